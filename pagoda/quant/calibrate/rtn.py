"""Round-to-nearest group quantization: the grid GPTQ, AWQ and plain RTN all quantize onto.

A weight [N, K] is cut into groups of `group_size` input columns; each (row, group) has a
scale and an integer zero, w ~ (q - zero) * scale with q in [0, 2**bits). Symmetric (as GPTQ
writers do it): zero = 2**(bits-1), scale = 2 max|w| / (2**bits - 1). Asymmetric: the grid
spans [min(w, 0), max(w, 0)].

Scales are rounded to float16 when they are fitted, because checkpoints store them so: the
codes are chosen against the scale a loader will see, and the in-memory quantized model is
exactly the one the checkpoint describes.

With `mse_clip` each group's range is also searched: the grid of [p lo, p hi] for the shrink
p on a grid from 1 down to 1 - CLIP_MAX_SHRINK whose codes give the lowest squared error of
the group's weights (clipping the few largest weights buys a finer step for all the others;
GPTQ's reference quantizer and llama.cpp's K-quants search the same way). The format is
unchanged: still one float16 scale and one integer zero per group.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class QuantSpec:
    bits: int = 4
    group_size: int = 128  # -1: one group per row
    sym: bool = True
    # The smallest zero the checkpoint format stores. GPTQ v1 writes zero - 1 in `bits` bits,
    # so a zero of 0 would read back as 2**bits: its asymmetric grids start at zero 1.
    min_zero: int = 0
    mse_clip: bool = False  # search each group's range for the lowest squared error

    @property
    def maxq(self) -> int:
        return (1 << self.bits) - 1

    def group_len(self, k: int) -> int:
        return k if self.group_size == -1 else self.group_size

    def check(self, k: int) -> None:
        if self.bits not in (2, 4, 8):
            raise ValueError(f"bits must be 2, 4 or 8, got {self.bits}")
        if self.group_size != -1 and (self.group_size < 1 or k % self.group_size):
            raise ValueError(
                f"group_size {self.group_size} does not divide the input size {k} "
                "(use a divisor, or -1 for one group per row)")


@dataclass(slots=True)
class QuantizedTensor:
    """codes [N, K] uint8 in the weight's own column order; scales [N, G] float32 (float16
    values); zeros [N, G] int64; g_idx [K] int64: the group of each input column (k //
    group_size unless act_order reordered the columns)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    spec: QuantSpec

    def rows(self, start: int, stop: int) -> QuantizedTensor:
        """Output rows [start, stop) (one linear of a stacked quantization)."""
        return QuantizedTensor(self.codes[start:stop], self.scales[start:stop],
                               self.zeros[start:stop], self.g_idx, self.spec)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] this quantization stands for."""
        s = self.scales[:, self.g_idx]
        return (self.codes.to(torch.float32) - self.zeros[:, self.g_idx]) * s


CLIP_GRID = 40  # shrink factors the mse_clip search tries, 1 - i / CLIP_GRID * CLIP_MAX_SHRINK
CLIP_MAX_SHRINK = 0.4


def fit_params(w: torch.Tensor, spec: QuantSpec, column_weight: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and integer zero for each row of `w` [N, group] (one group): float32 [N]
    holding float16 values, and int64 [N]. Rows are independent (a [N * G, group] view
    fits every group of a weight at once). `column_weight` [group]: with mse_clip, each
    column's weight in the squared error (GPTQ gives the Hessian's diagonal, so that a
    column whose input is large, such as an outlier channel's, is not clipped cheaply)."""
    w = w.to(torch.float32)
    lo = w.amin(dim=1).clamp(max=0)
    hi = w.amax(dim=1).clamp(min=0)
    if not spec.mse_clip:
        return _grid(lo, hi, spec)
    cw = None if column_weight is None else column_weight.to(torch.float32)
    best_scale, best_zero = _grid(lo, hi, spec)
    best_err = _squared_error(w, best_scale, best_zero, spec.maxq, cw)
    for i in range(1, CLIP_GRID):
        shrink = 1 - i * CLIP_MAX_SHRINK / CLIP_GRID
        scale, zero = _grid(lo * shrink, hi * shrink, spec)
        err = _squared_error(w, scale, zero, spec.maxq, cw)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


def _squared_error(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int,
                   column_weight: torch.Tensor | None) -> torch.Tensor:
    q = quantize_codes(w, scale, zero, maxq)
    err = ((q - zero.unsqueeze(1)) * scale.unsqueeze(1) - w).pow(2)
    return (err if column_weight is None else err * column_weight).sum(dim=1)


def _grid(lo: torch.Tensor, hi: torch.Tensor,
          spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid spanning [lo, hi] per row (lo <= 0 <= hi)."""
    if spec.sym:
        hi = torch.maximum(lo.abs(), hi)
        lo = -hi
    span = hi - lo
    span = torch.where(span == 0, torch.ones_like(span), span)
    scale = (span / spec.maxq).to(torch.float16).to(torch.float32)
    # A float16 underflow would divide by zero below; the smallest normal keeps codes finite.
    scale = scale.clamp(min=float(torch.finfo(torch.float16).tiny))
    if spec.sym:
        zero = torch.full_like(scale, (spec.maxq + 1) // 2, dtype=torch.int64)
        return scale, zero
    if spec.min_zero:
        # NOTE: a grid whose zero rounds below min_zero (hardly any negative weights) gives
        # the min_zero lowest codes to negatives and spans [0, hi] with the rest.
        low = torch.round(-lo / scale) < spec.min_zero
        refit = (hi / (spec.maxq - spec.min_zero)).to(torch.float16).to(torch.float32)
        scale = torch.where(low, refit, scale).clamp(min=float(torch.finfo(torch.float16).tiny))
    zero = torch.round(-lo / scale).clamp(spec.min_zero, spec.maxq).to(torch.int64)
    return scale, zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                   maxq: int) -> torch.Tensor:
    """Codes of `w` [N, C] on the grid of per-row `scale` / `zero` [N] (or [N, C])."""
    if scale.dim() == 1:
        scale, zero = scale.unsqueeze(1), zero.unsqueeze(1)
    return torch.clamp(torch.round(w / scale) + zero, 0, maxq)


@contextmanager
def single_threaded() -> Iterator[None]:
    """torch on one thread inside the block. NOTE: GPTQ's column loop and the group fits are
    many small elementwise ops; spread over OpenMP threads each one waits for the slowest
    thread, which on a busy machine made them 10-40x slower than on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def fake_quantize(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """w [N, K] quantized group-wise to nearest and dequantized again (float32)."""
    return quantize_rtn(w, spec).dequantize()


def quantize_rtn(w: torch.Tensor, spec: QuantSpec) -> QuantizedTensor:
    """Round-to-nearest, group by group (every group fitted at once: rows of [N * G, gl])."""
    n, k = w.shape
    spec.check(k)
    gl = spec.group_len(k)
    groups = w.to(torch.float32).reshape(n * (k // gl), gl)
    with single_threaded():
        scale, zero = fit_params(groups, spec)
        codes = quantize_codes(groups, scale, zero, spec.maxq).reshape(n, k).to(torch.uint8)
    g_idx = torch.arange(k) // gl
    return QuantizedTensor(codes, scale.reshape(n, k // gl), zero.reshape(n, k // gl), g_idx,
                           spec)
