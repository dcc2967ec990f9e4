"""Catalog programs: broadcasting, transposes, reshapes."""

from __future__ import annotations

from polyjit.core import dtypes, ir
from polyjit.core.ir import Node, Op, Symbol
from polyjit.testing.programs.base import CatalogProgram, f32, program, values


def broadcasting() -> list[CatalogProgram]:
    out = []
    a, b, r = f32("a", (3, 1, 5)), f32("b", (4, 1)), f32("r", (3, 4, 5))
    out.append(program("broadcast.3d", ir.apply(Op.ADD, a, b, into=r),
                       inputs=[(a, values(dtypes.float32, a.shape)), (b, values(dtypes.float32, b.shape))],
                       outputs=[r]))
    s, m, r2 = f32("s", ()), f32("m", (6, 7)), f32("r", (6, 7))
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
    e, r6 = f32("e", (0, 5)), f32("r", (0, 5))
    out.append(program("broadcast.empty", ir.apply(Op.ADD, e, 1.0, into=r6),
                       inputs=[(e, values(dtypes.float32, e.shape))], outputs=[r6]))
    z, r7 = f32("z", ()), f32("r", ())
    out.append(program("elementwise.0d", ir.apply(Op.TANH, z, into=r7),
                       inputs=[(z, values(dtypes.float32, ()))], outputs=[r7]))
    return out


def transposes() -> list[CatalogProgram]:
    out = []
    for dt in (dtypes.float32, dtypes.int64, dtypes.uint8, dtypes.bool_):
        a, r = Node("a", (5, 7), dt), Node("r", (7, 5), dt)
        out.append(program(f"transpose.2d.{dt}", ir.einsum("ij->ji", a, into=r) if not dt.is_bool
                           else _transpose_assign(a, r),
                           inputs=[(a, values(dt, a.shape))], outputs=[r]))
    a3, r3 = f32("a", (2, 3, 4)), f32("r", (4, 2, 3))
    out.append(program("transpose.3d", ir.einsum("ijk->kij", a3, into=r3),
                       inputs=[(a3, values(dtypes.float32, a3.shape))], outputs=[r3]))
    return out


def _transpose_assign(a: Node, r: Node) -> ir.Accum:
    """A transpose by plain assignment (einsum accumulates, which bool nodes cannot)."""
    i, j = Symbol("i"), Symbol("j")
    pr = ir.projections([(i, a.shape[0]), (j, a.shape[1])], [j, i], [i, j])
    return ir.Accum(r, None, Op.ID, (a,), pr)


def reshapes() -> list[CatalogProgram]:
    out = []
    a, flat = Node("a", (4, 6), dtypes.int32), Node("flat", (24,), dtypes.int32)
    out.append(program("reshape.copy", ir.reshape(flat, a),
                       inputs=[(a, values(dtypes.int32, a.shape))], outputs=[flat]))
    b, r3, o = f32("b", (6, 4)), f32("r3", (2, 3, 4)), f32("o", (2, 3, 4))
    out.append(program("reshape.inlined_into_reader", ir.reshape(r3, b), ir.apply(Op.MUL, r3, 2.0, into=o),
                       inputs=[(b, values(dtypes.float32, b.shape))], outputs=[o], virtual=(r3,)))
    c, t, m, s = f32("c", (12,)), f32("t", (12,)), f32("m", (3, 4)), f32("s", (3,))
    out.append(program("reshape.of_computed_then_reduced",
                       ir.apply(Op.EXP, c, into=t), ir.reshape(m, t), ir.einsum("ij->i", m, into=s),
                       inputs=[(c, values(dtypes.float32, c.shape, "exp"))], outputs=[s], rtol=1e-5))
    return out
