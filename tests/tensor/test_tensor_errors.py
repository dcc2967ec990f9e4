"""Misuse of the tensor front end raises a typed PolyjitError naming what is wrong, checked on the
host before anything reaches the device, and the plan stays usable: the same plan object runs
again with good input."""

from __future__ import annotations

import re
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import polyjit
from polyjit import tensor as pt
from polyjit.backends.cpu import create_backend
from polyjit.core import errors
from polyjit.core.errors import (
    DTypeMismatchError,
    FinalizedError,
    IndexOutOfRangeError,
    InvalidArgumentError,
    InvalidProgramError,
    PolyjitError,
    ShapeMismatchError,
    StateDictKeyError,
    SymbolicTensorError,
    UnknownDeviceError,
    ValueRangeError,
)
from polyjit.core.runtime import Backend

Array = np.ndarray[Any, Any]
B, C = 12, 3  # batch (splits over 1, 2 and 3 devices), classes


@pytest.fixture(scope="module")
def two_devices() -> Backend:
    return create_backend(num_devices=2)


def _data(seed: int = 0) -> tuple[Array, Array]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(B, 2)).astype(np.float32), rng.integers(0, C, B).astype(np.int32)


def _same(a: dict[str, Array], b: dict[str, Array]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_error_classes_derive_from_the_expected_builtins() -> None:
    assert issubclass(IndexOutOfRangeError, PolyjitError) and issubclass(IndexOutOfRangeError, IndexError)
    assert issubclass(ValueRangeError, ValueError) and issubclass(SymbolicTensorError, TypeError)
    assert issubclass(StateDictKeyError, KeyError)
    assert str(StateDictKeyError("no 'w'")) == "no 'w'"  # not KeyError's repr
    for name in ("IndexOutOfRangeError", "ValueRangeError", "SymbolicTensorError", "StateDictKeyError"):
        assert name in polyjit.__all__ and getattr(polyjit, name) is getattr(errors, name)


# -- 1. class labels and indices out of range -------------------------------------------------


@pytest.mark.parametrize("mode", ["compiled", "dynamic"])
def test_cross_entropy_labels_out_of_range_are_refused_before_the_step(mode: str) -> None:
    x, y = pt.input("x", (B, 2)), pt.input("y", (B,), "int32")
    mlp = pt.MLP("mlp", [2, 8, C], seed=1)
    plan = pt.compile(loss=pt.cross_entropy(mlp(x), y), optimizer=pt.Adam(0.01), mode=mode)  # type: ignore[arg-type]
    xs, ys = _data()
    before = plan.state_dict()
    for bad, value in ((5, C), (7, 5), (2, -1)):
        labels = ys.copy()
        labels[bad] = value
        with pytest.raises(IndexOutOfRangeError, match=rf"input 'y'.*value {value} at index \({bad},\).*"
                                                       rf"cross_entropy labels over {C} classes \(valid: 0\.\.2\)"):
            plan.step(x=xs, y=labels)
        with pytest.raises(IndexOutOfRangeError):  # a list goes through the staging array: checked too
            plan.step(x=xs, y=labels.tolist())
    _same(plan.state_dict(), before)  # nothing ran: no update, no Adam step
    assert plan.runs == 0
    loss = plan.step(x=xs, y=ys)
    assert np.isfinite(loss) and loss > 0.1
    assert plan.state_dict()["adam.step"] == 1.0
    plan.close()


@pytest.mark.parametrize("dtype", ["int32", "int64", "uint8"])
def test_index_extremes_are_refused_and_edges_accepted(dtype: str) -> None:
    """The check reads the indices once, as unsigned: the most negative value of the dtype,
    -1, the depth and the largest value are refused (those the dtype has); 0 and depth - 1
    pass."""
    idx = pt.input("idx", (4,), dtype)
    plan = pt.compile({"hot": pt.one_hot(idx, 5)})
    info = np.iinfo(dtype)
    for value in sorted({v for v in (info.min, -1, 5, info.max) if info.min <= v and not 0 <= v < 5}):
        arr = np.array([0, 4, value, 1], dtype)
        with pytest.raises(IndexOutOfRangeError, match=rf"value {value} at index \(2,\).*one_hot of depth 5"):
            plan.run(idx=arr)
    out = plan.run(idx=np.array([0, 4, 4, 0], dtype))
    np.testing.assert_array_equal(out["hot"], np.eye(5, dtype=np.float32)[[0, 4, 4, 0]])
    plan.close()


def test_one_hot_and_embedding_indices_out_of_range() -> None:
    idx = pt.input("idx", (2, 3), "int64")
    tokens = pt.input("tokens", (2, 3), "int32")
    table = pt.param("table", (5, 2), init=np.arange(10.0).reshape(5, 2))
    plan = pt.compile({"hot": pt.one_hot(idx, 4), "emb": pt.embedding(tokens.reshape(-1), table)})
    good_idx = np.array([[0, 1, 2], [3, 0, 1]])
    good_tok = np.array([[4, 0, 1], [2, 3, 4]], np.int32)
    with pytest.raises(IndexOutOfRangeError, match=r"input 'idx'.*value 4 at index \(1, 2\).*one_hot of depth 4"):
        plan.run(idx=np.array([[0, 1, 2], [3, 0, 4]]), tokens=good_tok)
    # through a reshape: the table has 5 rows
    with pytest.raises(IndexOutOfRangeError, match=r"input 'tokens'.*value -3 at index \(0, 1\).*"
                                                   r"embedding of a vocabulary of 5 \(valid: 0\.\.4\)"):
        plan.run(idx=good_idx, tokens=np.array([[4, -3, 1], [2, 3, 4]], np.int32))
    with pytest.raises(IndexOutOfRangeError, match="vocabulary of 5"):
        plan.run(idx=good_idx, tokens=np.full((2, 3), 5, np.int32))
    out = plan.run(idx=good_idx, tokens=good_tok)
    np.testing.assert_array_equal(out["hot"], np.eye(4, dtype=np.float32)[good_idx])
    np.testing.assert_array_equal(out["emb"], np.arange(10.0).reshape(5, 2)[good_tok.ravel()])
    plan.close()


def test_indices_computed_on_the_device_are_not_checked_on_the_host() -> None:
    y = pt.input("y", (4,), "int32")
    plan = pt.compile({"hot": pt.one_hot(y[1:], 3)})  # a slice: y[0] is not an index
    out = plan.run(y=np.array([-1, 0, 1, 2], np.int32))
    np.testing.assert_array_equal(out["hot"], np.eye(3, dtype=np.float32))
    plan.close()


@pytest.mark.parametrize("n", [1, 2], ids=["one_device", "two_devices"])
def test_data_parallel_labels_out_of_range_are_refused_on_every_replica(two_devices: Backend, n: int) -> None:
    mlp = pt.MLP("mlp", [2, 8, C], seed=2)
    dp = pt.data_parallel(lambda x, y: pt.cross_entropy(mlp(x), y),
                          {"x": ((B, 2), "float32"), "y": ((B,), "int32")},
                          optimizer=pt.SGD(0.1, momentum=0.9),
                          devices=two_devices.devices()[:n] if n > 1 else "cpu:0")
    xs, ys = _data(1)
    before = [dp.state_dict(k) for k in range(n)]
    labels = ys.copy()
    labels[B - 1] = C  # in the last shard: reported at its global row
    with pytest.raises(IndexOutOfRangeError, match=rf"input 'y'.*value {C} at index \({B - 1},\)"):
        dp.step(x=xs, y=labels)
    labels[B - 1] = -2
    with pytest.raises(IndexOutOfRangeError, match=r"value -2"):
        dp.step(x=xs, y=labels)
    with pytest.raises(ShapeMismatchError, match=r"input 'x'.*got shape \(12, 1\), expected \(12, 2\)"):
        dp.step(x=xs[:, :1], y=ys)
    for k in range(n):
        _same(dp.state_dict(k), before[k])
    assert dp.steps == 0
    loss = dp.step(x=xs, y=ys)
    assert np.isfinite(loss) and loss > 0.1
    assert dp.replica_spread() == 0.0
    for bad in (n, True, "0"):  # True was replica 1
        with pytest.raises(UnknownDeviceError, match=f"{n} replicas"):
            dp.state_dict(bad)  # type: ignore[arg-type]
    dp.close()


# -- 2. values that do not fit the input's dtype ------------------------------------------------


def test_input_values_that_do_not_fit_the_dtype_are_refused_not_wrapped() -> None:
    small = pt.input("small", (3,), "uint8")
    count = pt.input("count", (3,), "int32")
    plan = pt.compile({"sum": pt.cast(small, "int32") + count})
    zeros = np.zeros(3, np.int32)
    for value, pattern in (
        (np.array([1, 300, 2], np.int64), r"input 'small' \(uint8, shape \(3,\)\): value 300 at index \(1,\) "
                                          r"does not fit uint8 \(0\.\.255\)"),
        (np.array([-1, 0, 0], np.int64), r"value -1 at index \(0,\) does not fit uint8"),
        ([0, 1, 256], r"value 256 at index \(2,\)"),
        (np.array([1.0, 2.5, 3.0]), r"value 2\.5 at index \(1,\) is not an integer"),
        (np.array([1.0, np.nan, 3.0]), r"NaN at index \(1,\)"),
        (np.array([1.0, np.inf, 3.0]), r"value inf at index \(1,\) does not fit"),
    ):
        with pytest.raises(ValueRangeError, match=pattern):
            plan.run(small=value, count=zeros)
    with pytest.raises(ValueRangeError, match=r"input 'count'.*1099511627776 at index \(0,\) does not fit int32"):
        plan.run(small=np.zeros(3, np.uint8), count=np.array([2**40, 0, 0], np.int64))
    with pytest.raises(DTypeMismatchError, match=r"input 'count'.*complex128"):
        plan.run(small=np.zeros(3, np.uint8), count=np.ones(3, np.complex128))
    with pytest.raises(ShapeMismatchError, match=r"input 'count'.*got shape \(4,\)"):
        plan.run(small=np.zeros(3, np.uint8), count=np.zeros(4, np.int32))
    # Accepted: in-range integers of any integer dtype (a list too), integral floats.
    out = plan.run(small=np.array([0, 255, 7], np.int64), count=np.array([1.0, -2.0, 3.0]))
    np.testing.assert_array_equal(out["sum"], [1, 253, 10])
    out = plan.run(small=[1, 2, 3], count=np.array([2**31 - 4, -(2**31), 0], np.int64))  # int32's limits
    np.testing.assert_array_equal(out["sum"], [2**31 - 3, -(2**31) + 2, 3])
    plan.close()


def test_float_values_too_large_for_the_dtype_are_refused_not_turned_into_inf() -> None:
    """Found by review: 1e300 into a float32 input became inf (numpy warned, nothing else), and
    one step made every parameter NaN; 70000 into a float16 input, without even a warning."""
    x = pt.input("x", (3,))
    h = pt.input("h", (2,), "float16")
    w = pt.param("w", (3,), init="ones")
    plan = pt.compile(loss=pt.sum(x * w) + pt.sum(pt.cast(h, "float32")), optimizer=pt.SGD(0.1))
    good = {"x": np.ones(3), "h": np.ones(2, np.float32)}
    for bad, pattern in (
        ({"x": np.array([1.0, 1e300, 2.0])}, r"input 'x' \(float32, shape \(3,\)\): value 1e\+300 at index \(1,\) "
                                             r"does not fit float32 \(largest finite: 3\.40282e\+38\)"),
        ({"x": [-1e39, 0.0, 0.0]}, r"value -1e\+39 at index \(0,\)"),
        ({"h": np.array([70000.0, 1.0], np.float32)}, r"input 'h' \(float16.*value 70000\.0 at index \(0,\) "
                                                      r"does not fit float16 \(largest finite: 65504\)"),
        ({"h": np.array([1, 65535], np.int64)}, r"value 65535 at index \(1,\)"),  # rounds to 65536
        ({"x": [2**200, 1, 1]}, r"does not fit float32"),  # a Python int beyond 64 bits
    ):
        with pytest.raises(ValueRangeError, match=pattern):
            plan.step(**{**good, **bad})
    with pytest.raises(ValueRangeError, match=r"parameter 'w'.*value 1e\+300"):
        plan.load_state_dict({"w": np.array([1.0, 1e300, 1.0])})
    with pytest.raises(ValueRangeError, match=r"initial value of 'v'.*value 1e\+300"):
        pt.param("v", (2,), init=np.array([0.0, 1e300]))
    with pytest.raises(ValueRangeError, match=r"initial value of state 's'.*value 1e\+40"):
        pt.state("s", np.array([1e40]), "float32")
    assert plan.step(**good) == 3.0 + 2.0  # nothing was written: the plan is as it was
    # Accepted: what is infinite already, and values that round to the largest finite
    out = plan.step(x=np.array([np.inf, 0.0, 0.0]), h=np.array([65519.0, 0.0]))
    assert out == np.inf
    plan.close()


def test_python_integers_beyond_64_bits_are_refused_by_value() -> None:
    """numpy makes an object array of them; they were refused as 'object values'."""
    x = pt.input("x", (3,), "int32")
    plan = pt.compile({"y": x * 2})
    for value, shown in (([2**70, 1, 2], 2**70), ([1, -(2**70), 2], -(2**70)), ([2**64, 2**63, -1], 2**64)):
        with pytest.raises(ValueRangeError, match=rf"input 'x' \(int32, shape \(3,\)\): value {shown} at index"):
            plan.run(x=value)
    np.testing.assert_array_equal(plan.run(x=[1, 2, 3])["y"], [2, 4, 6])
    # in range, as pandas hands them (found by the second review: a bare StopIteration)
    np.testing.assert_array_equal(plan.run(x=np.array([1, 2, 3], dtype=object))["y"], [2, 4, 6])
    np.testing.assert_array_equal(plan.run(x=np.array([1, 2.0, True], dtype=object))["y"], [2, 4, 2])
    with pytest.raises(ValueRangeError, match=r"value 2\.5 at index"):
        plan.run(x=np.array([1, 2.5, 2**70], dtype=object)[:2].tolist() + [3])
    f = pt.input("f", (2,))
    floats = pt.compile({"g": f * 2.0})
    with pytest.raises(ValueRangeError, match=r"input 'f'.*at index \(0,\) does not fit float32 \(nor float64\)"):
        floats.run(f=[2**1100, 1])  # beyond float64 itself: was a bare OverflowError
    np.testing.assert_array_equal(floats.run(f=np.array([1, 2**70], dtype=object))["g"], [2.0, 2.0**71])
    floats.close()
    plan.close()


def test_object_arrays_convert_exactly_and_the_users_float_errors_are_left_alone() -> None:
    """Found by the third review: an object array holding a float went through float64, so
    2**53 + 1 became 2**53; bools in an object array were refused for a bool input; under the
    user's np.seterr(all="raise") an underflow (1e-300 into float32) was taken for an
    overflow, with no index."""
    n = pt.input("n", (2,), "int64")
    b = pt.input("b", (2,), "bool")
    f = pt.input("f", (2,))
    plan = pt.compile({"n2": n + 0, "b2": pt.where(b, 1.0, 0.0), "f2": f * 1.0})
    good = {"n": np.array([2**53 + 1, 1.0], dtype=object), "b": np.array([True, False], dtype=object),
            "f": np.array([1e-300, 2.0])}
    with np.errstate(all="raise"):
        out = plan.run(**good)
    assert out["n2"].tolist() == [2**53 + 1, 1] and out["b2"].tolist() == [1.0, 0.0]
    assert out["f2"].tolist() == [0.0, 2.0]
    with pytest.raises(ValueRangeError, match=r"value 1\.5 at index \(1,\) is not an integer"):
        plan.run(**{**good, "n": np.array([2**60, 1.5], dtype=object)})
    plan.close()


def test_initial_values_are_converted_as_inputs_are() -> None:
    """Found by the second review: bfloat16 sources and Python ints skipped the overflow
    check (inf accepted), and 2**1100 raised a bare OverflowError."""
    with pytest.raises(ValueRangeError, match=r"initial value of 'h'.*does not fit float16"):
        pt.param("h", (1,), init=np.array([1e5], ml_dtypes.bfloat16), dtype="float16")
    with pytest.raises(ValueRangeError, match=r"initial value of state 's'.*does not fit float32"):
        pt.state("s", [2**200], "float32")
    with pytest.raises(ValueRangeError, match=r"initial value of state 't'.*nor float64"):
        pt.state("t", [2**1100], "float32")
    assert pt.state("u", [1, 2], "float32").init.tolist() == [1.0, 2.0]


def test_scalars_that_do_not_fit_the_tensor_dtype_are_refused() -> None:
    a = pt.input("a", (2,), "int32")
    u = pt.input("u", (2,), "uint8")
    with pytest.raises(ValueRangeError, match=r"add of Tensor\(a 2 int32 input\): the scalar 1\.5 does not fit int32"):
        _ = a + 1.5
    with pytest.raises(ValueRangeError, match=r"0\.5"):
        _ = a * 0.5
    with pytest.raises(ValueRangeError, match="300"):
        _ = u + 300
    with pytest.raises(ValueRangeError, match=r"2\.5"):
        _ = a >= 2.5
    with pytest.raises(ValueRangeError, match="300"):
        pt.full((2,), 300, "uint8")
    plan = pt.compile({"b": a + 2.0, "c": u * 2, "d": pt.full((2,), 255, "uint8")})  # integral: fine
    out = plan.run(a=np.array([1, 2], np.int32), u=np.array([3, 4], np.uint8))
    np.testing.assert_array_equal(out["b"], [3, 4])
    np.testing.assert_array_equal(out["c"], [6, 8])
    np.testing.assert_array_equal(out["d"], [255, 255])
    plan.close()


# -- 3. load_state_dict -------------------------------------------------------------------------


def test_load_state_dict_checks_everything_before_writing_anything() -> None:
    x = pt.input("x", (4,))
    w = pt.param("w", (4,), init="ones")
    b = pt.param("b", (), init="zeros")
    plan = pt.compile(loss=pt.sum(x * w) + b, optimizer=pt.SGD(0.1))
    before = plan.state_dict()
    good = {"w": np.full(4, 2.0, np.float32), "b": np.float32(0.5)}
    bad_dicts: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({**good, "w": np.ones((2, 2))}, ShapeMismatchError, r"parameter 'w' \(float32, shape \(4,\)\): got shape \(2, 2\)"),
        ({**good, "w": np.ones(5)}, ShapeMismatchError, r"parameter 'w'.*got shape \(5,\)"),
        ({**good, "b": np.ones(())+1j}, DTypeMismatchError, r"parameter 'b'.*complex128"),
        ({**good, "w": np.array(["a", "b", "c", "d"])}, DTypeMismatchError, r"parameter 'w'.*<U1"),
        ({**good, "v": np.ones(4)}, StateDictKeyError, r"unknown 'v'"),
        ({"w": good["w"]}, StateDictKeyError, r"missing 'b'"),
    ]
    for values, error, pattern in bad_dicts:
        with pytest.raises(error, match=pattern):
            plan.load_state_dict(values)
        _same(plan.state_dict(), before)  # "w" came first and was good: still not written
    plan.load_state_dict({"w": [3, 3, 3, 3]}, strict=False)  # a subset; ints into float32
    np.testing.assert_array_equal(plan.state_dict()["w"], [3, 3, 3, 3])
    plan.load_state_dict(good)
    assert plan.step(x=np.ones(4, np.float32)) == pytest.approx(8.5)
    np.testing.assert_allclose(plan.state_dict()["w"], 1.9)
    plan.close()


