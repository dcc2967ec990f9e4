"""CPU backend specifics: device splitting, the GIL, concurrency across devices, statics."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from retry import attempts
from sharing import shared_every_run

from polyjit.backends import get_backend
from polyjit.backends.cpu import create_backend, split_cores
from polyjit.core import dtypes, ir, patterns
from polyjit.core.codegen import KernelSpec
from polyjit.core.runtime import Backend, Routine


def test_split_cores_is_even_and_covers_every_core() -> None:
    assert split_cores([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_cores([0, 1], 4) == [[0], [1], [0], [1]]


def test_env_var_splits_the_machine_into_devices() -> None:
    code = "from polyjit.backends import get_backend; print(get_backend('cpu').num_devices())"
    env = {**os.environ, "POLYJIT_CPU_DEVICES": "3"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "3"


def _slow_routine(backend: Backend, ordinal: int, n: int = 1 << 22, reps: int = 24) -> Routine:
    """A reduction long enough to measure: reps passes over x, summed."""
    x, out = ir.Node("x", (n,), "float64"), ir.Node("out", (), "float64")
    i, k = ir.Symbol("i"), ir.Symbol("k")
    comp = ir.Comp.of(ir.Accum(out, ir.AccumOp.ADD, ir.Op.ID, (x,),
                               ir.projections([(k, reps), (i, n)], [], [i])))
    ctx = backend.get_device(ordinal).make_context().init_from_host(x, np.ones(n, np.float64))
    return ctx.link(backend.compile(comp, name="slow_sum"))


def test_the_gil_is_free_while_a_kernel_runs() -> None:
    backend = get_backend("cpu")
    routine = _slow_routine(backend, 0)
    routine.run()  # warm up (page faults, thread team)
    routine.context.stream.synchronize()
    tries = []
    for _ in attempts():  # on 2 cores the kernel's team (or another process) may preempt this thread
        t0 = time.perf_counter()
        routine.run()
        enqueue = time.perf_counter() - t0
        ev = routine.context.stream.record()
        busy_loops = 0
        while not ev.is_done():  # Python keeps running while the kernel does
            busy_loops += 1
            time.sleep(0.001)
        total = time.perf_counter() - t0
        tries.append((enqueue, total, busy_loops))
        if enqueue < total / 5 and busy_loops > 0:
            break
    else:
        raise AssertionError(f"run() did not return while the kernel ran: (enqueue s, total s, loops) {tries}")
    assert routine.context.read(next(iter(routine.outputs))) == 24 * (1 << 22)


def test_two_devices_compute_at_once() -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    backend = create_backend(num_devices=2)
    r0, r1 = _slow_routine(backend, 0), _slow_routine(backend, 1)
    for r in (r0, r1):
        r.run()
        r.context.stream.synchronize()
    best = float("inf")
    for _ in attempts():  # another process may share the cores: the best ratio until a deadline
        t0 = time.perf_counter()
        r0.run()
        r0.context.stream.synchronize()
        single = time.perf_counter() - t0
        t0 = time.perf_counter()
        r0.run()
        r1.run()
        r0.context.stream.synchronize()
        r1.context.stream.synchronize()
        both = time.perf_counter() - t0
        best = min(best, both / single)
        if best < 1.75:  # sequential would be 2x; on an idle machine this is about 1.05x
            break
    else:
        raise AssertionError(f"two devices took {best:.2f}x one device's time")


def test_static_bindings_are_read_when_run_enqueues() -> None:
    backend = get_backend("cpu")
    table, row = ir.Node("table", (4, 3)), ir.Node("row", (3,))
    b = ir.StaticSymbol("b", 4)
    code = backend.compile(ir.Comp.of(ir.slice_at(row, table, b)), name="pick")
    values = np.arange(12, dtype=np.float32).reshape(4, 3)
    routine = backend.get_device(0).make_context().init_from_host(table, values).link(code)
    seen = []
    for k in (2, 0, 3):
        routine.bindings[b] = k
        routine.run()
        seen.append(routine.context.read(row).copy())
    np.testing.assert_array_equal(np.stack(seen), values[[2, 0, 3]])


def test_streaming_store_kernels_match_numpy_including_the_tail() -> None:
    from polyjit.backends.cpu.dialect import STREAMING_MIN_BYTES

    n = STREAMING_MIN_BYTES // 4 + 5  # past the threshold, and not a whole number of vectors
    backend = get_backend("cpu")
    a, s, out = ir.Node("a", (n,)), ir.Node("s", (1,)), ir.Node("out", (n,))
    code = backend.compile(ir.Comp.of(ir.apply(ir.Op.MUL, a, s, into=out)), name="scale_big")
    from polyjit.backends.cpu.host import host_cpu

    assert "_stream_" in code.source or host_cpu().vector_bytes < 32
    rng = np.random.default_rng(3)
    av, sv = rng.standard_normal(n).astype(np.float32), np.array([1.5], np.float32)
    ctx = backend.get_device(0).make_context().init_from_host(a, av).init_from_host(s, sv)
    routine = ctx.link(code)
    routine.run()
    np.testing.assert_array_equal(routine.context.read(out), av * sv)
    routine.context.finalize()


def test_streaming_tanh_runs_a_vector_at_a_time_and_matches_numpy(tmp_path: Path) -> None:
    """A streamed output's tanh (its blocks, its tail) goes through the vector helper, in C
    that GCC compiles without a warning (a chunk's passes declare only what they read)."""
    from polyjit.backends.cpu.dialect import STREAMING_MIN_BYTES
    from polyjit.backends.cpu.host import host_cpu

    n = STREAMING_MIN_BYTES // 4 + 5
    backend = get_backend("cpu")
    a, out = ir.Node("a", (n,)), ir.Node("out", (n,))
    code = backend.compile(ir.Comp.of(ir.apply(ir.Op.TANH, a, into=out)), name="tanh_big")
    assert "pj_tanh_vf32(" in code.source and ("_stream_" in code.source or host_cpu().vector_bytes < 32)
    (tmp_path / "k.c").write_text(code.source)
    gcc = subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-fPIC", "-std=gnu11", "-Wall", "-c", "-o",
                          str(tmp_path / "k.o"), str(tmp_path / "k.c")], capture_output=True, text=True)
    assert gcc.returncode == 0 and not gcc.stderr.strip(), gcc.stderr[:2000]
    av = np.random.default_rng(8).uniform(-6, 6, n).astype(np.float32)
    routine = backend.get_device(0).make_context().init_from_host(a, av).link(code)
    routine.run()
    np.testing.assert_allclose(routine.context.read(out), np.tanh(av.astype(np.float64)), rtol=3e-7, atol=1e-38)
    routine.context.finalize()


@settings(max_examples=25)
@given(batch=st.integers(0, 2), rows=st.integers(8, 70), cols=st.integers(8, 70),
       dtype=st.sampled_from(["float32", "int32"]), seed=st.integers(0, 2**31))
def test_block_transposes_copy_every_bit(batch: int, rows: int, cols: int, dtype: str, seed: int) -> None:
    """A stored transpose of 4-byte values (the TRANSPOSE shape: 8x8 blocks shuffled in
    registers, blocks cut by the edges copied one by one) matches numpy bit for bit, NaN
    payloads and negative zeros included, with and without batch axes outside."""
    shape = (3,) * batch + (rows, cols)
    outer = "pq"[:batch]
    x, out = ir.Node("x", shape, dtype), ir.Node("out", (3,) * batch + (cols, rows), dtype)
    backend = get_backend("cpu")
    code = backend.compile(ir.Comp.of(ir.einsum(f"{outer}ij->{outer}ji", x, into=out)), name="t")
    assert "pj_transpose8(" in code.source
    bits = np.random.default_rng(seed).integers(0, 2**32, size=shape, dtype=np.uint32)
    xv = bits.view(np.float32 if dtype == "float32" else np.int32)
    ctx = backend.get_device(0).make_context().init_from_host(x, xv)
    routine = ctx.link(code)
    routine.run()
    got = routine.context.read(out)
    np.testing.assert_array_equal(got.view(np.uint32), np.swapaxes(xv, -1, -2).view(np.uint32))
    ctx.finalize()


def test_a_large_transpose_is_shared_among_threads() -> None:
    """Blocks are the range the runtime shares (a 700x900 float32 transpose, edges in both
    axes), whichever threads run it."""
    x, out = ir.Node("x", (700, 900)), ir.Node("out", (900, 700))
    backend = get_backend("cpu")
    code = backend.compile(ir.Comp.of(ir.einsum("ij->ji", x, into=out)), name="big_t")
    assert "pj_transpose8(" in code.source and "pj_it = pj_lo" in code.source
    xv = np.random.default_rng(5).standard_normal((700, 900)).astype(np.float32)
    ctx = backend.get_device(0).make_context().init_from_host(x, xv)
    routine = ctx.link(code)
    for _ in range(3):
        routine.run()
        np.testing.assert_array_equal(routine.context.read(out), xv.T)
    ctx.finalize()


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(0, 2), m=st.integers(16, 90), k=st.integers(2, 40), n=st.integers(2, 15),
       dtype=st.sampled_from(["float32", "float64"]), onto=st.booleans(), seed=st.integers(0, 2**31))
