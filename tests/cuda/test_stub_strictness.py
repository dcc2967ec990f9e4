"""The stub driver is as strict as a real one: each rule, through the real cuda.bindings.

Stub devices of different archs (9.0, 8.6 and 12.3; the rules are shown on the first
two; the third is newer than NVRTC, see test_backend_mixed_archs.py). Every failing call shows the
CUresult the real driver gives. Kernels come from NVRTC; their host code is registered
by the NVRTC hook (see conftest.py and stub.py).
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import stub

STUB_ENV = {"PJSTUB_DEVICES": "3", "PJSTUB_CC": "9.0,8.6,12.3"}  # as test_backend_mixed_archs.py

KERNELS = r"""
extern "C" __global__ void fill(float* p, float v, long long n) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) p[i] = v;
}
extern "C" __global__ void add(float* dst, const float* src, long long n) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) dst[i] += src[i];
}
extern "C" __global__ void __launch_bounds__(128) bounded(float* p) { p[threadIdx.x] = 1.0f; }
extern "C" __device__ __noinline__ float helper(float x) { return 2.0f * x; }
extern "C" __global__ void twice(float* p) { p[threadIdx.x] = helper(p[threadIdx.x]); }
"""

N = 256


def _cu() -> Any:
    from cuda.bindings import driver

    return driver


def ok(result: Any) -> Any:
    """The value(s) of a successful call."""
    err = result[0]
    assert err == _cu().CUresult.CUDA_SUCCESS, f"expected CUDA_SUCCESS, got {err!r}"
    return result[1] if len(result) == 2 else result[1:] if len(result) > 2 else None


def fails(result: Any, name: str) -> None:
    """The call returned CUresult ``name``."""
    err = result[0]
    assert err == getattr(_cu().CUresult, name), f"expected {name}, got {err!r}"


def image(arch: str = "sm_90", kind: str = "cubin", register: bool = True) -> bytes:
    """The kernels compiled by polyjit's NVRTC step; ``register=False`` bypasses the hook
    (and compiles other kernels, with ``twice`` named ``thrice``, so that no earlier
    registration covers the image)."""
    from polyjit.backends import cuda

    if register:
        return cuda.nvrtc_compile(KERNELS, arch, kind=kind)
    return cuda.nvrtc_compile.__wrapped__(KERNELS.replace("twice", "thrice"), arch, kind=kind)  # type: ignore[attr-defined]


class Args:
    """A kernelParams array over ctypes values (kept alive with it)."""

    def __init__(self, *values: ctypes._SimpleCData) -> None:
        self.values = values
        self.array = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])

    @property
    def addr(self) -> int:
        return ctypes.addressof(self.array)


def ptr(p: Any) -> ctypes.c_void_p:
    return ctypes.c_void_p(int(p))


@pytest.fixture
def ctxs(stub_driver: stub.Driver) -> Iterator[list[Any]]:
    """The primary contexts of both devices, device 0's current."""
    cu = _cu()
    got = [ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(d)))) for d in range(2)]
    ok(cu.cuCtxSetCurrent(got[0]))
    yield got
    ok(cu.cuCtxSetCurrent(got[0]))
    for d in range(2):
        ok(cu.cuDevicePrimaryCtxRelease(ok(cu.cuDeviceGet(d))))


@pytest.fixture
def module(ctxs: list[Any]) -> Iterator[Any]:
    cu = _cu()
    mod = ok(cu.cuModuleLoadData(image()))
    yield mod
    cu.cuModuleUnload(mod)


def launch(func: Any, args: Args, stream: Any, grid: tuple[int, int, int] = (1, 1, 1),
           block: tuple[int, int, int] = (N, 1, 1), shared: int = 0) -> Any:
    return _cu().cuLaunchKernel(func, *grid, *block, shared, stream, args.addr, 0)


def pinned(n: int) -> tuple[int, np.ndarray]:
    addr = int(ok(_cu().cuMemHostAlloc(n * 4, 0)))
    return addr, np.ctypeslib.as_array((ctypes.c_float * n).from_address(addr))


# ---------------------------------------------------------------------------
# Devices, entry points, the build


