"""Fixtures for the KV engine tests: tiny random HF checkpoints (exact and fast on CPU) and
the bundled SmolLM2 converted once into the model cache dir (RAGBLEND_MODEL_CACHE or
~/.cache/ragblend/models) and reused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TINY_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked ``gpu`` need a CUDA device: skipped where there is none."""
    if item.get_closest_marker("gpu") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def tiny_hf_model(kind: str):
    """A tiny random HF model of one family, with the family's distinguishing options on."""
    import transformers

    torch.manual_seed({"llama": 0, "mistral": 1, "qwen2": 2}[kind])
    if kind == "llama":
        config = transformers.LlamaConfig(
            **TINY_COMMON,
            rope_theta=50000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=True,
        )
        model = transformers.LlamaForCausalLM(config)
    elif kind == "mistral":
        config = transformers.MistralConfig(
            **TINY_COMMON, sliding_window=None, tie_word_embeddings=False
        )
        model = transformers.MistralForCausalLM(config)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**TINY_COMMON, tie_word_embeddings=False)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        raise ValueError(kind)
    return perturbed(model)


def perturbed(model):
    """``model`` in eval mode with its biases and norms moved off the values random init
    leaves them at (0 and 1, or 0 for Gemma's 1 + weight norms), so a test can see them."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Tiny random Llama (llama3 rope scaling, tied), Mistral and Qwen2 (qkv bias) dirs."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for kind in ("llama", "mistral", "qwen2"):
        model = tiny_hf_model(kind)
        model.save_pretrained(root / kind, safe_serialization=True)
        out[kind] = root / kind
    return out


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoints):
    from kvservice.model.transformer import Transformer

    return Transformer.from_pretrained(tiny_checkpoints["llama"], device="cpu")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    # The product's own cache dir: converted once per machine, then reused (fast).
    from kvservice.model.bundled import smollm2_checkpoint
    from kvservice.protocol.models import default_cache_dir

    return smollm2_checkpoint(default_cache_dir())


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    from kvservice.model.transformer import Transformer

    return Transformer.from_pretrained(smollm2_dir, device="cpu")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture
def meta_model(tiny_checkpoints):
    """The tiny model on the meta device: every operator has a device, none computes, and a
    tensor made on the host stands out (``test_graphs.OffDevice``)."""
    from kvservice.model.transformer import Transformer

    model = Transformer.from_pretrained(tiny_checkpoints["llama"], device="cpu")
    model.prepare_kernels()
    return model.to("meta")  # packed again from the meta weights, as on CUDA: the torch kernel
