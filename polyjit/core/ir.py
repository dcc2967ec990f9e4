"""The IR: tensor nodes, index expressions and assignments.

A program is a ``Comp``: a tuple of assignments over ``Node``s. ``Accum`` is the
one general construct: over a product space of loop symbols it writes
``lhs[pl(it)] = accum(lhs[pl(it)], op(rhs_k[pk(it)]...))``, which covers
elementwise ops, broadcasting, transposes, reductions and matmul. ``Fetch``
fills a node with a constant, a fill value, a range, or a slice of another
node at a (static) index.
"""

from __future__ import annotations

import enum
import itertools
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeGuard, Union

import attrs
import numpy as np

from polyjit.core import dtypes
from polyjit.core.dtypes import DType, as_dtype
from polyjit.core.errors import (
    DTypeMismatchError,
    InvalidArgumentError,
    InvalidProgramError,
    ShapeMismatchError,
    ValueRangeError,
)

# re-exported: ir is where programs are written
from polyjit.core.index import Affine, Index, StaticSymbol, Symbol, Var, affine, as_affine, fixed  # noqa: F401
from polyjit.core.ops import COMPARISONS, FLOAT_ONLY, AccumOp, Op, result_dtype  # noqa: F401


class MemoryMode(enum.Enum):
    VIRTUAL = "virtual"  # inlined into its readers, never stored
    LOCAL = "local"  # scratch inside one linked batch; its space is reused by the planner
    ON_DEVICE = "on_device"  # stored in a context's slab
    MATERIALIZED = "materialized"  # stored and readable from the host


_node_ids = itertools.count(1)


def _check_name(name: object) -> None:
    if not isinstance(name, str):
        raise InvalidArgumentError(f"a node's name is a str, got {type(name).__name__} {name!r}")


def as_shape(value: int | Iterable[int]) -> tuple[int, ...]:
    """A shape: an int (one axis) or a sequence of non-negative ints. A float, a string or
    None is refused, not truncated (``2.5`` is not 2)."""
    dims = [value] if isinstance(value, (int, np.integer)) else value
    try:
        shape = tuple(dims)
    except TypeError:
        raise ShapeMismatchError(f"a shape is an int or a sequence of ints, got {value!r}") from None
    if not all(dtypes.is_int(d) for d in shape):
        raise ShapeMismatchError(f"a shape's dimensions are ints, got {value!r}")
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ShapeMismatchError(f"negative dimension in shape {shape}")
    return shape


def _as_mode(value: object) -> MemoryMode | None:
    """A memory mode: None, a MemoryMode, or its value ("local", "on_device", ...)."""
    if value is None or isinstance(value, MemoryMode):
        return value
    try:
        return MemoryMode(value)
    except ValueError:
        names = ", ".join(repr(m.value) for m in MemoryMode)
        raise InvalidArgumentError(f"a memory mode is a MemoryMode or one of {names}, got {value!r}") from None


@attrs.frozen(eq=False, repr=False)
class Node:
    """A tensor node. Identity (``id``) is what distinguishes nodes; names need not be unique."""

    name: str = attrs.field(validator=lambda _, __, v: _check_name(v))
    shape: tuple[int, ...] = attrs.field(converter=as_shape)
    dtype: DType = attrs.field(converter=as_dtype, default=dtypes.float32)
    mode: MemoryMode | None = attrs.field(default=None, converter=lambda v: _as_mode(v))
    id: int = attrs.field(factory=lambda: next(_node_ids))

    def __attrs_post_init__(self) -> None:
        if self.nbytes >= 1 << 62:  # offsets and sizes are int64 everywhere below
            raise ShapeMismatchError(f"{self.name}: shape {self.shape} of {self.dtype} is "
                                     f"{self.nbytes} bytes, beyond what a buffer can hold")

    @property
    def size(self) -> int:
        return math.prod(self.shape)  # not np.prod: every run asks (copies' sizes), and it is 20x slower

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __hash__(self) -> int:
        return self.id

    def __eq__(self, other: object) -> bool:
        return self is other

    def __repr__(self) -> str:
        shape = "x".join(map(str, self.shape)) or "scalar"
        return f"Node({self.name}#{self.id} {shape} {self.dtype})"

    @property
    def label(self) -> str:
        """A short human-readable name: ``name#id``."""
        return f"{self.name}#{self.id}"

    def with_mode(self, mode: MemoryMode | None) -> Node:
        """The same node (same id) with another memory mode."""
        return attrs.evolve(self, mode=mode)


