"""GPTQ and AWQ checkpoints built by the formats' packing rules from a tiny random llama:
they load, and float32 greedy output equals transformers holding the reference-dequantized
weights, token for token; malformed ones fail with an error naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda.models.factory import build_model
from pagoda.models.loader import CheckpointError, load_checkpoint
from pagoda.quant import packing
from tests.quant_helpers import (
    assert_greedy_matches,
    dequantize_groups,
    group_assignment,
    rtn_groups,
    write_quantized,
)

# Layers that read the same input get the same act_order (GPTQ orders by that input's
# Hessian), hence the same g_idx.
SHARED_INPUT = {"lm_head": 5, "q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 3,
                "up_proj": 3, "down_proj": 4}


def gptq_quantizer(bits: int, group_size: int, sym: bool, act_order: bool, v2: bool = False):
    def quantize(name: str, w: torch.Tensor):
        k = w.shape[1]
        gs = k if group_size == -1 else group_size
        group_of = group_assignment(k, gs, act_order, seed=SHARED_INPUT[name.split(".")[-2]])
        codes, scales, zeros = rtn_groups(w, bits, group_of, k // gs, sym)
        qweight, qzeros = packing.pack_gptq(codes.T, zeros.T, bits)
        if v2:
            qzeros = packing.pack_int32(zeros.T, bits, dim=1)
        parts = {"qweight": qweight, "qzeros": qzeros, "scales": scales.T,
                 "g_idx": group_of.to(torch.int32)}
        return parts, dequantize_groups(codes, scales, zeros, group_of)

    return quantize


def gptq_config(bits: int, group_size: int, sym: bool, act_order: bool, fmt: str = "gptq"):
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size,
            "desc_act": act_order, "sym": sym, "checkpoint_format": fmt, "lm_head": False}


def awq_quantizer(group_size: int, zero_point: bool):
    def quantize(name: str, w: torch.Tensor):
        k = w.shape[1]
        group_of = torch.arange(k) // group_size
        codes, scales, zeros = rtn_groups(w, 4, group_of, k // group_size, sym=not zero_point)
        qweight, qzeros = packing.pack_awq(codes.T, zeros.T)
        parts = {"qweight": qweight, "qzeros": qzeros, "scales": scales.T}
        return parts, dequantize_groups(codes, scales, zeros, group_of)

    return quantize


@pytest.fixture(scope="module")
def dense_dir(tiny_model) -> Path:
    return tiny_model("LlamaForCausalLM")


GPTQ_CASES = [
    # bits, group_size, sym, act_order
    (4, 64, True, False),
    (4, 32, False, True),
    (4, -1, False, False),
    (8, 32, True, True),
    (8, -1, False, False),
    (8, 64, False, False),
]


@pytest.mark.parametrize(("bits", "group_size", "sym", "act_order"), GPTQ_CASES)
def test_gptq_greedy_matches_dequantized_hf(dense_dir, tmp_path, bits, group_size, sym,
                                            act_order):
    q_dir, d_dir = write_quantized(
        dense_dir, tmp_path, gptq_config(bits, group_size, sym, act_order),
        gptq_quantizer(bits, group_size, sym, act_order),
    )
    assert_greedy_matches(q_dir, d_dir)


def test_gptq_v2_zeros_stored_without_the_offset(dense_dir, tmp_path):
    q_dir, d_dir = write_quantized(
        dense_dir, tmp_path, gptq_config(4, 32, False, False, fmt="gptq_v2"),
        gptq_quantizer(4, 32, False, False, v2=True),
    )
    assert_greedy_matches(q_dir, d_dir)


@pytest.mark.parametrize(("group_size", "zero_point"), [(32, True), (64, False)])
def test_awq_greedy_matches_dequantized_hf(dense_dir, tmp_path, group_size, zero_point):
    config = {"quant_method": "awq", "bits": 4, "group_size": group_size,
              "zero_point": zero_point, "version": "gemm"}
    q_dir, d_dir = write_quantized(dense_dir, tmp_path, config,
                                   awq_quantizer(group_size, zero_point))
    assert_greedy_matches(q_dir, d_dir)


def test_gptq_lm_head_true_quantizes_the_head(dense_dir, tmp_path):
    config = {**gptq_config(4, 32, False, False), "lm_head": True}
    q_dir, d_dir = write_quantized(dense_dir, tmp_path, config,
                                   gptq_quantizer(4, 32, False, False), quantize_head=True)
    assert_greedy_matches(q_dir, d_dir)
    model = _load(q_dir)
    assert type(model.lm_head.quant_method).__name__ == "GPTQLinearMethod"
    state = model.state_dict()
    assert state["lm_head.qweight"].shape == (8, 49152)
    assert state["lm_head.qzeros"].shape == (2, 49152 // 8)


def test_quantized_layers_hold_group_weights_and_the_head_stays_dense(dense_dir, tmp_path):
    q_dir, _ = write_quantized(dense_dir, tmp_path, gptq_config(4, 64, True, False),
                               gptq_quantizer(4, 64, True, False))
    model = build_model(load_checkpoint(q_dir), torch.float32, torch.device("cpu"), 64)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert type(qkv.quant_method).__name__ == "GPTQLinearMethod"
    assert qkv.quant_weight.qweight.shape == (128, 64) and qkv.quant_weight.bits == 4
    # The codes are held once, packed: the parameter is the weight object's panel bytes
    # (half a byte a code), and its scales are the loaded [G, N] parameter itself.
    codes = qkv.quant_weight.layout.codes
    assert qkv.qweight.data_ptr() == codes.data_ptr() and codes.numel() == 128 * 64 // 2
    assert qkv.quant_weight.layout.scales.data_ptr() == qkv.scales.data_ptr()
    assert type(model.lm_head.quant_method).__name__ == "UnquantizedLinearMethod"


CODES = {"gptq": ("qweight", 1), "awq": ("qweight", 1), "ct": ("weight_packed", 0)}


@pytest.mark.parametrize("fmt", list(CODES))
def test_state_dict_and_to_give_back_the_checkpoint_tensors(dense_dir, tmp_path, fmt):
    from tests.unit.test_quant_compressed_tensors import ct_config, ct_quantizer

    config, quantizer = {
        "gptq": (gptq_config(4, 32, False, True), gptq_quantizer(4, 32, False, True)),
        "awq": ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"},
                awq_quantizer(32, True)),
        "ct": (ct_config(4, 32, False, actorder=True), ct_quantizer(4, 32, False, True)),
    }[fmt]
    q_dir, _ = write_quantized(dense_dir, tmp_path, config, quantizer)
    written = load_file(q_dir / "model.safetensors")
    model = _load(q_dir)
    codes, out_dim = CODES[fmt]
    layer = "model.layers.1.self_attn"
    qkv_words = torch.cat([written[f"{layer}.{p}_proj.{codes}"] for p in "qkv"], dim=out_dim)
    x = torch.randn(3, 64)
    before = model.model.layers[1].self_attn.qkv_proj(x)
    for _ in range(2):  # after loading, then after .to()
        state = model.state_dict()
        assert torch.equal(state[f"{layer}.qkv_proj.{codes}"], qkv_words)
        assert torch.equal(state[f"{layer}.o_proj.{codes}"], written[f"{layer}.o_proj.{codes}"])
        model.to("cpu")
    qkv = model.model.layers[1].self_attn.qkv_proj
    assert getattr(qkv, codes).dtype == torch.uint8
    torch.testing.assert_close(qkv(x), before, rtol=0, atol=0)


# --- errors --------------------------------------------------------------------------------


def _load(path: Path):
    return build_model(load_checkpoint(path), torch.float32, torch.device("cpu"), 64)


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture
def gptq_dir(dense_dir, tmp_path) -> Path:
    q_dir, _ = write_quantized(dense_dir, tmp_path, gptq_config(4, 32, True, False),
                               gptq_quantizer(4, 32, True, False))
    return q_dir


def test_unsupported_bits_is_refused(gptq_dir):
    _edit_config(gptq_dir, bits=3)
    with pytest.raises(CheckpointError, match=r"bits must be one of \(2, 4, 8\), got 3"):
        _load(gptq_dir)


def test_unregistered_method_is_refused(gptq_dir):
    _edit_config(gptq_dir, quant_method="marlin-sparse")
    with pytest.raises(CheckpointError, match="'marlin-sparse' is not supported"):
        _load(gptq_dir)


def test_group_size_that_does_not_divide_k_is_refused(gptq_dir):
    _edit_config(gptq_dir, group_size=48)
    with pytest.raises(ValueError, match="qkv_proj: group_size 48 does not divide 64"):
        _load(gptq_dir)


def test_wrong_shaped_qweight_is_refused(gptq_dir):
    key = "model.layers.0.self_attn.k_proj.qweight"
    _edit_tensors(gptq_dir, lambda t: t.update({key: t[key][:, :-1].contiguous()}))
    with pytest.raises(CheckpointError, match=f"tensor '{key}'.*has shape"):
        _load(gptq_dir)


@pytest.mark.parametrize("part", ["g_idx", "scales"])
def test_missing_g_idx_or_scales_is_refused(gptq_dir, part):
    key = f"model.layers.1.mlp.up_proj.{part}"
    _edit_tensors(gptq_dir, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=f"missing tensors '{key}'"):
        _load(gptq_dir)


def test_packed_shards_with_different_g_idx_are_refused(dense_dir, tmp_path):
    q_dir, _ = write_quantized(dense_dir, tmp_path, gptq_config(4, 32, True, True),
                               gptq_quantizer(4, 32, True, True))
    key = "model.layers.0.self_attn.k_proj.g_idx"
    _edit_tensors(q_dir, lambda t: t.update({key: t[key].flip(0).contiguous()}))
    shard = r"self_attn\.[qkv]_proj\.g_idx'"
    with pytest.raises(CheckpointError, match=shard + ".*differs from the other"):
        _load(q_dir)


def test_awq_other_versions_are_refused(dense_dir, tmp_path):
    config = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
              "version": "gemv"}
    q_dir, _ = write_quantized(dense_dir, tmp_path, config, awq_quantizer(32, True))
    with pytest.raises(CheckpointError, match="version 'gemv' is not supported"):
        _load(q_dir)


def test_awq_modules_to_not_convert_stay_dense(dense_dir, tmp_path):
    config = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
              "version": "gemm", "modules_to_not_convert": ["down_proj"]}
    q_dir, d_dir = write_quantized(dense_dir, tmp_path, config, awq_quantizer(32, True),
                                   skip=lambda name: "down_proj" in name)
    assert_greedy_matches(q_dir, d_dir)
    mlp = _load(q_dir).model.layers[0].mlp
    assert type(mlp.down_proj.quant_method).__name__ == "UnquantizedLinearMethod"
    assert type(mlp.gate_up_proj.quant_method).__name__ == "AWQLinearMethod"
    config["modules_to_not_convert"] = ["k_proj"]
    _edit_config(q_dir, **config)
    with pytest.raises(ValueError, match="qkv_proj: modules_to_not_convert keeps only some"):
        _load(q_dir)
