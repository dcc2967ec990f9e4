"""Ordering the collectives by the per-node events, on the public Context API where it has
what is needed, and on the device's event records where it does not (the CUDA-aware and
NCCL paths; see docs/distributed.md, "What the runtime should offer").

- host paths (cpu, staged): ``ctx.host_view(node, write=...)`` waits for the node's writer
  (and, to write, its readers) and gives its values, zero-copy on the cpu backend;
- CUDA-aware MPI: :func:`wait_on_host` waits the same way, then MPI reads or writes the
  device memory behind ``ctx.export(node)``; the host returns only once MPI is done with it,
  so the routines enqueued after it are ordered by the host;
- NCCL: :func:`node_events` gives the event records that ``polyjit.core.streams.enqueue``
  orders device-side work by, so NCCL's kernels wait on the stream, never on the host.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from polyjit.core import ir

if TYPE_CHECKING:
    from polyjit.core.context import Context
    from polyjit.core.routine import Routine
    from polyjit.core.streams import NodeEvents


def wait_on_host(ctx: Context, node: ir.Node, *, write: bool) -> None:
    """Block until the node's last writer is done (and, with ``write``, its readers): what
    ``host_view`` waits for, without the view."""
    ctx.check_alive()
    loc = ctx.loc(node, "a collective")
    device = ctx.device
    with device.lock:
        st = device.tracker.locs.get(loc)
        waits = [] if st is None else st.events() if write else [st.writer] if st.writer else []
    for ev in waits:
        ev.synchronize()


def node_events(ctx: Context, node: ir.Node, what: str) -> NodeEvents:
    """The event record of the node's buffer (for ``polyjit.core.streams.enqueue``)."""
    ctx.check_alive()
    loc = ctx.loc(node, what)
    device = ctx.device
    with device.lock:
        return device.tracker.state(loc)


# (context, node id, divisor) -> the linked routine ``node = node / divisor``
_scalers: weakref.WeakKeyDictionary[Context, dict[tuple[int, int], Routine]] = weakref.WeakKeyDictionary()


def divide_in_place(ctx: Context, node: ir.Node, divisor: int) -> None:
    """Enqueue ``node /= divisor`` on the context's stream (a linked routine, cached): the
    "mean" of a collective whose result is in device memory."""
    per_ctx = _scalers.setdefault(ctx, {})
    routine = per_ctx.get((node.id, divisor))
    if routine is None:
        backend: Any = ctx.device.backend
        comp = ir.Comp.of(ir.apply(ir.Op.DIV, node, float(divisor), into=node), embedded=[node])
        routine = ctx.link(backend.compile(comp, name=f"mean_{node.name}"))
        per_ctx[(node.id, divisor)] = routine
    routine.run()
