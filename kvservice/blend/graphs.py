"""Blend's passes as CUDA graphs: one launch a pass instead of ~30 a layer.

On a GPU a pass over the question (reuse, blend's first pass) or over the recomputed tokens
(blend's second) is thousands of small kernels, and the host, not the GPU, sets its pace: at
4,096 tokens ~200 ms of host time over ~50 ms of GPU work (docs/long_context_gpu). A
``PassGraphs`` records a pass once per padded shape and replays it:

* the computed slots are padded to a power of two, or past ``ROW_STEP`` to a multiple of
  it (``PassShape.rows``), in front, so the prompt's last token is always the last row; a
  padded row is token 0 at position 0, and its KV goes to a scratch slot past every key read;
* the keys read are padded to a multiple of ``KEY_STEP`` (``PassShape.keys``), masked;
* what a request changes (token ids, positions, the slots written, the prompt's length, the
  stale keys' bias, which rows are the question) lives in the shape's ``PassInputs``;
* the cache the graphs read is one kept buffer (``PassGraphs.cache``): a request's passes
  run in it, and its first ``T`` slots are then copied into the request's own cache;
* a shape is recorded at the worker's warm-up (``prepare``), or the second time a request
  meets it (``RECORD_AFTER``): the first time, the engine's pass runs.

``static_pass`` is the pass itself, with no host synchronisation and no shape that depends
on a value: what a CUDA graph can record. It computes what the engine's pass computes
(``kvservice.blend.prefill._run_pass``) with the masked keys and padded rows added; on the
CPU it runs as is (the tests hold it to the engine's pass), on CUDA ``PassGraphs`` records
it. ``ENGINE_COMPILE=off`` leaves the graphs out; the worker turns them on for CUDA only.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvservice.model import cuda_graph
from kvservice.model.transformer import KVCache, Transformer
from kvservice.protocol import environment

log = logging.getLogger(__name__)

KEY_STEP = 512  # keys read are padded to a multiple of this (at 4,096 tokens: none)
MIN_ROWS = 16  # rows are padded to a power of two, at least this, up to ROW_STEP ...
ROW_STEP = 128  # ... and beyond it to a multiple of it (a blend's 640 recomputed: no padding)
MAX_ROWS = 8192  # more computed slots than this: the engine's pass (a prefill, not a blend)
MAX_GRAPHS = 48  # recorded shapes kept, least recently used dropped first
# A shape a request meets is recorded the second time it is met (the first runs the engine's
# pass): a shape met once never pays a recording, which costs about three passes (two to warm
# up, one recorded). The worker's warm-up records its shapes at once (``prepare``).
RECORD_AFTER = 2
# The longest prompt a recorded pass takes: the graphs' cache holds this many tokens (4.3 GB
# for Llama-3-8B's shape in bfloat16); a longer prompt runs the engine's passes.
GRAPH_TOKENS = 32768


@dataclass(frozen=True)
class PassShape:
    """What one recorded pass is: its padded sizes and what it computes."""

    rows: int  # computed slots, padded
    keys: int  # cache slots read, padded
    until: int  # layers run
    weigh_from: int | None  # the question's attention recorded from this layer on (None: not)
    logits: bool  # the last row's logits (the pass runs every layer)


@dataclass(frozen=True)
class PassInputs:
    """A shape's inputs, filled per request (``fill``)."""

    ids: torch.Tensor  # [rows] token ids (0 in padded rows)
    positions: torch.Tensor  # [rows] (0 in padded rows)
    slots: torch.Tensor  # [rows] cache slots written (padded rows: the scratch slot)
    length: torch.Tensor  # [] the prompt's tokens: keys from here on are masked
    bias: torch.Tensor  # [keys] float32, added to the logits of visible keys (stale keys)
    question: torch.Tensor  # [rows] 1 on the question's rows, whose attention is recorded
    share: torch.Tensor  # [] float32, 1 / (query heads x question tokens)

    @classmethod
    def empty(cls, shape: PassShape, scratch: int, device) -> PassInputs:
        """Inputs that compute nothing of a request's (every row padded)."""
        longs = dict(dtype=torch.long, device=device)
        return cls(
            torch.zeros(shape.rows, **longs),
            torch.zeros(shape.rows, **longs),
            torch.full((shape.rows,), scratch, **longs),
            torch.ones((), **longs),
            torch.zeros(shape.keys, device=device),
            torch.zeros(shape.rows, device=device),
            torch.ones((), device=device),
        )

    def fill(self, token_ids, active, num_tokens, scratch, bias, question_length, heads) -> None:
        """This request's: ``active [S]`` slots (sorted) of ``token_ids [T]``, the last
        ``question_length`` of them the question; ``bias [T]`` or None."""
        rows = self.ids.numel()
        pad = rows - active.numel()
        self.ids.copy_(F.pad(token_ids[active], (pad, 0)))
        self.positions.copy_(F.pad(active, (pad, 0)))
        self.slots.copy_(F.pad(active, (pad, 0), value=scratch))
        self.length.fill_(num_tokens)
        if bias is None:
            self.bias.zero_()
        else:
            self.bias.copy_(F.pad(bias.float(), (0, self.bias.numel() - num_tokens)))
        self.question.zero_()
        if question_length:
            self.question[rows - question_length :] = 1.0
        self.share.fill_(1.0 / max(1, heads * question_length))


