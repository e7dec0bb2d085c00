"""Optional C++ CPU kernels, built on first use with torch's JIT extension loader.

Contract: `paged_decode_attention` returns the decode attention output, or None when the
kernel is unavailable (disabled, no compiler, failed build) or the inputs are unsupported,
in which case the caller keeps its reference path. A failed build logs one warning and is
never retried in this process.

`PAGODA_DISABLE_CPU_KERNELS=1` forces the reference path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp",
    Path(__file__).parent / "csrc" / "fused_ops_cpu.cpp",
]
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
_lock = threading.Lock()
_module: ModuleType | None = None
_load_failed = False
build_seconds: float | None = None  # wall time of the load in this process (build or cache hit)


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


def _cpu_flags_tag() -> str:
    """A short hash of this CPU's feature flags (the `flags` line of /proc/cpuinfo).

    NOTE: the build uses -march=native, so the same source and flags compile to different
    code on different CPUs; torch caches builds by name, so the name carries this tag and a
    shared cache dir never hands one CPU the build of another (e.g. AVX512_BF16 code to a
    CPU without it). "generic" where /proc/cpuinfo is unreadable (not Linux).
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    flags = " ".join(sorted(value.split()))
                    return hashlib.sha256(flags.encode()).hexdigest()[:10]
    except OSError:
        pass
    return "generic"


def _sources_tag() -> str:
    """A short hash of the C++ sources.

    NOTE: torch's loader keeps one build per name and rebuilds in place when the sources
    change; two checkouts (or two installed versions) sharing the cache dir would then
    rebuild over each other. A name per source version lets them coexist.
    """
    digest = hashlib.sha256()
    for path in _SOURCES:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:8]


def extension_name() -> str:
    return f"pagoda_paged_attention_cpu_{_cpu_flags_tag()}_{_sources_tag()}"


def _announce_first_build(name: str) -> None:
    """A one-line notice when `name` has no cached build: the build is silent otherwise."""
    from torch.utils.cpp_extension import _get_build_directory

    if not any(Path(_get_build_directory(name, False)).glob(f"{name}*.so")):
        print("pagoda: building CPU kernels, once, ~40 s ...", file=sys.stderr, flush=True)


def load_extension() -> ModuleType | None:
    """Build (or load the cached build of) the extension; None if it cannot be built."""
    global _module, _load_failed, build_seconds
    if _module is not None or _load_failed or kernels_disabled():
        return _module
    with _lock:
        if _module is not None or _load_failed:
            return _module
        start = time.perf_counter()
        try:
            from torch.utils.cpp_extension import load

            _ensure_ninja_on_path()
            _announce_first_build(extension_name())
            _module = load(
                name=extension_name(),
                sources=[str(p) for p in _SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as exc:  # noqa: BLE001 - any build failure means "use the reference"
            _load_failed = True
            logger.warning("pagoda CPU kernels unavailable, using the PyTorch path: %s", exc)
            return None
        build_seconds = time.perf_counter() - start
        logger.info("pagoda CPU kernels loaded in %.1f s", build_seconds)
        return _module


def supports_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel handles these inputs (CPU, float32/bfloat16, contiguous caches)."""
    return (
        q.device.type == "cpu"
        and k_cache.device.type == "cpu"
        and q.dtype in _SUPPORTED_DTYPES
        and k_cache.dtype in _SUPPORTED_DTYPES
        and v_cache.dtype == k_cache.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and q.shape[1] % k_cache.shape[2] == 0
    )


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [N, bs, Hk, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64 or int32
    seq_lens: torch.Tensor,  # [B] int64
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor | None:
    """Attention of each query over positions [max(0, len - window), len) of its sequence.

    Returns [B, H, D] in q's dtype, or None if the kernel is unavailable or unsupported.
    """
    if kernels_disabled() or not supports_decode(q, k_cache, v_cache):
        return None
    ext = load_extension()
    if ext is None:
        return None
    q = q.contiguous()
    out = torch.empty_like(q)
    window = -1 if sliding_window is None else int(sliding_window)
    ext.paged_decode_attention(
        out, q, k_cache, v_cache, block_tables, seq_lens, float(scale), window
    )
    return out


# The fused element-wise ops (csrc/fused_ops_cpu.cpp) run in the low-precision dtypes only:
# float32 stays on PyTorch's ops, the path that matches transformers bit for bit.
FUSED_DTYPES = (torch.bfloat16, torch.float16)


def fused_ops_for(x: torch.Tensor) -> ModuleType | None:
    """The extension, if its fused ops should handle `x` (CPU, bf16/fp16), else None."""
    if x.device.type != "cpu" or x.dtype not in FUSED_DTYPES or kernels_disabled():
        return None
    return _module if _module is not None else load_extension()
