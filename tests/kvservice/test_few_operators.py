"""The engine's hot paths in few operators (issue #47: on a GPU each operator is a kernel
launch, and a 4,096-token blend spent most of its time launching them). Each test counts the
kernel-launching operators of one path (``bench.opcount``) and checks its values against the
plain expression it replaces."""

from __future__ import annotations

import torch

from bench.opcount import count_ops
from kvservice.chunk import ChunkKV
from kvservice.model.transformer import RMSNorm, apply_rope, rope_cos_sin
from kvservice.protocol.codecs import CODECS, DEFAULT_CODEC
from kvservice.store import codec as codecs
from kvservice.store.format import (
    as_uint8,
    decode_header,
    decode_layer,
    decode_layers,
    encode_chunk,
)


def _tables(rotary: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary))
    return rope_cos_sin(inv_freq.float(), torch.arange(100, 100 + tokens))


def _plain_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary = cos.shape[-1]
    half = rotary // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary], x[..., rotary:]
    c, s = cos[..., :half], sin[..., :half]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1)


def test_rope_is_three_operators_and_rounds_once_into_its_output() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 12, 50, 64, generator=gen)
    cos, sin = _tables(64, 50)
    ops = count_ops(lambda: apply_rope(x, cos, sin), layers=1)
    assert ops.total == 3, ops.by_name
    turned = apply_rope(x, cos, sin)
    torch.testing.assert_close(turned, _plain_rope(x.double(), cos.double(), sin.double()).float())
    into = torch.empty(x.shape, dtype=torch.bfloat16)
    assert apply_rope(x, cos, sin, out=into) is into
    assert torch.equal(into, turned.to(torch.bfloat16))  # one rounding, on the store
    # a bfloat16 input rotated in float32 is the widened input's rotation
    narrow = x.to(torch.bfloat16)
    widened = apply_rope(narrow, cos, sin, compute=torch.float32)
    assert widened.dtype == torch.float32
    assert torch.equal(widened, apply_rope(narrow.float(), cos, sin))


def test_partial_rotary_turns_the_first_dims_and_passes_the_rest() -> None:
    x = torch.randn(3, 20, 64, generator=torch.Generator().manual_seed(1))
    cos, sin = _tables(32, 20)
    turned = apply_rope(x, cos, sin)
    assert torch.equal(turned[..., 32:], x[..., 32:])
    torch.testing.assert_close(turned, _plain_rope(x.double(), cos.double(), sin.double()).float())


def test_a_norm_rounds_into_the_dtype_its_product_reads() -> None:
    norm = RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96) + 0.5)
    x = torch.randn(2, 7, 96, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # as the engine runs
        narrowed = norm(x, torch.bfloat16)
        assert narrowed.dtype == torch.bfloat16
        assert torch.equal(narrowed, norm(x).to(torch.bfloat16))
        plain = count_ops(lambda: norm(x), layers=1).total
        assert count_ops(lambda: norm(x, torch.bfloat16), layers=1).total == plain


def test_project_gives_q_k_v_in_the_caches_dtype_as_one_rounding(tiny_llama) -> None:
    layer = tiny_llama.layers[0]
    dim = tiny_llama.config.dim
    x = torch.randn(1, 9, dim, generator=torch.Generator().manual_seed(3))
    cos, sin = tiny_llama.rope(torch.arange(9))
    with torch.no_grad():
        wide = layer.project(x, cos[None], sin[None])
        narrow = layer.project(x, cos[None], sin[None], torch.bfloat16)
    for a, b in zip(wide[:3], narrow[:3], strict=True):  # q, k, v
        assert b.dtype == torch.bfloat16
        assert torch.equal(b, a.to(torch.bfloat16))
    assert torch.equal(narrow[3], wide[3])  # pre-RoPE k as the product gave it


def _kivi_object(layers: int = 8, heads: int = 2, tokens: int = 100, dim: int = 64):
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(layers, heads, tokens, dim, generator=gen) * 2
    v = torch.randn(layers, heads, tokens, dim, generator=gen)
    chunk = ChunkKV(list(range(tokens)), k, v, "model", "head")
    buf = encode_chunk(chunk, codec=CODECS[DEFAULT_CODEC])
    return decode_header(buf), as_uint8(buf)


def test_a_run_of_layers_decodes_in_a_handful_of_operators_as_each_layer_alone() -> None:
    header, raw = _kivi_object()
    first, count = 1, 7  # the default codec's later layers share their bit widths
    assert header.layer_bits[first:] == (header.layer_bits[first],) * count
    start = header.layer_offset(first)
    block = raw[start : start + count * header.layer_size(first)]
    decode_layers(header, first, count, block, dtype=torch.bfloat16)  # the shift tables made
    ops = count_ops(lambda: decode_layers(header, first, count, block, dtype=torch.bfloat16), 1)
    # 12 here. K: unpack (shift, mask), its steps and minima widened in one conversion, one
    # multiply-add per part of its groups (one here: whole groups); V: its runs' words (one
    # copy), unpack, widen, the Hadamard product, step, minimum, the cast into the cache's
    # dtype. Sixty-odd before (a copy per section, a shift and a mask per code slot), then
    # 18 (six for the words, two for K's steps and minima).
    assert ops.total <= 12, ops.by_name
    k, v = decode_layers(header, first, count, block, dtype=torch.bfloat16)
    for n in range(count):
        index = first + n
        at = header.layer_offset(index)
        layer = raw[at : at + header.layer_size(index)]
        k_one, v_one = decode_layer(header, index, layer, dtype=torch.bfloat16)
        assert torch.equal(k[n], k_one) and torch.equal(v[n], v_one)


def test_grouped_attention_joins_its_groups_in_the_output_products_layout() -> None:
    from kvservice.blend.attention import attend_grouped, group_queries

    gen = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(1, heads, n, 16, generator=gen) for heads, n in ((4, 40), (2, 90), (2, 90))
    )
    positions = torch.sort(torch.randperm(85, generator=gen)[:40]).values
    groups = group_queries(positions, torch.arange(90), 2, min_rows=20)
    assert len(groups.spans) > 1
    out = attend_grouped(q, k, v, groups)
    assert out.shape == (1, 4, 40, 16)
    assert out.transpose(1, 2).is_contiguous()  # Attention.output's layout: no copy left
    one = attend_grouped(q, k, v, group_queries(positions, torch.arange(90), 2, min_rows=None))
    torch.testing.assert_close(out, one)
    # one copy stacks every group's queries, three operators each on the CPU (scores with
    # the mask, softmax, values), one join: it was a copy a group
    ops = count_ops(lambda: attend_grouped(q, k, v, groups), 1)
    assert ops.total == 3 * len(groups.spans) + 2, ops.by_name


