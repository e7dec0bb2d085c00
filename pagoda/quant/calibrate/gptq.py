"""GPTQ (Frantar et al., 2022) for one linear layer.

Given the layer's calibration inputs X [tokens, K], the Hessian of the layer's squared
output error is H = 2 X^T X / tokens. Columns are quantized one at a time; the error each
one leaves is spread over the columns not yet quantized through the inverse Hessian, so
they compensate for it (optimal brain surgeon, one column at a time). The inverse is taken
once as the upper Cholesky factor of H^-1, whose rows give each step's update, and updates
are applied lazily: within a block of columns at once, to the rest of the matrix once per
block. With act_order the columns go in order of decreasing diag(H) (the most sensitive
first, while the most columns are left to compensate), groups are then formed in that order,
and g_idx records each input column's group. With static groups the groups stay the weight's
own column ranges (g_idx = k // group_size, the layout kernels take unpermuted), their
scales and zeros fitted on the weight before any update, and act_order only orders the
columns' quantization.
"""

from __future__ import annotations

import torch

from pagoda.quant.calibrate.rtn import (
    QuantizedTensor,
    QuantSpec,
    fit_params,
    quantize_codes,
    single_threaded,
)


class HessianAccumulator:
    """Running H = 2 X^T X / n over every batch of inputs given to `add`."""

    def __init__(self, num_columns: int) -> None:
        self.hessian = torch.zeros(num_columns, num_columns, dtype=torch.float64)
        self.num_tokens = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float64)
        total = self.num_tokens + x.shape[0]
        self.hessian *= self.num_tokens / total
        self.hessian += (2.0 / total) * (x.T @ x)
        self.num_tokens = total


def _inverse_cholesky(hessian: torch.Tensor, percdamp: float) -> torch.Tensor:
    """The upper Cholesky factor of (H + damp I)^-1, damp = percdamp * mean(diag(H))."""
    h = hessian.clone()
    damp = percdamp * torch.mean(torch.diag(h))
    h.diagonal().add_(damp)
    lower = torch.linalg.cholesky(h)
    return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True)


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, spec: QuantSpec, *,
                  act_order: bool = False, percdamp: float = 0.01,
                  static_groups: bool = False, block_size: int = 128) -> QuantizedTensor:
    """Quantize `weight` [N, K] against `hessian` [K, K] (from HessianAccumulator). Rows
    are independent given H, so the weights of linears that read one input may be stacked
    into one call."""
    with single_threaded():
        return _gptq(weight, hessian, spec, act_order, percdamp, static_groups, block_size)


def _current_group(w: torch.Tensor, wb: torch.Tensor, errors: torch.Tensor,
                   hinv: torch.Tensor, b0: int, b1: int, col: int, gl: int) -> torch.Tensor:
    """Columns [col, col + gl) as they stand when column `col` (in block [b0, b1)) is
    next: every update so far applied, including the current block's, which the columns
    past b1 receive only lazily at the block's end."""
    i, end = col - b0, min(col + gl, w.shape[1])
    if end <= b1:
        return wb[:, i : i + gl]
    pending = errors[:, :i] @ hinv[b0:col, b1:end]
    return torch.cat([wb[:, i:], w[:, b1:end] - pending], dim=1)


def _static_params(w: torch.Tensor, h_diag: torch.Tensor, spec: QuantSpec,
                   gl: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every group's scale and zero [N, G], fitted on `w` [N, K] as it is."""
    k = w.shape[1]
    scales, zeros = [], []
    for g in range(k // gl):
        cols = slice(g * gl, (g + 1) * gl)
        scale, zero = fit_params(w[:, cols], spec, h_diag[cols])
        scales.append(scale)
        zeros.append(zero)
    return torch.stack(scales, 1), torch.stack(zeros, 1)


def _gptq(weight: torch.Tensor, hessian: torch.Tensor, spec: QuantSpec, act_order: bool,
          percdamp: float, static_groups: bool, block_size: int) -> QuantizedTensor:
    n, k = weight.shape
    spec.check(k)
    gl = spec.group_len(k)
    w = weight.to(torch.float64).clone()
    h = hessian.to(torch.float64).clone()
    # Inputs that were always zero carry no information: fix them so H stays invertible.
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = torch.argsort(torch.diag(h), descending=True, stable=True) if act_order \
        else torch.arange(k)
    if static_groups:
        scales, zeros = _static_params(w, torch.diag(h), spec, gl)
        column_group = (perm // gl).tolist()  # the group of each column, in quantization order
    else:
        scales = torch.zeros(n, k // gl, dtype=torch.float32)
        zeros = torch.zeros(n, k // gl, dtype=torch.int64)
    w, h = w[:, perm], h[perm][:, perm]
    h_diag = torch.diag(h)
    hinv = _inverse_cholesky(h, percdamp)

    codes = torch.zeros(n, k, dtype=torch.uint8)
    scale = zero = None
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        wb = w[:, b0:b1].clone()
        errors = torch.zeros_like(wb)
        hb = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if static_groups:
                scale, zero = scales[:, column_group[col]], zeros[:, column_group[col]]
            elif col % gl == 0:
                group = _current_group(w, wb, errors, hinv, b0, b1, col, gl)
                scale, zero = fit_params(group, spec, h_diag[col : col + gl])
                scales[:, col // gl], zeros[:, col // gl] = scale, zero
            q = quantize_codes(wb[:, i : i + 1].to(torch.float32), scale, zero, spec.maxq)
            codes[:, col] = q[:, 0].to(torch.uint8)
            deq = ((q[:, 0] - zero) * scale).to(torch.float64)
            err = (wb[:, i] - deq) / hb[i, i]
            wb[:, i:] -= err.unsqueeze(1) * hb[i, i:].unsqueeze(0)
            errors[:, i] = err
        w[:, b1:] -= errors @ hinv[b0:b1, b1:]

    inverse = torch.argsort(perm)
    g_idx = torch.arange(k) // gl if static_groups else (torch.arange(k) // gl)[inverse]
    return QuantizedTensor(codes[:, inverse], scales, zeros, g_idx, spec)
