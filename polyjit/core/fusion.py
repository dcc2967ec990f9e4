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

:func:`fuse_epilogues` (at the end) merges an elementwise kernel into the tiled contraction
right before it, as the epilogue its tiles run (docs/architecture.md, "Epilogues").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set

import attrs

from polyjit.core import ir
from polyjit.core.ir import Affine, Node, Symbol
from polyjit.core.loops import Kernel, Load, Reduce, Seq, Store, map_stmt, walk_exprs, walk_stmts
from polyjit.core.patterns import fusable

WINDOW = 16  # entries of the schedule a kernel looks back over for a group to join
MAX_STATEMENTS = 16  # stores of one fused kernel


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
        renamed = group.renamed(kernel)
        new = _Entry.of(renamed)
        if not group.accepts(new, scratch):
            continue
        after = schedule[pos + 1:]
        if all(x.independent(new) for x in after):  # the kernel moves up to the group
            group.add(renamed)
            return True
        if all(x.independent(group) for x in after):  # the group moves down to the kernel
            del schedule[pos]
            group.add(renamed)
            schedule.append(group)
            return True
    return False


# ---------------------------------------------------------------------------
# Epilogues: an elementwise kernel run on each output tile of the contraction before it


def fuse_epilogues(kernels: Sequence[Kernel], tiled: Callable[[Kernel], bool]) -> list[Kernel]:
    """The kernels of one computation, in order, with each elementwise kernel that reads the
    output of the tiled contraction right before it (``tiled``: the dialect tiles this
    kernel, with epilogues) merged into it as the contraction's epilogue (a ``Seq``: the sum,
    then the elementwise stores; see :func:`_epilogue`)."""
    out: list[Kernel] = []
    for k in kernels:
        fused = _epilogue(out[-1], k) if out and tiled(out[-1]) else None
        if fused is not None:
            out[-1] = fused
        else:
            out.append(k)
    return out


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
    stmts = e.body.body if isinstance(e.body, Seq) else (e.body,)
    if not all(isinstance(st, Store) and st.row is None for st in stmts):
        return None
    env = _onto(e.parallel, p.parallel)
    if env is None:
        return None
    renamed = [map_stmt(st, lambda a: a.substitute(env)) for st in stmts]
    c = r.node
    reads = [x for st in renamed for x in walk_exprs(st) if isinstance(x, Load) and x.node is c]
    if not reads or any(x.merge or x.row is not None or x.index != r.index for x in reads):
        return None
    if {st.node for st in renamed if isinstance(st, Store)} & (set(p.inputs) | {c}):
        return None
    comment = f"{p.comment}; {e.comment}" if e.comment else p.comment
    return Kernel(p.name, p.parallel, Seq((r, *renamed)), comment)


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