def test_devices_describe_themselves(ctxs: list[Any]) -> None:
    cu = _cu()
    assert ok(cu.cuDeviceGetCount()) == 3
    name = ok(cu.cuDeviceGetName(64, ok(cu.cuDeviceGet(0))))
    assert name.split(b"\0")[0] == b"polyjit stub GPU"
    attr = cu.CUdevice_attribute
    cc = [(ok(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, d)),
           ok(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, d))) for d in range(3)]
    assert cc == [(9, 0), (8, 6), (12, 3)]
    assert ok(cu.cuDeviceTotalMem(0)) == 1 << 30
    assert ok(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0)) == 132
    assert ok(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, 0)) == 232448
    assert ok(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT, 0)) == 512
    assert ok(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_DEPTH, 0)) == 0  # unknown: 0
    fails(cu.cuDeviceGet(3), "CUDA_ERROR_INVALID_DEVICE")
    fails(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_WARP_SIZE, 5), "CUDA_ERROR_INVALID_DEVICE")


def test_entry_points_the_stub_lacks_fail_cleanly(ctxs: list[Any]) -> None:
    """cuGetProcAddress says NOT_FOUND for what the stub does not implement, so calling it
    raises in Python instead of crashing."""
    cu = _cu()
    with pytest.raises(Exception, match="not found"):
        cu.cuMemAllocManaged(1024, 1)


def test_zero_stub_devices_is_no_device(stub_driver: stub.Driver) -> None:
    code = ("from cuda.bindings import driver as cu; print(cu.cuInit(0)[0].name); "
            "from polyjit.backends import cuda; b = cuda.create_backend(); "
            "print(b.num_devices(), b.unavailable_reason)")
    import os

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PJSTUB_DEVICES": "0"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert lines[0] == "CUDA_ERROR_NO_DEVICE"
    assert lines[1].startswith("0 cuInit failed: CUDA_ERROR_NO_DEVICE")


