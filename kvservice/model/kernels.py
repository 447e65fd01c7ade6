"""The linear layers' kernel: the fastest product this machine has for the model's weights,
chosen at load by a short measurement and logged.

A transformer's prefill, blend recompute, reuse pass, decode and chunk precompute spend
most of their time in the linear layers (42 % of a 3,700-token SmolLM2 prefill on 2 cores;
the rest is attention). Which product is fastest depends on the CPU:

* ``torch``: ``F.linear`` (MKL's sgemm on x86). At the machine's fp32 peak on Intel
  (208 GFLOP/s for a 3,700x576 @ 576x1536 product on a 2-core Xeon with AMX), but half of it
  on AMD EPYC, where MKL takes a generic path (208 against oneDNN's 448 GFLOP/s).
* ``onednn``: oneDNN with the weight reordered once into its blocked layout
  (``mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, what vLLM's CPU backend runs).
* ``onednn-bf16``: the same with the weight in bfloat16 and the activations cast to it,
  products accumulated in fp32: AMX tiles or AVX512-BF16 where the CPU has them (5-6x fp32's
  rate on the Xeon above), refused where bfloat16 would be emulated. It rounds activations and
  weights to 8 bits of mantissa, so it runs only where ``precision`` allows it: see
  ``docs/kernels.md`` for what it changed in fidelity.
* On CUDA the products stay ``torch`` (cuBLAS): nothing to choose.

``prepare(model, precision)`` measures the candidates on layer 0's own weights at two shapes
(a prefill block and a decode step), packs every layer with the fastest for prefill, and
returns the ``KernelChoice`` (logged, and reported by the benches and the worker's status).
The q/k/v projections and the MLP's gate/up are each run as one product over their
concatenated weights (``FusedLinear``): one pass over the activations instead of three or two.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

KERNELS = ("torch", "onednn", "onednn-bf16")
PRECISIONS = ("float32", "auto")  # auto: bfloat16 products where the CPU has them natively
# The product's default (the inference worker, ingest, the benches): bfloat16 where the CPU has
# it natively, float32 elsewhere. On validation it moved full prefill by tf_kl 0.0007 and left
# blend's tf_kl to its own full unchanged (docs/kernels.md). Library calls
# (``Transformer.from_pretrained``) stay float32 unless asked.
DEFAULT_PRECISION = "auto"
PREFILL_ROWS = 512  # the measured prefill block (rows of one product)
DECODE_ROWS = 1
# oneDNN picks its blocked layout for a batch size; decode runs the same packed weight.
PACK_ROWS_HINT = 1024


class UnknownPrecisionError(ValueError):
    """A precision setting this engine does not know."""


def native_bf16() -> bool:
    """True when this CPU multiplies bfloat16 in hardware (AMX tiles or AVX512-BF16) and
    oneDNN is there to use it; elsewhere bfloat16 products are emulated and slower than fp32."""
    if not torch.backends.mkldnn.is_available():
        return False
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def attention_dtype(device: torch.device, precision: str, weights: torch.dtype) -> torch.dtype:
    """What attention and the KV cache run in: bfloat16 under ``auto`` on a CPU that has it
    natively, else the weights' dtype (on CUDA ``auto`` changes nothing: load the model in
    the dtype wanted)."""
    if precision == "auto" and device.type == "cpu" and native_bf16():
        return torch.bfloat16
    return weights


@functools.cache
def onednn_runs(dtype: torch.dtype) -> bool:
    """True when oneDNN's packed product runs in ``dtype`` on this CPU, asked of the CPU
    itself with a tiny product: float16 needs AVX512-FP16 or AVX-NE-CONVERT (absent on AMD
    EPYC Zen 4, where packing a float16 weight fails), float32 runs everywhere oneDNN does."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=dtype), 16)
        torch.ops.mkldnn._linear_pointwise(
            torch.ones(2, 16, dtype=dtype), weight, None, "none", [], ""
        )
    except RuntimeError as err:
        log.info("oneDNN has no %s product on this CPU: %s", dtype, err)
        return False
    return True


