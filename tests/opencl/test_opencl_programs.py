"""Programs on the OpenCL backend against numpy: fused chains, reductions, bools, transposes,
static bindings, and the matmul kernels."""

from __future__ import annotations

import numpy as np
import pytest
from opencl_helpers import f32, run_comps

from polyjit.backends.opencl import create_backend
from polyjit.core import dtypes, ir
from polyjit.core.ir import AccumOp, Node, Op, StaticSymbol
from polyjit.core.protocol import MergeBuffer
from polyjit.core.runtime import Backend, device_to_device

pytest.importorskip("pyopencl")


# ---------------------------------------------------------------------------
# Programs against numpy


def test_fused_elementwise_chain(backend: Backend) -> None:
    n = 10_007
    a, b, c, t, u, out = (f32(s, (n,)) for s in ("a", "b", "c", "t", "u", "out"))
    comp = ir.Comp.of(ir.apply(Op.MUL, a, b, into=t), ir.apply(Op.TANH, t, into=u),
                      ir.apply(Op.SUB, u, c, into=out))
    batch = backend.compile_batch([comp], names=["chain"])
    assert len(batch.source.all_kernels) == 1  # fused into one kernel
    rng = np.random.default_rng(0)
    xs = {a: rng.standard_normal(n).astype(np.float32), b: rng.standard_normal(n).astype(np.float32),
          c: rng.standard_normal(n).astype(np.float32)}
    got = run_comps(backend, [comp], xs, [out])[out]
    np.testing.assert_allclose(got, np.tanh(xs[a] * xs[b]) - xs[c], rtol=1e-5, atol=1e-6)


