"""Constant folding (core/folding.py): uniform float constants become literals in the
assignments that read them, bit for bit what the kernels would have computed; what cannot be
folded keeps its node. The catalog's ``fold.*`` programs check the values against the
reference on every backend; here, what is folded, what is kept, exact values over generated
chains, and the cross-entropy gradient this is for."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from catalog_check import backend_or_skip, kernel_comments
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from polyjit.core import dtypes, ir
from polyjit.core.folding import fold_constants
from polyjit.core.ir import MemoryMode, Node, Op
from polyjit.core.reference import run_reference


def _writers(comp: ir.Comp) -> list[str]:
    return [ir.writes(leaf).name for leaf in comp.leaves()]


@pytest.mark.parametrize("backend", ["cpu", "opencl"])
def test_a_filled_seed_and_its_scaled_copies_leave_no_kernel(backend: str) -> None:
    comments = kernel_comments(backend, "fold.constants.float32")
    assert len(comments) == 2, comments  # exp of a fill (kept), and the three readers as one
    assert not any(name in c for c in comments for name in ("seed#", "k1#", "k2#", "zero#", "r#"))
    assert any("e#" in c and "exp" in c for c in comments)


def test_what_folding_leaves_alone() -> None:
    """An embedded node, a node written twice, a node explicitly stored, a non-uniform fetch
    and an op that is not exactly rounded keep their writers; a node read through a reshape
    keeps its writer, while the Accums that read it take the literal."""
    dt = dtypes.float32
    x, y = Node("x", (4,), dt), Node("y", (4,), dt)
    kept = Node("kept", (), dt, MemoryMode.ON_DEVICE)
    twice, ranged, e = Node("twice", (), dt), Node("ranged", (4,), dt), Node("e", (), dt)
    viewed, view = Node("viewed", (2, 2), dt), Node("view", (4,), dt)
    out = Node("out", (4,), dt)
    comp = ir.Comp.of(
        ir.fill(kept, 2.0), ir.fill(twice, 1.0), ir.apply(Op.ADD, twice, 1.0, into=twice), ir.arange(ranged),
        ir.fill(e, 1.0), ir.apply(Op.EXP, e, into=e), ir.fill(viewed, 3.0), ir.reshape(view, viewed),
        ir.apply(Op.MUL, x, kept, into=y),
        ir.apply(Op.ADD, y, twice, into=y), ir.apply(Op.ADD, y, ranged, into=y), ir.apply(Op.ADD, y, e, into=y),
        ir.apply(Op.ADD, y, view, into=y), ir.apply(Op.MUL, y, view, into=out),
        embedded=[kept, y, out],
    )
    (folded,) = fold_constants([comp])
    assert {"kept", "twice", "ranged", "e", "viewed", "view"} <= set(_writers(folded))


def test_the_readers_of_a_node_read_through_a_reshape_take_the_literal_too() -> None:
    dt = dtypes.float32
    x, out, other = Node("x", (4,), dt), Node("out", (4,), dt), Node("other", (4,), dt)
    c, view = Node("c", (2, 2), dt), Node("view", (4,), dt)
    comp = ir.Comp.of(ir.fill(c, 3.0), ir.reshape(view, c), ir.apply(Op.ADD, x, view, into=out),
                      ir.apply(Op.MUL, x, view, into=other))
    (folded,) = fold_constants([comp])
    assert "c" in _writers(folded)  # the reshape still reads it
    host = {x: np.arange(4, dtype=np.float32)}
    assert all(np.array_equal(run_reference([comp], host)[n], run_reference([folded], host)[n]) for n in (out, other))


def test_a_partly_written_node_is_not_uniform() -> None:
    """Only a writer that reaches every cell makes a node one value: a fill of row 0 alone
    leaves the rest to what was there."""
    dt = dtypes.float32
    c, x, out = Node("c", (2, 3), dt), Node("x", (2, 3), dt), Node("out", (2, 3), dt)
    j = ir.Symbol("j")
    row0 = ir.Accum(c, None, Op.ID, (1.0,), ir.projections([(j, 3)], [0, j]))
    comp = ir.Comp.of(row0, ir.apply(Op.ADD, x, c, into=out))
    (folded,) = fold_constants([comp])
    assert folded is comp


_FOLDABLE = [Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MAX, Op.MIN, Op.NEG, Op.ABS, Op.SQRT, Op.ID]


@st.composite
def _chains(draw: st.DrawFn) -> tuple[str, float, list[tuple[Op, float]]]:
    dt = draw(st.sampled_from(["float32", "float64", "float16", "bfloat16"]))
    finite = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)
    start = draw(finite)
    steps = draw(st.lists(st.tuples(st.sampled_from(_FOLDABLE), finite), min_size=1, max_size=6))
    return dt, start, steps


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_chains())
@example(("float32", -1.0, [(Op.SQRT, 0.0)]))  # a negative NaN
@example(("bfloat16", 0.0, [(Op.DIV, 0.0)]))  # 0/0 in a half type
@example(("float32", 0.0, [(Op.SUB, 1.0), (Op.SQRT, 0.0), (Op.MUL, -0.0), (Op.NEG, 0.0)]))
@example(("float16", 60000.0, [(Op.MUL, 4.0), (Op.DIV, -0.0)]))  # overflow to inf, then -inf
def test_folded_chains_are_bit_for_bit_what_the_kernels_compute(chain: tuple[str, float, list[tuple[Op, float]]]) -> None:
    """A fill, then a chain of exactly rounded ops with literals (divisions by zero, sqrts of
    negatives), read broadcast: folded, the CPU's results equal the reference's bit for bit,
    signed zeros, infinities and NaNs included (a NaN is not folded: its sign is the op's)."""
    dt_name, start, steps = chain
    dt = dtypes.as_dtype(dt_name)
    x, out = Node("x", (3, 5), dt), Node("out", (3, 5), dt)
    nodes = [Node("c0", (), dt)]
    assigns: list[ir.Assignment] = [ir.fill(nodes[0], start)]
    for k, (op, v) in enumerate(steps, 1):
        nodes.append(Node(f"c{k}", (), dt))
        args = (nodes[-2],) if op.arity == 1 else (nodes[-2], v)
        assigns.append(ir.apply(op, *args, into=nodes[-1]))
    assigns.append(ir.apply(Op.ADD, x, nodes[-1], into=out))
    comp = ir.Comp.of(*assigns)
    host = np.linspace(-2, 2, 15, dtype=np.float32).reshape(3, 5).astype(dt.np)
    ref = run_reference([comp], {x: host})
    nan = [k for k, n in enumerate(nodes) if np.isnan(np.asarray(ref[n], np.float64))]
    kept = [n.name for n in nodes[nan[0]:]] if nan else []  # from the first NaN on: nodes
    assert _writers(fold_constants([comp])[0]) == [*kept, "out"]
    # unfolded: the same chain from a seed the context keeps (so none of it is uniform)
    stored = [attrs.evolve(assigns[0], node=nodes[0].with_mode(MemoryMode.ON_DEVICE))]
    unfolded = ir.Comp.of(*stored, *(_renamed(a, nodes[0], stored[0].node) for a in assigns[1:]))
    got, plain = _run_cpu([comp, unfolded], x, out, host)
    np.testing.assert_array_equal(got.view(np.uint8), plain.view(np.uint8))
    # NaNs equal, whatever their sign (float32: numpy's testing does not see bfloat16's NaNs)
    np.testing.assert_array_equal(got.astype(np.float32), np.asarray(ref[out]).astype(np.float32))


def _renamed(a: ir.Assignment, old: Node, new: Node) -> ir.Assignment:
    assert isinstance(a, ir.Accum)
    return attrs.evolve(a, rhs=tuple(new if x is old else x for x in a.rhs))


def _run_cpu(comps: list[ir.Comp], x: Node, out: Node, host: np.ndarray) -> list[np.ndarray]:
    """``out`` after each of ``comps``, from ``x`` = ``host``, on the CPU (one compile)."""
    backend = backend_or_skip("cpu")
    code = backend.compile_batch(comps, names=[f"fold{k}" for k in range(len(comps))])
    results = []
    with backend.get_device(0).make_context() as ctx:
        for routine in ctx.init_from_host(x, host).link_batch(code):
            routine.run()
            results.append(routine.context.read(out))
    return results


def test_the_cross_entropy_gradient_runs_in_the_log_softmax_kernel() -> None:
    """Autodiff seeds the loss's gradient with a filled 1; the mean's 1/B scale of it is now a
    literal, so the gradient joins the row group that computes the log-softmax it reads."""
    from polyjit import tensor as pt

    x, y = pt.input("x", (16, 12)), pt.input("y", (16,), "int32")
    mlp = pt.MLP("fold_mlp", [12, 5], seed=0)
    plan = pt.compile(loss=pt.cross_entropy(mlp(x), y), optimizer=pt.SGD(0.1), device="cpu")
    batch = plan.program.batch(plan.backend, "compiled")
    comments = [k.comment for k in batch.lowered.kernels]
    (row,) = [c for c in comments if "log#" in c]
    grad = row.split("; ")[-1]  # the gradient: (softmax - one-hot) * (1/B), a kernel of its own before
    assert grad.startswith("mul#") and grad.endswith("= mul"), comments
    assert grad not in comments and not any("seed#" in c for c in comments), comments
    rng = np.random.default_rng(0)
    xs, ys = rng.standard_normal((16, 12)).astype(np.float32), rng.integers(0, 5, 16).astype(np.int32)
    losses = [plan.step(x=xs, y=ys) for _ in range(30)]
    assert losses[-1] < losses[0] * 0.7


def _run_batch(comps: list[ir.Comp], inputs: dict[Node, np.ndarray], outputs: list[Node],
               backend: str = "cpu") -> dict[Node, np.ndarray]:
    be = backend_or_skip(backend)
    batch = be.compile_batch(comps, names=[f"c{k}" for k in range(len(comps))])
    with be.get_device(0).make_context() as root:
        ctx = root
        for n, a in inputs.items():
            ctx = ctx.init_from_host(n, a)
        routines = ctx.link_batch(batch)
        for r in routines:
            r.run()
        last = routines[-1].context if routines else ctx
        return {n: np.array(last.read(n)) for n in outputs}


@pytest.mark.parametrize("backend", ["cpu", "opencl"])
def test_a_node_another_computation_of_the_batch_uses_keeps_its_writer(backend: str) -> None:
    """Found by review: folded in one computation, the fill was dropped while the next read it
    (NodeNotInContextError); and a fill of a node another computation embeds was folded away,
    leaving the other computation's value in the context."""
    dt = dtypes.float32
    x, k, y, z = Node("x", (4,), dt), Node("k", (), dt), Node("y", (4,), dt), Node("z", (4,), dt)
    a = ir.Comp.of(ir.fill(k, 3.0), ir.apply(Op.MUL, x, k, into=y))
    b = ir.Comp.of(ir.apply(Op.ADD, x, k, into=z))
    host = {x: np.arange(4, dtype=np.float32)}
    got = _run_batch([a, b], host, [y, z], backend)
    np.testing.assert_array_equal(got[z], np.arange(4, dtype=np.float32) + 3)
    first = ir.Comp.of(ir.fill(k, 5.0))  # k is this computation's result
    second = ir.Comp.of(ir.fill(k, 3.0), ir.apply(Op.MUL, x, k, into=y))
    assert _writers(fold_constants([first, second])[1]) == ["k", "y"]
    np.testing.assert_array_equal(_run_batch([first, second], host, [k], backend)[k], np.float32(3.0))


@pytest.mark.parametrize("backend", ["cpu", "opencl"])
def test_a_folded_node_the_context_holds_is_refused_at_link_as_an_inlined_one_is(backend: str) -> None:
    """Found by review: a filled intermediate the context holds was folded away, so its
    buffer kept the old value where the reference writes the fill; an inlined one is refused
    at link (never stored), and a folded one now is too. Marked MATERIALIZED, it is stored."""
    from polyjit.core.errors import InvalidProgramError

    be = backend_or_skip(backend)
    x, s, y = Node("x", (4,)), Node("s", (4,)), Node("y", (4,))
    host = {x: np.arange(4, dtype=np.float32), s: np.full(4, 7, np.float32)}
    ctx = be.get_device(0).make_context()
    for n, a in host.items():
        ctx = ctx.init_from_host(n, a)
    with pytest.raises(InvalidProgramError, match=r"s#\d+.*never storing it.*holds s#"):
        ctx.link(be.compile(ir.Comp.of(ir.fill(s, 1.0), ir.apply(Op.ADD, s, x, into=y)), name="folds_s"))
    kept = Node("s", (4,), mode=MemoryMode.MATERIALIZED)
    ctx = ctx.init_from_host(kept, host[s])
    r = ctx.link(be.compile(ir.Comp.of(ir.fill(kept, 1.0), ir.apply(Op.ADD, kept, x, into=y)), name="keeps_s"))
    r.run()
    np.testing.assert_array_equal(r.context.read(kept), np.ones(4, np.float32))
    np.testing.assert_array_equal(r.context.read(y), np.arange(4, dtype=np.float32) + 1)
    r.context.finalize()


def test_a_write_over_an_empty_space_is_not_a_constant() -> None:
    """Found by review: an Accum over a product space with an extent of 0 writes no cell."""
    dt = dtypes.float32
    c, x, y = Node("c", (4,), dt), Node("x", (4,), dt), Node("y", (4,), dt)
    i, j = ir.Symbol("i"), ir.Symbol("j")
    empty = ir.Accum(c, None, Op.ID, (2.0,), ir.projections([(i, 4), (j, 0)], [i]))
    comp = ir.Comp.of(empty, ir.apply(Op.ADD, x, c, into=y))
    assert fold_constants([comp])[0] is comp


@pytest.mark.parametrize("backend", ["cpu", "opencl"])
def test_negative_folded_values_compile_under_neg_and_sigmoid(backend: str) -> None:
    """Found by review: NEG and SIGMOID spelled their operand's minus sign next to a negative
    literal's (``--0.5f``: a decrement, which does not compile)."""
    dt = dtypes.float32
    seed, k, y, s = Node("seed", (), dt), Node("k", (), dt), Node("y", (4,), dt), Node("s", (4,), dt)
    x = Node("x", (4,), dt)
    neg = ir.Accum(y, None, Op.NEG, (k,), ir.projections([(ir.Symbol("i"), 4)], [ir.Symbol("i")], []))
    comp = ir.Comp.of(ir.fill(seed, 1.0), ir.apply(Op.MUL, seed, -0.5, into=k), neg,
                      ir.apply(Op.SIGMOID, k, into=s), embedded=[y, s])
    assert _writers(fold_constants([comp])[0]) == ["y", "s"]
    got = _run_batch([comp], {x: np.zeros(4, np.float32)}, [y, s], backend)
    np.testing.assert_array_equal(got[y], np.full(4, 0.5, np.float32))
    np.testing.assert_allclose(got[s], 1 / (1 + np.exp(0.5)), rtol=1e-6)


@pytest.mark.parametrize("backend", ["cpu", "opencl"])
def test_a_filled_operand_of_a_contraction_stays_a_node(backend: str) -> None:
    """Only elementwise readers take literals: a matmul by a filled matrix (autodiff's
    ``ones @ W.T``) keeps its tiles and the order of its sums (found by review: folded, the
    einsum became a sum of products by a literal, its cells a different rounding)."""
    dt = dtypes.float32
    w, a, c = Node("w", (64, 64), dt), Node("a", (64, 64), dt), Node("c", (64, 64), dt)
    comp = ir.Comp.of(ir.fill(w, 0.1), ir.einsum("ik,kj->ij", a, w, into=c))
    assert _writers(fold_constants([comp])[0]) == ["w", "c"]
    host = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    got = _run_batch([comp], {a: host}, [c], backend)[c]
    np.testing.assert_allclose(got, host @ np.full((64, 64), np.float32(0.1)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "opencl"])
@pytest.mark.parametrize(("value", "dtype", "expected"), [
    (300.5, dtypes.uint8, 44), (-1.5, dtypes.uint8, 255), (3e9, dtypes.int64, 3_000_000_000), (7.9, dtypes.int32, 7)])
def test_a_filled_float_cast_to_an_integer_compiles_and_casts(backend: str, value: float, dtype: dtypes.DType,
                                                             expected: int) -> None:
    """Found by review: folding put the fill's value into the cast as a literal, which takes the
    integer dtype of the cast's node, so 300.5 (which casts to uint8 as 44) failed to compile
    with a ValueRangeError about a scalar the program never had. The cast keeps its node."""
    f, r = Node("f", (4,), dtypes.float32), Node("r", (4,), dtype)
    comp = ir.Comp.of(ir.fill(f, value), ir.apply(Op.CAST, f, into=r))
    assert run_reference([comp], {})[r].tolist() == [expected] * 4
    assert _run_batch([comp], {}, [r], backend)[r].tolist() == [expected] * 4


@pytest.mark.parametrize("backend", ["cpu", "opencl"])
def test_a_negative_nan_keeps_its_sign(backend: str) -> None:
    """Found by review: a fill of -NaN was folded (the docs say a NaN never is) into a literal
    that has no sign, so ``-f`` gave a negative NaN where numpy and the reference give a positive
    one. A NaN fill stays a node, and a negative NaN literal is spelled with its sign."""
    dt = dtypes.float32
    f, y, g = Node("f", (4,), dt), Node("y", (4,), dt), Node("g", (4,), dt, MemoryMode.ON_DEVICE)
    comp = ir.Comp.of(ir.fill(f, -np.nan), ir.apply(Op.NEG, f, into=y), ir.fill(g, -np.nan))
    assert "f" in _writers(fold_constants([comp])[0])
    got = _run_batch([comp], {}, [y, g], backend)
    assert np.isnan(got[y]).all() and not np.signbit(got[y]).any()
    assert np.isnan(got[g]).all() and np.signbit(got[g]).all()


def test_a_float32_literal_beyond_its_range_is_infinity() -> None:
    """1e40 is finite as a double and infinite as a float32: the literal is INFINITY (it was
    ``inff``, which does not compile)."""
    from polyjit.core.codegen import Dialect

    assert Dialect().float_literal(1e40, dtypes.float32) == "INFINITY"
    assert Dialect().float_literal(-1e40, dtypes.float32) == "(-INFINITY)"
    assert Dialect().float_literal(1e40, dtypes.float64) == "1e+40"
