"""KV block copies between the device cache and host memory, per layer, before a forward."""

from __future__ import annotations

import torch

from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.worker.kv_compress import convert_blocks

# One entry per layer: its cache tensors (K and V; one latent tensor for MLA).
LayerCaches = list[tuple[torch.Tensor, ...]]


def swap_blocks(
    out: SchedulerOutput,
    kv_caches: LayerCaches,
    host_kv_caches: LayerCaches | None,
    host_tier_kv_caches: LayerCaches | None,
    device_format: str = "plain",
    host_format: str = "plain",
) -> None:
    """Copy the step's blocks between the device cache and host memory (swap pool and
    prefix-cache host tier), in every layer, before anything reads or writes the cache;
    the host pools hold `host_format` blocks (kv_compress.py: compressed on the way out,
    decompressed on the way in, where it differs from `device_format`).

    NOTE: every device -> host copy first: a device block that a swap-out frees or an
    offload evicts may be the target of a swap-in, a host-tier load or new tokens in the
    same step. (The host tier never hands a slot a load reads to an offload of the same
    step, so host slots need no such order.) Copies go through `.to(device)`: no device ==
    host assumption.
    """
    down, up = (device_format, host_format), (host_format, device_format)
    if out.blocks_to_swap_out:
        copy_blocks(kv_caches, host_kv_caches, out.blocks_to_swap_out, *down)
    if out.blocks_to_offload:
        copy_blocks(kv_caches, host_tier_kv_caches, out.blocks_to_offload, *down)
    if out.blocks_to_copy:
        copy_blocks(kv_caches, kv_caches, out.blocks_to_copy)
    if out.blocks_to_swap_in:
        copy_blocks(host_kv_caches, kv_caches, out.blocks_to_swap_in, *up)
    if out.blocks_to_onload:
        copy_blocks(host_tier_kv_caches, kv_caches, out.blocks_to_onload, *up)


def copy_blocks(src_caches: LayerCaches, dst_caches: LayerCaches,
                pairs: list[tuple[int, int]], src_format: str = "plain",
                dst_format: str = "plain") -> None:
    """dst[d] = src[s] for every (s, d) in `pairs`, in each layer's tensors (converted
    between the two block formats where they differ)."""
    src_ids, dst_ids = zip(*pairs, strict=True)
    src_idx = torch.tensor(src_ids, device=src_caches[0][0].device)
    dst_idx = torch.tensor(dst_ids, device=dst_caches[0][0].device)
    for src_kv, dst_kv in zip(src_caches, dst_caches, strict=True):
        if src_format != dst_format:
            convert_blocks(src_kv, dst_kv, src_idx, dst_idx, src_format, dst_format)
            continue
        for src, dst in zip(src_kv, dst_kv, strict=True):
            dst[dst_idx] = src[src_idx].to(dst.device)
