"""Catalog programs: every op on every dtype where it is defined (with tensor and scalar
operands, and ``where``), and casts between all dtypes (the half types included)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from polyjit.core import dtypes, ir
from polyjit.core.dtypes import DType
from polyjit.core.errors import DTypeMismatchError
from polyjit.core.ir import Node, Op
from polyjit.testing.programs.base import Array, CatalogProgram, Gen, program, values


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


def elementwise() -> list[CatalogProgram]:
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


# ---------------------------------------------------------------------------
# Casts


def _cast_source(src: DType, dst: DType, shape: tuple[int, ...]) -> Gen:
    """Values of ``src`` whose conversion to ``dst`` is defined in C (and so, portable)."""

    def gen(rng: np.random.Generator) -> Array:
        if src.is_bool:
            return rng.random(shape) < 0.5
        zero = rng.random(shape) < 0.2  # zeros: cast to bool must give False
        if src.is_float:
            if dst is dtypes.uint8:
                # a half type rounds 255.99 up to 256, which no uint8 holds
                x = rng.uniform(-0.99, 250.0 if src.is_half else 255.99, shape)
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


def guarded_division() -> list[CatalogProgram]:
    """``where(b != 0, a / b, 0)`` on integers with zero divisors: one spelling of the guard
    users write (the division itself gives 0 there too: :func:`integer_edges`)."""
    out = []
    for dt in (dtypes.int32, dtypes.int64, dtypes.uint8):
        for n in (16, 4096):
            a, b = Node("a", (n,), dt), Node("b", (n,), dt)
            nz, q, r = Node("nz", (n,), dtypes.bool_), Node("q", (n,), dt), Node("r", (n,), dt)

            def divisors(rng: np.random.Generator, n: int = n, dt: DType = dt) -> Array:
                x = rng.integers(0, 4, n).astype(dt.np)
                x[::3] = 0
                return x

            out.append(program(
                f"elementwise.where_guards_division.{dt}.{n}", ir.apply(Op.NE, b, 0, into=nz),
                ir.apply(Op.DIV, a, b, into=q), ir.apply(Op.WHERE, nz, q, 0, into=r),
                inputs=[(a, values(dt, (n,))), (b, divisors)], outputs=[r], virtual=(nz, q),
            ))
    return out


def special_scalars() -> list[CatalogProgram]:
    """Scalar operands IEEE gives meaning to (session 32): a float64 pow of NaN or an infinity
    was ambiguous in OpenCL C (its NAN and INFINITY are floats), and NVRTC warned of a division
    by a literal zero."""
    out = []
    for dt in (dtypes.float32, dtypes.float64):
        for name, scalar in (("nan", float("nan")), ("inf", float("inf")), ("minus_inf", float("-inf"))):
            x, y, z = Node("x", (16,), dt), Node("y", (16,), dt), Node("z", (16,), dt)
            out.append(program(
                f"elementwise.pow_special_scalar.{name}.{dt}", ir.apply(Op.POW, x, scalar, into=y),
                ir.apply(Op.POW, scalar, x, into=z), inputs=[(x, values(dt, (16,), "few"))], outputs=[y, z]))
        for name, zero in (("zero", 0.0), ("minus_zero", -0.0)):
            x, y = Node("x", (16,), dt), Node("y", (16,), dt)
            out.append(program(f"elementwise.divide_by_{name}.{dt}", ir.apply(Op.DIV, x, zero, into=y),
                               inputs=[(x, values(dt, (16,)))], outputs=[y]))
    # x ** 0.5 is sqrt(x) (ir.apply), as numpy's: -0.0 at -0.0, NaN at -inf and below 0, in a
    # vectorized loop and its scalar tail alike (found by review: GCC made powf(x, 0.5f) a vector
    # sqrt and left the tail a powf, whose answers there are 0.0 and inf)
    def specials(rng: np.random.Generator) -> Array:
        return np.resize(np.array([-0.0, -np.inf, np.inf, np.nan, -1.0, 0.0, 4.0, 2.0, 1.5, 0.25]), 37)

    for dt in (dtypes.float32, dtypes.float64, *dtypes.HALF):
        x, y = Node("x", (37,), dt), Node("y", (37,), dt)
        out.append(program(f"elementwise.pow_half_specials.{dt}", ir.apply(Op.POW, x, 0.5, into=y),
                           inputs=[(x, specials)], outputs=[y], rtol=0.0, atol=0.0))
    return out


def _edge_values(dt: DType, n: int) -> Gen:
    """Integers at their type's ends (the minimum, the maximum, -1, 0, 1) among random ones of
    the whole range, where C's arithmetic overflows or traps."""

    def gen(rng: np.random.Generator) -> Array:
        info = np.iinfo(dt.np)
        x = rng.integers(info.min, info.max, n, dtype=dt.np, endpoint=True)
        ends = np.array([info.min, info.max, 0, 1, info.max - 1, *((-1, info.min + 1) if dt.is_signed else ())],
                        dt.np)
        x[rng.permutation(n)[: len(ends)]] = ends
        return x

    return gen


