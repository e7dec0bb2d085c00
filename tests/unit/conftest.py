"""Fixtures shared by the unit tests of the C++ CPU kernels."""

from __future__ import annotations

import pytest

from pagoda.ops import cpu_kernels


@pytest.fixture(scope="module")
def ext():
    """The built C++ extension; the test is skipped where it is switched off or unbuildable."""
    if cpu_kernels.kernels_disabled():
        pytest.skip("PAGODA_DISABLE_CPU_KERNELS is set")
    module = cpu_kernels.load_extension()
    if module is None:
        pytest.skip("the C++ extension could not be built here (no compiler?)")
    return module
