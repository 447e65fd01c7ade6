from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from kvservice.chunk import ChunkKV
from kvservice.protocol.codecs import codec_by_name, kivi
from kvservice.protocol.errors import ChunkMissing
from kvservice.protocol.keys import ChunkKey
from kvservice.store.config import StoreConfig
from kvservice.store.disk import DiskTier
from kvservice.store.format import decode_chunk, decode_header, encode_chunk
from kvservice.store.loader import KVLoader, _read_in_turn
from kvservice.store.memory import MemoryTier
from kvservice.store.tiered import TieredStore

from .conftest import FINGERPRINT, HEAD_HASH, D, H, L, make_chunk


def _assert_serves(source, chunk):
    assert source.num_tokens == chunk.num_tokens
    assert source.head_hash == chunk.head_hash
    for i in range(L):  # strictly increasing, as the blender reads
        k, v = source.layer(i)
        assert k.shape == chunk.k[i].shape
        assert torch.equal(k, chunk.k[i]) and torch.equal(v, chunk.v[i]), i


@pytest.mark.parametrize("where", ["cpu", "disk", "s3"])
def test_loader_serves_exactly_the_stored_layers_in_order(store, where):
    chunks = [make_chunk(30 + i) for i in range(3)]
    keys = []
    for chunk in chunks:
        key = store.put(chunk, tiers=[] if where == "s3" else [where])
        keys.append(key)
    keys.append(keys[0])  # the same chunk twice in one prompt
    with KVLoader(store) as loader:
        batch = loader.open(keys)
        # the repeat may find the chunk in memory already, where reading the first put it
        assert batch.tiers[:3] == [where] * 3 and batch.tiers[3] in (where, "cpu")
        for source, chunk in zip(batch, [*chunks, chunks[0]], strict=True):
            _assert_serves(source, chunk)
        stats = batch.stats()
    assert stats.chunks == 4 and stats.faults == 0 and 0.0 <= stats.hidden_load_fraction <= 1.0
    assert stats.tier_bytes[where] == 4 * decode_header(encode_chunk(chunks[0])).layers_bytes
    if where != "cpu":  # read from disk or S3: promoted into the CPU tier once complete
        deadline = time.monotonic() + 2
        while not all(store.tier("cpu").contains(k) for k in keys) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(store.tier("cpu").contains(k) for k in keys)


def test_s3_chunk_layers_come_from_one_request_per_chunk(store):
    """Streaming: a chunk's header (locate) and then all its layers in one GET, not a GET
    per layer; served exactly, and still promoted once complete."""
    chunks = [make_chunk(50 + i) for i in range(3)]
    keys = [store.put(chunk, tiers=[]) for chunk in chunks]
    s3 = store.tier("s3")
    before = s3.hits
    with KVLoader(store) as loader:
        batch = loader.open(keys)
        for source, chunk in zip(batch, chunks, strict=True):
            _assert_serves(source, chunk)
    assert s3.hits - before == 2 * len(chunks)  # per chunk: the header, then the stream
    deadline = time.monotonic() + 2
    while not all(store.tier("cpu").contains(k) for k in keys) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(store.tier("cpu").contains(k) for k in keys)


def test_chunks_the_controller_skips_are_not_read(store):
    """``open(choose=...)`` sees every located chunk (tier, tokens, bytes) before any read
    starts; a skipped S3 chunk is never streamed and is left for the caller to recompute."""
    chunks = [make_chunk(70 + i) for i in range(3)]
    keys = [store.put(chunk, tiers=[]) for chunk in chunks]
    s3 = store.tier("s3")
    seen = []

    def choose(located):
        seen.extend((source.tier, source.num_tokens, source.loaded_bytes()) for source in located)
        return [True, False, True]

    before = s3.hits
    with KVLoader(store) as loader:
        batch = loader.open(keys, choose=choose)
        assert batch.read == [True, False, True]
        assert batch.tiers == ["s3", "recomputed", "s3"]
        for i in (0, 2):
            _assert_serves(batch[i], chunks[i])
        stats = batch.stats()
    layer_bytes = decode_header(encode_chunk(chunks[0])).layers_bytes
    assert seen == [("s3", chunk.num_tokens, layer_bytes) for chunk in chunks]
    assert s3.hits - before == 3 + 2  # three headers, two streams: the skipped one unread
    assert stats.tier_bytes == {"s3": 2 * layer_bytes, "recomputed": 0}


