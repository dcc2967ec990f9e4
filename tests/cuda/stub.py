"""The stub CUDA driver for tests: build it, run a process on it, give it host code.

- :func:`build_stub` compiles ``stub_libcuda.c`` with the system C compiler into a
  ``libcuda.so.1`` (cached by the hash of the source);
- :func:`stub_env` is the environment of a process that uses it: ``LD_LIBRARY_PATH``
  points at the build, so ``cuda.bindings`` (and ``cuda.core``) load it as the driver;
- the stub sees cubins, not CUDA source: :func:`register_image` builds the host code of
  the source an image came from (``host_code.py``) and files it as
  ``$PJSTUB_KERNELS/<sha256 of the image>.so``, where the stub looks when it loads the
  image; :func:`install_nvrtc_hook` does that for every image polyjit's NVRTC step
  (``polyjit.backends.cuda.nvrtc_compile``) returns;
- :func:`driver` is the stub itself (ctypes), for its test hooks: ``inject_fault``,
  ``set_schedule``, ``pending``, ``count``.

See README.md for what the stub models and how strictly.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import host_code

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "stub_libcuda.c"
C_FLAGS = ("-std=gnu11", "-Wall", "-Wextra", "-O2", "-fPIC", "-shared", "-pthread")

OTHERS_FIRST, TARGET_FIRST = 0, 1  # the schedules (pjstub_set_schedule)


def c_compiler() -> str | None:
    """The C compiler (``$CC``, else cc, else gcc), or None."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build_stub(directory: Path) -> Path:
    """The directory holding the built ``libcuda.so.1`` (built there unless already)."""
    cc = c_compiler()
    if cc is None:
        raise RuntimeError("no C compiler ($CC, cc or gcc) to build the stub driver")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(C_FLAGS).encode()).hexdigest()[:24]
    out = directory / f"libcuda-{key}"
    if (out / "libcuda.so.1").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        lib = Path(tmp) / "libcuda.so.1"
        proc = subprocess.run([cc, *C_FLAGS, "-o", str(lib), str(SOURCE), "-ldl"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building the stub driver failed:\n{proc.stderr[:6000]}")
        os.replace(lib, out / "libcuda.so.1")
    return out


def stub_env(stub_dir: Path, kernels_dir: Path, cache_dir: Path, **settings: str) -> dict[str, str]:
    """The environment of a process on the stub: ``settings`` are PJSTUB_* variables
    (``PJSTUB_DEVICES="2"``, ``PJSTUB_CC="8.6"``, ...)."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(stub_dir), env.get("LD_LIBRARY_PATH")) if p)
    env["PJSTUB_KERNELS"] = str(kernels_dir)
    env["PJSTUB_HOST_CACHE"] = str(cache_dir)
    env.pop("POLYJIT_CUDA_DISABLE", None)
    env.pop("POLYJIT_REQUIRE_BACKENDS", None)  # the parent checked them; a child needs only CUDA
    env.update(settings)
    return env


def image_key(image: bytes) -> str:
    """What the stub calls an image: the SHA-256 of the ELF file, or of PTX text up to its NUL."""
    if image[:4] != b"\x7fELF":
        image = image.split(b"\x00", 1)[0]
    return hashlib.sha256(image).hexdigest()


def kernels_dir() -> Path:
    return Path(os.environ["PJSTUB_KERNELS"])


def host_cache() -> Path:
    return Path(os.environ.get("PJSTUB_HOST_CACHE") or kernels_dir() / "cache")


def register_image(image: bytes, text: str) -> Path:
    """Files the host code of ``text`` (the CUDA source of ``image``) for the stub."""
    target = kernels_dir() / f"{image_key(image)}.so"
    if not target.exists():
        lib = host_code.build_library([text], host_cache())
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(lib, tmp)
        os.replace(tmp, target)
    return target


def install_nvrtc_hook() -> Callable[[], None]:
    """From now on, every image polyjit's NVRTC step (``polyjit.backends.cuda.nvrtc_compile``)
    returns gets its host code. Returns the function that takes the hook out again."""
    import importlib

    from polyjit.backends import cuda

    # Wrap the function where it is defined: that is the name the backend calls.
    home = importlib.import_module(cuda.nvrtc_compile.__module__)
    original: Callable[..., bytes] = home.nvrtc_compile
    if getattr(original, "pjstub_hook", False):
        return lambda: None

    @functools.wraps(original)
    def compile_and_register(text: str, *args: Any, **kwargs: Any) -> bytes:
        image = original(text, *args, **kwargs)
        register_image(image, text)
        return image

    compile_and_register.pjstub_hook = True  # type: ignore[attr-defined]
    home.nvrtc_compile = compile_and_register
    cuda.nvrtc_compile = compile_and_register  # type: ignore[attr-defined]

    def remove() -> None:
        home.nvrtc_compile = original
        cuda.nvrtc_compile = original  # type: ignore[attr-defined]

    return remove


@contextlib.contextmanager
def nvrtc_hook() -> Iterator[None]:
    """:func:`install_nvrtc_hook` for the duration of a ``with`` block."""
    remove = install_nvrtc_hook()
    try:
        yield
    finally:
        remove()


class Driver:
    """The stub library's test hooks (the process must run on the stub)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.pjstub_inject_fault.argtypes = [ctypes.c_int]
        self.lib.pjstub_set_schedule.argtypes = [ctypes.c_int]
        self.lib.pjstub_fail_launch.argtypes = [ctypes.c_int]
        self.lib.pjstub_pending.restype = ctypes.c_ulonglong
        self.lib.pjstub_count.argtypes = [ctypes.c_char_p]
        self.lib.pjstub_count.restype = ctypes.c_ulonglong

    def inject_fault(self, device: int) -> None:
        """The next kernel that runs on ``device`` faults (a sticky ILLEGAL_ADDRESS)."""
        if self.lib.pjstub_inject_fault(device):
            raise ValueError(f"no stub device {device} (or cuInit has not run)")

    def fail_launch(self, after: int) -> None:
        """After ``after`` more kernel launches succeed, the next fails with
        CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (at the call, not sticky)."""
        self.lib.pjstub_fail_launch(after)

    def set_schedule(self, schedule: int) -> int:
        """OTHERS_FIRST or TARGET_FIRST; returns the previous one."""
        return int(self.lib.pjstub_set_schedule(schedule))

    def pending(self) -> int:
        """Ops queued on all streams and not run yet."""
        return int(self.lib.pjstub_pending())

    def count(self, name: str) -> int:
        """``kernel_launches`` / ``graph_launches`` (successful calls) or ``kernels_run``."""
        return int(self.lib.pjstub_count(name.encode()))


@functools.cache
def driver() -> Driver:
    return Driver()
