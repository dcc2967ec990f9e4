"""Collectives on context nodes over an mpi4py communicator.

Every call runs in three steps (docs/distributed.md, "Design"):

0. **local order**: ``ctx.host_view(node, write=...)`` waits for the node's last writer (and,
   when the collective writes the node, its readers) and gives the node's memory itself on
   the cpu backend (zero-copy), a host copy elsewhere (copied back after the collective).
   What fails here on one rank (a device fault in the node's writer) refuses the call in
   step 1, as a wrong argument does: every rank joins every numbered call.
   With a CUDA-aware MPI and a node on a CUDA device, MPI gets ``ctx.export(node)`` (device
   memory) after the same waits. The host returns once the data is in place, so routines
   enqueued before and after a collective need no waits from the user. (Waiting first also
   keeps the host from spinning on MPI while the device -- on the cpu backend, a worker
   thread that may share the rank's core -- still computes the node.)
1. **join**: each rank sends a small header (the collective, its call number on this
   communicator, op, root or tag, dtype, shape; see ``header.py``) to every other rank on a
   private duplicate of the communicator, with ``Isend`` / ``Irecv``, and tests the receives
   until the deadline. A rank whose header has arrived has joined; at the deadline the ranks
   whose headers have not arrived are the ones that did not join, and the call raises
   :class:`CollectiveTimeoutError` naming them. Once every header is in, every rank compares
   them all and, if they differ, raises :class:`CollectiveMismatchError` -- every rank, since
   every rank sees the same headers -- before any data moves.
2. **data**: the non-blocking collective (``Iallreduce``, ``Ibcast``, ``Iallgather``,
   ``Ireduce_scatter_block``, ``Isend`` / ``Irecv``) on a second duplicate, in place on the
   node's memory, tested until done or the same deadline.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import math
import numbers
import operator
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, TypeVar, cast

import ml_dtypes
import numpy as np
from mpi4py import MPI
from mpi4py.util import dtlib

from polyjit.core.context import Context
from polyjit.core.dtypes import is_int
from polyjit.core.errors import (
    CollectiveMismatchError,
    CollectiveRefusedError,
    CollectiveTimeoutError,
    DriverError,
    DTypeMismatchError,
    FinalizedError,
    InvalidArgumentError,
    PolyjitError,
    ShapeMismatchError,
    UnsupportedError,
)
from polyjit.core.ir import Node
from polyjit.distributed import header
from polyjit.distributed.cuda import mpi_cuda_aware, on_cuda
from polyjit.distributed.header import OPS
from polyjit.distributed.hugepages import HUGE_PAGES_FROM, huge_pages
from polyjit.distributed.ordering import divide_in_place, wait_on_host
from polyjit.distributed.wait import poll

Array = np.ndarray[Any, Any]

DEFAULT_TIMEOUT = 300.0  # seconds; POLYJIT_MPI_TIMEOUT or set_default_timeout() change it
TIMEOUT_ENV = "POLYJIT_MPI_TIMEOUT"
# Tags on the control communicator: a rank's withdrawal (see Comm._withdraw), collective
# headers, then two per user tag of send / recv.
TAG_WITHDRAW = 0
TAG_JOIN = 1
TAG_P2P = 2

_default_timeout: float | None = None


def default_timeout() -> float:
    """The timeout of a new Comm, in seconds: ``set_default_timeout``, else
    ``$POLYJIT_MPI_TIMEOUT``, else 300 s. ``inf`` waits for ever."""
    if _default_timeout is not None:
        return _default_timeout
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if text:
        try:
            value = float(text)
        except ValueError:
            raise InvalidArgumentError(f"{TIMEOUT_ENV}={text!r} is not a number of seconds") from None
        return _check_timeout(value, TIMEOUT_ENV)
    return DEFAULT_TIMEOUT


def set_default_timeout(seconds: float | None) -> None:
    """Set the timeout (seconds) of the Comms made from now on; None goes back to the
    environment's / the default."""
    global _default_timeout
    _default_timeout = None if seconds is None else _check_timeout(seconds, "the default timeout")


def _check_timeout(value: Any, what: str) -> float:
    # not float(value): it takes "5" and True
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{what}: a timeout is a number of seconds, got {value!r}")
    seconds = float(value)
    if not seconds > 0:  # also refuses NaN
        raise InvalidArgumentError(f"{what}: a timeout must be positive, got {value!r}")
    return seconds


Method = TypeVar("Method", bound=Callable[..., Any])


def one_call(method: Method) -> Method:
    """A public call of a Comm (or an NcclComm, which shares its Comm's lock): one at a time,
    so its number, header and data go together. A thread that waits for another thread's
    call waits within its own timeout (found by review: a call of 1 s waited out another's
    6 s), and the call's deadline runs from when it began to wait."""
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        asked = kwargs.get("timeout")
        try:
            seconds = self.timeout if asked is None else _check_timeout(asked, "timeout=")
        except InvalidArgumentError:  # the call's own problem, raised after its join (_start)
            seconds = self.timeout
        start = time.monotonic()
        wait = seconds if seconds < threading.TIMEOUT_MAX else -1
        if not self._lock.acquire(timeout=wait):
            raise CollectiveTimeoutError(
                f"rank {self.rank}: {method.__name__}: another thread's call on this Comm held it for the whole "
                f"{seconds:g} s of this call's timeout; nothing was sent, and the Comm carries on",
                collective=method.__name__)
        try:
            self._lock_deadline = start + seconds if math.isfinite(seconds) else math.inf
            self._exposed = None
            return method(self, *args, **kwargs)
        except BaseException as e:
            joined = self._exposed
            if joined is not None and self._broken is None:  # joined, data not yet moved: the peers wait for it
                self._interrupted(e, joined, None, None)
            raise
        finally:
            self._exposed = None
            self._lock_deadline = None
            self._lock.release()
    return cast(Method, call)