def test_s3_streams_are_read_by_the_stream_threads_only(store, monkeypatch):
    """Five chunks streaming from S3 are read by at most ``KV_STREAM_THREADS`` (2) readers,
    not a thread each, and still served exactly."""
    import threading

    chunks = [make_chunk(60 + i) for i in range(5)]
    keys = [store.put(chunk, tiers=[]) for chunk in chunks]
    s3, readers = store.tier("s3"), []
    opened = s3.open_stream

    def recording(key, start):
        readers.append(threading.current_thread().name)
        return opened(key, start)

    monkeypatch.setattr(s3, "open_stream", recording)
    with KVLoader(store) as loader:
        assert loader.stream_threads == 2
        batch = loader.open(keys)
        for source, chunk in zip(batch, chunks, strict=True):
            _assert_serves(source, chunk)
    assert len(readers) == 5 and len(set(readers)) <= 2
    assert all(name.startswith("kv-stream") for name in readers)
    with pytest.raises(ValueError, match="KV_STREAM_THREADS"):
        StoreConfig.from_env({"KV_STREAM_THREADS": "0"})


def test_a_reader_takes_one_layer_of_each_stream_in_turn():
    order = []

    def stream(name, layers):
        for i in range(layers):
            order.append((name, i))
            yield

    _read_in_turn([stream("a", 3), stream("b", 1), stream("c", 2)])
    assert order == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("c", 1), ("a", 2)]


class SlowDisk(DiskTier):
    """A disk whose every read takes ``delay`` seconds (a slow link, deterministic)."""

    delay = 0.03

    def read_into(self, key, start, out):
        time.sleep(self.delay)
        return super().read_into(key, start, out)


def _slow_store(tmp_path, chunk):
    store = TieredStore(
        [MemoryTier(1 << 20), SlowDisk(tmp_path / "slow", 1 << 20)],
        config=StoreConfig(store_dtype="float32", codec="fp16"),
    )
    return store, store.put(chunk, tiers=["disk"])


def test_prefetch_hides_load_behind_compute(tmp_path):
    chunk = make_chunk(40)
    store, key = _slow_store(tmp_path, chunk)
    # layer by layer (not in runs): each layer's read is what is hidden
    with KVLoader(store, promote=False, prefetch_depth=1, decode_layers=1) as loader:
        batch = loader.open([key])
        source = batch[0]
        for i in range(L):
            k, _ = source.layer(i)
            assert torch.equal(k, chunk.k[i])
            if i + 1 < L:
                assert i + 1 in source.scheduled()  # layer i+1 is on its way while i is used
            time.sleep(2 * SlowDisk.delay)  # "compute" layer i
        stats = batch.stats()
    # only layer 0 is waited for; layers 1..L-1 arrive during compute
    assert stats.load_s >= (L - 1) * SlowDisk.delay * 0.9  # layers 0 and 1 overlap
    assert stats.wait_s < 2 * SlowDisk.delay
    assert stats.hidden_load_fraction > 0.5


def test_no_pipeline_loads_everything_first_and_hides_nothing(tmp_path):
    chunk = make_chunk(41)
    store, key = _slow_store(tmp_path, chunk)
    with KVLoader(store, pipeline=False, promote=False) as loader:
        batch = loader.open([key])
        scheduled = batch[0].scheduled()
        assert all(f.done() for f in scheduled.values()) and len(scheduled) == L
        _assert_serves(batch[0], chunk)
        stats = batch.stats()
    assert stats.wait_s >= stats.load_s * 0.99 and stats.hidden_load_fraction < 0.01


def test_corrupt_layer_mid_stream_is_recomputed_and_replaced(store, recompute_from):
    chunk = make_chunk(42)
    key = store.put(chunk, tiers=[])
    bad = encode_chunk(chunk)
    bad[decode_header(bad).layer_offset(2) + 1] ^= 0x40
    store.tier("s3").put(key, bad)
    recompute = recompute_from(chunk)
    with KVLoader(store) as loader:
        batch = loader.open([key], token_ids=[chunk.token_ids], recompute_fn=recompute)
        assert batch[0].token_ids == chunk.token_ids
        _assert_serves(batch[0], chunk)
        assert batch.tiers == ["recomputed"] and batch.stats().faults == 1
    assert recompute.calls == 1 and store.stats().faults["corrupt"] == 1
    store.drop_local(key)
    assert torch.equal(store.get(key).v, chunk.v)  # the S3 object was replaced