def test_the_stub_compiles_without_warnings(tmp_path: Any) -> None:
    cc = stub.c_compiler()
    assert cc is not None
    proc = subprocess.run([cc, "-std=gnu11", "-Wall", "-Wextra", "-O2", "-fPIC", "-shared", "-pthread",
                           "-o", str(tmp_path / "libcuda.so.1"), str(stub.SOURCE), "-ldl"],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr


# ---------------------------------------------------------------------------
# Handles


def test_made_up_and_destroyed_handles(ctxs: list[Any], module: Any) -> None:
    cu = _cu()
    fails(cu.cuStreamSynchronize(cu.CUstream(0xDEAD0)), "CUDA_ERROR_INVALID_HANDLE")
    fails(cu.cuEventQuery(cu.CUevent(0xDEAD0)), "CUDA_ERROR_INVALID_HANDLE")
    fails(cu.cuCtxSetCurrent(cu.CUcontext(0xDEAD0)), "CUDA_ERROR_INVALID_CONTEXT")
    fails(cu.cuModuleGetFunction(cu.CUmodule(0xDEAD0), b"fill"), "CUDA_ERROR_INVALID_HANDLE")
    fails(cu.cuGraphLaunch(cu.CUgraphExec(0xDEAD0), 0), "CUDA_ERROR_INVALID_VALUE")
    fails(cu.cuGraphInstantiate(cu.CUgraph(0xDEAD0), 0), "CUDA_ERROR_INVALID_VALUE")
    graph = ok(cu.cuGraphCreate(0))
    ok(cu.cuGraphDestroy(graph))
    fails(cu.cuGraphDestroy(graph), "CUDA_ERROR_INVALID_VALUE")
    fails(cu.cuMemPoolTrimTo(cu.CUmemoryPool(0xDEAD0), 0), "CUDA_ERROR_INVALID_VALUE")
    s = ok(cu.cuStreamCreate(0))
    ok(cu.cuStreamDestroy(s))
    fails(cu.cuStreamSynchronize(s), "CUDA_ERROR_INVALID_HANDLE")
    fails(cu.cuStreamDestroy(s), "CUDA_ERROR_INVALID_HANDLE")
    e = ok(cu.cuEventCreate(0))
    ok(cu.cuEventDestroy(e))
    fails(cu.cuEventRecord(e, 0), "CUDA_ERROR_INVALID_HANDLE")
    # a function dies with its module; a kernel with its library
    mod = ok(cu.cuModuleLoadData(image()))
    f = ok(cu.cuModuleGetFunction(mod, b"twice"))
    ok(cu.cuModuleUnload(mod))
    p = ok(cu.cuMemAlloc(N * 4))
    fails(launch(f, Args(ptr(p)), 0), "CUDA_ERROR_INVALID_HANDLE")
    fails(cu.cuModuleGetFunction(mod, b"twice"), "CUDA_ERROR_INVALID_HANDLE")
    lib = ok(cu.cuLibraryLoadData(image(), None, None, 0, None, None, 0))
    k = ok(cu.cuLibraryGetKernel(lib, b"twice"))
    ok(cu.cuLibraryUnload(lib))
    fails(cu.cuKernelGetFunction(k), "CUDA_ERROR_INVALID_HANDLE")
    ok(cu.cuMemFree(p))
    fails(cu.cuMemFree(p), "CUDA_ERROR_INVALID_VALUE")  # a double free


def test_a_fresh_thread_has_no_current_context(ctxs: list[Any]) -> None:
    cu = _cu()
    s = ok(cu.cuStreamCreate(0))
    p = ok(cu.cuMemAlloc(64))
    host = np.zeros(16, np.float32)
    seen: dict[str, Any] = {}

    def worker() -> None:
        seen["current"] = ok(cu.cuCtxGetCurrent())
        seen["alloc"] = cu.cuMemAlloc(64)[0]
        seen["stream"] = cu.cuStreamCreate(0)[0]
        seen["copy"] = cu.cuMemcpyHtoDAsync(p, host.ctypes.data, 64, s)[0]
        seen["module"] = cu.cuModuleLoadData(image())[0]
        ok(cu.cuCtxSetCurrent(ctxs[1]))
        seen["after"] = cu.cuMemAlloc(64)[0]
        ok(cu.cuMemFree(cu.CUdeviceptr(0)))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert int(seen["current"]) == 0
    for what in ("alloc", "stream", "copy", "module"):
        assert seen[what] == cu.CUresult.CUDA_ERROR_INVALID_CONTEXT, what
    assert seen["after"] == cu.CUresult.CUDA_SUCCESS
    assert int(ok(cu.cuCtxGetCurrent())) == int(ctxs[0])  # this thread's is untouched
    # the context stack is per thread too
    ok(cu.cuCtxPushCurrent(ctxs[1]))
    assert int(ok(cu.cuCtxGetCurrent())) == int(ctxs[1])
    assert int(ok(cu.cuCtxPopCurrent())) == int(ctxs[1])
    assert int(ok(cu.cuCtxGetCurrent())) == int(ctxs[0])
    ok(cu.cuStreamDestroy(s))
    ok(cu.cuMemFree(p))


# ---------------------------------------------------------------------------
# Memory


def test_copies_and_memsets_stay_inside_allocations(ctxs: list[Any]) -> None:
    cu = _cu()
    s = ok(cu.cuStreamCreate(0))
    a, b = ok(cu.cuMemAlloc(1000)), ok(cu.cuMemAlloc(1000))
    host = np.zeros(2000, np.uint8)
    ok(cu.cuMemcpyHtoDAsync(a, host.ctypes.data, 1000, s))
    fails(cu.cuMemcpyHtoDAsync(a, host.ctypes.data, 1001, s), "CUDA_ERROR_INVALID_VALUE")
    fails(cu.cuMemcpyHtoDAsync(int(a) + 500, host.ctypes.data, 501, s), "CUDA_ERROR_INVALID_VALUE")
    fails(cu.cuMemcpyDtoHAsync(host.ctypes.data, int(a) + 1, 1000, s), "CUDA_ERROR_INVALID_VALUE")
    fails(cu.cuMemcpyDtoDAsync(b, a, 1001, s), "CUDA_ERROR_INVALID_VALUE")
    fails(cu.cuMemcpyAsync(b, int(a) + 999, 2, s), "CUDA_ERROR_INVALID_VALUE")
    fails(cu.cuMemsetD8Async(a, 0, 1001, s), "CUDA_ERROR_INVALID_VALUE")
    fails(cu.cuMemsetD32Async(int(a) + 2, 0, 4, s), "CUDA_ERROR_INVALID_VALUE")  # misaligned
    fails(cu.cuMemsetD32Async(a, 0, 251, s), "CUDA_ERROR_INVALID_VALUE")
    ok(cu.cuMemsetD32Async(a, 7, 250, s))
    # device memory is not host memory, and a made-up pointer is no memory at all
    fails(cu.cuMemcpyHtoDAsync(b, int(a), 10, s), "CUDA_ERROR_INVALID_VALUE")
    fails(cu.cuMemcpyDtoHAsync(int(b), a, 10, s), "CUDA_ERROR_INVALID_VALUE")
    fails(cu.cuMemcpyDtoDAsync(b, 0x1000, 10, s), "CUDA_ERROR_INVALID_VALUE")
    ok(cu.cuMemFree(a))
    fails(cu.cuMemcpyHtoDAsync(a, host.ctypes.data, 10, s), "CUDA_ERROR_INVALID_VALUE")  # freed
    # the device's memory is what it says
    free, total = ok(cu.cuMemGetInfo())
    assert total == 1 << 30 and free < total
    fails(cu.cuMemAlloc(1 << 30), "CUDA_ERROR_OUT_OF_MEMORY")
    fails(cu.cuMemAlloc(0), "CUDA_ERROR_INVALID_VALUE")
    ok(cu.cuStreamSynchronize(s))
    ok(cu.cuMemFree(b))
    ok(cu.cuStreamDestroy(s))


# ---------------------------------------------------------------------------
# Images and kernels


def test_images_must_fit_the_device(ctxs: list[Any]) -> None:
    cu = _cu()
    fails(cu.cuModuleLoadData(image("sm_80")), "CUDA_ERROR_NO_BINARY_FOR_GPU")  # device 0 is 9.0
    fails(cu.cuModuleLoadData(b"\x7fELF but not a cubin" + bytes(100)), "CUDA_ERROR_INVALID_IMAGE")
    fails(cu.cuModuleLoadData(b"garbage" * 20), "CUDA_ERROR_INVALID_IMAGE")
    ok(cu.cuModuleUnload(ok(cu.cuModuleLoadData(image("sm_90")))))
    ok(cu.cuModuleUnload(ok(cu.cuModuleLoadData(image("sm_80", kind="ptx")))))  # PTX: JIT-compiled
    fails(cu.cuModuleLoadData(image("sm_100", kind="ptx")), "CUDA_ERROR_INVALID_PTX")  # a newer arch
    ok(cu.cuCtxSetCurrent(ctxs[1]))  # 8.6: sm_80 and sm_86 cubins run, sm_90 does not
    ok(cu.cuModuleUnload(ok(cu.cuModuleLoadData(image("sm_80")))))
    ok(cu.cuModuleUnload(ok(cu.cuModuleLoadData(image("sm_86")))))
    fails(cu.cuModuleLoadData(image("sm_90")), "CUDA_ERROR_NO_BINARY_FOR_GPU")
    fails(cu.cuModuleLoadData(image("sm_89")), "CUDA_ERROR_NO_BINARY_FOR_GPU")
    # a library loads where some device runs it; its kernels only get functions there
    lib = ok(cu.cuLibraryLoadData(image("sm_90"), None, None, 0, None, None, 0))
    k = ok(cu.cuLibraryGetKernel(lib, b"fill"))
    fails(cu.cuKernelGetFunction(k), "CUDA_ERROR_NO_BINARY_FOR_GPU")
    ok(cu.cuCtxSetCurrent(ctxs[0]))
    ok(cu.cuKernelGetFunction(k))
    ok(cu.cuLibraryUnload(lib))


def test_kernel_names_come_from_the_symbol_table(module: Any) -> None:
    cu = _cu()
    ok(cu.cuModuleGetFunction(module, b"fill"))
    fails(cu.cuModuleGetFunction(module, b"no_such_kernel"), "CUDA_ERROR_NOT_FOUND")
    fails(cu.cuModuleGetFunction(module, b"helper"), "CUDA_ERROR_NOT_FOUND")  # a device function
    assert ok(cu.cuModuleGetFunctionCount(module)) == 4
    lib = ok(cu.cuLibraryLoadData(image(), None, None, 0, None, None, 0))
    fails(cu.cuLibraryGetKernel(lib, b"filll"), "CUDA_ERROR_NOT_FOUND")
    k = ok(cu.cuLibraryGetKernel(lib, b"add"))
    assert [ok(cu.cuKernelGetParamInfo(k, i)) for i in range(3)] == [(0, 8), (8, 8), (16, 8)]
    fails(cu.cuKernelGetParamInfo(k, 3), "CUDA_ERROR_INVALID_VALUE")
    ok(cu.cuLibraryUnload(lib))


def test_a_kernel_without_registered_host_code_fails_to_launch(ctxs: list[Any]) -> None:
    cu = _cu()
    ok(cu.cuCtxSetCurrent(ctxs[1]))
    mod = ok(cu.cuModuleLoadData(image("sm_86", register=False)))  # loads: the image is fine
    f = ok(cu.cuModuleGetFunction(mod, b"thrice"))
    p = ok(cu.cuMemAlloc(N * 4))
    fails(launch(f, Args(ptr(p)), 0), "CUDA_ERROR_LAUNCH_FAILED")
    ok(cu.cuMemFree(p))
    ok(cu.cuModuleUnload(mod))


def test_launch_limits(module: Any) -> None:
    cu = _cu()
    fill = ok(cu.cuModuleGetFunction(module, b"fill"))
    bounded = ok(cu.cuModuleGetFunction(module, b"bounded"))
    p = ok(cu.cuMemAlloc(4096 * 4))
    args = Args(ptr(p), ctypes.c_float(1.0), ctypes.c_longlong(4096))
    ok(launch(fill, args, 0, grid=(4, 1, 1), block=(1, 1, 64)))
    for grid, block in [((1 << 31, 1, 1), (1, 1, 1)), ((1, 65536, 1), (1, 1, 1)), ((1, 1, 65536), (1, 1, 1)),
                        ((1, 1, 1), (1025, 1, 1)), ((1, 1, 1), (1, 1025, 1)), ((1, 1, 1), (1, 1, 65)),
                        ((1, 1, 1), (32, 32, 2)), ((0, 1, 1), (1, 1, 1)), ((1, 1, 1), (0, 1, 1))]:
        fails(launch(fill, args, 0, grid=grid, block=block), "CUDA_ERROR_INVALID_VALUE")
    ok(launch(bounded, Args(ptr(p)), 0, block=(128, 1, 1)))
    fails(launch(bounded, Args(ptr(p)), 0, block=(256, 1, 1)), "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES")
    attr = cu.CUfunction_attribute
    assert ok(cu.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, bounded)) == 128
    # dynamic shared memory: 48 KiB unless raised, up to the opt-in limit
    fails(launch(fill, args, 0, shared=48 * 1024 + 1), "CUDA_ERROR_INVALID_VALUE")
    ok(launch(fill, args, 0, shared=48 * 1024))
    ok(cu.cuFuncSetAttribute(fill, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 100 * 1024))
    ok(launch(fill, args, 0, shared=100 * 1024))
    fails(launch(fill, args, 0, shared=100 * 1024 + 1), "CUDA_ERROR_INVALID_VALUE")
    fails(cu.cuFuncSetAttribute(fill, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 227 * 1024 + 1),
          "CUDA_ERROR_INVALID_VALUE")
    # arguments: from kernelParams or extra, never both, never none
    fails(cu.cuLaunchKernel(fill, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0), "CUDA_ERROR_INVALID_VALUE")
    # a function runs in its own context's streams only
    ok(cu.cuCtxSetCurrent(ok(cu.cuDevicePrimaryCtxRetain(1))))
    s1 = ok(cu.cuStreamCreate(0))
    ok(cu.cuCtxSetCurrent(ok(cu.cuDevicePrimaryCtxRetain(0))))
    fails(launch(fill, args, s1), "CUDA_ERROR_INVALID_HANDLE")
    ok(cu.cuCtxSynchronize())
    ok(cu.cuStreamDestroy(s1))
    for d in range(2):
        ok(cu.cuDevicePrimaryCtxRelease(d))
    ok(cu.cuMemFree(p))


