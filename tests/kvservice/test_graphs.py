"""Recorded passes (kvservice.blend.graphs): the static pass a CUDA graph records, checked on
the CPU against the engine's own pass, and checked to be recordable (no host waits, nothing
whose shape or sequence depends on a request)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvservice.blend.graphs import (
    KEY_STEP,
    MAX_ROWS,
    PassGraphs,
    PassInputs,
    _Recorded,
    static_pass,
    use_pass_graphs,
)
from kvservice.blend.prefill import BlendSettings, _read_layers, blend_prefill, warm_graphs
from kvservice.model.transformer import Transformer, precompute_chunks, precompute_head

ATOL = 1e-4


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    """A model of this module's own: the graphs it is given stay out of other tests."""
    model = Transformer.from_pretrained(tiny_checkpoints["llama"], device="cpu")
    yield model
    model.pass_graphs = None


@pytest.fixture(scope="module")
def prompt(model):
    return _prompt(model, seed=11)


def _prompt(model, seed):
    """Head, chunks, question, the chunks' KV and the head's."""
    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(0, 128, (5,), generator=gen).tolist()
    chunks = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (40, 57, 33, 61)]
    question = torch.randint(0, 128, (9,), generator=gen).tolist()
    return (
        head,
        chunks,
        question,
        precompute_chunks(model, head, chunks),
        precompute_head(model, head),
    )


@dataclass
class Streamed:
    """A chunk handed out one layer at a time, as the store's loader does (not a ChunkKV,
    which is placed whole)."""

    token_ids: list[int]
    k: torch.Tensor
    v: torch.Tensor
    head_hash: str  # the head it was computed after

    @property
    def num_tokens(self) -> int:
        return self.k.shape[2]

    def layer(self, index: int):
        return self.k[index], self.v[index]


def _prefill(model, prompt, graphs, mode, streamed=False, head_kv=True, **kwargs):
    """``head_kv``: the head's KV given (else it is computed in pass 1, beside the question)."""
    head, chunks, question, kvs, head_cached = prompt
    kwargs["head_kv"] = head_cached if head_kv else None
    if streamed:
        kvs = [Streamed(kv.token_ids, kv.k, kv.v, kv.head_hash) for kv in kvs]
    model.pass_graphs = graphs
    try:
        return blend_prefill(model, head, kvs, question, mode=mode, chunk_ids=chunks, **kwargs)
    finally:
        model.pass_graphs = None


@pytest.mark.parametrize(
    "mode, streamed, head_kv, settings",
    [
        ("reuse", False, True, BlendSettings()),
        ("blend", False, True, BlendSettings()),
        ("blend", True, True, BlendSettings(stale_bias=-0.5)),
        ("blend", True, False, BlendSettings()),
        ("prefix", True, True, BlendSettings()),
    ],
)
def test_recorded_passes_give_the_engines_logits_cache_and_selection(
    model, prompt, mode, streamed, head_kv, settings
):
    kwargs = dict(settings=settings, extra_capacity=3)
    engine = _prefill(model, prompt, None, mode, streamed, head_kv, **kwargs)
    graphs = PassGraphs(model, capacity=512)
    got = _prefill(model, prompt, graphs, mode, streamed, head_kv, **kwargs)
    assert graphs.recorded, "no pass ran as a recorded one"
    torch.testing.assert_close(got.logits, engine.logits, atol=ATOL, rtol=ATOL)
    n = engine.num_tokens
    assert got.num_tokens == n and got.cache.capacity == engine.cache.capacity == n + 3
    assert got.cache is not graphs.cache  # the request keeps its own cache
    torch.testing.assert_close(
        got.cache.k[:, :, :, :n], engine.cache.k[:, :, :, :n], atol=ATOL, rtol=ATOL
    )
    torch.testing.assert_close(
        got.cache.v[:, :, :, :n], engine.cache.v[:, :, :, :n], atol=ATOL, rtol=ATOL
    )
    assert got.recomputed_per_layer == engine.recomputed_per_layer
    if mode == "blend":  # the same tokens selected by the same attention
        torch.testing.assert_close(
            got.question_attention, engine.question_attention, atol=1e-5, rtol=1e-4
        )
        assert got.recompute_ratio_effective == engine.recompute_ratio_effective > 0
        shapes = list(graphs.recorded)
        if head_kv:  # pass 1 computes the question only and records its attention
            assert [s.weigh_from is not None for s in shapes] == [True, False]
            assert shapes[0].until == _read_layers(model, settings)[1] and shapes[1].logits
        else:  # pass 1 computes the head beside the question: the engine's pass
            assert [s.weigh_from for s in shapes] == [None] and shapes[0].logits