# ---------------------------------------------------------------------------
# Index expressions





# ---------------------------------------------------------------------------
# Operands and assignments


@attrs.frozen
class MergeRead:
    """Read ``node`` from the device's merge buffer instead of the node's own buffer."""

    node: Node


def merge(node: Node) -> MergeRead:
    """An operand that reads what a device_to_device(..., MergeBuffer.COPY) put in the merge buffer."""
    return MergeRead(node)


Scalar = Union[int, float, bool]
Operand = Union[Node, MergeRead, Scalar]


def _is_tensor_operand(x: object) -> TypeGuard[Node | MergeRead]:
    return isinstance(x, (Node, MergeRead))


def operand_node(x: Node | MergeRead) -> Node:
    return x.node if isinstance(x, MergeRead) else x


@attrs.frozen
class Projections:
    """The product space (symbols and extents) and the index tuple of the lhs and of each tensor rhs."""

    product_space: tuple[tuple[Symbol, int], ...]
    lhs: tuple[Affine, ...]
    rhs: tuple[tuple[Affine, ...], ...]

    def __attrs_post_init__(self) -> None:
        for entry in self.product_space:
            ok = isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], Symbol) \
                and dtypes.is_int(entry[1]) and entry[1] >= 0
            if not ok:
                raise InvalidProgramError(f"a product space holds (Symbol, extent) pairs with extents "
                                          f"ints >= 0, got {entry!r}")

    @property
    def symbols(self) -> tuple[Symbol, ...]:
        return tuple(s for s, _ in self.product_space)

    def extent(self, sym: Symbol) -> int:
        for s, n in self.product_space:
            if s == sym:
                return n
        raise InvalidProgramError(f"symbol {sym!r} is not in the product space")


def projections(
    space: Sequence[tuple[Symbol, int]], lhs: Sequence[Index], *rhs: Sequence[Index]
) -> Projections:
    pairs = []
    for entry in space:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
            raise InvalidProgramError(f"a product space holds (Symbol, extent) pairs, got {entry!r}")
        pairs.append((entry[0], entry[1]))
    return Projections(
        tuple(pairs),
        tuple(as_affine(i) for i in lhs),
        tuple(tuple(as_affine(i) for i in r) for r in rhs),
    )


@attrs.frozen
class Accum:
    """``lhs[pl(it)] = accum(lhs[pl(it)], op(rhs...))`` over the product space; accum=None assigns.

    With ``init_neutral`` the lhs starts from the accumulation's neutral element
    (zero for a sum); without it the accumulation adds onto what the lhs holds.
    """

    lhs: Node
    accum: AccumOp | None
    op: Op
    rhs: tuple[Operand, ...]
    projections: Projections
    init_neutral: bool = True

    def __attrs_post_init__(self) -> None:
        _check_accum(self)

    @property
    def tensor_operands(self) -> tuple[Node | MergeRead, ...]:
        return tuple(x for x in self.rhs if _is_tensor_operand(x))


@attrs.frozen
class Fill:
    value: Scalar


@attrs.frozen
class Range:
    """Each cell gets its row-major flat index (cast to the node's dtype)."""


@attrs.frozen(eq=False)
class Constant:
    """A host array; the node becomes a read-only constant in the device's constant table."""

    values: np.ndarray[Any, Any]


@attrs.frozen
class Slice:
    """``node[...] = source[index, ...]``: a slice of ``source`` along its first axis."""

    source: Node
    index: Affine = attrs.field(converter=as_affine)


@attrs.frozen
class Reshape:
    """``node`` is ``source`` read in row-major order with node's shape (same number of elements)."""

    source: Node


@attrs.frozen
class Gather:
    """``node[i..., j...] = table[clamp(indices[i...]), j...]``: rows of ``table`` picked by the
    integer values of ``indices``, each clamped to ``0 .. rows - 1`` (an index is data: clamping
    keeps every read inside the table; the tensor front end refuses bad indices on the host)."""

    table: Node
    indices: Node


