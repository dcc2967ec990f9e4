"""A complete polyjit backend in one file, proved by the conformance kit.

    python examples/custom_backend.py              # every check of polyjit.testing
    python examples/custom_backend.py -k merge     # the checks whose name contains "merge"

``SyncDriver`` implements the ``Driver`` protocol of ``polyjit/core/protocol.py``:
it compiles the C dialect's source with the system C compiler into a shared
library (kept in polyjit's verified compile cache), loads it with ctypes and runs kernels
synchronously in the calling thread. Memory is host memory; a stream is just a
counter, and an event is a marker of work that is already complete, so
``wait``/``sync`` have nothing to do. ``polyjit.core.runtime.Backend`` raises
the driver into the full backend: contexts, linking, per-node events, merge
buffers, device_to_device, users' own C functions (``Backend.raw_kernel``, bound
to the C dialect's calling convention by ``Dialect.raw_binding``).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from polyjit.core.codegen import Dialect, KernelSpec, Source
from polyjit.core.compile_cache import CachingCompiler, SharedLibrary, Target
from polyjit.core.errors import BackendUnavailableError, CompileError
from polyjit.core.protocol import DeviceInfo, Driver
from polyjit.core.runtime import Backend

FLAGS = ("-O2", "-fPIC", "-shared", "-std=gnu11")


class SyncCompiler(CachingCompiler):
    """The system C compiler ($CC, else cc). Only the uncached compile is ours: the base class
    keys, verifies, keeps and logs the binaries (docs/writing-a-backend.md, "The compile cache")."""

    namespace = "syncdriver"
    suffix = ".so"

    def __init__(self) -> None:
        super().__init__()
        self.cc = os.environ.get("CC", "cc")
        self._identity: tuple[str, ...] | None = None

    def identity(self) -> tuple[str, ...]:
        """The compiler's path and version, and the flags."""
        if self._identity is None:
            path = shutil.which(self.cc)
            if path is None:
                raise BackendUnavailableError(f"no C compiler {self.cc!r}")
            version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
            self._identity = (path, version.partition("\n")[0], *FLAGS)
        return self._identity

    def build(self, text: str, target: Target, out: Path) -> None:
        c_file = out.with_suffix(".c")
        c_file.write_text(text)
        try:
            proc = subprocess.run([self.cc, *FLAGS, "-o", str(out), str(c_file), "-lm"],
                                  capture_output=True, text=True)
        finally:
            c_file.unlink(missing_ok=True)
        if proc.returncode != 0:
            raise CompileError(f"{self.cc} failed:\n{proc.stderr}", source=text, log=proc.stderr)


class Pool:
    """One allocation: a numpy byte array and the aligned address inside it."""

    def __init__(self, nbytes: int, alignment: int) -> None:
        self.buffer = np.zeros(nbytes + alignment, np.uint8)
        base = self.buffer.ctypes.data
        self.address = (base + alignment - 1) // alignment * alignment


class Done:
    """An event: the work before it has already run (everything is synchronous)."""

    __slots__ = ()


DONE = Done()