def test_narrow_products_down_the_columns_match_numpy(batch: int, m: int, k: int, n: int, dtype: str,
                                                      onto: bool, seed: int) -> None:
    """``h.T @ dy`` with fewer output columns than a vector (k from 16, where it issues fewer
    FMAs) runs its tiles down the columns (patterns.down_columns; the others along the rows, as
    before): full and masked vectors, batch axes outside, a sum onto the output's values;
    against numpy."""
    lead = (batch,) if batch else ()
    h, dy, g = ir.Node("h", (*lead, k, m), dtype), ir.Node("dy", (*lead, k, n), dtype), ir.Node("g", (*lead, m, n), dtype)
    spec = "bki,bkj->bij" if batch else "ki,kj->ij"
    backend = get_backend("cpu")
    code = backend.compile(ir.Comp.of(ir.einsum(spec, h, dy, into=g, init_neutral=not onto)), name="narrow")
    lanes = backend.driver.dialect.vector_bytes // np.dtype(dtype).itemsize
    (plan,) = [ks.plan for kernel_specs in code.batch.source.kernels for ks in kernel_specs]
    assert ("pj_cell[pj_er][pj_ec];" in code.source) == plan.transposed  # the cells written from the tile
    if plan.transposed:  # where the plan's rules allow it (patterns.column_tiles_pay decides the rest)
        assert n < lanes <= m and k >= patterns.DOWN_COLUMNS_MIN_K
    rng = np.random.default_rng(seed)
    hv, dv, gv = (rng.standard_normal(nd.shape).astype(dtype) for nd in (h, dy, g))
    ctx = backend.get_device(0).make_context().init_from_host(h, hv).init_from_host(dy, dv).init_from_host(g, gv)
    routine = ctx.link(code)
    routine.run()
    want = np.swapaxes(hv.astype(np.float64), -1, -2) @ dv + (gv if onto else 0)
    tol = 1e-5 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(routine.context.read(g), want, rtol=tol, atol=tol * max(1, k))
    ctx.finalize()


def _cross_entropy_logit_grad(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """The summed cross-entropy's gradient in the logits: softmax minus the labels' one-hot."""
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(labels)), labels] -= 1
    return p


def test_a_large_narrow_product_is_shared_among_threads() -> None:
    """Its tiles down the columns are the range the runtime shares (4100 rows: the last tile
    a masked vector), and the epilogue of an optimizer's update runs on each of them."""
    from polyjit import tensor as pt

    dialect = get_backend("cpu").driver.dialect
    lanes = dialect.vector_bytes // 4
    classes = min(10, lanes - 1)  # narrower than a vector of float32 on this host
    vecs = patterns.column_vectors(dialect, classes)
    x, y = pt.input("x", (256, 4100)), pt.input("y", (256,), "int32")
    head = pt.Linear("head", 4100, classes, seed=3)
    plan = pt.compile(loss=pt.cross_entropy(head(x), y), optimizer=pt.SGD(0.01, momentum=0.9))
    assert f"acc[{classes}][{vecs}]" in plan.source  # every column in one tile
    xs = np.random.default_rng(6).standard_normal((256, 4100)).astype(np.float32)
    ys = np.random.default_rng(7).integers(0, classes, 256).astype(np.int32)
    w0 = plan.read(head.weight).copy()
    plan.step(x=xs, y=ys)
    p = _cross_entropy_logit_grad(xs.astype(np.float64) @ w0, ys)  # the bias starts at zero
    grad = xs.T.astype(np.float64) @ (p / 256)
    np.testing.assert_allclose(plan.read(head.weight), w0 - 0.01 * grad, rtol=1e-4, atol=1e-6)  # momentum 0 at first
    plan.close()


@pytest.mark.skipif(shutil.which("clang") is None, reason="clang is not installed")
def test_block_transposes_compile_with_clang(tmp_path: Path) -> None:
    """The shuffles are spelled for GCC and clang alike (``CC=clang``): a transpose kernel
    compiles and matches numpy. Before, GCC's __builtin_shuffle failed to compile there."""
    script = textwrap.dedent("""
        import numpy as np
        from polyjit.backends import get_backend
        from polyjit.core import ir
        x, out = ir.Node("x", (16, 24)), ir.Node("out", (24, 16))
        backend = get_backend("cpu")
        code = backend.compile(ir.Comp.of(ir.einsum("ij->ji", x, into=out)), name="t")
        assert "pj_transpose8(" in code.source
        xv = np.arange(16 * 24, dtype=np.float32).reshape(16, 24)
        ctx = backend.get_device(0).make_context().init_from_host(x, xv)
        routine = ctx.link(code)
        routine.run()
        assert np.array_equal(routine.context.read(out), xv.T)
        print("ok")
    """)
    env = {**os.environ, "CC": "clang", "POLYJIT_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# Panels of y are k * (2 or 4 vectors) * vector bytes: 1000-deep ones lie between
# PACK_MIN_BYTES and PACK_MAX_BYTES on AVX2 (2 vectors of 32 bytes) and AVX-512 hosts (4 of 64)
# alike, 6000-deep ones above, 100-deep ones below. x's are packed where x lies across k
# (tiles.packs_x) and k is PACK_X_MIN_K deep or more.
@pytest.mark.parametrize(("spec", "a_shape", "b_shape", "packed"), [
    ("ik,kj->ij", (64, 1000), (1000, 1024), "y"),  # rows of y a power of two apart
    ("bik,bkj->bij", (2, 20, 1000), (2, 1000, 80), "y"),  # a panel per batch index and column block
    ("ik,kj->ij", (13, 1000), (1000, 64), "y"),  # an edge tile of one row reads the panel too
    ("ik,kj->ij", (6, 1000), (1000, 64), ""),  # one row tile: a panel would be read once
    ("ik,kj->ij", (64, 100), (100, 64), ""),  # a panel under PACK_MIN_BYTES: cached as it is
    ("ik,kj->ij", (12, 6000), (6000, 64), ""),  # a panel over PACK_MAX_BYTES: read in place
    ("ki,kj->ij", (1000, 30), (1000, 72), "x"),  # x transposed; an edge row tile and edge columns
    ("ki,kj->ij", (256, 784), (256, 256), "x"),  # the MLP's weight gradient x.T @ dh
    ("bki,bkj->bij", (2, 300, 20), (2, 300, 72), "x"),  # a panel per batch index and row block (two column tiles of 4 AVX-512 vectors too)
    ("ki,kj->ij", (300, 30), (300, 16), ""),  # one column tile: x's panel would be read once
    ("ki,kj->ij", (100, 30), (100, 72), ""),  # a shallow k: x's lines stay in the L1 cache
])
def test_register_tiles_pack_panels(spec: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...],
                                    packed: str) -> None:
    """Full tiles read y from a panel packed once per (batch, column block) where one panel
    serves several row tiles and is between PACK_MIN_BYTES and PACK_MAX_BYTES, or x from one
    packed once per (batch, row block); products match numpy either way, whichever threads
    share the range."""
    from polyjit.backends.cpu.dialect import CpuDialect
    from polyjit.backends.cpu.tiles import PACK_MAX_BYTES, PACK_MIN_BYTES
    from polyjit.core.patterns import register_vectors
    d = CpuDialect()
    vb = d.vector_bytes
    if vb < 32:
        pytest.skip(f"the cases are sized for 32- and 64-byte vectors; this host has {vb}")
    row = register_vectors(d) * vb  # one k of a panel
    assert PACK_MIN_BYTES < 1000 * row <= PACK_MAX_BYTES < 6000 * row
    assert 100 * row < PACK_MIN_BYTES
    backend = get_backend("cpu")
    a, b = ir.Node("a", a_shape), ir.Node("b", b_shape)
    rng = np.random.default_rng(11)
    av, bv = rng.standard_normal(a_shape).astype(np.float32), rng.standard_normal(b_shape).astype(np.float32)
    want = np.einsum(spec, av, bv)
    out = ir.Node("out", want.shape)
    code = backend.compile(ir.Comp.of(ir.einsum(spec, a, b, into=out)), name="packed")
    assert ("pj_vec (*pj_panel)" in code.source) == (packed == "y"), code.source
    assert ("float (*pj_panel)" in code.source) == (packed == "x"), code.source
    ctx = backend.get_device(0).make_context().init_from_host(a, av).init_from_host(b, bv)
    routine = ctx.link(code)
    for _ in range(3):  # the range shared differently each run (the host thread may join)
        routine.run()
        np.testing.assert_allclose(routine.context.read(out), want, rtol=1e-4, atol=1e-4)
    ctx.finalize()


