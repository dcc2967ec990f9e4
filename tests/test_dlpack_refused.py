"""DLPack capsules polyjit makes, dropped without being consumed: refused by the consumer
(numpy has no bfloat16), dropped with no error pending, from several threads at once, and
where no C compiler builds the capsules' destructor."""

from __future__ import annotations

import ctypes
import gc
import os
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from forking import exit_code

from polyjit import get_backend
from polyjit.backends.cpu.compiler import c_compiler
from polyjit.core import dlpack
from polyjit.core.ir import Node

_get_destructor = ctypes.pythonapi.PyCapsule_GetDestructor
_get_destructor.restype, _get_destructor.argtypes = ctypes.c_void_p, (ctypes.py_object,)


def _has_c_compiler() -> bool:
    argv = shlex.split(c_compiler())
    return bool(argv) and shutil.which(argv[0]) is not None


@pytest.fixture
def unraisable(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What is reported as unraisable during the test (an error a destructor could not hand on)."""
    seen: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    return seen


def _context(n: int = 4) -> tuple[Any, Node, Node]:
    f, b = Node("f", (n,)), Node("b", (n,), "bfloat16")
    ctx = get_backend("cpu").get_device(0).make_context().init_from_host(f, np.arange(n, dtype=np.float32))
    return ctx.init_from_host(b, np.arange(n).astype(ml_dtypes.bfloat16)), f, b


def test_a_capsule_dropped_unconsumed_releases_what_it_holds(unraisable: list[Any]) -> None:
    ctx, f, _ = _context()
    gc.collect()
    live = len(dlpack._live)
    for versioned in (None, (1, 0)):
        capsule = ctx.export(f).__dlpack__(max_version=versioned)
        assert len(dlpack._live) == live + 1
        if _has_c_compiler():  # the C destructor, which hands a consumer's error back
            assert _get_destructor(capsule) == dlpack._load_destructor()
            assert dlpack._destructor_lib is not None
        del capsule
        assert len(dlpack._live) == live
    x = ctx.export(f)
    del x  # an Exported never asked for a capsule holds nothing in _live
    assert len(dlpack._live) == live and not unraisable
    ctx.finalize()


def test_exports_from_several_threads_release_everything(monkeypatch: pytest.MonkeyPatch,
                                                         unraisable: list[Any]) -> None:
    # the threads race to build and load the destructor on their first export
    monkeypatch.setattr(dlpack, "_destructor", None, raising=False)
    monkeypatch.setattr(dlpack, "_destructor_lib", None, raising=False)
    contexts = [_context(1 + k) for k in range(4)]
    gc.collect()
    live = len(dlpack._live)
    errors: list[BaseException] = []
    start = threading.Barrier(len(contexts))

    def work(k: int) -> None:
        ctx, f, b = contexts[k]
        try:
            start.wait()
            for i in range(200):
                match i % 4:
                    case 0:
                        assert np.from_dlpack(ctx.export(f)).tolist() == list(range(1 + k))
                    case 1:
                        ctx.export(f).__dlpack__()  # dropped unconsumed
                    case 2:
                        ctx.export(b).__dlpack__(max_version=(1, 0))
                    case _:
                        try:
                            np.from_dlpack(ctx.export(b))
                        except (RuntimeError, BufferError) as e:  # numpy's own refusal
                            assert "dtype" in str(e).lower(), e
                        else:
                            raise AssertionError("numpy took a bfloat16 capsule")
        except BaseException as e:  # handed to the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(contexts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    assert not errors, errors
    assert not unraisable, [(u.exc_type, u.exc_value) for u in unraisable]
    assert len(dlpack._live) == live
    if _has_c_compiler():
        assert dlpack._destructor_lib is not None
    for ctx, _, _ in contexts:
        ctx.finalize()


_NO_COMPILER = """
import logging, numpy as np, ml_dtypes
from polyjit.core import dlpack, dtypes
logging.basicConfig(level=logging.DEBUG, format="%(message)s")
class Producer:
    def __init__(self, values, dt):
        self.values, self.dt = values, dt
    def __dlpack_device__(self):
        return (dlpack.CPU, 0)
    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        v = self.values
        return dlpack.make_capsule(v.ctypes.data, v.shape, self.dt, (dlpack.CPU, 0), v, max_version is not None)
f = Producer(np.arange(3, dtype=np.float32), dtypes.float32)
assert np.from_dlpack(f).tolist() == [0.0, 1.0, 2.0]
f.__dlpack__()
b = Producer(np.arange(3).astype(ml_dtypes.bfloat16), dtypes.bfloat16)
try:
    np.from_dlpack(b)
except Exception as e:
    print("refused:", type(e).__name__)
assert dlpack._destructor_lib is None and not dlpack._live, dlpack._live
print("released")
"""


def test_without_a_c_compiler_capsules_still_release(tmp_path: Path) -> None:
    """The Python destructor stands in (numpy's refusal then arrives as a SystemError, and is
    reported as unraisable), said once in the debug log."""
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "POLYJIT_CACHE_DIR": str(tmp_path / "cache")}
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _NO_COMPILER], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "released" in proc.stdout and "refused:" in proc.stdout
    assert proc.stderr.count("DLPack capsules get the Python destructor") == 1, proc.stderr[-3000:]


_OWNER_HOLDS_A_CAPSULE = """
import numpy as np
from polyjit.core import dlpack, dtypes
v = np.arange(3, dtype=np.float32)
class Owner:
    def __init__(self, inner):
        self.inner = inner
inner = dlpack.make_capsule(v.ctypes.data, v.shape, dtypes.float32, (dlpack.CPU, 0), v, False)
outer = dlpack.make_capsule(v.ctypes.data, v.shape, dtypes.float32, (dlpack.CPU, 0), Owner(inner), False)
del inner
del outer  # frees the Owner, and with it the inner capsule: its release comes back to the deleter
assert not dlpack._live, dlpack._live
print("released")
"""


def test_a_release_that_frees_another_capsule_does_not_deadlock() -> None:
    """The deleter frees a capsule's entry after letting go of its lock (a subprocess: a
    deadlock would hang it, not the test run)."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run([sys.executable, "-c", _OWNER_HOLDS_A_CAPSULE], env=env, capture_output=True,
                              text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("releasing a capsule whose owner holds another capsule deadlocked")
    assert proc.returncode == 0 and "released" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_another_thread_held_the_locks_still_exports() -> None:
    """os.fork() copies only the calling thread: a child forked while another thread exported
    (holding the capsules' lock) or built the destructor waited for ever on its first export."""
    f = Node("fork_f", (3,))
    np.from_dlpack(_context_with(f).export(f))  # the destructor is built before the fork
    held = (dlpack._live_lock, dlpack._destructor_lock)
    for lock in held:
        lock.acquire()  # as another thread would, at the moment of the fork
    try:
        pid = os.fork()
        if pid == 0:  # the child (its own devices: the parent's refuse work there): export once
            code = 1
            try:
                code = 0 if np.from_dlpack(_context_with(f).export(f)).tolist() == [0, 1, 2] else 2
            finally:
                os._exit(code)
    finally:
        for lock in held:
            lock.release()
    assert exit_code(pid, "on a lock its parent's thread held") == 0


