"""The compile cache: content-addressed, verified binaries, in memory and on disk.

Keys hash everything that changes the binary (source, dialect, compiler and
its version, flags), so a second process that compiles the same batch finds
the file and never calls the compiler.

Trust rules (see docs/reliability.md, "The compile cache"):

- every entry ``<key><suffix>`` has a sidecar ``<key><suffix>.sha256`` holding the
  sha256 of its bytes and its own name, in ``sha256sum`` format; an entry is returned
  only after its bytes, read through one file descriptor, match the sidecar. An entry
  that is empty, damaged, swapped, planted without a hash or with a wrong one is
  treated as absent and rebuilt;
- a sidecar (not a header) because the files are loaded by other tools as they
  are (``dlopen``, ``cuModuleLoadData``, ``clCreateProgramWithBinary``), and an
  extended attribute does not survive every file system or copy;
- the binary is published first, its sidecar second, each by ``os.replace``: a
  reader that comes between the two sees a mismatch and rebuilds, never a binary
  without its hash;
- directories are created 0700; a cache directory owned by another user, or
  writable by group or others (or below such an ancestor without the sticky bit),
  is refused with a :class:`CacheDirWarning`, and the process uses a private
  directory from ``tempfile.mkdtemp`` instead. Entry files must be regular files
  owned by us and not writable by group or others.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import errno
import hashlib
import hmac
import os
import random
import re
import shutil
import stat
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from polyjit.core.errors import CompileError, InvalidArgumentError, PolyjitError
from polyjit.core.log import logger

__all__ = [
    "DEFAULT_MAX_BYTES",
    "HANDED_OVER",
    "HANDED_OVER_MARKER",
    "HASH_SUFFIX",
    "KNOWN_NAMESPACES",
    "MAX_BYTES_ENV",
    "MAX_ENTRY_BYTES",
    "NAMESPACES_FILE",
    "POCL_NAMESPACE",
    "TEMPORARY_AGE",
    "BinaryCache",
    "CacheDirWarning",
    "CacheError",
    "cache_dir",
    "cache_trim",
    "content_key",
    "hand_over",
    "max_bytes",
]

HASH_SUFFIX = ".sha256"
# The largest entry the cache reads (compiled kernels are kilobytes to a few megabytes): a
# larger file is refused before a byte of it is read, and rebuilt (a sparse 64 GiB file with a
# well-formed hash beside it was read whole into memory: a MemoryError on every run).
MAX_ENTRY_BYTES = 1 << 30
# The bound on what the cache's own entries (binaries and their hashes, in every namespace but
# those handed over to another program) hold on disk: a long-running service, or a machine that
# runs many jobs, compiles new shapes for ever. Past it, the least recently used entries go.
MAX_BYTES_ENV = "POLYJIT_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 2 << 30
_TRIM_TO = 0.8  # a trim leaves this fraction of the bound, so the next one is not one entry away
# An entry's last use is its hash file's mtime, set when a process verifies it from disk, at most
# this often (a use from a process's memory is not a use of the file).
_TOUCH_AFTER_NS = 600 * 1_000_000_000
# Entries each BinaryCache remembers as verified by this process (700 bytes each): a long-running
# process that builds many distinct sources keeps the newest.
MEMORY_RECORDS = 4096

# Namespaces handed whole to another program, which fills them its own way: PoCL's kernel
# cache (backends/opencl/platforms.py). The cache checks their directory like its own;
# `cache info` counts their files and `cache clear` empties them, but only once polyjit has
# really handed the directory over (HANDED_OVER_MARKER in it): a `<root>/pocl` that polyjit
# never gave to PoCL (POCL_CACHE_DIR pointed elsewhere) may hold the user's own files.
POCL_NAMESPACE = "pocl"
HANDED_OVER = frozenset({POCL_NAMESPACE})
HANDED_OVER_MARKER = ".polyjit-handed-over"

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_BINARY = getattr(os, "O_BINARY", 0)
# A FIFO (or device) planted in place of an entry or sidecar would block a plain O_RDONLY open
# forever, before fstat can refuse it; O_NONBLOCK does not change reads of a regular file.
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_READ_FLAGS = os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC | _BINARY
_SIDECAR_MAX = 4096
# Why a build cannot be written in a directory that is otherwise fine: the file system is
# full, over quota, read-only, or refuses us, or the file is over the process's size limit
# (RLIMIT_FSIZE, `ulimit -f`). Such a build moves to the private directory.
_NO_ROOM = frozenset(
    code for code in (errno.ENOSPC, getattr(errno, "EDQUOT", None), errno.EROFS, errno.EACCES, errno.EFBIG)
    if code is not None
)
# What a compiler's log says when the linker was killed by SIGXFSZ (over RLIMIT_FSIZE).
_FSIZE_SIGNAL = "File size limit exceeded"
_LITTLE_ROOM = 1 << 20  # bytes: below this a failed compiler run is retried in the fallback
_SIDECAR_RE = re.compile(r"([0-9a-f]{64})  (\S+)\n?")
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")
_SUFFIX_RE = re.compile(r"(\.[A-Za-z0-9_]+)*")
# A key is what content_key makes: 40 lowercase hex digits. `cache clear` removes only names of
# that form (an entry, its hash, their temporary files), so a key of any other form is refused.
_KEY_RE = re.compile(r"[0-9a-f]{40}")
# The root's list of the namespaces the cache made there (one name a line): `cache info` and
# `cache clear` look in those directories only (and in KNOWN_NAMESPACES and HANDED_OVER), never
# in the root's other subdirectories: the root may be a directory that holds other files.
NAMESPACES_FILE = ".polyjit-namespaces"
# The namespaces polyjit's own compilers wrote before NAMESPACES_FILE existed: the backends'
# and the custom-backend example's (examples/custom_backend.py, SyncCompiler).
KNOWN_NAMESPACES = frozenset({"cpu", "opencl", "cuda", "syncdriver"})
_NAMESPACES_MAX = 1 << 16  # bytes of NAMESPACES_FILE read


class CacheDirWarning(UserWarning):
    """A cache directory was refused (unsafe or unusable); a private temporary one is used."""


class CacheError(PolyjitError, OSError):
    """Not even a private temporary cache directory could be created or written."""


class NoRoomError(CacheError):
    """Neither the cache root's file system nor the private directory's has the room a
    namespace handed to another program needs (``hand_over``)."""


def _euid() -> int | None:
    return os.geteuid() if hasattr(os, "geteuid") else None  # None: no owners to check (Windows)


def _writers(mode: int) -> str:
    who = [name for bit, name in ((stat.S_IWGRP, "group"), (stat.S_IWOTH, "others")) if mode & bit]
    return " and ".join(who)


def _dir_problem(st: os.stat_result) -> str | None:
    """Why a directory with this stat may not hold cache entries, or None."""
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    uid = _euid()
    if uid is not None and st.st_uid != uid:
        return f"it is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & 0o022:
        return f"it is writable by {_writers(st.st_mode)} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _ancestor_problem(path: Path) -> str | None:
    """Another user who can rename an ancestor can swap the whole tree after we checked it."""
    uid = _euid()
    if uid is None:
        return None
    for parent in path.parents:
        try:
            st = os.stat(parent)
        except OSError as e:
            return f"its ancestor {parent} cannot be read ({e.strerror})"
        if st.st_uid not in (uid, 0):
            return f"its ancestor {parent} is owned by uid {st.st_uid}"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return f"its ancestor {parent} is writable by {_writers(st.st_mode)} without the sticky bit"
    return None


def _file_problem(st: os.stat_result) -> bool:
    if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o022:
        return True
    uid = _euid()
    return uid is not None and st.st_uid != uid


def _make_dirs(path: Path) -> str | None:
    """Create path and its missing ancestors, each 0700; a reason on failure."""
    missing: list[Path] = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for q in reversed(missing):
        try:
            os.mkdir(q, 0o700)
        except FileExistsError:
            continue  # a concurrent process made it; checked below like any other
        except OSError as e:
            return f"it cannot be created ({e.strerror or e})"
        try:
            os.chmod(q, 0o700)  # the umask may have taken bits we need
        except OSError as e:
            return f"it cannot be made private ({e.strerror or e})"
    return None


def _link_problem(path: Path) -> str | None:
    """A symbolic link on the way to ``path`` that another user owns can point it anywhere
    (the way Linux's protected_symlinks refuses to follow one in a shared directory)."""
    uid = _euid()
    if uid is None:
        return None
    here = Path(os.path.abspath(path))
    for p in (here, *here.parents):
        try:
            st = os.lstat(p)
        except OSError:
            continue  # not made yet
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (uid, 0):
            return f"{p} is a symbolic link owned by uid {st.st_uid}, not by this user (uid {uid}) or root"
    return None


def _usable_root(path: Path) -> tuple[Path | None, str | None]:
    """The real path of a safe, writable cache root (created if missing), or the reason not."""
    problem = _link_problem(path) or _make_dirs(path)
    if problem is not None:
        return None, problem
    # The real path from here on: a symlink planted in a shared directory cannot be retargeted.
    real = Path(os.path.realpath(path))
    try:
        st = os.stat(real)
    except OSError as e:
        return None, f"it cannot be read ({e.strerror or e})"
    problem = _dir_problem(st) or _ancestor_problem(real)
    if problem is None and not os.access(real, os.W_OK | os.X_OK):
        problem = "it is not writable by this user"
    return (None, problem) if problem else (real, None)


def _private_dir(path: Path) -> str | None:
    """Create path (0700) unless it exists; a reason if it is not ours alone. No symlinks."""
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        return f"it cannot be created ({e.strerror or e})"
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    problem = _dir_problem(st)
    if problem is None and not os.access(path, os.W_OK | os.X_OK):
        problem = "it is not writable by this user"
    return problem


def _recorded_namespaces(root: Path) -> set[str]:
    """The namespaces NAMESPACES_FILE in root lists (a plain file of ours), plain names only."""
    try:
        fd = os.open(root / NAMESPACES_FILE, _READ_FLAGS)
    except OSError:
        return set()
    try:
        if _file_problem(os.fstat(fd)):
            return set()
        text = os.read(fd, _NAMESPACES_MAX)
    except OSError:
        return set()
    finally:
        os.close(fd)
    return {n for n in text.decode("ascii", "replace").splitlines() if _NAME_RE.fullmatch(n)}


_recorded: set[tuple[Path, str]] = set()  # (root, namespace) this process found listed or listed


def _record_namespace(root: Path, namespace: str) -> None:
    """List namespace in root's NAMESPACES_FILE (once per process), so `cache clear` finds it."""
    if (root, namespace) in _recorded:
        return
    if namespace not in _recorded_namespaces(root):
        try:
            fd = os.open(root / NAMESPACES_FILE,
                         os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o600)
        except OSError as e:  # unlisted: `cache clear` leaves it alone, which is only less tidy
            logger.debug("cannot list namespace %s in %s: %s", namespace, root, e)
            return
        try:
            if _file_problem(os.fstat(fd)):
                return
            os.write(fd, f"{namespace}\n".encode("ascii"))  # one append: whole, whoever else appends
        except OSError as e:
            logger.debug("cannot list namespace %s in %s: %s", namespace, root, e)
            return
        finally:
            os.close(fd)
    _recorded.add((root, namespace))


_warned: set[str] = set()
_fallback_lock = threading.Lock()
_fallback: tuple[int, Path] | None = None  # (pid, dir): one per process, reused
_fallbacks_made: list[tuple[int, Path]] = []


def _warn(place: Path, reason: str) -> None:
    message = (
        f"polyjit compile cache: refusing {place}: {reason}; "
        "using a private temporary directory instead (binaries are not kept across processes)"
    )
    with _fallback_lock:
        if message in _warned:
            return
        _warned.add(message)
    warnings.warn(message, CacheDirWarning, stacklevel=2)


def _fallback_root() -> Path:
    """This process's private cache root, made by mkdtemp (0700) on first use."""
    global _fallback
    with _fallback_lock:
        pid = os.getpid()
        if _fallback is not None and _fallback[0] == pid:
            try:
                if _dir_problem(os.lstat(_fallback[1])) is None:
                    return _fallback[1]
            except OSError:
                pass  # removed under us: make another
        try:
            made = Path(tempfile.mkdtemp(prefix="polyjit-cache-"))
        except OSError as e:
            raise CacheError(f"polyjit compile cache: no private temporary directory: {e}") from e
        if not _fallbacks_made:
            atexit.register(_remove_fallbacks)
        _fallbacks_made.append((pid, made))
        _fallback = (pid, made)
        return made


def _remove_fallbacks() -> None:
    pid = os.getpid()  # a forked child must not remove its parent's directory
    for owner, path in _fallbacks_made:
        if owner == pid:
            shutil.rmtree(path, ignore_errors=True)


def _configured_root() -> Path | None:
    env = os.environ.get("POLYJIT_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    try:
        base = Path(xdg) if xdg else Path.home() / ".cache"
    except RuntimeError:  # no $HOME and no passwd entry
        return None
    return base / "polyjit"


def _root() -> tuple[Path | None, Path, str]:
    """The configured cache root: (its real path, or None when it is refused; the path as
    configured; why it is refused)."""
    root = _configured_root()
    if root is None:
        return None, Path("~/.cache/polyjit"), "there is no home directory"
    real, problem = _usable_root(root)
    return real, root, problem or "it is unusable"


def refused_cache_dir() -> tuple[Path, str] | None:
    """The configured cache directory and why it is refused (unsafe or unusable), or None when
    it is in use. ``polyjit cache`` says so rather than show or clear the private temporary
    directory that :func:`cache_dir` falls back to."""
    real, root, problem = _root()
    return None if real is not None else (root, problem)


def cache_dir() -> Path:
    """The cache root in use: ``$POLYJIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/polyjit``, else
    ``~/.cache/polyjit``, created 0700; a private temporary directory (with a
    :class:`CacheDirWarning`) when that one is unsafe or unusable."""
    real, root, problem = _root()
    if real is None:
        _warn(root, problem)
        return _fallback_root()
    return real


def content_key(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()[:40]


class _Ident(NamedTuple):
    """What changes when a file is replaced or rewritten (ctime cannot be set back by utime)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int


def _ident(st: os.stat_result) -> _Ident:
    return _Ident(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class _Seen(NamedTuple):
    path: Path
    ident: _Ident
    since_ns: int = 0  # the wall clock when its bytes were read to be hashed (0: never trust the ident)


# A file verified less than this long after it was last changed is hashed again when next used,
# however unchanged its identity looks: on a file system with one-second (or two-second)
# timestamps, a same-size rewrite in the same tick keeps dev, inode, size, mtime and ctime
# (300 of 300 rewrites went unnoticed on ext4 with 128-byte inodes). Once its ctime is this far
# before a verification, any later change gets a later ctime (the "racy git" rule).
_UNCHANGED_AFTER_NS = 3_000_000_000


def _digest_line(name: str, data: bytes) -> str:
    return f"{hashlib.sha256(data).hexdigest()}  {name}\n"  # sha256sum -c can check it


def _read_sidecar(path: Path) -> str | None:
    """The hex digest recorded for path, or None if the sidecar is missing or not trusted."""
    try:
        fd = os.open(f"{path}{HASH_SUFFIX}", _READ_FLAGS)
    except OSError:
        return None
    try:
        if _file_problem(os.fstat(fd)):
            return None
        text = os.read(fd, _SIDECAR_MAX + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(text) > _SIDECAR_MAX:
        return None
    m = _SIDECAR_RE.fullmatch(text.decode("ascii", "replace"))
    # The name inside catches a sidecar moved along with another entry's binary.
    return m.group(1) if m and m.group(2) == path.name else None


def _read_fd(fd: int, size: int) -> bytes | None:
    """The bytes of the file open as fd, whose fstat says size bytes (at most MAX_ENTRY_BYTES);
    None if it holds another number of bytes now. Never reads (or allocates) past size + 1."""
    with open(fd, "rb", closefd=False) as f:
        data = f.read(size + 1)
    return data if len(data) == size else None


def _verified(path: Path) -> tuple[bytes, _Ident, int] | None:
    """The bytes of path, its identity and when they were read (time.time_ns()), if they match
    their sidecar; else None."""
    expected = _read_sidecar(path)
    if expected is None:
        return None
    since_ns = time.time_ns()
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if _file_problem(st) or st.st_size == 0:
            return None
        if st.st_size > MAX_ENTRY_BYTES:
            logger.debug("cache entry %s: %d bytes, over MAX_ENTRY_BYTES: rebuilt", path, st.st_size)
            return None
        data = _read_fd(fd, st.st_size)
    except OSError:
        return None
    finally:
        os.close(fd)
    if not data or not hmac.compare_digest(hashlib.sha256(data).hexdigest(), expected):
        return None
    _mark_used(path, since_ns)
    return data, _ident(st), since_ns


def _mark_used(path: Path, now_ns: int) -> None:
    """Record a use of path's entry for the trim's LRU order: its hash file's mtime (not the
    entry's own, whose identity tells this and other processes it is unchanged)."""
    side = f"{path}{HASH_SUFFIX}"
    try:
        st = os.lstat(side)
        if st.st_mtime_ns < now_ns - _TOUCH_AFTER_NS and not _file_problem(st):
            os.utime(side, ns=(now_ns, now_ns), follow_symlinks=False)
    except (OSError, NotImplementedError):  # NotImplementedError: no lutimes on this platform
        pass  # the order is a little off: only what a trim removes first changes


def _unchanged(seen: _Seen) -> bool:
    if seen.ident.ctime_ns >= seen.since_ns - _UNCHANGED_AFTER_NS:
        return False  # changed too shortly before it was verified for its identity to tell
    try:
        st = os.lstat(seen.path)
    except OSError:
        return False
    return not _file_problem(st) and _ident(st) == seen.ident


def _no_room(directory: Path, error: BaseException) -> str | None:
    """Why a build failed for want of room (or write access) in directory, or None."""
    if isinstance(error, OSError):
        return (error.strerror or str(error)) if error.errno in _NO_ROOM else None
    if not isinstance(error, CompileError):
        return None
    # A compiler (a child process) reports the error only in its log: look for the C
    # library's message of a full disk, else (a translated one, or a directory we may not
    # write) ask the file system itself. Not "Permission denied": a compile error's own text
    # (an #error, an echoed source line) may say it.
    log = error.log or str(error)
    for code in (errno.ENOSPC, getattr(errno, "EDQUOT", None)):
        if code is not None and os.strerror(code) in log:
            return os.strerror(code)
    if _FSIZE_SIGNAL in log:
        return _FSIZE_SIGNAL
    if not os.access(directory, os.W_OK):
        return "not writable"
    try:
        st = os.statvfs(directory)
    except (OSError, AttributeError):  # AttributeError: no statvfs (Windows)
        return None
    if st.f_flag & getattr(os, "ST_RDONLY", 0):
        return "read-only file system"
    if st.f_bavail * st.f_frsize < _LITTLE_ROOM or (st.f_files and not st.f_favail):
        return "almost no space left on its file system"
    return None


def _in_fallback(directory: Path) -> bool:
    made = _fallback
    return made is not None and made[0] == os.getpid() and directory.is_relative_to(made[1])


def _open_built(tmp: str, name: str) -> tuple[int, bytes]:
    """An fd on a freshly built tmp file (made private) and its bytes."""
    fd = os.open(tmp, _READ_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CacheError(f"polyjit compile cache: the build of {name} is not a regular file")
        if st.st_mode & 0o022 and hasattr(os, "fchmod"):
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~0o022)  # compilers follow the umask
        if st.st_size > MAX_ENTRY_BYTES:
            raise CacheError(f"polyjit compile cache: the build of {name} is {st.st_size} bytes, "
                             f"over the cache's limit of {MAX_ENTRY_BYTES}")
        data = _read_fd(fd, st.st_size)
        if data is None:
            raise CacheError(f"polyjit compile cache: the build of {name} changed while it was read")
    except BaseException:
        os.close(fd)
        raise
    if not data:
        os.close(fd)
        raise CompileError(f"the build of cache entry {name} wrote nothing")
    return fd, data


class _HashNotWritten(OSError):
    """The entry's hash could not be written: the entry is not published (or unpublished again)."""


def _commit(fd: int, tmp: str, path: Path, data: bytes) -> _Ident:
    """Publish tmp (open as fd, holding data, in path's directory) as path, then its sidecar.
    The sidecar is written (to its own temporary file) before the binary is renamed, and if its
    rename fails the binary just published is removed again: no binary is left without its hash
    (a failed sidecar write used to leave one that nothing could trust or clear)."""
    try:
        side_fd, side_tmp = tempfile.mkstemp(prefix=f".{path.name}{HASH_SUFFIX}.", dir=path.parent)
    except OSError as e:
        raise _HashNotWritten(e.errno, e.strerror) from e
    try:
        try:
            with open(side_fd, "w", encoding="ascii") as f:
                f.write(_digest_line(path.name, data))
        except OSError as e:
            raise _HashNotWritten(e.errno, e.strerror) from e
        os.replace(tmp, path)  # the binary first: a reader never trusts it before its hash lands
        try:
            os.replace(side_tmp, f"{path}{HASH_SUFFIX}")
        except OSError as e:
            with contextlib.suppress(OSError):
                here, mine = os.lstat(path), os.fstat(fd)
                if (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino):  # not another's since
                    os.unlink(path)
            raise _HashNotWritten(e.errno, e.strerror) from e
    finally:
        if os.path.lexists(side_tmp):
            os.unlink(side_tmp)
    return _ident(os.fstat(fd))  # the published inode (the rename changed its ctime)


class BinaryCache:
    """Binaries by key: a dict in front of verified files under ``cache_dir()/<namespace>``.

    ``get_or_build`` returns a path (for loaders that take one, like ``dlopen``);
    ``get_or_build_bytes`` returns the verified bytes themselves, read once, so
    nothing can change between the check and the use.
    """

    def __init__(self, namespace: str, suffix: str) -> None:
        if not _NAME_RE.fullmatch(namespace):
            raise ValueError(f"cache namespace must be a plain name, not {namespace!r}")
        if not _SUFFIX_RE.fullmatch(suffix) or suffix.endswith(HASH_SUFFIX):
            raise ValueError(f"cache suffix must look like '.so', not {suffix!r}")
        self.namespace = namespace
        self.suffix = suffix
        # key -> the file verified here, and its identity: the newest MEMORY_RECORDS (one that
        # went is verified again when next used)
        self._memory: collections.OrderedDict[str, _Seen] = collections.OrderedDict()
        self.compiles = 0  # how many times build() really ran the compiler, for tests
        self._lock = threading.Lock()
        self._key_locks: dict[str, list[Any]] = {}  # key -> [its lock, threads using it]: only keys in use
        _instances.add(self)  # given new locks in a forked child (_after_fork_in_child)

    # -- places -----------------------------------------------------------------------

    def directory(self) -> Path:
        """The namespace directory in use (created 0700), or its private fallback."""
        root = cache_dir()
        path = root / self.namespace
        problem = _private_dir(path)
        if problem is None:
            _record_namespace(root, self.namespace)
            return path
        _warn(path, problem)
        return self._fallback_dir()

    def _fallback_dir(self) -> Path:
        path = _fallback_root() / self.namespace
        problem = _private_dir(path)
        if problem is not None:
            raise CacheError(f"polyjit compile cache: cannot use {path}: {problem}")
        return path

    def _name(self, key: str) -> str:
        if not _KEY_RE.fullmatch(key):
            raise ValueError(f"cache key must be 40 lowercase hex digits (from content_key), not {key!r}")
        return f"{key}{self.suffix}"

    def path_for(self, key: str) -> Path:
        return self.directory() / self._name(key)

    # -- lookups ----------------------------------------------------------------------

    def get_or_build(self, key: str, build: Callable[[Path], None]) -> Path:
        """The verified cached file for key; else call build(tmp_path), publish it, return it.
        A trim (:func:`cache_trim`, by any process) may remove the file later."""
        return self._get(key, build, want_bytes=False)[0]

    def get_or_build_bytes(self, key: str, build: Callable[[Path], None]) -> bytes:
        """Like get_or_build, but the verified bytes themselves (no check-then-use gap)."""
        data = self._get(key, build, want_bytes=True)[1]
        assert data is not None
        return data

    def put(self, key: str, data: bytes) -> Path:
        """Publish (or replace) the entry for key with data and its hash; return its path."""
        if not data:
            raise ValueError("a cache entry cannot be empty")
        if len(data) > MAX_ENTRY_BYTES:
            raise ValueError(f"a cache entry cannot be over MAX_ENTRY_BYTES ({MAX_ENTRY_BYTES} bytes)")
        name = self._name(key)
        with self._key_lock(key):
            try:
                return self._publish(self.directory(), name, key, lambda tmp: tmp.write_bytes(data))[0]
            except CacheError:
                raise
            except OSError as e:  # the cache's own write failed: the cache's error (an OSError too)
                raise CacheError(f"polyjit compile cache: cannot publish {name}: {e}") from e

    @contextlib.contextmanager
    def _key_lock(self, key: str) -> Iterator[None]:
        """Hold the key's lock: threads of one process build a key once. A key's lock lives
        while a thread uses it (one per key ever built grew for the life of the process)."""
        entry: list[Any] | None = None  # set with the count, where no interrupt comes between
        try:
            with self._lock:
                taken = self._key_locks.get(key)
                if taken is None:
                    taken = self._key_locks[key] = [threading.Lock(), 0]
                taken[1] += 1
                entry = taken
            with entry[0]:
                yield
        finally:
            if entry is not None:
                with self._lock:
                    entry[1] -= 1
                    if not entry[1] and self._key_locks.get(key) is entry:  # (a forked child
                        del self._key_locks[key]  # has a new table, without the parent's entry)

    def _remember(self, key: str, seen: _Seen) -> None:
        with self._lock:
            memory = self._memory
            memory[key] = seen
            memory.move_to_end(key)
            while len(memory) > MEMORY_RECORDS:
                # the oldest record of an entry in the shared directory (verified again when used);
                # one in the private fallback stays: nothing else leads there
                old = next((k for k, v in memory.items() if not _in_fallback(v.path.parent)), None)
                if old is None:
                    break
                del memory[old]

    def _hit(self, key: str, path: Path, want_bytes: bool) -> tuple[Path, bytes | None] | None:
        seen = self._memory.get(key)
        if seen is not None and seen.path != path and _in_fallback(seen.path.parent):
            path = seen.path  # built privately when the shared directory failed us: still ours
        if not want_bytes and seen is not None and seen.path == path and _unchanged(seen):
            return path, None  # verified by this process, and still the same file
        got = _verified(path)
        if got is None:
            return None
        data, ident, since_ns = got
        self._remember(key, _Seen(path, ident, since_ns))
        return path, data

    def _get(self, key: str, build: Callable[[Path], None], want_bytes: bool) -> tuple[Path, bytes | None]:
        name = self._name(key)
        hit = self._hit(key, self.directory() / name, want_bytes)
        if hit is not None:
            logger.debug("cache hit %s", hit[0])
            return hit
        with self._key_lock(key):  # threads of one process build a key once
            directory = self.directory()
            hit = self._hit(key, directory / name, want_bytes)
            if hit is not None:
                logger.debug("cache hit %s", hit[0])
                return hit
            with self._lock:
                self.compiles += 1
            logger.debug("cache miss %s: building it", directory / name)
            return self._publish(directory, name, key, build)

    def _new_tmp(self, directory: Path, name: str) -> tuple[Path, str]:
        """A fresh temp file for name in directory, else in the private fallback."""
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=self.suffix, dir=directory)
        except OSError as e:
            _warn(directory, f"it cannot be written ({e.strerror or e})")
            directory = self._fallback_dir()
            try:
                fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=self.suffix, dir=directory)
            except OSError as e2:
                raise CacheError(f"polyjit compile cache: cannot write in {directory}: {e2}") from e2
        os.close(fd)
        return directory, tmp

    def _publish(
        self, directory: Path, name: str, key: str, write: Callable[[Path], object]
    ) -> tuple[Path, bytes]:
        """Run write(tmp) in directory (or the fallback, if directory fails us) and publish."""
        bound = max_bytes()  # a bad $POLYJIT_CACHE_MAX_BYTES is said before the build, not after it
        directory, tmp = self._new_tmp(directory, name)
        try:
            try:
                write(Path(tmp))  # its other errors (CompileError, ...) go to the caller as they are
            except (OSError, CompileError) as e:
                reason = _no_room(directory, e)
                if reason is None:
                    raise
                if _in_fallback(directory):
                    if isinstance(e, CompileError):
                        raise  # the compiler's own error, with its log
                    raise CacheError(f"polyjit compile cache: cannot build {directory / name}: {reason}") from e
                # A full (or read-only, over-quota) file system under the cache root: build in
                # the private directory and keep the build there, as for a refused root.
                _warn(directory, f"builds cannot be written there ({reason})")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                directory, tmp = self._new_tmp(self._fallback_dir(), name)
                try:
                    write(Path(tmp))
                except OSError as e2:
                    if e2.errno not in _NO_ROOM:
                        raise
                    raise CacheError(f"polyjit compile cache: cannot build {directory / name}: {e2}") from e2
            try:
                fd, data = _open_built(tmp, name)
            except OSError as e:
                raise CacheError(f"polyjit compile cache: cannot read the build of {name}: {e}") from e
            try:
                ident = _commit(fd, tmp, directory / name, data)
            except OSError as e:
                # E.g. the entry's name (or its hash's) is taken by a directory, or no inode is
                # left for the hash: keep the build, publish it privately.
                what = "its hash cannot be written" if isinstance(e, _HashNotWritten) else "it cannot be replaced"
                _warn(directory / name, f"{what} ({e.strerror or e})")
                directory = self._fallback_dir()
                ident = self._write_new(directory, name, data)
            finally:
                os.close(fd)
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
        path = directory / name
        self._remember(key, _Seen(path, ident))
        if not _in_fallback(directory):
            _maybe_trim(len(data), bound, path)
        return path, data

    def _write_new(self, directory: Path, name: str, data: bytes) -> _Ident:
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=self.suffix, dir=directory)
            try:
                with open(fd, "wb", closefd=False) as f:
                    f.write(data)
                return _commit(fd, tmp, directory / name, data)
            finally:
                os.close(fd)
                if os.path.lexists(tmp):
                    os.unlink(tmp)
        except OSError as e:
            raise CacheError(f"polyjit compile cache: cannot publish {name} in {directory}: {e}") from e