class Comm:
    """Collectives on context nodes among the ranks of an mpi4py communicator.

    ``Comm(comm=None, timeout=None, cuda_aware=None)``: over ``comm`` (default
    ``MPI.COMM_WORLD``), which it duplicates twice (a collective call: every rank of
    ``comm`` makes its Comm at the same point). ``timeout``: seconds any call may take
    (default :func:`default_timeout`; ``comm.timeout = ...`` changes it, and every call takes
    ``timeout=`` too). ``cuda_aware``: hand CUDA nodes to MPI as device memory (default:
    :func:`mpi_cuda_aware`).

    Every call is collective over the communicator (``send`` / ``recv``: over the pair) and
    must be made by every rank in the same order with the same nodes (by name), shapes, dtypes,
    ops and roots.
    Argument errors of one rank (an unknown op, an ``out_node`` of the wrong shape), and
    failures while it takes the node's buffers (a device fault in the node's writer), are
    raised on that rank after the join, and every other rank raises CollectiveRefusedError
    naming it, so no rank is left waiting and the calls stay numbered alike. Making a Comm is
    itself collective (``MPI_Comm_idup``, tested until the timeout). Any thread may call a
    Comm: calls take turns, and calls that threads make at once pair between the ranks in the
    order each rank takes them (as with MPI and NCCL, order them to pair them as you mean; a
    call paired with another node's raises CollectiveMismatchError on every rank). ``free()``
    (or a ``with`` block) releases its two MPI communicators, of which MPI holds about two
    thousand.
    """

    def __init__(self, comm: Any = None, *, timeout: float | None = None, cuda_aware: bool | None = None) -> None:
        base = MPI.COMM_WORLD if comm is None else comm
        if isinstance(base, Comm):
            base = base.mpi
        if not isinstance(base, MPI.Comm):
            raise InvalidArgumentError(f"Comm needs an mpi4py communicator, got {type(base).__name__}")
        if base == MPI.COMM_NULL:
            raise InvalidArgumentError("Comm needs a communicator, got MPI.COMM_NULL (no ranks)")
        if base.Is_inter():  # found by review: its calls reduced over one rank, without an error
            raise InvalidArgumentError("Comm needs an intracommunicator, got an intercommunicator "
                                       "(Merge() it into one first)")
        self.mpi: Any = base
        self.rank = int(base.Get_rank())
        self.size = int(base.Get_size())
        self._timeout = default_timeout() if timeout is None else _check_timeout(timeout, "Comm(timeout=)")
        self.cuda_aware = mpi_cuda_aware() if cuda_aware is None else bool(cuda_aware)
        self._seconds = self.timeout
        self._data, self._ctl = self._dup_pair(base)
        tag_ub = base.Get_attr(MPI.TAG_UB)
        self._max_tag = (int(tag_ub) if tag_ub else 32767) // 2 - TAG_P2P
        # Any thread may call: one call at a time, so a call's number, its header and its data
        # go together. Calls that threads make at once pair between the ranks in the order each
        # rank takes them; the header's node names catch a pairing of two different nodes.
        self._lock = threading.RLock()
        self._lock_deadline: float | None = None  # the deadline of the call that took it (one_call)
        self._seq = 0  # collective calls so far
        self._p2p_seq: dict[tuple[str, int, int], int] = {}
        self._broken: str | None = None
        self._exposed: str | None = None  # the kind of a call joined whose data has not moved yet (one_call)
        self._freed = False
        self._abandoned: list[Any] = []  # buffers MPI may still touch after a timeout: never freed
        self.last_timings: dict[str, float] = {}
        # A peer's withdrawal, listened for from the start (see _withdraw).
        self._notice = np.zeros(header.LENGTH, np.int64)
        self._notice_status = MPI.Status()
        self._notice_req: Any = self._ctl.Irecv(self._notice, source=MPI.ANY_SOURCE, tag=TAG_WITHDRAW)
        self._withdrawn: int | None = None  # the peer that withdrew
        _listening.add(self)
        with Comm._live_lock:
            Comm._live += 1

    _live = 0  # Comms of this process not freed (each holds two MPI communicators)
    _live_lock = threading.Lock()
    # Per base communicator (its handle), the duplications a Comm() that timed out or was
    # interrupted left posted or made, oldest first: the next Comm() takes them before it posts
    # any (found by review: a new Idup paired with the peer's duplication of the abandoned one,
    # and the two ranks' Comms crossed). One Comm() of a base communicator at a time (its lock,
    # taken within the call's timeout): the pairs go in order.
    _pending_dups: collections.defaultdict[int, collections.deque[tuple[Any, Any]]] = \
        collections.defaultdict(collections.deque)
    _dup_locks: collections.defaultdict[int, threading.Lock] = collections.defaultdict(threading.Lock)
    _dup_locks_lock = threading.Lock()

    def __enter__(self) -> Comm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def _dup_pair(self, base: Any) -> tuple[Any, Any]:
        """The data and the control communicators: two ``MPI_Comm_idup``, tested until the
        timeout (a rank that never makes its Comm)."""
        key = base.py2f()
        deadline = time.monotonic() + self.timeout if math.isfinite(self.timeout) else math.inf
        with Comm._dup_locks_lock:
            lock = Comm._dup_locks[key]
        if not lock.acquire(timeout=self.timeout if self.timeout < threading.TIMEOUT_MAX else -1):
            raise CollectiveTimeoutError(
                f"rank {self.rank}: Comm(): another thread's Comm() of this communicator held it for the whole "
                f"{self.timeout:g} s of this one's timeout; nothing was duplicated", collective="Comm()")
        try:
            data = self._dup(base, key, deadline)
            try:
                return data, self._dup(base, key, deadline)
            except DriverError:
                with contextlib.suppress(Exception):
                    data.Free()
                raise
            except BaseException:  # timed out or interrupted: the next Comm() starts with this pair
                Comm._pending_dups[key].appendleft((data, None))
                raise
        finally:
            lock.release()

    def _dup(self, base: Any, key: int, deadline: float) -> Any:
        left = Comm._pending_dups[key]
        try:
            new, req = left.popleft() if left else base.Idup()
        except MPI.Exception as e:
            raise self._out_of_communicators(e) from None
        try:
            pending = [] if req is None else poll([req], deadline, patient=True)
        except MPI.Exception as e:
            raise self._out_of_communicators(e) from None
        except BaseException:  # interrupted: kept for the next Comm()
            left.appendleft((new, req))
            raise
        if pending:
            left.appendleft((new, req))
            raise CollectiveTimeoutError(
                f"rank {self.rank}: Comm(): duplicating the communicator timed out after {self.timeout:g} s: "
                "a rank did not make its Comm (every rank makes its Comms at the same point)",
                collective="Comm()")
        return new

    def _out_of_communicators(self, e: Any) -> DriverError:
        """MPICH holds about two thousand communicators."""
        return DriverError(
            f"rank {self.rank}: Comm(): MPI could not duplicate the communicator ({_mpi_reason(e)}); "
            f"{Comm._live} Comms of this process are not freed: free those no longer used "
            "(Comm.free(), or `with Comm() as comm:`)")

    @property
    def timeout(self) -> float:
        """Seconds any call may take (``inf``: for ever); set it to a positive number (NaN,
        zero and negative values are refused: InvalidArgumentError)."""
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._timeout = _check_timeout(seconds, "Comm.timeout")

    def __repr__(self) -> str:
        state = ", broken" if self._broken else ""
        return f"Comm(rank {self.rank} of {self.size}, timeout {self.timeout:g} s{state})"

    # -- collectives ----------------------------------------------------------------------

    @one_call
    def all_reduce(self, ctx: Context, node: Node, op: str = "sum", *, timeout: float | None = None,
                   peek: Callable[[Array], None] | None = None) -> None:
        """Reduce the node over the ranks, in place: every rank ends with the result. ``op``:
        "sum", "max", "min" or "mean" (floating dtypes). On bool nodes sum and max are a
        logical or, min a logical and (numpy's ``+``, ``maximum``, ``minimum``).
        ``peek(values)``: called with the result while it is on the host (cpu and staged
        paths), before routines after the call can change it."""
        deadline, problem = self._start(timeout)
        problem = problem or _node_problem(ctx, node, "all_reduce", write=True) or _op_problem(op, node)
        with contextlib.ExitStack() as stack:
            problem, views = self._enter(stack, problem, (ctx, node, True), reduce=op)
            self._refuse_on(problem, "all_reduce", node, deadline)
            ((buf, host),) = views
            self._join(self._header("all_reduce", op=op, node=node), "all_reduce", node, deadline)
            t0 = time.perf_counter()
            if self.size > 1:
                req = self._data.Iallreduce(MPI.IN_PLACE, buf, _mpi_op(op, node))
                self._complete([req], deadline, "all_reduce", node, (buf, host), ctx)
            self._finish_mean(ctx, node, host, op)
            if peek is not None and host is not None:
                peek(host)
            self.last_timings = {"data": time.perf_counter() - t0}

    @one_call
    def broadcast(self, ctx: Context, node: Node, root: int = 0, *, timeout: float | None = None) -> None:
        """Every rank's node gets ``root``'s values."""
        deadline, problem = self._start(timeout)
        problem = problem or self._rank_problem(root, "broadcast root") or \
            _node_problem(ctx, node, "broadcast", write=self.rank != root)
        with contextlib.ExitStack() as stack:
            problem, views = self._enter(stack, problem, (ctx, node, self.rank != root))
            self._refuse_on(problem, "broadcast", node, deadline)
            ((buf, host),) = views
            self._join(self._header("broadcast", node=node, root=root), "broadcast", node, deadline)
            if self.size == 1:
                return
            req = self._data.Ibcast(buf, root=root)
            self._complete([req], deadline, "broadcast", node, (buf, host), ctx)

    @one_call
    def all_gather(self, ctx: Context, node: Node, out_node: Node, *, timeout: float | None = None) -> None:
        """Every rank's ``out_node`` gets the nodes of all ranks in rank order, along axis 0:
        ``out_node`` has shape ``(size * n, ...)`` for a node of shape ``(n, ...)``, or
        ``(size, *node.shape)``."""
        deadline, problem = self._start(timeout)
        problem = problem or _node_problem(ctx, node, "all_gather", write=False) or \
            _node_problem(ctx, out_node, "all_gather (out_node)", write=True) or \
            _out_problem(node, out_node, self.size, "all_gather", gather=True)
        with contextlib.ExitStack() as stack:
            problem, views = self._enter(stack, problem, (ctx, node, False), (ctx, out_node, True))
            self._refuse_on(problem, "all_gather", node, deadline)
            (sbuf, shost), (rbuf, rhost) = views
            self._join(self._header("all_gather", node=node), "all_gather", node, deadline)
            req = self._data.Iallgather(sbuf, rbuf)
            self._complete([req], deadline, "all_gather", node, (sbuf, shost, rbuf, rhost), ctx, out_node)

    @one_call
    def reduce_scatter(self, ctx: Context, node: Node, out_node: Node, op: str = "sum", *,
                       timeout: float | None = None) -> None:
        """Reduce the node over the ranks and give rank r block r of the result along axis 0:
        for a node of shape ``(size * n, ...)`` (or ``(size, *out_node.shape)``), ``out_node``
        has shape ``(n, ...)``. Ops as :meth:`all_reduce`."""
        deadline, problem = self._start(timeout)
        problem = problem or _node_problem(ctx, node, "reduce_scatter", write=False) or \
            _node_problem(ctx, out_node, "reduce_scatter (out_node)", write=True) or \
            _op_problem(op, node) or _out_problem(out_node, node, self.size, "reduce_scatter", gather=False)
        with contextlib.ExitStack() as stack:
            problem, views = self._enter(stack, problem, (ctx, node, False), (ctx, out_node, True), reduce=op)
            self._refuse_on(problem, "reduce_scatter", node, deadline)
            (sbuf, shost), (rbuf, rhost) = views
            self._join(self._header("reduce_scatter", op=op, node=node), "reduce_scatter", node, deadline)
            if self.size > 1:
                req = self._data.Ireduce_scatter_block(sbuf, rbuf, _mpi_op(op, node))
                self._complete([req], deadline, "reduce_scatter", node, (sbuf, shost, rbuf, rhost), ctx, out_node)
            elif rhost is not None and shost is not None:
                rhost[...] = shost.reshape(rhost.shape)
            else:
                _copy_device(ctx, node, out_node)
            self._finish_mean(ctx, out_node, rhost, op)

    @one_call
    def barrier(self, *, timeout: float | None = None) -> None:
        """Wait for every rank (the join phase alone: it names the ranks that do not come)."""
        deadline, problem = self._start(timeout)
        self._refuse_on(problem, "barrier", None, deadline)
        self._join(self._header("barrier"), "barrier", None, deadline)

    @one_call
    def send(self, ctx: Context, node: Node, dest: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Send the node to rank ``dest``, whose matching :meth:`recv` (same tag) receives it.
        Synchronous, like ``MPI_Ssend``: it returns once the receiver has the data, so two
        ranks that send to each other must order their calls (one sends first)."""
        deadline, problem = self._start(timeout)
        self._check_peer(dest, tag, "send")  # else there is no one to tell, or no channel
        problem = problem or _node_problem(ctx, node, "send", write=False)
        with contextlib.ExitStack() as stack:
            problem, views = self._enter(stack, problem, (ctx, node, False))
            self._handshake("send", node, dest, tag, deadline, problem)  # raises the problem after it
            ((buf, host),) = views
            req = self._data.Isend(buf, dest=dest, tag=tag)
            self._complete([req], deadline, "send", node, (buf, host), ctx)

    @one_call
    def recv(self, ctx: Context, node: Node, source: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Receive into the node what rank ``source`` sends with :meth:`send` (same tag); the
        dtype and shape must be the sender's (else both raise CollectiveMismatchError)."""
        deadline, problem = self._start(timeout)
        self._check_peer(source, tag, "recv")  # else there is no one to tell, or no channel
        problem = problem or _node_problem(ctx, node, "recv", write=True)
        with contextlib.ExitStack() as stack:
            problem, views = self._enter(stack, problem, (ctx, node, True))
            self._handshake("recv", node, source, tag, deadline, problem)  # raises the problem after it
            ((buf, host),) = views
            req = self._data.Irecv(buf, source=source, tag=tag)
            self._complete([req], deadline, "recv", node, (buf, host), ctx)

    # -- host arrays --------------------------------------------------------------------------

    @one_call
    def all_reduce_array(self, array: Array, op: str = "sum", *, timeout: float | None = None) -> Array:
        """:meth:`all_reduce` of a host array (a new array: metrics, spreads, checks)."""
        deadline, problem = self._start(timeout)
        arr, node, bad = _host_array(array, "all_reduce_array")
        problem = problem or bad or _op_problem(op, node)
        self._refuse_on(problem, "all_reduce", None, deadline)
        hdr = self._header("all_reduce", op=op, shape=arr.shape, dtype=arr.dtype)
        self._join(hdr, "all_reduce", None, deadline)
        work = _mpi_array(arr.reshape(-1), reduce=True)
        if self.size > 1:
            req = self._data.Iallreduce(MPI.IN_PLACE, work, _mpi_op_dtype(op, work.dtype))
            self._complete([req], deadline, "all_reduce", None, (arr, work), None)
        if op == "mean":
            np.divide(work, self.size, out=work)
        if work.dtype != arr.dtype:
            _write_back(arr.reshape(-1), work)
        return arr

    @one_call
    def broadcast_array(self, array: Array, root: int = 0, *, timeout: float | None = None) -> Array:
        """:meth:`broadcast` of a host array: every rank gets a new array with root's values
        (every rank passes an array of the same shape and dtype)."""
        deadline, problem = self._start(timeout)
        arr, _, bad = _host_array(array, "broadcast_array")
        problem = problem or bad or self._rank_problem(root, "broadcast root")
        self._refuse_on(problem, "broadcast", None, deadline)
        hdr = self._header("broadcast", root=root, shape=arr.shape, dtype=arr.dtype)
        self._join(hdr, "broadcast", None, deadline)
        if self.size > 1:
            req = self._data.Ibcast(_mpi_array(arr.reshape(-1), reduce=False), root=root)
            self._complete([req], deadline, "broadcast", None, arr, None)
        return arr

    @one_call
    def check_same(self, what: str, values: Sequence[int], *, timeout: float | None = None) -> None:
        """Raise CollectiveMismatchError on every rank unless every rank passes the same
        integers (set-up checks: device counts, batch sizes)."""
        deadline, problem = self._start(timeout)
        try:
            ints = [operator.index(v) for v in values]
        except TypeError:
            ints, problem = [], problem or InvalidArgumentError(
                f"rank {self.rank}: check_same({what!r}) takes integers, got {values!r}")
        wide = [v for v in ints if not -(2**63) <= v < 2**63]
        if wide:  # the header carries int64s
            ints, problem = [], problem or InvalidArgumentError(
                f"rank {self.rank}: check_same({what!r}) takes integers of int64, got {wide[0]}")
        self._refuse_on(problem, "check", None, deadline)
        hdr = self._header("check", shape=ints, dtype=np.int64)
        self._join(hdr, "check", None, deadline, what=what)

    @one_call
    def refuse(self, error: Exception, collective: str = "all_reduce", node: Node | None = None, *,
               timeout: float | None = None) -> NoReturn:
        """Take part in this rank's next call without making it, because the work before it
        failed here: join with the refusal flag set, then raise ``error``. The other ranks'
        call (``collective``, of ``node``) raises CollectiveRefusedError naming this rank and
        the call, and the Comm stays in step. ``data_parallel``'s step uses it when its local
        part (the shards' checks, the compute) fails on one rank."""
        if collective not in header.KINDS or collective in ("send", "recv"):
            raise InvalidArgumentError(f"rank {self.rank}: refuse: {collective!r} is not a collective "
                                       f"({', '.join(k for k in header.KINDS if k not in ('send', 'recv'))})")
        deadline, problem = self._start(timeout)
        if not isinstance(error, BaseException):  # found by review: a bare TypeError here, after the join
            problem = problem or InvalidArgumentError(
                f"rank {self.rank}: refuse takes the exception to raise, got {type(error).__name__} {error!r}")
        self._refuse_on(problem or error, collective, node, deadline)
        raise error  # not reached: the join raises it

    # -- the two phases ---------------------------------------------------------------------

    def _start(self, timeout: float | None) -> tuple[float, Exception | None]:
        """The call's deadline, and what is wrong with its timeout (the call then refuses
        within the Comm's own timeout: see :meth:`_refuse_on`)."""
        if self._freed:
            raise FinalizedError(f"rank {self.rank}: this Comm was freed (Comm.free); make a new one")
        if self._broken is not None:
            raise CollectiveTimeoutError(
                f"rank {self.rank}: this Comm cannot be used any more: {self._broken} (MPI cannot "
                "cancel a collective, so the ranks no longer agree on what comes next; end the job)")
        problem = None
        try:
            seconds = self.timeout if timeout is None else _check_timeout(timeout, "timeout=")
        except InvalidArgumentError as e:
            seconds, problem = self.timeout, e
        self._seconds = seconds
        # from when the call began to wait for the Comm (one_call), not from now
        deadline, self._lock_deadline = self._lock_deadline, None
        if deadline is None:
            deadline = time.monotonic() + seconds if math.isfinite(seconds) else math.inf
        return deadline, problem

    def _enter(self, stack: contextlib.ExitStack[Any], problem: Exception | None, *views: tuple[Context, Node, bool],
               reduce: str | None = None) -> tuple[Exception | None, list[tuple[Any, Array | None]]]:
        """Step 0 of a call: enter the buffers of ``(ctx, node, write)`` (the waits for the
        node's events, the host views; ``reduce``: the op MPI reduces them with) on ``stack``. What fails here (a device fault in the
        node's writer, a copy) is this rank's own problem, returned to refuse the call with:
        every rank joins every numbered call, whatever failed on it before."""
        opened: list[tuple[Any, Array | None]] = []
        if problem is None:
            try:
                for ctx, node, write in views:
                    opened.append(stack.enter_context(self._buffer(ctx, node, write=write, reduce=reduce)))
            except Exception as e:  # raised on this rank after the join
                problem = e
        return problem, opened

    def _refuse_on(self, problem: Exception | None, kind: str, node: Any, deadline: float) -> None:
        """A rank whose own arguments are wrong, or whose preparation of the call failed, joins
        the call with its refusal flag set and raises its error after the join; every other
        rank raises CollectiveRefusedError naming it. Raising at once would leave them waiting
        (then broken, at their timeout), or pair their call with this rank's next one."""
        if problem is None:
            return
        shown = node if isinstance(node, Node) else None
        self._join(self._header(kind, node=shown, refused=True), kind, shown, deadline, problem)
        raise problem  # not reached: the join raises it (with the flag set, on one rank too)

    def _header(self, kind: str, *, op: str | None = None, node: Node | None = None, root: int = -1,
                shape: Sequence[int] | None = None, dtype: Any = None, refused: bool = False) -> Array:
        name = ""
        if node is not None:
            shape, dtype, name = node.shape, node.dtype.np, node.name
        h = header.make(self._seq, kind, op=op, root=root, dtype=dtype, shape=shape or (), name=name)
        self._seq += 1  # once the header is made: a call numbered here joins
        if refused:
            h[header.FLAG] = 1
        return h

    def _join(self, hdr: Array, kind: str, node: Node | None, deadline: float, problem: Exception | None = None,
              what: str | None = None) -> None:
        """Phase 1: exchange headers with every rank; raise on a timeout, a refusal, a mismatch."""
        n, me = self.size, self.rank
        if n > 1:
            got = np.zeros((n, header.LENGTH), np.int64)
            got[me] = hdr
            peers = [r for r in range(n) if r != me]
            rreqs = [self._ctl.Irecv(got[r], source=r, tag=TAG_JOIN) for r in peers]
            sreqs = [self._ctl.Isend(hdr, dest=r, tag=TAG_JOIN) for r in peers]
            keep = (got, hdr, rreqs, sreqs)
            pending = self._poll(rreqs, deadline, kind, node, keep, patient=True)
            if pending:
                missing = tuple(peers[i] for i in pending)
                self._cancel_or_break([rreqs[i] for i in pending], kind, node, keep)
                self._fail_timeout(kind, node, missing, (got, hdr, sreqs))
            if self._poll(sreqs, deadline, kind, node, keep, patient=True):  # their receives are posted
                self._fail_timeout(kind, node, (), (got, hdr, sreqs))
            if self._peer_withdrew():  # its header came, and then it gave the call up
                self._fail_timeout(kind, node, (), (got, hdr, sreqs))
            headers = [got[r] for r in range(n)]
        else:
            headers = [hdr]
        refused = [r for r, h in enumerate(headers) if h[header.FLAG]]
        if refused:
            if problem is not None:
                raise problem
            raise CollectiveRefusedError(
                f"rank {me}: {kind}{_of(node)}: {header.ranks_text(refused)} refused the call "
                f"(its own error says why), no data was moved: {header.describe(headers[refused[0]])}",
                collective=kind, ranks=tuple(refused))
        differ = header.disagreement(headers)
        if differ is not None:
            label = what or kind
            raise CollectiveMismatchError(
                f"rank {me}: {label}{_of(node)}: the ranks disagree, no data was moved: {differ}")
        # Joined: the peers now post the data; whatever interrupts this call before its data has
        # moved breaks the Comm (one_call; found by review: an interrupt between the join and the
        # data's post left the peer waiting its whole timeout)
        self._exposed = kind if n > 1 and kind not in ("check", "barrier") else None

    def _handshake(self, kind: str, node: Node, peer: int, tag: int, deadline: float,
                   problem: Exception | None = None) -> None:
        """Phase 1 of send / recv: the sender and the receiver swap headers. With ``problem``
        (this rank's own arguments are wrong) the header says so, the peer raises
        CollectiveMismatchError, and this rank raises ``problem``."""
        key = (kind, peer, tag)
        seq = self._p2p_seq.get(key, 0)
        self._p2p_seq[key] = seq + 1
        shown = node if problem is None else None
        mine = header.make(seq, kind, root=tag, dtype=shown.dtype.np if shown else None,
                           shape=shown.shape if shown else ())  # no name: a send of a into b is a pair
        if problem is not None:
            mine[header.FLAG] = 1
        theirs = np.zeros(header.LENGTH, np.int64)
        out_tag, in_tag = (TAG_P2P + 2 * tag, TAG_P2P + 2 * tag + 1)
        if kind == "recv":
            out_tag, in_tag = in_tag, out_tag
        rreq = self._ctl.Irecv(theirs, source=peer, tag=in_tag)
        sreq = self._ctl.Isend(mine, dest=peer, tag=out_tag)
        keep = (theirs, mine, rreq, sreq)
        if self._poll([rreq], deadline, kind, node, keep, patient=True):
            self._cancel_or_break([rreq], kind, node, keep)
            # found by review: two ranks that both send to each other read as "did not join"
            hint = f"; if rank {peer} is in a send to this rank too, one of the two must receive first" \
                if kind == "send" else ""
            self._fail_timeout(kind, node, (peer,), (theirs, mine, sreq), hint=hint)
        if self._poll([sreq], deadline, kind, node, keep, patient=True) or self._peer_withdrew():
            self._fail_timeout(kind, node, (), (theirs, mine, sreq))
        if problem is not None:
            raise problem
        if theirs[header.FLAG]:  # without a problem of its own, this rank's node is a Node
            raise CollectiveRefusedError(
                f"rank {self.rank}: {kind} of {node.label}: rank {peer} refused its side of the pair (its own "
                f"error says why), no data was moved: {header.describe(theirs)}", collective=kind, ranks=(peer,))
        send, recv = (mine, theirs) if kind == "send" else (theirs, mine)
        differ = header.pair_disagreement(send, recv)
        if differ is not None:
            sender, receiver = (self.rank, peer) if kind == "send" else (peer, self.rank)
            raise CollectiveMismatchError(
                f"rank {self.rank}: {kind} of {node.label}: rank {sender} sends, rank {receiver} receives, "
                f"and they disagree, no data was moved: {differ}")
        self._exposed = kind  # as after a join

    def _complete(self, requests: list[Any], deadline: float, kind: str, node: Node | None, keep: Any,
                  ctx: Context | None, *more: Node) -> None:
        """Phase 2: wait for the data until the deadline (or a peer's withdrawal)."""
        def pins() -> list[Any]:
            held: list[Any] = [keep, requests]
            if ctx is not None:  # the node's memory itself may be MPI's buffer: keep it allocated
                for n in (node, *more):
                    if n is not None:
                        with contextlib.suppress(PolyjitError):
                            held.append(ctx.export(n))
            return held

        try:
            pending = poll(requests, deadline, stop=self._peer_withdrew)
        except BaseException as e:
            self._interrupted(e, kind, node, pins())
            raise
        if pending:
            self._fail_timeout(kind, node, (), pins(), joined=True)
        self._exposed = None  # the data moved: what the call does next is its own

    def _poll(self, requests: list[Any], deadline: float, kind: str, node: Node | None, keep: Any, *,
              patient: bool) -> list[int]:
        """:func:`poll` of a call's header requests (or a peer's withdrawal), but what interrupts it
        breaks the Comm (:meth:`_interrupted`)."""
        try:
            return poll(requests, deadline, patient=patient, stop=self._peer_withdrew)
        except BaseException as e:
            self._interrupted(e, kind, node, keep)
            raise

    def _cancel_or_break(self, requests: list[Any], kind: str, node: Node | None, keep: Any) -> None:
        """Cancel a timed-out call's header receives (a wait of up to a second), the call's
        buffers kept first: an interrupt there breaks the Comm (found by review: the Comm was
        left unbroken, its posted header unpinned)."""
        self._abandoned.append(keep)
        try:
            self._cancel(requests)
        except BaseException as e:
            self._interrupted(e, kind, node, keep)
            raise

    def _interrupted(self, error: BaseException, kind: str, node: Node | None, keep: Any) -> None:
        """A call's wait interrupted (a KeyboardInterrupt, an exception a signal handler raised)
        while MPI held its buffers and requests: they are kept for ever, this Comm refuses every
        later call, and the peers are told (as after a timeout). Found by review: a Ctrl-C in
        an all_reduce left its header receive posted, which swallowed the next call's header."""
        self._abandoned.append(keep)
        self._broken = f"{kind}{_of(node)} was interrupted ({type(error).__name__})"
        self._exposed = None
        with contextlib.suppress(BaseException):
            self._withdraw(kind)

    def _fail_timeout(self, kind: str, node: Node | None, missing: tuple[int, ...], keep: Any,
                      joined: bool = False, hint: str = "") -> None:
        """Raise CollectiveTimeoutError; what MPI may still touch is kept for ever, and this
        Comm refuses every later call. Where a peer withdrew, its rank is named; else this
        rank withdraws (tells every peer)."""
        self._abandoned.append(keep)
        what = f"{kind}{_of(node)}"
        after = f"after {self._seconds:g} s"
        gone = self._withdrawn
        if gone is not None and missing:  # ranks not here yet, and one that gave up on them
            who = header.ranks_text(missing)
            msg = (f"rank {self.rank}: {what} failed: {who} of {self.size} did not join, and rank {gone} gave "
                   f"this Comm up meanwhile (its {header.describe(self._notice)} timed out or was interrupted "
                   "there)")
        elif gone is not None:  # every header came: the one that left
            msg = (f"rank {self.rank}: {what} failed: rank {gone} of {self.size} gave this Comm up "
                   f"(its {header.describe(self._notice)} timed out or was interrupted there), so the ranks "
                   "no longer meet")
            missing = (gone,)
        elif missing:
            who = header.ranks_text(missing)
            msg = (f"rank {self.rank}: {what} timed out {after}: {who} of {self.size} did not join "
                   f"(no header from {'it' if len(missing) == 1 else 'them'} before the deadline){hint}")
        elif joined:
            msg = (f"rank {self.rank}: {what} timed out {after}: every rank joined, but the data did "
                   "not arrive before the deadline (a rank stalled or died during the transfer)")
        else:
            msg = f"rank {self.rank}: {what} timed out {after} while the ranks exchanged headers"
        if gone is None:
            self._withdraw(kind)
        self._broken = f"{what} timed out" if gone is None else f"rank {gone} gave it up"
        raise CollectiveTimeoutError(msg, collective=kind, node=node.label if node is not None else "",
                                     missing=missing)

    def _withdraw(self, kind: str) -> None:
        """Tell every peer this rank gave the Comm up. Found by review: a rank whose call had
        timed out left its header posted, so a peer that came late took it for a join, posted
        its data and waited its whole timeout (with ``inf``, for ever, at 100% CPU); a peer
        now fails at once, naming this rank. The notice is the header of this rank's last
        call; its buffer and requests are kept (never waited for: the peer may never come)."""
        notice = header.make(max(self._seq - 1, 0), kind)
        sends = [self._ctl.Isend(notice, dest=r, tag=TAG_WITHDRAW) for r in range(self.size) if r != self.rank]
        self._abandoned.append((notice, sends))

    def _stop_listening(self) -> None:
        """Cancel the receive of a withdrawal notice (before MPI ends: a receive still posted
        then made UCX warn at every exit)."""
        _listening.discard(self)
        self._cancel([self._notice_req])

    def _peer_withdrew(self) -> bool:
        """Whether a peer's withdrawal notice has come (tested as calls wait)."""
        if self._withdrawn is None and self._notice_req.Test(self._notice_status):
            self._withdrawn = int(self._notice_status.Get_source())
        return self._withdrawn is not None

    @staticmethod
    def _cancel(requests: Sequence[Any]) -> None:
        for req in requests:
            with contextlib.suppress(Exception):
                req.Cancel()
        poll(list(requests), time.monotonic() + 1.0)  # a cancelled receive completes locally

    # -- buffers ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _buffer(self, ctx: Context, node: Node, *, write: bool, reduce: str | None = None
                ) -> Iterator[tuple[Any, Array | None]]:
        """What MPI reads or writes for the node, ordered by its events: (buffer, host array or
        None when the buffer is device memory). MPI has no bfloat16: a bfloat16 node goes
        through the host, as its 16-bit patterns where MPI only moves it, as a float32 copy
        where MPI reduces it (written back rounded once: see :func:`_mpi_array`). A float
        max or min folds on the host too (its op is numpy's: :func:`_nan_op`)."""
        device_op = reduce is None or not _folds_on_host(reduce, node.dtype.np)
        if self.cuda_aware and on_cuda(ctx) and node.dtype.np != BFLOAT16 and device_op:
            wait_on_host(ctx, node, write=write)
            exported = ctx.export(node)
            try:
                yield exported, None
            finally:
                exported.release()
            return
        with ctx.host_view(node, write=write) as values:
            flat = values.reshape(-1)
            if flat.nbytes >= HUGE_PAGES_FROM:
                huge_pages(flat)
            buf = _mpi_array(flat, reduce is not None)
            yield buf, buf
            if write and reduce and buf is not flat:
                _write_back(flat, buf)  # the reduced float32 values, rounded once

    def _finish_mean(self, ctx: Context, node: Node, host: Array | None, op: str) -> None:
        if op != "mean" or self.size == 1:
            return
        if host is not None:
            np.divide(host, self.size, out=host)
        else:
            divide_in_place(ctx, node, self.size)

    # -- checks -------------------------------------------------------------------------------

    def _rank_problem(self, rank: Any, what: str) -> Exception | None:
        if not is_int(rank) or not 0 <= rank < self.size:
            return InvalidArgumentError(f"rank {self.rank}: {what} {rank!r} is not a rank of this "
                                        f"communicator (0..{self.size - 1})")
        return None

    def _check_peer(self, peer: Any, tag: Any, what: str) -> None:
        problem = self._rank_problem(peer, f"{what} peer")
        if problem is None and int(peer) == self.rank:
            problem = InvalidArgumentError(f"rank {self.rank}: {what} to itself")
        if problem is None and (not is_int(tag) or not 0 <= tag <= self._max_tag):
            problem = InvalidArgumentError(f"rank {self.rank}: {what} tag {tag!r} is outside 0..{self._max_tag}")
        if problem is not None:
            raise problem

    @one_call
    def free(self) -> None:
        """Free the two duplicates of the communicator (collective). A Comm broken by a
        timeout keeps them: MPI may still use them."""
        if self._freed:
            return
        if self._broken is None:
            self._stop_listening()
            for c in (self._data, self._ctl):
                with contextlib.suppress(Exception):
                    c.Free()
        self._freed = True
        with Comm._live_lock:
            Comm._live -= 1


