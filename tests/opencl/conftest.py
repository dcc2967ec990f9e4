"""The OpenCL backend (pyopencl), tested on PoCL: the fixtures its tests share.

``OCL_ICD_VENDORS`` is pointed at a PoCL that builds on this host by ``tests/conftest.py``
(pip's, else the system's), unless it is set already. Tests that need two
devices run here when the platform shows two (``POCL_DEVICES="pthread pthread"``);
otherwise ``test_two_device_tests_in_a_subprocess`` runs them in a subprocess with that
variable set, so one plain ``pytest`` run covers them.
"""

from __future__ import annotations

import pytest

from polyjit.backends import get_backend
from polyjit.core.runtime import Backend
from polyjit.testing import required_backends


def _required() -> bool:
    return "opencl" in required_backends()


@pytest.fixture(scope="module")
def backend() -> Backend:
    be = get_backend("opencl")
    if be.num_devices() == 0:
        reason = f"no OpenCL device: {be.driver.unavailable_reason}"  # type: ignore[attr-defined]
        if _required():
            pytest.fail(reason)
        pytest.skip(reason)
    return be


@pytest.fixture(scope="module")
def two_devices(backend: Backend) -> Backend:
    if backend.num_devices() < 2:
        pytest.skip("needs two OpenCL devices (POCL_DEVICES='pthread pthread'); "
                    "test_two_device_tests_in_a_subprocess runs these with two")
    return backend