# What the cache writes in a namespace: entries ``<key><suffix>`` (a key is 40 lowercase hex
# digits), each beside its hash (``<entry>.sha256``), and the temporary files they are written
# as: mkstemp's ``.<entry>.XXXXXXXX<suffix>`` (8 of "a-z0-9_"), ``.<entry>.sha256.XXXXXXXX``,
# and what a build writes beside its output (the C compiler's ``.<entry>.XXXXXXXX.c``).
# Nothing else there is the cache's to count or remove: the root may be a directory that holds
# other files, and the namespace the user's own directory of that name.
_ENTRY_RE = re.compile(r"[0-9a-f]{40}(?:\.[A-Za-z0-9_]+)*")
_TMP_RE = re.compile(r"\.[0-9a-f]{40}((?:\.[A-Za-z0-9_]+)*?)\.(?:sha256\.[a-z0-9_]{8}|[a-z0-9_]{8}(?:\1|\.[A-Za-z0-9_]+)?)")
# `cache clear` removes a temporary file only once it was last written this many seconds ago: a
# younger one may be a build in progress (a process killed mid-compile leaves its own behind).
TEMPORARY_AGE = 3600
_DIR_FDS = (hasattr(os, "O_DIRECTORY") and os.scandir in os.supports_fd
            and os.unlink in os.supports_dir_fd and os.stat in os.supports_dir_fd)


