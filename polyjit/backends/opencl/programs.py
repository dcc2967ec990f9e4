"""OpenCL programs: built per device group through the one compile cache, pyopencl's public API.

A compiled batch (:class:`ClBinary`) holds its source and, per device group (the devices
of one platform built with the same options), its built program. Where the disk cache is
on (every device but CPU devices, unless ``binary_cache`` says otherwise), a group's
binaries are one entry of :class:`OpenCLCompiler`, a
:class:`~polyjit.core.compile_cache.CachingCompiler`: keyed by the platform, its devices and
driver versions, the options and the source, verified before they are loaded. On CPU
devices PoCL caches its own builds, and asking it for binaries compiles every kernel to
native code first (12 s for 140 kernels, against 0.5 s for the build itself), so there
programs are built in memory only.
"""

from __future__ import annotations

import collections
import struct
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from polyjit.backends.opencl.platforms import ClDevice, build_log, cl, cl_name
from polyjit.core.compile_cache import CachingCompiler, Target
from polyjit.core.compiler import source_excerpt
from polyjit.core.errors import CompileError

__all__ = ["RECENT_PROGRAMS", "ClBinary", "OpenCLCompiler"]

RECENT_PROGRAMS = 16  # dropped batches whose programs are kept for a compile of the same source


@attrs.frozen(eq=False)
class ClBinary:
    """A compiled batch: the source and its built program per device group, which live as long
    as the batch (its CodeBatch, or a routine's loaded module) does."""

    text: str
    fp64: bool
    names: tuple[str, ...]  # the kernels of the compile that made it (a user's text may define more)
    options: str = ""  # besides the device group's (users' kernels: -cl-kernel-arg-info)
    programs: dict[int, Any] = attrs.field(factory=dict)


class OpenCLCompiler(CachingCompiler):
    """Builds a batch's program for a device group; group binaries cached on disk where
    ``on_disk(devices)`` says so."""

    namespace = "opencl"
    suffix = ".bin"

    def __init__(self, on_disk: Callable[[Sequence[ClDevice]], bool]) -> None:
        super().__init__()
        self._on_disk = on_disk
        self._groups: dict[Target, list[ClDevice]] = {}
        self._fresh: dict[str, Any] = {}  # key -> the program build() made just now
        self._build_lock = threading.RLock()
        # Live batches by content: compiling the same source again reuses their programs; the
        # most recent few stay even when dropped (a bounded set: programs are megabytes each).
        self._live: weakref.WeakValueDictionary[str, ClBinary] = weakref.WeakValueDictionary()
        self._recent: collections.OrderedDict[str, ClBinary] = collections.OrderedDict()

    def identity(self) -> tuple[str, ...]:
        return ("opencl-group-binaries-v2", str(getattr(cl, "VERSION_TEXT", "")))

    def target(self, devs: Sequence[ClDevice], options: str) -> Target:
        """What a group's binaries depend on besides the source: platform, devices, drivers,
        options."""
        d0 = devs[0]
        target = (cl_name(d0.platform.name), cl_name(d0.platform.version), d0.options, options,
                  *(f"{d.info.name} / {cl_name(d.device.driver_version)}" for d in devs))
        self._groups[target] = list(devs)
        return target

    def build(self, text: str, target: Target, out: Path) -> None:
        devs = self._groups[target]
        program = build_source(text, devs, target[3])
        out.write_bytes(_pack([_binary_for(program, d, devs) for d in devs]))
        self._fresh[self.key(text, target)] = program  # no need to load what was just built

    def binary(self, text: str, names: tuple[str, ...], options: str = "") -> ClBinary:
        """The batch of this source: a live (or recent) one, else a new one. (A user's kernels
        from one text share it: :meth:`program` checks each one's name.)"""
        key = self.key(text, (options,))
        with self._build_lock:
            hit = self._live.get(key)
            if hit is None:
                hit = self._live[key] = ClBinary(text, "cl_khr_fp64 : enable" in text, names, options)
            self._recent[key] = hit
            self._recent.move_to_end(key)
            while len(self._recent) > RECENT_PROGRAMS:
                self._recent.popitem(last=False)
        return hit

    def program(self, binary: ClBinary, group: int, devs: Sequence[ClDevice],
                names: tuple[str, ...] = ()) -> Any:
        """The batch's program for one device group: already built, from the disk cache, or
        built now. ``names``: kernels the caller needs, checked even when the program was built
        for another compile of the same text (a user's kernel it does not define is a
        CompileError here, not a failure at link)."""
        hit = binary.programs.get(group)
        if hit is None:
            hit = self._built(binary, group, devs, names)
        elif names:  # this compile's own kernels: the text's first compile may have named others
            _check_kernels(hit, binary, devs, names)
        return hit

    def _built(self, binary: ClBinary, group: int, devs: Sequence[ClDevice], names: tuple[str, ...]) -> Any:
        """Build (or load) the program and check it has the caller's kernels (default: the
        batch's) before keeping it: a user's compile that named a kernel its text lacks must
        not leave a check of that name behind for the next compile of the same text."""
        with self._build_lock:
            hit = binary.programs.get(group)
            if hit is not None:
                return hit
            if self._on_disk(devs):
                program = self._from_disk(binary, devs)
            else:
                what = f"{len(binary.names)} kernels for {devs[0].info.name}"
                program = self.built_in_memory(what, lambda: build_source(binary.text, devs, binary.options))
            _check_kernels(program, binary, devs, names)
            binary.programs[group] = program
            return program

    def _from_disk(self, binary: ClBinary, devs: Sequence[ClDevice]) -> Any:
        text, target = binary.text, self.target(devs, binary.options)
        data = self.data(text, target)
        program = self._fresh.pop(self.key(text, target), None)
        if program is not None:
            return program
        try:
            program = cl.Program(devs[0].context, [d.device for d in devs], _unpack(data, len(devs)))
            _build(program, devs, binary.options)
            return program
        except (cl.Error, ValueError):
            # A binary the driver refuses (another driver version, say): build from source
            # and replace the entry.
            program = build_source(text, devs, binary.options)
            self.publish(text, target, _pack([_binary_for(program, d, devs) for d in devs]))
            return program