# -- 4. other misuse ----------------------------------------------------------------------------


def test_symbolic_tensors_refuse_to_be_values() -> None:
    x = pt.input("x", (2, 3))
    s = pt.input("s", ())
    with pytest.raises(SymbolicTensorError, match=r"np\.asarray\(\) of Tensor\(x 2x3 float32 input\).*run"):
        np.asarray(x)
    with pytest.raises(SymbolicTensorError, match="float"):
        float(s)
    with pytest.raises(SymbolicTensorError, match="bool"):
        bool(x)
    with pytest.raises(SymbolicTensorError, match="numpy's exp"):
        np.exp(x)
    with pytest.raises(SymbolicTensorError):
        np.concatenate([x, x])
    with pytest.raises(DTypeMismatchError, match="ndarray"):
        _ = np.ones(3) + x
    # A numpy scalar on the left hands the operator to the tensor (it built an object array).
    y = np.float64(2.0) * x - np.float32(1.0)  # type: ignore[operator]
    z = np.float64(0.5) < x
    assert isinstance(y, pt.Tensor) and y.dtype.name == "float32"
    assert isinstance(z, pt.Tensor) and z.dtype.name == "bool"
    assert (x == np.float64(1.0)) is False  # == keeps identity semantics
    plan = pt.compile({"y": y, "z": z})
    out = plan.run(x=np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(out["y"], 2 * np.arange(6.0).reshape(2, 3) - 1)
    np.testing.assert_array_equal(out["z"], np.arange(6.0).reshape(2, 3) > 0.5)
    with pytest.raises(SymbolicTensorError):  # a tensor fed as an input's value
        plan.run(x=x)
    assert plan.run(x=np.ones((2, 3)))["y"].tolist() == [[1.0] * 3] * 2
    plan.close()


def test_compile_and_optimizer_misuse(two_devices: Backend) -> None:
    x = pt.input("x", (4,))
    w = pt.param("w", (4,), init="ones")
    with pytest.raises(ShapeMismatchError, match=r"loss must be a scalar.*Tensor\(mul 4 float32 op\)"):
        pt.compile(loss=x * w)
    with pytest.raises(InvalidProgramError, match=r"output 'y' must be a Tensor, got ndarray"):
        pt.compile({"y": np.ones(4)})  # type: ignore[dict-item]
    with pytest.raises(InvalidProgramError, match=r"output 1 must be a Tensor, got int"):
        pt.compile([x * w, 3])  # type: ignore[list-item]
    with pytest.raises(InvalidProgramError, match=r"SGD: lr must be >= 0, got -1"):
        pt.SGD(-1.0)
    with pytest.raises(InvalidProgramError, match=r"momentum must be in \[0, 1\.0\)"):
        pt.SGD(0.1, momentum=1.5)
    with pytest.raises(InvalidProgramError, match="nesterov=True needs a momentum"):
        pt.SGD(0.1, nesterov=True)
    with pytest.raises(InvalidProgramError, match=r"betas must be a pair"):
        pt.Adam(0.1, betas=0.9)  # type: ignore[arg-type]
    with pytest.raises(InvalidProgramError, match=r"betas\[1\] must be in \[0, 1\.0\)"):
        pt.Adam(0.1, betas=(0.9, 1.0))
    nesterov = pt.SGD(0.1, momentum=0.9, nesterov=True)
    with pytest.raises(InvalidProgramError, match="nesterov=True needs a momentum"):
        nesterov.momentum = 0.0
    assert nesterov.momentum == 0.9  # unchanged
    opt = pt.SGD(np.float32(0.5))  # type: ignore[arg-type]  # a numpy scalar becomes a Python float
    assert type(opt.lr) is float
    with pytest.raises(InvalidProgramError, match=r"SGD has no hyperparameter 'betas'"):
        opt.betas = (0.9, 0.99)
    other = pt.compile({"y": x * 2.0}, device=two_devices.get_device(0))
    for bad in ({"mode": "fast"}, {"device": "cpu:99"}, {"share": other, "device": two_devices.get_device(1)}):
        with pytest.raises(PolyjitError, match=r"fast|no device 99|cannot share"):  # no plan was made:
            pt.compile(loss=pt.sum(x * w), optimizer=opt, **bad)  # type: ignore[arg-type]
        opt.lr = 0.25  # the optimizer is still free to change
        opt.lr = 0.5
    other.close()
    plan = pt.compile(loss=pt.sum(x * w), optimizer=opt)
    with pytest.raises(InvalidProgramError, match=r"SGD\.lr = 0\.1: .*already built into a plan with lr=0\.5"):
        opt.lr = 0.1  # a schedule would silently not happen: the plan has lr as a constant
    assert opt.lr == 0.5
    assert plan.step(x=np.ones(4, np.float32)) == pytest.approx(4.0)
    np.testing.assert_allclose(plan.state_dict()["w"], 0.5)
    plan.close()


def test_a_setting_made_while_a_compile_builds_the_updates_waits_for_it() -> None:
    """Found by review: a hyperparameter set on another thread while compile() built the
    updates was accepted, and the plan kept the old value (the kernels hold it as a constant).
    The setting now waits for the compile and is refused, as after any compile; a compile that
    fails meanwhile does not unlock what another one built."""
    import threading

    building, go = threading.Event(), threading.Event()

    class Slow(pt.SGD):
        def _updates(self, params: list[pt.Tensor], grads: list[pt.Tensor]) -> Any:
            building.set()
            go.wait(10)
            return super()._updates(params, grads)

    x = pt.input("x", (4,))
    w = pt.param("w", (4,), init="ones")
    opt = Slow(0.5)
    outcome: list[str] = []

    def set_lr() -> None:
        building.wait(10)
        threading.Timer(0.3, go.set).start()  # the compile goes on while this thread is waiting
        try:
            opt.lr = 0.1
            outcome.append("set")
        except InvalidProgramError:
            outcome.append("refused")

    setter = threading.Thread(target=set_lr)
    setter.start()
    plan = pt.compile(loss=pt.sum(x * w), optimizer=opt)
    setter.join(10)
    assert outcome == ["refused"] and opt.lr == 0.5
    plan.step(x=np.ones(4, np.float32))
    np.testing.assert_allclose(plan.state_dict()["w"], 0.5)  # the plan's lr is the optimizer's
    plan.close()


def test_plan_arguments_of_the_wrong_kind_are_typed_errors_and_the_plan_still_runs() -> None:
    """Found by review: each of these was a bare AttributeError or TypeError."""
    x = pt.input("x", (2, 3))
    w = pt.param("w", (3, 3), init="ones")
    y = (x @ w).named("y")
    plan = pt.compile({"y": y})
    xs = np.ones((2, 3), np.float32)
    with pytest.raises(InvalidArgumentError, match=r"Plan\.read takes a Tensor.*not str"):
        plan.read("y")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"plan inputs: a mapping.*not ndarray.*inputs: x"):
        plan.run_pipelined([xs])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match=r"run_pipelined takes a list.*not NoneType"):
        plan.run_pipelined(None)  # type: ignore[arg-type]
    for bad in (None, [("w", np.ones((3, 3)))]):
        with pytest.raises(InvalidArgumentError, match=r"load_state_dict takes a mapping"):
            plan.load_state_dict(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"share= takes a Plan.*not object"):
        pt.compile({"y": y}, share=object())  # type: ignore[arg-type]
    for params, culprit in ((["w"], "'w'"), ([None], "None"), ("w", "'w'"), (3, "3")):
        with pytest.raises(InvalidProgramError, match=f"params.*{culprit}"):
            pt.compile(loss=pt.sum(y), optimizer=pt.SGD(0.1), params=params)  # type: ignore[arg-type]
    np.testing.assert_array_equal(plan.run(x=xs)["y"], np.full((2, 3), 3, np.float32))
    plan.close()


