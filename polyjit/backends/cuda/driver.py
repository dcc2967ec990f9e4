"""The CUDA backend's Driver, on cuda.core (1.x).

- Devices are ``cuda.core.Device``s; every call that needs one makes its device current
  (``Device.set_current``), so a context another library switched to never leaks into
  polyjit's calls. The driver library is never touched before ``cuInit`` has succeeded:
  without a driver the backend reports zero devices and keeps the reason.
- Memory: a pool is a ``Buffer`` of the device's ``DeviceMemoryResource`` (a stream-ordered
  memory pool); kernels get base + offset. Host copies go through a ring of pinned memory
  (``staging.py``). Copies between devices are ``Buffer`` copies (peer access is enabled
  on the pools where the devices allow it; where enabling fails, the pair copies without).
- Streams and events are cuda.core's; events are recycled (``Stream.record(event=...)``).
- Code: NVRTC compiles each batch for the devices' archs (``nvrtc.py``); a module is a
  ``cuda.core.ObjectCode`` and kernels its ``Kernel``s.
- Launches: ``prepare`` fixes each kernel's ``LaunchConfig`` and pointer arguments once;
  ``launch`` adds the statics and calls cuda.core's ``launch``.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from polyjit.backends.cuda.dialect import CudaDialect
from polyjit.backends.cuda.nvrtc import (
    DEFAULT_ARCH,
    FAST_MATH_OPTIONS,
    NVRTC_OPTIONS,
    CudaBinary,
    arch_number,
    nvrtc_supported_archs,
    nvrtc_version,
)
from polyjit.backends.cuda.staging import STAGING_BYTES, Staging
from polyjit.core.codegen import KernelSpec, LaunchShape, Source
from polyjit.core.errors import DriverError, InvalidProgramError, PolyjitError, UnknownDeviceError
from polyjit.core.protocol import DeviceInfo, DriverDefaults

__all__ = ["BASE_ALIGNMENT", "CudaDriver", "CudaDriverError", "grid_and_block"]

BASE_ALIGNMENT = 256  # every pool offset is a multiple (float4 loads need 16)
BLOCKS_PER_SM = 32  # a grid-stride launch uses at most this many blocks per SM


class CudaDriverError(DriverError):
    """A CUDA driver call failed (the message names the call and the CUresult)."""


_import_lock = threading.Lock()
_cu_mod: Any = None


def _cu() -> Any:
    """cuda.bindings.driver (importing it does not load libcuda)."""
    global _cu_mod
    if _cu_mod is None:
        with _import_lock:
            if _cu_mod is None:
                from cuda.bindings import driver

                _cu_mod = driver
    return _cu_mod


def _ok(result: Any, what: str) -> Any:
    """The value(s) of a cuda.bindings ``(err, *values)`` result tuple."""
    if result[0]:
        raise CudaDriverError(f"{what} failed: {_err_name(result[0])}")
    return None if len(result) == 1 else result[1] if len(result) == 2 else result[1:]


def _err_name(err: Any) -> str:
    try:
        res, name = _cu().cuGetErrorName(err)
        if not res and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        pass
    return str(err)


def grid_and_block(launch: LaunchShape, sm_count: int | None = None) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """CUDA grid and block from an OpenCL-style launch shape; 1-D launches (grid-stride
    kernels) are capped at ``BLOCKS_PER_SM * sm_count`` blocks."""
    local = tuple(launch.local_size or (1,) * len(launch.global_size))
    grid = [max(1, g // max(1, b)) for g, b in zip(launch.global_size, local)]
    if len(grid) == 1 and sm_count:
        grid[0] = max(1, min(grid[0], BLOCKS_PER_SM * sm_count))
    g3, b3 = (grid + [1, 1, 1])[:3], (list(local) + [1, 1, 1])[:3]
    return (g3[0], g3[1], g3[2]), (b3[0], b3[1], b3[2])


# ---------------------------------------------------------------------------
# Handles


@attrs.frozen(eq=False)
class _Pool:
    ordinal: int
    ptr: int  # the aligned base kernels see
    buffer: Any  # the cuda.core Buffer (freed with close())
    nbytes: int


@attrs.frozen(eq=False)
class _Stream:
    ordinal: int
    core: Any  # cuda.core Stream
    handle: Any  # its CUstream, for the raw launch


class _Event:
    """A recorded cuda.core Event; it goes back to its device's free list when dropped."""

    __slots__ = ("core", "free", "ordinal")

    def __init__(self, ordinal: int, core: Any, free: list[Any]) -> None:
        self.ordinal = ordinal
        self.core = core
        self.free = free

    def __del__(self) -> None:
        self.free.append(self.core)