@attrs.frozen
class ScatterAdd:
    """``node = 0``, then for every ``i`` in row-major order ``node[clamp(indices[i...]), j...]
    += values[i..., j...]`` (the gradient of :class:`Gather`; rows picked twice add up, in order)."""

    indices: Node
    values: Node


FetchValue = Union[Fill, Range, Constant, Slice, Reshape, Gather, ScatterAdd]


@attrs.frozen
class Fetch:
    node: Node
    value: FetchValue

    def __attrs_post_init__(self) -> None:
        _check_fetch(self)


@attrs.frozen
class Seq:
    items: tuple[Assignment, ...]


@attrs.frozen
class Block:
    comment: str
    body: Assignment


Assignment = Union[Accum, Fetch, Seq, Block]


def flatten(a: Assignment) -> Iterator[Accum | Fetch]:
    """The Accum and Fetch leaves of an assignment tree, in program order."""
    if isinstance(a, (Accum, Fetch)):
        yield a
    elif isinstance(a, Seq):
        for item in a.items:
            yield from flatten(item)
    elif isinstance(a, Block):
        yield from flatten(a.body)
    else:
        raise InvalidProgramError(f"not an assignment: {a!r}")


def writes(a: Accum | Fetch) -> Node:
    return a.lhs if isinstance(a, Accum) else a.node


def reads(a: Accum | Fetch) -> tuple[Node | MergeRead, ...]:
    if isinstance(a, Accum):
        return a.tensor_operands
    if isinstance(a.value, (Slice, Reshape)):
        return (a.value.source,)
    if isinstance(a.value, Gather):
        return (a.value.table, a.value.indices)
    if isinstance(a.value, ScatterAdd):
        return (a.value.indices, a.value.values)
    return ()


@attrs.frozen
class Comp:
    """A computation: assignments plus the nodes it creates (``embedded``), which persist in the context.

    When ``embedded`` is not given, it is the nodes the computation writes that
    are either read by no assignment of it (its results) or have an explicit
    stored memory mode. Other written nodes are intermediates: inlined when they
    can be, else scratch space inside the batch.
    """

    assignments: tuple[Assignment, ...]
    embedded: frozenset[Node]

    def __attrs_post_init__(self) -> None:
        for a in self.assignments:
            if not isinstance(a, (Accum, Fetch, Seq, Block)):
                raise InvalidArgumentError(f"a computation holds assignments (ir.apply, ir.einsum, "
                                           f"ir.fill, ...), got {type(a).__name__} {a!r}")
        for n in self.embedded:
            if not isinstance(n, Node):
                raise InvalidArgumentError(f"embedded holds Nodes, got {type(n).__name__} {n!r}")

    @staticmethod
    def of(*assignments: Assignment, embedded: Iterable[Node] | None = None) -> Comp:
        flat = [leaf for a in assignments for leaf in flatten(a)]
        if embedded is None:
            read = {operand_node(x) for leaf in flat for x in reads(leaf)}
            stored = {MemoryMode.ON_DEVICE, MemoryMode.MATERIALIZED}
            embedded = [
                writes(leaf) for leaf in flat if writes(leaf) not in read or writes(leaf).mode in stored
            ]
        return Comp(tuple(assignments), frozenset(embedded))

    def leaves(self) -> list[Accum | Fetch]:
        return [leaf for a in self.assignments for leaf in flatten(a)]


# ---------------------------------------------------------------------------
# Validation


def _check_index_bounds(
    node: Node, index: tuple[Affine, ...], space: Mapping[Symbol, int], what: str
) -> None:
    if len(index) != len(node.shape):
        raise ShapeMismatchError(
            f"{what} indexes {node.label} of shape {node.shape} with {len(index)} indices"
        )
    for dim, (e, n) in enumerate(zip(index, node.shape)):
        lo = hi = e.const
        for v, c in e.terms:
            if isinstance(v, StaticSymbol):
                top = v.bound - 1
            elif v in space:
                top = space[v] - 1
            else:
                raise InvalidProgramError(f"{what}: symbol {v!r} is not in the product space")
            lo += min(0, c * top)
            hi += max(0, c * top)
        if any(extent == 0 for extent in space.values()):
            continue  # an empty product space makes no access at all
        if lo < 0 or hi >= n:
            raise ShapeMismatchError(
                f"{what}: index {e!r} of {node.label} axis {dim} ranges over [{lo}, {hi}] "
                f"but the axis has size {n}"
            )


