"""The blender's view of a checkpoint, without starting vLLM."""

from __future__ import annotations


def test_a_vllm_model_without_its_familys_modules_is_refused_by_name(tmp_path):
    """A Qwen3 config over a model whose attention has no q/k norms (what an older vLLM's
    Llama layer would give) is refused at attach time, the missing modules named."""
    import pytest
    import torch
    from torch import nn

    from kvservice.model.checkpoint import checkpoint_config
    from kvservice.vllm.blender import VllmBackedTransformer

    from ..test_families import tiny_family_model

    tiny_family_model("qwen3").save_pretrained(tmp_path)
    config = checkpoint_config(tmp_path)
    layer = nn.Module()
    layer.input_layernorm = layer.post_attention_layernorm = nn.Identity()
    layer.mlp, layer.self_attn = nn.Identity(), nn.Module()
    layer.self_attn.qkv_proj = layer.self_attn.o_proj = nn.Identity()
    vllm_model = nn.Module()
    vllm_model.model = nn.Module()
    vllm_model.model.layers = nn.ModuleList(layer for _ in range(config.n_layers))
    vllm_model.model.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
    vllm_model.model.norm = nn.Identity()
    with pytest.raises(TypeError, match=r"self_attn\.q_norm.*'qwen3'"):
        VllmBackedTransformer(vllm_model, config)
    layer.self_attn.q_norm = layer.self_attn.k_norm = nn.Identity()
    wrapped = VllmBackedTransformer(vllm_model, config)  # now it has what Qwen3 needs
    assert wrapped.inv_freq.dtype == torch.float32


def test_max_model_len_is_lowered_to_what_the_checkpoint_declares(tmp_path):
    import json

    from kvservice.vllm.engine import _served_model_len

    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "max_position_embeddings": 1024})
    )
    assert _served_model_len(str(tmp_path), 4096) == 1024  # vLLM would refuse 4096
    assert _served_model_len(str(tmp_path), 512) == 512
