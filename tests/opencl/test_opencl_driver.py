"""The OpenCL driver: devices and platforms, compiling and its cache, memory, streams and events."""

from __future__ import annotations

import gc
import os
import stat
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from opencl_helpers import ROOT, f32, run_comps, slow_accumulate

from polyjit.backends.opencl import OpenCLDriver, create_backend
from polyjit.core import dtypes, ir
from polyjit.core.codegen import Source
from polyjit.core.errors import (
    BackendUnavailableError,
    CompileError,
    DriverError,
    PoolExhaustedError,
    UnsupportedError,
)
from polyjit.core.ir import Node, Op
from polyjit.core.runtime import Backend

cl: Any = pytest.importorskip("pyopencl")


# ---------------------------------------------------------------------------
# Devices


def test_device_info(backend: Backend) -> None:
    driver = backend.driver
    assert isinstance(driver, OpenCLDriver)
    order = [(d.platform_index, d.device_index) for d in driver.devices]
    assert order == sorted(order)
    for k, d in enumerate(driver.devices):
        dev = backend.get_device(k)
        props = dev.properties
        assert dev.name == d.device.name.strip()
        assert props["memory_bytes"] == d.device.global_mem_size
        assert props["compute_units"] == d.device.max_compute_units
        assert props["base_alignment"] >= d.device.mem_base_addr_align // 8  # bits -> bytes
        assert props["base_alignment"] >= 64
        assert isinstance(props["fp64"], bool)
        assert props["fp64"] == ("cl_khr_fp64" in d.device.extensions or d.device.double_fp_config != 0)
        assert props["platform"] == d.platform.name.strip()
        # every device of a platform shares one context: copies stay on the device side
        same = [e for e in driver.devices if e.platform_index == d.platform_index]
        assert all(e.context is d.context for e in same)
        s = dev.new_stream()
        assert s.handle.queue.properties & cl.command_queue_properties.PROFILING_ENABLE


def test_platform_selection(backend: Backend) -> None:
    name = backend.get_device(0).properties["platform"]
    assert create_backend(platform=name[:6]).num_devices() >= 1
    assert create_backend(platform="0").num_devices() >= 1
    none = create_backend(platform="no such platform anywhere")
    assert none.num_devices() == 0
    reason = none.driver.unavailable_reason  # type: ignore[attr-defined]
    assert "POLYJIT_OPENCL_PLATFORM" in reason and name in reason


