"""The LLM checkpoint a process runs, converted where it comes as a GGUF file.

Where the files are (the bundled models, ``MODEL_PATH``, the model cache) and the checks on
them are torch-free, in ``kvservice.protocol.models``, which the web app reads too. Here is
the part that loads torch: a GGUF file (the bundled SmolLM2, or any ``MODEL_PATH=FILE.gguf``
of a supported family) is converted once (``kvservice.model.gguf``: dequantized to float32,
config and tokenizer from its metadata) into an HF checkpoint directory in the model cache
dir, named by the file's identity (``gguf_dir_name``), and reused afterwards. The conversion
writes into a temporary directory and renames it into place, so a killed conversion never
leaves a half directory behind.

``resolve_llm_path`` is the one place that decides which LLM checkpoint a process runs:
``MODEL_PATH`` or the bundled one. ``python -m kvservice.model.bundled [MODEL_PATH]`` converts
it and prints its directory (what a process that must not load torch runs:
``kvservice.protocol.models.converted_llm_dir``; the image's build runs it too).
"""

from __future__ import annotations

import contextlib
import fcntl
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kvservice.protocol.models import (
    ModelPathError,
    check_checkpoint_dir,
    default_cache_dir,
    gguf_dir_name,
    is_converted,
    llm_gguf_file,
    smollm2_gguf_path,
)


def gguf_checkpoint(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """The GGUF file ``gguf_path`` as an HF checkpoint directory in ``cache_dir``, converted
    on first use (``kvservice.model.gguf.convert_gguf``), atomically."""
    from kvservice.model.gguf import convert_gguf

    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    name = gguf_dir_name(gguf_path)
    target = cache_dir / name
    if is_converted(target):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # One process converts; the others (the web process, each ingest pool process and the
    # inference worker start at once on a fresh machine) wait for it and use its directory.
    with _locked(cache_dir / f".{name}.lock"):
        if is_converted(target):
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir))
        try:
            convert_gguf(gguf_path, staging)
            if target.exists():  # an incomplete leftover from older code or a manual copy
                shutil.rmtree(target)
            try:
                staging.rename(target)
            except OSError:  # a process that came after the lock's file was gone was first
                if not is_converted(target):
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


def resolve_llm_path(model_path: str | None, cache_dir: Path | None = None) -> Path:
    """The LLM checkpoint dir to serve: ``model_path`` (e.g. from ``MODEL_PATH``) when given,
    a directory as it is, a ``.gguf`` file converted into ``cache_dir`` on first use; else
    the bundled SmolLM2 (converted likewise). The directory is
    ``kvservice.protocol.models.llm_checkpoint_dir``'s."""
    gguf = llm_gguf_file(model_path)  # checks model_path first: nothing converts a bad one
    if gguf is None:
        return Path(model_path or "").expanduser()
    return check_checkpoint_dir(gguf_checkpoint(gguf, cache_dir))


def main(argv: list[str]) -> int:
    """Convert ``argv[0]`` (a ``MODEL_PATH``; empty or absent: the bundled model) into the
    model cache and print its directory; status 2 and the reason on a bad one."""
    from kvservice.model.families import UnsupportedModelError

    try:
        print(resolve_llm_path(argv[0] if argv else None))
    except (ModelPathError, UnsupportedModelError) as error:
        print(f"model: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
