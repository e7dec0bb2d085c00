"""int8 (weight-only and W8A8) and fp8 (checkpoints per tensor, per channel, per block; and
quantized at load): float32 greedy output equals transformers holding the same weights
(W8A8: and the same per-token activation quantization), token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from pagoda import LLM, SamplingParams
from pagoda.models.factory import build_model
from pagoda.models.loader import CheckpointError, load_checkpoint
from pagoda.ops import wquant
from pagoda.quant.fp8 import FP8_MAX, quantize_fp8_per_channel
from pagoda.quant.int8 import quantize_per_channel
from tests.quant_helpers import (
    LINEAR_NAMES,
    assert_greedy_matches,
    hf_greedy,
    pagoda_greedy,
    random_prompts,
    write_quantized,
)


@pytest.fixture(scope="module")
def dense_dir(tiny_model) -> Path:
    return tiny_model("LlamaForCausalLM")


def _int8_parts(name: str, w: torch.Tensor):
    codes, scales = quantize_per_channel(w)
    return {"weight": codes, "weight_scale": scales}, codes.float() * scales


def test_quantize_per_channel_round_trips_within_half_a_step():
    w = torch.randn(16, 64)
    codes, scales = quantize_per_channel(w)
    assert codes.dtype == torch.int8 and scales.shape == (16, 1)
    assert ((codes.float() * scales - w).abs() <= scales / 2 + 1e-7).all()
    q, s = quantize_fp8_per_channel(w)
    assert q.dtype == torch.float8_e4m3fn and (q.float().abs().amax(dim=1) == FP8_MAX).all()
    # e4m3 keeps 3 mantissa bits: relative error at most 2**-4.
    assert ((q.float() * s[:, None] - w).abs() <= w.abs() / 16 + s[:, None] * 2**-9).all()


def test_int8_weight_only_at_load_matches_hf(dense_dir, tmp_path):
    _, d_dir = write_quantized(dense_dir, tmp_path, {}, _int8_parts)
    assert_greedy_matches(dense_dir, d_dir, quantization="int8_wo")


def _hf_with_int8_activations(model: nn.Module) -> None:
    """Every quantized linear of transformers' model runs int8_linear's reference: per-token
    int8 activations times its per-channel int8 weight."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.split(".")[-1] in LINEAR_NAMES:
            codes, scales = quantize_per_channel(module.weight.data)
            weight = wquant.Int8Weight(codes, scales.reshape(-1))
            module.forward = lambda x, w=weight: wquant.int8_linear_reference(x, w)


def test_int8_w8a8_at_load_matches_hf_with_the_same_activation_quantization(
    dense_dir, monkeypatch
):
    import transformers

    load = transformers.AutoModelForCausalLM.from_pretrained

    def patched(*args, **kwargs):
        model = load(*args, **kwargs)
        _hf_with_int8_activations(model)
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", patched)
    prompts = random_prompts(3, seed=7)
    expected = hf_greedy(dense_dir, prompts)
    outs = pagoda_greedy(dense_dir, prompts, quantization="int8")
    assert [o.outputs[0].token_ids for o in outs] == [ids for ids, _ in expected]


def test_int8_state_dict_is_a_compressed_tensors_w8a8_checkpoint(dense_dir, tmp_path):
    """The at-load model's state_dict, saved under compressed-tensors' W8A8 config, loads
    back to the same weights."""
    model = build_model(load_checkpoint(dense_dir), torch.float32, torch.device("cpu"), 64,
                        quantization="int8")
    down = model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == torch.int8 and down.weight_scale.shape == (64, 1)
    q_dir, _ = write_quantized(dense_dir, tmp_path, _w8a8_config(), _int8_parts)
    loaded = build_model(load_checkpoint(q_dir), torch.float32, torch.device("cpu"), 64)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    assert type(loaded.model.layers[1].self_attn.qkv_proj.quant_method).__name__ == \
        "Int8LinearMethod"


def _w8a8_config():
    return {
        "quant_method": "compressed-tensors", "format": "int-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                  "strategy": "token", "dynamic": True},
        }},
        "ignore": ["lm_head"],
    }


def test_int8_names_are_not_checkpoint_formats(dense_dir, tmp_path):
    q_dir, _ = write_quantized(dense_dir, tmp_path, {"quant_method": "int8"}, _int8_parts)
    with pytest.raises(CheckpointError, match="'int8' is not a checkpoint format"):
        build_model(load_checkpoint(q_dir), torch.float32, torch.device("cpu"), 64)


