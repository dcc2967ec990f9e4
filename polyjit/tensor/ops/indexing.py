"""Affine reads: ``gather`` (an Accum reading each output cell at an affine index of its input:
transposes, broadcasts, slices) and its adjoint ``scatter_add`` (sums, and the gradients of gathers);
rows picked by data: ``take`` (``ir.Gather``) and its adjoint ``add_rows`` (``ir.ScatterAdd``)."""

from __future__ import annotations

import builtins
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from polyjit.core import ir
from polyjit.core.dtypes import is_int
from polyjit.core.errors import (
    DTypeMismatchError,
    IndexOutOfRangeError,
    InvalidArgumentError,
    InvalidProgramError,
    ShapeMismatchError,
    UnsupportedError,
)
from polyjit.core.ir import AccumOp, Affine, Op, Symbol
from polyjit.tensor.tensor import Tensor, alias, as_int, tensor_arg

IndexMap = Callable[[Sequence[Symbol]], tuple[Affine, ...]]


def _syms(n: int) -> list[Symbol]:
    return [Symbol(f"i{k}") for k in range(n)]


def gather(x: Tensor, shape: tuple[int, ...], index: IndexMap, name: str = "gather") -> Tensor:
    """``out[i...] = x[index(i...)]`` over every cell of ``out`` (inlined into its reader when it can be)."""
    syms = _syms(len(shape))
    node = ir.Node(name, shape, x.dtype)
    pr = ir.Projections(tuple(zip(syms, shape)), tuple(ir.as_affine(s) for s in syms), (index(syms),))
    assign = ir.Accum(node, None, Op.ID, (x.node,), pr)

    def backward(g: Tensor, needs: Sequence[bool]) -> list[Tensor | None]:
        return [scatter_add(g, x.shape, index, name=f"d_{name}")]

    return Tensor(node, (assign,), (x,), backward if x.dtype.is_float else None)


def scatter_add(x: Tensor, shape: tuple[int, ...], index: IndexMap, name: str = "scatter") -> Tensor:
    """``out = 0; out[index(i...)] += x[i...]`` over every cell of ``x``: the adjoint of ``gather``."""
    syms = _syms(x.ndim)
    node = ir.Node(name, shape, x.dtype)
    pr = ir.Projections(tuple(zip(syms, x.shape)), index(syms), (tuple(ir.as_affine(s) for s in syms),))
    assign = ir.Accum(node, AccumOp.ADD, Op.ID, (x.node,), pr, init_neutral=True)

    def backward(g: Tensor, needs: Sequence[bool]) -> list[Tensor | None]:
        return [gather(g, x.shape, index, name=f"d_{name}")]

    return Tensor(node, (assign,), (x,), backward if x.dtype.is_float else None)


def take(table: Tensor, indices: Tensor, name: str = "take") -> Tensor:
    """``out[i..., j...] = table[indices[i...], j...]``: rows picked by data (``ir.Gather``). An
    index outside the rows reads the nearest one; a plan refuses such inputs on the host when
    the indices come from one (``IndexBound``)."""
    table, indices = tensor_arg(table, f"{name}'s table"), tensor_arg(indices, f"{name}'s indices")
    if indices.dtype.is_float or indices.dtype.is_bool:
        raise DTypeMismatchError(f"take needs integer indices, got {indices.dtype}")
    node = ir.Node(name, indices.shape + table.shape[1:], table.dtype)

    def backward(g: Tensor, needs: Sequence[bool]) -> list[Tensor | None]:
        return [add_rows(indices, g, table.shape[0], name=f"d_{name}"), None]

    return Tensor(node, (ir.gather(table.node, indices.node, node),), (table, indices),
                  backward if table.dtype.is_float else None)


def add_rows(indices: Tensor, values: Tensor, rows: int, name: str = "add_rows") -> Tensor:
    """``out = 0; out[indices[i...], j...] += values[i..., j...]`` in row-major order of the
    indices (``ir.ScatterAdd``): the adjoint of :func:`take`, ``rows`` rows long."""
    node = ir.Node(name, (rows, *values.shape[indices.ndim:]), values.dtype)

    def backward(g: Tensor, needs: Sequence[bool]) -> list[Tensor | None]:
        return [None, take(g, indices, name=f"d_{name}")]

    return Tensor(node, (ir.scatter_add(indices.node, values.node, node),), (indices, values),
                  backward if values.dtype.is_float else None)


