from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvservice.chunk import ChunkKV
from kvservice.protocol.codecs import CODECS, DEFAULT_CODEC, FP16, codec_by_name, kivi
from kvservice.protocol.keys import ChunkKey
from kvservice.store.codec import (
    hadamard,
    pack_bits,
    quantize_groups,
    quantize_k_per_channel,
    quantize_v_per_token,
    unpack_bits,
)
from kvservice.store.config import StoreConfig
from kvservice.store.format import (
    decode_chunk,
    decode_chunk_runs,
    decode_header,
    decode_layer,
    decode_layers,
    encode_chunk,
    joinable,
    layer_run,
    verify_object,
)

from .conftest import make_chunk

DATA = Path(__file__).parent / "data"
SMOL = dict(layers=30, heads=3, dim=64)  # the bundled SmolLM2-135M's KV shape


def smol_like_chunk(tokens: int = 150, seed: int = 0) -> ChunkKV:
    """Random KV of SmolLM2-135M's shape, K with a few large channels as real keys have."""
    gen = torch.Generator().manual_seed(seed)
    shape = (SMOL["layers"], SMOL["heads"], tokens, SMOL["dim"])
    channel_scale = torch.ones(SMOL["dim"])
    channel_scale[:4] = 20.0  # outlier channels: per-channel K groups keep them apart
    k = torch.randn(*shape, generator=gen) * channel_scale
    v = torch.randn(*shape, generator=gen)
    return ChunkKV(list(range(tokens)), k, v, "smol@test", "head")


@pytest.mark.parametrize("bits", range(1, 9))
def test_bit_packing_round_trips_every_width(bits):
    codes = torch.randint(0, 1 << bits, (1001,))  # not a multiple of 8 codes
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == 126 * bits
    assert torch.equal(unpack_bits(packed, bits, 1001).long(), codes)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_per_channel_k_error_is_half_a_step_of_its_group(bits):
    k = torch.randn(3, 150, 64) * torch.logspace(-2, 2, 64)  # channels of very different size
    codes, step, low = quantize_k_per_channel(k, bits, group=64, clip=False)
    assert step.shape == (3, 3, 64) and codes.shape == k.shape  # 150 tokens: 3 groups
    index = torch.arange(150) // 64
    back = low.float()[:, index] + codes.float() * step.float()[:, index]
    # half a step, plus float16 rounding of the minimum (|low| * 2**-11) and of the step
    group_max = k.abs().view(3, 150, 64).amax(1, keepdim=True)
    bound = step.float()[:, index] / 2 + group_max * 2**-10
    assert bool(((back - k).abs() <= bound).all())
    # a small channel is not blurred by the large ones: its error is its own step's
    assert (back - k)[..., 0].abs().max() < 0.01 * k[..., -1].abs().max()


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_per_token_v_error_is_half_a_step_of_its_group(bits):
    v = torch.randn(3, 40, 64) * torch.logspace(-3, 2, 40).view(1, 40, 1)  # tokens of any size
    codes, step, low = quantize_v_per_token(v, bits, group=32, clip=False)
    assert step.shape == (3, 40, 2)
    back = low.float()[..., None] + codes.view(3, 40, 2, 32).float() * step.float()[..., None]
    bound = step.float()[..., None] / 2 + v.abs().view(3, 40, 2, 32).amax(-1, True) * 2**-10
    assert bool(((back - v.view(3, 40, 2, 32)).abs() <= bound).all())


def test_clipped_ranges_never_add_error_and_trim_a_rare_outlier():
    x = torch.randn(3, 40, 64)
    x[:, :, 7] *= 8.0  # one large value in every group of 64 channels
    errors = {}
    for clip in (False, True):
        codes, step, low = quantize_groups(x, 2, dim=2, clip=clip)
        back = low.float()[:, :, None] + codes.float() * step.float()[:, :, None]
        errors[clip] = ((back - x) ** 2).sum(2)  # per group
    assert bool((errors[True] <= errors[False] * (1 + 1e-3)).all())  # full range is a candidate
    assert errors[True].sum() < 0.9 * errors[False].sum()


def test_hadamard_is_orthonormal_and_its_own_inverse():
    for size in (1, 2, 64, 128):
        matrix = hadamard(size)
        assert torch.allclose(matrix @ matrix, torch.eye(size), atol=1e-5)
        assert torch.equal(matrix, matrix.T)


