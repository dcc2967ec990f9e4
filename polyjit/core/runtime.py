"""The generic runtime: raises a backend's ``Driver`` into the full Backend / Device / Stream /
Event / Context / Routine objects.

Everything a backend would otherwise write again lives here: contexts and
linking, the slab pools, per-node writer/reader events, merge buffers,
device_to_device (staged through the host between backends), host transfers.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attrs
import numpy as np

from polyjit.alloc import slab
from polyjit.alloc.slab import MERGE_POOL, BufferLoc
from polyjit.core import ir
from polyjit.core.codegen import KernelSpec, Source, generate
from polyjit.core.errors import (
    BindingError,
    DTypeMismatchError,
    FinalizedError,
    InvalidProgramError,
    MergeBufferMismatchError,
    NodeNotInContextError,
    PoolExhaustedError,
    ShapeMismatchError,
    UnknownDeviceError,
)
from polyjit.core.ir import MemoryMode, Node, StaticSymbol
from polyjit.core.lower import LoweredBatch, LoweredComp, lower
from polyjit.core.protocol import DeviceInfo, Driver, MergeBuffer

# ---------------------------------------------------------------------------
# Events and streams


class Event:
    """A point in a stream's work. ``sync()`` blocks the host; ``is_done()`` polls."""

    __slots__ = ("handle", "stream")

    def __init__(self, stream: Stream, handle: Any) -> None:
        self.stream = stream
        self.handle = handle

    def sync(self) -> None:
        self.stream.driver.event_sync(self.handle)

    def is_done(self) -> bool:
        return self.stream.driver.event_done(self.handle)

    def __repr__(self) -> str:
        return f"Event({self.stream!r})"


class AllOf:
    """Several events as one (``Device.all_work()``)."""

    def __init__(self, events: Sequence[Event]) -> None:
        self.events = tuple(events)

    def sync(self) -> None:
        for e in self.events:
            e.sync()

    def is_done(self) -> bool:
        return all(e.is_done() for e in self.events)


class Stream:
    """An in-order queue on one device."""

    def __init__(self, device: Device, handle: Any, index: int) -> None:
        self.device = device
        self.driver: Driver = device.driver
        self.handle = handle
        self.index = index

    def record(self) -> Event:
        return Event(self, self.driver.record(self.handle))

    def wait(self, event: Event | AllOf) -> None:
        """Make this stream wait for ``event`` on the device side; events of another backend
        are waited for on the host."""
        if isinstance(event, AllOf):
            for e in event.events:
                self.wait(e)
        elif event.stream is self:
            return
        elif event.stream.driver is self.driver:
            self.driver.wait(self.handle, event.handle)
        else:
            event.sync()

    def synchronize(self) -> None:
        self.record().sync()

    def __repr__(self) -> str:
        return f"Stream({self.device.device_id}, #{self.index})"


def _wait_unless_done(stream: Stream, event: Event | None) -> None:
    if event is not None and event.stream is not stream and not event.is_done():
        stream.wait(event)


class _NodeEvents:
    """The last writer of one buffer and its readers since (the latest per stream)."""

    __slots__ = ("readers", "writer")

    def __init__(self) -> None:
        self.writer: Event | None = None
        self.readers: dict[Stream, Event] = {}

    def wait_for_write(self, stream: Stream) -> None:
        """Before ``stream`` writes: the last writer and every reader since must be done."""
        _wait_unless_done(stream, self.writer)
        for s, ev in self.readers.items():
            if s is not stream:
                _wait_unless_done(stream, ev)

    def events(self) -> list[Event]:
        return ([self.writer] if self.writer else []) + list(self.readers.values())


