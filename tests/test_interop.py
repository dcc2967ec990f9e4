"""Interop and conventions: DLPack both ways (numpy, PyTorch), numpy dtype conventions,
devices by name, event timing, memory statistics, the log and the cache command."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import polyjit
from polyjit import get_backend, ir
from polyjit.core import dtypes
from polyjit.core.errors import (
    AliasedMemoryError,
    DTypeMismatchError,
    InvalidArgumentError,
    ReadOnlyNodeError,
    ShapeMismatchError,
    UnknownDeviceError,
    UnsupportedError,
)
from polyjit.core.ir import Node, Op

torch: Any = None
with contextlib.suppress(ImportError):  # the interop extra is not installed: the torch tests say so
    import torch  # type: ignore[no-redef]
needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed (pip install -e '.[interop]')")


def _squared(shape: tuple[int, ...] = (4, 5)) -> tuple[Any, Node, Node, np.ndarray]:
    be = get_backend("cpu")
    a, out = Node("a", shape), Node("out", shape)
    values = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    r = be.get_device(0).make_context().init_from_host(a, values).link(
        be.compile(ir.Comp.of(ir.apply(Op.MUL, a, a, into=out)), name="sq"))
    r.run()
    return r, a, out, values


# ---------------------------------------------------------------------------
# DLPack out


def test_numpy_sees_a_node_without_a_copy() -> None:
    r, _, out, values = _squared()
    exported = r.context.export(out)
    view = np.from_dlpack(exported)
    np.testing.assert_array_equal(view, values * values)
    assert view.ctypes.data == exported.address  # the node's own memory
    assert exported.__dlpack_device__() == (1, 0)
    np.testing.assert_array_equal(np.asarray(exported), values * values)
    r.context.finalize()


def test_a_bfloat16_node_reaches_numpy_without_a_copy() -> None:
    """numpy's from_dlpack has no bfloat16; np.asarray of an export wraps the memory instead,
    and the view keeps the buffer alive after the context is finalized."""
    import ml_dtypes

    x = Node("x", (64,), dtypes.bfloat16)
    values = np.linspace(-4, 4, 64).astype(ml_dtypes.bfloat16)
    ctx = get_backend("cpu").get_device(0).make_context().init_from_host(x, values)
    exported = ctx.export(x)
    view = np.asarray(exported)
    assert view.dtype == ml_dtypes.bfloat16 and view.ctypes.data == exported.address
    del exported
    ctx.finalize()
    gc.collect()
    np.testing.assert_array_equal(view, values)


def test_an_exported_buffer_outlives_finalize() -> None:
    r, _, out, values = _squared((256, 64))
    dev = r.context.device
    view = np.from_dlpack(r.context.export(out))
    r.context.finalize()  # the pool is kept while a view of it lives
    assert dev.pending_free_memory() >= out.nbytes
    gc.collect()
    np.testing.assert_array_equal(view, values * values)
    del view
    gc.collect()
    dev.synchronize()
    assert dev.pending_free_memory() == 0


def test_export_orders_after_the_writer() -> None:
    be = get_backend("cpu")
    n = 1 << 22
    a, out = Node("a", (n,)), Node("out", (n,))
    chain = ir.Comp.of(*[ir.apply(Op.TANH, a if k == 0 else out, into=out) for k in range(4)], embedded=[out])
    r = be.get_device(0).make_context().init_from_host(a, np.ones(n, np.float32)).link(be.compile(chain, name="ch"))
    for _ in range(3):
        r.run()  # only enqueued
    view = np.from_dlpack(r.context.export(out))  # after the last run's write
    want = np.ones(n, np.float32)
    for _ in range(4):
        want = np.tanh(want)
    np.testing.assert_allclose(view[:1000], want[:1000], rtol=1e-6)
    r.context.finalize()


def test_an_export_taken_before_a_write_waits_for_it() -> None:
    """Found by review: an Exported kept the node's writer seen at export(), so a view taken
    after a later run was handed over while that run still wrote the node (10 of 10)."""
    be = get_backend("cpu")
    n = 1 << 21
    a, out = Node("a", (n,)), Node("out", (n,))
    steps, t = [], a
    for k in range(16):  # a slow chain first, then out += a
        nxt = Node(f"t{k}", (n,))
        steps.append(ir.apply(Op.EXP if k % 2 == 0 else Op.LOG, t, into=nxt))
        t = nxt
    steps.append(ir.apply(Op.ADD, out, a, into=out))
    ctx = be.get_device(0).make_context().init_from_host(a, np.ones(n, np.float32))
    r = ctx.init_from_host(out, np.zeros(n, np.float32)).link(be.compile(ir.Comp.of(*steps), name="late"))
    r.run()
    for k in range(5):
        exported = r.context.export(out)  # its writer now: done
        r.run()  # a new write, enqueued after the export
        assert float(np.from_dlpack(exported)[0]) == k + 2.0
        r.context.stream.synchronize()
    r.context.finalize()


ESCAPED_VIEW = """
import gc, sys
import numpy as np
from polyjit import get_backend, ir
dev = get_backend("cpu").get_device(0)
n = 1 << 22  # 16 MiB: given back to the OS when freed
x = ir.Node("x", (n,))
ctx = dev.make_context().init_from_host(x, np.ones(n, np.float32))
if sys.argv[1] == "host_view":
    with ctx.host_view(x) as view:
        kept = view  # kept past the block
    del view
