"""GGUF checkpoints (llama.cpp's format), architecture "llama" only.

That covers SmolLM2, Llama and Mistral-style files. The file is read once with
`gguf.GGUFReader` (a memory map); the HF config is built from its metadata, the tokenizer by
transformers' GGUF tokenizer converter, and weights are dequantized to float32 one tensor at
a time under their HF names, with llama.cpp's rotary row permutation of q/k undone.
`iter_gguf_raw_tensors` hands out the stored blocks instead (bytes, ggml type, shape), for
a quant method that keeps them.

Llama 3.1/3.2 files store their llama3 rope scaling as the tensor `rope_freqs.weight`:
per-dimension divisors of the rotary inverse frequencies, which llama.cpp applies as such
(no rope scaling keys are written). It becomes `config.rope_freq_factors` (a list of
floats), which the model's rotary embedding applies the same way.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from pagoda.models.loader import Checkpoint, CheckpointError

SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF per-layer tensor stem -> HF module path under model.layers.N.
_LAYER_NAMES: dict[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# NOTE: llama.cpp stores precomputed llama3 rope frequency factors as a tensor; it goes
# into the config (rope_freq_factors), not into a parameter.
ROPE_FREQS = "rope_freqs.weight"
_SKIPPED_TENSORS = frozenset({ROPE_FREQS})
# HF config attribute -> GGUF metadata key; the first three also go into generation_config.
_SPECIAL_TOKEN_KEYS = {
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
    "pad_token_id": "tokenizer.ggml.padding_token_id",
    "unk_token_id": "tokenizer.ggml.unknown_token_id",
}
_GENERATION_TOKEN_NAMES = ("bos_token_id", "eos_token_id", "pad_token_id")
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str) -> str | None:
    """Map a GGUF tensor name to its HF parameter name; None when it has no HF equivalent."""
    if match := _LAYER_RE.fullmatch(gguf_name):
        layer, stem, kind = match.groups()
        module = _LAYER_NAMES.get(stem)
        return None if module is None else f"model.layers.{layer}.{module}.{kind}"
    if match := _GLOBAL_RE.fullmatch(gguf_name):
        module = _GLOBAL_NAMES.get(match.group(1))
        return None if module is None else f"{module}.{match.group(2)}"
    return None


def open_gguf(path: Path) -> GGUFReader:
    """Open and validate a llama GGUF file; CheckpointError if malformed or another architecture.

    Validation covers the header, metadata, tensor table (including tensors that run past the
    end of a truncated file) and that every tensor maps to an HF name.
    """
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # NOTE: GGUFReader raises many types (ValueError, struct, numpy)
        raise CheckpointError(f"{path}: not a readable GGUF file ({exc})") from exc
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    for tensor in reader.tensors:
        if tensor.name not in _SKIPPED_TENSORS and hf_tensor_name(tensor.name) is None:
            raise CheckpointError(f"{path}: GGUF tensor {tensor.name!r} has no HF equivalent")
    return reader


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """The value of metadata `key` (scalar, string or list), or `default` when absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_hf_config(reader: GGUFReader, path: Path) -> transformers.LlamaConfig:
    """Build the HF LlamaConfig that transformers' own GGUF loader would build for this file.

    NOTE: transformers has no fast config path for "llama" and re-parses the whole file with
    GGUFReader (about 2.5 s for SmolLM2); mapping the dozen keys here reuses our reader.
    """

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"llama.{name}", default)

    def required(name: str) -> int:
        if (value := key(name)) is None:
            raise CheckpointError(f"{path}: GGUF metadata lacks required key llama.{name}")
        return int(value)

    hidden_size = required("embedding_length")
    num_heads = required("attention.head_count")
    kwargs: dict[str, Any] = {
        "hidden_size": hidden_size,
        "intermediate_size": required("feed_forward_length"),
        "num_hidden_layers": required("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(key("attention.head_count_kv", num_heads)),
        "max_position_embeddings": required("context_length"),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
    }
    head_dim = key("attention.key_length", key("rope.dimension_count"))
    kwargs["head_dim"] = int(head_dim) if head_dim is not None else hidden_size // num_heads
    shapes = {tensor.name: tensor.shape for tensor in reader.tensors}
    if "token_embd.weight" not in shapes:
        raise CheckpointError(f"{path}: GGUF has no token_embd.weight tensor")
    # NOTE: GGUF dims are innermost-first, so the embedding is [hidden, vocab].
    kwargs["vocab_size"] = int(key("vocab_size", shapes["token_embd.weight"][-1]))
    kwargs["rope_parameters"] = _rope_parameters(reader)
    if (factors := _rope_freq_factors(reader, path, kwargs["head_dim"])) is not None:
        kwargs["rope_freq_factors"] = factors
    # NOTE: llama.cpp writes no output.weight when the LM head shares the embedding matrix.
    kwargs["tie_word_embeddings"] = "output.weight" not in shapes
    for name, gguf_key in _SPECIAL_TOKEN_KEYS.items():
        if (token_id := _field(reader, gguf_key)) is not None:
            kwargs[name] = int(token_id)
    config = transformers.LlamaConfig(**kwargs)
    config.architectures = ["LlamaForCausalLM"]
    return config


def _rope_parameters(reader: GGUFReader) -> dict[str, Any]:
    """HF `rope_parameters` from llama.rope.* metadata (default, linear or yarn scaling)."""
    params: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
    }
    scaling = _field(reader, "llama.rope.scaling.type")
    factor = _field(reader, "llama.rope.scaling.factor")
    if scaling in ("linear", "yarn") and factor:
        params.update(rope_type=scaling, factor=float(factor))
        original = _field(reader, "llama.rope.scaling.original_context_length")
        if scaling == "yarn" and original:
            params["original_max_position_embeddings"] = int(original)
    return params


