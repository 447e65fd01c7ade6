"""Random-weight models of a real model's shape: what a benchmark needs when it measures cost,
not answers, without downloading 16 GB of weights.

``SYNTHETIC_CONFIGS`` holds HF ``config.json`` dicts written here (``llama3-8b``: Llama-3.1-8B's
shapes, grouped-query heads and llama3 RoPE scaling); ``synthetic_config`` reads one through
``ModelConfig.from_hf_config``, the path a real checkpoint takes, optionally cut to fewer
layers. ``random_model`` builds the ``Transformer`` with seeded random weights created directly
on the device in the dtype asked for: an 8B model in bfloat16 is never materialized in float32
or on the host first.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, replace
from typing import Any

import torch
from torch import nn

from kvservice.model.families import ModelConfig
from kvservice.model.transformer import RMSNorm, Transformer, rope_inv_freq

# meta-llama/Llama-3.1-8B's config.json, less the fields the engine does not read.
LLAMA3_8B: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 131072,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
}

SYNTHETIC_CONFIGS: dict[str, dict[str, Any]] = {"llama3-8b": LLAMA3_8B}

# HF's initializer_range for Llama: linear and embedding weights ~ N(0, 0.02), norms 1, biases 0.
INIT_STD = 0.02


def synthetic_config(name: str, *, layers: int | None = None) -> ModelConfig:
    """The named shape as a ``ModelConfig``; ``layers`` keeps only the first that many."""
    if name not in SYNTHETIC_CONFIGS:
        raise ValueError(f"unknown synthetic model {name!r} (one of {sorted(SYNTHETIC_CONFIGS)})")
    config = ModelConfig.from_hf_config(SYNTHETIC_CONFIGS[name])
    if layers is not None:
        if not 1 <= layers <= config.n_layers:
            raise ValueError(f"{name} has 1 to {config.n_layers} layers, not {layers}")
        config = replace(config, n_layers=layers)
    return config


@torch.no_grad()
def random_model(
    config: ModelConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Transformer:
    """A ``Transformer`` of ``config`` with random weights, each created on ``device`` in
    ``dtype`` and drawn from a generator seeded with ``seed`` (the same model on the same
    kind of device; CPU and CUDA generators differ)."""
    device = torch.device(device)
    with torch.device("meta"):
        model = Transformer(config)
    generator = torch.Generator(device=device).manual_seed(seed)
    made: dict[int, nn.Parameter] = {}  # a tied weight is one parameter in two modules
    for module in model.modules():
        for name, meta in list(module.named_parameters(recurse=False)):
            if id(meta) not in made:
                weight = torch.empty(meta.shape, dtype=dtype, device=device)
                if isinstance(module, RMSNorm):
                    weight.fill_(1.0)
                elif name == "bias":
                    weight.zero_()
                else:
                    weight.normal_(0.0, INIT_STD, generator=generator)
                made[id(meta)] = nn.Parameter(weight, requires_grad=False)
            setattr(module, name, made[id(meta)])
    model.inv_freq = rope_inv_freq(config).to(device)
    # Hashing every weight (as fingerprint_weights does) would read 16 GB for an 8B model;
    # the config, seed and dtype name these weights as well.
    identity = json.dumps({"config": asdict(config), "seed": seed, "dtype": str(dtype)})
    model.fingerprint = "synthetic-" + hashlib.sha256(identity.encode()).hexdigest()[:22]
    return model.eval()
