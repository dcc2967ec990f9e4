"""Compile caching in one place: the base every driver's compile step extends.

A backend's compiler subclasses :class:`CachingCompiler` and gives only two things:

- :meth:`~CachingCompiler.identity`: what besides the source shapes its output and is the
  same for every compile of this compiler object (the compiler's path and version, its
  fixed flags);
- :meth:`~CachingCompiler.build`: its *uncached* compile of one source for one target into
  a file.

The base does the rest, once for every backend: a content key (namespace, identity, target
such as the host, the arch or the device, and the source), a bounded in-memory layer, the
verified files of :class:`~polyjit.core.cache.BinaryCache` on disk (nothing read from
disk is used before its bytes match their hash), the log of hits and misses under the
``polyjit`` logger, and the count of the compiler's runs (:attr:`compiles`). A second
process that compiles the same source for the same target reads the file and never runs
the compiler.
"""

from __future__ import annotations

import _ctypes
import atexit
import collections
import ctypes
import itertools
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, TypeVar

from polyjit.core.cache import BinaryCache, content_key
from polyjit.core.log import logger

__all__ = ["CachingCompiler", "SharedLibrary", "Target"]

Target = tuple[str, ...]  # what one compile is for (the host, an arch, a device group), as strings
T = TypeVar("T")


_compilers: weakref.WeakSet[CachingCompiler] = weakref.WeakSet()  # their locks, new in a forked child


class CachingCompiler:
    """A driver's compile step: content-addressed, in memory and in verified files on disk.

    Subclasses set ``namespace`` and ``suffix`` (the cache directory and the file suffix:
    ``"cpu"``/``".so"``) and implement :meth:`identity` and :meth:`build`. Several
    instances (say, one per set of flags) may share one :class:`BinaryCache`.
    """

    namespace: ClassVar[str] = ""
    suffix: ClassVar[str] = ".bin"
    memory_entries: ClassVar[int] = 256  # binaries kept in memory (bytes), least recent dropped

    def __init__(self, disk: BinaryCache | None = None) -> None:
        self.disk = disk if disk is not None else BinaryCache(self.namespace, self.suffix)
        self._memory: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._memory_only = 0  # builds kept out of the disk cache (see built_in_memory)
        self._lock = threading.Lock()
        _compilers.add(self)

    # -- what a subclass gives ------------------------------------------------------------

    def identity(self) -> tuple[str, ...]:
        """The compiler (path and version) and the flags of this instance: part of every key."""
        raise NotImplementedError

    def build(self, text: str, target: Target, out: Path) -> None:
        """Compile ``text`` for ``target`` into the file ``out`` (uncached); raise CompileError
        (with the log and the numbered source lines) when the compiler rejects it."""
        raise NotImplementedError

    # -- the cache -------------------------------------------------------------------------

    @property
    def compiles(self) -> int:
        """How many times this compiler (and whatever shares its disk cache) really compiled."""
        return self.disk.compiles + self._memory_only

    def key(self, text: str, target: Target = ()) -> str:
        # each run of parts led by its count: no identity and target can split into another's
        # (a "|" between them could: identity (a, |) and target (|) made the same parts)
        identity = self.identity()
        return content_key(self.namespace, str(len(identity)), *identity, str(len(target)), *target, text)

    def path(self, text: str, target: Target = ()) -> Path:
        """The file of the binary, verified now. A loader that takes a path (``dlopen``) must not
        be given it: the file could change before it reads it; load :meth:`data` (a shared
        library: :meth:`library`)."""
        return self.disk.get_or_build(self.key(text, target), self._builder(text, target))

    def data(self, text: str, target: Target = ()) -> bytes:
        """The binary's verified bytes: from memory, else from disk, else compiled now."""
        key = self.key(text, target)
        with self._lock:
            hit = self._memory.get(key)
            if hit is not None:
                self._memory.move_to_end(key)
        if hit is not None:
            logger.debug("cache hit %s/%s%s (in memory)", self.namespace, key, self.suffix)
            return hit
        data = self.disk.get_or_build_bytes(key, self._builder(text, target))
        self._remember(key, data)
        return data

    def library(self, text: str, target: Target = (), name: str = "lib") -> SharedLibrary:
        """The binary, a shared library, loaded from its verified bytes (:meth:`data`)."""
        return SharedLibrary(self.data(text, target), name)

    def publish(self, text: str, target: Target, data: bytes) -> None:
        """Replace the entry of ``text`` for ``target`` with ``data`` (built outside
        :meth:`data`, e.g. again after a loader refused the cached one)."""
        key = self.key(text, target)
        self.disk.put(key, data)
        self._remember(key, data)

    def built_in_memory(self, what: str, make: Callable[[], T]) -> T:
        """``make()`` for a compile whose output stays out of the disk cache (OpenCL on CPU
        devices: the platform caches its own builds, and handing out binaries costs more than
        building), counted and logged like a miss."""
        with self._lock:
            self._memory_only += 1
        logger.debug("cache miss %s: %s (built in memory only)", self.namespace, what)
        return make()

    def _builder(self, text: str, target: Target) -> Callable[[Path], None]:
        def build(out: Path) -> None:
            self.build(text, target, out)

        return build

    def _remember(self, key: str, data: bytes) -> None:
        with self._lock:
            self._memory[key] = data
            self._memory.move_to_end(key)
            while len(self._memory) > self.memory_entries:
                self._memory.popitem(last=False)


