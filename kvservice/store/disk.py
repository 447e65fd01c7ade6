"""Local-disk tier: one file per object under ``root`` (``<fingerprint>/<head>/<sha>.kv``),
written atomically (temp file + rename); ranged reads go straight into a bytearray."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from kvservice.protocol.keys import ChunkKey
from kvservice.protocol.objects import read_fully
from kvservice.store.format import Buffer
from kvservice.store.lru import LRUTier

SUFFIX = ".kv"


class DiskTier(LRUTier):
    name = "disk"

    def __init__(self, root: str | os.PathLike[str], capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._reindex()

    def path_for(self, key: ChunkKey) -> Path:
        return self.root / (key.to_string() + SUFFIX)

    def _reindex(self) -> None:
        """Adopt objects left by an earlier process, oldest access first."""
        found = []
        for path in self.root.rglob("*" + SUFFIX):
            try:
                key = ChunkKey.from_string(str(path.relative_to(self.root))[: -len(SUFFIX)])
                stat = path.stat()
            except (ValueError, OSError):
                continue
            found.append((stat.st_atime, key, stat.st_size))
        for _, key, size in sorted(found, key=lambda item: item[0]):
            self._adopt(key, size)

    def _store(self, key: ChunkKey, data: Buffer) -> None:
        path = self.path_for(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = data.cpu().numpy() if hasattr(data, "numpy") else data
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(payload)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _load_range(self, key: ChunkKey, start: int, length: int | None) -> Buffer | None:
        try:
            with open(self.path_for(key), "rb", buffering=0) as src:
                size = os.fstat(src.fileno()).st_size
                end = size if length is None else min(size, start + length)
                view = memoryview(bytearray(max(0, end - start)))
                return view[: _read_fully(src, start, view)]
        except FileNotFoundError:
            return None

    def read_into(self, key: ChunkKey, start: int, out: memoryview) -> int | None:
        with self._lock:
            present = key in self._sizes
            if present:
                self._sizes.move_to_end(key)
        if present:
            self._meter.start()
            got = 0
            try:
                with open(self.path_for(key), "rb", buffering=0) as src:
                    got = _read_fully(src, start, out)
                self._count(hit=True)
                return got
            except FileNotFoundError:
                self._forget(key)
            finally:
                self._meter.stop(got)
        self._count(hit=False)
        return None

    def _remove(self, key: ChunkKey) -> None:
        self.path_for(key).unlink(missing_ok=True)


def _read_fully(src: Any, start: int, out: memoryview) -> int:
    src.seek(start)
    return read_fully(src, out)
