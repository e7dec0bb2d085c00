"""A one-line notice, with elapsed time, for a long one-off build (the C++ CPU kernels).

Contract: `build_notice(what, expected_s)` prints "pagoda: building WHAT, once, ~N s" when
entered, then while its body runs the seconds elapsed (on a terminal the same line is
rewritten every second; elsewhere, e.g. a server log, one short line every `interval_s`),
and on exit how long it took or that it failed. The body's exception goes on unchanged.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO


@contextlib.contextmanager
def build_notice(what: str, expected_s: int, stream: TextIO | None = None,
                 interval_s: float | None = None) -> Iterator[None]:
    out = stream if stream is not None else sys.stderr
    tty = out.isatty()
    interval = interval_s if interval_s is not None else (1.0 if tty else 15.0)
    head = f"pagoda: building {what}, once, ~{expected_s} s"
    start = time.monotonic()
    stop = threading.Event()

    def write(text: str) -> None:
        # NOTE: a closed or broken stream must never fail the build it reports on.
        with contextlib.suppress(OSError, ValueError):
            out.write(text)
            out.flush()

    def tick() -> None:
        while not stop.wait(interval):
            elapsed = time.monotonic() - start
            write(f"\r{head} ... {elapsed:.0f} s" if tty else f"  ... {elapsed:.0f} s\n")

    write(head + (" ..." if tty else "\n"))
    ticker = threading.Thread(target=tick, name="pagoda-build-notice", daemon=True)
    ticker.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        stop.set()
        ticker.join()
        elapsed = time.monotonic() - start
        end = f"done in {elapsed:.0f} s" if ok else f"failed after {elapsed:.0f} s"
        write(f"\r{head}: {end}\n" if tty else f"pagoda: {what}: {end}\n")
