"""Quantized-weight linear ops: the contract between the quantization methods (pagoda/quant)
and the kernels that run them, with a dequantize-then-matmul reference for each.

  wq_linear(x, w: GroupQuantWeight, bias)          group-wise integer weight (GPTQ, AWQ,
                                                   compressed-tensors pack-quantized, RTN,
                                                   int8 weight-only)
  int8_linear(x, w: Int8Weight, bias)              W8A8: per-channel int8 weight, dynamic
                                                   per-token int8 activations
  fp8_linear(x, w: Fp8Weight, bias)                e4m3 weight, per-tensor/channel/block scales
  gguf_linear(x, w: GGUFWeight, bias)              a GGUF tensor's raw blocks

Each runs through the ops registry (registry.py): a device's kernel where one is registered
and accepts the call, else the reference. A method builds the weight object once after
loading, then calls `prepare(op, w)`, which lets each registered kernel of that device build
its own layout into `w.kernel_data` (a dict keyed by kernel name) once, not per call.

The reference computes in float32 and rounds the product to x's dtype once; a kernel must
match it to its documented rounding (tests/unit compare each kernel with it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from pagoda.ops import quant_layouts
from pagoda.ops.registry import define_op


@dataclass(eq=False, init=False)
class GroupQuantWeight:
    """w[n, k] = (qweight[n, k] - zeros[n, g]) * scales[n, g], g = k // group_size, for the
    layer's input taken in the column order `perm` (y = x[..., perm] @ w.T): act_order
    checkpoints are permuted once at load so that every group is contiguous.

    Held once, in the CPU kernels' panel layout (`layout`, quant_layouts.BlockLayout, any
    device): codes of up to 4 bits half a byte each, 8 bits a byte; scales and zeros
    [G, padded N] (a [G, N] float tensor seen transposed, e.g. GPTQ's scales parameter, is
    shared, not copied). `qweight` / `scales` / `zeros` unpack it ([N, K] uint8, [N, G]
    float32) and `dequantize()` (the reference) reads it."""

    layout: quant_layouts.BlockLayout
    bits: int
    perm: torch.Tensor | None
    kernel_data: dict[str, Any]

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bits: int, group_size: int, perm: torch.Tensor | None = None) -> None:
        """qweight uint8 [N, K] codes in [0, 2**bits); scales / zeros [N, G], G = ceil(K /
        group_size) (group_size K: one group per output channel); perm [K] int64."""
        n, k = qweight.shape
        groups = (k + group_size - 1) // group_size
        if qweight.dtype != torch.uint8:
            raise ValueError(f"qweight codes must be uint8, got {qweight.dtype}")
        if not 1 <= bits <= 8:
            raise ValueError(f"bits must be in [1, 8], got {bits}")
        for name, t in (("scales", scales), ("zeros", zeros)):
            if tuple(t.shape) != (n, groups):
                raise ValueError(f"{name} must be [{n}, {groups}], got {list(t.shape)}")
        if perm is not None and tuple(perm.shape) != (k,):
            raise ValueError(f"perm must be [{k}], got {list(perm.shape)}")
        self.layout = quant_layouts.pack(qweight, scales, zeros, bits, group_size,
                                         zero_form=True)
        self.bits, self.perm, self.kernel_data = bits, perm, {}

    @property
    def shape(self) -> tuple[int, int]:
        return self.layout.shape

    @property
    def group_size(self) -> int:
        return self.layout.group

    @property
    def qweight(self) -> torch.Tensor:
        """The codes, unpacked: uint8 [N, K] (a new tensor)."""
        return self.layout.unpack_codes()

    @property
    def scales(self) -> torch.Tensor:
        return self.layout.scale_rows()

    @property
    def zeros(self) -> torch.Tensor:
        return self.layout.offset_rows()

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] in the permuted column order."""
        return self.layout.dequantize()


