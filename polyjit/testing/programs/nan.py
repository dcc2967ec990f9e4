"""Programs that feed NaN to max, min and relu (which the kit's ``check_nan_propagation``
runs; catalog values stay finite).

A float max or min is NaN where either operand is, as numpy's ``maximum`` and ``max`` and
PyTorch's are: relu(NaN) is NaN, and a row's max is NaN where the row holds one. Each
kernel shape that combines maxima is here, with NaN first, in the middle and last, in rows
beside rows without one: elementwise in both operand orders and in a matmul's epilogue, per
cell over rows and down columns, a whole array in one reduction (OpenMP's parallel
reduction on the CPU), a long one split into partial results (an OpenMP simd reduction on
the CPU, a group's tree on a GPU), and onto what the context holds. Compared exactly: NaN
matches NaN.

``signed_zero_programs``: max and min over +0 and -0. Elementwise, ``b`` where the operands
are equal, exactly as the reference; a reduction's zero may take either sign (its lanes and
threads combine in an order of the backend's, as numpy's and PyTorch's vectorized
reductions), but its values must be exact."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from polyjit.core import dtypes, ir
from polyjit.core.dtypes import DType
from polyjit.core.ir import AccumOp, Node, Op
from polyjit.testing.programs.base import Array, CatalogProgram, Gen, program, values

FLOATS: tuple[DType, ...] = (dtypes.float32, dtypes.float64, *dtypes.HALF)


def with_nans(dt: DType, shape: tuple[int, ...], cells: Sequence[tuple[int, ...]]) -> Gen:
    """Random values of ``dt`` (multiples of 1/4, so that ties happen) with NaN at ``cells``."""
    base = values(dt, shape, "quarter")

    def gen(rng: np.random.Generator) -> Array:
        x = np.array(base(rng), dtype=np.float64)
        for c in cells:
            x[c] = np.nan
        return x

    return gen


def _ends(rows: int, n: int) -> list[tuple[int, int]]:
    """NaN first in row 0, in the middle of row 1, last in row 2; the other rows hold none."""
    return [(0, 0), (1, n // 2), (2, n - 1)][:rows]


def nan_programs() -> list[CatalogProgram]:
    out = []
    for dt in FLOATS:
        rows, n = 6, 37
        a, b = Node("a", (rows, n), dt), Node("b", (rows, n), dt)
        a_nans = _ends(rows, n)
        b_nans = [(0, n - 1), (1, n // 2), (3, 5)]  # (1, n // 2): NaN in both
        outs = [Node(nm, (rows, n), dt) for nm in ("max_ab", "max_ba", "min_ab", "min_ba", "relu")]
        comp = ir.Comp.of(ir.apply(Op.MAX, a, b, into=outs[0]), ir.apply(Op.MAX, b, a, into=outs[1]),
                          ir.apply(Op.MIN, a, b, into=outs[2]), ir.apply(Op.MIN, b, a, into=outs[3]),
                          ir.apply(Op.RELU, a, into=outs[4]), embedded=tuple(outs))
        out.append(program(f"nan.elementwise.{dt}", comps=[comp],
                           inputs=[(a, with_nans(dt, a.shape, a_nans)), (b, with_nans(dt, b.shape, b_nans))],
                           outputs=outs, rtol=0.0, atol=0.0))
        for acc in (AccumOp.MAX, AccumOp.MIN):
            by_rows, by_cols, whole = Node("rows", (rows,), dt), Node("cols", (n,), dt), Node("all", (), dt)
            out.append(program(
                f"nan.reduce.{acc.value}.{dt}",
                comps=[ir.Comp.of(ir.einsum("ij->i", a, into=by_rows, accum=acc)),
                       ir.Comp.of(ir.einsum("ij->j", a, into=by_cols, accum=acc)),
                       ir.Comp.of(ir.einsum("ij->", a, into=whole, accum=acc))],
                inputs=[(a, with_nans(dt, a.shape, a_nans))], outputs=[by_rows, by_cols, whole],
                rtol=0.0, atol=0.0))
            # onto the context: a NaN already there stays, and one from the values gets in
            onto, src = Node("onto", (rows,), dt), Node("src", (rows, n), dt)
            out.append(program(
                f"nan.reduce_onto_context.{acc.value}.{dt}",
                ir.einsum("ij->i", src, into=onto, accum=acc, init_neutral=False),
                inputs=[(onto, with_nans(dt, onto.shape, [(4,)])), (src, with_nans(dt, src.shape, a_nans))],
                outputs=[onto], rtol=0.0, atol=0.0))
    for dt in (dtypes.float32, dtypes.float64):
        for length in (1 << 16, 100_003):  # split into 256 partial results; prime: left whole
            for at in (0, length // 3, length - 1):
                x, hi, lo = Node("x", (length,), dt), Node("hi", (), dt), Node("lo", (), dt)
                out.append(program(
                    f"nan.long_reduce.{dt}.{length}.at{at}",
                    comps=[ir.Comp.of(ir.einsum("i->", x, into=hi, accum=AccumOp.MAX)),
                           ir.Comp.of(ir.einsum("i->", x, into=lo, accum=AccumOp.MIN))],
                    inputs=[(x, with_nans(dt, x.shape, [(at,)]))], outputs=[hi, lo], rtol=0.0, atol=0.0))
    # relu in a matmul's epilogue (the CPU's register tiles), NaN from x's rows
    f32 = dtypes.float32
    x, w, bias = Node("x", (9, 12), f32), Node("w", (12, 20), f32), Node("bias", (20,), f32)
    mm, biased, act = Node("mm", (9, 20), f32), Node("biased", (9, 20), f32), Node("act", (9, 20), f32)
    out.append(program(
        "nan.relu_epilogue", ir.einsum("ik,kj->ij", x, w, into=mm),
        ir.apply(Op.ADD, mm, bias, into=biased), ir.apply(Op.RELU, biased, into=act),
        inputs=[(x, with_nans(f32, x.shape, [(0, 0), (4, 11)])), (w, values(f32, w.shape, "quarter")),
                (bias, values(f32, bias.shape, "quarter"))],
        outputs=[act], virtual=(biased,), rtol=0.0, atol=0.0))
    return out


def zeros_of_both_signs(dt: DType, shape: tuple[int, ...]) -> Gen:
    """+0 and -0 at random, a row of -0 only, a row of +0 only, and a 1 in the last row."""
    def gen(rng: np.random.Generator) -> Array:
        x = np.where(rng.random(shape) < 0.5, -0.0, 0.0)
        x[0] = -0.0
        x[1] = 0.0
        x[-1, -1] = 1.0
        return x

    return gen


# Far below the values these programs make (0 and 1), and 0 in float32's and the half types'
# arithmetic: the values must be exact, and a zero's sign is not compared (harness.compare
# compares it at zero tolerance only).
ZERO_SIGN_FREE = 1e-300


def signed_zero_programs() -> list[CatalogProgram]:
    out = []
    for dt in FLOATS:
        for n in (3, 7, 16, 33, 100, 700):
            rows = 5
            a, b = Node("a", (rows, n), dt), Node("b", (rows, n), dt)
            reduced = [Node(f"{acc.value}_{k}", shape, dt) for acc in (AccumOp.MAX, AccumOp.MIN)
                       for k, shape in (("rows", (rows,)), ("cols", (n,)), ("all", ()))]
            comps = []
            for acc, (by_rows, by_cols, whole) in ((AccumOp.MAX, reduced[:3]), (AccumOp.MIN, reduced[3:])):
                comps += [ir.Comp.of(ir.einsum("ij->i", a, into=by_rows, accum=acc)),
                          ir.Comp.of(ir.einsum("ij->j", a, into=by_cols, accum=acc)),
                          ir.Comp.of(ir.einsum("ij->", a, into=whole, accum=acc))]
            out.append(program(f"signed_zero.reduce.{dt}.{n}", comps=comps,
                               inputs=[(a, zeros_of_both_signs(dt, a.shape))], outputs=reduced,
                               rtol=0.0, atol=ZERO_SIGN_FREE))
            pairs = [Node(nm, (rows, n), dt) for nm in ("max_ab", "max_ba", "min_ab", "min_ba", "relu")]
            comp = ir.Comp.of(ir.apply(Op.MAX, a, b, into=pairs[0]), ir.apply(Op.MAX, b, a, into=pairs[1]),
                              ir.apply(Op.MIN, a, b, into=pairs[2]), ir.apply(Op.MIN, b, a, into=pairs[3]),
                              ir.apply(Op.RELU, a, into=pairs[4]), embedded=tuple(pairs))
            out.append(program(f"signed_zero.elementwise.{dt}.{n}", comps=[comp],
                               inputs=[(a, zeros_of_both_signs(dt, a.shape)), (b, zeros_of_both_signs(dt, b.shape))],
                               outputs=pairs, rtol=0.0, atol=0.0))
    return out