def _context_with(node: Node) -> Any:
    return get_backend("cpu").get_device(0).make_context().init_from_host(node, np.arange(3, dtype=np.float32))


class _Hostile:
    """A producer whose capsule says what it is told to (a corrupt or lying DLPack tensor)."""

    def __init__(self, data: int | None, ndim: int, shape: Any) -> None:
        t = dlpack.DLTensor(ctypes.c_void_p(data), dlpack.DLDevice(1, 0), ndim, dlpack.DLDataType(2, 32, 1),
                            shape, None, 0)
        self.managed = dlpack.DLManagedTensorVersioned(dlpack.DLPackVersion(1, 0), None, dlpack._DELETER(0), 0, t)
        self.shape = shape

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)

    def __dlpack__(self, stream: Any = None, max_version: Any = None, **kw: Any) -> Any:
        return ctypes.pythonapi.PyCapsule_New(ctypes.addressof(self.managed), b"dltensor_versioned", None)


@pytest.mark.parametrize("case", ["ndim beyond its shape", "negative ndim", "NULL shape", "NULL data"])
def test_a_corrupt_capsule_is_refused_before_it_is_read(case: str) -> None:
    """Found by review: ndim 1 << 20 over a shape of one element read past the shape (SIGSEGV),
    and a NULL data pointer with 16 elements was taken as memory at address 0."""
    from polyjit.core.errors import InvalidArgumentError, ShapeMismatchError

    values = np.ones(16, np.float32)
    shape = (ctypes.c_int64 * 1)(16)
    data, ndim, shape_ptr = {"ndim beyond its shape": (values.ctypes.data, 1 << 20, shape),
                             "negative ndim": (values.ctypes.data, -1, shape),
                             "NULL shape": (values.ctypes.data, 1, None),
                             "NULL data": (None, 1, shape)}[case]
    x = Node("x", (16,))
    ctx = get_backend("cpu").get_device(0).make_context()
    error = InvalidArgumentError if case == "NULL data" else ShapeMismatchError
    with pytest.raises(error, match="DLPack tensor"):
        ctx.init_from_dlpack(x, _Hostile(data, ndim, shape_ptr))
    np.testing.assert_array_equal(ctx.init_from_dlpack(x, values).read(x), values)  # still usable