def _namespaces(root: Path) -> list[Path]:
    """The cache's namespace directories under root: those the cache listed there, the backends'
    and the handed-over ones; real directories of ours, never symbolic links."""
    found = []
    for name in sorted(KNOWN_NAMESPACES | HANDED_OVER | _recorded_namespaces(root)):
        try:
            st = os.lstat(root / name)
        except OSError:
            continue
        if _dir_problem(st) is None:
            found.append(root / name)
    return found


class _Space:
    """A namespace directory, opened once: its files are listed and removed relative to its fd
    (where the platform has them), so it (or a file in it) swapped for a link is never followed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None
        if _DIR_FDS:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC)

    def __enter__(self) -> _Space:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)

    def files(self) -> dict[str, os.stat_result]:
        """Its plain files by name (links and directories are not files)."""
        found = {}
        with os.scandir(self.path if self.fd is None else self.fd) as it:
            for entry in it:
                with contextlib.suppress(OSError):  # removed meanwhile
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        found[entry.name] = st
        return found

    def unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            if self.fd is None:
                os.unlink(self.path / name)
            else:
                os.unlink(name, dir_fd=self.fd)

    def _lstat(self, name: str) -> os.stat_result:
        if self.fd is None:
            return os.lstat(self.path / name)
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def remove_entry(self, name: str, st: os.stat_result, used_ns: int) -> bool:
        """Remove entry ``name`` (listed with stat ``st``, last used at ``used_ns``) and its hash,
        unless it was used or published again since it was listed. The hash goes first: from then
        on no process trusts the entry, and one that builds it again meanwhile publishes a new
        file, which is left (only the listed inode is removed)."""
        side = f"{name}{HASH_SUFFIX}"
        try:
            if self._lstat(side).st_mtime_ns > used_ns:
                return False  # used (or published) since it was listed
            self.unlink(side)
            now = self._lstat(name)
        except FileNotFoundError:
            return False
        if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            self.unlink(name)
        return True


class _Contents(NamedTuple):
    entries: list[str]  # entries with their hash beside them
    orphans: list[str]  # an entry without its hash, or a hash without its entry
    temporary: list[str]  # the cache's temporary files


def _contents(files: dict[str, os.stat_result]) -> _Contents:
    entries, orphans = [], []
    for n in files:
        if not _ENTRY_RE.fullmatch(n):
            continue
        if n.endswith(HASH_SUFFIX):
            if n[: -len(HASH_SUFFIX)] not in files:
                orphans.append(n)
        elif f"{n}{HASH_SUFFIX}" in files:
            entries.append(n)
        else:
            orphans.append(n)
    return _Contents(sorted(entries), sorted(orphans), sorted(n for n in files if _TMP_RE.fullmatch(n)))


def _marked(space: Path) -> bool:
    """Whether polyjit handed this directory over (its marker is a plain file of ours)."""
    try:
        return not _file_problem(os.lstat(space / HANDED_OVER_MARKER))
    except OSError:
        return False


# The room a handed-over directory's file system must have (see hand_over).
HAND_OVER_MIN_ROOM = 64 << 20


def _free_bytes(directory: Path) -> int | None:
    """Bytes an unprivileged writer may still use on the directory's file system (None: unknown)."""
    try:
        st = os.statvfs(directory)
    except (OSError, AttributeError):  # AttributeError: no statvfs (Windows)
        return None
    return st.f_bavail * st.f_frsize


