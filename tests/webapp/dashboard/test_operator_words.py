"""The dashboard in an operator's words: no engineer's names or raw notes on the page, every
figure with its unit and meaning, the object store named as it is, and the per-token figures
of the model that runs (not the bundled model's constants)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from django.urls import reverse

from kvservice.blend.controller import LoadingController
from kvservice.model.kernels import KernelChoice
from kvservice.protocol.codecs import CODECS, DEFAULT_CODEC
from kvservice.protocol.heartbeat import heartbeat_key, write_heartbeat
from kvservice.store.buffers import BufferPool
from tests.webapp.dashboard.factories import make_answers, make_document
from webapp.dashboard import selectors
from webapp.documents.models import Chunk
from webapp.redis import redis_client

pytestmark = pytest.mark.django_db

# What a new operator found on the page and could not read (each seen on the real dashboard)
ENGINEERS_WORDS = [
    DEFAULT_CODEC,
    "kivi4k3v",
    "r_min",
    "r min",
    "token-layers",
    "teacher-forced",
    "CUDA graphs: off",
    "handed out again",
    "validation examples",
    "added to env by hand",
    "F1 columns",
    "MinIO",
    "no measurement of recompute throughput",
    "KV_CODEC=",
    "(--refresh",
]
SMOLLM2 = {"layers": 30, "kv_heads": 3, "head_dim": 64}


def _visible_text(html: str) -> str:
    """What the page shows: the text outside tags (attributes such as titles are not shown)."""
    html = re.sub(r"<(script|style)\b.*?</\1>", "", html, flags=re.DOTALL)
    html = re.sub(r"</?(strong|span|code|sub|em|a)\b[^>]*>", "", html)  # inside a line
    return " ".join(re.sub(r"<[^>]+>", " ", html).replace("&#x27;", "'").split())


def _heartbeat(store: dict, **beat) -> dict:
    """A heartbeat as ``NativeRuntime.status`` writes it: a real controller that decided its
    first question before it measured the recompute speed, real engine stats."""
    controller = LoadingController(r_min=0.15)
    controller.choose(num_tokens=1500, num_layers=30, load_bytes_by_tier={"cpu": 2**20})
    controller.observe_recompute(tokens=512, layers=30, seconds=0.02)  # 768,000 token-layers/s
    pool = BufferPool(limit_bytes=64 << 20)
    pool.empty((2, 1 << 20), torch.float32)
    pool.empty((2, 1 << 20), torch.float32)
    kernels = KernelChoice("onednn-bf16", "auto", {}, {}, True, torch.bfloat16).to_dict()
    return {
        "pid": 1,
        "model": "SmolLM2-135M-Instruct",
        "model_loaded": True,
        "store": store,
        "controller": controller.snapshot(),
        "kernels": kernels,
        "pass_graphs": {"on": False},
        "buffers": pool.stats(),
        "model_shape": SMOLLM2,
        **beat,
    }


def _page(client, beat: dict | None) -> str:
    if beat is not None:
        write_heartbeat(redis_client(), **beat)
    try:
        response = client.get(reverse("dashboard:index"))
        assert response.status_code == 200
        return response.content.decode()
    finally:
        redis_client().delete(heartbeat_key())


def test_the_page_has_none_of_the_engineers_names_or_raw_notes(
    staff_client, alice, worker_heartbeat, settings
) -> None:
    settings.RATIO_CURVE_PATH = settings.BASE_DIR / "docs" / "ratio_curve.json"  # 3 curves
    make_answers(alice, make_document(alice))
    store = {**worker_heartbeat["store"], "codec": DEFAULT_CODEC}
    store["tiers"] = [*store["tiers"], {**store["tiers"][-1], "name": "s3"}]  # the disk's stats
    text = _visible_text(_page(staff_client, _heartbeat(store)))
    found = [words for words in ENGINEERS_WORDS if words.lower() in text.lower()]
    assert found == [], found
    # in their place: the codec's bit widths, the decision said once, the store by its host
    assert "4-bit keys, 3-bit values (4-bit values in the first 1/8 of the layers)" in text
    assert "chosen before the worker had measured how fast it recomputes" in text
    assert "Object store at 127.0.0.1" in text  # the suite's gateway, started by itself
    # how each curve was measured, in words (its file's own note is the bench's)
    assert text.count("Measured on 2026-11-26, with smollm2-135m-instruct") == 2
    assert "compare its quality columns with the others, not its times" in text  # fp16's run


def test_every_figure_of_the_live_panel_has_its_unit_and_meaning(
    staff_client, worker_heartbeat
) -> None:
    page = _page(staff_client, _heartbeat(worker_heartbeat["store"]))
    inputs = _visible_text(page.split('id="controller-inputs"')[1].split("</table>")[0])
    assert "0.15 (15.0% of each passage's tokens)" in inputs
    assert "25,600 tokens a second" in inputs  # 768,000 token-layers/s over 30 layers
    meanings = _visible_text(page.split('id="controller-inputs"')[1].split("</dl>")[0])
    assert "through all its 30 layers, measured on blend answers" in meanings
    engine = _visible_text(page.split('id="engine-state"')[1].split("</dl>")[0])
    assert "off: each step's pieces are launched one by one" in engine
    assert "1 buffer kept (8 MiB); 1 of 2 requests for cache memory" in engine
    assert "(a prefill's, a batch's) were served from a kept buffer" in engine
    queues = _visible_text(page.split('id="queue-meanings"')[1].split("</dl>")[0])
    assert "tasks waiting for a worker" in queues and "ingest (uploaded files" in queues
    assert "The recompute ratio is the share of each passage's tokens" in _visible_text(page)


def test_the_object_store_is_named_as_it_is(staff_client, settings, tmp_path) -> None:
    beat = {"store": {"tiers": [{"name": "s3", "hits": 3, "misses": 0}]}}
    settings.S3_ENDPOINT = "minio.storage.svc:9000"  # an external endpoint: its host
    assert selectors.tier_rows(beat)[0]["label"] == "Object store at minio.storage.svc"
    settings.DATA_DIR = tmp_path  # the dev stack started the gateway on this endpoint
    (tmp_path / "stack.json").write_text(json.dumps({"S3_ENDPOINT": settings.S3_ENDPOINT}))
    label = "Object store (bundled SeaweedFS S3 gateway)"
    assert selectors.tier_rows(beat)[0]["label"] == label
    page = staff_client.get(reverse("dashboard:index")).content.decode()
    assert f"</span> {label}" in page  # the health check's line names it too
    assert "</span> object_store" not in page and "</span> celery_worker" not in page


def test_the_per_token_figures_are_the_running_models(staff_client, alice, worker_heartbeat):
    """Another model's shape in the heartbeat (Qwen3-4B: 36 layers, 8 KV heads of 128): its
    16-bit KV a token (144 KiB), not the bundled model's 22.5 KiB; and the KV an earlier model
    stored is counted apart, by the chunk keys' model fingerprint."""
    document = make_document(alice, chunks=3)  # 20 tokens a chunk, keys of another model
    Chunk.objects.filter(document=document).update(kv_bytes=20 * 2_880)
    qwen = {"layers": 36, "kv_heads": 8, "head_dim": 128}
    beat = _heartbeat(
        worker_heartbeat["store"], model="Qwen3-4B", model_shape=qwen, model_fingerprint="qwen3fp"
    )
    page = _page(staff_client, beat)
    kv = _visible_text(page.split('id="model-kv"')[1].split("</p>")[0])
    assert "In 16 bits a token takes 144 KiB for Qwen3-4B: 36 layers × 8 KV heads" in kv
    assert "22.5 KiB" not in page
    row = _visible_text(page.split(f'id="dash-document-{document.pk}"')[1].split("</tr>")[0])
    assert "0 B + 3 passages stored for an earlier model" in row
    inputs = _visible_text(page.split('id="controller-inputs"')[1].split("</table>")[0])
    assert "21,333 tokens a second" in inputs  # 768,000 token-layers/s over 36 layers

    # once precomputed for it, the stored KV is the running model's, at its compression
    for chunk in Chunk.objects.filter(document=document):
        Chunk.objects.filter(pk=chunk.pk).update(kv_key=f"qwen3fp/_/{chunk.token_ids_sha256}")
    stored = _visible_text(_page(staff_client, beat).split('id="stored-kv"')[1].split("</p>")[0])
    assert "KV stored for Qwen3-4B: 169 KiB for 60 tokens of text" in stored
    assert "51.20× less than in 16 bits (144 KiB a token)" in stored  # 147,456 / 2,880


