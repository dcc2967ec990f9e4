"""Horizontal fusion: elementwise kernels of one iteration space merged into one kernel.

Lowering (core/lower.py) gives each stored write its own kernel; an optimizer step then has
several small elementwise kernels over one shape (AdamW: the first moment, the second, the
weight). :func:`fuse_horizontal` merges such kernels of a computation into one whose body
(a ``Seq``) runs their stores in order in each iteration of the shared parallel nest.

Kernels merge when, and only when:

- each is *fusable* (``patterns.fusable``: one ``Store`` in its parallel nest, so no
  reduction, contraction or serial loop, no merge buffer, no shape of its own on a dialect),
  and their parallel nests have the same extents (the later ones' symbols are renamed onto
  the first's);
- every node the group writes that more than one member touches is accessed by all of them
  at one and the same index (pointwise): each iteration then reads what it wrote itself,
  and no iteration overwrites what another still reads; and none of those is scratch
  (``LOCAL``: fused, its buffer could no longer share space with the others');
- they are next to each other in the computation's order, or can be made so by passing
  kernels that are independent of them (neither writes what the other reads or writes):
  the newer kernel moves up past them, or the group moves down past them. A kernel looks
  back at most ``WINDOW`` entries for a group.

Anything else stays as it was. Fusion never changes a value: each store computes the same
expression from the same values as before.

:func:`fuse_epilogues` (at the end) merges an elementwise kernel into a tiled contraction
before it, as the epilogue its tiles run (docs/architecture.md, "Epilogues"), and
:func:`private_sums` marks the sums that only their epilogue reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence, Set

import attrs

from polyjit.core import ir
from polyjit.core.ir import Affine, Node, Symbol
from polyjit.core.loops import (
    Kernel,
    Load,
    Loop,
    Reduce,
    Segment,
    Seq,
    Stmt,
    Store,
    affines_of,
    map_stmt,
    walk_exprs,
    walk_stmts,
)
from polyjit.core.patterns import elementwise_stores, fusable, match_contraction

WINDOW = 16  # entries of the schedule a kernel looks back over for a group to join
MAX_STATEMENTS = 16  # stores of one fused kernel
# Buffers of one batch: OpenCL guarantees 1024 bytes of kernel arguments, and a buffer
# takes 16 (its pointer and offset), statics and a merge buffer aside.
MAX_BATCH_BUFFERS = 48


def accesses(kernel: Kernel) -> list[tuple[Node, Affine, bool]]:
    """Every (node, index, is_write) the kernel's body does (merge-buffer reads included)."""
    out: list[tuple[Node, Affine, bool]] = []
    for st in walk_stmts(kernel.body):
        if isinstance(st, (Store, Reduce)):
            out.append((st.node, st.index, True))
            if (st.accum is not None) if isinstance(st, Store) else st.init is None:
                out.append((st.node, st.index, False))
    out += [(e.node, e.index, False) for e in walk_exprs(kernel.body) if isinstance(e, Load)]
    return out


