"""Linear layers whose weights are repacked once for the CPU's matmul library.

On CPU, `F.linear` in bfloat16/float16 hands oneDNN a plain row-major weight and oneDNN
reorders it into its blocked layout on every call: a full extra pass over the weight, which
at decode batch sizes costs as much as the product itself (1.2x slower at 32 rows, 2x at one
row on this machine's EPYC). Repacking once after loading removes that pass; the results are
bit-identical to `F.linear` (checked in tests/unit/test_linear.py).

float32 stays on `F.linear`: oneDNN's float32 kernels sum in another order than MKL's, and
float32 is the dtype in which pagoda must match transformers token for token.
`PAGODA_DISABLE_PACKED_LINEAR=1` turns the repacking off.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

_PACKED_DTYPES = (torch.bfloat16, torch.float16)


def packing_enabled() -> bool:
    return os.environ.get("PAGODA_DISABLE_PACKED_LINEAR", "0") in ("", "0")


def can_pack(weight: torch.Tensor) -> bool:
    return (
        packing_enabled()
        and weight.device.type == "cpu"
        and weight.dtype in _PACKED_DTYPES
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    # NOTE: the second argument is only a batch-size hint; the layout it picks serves
    # every batch size equally well here (measured 1..2048 rows).
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """`nn.Linear` that, after loading, may swap its weight for a packed copy.

    Once packed, `weight` becomes a meta tensor of the same shape and dtype (so parameter
    counts and dtype queries still work) and the dense storage is freed.
    """

    packed_weight: torch.Tensor | None = None

    def process_weights_after_loading(self) -> None:
        if self.packed_weight is not None or not can_pack(self.weight):
            return
        try:
            self.packed_weight = pack_weight(self.weight)
        except RuntimeError:  # e.g. float16 on a CPU without AVX512_FP16 / AVX_NE_CONVERT
            return
        self.weight = nn.Parameter(self.weight.detach().to("meta"), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, self.bias)
        return F.linear(x, self.weight, self.bias)
