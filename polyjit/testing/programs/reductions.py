"""Catalog programs: reductions with each AccumOp, matmul and batched matmul."""

from __future__ import annotations

from polyjit.core import dtypes, ir
from polyjit.core.ir import AccumOp, Node, Op, Symbol
from polyjit.testing.programs.base import CatalogProgram, f32, program, values


def reductions() -> list[CatalogProgram]:
    out = []
    red_dtypes = (dtypes.float32, dtypes.float64, dtypes.int32, dtypes.int64, dtypes.uint8, *dtypes.HALF)
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
    a3, r3 = f32("a", (4, 5, 6)), f32("r", (5,))
    out.append(program("reduce.middle_axis_kept", ir.einsum("ijk->j", a3, into=r3),
                       inputs=[(a3, values(dtypes.float32, a3.shape, "quarter"))], outputs=[r3]))
    # a reduction over an empty axis gives the neutral element
    e = f32("e", (4, 0))
    r_sum, r_max = f32("s", (4,)), f32("m", (4,))
    out.append(program("reduce.empty_axis",
                       comps=[ir.Comp.of(ir.einsum("ij->i", e, into=r_sum)),
                              ir.Comp.of(ir.einsum("ij->i", e, into=r_max, accum=AccumOp.MAX))],
                       inputs=[(e, values(dtypes.float32, e.shape))], outputs=[r_sum, r_max]))
    # reversed reads inside float reductions (GCC 12 -O3 once summed these wrongly); the half
    # types' long ones split into float32 partial results
    for dt in (dtypes.float32, dtypes.float64, *dtypes.HALF):
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
    x, sq, ss = f32("x", (8, 33)), f32("sq", (8, 33)), f32("ss", (8,))
    out.append(program("reduce.sum_of_squares",
                       ir.apply(Op.MUL, x, x, into=sq), ir.einsum("ij->i", sq, into=ss),
                       inputs=[(x, values(dtypes.float32, x.shape))], outputs=[ss], rtol=1e-5,
                       virtual=(sq,)))
    return out


