"""The benchmarks' data: the CacheBlend paper's Musique examples in ``../shared/data``
beside the checkout (``RAGBLEND_SHARED_DATA`` names another folder)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR_VARIABLE = "RAGBLEND_SHARED_DATA"


def shared_data(name: str = "musique_dev.json") -> Path:
    """``name`` in the shared data folder: ``$RAGBLEND_SHARED_DATA``, else ``../shared/data``
    relative to the repository root."""
    folder = os.environ.get(DATA_DIR_VARIABLE) or REPO_ROOT.parent / "shared" / "data"
    return Path(folder) / name


def passage_texts(example: dict, passages: int) -> list[str]:
    """A Musique example's first ``passages`` passages, each its title and text."""
    ctxs = example["ctxs"][:passages]
    return [f"{p['title']}\n{p['text']}" if p.get("title") else p["text"] for p in ctxs]