@torch.no_grad()
def static_pass(model: Transformer, cache: KVCache, tables, inputs: PassInputs, shape: PassShape):
    """The pass of ``shape`` over ``cache`` (batch 1, rotated K), what the engine's pass
    computes for the same slots: returns the last row's logits ``[V]`` (or None) and the
    question's attention ``[until, keys]`` per layer (zeros below ``weigh_from``; or None).
    ``tables``: cos and sin ``[C, R]`` at every cache slot. No host synchronisation, every
    shape fixed by ``shape``: a CUDA graph records it as is."""
    config, dtype = model.config, cache.k.dtype
    heads, kv_heads = config.n_heads, config.n_kv_heads
    group = heads // kv_heads
    key_pos = torch.arange(shape.keys, device=cache.k.device)
    visible = (key_pos <= inputs.positions[:, None]) & (key_pos < inputs.length)
    hidden = torch.full((), float("-inf"), dtype=dtype, device=cache.k.device)  # (a kernel)
    mask = torch.where(visible, inputs.bias.to(dtype), hidden)  # [rows, keys]
    stacked_mask = mask.repeat(group, 1)  # the query heads that share a key head, as rows
    last_mask = mask[-1:].repeat(group, 1)
    cos, sin = tables[0][inputs.positions][None], tables[1][inputs.positions][None]
    x = model.embed(inputs.ids)[None]  # [1, rows, dim]
    recorded, unread = [], torch.zeros(shape.keys, device=cache.k.device)
    for i, layer in enumerate(model.layers[: shape.until]):
        q, k, v, _ = layer.project(x, cos, sin, dtype)
        cache.k[i, 0].index_copy_(1, inputs.slots, k[0])
        cache.v[i, 0].index_copy_(1, inputs.slots, v[0])
        k_layer, v_layer = cache.k[i, :, :, : shape.keys], cache.v[i, :, :, : shape.keys]
        last = i == config.n_layers - 1
        if shape.weigh_from is not None and i >= shape.weigh_from:
            out, paid = _attend_and_weigh(q, k_layer[0], v_layer[0], stacked_mask, inputs)
            recorded.append(paid)
        else:
            if shape.weigh_from is not None:
                recorded.append(unread)
            rows = q[:, :, -1:] if last else q
            out = _attend(rows, k_layer, v_layer, last_mask if last else stacked_mask)
        if last:  # after the last layer only the last token's output counts
            x, out = x[:, -1:], out[:, :, -1:]
        x = layer.finish(x, out)
    logits = model.logits(x[0, -1]) if shape.logits else None
    return logits, torch.stack(recorded) if recorded else None


def _attend(q, k, v, mask):
    """``q [1, H, S, D]`` over ``k, v [1, H_kv, K, D]`` with the additive ``mask`` of its
    rows stacked per key head (``[H / H_kv * S, K]``): one SDPA call, ``[1, H, S, D]``."""
    _, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    rows = q.contiguous().view(1, kv_heads, heads // kv_heads * length, dim)
    out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask)
    return out.reshape(1, heads, length, dim)


