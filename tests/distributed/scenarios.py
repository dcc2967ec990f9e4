"""Scenarios that run under ``mpiexec -n N python tests/distributed/scenarios.py NAME...``.

Each scenario is run by every rank in the order given and prints ``PASS <name> rank <r>``
when it holds on that rank; tests/distributed/test_distributed.py starts the jobs and reads
these lines. A scenario that fails raises: the excepthook of polyjit.distributed prints the
tagged traceback and aborts the job.

Names: collectives, ordering, mismatch, data_parallel[:D] (D cpu devices per rank),
timeout, abort, staged (the OpenCL backend: host copies instead of zero-copy views),
cuda_staged, cuda_aware, nccl (GPU only).
"""

from __future__ import annotations

import functools
import gc
import math
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from polyjit import ir
from polyjit.backends import get_backend
from polyjit.backends.cpu import create_backend
from polyjit.core.errors import (
    CollectiveMismatchError,
    CollectiveRefusedError,
    CollectiveTimeoutError,
    DTypeMismatchError,
    FinalizedError,
    InvalidArgumentError,
    NodeNotInContextError,
    ShapeMismatchError,
)
from polyjit.core.ir import Node, Op
from polyjit.distributed import MPI, Comm

WORLD = MPI.COMM_WORLD
me, ranks = WORLD.Get_rank(), WORLD.Get_size()
DTYPES = ("float32", "float64", "int32", "int64", "uint8", "bool")
TIMEOUT = float(os.environ.get("SCENARIO_TIMEOUT", "120"))  # a hang ends in an abort

_cpu2: Any = None


def cpu2() -> Any:
    """A cpu backend of two devices (made once per process)."""
    global _cpu2
    if _cpu2 is None:
        _cpu2 = create_backend(num_devices=2)
    return _cpu2


def report(line: str) -> None:
    """A result line: printed, and appended to ``$SCENARIO_OUT/rank<R>.log`` (ranks' stdout
    is merged by mpiexec in chunks, not lines, so the tests read the files)."""
    print(line, flush=True)
    out = os.environ.get("SCENARIO_OUT")
    if out:
        with open(Path(out) / f"rank{me}.log", "a") as f:
            f.write(line + "\n")


def say(name: str) -> None:
    report(f"PASS {name} rank {me}")