@attrs.frozen(eq=False)
class _Module:
    ordinal: int
    code: Any  # cuda.core ObjectCode
    kind: str  # "cubin" or "ptx"
    kernels: dict[str, Any] = attrs.field(factory=dict)

    def kernel(self, name: str) -> Any:
        k = self.kernels.get(name)
        if k is None:
            k = self.kernels[name] = self.code.get_kernel(name)
        return k


@attrs.frozen(eq=False)
class _Launch:
    """One kernel of a prepared routine: its Kernel, launch configuration and pointers."""

    name: str
    kernel: Any  # cuda.core Kernel (it keeps the library loaded)
    config: Any  # cuda.core LaunchConfig
    pointers: tuple[Any, ...]  # np.uint64 device pointers, then the statics follow

    @property
    def grid(self) -> tuple[int, int, int]:
        return tuple(self.config.grid)

    @property
    def block(self) -> tuple[int, int, int]:
        return tuple(self.config.block)


@attrs.frozen(eq=False)
class _Prepared:
    ordinal: int
    launches: tuple[_Launch, ...]
    n_statics: int


# ---------------------------------------------------------------------------
# The driver


class CudaDriver(DriverDefaults):
    """The Driver of the CUDA backend (see the module docstring)."""

    name = "cuda"

    def __init__(self, *, fast_math: bool = False, staging_bytes: int = STAGING_BYTES) -> None:
        self.dialect = CudaDialect()
        self.options = NVRTC_OPTIONS + (FAST_MATH_OPTIONS if fast_math else ())
        self.staging_bytes = max(1 << 20, staging_bytes)
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
        if os.environ.get("POLYJIT_CUDA_DISABLE", "").strip() not in ("", "0"):
            return "disabled by POLYJIT_CUDA_DISABLE"
        try:
            cu = _cu()
            from cuda.core import Device
        except ImportError as e:
            return f"cuda-core / cuda-bindings are not importable ({e}); install polyjit[cuda]"
        try:  # raw cuInit: without a driver, cuda.core's Device() can hang instead of raising
            (err,) = cu.cuInit(0)
        except Exception as e:  # no libcuda: cuda.bindings raises before calling anything
            return f"no CUDA driver: cuInit failed ({type(e).__name__}: {e})"
        if err:
            return f"cuInit failed: {_err_name(err)}"
        count = int(_ok(cu.cuDeviceGetCount(), "cuDeviceGetCount"))
        if count == 0:
            return "the CUDA driver reports no devices"
        self._devices = [Device(k) for k in range(count)]
        self._peer = [[i != j and self._devices[i].can_access_peer(j) for j in range(count)] for i in range(count)]
        self._infos = [self._describe(k) for k in range(count)]
        return None

    def _describe(self, ordinal: int) -> DeviceInfo:
        dev = self._devices[ordinal]
        p = dev.properties
        major, minor = tuple(dev.compute_capability)
        # raw: cuda.core 1.2 has no total-memory query
        memory = int(_ok(_cu().cuDeviceTotalMem(int(dev.device_id)), "cuDeviceTotalMem"))
        props: dict[str, Any] = {
            "compute_capability": (major, minor),
            "arch": f"sm_{major}{minor}",
            "sm_count": p.multiprocessor_count,
            "warp_size": p.warp_size,
            "max_threads_per_block": p.max_threads_per_block,
            "max_threads_per_sm": p.max_threads_per_multiprocessor,
            "shared_memory_per_block": p.max_shared_memory_per_block,
            "shared_memory_per_block_optin": p.max_shared_memory_per_block_optin,
            "registers_per_block": p.max_registers_per_block,
            "l2_cache_bytes": p.l2_cache_size,
            "ecc": bool(p.ecc_enabled),
            "integrated": bool(p.integrated),
            "pci_bus_id": f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}",
            "fp64": True,
            "peer_access": tuple(self._peer[ordinal]),  # can this device reach device j's memory
            "peer_matrix": tuple(tuple(row) for row in self._peer),
            **versions(),
        }
        return DeviceInfo(name=dev.name, memory_bytes=memory, compute_units=p.multiprocessor_count,
                          base_alignment=BASE_ALIGNMENT, properties=props)

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

    def _current(self, ordinal: int) -> Any:
        """Make the device's primary context current on this thread (checked every time)."""
        self._probe()
        dev = self._devices[ordinal]
        dev.set_current()
        return dev

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
            from cuda.core import DeviceMemoryResource, StreamOptions

            with self._lock:
                hit = self._memory.get(ordinal)
                if hit is None:
                    dev = self._current(ordinal)
                    hit = self._memory[ordinal] = (DeviceMemoryResource(dev),
                                                   dev.create_stream(options=StreamOptions(nonblocking=True)))
        return hit

    def alloc(self, ordinal: int, nbytes: int, alignment: int) -> _Pool:
        mr, stream = self._resource(ordinal)
        self._current(ordinal)
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
        return _Pool(ordinal, ptr, buf, nbytes)

    def free(self, ordinal: int, pool: _Pool) -> None:
        _, stream = self._resource(ordinal)
        self._current(ordinal)
        pool.buffer.close(stream)  # the runtime calls this once the pool's last work is done

    def allocated_bytes(self, ordinal: int) -> int:
        """Bytes in use in the device's memory pool (polyjit's pools only), once the frees
        already ordered on its stream have run."""
        mr, stream = self._resource(ordinal)
        self._current(ordinal)
        stream.sync()
        return int(mr.attributes.used_mem_current)

    # -- DLPack: pools are device memory ---------------------------------------------------

    def dlpack_device(self, ordinal: int) -> tuple[int, int]:
        return (2, ordinal)  # kDLCUDA

    def address(self, pool: _Pool, offset: int) -> int:
        return pool.ptr + offset

    def wrap_address(self, ordinal: int, address: int, nbytes: int) -> _Pool:
        return _Pool(ordinal, address, None, nbytes)  # lent memory: the runtime never frees it

    def foreign_stream(self, stream: _Stream) -> int:
        """The stream a DLPack producer must order its work on: this one's CUstream."""
        return int(stream.handle)

    def wait_foreign(self, ordinal: int, stream: int, event: _Event) -> None:
        """Make another library's stream (a CUstream address, or 1 / 2: the legacy and
        per-thread default streams) wait for one of polyjit's events."""
        from cuda.core import Stream

        self._current(ordinal)
        if stream in (1, 2):  # the default streams have no handle to wrap: wait on the host
            event.core.sync()
            return
        Stream.from_handle(stream).wait(event.core)

    # -- streams and events ----------------------------------------------------------------

    def new_stream(self, ordinal: int) -> _Stream:
        from cuda.core import StreamOptions

        s = self._current(ordinal).create_stream(options=StreamOptions(nonblocking=True))
        return _Stream(ordinal, s, s.handle)

    def close_stream(self, stream: _Stream) -> None:
        self._current(stream.ordinal)
        stream.core.close()

    def record(self, stream: _Stream) -> _Event:
        free = self._free_events[stream.ordinal]
        try:
            recycled = free.pop()
        except IndexError:
            recycled = None
        self._current(stream.ordinal)
        if recycled is None:
            from cuda.core import EventOptions

            return _Event(stream.ordinal, stream.core.record(options=EventOptions(timing_enabled=False)), free)
        return _Event(stream.ordinal, stream.core.record(recycled), free)

    def record_timed(self, stream: _Stream) -> _Event:
        from cuda.core import EventOptions

        self._current(stream.ordinal)
        return _Event(stream.ordinal, stream.core.record(options=EventOptions(timing_enabled=True)), [])

    def elapsed_ms(self, start: _Event, end: _Event) -> float:
        return float(end.core - start.core)

    def wait(self, stream: _Stream, event: _Event) -> None:
        self._current(stream.ordinal)
        stream.core.wait(event.core)

    def event_done(self, event: _Event) -> bool:
        self._current(event.ordinal)  # a sticky fault of another device's context is not this one's
        if not event.core.is_done:
            return False
        self._poll(event.ordinal)
        return True

    def event_sync(self, event: _Event) -> None:
        self._current(event.ordinal)
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

    def _copy(self, dst: int, src: int, nbytes: int, stream: _Stream) -> None:
        self._view(dst, nbytes).copy_from(self._view(src, nbytes), stream=stream.core)

    def _ring(self, ordinal: int) -> Staging:
        ring = self._staging.get(ordinal)
        if ring is None:
            from cuda.core import PinnedMemoryResource

            with self._lock:
                ring = self._staging.get(ordinal)
                if ring is None:
                    _, stream = self._resource(ordinal)
                    self._current(ordinal)  # the ring belongs to this device's context
                    buf = PinnedMemoryResource().allocate(self.staging_bytes, stream=stream)
                    stream.sync()
                    ring = self._staging[ordinal] = Staging(buf, self._raw_record, self._copy)
        return ring

    def _raw_record(self, stream: _Stream) -> Any:
        return self.record(stream).core

    def memset_zero(self, stream: _Stream, pool: _Pool, offset: int, nbytes: int) -> None:
        if nbytes > 0:
            self._current(stream.ordinal)
            self._view(pool.ptr + offset, nbytes).fill(0, stream=stream.core)

    def copy_from_host(self, stream: _Stream, pool: _Pool, offset: int, array: np.ndarray) -> None:
        if array.nbytes:
            self._current(stream.ordinal)
            self._ring(stream.ordinal).to_device(stream, pool.ptr + offset, array.reshape(-1).view(np.uint8))

    def copy_to_host(self, stream: _Stream, pool: _Pool, offset: int, array: np.ndarray) -> None:
        if array.nbytes:
            self._current(stream.ordinal)
            self._ring(stream.ordinal).to_host(stream, array.reshape(-1).view(np.uint8), pool.ptr + offset)

    def copy_device(self, stream: _Stream, dst: tuple[int, _Pool, int], src: tuple[int, _Pool, int],
                    nbytes: int) -> None:
        if nbytes <= 0:
            return
        (dord, dpool, doff), (sord, spool, soff) = dst, src
        if dord != sord:
            self._enable_peers()
        self._current(stream.ordinal)
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

    def load(self, ordinal: int, binary: CudaBinary) -> _Module:
        from cuda.core import ObjectCode

        arch = self.arch(ordinal)
        self._current(ordinal)
        tried = []
        kind, image = binary.image(arch)
        attempts = [(kind, image)]
        if kind == "cubin":  # e.g. a driver older than NVRTC: let it JIT the PTX
            newest = max(a for a in nvrtc_supported_archs() if a <= arch_number(arch))
            attempts.append(("ptx", binary.ptx(f"compute_{newest}")))
        for kind, image in attempts:
            code = ObjectCode.from_cubin(image) if kind == "cubin" else ObjectCode.from_ptx(image)
            module = _Module(ordinal, code, kind)
            try:
                if binary.kernel_names:
                    module.kernel(binary.kernel_names[0])  # loads the library now: errors surface here
                return module
            except Exception as e:
                tried.append(f"{kind}: {type(e).__name__}: {e}")
        driver_version = self.device_info(ordinal).properties.get("driver_version")
        raise CudaDriverError(
            f"cuda:{ordinal} ({arch}) could not load the batch's module (driver {driver_version}, "
            f"NVRTC {'.'.join(map(str, nvrtc_version()))}); tried " + "; ".join(tried))

    def prepare(self, ordinal: int, module: _Module,
                kernels: Sequence[tuple[KernelSpec, Sequence[tuple[Any, int]]]]) -> _Prepared:
        from cuda.core import LaunchConfig

        self._current(ordinal)
        n_statics = len(kernels[0][0].statics) if kernels else 0
        sms = int(self.device_info(ordinal).properties["sm_count"])
        launches = []
        for spec, args in kernels:
            if len(spec.statics) != n_statics:
                raise InvalidProgramError(f"kernel {spec.name} takes {len(spec.statics)} statics, not {n_statics}")
            grid, block = grid_and_block(spec.launch, sms)
            config = LaunchConfig(grid=grid, block=block, shmem_size=spec.launch.shared_bytes)
            launches.append(_Launch(spec.name, module.kernel(spec.name), config,
                                    tuple(np.uint64(pool.ptr + off) for pool, off in args)))
        return _Prepared(ordinal, tuple(launches), n_statics)

    def launch(self, stream: _Stream, prepared: _Prepared, statics: Sequence[int]) -> None:
        # cuda.core's launch: 0.74 us a call on the stub against 0.39 us for a raw cuLaunchKernel
        # with packed parameters; a GPU driver's own launch costs several times either.
        from cuda.core import launch

        tail = [np.int64(v) for v in statics]
        self._current(prepared.ordinal)  # cuda.core launches in the thread's current context
        for ln in prepared.launches:
            try:
                launch(stream.core, ln.config, ln.kernel, *ln.pointers, *tail)
            except Exception as e:
                raise CudaDriverError(f"launching {ln.name} (grid {ln.grid}, block {ln.block}) on "
                                      f"cuda:{prepared.ordinal} failed: {e}") from e

    def close(self) -> None:
        """Free the staging rings (the process exit does the rest)."""
        with self._lock:
            for ring in self._staging.values():
                ring.close()
            self._staging.clear()


def versions() -> dict[str, Any]:
    """The versions a first run on a GPU must know: driver, NVRTC, cuda.core, cuda.bindings."""
    out: dict[str, Any] = {}
    try:
        out["driver_version"] = int(_ok(_cu().cuDriverGetVersion(), "cuDriverGetVersion"))
    except (PolyjitError, ImportError, RuntimeError):
        out["driver_version"] = None
    try:
        out["nvrtc_version"] = nvrtc_version()
    except PolyjitError:
        out["nvrtc_version"] = None
    for mod in ("cuda.core", "cuda.bindings"):
        try:
            out[mod.replace(".", "_") + "_version"] = __import__(mod, fromlist=["__version__"]).__version__
        except (ImportError, AttributeError):
            out[mod.replace(".", "_") + "_version"] = None
    return out
