"""DLPack, both ways, with ctypes: capsules of node buffers for other libraries, and the
tensors other libraries hand over.

A capsule made here points at device or host memory polyjit owns; its deleter releases an
``owner`` object (which keeps the memory alive) when the consumer is done. A capsule taken
in is renamed ``used_dltensor`` (the protocol's "consumed" mark) and its producer's deleter
is called when the :class:`Imported` holding it is released.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from polyjit.core import dtypes
from polyjit.core.dtypes import DType
from polyjit.core.errors import DTypeMismatchError, InvalidArgumentError, ShapeMismatchError
from polyjit.core.log import logger

if TYPE_CHECKING:
    from polyjit.core.compile_cache import SharedLibrary

__all__ = ["CPU", "CUDA", "CUDA_HOST", "Imported", "make_capsule", "take_capsule"]

CPU, CUDA, CUDA_HOST = 1, 2, 3  # DLDeviceType
READ_ONLY = 1  # DLPACK_FLAG_BITMASK_READ_ONLY of DLManagedTensorVersioned.flags
_INT, _UINT, _FLOAT, _BOOL, _BFLOAT = 0, 1, 2, 6, 4  # DLDataTypeCode


class DLDevice(ctypes.Structure):
    _fields_ = (("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32))


class DLDataType(ctypes.Structure):
    _fields_ = (("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16))


class DLTensor(ctypes.Structure):
    _fields_ = (("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64))


class DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
DLManagedTensor._fields_ = (("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER))


class DLPackVersion(ctypes.Structure):
    _fields_ = (("major", ctypes.c_uint32), ("minor", ctypes.c_uint32))


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = (("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER),
                ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor))


_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = (ctypes.py_object, ctypes.c_char_p)
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = (ctypes.py_object, ctypes.c_char_p)
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = (ctypes.py_object, ctypes.c_char_p)

# What each capsule made here keeps alive (the struct, its shape array, the owner), by the
# struct's address; the deleter takes the entry out.
_live: dict[int, tuple[Any, ...]] = {}
_live_lock = threading.Lock()


@_DELETER
def _deleter(address: int | None) -> None:
    # The entry is freed after the lock is let go: freeing its owner may run finalizers
    # (and the garbage collector), which may drop another capsule and come back here.
    with _live_lock:
        entry = _live.pop(int(address or 0), None)
    del entry


_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
# The capsule API on a raw PyObject*: a destructor runs while the capsule is being freed, so
# it must not make a Python reference to it.
_raw_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(("PyCapsule_IsValid", _api))
_raw_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(("PyCapsule_GetPointer", _api))


# PyErr_Fetch with no argtypes: ctypes then takes byref() arguments as they are, where a
# prototype's from_param would run Python code (an isinstance check) that fails while an
# error is pending.
_err_fetch = _api._FuncPtr(("PyErr_Fetch", _api))
_err_fetch.restype = None
_err_restore = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(("PyErr_Restore", _api))
# Made in advance: while an error is pending, even making a ctypes object fails.
_SAVED = (ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p())
_SAVED_REFS = tuple(ctypes.byref(x) for x in _SAVED)


@_CAPSULE_DESTRUCTOR
def _capsule_destructor(capsule: int) -> None:
    """The fallback destructor, where no C compiler builds :data:`_DESTRUCTOR_SOURCE`: a
    capsule freed unconsumed (still named ``dltensor``) has its tensor released here.

    A consumer that refused the capsule (numpy has no bfloat16) drops it with its error
    set, and ctypes calls fail while one is: the error is set aside while the tensor is
    released, then put back. The consumer's error is lost all the same: a Python function
    that returns with an error set is a SystemError to CPython, which ctypes reports as
    unraisable, so the user sees a SystemError in place of the consumer's error."""
    _err_fetch(_SAVED_REFS[0], _SAVED_REFS[1], _SAVED_REFS[2])  # nothing may be made before this
    saved = tuple(x.value for x in _SAVED)
    try:
        for name in (b"dltensor", b"dltensor_versioned"):
            if _raw_is_valid(capsule, name):
                _deleter(_raw_pointer(capsule, name))
    finally:
        if saved[0]:
            _err_restore(*saved)


