"""Per-device dispatch of the fused ops: one registry, no device branches in the callers.

Every op has a plain PyTorch reference that runs on any device. A device type may register
kernels for an op; a call runs the first kernel registered for its first tensor's device
type whose dtype set holds that tensor's dtype, whose `resolve()` gives a handle (built,
enabled, the CPU can run it) and whose `supports(*args)` accepts this call (layouts,
contiguity). Otherwise the reference runs. A kernel must compute what the reference computes (to its
documented rounding); the tests compare each with the reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


def _always(*_args: Any) -> bool:
    return True


@dataclass(frozen=True, slots=True)
class Kernel:
    name: str
    fn: Callable[..., Any]  # fn(handle, *args): the op's arguments after resolve()'s handle
    dtypes: frozenset[torch.dtype]  # of the op's first tensor argument
    resolve: Callable[[], Any]  # what fn needs (e.g. the loaded extension); None: unavailable
    supports: Callable[..., bool] = _always


class Op:
    """A dispatched op: `op(*args)` runs the selected kernel or the reference.

    A call resolves its kernels once per (device type, dtype) and keeps them until
    `refresh()` (the engine calls it at start): `resolve()` reads the environment and loads
    extensions, too slow for the several calls per layer per step. `kernel_for` and
    `select` resolve afresh every time (tests and diagnostics).
    """

    __slots__ = ("_kernels", "_resolved", "name", "reference")

    def __init__(self, name: str, reference: Callable[..., Any]) -> None:
        self.name = name
        self.reference = reference
        self._kernels: dict[str, list[Kernel]] = {}
        self._resolved: dict[tuple[str, torch.dtype], tuple[tuple[Kernel, Any], ...]] = {}

    def register(self, device_type: str, kernel: Kernel) -> None:
        self._kernels.setdefault(device_type, []).append(kernel)
        self._resolved.clear()

    def refresh(self) -> None:
        """Forget the resolved kernels (after the environment or the extensions changed)."""
        self._resolved.clear()

    def kernel_for(self, x: torch.Tensor) -> Kernel | None:
        """The kernel that could take a call whose first tensor is `x` (before `supports`)."""
        for k in self._kernels.get(x.device.type, ()):
            if x.dtype in k.dtypes and k.resolve() is not None:
                return k
        return None

    def select(self, *args: Any) -> Callable[..., Any]:
        """The function a call with these arguments runs: a kernel's, or the reference."""
        for k in self._kernels.get(args[0].device.type, ()):
            if args[0].dtype in k.dtypes:
                handle = k.resolve()
                if handle is not None and k.supports(*args):
                    return functools.partial(k.fn, handle)
        return self.reference

    def _resolve(self, key: tuple[str, torch.dtype]) -> tuple[tuple[Kernel, Any], ...]:
        device_type, dtype = key
        found = []
        for k in self._kernels.get(device_type, ()):
            if dtype in k.dtypes and (handle := k.resolve()) is not None:
                found.append((k, handle))
        self._resolved[key] = resolved = tuple(found)
        return resolved

    def __call__(self, *args: Any) -> Any:
        x = args[0]
        key = (x.device.type, x.dtype)
        candidates = self._resolved.get(key)
        if candidates is None:
            candidates = self._resolve(key)
        for k, handle in candidates:
            if k.supports(*args):
                return k.fn(handle, *args)
        return self.reference(*args)


OPS: dict[str, Op] = {}


def define_op(name: str, reference: Callable[..., Any]) -> Op:
    """Declares an op with its reference; kernels register on the returned Op."""
    if name in OPS:
        raise ValueError(f"op {name!r} is already defined")
    OPS[name] = op = Op(name, reference)
    return op


def refresh() -> None:
    """Re-resolve every op's kernels at its next call (the engine's start calls this, so
    PAGODA_DISABLE_CPU_KERNELS and a rebuilt extension take effect per engine)."""
    for op in OPS.values():
        op.refresh()
