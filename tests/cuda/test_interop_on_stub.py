"""DLPack and ``__cuda_array_interface__`` of polyjit's CUDA buffers, on a stub GPU, with
cuda.core as the other library: exports are the node's own device memory (no copy), a
consumer's stream is ordered after the node's writer, and device tensors come in without a
copy. The stub's deferred streams (target first) turn a missing wait into stale data."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import stub
from scenarios import f32

from polyjit.core import dlpack, dtypes, ir
from polyjit.core.errors import DTypeMismatchError, FinalizedError, ShapeMismatchError
from polyjit.core.ir import Op

STUB_ENV: dict[str, str] = {}  # one stub GPU, the child of test_backend_on_stub.py
N = 4096
X, Y = f32("x", (N,)), f32("y", (N,))
HOST = np.arange(N, dtype=np.float32)


@pytest.fixture
def target_first(stub_driver: stub.Driver) -> Iterator[None]:
    old = stub_driver.set_schedule(stub.TARGET_FIRST)
    yield
    stub_driver.set_schedule(old)


def _doubled(backend: Any) -> Any:
    ctx = backend.get_device(0).make_context().init_from_host(X, HOST)
    return ctx.link(backend.compile(ir.Comp.of(ir.apply(Op.MUL, X, 2.0, into=Y)), name="interop_doubled"))


def _device_read(ptr: int, nbytes: int) -> np.ndarray:
    from cuda.bindings import driver as cu

    out = np.empty(nbytes, np.uint8)
    (err,) = cu.cuMemcpyDtoH(out.ctypes.data, ptr, nbytes)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    return out


def _device_write(ptr: int, values: np.ndarray) -> None:
    from cuda.bindings import driver as cu

    (err,) = cu.cuMemcpyHtoD(ptr, values.ctypes.data, values.nbytes)
    assert err == cu.CUresult.CUDA_SUCCESS, err


def test_export_is_the_nodes_device_memory(backend: Any, target_first: None) -> None:
    from cuda.core.utils import StridedMemoryView

    r = _doubled(backend)
    r.run()
    exported = r.context.export(Y)
    assert exported.__dlpack_device__() == (2, 0)  # kDLCUDA, device 0
    cai = exported.__cuda_array_interface__  # syncs after the writer (no stream given)
    assert cai["shape"] == (N,) and cai["typestr"] == "<f4" and cai["version"] == 3
    ptr = cai["data"][0]
    view = StridedMemoryView(exported, stream_ptr=-1)  # cuda.core reads it through DLPack
    assert view.ptr == ptr and tuple(view.shape) == (N,) and view.dtype == np.float32
    np.testing.assert_array_equal(_device_read(ptr, N * 4).view(np.float32), HOST * 2)
    # written through the other library's pointer: polyjit reads what it wrote
    _device_write(ptr, np.full(N, 7.0, np.float32))
    np.testing.assert_array_equal(r.context.read(Y), np.full(N, 7.0, np.float32))
    r.context.finalize()


def test_a_consumer_stream_waits_for_the_writer(backend: Any, target_first: None) -> None:
    """``__dlpack__(stream=s)`` makes the consumer's stream s wait for the routine that
    writes the node, without a host sync: a copy on s sees the new values."""
    from cuda.bindings import driver as cu
    from cuda.core import Device

    dev = Device(0)
    dev.set_current()
    s = dev.create_stream()
    r = _doubled(backend)
    r.run()
    exported = r.context.export(Y)
    exported.__dlpack__(stream=int(s.handle))
    pinned = np.zeros(N, np.float32)
    (err,) = cu.cuMemcpyDtoHAsync(pinned.ctypes.data, exported.address, N * 4, s.handle)
    assert err == cu.CUresult.CUDA_SUCCESS
    s.sync()
    np.testing.assert_array_equal(pinned, HOST * 2)
    s.close()
    r.context.finalize()


def test_device_tensors_come_in_without_a_copy(backend: Any) -> None:
    """A polyjit export imported into another context of the same device shares its memory;
    a cuda.core buffer (bytes) comes in as a uint8 node."""
    from cuda.core import Device

    r = _doubled(backend)
    r.run()
    src = r.context
    other = backend.get_device(0).make_context()
    z = f32("z", (N,))
    taken = other.init_from_dlpack(z, src.export(Y))
    np.testing.assert_array_equal(taken.read(z), HOST * 2)
    assert taken.export(z).address == src.export(Y).address

    dev = Device(0)
    dev.set_current()
    s = dev.create_stream()
    buf = dev.allocate(N * 4, stream=s)
    s.sync()
    _device_write(int(buf.handle), HOST + 1)
    with pytest.raises(DTypeMismatchError, match="type code 0 with 8 bits"):
        other.init_from_dlpack(ir.Node("b", (N * 4,), dtypes.uint8), buf)  # cuda.core exports int8

    class Producer:  # another library's float32 tensor over that buffer
        def __dlpack_device__(self) -> tuple[int, int]:
            return (2, 0)

        def __dlpack__(self, **_: Any) -> Any:
            return dlpack.make_capsule(int(buf.handle), (N,), dtypes.float32, (2, 0), buf, False)

    b = f32("b", (N,))
    got = other.init_from_dlpack(b, Producer())
    assert got.export(b).address == int(buf.handle)
    np.testing.assert_array_equal(got.read(b), HOST + 1)
    got.finalize()
    taken.finalize()
    src.finalize()
    buf.close(s)
    s.close()


def test_misuse_is_typed_and_an_export_outlives_its_context(backend: Any) -> None:
    r = _doubled(backend)
    r.run()
    ctx = r.context
    exported = ctx.export(Y)
    with pytest.raises(ShapeMismatchError, match="shape"):
        ctx.init_from_dlpack(f32("w", (N + 1,)), exported)
    ctx.finalize()
    with pytest.raises(FinalizedError):
        ctx.export(Y)
    # the export pins the buffer: its memory still holds the values after finalize
    np.testing.assert_array_equal(_device_read(exported.address, N * 4).view(np.float32), HOST * 2)
    exported.release()
    backend.get_device(0).synchronize()
