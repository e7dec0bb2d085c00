"""Loading the C++ extension: a finished build is imported without torch's build lock (a
lock left by a killed process must not hang the next engine start), stale locks go."""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch.utils.cpp_extension

from pagoda.ops import cpu_kernels


def test_finished_build_loads_despite_a_leftover_lock(tmp_path, monkeypatch) -> None:
    if cpu_kernels.kernels_disabled():
        pytest.skip("PAGODA_DISABLE_CPU_KERNELS is set")
    ext = cpu_kernels.load_extension()
    if ext is None:
        pytest.skip("the C++ extension could not be built here (no compiler?)")
    name = cpu_kernels.extension_name()
    build_dir = tmp_path / name
    build_dir.mkdir()
    shutil.copy(cpu_kernels.build_directory(name) / f"{name}.so", build_dir / f"{name}.so")
    (build_dir / "lock").touch()  # as a process killed inside torch's loader leaves it

    def no_torch_loader(**_kwargs):
        raise AssertionError("torch's loader waits on the lock forever")

    monkeypatch.setattr(cpu_kernels, "build_directory", lambda _name: build_dir)
    monkeypatch.setattr(cpu_kernels, "_module", None)
    monkeypatch.setattr(cpu_kernels, "_load_failed", False)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_torch_loader)
    module = cpu_kernels.load_extension()
    assert module is not None and module.kernel_isa() == ext.kernel_isa()


def test_only_stale_locks_are_removed(tmp_path) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    cpu_kernels._remove_stale_lock(tmp_path)
    assert lock.exists()  # a build may be running
    old = time.time() - cpu_kernels._STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    cpu_kernels._remove_stale_lock(tmp_path)
    assert not lock.exists()
