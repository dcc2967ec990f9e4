"""NaN through max, min and relu, as numpy (and PyTorch) give it: NaN wherever an operand or
a reduced element is NaN, compiled on the CPU and OpenCL and on the reference interpreter.
A kernel's ``a > b ? a : b`` used to turn relu(NaN) into 0, so a model whose first layer
had gone NaN still reported a finite loss."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polyjit import tensor as pt
from polyjit.tensor.reference import evaluate

Array = np.ndarray[Any, Any]
BACKENDS = ["cpu", "opencl"]


def _nan_pattern(draw: st.DrawFn, shape: tuple[int, int]) -> Array:
    x = np.array(draw(st.lists(st.integers(-8, 8), min_size=shape[0] * shape[1], max_size=shape[0] * shape[1])),
                 np.float32).reshape(shape) / 4
    cells = draw(st.lists(st.tuples(st.integers(0, shape[0] - 1), st.integers(0, shape[1] - 1)), max_size=4))
    for c in cells:
        x[c] = np.nan
    return x


@st.composite
def nan_arrays(draw: st.DrawFn) -> tuple[Array, Array]:
    shape = (draw(st.integers(1, 5)), draw(st.integers(1, 70)))
    return _nan_pattern(draw, shape), _nan_pattern(draw, shape)


def _graph(shape: tuple[int, ...]) -> tuple[pt.Tensor, pt.Tensor, dict[str, pt.Tensor]]:
    a, b = pt.input("a", shape), pt.input("b", shape)
    return a, b, {"relu": pt.relu(a), "maximum": pt.maximum(a, b), "minimum": pt.minimum(b, a),
                  "max_rows": pt.max(a, axis=1), "min_cols": pt.min(b, axis=0), "max_all": pt.max(a)}


def _numpy(a: Array, b: Array) -> dict[str, Array]:
    return {"relu": np.maximum(a, 0), "maximum": np.maximum(a, b), "minimum": np.minimum(b, a),
            "max_rows": a.max(axis=1), "min_cols": b.min(axis=0), "max_all": a.max()}


@pytest.mark.parametrize("device", BACKENDS)
@settings(max_examples=15, deadline=None)
@given(ab=nan_arrays())
def test_max_min_relu_keep_nan_as_numpy_does(device: str, ab: tuple[Array, Array]) -> None:
    a, b = ab
    _, _, outs = _graph(a.shape)
    plan = pt.compile(outs, device=device)
    try:
        got = plan.run(a=a, b=b)
    finally:
        plan.close()
    ref = evaluate(outs, {"a": a, "b": b})[0]
    for name, want in _numpy(a, b).items():
        np.testing.assert_array_equal(np.asarray(got[name]), want, err_msg=f"{name} on {device}")
        np.testing.assert_array_equal(np.asarray(ref[name]), want, err_msg=f"{name} on the reference")


def test_a_nan_input_gives_a_nan_loss() -> None:
    """An MLP (its relu in the first product's epilogue) on a batch with one NaN feature: the
    loss is NaN, as PyTorch's is, not a finite number computed past a zeroed NaN."""
    x, y = pt.input("x", (16, 8)), pt.input("y", (16,), "int32")
    model = pt.MLP("nan_mlp", [8, 32, 4], seed=0)
    plan = pt.compile(loss=pt.cross_entropy(model(x), y), optimizer=pt.SGD(0.1))
    xv = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    yv = np.zeros(16, np.int32)
    try:
        assert np.isfinite(plan.step(x=xv, y=yv))
        xv[3, 5] = np.nan
        assert np.isnan(plan.step(x=xv, y=yv))
    finally:
        plan.close()