def test_rotated_v_is_recorded_and_turned_back_at_decode():
    chunk = smol_like_chunk(tokens=70)
    chunk.v[..., 5] *= 30.0  # an outlier channel: it widens every token's range
    plain, turned = kivi("plain", 4, 3), kivi("turned", 4, 3, v_rotate=True)
    objects = {
        c.name: encode_chunk(chunk, codec=c, narrow_to=torch.float16) for c in (plain, turned)
    }
    assert len(objects["plain"]) == len(objects["turned"])  # a flag, no bytes
    assert decode_header(objects["turned"]).v_rotated
    assert not decode_header(objects["plain"]).v_rotated
    back = {name: decode_chunk(data, ChunkKey.of(chunk)) for name, data in objects.items()}
    assert torch.equal(back["plain"].k, back["turned"].k)  # K is not turned

    def error(name: str) -> float:
        return float((back[name].v.float() - chunk.v).norm() / chunk.v.norm())

    assert error("turned") < 0.5 * error("plain")
    verify_object(objects["turned"], ChunkKey.of(chunk))


# relative error (Frobenius) of K and V through each codec on Gaussian KV, and the most
# bytes per token each may take at SmolLM2's shape (fp16: 23,040 + 4 for the token id)
BOUNDS = {
    "fp16": (1e-3, 23_100),
    "int8": (0.02, 12_300),
    "fp8": (0.04, 12_000),
    "kivi4": (0.1, 6_700),
    "kivi3": (0.22, 5_200),
    "kivi2": (0.5, 3_800),
    # 150 tokens: the second 128-token K group mostly empty (600-token chunks: 5,598 / 5,694)
    "kivi4k3v": (0.2, 5_750),
    "kivi4k3v-v4early": (0.2, 5_850),
}


@pytest.mark.parametrize("name", BOUNDS)
def test_each_codec_round_trips_within_its_error_and_size(name):
    chunk = smol_like_chunk()
    data = encode_chunk(chunk, codec=codec_by_name(name), narrow_to=torch.float16)
    back = decode_chunk(data, ChunkKey.of(chunk))
    max_error, max_bytes = BOUNDS[name]
    for stored, original in ((back.k, chunk.k), (back.v, chunk.v)):
        assert (stored.float() - original).norm() / original.norm() < max_error
    assert len(data) / chunk.num_tokens <= max_bytes
    assert back.token_ids == chunk.token_ids


def test_the_default_codec_takes_at_most_a_quarter_of_fp16s_bytes():
    chunk = smol_like_chunk(tokens=100)  # a short chunk: its last K group is a partial one
    fp16 = len(encode_chunk(chunk, codec=FP16, narrow_to=torch.float16))
    default = len(encode_chunk(chunk, codec=CODECS[DEFAULT_CODEC], narrow_to=torch.float16))
    assert default <= fp16 / 4
    assert default / chunk.num_tokens <= 5_760


def test_layer_dependent_bits_are_recorded_and_decoded_per_layer():
    codec = kivi("test", ((0.5, 4), (1.0, 2)), 3, k_group=32, v_group=32)
    chunk = smol_like_chunk(tokens=70)
    data = encode_chunk(chunk, codec=codec)
    header = decode_header(data)
    assert header.layer_bits[0] == (4, 3) and header.layer_bits[-1] == (2, 3)
    assert header.layer_size(0) > header.layer_size(29)  # 4-bit K layers take more bytes
    first = decode_layer(header, 0, data[header.layer_offset(0) :])[0]
    last = decode_layer(header, 29, data[header.layer_offset(29) :])[0]
    error = [
        (first - chunk.k[0]).norm() / chunk.k[0].norm(),
        (last - chunk.k[29]).norm() / chunk.k[29].norm(),
    ]
    assert error[0] < error[1] / 2
    verify_object(data, ChunkKey.of(chunk))


def test_v4early_gives_the_first_eighth_of_the_layers_4_bit_v():
    codec = CODECS["kivi4k3v-v4early"]
    assert codec.layer_bits(30) == ((4, 4),) * 4 + ((4, 3),) * 26  # SmolLM2: layers 0-3
    assert codec.layer_bits(32)[:5] == ((4, 4),) * 4 + ((4, 3),)  # Llama-3-8B's 32 as well
    chunk = smol_like_chunk(tokens=256)
    data = encode_chunk(chunk, codec=codec, narrow_to=torch.float16)
    header = decode_header(data)
    assert header.codec_name == "kivi k4v3,k4v4" and header.v_rotated
    back = decode_chunk(data, ChunkKey.of(chunk))

    def v_error(layers: slice) -> float:
        return float((back.v[layers].float() - chunk.v[layers]).norm() / chunk.v[layers].norm())

    assert v_error(slice(0, 4)) < 0.6 * v_error(slice(4, 30))  # a bit more: about half the error
    plain = len(encode_chunk(chunk, codec=CODECS["kivi4k3v"], narrow_to=torch.float16))
    assert len(data) - plain == 4 * 3 * 256 * 64 // 8  # one more bit a value, in 4 layers