def candidates(
    device: torch.device, precision: str, weights: torch.dtype = torch.float32
) -> list[str]:
    """The kernels worth measuring on ``device`` at ``precision`` for weights in ``weights``:
    only those this CPU runs."""
    if precision not in PRECISIONS:
        raise UnknownPrecisionError(
            f"unknown linear precision {precision!r} (one of {', '.join(PRECISIONS)})"
        )
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return ["torch"]
    names = ["torch"]
    if onednn_runs(weights):
        names.append("onednn")
    if precision == "auto" and native_bf16():
        names.append("onednn-bf16")
    return names


# --------------------------------------------------------------------------------------------
# The packed product


class FusedLinear(nn.Module):
    """Several ``nn.Linear`` of one input run as one product, their outputs returned apart.

    Holds no parameters of its own (the checkpoint's ``q_proj``/``k_proj``/... stay where the
    state dict names them); ``pack`` builds the concatenated weight in the kernel's layout
    once the weights are loaded. Unpacked (a model built in a test and never prepared), it
    runs the parts one by one."""

    def __init__(self, *parts: nn.Linear):
        super().__init__()
        self._parts = list(parts)  # not submodules: their parameters are registered elsewhere
        self.sizes = [part.out_features for part in parts]
        self.kernel = "torch"
        self.input_dtype = parts[0].weight.dtype
        # (weight [sum(out), in] in the kernel's layout, bias): a tuple, so that nn.Module
        # never registers a part's Parameter here a second time.
        self.packed: tuple[torch.Tensor, torch.Tensor | None] | None = None

    @torch.no_grad()
    def pack(self, kernel: str) -> None:
        weights = [part.weight for part in self._parts]
        biases = [part.bias for part in self._parts]
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)  # [sum(out), in]
        bias = None if biases[0] is None else torch.cat(biases)
        self.kernel = kernel
        self.input_dtype = torch.bfloat16 if kernel == "onednn-bf16" else weight.dtype
        if kernel == "torch":
            # The parts' weights become views of the fused one: no second copy in memory
            # (an 8B model's on a GPU).
            offset = 0
            for part in self._parts:
                rows = part.out_features
                part.weight.data = weight[offset : offset + rows]
                if part.bias is not None:
                    part.bias.data = bias[offset : offset + rows]
                offset += rows
            self.packed = (weight, bias)
            return
        dtype = self.input_dtype
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), PACK_ROWS_HINT)
        self.packed = (packed, None if bias is None else bias.to(dtype))

    @property
    def nbytes(self) -> int:
        """Bytes of the weights and biases one product reads, as they are run."""
        if self.packed is None:
            tensors = [p for part in self._parts for p in part.parameters()]
        else:
            tensors = [t for t in self.packed if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [..., in]`` -> each part's output ``[..., out_i]`` (bfloat16 under
        ``onednn-bf16``: the caller widens what it must, fp32 + bf16 promotes to fp32)."""
        if self.packed is None:
            x = x.to(self._parts[0].weight.dtype)
            return tuple(part(x) for part in self._parts)
        y = self.joined(x)
        if len(self.sizes) == 1:
            return (y,)
        return y.split(self.sizes, dim=-1)

    def joined(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` -> the parts' outputs side by side, ``[..., sum(out_i)]``: one
        tensor, so that what follows can treat neighbouring parts as one (q and k rotated
        by one RoPE)."""
        if self.packed is None:
            x = x.to(self._parts[0].weight.dtype)
            return torch.cat([part(x) for part in self._parts], dim=-1)
        weight, bias = self.packed
        x = x.to(self.input_dtype)  # e.g. a bfloat16 attention output into fp32 products
        if self.kernel == "torch":
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


# --------------------------------------------------------------------------------------------
# The choice


