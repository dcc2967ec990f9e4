"""The CUDA backend's Driver, on cuda.core (1.x); raw cuda.bindings only where cuda.core has
no such feature, each use marked with which.

- Devices (``devices.py``) are ``cuda.core.Device``s; every call that needs one makes its
  device current, so a context another library switched to never leaks into polyjit's
  calls. The driver library is never touched before ``cuInit`` has succeeded: without a
  driver the backend reports zero devices and keeps the reason.
- Memory: a pool is a ``Buffer`` of polyjit's own ``DeviceMemoryResource`` on the device (a
  stream-ordered memory pool, not the one other libraries share); kernels get base + offset. Host copies go through a ring of pinned memory
  (``staging.py``), but for small host-to-device ones, which the driver stages. Copies
  between devices are raw ``cuMemcpyAsync`` calls (peer access is enabled on the pools
  where the devices allow it; where enabling fails, the pair copies without).
- Streams and events are cuda.core's; events are recycled (``Stream.record(event=...)``).
- Code: NVRTC compiles each batch for the devices' archs through the compile cache
  (``nvrtc.py``); a module is a ``cuda.core.ObjectCode`` and kernels its ``Kernel``s.
- Launches (``handles.py``): ``prepare`` fixes each kernel's ``LaunchConfig`` and pointer
  arguments once (a user's own kernel: its grid exactly, its parameters checked);
  ``launch`` adds the statics and calls cuda.core's ``launch``.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from polyjit.backends.cuda.devices import (  # polyjit/bench/cuda.py's bare calls use cuda.driver._cu()
    BASE_ALIGNMENT,
    CudaDriverError,
    _cu,
    _ok,
    discover,
    versions,
)
from polyjit.backends.cuda.dialect import CudaDialect
from polyjit.backends.cuda.handles import (
    EventHandle,
    Module,
    Pool,
    PreparedLaunch,
    StreamHandle,
    grid_and_block,
    prepare_launches,
)
from polyjit.backends.cuda.nvrtc import (
    DEFAULT_ARCH,
    FAST_MATH_OPTIONS,
    NVRTC_OPTIONS,
    CudaBinary,
    arch_number,
    nvrtc_supported_archs,
    nvrtc_version,
)
from polyjit.backends.cuda.staging import Staging
from polyjit.backends.cuda.staging import staging_bytes as default_staging_bytes
from polyjit.core.codegen import KernelSpec, Source
from polyjit.core.device import close_devices_at_exit
from polyjit.core.errors import CompileError, UnknownDeviceError
from polyjit.core.protocol import DeviceInfo, DriverDefaults
from polyjit.core.streams import partly_issued

__all__ = ["BASE_ALIGNMENT", "CudaDriver", "CudaDriverError", "grid_and_block", "versions"]

# Host-to-device copies up to this size skip the staging ring: the driver stages pageable
# memory itself, at once, and the copy needs no ring segment and no event of its own.
DIRECT_COPY_BYTES = 64 << 10


class CudaDriver(DriverDefaults):
    """The Driver of the CUDA backend (see the module docstring)."""

    name = "cuda"

    def __init__(self, *, fast_math: bool = False, staging_bytes: int | None = None) -> None:
        self.dialect = CudaDialect()
        self.options = NVRTC_OPTIONS + (FAST_MATH_OPTIONS if fast_math else ())
        self.staging_bytes = max(1 << 20, default_staging_bytes() if staging_bytes is None else staging_bytes)
        self._lock = threading.RLock()
        self._probed = False
        self._reason: str | None = None
        self._devices: list[Any] = []  # cuda.core Device per ordinal
        self._infos: list[DeviceInfo] = []
        self._peer: list[list[bool]] = []
        self._peer_enabled = False
        self._memory: dict[int, tuple[Any, Any]] = {}  # ordinal -> (DeviceMemoryResource, its stream)
        self._free_events: dict[int, list[Any]] = collections.defaultdict(list)
        self._staging: dict[int, Staging] = {}
        # Streams open, and pools to free once none of theirs is (free_when_idle)
        self._open: set[StreamHandle] = set()
        self._idle_frees: list[tuple[int, Pool, frozenset[StreamHandle]]] = []

    # -- devices -----------------------------------------------------------------------

    @property
    def unavailable_reason(self) -> str | None:  # type: ignore[override]
        """Why there are no devices (None when there are some)."""
        self._probe()
        return self._reason

    def _probe(self) -> None:
        if self._probed:
            return
        with self._lock:
            if not self._probed:
                try:
                    self._reason = self._discover()
                finally:
                    self._probed = True

    def _discover(self) -> str | None:
        self._devices, self._infos, self._peer, reason = discover()
        # after cuda.core's import: the devices close (their queued work waited for) before the
        # interpreter tears down the pools' Buffers, whose finalizers free them on another
        # stream (found by review: at exit the stub ran a queued copy into a freed pool)
        close_devices_at_exit(CudaDriver)
        return reason

    def device_count(self) -> int:
        self._probe()
        return len(self._infos)

    def device_info(self, ordinal: int) -> DeviceInfo:
        self._probe()
        if not 0 <= ordinal < len(self._infos):
            raise UnknownDeviceError(f"cuda has {len(self._infos)} device(s); there is no device {ordinal}")
        return self._infos[ordinal]

    def arch(self, ordinal: int) -> str:
        return str(self.device_info(ordinal).properties["arch"])

    def make_current(self, ordinal: int) -> Any:
        """Make the device's primary context current on this thread (checked every time), as
        every call on a device does; returns its cuda.core Device."""
        self._probe()
        dev = self._devices[ordinal]
        dev.set_current()
        return dev

    _current = make_current

    def _enable_peers(self) -> None:
        """Let every pool be reached from the devices that allow it; a pair whose enabling fails
        is marked not peer-capable (its copies are staged by the driver)."""
        with self._lock:
            if self._peer_enabled:
                return
            self._peer_enabled = True
            for ordinal in range(len(self._devices)):
                mr, _ = self._resource(ordinal)
                peers = [j for j, ok in enumerate(self._peer[ordinal]) if ok]
                if not peers:
                    continue
                try:
                    mr.peer_accessible_by = peers
                except Exception:
                    for j in peers:
                        self._peer[ordinal][j] = False

    # -- memory --------------------------------------------------------------------------

    def _resource(self, ordinal: int) -> tuple[Any, Any]:
        """The device's memory resource and the stream its allocations are ordered on."""
        hit = self._memory.get(ordinal)
        if hit is None:
            from cuda.core import DeviceMemoryResource, DeviceMemoryResourceOptions, StreamOptions

            with self._lock:
                hit = self._memory.get(ordinal)
                if hit is None:
                    dev = self.make_current(ordinal)
                    # a pool of polyjit's own (options given), not the device's current one, which
                    # other libraries in the process share: allocated_bytes counted their memory,
                    # and making it reachable from peers changed their pool's access
                    mr = DeviceMemoryResource(dev, options=DeviceMemoryResourceOptions())
                    hit = self._memory[ordinal] = (mr, dev.create_stream(options=StreamOptions(nonblocking=True)))
        return hit

    def alloc(self, ordinal: int, nbytes: int, alignment: int) -> Pool:
        mr, stream = self._resource(ordinal)
        self.make_current(ordinal)
        extra = alignment if alignment > BASE_ALIGNMENT else 0
        try:
            buf = mr.allocate(nbytes + extra, stream=stream)
        except Exception as e:
            if "OUT_OF_MEMORY" in str(e):
                raise MemoryError(f"cuda:{ordinal}: out of memory allocating {nbytes} bytes") from e
            raise
        stream.sync()  # the pool is used on other streams next: let its allocation land
        ptr = int(buf.handle)
        if extra:
            ptr = (ptr + alignment - 1) // alignment * alignment
        return Pool(ordinal, ptr, buf, nbytes)

    def free(self, ordinal: int, pool: Pool) -> None:
        _, stream = self._resource(ordinal)
        self.make_current(ordinal)
        pool.buffer.close(stream)  # the runtime calls this once the pool's last work is done

    def free_when_idle(self, ordinal: int, pool: Pool, streams: frozenset[StreamHandle]) -> None:
        """Free ``pool`` once none of ``streams`` (its backend's) is open, now if none is: a
        pool whose Device object went in a garbage cycle with its streams, whose closing (after
        their queued work) comes later. Found by review: freed at once, on the memory
        resource's own stream, which no kernel's stream orders, while kernels still used it
        (the stub read freed memory). Memory another library lent is not freed here."""
        if pool.buffer is None:
            return
        with self._lock:
            if self._open & streams:
                self._idle_frees.append((ordinal, pool, streams))
                return
        self.free(ordinal, pool)

    def allocated_bytes(self, ordinal: int) -> int:
        """Bytes in use in the device's memory pool (polyjit's pools only), once the frees
        already ordered on its stream have run."""
        mr, stream = self._resource(ordinal)
        self.make_current(ordinal)
        stream.sync()
        return int(mr.attributes.used_mem_current)

    # -- DLPack: pools are device memory ---------------------------------------------------

    def dlpack_device(self, ordinal: int) -> tuple[int, int]:
        return (2, ordinal)  # kDLCUDA

    def address(self, pool: Pool, offset: int) -> int:
        return pool.ptr + offset

    def wrap_address(self, ordinal: int, address: int, nbytes: int) -> Pool:
        return Pool(ordinal, address, None, nbytes)  # lent memory: the runtime never frees it

    def foreign_stream(self, stream: StreamHandle) -> int:
        """The stream a DLPack producer must order its work on: this one's CUstream."""
        return int(stream.handle)

    def wait_foreign(self, ordinal: int, stream: int, event: EventHandle) -> None:
        """Make another library's stream (a CUstream address, or 1 / 2: the legacy and
        per-thread default streams) wait for one of polyjit's events."""
        from cuda.core import Stream

        self.make_current(ordinal)
        if stream in (1, 2):  # the default streams have no handle to wrap: wait on the host
            event.core.sync()
            return
        Stream.from_handle(stream).wait(event.core)

    # -- streams and events ----------------------------------------------------------------

    def new_stream(self, ordinal: int) -> StreamHandle:
        from cuda.core import StreamOptions

        s = self.make_current(ordinal).create_stream(options=StreamOptions(nonblocking=True))
        handle = StreamHandle(ordinal, s, s.handle)
        with self._lock:
            self._open.add(handle)
        return handle

    def close_stream(self, stream: StreamHandle) -> None:
        self.make_current(stream.ordinal)
        stream.core.close()
        with self._lock:
            self._open.discard(stream)
            due = [(o, p) for o, p, s in self._idle_frees if not self._open & s]
            self._idle_frees = [f for f in self._idle_frees if self._open & f[2]]
        failed: Exception | None = None
        for ordinal, pool in due:  # every one, whatever another's free raised (found by review)
            try:
                self.free(ordinal, pool)
            except Exception as e:
                failed = failed or e
        if failed is not None:
            raise failed

    def record(self, stream: StreamHandle) -> EventHandle:
        free = self._free_events[stream.ordinal]
        try:
            recycled = free.pop()
        except IndexError:
            recycled = None
        self._devices[stream.ordinal].set_current()  # make_current, inlined: a stream's device is known
        if recycled is None:
            from cuda.core import EventOptions

            return EventHandle(stream.ordinal, stream.core.record(options=EventOptions(timing_enabled=False)), free)
        return EventHandle(stream.ordinal, stream.core.record(recycled), free)

    def record_timed(self, stream: StreamHandle) -> EventHandle:
        from cuda.core import EventOptions

        self.make_current(stream.ordinal)
        return EventHandle(stream.ordinal, stream.core.record(options=EventOptions(timing_enabled=True)), [])

    def elapsed_ms(self, start: EventHandle, end: EventHandle) -> float:
        return float(end.core - start.core)

    def wait(self, stream: StreamHandle, event: EventHandle) -> None:
        self.make_current(stream.ordinal)
        stream.core.wait(event.core)

    def event_done(self, event: EventHandle) -> bool:
        self.make_current(event.ordinal)  # a sticky fault of another device's context is not this one's
        if not event.core.is_done:
            return False
        self._poll(event.ordinal)
        return True

    def event_sync(self, event: EventHandle) -> None:
        self.make_current(event.ordinal)
        event.core.sync()
        self._poll(event.ordinal)

    def _poll(self, ordinal: int) -> None:
        """Device-to-host copies land when an event of their device is found done (only
        that device's: another's context may hold a sticky fault that is not this one's)."""
        ring = self._staging.get(ordinal)
        if ring is not None and ring.pending:
            ring.poll()

    # -- transfers ---------------------------------------------------------------------------

    @staticmethod
    def _view(ptr: int, nbytes: int) -> Any:
        from cuda.core import Buffer

        return Buffer.from_handle(ptr, nbytes)

    def _copy(self, dst: int, src: int, nbytes: int, stream: StreamHandle) -> None:
        # raw cuMemcpyAsync between devices (and the raw calls below for host copies): two
        # cuda.core Buffer views a copy cost more than the call (a hot path)
        _ok(_cu().cuMemcpyAsync(dst, src, nbytes, stream.handle), "cuMemcpyAsync")

    def _copy_in(self, dst: int, src: int, nbytes: int, stream: StreamHandle) -> None:
        _ok(_cu().cuMemcpyHtoDAsync(dst, src, nbytes, stream.handle), "cuMemcpyHtoDAsync")  # raw: as _copy

    def _copy_out(self, dst: int, src: int, nbytes: int, stream: StreamHandle) -> None:
        _ok(_cu().cuMemcpyDtoHAsync(dst, src, nbytes, stream.handle), "cuMemcpyDtoHAsync")  # raw: as _copy

    def _ring(self, ordinal: int) -> Staging:
        ring = self._staging.get(ordinal)
        if ring is None:
            from cuda.core import LegacyPinnedMemoryResource

            with self._lock:
                ring = self._staging.get(ordinal)
                if ring is None:
                    # cuMemAllocHost memory, not PinnedMemoryResource's (a host memory pool): a
                    # device-to-host copy into the latter waited for the stream (H200: 250 us
                    # behind a busy stream, 3-5 us into the former; docs/benchmarks.md)
                    self.make_current(ordinal)
                    try:
                        buf = LegacyPinnedMemoryResource().allocate(self.staging_bytes)
                    except Exception as e:
                        raise CudaDriverError(
                            f"cuda:{ordinal}: allocating its {self.staging_bytes >> 20} MiB pinned staging ring "
                            f"failed (POLYJIT_CUDA_STAGING_MB sets the size): {e}") from e
                    ring = self._staging[ordinal] = Staging(buf, self.record, self._copy_in, self._copy_out)
        return ring

    def memset_zero(self, stream: StreamHandle, pool: Pool, offset: int, nbytes: int) -> None:
        if nbytes > 0:
            self.make_current(stream.ordinal)
            self._view(pool.ptr + offset, nbytes).fill(0, stream=stream.core)

    def copy_from_host(self, stream: StreamHandle, pool: Pool, offset: int, array: np.ndarray) -> None:
        n = array.nbytes
        if not n:
            return
        self.make_current(stream.ordinal)
        flat = array.reshape(-1)  # never 0-d: cuda.bindings reads a 0-d array as an address
        if n <= DIRECT_COPY_BYTES:
            # the driver copies pageable bytes into its own staging before it returns (on an
            # H200: 2.8-3.9 us, no wait on the stream, against 9.9 through the ring); the array
            # goes in as a buffer (numpy's .ctypes costs 1.6 us)
            _ok(_cu().cuMemcpyHtoDAsync(pool.ptr + offset, flat, n, stream.handle), "cuMemcpyHtoDAsync")
            return
        self._ring(stream.ordinal).to_device(stream, pool.ptr + offset, flat.view(np.uint8))

    def copy_to_host(self, stream: StreamHandle, pool: Pool, offset: int, array: np.ndarray) -> None:
        if array.nbytes:
            self.make_current(stream.ordinal)
            self._ring(stream.ordinal).to_host(stream, array.reshape(-1).view(np.uint8), pool.ptr + offset)

    def copy_device(self, stream: StreamHandle, dst: tuple[int, Pool, int], src: tuple[int, Pool, int],
                    nbytes: int) -> None:
        if nbytes <= 0:
            return
        (dord, dpool, doff), (sord, spool, soff) = dst, src
        if dord != sord:
            self._enable_peers()
        self.make_current(stream.ordinal)
        self._copy(dpool.ptr + doff, spool.ptr + soff, nbytes, stream)

    # -- code ----------------------------------------------------------------------------------

    def compile(self, source: Source) -> CudaBinary:
        """Compile for the archs of the present devices now (``sm_90`` without devices, so that
        errors surface here); other archs compile when a device of that arch loads it."""
        binary = CudaBinary(source, self.options)
        self._probe()
        for arch in sorted({str(i.properties["arch"]) for i in self._infos}) or [DEFAULT_ARCH]:
            binary.image(arch)
        return binary

    def load(self, ordinal: int, binary: CudaBinary) -> Module:
        from cuda.core import ObjectCode

        arch = self.arch(ordinal)
        self.make_current(ordinal)
        tried = []
        kind, image = binary.image(arch)
        attempts = [(kind, image)]
        if kind == "cubin":  # e.g. a driver older than NVRTC: let it JIT the PTX
            newest = max(a for a in nvrtc_supported_archs() if a <= arch_number(arch))
            attempts.append(("ptx", binary.ptx(f"compute_{newest}")))
        for kind, image in attempts:
            code = ObjectCode.from_cubin(image) if kind == "cubin" else ObjectCode.from_ptx(image)
            module = Module(ordinal, code, kind)
            try:
                if binary.kernel_names:
                    module.kernel(binary.kernel_names[0])  # loads the library now: errors surface here
                return module
            except Exception as e:
                if "CUDA_ERROR_NOT_FOUND" in str(e):  # the image loaded, but has no such kernel
                    raise CompileError(f"the CUDA module has no kernel {binary.kernel_names[0]} (a kernel "
                                       'of your own must be defined extern "C" __global__)',
                                       source=binary.text) from e
                tried.append(f"{kind}: {type(e).__name__}: {e}")
        driver_version = self.device_info(ordinal).properties.get("driver_version")
        raise CudaDriverError(
            f"cuda:{ordinal} ({arch}) could not load the batch's module (driver {driver_version}, "
            f"NVRTC {'.'.join(map(str, nvrtc_version()))}); tried " + "; ".join(tried))

    def prepare(self, ordinal: int, module: Module,
                kernels: Sequence[tuple[KernelSpec, Sequence[tuple[Any, int]]]]) -> PreparedLaunch:
        self.make_current(ordinal)
        props = self.device_info(ordinal).properties
        return prepare_launches(ordinal, module, kernels, int(props["max_threads_per_block"]))

    def launch(self, stream: StreamHandle, prepared: PreparedLaunch, statics: Sequence[int]) -> None:
        # cuda.core's launch: on an H200 4.29 us a call against 4.18 us for a raw cuLaunchKernel
        # with parameters packed once (docs/benchmarks.md, session 13): no reason to leave it
        launch = _core_launch()
        tail = tuple(np.int64(v) for v in statics) if statics else ()
        self._devices[prepared.ordinal].set_current()  # cuda.core launches in the thread's current context
        for k, ln in enumerate(prepared.launches):
            try:
                launch(stream.core, ln.config, ln.kernel, *ln.pointers, *tail)
            except BaseException as e:  # an interrupt too
                error = e if not isinstance(e, Exception) else CudaDriverError(
                    f"launching {ln.name} (grid {ln.grid}, block {ln.block}) on cuda:{prepared.ordinal} failed: {e}")
                # the kernels before it are queued: enqueue keeps what they use until the event
                # it records behind them completes (a split sum's second kernel failing freed the
                # memory its first was still reading)
                partly_issued(error, k, cause=e)


@functools.cache
def _core_launch() -> Any:
    """cuda.core's ``launch``, imported once (the package imports without cuda.core; an
    import statement in the launch path cost 0.3 us a launch)."""
    from cuda.core import launch

    return launch
