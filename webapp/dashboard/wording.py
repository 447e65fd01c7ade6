"""The dashboard's figures in an operator's words: codecs as bit widths, the object store by
what it is, the running model's KV size a token, and the loading controller's last decision
as a sentence (the worker writes its own rule for engineers; the page says what it means)."""

from __future__ import annotations

import json
import re
from fractions import Fraction
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from django.conf import settings

from deploy.stack import read_stack_env
from kvservice.protocol.codecs import CODECS, FP8, INT8, RAW
from webapp.units import seconds

FP16_BYTES = 2  # the "16 bits" the stored KV's compression is measured against
# A converted GGUF model's folder ends with the file's identity (kvservice.model.gguf): not
# part of the model's name ("smollm2-135m-instruct-q4-1-5d9b714f3e2ca41e").
_IDENTITY_SUFFIX = re.compile(r"-[0-9a-f]{12,}$")


def model_name(name: str | None) -> str:
    """The model's name as an operator knows it (without a converted file's identity)."""
    return _IDENTITY_SUFFIX.sub("", name or "")


def same_model(one: str | None, other: str | None) -> bool:
    """Whether two names are of one model (a GGUF's quantization and identity aside: the
    bundled "smollm2-135m-instruct-q4-1-5d9b..." is the curve's "smollm2-135m-instruct")."""
    one, other = model_name(one).lower(), model_name(other).lower()
    return one == other or one.startswith(other + "-") or other.startswith(one + "-")


# --------------------------------------------------------------------------------------------
# Codecs


def codec_in_words(name: str | None, *, short: bool = False) -> str:
    """``kivi4k3v-v4early`` -> "4-bit keys, 3-bit values (4-bit values in the first 1/8 of
    the layers)", ``short`` "(early layers: 4-bit values)" (a chart legend's line); a name
    the store does not know is shown as it is."""
    codec = CODECS.get(name or "")
    if codec is None:
        return name or "—"
    if codec.kind == RAW:
        return "16-bit floats (not compressed)"
    if codec.kind in (INT8, FP8):
        return "8-bit integers" if codec.kind == INT8 else "8-bit floats"
    keys, values = codec.k_bits[-1][1], codec.v_bits[-1][1]
    exceptions = [
        f"{bits}-bit {what}"
        if short
        else f"{bits}-bit {what} in the first {Fraction(upto).limit_denominator(64)} of the layers"
        for what, schedule in (("keys", codec.k_bits), ("values", codec.v_bits))
        for upto, bits in schedule[:-1]
    ]
    words = f"{keys}-bit keys, {values}-bit values"
    if not exceptions:
        return words
    return f"{words} ({'early layers: ' if short else ''}{'; '.join(exceptions)})"


# --------------------------------------------------------------------------------------------
# The object store


def object_store_name() -> str:
    """The S3 tier as it is: the bundled SeaweedFS gateway when ``S3_ENDPOINT`` is the one
    the dev stack started (``DATA_DIR/stack.json``), else the endpoint's host."""
    endpoint = settings.S3_ENDPOINT
    if endpoint and endpoint == read_stack_env(Path(settings.DATA_DIR)).get("S3_ENDPOINT"):
        return "Object store (bundled SeaweedFS S3 gateway)"
    host = urlsplit(f"//{endpoint}").hostname if endpoint else None
    return f"Object store at {host}" if host else "Object store (S3)"


# --------------------------------------------------------------------------------------------
# The model's KV


def model_kv(heartbeat: dict[str, Any] | None) -> dict[str, Any]:
    """The KV a token costs at 16 bits for the model that runs: its shape from the inference
    worker's heartbeat, else the configured checkpoint's ``config.json`` (``MODEL_PATH``),
    else the ``KV_BYTES_PER_TOKEN`` setting; ``source`` says which."""
    beat = heartbeat or {}
    shape = beat.get("model_shape")
    if shape:
        return _kv_of(beat.get("model") or "the running model", shape, "running")
    shape = _configured_shape()
    if shape:
        return _kv_of(Path(settings.MODEL_PATH).name, shape, "configured")
    return {
        "name": None,
        "layers": None,
        "kv_heads": None,
        "head_dim": None,
        "fp16_bytes_per_token": settings.KV_BYTES_PER_TOKEN,
        "source": "setting",
    }


