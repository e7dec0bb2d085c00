"""Quantization as a strategy object on layers, plus the registry of methods by name.

A layer (pagoda/layers/linear.py, vocab_embedding.py) knows its shapes and shards; its
`quant_method` decides how the weights are stored and multiplied:

- `create_weights` registers the parameters, in the layout the checkpoint's loaders write
  (each parameter carries the layer's `weight_loader` and `input_dim` / `output_dim`:
  the dimensions a tensor-parallel shard cuts, None where it does not cut);
- `process_weights_after_loading` may turn them into a kernel's layout once loaded;
- `apply` computes the layer's product;
- `restore_loaded_layout` / `state_dict_tensor` undo that layout for `.to()` and
  `state_dict()` (see `QuantizableLayer`), so both see the checkpoint's values.

A checkpoint's quantization (HF `quantization_config.quant_method`) names a registered
`QuantizationConfig`, which hands each layer its method by the layer's dotted prefix.
"""

from __future__ import annotations

import functools
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn


class QuantizeMethodBase(ABC):
    """How one layer stores, prepares and applies its weights."""

    @abstractmethod
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
        """Register `layer`'s parameters; each gets `extra_weight_attrs` (the layer's
        `weight_loader`) as attributes. `output_partition_sizes` are this rank's sizes of
        the packed outputs (e.g. q, k, v), summing to the layer's output per partition."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once every parameter is loaded (and again after `.to()`); idempotent."""

    @abstractmethod
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [..., input_size_per_partition] -> [..., output_size_per_partition]."""

    def bind(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """`layer`'s product as one callable x -> apply(layer, x, layer.bias), made once its
        weights are processed (and again after `.to()`), so a call skips the attribute
        lookups. A method may return a closure over its prepared tensors instead."""
        return functools.partial(self.apply, layer, bias=getattr(layer, "bias", None))

    def restore_loaded_layout(self, layer: nn.Module) -> None:
        """Put the parameters back in the layout the loaders wrote (before a conversion,
        after which `process_weights_after_loading` runs again)."""

    def state_dict_tensor(self, layer: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The value `state_dict()` shows for parameter `name`: the loaded layout's."""
        return tensor


def set_weight_attrs(param: nn.Parameter, attrs: dict[str, Any]) -> None:
    """Attach loader metadata (weight_loader, input_dim, output_dim) to a parameter."""
    for key, value in attrs.items():
        if hasattr(param, key):
            raise AttributeError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


def replace_param(layer: nn.Module, name: str, value: torch.Tensor) -> None:
    """Register `value` as parameter `name`, keeping the old one's loader attributes."""
    old = getattr(layer, name, None)
    param = nn.Parameter(value, requires_grad=False)
    if isinstance(old, nn.Parameter):
        set_weight_attrs(param, vars(old))
    layer.register_parameter(name, param)


class QuantizableLayer(nn.Module):
    """A layer whose parameters its `quant_method` owns.

    `.to()` / `.cuda()` / `to_empty()` (any `_apply`) first restore the loaded layout, then
    convert, then (once weights were processed) let the method prepare its layout again
    for the new dtype/device; the parameters keep their loader attributes. `state_dict()`
    returns loaded-layout values. `bound_apply` is the method's `bind` of the processed
    weights (None before processing, and while `_apply` converts).
    """

    quant_method: QuantizeMethodBase

    def __init__(self) -> None:
        super().__init__()
        self.weights_processed = False
        self.bound_apply: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._register_state_dict_hook(_loaded_layout_state_dict)

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)
        self.weights_processed = True
        self.bound_apply = self.quant_method.bind(self)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):
        self.bound_apply = None
        self.quant_method.restore_loaded_layout(self)
        # NOTE: nn.Module._apply creates new Parameter objects when the tensor type
        # changes (meta -> cpu, cpu -> cuda), which drops their attributes.
        attrs = {name: dict(vars(p)) for name, p in self._parameters.items() if p is not None}
        super()._apply(fn, recurse)
        for name, param in self._parameters.items():
            if param is not None:
                for key, value in attrs.get(name, {}).items():
                    setattr(param, key, value)
        if self.weights_processed:
            self.process_weights_after_loading()
        return self