# ---------------------------------------------------------------------------
# Peers, faults


def test_peer_access_rules(ctxs: list[Any], module: Any) -> None:
    cu = _cu()
    cu.cuCtxDisablePeerAccess(ctxs[1])  # from no peer access (other tests of this process enable it)
    assert ok(cu.cuDeviceCanAccessPeer(0, 1)) == 1
    assert ok(cu.cuDeviceCanAccessPeer(0, 0)) == 0
    fails(cu.cuCtxEnablePeerAccess(ctxs[0], 0), "CUDA_ERROR_INVALID_DEVICE")
    fails(cu.cuCtxDisablePeerAccess(ctxs[1]), "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED")
    ok(cu.cuCtxSetCurrent(ctxs[1]))
    remote = ok(cu.cuMemAlloc(N * 4))
    ok(cu.cuCtxSetCurrent(ctxs[0]))
    local = ok(cu.cuMemAlloc(N * 4))
    s = ok(cu.cuStreamCreate(0))
    # peer copies need no peer access
    ok(cu.cuMemsetD32Async(local, 0x3F800000, N, s))  # 1.0f
    ok(cu.cuMemcpyPeerAsync(remote, ctxs[1], local, ctxs[0], N * 4, s))
    fails(cu.cuMemcpyPeerAsync(remote, ctxs[0], local, ctxs[1], N * 4, s), "CUDA_ERROR_INVALID_VALUE")
    ok(cu.cuStreamSynchronize(s))
    add = ok(cu.cuModuleGetFunction(module, b"add"))
    ok(cu.cuCtxEnablePeerAccess(ctxs[1], 0))
    fails(cu.cuCtxEnablePeerAccess(ctxs[1], 0), "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED")
    ok(launch(add, Args(ptr(local), ptr(remote), ctypes.c_longlong(N)), s))  # reads device 1's memory
    host, view = pinned(N)
    ok(cu.cuMemcpyDtoHAsync(host, local, N * 4, s))
    ok(cu.cuStreamSynchronize(s))
    assert (view == 2.0).all()
    ok(cu.cuCtxDisablePeerAccess(ctxs[1]))
    # without peer access, a kernel touching device 1's memory faults
    ok(launch(add, Args(ptr(local), ptr(remote), ctypes.c_longlong(N)), s))
    fails(cu.cuStreamSynchronize(s), "CUDA_ERROR_ILLEGAL_ADDRESS")
    ok(cu.cuDevicePrimaryCtxReset(0))
    fails(cu.cuMemFreeHost(host), "CUDA_ERROR_INVALID_VALUE")  # the reset freed device 0's pinned memory too
    ok(cu.cuCtxSetCurrent(ctxs[1]))
    ok(cu.cuMemFree(remote))


