"""Where a Ragblend process keeps its local state when nothing says otherwise: the one place
the KV store, the dev stack (``deploy.stack``) and the web settings take these defaults from:
``DATA_DIR`` (all local state), and the local-disk KV tier under it, ``DATA_DIR/kv-disk``,
unless ``KV_DISK_DIR`` says otherwise (both declared in ``kvservice.protocol.environment``).

The disk tier sits under ``DATA_DIR`` because that is where a deployment gives local state its
room: the dev stack's data directory, and the sized ``/data`` volume of the Compose and
Kubernetes inference workers. (The model cache, ``RAGBLEND_MODEL_CACHE``, is another matter:
converted weights shared by every stack of a machine:
``kvservice.protocol.models.default_cache_dir``.)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kvservice.protocol import environment

DEFAULT_DATA_DIR = environment.variable("DATA_DIR").default
KV_DISK_SUBDIR = "kv-disk"


def data_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``DATA_DIR`` (from ``environ``, else the process environment), absolute."""
    return Path(environment.read("DATA_DIR", environ)).resolve()


def kv_disk_dir(data: Path) -> Path:
    """The local-disk KV tier's directory under the data directory ``data``."""
    return data / KV_DISK_SUBDIR
