"""Reads for the dashboard: the operator's settings, the inference worker's live state (its
heartbeat: tier stats and the loading controller), queue depths, and answer metrics."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db.models import Count, Q, Sum, Value
from django.db.models.functions import TruncHour
from django.utils import timezone

from kvservice.protocol.codecs import DEFAULT_CODEC, configured_codec
from kvservice.protocol.curve import (
    CurveSeries,
    bench_command,
    load_series,
    series_path,
    series_paths,
)
from kvservice.protocol.environment import read
from kvservice.protocol.heartbeat import read_heartbeat
from kvservice.protocol.ratio import TARGET, RatioPlan, RatioSetting, plan_ratios
from webapp.chat.models import Message
from webapp.dashboard import wording
from webapp.dashboard.models import DashboardSettings, FidelityAudit
from webapp.documents.models import Chunk, Document
from webapp.redis import redis_client

QUEUES = ("answers", "ingest", "kv", "inference")
# fastest first, as the store lists them; a worker with KV_SOURCE=kdn has the knowledge
# delivery API in S3's place
TIER_ORDER = ("device", "cpu", "disk", "s3", "kdn")
# (S3's label is the store's own name: tier_label)
TIER_LABELS = {
    "device": "GPU memory",
    "cpu": "CPU memory",
    "disk": "Local disk",
    "kdn": "Knowledge delivery API",
}
WARMABLE_TIERS = ("device", "cpu", "disk")


def dashboard_settings() -> DashboardSettings:
    """The settings row, created with its defaults on first use."""
    row, _ = DashboardSettings.objects.get_or_create(pk=DashboardSettings.SINGLETON_PK)
    return row


def _while_mode(mode: str, field: str) -> float | None:
    """A setting that holds only while the controller is in ``mode`` (None otherwise)."""
    row = (
        DashboardSettings.objects.filter(pk=DashboardSettings.SINGLETON_PK)
        .values_list("controller_mode", field)
        .first()
    )
    return None if row is None or row[0] != mode else row[1]


def fixed_recompute_ratio() -> float | None:
    """The admin's fixed recompute ratio, or None while the worker's controller decides."""
    return _while_mode(DashboardSettings.ControllerMode.FIXED, "fixed_recompute_ratio")


def fidelity_target() -> float | None:
    """The operator's fidelity target (mean KL to full prefill at most this), or None while
    the mode is not "target"."""
    return _while_mode(DashboardSettings.ControllerMode.TARGET, "fidelity_target")


def ratio_setting(row: DashboardSettings | None = None) -> RatioSetting:
    """The operator's recompute-ratio setting, as ``kvservice.protocol.ratio`` reads it."""
    row = row or dashboard_settings()
    return RatioSetting(
        mode=row.controller_mode,
        fixed_ratio=row.fixed_recompute_ratio,
        fidelity_target=row.fidelity_target,
        refresh_ratio=row.refresh_ratio,
    )


def ratio_plan(
    target: float | None = None,
    curve: dict[str, Any] | None = None,
    model_fingerprint: str | None = None,
) -> RatioPlan:
    """What the operator's setting asks of each request (``kvservice.protocol.ratio.plan_ratios``,
    the decision the worker's planner takes up): with ``target``, that fidelity target's plan
    whatever the mode; on the curve of the codec the store writes (``curve``, else
    :func:`ratio_curve`'s) and the running model (``model_fingerprint``, else the heartbeat's:
    a curve measured on another model is not read)."""
    setting = ratio_setting()
    if target is not None:
        setting = replace(setting, mode=TARGET, fidelity_target=target)
    if setting.mode != TARGET:
        return plan_ratios(setting, None)
    curve = ratio_curve() if curve is None else curve
    if model_fingerprint is None:
        model_fingerprint = (worker_heartbeat() or {}).get("model_fingerprint")
    return plan_ratios(setting, curve["current"], model_fingerprint, curve["command"])