def _kv_of(name: str, shape: dict[str, int], source: str) -> dict[str, Any]:
    layers, heads, dim = shape["layers"], shape["kv_heads"], shape["head_dim"]
    return {
        "name": name,
        "layers": layers,
        "kv_heads": heads,
        "head_dim": dim,
        "fp16_bytes_per_token": 2 * layers * heads * dim * FP16_BYTES,
        "source": source,
    }


def _configured_shape() -> dict[str, int] | None:
    """Layers, KV heads and head size from the Hugging Face config of ``MODEL_PATH`` (None
    for the bundled model, a GGUF file, or an unreadable config)."""
    if not settings.MODEL_PATH:
        return None
    try:
        hf = json.loads((Path(settings.MODEL_PATH).expanduser() / "config.json").read_text())
        heads = hf["num_attention_heads"]
        return {
            "layers": hf["num_hidden_layers"],
            "kv_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        }
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


def stored_kv_check(heartbeat: dict[str, Any] | None) -> dict[str, Any] | None:
    """Whether the stored passages' KV can serve the running worker, from the check it made
    at start (its heartbeat's ``key_check``: why its chunk keys match none of the stored
    chunks', naming the setting that differs, or None): ``reused`` and the words to show.
    None where no worker reports, or one too old to check."""
    beat = heartbeat or {}
    if "key_check" not in beat:
        return None
    problem = beat["key_check"]
    if not problem:
        return {
            "reused": True,
            "headline": "Stored passages: reused",
            "detail": "at its start the worker found no setting that differs from those the "
            "stored passages' KV was computed with",
        }
    return {
        "reused": False,
        "headline": "Stored passages: not reused",
        "detail": problem,  # the worker's words: what differs, what it costs, what to set
    }


def key_prefix(fingerprint: str | None) -> str | None:
    """What the chunk keys of a model's KV start with (``ChunkKey.to_string``)."""
    return f"{quote(fingerprint, safe='')}/" if fingerprint else None


# --------------------------------------------------------------------------------------------
# The loading controller

SOURCE_WORDS = {
    "r_min": "the least share allowed",
    "target": "what the fidelity target asks",
    "auto": "matched to the loading time",
}


def decision_in_words(decision: dict[str, Any], throughput_now: float | None) -> str:
    """The controller's last choice as a sentence, from its figures (not its rule's text,
    which speaks of ``r_min``); a decision taken before the recompute speed was measured says
    so once, instead of "no measurement" beside the measurement."""
    why = decision.get("why") or {}
    ratio = decision.get("recompute_ratio") or 0.0
    floor = why.get("target_ratio") if decision.get("source") == "target" else why.get("r_min")
    share = f"{ratio:.0%} of the passages' tokens recomputed"
    reason = SOURCE_WORDS.get(decision.get("source"), "")
    load_s, full_s = decision.get("load_s_estimate"), why.get("full_recompute_s")
    break_even = why.get("break_even_ratio")
    if break_even is None:
        if full_s is None and throughput_now:
            return (
                f"{share} ({reason}): chosen before the worker had measured how fast it "
                "recomputes; the next question uses that measurement."
            )
        if full_s is None:
            return f"{share} ({reason}): the worker has not measured how fast it recomputes yet."
        tiers = ", ".join(why.get("unmeasured_tiers") or []) or "a tier"
        return f"{share} ({reason}): how fast {tiers} reads was not measured yet."
    if floor is not None and break_even <= floor:
        return (
            f"{share} ({reason}): reading the stored KV (about {seconds(load_s)}) finishes "
            "while they are recomputed."
        )
    if break_even < 1.0:
        return (
            f"{share}: reading the stored KV takes about {seconds(load_s)}, as long as "
            "recomputing that share, so the extra recompute adds no wait."
        )
    return (
        f"Every token recomputed: reading the stored KV (about {seconds(load_s)}) is slower "
        f"than recomputing all of it ({seconds(full_s)})."
    )
