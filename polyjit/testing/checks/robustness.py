"""Checks of robustness: threads, injected driver faults, and misuse that must raise typed errors."""

from __future__ import annotations

import numpy as np

from polyjit.core import ir
from polyjit.core.errors import NodeNotInContextError, UnknownDeviceError
from polyjit.core.ir import AccumOp, Op
from polyjit.core.runtime import Backend
from polyjit.testing.checks.common import (
    assert_returned,
    assert_usable,
    driver_bytes,
    expect,
    f32,
    finalizing,
    require_devices,
    settle,
    settled_memory,
)

# ---------------------------------------------------------------------------
# Threads and faults


def check_threads(backend: Backend) -> None:
    """Four Python threads at once on one device (polyjit.testing.concurrency.thread_stress:
    link, run, copies, device_to_device, finalize, streams, compile): no error, no deadlock, and
    the memory comes back."""
    from polyjit.testing.concurrency import thread_stress

    require_devices(backend, 1)
    dev = backend.get_device(0)
    settle(backend)
    used, pending, held = dev.used_memory(), dev.pending_free_memory(), driver_bytes(backend, 0)
    errors = thread_stress(backend, threads=4, ops=40, deadline_s=120.0)
    if errors:
        shown = "\n".join(errors[:4]) + (f"\n... and {len(errors) - 4} more" if len(errors) > 4 else "")
        raise AssertionError(f"{len(errors)} error(s) with 4 threads on {dev.device_id}:\n{shown}")
    assert_returned(backend, dev, "4 threads of 40 operations", used, pending, held)


FAULT_OPERATIONS = 40  # each compiles with a chance of 0.15: keep the compiler's share small


FAULT_RATE = 0.15


def check_fault_typing(backend: Backend) -> None:
    """Driver calls that fail at random (polyjit.testing.faults.FaultyDriver over this backend's
    driver, driven by fault_storm): every failure reaches the user as a PolyjitError (DriverError,
    PoolExhaustedError, DeviceFaultError...), and once the faults stop every byte comes back.
    Runs on a second Backend over the same driver object: the kit runs checks one at a time, so
    the driver never sees two runtimes' calls at once."""
    from polyjit.testing.faults import FaultyDriver, fault_storm

    require_devices(backend, 1)
    settle(backend)
    held = driver_bytes(backend, 0)
    faulty = FaultyDriver(backend.driver, rate=FAULT_RATE, seed=1)
    faulty.armed = False  # the device and its default stream come up without faults
    wrapped = Backend(faulty)  # a Driver by duck typing
    dev = wrapped.get_device(0)
    try:
        faulty.armed = True
        try:
            counts = fault_storm(wrapped, operations=FAULT_OPERATIONS, seed=1)
        except Exception as e:
            raise AssertionError(f"a driver failure reached the user untyped (not a PolyjitError) "
                                 f"after injecting {faulty.injected}: {type(e).__name__}: {e}") from e
        finally:
            faulty.armed = False
        if not faulty.injected:
            raise AssertionError(f"fault_storm injected no fault in {FAULT_OPERATIONS} operations (counts {counts})")
        assert_returned(wrapped, dev, f"a storm of {FAULT_OPERATIONS} operations with faults {faulty.injected}",
                        0, 0, held)
        assert_usable(wrapped, dev.make_context(), f"the injected faults {faulty.injected}")
    finally:
        faulty.armed = False
        wrapped.close()  # its devices' streams, the default ones too
    assert_usable(backend, backend.get_device(0).make_context(), "a fault storm on the same driver")


# ---------------------------------------------------------------------------
# Misuse


def check_unknown_device(backend: Backend) -> None:
    """get_device with an ordinal outside [0, num_devices()) raises UnknownDeviceError."""
    n = backend.num_devices()
    for bad in (n, n + 7, -1):
        expect(UnknownDeviceError, lambda bad=bad: backend.get_device(bad), f"get_device({bad}) with {n} devices")  # type: ignore[misc]


def check_node_not_in_context(backend: Backend) -> None:
    """Linking a routine that reads a node the context lacks raises NodeNotInContextError naming it."""
    require_devices(backend, 1)
    dev = backend.get_device(0)
    a, missing, out = f32("nic_a", (5,)), f32("nic_missing", (5,)), f32("nic_out", (5,))
    code = backend.compile(ir.Comp.of(ir.apply(Op.MUL, a, missing, into=out)), name="needs_missing")
    ctx = dev.make_context().init_from_host(a, np.ones(5, np.float32))
    with finalizing(ctx):
        base = settled_memory(dev)
        e = expect(NodeNotInContextError, lambda: ctx.link(code), "linking without an input node",
                    contains=missing.label)
        if not isinstance(e, KeyError):
            raise AssertionError("NodeNotInContextError should also be a KeyError")
        if dev.used_memory() != base:
            raise AssertionError("a failed link allocated memory")
        acc = f32("nic_acc", (5,))
        onto = ir.Comp.of(ir.apply(Op.ID, a, into=acc, accum=AccumOp.ADD, init_neutral=False))
        expect(NodeNotInContextError, lambda: ctx.link(backend.compile(onto, name="onto_missing")),
                "linking an accumulation onto a node the context lacks", contains=acc.label)
        assert_usable(backend, ctx, "NodeNotInContextError")
