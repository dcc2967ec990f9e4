"""Compiled code, linked routines, replays and transfers between devices.

A ``CodeBatch`` is what a backend compiles; linking it into a context gives one
``Routine`` per computation, whose ``run()`` enqueues its kernels after the device-side
waits its buffers need. A ``Replay`` runs routines as one unit (a CUDA graph on CUDA);
``device_to_device`` copies a node between contexts, on one device or two.
"""

from __future__ import annotations

import copy
import inspect
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from polyjit.core.codegen import KernelSpec, Source
from polyjit.core.device import driver_call
from polyjit.core.dtypes import is_int
from polyjit.core.errors import (
    BindingError,
    DTypeMismatchError,
    FinalizedError,
    InvalidArgumentError,
    InvalidProgramError,
    MergeBufferMismatchError,
    ShapeMismatchError,
    UnsupportedError,
)
from polyjit.core.ir import Node, StaticSymbol
from polyjit.core.log import logger
from polyjit.core.lower import LoweredBatch
from polyjit.core.protocol import MergeBuffer
from polyjit.core.slab import MERGE_POOL, BufferLoc
from polyjit.core.streams import Event, Operation, Stream, enqueue, issue

if TYPE_CHECKING:
    from polyjit.core.context import Context
    from polyjit.core.device import LoadedModule
    from polyjit.core.runtime import Backend


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


def check_binding(where: str, sym: StaticSymbol, value: Any) -> int:
    """A static symbol's value: an integer (not a bool, a float or a string) in [0, bound)."""
    if not isinstance(sym, StaticSymbol):
        raise BindingError(f"{where}: bindings are keyed by ir.StaticSymbol, not {type(sym).__name__} {sym!r}")
    if not is_int(value):
        raise BindingError(f"{where}: {sym!r} = {value!r} is a {type(value).__name__}, not an integer")
    if not 0 <= value < sym.bound:
        raise BindingError(f"{where}: {sym!r} = {value} is outside [0, {sym.bound})")
    return int(value)


def check_host_array(node: Node, array: Any, what: str) -> None:
    """``array`` is what ``what`` (a word: "from_host") may copy ``node`` from or into: a numpy
    array of the node's shape and dtype."""
    if not isinstance(node, Node):
        raise InvalidArgumentError(f"{what} needs a Node first, got {type(node).__name__}")
    if not isinstance(array, np.ndarray):
        raise DTypeMismatchError(f"{what} of {node.label} needs a numpy array, got {type(array).__name__}")
    if array.shape != node.shape:
        raise ShapeMismatchError(f"{what} of {node.label}: array has shape {array.shape}, node has {node.shape}")
    if array.dtype != node.dtype.np:
        raise DTypeMismatchError(f"{what} of {node.label}: array has dtype {array.dtype}, node has {node.dtype}")


def check_writable(node: Node, array: np.ndarray, what: str) -> None:
    """A host array a copy writes into: writeable and C-contiguous, as the device writes it."""
    if not array.flags.c_contiguous or not array.flags.writeable:
        raise ShapeMismatchError(f"{what} of {node.label} needs a writeable C-contiguous array")


def _sequence(values: Any, what: str, of: str) -> tuple[Any, ...]:
    """A list or tuple as a tuple; anything else (one item, a dict, a generator, None) refused."""
    if not isinstance(values, (list, tuple)):
        raise InvalidArgumentError(f"{what} takes a list or tuple of {of}, got {type(values).__name__}")
    return tuple(values)


def _nodes(nodes: Sequence[Node], what: str, distinct: bool) -> tuple[Node, ...]:
    got = _sequence(nodes, f"capture({what}=)", "Nodes")
    if any(not isinstance(n, Node) for n in got):
        raise InvalidArgumentError(f"capture({what}=) takes a list or tuple of Nodes, got "
                                   f"{', '.join(sorted({type(n).__name__ for n in got}))}")
    twice = sorted({n.label for k, n in enumerate(got) if n in got[:k]}) if distinct else []
    if twice:
        raise InvalidArgumentError(f"capture({what}=) names {', '.join(twice)} more than once")
    return got


