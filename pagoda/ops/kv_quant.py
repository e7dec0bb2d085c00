"""Quantized KV cache formats: int8 and fp8 e4m3 codes with one float32 scale per token and
kv head (symmetric, scale = max|x| / code max).

Layout: a quantized layer holds four tensors, (k_codes, v_codes, k_scales, v_scales):
codes [num_blocks, block_size, Hk, D] (torch.int8, or torch.uint8 holding e4m3fn bits:
PyTorch's CPU index ops do not take float8 tensors), scales [num_blocks, block_size, Hk]
float32. Every block copy (swap, host tier, fork) copies all four, so scales travel with
their codes. A value is code * scale (fp8: the e4m3fn value of the bits times scale).

Rounding (the C++ kernels do the same arithmetic, code for code): amax in float32,
scale = amax / code_max, code = round-half-even(x / scale) clamped (int8: [-127, 127];
fp8: [-448, 448], then rounded to e4m3fn); an all-zero row has scale 0 and codes 0.
"""

from __future__ import annotations

import torch

# The storage dtype of each quantized format -> its largest code magnitude.
CODE_MAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.uint8: 448.0}
# The logical cache dtype a config names -> the codes' storage dtype.
STORAGE_DTYPE: dict[torch.dtype, torch.dtype] = {
    torch.int8: torch.int8,
    torch.float8_e4m3fn: torch.uint8,
}
SCALE_DTYPE = torch.float32


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of this (logical or storage) dtype holds codes with scales."""
    return dtype in STORAGE_DTYPE or dtype in CODE_MAX


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The element type the cache tensors are allocated in."""
    return STORAGE_DTYPE.get(dtype, dtype)


def quantize(x: torch.Tensor, code_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D] in code_dtype's storage, scales [...] float32);
    code_dtype: the logical (torch.float8_e4m3fn) or the storage dtype."""
    code_dtype = storage_dtype(code_dtype)
    code_max = CODE_MAX[code_dtype]
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / code_max
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    y = (xf / safe[..., None]).clamp(-code_max, code_max)
    if code_dtype == torch.int8:
        codes = torch.round(y).to(torch.int8)
    else:
        codes = y.to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(codes [..., D], scales [...]) -> values [..., D] in dtype (float32 math)."""
    if codes.dtype == torch.uint8:
        values = codes.view(torch.float8_e4m3fn).float()
    else:
        values = codes.float()
    return (values * scales[..., None]).to(dtype)
