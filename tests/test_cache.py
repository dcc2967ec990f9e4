"""The compile cache refuses what it cannot trust: every failure mode is rebuilt or refused.

Damaged entries are never loaded in this process: a truncated shared library that is
mapped can kill the process with SIGBUS, so each test checks the bytes before any
``ctypes.CDLL``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from forking import exit_code

from polyjit.backends.cpu.compiler import build_shared
from polyjit.core import cache as cache_mod
from polyjit.core.cache import HASH_SUFFIX, BinaryCache, CacheDirWarning, cache_dir, content_key
from polyjit.core.errors import CompileError

ROOT = Path(__file__).resolve().parents[1]
OTHER_UID = 65534  # nobody
needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to chown"
)


# Keys of the form content_key makes (the only form a BinaryCache takes).
K, K1, KA, KB, KSAME, KTAKEN = (content_key(n) for n in ("k", "k1", "a", "b", "samekey", "taken"))


def _source(value: int) -> str:
    return f"int answer(void) {{ return {value}; }}\n"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sidecar(path: Path) -> Path:
    return Path(f"{path}{HASH_SUFFIX}")


def _assert_verified(path: Path) -> bytes:
    """The entry's bytes match its sidecar (checked before anything loads it)."""
    data = path.read_bytes()
    assert data, f"{path} is empty"
    assert _sidecar(path).read_text() == f"{_sha(data)}  {path.name}\n"
    return data


def _writer(data: bytes, calls: list[int] | None = None) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        if calls is not None:
            calls.append(1)
        out.write_bytes(data)

    return build


def _counts(entries: int, size: int, **more: int) -> dict[str, int]:
    """A namespace's counts as cache_info gives them: the others are 0 unless given."""
    return {"entries": entries, "bytes": size, "orphans": 0, "orphan_bytes": 0, "temporary": 0,
            "temporary_bytes": 0, **more}


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = tmp_path / "cache"
    monkeypatch.setenv("POLYJIT_CACHE_DIR", str(root))
    yield root


def _assert_private_fallback(refused: Path) -> Path:
    used = cache_dir()
    assert not used.is_relative_to(refused)
    st = os.stat(used)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    return used


# -- damaged entries ---------------------------------------------------------------------


def test_truncated_library_is_rebuilt_not_loaded(cache_root: Path) -> None:
    cache = BinaryCache("cpu", ".so")
    path = build_shared(_source(41), cache=cache)
    good = _assert_verified(path)
    assert cache.compiles == 1

    # The same cache object: its memory layer must notice the file changed.
    os.truncate(path, len(good) // 2)
    again = build_shared(_source(41), cache=cache)
    assert cache.compiles == 2
    assert len(_assert_verified(again)) == len(good)

    # Another process (a fresh cache object) over a truncated file.
    os.truncate(again, 100)
    fresh = BinaryCache("cpu", ".so")
    third = build_shared(_source(41), cache=fresh)
    assert fresh.compiles == 1
    _assert_verified(third)
    assert ctypes.CDLL(str(third)).answer() == 41


def test_empty_entry_is_rebuilt_even_with_a_matching_hash(cache_root: Path) -> None:
    cache = BinaryCache("t", ".bin")
    assert cache.get_or_build_bytes(K1, _writer(b"payload")) == b"payload"
    path = cache.path_for(K1)
    path.write_bytes(b"")
    _sidecar(path).write_text(f"{_sha(b'')}  {path.name}\n")
    fresh = BinaryCache("t", ".bin")
    assert fresh.get_or_build(path.stem, _writer(b"payload")) == path
    assert fresh.compiles == 1 and _assert_verified(path) == b"payload"


def test_swapped_entry_is_rebuilt(cache_root: Path) -> None:
    cache = BinaryCache("cpu", ".so")
    one = build_shared(_source(1), cache=cache)
    two = build_shared(_source(2), cache=cache)
    one.write_bytes(two.read_bytes())  # a valid library, but another entry's
    fresh = BinaryCache("cpu", ".so")
    got = build_shared(_source(1), cache=fresh)
    assert got == one and fresh.compiles == 1
    _assert_verified(got)
    assert ctypes.CDLL(str(got)).answer() == 1


def test_entry_swapped_with_its_hash_is_rebuilt(cache_root: Path) -> None:
    cache = BinaryCache("t", ".bin")
    cache.put(KA, b"entry a")
    cache.put(KB, b"entry b")
    a, b = cache.path_for(KA), cache.path_for(KB)
    a.write_bytes(b.read_bytes())
    _sidecar(a).write_bytes(_sidecar(b).read_bytes())  # hash and bytes agree, but name b
    fresh = BinaryCache("t", ".bin")
    assert fresh.get_or_build_bytes(KA, _writer(b"entry a")) == b"entry a"
    assert fresh.compiles == 1


def test_planted_entry_without_a_hash_is_not_loaded(cache_root: Path) -> None:
    cache = BinaryCache("cpu", ".so")
    evil = build_shared(_source(666), cache=BinaryCache("evil", ".so"))
    key_path = build_shared(_source(7), cache=cache)
    key_path.write_bytes(evil.read_bytes())
    _sidecar(key_path).unlink()
    fresh = BinaryCache("cpu", ".so")
    got = build_shared(_source(7), cache=fresh)
    assert fresh.compiles == 1
    _assert_verified(got)
    assert ctypes.CDLL(str(got)).answer() == 7


def test_planted_entry_with_a_forged_wrong_hash_is_rebuilt(cache_root: Path) -> None:
    cache = BinaryCache("t", ".bin")
    path = cache.path_for(K)
    path.write_bytes(b"planted")
    _sidecar(path).write_text(f"{_sha(b'something else')}  {path.name}\n")
    assert cache.get_or_build_bytes(K, _writer(b"genuine")) == b"genuine"
    assert cache.compiles == 1 and _assert_verified(path) == b"genuine"


@needs_root
def test_entry_owned_by_another_user_is_rebuilt(cache_root: Path) -> None:
    cache = BinaryCache("t", ".bin")
    path = cache.put(K, b"theirs")
    os.chown(path, OTHER_UID, OTHER_UID)  # its hash matches; its owner does not
    fresh = BinaryCache("t", ".bin")
    assert fresh.get_or_build_bytes(K, _writer(b"ours")) == b"ours"
    assert fresh.compiles == 1 and os.stat(path).st_uid == os.geteuid()


def test_group_writable_entry_is_rebuilt(cache_root: Path) -> None:
    cache = BinaryCache("t", ".bin")
    path = cache.put(K, b"old")
    path.chmod(0o666)
    assert cache.get_or_build_bytes(K, _writer(b"new")) == b"new"
    assert cache.compiles == 1 and not _mode(path) & 0o022


def test_symlinked_entry_is_rebuilt(cache_root: Path, tmp_path: Path) -> None:
    cache = BinaryCache("t", ".bin")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"elsewhere")
    path = cache.path_for(K)
    path.symlink_to(outside)
    _sidecar(path).write_text(f"{_sha(b'elsewhere')}  {path.name}\n")
    assert cache.get_or_build_bytes(K, _writer(b"real")) == b"real"
    assert not path.is_symlink() and outside.read_bytes() == b"elsewhere"


