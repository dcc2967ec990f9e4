"""The system C compiler: content-addressed shared libraries built with ``$CC`` (else ``cc``).

:class:`CCompiler` is the C compiler as a :class:`~polyjit.core.compile_cache.CachingCompiler`:
binaries are keyed by the source, the compiler's identity (path and version line), the
flags and the target (the host, for ``-march=native``), and kept in verified files, so a
second process that builds the same source loads the ``.so`` without compiling.
"""

from __future__ import annotations

import functools
import os
import platform
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from polyjit.core.cache import BinaryCache
from polyjit.core.compile_cache import CachingCompiler, SharedLibrary, Target
from polyjit.core.compiler import source_excerpt
from polyjit.core.errors import BackendUnavailableError, CompileError
from polyjit.core.log import logger

__all__ = [
    "CPU_FLAGS",
    "SHARED_CACHE",
    "CCompiler",
    "build_shared",
    "c_compiler",
    "compiler_identity",
    "default_flags",
    "load_shared",
]

# GCC 12 (Debian's 12.2) miscompiles some leaf kernels for AVX-512 hosts: it zeroes a local
# accumulator array placed in the red zone with an aligned 16-byte store at an address that
# is 8 mod 16, and the kernel segfaults every time it runs (a float16 matmul with 20
# columns did; the catalog keeps it: matmul.float16.53x38x20). Without a red zone the
# locals live in an allocated frame, which GCC aligns correctly; it costs one ``sub`` per call.
_NO_RED_ZONE: tuple[str, ...] = ("-mno-red-zone",) if platform.machine().lower() in ("x86_64", "amd64") else ()

CPU_FLAGS: tuple[str, ...] = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-std=gnu11",
    "-fno-math-errno",
    # Not -fno-trapping-math, though on AVX2 hosts it lets GCC vectorize the tanh and exp
    # helpers' selects (char_lm's step 25-35% faster on the VM of session 20): it also turns
    # (float)(int)x into trunc(x), which gives -0.0 for x in (-1, 0) and changes out-of-range
    # casts (session 20's review; docs/benchmarks.md).
    *_NO_RED_ZONE,
)

# Hosts with AVX512-FP16 (Intel Sapphire Rapids and later): ``-march=native`` lets GCC compute
# in _Float16 natively, and it then narrows a float32 op whose result is rounded to float16
# back into a float16 op and contracts a product and a sum into one float16 FMA, skipping the
# product's rounding (half.fused_chain.float16 read 4 ulps off). Kernels compute the half types
# in float32 and round after each op (core/codegen.py); this keeps GCC to that, with the
# conversions still in hardware (F16C). Older compilers do not know the flag, and need none.
_NO_NATIVE_HALF = "-mno-avx512fp16"