def _loaded_layout_state_dict(
    module: QuantizableLayer, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    for name in module._parameters:
        key = prefix + name
        if key in state_dict:
            state_dict[key] = module.quant_method.state_dict_tensor(module, name, state_dict[key])


class QuantizationConfig(ABC):
    """A checkpoint's quantization scheme: which method each layer gets.

    `packed_modules_mapping` (set by the model factory before the layers are built) names
    the checkpoint modules a packed layer holds (qkv_proj -> q_proj, k_proj, v_proj), so
    that per-module rules (targets, ignore lists) apply to the packed layers too.
    """

    name: ClassVar[str]
    packed_modules_mapping: dict[str, list[str]]

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Build from an HF `quantization_config` dict; ValueError naming a bad field."""

    @classmethod
    def from_dense(cls) -> QuantizationConfig:
        """The config that quantizes a dense checkpoint while loading (`--quantization NAME`
        on a checkpoint without `quantization_config`); ValueError for methods that need a
        checkpoint in their own format."""
        raise ValueError(
            f"quantization method {cls.name!r} needs a checkpoint quantized with it "
            "(config.json quantization_config); it cannot quantize a dense checkpoint at load"
        )

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method for `layer` (dotted `prefix`, e.g. model.layers.3.mlp.down_proj), or
        None to leave it unquantized."""

    def get_embedding_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method of an embedding table (it must also have `embedding(layer, ids)`), or
        None for the dense table (the default)."""
        return None

    def module_names(self, prefix: str) -> list[str]:
        """The checkpoint module names behind `prefix`: the parts of a packed layer
        (model.layers.0.self_attn.q_proj, ...), else `prefix` itself."""
        parent, _, child = prefix.rpartition(".")
        parts = getattr(self, "packed_modules_mapping", {}).get(child)
        if not parts:
            return [prefix]
        return [f"{parent}.{part}" if parent else part for part in parts]


_QUANTIZATION_CONFIGS: dict[str, type[QuantizationConfig]] = {}
# NOTE: imported on the first registry lookup (they import this module, so not at its top).
_BUILTIN_METHOD_MODULES = (
    "pagoda.quant.gptq",
    "pagoda.quant.awq",
    "pagoda.quant.compressed_tensors",
    "pagoda.quant.int8",
    "pagoda.quant.fp8",
    "pagoda.quant.gguf",
)


def _load_builtin_methods() -> None:
    for module in _BUILTIN_METHOD_MODULES:
        importlib.import_module(module)


def register_quantization_config(
    name: str,
) -> Callable[[type[QuantizationConfig]], type[QuantizationConfig]]:
    """Class decorator: make `name` (HF's `quant_method` string) resolve to the class."""

    def wrap(cls: type[QuantizationConfig]) -> type[QuantizationConfig]:
        if name in _QUANTIZATION_CONFIGS:
            raise ValueError(f"quantization method {name!r} is already registered")
        cls.name = name
        _QUANTIZATION_CONFIGS[name] = cls
        return cls

    return wrap


def quantization_methods() -> list[str]:
    _load_builtin_methods()
    return sorted(_QUANTIZATION_CONFIGS)


def get_quantization_config(name: str) -> type[QuantizationConfig]:
    """The registered config class for `name`; ValueError listing the known ones."""
    _load_builtin_methods()
    if name not in _QUANTIZATION_CONFIGS:
        known = ", ".join(quantization_methods()) or "none yet"
        raise ValueError(f"quantization method {name!r} is not supported (supported: {known})")
    return _QUANTIZATION_CONFIGS[name]


def quant_config_from_hf(hf_config: Any) -> QuantizationConfig | None:
    """The QuantizationConfig an HF config asks for (`quantization_config`), or None."""
    config = getattr(hf_config, "quantization_config", None)
    if not config:
        return None
    if not isinstance(config, dict):
        config = config.to_dict()
    return get_quantization_config(str(config.get("quant_method"))).from_config(config)
