"""The compile cache: content-addressed binaries, in memory and on disk.

Keys hash everything that changes the binary (source, dialect, compiler and
its version, flags), so a second process that compiles the same batch finds
the file and never calls the compiler.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_dir() -> Path:
    """``$POLYJIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/polyjit``, else ``~/.cache/polyjit``."""
    env = os.environ.get("POLYJIT_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "polyjit"


def content_key(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()[:40]


class BinaryCache:
    """Binaries by key: a dict in front of files under ``cache_dir()/<namespace>``."""

    def __init__(self, namespace: str, suffix: str) -> None:
        self.namespace = namespace
        self.suffix = suffix
        self._memory: dict[str, Path] = {}
        self.compiles = 0  # how many times build() really ran the compiler, for tests

    def path_for(self, key: str) -> Path:
        return cache_dir() / self.namespace / f"{key}{self.suffix}"

    def get_or_build(self, key: str, build: Callable[[Path], None]) -> Path:
        """Return the cached file for key; else call build(tmp_path) and publish it atomically."""
        hit = self._memory.get(key)
        if hit is not None and hit.exists():
            return hit
        path = self.path_for(key)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=self.suffix, dir=path.parent)
            os.close(fd)
            try:
                self.compiles += 1
                build(Path(tmp))
                os.replace(tmp, path)  # atomic: a concurrent process sees all or nothing
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        self._memory[key] = path
        return path
