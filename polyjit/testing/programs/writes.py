"""Catalog programs: accumulation onto what the context holds, non-surjective and non-injective
writes, fused elementwise chains."""

from __future__ import annotations

import functools

from polyjit.core import dtypes, ir
from polyjit.core.ir import AccumOp, MemoryMode, Node, Op, Symbol
from polyjit.testing.programs.base import CatalogProgram, f32, program, values


def accumulate_onto_context() -> list[CatalogProgram]:
    """Accumulations without init_neutral add onto what the context holds, run after run."""
    out = []
    a, b, c = f32("a", (13, 7)), f32("b", (7, 21)), f32("c", (13, 21))
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


def writes() -> list[CatalogProgram]:
    """Non-surjective, non-injective, strided and fixed-index writes."""
    out = []
    i, j = Symbol("i"), Symbol("j")
    n = 10
    x, o = f32("x", (n,)), f32("o", (n + 5,))
    shift = ir.Accum(o, None, Op.ID, (x,), ir.projections([(i, n)], [ir.affine((1, i), const=3)], [i]))
    out.append(program("write.offset_into_context", shift,
                       inputs=[(x, values(dtypes.float32, x.shape)), (o, values(dtypes.float32, o.shape))],
                       outputs=[o]))
    o2, x = f32("o2", (n + 5,)), f32("x", (n,))
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
    fa, fmx = f32("fa", (5, 5)), f32("fmx", (9,))
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
    # scratch written at two cells after other scratch died: its other cells are zero, not
    # what the scratch before it left in the memory they share
    sx = f32("sx", (64,))
    s1, s2 = Node("s1", (64,), dtypes.float32, MemoryMode.LOCAL), Node("s2", (64,), dtypes.float32, MemoryMode.LOCAL)
    tot, so = f32("stot", ()), f32("so", (64,))
    out.append(program("write.scratch_in_part_after_scratch",
                       ir.apply(Op.MUL, sx, 5.0, into=s1), ir.einsum("i->", s1, into=tot),
                       ir.Accum(s2, None, Op.ID, (tot,), ir.projections([(i, 2)], [i], [])),
                       ir.apply(Op.MUL, s2, 1.0, into=so),
                       inputs=[(sx, values(dtypes.float32, sx.shape, "quarter"))], outputs=[so]))
    return out


def own_target() -> list[CatalogProgram]:
    """Writes that read their own target at other cells: every cell gets the value computed
    from the target as it was before the write (the reference's order), not from cells the
    same kernel already overwrote."""
    out = []
    for n, (m, w) in enumerate(((2, 8), (200, 200))):  # the second shares its range among threads
        i, j = Symbol("i"), Symbol("j")
        a, o = f32(f"a{n}", (m, w)), f32(f"o{n}", (m, w))
        mirror = ir.projections([(i, m), (j, w)], [i, j], [i, j], [i, ir.affine((-1, j), const=w - 1)])
        out.append(program(
            f"own_target.mirror.{m}x{w}", ir.Accum(o, None, Op.ADD, (a, o), mirror),
            inputs=[(a, values(dtypes.float32, a.shape)), (o, values(dtypes.float32, o.shape))], outputs=[o],
        ))
    x = f32("x", (33, 33))
    out.append(program("own_target.transpose_in_place", ir.einsum("ji->ij", x, into=x),
                       inputs=[(x, values(dtypes.float32, x.shape))], outputs=[x]))
    v, mat = f32("v", (24,)), f32("mat", (24, 24))
    q = functools.partial(values, dtypes.float32, kind="quarter")
    out.append(program("own_target.matvec_in_place", ir.einsum("j,ij->i", v, mat, into=v),
                       inputs=[(v, q(v.shape)), (mat, q(mat.shape))], outputs=[v]))
    # an update of some cells from the target's own values: the others keep the context's
    # (once zero-filled as if the target were scratch, since it is read, so not a result)
    i, j = Symbol("i"), Symbol("j")
    wt, mom = f32("wt", (5, 4)), f32("mom", (5, 4))
    part = ir.projections([(i, 4), (j, 3)], [i, ir.affine((1, j), const=1)], [i, ir.affine((1, j), const=1)],
                          [ir.affine((1, i), const=1), j])
    out.append(program("own_target.partial_update", ir.Accum(wt, None, Op.SUB, (wt, mom), part),
                       inputs=[(wt, q(wt.shape)), (mom, q(mom.shape))], outputs=[wt]))
    out += _own_target_windows()
    return out


