"""CPU kernels of the quantized-weight ops (wquant.py), from csrc/quant_cpu.cpp.

Which calls they take (anything else runs the reference):
  gguf_linear  Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K;
  wq_linear    codes of up to 8 bits whose group size is a multiple of 32 (or covers K);
  int8_linear  any shape (W8A8, bit-identical to the reference);
  fp8_linear   e4m3fn weights with per-tensor, per-channel or per-block scales (blocks of a
               multiple of 16 input columns): up to FP8_GEMV_MAX_ROWS activation rows each
               code widened in registers (csrc/fp8_cpu.cpp), more rows the weight
               dequantized to bf16 per call and oneDNN's bf16 GEMM;
with x bfloat16 (int8_linear also float32: it is exact), on a CPU whose flags hold what the
extension was compiled for (AVX-512 F/BW/VL, or AVX2 + FMA + F16C; VNNI is used where
compiled; the fp8 kernels have both vector paths too: `fp8_allowed()`), when the
weight went through `wquant.prepare(op, w, "cpu", dtype)` with a dtype the kernel takes (or
None): the preparers build nothing for other dtypes (a float32 model never runs them).
`PAGODA_DISABLE_CPU_KERNELS=1` forces the reference.

Rounding: gguf_linear and wq_linear quantize the activations to int8 per block of 32 (16
for Q6_K) before the integer dot products (llama.cpp's scheme), in the panel kernel
(csrc/quant_cpu.cpp). Where the CPU has AMX (amx_bf16, tiles granted), wider products
run bf16 activations against the weight dequantized to bf16 instead: from `AMX_MIN_ROWS`
(32) rows `q_linear_amx` (each panel of 16 output rows dequantized into a per-thread
buffer in AMX's B-tile layout, then TDPBF16PS per 16 rows x 32 columns: no dequantized
copy in memory; a row's result does not depend on the other rows), from
`AMX_WIDE_MIN_ROWS` (1,408) the whole weight dequantized a tile at a time through ATen's
bf16 GEMM (`q_linear_tiles`: oneDNN's AMX kernel; from `WIDE_MIN_ROWS` = 128 where the AMX
kernel is not built). Without AMX the panel kernel wins at every row count measured (AMD
EPYC, AVX-512 BF16), so it runs everywhere else. The paths round differently (int8
activations against bf16 activations and weights, and float32 sums in other orders), so on
an AMX CPU a bf16 row's result depends on the row count of its step: exact batch invariance
stays with float32 models, which run the reference. `PAGODA_QUANT_WIDE=int8` keeps every
product on the panel kernel, `=bf16` takes only the tiled path (from WIDE_MIN_ROWS rows, on
any CPU), `=amx` requires the AMX kernel; `auto` (the default) decides by AMX.

The extension is a second module beside cpu_kernels' (whose sources belong to other ops),
built by the same loader (`cpu_kernels.load_built`: named by CPU flags, sources and
`PAGODA_CPU_MARCH`'s -march= target, built once under a lock, a failed build never retried
in the process).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from pagoda.cpu_features import request_amx_tiles
from pagoda.ops import cpu_kernels, quant_layouts, wquant
from pagoda.ops.quant_layouts import BlockLayout
from pagoda.ops.registry import OPS, Kernel

logger = logging.getLogger(__name__)

NAME = "cpp"  # the key of this kernel's layout in w.kernel_data
# NOTE: gguf_linear and wq_linear quantize activations to int8, another product than the
# dequantized weight's: float32, the dtype exact against transformers, keeps the reference.
DTYPES = frozenset({torch.bfloat16})
EXACT_DTYPES = frozenset({torch.float32, torch.bfloat16})
# The vector paths quant_cpu.cpp compiles: one of them must be there for the kernels to run.
REQUIRED_ISA = (("avx512f", "avx512bw", "avx512vl"), ("avx2", "fma", "f16c"))
_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("quant_cpu.cpp", "fp8_cpu.cpp")]
# NOTE: part of the build name (not compiled on their own): a change to them rebuilds.
_HEADERS = [Path(__file__).parent / "csrc" / h for h in ("vec_lanes_cpu.h", "q_gemv_abi.h", "amx_tiles_cpu.h")]
_module: ModuleType | None = None
_load_failed = False
_allowed: bool | None = None
_wide_rows: int | None = None
_amx_rows: int | None = None


def extension_name() -> str:
    return cpu_kernels.build_name("pagoda_quant_cpu", [*_SOURCES, *_HEADERS])


def load_extension() -> ModuleType | None:
    """Build (or import the finished build of) the quant extension; None if it cannot."""
    global _module, _load_failed
    if _module is None and not _load_failed and not cpu_kernels.kernels_disabled():
        _module = cpu_kernels.load_built(extension_name(), _SOURCES, "quantized CPU kernels")
        _load_failed = _module is None
    return _module


def isa_allows(compiled: list[str] | tuple[str, ...], flags: frozenset[str]) -> bool:
    """`cpu_kernels.paths_allow` for the quant kernels' vector paths (`REQUIRED_ISA`)."""
    return cpu_kernels.paths_allow(REQUIRED_ISA, compiled, flags)


