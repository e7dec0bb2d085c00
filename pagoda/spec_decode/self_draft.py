"""Quantized self-draft proposer: the target's own weights, quantized in memory at start,
are the draft model. No second checkpoint, and the tokenizer and vocabulary are the
target's by construction.

It is the draft_model proposer (its own paged KV per request, k batched greedy steps,
catch-up on accepted tokens) over a model built from the target's checkpoint with
`SelfDraftQuantConfig`: every decoder linear gets `SelfDraftLinearMethod`, which loads the
dense weight as any linear does and, once loaded, replaces it by a group-quantized copy
(`wquant.GroupQuantWeight`, multiplied by `wq_linear`: the CPU kernels in bf16):
- "rtn": each group of the loaded weight rounded to its nearest grid point
  (quant/calibrate/rtn.py);
- "gptq": calibrated once at start on `calib_data` by `pagoda quantize`'s GPTQ driver
  (quant/calibrate/runner.py on the transformers float32 model: each layer calibrated on
  the outputs of the quantized layers before it), CALIB_SAMPLES windows of
  CALIB_SEQ_LEN tokens.
The grid has a zero point per group (asymmetric: it spends no code on a side of zero the
group does not reach). Every other module of the draft (embedding, LM head, norms, rotary
tables) is replaced by the target's own, shared: what the draft adds to the weights in
memory is its quantized linears only (`draft_extra_weight_bytes`). With `num_layers` N the
draft is the target's first N decoder layers only, then the target's final norm and LM head
(early exit): a draft that costs about N / L of a full one per token.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagoda.ops import wquant
from pagoda.quant.base import QuantizationConfig, QuantizeMethodBase
from pagoda.quant.calibrate.rtn import QuantizedTensor, QuantSpec, quantize_rtn
from pagoda.quant.group_quant import make_group_weight
from pagoda.quant.unquantized import UnquantizedLinearMethod
from pagoda.spec_decode.config import SpeculativeConfig
from pagoda.spec_decode.draft_model import DRAFT_BACKEND, DraftModelProposer
from pagoda.spec_decode.proposer import register_proposer

if TYPE_CHECKING:
    from pagoda.models.loader import Checkpoint

QUANTIZATIONS = ("rtn", "gptq")
BITS = (2, 4, 8)
DEFAULT_BITS = 4
# The default group size: the first of these that divides every decoder linear's input.
GROUP_SIZES = (128, 64, 32)
CALIB_SAMPLES = 32
CALIB_SEQ_LEN = 256


class SelfDraftLinearMethod(QuantizeMethodBase):
    """A dense weight while loading; after loading, its group quantization alone.

    `parts`: the quantizations of the checkpoint modules this layer packs (gptq, computed
    before the build), stacked along the outputs; None: round-to-nearest of the loaded
    weight. The layer is never moved after processing (a draft lives where it was built).
    """

    def __init__(self, spec: QuantSpec, parts: list[QuantizedTensor] | None = None) -> None:
        self.spec, self.parts = spec, parts

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        UnquantizedLinearMethod().create_weights(
            layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
            params_dtype, **extra_weight_attrs)
        layer.quant_weight = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.quant_weight is not None:
            return
        dense = layer.weight.detach()
        if self.parts is None:
            qt = quantize_rtn(dense, self.spec)
        else:
            qt = QuantizedTensor(*(torch.cat([getattr(p, name) for p in self.parts])
                                   for name in ("codes", "scales", "zeros")),
                                 self.parts[0].g_idx, self.spec)
            self.parts = None
        if tuple(qt.codes.shape) != tuple(dense.shape):
            raise ValueError(f"{layer.prefix}: quantized shape {list(qt.codes.shape)} is not "
                             f"the weight's {list(dense.shape)}")
        weight = make_group_weight(qt.codes.to(dense.device), qt.scales.to(dense.device),
                                   qt.zeros.to(dense.device), self.spec.bits,
                                   self.spec.group_len(dense.shape[1]))
        del layer.weight  # NOTE: the dense copy goes: the draft holds the codes only
        # NOTE: a kernel's layout only where a kernel takes this dtype (the CPU's: bf16):
        # in float32 the reference runs, and a layout would be bytes nobody reads.
        if wquant.wq_linear.kernel_for(dense[:0]) is not None:
            wquant.prepare("wq_linear", weight, dense.device.type)
        layer.quant_weight = weight

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return wquant.wq_linear(x, layer.quant_weight, bias)


class SelfDraftQuantConfig(QuantizationConfig):
    """`SelfDraftLinearMethod` for every decoder-layer linear (never the LM head);
    `quantized`: gptq's results by the checkpoint's module name, or None for rtn."""

    name = "quantized_self_draft"

    def __init__(self, spec: QuantSpec,
                 quantized: dict[str, QuantizedTensor] | None = None) -> None:
        self.spec, self.quantized = spec, quantized

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> SelfDraftQuantConfig:
        raise ValueError("quantized_self_draft is built in memory, not read from a checkpoint")

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if ".layers." not in f".{prefix}":
            return None
        if self.quantized is None:
            return SelfDraftLinearMethod(self.spec)
        return SelfDraftLinearMethod(self.spec, [self.quantized.pop(name)
                                                 for name in self.module_names(prefix)])


def _input_sizes(hf_config: Any) -> list[int]:
    """The input sizes of a Llama-family decoder layer's linears."""
    from pagoda.models.llama import LlamaSpec

    spec = LlamaSpec.from_hf(hf_config)
    return [spec.hidden_size, spec.num_heads * spec.head_dim, spec.intermediate_size]


