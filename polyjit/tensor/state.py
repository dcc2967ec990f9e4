"""The persistent state of a compiled program on one device: what a Plan and each replica of
a DataParallel keep alike.

A :class:`StateContext` is a chain of contexts holding the parameters, the optimizer state
and the input staging buffers, made one buffer at a time; the program's routines are linked
as its child. It reads, resets, loads and frees that state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from polyjit.core import ir
from polyjit.core.context import Context
from polyjit.core.device import Device
from polyjit.core.errors import InvalidArgumentError, StateDictKeyError
from polyjit.tensor.hostio import convert_into
from polyjit.tensor.tensor import Kind, Tensor

Array = np.ndarray[Any, Any]


class StateContext:
    """Persistent buffers on one device, in a context that grows one buffer at a time (or in
    another state's context: ``share``, whose buffers are reused, not copied)."""

    def __init__(self, device: Device, share: Context | None = None) -> None:
        self.device = device
        self.context: Context = share if share is not None else device.make_context()
        self._owned: list[Context] = []

    def add(self, node: ir.Node, value: Array) -> None:
        """A buffer for ``node`` holding ``value``, unless the context has one already."""
        if node not in self.context.buffers:
            self.context = self.context.init_from_host(node, value)
            self._owned.append(self.context)

    def state_dict(self, persistent: Sequence[Tensor]) -> dict[str, Array]:
        """Copies of the persistent buffers, by name."""
        return {t.name: self.context.read(t.node) for t in persistent}

    def reset(self, persistent: Sequence[Tensor]) -> None:
        """Every persistent buffer back to its initial value."""
        for t in persistent:
            assert t.init is not None
            self.context.from_host(t.node, t.init)

    def load_state_dict(self, persistent: Sequence[Tensor], values: Mapping[str, Any], strict: bool,
                        owner: str) -> None:
        """Set persistent buffers from arrays by name (what ``state_dict()`` gives). Every entry
        is checked before anything is written: the shape must be the tensor's, the values must
        convert to its dtype the way inputs do, and with ``strict`` the names must be exactly
        the program's; without it, unknown and missing names are skipped."""
        self.context.check_alive()  # a closed plan says so, before what the dict lacks
        self.write(stage_state(persistent, values, strict, owner))

    def write(self, staged: Sequence[tuple[Tensor, Array]]) -> None:
        """Copy checked host arrays (:func:`stage_state`) into their buffers, after the work
        queued before and waiting for the copies."""
        self.context.check_alive()
        self.context.stream.synchronize()
        for t, arr in staged:
            self.context.from_host(t.node, arr)
        self.context.stream.synchronize()

    def close(self) -> None:
        """Free the buffers this state made (states sharing them become unusable)."""
        for ctx in reversed(self._owned):
            ctx.finalize()
        self._owned.clear()


def stage_state(persistent: Sequence[Tensor], values: Mapping[str, Any], strict: bool,
                owner: str) -> list[tuple[Tensor, Array]]:
    """The checked host arrays of a load_state_dict (nothing is written when one is refused)."""
    if not isinstance(values, Mapping):
        raise InvalidArgumentError(f"load_state_dict takes a mapping of names to arrays (what state_dict() "
                                f"gives), not {type(values).__name__}")
    by_name = {t.name: t for t in persistent}
    if strict:
        unknown = sorted(k for k in values if k not in by_name)
        missing = sorted(k for k in by_name if k not in values)
        if unknown or missing:
            parts = ([f"unknown {', '.join(map(repr, unknown))}"] if unknown else []) + (
                [f"missing {', '.join(map(repr, missing))}"] if missing else [])
            have = ", ".join(sorted(by_name)) or "no state"
            raise StateDictKeyError(f"load_state_dict: {'; '.join(parts)} ({owner} has {have}; "
                                    "strict=False skips them)")
    staged = []
    for name, value in values.items():
        t = by_name.get(name)
        if t is None:
            continue
        arr = np.empty(t.shape, t.dtype.np)
        convert_into(arr, value, f"{'parameter' if t.kind is Kind.PARAM else 'state'} {name!r}")
        staged.append((t, arr))
    return staged