def hand_over(namespace: str) -> Path:
    """The directory of a namespace handed whole to another program (see HANDED_OVER),
    created 0700 like the cache's own, and marked as handed over: from now on what is in it
    is the other program's (an earlier polyjit's hand-over left files there unmarked). A
    directory polyjit never hands over (``$POCL_CACHE_DIR`` set elsewhere) stays unmarked,
    and `cache clear` leaves it alone. On a file system with under HAND_OVER_MIN_ROOM free,
    the namespace is made in this process's private directory instead, with a warning."""
    if namespace not in HANDED_OVER:
        raise ValueError(f"{namespace!r} is not a namespace handed over to another program")
    directory = BinaryCache(namespace, "").directory()
    room = _free_bytes(directory)
    if room is not None and room < HAND_OVER_MIN_ROOM:
        # The other program cannot fall back as polyjit's own writes do: PoCL's LLVM aborts the
        # whole process on a full disk (found by review: SIGABRT on a full cache file system).
        in_fallback = _in_fallback(directory)  # the root was refused: this is the private one
        if not in_fallback:
            _warn(directory, f"{room >> 20} MiB free on its file system, under {HAND_OVER_MIN_ROOM >> 20} MiB "
                             f"for {namespace}'s own cache, which cannot fall back on a full disk")
        fallback = _fallback_root()
        spare = room if in_fallback else _free_bytes(fallback)
        if spare is not None and spare < HAND_OVER_MIN_ROOM:  # the same full disk, often
            raise NoRoomError(f"no room for {namespace}'s own cache, which cannot fall back on a full disk: "
                              f"{room >> 20} MiB free at {directory}, {spare >> 20} MiB at {fallback} "
                              f"(under {HAND_OVER_MIN_ROOM >> 20} MiB)")
        directory = fallback / namespace
        directory.mkdir(mode=0o700, exist_ok=True)
    marker = directory / HANDED_OVER_MARKER
    try:
        if not _marked(directory):
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
            with open(fd, "w", encoding="ascii") as f:
                f.write("polyjit handed this directory to another program's cache\n")
    except FileExistsError:
        pass  # a concurrent process marked it
    except OSError as e:  # unmarked: clear leaves it alone, which is only less tidy
        logger.debug("cannot mark %s as handed over: %s", directory, e)
    return directory


