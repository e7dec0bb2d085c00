"""Host memory for the CPU KV pool: zeroed tensors backed by 2 MiB pages where the kernel
gives them.

NOTE (measured on both 2-core machines; docs/architecture.md, Defaults): decode attention
reads K/V blocks at random addresses all over a pool of gigabytes, so with 4 KiB pages
nearly every block costs a TLB miss and a page walk. Transparent huge pages cut that,
and the kernel's usual setting ("madvise") grants them only to mappings that ask. The
pool therefore gets its own anonymous mapping, advised MADV_HUGEPAGE before any page is
touched, and then faulted in at once, as torch.zeros would.
"""

from __future__ import annotations

import mmap

import torch

# Below this a tensor cannot hold one aligned huge page; torch's allocator is fine there.
HUGE_PAGE_BYTES = 2 << 20


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor of `shape` on the host, in its own mapping advised MADV_HUGEPAGE (a
    plain torch.zeros where it is too small, or where the platform lacks madvise). The
    tensor keeps the mapping alive; it is freed with the tensor's last reference."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE_BYTES or advice is None:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(advice)
    except OSError:
        pass  # THP compiled out or refused: 4 KiB pages, same contents
    out = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
    # NOTE: fault every page in now (as torch.zeros did): a first touch in a step costs a
    # 2 MiB page's zeroing inside the cache write of whichever request reaches it first.
    out.zero_()
    return out