def test_reductions(backend: Backend) -> None:
    rng = np.random.default_rng(1)
    x = f32("x", (33, 129))
    rows, cols, total = f32("rows", (33,)), f32("cols", (129,)), f32("total", ())
    li = Node("li", (9, 17), dtypes.int64)
    lmax, lmin = Node("lmax", (9,), dtypes.int64), Node("lmin", (17,), dtypes.int64)
    comps = [
        ir.Comp.of(ir.einsum("ij->i", x, into=rows)),
        ir.Comp.of(ir.einsum("ij->j", x, into=cols, accum=AccumOp.MAX)),
        ir.Comp.of(ir.einsum("ij->", x, into=total)),  # no parallel nest: one work-item
        ir.Comp.of(ir.einsum("ij->i", li, into=lmax, accum=AccumOp.MAX)),  # INT64_MIN neutral
        ir.Comp.of(ir.einsum("ij->j", li, into=lmin, accum=AccumOp.MIN)),  # INT64_MAX neutral
    ]
    xv = rng.standard_normal((33, 129)).astype(np.float32)
    lv = rng.integers(-(2**62), 2**62, (9, 17), dtype=np.int64)
    got = run_comps(backend, comps, {x: xv, li: lv}, [rows, cols, total, lmax, lmin])
    np.testing.assert_allclose(got[rows], xv.sum(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[cols], xv.max(0))
    np.testing.assert_allclose(got[total], xv.sum(), rtol=1e-4)
    np.testing.assert_array_equal(got[lmax], lv.max(1))
    np.testing.assert_array_equal(got[lmin], lv.min(0))


def test_bools_and_where(backend: Backend) -> None:
    rng = np.random.default_rng(2)
    a, b, r = f32("a", (50,)), f32("b", (50,)), f32("r", (50,))
    m = Node("m", (50,), dtypes.bool_)
    comps = [ir.Comp.of(ir.apply(Op.GT, a, b, into=m), ir.apply(Op.WHERE, m, a, b, into=r),
                        embedded=[m, r])]
    av, bv = rng.standard_normal(50).astype(np.float32), rng.standard_normal(50).astype(np.float32)
    got = run_comps(backend, comps, {a: av, b: bv}, [m, r])
    np.testing.assert_array_equal(got[m], av > bv)
    np.testing.assert_array_equal(got[r], np.maximum(av, bv))


def test_five_dimensional_transpose(backend: Backend) -> None:
    a, t = f32("a", (2, 3, 4, 5, 6)), f32("t", (6, 5, 4, 3, 2))
    av = np.arange(720, dtype=np.float32).reshape(a.shape)
    got = run_comps(backend, [ir.Comp.of(ir.einsum("abcde->edcba", a, into=t))], {a: av}, [t])[t]
    np.testing.assert_array_equal(got, av.transpose(4, 3, 2, 1, 0))


def test_statics_are_bound_at_each_run(backend: Backend) -> None:
    k = StaticSymbol("k", 6)
    src, row = f32("src", (6, 40)), f32("row", (40,))
    code = backend.compile(ir.Comp.of(ir.slice_at(row, src, k)), name="pick")
    sv = np.arange(240, dtype=np.float32).reshape(6, 40)
    ctx = backend.get_device(0).make_context().init_from_host(src, sv)
    r = ctx.link(code)
    for v in (3, 0, 5):
        r.bindings[k] = v
        r.run()
        np.testing.assert_array_equal(r.context.read(row), sv[v])
    ctx.finalize()


def _matmul_backend(variant: str) -> Backend:
    be = create_backend(matmul_variant=variant)
    be.driver.dialect.matmul_min_side = 1  # type: ignore[attr-defined]  # tile even small cases
    be.driver.dialect.matmul_min_work = 0  # type: ignore[attr-defined]
    return be


@pytest.fixture(scope="module", params=["auto", "local", "off"])
def matmul_backend(request: pytest.FixtureRequest, backend: Backend) -> Backend:
    return _matmul_backend(request.param)


MATMUL_CASES = {
    "edges": ("ik,kj->ij", (100, 70), (70, 50)),
    "whole_tiles": ("ik,kj->ij", (64, 32), (32, 128)),
    "transposed_x": ("ki,kj->ij", (37, 45), (37, 29)),
    "batched": ("bik,bkj->bij", (3, 20, 17), (3, 17, 24)),
    "tiny": ("ik,kj->ij", (1 + 2, 5), (5, 9)),
}


@pytest.mark.parametrize("case", sorted(MATMUL_CASES))
def test_matmul(matmul_backend: Backend, case: str) -> None:
    spec, sa, sb = MATMUL_CASES[case]
    rng = np.random.default_rng(3)
    a, b = f32("a", sa), f32("b", sb)
    want_np = np.einsum(spec, np.ones(sa, np.float32), np.ones(sb, np.float32))
    c = f32("c", want_np.shape)
    av, bv = rng.standard_normal(sa).astype(np.float32), rng.standard_normal(sb).astype(np.float32)
    got = run_comps(matmul_backend, [ir.Comp.of(ir.einsum(spec, a, b, into=c))], {a: av, b: bv}, [c])[c]
    np.testing.assert_allclose(got, np.einsum(spec, av, bv), rtol=1e-4, atol=1e-4)


def test_matmul_accumulates_onto_the_context_and_float64(matmul_backend: Backend) -> None:
    rng = np.random.default_rng(4)
    a, b, c = f32("a", (40, 30)), f32("b", (30, 50)), f32("c", (40, 50))
    av, bv = rng.standard_normal((40, 30)).astype(np.float32), rng.standard_normal((30, 50)).astype(np.float32)
    cv = rng.standard_normal((40, 50)).astype(np.float32)
    onto = ir.Comp.of(ir.einsum("ik,kj->ij", a, b, into=c, init_neutral=False))
    got = run_comps(matmul_backend, [onto], {a: av, b: bv, c: cv}, [c])[c]
    np.testing.assert_allclose(got, cv + av @ bv, rtol=1e-4, atol=1e-4)
    if not matmul_backend.get_device(0).properties["fp64"]:
        return
    x, y, z = (Node(n, s, dtypes.float64) for n, s in (("x", (33, 21)), ("y", (21, 19)), ("z", (33, 19))))
    xv, yv = rng.standard_normal((33, 21)), rng.standard_normal((21, 19))
    got = run_comps(matmul_backend, [ir.Comp.of(ir.einsum("ik,kj->ij", x, y, into=z))], {x: xv, y: yv}, [z])[z]
    np.testing.assert_allclose(got, xv @ yv, rtol=1e-12, atol=1e-12)


def test_matmul_with_a_static_index_and_the_merge_buffer(backend: Backend) -> None:
    be = _matmul_backend("auto")
    dev = be.get_device(0)
    rng = np.random.default_rng(5)
    s = StaticSymbol("s", 3)
    stack, w, row_mm = f32("stack", (3, 24, 16)), f32("w", (16, 40)), f32("out", (24, 40))
    sv, wv = rng.standard_normal((3, 24, 16)).astype(np.float32), rng.standard_normal((16, 40)).astype(np.float32)
    # x[i, k] = stack[s, i, k]: the static goes into the tiled kernel's index expressions
    i, j, k = ir.Symbol("i"), ir.Symbol("j"), ir.Symbol("k")
    pr = ir.projections([(i, 24), (j, 40), (k, 16)], [i, j], [s, i, k], [k, j])
    comp = ir.Comp.of(ir.Accum(row_mm, AccumOp.ADD, Op.MUL, (stack, w), pr))
    ctx = dev.make_context().init_from_host(stack, sv).init_from_host(w, wv)
    r = ctx.link(be.compile(comp, name="static_mm"))
    assert "PJ_MATMUL_WG void" in r.source.text
    for v in (2, 0):
        r.bindings[s] = v
        r.run()
        np.testing.assert_allclose(r.context.read(row_mm), sv[v] @ wv, rtol=1e-4, atol=1e-4)
    # the right operand read from the merge buffer of the same device
    mctx = device_to_device(w, dst=ctx, src=ctx, into_merge_buffer=MergeBuffer.COPY)
    assert mctx is not None
    a, out2 = f32("a2", (24, 16)), f32("out2", (24, 40))
    merged = ir.Comp.of(ir.einsum("ik,kj->ij", a, ir.merge(w), into=out2))
    mc = mctx.context.init_from_host(a, sv[1])
    r2 = mc.link(be.compile(merged, name="merge_mm"))
    r2.run()
    np.testing.assert_allclose(r2.context.read(out2), sv[1] @ wv, rtol=1e-4, atol=1e-4)
    ctx.finalize()