def data(rank: int, dtype: str, shape: tuple[int, ...], salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s values (every rank can make every rank's)."""
    rng = np.random.default_rng(1000 * rank + 17 * DTYPES.index(dtype) + salt)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype == "uint8":
        return rng.integers(0, 60, shape).astype(np.uint8)
    if dtype.startswith("int"):
        return rng.integers(-1000, 1000, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def reduce_np(arrays: list[np.ndarray], op: str) -> np.ndarray:
    stack = np.stack(arrays)
    if op == "sum":
        return np.sum(stack, axis=0, dtype=stack.dtype) if stack.dtype != bool else np.any(stack, axis=0)
    if op == "max":
        return np.max(stack, axis=0)
    if op == "min":
        return np.min(stack, axis=0)
    return np.mean(stack, axis=0, dtype=stack.dtype)


def check(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    if got.dtype.kind == "f":
        tol = 1e-6 if got.dtype == np.float32 else 1e-12
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


def ops_for(dtype: str) -> list[str]:
    return ["sum", "max", "min", "mean"] if dtype.startswith("float") else ["sum", "max", "min"]


# ---------------------------------------------------------------------------------------------


def collectives(backend: Any = None, name: str = "collectives") -> None:
    comm = Comm(timeout=TIMEOUT)
    be = backend or cpu2()
    dev = be.get_device(me % be.num_devices())
    base = dev.make_context()
    for dtype in DTYPES:
        for shape in ((), (5, 3), (ranks * 4, 3)):
            for op in ops_for(dtype):
                node = Node(f"ar_{dtype}_{op}", shape, dtype)
                ctx = base.init_from_host(node, data(me, dtype, shape))
                comm.all_reduce(ctx, node, op)
                want = reduce_np([data(r, dtype, shape) for r in range(ranks)], op)
                check(ctx.read(node), want, f"all_reduce {op} {dtype} {shape}")
                if len(shape) == 2 and shape[0] % ranks == 0:  # reduce_scatter of the same values
                    big = Node(f"rs_in_{dtype}_{op}", shape, dtype)
                    out = Node(f"rs_out_{dtype}_{op}", (shape[0] // ranks, shape[1]), dtype)
                    rctx = base.init_from_host(big, data(me, dtype, shape)).init_from_host(
                        out, np.zeros(out.shape, dtype))
                    comm.reduce_scatter(rctx, big, out, op)
                    rows = shape[0] // ranks
                    check(rctx.read(out), want[me * rows : (me + 1) * rows], f"reduce_scatter {op} {dtype}")
        for root in range(ranks):
            node = Node(f"bc_{dtype}", (7,), dtype)
            ctx = base.init_from_host(node, data(me, dtype, (7,), salt=root))
            comm.broadcast(ctx, node, root=root)
            check(ctx.read(node), data(root, dtype, (7,), salt=root), f"broadcast {dtype} root {root}")
        node = Node(f"ag_{dtype}", (2, 3), dtype)
        joined = Node(f"ag_out_{dtype}", (ranks * 2, 3), dtype)
        stacked = Node(f"ag_stack_{dtype}", (ranks, 2, 3), dtype)
        ctx = (base.init_from_host(node, data(me, dtype, (2, 3), salt=5))
               .init_from_host(joined, np.zeros(joined.shape, dtype))
               .init_from_host(stacked, np.zeros(stacked.shape, dtype)))
        comm.all_gather(ctx, node, joined)
        comm.all_gather(ctx, node, stacked)
        every = [data(r, dtype, (2, 3), salt=5) for r in range(ranks)]
        check(ctx.read(joined), np.concatenate(every), f"all_gather {dtype}")
        check(ctx.read(stacked), np.stack(every), f"all_gather stacked {dtype}")
    # send / recv around a ring; rank 0 sends first, the others receive first (sends are synchronous)
    if ranks > 1:
        for dtype in ("float32", "int64", "bool"):
            src, dst = Node(f"ring_src_{dtype}", (3, 4), dtype), Node(f"ring_dst_{dtype}", (3, 4), dtype)
            ctx = base.init_from_host(src, data(me, dtype, (3, 4), salt=9)).init_from_host(
                dst, np.zeros((3, 4), dtype))
            right, left = (me + 1) % ranks, (me - 1) % ranks
            if me == 0:
                comm.send(ctx, src, right, tag=3)
                comm.recv(ctx, dst, left, tag=3)
            else:
                comm.recv(ctx, dst, left, tag=3)
                comm.send(ctx, src, right, tag=3)
            check(ctx.read(dst), data(left, dtype, (3, 4), salt=9), f"recv {dtype}")
    # a large node, and host arrays
    big = Node("ar_big", (1 << 20,), "float32")
    ctx = base.init_from_host(big, np.full(1 << 20, me + 1, np.float32))
    comm.all_reduce(ctx, big, "sum")
    check(ctx.read(big), np.full(1 << 20, ranks * (ranks + 1) / 2, np.float32), "all_reduce 1M")
    got = comm.all_reduce_array(np.arange(4.0) * (me + 1), "max")
    check(got, np.arange(4.0) * ranks, "all_reduce_array")
    # found by review: a 0-d array came back with shape (1,)
    check(comm.all_reduce_array(np.array(me + 1.0), "sum"), np.array(ranks * (ranks + 1) / 2), "all_reduce_array 0-d")
    check(comm.all_reduce_array(np.float64(me), "max"), np.array(float(ranks - 1)), "all_reduce_array scalar")
    check(comm.broadcast_array(np.array(me, np.int32), root=ranks - 1), np.array(ranks - 1, np.int32),
          "broadcast_array 0-d")
    comm.check_same("the same numbers", [3, 4])
    comm.barrier()
    say(name)


def bfloat16() -> None:
    """Found by review: bfloat16 nodes and arrays could not go through the distributed layer
    at all (SystemError from the host view, BufferError from mpi4py: MPI has no bfloat16).
    Now MPI moves their 16-bit patterns, and reduces them as float32: max and min exact, a sum
    (and a mean) rounded once to bfloat16; data parallel with bfloat16 parameters trains."""
    import ml_dtypes

    from polyjit import tensor as pt
    from polyjit.distributed import comm as comm_module

    bf16 = ml_dtypes.bfloat16
    comm = Comm(timeout=TIMEOUT)

    def vals(rank: int, shape: tuple[int, ...], salt: int = 0) -> np.ndarray:
        rng = np.random.default_rng(100 * rank + salt)
        return (rng.standard_normal(shape) * 50).astype(bf16)  # sums that round

    def want(op: str, shape: tuple[int, ...]) -> np.ndarray:
        stack = np.stack([vals(r, shape).astype(np.float32) for r in range(ranks)])
        wide = {"sum": stack.sum(0), "max": stack.max(0), "min": stack.min(0), "mean": stack.sum(0) / ranks}[op]
        return wide.astype(bf16)

    def same(got: np.ndarray, expect: np.ndarray, what: str) -> None:
        assert got.dtype == bf16 and got.shape == expect.shape, (what, got.dtype, got.shape)
        np.testing.assert_array_equal(got.view(np.uint16), expect.view(np.uint16), err_msg=what)

    real = comm_module.on_cuda
    for path in ("cpu", "export"):  # "export": a CUDA-aware MPI's path, which bfloat16 does not take
        if path == "export":
            comm_module.on_cuda = lambda ctx: True
            comm.cuda_aware = True
        try:
            base = cpu2().get_device(0).make_context()
            shape = (ranks * 2, 3)
            for op in ("sum", "max", "min", "mean"):
                node = Node(f"bf_{path}_{op}", shape, "bfloat16")
                out = Node(f"bf_rs_{path}_{op}", (2, 3), "bfloat16")
                ctx = base.init_from_host(node, vals(me, shape)).init_from_host(out, np.zeros((2, 3), bf16))
                comm.reduce_scatter(ctx, node, out, op)
                comm.all_reduce(ctx, node, op)
                same(ctx.read(node), want(op, shape), f"{path} all_reduce {op}")
                same(ctx.read(out), want(op, shape)[me * 2 : (me + 1) * 2], f"{path} reduce_scatter {op}")
            node, joined = Node(f"bf_{path}_ag", (2,), "bfloat16"), Node(f"bf_{path}_ag_out", (ranks * 2,), "bfloat16")
            ctx = base.init_from_host(node, vals(me, (2,), 1)).init_from_host(joined, np.zeros(ranks * 2, bf16))
            comm.all_gather(ctx, node, joined)
            same(ctx.read(joined), np.concatenate([vals(r, (2,), 1) for r in range(ranks)]), f"{path} all_gather")
            comm.broadcast(ctx, node, root=ranks - 1)
            same(ctx.read(node), vals(ranks - 1, (2,), 1), f"{path} broadcast")
            if me in (0, 1):
                ctx = ctx.init_from_host(node, vals(me, (2,), 2))
                if me == 0:
                    comm.send(ctx, node, 1)
                else:
                    comm.recv(ctx, node, 0)
                same(ctx.read(node), vals(0, (2,), 2), f"{path} send / recv")
        finally:
            comm_module.on_cuda = real
            comm.cuda_aware = False
    for op in ("sum", "max", "min", "mean"):
        same(comm.all_reduce_array(vals(me, (2, 3)), op), want(op, (2, 3)), f"all_reduce_array {op}")
    same(comm.broadcast_array(vals(me, (4,)), root=ranks - 1), vals(ranks - 1, (4,)), "broadcast_array")
    # data parallel with bfloat16 parameters, across the ranks
    mlp = pt.MLP("mlp", [2, 8, 2], seed=0, dtype="bfloat16")
    dp = pt.data_parallel(lambda x, y: pt.cross_entropy(mlp(x), y),
                          {"x": ((12, 2), "bfloat16"), "y": ((12,), "int32")},
                          optimizer=pt.SGD(0.1), devices=cpu2().devices(), comm=comm)
    rng = np.random.default_rng(0)
    losses = [dp.step(x=rng.standard_normal((12, 2)).astype(bf16), y=rng.integers(0, 2, 12).astype(np.int32))
              for _ in range(3)]
    assert all(np.isfinite(losses)), losses
    assert dp.rank_spread() == 0.0 and dp.replica_spread() == 0.0
    dp.close()
    say("bfloat16")


def staged() -> None:
    """The collectives on a backend whose memory is not the host's: host_view stages copies."""
    be = get_backend("opencl")
    if be.num_devices() == 0:
        report(f"SKIP staged rank {me}: no OpenCL device: {getattr(be, 'unavailable_reason', '')}")
        return
    collectives(be, name="staged")


# ---------------------------------------------------------------------------------------------


def _slow(src: Node, dst: Node, rounds: int = 6) -> ir.Comp:
    """dst = a long elementwise chain of src (fused into one kernel): tens of milliseconds."""
    steps: list[Any] = []
    cur = src
    for k in range(rounds):
        nxt = dst if k == rounds - 1 else Node(f"{dst.name}_t{k}", src.shape, src.dtype)
        steps.append(ir.apply(Op.TANH, cur, into=nxt))
        cur = nxt
    return ir.Comp.of(*steps, embedded=[dst])


def ordering() -> None:
    """Routines before and after a collective, on the same and on other streams and devices,
    with no user waits: the per-node events order everything."""
    comm = Comm(timeout=TIMEOUT)
    be = cpu2()
    d0, d1 = be.get_device(0), be.get_device(1)
    n = 1 << 22
    a, x, y, z = (Node(k, (n,), "float32") for k in ("ord_a", "ord_x", "ord_y", "ord_z"))
    a_val = np.linspace(-2, 2, n, dtype=np.float32) * (me + 1)
    produce = be.compile(_slow(a, x), name="ord_produce")
    consume = be.compile(ir.Comp.of(ir.apply(Op.ADD, x, 1.0, into=y), embedded=[y]), name="ord_consume")
    snapshot = be.compile(_slow(x, z, rounds=2), name="ord_snapshot")
    ref_x = [np.tanh(np.tanh(np.tanh(np.tanh(np.tanh(np.tanh(
        np.linspace(-2, 2, n, dtype=np.float32) * (r + 1))))))) for r in range(ranks)]
    for trial in range(3):
        ctx = d0.make_context().init_from_host(a, a_val).init_from_host(x, np.zeros(n, np.float32))
        p = ctx.link(produce)
        c = p.context.link(consume)
        p.run()  # writes x: the all_reduce must wait for it
        comm.all_reduce(p.context, x, "sum")
        c.run()  # reads x: it must see the sum
        want_x = np.sum(ref_x, axis=0, dtype=np.float32)
        np.testing.assert_allclose(c.context.read(y), want_x + 1, rtol=1e-5, atol=1e-5, err_msg=f"trial {trial}")
        # a reader on another stream, then a collective that writes what it reads
        other = p.context.with_stream(d0.new_stream())
        p.run()
        snap = other.link(snapshot)
        snap.run()  # reads x (slowly) on the other stream
        comm.broadcast(p.context, x, root=0)  # writes x on ranks > 0: after the reader is done
        np.testing.assert_allclose(snap.context.read(z), np.tanh(np.tanh(ref_x[me])), rtol=1e-5, atol=1e-6,
                                   err_msg="the reader saw the broadcast's values")
        np.testing.assert_allclose(p.context.read(x), ref_x[0], rtol=1e-5, atol=1e-6)
        # the result moves on to another device with no waits either
        from polyjit.core.runtime import device_to_device
        ctx1 = d1.make_context().init_from_host(x, np.zeros(n, np.float32))
        p.run()
        comm.all_reduce(p.context, x, "max")
        move = device_to_device(x, dst=ctx1, src=p.context)
        assert move is not None
        move.run()
        np.testing.assert_allclose(ctx1.read(x), np.max(ref_x, axis=0), rtol=1e-6)
    say("ordering")


# ---------------------------------------------------------------------------------------------


def _expect(exc: type[BaseException], fn: Callable[[], None], *words: str) -> str:
    try:
        fn()
    except exc as e:
        text = str(e)
        for w in words:
            assert w in text, (w, text)
        return text
    raise AssertionError(f"{exc.__name__} not raised")


def mismatch() -> None:
    """Different shapes, dtypes, ops, roots or collectives: a typed error on every rank, no
    data moved, and the Comm still works."""
    comm = Comm(timeout=TIMEOUT)
    base = cpu2().get_device(0).make_context()
    last = ranks - 1
    rows = 4 if me != last else 5  # the last rank's shape differs
    node = Node("mm_shape", (rows, 3), "float32")
    ctx = base.init_from_host(node, np.full((rows, 3), me, np.float32))
    text = _expect(CollectiveMismatchError, lambda: comm.all_reduce(ctx, node, "sum"), "(4, 3)", "(5, 3)",
                   f"rank {last}")
    np.testing.assert_array_equal(ctx.read(node), np.full((rows, 3), me, np.float32))  # untouched
    dt = "float32" if me != last else "float64"
    node = Node("mm_dtype", (4,), dt)
    ctx = base.init_from_host(node, np.zeros(4, dt))
    _expect(CollectiveMismatchError, lambda: comm.all_reduce(ctx, node), "float32", "float64")
    node = Node("mm_op", (4,), "float32")
    ctx = base.init_from_host(node, np.zeros(4, np.float32))
    _expect(CollectiveMismatchError, lambda: comm.all_reduce(ctx, node, "max" if me == last else "sum"),
            "all_reduce(max)", "all_reduce(sum)")
    _expect(CollectiveMismatchError, lambda: comm.broadcast(ctx, node, root=0 if me != last else 1), "root")
    if me == last:
        _expect(CollectiveMismatchError, lambda: comm.broadcast(ctx, node), "broadcast", "all_reduce")
    else:
        _expect(CollectiveMismatchError, lambda: comm.all_reduce(ctx, node), "broadcast", "all_reduce")
    # one rank's own argument error: it raises its own, the others a mismatch naming it
    out = Node("mm_out", (ranks * 4 + (1 if me == last else 0),), "float32")
    octx = ctx.init_from_host(out, np.zeros(out.shape, np.float32))
    if me == last:
        _expect(ShapeMismatchError, lambda: comm.all_gather(octx, node, out), "out_node")
    else:
        _expect(CollectiveMismatchError, lambda: comm.all_gather(octx, node, out), f"rank {last} refused")
    ints = Node("mm_int", (4,), "int32")
    ictx = base.init_from_host(ints, np.zeros(4, np.int32))
    _expect(DTypeMismatchError, lambda: comm.all_reduce(ictx, ints, "mean"), "floating")
    # send / recv with different shapes: both sides raise
    if ranks > 1 and me in (0, 1):
        shape = (3,) if me == 0 else (4,)
        pn = Node("mm_p2p", shape, "float32")
        pctx = base.init_from_host(pn, np.zeros(shape, np.float32))
        if me == 0:
            _expect(CollectiveMismatchError, lambda: comm.send(pctx, pn, 1), "(3,)", "(4,)")
        else:
            _expect(CollectiveMismatchError, lambda: comm.recv(pctx, pn, 0), "(3,)", "(4,)")
    # Found by review: these of one rank's own errors were raised before the join, leaving the
    # others waiting until their timeout (then broken), or pairing their call with its next one
    good = Node("mm_good", (4,), "float32")
    gctx = base.init_from_host(good, np.ones(4, np.float32))
    stranger = Node("mm_stranger", (4,), "float32")  # in no context
    reduce_good = lambda: comm.all_reduce(gctx, good)  # noqa: E731  what the other ranks call
    own_errors: list[tuple[type[Exception], Callable[[], Any], Callable[[], Any], str]] = [
        (NodeNotInContextError, lambda: comm.all_reduce(gctx, stranger), reduce_good, "mm_stranger"),
        (InvalidArgumentError, lambda: comm.all_reduce(gctx, good, timeout=-1), reduce_good, "timeout"),
        (InvalidArgumentError, lambda: comm.broadcast(gctx, "mm_good"),  # type: ignore[arg-type]
         lambda: comm.broadcast(gctx, good), "needs a Node"),
        (DTypeMismatchError, lambda: comm.all_reduce_array(np.zeros(3, np.complex64)),
         lambda: comm.all_reduce_array(np.zeros(3, np.float32)), "complex"),
        (InvalidArgumentError, lambda: comm.check_same("setup", ["a"]), lambda: comm.check_same("setup", [1]),
         "integers"),
        # found by review: a raw OverflowError on that rank, and the Comm out of step
        (InvalidArgumentError, lambda: comm.check_same("setup", [1, 2**64]), lambda: comm.check_same("setup", [1, 2]),
         "int64"),
        (InvalidArgumentError, lambda: comm.barrier(timeout="soon"), comm.barrier, "timeout"),  # type: ignore[arg-type]
    ]
    for error, own, others, says in own_errors:
        t0 = time.monotonic()
        if me == last:
            _expect(error, own, says)
        else:
            _expect(CollectiveMismatchError, others, f"rank {last} refused")
        assert time.monotonic() - t0 < TIMEOUT / 2, f"{says}: the ranks waited for each other"
    np.testing.assert_array_equal(gctx.read(good), np.ones(4, np.float32))  # untouched
    if ranks > 1 and me in (0, 1):  # a pair where one side's node is wrong: both raise at once
        pn = Node("mm_pair", (3,), "float32")
        pctx = base.init_from_host(pn, np.zeros(3, np.float32))
        if me == 0:
            _expect(NodeNotInContextError, lambda: comm.send(pctx, stranger, 1), "mm_stranger")
        else:
            _expect(CollectiveMismatchError, lambda: comm.recv(pctx, pn, 0), "rank 0 refused")
    # still usable: nothing moved, nothing broke
    node = Node("mm_after", (4,), "float32")
    ctx = base.init_from_host(node, np.ones(4, np.float32))
    comm.all_reduce(ctx, node)
    np.testing.assert_array_equal(ctx.read(node), np.full(4, ranks, np.float32))
    freed = Comm(timeout=TIMEOUT)  # a freed Comm (every rank frees it): a typed error, not mpi4py's
    freed.free()
    _expect(FinalizedError, freed.barrier, "freed")
    report(f"MISMATCH rank {me}: {text}")
    say("mismatch")


def _refused(fn: Callable[[], None], rank: int, *words: str) -> None:
    """``fn`` raises CollectiveRefusedError naming ``rank`` (and ``words``) on this rank."""
    try:
        fn()
    except CollectiveRefusedError as e:
        assert e.ranks == (rank,), (e.ranks, str(e))
        for w in (f"rank {rank} refused", *words):
            assert w in str(e), (w, str(e))
        return
    raise AssertionError("CollectiveRefusedError not raised")


def local_failure() -> None:
    """Found by review: a call that failed on one rank while it prepared the call (here a device
    fault in the node's writer, which the call's wait reports) skipped the join there, and the
    Comm was out of step for good. The rank now joins with its refusal flag: it raises its own
    error, every other rank CollectiveRefusedError naming it and the call, and the next call
    works on every rank."""
    from polyjit.backends.cpu import CpuDriver
    from polyjit.core.errors import DeviceFaultError
    from polyjit.core.runtime import Backend
    from polyjit.testing.faults import FaultyDriver

    comm = Comm(timeout=TIMEOUT)
    last = ranks - 1
    driver = FaultyDriver(CpuDriver(1), rate=1.0, kinds=("event_sync",))
    driver.armed = False
    be = Backend(driver)
    a, x, many = Node("lf_a", (4,), "float32"), Node("lf_x", (4,), "float32"), Node("lf_many", (ranks * 4,), "float32")
    writer = be.get_device(0).make_context().init_from_host(a, np.zeros(4, np.float32)).init_from_host(
        x, np.zeros(4, np.float32)).init_from_host(many, np.zeros(ranks * 4, np.float32)).link(
        be.compile(ir.Comp.of(ir.apply(Op.EXP, a, into=x)), name="lf_write"))
    ctx = writer.context
    good = Node("lf_good", (3,), "float32")
    gctx = cpu2().get_device(0).make_context().init_from_host(good, np.ones(3, np.float32))
    calls: list[tuple[str, Callable[[], None]]] = [
        ("all_reduce", lambda: comm.all_reduce(ctx, x)),
        ("broadcast", lambda: comm.broadcast(ctx, x, root=0)),  # the last rank (not 0) writes x
        ("all_gather", lambda: comm.all_gather(ctx, x, many)),
        ("reduce_scatter", lambda: comm.reduce_scatter(ctx, many, x)),
    ]
    for name, call in calls:
        driver.armed = me == last
        writer.run()  # its event reports the fault to the call's wait, on the last rank only
        if me == last:
            _expect(DeviceFaultError, call, "injected")
        else:
            _refused(call, last, name, "(call #")
        driver.armed = False
        comm.all_reduce(gctx, good)  # the Comm carries on
        np.testing.assert_array_equal(gctx.read(good), np.full(3, ranks, np.float32))
        gctx = gctx.init_from_host(good, np.ones(3, np.float32))
    if me in (0, 1):  # send / recv: the sender's wait fails
        driver.armed = me == 0
        writer.run()
        if me == 0:
            _expect(DeviceFaultError, lambda: comm.send(ctx, x, 1), "injected")
        else:
            _refused(lambda: comm.recv(ctx, x, 0), 0, "recv")
        driver.armed = False
        writer.run()
        if me == 0:
            comm.send(ctx, x, 1)
        else:
            comm.recv(ctx, x, 0)
            np.testing.assert_array_equal(ctx.read(x), np.ones(4, np.float32))
    comm.barrier()
    say("local_failure")


# ---------------------------------------------------------------------------------------------


def timeout() -> None:
    """The last rank never joins: the others raise CollectiveTimeoutError naming it. (The
    last rank skips the call and goes on to make the next Comm, a collective on another
    communicator, where the others meet it once they have timed out.)"""
    comm = Comm(timeout=TIMEOUT)
    base = cpu2().get_device(0).make_context()
    last, wait = ranks - 1, 5.0  # long enough that only the absent rank is late, on a busy machine too
    node = Node("to_grads", (8,), "float32")
    ctx = base.init_from_host(node, np.ones(8, np.float32))
    comm.barrier()  # everyone starts together: only the last rank stays away
    if me != last:
        t0 = time.monotonic()
        try:
            comm.all_reduce(ctx, node, "sum", timeout=wait)
        except CollectiveTimeoutError as e:
            took = time.monotonic() - t0
            assert e.missing == (last,), e.missing
            assert e.collective == "all_reduce" and "to_grads" in e.node, (e.collective, e.node)
            assert f"rank {last} of {ranks} did not join" in str(e), str(e)
            # another waiting rank that timed out first (and told the others) may end it a
            # little early (found in CI, three ranks on a loaded machine)
            assert wait - 1.0 <= took < wait + 10.0, took
            report(f"TIMEOUT rank {me}: {e}")
        else:
            raise AssertionError("no CollectiveTimeoutError")
        _expect(CollectiveTimeoutError, lambda: comm.barrier(), "cannot be used")
    # a send that nobody receives names the peer
    fresh = Comm(timeout=TIMEOUT)
    if ranks > 1 and me == 0:
        _expect(CollectiveTimeoutError, lambda: fresh.send(ctx, node, 1, tag=7, timeout=wait), "send",
                f"rank 1 of {ranks} did not join", "one of the two must receive first")
    third = Comm(timeout=TIMEOUT)  # a new communicator carries on
    third.barrier()
    say("timeout")


def abort() -> None:
    """Rank 1 raises; rank 0 waits in a collective with a long timeout: the excepthook
    aborts the job long before."""
    comm = Comm(timeout=120)
    comm.barrier()
    if me == 1:
        raise RuntimeError("boom on purpose")
    node = Node("ab", (4,), "float32")
    ctx = cpu2().get_device(0).make_context().init_from_host(node, np.ones(4, np.float32))
    comm.all_reduce(ctx, node)
    report(f"NOT ABORTED rank {me}")


def thread_abort() -> None:
    """Found by review: an exception that ended a thread (a server's worker) did not abort
    the job (only sys.excepthook was replaced): rank 0 waited out its timeout. Rank 1's
    thread raises while rank 0 waits in a collective with a long timeout."""


    comm = Comm(timeout=120)
    comm.barrier()
    if me == 1:
        def work() -> None:
            raise ValueError("bad batch on rank 1's thread")

        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
        time.sleep(60)  # the abort comes before
    else:
        comm.barrier()
    report(f"NOT ABORTED rank {me}")


def late_rank() -> None:
    """Found by review: rank 0's call timed out (1 s) and it carried on; rank 1 came 3 s late,
    took rank 0's header, still posted, for a join, posted its data and waited its whole
    timeout (with ``inf``, for ever, at 100% CPU). Rank 0 now tells its peers it gave the Comm
    up, and rank 1's call fails at once, naming rank 0. A new Comm carries on."""
    if ranks != 2:
        return say("late_rank")
    comm = Comm(timeout=TIMEOUT)
    node = Node("late_grads", (4,), "float32")
    ctx = cpu2().get_device(0).make_context().init_from_host(node, np.full(4, 1.0 + me, np.float32))
    comm.barrier()
    if me == 1:
        time.sleep(3)
    t0 = time.monotonic()
    try:
        comm.all_reduce(ctx, node, "sum", timeout=1.0 if me == 0 else math.inf)
        raise AssertionError("the all_reduce returned")
    except CollectiveTimeoutError as e:
        took = time.monotonic() - t0
        if me == 0:
            assert e.missing == (1,) and "did not join" in str(e), str(e)
        else:
            assert e.missing == (0,) and "rank 0 of 2 gave this Comm up" in str(e), str(e)
            assert took < 5.0, took  # at once, not after a timeout (here: none)
    _expect(CollectiveTimeoutError, lambda: comm.barrier(), "cannot be used")
    fresh = Comm(timeout=TIMEOUT)
    fresh.all_reduce(ctx, node, "sum")
    np.testing.assert_array_equal(ctx.read(node), np.full(4, 3.0, np.float32))
    say("late_rank")


def gave_up_while_missing() -> None:
    """Found in CI (three ranks, loaded): rank 2 never joins; rank 1 times out first and tells
    the others; rank 0, still waiting, now names rank 2 as the one missing (it named rank 1,
    which had joined). Here rank 1's timeout is 2 s and rank 0's 30 s: rank 0 ends within a
    few seconds, not 30."""
    if ranks != 3:
        return say("gave_up_while_missing")
    comm = Comm(timeout=TIMEOUT)
    node = Node("gave_up", (4,), "float32")
    ctx = cpu2().get_device(0).make_context().init_from_host(node, np.ones(4, np.float32))
    comm.barrier()
    if me != 2:
        t0 = time.monotonic()
        try:
            comm.all_reduce(ctx, node, "sum", timeout=2.0 if me == 1 else 30.0)
            raise AssertionError("the all_reduce returned")
        except CollectiveTimeoutError as e:
            assert e.missing == (2,), (e.missing, str(e))
            assert "rank 2 of 3 did not join" in str(e), str(e)
            if me == 0:
                assert "rank 1 gave this Comm up" in str(e), str(e)
                assert time.monotonic() - t0 < 15.0, time.monotonic() - t0
    fresh = Comm(timeout=TIMEOUT)  # rank 2 comes straight here
    fresh.barrier()
    say("gave_up_while_missing")


def nan_fold() -> None:
    """Found by review: a float max or min with a NaN on one rank left the ranks with
    different values ([2, 2, nan] over three ranks: MPI's own max drops or keeps a NaN by the
    order the values meet in). Every rank now ends with numpy's values, NaN where any rank
    has one, in every float dtype, on nodes and host arrays, all_reduce and reduce_scatter."""
    import ml_dtypes

    comm = Comm(timeout=TIMEOUT)
    base = cpu2().get_device(0).make_context()
    n = 6 * ranks
    for dtype in ("float16", "float32", "float64", "bfloat16"):
        np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
        values = []
        for r in range(ranks):
            v = (np.arange(n) * (r + 1) % 7 - 3).astype(np.float32)
            v[r] = np.nan  # one NaN per rank, at its own place: rank r's NaN meets numbers elsewhere
            v[-1] = np.nan if r == 0 else v[-1]  # and one that only rank 0 has, at the end
            v[-2] = -0.0 if r % 2 else 0.0  # zeros of both signs: the same bits on every rank
            v[-3] = -np.nan if r % 2 else np.nan  # NaNs of both signs, too (found by review)
            values.append(v.astype(np_dtype))
        stack = np.stack([v.astype(np.float32) for v in values])
        for op, fold in (("max", np.max), ("min", np.min)):
            want = fold(stack, axis=0).astype(np_dtype)
            node = Node(f"nan_{dtype}_{op}", (n,), dtype)
            ctx = base.init_from_host(node, values[me])
            comm.all_reduce(ctx, node, op)
            got = ctx.read(node)
            np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32), err_msg=f"{dtype} {op}")
            every = WORLD.allgather(got.astype(np.float32).tobytes())
            assert len(set(every)) == 1, f"{dtype} {op}: the ranks ended with different values"
            if dtype != "bfloat16":
                arr = comm.all_reduce_array(values[me], op)
                np.testing.assert_array_equal(arr, want, err_msg=f"array {dtype} {op}")
            out = Node(f"nan_{dtype}_{op}_block", (6,), dtype)
            ctx = ctx.init_from_host(out, np.zeros(6, np_dtype))
            comm.reduce_scatter(ctx, node, out, op)
            np.testing.assert_array_equal(ctx.read(out).astype(np.float32),
                                          fold(stack, axis=0)[6 * me : 6 * me + 6].astype(np_dtype).astype(np.float32),
                                          err_msg=f"reduce_scatter {dtype} {op}")
    say("nan_fold")


def comm_lifetimes() -> None:
    """Found by review: Comms were never freed but by an explicit free(), and data_parallel's
    close() left the two it made from an mpi4py communicator: after about a thousand, MPI ran
    out of communicators and raised mpi4py's bare Exception. A ``with`` block frees its Comm
    (more of them than MPI holds at once, made one after another); data_parallel frees what it
    made, not what it was given; running out is a DriverError that names the fix, and the
    Comms freed after it leave MPI usable."""
    from polyjit import tensor as pt
    from polyjit.core.errors import DriverError

    live = Comm._live
    for _ in range(1100):  # 2200 duplicates: MPICH holds about 2000
        with Comm(timeout=TIMEOUT) as c:
            pass
    assert c._freed and Comm._live == live
    mlp = pt.MLP("mlp", [2, 4, 2], seed=3)
    loss = lambda x, y: pt.cross_entropy(mlp(x), y)  # noqa: E731
    shapes = {"x": ((4 * ranks, 2), "float32"), "y": ((4 * ranks,), "int32")}
    dp = pt.data_parallel(loss, shapes, optimizer=pt.SGD(0.1), devices=cpu2().devices()[:1], comm=WORLD)
    dp.close()
    assert dp.comm is not None and dp.comm._freed and Comm._live == live
    from polyjit.core.errors import InvalidProgramError

    try:  # a set-up refused after the Comm was made (found by review: it kept the Comm)
        pt.data_parallel(lambda x, y: pt.sum(x) * 0.0, shapes, optimizer=pt.SGD(0.1),
                         devices=cpu2().devices()[:1], comm=WORLD)
        raise AssertionError("no InvalidProgramError")
    except InvalidProgramError as e:
        assert "nothing to train" in str(e), str(e)
    assert Comm._live == live
    mine = Comm(timeout=TIMEOUT)
    dp = pt.data_parallel(loss, shapes, optimizer=pt.SGD(0.1), devices=cpu2().devices()[:1], comm=mine)
    dp.close()
    assert not mine._freed  # the caller's
    mine.barrier()
    kept: list[Comm] = []
    try:
        while len(kept) < 5000:
            kept.append(Comm(timeout=TIMEOUT))
        raise AssertionError("MPI never ran out of communicators")
    except DriverError as e:
        assert "not freed" in str(e) and "Comm.free()" in str(e), str(e)
    # ranks may run out at different counts: free them all, then meet again
    for c in kept:
        c.free()
    mine.barrier()
    mine.free()
    assert Comm._live == live
    with Comm(timeout=TIMEOUT) as c:
        c.barrier()
    say("comm_lifetimes")


def comm_threads() -> None:
    """Found by review: two threads calling one Comm got each other's sums in about half of
    600 calls, silently (the call numbers interleaved, and the header did not say which node).
    Calls now take turns on each rank and the header carries the node's name: threads racing
    each get their own sum or CollectiveMismatchError (a call paired with the other node's),
    never the other's values, and the Comm stays in step; threads that order their calls
    (taking turns on a lock, the same order on every rank) all get their sums."""
    comm = Comm(timeout=TIMEOUT)
    backend = cpu2()
    calls, wrong, mismatched = 150, [], []
    turns = threading.Condition()
    turn = ["A"]

    def work(tag: str, value: float, ordered: bool) -> None:
        node = Node(f"grads_{tag}", (16,), "float32")
        ctx = backend.get_device(0).make_context().init_from_host(node, np.full(16, value * (me + 1), np.float32))
        want = value * sum(r + 1 for r in range(ranks))
        for _ in range(calls):
            ctx.from_host(node, np.full(16, value * (me + 1), np.float32))
            if ordered:
                with turns:
                    turns.wait_for(lambda: turn[0] == tag)
            try:
                comm.all_reduce(ctx, node, "sum")
                got = ctx.read(node)
                if not np.all(got == want):
                    wrong.append((tag, float(got[0])))
            except CollectiveMismatchError as e:
                assert "grads_" in str(e), str(e)
                mismatched.append(tag)
            finally:
                if ordered:
                    with turns:
                        turn[0] = "B" if tag == "A" else "A"
                        turns.notify_all()

    for ordered in (False, True):
        threads = [threading.Thread(target=work, args=(t, v, ordered)) for t, v in (("A", 1.0), ("B", 1000.0))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert not any(t.is_alive() for t in threads)
        assert not wrong, wrong[:5]
        if ordered:
            assert not mismatched, len(mismatched)
        report(f"COMM_THREADS rank {me}: {'ordered' if ordered else 'racing'}: {len(mismatched)} of {2 * calls} "
               "calls paired with the other thread's node, none with its values")
        mismatched.clear()
        comm.barrier()  # in step
    say("comm_threads")


def lock_timeout() -> None:
    """Found by review: a thread whose call waited for another thread's call on the same Comm
    waited out that call's timeout, not its own (1 s asked, 5.7 s taken). Rank 1 comes 3 s
    late to a barrier that rank 0's thread A waits in (timeout 30 s); rank 0's thread B calls
    with a 1 s timeout meanwhile: B gives up after about 1 s, having sent nothing, and the
    Comm carries on."""


    comm = Comm(timeout=TIMEOUT)
    comm.barrier()
    if me == 0:
        took: dict[str, float] = {}

        def a() -> None:
            comm.barrier(timeout=30)

        def b() -> None:
            time.sleep(0.3)
            t0 = time.monotonic()
            _expect(CollectiveTimeoutError, lambda: comm.barrier(timeout=1.0), "another thread's call")
            took["b"] = time.monotonic() - t0

        threads = [threading.Thread(target=a), threading.Thread(target=b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert 0.9 <= took["b"] < 2.5, took
    else:
        time.sleep(3)
        comm.barrier()  # thread A's
    comm.barrier()  # in step: B's call never began
    say("lock_timeout")


def world_threads() -> None:
    """Found by review: world() from two threads at once made two Comms (two concurrent
    MPI_Comm_idup calls). Every thread now gets the one shared Comm."""


    import polyjit.distributed as pd

    got: list[Any] = []
    start = threading.Barrier(4)

    def ask() -> None:
        start.wait()
        got.append(pd.world())

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert len(got) == 4 and len({id(c) for c in got}) == 1, got
    got[0].barrier(timeout=TIMEOUT)
    say("world_threads")


def sysexit() -> None:
    """Rank 1 calls sys.exit(3) while rank 0 waits in a collective. A SystemExit never reaches
    the excepthook: under ``python -m mpi4py`` mpi4py's runner aborts the job with its code;
    without it rank 0 waits out its timeout (short here) and names rank 1."""
    comm = Comm(timeout=float(os.environ.get("SYSEXIT_TIMEOUT", "120")))
    comm.barrier()
    if me == 1:
        sys.exit(3)
    try:
        comm.barrier()
    except CollectiveTimeoutError as e:
        report(f"SYSEXIT rank {me}: {e}")
        os._exit(0)  # MPI_Finalize would wait for the rank that left
    report(f"NOT ABORTED rank {me}")


# ---------------------------------------------------------------------------------------------


BATCH, STEPS = 48, 20


def train(devs: Any, make_opt: Callable[[], Any], comm: Any, *, local: bool = False, steps: int = STEPS
          ) -> tuple[dict[str, np.ndarray], list[float], float]:
    """(parameters, losses, spread between the ranks) after ``steps`` steps of the MLP."""
    from polyjit import tensor as pt
    from polyjit.demo.datasets import two_spirals

    xs, ys = two_spirals(BATCH * steps, seed=1)
    mlp = pt.MLP("mlp", [2, 32, 32, 2], activation="tanh", seed=3)
    dp = pt.data_parallel(lambda x, y: pt.cross_entropy(mlp(x), y),
                          {"x": ((BATCH, 2), "float32"), "y": ((BATCH,), "int32")},
                          optimizer=make_opt(), devices=devs, comm=comm)
    losses = []
    for k in range(steps):
        xb, yb = xs[k * BATCH : (k + 1) * BATCH], ys[k * BATCH : (k + 1) * BATCH]
        if local:  # this rank's slice only
            rows = BATCH // ranks
            xb, yb = xb[me * rows : (me + 1) * rows], yb[me * rows : (me + 1) * rows]
        losses.append(dp.step(x=xb, y=yb))
    params = dp.parameters()
    assert dp.replica_spread() == 0.0
    spread = dp.rank_spread()
    dp.close()
    return params, losses, spread


def same_training(got: tuple[dict[str, np.ndarray], list[float], float],
                  ref: tuple[dict[str, np.ndarray], list[float], float], label: str) -> None:
    params, losses, spread = got
    assert spread == 0.0, f"{label}: the ranks differ by {spread}"
    np.testing.assert_allclose(losses, ref[1], rtol=1e-5, err_msg=label)
    for name, value in ref[0].items():
        scale = float(np.abs(value).max())
        np.testing.assert_allclose(params[name], value, rtol=1e-5, atol=1e-5 * scale, err_msg=f"{label} {name}")


def data_parallel(devices_per_rank: int = 2) -> None:
    """R ranks x D devices train 20 steps to the parameters of 1 device (1e-5 relative)."""
    from polyjit import tensor as pt

    assert BATCH % (ranks * devices_per_rank) == 0
    comm = Comm(timeout=TIMEOUT)
    backend = create_backend(num_devices=devices_per_rank)
    one = create_backend(num_devices=1)
    for label, make_opt in (("adam", lambda: pt.Adam(0.01)), ("sgd", lambda: pt.SGD(0.1, momentum=0.9))):
        ref = train(one.devices(), make_opt, None)
        got = train(backend.devices(), make_opt, comm)
        same_training(got, ref, label)
        if label == "adam":  # each rank feeding only its own slice trains the same
            sliced = train(backend.devices(), make_opt, comm, local=True)
            for name, value in got[0].items():
                np.testing.assert_array_equal(sliced[0][name], value, err_msg=f"sliced {name}")
    say(f"data_parallel:{devices_per_rank}")


def dp_local_failure() -> None:
    """Found by review: a data-parallel step that failed on one rank before the all-reduce (a
    label out of range in that rank's rows) left the other ranks' all-reduce to pair with
    the next step's, which then trained on wrong gradients. Now every rank raises in that step
    (the failing one its own error, the others CollectiveRefusedError naming it), nobody
    applies it, and training goes on in step: the result is one device's on the good batches."""
    from polyjit import tensor as pt
    from polyjit.core.errors import IndexOutOfRangeError
    from polyjit.demo.datasets import two_spirals

    comm = Comm(timeout=TIMEOUT)
    last = ranks - 1
    xs, ys = two_spirals(BATCH * 3, seed=1)
    batches = [(xs[k * BATCH : (k + 1) * BATCH], ys[k * BATCH : (k + 1) * BATCH]) for k in range(3)]

    def make(devs: Any, c: Any) -> Any:
        mlp = pt.MLP("mlp", [2, 16, 2], activation="tanh", seed=3)
        return pt.data_parallel(lambda x, y: pt.cross_entropy(mlp(x), y),
                                {"x": ((BATCH, 2), "float32"), "y": ((BATCH,), "int32")},
                                optimizer=pt.Adam(0.01), devices=devs, comm=c)

    ref = make(create_backend(num_devices=1).devices(), None)
    ref.step(x=batches[0][0], y=batches[0][1])
    ref.step(x=batches[2][0], y=batches[2][1])
    dp = make(cpu2().devices(), comm)
    dp.step(x=batches[0][0], y=batches[0][1])
    bad_y = batches[1][1].copy()
    bad_y[BATCH - 1] = 7  # a class that does not exist, in the last rank's rows
    for step in (dp.step, dp.step_profiled):
        bad = functools.partial(step, x=batches[1][0], y=bad_y)
        if me == last:
            _expect(IndexOutOfRangeError, bad, "out of range")
        else:
            _refused(bad, last, "all_reduce", "(call #")
    dp.step(x=batches[2][0], y=batches[2][1])
    assert dp.steps == 2, dp.steps
    assert dp.rank_spread() == 0.0 and dp.replica_spread() == 0.0
    for name, value in ref.parameters().items():
        np.testing.assert_allclose(dp.parameters()[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    dp.close()
    ref.close()
    say("dp_local_failure")


def spread_nan() -> None:
    """Found by review: rank_spread() and replica_spread() returned 0.0 when a replica's
    parameters were NaN (builtin max() drops a NaN that comes second, and MPI's max and min
    may drop it too). A NaN parameter on any rank now gives NaN on every rank."""
    from polyjit import tensor as pt
    from polyjit.tensor.state import stage_state

    comm = Comm(timeout=TIMEOUT)
    mlp = pt.MLP("mlp", [2, 4, 2], seed=0)
    dp = pt.data_parallel(lambda x, y: pt.cross_entropy(mlp(x), y),
                          {"x": ((ranks * 2, 2), "float32"), "y": ((ranks * 2,), "int32")},
                          optimizer=pt.SGD(0.1), devices=cpu2().devices(), comm=comm)
    assert dp.rank_spread() == 0.0 and dp.replica_spread() == 0.0
    state = dp.state_dict()
    name = sorted(state)[0]
    state[name] = state[name].copy()
    state[name].reshape(-1)[0] = np.inf  # the same inf everywhere: equal (inf - inf is NaN)
    dp.load_state_dict(state)
    assert dp.rank_spread() == 0.0 and dp.replica_spread() == 0.0, (dp.rank_spread(), dp.replica_spread())
    if me == ranks - 1:  # not load_state_dict, which gives every rank rank 0's values
        name = sorted(state)[-1]
        state[name] = state[name].copy()
        state[name].reshape(-1)[-1] = np.nan  # one value of one parameter, on one rank
        staged = stage_state(dp.persistent, state, True, "test")
        for rep in dp.replicas:
            rep.state.write(staged)
    assert np.isnan(dp.rank_spread()), dp.rank_spread()
    spread = dp.replica_spread()
    assert np.isnan(spread) if me == ranks - 1 else spread == 0.0, spread
    dp.close()
    say("spread_nan")


def dp_rank0_state() -> None:
    """Found by review: ranks whose parameters started apart (a seed per rank) trained apart and
    reported one loss; load_state_dict() and reset() the same. Every rank now takes rank 0's
    state, as PyTorch's DistributedDataParallel starts."""
    from polyjit import tensor as pt

    comm = Comm(timeout=TIMEOUT)
    w = pt.param("w", (2, 2), init=np.full((2, 2), me + 1, np.float32))  # each rank its own start
    dp = pt.data_parallel(lambda x: (x @ w).mean(), {"x": ((ranks * 2, 2), "float32")}, optimizer=pt.SGD(0.1),
                          devices=cpu2().devices(), comm=comm, name="rank0")
    np.testing.assert_array_equal(dp.parameters()["w"], np.ones((2, 2), np.float32))
    assert dp.rank_spread() == 0.0 and dp.replica_spread() == 0.0
    dp.step(x=np.ones((ranks * 2, 2), np.float32))
    assert dp.rank_spread() == 0.0
    dp.load_state_dict({"w": np.full((2, 2), 10 * (me + 1), np.float32)})
    np.testing.assert_array_equal(dp.parameters(1)["w"], np.full((2, 2), 10, np.float32))
    dp.reset()
    np.testing.assert_array_equal(dp.parameters(1)["w"], np.ones((2, 2), np.float32))
    last = ranks - 1
    bad = {"w": np.zeros((3, 2) if me == last else (2, 2), np.float32)}
    if me == last:  # refused on one rank: nothing written anywhere, and the Comm stays in step
        _expect(ShapeMismatchError, lambda: dp.load_state_dict(bad), "(3, 2)")
    else:
        _refused(lambda: dp.load_state_dict(bad), last, "check")
    np.testing.assert_array_equal(dp.parameters(1)["w"], np.ones((2, 2), np.float32))
    v = pt.param("v", (2,), init="zeros")  # the ranks agree on which tensors they load first
    dp2 = pt.data_parallel(lambda x: (x @ w).mean() + (x @ v).mean(), {"x": ((ranks * 2, 2), "float32")},
                           optimizer=pt.SGD(0.1), devices=cpu2().devices(), comm=comm, name="rank0_two")
    which = {"v": np.ones(2, np.float32)} if me == 0 else {"w": np.ones((2, 2), np.float32)}
    _expect(CollectiveMismatchError, lambda: dp2.load_state_dict(which, strict=False), "hash of its names")
    dp2.close()
    dp.close()
    say("dp_rank0_state")


def dp_two_models() -> None:
    """Found by review: two data parallels over one Comm all-reduced nodes of one name, so
    stepped from two threads they summed each other's gradients without an error. Their
    gradients are named by the model now: a step of one paired with the other's raises
    CollectiveMismatchError on every rank, and a second model of the same name is refused."""
    from polyjit import tensor as pt

    comm = Comm(timeout=TIMEOUT)
    made = {}
    for name in ("a", "b"):
        v = pt.param(f"{name}_w", (2,), init="ones")
        made[name] = pt.data_parallel(lambda x, v=v: (x * v).mean(), {"x": ((ranks, 2), "float32")},
                                      optimizer=pt.SGD(0.1), devices=cpu2().devices()[:1], comm=comm, name=name)
    v = pt.param("a2_w", (2,), init="ones")
    _expect(InvalidArgumentError, lambda: pt.data_parallel(lambda x: (x * v).mean(), {"x": ((ranks, 2), "float32")},
                                                           optimizer=pt.SGD(0.1), devices=cpu2().devices()[:1],
                                                           comm=comm, name="a"), "'a'", "its own name=")
    first = "a" if me == 0 else "b"
    x = np.ones((ranks, 2), np.float32)
    _expect(CollectiveMismatchError, lambda: made[first].step(x=x), "a_grads", "b_grads")
    for name in ("a", "b"):  # in one order: both train, alike on every rank
        made[name].step(x=x)
        assert made[name].rank_spread() == 0.0
        made[name].close()
    comm.barrier()
    say("dp_two_models")


def dp_names() -> None:
    """Found by the second review: a dropped data parallel kept its name for good (a model
    rebuilt without close() was refused), a name refused on one rank only left the others
    waiting, and ranks with other optimizers broadcast states that paired apart."""
    from polyjit import tensor as pt

    comm = Comm(timeout=TIMEOUT)
    devs = cpu2().devices()[:1]

    def make(name: str, opt: Any = None) -> Any:
        w = pt.param(f"{name}_w", (2,), init="ones")
        return pt.data_parallel(lambda x: (x * w).mean(), {"x": ((ranks, 2), "float32")},
                                optimizer=opt or pt.SGD(0.1), devices=devs, comm=comm, name=name)

    dp = make("model")
    del dp
    gc.collect()
    dp = make("model")  # the dropped one gave its name back
    last = ranks - 1
    held = make("held")
    if me != last:  # the last rank's stays alive
        held.close()
    if me == last:
        _expect(InvalidArgumentError, lambda: make("held"), "'held'")
    else:
        _refused(lambda: make("held"), last, "check")
    other = pt.Adam(0.01) if me == last else pt.SGD(0.1)
    _expect(CollectiveMismatchError, lambda: make("opt", other), "names, shapes and dtypes")
    # found by the first review: a set-up refused on one rank before the check left the others
    # waiting out their timeout in it
    w = pt.param("setup_w", (2,), init="ones")
    spec = {"x": ((ranks, 2) if me != last else (), "float32")}  # no batch axis on the last rank
    make_bad = lambda: pt.data_parallel(lambda x: (x * w).mean(), spec, optimizer=pt.SGD(0.1),  # noqa: E731
                                        devices=devs, comm=comm, name="setup")
    if me == last:
        _expect(ShapeMismatchError, make_bad, "no batch axis")
    else:
        _refused(make_bad, last, "check")
    comm.barrier()
    dp.close()
    held.close()
    say("dp_names")


def interrupted() -> None:
    """Found by review: a KeyboardInterrupt in an all_reduce (a Ctrl-C while a peer is late)
    left its header receive posted and the Comm unbroken: the next call's header was
    swallowed, and it waited its whole timeout. The Comm is now broken at once, and the peer
    fails at once, naming the rank that gave it up."""
    comm = Comm(timeout=TIMEOUT)
    if me == 0:
        def interrupt(*_: object) -> None:
            raise KeyboardInterrupt

        old = signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        try:
            _expect(KeyboardInterrupt, lambda: comm.all_reduce_array(np.ones(4)))
        finally:
            signal.signal(signal.SIGALRM, old)
        t0 = time.monotonic()
        _expect(CollectiveTimeoutError, lambda: comm.all_reduce_array(np.ones(4)), "was interrupted",
                "KeyboardInterrupt")
        assert time.monotonic() - t0 < 1.0
    else:
        time.sleep(1.5)  # late: rank 0 is interrupted while it waits
        t0 = time.monotonic()
        _expect(CollectiveTimeoutError, lambda: comm.all_reduce_array(np.ones(4)), "rank 0", "gave this Comm up")
        assert time.monotonic() - t0 < TIMEOUT / 2
    comm.free()
    # found by the second review: an interrupt after the join, before the data is posted
    comm = Comm(timeout=TIMEOUT)
    if me == 0:
        real = comm._join

        def join_then_interrupt(*args: Any, **kwargs: Any) -> None:
            real(*args, **kwargs)
            raise KeyboardInterrupt  # as a signal handler's, at the next bytecode

        comm._join = join_then_interrupt  # type: ignore[method-assign]
        _expect(KeyboardInterrupt, lambda: comm.all_reduce_array(np.ones(4)))
    else:
        t0 = time.monotonic()
        _expect(CollectiveTimeoutError, lambda: comm.all_reduce_array(np.ones(4)), "rank 0", "gave this Comm up")
        assert time.monotonic() - t0 < TIMEOUT / 2
    comm.free()
    say("interrupted")


def dup_retry() -> None:
    """Found by review: after a Comm() that timed out, the next Comm() of that rank paired its
    duplications with the wrong ones of the peers': a rank's Comm "succeeded" and its calls
    timed out. The next Comm() now takes the timed-out rank's pending duplications first."""
    if me == 0:
        _expect(CollectiveTimeoutError, lambda: Comm(timeout=0.5), "Comm()", "did not make its Comm")
    else:
        time.sleep(1.5)
    comm = Comm(timeout=TIMEOUT)
    got = comm.all_reduce_array(np.array([me + 1.0]))
    assert got[0] == ranks * (ranks + 1) / 2, got
    comm.free()
    if me == 0:  # found by the second review: interrupted there, as timed out
        def interrupt(*_: object) -> None:
            raise KeyboardInterrupt

        old = signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        try:
            _expect(KeyboardInterrupt, lambda: Comm(timeout=TIMEOUT))
        finally:
            signal.signal(signal.SIGALRM, old)
    else:
        time.sleep(1.0)
    with Comm(timeout=TIMEOUT) as comm:
        got = comm.all_reduce_array(np.array([me + 1.0]))
    assert got[0] == ranks * (ranks + 1) / 2, got
    # found by the second review: Comms over two communicators, made by two threads in other
    # orders on the ranks, waited for each other (one lock for every communicator)
    x, y = WORLD.Dup(), WORLD.Dup()
    order = [x, y] if me == 0 else [y, x]
    made: list[Any] = []

    def make(base: Any, delay: float) -> None:
        time.sleep(delay)
        made.append(Comm(base, timeout=TIMEOUT))

    threads = [threading.Thread(target=make, args=(order[0], 0.0)), threading.Thread(target=make, args=(order[1], 0.3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 2, made
    for c in made:
        c.free()
    x.Free()
    y.Free()
    say("dup_retry")


def intercomm() -> None:
    """Found by review: Comm() took an intercommunicator (its size the local group's), whose
    calls then reduced over one rank without an error."""
    local = WORLD.Split(me % 2, me)
    inter = local.Create_intercomm(0, WORLD, 1 - (me % 2), tag=7)
    _expect(InvalidArgumentError, lambda: Comm(inter, timeout=TIMEOUT), "intercommunicator")
    inter.Free()
    local.Free()
    say("intercomm")


def half_mean() -> None:
    """Found by review: a float16 mean of 40000s summed to inf in float16; it is reduced in
    float32, rounded once (a sum past float16's range is still inf, as numpy's)."""
    comm = Comm(timeout=TIMEOUT)
    got = comm.all_reduce_array(np.array([40000, 1], np.float16), "mean")
    np.testing.assert_array_equal(got, np.array([40000, 1], np.float16))
    assert got.dtype == np.float16
    node = Node("half_mean", (2,), "float16")
    ctx = cpu2().get_device(0).make_context().init_from_host(node, np.array([40000, 1], np.float16))
    comm.all_reduce(ctx, node, "mean")
    np.testing.assert_array_equal(ctx.read(node), np.array([40000, 1], np.float16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        total = comm.all_reduce_array(np.array([40000, 1], np.float16), "sum")
    assert np.isinf(total[0]) and total[1] == ranks, total
    say("half_mean")


def bind_refused() -> None:
    """Found by review: a rank whose bind_to_cores refused its arguments left the others in
    MPI's Split_type for ever; they now raise CollectiveRefusedError naming it."""
    from polyjit.distributed import bind_to_cores, local_rank

    assert local_rank() == (me, ranks)  # one machine
    if me == 0:
        _expect(InvalidArgumentError, lambda: bind_to_cores(cores=[], timeout=TIMEOUT), "cores=[]")
    else:
        _refused(lambda: bind_to_cores(timeout=TIMEOUT), 0, "check")
    # found by the second review: other cores_per_rank on the ranks bound overlapping cores
    _expect(CollectiveMismatchError, lambda: bind_to_cores(me + 1, timeout=TIMEOUT), "cores_per_rank")
    say("bind_refused")


# ---------------------------------------------------------------------------------------------


def _on_stub() -> None:
    """Under tests/cuda's stub driver (``$PJSTUB_KERNELS`` set): give the stub the host code
    of every CUDA image polyjit compiles."""
    if os.environ.get("PJSTUB_KERNELS"):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cuda"))
        import stub

        stub.install_nvrtc_hook()


def cuda_staged() -> None:
    """A node on a CUDA device, MPI not CUDA-aware: staged through host copies."""
    _on_stub()
    be = get_backend("cuda")
    if be.num_devices() == 0:
        report(f"SKIP cuda_staged rank {me}: no CUDA device")
        return
    comm = Comm(timeout=TIMEOUT, cuda_aware=False)
    _cuda_all_ops(comm, be, "cuda_staged")


def cuda_aware() -> None:
    """A node on a CUDA device handed to a CUDA-aware MPI as device memory."""
    from polyjit.distributed import mpi_cuda_aware

    _on_stub()
    be = get_backend("cuda")
    if be.num_devices() == 0 or not mpi_cuda_aware():
        report(f"SKIP cuda_aware rank {me}: no CUDA device or MPI is not CUDA-aware")
        return
    comm = Comm(timeout=TIMEOUT, cuda_aware=True)
    _cuda_all_ops(comm, be, "cuda_aware")


def cuda_data_parallel() -> None:
    """Data parallel with one CUDA device per rank (MPI between the ranks, CUDA-aware or
    staged as mpi_cuda_aware() says) trains to the parameters of one cpu device."""
    from polyjit import tensor as pt

    _on_stub()
    be = get_backend("cuda")
    if be.num_devices() == 0:
        report(f"SKIP cuda_data_parallel rank {me}: no CUDA device")
        return
    comm = Comm(timeout=TIMEOUT)
    ref = train(create_backend(num_devices=1).devices(), lambda: pt.SGD(0.1, momentum=0.9), None, steps=5)
    got = train([be.get_device(me % be.num_devices())], lambda: pt.SGD(0.1, momentum=0.9), comm, steps=5)
    assert got[2] == 0.0, got[2]
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5)
    for name, value in ref[0].items():
        np.testing.assert_allclose(got[0][name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    say("cuda_data_parallel")


def _cuda_all_ops(comm: Comm, be: Any, name: str) -> None:
    dev = be.get_device(me % be.num_devices())
    base = dev.make_context()
    for op in ("sum", "max", "min", "mean"):
        node = Node(f"cu_{op}", (ranks * 8, 4), "float32")
        ctx = base.init_from_host(node, data(me, "float32", node.shape))
        comm.all_reduce(ctx, node, op)
        check(ctx.read(node), reduce_np([data(r, "float32", node.shape) for r in range(ranks)], op), f"{name} {op}")
    node = Node("cu_bc", (5,), "float32")
    ctx = base.init_from_host(node, data(me, "float32", (5,)))
    comm.broadcast(ctx, node, root=ranks - 1)
    check(ctx.read(node), data(ranks - 1, "float32", (5,)), f"{name} broadcast")
    say(name)


def nccl() -> None:
    """NCCL collectives of CUDA nodes (one GPU per rank), ordered on the device: a routine
    before and after each call, no waits; data parallel over an NcclComm."""
    from polyjit import tensor as pt
    from polyjit.distributed.nccl import NcclComm, nccl_unavailable_reason

    be = get_backend("cuda")
    reason = nccl_unavailable_reason()
    if be.num_devices() < ranks or reason:
        report(f"SKIP nccl rank {me}: {reason or f'{be.num_devices()} CUDA devices for {ranks} ranks'}")
        return
    comm = Comm(timeout=TIMEOUT)
    dev = be.get_device(me)
    nc = NcclComm(comm, dev)
    base = dev.make_context()
    shape = (ranks * 8, 4)
    for op in ("sum", "max", "min", "mean"):
        a, x, y = (Node(f"nc_{k}_{op}", shape, "float32") for k in ("a", "x", "y"))
        ctx = base.init_from_host(a, data(me, "float32", shape)).init_from_host(x, np.zeros(shape, np.float32))
        produce = ctx.link(be.compile(ir.Comp.of(ir.apply(Op.MUL, a, 2.0, into=x)), name=f"nc_p_{op}"))
        consume = produce.context.link(be.compile(ir.Comp.of(ir.apply(Op.ADD, x, 1.0, into=y), embedded=[y]),
                                                  name=f"nc_c_{op}"))
        produce.run()
        nc.all_reduce(produce.context, x, op)  # enqueued after the writer, on the device
        consume.run()
        want = reduce_np([2 * data(r, "float32", shape) for r in range(ranks)], op) + 1
        check(consume.context.read(y), want, f"nccl all_reduce {op}")
        out = Node(f"nc_rs_{op}", (8, 4), "float32")
        rctx = base.init_from_host(a, data(me, "float32", shape)).init_from_host(out, np.zeros((8, 4), np.float32))
        nc.reduce_scatter(rctx, a, out, op)
        full = reduce_np([data(r, "float32", shape) for r in range(ranks)], op)
        check(rctx.read(out), full[me * 8 : (me + 1) * 8], f"nccl reduce_scatter {op}")
    node, joined = Node("nc_ag", (3, 2), "int32"), Node("nc_ag_out", (ranks * 3, 2), "int32")
    ctx = base.init_from_host(node, data(me, "int32", (3, 2))).init_from_host(joined, np.zeros((ranks * 3, 2), np.int32))
    nc.all_gather(ctx, node, joined)
    check(ctx.read(joined), np.concatenate([data(r, "int32", (3, 2)) for r in range(ranks)]), "nccl all_gather")
    nc.broadcast(ctx, node, root=ranks - 1)
    check(ctx.read(node), data(ranks - 1, "int32", (3, 2)), "nccl broadcast")
    ref = train(create_backend(num_devices=1).devices(), lambda: pt.SGD(0.1, momentum=0.9), None, steps=5)
    got = train([dev], lambda: pt.SGD(0.1, momentum=0.9), nc, steps=5)
    assert got[2] == 0.0, got[2]
    for name, value in ref[0].items():
        np.testing.assert_allclose(got[0][name], value, rtol=1e-5, atol=1e-6, err_msg=f"nccl data_parallel {name}")
    nc.check()
    nc.close()
    say("nccl")


def nccl_refusal() -> None:
    """Without a GPU (a fake NCCL library, the cpu backend's stream): a call whose preparation
    failed on one rank (an export, an event record, the stream) failed there after the MPI
    join, so the other ranks' NCCL kernels would have waited for one that never launched,
    until the watchdog's deadline. Now the preparation comes first, a failure refuses the
    join, and no rank launches anything; the communicator stays usable."""

    from polyjit.core.errors import DriverError
    from polyjit.distributed import nccl

    launched: list[str] = []

    class Lib:
        def ncclAllReduce(self, *a: Any) -> int:
            launched.append("all_reduce")
            return 0

        def ncclSend(self, *a: Any) -> int:
            launched.append("send")
            return 0

        def ncclRecv(self, *a: Any) -> int:
            launched.append("recv")
            return 0

        def ncclCommGetAsyncError(self, handle: Any, err: Any) -> int:
            return 0

        def ncclCommDestroy(self, handle: Any) -> int:
            return 0

    dev = create_backend(num_devices=1).get_device(0)
    broken = {"on": me == ranks - 1}

    def foreign_stream(handle: Any) -> int:
        if broken["on"]:
            raise DriverError(f"rank {me}: the stream is gone")
        return 0

    nccl._make_current = lambda device: None  # type: ignore[assignment]  # no CUDA here
    dev.driver.foreign_stream = foreign_stream  # type: ignore[attr-defined]
    nc = object.__new__(nccl.NcclComm)
    nc.lib, nc.handle, nc._broken, nc._timeout = Lib(), None, None, TIMEOUT
    nc.comm, nc.device = Comm(timeout=TIMEOUT), dev
    nc._watch = nccl._Watchdog(nc)
    node = Node("nr", (4,), "float32")
    ctx = dev.make_context().init_from_host(node, np.ones(4, np.float32))
    if me == ranks - 1:
        _expect(DriverError, lambda: nc.all_reduce(ctx, node), "the stream is gone")
    else:
        _refused(lambda: nc.all_reduce(ctx, node), ranks - 1, "all_reduce")
    assert launched == [], launched
    if ranks >= 2 and me in (0, 1):  # send from 0 to 1, refused by the receiver
        broken["on"] = me == 1
        if me == 0:
            _expect(CollectiveMismatchError, lambda: nc.send(ctx, node, 1))
        else:
            _expect(DriverError, lambda: nc.recv(ctx, node, 0), "the stream is gone")
        assert launched == [], launched
    broken["on"] = False
    nc.all_reduce(ctx, node)  # in step: every rank launches this one
    assert launched == ["all_reduce"], launched
    nc.close()
    say("nccl_refusal")


def nccl_id() -> None:
    """Without a GPU: the NCCL library loads and rank 0's unique id reaches every rank."""
    from polyjit.distributed.nccl import nccl_unavailable_reason, nccl_version, shared_unique_id

    reason = nccl_unavailable_reason()
    if reason:
        report(f"SKIP nccl_id rank {me}: {reason}")
        return
    comm = Comm(timeout=TIMEOUT)
    uid = shared_unique_id(comm)
    assert len(uid) == 128 and any(uid)
    every = WORLD.allgather(uid)
    assert all(u == every[0] for u in every)
    report(f"NCCL rank {me}: version {nccl_version()}")
    say("nccl_id")


def export_path() -> None:
    """The CUDA-aware path (MPI gets ``ctx.export(node)``, waits on the node's events, the
    mean as a linked routine), run on the cpu backend, whose exports are host memory."""
    from polyjit.distributed import comm as comm_module

    real = comm_module.on_cuda
    comm_module.on_cuda = lambda ctx: True  # every context takes the device-memory path
    try:
        _export_path()
    finally:
        comm_module.on_cuda = real
    say("export_path")


def _export_path() -> None:
    comm = Comm(timeout=TIMEOUT, cuda_aware=True)
    base = cpu2().get_device(0).make_context()
    for op in ("sum", "max", "min", "mean"):
        node = Node(f"ex_{op}", (ranks * 4, 3), "float32")
        out = Node(f"ex_rs_{op}", (4, 3), "float32")
        ctx = base.init_from_host(node, data(me, "float32", node.shape)).init_from_host(
            out, np.zeros(out.shape, np.float32))
        comm.reduce_scatter(ctx, node, out, op)
        comm.all_reduce(ctx, node, op)
        want = reduce_np([data(r, "float32", node.shape) for r in range(ranks)], op)
        check(ctx.read(node), want, f"export all_reduce {op}")
        check(ctx.read(out), want[me * 4 : (me + 1) * 4], f"export reduce_scatter {op}")
    node = Node("ex_bc", (6,), "int32")
    joined = Node("ex_ag", (ranks * 6,), "int32")
    ctx = base.init_from_host(node, data(me, "int32", (6,))).init_from_host(joined, np.zeros(ranks * 6, np.int32))
    comm.all_gather(ctx, node, joined)
    check(ctx.read(joined), np.concatenate([data(r, "int32", (6,)) for r in range(ranks)]), "export all_gather")
    comm.broadcast(ctx, node, root=ranks - 1)
    check(ctx.read(node), data(ranks - 1, "int32", (6,)), "export broadcast")
    # data parallel whose reduced gradients stay in "device memory": the loss comes apart
    from polyjit import tensor as pt

    ref = train(create_backend(num_devices=1).devices(), lambda: pt.SGD(0.1), None, steps=5)
    same_training(train(cpu2().devices(), lambda: pt.SGD(0.1), comm, steps=5), ref, "export data_parallel")


SCENARIOS: dict[str, Callable[[], None]] = {
    "collectives": collectives, "ordering": ordering, "mismatch": mismatch, "timeout": timeout,
    "abort": abort, "staged": staged, "cuda_staged": cuda_staged, "cuda_aware": cuda_aware,
    "nccl": nccl, "nccl_id": nccl_id, "nccl_refusal": nccl_refusal, "export_path": export_path,
    "cuda_data_parallel": cuda_data_parallel,
    "local_failure": local_failure, "dp_local_failure": dp_local_failure, "bfloat16": bfloat16,
    "spread_nan": spread_nan, "sysexit": sysexit,
    "world_threads": world_threads, "thread_abort": thread_abort,
    "comm_lifetimes": comm_lifetimes, "comm_threads": comm_threads,
    "nan_fold": nan_fold, "late_rank": late_rank,
    "lock_timeout": lock_timeout, "gave_up_while_missing": gave_up_while_missing,
    "dp_rank0_state": dp_rank0_state, "dp_two_models": dp_two_models,
    "interrupted": interrupted, "dup_retry": dup_retry, "half_mean": half_mean, "bind_refused": bind_refused,
    "intercomm": intercomm, "dp_names": dp_names,
}


def main(names: list[str]) -> None:
    for name in names:
        t0 = time.perf_counter()
        if name.startswith("data_parallel"):
            per = int(name.split(":", 1)[1]) if ":" in name else 2
            data_parallel(per)
        else:
            SCENARIOS[name]()
        if me == 0:
            report(f"TIME {name} {time.perf_counter() - t0:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