@functools.cache
def _accepts(cc: str, flag: str) -> bool:
    """Whether the compiler ``cc`` accepts ``flag`` (it compiles an empty unit with it)."""
    argv = _argv(cc)
    if not argv or shutil.which(argv[0]) is None:
        return False
    try:
        proc = subprocess.run([*argv, flag, "-x", "c", "-c", "-o", os.devnull, "-"], input="",
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return proc.returncode == 0


def default_flags() -> tuple[str, ...]:
    """The flags kernels are built with by the compiler ``$CC`` names now: :data:`CPU_FLAGS`,
    and on x86 ``-mno-avx512fp16`` where that compiler knows it."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return CPU_FLAGS + ((_NO_NATIVE_HALF,) if x86 and _accepts(c_compiler(), _NO_NATIVE_HALF) else ())


# Default cache for every shared library built here (kernels and the stream runtime).
SHARED_CACHE = BinaryCache("cpu", ".so")

_LOG_LIMIT = 4000  # characters of compiler log kept in a CompileError message


def c_compiler() -> str:
    """``$CC`` if set (it may carry arguments, e.g. ``"ccache gcc"``), else ``cc``."""
    return os.environ.get("CC") or "cc"


def _argv(cc: str) -> list[str]:
    return shlex.split(cc)


@functools.cache
def _identity(cc: str) -> str:
    argv = _argv(cc)
    path = shutil.which(argv[0]) if argv else None
    if path is None:
        return f"{cc} (not found)"
    # Resolve symlinks (cc -> gcc-12) so two spellings of one compiler share binaries.
    real = os.path.realpath(path)
    try:
        out = subprocess.run(
            [path, *argv[1:], "--version"], capture_output=True, text=True, timeout=60
        )
        first = (out.stdout or out.stderr).splitlines()[0] if (out.stdout or out.stderr) else ""
    except (OSError, subprocess.SubprocessError):
        first = "(version unknown)"
    return f"{first} @ {real} {shlex.join(argv[1:])}".rstrip()  # quoted: "-Da -Db" is not "-Da" "-Db"


def compiler_identity() -> str:
    """First line of ``<cc> --version`` plus the compiler's path; part of every cache key."""
    return _identity(c_compiler())


class CCompiler(CachingCompiler):
    """The system C compiler with fixed flags: shared libraries, cached by :class:`CachingCompiler`
    (source, compiler identity, flags, libraries and target: the host, for ``-march=native``)."""

    namespace = "cpu"
    suffix = ".so"

    def __init__(self, flags: Sequence[str] | None = None, extra_libs: Sequence[str] = ("-lm",),
                 cache: BinaryCache | None = None) -> None:
        super().__init__(SHARED_CACHE if cache is None else cache)
        self._flags = None if flags is None else tuple(flags)
        self.extra_libs = tuple(extra_libs)

    @property
    def flags(self) -> tuple[str, ...]:
        """The flags given, else those of the compiler ``$CC`` names now (:func:`default_flags`)."""
        return default_flags() if self._flags is None else self._flags

    def identity(self) -> tuple[str, ...]:
        # each flag a part of its own (the key hashes each part's length): ("-Da -Db",) and
        # ("-Da", "-Db") are different command lines and must not share a binary
        return (compiler_identity(), f"{len(self.flags)} flags", *self.flags, *self.extra_libs)

    def build(self, text: str, target: Target, out: Path) -> None:
        cc = c_compiler()
        argv = _argv(cc)
        if not argv or shutil.which(argv[0]) is None:
            raise BackendUnavailableError(f"no C compiler: {cc!r} not found (set $CC to a C compiler)")
        # The .c file sits next to the output so the log names a path inside the cache dir.
        src = out.with_suffix(".c")
        cmd = [*argv, *self.flags, "-o", str(out), str(src), *self.extra_libs]
        try:  # a write cut short (a full disk) leaves no part of the file either (found by review)
            src.write_text(text)
            logger.debug("compiling %s: %s", src, shlex.join(cmd))
            proc = subprocess.run(cmd, capture_output=True, text=True)
        finally:
            src.unlink(missing_ok=True)
        if proc.returncode != 0:
            log = (proc.stderr + proc.stdout).strip()
            shown = log if len(log) <= _LOG_LIMIT else log[:_LOG_LIMIT] + "\n... (log truncated)"
            message = (
                f"C compiler failed (exit {proc.returncode}): {shlex.join(cmd)}\n"
                f"{shown}\n"
                "generated source around the fault:\n"
                f"{source_excerpt(text, log)}"
            )
            raise CompileError(message, source=text, log=log)


def build_shared(
    source: str,
    *,
    flags: Sequence[str] | None = None,
    extra_libs: Sequence[str] = ("-lm",),
    cache: BinaryCache | None = None,
    target: Target = (),
) -> Path:
    """Compile ``source`` to a shared library and return its path (cached by content): for
    tools that need the file. Do not ``dlopen`` it: load :func:`load_shared` instead. A trim of
    the cache (over ``$POLYJIT_CACHE_MAX_BYTES``, by any process) may remove the file later:
    copy it to keep it.

    Raises :class:`CompileError` (with the compiler log and the numbered source
    lines it points at) when the compiler rejects the source.
    """
    return CCompiler(flags, extra_libs, cache).path(source, target)


def load_shared(
    source: str,
    name: str,
    *,
    flags: Sequence[str] | None = None,
    extra_libs: Sequence[str] = ("-lm",),
    target: Target = (),
) -> SharedLibrary:
    """Compile ``source`` to a shared library (cached by content) and load the bytes that were
    verified, not the file (``CachingCompiler.library``)."""
    return CCompiler(flags, extra_libs).library(source, target, name)
