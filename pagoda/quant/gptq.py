"""GPTQ checkpoints as AutoGPTQ / GPTQModel write them (quant_method "gptq").

config.json `quantization_config`: bits 2 | 4 | 8, group_size -1 (one group per output
channel) or a divisor of every layer's input size, desc_act (act_order: `g_idx` is then a
permutation of the groups), sym, checkpoint_format "gptq" (v1: zeros stored minus one) or
"gptq_v2" (zeros stored as they are), lm_head (a quantized head is refused).

Per linear layer (K inputs, N outputs, G = K / group_size groups, 32 / bits codes a word):
  qweight int32 [K * bits / 32, N]  packed along the input dim
  qzeros  int32 [G, N * bits / 32]  packed along the output dim
  scales  [G, N]                    (float16 in the files; held as float32)
  g_idx   int32 [K]                 each input column's group
Packed layers (qkv, gate_up) hold their shards side by side along the output dim, which
for qzeros is in units of words.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagoda.ops import wquant
from pagoda.quant import packing
from pagoda.quant.base import QuantizationConfig, register_quantization_config
from pagoda.quant.group_quant import (
    GroupQuantLinearMethod,
    ParamSpec,
    check_divides,
    make_group_weight,
    same_for_every_shard,
)

GPTQ_BITS = (2, 4, 8)
GPTQ_FORMATS = ("gptq", "gptq_v2")


def _field(config: dict[str, Any], name: str, default: Any = None) -> Any:
    return config.get(name, default) if config.get(name) is not None else default


def parse_bits(value: Any, supported: tuple[int, ...], method: str) -> int:
    """`bits` as an int among `supported`; ValueError naming the field otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value not in supported:
        raise ValueError(f"{method} quantization_config.bits must be one of {supported}, "
                         f"got {value!r}")
    return value


def parse_group_size(value: Any, method: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and value != -1):
        raise ValueError(f"{method} quantization_config.group_size must be -1 or a positive "
                         f"integer, got {value!r}")
    return value


@register_quantization_config("gptq")
class GPTQConfig(QuantizationConfig):
    def __init__(self, bits: int, group_size: int, desc_act: bool, sym: bool,
                 checkpoint_format: str) -> None:
        self.bits, self.group_size = bits, group_size
        self.desc_act, self.sym, self.checkpoint_format = desc_act, sym, checkpoint_format

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        bits = parse_bits(config.get("bits"), GPTQ_BITS, "gptq")
        group_size = parse_group_size(config.get("group_size"), "gptq")
        fmt = _field(config, "checkpoint_format", "gptq")
        if fmt not in GPTQ_FORMATS:
            raise ValueError(f"gptq quantization_config.checkpoint_format must be one of "
                             f"{GPTQ_FORMATS}, got {fmt!r}")
        if _field(config, "lm_head", False):
            raise ValueError("gptq quantization_config.lm_head: a quantized lm_head is not "
                             "supported")
        if _field(config, "dynamic", None):
            raise ValueError("gptq quantization_config.dynamic (per-module overrides) is not "
                             "supported")
        return cls(bits, group_size, bool(_field(config, "desc_act", False)),
                   bool(_field(config, "sym", True)), fmt)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> GPTQLinearMethod | None:
        if prefix.rpartition(".")[2] == "lm_head":
            return None
        return GPTQLinearMethod(self.bits, self.group_size, self.checkpoint_format)


class GPTQLinearMethod(GroupQuantLinearMethod):
    def __init__(self, bits: int, group_size: int, checkpoint_format: str = "gptq") -> None:
        super().__init__(bits, group_size)
        self.checkpoint_format = checkpoint_format
        self.pack_factor = 32 // bits

    def param_specs(
        self, prefix: str, k: int, output_partition_sizes: list[int], groups: int
    ) -> list[ParamSpec]:
        n, pf = sum(output_partition_sizes), self.pack_factor
        check_divides(prefix, "qweight's codes per word", k, pf)
        for size in output_partition_sizes:
            check_divides(prefix, "qzeros' codes per word", size, pf)
        # NOTE: one group per channel (group_size -1): scales and zeros are the same on
        # every input shard, so a row-parallel split replicates them.
        group_dim = None if groups == 1 else 0
        return [
            ParamSpec("qweight", (k // pf, n), torch.int32, 0, 1, packed_dim=0,
                      packed_factor=pf),
            ParamSpec("qzeros", (groups, n // pf), torch.int32, group_dim, 1, packed_dim=1,
                      packed_factor=pf),
            ParamSpec("scales", (groups, n), torch.float32, group_dim, 1),
            ParamSpec("g_idx", (k,), torch.int32, 0, None, wrap_loader=same_for_every_shard),
        ]

    def unpack(self, layer: nn.Module) -> wquant.GroupQuantWeight:
        codes, zeros = packing.unpack_gptq(layer.qweight.data, layer.qzeros.data, self.bits)
        if self.checkpoint_format == "gptq_v2":
            zeros = zeros - 1
        k = codes.shape[0]
        group_size = self.layer_group_size(k)
        g_idx = layer.g_idx.data.to(torch.int64)
        groups = layer.scales.shape[0]
        if g_idx.numel() and (g_idx.min() < 0 or g_idx.max() >= groups):
            raise ValueError(f"{layer.prefix}.g_idx: group indices must lie in [0, {groups})")
        try:
            perm = packing.gptq_group_order(g_idx, group_size)
        except ValueError as exc:
            raise ValueError(f"{layer.prefix}.g_idx: {exc}") from exc
        codes, scales, zeros = codes.T, layer.scales.data.T, zeros.T
        if perm is not None:
            codes = codes.index_select(1, perm)
        return make_group_weight(codes, scales, zeros, self.bits, group_size, perm)