def test_no_opencl_platform_means_zero_devices_not_a_crash(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        from polyjit.backends import get_backend, available_backends
        from polyjit.core import ir
        be = get_backend("opencl")
        print("devices", be.num_devices())
        print("reason", be.driver.unavailable_reason)
        x, y = ir.Node("x", (4,)), ir.Node("y", (4,))
        code = be.compile(ir.Comp.of(ir.apply(ir.Op.NEG, x, into=y)))  # generates, builds nothing
        print("source", "__kernel" in code.source)
        print("available", "opencl" in available_backends())
    """)
    env = {**os.environ, "OCL_ICD_VENDORS": str(tmp_path / "none.icd"),
           "POLYJIT_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "devices 0" in out.stdout
    assert "reason no OpenCL platform" in out.stdout
    assert "source True" in out.stdout and "available False" in out.stdout


def test_pocls_kernel_cache_lives_in_polyjits_checked_cache(tmp_path: Path) -> None:
    """PoCL dlopens the native code it cached in an earlier process: unless the user names its
    place, it goes under polyjit's cache root, in a directory only this user can write (a
    library another user planted in a shared place is never loaded). A user's choice stays."""
    script = textwrap.dedent("""
        import os
        from polyjit.backends import get_backend
        be = get_backend("opencl")
        print("devices", be.num_devices())
        print("pocl", os.environ.get("POCL_CACHE_DIR"))
    """)
    base = {k: v for k, v in os.environ.items() if k != "POCL_CACHE_DIR"}
    env = {**base, "POLYJIT_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    place = Path(out.stdout.split("pocl ")[1].strip())
    assert place == (tmp_path / "cache" / "pocl").resolve() and stat.S_IMODE(place.stat().st_mode) == 0o700
    if "devices 0" not in out.stdout:  # PoCL started there (its probe build's program.bc)
        assert any(place.rglob("*.bc")), sorted(place.rglob("*"))[:5]
    mine = {**env, "POCL_CACHE_DIR": str(tmp_path / "mine")}
    out = subprocess.run([sys.executable, "-c", script], env=mine, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and f"pocl {tmp_path / 'mine'}" in out.stdout, out.stderr


def test_without_pyopencl_the_backend_has_no_devices() -> None:
    script = textwrap.dedent("""
        import sys
        sys.modules["pyopencl"] = None  # as if it were not installed
        from polyjit.backends import get_backend
        from polyjit.core import ir
        be = get_backend("opencl")
        print("devices", be.num_devices(), be.driver.unavailable_reason)
        x, y = ir.Node("x", (4,)), ir.Node("y", (4,))
        print("source", "__kernel" in be.compile(ir.Comp.of(ir.apply(ir.Op.NEG, x, into=y))).source)
    """)
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "devices 0 pyopencl cannot be imported" in out.stdout and "source True" in out.stdout


# ---------------------------------------------------------------------------
# Compiling


def test_compile_error_names_the_log_and_the_lines(backend: Backend) -> None:
    bad = "/* polyjit */\n__kernel void broken(__global char* p0) {\n  undefined_name += 1;\n}\n"
    with pytest.raises(CompileError) as info:
        backend.driver.compile(Source(bad, "opencl", ()))
    msg = str(info.value)
    assert "undefined_name" in info.value.log
    assert ">>     3 |   undefined_name += 1;" in msg
    assert info.value.source == bad


def test_programs_are_cached_in_memory_and_on_disk(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import numpy as np
        from polyjit.backends.opencl import create_backend
        from polyjit.core import ir
        be = create_backend(binary_cache="always")  # PoCL's binaries are not cached by default
        x, y = ir.Node("x", (5,)), ir.Node("y", (5,))
        comp = ir.Comp.of(ir.apply(ir.Op.SQRT, x, into=y))
        code = be.compile(comp, name="cached")
        be.compile(comp, name="cached")  # in memory: no second build either
        ctx = be.get_device(0).make_context().init_from_host(x, np.arange(5, dtype=np.float32))
        r = ctx.link(code)
        r.run()
        print("compiles", be.driver.cache.compiles)
        print("ok", np.allclose(r.context.read(y), np.sqrt(np.arange(5))))
    """)
    env = {**os.environ, "POLYJIT_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}

    def run() -> str:
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout

    first = run()
    assert "compiles 1" in first and "ok True" in first
    files = list((tmp_path / "opencl").glob("*.bin"))
    assert len(files) == 1
    second = run()  # another process: the binary comes from disk, the compiler never runs
    assert "compiles 0" in second and "ok True" in second
    files[0].write_bytes(b"not a binary")  # a damaged entry is rebuilt, not fatal
    third = run()
    assert "ok True" in third


def test_cpu_devices_keep_binaries_in_memory_only(backend: Backend, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLYJIT_CACHE_DIR", str(tmp_path))
    be = create_backend()
    x, y = f32("x", (5,)), f32("y", (5,))
    comp = ir.Comp.of(ir.apply(Op.EXP, x, into=y))
    be.compile(comp, name="mem")
    be.compile(comp, name="mem")
    driver = be.driver
    assert isinstance(driver, OpenCLDriver)
    assert driver.cache.compiles == 1
    on_disk = list(tmp_path.rglob("*.bin"))
    if all(d.is_cpu for d in driver.devices):
        assert on_disk == []
    with pytest.raises(BackendUnavailableError, match="binary_cache"):  # as the cpu backend's bad num_devices
        create_backend(binary_cache="sometimes")


def test_a_cached_binary_the_platform_refuses_is_rebuilt_and_replaced(backend: Backend, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry whose hash checks out but which the platform cannot load (another driver
    version wrote it, say) is built again from source and its entry replaced."""
    monkeypatch.setenv("POLYJIT_CACHE_DIR", str(tmp_path))
    x, y = f32("x", (6,)), f32("y", (6,))
    comp = ir.Comp.of(ir.apply(Op.SQRT, x, into=y))
    first = create_backend(binary_cache="always")
    code = first.compile(comp, name="refused")
    compiler = first.driver.cache  # type: ignore[attr-defined]
    driver = first.driver
    assert isinstance(driver, OpenCLDriver)
    devs = [d for d in driver.devices if d.group == 0]
    target = compiler.target(devs, "")
    compiler.publish(code.source, target, b"\0\0\0\0\0\0\0\0")  # verified, but no binary
    second = create_backend(binary_cache="always")
    again = second.compile(comp, name="refused")  # the same source: the planted entry
    assert again.source == code.source
    ctx = second.get_device(0).make_context().init_from_host(x, np.arange(6, dtype=np.float32))
    r = ctx.link(again)
    r.run()
    np.testing.assert_allclose(r.context.read(y), np.sqrt(np.arange(6)), rtol=1e-6)
    ctx.finalize()
    fresh = OpenCLDriver(binary_cache="always").cache
    assert fresh.data(code.source, target) != b"\0" * 8  # the rebuilt binaries replaced it


def test_pyopencl_public_api_only() -> None:
    package = ROOT / "polyjit" / "backends" / "opencl"
    for path in package.glob("*.py"):
        text = path.read_text()
        assert "_cl." not in text and "cl._" not in text, path


def test_float64_on_a_device_without_fp64_is_unsupported(backend: Backend) -> None:
    be = create_backend()
    driver = be.driver
    assert isinstance(driver, OpenCLDriver)
    x, y = Node("x", (4,), dtypes.float64), Node("y", (4,), dtypes.float64)
    comp = ir.Comp.of(ir.apply(Op.NEG, x, into=y))
    devices = driver.devices
    for d in devices:
        d.fp64 = False
    with pytest.raises(UnsupportedError, match="float64"):
        be.compile(comp, name="needs_fp64")
    if len(devices) >= 2:  # one device with fp64: compiles; the other refuses to load it
        devices[1].fp64 = True
        code = be.compile(comp, name="needs_fp64")
        ctx = be.get_device(0).make_context().init_from_host(x, np.ones(4))
        with pytest.raises(UnsupportedError, match="cl_khr_fp64"):
            ctx.link(code)
        got = run_comps(be, [comp], {x: np.arange(4.0)}, [y], ordinal=1)[y]
        np.testing.assert_array_equal(got, -np.arange(4.0))
        ctx.finalize()


# ---------------------------------------------------------------------------
# Memory


def test_pools_beyond_the_largest_allocation_are_exhausted(backend: Backend) -> None:
    dev = backend.get_device(0)
    biggest = dev.properties["max_mem_alloc_size"]
    if biggest >= dev.properties["memory_bytes"]:
        pytest.skip("the device allows one allocation as big as its memory")
    before = dev.used_memory()
    with pytest.raises(PoolExhaustedError, match="max_mem_alloc_size"):
        dev.alloc_pool(1 << 29, biggest + 1, 64)
    assert dev.used_memory() == before


def test_memset_at_an_offset(backend: Backend) -> None:
    dev = backend.get_device(0)
    for nbytes, offset in ((4096, 0), (1001, 3), (64, 128)):
        pid = 1 << 28
        dev.alloc_pool(pid, offset + nbytes + 16, 64)
        handle = dev.pool_handle(pid)
        stream = dev.default_stream
        ones = np.full(offset + nbytes + 16, 7, np.uint8)
        dev.driver.copy_from_host(stream.handle, handle, 0, ones)
        dev.memset_zero(pid, offset, nbytes)
        back = np.empty_like(ones)
        dev.driver.copy_to_host(stream.handle, handle, 0, back)
        stream.synchronize()
        want = ones.copy()
        want[offset:offset + nbytes] = 0
        np.testing.assert_array_equal(back, want)
        dev.free_pool(pid)


# ---------------------------------------------------------------------------
# Streams and events


@pytest.fixture()
def gate(backend: Backend) -> Iterator[Any]:
    """A user event: a stream that waits for it is stuck until the test opens it."""
    ctx = backend.driver.devices[0].context  # type: ignore[attr-defined]
    ev = cl.UserEvent(ctx)
    yield ev
    if ev.command_execution_status != cl.command_execution_status.COMPLETE:
        ev.set_status(cl.command_execution_status.COMPLETE)  # never leave a stream stuck


def _block(stream: Any, gate: Any) -> None:
    stream.handle.enqueued(cl.enqueue_barrier(stream.handle.queue, wait_for=[gate]))


def test_waits_are_device_side(backend: Backend, gate: Any) -> None:
    dev = backend.get_device(0)
    s1, s2 = dev.new_stream(), dev.new_stream()
    _block(s1, gate)
    e1 = s1.record()
    t0 = time.perf_counter()
    s2.wait(e1)  # must not block the host
    e2 = s2.record()
    assert time.perf_counter() - t0 < 5.0  # a wait that blocked would hang: the gate opens below
    time.sleep(0.05)
    assert not e1.is_done() and not e2.is_done()
    gate.set_status(cl.command_execution_status.COMPLETE)
    e2.synchronize()
    assert e1.is_done() and e2.is_done()


def test_record_reuses_the_last_command_event(backend: Backend) -> None:
    dev = backend.get_device(0)
    x = f32("x", (8,))
    ctx = dev.make_context().init_from_host(x, np.zeros(8, np.float32))
    r = ctx.link(backend.compile(ir.Comp.of(ir.apply(Op.ADD, x, 1.0, into=x)), name="inc"))
    handle = ctx.stream.handle
    r.run()
    seq = handle.seq
    e1, e2 = ctx.stream.record(), ctx.stream.record()
    assert handle.seq == seq and e1.handle.event is e2.handle.event  # no marker per record
    e2.synchronize()
    np.testing.assert_array_equal(r.context.read(x), np.ones(8, np.float32))
    ctx.finalize()


def test_host_copies_do_not_block_and_keep_their_arrays(backend: Backend, gate: Any) -> None:
    dev = backend.get_device(0)
    x = f32("x", (100_000,))
    ctx = dev.make_context().init_from_host(x, np.zeros(100_000, np.float32))
    ctx.stream.synchronize()
    _block(ctx.stream, gate)
    t0 = time.perf_counter()
    ctx.from_host(x, np.arange(100_000, dtype=np.float32))  # the only reference to the array
    assert time.perf_counter() - t0 < 5.0  # generous: PoCL's threads and CI's other worker share the cores
    gc.collect()
    assert ctx.stream.backlog() == 1  # the runtime keeps the array and pyopencl's NannyEvent
    time.sleep(0.05)
    assert not ctx.stream.record().is_done()
    gate.set_status(cl.command_execution_status.COMPLETE)
    np.testing.assert_array_equal(ctx.read(x), np.arange(100_000, dtype=np.float32))
    assert ctx.stream.backlog() == 0  # released once the copy is done
    ctx.finalize()


def test_kernels_queued_before_a_later_enqueue_failed_keep_their_memory(
        backend: Backend, gate: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: a routine whose second kernel failed to enqueue raised a plain error and
    left the stream's last event before its first kernel, which was queued: nothing kept what
    that kernel used, and finalize freed it before the kernel ran."""
    dev = backend.get_device(0)
    n = 200_000
    x, total = f32("x", (n,)), f32("total", ())
    ctx = dev.make_context().init_from_host(x, np.ones(n, np.float32))
    r = ctx.link(backend.compile(ir.Comp.of(ir.einsum("i->", x, into=total)), name="sum"))
    assert len(r.prepared().calls) == 2  # a split sum: partial sums, then their sum
    real, calls = cl.enqueue_nd_range_kernel, [0]

    def second_fails(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise cl.RuntimeError("clEnqueueNDRangeKernel failed: OUT_OF_RESOURCES (injected)")
        return real(*args, **kwargs)

    ctx.stream.synchronize()
    _block(ctx.stream, gate)  # the first kernel stays queued until the gate opens
    monkeypatch.setattr(cl, "enqueue_nd_range_kernel", second_fails)
    with pytest.raises(DriverError, match="OUT_OF_RESOURCES"):
        r.run()
    monkeypatch.undo()
    after = ctx.stream.record()
    assert not after.is_done()  # the stream's event is behind the queued kernel, not before it
    ctx.finalize()
    assert dev.pending_free_memory() > 0  # x waits for the kernel that reads it
    gate.set_status(cl.command_execution_status.COMPLETE)
    after.synchronize()
    dev.synchronize()
    assert dev.pending_free_memory() == 0


def test_two_streams_on_one_device(backend: Backend) -> None:
    dev = backend.get_device(0)
    comp, x, acc = slow_accumulate()
    n = x.shape[0]
    out = f32("out", (n,))
    ctx = dev.make_context().init_from_host(x, np.ones(n, np.float32)).init_from_host(acc, np.zeros(n, np.float32))
    writer = ctx.link(backend.compile(comp, name="slow"))
    other = ctx.with_stream(dev.new_stream())
    reader = other.link(backend.compile(ir.Comp.of(ir.apply(Op.MUL, acc, 2.0, into=out)), name="double"))
    for _ in range(8):
        writer.run()
    reader.run()  # on the second stream: waits (device side) for the writes on the first
    np.testing.assert_array_equal(reader.context.read(out), np.full(n, 16, np.float32))
    ctx.finalize()


@pytest.mark.parametrize("data", [b"\x01\x02", struct.pack("<Q", 4) + b"ab", b"", struct.pack("<Q", 0),
                                  struct.pack("<Q", 2) + b"ab" + b"\x07"])
def test_a_malformed_group_entry_is_a_value_error_the_loader_rebuilds_on(data: bytes) -> None:
    """Found by the cache review: an entry that matched its hash but was cut inside a length
    raised struct.error, which the loader (it rebuilds on ValueError) let through: a DriverError
    on every run, the entry never rebuilt."""
    from polyjit.backends.opencl.programs import _pack, _unpack

    with pytest.raises(ValueError, match="cached OpenCL entry"):
        _unpack(data, 1)
    assert _unpack(_pack([b"one", b"two"]), 2) == [b"one", b"two"]
