"""The scalar operations of the IR (``Op``), the accumulations (``AccumOp``) and the dtype
each produces: polyjit does not promote types."""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np

from polyjit.core import dtypes
from polyjit.core.dtypes import DType
from polyjit.core.errors import DTypeMismatchError


class Op(enum.Enum):
    """Scalar operations applied to the rhs operands of an Accum."""

    # arity 1
    ID = "id"
    NEG = "neg"
    ABS = "abs"
    EXP = "exp"
    LOG = "log"
    SQRT = "sqrt"
    TANH = "tanh"
    SIGMOID = "sigmoid"
    RELU = "relu"
    CAST = "cast"  # converts to the lhs dtype
    # arity 2
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"  # integers: truncates toward zero, as C does
    MAX = "max"
    MIN = "min"
    POW = "pow"
    LT = "lt"
    LE = "le"
    GT = "gt"
    GE = "ge"
    EQ = "eq"
    NE = "ne"
    # arity 3
    WHERE = "where"  # where(cond, a, b)

    @property
    def arity(self) -> int:
        return _ARITY[self]


_UNARY = {Op.ID, Op.NEG, Op.ABS, Op.EXP, Op.LOG, Op.SQRT, Op.TANH, Op.SIGMOID, Op.RELU, Op.CAST}
_ARITY = {op: (1 if op in _UNARY else 3 if op is Op.WHERE else 2) for op in Op}
FLOAT_ONLY = frozenset({Op.EXP, Op.LOG, Op.SQRT, Op.TANH, Op.SIGMOID, Op.POW})
COMPARISONS = frozenset({Op.LT, Op.LE, Op.GT, Op.GE, Op.EQ, Op.NE})


class AccumOp(enum.Enum):
    """How an Accum combines a value with what the lhs cell holds."""

    ADD = "add"
    MUL = "mul"
    MAX = "max"
    MIN = "min"

    def neutral(self, dtype: DType) -> float | int:
        if self is AccumOp.ADD:
            return 0
        if self is AccumOp.MUL:
            return 1
        if dtype.is_float:
            return -np.inf if self is AccumOp.MAX else np.inf
        info = np.iinfo(dtype.np) if not dtype.is_bool else np.iinfo(np.uint8)
        return int(info.min) if self is AccumOp.MAX else int(info.max)


def result_dtype(op: Op, operand_dtypes: Sequence[DType], lhs_dtype: DType) -> DType:
    """The dtype an op produces; raises DTypeMismatchError for operands it does not accept.

    polyjit does not promote: arithmetic operands share one dtype, a cast is explicit.
    """
    if op is Op.CAST:
        return lhs_dtype
    if op is Op.WHERE:
        cond, a, b = operand_dtypes
        if not cond.is_bool:
            raise DTypeMismatchError(f"where() needs a bool condition, got {cond}")
        if a != b:
            raise DTypeMismatchError(f"where() branches differ in dtype: {a} and {b}")
        return a
    first = operand_dtypes[0]
    for d in operand_dtypes[1:]:
        if d != first:
            names = ", ".join(str(x) for x in operand_dtypes)
            raise DTypeMismatchError(f"{op.value} operands differ in dtype ({names}); cast first")
    if op in COMPARISONS:
        return dtypes.bool_
    if op in FLOAT_ONLY and not first.is_float:
        raise DTypeMismatchError(f"{op.value} needs a floating dtype, got {first}; cast first")
    if first.is_bool and op is not Op.ID:
        raise DTypeMismatchError(f"{op.value} is not defined on bool; cast first")
    return first