else:
    exported = ctx.export(x)
    kept = np.from_dlpack(exported)
    exported.release()
    try:
        np.from_dlpack(exported)
        print("a released export was taken again")
    except BufferError:
        pass
ctx.finalize()
dev.synchronize()
gc.collect()
other = dev.make_context().init_from_host(ir.Node("y", (n,)), np.full(n, 7, np.float32))
dev.synchronize()
print(float(kept.sum()))
del kept
gc.collect()
dev.synchronize()
print(dev.driver.allocated_bytes(0) == 4 * n)  # x's pool freed once the view went
"""


@pytest.mark.parametrize("how", ["host_view", "release"])
def test_a_view_kept_past_its_export_keeps_the_pool(how: str) -> None:
    """Found by review: host_view's end and Exported.release() unpinned the pool under a live
    view, so after finalize() reading the view read freed memory (SIGSEGV 3 of 3)."""
    proc = subprocess.run([sys.executable, "-c", ESCAPED_VIEW, how], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [str(float(1 << 22)), "True"]


@needs_torch
def test_torch_takes_an_export_without_a_copy() -> None:
    r, _, out, values = _squared()
    exported = r.context.export(out)
    t = torch.from_dlpack(exported)
    assert t.data_ptr() == exported.address
    np.testing.assert_array_equal(t.numpy(), values * values)
    r.context.finalize()


def test_opencl_buffers_do_not_export() -> None:
    be = get_backend("opencl")
    if be.num_devices() == 0:
        pytest.skip(f"no OpenCL device: {be.unavailable_reason}")
    a = Node("a", (4,))
    ctx = be.get_device(0).make_context().init_from_host(a, np.ones(4, np.float32))
    with pytest.raises(UnsupportedError, match="to_host"):
        ctx.export(a)
    ctx.finalize()


# ---------------------------------------------------------------------------
# DLPack in


def test_an_aligned_numpy_array_is_taken_without_a_copy() -> None:
    dev = get_backend("cpu").get_device(0)
    raw = np.empty(4096 + 16, np.float32)
    start = (-raw.ctypes.data % 64) // 4
    host = raw[start : start + 4096]  # a 64-byte aligned view
    host[:] = np.arange(4096)
    x, y = Node("x", (4096,)), Node("y", (4096,))
    ctx = dev.make_context().init_from_dlpack(x, host)
    assert dev.pool_handle(ctx.buffers[x].pool_id) == host.ctypes.data  # the same memory
    host[0] = 42.0
    np.testing.assert_array_equal(ctx.read(x)[:2], [42.0, 1.0])
    r = ctx.link(get_backend("cpu").compile(ir.Comp.of(ir.apply(Op.ADD, x, x, into=y)), name="dbl"))
    r.run()
    np.testing.assert_array_equal(r.context.read(y), 2 * host)
    r.context.finalize()
    ctx.finalize()


def _aligned(n: int) -> np.ndarray:
    raw = np.empty(n + 16, np.float32)
    start = (-raw.ctypes.data % 64) // 4
    return raw[start : start + n]


def test_read_only_memory_is_taken_read_only() -> None:
    """A producer's read-only flag (DLPack 1.0) holds: the memory is taken without a copy and
    read by kernels, but no write reaches it (a kernel writing it, from_host, a writable
    host_view); a read-only memmap written in place used to crash the process."""
    be = get_backend("cpu")
    dev = be.get_device(0)
    host = _aligned(64)
    host[:] = np.arange(64)
    host.flags.writeable = False
    x, y = Node("ro_x", (64,)), Node("ro_y", (64,))
    ctx = dev.make_context().init_from_dlpack(x, host)
    assert dev.pool_handle(ctx.buffers[x].pool_id) == host.ctypes.data  # zero-copy, as before
    reads = ctx.link(be.compile(ir.Comp.of(ir.apply(Op.ADD, x, x, into=y)), name="ro_reads"))
    reads.run()
    np.testing.assert_array_equal(reads.context.read(y), 2 * np.arange(64))
    with pytest.raises(ReadOnlyNodeError, match=r"ro_x.*DLPack.*read-only"):
        ctx.link(be.compile(ir.Comp.of(ir.apply(Op.EXP, x, into=x)), name="ro_writes"))
    with pytest.raises(ReadOnlyNodeError):
        ctx.from_host(x, np.zeros(64, np.float32))
    with pytest.raises(ReadOnlyNodeError), ctx.host_view(x, write=True):
        pass
    with ctx.host_view(x) as values:
        assert not values.flags.writeable
    assert not np.from_dlpack(ctx.export(x)).flags.writeable
    np.testing.assert_array_equal(host, np.arange(64))
    # a child with a buffer of its own for the node may write it; the producer's memory stays
    # read-only in the context that holds it (the flag used to stay on the node, not the memory)
    own = ctx.init_from_host(x, np.ones(64, np.float32))
    own.from_host(x, np.full(64, 2, np.float32))
    writes = own.link(be.compile(ir.Comp.of(ir.apply(Op.EXP, x, into=x)), name="ro_writes"))
    writes.run()
    np.testing.assert_allclose(writes.context.read(x), np.exp(np.full(64, 2, np.float32)), rtol=1e-6)
    with pytest.raises(ReadOnlyNodeError):
        ctx.from_host(x, np.zeros(64, np.float32))
    np.testing.assert_array_equal(host, np.arange(64))
    for c in (writes.context, own, reads.context, ctx):
        c.finalize()


def test_a_constant_is_not_writable_through_a_view_or_an_export() -> None:
    """Constants are shared by every context of a device: host_view(write=True) refuses, and
    views and exports are read-only (the export used to let numpy write every context's copy)."""
    be = get_backend("cpu")
    dev = be.get_device(0)
    a, k, out = Node("ca", (4,)), Node("ck", (4,), mode=ir.MemoryMode.MATERIALIZED), Node("cout", (4,))
    code = be.compile(ir.Comp.of(ir.constant(k, np.arange(4, dtype=np.float32)), ir.apply(Op.ADD, a, k, into=out)),
                      name="const_user")
    first = dev.make_context().init_from_host(a, np.zeros(4, np.float32)).link(code)
    second = dev.make_context().init_from_host(a, np.zeros(4, np.float32)).link(code)
    with pytest.raises(ReadOnlyNodeError, match="constant"), first.context.host_view(k, write=True):
        pass
    with first.context.host_view(k) as values:
        assert not values.flags.writeable
    view = np.from_dlpack(first.context.export(k))
    assert not view.flags.writeable
    with pytest.raises(ValueError):
        view[:] = 100.0
    second.run()
    np.testing.assert_array_equal(second.context.read(out), np.arange(4))
    del view
    first.context.finalize()
    second.context.finalize()


def test_a_producer_that_refuses_is_a_typed_error_naming_the_node() -> None:
    class Refuses:
        def __dlpack__(self, **kw: Any) -> Any:
            raise BufferError("nope")

    ctx = get_backend("cpu").get_device(0).make_context()
    with pytest.raises(DTypeMismatchError, match=r"init_from_dlpack of dl_n.*refused.*nope"):
        ctx.init_from_dlpack(Node("dl_n", (2,)), Refuses())
    with pytest.raises(DTypeMismatchError, match="init_from_dlpack of dl_t"):
        ctx.init_from_dlpack(Node("dl_t", (2,)), np.zeros(2, "datetime64[s]"))


def test_memory_another_node_uses_is_refused() -> None:
    """Two nodes on one memory would break the kernels' no-alias assumption (restrict
    pointers; fusion merges and reorders work on distinct nodes, and once moved a sum read
    its input before the increment the program put first): importing an array a node of the
    context already uses, or part of it, or a polyjit export of that node, is refused and
    names both nodes; the context stays usable, and the same node may take it again."""
    backend = get_backend("cpu")
    dev = backend.get_device(0)
    raw = np.zeros(64 + 16, np.float32)
    start = (-raw.ctypes.data % 64) // 4
    host = raw[start : start + 64]
    x, y, z = Node("x", (64,)), Node("y", (64,)), Node("z", (16,))
    ctx = dev.make_context().init_from_dlpack(x, host)
    with pytest.raises(AliasedMemoryError, match=r"y#\d+.*overlaps x#\d+"):
        ctx.init_from_dlpack(y, host)
    with pytest.raises(AliasedMemoryError, match="overlaps x"):
        ctx.init_from_dlpack(z, host[16:32])  # a part of it
    with pytest.raises(AliasedMemoryError, match="overlaps x"):
        ctx.init_from_dlpack(y, ctx.export(x))  # polyjit's own export of x
    again = ctx.init_from_dlpack(x, host)  # the same node, the same memory: fine
    other = ctx.init_from_dlpack(y, np.ones(64, np.float32))  # other memory: fine
    np.testing.assert_array_equal(other.read(y), np.ones(64, np.float32))
    for c in (other, again, ctx):
        c.finalize()


def test_a_node_taking_its_own_memory_again_keeps_its_events() -> None:
    """Found by review: ``c.init_from_dlpack(x, c.export(x))`` adopted the memory as a new
    pool with events of its own, so a reader of x on another stream ran before the parent's
    write of x (5 of 5). The child now holds x's own buffer."""
    be = get_backend("cpu")
    dev = be.get_device(0)
    n = 1 << 21
    a, x, out = Node("a", (n,)), Node("x", (n,)), Node("out", (n,))
    steps, t = [], a
    for k in range(16):  # a slow chain, then x += a
        nxt = Node(f"t{k}", (n,))
        steps.append(ir.apply(Op.EXP if k % 2 == 0 else Op.LOG, t, into=nxt))
        t = nxt
    steps.append(ir.apply(Op.ADD, x, a, into=x))
    slow = be.compile(ir.Comp.of(*steps, embedded=[x]), name="slow_inc")
    double = be.compile(ir.Comp.of(ir.apply(Op.ADD, x, x, into=out)), name="double")
    other = dev.new_stream()
    for _ in range(3):
        ctx = dev.make_context().init_from_host(a, np.ones(n, np.float32)).init_from_host(x, np.zeros(n, np.float32))
        writer = ctx.link(slow)
        again = writer.context.init_from_dlpack(x, writer.context.export(x))
        assert again.buffers[x] == writer.context.buffers[x]
        reader = again.with_stream(other).link(double)
        writer.run()  # x: 0 -> 1, slow, on the default stream
        reader.run()  # on the other stream: after that write
        assert float(reader.context.read(out)[0]) == 2.0
        ctx.finalize()
    other.close()


@pytest.mark.parametrize("shift", [0, 1, 3, 4, 15])
def test_numpy_arrays_aligned_only_to_their_dtype_are_taken_and_written(shift: int) -> None:
    """numpy aligns large arrays to 16 bytes, views to their dtype: the cpu kernels take both
    in place, as inputs and as outputs of streaming-store and matmul kernels."""
    be = get_backend("cpu")
    dev = be.get_device(0)
    n = (1 << 21) + 7  # 8 MiB and more: the chain streams its stores (patterns.STREAMING_MIN_BYTES)
    rng = np.random.default_rng(shift)

    def at(offset: int, count: int) -> np.ndarray:
        raw = np.empty(count + 32, np.float32)
        start = (-raw.ctypes.data % 64) // 4 + offset  # `offset` elements past a 64-byte line
        return raw[start : start + count]

    a, b, out = at(shift, n), at(shift + 1, n), at(shift + 2, n)
    a[:], b[:], out[:] = rng.standard_normal(n), rng.standard_normal(n), 0
    m, w, prod = at(shift, 48 * 40), at(shift + 3, 40 * 24), at(shift + 5, 48 * 24)
    m[:], w[:], prod[:] = rng.standard_normal(m.size), rng.standard_normal(w.size), 0
    na, nb, nout = Node("a", (n,)), Node("b", (n,)), Node("out", (n,))
    nm, nw, nprod = Node("m", (48, 40)), Node("w", (40, 24)), Node("prod", (48, 24))
    ctx = dev.make_context()
    for node, arr in ((na, a), (nb, b), (nout, out), (nm, m.reshape(48, 40)), (nw, w.reshape(40, 24)),
                      (nprod, prod.reshape(48, 24))):
        ctx = ctx.init_from_dlpack(node, arr)
        assert dev.pool_handle(ctx.buffers[node].pool_id) == arr.ctypes.data  # in place
    ab = Node("ab", (n,))  # inlined: one kernel, streaming its stores into `out`
    chain = ir.Comp.of(ir.apply(Op.MUL, na, nb, into=ab), ir.apply(Op.ADD, ab, na, into=nout))
    matmul = ir.Comp.of(ir.einsum("ik,kj->ij", nm, nw, into=nprod))
    for comp, name in ((chain, "chain"), (matmul, "mm")):
        r = ctx.link(be.compile(comp, name=name))
        r.run()
        r.context.stream.synchronize()
    np.testing.assert_allclose(out, a * b + a, rtol=1e-5, atol=1e-6)  # written in place (FMA rounds once)
    np.testing.assert_allclose(prod.reshape(48, 24), m.reshape(48, 40) @ w.reshape(40, 24), rtol=1e-4, atol=1e-4)
    ctx.finalize()


def test_other_tensors_are_copied_or_refused() -> None:
    dev = get_backend("cpu").get_device(0)
    x = Node("x", (8, 8))
    ctx = dev.make_context()
    raw = bytearray(4 * 64 + 2)
    unaligned = np.frombuffer(raw, np.float32, count=64, offset=2).reshape(8, 8)  # not even 4-aligned
    np.frombuffer(raw, np.uint8)[2:] = np.full(64, 3, np.float32).view(np.uint8)
    copied = ctx.init_from_dlpack(x, unaligned)  # not aligned as the kernels need: a copy
    assert dev.pool_handle(copied.buffers[x].pool_id) != unaligned.ctypes.data
    np.testing.assert_array_equal(copied.read(x), unaligned)
    with pytest.raises(ShapeMismatchError, match="C-contiguous"):
        ctx.init_from_dlpack(x, np.ones((8, 16), np.float32)[:, ::2])
    with pytest.raises(DTypeMismatchError, match="float64"):
        ctx.init_from_dlpack(x, np.ones((8, 8), np.float64))
    with pytest.raises(ShapeMismatchError, match=r"\(4, 16\)"):
        ctx.init_from_dlpack(x, np.ones((4, 16), np.float32))
    with pytest.raises(InvalidArgumentError, match="__dlpack__"):
        ctx.init_from_dlpack(x, [[1.0] * 8] * 8)
    ctx.finalize()


@pytest.mark.parametrize("shape", [(0, 3), (3, 0), (0,), (2, 0, 4)])
def test_an_empty_numpy_array_is_taken(shape: tuple[int, ...]) -> None:
    """Found by review: numpy exports strides (0, 0) for zeros((0, 3)), and a 0-size array was
    refused as not C-contiguous (a 0-size torch tensor was taken); with no elements, any
    strides are contiguous, as numpy and torch say."""
    value = np.zeros(shape, np.float32)
    assert value.flags.c_contiguous
    n = Node("n", shape)
    ctx = get_backend("cpu").get_device(0).make_context().init_from_dlpack(n, value)
    assert ctx.read(n).shape == shape
    ctx.finalize()


@needs_torch
def test_torch_tensors_come_in_and_go_back() -> None:
    dev = get_backend("cpu").get_device(0)
    t = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    x, y = Node("x", (8, 8)), Node("y", (8, 8))
    ctx = dev.make_context().init_from_dlpack(x, t)
    if t.data_ptr() % 64 == 0:
        assert dev.pool_handle(ctx.buffers[x].pool_id) == t.data_ptr()
    r = ctx.link(get_backend("cpu").compile(ir.Comp.of(ir.apply(Op.EXP, x, into=y)), name="ex"))
    r.run()
    back = torch.from_dlpack(r.context.export(y))
    torch.testing.assert_close(back, torch.exp(t))
    r.context.finalize()
    ctx.finalize()


# ---------------------------------------------------------------------------
# numpy conventions, devices by name


def test_dtypes_are_what_numpy_expects() -> None:
    node = Node("n", (3, 2), dtypes.int32)
    assert np.empty(node.shape, node.dtype).dtype == np.int32
    assert node.dtype == np.int32 and node.dtype == np.dtype("int32") and node.dtype == "int32"
    assert node.dtype != np.float32 and hash(node.dtype) == hash(np.dtype(np.int32))
    assert np.dtype(dtypes.float64) == np.float64


def test_devices_by_name_and_a_default() -> None:
    cpu0 = polyjit.device("cpu:0")
    assert cpu0 is polyjit.device("cpu") is get_backend("cpu").get_device(0)
    assert str(cpu0) == "cpu:0"
    assert polyjit.default_device() is cpu0
    with pytest.raises(UnknownDeviceError, match="ordinal"):
        polyjit.device("cpu:one")
    with pytest.raises(UnknownDeviceError):
        polyjit.device("cpu:7")
    two = __import__("polyjit.backends.cpu", fromlist=["create_backend"]).create_backend(num_devices=2)
    other = two.get_device(1)
    with other:
        assert polyjit.default_device() is other
        from polyjit import tensor as pt

        x = pt.input("x", (4,))
        plan = pt.compile({"y": x * 2.0})  # no device given: the scoped default
        assert plan.device is other
        plan.close()
    assert polyjit.default_device() is cpu0
    polyjit.set_default_device(other)
    try:
        assert polyjit.default_device() is other
    finally:
        polyjit.set_default_device(None)


def test_the_default_device_comes_from_the_environment() -> None:
    code = "import polyjit; print(polyjit.default_device())"
    env = {**os.environ, "POLYJIT_DEVICE": "cpu:0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.strip() == "cpu:0", out.stderr


# ---------------------------------------------------------------------------
# Observability


@pytest.mark.parametrize("name", ["cpu", "opencl"])
def test_events_time_work_on_the_device(name: str) -> None:
    be = get_backend(name)
    if be.num_devices() == 0:
        pytest.skip(f"no {name} device")
    dev = be.get_device(0)
    n = 1 << 20
    a, out = Node("a", (n,)), Node("out", (n,))
    r = dev.make_context().init_from_host(a, np.ones(n, np.float32)).link(
        be.compile(ir.Comp.of(ir.apply(Op.TANH, a, into=out)), name="timed"))
    s = r.context.stream
    start = s.record(timing=True)
    for _ in range(5):
        r.run()
    end = s.record(timing=True)
    ms = start.elapsed_time(end)
    assert 0.0 < ms < 10_000.0
    with pytest.raises(InvalidArgumentError, match="timing=True"):
        start.elapsed_time(s.record())
    r.context.finalize()


def test_memory_statistics() -> None:
    dev = get_backend("cpu").get_device(0)
    gc.collect()
    dev.synchronize()
    before = dev.memory_stats()
    r, _, out, _ = _squared((128, 128))
    stats = dev.memory_stats()
    assert stats["used_bytes"] > before["used_bytes"] and stats["peak_bytes"] >= stats["used_bytes"]
    assert stats["pools"] > before["pools"]
    root = r.context
    while root.parent is not None:
        root = root.parent
    mine = root.memory_stats()
    assert mine["with_descendants_bytes"] >= 2 * out.nbytes and mine["own_bytes"] == 0
    root.finalize()
    assert dev.memory_stats()["used_bytes"] == before["used_bytes"]


def test_the_log_says_what_compiles_hits_and_launches(caplog: pytest.LogCaptureFixture) -> None:
    be = get_backend("cpu")
    a, out = Node("logged_a", (7,)), Node("logged_out", (7,))
    with caplog.at_level(logging.DEBUG, logger="polyjit"):
        code = be.compile(ir.Comp.of(ir.apply(Op.SQRT, a, into=out)), name="logged")
        r = be.get_device(0).make_context().init_from_host(a, np.ones(7, np.float32)).link(code)
        r.run()
    text = caplog.text
    assert "generated source in" in text
    assert "cache hit" in text or "cache miss" in text
    assert "launch logged" in text
    r.context.finalize()


def test_the_cache_command(tmp_path: Any) -> None:
    env = {**os.environ, "POLYJIT_CACHE_DIR": str(tmp_path)}
    run = [sys.executable, "-m", "polyjit.cli"]
    subprocess.run([*run, "demo", "--kernels", "--size", "1000"], env=env, capture_output=True, timeout=300)
    info = subprocess.run([*run, "cache", "info"], env=env, capture_output=True, text=True, timeout=60)
    assert str(tmp_path) in info.stdout and "cpu" in info.stdout
    cleared = subprocess.run([*run, "cache", "clear"], env=env, capture_output=True, text=True, timeout=60)
    assert "removed" in cleared.stdout
    again = subprocess.run([*run, "cache", "info"], env=env, capture_output=True, text=True, timeout=60)
    assert " 0 entries" in again.stdout


@needs_torch
def test_plan_outputs_can_stay_on_the_device() -> None:
    from polyjit import tensor as pt

    x = pt.input("x", (8, 4))
    w = pt.param("w", (4, 3), init="ones")
    plan = pt.compile({"y": x @ w})
    out = plan.run_on_device(x=np.ones((8, 4), np.float32))
    y = torch.from_dlpack(out["y"])
    torch.testing.assert_close(y, torch.full((8, 3), 4.0))
    plan.close()


def test_a_loop_that_only_exports_keeps_no_queue_of_unpins() -> None:
    """Found by review: each dropped export queued its unpin for the device's next safe point,
    and a process that only read through exports (no enqueue, link or sync) never reached one:
    245 bytes an export, for ever. An export is a safe point now."""
    dev = get_backend("cpu").get_device(0)
    node = Node("exported_in_a_loop", (64,))
    ctx = dev.make_context().init_from_host(node, np.arange(64, dtype=np.float32))
    for k in range(2000):
        view = np.from_dlpack(ctx.export(node))
        assert view[k % 64] == k % 64
        del view
    assert len(dev.released) <= 2, len(dev.released)
    ctx.finalize()