def resolve_group_size(config: SpeculativeConfig, hf_config: Any) -> int:
    """The configured group size, checked against every linear's input size, or the default
    (the first of GROUP_SIZES dividing them all, else -1: one group per output row)."""
    sizes = _input_sizes(hf_config)
    if config.group_size is None:
        return next((g for g in GROUP_SIZES if all(k % g == 0 for k in sizes)), -1)
    if config.group_size != -1:
        bad = [k for k in sizes if k % config.group_size]
        if bad:
            raise ValueError(f"speculative_config.group_size {config.group_size} does not "
                             f"divide the input size {bad[0]} of the model's linears "
                             f"(use a divisor of {sizes}, or -1 for one group per row)")
    return config.group_size


def calibrate_gptq(path: str, spec: QuantSpec, calib_data: str) -> dict[str, QuantizedTensor]:
    """GPTQ quantizations of the float model at `path`, by module name, calibrated on the
    text `calib_data` names; ValueError naming the field if that text cannot serve."""
    from pagoda.eval.corpus import load_text
    from pagoda.quant.calibrate.export import load_float_model
    from pagoda.quant.calibrate.runner import CalibrationConfig, calibration_batch, quantize_model

    try:
        text = load_text(calib_data)
    except OSError as e:
        raise ValueError(f"speculative_config.calib_data: {e}") from None
    hf_model, tokenizer, _ = load_float_model(path)
    try:
        calib = calibration_batch(tokenizer, text, CALIB_SAMPLES, CALIB_SEQ_LEN)
    except ValueError as e:
        raise ValueError(f"speculative_config.calib_data: {e}") from None
    return quantize_model(hf_model, calib, CalibrationConfig("gptq", spec))


def share_target_modules(draft: nn.Module, target: nn.Module) -> None:
    """Replace each of `draft`'s modules that hold parameters themselves and are not
    quantized linears (embedding, LM head, norms), and its rotary tables, by the module of
    the same name and class in `target`."""
    own = [(name, m) for name, m in draft.named_modules(remove_duplicate=False)
           if name and next(m.parameters(recurse=False), None) is not None
           and not isinstance(getattr(m, "quant_method", None), SelfDraftLinearMethod)]
    targets = dict(target.named_modules(remove_duplicate=False))
    for name, module in [*own, ("rotary", draft.rotary)]:
        shared = targets.get(name)
        if shared is not None and type(shared) is type(module):
            parent, _, child = name.rpartition(".")
            setattr(draft.get_submodule(parent) if parent else draft, child, shared)


def draft_extra_weight_bytes(draft: nn.Module, target: nn.Module) -> int:
    """Bytes of weights `draft` holds that `target` does not share (a storage counts once)."""
    from pagoda.benchmarks.quant import weight_bytes

    return weight_bytes(nn.ModuleList([target, draft])) - weight_bytes(target)


