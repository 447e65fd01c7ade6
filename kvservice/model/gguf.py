"""A GGUF file (llama.cpp's format, the one Ollama, LM Studio and llama.cpp users keep their
models in) written out as the HF checkpoint directory the engine loads.

* ``config.json``: from the file's metadata (``{architecture}.*`` keys), one small function
  per architecture (Llama and Mistral are both ``llama`` in a GGUF; Qwen2, Qwen3, Gemma 3,
  Phi-3). What the metadata leaves out is what llama.cpp itself assumes for that
  architecture (Gemma 3: every sixth layer global, local RoPE at 10,000).
* ``model*.safetensors``: every tensor dequantized to float32 by the ``gguf`` library (any type
  it reads: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16, ...), renamed to HF's names and
  turned back where llama.cpp's converter changed it: Llama's q/k rows (permuted for its RoPE
  layout), Gemma's norm weights (stored as 1 + w). RoPE scaling stored as tensors (Llama 3's
  ``rope_freqs``, Phi-3's LongRoPE factors) goes into the config.
* the tokenizer: transformers' GGUF tokenizer builder (vocabulary, merges, special tokens,
  chat template, all from ``tokenizer.*``), saved as ``tokenizer.json``.
* ``generation_config.json``: every end-of-generation id the file names (end of sequence,
  end of turn, end of message), so answers stop where the model's own runtime stops them.

A file this engine would run wrongly (another architecture, RoPE scaling it cannot read)
is refused with ``UnsupportedModelError`` before anything is written. What this module writes
is cached by ``kvservice.model.bundled.gguf_checkpoint``: bump ``CONVERTER_VERSION``
(``kvservice.protocol.models``) when it changes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvservice.model.families import UnsupportedModelError

# float32 weights per safetensors file: bounds the memory a conversion holds
SHARD_BYTES = 2 * 2**30
# Tensors that describe RoPE, read into the config rather than loaded as weights.
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# Tokens llama.cpp ends a generation at whatever the metadata names (its vocabulary loader's
# list of end-of-generation spellings).
END_OF_GENERATION = frozenset(
    "<|eot_id|> <|eom_id|> <|im_end|> <|end|> <end_of_turn> <|endoftext|> <|end_of_text|> "
    "<EOT> _<EOT>".split()
)
# Gemma 3 as llama.cpp runs it: the metadata names neither of these.
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class GgufFile:
    """A GGUF file's metadata (every key, arrays as lists) and its tensors (memory-mapped)."""

    path: Path
    architecture: str
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf.ReaderTensor

    def get(self, key: str, default: Any = None) -> Any:
        """An architecture key, e.g. ``get("block_count")`` for ``llama.block_count``."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise UnsupportedModelError(f"{self.path} lacks {self.architecture}.{key}")
        return value


def read_gguf(path: str | Path) -> GgufFile:
    """The file's metadata and tensor table; tensor data stays on disk until read."""
    from gguf import GGUFReader

    path = Path(path)
    reader = GGUFReader(str(path))
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    architecture = metadata.get("general.architecture")
    if not isinstance(architecture, str):
        raise UnsupportedModelError(f"{path} names no general.architecture")
    return GgufFile(path, architecture, metadata, {t.name: t for t in reader.tensors})


# --------------------------------------------------------------------------------------------
# Config


def hf_config(gguf: GgufFile) -> dict[str, Any]:
    """The HF ``config.json`` dict of the model in ``gguf``."""
    family = _FAMILIES.get(gguf.architecture)
    if family is None:
        raise UnsupportedModelError(
            f"GGUF architecture {gguf.architecture!r} is not supported "
            f"(supported: {', '.join(sorted(_FAMILIES))})"
        )
    common = _common_config(gguf)
    return common | family(gguf, common)