def check_takes(cls: type, method: str, names: Sequence[str], spelled: str) -> None:
    """A subclass's override of ``method`` takes these keyword arguments (or ``**kwargs``):
    one written for an older signature fails when its class is made, not when it is called."""
    fn = cls.__dict__.get(method)
    if fn is None:
        return
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # not introspectable (a C function, a partialmethod): trust it
        return
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    if not set(names) <= {p.name for p in params}:
        raise InvalidArgumentError(f"{cls.__name__}.{method} must take {', '.join(n + '=' for n in names)}: {spelled}")


def _through_replay(self: Replay, ins: Sequence[np.ndarray] = (), outs: Sequence[np.ndarray] = ()) -> Event:
    """A plan's replay of a subclass that overrides ``replay()``: through that override."""
    return self.replay(list(ins) if ins else None, list(outs) if outs else None)


class Replay:
    """Linked routines replayed as one unit (see :meth:`Backend.capture`), ordered by the
    per-node events like ``run()``, with host copies of some nodes in before them and out
    after them: one enqueue, one event. This generic one launches the routines one after the
    other; a backend with something cheaper to launch (CUDA: one graph) overrides
    :meth:`_launches`. ``bindings`` (static symbol -> value, from the routines' own) is read
    by each ``replay()``."""

    same_stream = True  # this one runs each routine on its own context's stream

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if getattr(cls, "_enqueue", None) is not None:  # the hook of before: it would do nothing now
            raise InvalidArgumentError(f"{cls.__name__} overrides Replay._enqueue, which replay() no longer "
                                       "calls: override _launches() (the driver calls that run the routines) instead")
        check_takes(cls, "replay", ("inputs", "outputs"), "replay(inputs=None, outputs=None)")
        if "replay" in cls.__dict__ and "_replay_prepared" not in cls.__dict__:
            cls._replay_prepared = _through_replay  # type: ignore[method-assign]

    def __init__(self, routines: Sequence[Routine], stream: Stream | None = None,
                 inputs: Sequence[Node] = (), outputs: Sequence[Node] = ()) -> None:
        got = _sequence(routines, "capture()", "linked routines (Context.link)")
        if not got:
            raise InvalidProgramError("capture() needs at least one routine")
        if any(not isinstance(r, Routine) for r in got):
            raise InvalidArgumentError("capture() takes linked routines (Context.link)")
        if stream is not None and not isinstance(stream, Stream):
            raise InvalidArgumentError(f"capture(stream=) takes a Stream of the routines' device, "
                                       f"got {type(stream).__name__}")
        self.routines = got
        self.name = "+".join(r.name for r in got)  # what a device fault names
        self.stream = stream or self.routines[0].context.stream
        self.device = self.stream.device
        if any(r.context.device is not self.device for r in self.routines):
            raise InvalidProgramError(f"capture(): every routine must run on {self.device.device_id}")
        if self.same_stream and any(r.context.stream is not self.stream for r in self.routines):
            raise InvalidProgramError(
                "capture(): the routines run on another stream than the one given; link them in a "
                "context on that stream (Context.with_stream)")
        self.bindings: dict[StaticSymbol, int] = {}
        for r in self.routines:
            r.context.check_alive()
            for sym, value in r.bindings.items():
                self.bindings.setdefault(sym, value)
        self.inputs = _nodes(inputs, "inputs", distinct=True)  # one value per node
        self.outputs = _nodes(outputs, "outputs", distinct=False)  # a node may go to two arrays
        first, last = self.routines[0].context, self.routines[-1].context
        self._in_locs = tuple(first.writable_loc(n, "capture(inputs=)") for n in self.inputs)
        self._out_locs = tuple(last.loc(n, "capture(outputs=)") for n in self.outputs)
        reads = dict.fromkeys([*(loc for r in self.routines for loc in r.read_locs), *self._out_locs])
        writes = dict.fromkeys([*self._in_locs, *(loc for r in self.routines for loc in r.write_locs)])
        with self.device.lock:
            self._reads = self.device.tracker.states(list(reads))
            self._writes = self.device.tracker.states(list(writes))
        self.closed = False

    def bind(self, **values: int) -> Replay:
        """Set bindings by static symbol name: ``replay.bind(b=3).replay()``."""
        by_name = {s.name: s for r in self.routines for s in r.statics}
        for name, value in values.items():
            if name not in by_name:
                raise BindingError(f"no static symbol named {name!r} in the captured routines")
            self.bindings[by_name[name]] = check_binding("bind", by_name[name], value)
        return self

    def replay(self, inputs: Sequence[np.ndarray] | None = None,
               outputs: Sequence[np.ndarray] | None = None) -> Event:
        """Copy ``inputs`` (host arrays, one per captured input node, in order) into their
        nodes, run the routines, copy the captured output nodes into ``outputs`` (writeable
        C-contiguous arrays); returns the event behind all of it. Either may be None: no copies
        that way. Like ``from_host`` / ``to_host(blocking=False)``, the arrays are kept alive
        until the event completes; do not touch them before. Every array is checked before
        anything is enqueued."""
        if self.closed:
            raise FinalizedError(f"{self!r} was closed")
        for r in self.routines:
            r.context.check_alive()
        ins = () if inputs is None else self._host_arrays(self.inputs, inputs, "inputs", into=False)
        outs = () if outputs is None else self._host_arrays(self.outputs, outputs, "outputs", into=True)
        return self._enqueue_copies(ins, outs)

    def _replay_prepared(self, ins: Sequence[np.ndarray] = (), outs: Sequence[np.ndarray] = ()) -> Event:
        """``replay()`` for a Plan, whose arrays are made right already (its inputs through
        ``Feed.host_array``, its outputs its own arrays): none, or one per captured node. The
        full checks cost a char_lm step 12 us of host time on the 2-vCPU EPYC VM of session 20,
        where the host's time is the step's; what is left keeps every copy inside its array
        and its node (the count, each array's byte size and layout, outputs writeable). A
        subclass that overrides ``replay()`` gets plans through it (``__init_subclass__``)."""
        if self.closed:
            raise FinalizedError(f"{self!r} was closed")
        for r in self.routines:
            r.context.check_alive()
        for arrays, nodes, into in ((ins, self.inputs, False), (outs, self.outputs, True)):
            if not arrays:
                continue
            if len(arrays) != len(nodes):
                raise InvalidArgumentError(f"{self!r}: {len(arrays)} arrays for {len(nodes)} "
                                           f"{'output' if into else 'input'} nodes")
            for node, a in zip(nodes, arrays):
                if a.nbytes != node.nbytes or not a.flags.c_contiguous:
                    raise ShapeMismatchError(f"{self!r}: {node.label} needs a C-contiguous array of "
                                             f"{node.nbytes} bytes, got {a.nbytes} bytes, shape {a.shape}")
                if into and not a.flags.writeable:  # the message's repr only when it is raised
                    check_writable(node, a, f"{self!r} output")
        return self._enqueue_copies(ins, outs)

    def _enqueue_copies(self, ins: Sequence[np.ndarray], outs: Sequence[np.ndarray]) -> Event:
        """The replay's one enqueue, of arrays already checked."""
        if logger.isEnabledFor(10):  # DEBUG
            logger.debug("replay %r on %r (%d copies in, %d out)", self, self.stream, len(ins), len(outs))
        device = self.device
        driver, handle, pools = device.driver, self.stream.handle, device.pool_handle
        with device.lock:  # nothing may be freed, nor the merge buffer move, between the checks and the launch
            if self.closed:  # again, under the lock: a close() in between destroyed what it launches
                raise FinalizedError(f"{self!r} was closed")
            for r in self.routines:
                r.context.check_alive()  # again, under the lock: a finalize() in between freed the pools
                r.check_merge()
            ops = [(driver.copy_from_host, (handle, pools(loc.pool_id), loc.offset, a))
                   for loc, a in zip(self._in_locs, ins)]
            ops += self._launches()
            ops += [(driver.copy_to_host, (handle, pools(loc.pool_id), loc.offset, a))
                    for loc, a in zip(self._out_locs, outs)]
            return enqueue(self.stream, self._reads, self._writes, self, issue, (ops,), (self, ops))

    def _host_arrays(self, nodes: tuple[Node, ...], arrays: Sequence[np.ndarray], what: str,
                     into: bool) -> list[np.ndarray]:
        got = _sequence(arrays, f"replay({what}=)", "numpy arrays")
        if len(got) != len(nodes):
            raise InvalidArgumentError(f"replay({what}=) takes {len(nodes)} arrays, one per captured "
                                       f"{what[:-1]} node, got {len(got)}")
        word = f"replay {what[:-1]}"
        for n, a in zip(nodes, got):
            check_host_array(n, a, word)
            if into:
                check_writable(n, a, word)
        return list(got) if into else [np.ascontiguousarray(a) for a in got]

    def _launches(self) -> list[Operation]:
        """The driver calls that run the routines (device lock held; merge buffers checked)."""
        launch, handle, bindings = self.device.driver.launch, self.stream.handle, self.bindings
        return [(launch, (handle, r.prepared(), r.static_values(bindings) if r.statics else ()))
                for r in self.routines]

    def close(self) -> None:
        """Free what the replay holds (a recorded graph); the routines stay usable."""
        self.closed = True

    def __enter__(self) -> Replay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.routines)} routines on {self.device.device_id})"