def resolve() -> ModuleType | None:
    """The extension when its kernels may run here, else None (the reference runs)."""
    global _allowed
    if cpu_kernels.kernels_disabled():
        return None
    ext = _module if _module is not None else load_extension()
    if ext is None:
        return None
    if _allowed is None:
        compiled = ext.kernel_isa()["quant"]
        _allowed = isa_allows(compiled, cpu_kernels.cpu_flags())
        if _allowed:
            _configure_wide(ext)
        else:
            logger.warning("pagoda quant CPU kernels not used here: compiled for %s; they run "
                           "where the CPU has those flags and one of the vector paths %s",
                           compiled or "scalar code only", [list(p) for p in REQUIRED_ISA])
    return ext if _allowed else None


# ---- preparers: the layout, built once per weight object --------------------------------
def _takes(dtype: torch.dtype | None, dtypes: frozenset[torch.dtype]) -> bool:
    return (dtype is None or dtype in dtypes) and resolve() is not None


def _prepare_gguf(w: wquant.GGUFWeight, dtype: torch.dtype | None) -> None:
    if w.qtype in quant_layouts.GGUF_BLOCK and _takes(dtype, DTYPES):
        if w.layout is None:
            w.layout = quant_layouts.from_gguf(w.raw, w.qtype, tuple(w.shape))
        w.kernel_data[NAME] = w.layout


def wq_supported(w: wquant.GroupQuantWeight) -> bool:
    lay = w.layout
    return lay.group % lay.block == 0 or lay.group >= lay.shape[1]


def _prepare_wq(w: wquant.GroupQuantWeight, dtype: torch.dtype | None) -> None:
    # NOTE: the weight's own storage is the kernel's layout: nothing is built or copied.
    if wq_supported(w) and w.layout.codes.device.type == "cpu" and _takes(dtype, DTYPES):
        w.kernel_data[NAME] = w.layout


def _prepare_int8(w: wquant.Int8Weight, dtype: torch.dtype | None) -> None:
    if _takes(dtype, EXACT_DTYPES):
        w.kernel_data[NAME] = quant_layouts.int8_codes(w.qweight)


@dataclass(frozen=True, slots=True)
class Fp8Layout:
    codes: torch.Tensor  # uint8 [N, K]: the e4m3fn weight's own bytes (a view)
    scales: torch.Tensor  # float32 [N, ceil(K / kblock)]
    kblock: int


