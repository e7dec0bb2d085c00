"""Dense weights: `F.linear`, or on CPU in bf16/fp16 a weight repacked once for oneDNN.

On CPU, `F.linear` in bfloat16/float16 hands oneDNN a plain row-major weight and oneDNN
reorders it into its blocked layout on every call: a full extra pass over the weight, which
at decode batch sizes costs as much as the product itself (1.2x slower at 32 rows, 2x at one
row on this machine's EPYC). Repacking once after loading removes that pass; the results are
bit-identical to `F.linear` (checked in tests/unit/test_linear.py), except where this CPU's
start-up probe sends wide bf16 products to float32 (ops/gemm_dispatch.py).

The packed tensor replaces the dense one as the registered `weight` (an opaque mkldnn
tensor: no second copy is kept). `state_dict()` shows it densified (`to_dense()` is exact),
and `.to()` densifies it before converting, then repacks where the new dtype/device packs.

float32 stays on `F.linear`: oneDNN's float32 kernels sum in another order than MKL's, and
float32 is the dtype in which pagoda must match transformers token for token.
`PAGODA_DISABLE_PACKED_LINEAR=1` turns the repacking off.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.ops import gemm_dispatch
from pagoda.quant.base import QuantizeMethodBase, set_weight_attrs

_PACKED_DTYPES = (torch.bfloat16, torch.float16)


def packing_enabled() -> bool:
    return os.environ.get("PAGODA_DISABLE_PACKED_LINEAR", "0") in ("", "0")


def can_pack(weight: torch.Tensor) -> bool:
    return (
        packing_enabled()
        and weight.device.type == "cpu"
        and weight.layout == torch.strided
        and weight.dtype in _PACKED_DTYPES
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [out, in] in oneDNN's blocked layout (an opaque mkldnn tensor), or None
    where oneDNN cannot pack it (float16 on a CPU without AVX512_FP16 / AVX_NE_CONVERT)."""
    try:
        # NOTE: the second argument is only a batch-size hint; the layout it picks serves
        # every batch size equally well here (measured 1..2048 rows).
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
    except RuntimeError:
        return None


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    # NOTE: wide bf16 products may run in float32 where this CPU's probe chose it
    # (ops/gemm_dispatch.py); the threshold is sys.maxsize until an engine configures it.
    if x.shape[0] >= gemm_dispatch.active_min_rows and x.dtype == torch.bfloat16 \
            and x.dim() == 2:
        return gemm_dispatch.widened_linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def is_packed(weight: torch.Tensor) -> bool:
    return weight.is_mkldnn


class UnquantizedLinearMethod(QuantizeMethodBase):
    """One dense `weight` [out, in]; packed in place for oneDNN after loading."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        weight = nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight
        if not can_pack(weight) or (packed := pack_weight(weight)) is None:
            return
        param = nn.Parameter(packed, requires_grad=False)
        set_weight_attrs(param, vars(weight))
        layer.weight = param

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if is_packed(layer.weight):
            return packed_linear(x, layer.weight, bias)
        return F.linear(x, layer.weight, bias)

    def bind(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        weight, bias = layer.weight, getattr(layer, "bias", None)
        if is_packed(weight):
            return functools.partial(packed_linear, packed=weight, bias=bias)
        return functools.partial(F.linear, weight=weight, bias=bias)

    def restore_loaded_layout(self, layer: nn.Module) -> None:
        weight = layer.weight
        if is_packed(weight):
            param = nn.Parameter(weight.to_dense(), requires_grad=False)
            set_weight_attrs(param, vars(weight))
            layer.weight = param

    def state_dict_tensor(self, layer: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_dense() if is_packed(tensor) else tensor


class UnquantizedEmbeddingMethod(UnquantizedLinearMethod):
    """A dense table [vocab, hidden] for lookups; `apply` is the LM head's product.

    The table stays dense (lookups need it); a layer that also computes logits (a tied LM
    head, `layer.computes_logits`) gets a packed copy beside it for `apply`, not registered
    as a parameter, so it is neither in `state_dict()` nor converted by `.to()`.
    """

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        wanted = getattr(layer, "computes_logits", False) and layer.packed_logits_weight is None
        if wanted and can_pack(layer.weight):
            layer.packed_logits_weight = pack_weight(layer.weight)

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, layer.weight)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if layer.packed_logits_weight is not None:
            return packed_linear(x, layer.packed_logits_weight, bias)
        return F.linear(x, layer.weight, bias)

    def restore_loaded_layout(self, layer: nn.Module) -> None:
        layer.packed_logits_weight = None

    def state_dict_tensor(self, layer: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor
