"""The one compile-cache mechanism (core/compile_cache.py) every driver's compiler extends:
content keys, memory, verified files, hit/miss logging, compile counts, and its use by the
three backends' compilers."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from forking import exit_code

from polyjit.core.cache import HASH_SUFFIX, BinaryCache
from polyjit.core.compile_cache import CachingCompiler, Target
from polyjit.core.errors import CompileError

ROOT = Path(__file__).resolve().parents[1]


class Upper(CachingCompiler):
    """A compiler whose binary is its source upper-cased, with the target appended."""

    namespace = "upper"
    suffix = ".up"

    def __init__(self, version: str = "1") -> None:
        super().__init__()
        self.version = version
        self.builds: list[tuple[str, Target]] = []
        self.lock = threading.Lock()

    def identity(self) -> tuple[str, ...]:
        return (f"upper {self.version}",)

    def build(self, text: str, target: Target, out: Path) -> None:
        if "error" in text:
            raise CompileError(f"upper cannot compile {text!r}", source=text, log="error here")
        with self.lock:
            self.builds.append((text, target))
        out.write_bytes((text.upper() + "|" + ",".join(target)).encode())


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("POLYJIT_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_memory_then_disk_then_the_compiler(cache_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    c = Upper()
    with caplog.at_level(logging.DEBUG, logger="polyjit"):
        assert c.data("abc", ("t1",)) == b"ABC|t1"
        assert c.data("abc", ("t1",)) == b"ABC|t1"  # in memory
    assert c.compiles == 1 and len(c.builds) == 1
    assert "cache miss" in caplog.text and "(in memory)" in caplog.text
    files = sorted(p.name for p in (cache_dir / "upper").iterdir())
    assert len(files) == 2 and files[1] == files[0] + HASH_SUFFIX  # the entry and its hash

    fresh = Upper()  # another process's view: the verified file, no compile
    assert fresh.data("abc", ("t1",)) == b"ABC|t1" and fresh.compiles == 0
    path = fresh.path("abc", ("t1",))
    assert path.read_bytes() == b"ABC|t1" and path.suffix == ".up"


def test_keys_cover_source_target_and_identity() -> None:
    c = Upper()
    keys = {c.key("abc", ("t1",)), c.key("abd", ("t1",)), c.key("abc", ("t2",)), c.key("abc", ("t1", "x")),
            Upper("2").key("abc", ("t1",)), c.key("abc")}
    assert len(keys) == 6
    c.data("abc", ("t1",))
    Upper("2").data("abc", ("t1",))
    assert len(list(Path(c.disk.directory()).glob("*.up"))) == 2


class Parts(Upper):
    """An Upper whose identity is any tuple of parts (say, a list of libraries)."""

    def __init__(self, *parts: str) -> None:
        super().__init__()
        self.parts = parts

    def identity(self) -> tuple[str, ...]:
        return self.parts


def test_no_two_identities_and_targets_share_a_key() -> None:
    # the key once put a "|" part between identity, target and source: an identity ending in
    # "|" and a target starting with one made the same parts
    assert Parts("a", "|").key("x", ()) != Parts("a").key("x", ("|",))
    assert Parts("a", "|", "b").key("x", ()) != Parts("a").key("x", ("b",))
    assert Parts().key("x", ("a",)) != Parts("a").key("x", ())


def test_a_damaged_entry_is_rebuilt_never_used(cache_dir: Path) -> None:
    c = Upper()
    c.data("abc")
    path = c.path("abc")
    path.write_bytes(b"EVIL")
    fresh = Upper()
    assert fresh.data("abc") == b"ABC|" and fresh.compiles == 1


def test_publish_replaces_an_entry_and_built_in_memory_counts() -> None:
    c = Upper()
    c.data("abc")
    c.publish("abc", (), b"REPLACED")
    assert c.data("abc") == b"REPLACED" and Upper().data("abc") == b"REPLACED"
    made = c.built_in_memory("a program", lambda: object())
    assert made is not None and c.compiles == 2


def test_compile_errors_pass_through_and_nothing_is_kept() -> None:
    c = Upper()
    with pytest.raises(CompileError, match="cannot compile"):
        c.data("an error")
    assert not list(Path(c.disk.directory()).glob("*.up"))


def test_threads_build_a_key_once() -> None:
    c = Upper()
    results: list[bytes] = []
    gate = threading.Barrier(8)

    def work() -> None:
        gate.wait()
        results.append(c.data("shared", ("t",)))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [b"SHARED|t"] * 8 and len(c.builds) == 1


def test_the_backends_compile_through_it() -> None:
    from polyjit.backends.cpu.compiler import CCompiler
    from polyjit.backends.cuda.nvrtc import COMPILER, NvrtcCompiler
    from polyjit.backends.opencl.programs import OpenCLCompiler

    assert issubclass(CCompiler, CachingCompiler) and issubclass(OpenCLCompiler, CachingCompiler)
    assert isinstance(COMPILER, NvrtcCompiler)
    cc = CCompiler(cache=BinaryCache("cpu", ".so"))  # a count of its own (SHARED_CACHE counts the process's)
    path = cc.path("int forty_two(void) { return 42; }\n", ("host",))
    assert path.suffix == ".so" and cc.compiles == 1
    again = CCompiler(cache=BinaryCache("cpu", ".so"))
    assert again.path("int forty_two(void) { return 42; }\n", ("host",)) == path and again.compiles == 0
    assert CCompiler(flags=("-O0", "-fPIC", "-shared")).key("x") != cc.key("x")
    # one flag with a space is another command line than two flags (it built another binary)
    assert CCompiler(flags=("-DV=a", "-Db")).key("x") != CCompiler(flags=("-DV=a -Db",)).key("x")


def test_cache_info_and_clear_see_every_namespace(cache_dir: Path) -> None:
    Upper().data("abc")
    env = {"POLYJIT_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    info = subprocess.run([sys.executable, "-m", "polyjit.cli", "cache", "info"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert info.returncode == 0 and "upper" in info.stdout and "1 entries" in info.stdout, info.stderr
    clear = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        from polyjit.cli import main
        raise SystemExit(main(["cache", "clear"]))
    """)], env=env, capture_output=True, text=True, timeout=120)
    assert clear.returncode == 0 and "removed 1 entries" in clear.stdout
    assert not list((cache_dir / "upper").glob("*.up"))


@pytest.mark.parametrize("action", ["clear", "info", "trim"])
def test_cache_commands_say_a_refused_directory_is_refused(tmp_path: Path, action: str) -> None:
    """Found by review: with an unsafe POLYJIT_CACHE_DIR, ``polyjit cache clear`` printed "removed
    0 entries from /tmp/polyjit-cache-..." (the private directory it falls back to) and exit 0."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    (shared / "keep").write_text("not the cache's")
    says = {"info": "to show", "clear": "cleared", "trim": "trimmed"}[action]
    env = {"POLYJIT_CACHE_DIR": str(shared), "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "polyjit", "cache", action], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout
    assert proc.stderr.strip().splitlines() == [
        f"polyjit cache: refusing the configured cache directory {shared}: it is writable by group and "
        f"others (mode 0777); nothing {says} (polyjit compiles "
        "into a private temporary directory while it is refused)"]
    assert (shared / "keep").exists()


def test_a_program_built_again_is_the_same_source() -> None:
    """Found by review: kernel comments carried node ids from a process-wide counter, so a plan
    compiled again (autodiff and the optimizer make fresh nodes) was a new source: a C compile
    (0.7 s) and a new cache entry each time. Comments now number nodes in the batch's order."""
    import numpy as np

    from polyjit import get_backend
    from polyjit import tensor as pt

    def source() -> str:
        x, y = pt.input("x", (16, 8)), pt.input("y", (16,), "int32")
        mlp = pt.MLP("m", [8, 12, 3], seed=1)
        plan = pt.compile(loss=pt.cross_entropy(mlp(x), y), optimizer=pt.Adam(0.01))
        plan.step(x=np.ones((16, 8), np.float32), y=np.zeros(16, np.int32))
        text = plan.source
        plan.close()
        return text

    compiler = get_backend("cpu").driver.compiler  # type: ignore[attr-defined]
    first = source()
    runs = compiler.compiles
    assert source() == first and "#1 " in first
    assert compiler.compiles == runs


def _which(value: int) -> str:
    return f"int which(void) {{ return {value}; }}\n"