class SyncDriver:
    """Kernels run in the calling thread, in order: every stream is trivially in order."""

    name = "sync"

    def __init__(self, devices: int = 1, memory_bytes: int = 2 << 30) -> None:
        self.dialect = Dialect()  # plain C: no tiling, OpenMP pragmas ignored (no -fopenmp)
        self.devices = devices
        self.memory_bytes = memory_bytes
        self._streams = 0
        self.compiler = SyncCompiler()

    # devices
    def device_count(self) -> int:
        return self.devices

    def device_info(self, ordinal: int) -> DeviceInfo:
        return DeviceInfo(name=f"synchronous host device {ordinal}", memory_bytes=self.memory_bytes,
                          compute_units=1, base_alignment=64, properties={"synchronous": True})

    # memory
    def alloc(self, ordinal: int, nbytes: int, alignment: int) -> Pool:
        try:
            return Pool(nbytes, max(alignment, 64))
        except (MemoryError, ValueError) as e:
            raise MemoryError(f"cannot allocate {nbytes} bytes: {e}") from e

    def free(self, ordinal: int, pool: Pool) -> None:
        pool.buffer = np.zeros(0, np.uint8)  # drop the memory now, not when the handle dies

    # streams and events: nothing is ever pending
    def new_stream(self, ordinal: int) -> int:
        self._streams += 1
        return self._streams

    def record(self, stream: int) -> Done:
        return DONE

    def wait(self, stream: int, event: Done) -> None:
        pass

    def event_done(self, event: Done) -> bool:
        return True

    def event_sync(self, event: Done) -> None:
        pass

    # transfers
    def memset_zero(self, stream: int, pool: Pool, offset: int, nbytes: int) -> None:
        ctypes.memset(pool.address + offset, 0, nbytes)

    def copy_from_host(self, stream: int, pool: Pool, offset: int, array: np.ndarray) -> None:
        src = np.ascontiguousarray(array)
        ctypes.memmove(pool.address + offset, src.ctypes.data, src.nbytes)

    def copy_to_host(self, stream: int, pool: Pool, offset: int, array: np.ndarray) -> None:
        ctypes.memmove(array.ctypes.data, pool.address + offset, array.nbytes)

    def copy_device(self, stream: int, dst: tuple[int, Pool, int], src: tuple[int, Pool, int], nbytes: int) -> None:
        ctypes.memmove(dst[1].address + dst[2], src[1].address + src[2], nbytes)

    # code
    def compile(self, source: Source) -> bytes:
        """The C compiler, through polyjit's verified, content-addressed compile cache: the
        binary's verified bytes (never its file's path, which could change before a load)."""
        return self.compiler.data(source.text)

    def load(self, ordinal: int, binary: bytes) -> SharedLibrary:
        return SharedLibrary(binary, "sync")  # dlopen of those very bytes (a sealed memfd)

    def unload(self, ordinal: int, module: SharedLibrary) -> None:
        module.close()

    def prepare(self, ordinal: int, module: SharedLibrary,
                kernels: Sequence[tuple[KernelSpec, Sequence[tuple[Pool, int]]]]) -> list[tuple[Any, Any]]:
        prepared = []
        for spec, args in kernels:
            fn = getattr(module.lib, spec.name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            fn.restype = None
            pointers = (ctypes.c_void_p * max(len(args), 1))(*[pool.address + off for pool, off in args])
            prepared.append((fn, pointers))
        return prepared

    def launch(self, stream: int, prepared: list[tuple[Any, Any]], statics: Sequence[int]) -> None:
        values = (ctypes.c_int64 * max(len(statics), 1))(*statics)
        for fn, pointers in prepared:
            fn(pointers, values)


def main(argv: list[str] | None = None) -> int:
    from polyjit.testing import CHECKS, CheckSkipped, run_check
    from polyjit.testing.suite import check_name

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-k", dest="select", default="", help="run only checks whose name contains this")
    args = p.parse_args(argv)
    driver = SyncDriver()
    assert isinstance(driver, Driver)  # the protocol is runtime-checkable
    backend, two = Backend(driver), Backend(SyncDriver(devices=2))
    checks = [c for c in CHECKS if args.select in check_name(c)]
    print(f"conformance kit on the '{driver.name}' backend: {len(checks)} checks")
    failed = skipped = 0
    for check in checks:
        t0 = time.perf_counter()
        try:
            run_check(check, backend, two)
            status = "pass"
        except CheckSkipped as e:
            skipped += 1
            status = f"skip ({e})"
        except Exception as e:
            failed += 1
            status = f"FAIL {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"  {check_name(check):40s} {time.perf_counter() - t0:6.2f}s  {status}")
    print(f"{len(checks) - failed - skipped} passed, {skipped} skipped, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