def test_without_a_heartbeat_the_configured_models_figures_are_shown(
    staff_client, settings, tmp_path
) -> None:
    model = tmp_path / "Llama-3.2-1B"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 16,
                "hidden_size": 2048,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
            }
        )
    )
    settings.MODEL_PATH = str(model)
    kv = _visible_text(_page(staff_client, None).split('id="model-kv"')[1].split("</p>")[0])
    assert "32 KiB for Llama-3.2-1B (the configured model" in kv  # 2 x 16 x 8 x 64 x 2 B
    assert "16 layers × 8 KV heads × 64 values" in kv


def test_every_named_codec_reads_as_bit_widths() -> None:
    from webapp.dashboard import wording

    for name in CODECS:
        words = wording.codec_in_words(name)
        assert name not in words and "-bit" in words, (name, words)
    assert wording.codec_in_words("kivi4k3v") == "4-bit keys, 3-bit values"
    assert wording.codec_in_words("fp16") == "16-bit floats (not compressed)"
    short = wording.codec_in_words(DEFAULT_CODEC, short=True)
    assert short == "4-bit keys, 3-bit values (early layers: 4-bit values)"
    assert wording.codec_in_words("someone-elses") == "someone-elses"


def test_the_running_model_is_named_as_its_operator_knows_it() -> None:
    """The bundled model runs from a converted GGUF whose folder ends with the file's
    identity: the page named it so, and said the curve measured with the same model was
    another's."""
    from webapp.dashboard import wording

    bundled = "smollm2-135m-instruct-q4-1-5d9b714f3e2ca41e"
    assert wording.model_name(bundled) == "smollm2-135m-instruct-q4-1"
    assert wording.same_model("smollm2-135m-instruct", bundled)
    assert wording.same_model("Qwen3-4B", "qwen3-4b")
    assert not wording.same_model("smollm2-135m-instruct", "qwen3-4b")
    assert not wording.same_model("smollm2-1.7b", "smollm2-135m-instruct")


