"""Checkpoint -> ready model on the target device and dtype."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from pagoda.models.loader import Checkpoint
from pagoda.models.registry import resolve_model


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(
    ckpt: Checkpoint,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    attn_backend: str = "torch_paged",
) -> nn.Module:
    """Builds the architecture named in the checkpoint's config and loads its weights.

    NOTE: the model is built on the meta device in the target dtype and then given empty
    storage, so weights are never initialised randomly nor held twice: each checkpoint
    tensor is converted and copied straight into its parameter.
    """
    factory = resolve_model(ckpt.hf_config, str(ckpt.path))
    with _default_dtype(dtype), torch.device("meta"):
        model = factory(ckpt.hf_config, attn_backend=attn_backend)
    model.to_empty(device=device)
    model.load_weights(ckpt.iter_weights(), source=str(ckpt.path))
    model.init_rotary(max_positions, dtype, device)
    model.process_weights_after_loading()
    return model.eval()
