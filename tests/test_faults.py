"""Device and driver faults surface as typed errors; nothing crashes, hangs or leaks.

A failing driver call raises a DriverError (or PoolExhaustedError) naming the device and
the operation; a failure of work already enqueued is a DeviceFaultError raised at the next
sync of its stream, naming the routines in flight, while other streams and devices keep
working. ``polyjit.testing.faults`` injects both at random.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
from settle import settled_memory

from polyjit import ir
from polyjit.backends.cpu import CpuDriver
from polyjit.core.errors import DeviceFaultError, DriverError, PolyjitError
from polyjit.core.ir import Node, Op
from polyjit.core.runtime import Backend
from polyjit.testing.faults import FaultyDriver, fault_storm


def _inner(name: str, devices: int = 1) -> Any:
    if name == "cpu":
        return CpuDriver(devices)
    from polyjit.backends.opencl import OpenCLDriver

    driver = OpenCLDriver()
    if driver.device_count() == 0:
        pytest.skip(f"no OpenCL device: {driver.unavailable_reason}")
    return driver


@pytest.mark.parametrize("name", ["cpu", "opencl"])
@pytest.mark.parametrize("seed", [0, 1])
def test_1000_operations_with_random_faults(name: str, seed: int) -> None:
    inner = _inner(name)
    driver = FaultyDriver(inner, rate=0.04, seed=seed)
    backend = Backend(driver)  # type: ignore[arg-type]
    dev = backend.get_device(0)
    allocated = inner.allocated_bytes(0)
    counts = fault_storm(backend, operations=1000, seed=seed)
    injected = sum(driver.injected.values())
    failures = sum(v for k, v in counts.items() if k != "ok")
    assert injected > 20 and failures > 20, (driver.injected, counts)
    assert counts.get("DeviceFaultError", 0) > 0 and counts.get("DriverError", 0) > 0, counts
    assert counts.get("ok", 0) > 400, counts  # most operations still work
    driver.armed = False
    assert settled_memory(dev) == 0
    assert dev.pending_free_memory() == 0
    assert inner.allocated_bytes(0) == allocated  # the driver really freed every pool


def test_an_asynchronous_fault_names_the_routine_and_spares_other_devices() -> None:
    inner = CpuDriver(2)
    driver = FaultyDriver(inner, rate=1.0, kinds=("event_sync",))
    backend = Backend(driver)  # type: ignore[arg-type]
    driver.armed = False
    a, out = Node("a", (1000,)), Node("out", (1000,))
    code = backend.compile(ir.Comp.of(ir.apply(Op.EXP, a, into=out)), name="doomed_kernel")
    ctxs = [backend.get_device(k).make_context().init_from_host(a, np.zeros(1000, np.float32))
            for k in range(2)]
    routines = [c.link(code) for c in ctxs]
    routines[0].run()
    driver.armed = True
    with pytest.raises(DeviceFaultError, match="doomed_kernel") as info:
        routines[0].context.stream.synchronize()
    assert "cpu:0" in str(info.value)
    driver.armed = False
    replay = backend.capture([routines[0]], inputs=[a], outputs=[out])  # a replay's fault names it too
    replay.replay([np.zeros(1000, np.float32)], [np.empty(1000, np.float32)])
    driver.armed = True
    with pytest.raises(DeviceFaultError, match="in flight: doomed_kernel"):
        routines[0].context.stream.synchronize()
    driver.armed = False
    routines[1].run()  # the other device keeps working
    np.testing.assert_array_equal(routines[1].context.read(out), np.ones(1000, np.float32))
    routines[0].run()  # and so does new work on the faulted stream
    np.testing.assert_array_equal(routines[0].context.read(out), np.ones(1000, np.float32))
    for c in ctxs:
        c.finalize()


def test_synchronous_driver_failures_are_typed_and_leave_the_context_usable() -> None:
    inner = CpuDriver(1)
    driver = FaultyDriver(inner, rate=1.0, kinds=("launch", "copy_from_host", "load", "alloc"))
    backend = Backend(driver)  # type: ignore[arg-type]
    driver.armed = False
    dev = backend.get_device(0)
    a, out = Node("a", (64,)), Node("out", (64,))
    code = backend.compile(ir.Comp.of(ir.apply(Op.EXP, a, into=out)), name="k")
    ctx = dev.make_context().init_from_host(a, np.zeros(64, np.float32))
    r = ctx.link(code)
    used = settled_memory(dev)
    driver.armed = True
    with pytest.raises(DriverError, match=r"cpu:0.*injected launch failure"):
        r.run()
    with pytest.raises(DriverError, match="from_host"):
        ctx.from_host(a, np.ones(64, np.float32))
    with pytest.raises(PolyjitError):
        ctx.init_from_host(Node("c", (8,)), np.zeros(8, np.float32))  # alloc fails
    assert dev.used_memory() == used
    driver.armed = False
    r.run()
    np.testing.assert_array_equal(r.context.read(out), np.ones(64, np.float32))
    ctx.finalize()


class _SlowMarkers(CpuDriver):
    """A driver whose events, like a stream worker's markers, are done one poll after the work
    before them is: within the protocol (docs/writing-a-backend.md), unlike the cpu driver's."""

    def record(self, stream: int) -> list[Any]:
        return [super().record(stream), 0]

    def event_done(self, event: list[Any]) -> bool:
        event[1] += 1
        return event[1] > 1 and super().event_done(event[0])

    def event_sync(self, event: list[Any]) -> None:
        super().event_sync(event[0])

    def wait(self, stream: int, event: list[Any]) -> None:
        super().wait(stream, event[0])