@attrs.define
class _Entry:
    """A kernel of the schedule, or a group of fusable kernels (the first one's symbols)."""

    members: list[Kernel]
    space: tuple[int, ...] | None  # the parallel extents; None: not fusable
    indices: dict[Node, set[Affine]]  # the indices of every access to each node
    users: dict[Node, int]  # members that touch each node
    written: set[Node]

    @staticmethod
    def of(kernel: Kernel) -> _Entry:
        space = tuple(n for _, n in kernel.parallel) if fusable(kernel) else None
        e = _Entry([], space, {}, {}, set())
        e.add(kernel)
        return e

    def add(self, kernel: Kernel) -> None:
        self.members.append(kernel)
        seen: set[Node] = set()
        for node, index, write in accesses(kernel):
            self.indices.setdefault(node, set()).add(index)
            if write:
                self.written.add(node)
            if node not in seen:
                seen.add(node)
                self.users[node] = self.users.get(node, 0) + 1

    @property
    def touched(self) -> set[Node]:
        return set(self.indices)

    def independent(self, other: _Entry) -> bool:
        """Neither writes a node the other reads or writes: they may run in either order."""
        return not (self.written & other.touched) and not (other.written & self.touched)

    def renamed(self, kernel: Kernel) -> Kernel:
        """``kernel`` over this group's parallel symbols (the extents are equal)."""
        env: dict[ir.Var, Affine] = {
            s: ir.as_affine(t) for (s, _), (t, _) in zip(kernel.parallel, self.members[0].parallel)
        }
        return attrs.evolve(kernel, parallel=self.members[0].parallel,
                            body=map_stmt(kernel.body, lambda a: a.substitute(env)))

    def accepts(self, other: _Entry, scratch: Set[Node]) -> bool:
        """``other`` (one renamed kernel) may run right after this group's members, in the same
        iteration: every node written by either and touched by both is accessed at one index,
        and none is scratch that one writes and the other reads (its buffer would then live
        as long as the fused kernel's others: the planner could not reuse its space)."""
        if self.space is None or self.space != other.space or len(self.members) >= MAX_STATEMENTS:
            return False
        for node in (self.written | other.written) & self.touched & other.touched:
            if node in scratch or len(self.indices[node] | other.indices[node]) != 1:
                return False
        return True

    def kernel(self) -> Kernel:
        first = self.members[0]
        if len(self.members) == 1:
            return first
        comment = "; ".join(k.comment for k in self.members)
        return Kernel(first.name, first.parallel, Seq(tuple(k.body for k in self.members)), comment)


def fuse_horizontal(kernels: Sequence[Kernel], scratch: Set[Node] = frozenset()) -> list[Kernel]:
    """The kernels of one computation, in order, with fusable ones merged (module docstring);
    ``scratch``: the batch's LOCAL nodes."""
    schedule: list[_Entry] = []
    for k in kernels:
        entry = _Entry.of(k)
        if entry.space is None or not _join(schedule, k, scratch):
            schedule.append(entry)
    return [e.kernel() for e in schedule]


def _join(schedule: list[_Entry], kernel: Kernel, scratch: Set[Node]) -> bool:
    """Add ``kernel`` (the newest) to a group of the schedule's last WINDOW entries, moving it
    up past the entries after that group, or the group down past them, when they are
    independent of what moves."""
    for pos in range(len(schedule) - 1, max(-1, len(schedule) - 1 - WINDOW), -1):
        group = schedule[pos]
        if group.space is None or group.space != tuple(n for _, n in kernel.parallel):
            continue
        new = _Entry.of(group.renamed(kernel))
        if group.accepts(new, scratch) and _gather(schedule, pos, new):
            return True
    return False


def _gather(schedule: list[_Entry], pos: int, new: _Entry) -> bool:
    """Add ``new`` (one kernel, the newest) to the group at ``pos`` when it can move up to the
    group past the entries after it (they are independent of it), or the group can move down
    to it (they are independent of the group)."""
    group, after = schedule[pos], schedule[pos + 1:]
    if all(x.independent(new) for x in after):  # the kernel moves up to the group
        group.add(new.members[0])
        return True
    if all(x.independent(group) for x in after):  # the group moves down to the kernel
        del schedule[pos]
        group.add(new.members[0])
        schedule.append(group)
        return True
    return False


# ---------------------------------------------------------------------------
# Epilogues: an elementwise kernel run on each output tile of the contraction before it


def fuse_epilogues(kernels: Sequence[Kernel], tiled: Callable[[Kernel], bool]) -> list[Kernel]:
    """The kernels of one computation, in order, with each elementwise kernel that reads the
    output of a tiled contraction (``tiled``: the dialect tiles this kernel, with epilogues)
    merged into it as the contraction's epilogue (a ``Seq``: the sum, then the elementwise
    stores; see :func:`_epilogue`). The contraction may be up to ``WINDOW`` kernels back (an
    optimizer step computes every gradient before the first update, so a weight's update
    comes after the gradients of other layers): see :func:`_join_epilogue`."""
    out: list[Kernel] = []
    for k in kernels:
        if not _join_epilogue(out, k, tiled):
            out.append(k)
    return out


