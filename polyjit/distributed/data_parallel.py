"""The step between the ranks of a hierarchical data parallel (``polyjit.tensor.data_parallel``
with ``comm=``): one all-reduce of a rank's packed gradients, on replica 0's context.

- a :class:`~polyjit.distributed.Comm` (or an mpi4py communicator, wrapped in one): MPI,
  ``Comm.all_reduce`` ordered by the node's events on the host; on the host paths the
  reduced buffer is peeked at for the global loss it carries;
- a :class:`~polyjit.distributed.nccl.NcclComm` (CUDA replicas, one GPU per rank): NCCL on
  replica 0's stream, ordered on the device; its Comm carries the set-up checks and the loss.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from polyjit.core.context import Context
from polyjit.core.errors import InvalidArgumentError
from polyjit.core.ir import Node
from polyjit.distributed.comm import Comm

Array = np.ndarray[Any, Any]


# The names of the live data parallels that all-reduce over each Comm: the calls' headers tell
# them apart by node name, which the name makes (found by review: two models on one Comm,
# stepped from two threads, summed each other's gradients without an error). Re-entrant: a
# dropped data parallel's finalizer may run inside a claim, on its thread.
_names_on: weakref.WeakKeyDictionary[Comm, set[str]] = weakref.WeakKeyDictionary()
_names_lock = threading.RLock()


def _release_name(comm: Comm, name: str) -> None:
    with _names_lock:
        _names_on.get(comm, set()).discard(name)


class RankReduce:
    """``RankReduce(comm)(ctx, node, peek)``: sum ``node`` over the ranks, in place."""

    def __init__(self, comm: Any) -> None:
        from polyjit.distributed.nccl import NcclComm

        self.nccl: NcclComm | None = comm if isinstance(comm, NcclComm) else None
        self.owned = False  # a Comm made here from an mpi4py communicator: close() frees it
        if self.nccl is not None:
            self.comm = self.nccl.comm
        elif isinstance(comm, Comm):
            self.comm = comm
        else:
            self.comm, self.owned = Comm(comm), True
        self._release: weakref.finalize[..., Any] | None = None

    def claim(self, owner: object, name: str) -> InvalidArgumentError | None:
        """Take ``name`` among the data parallels over this Comm for ``owner`` (given back by
        close(), or when ``owner`` is collected); the refusal where another live one has it
        (raised by the caller through the set-up check: every rank fails together)."""
        with _names_lock:
            taken = _names_on.setdefault(self.comm, set())
            if name in taken:
                return InvalidArgumentError(
                    f"data_parallel {name!r}: another live data_parallel of that name all-reduces over "
                    f"{self.comm!r}: give each model over one Comm its own name= (the same on every rank)")
            taken.add(name)
        self._release = weakref.finalize(owner, _release_name, self.comm, name)
        return None

    def close(self) -> None:
        """Give the name back, and free the Comm made here (collective, as closing the data
        parallel is); a Comm the caller passed stays theirs."""
        if self._release is not None:
            self._release()
        if self.owned:
            self.comm.free()

    def __call__(self, ctx: Context, node: Node, peek: Callable[[Array], None] | None = None) -> None:
        if self.nccl is not None:
            self.nccl.all_reduce(ctx, node, "sum")
        else:
            self.comm.all_reduce(ctx, node, "sum", peek=peek)
