"""NVRTC: CUDA C -> CUBIN (or PTX), cached by content through ``core/compile_cache.py``.

Raw ``cuda.bindings.nvrtc``, not ``cuda.core.Program``: cuda.core's Program loads the driver
library, and polyjit compiles (and its tests check) CUDA code on machines without one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polyjit.core.cache import BinaryCache
from polyjit.core.codegen import Source
from polyjit.core.compile_cache import CachingCompiler, Target
from polyjit.core.compiler import source_excerpt
from polyjit.core.errors import (
    BackendUnavailableError,
    CompileError,
    PolyjitError,
    UnsupportedError,
)

__all__ = [
    "CACHE",
    "COMPILER",
    "DEFAULT_ARCH",
    "NVRTC_OPTIONS",
    "CudaBinary",
    "NvrtcCompiler",
    "arch_number",
    "nvrtc_compile",
    "nvrtc_log",
    "nvrtc_supported_archs",
    "nvrtc_version",
]

DEFAULT_ARCH = "sm_90"  # what compile() targets when no device is present
NVRTC_OPTIONS: tuple[str, ...] = ("-lineinfo", "--std=c++17")
FAST_MATH_OPTIONS: tuple[str, ...] = ("--use_fast_math",)
_LOG_LIMIT = 6000  # characters of NVRTC log kept in a CompileError message

CACHE = BinaryCache("cuda", ".img")  # CUBINs and PTX, keyed by everything that shapes them
_lock = threading.Lock()
_nvrtc_mod: Any = None
_info: dict[str, Any] = {}


def _nvrtc() -> Any:
    global _nvrtc_mod
    if _nvrtc_mod is None:
        with _lock:
            if _nvrtc_mod is None:
                try:
                    from cuda.bindings import nvrtc
                except ImportError as e:
                    raise BackendUnavailableError(
                        f"NVRTC is not available: cuda-bindings cannot be imported ({e}); install polyjit[cuda]"
                    ) from e
                _nvrtc_mod = nvrtc
    return _nvrtc_mod


def _ok(result: Any, what: str) -> Any:
    """The value(s) of a ``(err, *values)`` result tuple."""
    if result[0]:
        raise CompileError(f"NVRTC {what} failed: {result[0]}")
    return None if len(result) == 1 else result[1] if len(result) == 2 else result[1:]


def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor)."""
    if "version" not in _info:
        try:
            major, minor = _ok(_nvrtc().nvrtcVersion(), "nvrtcVersion")
        except PolyjitError:
            raise
        except Exception as e:  # the library itself is missing
            raise BackendUnavailableError(f"NVRTC is not available: {type(e).__name__}: {e}") from e
        _info["version"] = (int(major), int(minor))
    version: tuple[int, int] = _info["version"]
    return version