def writes_every_cell(a: Accum) -> bool:
    """Whether ``a`` writes every cell of its lhs: its space is not empty, and each lhs axis
    longer than one is indexed by a loop symbol of its own (coefficient 1, no offset) over the
    axis's whole extent (a diagonal ``c[i, i]`` reaches a few cells only)."""
    pr = a.projections
    extent: dict[Var, int] = dict(pr.product_space)
    if 0 in extent.values():  # an empty space writes nothing
        return False
    seen: set[Var] = set()
    for index, n in zip(pr.lhs, a.lhs.shape):
        if n == 1:
            continue
        if len(index.terms) != 1 or index.const != 0:
            return False
        (sym, coeff), = index.terms
        if coeff != 1 or sym in seen or extent.get(sym) != n:
            return False
        seen.add(sym)
    return True


def accum_operand_dtypes(a: Accum) -> list[DType]:
    """The dtype of each rhs operand; a Python scalar takes the dtype of the tensor values beside it."""
    value_positions = (1, 2) if a.op is Op.WHERE else range(len(a.rhs))
    tensor_values = [operand_node(x).dtype for x in (a.rhs[k] for k in value_positions)
                     if _is_tensor_operand(x)]
    scalar_dtype = tensor_values[0] if tensor_values else a.lhs.dtype
    out: list[DType] = []
    for k, x in enumerate(a.rhs):
        if _is_tensor_operand(x):
            out.append(operand_node(x).dtype)
        elif a.op is Op.WHERE and k == 0:
            out.append(dtypes.bool_)
        else:
            out.append(scalar_dtype)
    return out


def check_literal(value: object, dtype: DType, what: str) -> None:
    """Refuse a scalar operand that is not a real number (a string, None, a complex), or a
    float that an integer ``dtype`` cannot take (NaN, inf, or out of its range once truncated:
    undefined in C). Otherwise a scalar converts as C converts a literal
    (:func:`polyjit.core.reference.scalar_value`: floats truncate, integers wrap)."""
    if not isinstance(value, (bool, int, float, np.bool_, np.integer, np.floating)):
        raise DTypeMismatchError(f"{what}: a scalar operand is a real number, got {type(value).__name__} {value!r}")
    if dtype.is_float and dtypes.is_int(value):
        try:
            float(value)
        except OverflowError:
            raise ValueRangeError(f"{what}: the integer {value} is beyond every float (numpy refuses it too)") from None
    if dtype.is_float or dtype.is_bool or isinstance(value, (bool, int, np.bool_, np.integer)):
        return
    info = np.iinfo(dtype.np)
    if not (math.isfinite(value) and info.min <= math.trunc(float(value)) <= info.max):
        raise ValueRangeError(f"{what}: the scalar {value!r} does not convert to {dtype}")


def _check_accum(a: Accum) -> None:
    _check_target(a.lhs, a.op, "an assignment")
    if a.accum is not None and not isinstance(a.accum, AccumOp):
        raise InvalidArgumentError(f"{a.lhs.label}: accum is an ir.AccumOp (AccumOp.ADD, ...) or None, got {a.accum!r}")
    if not isinstance(a.init_neutral, (bool, np.bool_)):
        raise InvalidArgumentError(f"{a.lhs.label}: init_neutral is a bool, got {a.init_neutral!r}")
    if not isinstance(a.projections, Projections):
        raise InvalidArgumentError(f"{a.lhs.label}: projections are ir.Projections, got {type(a.projections).__name__}")
    pr = a.projections
    space = dict(pr.product_space)
    if len(space) != len(pr.product_space):
        raise InvalidProgramError(f"repeated symbol in product space {pr.product_space}")
    if a.op.arity != len(a.rhs):
        raise InvalidProgramError(f"{a.op.value} takes {a.op.arity} operands, got {len(a.rhs)}")
    tensors = a.tensor_operands
    if len(pr.rhs) != len(tensors):
        raise InvalidProgramError(
            f"{len(tensors)} tensor operands but {len(pr.rhs)} rhs projections for {a.lhs.label}"
        )
    _check_index_bounds(a.lhs, pr.lhs, space, f"write of {a.lhs.label}")
    for x, idx in zip(tensors, pr.rhs):
        _check_index_bounds(operand_node(x), idx, space, f"read for {a.lhs.label}")
    operand_dtypes = accum_operand_dtypes(a)
    for operand, dt in zip(a.rhs, operand_dtypes):
        if not _is_tensor_operand(operand):
            check_literal(operand, dt, f"{a.op.value} into {a.lhs.label}")
    out = result_dtype(a.op, operand_dtypes, a.lhs.dtype)
    if out != a.lhs.dtype:
        raise DTypeMismatchError(
            f"{a.op.value} produces {out} but {a.lhs.label} is {a.lhs.dtype}; add a cast"
        )
    if a.accum is not None and a.lhs.dtype.is_bool:
        raise DTypeMismatchError(f"cannot accumulate into bool node {a.lhs.label}")


