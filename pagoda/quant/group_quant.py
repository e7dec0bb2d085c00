"""The shared shape of the group-wise integer methods (GPTQ, AWQ, compressed-tensors).

A method declares its checkpoint tensors (`ParamSpec`: shape, dtype and the dimensions a
tensor-parallel shard cuts, with the packing along them) and how they unpack into a
`wquant.GroupQuantWeight`; this base registers them, builds the weight once after loading
(again after `.to()`), lets the device's kernels prepare it, and calls `wquant.wq_linear`.

After loading, the packed codes' parameter (`codes_param`: GPTQ's qweight, ...) holds the
GroupQuantWeight's codes in the kernels' panel layout instead (half a byte a 4-bit code),
so the codes are held once (the weight is `layer.quant_weight`, whose reference reads the
same bytes); `state_dict()` and `.to()` (through `restore_loaded_layout`) see them packed
back into the checkpoint's int32 words, bit for bit. Scales, zeros and g_idx stay as
loaded (a [G, N] scales parameter is the weight's own scales, not a copy).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from pagoda.ops import wquant
from pagoda.quant.base import QuantizeMethodBase, replace_param, set_weight_attrs


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One checkpoint tensor of a layer: `input_dim` / `output_dim` are the dimensions a
    tensor-parallel shard cuts (None: replicated along it); along `packed_dim` each
    element holds `packed_factor` values (int32 words of codes, blocks of scales)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    input_dim: int | None
    output_dim: int | None
    packed_dim: int | None = None
    packed_factor: int = 1
    # Wraps the layer's loader (e.g. `same_for_every_shard`); None: the layer's own.
    wrap_loader: Callable[[Callable[..., None]], Callable[..., None]] | None = None


def register_params(
    layer: nn.Module, specs: list[ParamSpec], extra_weight_attrs: dict[str, Any]
) -> None:
    """Register an empty parameter per spec on `layer`, carrying its dims and loader."""
    for spec in specs:
        param = nn.Parameter(torch.empty(spec.shape, dtype=spec.dtype), requires_grad=False)
        attrs: dict[str, Any] = {"input_dim": spec.input_dim, "output_dim": spec.output_dim}
        if spec.packed_dim is not None:
            attrs.update(packed_dim=spec.packed_dim, packed_factor=spec.packed_factor)
        extra = dict(extra_weight_attrs)
        if spec.wrap_loader is not None:
            extra["weight_loader"] = spec.wrap_loader(extra["weight_loader"])
        set_weight_attrs(param, {**attrs, **extra})
        layer.register_parameter(spec.name, param)


def same_for_every_shard(layer_loader: Callable[..., None]) -> Callable[..., None]:
    """A loader for a tensor that every shard of a packed layer stores whole and equal
    (GPTQ's g_idx: q, k and v see the same input, so act_order orders them alike): the
    first shard is loaded, later ones must agree (ValueError otherwise)."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None:
            layer_loader(param, loaded)
            return
        if getattr(param, "loaded_shards", None) and not torch.equal(
            param.data, loaded.to(param.dtype)
        ):
            raise ValueError(f"differs from the other shards' (shard {shard_id!r}) of this "
                             "packed layer, which must share it")
        layer_loader(param, loaded, shard_id)
        param.loaded_shards = True

    return load


def check_divides(prefix: str, what: str, size: int, divisor: int) -> None:
    """ValueError naming the layer when `divisor` does not divide `size`."""
    if size % divisor:
        raise ValueError(f"{prefix}: {what} {divisor} does not divide {size}")


class GroupQuantLinearMethod(QuantizeMethodBase):
    """Group-wise integer weights: `bits` per code, one scale (and zero) per `group_size`
    input columns (-1: one group per output channel)."""

    # The parameter of the packed codes, which holds the unpacked ones after loading.
    codes_param: ClassVar[str]

    def __init__(self, bits: int, group_size: int) -> None:
        self.bits, self.group_size = bits, group_size

    def layer_group_size(self, input_size_per_partition: int) -> int:
        return input_size_per_partition if self.group_size == -1 else self.group_size

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
        prefix = getattr(layer, "prefix", "")
        k = input_size_per_partition
        group_size = self.layer_group_size(k)
        check_divides(prefix, "group_size", k, group_size)
        specs = self.param_specs(prefix, k, output_partition_sizes, k // group_size)
        register_params(layer, specs, extra_weight_attrs)
        layer.params_dtype = params_dtype  # the activations' dtype, for the kernels' preparers
        layer.quant_weight = None

    @abstractmethod
    def param_specs(
        self, prefix: str, k: int, output_partition_sizes: list[int], groups: int
    ) -> list[ParamSpec]:
        """The layer's checkpoint tensors for K = k inputs, N = sum(sizes) outputs."""

    @abstractmethod
    def unpack(self, layer: nn.Module) -> wquant.GroupQuantWeight:
        """The loaded tensors as a GroupQuantWeight (codes [N, K], float32 scales/zeros)."""

    @abstractmethod
    def pack_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """uint8 codes [N, K] in the checkpoint's column order -> `codes_param` as loaded."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.quant_weight is not None:
            return
        weight = self.unpack(layer)
        replace_param(layer, self.codes_param, weight.layout.codes)
        wquant.prepare("wq_linear", weight, weight.layout.codes.device.type,
                       getattr(layer, "params_dtype", None))
        layer.quant_weight = weight

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return wquant.wq_linear(x, layer.quant_weight, bias)

    def restore_loaded_layout(self, layer: nn.Module) -> None:
        if layer.quant_weight is not None:
            replace_param(layer, self.codes_param, self._packed(layer.quant_weight))
        layer.quant_weight = None

    def state_dict_tensor(self, layer: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name == self.codes_param and layer.quant_weight is not None:
            return self._packed(layer.quant_weight)
        return tensor

    def _packed(self, weight: wquant.GroupQuantWeight) -> torch.Tensor:
        codes = weight.qweight
        if weight.perm is not None:
            codes = torch.empty_like(codes).index_copy_(1, weight.perm, codes)
        return self.pack_codes(codes)


def make_group_weight(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    perm: torch.Tensor | None = None,
) -> wquant.GroupQuantWeight:
    """codes [N, K] (any integer dtype) and scales / zeros [N, G] -> the weight object
    (float32 / float16 scales seen as [N, G] of a [G, N] tensor are kept, not copied)."""
    if scales.dtype not in (torch.float32, torch.float16):
        scales = scales.to(torch.float32)
    return wquant.GroupQuantWeight(
        qweight=codes.to(torch.uint8),
        scales=scales,
        zeros=zeros,
        bits=bits,
        group_size=group_size,
        perm=None if perm is None else perm.to(torch.int64),
    )
