"""A checkpoint read without loading a model: its fingerprint is the one loading gives."""

from __future__ import annotations

from kvservice.model.checkpoint import checkpoint_fingerprint
from kvservice.model.transformer import Transformer

from .test_families import tiny_family_model


def test_checkpoint_fingerprint_is_the_loaded_models(smollm2, smollm2_dir):
    # Chunk cache keys carry the fingerprint: the vLLM engine's keys must name the same objects.
    assert checkpoint_fingerprint(smollm2_dir) == smollm2.fingerprint


def test_checkpoint_fingerprint_is_the_loaded_models_for_the_new_families(tmp_path):
    """Gemma 3 and Phi-3 (fused weights split at load) too: the recipe reads every tensor
    by its checkpoint name, and the config's family fields."""
    for kind in ("gemma3", "phi3"):
        tiny_family_model(kind).save_pretrained(tmp_path / kind)
        native = Transformer.from_pretrained(tmp_path / kind).fingerprint
        assert checkpoint_fingerprint(tmp_path / kind) == native
