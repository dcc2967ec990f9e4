"""polyjit's CUDA backend on two stub GPUs: the conformance kit (with its two-device
checks), peers, copies across streams and devices, data parallel training."""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import numpy as np
import pytest
import stub
from scenarios import f32

from polyjit import device_to_device
from polyjit.backends import cuda
from polyjit.core import ir
from polyjit.core.ir import Op
from polyjit.testing import ConformanceSuite

STUB_ENV = {"PJSTUB_DEVICES": "2"}


def test_devices_and_peers(backend: Any) -> None:
    assert backend.num_devices() == 2 and backend.unavailable_reason is None
    d0, d1 = backend.get_device(0), backend.get_device(1)
    assert d0.properties["peer_access"] == (False, True)
    assert d1.properties["peer_access"] == (True, False)
    assert d0.properties["peer_matrix"] == ((False, True), (True, False))
    assert backend.static_properties()["archs"] == ("sm_90", "sm_90")
    assert d1.device_id == "cuda:1"


def test_copies_across_streams_and_devices(backend: Any, schedule: str) -> None:
    from polyjit.core.protocol import MergeBuffer

    d0, d1 = backend.get_device(0), backend.get_device(1)
    n = 5000
    x, y = f32("x", (n,)), f32("y", (n,))
    h = np.random.default_rng(4).standard_normal(n).astype(np.float32)
    a = d0.make_context(d0.new_stream()).init_from_host(x, h)
    b = d0.make_context(d0.new_stream()).init_from_host(x, np.zeros(n, np.float32))
    inc = a.link(backend.compile(ir.Comp.of(ir.apply(Op.ADD, x, 1.0, into=x)), name="inc"))
    for _ in range(3):
        inc.run()
    device_to_device(x, dst=b, src=inc.context)  # two contexts, two streams, one device
    np.testing.assert_allclose(b.read(x), h + 3, rtol=1e-6)
    c = d1.make_context().init_from_host(x, np.zeros(n, np.float32))
    inc.run()
    device_to_device(x, dst=c, src=inc.context)  # a peer copy, after the writer on device 0
    np.testing.assert_allclose(c.read(x), h + 4, rtol=1e-6)
    t = device_to_device(x, dst=c, src=b, into_merge_buffer=MergeBuffer.COPY)
    assert t is not None
    r = t.context.link(backend.compile(ir.Comp.of(ir.apply(Op.MUL, ir.merge(x), 2.0, into=y)), name="m"))
    r.run()
    np.testing.assert_allclose(r.context.read(y), (h + 3) * 2, rtol=1e-6)
    plan = cuda.capture([r])
    plan.replay()
    np.testing.assert_allclose(r.context.read(y), (h + 3) * 2, rtol=1e-6)
    plan.close()
    for ctx in (r.context, c, b, inc.context, a):
        ctx.finalize()


def test_data_parallel_on_two_gpus_matches_one_cpu_device(backend: Any, schedule: str,
                                                          stub_driver: stub.Driver) -> None:
    """Two replicas over peer copies, merge buffers and replayed graphs give the parameters
    one CPU device gets."""
    from polyjit import tensor as pt

    rng = np.random.default_rng(2)
    xs, ys = rng.standard_normal((5, 16, 6)).astype(np.float32), rng.integers(0, 3, (5, 16)).astype(np.int32)

    def train(devices: Any) -> dict[str, np.ndarray]:
        mlp = pt.MLP("mlp", [6, 8, 3], seed=4)
        dp = pt.data_parallel(lambda x, y: pt.cross_entropy(mlp(x), y),
                              {"x": ((16, 6), "float32"), "y": ((16,), "int32")},
                              optimizer=pt.SGD(0.1, momentum=0.9), devices=devices)
        for k in range(5):
            dp.step(x=xs[k], y=ys[k])
        assert dp.replica_spread() == 0.0
        params = dp.parameters()
        dp.close()
        return params

    before = stub_driver.count("graph_launches")
    two = train(backend.devices())
    assert stub_driver.count("graph_launches") - before == 5 * 2 * 2  # compute and update, per replica
    one = train(["cpu"])
    for name, value in one.items():
        np.testing.assert_allclose(two[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_threads_share_devices_and_contexts(backend: Any) -> None:
    """Routines linked in the main thread run, and are read, from other threads (each gets
    its device's context made current, the stub refusing work from a thread without one)."""
    x, y = f32("x", (4096,)), f32("y", (4096,))
    h = np.arange(4096, dtype=np.float32)
    code = backend.compile(ir.Comp.of(ir.apply(Op.ADD, x, 1.0, into=y)), name="plus_one")
    routines = [backend.get_device(k).make_context().init_from_host(x, h).link(code) for k in range(2)]
    results: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for _ in range(3):
                routines[k].run()
            results[k] = routines[k].context.read(y)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1, 0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(2):
        np.testing.assert_array_equal(results[k], h + 1)
    for r in routines:
        r.context.finalize()
        r.context.parent.finalize()


class TestConformanceKit(ConformanceSuite):
    """The conformance kit on two stub GPUs, others first (the schedule that runs every
    other stream before the one a host thread waits for)."""

    backend_name = "cuda-stub"
    _backend: ClassVar[Any] = None

    @pytest.fixture(autouse=True)
    def _install(self, backend: Any, stub_driver: stub.Driver) -> None:
        TestConformanceKit._backend = backend
        stub_driver.set_schedule(stub.OTHERS_FIRST)

    def backend(self) -> Any:
        return self._backend

    def multi_device_backend(self) -> Any:
        return self._backend


def test_pools_are_polyjits_own_not_the_devices_shared_pool(backend: Any) -> None:
    """Found by review: pools came from the device's current memory pool, which other libraries
    in the process share (cuda.core, CuPy or PyTorch with cudaMallocAsync): allocated_bytes counted
    their memory, and a copy between devices made their pool reachable from the other device."""
    from cuda.core import Device, DeviceMemoryResource

    x = f32("x", (1000,))
    ctx0 = backend.get_device(0).make_context().init_from_host(x, np.ones(1000, np.float32))
    ours = backend.driver.allocated_bytes(0)
    dev = Device(0)
    dev.set_current()
    theirs = DeviceMemoryResource(dev)  # another library's: the device's current pool
    stream = dev.create_stream()
    buf = theirs.allocate(64 << 20, stream=stream)
    stream.sync()
    assert backend.driver.allocated_bytes(0) == ours
    ctx1 = backend.get_device(1).make_context().init_from_host(x, np.zeros(1000, np.float32))
    device_to_device(x, dst=ctx1, src=ctx0)
    np.testing.assert_array_equal(ctx1.read(x), np.ones(1000, np.float32))
    assert list(theirs.peer_accessible_by) == []
    buf.close(stream)
    stream.sync()
    ctx0.finalize()
    ctx1.finalize()
