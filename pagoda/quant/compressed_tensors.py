"""compressed-tensors checkpoints as llm-compressor writes them (quant_method
"compressed-tensors").

config.json `quantization_config`: `config_groups` (schemes: `targets`, `weights`,
`input_activations`, optionally `format`), `ignore` (lm_head, usually) and `format`. A
target or ignore entry is a module name, a class name ("Linear": every linear layer) or
"re:" + a regular expression matched at the start of the module name. Supported schemes:

- pack-quantized W4A16 / W8A16 (`weights`: int, 4 or 8 bits, strategy group or channel,
  symmetric or not, actorder; no input activations), per layer (K inputs, N outputs):
    weight_packed     int32 [N, K * bits / 32]  codes + 2**(bits-1), packed along the input
    weight_scale      [N, G]
    weight_zero_point int32 [N * bits / 32, G]  (asymmetric) zeros + 2**(bits-1), packed
                                                along the OUTPUT dim
    weight_shape      int [2]                   the dense [N, K]
    weight_g_idx      int32 [K]                 (actorder "group")
- int-quantized W8A8 (weights int8 per channel, symmetric; input activations int8 per token,
  dynamic): weight int8 [N, K], weight_scale [N, 1] -> `int8.Int8LinearMethod`.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from pagoda.ops import wquant
from pagoda.quant import packing
from pagoda.quant.base import (
    QuantizationConfig,
    QuantizeMethodBase,
    register_quantization_config,
)
from pagoda.quant.group_quant import (
    GroupQuantLinearMethod,
    ParamSpec,
    check_divides,
    make_group_weight,
    same_for_every_shard,
)
from pagoda.quant.int8 import Int8LinearMethod

PACK_QUANTIZED = "pack-quantized"
INT_QUANTIZED = "int-quantized"


def target_matches(target: str, name: str) -> bool:
    """compressed-tensors' rule: "re:" regex (matched at the start), "Linear", or a name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == "Linear" or target == name


class CompressedTensorsConfig(QuantizationConfig):
    def __init__(self, schemes: list[dict[str, Any]], ignore: list[str], fmt: str) -> None:
        self.schemes, self.ignore, self.format = schemes, ignore, fmt

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        groups = config.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ValueError("compressed-tensors quantization_config.config_groups must be a "
                             "non-empty object")
        if config.get("sparsity_config"):
            raise ValueError("compressed-tensors sparsity_config (sparse weights) is not "
                             "supported")
        schemes = list(groups.values())
        for scheme in schemes:
            if not isinstance(scheme, dict) or not isinstance(scheme.get("targets"), list):
                raise ValueError(  # noqa: TRY004 (a malformed config is a ValueError here)"compressed-tensors config_groups: every scheme needs a "
                                 "'targets' list")
        return cls(schemes, list(config.get("ignore") or []), str(config.get("format")))

    def _scheme_for(self, name: str) -> dict[str, Any] | None:
        if any(target_matches(t, name) for t in self.ignore):
            return None
        return next((s for s in self.schemes
                     if any(target_matches(t, name) for t in s["targets"])), None)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        names = self.module_names(prefix)
        schemes = [self._scheme_for(name) for name in names]
        if any(s is not schemes[0] for s in schemes):
            raise ValueError(f"{prefix}: compressed-tensors schemes differ between the parts "
                             f"{names} of this packed layer")
        scheme = schemes[0]
        if scheme is None:
            return None
        return method_for_scheme(scheme, self.format, prefix)


register_quantization_config("compressed-tensors")(CompressedTensorsConfig)