def build_source(text: str, devs: Sequence[ClDevice], options: str = "") -> Any:
    """A program built from source for a device group (CompileError with the log)."""
    program = cl.Program(devs[0].context, text)
    try:
        _build(program, devs, options)
    except cl.Error as e:
        raise _compile_error(program, text, devs, e) from None
    return program


def _build(program: Any, devs: Sequence[ClDevice], options: str = "") -> None:
    with warnings.catch_warnings():
        # Warnings about generated code (an always-true comparison of a bool) are noise here.
        warnings.simplefilter("ignore", cl.CompilerWarning)
        # cache_dir=False: pyopencl's own disk cache stays out of it (this one is ours).
        program.build(options=" ".join(o for o in (devs[0].options, options) if o) or None,
                      devices=[d.device for d in devs], cache_dir=False)


def _pack(blobs: Sequence[bytes]) -> bytes:
    """One cache entry for a group: each device's binary, length-prefixed."""
    return b"".join(struct.pack("<Q", len(b)) + b for b in blobs)


def _unpack(data: bytes, count: int) -> list[bytes]:
    """The device binaries of a group's entry; ValueError (the caller rebuilds) for an entry
    that is not ``count`` length-prefixed binaries, however it is cut."""
    out, at = [], 0
    while at < len(data):
        if at + 8 > len(data):  # a length cut short: struct.error, which no caller rebuilt on
            raise ValueError("a cached OpenCL entry cut short inside a length")
        (n,) = struct.unpack_from("<Q", data, at)
        out.append(data[at + 8 : at + 8 + n])
        at += 8 + n
    if len(out) != count or at != len(data) or not all(out):
        raise ValueError("a cached OpenCL entry that does not hold one binary per device")
    return out


def _check_kernels(program: Any, binary: ClBinary, devs: Sequence[ClDevice], names: Sequence[str] = ()) -> None:
    """A build can succeed yet drop kernels (PoCL does, after some ABI warnings), and a user's
    source may not define the kernel named: say so now, with the log, rather than fail later
    in clCreateKernel. ``names``: those to look for (default: the batch's)."""
    names = names or binary.names
    if not names:
        return
    found = set(str(program.get_info(cl.program_info.KERNEL_NAMES)).split(";"))
    missing = [k for k in names if k not in found]
    if missing:
        err = _compile_error(program, binary.text, devs, RuntimeError("no build log"))
        raise CompileError(f"the OpenCL program was built without kernels {', '.join(missing)}\n{err}",
                           source=binary.text, log=err.log)


def _binary_for(program: Any, dev: ClDevice, built_for: Sequence[ClDevice]) -> bytes:
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


def _compile_error(program: Any, text: str, devs: Sequence[ClDevice], err: Exception) -> CompileError:
    log = build_log(program, [d.device for d in devs]) or str(err)
    dev = devs[0]
    message = (
        f"OpenCL C build failed on {dev.info.name} ({cl_name(dev.platform.name)}), "
        f"options {dev.options!r}:\n{log}\n\n{source_excerpt(text, log)}"
    )
    return CompileError(message, source=text, log=log)