def test_objects_of_the_earlier_default_decode_as_they_were_written():
    chunk = smol_like_chunk(tokens=200)
    old = encode_chunk(chunk, codec=CODECS["kivi4k3v"], narrow_to=torch.float16)
    assert decode_header(old).codec_name == "kivi k4v3"  # what re-encoding compares
    back = decode_chunk(old, ChunkKey.of(chunk))
    new = decode_chunk(
        encode_chunk(chunk, codec=CODECS["kivi4k3v-v4early"], narrow_to=torch.float16)
    )
    assert torch.equal(back.k, new.k)  # K is stored alike
    assert torch.equal(back.v[4:], new.v[4:]) and not torch.equal(back.v[:4], new.v[:4])


def test_an_object_decodes_by_what_it_records_not_by_todays_codec_table(monkeypatch):
    chunk = smol_like_chunk(tokens=20)
    data = encode_chunk(chunk, codec=CODECS["kivi2"])
    monkeypatch.setitem(CODECS, "kivi2", kivi("kivi2", 8, 8))  # retuned later
    back = decode_chunk(data)
    assert (back.v.float() - chunk.v).norm() / chunk.v.norm() > 0.1  # still 2-bit data


def test_quantized_chunks_decode_to_the_narrowed_type_and_tiny_chunks_work():
    for tokens in (1, 7, 64, 65):
        chunk = make_chunk(3, tokens=tokens)
        back = decode_chunk(encode_chunk(chunk, codec=CODECS["kivi4"], narrow_to=torch.float16))
        assert back.k.dtype == torch.float16 and back.k.shape == chunk.k.shape
        assert (back.k.float() - chunk.k).norm() / chunk.k.norm() < 0.15


def test_values_beyond_float16_are_stored_exactly_instead():
    chunk = make_chunk(4)
    chunk.k[0, 0, 0, 0] = 1e6
    data = encode_chunk(chunk, codec=CODECS["kivi4"], narrow_to=torch.float16)
    assert decode_header(data).codec_name == "raw float32"
    assert torch.equal(decode_chunk(data).k, chunk.k)


def test_zero_and_constant_groups_survive():
    chunk = make_chunk(5)
    chunk.k.zero_()
    chunk.v.fill_(0.25)
    back = decode_chunk(encode_chunk(chunk, codec=CODECS["kivi2"]))
    assert torch.equal(back.k.float(), chunk.k) and torch.equal(back.v.float(), chunk.v)


@pytest.mark.parametrize("name", ["v1_fp16.rbkv", "v1_int8.rbkv"])
def test_objects_in_format_version_1_stay_readable(name):
    # written by the store before the codecs (format version 1): make_chunk(11) in float16,
    # make_chunk(12) quantized to int8 per token
    data = bytearray((DATA / name).read_bytes())
    header = verify_object(data)
    assert header.version == 1
    original = make_chunk(11, dtype=torch.float16) if "fp16" in name else make_chunk(12)
    back = decode_chunk(data, ChunkKey.of(original))
    assert back.token_ids == original.token_ids
    if "fp16" in name:
        assert torch.equal(back.k, original.k) and torch.equal(back.v, original.v)
    else:
        bound = original.k.abs().amax(dim=-1, keepdim=True) / 254 + 1e-6
        assert bool(((back.k - original.k).abs() <= bound).all())


def test_kv_codec_is_read_once_and_checked():
    assert StoreConfig.from_env({}).codec == DEFAULT_CODEC
    assert StoreConfig.from_env({"KV_CODEC": "FP16"}).kv_codec == FP16
    assert StoreConfig.from_env({"KV_QUANTIZE": "true"}).codec == "int8"  # the old switch
    with pytest.raises(ValueError, match="KV_CODEC.*unknown KV codec 'zip'"):
        StoreConfig.from_env({"KV_CODEC": "zip"})


