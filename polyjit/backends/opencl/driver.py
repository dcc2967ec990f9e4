"""The OpenCL backend's Driver: pyopencl (public API only), kernels in OpenCL C.

- Devices (``platforms.py``): every device of every platform, or those of
  ``POLYJIT_OPENCL_PLATFORM``; all devices of a platform share one ``cl.Context``, so
  buffers of one device are copied to another on the device side. Without an OpenCL
  platform the backend reports zero devices and says why (``unavailable_reason``).
- Memory: a pool is one ``cl.Buffer``; a generated kernel gets the pool plus a byte offset
  (``__global char* pN, ulong oN``, cast at its start), a user's kernel a sub-buffer
  (``launch.py``).
- Streams are in-order command queues with profiling on; events are ``cl.Event``s. A
  stream waits for another one's event with a barrier on its own queue, so the host never
  blocks. Host copies are non-blocking; the runtime holds pyopencl's ``NannyEvent`` (which
  keeps the host array alive) until the copy is done.
- Code (``programs.py``): one program per batch and device group, through the compile
  cache (binaries on disk except on CPU devices, where PoCL caches its own builds).
  Matmul-shaped kernels have two variants chosen when the program is built: on CPU devices
  (``-D PJ_CPU``) each work-item keeps an 8x8 block of the output in vector registers; on
  other devices the work-group stages 16-deep tiles of both operands in local memory.

Run the tests on pip's PoCL alone with ``OCL_ICD_VENDORS`` set to the ``pocl.icd`` file inside
pyopencl's wheel (``pip_pocl_icd``); ``POCL_DEVICES="pthread pthread"`` makes PoCL show two
CPU devices.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from polyjit.backends.opencl.dialect import OpenCLDialect
from polyjit.backends.opencl.launch import Prepared, bind
from polyjit.backends.opencl.platforms import (
    PLATFORM_ENV,
    ClDevice,
    cl,
    discover,
    pip_pocl_icd,
    working_pocl_icd,
)
from polyjit.backends.opencl.programs import ClBinary, OpenCLCompiler
from polyjit.core.codegen import KernelSpec, Source
from polyjit.core.device import close_devices_at_exit
from polyjit.core.errors import BackendUnavailableError, UnknownDeviceError, UnsupportedError
from polyjit.core.protocol import DeviceInfo
from polyjit.core.raw import RAW
from polyjit.core.runtime import Backend
from polyjit.core.streams import partly_issued

__all__ = ["BINARY_CACHE_ENV", "PLATFORM_ENV", "OpenCLDriver", "create_backend", "pip_pocl_icd",
           "working_pocl_icd"]

BINARY_CACHE_ENV = "POLYJIT_OPENCL_BINARY_CACHE"


class _Stream:
    """An in-order queue and the event of its last command."""

    __slots__ = ("dev", "done_seq", "flushed_seq", "last", "queue", "seq")

    def __init__(self, dev: ClDevice, queue: Any) -> None:
        self.dev = dev
        self.queue = queue
        self.last: Any = None  # the event of the last command; None: record() enqueues a marker
        self.seq = 0  # commands enqueued so far
        self.done_seq = 0  # commands known complete
        self.flushed_seq = 0  # commands known submitted (clFlush)

    def enqueued(self, event: Any) -> None:
        self.seq += 1
        self.last = event

    def flush(self, upto: int) -> None:
        if self.flushed_seq < upto:
            self.flushed_seq = self.seq
            self.queue.flush()


class _Event:
    __slots__ = ("event", "seq", "stream")

    def __init__(self, stream: _Stream, event: Any, seq: int) -> None:
        self.stream = stream
        self.event = event
        self.seq = seq


@attrs.frozen(eq=False)
class _Module:
    program: Any
    dev: ClDevice


class OpenCLDriver:
    """The Driver of the OpenCL backend (see the module docstring)."""

    name = "opencl"

    def __init__(self, platform: str | None = None, matmul_variant: str = "auto",
                 binary_cache: str | None = None, group_reductions: str = "auto") -> None:
        """``platform``: a name substring or index (default: ``$POLYJIT_OPENCL_PLATFORM``, else all).
        ``matmul_variant``: "auto" (vector registers on CPUs, local-memory tiles elsewhere),
        "local" (local-memory tiles everywhere) or "off" (no tiled kernels).
        ``binary_cache`` (default ``$POLYJIT_OPENCL_BINARY_CACHE``, else "auto"): whether built
        binaries go to the disk cache: "always", "never", or "auto": for every device but CPU
        devices. Asking PoCL for a program's binaries compiles every kernel to native code
        first (12 s for a batch of 140 kernels, against 0.5 s for the build itself), while its
        own kernel cache already makes a second process's build of the same source cheap.
        ``group_reductions``: "auto" (a work-group per cell of few, long reductions unless
        every device is a CPU), "on" or "off"."""
        if group_reductions not in ("auto", "on", "off"):
            raise BackendUnavailableError(f"opencl: group_reductions must be auto, on or off, not {group_reductions!r}")
        if matmul_variant not in ("auto", "local", "off"):
            raise BackendUnavailableError(f"opencl: matmul_variant must be auto, local or off, not {matmul_variant!r}")
        binary_cache = binary_cache or os.environ.get(BINARY_CACHE_ENV) or "auto"
        if binary_cache not in ("auto", "always", "never"):
            raise BackendUnavailableError(f"opencl: binary_cache (or ${BINARY_CACHE_ENV}) must be auto, always or never, "
                                          f"not {binary_cache!r}")
        self.binary_cache = binary_cache
        self._dialect = OpenCLDialect(matmul=matmul_variant != "off", group_reductions=group_reductions != "off")
        self._group_reductions = group_reductions
        self.matmul_variant = matmul_variant
        self.platform_filter = platform if platform is not None else os.environ.get(PLATFORM_ENV)
        self.unavailable_reason: str | None = None
        self.cache = OpenCLCompiler(self._on_disk)
        self._devices: list[ClDevice] | None = None
        self._lock = threading.RLock()
        self._allocated: dict[int, int] = {}  # id(cl.Buffer) -> bytes, for allocated_bytes()

    @property
    def dialect(self) -> OpenCLDialect:
        if self._group_reductions == "auto":  # depends on the devices: resolved once, on first use
            on = not all(d.is_cpu for d in self.devices)
            self._dialect.group_reductions = on
            self._group_reductions = "on" if on else "off"
        return self._dialect

    # -- devices -----------------------------------------------------------------

    @property
    def devices(self) -> list[ClDevice]:
        if self._devices is None:
            with self._lock:
                if self._devices is None:
                    self._devices = self._discover()
        return self._devices

    def _discover(self) -> list[ClDevice]:
        devices, self.unavailable_reason = discover(self.platform_filter, self.matmul_variant == "auto")
        # after pyopencl's import: its exit code (PoCL's) runs after the devices close
        close_devices_at_exit(OpenCLDriver)
        return devices

    def _dev(self, ordinal: int) -> ClDevice:
        devs = self.devices
        if not 0 <= ordinal < len(devs):
            raise UnknownDeviceError(f"opencl has {len(devs)} device(s); there is no device {ordinal}")
        return devs[ordinal]

    def device_count(self) -> int:
        return len(self.devices)

    def device_info(self, ordinal: int) -> DeviceInfo:
        return self._dev(ordinal).info

    # -- memory ------------------------------------------------------------------

    def alloc(self, ordinal: int, nbytes: int, alignment: int) -> Any:
        dev = self._dev(ordinal)
        if nbytes > dev.max_alloc:
            raise MemoryError(
                f"{nbytes} bytes exceed the largest buffer {dev.info.name} allows "
                f"(max_mem_alloc_size {dev.max_alloc} bytes of {dev.info.memory_bytes})"
            )
        try:
            buf = cl.Buffer(dev.context, cl.mem_flags.READ_WRITE, size=nbytes)
        except cl.Error as e:
            raise MemoryError(f"cannot allocate {nbytes} bytes on {dev.info.name}: {e}") from e
        with self._lock:
            self._allocated[id(buf)] = nbytes
        return buf

    def free(self, ordinal: int, pool: Any) -> None:
        with self._lock:
            del self._allocated[id(pool)]
        pool.release()

    def allocated_bytes(self, ordinal: int) -> int:
        """Bytes of the pools this driver holds (on every device of every platform)."""
        with self._lock:
            return sum(self._allocated.values())

    # -- streams and events --------------------------------------------------------

    def new_stream(self, ordinal: int) -> _Stream:
        dev = self._dev(ordinal)
        props = cl.command_queue_properties.PROFILING_ENABLE
        return _Stream(dev, cl.CommandQueue(dev.context, dev.device, properties=props))

    def record(self, stream: _Stream) -> _Event:
        last = stream.last
        if last is None:  # nothing enqueued yet, or the last command was a host copy
            last = cl.enqueue_marker(stream.queue)
            stream.enqueued(last)
        return _Event(stream, last, stream.seq)

    def record_timed(self, stream: _Stream) -> _Event:
        """A marker of its own (its profiling times are this point's)."""
        marker = cl.enqueue_marker(stream.queue)
        stream.enqueued(marker)
        return _Event(stream, marker, stream.seq)

    def elapsed_ms(self, start: _Event, end: _Event) -> float:
        return float(end.event.profile.end - start.event.profile.end) / 1e6

    def wait(self, stream: _Stream, event: _Event) -> None:
        src = event.stream
        if src is stream or event.seq <= src.done_seq:
            return
        if src.dev.context is not stream.dev.context:
            event.event.wait()  # another platform: events do not cross contexts
            return
        src.flush(event.seq)  # a queue must be flushed before another queue waits on its events
        stream.enqueued(cl.enqueue_barrier(stream.queue, wait_for=[event.event]))

    def event_done(self, event: _Event) -> bool:
        s = event.stream
        if event.seq <= s.done_seq:
            return True
        s.flush(event.seq)
        status = event.event.command_execution_status
        if status < 0:  # the command was terminated: an error code, not a state
            raise RuntimeError(f"an OpenCL command failed with status {status}")
        if status > cl.command_execution_status.COMPLETE:
            return False
        s.done_seq = max(s.done_seq, event.seq)
        return True

    def event_sync(self, event: _Event) -> None:
        s = event.stream
        if event.seq > s.done_seq:
            event.event.wait()
            s.done_seq = max(s.done_seq, event.seq)

    # -- transfers (host copies return pyopencl's NannyEvent, which holds the host array:
    # the runtime keeps it until the copy is done, so dropping it never blocks) -----------

    @staticmethod
    def _host_copy(stream: _Stream, nanny: Any) -> Any:
        stream.seq += 1
        stream.last = None  # record() puts a plain marker after it
        return nanny

    def memset_zero(self, stream: _Stream, pool: Any, offset: int, nbytes: int) -> None:
        if nbytes <= 0:
            return
        width = 4 if offset % 4 == 0 and nbytes % 4 == 0 else 1  # the widest pattern that fits
        pattern = np.zeros(1, np.uint32 if width == 4 else np.uint8)
        stream.enqueued(cl.enqueue_fill_buffer(stream.queue, pool, pattern, offset, nbytes))

    def copy_from_host(self, stream: _Stream, pool: Any, offset: int, array: np.ndarray) -> Any:
        if array.nbytes == 0:
            return None
        ev = cl.enqueue_copy(stream.queue, pool, array, dst_offset=offset, is_blocking=False)
        return self._host_copy(stream, ev)

    def copy_to_host(self, stream: _Stream, pool: Any, offset: int, array: np.ndarray) -> Any:
        if array.nbytes == 0:
            return None
        ev = cl.enqueue_copy(stream.queue, array, pool, src_offset=offset, is_blocking=False)
        return self._host_copy(stream, ev)

    def copy_device(
        self, stream: _Stream, dst: tuple[int, Any, int], src: tuple[int, Any, int], nbytes: int
    ) -> Any:
        if nbytes <= 0:
            return None
        (_, dbuf, doff), (sord, sbuf, soff) = dst, src
        sdev = self._dev(sord)
        if sdev.context is stream.dev.context:  # one platform: a device-side copy
            ev = cl.enqueue_copy(stream.queue, dbuf, sbuf, byte_count=nbytes,
                                 src_offset=soff, dst_offset=doff)
            stream.enqueued(ev)
            return None
        # Another platform: stage through the host. The runtime already made this stream wait
        # for the source's writer, which across contexts is a host wait, so the data is there.
        with self._lock:
            if sdev.staging is None:
                sdev.staging = cl.CommandQueue(sdev.context, sdev.device)
        host = np.empty(nbytes, np.uint8)
        cl.enqueue_copy(sdev.staging, host, sbuf, src_offset=soff, is_blocking=True)
        return self.copy_from_host(stream, dbuf, doff, host)

    # -- code -------------------------------------------------------------------------

    def compile(self, source: Source) -> ClBinary:
        kernels = source.all_kernels
        # A user's kernel is built with its parameters' info, to check them against the nodes.
        options = "-cl-kernel-arg-info" if any(k.plan.kind == RAW for k in kernels) else ""
        binary = self.cache.binary(source.text, tuple(k.name for k in kernels), options)
        devices = self.devices
        if not devices:
            return binary  # nothing to build for; linking needs a device anyway
        usable = [d for d in devices if d.fp64 or not binary.fp64]
        if not usable:
            names = ", ".join(sorted({d.info.name for d in devices}))
            raise UnsupportedError(
                f"the batch uses float64, but no OpenCL device here supports it "
                f"(no cl_khr_fp64 on {names}); cast to float32"
            )
        wanted = tuple(k.name for k in kernels)
        for group in sorted({d.group for d in usable}):
            self._program(binary, group, wanted)
        return binary

    def _program(self, binary: ClBinary, group: int, names: tuple[str, ...] = ()) -> Any:
        devs = [d for d in self.devices if d.group == group and (d.fp64 or not binary.fp64)]
        return self.cache.program(binary, group, devs, names)

    def _on_disk(self, devs: Sequence[ClDevice]) -> bool:
        if self.binary_cache == "auto":
            return not any(d.is_cpu for d in devs)
        return self.binary_cache == "always"

    def load(self, ordinal: int, binary: ClBinary) -> _Module:
        dev = self._dev(ordinal)
        if binary.fp64 and not dev.fp64:
            raise UnsupportedError(
                f"the batch uses float64, but OpenCL device {ordinal} ({dev.info.name}) has no "
                f"cl_khr_fp64; cast to float32 or use another device"
            )
        return _Module(self._program(binary, dev.group), dev)

    def prepare(
        self, ordinal: int, module: _Module, kernels: Sequence[tuple[KernelSpec, Sequence[tuple[Any, int]]]]
    ) -> Prepared:
        keep: list[Any] = []
        launches = tuple(bind(module.program, spec, args, module.dev, keep) for spec, args in kernels)
        return Prepared(launches, tuple(keep))

    def launch(self, stream: _Stream, prepared: Prepared, statics: Sequence[int]) -> None:
        # The hot path of every run(): the kernels' buffers are bound, only statics change.
        queue = stream.queue
        enqueue = cl.enqueue_nd_range_kernel
        ev = None
        done = 0
        try:
            if statics:
                for ln in prepared.launches:
                    kernel = ln.kernel
                    for pos, value in enumerate(statics, ln.first_static):
                        kernel.set_arg(pos, np.int64(value))
                    ev = enqueue(queue, kernel, ln.global_size, ln.local_size)
                    done += 1
            else:
                for kernel, gsize, lsize in prepared.calls:
                    ev = enqueue(queue, kernel, gsize, lsize)
                    done += 1
        except BaseException as e:
            if done:  # the kernels before it are queued: the stream's event must come behind them
                stream.seq += done
                stream.last = ev
            partly_issued(e, done)  # and enqueue keeps what they use until it completes
        if ev is not None:
            stream.seq += done
            stream.last = ev


def create_backend(platform: str | None = None, matmul_variant: str = "auto",
                   binary_cache: str | None = None, group_reductions: str = "auto") -> Backend:
    """The OpenCL backend. ``platform`` overrides ``$POLYJIT_OPENCL_PLATFORM`` (a name substring
    or an index); ``matmul_variant`` is "auto", "local" or "off"; ``binary_cache`` is "auto",
    "always" or "never"; ``group_reductions`` is "auto", "on" or "off" (see OpenCLDriver)."""
    return Backend(OpenCLDriver(platform, matmul_variant, binary_cache, group_reductions))
