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

import collections
import threading
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, TypeVar

from polyjit.core.cache import BinaryCache, content_key
from polyjit.core.log import logger

__all__ = ["CachingCompiler", "Target"]

Target = tuple[str, ...]  # what one compile is for (the host, an arch, a device group), as strings
T = TypeVar("T")


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
        return content_key(self.namespace, *self.identity(), "|", *target, "|", text)

    def path(self, text: str, target: Target = ()) -> Path:
        """The verified file of the binary (for loaders that take a path, like ``dlopen``)."""
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