def _attend_and_weigh(q, k, v, mask, inputs: PassInputs):
    """``_attend`` computed explicitly, with the weights the question's rows paid each key,
    averaged over heads and question tokens (``kvservice.blend.attention.attend_and_weigh``)."""
    _, heads, length, dim = q.shape
    kv_heads = k.shape[0]
    stacked = q.contiguous().view(kv_heads, heads // kv_heads * length, dim)
    scores = torch.baddbmm(mask, stacked, k.transpose(1, 2), alpha=1 / math.sqrt(dim))
    weights = torch.softmax(scores, dim=-1)  # [H_kv, G * S, K]
    out = torch.bmm(weights, v.to(weights.dtype)).view(1, heads, length, dim)
    rows = inputs.question.repeat(heads // kv_heads).to(weights.dtype)  # 0 or 1: exact
    paid = (weights * rows[:, None]).sum(dim=(0, 1), dtype=torch.float32) * inputs.share
    return out, paid


@dataclass
class _Recorded:
    inputs: PassInputs
    graph: torch.cuda.CUDAGraph | None  # None: run as is (the CPU)
    outputs: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)


class PassGraphs:
    """The recorded passes of one model, and the cache they read (``capacity`` prompt
    tokens at most, plus the scratch slot). One request's passes at a time (``lock``)."""

    def __init__(
        self,
        model: Transformer,
        capacity: int,
        record: bool | None = None,
        record_after: int = RECORD_AFTER,
    ):
        self.model = model
        self.capacity = capacity
        self.record_after = record_after  # a request's shape is recorded the nth time it is met
        self.scratch = _round_up(capacity, KEY_STEP)  # the padded rows' slot
        device = model.device
        self.cache = KVCache(model.config, 1, self.scratch + 1, device, model.cache_dtype)
        self.tables = model.rope(torch.arange(self.scratch + 1, device=device))
        self.record = device.type == "cuda" if record is None else record
        self.pool = torch.cuda.graph_pool_handle() if self.record else None
        self.recorded: OrderedDict[PassShape, _Recorded] = OrderedDict()
        self.lock = threading.Lock()
        self.failed: str | None = None  # why recording stopped, if it did
        self.replays = 0
        self.met: Counter[PassShape] = Counter()  # a request's shapes not yet recorded
        self.recording_s: deque[float] = deque(maxlen=256)  # the last recordings' seconds

    @staticmethod
    def supports(model: Transformer) -> bool:
        """Whether the model's passes can run as ``static_pass`` (no sliding windows, one
        RoPE table)."""
        config = model.config
        return all(
            config.window(i) is None and not config.local_rope(i) for i in range(config.n_layers)
        )

    def begin(self, num_tokens: int) -> KVCache:
        """The kept cache, emptied, with slots ``[0, num_tokens)`` reserved for a prompt."""
        cache = self.cache
        cache.truncate(0)
        cache.reserve(torch.arange(num_tokens, device=cache.k.device)[None])
        return cache

    def shape(self, count, num_tokens, until, question_length, weigh_from) -> PassShape | None:
        """The shape that computes ``count`` slots of a ``num_tokens`` prompt, or None when
        the engine's pass should (too many rows, a prompt past ``capacity``, or the question's
        attention recorded beside other computed tokens)."""
        if count > MAX_ROWS or num_tokens > self.capacity:
            return None
        if question_length and count != question_length:
            return None
        rows = max(MIN_ROWS, 1 << (count - 1).bit_length())
        if rows > ROW_STEP:
            rows = _round_up(count, ROW_STEP)
        layers = self.model.config.n_layers
        weigh = weigh_from if question_length else None
        return PassShape(rows, _round_up(num_tokens, KEY_STEP), until, weigh, until == layers)

    def run(self, token_ids, active, shape: PassShape, question_length: int, bias):
        """The pass of ``shape`` over ``active``: (logits, attention ``[until, T]``), or None
        when the engine's pass should run instead: the shape is met for the first time
        (``RECORD_AFTER``), or it cannot be recorded (the reason is logged once)."""
        if self.record and shape not in self.recorded:
            self.met[shape] += 1
            if self.met[shape] < self.record_after:
                return None  # met for the first time: the engine's pass, not a recording
        recorded = self._recorded(shape)
        if recorded is None:
            return None
        num_tokens = token_ids.numel()
        recorded.inputs.fill(
            token_ids,
            active,
            num_tokens,
            self.scratch,
            bias,
            question_length,
            self.model.config.n_heads,
        )
        if recorded.graph is None:
            logits, attention = static_pass(
                self.model, self.cache, self.tables, recorded.inputs, shape
            )
        else:
            recorded.graph.replay()
            self.replays += 1
            logits, attention = (None if t is None else t.clone() for t in recorded.outputs)
        if attention is not None:
            attention = attention[:, :num_tokens]
        return logits, attention

    def stats(self) -> dict:
        """What the worker's heartbeat and the bench report: shapes recorded, replays, why
        recording stopped (None: it did not), and how long a recording took (seconds, each
        with its two warm-up runs)."""
        took = list(self.recording_s)
        recording = {"median": statistics.median(took), "max": max(took)} if took else None
        return {
            "on": True,
            "recorded": len(self.recorded),
            "replays": self.replays,
            "failed": self.failed,
            "recording_s": recording,
        }

    def prepare(self, shape: PassShape) -> bool:
        """Record ``shape``'s pass now (a worker's warm-up), if it is not yet; False when
        recording has stopped."""
        return self._recorded(shape) is not None

    def _recorded(self, shape: PassShape) -> _Recorded | None:
        if shape in self.recorded:
            self.recorded.move_to_end(shape)
            return self.recorded[shape]
        if self.failed is not None:
            return None
        inputs = PassInputs.empty(shape, self.scratch, self.model.device)
        entry = _Recorded(inputs, None)
        if self.record:
            try:
                entry = self._capture(shape, inputs)
            except Exception as exc:  # noqa: BLE001 - any failure: the engine's pass instead
                self.failed = f"{type(exc).__name__}: {exc}"
                log.warning("pass graphs off, recording %s failed: %s", shape, self.failed)
                return None
        self.recorded[shape] = entry
        self.met.pop(shape, None)
        while len(self.recorded) > MAX_GRAPHS:
            self.recorded.popitem(last=False)
        return entry

    def _capture(self, shape: PassShape, inputs: PassInputs) -> _Recorded:
        """Record ``shape``'s pass; every row is padded meanwhile, so the runs before the
        recording write only the scratch slot."""
        started = time.perf_counter()
        graph, outputs = cuda_graph.record(
            lambda: static_pass(self.model, self.cache, self.tables, inputs, shape),
            self.model.device,
            self.pool,
        )
        self.recording_s.append(time.perf_counter() - started)
        log.info("recorded the pass %s in %.0f ms", shape, 1e3 * self.recording_s[-1])
        return _Recorded(inputs, graph, outputs)


def _round_up(n: int, step: int) -> int:
    return max(step, -(-n // step) * step)


def graphs_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """``ENGINE_COMPILE`` (``kvservice.protocol.environment``): ``on`` (default; recorded
    passes where the model runs on CUDA) or ``off``."""
    return environment.read("ENGINE_COMPILE", environ) == "on"


def use_pass_graphs(
    model: Transformer, capacity: int = GRAPH_TOKENS, record_after: int = RECORD_AFTER
) -> PassGraphs | None:
    """Turn recorded passes on for ``model`` (its prompts up to ``capacity`` tokens), where it
    can run them (``PassGraphs.supports``); returns them, or None."""
    if not PassGraphs.supports(model):
        log.info("pass graphs off: the model has sliding windows or a local RoPE")
        model.pass_graphs = None
        return None
    model.pass_graphs = PassGraphs(model, capacity, record_after=record_after)
    return model.pass_graphs


def graphs_report(graphs: PassGraphs | None) -> dict:
    """``graphs.stats()``, or that recorded passes are off (the worker's heartbeat, the bench)."""
    return {"on": False} if graphs is None else graphs.stats()
