"""ctypes wrapper of the native stream runtime (``runtime.c``).

A stream is an opaque C pointer (a Python ``int``) to an in-order queue with its
own worker thread. Enqueue calls return a ticket; an event is simply
``(stream, ticket)`` and is done iff ``done(stream) >= ticket``.

The library is loaded with :class:`ctypes.CDLL`, which releases the GIL for the
length of every call: kernels run on the worker while Python goes on, and a
host thread blocked in :meth:`NativeRuntime.sync` does not hold up others.

The hot-path entry points (``launch_seq``, ``sync``, ``done``, ...) are the
ctypes function objects themselves, bound as attributes: a Python method
around them would add a frame per kernel run.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from polyjit.backends.cpu.compiler import load_shared
from polyjit.core.compile_cache import SharedLibrary
from polyjit.core.errors import BackendUnavailableError, PoolExhaustedError
from polyjit.core.log import logger

__all__ = [
    "CONTENTION_MODES",
    "MAX_STATICS",
    "OMP_SPIN_COUNT",
    "RING_CAPACITY",
    "TEAM_ADAPT",
    "TEAM_NONE",
    "LaunchDesc",
    "NativeRuntime",
    "load_runtime",
]

MAX_STATICS = 16  # int64 statics copied per launch (PJ_MAX_STATICS in the C file)
RING_CAPACITY = 4096  # tasks in flight per stream before an enqueue blocks (PJ_RING)
SHARE_WINDOW = 2048  # tasks per timed window of the share tuner (PJ_SHARE_WINDOW)

RUNTIME_FLAGS: tuple[str, ...] = ("-O2", "-fPIC", "-shared", "-fopenmp", "-pthread", "-std=gnu11")

#: How long a waiting OpenMP thread spins (libgomp's ``GOMP_SPINCOUNT``, in pause
#: instructions) before it sleeps, unless the user set ``GOMP_SPINCOUNT`` or
#: ``OMP_WAIT_POLICY``. libgomp's default, 300000 (about 7 ms at 24 ns a pause), keeps a
#: thread that waits at a barrier or for the next kernel on its core: when other processes
#: take cores, the team's threads spend most of their time spinning while the thread they
#: wait for is descheduled. This bound (about 0.25 ms) still spans the gap between a step's
#: kernels, so a team stays awake within a step when the machine is ours.
OMP_SPIN_COUNT = 10000

_c_void_p = ctypes.c_void_p
_c_u64 = ctypes.c_uint64
_c_i64 = ctypes.c_int64


#: ``LaunchDesc.team``: the stream picks the kernel's team size by timing it (the default).
TEAM_ADAPT = 0
#: ``LaunchDesc.team``: the kernel opens no OpenMP team (nothing to pick or time).
TEAM_NONE = -1
#: ``LaunchDesc.team``: threads share the kernel's range only while the stream finds that
#: sharing such kernels pays (it times itself both ways: runtime.c, share_window); else one
#: call runs the whole range.
TEAM_OPTIONAL = -2


class LaunchDesc(ctypes.Structure):
    """``pj_launch_desc``: a kernel address, the address of its ``void*`` buffer array, its
    team (:data:`TEAM_ADAPT`, :data:`TEAM_NONE`, :data:`TEAM_OPTIONAL` or a fixed number of threads), whether only
    the stream's worker runs it, and its range: the kernel
    ``void k(void* const* bufs, const int64_t* statics, int64_t lo, int64_t hi)`` computes
    iterations [lo, hi) of ``[0, chunks)``, which the runtime shares among threads."""

    _fields_ = (("fn", ctypes.c_void_p), ("bufs", ctypes.c_void_p), ("team", ctypes.c_int64),
                ("worker_only", ctypes.c_int64), ("chunks", ctypes.c_int64))


class _ArrayInterface(ctypes.Structure):
    """numpy's ``PyArrayInterface`` (the capsule of ``__array_struct__``), up to its data."""

    _fields_ = (("two", ctypes.c_int), ("nd", ctypes.c_int), ("typekind", ctypes.c_char),
                ("itemsize", ctypes.c_int), ("flags", ctypes.c_int), ("shape", ctypes.c_void_p),
                ("strides", ctypes.c_void_p), ("data", ctypes.c_void_p))


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = (ctypes.py_object, ctypes.c_char_p)
_void_at = ctypes.c_void_p.from_address
_DATA_OFFSET = _ArrayInterface.data.offset


