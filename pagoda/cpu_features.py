"""What this CPU can run: its model name, the ISA flags pagoda's fast paths depend on, and
the AMX tile permission, which Linux grants a process only when it asks.

Since Linux 5.16 a process must request the AMX tile data state with
`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)` before its first tile instruction,
or that instruction faults. `request_amx_tiles()` makes the request once per process,
only where /proc/cpuinfo lists `amx_tile`, and never raises: a refusal (old kernel, a
hypervisor that hides the state) is a status that the caller falls back on (AVX-512), and
is logged once. This module must not import torch (the entrypoints read it before torch
loads).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# The flags that decide which kernels can run (bf16 dot products, AMX tiles, fp16, VNNI).
ISA_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16", "avx_vnni",
             "avx512_vnni")

_SYS_ARCH_PRCTL = 158  # x86-64 syscall number
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


@functools.cache
def _first_processor() -> dict[str, str]:
    """The fields of the first processor in /proc/cpuinfo (key -> value); {} if unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # NOTE: a blank line ends the first processor's block
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


@functools.cache
def cpu_info() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo; ("unknown", {}) if none."""
    fields = _first_processor()
    name = fields.get("model name") or platform.processor() or "unknown"
    return name, frozenset(fields.get("flags", "").split())


def cpu_vendor() -> str:
    """The first processor's vendor_id in /proc/cpuinfo (GenuineIntel, AuthenticAMD, ...);
    "unknown" if none."""
    return _first_processor().get("vendor_id") or "unknown"


def isa_report(flags: frozenset[str] | None = None) -> dict[str, bool]:
    """Each flag of ISA_FLAGS -> whether the CPU lists it."""
    flags = cpu_info()[1] if flags is None else flags
    return {f: f in flags for f in ISA_FLAGS}


@dataclass(frozen=True, slots=True)
class AmxStatus:
    """`usable`: tile instructions may run in this process. `reason` says why, in words."""

    usable: bool
    reason: str


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _arch_prctl(code: int, arg: object) -> tuple[int, int]:
    """(return value, errno) of the raw arch_prctl syscall."""
    ret = _libc().syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(code), arg)
    return int(ret), ctypes.get_errno()


def _already_permitted() -> bool:
    perm = ctypes.c_ulong(0)
    ret, _ = _arch_prctl(_ARCH_GET_XCOMP_PERM, ctypes.byref(perm))
    return ret == 0 and bool(perm.value & (1 << _XFEATURE_XTILEDATA))


def request_amx_status(flags: frozenset[str] | None = None) -> AmxStatus:
    """Ask the kernel for AMX tile data (no caching, no logging); never raises."""
    flags = cpu_info()[1] if flags is None else flags
    if "amx_tile" not in flags:
        return AmxStatus(False, "not requested: the CPU does not list amx_tile")
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return AmxStatus(False, f"not requested: {platform.system()} {platform.machine()} "
                         "(the request is a Linux x86-64 syscall)")
    try:
        if _already_permitted():
            return AmxStatus(True, "granted (already permitted in this process)")
        ret, errno = _arch_prctl(_ARCH_REQ_XCOMP_PERM, ctypes.c_ulong(_XFEATURE_XTILEDATA))
    except (OSError, AttributeError, ValueError) as error:
        return AmxStatus(False, f"not requested: no syscall through libc ({error})")
    if ret == 0:
        return AmxStatus(True, "granted by arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)")
    return AmxStatus(False, f"refused by the kernel: {os.strerror(errno)} (errno {errno}); "
                     "AVX-512 paths run instead")


def amx_bf16_usable() -> bool:
    """Whether bf16 AMX runs in this process: the CPU lists amx_bf16 and the kernel granted
    the tiles (`request_amx_tiles`, asked once per process)."""
    return "amx_bf16" in cpu_info()[1] and request_amx_tiles().usable


@functools.cache
def request_amx_tiles() -> AmxStatus:
    """Once per process, at engine start before the first GEMM: the AMX request's status.
    A refusal on a CPU that lists AMX is logged once (at warning level)."""
    status = request_amx_status()
    if not status.usable and status.reason.startswith("refused"):
        logger.warning("AMX tiles %s", status.reason)
    else:
        logger.debug("AMX tiles: %s", status.reason)
    return status