def _join_epilogue(out: list[Kernel], e: Kernel, tiled: Callable[[Kernel], bool]) -> bool:
    """Merge ``e`` into the nearest of ``out``'s last ``WINDOW`` kernels that takes it as an
    epilogue. ``e`` moves up past the kernels in between that it is independent of; those it
    is not (the MLP's ``w^T`` for the hidden gradient reads the weight its update writes) move
    up above the contraction, if they are independent of it and of the kernels they pass."""
    for pos in range(len(out) - 1, max(-1, len(out) - 1 - WINDOW), -1):
        fused = _epilogue(out[pos], e) if tiled(out[pos]) else None
        if fused is None:
            continue
        moving, between = _Entry.of(e), [_Entry.of(k) for k in out[pos + 1:]]
        hoisted = [i for i, x in enumerate(between) if not x.independent(moving)]
        contraction = _Entry.of(out[pos])
        for i in hoisted:
            passed = [between[j] for j in range(i) if j not in hoisted] + [contraction]
            if not all(x.independent(between[i]) for x in passed):
                return False
        rest = [out[pos + 1 + i] for i in range(len(between)) if i not in hoisted]
        out[pos:] = [out[pos + 1 + i] for i in hoisted] + [fused] + rest
        return True
    return False


def _epilogue(p: Kernel, e: Kernel) -> Kernel | None:
    """``p`` (a contraction: a fresh sum per output cell) with ``e`` run on each of its cells
    right after the cell's sum is stored, when that computes what ``p`` then ``e`` did:

    - ``e`` is elementwise (stores only, no row picked by data) over the same parallel
      space (its symbols written in ``p``'s, see :func:`_onto`), and reads ``p``'s output
      only at the cell that iteration of ``p`` writes: the cell's final sum;
    - ``e`` writes nothing ``p`` reads or writes: ``p``'s later cells read what they did."""
    r = p.body
    if not isinstance(r, Reduce) or r.init is None:
        return None
    stmts = elementwise_stores(e)
    if stmts is None:
        return None
    env = _onto(e.parallel, p.parallel)
    if env is None:
        return None
    renamed = [map_stmt(st, lambda a: a.substitute(env)) for st in stmts]
    if not _reads_sum_at_its_cell(renamed, r):
        return None
    if {st.node for st in renamed if isinstance(st, Store)} & (set(p.inputs) | {r.node}):
        return None
    comment = f"{p.comment}; {e.comment}" if e.comment else p.comment
    return Kernel(p.name, p.parallel, Seq((r, *renamed)), comment)


def private_sums(kernels: Sequence[Kernel], scratch: Set[Node], tiled: Callable[[Kernel], bool]) -> list[Kernel]:
    """``kernels`` (every kernel of a batch, in order), each contraction the target tiles with
    an epilogue (``tiled``, as for :func:`fuse_epilogues`) marked (``Kernel.private``) when
    its sum is scratch that no other kernel reads: the epilogue is its only reader, at the
    cell just summed, so the target may hand the epilogue the sums where it holds them (the
    CPU's tiles: a local array) and never store them. The MLP's weight gradient is such a
    sum, read only by the optimizer update in its epilogue: stored, it costs a write of the
    whole gradient each step, and on two cores that each wrote part of it in the last step,
    the transfer of half its cache lines between them. Other kernels that start with a sum
    (a row group's max) are left as they are."""
    readers: dict[Node, int] = {}
    for k in kernels:
        for n in k.inputs:
            readers[n] = readers.get(n, 0) + 1
    out = []
    for k in kernels:
        c = match_contraction(k)
        if (c is not None and c.epilogue and c.reduce.init is not None and c.reduce.node in scratch
                and readers.get(c.reduce.node) == 1 and _reads_sum_at_its_cell(c.epilogue, c.reduce) and tiled(k)):
            k = attrs.evolve(k, private=(c.reduce.node,))
        out.append(k)
    return out


def _reads_sum_at_its_cell(after: Sequence[Stmt], r: Reduce) -> bool:
    """The statements ``after`` the sum ``r`` read it, and only at the cell ``r`` writes (its
    final sum: no row picked by data, no merge buffer), and write it nowhere."""
    reads = [x for st in after for x in walk_exprs(st) if isinstance(x, Load) and x.node is r.node]
    writes = [w for st in after for w in walk_stmts(st) if isinstance(w, (Store, Reduce)) and w.node is r.node]
    return bool(reads) and not writes and all(not x.merge and x.row is None and x.index == r.index for x in reads)


