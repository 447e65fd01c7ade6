"""The model families this engine runs, as one ``ModelConfig``: Llama 2/3, Mistral, Qwen2,
Qwen3, Gemma 3 (also a multimodal checkpoint's language model) and Phi-3/Phi-4, read from a
checkpoint's HF ``config.json`` by ``ModelConfig.from_hf_config``: the fields every family
shares, its RoPE (default, linear, llama3, LongRoPE; partial rotary), then one small function
per family for what is its own. What the engine would run wrongly is refused here
(``UnsupportedModelError``), before any weight is read.

``ModelConfig.identity`` is what the model fingerprint hashes (``kvservice.model.checkpoint``): the
fields the later families added count only where they differ from their defaults, so the
older families' chunk keys stay what they were.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3", "phi3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


# What every supported family's config.json names (the rest have defaults).
_REQUIRED_KEYS = (
    "num_attention_heads",
    "hidden_size",
    "vocab_size",
    "num_hidden_layers",
    "intermediate_size",
)


class UnsupportedModelError(ValueError):
    """A checkpoint this engine would run wrongly; refused at load time."""


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
    # Added for Qwen3, Gemma 3 and Phi-3 (``_FAMILY_FIELDS``: left out of the fingerprint at
    # their defaults, so the older families' chunk keys stay what they were).
    layer_windows: tuple[int | None, ...] = ()  # per layer (Gemma 3); () = sliding_window
    local_rope_theta: float | None = None  # the sliding layers' own plain RoPE (Gemma 3)
    qk_norm: bool = False  # RMSNorm of each head's q and k before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # RMSNorm scales by offset + weight (Gemma: 1)
    sandwich_norms: bool = False  # norms after attention and around the MLP (Gemma 3)
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(dim))
    attention_scale: float | None = None  # softmax scale; None: 1/sqrt(head_dim)
    hidden_act: str = "silu"  # the gated MLP's activation
    final_logit_softcap: float | None = None  # cap * tanh(logits / cap)
    rotary_fraction: float = 1.0  # of each head's dims that RoPE turns (Phi-4-mini 0.75)
    rope_short_factor: tuple[float, ...] = ()  # longrope's per-frequency divisors (Phi-3)
    rope_attention_factor: float = 1.0  # longrope's scale of cos and sin
    max_positions: int | None = None  # positions this engine computes as HF does

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any] | Any) -> ModelConfig:
        """From an HF ``config.json`` dict (or a ``PretrainedConfig``). Refuses what it would
        get wrong: other architectures, unknown RoPE scaling, MLP variants."""
        if not isinstance(hf, dict):
            hf = hf.to_dict()
        model_type = hf.get("model_type")
        if model_type == "gemma3":  # the multimodal checkpoint: its language model
            hf = _gemma3_text_config(hf)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})"
            )
        act = hf.get("hidden_act") or hf.get("hidden_activation") or "silu"
        if act not in ACTIVATIONS:
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported ({ACTIVATIONS})")
        if hf.get("pretraining_tp", 1) not in (1, None):
            raise UnsupportedModelError("pretraining_tp > 1 is not supported")
        missing = [key for key in _REQUIRED_KEYS if key not in hf]
        if missing:
            raise UnsupportedModelError(f"config.json has no {', '.join(missing)}")
        n_heads, dim = hf["num_attention_heads"], hf["hidden_size"]
        fields = dict(
            vocab_size=hf["vocab_size"],
            dim=dim,
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or dim // n_heads,
            intermediate_size=hf["intermediate_size"],
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            model_type=hf.get("model_type", model_type),
            hidden_act=act,
        )
        fields |= _rope_fields(hf, _rope_parameters(hf))
        if fields["rotary_fraction"] != 1.0 and model_type != "phi3":  # Phi-4-mini's 0.75
            raise UnsupportedModelError(
                f"partial rotary embeddings (partial_rotary_factor={fields['rotary_fraction']}) "
                f"are not supported for {model_type!r}"
            )
        fields |= _FAMILY_OPTIONS[fields["model_type"]](hf)
        return cls(**fields)

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window (None: it attends to every earlier token)."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    def local_rope(self, layer: int) -> bool:
        """True when layer ``layer`` turns q and k by the local RoPE (Gemma 3's sliding
        layers), not the global one."""
        return self.local_rope_theta is not None and self.window(layer) is not None

    def served_context(self, declared: int) -> int:
        """The context length to serve of the checkpoint's ``max_position_embeddings``:
        LongRoPE's original context (``_longrope_fields``), else all of it."""
        return min(declared, self.max_positions or declared)

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dims RoPE turns (the first ones; the rest pass)."""
        return int(self.head_dim * self.rotary_fraction)

    def identity(self) -> dict[str, Any]:
        """What the fingerprint hashes: every field, but the later families' fields only
        where they differ from their defaults."""
        fields = asdict(self)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return {
            name: value
            for name, value in fields.items()
            if name not in _FAMILY_FIELDS or value != defaults[name]
        }


_FAMILY_FIELDS = frozenset(
    "layer_windows local_rope_theta qk_norm norm_offset sandwich_norms embed_scale "
    "attention_scale hidden_act final_logit_softcap rotary_fraction rope_short_factor "
    "rope_attention_factor max_positions".split()
)


def _gemma3_text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal Gemma 3's language model config. Its ``text_config`` may hold only what
    differs from ``Gemma3TextConfig``'s defaults (Gemma 3 4B's has six fields: no head
    counts), so the defaults are filled in by that class."""
    from transformers import Gemma3TextConfig

    text = Gemma3TextConfig(**hf.get("text_config", {})).to_dict()
    return {**text, "model_type": "gemma3_text"}