def _struct_address(array: Any) -> int:
    """The address of a numpy array's first element, through numpy's C array interface
    (``__array_struct__``): half the cost of ``array.ctypes.data``, which builds an object
    per call (2.6 against 1.5 us on the 2-vCPU EPYC VM of session 20). The capsule owns the
    struct: it is held until the address is read (dropped first, the struct was freed
    memory, which ``python -X dev`` fills with 0xdd)."""
    capsule = array.__array_struct__
    return _void_at(_capsule_pointer(capsule, None) + _DATA_OFFSET).value or 0


# numpy's array object holds its data pointer first, right after the object's header
# (PyArrayObject_fields.data, what PyArray_DATA reads), and CPython's id() is the object's
# address: reading it there costs a third of the capsule (0.4 against 1.6 us a call, session
# 23; a plan's step asks three times). Only on CPython (elsewhere an id is no address), only
# for exact ndarrays, and only where it reads what the capsule reads for views at import.
_OBJECT_HEADER = object.__basicsize__


def _reads_data_pointer() -> bool:
    if sys.implementation.name != "cpython":
        return False
    base = np.arange(12, dtype=np.float64).reshape(3, 4)
    probes = (base, base[1:, 2:], base.T, np.zeros(0, np.int8), base[::2].view(np.int32))
    return all(_void_at(id(a) + _OBJECT_HEADER).value == _struct_address(a) for a in probes)


_DIRECT: type | None = np.ndarray if _reads_data_pointer() else None


def host_address(array: Any) -> int:
    """The address of a numpy array's first element (the data pointer where this interpreter
    lays an exact ndarray out as CPython does, else through :func:`_struct_address`)."""
    if type(array) is _DIRECT:
        return _void_at(id(array) + _OBJECT_HEADER).value or 0
    return _struct_address(array)


def _source() -> str:
    return Path(__file__).with_name("runtime.c").read_text()


def _bind(lib: ctypes.CDLL, name: str, restype: Any, argtypes: Sequence[Any]) -> Any:
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