def test_packed_panels_run_on_threads_with_small_stacks() -> None:
    """A packed panel (256 KiB at most) lives in the runtime's per-thread scratch memory, not
    on the stack of whichever thread runs the kernel's range: a Python thread with a 192 KiB
    stack that waits for the stream, and so runs the kernel itself (on a machine counted as
    busy), computes a 1024-deep matmul. On the stack, this crashed the process."""
    code = textwrap.dedent("""
        import threading
        import numpy as np
        from polyjit import get_backend, ir
        be = get_backend("cpu")
        m, k, n = 64, 1024, 1024
        a, b, o = ir.Node("a", (m, k)), ir.Node("b", (k, n)), ir.Node("o", (m, n))
        compiled = be.compile(ir.Comp.of(ir.einsum("ik,kj->ij", a, b, into=o)), name="deep")
        assert "pj_scratch_fn(" in compiled.source
        rng = np.random.default_rng(0)
        av, bv = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
        r = be.get_device(0).make_context().init_from_host(a, av).init_from_host(b, bv).link(compiled)
        out = []
        def work():
            for _ in range(50):
                r.run()
                r.context.stream.synchronize()
            out.append(np.allclose(r.context.read(o), av @ bv, rtol=1e-3, atol=1e-2))
        threading.stack_size(192 << 10)
        t = threading.Thread(target=work)
        t.start()
        t.join()
        print(out)
    """)
    env = {**os.environ, "POLYJIT_CPU_CONTENTION": "on"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
    assert done.stdout.split() == ["[True]"], done.stdout


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_staged_rows_run_on_threads_with_the_smallest_stack(dtype: str) -> None:
    """Found by review: a staged row reduction (``sum_j exp(x[i, j])``) kept its row in a local
    array of up to 4096 values, 32 KiB of float64, on the stack of the thread that runs it: a
    waiting host thread with Python's smallest stack (32 KiB) crashed the process. The array
    is now at most 16 KiB (STAGED_MAX_BYTES); longer rows are reduced as they come."""
    code = textwrap.dedent(f"""
        import threading
        import numpy as np
        from polyjit import get_backend, ir
        be = get_backend("cpu")
        rows, cols = 64, 4096
        x, e, s = ir.Node("x", (rows, cols), "{dtype}"), ir.Node("e", (rows, cols), "{dtype}"), ir.Node("s", (rows,), "{dtype}")
        compiled = be.compile(ir.Comp.of(ir.apply(ir.Op.EXP, x, into=e), ir.einsum("ij->i", e, into=s)), name="rows")
        xv = np.random.default_rng(0).standard_normal((rows, cols)).astype("{dtype}")
        r = be.get_device(0).make_context().init_from_host(x, xv).link(compiled)
        out = []
        def work():
            for _ in range(20):
                r.run()
                r.context.stream.synchronize()
            out.append(np.allclose(r.context.read(s), np.exp(xv).sum(1), rtol=1e-4))
        threading.stack_size(32 << 10)
        t = threading.Thread(target=work)
        t.start()
        t.join()
        print(out, "pj_vals[" in compiled.source)
    """)
    env = {**os.environ, "POLYJIT_CPU_CONTENTION": "on"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
    assert done.stdout.split() == ["[True]", str(dtype == "float32")], done.stdout  # float32: staged still


@pytest.mark.parametrize(("spec", "a_shape"), [("ik,kj->ij", (64, 1000)), ("ki,kj->ij", (1000, 64))])
def test_packed_tiles_read_in_place_without_scratch_memory(spec: str, a_shape: tuple[int, int]) -> None:
    """A module whose scratch pointer is unset (or a thread out of memory) runs its full
    tiles unpacked, with the same products: y's panels or (x transposed) x's."""
    import ctypes

    from polyjit.backends.cpu.tiles import SCRATCH_FN

    backend = get_backend("cpu")
    a, b, o = ir.Node("a", a_shape), ir.Node("b", (1000, 256)), ir.Node("o", (64, 256))
    code = backend.compile(ir.Comp.of(ir.einsum(spec, a, b, into=o)), name="noscratch")
    assert f"{SCRATCH_FN}(" in code.source
    rng = np.random.default_rng(3)
    av, bv = rng.standard_normal(a_shape).astype(np.float32), rng.standard_normal((1000, 256)).astype(np.float32)
    want = np.einsum(spec, av, bv)
    routine = backend.get_device(0).make_context().init_from_host(a, av).init_from_host(b, bv).link(code)
    slot = ctypes.c_void_p.in_dll(routine._module.handle.lib, SCRATCH_FN)
    assert slot.value  # the driver gave it the runtime's
    slot.value = None
    try:
        routine.run()
        np.testing.assert_allclose(routine.context.read(o), want, rtol=1e-3, atol=1e-3)
    finally:
        slot.value = backend.driver.rt.scratch_address  # type: ignore[attr-defined]
    routine.context.finalize()


def _one_panel() -> tuple[int, int]:
    """(k, n) of a matmul whose y is one panel of the largest size that is packed."""
    from polyjit.backends.cpu.dialect import CpuDialect
    from polyjit.backends.cpu.tiles import PACK_MAX_BYTES
    from polyjit.core.patterns import register_vectors
    d = CpuDialect()
    if d.vector_bytes < 32:
        pytest.skip(f"sized for 32- and 64-byte vectors; this host has {d.vector_bytes}")
    row = register_vectors(d) * d.vector_bytes  # one k of a panel
    return PACK_MAX_BYTES // row, row // 4


class _DirectMatmul(NamedTuple):
    routine: Routine
    spec: KernelSpec
    source: str
    b: ir.Node
    o: ir.Node
    av: np.ndarray
    bv: np.ndarray
    fn: Any  # the kernel as a ctypes function: fn(bufs, statics, lo, hi), any part of its range


def _direct_matmul(m: int, k: int, n: int, seed: int) -> _DirectMatmul:
    """A linked ``a @ b -> o`` routine of an m x k x n float32 matmul on cpu:0 (its stream
    idle), with what a test needs to call its one kernel directly."""
    import ctypes

    backend = get_backend("cpu")
    a, b, o = ir.Node("a", (m, k)), ir.Node("b", (k, n)), ir.Node("o", (m, n))
    code = backend.compile(ir.Comp.of(ir.einsum("ik,kj->ij", a, b, into=o)), name="direct")
    rng = np.random.default_rng(seed)
    av, bv = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    routine = backend.get_device(0).make_context().init_from_host(a, av).init_from_host(b, bv).link(code)
    (spec,) = routine.kernels
    routine.context.stream.synchronize()
    fn = getattr(routine._module.handle.lib, spec.name)
    fn.restype, fn.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    return _DirectMatmul(routine, spec, code.source, b, o, av, bv, fn)


def test_a_grain_reuses_the_panel_an_earlier_grain_of_its_launch_packed() -> None:
    """The scratch tag (runtime.c, t_scratch_tag): a grain that runs while the thread's tag
    names a launch reuses the panel that launch packed on this thread (so y is read from the
    panel, even after y changed: within a launch it cannot); a grain of another launch, or
    called outside a launch (tag 0), packs it again."""
    import ctypes

    from polyjit.backends.cpu.tiles import SCRATCH_TAG_FN

    m, k, n = 48, *_one_panel()  # 8 row tiles of one panel, 3M multiply-adds: a ranged kernel
    routine, spec, source, b, o, av, bv, fn = _direct_matmul(m, k, n, seed=5)
    assert f"{SCRATCH_TAG_FN}()" in source and spec.plan.chunks == 8
    rt = get_backend("cpu").driver.rt  # type: ignore[attr-defined]
    tag_of = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_int64))(rt.scratch_tag_address)
    tag = tag_of()  # this thread's
    ctx = routine.context
    pool, off = ctx.device.pool_handle(ctx.buffers[b].pool_id), ctx.buffers[b].offset
    b_live = np.ctypeslib.as_array(ctypes.cast(pool + off, ctypes.POINTER(ctypes.c_float)), (k, n))
    bufs = routine._prepared.descs[0].bufs
    out = lambda: ctx.read(o)  # noqa: E731
    try:
        tag[0] = 1 << 62  # as if this thread ran grains of launch 2^62
        fn(bufs, None, 0, 4)  # rows 0-23: packs the panel
        b_live += 1  # what no launch sees happen to its y
        fn(bufs, None, 4, 8)  # rows 24-47: the same launch reuses the panel of the old y
        np.testing.assert_allclose(out()[24:], av[24:] @ bv, rtol=1e-4, atol=1e-3)
        tag[0] = (1 << 62) + 1  # another launch packs again
        fn(bufs, None, 4, 8)
        np.testing.assert_allclose(out()[24:], av[24:] @ (bv + 1), rtol=1e-4, atol=1e-3)
        b_live -= 1
        tag[0] = 0  # outside a launch: never reused
        fn(bufs, None, 4, 8)
        np.testing.assert_allclose(out()[24:], av[24:] @ bv, rtol=1e-4, atol=1e-3)
    finally:
        tag[0] = 0
    ctx.finalize()