def test_libraries_load_their_verified_bytes_and_are_told_apart(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Loaded from a sealed memfd, never the cache's path. The dynamic loader knows a library
    by the name it was opened by: under /proc/self/fd/N, a later memfd that got the number N
    was taken for the earlier library (a forked child that closed its fds ran its parent's
    old code; found by review). Each is opened through a link of a new name, and no fd stays
    open: loading many libraries keeps the process's fds as they were."""
    import os

    from polyjit.backends.cpu.compiler import CCompiler
    from polyjit.core import compile_cache

    monkeypatch.setenv("POLYJIT_CACHE_DIR", str(tmp_path / "cache"))
    cc = CCompiler(("-O1", "-fPIC", "-shared"), ())
    fds = len(os.listdir("/proc/self/fd"))
    libs = [cc.library(_which(k), name=f"which{k}") for k in range(40)]
    assert [lib.lib.which() for lib in libs] == list(range(40))
    assert len(os.listdir("/proc/self/fd")) == fds
    for lib in libs:
        lib.close()
    # without memfd or /proc (a chroot): through a file of the private directory
    monkeypatch.setattr(compile_cache, "_through_memfd", lambda *a: (_ for _ in ()).throw(OSError("no /proc")))
    assert cc.library(_which(77), name="nofd").lib.which() == 77
    assert not os.listdir(compile_cache._private())  # nothing left there once loaded


def test_a_binary_replaced_between_compile_and_link_never_runs(tmp_path: Path) -> None:
    """Found by the cache review: the cpu backend verified the .so at compile() and dlopened its
    path at link(); a file replaced in between ran (a planted constructor, every time; a racing
    process won 2% of loads). Now compile() keeps the verified bytes and link() loads those."""
    script = tmp_path / "swap.py"
    marker = tmp_path / "planted_code_ran"
    script.write_text(textwrap.dedent(f"""
        import os, subprocess
        from pathlib import Path
        import numpy as np
        from polyjit import get_backend, ir
        from polyjit.backends.cpu.compiler import c_compiler
        a, out = ir.Node("a", (64,)), ir.Node("out", (64,))
        backend = get_backend("cpu")
        code = backend.compile(ir.Comp.of(ir.apply(ir.Op.MUL, a, a, into=out)), name="swapped_mul")
        root = Path(os.environ["POLYJIT_CACHE_DIR"])
        entries = [p for p in root.rglob("*.so") if p.is_file()]
        evil = Path({str(tmp_path)!r}) / "evil"
        evil.with_suffix(".c").write_text(
            '#include <stdio.h>\\n__attribute__((constructor)) static void planted(void) '
            '{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\\n')
        subprocess.run([c_compiler(), "-shared", "-fPIC", "-o", str(evil.with_suffix(".so")),
                        str(evil.with_suffix(".c"))], check=True)
        planted = evil.with_suffix(".so").read_bytes()
        for e in entries:  # every entry (the kernels', the runtime's), its sidecar left as it was
            swap = e.with_name(".swap")
            swap.write_bytes(planted)
            os.replace(swap, e)
        ctx = backend.get_device(0).make_context().init_from_host(a, np.full(64, 3, np.float32))
        r = ctx.link(code)
        r.run()
        print(r.context.read(out)[:2])
        """))
    env = {**__import__("os").environ, "POLYJIT_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=ROOT)
    assert not marker.exists(), "the replaced file's code ran"
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[9. 9.]"


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_child_forked_while_another_thread_held_a_compilers_lock_still_compiles(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """os.fork() copies only the calling thread: a compiler's lock that another thread held at
    the fork stayed held in the child, whose first compile waited for ever."""
    import os

    monkeypatch.setenv("POLYJIT_CACHE_DIR", str(tmp_path / "cache"))
    up = Upper()
    up.data("warm")
    with up._lock:  # as another thread would hold it, at the moment of the fork
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = 0 if up.data("in the child") == b"IN THE CHILD|" else 2
            finally:
                os._exit(code)
    assert exit_code(pid, "on the compiler's lock") == 0


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_child_that_closed_its_fds_loads_its_own_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: a forked child that closed the fds it inherited (as a daemon does)
    and then loaded new code got its parent's library back, the same /proc/self/fd/N name."""
    import os

    from polyjit.backends.cpu.compiler import CCompiler

    monkeypatch.setenv("POLYJIT_CACHE_DIR", str(tmp_path / "cache"))
    cc = CCompiler(("-O1", "-fPIC", "-shared"), ())
    parents = cc.library(_which(1), name="parents")
    assert parents.lib.which() == 1
    two = cc.data(_which(2))  # compiled before the fork: the child only loads
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            from polyjit.core.compile_cache import SharedLibrary

            top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
            os.closerange(3, top + 1)
            got = []
            for low in range(3, top + 2):  # the next fd is each number in turn, the parent's too
                held = [os.open(os.devnull, os.O_RDONLY) for _ in range(3, low)]
                lib = SharedLibrary(two, "childs")
                got.append(lib.lib.which())
                lib.close()
                for fd in held:
                    os.close(fd)
            code = 0 if set(got) == {2} else 2
        finally:
            os._exit(code)
    assert exit_code(pid, "loading a library") == 0


def test_a_source_file_cut_short_by_a_full_disk_is_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: the cpu compiler wrote its .c file before the try that removes it, so
    each process that hit a full disk left a partial file in the cache directory."""
    import errno

    from polyjit.backends.cpu.compiler import CCompiler

    def full_disk(self: Path, text: str, *args: object, **kwargs: object) -> int:
        with open(self, "w") as f:
            f.write(text[:100])
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space"):
        CCompiler().build("int f(void) { return 1; }\n", (), tmp_path / "lib.so")
    assert list(tmp_path.iterdir()) == []
