"""Wide bf16 GEMMs on CPU: oneDNN's bf16 kernel or float32 on a widened weight, chosen by a
start-up probe.

A bf16 product of many rows (prefill) is compute-bound. Where the CPU's bf16 dot product
(vdpbf16ps) runs at twice the FMA rate, oneDNN's bf16 kernel is the fast one. On an Intel
Xeon whose AMX is hidden (avx512_bf16 and avx512_fp16 listed, no amx_tile), vdpbf16ps
issues at half the FMA rate and oneDNN's avx512_core_bf16 kernel reaches about half of
float32's GFLOP/s (measured 80 against 150 on one core), so widening the packed weight to
float32 for the call (`to_dense(float32)`, exact) and running MKL's sgemm is faster once
there are enough rows to pay for the widening. Which CPU is which cannot be read from cpuid
alone, so `configure()` times the two on this machine, once per process, and sets the row
count from which the float32 path runs (`fp32_min_rows()`; None: never).

Both paths multiply the same bf16 values and sum in float32; only the summation order
differs, so results agree to float32 rounding before the final rounding to bf16, not bit
for bit. Decode-sized products stay on the bf16 path: they are memory-bound, and bf16
reads half the bytes.

`PAGODA_WIDE_GEMM=bf16` keeps every product on oneDNN's bf16 kernel, `=fp32` takes the
float32 path from `FORCED_MIN_ROWS` rows without probing; the default, `auto`, probes.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# Row counts the probe tries, smallest first: the first at which float32 wins by MARGIN
# becomes the threshold. Below 128 rows the weight's widening (a pass over 3x its bf16
# bytes) costs as much as float32 saves.
PROBE_ROWS = (128, 256, 512)
MARGIN = 1.15
FORCED_MIN_ROWS = 128
# NOTE: a layer-sized shape (SmolLM2's gate_up is 576 x 3072, Llama-8B's 4096 x 28672):
# big enough that the timing is the kernel's, small enough that the probe takes ~0.1 s.
_PROBE_K, _PROBE_N = 1024, 2048

# NOTE: what the hot path reads: the threshold, or a row count no product reaches.
active_min_rows: int = sys.maxsize
_decided = False
_probe_report: dict[str, object] = {}


def mode() -> str:
    value = os.environ.get("PAGODA_WIDE_GEMM", "auto").strip().lower() or "auto"
    if value not in ("auto", "bf16", "fp32"):
        raise ValueError(f"PAGODA_WIDE_GEMM={value!r}: expected auto, bf16 or fp32")
    return value


def fp32_min_rows() -> int | None:
    """Rows from which a bf16 packed product runs in float32, or None (always bf16).
    None until `configure()` has run in this process."""
    return None if active_min_rows == sys.maxsize else active_min_rows


def probe_report() -> dict[str, object]:
    """What the last probe measured (ms per call at each row count), for `bench profile`."""
    return dict(_probe_report)


def _best_ms(fn, repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def widened_linear(x: torch.Tensor, packed: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T (+ b) in float32 on the packed bf16 weight widened for this call, rounded to
    x's dtype."""
    w = packed.to_dense(torch.float32)
    out = F.linear(x.float(), w, None if bias is None else bias.float())
    return out.to(x.dtype)


def _probe() -> int | None:
    from pagoda.quant.unquantized import can_pack, pack_weight, packed_linear

    weight = torch.randn(_PROBE_N, _PROBE_K, dtype=torch.bfloat16)
    if not can_pack(weight) or (packed := pack_weight(weight)) is None:
        _probe_report.update(reason="oneDNN does not pack bf16 here")
        return None
    timings = {}
    chosen = None
    for rows in PROBE_ROWS:
        x = torch.randn(rows, _PROBE_K, dtype=torch.bfloat16)
        bf16 = _best_ms(lambda x=x: packed_linear(x, packed))
        fp32 = _best_ms(lambda x=x: widened_linear(x, packed))
        timings[rows] = {"bf16_ms": round(bf16, 3), "fp32_ms": round(fp32, 3)}
        if bf16 >= MARGIN * fp32:
            chosen = rows
            break
    _probe_report.update(timings=timings, shape=f"rows x {_PROBE_K} x {_PROBE_N}")
    return chosen


def configure() -> int | None:
    """Decides the threshold once per process (the probe runs on first call); returns it."""
    global _decided, active_min_rows
    if _decided:
        return fp32_min_rows()
    chosen = mode()
    _probe_report.clear()
    _probe_report["mode"] = chosen
    if chosen == "bf16":
        rows = None
    elif chosen == "fp32":
        rows = FORCED_MIN_ROWS
    else:
        rows = _probe()
        logger.info("wide bf16 GEMMs: %s (%s)",
                    "oneDNN bf16" if rows is None else f"float32 from {rows} rows",
                    _probe_report.get("timings", _probe_report.get("reason")))
    _probe_report["fp32_min_rows"] = rows
    active_min_rows = sys.maxsize if rows is None else rows
    _decided = True
    return rows


def reset() -> None:
    """Forgets the decision (tests; the next `configure()` decides again)."""
    global _decided, active_min_rows
    _decided = False
    active_min_rows = sys.maxsize
    _probe_report.clear()
