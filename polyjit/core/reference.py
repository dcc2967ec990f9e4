"""A reference interpreter of the IR, written with numpy.

It executes every ``Accum`` and ``Fetch`` of a batch of computations in program
order, with the semantics the IR documents:

- an ``Accum`` iterates its whole product space; ``accum=None`` assigns (when
  several iterations write one cell, the last one in row-major order of the
  product space wins); with an accumulation op and ``init_neutral`` the whole
  lhs starts from the op's neutral element, without it from its current value;
- operands take the dtypes of :func:`polyjit.core.ir.accum_operand_dtypes` and
  nothing is promoted: float32 math stays float32, uint8 arithmetic wraps,
  integer division truncates toward zero (as C does), ``CAST`` converts to the
  lhs dtype (to bool: ``!= 0``; a float to uint8 through int64, so that one out of
  range wraps);
- ``Fetch`` fills, numbers cells with their row-major flat index (cast to the
  node's dtype), copies a constant, or takes a slice of another node along its
  first axis at an index that may use static symbols, or reads another node's
  elements in row-major order with its own shape (``Reshape``);
- ``ir.merge(node)`` operands read ``merge[node]``;
- the half types (float16, bfloat16) compute as kernels do: each op converts its half
  operands to float32, computes in float32 and rounds its result to the half type (to
  nearest even); a cast to a half type rounds once (from float64 through float32 rounded to
  odd); a reduction (an accumulation whose distinct cells are distinct iterations of the
  parallel symbols, as lowering makes a ``Reduce`` of it) accumulates in float32 and rounds
  once at the end, while accumulations that lowering leaves serial round at every update.

Nodes a computation writes that are not in ``env`` start as zeros.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from polyjit.core import dtypes, ir, lower
from polyjit.core.dtypes import DType, to_half, wrap_int
from polyjit.core.errors import BindingError, InvalidProgramError, NodeNotInContextError
from polyjit.core.ir import AccumOp, Affine, Node, Op, StaticSymbol, Symbol

__all__ = ["apply_op", "run_reference", "scalar_value"]

Array = np.ndarray[Any, Any]


def scalar_value(value: int | float | bool, dt: DType) -> Array:
    """A Python scalar as a 0-d array of ``dt``, converted the way C converts a literal."""
    if dt.is_bool:
        return np.array(bool(value), dtype=np.bool_)
    if dt.is_half:
        return to_half(np.float64(value), dt)
    if dt.is_float:
        return np.array(float(value), dtype=dt.np)
    if isinstance(value, float):
        value = int(value)  # C truncates a float literal toward zero
    return np.array(wrap_int(int(value), dt), dtype=dt.np)  # integers wrap modulo 2**bits


def _max_keeping_nan(a: Array, b: Array) -> Array:
    """``a > b || a != a ? a : b``, as the kernels compute a max: NaN where either operand is
    (as ``np.maximum``), and ``b`` where the two are equal (``max(-0.0, 0.0)`` is 0.0)."""
    return np.where((a > b) | (a != a), a, b)


def _int_div(a: Array, b: Array) -> Array:
    """Integer division truncating toward zero (numpy's // floors)."""
    q = np.floor_divide(a, b)
    r = np.remainder(a, b)
    fix = (r != 0) & ((a < 0) != (b < 0))
    return (q + fix.astype(q.dtype)).astype(q.dtype)


def apply_op(op: Op, args: Sequence[Array], operand_dtypes: Sequence[DType], out: DType) -> Array:
    """Apply a scalar op elementwise to arrays already in their operand dtypes; the result has
    dtype ``out``. No promotion: every intermediate stays in the operand dtype (half types:
    float32, rounded once to the half type at the end)."""
    if out.is_half or any(d.is_half for d in operand_dtypes):
        return _apply_half(op, args, operand_dtypes, out)
    dt = out.np
    with np.errstate(all="ignore"):
        if op is Op.ID:
            return np.asarray(args[0]).astype(dt, copy=False)
        if op is Op.CAST:
            x = np.asarray(args[0])
            if out is dtypes.uint8 and x.dtype.kind == "f":  # truncated, then wrapped (as kernels spell it)
                x = x.astype(np.int64)
            return (x != 0) if out.is_bool else x.astype(dt)
        if op is Op.WHERE:
            return np.where(np.asarray(args[0], dtype=np.bool_), args[1], args[2]).astype(dt, copy=False)
        a = np.asarray(args[0])
        if op.arity == 1:
            if op is Op.NEG:
                res = np.negative(a)
            elif op is Op.ABS:
                res = a if operand_dtypes[0].np == np.uint8 else np.abs(a)
            elif op is Op.EXP:
                res = np.exp(a)
            elif op is Op.LOG:
                res = np.log(a)
            elif op is Op.SQRT:
                res = np.sqrt(a)
            elif op is Op.TANH:
                res = np.tanh(a)
            elif op is Op.SIGMOID:
                one = np.array(1, dtype=a.dtype)
                res = one / (one + np.exp(np.negative(a)))
            elif op is Op.RELU:  # max(a, 0), as the kernels spell it: relu(-0.0) is 0.0
                res = _max_keeping_nan(a, np.array(0, dtype=a.dtype))
            else:  # pragma: no cover - every unary op is listed above
                raise InvalidProgramError(f"reference: unhandled op {op}")
            return np.asarray(res).astype(dt, copy=False)
        b = np.asarray(args[1])
        if op is Op.ADD:
            res = np.add(a, b)
        elif op is Op.SUB:
            res = np.subtract(a, b)
        elif op is Op.MUL:
            res = np.multiply(a, b)
        elif op is Op.DIV:
            res = np.divide(a, b) if operand_dtypes[0].is_float else _int_div(a, b)
        elif op is Op.MAX:
            res = _max_keeping_nan(a, b)
        elif op is Op.MIN:
            res = np.where((a < b) | (a != a), a, b)
        elif op is Op.POW:
            res = np.power(a, b)
        elif op is Op.LT:
            res = a < b
        elif op is Op.LE:
            res = a <= b
        elif op is Op.GT:
            res = a > b
        elif op is Op.GE:
            res = a >= b
        elif op is Op.EQ:
            res = a == b
        elif op is Op.NE:
            res = a != b
        else:  # pragma: no cover
            raise InvalidProgramError(f"reference: unhandled op {op}")
        return np.asarray(res).astype(dt, copy=False)


def _apply_half(op: Op, args: Sequence[Array], operand_dtypes: Sequence[DType], out: DType) -> Array:
    """An op with half operands or a half result, as kernels compute it."""
    if op is Op.CAST and out.is_half:
        return to_half(args[0], out)  # float64: rounded once; others through float32
    wide = [np.asarray(a).astype(np.float32) if d.is_half else np.asarray(a) for a, d in zip(args, operand_dtypes)]
    res = apply_op(op, wide, [d.compute for d in operand_dtypes], out.compute)
    return to_half(res, out) if out.is_half else res


def _static_value(sym: StaticSymbol, bindings: Mapping[StaticSymbol, int]) -> int:
    if sym not in bindings:
        raise BindingError(f"reference: static symbol {sym!r} is not bound")
    v = int(bindings[sym])
    if not 0 <= v < sym.bound:
        raise BindingError(f"reference: {sym!r} = {v} is outside [0, {sym.bound})")
    return v


def _eval_affine(
    e: Affine,
    grids: Mapping[Symbol, Array],
    bindings: Mapping[StaticSymbol, int],
) -> Array:
    """The index expression over the product space: an int64 array that broadcasts to it
    (the grids are sparse, so only the axes the expression uses are materialized)."""
    out: Array = np.asarray(e.const, dtype=np.int64)
    for v, c in e.terms:
        if isinstance(v, StaticSymbol):
            out = out + c * _static_value(v, bindings)
        else:
            out = out + c * grids[v]
    return out


def _check_range(idx: Sequence[Array], shape: tuple[int, ...], what: str, empty: bool) -> None:
    if empty:
        return  # an empty product space makes no access
    for axis, (ix, n) in enumerate(zip(idx, shape)):
        if ix.size and (ix.min() < 0 or ix.max() >= n):
            raise InvalidProgramError(f"reference: {what} axis {axis} index out of [0, {n})")


# Strided views for affine indices (a fast path); False forces the general gather/scatter
# (the tests compare the two).
USE_VIEWS = True


def _affine_view(
    array: Array,
    index: Sequence[Affine],
    space: Sequence[tuple[Symbol, int]],
    bindings: Mapping[StaticSymbol, int],
) -> Array | None:
    """``array[index]`` over the product space as a strided view whose axes are the product
    space's (size 1 where a symbol is unused), when every index is ``c * sym + k`` with
    distinct symbols; None otherwise (or when out of range: the caller reports it)."""
    if not USE_VIEWS:
        return None
    picks: list[int | slice] = []
    kept: list[Symbol] = []
    extents = dict(space)
    for e, n in zip(index, array.shape):
        const = e.const
        loops: list[tuple[Symbol, int]] = []
        for v, c in e.terms:
            if isinstance(v, StaticSymbol):
                const += c * _static_value(v, bindings)
            else:
                loops.append((v, c))
        if not loops:
            if not 0 <= const < n:
                return None
            picks.append(const)
            continue
        if len(loops) > 1 or loops[0][0] in kept:
            return None
        sym, c = loops[0]
        last = const + c * (extents[sym] - 1)
        if not (0 <= const < n and 0 <= last < n):
            return None
        stop = last + (1 if c > 0 else -1)
        picks.append(slice(const, stop if stop >= 0 else None, c))
        kept.append(sym)
    view = array[tuple(picks)]
    order = [s for s, _ in space if s in kept]
    view = view.transpose([kept.index(s) for s in order])
    return view.reshape(tuple(extents[s] if s in kept else 1 for s, _ in space))


def _gather(
    array: Array,
    index: Sequence[Affine],
    grids: Mapping[Symbol, Array],
    space: Sequence[tuple[Symbol, int]],
    bindings: Mapping[StaticSymbol, int],
    what: str,
) -> Array:
    """``array[index]`` at every point of the product space (a read-only view of its shape)."""
    shape = tuple(n for _, n in space)
    empty = any(n == 0 for n in shape)
    if not empty:
        view = _affine_view(array, index, space, bindings)
        if view is not None:
            return np.broadcast_to(view, shape)
    idx = tuple(_eval_affine(e, grids, bindings) for e in index)
    _check_range(idx, array.shape, what, empty)
    if empty:
        return np.zeros(shape, array.dtype)
    picked = array[idx] if idx else array
    return np.broadcast_to(picked, shape)


_UFUNC_AT = {
    AccumOp.ADD: np.add,
    AccumOp.MUL: np.multiply,
    AccumOp.MAX: np.maximum,
    AccumOp.MIN: np.minimum,
}


def _injective(pr: ir.Projections) -> bool:
    """Distinct iterations write distinct cells."""
    return lower.injective(pr.lhs, pr.symbols)


def _lookup(node: Node, env: Mapping[Node, Array], what: str) -> Array:
    try:
        return env[node]
    except KeyError:
        raise NodeNotInContextError(f"reference: {node.label} has no value ({what})") from None


def _run_accum(
    a: ir.Accum,
    env: dict[Node, Array],
    bindings: Mapping[StaticSymbol, int],
    merge: Mapping[Node, Array] | None,
) -> None:
    pr = a.projections
    shape = tuple(n for _, n in pr.product_space)
    grids: dict[Symbol, Array] = {}
    if shape:
        for s, g in zip(pr.symbols, np.indices(shape, dtype=np.int64, sparse=True)):
            grids[s] = g
    operand_dtypes = ir.accum_operand_dtypes(a)
    out_dt = ir.result_dtype(a.op, operand_dtypes, a.lhs.dtype)
    args: list[Array] = []
    tensor_k = 0
    for x, dt in zip(a.rhs, operand_dtypes):
        if isinstance(x, (Node, ir.MergeRead)):
            if isinstance(x, ir.MergeRead):
                if merge is None or x.node not in merge:
                    raise NodeNotInContextError(f"reference: no merge-buffer value for {x.node.label}")
                src = np.asarray(merge[x.node])
            else:
                src = _lookup(x, env, f"read for {a.lhs.label}")
            vals = _gather(src, pr.rhs[tensor_k], grids, pr.product_space, bindings, f"read of {x!r}")
            tensor_k += 1
            args.append(vals.astype(dt.np, copy=False))
        else:
            args.append(np.broadcast_to(scalar_value(x, dt), shape))
    value = np.broadcast_to(apply_op(a.op, args, operand_dtypes, out_dt), shape)

    lhs_dt = a.lhs.dtype
    if a.accum is None or not a.init_neutral:
        current = env.get(a.lhs)
        if current is None:
            if a.accum is not None:
                raise NodeNotInContextError(
                    f"reference: {a.lhs.label} accumulates onto its value (init_neutral=False) "
                    "but has none"
                )
            current = np.zeros(a.lhs.shape, lhs_dt.np)
        target = np.array(current, dtype=lhs_dt.np, copy=True)
    else:
        target = np.full(a.lhs.shape, a.accum.neutral(lhs_dt), dtype=lhs_dt.np)
    empty = any(n == 0 for n in shape)
    if not empty and shape and _injective(pr):
        written = _affine_view(target, pr.lhs, pr.product_space, bindings)
        if written is not None and np.may_share_memory(written, target):  # a view of the written cells
            full = np.asarray(value).astype(lhs_dt.np, copy=False)
            with np.errstate(all="ignore"):
                if a.accum is None:
                    written[...] = full
                elif lhs_dt.is_half:  # one update per cell, in float32, rounded
                    written[...] = to_half(_UFUNC_AT[a.accum](written.astype(np.float32), full.astype(np.float32)),
                                           lhs_dt)
                else:
                    written[...] = _UFUNC_AT[a.accum](written, full)
            env[a.lhs] = target
            return
    idx = tuple(_eval_affine(e, grids, bindings) for e in pr.lhs)
    _check_range(idx, a.lhs.shape, f"write of {a.lhs.label}", empty)
    if not empty:
        full = np.asarray(value).astype(lhs_dt.np, copy=False)
        view = target.reshape(1) if not idx else target  # a 0-d lhs: every iteration hits its one cell
        cells: tuple[Array, ...] = tuple(
            np.broadcast_to(ix, shape) for ix in (idx or (np.zeros((), np.int64),)))
        with np.errstate(all="ignore"):
            if a.accum is None:  # the last iteration (in row-major order) wins
                flat_cells: Array = np.ravel_multi_index(tuple(np.ravel(c) for c in cells), view.shape)
                flat_values = np.ravel(full)  # row-major, whatever the strides
                reversed_cells: Array = flat_cells[::-1]
                rev_first: Array = np.unique(reversed_cells, return_index=True)[1]
                last = flat_cells.size - 1 - rev_first
                view.reshape(-1)[flat_cells[last]] = flat_values[last]
            elif lhs_dt.is_half and (_injective(pr) or lower.cell_symbols(a) is not None):
                # each cell once, or a reduction: accumulated in float32, rounded once
                wide = view.astype(np.float32)
                _UFUNC_AT[a.accum].at(wide, cells, full.astype(np.float32))
                view[...] = to_half(wide, lhs_dt)
            elif _injective(pr):  # each cell written once: no need for the slow unbuffered ufunc.at
                view[cells] = _UFUNC_AT[a.accum](view[cells], full)
            else:  # serial updates (a half type rounds at each: ufunc.at updates one at a time)
                _UFUNC_AT[a.accum].at(view, cells, full)
    env[a.lhs] = target


def _run_fetch(f: ir.Fetch, env: dict[Node, Array], bindings: Mapping[StaticSymbol, int]) -> None:
    node, v = f.node, f.value
    dt = node.dtype
    if isinstance(v, ir.Fill):
        out = np.full(node.shape, scalar_value(v.value, dt), dtype=dt.np)
    elif isinstance(v, ir.Range):
        flat = np.arange(node.size, dtype=np.int64).reshape(node.shape)
        out = (flat != 0) if dt.is_bool else to_half(flat, dt) if dt.is_half else flat.astype(dt.np)
    elif isinstance(v, ir.Constant):
        out = np.array(v.values, dtype=dt.np, copy=True)
    elif isinstance(v, ir.Reshape):
        src = _lookup(v.source, env, f"reshape into {node.label}")
        out = np.array(src, dtype=dt.np, copy=True).reshape(node.shape)
    elif isinstance(v, ir.Gather):
        table = _lookup(v.table, env, f"gather into {node.label}")
        rows = np.clip(_lookup(v.indices, env, f"gather into {node.label}").astype(np.int64), 0, table.shape[0] - 1)
        out = np.array(table[rows], dtype=dt.np, copy=True)
    elif isinstance(v, ir.ScatterAdd):
        values = _lookup(v.values, env, f"scatter_add into {node.label}")
        rows = np.clip(_lookup(v.indices, env, f"scatter_add into {node.label}").astype(np.int64), 0, node.shape[0] - 1)
        out = np.zeros(node.shape, dtype=dt.np)
        # one update at a time, in row-major order of the indices (a half type rounds at each)
        _UFUNC_AT[ir.AccumOp.ADD].at(out, rows.reshape(-1), values.reshape(rows.size, *node.shape[1:]))
    elif isinstance(v, ir.Slice):
        src = _lookup(v.source, env, f"slice into {node.label}")
        k = int(_eval_affine(v.index, {}, bindings))
        if not 0 <= k < src.shape[0]:
            raise InvalidProgramError(f"reference: slice index {k} of {v.source.label} out of range")
        out = np.array(src[k], dtype=dt.np, copy=True)
    else:  # pragma: no cover
        raise InvalidProgramError(f"reference: unknown fetch {v!r}")
    env[node] = out


def run_reference(
    comps: Sequence[ir.Comp],
    env: Mapping[Node, Array],
    bindings: Mapping[StaticSymbol, int] | None = None,
    merge: Mapping[Node, Array] | None = None,
) -> dict[Node, Array]:
    """Execute ``comps`` in order over copies of ``env``; return every node's value after.

    ``bindings`` give the values of static symbols; ``merge`` the merge-buffer value
    of the nodes read through ``ir.merge(node)``. The input arrays are not modified.
    """
    bindings = {} if bindings is None else bindings
    state: dict[Node, Array] = {}
    for node, value in env.items():
        arr = np.array(value, copy=True)
        if arr.shape != node.shape:
            raise InvalidProgramError(f"reference: value of {node.label} has shape {arr.shape}, not {node.shape}")
        dt = node.dtype
        state[node] = to_half(arr, dt) if dt.is_half and arr.dtype != dt.np else arr.astype(dt.np, copy=False)
    for comp in comps:
        for leaf in comp.leaves():
            if isinstance(leaf, ir.Accum):
                _run_accum(leaf, state, bindings, merge)
            else:
                _run_fetch(leaf, state, bindings)
    return state
