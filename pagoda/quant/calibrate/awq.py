"""AWQ (Lin et al., 2023): activation-aware per-channel scales, then a clipping search.

A few input channels carry much larger activations than the rest, and the weights that
multiply them matter most. Scaling input channel c of a weight up by s_c (and its input down
by 1 / s_c, folded into whatever op produces that input) leaves the float function unchanged
but shrinks those weights' relative rounding error. The scales are s = mean|x|^alpha,
normalised so that max * min = 1, with alpha chosen on a grid of 20 points in [0, 1) to
minimise the error of the block the weights feed (alpha = 0 is plain round-to-nearest, so
the search never does worse than it on the calibration tokens). The grid also holds the
scales mean|x|^alpha / mean|w|^(1 - alpha), with mean|w| each input channel's weight
magnitude relative to its group's largest (channels whose weights are already large need
less scaling up); the search keeps whichever of the two families scores better. Then each
group's clipping range is shrunk, as far as halfway, where that lowers the group's output
error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pagoda.quant.calibrate.rtn import QuantSpec, fake_quantize

NUM_ALPHAS = 20
NUM_CLIP_STEPS = 20
MAX_SHRINK = 0.5
CLIP_TOKENS = 512  # calibration tokens the clipping search looks at (it is per group)

BlockFn = Callable[[torch.Tensor, Sequence[torch.Tensor]], torch.Tensor]


def candidate_scales(x_mean: torch.Tensor, alpha: float,
                     w_mean: torch.Tensor | None = None) -> torch.Tensor:
    """mean|x|^alpha (over mean|w|^(1 - alpha) where `w_mean` is given) per input channel,
    normalised so that max * min = 1."""
    s = x_mean.to(torch.float32).pow(alpha)
    if w_mean is not None:
        s = s / w_mean.pow(1 - alpha).clamp(min=1e-4)
    s = s.clamp(min=1e-4)
    return s / torch.sqrt(s.max() * s.min())


def weight_magnitude(weights: Sequence[torch.Tensor], spec: QuantSpec) -> torch.Tensor:
    """Per input channel, the mean over every output row of |w| / (max |w| of its group)."""
    w = torch.cat([wi.to(torch.float32) for wi in weights]).abs()
    n, k = w.shape
    gl = spec.group_len(k)
    groups = w.reshape(n, k // gl, gl)
    relative = groups / (groups.amax(dim=-1, keepdim=True) + 1e-6)
    return relative.reshape(n, k).mean(dim=0)


def _candidates(x_mean: torch.Tensor, weights: Sequence[torch.Tensor],
                spec: QuantSpec) -> list[tuple[float, torch.Tensor]]:
    w_mean = weight_magnitude(weights, spec)
    return [(i / NUM_ALPHAS, candidate_scales(x_mean, i / NUM_ALPHAS, wm))
            for wm in (None, w_mean) for i in range(NUM_ALPHAS)]


def search_scales(x: torch.Tensor, x_mean: torch.Tensor, weights: Sequence[torch.Tensor],
                  block_fn: BlockFn, spec: QuantSpec) -> tuple[torch.Tensor, float]:
    """The per-input-channel scales [K] (and their alpha) that minimise the mean squared
    error of block_fn(x, weights quantized after scaling) against the float block, for the
    weights [N_i, K] that all read the same input x [T, K]."""
    with torch.no_grad():
        reference = block_fn(x, weights)
        best = (float("inf"), torch.ones_like(x_mean, dtype=torch.float32), 0.0)
        for alpha, s in _candidates(x_mean, weights, spec):
            trial = [fake_quantize(w * s, spec) / s for w in weights]
            loss = (block_fn(x, trial) - reference).pow(2).mean().item()
            if loss < best[0]:
                best = (loss, s, alpha)
    return best[1], best[2]


def search_scales_linear(x: torch.Tensor, x_mean: torch.Tensor,
                         weights: Sequence[torch.Tensor],
                         spec: QuantSpec) -> tuple[torch.Tensor, float]:
    """`search_scales` for the block that is the weights' outputs side by side: the squared
    output error of a weight error D over the tokens x is trace(D X^T X D^T), so with the
    Gram matrix X^T X taken once (float64) each alpha costs N K^2 instead of T N K."""
    with torch.no_grad():
        xd = x.to(torch.float64)
        gram = xd.T @ xd
        w = torch.cat([wi.to(torch.float32) for wi in weights])
        scale = 1.0 / (x.shape[0] * w.shape[0])
        best = (float("inf"), torch.ones_like(x_mean, dtype=torch.float32), 0.0)
        for alpha, s in _candidates(x_mean, weights, spec):
            d = (fake_quantize(w * s, spec) / s - w).to(torch.float64)
            loss = ((d @ gram) * d).sum().item() * scale
            if loss < best[0]:
                best = (loss, s, alpha)
    return best[1], best[2]


def search_clip(x: torch.Tensor, weight: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Per (output row, group) clipping bound [N, G]: max|w| of the group shrunk by the
    factor in (MAX_SHRINK, 1] that minimises the group's output error on x [T, K]."""
    n, k = weight.shape
    gl = spec.group_len(k)
    x = x[:: max(1, x.shape[0] // CLIP_TOKENS)][:CLIP_TOKENS].to(torch.float32)
    xg = x.reshape(x.shape[0], k // gl, gl)  # [T, G, gl]
    wg = weight.to(torch.float32).reshape(n, k // gl, gl)  # [N, G, gl]
    reference = torch.einsum("tgk,ngk->ngt", xg, wg)
    original_max = wg.abs().amax(dim=-1)  # [N, G]
    best_max = original_max.clone()
    best_err = torch.full_like(original_max, float("inf"))
    with torch.no_grad():
        for i in range(int(NUM_CLIP_STEPS * MAX_SHRINK)):
            bound = original_max * (1 - i / NUM_CLIP_STEPS)
            clipped = torch.maximum(torch.minimum(wg, bound.unsqueeze(-1)), -bound.unsqueeze(-1))
            q = fake_quantize(clipped.reshape(n, k), spec).reshape(n, k // gl, gl)
            err = (torch.einsum("tgk,ngk->ngt", xg, q) - reference).pow(2).mean(dim=-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max = torch.where(better, bound, best_max)
    return best_max


def apply_clip(weight: torch.Tensor, bound: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """weight [N, K] clamped to +-bound [N, G] group by group."""
    gl = spec.group_len(weight.shape[1])
    b = bound.repeat_interleave(gl, dim=1)
    return torch.maximum(torch.minimum(weight, b), -b)


def fold_into_norm(norm_weight: torch.Tensor, weights: Sequence[torch.Tensor],
                   s: torch.Tensor) -> None:
    """In place: the norm's output scaled by 1 / s, the weights reading it by s (per input
    channel). The float function is unchanged."""
    norm_weight.div_(s.to(norm_weight.dtype))
    for w in weights:
        w.mul_(s.to(w.dtype))


def fold_into_linear(prev_weight: torch.Tensor, prev_bias: torch.Tensor | None,
                     weight: torch.Tensor, s: torch.Tensor) -> None:
    """In place: the previous linear's output rows scaled by 1 / s, the next linear's input
    columns by s (the next one reads the previous one's output channel for channel)."""
    prev_weight.div_(s.to(prev_weight.dtype).unsqueeze(1))
    if prev_bias is not None:
        prev_bias.div_(s.to(prev_bias.dtype))
    weight.mul_(s.to(weight.dtype))
