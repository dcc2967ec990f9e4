"""Row-major reshapes (a Reshape fetch) and concatenation (writes into slices of one node)."""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence

import numpy as np

from polyjit.core import ir
from polyjit.core.dtypes import is_int
from polyjit.core.errors import (
    DTypeMismatchError,
    InvalidArgumentError,
    InvalidProgramError,
    ShapeMismatchError,
)
from polyjit.core.ir import Op
from polyjit.tensor.ops.indexing import _syms, getitem
from polyjit.tensor.ops.reductions import _axes
from polyjit.tensor.tensor import Tensor, alias, tensor_arg


def reshape(x: Tensor, shape: int | Sequence[int]) -> Tensor:
    """Row-major reshape (one dimension may be -1)."""
    x = tensor_arg(x, "reshape")
    items = (shape,) if is_int(shape) else shape
    if not isinstance(items, (tuple, list, range, np.ndarray)):
        raise ShapeMismatchError(f"reshape of {x!r}: a shape is an int or a sequence of ints, got {shape!r}")
    free = [k for k, d in enumerate(items) if is_int(d) and d == -1]
    if len(free) > 1:
        raise ShapeMismatchError(f"reshape of {x!r} into {tuple(items)}: only one dimension can be -1")
    try:  # the other dimensions as every shape is checked: ints, never truncated, not negative
        known = ir.as_shape([d for k, d in enumerate(items) if k not in free])
    except ShapeMismatchError as e:
        raise ShapeMismatchError(f"reshape of {x!r} into {tuple(items)!r}: {e}") from None
    dims = list(known)
    if free:
        n = math.prod(known)
        if n == 0 or x.size % n:
            raise ShapeMismatchError(f"cannot reshape {x.shape} into {tuple(items)}")
        dims.insert(free[0], x.size // n)
    target = tuple(dims)
    if math.prod(target) != x.size:
        raise ShapeMismatchError(f"cannot reshape {x.shape} into {target}")
    if target == x.shape:
        return alias(x)
    node = ir.Node("reshape", target, x.dtype)

    def backward(g: Tensor, needs: Sequence[bool]) -> list[Tensor | None]:
        return [reshape(g, x.shape)]

    return Tensor(node, (ir.reshape(node, x.node),), (x,), backward if x.dtype.is_float else None)


def concat(tensors: Sequence[Tensor], axis: int = 0, *, name: str = "concat") -> Tensor:
    """Join tensors along an axis: each one is written into its slice of one node (of ``name``;
    a single tensor is returned as it is)."""
    if isinstance(tensors, Tensor) or not isinstance(tensors, (list, tuple)):
        raise InvalidArgumentError(f"concat takes a list or tuple of Tensors, got {type(tensors).__name__}")
    if not tensors:
        raise InvalidProgramError("concat of no tensors")
    tensors = [tensor_arg(t, f"concat's item {k}") for k, t in enumerate(tensors)]
    first = tensors[0]
    ax = _axes(axis, first.ndim)[0]
    for t in tensors:
        if t.dtype != first.dtype:
            raise DTypeMismatchError(f"concat of {first.dtype} and {t.dtype}; cast first")
        if t.ndim != first.ndim or t.shape[:ax] + t.shape[ax + 1 :] != first.shape[:ax] + first.shape[ax + 1 :]:
            raise ShapeMismatchError(f"cannot concatenate {first.shape} and {t.shape} along axis {ax}")
    if len(tensors) == 1:
        return alias(first)
    total = builtins.sum(t.shape[ax] for t in tensors)
    shape = first.shape[:ax] + (total,) + first.shape[ax + 1 :]
    node = ir.Node(name, shape, first.dtype)
    assigns: list[ir.Assignment] = []
    offsets: list[int] = []
    offset = 0
    for t in tensors:
        syms = _syms(t.ndim)
        lhs = tuple(ir.affine((1, s), const=offset if k == ax else 0) for k, s in enumerate(syms))
        pr = ir.Projections(tuple(zip(syms, t.shape)), lhs, (tuple(ir.as_affine(s) for s in syms),))
        assigns.append(ir.Accum(node, None, Op.ID, (t.node,), pr))
        offsets.append(offset)
        offset += t.shape[ax]

    def backward(g: Tensor, needs: Sequence[bool]) -> list[Tensor | None]:
        out: list[Tensor | None] = []
        for t, off, need in zip(tensors, offsets, needs):
            if need:
                idx = [slice(None)] * g.ndim
                idx[ax] = slice(off, off + t.shape[ax])
                out.append(getitem(g, tuple(idx)))
            else:
                out.append(None)
        return out

    return Tensor(node, assigns, tensors, backward if first.dtype.is_float else None)