def test_a_recorded_pass_never_waits_and_runs_the_same_operators_for_any_request(model, prompt):
    """What a CUDA graph needs: no value read back on the host (an ``item``, ``nonzero``),
    and for two different requests of one shape the same operators on the same shapes."""
    graphs = PassGraphs(model, capacity=512)
    question = prompt[2]
    shape = graphs.shape(len(question) + 20, 230, model.config.n_layers, 0, 0)
    runs = []
    for seed, num_tokens in ((0, 230), (1, 201)):
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 128, (num_tokens,), generator=gen)
        active = (
            torch.randperm(num_tokens - 1, generator=gen)[: len(question) + 19 - seed].sort().values
        )
        active = torch.cat([active, torch.tensor([num_tokens - 1])])
        inputs = PassInputs.empty(shape, graphs.scratch, model.device)
        bias = torch.randn(num_tokens, generator=gen) if seed else None
        inputs.fill(ids, active, num_tokens, graphs.scratch, bias, 0, model.config.n_heads)
        cache = graphs.begin(num_tokens)
        with _Ops() as ops:
            logits, _ = static_pass(model, cache, graphs.tables, inputs, shape)
        assert logits.shape == (model.config.vocab_size,) and torch.isfinite(logits).all()
        runs.append(ops.seen)
    assert not {name for name, _ in runs[0]} & WAITS
    assert runs[0] == runs[1] and len(runs[0]) > 10 * model.config.n_layers


# operators that read a value back on the host: a CUDA graph cannot record them
WAITS = {"_local_scalar_dense", "nonzero", "item", "is_nonzero", "equal", "masked_select"}


class _Ops(TorchDispatchMode):
    """The operators dispatched, with their outputs' shapes."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shapes = tuple(
            tuple(t.shape)
            for t in (out if isinstance(out, (list, tuple)) else [out])
            if isinstance(t, torch.Tensor)
        )
        self.seen.append((func._schema.name.removeprefix("aten::"), shapes))
        return out


class OffDevice(TorchDispatchMode):
    """Every operator whose tensors are not all on ``device`` (0-dim CPU scalars aside,
    which a kernel takes as a number): in a recorded pass such an operator is a copy between
    host and device, which a CUDA graph cannot record, or a host value frozen into it."""

    def __init__(self, device: str):
        super().__init__()
        self.device = torch.device(device)
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = torch.utils._pytree.tree_leaves((args, kwargs, out))
        if any(
            isinstance(t, torch.Tensor) and t.device != self.device and t.dim() > 0 for t in flat
        ):
            self.seen.append(func._schema.name)
        return out


@pytest.mark.parametrize("weigh", [False, True])
def test_a_recorded_pass_runs_on_the_models_device_alone(meta_model, weigh):
    """Reuse's pass (every layer, logits) and blend's first (the question's attention
    weighed): no operator of the pass touches a tensor on the host, as recording on a GPU
    needs. The inputs are filled beforehand, outside the recording."""
    graphs = PassGraphs(meta_model, capacity=512)
    layers = meta_model.config.n_layers
    shape = graphs.shape(9, 230, 2 if weigh else layers, 9 if weigh else 0, 1 if weigh else 0)
    inputs = PassInputs.empty(shape, graphs.scratch, meta_model.device)
    cache = graphs.begin(230)
    with OffDevice("meta") as off:
        logits, attention = static_pass(meta_model, cache, graphs.tables, inputs, shape)
    assert off.seen == []
    if weigh:
        assert logits is None and attention.shape == (2, shape.keys)
    else:
        assert logits.shape == (meta_model.config.vocab_size,) and attention is None
    with OffDevice("meta") as off:  # the check sees a host tensor where there is one
        cache.k[0, 0, :, torch.arange(3)]  # indexed by a host tensor: a copy on a GPU
    assert off.seen


def test_pass_shapes_pad_rows_to_powers_of_two_and_keys_to_a_step(model):
    graphs = PassGraphs(model, capacity=3000)
    layers = model.config.n_layers
    shape = graphs.shape(45, 2049, layers, 0, 0)
    assert (shape.rows, shape.keys, shape.logits, shape.weigh_from) == (
        64,
        5 * KEY_STEP,
        True,
        None,
    )
    assert graphs.shape(3, 100, 2, 3, 1) == graphs.shape(16, 512, 2, 16, 1)  # one recorded pass
    assert graphs.shape(3, 100, 2, 3, 1).weigh_from == 1
    assert [graphs.shape(n, 3000, layers, 0, 0).rows for n in (100, 129, 640, 641)] == [
        128,
        256,
        640,
        768,
    ]
    assert graphs.scratch >= 3000 and graphs.cache.capacity == graphs.scratch + 1
    # the engine's pass instead: too many rows, past capacity, the question recorded beside
    # other tokens
    assert graphs.shape(MAX_ROWS + 1, 3000, layers, 0, 0) is None
    assert graphs.shape(10, 3001, layers, 0, 0) is None
    assert graphs.shape(30, 400, layers, 9, 0) is None


def test_the_warm_up_records_the_passes_questions_then_find(model, prompt):
    """A worker's warm-up records reuse's and blend's passes for a prompt size: a question
    of that size then records nothing more."""
    graphs = PassGraphs(model, capacity=512)
    num_tokens = 5 + sum(map(len, prompt[1])) + len(prompt[2])
    shapes = warm_graphs(model, graphs, contexts=(num_tokens,), question=len(prompt[2]))
    assert len(set(shapes)) == 3
    for mode in ("reuse", "blend"):
        _prefill(model, prompt, graphs, mode)
    assert set(graphs.recorded) == set(shapes)


def test_a_prompt_past_the_graphs_capacity_runs_the_engines_pass(model, prompt):
    engine = _prefill(model, prompt, None, "blend")
    graphs = PassGraphs(model, capacity=64)
    got = _prefill(model, prompt, graphs, "blend")
    assert not graphs.recorded
    torch.testing.assert_close(got.logits, engine.logits, atol=0, rtol=0)


def test_graphs_are_left_off_for_sliding_windows(model, monkeypatch):
    assert PassGraphs.supports(model)
    monkeypatch.setattr(type(model.config), "window", lambda self, layer: 8 if layer % 2 else None)
    assert not PassGraphs.supports(model)
    assert use_pass_graphs(model, 512) is None and model.pass_graphs is None


@pytest.mark.gpu
def test_passes_recorded_as_cuda_graphs_replay_the_engines_passes(tiny_checkpoints):
    """Recorded once, replayed for another prompt of the same shape: each prompt's own
    logits, as the engine's passes give them on the same device."""
    model = Transformer.from_pretrained(tiny_checkpoints["llama"], device="cuda")
    graphs = PassGraphs(model, capacity=512)
    assert graphs.record
    for seed in (11, 12, 13):  # the first prompt's shapes are met once: not yet recorded
        prompt = _prompt(model, seed)
        for mode in ("reuse", "blend"):
            engine = _prefill(model, prompt, None, mode)
            got = _prefill(model, prompt, graphs, mode)
            assert graphs.failed is None
            torch.testing.assert_close(got.logits, engine.logits, atol=ATOL, rtol=ATOL)
            assert got.recompute_ratio_effective == engine.recompute_ratio_effective
    assert len(graphs.recorded) == 3  # reuse's pass, blend's two: recorded once for two prompts
    assert graphs.replays == 6 and len(graphs.recording_s) == 3