@pytest.mark.parametrize("mode", ["compiled", "dynamic"])
def test_a_closed_plan_says_so_for_every_call(mode: str) -> None:
    """load_state_dict({}) of a closed plan reported the names the dict lacked."""
    x = pt.input("x", (4,))
    w = pt.param("w", (4,), init="ones")
    plan = pt.compile(loss=pt.sum(x * w), optimizer=pt.SGD(0.1), mode=mode)
    xs = np.ones(4, np.float32)
    plan.step(x=xs)
    plan.close()
    calls: dict[str, Any] = {
        "step()": lambda p: p.step(x=xs), "run()": lambda p: p.run(x=xs),
        "run_pipelined()": lambda p: p.run_pipelined([{"x": xs}]), "run_on_device()": lambda p: p.run_on_device(x=xs),
        "state_dict()": lambda p: p.state_dict(), "load_state_dict()": lambda p: p.load_state_dict({}),
        "reset()": lambda p: p.reset(), "read()": lambda p: p.read(w), "build()": lambda p: p.build()}
    for name, call in calls.items():  # each names what was called (it said "link into a live context")
        with pytest.raises(FinalizedError, match=rf"{re.escape(name)} after close\(\)"):
            call(plan)
    plan.close()  # twice is fine
    owner = pt.compile(loss=pt.sum(x * w), optimizer=pt.SGD(0.1), mode=mode)
    sharer = pt.compile({"y": x * w}, share=owner)
    sharer.run(x=xs)
    owner.close()
    for name, call in calls.items():
        if name != "step()":  # the sharer has no loss
            with pytest.raises(FinalizedError, match=rf"{re.escape(name)} after the plan .*whose state it shares"):
                call(sharer)