def test_corrupt_disk_copy_fails_over_to_s3_mid_stream(store, recompute_from):
    chunk = make_chunk(43)
    key = store.put(chunk, tiers=[])
    bad = encode_chunk(chunk)
    bad[decode_header(bad).layer_offset(3) + 1] ^= 0x40
    store.tier("disk").put(key, bad)
    with KVLoader(store) as loader:
        batch = loader.open([key], token_ids=[chunk.token_ids], recompute_fn=recompute_from(chunk))
        assert batch.tiers == ["disk"]
        _assert_serves(batch[0], chunk)
        assert batch.tiers == ["s3"]
    assert not store.tier("disk").contains(key) or torch.equal(store.get(key).k, chunk.k)


def test_disk_runs_of_layers_are_checked_served_and_promoted(store, recompute_from):
    """Disk read in runs of layers (as on a GPU): every layer exact, the whole object
    promoted into memory; a corrupt layer inside a run drops the disk copy and fails over to
    S3 (whose good copy is what the store serves since)."""
    chunk, bad_chunk = make_chunk(46), make_chunk(47)
    key = store.put(chunk, tiers=["disk"])
    bad_key = store.put(bad_chunk, tiers=[])
    bad = encode_chunk(bad_chunk)
    bad[decode_header(bad).layer_offset(L - 1) + 1] ^= 0x40
    store.tier("disk").put(bad_key, bad)
    with KVLoader(store, decode_layers=3) as loader:
        batch = loader.open(
            [key, bad_key],
            token_ids=[chunk.token_ids, bad_chunk.token_ids],
            recompute_fn=recompute_from(bad_chunk),
        )
        assert batch.tiers == ["disk", "disk"]
        _assert_serves(batch[0], chunk)
        _assert_serves(batch[1], bad_chunk)
        assert batch.tiers == ["disk", "s3"]
    size = decode_header(bad).layers_bytes
    assert batch.stats().tier_bytes == {"disk": size, "s3": size}
    assert store.stats().faults["corrupt"] == 1
    deadline = time.monotonic() + 2
    while not store.tier("cpu").contains(key) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.tier("cpu").contains(key) and torch.equal(store.get(key).k, chunk.k)
    store.drop_local(bad_key)  # what disk held of it was dropped; S3's copy is the good one
    assert torch.equal(store.get(bad_key).k, bad_chunk.k)


def test_a_corrupt_disk_run_is_never_promoted_into_memory(store, recompute_from):
    """The last run of a disk copy fails its checksum: the layers before it were fine, but
    the copy is not put into the memory tier (whose reads skip checksums)."""
    chunk = make_chunk(49)
    key = store.put(chunk, tiers=[])
    bad = encode_chunk(chunk)
    bad[decode_header(bad).layer_offset(L - 1) + 1] ^= 0x40
    store.tier("disk").put(key, bad)
    with KVLoader(store, decode_layers=3) as loader:
        source = loader.open(
            [key], token_ids=[chunk.token_ids], recompute_fn=recompute_from(chunk)
        )[0]
        _assert_serves(source, chunk)
    time.sleep(0.2)  # a promotion happens on a fetch thread
    held = store.tier("cpu").get(key)
    assert held is None or torch.equal(decode_chunk(held).k, chunk.k)


