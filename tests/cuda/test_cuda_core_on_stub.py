"""cuda.core (1.x) on the stub driver: devices, streams, events, NVRTC programs, launches,
graphs built by stream capture, and stream-ordered device and pinned memory."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import stub

# One stub GPU, in a process of its own: cuda.core switches the current context (its
# devices, its handles' destructors), which the CUDA backend's tests must not meet.
STUB_ENV = {"PJSTUB_DEVICES": "1"}

SAXPY = r"""
extern "C" __global__ void saxpy(float a, const float* x, float* y, unsigned long long n) {
  unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
extern "C" __global__ void scale(float* y, float a, unsigned long long n) {
  for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    y[i] *= a;
}
"""
N = 1000


@pytest.fixture(scope="module")
def dev(stub_driver: stub.Driver) -> Any:
    from cuda.core import Device

    d = Device(0)
    d.set_current()
    return d


@pytest.fixture(scope="module")
def kernels(dev: Any) -> dict[str, Any]:
    """The NVRTC-compiled kernels (their host code registered for the stub)."""
    from cuda.core import Program, ProgramOptions

    obj = Program(SAXPY, code_type="c++", options=ProgramOptions(arch=f"sm_{dev.arch}")).compile("cubin")
    assert obj.code[:4] == b"\x7fELF"
    stub.register_image(obj.code, SAXPY)
    return {name: obj.get_kernel(name) for name in ("saxpy", "scale")}


@pytest.fixture
def memory(dev: Any) -> Iterator[tuple[Any, Any, Any]]:
    """A stream, a device memory resource and a pinned one."""
    from cuda.core import DeviceMemoryResource, PinnedMemoryResource

    s = dev.create_stream()
    yield s, DeviceMemoryResource(dev), PinnedMemoryResource()
    s.sync()
    s.close()


def view(buffer: Any) -> np.ndarray:
    """A host buffer's bytes as float32."""
    return np.ctypeslib.as_array((ctypes.c_float * (buffer.size // 4)).from_address(int(buffer.handle)))


def test_device_properties(dev: Any) -> None:
    assert dev.name == "polyjit stub GPU"
    assert tuple(dev.compute_capability) == (9, 0) and dev.arch == "90"
    props = dev.properties
    assert props.multiprocessor_count == 132
    assert props.max_threads_per_block == 1024 and props.warp_size == 32
    assert props.max_shared_memory_per_block_optin == 232448


def test_streams_and_timed_events(dev: Any, kernels: dict[str, Any], memory: tuple[Any, Any, Any]) -> None:
    from cuda.core import EventOptions, LaunchConfig, launch

    s, mr, pmr = memory
    other = dev.create_stream()
    y, h = mr.allocate(N * 4, stream=s), pmr.allocate(N * 4, stream=s)
    view(h)[:] = 1.0
    y.copy_from(h, stream=s)
    start = s.record(options=EventOptions(timing_enabled=True))
    for _ in range(3):
        launch(s, LaunchConfig(grid=2, block=128), kernels["scale"], y, np.float32(2.0), np.uint64(N))
    end = s.record(options=EventOptions(timing_enabled=True))
    other.wait(end)  # the copy on the other stream comes after the kernels
    y.copy_to(h, stream=other)
    other.sync()
    assert (view(h) == 8.0).all()
    assert end.is_done and end - start >= 0.0
    untimed = s.record()
    s.sync()
    with pytest.raises(Exception, match=r"INVALID_HANDLE|timing"):
        _ = untimed - start
    other.close()


def test_program_kernel_launch(dev: Any, kernels: dict[str, Any], memory: tuple[Any, Any, Any]) -> None:
    from cuda.core import LaunchConfig, launch

    s, mr, pmr = memory
    x, y = mr.allocate(N * 4, stream=s), mr.allocate(N * 4, stream=s)
    hx, hy = pmr.allocate(N * 4, stream=s), pmr.allocate(N * 4, stream=s)
    view(hx)[:] = np.arange(N, dtype=np.float32)
    x.copy_from(hx, stream=s)
    y.copy_from(hx, stream=s)
    launch(s, LaunchConfig(grid=(N + 255) // 256, block=256), kernels["saxpy"], np.float32(2.0), x, y, np.uint64(N))
    y.copy_to(hy, stream=s)
    s.sync()
    np.testing.assert_array_equal(view(hy), 3 * np.arange(N, dtype=np.float32))
    with pytest.raises(Exception, match="INVALID_VALUE"):  # a block too large for any device
        launch(s, LaunchConfig(grid=1, block=2048), kernels["saxpy"], np.float32(2.0), x, y, np.uint64(N))


def test_graph_builder_capture_and_replay(dev: Any, kernels: dict[str, Any], memory: tuple[Any, Any, Any]) -> None:
    from cuda.core import LaunchConfig, launch

    s, mr, pmr = memory
    x, y, h = mr.allocate(N * 4, stream=s), mr.allocate(N * 4, stream=s), pmr.allocate(N * 4, stream=s)
    view(h)[:] = 1.0
    x.copy_from(h, stream=s)
    y.copy_from(h, stream=s)
    gb = s.create_graph_builder().begin_building()
    launch(gb, LaunchConfig(grid=4, block=256), kernels["saxpy"], np.float32(1.0), x, y, np.uint64(N))
    branch_a, branch_b = gb.split(2)  # fork: two branches, joined again below
    launch(branch_a, LaunchConfig(grid=1, block=256), kernels["scale"], x, np.float32(3.0), np.uint64(N))
    launch(branch_b, LaunchConfig(grid=1, block=256), kernels["scale"], y, np.float32(2.0), np.uint64(N))
    graph = type(gb).join(branch_a, branch_b).end_building().complete()
    y.copy_to(h, stream=s)
    s.sync()
    assert (view(h) == 1.0).all()  # capturing ran nothing
    for _ in range(2):  # y = 2 * (x + y), x = 3 * x
        graph.launch(s)
    y.copy_to(h, stream=s)
    s.sync()
    assert (view(h) == 2 * (3 + 4)).all()
    graph.close()


def test_memory_resources_and_copies(dev: Any, memory: tuple[Any, Any, Any]) -> None:
    s, mr, pmr = memory
    d1, d2 = mr.allocate(N * 4, stream=s), mr.allocate(N * 4, stream=s)
    h1, h2 = pmr.allocate(N * 4, stream=s), pmr.allocate(N * 4, stream=s)
    assert d1.is_device_accessible and not d1.is_host_accessible
    assert h1.is_host_accessible
    view(h1)[:] = np.arange(N, dtype=np.float32)
    view(h2)[:] = 0.0
    d1.copy_from(h1, stream=s)
    d2.copy_from(d1, stream=s)
    assert not view(h2).any()
    d2.copy_to(h2, stream=s)  # into pooled host memory: returns when done (as the next test shows)
    np.testing.assert_array_equal(view(h2), view(h1))
    s.sync()
    for b in (d1, d2, h1, h2):
        b.close(stream=s)
    s.sync()


def test_a_copy_into_pooled_pinned_memory_waits_for_the_stream(dev: Any, kernels: dict[str, Any],
                                                                  memory: tuple[Any, Any, Any]) -> None:
    """As the real driver did (docs/benchmarks.md, session 19): a device-to-host copy into
    ``PinnedMemoryResource`` memory (a host memory pool) returns once the stream's work before
    it is done; into ``cuMemAllocHost`` memory (``LegacyPinnedMemoryResource``'s) it returns at
    once, the bytes landing in stream order. (Why the CUDA backend's staging ring is the latter.)"""
    from cuda.bindings import driver as cu
    from cuda.core import LaunchConfig, launch

    s, mr, pmr = memory
    y, src, pooled = mr.allocate(N * 4, stream=s), pmr.allocate(N * 4, stream=s), pmr.allocate(N * 4, stream=s)
    err, addr = cu.cuMemAllocHost(N * 4)
    assert err == cu.CUresult.CUDA_SUCCESS
    plain = np.ctypeslib.as_array((ctypes.c_float * N).from_address(int(addr)))
    s.sync()
    view(src)[:] = 1.0
    view(pooled)[:] = plain[:] = 0.0
    y.copy_from(src, stream=s)
    launch(s, LaunchConfig(grid=2, block=128), kernels["scale"], y, np.float32(3.0), np.uint64(N))
    err, = cu.cuMemcpyDtoHAsync(int(addr), int(y.handle), N * 4, int(s.handle))
    assert err == cu.CUresult.CUDA_SUCCESS
    assert (plain == 0.0).all()  # queued behind the kernel, not run yet
    y.copy_to(pooled, stream=s)
    assert (view(pooled) == 3.0).all()  # returned only when done
    s.sync()
    assert (plain == 3.0).all()
    assert cu.cuMemFreeHost(int(addr))[0] == cu.CUresult.CUDA_SUCCESS