def test_graph_building_misuse_raises_typed_errors_naming_the_culprit() -> None:
    """Shapes that are not ints, a zero slice step, axes out of range, a matmul with a
    non-tensor: each a PolyjitError (not a TypeError or a silent truncation of 2.5 to 2)."""
    x = pt.input("x", (3, 4))
    for shape in ((2.5, 4), ("3", 4), None, (True, 2)):
        with pytest.raises(ShapeMismatchError, match="'a'"):
            pt.input("a", shape)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgumentError, match="name is a str"):
        pt.input(5, (3,))  # type: ignore[arg-type]
    with pytest.raises(ShapeMismatchError, match="step cannot be zero"):
        x[::0]
    with pytest.raises(ShapeMismatchError, match="not a permutation"):
        x.transpose((0, 5))  # was wrapped to (0, 1)
    with pytest.raises(ShapeMismatchError, match="not a permutation"):
        x.transpose((0, 0))
    assert x.transpose((1, 0)).shape == x.transpose(1, 0).shape == x.T.shape == (4, 3)
    for bad in (lambda: x @ 2.0, lambda: 2.0 @ x, lambda: x @ np.ones((4, 2), np.float32)):
        with pytest.raises(DTypeMismatchError, match="matmul takes a Tensor, got"):
            bad()
    mlp = pt.MLP("zero_width", [4, 0, 2])  # a layer with no values initialises (no 1/0)
    assert [p.shape for p in mlp.params][:2] == [(4, 0), (0,)]


