"""The compile cache's bound: past $POLYJIT_CACHE_MAX_BYTES the least recently used entries go,
and nothing else (a user's files, another program's namespace, an entry used meanwhile)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from polyjit.core import cache as cache_mod
from polyjit.core.cache import HASH_SUFFIX, MAX_BYTES_ENV, BinaryCache, cache_trim, content_key
from polyjit.core.errors import InvalidArgumentError

ENTRY = 1000  # bytes of each test entry; its hash file is 110 more
HOUR_NS = 3600 * 1_000_000_000


@pytest.fixture(autouse=True)
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("POLYJIT_CACHE_DIR", str(root))
    monkeypatch.delenv(MAX_BYTES_ENV, raising=False)
    return root


def _fill(cache: BinaryCache, n: int, first: int = 0) -> list[str]:
    """n entries of ENTRY bytes; the i-th last used i hours after the first (oldest first)."""
    keys = [content_key(f"k{i}") for i in range(first, first + n)]
    start = time.time_ns() - 100 * HOUR_NS
    for i, key in zip(range(first, first + n), keys, strict=True):
        path = cache.path_for(key)
        cache.put(key, bytes([i % 251]) * ENTRY)
        used = start + i * HOUR_NS
        os.utime(f"{path}{HASH_SUFFIX}", ns=(used, used))
        os.utime(path, ns=(used, used))
    return keys


def _left(cache: BinaryCache) -> set[str]:
    return {p.name.removesuffix(cache.suffix) for p in cache.directory().glob(f"*{cache.suffix}")
            if not p.name.startswith(".")}  # not temporary files


def test_a_trim_removes_the_least_recently_used_down_to_four_fifths() -> None:
    cache = BinaryCache("t", ".bin")
    keys = _fill(cache, 10)  # 10 x 1110 bytes
    assert cache_trim(20_000) == 0 and _left(cache) == set(keys)  # under the bound: nothing goes
    assert cache_trim(8_000) == 5  # 11,100 > 8,000: down to 6,400, the five oldest go
    assert _left(cache) == set(keys[5:])
    assert not any(p.name.endswith(HASH_SUFFIX) and not Path(str(p)[: -len(HASH_SUFFIX)]).exists()
                   for p in cache.directory().iterdir())  # no hash left without its entry


def test_a_use_from_disk_keeps_an_entry() -> None:
    cache = BinaryCache("t", ".bin")
    keys = _fill(cache, 10)
    fresh = BinaryCache("t", ".bin")  # another process: verifies the oldest from disk, a use
    assert fresh.get_or_build_bytes(keys[0], lambda out: pytest.fail("rebuilt")) == bytes([0]) * ENTRY
    cache_trim(8_000)
    assert _left(cache) == {keys[0], *keys[6:]}


def test_an_entry_trimmed_away_is_built_again_where_it_was_cached() -> None:
    cache = BinaryCache("t", ".bin")
    keys = _fill(cache, 4)
    cache_trim(1)
    assert _left(cache) == set()
    assert cache.get_or_build_bytes(keys[0], lambda out: out.write_bytes(b"again") and None) == b"again"
    assert BinaryCache("t", ".bin").get_or_build_bytes(keys[0], lambda out: pytest.fail("rebuilt")) == b"again"


def test_publishing_past_the_bound_trims(monkeypatch: pytest.MonkeyPatch) -> None:
    # a bound this small makes every publish trim (the chance is 16 x written / bound)
    monkeypatch.setenv(MAX_BYTES_ENV, "10k")
    cache = BinaryCache("t", ".bin")
    for i in range(40):
        cache.put(content_key(f"k{i}"), bytes([i]) * ENTRY)
    total = sum(p.stat().st_size for p in cache.directory().iterdir())
    assert total <= 10 * 1024 and content_key("k39") in _left(cache)


def test_the_bound_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for text, value in (("", cache_mod.DEFAULT_MAX_BYTES), ("0", None), ("4096", 4096), ("1.5K", 1536),
                        ("500M", 500 << 20), ("2GiB", 2 << 30), ("1t", 1 << 40), ("0.5", 1), ("0.0", None),
                        ("9" * 400, 1 << 62)):  # (found by review: an OverflowError, and "no bound")
        monkeypatch.setenv(MAX_BYTES_ENV, text)
        assert cache_mod.max_bytes() == value, text
    monkeypatch.setenv(MAX_BYTES_ENV, "0")
    cache = BinaryCache("t", ".bin")
    _fill(cache, 3)
    assert cache_trim() == 0 and len(_left(cache)) == 3  # no bound
    for bad in ("lots", "-1", "1e9", "5 apples"):
        monkeypatch.setenv(MAX_BYTES_ENV, bad)
        with pytest.raises(InvalidArgumentError, match=MAX_BYTES_ENV):
            cache_mod.max_bytes()
        with pytest.raises(InvalidArgumentError, match=MAX_BYTES_ENV):  # said at the next build
            cache.put(content_key("bad"), b"x")
        with pytest.raises(InvalidArgumentError, match=MAX_BYTES_ENV):  # before it, not after
            cache.get_or_build_bytes(content_key("bad"), lambda out: pytest.fail("built"))
        assert not cache.path_for(content_key("bad")).exists()  # (a hit later did not say it)


def test_an_entry_over_the_bound_is_kept_by_its_own_publish(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the review of session 34's change: a publish's trim removed the entry it had
    just published when the bound was under 1.25 entries, so build_shared returned a path that
    was gone. The entry just published is counted, never removed."""
    monkeypatch.setenv(MAX_BYTES_ENV, "1K")
    cache = BinaryCache("t", ".bin")
    older = cache.path_for(content_key("older"))
    cache.put(content_key("older"), b"o" * 2000)
    path = cache.path_for(content_key("big"))
    assert cache.get_or_build(content_key("big"), lambda out: out.write_bytes(b"b" * 2000) and None) == path
    assert path.read_bytes() == b"b" * 2000 and not older.exists()


