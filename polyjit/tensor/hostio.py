"""Host staging for plans: feeding inputs and fetching outputs without allocating per run.

A pipelined run enqueues its device-to-host copies (``to_host(...,
blocking=False)``) and waits once at the end.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from polyjit.core.errors import (
    BindingError,
    DTypeMismatchError,
    NodeNotInContextError,
    ShapeMismatchError,
)
from polyjit.core.ir import Node
from polyjit.core.runtime import Context

Array = np.ndarray[Any, Any]


def enqueue_to_host(ctx: Context, node: Node, array: Array) -> None:
    """Enqueue a copy of the node's buffer into ``array`` on the context's stream; no wait.

    The array must stay untouched until the stream has passed this point
    (``ctx.stream.synchronize()``).
    """
    if not ctx.to_host(node, array, blocking=False):
        raise NodeNotInContextError(f"{node.label} has no buffer in {ctx!r}")


class Feed:
    """One input of a plan: its node and a staging array used when the caller's array cannot be
    handed to the device as it is (wrong dtype, not contiguous, a list)."""

    __slots__ = ("name", "node", "staging")

    def __init__(self, name: str, node: Node) -> None:
        self.name = name
        self.node = node
        self.staging = np.zeros(node.shape, node.dtype.np)

    def host_array(self, value: Any, staging: Array | None = None) -> Array:
        """The array to copy from: the caller's own when it fits, else the staging array."""
        if (type(value) is np.ndarray and value.dtype == self.staging.dtype
                and value.flags.c_contiguous and value.shape == self.staging.shape):
            return value
        target = self.staging if staging is None else staging
        if np.shape(value) != target.shape:
            raise ShapeMismatchError(f"input {self.name!r}: got shape {np.shape(value)}, expected {target.shape}")
        try:
            np.copyto(target, value, casting="same_kind")
        except TypeError as e:
            raise DTypeMismatchError(f"input {self.name!r}: {e}") from None
        return target


def check_names(given: Mapping[str, Any], expected: frozenset[str], what: str) -> None:
    if given.keys() != expected:
        missing = sorted(expected - given.keys())
        extra = sorted(given.keys() - expected)
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"unknown {', '.join(extra)}"] if extra else [])
        raise BindingError(f"{what}: {'; '.join(parts)} (inputs: {', '.join(sorted(expected))})")