def _handed_over_files(space: Path) -> list[os.stat_result]:
    """The plain files anywhere below a handed-over namespace (links are not followed), but
    its marker."""
    found = []
    for top, _, names in os.walk(space):
        for name in names:
            if top == str(space) and name == HANDED_OVER_MARKER:
                continue
            with contextlib.suppress(OSError):  # the program may be removing it meanwhile
                st = os.lstat(os.path.join(top, name))
                if stat.S_ISREG(st.st_mode):
                    found.append(st)
    return found


def _handed_over_spaces(root: Path) -> list[Path]:
    """The namespaces under root that polyjit handed whole to another program (and marked)."""
    return [space for space in _namespaces(root) if space.name in HANDED_OVER and _marked(space)]


def _listed_spaces(root: Path, stack: contextlib.ExitStack) -> Iterator[tuple[_Space, dict[str, os.stat_result]]]:
    """The cache's own namespaces under root (not those handed over), each opened (and closed by
    ``stack``) and its plain files listed: what ``info``, ``clear`` and ``trim`` walk alike."""
    handed = set(_handed_over_spaces(root))
    for space in _namespaces(root):
        if space in handed:
            continue
        try:
            opened = stack.enter_context(_Space(space))
        except OSError:
            continue  # removed (or swapped for a link) meanwhile
        yield opened, opened.files()


