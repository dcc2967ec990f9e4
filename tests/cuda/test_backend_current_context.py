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
from polyjit.backends.cuda import CudaDriverError

# Two stub GPUs; a process apart from the other backend tests, since these leave drivers
# in states that break others (see conftest.py's backend fixture).
STUB_ENV = {"PJSTUB_DEVICES": "2", "PJSTUB_PEER": "1"}


@pytest.fixture
def fresh_backend(stub_driver: stub.Driver) -> Iterator[Any]:
    """A backend of its own (a new CudaDriver); what it leaves is collected afterwards, so
    that its pools are not freed in the middle of the next test."""
    yield cuda.CudaBackend(cuda.CudaDriver(staging_bytes=1 << 20))
    gc.collect()


@pytest.mark.xfail(strict=True, raises=CudaDriverError, reason=(
    "CudaDriver._use caches, per thread, which device's context it made current and skips "
    "cuCtxSetCurrent when the cache says it is current; other code in the thread (cuda.core's "
    "Device.set_current() and its handles' destructors, CuPy, a second CudaDriver) changes the "
    "current context behind it, so cuEventCreate in _raw_record makes the event in the wrong "
    "context and cuEventRecord on the device's stream fails with CUDA_ERROR_INVALID_HANDLE "
    "(event and stream of two devices: an error on real GPUs too)"))
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


@pytest.mark.xfail(strict=True, raises=CudaDriverError, reason=(
    "two CudaBackend instances (get_backend('cuda') and create_backend(fast_math=True), say) each "
    "cache the current device per thread: the second makes device 1's context current, and the "
    "first, believing device 0's still is, creates its events in device 1's context "
    "(cuEventRecord: CUDA_ERROR_INVALID_HANDLE)"))
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
