"""Any number of Python threads may compile, link, run, copy, read and finalize on shared
devices and contexts at once (docs/reliability.md, "Threads").

Each scenario runs in a child process with a timeout: a crash or a deadlock fails the test
instead of the whole run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from polyjit import get_backend

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("cpu", "opencl")
# The cpu backend again with its waiting threads running their streams' work (as on a busy
# machine, where the runtime does that by itself: docs/reliability.md, "Threads").
CASES = [pytest.param(n, {}, id=n) for n in BACKENDS] + [
    pytest.param("cpu", {"POLYJIT_CPU_CONTENTION": "on"}, id="cpu-contended")]


def _child(code: str, timeout: int, env: dict[str, str] | None = None) -> str:
    try:
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                              text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"no result after {timeout} s: a deadlock?\n{e.stdout!r}\n{e.stderr!r}") from e
    assert done.returncode == 0, f"exit {done.returncode}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    return done.stdout


def _available(name: str) -> None:
    be = get_backend(name)
    if be.num_devices() == 0:
        pytest.skip(f"no {name} device: {be.unavailable_reason}")


@pytest.mark.parametrize(("name", "env"), CASES)
def test_four_linkers_and_a_feeder(name: str, env: dict[str, str]) -> None:
    """Four threads link into stream children of one context while a fifth calls from_host:
    this crashed the cpu backend in most runs."""
    _available(name)
    out = _child(f"""
        import threading, numpy as np
        from polyjit import get_backend, ir
        be = get_backend({name!r})
        dev = be.get_device(0)
        n = 1 << 14
        a, b, out = ir.Node("a", (n,)), ir.Node("b", (n,)), ir.Node("out", (n,))
        code = be.compile(ir.Comp.of(ir.apply(ir.Op.MUL, a, a, into=out)), name="sq")
        for round in range(8):
            root = dev.make_context().init_from_host(a, np.full(n, 3, np.float32))
            root = root.init_from_host(b, np.zeros(n, np.float32))
            results = []
            def linker():
                for _ in range(60):
                    with dev.new_stream() as s:
                        r = root.with_stream(s).link(code)
                        r.run()
                        results.append(float(r.context.read(out)[7]))
            def feeder():
                for k in range(300):
                    root.from_host(b, np.full(n, k, np.float32))
            ts = [threading.Thread(target=linker) for _ in range(4)] + [threading.Thread(target=feeder)]
            [t.start() for t in ts]
            [t.join() for t in ts]
            assert results == [9.0] * 240, results[:5]
            assert float(root.read(b)[0]) == 299.0
            root.finalize()
        print("ok")
    """, timeout=300, env=env)
    assert out.split() == ["ok"]


@pytest.mark.parametrize(("name", "env"), CASES)
def test_eight_threads_times_200_mixed_operations(name: str, env: dict[str, str]) -> None:
    """polyjit.testing.concurrency.thread_stress, three seeds: results checked against numpy,
    threads still running at the deadline count as a deadlock."""
    _available(name)
    out = _child(f"""
        import time
        from polyjit import get_backend
        from polyjit.testing.concurrency import thread_stress
        be = get_backend({name!r})
        for seed in range(3):
            t0 = time.perf_counter()
            errors = thread_stress(be, threads=8, ops=200, seed=seed, deadline_s=150)
            if errors:
                raise SystemExit("\\n".join(errors)[:6000])
            print("seed", seed, round(time.perf_counter() - t0, 1))
        print("ok")
    """, timeout=540, env=env)
    assert out.split()[-1] == "ok"


def test_the_stress_calls_a_deadlock_once_no_thread_moves_not_at_a_fixed_total() -> None:
    """thread_stress's deadline runs from the last operation any thread finished: a thread that
    never returns is reported once the others are done and nothing moves for the deadline,
    while threads that go slowly (a loaded machine) are not cut short."""
    out = _child("""
        import threading, time
        from polyjit import get_backend
        from polyjit.testing import concurrency
        stuck = threading.Event()
        class Worker:  # the verdict alone: no compile's time in the way (a loaded CI machine)
            def __init__(self, k, *args):
                self.k = k
            def step(self):
                if self.k == 0:
                    stuck.wait()  # never set: a deadlock
                time.sleep(0.1)  # slow, but moving: 30 operations take longer than the deadline
            def close(self):
                pass
        concurrency._Worker = Worker
        t0 = time.monotonic()
        errors = concurrency.thread_stress(get_backend("cpu"), threads=3, ops=30, deadline_s=2.0)
        took = time.monotonic() - t0
        print(len(errors), "no operation finished in 2.0 s" in errors[-1], "60 of 90 done" in errors[-1], took > 5.0)
        stuck.set()
    """, timeout=120)
    assert out.split() == ["1", "True", "True", "True"], out


def test_the_stress_reports_a_threads_failed_set_up_not_a_deadlock() -> None:
    """Found by review: a worker whose set-up raised left the others at the start barrier,
    and the verdict read "a deadlock". Its error is reported, and nothing waits."""
    out = _child("""
        from polyjit import get_backend
        from polyjit.testing import concurrency
        made = concurrency._Worker.__init__
        def fails_once(self, k, *args):
            if k == 1:
                raise RuntimeError("set-up failed on purpose")
            made(self, k, *args)
        concurrency._Worker.__init__ = fails_once
        errors = concurrency.thread_stress(get_backend("cpu"), threads=3, ops=5, deadline_s=60)
        print(len(errors), "set-up failed on purpose" in errors[0], any("deadlock" in e for e in errors))
    """, timeout=120)
    assert out.split() == ["1", "True", "False"], out


@pytest.mark.parametrize(("name", "env"), CASES)
def test_no_other_threads_copy_lands_in_a_merge_buffer_held_across_its_reader(name: str, env: dict[str, str]) -> None:
    """Each device has one merge buffer: a copy into it and the routine that reads it are two
    enqueues. A thread holding ``device.merge_lock`` across both gets no other thread's copy in
    between (every copy into the merge buffer takes the lock): here the other thread's copy is
    started inside the held section and has not landed when the reader runs (it landed in
    between, and the reader raised MergeBufferMismatchError: found by review with two
    data_parallels on the same devices)."""
    _available(name)
    out = _child(f"""
        import threading, numpy as np
        from polyjit import get_backend, ir
        from polyjit.core.protocol import MergeBuffer
        from polyjit.core.runtime import device_to_device
        be = get_backend({name!r})
        dev = be.get_device(0)
        n = 1 << 12
        x, y = ir.Node("x", (n,)), ir.Node("y", (n,))
        reader = be.compile(ir.Comp.of(ir.apply(ir.Op.ADD, x, ir.merge(x), into=x), embedded=[x]), name="sum")
        src = dev.make_context().init_from_host(x, np.ones(n, np.float32)).init_from_host(y, np.ones(n, np.float32))
        dst = dev.make_context().init_from_host(x, np.zeros(n, np.float32))
        copy_x = device_to_device(x, dst=dst, src=src, into_merge_buffer=MergeBuffer.COPY)
        add = copy_x.context.link(reader)
        copy_y = device_to_device(y, dst=dst, src=src, into_merge_buffer=MergeBuffer.COPY)
        for k in range(5):
            started, landed = threading.Event(), threading.Event()
            def other():
                started.set()
                copy_y.run()
                landed.set()
            with dev.merge_lock:
                copy_x.run()
                t = threading.Thread(target=other)
                t.start()
                started.wait()
                assert not landed.wait(timeout=0.1), "another thread's copy landed in a held merge buffer"
                add.run()
            t.join(timeout=60)
            assert landed.is_set() and dev.merge.node is y
        assert (add.context.read(x) == 5).all(), add.context.read(x)[:4]
        print("ok")
    """, timeout=120, env=env)
    assert out.split() == ["ok"]
