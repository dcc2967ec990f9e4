"""Programs of the half types (float16, bfloat16) beyond each op and cast.

In the catalog (:func:`half_programs`): fused chains whose intermediates round per op, mixed
precision (float32 weights cast to half), reductions in float32 accumulators (per cell,
split, column, staged, a group per cell), accumulation onto the context, and serial
accumulation that rounds at every update. Apart (:func:`hostile`, which the kit's
``check_half_special_values`` runs; catalog values stay finite): hostile values, NaN, inf,
overflow on store, subnormals, rounding ties, compared exactly."""

from __future__ import annotations

import functools

import numpy as np

from polyjit.core import dtypes, ir
from polyjit.core.ir import AccumOp, Node, Op, Symbol
from polyjit.testing.programs.base import Array, CatalogProgram, Gen, program, values


def _fixed(arr: Array) -> Gen:
    return lambda rng: arr


def hostile_float32() -> Array:
    """float32 values whose conversion to a half type is hard to get right: signed zeros,
    inf, NaN, the largest finite halves and the values that round to inf, subnormals and
    values below the smallest one, and exact ties between two halves (to even, either way)."""
    f16_ties = [1 + 2.0**-11, 1 + 3 * 2.0**-11, 2048 + 1, 2048 + 3, 2.0**-24 * 1.5, 2.0**-24 * 2.5, 2.0**-25]
    bf16_ties = [1 + 2.0**-8, 1 + 3 * 2.0**-8, 256 + 1, 256 + 3, 2.0**-133 * 1.5, 2.0**-133 * 2.5]
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65519.0, 65520.0, 65536.0, 1e10, -1e10,
                6.1035156e-05, 6.0e-05, 5.96e-08, 2.98e-08, 2.9e-08, 1e-30, 3.3895314e38, 3.3961776e38,
                3.4028235e38, 1.4e-45, -1.4e-45, 1.0, -1.5, 0.1, 1.0 / 3.0]
    vals = specials + f16_ties + bf16_ties + [-v for v in f16_ties + bf16_ties]
    with np.errstate(all="ignore"):
        return np.array(vals, dtype=np.float32)


def hostile() -> list[CatalogProgram]:
    """Stores of hostile float32 values, and ops whose results overflow, vanish or tie."""
    out = []
    src = hostile_float32()
    n = src.size
    for dt in dtypes.HALF:
        x, h = Node("x", (n,), dtypes.float32), Node("h", (n,), dt)
        back, dbl, half_of, inc = (Node("back", (n,), dtypes.float32), Node("dbl", (n,), dt),
                                   Node("half_of", (n,), dt), Node("inc", (n,), dt))
        results = (h, back, dbl, half_of, inc)
        comp = ir.Comp.of(
            ir.apply(Op.CAST, x, into=h),  # float32 -> half: ties, overflow, subnormals, NaN
            ir.apply(Op.CAST, h, into=back),  # and back, exactly
            ir.apply(Op.MUL, h, 2.0, into=dbl),  # overflows to inf
            ir.apply(Op.MUL, h, 0.5, into=half_of),  # subnormal results and their ties
            ir.apply(Op.ADD, h, 1.0, into=inc),  # ties between the sum's neighbours
            embedded=results,
        )
        out.append(program(f"half.hostile_stores.{dt}", comps=[comp], inputs=[(x, _fixed(src))],
                           outputs=results, rtol=0.0, atol=0.0))  # exactly: NaN matches NaN, inf inf
        # float64 -> half rounds once (through float32 rounded to odd), as numpy does
        d, hd = Node("d", (6,), dtypes.float64), Node("hd", (6,), dt)
        eps = 2.0**-11 if dt is dtypes.float16 else 2.0**-8
        near = np.array([1 + eps + 2.0**-40, 1 + eps - 2.0**-40, 1 + eps, -(1 + eps + 2.0**-40), 1e300, -1e-300])
        out.append(program(f"half.float64_rounds_once.{dt}", ir.apply(Op.CAST, d, into=hd),
                           inputs=[(d, _fixed(near))], outputs=[hd], rtol=0.0, atol=0.0))
    return out


