"""``Tensor``: a symbolic array with a shape and a dtype, backed by one IR node.

A tensor records the IR assignments that compute its node, the tensors it
reads (its parents) and how to push a gradient back to them. Nothing runs when
a tensor is built: :func:`polyjit.tensor.compile` lowers a graph of tensors
into one routine batch.

Leaves: :func:`input` (fed from the host on every run), :func:`param`
(trainable, persistent, with an initial value) and constants
(:func:`constant`, :func:`full`, :func:`arange`).
"""

from __future__ import annotations

import enum
import itertools
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Union

import attrs
import numpy as np

from polyjit.core import dtypes, ir
from polyjit.core.dtypes import DType, as_dtype
from polyjit.core.errors import (
    DTypeMismatchError,
    InvalidArgumentError,
    ShapeMismatchError,
    SymbolicTensorError,
    ValueRangeError,
)

if TYPE_CHECKING:
    from polyjit.tensor.init import Init

Array = np.ndarray[Any, Any]
Scalar = Union[int, float, bool]
DTypeLike = Union[DType, str, type, np.dtype[Any]]

# A backward rule: (gradient of the output, which parents need one) -> one gradient per parent.
Backward = Callable[["Tensor", Sequence[bool]], Sequence[Union["Tensor", None]]]


class Kind(enum.Enum):
    INPUT = "input"  # fed from the host on every run
    PARAM = "param"  # trainable persistent state
    STATE = "state"  # persistent, not trained (optimizer moments, step counters)
    OP = "op"  # computed by its assignments


_tensor_ids = itertools.count(1)


def _pass_gradient(g: Tensor, needs: Sequence[bool]) -> list[Tensor | None]:
    return [g]  # an alias: the gradient of its one parent


def alias(x: Tensor) -> Tensor:
    """A new tensor that is ``x`` (its node, its gradient): what an op that changes nothing
    returns (``x.reshape(x.shape)``, a cast to its own dtype), so that naming the result
    cannot rename ``x`` (an input, a parameter's state dict key)."""
    return Tensor(x.node, (), (x,), _pass_gradient if x.dtype.is_float else None, name=x.name)


# numpy ufuncs that numpy calls for ``numpy_scalar <op> tensor``: the tensor's own op handles them
# (numpy 2 names true_divide "divide").
_UFUNC_OPS = {
    "add": "add", "subtract": "sub", "multiply": "mul", "true_divide": "div", "divide": "div", "power": "pow",
    "matmul": "matmul", "negative": "neg", "less": "less", "less_equal": "less_equal",
    "greater": "greater", "greater_equal": "greater_equal",
}


@attrs.frozen(eq=False)
class IndexBound:
    """The values of ``indices`` index ``depth`` cells (class labels, one-hot positions, rows of an
    embedding table). A plan whose graph holds the bound checks the values on the host before
    copying them, when ``indices`` is an input (or a reshape, transpose, broadcast or integer
    cast of one: ``program.fed_input``)."""

    indices: Tensor
    depth: int
    what: str  # "cross_entropy labels over 10 classes"


def check_scalar(value: Scalar, dtype: DType, what: str, hint: str = "") -> None:
    """Refuse a Python scalar that ``dtype`` cannot hold exactly (1.5 or 300 for uint8, -1 for
    bool): it would be truncated or wrap around in the kernel. Stricter than the IR's
    :func:`polyjit.core.ir.check_literal`, which converts as C does."""
    if dtype.is_float:
        return
    if dtype.is_bool:
        fits = value in (0, 1)
    else:
        info = np.iinfo(dtype.np)
        integral = isinstance(value, int) or float(value).is_integer()  # False for nan and inf
        fits = integral and info.min <= value <= info.max
    if not fits:
        raise ValueRangeError(f"{what}: the scalar {value!r} does not fit {dtype}{hint}")


def as_int(value: object, what: str) -> int:
    """An int (or a numpy integer, through ``operator.index``, as numpy takes them) for an axis,
    a dimension or an index; a float, a string, None or a bool is refused, never truncated."""
    if not isinstance(value, (bool, np.bool_)):
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise ShapeMismatchError(f"{what} is an int, got {value!r} ({type(value).__name__})")