def cache_info() -> dict[str, object]:
    """What the compile cache holds: its directory and, per namespace, its entries and their
    bytes, its orphans (an entry without its hash, or a hash without its entry, which
    ``clear`` removes too) and its temporary files (a build in progress, or one a killed
    process left) and theirs; for a namespace handed over to another program, its files;
    and the bound (:func:`max_bytes`)."""
    root = cache_dir()
    spaces: dict[str, dict[str, int]] = {}
    for space in _handed_over_spaces(root):
        sizes = [st.st_size for st in _handed_over_files(space)]
        spaces[space.name] = {"entries": len(sizes), "bytes": sum(sizes), "orphans": 0, "orphan_bytes": 0,
                              "temporary": 0, "temporary_bytes": 0}
    with contextlib.ExitStack() as stack:
        for opened, files in _listed_spaces(root, stack):
            found = _contents(files)
            spaces[opened.path.name] = {
                "entries": len(found.entries), "bytes": sum(files[n].st_size for n in found.entries),
                "orphans": len(found.orphans), "orphan_bytes": sum(files[n].st_size for n in found.orphans),
                "temporary": len(found.temporary),
                "temporary_bytes": sum(files[n].st_size for n in found.temporary),
            }
    return {"directory": str(root), "namespaces": dict(sorted(spaces.items())), "max_bytes": max_bytes()}