def _check_fetch(f: Fetch) -> None:
    v = f.value
    _check_target(f.node, None, "a fetch")
    reads = {Slice: ("source",), Reshape: ("source",), Gather: ("table", "indices"),
             ScatterAdd: ("indices", "values")}.get(type(v), ())
    for name in reads:
        part = getattr(v, name)
        if not isinstance(part, Node):
            raise InvalidArgumentError(f"{type(v).__name__.lower()} into {f.node.label}: {name} is a Node, "
                                       f"got {type(part).__name__} {part!r}")
    if isinstance(v, Fill):
        check_literal(v.value, f.node.dtype, f"fill of {f.node.label}")
    elif isinstance(v, Constant):
        if tuple(v.values.shape) != f.node.shape:
            raise ShapeMismatchError(
                f"constant of shape {v.values.shape} for {f.node.label} of shape {f.node.shape}"
            )
        if v.values.dtype != f.node.dtype.np:
            raise DTypeMismatchError(
                f"constant of dtype {v.values.dtype} for {f.node.label} of dtype {f.node.dtype}"
            )
    elif isinstance(v, Reshape):
        if v.source.size != f.node.size:
            raise ShapeMismatchError(
                f"cannot reshape {v.source.label} {v.source.shape} into {f.node.label} {f.node.shape}"
            )
        if v.source.dtype != f.node.dtype:
            raise DTypeMismatchError(
                f"reshape of {v.source.label} ({v.source.dtype}) into {f.node.label} ({f.node.dtype})"
            )
    elif isinstance(v, (Gather, ScatterAdd)):
        _check_row_pick(f.node, v)
    elif isinstance(v, Slice):
        if v.source.shape[1:] != f.node.shape:
            raise ShapeMismatchError(
                f"slice of {v.source.label} {v.source.shape} has shape {v.source.shape[1:]}, "
                f"but {f.node.label} is {f.node.shape}"
            )
        if v.source.dtype != f.node.dtype:
            raise DTypeMismatchError(
                f"slice of {v.source.label} ({v.source.dtype}) into {f.node.label} ({f.node.dtype})"
            )
        if f.node.size:  # a slice of empty rows reads nothing
            _check_index_bounds(v.source, (v.index,) + tuple(fixed(0) for _ in f.node.shape), {},
                                f"slice of {v.source.label}")


def _check_row_pick(node: Node, v: Gather | ScatterAdd) -> None:
    """Shapes and dtypes of a gather (``node`` = rows of ``table``) or a scatter-add (rows
    of ``node`` += ``values``): ``indices`` integer, the picked rows' shape after its own."""
    what = "gather" if isinstance(v, Gather) else "scatter_add"
    # table: whose rows are picked; picked: the rows laid out by index; source: what is read
    table, picked, source = (v.table, node, v.table) if isinstance(v, Gather) else (node, v.values, v.values)
    if v.indices.dtype.is_float or v.indices.dtype.is_bool:
        raise DTypeMismatchError(f"{what} into {node.label}: indices {v.indices.label} are "
                                 f"{v.indices.dtype}, not integers")
    if not table.shape or (table.shape[0] == 0 and v.indices.size > 0):
        raise ShapeMismatchError(f"{what} into {node.label}: {table.label} {table.shape} has no rows to pick")
    if picked.shape != v.indices.shape + table.shape[1:]:
        raise ShapeMismatchError(
            f"{what} into {node.label}: {picked.label} has shape {picked.shape}, expected "
            f"{v.indices.shape + table.shape[1:]} (the indices' {v.indices.shape}, then a row of "
            f"{table.label}: {table.shape[1:]})")
    if source.dtype != node.dtype:
        raise DTypeMismatchError(f"{what} into {node.label} ({node.dtype}) from {source.label} ({source.dtype})")
    if node in (v.indices, source):
        raise InvalidProgramError(f"{what} into {node.label} reads {node.label}: write a new node")


