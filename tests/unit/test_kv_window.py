"""KVCacheManager with windowed groups: blocks outside the window are freed (the null block
in their place) with exact counts, a prefix hit needs only the blocks inside the window, and
several groups draw group-major from one pool with their own (salted) prefix keys. Block
size 4, window 8; check_integrity after every scenario."""

from __future__ import annotations

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.kv_cache_spec import KVRetention, max_blocks_held
from tests.unit.test_kv_cache_manager import BS, ids, make_request

WINDOW = KVRetention(8)


def run_chunk(manager: KVCacheManager, request, n: int) -> list[int]:
    """Allocate n tokens, compute them and commit, as the scheduler does."""
    new = manager.allocate_slots(request, n)
    assert new is not None
    request.num_computed_tokens += n
    manager.cache_blocks(request)
    return ids(new)


def test_window_frees_blocks_outside_it_exactly() -> None:
    manager = KVCacheManager(num_blocks=32, block_size=BS, retentions=(WINDOW,))
    a = make_request("a", range(6))
    assert run_chunk(manager, a, 6) == [1, 2]
    for _ in range(34):  # decode to 40 tokens
        a.append_output_token_ids(7)
        run_chunk(manager, a, 1)
        c = a.num_computed_tokens - 1  # the step's query position
        table = manager.get_block_ids("a")
        first = max(0, c - 8 + 1) // BS
        assert table[:first] == [0] * first and 0 not in table[first:]
        assert manager.block_pool.get_num_used_blocks() == len(table) - first
        manager.check_integrity([a])
    # The step from position 39 reads positions 32..39: blocks 8 and 9 (W / BS + 1 = 3 at
    # most, when the window straddles three blocks).
    assert manager.get_block_ids("a") == [0] * 8 + manager.get_block_ids("a")[8:]
    assert manager.block_pool.get_num_used_blocks() == 2
    manager.free(a)
    assert manager.usage == 0.0
    manager.check_integrity()


def test_prefix_hit_needs_only_the_window() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BS, retentions=(WINDOW,))
    a = make_request("a", range(25))
    for _ in range(6):  # chunks of 4 tokens: the last chunk frees blocks 0-2
        run_chunk(manager, a, 4)
    table = list(manager.get_block_ids("a"))
    assert table[:3] == [0, 0, 0]
    manager.free(a)
    # Drain the uncached free blocks, then evict the three LRU cached ones: a's blocks
    # 0-2, which the window freed first.
    filler = make_request("filler", range(100, 200))
    uncached = manager.block_pool.free_block_queue.num_free_blocks
    manager.allocate_slots(filler, uncached * BS)
    victim = make_request("victim", range(300, 312))
    evicted = ids(manager.allocate_slots(victim, 12))
    assert len(evicted) == 3
    b = make_request("b", [*range(24), 99])
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    # A query from position 24 reads 17..24: blocks 4 and 5 (a's table entries 4 and 5).
    assert num_hit_tokens == 24
    assert ids(hits)[:4] == [0, 0, 0, 0] and ids(hits)[4:] == [5, 6]
    assert manager.allocate_slots(b, 1, hits, num_hit_tokens) is not None
    b.num_computed_tokens = num_hit_tokens  # as the scheduler does on admission
    assert manager.get_block_ids("b")[:6] == [0, 0, 0, 0, 5, 6]
    manager.check_integrity([b])


def test_groups_allocate_group_major_with_their_own_keys() -> None:
    manager = KVCacheManager(num_blocks=32, block_size=BS, retentions=(KVRetention(), WINDOW))
    a = make_request("a", range(17))
    assert run_chunk(manager, a, 17) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert manager.get_group_block_ids("a") == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    b = make_request("b", [*range(16), 50, 51])
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    # Four blocks hit: the full group needs them all, the window only blocks 2 and 3
    # (positions 9..16 for the query at 16), registered under group 1's own keys.
    assert num_hit_tokens == 16 and ids(hits) == [1, 2, 3, 4, 0, 0, 8, 9]
    new = manager.allocate_slots(b, 2, hits, num_hit_tokens)
    b.num_computed_tokens = num_hit_tokens
    assert manager.group_ids(new) == ([11], [12])
    assert manager.get_group_block_ids("b") == ([1, 2, 3, 4, 11], [0, 0, 8, 9, 12])
    manager.check_integrity([a, b])
    # A miss in the full group shortens the hit for every group.
    c = make_request("c", [*range(8), 77, *range(9, 17)])
    assert manager.get_computed_blocks(c) == (manager.get_computed_blocks(c)[0], 8)
    manager.free(a)
    manager.free(b)
    assert manager.usage == 0.0
    manager.check_integrity()


def test_max_blocks_held_bounds_the_window() -> None:
    # Window 8 and chunks of up to 4 tokens: a step holds at most ceil(11 / 4) + 1 = 4.
    assert max_blocks_held(WINDOW, 1000, 4, BS) == 4
    assert max_blocks_held(WINDOW, 6, 4, BS) == 2
    assert max_blocks_held(KVRetention(), 1000, 4, BS) == 250
    sinks = KVRetention(8, num_sink_tokens=5)  # two sink blocks kept
    assert max_blocks_held(sinks, 1000, 4, BS) == 6
    assert sinks.num_kept_blocks(40, BS) == 2 + 2  # sinks, then positions 33..39 in 8-9


def test_paged_attention_reads_nothing_of_freed_entries() -> None:
    """The reference and the CPU kernel, decoding with a window over a table whose entries
    before the window are the null block (zeros): the same output as with the original
    blocks. Stale ids of reused blocks (NaN here) would poison the reference's masked
    product, which is why the runner nulls the entries the manager freed."""
    import torch

    from pagoda.ops import paged_attention, reference

    torch.manual_seed(0)
    num_blocks, bs, hk, d = 12, 4, 2, 16
    k_cache, v_cache = torch.randn(2, num_blocks, bs, hk, d).unbind(0)
    k_cache[0], v_cache[0] = 0.0, 0.0
    q = torch.randn(1, 4, d)
    table = torch.tensor([[3, 5, 7, 9, 11, 2, 4]])  # 27 tokens; window 8 reads 19..26
    lens = torch.tensor([27])
    want = reference.paged_attention(q, k_cache, v_cache, table, lens, d**-0.5, 8)
    freed = table.clone()
    freed[0, :4] = 0  # blocks 0-3 hold positions 0..15: all before the window
    for b in (3, 5, 7, 9):
        k_cache[b], v_cache[b] = float("nan"), float("nan")
    got_ref = reference.paged_attention(q, k_cache, v_cache, freed, lens, d**-0.5, 8)
    got = paged_attention(q, k_cache, v_cache, freed, lens, d**-0.5, 8)
    torch.testing.assert_close(got_ref, want)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    stale = reference.paged_attention(q, k_cache, v_cache, table, lens, d**-0.5, 8)
    assert stale.isnan().all()