def test_sticky_error_after_a_fault_until_reset(ctxs: list[Any], module: Any, stub_driver: stub.Driver) -> None:
    cu = _cu()
    fill = ok(cu.cuModuleGetFunction(module, b"fill"))
    p = ok(cu.cuMemAlloc(N * 4))
    s = ok(cu.cuStreamCreate(0))
    stub_driver.inject_fault(0)
    ok(launch(fill, Args(ptr(p), ctypes.c_float(1.0), ctypes.c_longlong(N)), s))  # faults when it runs
    fails(cu.cuStreamSynchronize(s), "CUDA_ERROR_ILLEGAL_ADDRESS")
    for result in (cu.cuMemAlloc(64), cu.cuStreamCreate(0), cu.cuCtxSynchronize(), cu.cuEventCreate(0),
                   cu.cuMemsetD8Async(p, 0, 4, s), cu.cuModuleLoadData(image()), cu.cuStreamQuery(s)):
        fails(result, "CUDA_ERROR_ILLEGAL_ADDRESS")
    ok(cu.cuCtxSetCurrent(ctxs[1]))  # the other device is fine
    q = ok(cu.cuMemAlloc(64))
    ok(cu.cuMemFree(q))
    ok(cu.cuCtxSetCurrent(ctxs[0]))
    ok(cu.cuDevicePrimaryCtxReset(0))
    fails(cu.cuStreamSynchronize(s), "CUDA_ERROR_INVALID_HANDLE")  # the reset destroyed it
    fails(cu.cuModuleGetFunction(module, b"fill"), "CUDA_ERROR_INVALID_HANDLE")
    p = ok(cu.cuMemAlloc(N * 4))
    mod = ok(cu.cuModuleLoadData(image()))
    fill = ok(cu.cuModuleGetFunction(mod, b"fill"))
    ok(launch(fill, Args(ptr(p), ctypes.c_float(3.0), ctypes.c_longlong(N)), 0))
    host, view = pinned(N)
    ok(cu.cuMemcpyDtoH(host, p, N * 4))
    assert (view == 3.0).all()
    ok(cu.cuMemFreeHost(host))
    ok(cu.cuMemFree(p))