class NativeRuntime:
    """The loaded runtime library: typed entry points mirroring the C API.

    Pointers (streams, buffers) are plain ``int`` addresses. ``launch_seq``'s
    ``descs`` is an array from :meth:`make_descs` and ``statics`` a ``c_int64``
    array (or an address); both may be reused right after the call returns,
    because the statics are copied at enqueue time. The ``void*`` arrays the
    descriptors point at are read when the kernel runs: keep them alive and
    unchanged until then.
    """

    # Hot path: ctypes function objects, called directly.
    launch_seq: Callable[[int, Any, int, Any, int], int]
    #: ``launch_seq`` with no argument conversion, for the per-run hot path. Arguments:
    #: ``(stream_handle(stream), descs array, n, statics array, nstatics)``; a plain
    #: ``int`` where a pointer is expected would be truncated to 32 bits.
    launch_seq_raw: Callable[[ctypes.c_void_p, Any, int, Any, int], int]
    memcpy: Callable[[int, int, int, int], int]
    memcpy_in: Callable[[int, int, int, int], int]
    memset: Callable[[int, int, int, int], int]
    wait: Callable[[int, int, int], int]
    last_ticket: Callable[[int], int]
    done: Callable[[int], int]
    sync: Callable[[int, int], None]
    host_memcpy: Callable[[int, int, int], None]
    stamp: Callable[[int, Any], int]

    def __init__(self, library: SharedLibrary) -> None:
        self.library = library  # loaded from its verified bytes; kept (and never closed) for the process
        # Run at exit before the streams are destroyed: the drivers close their devices, so
        # that their Python streams are closed too (a use after exit raises, not segfaults).
        lib = library.lib
        self._lib = lib
        self._create = _bind(
            lib, "pj_stream_create", _c_void_p, [ctypes.c_int, _c_void_p, ctypes.c_int]
        )
        self._destroy = _bind(lib, "pj_stream_destroy", None, [_c_void_p])
        self._alloc = _bind(lib, "pj_alloc", _c_void_p, [ctypes.c_size_t, ctypes.c_size_t])
        self._free = _bind(lib, "pj_free", None, [_c_void_p])
        self._set_spin = _bind(lib, "pj_set_spin", None, [_c_i64] * 4)
        self._set_adaptive = _bind(lib, "pj_stream_set_adaptive", None, [_c_void_p, ctypes.c_int])
        self._team = _bind(lib, "pj_stream_team", ctypes.c_int, [_c_void_p, _c_void_p])
        self._sharing = _bind(lib, "pj_stream_sharing", ctypes.c_int, [_c_void_p])
        self._set_share_window = _bind(lib, "pj_set_share_window", None, [_c_i64])
        self._contended = _bind(lib, "pj_contended", ctypes.c_int, [])
        self._discard_queued = _bind(lib, "pj_discard_queued", None, [])
        self._set_contention = _bind(lib, "pj_set_contention", None, [ctypes.c_double, ctypes.c_double])
        self.launch_seq = _bind(
            lib,
            "pj_launch_seq",
            _c_u64,
            [_c_void_p, _c_void_p, ctypes.c_int, _c_void_p, ctypes.c_int],
        )
        # The same entry point without argtypes: ~0.3 us cheaper per call, but every
        # pointer must already be a ctypes object (see launch_seq_raw's docs).
        raw = lib["pj_launch_seq"]  # indexing makes a fresh function object
        raw.restype = _c_u64
        self.launch_seq_raw = raw
        self.memcpy = _bind(
            lib, "pj_memcpy", _c_u64, [_c_void_p, _c_void_p, _c_void_p, ctypes.c_size_t]
        )
        self.memcpy_in = _bind(
            lib, "pj_memcpy_in", _c_u64, [_c_void_p, _c_void_p, _c_void_p, ctypes.c_size_t]
        )
        self.memset = _bind(
            lib, "pj_memset", _c_u64, [_c_void_p, _c_void_p, ctypes.c_int, ctypes.c_size_t]
        )
        self.wait = _bind(lib, "pj_wait", _c_u64, [_c_void_p, _c_void_p, _c_u64])
        self.last_ticket = _bind(lib, "pj_last_ticket", _c_u64, [_c_void_p])
        self.done = _bind(lib, "pj_done", _c_u64, [_c_void_p])
        self.sync = _bind(lib, "pj_sync", None, [_c_void_p, _c_u64])
        self.stamp = _bind(lib, "pj_stamp", _c_u64, [_c_void_p, _c_void_p])
        self.host_memcpy = _bind(
            lib, "pj_host_memcpy", None, [_c_void_p, _c_void_p, ctypes.c_size_t]
        )
        #: The address of ``pj_scratch`` (kernels' per-thread scratch memory), which the
        #: driver gives every kernel module that asks for it (``pj_scratch_fn``).
        self.scratch_address = ctypes.cast(lib["pj_scratch"], ctypes.c_void_p).value or 0
        #: The address of ``pj_scratch_tag`` (what a thread's scratch memory holds), given the
        #: same way (``pj_scratch_tag_fn``): a matmul's grains reuse the panel packed there.
        self.scratch_tag_address = ctypes.cast(lib["pj_scratch_tag"], ctypes.c_void_p).value or 0
        self._live: set[int] = set()
        self._live_lock = threading.Lock()

    # -- streams ---------------------------------------------------------------------------

    def stream_create(self, num_threads: int, cpus: Sequence[int] | None = None) -> int:
        """A new stream whose kernels run OpenMP teams of ``num_threads`` (0: the default),
        its worker pinned to ``cpus`` when given."""
        cpu_list = list(cpus or ())
        arr = (ctypes.c_int * len(cpu_list))(*cpu_list) if cpu_list else None
        handle = self._create(int(num_threads), arr, len(cpu_list))
        if not handle:
            raise BackendUnavailableError(
                f"cannot start a CPU stream worker (num_threads={num_threads}, cpus={cpu_list})"
            )
        with self._live_lock:
            self._live.add(handle)
        return int(handle)

    def stream_destroy(self, stream: int) -> None:
        """Drain the stream, stop and join its worker, free it. Idempotent per handle."""
        with self._live_lock:
            if stream not in self._live:
                return
            self._live.discard(stream)
        self._destroy(stream)

    @staticmethod
    def stream_handle(stream: int) -> ctypes.c_void_p:
        """The stream as a ``c_void_p``, the form :attr:`launch_seq_raw` needs."""
        return ctypes.c_void_p(stream)

    def set_adaptive(self, stream: int, on: bool) -> None:
        """Whether the stream picks each kernel's team size, and whether to share its optional
        kernels (:data:`TEAM_OPTIONAL`), by timing them (the default), or always runs the full
        team and shares them."""
        self._set_adaptive(stream, int(on))

    def sharing(self, stream: int) -> bool:
        """Whether the stream shares its optional kernels now (else one thread runs each)."""
        return bool(self._sharing(stream))

    def set_share_window(self, tasks: int = SHARE_WINDOW) -> None:
        """The tasks a stream times per window when it decides whether to share optional
        kernels (process-wide; tests use short windows for their slow kernels)."""
        self._set_share_window(tasks)

    def team_of(self, stream: int, kernel: int) -> int:
        """The team size the stream runs the kernel at address ``kernel`` with now (0: not
        timed yet); read it while the stream is idle."""
        return int(self._team(stream, kernel))

    def contended(self) -> bool:
        """Whether the stream workers find the machine contended now: they wait for a core
        for a noticeable share of the time, so nobody spins (see runtime.c)."""
        return bool(self._contended())

    def set_contention(self, on: float, off: float) -> None:
        """The shares of time a stream worker spends waiting for a core above which the
        machine counts as contended (no spinning) and below which it no longer does;
        ``on > 1`` turns the sensing off."""
        self._set_contention(on, off)

    def live_streams(self) -> list[int]:
        with self._live_lock:
            return list(self._live)

    def is_done(self, stream: int, ticket: int) -> bool:
        """Whether the event ``(stream, ticket)`` has completed."""
        return bool(self.done(stream) >= ticket)

    def set_spin(
        self,
        worker_ns: int = -1,
        wait_ns: int = -1,
        worker_noyield_ns: int = -1,
        wait_noyield_ns: int = -1,
    ) -> None:
        """Process-wide spin policy, for tuning (negative: unchanged).

        An idle worker spins ``worker_ns`` before sleeping, a waiter ``wait_ns``;
        each spins without ``sched_yield`` for the first ``*_noyield_ns``.
        """
        self._set_spin(worker_ns, wait_ns, worker_noyield_ns, wait_noyield_ns)

    # -- memory ----------------------------------------------------------------------------

    def alloc(self, nbytes: int, alignment: int = 64) -> int:
        """Aligned host memory; 0 on failure (see :meth:`alloc_or_raise`)."""
        return int(self._alloc(nbytes, alignment) or 0)

    def alloc_or_raise(self, nbytes: int, alignment: int = 64) -> int:
        p = self.alloc(nbytes, alignment)
        if not p:
            raise PoolExhaustedError(
                f"cannot allocate {nbytes} bytes aligned to {alignment} on the host"
            )
        return p

    def free(self, ptr: int) -> None:
        if ptr:
            self._free(ptr)

    # -- descriptors -----------------------------------------------------------------------

    @staticmethod
    def make_descs(
        pairs: Sequence[tuple[int, ...]],
    ) -> ctypes.Array[LaunchDesc]:
        """A ``pj_launch_desc`` array from ``(kernel address, address of void* array)`` pairs,
        optionally followed by the team (:data:`TEAM_ADAPT` when left out), whether the
        kernel runs on the stream's worker only (its 64 MiB stack: users' own kernels; else a
        host thread that waits may run it, see runtime.c) and its range (1 when left out:
        one call with ``[0, 1)``)."""
        arr = (LaunchDesc * len(pairs))()
        for i, desc in enumerate(pairs):
            arr[i].fn = desc[0]
            arr[i].bufs = desc[1]
            arr[i].team = desc[2] if len(desc) > 2 else TEAM_ADAPT
            arr[i].worker_only = int(desc[3]) if len(desc) > 3 else 0
            arr[i].chunks = desc[4] if len(desc) > 4 else 1
        return arr

    @staticmethod
    def make_ptr_array(addresses: Sequence[int]) -> ctypes.Array[ctypes.c_void_p]:
        """A ``void*`` array (kernel buffer arguments); pass ``ctypes.addressof(arr)``."""
        return (ctypes.c_void_p * len(addresses))(*addresses)

    @staticmethod
    def make_statics(n: int = MAX_STATICS) -> ctypes.Array[ctypes.c_int64]:
        """A reusable ``int64`` statics array for :attr:`launch_seq`."""
        return (ctypes.c_int64 * n)()

    # -- shutdown --------------------------------------------------------------------------

    def forget_streams(self) -> None:
        """Drop every handle without touching it: a forked child has no worker threads. (On
        the child's only thread, with a fresh lock: a parent thread may have held the old.)"""
        self._live_lock = threading.Lock()
        self._live = set()

    def discard_queued(self) -> None:
        """From now on the workers drop the tasks they have not begun (at exit)."""
        self._discard_queued()

    def shutdown(self) -> None:
        """Sync and destroy every stream still alive (registered with atexit). The devices'
        exit hook, which runs first, gave queued work its second and dropped the rest
        (device._close_devices); dropped here too, for streams no device closed."""
        self._discard_queued()
        for stream in self.live_streams():
            self.sync(stream, self.last_ticket(stream))
            self.stream_destroy(stream)