class Tracker:
    """Per device: the events of every buffer location, so that routines on different streams
    and devices wait for each other on the device side, never on the host."""

    def __init__(self) -> None:
        self.locs: dict[BufferLoc, _NodeEvents] = {}

    def state(self, loc: BufferLoc) -> _NodeEvents:
        st = self.locs.get(loc)
        if st is None:
            st = self.locs[loc] = _NodeEvents()
        return st

    def before_read(self, loc: BufferLoc, stream: Stream) -> None:
        st = self.locs.get(loc)
        if st is not None:
            _wait_unless_done(stream, st.writer)

    def before_write(self, loc: BufferLoc, stream: Stream) -> None:
        st = self.locs.get(loc)
        if st is not None:
            st.wait_for_write(stream)

    def after_read(self, loc: BufferLoc, event: Event) -> None:
        self.state(loc).readers[event.stream] = event

    def after_write(self, loc: BufferLoc, event: Event) -> None:
        st = self.state(loc)
        st.writer = event
        if st.readers:
            st.readers = {}

    def states(self, locs: Sequence[BufferLoc]) -> tuple[_NodeEvents, ...]:
        """The event records of some buffers, resolved once (at link or capture time) so that
        each launch touches them without hashing."""
        return tuple(self.state(loc) for loc in locs)

    @staticmethod
    def ordered(stream: Stream, reads: Sequence[_NodeEvents], writes: Sequence[_NodeEvents],
                enqueue: Callable[..., None], *args: Any) -> Event:
        """Enqueue ``enqueue(*args)`` on ``stream`` after the device-side waits its buffers need,
        and record it as their new reader / writer. Every launch path (routines, graph replays)
        goes through here."""
        for st in reads:
            _wait_unless_done(stream, st.writer)
        for st in writes:
            st.wait_for_write(stream)
        enqueue(*args)
        ev = Event(stream, stream.driver.record(stream.handle))
        for st in reads:
            st.readers[stream] = ev
        for st in writes:
            st.writer = ev
            if st.readers:
                st.readers = {}
        return ev

    def drain_pool(self, pool_id: int) -> None:
        """Wait on the host for all work touching a pool, then forget it. The merge pool's records
        stay (emptied): routines hold them across the merge buffer's moves."""
        for loc in [loc for loc in self.locs if loc.pool_id == pool_id]:
            st = self.locs[loc] if pool_id == MERGE_POOL else self.locs.pop(loc)
            for ev in st.events():
                ev.sync()
            st.writer, st.readers = None, {}


# ---------------------------------------------------------------------------
# Compiled code


@attrs.frozen(eq=False)
class CodeBatch:
    """A compiled batch: one source, one binary, one entry per computation."""

    backend: Backend
    lowered: LoweredBatch
    source: Source
    binary: Any
    names: tuple[str, ...]
    bindings: tuple[Mapping[StaticSymbol, int], ...]

    def __len__(self) -> int:
        return len(self.names)


@attrs.frozen(eq=False)
class Code:
    """One computation of a compiled batch (what ``Backend.compile`` returns)."""

    batch: CodeBatch
    index: int = 0

    @property
    def name(self) -> str:
        return self.batch.names[self.index]

    @property
    def source(self) -> str:
        return self.batch.source.text


_IDENT = re.compile(r"[^A-Za-z0-9_]")


def _c_name(name: str, taken: set[str]) -> str:
    base = _IDENT.sub("_", name) or "comp"
    if base[0].isdigit():
        base = "k_" + base
    out, k = base, 1
    while out in taken:
        out, k = f"{base}_{k}", k + 1
    taken.add(out)
    return out


# ---------------------------------------------------------------------------
# Backend and devices


