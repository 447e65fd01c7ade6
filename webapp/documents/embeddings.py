"""Chunk embeddings with the bundled all-MiniLM-L6-v2 (sentence-transformers, offline).

The model is loaded once per process. MiniLM reads at most 256 word pieces; a chunk of ~512
LLM tokens is longer, so a long chunk is embedded as the normalized mean of its windows
rather than silently truncated to its first half.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np

EMBEDDING_DIM = 384


_embedder_lock = threading.Lock()


def embedder() -> Any:
    """The process's MiniLM, loaded on first use (thread-safe: one load per process)."""
    with _embedder_lock:
        return _load_embedder()


def embedder_loaded() -> bool:
    """Whether this process has loaded the embedder (without loading it)."""
    return _load_embedder.cache_info().currsize > 0


def warm_up_in_background() -> threading.Thread:
    """Load the embedder in a daemon thread: the web server calls this at start, so the
    first question does not wait for the model (~25 s on a 2-core machine)."""

    def load() -> None:
        try:
            embedder()
        except Exception:  # the first question will raise it to whoever asks
            logging.getLogger(__name__).exception("embedder warm-up failed")

    thread = threading.Thread(target=load, name="embedder-warm-up", daemon=True)
    thread.start()
    return thread


@cache
def _load_embedder() -> Any:
    import torch
    from sentence_transformers import SentenceTransformer

    from kvservice.protocol.models import minilm_path

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = SentenceTransformer(str(minilm_path()), device="cpu", local_files_only=True)
    dim = model.get_embedding_dimension()
    if dim != EMBEDDING_DIM:
        raise RuntimeError(
            f"the embedder makes {dim}-d vectors; the Chunk column holds {EMBEDDING_DIM}"
        )
    return model


def _windows(model: Any, text: str) -> list[str]:
    tokenizer = model.tokenizer
    limit = model.max_seq_length - 2  # [CLS] and [SEP]
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    if len(ids) <= limit:
        return [text]
    step = limit
    return [tokenizer.decode(ids[start : start + limit]) for start in range(0, len(ids), step)]


def embed_texts(texts: Sequence[str], *, batch_size: int = 32) -> list[list[float]]:
    """One unit-length 384-d vector per text (cosine distance ready)."""
    if not texts:
        return []
    model = embedder()
    windows: list[str] = []
    owners: list[int] = []
    for index, text in enumerate(texts):
        for window in _windows(model, text):
            windows.append(window)
            owners.append(index)
    vectors = model.encode(
        windows,
        batch_size=batch_size,
        normalize_embeddings=True,
        convert_to_numpy=True,
        show_progress_bar=False,
    )
    out = np.zeros((len(texts), vectors.shape[1]), dtype=np.float32)
    np.add.at(out, np.asarray(owners), vectors)
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    out /= np.maximum(norms, 1e-12)
    return out.tolist()
