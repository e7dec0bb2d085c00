"""Chained block hashes: stable, chained, salted at the root, computed incrementally."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pagoda.core.hashing import hash_block_tokens, update_block_hashes
from pagoda.core.request import Request
from pagoda.sampling_params import SamplingParams

BLOCK_SIZE = 4
REPO_ROOT = Path(__file__).resolve().parents[2]


def make_request(token_ids: list[int], salt: str | None = None) -> Request:
    return Request("r", list(token_ids), SamplingParams(), cache_salt=salt)


def hashes_of(token_ids: list[int], salt: str | None = None) -> list[bytes]:
    request = make_request(token_ids, salt)
    update_block_hashes(request, BLOCK_SIZE)
    return request.block_hashes


def test_hash_is_deterministic_and_sensitive_to_every_input() -> None:
    base = hash_block_tokens(None, [1, 2, 3, 4], None)
    assert isinstance(base, bytes) and len(base) == 32
    assert hash_block_tokens(None, [1, 2, 3, 4], None) == base
    assert hash_block_tokens(None, [1, 2, 3, 5], None) != base
    assert hash_block_tokens(base, [1, 2, 3, 4], None) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("salt",)) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("a",)) != hash_block_tokens(
        None, [1, 2, 3, 4], ("b",)
    )
    # Length-prefixed tokens: a shorter block plus extra keys cannot alias a longer one.
    assert hash_block_tokens(None, [1, 2, 3], (4,)) != hash_block_tokens(None, [1, 2, 3, 4])


def test_hash_is_stable_across_processes() -> None:
    """A str salt must hash the same under any PYTHONHASHSEED (sha256, not hash())."""
    code = (
        "from pagoda.core.hashing import hash_block_tokens as h;"
        "print(h(h(None, [7, 8, 9], ('salt',)), [1, 2]).hex())"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO_ROOT)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    expected = hash_block_tokens(hash_block_tokens(None, [7, 8, 9], ("salt",)), [1, 2]).hex()
    assert digests == {expected}


def test_only_full_blocks_are_hashed() -> None:
    assert hashes_of([1, 2, 3]) == []
    assert len(hashes_of([1, 2, 3, 4])) == 1
    assert len(hashes_of(list(range(11)))) == 2


def test_hashes_are_chained() -> None:
    tokens = list(range(12))
    hashes = hashes_of(tokens)
    assert hashes[0] == hash_block_tokens(None, [0, 1, 2, 3], None)
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7], None)
    assert hashes[2] == hash_block_tokens(hashes[1], [8, 9, 10, 11], None)
    # A different first block changes every later hash, though later tokens are equal.
    other = hashes_of([99] + tokens[1:])
    assert all(a != b for a, b in zip(hashes, other, strict=True))
    # A different last block leaves the shared prefix's hashes equal.
    tail = hashes_of(tokens[:-1] + [99])
    assert tail[:2] == hashes[:2] and tail[2] != hashes[2]


def test_salt_changes_the_whole_chain() -> None:
    tokens = list(range(8))
    plain, salted = hashes_of(tokens), hashes_of(tokens, "tenant-a")
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    assert hashes_of(tokens, "tenant-a") == salted
    assert hashes_of(tokens, "tenant-b")[1] != salted[1]
    assert salted[0] == hash_block_tokens(None, [0, 1, 2, 3], ("tenant-a",))
    # Only the root carries the salt; the rest is chained from it.
    assert salted[1] == hash_block_tokens(salted[0], [4, 5, 6, 7], None)


def test_update_block_hashes_is_incremental() -> None:
    request = make_request(list(range(6)))
    update_block_hashes(request, BLOCK_SIZE)
    first = request.block_hashes[0]
    assert len(request.block_hashes) == 1

    request.append_output_token_ids(6)
    update_block_hashes(request, BLOCK_SIZE)
    assert request.block_hashes == [first]  # block 1 is still partial

    request.append_output_token_ids(7)
    update_block_hashes(request, BLOCK_SIZE)
    assert len(request.block_hashes) == 2
    assert request.block_hashes[0] is first  # not recomputed
    assert request.block_hashes == hashes_of(list(range(8)))

    # Old hashes are never recomputed: a tampered one propagates, proving O(new blocks).
    request.block_hashes[1] = b"x" * 32
    request.append_output_token_ids([8, 9, 10, 11])
    update_block_hashes(request, BLOCK_SIZE)
    assert request.block_hashes[2] == hash_block_tokens(b"x" * 32, [8, 9, 10, 11], None)
