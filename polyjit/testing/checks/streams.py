"""Checks of streams and events: synchronization, ordering across streams and devices, closing."""

from __future__ import annotations

import numpy as np

from polyjit.core import ir
from polyjit.core.errors import StreamClosedError
from polyjit.core.ir import AccumOp, Op
from polyjit.core.reference import run_reference
from polyjit.core.runtime import Backend, device_to_device
from polyjit.testing.checks.common import (
    SLOW_ELEMENTS,
    SLOW_RUNS,
    assert_equal,
    assert_usable,
    expect,
    f32,
    finalizing,
    multi_device,
    reference_runs,
    require_devices,
    slow_accumulate,
)


def check_events_and_device_sync(backend: Backend) -> None:
    """Event.sync / is_done, Stream.record / synchronize, Device.all_work / synchronize / is_idle."""
    require_devices(backend, 1)
    dev = backend.get_device(0)
    slow, x, acc = slow_accumulate()
    stream = dev.new_stream()
    env = {x: np.ones(x.shape, np.float32), acc: np.zeros(acc.shape, np.float32)}
    ctx = dev.make_context(stream).init_from_host(x, env[x]).init_from_host(acc, env[acc])
    with finalizing(ctx):
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
        want = reference_runs(slow, env, 3 * SLOW_RUNS)[acc]
        assert_equal(f"{acc.label} after {3 * SLOW_RUNS} runs", r.context.read(acc), want)
        if not ev.is_done():
            raise AssertionError("an event that was done is no longer done")


def check_cross_stream_ordering(backend: Backend) -> None:
    """Routines on two streams of a device order themselves through the events of their buffers
    (read after write, write after read), with no will_wait_for from the user."""
    require_devices(backend, 1)
    dev = backend.get_device(0)
    sa, sb = dev.new_stream(), dev.new_stream()
    slow, x, acc = slow_accumulate()
    z = f32("xs_z", acc.shape)
    reader = ir.Comp.of(ir.apply(Op.ADD, acc, 0.5, into=z))
    env = {x: np.full(x.shape, 2.0, np.float32), acc: np.zeros(acc.shape, np.float32)}
    ctx_a = dev.make_context(sa).init_from_host(x, env[x]).init_from_host(acc, env[acc])
    with finalizing(ctx_a):
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
        state = reference_runs(slow, env, SLOW_RUNS)
        state = run_reference([reader], state)
        assert_equal(f"{z.label} read on stream B after {SLOW_RUNS} runs on stream A", got, state[z])
        if not last_write.is_done():
            raise AssertionError("stream B finished a read of A's output before A's write was done")
        # write after read: A rewrites x while B's slow routine still reads it
        out_b = f32("xs_out", x.shape)
        slow_read = ir.Comp.of(ir.apply(Op.ID, x, into=out_b, accum=AccumOp.ADD, init_neutral=False))
        ctx_b2 = ctx_b.init_from_host(out_b, np.zeros(out_b.shape, np.float32))
        sr = ctx_b2.link(backend.compile(slow_read, name="slow_reader_b"))
        overwrite = ir.Comp.of(ir.fill(x, -100.0))
        fill = ctx_a.link(backend.compile(overwrite, name="overwrite_a"))
        for _ in range(SLOW_RUNS):
            sr.run()
        fill.run()  # on stream A: must wait for B's reads of x
        state[out_b] = np.zeros(out_b.shape, np.float32)
        state = reference_runs(slow_read, state, SLOW_RUNS)
        assert_equal(f"{out_b.label}: B's reads of x while A overwrote it", sr.context.read(out_b), state[out_b])
        state = run_reference([overwrite], state)
        assert_equal(f"{x.label} after the overwrite on A", fill.context.read(x), state[x])
        # a host transfer on stream B orders itself after A's work too
        for _ in range(SLOW_RUNS):
            writer.run()
        new = np.full(acc.shape, 7.0, np.float32)
        ctx_b.from_host(acc, new)
        assert_equal(f"{acc.label} after from_host on B behind A's writes", ctx_a.read(acc), new)


