"""Device placement on CUDA (marked gpu: skipped where there is no CUDA device). The dtype
identities run on CUDA too, in test_half_precision.py."""

from __future__ import annotations

import pytest
import torch

from bench.prefill import main
from bench.staging import StoreBench
from kvservice.blend.prefill import blend_prefill
from kvservice.model.families import ModelConfig
from kvservice.model.transformer import Transformer, precompute_chunks, precompute_head
from kvservice.tools.synthetic import SYNTHETIC_CONFIGS, random_model

from .conftest import TINY_COMMON

pytestmark = pytest.mark.gpu

TINY = {"model_type": "llama", **TINY_COMMON}


@pytest.fixture(scope="module")
def prompt():
    gen = torch.Generator().manual_seed(7)
    head = torch.randint(0, 128, (5,), generator=gen).tolist()
    chunks = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (12, 40, 9, 14)]
    question = torch.randint(0, 128, (6,), generator=gen).tolist()
    return head, chunks, question


def test_random_weights_are_made_on_the_device():
    before = torch.cuda.memory_allocated()
    model = random_model(ModelConfig.from_hf_config(TINY), dtype=torch.bfloat16, device="cuda")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.inv_freq.device.type == "cuda" and model.inv_freq.dtype == torch.float32
    assert torch.cuda.memory_allocated() - before >= weights


def test_every_mode_on_cuda_equals_cpu_in_float32(tiny_checkpoints, prompt):
    head, chunks, question = prompt
    results = {}
    for device in ("cpu", "cuda"):
        model = Transformer.from_pretrained(tiny_checkpoints["llama"], device=device)
        kvs = precompute_chunks(model, head, chunks)  # computed on the device, kept on the host
        assert all(c.k.device.type == "cpu" for c in kvs)
        head_kv = precompute_head(model, head)
        for mode in ("full", "prefix", "reuse", "blend"):
            # blend's slots fixed: a near tie in the attention must not pick other tokens
            result = blend_prefill(
                model,
                head,
                kvs,
                question,
                mode=mode,
                head_kv=head_kv,
                recompute_slots=list(range(20, 35)) if mode == "blend" else None,
            )
            assert result.cache.k.device.type == device == result.logits.device.type
            results[device, mode] = result.logits.cpu()
    for mode in ("full", "prefix", "reuse", "blend"):
        # float32 on both; CUDA kernels sum in another order (TF32 is off by default)
        torch.testing.assert_close(
            results["cuda", mode], results["cpu", mode], atol=1e-4, rtol=1e-4
        )


@pytest.mark.parametrize("loader_device", ["cpu", "cuda"])
def test_chunks_loaded_from_the_store_reach_the_cuda_cache(tiny_checkpoints, prompt, loader_device):
    head, chunks, question = prompt
    model = Transformer.from_pretrained(
        tiny_checkpoints["llama"], device="cuda", dtype=torch.bfloat16
    )
    kvs = precompute_chunks(model, head, chunks)
    in_memory = blend_prefill(model, head, kvs, question, mode="reuse")
    environ = {"KV_STORE_DTYPE": "bfloat16", "KV_CODEC": "fp16"}
    bench = StoreBench("cpu", environ=environ, device=loader_device)
    try:
        bench.stage(kvs)
        loaded = blend_prefill(model, head, bench.sources(kvs, "reuse"), question, mode="reuse")
    finally:
        bench.close()
    assert loaded.cache.k.device.type == "cuda"
    torch.testing.assert_close(loaded.logits, in_memory.logits, atol=0, rtol=0)