def fp8_layout(w: wquant.Fp8Weight) -> Fp8Layout | None:
    """The kernel's view of an fp8 weight: its bytes and one scale per (row, K block); None
    for blocks the kernel does not take (K blocks neither a multiple of 16 nor all of K)."""
    n, k = w.weight.shape
    s = w.scale.float()
    if w.block is None:
        scales, kblock = (s.reshape(n, 1) if s.numel() == n else s.reshape(1, 1).expand(n, 1)), k
    else:
        bn, kblock = w.block
        if kblock % 16 and kblock < k:
            return None
        scales = s.repeat_interleave(bn, 0)[:n]
    return Fp8Layout(w.weight.contiguous().view(torch.uint8), scales.contiguous(), kblock)


def fp8_allowed() -> bool:
    """Whether the fp8 kernels (AVX-512 or AVX2) were compiled for this CPU's vector path."""
    ext = resolve()
    return ext is not None and bool(ext.kernel_isa().get("fp8"))


def _prepare_fp8(w: wquant.Fp8Weight, dtype: torch.dtype | None) -> None:
    if w.weight.device.type == "cpu" and _takes(dtype, DTYPES) and fp8_allowed():
        layout = fp8_layout(w)
        if layout is not None:
            w.kernel_data[NAME] = layout


# ---- wide products: the panel kernel, AMX tiles, or dequantized weights through oneDNN ---
# NOTE: on an AMX Xeon, over all of SmolLM2's layer products in a row, q_linear_amx is
# ahead of the panel kernel from 32 rows (24: even), and of the dequantized weight through
# oneDNN up to 1,280 rows (even at 1,408, behind from 1,536); without q_linear_amx the
# dequantized weight is ahead from 128 rows (docs/quantization.md).
AMX_MIN_ROWS = 32
AMX_WIDE_MIN_ROWS = 1408
WIDE_MIN_ROWS = 128


@dataclass(frozen=True, slots=True)
class WidePaths:
    """Which bf16 gguf/wq products leave the int8 panel kernel: q_linear_amx for rows in
    [amx_min_rows, wide_min_rows), the dequantized tiles through oneDNN from wide_min_rows
    (None: never)."""

    amx_min_rows: int | None
    wide_min_rows: int | None


def wide_mode() -> str:
    value = os.environ.get("PAGODA_QUANT_WIDE", "auto").strip().lower() or "auto"
    if value not in ("auto", "int8", "bf16", "amx"):
        raise ValueError(f"PAGODA_QUANT_WIDE={value!r}: expected auto, int8, bf16 or amx")
    return value


def amx_allowed(flags: frozenset[str], amx_usable: bool, amx_compiled: bool) -> bool:
    """Whether q_linear_amx can run: the CPU lists amx_bf16, this process was granted the
    tiles, and the extension was built with the kernel."""
    return "amx_bf16" in flags and amx_usable and amx_compiled


def decide_wide_paths(mode: str, flags: frozenset[str], amx_usable: bool,
                      amx_compiled: bool) -> WidePaths:
    """auto: on a CPU with usable bf16 AMX, q_linear_amx (where built) and the tiles; else
    the panel kernel alone. bf16: the tiles alone (any CPU); amx: auto's choice, refused
    where the AMX kernel cannot run; int8: the panel kernel alone."""
    can_amx = amx_allowed(flags, amx_usable, amx_compiled)
    if mode == "amx" and not can_amx:
        raise ValueError("PAGODA_QUANT_WIDE=amx: this CPU or build has no usable bf16 AMX "
                         f"(amx_bf16 listed: {'amx_bf16' in flags}, tiles granted: "
                         f"{amx_usable}, kernel built: {amx_compiled})")
    if mode == "int8" or (mode == "auto" and not ("amx_bf16" in flags and amx_usable)):
        return WidePaths(None, None)
    if mode == "bf16" or not can_amx:
        return WidePaths(None, WIDE_MIN_ROWS)
    return WidePaths(AMX_MIN_ROWS, AMX_WIDE_MIN_ROWS)


def wide_min_rows() -> int | None:
    """This process's choice (`decide_wide_paths`), once the extension resolved."""
    return _wide_rows