def _rope_freq_factors(reader: GGUFReader, path: Path, head_dim: int) -> list[float] | None:
    """The file's rope_freqs tensor as floats ([head_dim / 2] divisors), or None."""
    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        return None
    rotary_dim = int(_field(reader, "llama.rope.dimension_count", head_dim))
    factors = _dequantize(tensor, path).reshape(-1)
    if factors.size != rotary_dim // 2:
        raise CheckpointError(
            f"{path}: GGUF tensor {ROPE_FREQS} has {factors.size} values, expected "
            f"{rotary_dim // 2} (half the rotary dimension {rotary_dim})"
        )
    if not np.all(np.isfinite(factors)) or np.any(factors <= 0):
        raise CheckpointError(f"{path}: GGUF tensor {ROPE_FREQS} has non-positive values")
    return [float(f) for f in factors]


def gguf_tokenizer(reader: GGUFReader, path: Path) -> transformers.PreTrainedTokenizerBase:
    """The fast tokenizer (special tokens and chat template included) stored in the GGUF.

    NOTE: AutoTokenizer with gguf_file also rebuilds the model config through the slow
    GGUFReader path (about 3 s); the fast tokenizer class reads only the tokenizer keys.
    """
    try:
        tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    except Exception as exc:  # NOTE: the converter raises KeyError/ValueError on odd metadata
        raise CheckpointError(f"{path}: cannot build a tokenizer from GGUF ({exc})") from exc
    if tokenizer.chat_template is None:
        # NOTE: guard against converter versions that drop the template; serving needs it.
        tokenizer.chat_template = _field(reader, "tokenizer.chat_template")
    return tokenizer


def gguf_generation_config(reader: GGUFReader) -> dict[str, Any]:
    """bos/eos/pad ids from the GGUF; eos becomes [eos, eot] when an end-of-turn id differs."""
    generation_config = {
        name: int(token_id)
        for name in _GENERATION_TOKEN_NAMES
        if (token_id := _field(reader, _SPECIAL_TOKEN_KEYS[name])) is not None
    }
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    eos = generation_config.get("eos_token_id")
    if eot is not None and eos is not None and int(eot) != eos:
        generation_config["eos_token_id"] = [eos, int(eot)]
    return generation_config


@dataclass(frozen=True, slots=True)
class GGUFRawTensor:
    """One GGUF tensor as stored, for a kernel that works on the quantized blocks.

    `data` is the raw bytes (a read-only uint8 view of the memory map), blocks in file
    order; `shape` is the HF (row-major) shape of the dequantized tensor. When
    `rotary_permuted_heads` is set (q_proj / k_proj), the rows are still in llama.cpp's
    rotary order for that many heads (see `unpermute_rotary_rows`).
    """

    name: str
    gguf_name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray
    rotary_permuted_heads: int | None