def _layer_index(name: str) -> int | None:
    """N of a decoder layer's tensor `model.layers.N....`, None for any other tensor."""
    parts = name.split(".")
    if "layers" in parts[:-1]:
        index = parts[parts.index("layers") + 1]
        if index.isdigit():
            return int(index)
    return None


def first_layers(ckpt: Checkpoint, num_layers: int) -> Checkpoint:
    """`ckpt` cut to its first `num_layers` decoder layers (the config's count and per-layer
    lists, and the weights streamed); ValueError naming the field if it has fewer."""
    total = int(ckpt.hf_config.num_hidden_layers)
    if num_layers > total:
        raise ValueError(f"speculative_config.num_layers {num_layers} exceeds the target's "
                         f"{total} decoder layers")
    hf_config = copy.deepcopy(ckpt.hf_config)
    hf_config.num_hidden_layers = num_layers
    if getattr(hf_config, "layer_types", None):
        hf_config.layer_types = list(hf_config.layer_types[:num_layers])
    open_weights = ckpt.open_weights

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in open_weights():
            index = _layer_index(name)
            if index is None or index < num_layers:
                yield name, tensor

    return dataclasses.replace(ckpt, hf_config=hf_config, open_weights=weights,
                               open_raw_tensors=None)


@register_proposer("quantized_self_draft")
class QuantizedSelfDraftProposer(DraftModelProposer):
    @classmethod
    def validate_config(cls, config: SpeculativeConfig) -> None:
        quantization = config.quantization or "rtn"
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"speculative_config.quantization must be one of {QUANTIZATIONS}, "
                             f"got {config.quantization!r}")
        bits = config.bits
        if bits is not None and (not isinstance(bits, int) or isinstance(bits, bool)
                                 or bits not in BITS):
            raise ValueError(f"speculative_config.bits must be one of {BITS}, got {bits!r}")
        g = config.group_size
        if g is not None and (not isinstance(g, int) or isinstance(g, bool)
                              or (g < 1 and g != -1)):
            raise ValueError(f"speculative_config.group_size must be -1 or a positive integer, "
                             f"got {g!r}")
        n = config.num_layers
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"speculative_config.num_layers must be a positive integer, "
                             f"got {n!r}")
        if quantization == "gptq" and not config.calib_data:
            raise ValueError("speculative_config.calib_data is required for quantization gptq "
                             "(a .txt or .jsonl file, or 'calib' for the built-in corpus)")
        if quantization == "rtn" and config.calib_data is not None:
            raise ValueError("speculative_config.calib_data is for quantization gptq; rtn "
                             "needs no calibration")

    def load_draft_model(self) -> nn.Module:
        from pagoda.models.factory import build_model
        from pagoda.quant.base import quant_config_from_hf

        config, context = self.config, self.context
        ckpt, target = context.target_checkpoint, context.target_model
        if ckpt is None or target is None:
            raise ValueError("speculative_config.method quantized_self_draft needs the "
                             "target's checkpoint and model (an engine to run in)")
        if quant_config_from_hf(ckpt.hf_config) is not None:
            raise ValueError("speculative_config.method quantized_self_draft quantizes a dense "
                             f"checkpoint; {ckpt.path} is already quantized")
        spec = QuantSpec(config.bits or DEFAULT_BITS,
                         resolve_group_size(config, ckpt.hf_config), sym=False)
        quantized = None
        if (config.quantization or "rtn") == "gptq":
            quantized = calibrate_gptq(str(ckpt.path), spec, config.calib_data)
        if config.num_layers is not None:
            ckpt = first_layers(ckpt, config.num_layers)
            if quantized is not None:  # NOTE: the layers past the draft's are never built
                quantized = {name: q for name, q in quantized.items()
                             if (_layer_index(name) or 0) < config.num_layers}
        draft = build_model(ckpt, context.dtype, context.device, context.max_model_len,
                            DRAFT_BACKEND, quant_config=SelfDraftQuantConfig(spec, quantized))
        share_target_modules(draft, target)
        return draft
