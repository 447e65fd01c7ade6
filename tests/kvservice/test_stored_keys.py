"""An inference worker whose chunk keys would match none of the stored chunks' (another
KV_PREAMBLE or MODEL_PATH than ingest's) says so at start, naming the variable, against a
real S3 gateway."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

import pytest

from kvservice.config import WorkerConfig, check_stored_keys
from kvservice.protocol.keys import ChunkKey
from kvservice.protocol.prompt import PromptFormat
from kvservice.store.config import StoreConfig
from kvservice.store.tiered import TieredStore

FINGERPRINT = "0123456789abcdef0123456789abcdef"
BASE = {"REDIS_URL": "redis://127.0.0.1:1/0"}


@dataclass
class LoadedWorker:
    """What ``check_stored_keys`` reads of a loaded runtime (either engine's): its store, its
    tokenizer and the keys it looks chunks up by. The model itself is not needed."""

    store: TieredStore
    tokenizer: object
    fingerprint: str
    kv_preamble: bool

    def chunk_key(self, token_ids: list[int], scope: str = "") -> ChunkKey:
        head = PromptFormat.for_tokenizer(self.tokenizer, preamble=self.kv_preamble).storage_hash
        return ChunkKey.for_tokens(self.fingerprint, head, token_ids, scope)


@pytest.fixture
def store(s3_service) -> TieredStore:
    env = {**s3_service.env, "KV_S3_PREFIX": f"keys-{uuid.uuid4().hex[:12]}/"}
    return TieredStore.from_config(StoreConfig.from_env({**env, "KV_DISK_CAPACITY_BYTES": "0"}))


def _ingested(store: TieredStore, worker: LoadedWorker, count: int = 3) -> None:
    """Chunk objects as ingest stores them: under the ingest side's keys, in users' scopes."""
    for index in range(count):
        key = worker.chunk_key([index, index + 1], scope=f"u{index + 1}")
        store.durable.put(key, b"chunk KV object")


def _check(worker: LoadedWorker, **env: str) -> str | None:
    config = WorkerConfig.from_env({**BASE, **env})
    return check_stored_keys(worker, config)


def test_a_worker_with_another_kv_preamble_says_so_by_name(
    store, smollm2_tokenizer, caplog
) -> None:
    _ingested(store, LoadedWorker(store, smollm2_tokenizer, FINGERPRINT, kv_preamble=True))
    worker = LoadedWorker(store, smollm2_tokenizer, FINGERPRINT, kv_preamble=False)
    with caplog.at_level(logging.WARNING, logger="kvservice.config"):
        problem = _check(worker, KV_PREAMBLE="off")
    assert problem is not None
    assert "the stored chunks were made with KV_PREAMBLE=on" in problem
    assert "this worker has KV_PREAMBLE=off" in problem
    assert "KV_PREAMBLE=on" in caplog.text  # in the worker's log too


def test_a_worker_that_agrees_with_the_stored_chunks_says_nothing(store, smollm2_tokenizer):
    _ingested(store, LoadedWorker(store, smollm2_tokenizer, FINGERPRINT, kv_preamble=True))
    agreeing = LoadedWorker(store, smollm2_tokenizer, FINGERPRINT, kv_preamble=True)
    assert _check(agreeing, KV_PREAMBLE="on") is None


def test_a_worker_with_another_model_names_model_path(store, smollm2_tokenizer) -> None:
    _ingested(store, LoadedWorker(store, smollm2_tokenizer, FINGERPRINT, kv_preamble=False))
    other = LoadedWorker(store, smollm2_tokenizer, "f" * 32, kv_preamble=False)
    problem = _check(other, MODEL_PATH="/models/other")
    assert problem is not None
    assert "the stored chunks were made with another MODEL_PATH" in problem
    assert "this worker has MODEL_PATH=/models/other" in problem


def test_nothing_stored_yet_or_no_s3_tier_is_no_disagreement(store, smollm2_tokenizer) -> None:
    worker = LoadedWorker(store, smollm2_tokenizer, FINGERPRINT, kv_preamble=False)
    assert _check(worker) is None  # a fresh stack: nothing to disagree with
    no_s3 = TieredStore.from_config(StoreConfig(s3_endpoint=None, disk_capacity_bytes=0))
    assert _check(LoadedWorker(no_s3, smollm2_tokenizer, FINGERPRINT, False)) is None


@pytest.mark.slow
def test_the_inference_worker_says_it_at_start_in_its_log_and_heartbeat(
    s3_service, redis_service, smollm2_dir, smollm2_tokenizer, tmp_path
) -> None:
    """The real worker (bundled model, KV_PREAMBLE=off) started on a store whose chunks were
    made with KV_PREAMBLE=on: it starts, and says which variable differs."""
    from kvservice.model.checkpoint import checkpoint_fingerprint
    from tests.conftest import started_inference_worker

    tag = f"keys-{uuid.uuid4().hex[:12]}"
    config = StoreConfig.from_env({**s3_service.env, "KV_S3_PREFIX": f"{tag}/"})
    store = TieredStore.from_config(config)
    fingerprint = checkpoint_fingerprint(smollm2_dir)
    _ingested(store, LoadedWorker(store, smollm2_tokenizer, fingerprint, kv_preamble=True))
    env = {"KV_S3_PREFIX": f"{tag}/", "KV_PREAMBLE": "off"}
    with started_inference_worker(tmp_path, tag, env) as (beat, log):
        assert "the stored chunks were made with KV_PREAMBLE=on" in beat["key_check"]
        assert "this worker has KV_PREAMBLE=off" in log.read_text()