def test_stream_ordered_memory_is_usable_only_in_stream_order(ctxs: list[Any], module: Any,
                                                              stub_driver: stub.Driver) -> None:
    """A pool allocation on stream A used by stream B without a wait: under the
    target-first schedule B runs before A's allocation, and the kernel faults."""
    cu = _cu()
    fill = ok(cu.cuModuleGetFunction(module, b"fill"))
    pool = ok(cu.cuDeviceGetDefaultMemPool(0))
    a, b = ok(cu.cuStreamCreate(1)), ok(cu.cuStreamCreate(1))
    old = stub_driver.set_schedule(stub.TARGET_FIRST)
    try:
        p = ok(cu.cuMemAllocFromPoolAsync(N * 4, pool, a))
        ev = ok(cu.cuEventCreate(0))
        ok(cu.cuEventRecord(ev, a))
        ok(cu.cuStreamWaitEvent(b, ev, 0))  # ordered: fine
        ok(launch(fill, Args(ptr(p), ctypes.c_float(1.0), ctypes.c_longlong(N)), b))
        ok(cu.cuStreamSynchronize(b))
        ok(cu.cuMemFreeAsync(p, b))
        fails(cu.cuMemFreeAsync(p, b), "CUDA_ERROR_INVALID_VALUE")  # freed twice
        q = ok(cu.cuMemAllocFromPoolAsync(N * 4, pool, a))
        ok(launch(fill, Args(ptr(q), ctypes.c_float(1.0), ctypes.c_longlong(N)), b))  # not ordered
        fails(cu.cuStreamSynchronize(b), "CUDA_ERROR_ILLEGAL_ADDRESS")
    finally:
        stub_driver.set_schedule(old)
        ok(cu.cuDevicePrimaryCtxReset(0))


