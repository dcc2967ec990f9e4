"""Your own CUDA C kernels (``Backend.raw_kernel``) on two stub GPUs: compiled by NVRTC through
the compile cache, launched with base + offset pointers and the user's grid, ordered by the
per-node events under both schedules of the stub's deferred streams (a missing wait shows
as wrong data), hostile input, graphs, lifetimes and threads."""

from __future__ import annotations

import gc
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scenarios import f32
from settle import settled_memory

from polyjit.backends import cuda
from polyjit.core import ir, raw
from polyjit.core.errors import (
    CompileError,
    InvalidArgumentError,
    NodeNotInContextError,
    UnsupportedError,
)
from polyjit.core.ir import Op, StaticSymbol
from polyjit.core.routine import device_to_device

STUB_ENV = {"PJSTUB_DEVICES": "2"}

SAXPY = """extern "C" __global__ void saxpy(float* out, const float* x, const float* y, long long n, long long a) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = (float)a * x[i] + y[i];
}
"""

SHAPE = """extern "C" __global__ void shape(int* out, long long width) {
  long long x = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  long long y = (long long)blockIdx.y * blockDim.y + threadIdx.y;
  out[y * width + x] = (int)(blockDim.x * 1000 + blockDim.y * 100 + gridDim.x * 10 + gridDim.y);
}
"""


def _saxpy(backend: Any, n: int, a: int = 3, block: int | None = 128) -> tuple[Any, ...]:
    out, x, y = f32("out", (n,)), f32("x", (n,)), f32("y", (n,))
    sn, sa = StaticSymbol("n", n + 1), StaticSymbol("a", 16)
    glob = n if block is None else (n + block - 1) // block * block
    code = backend.raw_kernel(SAXPY, "saxpy", [raw.write(out), raw.read(x), raw.read(y)], statics=[sn, sa],
                              bindings={sn: n, sa: a}, global_size=glob, local_size=block)
    return out, x, y, sn, sa, code


def test_saxpy_matches_numpy(backend: Any, schedule: str) -> None:
    n = 1000
    out, x, y, _sn, sa, code = _saxpy(backend, n)
    assert code.source == SAXPY  # the user's source, and nothing else
    hx, hy = np.arange(n, dtype=np.float32), np.linspace(0, 1, n, dtype=np.float32)
    ctx = backend.get_device(0).make_context().init_from_host(x, hx).init_from_host(y, hy)
    r = ctx.link(code)
    (launch,) = r.prepared().launches  # the public launch record: the user's grid, exactly
    assert launch.grid == (8, 1, 1) and launch.block == (128, 1, 1)
    r.run()
    np.testing.assert_allclose(r.context.read(out), 3 * hx + hy, rtol=1e-6)
    r.bindings[sa] = 9
    r.run()
    np.testing.assert_allclose(r.context.read(out), 9 * hx + hy, rtol=1e-6)
    ((spec, seconds),) = r.time_kernels(2)
    assert spec.name == "saxpy" and seconds >= 0
    ctx.finalize()