@dataclass(eq=False)
class Int8Weight:
    """W8A8: w[n, k] = qweight[n, k] * scales[n]; activations quantized per token at run
    time: x_q = round(x / s_t) clamped to [-127, 127], s_t = max|x_t| / 127."""

    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N]
    kernel_data: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class Fp8Weight:
    """w = float(weight) * scale, the scale per tensor ([1]), per output channel ([N]) or per
    block ([ceil(N / bn), ceil(K / bk)] with block = (bn, bk)). Activations stay unquantized."""

    weight: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32
    block: tuple[int, int] | None = None
    kernel_data: dict[str, Any] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def dequantize(self) -> torch.Tensor:
        w = self.weight.to(torch.float32)
        s = self.scale.float()
        if self.block is not None:
            bn, bk = self.block
            s = s.repeat_interleave(bn, 0)[: w.shape[0]].repeat_interleave(bk, 1)[:, : w.shape[1]]
            return w * s
        return w * (s.reshape(-1, 1) if s.numel() > 1 else s)


@dataclass(eq=False)
class GGUFWeight:
    """One GGUF tensor of quant type `qtype` (a gguf.GGMLQuantizationType value), logical
    shape [N, K]: its raw blocks `raw` uint8 [N, bytes per row], and/or `layout`, the CPU
    kernels' panel layout of the same values (set by their preparer). Where the layout
    holds the blocks exactly (REPACKABLE types) the loader drops `raw`: `blocks()` rebuilds
    them bit for bit, and the reference dequantizes the layout (the same float32 values
    gguf's dequantization gives)."""

    raw: torch.Tensor | None
    qtype: int
    shape: tuple[int, int]
    kernel_data: dict[str, Any] = field(default_factory=dict)
    layout: quant_layouts.BlockLayout | None = None

    def blocks(self) -> torch.Tensor:
        """The raw blocks uint8 [N, bytes per row] (rebuilt from the layout when dropped)."""
        if self.raw is not None:
            return self.raw
        return quant_layouts.to_gguf(self.layout, self.qtype)

    def dequantize(self) -> torch.Tensor:
        if self.raw is None:
            return self.layout.dequantize()
        from gguf.quants import dequantize

        values = dequantize(self.raw.cpu().numpy(), self.qtype)
        return torch.from_numpy(values.reshape(self.shape).copy()).to(self.raw.device)

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 [len(rows), K]: the dequantized rows `rows` (int64) only."""
        if self.raw is None:
            return self.layout.dequantize_rows(rows)
        picked = self.raw.index_select(0, rows)
        return GGUFWeight(picked, self.qtype, (len(rows), self.shape[1])).dequantize()


def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = F.linear(x.to(torch.float32), w, None if bias is None else bias.to(torch.float32))
    return y.to(x.dtype)


def wq_linear_reference(
    x: torch.Tensor, w: GroupQuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    if w.perm is not None:
        x = x.index_select(-1, w.perm)
    return _linear(x, w.dequantize(), bias)


def int8_linear_reference(
    x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    # float64 holds every int8 x int8 partial sum exactly (up to K ~ 2**37 terms).
    xf = x.to(torch.float64)
    s_t = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-12)
    xq = torch.round(xf / s_t).clamp(-127, 127)
    acc = xq @ w.qweight.to(torch.float64).T
    y = (acc * s_t * w.scales.to(torch.float64)).to(torch.float32)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


def fp8_linear_reference(
    x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return _linear(x, w.dequantize(), bias)


def gguf_linear_reference(
    x: torch.Tensor, w: GGUFWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return _linear(x, w.dequantize(), bias)


wq_linear = define_op("wq_linear", wq_linear_reference)
int8_linear = define_op("int8_linear", int8_linear_reference)
fp8_linear = define_op("fp8_linear", fp8_linear_reference)
gguf_linear = define_op("gguf_linear", gguf_linear_reference)

# (op name, device type) -> functions that build a kernel's layout into w.kernel_data.
Preparer = Callable[[Any, torch.dtype | None], None]
_PREPARERS: dict[tuple[str, str], list[Preparer]] = {}


def register_preparer(op_name: str, device_type: str, fn: Preparer) -> None:
    """`fn(w, dtype)` runs once per weight object (from `prepare`) on that device type; it
    may store a layout in w.kernel_data (only when its kernel takes activations of `dtype`;
    None: any) and must leave w usable by the reference."""
    _PREPARERS.setdefault((op_name, device_type), []).append(fn)


def prepare(op_name: str, w: Any, device_type: str, dtype: torch.dtype | None = None) -> None:
    """Let each kernel registered for (op, device) prepare its layout of `w` once, for
    activations of `dtype` (the model's; None: whatever its kernels take)."""
    for fn in _PREPARERS.get((op_name, device_type), ()):
        fn(w, dtype)
