"""fp8 (e4m3) weights: vLLM's fp8 checkpoints (quant_method "fp8"), or a dense checkpoint
quantized at load (`--quantization fp8`).

Checkpoint (config.json `quantization_config`: activation_scheme "dynamic" | "static",
weight_block_size null | [bn, bk], ignored_layers / modules_to_not_convert), per layer:
  weight            float8_e4m3fn [N, K]
  weight_scale      per tensor ([] or [1]) or per output channel ([N] or [N, 1]);
                    or, with weight_block_size,
  weight_scale_inv  float32 [ceil(N / bn), ceil(K / bk)] one per block (w = q * s)
  input_scale       static activation scales: loaded and NOT used on CPU, where the
                    activations stay in the model's dtype and the weight is dequantized
                    on the fly (wquant.fp8_linear's reference).
Packed layers hold per-tensor scales as per-channel ones (each shard's rows get its own
scale), which is exact; block scales need every shard's rows to be a multiple of bn.

At load: one scale per output channel, max |w[n, :]| / 448.
"""

from __future__ import annotations

from collections.abc import Callable
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

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense w [N, K] -> (e4m3 weight [N, K], float32 scales [N])."""
    w = w.to(torch.float32)
    scales = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (w / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scales


@register_quantization_config("fp8")
class Fp8Config(QuantizationConfig):
    def __init__(self, serialized: bool, block: tuple[int, int] | None = None,
                 ignored: list[str] | None = None, static_activations: bool = False) -> None:
        self.serialized, self.block, self.ignored = serialized, block, ignored or []
        self.static_activations = static_activations

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8 quantization_config.activation_scheme must be dynamic or "
                             f"static, got {scheme!r}")
        block = config.get("weight_block_size")
        if block is not None:
            if (not isinstance(block, list) or len(block) != 2
                    or not all(isinstance(b, int) and b > 0 for b in block)):
                raise ValueError("fp8 quantization_config.weight_block_size must be [bn, bk] "
                                 f"positive integers, got {block!r}")
            block = (block[0], block[1])
        ignored = config.get("ignored_layers") or config.get("modules_to_not_convert") or []
        return cls(True, block, list(ignored), static_activations=scheme == "static")

    @classmethod
    def from_dense(cls) -> Fp8Config:
        return cls(False)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if prefix.rpartition(".")[2] == "lm_head":
            return None
        names = self.module_names(prefix)
        ignored = [any(name == i or name.startswith(i + ".") for i in self.ignored)
                   for name in names]
        if all(ignored):
            return None
        if any(ignored):
            raise ValueError(f"{prefix}: ignored_layers leave only some of {names} dense")
        return Fp8LinearMethod(self.serialized, self.block, self.static_activations)


def shard_rows(layer: nn.Module, shard_id: Any) -> int:
    """The full (unsharded) output rows of one part of a packed layer."""
    if shard_id is None:
        return layer.output_size
    if isinstance(shard_id, str):
        heads = layer.total_num_heads if shard_id == "q" else layer.total_num_kv_heads
        return heads * layer.head_size
    return layer.output_sizes[shard_id]


def _per_row_scale_loader(layer: nn.Module, layer_loader: Callable[..., None]):
    """weight_scale given per tensor or per channel -> this parameter's per-row scales."""

    def load(param: nn.Parameter, loaded: torch.Tensor, *shard: Any) -> None:
        rows = shard_rows(layer, shard[0] if shard else None)
        if loaded.numel() == 1:
            loaded = loaded.reshape(()).expand(rows)
        elif loaded.dim() == 2 and loaded.shape[1] == 1:
            loaded = loaded[:, 0]
        layer_loader(param, loaded.contiguous(), *shard)

    return load


def _scalar_max_loader(param: nn.Parameter, loaded: torch.Tensor, *shard: Any) -> None:
    """input_scale: one scalar per part; a packed layer keeps the largest."""
    if loaded.numel() != 1:
        raise ValueError(f"must be a scalar, got shape {tuple(loaded.shape)}")
    value = loaded.reshape(()).to(param.dtype)
    if getattr(param, "loaded_shards", False):
        value = torch.maximum(value, param.data)
    param.data.copy_(value)
    param.loaded_shards = True


class Fp8LinearMethod(QuantizeMethodBase):
    def __init__(self, serialized: bool, block: tuple[int, int] | None = None,
                 static_activations: bool = False) -> None:
        self.serialized, self.block = serialized, block
        self.static_activations = static_activations

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
        loader = extra_weight_attrs["weight_loader"]
        dtype = FP8_DTYPE if self.serialized else params_dtype
        layer.params_dtype = params_dtype  # the activations' dtype, for the kernels' preparers
        self._add(layer, "weight", (n, k), dtype, {"input_dim": 1, "output_dim": 0}, loader)
        layer.quant_weight = None
        if not self.serialized:
            return
        if self.block is None:
            self._add(layer, "weight_scale", (n,), torch.float32, {"output_dim": 0},
                      _per_row_scale_loader(layer, loader))
        else:
            bn, bk = self.block
            for size in output_partition_sizes:
                if size % bn:
                    raise ValueError(f"{layer.prefix}: output rows {size} are not a multiple "
                                     f"of the fp8 block {bn}")
            self._add(layer, "weight_scale_inv", (n // bn, -(-k // bk)), torch.float32,
                      {"input_dim": 1, "output_dim": 0, "packed_dim": 0, "packed_factor": bn},
                      loader)
        if self.static_activations:
            self._add(layer, "input_scale", (), torch.float32, {"output_dim": None},
                      _scalar_max_loader)

    @staticmethod
    def _add(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
             attrs: dict[str, Any], loader: Callable[..., None]) -> None:
        param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        set_weight_attrs(param, {**attrs, "weight_loader": loader})
        layer.register_parameter(name, param)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.weight.dtype != FP8_DTYPE:
            q, scales = quantize_fp8_per_channel(layer.weight.data)
            replace_param(layer, "weight", q)
            self._add(layer, "weight_scale", tuple(scales.shape), torch.float32,
                      {"output_dim": 0}, layer.weight.weight_loader)
            layer.weight_scale.data.copy_(scales)
        scale = layer.weight_scale_inv if self.block is not None else layer.weight_scale
        weight = wquant.Fp8Weight(layer.weight.data, scale.data.float(), self.block)
        wquant.prepare("fp8_linear", weight, weight.weight.device.type,
                       getattr(layer, "params_dtype", None))
        layer.quant_weight = weight

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return wquant.fp8_linear(x, layer.quant_weight, bias)

    def restore_loaded_layout(self, layer: nn.Module) -> None:
        layer.quant_weight = None