def test_the_last_serving_benchs_capacity_is_shown(staff_client, settings, tmp_path) -> None:
    """The newest serving bench report (by when it started, not by name) gives each mode's
    capacity and its all-at-once run; none: the page says how to measure one."""
    settings.SERVING_BENCH_DIR = tmp_path
    page = staff_client.get(reverse("dashboard:index")).content.decode()
    assert "No serving bench report yet" in page

    def report(started: str, blend_capacity: float | None) -> dict:
        burst = {
            "burst": 16,
            "rate_per_min": None,
            "answers_per_min": 45.48,
            "ttft_s": {"p95": 16.89},
            "max_pause_s": 1.74,
        }
        return {
            "bench": "serving",
            "started": started,
            "unloaded_blend": {"ttft_median_s": 0.893, "target_ttft_p95_s": 3.57},
            "modes": {
                "blend": {"capacity_per_min": blend_capacity, "runs": [burst]},
                "full": {"capacity_per_min": None, "runs": []},
            },
        }

    (tmp_path / "serving_b.json").write_text(json.dumps(report("20261127-090000", 3.0)))
    (tmp_path / "serving_a.json").write_text(json.dumps(report("20261128-200953", 8.0)))
    (tmp_path / "serving_c.json").write_text("{not json")  # skipped, not a 500
    text = _visible_text(staff_client.get(reverse("dashboard:index")).content.decode())
    section = text.split("Serving capacity", 1)[1].split("Workers and services", 1)[0]
    assert "2026-11-28 20:09" in section and "8 questions a minute" in section
    assert "3 questions a minute" not in section  # the older report
    assert "45.5 (16 questions)" in section and "16.89 s" in section and "1.74 s" in section
    assert "below the lowest rate tried" in section  # full: no capacity
    assert "within 3.57 s (4 times an answer's alone, 893.0 ms)" in section


def test_the_live_panel_says_whether_the_stored_passages_serve_the_running_worker(
    staff_client, worker_heartbeat
) -> None:
    """The worker's start check of its chunk keys against the stored chunks' (its heartbeat's
    ``key_check``), as the operator needs it: reused or not, and the setting that differs."""
    store = worker_heartbeat["store"]
    problem = (
        "the stored chunks were made with KV_PREAMBLE=on, this worker has KV_PREAMBLE=off: its "
        "chunk keys match none of them, so every passage's KV is computed again at each "
        "question, and none is reused (give ingest and the inference worker the same KV_PREAMBLE)"
    )

    def said(**beat) -> str | None:
        page = _page(staff_client, _heartbeat(store, **beat))
        if 'id="stored-kv-check"' not in page:
            return None
        return _visible_text(page.split('id="stored-kv-check"')[1].split("</p>")[0][1:])

    disagreeing = said(key_check=problem)
    assert disagreeing.startswith("Stored passages: not reused the stored chunks were made")
    assert "give ingest and the inference worker the same KV_PREAMBLE" in disagreeing
    agreeing = said(key_check=None)
    assert agreeing.startswith("Stored passages: reused at its start the worker found no")
    assert said() is None  # a worker too old to check says nothing either way
