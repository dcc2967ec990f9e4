"""A tensor graph frozen into a program: its steps in execution order, its leaves, and the two
ways to turn it into computations: one fused ``Comp`` (compiled mode) or one ``Comp`` per op
(dynamic mode, every intermediate stored)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from polyjit.core import ir
from polyjit.core.errors import InvalidProgramError, ShapeMismatchError
from polyjit.core.runtime import Backend, CodeBatch
from polyjit.tensor.autograd import topo_order
from polyjit.tensor.hostio import Feed
from polyjit.tensor.tensor import IndexBound, Kind, Tensor


@attrs.frozen(eq=False)
class Write:
    """An in-place update of persistent state, ``target := value``, done after what comes before it."""

    target: Tensor
    value: Tensor

    def __attrs_post_init__(self) -> None:
        if not self.target.is_persistent:
            raise InvalidProgramError(f"only parameters and state can be written, not {self.target!r}")
        if self.value.shape != self.target.shape or self.value.dtype != self.target.dtype:
            raise ShapeMismatchError(
                f"write of {self.value.shape} {self.value.dtype} into {self.target!r}"
            )


@attrs.frozen(eq=False)
class Step:
    """The assignments of one op (dynamic mode runs each step as its own routine)."""

    name: str
    assigns: tuple[ir.Assignment, ...]
    node: ir.Node
    dynamic: tuple[ir.Assignment, ...] | None = None  # what dynamic mode runs instead (() skips it)


_ids = itertools.count()
_IDENT = re.compile(r"[^A-Za-z0-9_]")


class Program:
    """Outputs and persistent writes of a tensor graph, in an order that respects every read.

    The outputs come first, then ``computed_first`` (an optimizer step's gradients: they are
    of the state before the step, whatever order the writes come in), then the writes in
    order, each value computed as late as it can be: it reads the state the earlier writes
    left (an optimizer's bias corrections read the step count it has just advanced)."""

    def __init__(self, outputs: Mapping[str, Tensor], writes: Sequence[Write] = (), name: str = "plan",
                 computed_first: Sequence[Tensor] = ()) -> None:
        self.name = _IDENT.sub("_", name) or "plan"
        self.outputs = dict(outputs)
        self.writes = tuple(writes)
        self.computed_first = tuple(computed_first)
        for t in self.computed_first:
            if not isinstance(t, Tensor):
                raise InvalidProgramError(f"computed_first holds {t!r}, not a tensor")
        self.steps: list[Step] = []
        seen: set[Tensor] = set()
        every: list[Tensor] = []

        def emit(roots: Sequence[Tensor]) -> None:
            for t in topo_order(roots):
                if t in seen:
                    continue
                seen.add(t)
                every.append(t)
                if t.assigns:
                    self.steps.append(Step(f"{t.name}", t.assigns, t.node))

        emit(list(self.outputs.values()))
        emit(list(self.computed_first))
        for w in self.writes:  # values computed late read state as the earlier writes left it
            emit([w.value])
            direct = ir.apply(ir.Op.ID, w.value.node, into=w.target.node)
            if _reads_elsewhere(w.target.node, w.value):
                # Inlined, the value would read cells of the target that the write has already
                # changed: compute it into scratch first (dynamic mode stores every op anyway).
                staged = ir.Node(f"{w.target.name}_new", w.target.shape, w.target.dtype,
                                 mode=ir.MemoryMode.LOCAL)
                stage = ir.apply(ir.Op.ID, w.value.node, into=staged)
                self.steps.append(Step(f"stage_{w.target.name}", (stage,), staged, dynamic=()))
                assign = ir.apply(ir.Op.ID, staged, into=w.target.node)
                self.steps.append(Step(f"update_{w.target.name}", (assign,), w.target.node, dynamic=(direct,)))
            else:
                self.steps.append(Step(f"update_{w.target.name}", (direct,), w.target.node))
            if w.target not in seen:
                seen.add(w.target)
                every.append(w.target)
        self.inputs = _unique([t for t in every if t.kind is Kind.INPUT], "input")
        # Inputs whose values index classes or rows: checked on the host by their Feed.
        self.index_bounds: dict[ir.Node, list[IndexBound]] = {}
        for t in every:
            for b in t.index_bounds:
                source = fed_input(b.indices)
                if source is not None:
                    self.index_bounds.setdefault(source.node, []).append(b)
        self.persistent = _unique([t for t in every if t.is_persistent], "parameter/state")
        self.embedded = frozenset(t.node for t in self.outputs.values()) | {w.target.node for w in self.writes}
        self._batches: dict[tuple[int, str], CodeBatch] = {}
        self.uid = next(_ids)

    def feeds(self) -> list[Feed]:
        """One host feed per input (with a fresh staging array), checking index inputs' bounds."""
        return [Feed(t.name, t.node, self.index_bounds.get(t.node, ())) for t in self.inputs]

    @property
    def assignments(self) -> list[ir.Assignment]:
        return [a for s in self.steps for a in s.assigns]

    def compiled_comp(self) -> ir.Comp:
        """Compiled mode: everything as one computation, intermediates inlined or LOCAL scratch."""
        return ir.Comp.of(*self.assignments, embedded=self.embedded)

    def dynamic_comps(self) -> list[ir.Comp]:
        """Dynamic mode: one computation per op, each op's result stored (readable while
        debugging)."""
        return [ir.Comp.of(*(s.assigns if s.dynamic is None else s.dynamic), embedded=[s.node])
                for s in self._dynamic_steps]

    @property
    def _dynamic_steps(self) -> list[Step]:
        return [s for s in self.steps if s.dynamic != ()]

    def batch(self, backend: Backend, kind: str) -> CodeBatch:
        """The compiled batch of this program for a backend in a mode ("compiled" or "dynamic"),
        cached."""
        key = (id(backend), kind)
        hit = self._batches.get(key)
        if hit is None or hit.backend is not backend:
            if kind == "compiled":
                hit = backend.compile_batch([self.compiled_comp()], names=[self.name])
            else:
                comps = self.dynamic_comps()
                names = [f"{self.name}_op{k}_{s.name}" for k, s in enumerate(self._dynamic_steps)]
                hit = backend.compile_batch(comps, names=names)
            self._batches[key] = hit
        return hit

    def describe(self) -> dict[str, Any]:
        """Counts that explain a program: steps, leaves, stored outputs."""
        return {
            "steps": len(self.steps),
            "inputs": [t.name for t in self.inputs],
            "persistent": [t.name for t in self.persistent],
            "outputs": list(self.outputs),
        }


def named_outputs(outputs: Tensor | Sequence[Tensor] | Mapping[str, Tensor] | None) -> dict[str, Tensor]:
    """Outputs as ``pt.compile`` and ``reference.evaluate`` take them: a tensor, a sequence of
    tensors (by their names) or a mapping of names to tensors."""
    if outputs is None:
        return {}
    if isinstance(outputs, Tensor):
        return {outputs.name: outputs}
    if isinstance(outputs, Mapping):
        named = dict(outputs)
        for key, t in named.items():
            check_tensor(t, f"output {key!r}")
        return named
    if isinstance(outputs, (str, bytes)) or not isinstance(outputs, Sequence):
        raise InvalidProgramError(f"outputs must be a Tensor, a list or a dict of Tensors, "
                                  f"got {type(outputs).__name__}")
    named = {}
    for k, t in enumerate(outputs):
        check_tensor(t, f"output {k}")
        if named.setdefault(t.name, t) is not t:
            raise InvalidProgramError(f"two outputs are named {t.name!r}; pass a dict or use .named()")
    return named


def check_tensor(t: object, what: str) -> None:
    if not isinstance(t, Tensor):
        raise InvalidProgramError(f"{what} must be a Tensor, got {type(t).__name__} "
                                  "(wrap host arrays with pt.constant(...))")


def fed_input(t: Tensor) -> Tensor | None:
    """The input whose values ``t`` holds, all of them and no others (maybe reordered, repeated or
    cast to another integer dtype): the input itself, an alias, a reshape, a transpose, a
    broadcast of it. None when ``t`` is computed otherwise (its values cannot be checked on the
    host)."""
    while t.kind is not Kind.INPUT:
        same = [p for p in t.parents if p.node is t.node]
        if not t.assigns and same:  # an alias (detach)
            t = same[0]
            continue
        if len(t.assigns) != 1 or len(t.parents) != 1:
            return None
        a, parent = t.assigns[0], t.parents[0]
        if isinstance(a, ir.Fetch):
            if not (isinstance(a.value, ir.Reshape) and a.value.source is parent.node):
                return None
        elif not isinstance(a, ir.Accum) or not _covers(a, parent):
            return None
        t = parent
    return t


def _covers(a: ir.Accum, x: Tensor) -> bool:
    """Whether ``a`` copies every cell of ``x`` (and nothing else): a transpose, a broadcast, an
    identity slice, or a cast between integer dtypes (in-range values keep their value)."""
    if a.accum is not None or a.rhs != (x.node,):
        return False
    if a.op is ir.Op.CAST:
        if a.lhs.dtype.is_float or a.lhs.dtype.is_bool or x.dtype.is_float or x.dtype.is_bool:
            return False
    elif a.op is not ir.Op.ID:
        return False
    pr = a.projections
    used: set[ir.Var] = set()
    for index, n in zip(pr.rhs[0], x.shape):
        if not index.terms:
            if index.const != 0 or n != 1:  # a fixed index reads one cell of a longer axis
                return False
            continue
        if len(index.terms) != 1 or index.const != 0:
            return False
        sym, coeff = index.terms[0]
        if coeff != 1 or sym in used or not isinstance(sym, ir.Symbol) or pr.extent(sym) != n:
            return False
        used.add(sym)
    return True


def _elementwise_leaf(t: Tensor) -> ir.Accum | ir.Fetch | None:
    """The single assignment of a tensor that lowering may inline into its reader, if any."""
    leaves = [leaf for a in t.assigns for leaf in ir.flatten(a)]
    if len(leaves) != 1:
        return None
    leaf = leaves[0]
    if isinstance(leaf, ir.Fetch):  # lowering stores constants and rows picked by data
        return None if isinstance(leaf.value, (ir.Constant, ir.Gather, ir.ScatterAdd)) else leaf
    pr = leaf.projections
    if leaf.accum is not None or len(set(pr.lhs)) != len(pr.lhs) or len(pr.lhs) != len(pr.product_space):
        return None
    return leaf


def _reads_elsewhere(target: ir.Node, value: Tensor) -> bool:
    """Whether computing ``value`` inline, cell by cell, reads ``target`` at another cell than the
    one being written (a transpose, a broadcast, a shift of the target): a hazard for an
    in-place write. Only chains that lowering can inline matter; stored results are complete
    before the write starts."""
    memo: dict[Tensor, bool] = {}

    def touches(t: Tensor) -> bool:  # reads the target through inlinable tensors
        if t.node is target:
            return True
        hit = memo.get(t)
        if hit is None:
            memo[t] = False  # graphs are acyclic; this only guards the recursion
            inline = not t.assigns or _elementwise_leaf(t) is not None
            hit = memo[t] = inline and any(touches(p) for p in t.parents)
        return hit

    stack, seen = [value], set()
    while stack:
        t = stack.pop()
        if t in seen or t.node is target:
            continue
        seen.add(t)
        if not t.assigns:
            stack.extend(t.parents)
            continue
        leaf = _elementwise_leaf(t)
        if leaf is None:
            continue
        if isinstance(leaf, ir.Fetch):
            if any(touches(p) for p in t.parents):
                return True
            continue
        by_node = {p.node: p for p in t.parents}
        lhs = leaf.projections.lhs
        for x, idx in zip(leaf.tensor_operands, leaf.projections.rhs):
            node = ir.operand_node(x)
            parent = by_node.get(node)
            if parent is None or not touches(parent):
                continue
            same_cell = node.shape == leaf.lhs.shape and all(
                n == 1 or a == b for a, b, n in zip(idx, lhs, node.shape))  # a size-1 axis has one cell
            if not same_cell:
                return True
        stack.extend(t.parents)
    return False


def _unique(tensors: list[Tensor], what: str) -> list[Tensor]:
    by_name: dict[str, Tensor] = {}
    for t in tensors:
        other = by_name.setdefault(t.name, t)
        if other is not t and other.node is not t.node:
            raise InvalidProgramError(f"two different {what} tensors are named {t.name!r}")
    return list(by_name.values())