# The destructor in C, which can hand a consumer's pending error back (see the fallback
# above). The CPython functions it calls are handed over as pointers at load, with the
# release callback: the library has no undefined symbols, so it needs no Python headers, no
# flag that leaves symbols to the interpreter (macOS's -undefined dynamic_lookup), and loads
# whether this interpreter's libpython is shared or static.
_DESTRUCTOR_SOURCE = r"""
/* polyjit.core.dlpack: the destructor of the DLPack capsules polyjit makes. */
typedef struct _object PyObject;
typedef void (*pj_fetch_fn)(PyObject **, PyObject **, PyObject **);
typedef void (*pj_restore_fn)(PyObject *, PyObject *, PyObject *);
typedef int (*pj_is_valid_fn)(PyObject *, const char *);
typedef void *(*pj_pointer_fn)(PyObject *, const char *);
typedef void (*pj_release_fn)(void *);

static pj_fetch_fn pj_fetch;
static pj_restore_fn pj_restore;
static pj_is_valid_fn pj_is_valid;
static pj_pointer_fn pj_pointer;
static pj_release_fn pj_release;

void pj_dlpack_init(pj_fetch_fn fetch, pj_restore_fn restore, pj_is_valid_fn is_valid, pj_pointer_fn pointer,
                    pj_release_fn release) {
    pj_fetch = fetch;
    pj_restore = restore;
    pj_is_valid = is_valid;
    pj_pointer = pointer;
    pj_release = release;
}

/* A capsule still named "dltensor" (or "dltensor_versioned") was never consumed: release its
   tensor. A consumer that refused it may have its error set: set aside while the release
   (Python code) runs, and put back for the consumer to raise. */
void pj_dlpack_destructor(PyObject *capsule) {
    PyObject *type, *value, *traceback;
    pj_fetch(&type, &value, &traceback);
    if (pj_is_valid(capsule, "dltensor"))
        pj_release(pj_pointer(capsule, "dltensor"));
    else if (pj_is_valid(capsule, "dltensor_versioned"))
        pj_release(pj_pointer(capsule, "dltensor_versioned"));
    pj_restore(type, value, traceback);
}
"""
_DESTRUCTOR_FLAGS = ("-O2", "-fPIC", "-shared")
_destructor_lock = threading.Lock()
_destructor: int | None = None  # the address capsules are made with, once chosen
_destructor_lib: SharedLibrary | None = None  # the loaded library, kept for the process's life


def _load_destructor() -> int:
    """The C destructor, built (once per machine: the cpu backend's verified compile cache)
    and loaded on the first export of the process; where it cannot be, the Python one."""
    global _destructor, _destructor_lib
    chosen = _destructor
    if chosen is not None:
        return chosen
    with _destructor_lock:
        if _destructor is None:
            fallback = ctypes.cast(_capsule_destructor, ctypes.c_void_p).value
            assert fallback is not None
            try:
                # core reaches into the cpu backend for the system C compiler: CCompiler is the
                # one place that finds $CC, keys the build by the compiler's identity and verifies
                # the cached file before it is loaded; nothing is imported until the first export.
                from polyjit.backends.cpu.compiler import CCompiler

                library = CCompiler(_DESTRUCTOR_FLAGS, extra_libs=()).library(_DESTRUCTOR_SOURCE, (), "dlpack")
                lib = library.lib
                init = lib.pj_dlpack_init
                init.restype, init.argtypes = None, (ctypes.c_void_p,) * 5
                init(*(ctypes.cast(getattr(_api, name), ctypes.c_void_p)
                       for name in ("PyErr_Fetch", "PyErr_Restore", "PyCapsule_IsValid", "PyCapsule_GetPointer")),
                     ctypes.cast(_deleter, ctypes.c_void_p))
                address = ctypes.cast(lib.pj_dlpack_destructor, ctypes.c_void_p).value
                assert address is not None
                # the library calls _deleter's thunk: a reference never dropped keeps it for the
                # process's life, even while the module's globals are cleared at exit
                _api.Py_IncRef(ctypes.py_object(_deleter))
                _destructor_lib, _destructor = library, address
            except Exception as e:  # no compiler (the cpu backend unavailable), or it failed
                logger.debug("DLPack capsules get the Python destructor (a consumer that refuses one "
                             "raises SystemError in place of its own error): the C one was not built: %s", e)
                _destructor = fallback
        return _destructor


