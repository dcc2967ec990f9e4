"""The reference interpreter against direct numpy, and the catalog's own consistency."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from polyjit.core import dtypes, ir
from polyjit.core.errors import BindingError, DTypeMismatchError, NodeNotInContextError
from polyjit.core.ir import AccumOp, Node, Op, StaticSymbol, Symbol
from polyjit.testing import run_reference
from polyjit.testing.harness import compare, program_rng
from polyjit.testing.programs import catalog

Array = np.ndarray[Any, Any]
rng = np.random.default_rng(0)


def f32(name: str, shape: tuple[int, ...]) -> Node:
    return Node(name, shape, dtypes.float32)


def run1(a: ir.Assignment, env: dict[Node, Array], **kw: Any) -> dict[Node, Array]:
    return run_reference([ir.Comp.of(a)], env, **kw)


def test_matmul_and_batched_matmul() -> None:
    a, b, c = f32("a", (5, 7)), f32("b", (7, 3)), f32("c", (5, 3))
    av, bv = rng.standard_normal(a.shape).astype(np.float32), rng.standard_normal(b.shape).astype(np.float32)
    got = run1(ir.einsum("ik,kj->ij", a, b, into=c), {a: av, b: bv})[c]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, av @ bv, rtol=1e-5, atol=1e-5)
    x, y, z = f32("x", (2, 4, 3)), f32("y", (2, 3, 5)), f32("z", (2, 4, 5))
    xv, yv = rng.standard_normal(x.shape).astype(np.float32), rng.standard_normal(y.shape).astype(np.float32)
    np.testing.assert_allclose(run1(ir.einsum("bik,bkj->bij", x, y, into=z), {x: xv, y: yv})[z], xv @ yv,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("accum,fn", [(AccumOp.ADD, np.sum), (AccumOp.MAX, np.max),
                                      (AccumOp.MIN, np.min), (AccumOp.MUL, np.prod)])
def test_reductions(accum: AccumOp, fn: Any) -> None:
    a = Node("a", (4, 6), dtypes.float64)
    av = rng.uniform(0.5, 1.5, a.shape)
    rows, cols, total = Node("r", (4,), dtypes.float64), Node("c", (6,), dtypes.float64), Node("t", (), dtypes.float64)
    env = {a: av}
    np.testing.assert_allclose(run1(ir.einsum("ij->i", a, into=rows, accum=accum), env)[rows], fn(av, axis=1))
    np.testing.assert_allclose(run1(ir.einsum("ij->j", a, into=cols, accum=accum), env)[cols], fn(av, axis=0))
    np.testing.assert_allclose(run1(ir.einsum("ij->", a, into=total, accum=accum), env)[total], fn(av))


def test_reduction_over_an_empty_axis_is_the_neutral_element() -> None:
    e, s, m = f32("e", (3, 0)), f32("s", (3,)), f32("m", (3,))
    env = {e: np.zeros((3, 0), np.float32)}
    assert (run1(ir.einsum("ij->i", e, into=s), env)[s] == 0).all()
    assert (run1(ir.einsum("ij->i", e, into=m, accum=AccumOp.MAX), env)[m] == -np.inf).all()


def test_broadcasting_and_transposes() -> None:
    a, b, out = f32("a", (3, 1, 5)), f32("b", (4, 1)), f32("o", (3, 4, 5))
    av, bv = rng.standard_normal(a.shape).astype(np.float32), rng.standard_normal(b.shape).astype(np.float32)
    np.testing.assert_array_equal(run1(ir.apply(Op.SUB, a, b, into=out), {a: av, b: bv})[out], av - bv)
    t, tt = f32("t", (2, 3, 4)), f32("tt", (4, 2, 3))
    tv = rng.standard_normal(t.shape).astype(np.float32)
    np.testing.assert_array_equal(run1(ir.einsum("ijk->kij", t, into=tt), {t: tv})[tt], tv.transpose(2, 0, 1))


def test_no_promotion_float32_stays_float32() -> None:
    a, out = f32("a", (1000,)), f32("o", (1000,))
    av = rng.uniform(0.5, 2, a.shape).astype(np.float32)
    got = run1(ir.apply(Op.DIV, a, 3.0, into=out), {a: av})[out]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, av / np.float32(3.0))  # float32 division, not float64 rounded


def test_integer_division_truncates_toward_zero() -> None:
    a, b, q = Node("a", (8,), dtypes.int32), Node("b", (8,), dtypes.int32), Node("q", (8,), dtypes.int32)
    av = np.array([7, -7, 7, -7, 0, 1, -1, 9], np.int32)
    bv = np.array([2, 2, -2, -2, 3, -3, 3, 9], np.int32)
    got = run1(ir.apply(Op.DIV, a, b, into=q), {a: av, b: bv})[q]
    np.testing.assert_array_equal(got, np.trunc(av / bv).astype(np.int32))


def test_uint8_wraps_and_cast_semantics() -> None:
    a, b, s = Node("a", (4,), dtypes.uint8), Node("b", (4,), dtypes.uint8), Node("s", (4,), dtypes.uint8)
    av, bv = np.array([250, 3, 0, 128], np.uint8), np.array([10, 5, 1, 128], np.uint8)
    env = {a: av, b: bv}
    np.testing.assert_array_equal(run1(ir.apply(Op.ADD, a, b, into=s), env)[s], (av.astype(int) + bv) % 256)
    np.testing.assert_array_equal(run1(ir.apply(Op.SUB, a, b, into=s), env)[s], (av.astype(int) - bv) % 256)
    np.testing.assert_array_equal(run1(ir.apply(Op.NEG, a, into=s), env)[s], (-av.astype(int)) % 256)
    x, flags, ints = f32("x", (5,)), Node("f", (5,), dtypes.bool_), Node("i", (5,), dtypes.int32)
    xv = np.array([0.0, -0.0, 0.5, -2.7, 3.9], np.float32)
    np.testing.assert_array_equal(run1(ir.apply(Op.CAST, x, into=flags), {x: xv})[flags], xv != 0)
    np.testing.assert_array_equal(run1(ir.apply(Op.CAST, x, into=ints), {x: xv})[ints], [0, 0, 0, -2, 3])
    s8 = Node("s8", (2,), dtypes.uint8)
    np.testing.assert_array_equal(run1(ir.fill(s8, -1), {})[s8], [255, 255])  # a literal converts like C


def test_unary_math_and_where() -> None:
    x, y = f32("x", (50,)), f32("y", (50,))
    xv = rng.uniform(-3, 3, x.shape).astype(np.float32)
    env = {x: xv}
    np.testing.assert_allclose(run1(ir.apply(Op.SIGMOID, x, into=y), env)[y], 1 / (1 + np.exp(-xv)), rtol=1e-6)
    np.testing.assert_array_equal(run1(ir.apply(Op.RELU, x, into=y), env)[y], np.maximum(xv, 0))
    c = Node("c", (50,), dtypes.bool_)
    cv = xv > 0
    np.testing.assert_array_equal(run1(ir.apply(Op.WHERE, c, x, 1.5, into=y), {x: xv, c: cv})[y],
                                  np.where(cv, xv, np.float32(1.5)))


def test_accumulation_without_init_neutral_adds_onto_the_value() -> None:
    x, acc = f32("x", (3, 4)), f32("acc", (3,))
    xv, accv = rng.standard_normal(x.shape).astype(np.float32), rng.standard_normal(acc.shape).astype(np.float32)
    got = run1(ir.einsum("ij->i", x, into=acc, init_neutral=False), {x: xv, acc: accv})[acc]
    np.testing.assert_allclose(got, accv + xv.sum(axis=1), rtol=1e-6)
    with pytest.raises(NodeNotInContextError):
        run1(ir.einsum("ij->i", x, into=acc, init_neutral=False), {x: xv})


def test_non_injective_and_partial_writes() -> None:
    i, j = Symbol("i"), Symbol("j")
    a, b, c = Node("a", (5,), dtypes.int64), Node("b", (3,), dtypes.int64), Node("c", (7,), dtypes.int64)
    av, bv = rng.integers(-9, 9, a.shape), rng.integers(-9, 9, b.shape)
    conv = ir.Accum(c, AccumOp.ADD, Op.MUL, (a, b), ir.projections([(i, 5), (j, 3)], [ir.affine((1, i), (1, j))], [i], [j]))
    np.testing.assert_array_equal(run1(conv, {a: av, b: bv})[c], np.convolve(av, bv))
    # an assignment over a symbol the lhs does not use: the last write wins
    m, last = Node("m", (4, 6), dtypes.int64), Node("l", (4,), dtypes.int64)
    mv = rng.integers(0, 100, m.shape)
    lw = ir.Accum(last, None, Op.ID, (m,), ir.projections([(i, 4), (j, 6)], [i], [i, j]))
    np.testing.assert_array_equal(run1(lw, {m: mv})[last], mv[:, -1])
    # a write at an offset leaves the other cells as they were
    o = Node("o", (8,), dtypes.int64)
    ov = rng.integers(0, 100, o.shape)
    shift = ir.Accum(o, None, Op.ID, (b,), ir.projections([(i, 3)], [ir.affine((1, i), const=4)], [i]))
    want = ov.copy()
    want[4:7] = bv
    np.testing.assert_array_equal(run1(shift, {o: ov, b: bv})[o], want)
    # a non-surjective accumulation starts every cell from the neutral element
    h = Node("h", (6,), dtypes.int64)
    half = ir.Accum(h, AccumOp.ADD, Op.ID, (b,), ir.projections([(i, 3)], [ir.affine((2, i))], [i]))
    np.testing.assert_array_equal(run1(half, {b: bv, h: ov[:6]})[h], [bv[0], 0, bv[1], 0, bv[2], 0])


def test_fetches_and_static_bindings() -> None:
    r, fl, k = Node("r", (2, 3), dtypes.float64), Node("f", (4,), dtypes.uint8), Node("k", (300,), dtypes.uint8)
    out = run_reference([ir.Comp.of(ir.arange(r), ir.fill(fl, 7), ir.arange(k))], {})
    np.testing.assert_array_equal(out[r], np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(out[fl], [7, 7, 7, 7])
    np.testing.assert_array_equal(out[k], np.arange(300) % 256)
    c = Node("c", (3,), dtypes.int32)
    assert run_reference([ir.Comp.of(ir.constant(c, [1, 2, 3]))], {})[c].tolist() == [1, 2, 3]
    b = StaticSymbol("b", 4)
    src, row = Node("src", (4, 5), dtypes.int32), Node("row", (5,), dtypes.int32)
    sv = np.arange(20, dtype=np.int32).reshape(4, 5)
    comp = ir.Comp.of(ir.slice_at(row, src, ir.affine((1, b))))
    for v in range(4):
        np.testing.assert_array_equal(run_reference([comp], {src: sv}, {b: v})[row], sv[v])
    with pytest.raises(BindingError):
        run_reference([comp], {src: sv})
    with pytest.raises(BindingError):
        run_reference([comp], {src: sv}, {b: 4})
    flat, sq = Node("flat", (20,), dtypes.int32), Node("sq", (5, 4), dtypes.int32)
    res = run_reference([ir.Comp.of(ir.reshape(flat, src), ir.reshape(sq, flat))], {src: sv})
    np.testing.assert_array_equal(res[sq], sv.reshape(5, 4))


def test_merge_reads_and_seq_block() -> None:
    x, y = f32("x", (4,)), f32("y", (4,))
    xv, mv = np.arange(4, dtype=np.float32), np.full(4, 10, np.float32)
    body = ir.Block("sum", ir.Seq((ir.apply(Op.ADD, x, ir.merge(x), into=y), ir.apply(Op.MUL, y, 2.0, into=y))))
    got = run_reference([ir.Comp.of(body)], {x: xv}, merge={x: mv})[y]
    np.testing.assert_array_equal(got, (xv + mv) * 2)
    with pytest.raises(NodeNotInContextError):
        run_reference([ir.Comp.of(body)], {x: xv})


def test_reference_does_not_modify_its_inputs() -> None:
    x = f32("x", (3,))
    xv = np.ones(3, np.float32)
    run1(ir.apply(Op.MUL, x, 2.0, into=x), {x: xv})
    assert (xv == 1).all()


def test_dtype_rules_come_from_the_ir() -> None:
    with pytest.raises(DTypeMismatchError):
        ir.apply(Op.ADD, f32("a", (2,)), Node("b", (2,), dtypes.float64), into=f32("c", (2,)))


def test_compare_messages() -> None:
    a = np.array([1.0, 2.0, 3.0], np.float32)
    assert compare("x", a, a.copy(), 0, 0) is None
    msg = compare("x", a, np.array([1.0, 2.5, 3.0], np.float32), 1e-6, 0)
    assert msg is not None and "1 of 3" in msg and "(1,)" in msg
    assert compare("x", a, a.astype(np.float64), 0, 0) is not None
    assert compare("i", np.array(3), np.array(4), 0, 0) is not None


# -- the catalog --------------------------------------------------------------------------


def test_catalog_names_are_unique_and_inputs_fit() -> None:
    progs = catalog()
    assert len({p.name for p in progs}) == len(progs)
    for p in progs:
        host = p.generate(program_rng(p.name))
        for node, arr in host.items():
            assert arr.shape == node.shape and arr.dtype == node.dtype.np, p.name
        assert p.outputs, p.name


def test_catalog_covers_every_op_on_every_dtype() -> None:
    names = {p.name for p in catalog()}
    for op in ir.Op:
        for dt in dtypes.ALL:
            if op is Op.CAST:
                assert all(f"cast.{dt}_to_{d}" in names for d in dtypes.ALL)
                continue
            try:
                ir.result_dtype(op, [dtypes.bool_] + [dt] * 2 if op is Op.WHERE else [dt] * op.arity, dt)
            except DTypeMismatchError:
                continue
            assert f"elementwise.{op.value}.{dt}" in names, (op, dt)


def test_catalog_reference_values_are_finite() -> None:
    """The input ranges avoid overflow and NaN (the empty-axis MAX is -inf on purpose, and so
    are the results of IEEE's special scalars: a pow of NaN or an infinity, a division by zero,
    the square root of special values)."""
    special = ("reduce.empty_axis", "elementwise.pow_special_scalar.", "elementwise.divide_by_",
               "elementwise.pow_half_specials.")
    for p in catalog():
        state = p.generate(program_rng(p.name))
        for bindings in p.runs:
            state = run_reference(p.comps, state, bindings)
        for node in p.outputs:
            v = state[node]
            if node.dtype.is_float and not p.name.startswith(special):
                assert np.isfinite(v).all(), (p.name, node)


# -- the reference's fast paths (strided views) agree with its general gather/scatter ----------

hypothesis = pytest.importorskip("hypothesis")


@hypothesis.settings(max_examples=int(os.environ.get("REF_EXAMPLES", "150")), deadline=None, database=None)
@hypothesis.given(hypothesis.strategies.data())
def test_strided_views_match_the_general_path(data: Any) -> None:
    from polyjit.core import reference
    from polyjit.testing import strategies

    prog = data.draw(hypothesis.strategies.one_of(
        strategies.affine_programs(), strategies.einsum_programs(), strategies.elementwise_programs()))
    env = prog.generate(program_rng(prog.name, data.draw(hypothesis.strategies.integers(0, 1000))))
    fast = run_reference(prog.comps, env)
    try:
        reference.USE_VIEWS = False
        slow = run_reference(prog.comps, env)
    finally:
        reference.USE_VIEWS = True
    for node in prog.outputs:
        np.testing.assert_array_equal(fast[node], slow[node], err_msg=prog.description)


@pytest.mark.parametrize("backend", ["cpu", "opencl"])
def test_integer_literals_beyond_their_type_wrap_as_c_converts_them(backend: str) -> None:
    """Found by review: the reference raised OverflowError for 2**63 into int64 (the kernels
    wrapped it); a literal the type cannot hold is now wrapped once, for the source and the
    reference alike, so no C literal is out of its type's range either."""
    from polyjit.backends import get_backend

    be = get_backend(backend)
    if be.num_devices() == 0:
        pytest.skip(f"no {backend} device")
    cases = [("int64", 2**63, -(2**63)), ("int64", 2**70 + 5, 5), ("int32", 2**40 + 7, 7),
             ("uint8", 300, 44), ("uint8", -1, 255)]
    nodes = [ir.Node(f"w{k}", (3,), dt) for k, (dt, _, _) in enumerate(cases)]
    comp = ir.Comp.of(*(ir.fill(n, value) for n, (_, value, _) in zip(nodes, cases)))
    want = run_reference([comp], {})
    r = be.get_device(0).make_context().link(be.compile(comp, name="wraps"))
    r.run()
    for n, (dt, value, wrapped) in zip(nodes, cases):
        assert want[n].tolist() == [wrapped] * 3, (dt, value)
        assert r.context.read(n).tolist() == [wrapped] * 3, (dt, value)
    r.context.finalize()
