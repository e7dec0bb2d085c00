"""The layer-by-layer driver of `pagoda quantize`.

The float model is a transformers Llama-family model (any of the architectures pagoda runs:
the decoder layers have self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj and the two
RMSNorms). The calibration batch is embedded once; then each decoder layer in turn sees the
hidden states the layers before it produce *after* their quantization, is calibrated and
quantized, and gives the next layer its input. Only one layer's activations (and Hessians)
are alive at a time. GPTQ goes the same way inside a layer (see `_gptq_layer`): each linear
is calibrated on what the layer's already-quantized parts feed it, in a single forward for
layers of the standard shape. Quantized weights are written back into the model as their
dequantized values, so the model is afterwards the in-memory quantized model the
checkpoint describes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pagoda.quant.calibrate import awq
from pagoda.quant.calibrate.gptq import HessianAccumulator, gptq_quantize
from pagoda.quant.calibrate.rtn import QuantizedTensor, QuantSpec, quantize_rtn

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
METHODS = ("gptq", "awq", "rtn")
AWQ_SEARCH_TOKENS = 4096  # default: calibration tokens AWQ's scale search evaluates (strided)


@dataclass(frozen=True, slots=True)
class CalibrationConfig:
    method: str
    spec: QuantSpec
    act_order: bool = False
    batch_size: int = 8  # calibration samples per forward
    damp_percent: float = 0.01  # gptq: dampening, this fraction of mean(diag(H))
    static_groups: bool = False  # gptq: groups fitted on the weight before any update
    # awq: at most this many calibration tokens (evenly strided) in the scale search, whose
    # cost is 40 block forwards over them per scaling; the means see every token.
    awq_search_tokens: int = AWQ_SEARCH_TOKENS

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.spec.bits not in (2, 4, 8):
            raise ValueError(f"bits must be 2, 4 or 8 (the int32 packings), got {self.spec.bits}")
        if (self.act_order or self.static_groups) and self.method != "gptq":
            raise ValueError("act_order and static_groups are GPTQ options")
        if not 0 < self.damp_percent <= 1:
            raise ValueError(f"damp_percent must lie in (0, 1], got {self.damp_percent}")
        if self.awq_search_tokens < 1:
            raise ValueError(f"awq_search_tokens must be positive, got {self.awq_search_tokens}")
        if self.method == "awq" and (self.spec.bits != 4 or self.spec.sym):
            raise ValueError("awq writes AutoAWQ's GEMM layout: 4 bits with a zero point "
                             "(--no-sym)")


def progress(iterable: list, desc: str) -> Iterator:
    """tqdm's bar where tqdm is installed, else one line per item on stderr."""
    try:
        from tqdm import tqdm
    except ImportError:
        def plain() -> Iterator:
            for i, item in enumerate(iterable):
                print(f"{desc}: {i + 1}/{len(iterable)}", file=sys.stderr, flush=True)
                yield item
        return plain()
    return iter(tqdm(iterable, desc=desc))


class _StopForward(Exception):
    """Raised by `feed_until`'s hook once the submodule it waits for has its input."""


