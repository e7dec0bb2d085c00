"""Tensor-parallel linear layers (vLLM's contract), quantization-agnostic.

Each layer computes its shard from `tp_rank` / `tp_size` (0 / 1 until pagoda has a
tensor-parallel group) and hands its parameters to a `quant_method` (pagoda/quant/):
the default `UnquantizedLinearMethod`, or the one a `QuantizationConfig` picks by the
layer's dotted `prefix`. Every parameter carries the layer's `weight_loader`, which takes
the full checkpoint tensor and copies in this rank's shard; the packed layers
(`QKVParallelLinear`, `MergedColumnParallelLinear`) also take a `shard_id` naming which
of their packed outputs the tensor is. A loader raises ValueError on a wrong shape.

A quantized parameter may store several values per element along a dimension (GPTQ's
qzeros: eight 4-bit zeros per int32 along the output; fp8 block scales: one per block of
rows). It says so with `packed_dim` and `packed_factor`; the packed layers' loaders then
place shards in those units (each shard's size must be a multiple of the factor).

- ColumnParallelLinear: the output dimension is split; each rank returns its slice.
- RowParallelLinear: the input dimension is split; the ranks' partial sums are added.
- ReplicatedLinear: not split.

NOTE: at tp_size > 1 the shard arithmetic and loaders work, but the communication a
forward needs (RowParallelLinear's all-reduce) does not exist yet and raises.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.quant.base import QuantizableLayer, QuantizationConfig, set_weight_attrs
from pagoda.quant.unquantized import UnquantizedLinearMethod


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tp_size {denominator}")
    return numerator // denominator


def check_shape(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")


def load_whole(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy an unsharded tensor (converting dtype); ValueError on a shape mismatch."""
    check_shape(param, loaded)
    param.data.copy_(loaded)


def load_shard(
    param: torch.Tensor, loaded: torch.Tensor, dim: int | None, start: int, size: int,
    full: int, offset: int = 0,
) -> None:
    """Copy rows [start, start + size) of `loaded` along `dim` (whose full extent must be
    `full`) into [offset, offset + size) of `param` along `dim`; `dim` None: whole copy."""
    if dim is None:
        load_whole(param, loaded)
        return
    expected = list(param.shape)
    expected[dim] = full
    if list(loaded.shape) != expected:
        raise ValueError(f"has shape {tuple(loaded.shape)}, expected {tuple(expected)}")
    param.data.narrow(dim, offset, size).copy_(loaded.narrow(dim, start, size))


