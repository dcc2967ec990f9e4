"""Host builds of CUDA C kernels, for tests without a GPU.

A CUDA source (polyjit's generated code, or a test's own kernels) is compiled by the
C++ compiler against ``host_shim.h`` into a shared library that exports, per kernel,

    extern "C" void pjhost_<kernel>(void** params, const unsigned* launch)

``params`` is the kernel's argument array as ``cuLaunchKernel`` takes it and ``launch``
is ``(gx, gy, gz, bx, by, bz, shared_bytes)``. The stub driver (``stub_libcuda.c``) runs
these when a launch of the kernel runs; :func:`call_kernel` runs one directly.

Libraries are cached by the hash of what is compiled, so a source is built once.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIM = HERE / "host_shim.h"
CXX_FLAGS = ("-std=c++17", "-O1", "-fno-strict-aliasing", "-shared", "-fPIC", "-w")

# extern "C" __global__ void [__launch_bounds__(...)] name(
_KERNEL = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)\s*)?(\w+)\s*\('
)


def compiler() -> str | None:
    """The C++ compiler (``$CXX``, else g++), or None when there is none."""
    name = os.environ.get("CXX") or "g++"
    return shutil.which(name)


def kernels(text: str) -> list[tuple[str, bool]]:
    """The ``extern "C" __global__`` kernels of a source, each with whether it needs
    barriers (``__syncthreads`` in its body, or anywhere outside the kernels)."""
    found = list(_KERNEL.finditer(text))
    if not found:
        return []
    preamble = "__syncthreads" in text[: found[0].start()]
    out = []
    for k, m in enumerate(found):
        end = found[k + 1].start() if k + 1 < len(found) else len(text)
        out.append((m.group(1), preamble or "__syncthreads" in text[m.start() : end]))
    return out


def library_source(texts: Sequence[str]) -> str:
    """The C++ of one host library: the shim, each source in a namespace, the thunks."""
    parts = [f'#include "{SHIM.name}"']
    for k, text in enumerate(texts):
        parts.append(f"namespace pj_src{k} {{\n{text}\n}}  // namespace pj_src{k}")
        for name, barriers in kernels(text):
            parts.append(f"PJ_THUNK(pj_src{k}, {name}, {'true' if barriers else 'false'})")
    return "\n".join(parts) + "\n"


def _shim_digest() -> str:
    return hashlib.sha256(SHIM.read_bytes()).hexdigest()


def build_library(texts: Sequence[str], directory: Path) -> Path:
    """The host library of the sources, built into ``directory`` unless already there."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler ($CXX or g++) for the host builds of CUDA kernels")
    code = library_source(texts)
    key = hashlib.sha256((code + _shim_digest() + " ".join(CXX_FLAGS)).encode()).hexdigest()[:32]
    out = directory / f"host_{key}.so"
    if out.exists():
        return out
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        src = Path(tmp) / "kernels.cpp"
        src.write_text(code)
        lib = Path(tmp) / "kernels.so"
        proc = subprocess.run([cxx, *CXX_FLAGS, f"-I{HERE}", "-o", str(lib), str(src)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"the host build of CUDA kernels failed:\n{proc.stderr[:6000]}")
        os.replace(lib, out)  # atomic: concurrent builders agree
    return out


def call_kernel(lib: ctypes.CDLL, name: str, args: Sequence[ctypes._SimpleCData],
                grid: tuple[int, int, int], block: tuple[int, int, int], shared: int = 0) -> None:
    """Run one kernel of a host library, arguments as ctypes values (c_void_p for pointers)."""
    params = (ctypes.c_void_p * max(1, len(args)))(*[ctypes.addressof(a) for a in args])
    launch = (ctypes.c_uint * 7)(*grid, *block, shared)
    getattr(lib, f"pjhost_{name}")(params, launch)