def method_for_scheme(scheme: dict[str, Any], default_format: str,
                      prefix: str) -> QuantizeMethodBase:
    """The method of one scheme; ValueError naming what is not supported."""
    weights = scheme.get("weights") or {}
    activations = scheme.get("input_activations")
    fmt = str(scheme.get("format") or default_format)
    bits, kind = weights.get("num_bits"), weights.get("type", "int")
    strategy, symmetric = weights.get("strategy"), bool(weights.get("symmetric", True))
    what = f"compressed-tensors scheme of {prefix}"
    if kind != "int":
        raise ValueError(f"{what}: weights of type {kind!r} are not supported (only int)")
    if fmt == PACK_QUANTIZED and activations is None and bits in (4, 8):
        if strategy not in ("group", "channel"):
            raise ValueError(f"{what}: strategy {strategy!r} is not supported (group, channel)")
        group_size = int(weights.get("group_size") or -1) if strategy == "group" else -1
        return CTPackedLinearMethod(bits, group_size, symmetric,
                                    weights.get("actorder") == "group")
    w8a8 = (bits == 8 and strategy == "channel" and symmetric and activations is not None
            and activations.get("num_bits") == 8 and activations.get("type", "int") == "int"
            and activations.get("strategy") == "token" and activations.get("dynamic"))
    if fmt == INT_QUANTIZED and w8a8:
        return Int8LinearMethod(from_checkpoint=True)
    raise ValueError(f"{what}: format {fmt!r} with weights {weights} and input activations "
                     f"{activations} is not supported (pack-quantized W4A16/W8A16, "
                     "int-quantized W8A8 with dynamic per-token activations)")


def _check_weight_shape(_layer_loader: Any) -> Any:
    """weight_shape is the dense [N, K] of each part; it carries nothing the packed tensors'
    shapes do not (their loaders check those), so it is only checked to be a shape."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if loaded.numel() != 2:
            raise ValueError(f"must hold a 2-d shape, got {loaded.tolist()}")
        param.data.copy_(loaded.reshape(2))

    return load


class CTPackedLinearMethod(GroupQuantLinearMethod):
    """pack-quantized W4A16 / W8A16 (see the module docstring for the tensors)."""

    codes_param = "weight_packed"

    def __init__(self, bits: int, group_size: int, symmetric: bool, has_g_idx: bool) -> None:
        super().__init__(bits, group_size)
        self.symmetric, self.has_g_idx = symmetric, has_g_idx
        self.pack_factor = 32 // bits

    def param_specs(
        self, prefix: str, k: int, output_partition_sizes: list[int], groups: int
    ) -> list[ParamSpec]:
        n, pf = sum(output_partition_sizes), self.pack_factor
        check_divides(prefix, "weight_packed's codes per word", k, pf)
        group_dim = None if groups == 1 else 1
        specs = [
            ParamSpec("weight_packed", (n, k // pf), torch.int32, 1, 0, packed_dim=1,
                      packed_factor=pf),
            ParamSpec("weight_scale", (n, groups), torch.float32, group_dim, 0),
            ParamSpec("weight_shape", (2,), torch.int64, None, None,
                      wrap_loader=_check_weight_shape),
        ]
        if not self.symmetric:
            for size in output_partition_sizes:
                check_divides(prefix, "weight_zero_point's zeros per word", size, pf)
            specs.append(ParamSpec("weight_zero_point", (n // pf, groups), torch.int32,
                                   group_dim, 0, packed_dim=0, packed_factor=pf))
        if self.has_g_idx:
            specs.append(ParamSpec("weight_g_idx", (k,), torch.int32, 0, None,
                                   wrap_loader=same_for_every_shard))
        return specs

    def pack_codes(self, codes: torch.Tensor) -> torch.Tensor:
        return packing.pack_int32(codes, self.bits, dim=1)

    def unpack(self, layer: nn.Module) -> wquant.GroupQuantWeight:
        codes = packing.unpack_int32(layer.weight_packed.data, self.bits, dim=1)
        scales = layer.weight_scale.data
        if self.symmetric:
            zeros = torch.full_like(scales, 1 << (self.bits - 1))
        else:
            zeros = packing.unpack_int32(layer.weight_zero_point.data, self.bits, dim=0)
        group_size = self.layer_group_size(codes.shape[1])
        perm = None
        if self.has_g_idx:
            g_idx = layer.weight_g_idx.data.to(torch.int64)
            if getattr(layer, "input_size_per_partition", None) != getattr(layer, "input_size", None):
                g_idx = g_idx - layer.tp_rank * scales.shape[1]  # NOTE: as in gptq.py
            try:
                perm = packing.gptq_group_order(g_idx, group_size)
            except ValueError as exc:
                raise ValueError(f"{layer.prefix}.weight_g_idx: {exc}") from exc
            if perm is not None:
                codes = codes.index_select(1, perm)
        return make_group_weight(codes, scales, zeros, self.bits, group_size, perm)