class LayerRunner:
    """Runs one decoder layer over the calibration batch (causal, positions 0..L-1)."""

    def __init__(self, model: Any, hidden: torch.Tensor, batch_size: int) -> None:
        from transformers.masking_utils import create_causal_mask

        self.batch_size = batch_size
        seq_len = hidden.shape[1]
        self.position_ids = torch.arange(seq_len).unsqueeze(0)
        self.position_embeddings = model.model.rotary_emb(hidden[:1], self.position_ids)
        self.masks: dict[int, Any] = {}
        for b in {min(batch_size, hidden.shape[0]), hidden.shape[0] % batch_size or batch_size}:
            self.masks[b] = create_causal_mask(
                config=model.config, inputs_embeds=hidden[:b], attention_mask=None,
                cache=None, position_ids=self.position_ids)

    def _forward(self, layer: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        out = layer(h, attention_mask=self.masks[h.shape[0]], position_ids=self.position_ids,
                    position_embeddings=self.position_embeddings)
        return out[0] if isinstance(out, tuple) else out

    def batches(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """The calibration batch cut as every forward here cuts it."""
        return [hidden[b0 : b0 + self.batch_size]
                for b0 in range(0, hidden.shape[0], self.batch_size)]

    def attention_output(self, attn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The input of `attn`'s o_proj (the heads' outputs, concatenated) for one batch
        of normed hidden states `x`: attn's own forward, stopped there."""
        kept: list[torch.Tensor] = []

        def stop(_module: torch.nn.Module, inputs: tuple) -> None:
            kept.append(inputs[0].detach())
            raise _StopForward

        handle = attn.o_proj.register_forward_pre_hook(stop)
        try:
            attn(hidden_states=x, attention_mask=self.masks[x.shape[0]],
                 position_ids=self.position_ids, position_embeddings=self.position_embeddings)
        except _StopForward:
            pass
        finally:
            handle.remove()
        return kept[0]

    def run(self, layer: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's output for every calibration sample."""
        with torch.no_grad():
            return torch.cat([self._forward(layer, h) for h in self.batches(hidden)])

    def feed_until(self, layer: torch.nn.Module, hidden: torch.Tensor, name: str,
                   sink: Callable[[torch.Tensor], None]) -> None:
        """Run the layer over the batch only as far as its submodule `name`, handing each
        batch's input of that submodule to `sink` (the rest of the forward is not run)."""
        def stop(_module: torch.nn.Module, inputs: tuple) -> None:
            sink(inputs[0].detach())
            raise _StopForward

        handle = layer.get_submodule(name).register_forward_pre_hook(stop)
        try:
            with torch.no_grad():
                for h in self.batches(hidden):
                    try:
                        self._forward(layer, h)
                    except _StopForward:
                        pass
        finally:
            handle.remove()


def _capture(layer: torch.nn.Module, names: tuple[str, ...],
             sink: Callable[[str, torch.Tensor], None]) -> list[Any]:
    def hook(name: str) -> Callable:
        return lambda _m, inputs, _out: sink(name, inputs[0].detach())
    return [layer.get_submodule(n).register_forward_hook(hook(n)) for n in names]


def _set_quantized(layer: torch.nn.Module, name: str, qt: QuantizedTensor) -> None:
    weight = layer.get_submodule(name).weight
    with torch.no_grad():
        weight.copy_(qt.dequantize().to(weight.dtype))


# Linears that read one input share its Hessian: GPTQ quantizes them stacked, in one pass.
# In this order each group's input depends only on the groups before it.
SHARED_INPUTS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 ("self_attn.o_proj",), ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))
# The children of a decoder layer whose forward `_gptq_layer_staged` reproduces (Llama, Mistral,
# Qwen2, ...: pre-norm attention and gated MLP, each added to the residual).
_STAGED_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}


def _gptq_group(layer: torch.nn.Module, names: tuple[str, ...], inputs: list[torch.Tensor],
                cfg: CalibrationConfig) -> dict[str, QuantizedTensor]:
    """Quantize the linears `names` (one input) stacked, against the Hessian of `inputs`
    (the calibration batches of that input), and write them back into the layer."""
    acc = HessianAccumulator(layer.get_submodule(names[0]).in_features)
    for x in inputs:
        acc.add(x)
    weights = [layer.get_submodule(n).weight.detach() for n in names]
    stacked = gptq_quantize(torch.cat(weights), acc.hessian, cfg.spec,
                            act_order=cfg.act_order, percdamp=cfg.damp_percent,
                            static_groups=cfg.static_groups)
    result, row = {}, 0
    for name, w in zip(names, weights):
        result[name] = stacked.rows(row, row + w.shape[0])
        row += w.shape[0]
        _set_quantized(layer, name, result[name])
    return result