def packed_units(param: torch.Tensor, dim: int, *sizes: int) -> tuple[int, ...]:
    """`sizes` along `dim` in the parameter's storage units: divided by its `packed_factor`
    when `dim` is its `packed_dim`; ValueError when a size is not a multiple of it."""
    factor = getattr(param, "packed_factor", 1)
    if getattr(param, "packed_dim", None) != dim or factor == 1:
        return sizes
    if any(size % factor for size in sizes):
        raise ValueError(f"shard sizes {sizes} are not multiples of the packing {factor}")
    return tuple(size // factor for size in sizes)


class LinearBase(QuantizableLayer):
    """y = x W^T + b through `quant_method`; `input_size` / `output_size` are unsharded."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        bias: bool,
        bias_is_sharded: bool,
        quant_config: QuantizationConfig | None,
        prefix: str,
        params_dtype: torch.dtype | None,
        tp_rank: int,
        tp_size: int,
    ) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = output_partition_sizes
        self.output_size_per_partition = sum(output_partition_sizes)
        self.prefix, self.tp_rank, self.tp_size = prefix, tp_rank, tp_size
        dtype = params_dtype or torch.get_default_dtype()
        method = quant_config.get_quant_method(self, prefix) if quant_config else None
        self.quant_method = method or UnquantizedLinearMethod()
        self.quant_method.create_weights(
            self, input_size_per_partition, output_partition_sizes, input_size, output_size,
            dtype, weight_loader=self.weight_loader,
        )
        if bias:
            rows = self.output_size_per_partition if bias_is_sharded else output_size
            self.bias = nn.Parameter(torch.empty(rows, dtype=dtype), requires_grad=False)
            dim = 0 if bias_is_sharded else None
            set_weight_attrs(self.bias, {"output_dim": dim, "weight_loader": self.weight_loader})
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's shard of the full checkpoint tensor into `param`."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bound = self.bound_apply
        if bound is not None:
            return bound(x)
        return self.quant_method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size_per_partition}, out={self.output_size_per_partition}, "
            f"bias={self.bias is not None}, tp={self.tp_rank}/{self.tp_size}, "
            f"quant_method={type(self.quant_method).__name__}"
        )


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = True, *,
        quant_config: QuantizationConfig | None = None, prefix: str = "",
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            input_size, output_size, input_size_per_partition=input_size,
            output_partition_sizes=[output_size], bias=bias, bias_is_sharded=False,
            quant_config=quant_config, prefix=prefix, params_dtype=params_dtype,
            tp_rank=0, tp_size=1,
        )

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        load_whole(param, loaded_weight)


class ColumnParallelLinear(LinearBase):
    """The output dimension is split: rank r holds output rows [r * n, (r + 1) * n)."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = True, *,
        output_sizes: list[int] | None = None,
        quant_config: QuantizationConfig | None = None, prefix: str = "",
        params_dtype: torch.dtype | None = None, tp_rank: int = 0, tp_size: int = 1,
    ) -> None:
        sizes = output_sizes or [output_size]
        super().__init__(
            input_size, output_size, input_size_per_partition=input_size,
            output_partition_sizes=[divide(s, tp_size) for s in sizes], bias=bias,
            bias_is_sharded=True, quant_config=quant_config, prefix=prefix,
            params_dtype=params_dtype, tp_rank=tp_rank, tp_size=tp_size,
        )

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        dim = getattr(param, "output_dim", None)
        size = param.shape[dim] if dim is not None else 0
        load_shard(param, loaded_weight, dim, self.tp_rank * size, size, size * self.tp_size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs packed along the output dimension (gate_up_proj).

    The loader's `shard_id` is the output's index (0 = gate, 1 = up); None loads a
    checkpoint tensor that is already packed.
    """

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool = True, *,
        quant_config: QuantizationConfig | None = None, prefix: str = "",
        params_dtype: torch.dtype | None = None, tp_rank: int = 0, tp_size: int = 1,
    ) -> None:
        self.output_sizes = list(output_sizes)
        self.shard_ids: tuple[int, ...] = tuple(range(len(output_sizes)))
        super().__init__(
            input_size, sum(output_sizes), bias, output_sizes=self.output_sizes,
            quant_config=quant_config, prefix=prefix, params_dtype=params_dtype,
            tp_rank=tp_rank, tp_size=tp_size,
        )

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | None = None
    ) -> None:
        dim = getattr(param, "output_dim", None)
        if dim is None:
            load_whole(param, loaded_weight)
            return
        if shard_id is None:
            sizes = list(packed_units(param, dim, *self.output_sizes))
            for index, part in enumerate(loaded_weight.split(sizes, dim)):
                self.weight_loader(param, part, index)
            return
        if shard_id not in self.shard_ids:
            raise ValueError(f"shard id {shard_id!r} is not one of {self.shard_ids}")
        size, offset, full = packed_units(
            param, dim, self.output_partition_sizes[shard_id],
            sum(self.output_partition_sizes[:shard_id]), self.output_sizes[shard_id],
        )
        load_shard(param, loaded_weight, dim, self.tp_rank * size, size, full, offset)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections packed along the output dimension, split by heads.

    With fewer kv heads than ranks each kv head is replicated on tp_size / num_kv_heads
    ranks. The loader's `shard_id` is "q", "k" or "v"; None loads a packed qkv tensor.
    """

    shard_ids = ("q", "k", "v")

    def __init__(
        self, hidden_size: int, head_size: int, total_num_heads: int,
        total_num_kv_heads: int, bias: bool = True, *,
        quant_config: QuantizationConfig | None = None, prefix: str = "",
        params_dtype: torch.dtype | None = None, tp_rank: int = 0, tp_size: int = 1,
    ) -> None:
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        q_size, kv_size = self.num_heads * head_size, self.num_kv_heads * head_size
        # NOTE: per-rank sizes times tp_size, so that ColumnParallelLinear's division
        # gives back exactly this rank's q / k / v sizes (kv replicas included).
        super().__init__(
            hidden_size, (total_num_heads + 2 * total_num_kv_heads) * head_size, bias,
            output_sizes=[q_size * tp_size, kv_size * tp_size, kv_size * tp_size],
            quant_config=quant_config, prefix=prefix, params_dtype=params_dtype,
            tp_rank=tp_rank, tp_size=tp_size,
        )

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | None = None
    ) -> None:
        dim = getattr(param, "output_dim", None)
        if dim is None:
            load_whole(param, loaded_weight)
            return
        full_q = self.total_num_heads * self.head_size
        full_kv = self.total_num_kv_heads * self.head_size
        if shard_id is None:
            parts = loaded_weight.split(list(packed_units(param, dim, full_q, full_kv, full_kv)),
                                        dim)
            for sid, part in zip(self.shard_ids, parts):
                self.weight_loader(param, part, sid)
            return
        if shard_id not in self.shard_ids:
            raise ValueError(f"shard id {shard_id!r} is not one of {self.shard_ids}")
        q_size, kv_size = self.output_partition_sizes[0], self.output_partition_sizes[1]
        if shard_id == "q":
            offset, size, full, rank = 0, q_size, full_q, self.tp_rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, full, rank = kv_size, full_kv, self.tp_rank // self.num_kv_head_replicas
        size, full, offset = packed_units(param, dim, size, full, offset)
        load_shard(param, loaded_weight, dim, rank * size, size, full, offset)


class RowParallelLinear(LinearBase):
    """The input dimension is split: rank r holds input columns [r * n, (r + 1) * n) and
    takes that slice of x; the bias is whole and added once, after the partial sums."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = True, *,
        quant_config: QuantizationConfig | None = None, prefix: str = "",
        params_dtype: torch.dtype | None = None, tp_rank: int = 0, tp_size: int = 1,
    ) -> None:
        super().__init__(
            input_size, output_size, input_size_per_partition=divide(input_size, tp_size),
            output_partition_sizes=[output_size], bias=bias, bias_is_sharded=False,
            quant_config=quant_config, prefix=prefix, params_dtype=params_dtype,
            tp_rank=tp_rank, tp_size=tp_size,
        )

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        dim = getattr(param, "input_dim", None)
        size = param.shape[dim] if dim is not None else 0
        load_shard(param, loaded_weight, dim, self.tp_rank * size, size, size * self.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            raise NotImplementedError(
                f"{self.prefix}: tp_size {self.tp_size} needs an all-reduce over the "
                "tensor-parallel group, which pagoda does not have yet"
            )
        bound = self.bound_apply
        if bound is not None:
            return bound(x)
        return self.quant_method.apply(self, x, self.bias)