def test_op_shapes_that_are_not_ints_are_refused_not_truncated() -> None:
    """Found by review: reshape, broadcast_to and arange truncated 2.9 to 2 (int(d)) and took
    the string "4"; as for leaves (ir.as_shape), each is a ShapeMismatchError naming the op."""
    x = pt.input("x", (2, 2))
    with pytest.raises(ShapeMismatchError, match=r"reshape of Tensor\(x 2x2.*\(2\.9, 2\.1\)"):
        x.reshape(2.9, 2.1)
    with pytest.raises(ShapeMismatchError, match="reshape of"):
        x.reshape("4",)  # type: ignore[arg-type]
    with pytest.raises(ShapeMismatchError, match="reshape of"):
        x.reshape(-1.0)  # type: ignore[arg-type]
    with pytest.raises(ShapeMismatchError, match="reshape of"):
        x.reshape(None)  # type: ignore[arg-type]  (was a bare TypeError)
    with pytest.raises(ShapeMismatchError, match="only one dimension can be -1"):
        x.reshape(-1, -1)
    with pytest.raises(ShapeMismatchError, match=r"broadcast_to of Tensor\(x.*3\.7"):
        pt.broadcast_to(x, (3.7, 2, 2))  # type: ignore[arg-type]
    for n in (2.5, "2", None, True):
        with pytest.raises(ShapeMismatchError, match="arange"):
            pt.arange(n)  # type: ignore[arg-type]
    with pytest.raises(ShapeMismatchError, match="arange"):
        pt.arange(-1)
    for bad_axis in (0.5, "0", True):
        with pytest.raises(ShapeMismatchError, match="an axis is an int"):
            x.sum(bad_axis)  # type: ignore[arg-type]
    with pytest.raises(ShapeMismatchError, match=r"an axis of transpose.*1\.0"):
        x.transpose(1.0, 0)  # type: ignore[arg-type]