def test_a_cuda_loader_decodes_the_codec_on_the_device_as_the_host_does(tiny_checkpoints, prompt):
    """The stored bytes cross to the device and are decoded there (kvservice.store.loader):
    the layers equal the host's decoding of the same objects, up to float rounding."""
    head, chunks, _ = prompt
    model = Transformer.from_pretrained(tiny_checkpoints["llama"], device="cuda")
    kvs = precompute_chunks(model, head, chunks)
    environ = {"KV_CODEC": "kivi4k3v-v4early"}
    layers = {}
    for device in ("cpu", "cuda"):
        bench = StoreBench("disk", environ=environ, device=device)
        try:
            bench.stage(kvs)
            sources = bench.sources(kvs, "reuse")
            assert all(source is not None for source in sources)  # every chunk read
            layers[device] = [s.layer(i) for s in sources for i in range(model.config.n_layers)]
        finally:
            bench.close()
    for (k_cpu, v_cpu), (k_cuda, v_cuda) in zip(layers["cpu"], layers["cuda"], strict=True):
        assert k_cpu.device.type == "cpu" and k_cuda.device.type == "cuda"
        torch.testing.assert_close(k_cuda.cpu(), k_cpu, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(v_cuda.cpu(), v_cpu, rtol=1e-3, atol=1e-3)


def test_the_synthetic_bench_on_cuda_reports_peak_memory_per_mode(monkeypatch):
    monkeypatch.setitem(SYNTHETIC_CONFIGS, "tiny", TINY)
    report = main(
        [
            "--synthetic",
            "tiny",
            "--context",
            "400",
            "--chunks",
            "4",
            "--modes",
            "full,reuse,blend",
            "--repeats",
            "2",
            "--device",
            "cuda",
        ]
    )
    assert report["env"]["dtype"] == "bfloat16"  # the CUDA default
    memory = report["memory"]
    assert "max_memory_allocated" in memory["measure"]
    for m in report["modes"].values():
        assert m["peak_memory_bytes"] >= memory["baseline_bytes"] >= memory["weights_bytes"]


def _word_tokenizer():
    """A real tokenizer over the tiny models' 128 ids (``w0`` ... ``w127``)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words)


def _batch_tokens(model, tokenizer, prompt, budget) -> list[list[int]]:
    """Three answers (full, reuse, blend) through one batch, the later two arriving while
    the first streams; each answer's tokens (greedy, with a presence penalty so that the
    tiny random model does not say one token over and over)."""
    import threading
    import time

    from kvservice.blend.prefill import blend_prefill_steps
    from kvservice.model.sampling import SamplingParams
    from kvservice.serve.batcher import ContinuousBatcher, Job

    head, chunks, question = prompt
    kvs, head_kv = precompute_chunks(model, head, chunks), precompute_head(model, head)
    batcher = ContinuousBatcher(model, tokenizer, budget=budget).start()
    out: list[list[int]] = [[], [], []]
    done = [threading.Event() for _ in out]
    try:
        for index, mode in enumerate(("full", "reuse", "blend")):
            steps = lambda extra, mode=mode: blend_prefill_steps(  # noqa: E731
                model,
                head,
                kvs,
                question,
                mode=mode,
                head_kv=head_kv,
                chunk_ids=chunks,
                extra_capacity=extra,
                recompute_slots=list(range(20, 35)) if mode == "blend" else None,
            )
            batcher.submit(
                Job(
                    prefill=steps,
                    stop_ids=set(),
                    sampling=SamplingParams(max_tokens=12, presence_penalty=2.0),
                    on_token=lambda _t, token, index=index: out[index].append(token),
                    on_finish=lambda _r, _e, index=index: done[index].set(),
                )
            )
            time.sleep(0.05)
        assert all(event.wait(120) for event in done)
    finally:
        batcher.close()
    return out


def test_the_batch_on_cuda_with_recorded_passes_and_steps_answers_as_the_host(
    tiny_checkpoints, prompt
):
    """The stall-free batch on CUDA, passes and decode steps recorded as CUDA graphs and
    prefills sliced a layer a step while answers stream, gives the host's tokens."""
    from kvservice.blend.graphs import use_pass_graphs
    from kvservice.serve.batcher import StepBudget

    tokenizer = _word_tokenizer()
    got = {}
    for device in ("cpu", "cuda"):
        model = Transformer.from_pretrained(tiny_checkpoints["llama"], device=device)
        if device == "cuda":
            assert use_pass_graphs(model, capacity=256, record_after=0) is not None
        got[device] = _batch_tokens(model, tokenizer, prompt, StepBudget(0.0005))
        if device == "cuda":
            assert model.pass_graphs.failed is None and model.pass_graphs.replays > 0
    assert all(len(tokens) == 12 for tokens in got["cuda"])
    assert got["cuda"] == got["cpu"]