def tensor_arg(value: object, what: str) -> Tensor:
    """``value``, where an op takes a tensor; anything else (a numpy array: wrap it) is a
    DTypeMismatchError naming the op's argument, as an array operand of ``+`` or ``@`` is."""
    if isinstance(value, Tensor):
        return value
    hint = " (wrap arrays with pt.constant(...))" if isinstance(value, (np.ndarray, np.generic, list)) else ""
    raise DTypeMismatchError(f"{what} takes a Tensor, got {type(value).__name__}{hint}")


def _one_or_many(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """numpy's ``x.reshape(2, 3)`` or ``x.reshape((2, 3))``: the ints, given apart or as one
    sequence. Anything else is kept as given, for the op to refuse by name."""
    if len(args) == 1 and isinstance(args[0], (tuple, list, range, np.ndarray)):
        return tuple(args[0])
    return args


class Tensor:
    """A node of the tensor graph. Build tensors with the functions of ``polyjit.tensor``."""

    __slots__ = ("_backward", "assigns", "id", "index_bounds", "init", "kind", "name", "node", "parents",
                 "requires_grad")

    def __init__(
        self,
        node: ir.Node,
        assigns: Sequence[ir.Assignment] = (),
        parents: Sequence[Tensor] = (),
        backward: Backward | None = None,
        *,
        kind: Kind = Kind.OP,
        init: Array | None = None,
        requires_grad: bool | None = None,
        name: str | None = None,
    ) -> None:
        self.node = node
        self.assigns = tuple(assigns)
        self.parents = tuple(parents)
        self._backward = backward
        self.kind = kind
        self.init = init
        self.id = next(_tensor_ids)
        self.name = name or node.name
        self.index_bounds: tuple[IndexBound, ...] = ()  # see IndexBound (set by one_hot)
        self.requires_grad: bool = (
            requires_grad if requires_grad is not None
            else backward is not None and any(p.requires_grad for p in self.parents)
        )

    # -- description -------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, ...]:
        return self.node.shape

    @property
    def dtype(self) -> DType:
        return self.node.dtype

    @property
    def ndim(self) -> int:
        return len(self.node.shape)

    @property
    def size(self) -> int:
        return self.node.size

    @property
    def is_persistent(self) -> bool:
        return self.kind in (Kind.PARAM, Kind.STATE)

    def __repr__(self) -> str:
        shape = "x".join(map(str, self.shape)) or "scalar"
        return f"Tensor({self.name} {shape} {self.dtype} {self.kind.value})"

    def __hash__(self) -> int:
        return self.id

    def _symbolic(self, use: str) -> SymbolicTensorError:
        return SymbolicTensorError(
            f"{use} of {self!r}: a Tensor is symbolic and has no values until a plan runs it; "
            f"use polyjit.tensor ops on it, or get its values with "
            f"pt.compile({{'{self.name}': t}}).run(...)['{self.name}'] (plan.read(t) for a stored tensor)"
        )

    def __bool__(self) -> bool:
        raise self._symbolic("bool()")

    def __float__(self) -> float:
        raise self._symbolic("float()")

    def __int__(self) -> int:
        raise self._symbolic("int()")

    def __array__(self, dtype: Any = None, copy: Any = None) -> Array:
        raise self._symbolic("np.asarray()")

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if ufunc.__name__ in ("equal", "not_equal") and method == "__call__" and len(inputs) == 2:
            # t == np.float64(1): == and != keep Python's identity semantics (use pt.equal)
            return (inputs[0] is inputs[1]) == (ufunc.__name__ == "equal")
        name = _UFUNC_OPS.get(ufunc.__name__) if method == "__call__" and not kwargs else None
        if name is None:  # np.exp(t), np.add.reduce(t), ...
            raise self._symbolic(f"numpy's {ufunc.__name__}{'' if method == '__call__' else '.' + method}")
        # np.float64(2.0) * t: numpy hands the operator over (a scalar maybe as a 0-d array)
        return getattr(ops, name)(*(x.item() if isinstance(x, np.ndarray) and not x.shape else x
                                    for x in inputs))

    def __len__(self) -> int:
        if not self.shape:
            raise InvalidArgumentError(f"len() of a 0-d tensor, {self!r}")  # a TypeError, as numpy's
        return self.shape[0]

    def __iter__(self) -> Iterator[Tensor]:
        return (self[k] for k in range(len(self)))

    def named(self, name: str) -> Tensor:
        """Give the tensor a name (the key of its output in a plan; an input's or parameter's
        own name); returns the tensor."""
        if not isinstance(name, str):
            raise InvalidArgumentError(f"a tensor's name is a str, not {type(name).__name__}")
        self.name = name
        return self

    def backward_rule(self) -> Backward | None:
        return self._backward

    # -- operators (see polyjit.tensor.ops) ----------------------------------------

    def __add__(self, other: Tensor | Scalar) -> Tensor:
        return ops.add(self, other)

    def __radd__(self, other: Scalar) -> Tensor:
        return ops.add(other, self)

    def __sub__(self, other: Tensor | Scalar) -> Tensor:
        return ops.sub(self, other)

    def __rsub__(self, other: Scalar) -> Tensor:
        return ops.sub(other, self)

    def __mul__(self, other: Tensor | Scalar) -> Tensor:
        return ops.mul(self, other)

    def __rmul__(self, other: Scalar) -> Tensor:
        return ops.mul(other, self)

    def __truediv__(self, other: Tensor | Scalar) -> Tensor:
        return ops.div(self, other)

    def __rtruediv__(self, other: Scalar) -> Tensor:
        return ops.div(other, self)

    def __pow__(self, other: Tensor | Scalar) -> Tensor:
        return ops.pow(self, other)

    def __rpow__(self, other: Scalar) -> Tensor:
        return ops.pow(other, self)

    def __neg__(self) -> Tensor:
        return ops.neg(self)

    def __abs__(self) -> Tensor:
        return ops.abs(self)

    def __matmul__(self, other: Tensor) -> Tensor:
        return ops.matmul(self, other)

    def __rmatmul__(self, other: Tensor) -> Tensor:
        return ops.matmul(other, self)

    def __lt__(self, other: Tensor | Scalar) -> Tensor:
        return ops.less(self, other)

    def __le__(self, other: Tensor | Scalar) -> Tensor:
        return ops.less_equal(self, other)

    def __gt__(self, other: Tensor | Scalar) -> Tensor:
        return ops.greater(self, other)

    def __ge__(self, other: Tensor | Scalar) -> Tensor:
        return ops.greater_equal(self, other)

    # == and != keep Python's identity semantics (tensors are dict keys): use ops.equal.

    def __getitem__(self, index: Any) -> Tensor:
        return ops.getitem(self, index)

    # -- methods ---------------------------------------------------------------

    @property
    def T(self) -> Tensor:
        return ops.transpose(self)

    def transpose(self, *axes: int | Sequence[int]) -> Tensor:
        """``x.transpose(1, 0)`` or ``x.transpose((1, 0))``, as numpy takes them."""
        perm = _one_or_many(axes)
        return ops.transpose(self, None if perm in ((), (None,)) else perm)  # x.transpose(None) reverses

    def reshape(self, *shape: int | Sequence[int]) -> Tensor:
        return ops.reshape(self, _one_or_many(shape))

    def sum(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return ops.sum(self, axis, keepdims)

    def mean(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return ops.mean(self, axis, keepdims)

    def max(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return ops.max(self, axis, keepdims)

    def min(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return ops.min(self, axis, keepdims)

    def exp(self) -> Tensor:
        return ops.exp(self)

    def log(self) -> Tensor:
        return ops.log(self)

    def abs(self) -> Tensor:
        return ops.abs(self)

    def sqrt(self) -> Tensor:
        return ops.sqrt(self)

    def tanh(self) -> Tensor:
        return ops.tanh(self)

    def sigmoid(self) -> Tensor:
        return ops.sigmoid(self)

    def relu(self) -> Tensor:
        return ops.relu(self)

    def astype(self, dtype: DTypeLike) -> Tensor:
        return ops.cast(self, dtype)

    def detach(self) -> Tensor:
        return ops.detach(self)


# ---------------------------------------------------------------------------
# Leaves


def _shape(name: str, shape: int | Sequence[int]) -> tuple[int, ...]:
    try:
        return ir.as_shape(shape)
    except ShapeMismatchError as e:
        raise ShapeMismatchError(f"{name!r}: {e}") from None


def input(name: str, shape: int | Sequence[int], dtype: DTypeLike = dtypes.float32) -> Tensor:
    """A tensor fed from the host on every run (``plan.run(name=array)``)."""
    return Tensor(ir.Node(name, _shape(name, shape), as_dtype(dtype)), kind=Kind.INPUT, requires_grad=False)


def param(
    name: str,
    shape: int | Sequence[int],
    init: Init = "glorot",
    *,
    dtype: DTypeLike = dtypes.float32,
    rng: np.random.Generator | int | None = None,
) -> Tensor:
    """A trainable parameter: persistent in the device context, uploaded once from its initial value.

    ``init`` is an array, a callable ``(rng, shape) -> array`` or a name
    (``"normal"``, ``"uniform"``, ``"zeros"``, ``"ones"``, ``"glorot"``/``"xavier"``,
    ``"he"``/``"kaiming"``). Without ``rng`` the values depend only on the name.
    """
    from polyjit.tensor.init import initial_value

    shape_t = _shape(name, shape)
    dt = as_dtype(dtype)
    value = initial_value(init, name, shape_t, dt, rng)
    return Tensor(ir.Node(name, shape_t, dt), kind=Kind.PARAM, init=value, requires_grad=True)


def state(name: str, value: Any, dtype: DTypeLike | None = None) -> Tensor:
    """Persistent non-trainable state (an optimizer moment, a counter) with an initial value."""
    from polyjit.tensor.init import frozen_initial

    arr = np.asarray(value)
    dt = as_dtype(dtype if dtype is not None else arr.dtype)
    arr = frozen_initial(arr, dt, f"initial value of state {name!r}")
    return Tensor(ir.Node(name, arr.shape, dt), kind=Kind.STATE, init=arr, requires_grad=False)


def constant(value: Any, dtype: DTypeLike | None = None, name: str = "const") -> Tensor:
    """A constant array (uploaded once per device into its constant table)."""
    arr = np.asarray(value)
    dt = as_dtype(dtype if dtype is not None else (np.float32 if arr.dtype == np.float64 else arr.dtype))
    node = ir.Node(name, arr.shape, dt)
    return Tensor(node, (ir.constant(node, arr),), requires_grad=False)


def full(shape: int | Sequence[int], value: Scalar, dtype: DTypeLike = dtypes.float32, name: str = "full") -> Tensor:
    """A tensor of one value (computed on the device: a Fill fetch, inlined into its reader)."""
    node = ir.Node(name, _shape(name, shape), as_dtype(dtype))
    check_scalar(value, node.dtype, f"{name} of {node.dtype}")
    return Tensor(node, (ir.fill(node, value),), requires_grad=False)


def zeros(shape: int | Sequence[int], dtype: DTypeLike = dtypes.float32) -> Tensor:
    return full(shape, 0, dtype, "zeros")


def ones(shape: int | Sequence[int], dtype: DTypeLike = dtypes.float32) -> Tensor:
    return full(shape, 1, dtype, "ones")


def arange(n: int, dtype: DTypeLike = dtypes.int32) -> Tensor:
    """``[0, 1, ..., n-1]`` (a Range fetch)."""
    node = ir.Node("arange", _shape("arange", (as_int(n, "arange's n"),)), as_dtype(dtype))
    return Tensor(node, (ir.arange(node),), requires_grad=False)


from polyjit.tensor import ops  # noqa: E402  (ops builds on Tensor; Tensor's operators call ops)