def _own_target_windows() -> list[CatalogProgram]:
    """Sums over a sliding window (``s[i + j] += ...``: several iterations accumulate into one
    cell) of the target itself, of an elementwise intermediate made from it, and of one that
    broadcasts it: each reads the target's values from before the write, not what earlier
    iterations of the same kernel added (int32: exact)."""
    out = []
    for m, w in ((4, 3), (300, 5)):
        i, j, a, b = Symbol("i"), Symbol("j"), Symbol("a"), Symbol("b")
        window = ir.affine((1, i), (1, j))
        space = [(i, m), (j, w)]
        for init in (True, False):
            s = Node(f"s_{init}", (m + w - 1,), dtypes.int32)
            acc = ir.Accum(s, AccumOp.ADD, Op.ID, (s,), ir.projections(space, [window], [window]), init_neutral=init)
            out.append(program(f"own_target.window.{m}x{w}.{'fresh' if init else 'onto'}", acc,
                               inputs=[(s, values(dtypes.int32, s.shape))], outputs=[s]))
        s, v = Node("s", (m + w - 1,), dtypes.int32), Node("v", (m + w - 1,), dtypes.int32)
        acc = ir.Accum(s, AccumOp.ADD, Op.ID, (v,), ir.projections(space, [window], [window]), init_neutral=False)
        out.append(program(f"own_target.window_of_an_intermediate.{m}x{w}", inputs=[(s, values(dtypes.int32, s.shape))],
                           outputs=[s], comps=[ir.Comp.of(ir.Seq((ir.apply(Op.MUL, s, 2, into=v), acc)), embedded=[s])]))
        s, vb = Node("s", (m + w - 1,), dtypes.int32), Node("vb", (m, w), dtypes.int32)
        spread = ir.Accum(vb, None, Op.MUL, (s, 2), ir.projections([(a, m), (b, w)], [a, b], [ir.affine((1, a), (1, b))]))
        acc = ir.Accum(s, AccumOp.ADD, Op.ID, (vb,), ir.projections(space, [window], [i, j]), init_neutral=False)
        out.append(program(f"own_target.window_of_a_broadcast.{m}x{w}", inputs=[(s, values(dtypes.int32, s.shape))],
                           outputs=[s], comps=[ir.Comp.of(ir.Seq((spread, acc)), embedded=[s])]))
    return out


