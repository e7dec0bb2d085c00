"""RMSNorm, with the residual add fused in the way the decoder layers use it."""

from __future__ import annotations

import torch
from torch import nn

from pagoda import ops


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in float32 like transformers, returned in x's dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def forward_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); may reuse x and residual's storage."""
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
