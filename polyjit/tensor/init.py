"""Initial values of parameters: named schemes, arrays or callables ``(rng, shape) -> array``."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import Any, Union

import numpy as np

from polyjit.core.dtypes import DType, bfloat16
from polyjit.core.errors import (
    DTypeMismatchError,
    InvalidArgumentError,
    InvalidProgramError,
    ShapeMismatchError,
)

Array = np.ndarray[Any, Any]
Init = Union[str, Array, float, int, Callable[[np.random.Generator, tuple[int, ...]], Any]]


def _fans(shape: tuple[int, ...]) -> tuple[int, int]:
    """Fan in and out of a weight: (in, out) for a matrix, receptive field included for more
    axes; at least 1 (a fan of 0 is a weight with no values, whose scale does not matter)."""
    if not shape:
        return 1, 1
    if len(shape) == 1:
        return max(shape[0], 1), max(shape[0], 1)
    field = math.prod(shape[:-2])
    return max(shape[-2] * field, 1), max(shape[-1] * field, 1)


def normal(rng: np.random.Generator, shape: tuple[int, ...], std: float = 0.02) -> Array:
    return rng.normal(0.0, std, shape)


def uniform(rng: np.random.Generator, shape: tuple[int, ...], bound: float = 0.05) -> Array:
    return rng.uniform(-bound, bound, shape)


def glorot(rng: np.random.Generator, shape: tuple[int, ...]) -> Array:
    """Glorot/Xavier uniform: keeps the variance of activations and gradients alike."""
    fan_in, fan_out = _fans(shape)
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-bound, bound, shape)


def he(rng: np.random.Generator, shape: tuple[int, ...]) -> Array:
    """He/Kaiming normal, for ReLU layers."""
    fan_in, _ = _fans(shape)
    return rng.normal(0.0, math.sqrt(2.0 / fan_in), shape)


SCHEMES: dict[str, Callable[[np.random.Generator, tuple[int, ...]], Array]] = {
    "normal": normal,
    "uniform": uniform,
    "glorot": glorot,
    "xavier": glorot,
    "he": he,
    "kaiming": he,
    "zeros": lambda rng, shape: np.zeros(shape),
    "ones": lambda rng, shape: np.ones(shape),
}


def name_rng(name: str) -> np.random.Generator:
    """A generator that depends only on the parameter's name: models initialise reproducibly."""
    return np.random.default_rng(zlib.crc32(name.encode()))


def initial_value(
    init: Init, name: str, shape: tuple[int, ...], dtype: DType, rng: np.random.Generator | int | None
) -> Array:
    """The initial array of a parameter, in its shape and dtype."""
    if rng is None:
        gen = name_rng(name)
    elif isinstance(rng, np.random.Generator):
        gen = rng
    else:
        try:
            gen = np.random.default_rng(rng)
        except (TypeError, ValueError) as e:  # "seed", -1, 2.5
            raise InvalidArgumentError(
                f"param {name!r}: rng is a numpy Generator or a seed (a non-negative int), got {rng!r}: {e}"
            ) from None
    value: Any
    if isinstance(init, str):
        try:
            scheme = SCHEMES[init]
        except KeyError:
            raise InvalidProgramError(f"unknown init {init!r}; known: {', '.join(SCHEMES)}") from None
        value = scheme(gen, shape)
    elif callable(init):
        value = init(gen, shape)
    else:
        value = init
    arr = np.asarray(value)
    if arr.dtype.kind not in "biuf" and arr.dtype != bfloat16.np:  # a string, None, a complex
        raise DTypeMismatchError(
            f"initial value of {name!r} ({dtype}, shape {shape}) is not numbers: got {arr.dtype} ({value!r:.60})"
        )
    if arr.shape == () and shape != ():
        arr = np.full(shape, arr)
    if arr.shape != shape:
        raise ShapeMismatchError(f"initial value of {name} has shape {arr.shape}, the parameter {shape}")
    return frozen_initial(arr, dtype, f"initial value of {name!r}")


def frozen_initial(arr: Array, dtype: DType, what: str) -> Array:
    """A parameter's or a state's initial value: its own read-only copy in ``dtype`` (the
    caller's array may change later; reset() puts back what was given), converted as inputs
    are (``hostio.convert_into``: a float too large for the dtype, an integer out of range
    are ValueRangeError)."""
    from polyjit.tensor.hostio import convert_into

    out = np.empty(arr.shape, dtype.np)  # C order; 0-d stays 0-d
    convert_into(out, arr, what)
    out.flags.writeable = False
    return out