def _broadcast_map(src: tuple[int, ...], dst: tuple[int, ...]) -> IndexMap:
    """numpy alignment: trailing axes line up; a size-1 axis of ``src`` reads index 0."""
    if ir.broadcast_shapes(src, dst) != dst:
        raise ShapeMismatchError(f"cannot broadcast {src} to {dst}")
    lead = len(dst) - len(src)

    def index(syms: Sequence[Symbol]) -> tuple[Affine, ...]:
        return tuple(ir.fixed(0) if n == 1 and dst[lead + k] != 1 else ir.as_affine(syms[lead + k])
                     for k, n in enumerate(src))

    return index


def indexed(op: Op, shape: tuple[int, ...], operands: Sequence[tuple[Tensor, IndexMap]],
            name: str | None = None) -> Tensor:
    """``out[i...] = op(x_k[index_k(i...)], ...)`` over every cell of ``out``, each operand read at
    its own affine index; no gradient (it builds comparisons such as one-hot matrices)."""
    syms = _syms(len(shape))
    tensors = [t for t, _ in operands]
    out_dt = ir.result_dtype(op, [t.dtype for t in tensors], tensors[0].dtype)
    node = ir.Node(name or op.value, shape, out_dt)
    pr = ir.Projections(tuple(zip(syms, shape)), tuple(ir.as_affine(s) for s in syms),
                        tuple(index(syms) for _, index in operands))
    assign = ir.Accum(node, None, op, tuple(t.node for t in tensors), pr)
    return Tensor(node, (assign,), tensors, None, requires_grad=False)


def broadcast_to(x: Tensor, shape: int | Sequence[int]) -> Tensor:
    x = tensor_arg(x, "broadcast_to")
    try:  # as every shape is checked: ints, never truncated (3.7 is not 3)
        dst = ir.as_shape(shape)
    except ShapeMismatchError as e:
        raise ShapeMismatchError(f"broadcast_to of {x!r}: {e}") from None
    if x.shape == dst:
        return alias(x)
    return gather(x, dst, _broadcast_map(x.shape, dst), name="broadcast")


