"""Reductions over axes: sum and mean (scatter-adds), max and min (MAX/MIN accumulations)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from polyjit.core import ir
from polyjit.core.dtypes import is_int
from polyjit.core.errors import ShapeMismatchError
from polyjit.core.ir import AccumOp, Affine, Op, Symbol
from polyjit.tensor.ops.elementwise import equal, where
from polyjit.tensor.ops.indexing import IndexMap, _syms, gather, scatter_add
from polyjit.tensor.tensor import Tensor, alias, as_int, tensor_arg


def _axes(axis: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    if is_int(axis) or isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (tuple, list)):
        raw: tuple[int, ...] = (as_int(axis, "an axis"),)  # np.int64(0) is an axis, as numpy takes it
    else:
        raw = tuple(as_int(a, "an axis") for a in axis)
    out = []
    for a in raw:
        if not -ndim <= a < ndim:
            raise ShapeMismatchError(f"axis {a} is out of range for {ndim} dimensions")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ShapeMismatchError(f"repeated axis in {raw}")
    return tuple(sorted(out))


def _reduce_map(ndim: int, axes: tuple[int, ...], keepdims: bool) -> IndexMap:
    def index(syms: Sequence[Symbol]) -> tuple[Affine, ...]:
        out = []
        for k in range(ndim):
            if k not in axes:
                out.append(ir.as_affine(syms[k]))
            elif keepdims:
                out.append(ir.fixed(0))
        return tuple(out)

    return index


def _reduced_shape(shape: tuple[int, ...], axes: tuple[int, ...], keepdims: bool) -> tuple[int, ...]:
    return tuple(1 if k in axes else n for k, n in enumerate(shape) if keepdims or k not in axes)


def sum(x: Tensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
    x = tensor_arg(x, "sum")
    axes = _axes(axis, x.ndim)
    if not axes:
        return alias(x)
    return scatter_add(x, _reduced_shape(x.shape, axes, keepdims), _reduce_map(x.ndim, axes, keepdims), name="sum")


def mean(x: Tensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
    x = tensor_arg(x, "mean")
    axes = _axes(axis, x.ndim)
    n = math.prod(x.shape[a] for a in axes)
    return sum(x, axes, keepdims) * (1.0 / n if n else math.nan)  # of nothing: NaN, as numpy's


def _reduce_extreme(x: Tensor, axis: int | Sequence[int] | None, keepdims: bool, accum: AccumOp) -> Tensor:
    axes = _axes(axis, x.ndim)
    if not axes:
        return alias(x)
    index = _reduce_map(x.ndim, axes, keepdims)
    shape = _reduced_shape(x.shape, axes, keepdims)
    syms = _syms(x.ndim)
    node = ir.Node(accum.value, shape, x.dtype)
    pr = ir.Projections(tuple(zip(syms, x.shape)), index(syms), (tuple(ir.as_affine(s) for s in syms),))
    assign = ir.Accum(node, accum, Op.ID, (x.node,), pr, init_neutral=True)
    holder: list[Tensor] = []

    def backward(g: Tensor, needs: Sequence[bool]) -> list[Tensor | None]:
        # Every element equal to the extreme gets the gradient (ties share it in full).
        hit = equal(x, gather(holder[0], x.shape, index, name="bcast_extreme"))
        return [where(hit, gather(g, x.shape, index, name="bcast_grad"), 0.0)]

    out = Tensor(node, (assign,), (x,), backward if x.dtype.is_float else None)
    holder.append(out)
    return out


def max(x: Tensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
    x = tensor_arg(x, "max")
    return _reduce_extreme(x, axis, keepdims, AccumOp.MAX)


def min(x: Tensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
    x = tensor_arg(x, "min")
    return _reduce_extreme(x, axis, keepdims, AccumOp.MIN)
