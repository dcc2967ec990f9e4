"""The catalog of named test programs of the conformance kit.

Every program carries its computations, a generator of random inputs whose
ranges avoid NaN, overflow, logarithms of negatives and integer division by
zero, the nodes to check, and a tolerance. It is run on a backend and checked
against :func:`polyjit.testing.reference.run_reference`, never against
hard-coded numbers (see :mod:`polyjit.testing.harness`).

The catalog covers every op on every dtype where it is defined (see
``ir.result_dtype``), casts between all dtypes, and every IR construct:
broadcasting, transposes, reductions with each AccumOp, matmul and batched
matmul, accumulation onto what the context holds, non-surjective and
non-injective writes, fused elementwise chains (whose intermediates must be
VIRTUAL and absent from the context), fetches (fill, range, constant, slice at
a static index bound at run time), Seq/Block, and explicit memory modes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from polyjit.core import dtypes, ir
from polyjit.core.dtypes import DType
from polyjit.core.errors import DTypeMismatchError
from polyjit.core.ir import AccumOp, MemoryMode, Node, Op, StaticSymbol, Symbol

__all__ = [
    "CatalogProgram",
    "Gen",
    "by_name",
    "catalog",
    "default_tolerance",
    "program",
    "values",
]

Array = np.ndarray[Any, Any]
Gen = Callable[[np.random.Generator], Array]


@attrs.frozen(eq=False)
class CatalogProgram:
    """A named test program.

    ``inputs``: the nodes put in the context before linking, each with its random
    generator (a node a computation writes in place or accumulates onto is an input
    too). ``runs``: one binding of the static symbols per run; every run executes
    the program's routines in order, and the outputs are checked after each run
    (state carries over from run to run, as it does in the context).
    ``virtual``: intermediates that must be inferred VIRTUAL and be absent from the
    context; ``absent``: nodes that must not be in the context (LOCAL scratch);
    ``present``: nodes that must be in the context.
    """

    name: str
    comps: tuple[ir.Comp, ...]
    inputs: tuple[tuple[Node, Gen], ...]
    outputs: tuple[Node, ...]
    runs: tuple[Mapping[StaticSymbol, int], ...] = ({},)
    virtual: tuple[Node, ...] = ()
    absent: tuple[Node, ...] = ()
    present: tuple[Node, ...] = ()
    rtol: float | None = None
    atol: float | None = None
    description: str = ""

    def generate(self, rng: np.random.Generator) -> dict[Node, Array]:
        out: dict[Node, Array] = {}
        for node, gen in self.inputs:
            arr = np.asarray(gen(rng))
            out[node] = np.ascontiguousarray(arr.astype(node.dtype.np, copy=False)).reshape(node.shape)
        return out

    def tolerance(self, dt: DType) -> tuple[float, float]:
        rtol, atol = default_tolerance(dt)
        return (self.rtol if self.rtol is not None else rtol, self.atol if self.atol is not None else atol)

    def __repr__(self) -> str:
        return f"CatalogProgram({self.name})"


def default_tolerance(dt: DType) -> tuple[float, float]:
    """(rtol, atol) for comparing a node of ``dt``; integers and bools compare exactly."""
    if dt is dtypes.float32:
        return 2e-5, 1e-6
    if dt is dtypes.float64:
        return 1e-11, 1e-12
    return 0.0, 0.0


# ---------------------------------------------------------------------------
# Random values


def values(dt: DType, shape: tuple[int, ...], kind: str = "any") -> Gen:
    """A generator of random values of ``dt``.

    kinds: ``any`` (floats in [-2, 2], ints in [-50, 50], all of uint8, bools),
    ``pos`` (strictly positive), ``nonzero`` (away from zero), ``exp`` (floats in
    [-3, 3]), ``few`` (a handful of exact values, so that comparisons meet equality),
    ``unit`` (floats in [0.8, 1.25], small ints: safe for products), ``quarter``
    (float multiples of 1/4 in [-4, 4]: sums are exact in any order),
    ``small`` (ints in [-3, 3]).
    """
    np_dt = dt.np

    def gen(rng: np.random.Generator) -> Array:
        if dt.is_bool:
            return rng.random(shape) < 0.5
        if dt.is_float:
            if kind == "pos":
                x = rng.uniform(0.25, 3.0, shape)
            elif kind == "nonzero":
                x = rng.uniform(0.5, 2.0, shape) * rng.choice([-1.0, 1.0], shape)
            elif kind == "exp":
                x = rng.uniform(-3.0, 3.0, shape)
            elif kind == "few":
                x = rng.choice([-1.0, -0.5, 0.0, 0.5, 1.0], shape)
            elif kind == "unit":
                x = rng.uniform(0.8, 1.25, shape)
            elif kind == "quarter":
                x = rng.integers(-16, 17, shape) / 4.0
            elif kind == "small":
                x = rng.integers(-3, 4, shape).astype(np.float64)
            else:
                x = rng.uniform(-2.0, 2.0, shape)
            return np.asarray(x).astype(np_dt)
        signed = dt.is_signed
        if kind == "pos":
            lo, hi = 1, (50 if signed else 255)
        elif kind == "nonzero":
            mag = rng.integers(1, 21 if signed else 256, shape)
            sign = rng.choice([-1, 1], shape) if signed else 1
            return np.asarray(mag * sign).astype(np_dt)
        elif kind == "few":
            lo, hi = 0, 3
        elif kind in ("unit", "small"):
            lo, hi = (-3, 3) if signed else (0, 3)
        else:
            lo, hi = (-50, 50) if signed else (0, 255)
        return rng.integers(lo, hi + 1, shape).astype(np_dt)

    return gen


# ---------------------------------------------------------------------------
# Building blocks


def program(
    name: str,
    *assignments: ir.Assignment,
    inputs: Sequence[tuple[Node, Gen]],
    outputs: Sequence[Node],
    comps: Sequence[ir.Comp] | None = None,
    **kw: Any,
) -> CatalogProgram:
    """A one-computation program (or several, with ``comps=``)."""
    cs = tuple(comps) if comps is not None else (ir.Comp.of(*assignments),)
    return CatalogProgram(name, cs, tuple(inputs), tuple(outputs), **kw)


def _valid(op: Op, operand_dtypes: Sequence[DType], lhs: DType) -> DType | None:
    try:
        return ir.result_dtype(op, operand_dtypes, lhs)
    except DTypeMismatchError:
        return None


_UNARY = (Op.ID, Op.NEG, Op.ABS, Op.EXP, Op.LOG, Op.SQRT, Op.TANH, Op.SIGMOID, Op.RELU)
_BINARY = (Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MAX, Op.MIN, Op.POW,
           Op.LT, Op.LE, Op.GT, Op.GE, Op.EQ, Op.NE)
_SHAPE = (3, 37)  # odd sizes: remainders of vector loops


def _unary_kind(op: Op) -> str:
    return {Op.LOG: "pos", Op.SQRT: "pos", Op.EXP: "exp"}.get(op, "any")


def _binary_kinds(op: Op) -> tuple[str, str]:
    if op is Op.DIV:
        return "any", "nonzero"
    if op is Op.POW:
        return "pos", "exp"
    if op in ir.COMPARISONS or op in (Op.MAX, Op.MIN):
        return "few", "few"
    return "any", "any"


def _pow_gens(dt: DType, shape: tuple[int, ...]) -> tuple[Gen, Gen]:
    def base(rng: np.random.Generator) -> Array:
        return rng.uniform(0.5, 2.0, shape).astype(dt.np)

    def expo(rng: np.random.Generator) -> Array:
        return rng.uniform(-2.0, 2.0, shape).astype(dt.np)

    return base, expo


def _elementwise() -> list[CatalogProgram]:
    out: list[CatalogProgram] = []
    for dt in dtypes.ALL:
        for op in _UNARY:
            rdt = _valid(op, [dt], dt)
            if rdt is None:
                continue
            a, r = Node(f"a_{dt}", _SHAPE, dt), Node(f"r_{op.value}", _SHAPE, rdt)
            out.append(program(
                f"elementwise.{op.value}.{dt}", ir.apply(op, a, into=r),
                inputs=[(a, values(dt, _SHAPE, _unary_kind(op)))], outputs=[r],
            ))
        for op in _BINARY:
            rdt = _valid(op, [dt, dt], dt)
            if rdt is None:
                continue
            ka, kb = _binary_kinds(op)
            a, b = Node(f"a_{dt}", _SHAPE, dt), Node(f"b_{dt}", _SHAPE, dt)
            r = Node(f"r_{op.value}", _SHAPE, rdt)
            ga, gb = (_pow_gens(dt, _SHAPE) if op is Op.POW
                      else (values(dt, _SHAPE, ka), values(dt, _SHAPE, kb)))
            out.append(program(
                f"elementwise.{op.value}.{dt}", ir.apply(op, a, b, into=r),
                inputs=[(a, ga), (b, gb)], outputs=[r],
            ))
            # a Python scalar operand takes the dtype of the tensor beside it
            scalar: int | float | bool
            if dt.is_bool:
                scalar = True
            elif op is Op.POW:
                scalar = 1.5
            elif dt.is_float:
                scalar = 0.5 if op in ir.COMPARISONS or op in (Op.MAX, Op.MIN) else -1.25
            else:
                scalar = 1 if op in ir.COMPARISONS or op in (Op.MAX, Op.MIN) else 7
            r2, r3 = Node(f"rs_{op.value}", _SHAPE, rdt), Node(f"sr_{op.value}", _SHAPE, rdt)
            a, b = Node(f"a_{dt}", _SHAPE, dt), Node(f"b_{dt}", _SHAPE, dt)  # fresh nodes
            comps = [ir.Comp.of(ir.apply(op, a, scalar, into=r2))]
            ins: list[tuple[Node, Gen]] = [(a, ga)]
            outs = [r2]
            if op is not Op.DIV or dt.is_float:  # scalar / tensor would divide by zero for ints
                comps.append(ir.Comp.of(ir.apply(op, scalar, b if op is Op.DIV else a, into=r3)))
                outs.append(r3)
                if op is Op.DIV:
                    ins.append((b, gb))
            out.append(program(
                f"elementwise.{op.value}_scalar.{dt}", comps=comps, inputs=ins, outputs=outs,
            ))
        # where(cond, a, b) on every dtype, with a tensor and a scalar branch
        c = Node("cond", _SHAPE, dtypes.bool_)
        a, b = Node(f"a_{dt}", _SHAPE, dt), Node(f"b_{dt}", _SHAPE, dt)
        r, r2 = Node("r_where", _SHAPE, dt), Node("r_where_s", _SHAPE, dt)
        out.append(program(
            f"elementwise.where.{dt}",
            ir.apply(Op.WHERE, c, a, b, into=r),
            ir.apply(Op.WHERE, c, a, False if dt.is_bool else 3, into=r2),
            inputs=[(c, values(dtypes.bool_, _SHAPE)), (a, values(dt, _SHAPE)), (b, values(dt, _SHAPE))],
            outputs=[r, r2],
        ))
    return out


def _cast_source(src: DType, dst: DType, shape: tuple[int, ...]) -> Gen:
    """Values of ``src`` whose conversion to ``dst`` is defined in C (and so, portable)."""

    def gen(rng: np.random.Generator) -> Array:
        if src.is_bool:
            return rng.random(shape) < 0.5
        zero = rng.random(shape) < 0.2  # zeros: cast to bool must give False
        if src.is_float:
            if dst is dtypes.uint8:
                x = rng.uniform(-0.99, 255.99, shape)
            elif dst.is_float:
                x = rng.uniform(-1e3, 1e3, shape)
            else:
                x = rng.uniform(-100.0, 100.0, shape)
            return np.where(zero, 0.0, x).astype(src.np)
        if src is dtypes.uint8:
            return np.where(zero, 0, rng.integers(0, 256, shape)).astype(src.np)
        # signed ints: into uint8 they wrap (defined in C); into signed types stay in range
        lo, hi = (-300, 300) if dst is dtypes.uint8 else (-1000, 1000)
        return np.where(zero, 0, rng.integers(lo, hi + 1, shape)).astype(src.np)

    return gen


def _casts() -> list[CatalogProgram]:
    out = []
    for src in dtypes.ALL:
        for dst in dtypes.ALL:
            a, r = Node(f"a_{src}", _SHAPE, src), Node(f"r_{dst}", _SHAPE, dst)
            out.append(program(
                f"cast.{src}_to_{dst}", ir.apply(Op.CAST, a, into=r),
                inputs=[(a, _cast_source(src, dst, _SHAPE))], outputs=[r],
            ))
    # a scalar cast: the literal takes the lhs dtype
    for dst in dtypes.ALL:
        r = Node(f"r_{dst}", (4,), dst)
        out.append(program(f"cast.scalar_to_{dst}", ir.apply(Op.CAST, 3, into=r), inputs=[], outputs=[r]))
    return out


# ---------------------------------------------------------------------------
# Constructs


def _f32(name: str, shape: tuple[int, ...], mode: MemoryMode | None = None) -> Node:
    return Node(name, shape, dtypes.float32, mode)


def _broadcasting() -> list[CatalogProgram]:
    out = []
    a, b, r = _f32("a", (3, 1, 5)), _f32("b", (4, 1)), _f32("r", (3, 4, 5))
    out.append(program("broadcast.3d", ir.apply(Op.ADD, a, b, into=r),
                       inputs=[(a, values(dtypes.float32, a.shape)), (b, values(dtypes.float32, b.shape))],
                       outputs=[r]))
    s, m, r2 = _f32("s", ()), _f32("m", (6, 7)), _f32("r", (6, 7))
    out.append(program("broadcast.0d_operand", ir.apply(Op.MUL, m, s, into=r2),
                       inputs=[(s, values(dtypes.float32, ())), (m, values(dtypes.float32, m.shape))],
                       outputs=[r2]))
    row, col, r3 = Node("row", (1, 9), dtypes.int32), Node("col", (5, 1), dtypes.int32), Node("r", (5, 9), dtypes.int32)
    out.append(program("broadcast.outer_int32", ir.apply(Op.SUB, row, col, into=r3),
                       inputs=[(row, values(dtypes.int32, row.shape)), (col, values(dtypes.int32, col.shape))],
                       outputs=[r3]))
    v, r4 = Node("v", (5,), dtypes.float64), Node("r", (2, 3, 5), dtypes.float64)
    out.append(program("broadcast.fill_from_vector", ir.apply(Op.ID, v, into=r4),
                       inputs=[(v, values(dtypes.float64, v.shape))], outputs=[r4]))
    c, x, y, r5 = (Node("c", (4, 1), dtypes.bool_), Node("x", (1, 6), dtypes.uint8),
                   Node("y", (), dtypes.uint8), Node("r", (4, 6), dtypes.uint8))
    out.append(program("broadcast.where_uint8", ir.apply(Op.WHERE, c, x, y, into=r5),
                       inputs=[(c, values(dtypes.bool_, c.shape)), (x, values(dtypes.uint8, x.shape)),
                               (y, values(dtypes.uint8, ()))], outputs=[r5]))
    e, r6 = _f32("e", (0, 5)), _f32("r", (0, 5))
    out.append(program("broadcast.empty", ir.apply(Op.ADD, e, 1.0, into=r6),
                       inputs=[(e, values(dtypes.float32, e.shape))], outputs=[r6]))
    z, r7 = _f32("z", ()), _f32("r", ())
    out.append(program("elementwise.0d", ir.apply(Op.TANH, z, into=r7),
                       inputs=[(z, values(dtypes.float32, ()))], outputs=[r7]))
    return out


def _transposes() -> list[CatalogProgram]:
    out = []
    for dt in (dtypes.float32, dtypes.int64, dtypes.uint8, dtypes.bool_):
        a, r = Node("a", (5, 7), dt), Node("r", (7, 5), dt)
        out.append(program(f"transpose.2d.{dt}", ir.einsum("ij->ji", a, into=r) if not dt.is_bool
                           else _transpose_assign(a, r),
                           inputs=[(a, values(dt, a.shape))], outputs=[r]))
    a3, r3 = _f32("a", (2, 3, 4)), _f32("r", (4, 2, 3))
    out.append(program("transpose.3d", ir.einsum("ijk->kij", a3, into=r3),
                       inputs=[(a3, values(dtypes.float32, a3.shape))], outputs=[r3]))
    return out


def _transpose_assign(a: Node, r: Node) -> ir.Accum:
    """A transpose by plain assignment (einsum accumulates, which bool nodes cannot)."""
    i, j = Symbol("i"), Symbol("j")
    pr = ir.projections([(i, a.shape[0]), (j, a.shape[1])], [j, i], [i, j])
    return ir.Accum(r, None, Op.ID, (a,), pr)


def _reductions() -> list[CatalogProgram]:
    out = []
    red_dtypes = (dtypes.float32, dtypes.float64, dtypes.int32, dtypes.int64, dtypes.uint8)
    for dt in red_dtypes:
        for acc in AccumOp:
            kind = "unit" if acc is AccumOp.MUL else ("quarter" if dt.is_float and acc is AccumOp.ADD else "any")
            if acc is AccumOp.MUL and not dt.is_float:
                kind = "small"
            a = Node("a", (6, 9), dt)
            r_rows, r_cols, r_all = Node("rows", (6,), dt), Node("cols", (9,), dt), Node("all", (), dt)
            comps = [
                ir.Comp.of(ir.einsum("ij->i", a, into=r_rows, accum=acc)),
                ir.Comp.of(ir.einsum("ij->j", a, into=r_cols, accum=acc)),
            ]
            outs = [r_rows, r_cols]
            if not (acc is AccumOp.MUL and not dt.is_float):  # 54 factors overflow an integer
                comps.append(ir.Comp.of(ir.einsum("ij->", a, into=r_all, accum=acc)))
                outs.append(r_all)
            out.append(program(f"reduce.{acc.value}.{dt}", comps=comps,
                               inputs=[(a, values(dt, a.shape, kind))], outputs=outs,
                               rtol=1e-5 if dt is dtypes.float32 else None))
    a3, r3 = _f32("a", (4, 5, 6)), _f32("r", (5,))
    out.append(program("reduce.middle_axis_kept", ir.einsum("ijk->j", a3, into=r3),
                       inputs=[(a3, values(dtypes.float32, a3.shape, "quarter"))], outputs=[r3]))
    # a reduction over an empty axis gives the neutral element
    e = _f32("e", (4, 0))
    r_sum, r_max = _f32("s", (4,)), _f32("m", (4,))
    out.append(program("reduce.empty_axis",
                       comps=[ir.Comp.of(ir.einsum("ij->i", e, into=r_sum)),
                              ir.Comp.of(ir.einsum("ij->i", e, into=r_max, accum=AccumOp.MAX))],
                       inputs=[(e, values(dtypes.float32, e.shape))], outputs=[r_sum, r_max]))
    # reversed reads inside float reductions (GCC 12 -O3 once summed these wrongly)
    for dt in (dtypes.float32, dtypes.float64):
        for rows, k in ((3, 2), (5, 16), (40_000, 3)):
            x = Node("x", (rows, k), dt)
            w, o = Node("w", (k,), dt), Node("o", (rows,), dt)
            kk, ii = Symbol("k"), Symbol("i")
            conv = ir.Accum(o, AccumOp.ADD, Op.MUL, (x, w),
                            ir.projections([(ii, rows), (kk, k)], [ii], [ii, ir.affine((-1, kk), const=k - 1)], [kk]))
            out.append(program(f"reduce.reversed_read.{dt}.{rows}x{k}", conv,
                               inputs=[(x, values(dt, x.shape, "small")), (w, values(dt, w.shape, "small"))],
                               outputs=[o]))
        y = Node("y", (5, 4), dt)
        z, tot = Node("z", (3,), dt), Node("tot", (), dt)
        s0, s1 = Symbol("s0"), Symbol("s1")
        pair = ir.Accum(tot, AccumOp.ADD, Op.ADD, (z, y),
                        ir.projections([(s0, 3), (s1, 2)], [], [ir.affine((1, s1), const=1)],
                                       [ir.affine((1, s0), const=2), ir.affine((-1, s1), const=2)]))
        out.append(program(f"reduce.reversed_pair.{dt}", pair,
                           inputs=[(z, values(dt, z.shape, "small")), (y, values(dt, y.shape, "small"))],
                           outputs=[tot]))
        yy, nest = Node("yy", (20, 16), dt), Node("nest", (), dt)
        rev_nested = ir.Accum(nest, AccumOp.ADD, Op.ID, (yy,),
                              ir.projections([(s0, 20), (s1, 16)], [], [s0, ir.affine((-1, s1), const=15)]))
        out.append(program(f"reduce.reversed_nested.{dt}", rev_nested,
                           inputs=[(yy, values(dt, yy.shape, "small"))], outputs=[nest]))
        big = Node("big", (70_000,), dt)
        rsum = Node("rsum", (), dt)
        q = Symbol("q")
        rev_full = ir.Accum(rsum, AccumOp.ADD, Op.ID, (big,),
                            ir.projections([(q, 70_000)], [], [ir.affine((-1, q), const=69_999)]))
        out.append(program(f"reduce.reversed_full.{dt}", rev_full,
                           inputs=[(big, values(dt, big.shape, "small"))], outputs=[rsum]))
    # reductions of a fused expression: sum of squares, max of abs
    x, sq, ss = _f32("x", (8, 33)), _f32("sq", (8, 33)), _f32("ss", (8,))
    out.append(program("reduce.sum_of_squares",
                       ir.apply(Op.MUL, x, x, into=sq), ir.einsum("ij->i", sq, into=ss),
                       inputs=[(x, values(dtypes.float32, x.shape))], outputs=[ss], rtol=1e-5,
                       virtual=(sq,)))
    return out


def _matmuls() -> list[CatalogProgram]:
    out = []
    for dt, (m, k, n) in [
        (dtypes.float32, (13, 17, 11)),
        (dtypes.float32, (24, 9, 64)),  # full register tiles
        (dtypes.float32, (50, 31, 37)),  # full and edge tiles
        (dtypes.float32, (5, 33, 20)),  # fewer rows than a tile; a vector and a few lanes
        (dtypes.float32, (7, 12, 48)),  # whole vectors past the last whole tile
        (dtypes.float32, (256, 16, 10)),  # a classifier head: every tile is narrow
        (dtypes.float64, (11, 6, 24)),
        (dtypes.float64, (13, 17, 37)),
        (dtypes.int32, (7, 5, 9)),
        (dtypes.int64, (12, 20, 33)),
        (dtypes.uint8, (6, 7, 8)),
    ]:
        a, b, c = Node("a", (m, k), dt), Node("b", (k, n), dt), Node("c", (m, n), dt)
        kind = "quarter" if dt.is_float else "any"
        out.append(program(f"matmul.{dt}.{m}x{k}x{n}", ir.einsum("ik,kj->ij", a, b, into=c),
                           inputs=[(a, values(dt, a.shape, kind)), (b, values(dt, b.shape, kind))],
                           outputs=[c]))
    a, b, c = _f32("a", (19, 23)), _f32("b", (23, 29)), _f32("c", (19, 29))
    out.append(program("matmul.float32.random_values", ir.einsum("ik,kj->ij", a, b, into=c),
                       inputs=[(a, values(dtypes.float32, a.shape)), (b, values(dtypes.float32, b.shape))],
                       outputs=[c], rtol=1e-4, atol=1e-4))
    at, bt, ct = _f32("at", (9, 14)), _f32("bt", (20, 9)), _f32("ct", (14, 20))
    out.append(program("matmul.transposed_operands", ir.einsum("ki,jk->ij", at, bt, into=ct),
                       inputs=[(at, values(dtypes.float32, at.shape, "quarter")),
                               (bt, values(dtypes.float32, bt.shape, "quarter"))], outputs=[ct]))
    ab, bb, cb = _f32("a", (3, 10, 6)), _f32("b", (3, 6, 21)), _f32("c", (3, 10, 21))
    out.append(program("matmul.batched", ir.einsum("bik,bkj->bij", ab, bb, into=cb),
                       inputs=[(ab, values(dtypes.float32, ab.shape, "quarter")),
                               (bb, values(dtypes.float32, bb.shape, "quarter"))], outputs=[cb]))
    ab2, bs, cb2 = Node("a", (4, 5, 7), dtypes.float64), Node("b", (7, 3), dtypes.float64), Node("c", (4, 5, 3), dtypes.float64)
    out.append(program("matmul.batched_shared_rhs", ir.einsum("bik,kj->bij", ab2, bs, into=cb2),
                       inputs=[(ab2, values(dtypes.float64, ab2.shape)), (bs, values(dtypes.float64, bs.shape))],
                       outputs=[cb2]))
    u, v, o = _f32("u", (7,)), _f32("v", (11,)), _f32("o", (7, 11))
    out.append(program("einsum.outer", ir.einsum("i,j->ij", u, v, into=o),
                       inputs=[(u, values(dtypes.float32, u.shape)), (v, values(dtypes.float32, v.shape))],
                       outputs=[o]))
    p, q, d = Node("p", (40,), dtypes.int64), Node("q", (40,), dtypes.int64), Node("d", (), dtypes.int64)
    out.append(program("einsum.dot", ir.einsum("i,i->", p, q, into=d),
                       inputs=[(p, values(dtypes.int64, p.shape)), (q, values(dtypes.int64, q.shape))],
                       outputs=[d]))
    mm, vv, mv = _f32("m", (12, 30)), _f32("v", (30,)), _f32("mv", (12,))
    out.append(program("einsum.matvec", ir.einsum("ij,j->i", mm, vv, into=mv),
                       inputs=[(mm, values(dtypes.float32, mm.shape, "quarter")),
                               (vv, values(dtypes.float32, vv.shape, "quarter"))], outputs=[mv]))
    h, w, mx = _f32("h", (6, 8)), _f32("w", (8, 5)), _f32("mx", (6, 5))
    out.append(program("einsum.max_plus_product", ir.einsum("ik,kj->ij", h, w, into=mx, accum=AccumOp.MAX),
                       inputs=[(h, values(dtypes.float32, h.shape)), (w, values(dtypes.float32, w.shape))],
                       outputs=[mx]))
    return out


def _accumulate_onto_context() -> list[CatalogProgram]:
    """Accumulations without init_neutral add onto what the context holds, run after run."""
    out = []
    a, b, c = _f32("a", (13, 7)), _f32("b", (7, 21)), _f32("c", (13, 21))
    q = functools.partial(values, dtypes.float32, kind="quarter")
    out.append(program("accumulate.matmul_onto_context",
                       ir.einsum("ik,kj->ij", a, b, into=c, init_neutral=False),
                       inputs=[(a, q(a.shape)), (b, q(b.shape)), (c, q(c.shape))],
                       outputs=[c], runs=({}, {}, {})))
    x, s = Node("x", (5, 8), dtypes.int32), Node("s", (5,), dtypes.int32)
    out.append(program("accumulate.sum_onto_context", ir.einsum("ij->i", x, into=s, init_neutral=False),
                       inputs=[(x, values(dtypes.int32, x.shape)), (s, values(dtypes.int32, s.shape))],
                       outputs=[s], runs=({}, {})))
    y, mx = Node("y", (6, 4), dtypes.float64), Node("mx", (4,), dtypes.float64)
    out.append(program("accumulate.max_onto_context",
                       ir.einsum("ij->j", y, into=mx, accum=AccumOp.MAX, init_neutral=False),
                       inputs=[(y, values(dtypes.float64, y.shape)), (mx, values(dtypes.float64, mx.shape))],
                       outputs=[mx]))
    e, acc = Node("e", (9,), dtypes.uint8), Node("acc", (9,), dtypes.uint8)
    out.append(program("accumulate.elementwise_uint8_wraps",
                       ir.apply(Op.ID, e, into=acc, accum=AccumOp.ADD, init_neutral=False),
                       inputs=[(e, values(dtypes.uint8, e.shape)), (acc, values(dtypes.uint8, acc.shape))],
                       outputs=[acc], runs=({}, {}, {})))
    f, g = Node("f", (4, 6), dtypes.float32), Node("g", (4, 6), dtypes.float32)
    out.append(program("accumulate.product_onto_context",
                       ir.apply(Op.ID, f, into=g, accum=AccumOp.MUL, init_neutral=False),
                       inputs=[(f, values(dtypes.float32, f.shape, "unit")),
                               (g, values(dtypes.float32, g.shape, "unit"))], outputs=[g], runs=({}, {})))
    # in place: z = z * 3, the node read and written by one assignment
    z = Node("z", (17,), dtypes.int64)
    out.append(program("accumulate.in_place_update", ir.apply(Op.MUL, z, 3, into=z),
                       inputs=[(z, values(dtypes.int64, z.shape, "small"))], outputs=[z], runs=({}, {})))
    return out


def _writes() -> list[CatalogProgram]:
    """Non-surjective, non-injective, strided and fixed-index writes."""
    out = []
    i, j = Symbol("i"), Symbol("j")
    n = 10
    x, o = _f32("x", (n,)), _f32("o", (n + 5,))
    shift = ir.Accum(o, None, Op.ID, (x,), ir.projections([(i, n)], [ir.affine((1, i), const=3)], [i]))
    out.append(program("write.offset_into_context", shift,
                       inputs=[(x, values(dtypes.float32, x.shape)), (o, values(dtypes.float32, o.shape))],
                       outputs=[o]))
    o2, x = _f32("o2", (n + 5,)), _f32("x", (n,))
    shift2 = ir.Accum(o2, None, Op.ID, (x,), ir.projections([(i, n)], [ir.affine((1, i), const=3)], [i]))
    out.append(program("write.fill_then_offset", ir.Seq((ir.fill(o2, -1.0), shift2)),
                       inputs=[(x, values(dtypes.float32, x.shape))], outputs=[o2]))
    o3 = Node("o3", (2 * n,), dtypes.int32)
    xi = Node("xi", (n,), dtypes.int32)
    strided = ir.Accum(o3, None, Op.NEG, (xi,), ir.projections([(i, n)], [ir.affine((2, i), const=1)], [i]))
    out.append(program("write.strided", strided,
                       inputs=[(xi, values(dtypes.int32, xi.shape)), (o3, values(dtypes.int32, o3.shape))],
                       outputs=[o3]))
    rev, xi = Node("rev", (n,), dtypes.int32), Node("xi", (n,), dtypes.int32)
    reverse = ir.Accum(rev, None, Op.ID, (xi,), ir.projections([(i, n)], [i], [ir.affine((-1, i), const=n - 1)]))
    out.append(program("read.reversed", reverse, inputs=[(xi, values(dtypes.int32, xi.shape))], outputs=[rev]))
    ev, xi = Node("ev", (n // 2,), dtypes.int32), Node("xi", (n,), dtypes.int32)
    every2 = ir.Accum(ev, None, Op.ID, (xi,), ir.projections([(i, n // 2)], [i], [ir.affine((2, i), const=1)]))
    out.append(program("read.strided", every2, inputs=[(xi, values(dtypes.int32, xi.shape))], outputs=[ev]))
    # non-injective: polynomial product out[i + j] += a[i] * b[j]
    pa, pb, pc = Node("pa", (6,), dtypes.int64), Node("pb", (4,), dtypes.int64), Node("pc", (9,), dtypes.int64)
    conv = ir.Accum(pc, AccumOp.ADD, Op.MUL, (pa, pb),
                    ir.projections([(i, 6), (j, 4)], [ir.affine((1, i), (1, j))], [i], [j]))
    out.append(program("write.non_injective_convolution", conv,
                       inputs=[(pa, values(dtypes.int64, pa.shape)), (pb, values(dtypes.int64, pb.shape))],
                       outputs=[pc]))
    fa, fmx = _f32("fa", (5, 5)), _f32("fmx", (9,))
    diag_max = ir.Accum(fmx, AccumOp.MAX, Op.ID, (fa,),
                        ir.projections([(i, 5), (j, 5)], [ir.affine((1, i), (1, j))], [i, j]))
    out.append(program("write.non_injective_max", diag_max,
                       inputs=[(fa, values(dtypes.float32, fa.shape))], outputs=[fmx]))
    # non-surjective accumulation with init_neutral: cells not written hold the neutral element
    hs, hx = Node("hs", (7,), dtypes.float64), Node("hx", (3, 4), dtypes.float64)
    part = ir.Accum(hs, AccumOp.ADD, Op.ID, (hx,), ir.projections([(i, 3), (j, 4)], [ir.affine((2, i))], [i, j]))
    out.append(program("write.non_surjective_sum", part,
                       inputs=[(hx, values(dtypes.float64, hx.shape))], outputs=[hs]))
    # fixed indices: a row of a matrix, a reduction into one cell
    row_src, mat = Node("rs", (6,), dtypes.float32), Node("mat", (3, 6), dtypes.float32)
    row_write = ir.Accum(mat, None, Op.EXP, (row_src,), ir.projections([(i, 6)], [1, i], [i]))
    out.append(program("write.fixed_row", row_write,
                       inputs=[(row_src, values(dtypes.float32, row_src.shape, "exp")),
                               (mat, values(dtypes.float32, mat.shape))], outputs=[mat]))
    cell_src, cells = Node("cs", (8,), dtypes.int32), Node("cells", (2, 3), dtypes.int32)
    into_cell = ir.Accum(cells, AccumOp.ADD, Op.ID, (cell_src,),
                         ir.projections([(i, 8)], [1, 2], [i]), init_neutral=False)
    out.append(program("write.fixed_cell_accumulate", into_cell,
                       inputs=[(cell_src, values(dtypes.int32, cell_src.shape)),
                               (cells, values(dtypes.int32, cells.shape))], outputs=[cells]))
    # an assignment over a symbol the lhs does not use: the last write wins
    lw_src, lw = Node("lws", (4, 5), dtypes.int32), Node("lw", (4,), dtypes.int32)
    last = ir.Accum(lw, None, Op.ID, (lw_src,), ir.projections([(i, 4), (j, 5)], [i], [i, j]))
    out.append(program("write.last_write_wins", last,
                       inputs=[(lw_src, values(dtypes.int32, lw_src.shape))], outputs=[lw]))
    # a diagonal: two lhs axes from one symbol
    dsrc, dmat = Node("ds", (5,), dtypes.float64), Node("dm", (5, 5), dtypes.float64)
    diag = ir.Accum(dmat, None, Op.ID, (dsrc,), ir.projections([(i, 5)], [i, i], [i]))
    out.append(program("write.diagonal", ir.Seq((ir.fill(dmat, 0.0), diag)),
                       inputs=[(dsrc, values(dtypes.float64, dsrc.shape))], outputs=[dmat]))
    dread, dvec = Node("dr", (6, 6), dtypes.float64), Node("dv", (6,), dtypes.float64)
    diag_read = ir.Accum(dvec, None, Op.ID, (dread,), ir.projections([(i, 6)], [i], [i, i]))
    out.append(program("read.diagonal", diag_read,
                       inputs=[(dread, values(dtypes.float64, dread.shape))], outputs=[dvec]))
    return out


def _fusion() -> list[CatalogProgram]:
    out = []
    shape = (4, 50)
    a, b, c = (_f32(nm, shape) for nm in "abc")
    t1, t2, t3, r = _f32("t1", shape), _f32("t2", shape), _f32("t3", shape), _f32("r", shape)
    f = functools.partial(values, dtypes.float32)
    out.append(program(
        "fusion.chain_float32",
        ir.apply(Op.MUL, a, b, into=t1), ir.apply(Op.ADD, t1, c, into=t2),
        ir.apply(Op.TANH, t2, into=t3), ir.apply(Op.SUB, t3, 1.0, into=r),
        inputs=[(a, f(shape)), (b, f(shape)), (c, f(shape))], outputs=[r], virtual=(t1, t2, t3),
        rtol=1e-5, atol=1e-5,
    ))
    xi = Node("xi", shape, dtypes.int32)
    ci, cf, cmp_, sel = (Node("ci", shape, dtypes.int32), Node("cf", shape, dtypes.float64),
                         Node("cmp", shape, dtypes.bool_), Node("sel", shape, dtypes.float64))
    out.append(program(
        "fusion.mixed_dtypes",
        ir.apply(Op.ABS, xi, into=ci), ir.apply(Op.CAST, ci, into=cf),
        ir.apply(Op.GT, xi, 0, into=cmp_),
        ir.apply(Op.WHERE, cmp_, cf, -1.0, into=sel),
        inputs=[(xi, values(dtypes.int32, shape))], outputs=[sel], virtual=(ci, cf, cmp_),
    ))
    # broadcast read of a virtual node: a bias added to a matmul result
    m, w, bias = _f32("m", (5, 6)), _f32("w", (6, 7)), _f32("bias", (7,))
    mm, biased, act = _f32("mm", (5, 7)), _f32("biased", (5, 7)), _f32("act", (5, 7))
    q = functools.partial(values, dtypes.float32, kind="quarter")
    out.append(program(
        "fusion.matmul_bias_relu",
        ir.einsum("ik,kj->ij", m, w, into=mm), ir.apply(Op.ADD, mm, bias, into=biased),
        ir.apply(Op.RELU, biased, into=act),
        inputs=[(m, q(m.shape)), (w, q(w.shape)), (bias, q(bias.shape))], outputs=[act],
        virtual=(biased,), absent=(mm,),
    ))
    # a node read twice is scratch (LOCAL): stored inside the batch, absent from the context
    e, t, sq = _f32("e", (33,)), _f32("t", (33,)), _f32("sq", (33,))
    out.append(program(
        "fusion.read_twice_is_local",
        ir.apply(Op.EXP, e, into=t), ir.apply(Op.MUL, t, t, into=sq),
        inputs=[(e, f(e.shape, "exp"))], outputs=[sq], absent=(t,), rtol=1e-5,
    ))
    # a fetch inlined into its reader
    rg, rgf = Node("rg", (3, 8), dtypes.int32), _f32("rgf", (3, 8))
    out.append(program(
        "fusion.range_inlined",
        ir.arange(rg), ir.apply(Op.CAST, rg, into=rgf),
        inputs=[], outputs=[rgf], virtual=(rg,),
    ))
    return out


def _fetches() -> list[CatalogProgram]:
    out = []
    for dt in dtypes.ALL:
        fnode, rnode = Node("fill", (3, 5), dt), Node("range", (300,), dt)
        fill_value: int | float | bool = True if dt.is_bool else (2.5 if dt.is_float else 7)
        out.append(program(f"fetch.fill_range.{dt}",
                           comps=[ir.Comp.of(ir.fill(fnode, fill_value)), ir.Comp.of(ir.arange(rnode))],
                           inputs=[], outputs=[fnode, rnode]))
        cnode, x, r = Node("const", (4, 6), dt), Node("x", (4, 6), dt), Node("r", (4, 6), dt)
        cvals = values(dt, cnode.shape)(np.random.default_rng(dtypes.ALL.index(dt)))
        use = ir.apply(Op.MAX, x, cnode, into=r) if not dt.is_bool else ir.apply(Op.NE, x, cnode, into=r)
        out.append(program(f"fetch.constant.{dt}", ir.constant(cnode, cvals), use,
                           inputs=[(x, values(dt, x.shape))], outputs=[r]))
    c2 = Node("c2", (5,), dtypes.float64)
    out.append(program("fetch.constant_as_result",
                       ir.constant(c2, np.linspace(-1.0, 1.0, 5)), inputs=[], outputs=[c2]))
    # a slice at a static index bound at run time, changed between runs
    b = StaticSymbol("b", 4)
    src, sl, r = _f32("src", (4, 3, 5)), _f32("slice", (3, 5)), _f32("r", (3, 5))
    out.append(program("fetch.slice_static_index", ir.slice_at(sl, src, b),
                       inputs=[(src, values(dtypes.float32, src.shape))], outputs=[sl],
                       runs=({b: 0}, {b: 3}, {b: 1})))
    src2, sl2 = Node("src2", (7, 6), dtypes.int32), Node("sl2", (6,), dtypes.int32)
    r2 = Node("r2", (6,), dtypes.int32)
    b2 = StaticSymbol("k", 3)
    out.append(program("fetch.slice_affine_static_index",
                       ir.slice_at(sl2, src2, ir.affine((2, b2), const=1)), ir.apply(Op.ADD, sl2, 1, into=r2),
                       inputs=[(src2, values(dtypes.int32, src2.shape))], outputs=[r2],
                       virtual=(sl2,), runs=({b2: 2}, {b2: 0}, {b2: 1})))
    # a static symbol in an Accum's projections: out[i] = x[$b, i] * w[i]
    bb = StaticSymbol("bb", 5)
    i = Symbol("i")
    xs, w, o = _f32("xs", (5, 9)), _f32("w", (9,)), _f32("o", (9,))
    acc = ir.Accum(o, None, Op.MUL, (xs, w), ir.projections([(i, 9)], [i], [bb, i], [i]))
    out.append(program("static.accum_projection", acc,
                       inputs=[(xs, values(dtypes.float32, xs.shape)), (w, values(dtypes.float32, w.shape))],
                       outputs=[o], runs=({bb: 4}, {bb: 0}, {bb: 2})))
    # a static symbol on the lhs: write row $b of a matrix held by the context
    rb = StaticSymbol("row", 3)
    j = Symbol("j")
    v, mat = Node("v", (4,), dtypes.int64), Node("mat", (3, 4), dtypes.int64)
    wr = ir.Accum(mat, AccumOp.ADD, Op.ID, (v,), ir.projections([(j, 4)], [rb, j], [j]), init_neutral=False)
    out.append(program("static.lhs_row_accumulate", wr,
                       inputs=[(v, values(dtypes.int64, v.shape)), (mat, values(dtypes.int64, mat.shape))],
                       outputs=[mat], runs=({rb: 1}, {rb: 1}, {rb: 2}, {rb: 0})))
    return out


def _reshapes() -> list[CatalogProgram]:
    out = []
    a, flat = Node("a", (4, 6), dtypes.int32), Node("flat", (24,), dtypes.int32)
    out.append(program("reshape.copy", ir.reshape(flat, a),
                       inputs=[(a, values(dtypes.int32, a.shape))], outputs=[flat]))
    b, r3, o = _f32("b", (6, 4)), _f32("r3", (2, 3, 4)), _f32("o", (2, 3, 4))
    out.append(program("reshape.inlined_into_reader", ir.reshape(r3, b), ir.apply(Op.MUL, r3, 2.0, into=o),
                       inputs=[(b, values(dtypes.float32, b.shape))], outputs=[o], virtual=(r3,)))
    c, t, m, s = _f32("c", (12,)), _f32("t", (12,)), _f32("m", (3, 4)), _f32("s", (3,))
    out.append(program("reshape.of_computed_then_reduced",
                       ir.apply(Op.EXP, c, into=t), ir.reshape(m, t), ir.einsum("ij->i", m, into=s),
                       inputs=[(c, values(dtypes.float32, c.shape, "exp"))], outputs=[s], rtol=1e-5))
    return out


def _structure() -> list[CatalogProgram]:
    out = []
    a, b = Node("a", (6, 5), dtypes.float64), Node("b", (6, 5), dtypes.float64)
    t, u, r = Node("t", (6, 5), dtypes.float64), Node("u", (6, 5), dtypes.float64), Node("r", (5,), dtypes.float64)
    body = ir.Block("the body", ir.Seq((
        ir.Block("product", ir.apply(Op.MUL, a, b, into=t)),
        ir.Seq((ir.apply(Op.SQRT, t, into=u), ir.einsum("ij->j", u, into=r))),
    )))
    out.append(program("structure.seq_block", body,
                       inputs=[(a, values(dtypes.float64, a.shape, "pos")),
                               (b, values(dtypes.float64, b.shape, "pos"))], outputs=[r]))
    # two computations of one batch: the first's result feeds the second
    x, y, s = _f32("x", (8,)), _f32("y", (8,)), _f32("s", ())
    out.append(program("structure.two_comps",
                       comps=[ir.Comp.of(ir.apply(Op.MUL, x, 2.0, into=y)),
                              ir.Comp.of(ir.einsum("i->", y, into=s))],
                       inputs=[(x, values(dtypes.float32, x.shape, "quarter"))], outputs=[y, s]))
    # explicit memory modes
    shape = (5, 9)
    p = Node("p", shape, dtypes.float32)
    mat = Node("mat", shape, dtypes.float32, MemoryMode.MATERIALIZED)
    dev = Node("dev", shape, dtypes.float32, MemoryMode.ON_DEVICE)
    loc = Node("loc", shape, dtypes.float32, MemoryMode.LOCAL)
    vir = Node("vir", shape, dtypes.float32, MemoryMode.VIRTUAL)
    res = Node("res", shape, dtypes.float32)
    out.append(program("modes.explicit",
                       ir.apply(Op.ADD, p, 1.0, into=mat),
                       ir.apply(Op.MUL, mat, 2.0, into=dev),
                       ir.apply(Op.SUB, dev, p, into=loc),
                       ir.apply(Op.NEG, loc, into=vir),
                       ir.apply(Op.ADD, vir, mat, into=res),
                       inputs=[(p, values(dtypes.float32, shape))],
                       outputs=[mat, dev, res], present=(mat, dev, res), absent=(loc,), virtual=(vir,)))
    # a chain of scratch nodes (each read twice, so stored) whose space the planner may share
    src = Node("src", (7, 9), dtypes.float64)
    chain: list[ir.Assignment] = []
    prev: Node = src
    scratch: list[Node] = []
    for k, dt in enumerate((dtypes.float64, dtypes.float32, dtypes.int32, dtypes.float64, dtypes.int64)):
        cast = Node(f"c{k}", src.shape, dt)
        nxt = Node(f"t{k}", src.shape, dt)
        chain.append(ir.apply(Op.CAST, prev, into=cast))
        chain.append(ir.apply(Op.ADD, cast, cast, into=nxt))  # cast is read twice: LOCAL
        scratch.append(cast)
        prev = nxt
    last = Node("last", src.shape, dtypes.int64)
    chain.append(ir.apply(Op.SUB, prev, 1, into=last))
    out.append(program("modes.scratch_reuse", *chain, inputs=[(src, values(dtypes.float64, src.shape, "small"))],
                       outputs=[last], absent=tuple(scratch)))
    emb_in, emb_mid, emb_out = _f32("ei", (6,)), _f32("em", (6,)), _f32("eo", (6,))
    out.append(program("modes.embedded_intermediate",
                       comps=[ir.Comp.of(ir.apply(Op.EXP, emb_in, into=emb_mid),
                                         ir.apply(Op.ADD, emb_mid, 1.0, into=emb_out),
                                         embedded=[emb_mid, emb_out])],
                       inputs=[(emb_in, values(dtypes.float32, (6,), "exp"))], outputs=[emb_mid, emb_out],
                       present=(emb_mid, emb_out)))
    return out


def _large() -> list[CatalogProgram]:
    """Sizes past the CPU dialect's OpenMP thresholds (parallel loops, parallel reductions)."""
    out = []
    shape = (300, 200)
    a, b, r = _f32("a", shape), _f32("b", shape), _f32("r", shape)
    t = _f32("t", shape)
    out.append(program("large.elementwise", ir.apply(Op.MUL, a, b, into=t), ir.apply(Op.ADD, t, a, into=r),
                       inputs=[(a, values(dtypes.float32, shape)), (b, values(dtypes.float32, shape))],
                       outputs=[r], virtual=(t,)))
    x = Node("x", (100_003,), dtypes.int64)
    s, mx, mn = Node("s", (), dtypes.int64), Node("mx", (), dtypes.int64), Node("mn", (), dtypes.int64)
    out.append(program("large.full_reductions_int64",
                       comps=[ir.Comp.of(ir.einsum("i->", x, into=s)),
                              ir.Comp.of(ir.einsum("i->", x, into=mx, accum=AccumOp.MAX)),
                              ir.Comp.of(ir.einsum("i->", x, into=mn, accum=AccumOp.MIN))],
                       inputs=[(x, values(dtypes.int64, x.shape))], outputs=[s, mx, mn]))
    # long enough to be split into partial results (core/lower.py: split_long_reduction)
    xs = Node("xs", (2, 65_536), dtypes.int64)
    ss, sx, sn = Node("ss", (), dtypes.int64), Node("sx", (), dtypes.int64), Node("sn", (), dtypes.int64)
    out.append(program("large.full_reductions_split_int64",
                       comps=[ir.Comp.of(ir.einsum("ij->", xs, into=ss)),
                              ir.Comp.of(ir.einsum("ij->", xs, into=sx, accum=AccumOp.MAX)),
                              ir.Comp.of(ir.einsum("ij->", xs, into=sn, accum=AccumOp.MIN, init_neutral=False))],
                       inputs=[(xs, values(dtypes.int64, xs.shape)), (sn, values(dtypes.int64, ()))],
                       outputs=[ss, sx, sn]))
    y = _f32("y", (400, 250))
    ys = _f32("ys", ())
    out.append(program("large.full_sum_float32", ir.einsum("ij->", y, into=ys),
                       inputs=[(y, values(dtypes.float32, y.shape, "quarter"))], outputs=[ys]))
    big = Node("big", (256, 160), dtypes.float32)
    rows = Node("rows", (256,), dtypes.float32)
    out.append(program("large.row_max", ir.einsum("ij->i", big, into=rows, accum=AccumOp.MAX),
                       inputs=[(big, values(dtypes.float32, big.shape))], outputs=[rows]))
    ma, mb, mc = _f32("ma", (96, 80)), _f32("mb", (80, 72)), _f32("mc", (96, 72))
    out.append(program("large.matmul", ir.einsum("ik,kj->ij", ma, mb, into=mc),
                       inputs=[(ma, values(dtypes.float32, ma.shape, "quarter")),
                               (mb, values(dtypes.float32, mb.shape, "quarter"))], outputs=[mc]))
    return out


@functools.cache
def catalog() -> tuple[CatalogProgram, ...]:
    """Every program of the catalog (names are unique)."""
    progs = [
        *_elementwise(), *_casts(), *_broadcasting(), *_transposes(), *_reductions(), *_matmuls(),
        *_accumulate_onto_context(), *_writes(), *_fusion(), *_fetches(), *_reshapes(), *_structure(), *_large(),
    ]
    names = [p.name for p in progs]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:  # pragma: no cover - a catalog bug
        raise AssertionError(f"duplicate program names: {sorted(dupes)}")
    return tuple(progs)


def by_name(name: str) -> CatalogProgram:
    for p in catalog():
        if p.name == name:
            return p
    raise KeyError(name)
