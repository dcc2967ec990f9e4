"""The conformance checks every backend runs.

Each check is a plain function ``check_xxx(backend) -> None`` that raises
AssertionError with a clear message on failure (or :class:`CheckSkipped`);
they are listed, in order, in :data:`CHECKS`. Checks that need two devices
(see :func:`needs_multi_device`) are given a backend with at least two devices.

For pytest, subclass :class:`ConformanceSuite` in a ``Test*`` class and set
``backend_name`` (or override :meth:`ConformanceSuite.backend`); the subclass gets
one ``test_<check>`` method per check. Override
:meth:`ConformanceSuite.multi_device_backend` to hand the multi-device checks a
backend with two devices (return None when there is none: those checks are then
skipped, with the reason, and only then).

A check that passes but left something out (the float64 programs on a device without
fp64, say) says so with a :class:`KitNote` warning: pytest lists it in its warnings
summary, ``polyjit selftest`` prints it beside the check.
"""

from __future__ import annotations

import functools
import gc
import os
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import numpy as np

from polyjit.core import dtypes, ir
from polyjit.core.errors import (
    BackendUnavailableError,
    BindingError,
    DTypeMismatchError,
    FinalizedError,
    MergeBufferMismatchError,
    NodeNotInContextError,
    PolyjitError,
    PoolExhaustedError,
    ShapeMismatchError,
    StreamClosedError,
    UnknownDeviceError,
)
from polyjit.core.ir import AccumOp, Node, Op, StaticSymbol
from polyjit.core.protocol import MergeBuffer
from polyjit.core.runtime import Backend, Context, Device, device_to_device, init_from_device
from polyjit.testing.harness import compare, run_programs, unsupported_reason
from polyjit.testing.programs import catalog
from polyjit.testing.reference import run_reference

__all__ = [
    "CHECKS",
    "CheckFn",
    "CheckSkipped",
    "ConformanceSuite",
    "KitNote",
    "default_multi_device_backend",
    "needs_multi_device",
    "run_check",
    "run_selftest",
]

Array = np.ndarray[Any, Any]
CheckFn = Callable[[Backend], None]


class CheckSkipped(Exception):
    """A check cannot run here (the reason is the message)."""


class KitNote(UserWarning):
    """A check passed but left part of its work out here; the message says what and why."""


def _note(message: str) -> None:
    warnings.warn(KitNote(message), stacklevel=2)


CHECKS: list[CheckFn] = []
_MULTI_DEVICE: set[CheckFn] = set()

# Elements of the slow routines the ordering checks race against (float32).
SLOW_ELEMENTS = 1 << 22
SLOW_RUNS = 16
HYPOTHESIS_EXAMPLES = int(os.environ.get("POLYJIT_HYPOTHESIS_EXAMPLES", "25") or 25)


def _register(multi_device: bool = False) -> Callable[[CheckFn], CheckFn]:
    def deco(fn: CheckFn) -> CheckFn:
        CHECKS.append(fn)
        if multi_device:
            _MULTI_DEVICE.add(fn)
        return fn

    return deco


def needs_multi_device(check: CheckFn) -> bool:
    """Whether the check must be given a backend with at least two devices."""
    return check in _MULTI_DEVICE


def check_name(check: CheckFn) -> str:
    return check.__name__.removeprefix("check_")


# ---------------------------------------------------------------------------
# Helpers


