"""A Llama-family decoder (Llama, Mistral, Qwen2) over explicit positions.

Read top to bottom: config, RoPE (pure functions), the masked attention helper, the small
modules, the KV cache, the model, loading, chunk precompute.

Two things differ from a textbook implementation, both for KV blending:

* Every token carries an explicit position, and the attention mask is built from positions
  (a query attends to a key iff ``key_pos <= query_pos``), never from a bottom-right triangle.
  A subset of a prompt's tokens can then be recomputed against a cache holding all of them.
* A layer runs in two halves around the cache write: ``Attention.project`` gives this layer's
  Q (rotated) and K (pre-RoPE) and V for the tokens being computed; the caller writes them
  wherever its KV lives (our ``KVCache``, or another engine's paged cache) and then calls
  ``Block.attend_and_mlp`` with the layer's full K and V. ``Transformer.forward`` is the plain
  driver of that loop; ``kvservice.blend`` is the selective one.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvservice.chunk import ChunkKV, token_ids_sha256
from kvservice.kernels import FusedLinear, KernelChoice, prepare

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """A checkpoint this engine would run wrongly; refused at load time."""


# --------------------------------------------------------------------------------------------
# Config


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    rope_type: str = "default"
    rope_factor: float = 1.0
    # llama3 rope scaling only
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = False
    sliding_window: int | None = None
    model_type: str = "llama"

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any] | Any) -> ModelConfig:
        """From an HF ``config.json`` dict (or a ``PretrainedConfig``). Refuses what it would
        get wrong: other architectures, unknown RoPE scaling, partial rotary, MLP variants."""
        if not isinstance(hf, dict):
            hf = hf.to_dict()
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(
                f"hidden_act {hf.get('hidden_act')!r} is not supported (silu only)"
            )
        if float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
            raise UnsupportedModelError(
                f"partial rotary embeddings (partial_rotary_factor={hf['partial_rotary_factor']}) "
                "are not supported"
            )
        if hf.get("pretraining_tp", 1) not in (1, None):
            raise UnsupportedModelError("pretraining_tp > 1 is not supported")

        # transformers 5 nests RoPE settings in `rope_parameters`; older configs keep
        # `rope_theta` and `rope_scaling` at top level.
        rope = dict(hf.get("rope_parameters") or {})
        if hf.get("rope_scaling"):
            rope = {**hf["rope_scaling"], **rope}
        rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope scaling type {rope_type!r} is not supported "
                f"(supported: {SUPPORTED_ROPE_TYPES})"
            )
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise UnsupportedModelError("partial rotary embeddings are not supported")

        n_heads = hf["num_attention_heads"]
        dim = hf["hidden_size"]
        head_dim = hf.get("head_dim") or dim // n_heads
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
            sliding_window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        elif model_type == "mistral":
            qkv_bias = o_bias = False
            sliding_window = hf.get("sliding_window")
        else:
            qkv_bias = o_bias = bool(hf.get("attention_bias", False))
            sliding_window = None
        if (
            sliding_window is not None
            and model_type == "qwen2"
            and hf.get("max_window_layers")
            not in (
                None,
                0,
            )
        ):
            # Qwen2 applies the window only to layers >= max_window_layers; not modelled here.
            raise UnsupportedModelError("Qwen2 sliding-window attention is not supported")
        return cls(
            vocab_size=hf["vocab_size"],
            dim=dim,
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            intermediate_size=hf["intermediate_size"],
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_type=rope_type,
            rope_factor=float(rope.get("factor", 1.0)),
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            rope_original_max_position=int(rope.get("original_max_position_embeddings", 8192)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_window=sliding_window,
            model_type=model_type,
        )


# --------------------------------------------------------------------------------------------
# RoPE: pure functions. Rotate-half layout (HF's), so HF weights need no permutation.


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[D/2]`` (fp32), with Llama-3 / linear scaling applied."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
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
    inv_freq: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[..., T, D]`` for integer ``positions [..., T]`` (computed in fp32)."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)  # [..., T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., T, D]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., T, D]`` by the angles in cos/sin ``[T, D]`` (broadcast over heads)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[..., :half].to(x.dtype), sin[..., :half].to(x.dtype)  # halves are equal
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


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
    q = q.to(k.dtype)  # the cache's dtype (bfloat16 attention: kvservice.kernels)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if mask.dim() == 3:
        mask = mask[:, None]  # mask: [B, 1, S, T], broadcast over heads
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


# --------------------------------------------------------------------------------------------
# Modules


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


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
        # The products as run: q, k and v in one (kvservice.kernels), o alone.
        self.qkv = FusedLinear(self.q_proj, self.k_proj, self.v_proj)
        self.out = FusedLinear(self.o_proj)

    def project(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed hidden ``h [B, S, dim]`` -> rotated q ``[B, H, S, D]``, pre-RoPE k and v
        ``[B, H_kv, S, D]``. cos/sin ``[B, S, D]`` at the tokens' positions."""
        bsz, seqlen, _ = h.shape
        q, k, v = (t.to(h.dtype) for t in self.qkv(h))  # [B, S, H*D], [B, S, H_kv*D] x2
        q = q.view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        # q: [B, H, S, D]; k, v: [B, H_kv, S, D]
        q = apply_rope(q, cos[:, None], sin[:, None])
        return q, k, v

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        bsz, _, seqlen, _ = attn.shape
        attn = attn.transpose(1, 2).reshape(
            bsz, seqlen, self.n_heads * self.head_dim
        )  # [B, S, H*D]
        return self.out(attn)[0]