# ---------------------------------------------------------------------------------------------

# Comms whose withdrawal receive is posted (held until freed: a dropped Comm's receive would
# stay posted all the same); cancelled at exit, before MPI_Finalize (mpi4py's, registered when
# it was imported, runs after this module's hook).
_listening: set[Comm] = set()


@atexit.register
def _stop_listening_at_exit() -> None:
    if MPI.Is_initialized() and not MPI.Is_finalized():
        for comm in list(_listening):
            with contextlib.suppress(Exception):
                comm._stop_listening()


def _mpi_reason(e: Exception) -> str:
    """The most specific line of an MPI error's stack (MPICH's first is "Other MPI error")."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__


def _of(node: Node | None) -> str:
    return f" of {node.label} {node.shape} {node.dtype}" if node is not None else ""


def _node_problem(ctx: Any, node: Any, what: str, *, write: bool) -> Exception | None:
    """What is wrong with a call's context and node (a rank refuses the call with it)."""
    if not isinstance(ctx, Context):
        return InvalidArgumentError(f"{what} needs a Context first, got {type(ctx).__name__}")
    if not isinstance(node, Node):
        return InvalidArgumentError(f"{what} needs a Node, got {type(node).__name__}")
    try:
        ctx.check_alive()
        if write:
            ctx.writable_loc(node, what)  # NodeNotInContextError, ReadOnlyNodeError
        else:
            ctx.loc(node, what)
    except PolyjitError as e:
        return e
    return None


