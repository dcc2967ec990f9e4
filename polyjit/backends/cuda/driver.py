"""The CUDA backend: cuda.bindings (driver API) for devices, memory, streams and launches;
NVRTC (``nvidia-cuda-nvrtc``) for code.

- Devices: every GPU the driver reports, with its compute capability, memory, SM
  count and the peer-access matrix in ``DeviceInfo.properties``. The driver is
  never touched before ``cuInit`` has succeeded (without a driver, later calls can
  hang): on a machine without one the backend reports zero devices and keeps the
  reason in ``CudaDriver.unavailable_reason``. Importing this module needs neither
  a driver nor the cuda packages.
- Code: a batch's CUDA C source (``cuda_dialect.CudaDialect``) is compiled by NVRTC
  to a CUBIN for each device's own arch (``sm_XY``), or to PTX for the newest arch
  NVRTC knows when the device is newer still. ``compile()`` compiles for the archs of
  the present devices (``sm_90`` when there are none, so codegen is still checked)
  and returns a :class:`CudaBinary` that compiles further archs on demand. Binaries
  are cached by content (source, options, arch, NVRTC version) on disk and in memory.
- Memory: a pool is one ``cuMemAlloc`` slab; kernels get base + offset. Host copies go
  through a ring of pinned staging memory per device, in chunks, so large transfers
  run at DMA speed and the host copy of one chunk overlaps the DMA of the previous.
- Streams are non-blocking; events are timing-disabled CUDA events (recycled);
  ``wait`` is ``cuStreamWaitEvent``. Copies between devices use ``cuMemcpyPeerAsync``
  (peer access is enabled where ``cuDeviceCanAccessPeer`` allows).
- Launches: ``prepare`` builds each kernel's argument array once; ``launch`` only
  writes the statics and calls ``cuLaunchKernel``.
- Graph replay: :func:`capture` turns linked routines into a CUDA graph whose
  static-index arguments are updated between replays (:class:`Plan`).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import numpy as np

from polyjit.alloc.slab import MERGE_POOL, BufferLoc
from polyjit.backends.cuda.dialect import CudaDialect
from polyjit.core.cache import BinaryCache, content_key
from polyjit.core.codegen import KernelSpec, LaunchShape, Source
from polyjit.core.compiler import source_excerpt
from polyjit.core.errors import (
    BackendUnavailableError,
    BindingError,
    CompileError,
    InvalidProgramError,
    MergeBufferMismatchError,
    PolyjitError,
    UnknownDeviceError,
    UnsupportedError,
)
from polyjit.core.ir import StaticSymbol
from polyjit.core.protocol import DeviceInfo
from polyjit.core.runtime import Backend, Replay, Routine, Stream
from polyjit.core.streams import enqueue

__all__ = [
    "BASE_ALIGNMENT",
    "DEFAULT_ARCH",
    "NVRTC_OPTIONS",
    "STAGING_BYTES",
    "CudaBackend",
    "CudaBinary",
    "CudaDriver",
    "CudaDriverError",
    "Plan",
    "capture",
    "create_backend",
    "grid_and_block",
    "nvrtc_compile",
    "nvrtc_log",
    "nvrtc_supported_archs",
    "nvrtc_version",
]

DEFAULT_ARCH = "sm_90"  # what compile() targets when no device is present
BASE_ALIGNMENT = 256  # cuMemAlloc's alignment; also every pool offset (float4 loads need 16)
NVRTC_OPTIONS: tuple[str, ...] = ("-lineinfo", "--std=c++17")
FAST_MATH_OPTIONS: tuple[str, ...] = ("--use_fast_math",)
BLOCKS_PER_SM = 32  # a grid-stride launch uses at most this many blocks per SM
STAGING_BYTES = int(float(os.environ.get("POLYJIT_CUDA_STAGING_MB", "64")) * (1 << 20))
_LOG_LIMIT = 6000  # characters of NVRTC log kept in a CompileError message


class CudaDriverError(PolyjitError, RuntimeError):
    """A CUDA driver call failed (the message names the call and the CUresult)."""


# ---------------------------------------------------------------------------
# The cuda packages, imported on first use (the module imports without them)


_modules_lock = threading.Lock()
_driver_mod: Any = None
_nvrtc_mod: Any = None


def _cu() -> Any:
    """cuda.bindings.driver (importing it does not load libcuda)."""
    global _driver_mod
    if _driver_mod is None:
        with _modules_lock:
            if _driver_mod is None:
                from cuda.bindings import driver

                _driver_mod = driver
    return _driver_mod


def _nvrtc() -> Any:
    global _nvrtc_mod
    if _nvrtc_mod is None:
        with _modules_lock:
            if _nvrtc_mod is None:
                try:
                    from cuda.bindings import nvrtc
                except ImportError as e:
                    raise BackendUnavailableError(
                        f"NVRTC is not available: cuda-bindings cannot be imported ({e}); "
                        "install polyjit[cuda]"
                    ) from e
                _nvrtc_mod = nvrtc
    return _nvrtc_mod


def _err_name(err: Any) -> str:
    try:
        res, name = _cu().cuGetErrorName(err)
        if not res and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        pass
    return str(err)


def _values(result: Any) -> Any:
    """The value(s) of a cuda.bindings result tuple ``(err, *values)``: None, one, or a tuple."""
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def _ok(result: Any, what: str) -> Any:
    """Check a cuda.bindings driver result tuple; return the value(s)."""
    if result[0]:
        raise CudaDriverError(f"{what} failed: {_err_name(result[0])}")
    return _values(result)


# ---------------------------------------------------------------------------
# NVRTC


def _nvrtc_ok(result: Any, what: str) -> Any:
    if result[0]:
        raise CompileError(f"NVRTC {what} failed: {result[0]}")
    return _values(result)


_nvrtc_info: dict[str, Any] = {}


def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor)."""
    if "version" not in _nvrtc_info:
        try:
            major, minor = _nvrtc_ok(_nvrtc().nvrtcVersion(), "nvrtcVersion")
        except PolyjitError:
            raise
        except Exception as e:  # the library itself is missing
            raise BackendUnavailableError(f"NVRTC is not available: {type(e).__name__}: {e}") from e
        _nvrtc_info["version"] = (int(major), int(minor))
    return tuple(_nvrtc_info["version"])


