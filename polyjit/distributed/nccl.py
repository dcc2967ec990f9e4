"""NCCL for CUDA nodes: collectives that run on the device, on the context's own stream.

Design (docs/distributed.md, "GPUs: NCCL"):

- The library: ``libnccl.so.2`` from the ``nvidia-nccl-cu13`` wheel (``nvidia/nccl/lib``),
  else ``$POLYJIT_NCCL_LIBRARY``, else the system's; loaded with ctypes (cuda.bindings has
  no NCCL bindings). Nothing here touches the CUDA driver before a :class:`NcclComm` is made
  for a CUDA device.
- Set-up: rank 0 makes the ``ncclUniqueId``; MPI broadcasts its 128 bytes
  (:func:`shared_unique_id`); every rank calls ``ncclCommInitRank`` with its MPI rank, on
  its polyjit device made current (cuda.core's primary context, the one NCCL's runtime uses).
- A call joins over MPI first, exactly as :class:`~polyjit.distributed.comm.Comm` does (the
  header exchange: the ranks that do not join are named at the deadline, mismatched shapes,
  dtypes and ops raise on every rank before anything is enqueued). Then the NCCL kernel is
  enqueued on the context's CUDA stream through ``polyjit.core.streams.enqueue``: the stream
  waits, on the device, for the node's writer (and readers, when it is written); the NCCL
  call becomes the node's writer (or reader), so routines after it wait for it on the device
  too. The host never waits for the data.
- Timeouts: the data moves after the host call returns, so a watchdog thread follows every
  call's event; past its deadline it aborts the NCCL communicator (``ncclCommAbort``, which
  ends the stuck kernels) and the next call, or :meth:`NcclComm.check`, raises
  :class:`CollectiveTimeoutError`. Asynchronous NCCL errors (``ncclCommGetAsyncError``) are
  raised the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import importlib.util
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from polyjit.core.errors import (
    BackendUnavailableError,
    CollectiveTimeoutError,
    DriverError,
    DTypeMismatchError,
    InvalidArgumentError,
    UnsupportedError,
)
from polyjit.core.ir import Node
from polyjit.distributed.comm import (
    Comm,
    _check_timeout,
    _node_problem,
    _of,
    _op_problem,
    _out_problem,
    one_call,
)
from polyjit.distributed.ordering import node_events

if TYPE_CHECKING:
    from polyjit.core.context import Context
    from polyjit.core.device import Device
    from polyjit.core.streams import Event

LIBRARY_ENV = "POLYJIT_NCCL_LIBRARY"
UNIQUE_ID_BYTES = 128
WATCH_PERIOD_S = 0.05

# ncclDataType_t and ncclRedOp_t (nccl.h)
_DTYPES = {"float32": 7, "float64": 8, "int32": 2, "int64": 4, "uint8": 1, "bool": 1, "float16": 6, "bfloat16": 9}
_OPS = {"sum": 0, "max": 2, "min": 3, "mean": 4}  # mean: ncclAvg (NCCL >= 2.10)
_BOOL_OPS = {"sum": 2, "max": 2, "min": 3}  # 0/1 bytes: or is max, and is min


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


def _library_candidates() -> list[str]:
    out: list[str] = []
    forced = os.environ.get(LIBRARY_ENV, "").strip()
    if forced:
        out.append(forced)
    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec("nvidia.nccl")
        if spec is not None:
            for root in spec.submodule_search_locations or []:
                out.append(str(Path(root) / "lib" / "libnccl.so.2"))
    found = ctypes.util.find_library("nccl")
    if found:
        out.append(found)
    out.append("libnccl.so.2")
    return list(dict.fromkeys(out))


@functools.cache
def _load() -> tuple[Any, str | None]:
    errors = []
    for path in _library_candidates():
        if os.sep in path and not Path(path).exists():
            errors.append(f"{path}: no such file")
            continue
        try:
            lib = ctypes.CDLL(path)
            _declare(lib)
            return lib, None
        except (OSError, AttributeError) as e:
            errors.append(f"{path}: {e}")
    return None, ("NCCL not found (pip install nvidia-nccl-cu13, or set "
                  f"{LIBRARY_ENV}): " + "; ".join(errors))


def _declare(lib: Any) -> None:
    c_int, c_size, vp = ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p
    sigs: dict[str, list[Any]] = {
        "ncclGetVersion": [ctypes.POINTER(c_int)],
        "ncclGetUniqueId": [ctypes.POINTER(UniqueId)],
        "ncclCommInitRank": [ctypes.POINTER(vp), c_int, UniqueId, c_int],
        "ncclCommDestroy": [vp],
        "ncclCommAbort": [vp],
        "ncclCommGetAsyncError": [vp, ctypes.POINTER(c_int)],
        "ncclAllReduce": [vp, vp, c_size, c_int, c_int, vp, vp],
        "ncclBroadcast": [vp, vp, c_size, c_int, c_int, vp, vp],
        "ncclAllGather": [vp, vp, c_size, c_int, vp, vp],
        "ncclReduceScatter": [vp, vp, c_size, c_int, c_int, vp, vp],
        "ncclSend": [vp, c_size, c_int, c_int, vp, vp],
        "ncclRecv": [vp, c_size, c_int, c_int, vp, vp],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = c_int
    lib.ncclGetErrorString.argtypes = [c_int]
    lib.ncclGetErrorString.restype = ctypes.c_char_p


def nccl_unavailable_reason() -> str | None:
    """None when the NCCL library loads; else why not."""
    return _load()[1]


def load_nccl() -> Any:
    lib, reason = _load()
    if lib is None:
        raise BackendUnavailableError(reason)
    return lib


def nccl_version() -> int:
    """NCCL's version code (e.g. 23203 for 2.32.3)."""
    lib = load_nccl()
    v = ctypes.c_int(0)
    _check(lib, lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
    return int(v.value)


def _check(lib: Any, result: int, what: str) -> None:
    if result:
        text = lib.ncclGetErrorString(result)
        raise DriverError(f"{what} failed: NCCL error {result} ({text.decode() if text else '?'})")


def shared_unique_id(comm: Comm) -> bytes:
    """Rank 0's ``ncclUniqueId``, broadcast to every rank over MPI (collective)."""
    lib = load_nccl()
    uid = np.zeros(UNIQUE_ID_BYTES, np.uint8)
    if comm.rank == 0:
        made = UniqueId()
        _check(lib, lib.ncclGetUniqueId(ctypes.byref(made)), "ncclGetUniqueId")
        uid[:] = np.frombuffer(ctypes.string_at(ctypes.addressof(made), UNIQUE_ID_BYTES), np.uint8)
    return bytes(comm.broadcast_array(uid, root=0))


class _Watchdog:
    """Follows the events of enqueued NCCL calls; aborts the communicator past a deadline."""

    def __init__(self, owner: NcclComm) -> None:
        self.owner = owner
        self.lock = threading.Lock()
        self.calls: list[tuple[Event, float, str]] = []
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()

    def track(self, event: Event, deadline: float, what: str) -> None:
        with self.lock:
            self.calls.append((event, deadline, what))
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="polyjit-nccl-watchdog", daemon=True)
                self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(WATCH_PERIOD_S):
            with self.lock:
                calls = list(self.calls)
            late = None
            done = []
            now = time.monotonic()
            for call in calls:
                if call[0].is_done():
                    done.append(call)
                elif now > call[1]:
                    late = call
                    break
            with self.lock:
                self.calls = [c for c in self.calls if c not in done]
            if late is None:
                late_error = self.owner.async_error()
                if late_error is None:
                    continue
                self.owner.abort(late_error)
                return
            self.owner.abort(f"{late[2]} timed out: its NCCL kernels did not finish before the deadline "
                             "(every rank joined; a rank stalled or died during the transfer)")
            return


