"""Weight loading by name: a missing, duplicated, wrong-shaped or unexpected tensor is a
CheckpointError naming it (HF safetensors dirs and GGUF files); state_dict() of a packed
bf16 model is the checkpoint's tensors exactly; .to() converts a packed model; GGUF
hands out its raw quantized blocks."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from safetensors.torch import load_file, save_file

from pagoda.models.factory import build_model
from pagoda.models.gguf import dequantize_raw
from pagoda.models.llama import LlamaForCausalLM
from pagoda.models.loader import CheckpointError, load_checkpoint
from tests.gguf_helpers import write_llama_gguf
from tests.helpers import bf16_packs

ARCH = "LlamaForCausalLM"
CPU = torch.device("cpu")
needs_mkldnn = pytest.mark.skipif(
    not bf16_packs(),
    reason="no oneDNN in this torch, or oneDNN packs no bf16 weight on this CPU (no AVX-512)",
)


def _build(path: Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    return build_model(load_checkpoint(path), dtype, CPU, 64)


def _hf_variant(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of HF dir `src` whose model.safetensors went through `edit`."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _drop(name: str) -> Callable[[dict], None]:
    return lambda tensors: tensors.pop(name)


def _narrow(name: str) -> Callable[[dict], None]:
    """Drop the last 4 columns (numpy arrays for GGUF, tensors for safetensors)."""

    def edit(tensors: dict) -> None:
        cut = tensors[name][..., :-4]
        tensors[name] = np.ascontiguousarray(cut) if isinstance(cut, np.ndarray) else cut.clone()

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_drop("model.layers.1.mlp.up_proj.weight"),
         r"missing tensors 'model\.layers\.1\.mlp\.up_proj\.weight'"),
        (_drop("model.norm.weight"), r"missing tensors 'model\.norm\.weight'"),
        (_narrow("model.layers.0.self_attn.v_proj.weight"),
         r"'model\.layers\.0\.self_attn\.v_proj\.weight'.* has shape \(32, 60\), expected"),
        (_narrow("model.layers.1.post_attention_layernorm.weight"),
         r"'model\.layers\.1\.post_attention_layernorm\.weight'.* has shape \(60,\)"),
        (lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": torch.zeros(2)}),
         r"unexpected tensor 'model\.layers\.0\.mlp\.extra_proj\.weight'"),
    ],
    ids=["missing-part", "missing", "wrong-shape-part", "wrong-shape", "unexpected"],
)
def test_hf_checkpoint_errors_name_the_tensor(
    tiny_model: Callable[..., Path], tmp_path: Path, edit: Callable, message: str
) -> None:
    path = _hf_variant(tiny_model(ARCH), tmp_path / "m", edit)
    with pytest.raises(CheckpointError, match=message) as info:
        _build(path)
    assert str(path) in str(info.value)


def test_hf_tensor_given_twice(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    src = tiny_model(ARCH)
    path = tmp_path / "m"
    shutil.copytree(src, path)
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    name = "model.layers.0.self_attn.k_proj.weight"
    save_file(tensors, path / "a.safetensors", metadata={"format": "pt"})
    save_file({name: tensors[name]}, path / "b.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"'{name}' in {path}.* given twice"):
        _build(path)


def test_unsupported_quantization_is_named(tiny_model: Callable[..., Path], tmp_path) -> None:
    path = tmp_path / "m"
    shutil.copytree(tiny_model(ARCH), path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitnet", "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quantization method 'bitnet' is not supported"):
        _build(path)


# --- GGUF -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def test_gguf_missing_tensor(tiny_model: Callable[..., Path], gguf_dir: Path) -> None:
    path = write_llama_gguf(tiny_model(ARCH), gguf_dir / "missing.gguf",
                            edit=_drop("blk.1.ffn_up.weight"))
    with pytest.raises(CheckpointError, match=r"missing.gguf is missing tensors "
                       r"'model\.layers\.1\.mlp\.up_proj\.weight'"):
        _build(path)


def test_gguf_wrong_shaped_tensor(tiny_model: Callable[..., Path], gguf_dir: Path) -> None:
    path = write_llama_gguf(tiny_model(ARCH), gguf_dir / "shape.gguf",
                            edit=_narrow("blk.0.attn_v.weight"))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.self_attn\.v_proj\.weight' "
                       r"in .*shape.gguf has shape \(32, 60\), expected \(32, 64\)"):
        _build(path)


def test_gguf_duplicated_tensor(tiny_model: Callable[..., Path], gguf_dir: Path) -> None:
    path = write_llama_gguf(tiny_model(ARCH), gguf_dir / "dup.gguf")
    # NOTE: GGUFWriter refuses duplicate names; rename k to q in the header instead (same
    # length, so every offset stays valid).
    data = path.read_bytes()
    assert data.count(b"blk.0.attn_k.weight") == 1
    path.write_bytes(data.replace(b"blk.0.attn_k.weight", b"blk.0.attn_q.weight"))
    with pytest.raises(CheckpointError, match=r"dup.gguf.*duplicated tensor.*blk\.0\.attn_q"):
        load_checkpoint(path)


def test_gguf_raw_blocks_and_their_dequantization(
    tiny_model: Callable[..., Path], gguf_dir: Path
) -> None:
    hf_dir = tiny_model(ARCH)
    path = write_llama_gguf(hf_dir, gguf_dir / "q8.gguf", qtype=GGMLQuantizationType.Q8_0)
    checkpoint = load_checkpoint(path)
    dense = dict(checkpoint.iter_weights())
    raws = {raw.name: raw for raw in checkpoint.iter_raw_tensors()}
    assert raws.keys() == dense.keys()
    hf = load_file(hf_dir / "model.safetensors")
    for name, raw in raws.items():
        expected_type = GGMLQuantizationType.Q8_0 if len(raw.shape) == 2 else (
            GGMLQuantizationType.F32)
        assert raw.ggml_type == expected_type and raw.shape == tuple(hf[name].shape), name
        block, block_bytes = GGML_QUANT_SIZES[raw.ggml_type]
        assert raw.data.dtype == np.uint8
        assert raw.data.nbytes == hf[name].numel() // block * block_bytes, name
        assert torch.equal(dequantize_raw(raw, path), dense[name]), name
        # Q8_0 keeps about 8 bits; the rows are back in HF order (q/k un-permuted)
        torch.testing.assert_close(dense[name], hf[name], rtol=0, atol=0.02, msg=name)
    q = raws["model.layers.0.self_attn.q_proj.weight"]
    assert q.rotary_permuted_heads == 4 and raws["model.norm.weight"].rotary_permuted_heads is None


def test_safetensors_have_no_raw_blocks(tiny_model: Callable[..., Path]) -> None:
    with pytest.raises(CheckpointError, match="stores no quantized blocks"):
        load_checkpoint(tiny_model(ARCH)).iter_raw_tensors()


# --- state_dict and .to() after packing ----------------------------------------------


def _expected_state(path: Path, names: Iterator[str]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the model's parameter names (packed parts concatenated
    in packed_modules_mapping order; a tied head is the embedding)."""
    ckpt = dict(load_checkpoint(path).iter_weights())
    mapping = LlamaForCausalLM.packed_modules_mapping
    expected = {}
    for name in names:
        module, _, leaf = name.rpartition(".")
        parent, _, child = module.rpartition(".")
        if child in mapping:
            expected[name] = torch.cat([ckpt[f"{parent}.{p}.{leaf}"] for p in mapping[child]])
        else:
            expected[name] = ckpt.get(name, ckpt["model.embed_tokens.weight"])
    return expected


