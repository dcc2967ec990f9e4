"""The dtype table: numpy dtypes and their names in each C-family dialect.

float16 and bfloat16 (``ml_dtypes.bfloat16`` on the host) are *storage* types: a node of
either holds 2-byte values, and kernels compute with them in float32 (``DType.compute``).
Every load converts to float32 (exactly), every op on half values rounds its float32
result to the half type (round to nearest even), and every store converts the (already
rounded) value back; reductions accumulate in float32 and round once, when they store.
For ``+ - * /`` and ``sqrt`` this gives the bits a native half unit would (float32 holds
more than 2p + 2 bits of either type, so rounding twice is harmless); the reference
interpreter (core/reference.py) computes the same way. :func:`to_half` and
:func:`round_scalar` are the host side of those conversions."""

from __future__ import annotations

from typing import Any, TypeGuard

import attrs
import ml_dtypes
import numpy
import numpy as np

from polyjit.core.errors import DTypeMismatchError, ValueRangeError


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
    def is_half(self) -> bool:
        """float16 or bfloat16: stored in 2 bytes, computed in float32."""
        return self.name in ("float16", "bfloat16")

    @property
    def compute(self) -> DType:
        """The dtype kernels compute this one in: float32 for the half types, else itself."""
        return float32 if self.is_half else self

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
# The half types: C and CUDA store the bits (uint16_t, unsigned short) and convert with
# helpers; OpenCL stores float16 as ``half`` (what vload_half/vstore_half_rte read and
# write, core OpenCL: no extension needed) and bfloat16 as its bits.
float16 = DType("float16", np.dtype(np.float16), "uint16_t", "half", "unsigned short", True, True)
bfloat16 = DType("bfloat16", np.dtype(ml_dtypes.bfloat16), "uint16_t", "ushort", "unsigned short", True, True)

# New dtypes go at the end: the kit seeds some values by a dtype's position here.
ALL: tuple[DType, ...] = (float32, float64, int32, int64, uint8, bool_, float16, bfloat16)
HALF: tuple[DType, ...] = (float16, bfloat16)
_BY_NAME = {d.name: d for d in ALL}
_BY_NP = {d.np: d for d in ALL}