def _host_array(array: Any, what: str) -> tuple[Array, Node, Exception | None]:
    """A private contiguous copy of a host array, a node that describes it, and what is
    wrong with it (a dtype no node has: complex, object)."""
    try:
        arr = np.array(array, order="C")  # a copy of its shape (ascontiguousarray made 0-d arrays 1-d)
        return arr, Node("array", arr.shape, arr.dtype), None
    except PolyjitError as e:
        problem: Exception = e
    except (TypeError, ValueError) as e:
        problem = InvalidArgumentError(f"{what}: not an array of numbers: {e}")
    return np.zeros(0, np.float32), Node("array", (0,)), problem


def _op_problem(op: Any, node: Node) -> Exception | None:
    if op not in OPS:
        return InvalidArgumentError(f"unknown reduction op {op!r}: one of {', '.join(OPS)}")
    if op == "mean" and not node.dtype.is_float:
        return DTypeMismatchError(f"op 'mean' needs a floating dtype; {node.label} is {node.dtype}")
    return None


def _out_problem(small: Node, big: Node, size: int, what: str, *, gather: bool) -> Exception | None:
    """``big`` must hold ``size`` blocks of ``small`` along axis 0, of the same dtype."""
    if small is big:  # MPI may not send from and receive into one buffer (it raised mpi4py's Exception)
        return InvalidArgumentError(f"{what}: node and out_node are the same node, {small.label}: the result "
                                    "needs a node of its own")
    if small.dtype != big.dtype:
        return DTypeMismatchError(f"{what}: {small.label} is {small.dtype}, {big.label} is {big.dtype}")
    stacked = (size, *small.shape)
    joined = (size * small.shape[0], *small.shape[1:]) if small.shape else None
    if big.shape not in (stacked, joined):
        want = " or ".join(str(s) for s in (joined, stacked) if s is not None)
        name = "out_node" if gather else "node"
        return ShapeMismatchError(f"{what} over {size} ranks: {name} {big.label} has shape {big.shape}, "
                                  f"expected {want} for {small.label} {small.shape}")
    return None


BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def _mpi_array(flat: Array, reduce: bool) -> Array:
    """What MPI gets for a flat host array: the array itself, but for bfloat16, which MPI has
    no datatype for: its 16-bit patterns (``uint16``, the same memory) where MPI only moves
    it, a float32 copy where MPI reduces it (max and min are exact; a sum is rounded once, when
    the caller writes the float32 result back to bfloat16). float16 is reduced in float32 too
    (found by review: a mean of 40000s summed to inf in float16, where numpy's is finite)."""
    if flat.dtype == np.float16 and reduce:
        return flat.astype(np.float32)
    if flat.dtype != BFLOAT16:
        return flat
    return flat.astype(np.float32) if reduce else flat.view(np.uint16)


def _write_back(flat: Array, work: Array) -> None:
    """The float32 result of a half type's reduction, rounded once into the array (a sum past
    the type's range is inf, as numpy's own float16 sum is)."""
    with np.errstate(over="ignore"):
        flat[...] = work


def _mpi_op(op: str, node: Node) -> Any:
    return _mpi_op_dtype(op, node.dtype.np)


def _mpi_op_dtype(op: str, dtype: Any) -> Any:
    if np.dtype(dtype) == np.bool_:
        if op == "mean":
            raise UnsupportedError("op 'mean' on a bool node")
        return MPI.LAND if op == "min" else MPI.LOR
    if _folds_on_host(op, dtype):
        return _nan_op(op)
    return {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]