def _gptq_layer_staged(layer: torch.nn.Module, runner: LayerRunner, hidden: torch.Tensor,
                       cfg: CalibrationConfig) -> tuple[dict[str, QuantizedTensor],
                                                         torch.Tensor]:
    """`_gptq_layer` for a layer of the standard shape, in one forward: the layer's own
    submodules, called in its forward's order, each stage run once per batch as soon as the
    groups it reads are quantized, its result kept for the next stage (the generic path
    re-runs the layer's front for every group)."""
    attn, mlp = layer.self_attn, layer.mlp
    with torch.no_grad():
        residual = runner.batches(hidden)
        stage = [layer.input_layernorm(h) for h in residual]
        result = _gptq_group(layer, SHARED_INPUTS[0], stage, cfg)
        stage = [runner.attention_output(attn, x) for x in stage]  # o_proj's input
        result |= _gptq_group(layer, SHARED_INPUTS[1], stage, cfg)
        residual = [h + attn.o_proj(a) for h, a in zip(residual, stage)]
        stage = [layer.post_attention_layernorm(h) for h in residual]
        result |= _gptq_group(layer, SHARED_INPUTS[2], stage, cfg)
        stage = [mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x) for x in stage]
        result |= _gptq_group(layer, SHARED_INPUTS[3], stage, cfg)
        out = torch.cat([h + mlp.down_proj(d) for h, d in zip(residual, stage)])
    return result, out


def _gptq_layer(layer: torch.nn.Module, runner: LayerRunner, hidden: torch.Tensor,
                cfg: CalibrationConfig) -> tuple[dict[str, QuantizedTensor], torch.Tensor]:
    """GPTQ "true sequential": each group of SHARED_INPUTS is calibrated on the inputs that
    the layer, with the groups before it already quantized, gives it; the error q/k/v leave
    is then part of what o compensates, and so on down to down_proj. Returns the
    quantizations and the quantized layer's output on `hidden`."""
    if {name for name, _ in layer.named_children()} == _STAGED_CHILDREN:
        return _gptq_layer_staged(layer, runner, hidden, cfg)
    result = {}
    for names in SHARED_INPUTS:
        inputs: list[torch.Tensor] = []
        runner.feed_until(layer, hidden, names[0], inputs.append)
        result |= _gptq_group(layer, names, inputs, cfg)
    return result, runner.run(layer, hidden)