@pytest.mark.parametrize("m, k, n", [(128, 128, 64), (24, 768, 64)])  # the second packs y's panels
def test_mid_sized_matmuls_match_numpy_shared_or_on_one_thread(m: int, k: int, n: int) -> None:
    """A matmul of 1M multiply-adds is optional to share (KernelPlan.optional): the stream
    runs it shared or as one call over its whole range, picking by timing windows of 2048
    tasks (runtime.c, share_window). Both ways match numpy: the kernel called directly over
    its whole range and in grains, and run through the stream over 8 windows, with the
    inputs changed between batches."""
    from polyjit.backends.cpu.dialect import CpuDialect

    routine, spec, source, b, o, av, bv, fn = _direct_matmul(m, k, n, seed=11)
    assert spec.plan.optional and spec.plan.chunks > 1
    assert ("pj_panel" in source) == (k == 768 and CpuDialect().vector_bytes >= 32)
    ctx, rng = routine.context, np.random.default_rng(12)
    bufs, chunks = routine._prepared.descs[0].bufs, spec.plan.chunks
    for ranges in ([(0, chunks)], [(lo, min(chunks, lo + 3)) for lo in range(0, chunks, 3)]):
        assert ctx.from_host(o, np.zeros((m, n), np.float32))
        ctx.stream.synchronize()
        for lo, hi in ranges:
            fn(bufs, None, lo, hi)
        np.testing.assert_allclose(ctx.read(o), av @ bv, rtol=1e-4, atol=1e-3)
    for _ in range(8):
        bv = rng.standard_normal((k, n)).astype(np.float32)
        assert ctx.from_host(b, bv)
        for _ in range(2048):
            routine.run()
        np.testing.assert_allclose(ctx.read(o), av @ bv, rtol=1e-4, atol=1e-3)
    ctx.finalize()


def test_launches_never_reuse_each_others_panels() -> None:
    """Two matmuls whose panels have the same keys, alternating on one stream with y changed
    between launches, on whichever threads share their ranges (the waiting host thread joins
    them): every product matches numpy, so no grain read a panel another launch packed."""
    backend = get_backend("cpu")
    m, k, n = 96, *_one_panel()  # one panel each: a grain that read the other's would be wrong
    x, w, v = ir.Node("x", (m, k)), ir.Node("w", (k, n)), ir.Node("v", (k, n))
    xw, xv = ir.Node("xw", (m, n)), ir.Node("xv", (m, n))
    code = backend.compile_batch([ir.Comp.of(ir.einsum("ik,kj->ij", x, w, into=xw)),
                                  ir.Comp.of(ir.einsum("ik,kj->ij", x, v, into=xv))], names=["mw", "mv"])
    assert all(spec.plan.chunks > 1 for comp in code.source.kernels for spec in comp)
    rng = np.random.default_rng(9)
    xh = rng.standard_normal((m, k)).astype(np.float32)
    ctx = backend.get_device(0).make_context().init_from_host(x, xh)
    ctx = ctx.init_from_host(w, np.zeros((k, n), np.float32)).init_from_host(v, np.zeros((k, n), np.float32))
    mw, mv = ctx.link_batch(code)
    ctx = mw.context
    for step in range(12):
        wh = rng.standard_normal((k, n)).astype(np.float32)
        vh = rng.standard_normal((k, n)).astype(np.float32)
        ctx.from_host(w, wh)
        mw.run()
        ctx.from_host(v, vh)
        mv.run()
        got_w, got_v = ctx.read(xw), ctx.read(xv)
        np.testing.assert_allclose(got_w, xh @ wh, rtol=1e-4, atol=1e-3, err_msg=f"x @ w, launch {step}")
        np.testing.assert_allclose(got_v, xh @ vh, rtol=1e-4, atol=1e-3, err_msg=f"x @ v, launch {step}")
    ctx.finalize()


