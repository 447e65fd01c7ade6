"""The linear layers' kernels (kvservice.model.kernels): each computes the same products as
``F.linear``, the choice is made among the candidates the device allows, and packing leaves
the checkpoint's parameters as they were."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvservice.model import kernels
from kvservice.model.kernels import FusedLinear, UnknownPrecisionError, candidates, prepare
from kvservice.model.transformer import Transformer

ONEDNN = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


def _parts(bias: bool) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(96, out, bias=bias) for out in (96, 32, 32)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "kernel,tolerance",
    [
        ("torch", 1e-5),
        pytest.param("onednn", 1e-5, marks=ONEDNN),
        pytest.param("onednn-bf16", 3e-2, marks=ONEDNN),
    ],
)
def test_each_kernel_computes_each_parts_product(kernel, tolerance, bias):
    parts = _parts(bias)
    fused = FusedLinear(*parts)
    x = torch.randn(2, 37, 96)
    unpacked = fused(x)
    fused.pack(kernel)
    packed = fused(x)
    assert [tuple(y.shape) for y in packed] == [(2, 37, 96), (2, 37, 32), (2, 37, 32)]
    for part, before, after in zip(parts, unpacked, packed, strict=True):
        expected = F.linear(x, part.weight, part.bias)
        torch.testing.assert_close(before, expected)
        torch.testing.assert_close(after.float(), expected, atol=tolerance, rtol=tolerance)


def test_torch_packing_keeps_one_copy_of_the_weights():
    parts = _parts(bias=True)
    before = [part.weight.detach().clone() for part in parts]
    fused = FusedLinear(*parts)
    fused.pack("torch")
    weight, _ = fused.packed
    for part, original in zip(parts, before, strict=True):
        assert part.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
        torch.testing.assert_close(part.weight, original, atol=0, rtol=0)


def test_candidates_follow_device_and_precision():
    assert candidates(torch.device("cuda"), "auto") == ["torch"]
    cpu_fp32 = candidates(torch.device("cpu"), "float32")
    assert "onednn-bf16" not in cpu_fp32 and cpu_fp32[0] == "torch"
    bf16_allowed = "onednn-bf16" in candidates(torch.device("cpu"), "auto")
    assert bf16_allowed == kernels.native_bf16()
    with pytest.raises(UnknownPrecisionError, match="unknown linear precision 'int4'"):
        candidates(torch.device("cpu"), "int4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_candidate_kernel_runs_on_this_cpu_in_the_weights_dtype(tiny_checkpoints, dtype):
    """Only kernels this CPU runs are offered: a float16 model loads on an AMD EPYC without
    AVX512-FP16 (oneDNN's float16 packing failed there and the load with it)."""
    names = candidates(torch.device("cpu"), "auto", dtype)
    assert ("onednn" in names) == kernels.onednn_runs(dtype)
    model = Transformer.from_pretrained(tiny_checkpoints["llama"], dtype=dtype)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(5))
    for name in names:
        model.prepare_kernels("auto", kernel=name)
        logits, _ = model(ids, torch.arange(20)[None], all_logits=True)
        assert torch.isfinite(logits).all(), name
    if not kernels.onednn_runs(dtype):
        with pytest.raises(ValueError, match="no oneDNN"):
            model.prepare_kernels("auto", kernel="onednn")


def test_prepare_measures_every_candidate_and_keeps_the_state_dict(tiny_checkpoints):
    model = Transformer.from_pretrained(tiny_checkpoints["llama"])
    keys_before = set(model.state_dict())
    ids = torch.randint(0, 128, (1, 50), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(50)[None]
    expected, _ = model(ids, positions, all_logits=True)

    choice = prepare(model, "float32")
    assert set(choice.prefill_ms) == set(candidates(torch.device("cpu"), "float32"))
    assert choice.kernel == min(choice.prefill_ms, key=choice.prefill_ms.__getitem__)
    assert all(ms > 0 for ms in [*choice.prefill_ms.values(), *choice.decode_ms.values()])
    assert choice.kernel in choice.describe()
    assert set(model.state_dict()) == keys_before  # nothing of the packing is a parameter
    logits, _ = model(ids, positions, all_logits=True)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)

    with pytest.raises(ValueError, match="unknown linear kernel 'fast'"):
        prepare(model, "float32", kernel="fast")


@pytest.mark.parametrize("kernel", ["torch", pytest.param("onednn", marks=ONEDNN)])
def test_a_prepared_model_moved_or_cast_runs_its_products_where_its_weights_went(
    tiny_checkpoints, kernel
):
    """The packed weights are not parameters, so ``nn.Module.to`` alone would leave them
    behind: cast to float64 (which oneDNN does not pack), the model computes in float64 with
    the kernel that runs it (its logits are float32, as always), and on the meta device
    every packed weight is on meta."""
    model = Transformer.from_pretrained(tiny_checkpoints["llama"])
    model.prepare_kernels("float32", kernel=kernel)
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(6))
    positions = torch.arange(30)[None]
    before, _ = model(ids, positions, all_logits=True)

    model.to(torch.float64)
    products = [m for m in model.modules() if isinstance(m, FusedLinear)]
    assert model.kernel_choice.kernel == "torch"
    assert {p.packed[0].dtype for p in products} == {torch.float64}
    after, _ = model(ids, positions, all_logits=True)
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)

    model.to("meta")
    assert {p.packed[0].device.type for p in products} == {"meta"}
    x = torch.zeros(1, 3, model.config.dim, device="meta")
    assert all(y.device.type == "meta" for y in model.layers[0].self_attn.qkv(x))


@ONEDNN
def test_bfloat16_products_stay_close_to_float32(tiny_checkpoints):
    """The model run with bfloat16 products predicts what it predicts in float32: the
    fidelity measured on the bundled model is in docs/kernels.md."""
    model = Transformer.from_pretrained(tiny_checkpoints["llama"])
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(60)[None]
    reference, _ = model(ids, positions, all_logits=True)
    forced = model.prepare_kernels("auto", kernel="onednn-bf16")
    assert forced.kernel == "onednn-bf16" and forced.prefill_ms == {}
    logits, _ = model(ids, positions, all_logits=True)
    assert logits.dtype == torch.float32
    kl = F.kl_div(
        logits.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="none"
    ).sum(-1)
    assert float(kl.mean()) < 1e-3
    agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
    assert float(agree) > 0.9


def test_the_worker_reads_and_checks_engine_precision_and_kernel(monkeypatch):
    from kvservice.config import WorkerConfig

    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.delenv("ENGINE_PRECISION", raising=False)
    assert WorkerConfig.from_env().precision == kernels.DEFAULT_PRECISION
    monkeypatch.setenv("ENGINE_PRECISION", "float32")
    assert WorkerConfig.from_env().precision == "float32"
    monkeypatch.setenv("ENGINE_PRECISION", "int4")
    with pytest.raises(ValueError, match="ENGINE_PRECISION must be 'float32' or 'auto'"):
        WorkerConfig.from_env()
    monkeypatch.setenv("ENGINE_PRECISION", "auto")
    monkeypatch.setenv("ENGINE_KERNEL", "onednn")
    assert WorkerConfig.from_env().kernel == "onednn"
    monkeypatch.setenv("ENGINE_KERNEL", "cublas-int8")
    with pytest.raises(ValueError, match="ENGINE_KERNEL must be one of"):
        WorkerConfig.from_env()
