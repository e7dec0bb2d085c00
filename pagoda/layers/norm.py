"""RMSNorm, with the residual add fused in the way the decoder layers use it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.attention.cpu_kernels import fused_ops_for


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in float32 like transformers, returned in x's dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: the fused kernel accumulates in float32 for bf16 inputs, as transformers does.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def forward_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); may reuse x and residual's storage."""
        ops = fused_ops_for(x)
        if ops is not None and x.is_contiguous() and residual.is_contiguous() and x.dim() == 2:
            ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self.forward(residual), residual