def test_disk_runs_stop_at_the_byte_cap(store, monkeypatch):
    """A run from disk holds at most ``DISK_RUN_BYTES`` of stored layers (one layer at least),
    so a chunk's first layer does not wait for the read of all of them."""
    import kvservice.store.layered as layered_module

    chunk = make_chunk(48)
    key = store.put(chunk, tiers=["disk"])
    layer = decode_header(encode_chunk(chunk)).layer_size(0)
    disk, reads = store.tier("disk"), []
    read_into = disk.read_into
    monkeypatch.setattr(
        disk, "read_into", lambda k, start, out: reads.append(len(out)) or read_into(k, start, out)
    )
    for cap, per_read in ((2 * layer + 1, 2), (layer // 2, 1)):
        monkeypatch.setattr(layered_module, "DISK_RUN_BYTES", cap)
        reads.clear()
        with KVLoader(store, decode_layers=8, promote=False) as loader:
            _assert_serves(loader.open([key])[0], chunk)
        assert reads == [per_read * layer] * (L // per_read)  # layers of equal size here


def test_missing_chunk_without_recompute_raises_typed_error(store):
    key = ChunkKey.of(make_chunk(44))
    with KVLoader(store) as loader:
        batch = loader.open([key])
        with pytest.raises(ChunkMissing):
            batch[0].layer(0)


def test_missing_chunk_with_recompute_is_served_and_stored(store, recompute_from):
    chunk = make_chunk(45)
    key = ChunkKey.of(chunk)
    recompute = recompute_from(chunk)
    with KVLoader(store) as loader:
        batch = loader.open([key], token_ids=[chunk.token_ids], recompute_fn=recompute)
        _assert_serves(batch[0], chunk)
    assert recompute.calls == 1 and store.tier("s3").contains(key)


def test_quantized_objects_load_close_to_the_original(store_config):
    store = TieredStore.from_config(store_config)
    chunk = make_chunk(46)
    key = store.put(chunk, tiers=[], quantize=True)
    with KVLoader(store) as loader:
        source = loader.open([key])[0]
        for i in range(L):
            k, v = source.layer(i)
            bound = chunk.k[i].abs().amax(dim=-1, keepdim=True) / 254 + 1e-6
            assert bool(((k - chunk.k[i]).abs() <= bound).all())


def test_s3_unreachable_while_loading_recomputes_without_hanging(tmp_path, recompute_from, caplog):
    from deploy.services import free_port

    closed = f"127.0.0.1:{free_port()}"  # nothing listens there
    config = StoreConfig(s3_endpoint=closed, disk_capacity_bytes=0, s3_connect_timeout_s=0.5)
    store = TieredStore.from_config(config)
    chunk = make_chunk(47)
    recompute = recompute_from(chunk)
    started = time.monotonic()
    with KVLoader(store) as loader:
        batch = loader.open(
            [ChunkKey.of(chunk)], token_ids=[chunk.token_ids], recompute_fn=recompute
        )
        _assert_serves(batch[0], chunk)
    assert time.monotonic() - started < 5
    assert recompute.calls == 1 and batch.tiers == ["recomputed"]
    assert "S3 unreachable" in caplog.text and store.stats().faults["unavailable"] == 1
    assert store.tier("cpu").contains(ChunkKey.of(chunk))


def test_fetch_threads_run_single_threaded_at_the_configured_lower_priority(tmp_path):
    import os
    import threading

    def nice_and_threads_of_a_fetch_thread(loader: KVLoader) -> tuple[int, int]:
        tid, threads = loader.executor.submit(
            lambda: (threading.get_native_id(), torch.get_num_threads())
        ).result()
        return os.getpriority(os.PRIO_PROCESS, tid), threads

    base, own_threads = os.getpriority(os.PRIO_PROCESS, 0), torch.get_num_threads()
    try:
        for nice, expected in [(0, base), (7, min(19, base + 7))]:
            store = TieredStore([MemoryTier(1 << 20)], config=StoreConfig(load_nice=nice))
            with KVLoader(store) as loader:
                assert nice_and_threads_of_a_fetch_thread(loader) == (expected, 1)
        # the caller's own thread is untouched
        assert os.getpriority(os.PRIO_PROCESS, 0) == base
        assert torch.get_num_threads() == own_threads
    finally:
        torch.set_num_threads(own_threads)  # threads started later take this count again
    with pytest.raises(ValueError, match="KV_LOAD_NICE"):
        StoreConfig.from_env({"KV_LOAD_NICE": "25"})


JOINED = kivi("joined", ((0.5, 4), (1.0, 2)), 3, k_group=16, v_group=4)  # two runs of layers


def _memory_store() -> TieredStore:
    return TieredStore([MemoryTier(1 << 30)], config=StoreConfig(store_dtype="float32"))


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
        ),
    ],
)
def test_a_requests_chunks_in_memory_are_decoded_together(monkeypatch, device):
    """Chunks of one request that the memory tier serves, joined: each run of layers is
    decoded for every chunk stored alike in one call (``decode_chunk_runs``), a chunk
    stored otherwise on its own, and every layer served is exactly its chunk's (on CUDA, where
    chunks are joined unasked, within K's fused multiply-add)."""
    from kvservice.store import joined as joined_module

    calls = []
    real = joined_module.decode_chunk_runs

    def recording(headers, first, count, *args, **kwargs):
        calls.append(([h.num_tokens for h in headers], first, count))
        return real(headers, first, count, *args, **kwargs)

    monkeypatch.setattr(joined_module, "decode_chunk_runs", recording)
    store = _memory_store()
    chunks = [make_chunk(90 + i, tokens=n) for i, n in enumerate((17, 40, 23, 31))]
    codecs = [JOINED, JOINED, codec_by_name("kivi4"), JOINED]
    keys = [store.put(chunk, codec=codec) for chunk, codec in zip(chunks, codecs, strict=True)]
    expected = [
        decode_chunk(encode_chunk(c, codec=codec)) for c, codec in zip(chunks, codecs, strict=True)
    ]
    join = True if device == "cpu" else None  # on a GPU, joined by default
    with KVLoader(store, join_chunks=join, device=device) as loader:
        assert loader.join_chunks
        batch = loader.open(keys)
        for i in range(L):
            for source, chunk in zip(batch, expected, strict=True):
                k, v = source.layer(i)
                exact = 0 if device == "cpu" else 1e-5
                torch.testing.assert_close(k.cpu(), chunk.k[i], rtol=exact, atol=exact)
                torch.testing.assert_close(v.cpu(), chunk.v[i], rtol=100 * exact, atol=100 * exact)
    # K at 4 bits in layers 0-1, at 2 in 2-3: two runs, each of the three chunks stored alike
    assert calls == [([17, 40, 31], 0, 2), ([17, 40, 31], 2, 2)]