class Routine:
    """A linked computation: ``run()`` enqueues its kernels on the context's stream after the
    device-side waits its buffers need. The runtime keeps the routine (and its launch record)
    alive until that work completes, whatever the caller drops."""

    def __init__(self, context: Context, batch: CodeBatch, index: int, module: LoadedModule,
                 buffers: Mapping[Node, BufferLoc]) -> None:
        comp = batch.lowered.comps[index]
        specs = batch.source.kernels[index]
        self.context = context
        self.name = batch.names[index]
        self.inputs = frozenset(comp.inputs)
        self.outputs = frozenset(comp.outputs)
        self.merge_buffer_input = comp.merge_input
        # Every kernel of a computation takes all of its statics, in one order (a user's own
        # kernel has no loop IR to find them in: its spec says them).
        self.statics = specs[0].statics if specs else comp.statics
        self.bindings: dict[StaticSymbol, int] = dict(batch.bindings[index])
        self.source = batch.source
        self._module = module
        self._buffers = buffers
        self._bind(specs)

    def _bind(self, specs: Sequence[KernelSpec]) -> None:
        """Take these kernels: their buffers' event records and their launch record."""
        device = self.context.device
        self._specs = tuple(specs)
        stored = {n for spec in specs for n in spec.buffers}
        locs = {n: self._buffers[n] for n in stored}
        written = {n for spec in specs for n in spec.outputs}
        self.write_locs = tuple(dict.fromkeys(locs[n] for n in written))
        self.read_locs = tuple(dict.fromkeys(locs[n] for n in stored if n not in written))
        if self.merge_buffer_input is not None:
            self.read_locs += (BufferLoc(MERGE_POOL, 0),)
        self._read_states = device.tracker.states(self.read_locs)
        self._write_states = device.tracker.states(self.write_locs)
        self._prepared: Any = None
        self._merge_generation = -1
        # What run() passes the driver's launch when nothing varies between runs (no statics,
        # no merge buffer that may move): built once, so that a run is one call of enqueue.
        self._fixed_launch: tuple[Any, ...] | None = None
        if self.merge_buffer_input is None or device.merge.handle is not None:
            self._prepare()
        if self.merge_buffer_input is None and not self.statics:
            self._fixed_launch = (self.context.stream.handle, self._prepared, ())

    def split_after(self, node: Node) -> tuple[Routine, Routine] | None:
        """Two routines that run this one's kernels in two parts: up to the last kernel that
        writes ``node``, and the rest (None when that is the last kernel, or none writes it).
        Work enqueued between the parts' runs (copying ``node`` out) is done as soon as the
        first part is, before the second part runs: a training step's loss, before its
        backward pass and update."""
        writers = [k for k, spec in enumerate(self._specs) if node in spec.outputs]
        if not writers or writers[-1] == len(self._specs) - 1:
            return None
        cut = writers[-1] + 1
        return self._part(self._specs[:cut], "head"), self._part(self._specs[cut:], "tail")

    def _part(self, specs: Sequence[KernelSpec], which: str) -> Routine:
        part = copy.copy(self)
        part.name = f"{self.name}.{which}"
        part.bindings = dict(self.bindings)
        part._bind(specs)
        return part

    def _kernel_args(self, spec: KernelSpec) -> tuple[KernelSpec, list[tuple[Any, int]]]:
        device = self.context.device
        args = [(device.pool_handle(self._buffers[n].pool_id), self._buffers[n].offset) for n in spec.buffers]
        if spec.merge is not None:
            args.append((device.merge.handle, 0))
        return spec, args

    def _prepare(self, specs: Sequence[KernelSpec] | None = None) -> Any:
        device = self.context.device
        with device.lock:  # the pools it binds must not be freed between the check and the binding
            self.context.check_alive()  # a finalize() freed them: FinalizedError, not "no pool (freed?)"
            device.check_open(f"prepare of {self.name}")
            kernels = [self._kernel_args(spec) for spec in (self._specs if specs is None else specs)]
            prepared = driver_call(device.label, f"prepare of {self.name}", device.driver.prepare,
                                   device.ordinal, self._module.handle, kernels)
            if specs is None:
                self._prepared = prepared
                self._merge_generation = device.merge.generation
        return prepared

    @property
    def kernels(self) -> tuple[KernelSpec, ...]:
        """The kernels one run() launches, in order."""
        return tuple(self._specs)

    def time_kernels(self, repeats: int = 10) -> list[tuple[KernelSpec, float]]:
        """Each kernel of ``run()`` launched alone: one warm-up launch, then ``repeats``, ordered
        like ``run()`` by the per-node events; returns its mean seconds per launch, measured on
        the device between two events recorded with ``Stream.record(timing=True)`` (host
        time around a sync where the backend cannot time events). Kernels that update
        persistent state run ``repeats + 1`` extra times."""
        if not is_int(repeats) or repeats < 1:
            raise InvalidArgumentError(f"time_kernels: repeats must be a positive integer, not {repeats!r}")
        ctx = self.context
        ctx.check_alive()
        stream, launch = ctx.stream, ctx.device.driver.launch
        statics = self.static_values() if self.statics else ()
        out = []
        for spec in self._specs:
            one = self._prepare([spec])
            args, keep = (stream.handle, one, statics), (self, one)
            enqueue(stream, self._read_states, self._write_states, self, launch, args, keep)  # warm-up
            try:
                start: Event | None = stream.record(timing=True)
            except UnsupportedError:
                start = None
                stream.synchronize()
            t0 = time.perf_counter()
            for _ in range(repeats):
                enqueue(stream, self._read_states, self._write_states, self, launch, args, keep)
            if start is not None:
                seconds = start.elapsed_time(stream.record(timing=True)) / 1e3 / repeats
            else:
                stream.synchronize()
                seconds = (time.perf_counter() - t0) / repeats
            out.append((spec, seconds))
        return out

    def __repr__(self) -> str:
        return f"Routine({self.name} on {self.context.device.device_id})"

    def prepared(self) -> Any:
        """The routine's launch record: what the driver's ``prepare`` made of its kernels (the
        kernels with their buffers bound; ``launch`` adds the statics), bound again if the
        merge buffer moved since. Backends that replay routines their own way (CUDA graphs)
        read it; its type is the driver's."""
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
            out.append(check_binding(f"routine {self.name}", s, v))
        return tuple(out)

    def check_merge(self) -> None:
        """A routine that reads the merge buffer needs it to hold its node (the one check of it
        at run time; linking checks the context's)."""
        merge = self.merge_buffer_input
        if merge is not None and self.context.device.merge.node is not merge:
            device = self.context.device
            held = device.merge.node.label if device.merge.node else "nothing"
            raise MergeBufferMismatchError(
                f"routine {self.name} reads {merge.label} from the merge buffer of "
                f"{device.device_id}, which now holds {held}")

    def run(self) -> None:
        fixed = self._fixed_launch
        ctx = self.context
        if fixed is None or ctx.finalized or logger.isEnabledFor(10):  # DEBUG logs each launch
            self.run_with(self.bindings)
            return
        enqueue(ctx.stream, self._read_states, self._write_states, self, ctx.device.driver.launch, fixed, self)

    def run_with(self, bindings: Mapping[StaticSymbol, int]) -> None:
        """``run()`` with these static bindings instead of the routine's."""
        ctx = self.context
        if ctx.finalized:
            ctx.check_alive()
        statics = self.static_values(bindings) if self.statics else ()
        stream = ctx.stream
        device = ctx.device
        if logger.isEnabledFor(10):  # DEBUG
            logger.debug("launch %s on %r%s", self.name, stream, f" statics {statics}" if statics else "")
        if self.merge_buffer_input is None:  # prepared once, at link: keeping self keeps it
            enqueue(stream, self._read_states, self._write_states, self, device.driver.launch,
                    (stream.handle, self._prepared, statics), self)
            return
        with device.lock:  # the merge buffer must not move between the check and the launch
            self.check_merge()
            prepared = self.prepared()
            enqueue(stream, self._read_states, self._write_states, self, device.driver.launch,
                    (stream.handle, prepared, statics), (self, prepared))