def target_plan(
    target: float | None = None, curve: dict[str, Any] | None = None
) -> tuple[float | None, float | None]:
    """(ratio, refresh ratio) for the fidelity target (the operator's unless ``target`` is
    given): the least first-token ratio that reaches it, by plain blend or by progressive
    blend upgrading to the operator's progressive setting (None where plain blend is cheaper or
    nothing upgrades); (None, None) without a target or a curve for the store's codec and the
    running model, when the worker's controller decides as in auto (:func:`ratio_plan`)."""
    plan = ratio_plan(target, curve)
    return plan.target_ratio, plan.target_refresh


def target_ratio(target: float | None = None) -> float | None:
    """The first-token ratio of :func:`target_plan`."""
    return target_plan(target)[0]


def request_ratios() -> dict[str, float | None]:
    """What each chat request carries from the operator's settings (``GenerateRequest``'s
    fields ``recompute_ratio``, ``target_ratio``, ``refresh_ratio``: :func:`ratio_plan`)."""
    return ratio_plan().request_fields()


def audit_sample_rate() -> float:
    rate = (
        DashboardSettings.objects.filter(pk=DashboardSettings.SINGLETON_PK)
        .values_list("audit_sample_rate", flat=True)
        .first()
    )
    return rate or 0.0


def store_codec() -> str:
    """The codec the store writes new chunk KV in (``KV_CODEC``, ``KV_QUANTIZE``), as the
    workers' ``StoreConfig`` reads it."""
    return configured_codec(read("KV_CODEC"), read("KV_QUANTIZE"))


def ratio_curve(running_model: str | None = None) -> dict[str, Any]:
    """The quality/speed curves the bench measured, one ``series`` per codec of the stored
    KV (the JSON at ``RATIO_CURVE_PATH`` and its siblings ``<stem>_<codec>.json``; the
    store's codec first, the first file of a codec kept); ``codec``: the one the store
    writes, and ``points``: its series' (None while it has not been measured), which the
    fidelity target and the audit's predictions read; the ``error`` reading them; the
    ``command`` that measures the store's codec's curve; ``current``: the store's codec's
    :class:`CurveSeries` (None while unmeasured); ``measured``: a line a series on
    how it was measured (the files' own notes are the bench's, for engineers)."""
    path = Path(settings.RATIO_CURVE_PATH)
    errors: list[str] = []
    try:
        codec: str | None = store_codec()
    except ValueError as err:  # a bad KV_CODEC: the dashboard says so, never a 500
        codec = None
        errors.append(str(err))
    series: list[CurveSeries] = []
    conditions: dict[str, dict[str, Any]] = {}
    for one_path in series_paths(path):
        try:
            one = load_series(one_path)
        except (OSError, ValueError) as err:
            errors.append(str(err))
            continue
        if one is not None and all(s.codec != one.codec for s in series):
            series.append(replace(one, path=str(_shown(one_path))))
            conditions[one.codec] = _conditions(one_path, one.note)
    series.sort(key=lambda one: one.codec != codec)  # stable: the rest in file order
    current = next((one for one in series if one.codec == codec), None)
    return {
        "measured": _how_measured(series, conditions, running_model),
        "path": str(_shown(path)),
        "series": series,
        "codec": codec,
        "points": current.points if current else None,
        "current": current,
        "error": "; ".join(errors) or None,
        "command": bench_command(
            str(_shown(series_path(path, codec or DEFAULT_CODEC, DEFAULT_CODEC))), codec
        ),
    }


MEASURED_ON = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def _conditions(path: Path, note: str | None) -> dict[str, Any]:
    """Where and how a curve was measured, from its bench JSON's ``env`` (and the date its
    note gives)."""
    try:
        env = json.loads(path.read_text()).get("env") or {}
    except (OSError, ValueError, AttributeError):
        env = {}
    date = MEASURED_ON.search(note or "")
    return {
        "date": date.group() if date else None,
        "model": Path(str(env.get("model") or "")).name or None,
        "questions": env.get("examples"),
        "threads": env.get("threads"),
        "device": str(env.get("device") or "cpu").upper(),
    }