def epilogues() -> list[CatalogProgram]:
    """A contraction and the elementwise kernel after it that reads it (merged into its
    epilogue where the dialect tiles contractions with one), and the cases that must stay
    apart: the consumer writes an operand, or reads the product at another cell. Sizes cut
    full and edge tiles of rows and columns."""
    out = []
    ON = MemoryMode.ON_DEVICE  # a product read by one consumer is scratch unless kept
    for dt in (dtypes.float32, dtypes.float64):
        q = functools.partial(values, dt, kind="quarter")
        x, w, bias = Node("x", (20, 33), dt), Node("w", (33, 40), dt), Node("bias", (40,), dt)
        h, biased, act = Node("h", (20, 40), dt, ON), Node("biased", (20, 40), dt), Node("act", (20, 40), dt)
        out.append(program(  # bias and activation on each tile; the product is kept as well
            f"epilogue.bias_relu.{dt}", ir.einsum("ik,kj->ij", x, w, into=h),
            ir.apply(Op.ADD, h, bias, into=biased), ir.apply(Op.RELU, biased, into=act),
            inputs=[(x, q(x.shape)), (w, q(w.shape)), (bias, q(bias.shape))], outputs=[h, act],
            virtual=(biased,),
        ))
        # the same with w stored [out, in] (x @ w.T): w is laid out [in, out] in scratch first
        wt_ = Node("wt", (40, 33), dt)
        h2, biased2, act2 = Node("h2", (20, 40), dt, ON), Node("biased2", (20, 40), dt), Node("act2", (20, 40), dt)
        out.append(program(
            f"epilogue.bias_relu_w_transposed.{dt}", ir.einsum("ik,jk->ij", x, wt_, into=h2),
            ir.apply(Op.ADD, h2, bias, into=biased2), ir.apply(Op.RELU, biased2, into=act2),
            inputs=[(x, q(x.shape)), (wt_, q(wt_.shape)), (bias, q(bias.shape))], outputs=[h2, act2],
            virtual=(biased2,),
        ))
        # an optimizer's update of a weight from its gradient, in place (momentum, then the
        # weight); large, the CPU's tiles prefetch their rows of the momentum and the weight
        # (tiles.PREFETCH_MIN_BYTES), with edge rows and a masked last vector
        for name, (kk, m, n) in (("update_in_place", (30, 14, 50)), ("update_large", (30, 301, 244))):
            a, d = Node("a", (kk, m), dt), Node("d", (kk, n), dt)
            g, mom, wt = Node("g", (m, n), dt), Node("mom", (m, n), dt), Node("wt", (m, n), dt)
            out.append(program(
                f"epilogue.{name}.{dt}", ir.einsum("ki,kj->ij", a, d, into=g),
                ir.apply(Op.ADD, mom, g, into=mom), ir.apply(Op.SUB, wt, mom, into=wt),
                inputs=[(a, q(a.shape)), (d, q(d.shape)), (mom, q(mom.shape)), (wt, q(wt.shape))],
                outputs=[mom, wt],
            ))
        # the same update of a head narrower than a vector (the MLP's 256x10: its tiles run
        # down the columns), its gradient scratch (only the tiles see it) or kept as well
        for kept in (False, True):
            na_, nd_ = Node("na", (26, 37), dt), Node("nd", (26, 6), dt)
            ng_ = Node("ng", (37, 6), dt, ON if kept else MemoryMode.LOCAL)
            nm_, nw_ = Node("nm", (37, 6), dt), Node("nw", (37, 6), dt)
            out.append(program(
                f"epilogue.narrow_update{'_kept' if kept else ''}.{dt}", ir.einsum("ki,kj->ij", na_, nd_, into=ng_),
                ir.apply(Op.MUL, nm_, 0.5, into=nm_), ir.apply(Op.ADD, nm_, ng_, into=nm_),
                ir.apply(Op.SUB, nw_, nm_, into=nw_),
                inputs=[(na_, q(na_.shape)), (nd_, q(nd_.shape)), (nm_, q(nm_.shape)), (nw_, q(nw_.shape))],
                outputs=[ng_, nm_, nw_] if kept else [nm_, nw_],
            ))
        # an optimizer step computes every gradient first: the update comes after another
        # layer's gradient (a product and a column sum, independent of it) and moves up to its
        # own product; in the second, a kernel between reads the weight the update writes (the
        # MLP's w^T), so it moves above the product; in the third, that reader also reads the
        # product: everything stays in order
        ua, ud, ug = Node("ua", (30, 14), dt), Node("ud", (30, 50), dt), Node("ug", (14, 50), dt)
        um, uw = Node("um", (14, 50), dt), Node("uw", (14, 50), dt)
        ob, oe, og = Node("ob", (30, 20), dt), Node("oe", (30, 6), dt), Node("og", (20, 6), dt)
        os_ = Node("os", (6,), dt)
        out.append(program(
            f"epilogue.update_after_other_gradients.{dt}", ir.einsum("ki,kj->ij", ua, ud, into=ug),
            ir.einsum("ki,kj->ij", ob, oe, into=og), ir.einsum("ij->j", oe, into=os_),
            ir.apply(Op.ADD, um, ug, into=um), ir.apply(Op.SUB, uw, um, into=uw),
            inputs=[(ua, q(ua.shape)), (ud, q(ud.shape)), (ob, q(ob.shape)), (oe, q(oe.shape)),
                    (um, q(um.shape)), (uw, q(uw.shape))], outputs=[og, os_, um, uw],
        ))
        va, vd, vg = Node("va", (30, 14), dt), Node("vd", (30, 50), dt), Node("vg", (14, 50), dt)
        vw, vr = Node("vw", (14, 50), dt), Node("vr", (50,), dt)
        out.append(program(
            f"epilogue.update_behind_a_reader.{dt}", ir.einsum("ki,kj->ij", va, vd, into=vg),
            ir.einsum("ij->j", vw, into=vr), ir.apply(Op.SUB, vw, vg, into=vw),
            inputs=[(va, q(va.shape)), (vd, q(vd.shape)), (vw, q(vw.shape))], outputs=[vr, vw],
        ))
        xa, xd, xg = Node("xa", (30, 14), dt), Node("xd", (30, 50), dt), Node("xg", (14, 50), dt)
        xw, xr = Node("xw", (14, 50), dt), Node("xr", (50,), dt)
        out.append(program(
            f"epilogue.update_behind_a_dependent_reader.{dt}", ir.einsum("ki,kj->ij", xa, xd, into=xg),
            ir.einsum("ij,ij->j", xg, xw, into=xr), ir.apply(Op.SUB, xw, xg, into=xw),
            inputs=[(xa, q(xa.shape)), (xd, q(xd.shape)), (xw, q(xw.shape))], outputs=[xr, xw],
        ))
        # the consumer writes an operand of the product: later tiles must read the old values
        sa, sw, sc = Node("sa", (24, 24), dt), Node("sw", (24, 40), dt), Node("sc", (24, 40), dt, ON)
        out.append(program(
            f"epilogue.consumer_writes_operand.{dt}", ir.einsum("ik,kj->ij", sa, sw, into=sc),
            ir.apply(Op.ADD, sw, sc, into=sw),
            inputs=[(sa, q(sa.shape)), (sw, q(sw.shape))], outputs=[sc, sw],
        ))
        # the consumer reads the product transposed: the cell it reads is another tile's
        ta, tb, td = (Node(nm, (40, 40), dt) for nm in ("ta", "tb", "td"))
        tc = Node("tc", (40, 40), dt, ON)
        out.append(program(
            f"epilogue.transposed_read.{dt}", ir.einsum("ik,kj->ij", ta, tb, into=tc),
            ir.einsum("ji->ij", tc, into=td),
            inputs=[(ta, q(ta.shape)), (tb, q(tb.shape))], outputs=[tc, td],
        ))
        # a relu's backward mask on the product: where(h > 0, product, 0), 16 columns (GCC 12.2
        # at -O3 loaded each vector of the product under the previous vector's mask, when
        # kernels spelled where as c ? x : y)
        ma, mb, mh = Node("ma", (24, 3), dt), Node("mb", (3, 16), dt), Node("mh", (24, 16), dt)
        mc, mp, mo = Node("mc", (24, 16), dt), Node("mp", (24, 16), dtypes.bool_), Node("mo", (24, 16), dt)
        out.append(program(
            f"epilogue.relu_mask.{dt}", ir.einsum("ik,kj->ij", ma, mb, into=mc),
            ir.apply(Op.GT, mh, 0.0, into=mp), ir.apply(Op.WHERE, mp, mc, 0.0, into=mo),
            inputs=[(ma, q(ma.shape)), (mb, q(mb.shape)), (mh, q(mh.shape))], outputs=[mo], virtual=(mp,),
        ))
        # batched, the bias broadcast over the batch and the rows
        ba, bb, bbias = Node("ba", (3, 13, 9), dt), Node("bb", (3, 9, 36), dt), Node("bbias", (36,), dt)
        bc, bo = Node("bc", (3, 13, 36), dt, ON), Node("bo", (3, 13, 36), dt)
        out.append(program(
            f"epilogue.batched_bias.{dt}", ir.einsum("bik,bkj->bij", ba, bb, into=bc),
            ir.apply(Op.MUL, bc, bbias, into=bo),
            inputs=[(ba, q(ba.shape)), (bb, q(bb.shape)), (bbias, q(bbias.shape))], outputs=[bc, bo],
        ))
        # scratch products that another kernel reads as well (here, or in the next computation):
        # the tiles run the epilogue and still store the product (core/fusion.py private_sums)
        ra, rw, rs = Node("ra", (20, 33), dt), Node("rw", (33, 40), dt), Node("rs", (20, 40), dt)
        ro, rsum = Node("ro", (20, 40), dt), Node("rsum", (20, 1), dt)
        product, scaled = ir.einsum("ik,kj->ij", ra, rw, into=rs), ir.apply(Op.MUL, rs, 2.0, into=ro)
        total = _row_reduce(rs, rsum, AccumOp.ADD)
        ins = [(ra, q(ra.shape)), (rw, q(rw.shape))]
        out.append(program(f"epilogue.sum_read_again.{dt}", product, scaled, total, inputs=ins, outputs=[ro, rsum]))
        out.append(program(f"epilogue.sum_read_by_next_comp.{dt}", inputs=ins, outputs=[ro, rsum],
                           comps=[ir.Comp.of(product, scaled), ir.Comp.of(total)]))
    return out


