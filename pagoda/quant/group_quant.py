"""The shared shape of the group-wise integer methods (GPTQ, AWQ, compressed-tensors).

A method declares its checkpoint tensors (`ParamSpec`: shape, dtype and the dimensions a
tensor-parallel shard cuts, with the packing along them) and how they unpack into a
`wquant.GroupQuantWeight`; this base registers them, builds the weight once after loading
(again after `.to()`), lets the device's kernels prepare it, and calls `wquant.wq_linear`.

The registered parameters stay in the checkpoint's layout, so `state_dict()` and `.to()`
see exactly what was loaded; the GroupQuantWeight (codes as uint8 [N, K]) is derived from
them and held beside them as `layer.quant_weight`.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagoda.ops import wquant
from pagoda.quant.base import QuantizeMethodBase, set_weight_attrs


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
        layer.quant_weight = None

    @abstractmethod
    def param_specs(
        self, prefix: str, k: int, output_partition_sizes: list[int], groups: int
    ) -> list[ParamSpec]:
        """The layer's checkpoint tensors for K = k inputs, N = sum(sizes) outputs."""

    @abstractmethod
    def unpack(self, layer: nn.Module) -> wquant.GroupQuantWeight:
        """The loaded tensors as a GroupQuantWeight (codes [N, K], float32 scales/zeros)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = self.unpack(layer)
        wquant.prepare("wq_linear", weight, weight.qweight.device.type)
        layer.quant_weight = weight

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return wquant.wq_linear(x, layer.quant_weight, bias)

    def restore_loaded_layout(self, layer: nn.Module) -> None:
        layer.quant_weight = None


def make_group_weight(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    perm: torch.Tensor | None = None,
) -> wquant.GroupQuantWeight:
    """codes [N, K] (any integer dtype) and scales / zeros [N, G] -> the weight object, with
    float32 scales and zeros and contiguous tensors (the layout kernels expect)."""
    return wquant.GroupQuantWeight(
        qweight=codes.to(torch.uint8).contiguous(),
        scales=scales.to(torch.float32).contiguous(),
        zeros=zeros.to(torch.float32).contiguous(),
        bits=bits,
        group_size=group_size,
        perm=None if perm is None else perm.to(torch.int64),
    )
