"""An HF checkpoint directory (``config.json`` and ``*.safetensors``) as this engine reads it:
its config (``checkpoint_config``), its tensors under our parameter names
(``checkpoint_state``: mmapped, a multimodal model's vision tower left out, Phi-3's fused
weights split), and its fingerprint, the model identity every chunk KV key carries.

The fingerprint is computed here and only here: while the native engine loads the weights
(``checkpoint_state``, for ``Transformer.from_pretrained``) and without loading them
(``checkpoint_fingerprint``, for the vLLM engine, which loads its own), the same recipe over
the same tensors. It hashes the config's identity (``ModelConfig.identity``), then each
tensor's name, shape and a sample of 64 of its values, in file and key order: hashing every
byte of an 8B model would take about as long as loading it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from kvservice.model.families import ModelConfig


def checkpoint_config(path: str | Path) -> ModelConfig:
    """The checkpoint's ``config.json`` as a ``ModelConfig`` (refusing what the engine would
    run wrongly)."""
    return ModelConfig.from_hf_config(json.loads((Path(path) / "config.json").read_text()))


def checkpoint_state(
    path: str | Path, config: ModelConfig, device: torch.device | str, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], str]:
    """The checkpoint's weights under our parameter names, on ``device`` in ``dtype``, and
    its fingerprint."""
    state: dict[str, torch.Tensor] = {}
    fingerprint = _Fingerprint(config)
    for name, tensor in _tensors(Path(path)):
        fingerprint.add(name, tensor)
        ours = _hf_to_ours(name)
        if ours is None:  # a multimodal checkpoint's vision tower
            continue
        for part, value in _split_fused(ours, tensor, config):
            state[part] = value.to(device=device, dtype=dtype)
    return state, fingerprint.hexdigest()


def checkpoint_fingerprint(path: str | Path) -> str:
    """The fingerprint ``Transformer.from_pretrained(path)`` gives, without loading a model:
    each tensor read through safetensors' mmap, one at a time."""
    fingerprint = _Fingerprint(checkpoint_config(path))
    for name, tensor in _tensors(Path(path)):
        fingerprint.add(name, tensor)
    return fingerprint.hexdigest()


class _Fingerprint:
    """The recipe (see the module's doc)."""

    def __init__(self, config: ModelConfig) -> None:
        self._digest = hashlib.sha256(json.dumps(config.identity(), sort_keys=True).encode())

    def add(self, name: str, tensor: torch.Tensor) -> None:
        flat = tensor.reshape(-1)
        self._digest.update(name.encode() + str(tuple(tensor.shape)).encode())
        self._digest.update(flat[:: max(1, flat.numel() // 64)].float().numpy().tobytes())

    def hexdigest(self) -> str:
        return self._digest.hexdigest()[:32]


def _tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint's safetensors files (mmapped), in file and key order."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


# A multimodal Gemma 3's language model, as transformers 5 and the original checkpoints name it.
_LANGUAGE_MODEL_PREFIXES = ("model.language_model.", "language_model.model.")
_VISION_PREFIXES = (
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "vision_tower.",
    "multi_modal_projector.",
)


def _hf_to_ours(name: str) -> str | None:
    """HF parameter names map onto ours by dropping the ``model.`` prefix (a multimodal
    checkpoint's language model prefix); None for a vision tower's weights."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for prefix in _LANGUAGE_MODEL_PREFIXES:
        if name.startswith(prefix):
            return name.removeprefix(prefix)
    return name.removeprefix("language_model.").removeprefix("model.")


def _split_fused(
    name: str, tensor: torch.Tensor, config: ModelConfig
) -> list[tuple[str, torch.Tensor]]:
    """Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` as our separate parts (views; the
    kernels fuse them again, ``kvservice.model.kernels.FusedLinear``); other weights as they are."""
    if ".self_attn.qkv_proj." in name:
        q_rows, kv_rows = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
        parts, sizes = ("q_proj", "k_proj", "v_proj"), [q_rows, kv_rows, kv_rows]
        pieces = tensor.split(sizes, dim=0)
        return [(name.replace("qkv_proj", p), t) for p, t in zip(parts, pieces, strict=True)]
    if ".mlp.gate_up_proj." in name:
        gate, up = tensor.chunk(2, dim=0)  # gate first, as Phi-3's MLP reads them
        return [
            (name.replace("gate_up_proj", "gate_proj"), gate),
            (name.replace("gate_up_proj", "up_proj"), up),
        ]
    return [(name, tensor)]
