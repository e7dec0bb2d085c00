"""`pagoda quantize` on tiny random Llamas: AWQ's folding leaves the float model's function
unchanged, and OUT_DIR holds the method's standard tensors, which decode to exactly the
in-memory quantized model's weights."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from pagoda.quant.calibrate import awq, runner
from pagoda.quant.calibrate.command import quantize_to_dir
from pagoda.quant.calibrate.gptq import HessianAccumulator
from pagoda.quant.calibrate.rtn import QuantSpec, quantize_rtn
from pagoda.quant.calibrate.runner import (
    LINEARS,
    SHARED_INPUTS,
    CalibrationConfig,
    LayerRunner,
    _awq_scales,
    _capture,
    _Features,
    _gptq_layer,
)
from pagoda.quant.packing import unpack_awq, unpack_gptq
from tests.model.test_perplexity import TEXT

GROUP = 32  # divides the tiny models' hidden (64) and intermediate (128) sizes


@pytest.fixture
def calib_file(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text(TEXT * 3)
    return str(path)


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def random_ids(n: int = 2, length: int = 40) -> torch.Tensor:
    return torch.randint(3, 49152, (n, length), generator=torch.Generator().manual_seed(0))


def test_awq_fold_with_any_scales_keeps_the_float_model(tiny_model):
    # Heads == KV heads, so the v -> o fold applies too.
    path = tiny_model("LlamaForCausalLM", num_key_value_heads=4)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = random_ids()
    before = hf_logits(model, ids)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            h, inter = attn.q_proj.in_features, mlp.down_proj.in_features

            def scales(n):
                return torch.exp(torch.randn(n, generator=g))

            awq.fold_into_norm(layer.input_layernorm.weight,
                               [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight],
                               scales(h))
            awq.fold_into_linear(attn.v_proj.weight, attn.v_proj.bias, attn.o_proj.weight,
                                 scales(attn.o_proj.in_features))
            awq.fold_into_norm(layer.post_attention_layernorm.weight,
                               [mlp.gate_proj.weight, mlp.up_proj.weight], scales(h))
            awq.fold_into_linear(mlp.up_proj.weight, mlp.up_proj.bias, mlp.down_proj.weight,
                                 scales(inter))
    after = hf_logits(model, ids)
    assert not torch.equal(before, after)  # the weights did change
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_awq_searched_scales_keep_the_float_layer(tiny_model, kv_heads):
    path = tiny_model("LlamaForCausalLM", num_key_value_heads=kv_heads)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = random_ids(4, 48)
    hidden = model.model.embed_tokens(ids).detach()
    hidden[..., :3] *= 20.0  # a few salient channels, as in real activations
    runner = LayerRunner(model, hidden, batch_size=2)
    layer = model.model.layers[0]
    before = runner.run(layer, hidden)
    feats = _Features(hidden.shape[0] * hidden.shape[1])
    hooks = _capture(layer, ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj",
                             "mlp.down_proj"), feats.add)
    runner.run(layer, hidden)
    for h in hooks:
        h.remove()
    norm_before = layer.input_layernorm.weight.detach().clone()
    inputs = _awq_scales(layer, feats, QuantSpec(4, GROUP, False))
    assert set(inputs) == set(LINEARS)
    assert not torch.equal(layer.input_layernorm.weight, norm_before)
    torch.testing.assert_close(runner.run(layer, hidden), before, rtol=1e-4, atol=1e-4)


def _decoded_gptq(tensors, prefix):
    codes, zeros = unpack_gptq(tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"], 4)
    g_idx = tensors[f"{prefix}.g_idx"].long()
    scales = tensors[f"{prefix}.scales"].float()
    return ((codes.float() - zeros.float()[g_idx]) * scales[g_idx]).T


def _decoded_awq(tensors, prefix):
    codes, zeros = unpack_awq(tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"])
    g = torch.arange(codes.shape[0]) // GROUP
    scales = tensors[f"{prefix}.scales"].float()
    return ((codes.float() - zeros.float()[g]) * scales[g]).T


@pytest.mark.parametrize("method,act_order,sym", [
    ("gptq", False, True), ("gptq", True, False), ("rtn", False, False), ("awq", False, None),
])
def test_out_dir_decodes_to_the_in_memory_model(tiny_model, tmp_path, calib_file, method,
                                                act_order, sym):
    src = tiny_model("LlamaForCausalLM")
    out = tmp_path / method
    model, quantized = quantize_to_dir(str(src), out, method, 4, GROUP, act_order, sym,
                                       calib_file, num_samples=8, seq_len=64)
    assert len(quantized) == 2 * len(LINEARS)
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    if method == "awq":
        assert qc == {"quant_method": "awq", "bits": 4, "group_size": GROUP,
                      "zero_point": True, "version": "gemm"}
    else:
        assert qc["quant_method"] == "gptq" and qc["checkpoint_format"] == "gptq"
        assert (qc["bits"], qc["group_size"], qc["desc_act"], qc["sym"]) == \
            (4, GROUP, act_order, method == "gptq" and sym)
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    tensors = load_file(str(out / "model.safetensors"))
    decode = _decoded_awq if method == "awq" else _decoded_gptq
    state = model.state_dict()
    for prefix, qt in quantized.items():
        assert f"{prefix}.weight" not in tensors
        assert tensors[f"{prefix}.scales"].dtype == torch.float16
        assert torch.equal(decode(tensors, prefix), state[f"{prefix}.weight"])
        if act_order:
            assert not torch.equal(qt.g_idx, torch.arange(qt.g_idx.numel()) // GROUP)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert torch.equal(tensors[name], state[name])
    transformers.AutoConfig.from_pretrained(out)  # a config transformers reads as its own


def test_awq_refuses_a_symmetric_grid(tiny_model, tmp_path, calib_file):
    with pytest.raises(ValueError, match="zero point"):
        quantize_to_dir(str(tiny_model("LlamaForCausalLM")), tmp_path / "o", "awq",
                        sym=True, group_size=GROUP, calib_data=calib_file)


@pytest.mark.parametrize("method,act_order,sym", [
    ("gptq", True, True), ("gptq", False, False), ("rtn", False, True), ("awq", False, None),
])
def test_round_trip_pagoda_loads_the_in_memory_quantized_model(tiny_model, tmp_path,
                                                                calib_file, method,
                                                                act_order, sym):
    from pagoda import LLM, SamplingParams

    out = tmp_path / method
    model, _ = quantize_to_dir(str(tiny_model("LlamaForCausalLM")), out, method, 4, GROUP,
                               act_order, sym, calib_file, num_samples=8, seq_len=64)
    prompts = random_ids(3, 24)
    expected = torch.log_softmax(hf_logits(model, prompts).float(), dim=-1)
    llm = LLM(str(out), dtype="float32")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts], params,
                        use_tqdm=False)
    for row, out_ in zip(range(prompts.shape[0]), outs):
        for pos in range(1, prompts.shape[1]):
            entry = out_.prompt_logprobs[pos]
            want = expected[row, pos - 1]
            top = torch.topk(want, 5).indices.tolist()
            assert top == [t for t, lp in sorted(entry.items(), key=lambda e: e[1].rank)
                           if lp.rank >= 1][:5]
            for token, lp in entry.items():
                assert lp.logprob == pytest.approx(want[token].item(), abs=1e-4)
        assert out_.outputs[0].token_ids == [int(expected[row, -1].argmax())]


def _hessian_of(layer, layer_runner, hidden, name):
    acc = HessianAccumulator(layer.get_submodule(name).in_features)
    hooks = _capture(layer, (name,), lambda _n, x: acc.add(x))
    layer_runner.run(layer, hidden)
    for h in hooks:
        h.remove()
    return acc.hessian


def _record_hessians(monkeypatch) -> list[torch.Tensor]:
    """Every Hessian GPTQ is given from now on (until `monkeypatch` undoes it), in order."""
    hessians: list[torch.Tensor] = []
    gptq_quantize = runner.gptq_quantize

    def recording(weight, hessian, spec, **kwargs):
        hessians.append(hessian.clone())
        return gptq_quantize(weight, hessian, spec, **kwargs)

    monkeypatch.setattr(runner, "gptq_quantize", recording)
    return hessians


def test_gptq_calibrates_each_sublayer_after_the_ones_before_it(tiny_model, monkeypatch):
    # "True sequential": o_proj's Hessian comes from the layer with q/k/v already quantized,
    # gate/up's with o too, down's with gate/up too.
    path = tiny_model("LlamaForCausalLM")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hidden = model.model.embed_tokens(random_ids(4, 32)).detach()
    layer_runner = LayerRunner(model, hidden, batch_size=3)
    layer = model.model.layers[0]
    float_layer = copy.deepcopy(layer)
    hessians = _record_hessians(monkeypatch)
    result, _ = _gptq_layer(layer, layer_runner, hidden,
                            CalibrationConfig("gptq", QuantSpec(4, GROUP, False)))
    assert len(hessians) == len(SHARED_INPUTS)
    for g, names in enumerate(SHARED_INPUTS):
        replay = copy.deepcopy(float_layer)
        with torch.no_grad():
            for earlier in SHARED_INPUTS[:g]:
                for name in earlier:
                    replay.get_submodule(name).weight.copy_(result[name].dequantize())
        want = _hessian_of(replay, layer_runner, hidden, names[0])
        torch.testing.assert_close(hessians[g], want, rtol=1e-9, atol=1e-12)
        if g:
            floats = _hessian_of(float_layer, layer_runner, hidden, names[0])
            assert not torch.allclose(hessians[g], floats, rtol=1e-6, atol=1e-9)
    for name in LINEARS:
        assert torch.equal(layer.get_submodule(name).weight, result[name].dequantize())


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_staged_layer_is_the_generic_path(tiny_model, monkeypatch, act_order):
    # The one-forward staged path must quantize exactly as the generic one, which re-runs
    # the layer's own forward up to each group's input: the same codes, scales and zeros,
    # and the same output (the quantized layer's own forward).
    path = tiny_model("LlamaForCausalLM")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hidden = model.model.embed_tokens(random_ids(5, 32)).detach()
    layer_runner = LayerRunner(model, hidden, batch_size=2)
    cfg = CalibrationConfig("gptq", QuantSpec(4, GROUP, False, min_zero=1), act_order)
    staged_layer = model.model.layers[0]
    generic_layer = copy.deepcopy(staged_layer)
    staged, staged_out = _gptq_layer(staged_layer, layer_runner, hidden, cfg)
    monkeypatch.setattr(runner, "_STAGED_CHILDREN", set())
    generic, generic_out = _gptq_layer(generic_layer, layer_runner, hidden, cfg)
    assert set(staged) == set(generic) == set(LINEARS)
    for name in LINEARS:
        for field in ("codes", "scales", "zeros", "g_idx"):
            assert torch.equal(getattr(staged[name], field), getattr(generic[name], field))
    assert torch.equal(staged_out, generic_out)
    assert torch.equal(staged_out, layer_runner.run(staged_layer, hidden))


def test_gptq_layer_output_closer_than_rtn(tiny_model):
    path = tiny_model("LlamaForCausalLM")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    width = model.config.hidden_size
    # Correlated hidden states (low rank plus noise), as real activations are.
    hidden = torch.randn(8, 48, 6, generator=g) @ torch.randn(6, width, generator=g) + \
        0.1 * torch.randn(8, 48, width, generator=g)
    layer_runner = LayerRunner(model, hidden, batch_size=4)
    layer = model.model.layers[0]
    spec = QuantSpec(4, GROUP, False)
    reference = layer_runner.run(layer, hidden)
    rtn_layer = copy.deepcopy(layer)
    with torch.no_grad():
        for name in LINEARS:
            weight = rtn_layer.get_submodule(name).weight
            weight.copy_(quantize_rtn(weight, spec).dequantize())
    _gptq_layer(layer, layer_runner, hidden, CalibrationConfig("gptq", spec))

    def error(quantized_layer):
        return (layer_runner.run(quantized_layer, hidden) - reference).pow(2).mean().item()

    assert error(layer) < 0.5 * error(rtn_layer)


def test_gptq_v1_checkpoint_keeps_a_grid_without_negative_weights(tiny_model, tmp_path,
                                                                   calib_file):
    # GPTQ v1 stores zero - 1: an asymmetric grid of zero 0 (a group with no negative weight)
    # would read back as zero 16. The writer gives such a group zero 1 instead.
    tiny = tiny_model("LlamaForCausalLM")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[:, :GROUP].abs_()
    src = tmp_path / "src"
    model.save_pretrained(src)
    for item in tiny.iterdir():
        if not (src / item.name).exists():
            (src / item.name).write_bytes(item.read_bytes())
    prefix = "model.layers.0.mlp.down_proj"
    for method in ("rtn", "gptq"):
        out = tmp_path / method
        model_q, quantized = quantize_to_dir(str(src), out, method, 4, GROUP, False, False,
                                             calib_file, num_samples=8, seq_len=64)
        tensors = load_file(str(out / "model.safetensors"))
        state = model_q.state_dict()
        for name in quantized:
            assert torch.equal(_decoded_gptq(tensors, name), state[f"{name}.weight"])
        assert bool((quantized[prefix].zeros[:, 0] == 1).any())
        if method == "rtn":
            # The refitted grid still spans the group: at most half a step of rounding error.
            qt, w = quantized[prefix], model.model.layers[0].mlp.down_proj.weight[:, :GROUP]
            err = (qt.dequantize()[:, :GROUP] - w).abs()
            assert bool((err <= 0.5 * qt.scales[:, :1] + 1e-6).all())


def _layer_outputs(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Every decoder layer's output in the model's own forward (hooks, not hidden_states,
    whose last entry is the final norm's output)."""
    outputs: list[torch.Tensor] = []

    def keep(_module, _inputs, out):
        outputs.append((out[0] if isinstance(out, tuple) else out).detach())

    hooks = [layer.register_forward_hook(keep) for layer in model.model.layers]
    try:
        hf_logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return outputs