# ---------------------------------------------------------------------------
# Convenient constructors


def _symbols(n: int, prefix: str = "i") -> list[Symbol]:
    return [Symbol(f"{prefix}{k}") for k in range(n)]


def _broadcast_index(shape: tuple[int, ...], out_syms: Sequence[Symbol]) -> tuple[Affine, ...]:
    """numpy broadcasting: align trailing axes; a size-1 axis reads index 0."""
    offset = len(out_syms) - len(shape)
    return tuple(
        fixed(0) if n == 1 else as_affine(out_syms[offset + k]) for k, n in enumerate(shape)
    )


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in np.broadcast_shapes(*shapes))
    except ValueError:
        raise ShapeMismatchError(f"shapes {shapes} do not broadcast together") from None


def apply(
    op: Op,
    *operands: Operand,
    into: Node,
    accum: AccumOp | None = None,
    init_neutral: bool = True,
) -> Accum:
    """An elementwise Accum with numpy broadcasting of the tensor operands to ``into.shape``.
    ``x ** 0.5`` (a literal exponent) is ``sqrt(x)``, as numpy computes it: -0.0 at -0.0 and NaN
    at -inf, where C's pow gives 0.0 and inf (found by review: GCC's vectorizer made ``powf(x,
    0.5f)`` a vector sqrt but left a loop's scalar tail a powf, and the reference took numpy's
    sqrt for float32 and pow for the half types)."""
    if op is Op.POW and len(operands) == 2 and isinstance(operands[1], (float, np.floating)) \
            and not isinstance(operands[0], (int, float, np.number)) and operands[1] == 0.5 \
            and into.dtype.is_float:  # else pow's own error names the dtype
        op, operands = Op.SQRT, operands[:1]
    _check_target(into, op, "apply")
    shapes = [operand_node(x).shape for x in operands if _is_tensor_operand(x)]
    out_shape = broadcast_shapes(into.shape, *shapes)
    if out_shape != into.shape:
        raise ShapeMismatchError(
            f"operands of {op.value} broadcast to {out_shape}, but {into.label} is {into.shape}"
        )
    syms = _symbols(len(into.shape))
    space = tuple(zip(syms, into.shape))
    rhs_idx = [_broadcast_index(operand_node(x).shape, syms) for x in operands if _is_tensor_operand(x)]
    return Accum(
        into,
        accum,
        op,
        tuple(operands),
        Projections(space, tuple(as_affine(s) for s in syms), tuple(rhs_idx)),
        init_neutral,
    )


_EINSUM_SPEC = re.compile(r"^\s*([a-zA-Z]*)\s*((?:,\s*[a-zA-Z]*\s*)*)->\s*([a-zA-Z]*)\s*$")