def fusion() -> list[CatalogProgram]:
    out = []
    shape = (4, 50)
    a, b, c = (f32(nm, shape) for nm in "abc")
    t1, t2, t3, r = f32("t1", shape), f32("t2", shape), f32("t3", shape), f32("r", shape)
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
    m, w, bias = f32("m", (5, 6)), f32("w", (6, 7)), f32("bias", (7,))
    mm, biased, act = f32("mm", (5, 7)), f32("biased", (5, 7)), f32("act", (5, 7))
    q = functools.partial(values, dtypes.float32, kind="quarter")
    out.append(program(
        "fusion.matmul_bias_relu",
        ir.einsum("ik,kj->ij", m, w, into=mm), ir.apply(Op.ADD, mm, bias, into=biased),
        ir.apply(Op.RELU, biased, into=act),
        inputs=[(m, q(m.shape)), (w, q(w.shape)), (bias, q(bias.shape))], outputs=[act],
        virtual=(biased,), absent=(mm,),
    ))
    # a node read twice is scratch (LOCAL): stored inside the batch, absent from the context
    e, t, sq = f32("e", (33,)), f32("t", (33,)), f32("sq", (33,))
    out.append(program(
        "fusion.read_twice_is_local",
        ir.apply(Op.EXP, e, into=t), ir.apply(Op.MUL, t, t, into=sq),
        inputs=[(e, f(e.shape, "exp"))], outputs=[sq], absent=(t,), rtol=1e-5,
    ))
    # a fetch inlined into its reader
    rg, rgf = Node("rg", (3, 8), dtypes.int32), f32("rgf", (3, 8))
    out.append(program(
        "fusion.range_inlined",
        ir.arange(rg), ir.apply(Op.CAST, rg, into=rgf),
        inputs=[], outputs=[rgf], virtual=(rg,),
    ))
    return out