def test_numpy_integers_are_ints_for_shapes_axes_and_indices() -> None:
    """Found by review: np.int64 axes, dimensions and transposes raised a bare TypeError or a
    misleading "not a permutation"; numpy takes them (operator.index), so does the front end."""
    x = pt.input("x", (2, 3))
    i0, i1 = np.int64(0), np.int64(1)
    assert x.sum(axis=i0).shape == (3,)
    assert x.sum(axis=(np.int8(1),)).shape == (2,)
    assert pt.concat([x, x], i1).shape == (2, 6)
    assert x.reshape(np.int64(6)).shape == (6,)
    assert x.reshape((np.int32(-1), np.int64(2))).shape == (3, 2)
    assert x.transpose(i1, i0).shape == (3, 2)
    assert x.transpose(None).shape == (3, 2)  # numpy's reversal
    assert pt.broadcast_to(pt.input("v", (1,)), np.int64(4)).shape == (4,)
    assert pt.arange(np.int64(3)).shape == (3,)
    assert x[i1].shape == (3,)
    assert x[np.int32(0) : np.int64(1), ::np.int64(2)].shape == (1, 2)
    # a range is a sequence of ints, as numpy takes it (found by the review of this fix)
    assert x.reshape(range(3, 1, -1)).shape == (3, 2) and x.transpose(range(1, -1, -1)).shape == (3, 2)
    assert pt.reshape(x, range(1, 7)[::5]).shape == (1, 6)


