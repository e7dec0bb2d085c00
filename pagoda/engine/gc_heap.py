"""Keeping Python's full garbage collections off the step loop.

A loaded engine leaves about 800,000 GC-tracked objects behind (the model's modules and
parameters, the tokenizer, transformers and torch themselves). CPython runs a full
(generation 2) collection whenever the objects that survived younger collections reach a
quarter of the long-lived ones; that collection walks every tracked object: about 250 ms
on SmolLM2-135M, a stall inside whichever step allocated last (it showed as one decode
step of 311 ms among 40 ms ones). `gc.freeze()` moves every object tracked so far into a
permanent generation that collections skip; objects made later are collected as
before, so garbage made while the loop runs (cycles included) is still freed.

The freeze holds only while a loop runs (`LLM.generate`, the engine core's loop, the
throughput benchmark's) or an engine is built (`LLMEngine.__init__`: loading makes about a
million short-lived objects, whose collections would walk the imported modules each time)
and is undone when it ends: a frozen object that becomes cyclic garbage (an engine a test
dropped) is freed by the next full collection after `gc.unfreeze()`, not never. Loops
may nest or overlap (an LLM inside a server's process, two threads): the outermost one
freezes and the last one out unfreezes.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Objects that exist on entry are left out of collections until the last exit."""
    global _depth
    with _lock:
        if _depth == 0:
            gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.unfreeze()
