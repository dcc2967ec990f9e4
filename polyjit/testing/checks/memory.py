"""Checks of device memory: pools, memset, exhaustion, finalize, and memory that comes back."""

from __future__ import annotations

import gc

import numpy as np

from polyjit.core import dtypes, ir
from polyjit.core.errors import FinalizedError, PoolExhaustedError
from polyjit.core.ir import Node, Op
from polyjit.core.reference import run_reference
from polyjit.core.runtime import Backend
from polyjit.testing.checks.common import (
    SLOW_ELEMENTS,
    SLOW_RUNS,
    CheckSkipped,
    assert_equal,
    assert_returned,
    assert_usable,
    driver_bytes,
    expect,
    f32,
    finalizing,
    reference_runs,
    require_devices,
    settle,
    settled_memory,
    slow_accumulate,
)


def check_alloc_and_memset(backend: Backend) -> None:
    """Device.alloc_pool / free_pool / memset_zero; used_memory is exact."""
    require_devices(backend, 1)
    dev = backend.get_device(0)
    base = settled_memory(dev)
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
    # memset_zero over a node's buffer, in part (aligned, and at odd offsets and lengths), not at
    # all (zero bytes), then whole. Every byte starts nonzero, so a memset that stops short by
    # even one byte, or starts late, leaves a byte that shows.
    rng = np.random.default_rng(1)
    node = Node("memset_target", (256,), dtypes.uint8)
    values = rng.integers(1, 256, node.shape).astype(np.uint8)
    ctx = dev.make_context().init_from_host(node, values)
    with finalizing(ctx):
        if dev.used_memory() < base + node.nbytes:
            raise AssertionError(f"used_memory did not grow by the {node.nbytes} bytes of a new buffer")
        loc = ctx.buffers[node]
        want = values.copy()
        for start, length in ((64, 32), (131, 37), (201, 3), (170, 0), (250, 1)):
            dev.memset_zero(loc.pool_id, loc.offset + start, length)
            want[start:start + length] = 0
            assert_equal(f"after memset_zero of {length} bytes at offset {start} of a {node.nbytes}-byte "
                         f"buffer (bytes not zeroed before were all nonzero)", ctx.read(node), want)
        dev.memset_zero(loc.pool_id, loc.offset, node.nbytes)
        assert_equal("after memset_zero of the whole buffer", ctx.read(node), np.zeros_like(values))
    if dev.used_memory() != base:
        raise AssertionError(f"used_memory after finalize is {dev.used_memory()}, expected {base}")