@pytest.mark.parametrize("features, classes, prefetched", [(787, 250, True), (40, 16, False)])
def test_a_large_epilogues_rows_are_prefetched(features: int, classes: int, prefetched: bool) -> None:
    """A weight gradient whose momentum and weight span at least tiles.PREFETCH_MIN_BYTES
    prefetches each tile's rows of them (full, edge and masked tiles: 787 rows, 250 columns);
    a small one does not. Two SGD steps with momentum match numpy's."""
    from polyjit import tensor as pt
    from polyjit.backends.cpu.tiles import PREFETCH_MIN_BYTES

    assert (2 * features * classes * 4 >= PREFETCH_MIN_BYTES) == prefetched
    batch, lr, mu = 64, 0.01, 0.9
    x, y = pt.input("x", (batch, features)), pt.input("y", (batch,), "int32")
    layer = pt.Linear("wide", features, classes, seed=4)
    plan = pt.compile(loss=pt.cross_entropy(layer(x), y), optimizer=pt.SGD(lr, momentum=mu))
    assert ("__builtin_prefetch(" in plan.source) == prefetched
    rng = np.random.default_rng(8)
    w, b = plan.read(layer.weight).astype(np.float64), plan.read(layer.bias).astype(np.float64)
    vw, vb = np.zeros_like(w), np.zeros_like(b)
    for _ in range(2):
        xs = rng.standard_normal((batch, features)).astype(np.float32)
        ys = rng.integers(0, classes, batch).astype(np.int32)
        plan.step(x=xs, y=ys)
        p = _cross_entropy_logit_grad(xs.astype(np.float64) @ w + b, ys)
        vw, vb = mu * vw + xs.T.astype(np.float64) @ (p / batch), mu * vb + p.sum(0) / batch
        w, b = w - lr * vw, b - lr * vb
    np.testing.assert_allclose(plan.read(layer.weight), w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(plan.read(layer.bias), b, rtol=1e-4, atol=1e-5)
    plan.close()


@pytest.mark.parametrize("registers", [16, 32])
def test_prefetches_take_every_cache_line_of_a_tiles_row(registers: int) -> None:
    """The catalog's large in-place update (its values are checked on every backend): a
    tile of 2 vectors of float32 prefetches each row's first and last cell; of 4 (32
    registers: 128 bytes a row), a cell a cache line and the last. The tiles still match
    numpy with either width."""
    from polyjit.backends.cpu.dialect import CpuDialect
    from polyjit.backends.cpu.tiles import CACHE_LINE
    from polyjit.testing.programs import by_name

    backend = create_backend()
    dialect = backend.driver.dialect = CpuDialect(vector_registers=registers)  # type: ignore[attr-defined]
    width = patterns.register_vectors(dialect) * dialect.vector_bytes // 4
    p = by_name("epilogue.update_large.float32")
    code = backend.compile(p.comps[0], name=f"pf{registers}")
    step = CACHE_LINE // 4
    cells = {int(c) for c in re.findall(r"pj_j0 \+ (\d+); __builtin_prefetch", code.source)}
    nodes = {node.name: node for node, _ in p.inputs}
    edge = nodes["mom"].shape[-1] % width  # the last tiles' masked columns (244 of them in all)
    assert edge and cells == {*range(0, width, step), width - 1, *range(0, edge, step), edge - 1}
    rng = np.random.default_rng(registers)
    a, d, mom, wt = (rng.standard_normal(nodes[n].shape).astype(np.float32) for n in ("a", "d", "mom", "wt"))
    ctx = backend.get_device(0).make_context()
    for name, value in (("a", a), ("d", d), ("mom", mom), ("wt", wt)):
        ctx = ctx.init_from_host(nodes[name], value)
    routine = ctx.link(code)
    routine.run()
    want_mom = mom + a.T.astype(np.float64) @ d
    np.testing.assert_allclose(routine.context.read(nodes["mom"]), want_mom, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(routine.context.read(nodes["wt"]), wt - want_mom, rtol=1e-5, atol=1e-5)
    routine.context.finalize()


def test_a_transposed_tile_prefetches_nothing() -> None:
    """A head's weight gradient narrower than a vector runs its tiles down the columns
    (plan.transposed), whose rows in memory run along the tile's columns: no prefetches,
    however large its update."""
    from polyjit import tensor as pt
    from polyjit.backends.cpu.tiles import PREFETCH_MIN_BYTES

    dialect = get_backend("cpu").driver.dialect
    classes = min(10, dialect.vector_bytes // 4 - 1)  # narrower than a vector
    x, y = pt.input("x", (256, 5000)), pt.input("y", (256,), "int32")
    head = pt.Linear("head", 5000, classes, seed=3)
    plan = pt.compile(loss=pt.cross_entropy(head(x), y), optimizer=pt.SGD(0.01, momentum=0.9))
    assert 2 * 5000 * classes * 4 >= PREFETCH_MIN_BYTES
    assert f"acc[{classes}][{patterns.column_vectors(dialect, classes)}]" in plan.source  # down the columns
    assert "__builtin_prefetch(" not in plan.source
    plan.close()


@pytest.mark.parametrize("registers", [16, 32])
def test_register_tiles_fit_the_hosts_vector_registers(registers: int) -> None:
    """A tile holds 6 rows x 2 vectors with 16 vector registers, 6 x 4 with 32 (AVX-512, Arm);
    either width computes full, edge and masked tiles, packed or not, as numpy does, whatever
    this host has."""
    from polyjit.backends.cpu.dialect import CpuDialect
    from polyjit.core.patterns import register_vectors

    backend = create_backend()
    dialect = backend.driver.dialect = CpuDialect(vector_registers=registers)  # type: ignore[attr-defined]
    vectors = register_vectors(dialect)
    assert vectors == (4 if registers == 32 else 2)
    rng = np.random.default_rng(5)
    for spec, a_shape, b_shape in [("ik,kj->ij", (50, 300), (300, 150)), ("ki,kj->ij", (600, 40), (600, 130))]:
        a, b = ir.Node("a", a_shape), ir.Node("b", b_shape)
        av, bv = rng.standard_normal(a_shape).astype(np.float32), rng.standard_normal(b_shape).astype(np.float32)
        want = np.einsum(spec, av, bv)
        out = ir.Node("out", want.shape)
        code = backend.compile(ir.Comp.of(ir.einsum(spec, a, b, into=out)), name=f"tiles{registers}")
        assert f"pj_vec acc[6][{vectors}];" in code.source, code.source
        routine = backend.get_device(0).make_context().init_from_host(a, av).init_from_host(b, bv).link(code)
        routine.run()
        np.testing.assert_allclose(routine.context.read(out), want, rtol=1e-4, atol=1e-4)
        routine.context.finalize()


def test_narrow_matmuls_and_column_sums_stay_vectorized() -> None:
    """A 256x10 head is all edge tiles: they run masked vectors, not scalar loops; a column sum
    accumulates rows into a block of outputs. Both match numpy."""
    backend = get_backend("cpu")
    a, w, out = ir.Node("a", (256, 40)), ir.Node("w", (40, 10)), ir.Node("out", (256, 10))
    x, col = ir.Node("x", (37, 300)), ir.Node("col", (300,))
    code = backend.compile_batch([ir.Comp.of(ir.einsum("ik,kj->ij", a, w, into=out)),
                                  ir.Comp.of(ir.einsum("ij->j", x, into=col))], names=["head", "colsum"])
    assert "pj_load_tail_f32(" in code.source.text and "pj_acc[pj_jj]" in code.source.text
    assert "pj_acc += " not in code.source.text  # no scalar dot product per output (the old edge loop)
    rng = np.random.default_rng(5)
    av, wv = rng.standard_normal((256, 40)).astype(np.float32), rng.standard_normal((40, 10)).astype(np.float32)
    xv = rng.standard_normal((37, 300)).astype(np.float32)
    ctx = backend.get_device(0).make_context()
    for node, value in ((a, av), (w, wv), (x, xv)):
        ctx = ctx.init_from_host(node, value)
    head, colsum = ctx.link_batch(code)
    head.run()
    colsum.run()
    np.testing.assert_allclose(head.context.read(out), av @ wv, rtol=1e-5, atol=1e-5)
    in_order = np.zeros(300, np.float32)
    for row in xv:  # the order the kernel sums in: the same bits
        in_order += row
    np.testing.assert_array_equal(colsum.context.read(col), in_order)
    ctx.finalize()


@settings(max_examples=25, deadline=None)
# found in CI: GCC 12 (-O3, AVX2) miscompiled these until the passes took ``omp simd``
@example(outer=1, rows=9, cols=9, accum="add", dtype="int32", seed=0)
@example(outer=1, rows=10, cols=10, accum="add", dtype="int32", seed=1)
@given(outer=st.integers(1, 3), rows=st.integers(2, 11), cols=st.integers(4, 700),
       accum=st.sampled_from(["add", "max", "min", "mul_add"]), dtype=st.sampled_from(["float32", "int32", "int64"]),
       seed=st.integers(0, 99))
def test_column_reductions_take_rows_in_fours_and_keep_each_outputs_order(
        outer: int, rows: int, cols: int, accum: str, dtype: str, seed: int) -> None:
    """The column shape combines COLUMN_ROWS rows a pass over its block of outputs (a
    remainder pass for the rest): each output still folds its rows in order, two reduced
    loops included, so the result has the bits of numpy folding the rows one at a time."""
    backend = get_backend("cpu")
    x, v, col = ir.Node("x", (outer, rows, cols), dtype), ir.Node("v", (rows,), dtype), ir.Node("col", (cols,), dtype)
    op = {"add": ir.AccumOp.ADD, "max": ir.AccumOp.MAX, "min": ir.AccumOp.MIN, "mul_add": ir.AccumOp.ADD}[accum]
    if accum == "mul_add":  # x @ W for one row: a product folded down the columns
        comp = ir.Comp.of(ir.einsum("kij,i->j", x, v, into=col, accum=op))
    else:
        comp = ir.Comp.of(ir.einsum("kij->j", x, into=col, accum=op))
    rng = np.random.default_rng(seed)
    xv = (rng.standard_normal((outer, rows, cols)) * 100).astype(dtype)
    vv = (rng.standard_normal(rows) * 3).astype(dtype)
    ctx = backend.get_device(0).make_context().init_from_host(x, xv).init_from_host(v, vv)
    code = backend.compile(comp, name="cols")
    assert "pj_acc[pj_jj]" in code.source  # the column shape
    routine = ctx.link(code)
    routine.run()
    fold = {"max": np.maximum, "min": np.minimum}.get(accum, np.add)
    want = None
    for k in range(outer):
        for i in range(rows):  # the kernel's order: k, then i
            term = xv[k, i] * vv[i] if accum == "mul_add" else xv[k, i]
            want = term.copy() if want is None and accum != "add" and accum != "mul_add" else fold(
                np.zeros(cols, dtype) if want is None else want, term)
    got = routine.context.read(col)
    if accum == "mul_add" and dtype == "float32":  # the product may fuse into its add (FMA)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3)
    else:
        np.testing.assert_array_equal(got, want)
    ctx.finalize()


def _ulps(got: np.ndarray, exact: np.ndarray) -> float:
    """Largest error in float32 ulps of the exact value, over exact values float32 can hold."""
    held = np.isfinite(exact) & (np.abs(exact) < np.finfo(np.float32).max)
    got, exact = got[held].astype(np.float64), exact[held]
    spacing = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    return float((np.abs(got - exact) / spacing).max())


def test_vectorized_float32_exp_and_tanh_are_within_two_ulps() -> None:
    """The C dialect's own float32 exp/tanh (libm's vectorize no loop): ulps against float64
    numpy, and the special values libm gives."""
    backend = get_backend("cpu")
    n = 1 << 18
    x, t, e = ir.Node("x", (n,)), ir.Node("t", (n,)), ir.Node("e", (n,))
    code = backend.compile_batch([ir.Comp.of(ir.apply(ir.Op.TANH, x, into=t)),
                                  ir.Comp.of(ir.apply(ir.Op.EXP, x, into=e))], names=["tanh32", "exp32"])
    assert "pj_tanh_vf32(" in code.source.text and "pj_exp_vf32(" in code.source.text
    rng = np.random.default_rng(11)
    special = [np.nan, np.inf, -np.inf, 0.0, -0.0, 88.8, -88.0, -120.0, 1e-30, 0.55, -0.55, 9.5]
    xv = np.concatenate([special, rng.uniform(-110, 90, n // 2 - len(special)), rng.uniform(-2, 2, n // 2)])
    xv = xv.astype(np.float32)
    ctx = backend.get_device(0).make_context().init_from_host(x, xv)
    th, ex = ctx.link_batch(code)
    th.run()
    ex.run()
    got_t, got_e = th.context.read(t), th.context.read(e)
    with np.errstate(over="ignore"):
        exact_t, exact_e = np.tanh(xv.astype(np.float64)), np.exp(xv.astype(np.float64))
    assert _ulps(got_t, exact_t) <= 2.0
    normal = exact_e >= np.finfo(np.float32).tiny
    assert _ulps(got_e[normal], exact_e[normal]) <= 1.0
    tiny = exact_e < np.finfo(np.float32).tiny  # subnormal or zero results (not NaN)
    assert np.abs(got_e[tiny] - exact_e[tiny]).max() <= 2 * np.finfo(np.float32).smallest_subnormal
    np.testing.assert_array_equal(got_t[:8], exact_t[:8].astype(np.float32))  # nan, +-1, +-0, -1
    assert np.signbit(got_t[4]) and not np.signbit(got_t[3])
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(got_e[:5], np.exp(xv[:5]))
        assert np.isinf(got_e[5]) and got_e[7] == 0.0
    ctx.finalize()


def test_the_scalar_exp_and_tanh_have_no_undefined_behaviour(tmp_path: Path) -> None:
    """The scalar float32 helpers under UBSan (a float cast out of an int's range is undefined:
    exp's ``(int32_t)n`` of a NaN was), on the values where they clamp, switch or give NaN."""
    from polyjit.backends.cpu import tiles

    cc = shutil.which("gcc")
    if cc is None:
        pytest.skip("gcc is not installed")
    helpers = [ln for _, lines in tiles.FLOAT32_MATH for ln in lines]
    main = textwrap.dedent("""\
        volatile float in[] = {NAN, -NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1e30f, -1e30f, 88.8f,
                               -120.0f, 0.55f, 1e-45f};
        int main(void) {
          for (unsigned i = 0; i < sizeof in / sizeof in[0]; ++i)
            printf("%a %a\\n", (double)pj_exp_f32(in[i]), (double)pj_tanh_f32(in[i]));
          return 0;
        }""")
    src = tmp_path / "math.c"
    src.write_text("\n".join(["#include <math.h>", "#include <stdint.h>", "#include <stdio.h>", *helpers, main]))
    exe = tmp_path / "math"
    subprocess.run([cc, "-O1", "-fsanitize=undefined,float-cast-overflow", "-fno-sanitize-recover=all",
                    str(src), "-o", str(exe), "-lm"], check=True, capture_output=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    rows = [[float.fromhex(v) for v in line.split()] for line in run.stdout.splitlines()]
    assert all(np.isnan(v) for v in rows[0] + rows[1])
    assert rows[2] == [np.inf, 1.0] and rows[3] == [0.0, -1.0] and rows[9][0] == 0.0


def _float32_bits_with_specials(n: int, seed: int) -> np.ndarray:
    """``n`` float32s of random bits (NaNs, infinities and subnormals among them), the values
    where exp and tanh change formula or saturate first."""
    special = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 88.72, 88.73, 89.0,
                        -103.9, -104.0, -110.0, 0.55, -0.55, 0.5499, 10.0, -10.0, 1e-8], np.float32)
    bits = np.random.default_rng(seed).integers(0, 1 << 32, n - len(special), dtype=np.uint64).astype(np.uint32)
    return np.concatenate([special, bits.view(np.float32)])


def test_vector_exp_and_tanh_give_the_scalar_helpers_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop's float32 exp and tanh run a vector at a time (Emitter.lanes: pj_exp_vf32,
    pj_tanh_vf32), also in a chunk's tail and nested; every result is the scalar helpers'
    (which the loop ran before), bit for bit, NaN payloads included (sigmoid's NaNs aside)."""
    from polyjit.backends.cpu.dialect import CpuDialect

    backend = get_backend("cpu")
    n = 4099  # chunks of a vector's lanes and a tail
    x = ir.Node("x", (n,))
    outs = {op: ir.Node(op.value, (n,)) for op in (ir.Op.TANH, ir.Op.EXP, ir.Op.SIGMOID)}
    t, nested = ir.Node("t", (n,)), ir.Node("nested", (n,))
    comps = [ir.Comp.of(ir.apply(op, x, into=out)) for op, out in outs.items()]
    comps.append(ir.Comp.of(ir.apply(ir.Op.EXP, x, into=t), ir.apply(ir.Op.TANH, t, into=nested)))
    xv = _float32_bits_with_specials(n, 5)
    results = []
    for vector in (True, False):
        if not vector:
            monkeypatch.setattr(CpuDialect, "vector_math", lambda self, fn, dt: None)
        code = backend.compile_batch(comps, names=["tanh32", "exp32", "sigmoid32", "nested32"])
        text = code.source.text
        assert ("pj_tanh_vf32(" in text and "pj_lv1[pj_l]" in text) == vector and ("pj_tanh_f32(" in text) != vector
        ctx = backend.get_device(0).make_context().init_from_host(x, xv)
        routines = ctx.link_batch(code)
        for r in routines:
            r.run()
        results.append([routines[-1].context.read(out).view(np.uint32) for out in [*outs.values(), nested]])
        ctx.finalize()
    for op, vec, scalar in zip([*outs, "nested"], *results):
        if op is ir.Op.SIGMOID:  # 1 / (1 + exp(-x)): GCC folds the scalar 1 + -x into 1 - x, so a NaN's sign differs
            np.testing.assert_array_equal(vec.view(np.float32), scalar.view(np.float32))
        else:
            np.testing.assert_array_equal(vec, scalar)


def test_fused_statements_run_their_vector_chunks_in_turn() -> None:
    """tanh(tanh(tanh(a))) into one node, three statements of one kernel: each statement's
    lanes (and the tanh its value needs, staged) run after the one before it wrote them."""
    backend = get_backend("cpu")
    n = 1003
    a, out = ir.Node("a", (n,)), ir.Node("out", (n,))
    chain = ir.Comp.of(*[ir.apply(ir.Op.TANH, a if k == 0 else out, into=out) for k in range(3)], embedded=[out])
    code = backend.compile(chain, name="chain")
    assert "pj_lv0[pj_l]" in code.source
    av = np.linspace(-3, 3, n, dtype=np.float32)
    r = backend.get_device(0).make_context().init_from_host(a, av).link(code)
    r.run()
    np.testing.assert_allclose(r.context.read(out), np.tanh(np.tanh(np.tanh(av))), rtol=2e-6, atol=1e-7)
    r.context.finalize()


# 2047: the longest exp loop that runs whole on one thread (patterns.sharing_work); a shared
# one's ranges keep the lane-by-lane tail
@pytest.mark.parametrize("n", [27, 8 * 3 + 1, 2047])
def test_a_tail_is_the_last_whole_vector_again_only_where_that_changes_nothing(
        monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """A loop's exp over ``n`` elements, not a multiple of a vector's lanes: ``y = exp(x)``
    runs its tail as the last whole vector, some elements a second time (Emitter.lanes: no
    lane-by-lane staging); ``x = exp(x)`` would take exp twice there, and keeps the staged
    tail. Both give the scalar loop's bits."""
    from polyjit.backends.cpu.dialect import CpuDialect

    backend = get_backend("cpu")
    lanes = backend.driver.dialect.vector_bytes // 4
    x, y = ir.Node("x", (n,)), ir.Node("y", (n,))
    comps = [ir.Comp.of(ir.apply(ir.Op.EXP, x, into=y)), ir.Comp.of(ir.apply(ir.Op.EXP, x, into=x, accum=None))]
    xv = _float32_bits_with_specials(n, 7)
    results = []
    for vector in (True, False):
        if not vector:
            monkeypatch.setattr(CpuDialect, "vector_math", lambda self, fn, dt: None)
        code = backend.compile_batch(comps, names=["apart", "inplace"])
        if vector:
            apart, inplace = code.source.text.split("\nvoid inplace")
            assert f"pj_lc = {n - lanes};" in apart and "const int pj_ln" not in apart
            assert "const int pj_ln" in inplace and f"pj_lc = {n - lanes};" not in inplace
        ctx = backend.get_device(0).make_context().init_from_host(x, xv)
        first, second = ctx.link_batch(code)
        first.run()
        second.run()
        results.append([second.context.read(node).view(np.uint32) for node in (y, x)])
        ctx.finalize()
    for vec, scalar in zip(*results):
        np.testing.assert_array_equal(vec, scalar)
    with np.errstate(over="ignore", invalid="ignore"):
        once = np.exp(xv.astype(np.float64)).astype(np.float32)
    finite = np.isfinite(once) & (np.abs(once) > 1e-30)
    np.testing.assert_allclose(results[0][1].view(np.float32)[finite], once[finite], rtol=4e-7)


def test_a_shared_exp_loop_gives_the_bits_of_the_loop_run_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """``y = exp(x)`` over 4099 elements is shared (patterns.sharing_work; optional: while it
    pays), and its threads' grains cut vectors anywhere: each grain's tail runs lane by lane.
    Shared on every run (the stream's tuner off), 20 runs give the bits of the loop run whole."""
    from polyjit.core import patterns

    backend = get_backend("cpu")
    n = 4099
    x, y = ir.Node("x", (n,)), ir.Node("y", (n,))
    comp = ir.Comp.of(ir.apply(ir.Op.EXP, x, into=y))
    xv = _float32_bits_with_specials(n, 11)
    results = []
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(patterns, "COSTLY_OP_WEIGHT", 1)
        code = backend.compile(comp, name="e")
        (spec,) = code.batch.source.all_kernels
        assert (spec.plan.team, spec.plan.optional) == ((1, True) if shared else (0, False))
        assert ("pj_lo;" in code.source) == shared  # the loop starts at its range
        ctx = backend.get_device(0).make_context().init_from_host(x, xv)
        r = ctx.link(code)
        runs = []
        with shared_every_run(ctx.stream.handle):
            for _ in range(20 if shared else 1):
                r.run()
                runs.append(r.context.read(y).view(np.uint32))
        ctx.finalize()
        for run in runs[1:]:
            np.testing.assert_array_equal(run, runs[0])
        results.append(runs[0])
    np.testing.assert_array_equal(results[0], results[1])


def test_which_loops_may_run_iterations_twice() -> None:
    """codegen.repeatable: plain stores of nodes the loop does not read."""
    from polyjit.core.codegen import repeatable
    from polyjit.core.loops import Load, Reduce, Row, Seq, Store

    i = ir.Symbol("i")
    x, y, z = ir.Node("x", (8,)), ir.Node("y", (8,)), ir.Node("z", (8,))
    at = ir.as_affine(i)
    assert repeatable(Store(y, at, Load(x, at)))
    assert repeatable(Seq((Store(y, at, Load(x, at)), Store(z, at, Load(x, at)))))
    assert not repeatable(Store(x, at, Load(x, at)))  # in place
    assert not repeatable(Seq((Store(y, at, Load(x, at)), Store(z, at, Load(y, at)))))  # reads what it stores
    assert not repeatable(Store(y, at, Load(x, at), accum=ir.AccumOp.ADD))
    assert not repeatable(Store(y, at, Load(x, at), accum=ir.AccumOp.MAX))
    k = ir.Symbol("k")
    picked = Row(Load(ir.Node("idx", (8,), dtypes.int32), at), 8, 1)  # a scatter's row, picked by data
    assert not repeatable(Store(y, ir.fixed(0), Load(x, at), row=picked))
    assert not repeatable(Reduce(y, at, ir.AccumOp.ADD, None, ((k, 8),), Load(x, ir.as_affine(k))))


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_a_bool_cast_to_a_float_is_zero_or_one(dtype: str) -> None:
    """``x - float(x > 0)`` (the shape of ``softmax - onehot``): the C spells the cast through
    the bits of 1.0 (tiles.BOOL_TO_FLOAT), which GCC cannot turn into a branch; the values
    are numpy's, NaN's comparison included."""
    backend = get_backend("cpu")
    dt = dtypes.as_dtype(dtype)
    n = 101
    x, pos, one, out = ir.Node("x", (n,), dt), ir.Node("pos", (n,), dtypes.bool_), ir.Node("one", (n,), dt), ir.Node("out", (n,), dt)
    comp = ir.Comp.of(ir.apply(ir.Op.GT, x, 0.0, into=pos), ir.apply(ir.Op.CAST, pos, into=one),
                      ir.apply(ir.Op.SUB, x, one, into=out))
    code = backend.compile(comp, name="onehot")
    assert f"pj_bool_{'f64' if dtype == 'float64' else 'f32'}(" in code.source
    xv = np.concatenate([[np.nan, -0.0, 0.0, np.inf, -np.inf], np.linspace(-3, 3, n - 5)]).astype(dt.np)
    r = backend.get_device(0).make_context().init_from_host(x, xv).link(code)
    r.run()
    with np.errstate(invalid="ignore"):
        expect = xv - (xv > 0).astype(dt.np)
    np.testing.assert_array_equal(r.context.read(out), expect)
    r.context.finalize()


def test_a_guarded_integer_division_may_run_on_every_lane() -> None:
    """``where(b != 0, exp(a / b), 0)`` on int32 a, b: an integer division never traps
    (``pj_div_int32`` gives 0 for a zero divisor), so the exp runs on vectors in a chunk's
    first pass, on every lane, and the ``where`` picks."""
    backend = get_backend("cpu")
    n = 100
    a, b = ir.Node("a", (n,), dtypes.int32), ir.Node("b", (n,), dtypes.int32)
    q, f, e = ir.Node("q", (n,), dtypes.int32), ir.Node("f", (n,)), ir.Node("e", (n,))
    nz, y = ir.Node("nz", (n,), dtypes.bool_), ir.Node("y", (n,))
    comp = ir.Comp.of(ir.apply(ir.Op.DIV, a, b, into=q), ir.apply(ir.Op.CAST, q, into=f),
                      ir.apply(ir.Op.EXP, f, into=e), ir.apply(ir.Op.NE, b, 0, into=nz),
                      ir.apply(ir.Op.WHERE, nz, e, 0.0, into=y))
    code = backend.compile_batch([comp], names=["guarded"])
    assert "pj_div_int32(" in code.source.text and "pj_lv0" in code.source.text
    av = np.arange(n, dtype=np.int32) - 50
    bv = np.where(np.arange(n) % 3 == 0, 0, 7).astype(np.int32)
    ctx = backend.get_device(0).make_context().init_from_host(a, av).init_from_host(b, bv)
    (r,) = ctx.link_batch(code)
    r.run()
    expect = np.where(bv != 0, np.exp((np.fix(av / np.where(bv == 0, 1, bv))).astype(np.float32)), 0.0)
    np.testing.assert_allclose(r.context.read(y), expect, rtol=1e-6)
    ctx.finalize()


def test_row_sums_of_exp_stage_the_values_and_sum_them_in_order() -> None:
    """``sum_j exp(x[i, j])``: exps into a local array (a loop that vectorizes), then an in-order
    sum of it; the kernel equals that sum of the kernel's own exps bit for bit."""
    backend = get_backend("cpu")
    x, e, s = ir.Node("x", (128, 27)), ir.Node("e", (128, 27)), ir.Node("s", (128,))
    exps = ir.Comp.of(ir.apply(ir.Op.EXP, x, into=e))
    tmp = ir.Node("tmp", (128, 27))
    staged = ir.Comp.of(ir.apply(ir.Op.EXP, x, into=tmp), ir.einsum("ij->i", tmp, into=s))
    code = backend.compile_batch([exps, staged], names=["exps", "sumexp"])
    assert "pj_vals[" in code.source.text
    xv = np.random.default_rng(4).uniform(-3, 3, (128, 27)).astype(np.float32)
    ctx = backend.get_device(0).make_context().init_from_host(x, xv)
    r_exps, r_sum = ctx.link_batch(code)
    r_exps.run()
    r_sum.run()
    ev, sv = r_exps.context.read(e), r_sum.context.read(s)
    in_order = np.zeros(128, np.float32)
    for j in range(27):
        in_order += ev[:, j]
    np.testing.assert_array_equal(sv, in_order)
    np.testing.assert_allclose(sv, np.exp(xv.astype(np.float64)).sum(1), rtol=1e-6)
    ctx.finalize()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 vector widths: the host is not x86")
@pytest.mark.parametrize(("vector_bytes", "march"), [(32, "-march=haswell"), (16, "-march=x86-64")])
def test_narrower_vector_units_take_their_own_paths(vector_bytes: int, march: str) -> None:
    """The dialect's AVX2 (lane masks) and SSE (memcpy tails) paths, compiled for those
    targets (this host runs both), on every catalog program with a matmul, reduction or exp."""
    from polyjit.backends.cpu import CpuDriver
    from polyjit.backends.cpu.compiler import CPU_FLAGS, CCompiler
    from polyjit.backends.cpu.dialect import CpuDialect
    from polyjit.testing import catalog, run_programs

    class NarrowDriver(CpuDriver):
        def __init__(self) -> None:
            super().__init__(1)
            self.dialect = CpuDialect(vector_bytes=vector_bytes)
            self.compiler = CCompiler(tuple(march if f.startswith("-march=") else f for f in CPU_FLAGS))

    backend = Backend(NarrowDriver())
    a, b, c = ir.Node("a", (7, 5)), ir.Node("b", (5, 10)), ir.Node("c", (7, 10))
    text = backend.compile(ir.Comp.of(ir.einsum("ik,kj->ij", a, b, into=c)), name="narrow").source
    assert f"vector_size({vector_bytes})" in text and ("_mm256_maskload_ps" in text) == (vector_bytes == 32)
    picked = [p for p in catalog() if any(w in p.name for w in ("matmul", "reduce", "exp", "tanh", "sum"))]
    assert len(picked) > 20
    failures = run_programs(backend, picked)
    assert not failures, "\n\n".join(str(f) for f in failures[:5])


def test_long_full_reductions_split_and_vectorize_even_reading_backwards() -> None:
    """A 2^18 sum is split into partial sums (core/lower.py) whose chunks the C dialect
    vectorizes with omp simd; reading the input backwards (the negative stride that GCC 12
    miscompiles in *ordered* float reductions) gives the same sum as reading it forwards."""
    backend = get_backend("cpu")
    n = 1 << 18
    i = ir.Symbol("i")
    x, fwd, bwd = ir.Node("x", (n,)), ir.Node("fwd", ()), ir.Node("bwd", ())
    forwards = ir.Accum(fwd, ir.AccumOp.ADD, ir.Op.ID, (x,), ir.projections([(i, n)], [], [i]))
    backwards = ir.Accum(bwd, ir.AccumOp.ADD, ir.Op.ID, (x,),
                         ir.projections([(i, n)], [], [ir.affine((-1, i), const=n - 1)]))
    code = backend.compile_batch([ir.Comp.of(forwards), ir.Comp.of(backwards)], names=["fwd", "bwd"])
    assert "omp simd reduction(+:pj_acc)" in code.source.text and "fwd_0_parts" in code.source.text
    xv = np.random.default_rng(8).integers(-8, 9, n).astype(np.float32) / 4  # every partial sum exact
    ctx = backend.get_device(0).make_context().init_from_host(x, xv)
    r_fwd, r_bwd = ctx.link_batch(code)
    r_fwd.run()
    r_bwd.run()
    exact = float(xv.astype(np.float64).sum())
    assert float(r_fwd.context.read(fwd)) == exact and float(r_bwd.context.read(bwd)) == exact
    ctx.finalize()


def test_a_sum_of_prime_length_has_the_same_bits_on_any_number_of_cores() -> None:
    """Found by review: a long sum no divisor splits (2^20 + 1 values) ran as one kernel with an
    OpenMP reduction clause, whose result depended on the team size (the tuner's choice, by
    timing) and on the order its threads finished: other bits on another machine, from run to
    run, and under load. Now it is split into parts and a tail, in an order fixed by its size.
    Each process here sees another number of cores (as a host of that many would)."""
    script = textwrap.dedent("""
        import os, sys
        cores = set(range(int(sys.argv[1])))
        os.sched_getaffinity = lambda pid: cores  # before the backend counts them
        import numpy as np
        from polyjit import get_backend, ir
        n = (1 << 20) + 1
        x, s = ir.Node("x", (n,)), ir.Node("s", ())
        backend = get_backend("cpu")
        r = backend.get_device(0).make_context().init_from_host(
            x, np.random.default_rng(0).standard_normal(n).astype(np.float32)).link(
            backend.compile(ir.Comp.of(ir.einsum("i->", x, into=s)), name="sum"))
        m = ir.Node("m", (64, 4099))  # rows folded in vector lanes (session 35)
        rs = ir.Node("rs", (64,))
        rows = backend.get_device(0).make_context().init_from_host(
            m, np.random.default_rng(1).standard_normal((64, 4099)).astype(np.float32)).link(
            backend.compile(ir.Comp.of(ir.einsum("ij->i", m, into=rs)), name="rows"))
        bits = set()
        for _ in range(50):
            r.run()
            rows.run()
            bits.add(r.context.read(s).tobytes().hex() + rows.context.read(rs).tobytes().hex())
        print(" ".join(sorted(bits)))
    """)
    seen = {cores: subprocess.run([sys.executable, "-c", script, str(cores)], capture_output=True, text=True,
                                  check=True, timeout=300).stdout.split()
            for cores in (1, 2, 4, 7)}
    assert len({bits for runs in seen.values() for bits in runs}) == 1, seen


def test_where_runs_both_values_an_integer_division_too() -> None:
    """A where computes both of its values (GCC 12.2 miscompiled C's ?: with a load on one
    side in a vectorized nest: epilogue.relu_mask in the catalog), an integer division too:
    ``pj_div_<dtype>`` gives 0 for a zero divisor where C's ``/`` trapped."""
    from polyjit.testing.programs import by_name

    backend = get_backend("cpu")
    guarded = backend.compile(by_name("elementwise.where_guards_division.int32.16").comps[0], name="g").source
    body = guarded.split("void g_")[-1]
    assert "pj_where_int32(" in body and "pj_div_int32(" in body
    masked = backend.compile(by_name("epilogue.relu_mask.float32").comps[0], name="m").source
    assert "pj_where_float32(" in masked.split("void m_")[-1]


def test_a_write_reading_its_own_target_compiles_to_the_same_source_again() -> None:
    """The copy a self-reading write reads (lower.py, _read_own_target_first) is one node per
    target: compiling the program again gives the same source, so the compile cache finds it."""
    from polyjit.testing.programs import by_name

    comp = by_name("own_target.transpose_in_place").comps[0]
    backend = get_backend("cpu")
    first = backend.compile(comp, name="t").source
    assert "x_before" in first and backend.compile(comp, name="t").source == first


def test_a_gathers_rows_are_copied_by_a_vectorized_loop_and_match_numpy() -> None:
    """The innermost loop of a parallel nest that only stores is marked ``omp simd`` (GCC 12
    copied a gathered row of 16 floats as 16 scalar moves: 4.5 -> 1.0 us for char_lm's
    embedding); a scatter-add (rows may repeat) and a row sum (a reduction) are not. Rows out
    of range are clamped, as before."""
    backend = get_backend("cpu")
    table, idx, rows = ir.Node("table", (27, 16)), ir.Node("idx", (1024,), "int32"), ir.Node("rows", (1024, 16))
    grad, back = ir.Node("grad", (1024, 16)), ir.Node("back", (27, 16))
    x, sums = ir.Node("x", (64, 27)), ir.Node("sums", (64,))
    code = backend.compile_batch([ir.Comp.of(ir.gather(table, idx, into=rows)),
                                  ir.Comp.of(ir.scatter_add(idx, grad, into=back)),
                                  ir.Comp.of(ir.einsum("ij->i", x, into=sums))], names=["gather", "scatter", "sums"])
    def simd(spec: KernelSpec) -> bool:
        return "#pragma omp simd\n" in code.source.text.split(f"void {spec.name}(")[1].split("\n}\n")[0]

    (gather_k,), (zero_k, scatter_k), (sums_k,) = code.source.kernels
    assert simd(gather_k) and simd(zero_k)
    assert scatter_k.plan.kind == "serial" and not simd(scatter_k)
    assert sums_k.plan.kind == "reduction" and not simd(sums_k)
    rng = np.random.default_rng(3)
    tv = rng.standard_normal((27, 16)).astype(np.float32)
    iv = rng.integers(-3, 30, 1024).astype(np.int32)  # some out of range: clamped into the table
    gv = rng.standard_normal((1024, 16)).astype(np.float32)
    xv = rng.standard_normal((64, 27)).astype(np.float32)
    ctx = backend.get_device(0).make_context()
    for node, value in ((table, tv), (idx, iv), (grad, gv), (x, xv)):
        ctx = ctx.init_from_host(node, value)
    routines = ctx.link_batch(code)
    for r in routines:
        r.run()
    clamped = np.clip(iv, 0, 26)
    np.testing.assert_array_equal(routines[0].context.read(rows), tv[clamped])
    want = np.zeros((27, 16), np.float32)
    np.add.at(want, clamped, gv)
    np.testing.assert_allclose(routines[1].context.read(back), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(routines[2].context.read(sums), xv.sum(1), rtol=1e-5, atol=1e-5)
    ctx.finalize()


def test_a_device_count_below_one_or_not_a_number_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: a bare ValueError (the demo's --devices 0 ended in its traceback)."""
    from polyjit.core.errors import BackendUnavailableError

    for bad in (0, -1, 1.5, True):
        with pytest.raises(BackendUnavailableError, match="at least 1 device"):
            create_backend(num_devices=bad)  # type: ignore[arg-type]
    monkeypatch.setenv("POLYJIT_CPU_DEVICES", "two")
    with pytest.raises(BackendUnavailableError, match="whole number, got 'two'"):
        create_backend()


_ARM_CORE = """processor\t: {n}
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid{extra}
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x{variant}
CPU part\t: 0x{part}
CPU revision\t: 1
"""


def test_arm_hosts_are_told_apart_by_their_cores() -> None:
    """Found by the cache review: the host's digest (in every kernel's cache key, since kernels
    are built with -march=native) read only x86's "model name" and "flags", so every Arm host
    had the same one and a cache copied between two would load code for the other's CPU."""
    from polyjit.backends.cpu.host import parse_cpuinfo

    a72 = parse_cpuinfo(_ARM_CORE.format(n=0, extra="", variant="0", part="d08"))
    n1 = parse_cpuinfo(_ARM_CORE.format(n=0, extra=" asimddp sve", variant="3", part="d0c"))
    big_little = parse_cpuinfo(_ARM_CORE.format(n=0, extra="", variant="0", part="d03")
                               + "\n" + _ARM_CORE.format(n=1, extra="", variant="0", part="d08"))
    digests = {a72.digest, n1.digest, big_little.digest}
    assert len(digests) == 3 and "asimd" in a72.flags and "CPU part 0xd0c" in n1.model
    x86 = parse_cpuinfo("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2\n")
    assert x86.model == "AMD EPYC" and x86.flags == {"fpu", "sse2", "avx2"}
