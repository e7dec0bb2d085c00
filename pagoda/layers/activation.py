"""Gated activations on a fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.attention.cpu_kernels import fused_ops_for


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] on the last dim -> silu(gate) * up."""
    ops = fused_ops_for(x)
    if ops is not None and x.dim() == 2 and x.is_contiguous():
        return ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
