"""fp8_linear on CUDA devices with FP8 tensor cores (compute capability 8.9+): the
activations are quantized to e4m3 per token, then torch._scaled_mm multiplies with row-wise
(per-token x per-channel) scales, accumulating in float32.

Its documented rounding against the reference (which keeps activations unquantized): the
per-token e4m3 rounding of x, and a bfloat16 product. Block-scaled weights are left to the
reference. tests/gpu/test_ops_on_device.py checks it (run on an H200, session 18).
"""

from __future__ import annotations

import torch

from pagoda.ops import wquant
from pagoda.ops.registry import Kernel

_FP8 = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(_FP8).max)


def _resolve() -> bool | None:
    return True if torch.cuda.is_available() and hasattr(torch, "_scaled_mm") else None


def _supports(x: torch.Tensor, w: wquant.Fp8Weight, bias: torch.Tensor | None = None) -> bool:
    n, k = w.weight.shape
    return (
        w.block is None and w.weight.is_cuda and k % 16 == 0 and n % 16 == 0
        and torch.cuda.get_device_capability(x.device) >= (8, 9)
    )


def fp8_linear_scaled_mm(
    _handle: bool, x: torch.Tensor, w: wquant.Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    n, k = w.weight.shape
    x2 = x.reshape(-1, k).float()
    s_x = (x2.abs().amax(dim=1, keepdim=True) / _FP8_MAX).clamp(min=1e-12)
    xq = (x2 / s_x).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8)
    s_w = w.scale.float().reshape(-1).expand(n).reshape(1, n).contiguous()
    # NOTE: mat2 must be column-major: the [N, K] row-major weight transposed is.
    y = torch._scaled_mm(xq, w.weight.t(), scale_a=s_x, scale_b=s_w, out_dtype=torch.bfloat16)
    y = y.float() if bias is None else y.float() + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def register() -> None:
    wquant.fp8_linear.register("cuda", Kernel(
        name="scaled_mm", fn=fp8_linear_scaled_mm,
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        resolve=_resolve, supports=_supports,
    ))