def is_int(value: object) -> TypeGuard[int | np.integer[Any]]:
    """Whether ``value`` is a whole number as polyjit takes one (a count, a size, an offset, an
    ordinal, a bound): an int or a numpy integer, never a bool (a flag is not a count, though
    Python's bool is an int)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


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


# ---------------------------------------------------------------------------
# Host-side conversions to the half types, as kernels do them

Array = np.ndarray[Any, Any]


def float32_round_to_odd(x: Any) -> Array:
    """float64 values as float32, rounded to odd: truncated toward zero, with the last bit set
    when anything was cut off. Rounding that to a type of at most 22 bits (float16: 11,
    bfloat16: 8) gives the correctly rounded result, where float64 -> float32 -> half
    (round to nearest twice) may not."""
    d = np.asarray(x, dtype=np.float64)
    with np.errstate(all="ignore"):
        f = d.astype(np.float32)
        inexact = (f.astype(np.float64) != d) & ~np.isnan(d)
        bits = f.view(np.uint32).copy()
        away = np.abs(f.astype(np.float64)) > np.abs(d)  # rounded away from zero: step back
        bits = np.where(inexact & away, bits - np.uint32(1), bits)
        bits = np.where(inexact, bits | np.uint32(1), bits)
    return bits.astype(np.uint32).view(np.float32).reshape(d.shape)


def position(flat: int, shape: tuple[int, ...], row0: int = 0) -> tuple[int, ...]:
    """The index of a flat position, its first axis shifted by ``row0`` (a shard's offset)."""
    pos = [int(k) for k in np.unravel_index(flat, shape)] if shape else []
    if pos:
        pos[0] += row0
    return tuple(pos)


def check_integers(arr: Array, dst: np.dtype[Any], what: str, row0: int = 0) -> None:
    """Every value of ``arr`` (bools, integers or floats) is an integer that the integer dtype
    ``dst`` holds, so a cast neither wraps nor truncates; else ValueRangeError naming ``what``
    and the first culprit's index (``row0``: see :func:`position`). Host values bound for an
    integer node (a plan's inputs, a constant) pass here."""
    if not arr.size or arr.dtype.kind == "b":
        return
    info = np.iinfo(dst)
    lo, hi = arr.min(), arr.max()
    if arr.dtype.kind == "f":
        if np.isnan(lo) or np.isnan(hi):
            at = int(np.flatnonzero(np.isnan(arr))[0]) if arr.ndim else 0
            raise ValueRangeError(f"{what}: NaN at index {position(at, arr.shape, row0)} does not fit {dst}")
        # exact: Python compares a float with an int exactly (2.0**63 > 2**63 - 1)
        too_low, too_high = float(lo) < info.min, float(hi) > info.max
    else:
        too_low, too_high = int(lo) < info.min, int(hi) > info.max
    if too_low or too_high:
        at = int(np.argmin(arr)) if too_low else int(np.argmax(arr))
        raise out_of_range(what, arr.flat[at].item(), position(at, arr.shape, row0), dst)
    if arr.dtype.kind == "f":
        fraction = np.flatnonzero(arr != np.trunc(arr))
        if fraction.size:
            at = int(fraction[0])
            raise not_integral(what, arr.flat[at].item(), position(at, arr.shape, row0))


def out_of_range(what: str, value: object, index: tuple[int, ...], dst: np.dtype[Any]) -> ValueRangeError:
    """The error for an integer value the integer dtype ``dst`` cannot hold."""
    info = np.iinfo(dst)
    return ValueRangeError(f"{what}: value {value!r} at index {index} does not fit {dst} ({info.min}..{info.max})")


def not_integral(what: str, value: object, index: tuple[int, ...]) -> ValueRangeError:
    """The error for a fractional value bound for an integer node."""
    return ValueRangeError(f"{what}: value {value!r} at index {index} is not an integer "
                           "(an integer node takes integral values)")


def check_no_overflow(source: Array, converted: Array, what: str, row0: int = 0) -> None:
    """``converted`` (``source`` rounded to a narrower float dtype) holds an infinity only
    where ``source`` does; else ValueRangeError naming ``what`` and the first value too large
    for the dtype (1e300 for float32, 70000 for float16: rounding, not overflow, is what a
    conversion of host values may do). Its min and max only, when they are finite (no
    temporary array: a plan's run allocates nothing per step)."""
    if not converted.size or (np.isfinite(converted.max()) and np.isfinite(converted.min())):
        return
    src = source.astype(np.float64) if source.dtype.kind != "f" else source
    grew = np.flatnonzero(np.isinf(converted) & np.isfinite(src))
    if grew.size:
        at = int(grew[0])
        limit = float(ml_dtypes.finfo(converted.dtype).max)
        raise ValueRangeError(f"{what}: value {source.flat[at].item()!r} at index "
                              f"{position(at, source.shape, row0)} does not fit {as_dtype(converted.dtype)} "
                              f"(largest finite: {limit:.6g})")


def to_half(x: Any, dt: DType) -> Array:
    """``x`` (any real array) converted to the half type ``dt`` the way kernels convert:
    float64 through float32 rounded to odd (so correctly rounded), everything else through
    float32 (integers beyond 2**24 round twice), then to nearest even. Overflow gives inf,
    NaN stays NaN."""
    arr = np.asarray(x)
    if arr.dtype == dt.np:
        return arr.copy()
    if arr.dtype == np.float64:
        f32 = float32_round_to_odd(arr)
    else:
        with np.errstate(all="ignore"):
            f32 = arr.astype(np.float32)
    with np.errstate(all="ignore"):
        return f32.astype(dt.np)


def wrap_int(value: int, dt: DType) -> int:
    """An integer as C's conversion to the integer type ``dt`` gives it: modulo 2**bits, in
    the type's range (2**63 into int64 is -2**63, 300 into uint8 is 44)."""
    bits = 8 * dt.itemsize
    v = int(value) % (1 << bits)
    return v - (1 << bits) if np.iinfo(dt.np).min < 0 and v >= 1 << (bits - 1) else v


def round_scalar(value: float, dt: DType) -> float:
    """A Python number rounded to ``dt`` (a literal of a half type, as kernels see it)."""
    return float(to_half(np.float64(value), dt).astype(np.float32)) if dt.is_half else float(value)