def test_the_store_writes_its_codec():
    from kvservice.store.memory import MemoryTier
    from kvservice.store.tiered import TieredStore

    chunk = smol_like_chunk(tokens=256)  # K groups of 128 tokens: a whole number of them
    sizes = {}
    for name in ("fp16", DEFAULT_CODEC):
        store = TieredStore([MemoryTier(1 << 30)], config=StoreConfig(codec=name))
        store.put(chunk)
        sizes[name] = store.tier("cpu").stats().bytes
        assert store.stats().codec == name
    assert sizes[DEFAULT_CODEC] <= sizes["fp16"] / 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["kivi4", "kivi3", "kivi2", "fp8", "int8"])
def test_decoding_on_cuda_gives_the_cpu_values(name):
    chunk = smol_like_chunk(tokens=90)
    data = encode_chunk(chunk, codec=codec_by_name(name), narrow_to=torch.float16)
    header = decode_header(data)
    on_device = torch.frombuffer(data, dtype=torch.uint8).cuda()
    for index in (0, 29):
        cpu = decode_layer(header, index, data[header.layer_offset(index) :])
        cuda = decode_layer(header, index, on_device[header.layer_offset(index) :], verify=False)
        for a, b in zip(cpu, cuda, strict=True):
            assert b.is_cuda and torch.allclose(a.float(), b.float().cpu(), rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["kivi4", "kivi3", "fp8", "int8", DEFAULT_CODEC])
def test_encoding_on_cuda_gives_the_cpu_object_up_to_rounding(name):
    chunk = smol_like_chunk(tokens=90)
    codec = codec_by_name(name)
    on_cpu = encode_chunk(chunk, codec=codec, narrow_to=torch.float16)
    cuda_chunk = ChunkKV(
        chunk.token_ids, chunk.k.cuda(), chunk.v.cuda(), chunk.model_fingerprint, chunk.head_hash
    )
    on_cuda = encode_chunk(cuda_chunk, codec=codec, narrow_to=torch.float16)
    assert len(on_cuda) == len(on_cpu)
    a, b = decode_chunk(on_cpu), decode_chunk(on_cuda)  # both decoded on the host
    for x, y, true in ((a.k, b.k, chunk.k), (a.v, b.v, chunk.v)):
        # as close to the true values (codes may differ at a step's edge: the division is
        # rounded otherwise on CUDA; measured: 3.6 % of int8's codes, same error)
        for norm in (1, 2):
            error_cpu = torch.linalg.vector_norm(x.float() - true.float(), norm)
            error_cuda = torch.linalg.vector_norm(y.float() - true.float(), norm)
            assert error_cuda <= error_cpu * 1.01 + 1e-6


MIXED = kivi("mixed", ((0.5, 4), (1.0, 2)), 3, k_group=16, v_group=4)  # K bits change halfway