def test_bool_indices_and_non_int_slice_bounds_are_refused() -> None:
    """Found by review: x[True] read row 1 (True is an int to isinstance), where numpy reads a
    new axis; a bool index is refused rather than given another meaning. x[0.5:] raised a bare
    TypeError from slice.indices."""
    x = pt.input("x", (2, 2))
    for bad in (lambda: x[True], lambda: x[np.True_], lambda: x[0, False], lambda: x[..., np.False_]):
        with pytest.raises(InvalidArgumentError, match=r"indexing Tensor\(x 2x2.*with a bool.*x\[None\]"):
            bad()
    for bad in (lambda: x[0.5:], lambda: x[:"1"], lambda: x[::1.0], lambda: x[True:]):
        with pytest.raises(InvalidArgumentError, match=r"indexing Tensor\(x 2x2.*a slice's (start|stop|step)"):
            bad()
    assert x[None].shape == (1, 2, 2)


def test_einsum_grad_and_param_misuse_are_typed_errors() -> None:
    """Found by review: each of these raised a bare KeyError, ValueError, TypeError or
    AttributeError from inside the front end."""
    x = pt.input("x", (2, 3))
    for spec, pattern in (("ij->k", r"output letter\(s\) 'k'"), ("ij->i->j", "one explicit '->'"),
                          ("ij->ii", "repeats in the output"), ("ij->i,j", r"output letter\(s\) ','")):
        with pytest.raises(InvalidProgramError, match=rf"einsum.*{pattern}"):
            pt.einsum(spec, x)
    with pytest.raises(InvalidArgumentError, match=r"einsum's spec is a str.*got int"):
        pt.einsum(3, x)  # type: ignore[arg-type]
    assert pt.einsum("ij->ji", x).shape == (3, 2)
    loss = pt.sum(x)
    with pytest.raises(InvalidArgumentError, match=r"wrt\[1\] is a Tensor, got 'x' \(str\)"):
        pt.grad(loss, [x, "x"])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match=r"wrt is a list of Tensors.*got Tensor"):
        pt.grad(loss, x)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="loss is a Tensor, got float"):
        pt.grad(1.0, [x])  # type: ignore[arg-type]
    for rng in ("seed", -1, 2.5):
        with pytest.raises(InvalidArgumentError, match=r"param 'p': rng is a numpy Generator or a seed"):
            pt.param("p", (2,), rng=rng)  # type: ignore[arg-type]
    for init in (lambda r, s: "x", lambda r, s: None, np.array(["a", "b"]), np.ones(2, np.complex64)):
        with pytest.raises(DTypeMismatchError, match=r"initial value of 'q' \(float32, shape \(2,\)\) is not numbers"):
            pt.param("q", (2,), init=init)  # type: ignore[arg-type]
    assert pt.param("p", (2,), rng=np.int64(3)).shape == (2,)  # a numpy seed is a seed