def _rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """The global layers' RoPE settings: transformers 5 nests them in ``rope_parameters``
    (per layer type for Gemma 3); older configs keep ``rope_theta`` and ``rope_scaling`` at
    top level."""
    rope = dict(hf.get("rope_parameters") or {})
    if "full_attention" in rope:
        rope = dict(rope["full_attention"] or {})
    if hf.get("rope_scaling"):
        rope = {**hf["rope_scaling"], **rope}
    return rope


def _rope_fields(hf: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    rope_type = {"su": "longrope"}.get(rope_type, rope_type)  # Phi-3's first name for it
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
        )
    rotary = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    original = rope.get("original_max_position_embeddings") or hf.get(
        "original_max_position_embeddings", 8192
    )
    fields: dict[str, Any] = dict(
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_type=rope_type,
        rope_factor=float(rope.get("factor") or 1.0),
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_original_max_position=int(original),
        rotary_fraction=rotary,
    )
    if rope_type == "longrope":
        fields |= _longrope_fields(hf, rope, int(original))
    return fields


def _longrope_fields(hf: dict[str, Any], rope: dict[str, Any], original: int) -> dict[str, Any]:
    """LongRoPE (Phi-3/Phi-4 long-context): HF turns every token by the short factors while
    the sequence stays within the original context and by the long ones past it, which
    changes every cached key's rotation at that length. This engine keeps the short factors
    and serves that original context (``max_positions``)."""
    factor = rope.get("factor") or hf.get("max_position_embeddings", original) / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return dict(
        rope_short_factor=tuple(float(f) for f in rope["short_factor"]),
        rope_attention_factor=float(attention),
        max_positions=original,
    )


def _llama_options(hf: dict[str, Any]) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias)


def _mistral_options(hf: dict[str, Any]) -> dict[str, Any]:
    return dict(sliding_window=hf.get("sliding_window"))


def _qwen2_options(hf: dict[str, Any]) -> dict[str, Any]:
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if window is not None and hf.get("max_window_layers") not in (None, 0):
        # Qwen2 applies the window only to layers >= max_window_layers; not modelled here.
        raise UnsupportedModelError("Qwen2 sliding-window attention is not supported")
    return dict(qkv_bias=True, sliding_window=window)


def _qwen3_options(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("use_sliding_window"):  # no released Qwen3 uses it
        raise UnsupportedModelError("Qwen3 sliding-window attention is not supported")
    return _llama_options(hf) | dict(qk_norm=True)


def _phi3_options(hf: dict[str, Any]) -> dict[str, Any]:
    """Phi-3/Phi-4: fused qkv and gate-up weights (split at load), a window on every layer."""
    return dict(sliding_window=hf.get("sliding_window"))


def _gemma3_options(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3: sliding-window layers with their own RoPE between global ones, (1 + weight)
    norms around attention and MLP, q/k norms, scaled embeddings and query scalar."""
    if hf.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError(
            "attention logit soft-capping (attn_logit_softcapping) is not supported: "
            "Gemma 3 checkpoints have none; this one is a Gemma 2 layout"
        )
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedModelError("bidirectional attention (an embedding model) is not supported")
    n_layers, window = hf["num_hidden_layers"], hf.get("sliding_window")
    types = hf.get("layer_types")
    if types is None:  # older configs: every sliding_window_pattern-th layer is global
        pattern = int(hf.get("sliding_window_pattern", 6))
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(n_layers)
        ]
    local = (hf.get("rope_parameters") or {}).get("sliding_attention") or {}
    local_theta = local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0))
    if local.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"local rope type {local['rope_type']!r} is not supported")
    softcap = hf.get("final_logit_softcapping")
    return dict(
        layer_windows=tuple(window if t == "sliding_attention" else None for t in types),
        local_rope_theta=float(local_theta),
        qk_norm=True,
        norm_offset=1.0,
        sandwich_norms=True,
        embed_scale=float(hf["hidden_size"]) ** 0.5,
        attention_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        qkv_bias=bool(hf.get("attention_bias", False)),
        o_bias=bool(hf.get("attention_bias", False)),
        final_logit_softcap=None if softcap is None else float(softcap),
    )


_FAMILY_OPTIONS = {
    "llama": _llama_options,
    "mistral": _mistral_options,
    "qwen2": _qwen2_options,
    "qwen3": _qwen3_options,
    "phi3": _phi3_options,
    "gemma3_text": _gemma3_options,
}