_private_dir: tuple[int, str] | None = None  # (the process that made it, the directory)
_private_lock = threading.Lock()
_library_ids = itertools.count()


class SharedLibrary:
    """A shared library loaded from bytes already verified (``CachingCompiler.data``), never
    from a path a check once passed: a file in the cache could be replaced between the check
    and ``dlopen`` (another process, a sync tool). ``lib`` is the ctypes handle;
    :meth:`close` dlcloses it.

    The bytes go into a sealed memfd, which ``dlopen`` opens through a symbolic link of a
    private directory (mode 0700) to ``/proc/self/fd/N``; link and fd go once it is loaded.
    The link's name is new for every library: the dynamic loader knows a library by the name
    it was opened by, and a later memfd that reused the number N would be taken for an
    earlier one under ``/proc/self/fd/N``. Without memfd or ``/proc`` (a chroot, a minimal
    container), the bytes go into a file of that directory instead, removed once loaded."""

    def __init__(self, data: bytes, name: str) -> None:
        self.name = name
        unique = os.path.join(_private(), f"{os.getpid()}-{next(_library_ids)}-{name}.so")
        try:
            self.lib = _through_memfd(data, name, unique)
        except OSError:
            self.lib = _through_file(data, unique)

    def close(self) -> None:
        """dlclose the library: nothing of it may run any more."""
        _ctypes.dlclose(self.lib._handle)


def _through_memfd(data: bytes, name: str, link: str) -> ctypes.CDLL:
    memfd = getattr(os, "memfd_create", None)
    if memfd is None:
        raise OSError("no memfd_create here")
    fd = memfd(f"polyjit-{name}", os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 0))
    try:
        _write_all(fd, data)
        seals = (getattr(os, "F_SEAL_SHRINK", 0) | getattr(os, "F_SEAL_GROW", 0)
                 | getattr(os, "F_SEAL_WRITE", 0) | getattr(os, "F_SEAL_SEAL", 0))
        if seals and hasattr(os, "F_ADD_SEALS"):
            import fcntl

            fcntl.fcntl(fd, os.F_ADD_SEALS, seals)
        os.symlink(f"/proc/self/fd/{fd}", link)
        try:
            return ctypes.CDLL(link)
        finally:
            os.unlink(link)
    finally:
        os.close(fd)  # the mapping keeps the memfd's pages


def _through_file(data: bytes, path: str) -> ctypes.CDLL:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o700)
    try:
        _write_all(fd, data)
    finally:
        os.close(fd)
    try:
        return ctypes.CDLL(path)
    finally:
        os.unlink(path)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _private() -> str:
    """A directory only this process made (mode 0700), removed at its exit: a forked child
    makes its own (its parent's goes when the parent exits)."""
    global _private_dir
    pid = os.getpid()
    with _private_lock:
        if _private_dir is None or _private_dir[0] != pid:
            path = tempfile.mkdtemp(prefix="polyjit-load-")
            atexit.register(_remove_private, pid, path)
            _private_dir = (pid, path)
        return _private_dir[1]


def _remove_private(pid: int, path: str) -> None:
    if os.getpid() == pid:  # a forked child runs its parent's exit hooks too
        shutil.rmtree(path, ignore_errors=True)


def _new_locks_in_child() -> None:
    """os.fork() copies only the calling thread: a lock another thread held at the fork would
    stay held in the child for ever."""
    global _private_lock
    _private_lock = threading.Lock()
    for compiler in list(_compilers):
        compiler._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_locks_in_child)