def matmuls() -> list[CatalogProgram]:
    out = []
    for dt, (m, k, n) in [
        (dtypes.float32, (13, 17, 11)),
        (dtypes.float32, (24, 9, 64)),  # full register tiles
        (dtypes.float32, (50, 31, 37)),  # full and edge tiles
        (dtypes.float32, (5, 33, 20)),  # fewer rows than a tile; a vector and a few lanes
        (dtypes.float32, (7, 12, 48)),  # whole vectors past the last whole tile
        (dtypes.float32, (256, 16, 10)),  # a classifier head: every tile is narrow
        (dtypes.float32, (0, 5, 20)),  # no rows: no tiles (the C tiles once closed a brace twice)
        (dtypes.float32, (6, 3, 0)),  # no columns
        (dtypes.float32, (4, 0, 3)),  # nothing to sum: zeros
        (dtypes.float64, (11, 6, 24)),
        (dtypes.float64, (13, 17, 37)),
        (dtypes.int32, (7, 5, 9)),
        (dtypes.int64, (12, 20, 33)),
        (dtypes.uint8, (6, 7, 8)),
        (dtypes.float16, (13, 17, 11)),  # the half types: float32 accumulators, never tiles
        (dtypes.float16, (53, 38, 20)),  # 20 accumulators on the stack: GCC 12 misaligned them
        (dtypes.bfloat16, (24, 9, 64)),
    ]:
        a, b, c = Node("a", (m, k), dt), Node("b", (k, n), dt), Node("c", (m, n), dt)
        kind = "quarter" if dt.is_float else "any"
        out.append(program(f"matmul.{dt}.{m}x{k}x{n}", ir.einsum("ik,kj->ij", a, b, into=c),
                           inputs=[(a, values(dt, a.shape, kind)), (b, values(dt, b.shape, kind))],
                           outputs=[c]))
    a, b, c = f32("a", (19, 23)), f32("b", (23, 29)), f32("c", (19, 29))
    out.append(program("matmul.float32.random_values", ir.einsum("ik,kj->ij", a, b, into=c),
                       inputs=[(a, values(dtypes.float32, a.shape)), (b, values(dtypes.float32, b.shape))],
                       outputs=[c], rtol=1e-4, atol=1e-4))
    at, bt, ct = f32("at", (9, 14)), f32("bt", (20, 9)), f32("ct", (14, 20))
    out.append(program("matmul.transposed_operands", ir.einsum("ki,jk->ij", at, bt, into=ct),
                       inputs=[(at, values(dtypes.float32, at.shape, "quarter")),
                               (bt, values(dtypes.float32, bt.shape, "quarter"))], outputs=[ct]))
    # x contiguous along i and fewer output columns than a vector: the CPU's tiles run their
    # vectors down the columns (patterns.down_columns); whole vectors, a masked last one, a
    # tile of only a masked vector, a batch, a sum onto the output's values, and a shallow k
    # (a small batch's gradient), which keeps the tiles along the rows
    for dt, (k, m, n), batch, neutral in [
        (dtypes.float32, (40, 70, 10), 0, True),
        (dtypes.float32, (19, 16, 2), 0, True),
        (dtypes.float32, (20, 37, 3), 2, True),
        (dtypes.float32, (21, 45, 7), 0, False),
        (dtypes.float32, (6, 40, 5), 0, False),
        (dtypes.float64, (17, 29, 5), 0, True),
        (dtypes.float64, (18, 20, 3), 0, False),
    ]:
        lead = (batch,) if batch else ()
        na, nb, nc = Node("a", (*lead, k, m), dt), Node("b", (*lead, k, n), dt), Node("c", (*lead, m, n), dt)
        spec = "bki,bkj->bij" if batch else "ki,kj->ij"
        ins = [(na, values(dt, na.shape, "quarter")), (nb, values(dt, nb.shape, "quarter"))]
        if not neutral:
            ins.append((nc, values(dt, nc.shape, "quarter")))
        name = f"matmul.narrow_columns.{dt}.{'b' if batch else ''}{k}x{m}x{n}{'' if neutral else '.onto'}"
        out.append(program(name, ir.einsum(spec, na, nb, into=nc, init_neutral=neutral), inputs=ins, outputs=[nc]))
    ab, bb, cb = f32("a", (3, 10, 6)), f32("b", (3, 6, 21)), f32("c", (3, 10, 21))
    out.append(program("matmul.batched", ir.einsum("bik,bkj->bij", ab, bb, into=cb),
                       inputs=[(ab, values(dtypes.float32, ab.shape, "quarter")),
                               (bb, values(dtypes.float32, bb.shape, "quarter"))], outputs=[cb]))
    ab2, bs, cb2 = Node("a", (4, 5, 7), dtypes.float64), Node("b", (7, 3), dtypes.float64), Node("c", (4, 5, 3), dtypes.float64)
    out.append(program("matmul.batched_shared_rhs", ir.einsum("bik,kj->bij", ab2, bs, into=cb2),
                       inputs=[(ab2, values(dtypes.float64, ab2.shape)), (bs, values(dtypes.float64, bs.shape))],
                       outputs=[cb2]))
    u, v, o = f32("u", (7,)), f32("v", (11,)), f32("o", (7, 11))
    out.append(program("einsum.outer", ir.einsum("i,j->ij", u, v, into=o),
                       inputs=[(u, values(dtypes.float32, u.shape)), (v, values(dtypes.float32, v.shape))],
                       outputs=[o]))
    p, q, d = Node("p", (40,), dtypes.int64), Node("q", (40,), dtypes.int64), Node("d", (), dtypes.int64)
    out.append(program("einsum.dot", ir.einsum("i,i->", p, q, into=d),
                       inputs=[(p, values(dtypes.int64, p.shape)), (q, values(dtypes.int64, q.shape))],
                       outputs=[d]))
    mm, vv, mv = f32("m", (12, 30)), f32("v", (30,)), f32("mv", (12,))
    out.append(program("einsum.matvec", ir.einsum("ij,j->i", mm, vv, into=mv),
                       inputs=[(mm, values(dtypes.float32, mm.shape, "quarter")),
                               (vv, values(dtypes.float32, vv.shape, "quarter"))], outputs=[mv]))
    h, w, mx = f32("h", (6, 8)), f32("w", (8, 5)), f32("mx", (6, 5))
    out.append(program("einsum.max_plus_product", ir.einsum("ik,kj->ij", h, w, into=mx, accum=AccumOp.MAX),
                       inputs=[(h, values(dtypes.float32, h.shape)), (w, values(dtypes.float32, w.shape))],
                       outputs=[mx]))
    return out
