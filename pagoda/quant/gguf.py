"""GGUF linears run from their blocks (`--gguf-native on|auto`), without a dequantized copy.

A GGUF file quantizes each tensor with its own ggml type. Linear layers whose checkpoint
modules are all of one type in NATIVE_TYPES keep that tensor's blocks as their `weight`
(uint8 [N, bytes per row]: a row's blocks are independent, so shards and q/k's rotary
un-permutation move whole rows) and compute through `wquant.gguf_linear`. Everything else
(norms, the token embedding, other types, a packed layer whose parts differ in type, e.g.
Q4_K_M's Q6_K v_proj beside Q4_K q/k) is dequantized at load as before.

"auto" (the default) dequantizes today: the CPU kernels (ops/quant_cpu.py) are faster
than the dense bf16 GEMM only for a single row (single-stream decode, 0.83x the time),
2-3x slower from 16 rows on, and they quantize activations to int8, a different product
than transformers' (on the embedded SmolLM2 it flips the thin greedy margin of the README's
France question). `on` runs the native path: the kernels where built, else the reference
(which dequantizes the whole weight on every call: exactness, not speed; in float32 it
computes exactly what the dequantized path does). Revisit "auto" once a kernel wins at
every batch size.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from pagoda.config import GGUF_NATIVE_MODES
from pagoda.ops import wquant
from pagoda.quant.base import (
    QuantizationConfig,
    QuantizeMethodBase,
    register_quantization_config,
    set_weight_attrs,
)

T = GGMLQuantizationType
NATIVE_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K})


def native_enabled(mode: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a GGUF file's linears run from their blocks under `--gguf-native mode`."""
    if mode not in GGUF_NATIVE_MODES:
        raise ValueError(f"gguf_native must be one of {list(GGUF_NATIVE_MODES)}, got {mode!r}")
    # NOTE: "auto" is "off" until a kernel beats the dense path at every batch size (above).
    return mode == "on"


@register_quantization_config("gguf")
class GGUFNativeConfig(QuantizationConfig):
    """`types`: each checkpoint module's ggml type (HF module path, e.g.
    model.layers.0.self_attn.q_proj). `native_modules` collects the modules that got the
    native method, for the weight iterator."""

    def __init__(self, types: dict[str, GGMLQuantizationType]) -> None:
        self.types = types
        self.native_modules: set[str] = set()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GGUFNativeConfig:
        raise ValueError("'gguf' is not a config.json quantization_config: GGUF files run "
                         "their blocks natively through --gguf-native")

    @classmethod
    def from_checkpoint(cls, raw_tensors: Iterator[Any]) -> GGUFNativeConfig:
        """From a GGUF checkpoint's `iter_raw_tensors()`: the types of its 2-D weights."""
        return cls({raw.name.removesuffix(".weight"): raw.ggml_type for raw in raw_tensors
                    if raw.name.endswith(".weight") and len(raw.shape) == 2})

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        names = self.module_names(prefix)
        types = {self.types.get(name) for name in names}
        if len(types) != 1 or (qtype := types.pop()) not in NATIVE_TYPES:
            return None
        self.native_modules.update(names)
        return GGUFLinearMethod(qtype)

    def keeps_blocks(self, hf_name: str) -> bool:
        """Whether checkpoint tensor `hf_name` loads as its blocks (a native weight)."""
        module, _, leaf = hf_name.rpartition(".")
        return leaf == "weight" and module in self.native_modules


class GGUFLinearMethod(QuantizeMethodBase):
    """One GGUF tensor's blocks as `weight` uint8 [N, K / block * block bytes]."""

    def __init__(self, qtype: GGMLQuantizationType) -> None:
        self.qtype = qtype
        self.block_size, self.type_size = GGML_QUANT_SIZES[qtype]

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
        k, n = input_size_per_partition, sum(output_partition_sizes)
        if k % self.block_size:
            raise ValueError(f"{layer.prefix}: {self.qtype.name} blocks of {self.block_size} "
                             f"do not divide the input size {k}")
        row_bytes = k // self.block_size * self.type_size
        weight = nn.Parameter(torch.empty(n, row_bytes, dtype=torch.uint8), requires_grad=False)
        # NOTE: input_dim is in bytes; a row-parallel shard must hold whole blocks.
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
        layer.register_parameter("weight", weight)
        layer.quant_weight = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        raw = layer.weight.data
        k = raw.shape[1] // self.type_size * self.block_size
        weight = wquant.GGUFWeight(raw, int(self.qtype), (raw.shape[0], k))
        wquant.prepare("gguf_linear", weight, raw.device.type)
        layer.quant_weight = weight

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return wquant.gguf_linear(x, layer.quant_weight, bias)

    def restore_loaded_layout(self, layer: nn.Module) -> None:
        layer.quant_weight = None
