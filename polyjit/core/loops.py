"""The loop IR: what lowering (core/lower.py) produces and codegen (core/codegen.py) reads.

A batch lowers to computations (``LoweredComp``), each a list of ``Kernel``s. A kernel is
a nest of parallel loops (distinct iterations write distinct cells) around one statement:
a ``Store``, a ``Reduce`` (a per-cell accumulator over reduction loops) or serial
``Loop``s around either, or a ``Seq`` of statements (core/fusion.py: the stores of a
horizontally fused kernel, a contraction and its epilogue, a row group's statements, or a
batch's ``Segment``s).
Expressions (``Load``, ``Const``, ``IndexValue``, ``Call``) carry their dtype; indices are
flat ``Affine`` forms, in elements.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Union

import attrs
import numpy as np

from polyjit.core import dtypes, ir
from polyjit.core.dtypes import DType
from polyjit.core.ir import Affine, MemoryMode, Node, Symbol

# ---------------------------------------------------------------------------
# Expressions


@attrs.frozen
class Row:
    """A row picked by data (a gather's load, a scatter's store): ``clamp(value, 0, rows - 1)
    * size`` elements, added to the access's affine index (the column within the row)."""

    value: Expr  # an integer
    rows: int
    size: int


@attrs.frozen
class Load:
    node: Node
    index: Affine  # flat, row-major, in elements
    merge: bool = False  # read from the device's merge buffer
    row: Row | None = None  # plus a row picked by data

    @property
    def dtype(self) -> DType:
        return self.node.dtype


@attrs.frozen
class Const:
    value: int | float | bool
    dtype: DType


@attrs.frozen
class IndexValue:
    """An index expression used as a value (``Range``)."""

    index: Affine
    dtype: DType = dtypes.int64


@attrs.frozen
class Call:
    op: ir.Op
    args: tuple[Expr, ...]
    dtype: DType  # the result dtype (for CAST: the target)


Expr = Union[Load, Const, IndexValue, Call]

# ---------------------------------------------------------------------------
# Statements


@attrs.frozen
class Store:
    """``node[index] = value``, or ``node[index] = accum(node[index], value)``."""

    node: Node
    index: Affine
    value: Expr
    accum: ir.AccumOp | None = None
    row: Row | None = None  # plus a row picked by data (a scatter's updates: always serial)


@attrs.frozen
class Reduce:
    """One output cell: ``acc = init (or the cell); for loops: acc = accum(acc, value); cell = acc``."""

    node: Node
    index: Affine
    accum: ir.AccumOp
    init: Expr | None  # None: start from what the cell holds
    loops: tuple[tuple[Symbol, int], ...]
    value: Expr
    # The values may be combined in any order (the partial results of a split reduction):
    # a dialect may keep several accumulators (vector lanes). Otherwise: in loop order.
    reassociable: bool = False
    # One work-item combines them, in loop order, on every target (a GPU's group-per-cell
    # tree would round differently): a scatter's sums, which promise the serial order.
    ordered: bool = False

    @property
    def length(self) -> int:
        """Values reduced into the cell."""
        return math.prod(n for _, n in self.loops)


@attrs.frozen
class Loop:
    """A serial loop."""

    sym: Symbol
    extent: int
    body: Stmt


@attrs.frozen
class Seq:
    """Statements run one after the other in each iteration of the parallel nest (the body of
    a horizontally fused kernel: stores over one iteration space, see core/fusion.py)."""

    body: tuple[Stmt, ...]


@attrs.frozen
class Segment:
    """``body`` for the iterations ``lo <= sym < hi`` of the kernel's one parallel loop ``sym``
    (a batch of independent elementwise kernels, each over its own segment of one range:
    core/fusion.py ``fuse_segments``). ``body`` is written in ``sym`` (a member's own loop
    symbol is ``sym - lo``)."""

    sym: Symbol
    lo: int
    hi: int
    body: Stmt


Stmt = Union[Store, Reduce, Loop, Seq, Segment]


@attrs.frozen
class Kernel:
    """One kernel: a nest of parallel loops around a body."""

    name: str
    parallel: tuple[tuple[Symbol, int], ...]
    body: Stmt
    comment: str = ""
    # Scratch nodes this kernel writes and only it reads, each at the cell it writes (a
    # contraction's sum that only its epilogue reads: core/fusion.py, private_sums). No other
    # kernel and nothing after the run sees them: a target may keep them out of memory.
    private: tuple[Node, ...] = ()

    @property
    def stores(self) -> list[Store | Reduce]:
        return [s for s in walk_stmts(self.body) if isinstance(s, (Store, Reduce))]

    @property
    def loads(self) -> list[Load]:
        return [e for e in walk_exprs(self.body) if isinstance(e, Load)]

    @property
    def outputs(self) -> tuple[Node, ...]:
        return tuple(dict.fromkeys(s.node for s in self.stores))

    @property
    def inputs(self) -> tuple[Node, ...]:
        """Nodes read from their own buffers (in-place accumulation reads the lhs too)."""
        nodes = [ld.node for ld in self.loads if not ld.merge]
        nodes += [s.node for s in self.stores if isinstance(s, Store) and s.accum is not None]
        nodes += [s.node for s in self.stores if isinstance(s, Reduce) and s.init is None]
        return tuple(dict.fromkeys(nodes))

    @property
    def buffers(self) -> tuple[Node, ...]:
        """The kernel's buffer parameters, in order: outputs first, then inputs."""
        return tuple(dict.fromkeys(self.outputs + self.inputs))

    @property
    def merge_input(self) -> Node | None:
        merged = [ld.node for ld in self.loads if ld.merge]
        return merged[0] if merged else None

    @property
    def statics(self) -> tuple[ir.StaticSymbol, ...]:
        found = {v for a in affines_of(self) for v in a.vars if isinstance(v, ir.StaticSymbol)}
        return tuple(sorted(found, key=lambda s: s.name))

    @property
    def work(self) -> int:
        """Iterations of the parallel nest (the dialects' launch size)."""
        return int(np.prod([n for _, n in self.parallel], dtype=np.int64))

    @property
    def total_work(self) -> int:
        """Iterations of the innermost statement: the parallel nest times the loops inside it
        (of a ``Seq``'s statements, the longest: what a fused kernel's thresholds compare)."""
        return self.work * inner_work(self.body)


