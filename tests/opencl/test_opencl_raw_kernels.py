"""Your own OpenCL C kernels (``Backend.raw_kernel``) on PoCL: buffers as sub-buffers of the
pools, ``long`` statics, the user's launch shape, ordering by the per-node events (a user
event holds a stream shut, so a missing wait shows), hostile input, lifetimes, threads."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from opencl_helpers import ROOT, f32
from settle import settled_memory

from polyjit.core import ir, raw
from polyjit.core.errors import (
    CompileError,
    InvalidArgumentError,
    NodeNotInContextError,
    UnsupportedError,
)
from polyjit.core.ir import Op, StaticSymbol
from polyjit.core.runtime import Backend

cl: Any = pytest.importorskip("pyopencl")

SAXPY = """__kernel void saxpy(__global float* out, __global const float* x, __global const float* y,
                    long n, long a) {
  size_t i = get_global_id(0);
  if (i < n) out[i] = (float)a * x[i] + y[i];
}
"""

FILL3 = """__kernel void fill3(__global float* a, __global int* b, __global float* c) {
  size_t i = get_global_id(0);
  if (i < 3) a[i] = (float)i;
  if (i < 5) b[i] = 10 + (int)i;
  if (i < 7) c[i] = 0.5f * (float)i;
}
"""


@pytest.fixture()
def gate(backend: Backend) -> Iterator[Any]:
    """A user event: a stream that waits for it is stuck until the test opens it."""
    ev = cl.UserEvent(backend.driver.devices[0].context)  # type: ignore[attr-defined]
    yield ev
    if ev.command_execution_status != cl.command_execution_status.COMPLETE:
        ev.set_status(cl.command_execution_status.COMPLETE)  # never leave a stream stuck


def _block(stream: Any, gate: Any) -> None:
    stream.handle.enqueued(cl.enqueue_barrier(stream.handle.queue, wait_for=[gate]))


def _open(gate: Any) -> None:
    gate.set_status(cl.command_execution_status.COMPLETE)


def _saxpy(backend: Backend, n: int, a: int = 3) -> tuple[Any, ...]:
    out, x, y = f32("out", (n,)), f32("x", (n,)), f32("y", (n,))
    sn, sa = StaticSymbol("n", n + 1), StaticSymbol("a", 16)
    code = backend.raw_kernel(SAXPY, "saxpy", [raw.write(out), raw.read(x), raw.read(y)], statics=[sn, sa],
                              bindings={sn: n, sa: a}, global_size=(n + 63) // 64 * 64, local_size=64)
    return out, x, y, sn, sa, code


def test_saxpy_matches_numpy(backend: Backend) -> None:
    n = 1000
    out, x, y, _sn, sa, code = _saxpy(backend, n)
    assert code.source == SAXPY  # the user's source, and nothing else
    hx, hy = np.arange(n, dtype=np.float32), np.linspace(0, 1, n, dtype=np.float32)
    ctx = backend.get_device(0).make_context().init_from_host(x, hx).init_from_host(y, hy)
    r = ctx.link(code)
    r.run()
    np.testing.assert_allclose(r.context.read(out), 3 * hx + hy, rtol=1e-6)
    r.bindings[sa] = 7
    r.run()
    np.testing.assert_allclose(r.context.read(out), 7 * hx + hy, rtol=1e-6)
    ((spec, seconds),) = r.time_kernels(2)
    assert spec.name == "saxpy" and seconds > 0
    ctx.finalize()


def test_nodes_inside_pools_are_passed_as_aligned_sub_buffers(backend: Backend) -> None:
    dev = backend.get_device(0)
    align = dev.info.base_alignment
    assert align >= max(64, dev.properties["base_alignment"])
    a, b, c = f32("a", (3,)), ir.Node("b", (5,), "int32"), f32("c", (7,))
    code = backend.raw_kernel(FILL3, "fill3", [raw.write(a), raw.write(b), raw.write(c)], global_size=8)
    r = dev.make_context().link(code)
    locs = [r.context.buffers[n] for n in (a, b, c)]
    assert len({loc.pool_id for loc in locs}) == 1 and sum(loc.offset > 0 for loc in locs) == 2
    assert all(loc.offset % align == 0 for loc in locs)  # the slab planner aligns for sub-buffers
    r.run()
    np.testing.assert_array_equal(r.context.read(a), np.arange(3, dtype=np.float32))
    np.testing.assert_array_equal(r.context.read(b), 10 + np.arange(5, dtype=np.int32))
    np.testing.assert_array_equal(r.context.read(c), 0.5 * np.arange(7, dtype=np.float32))
    # A generated kernel reads what the raw one wrote at those offsets, and the other way round.
    d = f32("d", (7,))
    plus = r.context.link(backend.compile(ir.Comp.of(ir.apply(Op.ADD, c, 1.0, into=d)), name="plus"))
    plus.run()
    np.testing.assert_array_equal(plus.context.read(d), 0.5 * np.arange(7) + 1)
    r.context.finalize()


def test_ordered_after_a_generated_writer_on_another_stream(backend: Backend, gate: Any) -> None:
    dev = backend.get_device(0)
    n = 256
    out, x, y, *_, code = _saxpy(backend, n)
    ctx = dev.make_context().init_from_host(x, np.zeros(n, np.float32)).init_from_host(y, np.ones(n, np.float32))
    writer = ctx.link(backend.compile(ir.Comp.of(ir.apply(Op.ADD, x, 5.0, into=x)), name="inc"))
    s2 = dev.new_stream()
    reader = ctx.with_stream(s2).link(code)
    ctx.stream.synchronize()
    _block(ctx.stream, gate)
    writer.run()  # held by the gate
    reader.run()  # on s2: must wait for the writer (device side), not read x = 0
    assert not s2.record().is_done()
    _open(gate)
    np.testing.assert_array_equal(reader.context.read(out), np.full(n, 16, np.float32))
    s2.close()
    ctx.finalize()


def test_generated_reader_waits_for_a_raw_writer_on_another_stream(backend: Backend, gate: Any) -> None:
    dev = backend.get_device(0)
    n = 256
    out, x, y, *_, code = _saxpy(backend, n)
    z = f32("z", (n,))
    ctx = dev.make_context().init_from_host(x, np.ones(n, np.float32)).init_from_host(y, np.ones(n, np.float32))
    ctx = ctx.init_from_host(out, np.zeros(n, np.float32))
    writer = ctx.link(code)
    s2 = dev.new_stream()
    reader = ctx.with_stream(s2).link(backend.compile(ir.Comp.of(ir.apply(Op.NEG, out, into=z)), name="neg"))
    ctx.stream.synchronize()
    _block(ctx.stream, gate)
    writer.run()
    reader.run()
    assert not s2.record().is_done()
    _open(gate)
    np.testing.assert_array_equal(reader.context.read(z), np.full(n, -4, np.float32))
    s2.close()
    ctx.finalize()


# -- hostile input -------------------------------------------------------------------------------


def test_2_to_the_32_work_items_in_a_dimension_are_refused(backend: Backend) -> None:
    """Found by review: PoCL killed the process (SIGILL) on 2**32 work-groups in a dimension."""
    out = f32("out", (4,))
    backend.raw_kernel(SAXPY, "saxpy", [raw.write(out)], global_size=2**32 - 1, local_size=1)
    for size in (2**32, (1, 2**62)):
        with pytest.raises(InvalidArgumentError, match="global_size"):
            backend.raw_kernel(SAXPY, "saxpy", [raw.write(out)], global_size=size)


def test_wrong_parameters_are_refused_at_link(backend: Backend) -> None:
    dev = backend.get_device(0)
    n = 64
    out, x, y = f32("out", (n,)), f32("x", (n,)), f32("y", (n,))
    ctx = dev.make_context().init_from_host(x, np.ones(n, np.float32)).init_from_host(y, np.ones(n, np.float32))
    before = settled_memory(dev)
    too_few = backend.raw_kernel(SAXPY, "saxpy", [raw.write(out), raw.read(x), raw.read(y)], global_size=n)
    with pytest.raises(InvalidArgumentError, match="takes 5 parameters, but raw_kernel names 3"):
        ctx.link(too_few)
    int_static = """__kernel void k(__global float* out, int n) { out[get_global_id(0)] = n; }"""
    wrong = backend.raw_kernel(int_static, "k", [raw.write(out)], statics=[StaticSymbol("n", 9)],
                               bindings={StaticSymbol("n", 9): 1}, global_size=n)
    with pytest.raises(InvalidArgumentError, match="64-bit integer"):
        ctx.link(wrong)
    takes_long = """__kernel void k2(long p, __global float* out) { out[get_global_id(0)] = p; }"""
    swapped = backend.raw_kernel(takes_long, "k2", [raw.write(out)], statics=[StaticSymbol("p", 9)],
                                 bindings={StaticSymbol("p", 9): 1}, global_size=n)
    with pytest.raises(InvalidArgumentError, match="parameter 0"):
        ctx.link(swapped)
    # 8 bytes, but not an integer (found by review: a binding of 3 arrived as 1.5e-323)
    takes_double = """__kernel void k3(__global float* out, double p) { out[get_global_id(0)] = p; }"""
    floating = backend.raw_kernel(takes_double, "k3", [raw.write(out)], statics=[StaticSymbol("p", 9)],
                                  bindings={StaticSymbol("p", 9): 3}, global_size=n)
    with pytest.raises(InvalidArgumentError, match="parameter 1 of OpenCL kernel k3 is 'double'"):
        ctx.link(floating)
    assert dev.used_memory() == before  # the failed links kept nothing
    ctx.finalize()


def test_launch_shapes_are_the_users(backend: Backend) -> None:
    dev = backend.get_device(0)
    out = f32("out", (64,))
    reqd = """__kernel __attribute__((reqd_work_group_size(16, 1, 1)))
