"""A device of a backend: its streams, pools, constants, loaded modules and merge buffer.

Releases are stream-ordered: a pool that its context frees (``finalize()``, or the
garbage collector) is handed back to the driver only once every piece of work that
touched it is complete, never under a running kernel. What the garbage collector
drops (contexts, loaded modules, streams) is queued and released at the device's next
safe point (:meth:`Device.reap`, run under the device lock by every enqueue, link and
allocation), so a finalizer never re-enters the runtime in the middle of an operation.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import itertools
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from polyjit.core import slab
from polyjit.core.dtypes import is_int
from polyjit.core.errors import (
    DeviceFaultError,
    DriverError,
    InvalidArgumentError,
    InvalidProgramError,
    PolyjitError,
    PoolExhaustedError,
    StreamClosedError,
    UnknownDeviceError,
)
from polyjit.core.ir import Node
from polyjit.core.log import logger
from polyjit.core.protocol import DeviceInfo, Driver
from polyjit.core.slab import MERGE_POOL, BufferLoc
from polyjit.core.streams import AllOf, Event, Stream, Tracker, enqueue

if TYPE_CHECKING:
    from polyjit.core.context import Context
    from polyjit.core.runtime import Backend


@attrs.define
class MergeState:
    handle: Any = None
    nbytes: int = 0
    node: Node | None = None
    generation: int = 0


class LoadedModule:
    """A binary loaded on one device. Routines and the work in flight hold it; when the last of
    them lets go, the driver unloads it (at the device's next safe point)."""

    __slots__ = ("__weakref__", "binary", "device", "handle")

    def __init__(self, device: Device, binary: Any, handle: Any) -> None:
        self.device = device
        self.binary = binary
        self.handle = handle

    def __del__(self) -> None:
        try:  # not contextlib.suppress: at interpreter shutdown the module's globals may be None
            if getattr(self.device.driver, "unload", None) is not None:  # its failure: a DriverError
                self.device.released.append(functools.partial(self.device.unload, self.handle))
        except Exception:
            pass


def driver_call(where: str, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """A driver call whose failure becomes a typed error naming the device and the operation."""
    try:
        return fn(*args)
    except PolyjitError:
        raise
    except MemoryError as e:
        raise PoolExhaustedError(f"{where}: {what}: {e}") from e
    except Exception as e:
        raise DriverError(f"{where}: {what} failed: {type(e).__name__}: {e}") from e


_LIVE: weakref.WeakSet[Device] = weakref.WeakSet()  # every device made, while it lives


def live_devices() -> list[Device]:
    return list(_LIVE)


def _release_failed(device: Device, error: Exception) -> None:
    """What a dropped object's release raised, reported as a finalizer's failure is (a warning
    naming the device), not raised into the run, sync or close that reached the safe point
    (found by review: another context's failed release failed an unrelated run())."""
    warnings.warn(f"polyjit: giving back what a dropped object held on {device.label} failed: "
                  f"{type(error).__name__}: {error}", RuntimeWarning, stacklevel=2)


_exit_lock = threading.Lock()
_closed_at_exit: set[type[Driver]] = set()


def close_devices_at_exit(driver_type: type[Driver]) -> None:
    """Have every device of ``driver_type`` closed at exit (:meth:`Device.close_at_exit`) by an
    exit hook registered now, once per type. Call it right after the driver's library loads:
    exit hooks run last first, so the devices close before that library's own exit code runs,
    and a daemon thread still running routines gets StreamClosedError, not a library torn
    down under it (PoCL aborted the process; the cpu runtime's workers were joined)."""
    with _exit_lock:
        if driver_type not in _closed_at_exit:
            _closed_at_exit.add(driver_type)
            atexit.register(_close_devices, driver_type)


def _close_devices(driver_type: type[Driver], calls_wait_s: float = 10.0, wait_s: float = 1.0) -> None:
    """The exit hook: every device first (new work refused at once, on all of them before any
    wait), then queued work (``wait_s``), what is still queued dropped where the driver can,
    then threads inside a host wait and compiles under way (``calls_wait_s``), each against
    one deadline for all the devices (a wait each made an exit beside several stuck devices
    take N times as long)."""
    from polyjit.core.runtime import live_backends

    devices = [dev for dev in live_devices() if isinstance(dev.driver, driver_type) and not dev.forked]
    calls_deadline = _close_at_exit(devices, wait_s, calls_wait_s, discard=True)
    for backend in live_backends():  # those that made no device compile too
        if isinstance(backend.driver, driver_type):
            with contextlib.suppress(Exception):
                backend.close_compiles_at_exit(calls_deadline)


def _close_at_exit(devices: list[Device], wait_s: float, calls_wait_s: float, *, discard: bool) -> float:
    """Close ``devices`` at exit (Device.close_at_exit): refuse new work on all of them, give
    queued work ``wait_s``, drop what is still queued where ``discard`` and the driver can,
    then give threads inside a host wait ``calls_wait_s``; one deadline each for all the
    devices. Returns the calls' deadline. What fails on one device does not stop the rest."""
    closing = []
    for dev in devices:
        with contextlib.suppress(Exception):  # the exit goes on
            closing.append((dev, dev._refuse_at_exit()))
    deadline = time.monotonic() + wait_s
    for dev, (_, newest) in closing:
        with contextlib.suppress(Exception):
            dev._wait_queued_at_exit(newest, deadline)
    # What is still queued after that second is dropped where the driver can (the cpu
    # runtime, process-wide: only the exit hook asks): threads blocked on it (a host wait, an
    # enqueue into a full queue) then return within the kernels running now, instead of after
    # all of it (found by review: daemon threads that queued runs without waiting kept the
    # exit for minutes).
    drop = getattr(closing[0][0].driver, "discard_queued", None) if discard and closing else None
    if drop is not None:
        for dev, _ in closing:  # before the drop: a wait it ends must know why (Event.synchronize)
            dev.discarded = True
        with contextlib.suppress(Exception):
            drop()
    calls_deadline = time.monotonic() + calls_wait_s
    for dev, (streams, _) in closing:
        with contextlib.suppress(Exception):
            dev._wait_calls_at_exit(streams, calls_deadline)
    return calls_deadline


_scope = threading.local()  # the thread's stack of devices entered with ``with device:``


def scoped_device() -> Device | None:
    """The device of the innermost ``with device:`` block of this thread, if any."""
    stack = getattr(_scope, "stack", None)
    return stack[-1] if stack else None


class Device:
    """One device of a backend: its pools, streams, per-node events and merge buffer.
    ``with device:`` makes it the default device of this thread inside the block."""

    def __init__(self, backend: Backend, ordinal: int) -> None:
        self.backend = backend
        self.driver: Driver = backend.driver
        self.ordinal = ordinal
        self.device_id = f"{backend.name}:{ordinal}"
        self.name = self.device_id
        self.info: DeviceInfo = driver_call(self.label, "device_info", self.driver.device_info, ordinal)
        self.name = self.info.name
        self.properties: Mapping[str, Any] = MappingProxyType(
            {"memory_bytes": self.info.memory_bytes, "compute_units": self.info.compute_units,
             "base_alignment": self.info.base_alignment, **self.info.properties}
        )
        # One lock per device guards its tracker, pools, streams and modules, and makes each
        # enqueue (waits, the driver call, the event behind it) atomic: any thread may call in.
        self.lock = threading.RLock()
        self.tracker = Tracker()
        self.merge = MergeState()
        # Held across a copy into the merge buffer and the routines that read it, so that no
        # other thread's copy lands in between (data_parallel's all-reduce holds it per round;
        # every copy into the merge buffer takes it). Taken before the device locks, never
        # while holding one, one device's at a time.
        self.merge_lock = threading.RLock()
        self._pools: dict[int, tuple[Any, int]] = {}  # live pools: (driver handle, bytes counted as used)
        self._extent: dict[int, int] = {}  # live pools' bytes, adopted ones too (what memset_zero may reach)
        # (events, pool id, handle, bytes): freed once those events are done and it is unpinned
        self.freeing: list[tuple[list[Event], int, Any, int]] = []
        self._pins: dict[int, int] = {}  # pool id -> exported views alive
        self._peak = 0  # the most bytes of pools held at once
        self._external: dict[int, Callable[[], None]] = {}  # adopted pools: how to give them back
        self.released: collections.deque[Callable[[], None]] = collections.deque()
        self._reaping = False
        self._reaper_lock = threading.Lock()
        self._reaper_running = False  # a closed device's reaper thread (_reap_on_a_thread)
        self._pool_ids = slab.PoolIds()
        self._streams: weakref.WeakSet[Stream] = weakref.WeakSet()
        self.forked = False  # this process is a fork of the one that made the device
        self.exiting = False  # closed at exit (close_at_exit): nothing new reaches the driver
        self.closed = False  # close() ended every stream after its work: no safe point comes again
        self.discarded = False  # at exit, work not yet begun was dropped (see _close_at_exit)
        _LIVE.add(self)
        self._stream_index = itertools.count()
        self._modules: weakref.WeakValueDictionary[int, LoadedModule] = weakref.WeakValueDictionary()
        self._constants: dict[bytes, tuple[BufferLoc, int]] = {}  # content -> (loc, refcount)
        self._constant_locs: set[BufferLoc] = set()
        self.default_stream = self.new_stream()

    def __repr__(self) -> str:
        return f"Device({self.device_id} {self.name!r})"

    def __str__(self) -> str:
        return self.device_id

    def __enter__(self) -> Device:
        stack = getattr(_scope, "stack", None)
        if stack is None:
            stack = _scope.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _scope.stack.pop()

    @property
    def label(self) -> str:
        return f"{self.device_id} ({self.name})"

    # -- streams ---------------------------------------------------------------

    def new_stream(self) -> Stream:
        """A new in-order queue on this device; ``close()`` it (or use ``with``) when done."""
        with self.lock:
            self.check_open("new_stream")
            self.reap(poll=True)  # streams dropped with work in flight end once it is done
            handle = driver_call(self.label, "new_stream", self.driver.new_stream, self.ordinal)
            s = Stream(self, handle, next(self._stream_index))
            self._streams.add(s)
            self.backend.stream_handles.add(handle)
        return s

    def forget_stream(self, stream: Stream) -> None:
        self._streams.discard(stream)

    def close_stream_handle(self, handle: Any) -> None:
        self.backend.stream_handles.discard(handle)
        close = getattr(self.driver, "close_stream", None)
        if close is not None:
            driver_call(self.label, "close_stream", close, handle)

    def after_fork_in_child(self) -> None:
        """This process is a fork of the one that made the device, and none of the driver's
        threads (the CPU's stream workers, PoCL's, CUDA's) came with it: work enqueued here
        would wait forever. Every stream of the device now refuses work (ForkedError), a wait
        on them returns, and nothing is given back to the driver (the child's copies of the
        parent's buffers go with the child). Runs in the child right after the fork, on its
        only thread: the locks are replaced, since a parent thread may have held them."""
        self.lock = threading.RLock()
        self.merge_lock = threading.RLock()
        self._reaper_lock = threading.Lock()
        self._reaper_running = False
        self.forked = True
        for s in list(self._streams):
            s.reset_after_fork()
        self.released.clear()
        self.freeing = []
        self._external.clear()

    def close(self) -> None:
        """Wait for all work, give back what dropped objects held, and end every stream,
        the default one included. For a Backend made for a while (a wrapped driver, a test):
        the registry's backends live as long as the process."""
        with contextlib.suppress(DeviceFaultError):
            self.synchronize()
        with self.lock:
            self.reap(wait=True)
            for s in self.streams():
                if s is not self.default_stream:
                    s.close()
            default = self.default_stream
            if not default.closed:
                with contextlib.suppress(DeviceFaultError):
                    default.synchronize()
                with default._lock:
                    default._close_when_idle()
                self.forget_stream(default)
                default.completed(default.seq)
                self.close_stream_handle(default.handle)
            self.closed = True
            self.reap()  # what was dropped while it closed

    def check_open(self, what: str) -> None:
        """Refuse a driver call that would start after close_at_exit (the device lock held)."""
        if self.exiting:
            raise StreamClosedError(f"{self.device_id}: {what} refused: the process is exiting, and the "
                                    "device was closed at exit")

    def close_at_exit(self, wait_s: float = 1.0, calls_wait_s: float = 10.0) -> None:
        """For an exit hook: refuse new work on every stream at once (a thread that enqueues
        more gets StreamClosedError), and new streams, pools, loads and bindings of kernels (the
        driver calls made under the device lock, so none is under way once it holds it); give
        threads inside a host wait up to ``calls_wait_s`` seconds to return (what they wait for
        can no longer grow; one still inside the driver when its library's exit code runs may
        crash the process), and what is queued up to ``wait_s`` seconds to finish. Not
        :meth:`close`, which waits for all of it: a daemon thread that went on running routines
        queued more than it could finish, and the process never exited."""
        _close_at_exit([self], wait_s, calls_wait_s, discard=False)

    def _refuse_at_exit(self) -> tuple[list[Stream], list[Any]]:
        """close_at_exit's first step: refuse new work; the streams, and their newest events."""
        with self.lock:
            self.exiting = True
            newest = [s.newest for s in self._streams if not s.closed and s.newest is not None]
            for s in self._streams:
                s.closed = True  # enqueue refuses; a host wait not yet begun returns at once
            return list(self._streams), newest

    def _wait_calls_at_exit(self, streams: list[Stream], deadline: float) -> None:
        """Until ``deadline``: threads inside a driver call on a stream (a host wait) return."""
        for s in streams:
            with s._lock:
                while s._users and time.monotonic() < deadline:
                    s._idle.wait(max(0.0, deadline - time.monotonic()))

    def _wait_queued_at_exit(self, newest: list[Any], deadline: float) -> None:
        """Until ``deadline``: what was queued finishes."""
        for handle in newest:
            while time.monotonic() < deadline:
                try:
                    if self.driver.event_done(handle):
                        break
                except Exception:
                    break
                time.sleep(0.001)

    def make_context(self, stream: Stream | None = None) -> Context:
        """A root context on this device (on ``stream``, default: the device's). Use it as
        ``with device.make_context() as ctx:`` to finalize what was linked into it on exit."""
        from polyjit.core.context import Context

        if stream is not None and not isinstance(stream, Stream):
            raise InvalidArgumentError(f"make_context takes a Stream of {self.device_id}, not {type(stream).__name__}")
        stream = stream or self.default_stream
        if stream.device is not self:
            raise UnknownDeviceError(f"{stream!r} belongs to {stream.device.device_id}, not {self.device_id}")
        stream.check_usable()
        return Context(self, stream, None, {}, None, ())

    def streams(self) -> list[Stream]:
        with self.lock:
            return [s for s in self._streams if not s.closed]

    def all_work(self) -> AllOf:
        """An event behind the work of every stream of the device (a stream another thread
        closes meanwhile has none left)."""
        return AllOf([e for e in (s.record_if_open() for s in self.streams()) if e is not None])

    def synchronize(self) -> None:
        """Wait for all work on this device, then release what waited for it."""
        faults: list[DeviceFaultError] = []
        for s in self.streams():
            try:
                s.synchronize()
            except DeviceFaultError as e:
                faults.append(e)
        self.reap(poll=True)
        if faults:
            raise faults[0]

    def is_idle(self) -> bool:
        """Whether every stream's work is done (records no event: Stream.is_idle)."""
        return all(s.is_idle() for s in self.streams())

    # -- safe points -------------------------------------------------------------

    def release_later(self, release: Callable[[], None]) -> None:
        """Queue what a dropped object gives back (a garbage collector's finalizer may run on a
        thread holding any lock: taking the device lock there deadlocked) for the next safe
        point. A closed device reaches none again (found by review: its releases leaked), so
        this is one, or, where another thread holds the device, a thread of its own waits."""
        self.released.append(release)
        if self.closed and not self.reap(blocking=False):
            self._reap_on_a_thread()

    def _reap_on_a_thread(self) -> None:
        """A closed device whose lock another thread holds: a thread of its own waits for the
        lock and reaps (this one may hold any lock; that one holds none). Skipping it leaked
        (found by review: 400 views dropped beside a thread reading memory_stats())."""
        with self._reaper_lock:
            if self._reaper_running:
                return  # it reaps what was queued before it looks for more, under this lock
            self._reaper_running = True
        threading.Thread(target=self._reap_until_empty, name=f"polyjit-reap-{self.label}", daemon=True).start()

    def _reap_until_empty(self) -> None:
        try:
            while True:
                self.reap()
                with self._reaper_lock:
                    if not self.released:
                        self._reaper_running = False
                        return
        except BaseException:
            with self._reaper_lock:
                self._reaper_running = False
            raise

    def reap(self, poll: bool = False, wait: bool = False, blocking: bool = True) -> bool:
        """Run the releases the garbage collector queued, and free the pools whose work is done
        (``poll``: ask the driver about events not yet known complete, each stream's newest too;
        ``wait``: block for them).
        ``blocking=False`` skips it when another thread holds the device: a thread that learns
        of a completed event while it holds another device's lock must not wait for this one;
        it returns False then (True: reaped, or a reap on this thread's stack will)."""
        if self.forked:  # nothing here reaches the driver (after_fork_in_child)
            self.released.clear()
            self.freeing = []
            return True
        if not self.lock.acquire(blocking):
            return False
        try:
            if self._reaping:
                return True
            self._reaping = True
            try:
                if poll:
                    self._poll_streams()
                interrupted: BaseException | None = None
                try:
                    while self.released:  # every one, whatever another raised (found by review:
                        try:              # one that raised left those queued after it for good)
                            self.released.popleft()()
                        except Exception as e:  # a finalizer's failure, not this caller's: reported
                            _release_failed(self, e)
                        except BaseException as e:  # an interrupt: raised once the queue is done
                            interrupted = interrupted or e
                    if self.freeing:
                        self._free_finished(poll, wait)
                finally:
                    if interrupted is not None:
                        raise interrupted
            finally:
                self._reaping = False
        finally:
            self.lock.release()
        return True

    def _poll_streams(self) -> None:
        """Ask about each stream's newest event. A stream dropped with work in flight is held by
        the device's own records of that work (its events, the pools its contexts used), so the
        garbage collector cannot take it: once its work is known done, what it kept goes, its
        contexts' pools follow, and then the stream itself (its finalizer ends it in the driver)."""
        for s in list(self._streams):
            newest = None if s.closed or s.seq <= s.done_seq else s.newest_event()
            if newest is not None:
                newest.is_done()
        self.tracker.forget_done()  # and the records of a buffer only read (a weight) let it go

    def _free_finished(self, poll: bool, wait: bool) -> None:
        if self.forked:
            self.freeing = []
            return
        # Taken whole: a garbage collection inside a free below may reach a safe point on this
        # thread (the lock is re-entrant) and free again what is still listed here (found by
        # review: two pools freed twice on a closed device). What it adds is kept.
        todo, self.freeing = self.freeing, []
        still: list[tuple[list[Event], int, Any, int]] = []
        errors: list[PolyjitError] = []
        for events, pid, handle, nbytes in todo:
            if pid in self._pins:  # an exported view of it is still alive
                still.append((events, pid, handle, nbytes))
                continue
            pending = []
            for ev in events:
                known = ev.seq <= ev.stream.done_seq
                if not known and (poll or wait):
                    try:
                        if wait:
                            ev.synchronize()
                            known = True
                        else:
                            known = ev.is_done()
                    except DeviceFaultError:
                        known = True  # the faulted work is over
                if not known:
                    pending.append(ev)
            if pending:
                still.append((pending, pid, handle, nbytes))
                continue
            try:
                external = self._external.pop(pid, None)
                if external is not None:  # memory another library lent: give it back to it
                    external()
                else:
                    driver_call(self.label, f"free of a pool of {nbytes} bytes", self.driver.free,
                                self.ordinal, handle)
            except PolyjitError as e:
                errors.append(e)
        self.freeing = still + self.freeing
        if errors:
            raise errors[0]

    # -- pools -----------------------------------------------------------------

    def used_memory(self) -> int:
        """Bytes of the pools that live contexts hold (exact; a pool returns when its context
        is finalized, even while the driver waits for its last work before freeing it)."""
        with self.lock:
            return sum(n for _, n in self._pools.values())

    def memory_stats(self) -> dict[str, int]:
        """used / peak / pending-free bytes of polyjit's pools on this device, how many pools
        live contexts hold (and how many of them are memory other libraries lent), and how
        many constants the device shares."""
        with self.lock:
            return {"used_bytes": self.used_memory(), "peak_bytes": self._peak,
                    "pending_free_bytes": self.pending_free_memory(), "pools": len(self._pools),
                    "lent_pools": len(self._external), "constants": len(self._constants)}

    def pending_free_memory(self) -> int:
        """Bytes of pools released by their contexts whose last work has not completed yet (or
        that an exported view still shows)."""
        with self.lock:
            return sum(entry[3] for entry in self.freeing)

    def alloc_pool(self, pool_id: int, nbytes: int, alignment: int) -> None:
        pool_id = _whole(pool_id, "alloc_pool: pool_id", self.device_id)
        nbytes = _whole(nbytes, f"alloc_pool of pool {pool_id}: nbytes", self.device_id)
        alignment = _whole(alignment, f"alloc_pool of pool {pool_id}: alignment", self.device_id)
        if alignment < 1:  # a power of two or not is the driver's to say (its base_alignment is one)
            raise InvalidArgumentError(f"alloc_pool of pool {pool_id} on {self.device_id}: the alignment is at "
                                       f"least 1, got {alignment}")
        with self.lock:
            self.check_open(f"alloc of pool {pool_id}")
            self.reap(poll=True)
            if pool_id in self._pools:
                raise InvalidProgramError(f"pool {pool_id} already exists on {self.device_id}")
            cap = self.info.memory_bytes
            if self.freeing and self.used_memory() + self.pending_free_memory() + nbytes > cap:
                self.reap(wait=True)
            used = self.used_memory()
            if used + nbytes > cap:
                raise PoolExhaustedError(
                    f"pool {pool_id} of {nbytes} bytes does not fit on {self.device_id} "
                    f"({self.name}): {used} of {cap} bytes are in use, {cap - used} free"
                )
            handle = driver_call(self.label, f"alloc of pool {pool_id} ({nbytes} bytes, {used} in use)",
                           self.driver.alloc, self.ordinal, max(nbytes, 1), alignment)
            self._pools[pool_id] = (handle, nbytes)
            self._extent[pool_id] = nbytes
            self._peak = max(self._peak, used + nbytes)
            logger.debug("%s: pool %d of %d bytes (%d in use)", self.device_id, pool_id, nbytes, used + nbytes)

    def free_pool(self, pool_id: int) -> None:
        """Release a pool: the driver frees it once the work that touches it is done."""
        with self.lock:
            try:
                handle, nbytes = self._pools.pop(pool_id)
            except KeyError:
                raise InvalidProgramError(f"{self.device_id} has no pool {pool_id}") from None
            self._extent.pop(pool_id, None)
            events = self.tracker.take_pool(pool_id, keep=pool_id == MERGE_POOL)
            self.freeing.append((events, pool_id, handle, nbytes))
            self._free_finished(poll=False, wait=False)

    def pin(self, pool_id: int) -> None:
        """Keep a pool's memory after its context lets go, while a view of it is exported."""
        with self.lock:
            self._pins[pool_id] = self._pins.get(pool_id, 0) + 1

    def unpin(self, pool_id: int) -> None:
        with self.lock:
            left = self._pins.pop(pool_id) - 1
            if left:
                self._pins[pool_id] = left
            elif self.freeing:
                self._free_finished(poll=False, wait=False)

    def adopt_pool(self, handle: Any, nbytes: int, release: Callable[[], None]) -> int:
        """A pool over memory another library lent (DLPack): ``release`` gives it back, once
        the work on it is done, instead of the driver's free. It is not counted in
        used_memory (polyjit did not allocate it)."""
        with self.lock:
            pid = self._pool_ids.take()
            self._pools[pid] = (handle, 0)
            self._extent[pid] = nbytes
            self._external[pid] = release
            return pid

    def release(self, pools: Iterable[int], constants: Iterable[BufferLoc]) -> None:
        """Give back what a context created (its finalize(), or its garbage collection)."""
        with self.lock:
            for pid in pools:
                self.free_pool(pid)
            self.release_constants(constants)

    def pool_handle(self, pool_id: int) -> Any:
        try:
            return self._pools[pool_id][0]
        except KeyError:
            raise InvalidProgramError(f"{self.device_id} has no pool {pool_id} (freed?)") from None

    def memset_zero(self, pool_id: int, offset: int, nbytes: int, stream: Stream | None = None,
                    what: str = "memset_zero") -> None:
        """Zero bytes of a pool, ordered after all work on it (on ``stream``, else the default
        stream); ``what`` names it in an error."""
        stream = stream or self.default_stream
        with self.lock:
            size = self._extent.get(pool_id)
            if size is None:
                raise InvalidProgramError(f"{self.device_id} has no pool {pool_id} (freed?)")
            offset = _whole(offset, f"{what} in pool {pool_id}: offset", self.device_id)
            nbytes = _whole(nbytes, f"{what} in pool {pool_id}: nbytes", self.device_id)
            if offset + nbytes > size:
                raise InvalidArgumentError(f"{what} on {self.device_id}: bytes {offset}..{offset + nbytes} are "
                                           f"outside pool {pool_id} of {size} bytes")
            states = (self.tracker.state(BufferLoc(pool_id, offset)),)
            enqueue(stream, (), states, what, self.driver.memset_zero,
                    (stream.handle, self.pool_handle(pool_id), offset, nbytes), None)

    def new_pool(self, nbytes: int) -> int:
        with self.lock:
            pid = self._pool_ids.take()
            self.alloc_pool(pid, nbytes, self.info.base_alignment)
        return pid

    # -- the merge buffer (pool 0) ---------------------------------------------

    def reserve_merge(self, nbytes: int) -> None:
        """Grow the merge buffer to at least nbytes. Growing moves it, so all work must finish."""
        with self.lock:
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
        with self.lock:
            hit = self._constants.get(key)
            if hit is not None:
                self._constants[key] = (hit[0], hit[1] + 1)
                return hit[0]
            pid = self.new_pool(values.nbytes)
            loc = BufferLoc(pid, 0)
            stream = self.default_stream
            enqueue(stream, (), (self.tracker.state(loc),), "copy of a constant", self.driver.copy_from_host,
                    (stream.handle, self.pool_handle(pid), 0, values), values)
            self._constants[key] = (loc, 1)
            self._constant_locs.add(loc)
            return loc

    def is_constant(self, loc: BufferLoc) -> bool:
        return loc in self._constant_locs

    def release_constants(self, locs: Iterable[BufferLoc]) -> None:
        with self.lock:
            for loc in locs:
                key = next(k for k, (v, _) in self._constants.items() if v == loc)
                at, refs = self._constants[key]
                if refs > 1:
                    self._constants[key] = (at, refs - 1)
                else:
                    del self._constants[key]
                    self._constant_locs.discard(at)
                    self.free_pool(at.pool_id)

    # -- modules -------------------------------------------------------------------

    def module(self, binary: Any) -> LoadedModule:
        """The binary loaded on this device: once while any routine of it lives."""
        with self.lock:
            hit = self._modules.get(id(binary))
            if hit is None or hit.binary is not binary:
                self.check_open("load")
                handle = driver_call(self.label, "load", self.driver.load, self.ordinal, binary)
                hit = LoadedModule(self, binary, handle)
                self._modules[id(binary)] = hit
            return hit

    def unload(self, handle: Any) -> None:
        unload = getattr(self.driver, "unload", None)
        if unload is not None:
            driver_call(self.label, "unload", unload, self.ordinal, handle)

    def loaded_modules(self) -> int:
        with self.lock:
            return len(self._modules)


def _whole(value: Any, what: str, device_id: str) -> int:
    """``value`` as a whole number of at least 0 (a size, an offset, an id), else
    InvalidArgumentError naming ``what``: the driver would take anything."""
    if not is_int(value):
        raise InvalidArgumentError(f"{what} on {device_id} is a whole number, got {value!r}")
    number = int(value)
    if number < 0:
        raise InvalidArgumentError(f"{what} on {device_id} is at least 0, got {number}")
    return number