# --- fp8 -----------------------------------------------------------------------------------


def fp8_quantizer(kind: str, block: tuple[int, int] = (16, 32)):
    def quantize(name: str, w: torch.Tensor):
        if kind == "block":
            bn, bk = block
            n, k = w.shape
            tiles = w.reshape(n // bn, bn, k // bk, bk)
            s = tiles.abs().amax(dim=(1, 3)) / FP8_MAX
            q = (tiles / s[:, None, :, None]).to(torch.float8_e4m3fn).reshape(n, k)
            full = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
            return {"weight": q, "weight_scale_inv": s}, q.float() * full
        if kind == "tensor":
            s = w.abs().amax() / FP8_MAX
            q = (w / s).to(torch.float8_e4m3fn)
            return ({"weight": q, "weight_scale": s, "input_scale": torch.tensor(0.5)},
                    q.float() * s)
        q, s = quantize_fp8_per_channel(w)
        return {"weight": q, "weight_scale": s[:, None]}, q.float() * s[:, None]

    return quantize


@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
def test_fp8_checkpoint_matches_dequantized_hf(dense_dir, tmp_path, kind):
    config = {"quant_method": "fp8", "activation_scheme": "static" if kind == "tensor"
              else "dynamic", "weight_block_size": [16, 32] if kind == "block" else None}
    q_dir, d_dir = write_quantized(dense_dir, tmp_path, config, fp8_quantizer(kind))
    assert_greedy_matches(q_dir, d_dir)


def test_fp8_at_load_matches_hf_on_its_dequantized_weights(dense_dir, tmp_path):
    _, d_dir = write_quantized(dense_dir, tmp_path, {}, fp8_quantizer("channel"))
    assert_greedy_matches(dense_dir, d_dir, quantization="fp8")


def test_fp8_block_not_dividing_a_shard_is_refused(dense_dir, tmp_path):
    config = {"quant_method": "fp8", "weight_block_size": [48, 32]}
    q_dir, _ = write_quantized(dense_dir, tmp_path, config, fp8_quantizer("block"))
    with pytest.raises(ValueError, match="not a multiple of the fp8 block 48"):
        build_model(load_checkpoint(q_dir), torch.float32, torch.device("cpu"), 64)


def test_quantization_that_contradicts_the_checkpoint_is_refused(dense_dir, tmp_path):
    q_dir, _ = write_quantized(dense_dir, tmp_path, {"quant_method": "fp8"},
                               fp8_quantizer("channel"))
    with pytest.raises(CheckpointError, match="'int8' was asked for.*quantized with 'fp8'"):
        build_model(load_checkpoint(q_dir), torch.float32, torch.device("cpu"), 64,
                    quantization="int8")
    with pytest.raises(CheckpointError, match="'gptq' needs a checkpoint quantized with it"):
        build_model(load_checkpoint(dense_dir), torch.float32, torch.device("cpu"), 64,
                    quantization="gptq")


def test_fp8_tensors_keep_their_scales_through_to(dense_dir, tmp_path):
    """.to() rebuilds the weight object from the loaded tensors (no dense copy needed)."""
    q_dir, _ = write_quantized(dense_dir, tmp_path,
                               {"quant_method": "fp8", "activation_scheme": "static"},
                               fp8_quantizer("tensor"))
    model = build_model(load_checkpoint(q_dir), torch.float32, torch.device("cpu"), 64)
    qkv = model.model.layers[0].self_attn.qkv_proj
    x = torch.randn(3, 64)
    before = qkv(x)
    qkv.to("cpu")
    torch.testing.assert_close(qkv(x), before, rtol=0, atol=0)
    written = load_file(q_dir / "model.safetensors")
    k_scale = written["model.layers.0.self_attn.k_proj.weight_scale"]
    assert torch.equal(qkv.weight_scale[64:96], k_scale.expand(32))
    assert qkv.input_scale.item() == 0.5


@pytest.mark.parametrize("quantization", ["int8", "int8_wo", "fp8"])
def test_bfloat16_models_run_every_method(dense_dir, quantization):
    """In bfloat16 (the CPU default) the methods take bf16 activations; the first greedy
    token (far from a tie in this model) is float32's."""
    firsts = []
    for dtype in ("bfloat16", "float32"):
        llm = LLM(str(dense_dir), dtype=dtype, quantization=quantization)
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        firsts.append(llm.generate([[42, 4242, 17, 900]], params, use_tqdm=False)[0]
                      .outputs[0].token_ids[0])
    assert firsts[0] == firsts[1]
