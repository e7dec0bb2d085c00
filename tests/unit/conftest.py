"""Fixtures shared by the unit tests of the C++ CPU kernels."""

from __future__ import annotations

import pytest

from pagoda.ops import cpu_kernels, quant_cpu


@pytest.fixture(scope="module")
def ext():
    """The built C++ extension; the test is skipped where it is switched off or unbuildable."""
    if cpu_kernels.kernels_disabled():
        pytest.skip("PAGODA_DISABLE_CPU_KERNELS is set")
    module = cpu_kernels.load_extension()
    if module is None:
        pytest.skip("the C++ extension could not be built here (no compiler?)")
    return module


@pytest.fixture(scope="module")
def qext():
    """The built quant extension, allowed to run on this CPU; else the test is skipped."""
    module = quant_cpu.resolve()
    if module is None:
        pytest.skip("the quant CPU kernels are disabled, unbuildable or not for this CPU")
    return module


@pytest.fixture(scope="module")
def fp8ext(qext):
    """The quant extension where its fp8 kernels (AVX-512 only) run; else skipped, saying so."""
    if not quant_cpu.fp8_allowed():
        pytest.skip(f"the fp8 kernels need AVX-512; this build has {qext.kernel_isa()['quant']}")
    return qext


@pytest.fixture(scope="module")
def fused_ext(ext):
    """The extension where dispatch takes its fused ops (AVX-512 F/BW/VL or AVX2 + FMA +
    F16C); else skipped, saying so (their scalar code still builds there, and the tests
    calling it run)."""
    if cpu_kernels.kernel_for("fused_ops") is None:
        pytest.skip("dispatch takes the fused ops only with AVX-512 F/BW/VL or AVX2 + FMA + "
                    f"F16C; this build has {ext.kernel_isa()['fused_ops'] or 'neither'}")
    return ext