class Backend:
    """A backend: its devices and its compiler, over one Driver."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.name: str = driver.name
        self._devices: dict[int, Device] = {}
        self._lock = threading.Lock()

    def num_devices(self) -> int:
        return self.driver.device_count()

    def get_device(self, ordinal: int) -> Device:
        n = self.num_devices()
        if not isinstance(ordinal, (int, np.integer)) or not 0 <= ordinal < n:
            raise UnknownDeviceError(
                f"{self.name} has {n} device(s) (ordinals 0..{n - 1}); there is no device {ordinal!r}"
            )
        with self._lock:
            dev = self._devices.get(int(ordinal))
            if dev is None:
                dev = self._devices[int(ordinal)] = Device(self, int(ordinal))
        return dev

    def devices(self) -> list[Device]:
        return [self.get_device(k) for k in range(self.num_devices())]

    def static_properties(self) -> dict[str, Any]:
        return {"name": self.name, "dialect": self.driver.dialect.name, "num_devices": self.num_devices()}

    def capture(self, routines: Sequence[Routine], *, stream: Stream | None = None) -> Replay:
        """Routines to run again and again as one unit, in this order: ``replay()`` does what
        ``run()`` of each would. Here that is all it does; a backend with something cheaper
        to launch overrides it (CUDA records a graph: ``CudaBackend.capture``). ``stream``:
        where to replay (default: the first routine's context stream)."""
        return Replay(routines, stream)

    def compile(
        self, comp: ir.Comp, name: str | None = None, bindings: Mapping[StaticSymbol, int] | None = None
    ) -> Code:
        batch = self.compile_batch([comp], names=[name or "comp"], bindings=[bindings or {}])
        return Code(batch, 0)

    def compile_batch(
        self,
        comps: Sequence[ir.Comp],
        names: Sequence[str] | None = None,
        occupancy: Callable[[str], bool] | None = None,
        bindings: Sequence[Mapping[StaticSymbol, int]] | None = None,
    ) -> CodeBatch:
        """Compile several computations into one source and one binary.

        ``occupancy(name)`` returning False leaves that computation out (the
        batch keeps the others, in order).
        """
        names = list(names) if names is not None else [f"comp{k}" for k in range(len(comps))]
        if len(names) != len(comps):
            raise InvalidProgramError(f"{len(comps)} computations but {len(names)} names")
        bindings = list(bindings) if bindings is not None else [{} for _ in comps]
        keep = [k for k, n in enumerate(names) if occupancy is None or occupancy(n)]
        taken: set[str] = set()
        c_names = tuple(_c_name(names[k], taken) for k in keep)
        lowered = lower([comps[k] for k in keep], c_names)
        source = generate(lowered, self.driver.dialect)
        binary = self.driver.compile(source)
        return CodeBatch(self, lowered, source, binary, c_names, tuple(dict(bindings[k]) for k in keep))

    def __repr__(self) -> str:
        return f"Backend({self.name})"


@attrs.define
class _MergeState:
    handle: Any = None
    nbytes: int = 0
    node: Node | None = None
    generation: int = 0


class Device:
    """One device of a backend: its pools, streams, per-node events and merge buffer."""

    def __init__(self, backend: Backend, ordinal: int) -> None:
        self.backend = backend
        self.driver: Driver = backend.driver
        self.ordinal = ordinal
        self.info: DeviceInfo = self.driver.device_info(ordinal)
        self.device_id = f"{backend.name}:{ordinal}"
        self.name = self.info.name
        self.properties: Mapping[str, Any] = MappingProxyType(
            {"memory_bytes": self.info.memory_bytes, "compute_units": self.info.compute_units,
             "base_alignment": self.info.base_alignment, **self.info.properties}
        )
        self.tracker = Tracker()
        self.merge = _MergeState()
        self._pools: dict[int, tuple[Any, int]] = {}
        self._pool_ids = slab.PoolIds()
        self._streams: list[Stream] = []
        self._modules: dict[int, tuple[Any, Any]] = {}  # id(binary) -> (binary, module)
        self._constants: dict[bytes, tuple[BufferLoc, int]] = {}  # content key -> (loc, refcount)
        self._lock = threading.RLock()
        self.default_stream = self.new_stream()

    def __repr__(self) -> str:
        return f"Device({self.device_id} {self.name!r})"

    # -- streams ---------------------------------------------------------------

    def new_stream(self) -> Stream:
        with self._lock:
            s = Stream(self, self.driver.new_stream(self.ordinal), len(self._streams))
            self._streams.append(s)
        return s

    def make_context(self, stream: Stream | None = None) -> Context:
        stream = stream or self.default_stream
        if stream.device is not self:
            raise UnknownDeviceError(f"{stream!r} belongs to {stream.device.device_id}, not {self.device_id}")
        return Context(self, stream, None, {}, None, ())

    def all_work(self) -> AllOf:
        return AllOf([s.record() for s in self._streams])

    def synchronize(self) -> None:
        self.all_work().sync()

    def is_idle(self) -> bool:
        return self.all_work().is_done()

    # -- pools -----------------------------------------------------------------

    def used_memory(self) -> int:
        with self._lock:
            return sum(n for _, n in self._pools.values())

    def alloc_pool(self, pool_id: int, nbytes: int, alignment: int) -> None:
        with self._lock:
            if pool_id in self._pools:
                raise InvalidProgramError(f"pool {pool_id} already exists on {self.device_id}")
            used, cap = self.used_memory(), self.info.memory_bytes
            if used + nbytes > cap:
                raise PoolExhaustedError(
                    f"pool {pool_id} of {nbytes} bytes does not fit on {self.device_id} "
                    f"({self.name}): {used} of {cap} bytes are in use, {cap - used} free"
                )
            try:
                handle = self.driver.alloc(self.ordinal, max(nbytes, 1), alignment)
            except PoolExhaustedError:
                raise
            except MemoryError as e:
                raise PoolExhaustedError(
                    f"{self.device_id} could not allocate pool {pool_id} of {nbytes} bytes "
                    f"({used} bytes in use): {e}"
                ) from e
            self._pools[pool_id] = (handle, nbytes)

    def free_pool(self, pool_id: int) -> None:
        with self._lock:
            handle, _ = self._pools.pop(pool_id)
        self.tracker.drain_pool(pool_id)
        self.driver.free(self.ordinal, handle)

    def pool_handle(self, pool_id: int) -> Any:
        return self._pools[pool_id][0]

    def memset_zero(self, pool_id: int, offset: int, nbytes: int) -> None:
        """Zero bytes of a pool, ordered after all work on it (on the default stream)."""
        stream = self.default_stream
        loc = BufferLoc(pool_id, offset)
        self.tracker.before_write(loc, stream)
        self.driver.memset_zero(stream.handle, self.pool_handle(pool_id), offset, nbytes)
        self.tracker.after_write(loc, stream.record())

    def new_pool(self, nbytes: int) -> int:
        pid = self._pool_ids.take()
        self.alloc_pool(pid, nbytes, self.info.base_alignment)
        return pid

    # -- the merge buffer (pool 0) ---------------------------------------------

    def reserve_merge(self, nbytes: int) -> None:
        """Grow the merge buffer to at least nbytes. Growing moves it, so all work must finish."""
        with self._lock:
            if self.merge.nbytes >= nbytes:
                return
            self.synchronize()
            if self.merge.handle is not None:
                self.free_pool(MERGE_POOL)
            self.alloc_pool(MERGE_POOL, nbytes, self.info.base_alignment)
            self.merge.handle = self.pool_handle(MERGE_POOL)
            self.merge.nbytes = nbytes
            self.merge.generation += 1

    # -- constants ---------------------------------------------------------------

    def acquire_constant(self, values: np.ndarray) -> BufferLoc:
        """The device's copy of a read-only constant, shared by content, refcounted."""
        key = values.dtype.str.encode() + repr(values.shape).encode() + values.tobytes()
        with self._lock:
            hit = self._constants.get(key)
            if hit is not None:
                self._constants[key] = (hit[0], hit[1] + 1)
                return hit[0]
            pid = self.new_pool(values.nbytes)
            loc = BufferLoc(pid, 0)
            stream = self.default_stream
            self.driver.copy_from_host(stream.handle, self.pool_handle(pid), 0, values)
            self.tracker.after_write(loc, stream.record())
            self._constants[key] = (loc, 1)
            return loc

    def release_constants(self, locs: Iterable[BufferLoc]) -> None:
        with self._lock:
            for loc in locs:
                key = next(k for k, (v, _) in self._constants.items() if v == loc)
                at, refs = self._constants[key]
                if refs > 1:
                    self._constants[key] = (at, refs - 1)
                else:
                    del self._constants[key]
                    self.free_pool(at.pool_id)

    # -- modules -------------------------------------------------------------------

    def module(self, binary: Any) -> Any:
        """Load a binary once per device."""
        with self._lock:
            hit = self._modules.get(id(binary))
            if hit is None or hit[0] is not binary:
                hit = (binary, self.driver.load(self.ordinal, binary))
                self._modules[id(binary)] = hit
            return hit[1]


# ---------------------------------------------------------------------------
# Contexts


class Context:
    """Buffers of nodes on one device, and the stream that work on them runs on.

    A context never changes after it is made: linking returns a child context
    that adds the new buffers. ``finalize()`` frees only the pools the context
    itself created, and makes it and its descendants unusable.
    """

    def __init__(
        self,
        device: Device,
        stream: Stream,
        parent: Context | None,
        buffers: Mapping[Node, BufferLoc],
        merge_node: Node | None,
        own_pools: Sequence[int],
        own_constants: Sequence[BufferLoc] = (),
    ) -> None:
        self.device = device
        self.stream = stream
        self.parent = parent
        self.buffers: Mapping[Node, BufferLoc] = MappingProxyType(dict(buffers))
        self.merge_node = merge_node
        self._own_pools = tuple(own_pools)
        self._own_constants = tuple(own_constants)
        self._children: weakref.WeakSet[Context] = weakref.WeakSet()
        self.finalized = False
        if parent is not None:
            parent._children.add(self)

    def __repr__(self) -> str:
        return f"Context({self.device.device_id}, {len(self.buffers)} buffers{', finalized' if self.finalized else ''})"

    def _child(self, buffers: Mapping[Node, BufferLoc], *, merge_node: Node | None = None,
               own_pools: Sequence[int] = (), own_constants: Sequence[BufferLoc] = (),
               stream: Stream | None = None) -> Context:
        return Context(self.device, stream or self.stream, self, {**self.buffers, **buffers},
                       merge_node if merge_node is not None else self.merge_node, own_pools, own_constants)

    def check_alive(self) -> None:
        if self.finalized:
            raise FinalizedError(f"{self!r} was finalized (or an ancestor was); link into a live context")

    def loc(self, node: Node, what: str = "") -> BufferLoc:
        loc = self.buffers.get(node)
        if loc is None:
            raise NodeNotInContextError(_missing(node, self, what))
        return loc

    def with_stream(self, stream: Stream) -> Context:
        """A child context with the same buffers whose work runs on another stream of the device."""
        self.check_alive()
        if stream.device is not self.device:
            raise UnknownDeviceError(f"{stream!r} is not a stream of {self.device.device_id}")
        return self._child({}, stream=stream)

    # -- linking ------------------------------------------------------------------

    def link(self, code: Code) -> Routine:
        routines = self.link_batch(code.batch)
        return routines[code.index]

    def link_batch(self, batch: CodeBatch) -> list[Routine]:
        self.check_alive()
        dev = self.device
        if batch.backend is not dev.backend:
            raise InvalidProgramError(
                f"code compiled by the {batch.backend.name} backend cannot be linked on {dev.device_id}"
            )
        comps = batch.lowered.comps
        self._check_inputs(comps)
        new_nodes, requests = _plan_requests(comps, self.buffers, dev.info.base_alignment)
        plan = slab.plan(requests, dev.info.base_alignment)
        pools: list[int] = []
        constants: list[BufferLoc] = []
        try:
            buffers: dict[Node, BufferLoc] = {}
            if plan.nbytes:
                pid = dev.new_pool(plan.nbytes)
                pools.append(pid)
                buffers.update({n: BufferLoc(pid, plan.offsets[n]) for n in new_nodes})
            for comp in comps:
                for node, values in comp.constants:
                    if node not in self.buffers and node not in buffers:
                        buffers[node] = dev.acquire_constant(values)
                        constants.append(buffers[node])
            module = dev.module(batch.binary)
        except BaseException:
            for pid in pools:
                dev.free_pool(pid)
            dev.release_constants(constants)
            raise
        persistent = {n: loc for n, loc in buffers.items() if batch.lowered.modes.get(n) is not MemoryMode.LOCAL}
        scratch = {n: loc for n, loc in buffers.items() if n not in persistent}
        child = self._child(persistent, own_pools=pools, own_constants=constants)
        every = {**child.buffers, **scratch}
        return [Routine(child, batch, k, module, every) for k in range(len(comps))]

    def _check_inputs(self, comps: Sequence[LoweredComp]) -> None:
        written: set[Node] = set()
        for comp in comps:
            for node in comp.inputs:
                if node not in self.buffers and node not in written:
                    raise NodeNotInContextError(_missing(node, self, f"computation {comp.name} reads it"))
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

    def _host_array(self, node: Node, array: np.ndarray, what: str) -> None:
        if not isinstance(array, np.ndarray):
            raise DTypeMismatchError(f"{what} of {node.label} needs a numpy array, got {type(array).__name__}")
        if array.shape != node.shape:
            raise ShapeMismatchError(f"{what} of {node.label}: array has shape {array.shape}, node has {node.shape}")
        if array.dtype != node.dtype.np:
            raise DTypeMismatchError(f"{what} of {node.label}: array has dtype {array.dtype}, node has {node.dtype}")

    def from_host(self, node: Node, array: np.ndarray) -> bool:
        """Enqueue a copy of ``array`` into the node's buffer; returns False if the node has none.

        Like pyopencl's non-blocking copies: the array is kept alive until the copy
        is done; do not modify it before the stream gets past this point.
        """
        self.check_alive()
        self._host_array(node, array, "from_host")
        loc = self.buffers.get(node)
        if loc is None:
            return False
        src = np.ascontiguousarray(array)
        self.device.tracker.before_write(loc, self.stream)
        self.device.driver.copy_from_host(self.stream.handle, self.device.pool_handle(loc.pool_id), loc.offset, src)
        self.device.tracker.after_write(loc, self.stream.record())
        return True

    def to_host(self, node: Node, array: np.ndarray, *, blocking: bool = True) -> bool:
        """Copy the node's buffer into ``array``; returns False if the node has none.

        ``blocking=False`` (like pyopencl's ``is_blocking=False``) only enqueues the copy:
        ``array`` holds the value once the stream gets past this point
        (``stream.synchronize()``), which lets a caller fetch several outputs with one wait.
        """
        self.check_alive()
        self._host_array(node, array, "to_host")
        loc = self.buffers.get(node)
        if loc is None:
            return False
        if not array.flags.c_contiguous or not array.flags.writeable:
            raise ShapeMismatchError(f"to_host of {node.label} needs a writeable C-contiguous array")
        self.device.tracker.before_read(loc, self.stream)
        self.device.driver.copy_to_host(self.stream.handle, self.device.pool_handle(loc.pool_id), loc.offset, array)
        ev = self.stream.record()
        self.device.tracker.after_read(loc, ev)
        if blocking:
            ev.sync()
        return True

    def read(self, node: Node) -> np.ndarray:
        """A new numpy array with the node's value (blocking)."""
        out = np.empty(node.shape, node.dtype.np)
        if not self.to_host(node, out):
            raise NodeNotInContextError(_missing(node, self, "read"))
        return out

    def init_from_host(self, node: Node, array: np.ndarray) -> Context:
        """A child context with a new buffer for ``node``, filled from ``array``."""
        self.check_alive()
        self._host_array(node, array, "init_from_host")
        child = self._with_new_buffer(node)
        child.from_host(node, array)
        return child

    def _with_new_buffer(self, node: Node) -> Context:
        pid = self.device.new_pool(node.nbytes)
        return self._child({node: BufferLoc(pid, 0)}, own_pools=[pid])

    def will_wait_for(self, event: Event | AllOf) -> None:
        """Make this context's stream wait (device side) for an event."""
        self.check_alive()
        self.stream.wait(event)

    def finalize(self) -> None:
        """Free the pools this context created; it and its descendants become unusable.

        The descendants' own pools are freed too (nothing can use them any more);
        the ancestors' pools are not.
        """
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
            for pid in ctx._own_pools:
                self.device.free_pool(pid)
            self.device.release_constants(ctx._own_constants)


def _missing(node: Node, ctx: Context, what: str) -> str:
    mode = f" (it is {node.mode.value})" if node.mode else ""
    suffix = f": {what}" if what else ""
    return f"{node.label} {node.shape} {node.dtype} has no buffer in {ctx!r}{mode}{suffix}"


def _plan_requests(
    comps: Sequence[LoweredComp], existing: Mapping[Node, BufferLoc], base_alignment: int
) -> tuple[list[Node], list[slab.Request]]:
    """Lifetimes (in kernel positions over the batch) of the nodes a link must allocate:
    persistent results live for the whole batch, scratch from its first to its last kernel."""
    first: dict[Node, int] = {}
    last: dict[Node, int] = {}
    pos = 0
    for comp in comps:
        for k in comp.kernels:
            for n in k.buffers:
                first.setdefault(n, pos)
                last[n] = pos
            pos += 1
    end = max(pos - 1, 0)
    # Constants (written by no kernel) live in the device's constant table, not in the pool.
    computed = {n for comp in comps for k in comp.kernels for n in k.outputs}
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


class Replay:
    """Linked routines replayed as one unit (see :meth:`Backend.capture`); this generic one
    runs them one after the other on their contexts' streams."""

    def __init__(self, routines: Sequence[Routine], stream: Stream | None = None) -> None:
        if not routines:
            raise InvalidProgramError("capture() needs at least one routine")
        self.routines = tuple(routines)
        self.stream = stream or self.routines[0].context.stream
        if any(r.context.stream is not self.stream for r in self.routines):
            raise InvalidProgramError(
                "capture(): the routines run on another stream than the one given; link them in a "
                "context on that stream (Context.with_stream)")

    def replay(self) -> None:
        for r in self.routines:
            r.run()

    def close(self) -> None:
        """Nothing to free here; a recorded graph frees its handles."""


class Routine:
    """A linked computation: ``run()`` enqueues its kernels on the context's stream after the
    device-side waits its buffers need."""

    def __init__(self, context: Context, batch: CodeBatch, index: int, module: Any,
                 buffers: Mapping[Node, BufferLoc]) -> None:
        comp = batch.lowered.comps[index]
        self.context = context
        self.name = batch.names[index]
        self.inputs = frozenset(comp.inputs)
        self.outputs = frozenset(comp.outputs)
        self.merge_buffer_input = comp.merge_input
        self.statics = comp.statics
        self.bindings: dict[StaticSymbol, int] = dict(batch.bindings[index])
        self.source = batch.source
        self._specs = batch.source.kernels[index]
        self._module = module
        self._buffers = buffers
        device = context.device
        stored = {n for k in comp.kernels for n in k.buffers}
        locs = {n: buffers[n] for n in stored}
        written = {n for k in comp.kernels for n in k.outputs}
        self.write_locs = tuple(dict.fromkeys(locs[n] for n in written))
        self.read_locs = tuple(dict.fromkeys(locs[n] for n in stored if n not in written))
        if comp.merge_input is not None:
            self.read_locs += (BufferLoc(MERGE_POOL, 0),)
        self._read_states = device.tracker.states(self.read_locs)
        self._write_states = device.tracker.states(self.write_locs)
        self._prepared: Any = None
        self._merge_generation = -1
        if comp.merge_input is None or device.merge.handle is not None:
            self._prepare()

    def _prepare(self) -> None:
        device = self.context.device
        kernels: list[tuple[KernelSpec, list[tuple[Any, int]]]] = []
        for spec in self._specs:
            args = [(device.pool_handle(self._buffers[n].pool_id), self._buffers[n].offset) for n in spec.buffers]
            if spec.merge is not None:
                args.append((device.merge.handle, 0))
            kernels.append((spec, args))
        self._prepared = device.driver.prepare(device.ordinal, self._module, kernels)
        self._merge_generation = device.merge.generation

    def __repr__(self) -> str:
        return f"Routine({self.name} on {self.context.device.device_id})"

    def prepared(self) -> Any:
        """The driver's prepared launch, bound again if the merge buffer moved since."""
        if self._prepared is None or (
            self.merge_buffer_input is not None
            and self._merge_generation != self.context.device.merge.generation
        ):
            self._prepare()
        return self._prepared

    def static_values(self, bindings: Mapping[StaticSymbol, int] | None = None) -> tuple[int, ...]:
        """The statics' values, in kernel-argument order, from ``bindings`` (default: the routine's)."""
        bindings = self.bindings if bindings is None else bindings
        out = []
        for s in self.statics:
            v = bindings.get(s)
            if v is None:
                raise BindingError(f"routine {self.name}: static symbol {s!r} is not bound (set routine.bindings[sym])")
            if not 0 <= v < s.bound:
                raise BindingError(f"routine {self.name}: {s!r} = {v} is outside [0, {s.bound})")
            out.append(int(v))
        return tuple(out)

    def run(self) -> None:
        ctx = self.context
        if ctx.finalized:
            ctx.check_alive()
        device = ctx.device
        merge = self.merge_buffer_input
        if merge is not None:
            if device.merge.node is not merge:
                held = device.merge.node.label if device.merge.node else "nothing"
                raise MergeBufferMismatchError(
                    f"routine {self.name} reads {merge.label} from the merge buffer of "
                    f"{device.device_id}, which now holds {held}"
                )
            if self._merge_generation != device.merge.generation:
                self._prepare()
        statics = self.static_values() if self.statics else ()
        stream = ctx.stream
        Tracker.ordered(stream, self._read_states, self._write_states,
                        device.driver.launch, stream.handle, self._prepared, statics)


class TransferRoutine:
    """A device_to_device copy as a routine: run() enqueues the copy again."""

    def __init__(self, node: Node, dst: Context, src: Context, into_merge: bool, context: Context) -> None:
        self.node = node
        self.name = f"copy_{node.name}_{src.device.device_id}_to_{dst.device.device_id}"
        self.context = context
        self.inputs = frozenset([node])
        self.outputs = frozenset() if into_merge else frozenset([node])
        self.merge_buffer_input: Node | None = None
        self.bindings: dict[StaticSymbol, int] = {}
        self._dst, self._src, self._into_merge = dst, src, into_merge

    def __repr__(self) -> str:
        return f"TransferRoutine({self.name})"

    def run(self) -> None:
        node, dst, src = self.node, self._dst, self._src
        src.check_alive()
        dst.check_alive()
        sdev, ddev = src.device, dst.device
        sloc = src.loc(node, "device_to_device source")
        if self._into_merge:
            ddev.reserve_merge(node.nbytes)
            dloc = BufferLoc(MERGE_POOL, 0)
            dhandle = ddev.merge.handle
        else:
            dloc = dst.loc(node, "device_to_device destination")
            dhandle = ddev.pool_handle(dloc.pool_id)
        stream = dst.stream
        if sdev.backend is not ddev.backend:  # different backends: stage through the host
            staging = src.read(node)
            ddev.tracker.before_write(dloc, stream)
            ddev.driver.copy_from_host(stream.handle, dhandle, dloc.offset, staging)
        else:
            sdev.tracker.before_read(sloc, stream)
            ddev.tracker.before_write(dloc, stream)
            ddev.driver.copy_device(
                stream.handle, (ddev.ordinal, dhandle, dloc.offset),
                (sdev.ordinal, sdev.pool_handle(sloc.pool_id), sloc.offset), node.nbytes,
            )
        ev = stream.record()
        if sdev.backend is ddev.backend:
            sdev.tracker.after_read(sloc, ev)
        ddev.tracker.after_write(dloc, ev)
        if self._into_merge:
            ddev.merge.node = node


def device_to_device(
    node: Node, *, dst: Context, src: Context, into_merge_buffer: MergeBuffer = MergeBuffer.NO
) -> TransferRoutine | None:
    """Copy ``node`` from ``src``'s buffer to ``dst``'s (or into dst's device merge buffer).

    The copy is enqueued now, on dst's stream, after the device-side waits it
    needs; the returned routine enqueues it again on ``run()``. With
    ``MergeBuffer.COPY``, link readers of ``ir.merge(node)`` against
    ``routine.context``. Returns None when src and dst share the buffer.
    """
    src.check_alive()
    dst.check_alive()
    src.loc(node, "device_to_device source")
    into_merge = into_merge_buffer is MergeBuffer.COPY
    if into_merge:
        context = dst._child({}, merge_node=node)
    else:
        dloc = dst.loc(node, "device_to_device destination")
        if src.device is dst.device and src.buffers[node] == dloc:
            return None
        context = dst
    routine = TransferRoutine(node, dst, src, into_merge, context)
    routine.run()
    return routine


def init_from_device(node: Node, *, dst: Context, src: Context) -> Context:
    """A child of ``dst`` with a new buffer for ``node``, filled from ``src`` (device side)."""
    src.check_alive()
    dst.check_alive()
    src.loc(node, "init_from_device source")
    child = dst._with_new_buffer(node)
    TransferRoutine(node, child, src, False, child).run()
    return child
