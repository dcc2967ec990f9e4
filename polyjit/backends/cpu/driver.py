"""The CPU backend: C through the system compiler, loaded with ctypes, OpenMP inside kernels.

Each device is a set of cores (``POLYJIT_CPU_DEVICES=N`` splits the machine
into N devices); each stream is a worker thread written in C
(``runtime.c``) pinned to its device's cores, so handing a kernel over
costs about a microsecond and the GIL is never held while kernels run.
A pool is one aligned host allocation; kernels get pool base + offset.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from polyjit.backends.cpu import native, tiles
from polyjit.backends.cpu.compiler import CCompiler
from polyjit.backends.cpu.dialect import CpuDialect
from polyjit.backends.cpu.host import cpu_model, host_cpu
from polyjit.backends.cpu.native import (
    MAX_STATICS,
    TEAM_ADAPT,
    TEAM_OPTIONAL,
    NativeRuntime,
    _contention_mode,
    load_runtime,
)
from polyjit.core.codegen import KernelSpec, Source
from polyjit.core.compile_cache import SharedLibrary
from polyjit.core.device import close_devices_at_exit
from polyjit.core.dtypes import is_int
from polyjit.core.errors import BackendUnavailableError, UnsupportedError
from polyjit.core.protocol import DeviceInfo
from polyjit.core.raw import RAW
from polyjit.core.runtime import Backend

BASE_ALIGNMENT = 64  # a cache line; also enough for AVX-512 loads


def _total_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return 8 << 30


def split_cores(cores: Sequence[int], n: int) -> list[list[int]]:
    """N groups of cores, as even as possible; with more devices than cores, groups share cores."""
    cores = list(cores)
    if n <= len(cores):
        base, extra = divmod(len(cores), n)
        out, start = [], 0
        for k in range(n):
            size = base + (1 if k < extra else 0)
            out.append(cores[start : start + size])
            start += size
        return out
    return [[cores[k % len(cores)]] for k in range(n)]


@attrs.frozen(eq=False)
class _Prepared:
    descs: Any  # ctypes array of pj_launch_desc
    count: int
    keep: tuple[Any, ...]  # the void* arrays the descriptors point at


@attrs.frozen(repr=False)
class CpuBinary:
    """A compiled batch: the shared library's verified bytes (loaded as they are, never from
    the cache's file) and whether its kernels take the runtime's scratch memory."""

    data: bytes
    takes_scratch: bool

    def __repr__(self) -> str:
        return f"CpuBinary({len(self.data)} bytes)"


class CpuDriver:
    """The Driver of the CPU backend."""

    name = "cpu"

    def __init__(self, num_devices: int | None = None) -> None:
        if num_devices is None:
            text = os.environ.get("POLYJIT_CPU_DEVICES", "1") or "1"
            try:
                num_devices = int(text)
            except ValueError:
                raise BackendUnavailableError(f"POLYJIT_CPU_DEVICES must be a whole number, got {text!r}") from None
        if not is_int(num_devices) or num_devices < 1:
            raise BackendUnavailableError(f"the cpu backend needs at least 1 device (num_devices, or "
                                          f"POLYJIT_CPU_DEVICES), got {num_devices!r}")
        num_devices = int(num_devices)
        _contention_mode()  # a bad POLYJIT_CPU_CONTENTION is refused here, as a bad device count
        self.dialect = CpuDialect()
        self.compiler = CCompiler()
        self._cores = split_cores(sorted(os.sched_getaffinity(0)), num_devices)
        self._memory = _total_memory() // num_devices
        self._rt: NativeRuntime | None = None
        # Reentrant: a garbage collection under it may close a dropped stream (close_stream)
        self._lock = threading.RLock()
        self._allocated: dict[int, int] = {}  # pointer -> bytes, for allocated_bytes()
        # Native streams open, and pools to free once none is (free_when_idle)
        self._open: set[int] = set()
        self._idle_frees: list[tuple[int, frozenset[int]]] = []  # (pool, the streams it waits for)

    @property
    def rt(self) -> NativeRuntime:
        if self._rt is None:
            rt = load_runtime()
            close_devices_at_exit(CpuDriver)  # after the runtime's exit code, so it runs first
            self._rt = rt
        return self._rt

    # -- devices -----------------------------------------------------------------

    def device_count(self) -> int:
        return len(self._cores)

    def device_info(self, ordinal: int) -> DeviceInfo:
        cores = self._cores[ordinal]
        return DeviceInfo(
            name=f"{cpu_model()} [cores {','.join(map(str, cores))}]",
            memory_bytes=self._memory,
            compute_units=len(cores),
            base_alignment=BASE_ALIGNMENT,
            import_alignment=1,  # kernels load unaligned and peel streaming stores to alignment
            properties={"cores": tuple(cores), "openmp_threads": len(cores), "fp64": True},
        )

    # -- memory ------------------------------------------------------------------

    def alloc(self, ordinal: int, nbytes: int, alignment: int) -> int:
        ptr = self.rt.alloc(nbytes, max(alignment, BASE_ALIGNMENT))
        if not ptr:
            raise MemoryError(f"cannot allocate {nbytes} bytes on the host")
        with self._lock:
            self._allocated[ptr] = nbytes
        return ptr

    def free(self, ordinal: int, pool: int) -> None:
        with self._lock:
            del self._allocated[pool]
        self.rt.free(pool)

    def free_when_idle(self, ordinal: int, pool: int, streams: frozenset[int]) -> None:
        """Free ``pool`` once none of ``streams`` (the driver handles of its backend's streams)
        is open (now, if none is): for a pool whose Device object is gone in the same garbage
        cycle as its streams, whose closing (which waits for their queued work) comes after
        (found by review: the pools of a dropped backend were freed under its running kernels).
        Any device's stream of the backend counts: a copy queued on one device's stream reads
        another's pools (the second review); another backend's do not (a wrapped driver shares
        this one with the registry's backend, whose streams never close: the third review).
        Memory the driver did not allocate (taken in from numpy) is not its to free."""
        with self._lock:
            if pool not in self._allocated:
                return
            if self._open & streams:
                self._idle_frees.append((pool, streams))
                return
        self.free(ordinal, pool)

    # -- DLPack: pools are host memory ----------------------------------------------------

    def dlpack_device(self, ordinal: int) -> tuple[int, int]:
        return (1, 0)  # kDLCPU

    def address(self, pool: int, offset: int) -> int:
        return pool + offset

    def wrap_address(self, ordinal: int, address: int, nbytes: int) -> int:
        return address  # a pool is its base address; the runtime never frees an adopted one

    def allocated_bytes(self, ordinal: int) -> int:
        """Bytes of host memory this driver holds in pools (every device shares the host)."""
        with self._lock:
            return sum(self._allocated.values())

    # -- streams and events --------------------------------------------------------

    def new_stream(self, ordinal: int) -> int:
        cores = self._cores[ordinal]
        pin = cores if len(self._cores) > 1 else None  # one device: let the OS place threads
        handle = self.rt.stream_create(len(cores), pin)
        with self._lock:
            self._open.add(handle)
        return handle

    def close_stream(self, stream: int) -> None:
        """Drain the stream and join its worker thread; then free what waited for the last of
        its streams (free_when_idle)."""
        self.rt.stream_destroy(stream)
        with self._lock:
            self._open.discard(stream)
            pools = [pool for pool, streams in self._idle_frees if not self._open & streams]
            self._idle_frees = [(pool, streams) for pool, streams in self._idle_frees if self._open & streams]
        for pool in pools:
            with contextlib.suppress(KeyError):  # freed meanwhile by another path
                self.free(0, pool)

    def discard_queued(self) -> None:
        """At exit: every stream's tasks not yet begun are dropped (the runtime's workers count
        them done without running them): the process is going, and daemon threads may have
        queued more than any exit should wait for."""
        self.rt.discard_queued()

    def record(self, stream: int) -> tuple[int, int]:
        return (stream, self.rt.last_ticket(stream))

    def wait(self, stream: int, event: tuple[int, int]) -> None:
        self.rt.wait(stream, event[0], event[1])

    def event_done(self, event: tuple[int, int]) -> bool:
        return bool(self.rt.done(event[0]) >= event[1])

    def record_timed(self, stream: int) -> tuple[int, int, Any]:
        """An event that also notes when the worker got to it."""
        slot = ctypes.c_int64(0)
        return (stream, self.rt.stamp(stream, ctypes.byref(slot)), slot)

    def elapsed_ms(self, start: tuple[int, int, Any], end: tuple[int, int, Any]) -> float:
        return float(end[2].value - start[2].value) / 1e6

    def event_sync(self, event: tuple[int, int]) -> None:
        self.rt.sync(event[0], event[1])

    # -- transfers (the runtime keeps the host arrays alive until the copies are done) --------

    def memset_zero(self, stream: int, pool: int, offset: int, nbytes: int) -> None:
        self.rt.memset(stream, pool + offset, 0, nbytes)

    def copy_from_host(self, stream: int, pool: int, offset: int, array: np.ndarray) -> None:
        self.rt.memcpy_in(stream, pool + offset, native.host_address(array), array.nbytes)

    def copy_to_host(self, stream: int, pool: int, offset: int, array: np.ndarray) -> None:
        self.rt.memcpy(stream, native.host_address(array), pool + offset, array.nbytes)

    def copy_device(self, stream: int, dst: tuple[int, int, int], src: tuple[int, int, int], nbytes: int) -> None:
        self.rt.memcpy(stream, dst[1] + dst[2], src[1] + src[2], nbytes)

    # -- code -------------------------------------------------------------------------

    def compile(self, source: Source) -> CpuBinary:
        # -march=native: the binary is this host's (its CPU's digest is the cache target).
        data = self.compiler.data(source.text, (host_cpu().digest,))
        # Generated kernels that pack panels take memory from the runtime (runtime.c,
        # pj_scratch) through pointers load() sets. A user's kernel may define a function of
        # that name (a write to its address would hit read-only code).
        generated = not any(spec.plan.kind == RAW for spec in source.all_kernels)
        return CpuBinary(data, generated and tiles.SCRATCH_FN in source.text)

    def load(self, ordinal: int, binary: CpuBinary) -> SharedLibrary:
        module = SharedLibrary(binary.data, "kernels")  # the verified bytes, never a path
        if binary.takes_scratch:
            with contextlib.suppress(ValueError):
                ctypes.c_void_p.in_dll(module.lib, tiles.SCRATCH_FN).value = self.rt.scratch_address
            with contextlib.suppress(ValueError):
                ctypes.c_void_p.in_dll(module.lib, tiles.SCRATCH_TAG_FN).value = self.rt.scratch_tag_address
        return module

    def unload(self, ordinal: int, module: SharedLibrary) -> None:
        """dlclose: the runtime calls this once no routine and no queued launch uses it."""
        module.close()

    def prepare(
        self, ordinal: int, module: SharedLibrary, kernels: Sequence[tuple[KernelSpec, Sequence[tuple[int, int]]]]
    ) -> _Prepared:
        pairs = []
        keep = []
        for spec, args in kernels:
            fn = ctypes.cast(getattr(module.lib, spec.name), ctypes.c_void_p).value or 0
            bufs = self.rt.make_ptr_array([pool + off for pool, off in args])
            keep.append(bufs)
            # A user's kernel keeps to the worker's large stack; generated ones may run on a
            # waiting host thread (runtime.c, wait_done_host).
            team = TEAM_OPTIONAL if spec.plan.optional else TEAM_ADAPT
            pairs.append((fn, ctypes.addressof(bufs), team, spec.plan.kind == RAW, spec.plan.chunks))
        return _Prepared(self.rt.make_descs(pairs), len(pairs), tuple(keep))

    def launch(self, stream: int, prepared: _Prepared, statics: Sequence[int]) -> None:
        if statics:
            if len(statics) > MAX_STATICS:  # the runtime would drop the launch (runtime.c, pj_launch_seq)
                raise UnsupportedError(f"a launch with {len(statics)} static values: the CPU runtime passes "
                                       f"at most {MAX_STATICS} to a kernel")
            arr = (ctypes.c_int64 * len(statics))(*statics)
            self.rt.launch_seq(stream, prepared.descs, prepared.count, arr, len(statics))
        else:
            self.rt.launch_seq(stream, prepared.descs, prepared.count, None, 0)


def create_backend(num_devices: int | None = None) -> Backend:
    """A CPU backend; ``num_devices`` overrides ``POLYJIT_CPU_DEVICES``."""
    return Backend(CpuDriver(num_devices))
