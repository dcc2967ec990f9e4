"""Catalog programs: fetches (fill, range, constant, slice at a static index), Seq/Block, several
computations in one batch, explicit memory modes, and large programs."""

from __future__ import annotations

import numpy as np

from polyjit.core import dtypes, ir
from polyjit.core.ir import AccumOp, MemoryMode, Node, Op, StaticSymbol, Symbol
from polyjit.testing.programs.base import Array, CatalogProgram, Gen, f32, program, values


def fetches() -> list[CatalogProgram]:
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
    src, sl, r = f32("src", (4, 3, 5)), f32("slice", (3, 5)), f32("r", (3, 5))
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
    xs, w, o = f32("xs", (5, 9)), f32("w", (9,)), f32("o", (9,))
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


def _hostile_indices(rows: int, shape: tuple[int, ...]) -> Gen:
    """Indices into ``rows`` rows, repeats, and a few outside them (-1, rows, and int32's
    extremes): a gather clamps them to the nearest row, and nothing reads or writes outside."""
    def gen(rng: np.random.Generator) -> Array:
        idx = rng.integers(0, rows, shape).astype(np.int32)
        flat = idx.reshape(-1)
        for k, bad in enumerate((-1, rows, np.iinfo(np.int32).min, np.iinfo(np.int32).max)):
            if 3 * k + 1 < flat.size:
                flat[3 * k + 1] = bad
        return idx
    return gen


def rows_by_data() -> list[CatalogProgram]:
    """Rows picked by data: a gather (an embedding) and its adjoint scatter-add, whose rows
    picked twice add up in order; indices repeated and out of range (clamped)."""
    out = []
    for dt in (dtypes.float32, dtypes.float64, dtypes.float16, dtypes.bfloat16, dtypes.int32):
        table, idx = Node("table", (7, 2, 3), dt), Node("idx", (5, 4), dtypes.int32)
        picked, summed = Node("picked", (5, 4, 2, 3), dt), Node("summed", (7, 2, 3), dt)
        kind = "quarter" if dt.is_float else "small"  # sums exact in any order
        out.append(program(
            f"rows.gather_scatter_add.{dt}",
            comps=[ir.Comp.of(ir.gather(table, idx, picked)), ir.Comp.of(ir.scatter_add(idx, picked, summed))],
            inputs=[(table, values(dt, table.shape, kind)), (idx, _hostile_indices(7, idx.shape))],
            outputs=[picked, summed]))
    # uint8 indices (session 32: the clamps compared them with 0, and with rows beyond their range,
    # and the compilers warned): a table they cannot pass the end of, and one they can
    for rows in (7, 300):
        table, idx = f32(f"u8table{rows}", (rows, 3)), Node("u8idx", (6, 5), dtypes.uint8)
        picked, summed = f32("u8picked", (6, 5, 3)), f32(f"u8summed{rows}", (rows, 3))

        def every_uint8(rng: np.random.Generator, shape: tuple[int, ...] = idx.shape) -> Array:
            return rng.integers(0, 256, shape).astype(np.uint8)

        out.append(program(
            f"rows.gather_scatter_add.uint8_indices.{rows}_rows",
            comps=[ir.Comp.of(ir.gather(table, idx, picked)), ir.Comp.of(ir.scatter_add(idx, picked, summed))],
            inputs=[(table, values(dtypes.float32, table.shape, "quarter")),
                    (idx, every_uint8)],
            outputs=[picked, summed]))
    # a gather read by a contraction (the embedding of a language model), and an int64 index
    # into a table of vectors, its result reshaped
    emb, tok = f32("emb", (27, 16)), Node("tok", (12, 8), dtypes.int64)
    e, feats, w, h = f32("e", (12, 8, 16)), f32("feats", (12, 128)), f32("w", (128, 10)), f32("h", (12, 10))
    out.append(program(
        "rows.embedding_into_matmul",
        ir.gather(emb, tok, e), ir.reshape(feats, e), ir.einsum("ik,kj->ij", feats, w, into=h),
        inputs=[(emb, values(dtypes.float32, emb.shape, "quarter")),
                (tok, lambda rng: rng.integers(0, 27, tok.shape)), (w, values(dtypes.float32, w.shape, "quarter"))],
        outputs=[h], rtol=1e-5, atol=1e-5))
    return out


