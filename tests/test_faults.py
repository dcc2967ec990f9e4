"""Device and driver faults surface as typed errors; nothing crashes, hangs or leaks.

A failing driver call raises a DriverError (or PoolExhaustedError) naming the device and
the operation; a failure of work already enqueued is a DeviceFaultError raised at the next
sync of its stream, naming the routines in flight, while other streams and devices keep
working. ``polyjit.testing.faults`` injects both at random.
"""

from __future__ import annotations

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