def test_the_reference_takes_outputs_as_compile_does() -> None:
    """Found by the docs review: ``reference.evaluate([t])`` raised a bare ValueError ("dictionary
    update sequence ...") where ``pt.compile([t])`` takes the list."""
    from polyjit.core.errors import InvalidProgramError
    from polyjit.tensor.reference import evaluate

    x = pt.input("x", (3,))
    y = (x * 2.0).named("y")
    xv = np.arange(3, dtype=np.float32)
    for outputs in (y, [y], {"y": y}):
        np.testing.assert_array_equal(evaluate(outputs, {"x": xv})[0]["y"], xv * 2)
    for bad in ("y", 3, [y, "z"], {"y": xv}):
        with pytest.raises(InvalidProgramError, match="output"):
            evaluate(bad, {"x": xv})  # type: ignore[arg-type]


def test_found_by_the_tensor_fuzz_review() -> None:
    """A differential fuzz against PyTorch (session 33) found no wrong value or gradient, but
    valid programs that raised and misuse that raised builtins instead of polyjit errors."""
    import ml_dtypes

    x = pt.input("x", (3,), "float64")
    xv = np.array([1.0, 2.0, 4.0])
    # numpy 2 calls true_divide "divide": np.float32(1) / std raised SymbolicTensorError
    outs = {"a": np.float64(2) / x, "b": np.float32(2) / x, "c": np.array(2.0) / x, "d": np.int64(2) / x}
    for got in pt.compile(outs).run(x=xv).values():
        np.testing.assert_array_equal(got, 2 / xv)
    # a bfloat16 array (numpy kind "V") is an initial value, as a state_dict gives it back
    v = np.array([1.5, -2.0, 3.25], dtype=ml_dtypes.bfloat16)
    w = pt.param("bf16_w", (3,), init=v, dtype="bfloat16")
    np.testing.assert_array_equal(pt.compile({"w": w}).run()["w"], v)
    # an array where an op takes a tensor is a polyjit error that says to wrap it
    t, arr = pt.input("t", (2, 2)), np.ones((2, 2), np.float32)
    for call in (lambda: pt.concat([t, arr], 0), lambda: pt.sum(arr), lambda: pt.softmax(arr),  # type: ignore
                 lambda: pt.reshape(arr, (4,)), lambda: pt.transpose(arr), lambda: pt.einsum("ij->ji", arr),  # type: ignore
                 lambda: pt.cross_entropy(t, np.zeros(2, np.int32)), lambda: pt.cast(arr, "float64")):  # type: ignore
        with pytest.raises(DTypeMismatchError, match=r"takes a Tensor, got ndarray \(wrap arrays with pt.constant"):
            call()
    with pytest.raises(InvalidArgumentError, match="concat takes a list or tuple of Tensors, got Tensor"):
        pt.concat(t, 0)  # type: ignore[arg-type]
    # x[5] is an IndexError, as numpy's and torch's; len() of a 0-d tensor a TypeError
    with pytest.raises(IndexError, match="index 5 is out of bounds for axis 0"):
        t[5]
    with pytest.raises(TypeError, match="len\\(\\) of a 0-d tensor"):
        len(pt.input("s0", ()))
    with pytest.raises(errors.PolyjitError):
        len(pt.input("s1", ()))