def _row_reduce(x: Node, into: Node, accum: AccumOp, op: Op = Op.ID) -> ir.Accum:
    """``into[i, 0] = accum_j op(x[i, j])`` (a reduction along rows, the reduced axis kept)."""
    i, j = Symbol("i"), Symbol("j")
    pr = ir.Projections(((i, x.shape[0]), (j, x.shape[1])), (ir.as_affine(i), ir.fixed(0)),
                        ((ir.as_affine(i), ir.as_affine(j)),))
    return ir.Accum(into, accum, op, (x,), pr, init_neutral=True)


def rows() -> list[CatalogProgram]:
    """Reductions with their producers and consumers over the rows of one loop (merged into a
    row group where the dialect runs them: core/fusion.py ``fuse_rows``), and the cases that
    must stay apart: a consumer that reads another row, a later kernel that overwrites what an
    earlier one reads in other rows. 13 rows: a full block of the CPU's row blocks and a tail."""
    out = []
    for dt in (dtypes.float32, dtypes.float64):
        q = functools.partial(values, dt, kind="quarter")
        x = Node("x", (13, 27), dt)
        on = MemoryMode.ON_DEVICE  # kept, though later kernels read them
        m, s, z = Node("m", (13, 1), dt, on), Node("s", (13, 27), dt), Node("z", (13, 1), dt)
        lse, e, p = Node("lse", (13, 1), dt), Node("e", (13, 27), dt), Node("p", (13, 27), dt)
        out.append(program(  # softmax and log-sum-exp: max, shift, sum of exp, log, divide
            f"rows.softmax.{dt}", _row_reduce(x, m, AccumOp.MAX), ir.apply(Op.SUB, x, m, into=s),
            _row_reduce(s, z, AccumOp.ADD, Op.EXP), ir.apply(Op.LOG, z, into=lse),
            ir.apply(Op.EXP, s, into=e), ir.apply(Op.DIV, e, z, into=p),
            inputs=[(x, q(x.shape))], outputs=[m, lse, p],
        ))
        # the consumer sums a column of the shifted rows: row i reads every row's cell i
        sx, sm, ss, col = Node("sx", (16, 16), dt), Node("sm", (16, 1), dt, on), Node("ss", (16, 16), dt), Node("col", (16,), dt)
        out.append(program(
            f"rows.reads_other_rows.{dt}", _row_reduce(sx, sm, AccumOp.MAX), ir.apply(Op.SUB, sx, sm, into=ss),
            ir.einsum("ki->i", ss, into=col),
            inputs=[(sx, q(sx.shape))], outputs=[sm, col],
        ))
        # the second kernel's loops are named like the row symbol ("i") and like the name a
        # row group first gives such a loop ("i_own"): both stay apart from the row loop
        rx, rm = Node("rx", (6, 5), dt), Node("rm", (6, 1), dt, on)
        ry, rz = Node("ry", (6, 4, 3), dt), Node("rz", (6, 3), dt)
        i, j, a, own = Symbol("i"), Symbol("j"), Symbol("a"), Symbol("i_own")
        out.append(program(
            f"rows.loop_names_taken.{dt}",
            ir.Accum(rm, AccumOp.MAX, Op.ID, (rx,), ir.projections([(i, 6), (j, 5)], [i, 0], [i, j])),
            ir.Accum(rz, AccumOp.ADD, Op.ID, (ry,), ir.projections([(a, 6), (own, 3), (i, 4)], [a, own], [a, i, own])),
            inputs=[(rx, q(rx.shape)), (ry, q(ry.shape))], outputs=[rm, rz],
        ))
        # each row's sum reads the mirrored row of w; the scaling after it overwrites w row by
        # row (by a per-row factor, so that its nest stays two loops over the rows)
        w, c, g = Node("w", (16, 16), dt), Node("c", (16, 1), dt), Node("g", (16,), dt)
        i, j = Symbol("i"), Symbol("j")
        mirror = ir.projections([(i, 16), (j, 16)], [i], [ir.affine((-1, i), const=15), j])
        out.append(program(
            f"rows.overwrites_what_others_read.{dt}", ir.Accum(g, AccumOp.ADD, Op.ID, (w,), mirror),
            ir.apply(Op.MUL, w, c, into=w),
            inputs=[(w, q(w.shape)), (c, q(c.shape))], outputs=[g, w],
        ))
    return out


