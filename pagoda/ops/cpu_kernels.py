"""The optional C++ CPU kernels (csrc/), built on first use with torch's JIT extension loader.

Contract: `kernel_for(op)` returns the extension when its kernel for `op` ("paged_attention",
"paged_prefill_attention" or "fused_ops") may run here, else None: disabled, no compiler,
a failed build (one warning, never retried in this process), or an instruction-set
mismatch. The build uses -march=native (or `PAGODA_CPU_MARCH`); the extension reports the
instruction-set subsets each op's vector path was compiled with (`kernel_isa()`), and an op
runs only when the CPU's flags hold all of them and one of its required paths (`REQUIRED_ISA`)
was compiled in (the fused ops' scalar fallback is slower than PyTorch's ops, so such a CPU
uses the reference instead). Never SIGILL, never a silent slow path.

`PAGODA_DISABLE_CPU_KERNELS=1` forces the reference path. `PAGODA_CPU_MARCH` (default
`native`) is the `-march=` target of both extensions' builds (this one and quant_cpu's), part
of their build names, so builds for several targets coexist in the cache: e.g. `x86-64-v3`
builds the AVX2 + FMA + F16C paths on an AVX-512 machine (how the tests check those paths
there). A target is letters, digits, `_`, `.` and `-` (else a ValueError); one above this CPU
is the caller's risk: the ISA check covers the vector paths, not code the compiler generates.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

from pagoda.ops.build_progress import build_notice

logger = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp",
    Path(__file__).parent / "csrc" / "fused_ops_cpu.cpp",
    Path(__file__).parent / "csrc" / "paged_prefill_cpu.cpp",
    Path(__file__).parent / "csrc" / "paged_prefill_amx_cpu.cpp",
    Path(__file__).parent / "csrc" / "decoder_layer_cpu.cpp",
]
# Included by the sources: part of the build's inputs (its hash), not compiled on their own.
_HEADERS = [
    Path(__file__).parent / "csrc" / h
    for h in ("kv_quant_cpu.h", "attention_cpu.h", "fused_ops_cpu.h", "fused_vec_cpu.h",
              "vec_lanes_cpu.h", "q_gemv_abi.h", "amx_tiles_cpu.h", "index_args_cpu.h",
              "decode_attention_cpu.h")
]
_LDFLAGS = ("-fopenmp",)
_MARCH = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# NOTE: a build takes ~1.5 min on a loaded 2-core machine; a lock this old has no owner.
_STALE_LOCK_S = 30 * 60
# The vector paths an op's kernel is worth calling with: the subsets one of them must have
# compiled in.
REQUIRED_ISA: dict[str, tuple[tuple[str, ...], ...]] = {
    "paged_attention": ((),),  # NOTE: its portable path is still faster than gather + SDPA
    "fused_ops": (("avx512f", "avx512bw", "avx512vl"), ("avx2", "fma", "f16c")),
    # NOTE: else prefill rows take the decode kernel
    "paged_prefill_attention": (("avx512f",), ("avx2", "fma")),
}
_lock = threading.Lock()
_builds: dict[str, ModuleType | None] = {}  # name -> the loaded build; None: it failed
_module: ModuleType | None = None  # this module's extension, once loaded
_load_failed = False
_allowed: dict[str, bool] = {}  # op -> the instruction-set decision, made once per process


def kernels_disabled() -> bool:
    return os.environ.get("PAGODA_DISABLE_CPU_KERNELS", "0") not in ("", "0")


def _ensure_ninja_on_path() -> None:
    # NOTE: torch finds ninja on PATH only; the pip `ninja` wheel puts it beside the venv's
    # python, which is not on PATH when the venv is not activated.
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def cpu_march() -> str:
    """The builds' -march= target: `PAGODA_CPU_MARCH`, default native; a ValueError for a
    value that is no plain target name."""
    march = os.environ.get("PAGODA_CPU_MARCH", "native")
    if not _MARCH.fullmatch(march):
        raise ValueError(
            f"PAGODA_CPU_MARCH={march!r} is not a -march= target: expected e.g. native or "
            "x86-64-v3 (letters, digits, '_', '.' and '-', starting with a letter or digit)")
    return march


def cflags() -> list[str]:
    """The compiler flags of both extensions' builds."""
    return ["-O3", f"-march={cpu_march()}", "-fopenmp"]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (the `flags` line of /proc/cpuinfo); empty where unreadable."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def _cpu_flags_tag() -> str:
    """A short hash of this CPU's feature flags.

    NOTE: a native build (-march=native) of the same source and flags compiles to different
    code on different CPUs; torch caches builds by name, so the name carries this tag and a
    shared cache dir never hands one CPU the build of another (e.g. AVX512_BF16 code to a
    CPU without it). "generic" where /proc/cpuinfo is unreadable (not Linux).
    """
    flags = cpu_flags()
    if not flags:
        return "generic"
    return hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:10]


