"""Elementwise ops (``ir.apply`` with numpy broadcasting) and their derivatives."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from polyjit.core import dtypes, ir
from polyjit.core.dtypes import as_dtype
from polyjit.core.errors import DTypeMismatchError, InvalidProgramError
from polyjit.core.ir import Op
from polyjit.tensor.ops.indexing import sum_to
from polyjit.tensor.tensor import DTypeLike, Scalar, Tensor, alias, check_scalar, full, tensor_arg

Operand = Tensor | Scalar


def _is_scalar(x: object) -> bool:
    return isinstance(x, (int, float, bool)) and not isinstance(x, Tensor)


def _as_operand(x: Any) -> Any:
    """A numpy scalar (np.float32(2), np.int64(3)) as the Python scalar it holds."""
    return x.item() if isinstance(x, np.generic) and x.dtype.kind in "biuf" else x


def _check_operands(operands: Sequence[Operand]) -> None:
    for x in operands:
        if not isinstance(x, Tensor) and not _is_scalar(x):
            hint = " (wrap arrays with pt.constant(...))" if isinstance(x, np.ndarray) else ""
            raise DTypeMismatchError(f"an operand must be a Tensor or a scalar, got {type(x).__name__}{hint}")


def _operand_dtypes(op: Op, operands: Sequence[Operand], default: dtypes.DType) -> list[dtypes.DType]:
    """Like ir.accum_operand_dtypes: a scalar takes the dtype of the tensor values beside it."""
    positions = (1, 2) if op is Op.WHERE else range(len(operands))
    values = [x.dtype for k, x in enumerate(operands) if k in positions and isinstance(x, Tensor)]
    scalar_dt = values[0] if values else default
    out = []
    for k, x in enumerate(operands):
        if isinstance(x, Tensor):
            out.append(x.dtype)
        elif op is Op.WHERE and k == 0:
            out.append(dtypes.bool_)
        else:
            out.append(scalar_dt)
    return out


# d(out)/d(operand k) as tensors: (gradient of out, out, operands) -> one entry per operand.
_Rule = Callable[[Tensor, Tensor, Sequence[Operand]], Sequence[Any]]


def elementwise(
    op: Op, *operands: Operand, dtype: DTypeLike | None = None, name: str | None = None
) -> Tensor:
    """``op`` applied elementwise with numpy broadcasting; Python (and numpy) scalars become literals
    of the dtype of the tensor beside them, which must hold them exactly."""
    operands = tuple(_as_operand(x) for x in operands)
    _check_operands(operands)
    tensors = [x for x in operands if isinstance(x, Tensor)]
    if not tensors:
        raise InvalidProgramError(f"{op.value} needs at least one tensor operand")
    shape = ir.broadcast_shapes(*(t.shape for t in tensors))
    default = as_dtype(dtype) if dtype is not None else dtypes.float32
    if op is Op.CAST:
        out_dt = default
    else:
        operand_dts = _operand_dtypes(op, operands, default)
        for x, dt in zip(operands, operand_dts):
            if not isinstance(x, Tensor):
                check_scalar(x, dt, f"{op.value} of {', '.join(repr(t) for t in tensors)}",
                             "; cast the tensor first, e.g. x.astype('float32')")
        out_dt = ir.result_dtype(op, operand_dts, default)
    node = ir.Node(name or op.value, shape, out_dt)
    rhs = tuple(x.node if isinstance(x, Tensor) else x for x in operands)
    assign = ir.apply(op, *rhs, into=node)
    # the op ir.apply made (x ** 0.5 is sqrt: its gradient too, found by review: 0 where the
    # forward was NaN, at -inf) and the operands it kept
    rule = _RULES.get(assign.op)
    operands = operands[: len(assign.rhs)]
    if rule is None or not out_dt.is_float:
        return Tensor(node, (assign,), tensors, None, requires_grad=False)
    out_holder: list[Tensor] = []

    def backward(g: Tensor, needs: Sequence[bool]) -> list[Tensor | None]:
        grads = rule(g, out_holder[0], operands)
        result: list[Tensor | None] = []
        k = 0
        for x, gx in zip(operands, grads):
            if not isinstance(x, Tensor):
                continue
            result.append(sum_to(gx, x.shape) if needs[k] and gx is not None else None)
            k += 1
        return result

    out = Tensor(node, (assign,), tensors, backward)
    out_holder.append(out)
    return out


def _pow_grads(g: Tensor, out: Tensor, a: Operand, b: Operand) -> list[Tensor | None]:
    """PyTorch's values at the edges (pow_backward_self / pow_backward_exponent): where the
    exponent is 0, d/da is 0 (not 0 * a**-1, NaN at a == 0); where a == 0 and b >= 0, d/db
    is 0 (not 0 * log(0), NaN); a negative scalar base gives NaN, as log(a) does."""
    ga: Tensor | None = None
    if isinstance(a, Tensor):
        if isinstance(b, Tensor):
            ga = where(equal(b, 0.0), 0.0, g * b * pow(a, b - 1.0))
        elif b == 0:
            ga = full(g.shape, 0, g.dtype, "zeros")  # torch's zeros_like: 0 even where g is NaN
        else:
            ga = g * b * pow(a, b - 1.0)
    gb: Tensor | None = None
    if isinstance(b, Tensor):  # d(a^b)/db = a^b log(a)
        if isinstance(a, Tensor):
            at_zero = where(greater_equal(b, 0.0), equal(a, 0.0), False)
            gb = g * where(at_zero, 0.0, out * log(a))
        elif a == 0:  # log(0) = -inf: only b < 0 (a**b = inf) keeps it
            gb = g * where(greater_equal(b, 0.0), 0.0, out * -math.inf)
        else:  # math.log refuses a < 0 where log(a) is NaN
            gb = g * out * (math.log(a) if a > 0 else math.nan)
    return [ga, gb]


def _mask_grads(m: Tensor, g: Tensor) -> list[Tensor]:
    return [where(m, g, 0.0), where(m, 0.0, g)]


def _tie_grads(picks_a: Tensor, x: Sequence[Operand], g: Tensor) -> list[Tensor]:
    """``maximum`` and ``minimum``: the gradient goes to the operand the value came from, in
    halves where the two are equal (PyTorch's and JAX's rule; either alone is a subgradient)."""
    half = g * 0.5
    tie = equal(x[0], x[1])
    return [where(picks_a, where(tie, half, g), 0.0), where(picks_a, where(tie, half, 0.0), g)]


_RULES: dict[Op, _Rule] = {
    Op.ID: lambda g, out, x: [g],
    Op.NEG: lambda g, out, x: [-g],
    Op.ADD: lambda g, out, x: [g, g],
    Op.SUB: lambda g, out, x: [g, -g],
    Op.MUL: lambda g, out, x: [g * x[1], g * x[0]],
    Op.DIV: lambda g, out, x: [g / x[1], -(g * out) / x[1]],
    Op.EXP: lambda g, out, x: [g * out],
    Op.LOG: lambda g, out, x: [g / x[0]],
    Op.SQRT: lambda g, out, x: [g * 0.5 / out],
    Op.TANH: lambda g, out, x: [g * (1.0 - out * out)],
    Op.SIGMOID: lambda g, out, x: [g * out * (1.0 - out)],
    # from the output, as PyTorch's threshold_backward: out > 0 exactly where x > 0 (NaN and
    # -0.0 included), and the input then has one reader, so a layer's bias and relu run in
    # its product's epilogue and the pre-activation is never stored
    Op.RELU: lambda g, out, x: [where(greater(out, 0.0), g, 0.0)],
    Op.ABS: lambda g, out, x: [where(greater_equal(x[0], 0.0), g, -g)],
    Op.POW: lambda g, out, x: _pow_grads(g, out, x[0], x[1]),
    Op.MAX: lambda g, out, x: _tie_grads(_ge(x[0], x[1]), x, g),
    Op.MIN: lambda g, out, x: _tie_grads(_le(x[0], x[1]), x, g),
    Op.WHERE: lambda g, out, x: [None, *_mask_grads(x[0], g)],  # type: ignore[arg-type]
    Op.CAST: lambda g, out, x: [cast(g, x[0].dtype) if x[0].dtype.is_float else None],  # type: ignore[union-attr]
}


def _ge(a: Operand, b: Operand) -> Tensor:
    return elementwise(Op.GE, a, b)


def _le(a: Operand, b: Operand) -> Tensor:
    return elementwise(Op.LE, a, b)


def add(a: Operand, b: Operand) -> Tensor:
    return elementwise(Op.ADD, a, b)


def sub(a: Operand, b: Operand) -> Tensor:
    return elementwise(Op.SUB, a, b)


def mul(a: Operand, b: Operand) -> Tensor:
    return elementwise(Op.MUL, a, b)


def div(a: Operand, b: Operand) -> Tensor:
    return elementwise(Op.DIV, a, b)


def pow(a: Operand, b: Operand) -> Tensor:
    return elementwise(Op.POW, a, b)


def neg(x: Tensor) -> Tensor:
    return elementwise(Op.NEG, x)


def abs(x: Tensor) -> Tensor:
    return elementwise(Op.ABS, x)


def exp(x: Tensor) -> Tensor:
    return elementwise(Op.EXP, x)


def log(x: Tensor) -> Tensor:
    return elementwise(Op.LOG, x)


def sqrt(x: Tensor) -> Tensor:
    return elementwise(Op.SQRT, x)


def tanh(x: Tensor) -> Tensor:
    return elementwise(Op.TANH, x)


def sigmoid(x: Tensor) -> Tensor:
    return elementwise(Op.SIGMOID, x)


def relu(x: Tensor) -> Tensor:
    return elementwise(Op.RELU, x)


def maximum(a: Operand, b: Operand) -> Tensor:
    return elementwise(Op.MAX, a, b)


def minimum(a: Operand, b: Operand) -> Tensor:
    return elementwise(Op.MIN, a, b)


def where(cond: Tensor, a: Operand, b: Operand) -> Tensor:
    """``a`` where ``cond`` (a bool tensor) holds, else ``b``."""
    return elementwise(Op.WHERE, cond, a, b)


def less(a: Operand, b: Operand) -> Tensor:
    return elementwise(Op.LT, a, b)


def less_equal(a: Operand, b: Operand) -> Tensor:
    return elementwise(Op.LE, a, b)


def greater(a: Operand, b: Operand) -> Tensor:
    return elementwise(Op.GT, a, b)


def greater_equal(a: Operand, b: Operand) -> Tensor:
    return elementwise(Op.GE, a, b)


def equal(a: Operand, b: Operand) -> Tensor:
    return elementwise(Op.EQ, a, b)


def not_equal(a: Operand, b: Operand) -> Tensor:
    return elementwise(Op.NE, a, b)


def cast(x: Tensor, dtype: DTypeLike) -> Tensor:
    x = tensor_arg(x, "cast")
    dt = as_dtype(dtype)
    if dt == x.dtype:
        return alias(x)
    return elementwise(Op.CAST, x, dtype=dt, name=f"to_{dt.name}")


def detach(x: Tensor) -> Tensor:
    """The same values, through which no gradient flows (an alias: no new node)."""
    x = tensor_arg(x, "detach")
    return Tensor(x.node, (), (x,), None, requires_grad=False, name=x.name)