def _assert_state_equals(model: torch.nn.Module, expected: dict, dtype: torch.dtype) -> None:
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in state.items():
        assert tensor.layout == torch.strided and tensor.device.type == "cpu", name
        assert tensor.dtype == dtype, name
        assert torch.equal(tensor, expected[name].to(dtype)), name


@needs_mkldnn
@pytest.mark.parametrize("tied", [False, True])
def test_state_dict_of_a_packed_bf16_model_is_the_checkpoint(
    tiny_model: Callable[..., Path], tied: bool
) -> None:
    path = tiny_model(ARCH, dtype=torch.bfloat16, tie_word_embeddings=tied)
    model = _build(path, torch.bfloat16)
    packed = [n for n, p in model.named_parameters() if p.is_mkldnn]
    assert "model.layers.0.self_attn.qkv_proj.weight" in packed
    assert ("lm_head.weight" in packed) is not tied  # a tied head keeps the dense table
    expected = _expected_state(path, model.state_dict().keys())
    assert ("lm_head.weight" in expected) and "model.layers.1.mlp.gate_up_proj.weight" in expected
    _assert_state_equals(model, expected, torch.bfloat16)

    # state_dict() loads back by name (packed names take the whole packed tensor)
    with torch.device("cpu"):
        fresh = LlamaForCausalLM(model.hf_config).to(torch.bfloat16)
    fresh.load_weights(model.state_dict().items())
    _assert_state_equals(fresh, expected, torch.bfloat16)


@needs_mkldnn
def test_to_float32_and_back_gives_a_working_model(tiny_model: Callable[..., Path]) -> None:
    path = tiny_model(ARCH, dtype=torch.bfloat16)
    model = _build(path, torch.bfloat16)
    expected = _expected_state(path, model.state_dict().keys())
    hidden = torch.randn(3, 64)

    model.to(torch.float32)
    assert not any(p.is_mkldnn for p in model.parameters())
    _assert_state_equals(model, expected, torch.float32)
    assert model.rotary.cos.dtype == torch.float32
    lm_head = expected["lm_head.weight"].float()
    assert torch.equal(model.compute_logits(hidden), F.linear(hidden, lm_head))
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 64)
    gate_up = expected["model.layers.0.mlp.gate_up_proj.weight"].float()
    assert torch.equal(mlp.gate_up_proj(x), F.linear(x, gate_up))

    model.to(torch.bfloat16).to("cpu")
    assert model.model.layers[1].self_attn.qkv_proj.weight.is_mkldnn  # repacked
    _assert_state_equals(model, expected, torch.bfloat16)
    hb = hidden.bfloat16()
    assert torch.equal(model.compute_logits(hb), F.linear(hb, expected["lm_head.weight"]))