def _folds_on_host(op: str, dtype: Any) -> bool:
    """A float max or min: MPI's own (MPICH's ``a > b ? a : b``) drops a NaN or keeps it by
    the order the ranks' values meet in, so ranks ended with different values (found by
    review: ``[2, 2, nan]`` over three ranks); it folds with numpy's instead."""
    dt = np.dtype(dtype)
    return op in ("max", "min") and (dt.kind == "f" or dt == BFLOAT16)


_nan_ops: dict[str, Any] = {}
_nan_ops_lock = threading.Lock()


def _nan_op(op: str) -> Any:
    """An MPI op (made once) that folds with ``np.maximum`` / ``np.minimum``: NaN wins, as in
    numpy, whatever order the values meet in, so every rank ends with the same values (on the
    host: 2-3x the time of MPI's own max, found by review; max and min only)."""
    with _nan_ops_lock:
        made = _nan_ops.get(op)
        if made is None:
            fold = np.maximum if op == "max" else np.minimum

            def combine(inbuf: Any, inoutbuf: Any, datatype: Any, max_: bool = op == "max") -> None:
                dtype = dtlib.to_numpy_dtype(datatype)
                a, out = np.frombuffer(inbuf, dtype), np.frombuffer(inoutbuf, dtype)
                res = fold(a, out)
                # Bit for bit the same whichever operand comes first (the ranks fold in other
                # orders; found by review): +0 and -0 compare equal, so max takes +0 and min -0
                # in either order, and every NaN becomes numpy's one NaN.
                zero = (a == 0) & (out == 0)
                if zero.any():
                    res[zero] = a[zero] + out[zero] if max_ else -((-a[zero]) + (-out[zero]))
                nan = np.isnan(res)
                if nan.any():
                    res[nan] = np.nan
                out[...] = res

            made = _nan_ops[op] = MPI.Op.Create(combine, commute=True)
        return made


def _copy_device(ctx: Context, src: Node, dst: Node) -> None:
    """One rank's reduce_scatter with the result in device memory: the node is the result."""
    values = ctx.read(src)
    ctx.from_host(dst, values.reshape(dst.shape))