def _how_measured(
    series: list[CurveSeries], conditions: dict[str, dict[str, Any]], running_model: str | None
) -> list[dict[str, str]]:
    """One plain line a curve: its codec in words, when, with which model, over how many
    questions, on what; a warning where its times were taken with other threads than the
    first curve's (compare its quality, not its times) or another model than the running one."""
    lines = []
    first = conditions.get(series[0].codec, {}) if series else {}
    for one in series:
        found = conditions.get(one.codec, {})
        parts = [
            f"on {found['date']}" if found.get("date") else None,
            f"with {found['model']}" if found.get("model") else None,
            f"over {found['questions']} questions" if found.get("questions") else None,
            f"on {found['device']} with {found['threads']} thread"
            f"{'' if found['threads'] == 1 else 's'}"
            if found.get("threads")
            else None,
        ]
        text = "Measured " + ", ".join(p for p in parts if p) if any(parts) else "Measured"
        if found.get("threads") and found.get("threads") != first.get("threads"):
            text += (
                ". Its times were taken with other threads than the first curve's: compare "
                "its quality columns with the others, not its times"
            )
        model = found.get("model")
        if model and running_model and not wording.same_model(model, running_model):
            running = wording.model_name(running_model)
            text += f". The model that runs now is {running}: these figures are {model}'s"
        lines.append(
            {"codec": one.codec, "words": wording.codec_in_words(one.codec), "text": text + "."}
        )
    return lines


def _shown(path: Path) -> Path:
    return path.relative_to(settings.BASE_DIR) if path.is_relative_to(settings.BASE_DIR) else path


# --------------------------------------------------------------------------------------------
# Live state: the inference worker's heartbeat, queues


def worker_heartbeat() -> dict[str, Any] | None:
    """The inference worker's last heartbeat (None when it is dead or Redis is down)."""
    try:
        return read_heartbeat(redis_client())
    except Exception:  # noqa: BLE001 - the dashboard shows "no heartbeat", never a 500
        return None


def tier_label(name: str) -> str:
    """A tier as the operator knows it; the S3 tier by the store it is."""
    return wording.object_store_name() if name == "s3" else TIER_LABELS.get(name, name)


def _hit_rate(hits: int, misses: int) -> float | None:
    return hits / (hits + misses) if hits + misses else None