def _new_locks_in_child() -> None:
    """os.fork() copies only the calling thread: a lock another thread held at the fork (an
    export, the destructor's one-time build) would stay held in the child for ever."""
    global _live_lock, _destructor_lock
    _live_lock, _destructor_lock = threading.Lock(), threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_locks_in_child)


def _code(dt: DType) -> tuple[int, int]:
    if dt.is_bool:
        return _BOOL, 8
    if dt.name == "bfloat16":
        return _BFLOAT, 16
    kind = np.dtype(dt.np).kind
    return {"f": _FLOAT, "i": _INT, "u": _UINT}[kind], dt.itemsize * 8


def make_capsule(address: int, shape: Sequence[int], dt: DType, device: tuple[int, int], owner: Any,
                 versioned: bool, read_only: bool = False) -> Any:
    """A capsule of a C-contiguous tensor at ``address``; ``owner`` lives until the consumer
    calls the deleter (or the capsule is dropped unconsumed)."""
    code, bits = _code(dt)
    destructor = _load_destructor()
    dims = (ctypes.c_int64 * max(1, len(shape)))(*shape)
    tensor = DLTensor(ctypes.c_void_p(address or None), DLDevice(*device), len(shape), DLDataType(code, bits, 1),
                      dims, None, 0)
    managed: DLManagedTensor | DLManagedTensorVersioned
    if versioned:
        managed = DLManagedTensorVersioned(DLPackVersion(1, 0), None, _deleter, READ_ONLY if read_only else 0, tensor)
    elif read_only:  # a consumer of DLPack before 1.0 cannot be told, and would write
        raise BufferError("the buffer is read-only, which only a DLPack 1.0 consumer (max_version) can be told")
    else:
        managed = DLManagedTensor(tensor, None, _deleter)
    key = ctypes.addressof(managed)
    entry = (managed, dims, owner)  # made outside the lock: making it may run the garbage collector
    with _live_lock:
        _live[key] = entry
    name = b"dltensor_versioned" if versioned else b"dltensor"
    return _api.PyCapsule_New(key, name, destructor)


class Imported:
    """A tensor taken from another library: where it is and what it is. ``release()`` (or
    garbage collection) tells the producer it may free it."""

    def __init__(self, address: int, shape: tuple[int, ...], strides: tuple[int, ...] | None,
                 dt: DType, device: tuple[int, int], managed: int, deleter: Any, producer: Any,
                 read_only: bool = False) -> None:
        self.address, self.shape, self.strides, self.dtype = address, shape, strides, dt
        self.device = device
        self.read_only = read_only  # the producer's flag (DLPack 1.0): no write may reach it
        self._managed, self._deleter, self._producer = managed, deleter, producer

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def contiguous(self) -> bool:
        # no elements: contiguous whatever the strides (numpy exports (0, 0) for zeros((0, 3)),
        # and numpy and torch both call it contiguous)
        if self.strides is None or 0 in self.shape:
            return True
        expect, ok = 1, True
        for n, s in zip(reversed(self.shape), reversed(self.strides)):
            ok &= n == 1 or s == expect
            expect *= n
        return ok

    def release(self) -> None:
        managed, self._managed = self._managed, 0
        if managed and self._deleter:
            self._deleter(managed)

    def __del__(self) -> None:
        self.release()


