"""polyjit's CUDA backend when the thread's current context changes behind it: other code
in the process (cuda.core, CuPy, a second polyjit backend) switches it as it needs."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import stub
from scenarios import f32

from polyjit.backends import cuda

# Two stub GPUs; a process apart from the other backend tests, since these leave drivers
# in states that break others (see conftest.py's backend fixture).
STUB_ENV = {"PJSTUB_DEVICES": "2", "PJSTUB_PEER": "1"}


@pytest.fixture
def fresh_backend(stub_driver: stub.Driver) -> Iterator[Any]:
    """A backend of its own (a new CudaDriver); what it leaves is collected afterwards, so
    that its pools are not freed in the middle of the next test."""
    yield cuda.CudaBackend(cuda.CudaDriver(staging_bytes=1 << 20))
    gc.collect()


def test_other_code_may_change_the_current_context_in_between(fresh_backend: Any) -> None:
    from cuda.bindings import driver as cu

    stream = fresh_backend.get_device(0).new_stream()
    events = [stream.record() for _ in range(3)]  # device 0's context is current now
    previous = cu.cuCtxGetCurrent()[1]
    cu.cuCtxSetCurrent(cu.cuDevicePrimaryCtxRetain(1)[1])  # as cuda.core's Device(1).set_current() does
    try:
        events += [stream.record() for _ in range(50)]  # more events than polyjit has recycled
        for e in events:
            e.synchronize()
    finally:
        cu.cuCtxSetCurrent(previous)
        cu.cuDevicePrimaryCtxRelease(1)


def test_two_backends_in_one_thread(stub_driver: stub.Driver) -> None:
    first = cuda.CudaBackend(cuda.CudaDriver(staging_bytes=1 << 20))
    second = cuda.CudaBackend(cuda.CudaDriver(staging_bytes=1 << 20, fast_math=True))
    x = f32("x", (100,))
    stream = first.get_device(0).new_stream()
    events = [stream.record() for _ in range(3)]  # the first backend made device 0's context current
    other = second.get_device(1).make_context().init_from_host(x, np.ones(100, np.float32))
    try:
        events += [stream.record() for _ in range(50)]
        for e in events:
            e.synchronize()
    finally:
        other.finalize()
        gc.collect()
