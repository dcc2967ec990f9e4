"""Host copies through a ring of pinned memory, so that large transfers run at DMA speed.

Each chunk of a host copy takes a segment of the device's ring (page-locked memory from
cuda.core's ``LegacyPinnedMemoryResource``); the host side of one chunk overlaps the DMA of
the previous one. A segment is reused only after the event recorded behind its DMA is done. A
device-to-host chunk carries a completion (copying it out to the user's array), run when
its event is found done, at the latest before its space is reused: ``event_done`` and
``event_sync`` run them, so a copy has landed when its event reports done.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from polyjit.core.errors import InvalidArgumentError
from polyjit.core.streams import partly_issued

__all__ = ["STAGING_BYTES", "STAGING_ENV", "Staging", "host_copy", "staging_bytes"]

STAGING_ENV = "POLYJIT_CUDA_STAGING_MB"
STAGING_BYTES = 64 << 20  # each device's ring, unless STAGING_ENV says otherwise


def staging_bytes() -> int:
    """The bytes of each device's ring: ``$POLYJIT_CUDA_STAGING_MB`` MiB, else STAGING_BYTES.
    Read when a driver is made, not at import: a bad value is an error naming the variable,
    not a failed import of the backend."""
    text = os.environ.get(STAGING_ENV, "").strip()
    if not text:
        return STAGING_BYTES
    try:
        mib = float(text)
    except ValueError:
        mib = float("nan")
    if not math.isfinite(mib) or mib <= 0:
        raise InvalidArgumentError(f"{STAGING_ENV}={text!r} is not a positive number of MiB")
    return int(mib * (1 << 20))
_COPY_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))
_PARALLEL_COPY_BYTES = 4 << 20
RECLAIM_AFTER = 16  # segments in flight before a stage asks whether the oldest are done
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def host_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """memcpy between uint8 views; large copies are split across a few threads (numpy releases
    the GIL while it copies), so staging keeps up with the DMA engines."""
    global _pool
    n = dst.nbytes
    if n < _PARALLEL_COPY_BYTES or _COPY_THREADS == 1:
        np.copyto(dst, src)
        return
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="polyjit-cuda-copy")
    step = (n + _COPY_THREADS - 1) // _COPY_THREADS
    futures = [_pool.submit(np.copyto, dst[k : k + step], src[k : k + step]) for k in range(0, n, step)]
    for f in futures:
        f.result()


class _StreamDone:
    """Stands for the event of a copy whose record failed: done once the whole stream is."""

    is_done = False

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def sync(self) -> None:
        getattr(self.stream, "core", self.stream).sync()


def _drain(part: np.ndarray, view: np.ndarray) -> None:
    host_copy(part, view)


class Staging:
    """The ring of one device. ``record(stream)`` returns an event object with ``is_done``
    and ``sync()`` (the driver's ``EventHandle``: the ring holds it until the segment is
    reused, so the event is not recycled under it); ``copy_in(device, host, n, stream)`` and
    ``copy_out(host, device, n, stream)`` enqueue a DMA between two addresses."""

    def __init__(self, buffer: Any, record: Callable[[Any], Any], copy_in: Callable[[int, int, int, Any], None],
                 copy_out: Callable[[int, int, int, Any], None]) -> None:
        self.buffer = buffer  # a page-locked cuda.core Buffer: a ring lives as long as the process
        self.nbytes = int(buffer.size)
        self.ptr = int(buffer.handle)
        self.view = np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(self.ptr))
        self._record, self._copy_in, self._copy_out = record, copy_in, copy_out
        self.head = 0
        self.segments: collections.deque[list[Any]] = collections.deque()  # [start, end, event, done]
        self.pending = 0  # segments whose completion has not run
        self.lock = threading.RLock()

    @property
    def chunk(self) -> int:
        return max(1 << 20, self.nbytes // 4)

    def _complete(self, seg: list[Any]) -> None:
        # ``pending`` drops only after the bytes are out: a thread that finds it 0 without the
        # lock (``poll``) may return to a caller that reads them.
        done = seg[3]
        if done is not None:
            seg[3] = None
            try:
                done()
            finally:
                self.pending -= 1

    def _reclaim_done(self) -> None:
        while self.segments and self.segments[0][2].is_done:
            self._complete(self.segments.popleft())

    def _segment(self, start: int, n: int, stream: Any, chunks: int) -> list[Any]:
        """The ring's segment of a chunk's copy, just queued (lock held), with the event behind
        it. If recording that fails, the segment stays the copy's until the whole stream is done
        (one left out of the ring was reused while the queued copy still used it), and the copy
        counts as issued: ``chunks`` of them are (PartlyIssued)."""
        seg = [start, start + n, _StreamDone(stream), None]
        self.segments.append(seg)
        try:
            seg[2] = self._record(stream)
        except BaseException as e:
            partly_issued(e, chunks)
        return seg

    def _retire_oldest(self) -> None:
        seg = self.segments.popleft()
        seg[2].sync()
        self._complete(seg)

    def _reserve(self, n: int) -> int:
        """Take ``n`` bytes of the ring (lock held): the start of a segment no DMA in flight
        uses, waiting for the oldest segments in its way."""
        size = (n + 255) // 256 * 256
        segments = self.segments
        if len(segments) > RECLAIM_AFTER:  # asking an event costs 1.5 us on an H200
            self._reclaim_done()
        # Segments lie in the ring in the order they were taken, oldest first, from past the
        # head round to it: only the oldest can be in the way, and once it is not, none is.
        # Wrapping to 0 skips the tail from the head on, which the oldest segments hold.
        tail, wrap = self.head, self.head + size > self.nbytes
        start = 0 if wrap else self.head
        end = start + size
        while segments:
            s0 = segments[0]
            if not ((wrap and s0[0] >= tail) or (s0[0] < end and start < s0[1])):
                break
            self._retire_oldest()
        self.head = end
        return start

    def to_device(self, stream: Any, dst: int, src: np.ndarray) -> None:
        """Enqueue ``src`` (uint8, C-contiguous) -> device address ``dst``, chunk by chunk: the
        host copies a chunk into the ring, then the DMA takes it from there."""
        n, chunk = src.nbytes, self.chunk
        for k, off in enumerate(range(0, n, chunk)):
            m = min(chunk, n - off)
            with self.lock:
                try:
                    start = self._reserve(m)
                    host_copy(self.view[start : start + m], src[off : off + m])
                    self._copy_in(dst + off, self.ptr + start, m, stream)
                except BaseException as e:
                    partly_issued(e, k)  # the chunks before it are queued
                self._segment(start, m, stream, k + 1)

    def to_host(self, stream: Any, out: np.ndarray, src: int) -> None:
        """Enqueue device address ``src`` -> ``out`` (uint8); the bytes land when the stream's
        next event is found done (see the module docstring)."""
        n, chunk = out.nbytes, self.chunk
        for k, off in enumerate(range(0, n, chunk)):
            m = min(chunk, n - off)
            with self.lock:
                try:
                    start = self._reserve(m)
                    self._copy_out(self.ptr + start, src + off, m, stream)
                except BaseException as e:
                    partly_issued(e, k)  # the chunks before it are queued
                seg = self._segment(start, m, stream, k + 1)
                seg[3] = functools.partial(_drain, out[off : off + m], self.view[start : start + m])
                self.pending += 1

    def poll(self) -> None:
        """Run the completions whose events are done."""
        if not self.pending:
            return
        with self.lock:
            for seg in self.segments:
                if seg[3] is not None and seg[2].is_done:
                    self._complete(seg)
            self._reclaim_done()
