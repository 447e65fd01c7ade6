"""``python -m worker.kv_reencode``: stored KV objects brought to one codec, resumably, with
the chunks' recorded bytes following."""

from __future__ import annotations

import io

import pytest
import torch

from kvservice.chunk import ChunkKV
from kvservice.protocol.codecs import DEFAULT_CODEC, codec_by_name
from kvservice.protocol.keys import ChunkKey
from webapp.documents.models import Chunk, Document
from worker.kv import kv_store
from worker.kv_reencode import main

pytestmark = pytest.mark.django_db


@pytest.fixture
def user(django_user_model):
    return django_user_model.objects.create_user(username="alice", password="pw-alice-123")


def _stored(seed: int, codec: str) -> tuple[str, ChunkKV]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(4, 3, 40, 64, generator=gen)
    chunk = ChunkKV(
        list(range(seed, seed + 40)),
        k,
        torch.randn(4, 3, 40, 64, generator=gen),
        model_fingerprint="reencode-test",
        head_hash="head",
    )
    key = kv_store().store.put(chunk, tiers=[], codec=codec_by_name(codec))
    return key.to_string(), chunk


def _rows(user, keys: list[str]) -> None:
    document = Document.objects.create(
        owner=user, title="t", content_sha256="1" * 64, status=Document.Status.READY
    )
    for index, key in enumerate(keys):
        Chunk.objects.create(
            document=document,
            index=index,
            text="x",
            token_ids=[1] * 40,
            token_count=40,
            token_ids_sha256=f"{index:064x}",
            kv_key=key,
            kv_status="ready",
        )


def _run(*args: str) -> str:
    out = io.StringIO()
    assert main(list(args), out) == 0
    return out.getvalue()


def test_fp16_objects_are_reencoded_resumably_and_their_bytes_recorded(user) -> None:
    (first, chunk), (second, _), (int8, _) = (
        _stored(1, "fp16"),
        _stored(2, "fp16"),
        _stored(3, "int8"),
    )
    _rows(user, [first, second, first, int8])  # a shared object is re-encoded once
    store = kv_store()
    fp16_bytes = store.object_bytes(first)

    dry = _run("--dry-run")
    assert "3 objects" in dry and "2 would" in dry and "1 skipped" in dry
    assert store.object_bytes(first) == fp16_bytes  # a dry run writes nothing

    ordered = sorted([first, second, int8])
    head = _run("--limit", "1")
    assert "[1/1]" in head and f"--start-after {ordered[0]}" in head
    rest = _run("--start-after", ordered[0])
    assert "[2/2]" in rest

    for key in (first, second):
        assert Chunk.objects.filter(kv_key=key).first().kv_bytes == store.object_bytes(key)
        assert store.object_bytes(key) <= fp16_bytes / 3
    back = store.store.get(ChunkKey.from_string(first))
    assert (back.k.float() - chunk.k).norm() / chunk.k.norm() < 0.1  # the default codec's error
    again = _run()
    assert "2 already" in again and "1 skipped" in again  # int8 is not quantized twice
    assert Chunk.objects.get(kv_key=int8).kv_bytes == store.object_bytes(int8)


def test_an_unknown_codec_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        _run("--codec", "zip")
    assert exit_.value.code == 2 and "unknown KV codec" in capsys.readouterr().err


def test_the_command_targets_kv_codec_and_can_go_back_to_fp16(user, monkeypatch) -> None:
    from kvservice.store.format import decode_header

    key, _ = _stored(4, "fp16")
    _rows(user, [key])
    monkeypatch.setenv("KV_CODEC", DEFAULT_CODEC)
    assert f"to bring to {DEFAULT_CODEC}" in _run()
    s3 = kv_store().store.durable
    assert decode_header(s3.get(ChunkKey.from_string(key))).quantized
    assert "1 reencoded" in _run("--codec", "fp16")  # dequantized values, stored in 16 bits
    assert decode_header(s3.get(ChunkKey.from_string(key))).codec_name == "fp16"