def test_layer_runner_is_the_model_forward(tiny_model):
    # The calibration forward must be the model's own: a wrong causal mask or rotary
    # position would give every Hessian wrong inputs. 5 samples in batches of 2 also runs
    # the remainder batch's mask.
    path = tiny_model("LlamaForCausalLM")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = random_ids(5, 40)
    want = _layer_outputs(model, ids)
    hidden = model.model.embed_tokens(ids).detach()
    layer_runner = LayerRunner(model, hidden, batch_size=2)
    for layer, expected in zip(model.model.layers, want):
        hidden = layer_runner.run(layer, hidden)
        torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)


def test_each_layer_is_calibrated_on_the_quantized_layers_before_it(tiny_model, monkeypatch):
    # Layer 1's first Hessian comes from the hidden states that the *quantized* layer 0
    # produces (GPTQ's standard), not from the float model's.
    path = tiny_model("LlamaForCausalLM")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    float_model = copy.deepcopy(model)
    ids = random_ids(4, 32)
    hessians = _record_hessians(monkeypatch)
    runner.quantize_model(model, ids, CalibrationConfig("gptq", QuantSpec(4, GROUP, False),
                                                        batch_size=3))

    def qkv_hessian(m):
        acc = HessianAccumulator(m.config.hidden_size)
        handle = m.model.layers[1].self_attn.q_proj.register_forward_pre_hook(
            lambda _m, inputs: acc.add(inputs[0].detach()))
        hf_logits(m, ids)
        handle.remove()
        return acc.hessian

    layer1_first = hessians[len(SHARED_INPUTS)]
    torch.testing.assert_close(layer1_first, qkv_hessian(model), rtol=1e-5, atol=1e-8)
    assert not torch.allclose(layer1_first, qkv_hessian(float_model), rtol=1e-4, atol=1e-6)