def _onto(nest: tuple[tuple[Symbol, int], ...], onto: tuple[tuple[Symbol, int], ...]) -> dict[ir.Var, Affine] | None:
    """Each symbol of ``nest`` as an index over ``onto``'s symbols, when ``nest`` is ``onto``
    with runs of adjacent loops merged into one (lowering merges an elementwise kernel's
    contiguous loops): a merged loop's symbol is its run's row-major flat index. None if it
    is not."""
    env: dict[ir.Var, Affine] = {}
    pos = 0
    for sym, extent in nest:
        flat, size = ir.as_affine(0), 1
        while size < extent and pos < len(onto):
            s, n = onto[pos]
            flat, size, pos = flat.scale(n) + ir.as_affine(s), size * n, pos + 1
        if size != extent:
            return None
        env[sym] = flat
    return env if pos == len(onto) else None


# ---------------------------------------------------------------------------
# Row groups: kernels over the rows of one outer loop, each row's statements run in turn


def fuse_rows(kernels: Sequence[Kernel], joins: Callable[[Kernel], bool]) -> list[Kernel]:
    """The kernels of one computation, in order, with runs of adjacent kernels that share their
    outermost parallel loop merged into one kernel over that loop (a *row group*): each
    iteration runs every member's statements for its row in turn, the rest of a member's
    parallel nest as serial loops. Softmax's max, shift, sum of exponentials and log become one
    kernel; a reduction joins its producers and consumers (docs/architecture.md, "Row groups").

    ``joins``: the kernels the target runs well one row per iteration (the dialect's choice,
    ``patterns.row_fusable``). A kernel joins a group when every node written by one of them
    and touched by both is only ever accessed within the iteration's own row (its outer-loop
    coefficient is the node's row size, the rest of the index stays inside the row, no row
    picked by data, no merge buffer): an iteration then reads only what earlier members wrote
    for its row, and overwrites nothing another iteration reads. The group is the one right
    before the kernel, or an earlier one of the last WINDOW entries when the kernel can move
    up to it past the entries between (each independent of it: neither writes what the other
    touches). A cross-entropy gradient, after the loss's own kernels, joins the log-softmax
    that computes what it reads."""
    out: list[Kernel | _RowGroup] = []
    for k in kernels:
        if not joins(k):
            out.append(k)
        elif not _join_rows(out, k):
            out.append(_RowGroup(k))
    return [m for x in out for m in (x.kernels() if isinstance(x, _RowGroup) else (x,))]


def _join_rows(out: list[Kernel | _RowGroup], k: Kernel) -> bool:
    """Add ``k`` (the newest) to a group of the last WINDOW entries that it may join and move
    up to (fuse_rows): the newest one that writes what it reads (its producer's, where the
    values it reads were just computed), else the newest."""
    mine = accesses(k)
    touched, written = _touches(mine)
    read = {n for n, _, w in mine if not w}
    reachable: list[_RowGroup] = []
    for pos in range(len(out) - 1, max(-1, len(out) - 1 - WINDOW), -1):
        x = out[pos]
        if isinstance(x, _RowGroup) and x.fits(k) is not None:
            reachable.append(x)
        theirs, their_writes = x.touches() if isinstance(x, _RowGroup) else _touches(accesses(x))
        if written & theirs or their_writes & touched:
            break  # k cannot move up past x (they are not independent)
    if not reachable:
        return False
    producers = [g for g in reachable if read & g.touches()[1]]
    (producers or reachable)[0].join(k)
    return True


def _touches(access: Iterable[tuple[Node, object, bool]]) -> tuple[set[Node], set[Node]]:
    """The nodes these accesses touch, and those they write."""
    touched, written = set(), set()
    for node, _, write in access:
        touched.add(node)
        if write:
            written.add(node)
    return touched, written