def _common_config(gguf: GgufFile) -> dict[str, Any]:
    heads, hidden = int(gguf.require("attention.head_count")), int(gguf.require("embedding_length"))
    kv_heads = gguf.get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per layer: this engine gives every layer the same
        if len(set(kv_heads)) != 1:
            raise UnsupportedModelError(f"{gguf.path}: KV heads differ between layers")
        kv_heads = kv_heads[0]
    head_dim = int(gguf.get("attention.key_length", hidden // heads))
    if int(gguf.get("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModelError(f"{gguf.path}: keys and values of different widths")
    metadata = gguf.metadata
    return {
        "hidden_size": hidden,
        "num_hidden_layers": int(gguf.require("block_count")),
        "intermediate_size": int(gguf.require("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(gguf.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(gguf.get("context_length", 4096)),
        # the embedding's rows, as HF counts them (a tokenizer may list fewer or more)
        "vocab_size": int(gguf.tensors["token_embd.weight"].shape[-1]),
        # llama.cpp writes the output projection only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "dtype": "float32",
    }


def _has_bias(gguf: GgufFile) -> bool:
    return "blk.0.attn_q.bias" in gguf.tensors


def _rotary_dims(gguf: GgufFile, head_dim: int) -> int:
    return int(gguf.get("rope.dimension_count", head_dim))


def _llama_config(gguf: GgufFile, common: dict[str, Any]) -> dict[str, Any]:
    """Llama 2/3.x and Mistral (llama.cpp writes Mistral as ``llama``; without a sliding
    window, which Mistral v0.2 on has none of, the two are the same model)."""
    if _rotary_dims(gguf, common["head_dim"]) != common["head_dim"]:
        raise UnsupportedModelError(f"{gguf.path}: partial rotary embeddings in a Llama model")
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": _has_bias(gguf),
        "rope_parameters": _rope_parameters(gguf, common["head_dim"]),
    }


def _qwen2_config(gguf: GgufFile, common: dict[str, Any]) -> dict[str, Any]:
    return {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "use_sliding_window": False,
        "rope_parameters": _rope_parameters(gguf, common["head_dim"]),
    }


def _qwen3_config(gguf: GgufFile, common: dict[str, Any]) -> dict[str, Any]:
    return {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": _has_bias(gguf),
        "use_sliding_window": False,
        "rope_parameters": _rope_parameters(gguf, common["head_dim"]),
    }


def _gemma3_config(gguf: GgufFile, common: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's text model. Its query scale is llama.cpp's: 1/sqrt(hidden/heads) for the
    27B (62 layers), 1/sqrt(head_dim) for the others, as their HF configs have it."""
    layers, head_dim = common["num_hidden_layers"], common["head_dim"]
    scalar = common["hidden_size"] // common["num_attention_heads"] if layers == 62 else head_dim
    local = {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA}
    return {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(gguf.require("attention.sliding_window")),
        "layer_types": _gemma3_layer_types(gguf, layers),
        "final_logit_softcapping": gguf.get("final_logit_softcapping"),
        "attn_logit_softcapping": gguf.get("attn_logit_softcapping"),
        "rope_parameters": {
            "full_attention": _rope_parameters(gguf, head_dim),
            "sliding_attention": local,
        },
    }


def _gemma3_layer_types(gguf: GgufFile, layers: int) -> list[str]:
    """Which layers slide: the file's ``attention.sliding_window_pattern`` (a flag per layer,
    or a period) where it has one, else llama.cpp's every sixth layer global."""
    pattern = gguf.get("attention.sliding_window_pattern", GEMMA3_GLOBAL_EVERY)
    if isinstance(pattern, list):
        return ["sliding_attention" if slides else "full_attention" for slides in pattern]
    return [
        "full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention"
        for i in range(layers)
    ]


def _phi3_config(gguf: GgufFile, common: dict[str, Any]) -> dict[str, Any]:
    """Phi-3 and Phi-4-mini: fused qkv and gate-up weights (kept fused, as HF's), partial
    rotary where ``rope.dimension_count`` is below the head's width, LongRoPE from the
    file's factor tensors."""
    head_dim = common["head_dim"]
    rotary = _rotary_dims(gguf, head_dim) / head_dim
    window = gguf.get("attention.sliding_window")
    rope = _rope_parameters(gguf, head_dim) | {"partial_rotary_factor": rotary}
    return {
        "model_type": "phi3",
        "architectures": ["Phi3ForCausalLM"],
        "sliding_window": None if window is None else int(window),
        "partial_rotary_factor": rotary,
        "original_max_position_embeddings": rope.get(
            "original_max_position_embeddings", common["max_position_embeddings"]
        ),
        "rope_parameters": rope,
    }


_FAMILIES = {
    "llama": _llama_config,
    "qwen2": _qwen2_config,
    "qwen3": _qwen3_config,
    "gemma3": _gemma3_config,
    "phi3": _phi3_config,
}


# --------------------------------------------------------------------------------------------
# RoPE scaling: in the metadata (linear), or in tensors (Llama 3, LongRoPE)


def _rope_parameters(gguf: GgufFile, head_dim: int) -> dict[str, Any]:
    theta = float(gguf.get("rope.freq_base", 10000.0))
    if "rope_factors_short.weight" in gguf.tensors:
        return _longrope_parameters(gguf, theta)
    if "rope_freqs.weight" in gguf.tensors:
        factors = _tensor(gguf, "rope_freqs.weight").double()
        return {"rope_theta": theta} | llama3_rope_parameters(
            factors, theta, _rotary_dims(gguf, head_dim), gguf.get("context_length", 8192)
        )
    kind = gguf.get("rope.scaling.type", "none")
    if kind == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if kind == "linear":
        factor = float(gguf.require("rope.scaling.factor"))
        return {"rope_type": "linear", "factor": factor, "rope_theta": theta}
    raise UnsupportedModelError(f"{gguf.path}: RoPE scaling {kind!r} is not supported")


def _longrope_parameters(gguf: GgufFile, theta: float) -> dict[str, Any]:
    context = int(gguf.get("context_length", 4096))
    original = int(gguf.get("rope.scaling.original_context_length", context))
    rope = {
        "rope_type": "longrope",
        "rope_theta": theta,
        "short_factor": _tensor(gguf, "rope_factors_short.weight").tolist(),
        "long_factor": _tensor(gguf, "rope_factors_long.weight").tolist(),
        "original_max_position_embeddings": original,
        "factor": context / original,
    }
    attention = gguf.get("rope.scaling.attn_factor")
    return rope if attention is None else rope | {"attention_factor": float(attention)}


def llama3_rope_factors(
    theta: float, rotary_dims: int, factor: float, low: float, high: float, original: int
) -> torch.Tensor:
    """What each frequency's wavelength is multiplied by under Llama 3's RoPE scaling
    (``[R/2]``, float64): 1 for short wavelengths, ``factor`` for long ones, smoothly
    between (transformers' ``llama3`` rope type; llama.cpp stores these as ``rope_freqs``)."""
    exponents = torch.arange(0, rotary_dims, 2, dtype=torch.float64) / rotary_dims
    wavelength = 2 * math.pi * theta**exponents
    smooth = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    return 1.0 / ((1 - smooth) / factor + smooth)


def llama3_rope_parameters(
    factors: torch.Tensor, theta: float, rotary_dims: int, context: int
) -> dict[str, Any]:
    """Llama 3's ``rope_parameters`` that give ``factors`` (a GGUF's ``rope_freqs``). Every
    Llama 3.x release scales with low 1 and high 4; the factor is the largest and the
    original context is read from a smoothly scaled frequency (or, where none is, a value
    between the last unscaled and the first fully scaled wavelength). A file whose factors
    this does not reproduce is refused."""
    factor, low, high = float(factors.max()), 1.0, 4.0
    if factor == 1.0:
        return {"rope_type": "default"}
    exponents = torch.arange(0, rotary_dims, 2, dtype=torch.float64) / rotary_dims
    wavelength = 2 * math.pi * theta**exponents
    between = (factors > 1.0 + 1e-6) & (factors < factor - 1e-6)
    if between.any():  # 1/f = (1 - s)/factor + s, s = (original / wavelength - low) / (high - low)
        smooth = (1 / factors[between] - 1 / factor) / (1 - 1 / factor)
        original = float(((smooth * (high - low) + low) * wavelength[between]).median())
    else:  # any original with high-frequency cut and low-frequency cut in the gaps
        unscaled = wavelength[factors <= 1.0 + 1e-6]
        scaled = wavelength[factors >= factor - 1e-6]
        lower = float(unscaled.max()) * high if unscaled.numel() else 0.0
        upper = float(scaled.min()) * low if scaled.numel() else float(context)
        original = math.sqrt(max(lower, 1.0) * upper)
    original = round(original)
    rebuilt = llama3_rope_factors(theta, rotary_dims, factor, low, high, original)
    if not torch.allclose(rebuilt, factors, rtol=1e-4, atol=1e-6):
        raise UnsupportedModelError(
            "rope_freqs.weight is not Llama 3's RoPE scaling (low 1, high 4): not supported"
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }


# --------------------------------------------------------------------------------------------
# Tensors


# GGUF's per-layer names -> HF's (``model.layers.N.`` + this); Gemma 3's norms differ.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_LAYER_NAMES = _LAYER_NAMES | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_LAYER_NAMES = _LAYER_NAMES | {"ffn_up": "mlp.gate_up_proj"}  # gate and up, fused
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def hf_name(gguf_name: str, architecture: str) -> str:
    """The HF parameter name of the GGUF tensor ``gguf_name``."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    names = {"gemma3": _GEMMA3_LAYER_NAMES, "phi3": _PHI3_LAYER_NAMES}.get(
        architecture, _LAYER_NAMES
    )
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no place in a {architecture} model")


def _tensor(gguf: GgufFile, name: str) -> torch.Tensor:
    """Tensor ``name`` dequantized to float32, in torch's dimension order."""
    from gguf import dequantize

    tensor = gguf.tensors[name]
    values = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the fastest dim first
    values = np.asarray(values, dtype=np.float32).reshape(shape)
    # an unquantized tensor comes back as a view of the read-only memory map
    return torch.from_numpy(values if values.flags.writeable else values.copy())


def unpermute_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (its converter interleaves each head's two
    rotary halves for its RoPE kernel): rows ``[heads * D, ...]`` back to HF's layout."""
    rest = weight.shape[1:]
    grouped = weight.reshape(heads, weight.shape[0] // heads // 2, 2, *rest)
    return grouped.transpose(1, 2).reshape(weight.shape)


def hf_tensors(gguf: GgufFile, config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of ``gguf`` as ``(HF name, float32 tensor)``, one at a time."""
    for name in gguf.tensors:
        if name in ROPE_TENSORS:
            continue
        target = hf_name(name, gguf.architecture)
        weight = _tensor(gguf, name)
        if gguf.architecture == "llama" and ".attn_q." in name:
            weight = unpermute_rotary(weight, config["num_attention_heads"])
        elif gguf.architecture == "llama" and ".attn_k." in name:
            weight = unpermute_rotary(weight, config["num_key_value_heads"])
        elif gguf.architecture == "gemma3" and name.endswith("norm.weight"):
            weight = weight - 1.0  # llama.cpp stores Gemma's (1 + w) norms as 1 + w
        yield target, weight.contiguous()


def write_weights(tensors: Iterator[tuple[str, torch.Tensor]], out_dir: Path) -> None:
    """``model.safetensors``, or shards of ``SHARD_BYTES`` with HF's index when larger; only
    one shard's tensors are held at a time."""
    shard: dict[str, torch.Tensor] = {}
    held, written, names = 0, [], [[]]
    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if held and held + size > SHARD_BYTES:
            written.append(_save_shard(shard, out_dir, len(written)))
            held = 0
            names.append([])
        shard[name], held = tensor, held + size
        names[-1].append(name)
    written.append(_save_shard(shard, out_dir, len(written)))
    if len(written) == 1:
        written[0].rename(out_dir / "model.safetensors")
        return
    count, weight_map = len(written), {}
    for index, (path, shard_names) in enumerate(zip(written, names, strict=True)):
        final = out_dir / f"model-{index + 1:05d}-of-{count:05d}.safetensors"
        path.rename(final)
        weight_map |= {name: final.name for name in shard_names}
    index = {"metadata": {}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _save_shard(shard: dict[str, torch.Tensor], out_dir: Path, index: int) -> Path:
    """``shard`` written to a temporary name (renamed once the count is known), then emptied."""
    from safetensors.torch import save_file

    path = out_dir / f".shard-{index}.safetensors"
    save_file(shard, str(path), metadata={"format": "pt"})
    shard.clear()
    return path


# --------------------------------------------------------------------------------------------
# Tokenizer and generation config


def stop_ids(gguf: GgufFile) -> list[int]:
    """The ids that end a generation, as llama.cpp ends them: the end of sequence, of turn
    and of message the file names, and every token spelled as one of ``END_OF_GENERATION``
    (so an instruct Gemma's ``<end_of_turn>`` stops an answer when the file names only
    ``<eos>``)."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    named = [gguf.metadata.get(f"tokenizer.ggml.{key}") for key in keys]
    tokens = gguf.metadata.get("tokenizer.ggml.tokens") or []
    spelled = [i for i, token in enumerate(tokens) if token in END_OF_GENERATION]
    return list(dict.fromkeys(int(i) for i in [*named, *spelled] if i is not None))


def write_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """The file's tokenizer (``tokenizer.*`` metadata) as ``tokenizer.json`` and its config,
    built by transformers' GGUF tokenizer builder."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out_dir)


def write_generation_config(gguf: GgufFile, out_dir: Path) -> None:
    metadata = gguf.metadata
    generation = {
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": stop_ids(gguf),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> None:
    """Write the GGUF file ``gguf_path`` into ``out_dir`` (an existing, empty directory) as
    an HF checkpoint directory (see the module doc)."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    gguf = read_gguf(gguf_path)
    config = hf_config(gguf)
    from kvservice.model.families import ModelConfig

    ModelConfig.from_hf_config(config)  # refuses what the engine would run wrongly, early
    write_weights(hf_tensors(gguf, config), out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    write_generation_config(gguf, out_dir)
    write_tokenizer(gguf_path, out_dir)