def build_name(prefix: str, inputs: Sequence[Path]) -> str:
    """`prefix` (+ the -march target where it is not native) + this CPU's flags tag + a short
    hash of the build's inputs (sources and headers), the compiler flags and the torch version.

    NOTE: torch's loader keeps one build per name and rebuilds in place when the sources
    change; two checkouts (or two installed versions) sharing the cache dir would then
    rebuild over each other. A name per build input lets them coexist, and lets a finished
    build be imported as is (`_import_built`).
    """
    digest = hashlib.sha256()
    for path in inputs:
        digest.update(path.read_bytes())
    digest.update(" ".join([*cflags(), *_LDFLAGS, torch.__version__]).encode())
    march = cpu_march()
    if march != "native":  # NOTE: a module name is an identifier: the hash holds the exact value
        prefix = f"{prefix}_{re.sub(r'[^A-Za-z0-9]', '_', march)}"
    return f"{prefix}_{_cpu_flags_tag()}_{digest.hexdigest()[:8]}"


def extension_name() -> str:
    return build_name("pagoda_paged_attention_cpu", [*_SOURCES, *_HEADERS])


def build_directory(name: str) -> Path:
    """Where the build of `name` lives (under TORCH_EXTENSIONS_DIR or torch's default root)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / "pagoda" / name


def _import_built(name: str, build_dir: Path) -> ModuleType | None:
    """The finished build of an earlier process, imported directly; None if there is none.

    NOTE: torch's loader takes a lock file in the build dir on every load, even when
    nothing needs building, and waits forever on a lock left by a process killed inside
    that window (a server stopped while starting): every later start then hangs. The name
    already pins every build input, so an existing library is the right one.
    """
    path = build_dir / f"{name}.so"
    if not path.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as exc:  # e.g. a link cut short: build again
        logger.warning("pagoda CPU kernels: cannot import %s (%s), rebuilding", path, exc)
        return None
    return module


def _remove_stale_lock(build_dir: Path) -> None:
    lock = build_dir / "lock"
    with contextlib.suppress(OSError):
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink()
            logger.warning("pagoda CPU kernels: removed a stale build lock %s", lock)


def load_built(name: str, sources: Sequence[Path], what: str) -> ModuleType | None:
    """The extension `name` (from `build_name`) compiled from `sources`: the finished
    build of an earlier process imported, else built here (a notice naming `what`), once
    per process; None, with one warning and never retried, where it cannot be built."""
    if name in _builds:
        return _builds[name]
    with _lock:
        if name not in _builds:
            _builds[name] = _build_or_import(name, sources, what)
        return _builds[name]


def _build_or_import(name: str, sources: Sequence[Path], what: str) -> ModuleType | None:
    start = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load

        build_dir = build_directory(name)
        module = _import_built(name, build_dir)
        if module is None:
            build_dir.mkdir(parents=True, exist_ok=True)
            _remove_stale_lock(build_dir)
            _ensure_ninja_on_path()
            with build_notice(what, expected_s=40):
                # NOTE: copies: torch appends its libraries to extra_ldflags in place, which
                # changed every later build name of the process (another hash, a rebuild).
                module = load(name=name, sources=[str(p) for p in sources],
                              extra_cflags=cflags(), extra_ldflags=list(_LDFLAGS),
                              build_directory=str(build_dir), verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the reference"
        logger.warning("pagoda %s unavailable, using the reference: %s", what, exc)
        return None
    logger.info("pagoda %s loaded in %.1f s", what, time.perf_counter() - start)
    return module


def load_extension() -> ModuleType | None:
    """The extension of the ops in `REQUIRED_ISA` (`load_built`); None if it cannot be
    built or the kernels are disabled."""
    global _module, _load_failed
    if _module is None and not _load_failed and not kernels_disabled():
        _module = load_built(extension_name(), _SOURCES, "CPU kernels")
        _load_failed = _module is None
        if _module is not None:
            configure_prefill_amx(_module)
            configure_kv_prefetch(_module)
    return _module


KV_PREFETCH_MODES = ("auto", "l1", "l2")


def kv_prefetch_level(mode: str, vendor: str) -> str:
    """Where decode attention's software prefetches of K/V rows land under
    `PAGODA_KV_PREFETCH` = `mode`: l1 or l2 as asked; auto: l2 on AMD, l1 elsewhere.
    Zen's L1 can wait on few lines at once and its L2 on many more, so L1 prefetches cap a
    core's read rate there (measured: attention_cpu.h, g_kv_prefetch_l2); on the AMX Xeons
    L2 prefetches were slower."""
    if mode not in KV_PREFETCH_MODES:
        raise ValueError(f"PAGODA_KV_PREFETCH={mode!r}: expected one of {list(KV_PREFETCH_MODES)}")
    if mode != "auto":
        return mode
    return "l2" if vendor == "AuthenticAMD" else "l1"


def kv_prefetch_mode() -> str:
    """`PAGODA_KV_PREFETCH` as `kv_prefetch_level` takes it (default auto)."""
    return os.environ.get("PAGODA_KV_PREFETCH", "auto").strip().lower() or "auto"


def configure_kv_prefetch(ext: ModuleType) -> str:
    """Set decode attention's prefetch level in `ext` (once per load); the level set."""
    from pagoda.cpu_features import cpu_vendor

    mode = kv_prefetch_mode()
    level = kv_prefetch_level(mode, cpu_vendor())
    ext.set_kv_prefetch_l2(level == "l2")
    logger.debug("decode attention prefetches K/V into %s (mode %s)", level.upper(), mode)
    return level


