"""What every program of the catalog is built from: :class:`CatalogProgram`, random values,
:func:`program`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from polyjit.core import dtypes, ir
from polyjit.core.dtypes import DType
from polyjit.core.ir import MemoryMode, Node, StaticSymbol

__all__ = [
    "TOLERANCES",
    "Array",
    "CatalogProgram",
    "Gen",
    "default_tolerance",
    "f32",
    "program",
    "values",
]

Array = np.ndarray[Any, Any]
Gen = Callable[[np.random.Generator], Array]


@attrs.frozen(eq=False)
class CatalogProgram:
    """A named test program.

    ``inputs``: the nodes put in the context before linking, each with its random
    generator (a node a computation writes in place or accumulates onto is an input
    too). ``runs``: one binding of the static symbols per run; every run executes
    the program's routines in order, and the outputs are checked after each run
    (state carries over from run to run, as it does in the context).
    ``virtual``: intermediates that must be inferred VIRTUAL and be absent from the
    context; ``absent``: nodes that must not be in the context (LOCAL scratch);
    ``present``: nodes that must be in the context.
    """

    name: str
    comps: tuple[ir.Comp, ...]
    inputs: tuple[tuple[Node, Gen], ...]
    outputs: tuple[Node, ...]
    runs: tuple[Mapping[StaticSymbol, int], ...] = ({},)
    virtual: tuple[Node, ...] = ()
    absent: tuple[Node, ...] = ()
    present: tuple[Node, ...] = ()
    rtol: float | None = None
    atol: float | None = None
    description: str = ""

    def generate(self, rng: np.random.Generator) -> dict[Node, Array]:
        out: dict[Node, Array] = {}
        for node, gen in self.inputs:
            arr = np.asarray(gen(rng))
            out[node] = np.ascontiguousarray(arr.astype(node.dtype.np, copy=False)).reshape(node.shape)
        return out

    def tolerance(self, dt: DType) -> tuple[float, float]:
        rtol, atol = default_tolerance(dt)
        return (self.rtol if self.rtol is not None else rtol, self.atol if self.atol is not None else atol)

    def __repr__(self) -> str:
        return f"CatalogProgram({self.name})"


# The kit's tolerances, (rtol, atol) per float dtype, for comparing a backend's node with the
# reference interpreter's (``np.isclose``: |got - want| <= atol + rtol * |want|); integers and
# bools compare exactly. The half types compute as the reference does (float32, rounded per
# op), so they differ only where float32 results differ (exp, tanh, pow; summation order) and
# that moves a rounding: 2 units in the last place of each (float16: 2**-10 relative,
# bfloat16: 2**-7), and an atol for results that cancel to near zero. A program may set its
# own (a matmul of random values, a generated program with its error bound).
TOLERANCES: dict[DType, tuple[float, float]] = {
    dtypes.float32: (2e-5, 1e-6),
    dtypes.float64: (1e-11, 1e-12),
    dtypes.float16: (2e-3, 1e-5),
    dtypes.bfloat16: (1.6e-2, 1e-5),
}


def default_tolerance(dt: DType) -> tuple[float, float]:
    """(rtol, atol) for comparing a node of ``dt`` (:data:`TOLERANCES`); integers and bools
    compare exactly."""
    return TOLERANCES.get(dt, (0.0, 0.0))


# ---------------------------------------------------------------------------
# Random values


def values(dt: DType, shape: tuple[int, ...], kind: str = "any") -> Gen:
    """A generator of random values of ``dt``.

    kinds: ``any`` (floats in [-2, 2], ints in [-50, 50], all of uint8, bools),
    ``pos`` (strictly positive), ``nonzero`` (away from zero), ``exp`` (floats in
    [-3, 3]), ``few`` (a handful of exact values, so that comparisons meet equality),
    ``unit`` (floats in [0.8, 1.25], small ints: safe for products), ``quarter``
    (float multiples of 1/4 in [-4, 4]: sums are exact in any order),
    ``small`` (ints in [-3, 3]).
    """
    np_dt = dt.np

    def gen(rng: np.random.Generator) -> Array:
        if dt.is_bool:
            return rng.random(shape) < 0.5
        if dt.is_float:
            if kind == "pos":
                x = rng.uniform(0.25, 3.0, shape)
            elif kind == "nonzero":
                x = rng.uniform(0.5, 2.0, shape) * rng.choice([-1.0, 1.0], shape)
            elif kind == "exp":
                x = rng.uniform(-3.0, 3.0, shape)
            elif kind == "few":
                x = rng.choice([-1.0, -0.5, 0.0, 0.5, 1.0], shape)
            elif kind == "unit":
                x = rng.uniform(0.8, 1.25, shape)
            elif kind == "quarter":
                x = rng.integers(-16, 17, shape) / 4.0
            elif kind == "small":
                x = rng.integers(-3, 4, shape).astype(np.float64)
            else:
                x = rng.uniform(-2.0, 2.0, shape)
            return np.asarray(x).astype(np_dt)
        signed = dt.is_signed
        if kind == "pos":
            lo, hi = 1, (50 if signed else 255)
        elif kind == "nonzero":
            mag = rng.integers(1, 21 if signed else 256, shape)
            sign = rng.choice([-1, 1], shape) if signed else 1
            return np.asarray(mag * sign).astype(np_dt)
        elif kind == "few":
            lo, hi = 0, 3
        elif kind in ("unit", "small"):
            lo, hi = (-3, 3) if signed else (0, 3)
        else:
            lo, hi = (-50, 50) if signed else (0, 255)
        return rng.integers(lo, hi + 1, shape).astype(np_dt)

    return gen


# ---------------------------------------------------------------------------
# Building blocks


def program(
    name: str,
    *assignments: ir.Assignment,
    inputs: Sequence[tuple[Node, Gen]],
    outputs: Sequence[Node],
    comps: Sequence[ir.Comp] | None = None,
    **kw: Any,
) -> CatalogProgram:
    """A one-computation program (or several, with ``comps=``)."""
    cs = tuple(comps) if comps is not None else (ir.Comp.of(*assignments),)
    return CatalogProgram(name, cs, tuple(inputs), tuple(outputs), **kw)


def f32(name: str, shape: tuple[int, ...], mode: MemoryMode | None = None) -> Node:
    return Node(name, shape, dtypes.float32, mode)
