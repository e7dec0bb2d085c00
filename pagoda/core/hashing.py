"""Chained hashes of full KV blocks: the keys of the automatic prefix cache.

A block's hash covers its parent's hash, its own token ids and optional extra keys, so
equal hashes mean equal *prefixes*, not just equal blocks. Only full blocks are hashed;
a partial block never enters the cache.

NOTE: hashes are sha256 digests (32 bytes), not Python's `hash()`. Python salts `str`
hashing per process (PYTHONHASHSEED), and a cache salt is a string, so `hash()` would give
different keys in different processes (e.g. data-parallel replicas or a restarted server).
A 64-bit hash also makes an accidental collision, which would silently serve another
prompt's KV, far likelier than with 256 bits. The cost is ~1-2 us per 16-token block,
paid once per block as it fills (see `update_block_hashes`).
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from array import array
from collections.abc import Sequence
from typing import Protocol

# A block hash: the 32-byte sha256 digest of (parent hash, token ids, extra keys).
BlockHash = bytes

# NOTE: the parent of a sequence's first block: a fixed value rather than an empty string
# so that every hashed message has the same fixed-length head (no ambiguity).
_ROOT_PARENT: BlockHash = hashlib.sha256(b"pagoda.prefix-cache.root").digest()


class _HashableRequest(Protocol):
    all_token_ids: list[int]
    block_hashes: list[BlockHash]
    cache_salt: str | None


def hash_block_tokens(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> BlockHash:
    """The hash of one block given its parent's hash (None for a sequence's first block).

    Deterministic across processes and runs. `extra_keys` must be picklable built-ins
    (str, int, bytes, tuples of them) so that their pickle is stable.
    """
    hasher = hashlib.sha256(_ROOT_PARENT if parent is None else parent)
    # NOTE: length-prefixed token bytes, then the extra keys: the message parses one way
    # only, so (tokens, extras) pairs cannot alias each other.
    hasher.update(struct.pack("<I", len(token_ids)))
    hasher.update(array("q", token_ids).tobytes())
    if extra_keys is not None:
        hasher.update(pickle.dumps(extra_keys, protocol=5))
    return hasher.digest()


def update_block_hashes(request: _HashableRequest, block_size: int) -> None:
    """Append to `request.block_hashes` the hashes of blocks of `all_token_ids` that are
    newly full; O(new blocks). The first block carries `(cache_salt,)` as extra keys when
    the request has a salt: salting the root salts the whole chain.
    """
    block_hashes = request.block_hashes
    token_ids = request.all_token_ids
    num_full_blocks = len(token_ids) // block_size
    for i in range(len(block_hashes), num_full_blocks):
        if i == 0:
            parent = None
            salt = request.cache_salt
            extra_keys = None if salt is None else (salt,)
        else:
            parent = block_hashes[i - 1]
            extra_keys = None
        start = i * block_size
        block_hashes.append(
            hash_block_tokens(parent, token_ids[start : start + block_size], extra_keys)
        )