PREFILL_AMX_MODES = ("auto", "off")


def prefill_amx_allowed(mode: str, amx_usable: bool, compiled: bool) -> bool:
    """Whether bf16 prefill attention runs on AMX tiles (paged_prefill_amx_cpu.cpp) under
    `PAGODA_PREFILL_AMX` = `mode`: auto where the build has the path and this process may
    use bf16 AMX (the CPU lists amx_bf16 and arch_prctl granted the tiles), never with off."""
    if mode not in PREFILL_AMX_MODES:
        raise ValueError(f"PAGODA_PREFILL_AMX={mode!r}: expected one of {list(PREFILL_AMX_MODES)}")
    return mode == "auto" and amx_usable and compiled


def configure_prefill_amx(ext: ModuleType) -> bool:
    """Turn the AMX prefill path on or off in `ext` (once per load); whether it is on.
    NOTE (measured on the AMX Xeon, SmolLM2's 9 / 3 heads x 64, ms per layer, vector tiles ->
    AMX -> SDPA): 8 x 150 fresh tokens 2.4 -> 0.8 -> 1.5-1.7, 1 x 1,024 7.3 -> 2.4-2.6 ->
    2.7-3.3, 1 x 2,048 28 -> 9-10 -> 9-10 (docs/architecture.md)."""
    from pagoda.cpu_features import amx_bf16_usable

    mode = os.environ.get("PAGODA_PREFILL_AMX", "auto").strip().lower() or "auto"
    compiled = bool(ext.prefill_amx_compiled())
    on = prefill_amx_allowed(mode, compiled and amx_bf16_usable(), compiled)
    ext.set_prefill_amx(on)
    logger.debug("prefill attention on AMX tiles: %s (mode %s, compiled %s)", on, mode, compiled)
    return on


def prefill_amx_enabled() -> bool:
    """Whether bf16 prefill attention runs on AMX tiles in this process."""
    ext = kernel_for("paged_prefill_attention")
    return ext is not None and bool(ext.prefill_amx_enabled())


def paths_allow(paths: Sequence[Sequence[str]], compiled: Sequence[str],
                flags: frozenset[str]) -> bool:
    """Whether a kernel compiled for the `compiled` subsets may run on a CPU with `flags`:
    every compiled subset present (no SIGILL) and one of `paths` compiled whole (the rule of
    both extensions: this one's ops and quant_cpu's)."""
    return all(f in flags for f in compiled) and any(
        all(f in compiled for f in path) for path in paths)


def isa_allows(op: str, compiled: list[str] | tuple[str, ...], flags: frozenset[str]) -> bool:
    """`paths_allow` for `op`'s required paths (`REQUIRED_ISA`)."""
    return paths_allow(REQUIRED_ISA[op], compiled, flags)


def kernel_for(op: str) -> ModuleType | None:
    """The extension, if its kernel for `op` may run on this CPU; else None."""
    if kernels_disabled():
        return None
    ext = _module if _module is not None else load_extension()
    if ext is None:
        return None
    allowed = _allowed.get(op)
    if allowed is None:
        compiled = ext.kernel_isa()[op]
        allowed = _allowed[op] = isa_allows(op, compiled, cpu_flags())
        if not allowed:
            logger.warning(
                "pagoda CPU kernel %r not used here: compiled for %s, needs one of %s, CPU "
                "has %s", op, compiled or "scalar code only", [list(p) for p in REQUIRED_ISA[op]],
                sorted(f for f in cpu_flags() if f.startswith("avx") or f in ("fma", "f16c"))
                or "no AVX",
            )
    return ext if allowed else None
