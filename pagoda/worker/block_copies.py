"""KV block copies between the device cache and host memory, per layer, before a forward."""

from __future__ import annotations

import torch

from pagoda.core.scheduler_output import SchedulerOutput

# One entry per layer: its cache tensors (K and V; one latent tensor for MLA).
LayerCaches = list[tuple[torch.Tensor, ...]]


def swap_blocks(
    out: SchedulerOutput,
    kv_caches: LayerCaches,
    host_kv_caches: LayerCaches | None,
    host_tier_kv_caches: LayerCaches | None,
) -> None:
    """Copy the step's blocks between the device cache and host memory (swap pool and
    prefix-cache host tier), in every layer, before anything reads or writes the cache.

    NOTE: every device -> host copy first: a device block that a swap-out frees or an
    offload evicts may be the target of a swap-in, a host-tier load or new tokens in the
    same step. (The host tier never hands a slot a load reads to an offload of the same
    step, so host slots need no such order.) Copies go through `.to(device)`: no device ==
    host assumption.
    """
    if out.blocks_to_swap_out:
        copy_blocks(kv_caches, host_kv_caches, out.blocks_to_swap_out)
    if out.blocks_to_offload:
        copy_blocks(kv_caches, host_tier_kv_caches, out.blocks_to_offload)
    if out.blocks_to_copy:
        copy_blocks(kv_caches, kv_caches, out.blocks_to_copy)
    if out.blocks_to_swap_in:
        copy_blocks(host_kv_caches, kv_caches, out.blocks_to_swap_in)
    if out.blocks_to_onload:
        copy_blocks(host_tier_kv_caches, kv_caches, out.blocks_to_onload)


def copy_blocks(src_caches: LayerCaches, dst_caches: LayerCaches,
                pairs: list[tuple[int, int]]) -> None:
    """dst[d] = src[s] for every (s, d) in `pairs`, in each layer's tensors."""
    src_ids, dst_ids = zip(*pairs, strict=True)
    src_idx = torch.tensor(src_ids, device=src_caches[0][0].device)
    dst_idx = torch.tensor(dst_ids, device=dst_caches[0][0].device)
    for src_kv, dst_kv in zip(src_caches, dst_caches, strict=True):
        for src, dst in zip(src_kv, dst_kv, strict=True):
            dst[dst_idx] = src[src_idx].to(dst.device)