# ---------------------------------------------------------------------------
# Deferred streams


def _two_streams_and_buffers(module: Any) -> tuple[Any, Any, Any, Any, Any]:
    cu = _cu()
    fill = ok(cu.cuModuleGetFunction(module, b"fill"))
    a, b = ok(cu.cuStreamCreate(1)), ok(cu.cuStreamCreate(1))
    x = ok(cu.cuMemAlloc(N * 4))
    ok(cu.cuMemsetD32(x, 0, N))
    return cu, fill, a, b, x


@pytest.mark.parametrize("wait", [False, True])
def test_a_missing_wait_reads_stale_data_under_target_first(module: Any, stub_driver: stub.Driver,
                                                            wait: bool) -> None:
    """Read-after-write across streams: stream B copies out what stream A writes."""
    cu, fill, a, b, x = _two_streams_and_buffers(module)
    host, view = pinned(N)
    old = stub_driver.set_schedule(stub.TARGET_FIRST)
    try:
        ok(launch(fill, Args(ptr(x), ctypes.c_float(5.0), ctypes.c_longlong(N)), a))
        if wait:
            ev = ok(cu.cuEventCreate(2))
            ok(cu.cuEventRecord(ev, a))
            ok(cu.cuStreamWaitEvent(b, ev, 0))
        ok(cu.cuMemcpyDtoHAsync(host, x, N * 4, b))
        assert stub_driver.pending() >= 2
        view[:] = -1.0
        ok(cu.cuStreamSynchronize(b))
        assert (view == (5.0 if wait else 0.0)).all()
    finally:
        stub_driver.set_schedule(old)
        ok(cu.cuCtxSynchronize())
    ok(cu.cuMemFreeHost(host))
    ok(cu.cuMemFree(x))


@pytest.mark.parametrize("wait", [False, True])
def test_a_missing_wait_overwrites_data_under_others_first(module: Any, stub_driver: stub.Driver,
                                                           wait: bool) -> None:
    """Write-after-read across streams: stream B overwrites what stream A still has to read."""
    cu, fill, a, b, x = _two_streams_and_buffers(module)
    host, view = pinned(N)
    assert stub_driver.set_schedule(stub.OTHERS_FIRST) == stub.OTHERS_FIRST  # the default
    ok(cu.cuMemcpyDtoHAsync(host, x, N * 4, a))  # A reads x (zeros)
    if wait:
        ev = ok(cu.cuEventCreate(2))
        ok(cu.cuEventRecord(ev, a))
        ok(cu.cuStreamWaitEvent(b, ev, 0))
    ok(launch(fill, Args(ptr(x), ctypes.c_float(5.0), ctypes.c_longlong(N)), b))  # B overwrites x
    view[:] = -1.0
    assert (view == -1.0).all()  # nothing has run: host memory changes only when a copy runs
    ok(cu.cuStreamSynchronize(a))
    assert (view == (0.0 if wait else 5.0)).all()
    ok(cu.cuCtxSynchronize())
    ok(cu.cuMemFreeHost(host))
    ok(cu.cuMemFree(x))