def test_a_requests_shape_is_recorded_the_second_time_it_is_met(model, prompt, monkeypatch):
    """A shape met once runs the engine's pass and pays no recording; met again, it is
    recorded (here: made ready as on the CPU, where nothing is recorded) and replayed from
    then on. The warm-up records at once."""
    recordings = []

    def capture(self, shape, inputs):
        recordings.append(shape)
        return _Recorded(inputs, None)  # the pass as is: the CPU has no CUDA graph to record

    monkeypatch.setattr(PassGraphs, "_capture", capture)
    engine = _prefill(model, prompt, None, "blend")
    graphs = PassGraphs(model, capacity=512, record=False)
    graphs.record = True  # as on a GPU
    first = _prefill(model, prompt, graphs, "blend")
    assert recordings == [] and not graphs.recorded and sorted(graphs.met.values()) == [1, 1]
    for _ in range(2):
        again = _prefill(model, prompt, graphs, "blend")
        assert len(recordings) == 2 and set(graphs.recorded) == set(recordings)
        assert not graphs.met
        torch.testing.assert_close(again.logits, engine.logits, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(first.logits, engine.logits, atol=0, rtol=0)  # the engine's
    stats = dict(on=True, recorded=2, replays=0, failed=None, recording_s=None)  # CPU: untimed
    assert graphs.stats() == stats
    warm = PassGraphs(model, capacity=512, record=False)
    warm.record = True
    assert warm.prepare(recordings[0]) and len(recordings) == 3


def test_a_failed_recording_leaves_the_engines_passes_running(model, prompt, caplog):
    """Recording asked for where it cannot happen (no CUDA here): the reason is kept and
    logged once, and every pass runs as the engine runs it."""
    engine = _prefill(model, prompt, None, "blend")
    graphs = PassGraphs(model, capacity=512, record=False)
    graphs.record = True  # as on a GPU whose recording fails
    with caplog.at_level("WARNING", logger="kvservice.blend.graphs"):
        got = _prefill(model, prompt, graphs, "blend")
        again = _prefill(model, prompt, graphs, "blend")
    assert graphs.failed and not graphs.recorded and graphs.replays == 0
    assert graphs.stats()["failed"] == graphs.failed
    assert sum("recording" in r.getMessage() for r in caplog.records) == 1
    for result in (got, again):
        torch.testing.assert_close(result.logits, engine.logits, atol=0, rtol=0)
