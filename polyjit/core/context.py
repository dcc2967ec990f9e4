"""Contexts: the buffers of nodes on one device, and the stream their work runs on.

A context maps nodes to buffers on one device and names the stream its work runs
on. It never changes after it is made: linking returns a child context that adds
the new buffers. The pools a context creates are released by ``finalize()``, by
``with``, or when the garbage collector takes it (a child holds its parent, so a
context is collected only when no child uses its pools); the device frees them once
their last work is done.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from polyjit.core import interop, slab
from polyjit.core.codegen import KernelSpec
from polyjit.core.errors import (
    FinalizedError,
    InvalidArgumentError,
    InvalidProgramError,
    MergeBufferMismatchError,
    NodeNotInContextError,
    ReadOnlyNodeError,
    UnknownDeviceError,
)
from polyjit.core.interop import Exported
from polyjit.core.ir import MemoryMode, Node
from polyjit.core.lower import LoweredComp
from polyjit.core.routine import Code, CodeBatch, Routine, check_host_array, check_writable
from polyjit.core.slab import BufferLoc
from polyjit.core.streams import AllOf, Event, Stream, enqueue

if TYPE_CHECKING:
    from polyjit.core.device import Device


class Context:
    """Buffers of nodes on one device, and the stream that work on them runs on."""

    def __init__(
        self,
        device: Device,
        stream: Stream,
        parent: Context | None,
        buffers: Mapping[Node, BufferLoc],
        merge_node: Node | None,
        own_pools: Sequence[int],
        own_constants: Sequence[BufferLoc] = (),
        read_only: frozenset[Node] = frozenset(),
    ) -> None:
        self.device = device
        self.stream = stream
        self.parent = parent
        self.buffers: Mapping[Node, BufferLoc] = MappingProxyType(dict(buffers))
        self.merge_node = merge_node
        # nodes no write may reach: the device's constants (shared by every context of the
        # device) and read-only memory taken through DLPack (another library's)
        self.read_only = read_only
        self._own_pools = tuple(own_pools)
        self._own_constants = tuple(own_constants)
        self._children: weakref.WeakSet[Context] = weakref.WeakSet()
        self.finalized = False
        self._release: weakref.finalize | None = None
        if own_pools or own_constants:  # the garbage collector's way to give them back
            handles = tuple(device.pool_handle(pid) for pid in self._own_pools)
            self._release = weakref.finalize(self, _context_dropped, weakref.ref(device), device.driver,
                                             device.ordinal, self._own_pools, handles, self._own_constants,
                                             device.backend.stream_handles)
            # Not at exit: a context still referenced keeps its pools until its device closes (an
            # exit hook or a daemon thread that uses it gets StreamClosedError, not freed pools).
            self._release.atexit = False
        if parent is not None:
            with device.lock:
                if parent.finalized:  # finalized after the caller's check: this child is born dead
                    self.finalized = True
                    if self._release is not None and self._release.detach() is not None:
                        device.release(self._own_pools, self._own_constants)  # what was made for it
                    parent.check_alive()  # FinalizedError naming the parent
                parent._children.add(self)

    def __repr__(self) -> str:
        return f"Context({self.device.device_id}, {len(self.buffers)} buffers{', finalized' if self.finalized else ''})"

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finalize()

    def _child(self, buffers: Mapping[Node, BufferLoc], *, merge_node: Node | None = None,
               own_pools: Sequence[int] = (), own_constants: Sequence[BufferLoc] = (),
               read_only: frozenset[Node] = frozenset(), stream: Stream | None = None) -> Context:
        # a node given a new buffer here is read-only as that buffer is, whatever its old one was
        return Context(self.device, stream or self.stream, self, {**self.buffers, **buffers},
                       merge_node if merge_node is not None else self.merge_node, own_pools,
                       own_constants, self.read_only.difference(buffers) | read_only)

    def check_alive(self) -> None:
        if self.finalized:
            raise FinalizedError(f"{self!r} was finalized (or an ancestor was); link into a live context")
        if self.stream.closed:
            self.stream.check_usable()

    def loc(self, node: Node, what: str = "") -> BufferLoc:
        if not isinstance(node, Node):
            raise InvalidArgumentError(f"{what or 'a context lookup'} needs a Node, got {type(node).__name__}")
        loc = self.buffers.get(node)
        if loc is None:
            raise NodeNotInContextError(_missing(node, self, what))
        return loc

    def why_read_only(self, node: Node) -> str:
        if any(self.buffers[node] == loc for loc in self._all_constants()):
            return "a constant, shared by every context of the device"
        return "memory taken through DLPack that its producer marked read-only"

    def _all_constants(self) -> list[BufferLoc]:
        out: list[BufferLoc] = []
        ctx: Context | None = self
        while ctx is not None:
            out += ctx._own_constants
            ctx = ctx.parent
        return out

    def writable_loc(self, node: Node, what: str) -> BufferLoc:
        loc = self.loc(node, what)
        if node in self.read_only:
            raise ReadOnlyNodeError(f"{what}: {node.label} is read-only on {self.device.device_id} "
                                    f"({self.why_read_only(node)})")
        return loc

    def with_stream(self, stream: Stream) -> Context:
        """A child context with the same buffers whose work runs on another stream of the device."""
        self.check_alive()
        if not isinstance(stream, Stream) or stream.device is not self.device:
            raise UnknownDeviceError(f"{stream!r} is not a stream of {self.device.device_id}")
        stream.check_usable()
        return self._child({}, stream=stream)

    # -- linking ------------------------------------------------------------------

    def link(self, code: Code) -> Routine:
        if isinstance(code, CodeBatch):
            raise InvalidArgumentError(
                "Context.link takes one Code (Backend.compile); for a CodeBatch use link_batch, "
                "which returns a routine per computation")
        if not isinstance(code, Code):
            raise InvalidArgumentError(f"Context.link takes a Code from Backend.compile, not {type(code).__name__}")
        return self.link_batch(code.batch)[code.index]

    def link_batch(self, batch: CodeBatch) -> list[Routine]:
        if not isinstance(batch, CodeBatch):
            raise InvalidArgumentError(
                f"Context.link_batch takes a CodeBatch from Backend.compile_batch, not {type(batch).__name__}")
        self.check_alive()
        dev = self.device
        if batch.backend is not dev.backend:
            other = " (another instance of it: one made before os.fork()?)" if batch.backend.name == dev.backend.name else ""
            raise InvalidProgramError(
                f"code compiled by the {batch.backend.name} backend{other} cannot be linked on {dev.device_id}: "
                f"compile it with {dev.device_id}'s backend"
            )
        comps = batch.lowered.comps
        self._check_link(comps, batch.lowered.modes)
        new_nodes, requests = _plan_requests(comps, batch.source.kernels, self.buffers, dev.info.base_alignment)
        plan = slab.plan(requests, dev.info.base_alignment)
        with dev.lock:
            self.check_alive()  # again, under the lock: a finalize() in between freed the pools the routines bind
            pools: list[int] = []
            constants: list[BufferLoc] = []
            try:
                buffers: dict[Node, BufferLoc] = {}
                if plan.nbytes:
                    pid = dev.new_pool(plan.nbytes)
                    pools.append(pid)
                    buffers.update({n: BufferLoc(pid, plan.offsets[n]) for n in new_nodes})
                    # New nodes start at zero, as the reference's do: one written at only some
                    # cells (a slice, a row, an empty space, a user's kernel) must not show what
                    # the memory held before (pools are reused: another context's data). Once
                    # per link; nodes written whole are left alone.
                    partial = {n for comp in comps for n in comp.partial} & set(new_nodes)
                    for n in sorted(partial, key=lambda n: plan.offsets[n]):
                        dev.memset_zero(pid, plan.offsets[n], n.nbytes, self.stream, f"zeroing new {n.label}")
                const_nodes = set()
                for comp in comps:
                    for node, values in comp.constants:
                        if node not in self.buffers and node not in buffers:
                            buffers[node] = dev.acquire_constant(values)
                            constants.append(buffers[node])
                            const_nodes.add(node)
                module = dev.module(batch.binary)
            except BaseException:
                dev.release(pools, constants)
                raise
            persistent = {n: loc for n, loc in buffers.items() if batch.lowered.modes.get(n) is not MemoryMode.LOCAL}
            scratch = {n: loc for n, loc in buffers.items() if n not in persistent}
            child = self._child(persistent, own_pools=pools, own_constants=constants,
                                read_only=frozenset(const_nodes))
            every = {**child.buffers, **scratch}
            try:
                return [Routine(child, batch, k, module, every) for k in range(len(comps))]
            except BaseException:
                child.finalize()  # a failed prepare: give the new pools back now
                raise

    def _check_link(self, comps: Sequence[LoweredComp], modes: Mapping[Node, MemoryMode]) -> None:
        # nodes the batch never stores: a context that holds one would show a stale value
        never_stored = {n: f"inlines {n.label} into its reader (VIRTUAL)"
                        for n, m in modes.items() if m is MemoryMode.VIRTUAL}
        never_stored |= {n: f"keeps {n.label} inside a kernel (a sum only the elementwise work fused "
                            f"after it reads: LOCAL scratch)" for c in comps for k in c.kernels for n in k.private}
        for node, how in never_stored.items():
            if node in self.buffers:
                raise InvalidProgramError(
                    f"the batch {how}, never storing it, but this context on {self.device.device_id} "
                    f"holds {node.label}, whose buffer would then not change; mark it ON_DEVICE or "
                    f"MATERIALIZED to keep its value")
        written: set[Node] = set()
        for comp in comps:
            for node in comp.inputs:
                if node not in self.buffers and node not in written:
                    raise NodeNotInContextError(_missing(node, self, f"computation {comp.name} reads it"))
            for node in comp.zeroed:
                if node in self.buffers:
                    raise InvalidProgramError(
                        f"computation {comp.name} keeps {node.label} as scratch that starts at zero (written "
                        f"at some cells, then read), but this context on {self.device.device_id} holds "
                        f"{node.label}, whose other cells would be lost; mark it ON_DEVICE or MATERIALIZED "
                        f"to keep its value")
            for node in (*comp.outputs, *comp.scratch):
                if node in self.read_only:
                    raise ReadOnlyNodeError(
                        f"computation {comp.name} writes {node.label}, read-only on {self.device.device_id} "
                        f"({self.why_read_only(node)})")
            if comp.merge_input is not None and comp.merge_input is not self.merge_node:
                held = self.merge_node.label if self.merge_node else "nothing"
                raise MergeBufferMismatchError(
                    f"computation {comp.name} reads {comp.merge_input.label} from the merge buffer, "
                    f"but in this context on {self.device.device_id} the merge buffer holds {held}; "
                    f"link against the context of device_to_device(..., into_merge_buffer=COPY)"
                )
            written.update(comp.outputs)
            written.update(comp.scratch)

    # -- host transfers ----------------------------------------------------------

    def from_host(self, node: Node, array: np.ndarray) -> bool:
        """Enqueue a copy of ``array`` into the node's buffer; returns False if the node has none.

        Like pyopencl's non-blocking copies: the runtime keeps the array alive until the copy
        is done; do not modify it before the stream gets past this point.
        """
        self.check_alive()
        check_host_array(node, array, "from_host")
        if node not in self.buffers:
            return False
        loc = self.writable_loc(node, "from_host")
        src = np.ascontiguousarray(array)
        dev = self.device
        with dev.lock:
            self.check_alive()  # again, under the lock: a finalize() in between freed the pool
            enqueue(self.stream, (), (dev.tracker.state(loc),), "from_host", dev.driver.copy_from_host,
                    (self.stream.handle, dev.pool_handle(loc.pool_id), loc.offset, src), src)
        return True

    def to_host(self, node: Node, array: np.ndarray, *, blocking: bool = True) -> bool:
        """Copy the node's buffer into ``array``; returns False if the node has none.

        ``blocking=False`` (like pyopencl's ``is_blocking=False``) only enqueues the copy:
        ``array`` holds the value once the stream gets past this point
        (``stream.synchronize()``), which lets a caller fetch several outputs with one wait.
        """
        self.check_alive()
        check_host_array(node, array, "to_host")
        loc = self.buffers.get(node)
        if loc is None:
            return False
        check_writable(node, array, "to_host")
        dev = self.device
        with dev.lock:
            self.check_alive()  # again, under the lock: a finalize() in between freed the pool
            ev = enqueue(self.stream, (dev.tracker.state(loc),), (), "to_host", dev.driver.copy_to_host,
                         (self.stream.handle, dev.pool_handle(loc.pool_id), loc.offset, array), array)
        if blocking:
            ev.synchronize()
        return True

    def read(self, node: Node) -> np.ndarray:
        """A new numpy array with the node's value (blocking)."""
        self.check_alive()
        if not isinstance(node, Node):
            raise InvalidArgumentError(f"read needs a Node, got {type(node).__name__}")
        out = np.empty(node.shape, node.dtype.np)
        if not self.to_host(node, out):
            raise NodeNotInContextError(_missing(node, self, "read"))
        return out

    def init_from_host(self, node: Node, array: np.ndarray) -> Context:
        """A child context with a new buffer for ``node``, filled from ``array``."""
        self.check_alive()
        check_host_array(node, array, "init_from_host")
        child = self._with_new_buffer(node)
        child.from_host(node, array)
        return child

    def _with_new_buffer(self, node: Node) -> Context:
        pid = self.device.new_pool(node.nbytes)
        return self._child({node: BufferLoc(pid, 0)}, own_pools=[pid])

    def memory_stats(self) -> dict[str, int]:
        """Bytes of the pools this context created, and with its live descendants'."""
        dev = self.device
        with dev.lock:
            sizes = {pid: n for pid, (_, n) in dev._pools.items()}
            own = sum(sizes.get(pid, 0) for pid in self._own_pools)
            stack, total, seen = [self], 0, set()
            while stack:
                ctx = stack.pop()
                if id(ctx) in seen:
                    continue
                seen.add(id(ctx))
                total += sum(sizes.get(pid, 0) for pid in ctx._own_pools)
                stack.extend(ctx._children)
        return {"own_bytes": own, "with_descendants_bytes": total, "buffers": len(self.buffers)}

    def export(self, node: Node) -> Exported:
        """The node's buffer for other libraries, zero-copy: ``np.from_dlpack``,
        ``torch.from_dlpack``, CuPy (DLPack; ``__cuda_array_interface__`` on CUDA). See
        ``core/interop.py`` for the ordering it promises."""
        return interop.export(self, node)

    def host_view(self, node: Node, *, write: bool = False) -> contextlib.AbstractContextManager[np.ndarray]:
        """``with ctx.host_view(node, write=True) as values:``: the node's values on the host,
        ordered by the per-node events (zero-copy on the cpu backend; see core/interop.py)."""
        return interop.host_view(self, node, write=write)

    def init_from_dlpack(self, node: Node, obj: Any) -> Context:
        """A child context whose buffer for ``node`` is another library's tensor (any DLPack
        producer): zero-copy where device, layout and alignment allow, else a copy of a host
        tensor, else a typed error."""
        return interop.init_from_dlpack(self, node, obj)

    def will_wait_for(self, event: Event | AllOf) -> None:
        """Make this context's stream wait (device side) for an event."""
        self.check_alive()
        self.stream.wait(event)

    def finalize(self) -> None:
        """Free the pools this context created; it and its descendants become unusable.

        The descendants' own pools are freed too (nothing can use them any more); the
        ancestors' pools are not. Work already enqueued on them completes first: the device
        frees each pool once its last work is done.
        """
        dev = self.device
        with dev.lock:
            if self.finalized:
                return
            doomed: list[Context] = []
            stack: list[Context] = [self]
            while stack:
                ctx = stack.pop()
                if ctx.finalized:
                    continue
                ctx.finalized = True
                doomed.append(ctx)
                stack.extend(ctx._children)
            for ctx in reversed(doomed):  # descendants first
                if ctx._release is not None and ctx._release.detach() is not None:
                    dev.release(ctx._own_pools, ctx._own_constants)


def _context_dropped(device: weakref.ref[Device], driver: Any, ordinal: int, pools: tuple[int, ...],
                     handles: tuple[Any, ...], constants: tuple[BufferLoc, ...], streams: set[Any]) -> None:
    """The garbage collector took a context: its device gives its pools back at its next safe
    point. (The finalizer holds the device weakly: finalizers are roots, and a strong reference
    would keep a dropped device, and its streams, alive for ever.) If the device is gone too,
    its streams were closed after their work: free the pools now."""
    dev = device()
    if dev is not None:
        dev.release_later(_Release(dev, pools, constants))  # a pool a view pins waits for its unpin
        return
    # The device is garbage in the same cycle, its streams not closed yet (their finalizers
    # run after this): a driver that can frees once its backend's streams (any device's: a copy
    # on one reads another's pools) are (free_when_idle). No view pins these pools: a view
    # holds its device.
    idle = getattr(driver, "free_when_idle", None)
    for handle in handles:
        with contextlib.suppress(Exception):  # at interpreter exit, say
            if idle is not None:
                idle(ordinal, handle, frozenset(streams))
            else:
                driver.free(ordinal, handle)


class _Release:
    """What a garbage-collected context gives back, run at its device's next safe point."""

    __slots__ = ("constants", "device", "pools")

    def __init__(self, device: Device, pools: tuple[int, ...], constants: tuple[BufferLoc, ...]) -> None:
        self.device, self.pools, self.constants = device, pools, constants

    def __call__(self) -> None:
        self.device.release(self.pools, self.constants)


def _missing(node: Node, ctx: Context, what: str) -> str:
    mode = f" (it is {node.mode.value})" if node.mode else ""
    suffix = f": {what}" if what else ""
    return f"{node.label} {node.shape} {node.dtype} has no buffer in {ctx!r}{mode}{suffix}"


def _plan_requests(
    comps: Sequence[LoweredComp], specs: Sequence[Sequence[KernelSpec]], existing: Mapping[Node, BufferLoc],
    base_alignment: int
) -> tuple[list[Node], list[slab.Request]]:
    """Lifetimes (in kernel positions over the batch) of the nodes a link must allocate:
    persistent results live for the whole batch, scratch from its first to its last kernel.
    The kernels' specs (one tuple per computation) say what each kernel reads and writes,
    for generated kernels and users' own alike."""
    first: dict[Node, int] = {}
    last: dict[Node, int] = {}
    pos = 0
    for comp_specs in specs:
        for spec in comp_specs:
            for n in spec.buffers:
                first.setdefault(n, pos)
                last[n] = pos
            pos += 1
    end = max(pos - 1, 0)
    # Constants (written by no kernel) live in the device's constant table, not in the pool.
    computed = {n for comp_specs in specs for spec in comp_specs for n in spec.outputs}
    constants = {n for comp in comps for n, _ in comp.constants if n not in computed}
    new: list[Node] = []
    requests: list[slab.Request] = []
    for comp in comps:
        for n in (*comp.outputs, *comp.scratch):
            if n in existing or n in new or n in constants:
                continue
            new.append(n)
            scratch = n in comp.scratch
            lo, hi = (first.get(n, 0), last.get(n, 0)) if scratch else (0, end)
            requests.append(slab.Request(n, n.nbytes, max(n.dtype.itemsize, base_alignment), lo, hi))
    return new, requests


# ---------------------------------------------------------------------------
# Routines
