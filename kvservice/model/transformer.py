"""A decoder of the Llama family and its relatives (Llama 2/3, Mistral, Qwen2, Qwen3, Gemma 3,
Phi-3/Phi-4) over explicit positions. Where the families differ is in ``ModelConfig``
(``kvservice.model.families``: read from the checkpoint's config, one small function per family) and
a few switches in the modules: q/k norms, (1 + weight) norms around attention and MLP,
sliding-window layers with their own RoPE, LongRoPE and partial rotary. Reading a checkpoint
(fused weights split, the fingerprint) is ``kvservice.model.checkpoint``.

Read top to bottom: RoPE (pure functions), the masked attention helper, the small modules, the
KV cache, the model, chunk precompute.

Two things differ from a textbook implementation, both for KV blending:

* Every token carries an explicit position, and the attention mask is built from positions
  (a query attends to a key iff ``key_pos <= query_pos``), never from a bottom-right triangle.
  A subset of a prompt's tokens can then be recomputed against a cache holding all of them.
* A layer runs in two halves around the cache write: ``Attention.project`` gives this layer's
  Q (rotated) and K (pre-RoPE) and V for the tokens being computed; the caller writes them
  wherever its KV lives (our ``KVCache``, or another engine's paged cache) and then calls
  ``Block.attend_and_mlp`` with the layer's full K and V. ``Transformer.forward`` is the plain
  driver of that loop; ``kvservice.blend.prefill`` is the selective one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kvservice.chunk import ChunkKV, token_ids_sha256
from kvservice.model.checkpoint import checkpoint_config, checkpoint_state
from kvservice.model.families import ModelConfig, UnsupportedModelError
from kvservice.model.kernels import FusedLinear, KernelChoice, candidates, prepare
from kvservice.store.buffers import KV_BUFFERS

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# RoPE: pure functions. Rotate-half layout (HF's), so HF weights need no permutation.


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies ``[R/2]`` (fp32, ``R = config.rotary_dim``), with Llama-3 / linear /
    LongRoPE (short factors) scaling applied; ``local``: the sliding layers' plain RoPE at
    ``local_rope_theta`` (Gemma 3)."""
    d = config.rotary_dim
    exponents = torch.arange(0, d, 2, dtype=torch.float64) / d
    if local:
        return (1.0 / (config.local_rope_theta**exponents)).float()
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_type == "longrope":  # HF computes this one in fp32
        short = torch.tensor(config.rope_short_factor, dtype=torch.float32)
        base = torch.tensor(config.rope_theta, dtype=torch.float32)
        return 1.0 / (short * base ** (torch.arange(0, d, 2).float() / d))
    if config.rope_type == "linear":
        inv_freq = inv_freq / config.rope_factor
    elif config.rope_type == "llama3":
        factor = config.rope_factor
        low_wavelen = config.rope_original_max_position / config.rope_low_freq_factor
        high_wavelen = config.rope_original_max_position / config.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are scaled down by `factor`, short ones kept, the band between
        # interpolated smoothly.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (config.rope_original_max_position / wavelen - config.rope_low_freq_factor) / (
            config.rope_high_freq_factor - config.rope_low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq.float()


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[..., T, R]`` for integer ``positions [..., T]`` (computed in fp32),
    times ``scale`` (LongRoPE's attention factor; 1 for the others)."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)  # [..., T, R/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., T, R]
    if scale != 1.0:
        return emb.cos() * scale, emb.sin() * scale
    return emb.cos(), emb.sin()


def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    compute: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate ``x [..., T, D]`` by the angles in cos/sin ``[T, R]`` (broadcast over heads);
    with ``R < D`` (partial rotary) the first ``R`` dims turn and the rest pass.

    Computed in ``compute`` (default ``x``'s dtype; the tables are cast to it, and a narrower
    ``x`` is widened inside the operators), written into ``out`` when given (a cache slice,
    or a tensor of the dtype attention runs in: the rounding then happens once, on the
    store). Three operators whatever the size: ``x cos`` over both halves, then each half's
    ``+- x_other sin`` as one multiply-add into its half of the result. The same products
    and sums in the same order as ``x1 cos - x2 sin`` and ``x2 cos + x1 sin``: on a GPU each
    operator is a kernel launch, and a layer used to spend seven here."""
    rotary = cos.shape[-1]
    half = rotary // 2
    compute = compute or x.dtype
    cos, sin = cos.to(compute), sin[..., :half].to(compute)  # sin's halves are equal
    turned = x[..., :rotary] * cos  # [..., T, R]: x cos
    if out is None:
        shape = torch.broadcast_shapes(x.shape, cos.shape[:-1] + (x.shape[-1],))
        out = torch.empty(shape, dtype=turned.dtype, device=x.device)
    torch.addcmul(turned[..., :half], x[..., half:rotary], sin, value=-1, out=out[..., :half])
    torch.addcmul(turned[..., half:], x[..., :half], sin, out=out[..., half:rotary])
    if rotary < x.shape[-1]:
        out[..., rotary:] = x[..., rotary:]
    return out


# --------------------------------------------------------------------------------------------
# Attention over explicit positions


def position_mask(
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    key_valid: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Boolean mask ``[..., S, T]``: True where a query may attend to a key, i.e. the key is
    at the same or an earlier *position* (and valid, and inside the sliding window)."""
    q = query_pos[..., :, None]  # [..., S, 1]
    k = key_pos[..., None, :]  # [..., 1, T]
    mask = k <= q
    if sliding_window is not None:
        mask = mask & (q - k < sliding_window)
    if key_valid is not None:
        mask = mask & key_valid[..., None, :]
    return mask


def is_causal_triangle(
    query_pos: torch.Tensor, key_pos: torch.Tensor, key_valid: torch.Tensor | None = None
) -> bool:
    """True when the position mask is exactly the lower triangle (queries are the keys, in
    strictly increasing positions, none padded): SDPA's fused causal kernel then computes
    the same attention while skipping the masked half."""
    if query_pos.shape != key_pos.shape or (key_valid is not None and not bool(key_valid.all())):
        return False
    steps = query_pos[..., 1:] - query_pos[..., :-1]
    return bool(torch.equal(query_pos, key_pos) and (steps > 0).all())


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """SDPA with grouped-query heads. q ``[B, H, S, D]``, k/v ``[B, H_kv, T, D]`` (rotated K),
    mask ``[B, S, T]`` or ``[S, T]`` bool, or None for the plain causal triangle (S == T).
    Returns ``[B, H, S, D]``."""
    gqa = q.shape[1] != k.shape[1]
    q = q.to(k.dtype)  # the cache's dtype (bfloat16 attention: kvservice.model.kernels)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    mask = mask[:, None] if mask.dim() == 3 else mask[None, None]  # [B or 1, 1, S, T]
    if gqa and q.device.type == "cpu":
        return _attend_grouped(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def _attend_grouped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Grouped-query attention on the CPU as SDPA over each KV head with its group's query
    heads as rows: K and V are read once a group, where the CPU kernel's own GQA path works
    head by head (a decode step of SmolLM2 at batch 8 over 3,800-token rows: 12.0 -> 1.9 ms
    a layer on 2 cores; the same values to 2e-6). Query head ``i`` reads KV head ``i // g``
    as ``enable_gqa`` does; ``mask [B or 1, 1, S, T]`` is repeated for the group's rows."""
    batch, heads, queries, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    rows = q.reshape(batch, kv_heads, group * queries, dim)  # row j * S + t: head j, query t
    if queries > 1:
        mask = mask.repeat(1, 1, group, 1)
    out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask)
    return out.view(batch, heads, queries, dim)


# --------------------------------------------------------------------------------------------
# Modules


# Where ``F.rms_norm`` is one fused kernel (PyTorch's CUDA build): there a norm is one launch
# instead of six (the square, the mean, epsilon, the root, the two products). On the CPU it is
# those same six operators, so the norm keeps its own, which round into the next product's
# dtype as they store.
FUSED_NORM_ON = frozenset({"cuda"})


class RMSNorm(nn.Module):
    """RMS norm scaled by ``weight`` (Llama), or by ``1 + weight`` in fp32 before rounding
    to the input's dtype (Gemma: ``offset`` 1)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x`` normed, in ``x``'s dtype; in ``dtype`` when given (what the next product
        reads: the last multiply rounds into it as it stores, one operator instead of a
        product and a conversion). On a device with a fused kernel (:data:`FUSED_NORM_ON`),
        a float32 ``x`` is normed by it: one kernel launch and the conversion, not six."""
        if x.device.type in FUSED_NORM_ON and x.dtype == torch.float32 and not self.offset:
            normed = F.rms_norm(x, x.shape[-1:], self.weight.to(x.dtype), self.eps)
            return normed if dtype is None else normed.to(dtype)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            a, b, into = self.offset + self.weight.float(), x32, dtype or x.dtype
        else:
            a, b, into = self.weight, x32.to(x.dtype), dtype
        if into is None or torch.is_grad_enabled():  # (out= does not differentiate)
            return a * b if into is None else (a * b).to(into)
        return torch.mul(a, b, out=torch.empty(x.shape, dtype=into, device=x.device))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
        )
        self.q_proj = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(
            config.dim, config.n_kv_heads * config.head_dim, bias=config.qkv_bias
        )
        self.v_proj = nn.Linear(
            config.dim, config.n_kv_heads * config.head_dim, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=config.o_bias)
        # The products as run: q, k and v in one (kvservice.model.kernels), o alone.
        self.qkv = FusedLinear(self.q_proj, self.k_proj, self.v_proj)
        self.out = FusedLinear(self.o_proj)
        if config.qk_norm:  # each head's q and k normed before RoPE (Qwen3, Gemma 3)
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps, config.norm_offset)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps, config.norm_offset)
        # SDPA scales by 1/sqrt(D); another softmax scale is folded into q.
        scale = config.attention_scale
        self.q_scale = 1.0 if scale is None else scale * math.sqrt(config.head_dim)

    def project(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        dtype: torch.dtype | None = None,
        compute: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed hidden ``h [B, S, dim]`` -> rotated q ``[B, H, S, D]``, rotated k, v and
        pre-RoPE k ``[B, H_kv, S, D]``. cos/sin ``[B, S, D]`` at the tokens' positions.

        RoPE is computed in ``compute`` (the residual stream's dtype; default ``h``'s); q, k
        and v come back in ``dtype`` (the KV cache's, what attention reads; default
        ``compute``), pre-RoPE k as the product gave it. q and k sit side by side in the
        fused product's output, so they are rotated as one tensor of ``H + H_kv`` heads,
        straight from the product's output: one set of operators a layer and no conversions
        (each a kernel launch on a GPU)."""
        bsz, seqlen, _ = h.shape
        heads, kv_heads, dim = self.n_heads, self.n_kv_heads, self.head_dim
        compute = compute or h.dtype
        dtype = dtype or compute
        y = self.qkv.joined(h)  # [B, S, (H + 2 H_kv) * D]
        qk = y[..., : (heads + kv_heads) * dim]
        qk = qk.view(bsz, seqlen, heads + kv_heads, dim).transpose(1, 2)  # [B, H + H_kv, S, D]
        v = y[..., (heads + kv_heads) * dim :].to(dtype)
        v = v.view(bsz, seqlen, kv_heads, dim).transpose(1, 2)  # [B, H_kv, S, D]
        if hasattr(self, "q_norm"):  # each head's q and k normed by its own weights, in the
            qk = qk.to(compute)  # residual stream's dtype (a norm returns its input's)
            qk = torch.cat([self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])], dim=1)
        scaled = self.q_scale != 1.0  # then q is scaled before its one rounding
        into = torch.empty(qk.shape, dtype=compute if scaled else dtype, device=h.device)
        rotated = apply_rope(qk, cos[:, None], sin[:, None], compute=compute, out=into)
        q, k = rotated[:, :heads], rotated[:, heads:]
        if scaled:
            q, k = (q * self.q_scale).to(dtype), k.to(dtype)
        return q, k, v, qk[:, heads:]

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        bsz, _, seqlen, _ = attn.shape
        # [B, S, H*D]: one copy (a reshape of the transposed view copies and views again)
        attn = attn.transpose(1, 2).contiguous().view(bsz, seqlen, self.n_heads * self.head_dim)
        return self.out(attn)[0]


class FeedForward(nn.Module):
    """A gated MLP: SwiGLU, or GeGLU with tanh-approximated GELU (Gemma)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.gate_proj = nn.Linear(config.dim, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.dim, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.dim, bias=config.mlp_bias)
        self.gate_up = FusedLinear(self.gate_proj, self.up_proj)
        self.down = FusedLinear(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)  # [..., I] each (bfloat16 under onednn-bf16)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down(gate * up)[0]


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        offset = config.norm_offset
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps, offset)
        self.self_attn = Attention(config)
        # Llama: the MLP's input norm. Gemma 3 (sandwich): the attention output's norm, and
        # the MLP has a norm before and after it.
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps, offset)
        self.mlp = FeedForward(config)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.dim, config.norm_eps, offset)
            self.post_feedforward_layernorm = RMSNorm(config.dim, config.norm_eps, offset)

    def project(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """First half of the layer: rotated q and k, v (in ``dtype``: the cache's), pre-RoPE
        k for the tokens in ``x``."""
        normed = self.input_layernorm(x, self.self_attn.qkv.input_dtype)
        return self.self_attn.project(normed, cos, sin, dtype, compute=x.dtype)

    def attend_and_mlp(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Second half: attention of ``q`` over the layer's whole rotated ``k``/``v``
        (``[B, H_kv, T, D]``, including these tokens' own fresh entries), then the MLP."""
        return self.finish(x, attend(q, k, v, mask))

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection of the attention result ``attn [B, H, S, D]``, residual, MLP."""
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn.output(attn))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn.output(attn)  # fp32 residual (+ a bfloat16 product: fp32)
        return x + self.mlp(self.post_attention_layernorm(x, self.mlp.gate_up.input_dtype))


# --------------------------------------------------------------------------------------------
# KV cache: our own layout. K is stored rotated (ready for attention); each slot records the
# position of its token and whether it holds one, so rows of a batch can have any lengths.


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        capacity: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        written_before_read: int = 0,
    ):
        """``written_before_read``: the caller fills slots ``[0, n)`` of every layer before
        anything reads them, so they are left uninitialized (zeroing them took 45 ms of a
        3.7k-token SmolLM2 prefill on 2 cores); the rest is zeroed, since masked slots still
        enter attention with weight 0 and must not hold NaN."""
        shape = (config.n_layers, batch_size, config.n_kv_heads, capacity, config.head_dim)
        # kept buffers on the CPU (no fresh pages per request: kvservice.store.buffers)
        self.k = KV_BUFFERS.empty(shape, dtype, device)  # [L, B, H_kv, C, D], rotated
        self.v = KV_BUFFERS.empty(shape, dtype, device)  # [L, B, H_kv, C, D]
        self.k[:, :, :, written_before_read:] = 0
        self.v[:, :, :, written_before_read:] = 0
        self.positions = torch.zeros(
            batch_size, capacity, dtype=torch.long, device=device
        )  # [B, C]
        self.valid = torch.zeros(batch_size, capacity, dtype=torch.bool, device=device)  # [B, C]
        self.length = 0  # slots [0, length) are in use (some may be invalid padding)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    def first_rows(self, rows: int) -> KVCache:
        """A cache over this one's first ``rows`` rows, sharing its memory (a batch whose
        rows come and go keeps one allocation: ``kvservice.serve.batcher``)."""
        view = KVCache.__new__(KVCache)
        view.k, view.v = self.k[:, :rows], self.v[:, :rows]
        view.positions, view.valid = self.positions[:rows], self.valid[:rows]
        view.length = self.length
        return view

    def move_row(self, source: int, dest: int, length: int) -> None:
        """Row ``source``'s slots ``[0, length)`` (and its whole validity) into row ``dest``."""
        self.k[:, dest, :, :length] = self.k[:, source, :, :length]
        self.v[:, dest, :, :length] = self.v[:, source, :, :length]
        self.positions[dest] = self.positions[source]
        self.valid[dest] = self.valid[source]

    def compact_rows(self) -> int:
        """Move each row's valid slots to the row's front, in order (a row's keys are
        masked by position, not by column), and shorten the cache to its longest row.
        Returns the new length."""
        counts = self.valid[:, : self.length].sum(dim=1)
        for row in range(self.batch_size):
            slots = self.valid[row, : self.length].nonzero().squeeze(1)
            count = slots.numel()
            if count == 0 or int(slots[-1]) == count - 1:
                continue  # empty, or already at the front
            self.k[:, row, :, :count] = self.k[:, row, :, slots]
            self.v[:, row, :, :count] = self.v[:, row, :, slots]
            self.positions[row, :count] = self.positions[row, slots]
            self.valid[row] = False
            self.valid[row, :count] = True
        self.length = int(counts.max()) if counts.numel() else 0
        return self.length

    def truncate(self, length: int) -> None:
        """Forget every slot from ``length`` on (e.g. roll back a teacher-forced probe)."""
        self.valid[:, length:] = False
        self.length = min(self.length, length)

    def reserve(self, positions: torch.Tensor, valid: torch.Tensor | None = None) -> slice:
        """Claim the next ``T`` slots for tokens at ``positions [B, T]``; returns the slice."""
        start, end = self.length, self.length + positions.shape[1]
        if end > self.capacity:
            raise ValueError(f"KV cache full: {end} slots needed, capacity {self.capacity}")
        self.positions[:, start:end] = positions
        self.valid[:, start:end] = True if valid is None else valid
        self.length = end
        return slice(start, end)


# --------------------------------------------------------------------------------------------
# The model


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps, config.norm_offset)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.head = FusedLinear(self.lm_head)
        set_rope_buffers(self, config)
        self.fingerprint = ""  # set by from_pretrained / fingerprint_weights
        self.kernel_choice: KernelChoice | None = None  # set by prepare_kernels
        self.pass_graphs = None  # recorded passes (kvservice.blend.graphs.use_pass_graphs)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings ``[..., dim]`` (times ``embed_scale``, rounded to the
        weights' dtype first, as Gemma does)."""
        x = self.embed_tokens(token_ids)
        if self.config.embed_scale != 1.0:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        return x

    def rope(self, positions: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[..., T, R]`` at ``positions`` for layer ``layer`` (the global RoPE,
        or Gemma 3's local one on its sliding layers)."""
        if self.config.local_rope(layer):
            return rope_cos_sin(self.local_inv_freq, positions)
        return rope_cos_sin(self.inv_freq, positions, self.config.rope_attention_factor)

    def ropes(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's ``rope(positions, layer)``, each distinct one computed once."""
        tables: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in range(self.config.n_layers):
            local = self.config.local_rope(i)
            if local not in tables:
                tables[local] = self.rope(positions, layer=i)
        return [tables[self.config.local_rope(i)] for i in range(self.config.n_layers)]

    def mask(
        self,
        query_pos: torch.Tensor,
        key_pos: torch.Tensor,
        key_valid: torch.Tensor | None = None,
        layer: int = 0,
    ) -> torch.Tensor | None:
        """Layer ``layer``'s attention mask from real positions (its sliding window, if it
        has one); None when it is exactly the causal triangle (see ``attend``)."""
        window = self.config.window(layer)
        span = int(key_pos.max() - key_pos.min()) if key_pos.numel() else 0
        if (window is None or span < window) and is_causal_triangle(query_pos, key_pos, key_valid):
            return None
        return position_mask(query_pos, key_pos, key_valid, window)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's dtype, which attention runs in (``kvservice.model.kernels``)."""
        if self.kernel_choice is not None:
            return self.kernel_choice.attention_dtype
        return self.embed_tokens.weight.dtype

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(x))[0].float()
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def prepare_kernels(
        self, precision: str = "float32", kernel: str | None = None
    ) -> KernelChoice:
        """Pack the linear layers for the fastest kernel this device has at ``precision``
        (``kvservice.model.kernels``); call again after changing weights."""
        self.kernel_choice = prepare(self, precision, kernel)
        return self.kernel_choice

    def _apply(self, fn, recurse=True):
        """``nn.Module``'s move or cast (``.to``, ``.cuda``, ``.half``...), then what it
        cannot see: the packed products (plain attributes, not parameters) are packed again
        from the moved weights, with the same kernel where the new device and dtype run it,
        and recorded passes, bound to the old tensors, are dropped."""
        super()._apply(fn, recurse)
        choice = getattr(self, "kernel_choice", None)  # None before __init__ set it
        if choice is not None:
            dtype = self.embed_tokens.weight.dtype
            runs = choice.kernel in candidates(self.device, choice.precision, dtype)
            self.prepare_kernels(choice.precision, choice.kernel if runs else None)
        if getattr(self, "pass_graphs", None) is not None:
            log.info("the model moved: its recorded passes are dropped")
            self.pass_graphs = None
        return self

    @torch.no_grad()
    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        *,
        valid: torch.Tensor | None = None,
        all_logits: bool = False,
        collect_kv: bool = False,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """Run ``token_ids [B, T]`` at ``positions [B, T]``, attending to everything already in
        ``cache`` plus themselves (causally by position). Their KV is appended to ``cache``.

        Returns logits (``[B, T, V]`` if ``all_logits`` else the last token's ``[B, V]``) and,
        with ``collect_kv``, each layer's (pre-RoPE k, v) of these tokens, ``[B, H_kv, T, D]``.
        ``valid [B, T]`` marks padding (False) in ragged batches; padded keys are never seen.
        """
        x = self.embed(token_ids)  # x: [B, T, dim]
        ropes = self.ropes(positions)  # per layer: cos, sin [B, T, R]
        if cache is not None:
            slots = cache.reserve(positions, valid)
            key_pos, key_valid = cache.positions[:, : slots.stop], cache.valid[:, : slots.stop]
        else:
            key_pos, key_valid = positions, valid
        masks = {}  # per window: [B, T, T_keys] or None (causal)
        collected = [] if collect_kv else None
        for i, layer in enumerate(self.layers):
            window = self.config.window(i)
            if window not in masks:
                masks[window] = self.mask(positions, key_pos, key_valid, layer=i)
            cos, sin = ropes[i]
            # k: [B, H_kv, T, D], rotated; q, k and v in the cache's dtype
            q, k, v, k_pre = layer.project(x, cos, sin, None if cache is None else cache.k.dtype)
            if collected is not None:  # as the residual stream's dtype holds them
                collected.append((k_pre.to(x.dtype), v.to(x.dtype)))
            if cache is not None:
                cache.k[i, :, :, slots] = k
                cache.v[i, :, :, slots] = v
                k, v = cache.k[i, :, :, : slots.stop], cache.v[i, :, :, : slots.stop]
            x = layer.attend_and_mlp(x, q, k, v, masks[window])
        if not all_logits:
            x = x[:, -1]  # x: [B, dim]; only the next-token distribution is needed
        return self.logits(x), collected

    # ----------------------------------------------------------------------------------------
    # Loading

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        precision: str = "float32",
        kernel: str | None = None,
    ) -> Transformer:
        """Load an HF checkpoint directory (config.json + *.safetensors, mmapped), its linear
        layers packed for the fastest kernel allowed at ``precision`` (``float32``; ``auto``:
        bfloat16 products where the CPU has them natively; ``kvservice.model.kernels``), or for
        ``kernel`` when given (benches)."""
        config = checkpoint_config(path)
        with torch.device("meta"):
            model = cls(config)
        state, fingerprint = checkpoint_state(path, config, device, dtype)
        if config.tie_embeddings:
            state.pop("lm_head.weight", None)
        model.load_state_dict(state, strict=not config.tie_embeddings, assign=True)
        if config.tie_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        if missing:
            raise UnsupportedModelError(f"checkpoint {path} lacks weights: {missing[:5]}")
        set_rope_buffers(model, config, device)
        model.fingerprint = fingerprint
        model.prepare_kernels(precision, kernel)
        return model.eval()

    def fingerprint_weights(self) -> str:
        """Fingerprint an in-memory model (tests, random configs) from config and weights."""
        digest = hashlib.sha256(json.dumps(self.config.identity(), sort_keys=True).encode())
        for name, param in self.state_dict().items():
            digest.update(name.encode() + param.float().cpu().numpy().tobytes())
        self.fingerprint = digest.hexdigest()[:32]
        return self.fingerprint


def set_rope_buffers(
    model: nn.Module, config: ModelConfig, device: torch.device | str | None = None
) -> None:
    """The RoPE inverse frequencies a model turns q and k by: ``inv_freq`` and, where sliding
    layers have their own (Gemma 3), ``local_inv_freq``."""
    model.register_buffer("inv_freq", rope_inv_freq(config).to(device), persistent=False)
    if config.local_rope_theta is not None:
        local = rope_inv_freq(config, local=True).to(device)
        model.register_buffer("local_inv_freq", local, persistent=False)


# --------------------------------------------------------------------------------------------
# Chunk precompute: run [prompt head + chunk], keep the chunk's part.


def head_hash(head_ids: Sequence[int]) -> str:
    return token_ids_sha256(head_ids)


@torch.no_grad()
def precompute_head(model: Transformer, head_ids: Sequence[int]) -> ChunkKV:
    """The fixed prompt head's own KV (it is always at positions 0..h-1, so it is exact)."""
    device = model.device
    ids = torch.tensor([list(head_ids)], device=device)
    positions = torch.arange(len(head_ids), device=device)[None]
    _, kv = model(ids, positions, collect_kv=True)
    k = torch.stack([layer_k[0] for layer_k, _ in kv])  # k: [L, H_kv, h, D]
    v = torch.stack([layer_v[0] for _, layer_v in kv])  # v: [L, H_kv, h, D]
    return ChunkKV(list(head_ids), k.cpu(), v.cpu(), model.fingerprint, head_hash(head_ids))


@torch.no_grad()
def precompute_chunks(
    model: Transformer,
    head_ids: Sequence[int],
    chunks_ids: Sequence[Sequence[int]],
    *,
    max_batch_tokens: int = 4096,
    out_device: torch.device | str = "cpu",
    head_kv: ChunkKV | None = None,
) -> list[ChunkKV]:
    """Each chunk's per-layer KV, computed after the prompt head (positions h..h+n-1).

    The head runs once (not at all when its KV is given, ``head_kv``: a long storage context,
    ``PromptFormat.storage_ids``); chunks of similar length share one forward, padded on the
    right (padded slots are invalid keys, so no real token sees them)."""
    device, config = model.device, model.config
    h = len(head_ids)
    if head_kv is not None and head_kv.token_ids != list(head_ids):
        raise ValueError("head_kv is not the KV of head_ids")
    head = head_kv if head_kv is not None else precompute_head(model, head_ids) if h else None
    results: list[ChunkKV | None] = [None] * len(chunks_ids)
    order = sorted(range(len(chunks_ids)), key=lambda i: len(chunks_ids[i]))
    batches: list[list[int]] = []
    for index in order:  # group by length so padding stays small
        n = len(chunks_ids[index])
        if n == 0:
            raise ValueError("cannot precompute an empty chunk")
        if batches and (len(batches[-1]) + 1) * n <= max_batch_tokens:
            batches[-1].append(index)
        else:
            batches.append([index])
    for batch in batches:
        longest = max(len(chunks_ids[i]) for i in batch)
        bsz = len(batch)
        ids = torch.zeros(bsz, longest, dtype=torch.long, device=device)
        valid = torch.zeros(bsz, longest, dtype=torch.bool, device=device)
        for row, index in enumerate(batch):
            n = len(chunks_ids[index])
            ids[row, :n] = torch.tensor(list(chunks_ids[index]), device=device)
            valid[row, :n] = True
        positions = (h + torch.arange(longest, device=device))[None].expand(bsz, -1)  # [B, n]
        cache = KVCache(config, bsz, h + longest, device, model.cache_dtype)
        if head is not None:
            cache.reserve(torch.arange(h, device=device)[None].expand(bsz, -1))
            ropes = model.ropes(torch.arange(h, device=device))
            for i in range(config.n_layers):
                k_head, v_head = head.layer(i)  # [H_kv, h, D]
                cache.k[i, :, :, :h] = apply_rope(k_head.to(device), *ropes[i])
                cache.v[i, :, :, :h] = v_head.to(device)
        _, kv = model(ids, positions, cache, valid=valid, collect_kv=True)
        k_all = torch.stack([layer_k for layer_k, _ in kv], dim=1)  # [B, L, H_kv, n, D]
        v_all = torch.stack([layer_v for _, layer_v in kv], dim=1)  # [B, L, H_kv, n, D]
        for row, index in enumerate(batch):
            n = len(chunks_ids[index])
            results[index] = ChunkKV(
                token_ids=list(chunks_ids[index]),
                k=k_all[row, :, :, :n].to(out_device).contiguous(),
                v=v_all[row, :, :, :n].to(out_device).contiguous(),
                model_fingerprint=model.fingerprint,
                head_hash=head_hash(head_ids),
            )
    return [r for r in results if r is not None]
