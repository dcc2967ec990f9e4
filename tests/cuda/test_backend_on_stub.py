"""polyjit's CUDA backend on one stub GPU, under both schedules of the stub's deferred
streams (others first, target first), where a staging segment reused too early, a
copy-out before its DMA, or a missing cross-stream wait shows up as wrong data."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import scenarios
import stub
from scenarios import f32

from polyjit.backends import cuda
from polyjit.core import ir
from polyjit.core.errors import FinalizedError
from polyjit.core.ir import AccumOp, Op, StaticSymbol, Symbol
from polyjit.testing.concurrency import close_with_late_work

STUB_ENV: dict[str, str] = {}  # one stub GPU


def test_device_describes_itself(backend: Any) -> None:
    assert backend.num_devices() == 1 and backend.unavailable_reason is None
    dev = backend.get_device(0)
    props = dev.properties
    assert dev.name == "polyjit stub GPU" and dev.device_id == "cuda:0"
    assert props["arch"] == "sm_90" and props["compute_capability"] == (9, 0)
    assert props["sm_count"] == 132 and props["warp_size"] == 32
    assert props["peer_access"] == (False,)
    assert dev.properties["base_alignment"] == cuda.BASE_ALIGNMENT
    assert backend.static_properties()["archs"] == ("sm_90",)


def test_conformance_catalog(backend: Any, stub_driver: stub.Driver) -> None:
    """Every catalog program and the CUDA-specific ones (tiled matmuls, block reductions,
    grid-stride nests), target first (the conformance kit runs others first)."""
    from polyjit.testing.harness import run_programs

    old = stub_driver.set_schedule(stub.TARGET_FIRST)
    try:
        before = stub_driver.count("kernels_run")
        progs = [p for p in scenarios.all_programs() if not p.name.startswith(("elementwise.", "cast."))]
        failures = run_programs(backend, progs)
    finally:
        stub_driver.set_schedule(old)
    assert not failures, "\n".join(str(f) for f in failures[:20])
    assert stub_driver.count("kernels_run") - before > 100


def test_unrolled_grid_stride_nests(backend: Any, stub_driver: stub.Driver) -> None:
    """Elementwise nests of a million cells take several cells a thread per trip; with that
    threshold at one cell, every elementwise program (sizes that divide a trip and sizes
    that do not, broadcasts, multi-dimensional nests) still computes what the reference does."""
    from polyjit.testing.harness import run_programs

    dialect = backend.driver.dialect
    assert dialect.grid_stride_unroll > 1
    dialect.grid_stride_unroll_min_work = 1
    old = stub_driver.set_schedule(stub.TARGET_FIRST)
    try:
        progs = [p for p in scenarios.all_programs() if p.name.startswith(("elementwise.", "cuda.grid.", "large."))]
        failures = run_programs(backend, progs)
    finally:
        stub_driver.set_schedule(old)
        del dialect.grid_stride_unroll_min_work
    assert not failures, "\n".join(str(f) for f in failures[:20])


def test_host_copies_through_the_staging_ring(backend: Any, schedule: str) -> None:
    dev = backend.get_device(0)
    n = 700_001  # 2.8 MB: three chunks and more through a 1 MiB ring
    x, y = f32("x", (n,)), f32("y", (n,))
    host = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    ctx = dev.make_context().init_from_host(x, host)
    r = ctx.link(backend.compile(ir.Comp.of(ir.apply(Op.NEG, x, into=y)), name="neg"))
    r.run()
    np.testing.assert_array_equal(r.context.read(y), -host)
    np.testing.assert_array_equal(r.context.read(x), host)
    h2 = host * 3
    r.context.from_host(x, h2)
    h2[:] = 0  # the runtime's from_host has already copied it into pinned staging
    r.run()
    np.testing.assert_array_equal(r.context.read(y), -host * 3)
    before = dev.used_memory()
    r.context.finalize()
    ctx.finalize()
    assert dev.used_memory() < before


@pytest.mark.parametrize("extra", [-4, 0, 4])
def test_small_host_copies_skip_the_ring(backend: Any, schedule: str, extra: int) -> None:
    """Up to DIRECT_COPY_BYTES a host-to-device copy goes to the driver from the user's own
    array: no ring segment. The driver stages pageable bytes before it returns (so does the
    stub), so this (pageable) array may change or go at once; a page-locked one is read when
    the stream runs, as from_host's contract allows. One byte more takes the ring."""
    from polyjit.backends.cuda.driver import DIRECT_COPY_BYTES

    dev = backend.get_device(0)
    n = (DIRECT_COPY_BYTES + extra) // 4
    x = f32("x", (n,))
    ring = backend.driver._ring(0)
    want = np.arange(n, dtype=np.float32)
    host = want.copy()
    ctx = dev.make_context().init_from_host(x, np.zeros(n, np.float32))
    before = len(ring.segments) + ring.head
    ctx.from_host(x, host)
    took_ring = ring.head + len(ring.segments) != before
    host[:] = -1  # changed before the stream has run the copy
    del host
    np.testing.assert_array_equal(ctx.read(x), want)
    assert took_ring == (extra > 0)
    ctx.finalize()


