"""Gated activations on a fused [gate | up] projection."""

from __future__ import annotations

import torch

from pagoda import ops


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] on the last dim -> silu(gate) * up."""
    return ops.silu_and_mul(x)
