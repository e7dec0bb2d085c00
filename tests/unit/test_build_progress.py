"""The kernel build's notice: one line up front, the elapsed time while it runs, the end."""

from __future__ import annotations

import io
import time

import pytest

from pagoda.ops.build_progress import build_notice


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _until_ticked(out: io.StringIO, tick: str) -> None:
    # NOTE: waits for the ticker's output (bounded), asserting nothing about time.
    deadline = time.monotonic() + 30
    while tick not in out.getvalue():
        assert time.monotonic() < deadline, out.getvalue()
        time.sleep(0.005)


def test_a_log_gets_short_lines_with_the_elapsed_time() -> None:
    out = io.StringIO()
    with build_notice("CPU kernels", expected_s=40, stream=out, interval_s=0.01):
        _until_ticked(out, "  ... ")
    lines = out.getvalue().splitlines()
    assert lines[0] == "pagoda: building CPU kernels, once, ~40 s"
    assert lines[1].startswith("  ... ") and lines[1].endswith(" s"), lines
    assert lines[-1].startswith("pagoda: CPU kernels: done in "), lines
    assert "\r" not in out.getvalue()


def test_a_terminal_gets_one_rewritten_line_and_a_failure_is_said() -> None:
    out = Tty()
    with pytest.raises(RuntimeError, match="no compiler"), build_notice(
            "CPU kernels", expected_s=40, stream=out, interval_s=0.01):
        _until_ticked(out, "\r")
        raise RuntimeError("no compiler")
    text = out.getvalue()
    assert text.startswith("pagoda: building CPU kernels, once, ~40 s ...")
    assert "\rpagoda: building CPU kernels, once, ~40 s ... " in text
    last = text.rsplit("\r", 1)[-1]
    assert last.startswith("pagoda: building CPU kernels, once, ~40 s: failed after "), text
    assert text.count("\n") == 1 and last.endswith(" s\n"), text