def test_a_trim_leaves_what_is_not_the_caches(cache_root: Path) -> None:
    cache = BinaryCache("t", ".bin")
    keys = _fill(cache, 4)
    space = cache.directory()
    mine = space / "notes.txt"
    mine.write_text("the user's")
    pocl = cache_mod.hand_over(cache_mod.POCL_NAMESPACE) / "kcache"
    pocl.mkdir()
    (pocl / "program.so").write_bytes(b"p" * 50_000)  # another program's: neither counted nor trimmed
    young = space / f".{keys[0]}.bin.abcd1234.bin"  # a build in progress
    young.write_bytes(b"t")
    old = space / f".{keys[1]}.bin.efgh5678.bin"  # one a killed process left, an hour ago
    old.write_bytes(b"t")
    os.utime(old, (time.time() - 2 * cache_mod.TEMPORARY_AGE,) * 2)
    assert cache_trim(4_000) == 2  # 4,440 > 4,000: the two oldest go (down to 3,200)
    assert _left(cache) == set(keys[2:])
    assert mine.read_text() == "the user's" and (pocl / "program.so").exists()
    assert young.exists() and not old.exists()


def test_an_entry_used_or_published_after_the_listing_is_kept() -> None:
    cache = BinaryCache("t", ".bin")
    keys = _fill(cache, 2)
    space = cache_mod._Space(cache.directory())
    with space:
        files = space.files()
        name = keys[0] + ".bin"
        listed = files[name]
        used = max(listed.st_mtime_ns, files[name + HASH_SUFFIX].st_mtime_ns)
        cache.put(keys[0], b"published again")  # another process, between the listing and the removal
        assert not space.remove_entry(name, listed, used)
        assert cache.get_or_build_bytes(keys[0], lambda out: pytest.fail("rebuilt")) == b"published again"
        name = keys[1] + ".bin"
        listed = files[name]
        used = max(listed.st_mtime_ns, files[name + HASH_SUFFIX].st_mtime_ns)
        assert space.remove_entry(name, listed, used)
    assert _left(cache) == {keys[0]}


def test_threads_that_publish_and_trim_at_once_leave_only_whole_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MAX_BYTES_ENV, "20k")
    cache = BinaryCache("t", ".bin")
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(60):
                key = content_key(f"{t}-{i % 25}")
                data = f"{t}-{i % 25}".encode() * 100
                assert cache.get_or_build_bytes(key, lambda out, d=data: out.write_bytes(d) and None) == data  # type: ignore[misc]
                if i % 7 == 0:
                    cache_trim()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    info = cache_mod.cache_info()["namespaces"]["t"]  # type: ignore[index]
    assert info["orphans"] == 0 and info["temporary"] == 0
    assert info["bytes"] <= 20 * 1024
    for path in cache.directory().glob("*.bin"):
        fresh = BinaryCache("t", ".bin")
        assert fresh.get_or_build_bytes(path.stem, lambda out: pytest.fail("damaged")) == path.read_bytes()


def test_the_cli_trims_and_shows_the_bound(cache_root: Path) -> None:
    cache = BinaryCache("t", ".bin")
    _fill(cache, 10)
    env = {**os.environ, "POLYJIT_CACHE_DIR": str(cache_root), MAX_BYTES_ENV: "8000"}
    run = [sys.executable, "-m", "polyjit", "cache"]
    info = subprocess.run([*run, "info"], env=env, capture_output=True, text=True, check=True).stdout
    assert "bound 7.8 KiB" in info and "10 entries" in info
    out = subprocess.run([*run, "trim"], env=env, capture_output=True, text=True, check=True).stdout
    assert out.startswith("removed 5 least recently used entries")
    assert len(_left(cache)) == 5
    bad = subprocess.run([*run, "info"], env={**env, MAX_BYTES_ENV: "lots"}, capture_output=True, text=True)
    assert bad.returncode != 0 and MAX_BYTES_ENV in bad.stderr
