"""The dtype table: numpy dtypes and their names in each C-family dialect."""

from __future__ import annotations

from typing import Any

import attrs
import numpy
import numpy as np

from polyjit.core.errors import DTypeMismatchError


@attrs.frozen(eq=False)
class DType:
    """One supported element type. ``c``, ``opencl`` and ``cuda`` are the storage type names.

    It behaves as numpy expects of a dtype: ``np.empty(node.shape, node.dtype)`` works (numpy
    reads ``.dtype``) and it compares equal to the numpy dtype, scalar type and name of the
    same type (``dtypes.float32 == np.float32 == "float32"``)."""

    name: str
    np: np.dtype[Any] = attrs.field(eq=False)
    c: str
    opencl: str
    cuda: str
    is_float: bool
    is_signed: bool

    @property
    def itemsize(self) -> int:
        return int(self.np.itemsize)

    @property
    def is_bool(self) -> bool:
        return self.name == "bool"

    @property
    def dtype(self) -> numpy.dtype[Any]:
        """The numpy dtype (what ``np.dtype(d)`` and numpy's constructors read)."""
        return self.np

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DType):
            return self.name == other.name
        try:
            return bool(self.np == np.dtype(other))  # type: ignore[call-overload]
        except TypeError:
            return False

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self.np)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"dtypes.{self.name}"


# bool is stored as one byte (like numpy); kernels compute with it as 0/1.
float32 = DType("float32", np.dtype(np.float32), "float", "float", "float", True, True)
float64 = DType("float64", np.dtype(np.float64), "double", "double", "double", True, True)
int32 = DType("int32", np.dtype(np.int32), "int32_t", "int", "int", False, True)
int64 = DType("int64", np.dtype(np.int64), "int64_t", "long", "long long", False, True)
uint8 = DType("uint8", np.dtype(np.uint8), "uint8_t", "uchar", "unsigned char", False, False)
bool_ = DType("bool", np.dtype(np.bool_), "uint8_t", "uchar", "unsigned char", False, False)

ALL: tuple[DType, ...] = (float32, float64, int32, int64, uint8, bool_)
_BY_NAME = {d.name: d for d in ALL}
_BY_NP = {d.np: d for d in ALL}


def as_dtype(value: Any) -> DType:
    """Accept a DType, a numpy dtype or anything numpy understands as one ("float32", np.int64...)."""
    if isinstance(value, DType):
        return value
    if isinstance(value, str) and value in _BY_NAME:
        return _BY_NAME[value]
    try:
        npd = np.dtype(value)
    except TypeError as e:
        raise DTypeMismatchError(f"not a dtype: {value!r}") from e
    try:
        return _BY_NP[npd]
    except KeyError:
        names = ", ".join(_BY_NAME)
        raise DTypeMismatchError(f"unsupported dtype {npd}; polyjit supports {names}") from None