def test_words_of_odd_width_codes_ignore_their_unset_high_bytes() -> None:
    """3-, 5-, 6- and 7-bit codes are unpacked from words whose high bytes are left unset
    (``codec._run_words``): whatever those bytes hold, the codes come out the same."""
    gen = torch.Generator().manual_seed(3)
    for bits in (3, 5, 6, 7):
        codes = torch.randint(0, 1 << bits, (2, 8 * 50), generator=gen)
        packed = torch.stack([codecs.pack_bits(row, bits) for row in codes])  # [2, 50 * bits]
        words = codecs._run_words(packed, bits)
        width = words.element_size()
        words.view(torch.uint8).view(2, 50, width)[..., bits:] = 0xFF  # set every unset bit
        shifts = codecs._shifts(bits, 8, words.dtype, "cpu")
        unpacked = (words[..., None] >> shifts) & ((1 << bits) - 1)
        assert torch.equal(unpacked.view(2, -1).long(), codes), bits
        ops = count_ops(lambda p=packed, b=bits: codecs._run_words(p, b), 1)
        assert ops.total == 1, ops.by_name


def test_a_layer_nobody_weighs_attends_as_the_weighed_one_in_fewer_operators() -> None:
    """The question's attention below the first layer selection reads runs as plain
    attention (``attend_layer(weigh=False)``; on the CPU three operators: scores, softmax,
    values): the same output as the weighed computation, no weights, in fewer operators."""
    from kvservice.blend.attention import AttentionPlan, attend_layer, group_queries

    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 4, 6, 16, generator=gen)
    k, v = torch.randn(1, 2, 50, 16, generator=gen), torch.randn(1, 2, 50, 16, generator=gen)
    positions, active = torch.arange(50), torch.arange(44, 50)
    plan = AttentionPlan(
        positions,
        active,
        0,
        6,
        False,
        None,
        group_queries(active[-1:], positions, 2),
        None,
        None,
        None,
        group_queries(active, positions, 2, min_rows=None),
    )
    weighed, weights = attend_layer(plan, q, k, v, last=False)
    plain, none = attend_layer(plan, q, k, v, last=False, weigh=False)
    assert none is None and weights.shape == (50,)
    torch.testing.assert_close(plain, weighed)
    with_weights = count_ops(lambda: attend_layer(plan, q, k, v, last=False), 1).total
    without = count_ops(lambda: attend_layer(plan, q, k, v, last=False, weigh=False), 1).total
    assert without <= 3 < with_weights, (without, with_weights)


def test_sections_side_by_side_widen_in_one_conversion() -> None:
    """K's float16 steps and minima lie back to back in a stored layer (and row by row in a
    run's strided view): ``codec._widened_pair`` converts them as one; apart, one each."""
    gen = torch.Generator().manual_seed(2)
    values = torch.randn(3, 2, 40, generator=gen).half()  # [layers, step | low, 40]
    rows = torch.zeros(3, 200, dtype=torch.uint8)  # a run's layers, 200 bytes each
    rows[:, 16:176] = values.view(torch.uint8).view(3, 160)
    step, low = rows[:, 16:96], rows[:, 96:176]  # [3, 80] bytes each, side by side
    for a, b, launches in ((step, low, 1), (step[0], low[0], 1), (step, rows[:, 104:184], 2)):
        ops = count_ops(lambda a=a, b=b: codecs._widened_pair(a, b), 1)
        assert ops.total == launches, ops.by_name
        wide_a, wide_b = codecs._widened_pair(a, b)
        assert torch.equal(wide_a, a.contiguous().view(torch.float16).float())
        assert torch.equal(wide_b, b.contiguous().view(torch.float16).float())


def test_a_fused_norm_gives_the_norm_the_engine_computes(monkeypatch) -> None:
    """Where ``F.rms_norm`` is one fused kernel (CUDA: ``transformer.FUSED_NORM_ON``) the
    norms use it; forced on the CPU here (where it is the same six operators) it gives what
    the engine's own norm gives, in the dtype asked for."""
    from kvservice.model import transformer

    gen = torch.Generator().manual_seed(4)
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = torch.rand(64, generator=gen) + 0.5
    x = torch.randn(2, 7, 64, generator=gen) * 3
    own = norm(x, torch.bfloat16), norm(x)
    monkeypatch.setattr(transformer, "FUSED_NORM_ON", frozenset({"cpu"}))
    fused = norm(x, torch.bfloat16), norm(x)
    assert fused[0].dtype == torch.bfloat16 and fused[1].dtype == torch.float32
    torch.testing.assert_close(fused[0], own[0], rtol=2**-8, atol=0)
    torch.testing.assert_close(fused[1], own[1], rtol=1e-6, atol=1e-6)
