"""The host-memory second tier of the prefix cache: block accounting only (the runner holds
the tensors, one K and one V per layer shaped like the device cache, own slot ids).

When the device pool evicts a cached block to reuse it, the block's KV is copied to a host
slot kept under the block's hash; a later prefix lookup that runs out of device hits
continues its chain here, and each host hit is copied back into a new device block.

The tiers are exclusive: a hash is in the device cache or here, never both. A load moves
the entry back to the device (the slot is freed), a device block registered under a hash
that is here drops the entry (the device copy wins). So the only "use" of an entry is its
removal, and least recently used = least recently offloaded: the LRU order continues the
device pool's eviction order.

| slot state | in `_entries` | in `_written` | in `_released` | in `_free` |
|------------|---------------|---------------|----------------|------------|
| free       | no            | no            | no             | yes        |
| held       | yes           | this step's   | no             | no         |
|            |               | offloads only |                |            |
| released   | no            | no            | yes            | no         |

Every slot is in exactly one state. Copies are only decided inside a step and performed by
the runner before that step's forward, device -> host first (see model_runner.swap_blocks).
Hence, until `end_step()`:
- a slot a load reads (released) is not handed to an offload of the same step, which the
  runner would perform first and so overwrite what the load reads;
- a slot an offload writes (written) is not evicted and reused by another offload of the
  same step: a copy list never names one destination twice (indexed assignment with a
  repeated index is undefined on a GPU).
An offload that finds no slot it may take (every slot busy this step) is dropped: the block
is simply forgotten, as without the tier.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Container, Iterable, Sequence

from pagoda.core.block_pool import assert_that
from pagoda.core.hashing import BlockHash


class HostPrefixTier:
    """An LRU map block hash -> host slot over `num_slots` slots, and the step's copies.

    Free slots are handed out first free, first used (so tests can name exact ids).
    Counters (blocks): `num_offloaded` (device -> host copies), `num_loaded` (host ->
    device copies), `num_evicted` (entries dropped for space), `num_dropped` (offloads
    refused because every slot was busy this step).
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._entries: OrderedDict[BlockHash, int] = OrderedDict()  # LRU first
        self._free: deque[int] = deque(range(num_slots))
        self._written: set[int] = set()
        self._released: list[int] = []
        self._offloads: list[tuple[int, int]] = []  # (device block, slot)
        self._loads: list[tuple[int, int]] = []  # (slot, device block)
        self.num_offloaded = 0
        self.num_loaded = 0
        self.num_evicted = 0
        self.num_dropped = 0

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def usage(self) -> float:
        """Fraction of slots holding an entry, in [0, 1]."""
        return len(self._entries) / self.num_slots if self.num_slots else 0.0

    def lru_hashes(self) -> list[BlockHash]:
        """The held hashes, least recently offloaded first (the eviction order)."""
        return list(self._entries)

    def slot_of(self, block_hash: BlockHash) -> int | None:
        """The slot holding `block_hash`, or None. Changes no state."""
        return self._entries.get(block_hash)

    # ---- device -> host ---------------------------------------------------------------
    def offload(self, block_hash: BlockHash, device_block_id: int) -> int | None:
        """Keep the KV of the device block being evicted under `block_hash`: take a free
        slot, else the LRU entry's; queue the (device, slot) copy. Returns the slot, or None
        if every slot is busy this step (the block is forgotten).
        """
        if block_hash in self._entries:
            # NOTE: cannot happen while the tiers stay exclusive (check_integrity); refuse
            # rather than hold one hash twice.
            raise ValueError(f"hash {block_hash.hex()[:8]} is already in the host tier")
        slot = self._take_slot()
        if slot is None:
            self.num_dropped += 1
            return None
        self._entries[block_hash] = slot
        self._written.add(slot)
        self._offloads.append((device_block_id, slot))
        self.num_offloaded += 1
        return slot

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.popleft()
        if not self._entries:
            return None
        block_hash, slot = next(iter(self._entries.items()))
        if slot in self._written:
            # NOTE: entries are in offload order, so if the LRU one was written this step
            # every one was.
            return None
        del self._entries[block_hash]
        self.num_evicted += 1
        return slot

    # ---- host -> device ---------------------------------------------------------------
    def take(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Remove the entries of `block_hashes` for loading and return their slots, which
        stay reserved until `end_step()`. KeyError (no change) if one is not held.
        """
        missing = [h for h in block_hashes if h not in self._entries]
        if missing:
            raise KeyError(f"hash {missing[0].hex()[:8]} is not in the host tier")
        slots = [self._entries.pop(h) for h in block_hashes]
        for slot in slots:
            self._release(slot)
        return slots

    def load(self, slots: Sequence[int], device_block_ids: Sequence[int]) -> None:
        """Queue the copies of `take`n slots into their new device blocks, pairwise."""
        self._loads.extend(zip(slots, device_block_ids, strict=True))
        self.num_loaded += len(slots)

    def discard(self, block_hash: BlockHash) -> None:
        """Drop `block_hash` (no-op if absent): a device block was just registered under it.
        Between steps (registration happens at a step's commit, when no copy is in flight):
        the slot is free at once."""
        slot = self._entries.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def discard_slots(self, slots: Iterable[int]) -> None:
        """Drop the entries held in `slots` (slots no entry holds are skipped): the copies
        that were to fill them belong to a step that failed. Between steps: the slots are
        free at once."""
        dropped = set(slots)
        if not dropped:
            return
        for block_hash in [h for h, slot in self._entries.items() if slot in dropped]:
            self._free.append(self._entries.pop(block_hash))

    def _release(self, slot: int) -> None:
        # NOTE: a slot read or written by this step's copies must not be reused before the
        # step ends; any other slot is free at once.
        self._written.discard(slot)
        self._released.append(slot)

    # ---- step boundary ----------------------------------------------------------------
    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's queued copies, (device, slot) offloads and (slot, device) loads;
        the queues are emptied."""
        offloads, loads = self._offloads, self._loads
        self._offloads, self._loads = [], []
        return offloads, loads

    def end_step(self) -> None:
        """The step's copies are all decided: released slots become free, written ones
        evictable."""
        self._free.extend(self._released)
        self._released.clear()
        self._written.clear()

    def reset(self) -> None:
        """Forget every entry (between steps)."""
        self.end_step()
        self._free.extend(self._entries.values())
        self._entries.clear()

    def check_integrity(self, device_hashes: Container[BlockHash]) -> None:
        """Assert the table in the module docstring between steps: every slot once, in
        range, nothing reserved or queued, and no hash also in `device_hashes`.
        """
        assert_that(not self._released and not self._written,
                    "host tier: slots reserved past the end of a step")
        assert_that(not self._offloads and not self._loads,
                    "host tier: copies queued but not handed to the runner")
        every = [*self._free, *self._entries.values()]
        assert_that(len(every) == self.num_slots, "host tier: free + held != total")
        assert_that(len(set(every)) == self.num_slots, "host tier: a slot twice")
        assert_that(all(0 <= s < self.num_slots for s in every), "host tier: slot out of range")
        for block_hash in self._entries:
            assert_that(block_hash not in device_hashes,
                        f"hash {block_hash.hex()[:8]} is in both the device and the host tier")