def amx_min_rows() -> int | None:
    """Rows from which this process's bf16 products run q_linear_amx (None: never)."""
    return _amx_rows


def set_wide_min_rows(ext: ModuleType, rows: int | None) -> None:
    """Sets the rows from which bf16 products take the tiled path (None: never), in this
    process; tests and `bench kernels` pin one path with it (with `set_amx_min_rows`)."""
    global _wide_rows
    _wide_rows = rows
    ext.set_wide_min_rows(sys.maxsize if rows is None else rows)
    _push_amx_rows(ext)


def set_amx_min_rows(ext: ModuleType, rows: int | None) -> None:
    """Sets the rows from which bf16 products take q_linear_amx (None: never), up to the
    tiled path's first row; only where `amx_kernel_runs()`."""
    global _amx_rows
    if rows is not None and not amx_kernel_runs(ext):
        raise ValueError("q_linear_amx does not run here")
    _amx_rows = rows
    _push_amx_rows(ext)


def _push_amx_rows(ext: ModuleType) -> None:
    if _amx_rows is None:
        ext.set_amx_rows(sys.maxsize, 0)
    else:
        ext.set_amx_rows(_amx_rows, sys.maxsize if _wide_rows is None else _wide_rows - 1)


def amx_kernel_runs(ext: ModuleType) -> bool:
    """Whether q_linear_amx was built and this process was granted AMX tiles."""
    return amx_allowed(cpu_kernels.cpu_flags(), request_amx_tiles().usable,
                       bool(ext.amx_compiled()))


def _configure_wide(ext: ModuleType) -> None:
    flags, amx = cpu_kernels.cpu_flags(), request_amx_tiles().usable
    paths = decide_wide_paths(wide_mode(), flags, amx, bool(ext.amx_compiled()))
    global _amx_rows
    _amx_rows = paths.amx_min_rows
    set_wide_min_rows(ext, paths.wide_min_rows)
    logger.info("quantized bf16 products: %s%s",
                "" if _amx_rows is None else f"AMX tiles from {_amx_rows} rows, ",
                "the int8 panel kernel at every row count" if _wide_rows is None
                else f"dequantized bf16 weights through oneDNN from {_wide_rows} rows")


