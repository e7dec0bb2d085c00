"""Rotary position embeddings (neox / rotate-half layout, as transformers' Llama family).

The inverse frequencies and attention factor come from transformers' own ROPE_INIT_FUNCTIONS,
so every scaling it defines (linear, dynamic NTK, llama3, yarn, longrope) means exactly what
it means there. cos/sin are precomputed per position once; a step only gathers rows.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagoda.ops import apply_rotary

__all__ = ["RotaryEmbedding", "apply_rotary", "build_cos_sin", "rope_inv_freq", "rotate_by"]


def _rope_type(config: PretrainedConfig) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not params:
        return "default"
    return params.get("rope_type", params.get("type", "default"))


def _default_inv_freq(config: PretrainedConfig, head_dim: int) -> torch.Tensor:
    params = getattr(config, "rope_parameters", None) or {}
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def build_cos_sin(
    config: PretrainedConfig, head_dim: int, max_positions: int,
    freq_factors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_positions, head_dim // 2] in float32. `freq_factors` [head_dim
    // 2] divide the inverse frequencies (GGUF's rope_freqs, e.g. llama3 scaling)."""
    pos = torch.arange(max_positions, dtype=torch.float32)
    if _rope_type(config) == "dynamic":
        if freq_factors is not None:
            raise ValueError("rope frequency factors do not combine with dynamic scaling")
        return _dynamic_cos_sin(config, head_dim, pos)
    inv_freq, factor = rope_inv_freq(config, head_dim, freq_factors)
    freqs = torch.outer(pos, inv_freq)
    return freqs.cos() * factor, freqs.sin() * factor


def rope_inv_freq(
    config: PretrainedConfig, head_dim: int, freq_factors: torch.Tensor | None = None
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim // 2] float32, attention factor) of a rope whose
    frequencies do not depend on the position (every type but dynamic)."""
    rope_type = _rope_type(config)
    if rope_type == "default":
        inv_freq, factor = _default_inv_freq(config, head_dim), 1.0
    elif rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    elif rope_type == "dynamic":
        raise ValueError("dynamic rope scaling has no position-independent frequencies")
    else:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    if freq_factors is not None:
        inv_freq = inv_freq.float() / freq_factors.float()
    return inv_freq.float(), factor


def rotate_by(x: torch.Tensor, offsets: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by offsets[t] more positions (negative: back), with no attention
    factor: R(p + o) = R(o) R(p), so a query rotated at p reads keys as if it were at p + o."""
    angles = offsets.to(torch.float32)[:, None] * inv_freq.to(x.device)[None, :]
    cos, sin = angles.cos().to(x.dtype)[:, None], angles.sin().to(x.dtype)[:, None]
    return apply_rotary(x, cos, sin)


def _dynamic_cos_sin(
    config: PretrainedConfig, head_dim: int, pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # NOTE: transformers rescales the base from the longest sequence in the batch, so its
    # result depends on batch composition. Here position p uses the frequencies for a
    # sequence of length p + 1: identical to transformers inside the original context
    # length (the common case) and batch-independent beyond it.
    original = getattr(config, "original_max_position_embeddings", None) or (
        config.max_position_embeddings
    )
    base_inv = _default_inv_freq(config, head_dim)
    freqs = torch.outer(pos, base_inv)
    long_pos = pos[pos >= original]
    if long_pos.numel():
        fn = ROPE_INIT_FUNCTIONS["dynamic"]
        rows = [fn(config, "cpu", seq_len=int(p) + 1)[0].float() * p for p in long_pos.tolist()]
        freqs[original:] = torch.stack(rows)
    return freqs.cos(), freqs.sin()


class RotaryEmbedding(nn.Module):
    def __init__(
        self, config: PretrainedConfig, head_dim: int, max_positions: int,
        freq_factors: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        cos, sin = build_cos_sin(config, head_dim, max_positions, freq_factors)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def to_dtype(self, dtype: torch.dtype) -> None:
        self.cos = self.cos.to(dtype)
        self.sin = self.sin.to(dtype)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, Hk, D] -> rotated copies."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