class NcclComm:
    """NCCL collectives on CUDA nodes of one device per rank (see the module docstring).

    ``NcclComm(comm, device, timeout=None)``: collective over ``comm`` (a
    :class:`~polyjit.distributed.Comm`, which also carries the joins); ``device``: this
    rank's polyjit CUDA device. The calls mirror :class:`~polyjit.distributed.Comm`'s and
    return once the work is enqueued.
    """

    def __init__(self, comm: Comm, device: Device, *, timeout: float | None = None) -> None:
        self._timeout = comm.timeout if timeout is None else _check_timeout(timeout, "NcclComm(timeout=)")
        self.lib = load_nccl()
        fn = getattr(device.driver, "dlpack_device", None)
        if fn is None or int(fn(device.ordinal)[0]) != 2:
            raise UnsupportedError(f"NCCL needs a CUDA device; {device.device_id} is not one")
        self.comm, self.device = comm, device
        uid = UniqueId()
        ctypes.memmove(ctypes.addressof(uid), shared_unique_id(comm), UNIQUE_ID_BYTES)
        _make_current(device)
        handle = ctypes.c_void_p()
        _check(self.lib, self.lib.ncclCommInitRank(ctypes.byref(handle), comm.size, uid, comm.rank),
               f"ncclCommInitRank (rank {comm.rank} of {comm.size} on {device.device_id})")
        self.handle = handle
        self._broken: str | None = None
        self._watch = _Watchdog(self)

    @property
    def timeout(self) -> float:
        """Seconds a call may take, from its start to its NCCL kernels' end (checked as
        ``Comm.timeout`` is)."""
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._timeout = _check_timeout(seconds, "NcclComm.timeout")

    # One call at a time with the Comm's own calls (comm.one_call: a call's MPI join and its
    # NCCL launch go together, and a thread that calls the Comm meanwhile waits its turn).
    @property
    def _lock(self) -> threading.RLock:
        return self.comm._lock

    @property
    def _lock_deadline(self) -> float | None:
        return self.comm._lock_deadline

    @_lock_deadline.setter
    def _lock_deadline(self, deadline: float | None) -> None:
        self.comm._lock_deadline = deadline

    @property
    def rank(self) -> int:
        return self.comm.rank

    # -- calls ----------------------------------------------------------------------------

    @one_call
    def all_reduce(self, ctx: Context, node: Node, op: str = "sum", *, timeout: float | None = None) -> None:
        call = self._join("all_reduce", ctx, node, (), (node,), op=op, timeout=timeout)
        nop = _nccl_op(node, op)
        self._enqueue(call, lambda p: self.lib.ncclAllReduce(p[0], p[0], node.size, call.dt, nop, self.handle, p[-1]))

    @one_call
    def broadcast(self, ctx: Context, node: Node, root: int = 0, *, timeout: float | None = None) -> None:
        call = self._join("broadcast", ctx, node, (), (node,), root=root, timeout=timeout)
        self._enqueue(call, lambda p: self.lib.ncclBroadcast(p[0], p[0], node.size, call.dt, root, self.handle, p[-1]))

    @one_call
    def all_gather(self, ctx: Context, node: Node, out_node: Node, *, timeout: float | None = None) -> None:
        call = self._join("all_gather", ctx, node, (node,), (out_node,), out_node=out_node, timeout=timeout)
        self._enqueue(call, lambda p: self.lib.ncclAllGather(p[0], p[1], node.size, call.dt, self.handle, p[-1]))

    @one_call
    def reduce_scatter(self, ctx: Context, node: Node, out_node: Node, op: str = "sum", *,
                       timeout: float | None = None) -> None:
        call = self._join("reduce_scatter", ctx, node, (node,), (out_node,), out_node=out_node, op=op,
                          timeout=timeout)
        nop = _nccl_op(node, op)
        self._enqueue(call, lambda p: self.lib.ncclReduceScatter(p[0], p[1], out_node.size, call.dt, nop,
                                                                 self.handle, p[-1]))

    @one_call
    def send(self, ctx: Context, node: Node, dest: int, tag: int = 0, *, timeout: float | None = None) -> None:
        deadline, problem = self._start(timeout)
        self.comm._check_peer(dest, tag, "send")  # else there is no one to tell, or no channel
        problem = problem or self._node_problem(ctx, node, "send", write=False)
        call, problem = self._prepare(problem, ctx, "send", node, (node,), (), deadline)
        self.comm._handshake("send", node, dest, tag, deadline, problem)  # raises the problem after it
        assert call is not None
        self._enqueue(call, lambda p: self.lib.ncclSend(p[0], node.size, call.dt, dest, self.handle, p[-1]))

    @one_call
    def recv(self, ctx: Context, node: Node, source: int, tag: int = 0, *, timeout: float | None = None) -> None:
        deadline, problem = self._start(timeout)
        self.comm._check_peer(source, tag, "recv")  # else there is no one to tell, or no channel
        problem = problem or self._node_problem(ctx, node, "recv", write=True)
        call, problem = self._prepare(problem, ctx, "recv", node, (), (node,), deadline)
        self.comm._handshake("recv", node, source, tag, deadline, problem)  # raises the problem after it
        assert call is not None
        self._enqueue(call, lambda p: self.lib.ncclRecv(p[0], node.size, call.dt, source, self.handle, p[-1]))

    # -- machinery ------------------------------------------------------------------------

    def _start(self, timeout: float | None) -> tuple[float, Exception | None]:
        self.check()
        return self.comm._start(self.timeout if timeout is None else timeout)  # a broken MPI side refuses too

    def _node_problem(self, ctx: Any, node: Any, kind: str, *, write: bool) -> Exception | None:
        problem = _node_problem(ctx, node, f"nccl {kind}", write=write)
        if problem is None and ctx.device is not self.device:
            problem = InvalidArgumentError(f"nccl {kind}: {ctx.device.device_id} is not this NcclComm's "
                                           f"device {self.device.device_id}")
        return problem

    def _join(self, kind: str, ctx: Context, node: Node, reads: tuple[Node, ...], writes: tuple[Node, ...], *,
              out_node: Node | None = None, op: str | None = None, root: int = -1,
              timeout: float | None) -> _Call:
        """The MPI join of a collective; a rank whose own arguments are wrong, or whose
        preparation of the call fails, refuses it there (Comm._refuse_on), so no rank is left
        waiting, and no rank's NCCL kernel waits for a peer that will not launch its own."""
        deadline, problem = self._start(timeout)
        writes_node = kind == "all_reduce" or (kind == "broadcast" and root != self.comm.rank)
        problem = problem or self._node_problem(ctx, node, kind, write=writes_node)
        if out_node is not None:
            gather = kind == "all_gather"
            problem = problem or self._node_problem(ctx, out_node, f"{kind} (out_node)", write=True) or \
                (_out_problem(node, out_node, self.comm.size, kind, gather=True) if gather
                 else _out_problem(out_node, node, self.comm.size, kind, gather=False))
        if op is not None:
            problem = problem or _op_problem(op, node)
        if kind == "broadcast":
            problem = problem or self.comm._rank_problem(root, "broadcast root")
        call, problem = self._prepare(problem, ctx, kind, node, reads, writes, deadline)
        self.comm._refuse_on(problem, kind, node, deadline)
        self.comm._join(self.comm._header(kind, op=op, node=node, root=root), kind, node, deadline)
        assert call is not None
        return call

    def _prepare(self, problem: Exception | None, ctx: Context, kind: str, node: Node, reads: tuple[Node, ...],
                 writes: tuple[Node, ...], deadline: float) -> tuple[_Call | None, Exception | None]:
        """Everything a call needs from this rank before it joins: the exports that pin the
        nodes' pools, the event records, the stream. A failure here becomes the call's problem
        (after the join, the other ranks would have enqueued kernels that wait for this one)."""
        if problem is not None:
            return None, problem
        try:
            dt = _nccl_dtype(node)
            ctx.stream.check_usable()
            _make_current(self.device)  # again at the launch, on this thread: a failure shows here first
            exports = tuple(ctx.export(n) for n in (*reads, *writes))  # pins the pools until the event is done
            stream = ctypes.c_void_p(int(ctx.device.driver.foreign_stream(ctx.stream.handle)))  # type: ignore[attr-defined]
            events = tuple(node_events(ctx, n, f"nccl {kind}") for n in (*reads, *writes))
        except Exception as e:  # refused on every rank, raised here after the join
            return None, e
        return _Call(ctx, kind, node, dt, exports, stream, events[:len(reads)], events[len(reads):], deadline), None

    def _enqueue(self, call: _Call, fn: Any) -> None:
        from polyjit.core.streams import enqueue

        pointers = [ctypes.c_void_p(e.address) for e in call.exports]
        lib, what = self.lib, f"nccl {call.kind}{_of(call.node)}"

        def launch() -> None:
            _make_current(self.device)
            _check(lib, fn([*pointers, call.stream]), what)

        event = enqueue(call.ctx.stream, call.reads, call.writes, f"nccl {call.kind}", launch, (), call.exports)
        # tracked whatever the deadline (inf never passes): the watchdog polls asynchronous errors too
        self._watch.track(event, call.deadline, what)

    def async_error(self) -> str | None:
        err = ctypes.c_int(0)
        if self.lib.ncclCommGetAsyncError(self.handle, ctypes.byref(err)) or err.value in (0, 7):  # 7: in progress
            return None
        text = self.lib.ncclGetErrorString(err.value)
        return f"NCCL reported an asynchronous error {err.value} ({text.decode() if text else '?'})"

    def abort(self, why: str) -> None:
        """Abort the NCCL communicator (ends its kernels); later calls raise ``why``."""
        if self._broken is None:
            self._broken = why
            with contextlib.suppress(Exception):
                self.lib.ncclCommAbort(self.handle)

    def check(self) -> None:
        """Raise what the watchdog found (a timeout or an asynchronous NCCL error)."""
        if self._broken is not None:
            raise CollectiveTimeoutError(f"rank {self.comm.rank}: NCCL communicator aborted: {self._broken}",
                                         collective="nccl")

    def close(self) -> None:
        """Stop the watchdog (and wait for it: it may be calling into the communicator), wait
        for the calls in flight, then destroy the communicator."""
        self._watch.stop.set()
        thread = self._watch.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        if self._broken is None:
            self.device.synchronize()
            _check(self.lib, self.lib.ncclCommDestroy(self.handle), "ncclCommDestroy")
            self._broken = "the communicator was closed"


def _nccl_dtype(node: Node) -> int:
    """The ncclDataType_t of ``node``."""
    dt = _DTYPES.get(node.dtype.name)
    if dt is None:
        raise DTypeMismatchError(f"nccl: {node.label} is {node.dtype}, which has no NCCL datatype")
    return dt


def _nccl_op(node: Node, op: str) -> int:
    """The ncclRedOp_t of ``op`` on ``node`` (an op _op_problem accepted)."""
    return _BOOL_OPS[op] if node.dtype.name == "bool" else _OPS[op]


@attrs.frozen
class _Call:
    """One call, prepared before its join: what its launch needs and what it keeps alive."""

    ctx: Context
    kind: str
    node: Node
    dt: int
    exports: tuple[Any, ...]
    stream: ctypes.c_void_p
    reads: tuple[Any, ...]
    writes: tuple[Any, ...]
    deadline: float


def _make_current(device: Device) -> None:
    from cuda.core import Device as CoreDevice

    CoreDevice(device.ordinal).set_current()
