"""The per-request generators of seeded requests, owned by the model runner.

A seeded request draws its random numbers from its own generator, made from its seed when
the runner first sees it and advanced only by the runner's sampling. Its stream must not
depend on how the request was scheduled: a request that comes back (preempted, or run by
a step that failed and was rolled back) continues where its committed tokens leave it.

A preemption comes after the commit of every token the request has sampled, so its
generator already stands there. A rolled-back step may have sampled (the fault came later
in the step, or under async scheduling a step in flight completed) without its tokens
being committed; so before each sampling the runner checkpoints the generator under the
position it samples (`checkpoint`), and a request that comes back with `num_tokens`
tokens is rewound to the checkpoint of position `num_tokens` if it sampled it (`add`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

# NOTE: a rollback undoes at most the steps in flight (engine/step_pipeline.py keeps two),
# so the position a request comes back at is one of its last two sampling positions.
NUM_CHECKPOINTS = 2


@dataclass(slots=True)
class _Stream:
    generator: torch.Generator
    # (position sampled, the generator's state just before), oldest first.
    checkpoints: deque[tuple[int, torch.Tensor]] = field(
        default_factory=lambda: deque(maxlen=NUM_CHECKPOINTS))


class SeededGenerators:
    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}

    def get(self, req_id: str) -> torch.Generator | None:
        """`req_id`'s generator; None for an unseeded request."""
        stream = self._streams.get(req_id)
        return stream.generator if stream is not None else None

    def add(self, req_id: str, seed: int | None, num_tokens: int) -> None:
        """A request (re)entering the batch with `num_tokens` tokens: a new stream from
        `seed`, or a known request's stream as it stood before sampling position
        `num_tokens` (unchanged if it has not sampled there)."""
        if seed is None:
            return
        stream = self._streams.get(req_id)
        if stream is None:
            self._streams[req_id] = _Stream(torch.Generator().manual_seed(seed))
            return
        kept = [(pos, state) for pos, state in stream.checkpoints if pos < num_tokens]
        for pos, state in stream.checkpoints:
            if pos == num_tokens:
                stream.generator.set_state(state)
        stream.checkpoints.clear()
        stream.checkpoints.extend(kept)

    def checkpoint(self, req_id: str, position: int) -> None:
        """Before `req_id`'s sampling of the token at `position` (several positions in one
        draw, with drafts: the first); nothing for an unseeded request."""
        stream = self._streams.get(req_id)
        if stream is not None:
            stream.checkpoints.append((position, stream.generator.get_state()))

    def remove(self, req_id: str) -> None:
        """`req_id` finished: its stream is dropped."""
        self._streams.pop(req_id, None)

    def __iter__(self) -> Iterator[str]:
        """The ids of the requests holding a stream."""
        return iter(self._streams)