def nvrtc_supported_archs() -> tuple[int, ...]:
    """The SM versions NVRTC compiles for (e.g. 75, 80, ..., 120)."""
    if "archs" not in _info:
        nvrtc_version()
        _info["archs"] = tuple(int(a) for a in _ok(_nvrtc().nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs"))
    archs: tuple[int, ...] = _info["archs"]
    return archs


def arch_number(arch: str) -> int:
    """``sm_90`` / ``compute_90`` / ``90`` -> 90."""
    digits = "".join(ch for ch in str(arch).split("_", 1)[-1] if ch.isdigit())
    if not digits:
        raise UnsupportedError(f"not a CUDA arch: {arch!r}")
    return int(digits)


class NvrtcCompiler(CachingCompiler):
    """NVRTC as a :class:`~polyjit.core.compile_cache.CachingCompiler`: an image per (source,
    target), the target being the kind, the arch, the file name and the options."""

    namespace = "cuda"
    suffix = ".img"

    def identity(self) -> tuple[str, ...]:
        major, minor = nvrtc_version()
        return (f"nvrtc {major}.{minor}",)

    def build(self, text: str, target: Target, out: Path) -> None:
        kind, arch, name, *options = target
        out.write_bytes(_run(text, (f"--gpu-architecture={arch}", *options), kind, name)[0])


COMPILER = NvrtcCompiler(CACHE)


def nvrtc_compile(text: str, arch: str = DEFAULT_ARCH, *, kind: str = "cubin",
                  options: Sequence[str] = NVRTC_OPTIONS, name: str = "polyjit.cu") -> bytes:
    """CUDA C -> CUBIN (``kind="cubin"``, ``arch="sm_XY"``) or PTX (``kind="ptx"``; an
    ``sm_XY`` arch becomes ``compute_XY``), cached on disk and in memory by (source, options,
    arch, NVRTC version). Raises CompileError with the log and the numbered source lines."""
    if kind not in ("cubin", "ptx"):
        raise ValueError(f"kind must be 'cubin' or 'ptx', not {kind!r}")
    number = arch_number(arch)
    target = f"sm_{number}" if kind == "cubin" else f"compute_{number}"
    return COMPILER.data(text, (kind, target, name, *options))


def nvrtc_log(text: str, arch: str = DEFAULT_ARCH, *, options: Sequence[str] = NVRTC_OPTIONS,
              name: str = "polyjit.cu") -> str:
    """Compile to a CUBIN without the cache and return NVRTC's log: empty when the source
    compiles without a warning. Raises CompileError on errors."""
    return _run(text, (f"--gpu-architecture=sm_{arch_number(arch)}", *options), "cubin", name)[1]


def _run(text: str, opts: Sequence[str], kind: str, name: str) -> tuple[bytes, str]:
    """(the CUBIN or the NUL-terminated PTX, the log)."""
    nv = _nvrtc()
    prog = _ok(nv.nvrtcCreateProgram(text.encode(), name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        encoded = [o.encode() for o in opts]
        (err,) = nv.nvrtcCompileProgram(prog, len(encoded), encoded)
        log = _log(nv, prog)
        if err:
            shown = log if len(log) <= _LOG_LIMIT else log[:_LOG_LIMIT] + "\n... (log truncated)"
            major, minor = nvrtc_version()
            raise CompileError(
                f"NVRTC {major}.{minor} failed to compile {name} ({getattr(err, 'name', err)}) with "
                f"{' '.join(opts)}:\n{shown}\ngenerated source around the fault:\n{source_excerpt(text, log)}",
                source=text, log=log)
        size_fn, get_fn = ((nv.nvrtcGetCUBINSize, nv.nvrtcGetCUBIN) if kind == "cubin"
                           else (nv.nvrtcGetPTXSize, nv.nvrtcGetPTX))
        buf = _buffer(_ok(size_fn(prog), size_fn.__name__))
        _ok(get_fn(prog, buf), get_fn.__name__)
        return bytes(buf), log
    finally:
        nv.nvrtcDestroyProgram(prog)


def _buffer(size: int) -> bytearray:
    """A fresh, writable buffer for NVRTC to fill. Never ``b" " * size``: NVRTC writes into
    the object it is given, and ``b" " * 1`` (an empty log is one NUL) is the interpreter's
    one shared ``b" "``; filling it would change ``b" "`` in the whole process."""
    return bytearray(max(0, int(size)))


def _log(nv: Any, prog: Any) -> str:
    try:
        buf = _buffer(_ok(nv.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize"))
        _ok(nv.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
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
        number = arch_number(arch)
        supported = nvrtc_supported_archs()
        if number in supported:
            out = ("cubin", self.cubin(f"sm_{number}"))
        else:
            older = [a for a in supported if a <= number]
            if not older:
                raise UnsupportedError(
                    f"NVRTC {nvrtc_version()} cannot compile for {arch} (it supports sm_{min(supported)} and newer)")
            out = ("ptx", self.ptx(f"compute_{max(older)}"))
        with self._lock:
            self._images[arch] = out
        return out
