"""The blender's view of a checkpoint, without starting vLLM."""

from __future__ import annotations


def test_checkpoint_fingerprint_is_the_native_models(smollm2, smollm2_dir):
    from kvservice.vllm.blender import checkpoint_fingerprint

    # Chunk cache keys carry the fingerprint: vLLM-side keys must name the same objects.
    assert checkpoint_fingerprint(smollm2_dir) == smollm2.fingerprint
