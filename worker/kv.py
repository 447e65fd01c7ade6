"""The KV worker's engine: the LLM that computes chunk KV and the store it writes to
(kvservice). The web process never imports this module (it loads torch).

One producer per worker process (``kv_producer()``, created lazily on the first KV task or
by the warm-up): the LLM loaded once, with the deployment's fixed prompt head. The services
that compute or re-encode KV (``webapp.documents.services``, ``webapp.kdn.services``) take
the producer and the store from the tasks (``worker/tasks.py``), in keys and token ids only.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from functools import cache
from typing import Any

from webapp.documents.kv import prompt_head_ids

log = logging.getLogger(__name__)


class KVUnavailable(RuntimeError):
    """The engine or store this step needs is not installed or not configured."""


@dataclass(frozen=True)
class Reencoded:
    """What :meth:`KVStoreClient.reencode` did to one object."""

    key: str
    codec_before: str
    codec_after: str
    bytes_before: int
    bytes_after: int
    outcome: str  # reencoded, would (a dry run), already (in the codec), skipped (quantized)


class KVStoreClient:
    """Key-level access to the durable KV store (the S3 tier of kvservice's ``TieredStore``).

    The KV worker writes straight to S3 and keeps no local tier: the inference worker's
    memory and disk tiers are its own, and S3 is the truth that deletes are decided against
    (the web side deletes objects by name: ``webapp.documents.kv.delete_kv_object``)."""

    def __init__(self) -> None:
        from kvservice.store import StoreConfig, TieredStore
        from kvservice.store.s3 import S3Tier

        config = StoreConfig.from_env()
        if not config.s3_endpoint:
            raise KVUnavailable("S3_ENDPOINT is not set: there is no KV store to write to")
        self.store = TieredStore([S3Tier(config)], quantize=config.quantize, config=config)

    @staticmethod
    def parse_key(key: str) -> Any:
        from kvservice.protocol.keys import ChunkKey

        return ChunkKey.from_string(key)

    def contains(self, key: str) -> bool:
        """Whether S3 holds the object (raises ``StoreUnavailable`` when S3 is down)."""
        s3 = self.store.durable
        assert s3 is not None
        return s3.contains(self.parse_key(key))

    def put(self, chunk: Any, scope: str = "") -> str:
        """Store a ``ChunkKV`` in S3 under ``scope``; returns its key string."""
        return self.store.put(chunk, tiers=[], write_through=True, scope=scope).to_string()

    def reencode(self, key: str, codec: str, *, write: bool = True) -> Reencoded | None:
        """Read the object, and unless it is in ``codec`` already, store it again in
        ``codec`` under the same key (``write=False``: only say what would change). None
        when S3 has no such object. An object in another quantized codec is left as it is
        (``skipped``): re-quantizing adds a second rounding; recompute it instead."""
        import torch

        from kvservice.protocol.codecs import FP16, codec_by_name
        from kvservice.store.codec import describe
        from kvservice.store.format import decode_chunk, decode_header

        target = codec_by_name(codec)
        chunk_key = self.parse_key(key)
        s3 = self.store.durable
        assert s3 is not None
        data = s3.get(chunk_key)
        if data is None:
            return None
        header = decode_header(data)
        before = header.codec_name
        narrow = self.store.config.narrow_to if header.dtype == torch.float32 else None
        wanted = describe(target.kind, target.layer_bits(header.num_layers), narrow or header.dtype)
        if wanted == before:
            return Reencoded(key, before, before, len(data), len(data), "already")
        if header.quantized and target != FP16:
            return Reencoded(key, before, before, len(data), len(data), "skipped")
        chunk = decode_chunk(data, chunk_key)  # verifies every layer and the token ids
        new = self.store.encode(chunk, target)
        if write:
            s3.put(chunk_key, new)
        return Reencoded(
            key,
            before,
            decode_header(new).codec_name,
            len(data),
            len(new),
            "reencoded" if write else "would",
        )

    def object_bytes(self, key: str) -> int | None:
        """Bytes of the stored object, as its codec wrote it (one HEAD); None if absent."""
        s3 = self.store.durable
        assert s3 is not None
        return s3.object_size(self.parse_key(key))


@cache
def kv_store() -> KVStoreClient:
    return KVStoreClient()


def _load_producer() -> Any:
    """The deployment's LLM (``MODEL_PATH``, else the bundled one) and its prompt head, as
    ``kvservice.model.producer.KVProducer``: token ids -> ChunkKV."""
    import torch
    from django.conf import settings

    from kvservice.model.bundled import resolve_llm_path
    from kvservice.model.kernels import DEFAULT_PRECISION
    from kvservice.model.producer import KVProducer
    from kvservice.model.transformer import Transformer
    from webapp.documents.chunking import llm_tokenizer

    path = resolve_llm_path(settings.MODEL_PATH or None)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    precision = settings.ENGINE_PRECISION or DEFAULT_PRECISION
    model = Transformer.from_pretrained(path, device=device, precision=precision)
    producer = KVProducer(model, prompt_head_ids(llm_tokenizer()))
    log.info(
        "KV precompute: model %s (%s), head of %d tokens",
        path,
        producer.fingerprint,
        len(producer.head_ids),
    )
    return producer


_producer_lock = threading.Lock()


def kv_producer() -> Any:
    """The process's ``KVProducer``, built on first use (a worker's warm-up thread and its
    first task may ask at once: one builds, the other waits)."""
    with _producer_lock:
        return _build_producer()


@cache
def _build_producer() -> Any:
    try:
        return _load_producer()
    except (ImportError, AttributeError) as err:
        raise KVUnavailable(f"the KV engine is not available: {err}") from err