def cache_clear() -> int:
    """Remove every entry of the compile cache (this user's own directory), and only what the
    cache wrote or handed over; returns how many entries and orphans (files, in a handed-over
    namespace). Its temporary files go too once last written TEMPORARY_AGE seconds ago (a younger
    one may be a build in progress). Processes running keep what they loaded."""
    removed = 0
    root = cache_dir()
    for space in _handed_over_spaces(root):  # the other program's alone: all of it
        removed += len(_handed_over_files(space))
        for f in space.iterdir():
            if f.name == HANDED_OVER_MARKER:
                continue  # still handed over: a running process's PoCL may write there
            if stat.S_ISDIR(os.lstat(f).st_mode):
                shutil.rmtree(f, ignore_errors=True)  # unlinks links, never follows them
            else:
                f.unlink(missing_ok=True)
    with contextlib.ExitStack() as stack:
        for opened, files in _listed_spaces(root, stack):
            found = _contents(files)
            for name in found.entries:
                opened.unlink(name)
                opened.unlink(f"{name}{HASH_SUFFIX}")
                removed += 1
            for name in found.orphans:
                opened.unlink(name)
                removed += 1
            old = time.time() - TEMPORARY_AGE
            for name in found.temporary:
                if files[name].st_mtime < old:  # not a build in progress
                    opened.unlink(name)
    return removed


