"""Loading the C++ extensions (one loader for cpu_kernels' and quant_cpu's): a finished
build is imported without torch's build lock (a lock left by a killed process must not
hang the next engine start), stale locks go."""

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
    monkeypatch.setattr(cpu_kernels, "_builds", {})
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


def test_both_extensions_load_through_the_one_loader(monkeypatch) -> None:
    """cpu_kernels' and quant_cpu's extensions: one loader, each build once per process,
    a failed build remembered (never retried), the names unchanged by the move."""
    from pagoda.ops import quant_cpu

    calls: list[str] = []

    def failing_build(name, sources, what):
        calls.append(name)

    monkeypatch.delenv("PAGODA_DISABLE_CPU_KERNELS", raising=False)
    monkeypatch.setattr(cpu_kernels, "_builds", {})
    monkeypatch.setattr(cpu_kernels, "_build_or_import", failing_build)
    for module in (cpu_kernels, quant_cpu):
        monkeypatch.setattr(module, "_module", None)
        monkeypatch.setattr(module, "_load_failed", False)
        assert module.load_extension() is None and module.load_extension() is None
    assert calls == [cpu_kernels.extension_name(), quant_cpu.extension_name()]
    assert cpu_kernels.load_built(calls[1], [], "again") is None and len(calls) == 2
    assert calls[0].startswith("pagoda_paged_attention_cpu_")
    assert calls[1].startswith("pagoda_quant_cpu_")


def test_march_knob_names_its_builds(monkeypatch) -> None:
    """PAGODA_CPU_MARCH: the -march= of both extensions' builds, in their names (several
    targets coexist in the cache), validated."""
    from pagoda.ops import quant_cpu

    monkeypatch.delenv("PAGODA_CPU_MARCH", raising=False)
    native = (cpu_kernels.extension_name(), quant_cpu.extension_name())
    assert cpu_kernels.cpu_march() == "native" and "-march=native" in cpu_kernels.cflags()
    monkeypatch.setenv("PAGODA_CPU_MARCH", "native")
    assert (cpu_kernels.extension_name(), quant_cpu.extension_name()) == native
    monkeypatch.setenv("PAGODA_CPU_MARCH", "x86-64-v3")
    assert "-march=x86-64-v3" in cpu_kernels.cflags()
    v3 = (cpu_kernels.extension_name(), quant_cpu.extension_name())
    assert v3[0].startswith("pagoda_paged_attention_cpu_x86_64_v3_")
    assert v3[1].startswith("pagoda_quant_cpu_x86_64_v3_")
    assert all(name.isidentifier() for name in v3)  # the module's name in PYBIND11_MODULE
    monkeypatch.setenv("PAGODA_CPU_MARCH", "x86_64.v3")  # the same tag, another hash
    assert cpu_kernels.extension_name() not in (v3[0], native[0])
    for bad in ("", "-O0", "x86-64 -O0", "native;", "skylake/avx512"):
        monkeypatch.setenv("PAGODA_CPU_MARCH", bad)
        with pytest.raises(ValueError, match="PAGODA_CPU_MARCH"):
            cpu_kernels.extension_name()


def test_a_build_leaves_the_build_names_unchanged(tmp_path, monkeypatch) -> None:
    """torch's loader appends its libraries to the flag lists it is handed: the loader hands
    it copies, so the names of later builds in the process stay those a fresh process
    computes (else the next process builds again)."""
    from pagoda.ops import quant_cpu

    names = (cpu_kernels.extension_name(), quant_cpu.extension_name())

    def mutating_load(*, extra_cflags, extra_ldflags, **_kwargs):
        extra_cflags.append("-DMUTATED")
        extra_ldflags.append("-lmutated")
        return object()

    monkeypatch.setattr(cpu_kernels, "build_directory", lambda name: tmp_path / name)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", mutating_load)
    assert cpu_kernels._build_or_import("fresh", [], "test kernels") is not None
    assert (cpu_kernels.extension_name(), quant_cpu.extension_name()) == names
