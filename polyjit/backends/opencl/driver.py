"""The OpenCL backend: pyopencl, kernels in OpenCL C, one context per platform.

Devices are every device of every OpenCL platform pyopencl finds, in the order
(platform index, device index), or only those of ``POLYJIT_OPENCL_PLATFORM``
(a platform name substring or index) when it is set. All devices of a platform
share one ``cl.Context``, so buffers of one device can be copied to another on
the device side. Without an OpenCL platform (no ICD loader or no driver) the
backend reports zero devices and says why in ``OpenCLDriver.unavailable_reason``.

Memory: a pool is one ``cl.Buffer``; a kernel gets the pool buffer plus a byte
offset (never a sub-buffer, whose offsets must be aligned to the device's base
alignment), declared as ``__global char* pN, ulong oN`` and cast to the element
type at the kernel's start.

Streams are in-order command queues with profiling on; events are ``cl.Event``s.
A stream waits for another one's event with a barrier on its own queue, so the
host never blocks. Host copies are non-blocking; the driver holds pyopencl's
``NannyEvent`` (which keeps the host array alive, and would block if freed early)
until the copy is done.

Code: one program per batch, built per platform for the devices that can run
it, kept in memory, and its binaries cached on disk by content (platform,
device, driver version, build options and source) through ``core/cache.py``;
on CPU devices only with ``POLYJIT_OPENCL_BINARY_CACHE=always``, because PoCL
compiles every kernel to native code to hand its binaries out (see
``OpenCLDriver``) and caches its own builds anyway. Matmul-shaped kernels
get a tiled kernel with two variants chosen when the program is built: on CPU
devices (``-D PJ_CPU``) each work-item keeps an 8x8 block of the output in
vector registers and reads the operands straight from (cached) memory; on other
devices the work-group stages 16-deep tiles of both operands in local memory
and each work-item computes 8x8 outputs.

Run the tests on pip's PoCL alone with ``OCL_ICD_VENDORS`` set to the ``pocl.icd``
file inside pyopencl's wheel (see :func:`pip_pocl_icd`); ``POCL_DEVICES="pthread
pthread"`` makes PoCL show two CPU devices.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib.util
import math
import os
import threading
import warnings
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from polyjit.backends.opencl.dialect import CPU_BUILD_OPTION, OpenCLDialect
from polyjit.core.cache import BinaryCache, content_key
from polyjit.core.codegen import KernelSpec, LaunchShape, Source
from polyjit.core.compiler import source_excerpt
from polyjit.core.errors import CompileError, UnknownDeviceError, UnsupportedError
from polyjit.core.protocol import DeviceInfo
from polyjit.core.runtime import Backend

try:
    import pyopencl as cl
except ImportError as _e:  # the dialect still works (code generation needs no driver)
    cl = None  # type: ignore[assignment]
    _IMPORT_ERROR: str | None = f"pyopencl cannot be imported: {_e}"
else:
    _IMPORT_ERROR = None

PLATFORM_ENV = "POLYJIT_OPENCL_PLATFORM"
BINARY_CACHE_ENV = "POLYJIT_OPENCL_BINARY_CACHE"
MIN_BASE_ALIGNMENT = 64  # bytes; pool offsets are multiples of max(this, the device's alignment)
RECENT_PROGRAMS = 16  # dropped batches whose programs are kept for a compile of the same source
PROBE_KERNEL = "__kernel void pj_probe(__global int* a) { a[0] = 1; }"


def pip_pocl_icd() -> str | None:
    """The ``pocl.icd`` file shipped inside pyopencl's wheel (``pyopencl[pocl]``), if any.

    Setting ``OCL_ICD_VENDORS`` to this *file* (not its folder: pyopencl's loader
    reads that folder anyway, and PoCL would show up twice) makes the ICD loader
    offer pip's PoCL alone, whatever OpenCL drivers the system has.
    """
    spec = importlib.util.find_spec("pyopencl")
    if spec is None or spec.origin is None:
        return None
    icd = Path(spec.origin).parent / ".libs" / "pocl.icd"
    return str(icd) if icd.is_file() else None


SYSTEM_POCL_ICDS = ("/etc/OpenCL/vendors/pocl.icd",)  # Debian's pocl-opencl-icd


def working_pocl_icd() -> str | None:
    """An ICD file of a PoCL that builds kernels on this host: pip's (see :func:`pip_pocl_icd`)
    when it can, else the system's. pip's PoCL 3.0 is built on LLVM 14, which does not know
    CPUs newer than it (AMD Zen 5: "unknown target CPU 'generic'"); Debian's PoCL does.
    Each candidate is tried in a child process: OpenCL reads ``OCL_ICD_VENDORS`` once."""
    import subprocess
    import sys

    probe = ("import pyopencl as cl\n"
             "for p in cl.get_platforms():\n"
             "    cl.Program(cl.Context(devices=p.get_devices()), PROBE).build()\n")
    for icd in (pip_pocl_icd(), *SYSTEM_POCL_ICDS):
        if not icd or not Path(icd).is_file():
            continue
        env = {**os.environ, "OCL_ICD_VENDORS": icd}
        code = f"PROBE = {PROBE_KERNEL!r}\n{probe}"
        try:
            done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0:
            return icd
    return None


# ---------------------------------------------------------------------------
# Driver objects


@attrs.define(eq=False)
class _Device:
    ordinal: int
    platform_index: int
    device_index: int
    platform: Any  # cl.Platform
    device: Any  # cl.Device
    context: Any  # cl.Context, shared by the platform's devices
    group: int  # devices of one group share a build (same context and options)
    options: str
    fp64: bool
    is_cpu: bool
    max_alloc: int
    info: DeviceInfo
    staging: Any = None  # a queue for blocking reads when copying across platforms


class _Stream:
    """An in-order queue and the event of its last command."""

    __slots__ = ("dev", "done_seq", "flushed_seq", "last", "queue", "seq")

    def __init__(self, dev: _Device, queue: Any) -> None:
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
class _Binary:
    """A compiled batch: the source and its built program per device group, which live as long
    as the batch (its CodeBatch, or a routine's loaded module) does."""

    text: str
    key: str
    fp64: bool
    names: tuple[str, ...]
    programs: dict[int, Any] = attrs.field(factory=dict)


@attrs.frozen(eq=False)
class _Module:
    program: Any
    dev: _Device


@attrs.frozen(eq=False)
class _Launch:
    kernel: Any
    global_size: tuple[int, ...]
    local_size: tuple[int, ...] | None
    first_static: int


@attrs.frozen(eq=False)
class _Prepared:
    launches: tuple[_Launch, ...]
    keep: tuple[Any, ...]  # the pool buffers the kernels point at
    calls: tuple[tuple[Any, tuple[int, ...], tuple[int, ...] | None], ...] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        calls = tuple((ln.kernel, ln.global_size, ln.local_size) for ln in self.launches)
        object.__setattr__(self, "calls", calls)


def _cl_name(value: Any) -> str:
    return str(value).strip()


def _device_type(flags: int) -> str:
    for name in ("GPU", "ACCELERATOR", "CPU", "CUSTOM"):
        if flags & getattr(cl.device_type, name):
            return name.lower()
    return "other"


def _platform_filter(platforms: Sequence[Any], want: str) -> list[int]:
    want = want.strip()
    if want.isdigit():
        k = int(want)
        return [k] if k < len(platforms) else []
    low = want.lower()
    return [k for k, p in enumerate(platforms) if low in _cl_name(p.name).lower()]


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
            raise ValueError(f"group_reductions must be auto, on or off, not {group_reductions!r}")
        if matmul_variant not in ("auto", "local", "off"):
            raise ValueError(f"matmul_variant must be auto, local or off, not {matmul_variant!r}")
        binary_cache = binary_cache or os.environ.get(BINARY_CACHE_ENV) or "auto"
        if binary_cache not in ("auto", "always", "never"):
            raise ValueError(f"binary_cache must be auto, always or never, not {binary_cache!r}")
        self.binary_cache = binary_cache
        self._dialect = OpenCLDialect(matmul=matmul_variant != "off", group_reductions=group_reductions != "off")
        self._group_reductions = group_reductions
        self.matmul_variant = matmul_variant
        self.platform_filter = platform if platform is not None else os.environ.get(PLATFORM_ENV)
        self.unavailable_reason: str | None = None
        self.cache = BinaryCache("opencl", ".bin")
        self._devices: list[_Device] | None = None
        self._lock = threading.RLock()
        # Live batches by content: compiling the same source again reuses their programs; the
        # most recent few stay even when dropped (a bounded set: programs are megabytes each).
        self._binaries: weakref.WeakValueDictionary[str, _Binary] = weakref.WeakValueDictionary()
        self._recent: collections.OrderedDict[str, _Binary] = collections.OrderedDict()
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
    def devices(self) -> list[_Device]:
        if self._devices is None:
            with self._lock:
                if self._devices is None:
                    self._devices = self._discover()
        return self._devices

    def _discover(self) -> list[_Device]:
        if cl is None:
            self.unavailable_reason = _IMPORT_ERROR
            return []
        try:
            platforms = list(cl.get_platforms())
        except cl.Error as e:  # no ICD loader configuration, or no driver behind it
            self.unavailable_reason = f"no OpenCL platform: {e}".strip()
            return []
        indices = list(range(len(platforms)))
        if self.platform_filter:
            indices = _platform_filter(platforms, self.platform_filter)
            if not indices:
                names = ", ".join(f"{k}: {_cl_name(p.name)}" for k, p in enumerate(platforms))
                self.unavailable_reason = (
                    f"{PLATFORM_ENV}={self.platform_filter!r} matches no OpenCL platform ({names or 'none'})"
                )
                return []
        out: list[_Device] = []
        problems: list[str] = []
        groups: dict[tuple[int, str], int] = {}
        for pk in indices:
            plat = platforms[pk]
            try:
                devs = list(plat.get_devices())
                ctx = cl.Context(devices=devs) if devs else None
            except cl.Error as e:
                problems.append(f"{_cl_name(plat.name)}: {e}")
                continue
            broken = _cannot_build(ctx, devs) if devs else None
            if broken:
                problems.append(f"{_cl_name(plat.name)} ({_cl_name(plat.version)}) cannot build kernels "
                                f"here: {broken}")
                continue
            for dk, dev in enumerate(devs):
                is_cpu = bool(dev.type & cl.device_type.CPU)
                options = CPU_BUILD_OPTION if (is_cpu and self.matmul_variant == "auto") else ""
                group = groups.setdefault((pk, options), len(groups))
                out.append(self._describe(len(out), pk, dk, plat, dev, ctx, group, options, is_cpu))
        if not out:
            self.unavailable_reason = "no OpenCL device" + (f" ({'; '.join(problems)})" if problems else "")
        return out

    @staticmethod
    def _describe(ordinal: int, pk: int, dk: int, plat: Any, dev: Any, ctx: Any, group: int,
                  options: str, is_cpu: bool) -> _Device:
        extensions = _cl_name(dev.extensions).split()
        try:
            double_config = int(dev.double_fp_config)
        except cl.Error:
            double_config = 0
        fp64 = "cl_khr_fp64" in extensions or double_config != 0
        align = max(MIN_BASE_ALIGNMENT, int(dev.mem_base_addr_align) // 8)  # the query is in bits
        name = _cl_name(dev.name)
        info = DeviceInfo(
            name=name,
            memory_bytes=int(dev.global_mem_size),
            compute_units=int(dev.max_compute_units),
            base_alignment=align,
            properties={
                "platform": _cl_name(plat.name),
                "platform_index": pk,
                "device_index": dk,
                "vendor": _cl_name(dev.vendor),
                "driver_version": _cl_name(dev.driver_version),
                "opencl_version": _cl_name(dev.version),
                "device_type": _device_type(dev.type),
                "fp64": fp64,
                "max_mem_alloc_size": int(dev.max_mem_alloc_size),
                "max_work_group_size": int(dev.max_work_group_size),
                "local_mem_size": int(dev.local_mem_size),
            },
        )
        return _Device(ordinal, pk, dk, plat, dev, ctx, group, options, fp64, is_cpu,
                       int(dev.max_mem_alloc_size), info)

    def _dev(self, ordinal: int) -> _Device:
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

    def compile(self, source: Source) -> _Binary:
        text = source.text
        key = content_key("opencl", text)
        with self._lock:
            hit = self._binaries.get(key)
            if hit is not None:
                self._recent[key] = hit
                self._recent.move_to_end(key)
                return hit
        fp64 = "cl_khr_fp64 : enable" in text
        binary = _Binary(text, key, fp64, tuple(k.name for k in source.all_kernels))
        with self._lock:
            self._binaries[key] = binary
            self._recent[key] = binary
            while len(self._recent) > RECENT_PROGRAMS:
                self._recent.popitem(last=False)
        devices = self.devices
        if not devices:
            return binary  # nothing to build for; linking needs a device anyway
        usable = [d for d in devices if d.fp64 or not fp64]
        if not usable:
            names = ", ".join(sorted({d.info.name for d in devices}))
            raise UnsupportedError(
                f"the batch uses float64, but no OpenCL device here supports it "
                f"(no cl_khr_fp64 on {names}); cast to float32"
            )
        for group in sorted({d.group for d in usable}):
            self._program(binary, group)
        return binary

    def _program(self, binary: _Binary, group: int) -> Any:
        """The program of a batch for one device group: already built, from the disk cache, or
        built now."""
        hit = binary.programs.get(group)
        if hit is not None:
            return hit
        with self._lock:
            hit = binary.programs.get(group)
            if hit is not None:
                return hit
            devs = [d for d in self.devices if d.group == group and (d.fp64 or not binary.fp64)]
            if not self._on_disk(devs):
                self.cache.compiles += 1
                program = self._build_source(binary.text, devs)
                _check_kernels(program, binary, devs)
                binary.programs[group] = program
                return program
            built: list[Any] = []  # the program built from source, once, if any key misses

            def build(dev: _Device, path: Path) -> None:
                if not built:
                    built.append(self._build_source(binary.text, devs))
                path.write_bytes(_binary_for(built[0], dev, devs))

            blobs = [self.cache.get_or_build_bytes(self._cache_key(binary, d), functools.partial(build, d))
                     for d in devs]
            program = built[0] if built else self._build_binaries(binary, devs, blobs)
            _check_kernels(program, binary, devs)
            binary.programs[group] = program
            return program

    def _on_disk(self, devs: Sequence[_Device]) -> bool:
        if self.binary_cache == "auto":
            return not any(d.is_cpu for d in devs)
        return self.binary_cache == "always"

    @staticmethod
    def _cache_key(binary: _Binary, dev: _Device) -> str:
        return content_key(
            "opencl-binary-v1", _cl_name(dev.platform.name), _cl_name(dev.platform.version),
            dev.info.name, _cl_name(dev.device.driver_version), dev.options, binary.text,
        )

    def _build_source(self, text: str, devs: Sequence[_Device]) -> Any:
        ctx = devs[0].context
        program = cl._cl._Program(ctx, text)  # the raw program: pyopencl's own cache stays out of it
        try:
            _build(program, devs)
        except cl.Error as e:
            raise _compile_error(program, text, devs, e) from None
        return program

    def _build_binaries(self, binary: _Binary, devs: Sequence[_Device], blobs: Sequence[bytes]) -> Any:
        """A program from verified cached binaries; one the driver refuses (another driver
        version, say) is built from source again and its entries replaced."""
        try:
            program = cl._cl._Program(devs[0].context, [d.device for d in devs], list(blobs))
            _build(program, devs)
            return program
        except cl.Error:
            program = self._build_source(binary.text, devs)
            for d in devs:
                self.cache.put(self._cache_key(binary, d), _binary_for(program, d, devs))
            return program

    def load(self, ordinal: int, binary: _Binary) -> _Module:
        dev = self._dev(ordinal)
        if binary.fp64 and not dev.fp64:
            raise UnsupportedError(
                f"the batch uses float64, but OpenCL device {ordinal} ({dev.info.name}) has no "
                f"cl_khr_fp64; cast to float32 or use another device"
            )
        return _Module(self._program(binary, dev.group), dev)

    def prepare(
        self, ordinal: int, module: _Module, kernels: Sequence[tuple[KernelSpec, Sequence[tuple[Any, int]]]]
    ) -> _Prepared:
        dev = module.dev
        launches: list[_Launch] = []
        keep: list[Any] = []
        for spec, args in kernels:
            kernel = cl.Kernel(module.program, spec.name)
            pos = 0
            for buf, offset in args:
                kernel.set_arg(pos, buf)
                kernel.set_arg(pos + 1, np.uint64(offset))
                keep.append(buf)
                pos += 2
            glob, local = _fit_launch(spec.launch, kernel, dev)
            launches.append(_Launch(kernel, glob, local, pos))
        return _Prepared(tuple(launches), tuple(keep))

    def launch(self, stream: _Stream, prepared: _Prepared, statics: Sequence[int]) -> None:
        # The hot path of every run(): the kernels' buffers are bound, only statics change.
        queue = stream.queue
        enqueue = cl.enqueue_nd_range_kernel
        ev = None
        if statics:
            for ln in prepared.launches:
                kernel = ln.kernel
                for pos, value in enumerate(statics, ln.first_static):
                    kernel.set_arg(pos, np.int64(value))
                ev = enqueue(queue, kernel, ln.global_size, ln.local_size)
        else:
            for kernel, gsize, lsize in prepared.calls:
                ev = enqueue(queue, kernel, gsize, lsize)
        if ev is not None:
            stream.seq += len(prepared.calls)
            stream.last = ev


def _cannot_build(ctx: Any, devs: Sequence[Any]) -> str | None:
    """Why a platform cannot build a trivial kernel (None when it can). A platform whose
    compiler does not know this host (pip's PoCL 3.0 on CPUs newer than its LLVM 14) is left
    out at discovery, with the reason, instead of failing every later build."""
    program = cl._cl._Program(ctx, PROBE_KERNEL)
    try:
        program.build(b"", devs)
    except cl.Error as e:
        logs = []
        for d in devs:
            with contextlib.suppress(cl.Error):
                logs.append(str(program.get_build_info(d, cl.program_build_info.LOG)).strip())
        log = " ".join(ln for ln in "\n".join(logs).splitlines() if ln.strip()) or str(e)
        hint = ""
        if "unknown target CPU" in log:
            hint = ("; its LLVM does not know this CPU: install a newer PoCL (Debian: "
                    "apt install pocl-opencl-icd) and point OCL_ICD_VENDORS at its .icd file")
        return log[:500] + hint
    return None


def _check_kernels(program: Any, binary: _Binary, devs: Sequence[_Device]) -> None:
    """A build can succeed yet drop kernels (PoCL does, after some ABI warnings): say so now,
    with the log, rather than fail later in clCreateKernel."""
    if not binary.names:
        return
    found = set(str(program.get_info(cl.program_info.KERNEL_NAMES)).split(";"))
    missing = [k for k in binary.names if k not in found]
    if missing:
        err = _compile_error(program, binary.text, devs, RuntimeError("no build log"))
        raise CompileError(f"the OpenCL program was built without kernels {', '.join(missing)}\n{err}",
                           source=binary.text, log=err.log)


def _build(program: Any, devs: Sequence[_Device]) -> None:
    with warnings.catch_warnings():
        # Warnings about generated code (an always-true comparison of a bool) are noise here.
        warnings.simplefilter("ignore", cl.CompilerWarning)
        program.build(devs[0].options.encode(), [d.device for d in devs])


def _binary_for(program: Any, dev: _Device, built_for: Sequence[_Device]) -> bytes:
    """The device's binary. The program holds every device of the context, but some drivers
    (PoCL) list binaries only for the devices it was built for, in the program's order."""
    devices = list(program.get_info(cl.program_info.DEVICES))
    binaries = list(program.get_info(cl.program_info.BINARIES))
    if len(binaries) != len(devices):
        wanted = [d.device for d in built_for]
        devices = [d for d in devices if d in wanted]
    if len(binaries) == len(devices):
        for d, b in zip(devices, binaries):
            if d == dev.device and len(b):
                return bytes(b)
    raise CompileError(f"the OpenCL program holds no binary for {dev.info.name}")


def _compile_error(program: Any, text: str, devs: Sequence[_Device], err: Exception) -> CompileError:
    logs: list[str] = []
    for d in devs:
        try:
            log = str(program.get_build_info(d.device, cl.program_build_info.LOG)).strip()
        except cl.Error:
            log = ""
        if log and log not in logs:
            logs.append(log)
    log = "\n".join(logs) or str(err)
    dev = devs[0]
    message = (
        f"OpenCL C build failed on {dev.info.name} ({_cl_name(dev.platform.name)}), "
        f"options {dev.options!r}:\n{log}\n\n{source_excerpt(text, log)}"
    )
    return CompileError(message, source=text, log=log)


def _fit_launch(launch: LaunchShape, kernel: Any, dev: _Device) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """The launch configuration, with the work-group shrunk (halved: the rounded global size
    stays a multiple) to what this kernel may use on this device. On CPU devices, kernels that
    do not require a work-group size let the driver choose: PoCL picks larger work-groups than
    a GPU wants (about 10% faster on a memory-bound copy), and every kernel guards its range."""
    glob = tuple(launch.global_size)
    if launch.local_size is None:
        return glob, None
    required = tuple(kernel.get_work_group_info(cl.kernel_work_group_info.COMPILE_WORK_GROUP_SIZE,
                                                dev.device))
    if dev.is_cpu and not any(required):
        return glob, None
    local = list(launch.local_size)
    limit = int(kernel.get_work_group_info(cl.kernel_work_group_info.WORK_GROUP_SIZE, dev.device))
    dims = list(dev.device.max_work_item_sizes)
    for d in range(len(local)):
        while local[d] > dims[d] and local[d] % 2 == 0:
            local[d] //= 2
    while math.prod(local) > limit:
        d = max(range(len(local)), key=lambda k: local[k])
        if local[d] % 2:
            break
        local[d] //= 2
    if math.prod(local) > limit or any(lsz > mx for lsz, mx in zip(local, dims)):
        raise UnsupportedError(
            f"kernel {kernel.function_name} needs work-groups of {tuple(launch.local_size)}, "
            f"but {dev.info.name} allows {limit} work-items ({tuple(dims)} per dimension)"
        )
    return glob, tuple(local)


def create_backend(platform: str | None = None, matmul_variant: str = "auto",
                   binary_cache: str | None = None, group_reductions: str = "auto") -> Backend:
    """The OpenCL backend. ``platform`` overrides ``$POLYJIT_OPENCL_PLATFORM`` (a name substring
    or an index); ``matmul_variant`` is "auto", "local" or "off"; ``binary_cache`` is "auto",
    "always" or "never"; ``group_reductions`` is "auto", "on" or "off" (see OpenCLDriver)."""
    return Backend(OpenCLDriver(platform, matmul_variant, binary_cache, group_reductions))
