"""Random-weight models of a real shape (kvservice.tools.synthetic): the Llama-3-8B config is that
model's, and the weights are seeded, in the dtype and on the device asked for."""

from __future__ import annotations

import pytest
import torch

from kvservice.model.families import ModelConfig
from kvservice.model.transformer import RMSNorm, Transformer, rope_inv_freq
from kvservice.tools.synthetic import INIT_STD, LLAMA3_8B, random_model, synthetic_config

from .conftest import TINY_COMMON

LLAMA_3_1_8B_PARAMETERS = 8_030_261_248  # the published model's parameter count


def _tiny(**overrides) -> ModelConfig:
    return ModelConfig.from_hf_config({"model_type": "llama", **TINY_COMMON, **overrides})


def test_llama3_8b_has_llama_3_1_8b_shape_and_rope():
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = synthetic_config("llama3-8b")
    assert (config.dim, config.n_layers, config.n_heads, config.n_kv_heads) == (4096, 32, 32, 8)
    assert (config.head_dim, config.intermediate_size, config.vocab_size) == (128, 14336, 128256)
    assert (config.rope_type, config.rope_theta, config.rope_factor) == ("llama3", 500000.0, 8.0)
    assert config.rope_original_max_position == 8192 and not config.tie_embeddings
    with torch.device("meta"):  # counted without allocating 32 GB
        model = Transformer(config)
    assert sum(p.numel() for p in model.parameters()) == LLAMA_3_1_8B_PARAMETERS
    # The frequencies transformers derives from the same config.json.
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](transformers.LlamaConfig(**LLAMA3_8B), "cpu")
    torch.testing.assert_close(rope_inv_freq(config), expected.float(), rtol=1e-6, atol=0)


def test_layers_keeps_the_first_n_and_refuses_what_is_not_there():
    two = synthetic_config("llama3-8b", layers=2)
    assert two.n_layers == 2 and two.dim == 4096 and two.vocab_size == 128256
    for layers in (0, 33):
        with pytest.raises(ValueError, match="1 to 32 layers"):
            synthetic_config("llama3-8b", layers=layers)
    with pytest.raises(ValueError, match="unknown synthetic model"):
        synthetic_config("llama3-70b")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_model_is_seeded_and_made_in_the_dtype_asked(dtype):
    config = _tiny()
    model = random_model(config, seed=3, dtype=dtype)
    state = model.state_dict()
    assert all(t.dtype == dtype and t.device.type == "cpu" for t in state.values())
    assert not any(p.requires_grad for p in model.parameters())
    again = random_model(config, seed=3, dtype=dtype).state_dict()
    assert all(torch.equal(state[name], again[name]) for name in state)
    other = random_model(config, seed=4, dtype=dtype)
    assert not torch.equal(state["layers.0.mlp.up_proj.weight"], other.layers[0].mlp.up_proj.weight)
    assert other.fingerprint != model.fingerprint
    in_float16 = random_model(config, seed=3, dtype=torch.float16)
    assert in_float16.fingerprint != random_model(config, seed=3).fingerprint
    # HF's Llama init: norms 1, the rest ~ N(0, 0.02)
    norms = [m.weight for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * config.n_layers + 1 and all(bool((w == 1).all()) for w in norms)
    up = state["layers.0.mlp.up_proj.weight"].float()  # 6,144 draws
    assert up.std().item() == pytest.approx(INIT_STD, rel=0.05) and abs(up.mean()) < 1e-3
    torch.testing.assert_close(model.inv_freq, rope_inv_freq(config), rtol=0, atol=0)
    ids = torch.randint(0, config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    logits, _ = model(ids, torch.arange(20)[None])
    assert logits.shape == (1, config.vocab_size) and bool(logits.isfinite().all())


def test_a_tied_embedding_stays_one_parameter():
    model = random_model(_tiny(tie_word_embeddings=True))
    assert model.lm_head.weight is model.embed_tokens.weight
    assert random_model(_tiny()).lm_head.weight is not random_model(_tiny()).embed_tokens.weight