@pytest.mark.parametrize("name", ["fp16", "int8", "fp8", "kivi4", DEFAULT_CODEC, "mixed"])
def test_layers_decoded_together_equal_layers_decoded_one_by_one(name):
    codec = MIXED if name == "mixed" else codec_by_name(name)
    data = encode_chunk(smol_like_chunk(tokens=90), codec=codec, narrow_to=torch.float16)
    header = decode_header(data)
    first, runs = 0, []
    while first < header.num_layers:
        count = layer_run(header, first, 8)
        assert len({header.layer_bits[i] for i in range(first, first + count)}) == 1
        k, v = decode_layers(header, first, count, data[header.layer_offset(first) :])
        assert k.shape == (count, header.num_kv_heads, 90, header.head_dim) == v.shape
        for n in range(count):
            one_k, one_v = decode_layer(header, first + n, data[header.layer_offset(first + n) :])
            torch.testing.assert_close(k[n], one_k, rtol=0, atol=0)
            torch.testing.assert_close(v[n], one_v, rtol=1e-3, atol=1e-3)  # V's matrix product
        runs.append(count)
        first += count
    # runs of at most 8 within each stretch of equal bits (mixed: 15 + 15 layers; v4early:
    # the first eighth, 4, then 26)
    stretches = {"mixed": [15, 15], DEFAULT_CODEC: [4, 26]}.get(name, [30])
    assert sum(runs) == header.num_layers == 30
    assert len(runs) == sum(-(-n // 8) for n in stretches)


@pytest.mark.parametrize("name", ["fp16", "int8", "fp8", "kivi4k2v", DEFAULT_CODEC, "mixed"])
def test_chunks_decoded_together_equal_each_chunk_decoded_alone(name):
    """A request's chunks (token counts that end K's groups anywhere: 90, 150, 37 and 8
    tokens against groups of 16, 64 or 128) decoded in one call per run of layers give each
    chunk's values bit for bit as its own decode does, in each cache dtype: the cache, and
    so the logits, are unchanged."""
    codec = MIXED if name == "mixed" else codec_by_name(name)
    datas = [
        encode_chunk(smol_like_chunk(tokens=n, seed=n), codec=codec, narrow_to=torch.float16)
        for n in (90, 150, 37, 8)
    ]
    headers = [decode_header(data) for data in datas]
    for dtype, first in ((d, f) for d in (None, torch.float32, torch.bfloat16) for f in (0, 4, 20)):
        count = layer_run(headers[0], first, 32)
        assert all(joinable(headers[0], header, first) for header in headers)
        blocks = [
            data[header.layer_offset(first) :] for data, header in zip(datas, headers, strict=True)
        ]
        runs = decode_chunk_runs(headers, first, count, blocks, dtype=dtype)
        for header, block, (k, v) in zip(headers, blocks, runs, strict=True):
            alone_k, alone_v = decode_layers(header, first, count, block, dtype=dtype)
            assert k.dtype == alone_k.dtype and v.dtype == alone_v.dtype
            assert torch.equal(k, alone_k) and torch.equal(v, alone_v), (header.num_tokens, first)


def test_objects_stored_otherwise_are_not_joined():
    chunk = smol_like_chunk(tokens=40)
    default = decode_header(encode_chunk(chunk, codec=codec_by_name(DEFAULT_CODEC)))
    other = decode_header(encode_chunk(chunk, codec=codec_by_name("kivi4k3v")))
    assert joinable(default, other, 10)  # both K at 4 bits and V at 3 there
    assert not joinable(default, other, 0)  # V at 4 bits in the default's first eighth
    assert not joinable(default, decode_header(encode_chunk(chunk, codec=FP16)), 10)


def test_layers_whose_codes_end_mid_byte_run_are_decoded_one_by_one():
    chunk = ChunkKV(list(range(7)), torch.randn(3, 1, 7, 6), torch.randn(3, 1, 7, 6), "f", "h")
    header = decode_header(encode_chunk(chunk, codec=codec_by_name("kivi4")))  # 42 values
    assert [layer_run(header, i, 8) for i in range(3)] == [1, 1, 1]


@pytest.mark.parametrize("where", ["cpu", "device", "disk"])
def test_the_loader_decodes_runs_of_layers_in_one_call(where, tmp_path):
    """On CUDA where there is one: from pinned memory, the GPU tier or disk (checksums
    checked on the host), decoded on the GPU."""
    from kvservice.store.device import DeviceTier
    from kvservice.store.disk import DiskTier
    from kvservice.store.loader import KVLoader
    from kvservice.store.memory import MemoryTier
    from kvservice.store.tiered import TieredStore

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tier = {
        "device": lambda: DeviceTier(1 << 30, device),
        "cpu": lambda: MemoryTier(1 << 30, pinned=device == "cuda"),
        "disk": lambda: DiskTier(tmp_path / "disk", 1 << 30),
    }[where]()
    store = TieredStore([tier], config=StoreConfig(store_dtype="float32"))
    chunk = make_chunk(50, tokens=70)
    expected = decode_chunk(encode_chunk(chunk, codec=MIXED))
    key = store.put(chunk, codec=MIXED)
    bytes_read = {}
    for layers in (3, 1):
        with KVLoader(store, promote=False, decode_layers=layers, device=device) as loader:
            batch = loader.open([key])
            assert batch[0].tier == where
            for i in range(expected.num_layers):
                k, v = batch[0].layer(i)
                assert k.device.type == device == v.device.type
                exact = 0 if device == "cpu" else 1e-5  # CUDA may fuse K's multiply-add
                torch.testing.assert_close(k.cpu(), expected.k[i], rtol=exact, atol=exact)
                torch.testing.assert_close(v.cpu(), expected.v[i], rtol=1e-3, atol=1e-3)
            bytes_read[layers] = batch.stats().bytes_read
    assert bytes_read[3] == bytes_read[1]  # each layer read once


def test_the_loader_serves_layer_dependent_objects_from_every_tier(store):
    from kvservice.store.loader import KVLoader

    codec = MIXED
    chunk = make_chunk(50, tokens=70)
    expected = decode_chunk(encode_chunk(chunk, codec=codec))
    for where in ("cpu", "disk", "s3"):  # a view, a ranged read, one streamed request
        key = store.put(chunk, tiers=[] if where == "s3" else [where], codec=codec, scope=where)
        with KVLoader(store, promote=False) as loader:
            source = loader.open([key])[0]
            assert source.tier == where
            for i in range(expected.num_layers):
                k, v = source.layer(i)
                assert torch.equal(k, expected.k[i]) and torch.equal(v, expected.v[i])


def test_memory_tiers_hold_the_compressed_object_and_decode_it_at_use(store):
    from kvservice.store.loader import KVLoader

    codec = CODECS[DEFAULT_CODEC]
    chunk = smol_like_chunk(tokens=256)
    data = store.encode(chunk, codec)
    expected = decode_chunk(data)
    key = store.put(chunk, tiers=[], codec=codec)  # in S3 only
    with KVLoader(store, promote=True) as loader:
        source = loader.open([key])[0]
        assert source.tier == "s3"
        for i in range(expected.num_layers):
            k, v = source.layer(i)
            assert torch.equal(k, expected.k[i]) and torch.equal(v, expected.v[i])
    cpu = store.tier("cpu")
    assert cpu.contains(key)
    assert cpu.stats().bytes == len(data) <= 2 * chunk.k.numel() * 2 / 4  # a quarter of fp16
    with KVLoader(store, promote=False) as loader:  # served from memory, decoded at use
        source = loader.open([key])[0]
        assert source.tier == "cpu"
        k, v = source.layer(0)
        assert torch.equal(v, expected.v[0])


@pytest.mark.parametrize("name", ["fp16", DEFAULT_CODEC, "int8"])
def test_the_loader_decodes_into_the_dtype_its_cache_holds(name):
    """A loader given the cache's dtype hands over layers in it (placing them is then a
    plain copy), equal to the object's own decoding rounded once to that dtype."""
    from kvservice.store.loader import KVLoader
    from kvservice.store.memory import MemoryTier
    from kvservice.store.tiered import TieredStore

    chunk = smol_like_chunk(tokens=140)
    store = TieredStore([MemoryTier(1 << 30)], config=StoreConfig(codec=name))
    key = store.put(chunk)
    expected = decode_chunk(bytes(store.tier("cpu").get(key)))
    for dtype in (torch.bfloat16, torch.float32):
        with KVLoader(store, promote=False, dtype=dtype) as loader:
            source = loader.open([key])[0]
            for i in (0, expected.num_layers - 1):
                k, v = source.layer(i)
                assert k.dtype == v.dtype == dtype
                for got, want in ((k, expected.k[i]), (v, expected.v[i])):
                    if name == "fp16":  # the stored values themselves, converted
                        assert torch.equal(got, want.float().to(dtype))
                    else:  # computed in float32, rounded once: within a rounding of float16's
                        rtol = 2**-8 if dtype == torch.bfloat16 else 2**-10
                        assert torch.allclose(got.float(), want.float(), rtol=rtol, atol=1e-4)


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_turned_v_decodes_to_the_in_order_values(bits):
    """The fast path for V turned by a Hadamard matrix (the minimum added through H's column
    sums, the float16 steps widened inside the product) gives what decoding plainly and
    turning gives."""
    from kvservice.store.codec import _kivi_v

    heads, tokens, dim = 3, 45, 64
    v = torch.randn(heads, tokens, dim) * 2
    codes, step, low = quantize_v_per_token(v, bits, dim, rotate=True)
    sections = [pack_bits(codes, bits), step.contiguous(), low.contiguous()]
    packed, step_bytes, low_bytes = (s.reshape(-1).view(torch.uint8) for s in sections)
    fast = _kivi_v(packed, step_bytes, low_bytes, bits, (heads, tokens, dim), dim, True)
    in_order = unpack_bits(packed, bits, v.numel()).view(heads, tokens, dim).float()
    expected = (low.float() + in_order * step.float()) @ hadamard(dim)  # step: [H, T, 1]
    assert torch.allclose(fast, expected, rtol=1e-5, atol=1e-5)
    relative = torch.linalg.norm(fast - v) / torch.linalg.norm(
        v
    )  # V again, within the codec's error
    assert relative < 1.5 * 2.0 ** (1 - bits)
