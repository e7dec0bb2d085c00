"""compressed-tensors pack-quantized (W4A16 / W8A16) checkpoints built by llm-compressor's
packing rules from a tiny random llama: float32 greedy output equals transformers holding the
reference-dequantized weights; targets / ignore pick the layers; bad schemes are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagoda.models.factory import build_model
from pagoda.models.loader import load_checkpoint
from pagoda.quant import packing
from tests.quant_helpers import (
    assert_greedy_matches,
    dequantize_groups,
    group_assignment,
    rtn_groups,
    write_quantized,
)


def ct_quantizer(bits: int, group_size: int, symmetric: bool, actorder: bool = False):
    def quantize(name: str, w: torch.Tensor):
        n, k = w.shape
        gs = k if group_size == -1 else group_size
        # NOTE: layers reading the same input share their activation order.
        seed = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "gate_proj": 2, "up_proj": 2}
        group_of = group_assignment(k, gs, actorder, seed.get(name.split(".")[-2], 3))
        codes, scales, zeros = rtn_groups(w, bits, group_of, k // gs, sym=symmetric)
        # The packed codes are the signed values + 2**(bits-1): exactly the unsigned codes.
        parts = {"weight_packed": packing.pack_int32(codes, bits, dim=1),
                 "weight_scale": scales.to(torch.bfloat16),
                 "weight_shape": torch.tensor([n, k])}
        if not symmetric:
            parts["weight_zero_point"] = packing.pack_int32(zeros, bits, dim=0)
        if actorder:
            parts["weight_g_idx"] = group_of.to(torch.int32)
        deq = dequantize_groups(codes, scales.to(torch.bfloat16), zeros, group_of)
        return parts, deq

    return quantize


def ct_config(bits: int, group_size: int, symmetric: bool, actorder: bool = False,
              targets=("Linear",), ignore=("lm_head",)):
    strategy = "channel" if group_size == -1 else "group"
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": list(targets), "input_activations": None, "output_activations": None,
            "weights": {"num_bits": bits, "type": "int", "symmetric": symmetric,
                        "strategy": strategy,
                        "group_size": None if group_size == -1 else group_size,
                        "actorder": "group" if actorder else None, "dynamic": False},
        }},
        "ignore": list(ignore),
    }


@pytest.fixture(scope="module")
def dense_dir(tiny_model) -> Path:
    return tiny_model("LlamaForCausalLM")


@pytest.mark.parametrize(("bits", "group_size", "symmetric", "actorder"), [
    (4, 32, True, False),
    (4, 64, False, False),
    (8, -1, True, False),
    (4, 32, False, True),
])
def test_pack_quantized_greedy_matches_dequantized_hf(dense_dir, tmp_path, bits, group_size,
                                                      symmetric, actorder):
    q_dir, d_dir = write_quantized(
        dense_dir, tmp_path, ct_config(bits, group_size, symmetric, actorder),
        ct_quantizer(bits, group_size, symmetric, actorder),
    )
    assert_greedy_matches(q_dir, d_dir)


def test_targets_and_ignore_choose_the_layers(dense_dir, tmp_path):
    config = ct_config(4, 32, True, targets=("re:.*mlp\\..*_proj$", "re:.*self_attn\\..*"),
                       ignore=("lm_head", "re:.*down_proj$"))
    q_dir, d_dir = write_quantized(dense_dir, tmp_path, config, ct_quantizer(4, 32, True),
                                   skip=lambda name: "down_proj" in name)
    assert_greedy_matches(q_dir, d_dir)
    model = build_model(load_checkpoint(q_dir), torch.float32, torch.device("cpu"), 64)
    mlp = model.model.layers[0].mlp
    assert type(mlp.gate_up_proj.quant_method).__name__ == "CTPackedLinearMethod"
    assert type(mlp.down_proj.quant_method).__name__ == "UnquantizedLinearMethod"


def _load(path: Path):
    return build_model(load_checkpoint(path), torch.float32, torch.device("cpu"), 64)


def test_a_packed_layer_with_parts_in_different_schemes_is_refused(dense_dir, tmp_path):
    config = ct_config(4, 32, True, ignore=("lm_head", "re:.*k_proj$"))
    q_dir, _ = write_quantized(dense_dir, tmp_path, config, ct_quantizer(4, 32, True))
    with pytest.raises(ValueError, match="qkv_proj: compressed-tensors schemes differ"):
        _load(q_dir)


def test_unsupported_schemes_are_refused(dense_dir, tmp_path):
    config = ct_config(4, 32, True)
    config["config_groups"]["group_0"]["weights"]["type"] = "float"
    q_dir, _ = write_quantized(dense_dir, tmp_path, config, ct_quantizer(4, 32, True))
    with pytest.raises(ValueError, match="weights of type 'float' are not supported"):
        _load(q_dir)


def test_a_quantized_lm_head_is_loaded_quantized(dense_dir, tmp_path):
    q_dir, d_dir = write_quantized(dense_dir, tmp_path, ct_config(4, 32, False, ignore=()),
                                   ct_quantizer(4, 32, False), quantize_head=True)
    assert_greedy_matches(q_dir, d_dir)
    model = _load(q_dir)
    assert type(model.lm_head.quant_method).__name__ == "CTPackedLinearMethod"
    assert model.state_dict()["lm_head.weight_packed"].shape == (49152, 8)
    assert model.lm_head.quant_weight.qweight.shape == (49152, 64)