def test_scalar_constants_and_scalar_nodes_reach_the_device(backend: Any, schedule: str) -> None:
    """0-d host arrays (a scalar constant; a CPU node of shape () copied to CUDA through the
    host) take the small-copy path as one-element buffers: cuda.bindings would read a 0-d
    array as an address."""
    import polyjit as pj

    dev = backend.get_device(0)
    x, c, y = f32("x", (4,)), f32("c", ()), f32("y", (4,))
    code = backend.compile(ir.Comp.of(ir.constant(c, np.float32(3.0)), ir.apply(Op.MUL, x, c, into=y)), name="k")
    r = dev.make_context().init_from_host(x, np.arange(4, dtype=np.float32)).link(code)
    r.run()
    np.testing.assert_array_equal(r.context.read(y), 3 * np.arange(4, dtype=np.float32))
    s = f32("s", ())
    cpu = pj.get_backend("cpu").get_device(0).make_context().init_from_host(s, np.array(7.5, np.float32))
    dst = dev.make_context().init_from_host(s, np.array(0.0, np.float32))
    pj.device_to_device(s, dst=dst, src=cpu)
    assert dst.read(s) == np.float32(7.5)


def test_a_copy_to_the_host_does_not_wait_for_the_stream(backend: Any, stub_driver: stub.Driver,
                                                         schedule: str) -> None:
    """``to_host(blocking=False)`` (and a replay's copy out, a training step's loss) only
    enqueues: the kernel before it has not run when it returns. Into a host memory pool
    (cuda.core's PinnedMemoryResource) the stub's copy waits for the stream, as a real
    driver's did (docs/benchmarks.md, session 19): this fails if the ring were such memory."""
    dev = backend.get_device(0)
    x, y = f32("x", (1024,)), f32("y", (1024,))
    ctx = dev.make_context().init_from_host(x, np.arange(1024, dtype=np.float32))
    r = ctx.link(backend.compile(ir.Comp.of(ir.apply(Op.NEG, x, into=y)), name="neg_out"))
    r.context.stream.synchronize()
    before = stub_driver.count("kernels_run")
    r.run()
    out = np.zeros(1024, np.float32)
    r.context.to_host(y, out, blocking=False)
    assert stub_driver.count("kernels_run") == before and not out.any()
    r.context.stream.synchronize()
    np.testing.assert_array_equal(out, -np.arange(1024, dtype=np.float32))