_FIFO_CHILD = textwrap.dedent(
    """
    import ctypes
    from polyjit.backends.cpu.compiler import build_shared
    print(ctypes.CDLL(str(build_shared("int answer(void) { return 7; }\\n"))).answer(), flush=True)
    """
)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
@pytest.mark.parametrize("planted", ["entry", "sidecar"])
def test_fifo_in_place_of_an_entry_or_its_hash_is_rebuilt_not_waited_on(cache_root: Path, planted: str) -> None:
    """A FIFO where a file should be: a blocking open waited forever for a writer before
    fstat could refuse it. The compile (in a child, with a deadline) must rebuild instead."""
    path = build_shared(_source(7))
    target = path if planted == "entry" else _sidecar(path)
    target.unlink()
    os.mkfifo(target, 0o600)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        child = subprocess.run([sys.executable, "-c", _FIFO_CHILD], env=env, text=True,
                               capture_output=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the compile hung on the FIFO planted as the {planted}")
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "7"
    assert stat.S_ISREG(os.lstat(target).st_mode)
    _assert_verified(path)


def test_memory_layer_skips_rehash_but_notices_replacement(
    cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cache_mod, "_UNCHANGED_AFTER_NS", 0)  # nanosecond timestamps (ext4, tmpfs)
    cache = BinaryCache("t", ".bin")
    path = cache.get_or_build(K, _writer(b"AAAA"))
    checks: list[Path] = []
    real = cache_mod._verified

    def counting(p: Path) -> tuple[bytes, cache_mod._Ident, int] | None:
        checks.append(p)
        return real(p)

    monkeypatch.setattr(cache_mod, "_verified", counting)
    assert cache.get_or_build(K, _writer(b"AAAA")) == path
    assert checks == [path]  # written, not yet read back: hashed
    assert cache.get_or_build(K, _writer(b"AAAA")) == path
    assert checks == [path]  # verified by this process and unchanged since: not hashed again

    # Rewritten in place, same size, mtime put back: the ctime still tells.
    st = os.stat(path)
    path.write_bytes(b"BBBB")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert cache.get_or_build(K, _writer(b"AAAA")) == path
    assert checks[1:] and set(checks) == {path} and cache.compiles == 2 and path.read_bytes() == b"AAAA"


def test_a_rewrite_in_the_same_second_is_noticed_on_a_one_second_file_system(
    cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: on a file system with one-second timestamps (ext4 with 128-byte inodes,
    ext3, FAT, many NFS servers) a same-size rewrite in the same second keeps every part of
    the identity, and get_or_build returned the rewritten file unhashed (300 of 300). A file
    changed less than _UNCHANGED_AFTER_NS before it was verified is hashed again when used."""
    real = cache_mod._ident

    def one_second(st: os.stat_result) -> cache_mod._Ident:  # what such a file system reports
        i = real(st)
        return i._replace(mtime_ns=i.mtime_ns // 10**9 * 10**9, ctime_ns=i.ctime_ns // 10**9 * 10**9)

    monkeypatch.setattr(cache_mod, "_ident", one_second)
    cache = BinaryCache("t", ".bin")
    path = cache.get_or_build(K, _writer(b"AAAA"))
    assert cache.get_or_build(K, _writer(b"AAAA")) == path  # read back and verified
    path.write_bytes(b"BBBB")  # the same size, almost surely in the same second
    assert cache.get_or_build(K, _writer(b"AAAA")) == path
    assert cache.compiles == 2 and path.read_bytes() == b"AAAA"


def test_put_publishes_with_a_hash(cache_root: Path) -> None:
    cache = BinaryCache("t", ".bin")
    path = cache.put(K, b"given")
    assert _assert_verified(path) == b"given"
    assert BinaryCache("t", ".bin").get_or_build_bytes(K, _writer(b"never")) == b"given"
    cache.put(K, b"replaced")
    assert cache.get_or_build_bytes(K, _writer(b"never")) == b"replaced"
    assert cache.compiles == 0
    with pytest.raises(ValueError):
        cache.put(K, b"")
    with pytest.raises(ValueError):
        cache.put("../escape", b"x")


def test_failed_build_publishes_nothing(cache_root: Path) -> None:
    cache = BinaryCache("t", ".bin")

    def failing(out: Path) -> None:
        out.write_bytes(b"half")
        raise RuntimeError("compiler exploded")

    with pytest.raises(RuntimeError, match="exploded"):
        cache.get_or_build(K, failing)
    assert list(cache.path_for(K).parent.iterdir()) == []


# -- directories ---------------------------------------------------------------------------


def test_directories_are_created_private(cache_root: Path) -> None:
    old = os.umask(0)  # even a permissive umask gives 0700
    try:
        cache = BinaryCache("cpu", ".so")
        path = build_shared(_source(3), cache=cache)
    finally:
        os.umask(old)
    assert path.parent == cache_root / "cpu"
    assert _mode(cache_root) == 0o700 and _mode(cache_root / "cpu") == 0o700
    assert not _mode(path) & 0o022 and not _mode(_sidecar(path)) & 0o077


def test_world_writable_cache_dir_is_refused(cache_root: Path) -> None:
    cache_root.mkdir()
    cache_root.chmod(0o777)
    cache = BinaryCache("t", ".bin")
    with pytest.warns(CacheDirWarning, match="writable by group and others"):
        path = cache.get_or_build(K, _writer(b"data"))
    used = _assert_private_fallback(cache_root)
    assert path.parent == used / "t" and _mode(path.parent) == 0o700
    assert list(cache_root.iterdir()) == []


def test_group_writable_namespace_dir_is_refused(cache_root: Path) -> None:
    (cache_root / "t").mkdir(parents=True)
    (cache_root / "t").chmod(0o770)
    cache_root.chmod(0o700)
    cache = BinaryCache("t", ".bin")
    with pytest.warns(CacheDirWarning, match="writable by group"):
        path = cache.get_or_build(K, _writer(b"data"))
    assert not path.is_relative_to(cache_root) and _mode(path.parent) == 0o700
    assert list((cache_root / "t").iterdir()) == []


@needs_root
def test_cache_dir_owned_by_another_user_is_refused(cache_root: Path) -> None:
    cache_root.mkdir(mode=0o700)
    os.chown(cache_root, OTHER_UID, OTHER_UID)
    with pytest.warns(CacheDirWarning, match=f"owned by uid {OTHER_UID}"):
        path = BinaryCache("t", ".bin").get_or_build(K, _writer(b"data"))
    assert not path.is_relative_to(cache_root)
    _assert_private_fallback(cache_root)


@needs_root
def test_namespace_dir_owned_by_another_user_is_refused(cache_root: Path) -> None:
    (cache_root / "t").mkdir(parents=True, mode=0o700)
    os.chown(cache_root / "t", OTHER_UID, OTHER_UID)
    with pytest.warns(CacheDirWarning, match=f"owned by uid {OTHER_UID}"):
        path = BinaryCache("t", ".bin").get_or_build(K, _writer(b"data"))
    assert not path.is_relative_to(cache_root)


@needs_root
def test_a_symlink_planted_by_another_user_is_not_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A link in a shared place that names the cache root, owned by someone else, could point
    it at this user's home (Python's realpath does not apply fs.protected_symlinks)."""
    home = tmp_path / "home"
    (home / "notes").mkdir(parents=True, mode=0o700)
    (home / "notes" / "thesis.tex").write_text("years of work")
    planted = tmp_path / "planted"
    planted.symlink_to(home)
    os.lchown(planted, OTHER_UID, OTHER_UID)
    monkeypatch.setenv("POLYJIT_CACHE_DIR", str(planted))
    with pytest.warns(CacheDirWarning, match=f"symbolic link owned by uid {OTHER_UID}"):
        _assert_private_fallback(home)
    assert (home / "notes" / "thesis.tex").read_text() == "years of work"


def test_clear_removes_only_what_the_cache_wrote(cache_root: Path, tmp_path: Path) -> None:
    """A root that holds other files (a mistake, a shared directory), a namespace that is a
    link out of it: `polyjit cache clear` removes entries, their hashes and its temporary
    files, and nothing else (it used to remove every file one level down, through links)."""
    BinaryCache("t", ".bin").get_or_build(K, _writer(b"data"))
    (cache_root / "project").mkdir()
    (cache_root / "project" / "main.py").write_text("print()")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep")
    (outside / f"{K}.bin").write_bytes(b"theirs")
    (outside / f"{K}.bin.sha256").write_bytes(b"theirs")
    (cache_root / "linked").symlink_to(outside)
    with open(cache_root / cache_mod.NAMESPACES_FILE, "a") as f:
        f.write("linked\n")  # listed, but a link: never followed
    (cache_root / "t" / "notes.txt").write_text("mine")
    tmp_file = cache_root / "t" / f".{'a' * 40}.bin.x7k2_abc.bin"
    tmp_file.write_bytes(b"half written")
    os.utime(tmp_file, (time.time() - 2 * cache_mod.TEMPORARY_AGE,) * 2)  # left by a killed process
    assert cache_mod.cache_info()["namespaces"] == {"t": _counts(1, 4, temporary=1, temporary_bytes=12)}
    assert cache_mod.cache_clear() == 1
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == [f"cache/{cache_mod.NAMESPACES_FILE}", "cache/project/main.py", "cache/t/notes.txt",
                    f"outside/{K}.bin", f"outside/{K}.bin.sha256", "outside/precious.txt"]


def test_clear_in_a_root_that_holds_the_users_files_removes_only_real_entries(cache_root: Path) -> None:
    """Found by review: with POLYJIT_CACHE_DIR pointed at a directory that holds other files (the
    docs allow it), `cache clear` took every subdirectory for a namespace and removed any file
    X with an X.sha256 beside it (an ISO and its checksum) and any dotfile ending in a dot and
    8 letters or digits (`.gitignore.template`, `.bashrc.20240101`). It removes only names of the
    form the cache writes (a 40-hex key), in the namespaces it made, and `cache info` shows
    only those namespaces."""
    users = {
        "Downloads/debian-12.5.0-amd64-netinst.iso": b"iso",
        "Downloads/debian-12.5.0-amd64-netinst.iso.sha256": b"checksum",
        f"Downloads/{K}.bin": b"a file named like an entry, outside any namespace",
        f"Downloads/{K}.bin.sha256": b"its checksum",
        f"Downloads/.{K}.bin.abcdefgh.bin": b"named like a temporary file",
        "project/.gitignore.template": b"*.o",
        "project/.bashrc.20240101": b"alias",
        "project/.config.backup01.json": b"{}",
        "deep/sub/x.iso": b"iso",
        "deep/sub/x.iso.sha256": b"checksum",
        "cpu/notes.iso": b"the user's own files in a directory named like a namespace",
        "cpu/notes.iso.sha256": b"checksum",
        "t/.gitignore.template": b"*.o",
        "t/.bashrc.20240101": b"alias",
        "t/release.tar.gz": b"tarball",
        "t/release.tar.gz.sha256": b"checksum",
        "debian.iso": b"iso",
        "debian.iso.sha256": b"checksum",
        ".bashrc.20240101": b"alias",
    }
    for name, data in users.items():
        (cache_root / name).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        (cache_root / name).write_bytes(data)
    t, cpu = BinaryCache("t", ".bin"), BinaryCache("cpu", ".so")
    entries = [t.put(K, b"one"), t.put(K1, b"two"), cpu.put(KA, b"three")]
    assert cache_mod.cache_info()["namespaces"] == {"cpu": _counts(1, 5),
                                                    "t": _counts(2, 6)}
    assert cache_mod.cache_clear() == 3
    for name, data in users.items():
        assert (cache_root / name).read_bytes() == data, name
    assert not any(p.exists() or _sidecar(p).exists() for p in entries)
    assert cache_mod.cache_info()["namespaces"] == {"cpu": _counts(0, 0),
                                                    "t": _counts(0, 0)}


def test_a_key_not_of_content_keys_form_is_refused(cache_root: Path) -> None:
    """`cache clear` removes only names of the form the cache writes: so the cache writes no other."""
    cache = BinaryCache("t", ".bin")
    for key in ("k", "A" * 40, "a" * 39, "a" * 41, "../escape"):
        with pytest.raises(ValueError, match="40 lowercase hex"):
            cache.put(key, b"x")


def test_a_handed_over_namespace_on_an_almost_full_disk_goes_to_the_private_directory(
        cache_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: PoCL's LLVM aborts the whole process (SIGABRT) when its cache's disk is
    full; it cannot fall back as polyjit's own writes do. Under HAND_OVER_MIN_ROOM free, its
    cache goes to this process's private directory, with a warning."""
    monkeypatch.setattr(cache_mod, "_free_bytes", lambda directory: 3 << 20 if directory.is_relative_to(cache_root)
                        else 1 << 30)  # the private directory elsewhere, with room
    with pytest.warns(CacheDirWarning, match=r"3 MiB free on its file system, under 64 MiB for pocl"):
        handed = cache_mod.hand_over(cache_mod.POCL_NAMESPACE)
    assert not handed.is_relative_to(cache_root) and handed.name == "pocl" and handed.is_dir()
    assert stat.S_IMODE(os.stat(handed.parent).st_mode) == 0o700
    monkeypatch.setattr(cache_mod, "_free_bytes", lambda directory: 1 << 30)
    assert cache_mod.hand_over(cache_mod.POCL_NAMESPACE) == cache_root / "pocl"  # room again: its own place


def test_no_room_anywhere_for_pocls_cache_is_an_opencl_without_devices(
        cache_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the second review: the private directory (in $TMPDIR) is often on the same full
    disk, and PoCL aborted there too. With no room anywhere, hand_over raises NoRoomError, and
    OpenCL reports no devices, with the reason, instead of starting PoCL."""
    from polyjit.backends.opencl import platforms

    monkeypatch.setattr(cache_mod, "_free_bytes", lambda directory: 1 << 20)
    monkeypatch.delenv(platforms.POCL_CACHE_ENV, raising=False)
    with pytest.warns(CacheDirWarning), pytest.raises(cache_mod.NoRoomError, match="no room for pocl's own cache"):
        cache_mod.hand_over(cache_mod.POCL_NAMESPACE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheDirWarning)  # said once above
        reason = platforms._private_pocl_cache()
    assert reason is not None and "1 MiB free" in reason
    assert platforms.POCL_CACHE_ENV not in os.environ


def test_no_room_in_the_private_directory_the_root_fell_back_to(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the third review: where the root was refused, the cache lives in the private
    directory already, and its room went unchecked: PoCL got a full disk."""
    refused = tmp_path / "open_to_all"
    refused.mkdir()
    refused.chmod(0o777)
    monkeypatch.setenv("POLYJIT_CACHE_DIR", str(refused))
    monkeypatch.setattr(cache_mod, "_free_bytes", lambda directory: 1 << 20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheDirWarning)  # the refused root
        with pytest.raises(cache_mod.NoRoomError, match="no room for pocl's own cache"):
            cache_mod.hand_over(cache_mod.POCL_NAMESPACE)


def test_clear_empties_the_namespace_handed_to_pocl_and_follows_no_link(cache_root: Path, tmp_path: Path) -> None:
    """PoCL fills `<root>/pocl` its own way (a directory per program): `cache info` counts
    its files and `cache clear` removes them (it used to leave PoCL's native code behind),
    removing links in it without following them."""
    assert cache_mod.hand_over(cache_mod.POCL_NAMESPACE) == cache_root / "pocl"  # as platforms.py does
    program = cache_root / cache_mod.POCL_NAMESPACE / "LG" / "HCGHGPMEMOIF"
    program.mkdir(parents=True)
    (program / "program.bc").write_bytes(b"bitcode")
    (program / "last_accessed").write_bytes(b"")
    (cache_root / "pocl" / "tempfile_Ea6xgD").write_bytes(b"12")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep")
    (program / "linked").symlink_to(outside)
    (cache_root / "pocl" / "file_link").symlink_to(outside / "precious.txt")
    assert cache_mod.cache_info()["namespaces"] == {"pocl": _counts(3, 9)}
    assert cache_mod.cache_clear() == 3
    # the marker stays: a running process's PoCL may still write there
    assert [p.name for p in (cache_root / "pocl").iterdir()] == [cache_mod.HANDED_OVER_MARKER]
    assert (outside / "precious.txt").read_text() == "keep"


def test_clear_leaves_a_pocl_directory_polyjit_never_handed_over(
    cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With POCL_CACHE_DIR set elsewhere polyjit never gives `<root>/pocl` to PoCL, so what
    is there is the user's: `cache clear` emptied it all the same (found by review)."""
    from polyjit.backends.opencl import platforms

    (cache_root / "pocl" / "src").mkdir(parents=True)
    (cache_root / "pocl" / "src" / "important.c").write_text("int main(void) { return 0; }\n")
    (cache_root / "pocl" / "README").write_text("my checkout of pocl\n")
    monkeypatch.setenv("POCL_CACHE_DIR", str(cache_root.parent / "pocl_elsewhere"))
    platforms._private_pocl_cache()  # the user chose PoCL's place: nothing handed over
    assert os.environ["POCL_CACHE_DIR"] == str(cache_root.parent / "pocl_elsewhere")
    assert cache_mod.cache_info()["namespaces"] == {"pocl": _counts(0, 0)}
    assert cache_mod.cache_clear() == 0
    assert (cache_root / "pocl" / "src" / "important.c").exists()
    assert (cache_root / "pocl" / "README").exists()

    # Handing it over later gives it to PoCL, what is in it too (an earlier polyjit's
    # hand-over left PoCL's files there unmarked: `cache clear` clears them after an upgrade).
    monkeypatch.delenv("POCL_CACHE_DIR")
    platforms._private_pocl_cache()
    assert os.environ["POCL_CACHE_DIR"] == str(cache_root / "pocl")
    assert (cache_root / "pocl" / cache_mod.HANDED_OVER_MARKER).exists()
    assert cache_mod.cache_clear() == 2


def test_clear_empties_the_pocl_directory_polyjit_handed_over(
    cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real hand-over (POCL_CACHE_DIR unset): the directory is marked, and cleared."""
    from polyjit.backends.opencl import platforms

    monkeypatch.delenv("POCL_CACHE_DIR", raising=False)
    platforms._private_pocl_cache()
    assert os.environ["POCL_CACHE_DIR"] == str(cache_root / "pocl")
    kernel = cache_root / "pocl" / "AB" / "CDEF"
    kernel.mkdir(parents=True)
    (kernel / "program.so").write_bytes(b"native")
    assert cache_mod.cache_info()["namespaces"] == {"pocl": _counts(1, 6)}
    assert cache_mod.cache_clear() == 1
    assert not (cache_root / "pocl" / "AB").exists()


def test_ancestor_writable_by_others_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # no sticky bit: anyone may rename our directory away
    monkeypatch.setenv("POLYJIT_CACHE_DIR", str(shared / "mine"))
    with pytest.warns(CacheDirWarning, match="ancestor"):
        _assert_private_fallback(shared)


def test_cache_dir_that_is_a_file_falls_back(cache_root: Path) -> None:
    cache_root.write_text("not a directory")
    with pytest.warns(CacheDirWarning, match="not a directory|cannot be created"):
        data = BinaryCache("t", ".bin").get_or_build_bytes(K, _writer(b"data"))
    assert data == b"data"
    _assert_private_fallback(cache_root)


def test_unwritable_cache_dir_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("POLYJIT_CACHE_DIR", str(blocker / "sub" / "cache"))
    cache = BinaryCache("cpu", ".so")
    with pytest.warns(CacheDirWarning, match="cannot be created"):
        path = build_shared(_source(5), cache=cache)
    _assert_verified(path)
    assert ctypes.CDLL(str(path)).answer() == 5
    _assert_private_fallback(blocker)


def test_entry_name_taken_by_a_directory_falls_back(cache_root: Path) -> None:
    cache = BinaryCache("t", ".bin")
    cache.path_for(K).mkdir()
    with pytest.warns(CacheDirWarning, match="cannot be replaced"):
        assert cache.get_or_build_bytes(K, _writer(b"data")) == b"data"


def _full_below(root: Path, code: int, data: bytes, calls: list[Path]) -> Callable[[Path], None]:
    """A build that fails with errno code while it writes under root, as on a full disk."""
    def build(out: Path) -> None:
        calls.append(out)
        if out.is_relative_to(root):
            out.write_bytes(data[:1])  # a partial write, then the error
            raise OSError(code, os.strerror(code), str(out))
        out.write_bytes(data)

    return build


_NO_ROOM = [code for code in (errno.ENOSPC, getattr(errno, "EDQUOT", None), errno.EROFS, errno.EACCES) if code]


@pytest.mark.parametrize("code", _NO_ROOM, ids=errno.errorcode.get)
def test_no_room_under_the_cache_root_builds_in_the_private_directory(cache_root: Path, code: int) -> None:
    """ENOSPC (EDQUOT, EROFS, EACCES) while an entry is built went to the caller, so a full
    disk under the root made the backend unusable; the build moves to the private directory."""
    cache = BinaryCache("t", ".bin")
    calls: list[Path] = []
    with pytest.warns(CacheDirWarning, match="builds cannot be written there"):
        path = cache.get_or_build(K, _full_below(cache_root, code, b"data", calls))
    assert path.read_bytes() == b"data" and not path.is_relative_to(cache_root)
    _assert_verified(path)
    assert [p.is_relative_to(cache_root) for p in calls] == [True, False]
    # The build is kept there: found again without building, bytes checked as ever.
    assert cache.get_or_build_bytes(K, _full_below(cache_root, code, b"data", calls)) == b"data"
    assert cache.get_or_build(K, _full_below(cache_root, code, b"data", calls)) == path
    assert len(calls) == 2 and cache.compiles == 1
    assert [p.name for p in (cache_root / "t").iterdir()] == []  # nothing half written left


def test_put_on_a_full_disk_publishes_in_the_private_directory(
    cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = BinaryCache("t", ".bin")
    cache.directory()
    real = Path.write_bytes

    def full(self: Path, data: bytes) -> int:
        if self.is_relative_to(cache_root):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.warns(CacheDirWarning, match="No space left"):
        path = cache.put(K, b"data")
    assert not path.is_relative_to(cache_root)
    assert _assert_verified(path) == b"data"


def test_compiler_out_of_room_builds_in_the_private_directory(
    cache_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiler, a child process, reports ENOSPC only in its log: the CPU build is
    retried in the private directory and the library works."""
    cc = tmp_path / "cc"
    cc.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        for a in "$@"; do case "$a" in {cache_root}/*.so)
            echo "/usr/bin/ld: final link failed: No space left on device" >&2; exit 1;; esac; done
        exec {os.environ.get("CC", "cc")} "$@"
        """))
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    cache = BinaryCache("cpu", ".so")
    with pytest.warns(CacheDirWarning, match="No space left on device"):
        path = build_shared(_source(11), cache=cache)
    assert not path.is_relative_to(cache_root)
    _assert_verified(path)
    assert ctypes.CDLL(str(path)).answer() == 11 and cache.compiles == 1


def test_a_real_compile_error_is_not_retried(cache_root: Path) -> None:
    cache = BinaryCache("t", ".bin")
    calls: list[Path] = []

    def bad(out: Path) -> None:
        calls.append(out)
        raise CompileError("C compiler failed: error: expected ';'", log="error: expected ';'")

    with pytest.raises(CompileError):
        cache.get_or_build(K, bad)
    assert len(calls) == 1


def test_a_compile_error_that_says_permission_denied_is_not_taken_for_no_room(cache_root: Path) -> None:
    """Found by review of the fallback: an ``#error Permission denied`` in a kernel's source
    (GCC echoes it in its log) warned that the cache could not be written, built a second
    time in the private directory and, there, turned into a CacheError."""
    import warnings

    cache = BinaryCache("t", ".bin")
    calls: list[Path] = []

    def bad(out: Path) -> None:
        calls.append(out)
        log = "k.c:1:2: error: #error Permission denied (the user's own words)\n    1 | #error Permission denied"
        raise CompileError("C compiler failed", log=log)

    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheDirWarning)
        with pytest.raises(CompileError):
            cache.get_or_build(K, bad)
    assert len(calls) == 1


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or not sys.platform.startswith("linux"):
        pytest.skip("mounting a small tmpfs needs root on Linux")
    mount = tmp_path / "full"
    mount.mkdir(mode=0o700)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k,mode=0700", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_compile_on_a_really_full_file_system(tiny_tmpfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reviewer's case: a cache root on a full tmpfs. The compile falls back and works."""
    monkeypatch.setenv("POLYJIT_CACHE_DIR", str(tiny_tmpfs))
    cache = BinaryCache("cpu", ".so")
    cache.directory()
    with open(tiny_tmpfs / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)
    with pytest.warns(CacheDirWarning, match="builds cannot be written there"):
        path = build_shared(_source(13), cache=cache)
    assert not path.is_relative_to(tiny_tmpfs)
    _assert_verified(path)
    assert ctypes.CDLL(str(path)).answer() == 13


# -- concurrency ---------------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import hashlib, os, sys, time
    from pathlib import Path
    from polyjit.core.cache import BinaryCache, content_key
    go = Path(sys.argv[1])
    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.005)
    def build(out):
        time.sleep(0.05)
        out.write_bytes(bytes(range(256)) * 64)
    data = BinaryCache("conc", ".bin").get_or_build_bytes(content_key("samekey"), build)
    print(hashlib.sha256(data).hexdigest(), flush=True)
    """
)


def test_concurrent_threads_and_processes_get_identical_verified_bytes(
    cache_root: Path, tmp_path: Path
) -> None:
    payload = bytes(range(256)) * 64
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    children = [
        subprocess.Popen([sys.executable, "-c", _CHILD, str(go)], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    for child in children:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"

    cache = BinaryCache("conc", ".bin")
    results: list[bytes] = []
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def build(out: Path) -> None:
        time.sleep(0.05)
        out.write_bytes(payload)

    def worker() -> None:
        try:
            start.wait()
            results.append(cache.get_or_build_bytes(KSAME, build))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    go.touch()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    outs = [child.communicate(timeout=60) for child in children]
    assert errors == []
    assert [child.returncode for child in children] == [0, 0], [err for _, err in outs]
    assert results == [payload] * 8 and cache.compiles <= 1
    assert [out.strip() for out, _ in outs] == [_sha(payload)] * 2
    assert _assert_verified(cache.path_for(KSAME)) == payload
    leftovers = [p.name for p in (cache_root / "conc").iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_what_a_cache_remembers_in_memory_is_bounded(cache_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: a cache kept a verified record (700 bytes) and a lock for every key it
    ever built, for the life of the process. It keeps the newest MEMORY_RECORDS records, a key's
    lock only while a thread uses it, and a key whose record went is verified again, not rebuilt."""
    monkeypatch.setattr(cache_mod, "MEMORY_RECORDS", 8)
    cache = BinaryCache("bounded", ".bin")
    calls: list[int] = []
    for k in range(40):
        cache.get_or_build(content_key(f"key{k}"), _writer(f"entry {k}".encode(), calls))
    assert len(calls) == 40 and len(cache._memory) == 8 and not cache._key_locks
    assert cache.get_or_build_bytes(content_key("key0"), _writer(b"rebuilt", calls)) == b"entry 0"
    assert len(calls) == 40
    # An entry the shared directory could not take lives in the private fallback, which only
    # its record leads to: that record stays (evicted, the entry was built again).
    cache.path_for(KTAKEN).mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheDirWarning)
        cache.get_or_build(KTAKEN, _writer(b"private", calls))
    for k in range(40, 60):
        cache.get_or_build(content_key(f"key{k}"), _writer(f"entry {k}".encode(), calls))
    assert cache.get_or_build_bytes(KTAKEN, _writer(b"rebuilt", calls)) == b"private"
    assert len(calls) == 61 and len(cache._memory) == 8


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_child_forked_while_another_thread_compiles_does_not_hang(cache_root: Path) -> None:
    """Found by review: os.fork() copies only the calling thread, so the key's lock that another
    thread held for its compile stayed locked in the child, and the child's first lookup of that
    key (the cpu backend's compile) waited for ever. The child gets new locks."""
    cache = BinaryCache("t", ".bin")
    inside, done = threading.Event(), threading.Event()

    def slow(out: Path) -> None:
        inside.set()
        done.wait(60)
        out.write_bytes(b"parent")

    builder = threading.Thread(target=cache.get_or_build_bytes, args=(K, slow))
    builder.start()
    try:
        assert inside.wait(30)
        with cache_mod._fallback_lock:  # as another thread would hold it, at the moment of the fork
            pid = os.fork()
            if pid == 0:  # the child: the same key (its lock held by the parent's thread), then another
                code = 1
                try:
                    same = cache.get_or_build_bytes(K, _writer(b"child"))
                    other = cache.get_or_build_bytes(K1, _writer(b"other"))
                    with cache_mod._fallback_lock:  # _warn's and _fallback_root's
                        pass
                    code = 0 if (same, other) == (b"child", b"other") else 2
                finally:
                    os._exit(code)
        # the parent's compile goes on until the child is done
        code = exit_code(pid, "on a lock its parent's thread held")
    finally:
        done.set()
        builder.join()
    assert code == 0
    assert not cache._key_locks


_HUGE_CHILD = textwrap.dedent(
    """
    import hashlib, os, resource, sys, time
    from polyjit.core.cache import BinaryCache
    key, size = sys.argv[1], int(sys.argv[2])
    cache = BinaryCache("t", ".bin")
    path = cache.path_for(key)
    with open(path, "wb") as f:
        f.truncate(size)  # sparse: no disk space, but a read of it allocates it all
    with open(f"{path}.sha256", "w") as f:
        f.write(f"{hashlib.sha256(b'').hexdigest()}  {path.name}\\n")  # well-formed, whatever it says
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20),) * 2)  # 512 MiB more than now
    start = time.monotonic()
    data = cache.get_or_build_bytes(key, lambda out: out.write_bytes(b"rebuilt"))
    print(data.decode(), os.path.getsize(path), cache.compiles, round(time.monotonic() - start, 1))
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmSize from /proc")
def test_a_huge_entry_is_refused_before_it_is_read(cache_root: Path) -> None:
    """Found by review: a huge (sparse) entry with a well-formed hash beside it was read whole
    into memory before the hash refused it (2 GiB: 12 s and 2.1 GB of memory per process; 64 GiB:
    a MemoryError, PoolExhaustedError through a backend, on every run, the entry never replaced).
    An entry over MAX_ENTRY_BYTES is refused by its size and rebuilt, in a process that may not
    allocate 512 MiB more."""
    size = 4 << 30  # over MAX_ENTRY_BYTES (1 GiB)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.run([sys.executable, "-c", _HUGE_CHILD, K, str(size)], env=env, text=True,
                           capture_output=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    data, on_disk, compiles, seconds = child.stdout.split()
    assert (data, int(on_disk), int(compiles)) == ("rebuilt", len(b"rebuilt"), 1)
    assert float(seconds) < 10


def test_entries_over_the_limit_are_rebuilt_and_not_published(
    cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cache_mod, "MAX_ENTRY_BYTES", 100)
    cache = BinaryCache("t", ".bin")
    big = bytes(101)
    path = cache.path_for(K)
    path.write_bytes(big)
    _sidecar(path).write_text(f"{_sha(big)}  {path.name}\n")  # the right hash: refused by size alone
    assert cache.get_or_build_bytes(K, _writer(bytes(100))) == bytes(100) and cache.compiles == 1
    with pytest.raises(ValueError, match="MAX_ENTRY_BYTES"):
        cache.put(K1, big)
    with pytest.raises(cache_mod.CacheError, match="over the cache's limit"):
        cache.get_or_build_bytes(K1, _writer(big))
    assert not cache.path_for(K1).exists()


_FSIZE_CHILD = textwrap.dedent(
    """
    import resource, sys, warnings
    from polyjit.core.cache import BinaryCache, CacheDirWarning
    cache = BinaryCache("t", ".bin")
    cache.directory()
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))  # `ulimit -f 4`
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        try:
            cache.put(sys.argv[1], bytes(10000))
        except BaseException as e:
            print(type(e).__name__, isinstance(e, OSError), e)
    print(*(str(w.message) for w in warned if issubclass(w.category, CacheDirWarning)), sep="\\n")
    """
)


@pytest.mark.skipif(sys.platform == "win32", reason="no RLIMIT_FSIZE")
def test_put_over_the_file_size_limit_is_a_cache_error(cache_root: Path) -> None:
    """Found by review: under RLIMIT_FSIZE (`ulimit -f`) put raised a bare OSError (EFBIG), where
    a full disk falls back to the private directory: EFBIG is handled like a full disk (a warning,
    a try in the private directory), and where that fails too, it is a CacheError."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.run([sys.executable, "-c", _FSIZE_CHILD, K], env=env, text=True,
                           capture_output=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    error, warning = child.stdout.splitlines()[:2]
    assert error.startswith("CacheError True polyjit compile cache: cannot build"), child.stdout
    assert "File too large" in error
    assert "builds cannot be written there (File too large)" in warning
    assert not any(p.name.startswith(f".{K}") for p in (cache_root / "t").iterdir())


def test_a_linker_killed_for_the_file_size_limit_is_out_of_room(tmp_path: Path) -> None:
    log = "collect2: fatal error: ld terminated with signal 25 [File size limit exceeded]"
    reason = cache_mod._no_room(tmp_path, CompileError("C compiler failed", log=log))
    assert reason == "File size limit exceeded"


def test_an_entry_whose_hash_cannot_be_written_is_not_left_behind(cache_root: Path) -> None:
    """Found by review: the binary was published before its hash was written; when that failed
    (no inode left, the hash's name taken) the binary stayed without its hash, for ever (nothing
    trusts it, and `cache clear` did not see it), and the warning said the entry "cannot be
    replaced". The hash is written first and renamed second; if that rename fails, the binary
    is taken back, and the warning says what failed."""
    cache = BinaryCache("t", ".bin")
    path = cache.path_for(K)
    _sidecar(path).mkdir()  # the hash's name taken
    with pytest.warns(CacheDirWarning, match="its hash cannot be written"):
        got = cache.get_or_build_bytes(K, _writer(b"data"))
    assert got == b"data" and not path.exists()
    assert [p.name for p in (cache_root / "t").iterdir()] == [_sidecar(path).name]


def test_info_and_clear_see_orphans(cache_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An entry without its hash (a process killed between the two renames) or a hash without
    its entry: `cache info` counts them, `cache clear` removes them (it saw neither)."""
    cache = BinaryCache("t", ".bin")
    cache.put(K, b"entry")
    orphan = cache.path_for(K1)
    orphan.write_bytes(b"no hash")
    lone = _sidecar(cache.path_for(KA))
    lone.write_text(f"{_sha(b'gone')}  {cache.path_for(KA).name}\n")
    assert cache_mod.cache_info()["namespaces"] == {"t": _counts(1, 5, orphans=2, orphan_bytes=7 + lone.stat().st_size)}
    from polyjit.cli import main

    assert main(["cache", "info"]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert "1 entries" in line and "; 2 orphaned files" in line, line
    assert cache_mod.cache_clear() == 3
    assert list((cache_root / "t").iterdir()) == []


def test_clear_removes_old_temporary_files_and_info_shows_them(cache_root: Path) -> None:
    """Found by review: a process killed mid-compile leaves its temporary files (the build, the
    C source beside it), which `cache info` did not count ("0 entries 0 B"). Info counts them
    with their sizes; clear removes those last written over TEMPORARY_AGE ago, never a younger
    one (a build in progress, which clear used to remove from under its writer)."""
    space = BinaryCache("cpu", ".so").directory()
    stale = {f".{K}.so.a1b2c3d4.so": 1000, f".{K}.so.a1b2c3d4.c": 200, f".{K}.so.sha256.zz_9yy8x": 77}
    live = {f".{K1}.so.e5f6g7h8.so": 3000, f".{K1}.so.e5f6g7h8.c": 300}
    long_ago = time.time() - cache_mod.TEMPORARY_AGE - 60
    for name, size in {**stale, **live}.items():
        (space / name).write_bytes(bytes(size))
        if name in stale:
            os.utime(space / name, (long_ago, long_ago))
    assert cache_mod.cache_info()["namespaces"] == {"cpu": _counts(0, 0, temporary=5, temporary_bytes=4577)}
    assert cache_mod.cache_clear() == 0
    assert sorted(p.name for p in space.iterdir()) == sorted(live)
    assert cache_mod.cache_info()["namespaces"] == {"cpu": _counts(0, 0, temporary=2, temporary_bytes=3300)}


@pytest.mark.skipif(sys.platform != "linux", reason="needs a file system that takes any bytes in a name")
@pytest.mark.parametrize("action", ["info", "clear"])
def test_cache_commands_print_a_path_that_is_not_utf8(tmp_path: Path, action: str) -> None:
    """Found by review: under a strict UTF-8 stdout, a cache directory whose name is not UTF-8
    made `cache info` and `cache clear` (after clearing) end in a UnicodeEncodeError traceback.
    The name is printed with the bytes escaped."""
    root = os.fsdecode(os.fsencode(str(tmp_path)) + b"/bad\xff")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "POLYJIT_CACHE_DIR": root, "PYTHONIOENCODING": "utf-8:strict"}
    made = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from polyjit.core.cache import BinaryCache
        BinaryCache("t", ".bin").put("{K}", b"data")
    """)], env=env, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    proc = subprocess.run([sys.executable, "-m", "polyjit", "cache", action], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "bad\\xff" in proc.stdout, proc.stdout
    assert ("removed 1 entries" if action == "clear" else "1 entries") in proc.stdout