def sum_to(x: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Sum ``x`` down to ``shape`` (which broadcasts to x's shape): the gradient of broadcasting."""
    if x.shape == shape:
        return x
    to_x = _broadcast_map(shape, x.shape)  # maps x's symbols to indices of the small shape
    return scatter_add(x, shape, to_x, name="sum_to")


def transpose(x: Tensor, axes: Sequence[int] | None = None) -> Tensor:
    """Permute the axes (reverse them by default), like numpy.transpose."""
    x = tensor_arg(x, "transpose")
    if axes is not None:  # numpy integers are axes too (operator.index)
        axes = tuple(as_int(a, f"an axis of transpose of {x!r}") for a in axes)
        if not all(-x.ndim <= a < x.ndim for a in axes):
            raise ShapeMismatchError(f"{axes} is not a permutation of the axes of {x.shape}")
    perm = tuple(range(x.ndim))[::-1] if axes is None else tuple(a % builtins.max(x.ndim, 1) for a in axes)
    if sorted(perm) != list(range(x.ndim)):
        raise ShapeMismatchError(f"{axes} is not a permutation of the axes of {x.shape}")
    if perm == tuple(range(x.ndim)):
        return alias(x)
    inverse = [0] * x.ndim
    for pos, a in enumerate(perm):
        inverse[a] = pos

    def index(syms: Sequence[Symbol]) -> tuple[Affine, ...]:
        return tuple(ir.as_affine(syms[inverse[a]]) for a in range(x.ndim))

    return gather(x, tuple(x.shape[a] for a in perm), index, name="transpose")


def _index_item(x: Tensor, it: Any) -> Any:
    """One item of an index, its ints (numpy's too) as Python ints. A bool is refused: numpy
    reads ``x[True]`` as ``x[None]`` and ``x[False]`` as an empty ``x[None][:0]``, not as row
    1 or 0 (which ``isinstance(True, int)`` made it); a slice bound must be an int or None."""
    if isinstance(it, (bool, np.bool_)):
        raise InvalidArgumentError(
            f"indexing {x!r} with a bool ({it!r}) is not supported (numpy reads it as a new axis, "
            "or an empty one); write x[None] for a new axis, or an int for a row"
        )
    if isinstance(it, np.integer):
        return int(it)
    if isinstance(it, slice):
        bounds = []
        for part, v in (("start", it.start), ("stop", it.stop), ("step", it.step)):
            if v is not None and not is_int(v):  # is_int refuses bools, as everywhere here
                raise InvalidArgumentError(f"indexing {x!r}: a slice's {part} is an int or None, got {v!r}")
            bounds.append(None if v is None else int(v))
        return slice(*bounds)
    return it


def getitem(x: Tensor, index: Any) -> Tensor:
    """Basic indexing: integers, slices (any step), ``...`` and ``None``, as numpy does."""
    items = tuple(_index_item(x, it) for it in (index if isinstance(index, tuple) else (index,)))
    for it in items:
        if isinstance(it, Tensor) or not (it is None or it is Ellipsis or isinstance(it, (int, slice))):
            raise UnsupportedError(
                f"only basic indexing (ints, slices, ..., None) is supported, got {type(it).__name__}; "
                "use embedding() / one_hot() to gather rows by tensor indices"
            )
    real = builtins.sum(1 for it in items if it is not None and it is not Ellipsis)
    if real > x.ndim:
        raise ShapeMismatchError(f"too many indices ({real}) for a tensor of shape {x.shape}")
    if items.count(Ellipsis) > 1:
        raise InvalidProgramError("an index can only have one ellipsis")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items = items[:at] + (slice(None),) * (x.ndim - real) + items[at + 1 :]
    else:
        items = items + (slice(None),) * (x.ndim - real)
    shape: list[int] = []
    spec: list[tuple[int, int, int]] = []  # per axis of x: (output position or -1, start, step)
    axis = 0
    for it in items:
        if it is None:
            shape.append(1)
            continue
        n = x.shape[axis]
        if isinstance(it, int):
            k = it + n if it < 0 else it
            if not 0 <= k < n:
                raise IndexOutOfRangeError(f"index {it} is out of bounds for axis {axis} of {x!r}, of size {n}")
            spec.append((-1, k, 0))
        else:
            if it.step == 0:
                raise ShapeMismatchError(f"slice step cannot be zero (axis {axis} of {x.shape})")
            start, stop, step = it.indices(n)
            spec.append((len(shape), start, step))
            shape.append(len(range(start, stop, step)))
        axis += 1

    def gather_index(syms: Sequence[Symbol]) -> tuple[Affine, ...]:
        return tuple(ir.fixed(start) if pos < 0 else ir.affine((step, syms[pos]), const=start)
                     for pos, start, step in spec)

    identity = all(pos == k and start == 0 and step == 1 for k, (pos, start, step) in enumerate(spec))
    if identity and tuple(shape) == x.shape:
        return alias(x)
    return gather(x, tuple(shape), gather_index, name="slice")


def flat_view(x: Tensor, offset: int, shape: tuple[int, ...], name: str = "view") -> Tensor:
    """Elements ``offset .. offset+prod(shape)`` of a 1-D tensor, read in ``shape`` (no copy once inlined)."""
    if x.ndim != 1 or offset < 0 or offset + math.prod(shape) > x.shape[0]:
        raise ShapeMismatchError(f"no view of {shape} at offset {offset} in a tensor of shape {x.shape}")
    st = [math.prod(shape[k + 1 :]) for k in range(len(shape))]

    def index(syms: Sequence[Symbol]) -> tuple[Affine, ...]:
        return (ir.Affine.of(dict(zip(syms, st)), offset),)

    return gather(x, shape, index, name=name)
