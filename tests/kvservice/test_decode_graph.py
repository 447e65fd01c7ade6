"""The decode step a CUDA graph records (kvservice.model.decode_graph): on the CPU it is held
to ``Transformer.forward``, and checked to be recordable (nothing read back on the host, the
same operators on the same shapes every step)."""

from __future__ import annotations

import pytest
import torch

from kvservice.model.decode_graph import (
    STABLE_STEPS,
    DecodeGraph,
    DecodeInputs,
    static_decode_step,
)
from kvservice.model.transformer import KVCache, Transformer

from .test_graphs import WAITS, OffDevice, _Ops


def _ragged_batch(model, capacity):
    """Two rows prefilled with 23 and 17 tokens (the second padded), as the batcher merges
    them, into two equal caches: the caches, the rows' next tokens and positions."""
    gen = torch.Generator().manual_seed(5)
    device = model.device
    caches = [KVCache(model.config, 2, capacity, device, model.cache_dtype) for _ in range(2)]
    ids = torch.randint(0, 128, (2, 23), generator=gen)
    valid = torch.ones(2, 23, dtype=torch.bool)
    valid[1, 17:] = False  # the shorter row's padding
    positions = torch.arange(23).expand(2, 23).clone()
    positions[1, 17:] = 0
    for cache in caches:
        model(ids.to(device), positions.to(device), cache, valid=valid.to(device))
    return caches, torch.tensor([3, 9], device=device), torch.tensor([23, 17], device=device)


def test_the_static_step_gives_forwards_logits_and_cache(tiny_llama):
    """Step after step (the graph's own steps on the CPU: nothing is recorded there)."""
    (engine, ours), tokens, positions = _ragged_batch(tiny_llama, capacity=40)
    decoder = DecodeGraph(tiny_llama, ours)
    assert not decoder.record  # the CPU
    for _ in range(5):
        want, _ = tiny_llama(tokens[:, None], positions[:, None], engine)
        got = decoder.step(tokens, positions)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert ours.length == engine.length
        n = engine.length
        torch.testing.assert_close(ours.k[..., :n, :], engine.k[..., :n, :], atol=1e-6, rtol=1e-6)
        assert torch.equal(ours.valid, engine.valid) and torch.equal(
            ours.positions, engine.positions
        )
        tokens, positions = want.argmax(-1), positions + 1
    assert decoder.steps == 5 and decoder.replays == 0


def test_the_step_never_waits_and_runs_the_same_operators_each_step(tiny_llama):
    (cache, _), tokens, positions = _ragged_batch(tiny_llama, capacity=40)
    inputs = DecodeInputs.empty(2, tiny_llama.device)
    runs = []
    for step in range(2):
        inputs.tokens.copy_(tokens + step)
        inputs.positions.copy_(positions + step)
        inputs.slot.fill_(cache.length)
        with _Ops() as ops:
            static_decode_step(tiny_llama, cache, inputs)
        cache.length += 1
        runs.append(ops.seen)
    assert not {name for name, _ in runs[0]} & WAITS
    assert runs[0] == runs[1] and len(runs[0]) > 10 * tiny_llama.config.n_layers


def test_the_step_runs_on_the_models_device_alone(meta_model):
    """No operator of the step touches a tensor on the host (``OffDevice``), as recording
    on a GPU needs."""
    cache = KVCache(meta_model.config, 2, 40, meta_model.device, meta_model.cache_dtype)
    cache.length = 23
    inputs = DecodeInputs.empty(2, meta_model.device)
    with OffDevice("meta") as off:
        logits = static_decode_step(meta_model, cache, inputs)
    assert off.seen == [] and logits.shape == (2, meta_model.config.vocab_size)


def test_a_full_cache_or_replaced_tensors_are_refused(tiny_llama):
    (cache, _), tokens, positions = _ragged_batch(tiny_llama, capacity=24)
    decoder = DecodeGraph(tiny_llama, cache)
    decoder.step(tokens, positions)
    with pytest.raises(RuntimeError, match="full"):
        decoder.step(tokens, positions + 1)
    cache.length -= 1
    cache.k = cache.k.clone()  # what dropping a finished row does
    with pytest.raises(RuntimeError, match="replaced"):
        decoder.step(tokens, positions)


@pytest.mark.gpu
def test_a_recorded_decode_step_replays_forwards_steps_on_cuda(tiny_checkpoints):
    model = Transformer.from_pretrained(tiny_checkpoints["llama"], device="cuda")
    (engine, ours), tokens, positions = _ragged_batch(model, capacity=40)
    decoder = DecodeGraph(model, ours)
    for _ in range(6):
        want, _ = model(tokens[:, None], positions[:, None], engine)
        torch.testing.assert_close(decoder.step(tokens, positions), want, atol=1e-4, rtol=1e-4)
        tokens, positions = want.argmax(-1), positions + 1
    assert DecodeGraph.failed is None and decoder.graph is not None
    assert decoder.replays == 6 - STABLE_STEPS


def test_a_failed_recording_leaves_the_steps_running(tiny_llama, monkeypatch):
    """Recording asked for where it cannot happen (no CUDA here): the steps go on as they
    are, and no later cache tries again."""
    monkeypatch.setattr(DecodeGraph, "failed", None)
    (engine, ours), tokens, positions = _ragged_batch(tiny_llama, capacity=40)
    decoder = DecodeGraph(tiny_llama, ours, record=True)
    for _ in range(STABLE_STEPS + 2):
        want, _ = tiny_llama(tokens[:, None], positions[:, None], engine)
        torch.testing.assert_close(decoder.step(tokens, positions), want, atol=1e-5, rtol=1e-5)
        tokens, positions = want.argmax(-1), positions + 1
    assert DecodeGraph.failed and decoder.graph is None and not decoder.record
    later = DecodeGraph(tiny_llama, engine, record=True)
    for _ in range(STABLE_STEPS + 1):  # past the step it would record on
        later.step(tokens, positions)
        positions = positions + 1
    assert not later.record and later.graph is None
