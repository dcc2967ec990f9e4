"""Events, streams, and what the runtime keeps alive for the work on them.

Lifetimes belong to the runtime, once for every backend: whatever a queued
operation reads or writes (a routine and its driver launch record, a host array
being copied, a driver's token for the copy) is appended to its stream's
*retained* entries together with the sequence number of the event recorded behind
it, and dropped once that event is known complete. Streams are in order, so one
completed event releases everything enqueued before it. Knowing an event is
complete costs nothing when the host already waited for it (``sync``) or saw it
done (``is_done``); otherwise the stream polls its backlog now and then.

The per-node records (:class:`Tracker`) keep, for every buffer location, the
event of its last writer and of its readers since, so that work on different
streams and devices waits on the device side, never on the host.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from polyjit.core.errors import (
    DeviceFaultError,
    DriverError,
    FinalizedError,
    ForkedError,
    InvalidArgumentError,
    PolyjitError,
    StreamClosedError,
    UnsupportedError,
)

if TYPE_CHECKING:
    from polyjit.core.protocol import Driver
    from polyjit.core.runtime import Device

# Retained entries are kept in batches of POLL_EVERY: an open list the stream appends to, and
# closed batches, oldest first. Only a batch's newest entry keeps its event's driver handle
# (the stream is in order, so the others need none, and a driver may pay for every event
# alive: PoCL's enqueue cost grows with them, 1.96 us with none kept, 2.98 us with 64), and
# completed work is released a batch at a time, not an entry at a time. Past POLL_AFTER
# entries in closed batches, closing a batch first polls the older ones (the newest, the
# middle and the oldest: three driver calls at most, whatever the backlog), so a host that
# never waits does not grow the queue without bound. Entries are counted, not events: events
# recorded between enqueues (``record()``) retain nothing and must not skip the count.
POLL_AFTER = 64
POLL_EVERY = 16


class Event:
    """A point in a stream's work. ``synchronize()`` blocks the host; ``is_done()`` polls;
    ``start.elapsed_time(end)`` gives the milliseconds between two events recorded with
    ``stream.record(timing=True)``."""

    __slots__ = ("handle", "seq", "stream", "timed")

    def __init__(self, stream: Stream, handle: Any, seq: int, timed: bool = False) -> None:
        self.stream = stream
        self.handle = handle
        self.seq = seq
        self.timed = timed

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds from this event to ``end`` on the device (both recorded with timing on,
        on streams of one device); waits for ``end``."""
        if not (self.timed and end.timed):
            raise InvalidArgumentError("elapsed_time needs two events recorded with stream.record(timing=True)")
        if end.stream.device is not self.stream.device:
            raise InvalidArgumentError(f"elapsed_time between {self.stream.device.device_id} and "
                                       f"{end.stream.device.device_id}: events of one device only")
        self.synchronize()
        end.synchronize()
        return float(self.stream.driver.elapsed_ms(self.handle, end.handle))  # type: ignore[attr-defined]

    def synchronize(self) -> None:
        """Block until the work before this event is done; raise DeviceFaultError if it failed."""
        s = self.stream
        if self.seq > s.done_seq:
            try:
                s.driver_done(self.handle, block=True)
            except Exception as e:
                s.fault(e)
            if s.device.discarded:  # the exit dropped what had not begun: this work may be
                raise StreamClosedError(  # among it (found by review: a read returned np.empty)
                    f"{s!r} of {s.device.label}: the process is exiting, and work not yet begun was "
                    "dropped (the device was closed at exit); this wait's results are not there")
            s.completed(self.seq)
        if self.seq <= s.fault_seq and s.fault_error is not None:
            raise s.fault_error

    sync = synchronize  # DESIGN.md's name (OCANNL's); synchronize is CuPy's and PyTorch's

    def is_done(self) -> bool:
        """Whether the work before this event is over (a failure is over too: ``sync`` raises it)."""
        s = self.stream
        if self.seq <= s.done_seq:
            return True
        try:
            done = s.driver_done(self.handle, block=False)
        except Exception as e:
            s.fault(e)
            return True
        if done:
            s.completed(self.seq)
        return done

    def __repr__(self) -> str:
        return f"Event({self.stream!r} #{self.seq})"