class TransferRoutine:
    """A device_to_device copy as a routine: run() enqueues the copy again. A copy into the
    merge buffer takes the destination device's ``merge_lock`` first: a thread that holds it
    across the copy and the routines that read it (``with device.merge_lock:``) gets no other
    thread's copy in between."""

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
        if self._into_merge:  # no copy of another thread's lands while one holds the merge buffer
            with self._dst.device.merge_lock:
                self._run()
        else:
            self._run()

    def _run(self) -> None:
        node, dst, src = self.node, self._dst, self._src
        src.check_alive()
        dst.check_alive()
        sdev, ddev = src.device, dst.device
        sloc = src.loc(node, "device_to_device source")
        stream = dst.stream
        if sdev.backend is not ddev.backend:  # different backends: stage through the host
            staging = src.read(node)
            with ddev.lock:
                dst.check_alive()  # again, under the lock: a finalize() in between freed the pool
                dloc, dhandle = self._destination()
                enqueue(stream, (), (ddev.tracker.state(dloc),), self, ddev.driver.copy_from_host,
                        (stream.handle, dhandle, dloc.offset, staging), (self, staging))
                if self._into_merge:
                    ddev.merge.node = node
            return
        first, second = sorted({sdev, ddev}, key=lambda d: d.device_id) + [ddev] * (sdev is ddev)
        with first.lock, second.lock:  # both trackers, in one order for every thread
            src.check_alive()  # again, under the locks: a finalize() in between freed the pools
            dst.check_alive()
            dloc, dhandle = self._destination()
            src_handle = sdev.pool_handle(sloc.pool_id)
            enqueue(stream, (sdev.tracker.state(sloc),), (ddev.tracker.state(dloc),), self, ddev.driver.copy_device,
                    (stream.handle, (ddev.ordinal, dhandle, dloc.offset),
                     (sdev.ordinal, src_handle, sloc.offset), node.nbytes), (self,))
            if self._into_merge:
                ddev.merge.node = node

    def _destination(self) -> tuple[BufferLoc, Any]:
        ddev, node = self._dst.device, self.node
        if self._into_merge:
            ddev.reserve_merge(node.nbytes)
            return BufferLoc(MERGE_POOL, 0), ddev.merge.handle
        dloc = self._dst.writable_loc(node, "device_to_device destination")
        return dloc, ddev.pool_handle(dloc.pool_id)


