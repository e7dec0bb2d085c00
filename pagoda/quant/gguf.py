"""GGUF linears run from their blocks (`--gguf-native on|auto`), without a dequantized copy.

A GGUF file quantizes each tensor with its own ggml type. Linear layers whose checkpoint
modules are all of one type in NATIVE_TYPES load that tensor's blocks as their `weight`
(uint8 [N, bytes per row]: a row's blocks are independent, so shards and q/k's rotary
un-permutation move whole rows) and compute through `wquant.gguf_linear` (after loading,
Q4_0 / Q4_1 / Q8_0 hold only the kernels' layout, GGUFLinearMethod). Everything else
(norms, the token embedding, other types, a packed layer whose parts differ in type, e.g.
Q4_K_M's Q6_K v_proj beside Q4_K q/k) is dequantized at load as before.

"auto" (the default) runs natively exactly where a kernel of gguf_linear takes the model's
activations (ops/quant_cpu.py: bfloat16 on a CPU with AVX-512 BW or AVX2 and a built
extension; dtype auto is bfloat16 there for such a file: `prefers_bf16`),
and dequantizes elsewhere: there the kernel takes 0.3-1.04x of the dense bf16 GEMM's time
at every row count measured, 1 to 1,024 (docs/quantization.md), holds a third of bf16's
bytes, and decodes and serves offline faster than the dequantized model (same run).
The kernels quantize activations to int8 per block, another product than transformers':
float32 (the dtype exact against transformers) never runs them, so auto keeps float32
dequantized. `on` runs the native path anywhere: the kernels where they take the call,
else the reference (which dequantizes the whole weight on every call: exactness, not
speed; in float32 it computes exactly what the dequantized path does).

On a CPU whose bf16 products run on AMX, the native linears (and a native tied head) also
keep their weight once dequantized to bf16, in q_linear_amx's own tile layout
(`quant_cpu.dense_panels`), where the copies are small (`PAGODA_GGUF_DENSE_COPY` = auto /
on / off; auto: at most DENSE_COPY_MAX_BYTES of copies in all). bf16 products from q_linear_amx's first row count
up to DENSE_COPY_MAX_ROWS read it (`quant_cpu.panels_linear`) instead of dequantizing every
panel on every call: the same kernel and the same bits, without the vector work that took
about half of a 48-row product. All of SmolLM2's layer products, weights streaming as in a
step: 0.86-0.91 of q_linear's time at 40-64 rows, 0.70-0.79 at 128-768 and ahead of
oneDNN's GEMM on a packed bf16 copy at every row count from 40 to 1,408 (which a
partition of its own leaves one core idle for much of at 257-383 and 513-600 rows:
docs/quantization.md). From 2,048 rows the tiles path (a plain dequantized weight through
oneDNN) is ahead, so those read the codes. Where no copy can be read (no AMX tiles) none
is kept, whatever the setting.

A tied LM head (no output tensor: the token table computes the logits, SmolLM2's Q8_0)
also runs from its blocks when native, but only where a kernel takes the model's dtype
(its reference would dequantize the whole vocabulary every step): `GGUFEmbeddingMethod`,
whose lookups dequantize just the looked-up rows (the same values the dense table holds).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from pagoda.config import GGUF_NATIVE_MODES
from pagoda.ops import quant_cpu, quant_layouts, wquant
from pagoda.quant.base import (
    QuantizationConfig,
    QuantizeMethodBase,
    register_quantization_config,
    replace_param,
    set_weight_attrs,
)

T = GGMLQuantizationType
NATIVE_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K})
# Dense copies (module docstring): auto keeps them up to this many bytes in all
# (SmolLM2-135M's: 269 MB, its head's 57 among them; with the blocks about what its dense
# bf16 model holds), and bf16 products from q_linear_amx's first row count up to
# DENSE_COPY_MAX_ROWS read them.
DENSE_COPY_MAX_BYTES = 1 << 30
DENSE_COPY_MAX_ROWS = 2048
DENSE_COPY_MODES = ("auto", "on", "off")


def dense_copy_mode() -> str:
    """`PAGODA_GGUF_DENSE_COPY`: auto (the default), on or off."""
    value = os.environ.get("PAGODA_GGUF_DENSE_COPY", "auto").strip().lower() or "auto"
    if value not in DENSE_COPY_MODES:
        raise ValueError(f"PAGODA_GGUF_DENSE_COPY={value!r}: expected one of "
                         f"{list(DENSE_COPY_MODES)}")
    return value


def dense_copy_enabled(mode: str, dtype: torch.dtype, device: torch.device,
                       copy_bytes: int) -> bool:
    """Whether native linears keep dense bf16 copies: only for bf16 on a CPU whose bf16
    products run q_linear_amx (the kernel that reads them; elsewhere the panel kernel is
    ahead of oneDNN's dense GEMM at every row count, docs/quantization.md); on: wherever
    that holds; auto: where the copies also take at most DENSE_COPY_MAX_BYTES."""
    if (mode == "off" or dtype != torch.bfloat16 or device.type != "cpu"
            or quant_cpu.resolve() is None or quant_cpu.amx_min_rows() is None):
        return False
    return mode == "on" or copy_bytes <= DENSE_COPY_MAX_BYTES


def native_enabled(mode: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a GGUF file's linears run from their blocks under `--gguf-native mode`."""
    if mode not in GGUF_NATIVE_MODES:
        raise ValueError(f"gguf_native must be one of {list(GGUF_NATIVE_MODES)}, got {mode!r}")
    if mode != "auto":
        return mode == "on"
    probe = torch.empty(0, dtype=dtype, device=device)
    return wquant.gguf_linear.kernel_for(probe) is not None


def prefers_bf16(ckpt: Any, quantization: str | None, mode: str, device: torch.device) -> bool:
    """Whether dtype "auto" takes bfloat16 on a CPU without bf16 arithmetic (AVX2, or
    AVX-512 without AVX512_BF16), where it is float32 otherwise: a GGUF file all of whose
    linears run from their blocks there, with bf16 activations. No dense bf16 GEMM is then
    left to emulate (oneDNN has no bf16 kernel on such a CPU: a dense one runs ~5x slower
    than float32), and the blocks read a quarter of float32's bytes (measured faster,
    docs/architecture.md). An explicit float32 keeps the exact dequantized path."""
    from pagoda.config import cpu_has_bf16

    if (device.type != "cpu" or getattr(ckpt, "format", None) != "gguf" or cpu_has_bf16()
            or quantization not in (None, "gguf") or mode == "off"):
        return False
    if not native_enabled(mode, device, torch.bfloat16):
        return False
    from pagoda.models.registry import resolve_model

    config = GGUFNativeConfig.from_checkpoint(ckpt.iter_raw_tensors())
    factory = resolve_model(ckpt.hf_config, str(ckpt.path))
    config.packed_modules_mapping = dict(getattr(factory, "packed_modules_mapping", {}))
    return config.all_linears_native()


@register_quantization_config("gguf")
class GGUFNativeConfig(QuantizationConfig):
    """`types`: each checkpoint module's ggml type (HF module path, e.g.
    model.layers.0.self_attn.q_proj). `native_modules` collects the modules that got the
    native method, for the weight iterator."""

    def __init__(self, types: dict[str, GGMLQuantizationType],
                 shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        self.types = types
        self.shapes = shapes or {}
        self.native_modules: set[str] = set()
        # Whether the native linears keep dense copies: `decide_dense_copy`, once the
        # model's layers exist and before they load.
        self.dense_copy = False

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GGUFNativeConfig:
        raise ValueError("'gguf' is not a config.json quantization_config: GGUF files run "
                         "their blocks natively through --gguf-native")

    @classmethod
    def from_checkpoint(cls, raw_tensors: Iterator[Any]) -> GGUFNativeConfig:
        """From a GGUF checkpoint's `iter_raw_tensors()`: the types of its 2-D weights."""
        weights = [raw for raw in raw_tensors
                   if raw.name.endswith(".weight") and len(raw.shape) == 2]
        return cls({raw.name.removesuffix(".weight"): raw.ggml_type for raw in weights},
                   {raw.name.removesuffix(".weight"): tuple(raw.shape) for raw in weights})

    def dense_copy_bytes(self) -> int:
        """The bytes the native modules' bf16 copies would take (a tied head's included)."""
        return sum(2 * self.shapes[m][0] * self.shapes[m][1]
                   for m in self.native_modules if m in self.shapes)

    def decide_dense_copy(self, dtype: torch.dtype, device: torch.device) -> bool:
        """`dense_copy` under `PAGODA_GGUF_DENSE_COPY` (`dense_copy_enabled`)."""
        self.dense_copy = dense_copy_enabled(dense_copy_mode(), dtype, device,
                                             self.dense_copy_bytes())
        return self.dense_copy

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        names = self.module_names(prefix)
        types = {self.types.get(name) for name in names}
        if len(types) != 1 or (qtype := types.pop()) not in NATIVE_TYPES:
            return None
        self.native_modules.update(names)
        return GGUFLinearMethod(qtype, self)

    def get_embedding_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        qtype = self.types.get(prefix)
        if "lm_head" in self.types or qtype not in NATIVE_TYPES:
            return None  # NOTE: an untied table only serves lookups: dense is the fast one
        # NOTE: the layers are built under the model's default dtype and device.
        if wquant.gguf_linear.kernel_for(torch.empty(0)) is None:
            return None
        self.native_modules.add(prefix)
        return GGUFEmbeddingMethod(qtype, self)

    def all_linears_native(self) -> bool:
        """Whether every 2-D weight would run from its blocks: each of a native type, and the
        parts of each packed layer (`packed_modules_mapping`, as `get_quant_method` groups
        them) of one type."""
        part_of = {part: fused for fused, parts in
                   getattr(self, "packed_modules_mapping", {}).items() for part in parts}
        layers: dict[tuple[str, str], set[GGMLQuantizationType]] = {}
        for module, qtype in self.types.items():
            if qtype not in NATIVE_TYPES:
                return False
            parent, _, leaf = module.rpartition(".")
            layers.setdefault((parent, part_of.get(leaf, leaf)), set()).add(qtype)
        return bool(self.types) and all(len(t) == 1 for t in layers.values())

    def keeps_blocks(self, hf_name: str) -> bool:
        """Whether checkpoint tensor `hf_name` loads as its blocks (a native weight)."""
        module, _, leaf = hf_name.rpartition(".")
        return leaf == "weight" and module in self.native_modules


class GGUFLinearMethod(QuantizeMethodBase):
    """One GGUF tensor's blocks as `weight` uint8 [N, K / block * block bytes], as loaded.

    After loading, where the kernels' panel layout holds the blocks bit for bit (Q4_0,
    Q4_1, Q8_0: quant_layouts.REPACKABLE) `weight` holds the layout's codes instead and the
    raw blocks are dropped: one copy of the weight (Q4_1 0.625 bytes a weight: half a byte
    a code, a float16 scale and offset per 32). `state_dict()` and `.to()` (through
    `restore_loaded_layout`) see the blocks rebuilt, bit for bit."""

    def __init__(self, qtype: GGMLQuantizationType,
                 config: GGUFNativeConfig | None = None) -> None:
        self.qtype = qtype
        self.block_size, self.type_size = GGML_QUANT_SIZES[qtype]
        self.config = config  # its dense_copy, read after loading

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
        layer.params_dtype = params_dtype  # the activations' dtype, for the kernels' preparers
        layer.quant_weight = None
        layer.dense_weight = None  # the bf16 copy in q_linear_amx's layout, if kept
        layer.dense_rows = None  # [lo, hi): the rows of the products that read it

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.quant_weight is not None:
            return  # NOTE: `weight` may hold the layout's codes now, not blocks
        raw = layer.weight.data
        k = raw.shape[1] // self.type_size * self.block_size
        weight = wquant.GGUFWeight(raw, int(self.qtype), (raw.shape[0], k))
        wquant.prepare("gguf_linear", weight, raw.device.type, getattr(layer, "params_dtype", None))
        lay = weight.layout
        # NOTE: checked, not assumed: a block the layout would not give back (a NaN scale)
        # keeps the raw blocks.
        if (lay is not None and self.qtype in quant_layouts.REPACKABLE
                and torch.equal(quant_layouts.to_gguf(lay, self.qtype), raw.cpu())):
            replace_param(layer, "weight", lay.codes)  # one copy of the codes: the layout's
            weight.raw = None
        layer.quant_weight = weight
        if self.config is not None and self.config.dense_copy:
            self._keep_dense_copy(layer)

    def _keep_dense_copy(self, layer: nn.Module) -> None:
        lay = layer.quant_weight.kernel_data.get(quant_cpu.NAME)
        if not isinstance(lay, quant_layouts.BlockLayout):
            return  # NOTE: no kernel layout (the reference runs): nothing to copy from
        layer.dense_weight = quant_cpu.dense_panels(lay)
        if layer.dense_weight is not None:
            layer.dense_rows = (quant_cpu.amx_min_rows(), DENSE_COPY_MAX_ROWS)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        dense = layer.dense_weight
        if dense is not None and x.dtype == torch.bfloat16:
            k = x.shape[-1]
            lo, hi = layer.dense_rows
            if lo * k <= x.numel() < hi * k:
                return quant_cpu.panels_linear(x, dense, layer.quant_weight.shape[0], bias)
        return wquant.gguf_linear(x, layer.quant_weight, bias)

    def restore_loaded_layout(self, layer: nn.Module) -> None:
        layer.dense_weight, layer.dense_rows = None, None
        weight = layer.quant_weight
        if weight is not None and weight.raw is None:
            replace_param(layer, "weight", weight.blocks())
        layer.quant_weight = None

    def state_dict_tensor(self, layer: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
        weight = layer.quant_weight
        if name == "weight" and weight is not None and weight.raw is None:
            return weight.blocks()
        return tensor


class GGUFEmbeddingMethod(GGUFLinearMethod):
    """A tied head's token table as its GGUF blocks: `apply` (the logits) through
    gguf_linear, or its dense copy for the rows that copies serve (a decode step's sampled
    rows: SmolLM2's Q8_0 head at 32-64 rows in 0.58-0.63 of q_linear's time); lookups
    dequantize the looked-up rows to the model's dtype."""

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        weight, ids = layer.quant_weight, input_ids.reshape(-1)
        values = None
        if weight.raw is None:  # NOTE: the layout is the weight's only copy: its values
            values = quant_cpu.dequantize_rows(weight.layout, ids, layer.params_dtype)
        if values is None:
            values = weight.dequantize_rows(ids).to(layer.params_dtype)
        return values.reshape(*input_ids.shape, weight.shape[1])