void r(__global float* out) { out[get_global_id(0)] = get_local_size(0); }"""
    ctx = dev.make_context()
    with pytest.raises(InvalidArgumentError, match="local_size"):
        ctx.link(backend.raw_kernel(reqd, "r", [raw.write(out)], global_size=64))
    r = ctx.link(backend.raw_kernel(reqd, "r", [raw.write(out)], global_size=64, local_size=16))
    r.run()
    np.testing.assert_array_equal(r.context.read(out), np.full(64, 16, np.float32))
    plain = "__kernel void p(__global float* out) { out[get_global_id(0)] = get_local_size(0); }"
    huge = dev.properties["max_work_group_size"] * 2
    with pytest.raises(UnsupportedError, match="work-groups"):
        ctx.link(backend.raw_kernel(plain, "p", [raw.write(f32("big", (huge,)))], global_size=huge, local_size=huge))
    r2 = ctx.link(backend.raw_kernel(plain, "p", [raw.write(out)], global_size=64, local_size=8))
    r2.run()  # the user's local size, even where PoCL would pick its own
    np.testing.assert_array_equal(r2.context.read(out), np.full(64, 8, np.float32))
    with pytest.raises(InvalidArgumentError, match="global_size"):
        backend.raw_kernel(plain, "p", [raw.write(out)])
    ctx.finalize()


def test_compile_errors_and_missing_kernels(backend: Backend, tmp_path: Path) -> None:
    path = tmp_path / "bad_kernel.cl"
    path.write_text("__kernel void bad(__global float* x) {\n  x[0] = nope;\n}\n")
    with pytest.raises(CompileError) as info:
        backend.raw_kernel(path, "bad", [raw.write(f32("x", (4,)))], global_size=4)
    assert str(path) in str(info.value) and "nope" in info.value.log
    with pytest.raises(CompileError, match="without kernels absent"):
        backend.raw_kernel("__kernel void present(__global float* x) { x[0] = 1; }", "absent",
                           [raw.write(f32("x", (4,)))], global_size=4)
    with pytest.raises(InvalidArgumentError, match="present;"):
        backend.raw_kernel("__kernel void present(__global float* x) {}", "present;", [raw.write(f32("x", (4,)))],
                           global_size=4)
    # Found by review: a text compiled before under another kernel's name reused that batch,
    # whose check had passed, and the missing kernel failed at link as a DriverError.
    text = "__kernel void here(__global float* x) { x[0] = 2; }"
    backend.raw_kernel(text, "here", [raw.write(f32("x", (4,)))], global_size=4)
    with pytest.raises(CompileError, match="without kernels elsewhere"):
        backend.raw_kernel(text, "elsewhere", [raw.write(f32("x", (4,)))], global_size=4)
    # ... while kernels the text does define share its one build
    two = ("__kernel void k_one(__global float* x) { x[0] = 1; }\n"
           "__kernel void k_two(__global float* x) { x[0] = 2; }\n")
    before = backend.driver.cache.compiles  # type: ignore[attr-defined]
    for name in ("k_one", "k_two"):
        backend.raw_kernel(two, name, [raw.write(f32("x", (4,)))], global_size=4)
    assert backend.driver.cache.compiles - before <= 1  # type: ignore[attr-defined]


def test_a_wrong_kernel_name_first_does_not_spoil_the_right_one(backend: Backend) -> None:
    """Found by review: the first compile of a text named a kernel it lacks; the batch kept
    that name and checked it at every later build, so the right name failed too, for the
    life of the process, with a message naming the wrong one."""
    text = "__kernel void right(__global float* x) { x[get_global_id(0)] = 3; }\n/* typo first */"
    x = f32("x", (4,))
    with pytest.raises(CompileError, match="without kernels wrong"):
        backend.raw_kernel(text, "wrong", [raw.write(x)], global_size=4)
    r = backend.get_device(0).make_context().link(backend.raw_kernel(text, "right", [raw.write(x)], global_size=4))
    r.run()
    np.testing.assert_array_equal(r.context.read(x), np.full(4, 3, np.float32))
    with pytest.raises(CompileError, match="without kernels wrong"):  # and the wrong one still fails
        backend.raw_kernel(text, "wrong", [raw.write(x)], global_size=4)


def test_nodes_read_must_be_in_the_context(backend: Backend) -> None:
    _out, x, _y, *_, code = _saxpy(backend, 32)
    ctx = backend.get_device(0).make_context().init_from_host(x, np.ones(32, np.float32))
    with pytest.raises(NodeNotInContextError, match="y"):
        ctx.link(code)
    ctx.finalize()


# -- lifetimes and threads --------------------------------------------------------------------


def test_dropped_objects_while_in_flight(backend: Backend, gate: Any) -> None:
    dev = backend.get_device(0)
    base = settled_memory(dev)
    n = 128
    stream = dev.new_stream()
    out, x, y, *_, code = _saxpy(backend, n)
    ctx = dev.make_context(stream).init_from_host(x, np.ones(n, np.float32)).init_from_host(y, np.ones(n, np.float32))
    stream.synchronize()
    _block(stream, gate)
    r = ctx.link(code)
    r.run()
    keep = r.context
    del r, code
    gc.collect()
    _open(gate)
    np.testing.assert_array_equal(keep.read(out), np.full(n, 4, np.float32))

    gate2 = cl.UserEvent(dev.driver.devices[0].context)  # type: ignore[attr-defined]
    _block(stream, gate2)
    sn, sa = StaticSymbol("n", n + 1), StaticSymbol("a", 16)
    again = backend.raw_kernel(SAXPY, "saxpy", [raw.write(out), raw.read(x), raw.read(y)], statics=[sn, sa],
                               bindings={sn: n, sa: 2}, global_size=n)
    r2 = keep.link(again)
    r2.run()
    assert stream.backlog() >= 1
    del r2, again, keep, ctx, stream  # routine, code, contexts and stream while the work is held
    gc.collect()
    _open(gate2)
    dev.synchronize()
    assert dev.used_memory() == base


def test_threads_compile_link_and_run(backend: Backend) -> None:
    dev = backend.get_device(0)
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work(k: int) -> None:
        try:
            n = 64 + k
            out, x, y, _sn, _sa, code = _saxpy(backend, n, a=k % 16)
            s = dev.new_stream()
            ctx = dev.make_context(s).init_from_host(x, np.full(n, k, np.float32))
            r = ctx.init_from_host(y, np.ones(n, np.float32)).link(code)
            for _ in range(4):
                r.run()
            np.testing.assert_allclose(r.context.read(out), np.full(n, (k % 16) * k + 1, np.float32))
            ctx.finalize()
            s.close()
        except BaseException as e:  # reported by the main thread
            with lock:
                errors.append(e)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(work, range(12)))
    assert not errors, errors[:3]


def test_ordered_across_two_devices(backend: Backend) -> None:
    """A raw writer on device 0, a copy to device 1, a raw reader there: no user waits
    (with POCL_DEVICES='pthread pthread' in a subprocess when this process has one device)."""
    script = textwrap.dedent("""
        import numpy as np
        from polyjit.backends import get_backend
        from polyjit.core import ir, raw
        from polyjit.core.routine import device_to_device
        be = get_backend("opencl")
        assert be.num_devices() >= 2, be.num_devices()
        n = 1 << 16
        x, y, z = (ir.Node(k, (n,)) for k in "xyz")
        twice = be.raw_kernel(
            "__kernel void twice(__global float* y, __global const float* x) {"
            "  size_t i = get_global_id(0); float v = x[i];"
            "  for (int k = 0; k < 2000; k++) v = v * 1.0000001f;"  # slow enough to be overtaken
            "  y[i] = 2.0f * x[i] + 0.0f * v; }",
            "twice", [raw.write(y), raw.read(x)], global_size=n)
        neg = be.raw_kernel("__kernel void neg(__global float* z, __global const float* y) {"
                            "  size_t i = get_global_id(0); z[i] = -y[i]; }",
                            "neg", [raw.write(z), raw.read(y)], global_size=n)
        c0 = be.get_device(0).make_context().init_from_host(x, np.arange(n, dtype=np.float32))
        c0 = c0.init_from_host(y, np.zeros(n, np.float32))
        c1 = be.get_device(1).make_context().init_from_host(y, np.full(n, 7, np.float32))
        w, r = c0.link(twice), c1.link(neg)
        for k in range(3):
            w.run()
            device_to_device(y, dst=c1, src=c0)
            r.run()
            assert np.array_equal(r.context.read(z), -2 * np.arange(n, dtype=np.float32)), k
        print("ok")
    """)
    env = dict(os.environ)
    if backend.num_devices() < 2:
        if "portable computing language" not in str(backend.get_device(0).properties["platform"]).lower():
            pytest.skip("needs two OpenCL devices")
        env["POCL_DEVICES"] = "pthread pthread"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "ok" in out.stdout, (out.stdout + out.stderr)[-4000:]