_SIZE_RE = re.compile(r"(\d+(?:\.\d*)?)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)


def max_bytes() -> int | None:
    """The bound on the cache's own entries on disk: ``$POLYJIT_CACHE_MAX_BYTES`` (bytes, or a
    number with K, M, G or T: powers of 1024, as ccache's ``max_size``), else DEFAULT_MAX_BYTES;
    None (no bound) for 0."""
    text = os.environ.get(MAX_BYTES_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_BYTES
    m = _SIZE_RE.fullmatch(text)
    if m is None:
        raise InvalidArgumentError(
            f"{MAX_BYTES_ENV}={text!r} is not a size: bytes, or a number with K, M, G or T (say 500M), "
            "or 0 for no bound")
    number = float(m.group(1)) * 1024 ** ("", "k", "m", "g", "t").index(m.group(2).lower())
    if not number:
        return None
    return max(1, int(min(number, 1 << 62)))  # 0.5 is a bound of a byte, not none; 10^400 fits


def cache_trim(limit: int | None = None, keep: Path | None = None) -> int:
    """When the cache's own entries hold more than ``limit`` bytes (default :func:`max_bytes`),
    remove the least recently used ones (last verified from disk by any process, or published)
    until they hold at most 80% of it; returns how many went. Orphans and temporary files last
    written TEMPORARY_AGE seconds ago go too (a killed build's). The namespaces handed over to
    another program (PoCL's kernel cache) are not counted or trimmed. Processes running keep
    what they loaded; one that looks up an entry removed meanwhile compiles it again. ``keep``:
    an entry never removed (the one a publish just returned the path of)."""
    bound = max_bytes() if limit is None else limit
    if not bound:
        return 0
    with contextlib.ExitStack() as stack:
        found: list[tuple[int, int, _Space, str, os.stat_result]] = []  # (last use, bytes, ...)
        total = 0
        for opened, files in _listed_spaces(cache_dir(), stack):
            contents = _contents(files)
            old = time.time() - TEMPORARY_AGE  # what a killed build or trim left: no one's now
            for name in (*contents.orphans, *contents.temporary):
                if files[name].st_mtime < old:
                    opened.unlink(name)
            for name in contents.entries:
                st, side = files[name], files[f"{name}{HASH_SUFFIX}"]
                size = st.st_size + side.st_size
                total += size
                if keep is None or opened.path / name != keep:  # (counted, never removed)
                    found.append((max(st.st_mtime_ns, side.st_mtime_ns), size, opened, name, st))
        if total <= bound:
            return 0
        found.sort(key=lambda f: f[0])
        removed, target = 0, int(bound * _TRIM_TO)
        for used, size, opened, name, st in found:
            if total <= target:
                break
            if opened.remove_entry(name, st, used):
                removed += 1
            total -= size  # (one used again meanwhile is kept, and counted as gone: it is new)
    logger.debug("cache trim: removed %d entries, about %d bytes left (bound %d)", removed, total, bound)
    return removed


def _maybe_trim(written: int, bound: int | None, keep: Path) -> None:
    """After a publish of ``written`` bytes: trim, with the chance that makes one trim for about
    every sixteenth of the bound written, whichever processes wrote it. A trim lists every entry,
    so it is not run on every publish, and a count of bytes written kept per process would never
    reach its mark in processes that each compile a little. ``keep``: the entry just published,
    whose path its caller returns."""
    if bound and random.random() < written * 16 / bound:
        try:
            cache_trim(bound, keep)
        except OSError as e:  # a cache that cannot be trimmed still serves
            logger.debug("cache trim failed: %s", e)


# os.fork() copies only the calling thread: a lock another thread held at that moment (a key's
# lock for the length of a compile, a cache's table lock, the fallback lock) stays locked in the
# child for ever, and the child's first lookup of that key waited for it for ever. The child
# gets new locks (what they guarded is whole: every change under them is a few bytecodes, or a
# file published by rename).
_instances: weakref.WeakSet[BinaryCache] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    global _fallback_lock
    _fallback_lock = threading.Lock()
    for cache in list(_instances):
        cache._lock = threading.Lock()
        cache._key_locks = {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
