"""Holding a Ctrl-C while the engine's state is being updated, so that an interrupt always
finds the scheduler and the output processor consistent."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold a Ctrl-C that arrives inside the block and raise KeyboardInterrupt at its end.

    Only on the main thread (the only one Python delivers signals to) and only while
    SIGINT has Python's default handler; anything else is left alone.
    """
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    received: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if received:
        raise KeyboardInterrupt
