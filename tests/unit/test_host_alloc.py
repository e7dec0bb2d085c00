"""The CPU KV pool's memory: zeroed, writable, alive with its tensor, advised for huge pages."""

from __future__ import annotations

import gc
import mmap
import sys

import pytest
import torch

from pagoda.core.kv_cache_spec import AttentionKind, KVCacheSpec
from pagoda.worker.host_alloc import HUGE_PAGE_BYTES, huge_page_zeros
from pagoda.worker.worker import allocate_kv_caches


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_large_pool_tensor_is_zero_writable_and_outlives_its_maker():
    t = huge_page_zeros((1024, 16, 3, 64), torch.bfloat16)
    assert t.shape == (1024, 16, 3, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.numel() * t.element_size() >= HUGE_PAGE_BYTES
    assert not t.any()
    gc.collect()  # the mapping lives as long as the tensor, not the function's local
    t[5, 3] = 1.5
    assert float(t[5, 3, 2, 7]) == 1.5 and float(t.float().sum()) == 1.5 * 3 * 64
    view = t[10:20]
    del t
    gc.collect()
    view.fill_(2.0)
    assert float(view.float().mean()) == 2.0


def test_a_small_tensor_takes_torch_zeros():
    t = huge_page_zeros((4, 16, 2, 8), torch.float32)
    assert t.shape == (4, 16, 2, 8) and not t.any()
    t.add_(1)  # writable, resizable storage of torch's own allocator
    assert t.untyped_storage().resizable()


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="MADV_HUGEPAGE is Linux's")
def test_the_device_pool_on_the_host_is_advised_for_huge_pages():
    t = huge_page_zeros((1024, 16, 3, 64), torch.bfloat16)  # 6 MiB
    assert "hg" in _vm_flags(t.data_ptr())  # VM_HUGEPAGE, set by MADV_HUGEPAGE


def test_allocate_kv_caches_uses_it_for_the_zeroed_host_pool_only():
    spec = KVCacheSpec(AttentionKind.FULL, layer_ids=(0, 1), block_size=16, num_kv_heads=3,
                       head_size=64, dtype=torch.bfloat16)
    pool = allocate_kv_caches([spec], 1024, torch.device("cpu"), pin=False, zero=True)
    assert len(pool) == 2 and all(len(layer) == 2 for layer in pool)
    k, v = pool[1]
    assert k.shape == (1024, 16, 3, 64) and not k.any() and not v.any()
    assert not k.untyped_storage().resizable()  # a mapping of its own
    assert k.data_ptr() != v.data_ptr()
    swap = allocate_kv_caches([spec], 1024, None, pin=False, zero=False)
    assert swap[0][0].untyped_storage().resizable()  # torch.empty: never touched up front