class _Freed:
    """The writer of a buffer whose pool was freed (``Tracker.take_pool``). A routine or a
    replay resolved its records at link time and may still hold them; an enqueue that reaches
    this writer, under the device lock, raises instead of launching into freed memory (a
    ``finalize()`` in another thread can come between a caller's liveness check and the lock)."""

    __slots__ = ()
    stream = None
    seq = 0

    def is_done(self) -> bool:
        raise FinalizedError("a buffer this work uses was freed: its context (or an ancestor) was finalized "
                             "or closed; link into a live context")

    def synchronize(self) -> None:
        pass  # nothing of it is left to wait for


FREED: Any = _Freed()


class AllOf:
    """Several events as one (``Device.all_work()``)."""

    def __init__(self, events: Sequence[Event]) -> None:
        self.events = tuple(events)

    def synchronize(self) -> None:
        for e in self.events:
            e.synchronize()

    sync = synchronize

    def is_done(self) -> bool:
        return all(e.is_done() for e in self.events)


class Stream:
    """An in-order queue on one device. ``close()`` (or ``with``) waits for its work and ends
    it; a stream that is garbage-collected is closed once its work is done."""

    def __init__(self, device: Device, handle: Any, index: int) -> None:
        self.device = device
        self.driver: Driver = device.driver
        self.handle = handle
        self.index = index
        self.seq = 0  # events recorded so far
        self.done_seq = 0  # the newest event known complete
        self.newest: Any = None  # the driver handle of event ``seq`` (None: its record failed)
        self.closed = False
        self.forked = False  # made in the parent of this (forked) process: see Device.after_fork_in_child
        # The last failure the driver reported, and the events it covers (all recorded by then).
        self.fault_error: DeviceFaultError | None = None
        self.fault_seq = 0
        # (event seq, what that work uses), appended by enqueues (under the device lock), and
        # the closed batches: (seq of the newest entry, its driver event, the entries). Driver
        # handles, not Events: an Event would tie the stream into a cycle.
        self._open: list[tuple[int, Any]] = []
        self._batches: collections.deque[tuple[int, Any, list[tuple[int, Any]]]] = collections.deque()
        self._lock = threading.Lock()
        self._users = 0  # host threads inside a driver call that names this stream (_in_use)
        self._idle = threading.Condition(self._lock)

    # -- recording ----------------------------------------------------------------

    def record(self, timing: bool = False) -> Event:
        """An event behind the work enqueued so far (``timing``: one ``elapsed_time`` can use)."""
        with self.device.lock:
            self.check_usable()
            if not timing:
                return self._record()
            timed = getattr(self.driver, "record_timed", None)
            if timed is None:
                raise UnsupportedError(f"the {self.device.backend.name} backend cannot time events")
            try:
                handle = timed(self.handle)
            except PolyjitError:
                raise
            except Exception as e:
                raise DriverError(f"{self.device.label}: recording a timed event failed: {e}") from e
            self.seq += 1
            self.newest = handle
            ev = Event(self, handle, self.seq, timed=True)
            self.retain(ev, handle)  # what the device writes the time into
            return ev

    def _record(self) -> Event:
        """Record an event behind the work enqueued so far (device lock held)."""
        try:
            handle = self.driver.record(self.handle)
        except PolyjitError:
            raise
        except Exception as e:
            raise DriverError(f"{self.device.device_id}: recording an event on {self!r} failed: {e}") from e
        self.seq += 1
        self.newest = handle
        return Event(self, handle, self.seq)

    def is_idle(self) -> bool:
        """Whether the work enqueued so far is done. Asks the driver about the newest event and
        records none: a marker recorded on an idle stream need not be done the moment it is made
        (a stream worker, a CUDA event), so a new one could keep an idle stream looking busy."""
        with self.device.lock:
            seq, newest = self.seq, self.newest_event()
        if seq <= self.done_seq:
            return True
        if newest is None:  # the newest work's event could not be recorded: record one now
            return self.record().is_done()
        return newest.is_done()

    def newest_event(self) -> Event | None:
        """The event of the newest work enqueued (None where its record failed); a safe point
        polls it (``Device.reap``), :meth:`is_idle` asks it. Read under the device lock."""
        return None if self.newest is None else Event(self, self.newest, self.seq)

    def driver_done(self, handle: Any, *, block: bool) -> bool:
        """Ask the driver whether an event of this stream is done (``block``: wait for it). A
        closed stream has done all its work; close() waits for the calls in progress here."""
        counted = False  # set with the count, where no interrupt can come between them
        try:
            with self._lock:  # _in_use(), inlined: a sync or a poll is on every step's path
                if self.closed:
                    return True
                self._users += 1
                counted = True
            if block:
                self.driver.event_sync(handle)
                return True
            return bool(self.driver.event_done(handle))
        finally:
            if counted:  # inlined: an interrupt (Ctrl-C) comes at a function's entry, and a count
                with self._lock:  # left behind would make close() wait for ever
                    self._users -= 1
                    if not self._users and self.closed:  # close() waits for the last one
                        self._idle.notify_all()

    @contextlib.contextmanager
    def _in_use(self) -> Iterator[bool]:
        """A host thread's call into the driver that names this stream (its events): close()
        waits for it to return before the driver frees the stream. Yields False, and counts
        nothing, when the stream is closed already (all its work is done)."""
        counted = False
        try:
            with self._lock:
                if self.closed:
                    yield False
                    return
                self._users += 1
                counted = True
            yield True
        finally:
            if counted:  # as in driver_done
                with self._lock:
                    self._users -= 1
                    if not self._users and self.closed:
                        self._idle.notify_all()

    def _close_when_idle(self) -> None:
        """Mark the stream closed, then wait for the host threads still inside a driver call
        that names it (the caller holds ``_lock``; the wait lets it go)."""
        self.closed = True
        while self._users:
            self._idle.wait()

    def retain(self, event: Event, keep: Any) -> None:
        """Keep ``keep`` alive until ``event`` (just recorded on this stream, device lock held)
        completes. Appends are atomic; releases take the stream's lock."""
        entries = self._open
        entries.append((event.seq, keep))
        if len(entries) >= POLL_EVERY:
            self.close_batch(event.handle)

    def close_batch(self, handle: Any) -> None:
        """The open entries become a batch; ``handle`` is the driver event of the newest."""
        if len(self._batches) * POLL_EVERY >= POLL_AFTER:
            self._poll()  # before closing this batch: the older ones may be done by now
        with self._lock:  # completed() may be taking the oldest entries off the open list
            entries = self._open
            self._batches.append((entries[-1][0] if entries else self.done_seq, handle, entries))
            self._open = []

    def backlog(self) -> int:
        """How many entries the stream keeps alive for work not yet known complete."""
        with self._lock:
            return sum(len(b[2]) for b in self._batches) + len(self._open)

    def _poll(self) -> None:
        """Release what completed work kept: ask the driver about the newest closed batch,
        else the middle one, else the oldest (at most three calls: the stream is in order)."""
        with self._lock:
            batches = self._batches
            n = len(batches)
            asks = [batches[k][:2] for k in dict.fromkeys((n - 1, n // 2, 0))] if n else []
        try:
            for seq, handle in asks:
                if self.driver_done(handle, block=False):
                    self.completed(seq)
                    return
        except Exception as e:
            self.fault(e)  # raised by the next sync, not by this enqueue

    def completed(self, seq: int) -> None:
        """Everything up to event ``seq`` has run: release what it kept alive."""
        with self._lock:
            if seq > self.done_seq:
                self.done_seq = seq
            batches = self._batches
            dropped: list[Any] = []
            while batches and batches[0][0] <= seq:
                dropped.append(batches.popleft())
            if not batches:  # the open entries are newer than every closed batch
                entries = self._open
                n = len(entries)  # an enqueue may append meanwhile: only these n are looked at
                if n and entries[n - 1][0] > seq:
                    n = next(k for k in range(n) if entries[k][0] > seq)
                if n:
                    dropped.append(entries[:n])
                    del entries[:n]
        del dropped  # the objects die here, outside the lock
        if self.device.freeing:
            self.device.reap(blocking=False)

    def fault(self, error: Exception) -> DeviceFaultError:
        """The driver reported that work on this stream failed. Every event recorded so far is
        over; their syncs raise the DeviceFaultError made here, which names the routines that
        were in flight. Work enqueued later runs as usual (a lost device fails its calls)."""
        if isinstance(error, DeviceFaultError):
            return error
        with self._lock:  # list() copies at once; another thread may append
            pending = [keep for b in list(self._batches) for _, keep in b[2]] + [k for _, k in list(self._open)]
        names = [getattr(_first(k), "name", None) for k in pending]
        work = ", ".join(dict.fromkeys(str(n) for n in names if n)) or "no routine (copies only)"
        self.fault_error = DeviceFaultError(
            f"{self.device.device_id} ({self.device.name}): work on {self!r} failed: "
            f"{type(error).__name__}: {error}; in flight: {work}")
        self.fault_seq = self.seq
        self.completed(self.seq)  # the failed work is over: nothing it used is needed now
        return self.fault_error

    def reset_after_fork(self) -> None:
        """In a forked child (Device.after_fork_in_child): refuse work from now on, count
        everything enqueued as over (nothing of it runs here), with fresh locks."""
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._users = 0
        self.forked = self.closed = True
        self.completed(self.seq)

    def check_usable(self) -> None:
        if self.forked:
            raise ForkedError(f"{self!r} of {self.device.label} was made before os.fork(), in the parent: "
                              "its driver's threads are not in this process; get the device again here "
                              "(polyjit.device(...) or get_backend(...).get_device(...))")
        if self.closed:
            raise StreamClosedError(f"{self!r} was closed")

    # -- waiting ------------------------------------------------------------------

    def wait(self, event: Event | AllOf) -> None:
        """Make this stream wait for ``event`` on the device side; events of another backend
        are waited for on the host."""
        if not isinstance(event, (Event, AllOf)):
            raise InvalidArgumentError(f"{self!r}.wait needs an Event (stream.record()), not {type(event).__name__}")
        with self.device.lock:
            self.check_usable()
            self._wait(event)

    def _wait(self, event: Event | AllOf) -> None:
        if isinstance(event, AllOf):
            for e in event.events:
                self._wait(e)
        elif event.stream is self or event.is_done():
            return
        elif event.stream.driver is self.driver:
            # the event's stream may be another device's, closed by a thread holding that
            # device's lock, not ours: hold it open across the call (its work is done if closed)
            with event.stream._in_use() as alive:
                if not alive:
                    return
                try:
                    self.driver.wait(self.handle, event.handle)
                except PolyjitError:
                    raise
                except Exception as e:
                    raise DriverError(f"{self.device.label}: {self!r} waiting for {event!r} failed: "
                                      f"{type(e).__name__}: {e}") from e
        else:
            event.synchronize()

    def record_if_open(self) -> Event | None:
        """An event behind the work enqueued so far, or None where another thread closed the
        stream meanwhile, which it does after its work (found by review: its StreamClosedError
        came out of Device.synchronize and all_work); at exit, StreamClosedError."""
        try:
            return self.record()
        except StreamClosedError:
            if self.closed and not self.device.exiting:
                return None
            raise

    def synchronize(self) -> None:
        if self.closed:
            return
        event = self.record_if_open()
        if event is not None:
            event.synchronize()

    # -- release --------------------------------------------------------------------

    def close(self) -> None:
        """Wait for this stream's work, then end it (its worker, its driver queue). Contexts
        on a closed stream cannot enqueue work any more. The device's default stream stays."""
        if self.closed:
            return
        if self is self.device.default_stream:
            raise StreamClosedError(f"{self!r} is the default stream of {self.device.device_id}; "
                                    "it lives as long as the device")
        while True:
            with contextlib.suppress(DeviceFaultError):  # a faulted stream still closes
                self.synchronize()
            with self.device.lock:  # no enqueue can slip in from here on
                with self._lock:
                    if self.closed:
                        return
                    if self.seq > self.done_seq:  # work came in during the wait: wait for it too
                        continue  # (marking it complete unwaited would let its reads return early)
                    self._close_when_idle()
                self.device.forget_stream(self)
                self.device.tracker.forget_reader(self)
                self.completed(self.seq)
                self.device.close_stream_handle(self.handle)
                return

    def __del__(self) -> None:
        """The garbage collector took this stream (and, in a cycle, what its retained queue
        holds, still intact here): let its last work finish, then end it in the driver."""
        if getattr(self, "closed", True) or sys.is_finalizing():  # at exit the drivers are gone
            return
        with contextlib.suppress(Exception):  # found by review: the backend's set only grew
            self.device.backend.stream_handles.discard(self.handle)
        with contextlib.suppress(Exception):  # a faulted stream: its work is over, it closes too
            self.driver.event_sync(self.driver.record(self.handle))
        close = getattr(self.driver, "close_stream", None)
        if close is not None:
            with contextlib.suppress(Exception):
                close(self.handle)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Stream({self.device.device_id}, #{self.index})"


def _first(keep: Any) -> Any:
    """What a retained entry was kept for: the first item of its (nested) tuples, a routine or
    a replay where it names one."""
    while isinstance(keep, tuple) and keep:
        keep = keep[0]
    return keep


class NodeEvents:
    """The last writer of one buffer and its readers since (the latest per stream)."""

    __slots__ = ("readers", "writer")

    def __init__(self) -> None:
        self.writer: Event | None = None
        self.readers: dict[Stream, Event] = {}

    def events(self) -> list[Event]:
        return ([self.writer] if self.writer else []) + list(self.readers.values())


class Tracker:
    """Per device: the events of every buffer location. Callers hold the device lock."""

    def __init__(self) -> None:
        self.locs: dict[Any, NodeEvents] = {}

    def state(self, loc: Any) -> NodeEvents:
        st = self.locs.get(loc)
        if st is None:
            st = self.locs[loc] = NodeEvents()
        return st

    def states(self, locs: Sequence[Any]) -> tuple[NodeEvents, ...]:
        """The event records of some buffers, resolved once (at link or capture time) so that
        each launch touches them without hashing."""
        return tuple(self.state(loc) for loc in locs)

    def take_pool(self, pool_id: int, keep: bool = False) -> list[Event]:
        """The events of all work touching a pool; its records are forgotten unless ``keep``
        (the merge pool's records are held by routines across its moves: emptied, not removed)."""
        events: list[Event] = []
        for loc in [loc for loc in self.locs if loc.pool_id == pool_id]:
            st = self.locs[loc] if keep else self.locs.pop(loc)
            events += st.events()
            st.writer, st.readers = (None if keep else FREED), {}
        return events

    def forget_done(self) -> None:
        """Drop the records of work known complete (ordering never waits for it): a dropped
        stream that read a buffer nobody writes again (a weight) was held by its record for
        ever, and with it its worker. A writer whose work failed stays: a sync on the node
        raises that failure."""
        for st in self.locs.values():
            w = st.writer
            if w is not None and w.stream is not None:  # FREED (a freed pool's) has none
                s = w.stream
                if w.seq <= s.done_seq and not (w.seq <= s.fault_seq and s.fault_error is not None):
                    st.writer = None
            if st.readers:
                done = [s for s, ev in st.readers.items() if ev.seq <= s.done_seq]
                for s in done:
                    del st.readers[s]

    def forget_reader(self, stream: Stream) -> None:
        """A closed stream reads nothing any more: drop its entries (a buffer only read, a
        weight or a constant, would keep every stream that ever read it)."""
        for st in self.locs.values():
            if stream in st.readers:
                del st.readers[stream]


def enqueue(stream: Stream, reads: Sequence[NodeEvents], writes: Sequence[NodeEvents],
            what: object, fn: Callable[..., Any], args: tuple[Any, ...], keep: Any) -> Event:
    """The one way work reaches a stream: under the device lock, wait on the device side for
    the writers of what it reads and the writers and readers of what it writes, call
    ``fn(*args)``, record an event behind it, make it the new reader / writer, and keep
    ``keep`` (plus whatever the driver returned) alive until that event completes. ``what``
    (a routine, or a word) names the work in an error. (The launch path of every routine:
    written flat, for speed.)"""
    device = stream.device
    with device.lock:
        if stream.closed:
            stream.check_usable()
        if device.released:
            device.reap()
        for st in reads:
            w = st.writer
            if w is not None and w.stream is not stream and not w.is_done():
                stream._wait(w)
        for st in writes:  # the last writer and every reader since (the hottest loop of a launch)
            w = st.writer
            if w is not None and w.stream is not stream and not w.is_done():
                stream._wait(w)
            if st.readers:
                for s, ev in list(st.readers.items()):
                    if s is not stream and not ev.is_done():
                        stream._wait(ev)
        try:
            token = fn(*args)
        except PartlyIssued as part:  # what is on the stream lives until it is done, as always
            _track_issued(stream, reads, writes, (keep, part.tokens))
            if isinstance(part.error, PolyjitError) or not isinstance(part.error, Exception):
                raise part.error from None  # its own type (a KeyboardInterrupt stays one)
            raise DriverError(f"{device.device_id} ({device.name}): {what} failed after {part.count} of "
                              f"its operations were enqueued: {type(part.error).__name__}: {part.error}"
                              ) from part.error
        except PolyjitError:
            raise
        except Exception as e:
            raise DriverError(f"{device.device_id} ({device.name}): {what} failed: "
                              f"{type(e).__name__}: {e}") from e
        except BaseException:  # an interrupt (Ctrl-C): Python raises it once a call returns, so
            _track_issued(stream, reads, writes, keep)  # the driver may have queued the work
            raise
        kept = keep if token is None else (keep, token)
        try:
            handle = stream.driver.record(stream.handle)
        except BaseException as e:  # the work is on the stream: keep what it uses
            _track_issued(stream, reads, writes, kept)
            if isinstance(e, PolyjitError) or not isinstance(e, Exception):
                raise
            raise DriverError(f"{device.device_id} ({device.name}): recording the event behind {what} "
                              f"failed: {type(e).__name__}: {e}") from e
        seq = stream.seq + 1
        try:
            stream.seq = seq
            stream.newest = handle
            ev = Event(stream, handle, seq)
            for st in reads:
                st.readers[stream] = ev
            for st in writes:
                st.writer = ev
                if st.readers:
                    st.readers = {}
            entries = stream._open  # stream.retain(ev, ...), inlined
            entries.append((seq, kept))
            if len(entries) >= POLL_EVERY:
                stream.close_batch(handle)
        except BaseException:  # an interrupt between two steps: do them all (again: each is idempotent)
            _settle(stream, reads, writes, kept, handle, seq)
            raise
    return ev


Operation = tuple[Callable[..., Any], tuple[Any, ...]]


class PartlyIssued(Exception):
    """:func:`issue` failed after its first operation: ``count`` of them are on the stream."""

    def __init__(self, error: BaseException, count: int, tokens: list[Any]) -> None:
        super().__init__(error)
        self.error, self.count, self.tokens = error, count, tokens


def partly_issued(error: BaseException, count: int, tokens: list[Any] | None = None,
                  cause: BaseException | None = None) -> NoReturn:
    """Raise ``error`` of an operation after ``count`` others of one unit of work reached the
    stream: as it is when none did, else as :class:`PartlyIssued`, so that ``enqueue`` keeps
    what those use until an event behind them (``cause``: what the driver raised, if ``error``
    wraps it). Every driver call that issues several operations (``issue``, a launch of
    several kernels, a copy in chunks) raises its failure through this."""
    cause = error if cause is None else cause
    if count:
        raise PartlyIssued(error, count, tokens or []) from cause
    if cause is error:
        raise error
    raise error from cause


def issue(ops: Sequence[Operation]) -> list[Any] | None:
    """Call driver operations in order: several as one unit of work,
    ``enqueue(stream, reads, writes, what, issue, (ops,), keep)`` (a replay's copies in, launches
    and copies out: one event, and the per-node records walked once). Returns the tokens the
    driver gave. If an operation after the first fails, ``enqueue`` still records and keeps
    alive what the ones before it use, then raises."""
    tokens: list[Any] = []
    for k, (fn, args) in enumerate(ops):
        try:
            token = fn(*args)
        except BaseException as e:  # an interrupt too: the operations before it are queued
            partly_issued(e, k, tokens)
        if token is not None:
            tokens.append(token)
    return tokens or None


def _settle(stream: Stream, reads: Sequence[NodeEvents], writes: Sequence[NodeEvents], keep: Any, handle: Any,
            seq: int) -> None:
    """The records of work that reached the stream, made whole after an interrupt came in the
    middle of making them (:func:`enqueue`): the event, the readers and writers, and what it
    keeps (kept twice, at worst, until the same event)."""
    if stream.seq < seq:
        stream.seq, stream.newest = seq, handle
    _mark(Event(stream, handle, seq), reads, writes)
    stream._open.append((seq, keep))


def _mark(ev: Event, reads: Sequence[NodeEvents], writes: Sequence[NodeEvents]) -> None:
    """``ev`` becomes the reader of ``reads`` and the writer of ``writes`` (enqueue inlines it)."""
    for st in reads:
        st.readers[ev.stream] = ev
    for st in writes:
        st.writer = ev
        st.readers = {}


def _track_issued(stream: Stream, reads: Sequence[NodeEvents], writes: Sequence[NodeEvents], keep: Any) -> None:
    """Work reached the stream, but a driver call after it failed (a later operation of
    :func:`issue`, or the event's record): record an event behind it as the reader and writer
    of everything the whole would have touched, and keep ``keep`` until it completes. If
    recording fails again, ``keep`` stays until a later event of the stream completes (or the
    stream ends); with no event to wait for, neither other streams nor the host's waits on those
    nodes (``export``, ``host_view``) are ordered after that work: only a stream sync is."""
    try:
        handle = stream.driver.record(stream.handle)
    except BaseException:
        handle = None
    stream.seq = seq = stream.seq + 1
    stream.newest = handle
    stream._open.append((seq, keep))
    if handle is None:
        return
    _mark(Event(stream, handle, seq), reads, writes)