def rows_past_independent() -> list[CatalogProgram]:
    """A row consumer that joins a row group further up, past kernels independent of it (a
    cross-entropy gradient after the loss's own kernels joins its log-softmax), and one that
    must not: the kernel between writes what it reads."""
    out = []
    for dt in (dtypes.float32, dtypes.float64):
        q = functools.partial(values, dt, kind="quarter")
        on = MemoryMode.ON_DEVICE
        x, m, s = Node("x", (13, 27), dt), Node("m", (13, 1), dt), Node("s", (13, 27), dt, on)
        z, lse = Node("z", (13, 1), dt), Node("lse", (13, 1), dt, on)
        total, scale = Node("total", (), dt), Node("scale", (), dt, on)
        g, e = Node("g", (13, 27), dt), Node("e", (13, 27), dt)
        log_softmax = (_row_reduce(x, m, AccumOp.MAX), ir.apply(Op.SUB, x, m, into=s),
                       _row_reduce(s, z, AccumOp.ADD, Op.EXP), ir.apply(Op.LOG, z, into=lse))
        out.append(program(  # the sum of the lse over all rows runs between, independent of g
            f"rows.joins_past_independent.{dt}", *log_softmax, ir.einsum("ij->", lse, into=total),
            ir.apply(Op.SUB, s, lse, into=e), ir.apply(Op.EXP, e, into=g),
            inputs=[(x, q(x.shape))], outputs=[s, lse, total, g],
        ))
        out.append(program(  # g scales by that sum: it waits for it, in a kernel of its own
            f"rows.waits_for_what_runs_between.{dt}", *log_softmax, ir.einsum("ij->", lse, into=scale),
            ir.apply(Op.SUB, s, lse, into=e), ir.apply(Op.MUL, e, scale, into=g),
            inputs=[(x, q(x.shape))], outputs=[s, lse, scale, g],
        ))
    return out