# ---- kernels -------------------------------------------------------------------------------
def block_linear(ext: ModuleType, x: torch.Tensor, lay: BlockLayout,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ w.T (+ bias) for a panel layout: activations quantized to int8 per block,
    or, bf16 from `amx_min_rows()` / `wide_min_rows()` rows, the weight dequantized to bf16
    (q_linear decides)."""
    n, k = lay.shape
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = ext.q_linear(x2, lay.codes, lay.scales, lay.offsets, lay.bits, lay.block, lay.group,
                     lay.zero_form, n, bias)
    return y.view(*x.shape[:-1], n)


def _gguf_linear(ext, x, w, bias=None):
    return block_linear(ext, x, w.kernel_data[NAME], bias)


def _wq_linear(ext, x, w, bias=None):
    if w.perm is not None:
        x = x.index_select(-1, w.perm)
    return block_linear(ext, x, w.kernel_data[NAME], bias)


def dequantize_rows(lay: BlockLayout, rows: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor | None:
    """`lay.dequantize_rows(rows).to(dtype)` (float32 or bfloat16, bit for bit) in one
    extension call, for a token table's lookups; None where the extension does not run here
    or does not take the layout (the caller uses the reference)."""
    ext = resolve()
    if (ext is None or dtype not in EXACT_DTYPES or lay.codes.device.type != "cpu"
            or lay.group != lay.block or rows.device.type != "cpu"):
        return None
    out = torch.empty(len(rows), lay.shape[1], dtype=dtype)
    ext.dequant_rows(out, lay.codes, lay.scales, lay.offsets, lay.bits, lay.group,
                     lay.zero_form, lay.shape[0], rows.to(torch.int64).contiguous())
    return out


def dense_panels(lay: BlockLayout) -> torch.Tensor | None:
    """The layout's weight dequantized once into q_linear_amx's buffer layout (`w = s q + m`
    in float32, one rounding to bf16, as every bf16 path dequantizes): [panels, kp * 16]
    bf16, for a dense copy that `panels_linear` reads. None where q_linear_amx does not run
    in this process (no AMX tiles granted, or not built)."""
    ext = resolve()
    if ext is None or _amx_rows is None or lay.codes.device.type != "cpu":
        return None
    n, k = lay.shape
    return ext.dequantize_panels(lay.codes, lay.scales, lay.offsets, lay.bits, lay.block,
                                 lay.group, lay.zero_form, n, k)


def panels_linear(x: torch.Tensor, panels: torch.Tensor, n: int,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] (bf16) @ w.T (+ bias) from a `dense_panels` copy: q_linear_amx's bits."""
    ext = resolve()
    assert ext is not None, "a dense_panels copy exists only where the extension runs"
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    return ext.q_linear_panels(x2, panels, n, bias).view(*x.shape[:-1], n)


def _int8_linear(ext, x, w, bias=None):
    k = w.qweight.shape[1]
    x2 = x.reshape(-1, k)
    y = ext.i8_linear(x2.contiguous(), w.kernel_data[NAME], w.scales, bias)
    return y.view(*x.shape[:-1], w.qweight.shape[0])


# NOTE: activation rows up to which widening every code per call beats dequantizing the
# weight to bf16 and oneDNN's GEMM (measured per shape: docs/quantization.md).
FP8_GEMV_MAX_ROWS = 8


_fp8_buffers = threading.local()


def _fp8_scratch(n: int, k: int) -> torch.Tensor:
    """This thread's bf16 [n, k] buffer for a dequantized fp8 weight, reused by every layer
    of that shape: a fresh tensor each call was mostly page faults (a 576 x 49152 weight:
    20 ms, above glibc's mmap threshold every allocation maps new pages)."""
    buffers = getattr(_fp8_buffers, "by_shape", None)
    if buffers is None:
        buffers = _fp8_buffers.by_shape = {}
    buf = buffers.get((n, k))
    if buf is None:
        buf = buffers[(n, k)] = torch.empty(n, k, dtype=torch.bfloat16)
    return buf


def _fp8_linear(ext, x, w, bias=None):
    lay: Fp8Layout = w.kernel_data[NAME]
    n, k = lay.codes.shape
    x2 = x.reshape(-1, k)
    if x2.shape[0] <= FP8_GEMV_MAX_ROWS:
        y = ext.fp8_gemv(x2.contiguous(), lay.codes, lay.scales, lay.kblock, bias)
    else:
        wb = _fp8_scratch(n, k)
        ext.fp8_dequant(lay.codes, lay.scales, lay.kblock, wb)
        y = torch.nn.functional.linear(x2, wb, None if bias is None else bias.to(x.dtype))
    return y.view(*x.shape[:-1], n)


def _has_layout(x, w, bias=None) -> bool:
    return NAME in w.kernel_data and x.shape[-1] == w.shape[1] and x.device.type == "cpu"


def _int8_has_layout(x, w, bias=None) -> bool:
    return NAME in w.kernel_data and x.shape[-1] == w.qweight.shape[1]


def register() -> None:
    for op, fn, prep, supports, dtypes in (
        ("gguf_linear", _gguf_linear, _prepare_gguf, _has_layout, DTYPES),
        ("wq_linear", _wq_linear, _prepare_wq, _has_layout, DTYPES),
        ("int8_linear", _int8_linear, _prepare_int8, _int8_has_layout, EXACT_DTYPES),
        ("fp8_linear", _fp8_linear, _prepare_fp8, _has_layout, DTYPES),
    ):
        OPS[op].register("cpu", Kernel(NAME, fn, dtypes, resolve, supports))
        wquant.register_preparer(op, "cpu", prep)
