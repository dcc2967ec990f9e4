"""polyjit.tensor ops: forward values against numpy, reverse-mode gradients against finite
differences (float64, on the reference interpreter), and one compiled check on the CPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from polyjit import tensor as pt
from polyjit.core.errors import DTypeMismatchError, ShapeMismatchError, UnsupportedError
from polyjit.core.ir import MemoryMode
from polyjit.tensor import ops
from polyjit.tensor.reference import evaluate

Array = np.ndarray[Any, Any]
Build = Callable[..., pt.Tensor]

LABELS = np.array([0, 2, 1], np.int32)
INDICES = np.array([[0, 2], [1, 1], [2, 0]], np.int32)

# name, build(params...), shapes, positive inputs only
CASES: list[tuple[str, Build, list[tuple[int, ...]], bool]] = [
    ("add_broadcast", lambda a, b: a + b, [(3, 4), (4,)], False),
    ("sub_outer", lambda a, b: a - b, [(3, 1), (1, 4)], False),
    ("mul_column", lambda a, b: a * b, [(3, 4), (3, 1)], False),
    ("div", lambda a, b: a / b, [(3, 4), (4,)], True),
    ("rdiv_scalar", lambda a: 2.0 / a, [(3, 4)], True),
    ("pow_tensor", lambda a, b: a**b, [(3, 4), (4,)], True),
    ("pow_scalar", lambda a: a**3.0, [(3, 4)], False),
    ("neg", lambda a: -a, [(5,)], False),
    ("exp", pt.exp, [(3, 4)], False),
    ("log", pt.log, [(3, 4)], True),
    ("sqrt", pt.sqrt, [(3, 4)], True),
    ("tanh", pt.tanh, [(3, 4)], False),
    ("sigmoid", pt.sigmoid, [(3, 4)], False),
    ("relu", pt.relu, [(3, 4)], False),
    ("abs", pt.abs, [(3, 4)], False),
    ("maximum", pt.maximum, [(3, 4), (3, 4)], False),
    ("minimum_broadcast", pt.minimum, [(3, 4), (4,)], False),
    ("where", lambda a, b: pt.where(a > 0.0, a, b), [(3, 4), (3, 4)], False),
    ("sum_axis", lambda a: pt.sum(a, 1), [(3, 4)], False),
    ("sum_keepdims", lambda a: pt.sum(a, 0, keepdims=True), [(3, 4)], False),
    ("sum_all", lambda a: pt.sum(a), [(3, 4)], False),
    ("mean_axes", lambda a: pt.mean(a, (0, 2)), [(2, 3, 4)], False),
    ("max_axis", lambda a: pt.max(a, 1), [(3, 4)], False),
    ("min_keepdims", lambda a: pt.min(a, 0, keepdims=True), [(3, 4)], False),
    ("matmul", pt.matmul, [(3, 4), (4, 5)], False),
    ("matmul_batched", pt.matmul, [(2, 3, 4), (2, 4, 5)], False),
    ("matmul_stack_by_matrix", pt.matmul, [(2, 3, 4), (4, 5)], False),
    ("matvec", pt.matmul, [(3, 4), (4,)], False),
    ("vecmat", pt.matmul, [(4,), (4, 3)], False),
    ("einsum_dropped_axis", lambda a, b: pt.einsum("ij,jk->k", a, b), [(3, 4), (4, 2)], False),
    ("einsum_diagonal", lambda a: pt.einsum("ii->i", a), [(3, 3)], False),
    ("einsum_trace", lambda a: pt.einsum("ii->", a), [(3, 3)], False),
    ("einsum_diagonal_times", lambda a, b: pt.einsum("iij,k->jk", a, b), [(3, 3, 2), (2,)], False),
    ("einsum_diagonal_summed", lambda a, b: pt.einsum("jii,j->j", a, b), [(2, 3, 3), (2,)], False),
    ("reshape", lambda a: pt.reshape(a, (2, 6)) * 1.5, [(3, 4)], False),
    ("transpose", lambda a: a.T, [(3, 4)], False),
    ("transpose_3d", lambda a: pt.transpose(a, (1, 2, 0)), [(2, 3, 4)], False),
    ("slice_step", lambda a: a[1:, ::2], [(3, 5)], False),
    ("slice_negative_step", lambda a: a[::-1, 2], [(3, 5)], False),
    ("slice_newaxis", lambda a: a[None, :, 1:3], [(3, 5)], False),
    ("concat", lambda a, b: pt.concat([a, b, a], 1), [(3, 2), (3, 4)], False),
    ("broadcast_to", lambda a: pt.broadcast_to(a, (2, 3, 4)), [(3, 1)], False),
    ("softmax", pt.softmax, [(3, 5)], False),
    ("log_softmax", pt.log_softmax, [(3, 5)], False),
    ("cross_entropy", lambda a: pt.cross_entropy(a, pt.constant(LABELS)), [(3, 4)], False),
    ("embedding", lambda t: pt.embedding(pt.constant(INDICES), t), [(3, 4)], False),
    ("take_rows_of_a_3d_table", lambda t: ops.take(t, pt.constant(INDICES)), [(3, 2, 2)], False),
    ("add_rows", lambda v: ops.add_rows(pt.constant(INDICES), v, 4), [(3, 2, 3)], False),
    ("used_twice", lambda a: a * a + pt.exp(a), [(3, 4)], False),
]


def _params(shapes: list[tuple[int, ...]], positive: bool, seed: int) -> list[pt.Tensor]:
    rng = np.random.default_rng(seed)
    out = []
    for k, s in enumerate(shapes):
        v = rng.standard_normal(s)
        out.append(pt.param(f"p{k}", s, init=np.abs(v) + 0.5 if positive else v, dtype="float64"))
    return out


def _loss_of(out: pt.Tensor, seed: int) -> pt.Tensor:
    """sum(out * w) with fixed random weights: every output element gets its own gradient."""
    w = np.random.default_rng(seed + 100).standard_normal(out.shape)
    return pt.sum(out * pt.constant(w, "float64"))


@pytest.mark.parametrize("name,build,shapes,positive", CASES, ids=[c[0] for c in CASES])
def test_gradient_matches_finite_differences(name: str, build: Build, shapes: list[tuple[int, ...]],
                                             positive: bool) -> None:
    params = _params(shapes, positive, seed=len(name))
    loss = _loss_of(build(*params), seed=len(name))
    grads = pt.grad(loss, params)
    got, _ = evaluate({"loss": loss, **{p.name: g for p, g in zip(params, grads)}})
    eps = 1e-6
    for p in params:
        assert p.init is not None
        numeric = np.zeros_like(p.init)
        for idx in np.ndindex(p.init.shape):
            values = {}
            for sign in (1, -1):
                moved = p.init.copy()
                moved[idx] += sign * eps
                values[sign] = evaluate({"loss": loss}, state={p.name: moved})[0]["loss"]
            numeric[idx] = (values[1] - values[-1]) / (2 * eps)
        scale = max(float(np.abs(numeric).max()), 1e-3)
        np.testing.assert_allclose(got[p.name], numeric, atol=1e-6 * scale, rtol=1e-5,
                                   err_msg=f"d loss / d {p.name} for {name}")


def test_gradient_flows_through_casts() -> None:
    a = pt.param("a", (3,), dtype="float64")
    (g,) = pt.grad(pt.sum(pt.cast(pt.cast(a, "float32") * 3.0, "float64")), [a])
    got, _ = evaluate({"g": g})
    assert got["g"].dtype == np.float64
    np.testing.assert_array_equal(got["g"], [3.0, 3.0, 3.0])


def test_grad_of_unused_parameter_is_zero_and_detach_stops_gradients() -> None:
    a, b = pt.param("a", (3,), dtype="float64"), pt.param("b", (3,), dtype="float64")
    loss = pt.sum(a * pt.detach(a) * 2.0)
    ga, gb = pt.grad(loss, [a, b])
    got, _ = evaluate({"ga": ga, "gb": gb})
    assert a.init is not None
    np.testing.assert_allclose(got["ga"], 2.0 * a.init)
    np.testing.assert_array_equal(got["gb"], np.zeros(3))


def test_grad_with_respect_to_an_input_a_constant_and_an_intermediate() -> None:
    """Found by review: with no parameter on the path, every gradient came out 0 (saliency
    maps, adversarial inputs)."""
    x = pt.input("x", (3,), "float64")
    c = pt.constant(np.array([1.0, -2.0, 0.5]), "float64")
    h = x * c
    loss = pt.sum(h * h)
    gx, gc, gh = pt.grad(loss, [x, c, h])
    xv = np.array([1.0, 2.0, 3.0])
    cv = np.array([1.0, -2.0, 0.5])
    got, _ = evaluate({"gx": gx, "gc": gc, "gh": gh}, {"x": xv})
    np.testing.assert_allclose(got["gx"], 2 * xv * cv * cv)
    np.testing.assert_allclose(got["gc"], 2 * cv * xv * xv)
    np.testing.assert_allclose(got["gh"], 2 * xv * cv)
    plan = pt.compile({"gx": gx})
    np.testing.assert_allclose(plan.run(x=xv)["gx"], 2 * xv * cv * cv)
    plan.close()


def _forward(out: pt.Tensor, **inputs: Array) -> Array:
    return evaluate({"out": out}, inputs)[0]["out"]


def test_forward_values_match_numpy() -> None:
    rng = np.random.default_rng(0)
    xv = rng.standard_normal((4, 5)).astype(np.float32)
    yv = rng.standard_normal((5,)).astype(np.float32)
    x, y = pt.input("x", (4, 5)), pt.input("y", (5,))
    checks: list[tuple[pt.Tensor, Array]] = [
        (x * y + 1.0, xv * yv + 1),
        (pt.maximum(x, y), np.maximum(xv, yv)),
        (pt.where(x < y, x, 0.0), np.where(xv < yv, xv, 0)),
        (x.sum(0), xv.sum(0)),
        (x.mean(1, keepdims=True), xv.mean(1, keepdims=True)),
        (x.max(), xv.max()),
        (x.min(1, keepdims=True), xv.min(1, keepdims=True)),  # the methods numpy and torch have
        (abs(x) + x.abs(), 2 * np.abs(xv)),
        (x @ y, xv @ yv),
        (x.T @ x, xv.T @ xv),
        (x[1:3, ::-2], xv[1:3, ::-2]),
        (x[..., 0], xv[..., 0]),
        (x.reshape(2, 10).T, xv.reshape(2, 10).T),
        (pt.concat([x, x[:2]], 0), np.concatenate([xv, xv[:2]], 0)),
        (pt.softmax(x), np.exp(xv) / np.exp(xv).sum(1, keepdims=True)),
    ]
    for out, want in checks:
        np.testing.assert_allclose(_forward(out, x=xv, y=yv), want, rtol=1e-5, atol=1e-6)
    comparisons = [(x < y, xv < yv), (x >= 0.0, xv >= 0), (pt.equal(x, x), xv == xv)]
    for out, want in comparisons:
        got = _forward(out, x=xv, y=yv)
        assert got.dtype == np.bool_
        np.testing.assert_array_equal(got, want)


def test_softmax_and_cross_entropy_are_stable_for_huge_logits() -> None:
    logits = pt.input("logits", (2, 3))
    labels = pt.input("labels", (2,), "int32")
    big = np.array([[1000.0, 0.0, -1000.0], [5000.0, 5001.0, 4999.0]], np.float32)
    out, _ = evaluate({"p": pt.softmax(logits), "ls": pt.log_softmax(logits),
                       "ce": pt.cross_entropy(logits, labels)}, {"logits": big, "labels": [0, 1]})
    assert np.isfinite(out["p"]).all() and np.isfinite(out["ls"]).all()
    z = big.astype(np.float64) - big.max(1, keepdims=True)
    want_ls = z - np.log(np.exp(z).sum(1, keepdims=True))
    np.testing.assert_allclose(out["ls"], want_ls, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["ce"], -(want_ls[0, 0] + want_ls[1, 1]) / 2, rtol=1e-5)


def test_one_hot_and_embedding_gather_rows() -> None:
    idx = pt.input("idx", (2, 3), "int32")
    table = pt.param("table", (5, 4), init="normal")
    iv = np.array([[4, 0, 2], [1, 1, 3]], np.int32)
    out, _ = evaluate({"oh": pt.one_hot(idx, 5), "emb": pt.embedding(idx, table)}, {"idx": iv})
    np.testing.assert_array_equal(out["oh"], np.eye(5, dtype=np.float32)[iv])
    assert table.init is not None
    np.testing.assert_allclose(out["emb"], table.init[iv], rtol=1e-6)


def test_shape_and_dtype_errors_are_raised_when_building() -> None:
    a, b = pt.input("a", (3, 4)), pt.input("b", (5,))
    with pytest.raises(ShapeMismatchError):
        a + b
    with pytest.raises(ShapeMismatchError):
        a @ pt.input("c", (3, 4))
    with pytest.raises(DTypeMismatchError):
        a + pt.input("i", (3, 4), "int32")
    with pytest.raises(ShapeMismatchError):
        a.reshape(5, 3)
    with pytest.raises(UnsupportedError):
        a[pt.input("k", (2,), "int32")]
    with pytest.raises(IndexError):  # as numpy's and torch's (an IndexOutOfRangeError)
        a[3]
    with pytest.raises(TypeError):
        bool(a > 0.0)


def test_param_initialisers() -> None:
    w = pt.param("w", (64, 32), init="glorot")
    assert w.init is not None and w.init.dtype == np.float32
    bound = np.sqrt(6 / 96)
    assert np.abs(w.init).max() <= bound and w.init.std() > bound / 3
    again = pt.param("w", (64, 32), init="glorot")
    assert again.init is not None
    np.testing.assert_array_equal(again.init, w.init)  # values depend on the name only
    assert pt.param("z", (3,), init="zeros").init.tolist() == [0, 0, 0]  # type: ignore[union-attr]
    custom = pt.param("c", (2, 2), init=lambda rng, shape: np.full(shape, 7.0))
    assert custom.init.tolist() == [[7, 7], [7, 7]]  # type: ignore[union-attr]
    with pytest.raises(ShapeMismatchError):
        pt.param("bad", (2, 2), init=np.zeros(3))


def test_compiled_forward_and_gradients_match_the_reference() -> None:
    """Every op of CASES in one float64 plan on the CPU: values and gradients equal the reference."""
    outputs: dict[str, pt.Tensor] = {}
    for name, build, shapes, positive in CASES:
        params = [pt.param(f"{name}.{p.name}", p.shape, init=p.init, dtype="float64")
                  for p in _params(shapes, positive, seed=len(name)) if p.init is not None]
        loss = _loss_of(build(*params), seed=len(name))
        outputs[f"{name}.loss"] = loss
        for p, g in zip(params, pt.grad(loss, params)):
            outputs[f"{p.name}.grad"] = g
    plan = pt.compile(outputs, name="all_ops")
    got = plan.run()
    want, _ = evaluate(outputs)
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-9, atol=1e-10, err_msg=key)
    modes = plan.memory_modes()
    assert MemoryMode.VIRTUAL in modes.values()  # elementwise chains were fused
    plan.close()


def test_relu_gradient_at_zero_and_nan_and_its_place_in_the_epilogue() -> None:
    """relu's gradient masks by its output (out > 0 exactly where x > 0): 0, -0.0 and NaN
    inputs pass no gradient, on the reference and compiled. The pre-activation then has one
    reader: a layer's bias and relu run in its product's epilogue, and it is never stored."""
    x = pt.param("x", (6,), init=np.array([-1.0, -0.0, 0.0, np.nan, 1e-30, 2.0], np.float32))
    (g,) = pt.grad(pt.sum(pt.relu(x) * pt.constant(np.arange(1.0, 7.0, dtype=np.float32))), [x])
    want = np.array([0, 0, 0, 0, 5, 6], np.float32)
    np.testing.assert_array_equal(evaluate({"g": g})[0]["g"], want)
    plan = pt.compile({"g": g})
    np.testing.assert_array_equal(plan.run()["g"], want)
    plan.close()
    a, y = pt.input("a", (24, 20)), pt.input("y", (24,), "int32")
    mlp = pt.MLP("m", [20, 32, 5], seed=0)
    step = pt.compile(loss=pt.cross_entropy(mlp(a), y), optimizer=pt.SGD(0.1)).build()
    comments = [k.comment for k in step.program.batch(step.backend, "compiled").lowered.kernels]
    assert any("add= mul" in c and "relu" in c for c in comments), comments  # x @ w, + b, relu: one kernel
    assert not any(c.startswith("relu") for c in comments), comments
    step.close()


@pytest.mark.parametrize("mode", ["compiled", "dynamic"])
def test_the_mean_of_nothing_is_nan_as_numpys(mode: str) -> None:
    """Found by review: a mean over an empty axis was 0.0 (its sum scaled by 1/max(n, 1))."""
    e, f = pt.input("e", (0,)), pt.input("f", (3, 0))
    plan = pt.compile({"m": pt.mean(e), "rows": pt.mean(f, axis=1), "cols": pt.mean(f, axis=0)}, mode=mode)
    out = plan.run(e=np.zeros(0, np.float32), f=np.zeros((3, 0), np.float32))
    assert np.isnan(out["m"]) and out["rows"].shape == (3,) and np.isnan(out["rows"]).all()
    assert out["cols"].shape == (0,)
    plan.close()


def test_cross_entropy_of_an_empty_batch_and_of_one_row() -> None:
    """The loss picks each row's logit by a gather: an empty batch (nothing to pick) is the
    mean of no rows, NaN, as pt.mean's and torch's (it was 0.0), with an empty gradient; one
    row of logits with a 0-d label is -log softmax at the label."""
    x, y = pt.input("x", (0, 4)), pt.input("y", (0,), "int32")
    w = pt.param("w", (0, 4), init=np.zeros((0, 4), np.float32))
    loss = pt.cross_entropy(x + w, y)
    plan = pt.compile({"l": loss, "g": pt.grad(loss, [w])[0]})
    out = plan.run(x=np.zeros((0, 4), np.float32), y=np.zeros((0,), np.int32))
    assert np.isnan(out["l"]) and out["g"].shape == (0, 4), out
    x1, y1 = pt.input("x1", (4,)), pt.input("y1", (), "int32")
    plan = pt.compile({"l": pt.cross_entropy(x1, y1)})
    xv = np.array([1.0, 2.0, 0.5, -1.0], np.float32)
    got = plan.run(x1=xv, y1=np.array(2, np.int32))["l"]
    np.testing.assert_allclose(got, np.log(np.exp(xv.astype(np.float64)).sum()) - xv[2], rtol=1e-6)


# PyTorch 2's gradients of a**b (float64) on this grid, printed by torch and kept here so the
# test needs no torch: a in (0, -2, 2) (rows) by b in (-1, 0, 0.5, 2) (columns).
_POW_A = (0.0, -2.0, 2.0)
_POW_B = (-1.0, 0.0, 0.5, 2.0)
_TORCH_POW_GA = [[-np.inf, 0.0, np.inf, 0.0], [-0.25, 0.0, np.nan, -4.0], [-0.25, 0.0, 0.3535533905932738, 4.0]]
_TORCH_POW_GB = [[-np.inf, 0.0, 0.0, 0.0], [np.nan] * 4,
                 [0.34657359027997264, 0.6931471805599453, 0.9802581434685472, 2.772588722239781]]


def test_a_literal_half_power_is_sqrt_forward_and_backward() -> None:
    """``x ** 0.5`` is sqrt(x) (numpy's answer: -0.0 at -0.0, NaN at -inf); found by review, its
    gradient still came from C's pow: 0 at -inf where the forward was NaN, +inf at -0.0. Now
    sqrt's (torch's): NaN and -inf. On the reference and the cpu alike."""
    xv = np.array([-np.inf, -0.0, 0.0, 4.0, 9.0, -1.0], np.float32)
    x = pt.param("x", xv.shape, init=xv)
    (gx,) = pt.grad(pt.sum(x**0.5), [x])
    outs = {"y": x**0.5, "gx": gx}
    want_y = np.array([np.nan, -0.0, 0.0, 2.0, 3.0, np.nan], np.float32)
    want_g = np.array([np.nan, -np.inf, np.inf, 0.25, 1 / 6, np.nan], np.float32)
    got_ref, _ = evaluate(outs)
    got_cpu = pt.compile(outs, device="cpu").run()
    for got in (got_ref, got_cpu):
        np.testing.assert_array_equal(got["y"], want_y)
        np.testing.assert_array_equal(np.signbit(got["y"][1:3]), [True, False])
        np.testing.assert_allclose(got["gx"], want_g, rtol=1e-6)


def test_pow_gradients_at_edge_values_match_torch() -> None:
    """Found by review: a scalar base of 0 or below raised a bare ValueError (math.log), and
    d(a**b)/db at a == 0, d(a**0)/da at a == 0 were NaN where torch gives 0."""
    av = np.repeat(_POW_A, len(_POW_B))
    bv = np.tile(_POW_B, len(_POW_A))
    a = pt.param("a", av.shape, init=av, dtype="float64")
    b = pt.param("b", bv.shape, init=bv, dtype="float64")
    ga, gb = pt.grad(pt.sum(a**b), [a, b])
    outs: dict[str, pt.Tensor] = {"ga": ga, "gb": gb}
    for k, base in enumerate(_POW_A):  # a scalar base
        outs[f"base{k}"] = pt.grad(pt.sum(base ** b), [b])[0]
    for k, e in enumerate(_POW_B):  # a scalar exponent
        outs[f"exp{k}"] = pt.grad(pt.sum(a**e), [a])[0]
    got, _ = evaluate(outs)
    with np.errstate(all="ignore"):
        # a ** 0.5 is sqrt (forward and gradient: 0.5 / sqrt(a)), 1 ulp from torch's 0.5 * a ** -0.5
        np.testing.assert_allclose(got["ga"], np.ravel(_TORCH_POW_GA), rtol=2e-16)
        np.testing.assert_array_equal(got["gb"], np.ravel(_TORCH_POW_GB))
        for k in range(len(_POW_A)):
            np.testing.assert_array_equal(got[f"base{k}"], np.tile(_TORCH_POW_GB[k], len(_POW_A)))
        for k in range(len(_POW_B)):
            np.testing.assert_allclose(got[f"exp{k}"], np.repeat(np.asarray(_TORCH_POW_GA)[:, k], len(_POW_B)),
                                       rtol=2e-16)
    plan = pt.compile(outs)  # the CPU kernels give the same values
    run = plan.run()
    for key, want in got.items():
        np.testing.assert_allclose(run[key], want, rtol=1e-12, err_msg=key)
    plan.close()


def test_maximum_and_minimum_split_the_gradient_at_ties_as_torch_and_jax() -> None:
    """Found by the tensor fuzz review: a tie sent the whole gradient to ``a``; PyTorch and JAX
    give each operand half. ``abs`` at 0 keeps gradient 1 (JAX's; PyTorch's is 0)."""
    av, bv = np.array([0.0, 1.0, 3.0, -2.0]), np.array([0.0, 1.0, 5.0, -7.0])
    a = pt.param("tie_a", av.shape, init=av, dtype="float64")
    b = pt.param("tie_b", bv.shape, init=bv, dtype="float64")
    outs: dict[str, pt.Tensor] = {}
    for name, fn in (("max", pt.maximum), ("min", pt.minimum)):
        ga, gb = pt.grad(pt.sum(fn(a, b)), [a, b])
        outs[f"{name}_a"], outs[f"{name}_b"] = ga, gb
    outs["abs"] = pt.grad(pt.sum(abs(a)), [a])[0]
    want = {"max_a": [0.5, 0.5, 0, 1], "max_b": [0.5, 0.5, 1, 0], "min_a": [0.5, 0.5, 1, 0],
            "min_b": [0.5, 0.5, 0, 1], "abs": [1, 1, 1, -1]}
    got, _ = evaluate(outs)
    run = pt.compile(outs).run()
    for key, w in want.items():
        np.testing.assert_array_equal(got[key], w, err_msg=key)
        np.testing.assert_array_equal(run[key], w, err_msg=key)
