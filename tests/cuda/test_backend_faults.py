"""polyjit's CUDA backend when a kernel faults on a stub GPU: the fault is sticky, as on
a real GPU (the context fails every call until it is reset)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import stub
from scenarios import f32

from polyjit.backends import cuda
from polyjit.core import ir
from polyjit.core.errors import DeviceFaultError, DriverError
from polyjit.core.ir import Op

STUB_ENV = {"PJSTUB_DEVICES": "2", "PJSTUB_PEER": "1"}  # as test_backend_current_context.py
N = 1000
X, Y = f32("x", (N,)), f32("y", (N,))
HOST = np.arange(N, dtype=np.float32)


@pytest.fixture
def backend(stub_driver: stub.Driver) -> Iterator[Any]:
    """A backend of its own per test (a fault breaks it); what it leaves is collected
    afterwards, before the context is reset."""
    yield cuda.CudaBackend(cuda.CudaDriver(staging_bytes=1 << 20))
    gc.collect()


@pytest.fixture
def fault(backend: Any, stub_driver: stub.Driver) -> Iterator[Callable[[], Any]]:
    """Makes a routine on device 0 fault (returns it); resets device 0's primary context
    afterwards, for the next tests of this process."""
    from cuda.bindings import driver as cu

    def make() -> Any:
        ctx = backend.get_device(0).make_context().init_from_host(X, HOST)
        r = ctx.link(backend.compile(ir.Comp.of(ir.apply(Op.MUL, X, 2.0, into=Y)), name="doubled"))
        stub_driver.inject_fault(0)
        r.run()
        return r

    yield make
    (err,) = cu.cuDevicePrimaryCtxReset(0)
    assert err == cu.CUresult.CUDA_SUCCESS


def _works(backend: Any, ordinal: int) -> None:
    dev = backend.get_device(ordinal)
    ctx = dev.make_context(dev.new_stream()).init_from_host(X, HOST)
    np.testing.assert_array_equal(ctx.read(X), HOST)
    ctx.finalize()


def test_a_kernel_fault_is_a_device_fault_naming_the_routine(backend: Any, fault: Callable[[], Any]) -> None:
    _works(backend, 1)
    r = fault()
    with pytest.raises(DeviceFaultError, match="doubled") as info:
        r.context.read(Y)
    assert "ILLEGAL_ADDRESS" in str(info.value)
    _works(backend, 1)  # a device in use before the fault is not touched by it


def test_a_device_first_used_after_a_fault_elsewhere_works(backend: Any, fault: Callable[[], Any]) -> None:
    r = fault()
    with pytest.raises(DeviceFaultError):
        r.context.read(Y)
    _works(backend, 1)


def test_a_sticky_fault_makes_later_calls_on_that_device_typed_driver_errors(
        backend: Any, fault: Callable[[], Any]) -> None:
    """A kernel fault poisons the device's context, on a GPU as on the stub: polyjit reports
    it as a DeviceFaultError at the sync, every later call on that device as a DriverError
    naming the sticky error (docs/reliability.md: a lost device fails its next driver calls),
    and the other device keeps working."""
    r = fault()
    with pytest.raises(DeviceFaultError):
        r.context.stream.synchronize()
    with pytest.raises(DriverError, match="ILLEGAL_ADDRESS"):
        _works(backend, 0)
    _works(backend, 1)


def test_kernels_queued_before_a_later_launch_failed_keep_their_memory(backend: Any, stub_driver: stub.Driver) -> None:
    """Found by review: a routine whose second kernel failed to launch raised a plain error, so
    its first kernel, already queued, was not tracked: finalize freed the memory it still read
    (a sticky ILLEGAL_ADDRESS when it ran). The runtime now keeps it until an event behind it."""
    n = 200_000
    x, total = f32("x", (n,)), f32("total", ())
    dev = backend.get_device(0)
    ctx = dev.make_context().init_from_host(x, np.ones(n, np.float32))
    r = ctx.link(backend.compile(ir.Comp.of(ir.einsum("i->", x, into=total)), name="sum"))
    assert len(r.prepared().launches) == 2  # a split sum: partial sums, then their sum
    r.run()
    assert r.context.read(total) == n
    stub_driver.fail_launch(1)
    with pytest.raises(DriverError, match=r"launching sum_0 .*LAUNCH_OUT_OF_RESOURCES"):
        r.run()
    r.run()  # the context is usable
    assert r.context.read(total) == n
    stub_driver.fail_launch(1)
    with pytest.raises(DriverError):
        r.run()
    assert stub_driver.pending() > 0  # the first kernel is queued, not run
    r.context.finalize()
    ctx.finalize()
    assert dev.pending_free_memory() > 0  # its memory waits for it
    dev.synchronize()  # it runs on live memory: no fault
    _works(backend, 0)


def test_a_staged_copy_whose_event_fails_keeps_its_ring_segment(backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: a chunk of a staged host copy whose copy was queued but whose event
    failed to record was left out of the staging ring, so the next copy could reuse that part
    of the ring while the queued one still read it. It stays in the ring now, until the whole
    stream is done, and the copy counts as issued."""
    n = (3 << 20) // 4  # three 1 MiB chunks through a 1 MiB ring
    x, y = f32("big_x", (n,)), f32("big_y", (n,))
    dev = backend.get_device(0)
    ctx = dev.make_context().init_from_host(x, np.zeros(n, np.float32)).init_from_host(y, np.zeros(n, np.float32))
    ctx.stream.synchronize()
    ring = backend.driver._staging[0]
    record, calls = ring._record, [0]

    def second_fails(stream: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("injected: recording the event failed")
        return record(stream)

    xs, ys = np.arange(n, dtype=np.float32), -np.arange(n, dtype=np.float32)
    monkeypatch.setattr(ring, "_record", second_fails)
    with pytest.raises(DriverError, match="after 2 of its operations"):
        ctx.from_host(x, xs)
    monkeypatch.undo()
    ctx.from_host(y, ys)  # reuses the ring: after the queued copies of x's first two chunks
    np.testing.assert_array_equal(ctx.read(x)[: 2 * n // 3], xs[: 2 * n // 3])
    np.testing.assert_array_equal(ctx.read(y), ys)
    ctx.finalize()
