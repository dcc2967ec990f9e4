"""Evaluate a tensor graph with the IR's numpy reference interpreter: no compiler, no device.

Handy to check a model or a gradient without compiling (the tests use it for
finite differences) and to compare a backend's results with the reference.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from polyjit.core.dtypes import to_half
from polyjit.core.errors import BindingError
from polyjit.core.reference import run_reference
from polyjit.tensor.program import Program, Write, named_outputs
from polyjit.tensor.tensor import Tensor

Array = np.ndarray[Any, Any]


def _host_value(value: Any, t: Tensor) -> Array:
    """A host value in the tensor's dtype, converted as a plan converts it (a half type:
    rounded once, from float64 too)."""
    dt = t.dtype
    arr = to_half(value, dt) if dt.is_half else np.asarray(value, dtype=dt.np)
    return arr.reshape(t.shape)


def evaluate(
    outputs: Tensor | Sequence[Tensor] | Mapping[str, Tensor],
    inputs: Mapping[str, Any] | None = None,
    *,
    state: Mapping[str, Any] | None = None,
    writes: Sequence[Write] = (),
    computed_first: Sequence[Tensor] = (),
) -> tuple[dict[str, Array], dict[str, Array]]:
    """Run the graph once; returns (outputs by name, persistent state after the writes by name).
    ``outputs`` as ``pt.compile`` takes them: a tensor, a list of tensors or a dict by name.

    ``inputs`` feed the input tensors by name; ``state`` overrides the initial
    value of parameters and state by name; ``writes`` and ``computed_first`` as a
    :class:`Program` takes them (a plan's: ``plan.program.writes``, ``plan.program.computed_first``).
    """
    program = Program(named_outputs(outputs), writes, name="reference", computed_first=computed_first)
    inputs = dict(inputs or {})
    overrides = dict(state or {})
    env: dict[Any, Array] = {}
    for t in program.inputs:
        if t.name not in inputs:
            raise BindingError(f"reference evaluation: no value for input {t.name!r}")
        env[t.node] = _host_value(inputs[t.name], t)
    for t in program.persistent:
        env[t.node] = _host_value(overrides.get(t.name, t.init), t)
    result = run_reference([program.compiled_comp()], env)
    outs = {name: result[t.node] for name, t in program.outputs.items()}
    persistent = {t.name: result[t.node] for t in program.persistent}
    return outs, persistent
