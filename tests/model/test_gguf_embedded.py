"""The embedded SmolLM2-135M-Instruct Q4_1 GGUF: config, tokenizer and weights against
transformers' own GGUF loading as the oracle; its raw Q4_1 blocks as handed out."""

from __future__ import annotations

from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagoda.models.gguf import dequantize_raw
from pagoda.models.loader import Checkpoint, default_model_path, load_checkpoint

# NOTE: first, second and last layers: the permutation and the mapping hold layer by layer.
CHECKED_LAYERS = (0, 1, 29)


@pytest.fixture(scope="module")
def checkpoint() -> Checkpoint:
    """The embedded checkpoint, loaded without transformers' slow path (its GGUF loader
    reading every tensor), which a timing budget used to catch and a loaded machine broke."""
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    tensor_loads = []
    load = hf_gguf.load_gguf_checkpoint

    def spy(path, return_tensors=False, **kwargs):
        tensor_loads.append(return_tensors)
        return load(path, return_tensors=return_tensors, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(hf_gguf, "load_gguf_checkpoint", spy)
        loaded = load_checkpoint(None)
        list(islice(loaded.iter_weights(), 1))
    assert True not in tensor_loads
    return loaded


@pytest.fixture(scope="module")
def oracle_state_dict() -> dict[str, torch.Tensor]:
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.state_dict()


def test_config(checkpoint: Checkpoint) -> None:
    config = checkpoint.hf_config
    assert checkpoint.format == "gguf"
    assert checkpoint.path == default_model_path()
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        30,
        576,
        1536,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152 and config.max_position_embeddings == 8192
    assert config.tie_word_embeddings is True
    assert config.rope_parameters["rope_theta"] == 100000.0
    assert config.rms_norm_eps == pytest.approx(1e-5)


def test_config_matches_transformers(checkpoint: Checkpoint) -> None:
    path = default_model_path()
    ref = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    ours = checkpoint.hf_config.to_dict()
    ignored = {"_name_or_path", "_model_name_or_path", "architectures"}
    assert {k: v for k, v in ours.items() if k not in ignored} == {
        k: v for k, v in ref.items() if k not in ignored
    }


def test_tokenizer(checkpoint: Checkpoint) -> None:
    tokenizer = checkpoint.tokenizer
    assert tokenizer.is_fast and len(tokenizer) == 49152
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert checkpoint.generation_config == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    # NOTE: add_bos_token is false in this file; the chat template writes <|im_start|> itself.
    assert tokenizer("hello world").input_ids == [28120, 905]


def test_tokenizer_matches_transformers(checkpoint: Checkpoint, smollm2_hf_tokenizer) -> None:
    ref = smollm2_hf_tokenizer
    assert checkpoint.tokenizer.chat_template == ref.chat_template
    for text in ["Hello, world!", " 12345 émoji 🙂\n\ttabs", "<|im_start|>user\nhi<|im_end|>"]:
        assert checkpoint.tokenizer(text).input_ids == ref(text).input_ids


def test_weights_match_transformers(
    checkpoint: Checkpoint, oracle_state_dict: dict[str, torch.Tensor]
) -> None:
    # NOTE: tied embeddings: the file has no output.weight, so no lm_head comes out.
    expected_names = set(oracle_state_dict) - {"lm_head.weight"}
    checked = ("model.embed_tokens.", "model.norm.") + tuple(
        f"model.layers.{i}." for i in CHECKED_LAYERS
    )
    seen = set()
    for name, tensor in checkpoint.iter_weights():
        seen.add(name)
        ref = oracle_state_dict[name]
        assert tensor.dtype == torch.float32 and tensor.shape == ref.shape, name
        if name.startswith(checked):
            torch.testing.assert_close(tensor, ref, rtol=0, atol=1e-6, msg=name)
    assert seen == expected_names


def test_directory_with_one_gguf(tmp_path: Path) -> None:
    link = tmp_path / "model.gguf"
    link.symlink_to(default_model_path())
    loaded = load_checkpoint(tmp_path)
    assert loaded.path == link and loaded.hf_config.num_hidden_layers == 30


def test_raw_q4_1_blocks_dequantize_to_the_weights(checkpoint: Checkpoint) -> None:
    raws = {raw.name: raw for raw in checkpoint.iter_raw_tensors()}
    dense = {n: t for n, t in checkpoint.iter_weights() if n.startswith("model.layers.1.")}
    q = raws["model.layers.1.self_attn.q_proj.weight"]
    assert q.gguf_name == "blk.1.attn_q.weight" and q.shape == (576, 576)
    assert q.ggml_type == GGMLQuantizationType.Q4_1 and q.rotary_permuted_heads == 9
    block, block_bytes = GGML_QUANT_SIZES[q.ggml_type]
    assert q.data.dtype == np.uint8 and q.data.nbytes == 576 * 576 // block * block_bytes
    for name, tensor in dense.items():
        assert torch.equal(dequantize_raw(raws[name], checkpoint.path), tensor), name