def test_decoding_a_request_dispatches_as_many_operators_for_six_chunks_as_for_two():
    from bench.opcount import count_ops

    store = _memory_store()

    def operators(chunks: int) -> int:
        keys = [
            store.put(make_chunk(60 + i, tokens=17 + 5 * i), codec=JOINED) for i in range(chunks)
        ]
        with KVLoader(store, join_chunks=True) as loader:

            def run() -> None:
                batch = loader.open(keys)
                for i in range(L):
                    for source in batch:
                        source.layer(i)

            return count_ops(run, L).total

    assert operators(6) == operators(2) > 0
    with KVLoader(store) as loader:  # on the host chunk by chunk unless asked (JOIN_ON_CPU)
        assert not loader.join_chunks


def test_a_requests_quantized_chunks_decoded_one_by_one_lie_side_by_side():
    """On the host, chunk by chunk: the quantized chunks of a request are decoded into one K
    and one V buffer, side by side in request order (``joined.joint_slots``), so that the
    blender reads neighbours' layers as one view (``placing.joined_view``); a chunk stored
    otherwise (unquantized) decodes on its own. Every layer is exactly its chunk's."""
    from kvservice.blend.placing import joined_view

    store = _memory_store()
    chunks = [make_chunk(70 + i, tokens=n) for i, n in enumerate((17, 40, 23, 31))]
    codecs = [JOINED, codec_by_name("kivi4"), codec_by_name("fp16"), JOINED]
    keys = [store.put(chunk, codec=codec) for chunk, codec in zip(chunks, codecs, strict=True)]
    expected = [
        decode_chunk(encode_chunk(c, codec=codec)) for c, codec in zip(chunks, codecs, strict=True)
    ]
    with KVLoader(store, join_chunks=False) as loader:
        batch = loader.open(keys)
        for i in range(L):
            layers = [source.layer(i) for source in batch]
            for (k, v), chunk in zip(layers, expected, strict=True):
                torch.testing.assert_close(k, chunk.k[i], rtol=0, atol=0)
                torch.testing.assert_close(v, chunk.v[i], rtol=0, atol=0)
            for part in (0, 1):  # K, then V
                first_two = joined_view([layer[part] for layer in layers[:2]])
                assert first_two is not None and first_two.shape == (H, 17 + 40, D)
                assert torch.equal(first_two, torch.cat([layers[0][part], layers[1][part]], 1))
                assert joined_view([layer[part] for layer in layers[1:3]]) is None  # fp16 apart
                # the unquantized chunk is not in the buffer: the last follows the second
                assert joined_view([layers[1][part], layers[3][part]]) is not None


