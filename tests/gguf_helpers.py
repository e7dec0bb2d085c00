"""Writing a tiny HF Llama checkpoint as a GGUF file, the way llama.cpp's converter does:
llama.* metadata, the embedded SmolLM2 tokenizer's keys, q/k rows permuted into
llama.cpp's rotary order and, for llama3 rope scaling, the `rope_freqs.weight` factors."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import transformers
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file

from pagoda.models.gguf import _GLOBAL_NAMES, _LAYER_NAMES
from pagoda.models.loader import default_model_path

_HF_TO_GGUF = {hf: gguf for gguf, hf in _GLOBAL_NAMES.items()}
_HF_LAYER_TO_GGUF = {hf: gguf for gguf, hf in _LAYER_NAMES.items()}


def gguf_name(hf_name: str) -> str:
    """HF parameter name -> GGUF tensor name (the inverse of pagoda's mapping)."""
    module, _, kind = hf_name.rpartition(".")
    if module.startswith("model.layers."):
        layer, _, rest = module.removeprefix("model.layers.").partition(".")
        return f"blk.{layer}.{_HF_LAYER_TO_GGUF[rest]}.{kind}"
    return f"{_HF_TO_GGUF[module]}.{kind}"


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp convert's q/k permutation (HF rotate-half rows -> interleaved pairs)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def llama3_rope_factors(config: transformers.PretrainedConfig) -> np.ndarray:
    """The per-dimension frequency divisors llama.cpp's converter writes for llama3."""
    scaling = config.rope_parameters
    base = scaling["rope_theta"]
    dim = config.head_dim
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def _copy_tokenizer_keys(writer: GGUFWriter) -> None:
    reader = GGUFReader(default_model_path())
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), vtype, sub_type=sub)


# ggml type -> byte offsets of its float16 super-block scales (d, then dmin) in a block.
_K_QUANT_SCALES = {
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
}


def random_k_quant_blocks(
    rows: int, cols: int, qtype: GGMLQuantizationType, seed: int
) -> np.ndarray:
    """Random valid blocks of a K-quant type (gguf-py cannot quantize to them) as uint8
    [rows, bytes per row]: random codes and sub-block scales, small finite super-block
    scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for i, offset in enumerate(_K_QUANT_SCALES[qtype]):
        scale = rng.uniform(1e-4, 4e-4 if i == 0 else 2e-4, (rows, cols // block))
        data[:, :, offset:offset + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return data.reshape(rows, -1)


def write_llama_gguf(
    hf_dir: Path,
    out: Path,
    *,
    rope_freqs: np.ndarray | None = None,
    edit: Callable[[dict[str, np.ndarray]], None] | None = None,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    qtypes: dict[str, GGMLQuantizationType] | None = None,
) -> Path:
    """Write `hf_dir`'s float32 Llama model as GGUF `out`; `edit` may change the GGUF-named
    tensor dict before writing; 2-D weights are stored as `qtype` (F32 or Q8_0), or as
    `qtypes[gguf name]` where given (K-quants: random blocks, see random_k_quant_blocks)."""
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    tensors: dict[str, np.ndarray] = {}
    for name, tensor in load_file(hf_dir / "model.safetensors").items():
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = llama_cpp_permute(tensor, config.num_attention_heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = llama_cpp_permute(tensor, config.num_key_value_heads)
        tensors[gguf_name(name)] = tensor.float().numpy()
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = rope_freqs
    if edit is not None:
        edit(tensors)
    writer = GGUFWriter(out, "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    _copy_tokenizer_keys(writer)
    for seed, (name, array) in enumerate(tensors.items()):
        if name in (qtypes or {}):
            t = qtypes[name]
            blocks = (random_k_quant_blocks(*array.shape, t, seed) if t in _K_QUANT_SCALES
                      else quantize(array, t))
            writer.add_tensor(name, blocks, raw_dtype=t)
        elif qtype != GGMLQuantizationType.F32 and array.ndim == 2 and name != "rope_freqs.weight":
            writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