def structure() -> list[CatalogProgram]:
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
    x, y, s = f32("x", (8,)), f32("y", (8,)), f32("s", ())
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
    emb_in, emb_mid, emb_out = f32("ei", (6,)), f32("em", (6,)), f32("eo", (6,))
    out.append(program("modes.embedded_intermediate",
                       comps=[ir.Comp.of(ir.apply(Op.EXP, emb_in, into=emb_mid),
                                         ir.apply(Op.ADD, emb_mid, 1.0, into=emb_out),
                                         embedded=[emb_mid, emb_out])],
                       inputs=[(emb_in, values(dtypes.float32, (6,), "exp"))], outputs=[emb_mid, emb_out],
                       present=(emb_mid, emb_out)))
    return out


def large() -> list[CatalogProgram]:
    """Sizes past the CPU dialect's OpenMP thresholds (parallel loops, parallel reductions)."""
    out = []
    shape = (300, 200)
    a, b, r = f32("a", shape), f32("b", shape), f32("r", shape)
    t = f32("t", shape)
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
    # every loop too short to split alone (under 32 values): the outer ones index the parts
    xq = Node("xq", (16, 16, 16, 16), dtypes.int64)
    qs, qx = Node("qs", (), dtypes.int64), Node("qx", (), dtypes.int64)
    ca, cb, cs = f32("ca", (16, 16, 16)), f32("cb", (16, 16)), f32("cs", ())
    cc, ct = f32("cc", (16, 16, 16)), f32("ct", ())  # parts kernel: a tiled contraction
    out.append(program("large.full_reductions_of_short_loops",
                       comps=[ir.Comp.of(ir.einsum("ijkl->", xq, into=qs)),
                              ir.Comp.of(ir.einsum("ijkl->", xq, into=qx, accum=AccumOp.MAX)),
                              ir.Comp.of(ir.einsum("ijk,kl->", ca, cb, into=cs)),
                              ir.Comp.of(ir.einsum("ikl,klj->", ca, cc, into=ct))],
                       inputs=[(xq, values(dtypes.int64, xq.shape)), (ca, values(dtypes.float32, ca.shape, "quarter")),
                               (cb, values(dtypes.float32, cb.shape, "quarter")),
                               (cc, values(dtypes.float32, cc.shape, "quarter"))],
                       outputs=[qs, qx, cs, ct]))
    y = f32("y", (400, 250))
    ys = f32("ys", ())
    out.append(program("large.full_sum_float32", ir.einsum("ij->", y, into=ys),
                       inputs=[(y, values(dtypes.float32, y.shape, "quarter"))], outputs=[ys]))
    big = Node("big", (256, 160), dtypes.float32)
    rows = Node("rows", (256,), dtypes.float32)
    out.append(program("large.row_max", ir.einsum("ij->i", big, into=rows, accum=AccumOp.MAX),
                       inputs=[(big, values(dtypes.float32, big.shape))], outputs=[rows]))
    ma, mb, mc = f32("ma", (96, 80)), f32("mb", (80, 72)), f32("mc", (96, 72))
    out.append(program("large.matmul", ir.einsum("ik,kj->ij", ma, mb, into=mc),
                       inputs=[(ma, values(dtypes.float32, ma.shape, "quarter")),
                               (mb, values(dtypes.float32, mb.shape, "quarter"))], outputs=[mc]))
    # b not contiguous along the output's columns (a @ b.T, a.T @ b.T, attention's q @ k.T): b is
    # laid out [.., k, j] in scratch first, then tiled (lower.transpose_y)
    for name, spec, sa, sb, so in (("b_transposed", "ik,jk->ij", (96, 80), (72, 80), (96, 72)),
                                   ("both_transposed", "ki,jk->ij", (80, 96), (72, 80), (96, 72)),
                                   ("batched_b_transposed", "bik,bjk->bij", (3, 40, 24), (3, 36, 24), (3, 40, 36))):
        ta, tb, tc = f32("ta", sa), f32("tb", sb), f32("tc", so)
        out.append(program(f"large.matmul_{name}", ir.einsum(spec, ta, tb, into=tc),
                           inputs=[(ta, values(dtypes.float32, sa, "quarter")),
                                   (tb, values(dtypes.float32, sb, "quarter"))], outputs=[tc]))
    return out