def test_queries_say_not_ready_before_the_work_runs(module: Any) -> None:
    cu, fill, a, _, x = _two_streams_and_buffers(module)
    ev = ok(cu.cuEventCreate(0))
    fails(cu.cuEventElapsedTime(ev, ev), "CUDA_ERROR_INVALID_HANDLE")  # not recorded, and no timing
    ok(launch(fill, Args(ptr(x), ctypes.c_float(5.0), ctypes.c_longlong(N)), a))
    ok(cu.cuEventRecord(ev, a))
    fails(cu.cuEventQuery(ev), "CUDA_ERROR_NOT_READY")
    ok(cu.cuEventQuery(ev))  # a later query finds it done (the work has run)
    ok(launch(fill, Args(ptr(x), ctypes.c_float(5.0), ctypes.c_longlong(N)), a))
    fails(cu.cuStreamQuery(a), "CUDA_ERROR_NOT_READY")
    ok(cu.cuStreamSynchronize(a))
    ok(cu.cuStreamQuery(a))
    ok(cu.cuMemFree(x))


# ---------------------------------------------------------------------------
# Graphs and capture


def test_stream_capture_rules(module: Any) -> None:
    cu, fill, a, b, x = _two_streams_and_buffers(module)
    mode = cu.CUstreamCaptureMode
    args = Args(ptr(x), ctypes.c_float(2.0), ctypes.c_longlong(N))
    fails(cu.cuStreamBeginCapture(0, mode.CU_STREAM_CAPTURE_MODE_GLOBAL), "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
    ok(cu.cuStreamBeginCapture(a, mode.CU_STREAM_CAPTURE_MODE_GLOBAL))
    ok(launch(fill, args, a))
    fails(cu.cuMemAlloc(64), "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")  # unsafe during a global capture
    fails(cu.cuStreamEndCapture(a), "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED")
    # a capture that joins a second stream must join it back
    ok(cu.cuStreamBeginCapture(a, mode.CU_STREAM_CAPTURE_MODE_RELAXED))
    fork, join = ok(cu.cuEventCreate(2)), ok(cu.cuEventCreate(2))
    ok(cu.cuEventRecord(fork, a))
    fails(cu.cuEventQuery(fork), "CUDA_ERROR_CAPTURED_EVENT")
    ok(cu.cuStreamWaitEvent(b, fork, 0))
    ok(launch(fill, args, b))
    fails(cu.cuStreamSynchronize(b), "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
    fails(cu.cuStreamEndCapture(a), "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED")
    ok(cu.cuStreamBeginCapture(a, mode.CU_STREAM_CAPTURE_MODE_RELAXED))
    ok(cu.cuEventRecord(fork, a))
    ok(cu.cuStreamWaitEvent(b, fork, 0))
    ok(launch(fill, args, b))
    fails(cu.cuStreamEndCapture(a), "CUDA_ERROR_STREAM_CAPTURE_UNJOINED")
    ok(cu.cuStreamBeginCapture(a, mode.CU_STREAM_CAPTURE_MODE_RELAXED))
    ok(cu.cuEventRecord(fork, a))
    ok(cu.cuStreamWaitEvent(b, fork, 0))
    ok(launch(fill, args, b))
    ok(cu.cuEventRecord(join, b))
    ok(cu.cuStreamWaitEvent(a, join, 0))
    graph = ok(cu.cuStreamEndCapture(a))
    assert ok(cu.cuGraphGetNodes(graph, 0))[1] == 1
    # an uncaptured event is no dependency of a capture
    ok(cu.cuEventRecord(fork, a))
    ok(cu.cuStreamBeginCapture(b, mode.CU_STREAM_CAPTURE_MODE_RELAXED))
    fails(cu.cuStreamWaitEvent(b, fork, 0), "CUDA_ERROR_STREAM_CAPTURE_ISOLATION")
    fails(cu.cuStreamEndCapture(b), "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED")
    # the graph runs where it is launched, with the arguments it was captured with
    exe = ok(cu.cuGraphInstantiate(graph, 0))
    host, view = pinned(N)
    ok(cu.cuGraphLaunch(exe, a))
    ok(cu.cuMemcpyDtoHAsync(host, x, N * 4, a))
    ok(cu.cuStreamSynchronize(a))
    assert (view == 2.0).all()
    ok(cu.cuGraphExecDestroy(exe))
    ok(cu.cuGraphDestroy(graph))
    ok(cu.cuMemFreeHost(host))
    ok(cu.cuMemFree(x))