def _rows_of(out: Node, x: Node) -> ir.Projections:
    """out[i] accumulates x[i, j] over j."""
    i, j = ir.Symbol("i"), ir.Symbol("j")
    return ir.Projections(((i, x.shape[0]), (j, x.shape[1])), (ir.as_affine(i),), ((ir.as_affine(i), ir.as_affine(j)),))


def integer_edges() -> list[CatalogProgram]:
    """Signed arithmetic that overflows wraps, as in numpy (C leaves it undefined, and
    compilers assume it never happens: ``a + 1 > a`` folds to true); a division by zero
    gives 0 and the minimum over -1 the minimum (C's ``/`` traps on both). The comparison
    after the sum is what an optimizer would fold."""
    out = []
    n = 64
    for dt in (dtypes.int32, dtypes.int64, dtypes.uint8):
        for op in (Op.ADD, Op.SUB, Op.MUL, Op.DIV):
            a, b, r = Node("a", (n,), dt), Node("b", (n,), dt), Node(f"r_{op.value}", (n,), dt)
            out.append(program(
                f"elementwise.int_edges.{op.value}.{dt}", ir.apply(op, a, b, into=r),
                inputs=[(a, _edge_values(dt, n)), (b, _edge_values(dt, n))], outputs=[r],
            ))
        if dt.is_signed:  # (uint8 >= 0 is always true, and NVRTC warns of it)
            # a sum of non-negative values compared with 0: LLVM folded it to true
            x, y = Node("x", (16, 4), dt), Node("y", (16, 4), dt)
            sums = Node("row_sums", (16,), dt, mode=ir.MemoryMode.MATERIALIZED)  # read by the compare too
            nonneg = Node("row_sums_ge_0", (16,), dtypes.bool_)
            prods, big = Node("row_prods", (16,), dt), Node("x_big", (16, 4), dt)

            def near_max(rng: np.random.Generator, dt: DType = dt) -> Array:
                return (np.iinfo(dt.np).max - rng.integers(0, 3, (16, 4))).astype(dt.np)

            out.append(program(
                f"elementwise.int_edges.row_sums_compare.{dt}", ir.apply(Op.RELU, x, into=y),
                ir.einsum("ij->i", y, into=sums), ir.apply(Op.GE, sums, 0, into=nonneg),
                ir.apply(Op.ID, x, into=big), ir.Accum(prods, ir.AccumOp.MUL, Op.ID, (big,), _rows_of(prods, big),
                                                       init_neutral=True),
                inputs=[(x, near_max)], outputs=[sums, nonneg, prods], virtual=(y,),
            ))
        a, t, gt = Node("a", (n,), dt), Node("t", (n,), dt), Node("a_plus_1_gt_a", (n,), dtypes.bool_)
        neg, ab = Node("r_neg", (n,), dt), Node("r_abs", (n,), dt)
        out.append(program(
            f"elementwise.int_edges.neg_abs_sum_compare.{dt}", ir.apply(Op.ADD, a, 1, into=t),
            ir.apply(Op.GT, t, a, into=gt), ir.apply(Op.NEG, a, into=neg), ir.apply(Op.ABS, a, into=ab),
            inputs=[(a, _edge_values(dt, n))], outputs=[gt, neg, ab], virtual=(t,),
        ))
    return out


def _out_of_uint8(dt: DType, n: int) -> Gen:
    def gen(rng: np.random.Generator) -> Array:
        return rng.uniform(-1000.0, 1000.0, n).astype(dt.np)

    return gen


def casts() -> list[CatalogProgram]:
    out = []
    for src in (dtypes.float32, dtypes.float64, dtypes.float16):  # beyond uint8: wraps
        n = 4096  # PoCL saturated only in its vector loop
        a, r = Node(f"a_{src}", (n,), src), Node("r_uint8", (n,), dtypes.uint8)
        out.append(program(
            f"cast.{src}_to_uint8_out_of_range", ir.apply(Op.CAST, a, into=r),
            inputs=[(a, _out_of_uint8(src, n))], outputs=[r],
        ))
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