def check_pool_exhausted(backend: Backend) -> None:
    """alloc_pool beyond the device's memory raises PoolExhaustedError; nothing leaks."""
    require_devices(backend, 1)
    dev = backend.get_device(0)
    ctx = dev.make_context()
    base = settled_memory(dev)
    info = getattr(dev, "info", None)
    memory = int(info.memory_bytes if info is not None else dev.properties["memory_bytes"])
    expect(PoolExhaustedError, lambda: dev.alloc_pool(1 << 30, memory + 1, 64),
            f"alloc_pool of {memory + 1} bytes on a device of {memory}")
    if dev.used_memory() != base:
        raise AssertionError(f"a failed alloc_pool changed used_memory from {base} to {dev.used_memory()}")
    big = Node("too_big", (memory // 4 + 1,), dtypes.float32)
    expect(PoolExhaustedError, lambda: ctx.link(backend.compile(ir.Comp.of(ir.fill(big, 1.0)), name="too_big")),
            f"linking a routine whose buffer ({big.nbytes} bytes) exceeds the device memory")
    if dev.used_memory() != base:
        raise AssertionError(f"a failed link changed used_memory from {base} to {dev.used_memory()}")
    assert_usable(backend, ctx, "PoolExhaustedError")


# ---------------------------------------------------------------------------
# Finalize


def check_finalize(backend: Backend) -> None:
    """finalize(): the context and its descendants raise FinalizedError for link / run / from_host /
    to_host; their memory returns; the parent's buffers survive."""
    require_devices(backend, 1)
    dev = backend.get_device(0)
    a, out, c = f32("fin_a", (300,)), f32("fin_out", (300,)), f32("fin_c", (300,))
    cvals = np.linspace(0, 1, 300, dtype=np.float32)
    comp = ir.Comp.of(ir.constant(c, cvals), ir.apply(Op.ADD, a, c, into=out))
    code = backend.compile(comp, name="finalize_me")
    av = np.arange(300, dtype=np.float32)
    base = settled_memory(dev)
    root = dev.make_context()
    keep = root.init_from_host(a, av)  # the parent: survives its child's finalize
    after_parent = dev.used_memory()
    child = keep.init_from_host(out, np.zeros(300, np.float32))
    r = child.link(code)
    r.run()
    grand = r.context
    want = run_reference([comp], {a: av})[out]
    assert_equal(out.label, grand.read(out), want)
    if dev.used_memory() <= after_parent:
        raise AssertionError("linking and init_from_host did not raise used_memory")
    child.finalize()
    child.finalize()  # twice is harmless
    if dev.used_memory() != after_parent:
        raise AssertionError(f"after finalize of a child, used_memory is {dev.used_memory()}, expected "
                             f"{after_parent} (its and its descendants' pools freed, the parent's kept)")
    arr = np.zeros(300, np.float32)
    for ctx, label in ((child, "the finalized context"), (grand, "a descendant of a finalized context")):
        expect(FinalizedError, lambda ctx=ctx: ctx.link(code), f"link on {label}")  # type: ignore[misc]
        expect(FinalizedError, lambda ctx=ctx: ctx.from_host(a, arr), f"from_host on {label}")  # type: ignore[misc]
        expect(FinalizedError, lambda ctx=ctx: ctx.to_host(a, arr), f"to_host on {label}")  # type: ignore[misc]
        expect(FinalizedError, lambda ctx=ctx: ctx.init_from_host(out, arr), f"init_from_host on {label}")  # type: ignore[misc]
    expect(FinalizedError, r.run, "run() of a routine whose context was finalized")
    assert_equal(f"{a.label} in the parent after its child's finalize", keep.read(a), av)
    assert_usable(backend, keep, "finalize of a child")
    root.finalize()
    if dev.used_memory() != base:
        raise AssertionError(f"after finalize of the root, used_memory is {dev.used_memory()}, expected {base}")
    expect(FinalizedError, lambda: keep.read(a), "read from a descendant of a finalized root")


# ---------------------------------------------------------------------------
# Memory comes back


FREE_CYCLES = 50


FREE_POOL_BYTES = 4 << 20


def check_free_returns_memory(backend: Backend) -> None:
    """Pools and contexts allocated and released many times (finalize, and dropped for the garbage
    collector): used_memory, pending_free_memory and the driver's allocated_bytes come back
    (catches a driver whose free() does nothing; allocated_bytes None: that part is skipped)."""
    require_devices(backend, 1)
    dev = backend.get_device(0)
    settle(backend)
    used, pending, held = dev.used_memory(), dev.pending_free_memory(), driver_bytes(backend, 0)
    n = max(1, min(FREE_POOL_BYTES, int(dev.info.memory_bytes) // 64) // 8)  # two float32 nodes
    a, b, seed = f32("free_a", (n,)), f32("free_b", (n,)), f32("free_seed", (4,))
    batch = backend.compile_batch([ir.Comp.of(ir.fill(a, 1.0)), ir.Comp.of(ir.apply(Op.ADD, a, 2.0, into=b))],
                                  names=["free_fill", "free_add"])
    root = dev.make_context()
    with finalizing(root):
        for cycle in range(FREE_CYCLES):
            ctx = root.init_from_host(seed, np.full(4, cycle, np.float32))  # a small pool
            routines = ctx.link_batch(batch)  # a pool of a few MiB
            for r in routines:
                r.run()
            if cycle == 0:
                assert_equal(f"{b.label} after the first cycle", routines[1].context.read(b),
                              np.full(n, 3.0, np.float32))
                grown = driver_bytes(backend, 0)
                if held is not None and grown is not None and grown < held + 2 * n * 4:
                    raise AssertionError(f"allocated_bytes(0) is {grown} with a pool of {2 * n * 4} bytes live, "
                                         f"{held} before it: it does not count the pools the driver holds")
            if cycle % 5 == 4:
                del ctx, routines  # the garbage collector's way: released at the next safe point
            else:
                ctx.finalize()
    assert_returned(backend, dev, f"{FREE_CYCLES} cycles of link and release of a {2 * n * 4}-byte pool",
                    used, pending, held)
    if held is None or driver_bytes(backend, 0) is None:
        raise CheckSkipped("used_memory and pending_free_memory came back; the driver's allocated_bytes is "
                           "None (it cannot tell what it holds), so whether free() releases is unchecked")


def check_dropped_work(backend: Backend) -> None:
    """Work still queued when the user drops every reference (its routines, its context, its
    stream, the host arrays of its copies) runs to the end and is ordered before later work; the
    memory comes back."""
    require_devices(backend, 1)
    dev = backend.get_device(0)
    settle(backend)
    used, pending, held = dev.used_memory(), dev.pending_free_memory(), driver_bytes(backend, 0)
    slow, x, acc = slow_accumulate(SLOW_ELEMENTS // 4)
    out = f32("dropped_out", acc.shape)
    plus = ir.Comp.of(ir.apply(Op.ADD, acc, 1.0, into=out))
    slow_code, plus_code = backend.compile(slow, name="dropped_slow"), backend.compile(plus, name="dropped_plus")
    env = {x: np.ones(x.shape, np.float32), acc: np.zeros(acc.shape, np.float32)}
    runs = SLOW_RUNS // 2
    root = dev.make_context()
    keep = root.init_from_host(x, env[x]).init_from_host(acc, env[acc])
    with finalizing(root):
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
        want = reference_runs(slow, env, runs)[acc]
        assert_equal(f"{acc.label} read on the default stream after {runs} runs queued on a stream whose "
                      f"routines, contexts and stream were dropped", keep.read(acc), want)
        assert_usable(backend, keep, "dropping queued work")
    del keep
    assert_returned(backend, dev, "dropping queued work and finalizing its parent", used, pending, held)
