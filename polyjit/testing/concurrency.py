"""Many Python threads on shared devices and contexts at once.

:func:`thread_stress` runs ``threads`` threads that each do ``ops`` random operations
(compile, link into stream children of one shared context, run, copy in and out, read,
device_to_device, finalize, open and close streams) on a backend, every result checked
against numpy. It returns the errors it saw; a deadlock shows as threads still alive at
the deadline. :func:`close_with_late_work` closes a stream as if another thread enqueued
work during ``close()``'s own wait.
"""

from __future__ import annotations

import random
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from polyjit.core import ir
from polyjit.core.context import Context
from polyjit.core.ir import Node, Op
from polyjit.core.routine import Routine, device_to_device
from polyjit.core.runtime import Backend
from polyjit.core.streams import Stream

__all__ = ["close_with_late_work", "thread_stress"]

N = 4096


class _Worker:
    """One thread's state: its own nodes, contexts and routines; expected values in numpy."""

    def __init__(self, k: int, backend: Backend, root: Context, shared: Node, shared_value: np.ndarray,
                 seed: int) -> None:
        self.k = k
        self.backend = backend
        self.root = root
        self.shared, self.shared_value = shared, shared_value
        self.rng = random.Random(seed * 1000 + k)
        self.x = Node(f"x{k}", (N,))
        self.y = Node(f"y{k}", (N,))
        self.x_value = np.full(N, float(k), np.float32)
        self.contexts: list[Context] = []
        self.routines: list[Routine] = []
        self.codes: dict[float, Any] = {}

    def fresh_context(self) -> Context:
        dev = self.root.device
        base = self.root if self.rng.random() < 0.5 else self.root.with_stream(dev.new_stream())
        ctx = base.init_from_host(self.x, self.x_value)
        self.contexts.append(ctx)
        return ctx

    def code(self, scale: float) -> Any:
        """y = x * scale + shared, compiled once per scale (then from the worker's table)."""
        hit = self.codes.get(scale)
        if hit is None:
            s, t = Node("s", ()), Node("t", (N,))
            comp = ir.Comp.of(ir.fill(s, scale), ir.apply(Op.MUL, self.x, s, into=t),
                              ir.apply(Op.ADD, t, self.shared, into=self.y))
            hit = self.codes[scale] = self.backend.compile(comp, name=f"stress{self.k}_{int(scale)}")
        return hit

    def check(self, ctx: Context, scale: float) -> None:
        want = self.x_value * np.float32(scale) + self.shared_value
        got = ctx.read(self.y)
        if not np.allclose(got, want, rtol=1e-6):
            raise AssertionError(f"thread {self.k}: y = {got[:3]}..., expected {want[:3]}...")

    def step(self) -> None:
        r = self.rng.random()
        if r < 0.25 or not self.routines:
            scale = float(self.rng.randrange(1, 4))
            ctx = self.fresh_context()
            routine = ctx.link(self.code(scale))
            routine.run()
            self.routines.append(routine)
            self.check(routine.context, scale)
        elif r < 0.45:
            routine = self.rng.choice(self.routines)
            if routine.context.finalized:
                return
            for _ in range(self.rng.randrange(1, 4)):
                routine.run()
            if self.rng.random() < 0.5:
                scale = float(routine.name.rsplit("_", 1)[1])
                self.check(routine.context, scale)
        elif r < 0.6:
            live = [c for c in self.contexts if not c.finalized]
            if live:
                value = np.full(N, float(self.rng.randrange(10)), np.float32)
                ctx = self.rng.choice(live)
                ctx.from_host(self.x, value)
                back = np.empty(N, np.float32)
                ctx.to_host(self.x, back, blocking=self.rng.random() < 0.5)
                ctx.stream.synchronize()
                if not np.array_equal(back, value):
                    raise AssertionError(f"thread {self.k}: from_host/to_host round trip lost data")
                ctx.from_host(self.x, self.x_value)
        elif r < 0.72:
            live = [c for c in self.contexts if not c.finalized]
            if len(live) >= 2:
                a, b = self.rng.sample(live, 2)
                device_to_device(self.x, dst=b, src=a)
                if not np.array_equal(b.read(self.x), a.read(self.x)):
                    raise AssertionError(f"thread {self.k}: device_to_device lost data")
        elif r < 0.85:
            if self.contexts:
                victim = self.contexts.pop(self.rng.randrange(len(self.contexts)))
                victim.finalize()
                self.routines = [rt for rt in self.routines if not rt.context.finalized]
        elif r < 0.93:
            with self.root.device.new_stream() as s:
                s.synchronize()
        else:
            self.backend.compile(ir.Comp.of(ir.apply(Op.EXP, self.x, into=self.y)), name=f"side{self.k}")

    def close(self) -> None:
        for ctx in self.contexts:
            ctx.finalize()


def thread_stress(backend: Backend, *, threads: int = 8, ops: int = 200, seed: int = 0,
                  deadline_s: float = 240.0, ordinal: int = 0) -> list[str]:
    """Run the workers; return a description of every error (and of the threads still running
    once none has finished an operation for ``deadline_s``: a deadlock). The deadline runs from
    the last operation any thread finished, not from the start: on a loaded machine the
    threads go slowly but go (a fixed total once cut a starved run short, session 35)."""
    dev = backend.get_device(ordinal)
    shared = Node("shared", (N,))
    shared_value = np.linspace(-1, 1, N, dtype=np.float32)
    root = dev.make_context().init_from_host(shared, shared_value)
    errors: list[str] = []
    start = threading.Barrier(threads)
    done = [0]  # operations finished, by every thread (a lost increment only delays a verdict)

    def body(k: int) -> None:
        try:
            worker = _Worker(k, backend, root, shared, shared_value, seed)
        except Exception:  # found by review: the others waited at the barrier, read as a deadlock
            errors.append(f"thread {k} (setting up):\n{traceback.format_exc()}")
            start.abort()
            return
        try:
            start.wait()
            for _ in range(ops):
                worker.step()
                done[0] += 1
            worker.close()
        except threading.BrokenBarrierError:
            pass  # another thread's set-up failed: its error says why
        except Exception:
            errors.append(f"thread {k}:\n{traceback.format_exc()}")

    pool = [threading.Thread(target=body, args=(k,), daemon=True) for k in range(threads)]
    for t in pool:
        t.start()
    seen, since = -1, time.monotonic()
    while any(t.is_alive() for t in pool):
        if done[0] != seen:
            seen, since = done[0], time.monotonic()
        elif time.monotonic() - since > deadline_s:
            break
        next(t for t in pool if t.is_alive()).join(0.5)
    stuck = [t.name for t in pool if t.is_alive()]
    if stuck:
        errors.append(f"{len(stuck)} thread(s) still running, no operation finished in {deadline_s} s "
                      f"(a deadlock?), {done[0]} of {threads * ops} done: {stuck}")
    else:
        root.finalize()
    return errors


def close_with_late_work(stream: Stream, work: Callable[[], object]) -> None:
    """``stream.close()``, with ``work()`` (an enqueue on the stream) run right after close's
    own wait, where another thread's enqueue lands once in a long while: close() must wait for
    it too before it ends the stream."""
    wait = stream.synchronize
    ran: list[bool] = []

    def wait_then_work() -> None:
        wait()
        if not ran:
            ran.append(True)
            work()

    stream.synchronize = wait_then_work  # type: ignore[method-assign]
    try:
        stream.close()
    finally:
        del stream.synchronize
    if not ran:
        raise AssertionError(f"close() of {stream!r} never waited: the late work was not enqueued")
