"""Checkpoint -> ready model on the target device and dtype."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from pagoda.models.gguf import iter_gguf_weights_keeping_blocks
from pagoda.models.loader import Checkpoint, CheckpointError
from pagoda.models.registry import resolve_model
from pagoda.quant.base import QuantizationConfig, get_quantization_config, quant_config_from_hf
from pagoda.quant.gguf import GGUFNativeConfig, native_enabled


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def checkpoint_quant_config(
    ckpt: Checkpoint, quantization: str | None = None
) -> QuantizationConfig | None:
    """The quantization scheme to load `ckpt` with (None: dense): its config.json's
    `quantization_config`, which `quantization` (`--quantization`), when given, must name;
    or, for a dense checkpoint, `quantization`'s quantize-at-load config. CheckpointError
    naming the problem if unsupported or contradictory."""
    try:
        config = quant_config_from_hf(ckpt.hf_config)
        if quantization is None:
            return config
        if config is None:
            return get_quantization_config(quantization).from_dense()
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{ckpt.path}: {exc}") from exc
    if config.name != quantization:
        raise CheckpointError(
            f"{ckpt.path}: quantization {quantization!r} was asked for, but the checkpoint "
            f"is quantized with {config.name!r} (leave --quantization unset to use it)"
        )
    return config


def build_model(
    ckpt: Checkpoint,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    attn_backend: str = "torch_paged",
    quantization: str | None = None,
    gguf_native: str = "auto",
    quant_config: QuantizationConfig | None = None,
) -> nn.Module:
    """Builds the architecture named in the checkpoint's config and loads its weights.

    NOTE: the layers create their parameters with `torch.empty` on the target device in
    the target dtype, so weights are never initialised randomly nor held twice: each
    checkpoint tensor is converted and copied straight into its parameter by its loader.
    `quant_config`, when given, replaces the checkpoint's (`quantization` is then unused):
    the quantized self-draft's in-memory quantization of a dense checkpoint.
    """
    factory = resolve_model(ckpt.hf_config, str(ckpt.path))
    native = ckpt.format == "gguf" and (
        quantization == "gguf"
        or (quantization is None and native_enabled(gguf_native, device, dtype))
    )
    if quant_config is None and native:
        quant_config = GGUFNativeConfig.from_checkpoint(
            ckpt.iter_raw_tensors()
        )
    elif quant_config is None:
        quant_config = checkpoint_quant_config(ckpt, quantization)
    if quant_config is not None:
        quant_config.packed_modules_mapping = dict(getattr(factory, "packed_modules_mapping", {}))
    with _default_dtype(dtype), torch.device(device):
        model = factory(ckpt.hf_config, attn_backend=attn_backend, quant_config=quant_config)
    weights = ckpt.iter_weights()
    if isinstance(quant_config, GGUFNativeConfig):
        quant_config.decide_dense_copy(dtype, device)  # the layers exist: their sizes count
        weights = iter_gguf_weights_keeping_blocks(
            ckpt.iter_raw_tensors(), ckpt.path, quant_config.keeps_blocks
        )
    model.load_weights(weights, source=str(ckpt.path))
    model.init_rotary(max_positions, dtype, device)
    model.process_weights_after_loading()
    return model.eval()