def _expect(exc: type[BaseException], fn: Callable[[], object], what: str, contains: str | None = None
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


def _assert_equal(label: str, got: Array, want: Array, rtol: float = 0.0, atol: float = 0.0) -> None:
    msg = compare(label, np.asarray(got), np.asarray(want), rtol, atol)
    if msg:
        raise AssertionError(msg)


def _require_devices(backend: Backend, n: int) -> None:
    have = backend.num_devices()
    if have < n:
        raise CheckSkipped(f"needs {n} devices; backend {backend.name!r} has {have}")


@contextmanager
def _finalizing(*contexts: Context) -> Iterator[list[Context]]:
    """Finalize the contexts (and those appended to the yielded list) on the way out."""
    held = list(contexts)
    try:
        yield held
    finally:
        for ctx in reversed(held):
            ctx.finalize()


def _f32(name: str, shape: tuple[int, ...]) -> Node:
    return Node(name, shape, dtypes.float32)


def _assert_usable(backend: Backend, ctx: Context, what: str) -> None:
    """After an error: a routine linked on ``ctx`` still runs and computes the right values."""
    x, y = _f32("usable_x", (7,)), _f32("usable_y", (7,))
    t = _f32("usable_t", (7,))
    comp = ir.Comp.of(ir.apply(Op.MUL, x, 3.0, into=t), ir.apply(Op.ADD, t, 1.0, into=y))
    xs = np.arange(7, dtype=np.float32) - 2
    try:
        child = ctx.init_from_host(x, xs)
        r = child.link(backend.compile(comp, name="usable"))
        r.run()
        got = r.context.read(y)
    except Exception as e:
        raise AssertionError(f"after {what}, the context is no longer usable: {type(e).__name__}: {e}") from e
    _assert_equal(f"after {what}: {y.label}", got, run_reference([comp], {x: xs})[y])
    child.finalize()


def _slow_accumulate(n: int = SLOW_ELEMENTS) -> tuple[ir.Comp, Node, Node]:
    """``acc += x``, elementwise over n float32: each run takes a while."""
    x, acc = _f32("slow_x", (n,)), _f32("slow_acc", (n,))
    return ir.Comp.of(ir.apply(Op.ID, x, into=acc, accum=AccumOp.ADD, init_neutral=False)), x, acc


def _reference_runs(comp: ir.Comp, env: dict[Node, Array], runs: int) -> dict[Node, Array]:
    """The reference state after running ``comp`` ``runs`` times."""
    state = dict(env)
    for _ in range(runs):
        state = run_reference([comp], state)
    return state


def _small_ints(rng: np.random.Generator, shape: tuple[int, ...], lo: int = -8, hi: int = 8) -> Array:
    return rng.integers(lo, hi + 1, shape).astype(np.float32)


# ---------------------------------------------------------------------------
# Memory


def _settled_memory(dev: Any) -> int:
    """used_memory once the contexts that earlier checks dropped have been given back (the
    garbage collector releases their pools at the device's next safe point)."""
    gc.collect()
    dev.synchronize()
    return int(dev.used_memory())


@_register()
def check_alloc_and_memset(backend: Backend) -> None:
    """Device.alloc_pool / free_pool / memset_zero; used_memory is exact."""
    _require_devices(backend, 1)
    dev = backend.get_device(0)
    base = _settled_memory(dev)
    pid = 1 << 30
    for nbytes in (1, 4096, 1000_003):
        dev.alloc_pool(pid, nbytes, 64)
        used = dev.used_memory()
        if used != base + nbytes:
            raise AssertionError(f"used_memory after alloc_pool({nbytes}) is {used}, expected {base + nbytes}")
        dev.memset_zero(pid, 0, nbytes)
        dev.free_pool(pid)
        if dev.used_memory() != base:
            raise AssertionError(f"used_memory after free_pool is {dev.used_memory()}, expected {base}")
    # memset_zero over a node's buffer, whole and in part
    rng = np.random.default_rng(1)
    node = Node("memset_target", (64,), dtypes.int32)
    values = rng.integers(1, 100, node.shape).astype(np.int32)
    ctx = dev.make_context().init_from_host(node, values)
    with _finalizing(ctx):
        if dev.used_memory() < base + node.nbytes:
            raise AssertionError(f"used_memory did not grow by the {node.nbytes} bytes of a new buffer")
        loc = ctx.buffers[node]
        dev.memset_zero(loc.pool_id, loc.offset + 16 * 4, 8 * 4)  # cells 16..23
        want = values.copy()
        want[16:24] = 0
        _assert_equal("after memset_zero of cells 16..23", ctx.read(node), want)
        dev.memset_zero(loc.pool_id, loc.offset, node.nbytes)
        _assert_equal("after memset_zero of the whole buffer", ctx.read(node), np.zeros_like(values))
    if dev.used_memory() != base:
        raise AssertionError(f"used_memory after finalize is {dev.used_memory()}, expected {base}")


@_register()
def check_pool_exhausted(backend: Backend) -> None:
    """alloc_pool beyond the device's memory raises PoolExhaustedError; nothing leaks."""
    _require_devices(backend, 1)
    dev = backend.get_device(0)
    ctx = dev.make_context()
    base = _settled_memory(dev)
    info = getattr(dev, "info", None)
    memory = int(info.memory_bytes if info is not None else dev.properties["memory_bytes"])
    _expect(PoolExhaustedError, lambda: dev.alloc_pool(1 << 30, memory + 1, 64),
            f"alloc_pool of {memory + 1} bytes on a device of {memory}")
    if dev.used_memory() != base:
        raise AssertionError(f"a failed alloc_pool changed used_memory from {base} to {dev.used_memory()}")
    big = Node("too_big", (memory // 4 + 1,), dtypes.float32)
    _expect(PoolExhaustedError, lambda: ctx.link(backend.compile(ir.Comp.of(ir.fill(big, 1.0)), name="too_big")),
            f"linking a routine whose buffer ({big.nbytes} bytes) exceeds the device memory")
    if dev.used_memory() != base:
        raise AssertionError(f"a failed link changed used_memory from {base} to {dev.used_memory()}")
    _assert_usable(backend, ctx, "PoolExhaustedError")


# ---------------------------------------------------------------------------
# Host transfers


_ROUND_TRIP_SHAPES: tuple[tuple[int, ...], ...] = ((), (0,), (3, 0, 2), (1,), (7,), (5, 13), (2, 3, 4))


def _random(dt: dtypes.DType, shape: tuple[int, ...], rng: np.random.Generator) -> Array:
    if dt.is_bool:
        return np.asarray(rng.random(shape) < 0.5)
    if dt.is_float:
        return np.asarray(rng.standard_normal(shape)).astype(dt.np)
    info = np.iinfo(dt.np)
    return np.asarray(rng.integers(info.min, info.max, shape, dtype=dt.np, endpoint=True))


@_register()
def check_host_round_trips(backend: Backend) -> None:
    """init_from_host / from_host / to_host (blocking or not) / read for every dtype, 0-d and empty shapes."""
    _require_devices(backend, 1)
    dev = backend.get_device(0)
    rng = np.random.default_rng(2)
    base = _settled_memory(dev)
    with _finalizing(dev.make_context()) as held:
        for dt in dtypes.ALL:
            for shape in _ROUND_TRIP_SHAPES:
                node = Node(f"rt_{dt}", shape, dt)
                label = f"{dt} {shape}"
                first = _random(dt, shape, rng)
                ctx = held[-1].init_from_host(node, first)
                held.append(ctx)
                _assert_equal(f"read after init_from_host, {label}", ctx.read(node), first)
                second = _random(dt, shape, rng)
                if ctx.from_host(node, second) is not True:
                    raise AssertionError(f"from_host of a node with a buffer must return True ({label})")
                out = np.empty(shape, dt.np)
                if ctx.to_host(node, out) is not True:
                    raise AssertionError(f"to_host of a node with a buffer must return True ({label})")
                _assert_equal(f"to_host after from_host, {label}", out, second)
                # a non-blocking to_host holds the value once the stream is past it
                third, late = _random(dt, shape, rng), np.empty(shape, dt.np)
                ctx.from_host(node, third)
                if ctx.to_host(node, late, blocking=False) is not True:
                    raise AssertionError(f"a non-blocking to_host must return True ({label})")
                ctx.stream.synchronize()
                _assert_equal(f"to_host(blocking=False) after a sync, {label}", late, third)
                # a non-contiguous source array is accepted (copied)
                if len(shape) >= 1 and shape[0] > 1 and np.prod(shape) > 0:
                    wide = _random(dt, (shape[0] * 2, *shape[1:]), rng)
                    ctx.from_host(node, wide[::2])
                    _assert_equal(f"from_host of a strided array, {label}", ctx.read(node), wide[::2])
        # transfers of a node the context does not hold return False
        stranger = Node("rt_stranger", (3,), dtypes.float32)
        ctx = held[-1]
        if ctx.from_host(stranger, np.zeros(3, np.float32)) is not False:
            raise AssertionError("from_host of a node without a buffer must return False")
        if ctx.to_host(stranger, np.zeros(3, np.float32)) is not False:
            raise AssertionError("to_host of a node without a buffer must return False")
        _expect(NodeNotInContextError, lambda: ctx.read(stranger), "Context.read of a node without a buffer",
                contains=stranger.label)
    if dev.used_memory() != base:
        raise AssertionError(f"used_memory after finalize is {dev.used_memory()}, expected {base}")


@_register()
def check_host_transfer_errors(backend: Backend) -> None:
    """Wrong shapes and dtypes raise ShapeMismatchError / DTypeMismatchError; the context survives."""
    _require_devices(backend, 1)
    dev = backend.get_device(0)
    node = Node("xfer", (4, 5), dtypes.float32)
    good = np.arange(20, dtype=np.float32).reshape(4, 5)
    ctx = dev.make_context().init_from_host(node, good)
    with _finalizing(ctx):
        for name, call in (("from_host", ctx.from_host), ("to_host", ctx.to_host),
                           ("init_from_host", ctx.init_from_host)):
            _expect(ShapeMismatchError, lambda call=call: call(node, np.zeros((5, 4), np.float32)),  # type: ignore[misc]
                    f"{name} with a (5, 4) array for a (4, 5) node")
            _expect(ShapeMismatchError, lambda call=call: call(node, np.zeros((20,), np.float32)),  # type: ignore[misc]
                    f"{name} with a flat array for a (4, 5) node")
            _expect(DTypeMismatchError, lambda call=call: call(node, np.zeros((4, 5), np.float64)),  # type: ignore[misc]
                    f"{name} with a float64 array for a float32 node")
            _expect(DTypeMismatchError, lambda call=call: call(node, np.zeros((4, 5), np.int32)),  # type: ignore[misc]
                    f"{name} with an int32 array for a float32 node")
        _assert_equal("the node after rejected transfers", ctx.read(node), good)
        _assert_usable(backend, ctx, "ShapeMismatchError/DTypeMismatchError")


# ---------------------------------------------------------------------------
# Programs against the reference


@_register()
def check_catalog_programs(backend: Backend) -> None:
    """Every program of the catalog (polyjit.testing.programs) matches the reference interpreter.
    On a device whose property ``fp64`` is False, the programs whose kernels compute in float64
    are left out, and a KitNote says how many and why."""
    _require_devices(backend, 1)
    dev = backend.get_device(0)
    progs = catalog()
    reasons = {p.name: unsupported_reason(dev.properties, p) for p in progs}
    runnable = [p for p in progs if reasons[p.name] is None]
    skipped = _skip_summary(reasons, len(progs), f"catalog programs on {dev.label}")
    if not runnable:
        raise CheckSkipped(skipped or f"no catalog program can run on {dev.label}")
    failures = run_programs(backend, runnable, batch_size=100)
    if failures:
        names = sorted({f.program for f in failures})
        shown = "\n\n".join(str(f) for f in failures[:12])
        more = f"\n... and {len(failures) - 12} more" if len(failures) > 12 else ""
        left = f" ({skipped})" if skipped else ""
        raise AssertionError(f"{len(names)} of {len(runnable)} programs differ from the reference{left}: "
                             f"{', '.join(names)}\n\n{shown}{more}")
    if skipped:
        _note(skipped)


def _skip_summary(reasons: dict[str, str | None], total: int, what: str) -> str:
    """'N of M <what> skipped: <reason>' per reason, or '' when nothing was skipped."""
    by_reason: dict[str, int] = {}
    for reason in reasons.values():
        if reason is not None:
            by_reason[reason] = by_reason.get(reason, 0) + 1
    return "; ".join(f"{n} of {total} {what} skipped: {reason}" for reason, n in by_reason.items())


def _hypothesis_check(backend: Backend, strategy_name: str) -> None:
    try:
        from hypothesis import HealthCheck, given, settings
        from hypothesis import strategies as st

        from polyjit.testing import strategies
    except ImportError as e:  # pragma: no cover - hypothesis is a dev dependency
        raise CheckSkipped(f"hypothesis is not installed ({e})") from e
    _require_devices(backend, 1)
    strategy = getattr(strategies, strategy_name)()
    properties = backend.get_device(0).properties
    reasons: dict[str, str | None] = {}

    @settings(max_examples=HYPOTHESIS_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy, st.integers(0, 2**32 - 1))
    def run(program: Any, seed: int) -> None:
        reason = reasons[f"{len(reasons)}"] = unsupported_reason(properties, program)
        if reason is not None:  # float64 on a device without fp64: not this device's failure
            return
        failures = run_programs(backend, [program], seed=seed)
        if failures:
            raise AssertionError("\n".join(str(f) for f in failures))

    run()
    skipped = _skip_summary(reasons, len(reasons), f"generated {strategy_name}")
    if skipped and all(r is not None for r in reasons.values()):
        raise CheckSkipped(skipped)
    if skipped:
        _note(skipped)


@_register()
def check_random_elementwise_programs(backend: Backend) -> None:
    """Hypothesis: random DAGs of elementwise ops (dtypes, broadcasting, casts) match the reference."""
    _hypothesis_check(backend, "elementwise_programs")


@_register()
def check_random_einsum_programs(backend: Backend) -> None:
    """Hypothesis: random einsums (every AccumOp, with and without init_neutral) match the reference."""
    _hypothesis_check(backend, "einsum_programs")


@_register()
def check_random_matmul_programs(backend: Backend) -> None:
    """Hypothesis: matmuls of sizes that cut every kind of tile edge match the reference."""
    _hypothesis_check(backend, "matmul_programs")


@_register()
def check_random_affine_programs(backend: Backend) -> None:
    """Hypothesis: random affine projections (strides, offsets, repeated writes) match the reference."""
    _hypothesis_check(backend, "affine_programs")


@_register()
def check_routines_and_batches(backend: Backend) -> None:
    """Routine metadata; compile_batch with names and occupancy; link_batch shares one context."""
    _require_devices(backend, 1)
    dev = backend.get_device(0)
    a, b, s, p = _f32("rb_a", (6,)), _f32("rb_b", (6,)), _f32("rb_s", (6,)), _f32("rb_p", ())
    sum_comp = ir.Comp.of(ir.apply(Op.ADD, a, b, into=s))
    dot_comp = ir.Comp.of(ir.einsum("i,i->", a, s, into=p))
    skipped = ir.Comp.of(ir.apply(Op.NEG, a, into=_f32("rb_unused", (6,))))
    batch = backend.compile_batch([sum_comp, skipped, dot_comp], names=["sum", "skipped", "dot"],
                                  occupancy=lambda name: name != "skipped")
    rng = np.random.default_rng(3)
    av, bv = _small_ints(rng, (6,)), _small_ints(rng, (6,))
    ctx = dev.make_context().init_from_host(a, av).init_from_host(b, bv)
    with _finalizing(ctx):
        routines = ctx.link_batch(batch)
        if len(routines) != 2:
            raise AssertionError(f"occupancy left out one computation of three: expected 2 routines, got {len(routines)}")
        r_sum, r_dot = routines
        if r_sum.inputs != frozenset({a, b}) or r_sum.outputs != frozenset({s}):
            raise AssertionError(f"sum routine: inputs {set(r_sum.inputs)} outputs {set(r_sum.outputs)}, "
                                 f"expected inputs {{a, b}} and outputs {{s}}")
        if r_dot.outputs != frozenset({p}) or r_sum.merge_buffer_input is not None:
            raise AssertionError(f"dot routine: outputs {set(r_dot.outputs)}, expected {{p}}")
        if r_sum.context is not r_dot.context:
            raise AssertionError("the routines of one link_batch must share one child context")
        if ctx.buffers.keys() - r_sum.context.buffers.keys():
            raise AssertionError("the child context must hold every buffer of its parent")
        if s in ctx.buffers:
            raise AssertionError("linking must not change the parent context (contexts never change)")
        r_sum.run()
        r_dot.run()
        want = run_reference([sum_comp, dot_comp], {a: av, b: bv})
        _assert_equal(s.label, r_sum.context.read(s), want[s])
        _assert_equal(p.label, r_dot.context.read(p), want[p])
        # Backend.compile of one computation links with Context.link
        code = backend.compile(dot_comp, name="dot_again")
        r2 = r_sum.context.link(code)
        r2.run()
        _assert_equal(f"{p.label} (Backend.compile)", r2.context.read(p), want[p])


# ---------------------------------------------------------------------------
# Static bindings


@_register()
def check_static_bindings(backend: Backend) -> None:
    """routine.bindings are read when run() enqueues; unbound or out-of-range values raise BindingError."""
    _require_devices(backend, 1)
    dev = backend.get_device(0)
    k = StaticSymbol("k", 4)
    src, row = _f32("sb_src", (4, 5)), _f32("sb_row", (5,))
    comp = ir.Comp.of(ir.slice_at(row, src, k))
    slow, sx, sacc = _slow_accumulate()
    rng = np.random.default_rng(4)
    srcv = _small_ints(rng, src.shape)
    ctx = (dev.make_context().init_from_host(src, srcv)
           .init_from_host(sx, np.ones(sx.shape, np.float32)).init_from_host(sacc, np.zeros(sacc.shape, np.float32)))
    with _finalizing(ctx):
        r = ctx.link(backend.compile(comp, name="static_row"))
        busy = ctx.link(backend.compile(slow, name="busy"))
        _expect(BindingError, r.run, "run() with an unbound static symbol", contains="k")
        for bad in (4, -1, 100):
            r.bindings[k] = bad
            _expect(BindingError, r.run, f"run() with {k!r} = {bad} (bound 4)")
        for v in (2, 0, 3):
            for _ in range(SLOW_RUNS // 4):
                busy.run()  # keep the stream busy so that run() below is only enqueued
            r.bindings[k] = v
            r.run()
            r.bindings[k] = (v + 1) % 4  # changed after enqueueing: must not affect that run
            _assert_equal(f"{row.label} with {k!r} = {v}", r.context.read(row), srcv[v])
        _assert_usable(backend, ctx, "BindingError")


# ---------------------------------------------------------------------------
# Streams and events


@_register()
def check_events_and_device_sync(backend: Backend) -> None:
    """Event.sync / is_done, Stream.record / synchronize, Device.all_work / synchronize / is_idle."""
    _require_devices(backend, 1)
    dev = backend.get_device(0)
    slow, x, acc = _slow_accumulate()
    stream = dev.new_stream()
    env = {x: np.ones(x.shape, np.float32), acc: np.zeros(acc.shape, np.float32)}
    ctx = dev.make_context(stream).init_from_host(x, env[x]).init_from_host(acc, env[acc])
    with _finalizing(ctx):
        r = ctx.link(backend.compile(slow, name="slow_events"))
        if r.context.stream is not stream:
            raise AssertionError("a routine runs on the stream of the context it was linked into")
        for _ in range(SLOW_RUNS):
            r.run()
        ev = stream.record()
        ev.synchronize()
        if not ev.is_done():
            raise AssertionError("Event.is_done() is False after Event.synchronize()")
        for _ in range(SLOW_RUNS):
            r.run()
        work = dev.all_work()
        work.synchronize()
        if not work.is_done():
            raise AssertionError("Device.all_work() is not done after its sync()")
        for _ in range(SLOW_RUNS):
            r.run()
        dev.synchronize()
        if not dev.is_idle():
            raise AssertionError("Device.is_idle() is False right after Device.synchronize()")
        stream.synchronize()
        want = _reference_runs(slow, env, 3 * SLOW_RUNS)[acc]
        _assert_equal(f"{acc.label} after {3 * SLOW_RUNS} runs", r.context.read(acc), want)
        if not ev.is_done():
            raise AssertionError("an event that was done is no longer done")


@_register()
def check_cross_stream_ordering(backend: Backend) -> None:
    """Routines on two streams of a device order themselves through the events of their buffers
    (read after write, write after read), with no will_wait_for from the user."""
    _require_devices(backend, 1)
    dev = backend.get_device(0)
    sa, sb = dev.new_stream(), dev.new_stream()
    slow, x, acc = _slow_accumulate()
    z = _f32("xs_z", acc.shape)
    reader = ir.Comp.of(ir.apply(Op.ADD, acc, 0.5, into=z))
    env = {x: np.full(x.shape, 2.0, np.float32), acc: np.zeros(acc.shape, np.float32)}
    ctx_a = dev.make_context(sa).init_from_host(x, env[x]).init_from_host(acc, env[acc])
    with _finalizing(ctx_a):
        writer = ctx_a.link(backend.compile(slow, name="slow_writer"))
        ctx_b = writer.context.with_stream(sb)
        if ctx_b.stream is not sb:
            raise AssertionError("Context.with_stream must give a context on that stream")
        rd = ctx_b.link(backend.compile(reader, name="reader_b"))
        # read after write: B's reader must see every run A enqueued before it
        for _ in range(SLOW_RUNS):
            writer.run()
        last_write = sa.record()
        rd.run()
        got = rd.context.read(z)
        state = _reference_runs(slow, env, SLOW_RUNS)
        state = run_reference([reader], state)
        _assert_equal(f"{z.label} read on stream B after {SLOW_RUNS} runs on stream A", got, state[z])
        if not last_write.is_done():
            raise AssertionError("stream B finished a read of A's output before A's write was done")
        # write after read: A rewrites x while B's slow routine still reads it
        out_b = _f32("xs_out", x.shape)
        slow_read = ir.Comp.of(ir.apply(Op.ID, x, into=out_b, accum=AccumOp.ADD, init_neutral=False))
        ctx_b2 = ctx_b.init_from_host(out_b, np.zeros(out_b.shape, np.float32))
        sr = ctx_b2.link(backend.compile(slow_read, name="slow_reader_b"))
        overwrite = ir.Comp.of(ir.fill(x, -100.0))
        fill = ctx_a.link(backend.compile(overwrite, name="overwrite_a"))
        for _ in range(SLOW_RUNS):
            sr.run()
        fill.run()  # on stream A: must wait for B's reads of x
        state[out_b] = np.zeros(out_b.shape, np.float32)
        state = _reference_runs(slow_read, state, SLOW_RUNS)
        _assert_equal(f"{out_b.label}: B's reads of x while A overwrote it", sr.context.read(out_b), state[out_b])
        state = run_reference([overwrite], state)
        _assert_equal(f"{x.label} after the overwrite on A", fill.context.read(x), state[x])
        # a host transfer on stream B orders itself after A's work too
        for _ in range(SLOW_RUNS):
            writer.run()
        new = np.full(acc.shape, 7.0, np.float32)
        ctx_b.from_host(acc, new)
        _assert_equal(f"{acc.label} after from_host on B behind A's writes", ctx_a.read(acc), new)


# ---------------------------------------------------------------------------
# Device to device, merge buffers


def _merge_reader(node: Node) -> ir.Comp:
    """node += merge(node): sums what device_to_device(..., COPY) brought into the local node."""
    return ir.Comp.of(ir.apply(Op.ID, ir.merge(node), into=node, accum=AccumOp.ADD, init_neutral=False),
                      embedded=[node])


def _transfers(backend: Backend, d0: int, d1: int) -> None:
    dev0, dev1 = backend.get_device(d0), backend.get_device(d1)
    where = f"{dev0.device_id} -> {dev1.device_id}"
    rng = np.random.default_rng(5)
    x, y = Node("d2d_x", (33, 7), dtypes.float32), Node("d2d_y", (5,), dtypes.int64)
    xa, xb = _small_ints(rng, x.shape), _small_ints(rng, x.shape)
    ya, yb = rng.integers(-9, 9, y.shape), rng.integers(-9, 9, y.shape)
    src = dev0.make_context().init_from_host(x, xa).init_from_host(y, ya)
    dst = dev1.make_context().init_from_host(x, xb).init_from_host(y, yb)
    with _finalizing(src, dst) as held:
        # MergeBuffer.NO: into the node's own buffer
        r = device_to_device(x, dst=dst, src=src, into_merge_buffer=MergeBuffer.NO)
        if r is None:
            raise AssertionError(f"device_to_device between distinct buffers ({where}) returned None")
        _assert_equal(f"{x.label} after device_to_device {where}", dst.read(x), xa)
        _assert_equal(f"{x.label} on the source after device_to_device", src.read(x), xa)
        xc = _small_ints(rng, x.shape)
        src.from_host(x, xc)
        r.run()
        _assert_equal(f"{x.label} after the transfer routine's run() {where}", dst.read(x), xc)
        if device_to_device(x, dst=src, src=src) is not None:
            raise AssertionError("device_to_device of a buffer onto itself must return None")
        # init_from_device: a new buffer filled from the other device
        z = Node("d2d_z", (4, 4), dtypes.uint8)
        zv = rng.integers(0, 256, z.shape).astype(np.uint8)
        src_z = src.init_from_host(z, zv)
        held.append(src_z)
        made = init_from_device(z, dst=dst, src=src_z)
        held.append(made)
        if z in dst.buffers:
            raise AssertionError("init_from_device must not change dst (it returns a child)")
        _assert_equal(f"{z.label} after init_from_device {where}", made.read(z), zv)
        # MergeBuffer.COPY: into dst's merge buffer; a reader sums it into the local node
        reader = backend.compile(_merge_reader(x), name="merge_sum")
        rc = device_to_device(x, dst=dst, src=src, into_merge_buffer=MergeBuffer.COPY)
        if rc is None:
            raise AssertionError("device_to_device(..., COPY) returned None")
        local = dst.read(x)
        merged = rc.context.link(reader)
        if merged.merge_buffer_input is not x:
            raise AssertionError(f"the merge reader's merge_buffer_input is {merged.merge_buffer_input}, not {x.label}")
        merged.run()
        want = run_reference([_merge_reader(x)], {x: local}, merge={x: xc})[x]
        _assert_equal(f"{x.label} + merge({x.label}) {where}", merged.context.read(x), want)
        # a reader linked against a context whose merge buffer holds nothing, or another node
        _expect(MergeBufferMismatchError, lambda: dst.link(reader),
                "linking a merge reader against a context without the merge copy")
        ry = device_to_device(y, dst=dst, src=src, into_merge_buffer=MergeBuffer.COPY)
        assert ry is not None
        _expect(MergeBufferMismatchError, lambda: ry.context.link(reader),
                f"linking a reader of merge({x.label}) against a context whose merge buffer holds {y.label}")
        _assert_usable(backend, dst, "MergeBufferMismatchError")


@_register()
def check_device_to_device_one_device(backend: Backend) -> None:
    """device_to_device (NO and COPY) and init_from_device between two contexts of one device;
    linking a merge reader against the wrong context raises MergeBufferMismatchError."""
    _require_devices(backend, 1)
    _transfers(backend, 0, 0)


@_register(multi_device=True)
def check_device_to_device_two_devices(backend: Backend) -> None:
    """device_to_device (NO and COPY) and init_from_device between two devices, both ways."""
    _require_devices(backend, 2)
    _transfers(backend, 0, 1)
    _transfers(backend, 1, 0)


@_register(multi_device=True)
def check_merge_buffer_all_reduce(backend: Backend) -> None:
    """An all-reduce over every device: merge-buffer copies summed into the local nodes, then
    copied back; checked against the reference."""
    _require_devices(backend, 2)
    n = backend.num_devices()
    devs = [backend.get_device(k) for k in range(n)]
    g = Node("grad", (129,), dtypes.float32)
    rng = np.random.default_rng(6)
    values = [_small_ints(rng, g.shape) for _ in devs]
    ctxs = [d.make_context().init_from_host(g, v) for d, v in zip(devs, values)]
    reader = backend.compile(_merge_reader(g), name="all_reduce_sum")
    with _finalizing(*ctxs):
        # reduce into device 0: one merge copy and one sum per other device
        acc = ctxs[0]
        state = values[0]
        for k in range(1, n):
            rc = device_to_device(g, dst=acc, src=ctxs[k], into_merge_buffer=MergeBuffer.COPY)
            assert rc is not None
            r = rc.context.link(reader)
            r.run()
            state = run_reference([_merge_reader(g)], {g: state}, merge={g: values[k]})[g]
            acc = r.context
        total = np.asarray(np.sum(np.stack(values), axis=0, dtype=np.float32))
        _assert_equal(f"{g.label} reduced on {devs[0].device_id}", acc.read(g), total)
        # broadcast back
        for k in range(1, n):
            device_to_device(g, dst=ctxs[k], src=acc)
        for k in range(n):
            _assert_equal(f"{g.label} on {devs[k].device_id} after the all-reduce", ctxs[k].read(g), total)


@_register(multi_device=True)
def check_cross_device_ordering(backend: Backend) -> None:
    """A copy to another device waits for the slow writer on the source device; a write on the
    source waits for a copy still queued behind slow work on the destination."""
    _require_devices(backend, 2)
    dev0, dev1 = backend.get_device(0), backend.get_device(1)
    slow, x, acc = _slow_accumulate()
    env = {x: np.ones(x.shape, np.float32), acc: np.zeros(acc.shape, np.float32)}
    ctx0 = dev0.make_context().init_from_host(x, env[x]).init_from_host(acc, env[acc])
    ctx1 = dev1.make_context().init_from_host(x, env[x]).init_from_host(acc, env[acc])
    code = backend.compile(slow, name="slow_cross")
    with _finalizing(ctx0, ctx1):
        w0, w1 = ctx0.link(code), ctx1.link(code)
        for _ in range(SLOW_RUNS):
            w0.run()
        device_to_device(acc, dst=ctx1, src=ctx0)
        on0 = _reference_runs(slow, env, SLOW_RUNS)
        _assert_equal(f"{acc.label} copied to {dev1.device_id} behind {SLOW_RUNS} runs on {dev0.device_id}",
                      ctx1.read(acc), on0[acc])
        # write after read across devices: keep dev1 busy, queue a copy from dev0 behind it,
        # then overwrite the source on dev0
        for _ in range(SLOW_RUNS):
            w1.run()
        device_to_device(acc, dst=ctx1, src=ctx0)  # copies dev0's value (SLOW_RUNS) once dev1 is free
        w0.run()  # dev0 writes acc: must wait for the copy's read
        _assert_equal(f"{acc.label} on {dev1.device_id}: the copy must read the value before the overwrite",
                      ctx1.read(acc), on0[acc])
        _assert_equal(f"{acc.label} on {dev0.device_id}", ctx0.read(acc), _reference_runs(slow, on0, 1)[acc])


# ---------------------------------------------------------------------------
# Device-side copies between nodes that do not start their pools


def _offset_nodes() -> tuple[Node, Node, Node, Node]:
    """A float32 node and a uint8 node of odd size to copy, and two guards around them."""
    return (_f32("off_lo", (64,)), _f32("off_x", (37,)), _f32("off_hi", (16,)),
            Node("off_y", (13,), dtypes.uint8))


def _offset_layout(dev: Device, code: Any, nodes: tuple[Node, Node, Node, Node], rng: np.random.Generator
                   ) -> tuple[Context, dict[Node, Array]]:
    """A context on ``dev`` whose four nodes share one pool (one link of a batch that creates
    them; the planner puts the largest, a guard, first), filled with random values."""
    routine = dev.make_context().link(code)
    routine.run()
    ctx = routine.context
    values: dict[Node, Array] = {}
    for node in nodes:
        if node not in ctx.buffers:
            raise AssertionError(f"linking the layout batch gave {node.label} no buffer")
        values[node] = (rng.integers(0, 256, node.shape).astype(np.uint8) if node.dtype is dtypes.uint8
                        else _small_ints(rng, node.shape, -99, 99))
        ctx.from_host(node, values[node])
    _, x, _, y = nodes
    pools = {ctx.buffers[n].pool_id for n in values}
    if len(pools) != 1 or ctx.buffers[x].offset == 0 or ctx.buffers[y].offset == 0:
        raise AssertionError(f"the kit's layout batch must place its nodes in one pool, the copied ones "
                             f"past the first: {dict(ctx.buffers)}")
    for node, want in values.items():
        _assert_equal(f"{node.label} at offset {ctx.buffers[node].offset} after from_host", ctx.read(node), want)
    return ctx, values


def _where(ctx: Context, node: Node) -> str:
    loc = ctx.buffers[node]
    return f"offset {loc.offset} of pool {loc.pool_id} on {ctx.device.device_id}"


def _copies_at_offsets(backend: Backend, d0: int, d1: int) -> None:
    """device_to_device (NO, then COPY and a merge reader) from nodes at non-zero offsets to
    nodes at non-zero offsets; the neighbouring bytes on both sides must stay as they were."""
    src_dev, dst_dev = backend.get_device(d0), backend.get_device(d1)
    nodes = _offset_nodes()
    lo, x, hi, y = nodes
    layout = backend.compile(ir.Comp.of(ir.fill(lo, 0.0), ir.fill(x, 0.0), ir.fill(hi, 0.0), ir.fill(y, 0)),
                             name="offset_layout")
    reader = backend.compile(_merge_reader(x), name="offset_merge_sum")
    rng = np.random.default_rng(11 + 2 * d0 + d1)
    src, sv = _offset_layout(src_dev, layout, nodes, rng)
    dst, dv = _offset_layout(dst_dev, layout, nodes, rng)
    with _finalizing(src, dst) as held:
        if src.buffers[x].pool_id == dst.buffers[x].pool_id and src_dev is dst_dev:
            raise AssertionError("the two layout contexts of one device must not share a pool")

        def untouched(what: str, ctx: Context, want: dict[Node, Array], nodes: tuple[Node, ...]) -> None:
            for n in nodes:
                _assert_equal(f"{n.label} ({_where(ctx, n)}) after {what}: a neighbour of the copied "
                              f"node must stay untouched", ctx.read(n), want[n])

        for node in (x, y):
            what = (f"device_to_device of {node.label} from {_where(src, node)} to {_where(dst, node)}, "
                    f"{node.nbytes} bytes")
            if device_to_device(node, dst=dst, src=src, into_merge_buffer=MergeBuffer.NO) is None:
                raise AssertionError(f"{what} returned None")
            _assert_equal(f"{node.label} after {what} (copy_device must read nbytes at the source "
                          f"offset and write them at the destination offset)", dst.read(node), sv[node])
            dv[node] = sv[node]
            untouched(what, dst, dv, (lo, hi, x, y))
            untouched(what, src, sv, (lo, hi, x, y))
        # into the merge buffer, then a routine adds it to the destination's own node
        fresh = _small_ints(rng, x.shape, -99, 99)
        dst.from_host(x, fresh)
        dv[x] = fresh
        rc = device_to_device(x, dst=dst, src=src, into_merge_buffer=MergeBuffer.COPY)
        what = f"device_to_device of {x.label} from {_where(src, x)} into the merge buffer of {dst_dev.device_id}"
        if rc is None:
            raise AssertionError(f"{what} returned None")
        merged = rc.context.link(reader)
        held.append(merged.context)
        merged.run()
        want = run_reference([_merge_reader(x)], {x: fresh}, merge={x: sv[x]})[x]
        _assert_equal(f"{x.label} ({_where(dst, x)}) + merge({x.label}) after {what} (copy_device must read "
                      f"the source at its offset)", merged.context.read(x), want)
        dv[x] = want
        untouched(f"{what} and the merge reader", merged.context, dv, (lo, hi, y))
        untouched(f"{what} and the merge reader", src, sv, (lo, hi, x, y))


@_register()
def check_copy_offsets_one_device(backend: Backend) -> None:
    """device_to_device (NO, and COPY into the merge buffer read by a routine) between two pools of
    one device, with both nodes at non-zero offsets: catches a copy_device that ignores the source
    or the destination offset, or copies more bytes than asked."""
    _require_devices(backend, 1)
    _copies_at_offsets(backend, 0, 0)


@_register(multi_device=True)
def check_copy_offsets_two_devices(backend: Backend) -> None:
    """As copy_offsets_one_device, between two devices, both ways."""
    _require_devices(backend, 2)
    _copies_at_offsets(backend, 0, 1)
    _copies_at_offsets(backend, 1, 0)


# ---------------------------------------------------------------------------
# Finalize and errors


@_register()
def check_finalize(backend: Backend) -> None:
    """finalize(): the context and its descendants raise FinalizedError for link / run / from_host /
    to_host; their memory returns; the parent's buffers survive."""
    _require_devices(backend, 1)
    dev = backend.get_device(0)
    a, out, c = _f32("fin_a", (300,)), _f32("fin_out", (300,)), _f32("fin_c", (300,))
    cvals = np.linspace(0, 1, 300, dtype=np.float32)
    comp = ir.Comp.of(ir.constant(c, cvals), ir.apply(Op.ADD, a, c, into=out))
    code = backend.compile(comp, name="finalize_me")
    av = np.arange(300, dtype=np.float32)
    base = _settled_memory(dev)
    root = dev.make_context()
    keep = root.init_from_host(a, av)  # the parent: survives its child's finalize
    after_parent = dev.used_memory()
    child = keep.init_from_host(out, np.zeros(300, np.float32))
    r = child.link(code)
    r.run()
    grand = r.context
    want = run_reference([comp], {a: av})[out]
    _assert_equal(out.label, grand.read(out), want)
    if dev.used_memory() <= after_parent:
        raise AssertionError("linking and init_from_host did not raise used_memory")
    child.finalize()
    child.finalize()  # twice is harmless
    if dev.used_memory() != after_parent:
        raise AssertionError(f"after finalize of a child, used_memory is {dev.used_memory()}, expected "
                             f"{after_parent} (its and its descendants' pools freed, the parent's kept)")
    arr = np.zeros(300, np.float32)
    for ctx, label in ((child, "the finalized context"), (grand, "a descendant of a finalized context")):
        _expect(FinalizedError, lambda ctx=ctx: ctx.link(code), f"link on {label}")  # type: ignore[misc]
        _expect(FinalizedError, lambda ctx=ctx: ctx.from_host(a, arr), f"from_host on {label}")  # type: ignore[misc]
        _expect(FinalizedError, lambda ctx=ctx: ctx.to_host(a, arr), f"to_host on {label}")  # type: ignore[misc]
        _expect(FinalizedError, lambda ctx=ctx: ctx.init_from_host(out, arr), f"init_from_host on {label}")  # type: ignore[misc]
    _expect(FinalizedError, r.run, "run() of a routine whose context was finalized")
    _assert_equal(f"{a.label} in the parent after its child's finalize", keep.read(a), av)
    _assert_usable(backend, keep, "finalize of a child")
    root.finalize()
    if dev.used_memory() != base:
        raise AssertionError(f"after finalize of the root, used_memory is {dev.used_memory()}, expected {base}")
    _expect(FinalizedError, lambda: keep.read(a), "read from a descendant of a finalized root")


# ---------------------------------------------------------------------------
# Memory comes back


FREE_CYCLES = 50
FREE_POOL_BYTES = 4 << 20


def _settle(backend: Backend) -> None:
    """Let every device of the backend give back what dropped contexts and finished work held."""
    gc.collect()
    for dev in backend.devices():
        dev.synchronize()


def _driver_bytes(backend: Backend, ordinal: int) -> int | None:
    fn = getattr(backend.driver, "allocated_bytes", None)
    got = fn(ordinal) if fn is not None else None
    return None if got is None else int(got)


def _check_returned(backend: Backend, dev: Device, what: str, used: int, pending: int,
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
    now = _driver_bytes(backend, dev.ordinal)
    if held is not None and now is not None and now > held:
        raise AssertionError(f"after {what}, the driver still holds {now - held} bytes more than before "
                             f"(allocated_bytes({dev.ordinal}) went from {held} to {now}): its free() does "
                             f"not release pools")


@_register()
def check_free_returns_memory(backend: Backend) -> None:
    """Pools and contexts allocated and released many times (finalize, and dropped for the garbage
    collector): used_memory, pending_free_memory and the driver's allocated_bytes come back
    (catches a driver whose free() does nothing; allocated_bytes None: that part is skipped)."""
    _require_devices(backend, 1)
    dev = backend.get_device(0)
    _settle(backend)
    used, pending, held = dev.used_memory(), dev.pending_free_memory(), _driver_bytes(backend, 0)
    n = max(1, min(FREE_POOL_BYTES, int(dev.info.memory_bytes) // 64) // 8)  # two float32 nodes
    a, b, seed = _f32("free_a", (n,)), _f32("free_b", (n,)), _f32("free_seed", (4,))
    batch = backend.compile_batch([ir.Comp.of(ir.fill(a, 1.0)), ir.Comp.of(ir.apply(Op.ADD, a, 2.0, into=b))],
                                  names=["free_fill", "free_add"])
    root = dev.make_context()
    with _finalizing(root):
        for cycle in range(FREE_CYCLES):
            ctx = root.init_from_host(seed, np.full(4, cycle, np.float32))  # a small pool
            routines = ctx.link_batch(batch)  # a pool of a few MiB
            for r in routines:
                r.run()
            if cycle == 0:
                _assert_equal(f"{b.label} after the first cycle", routines[1].context.read(b),
                              np.full(n, 3.0, np.float32))
                grown = _driver_bytes(backend, 0)
                if held is not None and grown is not None and grown < held + 2 * n * 4:
                    raise AssertionError(f"allocated_bytes(0) is {grown} with a pool of {2 * n * 4} bytes live, "
                                         f"{held} before it: it does not count the pools the driver holds")
            if cycle % 5 == 4:
                del ctx, routines  # the garbage collector's way: released at the next safe point
            else:
                ctx.finalize()
    _check_returned(backend, dev, f"{FREE_CYCLES} cycles of link and release of a {2 * n * 4}-byte pool",
                    used, pending, held)
    if held is None or _driver_bytes(backend, 0) is None:
        raise CheckSkipped("used_memory and pending_free_memory came back; the driver's allocated_bytes is "
                           "None (it cannot tell what it holds), so whether free() releases is unchecked")


@_register()
def check_dropped_work(backend: Backend) -> None:
    """Work still queued when the user drops every reference (its routines, its context, its
    stream, the host arrays of its copies) runs to the end and is ordered before later work; the
    memory comes back."""
    _require_devices(backend, 1)
    dev = backend.get_device(0)
    _settle(backend)
    used, pending, held = dev.used_memory(), dev.pending_free_memory(), _driver_bytes(backend, 0)
    slow, x, acc = _slow_accumulate(SLOW_ELEMENTS // 4)
    out = _f32("dropped_out", acc.shape)
    plus = ir.Comp.of(ir.apply(Op.ADD, acc, 1.0, into=out))
    slow_code, plus_code = backend.compile(slow, name="dropped_slow"), backend.compile(plus, name="dropped_plus")
    env = {x: np.ones(x.shape, np.float32), acc: np.zeros(acc.shape, np.float32)}
    runs = SLOW_RUNS // 2
    root = dev.make_context()
    keep = root.init_from_host(x, env[x]).init_from_host(acc, env[acc])
    with _finalizing(root):
        stream = dev.new_stream()
        ctx = keep.with_stream(stream)
        writer = ctx.link(slow_code)  # writes acc, which the kept context holds
        reader = writer.context.link(plus_code)  # a new pool, owned by the dropped context
        for _ in range(runs):
            writer.run()
            reader.run()
        reader.context.from_host(x, np.ones(x.shape, np.float32))  # a host array only the runtime holds
        reader.context.to_host(out, np.empty(out.shape, np.float32), blocking=False)
        del stream, ctx, writer, reader
        gc.collect()
        want = _reference_runs(slow, env, runs)[acc]
        _assert_equal(f"{acc.label} read on the default stream after {runs} runs queued on a stream whose "
                      f"routines, contexts and stream were dropped", keep.read(acc), want)
        _assert_usable(backend, keep, "dropping queued work")
    del keep
    _check_returned(backend, dev, "dropping queued work and finalizing its parent", used, pending, held)


# ---------------------------------------------------------------------------
# Streams, threads, faults


@_register()
def check_stream_close(backend: Backend) -> None:
    """``with device.new_stream() as s:`` closes s once its queued work is done; a context or a
    routine on a closed stream raises StreamClosedError; the default stream cannot be closed."""
    _require_devices(backend, 1)
    dev = backend.get_device(0)
    slow, x, acc = _slow_accumulate(SLOW_ELEMENTS // 4)
    code = backend.compile(slow, name="close_slow")
    env = {x: np.ones(x.shape, np.float32), acc: np.zeros(acc.shape, np.float32)}
    root = dev.make_context()
    keep = root.init_from_host(x, env[x]).init_from_host(acc, env[acc])
    with _finalizing(root):
        with dev.new_stream() as s:
            ctx = keep.with_stream(s)
            r = ctx.link(code)
            for _ in range(SLOW_RUNS // 2):
                r.run()
            if s not in dev.streams():
                raise AssertionError("Device.streams() must list a new stream until it is closed")
        if not s.closed:
            raise AssertionError("leaving `with device.new_stream() as s:` must close s")
        if s in dev.streams():
            raise AssertionError("Device.streams() still lists a closed stream")
        _assert_equal(f"{acc.label} after closing the stream its {SLOW_RUNS // 2} runs were queued on "
                      "(close waits for the work)", keep.read(acc), _reference_runs(slow, env, SLOW_RUNS // 2)[acc])
        arr = np.zeros(x.shape, np.float32)
        for what, fn in (("Routine.run", r.run), ("Context.link", lambda: ctx.link(code)),
                         ("Context.from_host", lambda: ctx.from_host(x, arr)),
                         ("Context.to_host", lambda: ctx.to_host(x, arr)),
                         ("Context.read", lambda: ctx.read(x)),
                         ("Device.make_context", lambda: dev.make_context(s)),
                         ("Context.with_stream", lambda: keep.with_stream(s)),
                         ("Stream.record", s.record),
                         ("Stream.wait", lambda: s.wait(dev.default_stream.record()))):
            _expect(StreamClosedError, fn, f"{what} on a closed stream")
        s.close()  # twice is harmless
        s.synchronize()  # nothing left to wait for
        _expect(StreamClosedError, dev.default_stream.close, "closing the default stream")
        if dev.default_stream.closed:
            raise AssertionError("a refused close() marked the default stream closed")
        _assert_usable(backend, keep, "closing a stream")


@_register()
def check_threads(backend: Backend) -> None:
    """Four Python threads at once on one device (polyjit.testing.concurrency.thread_stress:
    link, run, copies, device_to_device, finalize, streams, compile): no error, no deadlock, and
    the memory comes back."""
    from polyjit.testing.concurrency import thread_stress

    _require_devices(backend, 1)
    dev = backend.get_device(0)
    _settle(backend)
    used, pending, held = dev.used_memory(), dev.pending_free_memory(), _driver_bytes(backend, 0)
    errors = thread_stress(backend, threads=4, ops=40, deadline_s=120.0)
    if errors:
        shown = "\n".join(errors[:4]) + (f"\n... and {len(errors) - 4} more" if len(errors) > 4 else "")
        raise AssertionError(f"{len(errors)} error(s) with 4 threads on {dev.device_id}:\n{shown}")
    _check_returned(backend, dev, "4 threads of 40 operations", used, pending, held)


FAULT_OPERATIONS = 40  # each compiles with a chance of 0.15: keep the compiler's share small
FAULT_RATE = 0.15


@_register()
def check_fault_typing(backend: Backend) -> None:
    """Driver calls that fail at random (polyjit.testing.faults.FaultyDriver over this backend's
    driver, driven by fault_storm): every failure reaches the user as a PolyjitError (DriverError,
    PoolExhaustedError, DeviceFaultError...), and once the faults stop every byte comes back.
    Runs on a second Backend over the same driver object: the kit runs checks one at a time, so
    the driver never sees two runtimes' calls at once."""
    from polyjit.testing.faults import FaultyDriver, fault_storm

    _require_devices(backend, 1)
    _settle(backend)
    held = _driver_bytes(backend, 0)
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
        _check_returned(wrapped, dev, f"a storm of {FAULT_OPERATIONS} operations with faults {faulty.injected}",
                        0, 0, held)
        _assert_usable(wrapped, dev.make_context(), f"the injected faults {faulty.injected}")
    finally:
        faulty.armed = False
        wrapped.close()  # its devices' streams, the default ones too
    _assert_usable(backend, backend.get_device(0).make_context(), "a fault storm on the same driver")


@_register()
def check_unknown_device(backend: Backend) -> None:
    """get_device with an ordinal outside [0, num_devices()) raises UnknownDeviceError."""
    n = backend.num_devices()
    for bad in (n, n + 7, -1):
        _expect(UnknownDeviceError, lambda bad=bad: backend.get_device(bad), f"get_device({bad}) with {n} devices")  # type: ignore[misc]


@_register()
def check_node_not_in_context(backend: Backend) -> None:
    """Linking a routine that reads a node the context lacks raises NodeNotInContextError naming it."""
    _require_devices(backend, 1)
    dev = backend.get_device(0)
    a, missing, out = _f32("nic_a", (5,)), _f32("nic_missing", (5,)), _f32("nic_out", (5,))
    code = backend.compile(ir.Comp.of(ir.apply(Op.MUL, a, missing, into=out)), name="needs_missing")
    ctx = dev.make_context().init_from_host(a, np.ones(5, np.float32))
    with _finalizing(ctx):
        base = _settled_memory(dev)
        e = _expect(NodeNotInContextError, lambda: ctx.link(code), "linking without an input node",
                    contains=missing.label)
        if not isinstance(e, KeyError):
            raise AssertionError("NodeNotInContextError should also be a KeyError")
        if dev.used_memory() != base:
            raise AssertionError("a failed link allocated memory")
        acc = _f32("nic_acc", (5,))
        onto = ir.Comp.of(ir.apply(Op.ID, a, into=acc, accum=AccumOp.ADD, init_neutral=False))
        _expect(NodeNotInContextError, lambda: ctx.link(backend.compile(onto, name="onto_missing")),
                "linking an accumulation onto a node the context lacks", contains=acc.label)
        _assert_usable(backend, ctx, "NodeNotInContextError")


# ---------------------------------------------------------------------------
# Running the checks


def run_check(check: CheckFn, backend: Backend, multi_device_backend: Backend | None = None) -> None:
    """Run one check with the right backend; raises CheckSkipped when it cannot run here."""
    if needs_multi_device(check):
        if multi_device_backend is None or multi_device_backend.num_devices() < 2:
            raise CheckSkipped(f"needs a backend with two devices; none is available for {backend.name!r}")
        check(multi_device_backend)
    else:
        check(backend)


@functools.cache
def _split_cpu_backend() -> Backend:
    from polyjit.backends.cpu import create_backend

    return create_backend(num_devices=2)


def default_multi_device_backend(backend: Backend) -> Backend | None:
    """The backend itself when it has two devices or more; for ``cpu``, a backend that splits the
    machine into two devices; else None."""
    if backend.num_devices() >= 2:
        return backend
    if backend.name == "cpu":
        return _split_cpu_backend()
    return None


def required_backends() -> list[str]:
    """The backends ``$POLYJIT_REQUIRE_BACKENDS`` names (comma-separated): where they are
    missing, their tests fail instead of skipping. Read here and nowhere else."""
    return [b.strip() for b in os.environ.get("POLYJIT_REQUIRE_BACKENDS", "").split(",") if b.strip()]


class ConformanceSuite:
    """Subclass as ``class TestMyBackend(ConformanceSuite): backend_name = "mine"``: pytest then
    collects one ``test_<check>`` per check of :data:`CHECKS`."""

    backend_name: ClassVar[str | None] = None

    def backend(self) -> Backend:
        if self.backend_name is None:
            raise NotImplementedError("set backend_name or override backend()")
        from polyjit.backends import get_backend

        return get_backend(self.backend_name)

    def multi_device_backend(self) -> Backend | None:
        """A backend of the same kind with at least two devices, or None when there is none."""
        return default_multi_device_backend(self.backend())

    def _run(self, check: CheckFn) -> None:
        import pytest

        name = self.backend_name or type(self).__name__
        try:
            backend = self.backend()
            devices = backend.num_devices()
        except BackendUnavailableError as e:
            if name in required_backends():
                raise AssertionError(f"required backend {name!r} is unavailable: {e}") from e
            pytest.skip(f"backend {name!r} is unavailable: {e}")
        if devices == 0 and check is not check_unknown_device:
            if name in required_backends():
                raise AssertionError(f"required backend {name!r} has no devices")
            pytest.skip(f"backend {name!r} has no devices")
        try:
            run_check(check, backend, self.multi_device_backend() if needs_multi_device(check) else None)
        except CheckSkipped as e:
            pytest.skip(str(e))


def _make_test(check: CheckFn) -> Callable[[ConformanceSuite], None]:
    def test(self: ConformanceSuite) -> None:
        self._run(check)

    test.__name__ = f"test_{check_name(check)}"
    test.__qualname__ = f"ConformanceSuite.{test.__name__}"
    test.__doc__ = check.__doc__
    return test


for _check in CHECKS:
    setattr(ConformanceSuite, f"test_{check_name(_check)}", _make_test(_check))
del _check


# ---------------------------------------------------------------------------
# The CLI


def run_selftest(backend_name: str, *, verbose: bool = False) -> int:
    """Run every check on a backend, print one line per check, return the number of failures."""
    try:
        from polyjit.backends import get_backend

        backend = get_backend(backend_name)
        n = backend.num_devices()
    except PolyjitError as e:
        print(f"FAIL  backend {backend_name!r} cannot start: {type(e).__name__}: {e}")
        print("0 passed, 1 failed")
        return 1
    if n == 0:
        print(f"FAIL  backend {backend_name!r} has no devices")
        print("0 passed, 1 failed")
        return 1
    multi = default_multi_device_backend(backend)
    print(f"polyjit selftest: backend {backend_name!r}, {n} device(s)"
          + (f"; multi-device checks on {multi.num_devices()} devices" if multi is not None else ""))
    passed = failed = skipped = 0
    width = max(len(check_name(c)) for c in CHECKS)
    for check in CHECKS:
        t0 = time.perf_counter()
        status, detail = "pass", ""
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always", KitNote)
                run_check(check, backend, multi)
            passed += 1
            detail = "; ".join(str(w.message) for w in seen if issubclass(w.category, KitNote))
            for w in seen:  # other warnings as they would have shown
                if not issubclass(w.category, KitNote):
                    warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        except CheckSkipped as e:
            status, detail = "skip", str(e)
            skipped += 1
        except Exception as e:
            status = "FAIL"
            failed += 1
            detail = (traceback.format_exc() if verbose or not isinstance(e, AssertionError)
                      else f"{e}")
        dt = time.perf_counter() - t0
        shown = f"  ({detail})" if status == "skip" else (f"  (note: {detail})" if status == "pass" and detail else "")
        print(f"{status:4}  {check_name(check):{width}}  {dt:7.2f}s{shown}")
        if status == "FAIL":
            lines = detail.rstrip().splitlines()
            if not verbose and len(lines) > 30:
                lines = [*lines[:30], f"... ({len(lines) - 30} more lines; use --verbose)"]
            for line in lines:
                print(f"      {line}")
        elif verbose and check.__doc__:
            print(f"      {check.__doc__.strip().splitlines()[0]}")
    print(f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
    return failed