def folding() -> list[CatalogProgram]:
    """Uniform constants folded into their readers (core/folding.py): a filled seed scaled
    twice (1/3 rounds in each dtype as a kernel would round it), then read broadcast; a
    folded infinity (1 over a filled zero) that x is divided by (zeros of x's sign); and an
    exp of a fill, which stays a node (libm's and numpy's exp may differ in the last bit)."""
    out = []
    for dt in (dtypes.float32, dtypes.float64, dtypes.float16, dtypes.bfloat16):
        q = functools.partial(values, dt, kind="quarter")
        x, y = Node("x", (5, 7), dt), Node("y", (5, 7), dt)
        seed, k1, k2 = Node("seed", (), dt), Node("k1", (), dt), Node("k2", (), dt)
        zero, r, inf = Node("zero", (1,), dt), Node("r", (1,), dt), Node("over_inf", (5, 7), dt)
        half, e, ye = Node("half", (), dt), Node("e", (), dt), Node("ye", (5, 7), dt)
        below, picked = Node("below", (5, 7), dtypes.bool_), Node("picked", (5, 7), dt)
        out.append(program(
            f"fold.constants.{dt}", ir.fill(seed, 1.0), ir.apply(Op.MUL, seed, 0.0078125, into=k1),
            ir.apply(Op.DIV, k1, 3.0, into=k2), ir.apply(Op.MUL, x, k2, into=y),
            ir.fill(zero, 0.0), ir.apply(Op.DIV, 1.0, zero, into=r), ir.apply(Op.DIV, x, r, into=inf),
            ir.fill(half, 0.5), ir.apply(Op.EXP, half, into=e), ir.apply(Op.MUL, x, e, into=ye),
            inputs=[(x, q(x.shape))], outputs=[y, inf, ye],
        ))
        # a comparison of two folded values would compare literals of its result's dtype
        # (bool): its operands stay nodes
        seed, k1, k2 = Node("seed", (), dt), Node("k1", (), dt), Node("k2", (), dt)
        out.append(program(
            f"fold.compared.{dt}", ir.fill(seed, 1.0), ir.apply(Op.MUL, seed, 0.25, into=k1),
            ir.apply(Op.MUL, seed, 0.5, into=k2),
            ir.apply(Op.LT, k1, k2, into=below), ir.apply(Op.WHERE, below, x, 2.0, into=picked),
            inputs=[(x, q(x.shape))], outputs=[picked],
        ))
    return out


def batches() -> list[CatalogProgram]:
    """Independent elementwise kernels of different sizes (batched into one launch, each on its
    own segment, where the dialect batches: core/fusion.py ``fuse_segments``): an optimizer's
    momentum updates of three parameters, in place, small and large enough for the CPU's
    threads to share the range (their ranges then cut segments); and a chain whose second
    kernel reads the first's output, which must stay apart."""
    out = []
    for dt in (dtypes.float32, dtypes.float64):
        q = functools.partial(values, dt, kind="quarter")
        for label, sizes in (("small", (432, 64, 27)), ("large", (30_000, 50_001, 7))):
            on = MemoryMode.ON_DEVICE  # parameters and moments persist, as an optimizer's do
            params = [(Node(f"w{k}", (n,), dt, on), Node(f"m{k}", (n,), dt, on), Node(f"g{k}", (n,), dt))
                      for k, n in enumerate(sizes)]
            assigns = []
            for w, m, g in params:
                decay = Node(f"{m.name}_decay", m.shape, dt)
                assigns += [ir.apply(Op.MUL, m, 0.9, into=decay), ir.apply(Op.ADD, decay, g, into=m),
                            ir.apply(Op.SUB, w, m, into=w)]
            out.append(program(
                f"batch.updates_{label}.{dt}", *assigns,
                inputs=[(n, q(n.shape)) for p in params for n in p], outputs=[n for w, m, _ in params for n in (w, m)],
            ))
        # the second kernel reads every other cell of what the first writes: apart
        a, b, d = Node("a", (40,), dt), Node("b", (40,), dt, MemoryMode.ON_DEVICE), Node("d", (20,), dt)
        i = Symbol("i")
        every_other = ir.projections([(i, 20)], [i], [ir.affine((2, i))])
        out.append(program(
            f"batch.dependent.{dt}", ir.apply(Op.EXP, a, into=b), ir.Accum(d, None, Op.ID, (b,), every_other),
            inputs=[(a, q(a.shape))], outputs=[b, d],
        ))
    return out