@dataclass(frozen=True)
class KernelChoice:
    kernel: str
    precision: str
    prefill_ms: dict[str, float] = field(default_factory=dict)  # per candidate, one layer
    decode_ms: dict[str, float] = field(default_factory=dict)
    cpu_bf16: bool = False
    # What attention and the KV cache it reads run in: bfloat16 under ``auto`` on a CPU with
    # native bfloat16 (SDPA's flash kernel 2.5x fp32's rate there), else the weights' dtype.
    attention_dtype: torch.dtype = torch.float32

    def to_dict(self) -> dict[str, object]:
        return {
            "kernel": self.kernel,
            "precision": self.precision,
            "prefill_ms": self.prefill_ms,
            "decode_ms": self.decode_ms,
            "cpu_bf16": self.cpu_bf16,
            "attention_dtype": str(self.attention_dtype).removeprefix("torch."),
        }

    def describe(self) -> str:
        timings = ", ".join(
            f"{name} {self.prefill_ms[name]:.2f}/{self.decode_ms[name]:.3f} ms"
            for name in self.prefill_ms
        )
        measured = timings or "not measured"
        attention = str(self.attention_dtype).removeprefix("torch.")
        return (
            f"linear kernel {self.kernel}, attention in {attention} "
            f"(precision {self.precision}; {measured})"
        )


def _products(module: nn.Module) -> list[FusedLinear]:
    """The packed products under ``module`` (a model or one layer)."""
    return [m for m in module.modules() if isinstance(m, FusedLinear)]


ROUNDS = 3  # rounds of timing every candidate kernel at load


def _time_layer(products: Sequence[FusedLinear], rows: int, repeats: int) -> float:
    """Fastest milliseconds of one pass of a layer's products over ``rows`` rows (the
    fastest: other processes on the cores only ever slow a run down)."""
    inputs = [torch.randn(1, rows, product._parts[0].in_features) for product in products]
    best = float("inf")
    for _ in range(repeats + 1):  # the first run is a warm-up, and never the fastest
        start = time.perf_counter()
        for product, x in zip(products, inputs, strict=True):
            product(x)
        best = min(best, time.perf_counter() - start)
    return 1000 * best


@torch.no_grad()
def prepare(
    model: nn.Module, precision: str = "float32", kernel: str | None = None
) -> KernelChoice:
    """Pack ``model``'s linear layers with the fastest kernel allowed at ``precision``
    (``kernel`` forces one, for tests and benches). Returns the choice, also logged."""
    device = next(model.parameters()).device
    weights = next(model.parameters()).dtype
    names = candidates(device, precision, weights)
    if kernel is not None:
        if kernel not in KERNELS:
            raise ValueError(f"unknown linear kernel {kernel!r} (one of {', '.join(KERNELS)})")
        if kernel == "onednn" and device.type == "cpu" and not onednn_runs(weights):
            raise ValueError(f"this CPU has no oneDNN {weights} product: use kernel 'torch'")
        names = [kernel]
    products = _products(model)
    prefill_ms: dict[str, float] = {}
    decode_ms: dict[str, float] = {}
    if len(names) > 1:
        first_layer = _products(model.layers[0])
        for _ in range(ROUNDS):  # candidates in turn, so a burst of other work hits them alike
            for name in names:
                for product in first_layer:
                    product.pack(name)
                prefill = _time_layer(first_layer, PREFILL_ROWS, repeats=2)
                decode = _time_layer(first_layer, DECODE_ROWS, repeats=3)
                prefill_ms[name] = min(prefill_ms.get(name, prefill), prefill)
                decode_ms[name] = min(decode_ms.get(name, decode), decode)
        chosen = min(prefill_ms, key=prefill_ms.__getitem__)
    else:
        chosen = names[0]
    for product in products:
        product.pack(chosen)
    choice = KernelChoice(
        chosen,
        precision,
        prefill_ms,
        decode_ms,
        native_bf16(),
        attention_dtype(device, precision, weights),
    )
    log.info("%s", choice.describe())
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if len(names) > 1 and busy > (os.cpu_count() or 1):
        log.warning(
            "the kernels were timed on a busy machine (load average %.1f on %d cores): the "
            "choice may not be the fastest (restart when quieter, or set ENGINE_KERNEL)",
            busy,
            os.cpu_count() or 1,
        )
    return choice