@multi_device
def check_cross_device_ordering(backend: Backend) -> None:
    """A copy to another device waits for the slow writer on the source device; a write on the
    source waits for a copy still queued behind slow work on the destination."""
    require_devices(backend, 2)
    dev0, dev1 = backend.get_device(0), backend.get_device(1)
    slow, x, acc = slow_accumulate()
    env = {x: np.ones(x.shape, np.float32), acc: np.zeros(acc.shape, np.float32)}
    ctx0 = dev0.make_context().init_from_host(x, env[x]).init_from_host(acc, env[acc])
    ctx1 = dev1.make_context().init_from_host(x, env[x]).init_from_host(acc, env[acc])
    code = backend.compile(slow, name="slow_cross")
    with finalizing(ctx0, ctx1):
        w0, w1 = ctx0.link(code), ctx1.link(code)
        for _ in range(SLOW_RUNS):
            w0.run()
        device_to_device(acc, dst=ctx1, src=ctx0)
        on0 = reference_runs(slow, env, SLOW_RUNS)
        assert_equal(f"{acc.label} copied to {dev1.device_id} behind {SLOW_RUNS} runs on {dev0.device_id}",
                      ctx1.read(acc), on0[acc])
        # write after read across devices: keep dev1 busy, queue a copy from dev0 behind it,
        # then overwrite the source on dev0
        for _ in range(SLOW_RUNS):
            w1.run()
        device_to_device(acc, dst=ctx1, src=ctx0)  # copies dev0's value (SLOW_RUNS) once dev1 is free
        w0.run()  # dev0 writes acc: must wait for the copy's read
        assert_equal(f"{acc.label} on {dev1.device_id}: the copy must read the value before the overwrite",
                      ctx1.read(acc), on0[acc])
        assert_equal(f"{acc.label} on {dev0.device_id}", ctx0.read(acc), reference_runs(slow, on0, 1)[acc])


def check_stream_close(backend: Backend) -> None:
    """``with device.new_stream() as s:`` closes s once its queued work is done; a context or a
    routine on a closed stream raises StreamClosedError; the default stream cannot be closed."""
    require_devices(backend, 1)
    dev = backend.get_device(0)
    slow, x, acc = slow_accumulate(SLOW_ELEMENTS // 4)
    code = backend.compile(slow, name="close_slow")
    env = {x: np.ones(x.shape, np.float32), acc: np.zeros(acc.shape, np.float32)}
    root = dev.make_context()
    keep = root.init_from_host(x, env[x]).init_from_host(acc, env[acc])
    with finalizing(root):
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
        assert_equal(f"{acc.label} after closing the stream its {SLOW_RUNS // 2} runs were queued on "
                      "(close waits for the work)", keep.read(acc), reference_runs(slow, env, SLOW_RUNS // 2)[acc])
        arr = np.zeros(x.shape, np.float32)
        for what, fn in (("Routine.run", r.run), ("Context.link", lambda: ctx.link(code)),
                         ("Context.from_host", lambda: ctx.from_host(x, arr)),
                         ("Context.to_host", lambda: ctx.to_host(x, arr)),
                         ("Context.read", lambda: ctx.read(x)),
                         ("Device.make_context", lambda: dev.make_context(s)),
                         ("Context.with_stream", lambda: keep.with_stream(s)),
                         ("Stream.record", s.record),
                         ("Stream.wait", lambda: s.wait(dev.default_stream.record()))):
            expect(StreamClosedError, fn, f"{what} on a closed stream")
        s.close()  # twice is harmless
        s.synchronize()  # nothing left to wait for
        expect(StreamClosedError, dev.default_stream.close, "closing the default stream")
        if dev.default_stream.closed:
            raise AssertionError("a refused close() marked the default stream closed")
        assert_usable(backend, keep, "closing a stream")