def test_launch_shapes(backend: Any) -> None:
    dev = backend.get_device(0)
    out = ir.Node("out", (8, 16), "int32")
    w = StaticSymbol("width", 17)
    ctx = dev.make_context()
    r = ctx.link(backend.raw_kernel(SHAPE, "shape", [raw.write(out)], statics=[w], bindings={w: 16},
                                    global_size=(16, 8), local_size=(8, 4)))
    r.run()
    np.testing.assert_array_equal(r.context.read(out), np.full((8, 16), 8 * 1000 + 4 * 100 + 2 * 10 + 2))
    # Without a block size: the largest divisor of the global size up to 256 threads.
    r2 = ctx.link(backend.raw_kernel(SHAPE, "shape", [raw.write(out)], statics=[w], bindings={w: 16},
                                     global_size=(16, 8)))
    assert r2.prepared().launches[0].block == (16, 1, 1)
    r2.run()
    np.testing.assert_array_equal(r2.context.read(out), np.full((8, 16), 16 * 1000 + 100 + 10 + 8))
    n = 1000  # 1000 = 4 * 250: blocks of 250, no thread past the end
    _out1, x, y, *_, code = _saxpy(backend, n, block=None)
    c1 = ctx.init_from_host(x, np.ones(n, np.float32)).init_from_host(y, np.zeros(n, np.float32))
    r3 = c1.link(code)
    assert r3.prepared().launches[0].grid == (4, 1, 1) and r3.prepared().launches[0].block == (250, 1, 1)
    with pytest.raises(UnsupportedError, match="exceed"):
        ctx.link(backend.raw_kernel(SHAPE, "shape", [raw.write(out)], statics=[w], bindings={w: 16},
                                    global_size=(2048,), local_size=(2048,)))
    ctx.finalize()


def test_nodes_in_the_middle_of_a_pool_get_base_plus_offset(backend: Any, schedule: str) -> None:
    dev = backend.get_device(0)
    a, b = f32("a", (100,)), f32("b", (300,))
    fill = """extern "C" __global__ void fill2(float* a, float* b) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < 100) a[i] = i;
  if (i < 300) b[i] = 2 * i;
}
"""
    r = dev.make_context().link(backend.raw_kernel(fill, "fill2", [raw.write(a), raw.write(b)], global_size=512,
                                                   local_size=128))
    assert r.context.buffers[a].pool_id == r.context.buffers[b].pool_id
    assert max(r.context.buffers[n].offset for n in (a, b)) > 0
    r.run()
    np.testing.assert_array_equal(r.context.read(a), np.arange(100, dtype=np.float32))
    np.testing.assert_array_equal(r.context.read(b), 2 * np.arange(300, dtype=np.float32))
    r.context.finalize()


def test_ordered_against_generated_routines_across_streams(backend: Any, schedule: str) -> None:
    dev = backend.get_device(0)
    n = 4096
    out, x, y, *_, code = _saxpy(backend, n)
    z = f32("z", (n,))
    ctx = dev.make_context(dev.new_stream()).init_from_host(x, np.zeros(n, np.float32))
    ctx = ctx.init_from_host(y, np.ones(n, np.float32))
    inc = ctx.link(backend.compile(ir.Comp.of(ir.apply(Op.ADD, x, 2.0, into=x)), name="inc"))
    s2, s3 = dev.new_stream(), dev.new_stream()
    saxpy = ctx.with_stream(s2).link(code)
    neg = saxpy.context.with_stream(s3).link(backend.compile(ir.Comp.of(ir.apply(Op.NEG, out, into=z)), name="neg"))
    for k in range(1, 4):
        inc.run()  # stream 1 writes x
        saxpy.run()  # stream 2 reads x, writes out
        neg.run()  # stream 3 reads out
        np.testing.assert_array_equal(neg.context.read(z), np.full(n, -(3 * 2 * k + 1), np.float32))
    for s in (s2, s3):
        s.close()
    ctx.finalize()


def test_ordered_across_devices(backend: Any, schedule: str) -> None:
    d0, d1 = backend.get_device(0), backend.get_device(1)
    n = 2048
    out, x, y, *_, code = _saxpy(backend, n, a=2)
    c0 = d0.make_context().init_from_host(x, np.arange(n, dtype=np.float32)).init_from_host(y, np.zeros(n, np.float32))
    c1 = d1.make_context().init_from_host(out, np.full(n, -5, np.float32))
    x1, y1 = f32("x1", (n,)), f32("y1", (n,))
    twice = c1.init_from_host(y1, np.zeros(n, np.float32)).link(
        backend.raw_kernel(SAXPY, "saxpy", [raw.write(x1), raw.read(out), raw.read(y1)],
                           statics=[StaticSymbol("n", n + 1), StaticSymbol("a", 16)],
                           bindings={StaticSymbol("n", n + 1): n, StaticSymbol("a", 16): 2}, global_size=n))
    w = c0.link(code)
    for _ in range(2):
        w.run()  # device 0 writes out
        device_to_device(out, dst=c1, src=w.context)  # after the raw writer
        twice.run()  # device 1 reads out after the copy
        np.testing.assert_array_equal(twice.context.read(x1), 4 * np.arange(n, dtype=np.float32))
    c0.finalize()
    c1.finalize()