def tier_rows(heartbeat: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One row per tier of the worker's store (``TieredStore.stats().to_dict()``), fastest
    first, with the hit rate and the share of capacity used worked out."""
    store = (heartbeat or {}).get("store") or {}
    rows = []
    for tier in store.get("tiers") or []:
        capacity, used = tier.get("capacity_bytes"), tier.get("bytes")
        rows.append(
            {
                **tier,
                "label": tier_label(tier["name"]),
                "hit_rate": _hit_rate(tier.get("hits", 0), tier.get("misses", 0)),
                "used_fraction": used / capacity if capacity and used is not None else None,
            }
        )
    order = {name: i for i, name in enumerate(TIER_ORDER)}
    return sorted(rows, key=lambda row: order.get(row["name"], len(order)))


def warmable_tiers(heartbeat: dict[str, Any] | None) -> list[str]:
    """The worker's local tiers (those a document can be warmed into), fastest first."""
    names = [row["name"] for row in tier_rows(heartbeat) if row["name"] in WARMABLE_TIERS]
    return names or ["cpu", "disk"]


def queue_depths() -> dict[str, int | None]:
    """Messages waiting in each Celery queue (a Redis list per queue)."""
    try:
        client = redis_client()
        return {name: client.llen(name) for name in QUEUES}
    except Exception:  # noqa: BLE001
        return dict.fromkeys(QUEUES)


def live_state() -> dict[str, Any]:
    """Everything the live (polled) panel shows."""
    heartbeat = worker_heartbeat()
    store = (heartbeat or {}).get("store") or {}
    controller = (heartbeat or {}).get("controller") or None
    return {
        "heartbeat": heartbeat,
        "heartbeat_age_s": time.time() - heartbeat["ts"] if heartbeat else None,
        "tiers": tier_rows(heartbeat),
        "store": store,
        "controller": controller,
        "controller_inputs": controller_inputs(heartbeat),
        "queues": queue_depths(),
        "model_kv": wording.model_kv(heartbeat),
        "stored_kv_check": wording.stored_kv_check(heartbeat),
        "codec_words": wording.codec_in_words(store.get("codec")),
    }


def controller_inputs(heartbeat: dict[str, Any] | None) -> dict[str, Any]:
    """The loading controller's measured inputs, from its snapshot and its last decision,
    with the recompute speed in tokens a second where the model's layers are known."""
    controller = (heartbeat or {}).get("controller") or {}
    decision = controller.get("last_decision") or {}
    bandwidth = controller.get("tier_bandwidth_bytes_per_s") or {}
    order = {name: i for i, name in enumerate(TIER_ORDER)}
    throughput = controller.get("recompute_token_layers_per_s")
    layers = ((heartbeat or {}).get("model_shape") or {}).get("layers")
    return {
        "tier_bandwidth": [
            (tier_label(name), speed)
            for name, speed in sorted(bandwidth.items(), key=lambda kv: order.get(kv[0], 99))
        ],
        "recompute_token_layers_per_s": throughput,
        "recompute_tokens_per_s": throughput / layers if throughput and layers else None,
        "layers": layers,
        "r_min": controller.get("r_min"),
        "decision": decision or None,
        "decision_words": wording.decision_in_words(decision, throughput) if decision else None,
        "decision_source": wording.SOURCE_WORDS.get(decision.get("source"), decision.get("source")),
        "cheapest_hidden_tier": tier_label(decision["cheapest_hidden_tier"])
        if decision.get("cheapest_hidden_tier")
        else None,
    }


# --------------------------------------------------------------------------------------------
# Documents and their caches


def documents_with_cache_counts(
    limit: int = 100, *, fingerprint: str | None = None
) -> list[Document]:
    """Documents (every owner's) with their chunk and ready-KV counts and the bytes their KV
    objects take as stored (a chunk shared by two documents counts in both), newest first.
    With the running model's ``fingerprint``, the bytes are those stored for that model, and
    ``kv_other_count`` counts the chunks whose KV an earlier model stored."""
    prefix = wording.key_prefix(fingerprint)
    ready = Q(chunks__kv_status=Chunk.KVStatus.READY)
    if prefix:
        mine = Q(chunks__kv_key__startswith=prefix)
        by_model = {
            "kv_bytes": Sum("chunks__kv_bytes", filter=mine),
            "kv_other_count": Count("chunks", filter=ready & ~Q(chunks__kv_key="") & ~mine),
        }
    else:  # the model is not known: every stored byte counts
        by_model = {"kv_bytes": Sum("chunks__kv_bytes"), "kv_other_count": Value(0)}
    return list(
        Document.objects.select_related("owner")
        .annotate(
            chunk_count=Count("chunks"), kv_ready_count=Count("chunks", filter=ready), **by_model
        )
        .order_by("-created_at", "-id")[:limit]
    )


def stored_kv_summary(model_kv: dict[str, Any], fingerprint: str | None = None) -> dict[str, Any]:
    """The KV objects stored for every user's chunks, each once (only the running model's,
    given its ``fingerprint``): bytes as stored (their codecs'), the tokens they hold, bytes a
    token, and the compression against the model's 16 bits a value (``model_kv``)."""
    from webapp.documents.quotas import stored_kv

    prefix = wording.key_prefix(fingerprint)
    chunks = Chunk.objects.filter(kv_key__startswith=prefix) if prefix else Chunk.objects.all()
    nbytes, tokens = stored_kv(chunks)
    per_token = nbytes / tokens if tokens and nbytes else None
    fp16 = model_kv["fp16_bytes_per_token"]
    return {
        "bytes": nbytes,
        "tokens": tokens,
        "bytes_per_token": per_token,
        "fp16_bytes_per_token": fp16,
        "compression_ratio": fp16 / per_token if per_token else None,
    }


def document_kv_keys(*, document: Document) -> list[str]:
    """The distinct KV keys of a document's chunks (identical chunks share one)."""
    return sorted(set(document.chunks.exclude(kv_key="").values_list("kv_key", flat=True)))


# --------------------------------------------------------------------------------------------
# Metrics


def answered_messages(*, since: datetime, limit: int = 2000) -> list[Message]:
    """Finished answers with a measured TTFT since ``since``, oldest first."""
    return list(
        Message.objects.filter(
            role=Message.Role.ASSISTANT,
            status=Message.Status.DONE,
            ttft_s__isnull=False,
            completed_at__gte=since,
        )
        .only(
            "id",
            "mode",
            "ttft_s",
            "ttft_seen_s",
            "total_s",
            "recompute_ratio",
            "refresh_ratio",
            "second_token_s",
            "tiers",
            "completed_at",
        )
        .order_by("-completed_at")[:limit]
    )[::-1]


def questions_per_hour(
    *, hours: int = 24, now: datetime | None = None
) -> list[tuple[datetime, int]]:
    """User questions per hour over the last ``hours`` hours (every hour, zeros included)."""
    now = now or timezone.now()
    end = now.replace(minute=0, second=0, microsecond=0)
    start = end - timedelta(hours=hours - 1)
    counts = dict(
        Message.objects.filter(role=Message.Role.USER, created_at__gte=start)
        .annotate(hour=TruncHour("created_at"))
        .values("hour")
        .annotate(n=Count("id"))
        .values_list("hour", "n")
    )
    return [
        (start + timedelta(hours=i), counts.get(start + timedelta(hours=i), 0))
        for i in range(hours)
    ]


def metrics_summary(messages: list[Message]) -> list[dict[str, Any]]:
    """Per mode: answers, median and p90 TTFT (the users' and the worker's), mean recompute
    ratio, tier mix, and of the
    answers progressive blend upgraded, how many and their second token's median time."""
    by_mode: dict[str, list[Message]] = {}
    for message in messages:
        by_mode.setdefault(message.mode or "?", []).append(message)
    rows = []
    for mode, items in sorted(by_mode.items()):
        ttfts = sorted(m.ttft_s for m in items if m.ttft_s is not None)
        seen = sorted(m.ttft_seen_s for m in items if m.ttft_seen_s is not None)
        ratios = [m.recompute_ratio for m in items if m.recompute_ratio is not None]
        upgraded = [m for m in items if m.refresh_ratio is not None]
        seconds = sorted(m.second_token_s for m in upgraded if m.second_token_s is not None)
        tiers: Counter[str] = Counter()
        for m in items:
            tiers.update(m.tiers or {})
        rows.append(
            {
                "mode": mode,
                "answers": len(items),
                "ttft_p50": _quantile(ttfts, 0.5),
                "ttft_p90": _quantile(ttfts, 0.9),
                "seen_p50": _quantile(seen, 0.5),
                "seen_p90": _quantile(seen, 0.9),
                "mean_ratio": sum(ratios) / len(ratios) if ratios else None,
                "progressive": len(upgraded),
                "second_token_p50": _quantile(seconds, 0.5),
                "tiers": dict(tiers.most_common()),
            }
        )
    return rows


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def fidelity_audits(*, since: datetime, limit: int = 500) -> list[FidelityAudit]:
    return list(
        FidelityAudit.objects.filter(created_at__gte=since).order_by("-created_at")[:limit]
    )[::-1]


def last_serving_bench() -> dict[str, Any] | None:
    """The newest serving bench report under ``SERVING_BENCH_DIR`` (``serving_*.json``, by
    when it started): per mode, its capacity (questions a minute) and its run with every
    question at once; None when there is none or none can be read."""
    newest: dict[str, Any] | None = None
    for path in sorted(Path(settings.SERVING_BENCH_DIR).glob("serving_*.json")):
        try:
            report = json.loads(path.read_text())
            started = datetime.strptime(report["started"], "%Y%m%d-%H%M%S")
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if report.get("bench") != "serving" or (newest and started <= newest["started"]):
            continue
        newest = {"started": started, "path": _shown(path), "report": report}
    if newest is None:
        return None
    report = newest.pop("report")
    unloaded = report.get("unloaded_blend") or {}
    newest["target_ttft_s"] = unloaded.get("target_ttft_p95_s")
    newest["unloaded_ttft_s"] = unloaded.get("ttft_median_s")
    newest["modes"] = [
        {
            "mode": mode,
            "capacity_per_min": entry.get("capacity_per_min"),
            "burst": next((run for run in entry.get("runs", []) if run.get("burst")), None),
        }
        for mode, entry in (report.get("modes") or {}).items()
    ]
    return newest