def einsum(
    spec: str,
    *operands: Node | MergeRead,
    into: Node,
    accum: AccumOp = AccumOp.ADD,
    init_neutral: bool = True,
) -> Accum:
    """``einsum("ik,kj->ij", a, b, into=c)``: multiply the operands, accumulate over dropped letters.

    One operand is a transpose or a reduction (``"ij->i"``); two are a product
    (matmul, outer product, batched forms). ``accum`` picks the reduction.
    """
    if not isinstance(spec, str):
        raise InvalidProgramError(f"an einsum spec is a str such as 'ik,kj->ij', got {spec!r}")
    _check_target(into, None, "einsum")
    for x in operands:
        if not _is_tensor_operand(x):
            raise InvalidArgumentError(f"einsum {spec!r} into {into.label}: operands are Nodes, got {x!r}")
    m = _EINSUM_SPEC.match(spec)
    if not m:
        raise InvalidProgramError(f"bad einsum spec {spec!r}")
    ins = [m.group(1)] + [s.strip() for s in m.group(2).split(",")[1:]]
    out = m.group(3)
    if len(ins) != len(operands):
        raise InvalidProgramError(f"einsum {spec!r} names {len(ins)} operands, got {len(operands)}")
    if len(operands) not in (1, 2):
        raise InvalidProgramError("einsum takes one or two operands")
    extents: dict[str, int] = {}
    for letters, x in zip(ins + [out], [*operands, into]):
        shape = operand_node(x).shape
        if len(letters) != len(shape):
            raise ShapeMismatchError(
                f"einsum {spec!r}: {letters!r} has {len(letters)} axes but "
                f"{operand_node(x).label} has shape {shape}"
            )
        for ch, n in zip(letters, shape):
            if extents.setdefault(ch, n) != n:
                raise ShapeMismatchError(
                    f"einsum {spec!r}: axis {ch!r} has sizes {extents[ch]} and {n}"
                )
    for ch in out:
        if not any(ch in s for s in ins):
            raise InvalidProgramError(f"einsum {spec!r}: output axis {ch!r} is in no operand")
    order = list(dict.fromkeys(out + "".join(ins)))
    sym = {ch: Symbol(ch) for ch in order}
    space = tuple((sym[ch], extents[ch]) for ch in order)
    pr = Projections(
        space,
        tuple(as_affine(sym[ch]) for ch in out),
        tuple(tuple(as_affine(sym[ch]) for ch in s) for s in ins),
    )
    op = Op.ID if len(operands) == 1 else Op.MUL
    return Accum(into, accum, op, tuple(operands), pr, init_neutral)


def _check_target(into: object, op: object, what: str) -> None:
    if not isinstance(into, Node):
        raise InvalidArgumentError(f"{what}: into= is a Node, got {type(into).__name__} {into!r}")
    if op is not None and not isinstance(op, Op):
        raise InvalidArgumentError(f"{what} into {into.label}: op is an ir.Op (Op.ADD, ...), got {op!r}")


def fill(node: Node, value: Scalar) -> Fetch:
    return Fetch(node, Fill(value))


def arange(node: Node) -> Fetch:
    return Fetch(node, Range())


def constant(node: Node, values: Any) -> Fetch:
    _check_target(node, None, "constant")
    dt = node.dtype
    try:
        given = np.asarray(values)
        if given.dtype == object:  # Python numbers: as numpy reads a list of them
            given = np.asarray(given.tolist())
        if given.dtype.kind in "US":  # numpy would parse "3" (a plan's inputs refuse strings too)
            raise TypeError(f"{given.dtype} values are text")
        if dt.np.kind in "iu":  # nothing wraps or truncates (np.asarray would, with a warning at most)
            if given.dtype == dtypes.bfloat16.np:  # not of numpy's kind "f": its float32 values, exactly
                given = given.astype(np.float32)
            if given.dtype.kind in "biuf":
                dtypes.check_integers(given, dt.np, f"constant of {node.label}")
        arr = dtypes.to_half(given, dt) if dt.is_half else np.asarray(given, dtype=dt.np)  # half: rounded once
    except (TypeError, ValueError, OverflowError) as e:
        if isinstance(e, ValueRangeError):
            raise
        raise DTypeMismatchError(f"constant of {node.label}: the values do not convert to {dt}: {e}") from None
    # Read-only and never the caller's memory (0-d stays 0-d): the constant is the values of
    # now, whatever the caller does to its array later (its bytes are copied to devices when
    # linked, and on some backends read when the stream runs). A cast already made a new array.
    borrowed = arr is values or not arr.flags.owndata
    owned = np.array(arr, order="C", copy=True) if borrowed else np.require(arr, requirements="C")
    owned.setflags(write=False)
    return Fetch(node, Constant(owned))


def reshape(node: Node, source: Node) -> Fetch:
    return Fetch(node, Reshape(source))


def slice_at(node: Node, source: Node, index: Index) -> Fetch:
    return Fetch(node, Slice(source, as_affine(index)))


def gather(table: Node, indices: Node, into: Node) -> Fetch:
    """``into[i..., j...] = table[clamp(indices[i...]), j...]`` (:class:`Gather`)."""
    return Fetch(into, Gather(table, indices))


def scatter_add(indices: Node, values: Node, into: Node) -> Fetch:
    """``into = 0; into[clamp(indices[i...]), j...] += values[i..., j...]`` (:class:`ScatterAdd`)."""
    return Fetch(into, ScatterAdd(indices, values))