def iter_gguf_raw_tensors(
    reader: GGUFReader, config: transformers.PretrainedConfig
) -> Iterator[GGUFRawTensor]:
    """Yield each weight tensor of the file undecoded, under its HF name."""
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        heads = None
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = config.num_attention_heads
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = config.num_key_value_heads
        yield GGUFRawTensor(
            name=name,
            gguf_name=tensor.name,
            ggml_type=GGMLQuantizationType(tensor.tensor_type),
            # NOTE: GGUF lists dims innermost-first; HF (row-major) order is the reverse.
            shape=tuple(int(dim) for dim in reversed(tensor.shape)),
            data=np.asarray(tensor.data).reshape(-1).view(np.uint8),
            rotary_permuted_heads=heads,
        )


def dequantize_raw(raw: GGUFRawTensor, path: Path) -> torch.Tensor:
    """The float32 tensor in HF shape and row order (q/k rows un-permuted)."""
    try:
        array = dequantize(raw.data, raw.ggml_type)
    except NotImplementedError as exc:
        raise CheckpointError(
            f"{path}: tensor {raw.gguf_name} has unsupported type {raw.ggml_type.name}"
        ) from exc
    array = np.asarray(array, dtype=np.float32)
    if array.size != int(np.prod(raw.shape)):
        raise CheckpointError(
            f"{path}: tensor {raw.gguf_name} holds {array.size} values, not {raw.shape}"
        )
    array = array.reshape(raw.shape)
    if not array.flags.writeable:  # F32 tensors are read-only views of the memory map
        array = array.copy()
    weight = torch.from_numpy(array)
    if raw.rotary_permuted_heads is not None:
        weight = unpermute_rotary_rows(weight, raw.rotary_permuted_heads)
    return weight


def _dequantize(tensor: Any, path: Path) -> np.ndarray:
    """A reader tensor's values as float32 (any shape)."""
    try:
        return np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    except NotImplementedError as exc:
        raise CheckpointError(
            f"{path}: tensor {tensor.name} has unsupported type {tensor.tensor_type.name}"
        ) from exc


def iter_gguf_weights(
    reader: GGUFReader, config: transformers.PretrainedConfig, path: Path
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor in HF shape) for each GGUF tensor, one at a time.

    q_proj/k_proj rows are put back in HF order (llama.cpp permutes them for its rotary layout).
    """
    for raw in iter_gguf_raw_tensors(reader, config):
        yield raw.name, dequantize_raw(raw, path)


def raw_rows(raw: GGUFRawTensor) -> torch.Tensor:
    """A quantized 2-D tensor's blocks as uint8 [rows, bytes per row], rows in HF order
    (each row's blocks are independent, so q/k rows un-permute as whole rows)."""
    rows = torch.from_numpy(raw.data.copy()).reshape(raw.shape[0], -1)
    if raw.rotary_permuted_heads is not None:
        rows = unpermute_rotary_rows(rows, raw.rotary_permuted_heads)
    return rows.contiguous()


def iter_gguf_weights_keeping_blocks(
    raw_tensors: Iterator[GGUFRawTensor], path: Path, keep: Callable[[str], bool]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Like `iter_gguf_weights`, except that a tensor whose HF name `keep` accepts comes as
    its blocks (`raw_rows`), for a quant method that computes from them."""
    for raw in raw_tensors:
        yield raw.name, raw_rows(raw) if keep(raw.name) else dequantize_raw(raw, path)


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, rows (i, 2) back to (2, i).

    llama.cpp's converter interleaves each head's two rotary halves (HF's rotate_half layout)
    into adjacent pairs (GPT-J layout); this restores the halves. Works for weights and biases.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def load_gguf_checkpoint(path: Path) -> Checkpoint:
    """Load a llama GGUF file: config, tokenizer, generation ids and a lazy weight iterator."""
    reader = open_gguf(path)
    config = gguf_hf_config(reader, path)
    tokenizer = gguf_tokenizer(reader, path)
    return Checkpoint(
        path=path,
        hf_config=config,
        tokenizer=tokenizer,
        generation_config=gguf_generation_config(reader),
        format="gguf",
        open_weights=functools.partial(iter_gguf_weights, reader, config, path),
        open_raw_tensors=functools.partial(iter_gguf_raw_tensors, reader, config),
    )
