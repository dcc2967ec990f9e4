"""Host staging for plans: feeding inputs and fetching outputs without allocating per run.

Every value that goes from the host into a plan (an input of ``run()`` / ``step()``, a
data-parallel shard, a ``load_state_dict`` entry) passes through :func:`convert_into` or
:meth:`Feed.host_array`, which refuse, before anything is copied to the device:

- a wrong shape (``ShapeMismatchError``) or a value of a kind that does not convert
  (strings, objects, complex numbers; a non-bool array for a bool tensor:
  ``DTypeMismatchError``);
- for an integer tensor, integers outside its dtype's range and floats that are not
  integral (``ValueRangeError``): nothing wraps around or truncates;
- for a float tensor, finite values too large for its dtype (1e300 for float32, 70000 for
  float16: ``ValueRangeError``): a value may round, never turn into inf;
- for an input that indexes classes or rows (the labels of ``cross_entropy``, the
  indices of ``one_hot`` and ``embedding``), values that are negative or at least the
  number of classes (``IndexOutOfRangeError``), with a min/max over the array.

A pipelined run enqueues its device-to-host copies (``to_host(...,
blocking=False)``) and waits once at the end.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from polyjit.core import dtypes
from polyjit.core.errors import (
    BindingError,
    DTypeMismatchError,
    IndexOutOfRangeError,
    InvalidArgumentError,
    NodeNotInContextError,
    ShapeMismatchError,
    ValueRangeError,
)
from polyjit.core.ir import Node
from polyjit.core.runtime import Context
from polyjit.tensor.tensor import IndexBound

Array = np.ndarray[Any, Any]


def enqueue_to_host(ctx: Context, node: Node, array: Array) -> None:
    """Enqueue a copy of the node's buffer into ``array`` on the context's stream; no wait.

    The array must stay untouched until the stream has passed this point
    (``ctx.stream.synchronize()``).
    """
    if not ctx.to_host(node, array, blocking=False):
        raise NodeNotInContextError(f"{node.label} has no buffer in {ctx!r}")


def convert_into(target: Array, value: Any, what: str, row0: int = 0) -> None:
    """Copy ``value`` (an array, a nested list, a scalar) into ``target`` when ``target``'s dtype
    holds every value of it; else raise, naming ``what``, and leave nothing half-done on the device
    (``target`` is a host array: its contents are unspecified after an error).

    Accepted: the same dtype; any real (bool, integer, float) array for a float target (rounded as
    numpy's ``same_kind`` casts do); bool and integer arrays whose values are in range for an
    integer target, and float arrays whose values are integral and in range; bool arrays for a
    bool target. ``row0`` shifts the first axis of positions in messages (a data-parallel shard).
    """
    desc = f"{what} ({target.dtype}, shape {target.shape})"
    try:
        arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    except ValueError as e:  # a ragged nested list
        raise ShapeMismatchError(f"{desc}: {e}") from None
    if arr.shape != target.shape:
        raise ShapeMismatchError(f"{desc}: got shape {arr.shape}, expected {target.shape}")
    src, dst = arr.dtype, target.dtype
    if src == dst:
        np.copyto(target, arr)
        return
    if src.kind == "O" and arr.size and all(type(v) in (int, float, bool) for v in arr.flat):
        arr = _python_numbers(arr, dst, desc, row0)  # ints beyond 64 bits
        src = arr.dtype
        if src == dst:
            np.copyto(target, arr)
            return
    if src == dtypes.bfloat16.np:  # not of numpy's kind "f": its float32 values, exactly
        arr = arr.astype(np.float32)
        src = arr.dtype
    if src.kind not in "biuf":
        raise DTypeMismatchError(f"{desc}: got {src} values, which do not convert to {dst}")
    if dst.kind == "b":
        raise DTypeMismatchError(f"{desc}: got {src} values; a bool tensor takes bool values "
                                 "(compare first: values != 0)")
    if dst.kind in "iu" and src.kind != "b" and not np.can_cast(src, dst, "safe"):
        dtypes.check_integers(arr, dst, desc, row0)
        np.copyto(target, arr, casting="unsafe")
        return
    if dst in (dtypes.float16.np, dtypes.bfloat16.np):  # rounded once, as kernels round
        np.copyto(target, dtypes.to_half(arr, dtypes.as_dtype(dst)))
        if src.itemsize >= dst.itemsize:  # a value too large for dst: inf
            dtypes.check_no_overflow(arr, target, desc, row0)
        return
    try:  # numpy's cast flags an overflow itself: no pass of ours over the values
        with np.errstate(over="raise", under="ignore", invalid="ignore", divide="ignore"):  # not the user's
            np.copyto(target, arr, casting="unsafe")  # float targets, and safe integer casts
    except FloatingPointError:
        dtypes.check_no_overflow(arr, target, desc, row0)
        raise ValueRangeError(f"{desc}: a value does not fit {dst}") from None


def _python_numbers(arr: Array, dst: np.dtype[Any], desc: str, row0: int) -> Array:
    """An object array of Python numbers (numpy makes one of ints beyond 64 bits; pandas of
    any): refused by the first value ``dst`` cannot hold (ValueRangeError, as for any
    integer out of range, or a float beyond float64); else its int64 or float64 values,
    checked as those are."""
    if all(type(v) is bool for v in arr.flat):
        return arr.astype(np.bool_)
    if dst.kind in "iu":
        info = np.iinfo(dst)
        for k, v in enumerate(arr.flat):  # Python numbers: check_integers reads numpy's
            if type(v) is float and not v.is_integer():
                raise dtypes.not_integral(desc, v, dtypes.position(k, arr.shape, row0))
            if not info.min <= v <= info.max:
                raise dtypes.out_of_range(desc, v, dtypes.position(k, arr.shape, row0), dst)
        # exact, as Python ints: 2**53 + 1 beside a float stays itself
        return np.array([int(v) for v in arr.flat], dtype=np.uint64 if dst.kind == "u" else np.int64).reshape(arr.shape)
    for k, v in enumerate(arr.flat):
        try:
            float(v)
        except OverflowError:
            raise ValueRangeError(f"{desc}: value {v!r} at index {dtypes.position(k, arr.shape, row0)} does not "
                                  f"fit {dst} (nor float64)") from None
    return arr.astype(np.float64)


class Feed:
    """One input of a plan: its node, the bounds of its values when they index classes or rows,
    and a staging array used when the caller's array cannot be handed to the device as it is
    (wrong dtype, not contiguous, a list)."""

    __slots__ = ("_unsigned", "bounds", "depth", "name", "node", "staging")

    def __init__(self, name: str, node: Node, bounds: Sequence[IndexBound] = ()) -> None:
        self.name = name
        self.node = node
        self.staging = np.zeros(node.shape, node.dtype.np)
        self.bounds = tuple(sorted(bounds, key=lambda b: b.depth))  # the tightest first
        self.depth = self.bounds[0].depth if self.bounds else 0
        # index checks see the values as unsigned: a negative index is larger than any depth
        kind = self.staging.dtype
        self._unsigned = np.dtype(kind.str.replace("i", "u")) if kind.kind == "i" else kind

    def host_array(self, value: Any, staging: Array | None = None, row0: int | None = None) -> Array:
        """The array to copy from: the caller's own when it fits, else the staging array.

        Checks every value before anything is copied (see :func:`convert_into`; index inputs
        against the number of classes). ``row0``: the first row of a data-parallel shard
        (messages then give indices in the global batch).
        """
        if (type(value) is np.ndarray and value.dtype == self.staging.dtype
                and value.flags.c_contiguous and value.shape == self.staging.shape):
            arr = value
        else:
            arr = self.staging if staging is None else staging
            convert_into(arr, value, self._what(row0), row0 or 0)
        # One pass over the values (the hot path of every step that takes indices).
        if self.bounds and arr.size and int(arr.view(self._unsigned).max()) >= self.depth:
            self._refuse_indices(arr, self._what(row0), row0 or 0)
        return arr

    def _what(self, row0: int | None) -> str:
        what = f"input {self.name!r}"
        if row0 is not None and self.node.shape:
            what += f" [rows {row0}..{row0 + self.node.shape[0] - 1} of the batch]"
        return what

    def _refuse_indices(self, arr: Array, what: str, row0: int) -> None:
        lo, hi = int(arr.min()), int(arr.max())
        at = int(np.argmin(arr)) if lo < 0 else int(np.argmax(arr))
        bound = self.bounds[0] if lo < 0 else next(b for b in self.bounds if hi >= b.depth)
        raise IndexOutOfRangeError(
            f"{what} ({arr.dtype}, shape {arr.shape}): value {arr.flat[at].item()} at index "
            f"{dtypes.position(at, arr.shape, row0)} is out of range for {bound.what} "
            f"(valid: 0..{bound.depth - 1})"
        )


def check_names(given: Mapping[str, Any], expected: frozenset[str], what: str) -> None:
    if not isinstance(given, Mapping):
        raise InvalidArgumentError(f"{what}: a mapping of input names to arrays, not {type(given).__name__} "
                                   f"(inputs: {', '.join(sorted(expected))})")
    if given.keys() != expected:
        missing = sorted(expected - given.keys())
        extra = sorted(given.keys() - expected)
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"unknown {', '.join(extra)}"] if extra else [])
        raise BindingError(f"{what}: {'; '.join(parts)} (inputs: {', '.join(sorted(expected))})")
