from __future__ import annotations

import pytest
import torch

from bench.staging import StoreBench
from tests.kvservice.store.conftest import L, make_chunk


@pytest.mark.parametrize("tier", ["device", "cpu", "disk", "s3"])
def test_bench_stages_in_one_tier_and_reports_loading(tier, s3_service):
    chunks = [make_chunk(60 + i) for i in range(3)]
    environ = {**s3_service.env, "KV_STORE_DTYPE": "float32", "KV_CODEC": "fp16"}  # exact
    bench = StoreBench(tier, environ=environ)
    try:
        bench.stage(chunks)
        key = bench._keys[id(chunks[0])]
        assert bench.store.where(key) == tier
        assert bench.sources(chunks, "full") == chunks  # full reads no cached KV
        prefix = bench.sources(chunks, "prefix")
        assert prefix[1:] == [None, None]
        for mode in ("blend", "blend"):
            sources = bench.sources(chunks, mode)
            for i in range(L):
                for source, chunk in zip(sources, chunks, strict=True):
                    assert torch.equal(source.layer(i)[0], chunk.k[i])
        report = bench.report("blend", prompt_tokens=60, num_layers=L, full_ttft_s=0.5)
        assert report["tier"] == tier and report["load_s"] > 0
        assert 0.0 <= report["hidden_load_fraction"] <= 1.0
        assert 0.15 <= report["ratio_chosen"] <= 1.0
        assert (
            bench.report("full", prompt_tokens=60, num_layers=L, full_ttft_s=0.5)["load_s"] == 0.0
        )
        assert bench.store.where(key) == tier  # no promotion: every repeat starts there
    finally:
        bench.close()


def test_staging_the_same_chunks_again_encodes_them_once(monkeypatch):
    chunks = [make_chunk(60 + i) for i in range(2)]
    bench = StoreBench("cpu", environ={"KV_CODEC": "kivi4"})
    try:
        encoded = []
        encode = bench.store.encode
        monkeypatch.setattr(bench.store, "encode", lambda c: encoded.append(c) or encode(c))
        bench.stage(chunks)
        bench.stage(chunks)  # the timed runs' stage: the same objects, not encoded again
        assert len(encoded) == 2
        bench.stage(chunks[1:])  # another example: only its chunks are kept
        assert len(encoded) == 2
        assert bench.sources(chunks[1:], "reuse")[0].layer(0)[0].shape == chunks[1].k[0].shape
        bench.stage(chunks)  # the first chunk was dropped with its example: encoded again
        assert len(encoded) == 3 and encoded[2] is chunks[0]
    finally:
        bench.close()