def inner_work(s: Stmt, weight: Callable[[Stmt], int] | None = None) -> int:
    """Iterations of ``s`` for one iteration of the parallel nest (of a ``Seq``, its longest
    statement's); ``weight`` multiplies each store's or reduction's own."""
    if isinstance(s, Segment):
        return inner_work(s.body, weight)
    if isinstance(s, Seq):
        return max((inner_work(st, weight) for st in s.body), default=1)
    if isinstance(s, Loop):
        return s.extent * inner_work(s.body, weight)
    return (s.length if isinstance(s, Reduce) else 1) * (1 if weight is None else weight(s))


# ---------------------------------------------------------------------------
# Walkers


def walk_stmts(s: Stmt) -> Iterator[Stmt]:
    yield s
    if isinstance(s, (Loop, Segment)):
        yield from walk_stmts(s.body)
    elif isinstance(s, Seq):
        for st in s.body:
            yield from walk_stmts(st)


def walk_expr(e: Expr) -> Iterator[Expr]:
    yield e
    if isinstance(e, Call):
        for c in e.args:
            yield from walk_expr(c)
    elif isinstance(e, Load) and e.row is not None:
        yield from walk_expr(e.row.value)


def walk_exprs(s: Stmt) -> Iterator[Expr]:
    for st in walk_stmts(s):
        if isinstance(st, Store):
            if st.row is not None:
                yield from walk_expr(st.row.value)
            yield from walk_expr(st.value)
        elif isinstance(st, Reduce):
            if st.init is not None:
                yield from walk_expr(st.init)
            yield from walk_expr(st.value)


def affines_of(k: Kernel) -> Iterator[Affine]:
    for st in walk_stmts(k.body):
        if isinstance(st, (Store, Reduce)):
            yield st.index
    for e in walk_exprs(k.body):
        if isinstance(e, (Load, IndexValue)):
            yield e.index


def _map_row(r: Row | None, f: Callable[[Affine], Affine]) -> Row | None:
    return None if r is None else attrs.evolve(r, value=map_expr(r.value, f))


def map_expr(e: Expr, f: Callable[[Affine], Affine]) -> Expr:
    """``e`` with ``f`` applied to every index in it."""
    if isinstance(e, Load):
        return attrs.evolve(e, index=f(e.index), row=_map_row(e.row, f))
    if isinstance(e, IndexValue):
        return attrs.evolve(e, index=f(e.index))
    if isinstance(e, Call):
        return attrs.evolve(e, args=tuple(map_expr(a, f) for a in e.args))
    return e


def map_stmt(s: Stmt, f: Callable[[Affine], Affine],
             loops: Callable[[Symbol, int], tuple[Symbol, int]] | None = None) -> Stmt:
    """``s`` with ``f`` applied to every index, and ``loops`` to every loop (symbol, extent)."""
    if isinstance(s, Store):
        return attrs.evolve(s, index=f(s.index), value=map_expr(s.value, f), row=_map_row(s.row, f))
    if isinstance(s, Reduce):
        init = None if s.init is None else map_expr(s.init, f)
        new_loops = tuple(loops(*lp) for lp in s.loops) if loops else s.loops
        return attrs.evolve(s, index=f(s.index), init=init, loops=new_loops, value=map_expr(s.value, f))
    if isinstance(s, Seq):
        return Seq(tuple(map_stmt(st, f, loops) for st in s.body))
    if isinstance(s, Segment):
        return attrs.evolve(s, body=map_stmt(s.body, f, loops))
    sym, ext = loops(s.sym, s.extent) if loops else (s.sym, s.extent)
    return Loop(sym, ext, map_stmt(s.body, f, loops))


# ---------------------------------------------------------------------------
# A lowered batch


@attrs.frozen
class LoweredComp:
    name: str
    kernels: tuple[Kernel, ...]
    inputs: tuple[Node, ...]  # read before written: must be in the context at link time
    outputs: tuple[Node, ...]  # persist in the context (embedded)
    scratch: tuple[Node, ...]  # LOCAL: stored only inside the batch
    constants: tuple[tuple[Node, np.ndarray], ...]
    merge_input: Node | None
    # written, maybe not at every cell: a link zeroes them when it creates them (their cells
    # start at zero, as the reference's; reused memory shows nothing old)
    partial: tuple[Node, ...] = ()
    # scratch the batch zero-fills before its first write, which writes only some cells: a
    # context that holds one would lose its other cells (Context._check_link refuses it)
    zeroed: tuple[Node, ...] = ()

    @property
    def statics(self) -> tuple[ir.StaticSymbol, ...]:
        found = {s for k in self.kernels for s in k.statics}
        return tuple(sorted(found, key=lambda s: s.name))


@attrs.frozen
class LoweredBatch:
    comps: tuple[LoweredComp, ...]
    modes: dict[Node, MemoryMode]

    @property
    def kernels(self) -> list[Kernel]:
        return [k for c in self.comps for k in c.kernels]
