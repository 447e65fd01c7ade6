"""The web side's adapter onto the KV engine and the KV store (kvservice).

One object per worker process (``kv_precomputer()``, created lazily on the first KV task):
the LLM loaded once, the deployment's fixed prompt head, and the store's S3 tier. Services
talk to it in keys and token ids only, so the Celery and Django code never touches tensors.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from functools import cache
from typing import Any

log = logging.getLogger(__name__)


class KVUnavailable(RuntimeError):
    """The engine or store this step needs is not installed or not configured."""


class KVStoreClient:
    """Key-level access to the shared KV bucket (no model): contains / delete.

    Used by deletes (from the web process), so it must not load the LLM."""

    def __init__(self) -> None:
        from kvservice.store.config import StoreConfig
        from kvservice.store.s3 import S3Tier

        config = StoreConfig.from_env()
        if not config.s3_endpoint:
            raise KVUnavailable("S3_ENDPOINT is not set: there is no KV store to write to")
        self.tier = S3Tier(config)

    @staticmethod
    def parse_key(key: str) -> Any:
        from kvservice.store.keys import ChunkKey

        return ChunkKey.from_string(key)

    def contains(self, key: str) -> bool:
        return self.tier.contains(self.parse_key(key))

    def put(self, key: str, data: Any) -> None:
        self.tier.put(self.parse_key(key), data)

    def delete(self, key: str) -> bool:
        return self.tier.delete(self.parse_key(key))


@cache
def kv_store() -> KVStoreClient:
    return KVStoreClient()


def prompt_head_ids(tokenizer: Any) -> list[int]:
    """The deployment's fixed prompt head, as the engine defines it (every chunk is computed
    after it, and its hash is part of the chunk key)."""
    from kvservice import engine

    return list(engine.prompt_head_ids(tokenizer))


class KVPrecomputer:
    """The LLM (loaded once per process) plus the prompt head: token ids -> encoded KV."""

    def __init__(self) -> None:
        import torch

        from kvservice.bundled import resolve_llm_path
        from kvservice.model import Transformer, head_hash
        from webapp.documents.chunking import llm_tokenizer

        path = resolve_llm_path(os.environ.get("MODEL_PATH") or None)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = Transformer.from_pretrained(path, device=device)
        self.tokenizer = llm_tokenizer()
        self.head_ids = prompt_head_ids(self.tokenizer)
        self.head_hash = head_hash(self.head_ids)
        self.fingerprint: str = self.model.fingerprint
        log.info("KV precompute: model %s (%s), head of %d tokens", path, self.fingerprint,
                 len(self.head_ids))  # fmt: skip

    def key_for(self, token_ids: Sequence[int]) -> str:
        from kvservice.store.keys import ChunkKey

        return ChunkKey.for_tokens(self.fingerprint, self.head_hash, token_ids).to_string()

    def compute(self, chunks_ids: Sequence[Sequence[int]]) -> list[bytearray]:
        """Each chunk's KV after the prompt head, serialized in the store's format."""
        from kvservice.model import precompute_chunks
        from kvservice.store.format import encode_chunk

        quantize = os.environ.get("KV_QUANTIZE", "").strip().lower() in {"1", "true", "yes", "on"}
        return [
            encode_chunk(kv, quantize=quantize)
            for kv in precompute_chunks(self.model, self.head_ids, chunks_ids)
        ]


@cache
def kv_precomputer() -> KVPrecomputer:
    try:
        return KVPrecomputer()
    except (ImportError, AttributeError) as err:
        raise KVUnavailable(f"the KV engine is not available: {err}") from err
