"""AWQ checkpoints in AutoAWQ's GEMM layout (quant_method "awq", version "gemm").

config.json `quantization_config`: bits (or AutoAWQ's w_bit) 4, group_size (or
q_group_size) -1 or a divisor of every input size, zero_point true | false, version "gemm"
(GEMV, GEMV-fast, Marlin, ExLlama and IPEX layouts are refused: their words are ordered
differently), modules_to_not_convert (a module whose name contains one of these strings
stays dense, the rule AutoAWQ and transformers apply).

Per linear layer (K inputs, N outputs, G groups), 4-bit codes eight to an int32 word in
the interleaved order packing.AWQ_ORDER:
  qweight int32 [K, N / 8]   packed along the output dim
  qzeros  int32 [G, N / 8]   packed along the output dim (zeros as they are; a checkpoint
                             written with zero_point false stores its fixed zero there too)
  scales  [G, N]             (float16 in the files; held as float32)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagoda.ops import wquant
from pagoda.quant import packing
from pagoda.quant.base import QuantizationConfig, register_quantization_config
from pagoda.quant.gptq import parse_bits, parse_group_size
from pagoda.quant.group_quant import (
    GroupQuantLinearMethod,
    ParamSpec,
    check_divides,
    make_group_weight,
)

AWQ_PACK_FACTOR = 8


@register_quantization_config("awq")
class AWQConfig(QuantizationConfig):
    def __init__(self, group_size: int, zero_point: bool, not_converted: list[str]) -> None:
        self.group_size, self.zero_point = group_size, zero_point
        self.modules_to_not_convert = not_converted

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        version = str(config.get("version") or "gemm").lower()
        if version != "gemm":
            raise ValueError(f"awq quantization_config.version {version!r} is not supported "
                             "(only AutoAWQ's 'gemm' layout)")
        bits = config.get("bits", config.get("w_bit"))
        parse_bits(bits, (4,), "awq")
        group_size = parse_group_size(config.get("group_size", config.get("q_group_size")),
                                      "awq")
        not_converted = config.get("modules_to_not_convert") or []
        if not isinstance(not_converted, list):
            raise TypeError("awq quantization_config.modules_to_not_convert must be a list")
        return cls(group_size, bool(config.get("zero_point", True)), not_converted)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> AWQLinearMethod | None:
        if prefix.rpartition(".")[2] == "lm_head":
            return None
        names = self.module_names(prefix)
        skipped = [any(s in name for s in self.modules_to_not_convert) for name in names]
        if all(skipped):
            return None
        if any(skipped):
            raise ValueError(f"{prefix}: modules_to_not_convert keeps only some of "
                             f"{names} dense; a packed layer needs all or none")
        return AWQLinearMethod(4, self.group_size)


class AWQLinearMethod(GroupQuantLinearMethod):
    def param_specs(
        self, prefix: str, k: int, output_partition_sizes: list[int], groups: int
    ) -> list[ParamSpec]:
        n, pf = sum(output_partition_sizes), AWQ_PACK_FACTOR
        for size in output_partition_sizes:
            check_divides(prefix, "AWQ's codes per word", size, pf)
        group_dim = None if groups == 1 else 0
        return [
            ParamSpec("qweight", (k, n // pf), torch.int32, 0, 1, packed_dim=1,
                      packed_factor=pf),
            ParamSpec("qzeros", (groups, n // pf), torch.int32, group_dim, 1, packed_dim=1,
                      packed_factor=pf),
            ParamSpec("scales", (groups, n), torch.float32, group_dim, 1),
        ]

    def unpack(self, layer: nn.Module) -> wquant.GroupQuantWeight:
        codes, zeros = packing.unpack_awq(layer.qweight.data, layer.qzeros.data)
        group_size = self.layer_group_size(codes.shape[0])
        return make_group_weight(codes.T, layer.scales.data.T, zeros.T, self.bits, group_size)