def test_is_idle_asks_about_the_newest_event_and_records_none() -> None:
    """Found by review: Device.is_idle() recorded a new event on every stream and polled it at
    once, so on a driver whose fresh marker is not done at its first poll it was False right
    after synchronize(), and every call added an event. It now polls each stream's newest."""
    backend = Backend(_SlowMarkers(1))
    dev = backend.get_device(0)
    stream = dev.new_stream()
    a, out = Node("idle_a", (64,)), Node("idle_out", (64,))
    r = dev.make_context(stream).init_from_host(a, np.ones(64, np.float32)).link(
        backend.compile(ir.Comp.of(ir.apply(Op.MUL, a, 2.0, into=out)), name="idle"))
    for _ in range(5):
        r.run()
        dev.synchronize()
        seq = stream.seq
        assert dev.is_idle() and stream.seq == seq
    r.run()
    polls = 0
    while not dev.is_idle():  # the newest event: done by its second poll
        polls += 1
        assert polls < 1000
    assert stream.seq == seq + 1
    np.testing.assert_array_equal(r.context.read(out), np.full(64, 2.0, np.float32))
    dev.close()


class _FailingUnload(CpuDriver):
    def unload(self, ordinal: int, module: Any) -> None:
        super().unload(ordinal, module)
        raise RuntimeError("injected unload failure")


def test_a_failed_unload_is_a_driver_error() -> None:
    """Found by review: a module collected with no routine left queued the driver's own unload,
    whose failure reached the next safe point as the driver's bare RuntimeError. It is a
    DriverError naming the device, reported as a finalizer's failure is (a RuntimeWarning), not
    raised into the unrelated call that reached the safe point (session 38's review)."""
    backend = Backend(_FailingUnload(1))
    dev = backend.get_device(0)
    a, out = Node("unload_a", (8,)), Node("unload_out", (8,))
    r = dev.make_context().init_from_host(a, np.ones(8, np.float32)).link(
        backend.compile(ir.Comp.of(ir.apply(Op.MUL, a, 3.0, into=out)), name="unload"))
    r.run()
    r.context.read(out)
    del r
    gc.collect()
    with pytest.warns(RuntimeWarning, match=r"cpu:0.*DriverError.*unload.*injected unload failure"):
        dev.synchronize()
    dev.synchronize()  # reported once; the device goes on
    dev.close()