class FeedForward(nn.Module):
    """SwiGLU."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.dim, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.dim, bias=config.mlp_bias)
        self.gate_up = FusedLinear(self.gate_proj, self.up_proj)
        self.down = FusedLinear(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)  # [..., I] each (bfloat16 under onednn-bf16)
        return self.down(F.silu(gate) * up)[0]


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = FeedForward(config)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """First half of the layer: rotated q, pre-RoPE k, v for the tokens in ``x``."""
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

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
        x = x + self.self_attn.output(attn)  # fp32 residual (+ a bfloat16 product: fp32)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        self.k = torch.empty(shape, device=device, dtype=dtype)  # [L, B, H_kv, C, D], rotated
        self.v = torch.empty(shape, device=device, dtype=dtype)  # [L, B, H_kv, C, D]
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
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.head = FusedLinear(self.lm_head)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.fingerprint = ""  # set by from_pretrained / fingerprint_weights
        self.kernel_choice: KernelChoice | None = None  # set by prepare_kernels

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(self.inv_freq, positions)

    def mask(
        self, query_pos: torch.Tensor, key_pos: torch.Tensor, key_valid: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The attention mask from real positions; None when it is exactly the causal
        triangle (see ``attend``)."""
        window = self.config.sliding_window
        span = int(key_pos.max() - key_pos.min()) if key_pos.numel() else 0
        if (window is None or span < window) and is_causal_triangle(query_pos, key_pos, key_valid):
            return None
        return position_mask(query_pos, key_pos, key_valid, window)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's dtype, which attention runs in (``kvservice.kernels``)."""
        if self.kernel_choice is not None:
            return self.kernel_choice.attention_dtype
        return self.embed_tokens.weight.dtype

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))[0].float()

    def prepare_kernels(
        self, precision: str = "float32", kernel: str | None = None
    ) -> KernelChoice:
        """Pack the linear layers for the fastest kernel this device has at ``precision``
        (``kvservice.kernels``); call again after changing weights."""
        self.kernel_choice = prepare(self, precision, kernel)
        return self.kernel_choice

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
        x = self.embed_tokens(token_ids)  # x: [B, T, dim]
        cos, sin = self.rope(positions)  # [B, T, D]
        if cache is not None:
            slots = cache.reserve(positions, valid)
            key_pos, key_valid = cache.positions[:, : slots.stop], cache.valid[:, : slots.stop]
        else:
            key_pos, key_valid = positions, valid
        mask = self.mask(positions, key_pos, key_valid)  # [B, T, T_keys] or None (causal)
        collected = [] if collect_kv else None
        for i, layer in enumerate(self.layers):
            q, k, v = layer.project(x, cos, sin)
            if collected is not None:
                collected.append((k, v))
            k = apply_rope(k, cos[:, None], sin[:, None])  # k: [B, H_kv, T, D], rotated
            if cache is not None:
                cache.k[i, :, :, slots] = k
                cache.v[i, :, :, slots] = v
                k, v = cache.k[i, :, :, : slots.stop], cache.v[i, :, :, : slots.stop]
            x = layer.attend_and_mlp(x, q, k, v, mask)
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
        bfloat16 products where the CPU has them natively; ``kvservice.kernels``), or for
        ``kernel`` when given (benches)."""
        from safetensors import safe_open

        path = Path(path)
        hf_config = json.loads((path / "config.json").read_text())
        config = ModelConfig.from_hf_config(hf_config)
        with torch.device("meta"):
            model = cls(config)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        state: dict[str, torch.Tensor] = {}
        digest = hashlib.sha256(json.dumps(asdict(config), sort_keys=True).encode())
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    tensor = f.get_tensor(name)
                    state[_hf_to_ours(name)] = tensor.to(device=device, dtype=dtype)
                    # Identify weights by name, shape and a sample of content, not all bytes.
                    flat = tensor.reshape(-1)
                    digest.update(name.encode() + str(tuple(tensor.shape)).encode())
                    digest.update(flat[:: max(1, flat.numel() // 64)].float().numpy().tobytes())
        if config.tie_embeddings:
            state.pop("lm_head.weight", None)
        model.load_state_dict(state, strict=not config.tie_embeddings, assign=True)
        if config.tie_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        if missing:
            raise UnsupportedModelError(f"checkpoint {path} lacks weights: {missing[:5]}")
        model.inv_freq = rope_inv_freq(config).to(device)
        model.fingerprint = digest.hexdigest()[:32]
        model.prepare_kernels(precision, kernel)
        return model.eval()

    def fingerprint_weights(self) -> str:
        """Fingerprint an in-memory model (tests, random configs) from config and weights."""
        digest = hashlib.sha256(json.dumps(asdict(self.config), sort_keys=True).encode())
        for name, param in self.state_dict().items():
            digest.update(name.encode() + param.float().cpu().numpy().tobytes())
        self.fingerprint = digest.hexdigest()[:32]
        return self.fingerprint


def _hf_to_ours(name: str) -> str:
    """HF parameter names map onto ours by dropping the ``model.`` prefix."""
    return name.removeprefix("model.")


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
) -> list[ChunkKV]:
    """Each chunk's per-layer KV, computed after the prompt head (positions h..h+n-1).

    The head runs once; chunks of similar length share one forward, padded on the right
    (padded slots are invalid keys, so no real token sees them)."""
    device, config = model.device, model.config
    h = len(head_ids)
    head = precompute_head(model, head_ids) if h else None
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
            cos, sin = model.rope(torch.arange(h, device=device))
            for i in range(config.n_layers):
                k_head, v_head = head.layer(i)  # [H_kv, h, D]
                cache.k[i, :, :, :h] = apply_rope(k_head.to(device), cos, sin)
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


def precompute_chunk(
    model: Transformer, head_ids: Sequence[int], chunk_ids: Sequence[int]
) -> ChunkKV:
    """One chunk's KV after the prompt head (see ``precompute_chunks``)."""
    return precompute_chunks(model, head_ids, [chunk_ids])[0]