class _Features:
    """Per capture point: the mean |x| per channel over every token, and an evenly strided
    subsample of at most `max_rows` token rows."""

    def __init__(self, num_tokens: int, max_rows: int = AWQ_SEARCH_TOKENS) -> None:
        self.step = max(1, -(-num_tokens // max_rows))
        self.abs_sum: dict[str, torch.Tensor] = {}
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.count: dict[str, int] = {}

    def add(self, name: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float32)
        seen = self.count.get(name, 0)
        self.abs_sum[name] = self.abs_sum.get(name, 0) + x.abs().sum(0)
        first = (-seen) % self.step
        self.rows.setdefault(name, []).append(x[first :: self.step])
        self.count[name] = seen + x.shape[0]

    def get(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self.rows[name]), self.abs_sum[name] / self.count[name]


def _awq_scales(layer: torch.nn.Module, feats: _Features, spec: QuantSpec) -> dict[str, Any]:
    """Search and fold the four scalings of a Llama layer; returns the inputs each linear
    now reads (the captured ones divided by the folded scales)."""
    attn, mlp = layer.self_attn, layer.mlp
    inputs: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        x, mean = feats.get("self_attn.q_proj")
        qkv = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
        s, _ = awq.search_scales_linear(x, mean, qkv, spec)
        awq.fold_into_norm(layer.input_layernorm.weight, qkv, s)
        for n in ("q_proj", "k_proj", "v_proj"):
            inputs[f"self_attn.{n}"] = x / s
        x, mean = feats.get("self_attn.o_proj")
        # NOTE: v feeds o channel for channel only without grouped-query sharing.
        if attn.v_proj.out_features == attn.o_proj.in_features:
            s, _ = awq.search_scales_linear(x, mean, [attn.o_proj.weight], spec)
            awq.fold_into_linear(attn.v_proj.weight, attn.v_proj.bias, attn.o_proj.weight, s)
            x = x / s
        inputs["self_attn.o_proj"] = x

        x, mean = feats.get("mlp.gate_proj")
        down = mlp.down_proj.weight.detach().clone()

        def mlp_block(x: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
            return (mlp.act_fn(x @ w[0].T) * (x @ w[1].T)) @ down.T

        gate_up = [mlp.gate_proj.weight, mlp.up_proj.weight]
        s, _ = awq.search_scales(x, mean, gate_up, mlp_block, spec)
        awq.fold_into_norm(layer.post_attention_layernorm.weight, gate_up, s)
        inputs["mlp.gate_proj"] = inputs["mlp.up_proj"] = x / s
        x, mean = feats.get("mlp.down_proj")
        s, _ = awq.search_scales_linear(x, mean, [mlp.down_proj.weight], spec)
        awq.fold_into_linear(mlp.up_proj.weight, mlp.up_proj.bias, mlp.down_proj.weight, s)
        inputs["mlp.down_proj"] = x / s
    return inputs


def _awq_layer(layer: torch.nn.Module, runner: LayerRunner, hidden: torch.Tensor,
               cfg: CalibrationConfig) -> tuple[dict[str, QuantizedTensor], torch.Tensor]:
    points = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")
    feats = _Features(hidden.shape[0] * hidden.shape[1], cfg.awq_search_tokens)
    hooks = _capture(layer, points, feats.add)
    try:
        runner.run(layer, hidden)
    finally:
        for h in hooks:
            h.remove()
    inputs = _awq_scales(layer, feats, cfg.spec)
    result = {}
    for name in LINEARS:
        weight = layer.get_submodule(name).weight.detach()
        # NOTE: q and k are not clipped: their error goes through the softmax, which the
        # per-group output error does not see.
        if name not in ("self_attn.q_proj", "self_attn.k_proj"):
            bound = awq.search_clip(inputs[name], weight, cfg.spec)
            weight = awq.apply_clip(weight, bound, cfg.spec)
        result[name] = quantize_rtn(weight, cfg.spec)
        _set_quantized(layer, name, result[name])
    return result, runner.run(layer, hidden)


def quantize_model(model: Any, calib_ids: torch.Tensor | None,
                   cfg: CalibrationConfig) -> dict[str, QuantizedTensor]:
    """Quantize every decoder-layer linear of `model` (transformers, float32) in place;
    returns the quantizations by the linear's full name ("model.layers.3.mlp.up_proj").
    `calib_ids` [samples, seq_len] is needed by gptq and awq, not by rtn."""
    layers = list(model.model.layers)
    quantized: dict[str, QuantizedTensor] = {}
    if cfg.method == "rtn":
        for i, layer in enumerate(progress(layers, "rtn")):
            for name in LINEARS:
                qt = quantize_rtn(layer.get_submodule(name).weight.detach(), cfg.spec)
                _set_quantized(layer, name, qt)
                quantized[f"model.layers.{i}.{name}"] = qt
        return quantized
    if calib_ids is None:
        raise ValueError(f"{cfg.method} needs calibration data")
    with torch.no_grad():
        hidden = model.model.embed_tokens(calib_ids).to(torch.float32)
    runner = LayerRunner(model, hidden, cfg.batch_size)
    quantize_layer = _gptq_layer if cfg.method == "gptq" else _awq_layer
    for i, layer in enumerate(progress(layers, cfg.method)):
        result, hidden = quantize_layer(layer, runner, hidden, cfg)
        for name, qt in result.items():
            quantized[f"model.layers.{i}.{name}"] = qt
    return quantized


def calibration_batch(tokenizer: Any, text: str, num_samples: int, seq_len: int) -> torch.Tensor:
    """[samples, seq_len] token ids: consecutive windows of the tokenized text."""
    from pagoda.eval.corpus import token_windows

    ids = list(tokenizer(text)["input_ids"])
    return torch.tensor(token_windows(ids, num_samples, seq_len), dtype=torch.long)