def test_chunks_read_from_disk_decode_into_their_own_tensors(tmp_path):
    """Only chunks a trusted tier serves are laid side by side: a disk's are decoded as their
    bytes are checked, each into its own tensors (served exactly all the same)."""
    from kvservice.blend.placing import joined_view

    store = TieredStore(
        [DiskTier(tmp_path / "disk", 1 << 30)], config=StoreConfig(store_dtype="float32")
    )
    chunks = [make_chunk(80 + i, tokens=n) for i, n in enumerate((17, 40))]
    keys = [store.put(chunk, codec=JOINED, tiers=["disk"]) for chunk in chunks]
    expected = [decode_chunk(encode_chunk(c, codec=JOINED)) for c in chunks]
    with KVLoader(store, join_chunks=False, promote=False) as loader:
        batch = loader.open(keys)
        assert all(source.joint_slot is None for source in batch)  # no buffer laid out
        for i in range(L):
            layers = [source.layer(i) for source in batch]
            for (k, v), chunk in zip(layers, expected, strict=True):
                torch.testing.assert_close(k, chunk.k[i], rtol=0, atol=0)
                torch.testing.assert_close(v, chunk.v[i], rtol=0, atol=0)
            assert joined_view([k for k, _ in layers]) is None


class _Held:
    """A chunk's layers as a loader served them, read again at will."""

    def __init__(self, layers):
        self.layers = layers

    def layer(self, index):
        return self.layers[index]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(
    "join, device", [(True, "cpu"), (False, "cpu"), pytest.param(True, "cuda", marks=CUDA)]
)
@pytest.mark.parametrize("third", ["joined", "fp16"])
def test_a_loaders_chunks_placed_by_runs_of_layers_fill_the_cache_as_layer_by_layer(
    join, device, third
):
    """Before a recorded pass, chunks a loader served are placed a run of layers at a time
    (``placing.place_layers``): decoded together (as on a GPU) or side by side (the host's
    joint buffer), with or without an unquantized chunk among them, stale chunks' keys
    scaled, the cache is exactly what placing layer by layer (``place_sources``) makes, with
    fewer operators."""
    from bench.opcount import count_ops
    from kvservice.blend.placing import place_layers, place_sources, placing_runs
    from kvservice.blend.plan import Segment, StaleReading
    from kvservice.model.transformer import rope_cos_sin

    store, layers = _memory_store(), 12  # the codec's two widths: two runs of 6 layers
    lengths = (17, 40, 23, 31)
    codecs = [JOINED, JOINED, JOINED if third == "joined" else codec_by_name("fp16"), JOINED]
    keys = []
    for i, (n, codec) in enumerate(zip(lengths, codecs, strict=True)):
        gen = torch.Generator().manual_seed(100 + i)
        k, v = torch.randn(2, layers, H, n, D, generator=gen)
        keys.append(store.put(ChunkKV(list(range(n)), k, v, FINGERPRINT, HEAD_HASH), codec=codec))
    with KVLoader(store, join_chunks=join, device=device) as loader:
        batch = loader.open(keys)
        served = [[source.layer(i) for i in range(layers)] for source in batch]
    segments, start = [], 3  # after a 3-token head, not placed here
    for held, n in zip(served, lengths, strict=True):
        segments.append(Segment(start, n, _Held(held), "chunk"))
        start += n
    stale = StaleReading(spans=(slice(60, 83), slice(83, 114)), key_scales=(0.9, 0.8))
    inverse = 1.0 / 10000 ** (torch.arange(0, D, 2, device=device) / D)
    cos, sin = rope_cos_sin(inverse, torch.arange(start, device=device))

    def placed(by_runs: bool):
        size = (layers, 1, H, start, D)
        cache = SimpleNamespace(
            k=torch.zeros(size, device=device), v=torch.zeros(size, device=device)
        )
        placings = placing_runs(segments, stale, device)

        def run():
            if by_runs:
                place_layers(cache, placings, [(cos, sin)] * layers)
            else:
                for i in range(layers):
                    place_sources(cache, i, placings, cos, sin)

        return cache, count_ops(run, layers).total

    (runs, by_runs), (layered, by_layers) = placed(True), placed(False)
    assert torch.equal(runs.k, layered.k) and torch.equal(runs.v, layered.v)
    assert runs.k[:, :, :, 3:].abs().amin() > 0  # every chunk slot written
    assert by_runs <= 0.6 * by_layers  # a GPU's layout (join): 4 operators a chunk a run