def test_a_raw_kernel_in_a_cuda_graph(backend: Any, schedule: str) -> None:
    dev = backend.get_device(0)
    n = 512
    out, x, y, _sn, sa, code = _saxpy(backend, n)
    ctx = dev.make_context().init_from_host(x, np.ones(n, np.float32)).init_from_host(y, np.zeros(n, np.float32))
    inc = ctx.link(backend.compile(ir.Comp.of(ir.apply(Op.ADD, x, 1.0, into=x)), name="inc"))
    saxpy = inc.context.link(code)
    graph = cuda.capture([inc, saxpy])
    assert graph.kernel_count == 2
    graph.replay()
    np.testing.assert_array_equal(saxpy.context.read(out), np.full(n, 6, np.float32))
    graph.bindings[sa] = 5  # patched in the graph's kernel node
    graph.replay()
    np.testing.assert_array_equal(saxpy.context.read(out), np.full(n, 15, np.float32))
    graph.close()
    ctx.finalize()


# -- hostile input ---------------------------------------------------------------------------


def test_parameters_are_checked_against_the_image(backend: Any) -> None:
    dev = backend.get_device(0)
    n = 256
    out, x, y = f32("out", (n,)), f32("x", (n,)), f32("y", (n,))
    ctx = dev.make_context().init_from_host(x, np.ones(n, np.float32)).init_from_host(y, np.ones(n, np.float32))
    before = dev.used_memory()
    missing_statics = backend.raw_kernel(SAXPY, "saxpy", [raw.write(out), raw.read(x), raw.read(y)], global_size=n)
    with pytest.raises(InvalidArgumentError, match="takes 5 parameters, but raw_kernel names 3"):
        ctx.link(missing_statics)
    int_static = 'extern "C" __global__ void k(float* out, int n) { out[threadIdx.x] = n; }\n'
    s = StaticSymbol("s", 4)
    with pytest.raises(InvalidArgumentError, match="not 8 bytes"):
        ctx.link(backend.raw_kernel(int_static, "k", [raw.write(out)], statics=[s], bindings={s: 1}, global_size=n))
    assert dev.used_memory() == before
    mangled = "__global__ void plain(float* out) { out[threadIdx.x] = 1; }\n"
    with pytest.raises(CompileError, match='extern "C"'):
        ctx.link(backend.raw_kernel(mangled, "plain", [raw.write(out)], global_size=n))
    with pytest.raises(NodeNotInContextError):
        dev.make_context().link(missing_statics)
    with pytest.raises(InvalidArgumentError, match="global_size"):
        backend.raw_kernel(SAXPY, "saxpy", [raw.write(out)])
    with pytest.raises(InvalidArgumentError, match="not a C identifier"):
        backend.raw_kernel(SAXPY, 'saxpy"); asm("', [raw.write(out)], global_size=n)
    ctx.finalize()


def test_nvrtc_errors_name_the_file(backend: Any, tmp_path: Path) -> None:
    path = tmp_path / "broken_kernel.cu"
    path.write_text('extern "C" __global__ void broken(float* x) {\n  x[0] = not_declared;\n}\n')
    with pytest.raises(CompileError) as info:
        backend.raw_kernel(path, "broken", [raw.write(f32("x", (4,)))], global_size=4)
    assert str(path) in str(info.value) and "not_declared" in info.value.log


