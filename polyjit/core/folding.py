"""Constant folding: a float node whose every cell holds one value known when the batch is
lowered (a fill, or an elementwise op of such values and literals) is replaced, in each
assignment of its computation that reads it, by that value as a literal; its writer goes
when nothing reads it any more.

Why: autodiff seeds a loss's gradient with a filled scalar, and the gradient of a mean then
scales by it (``seed * (1/B)``). As a node, that scalar is a kernel of its own, and every
consumer waits for it: the cross-entropy gradient could not join the log-softmax kernel that
computes what it reads (char_lm: a kernel less, its exponentials computed in the row loop).

Only ops that IEEE rounds exactly are folded, with the reference's arithmetic
(core/reference.py, half types included): a folded value is the one every kernel computed
for that node. Where a kernel went on to use it differently, the folded program is the
reference's: a compiler that contracted the node's product with its reader into one FMA
(GCC, NVRTC) now rounds the product first, as the reference does; a GPU division or square
root that is not correctly rounded (OpenCL without -cl-fp32-correctly-rounded-divide-sqrt)
is now correctly rounded. Only elementwise readers take literals (a contraction keeps its
tiles and its order of sums). Nodes any computation of the batch embeds (results,
parameters), nodes another computation of the batch reads or writes, and nodes read through
the merge buffer or by a fetch (a reshape, a gather) keep their writer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np

from polyjit.core import ir
from polyjit.core.errors import PolyjitError
from polyjit.core.ir import MemoryMode, Node, Op
from polyjit.core.reference import apply_op, scalar_value

# Exactly rounded in IEEE arithmetic (max and min are C's a > b ? a : b, as the reference's).
FOLDABLE = frozenset({Op.ID, Op.NEG, Op.ABS, Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MAX, Op.MIN,
                      Op.SQRT, Op.CAST})


def fold_constants(comps: Sequence[ir.Comp]) -> list[ir.Comp]:
    """The computations with their uniform float constants folded (module docstring). A node
    another computation of the batch reads or writes, or one any of them embeds, persists or
    is shared: it keeps its writer and its readers keep reading it."""
    comps = list(comps)
    users: dict[Node, set[int]] = {}
    for k, c in enumerate(comps):
        for leaf in c.leaves():
            for node in (ir.writes(leaf), *(ir.operand_node(x) for x in ir.reads(leaf))):
                users.setdefault(node, set()).add(k)
    embedded = frozenset().union(*(c.embedded for c in comps))
    shared = {n for n, ks in users.items() if len(ks) > 1} | embedded
    return [_fold(c, shared) for c in comps]


def _fold(comp: ir.Comp, shared: set[Node] | frozenset[Node]) -> ir.Comp:
    leaves = comp.leaves()
    writes: dict[Node, int] = {}
    for leaf in leaves:
        node = ir.writes(leaf)
        writes[node] = writes.get(node, 0) + 1
    known: dict[Node, float] = {}
    new: dict[int, ir.Accum | ir.Fetch] = {}  # id of a leaf -> its folded form
    for leaf in leaves:
        folded = _substitute(leaf, known) if isinstance(leaf, ir.Accum) else leaf
        if folded is not leaf:
            new[id(leaf)] = folded
        node = ir.writes(folded)
        if writes[node] == 1 and node not in shared and _may_fold(node):
            value = _value(folded)
            if value is not None:
                known[node] = value
    if not known:
        return comp
    still_read = {ir.operand_node(x) for leaf in leaves for x in ir.reads(new.get(id(leaf), leaf))}
    dead = {n for n in known if n not in still_read}

    def rebuild(a: ir.Assignment) -> ir.Assignment | None:
        if isinstance(a, (ir.Accum, ir.Fetch)):
            return None if ir.writes(a) in dead else new.get(id(a), a)
        if isinstance(a, ir.Seq):
            items = tuple(x for x in (rebuild(i) for i in a.items) if x is not None)
            return ir.Seq(items) if items else None
        body = rebuild(a.body)
        return None if body is None else ir.Block(a.comment, body)

    kept = tuple(x for x in (rebuild(a) for a in comp.assignments) if x is not None)
    return ir.Comp(kept, comp.embedded)


def _may_fold(node: Node) -> bool:
    return (node.dtype.is_float and node.size > 0
            and node.mode not in (MemoryMode.ON_DEVICE, MemoryMode.MATERIALIZED))


def _substitute(a: ir.Accum, known: dict[Node, float]) -> ir.Accum:
    """``a`` with each operand that is a known node replaced by its value. Elementwise
    assignments only: a contraction keeps its operand (a filled matrix times a weight stays
    a tiled matmul, and its sums stay in the order they had)."""
    if a.accum is not None or not any(isinstance(x, Node) and x in known for x in a.rhs):
        return a
    rhs: list[ir.Operand] = []
    projections: list[tuple[ir.Affine, ...]] = []
    tensors = iter(a.projections.rhs)
    for x in a.rhs:
        if isinstance(x, (Node, ir.MergeRead)):
            index = next(tensors)
            if isinstance(x, Node) and x in known:
                rhs.append(known[x])
                continue
            projections.append(index)
        rhs.append(x)
    try:
        folded = attrs.evolve(a, rhs=tuple(rhs), projections=attrs.evolve(a.projections, rhs=tuple(projections)))
    except PolyjitError:  # a cast's lone literal takes the lhs's dtype: 300.5 does not fit uint8
        return a
    # A literal takes the dtype of the tensor values beside it, else the lhs's: where that is
    # not the node's (a comparison of two folded values would compare bools), keep the nodes.
    return folded if ir.accum_operand_dtypes(folded) == ir.accum_operand_dtypes(a) else a


def _value(leaf: ir.Accum | ir.Fetch) -> float | None:
    """The one value every cell of the leaf's node gets, when the leaf writes them all with a
    value known now; else None."""
    node = ir.writes(leaf)
    if isinstance(leaf, ir.Fetch):
        if not isinstance(leaf.value, ir.Fill):
            return None
        filled = float(scalar_value(leaf.value.value, node.dtype).astype(np.float64))
        return None if math.isnan(filled) else filled  # a NaN stays a node, as below
    if leaf.accum is not None or leaf.op not in FOLDABLE or leaf.tensor_operands:
        return None
    if not ir.writes_every_cell(leaf):
        return None
    dts = ir.accum_operand_dtypes(leaf)
    args = [scalar_value(x, dt) for x, dt in zip(leaf.rhs, dts)]  # type: ignore[arg-type]
    value = float(np.asarray(apply_op(leaf.op, args, dts, node.dtype)).astype(np.float64))
    # A NaN stays a node: a literal NaN has no sign and payload of its own, the op's has
    # (x86's sqrt of a negative is a negative NaN).
    return None if math.isnan(value) else value

