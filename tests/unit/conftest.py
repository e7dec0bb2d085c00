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