_lock = threading.Lock()
_runtime: NativeRuntime | None = None


def _openmp_loaded() -> bool:
    """Whether libgomp is already in this process (it reads its settings once, when loaded)."""
    try:
        return "libgomp" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def _load_with_bounded_spin(load: Callable[[], SharedLibrary]) -> NativeRuntime:
    """Load the runtime (and with it libgomp) with :data:`OMP_SPIN_COUNT` in the environment
    libgomp reads at load time, then restore the environment: child processes keep theirs."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return NativeRuntime(load())
    if _openmp_loaded():
        logger.debug("libgomp was loaded before the CPU runtime: its spin count is left as is")
    os.environ["GOMP_SPINCOUNT"] = str(OMP_SPIN_COUNT)
    try:
        return NativeRuntime(load())
    finally:
        os.environ.pop("GOMP_SPINCOUNT", None)


#: ``POLYJIT_CPU_CONTENTION``: ``auto`` (the default: stream workers sense whether they wait
#: for a core), ``on`` (always behave as on a busy machine: nobody spins, a waiting thread runs
#: its stream's work) or ``off`` (always as alone: spin before sleeping).
#: Each mode's thresholds: the share of its runnable time a thread spends waiting for a core
#: above which the machine counts as contended, and below which it no longer does.
CONTENTION_MODES: dict[str, tuple[float, float]] = {"auto": (0.25, 0.12), "on": (-1.0, -1.0), "off": (2.0, 2.0)}


def _contention_mode() -> tuple[float, float]:
    """The thresholds ``POLYJIT_CPU_CONTENTION`` names (BackendUnavailableError for a bad value)."""
    mode = os.environ.get("POLYJIT_CPU_CONTENTION", "auto").strip().lower() or "auto"
    if mode not in CONTENTION_MODES:
        raise BackendUnavailableError(f"POLYJIT_CPU_CONTENTION must be one of {', '.join(CONTENTION_MODES)}, "
                                      f"not {mode!r}")
    return CONTENTION_MODES[mode]


def load_runtime() -> NativeRuntime:
    """The process-wide runtime, compiled (once per machine, cached on disk) and loaded."""
    global _runtime
    rt = _runtime
    if rt is not None:
        return rt
    with _lock:
        if _runtime is None:
            contention = _contention_mode()  # checked first: every try refuses a bad value
            rt = _load_with_bounded_spin(lambda: load_shared(_source(), "runtime", flags=RUNTIME_FLAGS))
            rt.set_contention(*contention)
            atexit.register(rt.shutdown)
            if hasattr(os, "register_at_fork"):
                # The parent's streams are dead in a child (no workers there): the exit
                # hook must not sync or join them.
                os.register_at_fork(after_in_child=rt.forget_streams)
            _runtime = rt  # only once whole: a failed load leaves nothing half made
        return _runtime