class _RowGroup:
    """Row-group members over the first member's outer symbol, and what they access."""

    def __init__(self, first: Kernel) -> None:
        (self.sym, self.rows), *_ = first.parallel
        self.members: list[Kernel] = []
        self.stmts: list[Stmt] = []
        self.access: dict[Node, list[tuple[Affine, bool, bool]]] = {}  # (index, in row, write)
        self._add(first, *self._rowwise(first))

    def _rowwise(self, k: Kernel) -> tuple[Stmt, dict[Node, list[tuple[Affine, bool, bool]]]]:
        """``k``'s body over the group's row symbol, the rest of its parallel nest serial loops
        (a loop of its own named like the row symbol is renamed apart)."""
        (s0, _), *inner = k.parallel
        env: dict[ir.Var, Affine] = {s0: ir.as_affine(self.sym)}
        apart = _fresh(self.sym, _symbols(k))
        if s0 != self.sym:
            env[self.sym] = ir.as_affine(apart)
        body = k.body
        for sym, n in reversed(inner):
            body = Loop(sym, n, body)
        stmt = map_stmt(body, lambda a: a.substitute(env),
                        lambda sym, n: (apart if sym == self.sym else sym, n))
        return stmt, _row_accesses(stmt, self.sym, self.rows)

    def fits(self, k: Kernel) -> tuple[Stmt, dict[Node, list[tuple[Affine, bool, bool]]]] | None:
        """``k`` row-wise and its accesses, when it runs over the group's rows and every node
        written by it or a member and touched by both is accessed only within the iteration's
        own row; else None."""
        if not k.parallel or k.parallel[0][1] != self.rows or len(self.stmts) >= MAX_STATEMENTS:
            return None
        stmt, access = self._rowwise(k)
        for node in self.access.keys() & access.keys():
            both = self.access[node] + access[node]
            if any(w for _, _, w in both) and not all(inside for _, inside, _ in both):
                return None
        return stmt, access

    def join(self, k: Kernel) -> bool:
        """Add ``k`` when it fits (``fits``)."""
        fit = self.fits(k)
        if fit is None:
            return False
        self._add(k, *fit)
        return True

    def _add(self, k: Kernel, stmt: Stmt, access: dict[Node, list[tuple[Affine, bool, bool]]]) -> None:
        self.members.append(k)
        self.stmts += stmt.body if isinstance(stmt, Seq) else (stmt,)  # a fused member's stores, flat
        for node, acc in access.items():
            self.access.setdefault(node, []).extend(acc)

    def touches(self) -> tuple[set[Node], set[Node]]:
        """The nodes the members touch, and those they write."""
        return _touches((node, index, write) for node, acc in self.access.items() for index, _, write in acc)

    def kernels(self) -> list[Kernel]:
        """One kernel; or the members as they were when none has more than one cell per row
        (elementwise kernels over one space: horizontal fusion's to merge, which keeps
        scratch apart so that its space is reused)."""
        if len(self.members) == 1 or all(k.total_work == self.rows for k in self.members):
            return self.members
        return [Kernel(self.members[0].name, ((self.sym, self.rows),), Seq(tuple(self.stmts)),
                       "; ".join(k.comment for k in self.members if k.comment))]


def _symbols(k: Kernel) -> set[ir.Var]:
    """Every loop symbol of ``k`` and every symbol its indices name."""
    out: set[ir.Var] = {sym for sym, _ in k.parallel}
    out.update(_extents(k.body))
    out.update(v for a in affines_of(k) for v in a.vars)
    return out


def _fresh(sym: Symbol, taken: set[ir.Var]) -> Symbol:
    """``<sym>_own``, or ``<sym>_own2``, ``_own3``... : a name none of ``taken`` has."""
    k, name = 1, f"{sym.name}_own"
    while Symbol(name) in taken:
        k += 1
        name = f"{sym.name}_own{k}"
    return Symbol(name)


def _extents(s: Stmt) -> dict[ir.Var, int]:
    out: dict[ir.Var, int] = {}
    for st in walk_stmts(s):
        if isinstance(st, Loop):
            out[st.sym] = st.extent
        elif isinstance(st, Reduce):
            out.update(st.loops)
    return out


