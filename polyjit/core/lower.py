"""Lowering: assignments -> the loop IR (core/loops.py).

Steps, for a batch of computations:
0. constant folding: uniform float constants (a filled seed, its scaled copies) become
   literals in the assignments that read them (core/folding.py);
1. memory-mode inference: which written nodes are inlined (VIRTUAL), which are
   scratch inside the batch (LOCAL) and which persist in the context;
2. each remaining Accum/Fetch becomes one or two kernels: a parallel nest over
   the cells it writes, around a Store, a Reduce (a per-cell accumulator over
   the reduction symbols) or serial loops; a zero-fill kernel goes first when
   the accumulation is not injective and surjective;
3. VIRTUAL nodes are inlined into their readers (this fuses elementwise chains);
4. simplification: size-1 loops vanish, adjacent loops that walk memory
   contiguously merge into one;
5. a long full reduction splits into partial results and their reduction;
6. horizontal fusion: elementwise kernels of one iteration space merge into one kernel
   when every value one reads of another's is its own iteration's (core/fusion.py);
7. epilogues (a tiled contraction and an elementwise kernel after it), row groups
   (adjacent kernels over the rows of one outer loop) and batches (independent elementwise
   kernels as segments of one launch), as the target asks.

Each kernel reports its inputs and outputs *after* inlining. How each kernel then
runs on a target (its kind, tiles, launch shape) is core/patterns.py's to decide.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import attrs
import numpy as np

from polyjit.core import dtypes, ir
from polyjit.core.errors import InvalidProgramError
from polyjit.core.folding import fold_constants
from polyjit.core.fusion import (
    fuse_epilogues,
    fuse_horizontal,
    fuse_rows,
    fuse_segments,
    private_sums,
)
from polyjit.core.ir import Affine, MemoryMode, Node, Symbol
from polyjit.core.loops import (
    Call,
    Const,
    Expr,
    IndexValue,
    Kernel,
    Load,
    Loop,
    LoweredBatch,
    LoweredComp,
    Reduce,
    Row,
    Seq,
    Stmt,
    Store,
    affines_of,
    map_expr,
    map_stmt,
    walk_exprs,
    walk_stmts,
)

# The loop IR lives in core/loops.py; its names stay importable from here.
__all__ = [
    "Call", "Const", "Expr", "IndexValue", "Inference", "Kernel", "Load", "Loop", "LoweredBatch",
    "LoweredComp", "Reduce", "Stmt", "Store", "cell_symbols", "flat_index", "infer_modes", "injective", "lower",
    "simplify",
    "split_long_reduction", "strides", "walk_exprs", "walk_stmts",
]

# ---------------------------------------------------------------------------
# Memory-mode inference


def _is_bijective_write(a: ir.Accum) -> bool:
    """The lhs index is a permutation of the whole product space onto the whole node."""
    pr = a.projections
    if len(pr.lhs) != len(pr.product_space):
        return False
    seen: set[Symbol] = set()
    for e, n in zip(pr.lhs, a.lhs.shape):
        if e.const != 0 or len(e.terms) != 1:
            return False
        v, c = e.terms[0]
        if c != 1 or not isinstance(v, Symbol) or v in seen or pr.extent(v) != n:
            return False
        seen.add(v)
    return True


def _reads_own_target_elsewhere(a: ir.Accum) -> bool:
    """The Accum reads its target at other cells than each iteration writes (or accumulates
    several iterations into one cell it also reads): in place, iterations would read cells
    others already wrote, where the program means the values from before the write."""
    pointwise = _is_bijective_write(a)
    return any(x is a.lhs and (not pointwise or tuple(idx) != tuple(a.projections.lhs))
               for x, idx in zip(a.tensor_operands, a.projections.rhs))


@functools.lru_cache(maxsize=4096)
def _copy_before(target: Node) -> Node:
    """The one copy node of ``target`` (so that lowering a computation again writes the same
    source, and the compile cache finds it)."""
    return Node(f"{target.name}_before", target.shape, target.dtype)


def _read_own_target_first(comp: ir.Comp) -> ir.Comp:
    """``comp`` with each Accum that reads its own target at other cells reading a copy of it
    taken just before (``<target>_before``), as the reference reads the target's values
    from before the write (``o[i, j] = a[i, j] + o[i, n - 1 - j]``). The copy is an
    intermediate like any other: a kernel of its own, never inlined back (its source is the
    target, see _inlined_reads_of_own_target)."""
    leaves = comp.leaves()
    if not any(isinstance(a, ir.Accum) and _reads_own_target_elsewhere(a) for a in leaves):
        return comp
    out: list[ir.Assignment] = []
    for a in leaves:
        if isinstance(a, ir.Accum) and _reads_own_target_elsewhere(a):
            before = _copy_before(a.lhs)
            out.append(ir.apply(ir.Op.ID, a.lhs, into=before))
            a = attrs.evolve(a, rhs=tuple(before if x is a.lhs else x for x in a.rhs))
        out.append(a)
    return ir.Comp(tuple(out), comp.embedded)


def _is_elementwise_writer(leaf: ir.Accum | ir.Fetch) -> bool:
    if isinstance(leaf, ir.Fetch):  # rows picked by data are stored: their readers stay plain loads
        return not isinstance(leaf.value, (ir.Constant, ir.Gather, ir.ScatterAdd))
    return leaf.accum is None and _is_bijective_write(leaf)


def injective(index: Sequence[Affine], symbols: Sequence[Symbol]) -> bool:
    """Distinct iterations over ``symbols`` reach distinct cells through ``index``: every loop
    symbol is the only one of some axis (``x[i + j]`` reaches a cell from several)."""
    seen: set[Symbol] = set()
    for e in index:
        loops = [v for v in e.vars if isinstance(v, Symbol)]
        if len(loops) > 1 or (loops and loops[0] in seen):
            return False
        seen.update(loops)
    return all(s in seen for s in symbols)


def _read_covers_space(reader: ir.Accum, node: Node) -> bool:
    """The reader reads each element of node in one iteration only: inlined, each element is
    computed once, and from the values its writer saw (``s[i + j] += v[i + j]`` with ``v = 2 *
    s`` inlined would read cells of s that earlier iterations updated)."""
    for x, idx in zip(reader.tensor_operands, reader.projections.rhs):
        if x is node:
            return injective(idx, reader.projections.symbols)
    return False


@attrs.frozen
class Inference:
    modes: dict[Node, MemoryMode]
    writer: dict[Node, ir.Accum | ir.Fetch]  # the unique writer of each VIRTUAL node
    why_not: dict[Node, str] = attrs.Factory(dict)  # why each inferred LOCAL node is not inlined


def infer_modes(comps: Sequence[ir.Comp]) -> Inference:
    """Decide the memory mode of every node the batch writes (see the module docstring)."""
    leaves: list[tuple[int, ir.Accum | ir.Fetch]] = [
        (ci, leaf) for ci, c in enumerate(comps) for leaf in c.leaves()
    ]
    embedded = frozenset().union(*(c.embedded for c in comps))
    writers: dict[Node, list[int]] = {}
    readers: dict[Node, list[int]] = {}
    for pos, (_, leaf) in enumerate(leaves):
        for x in ir.reads(leaf):
            if isinstance(x, Node):
                readers.setdefault(x, []).append(pos)
        writers.setdefault(ir.writes(leaf), []).append(pos)

    modes: dict[Node, MemoryMode] = {}
    writer_of: dict[Node, ir.Accum | ir.Fetch] = {}
    why_not: dict[Node, str] = {}
    for node, wpos in writers.items():
        explicit = node.mode
        if node in embedded or explicit in (MemoryMode.ON_DEVICE, MemoryMode.MATERIALIZED):
            modes[node] = explicit or MemoryMode.MATERIALIZED
            if explicit in (MemoryMode.VIRTUAL, MemoryMode.LOCAL):
                raise InvalidProgramError(
                    f"{node.label} is {explicit.value} but is embedded (a result of the computation)"
                )
            continue
        why_not_inlined = _why_not_inlinable(node, wpos, readers.get(node, []), leaves)
        if why_not_inlined is None and explicit in (None, MemoryMode.VIRTUAL):
            modes[node] = MemoryMode.VIRTUAL
            writer_of[node] = leaves[wpos[0]][1]
        elif explicit is MemoryMode.VIRTUAL:
            raise InvalidProgramError(f"{node.label} is marked VIRTUAL but cannot be inlined: {why_not_inlined}")
        else:
            modes[node] = MemoryMode.LOCAL
            why_not[node] = why_not_inlined or "it is marked LOCAL"
    inference = Inference(modes, writer_of, why_not)
    while True:  # each pass demotes at least one node, or ends
        _keep_inlined_sources_fixed(inference, leaves, writers, readers)
        overwritten = _inlined_reads_of_own_target(inference, leaves)
        if not overwritten:
            return inference
        for node in overwritten:
            _demote(inference, node, "its value is read, inlined, by a kernel that writes what it is "
                                      "computed from at other cells")


def stored_sources(inference: Inference, node: Node) -> set[Node]:
    """The stored nodes a read of ``node`` loads once inlining is done: itself, or, for a
    VIRTUAL node, those its writer reads, through any chain of inlined nodes and views."""
    if inference.modes.get(node) is not MemoryMode.VIRTUAL:
        return {node}
    out: set[Node] = set()
    for x in ir.reads(inference.writer[node]):
        if isinstance(x, Node):
            out |= stored_sources(inference, x)
    return out


def _demote(inference: Inference, node: Node, why: str) -> None:
    if node.mode is MemoryMode.VIRTUAL:
        raise InvalidProgramError(f"{node.label} is marked VIRTUAL but cannot be inlined: {why}")
    inference.modes[node] = MemoryMode.LOCAL
    del inference.writer[node]
    inference.why_not[node] = why


def _keep_inlined_sources_fixed(
    inference: Inference, leaves: list[tuple[int, ir.Accum | ir.Fetch]],
    writers: dict[Node, list[int]], readers: dict[Node, list[int]],
) -> None:
    """An inlined node is computed where it is finally consumed (its reader, or its reader's
    reader when that is inlined too, ...), from the stored nodes at the end of its chain: none
    of those may change between its writer and a final consumer. The checks of one node
    (``_why_not_inlinable``) see its direct sources and readers only; this sees through the
    chain, to a fixed point (demoting one node changes the chains through it)."""
    def consumers(node: Node) -> list[int]:
        out: list[int] = []
        for r in readers.get(node, []):
            target = ir.writes(leaves[r][1])
            out += consumers(target) if inference.modes.get(target) is MemoryMode.VIRTUAL else [r]
        return out

    changed = True
    while changed:
        changed = False
        for node in [n for n, m in inference.modes.items() if m is MemoryMode.VIRTUAL]:
            w = writers[node][0]
            last = max(consumers(node), default=w)
            sources = stored_sources(inference, node)
            for _, between in leaves[w + 1 : last]:
                if ir.writes(between) in sources:
                    _demote(inference, node, f"{ir.writes(between).label}, which it is computed from, "
                                             "changes before it is used")
                    changed = True
                    break


def _why_not_inlinable(
    node: Node, wpos: list[int], rpos: list[int], leaves: list[tuple[int, ir.Accum | ir.Fetch]]
) -> str | None:
    if len(wpos) != 1:
        return "it is written more than once"
    w = wpos[0]
    comp, writer = leaves[w]
    if isinstance(writer, ir.Fetch) and isinstance(writer.value, ir.Reshape):
        return _why_not_view(writer.value.source, w, rpos, leaves)
    if not _is_elementwise_writer(writer):
        return "its writer is not elementwise (a reduction, a partial or strided write)"
    if len(rpos) != 1:
        return f"it is read {len(rpos)} times, not once"
    r = rpos[0]
    rcomp, reader = leaves[r]
    if r <= w:
        return "it is read before it is written"
    if isinstance(reader, ir.Fetch) and isinstance(reader.value, ir.Reshape):
        return "it is read through a reshape (a flat index)"
    if _reads_by_row(reader, node):
        return "a gather or scatter-add reads it at rows picked by data, or once per element of a row"
    if rcomp != comp:
        return "its reader is in another computation of the batch"
    if isinstance(reader, ir.Accum) and isinstance(writer, ir.Accum) and not _read_covers_space(reader, node):
        return "its reader reads each element several times (broadcast or contraction)"
    if any(isinstance(x, ir.MergeRead) for x in ir.reads(writer)):
        return "its writer reads the merge buffer"
    sources = {ir.operand_node(x) for x in ir.reads(writer)}
    for _, between in leaves[w + 1 : r]:
        if ir.writes(between) in sources:
            return f"{ir.writes(between).label}, which its writer reads, changes before the read"
    return None


def _reads_by_row(reader: ir.Accum | ir.Fetch, node: Node) -> bool:
    """Whether ``reader`` is a gather or a scatter-add that reads ``node`` other than once per
    element at an affine index: a gather's table and indices, a scatter-add's indices (only a
    scatter-add's values may be inlined)."""
    if not isinstance(reader, ir.Fetch):
        return False
    v = reader.value
    return isinstance(v, ir.Gather) or (isinstance(v, ir.ScatterAdd) and node is not v.values)


def _why_not_view(
    source: Node, w: int, rpos: list[int], leaves: list[tuple[int, ir.Accum | ir.Fetch]]
) -> str | None:
    """A reshape only renames indices (row-major order keeps the flat index): every reader,
    however many, loads the source instead, unless the source changes before a read."""
    comp = leaves[w][0]
    for r in rpos:
        rcomp = leaves[r][0]
        if r <= w:
            return "it is read before it is written"
        if rcomp != comp:
            return "its reader is in another computation of the batch"
    for _, between in leaves[w + 1 : max(rpos, default=w) + 1]:
        if ir.writes(between) is source:
            return f"{source.label}, which it reshapes, changes before a read"
    return None


def _inlined_reads_of_own_target(
    inference: Inference, leaves: list[tuple[int, ir.Accum | ir.Fetch]]
) -> set[Node]:
    """The inlined nodes that make a kernel load a node it stores at other cells than the one
    it stores (``x = transpose(2 * x)`` through an inlined ``2 * x``: iterations would read
    cells others already wrote). Each stored write whose inlined reads lead back to its own
    target is lowered and looked at."""
    lowerer = _Lowerer(inference)
    found: set[Node] = set()
    for _, leaf in leaves:
        target = ir.writes(leaf)
        if inference.modes[target] is MemoryMode.VIRTUAL:
            continue
        suspects = {v for v in _inlined_by(inference, leaf) if target in stored_sources(inference, v)}
        if not suspects or (isinstance(leaf, ir.Fetch) and isinstance(leaf.value, ir.Constant)):
            continue
        # Where several iterations write one cell, even a load at the stored index reads what
        # an earlier iteration wrote there.
        several = isinstance(leaf, ir.Accum) and not injective(leaf.projections.lhs, leaf.projections.symbols)
        kernels = lowerer.lower_fetch("k", leaf) if isinstance(leaf, ir.Fetch) else lowerer.lower_accum("k", leaf)
        for k in kernels:
            for st in walk_stmts(k.body):
                if isinstance(st, (Store, Reduce)) and any(
                        isinstance(e, Load) and e.node is st.node and (several or e.index != st.index)
                        for e in walk_exprs(st)):
                    found |= suspects
    return found


def _inlined_by(inference: Inference, leaf: ir.Accum | ir.Fetch) -> set[Node]:
    """The VIRTUAL nodes a leaf's kernel computes inline (through chains of them)."""
    out: set[Node] = set()
    todo = [x for x in ir.reads(leaf) if isinstance(x, Node)]
    while todo:
        x = todo.pop()
        if inference.modes.get(x) is MemoryMode.VIRTUAL and x not in out:
            out.add(x)
            todo += [y for y in ir.reads(inference.writer[x]) if isinstance(y, Node)]
    return out


# ---------------------------------------------------------------------------
# Lowering of one leaf


def strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        out[k] = out[k + 1] * shape[k + 1]
    return tuple(out)


def flat_index(node: Node, index: Sequence[Affine]) -> Affine:
    out = Affine()
    for e, st in zip(index, strides(node.shape)):
        out = out + e.scale(st)
    return out


class _Lowerer:
    def __init__(self, inference: Inference, scatter_scan: int = 0) -> None:
        self.inference = inference
        self.scatter_scan = scatter_scan
        self._fresh = 0

    def fresh_symbols(self, n: int) -> list[Symbol]:
        out = [Symbol(f"_c{self._fresh + k}") for k in range(n)]
        self._fresh += n
        return out

    # -- expressions -------------------------------------------------------

    def read(self, x: Node | ir.MergeRead, index: Sequence[Affine]) -> Expr:
        if isinstance(x, ir.MergeRead):
            return Load(x.node, flat_index(x.node, index), merge=True)
        if self.inference.modes.get(x) is MemoryMode.VIRTUAL:
            return self.inline(self.inference.writer[x], index)
        return Load(x, flat_index(x, index))

    def load_flat(self, node: Node, flat: Affine) -> Expr:
        """The element at a flat index; an inlined reshape's is its source's."""
        if self.inference.modes.get(node) is MemoryMode.VIRTUAL:
            writer = self.inference.writer[node]
            if not (isinstance(writer, ir.Fetch) and isinstance(writer.value, ir.Reshape)):
                raise InvalidProgramError(f"{node.label} is inlined but read at a flat index")
            return self.load_flat(writer.value.source, flat)
        return Load(node, flat)

    def inline(self, writer: ir.Accum | ir.Fetch, index: Sequence[Affine]) -> Expr:
        """The writer's value at ``index`` (its cell symbols replaced by the reader's indices)."""
        if isinstance(writer, ir.Fetch):
            return self.fetch_value(writer, index)
        env: dict[ir.Var, Affine] = {e.terms[0][0]: idx for e, idx in zip(writer.projections.lhs, index)}
        return self.value(writer, lambda a: a.substitute(env))

    def value(self, a: ir.Accum, remap: Callable[[Affine], Affine] = lambda x: x) -> Expr:
        operand_dtypes = ir.accum_operand_dtypes(a)
        out_dtype = ir.result_dtype(a.op, operand_dtypes, a.lhs.dtype)
        args: list[Expr] = []
        tensor_k = 0
        for x, dt in zip(a.rhs, operand_dtypes):
            if isinstance(x, (Node, ir.MergeRead)):
                idx = [remap(e) for e in a.projections.rhs[tensor_k]]
                tensor_k += 1
                args.append(self.read(x, idx))
            else:
                args.append(Const(x, dt))
        if a.op is ir.Op.ID:
            return args[0]
        return Call(a.op, tuple(args), out_dtype)

    def fetch_value(self, f: ir.Fetch, cell: Sequence[Affine]) -> Expr:
        v = f.value
        if isinstance(v, ir.Fill):
            return Const(v.value, f.node.dtype)
        if isinstance(v, ir.Range):
            return Call(ir.Op.CAST, (IndexValue(flat_index(f.node, cell)),), f.node.dtype)
        if isinstance(v, ir.Slice):
            return self.read(v.source, (v.index, *cell))
        if isinstance(v, ir.Reshape):  # same row-major order: the flat index carries over
            return self.load_flat(v.source, flat_index(f.node, cell))
        if isinstance(v, ir.Gather):  # a view's rows are its source's at the same flat index
            k = len(v.indices.shape)
            return Load(self.stored(v.table), flat_index(v.table, (ir.as_affine(0), *cell[k:])),
                        row=self.picked_row(v.indices, cell[:k], v.table))
        raise InvalidProgramError(f"{f.node.label} cannot be inlined")

    def stored(self, node: Node) -> Node:
        """The node whose buffer holds ``node``'s elements in its row-major order: itself, or
        for an inlined reshape, its source (through any chain of them)."""
        while self.inference.modes.get(node) is MemoryMode.VIRTUAL:
            writer = self.inference.writer[node]
            if not (isinstance(writer, ir.Fetch) and isinstance(writer.value, ir.Reshape)):
                raise InvalidProgramError(f"{node.label} is inlined but read at rows picked by data")
            node = writer.value.source
        return node

    def picked_row(self, indices: Node, at: Sequence[Affine], table: Node) -> Row:
        return Row(self.read(indices, at), table.shape[0], math.prod(table.shape[1:]))

    # -- kernels -------------------------------------------------------------

    def cell_nest(self, node: Node) -> tuple[tuple[tuple[Symbol, int], ...], tuple[Affine, ...]]:
        syms = self.fresh_symbols(len(node.shape))
        return tuple(zip(syms, node.shape)), tuple(ir.as_affine(s) for s in syms)

    def fill_kernel(self, name: str, node: Node, value: Expr, comment: str) -> Kernel:
        nest, cell = self.cell_nest(node)
        return Kernel(name, nest, Store(node, flat_index(node, cell), value), comment)

    def lower_fetch(self, name: str, f: ir.Fetch) -> list[Kernel]:
        if isinstance(f.value, ir.Constant):
            return []  # constants are uploaded at link time, not computed
        if isinstance(f.value, ir.ScatterAdd):
            return self.lower_scatter_add(name, f.node, f.value)
        nest, cell = self.cell_nest(f.node)
        body = Store(f.node, flat_index(f.node, cell), self.fetch_value(f, cell))
        return [Kernel(name, nest, body, f"fetch {type(f.value).__name__.lower()} {f.node.label}")]

    def lower_scatter_add(self, name: str, node: Node, v: ir.ScatterAdd) -> list[Kernel]:
        """Zeros, then one serial kernel: for each index in row-major order, its row of values
        added to the row it picks (rows picked twice add up in that order, on every target).
        Where the target scans indices cheaply (``scatter_scan``: a GPU's threads, each
        comparing rows x updates indices at most), each cell instead sums the updates that pick
        its row, in the same order, from zero: one parallel kernel, the same sums (a half
        type's table keeps the serial kernel: it rounds after every update, a sum would round
        once)."""
        updates = math.prod(v.indices.shape)
        if node.shape[0] * updates <= self.scatter_scan and not node.dtype.is_half:
            return [self.scatter_by_owner(name, node, v)]
        zero = self.fill_kernel(f"{name}_init", node, Const(0, node.dtype), f"{node.label} = 0")
        at = self.fresh_symbols(len(v.indices.shape))
        col = self.fresh_symbols(len(node.shape) - 1)
        r, j = [ir.as_affine(s) for s in at], [ir.as_affine(s) for s in col]
        body: Stmt = Store(node, flat_index(node, (ir.as_affine(0), *j)), self.read(v.values, (*r, *j)),
                           ir.AccumOp.ADD, row=self.picked_row(v.indices, r, node))
        for sym, n in reversed([*zip(at, v.indices.shape), *zip(col, node.shape[1:])]):
            body = Loop(sym, n, body)
        return [zero, Kernel(name, (), body, f"{node.label} += rows of {v.values.label} at {v.indices.label}")]

    def scatter_by_owner(self, name: str, node: Node, v: ir.ScatterAdd) -> Kernel:
        """``node[row, j...] = sum over i (row-major) of where(clamp(indices[i]) == row,
        values[i, j...], 0)``: adding 0 leaves a sum that started from +0 unchanged, so each
        cell is the serial kernel's, whatever its updates hold, where the values are loads.
        Values computed inline (a product) may differ in the last bit where a compiler fuses
        the serial kernel's ``cell + x * y`` into one FMA (NVCC does); here the product is
        rounded first, as the reference rounds it. The Reduce is ``ordered``: never split
        into partial sums or shared by threads."""
        row, *col = self.fresh_symbols(len(node.shape))
        at = self.fresh_symbols(len(v.indices.shape))
        r, j = [ir.as_affine(s) for s in at], [ir.as_affine(s) for s in col]
        i64 = dtypes.int64
        picked: Expr = Call(ir.Op.CAST, (self.read(v.indices, r),), i64)
        picked = Call(ir.Op.MAX, (Call(ir.Op.MIN, (picked, Const(node.shape[0] - 1, i64)), i64), Const(0, i64)), i64)
        mine = Call(ir.Op.EQ, (picked, IndexValue(ir.as_affine(row), i64)), dtypes.bool_)
        value = Call(ir.Op.WHERE, (mine, self.read(v.values, (*r, *j)), Const(0, node.dtype)), node.dtype)
        body = Reduce(node, flat_index(node, (ir.as_affine(row), *j)), ir.AccumOp.ADD, Const(0, node.dtype),
                      tuple(zip(at, v.indices.shape)), value, ordered=True)
        nest = tuple(zip([row, *col], node.shape))
        return Kernel(name, nest, body, f"{node.label} = rows of {v.values.label} at {v.indices.label}, by row")

    def lower_accum(self, name: str, a: ir.Accum) -> list[Kernel]:
        pr = a.projections
        lhs_index = flat_index(a.lhs, pr.lhs)
        value = self.value(a)
        cells = cell_symbols(a)  # None when two iterations may write one cell
        comment = f"{a.lhs.label} {'=' if a.accum is None else a.accum.value + '='} {a.op.value}"
        kernels: list[Kernel] = []
        surjective = cells is not None and _is_surjective(a)
        if a.accum is not None and a.init_neutral and not surjective:
            zero = Const(a.accum.neutral(a.lhs.dtype), a.lhs.dtype)
            kernels.append(self.fill_kernel(f"{name}_init", a.lhs, zero, f"{a.lhs.label} = neutral"))
        start_from_neutral = a.init_neutral and surjective
        if cells is None:  # serial: iterations may hit the same cell
            body: Stmt = Store(a.lhs, lhs_index, value, a.accum)
            for s, n in reversed(pr.product_space):
                body = Loop(s, n, body)
            kernels.append(Kernel(name, (), body, comment + " (serial)"))
            return kernels
        parallel = tuple((s, pr.extent(s)) for s in cells)
        rest = tuple((s, n) for s, n in pr.product_space if s not in cells)
        if a.accum is None or not rest:
            accum = None if (a.accum is None or start_from_neutral) else a.accum
            if (start_from_neutral and a.accum is ir.AccumOp.ADD and a.lhs.dtype.is_float
                    and isinstance(value, Call) and value.op is ir.Op.MUL):
                value = _plus_zero(value, a.lhs.dtype)
            body = Store(a.lhs, lhs_index, value, accum)
            for s, n in reversed(rest):  # an assignment over extra symbols: the last write wins
                body = Loop(s, n, body)
        else:
            init = Const(a.accum.neutral(a.lhs.dtype), a.lhs.dtype) if start_from_neutral else None
            body = Reduce(a.lhs, lhs_index, a.accum, init, rest, value)
        kernels.append(Kernel(name, parallel, body, comment))
        return kernels


def _plus_zero(product: Expr, dtype: dtypes.DType) -> Expr:
    """A product summed from zero alone (``i,i->i``, ``i,j->ij``): 0 + (-0.0) is +0.0, as the
    reference and numpy's einsum give (found by review: stored as is, 1 / it was -inf for
    +inf). Spelled as a select, not ``0.0 + x``, which compilers contract with the product
    into an FMA that keeps an underflowing product's sign (the review's second look). A
    single operand (a copy, a transpose) keeps its bits, as numpy's views do."""
    zero = Const(0.0, dtype)
    return Call(ir.Op.WHERE, (Call(ir.Op.EQ, (product, zero), dtypes.bool_), zero, product), dtype)


def cell_symbols(a: ir.Accum) -> tuple[Symbol, ...] | None:
    """The symbols that pick the lhs cell, in lhs axis order, if distinct iterations of them
    write distinct cells (each lhs index uses at most one symbol, each symbol at most once)."""
    out: list[Symbol] = []
    for e in a.projections.lhs:
        loop_vars = [v for v in e.vars if isinstance(v, Symbol)]
        if len(loop_vars) > 1:
            return None
        if loop_vars:
            if loop_vars[0] in out:
                return None
            out.append(loop_vars[0])
    return tuple(out)


def _is_surjective(a: ir.Accum) -> bool:
    """Every cell of the lhs is written."""
    for e, n in zip(a.projections.lhs, a.lhs.shape):
        if n == 1:
            continue
        if e.const != 0 or len(e.terms) != 1:
            return False
        v, c = e.terms[0]
        if c != 1 or not isinstance(v, Symbol) or a.projections.extent(v) != n:
            return False
    return True


# ---------------------------------------------------------------------------
# Simplification


def _drop_unit_loops(k: Kernel) -> Kernel:
    units: dict[ir.Var, Affine] = {s: Affine() for s, n in k.parallel if n == 1}
    units.update({st.sym: Affine() for st in walk_stmts(k.body) if isinstance(st, Loop) and st.extent == 1})
    for st in walk_stmts(k.body):
        if isinstance(st, Reduce):
            units.update({s: Affine() for s, n in st.loops if n == 1})
    if not units:
        return k
    body = _strip_loops(k.body, set(units))
    body = map_stmt(body, lambda a: a.substitute(units))
    return attrs.evolve(k, parallel=tuple((s, n) for s, n in k.parallel if s not in units), body=body)


def _strip_loops(s: Stmt, drop: set[ir.Var]) -> Stmt:
    if isinstance(s, Loop):
        inner = _strip_loops(s.body, drop)
        return inner if s.sym in drop else Loop(s.sym, s.extent, inner)
    if isinstance(s, Reduce):
        return attrs.evolve(s, loops=tuple((v, n) for v, n in s.loops if v not in drop))
    if isinstance(s, Seq):
        return Seq(tuple(_strip_loops(st, drop) for st in s.body))
    return s


def _merge_parallel(k: Kernel) -> Kernel:
    """Merge adjacent parallel loops (outer, inner) when every index has coeff(outer) ==
    extent(inner) * coeff(inner): the pair then walks memory like one loop."""
    changed = True
    while changed and len(k.parallel) > 1:
        changed = False
        affs = list(affines_of(k))
        for pos in range(len(k.parallel) - 1):
            (so, no), (si, ni) = k.parallel[pos], k.parallel[pos + 1]
            if all(a.coeff(so) == ni * a.coeff(si) for a in affs):
                drop: dict[ir.Var, Affine] = {so: Affine()}
                body = map_stmt(k.body, functools.partial(Affine.substitute, env=drop))
                parallel = k.parallel[:pos] + ((si, no * ni),) + k.parallel[pos + 2 :]
                k = attrs.evolve(k, parallel=parallel, body=body)
                changed = True
                break
    return k


def _merge_reduced(k: Kernel) -> Kernel:
    """A top-level reduction's adjacent loops merged where they walk memory like one loop (as
    _merge_parallel merges the parallel nest's): one long vector loop, not a collapsed nest."""
    r = k.body
    if not isinstance(r, Reduce):
        return k
    affs = list(affines_of(k))
    for pos in range(len(r.loops) - 1):
        (so, no), (si, ni) = r.loops[pos], r.loops[pos + 1]
        if all(a.coeff(so) == ni * a.coeff(si) for a in affs):
            loops = r.loops[:pos] + ((si, no * ni),) + r.loops[pos + 2:]
            body = map_stmt(attrs.evolve(r, loops=loops), functools.partial(Affine.substitute, env={so: Affine()}))
            return _merge_reduced(attrs.evolve(k, body=body))
    return k


def _lane_sums(k: Kernel) -> Kernel:
    """A reduction into many cells whose innermost loop reads memory contiguously (a row sum,
    a row's max, a matrix-vector product) folds it in vector lanes, as a split reduction's
    parts do (``reassociable``): in an order fixed by the sizes and the vector width, not by
    the thread count. In loop order, GCC does not vectorize it: 3-9x numpy's time."""
    r = k.body
    if (not k.parallel or not isinstance(r, Reduce) or not r.loops or r.ordered or r.reassociable
            or not r.node.dtype.is_float or r.accum not in (ir.AccumOp.ADD, ir.AccumOp.MAX, ir.AccumOp.MIN)):
        return k
    inner = r.loops[-1][0]
    loads = [e for e in walk_exprs(r) if isinstance(e, Load)]
    if any(e.row is not None or e.merge or e.index.coeff(inner) not in (0, 1) for e in loads):
        return k
    if not any(e.index.coeff(inner) == 1 for e in loads):  # nothing read along it (or no load)
        return k
    return _merge_reduced(attrs.evolve(k, body=attrs.evolve(r, reassociable=True)))


def simplify(k: Kernel) -> Kernel:
    return _merge_parallel(_drop_unit_loops(k))


# A full reduction (no parallel nest) at least this long is split in two kernels.
SPLIT_MIN_LENGTH = 1 << 15
SPLIT_PARTS = 256  # partial results wanted (a divisor of a reduced extent near this is taken)
SPLIT_MIN_CHUNK = 128  # each partial reduces at least this many values


def _split_parts(loops: tuple[tuple[Symbol, int], ...]) -> tuple[int, int] | None:
    """(which loop, into how many parts): the outermost reduced loop whose extent has a
    divisor between 32 and 1024 that leaves chunks of at least SPLIT_MIN_CHUNK values, and
    of its divisors the one closest to SPLIT_PARTS (the outermost, so that each chunk is a
    contiguous run of memory when the loops walk it row-major)."""
    length = math.prod(n for _, n in loops)
    for pos, (_, n) in enumerate(loops):
        fits = [d for d in range(32, min(n, 1024) + 1) if n % d == 0 and length // d >= SPLIT_MIN_CHUNK]
        if fits:
            return pos, min(fits, key=lambda d: (abs(d - SPLIT_PARTS), d))
    return None


def _ragged_parts(loops: tuple[tuple[Symbol, int], ...]) -> tuple[int, int] | None:
    """(which loop, into how many parts) for a reduction no divisor splits (a prime length):
    SPLIT_PARTS chunks of ``extent // SPLIT_PARTS``, the rest of the loop a tail. Of the loops
    long enough, the one whose tail holds the fewest values (the outermost of those)."""
    length = math.prod(n for _, n in loops)
    fits = [(n % SPLIT_PARTS * (length // n), pos) for pos, (_, n) in enumerate(loops)
            if n >= SPLIT_PARTS and n // SPLIT_PARTS * (length // n) >= SPLIT_MIN_CHUNK]
    return (min(fits)[1], SPLIT_PARTS) if fits else None


def _outer_loops_as_parts(loops: tuple[tuple[Symbol, int], ...]) -> int | None:
    """How many outer loops, taken together, index the parts of a reduction whose loops are
    each too short to split alone (under 32 values): the fewest whose product reaches 32 (so
    under 32 * 32 parts), where each part still reduces SPLIT_MIN_CHUNK values or more; else
    one loop fewer, fewer parts of more values ((20, 20, 20, 5): 20 parts of 2000)."""
    length, parts, fewer = math.prod(n for _, n in loops), 1, None
    for count, (_, n) in enumerate(loops, 1):
        parts *= n
        if count == len(loops) or length // parts < SPLIT_MIN_CHUNK:
            return fewer
        if parts >= 32:
            return count
        if parts > 1:
            fewer = count
    return None


def split_long_reduction(k: Kernel) -> tuple[list[Kernel], Node | None]:
    """A long full reduction as two kernels: ``parts[b] = reduce(chunk b)`` over a parallel
    ``b``, then ``out = reduce(parts)``; for a length no divisor splits, a kernel between them
    reduces the values after the last chunk into one more partial result. Every backend then
    reduces in parallel (OpenMP threads, work-items, blocks) with no atomics, in an order
    fixed by the sizes (and, within a chunk, the vector width: chunks are ``reassociable``),
    never by the thread count, and rounds the cell once. Returns the kernels and the new
    scratch node of partial results (None: left whole, and serial: a reduction whose parts would
    be too short). A part's loops merge where they walk memory as one (an (N, 3) array's rows
    and columns: a collapsed simd nest with 3 inner trips ran 10x slower than one loop)."""
    r = k.body
    if (k.parallel or not isinstance(r, Reduce) or r.ordered
            or math.prod(n for _, n in r.loops) < SPLIT_MIN_LENGTH):
        return [k], None
    split = _split_parts(r.loops) or _ragged_parts(r.loops)
    if split is None:
        return _split_outer_loops(k, r)
    pos, parts = split
    sym, n = r.loops[pos]
    chunk = n // parts
    tail = n - parts * chunk
    b, c, b2 = Symbol(f"{sym.name}_part"), Symbol(f"{sym.name}_in"), Symbol(f"{sym.name}_parts")
    whole = ir.as_affine(b).scale(chunk) + ir.as_affine(c)
    # LOCAL: lower() records it. A half type's partial results stay float32 (its accumulator's
    # type): the cell is rounded once, as an unsplit reduction rounds it (the tail's too).
    partial = Node(f"{r.node.name}_parts", (parts + (1 if tail else 0),), r.node.dtype.compute)
    loops = (*r.loops[:pos], (c, chunk), *r.loops[pos + 1:])
    value = map_expr(r.value, lambda a: a.substitute({sym: whole}))
    neutral = Const(r.accum.neutral(partial.dtype), partial.dtype)
    kernels = [_merge_reduced(Kernel(f"{k.name}_parts", ((b, parts),),
                                     Reduce(partial, ir.as_affine(b), r.accum, neutral, loops, value, reassociable=True),
                                     f"{k.comment} (partial results)"))]
    if tail:
        t = Symbol(f"{sym.name}_tail")
        rest = map_expr(r.value, lambda a: a.substitute({sym: ir.as_affine(t) + ir.fixed(parts * chunk)}))
        kernels.append(Kernel(f"{k.name}_tail", (), Reduce(partial, ir.fixed(parts), r.accum, neutral,
                                                           (*r.loops[:pos], (t, tail), *r.loops[pos + 1:]), rest),
                              f"{k.comment} (the {tail} values after the last part)"))
    kernels.append(Kernel(k.name, (), Reduce(r.node, r.index, r.accum, r.init, ((b2, partial.shape[0]),),
                                             Load(partial, ir.as_affine(b2))),
                          f"{k.comment} (of {partial.shape[0]} partial results)"))
    return kernels, partial


def _split_outer_loops(k: Kernel, r: Reduce) -> tuple[list[Kernel], Node | None]:
    """A long full reduction whose loops are all short (30^4, say): its outer loops become the
    parallel nest of the partial results, one part per point of them (see split_long_reduction)."""
    count = _outer_loops_as_parts(r.loops)
    if count is None:
        return [k], None
    outer = r.loops[:count]
    parts = math.prod(n for _, n in outer)
    index = Affine()  # the parts in the loops' row-major order
    for (sym, _), st in zip(outer, strides(tuple(n for _, n in outer))):
        index = index + ir.as_affine(sym).scale(st)
    partial = Node(f"{r.node.name}_parts", (parts,), r.node.dtype.compute)
    neutral = Const(r.accum.neutral(partial.dtype), partial.dtype)
    b = Symbol(f"{r.node.name}_parts")
    return [_merge_reduced(simplify(Kernel(f"{k.name}_parts", outer,
                            Reduce(partial, index, r.accum, neutral, r.loops[count:], r.value, reassociable=True),
                            f"{k.comment} (partial results)"))),
            Kernel(k.name, (), Reduce(r.node, r.index, r.accum, r.init, ((b, parts),), Load(partial, ir.as_affine(b))),
                   f"{k.comment} (of {parts} partial results)")], partial


def transpose_y(k: Kernel, y: Load, ks: Symbol, js: Symbol) -> tuple[list[Kernel], Node]:
    """A contraction whose ``y`` is not contiguous along the output's columns ``js`` (``a @ b.T``)
    as two kernels: ``y`` copied to a new scratch node laid out ``[.., ks, js]`` (its other
    symbols first, in ``y``'s order), then the contraction reading the copy, which the dialect
    tiles (patterns.transposable_contraction). The copy moves each value of ``y`` once; the
    products read each ``m`` times. Returns the kernels and the scratch node."""
    r = k.body
    assert isinstance(r, Reduce) and isinstance(r.value, Call)
    extent = dict((*k.parallel, *r.loops))
    outer = [v for v, _ in sorted(y.index.terms, key=lambda t: -abs(t[1]))
             if isinstance(v, Symbol) and v not in (ks, js)]  # statics: never (transposable_contraction)
    order = [*outer, ks, js]
    shape = tuple(extent[v] for v in order)
    laid = Node(f"{y.node.name}_t", shape, y.node.dtype)  # LOCAL: lower() records it
    index = flat_index(laid, [ir.as_affine(v) for v in order])
    copy = Kernel(f"{k.name}_t", tuple((v, extent[v]) for v in order), Store(laid, index, y),
                  f"{y.node.label} laid out [.., k, j] for a product")
    value = attrs.evolve(r.value, args=tuple(Load(laid, index) if a == y else a for a in r.value.args))
    return [simplify(copy), attrs.evolve(k, body=attrs.evolve(r, value=value))], laid


# ---------------------------------------------------------------------------
# The batch


def _writes_in_part(leaf: ir.Accum | ir.Fetch) -> bool:
    """An assignment (no accumulation) that may leave some cells of its node unwritten."""
    return isinstance(leaf, ir.Accum) and leaf.accum is None and not ir.writes_every_cell(leaf)


def lower(comps: Sequence[ir.Comp], names: Sequence[str], horizontal: bool = True,
          epilogues: Callable[[Kernel], bool] | None = None,
          rows: Callable[[Kernel], bool] | None = None,
          segments: Callable[[Kernel], bool] | None = None,
          scatter_scan: int = 0,
          transposes: Callable[[Kernel], tuple[Load, Symbol, Symbol] | None] | None = None) -> LoweredBatch:
    """Lower a batch of computations into kernels (the names must be C identifiers);
    ``horizontal``: merge elementwise kernels of one iteration space; ``epilogues``: the
    contractions the target tiles with an epilogue, each merged with the elementwise kernel
    after it that reads it; ``rows``: the kernels the target runs in row groups, adjacent ones
    over one outer loop merged; ``segments``: the kernels the target batches, independent ones
    run as segments of one launch (core/fusion.py); ``scatter_scan``: scatters of at most this
    many rows x updates are computed by row (:meth:`_Lowerer.scatter_by_owner`); ``transposes``:
    for a contraction the target tiles only once its ``y`` is laid out ``[.., k, j]``, that
    load and the k and j symbols (:func:`transpose_y`)."""
    if len(names) != len(comps):  # zip would drop the computations without a name
        raise InvalidProgramError(f"lower: {len(comps)} computations but {len(names)} names")
    for k, c in enumerate(comps):
        if not isinstance(c, ir.Comp):
            raise InvalidProgramError(f"lower: computation {k} is a {type(c).__name__}, not an ir.Comp "
                                      "(ir.Comp.of(...) makes one)")
    folded = fold_constants(comps)
    # nodes folded into their readers as literals are never stored, as inlined ones are: a
    # context that holds one is refused at link (Context._check_link), not left stale
    gone = {ir.writes(leaf) for c in comps for leaf in c.leaves()} - \
        {ir.writes(leaf) for c in folded for leaf in c.leaves()}
    comps = [_read_own_target_first(c) for c in folded]
    inference = infer_modes(comps)
    inference.modes.update(dict.fromkeys(gone, MemoryMode.VIRTUAL))
    lowerer = _Lowerer(inference, scatter_scan)
    out: list[LoweredComp] = []
    for comp, name in zip(comps, names):
        kernels: list[Kernel] = []
        written: set[Node] = set()
        inputs: dict[Node, None] = {}
        constants: list[tuple[Node, np.ndarray]] = []
        merges: set[Node] = set()
        partials: list[Node] = []  # scratch the lowering adds (split reductions, b laid out)
        zeroed: list[Node] = []  # scratch zero-filled before its first write, which is partial
        for k, leaf in enumerate(comp.leaves()):
            target = ir.writes(leaf)
            for x in ir.reads(leaf):
                if isinstance(x, ir.MergeRead):
                    merges.add(x.node)
                elif x not in written and inference.modes.get(x) is not MemoryMode.VIRTUAL:
                    inputs[x] = None
            accumulates_onto_context = (
                isinstance(leaf, ir.Accum) and leaf.accum is not None and not leaf.init_neutral
            )
            if accumulates_onto_context and target not in written:
                inputs[target] = None
            first_write = target not in written
            written.add(target)
            if inference.modes[target] is MemoryMode.VIRTUAL:
                continue
            if isinstance(leaf, ir.Fetch) and isinstance(leaf.value, ir.Constant):
                constants.append((target, leaf.value.values))
                continue
            kname = f"{name}_{k}"
            if first_write and inference.modes[target] is MemoryMode.LOCAL and _writes_in_part(leaf) \
                    and target not in inputs:
                # scratch shares memory within a run: a node written at some cells starts at
                # zero, as the reference's does, not with what an earlier scratch node left;
                # one read before its first write holds the context's values (an input)
                kernels.append(lowerer.fill_kernel(f"{kname}_zero", target, Const(0, target.dtype),
                                                   f"{target.label} = 0"))
                zeroed.append(target)
            raw = lowerer.lower_fetch(kname, leaf) if isinstance(leaf, ir.Fetch) else lowerer.lower_accum(kname, leaf)
            for kern in map(simplify, raw):
                moved = transposes(kern) if transposes is not None else None
                pieces, partial = (transpose_y(kern, *moved) if moved is not None
                                   else split_long_reduction(_lane_sums(kern)))
                kernels.extend(pieces)
                if partial is not None:  # scratch the lowering made: b laid out, partial results
                    partials.append(partial)
                    inference.modes[partial] = MemoryMode.LOCAL
        if horizontal:
            local = {n for n, m in inference.modes.items() if m is MemoryMode.LOCAL}
            kernels = fuse_horizontal(kernels, local)
        if epilogues is not None:
            kernels = fuse_epilogues(kernels, epilogues)
        if rows is not None:
            kernels = fuse_rows(kernels, rows)
        if segments is not None:
            kernels = fuse_segments(kernels, segments)
        if len(merges) > 1:
            labels = ", ".join(sorted(m.label for m in merges))
            raise InvalidProgramError(f"computation {name} reads several merge-buffer nodes: {labels}")
        modes = inference.modes
        outputs = tuple(n for n in dict.fromkeys(ir.writes(leaf) for leaf in comp.leaves())
                        if modes[n] in (MemoryMode.ON_DEVICE, MemoryMode.MATERIALIZED))
        scratch = tuple(n for n in dict.fromkeys(ir.writes(leaf) for leaf in comp.leaves())
                        if modes[n] is MemoryMode.LOCAL) + tuple(partials)
        partly_written = tuple(dict.fromkeys(ir.writes(leaf) for leaf in comp.leaves() if _writes_in_part(leaf)))
        out.append(
            LoweredComp(name, tuple(kernels), tuple(inputs), outputs, scratch, tuple(constants),
                        next(iter(merges), None), partly_written, tuple(zeroed))
        )
    if epilogues is not None:
        out = _private_sums(out, {n for n, m in inference.modes.items() if m is MemoryMode.LOCAL}, epilogues)
    return LoweredBatch(tuple(out), inference.modes)


def _private_sums(comps: list[LoweredComp], scratch: set[Node], tiled: Callable[[Kernel], bool]) -> list[LoweredComp]:
    """The computations with their contractions' private sums marked (fusion.private_sums),
    readers counted over the whole batch."""
    marked = iter(private_sums([k for c in comps for k in c.kernels], scratch, tiled))
    return [attrs.evolve(c, kernels=tuple(next(marked) for _ in c.kernels)) for c in comps]