def chains() -> list[CatalogProgram]:
    """Fused chains (per-op rounding inside one kernel) and mixed precision."""
    out = []
    shape = (4, 50)
    for dt in dtypes.HALF:
        a, b, c = (Node(nm, shape, dt) for nm in "abc")
        t1, t2, t3, r = Node("t1", shape, dt), Node("t2", shape, dt), Node("t3", shape, dt), Node("r", shape, dt)
        f = functools.partial(values, dt)
        out.append(program(
            f"half.fused_chain.{dt}",
            ir.apply(Op.MUL, a, b, into=t1), ir.apply(Op.ADD, t1, c, into=t2),
            ir.apply(Op.TANH, t2, into=t3), ir.apply(Op.SUB, t3, 1.0, into=r),
            inputs=[(a, f(shape)), (b, f(shape)), (c, f(shape))], outputs=[r], virtual=(t1, t2, t3),
        ))
        # mixed precision: float32 weights cast to the half type, a half matmul and bias, the
        # activation cast back to float32 and summed there
        x, w, bias = Node("x", (8, 12), dt), Node("w", (12, 6), dtypes.float32), Node("bias", (6,), dtypes.float32)
        wh, bh, mm, biased = Node("wh", (12, 6), dt), Node("bh", (6,), dt), Node("mm", (8, 6), dt), Node("bd", (8, 6), dt)
        act, act32, total = Node("act", (8, 6), dt), Node("act32", (8, 6), dtypes.float32), Node("total", (), dtypes.float32)
        layer = ir.Comp.of(
            ir.apply(Op.CAST, w, into=wh), ir.apply(Op.CAST, bias, into=bh),
            ir.einsum("ik,kj->ij", x, wh, into=mm), ir.apply(Op.ADD, mm, bh, into=biased),
            ir.apply(Op.RELU, biased, into=act), ir.apply(Op.CAST, act, into=act32),
            ir.einsum("ij->", act32, into=total),
            embedded=(act32, total),
        )
        out.append(program(
            f"half.mixed_precision_layer.{dt}", comps=[layer],
            inputs=[(x, values(dt, x.shape)), (w, values(dtypes.float32, w.shape)),
                    (bias, values(dtypes.float32, bias.shape))],
            outputs=[act32, total], virtual=(biased,), absent=(wh, bh, mm),
        ))
    return out


def reductions() -> list[CatalogProgram]:
    """Float32 accumulators in each kernel shape, onto the context, and serial updates."""
    out = []
    for dt in dtypes.HALF:
        # a group per cell on GPUs (few, long rows), a column reduction and a staged one on the CPU
        g, gs = Node("g", (3, 2048), dt), Node("gs", (3,), dt)
        col, cs = Node("col", (40, 64), dt), Node("cs", (64,), dt)
        st, e, es = Node("st", (6, 100), dt), Node("e", (6, 100), dt), Node("es", (6,), dt)
        out.append(program(
            f"half.reduction_shapes.{dt}",
            comps=[ir.Comp.of(ir.einsum("ij->i", g, into=gs)), ir.Comp.of(ir.einsum("ij->j", col, into=cs)),
                   ir.Comp.of(ir.apply(Op.EXP, st, into=e), ir.einsum("ij->i", e, into=es))],
            inputs=[(g, values(dt, g.shape)), (col, values(dt, col.shape)), (st, values(dt, st.shape, "exp"))],
            outputs=[gs, cs, es], virtual=(e,),
        ))
        # onto what the context holds, run after run: the cell starts the float32 accumulator
        x, s = Node("x", (5, 8), dt), Node("s", (5,), dt)
        out.append(program(f"half.sum_onto_context.{dt}", ir.einsum("ij->i", x, into=s, init_neutral=False),
                           inputs=[(x, values(dt, x.shape)), (s, values(dt, s.shape))],
                           outputs=[s], runs=({}, {}, {})))
        # non-injective (out[i + j] += ...): serial updates, each rounded, in order. Values near
        # 1 make the roundings of a long run of updates visible.
        i, j = Symbol("i"), Symbol("j")
        pa, pc = Node("pa", (40, 8), dt), Node("pc", (47,), dt)
        conv = ir.Accum(pc, AccumOp.ADD, Op.ID, (pa,), ir.projections([(i, 40), (j, 8)], [ir.affine((1, i), (1, j))],
                                                                       [i, j]))
        out.append(program(f"half.serial_updates_round.{dt}", conv,
                           inputs=[(pa, values(dt, pa.shape, "unit"))], outputs=[pc]))
    return out


def half_programs() -> list[CatalogProgram]:
    """The catalog's half programs (not :func:`hostile`)."""
    return [*chains(), *reductions()]