def _row_accesses(s: Stmt, row: Symbol, rows: int) -> dict[Node, list[tuple[Affine, bool, bool]]]:
    """Each node ``s`` touches: (index, whether the access stays in the ``row``-th row of the
    node, whether it writes), with ``s``'s loop extents bounding its other symbols."""
    extents = _extents(s)

    def inside(node: Node, index: Affine, picked: bool, merge: bool) -> bool:
        size = math.prod(node.shape)
        if picked or merge or size % rows or index.coeff(row) != size // rows:
            return False
        lo = hi = index.const
        for v, c in index.terms:
            if v == row:
                continue
            n = extents.get(v)
            if n is None:  # a static symbol, or one bound outside the statement
                return False
            lo, hi = lo + min(0, c * (n - 1)), hi + max(0, c * (n - 1))
        return lo >= 0 and hi < size // rows

    out: dict[Node, list[tuple[Affine, bool, bool]]] = {}
    for st in walk_stmts(s):
        if isinstance(st, (Store, Reduce)):
            picked = isinstance(st, Store) and st.row is not None
            out.setdefault(st.node, []).append((st.index, inside(st.node, st.index, picked, False), True))
    for e in walk_exprs(s):
        if isinstance(e, Load):
            out.setdefault(e.node, []).append((e.index, inside(e.node, e.index, e.row is not None, e.merge), False))
    return out


# ---------------------------------------------------------------------------
# Batches: independent elementwise kernels as segments of one range, in one launch


def fuse_segments(kernels: Sequence[Kernel], joins: Callable[[Kernel], bool]) -> list[Kernel]:
    """The kernels of one computation, in order, with independent elementwise kernels merged
    into *batches*: one kernel over the sum of their ranges, each member on its own segment of
    it (``Segment``). An optimizer's updates of every parameter become one launch (what other
    frameworks call a multi-tensor apply); on loops each member keeps its own loop.

    ``joins``: the kernels that may be members (``patterns.segmentable``: one parallel loop
    around stores). A kernel joins a batch of the last WINDOW entries when it is independent
    of every member (neither writes a node the other touches: segments run at once, in any
    order) and can move up to it past the entries between (independent of it), or the batch
    can move down to it (the entries between independent of the batch)."""
    schedule: list[_Entry] = []
    for k in kernels:
        entry = _Entry.of(k)
        entry.space = (0,) if joins(k) else None  # a batch member, or a kernel to move past
        if entry.space is None or not _join_batch(schedule, entry):
            schedule.append(entry)
    return [_batch(e.members) for e in schedule]


def _join_batch(schedule: list[_Entry], new: _Entry) -> bool:
    # the oldest batch first: an optimizer's first moments gather in one batch, the weights
    # that read them in the next, where the newest-first order would pair each weight with
    # the next moment
    for pos in range(max(0, len(schedule) - WINDOW), len(schedule)):
        batch = schedule[pos]
        if batch.space is None or len(batch.members) >= MAX_STATEMENTS or not batch.independent(new):
            continue
        if len(batch.touched | new.touched) <= MAX_BATCH_BUFFERS and _gather(schedule, pos, new):
            return True
    return False


def _batch(members: list[Kernel]) -> Kernel:
    """One kernel over the members' ranges end to end, over the first member's symbol."""
    if len(members) == 1:
        return members[0]
    ((sym, _),) = members[0].parallel
    segments: list[Stmt] = []
    lo = 0
    for k in members:
        segments.append(_segment(k, sym, lo))
        lo += k.work
    return Kernel(members[0].name, ((sym, lo),), Seq(tuple(segments)), "; ".join(k.comment for k in members if k.comment))


def _segment(k: Kernel, sym: Symbol, lo: int) -> Segment:
    """``k`` (one parallel loop) as the segment of a batch's range ``sym`` that starts at ``lo``."""
    ((own, n),) = k.parallel
    env: dict[ir.Var, Affine] = {own: ir.as_affine(sym) + ir.as_affine(-lo)}
    return Segment(sym, lo, lo + n, map_stmt(k.body, lambda a: a.substitute(env)))