def _check_transfer(node: object, dst: object, src: object, what: str) -> None:
    from polyjit.core.context import Context

    if not isinstance(node, Node):
        raise InvalidArgumentError(f"{what} needs a Node first, got {type(node).__name__}")
    for side, ctx in (("dst", dst), ("src", src)):
        if not isinstance(ctx, Context):
            raise InvalidArgumentError(f"{what} of {node.label}: {side} must be a Context, not {type(ctx).__name__}")


def device_to_device(
    node: Node, *, dst: Context, src: Context, into_merge_buffer: MergeBuffer = MergeBuffer.NO
) -> TransferRoutine | None:
    """Copy ``node`` from ``src``'s buffer to ``dst``'s (or into dst's device merge buffer).

    The copy is enqueued now, on dst's stream, after the device-side waits it
    needs; the returned routine enqueues it again on ``run()``. With
    ``MergeBuffer.COPY``, link readers of ``ir.merge(node)`` against
    ``routine.context``. Returns None when src and dst share the buffer.
    """
    _check_transfer(node, dst, src, "device_to_device")
    src.check_alive()
    dst.check_alive()
    src.loc(node, "device_to_device source")
    into_merge = into_merge_buffer is MergeBuffer.COPY
    if into_merge:
        context = dst._child({}, merge_node=node)
    else:
        dloc = dst.writable_loc(node, "device_to_device destination")
        if src.device is dst.device and src.buffers[node] == dloc:
            return None
        context = dst
    routine = TransferRoutine(node, dst, src, into_merge, context)
    routine.run()
    return routine


def init_from_device(node: Node, *, dst: Context, src: Context) -> Context:
    """A child of ``dst`` with a new buffer for ``node``, filled from ``src`` (device side)."""
    _check_transfer(node, dst, src, "init_from_device")
    src.check_alive()
    dst.check_alive()
    src.loc(node, "init_from_device source")
    child = dst._with_new_buffer(node)
    TransferRoutine(node, child, src, False, child).run()
    return child
