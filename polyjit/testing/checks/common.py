"""What the checks share: the exceptions and warnings they raise, the mark of the multi-device
checks, and the helpers that build, run and compare small programs."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from polyjit.core import dtypes, ir
from polyjit.core.ir import AccumOp, Node, Op
from polyjit.core.reference import run_reference
from polyjit.core.runtime import Backend, Context, Device
from polyjit.testing.harness import compare

Array = np.ndarray[Any, Any]
CheckFn = Callable[[Backend], None]


class CheckSkipped(Exception):
    """A check cannot run here (the reason is the message)."""


class KitNote(UserWarning):
    """A check passed but left part of its work out here; the message says what and why."""


def note(message: str) -> None:
    warnings.warn(KitNote(message), stacklevel=2)


MULTI_DEVICE: set[CheckFn] = set()


def multi_device(check: CheckFn) -> CheckFn:
    """Mark a check as one that must be given a backend with at least two devices."""
    MULTI_DEVICE.add(check)
    return check


# Elements of the slow routines the ordering checks race against (float32).
SLOW_ELEMENTS = 1 << 22
SLOW_RUNS = 16


def expect(exc: type[BaseException], fn: Callable[[], object], what: str, contains: str | None = None
           ) -> BaseException:
    """Run ``fn``; it must raise ``exc`` (whose message contains ``contains``)."""
    try:
        fn()
    except exc as e:
        if contains is not None and contains not in str(e):
            raise AssertionError(f"{what}: {type(e).__name__} message should name {contains!r}: {e}") from e
        return e
    except Exception as e:
        raise AssertionError(f"{what}: expected {exc.__name__}, got {type(e).__name__}: {e}") from e
    raise AssertionError(f"{what}: expected {exc.__name__}, nothing was raised")


def assert_equal(label: str, got: Array, want: Array, rtol: float = 0.0, atol: float = 0.0) -> None:
    msg = compare(label, np.asarray(got), np.asarray(want), rtol, atol)
    if msg:
        raise AssertionError(msg)


def require_devices(backend: Backend, n: int) -> None:
    have = backend.num_devices()
    if have < n:
        raise CheckSkipped(f"needs {n} devices; backend {backend.name!r} has {have}")


@contextmanager
def finalizing(*contexts: Context) -> Iterator[list[Context]]:
    """Finalize the contexts (and those appended to the yielded list) on the way out."""
    held = list(contexts)
    try:
        yield held
    finally:
        for ctx in reversed(held):
            ctx.finalize()


def f32(name: str, shape: tuple[int, ...]) -> Node:
    return Node(name, shape, dtypes.float32)


def assert_usable(backend: Backend, ctx: Context, what: str) -> None:
    """After an error: a routine linked on ``ctx`` still runs and computes the right values."""
    x, y = f32("usable_x", (7,)), f32("usable_y", (7,))
    t = f32("usable_t", (7,))
    comp = ir.Comp.of(ir.apply(Op.MUL, x, 3.0, into=t), ir.apply(Op.ADD, t, 1.0, into=y))
    xs = np.arange(7, dtype=np.float32) - 2
    try:
        child = ctx.init_from_host(x, xs)
        r = child.link(backend.compile(comp, name="usable"))
        r.run()
        got = r.context.read(y)
    except Exception as e:
        raise AssertionError(f"after {what}, the context is no longer usable: {type(e).__name__}: {e}") from e
    assert_equal(f"after {what}: {y.label}", got, run_reference([comp], {x: xs})[y])
    child.finalize()


def slow_accumulate(n: int = SLOW_ELEMENTS) -> tuple[ir.Comp, Node, Node]:
    """``acc += x``, elementwise over n float32: each run takes a while."""
    x, acc = f32("slow_x", (n,)), f32("slow_acc", (n,))
    return ir.Comp.of(ir.apply(Op.ID, x, into=acc, accum=AccumOp.ADD, init_neutral=False)), x, acc


def reference_runs(comp: ir.Comp, env: dict[Node, Array], runs: int) -> dict[Node, Array]:
    """The reference state after running ``comp`` ``runs`` times."""
    state = dict(env)
    for _ in range(runs):
        state = run_reference([comp], state)
    return state


def small_ints(rng: np.random.Generator, shape: tuple[int, ...], lo: int = -8, hi: int = 8) -> Array:
    return rng.integers(lo, hi + 1, shape).astype(np.float32)


def settled_memory(dev: Any) -> int:
    """used_memory once the contexts that earlier checks dropped have been given back (the
    garbage collector releases their pools at the device's next safe point)."""
    gc.collect()
    dev.synchronize()
    return int(dev.used_memory())


def settle(backend: Backend) -> None:
    """Let every device of the backend give back what dropped contexts and finished work held."""
    gc.collect()
    for dev in backend.devices():
        dev.synchronize()


def driver_bytes(backend: Backend, ordinal: int) -> int | None:
    fn = getattr(backend.driver, "allocated_bytes", None)
    got = fn(ordinal) if fn is not None else None
    return None if got is None else int(got)


def assert_returned(backend: Backend, dev: Device, what: str, used: int, pending: int,
                    held: int | None) -> None:
    """After ``what``: used_memory, pending_free_memory and the driver's allocated_bytes are back
    where they were."""
    gc.collect()
    dev.synchronize()
    if dev.used_memory() != used:
        raise AssertionError(f"after {what}, used_memory of {dev.device_id} is {dev.used_memory()}, "
                             f"expected its baseline {used}")
    if dev.pending_free_memory() != pending:
        raise AssertionError(f"after {what} and a synchronize, pending_free_memory of {dev.device_id} is "
                             f"{dev.pending_free_memory()}, expected its baseline {pending}: pools whose "
                             f"work is done were not handed back to the driver")
    now = driver_bytes(backend, dev.ordinal)
    if held is not None and now is not None and now > held:
        raise AssertionError(f"after {what}, the driver still holds {now - held} bytes more than before "
                             f"(allocated_bytes({dev.ordinal}) went from {held} to {now}): its free() does "
                             f"not release pools")
