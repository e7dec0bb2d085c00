"""int8 weights with one scale per output channel, quantized from a dense checkpoint at
load, or loaded from a compressed-tensors W8A8 checkpoint.

  --quantization int8     W8A8: int8 weights, activations quantized per token at run time
                          (wquant.int8_linear; the VNNI path on CPUs that have it)
  --quantization int8_wo  weight-only: int8 weights, activations in the model's dtype
                          (wquant.wq_linear with bits 8 and one group per channel)

Both hold the layer's weights as compressed-tensors' W8A8 checkpoints store them:
  weight        int8 [N, K]     round(w / scale), clamped to [-127, 127]
  weight_scale  float32 [N, 1]  max |w[n, :]| / 127
so `state_dict()` of a model quantized at load is that checkpoint's tensors (a dense
weight is not kept: the quantization replaces it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagoda.ops import wquant
from pagoda.quant.base import (
    QuantizationConfig,
    QuantizeMethodBase,
    register_quantization_config,
    replace_param,
    set_weight_attrs,
)

INT8_MAX = 127


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense w [N, K] -> (int8 codes [N, K], float32 scales [N, 1]), symmetric."""
    w = w.to(torch.float32)
    scales = (w.abs().amax(dim=1, keepdim=True) / INT8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    codes = torch.round(w / scales).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scales


class Int8LinearMethod(QuantizeMethodBase):
    """int8 per-channel weights; `activations` True: W8A8 through int8_linear, False:
    weight-only through wq_linear. `from_checkpoint`: the layer's tensors are loaded
    quantized (compressed-tensors), else a dense weight is loaded and quantized."""

    def __init__(self, activations: bool = True, from_checkpoint: bool = False) -> None:
        self.activations, self.from_checkpoint = activations, from_checkpoint

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
        n, k = sum(output_partition_sizes), input_size_per_partition
        dtype = torch.int8 if self.from_checkpoint else params_dtype
        weight = nn.Parameter(torch.empty(n, k, dtype=dtype), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
        layer.register_parameter("weight", weight)
        if self.from_checkpoint:
            scale = nn.Parameter(torch.empty(n, 1, dtype=torch.float32), requires_grad=False)
            set_weight_attrs(scale, {"input_dim": None, "output_dim": 0, **extra_weight_attrs})
            layer.register_parameter("weight_scale", scale)
        layer.quant_weight = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.weight.dtype != torch.int8:
            codes, scales = quantize_per_channel(layer.weight.data)
            replace_param(layer, "weight", codes)
            scale = nn.Parameter(scales, requires_grad=False)
            set_weight_attrs(scale, {"input_dim": None, "output_dim": 0,
                                     "weight_loader": layer.weight.weight_loader})
            layer.register_parameter("weight_scale", scale)
        codes, scales = layer.weight.data, layer.weight_scale.data.reshape(-1).float()
        if self.activations:
            weight: Any = wquant.Int8Weight(codes.contiguous(), scales.contiguous())
            op = "int8_linear"
        else:
            n, k = codes.shape
            # NOTE: codes + 128 are the unsigned codes GroupQuantWeight holds (zero 128).
            weight = wquant.GroupQuantWeight(
                (codes.to(torch.int16) + 128).to(torch.uint8), scales.reshape(n, 1),
                torch.full((n, 1), 128.0, device=codes.device), bits=8, group_size=k,
            )
            op = "wq_linear"
        wquant.prepare(op, weight, codes.device.type)
        layer.quant_weight = weight

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.activations:
            return wquant.int8_linear(x, layer.quant_weight, bias)
        return wquant.wq_linear(x, layer.quant_weight, bias)

    def restore_loaded_layout(self, layer: nn.Module) -> None:
        layer.quant_weight = None


class _Int8AtLoadConfig(QuantizationConfig):
    """Quantizes every linear layer but the LM head of a dense checkpoint at load."""

    activations: bool

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        raise ValueError(f"{cls.name!r} is not a checkpoint format: it quantizes a dense "
                         f"checkpoint at load (--quantization {cls.name})")

    @classmethod
    def from_dense(cls) -> QuantizationConfig:
        return cls()

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if prefix.rpartition(".")[2] == "lm_head":
            return None
        return Int8LinearMethod(activations=self.activations)


@register_quantization_config("int8")
class Int8Config(_Int8AtLoadConfig):
    activations = True


@register_quantization_config("int8_wo")
class Int8WeightOnlyConfig(_Int8AtLoadConfig):
    activations = False