def test_a_blocking_read_lands_while_another_thread_polls(backend: Any, schedule: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A read returns only once its bytes are in the user's array, although another thread
    polls the same device meanwhile. Two bugs once let it return early (about 1 read in 10
    here): the ring kept only the raw event of a segment, whose handle went back to the free
    list at once, so a recording thread reused the event and it reported another point's
    completion; and a thread copying a segment out lowered ``pending`` before the copy, so the
    reader's poll saw nothing left. The copy-out is slowed to widen both windows."""
    import threading
    import time

    from polyjit.backends.cuda import staging

    drain = staging._drain
    monkeypatch.setattr(staging, "_drain", lambda part, view: (time.sleep(0.001), drain(part, view)))
    dev = backend.get_device(0)
    x = f32("x", (4096,))
    want = np.arange(4096, dtype=np.float32)
    ctx = dev.make_context().init_from_host(x, want)
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            dev.default_stream.record().is_done()

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        bad = sum(not np.array_equal(ctx.read(x), want) for _ in range(100))
    finally:
        stop.set()
        poller.join()
    ctx.finalize()
    assert bad == 0, f"{bad} of 100 reads returned before their bytes landed"


def test_close_waits_for_a_read_enqueued_during_its_wait(backend: Any, schedule: str) -> None:
    """A read another thread enqueued between close()'s wait and the end of the stream was
    marked complete unwaited: its copy-out from the staging ring never ran, and the array
    stayed as it was. The enqueue is injected right after close()'s own wait."""
    dev = backend.get_device(0)
    x = f32("x", (4096,))
    want = np.arange(4096, dtype=np.float32)
    s = dev.new_stream()
    ctx = dev.make_context().init_from_host(x, want).with_stream(s)
    host = np.zeros(4096, np.float32)
    close_with_late_work(s, lambda: ctx.to_host(x, host, blocking=False))
    np.testing.assert_array_equal(host, want)
    ctx.finalize()


def test_statics_and_graph_replay(backend: Any, schedule: str, stub_driver: stub.Driver) -> None:
    rows = StaticSymbol("row", 4)
    i = Symbol("i")
    src, acc, half = f32("src", (4, 300)), f32("acc", (300,)), f32("half", (300,))
    add_row = ir.Accum(acc, AccumOp.ADD, Op.ID, (src,), ir.projections([(i, 300)], [i], [rows, i]),
                       init_neutral=False)
    dev = backend.get_device(0)
    hsrc = np.arange(1200, dtype=np.float32).reshape(4, 300)
    ctx = dev.make_context().init_from_host(src, hsrc).init_from_host(acc, np.zeros(300, np.float32))
    batch = backend.compile_batch([ir.Comp.of(add_row), ir.Comp.of(ir.apply(Op.MUL, acc, 0.5, into=half))],
                                  names=["add_row", "half"])
    routines = ctx.link_batch(batch)
    routines[0].bindings[rows] = 1
    routines[0].run()
    routines[1].run()
    want = hsrc[1].copy()
    np.testing.assert_array_equal(routines[1].context.read(half), want * 0.5)
    launches = stub_driver.count("graph_launches")
    plan = cuda.capture(routines, bindings={rows: 2})
    assert plan.kernel_count == 2 and plan.bindings[rows] == 2
    for row in (2, 3, 3, 0):
        plan.bindings[rows] = row
        plan.replay()
        want += hsrc[row]
    np.testing.assert_array_equal(routines[1].context.read(half), want * 0.5)
    plan.bind(row=1).replay()
    routines[0].bindings[rows] = 3
    routines[0].run()  # ordered after the replay on the same stream
    want += hsrc[1] + hsrc[3]
    np.testing.assert_array_equal(routines[1].context.read(acc), want)
    # a replay on another stream waits (device side) for the writers on the first
    other = dev.new_stream()
    plan2 = cuda.capture(routines, stream=other)
    plan2.bindings[rows] = 0
    routines[0].run()
    plan2.replay()
    want += hsrc[3] + hsrc[0]
    np.testing.assert_array_equal(routines[1].context.read(half), want * 0.5)
    assert stub_driver.count("graph_launches") - launches == 6
    plan.close()
    plan2.close()
    routines[0].context.finalize()
    ctx.finalize()


def test_graph_captured_before_its_statics_are_bound(backend: Any, schedule: str) -> None:
    """Statics may be bound after capture (the first replay sets them); a replay with a bad
    binding raises and changes no kernel node, so the next good one runs what it says."""
    from polyjit.core.errors import BindingError

    rows, b = StaticSymbol("row", 4), StaticSymbol("b", 4)
    i = Symbol("i")
    src, acc, out = f32("src", (4, 300)), f32("acc", (300,)), f32("out", (300,))
    add_row = ir.Accum(acc, AccumOp.ADD, Op.ID, (src,), ir.projections([(i, 300)], [i], [rows, i]),
                       init_neutral=False)
    pick = ir.Accum(out, None, Op.ID, (src,), ir.projections([(i, 300)], [i], [b, i]))
    dev = backend.get_device(0)
    hsrc = np.arange(1200, dtype=np.float32).reshape(4, 300)
    ctx = dev.make_context().init_from_host(src, hsrc).init_from_host(acc, np.zeros(300, np.float32))
    routines = ctx.link_batch(backend.compile_batch([ir.Comp.of(add_row), ir.Comp.of(pick)],
                                                    names=["add_row", "pick"]))
    plan = cuda.capture(routines)
    with pytest.raises(BindingError, match="row"):
        plan.replay()
    plan.bindings[rows] = 1
    with pytest.raises(BindingError, match="b"):
        plan.replay()
    plan.bind(b=2).replay()
    want = hsrc[1].copy()
    np.testing.assert_array_equal(routines[1].context.read(acc), want)
    np.testing.assert_array_equal(routines[1].context.read(out), hsrc[2])
    plan.bindings[rows], plan.bindings[b] = 3, 7  # b out of its range: nothing runs or changes
    with pytest.raises(BindingError):
        plan.replay()
    plan.bindings[b] = 0
    plan.replay()
    want += hsrc[3]
    np.testing.assert_array_equal(routines[1].context.read(acc), want)
    np.testing.assert_array_equal(routines[1].context.read(out), hsrc[0])
    plan.close()
    routines[0].context.finalize()
    ctx.finalize()


def test_a_graph_update_that_fails_midway_is_redone_whole(backend: Any, schedule: str) -> None:
    """A replay whose kernel-node updates fail after the first of a routine's two nodes leaves
    that routine marked unknown: going back to the earlier bindings updates both nodes again
    (else the first kept the failed replay's static)."""
    rows = StaticSymbol("row", 4)
    i = Symbol("i")
    src, acc = f32("src", (4, 300)), f32("acc", (300,))
    src2, acc2 = f32("src2", (4, 4096)), f32("acc2", ())
    comp = ir.Comp.of(  # an elementwise kernel and a block reduction: two kernels, two graph nodes
        ir.Accum(acc, AccumOp.ADD, Op.ID, (src,), ir.projections([(i, 300)], [i], [rows, i]), init_neutral=False),
        ir.Accum(acc2, AccumOp.MAX, Op.ID, (src2,), ir.projections([(i, 4096)], [], [rows, i])))
    dev = backend.get_device(0)
    hsrc = np.arange(1200, dtype=np.float32).reshape(4, 300)
    hsrc2 = np.arange(4 * 4096, dtype=np.float32).reshape(4, 4096)
    ctx = (dev.make_context().init_from_host(src, hsrc).init_from_host(acc, np.zeros(300, np.float32))
           .init_from_host(src2, hsrc2))
    r = ctx.link(backend.compile(comp, name="two"))
    plan = cuda.capture([r], bindings={rows: 1})
    assert plan.kernel_count == 2
    plan.replay()
    graph = plan._graph
    calls = []

    class Failing:  # the second node update of the next replay fails
        def __getitem__(self, node: Any) -> Any:
            calls.append(node)
            if len(calls) == 2:
                raise RuntimeError("injected: node update failed")
            return graph[node]

    plan._graph = Failing()
    plan.bindings[rows] = 2
    with pytest.raises(RuntimeError, match="injected"):
        plan.replay()
    plan._graph = graph
    plan.bindings[rows] = 1  # back to what the graph last ran with
    plan.replay()
    np.testing.assert_array_equal(r.context.read(acc), hsrc[1] * 2)
    assert r.context.read(acc2) == hsrc2[1].max()
    plan.close()
    r.context.finalize()
    ctx.finalize()


def test_a_graph_closed_while_a_replay_checks_is_not_launched(backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: replay() checked `closed` before the device lock, and close() took no
    lock, so a close on another thread between the two launched a destroyed graph (a
    DriverError from cuda.core, "Graph has been closed", not FinalizedError)."""
    x, y = f32("x", (1000,)), f32("y", (1000,))
    ctx = backend.get_device(0).make_context().init_from_host(x, np.ones(1000, np.float32))
    r = ctx.link(backend.compile(ir.Comp.of(ir.apply(Op.MUL, x, 2.0, into=y)), name="doubled"))
    graph = backend.capture([r])
    graph.replay()
    check_alive, calls = type(r.context).check_alive, [0]

    def close_meanwhile(self: Any) -> None:
        calls[0] += 1
        if calls[0] == 1:  # replay() has passed its first check: another thread closes the graph
            closer = threading.Thread(target=graph.close)
            closer.start()
            closer.join()
        check_alive(self)

    monkeypatch.setattr(type(r.context), "check_alive", close_meanwhile)
    with pytest.raises(FinalizedError, match="closed"):
        graph.replay()
    monkeypatch.undo()
    np.testing.assert_array_equal(r.context.read(y), np.full(1000, 2, np.float32))
    r.run()  # the routine stays usable
    r.context.finalize()
    ctx.finalize()


def test_tensor_plans_replay_a_cuda_graph(backend: Any, schedule: str, stub_driver: stub.Driver) -> None:
    before = stub_driver.count("graph_launches")
    replays = scenarios.check_tensor_plans_replay_a_graph(backend)
    assert stub_driver.count("graph_launches") - before == replays


def test_char_lm_trains_like_on_the_cpu(backend: Any, schedule: str) -> None:
    """examples/char_lm.py's model (gathers, reshape, tanh, AdamW) in compiled mode: the same
    losses on the stub GPU (generated CUDA, graph replays) as on the CPU backend."""
    from polyjit import tensor as pt
    from polyjit.demo.datasets import context_windows, encode_text

    char_lm = scenarios.char_lm()
    contexts, targets = context_windows(encode_text(char_lm.TEXT.read_text()), char_lm.CONTEXT)
    rng = np.random.default_rng(3)
    picks = [rng.integers(0, len(contexts), 32) for _ in range(4)]

    def losses(device: Any) -> list[float]:
        model = char_lm.CharModel()
        ctx, nxt = pt.input("context", (32, char_lm.CONTEXT), "int32"), pt.input("next", (32,), "int32")
        plan = pt.compile(loss=pt.cross_entropy(model(ctx), nxt), optimizer=pt.AdamW(lr=0.01), device=device)
        out = [plan.step(context=contexts[idx], next=targets[idx]) for idx in picks]
        plan.close()
        return out

    np.testing.assert_allclose(losses(backend.get_device(0)), losses("cpu"), rtol=2e-5)


def test_benchmark_code_runs(backend: Any, capsys: pytest.CaptureFixture[str]) -> None:
    bench = scenarios.bench_module()
    results = []
    results += bench.bench_bandwidth(backend, None, 4096)
    results += bench.bench_launch(backend, None, 3)
    results += bench.bench_graph(backend, 4, 8)
    results += bench.bench_matmul(backend, None, 128)
    results += bench.bench_copy(backend, 1 << 16)
    assert all(r["value"] > 0 for r in results)
    printed = capsys.readouterr().out
    assert "max abs error" in printed
    err = float(printed.split("max abs error on 64 rows: ")[1].split()[0])
    assert err < 1e-3, printed


def test_empty_kernels_are_not_launched(backend: Any) -> None:
    """Found by review: a batched matmul of batch 0 got a grid of 1 (a 0 dimension was clamped)
    and its tiles, "aligned" (0 is a multiple of every tile), wrote 64 KiB past its empty
    buffer into another context's memory. A kernel with nothing to compute is not launched."""
    a, b, c = ir.Node("a", (0, 128, 64)), ir.Node("b", (0, 64, 128)), ir.Node("c", (0, 128, 128))
    x, y = f32("x", (1 << 14,)), f32("y", (1 << 14,))
    code = backend.compile(ir.Comp.of(ir.apply(Op.ADD, x, x, into=y), ir.einsum("bik,bkj->bij", a, b, into=c)),
                           name="bmm0")
    dev = backend.get_device(0)
    ctx = dev.make_context().init_from_host(x, np.ones(1 << 14, np.float32))
    ctx = ctx.init_from_host(a, np.zeros((0, 128, 64), np.float32)).init_from_host(b, np.zeros((0, 64, 128), np.float32))
    routine = ctx.link(code)
    z = f32("z", (1 << 14,))
    beside = dev.make_context().init_from_host(z, np.full(1 << 14, 7, np.float32))
    routine.run()
    np.testing.assert_array_equal(beside.read(z), np.full(1 << 14, 7, np.float32))
    np.testing.assert_array_equal(routine.context.read(y), np.full(1 << 14, 2, np.float32))
    assert routine.context.read(c).shape == (0, 128, 128)


def test_a_backend_dropped_in_a_garbage_cycle_frees_its_pools_after_its_kernels(backend: Any) -> None:
    """Found by review: a backend dropped with kernels queued, in a garbage cycle, had its pools
    freed at once (on the memory resource's stream, which no kernel's stream orders): the stub's
    queued kernels then read freed memory (CUDA_ERROR_ILLEGAL_ADDRESS). The pools now go once
    the backend's streams have closed, after their work (CudaDriver.free_when_idle)."""
    import gc

    from polyjit.backends.cuda import CudaBackend
    from polyjit.backends.cuda.driver import CudaDriver

    n = 1 << 16
    driver = CudaDriver()

    def in_flight() -> None:
        be = CudaBackend(driver)
        dev = be.get_device(0)
        a = f32("a", (n,))
        steps, t = [], a
        for k in range(6):
            nxt = f32(f"t{k}", (n,))
            steps.append(ir.apply(Op.EXP if k % 2 == 0 else Op.LOG, t, into=nxt))
            t = nxt
        routine = dev.make_context().init_from_host(a, np.ones(n, np.float32)).link(
            be.compile(ir.Comp.of(*steps), name="slow"))
        for _ in range(4):
            routine.run()
        dev.cycle = (be, routine)  # type: ignore[attr-defined]

    in_flight()
    gc.collect()  # the backend, its device, streams, contexts and routine: one garbage cycle
    assert driver.allocated_bytes(0) == 0  # raised CUDAError (illegal address) before


def test_work_queued_at_exit_lands_before_the_pools_go(backend: Any) -> None:
    """Found by review: the CUDA devices were not closed at exit, so the interpreter's teardown
    freed the pools' Buffers (on another stream) while a copy was still queued, which the stub
    then ran into freed memory. The devices now close at exit, after their queued work."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    script = (f"import sys; sys.path.insert(0, {str(here)!r})\n"
              "import stub; stub.install_nvrtc_hook()\n"
              "import numpy as np, polyjit\n"
              "from polyjit.core import ir\n"
              "cuda = polyjit.get_backend('cuda')\n"
              "for n in (1, 1 << 20):\n"
              "    x = ir.Node(f'x{n}', (n,))\n"
              "    cuda.get_device(0).make_context().init_from_host(x, np.zeros(n, np.float32))\n"
              "print('exiting with the copies queued')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "exiting with the copies queued" in done.stdout
    assert "fault" not in done.stderr, done.stderr[-2000:]
