"""Transfers: between the cpu and OpenCL backends, and between two devices of one platform
(``TestTwoDevices``: with one device here, ``test_two_device_tests_in_a_subprocess`` in
test_opencl_conformance.py runs them with two)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from opencl_helpers import f32, slow_accumulate

from polyjit.backends import get_backend
from polyjit.core import ir
from polyjit.core.ir import Op
from polyjit.core.protocol import MergeBuffer
from polyjit.core.runtime import Backend, device_to_device, init_from_device

pytest.importorskip("pyopencl")


def test_cpu_and_opencl_copies_are_staged(backend: Backend) -> None:
    cpu = get_backend("cpu")
    x = f32("x", (1000,))
    xv = np.random.default_rng(6).standard_normal(1000).astype(np.float32)
    c_ctx = cpu.get_device(0).make_context().init_from_host(x, xv)
    o_ctx = backend.get_device(0).make_context().init_from_host(x, np.zeros(1000, np.float32))
    device_to_device(x, dst=o_ctx, src=c_ctx)
    np.testing.assert_array_equal(o_ctx.read(x), xv)
    back = init_from_device(x, dst=cpu.get_device(0).make_context(), src=o_ctx)
    np.testing.assert_array_equal(back.read(x), xv)
    for ctx in (back, o_ctx, c_ctx):
        ctx.finalize()


# ---------------------------------------------------------------------------
# Two devices of one platform


class TestTwoDevices:
    def test_devices_share_a_context(self, two_devices: Backend) -> None:
        d = two_devices.driver.devices  # type: ignore[attr-defined]
        assert d[0].context is d[1].context

    def test_copies_both_ways(self, two_devices: Backend) -> None:
        d0, d1 = two_devices.get_device(0), two_devices.get_device(1)
        rng = np.random.default_rng(7)
        x = f32("x", (3, 1000))
        v0, v1 = rng.standard_normal((3, 1000)).astype(np.float32), rng.standard_normal((3, 1000)).astype(np.float32)
        c0 = d0.make_context().init_from_host(x, v0)
        c1 = d1.make_context().init_from_host(x, v1)
        device_to_device(x, dst=c1, src=c0)
        np.testing.assert_array_equal(c1.read(x), v0)
        c0.from_host(x, v1 * 2)
        device_to_device(x, dst=c0, src=c1)  # back: c0 now holds v0 again
        np.testing.assert_array_equal(c0.read(x), v0)
        fresh = init_from_device(x, dst=d1.make_context(), src=c0)
        np.testing.assert_array_equal(fresh.read(x), v0)
        for ctx in (fresh, c1, c0):
            ctx.finalize()

    def test_merge_buffer_reduction_across_devices(self, two_devices: Backend) -> None:
        d0, d1 = two_devices.get_device(0), two_devices.get_device(1)
        n = 4099
        part, total = f32("part", (n,)), f32("total", (n,))
        rng = np.random.default_rng(8)
        v0, v1 = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
        c0 = d0.make_context().init_from_host(part, v0)
        c1 = d1.make_context().init_from_host(part, v1)
        merged = device_to_device(part, dst=c0, src=c1, into_merge_buffer=MergeBuffer.COPY)
        assert merged is not None
        add = ir.Comp.of(ir.apply(Op.ADD, part, ir.merge(part), into=total))
        r = merged.context.link(two_devices.compile(add, name="all_reduce"))
        r.run()
        np.testing.assert_allclose(r.context.read(total), v0 + v1, rtol=1e-6)
        # and back to device 1
        c1b = c1.init_from_host(total, np.zeros(n, np.float32))
        device_to_device(total, dst=c1b, src=r.context)
        np.testing.assert_allclose(c1b.read(total), v0 + v1, rtol=1e-6)
        c1.finalize()
        c0.finalize()

    def test_a_routine_on_device_1_waits_for_a_write_on_device_0(self, two_devices: Backend) -> None:
        d0, d1 = two_devices.get_device(0), two_devices.get_device(1)
        comp, x, acc = slow_accumulate()
        n = x.shape[0]
        out = f32("out", (n,))
        c0 = d0.make_context().init_from_host(x, np.ones(n, np.float32)).init_from_host(acc, np.zeros(n, np.float32))
        w = c0.link(two_devices.compile(comp, name="slow"))
        c1 = d1.make_context().init_from_host(acc, np.zeros(n, np.float32))
        r = c1.link(two_devices.compile(ir.Comp.of(ir.apply(Op.ADD, acc, 1.0, into=out)), name="plus1"))
        for _ in range(8):
            w.run()
        t0 = time.perf_counter()
        device_to_device(acc, dst=c1, src=c0)  # enqueued behind the writes, device side
        r.run()
        enqueue_s = time.perf_counter() - t0
        np.testing.assert_array_equal(r.context.read(out), np.full(n, 9, np.float32))
        assert enqueue_s < 5.0
        c1.finalize()
        c0.finalize()

    def test_same_node_on_two_streams_of_each_device(self, two_devices: Backend) -> None:
        d0, d1 = two_devices.get_device(0), two_devices.get_device(1)
        x, y = f32("x", (512,)), f32("y", (512,))
        xv = np.arange(512, dtype=np.float32)
        c0 = d0.make_context(d0.new_stream()).init_from_host(x, xv)
        c1 = d1.make_context(d1.new_stream()).init_from_host(x, np.zeros(512, np.float32))
        device_to_device(x, dst=c1, src=c0)
        r = c1.link(two_devices.compile(ir.Comp.of(ir.apply(Op.NEG, x, into=y)), name="neg"))
        r.run()
        np.testing.assert_array_equal(r.context.read(y), -xv)
        c1.finalize()
        c0.finalize()
