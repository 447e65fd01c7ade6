"""KV chunk store: the chunk object format, content-addressed keys, tiers (device, CPU
memory, local disk, S3/MinIO) behind one interface, and the pipelined per-layer loader.

Typical use (engine / inference worker)::

    config = StoreConfig.from_env()
    store = TieredStore.from_config(config)
    key = store.put(chunk)                       # ChunkKV -> ChunkKey (local + S3)
    loader = KVLoader(store)                     # one per process: owns the fetch threads
    batch = loader.open(keys, token_ids=ids, recompute_fn=recompute)
    k, v = batch[0].layer(0)                     # LayeredKV, layer i+1.. prefetched
    batch.stats().hidden_load_fraction; store.stats().to_dict()
"""

from __future__ import annotations

from kvservice.store.batch import LoadBatch, LoadStats
from kvservice.store.config import StoreConfig
from kvservice.store.layered import StoreLayeredKV
from kvservice.store.loader import KVLoader
from kvservice.store.tiered import StoreStats, TieredStore

__all__ = [
    "KVLoader",
    "LoadBatch",
    "LoadStats",
    "StoreConfig",
    "StoreLayeredKV",
    "StoreStats",
    "TieredStore",
]