def nvrtc_supported_archs() -> tuple[int, ...]:
    """The SM versions NVRTC compiles for (e.g. 75, 80, ..., 120)."""
    if "archs" not in _nvrtc_info:
        nvrtc_version()
        _nvrtc_info["archs"] = tuple(int(a) for a in _nvrtc_ok(_nvrtc().nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs"))
    return tuple(_nvrtc_info["archs"])


def _arch_number(arch: str) -> int:
    """``sm_90`` / ``compute_90`` -> 90."""
    digits = "".join(ch for ch in arch.split("_", 1)[-1] if ch.isdigit())
    if not digits:
        raise UnsupportedError(f"not a CUDA arch: {arch!r}")
    return int(digits)


CUBIN_CACHE = BinaryCache("cuda", ".cubin")
PTX_CACHE = BinaryCache("cuda", ".ptx")
_memory_cache: dict[str, bytes] = {}
_memory_lock = threading.Lock()


def nvrtc_compile(
    text: str,
    arch: str = DEFAULT_ARCH,
    *,
    kind: str = "cubin",
    options: Sequence[str] = NVRTC_OPTIONS,
    name: str = "polyjit.cu",
) -> bytes:
    """CUDA C -> CUBIN (``kind="cubin"``, ``arch="sm_XY"``) or PTX (``kind="ptx"``; an
    ``sm_XY`` arch is turned into ``compute_XY``), cached on disk and in memory by
    (source, options, arch, NVRTC version). Raises :class:`CompileError` with the log
    and the numbered source lines it points at."""
    if kind not in ("cubin", "ptx"):
        raise ValueError(f"kind must be 'cubin' or 'ptx', not {kind!r}")
    number = _arch_number(arch)
    target = f"sm_{number}" if kind == "cubin" else f"compute_{number}"
    major, minor = nvrtc_version()
    opts = (f"--gpu-architecture={target}", *options)
    key = content_key(text, " ".join(opts), target, f"nvrtc {major}.{minor}", kind)
    with _memory_lock:
        hit = _memory_cache.get(key)
    if hit is not None:
        return hit
    cache = CUBIN_CACHE if kind == "cubin" else PTX_CACHE

    def build(out: Any) -> None:
        out.write_bytes(_nvrtc_build(text, opts, kind, name))

    data = cache.get_or_build_bytes(key, build)
    with _memory_lock:
        _memory_cache[key] = data
    return data


def nvrtc_log(text: str, arch: str = DEFAULT_ARCH, *, options: Sequence[str] = NVRTC_OPTIONS,
              name: str = "polyjit.cu") -> str:
    """Compile ``text`` to a CUBIN for ``arch`` without the cache and return NVRTC's log:
    empty when the source compiles without a warning. Raises :class:`CompileError` on errors."""
    return _nvrtc_run(text, (f"--gpu-architecture=sm_{_arch_number(arch)}", *options), "cubin", name)[1]


def _nvrtc_build(text: str, opts: Sequence[str], kind: str, name: str) -> bytes:
    return _nvrtc_run(text, opts, kind, name)[0]


def _nvrtc_run(text: str, opts: Sequence[str], kind: str, name: str) -> tuple[bytes, str]:
    """(the CUBIN or PTX, the log)."""
    nv = _nvrtc()
    prog = _nvrtc_ok(nv.nvrtcCreateProgram(text.encode(), name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        encoded = [o.encode() for o in opts]
        (err,) = nv.nvrtcCompileProgram(prog, len(encoded), encoded)
        log = _program_log(nv, prog)
        if err:
            shown = log if len(log) <= _LOG_LIMIT else log[:_LOG_LIMIT] + "\n... (log truncated)"
            raise CompileError(
                f"NVRTC {nvrtc_version()[0]}.{nvrtc_version()[1]} failed to compile {name} "
                f"({err.name if hasattr(err, 'name') else err}) with {' '.join(opts)}:\n{shown}\n"
                f"generated source around the fault:\n{source_excerpt(text, log)}",
                source=text,
                log=log,
            )
        if kind == "cubin":
            size = _nvrtc_ok(nv.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            buf = _nvrtc_buffer(size)
            _nvrtc_ok(nv.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
            return bytes(buf), log
        size = _nvrtc_ok(nv.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
        buf = _nvrtc_buffer(size)
        _nvrtc_ok(nv.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
        return bytes(buf), log  # the PTX is NUL-terminated, as cuModuleLoadData wants
    finally:
        nv.nvrtcDestroyProgram(prog)


def _nvrtc_buffer(size: int) -> bytearray:
    """A fresh, writable buffer for NVRTC to fill. Never ``b" " * size``: NVRTC writes into
    the bytes object it is given, and ``b" " * 1`` (an empty log is one NUL) is the
    interpreter's one shared ``b" "``; filling it changes ``b" "`` in the whole process."""
    return bytearray(max(0, int(size)))


def _program_log(nv: Any, prog: Any) -> str:
    try:
        size = _nvrtc_ok(nv.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = _nvrtc_buffer(size)
        _nvrtc_ok(nv.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        return bytes(buf).rstrip(b"\x00").decode(errors="replace").strip()
    except PolyjitError:
        return ""


class CudaBinary:
    """A compiled batch: its CUDA source and, per arch, a CUBIN (or PTX) compiled on demand."""

    def __init__(self, source: Source, options: Sequence[str] = NVRTC_OPTIONS) -> None:
        self.source = source
        self.text = source.text
        self.options = tuple(options)
        self.kernel_names = tuple(k.name for k in source.all_kernels)
        self._images: dict[str, tuple[str, bytes]] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"CudaBinary({len(self.kernel_names)} kernels, archs {sorted(self._images)})"

    @property
    def archs(self) -> tuple[str, ...]:
        """The archs compiled so far."""
        return tuple(sorted(self._images))

    def cubin(self, arch: str) -> bytes:
        return nvrtc_compile(self.text, arch, kind="cubin", options=self.options)

    def ptx(self, arch: str) -> bytes:
        return nvrtc_compile(self.text, arch, kind="ptx", options=self.options)

    def image(self, arch: str) -> tuple[str, bytes]:
        """("cubin", bytes) for an arch NVRTC supports; else ("ptx", bytes) for the newest
        older arch it supports (the driver JIT-compiles it)."""
        with self._lock:
            hit = self._images.get(arch)
        if hit is not None:
            return hit
        number = _arch_number(arch)
        supported = nvrtc_supported_archs()
        if number in supported:
            out = ("cubin", self.cubin(f"sm_{number}"))
        else:
            older = [a for a in supported if a <= number]
            if not older:
                raise UnsupportedError(
                    f"NVRTC {nvrtc_version()} cannot compile for {arch} (it supports sm_{min(supported)} and newer)"
                )
            out = ("ptx", self.ptx(f"compute_{max(older)}"))
        with self._lock:
            self._images[arch] = out
        return out


# ---------------------------------------------------------------------------
# Driver-side handles


@attrs.frozen(eq=False)
class _Pool:
    ordinal: int
    ptr: int  # aligned base the kernels see
    raw: Any  # what cuMemAlloc returned (freed with cuMemFree)
    nbytes: int


class _Stream:
    __slots__ = ("cu", "handle", "ordinal")

    def __init__(self, ordinal: int, handle: Any) -> None:
        self.ordinal = ordinal
        self.handle = handle  # CUstream
        self.cu = int(handle)

    def __repr__(self) -> str:
        return f"CudaStream(device {self.ordinal}, 0x{self.cu:x})"


class _Event:
    """A recorded CUDA event; its handle goes back to the device's free list when dropped."""

    __slots__ = ("free", "handle", "ordinal")

    def __init__(self, ordinal: int, handle: Any, free: list[Any]) -> None:
        self.ordinal = ordinal
        self.handle = handle
        self.free = free

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.free.append(self.handle)


class _Module:
    def __init__(self, ordinal: int, handle: Any, kind: str) -> None:
        self.ordinal = ordinal
        self.handle = handle
        self.kind = kind  # "cubin" or "ptx"
        self._functions: dict[str, Any] = {}

    def function(self, name: str) -> Any:
        f = self._functions.get(name)
        if f is None:
            f = _ok(_cu().cuModuleGetFunction(self.handle, name.encode()), f"cuModuleGetFunction({name})")
            self._functions[name] = f
        return f


@attrs.frozen(eq=False)
class _Launch:
    """One kernel of a prepared routine: its function, grid, block and argument storage."""

    name: str
    func: Any
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int
    buffers: Any  # ctypes c_uint64 array: the device pointers
    n_buffers: int
    n_statics: int
    params: Any  # ctypes c_void_p array: the kernelParams (pointers into buffers and statics)

    @property
    def params_addr(self) -> int:
        return ctypes.addressof(self.params)

    def param_array(self, statics: Any) -> Any:
        """A kernelParams array over these buffers and another statics array."""
        n = self.n_buffers + self.n_statics
        arr = (ctypes.c_void_p * max(1, n))()
        base = ctypes.addressof(self.buffers)
        for k in range(self.n_buffers):
            arr[k] = base + 8 * k
        sbase = ctypes.addressof(statics)
        for k in range(self.n_statics):
            arr[self.n_buffers + k] = sbase + 8 * k
        return arr


@attrs.frozen(eq=False)
class _Prepared:
    ordinal: int
    launches: tuple[_Launch, ...]
    statics: Any  # ctypes c_longlong array shared by every kernel of the routine
    n_statics: int
    calls: tuple[tuple[Any, ...], ...]  # cuLaunchKernel arguments but the stream, per kernel


def grid_and_block(launch: LaunchShape, sm_count: int | None = None) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """CUDA grid and block from an OpenCL-style launch config; 1-D launches (grid-stride
    kernels) are capped at ``BLOCKS_PER_SM * sm_count`` blocks."""
    local = tuple(launch.local_size or (1,) * len(launch.global_size))
    glob = tuple(launch.global_size)
    grid = [max(1, g // max(1, b)) for g, b in zip(glob, local)]
    if len(glob) == 1 and sm_count:
        grid[0] = max(1, min(grid[0], BLOCKS_PER_SM * sm_count))
    g3 = (grid + [1, 1, 1])[:3]
    b3 = (list(local) + [1, 1, 1])[:3]
    return (g3[0], g3[1], g3[2]), (b3[0], b3[1], b3[2])


_COPY_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))
_PARALLEL_COPY_BYTES = 4 << 20
_copy_pool: ThreadPoolExecutor | None = None


def _host_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """memcpy between uint8 views; large copies are split across a few threads (numpy releases
    the GIL while it copies), so staging keeps up with the DMA engines."""
    global _copy_pool
    n = dst.nbytes
    if n < _PARALLEL_COPY_BYTES or _COPY_THREADS == 1:
        np.copyto(dst, src)
        return
    if _copy_pool is None:
        with _modules_lock:
            if _copy_pool is None:
                _copy_pool = ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="polyjit-cuda-copy")
    step = (n + _COPY_THREADS - 1) // _COPY_THREADS
    futures = [_copy_pool.submit(np.copyto, dst[k : k + step], src[k : k + step]) for k in range(0, n, step)]
    for f in futures:
        f.result()


class _Staging:
    """A ring of pinned host memory for one device. Each chunk of a host copy takes a
    segment; a segment is reused only after the event recorded behind its DMA is done.
    A segment may carry a completion (copying a device-to-host chunk out to the user's
    array), run when its event is found done, at the latest before its space is reused."""

    def __init__(self, driver: CudaDriver, ordinal: int, nbytes: int) -> None:
        cu = _cu()
        self.driver = driver
        self.ordinal = ordinal
        self.nbytes = nbytes
        self.ptr = int(_ok(cu.cuMemHostAlloc(nbytes, cu.CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc"))
        self.view = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self.ptr))
        self.head = 0
        # [start, end, event, completion or None]
        self.segments: collections.deque[list[Any]] = collections.deque()
        self.pending = 0  # segments whose completion has not run
        self.lock = threading.RLock()

    @property
    def chunk(self) -> int:
        return max(1 << 20, self.nbytes // 4)

    def _reclaim_done(self) -> None:
        """Free the oldest segments whose events are done (running their completions)."""
        query = _cu().cuEventQuery
        while self.segments and not query(self.segments[0][2])[0]:
            seg = self.segments.popleft()
            self._complete(seg)
            self.driver._free_events[self.ordinal].append(seg[2])

    def _retire_oldest(self) -> None:
        seg = self.segments.popleft()
        _ok(_cu().cuEventSynchronize(seg[2]), "cuEventSynchronize")
        self._complete(seg)
        self.driver._free_events[self.ordinal].append(seg[2])

    def _complete(self, seg: list[Any]) -> None:
        done = seg[3]
        if done is not None:
            seg[3] = None
            self.pending -= 1
            done()

    def stage(self, stream: _Stream, n: int, fill: Callable[[np.ndarray], None] | None,
              enqueue: Callable[[int], None], completion: Callable[[np.ndarray], None] | None) -> None:
        """Take ``n`` bytes of the ring, ``fill`` them (host side), ``enqueue(ptr)`` the DMA on
        ``stream``, record an event behind it, and remember ``completion`` (called with the
        segment's bytes once the event is done)."""
        size = (n + 255) // 256 * 256
        with self.lock:
            self._reclaim_done()
            if self.head + size > self.nbytes:
                self.head = 0
            start, end = self.head, self.head + size
            while self.segments and any(s[0] < end and start < s[1] for s in self.segments):
                self._retire_oldest()
            self.head = end
            view = self.view[start : start + n]
            if fill is not None:
                fill(view)
            enqueue(self.ptr + start)
            event = self.driver._raw_record(stream)
            done = None if completion is None else (lambda: completion(view))
            self.segments.append([start, end, event, done])
            if done is not None:
                self.pending += 1

    def poll(self) -> None:
        """Run the completions whose events are done."""
        if not self.pending:
            return
        query = _cu().cuEventQuery
        with self.lock:
            for seg in self.segments:
                if seg[3] is not None and not query(seg[2])[0]:
                    self._complete(seg)
            self._reclaim_done()

    def close(self) -> None:
        with self.lock:
            while self.segments:
                self._retire_oldest()
            _cu().cuMemFreeHost(self.ptr)


# ---------------------------------------------------------------------------
# The driver


class CudaDriver:
    """The Driver of the CUDA backend (see the module docstring)."""

    name = "cuda"

    def __init__(self, *, fast_math: bool = False, staging_bytes: int = STAGING_BYTES) -> None:
        self.dialect = CudaDialect()
        self.options = NVRTC_OPTIONS + (FAST_MATH_OPTIONS if fast_math else ())
        self.staging_bytes = max(1 << 20, staging_bytes)
        self._lock = threading.RLock()
        self._probed = False
        self._reason: str | None = None
        self._devices: list[Any] = []  # CUdevice per ordinal
        self._infos: list[DeviceInfo] = []
        self._archs: list[str] = []
        self._sm_counts: list[int] = []
        self._peer: tuple[tuple[bool, ...], ...] = ()
        self._ctxs: dict[int, Any] = {}
        self._tls = threading.local()
        self._free_events: dict[int, list[Any]] = collections.defaultdict(list)
        self._staging: dict[int, _Staging | None] = {}

    # -- devices -----------------------------------------------------------------

    @property
    def unavailable_reason(self) -> str | None:
        """Why there are no devices (None when there are some)."""
        self._probe()
        return self._reason

    def _probe(self) -> None:
        if self._probed:
            return
        with self._lock:
            if self._probed:
                return
            try:
                self._reason = self._init_devices()
            finally:
                self._probed = True

    def _init_devices(self) -> str | None:
        if os.environ.get("POLYJIT_CUDA_DISABLE", "").strip() not in ("", "0"):
            return "disabled by POLYJIT_CUDA_DISABLE"
        try:
            cu = _cu()
        except ImportError as e:
            return f"cuda-bindings is not importable ({e}); install polyjit[cuda]"
        try:
            (err,) = cu.cuInit(0)
        except Exception as e:  # no libcuda: cuda.bindings raises before calling anything
            return f"no CUDA driver: cuInit failed ({type(e).__name__}: {e})"
        if err:
            return f"cuInit failed: {_err_name(err)}"
        count = int(_ok(cu.cuDeviceGetCount(), "cuDeviceGetCount"))
        if count == 0:
            return "the CUDA driver reports no devices"
        self._devices = [_ok(cu.cuDeviceGet(k), "cuDeviceGet") for k in range(count)]
        peer = []
        for i in range(count):
            row = []
            for j in range(count):
                ok = i != j and bool(_ok(cu.cuDeviceCanAccessPeer(self._devices[i], self._devices[j]),
                                         "cuDeviceCanAccessPeer"))
                row.append(ok)
            peer.append(tuple(row))
        self._peer = tuple(peer)
        for k in range(count):
            self._infos.append(self._describe(k))
        return None

    def _attr(self, ordinal: int, name: str, default: int = 0) -> int:
        cu = _cu()
        attr = getattr(cu.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}", None)
        if attr is None:
            return default
        err, value = cu.cuDeviceGetAttribute(attr, self._devices[ordinal])
        return default if err else int(value)

    def _describe(self, ordinal: int) -> DeviceInfo:
        cu = _cu()
        dev = self._devices[ordinal]
        raw = _ok(cu.cuDeviceGetName(256, dev), "cuDeviceGetName")
        name = raw.split(b"\x00", 1)[0].decode(errors="replace").strip() if isinstance(raw, bytes) else str(raw)
        memory = int(_ok(cu.cuDeviceTotalMem(dev), "cuDeviceTotalMem"))
        major = self._attr(ordinal, "COMPUTE_CAPABILITY_MAJOR")
        minor = self._attr(ordinal, "COMPUTE_CAPABILITY_MINOR")
        sms = self._attr(ordinal, "MULTIPROCESSOR_COUNT", 1)
        arch = f"sm_{major}{minor}"
        self._archs.append(arch)
        self._sm_counts.append(sms)
        try:
            driver_version = int(_ok(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
        except CudaDriverError:
            driver_version = 0
        props: dict[str, Any] = {
            "compute_capability": (major, minor),
            "arch": arch,
            "sm_count": sms,
            "multiprocessor_count": sms,
            "warp_size": self._attr(ordinal, "WARP_SIZE", 32),
            "max_threads_per_block": self._attr(ordinal, "MAX_THREADS_PER_BLOCK", 1024),
            "max_threads_per_sm": self._attr(ordinal, "MAX_THREADS_PER_MULTIPROCESSOR"),
            "shared_memory_per_block": self._attr(ordinal, "MAX_SHARED_MEMORY_PER_BLOCK"),
            "shared_memory_per_block_optin": self._attr(ordinal, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
            "registers_per_block": self._attr(ordinal, "MAX_REGISTERS_PER_BLOCK"),
            "l2_cache_bytes": self._attr(ordinal, "L2_CACHE_SIZE"),
            "clock_khz": self._attr(ordinal, "CLOCK_RATE"),
            "memory_clock_khz": self._attr(ordinal, "MEMORY_CLOCK_RATE"),
            "async_engines": self._attr(ordinal, "ASYNC_ENGINE_COUNT"),
            "ecc": bool(self._attr(ordinal, "ECC_ENABLED")),
            "integrated": bool(self._attr(ordinal, "INTEGRATED")),
            "pci_bus_id": "{:04x}:{:02x}:{:02x}".format(
                self._attr(ordinal, "PCI_DOMAIN_ID"), self._attr(ordinal, "PCI_BUS_ID"),
                self._attr(ordinal, "PCI_DEVICE_ID")),
            "fp64": True,
            "peer_access": self._peer[ordinal],  # can this device access device j's memory
            "peer_matrix": self._peer,
            "driver_version": driver_version,
        }
        return DeviceInfo(name=name, memory_bytes=memory, compute_units=sms,
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
        self._probe()
        return self._archs[ordinal]

    # -- contexts ------------------------------------------------------------------

    def _ctx(self, ordinal: int) -> Any:
        ctx = self._ctxs.get(ordinal)
        if ctx is not None:
            return ctx
        with self._lock:
            ctx = self._ctxs.get(ordinal)
            if ctx is not None:
                return ctx
            self._probe()
            if not 0 <= ordinal < len(self._devices):
                raise UnknownDeviceError(f"cuda has {len(self._devices)} device(s); there is no device {ordinal}")
            cu = _cu()
            ctx = _ok(cu.cuDevicePrimaryCtxRetain(self._devices[ordinal]), "cuDevicePrimaryCtxRetain")
            self._ctxs[ordinal] = ctx
            self._enable_peers(ordinal)
            return ctx

    def _enable_peers(self, ordinal: int) -> None:
        """Enable peer access both ways between this device and every retained one that allows it."""
        cu = _cu()
        for other in list(self._ctxs):
            if other == ordinal:
                continue
            for a, b in ((ordinal, other), (other, ordinal)):
                if self._peer[a][b]:
                    _ok(cu.cuCtxSetCurrent(self._ctxs[a]), "cuCtxSetCurrent")
                    (err,) = cu.cuCtxEnablePeerAccess(self._ctxs[b], 0)
                    if err and err != cu.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
                        raise CudaDriverError(f"cuCtxEnablePeerAccess({a} -> {b}) failed: {_err_name(err)}")
        self._tls.ordinal = None  # the current context changed above

    def _use(self, ordinal: int, force: bool = False) -> None:
        """Make the device's primary context current on this thread."""
        tls = self._tls
        if force or getattr(tls, "ordinal", None) != ordinal:
            _ok(_cu().cuCtxSetCurrent(self._ctx(ordinal)), "cuCtxSetCurrent")
            tls.ordinal = ordinal

    # -- memory ----------------------------------------------------------------------

    def alloc(self, ordinal: int, nbytes: int, alignment: int) -> _Pool:
        cu = _cu()
        self._use(ordinal, force=True)
        extra = alignment if alignment > BASE_ALIGNMENT else 0
        err, raw = cu.cuMemAlloc(max(1, nbytes + extra))
        if err:
            if err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                raise MemoryError(f"cuMemAlloc of {nbytes} bytes on cuda:{ordinal}: out of memory")
            raise CudaDriverError(f"cuMemAlloc({nbytes}) on cuda:{ordinal} failed: {_err_name(err)}")
        ptr = int(raw)
        if extra:
            ptr = (ptr + alignment - 1) // alignment * alignment
        return _Pool(ordinal, ptr, raw, nbytes)

    def free(self, ordinal: int, pool: _Pool) -> None:
        self._use(ordinal, force=True)
        _ok(_cu().cuMemFree(pool.raw), "cuMemFree")

    def allocated_bytes(self, ordinal: int) -> int:
        """Device memory in use on this GPU (cuMemGetInfo: total - free), by every user."""
        self._use(ordinal, force=True)
        free, total = _ok(_cu().cuMemGetInfo(), "cuMemGetInfo")
        return int(total) - int(free)

    # -- streams and events ----------------------------------------------------------

    def close_stream(self, stream: _Stream) -> None:
        self._use(stream.ordinal, force=True)
        _ok(_cu().cuStreamDestroy(stream.handle), "cuStreamDestroy")

    def unload(self, ordinal: int, module: _Module) -> None:
        self._use(ordinal, force=True)
        _ok(_cu().cuModuleUnload(module.handle), "cuModuleUnload")

    def new_stream(self, ordinal: int) -> _Stream:
        cu = _cu()
        self._use(ordinal, force=True)
        handle = _ok(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        return _Stream(ordinal, handle)

    def _raw_record(self, stream: _Stream) -> Any:
        """Record a (recycled or new) event on the stream; returns the CUevent."""
        cu = _cu()
        free = self._free_events[stream.ordinal]
        self._use(stream.ordinal)
        try:
            handle = free.pop()
        except IndexError:
            handle = _ok(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        (err,) = cu.cuEventRecord(handle, stream.handle)
        if err:
            free.append(handle)
            raise CudaDriverError(f"cuEventRecord failed: {_err_name(err)}")
        return handle

    def record(self, stream: _Stream) -> _Event:
        return _Event(stream.ordinal, self._raw_record(stream), self._free_events[stream.ordinal])

    def wait(self, stream: _Stream, event: _Event) -> None:
        self._use(stream.ordinal)
        (err,) = _cu().cuStreamWaitEvent(stream.handle, event.handle, 0)
        if err:
            raise CudaDriverError(f"cuStreamWaitEvent failed: {_err_name(err)}")

    def event_done(self, event: _Event) -> bool:
        cu = _cu()
        (err,) = cu.cuEventQuery(event.handle)
        if not err:
            self._poll(event.ordinal)
            return True
        if err == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        raise CudaDriverError(f"cuEventQuery failed: {_err_name(err)}")

    def event_sync(self, event: _Event) -> None:
        _ok(_cu().cuEventSynchronize(event.handle), "cuEventSynchronize")
        self._poll(event.ordinal)

    def _poll(self, ordinal: int) -> None:
        ring = self._staging.get(ordinal)
        if ring is not None and ring.pending:
            ring.poll()

    # -- transfers ---------------------------------------------------------------------

    def _ring(self, ordinal: int) -> _Staging | None:
        """The device's pinned staging ring (None when pinned memory cannot be had)."""
        if ordinal in self._staging:
            return self._staging[ordinal]
        with self._lock:
            if ordinal not in self._staging:
                self._use(ordinal, force=True)
                try:
                    self._staging[ordinal] = _Staging(self, ordinal, self.staging_bytes)
                except CudaDriverError:
                    self._staging[ordinal] = None
            return self._staging[ordinal]

    def memset_zero(self, stream: _Stream, pool: _Pool, offset: int, nbytes: int) -> None:
        if nbytes <= 0:
            return
        self._use(stream.ordinal)
        _ok(_cu().cuMemsetD8Async(pool.ptr + offset, 0, nbytes, stream.handle), "cuMemsetD8Async")

    @staticmethod
    def _bytes(array: np.ndarray) -> np.ndarray:
        if not array.flags.c_contiguous:
            raise InvalidProgramError("cuda host copies need C-contiguous arrays")
        return array.reshape(-1).view(np.uint8)

    def copy_from_host(self, stream: _Stream, pool: _Pool, offset: int, array: np.ndarray) -> None:
        n = array.nbytes
        if n == 0:
            return
        cu = _cu()
        src = self._bytes(array)
        dst = pool.ptr + offset
        self._use(stream.ordinal)
        ring = self._ring(stream.ordinal)
        if ring is None:  # pageable: the driver stages it before returning
            _ok(cu.cuMemcpyHtoDAsync(dst, src.ctypes.data, n, stream.handle), "cuMemcpyHtoDAsync")
            return
        chunk = ring.chunk
        for off in range(0, n, chunk):
            m = min(chunk, n - off)

            def fill(view: np.ndarray, off: int = off, m: int = m) -> None:
                _host_copy(view, src[off : off + m])

            def enqueue(ptr: int, off: int = off, m: int = m) -> None:
                _ok(cu.cuMemcpyHtoDAsync(dst + off, ptr, m, stream.handle), "cuMemcpyHtoDAsync")

            ring.stage(stream, m, fill, enqueue, None)

    def copy_to_host(self, stream: _Stream, pool: _Pool, offset: int, array: np.ndarray) -> None:
        """Enqueue the copy into pinned staging; the bytes reach ``array`` when an event recorded
        after this call is synced (or found done), or earlier when the staging space is reused."""
        n = array.nbytes
        if n == 0:
            return
        cu = _cu()
        out = self._bytes(array)
        src = pool.ptr + offset
        self._use(stream.ordinal)
        ring = self._ring(stream.ordinal)
        if ring is None:  # pageable: synchronous
            _ok(cu.cuMemcpyDtoHAsync(out.ctypes.data, src, n, stream.handle), "cuMemcpyDtoHAsync")
            _ok(cu.cuStreamSynchronize(stream.handle), "cuStreamSynchronize")
            return
        chunk = ring.chunk
        for off in range(0, n, chunk):
            m = min(chunk, n - off)

            def enqueue(ptr: int, off: int = off, m: int = m) -> None:
                _ok(cu.cuMemcpyDtoHAsync(ptr, src + off, m, stream.handle), "cuMemcpyDtoHAsync")

            def completion(view: np.ndarray, off: int = off, m: int = m) -> None:
                _host_copy(out[off : off + m], view)

            ring.stage(stream, m, None, enqueue, completion)

    def copy_device(self, stream: _Stream, dst: tuple[int, _Pool, int], src: tuple[int, _Pool, int],
                    nbytes: int) -> None:
        if nbytes <= 0:
            return
        cu = _cu()
        (dord, dpool, doff), (sord, spool, soff) = dst, src
        self._use(stream.ordinal)
        if dord == sord:
            _ok(cu.cuMemcpyDtoDAsync(dpool.ptr + doff, spool.ptr + soff, nbytes, stream.handle),
                "cuMemcpyDtoDAsync")
        else:
            _ok(cu.cuMemcpyPeerAsync(dpool.ptr + doff, self._ctx(dord), spool.ptr + soff, self._ctx(sord),
                                     nbytes, stream.handle), "cuMemcpyPeerAsync")

    # -- code ----------------------------------------------------------------------------

    def compile(self, source: Source) -> CudaBinary:
        """Compile for the archs of the present devices now (``sm_90`` without devices, so that
        errors surface here); other archs compile when a device of that arch loads it."""
        binary = CudaBinary(source, self.options)
        self._probe()
        for arch in sorted(set(self._archs)) or [DEFAULT_ARCH]:
            binary.image(arch)
        return binary

    def load(self, ordinal: int, binary: CudaBinary) -> _Module:
        cu = _cu()
        arch = self.arch(ordinal)
        kind, image = binary.image(arch)
        self._use(ordinal, force=True)
        err, handle = cu.cuModuleLoadData(image)
        if err and kind == "cubin":  # e.g. a driver older than NVRTC: let it JIT the PTX
            newest = max(a for a in nvrtc_supported_archs() if a <= _arch_number(arch))
            kind, image = "ptx", binary.ptx(f"compute_{newest}")
            err2, handle = cu.cuModuleLoadData(image)
            if err2:
                raise CudaDriverError(
                    f"cuModuleLoadData on cuda:{ordinal} ({arch}) failed for the CUBIN ({_err_name(err)}) "
                    f"and for the PTX ({_err_name(err2)})"
                )
        elif err:
            raise CudaDriverError(f"cuModuleLoadData ({kind}) on cuda:{ordinal} failed: {_err_name(err)}")
        return _Module(ordinal, handle, kind)

    def prepare(self, ordinal: int, module: _Module,
                kernels: Sequence[tuple[KernelSpec, Sequence[tuple[Any, int]]]]) -> _Prepared:
        self._use(ordinal, force=True)
        n_statics = len(kernels[0][0].statics) if kernels else 0
        statics = (ctypes.c_longlong * max(1, n_statics))()
        sms = self._sm_counts[ordinal] if ordinal < len(self._sm_counts) else None
        launches = []
        for spec, args in kernels:
            if len(spec.statics) != n_statics:
                raise InvalidProgramError(f"kernel {spec.name} takes {len(spec.statics)} statics, not {n_statics}")
            buffers = (ctypes.c_uint64 * max(1, len(args)))(*[pool.ptr + off for pool, off in args])
            grid, block = grid_and_block(spec.launch, sms)
            params = (ctypes.c_void_p * max(1, len(args) + n_statics))()
            launch = _Launch(spec.name, module.function(spec.name), grid, block, spec.launch.shared_bytes,
                             buffers, len(args), n_statics, params)
            filled = launch.param_array(statics)
            ctypes.memmove(params, filled, ctypes.sizeof(filled))
            launches.append(launch)
        calls = tuple((ln.func, *ln.grid, *ln.block, ln.shared) for ln in launches)
        return _Prepared(ordinal, tuple(launches), statics, n_statics, calls)

    def launch(self, stream: _Stream, prepared: _Prepared, statics: Sequence[int]) -> None:
        if statics:
            prepared.statics[: len(statics)] = statics
        self._use(stream.ordinal)
        launch_kernel = _cu().cuLaunchKernel
        h = stream.handle
        for call, ln in zip(prepared.calls, prepared.launches):
            (err,) = launch_kernel(*call, h, ln.params_addr, 0)
            if err:
                raise CudaDriverError(
                    f"cuLaunchKernel({ln.name}, grid {ln.grid}, block {ln.block}) failed: {_err_name(err)}"
                )

    def close(self) -> None:
        """Free the staging rings (the process exit does the rest)."""
        with self._lock:
            for ordinal, ring in list(self._staging.items()):
                if ring is not None:
                    self._use(ordinal, force=True)
                    ring.close()
            self._staging.clear()


# ---------------------------------------------------------------------------
# The backend


class CudaBackend(Backend):
    """The CUDA backend: the generic runtime over a :class:`CudaDriver`."""

    driver: CudaDriver

    def __init__(self, driver: CudaDriver | None = None) -> None:
        super().__init__(driver or CudaDriver())

    @property
    def unavailable_reason(self) -> str | None:
        """Why this backend has no devices here (None when it has some)."""
        return self.driver.unavailable_reason

    def capture(self, routines: Sequence[Routine], *, stream: Stream | None = None) -> Plan:
        """The routines recorded into a CUDA graph: one launch a replay (see :func:`capture`)."""
        return capture(routines, stream=stream)

    def static_properties(self) -> dict[str, Any]:
        props = super().static_properties()
        props["unavailable_reason"] = self.driver.unavailable_reason
        props["default_arch"] = DEFAULT_ARCH
        props["nvrtc_options"] = self.driver.options
        try:
            props["nvrtc_version"] = nvrtc_version()
            props["nvrtc_archs"] = tuple(f"sm_{a}" for a in nvrtc_supported_archs())
        except PolyjitError as e:
            props["nvrtc_version"] = None
            props["nvrtc_unavailable_reason"] = str(e)
        props["archs"] = tuple(self.driver.arch(k) for k in range(self.num_devices()))
        return props


def create_backend(*, fast_math: bool = False) -> CudaBackend:
    """The CUDA backend (zero devices, with ``unavailable_reason``, where there is no driver)."""
    return CudaBackend(CudaDriver(fast_math=fast_math))


# ---------------------------------------------------------------------------
# Graph replay


class Plan(Replay):
    """Linked routines captured once into a CUDA graph, replayed with one launch.

    ``bindings`` maps each static symbol of the routines to its value (initially the
    routines' own bindings); ``replay()`` reads it, updates the graph's kernel nodes
    whose statics changed (``cuGraphExecKernelNodeSetParams``), waits on the device
    side for the buffers' writers and readers like ``Routine.run()``, and launches the
    graph on ``stream``. Build one with :func:`capture`.
    """

    def __init__(self, routines: Sequence[Routine], stream: Stream) -> None:
        if not routines:
            raise InvalidProgramError("capture() needs at least one routine")
        device = routines[0].context.device
        driver = device.driver
        if not isinstance(driver, CudaDriver):
            raise InvalidProgramError(f"capture() needs routines of the cuda backend, not {device.backend.name}")
        for r in routines:
            if not isinstance(r, Routine):
                raise InvalidProgramError(f"capture() takes linked routines, not {type(r).__name__}")
            if r.context.device is not device:
                raise InvalidProgramError(
                    f"capture(): {r!r} runs on {r.context.device.device_id}, not {device.device_id}")
            r.context.check_alive()
        if stream.device is not device:
            raise InvalidProgramError(f"capture(): {stream!r} is not a stream of {device.device_id}")
        self.routines = tuple(routines)
        self.stream = stream
        self.device = device
        self._driver: CudaDriver = driver
        self.bindings: dict[StaticSymbol, int] = {}
        for r in self.routines:
            for sym, value in r.bindings.items():
                self.bindings.setdefault(sym, value)
        self._merge_generation = device.merge.generation
        self._reads: list[BufferLoc] = []
        self._writes: list[BufferLoc] = []
        self._build()

    def _prepared_of(self, r: Routine) -> _Prepared:
        device = self.device
        merge = r.merge_buffer_input
        if merge is not None and device.merge.node is not merge:
            held = device.merge.node.label if device.merge.node else "nothing"
            raise MergeBufferMismatchError(
                f"routine {r.name} reads {merge.label} from the merge buffer of {device.device_id}, "
                f"which holds {held}")
        prepared = r.prepared()
        assert isinstance(prepared, _Prepared)
        return prepared

    def _build(self) -> None:
        cu = _cu()
        drv = self._driver
        drv._use(self.device.ordinal, force=True)
        self._graph = _ok(cu.cuGraphCreate(0), "cuGraphCreate")
        self._nodes: list[tuple[int, Any, Any, Any]] = []  # (routine index, node, params struct, keep)
        self._statics: list[Any] = []  # per routine: its ctypes statics array
        self._last: list[tuple[int, ...] | None] = []
        prev = None
        for ri, r in enumerate(self.routines):
            prepared = self._prepared_of(r)
            statics = (ctypes.c_longlong * max(1, prepared.n_statics))()
            self._statics.append(statics)
            self._last.append(None)
            for ln in prepared.launches:
                arr = ln.param_array(statics)
                p = cu.CUDA_KERNEL_NODE_PARAMS()
                p.func = ln.func
                p.gridDimX, p.gridDimY, p.gridDimZ = ln.grid
                p.blockDimX, p.blockDimY, p.blockDimZ = ln.block
                p.sharedMemBytes = ln.shared
                p.kernelParams = ctypes.addressof(arr)
                p.extra = 0
                deps = [prev] if prev is not None else None
                node = _ok(cu.cuGraphAddKernelNode(self._graph, deps, 1 if deps else 0, p), "cuGraphAddKernelNode")
                self._nodes.append((ri, node, p, (arr, ln)))
                prev = node
            self._reads.extend(r.read_locs)  # what Routine.run() waits on and records
            self._writes.extend(r.write_locs)
        self._reads = list(dict.fromkeys(self._reads))
        self._writes = list(dict.fromkeys(self._writes))
        if any(r.merge_buffer_input is not None for r in self.routines):
            self._reads.append(BufferLoc(MERGE_POOL, 0))
            self._reads = list(dict.fromkeys(self._reads))
        self._exec = _ok(cu.cuGraphInstantiate(self._graph, 0), "cuGraphInstantiate")
        self._closed = False

    @property
    def kernel_count(self) -> int:
        return len(self._nodes)

    def bind(self, **values: int) -> Plan:
        """Set bindings by symbol name: ``plan.bind(b=3).replay()``."""
        by_name = {s.name: s for r in self.routines for s in r.statics}
        for name, value in values.items():
            if name not in by_name:
                raise BindingError(f"no static symbol named {name!r} in the captured routines")
            self.bindings[by_name[name]] = int(value)
        return self

    def replay(self) -> None:
        """Enqueue the whole graph once on the plan's stream."""
        if self._closed:
            raise InvalidProgramError("this plan was closed")
        device = self.device
        for r in self.routines:
            r.context.check_alive()
            merge = r.merge_buffer_input
            if merge is not None and (device.merge.node is not merge or device.merge.generation != self._merge_generation):
                raise MergeBufferMismatchError(
                    f"routine {r.name} of this plan reads {merge.label} from the merge buffer, which has "
                    "changed (another node, or grown and moved) since capture; capture again")
        cu = _cu()
        drv = self._driver
        drv._use(device.ordinal)
        changed: set[int] = set()
        for ri, r in enumerate(self.routines):
            if not r.statics:
                continue
            values = r.static_values(self.bindings)
            if values != self._last[ri]:
                self._statics[ri][: len(values)] = values
                self._last[ri] = values
                changed.add(ri)
        if changed:
            for ri, node, p, _ in self._nodes:
                if ri in changed:
                    _ok(cu.cuGraphExecKernelNodeSetParams(self._exec, node, p), "cuGraphExecKernelNodeSetParams")
        stream = self.stream
        tracker = device.tracker
        with device.lock:
            enqueue(stream, tracker.states(self._reads), tracker.states(self._writes), self,
                    lambda: _ok(cu.cuGraphLaunch(self._exec, stream.handle.handle), "cuGraphLaunch"),
                    (), (self,))

    def close(self) -> None:
        """Destroy the graph (the routines stay usable)."""
        if self._closed:
            return
        self._closed = True
        cu = _cu()
        self.stream.synchronize()
        cu.cuGraphExecDestroy(self._exec)
        cu.cuGraphDestroy(self._graph)

    def __enter__(self) -> Plan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Plan({len(self.routines)} routines, {self.kernel_count} kernels on {self.device.device_id})"


def capture(routines: Routine | Iterable[Routine], *, stream: Stream | None = None,
            bindings: Mapping[StaticSymbol, int] | None = None) -> Plan:
    """Capture linked cuda routines (run in this order) into a CUDA graph.

    ``stream`` defaults to the first routine's context stream. Returns a :class:`Plan`:
    set ``plan.bindings[sym]`` (or ``plan.bind(name=value)``) and call ``plan.replay()``.
    """
    rs = [routines] if isinstance(routines, Routine) else list(routines)
    if not rs:
        raise InvalidProgramError("capture() needs at least one routine")
    plan = Plan(rs, stream or rs[0].context.stream)
    if bindings:
        plan.bindings.update(bindings)
    return plan