def _dtype_of(code: int, bits: int, lanes: int) -> DType:
    if lanes != 1:
        raise DTypeMismatchError(f"a DLPack tensor of {lanes}-lane vectors cannot be taken")
    table = {(_FLOAT, 32): dtypes.float32, (_FLOAT, 64): dtypes.float64, (_INT, 32): dtypes.int32,
             (_INT, 64): dtypes.int64, (_UINT, 8): dtypes.uint8, (_BOOL, 8): dtypes.bool_}
    for name, key in (("float16", (_FLOAT, 16)), ("bfloat16", (_BFLOAT, 16))):
        if hasattr(dtypes, name):
            table[key] = getattr(dtypes, name)
    dt = table.get((code, bits))
    if dt is None:
        raise DTypeMismatchError(f"polyjit has no dtype for DLPack type code {code} with {bits} bits")
    return dt


# More dimensions than any producer makes (numpy's limit is 64): a larger ndim is corrupt.
MAX_NDIM = 64


def take_capsule(obj: Any, stream: int | None = None) -> Imported:
    """Consume ``obj.__dlpack__(...)`` (``stream``: the consumer's stream, for CUDA
    producers) and describe the tensor."""
    if not hasattr(obj, "__dlpack__"):
        raise InvalidArgumentError(f"{type(obj).__name__} has no __dlpack__: not a DLPack producer")
    try:
        try:
            capsule = obj.__dlpack__(stream=stream, max_version=(1, 0))
        except TypeError:  # an older producer: no max_version
            capsule = obj.__dlpack__(stream=stream) if stream is not None else obj.__dlpack__()
    except (BufferError, TypeError, ValueError) as e:  # the producer's refusal (a dtype DLPack lacks...)
        raise DTypeMismatchError(f"{type(obj).__name__} refused to export through DLPack: {e}") from e
    versioned = bool(_api.PyCapsule_IsValid(capsule, b"dltensor_versioned"))
    name = b"dltensor_versioned" if versioned else b"dltensor"
    if not _api.PyCapsule_IsValid(capsule, name):
        raise InvalidArgumentError("the DLPack capsule was already consumed or is not a tensor")
    address = _api.PyCapsule_GetPointer(capsule, name)
    managed: DLManagedTensor | DLManagedTensorVersioned
    if versioned:
        managed = DLManagedTensorVersioned.from_address(address)
        if managed.version.major > 1:
            raise InvalidArgumentError(f"DLPack {managed.version.major}.x is newer than polyjit reads")
    else:
        managed = DLManagedTensor.from_address(address)
    t = managed.dl_tensor
    # What a producer says is checked before it is read (found by review: ndim 1 << 20 over a
    # shape of one read past its end, SIGSEGV; a NULL data pointer was taken as memory)
    if not 0 <= t.ndim <= MAX_NDIM or (t.ndim and not t.shape):
        raise ShapeMismatchError(f"a DLPack tensor of {t.ndim} dimensions, its shape at "
                                 f"{'NULL' if not t.shape else 'an address'} (0..{MAX_NDIM} dimensions)")
    shape = tuple(int(t.shape[k]) for k in range(t.ndim))
    strides = tuple(int(t.strides[k]) for k in range(t.ndim)) if t.strides else None
    if any(n < 0 for n in shape):
        raise ShapeMismatchError(f"a DLPack tensor of shape {shape}")
    if not t.data and 0 not in shape:
        raise InvalidArgumentError(f"a DLPack tensor of shape {shape} whose data pointer is NULL")
    dt = _dtype_of(t.dtype.code, t.dtype.bits, t.dtype.lanes)
    _api.PyCapsule_SetName(capsule, b"used_dltensor_versioned" if versioned else b"used_dltensor")
    deleter = managed.deleter if managed.deleter else None
    read_only = versioned and bool(managed.flags & READ_ONLY)
    return Imported(int(t.data or 0) + int(t.byte_offset), shape, strides, dt,
                    (int(t.device.device_type), int(t.device.device_id)), address, deleter, obj, read_only)