# -- lifetimes and threads ----------------------------------------------------------------------


def test_dropped_objects_while_in_flight(backend: Any, schedule: str) -> None:
    dev = backend.get_device(0)
    dev.synchronize()
    base = dev.used_memory()
    n = 1024
    out, x, y, *_, code = _saxpy(backend, n)
    stream = dev.new_stream()
    ctx = dev.make_context(stream).init_from_host(x, np.ones(n, np.float32)).init_from_host(y, np.ones(n, np.float32))
    r = ctx.link(code)
    r.run()  # deferred: nothing runs on the stub until a host waits
    keep = r.context
    del r, code
    gc.collect()
    np.testing.assert_array_equal(keep.read(out), np.full(n, 4, np.float32))
    r2 = keep.link(backend.raw_kernel(SAXPY, "saxpy", [raw.write(out), raw.read(x), raw.read(y)],
                                      statics=[StaticSymbol("n", n + 1), StaticSymbol("a", 16)],
                                      bindings={StaticSymbol("n", n + 1): n, StaticSymbol("a", 16): 1},
                                      global_size=n))
    r2.run()
    del r2, keep, ctx, stream
    assert settled_memory(dev) == base


def test_threads_compile_link_and_run(backend: Any) -> None:
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work(k: int) -> None:
        try:
            dev = backend.get_device(k % 2)
            n = 256 + k
            out, x, y, _sn, _sa, code = _saxpy(backend, n, a=k % 16)
            s = dev.new_stream()
            ctx = dev.make_context(s).init_from_host(x, np.full(n, k, np.float32))
            r = ctx.init_from_host(y, np.ones(n, np.float32)).link(code)
            for _ in range(3):
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


def test_the_cuda_example_of_the_docs_runs_as_written(backend: Any) -> None:
    """docs/raw-kernels.md's CUDA example, on this child's backend (one CudaDriver per thread)."""
    import contextlib
    import io
    import re

    doc = Path(__file__).resolve().parents[2] / "docs" / "raw-kernels.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
    (code,) = [b for b in blocks if 'get_backend("cuda")' in b]
    code = code.replace('polyjit.get_backend("cuda")', "backend")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(doc), "exec"), {"backend": backend})
    expected = re.search(r"# (\[.*\])", code)
    assert expected is not None and out.getvalue().strip() == expected.group(1)


def test_a_grid_past_cudas_limits_is_refused_when_linked(backend: Any) -> None:
    """Found by review: a raw kernel's grid past CUDA's limits (65535 blocks in y and z, 2^31 - 1
    in x) failed at run() with the driver's CUDA_ERROR_INVALID_VALUE (or an overflow in
    cuda.core); it is refused by name, with the limit, before anything runs."""
    x = f32("x", (4,))
    src = 'extern "C" __global__ void k(float* x) { if (blockIdx.y == 0 && threadIdx.x == 0) x[0] = 1.0f; }'
    for glob, local in (((1, 70000), (1, 1)), ((1 << 40,), (256,))):
        code = backend.raw_kernel(src, "k", [raw.write(x)], global_size=glob, local_size=local)
        ctx = backend.get_device(0).make_context().init_from_host(x, np.zeros(4, np.float32))
        with pytest.raises(UnsupportedError, match=r"exceeds CUDA's \(2147483647, 65535, 65535\)"):
            ctx.link(code).run()
        assert float(ctx.read(x)[0]) == 0.0
    # and a block past CUDA's per-dimension limits (64 threads in z), found by the next review
    code = backend.raw_kernel(src, "k", [raw.write(x)], global_size=(1, 1, 128), local_size=(1, 1, 128))
    ctx = backend.get_device(0).make_context().init_from_host(x, np.zeros(4, np.float32))
    with pytest.raises(UnsupportedError, match=r"\(1024, 1024, 64\) per dimension"):
        ctx.link(code).run()
