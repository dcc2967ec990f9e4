"""Your own kernels on the cpu backend: ``Backend.raw_kernel`` compiles a user's C function
through the compile cache, links it like generated code and orders it by the per-node events.

(OpenCL: tests/opencl/test_opencl_raw_kernels.py; CUDA on the stub driver:
tests/cuda/test_backend_raw_kernels.py.)
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from settle import settled_memory

from polyjit.backends import get_backend
from polyjit.backends.cpu import CpuDriver, create_backend
from polyjit.core import dtypes, ir, raw
from polyjit.core.errors import (
    BindingError,
    CompileError,
    InvalidArgumentError,
    NodeNotInContextError,
    ReadOnlyNodeError,
)
from polyjit.core.ir import Node, Op, StaticSymbol
from polyjit.core.routine import Code, device_to_device
from polyjit.core.runtime import Backend

SAXPY = """
#include <stdint.h>
void saxpy(float* out, const float* x, const float* y, int64_t n, int64_t a) {
  for (int64_t i = 0; i < n; i++) out[i] = (float)a * x[i] + y[i];
}
"""

# Holds its stream for a while before it writes: a reader on another stream or device that
# did not wait for it would see the old values.
SLOW_COPY = """
#include <stdint.h>
#include <time.h>
void slow_copy(double* out, const double* x, int64_t n) {
  struct timespec t = {0, 150 * 1000 * 1000};
  nanosleep(&t, 0);
  for (int64_t i = 0; i < n; i++) out[i] = x[i] + 1.0;
}
"""

SLOW_READ = """
#include <stdint.h>
#include <time.h>
void slow_sum(double* out, const double* x, int64_t n) {
  struct timespec t = {0, 150 * 1000 * 1000};
  nanosleep(&t, 0);
  double s = 0.0;
  for (int64_t i = 0; i < n; i++) s += x[i];
  out[0] = s;
}
"""


@pytest.fixture(scope="module")
def cpu() -> Backend:
    return get_backend("cpu")


def _compiles(backend: Backend) -> int:
    assert isinstance(backend.driver, CpuDriver)
    return backend.driver.compiler.compiles


def f32(name: str, shape: tuple[int, ...]) -> Node:
    return Node(name, shape, dtypes.float32)


def f64(name: str, shape: tuple[int, ...]) -> Node:
    return Node(name, shape, dtypes.float64)


def _saxpy(backend: Backend, n: int, a: int = 3) -> tuple[Node, Node, Node, StaticSymbol, StaticSymbol, Code]:
    out, x, y = f32("out", (n,)), f32("x", (n,)), f32("y", (n,))
    sn, sa = StaticSymbol("n", n + 1), StaticSymbol("a", 16)
    code = backend.raw_kernel(SAXPY, "saxpy", [raw.write(out), raw.read(x), raw.read(y)],
                              statics=[sn, sa], bindings={sn: n, sa: a})
    return out, x, y, sn, sa, code


# -- correctness ---------------------------------------------------------------------------


def test_saxpy_matches_numpy_and_statics_are_read_at_run(cpu: Backend) -> None:
    n = 1000
    out, x, y, sn, sa, code = _saxpy(cpu, n)
    hx, hy = np.arange(n, dtype=np.float32), np.linspace(0, 1, n, dtype=np.float32)
    ctx = cpu.get_device(0).make_context().init_from_host(x, hx).init_from_host(y, hy)
    r = ctx.link(code)
    assert r.inputs == {x, y} and r.outputs == {out} and r.statics == (sn, sa)
    r.run()
    np.testing.assert_allclose(r.context.read(out), 3 * hx + hy, rtol=1e-6)
    r.bindings[sa] = 5  # read when run() enqueues, like a generated routine's
    r.run()
    np.testing.assert_allclose(r.context.read(out), 5 * hx + hy, rtol=1e-6)
    r.bindings[sn] = 10  # only the first 10 are written now
    r.bindings[sa] = 1
    r.run()
    got = r.context.read(out)
    np.testing.assert_allclose(got[:10], hx[:10] + hy[:10], rtol=1e-6)
    np.testing.assert_allclose(got[10:], 5 * hx[10:] + hy[10:], rtol=1e-6)
    ctx.finalize()


def test_source_is_the_users_plus_the_parameter_binding_only(cpu: Backend) -> None:
    *_, code = _saxpy(cpu, 8)
    text = code.source
    assert text.startswith(SAXPY.rstrip("\n"))
    binding = text[len(SAXPY.rstrip("\n")):]
    # the CPU's kernels take a range of iterations too; a user's kernel runs whole
    assert ("pj_raw_saxpy(void* const* pj_bufs, const long long* pj_statics, long long pj_lo, "
            "long long pj_hi)") in binding
    assert "saxpy(pj_bufs[0], pj_bufs[1], pj_bufs[2], pj_statics[0], pj_statics[1]);" in binding
    assert binding.count(";") <= 8


def test_read_write_nodes_and_generated_code_around_them(cpu: Backend) -> None:
    """A raw kernel updates a node in place between two generated routines."""
    n = 64
    x, y, z = f32("x", (n,)), f32("y", (n,)), f32("z", (n,))
    src = "void twice(float* v, long long n) { for (long long i = 0; i < n; i++) v[i] *= 2.0f; }\n"
    sn = StaticSymbol("n", n + 1)
    twice = cpu.raw_kernel(src, "twice", [(y, "rw")], statics=[sn], bindings={sn: n})
    hx = np.arange(n, dtype=np.float32)
    ctx = cpu.get_device(0).make_context().init_from_host(x, hx)
    first = ctx.link(cpu.compile(ir.Comp.of(ir.apply(Op.ADD, x, 1.0, into=y)), name="plus1"))
    mid = first.context.link(twice)
    last = mid.context.link(cpu.compile(ir.Comp.of(ir.apply(Op.MUL, y, 3.0, into=z)), name="times3"))
    for r in (first, mid, last):
        r.run()
    np.testing.assert_array_equal(last.context.read(z), (hx + 1) * 2 * 3)
    assert mid.inputs == {y} and mid.outputs == {y}
    ctx.finalize()


def test_many_outputs_share_one_pool_and_each_gets_its_own_place(cpu: Backend) -> None:
    a, b, c = f64("a", (3,)), Node("b", (5,), dtypes.int32), f64("c", (7,))
    src = ("#include <stdint.h>\n"
           "void fill(double* a, int32_t* b, double* c) {\n"
           "  for (int i = 0; i < 3; i++) a[i] = i;\n"
           "  for (int i = 0; i < 5; i++) b[i] = 10 + i;\n"
           "  for (int i = 0; i < 7; i++) c[i] = 0.5 * i;\n}\n")
    code = cpu.raw_kernel(src, "fill", [raw.write(a), raw.write(b), raw.write(c)])
    dev = cpu.get_device(0)
    before = settled_memory(dev)
    r = dev.make_context().link(code)
    assert len({r.context.buffers[n].pool_id for n in (a, b, c)}) == 1
    r.run()
    np.testing.assert_array_equal(r.context.read(a), np.arange(3.0))
    np.testing.assert_array_equal(r.context.read(b), 10 + np.arange(5))
    np.testing.assert_array_equal(r.context.read(c), 0.5 * np.arange(7))
    r.context.finalize()
    assert dev.used_memory() == before


def test_compiled_through_the_cache_once(cpu: Backend) -> None:
    *_, first = _saxpy(cpu, 16)
    compiles = _compiles(cpu)
    *_, again = _saxpy(cpu, 32)  # other nodes and bindings, the same source: no compile
    assert _compiles(cpu) == compiles
    assert again.batch.binary == first.batch.binary


def test_source_from_a_file(cpu: Backend, tmp_path: Path) -> None:
    path = tmp_path / "saxpy.c"
    path.write_text(SAXPY)
    n = 10
    out, x, y = f32("out", (n,)), f32("x", (n,)), f32("y", (n,))
    sn, sa = StaticSymbol("n", 11), StaticSymbol("a", 4)
    code = cpu.raw_kernel(path, "saxpy", [raw.write(out), raw.read(x), raw.read(y)], statics=[sn, sa],
                          bindings={sn: n, sa: 2})
    ctx = cpu.get_device(0).make_context().init_from_host(x, np.ones(n, np.float32))
    r = ctx.init_from_host(y, np.ones(n, np.float32)).link(code)
    r.run()
    np.testing.assert_array_equal(r.context.read(out), np.full(n, 3, np.float32))
    ctx.finalize()


def test_time_kernels_times_a_raw_kernel(cpu: Backend) -> None:
    n = 1 << 16
    out, x, y, *_, code = _saxpy(cpu, n)
    ctx = cpu.get_device(0).make_context().init_from_host(x, np.ones(n, np.float32))
    r = ctx.init_from_host(y, np.ones(n, np.float32)).link(code)
    ((spec, seconds),) = r.time_kernels(3)
    assert spec.name == "pj_raw_saxpy" and 0 < seconds < 1
    np.testing.assert_array_equal(r.context.read(out), np.full(n, 4, np.float32))
    ctx.finalize()


# -- ordering without waits -------------------------------------------------------------------


def test_raw_writer_then_generated_reader_on_another_stream(cpu: Backend) -> None:
    dev = cpu.get_device(0)
    n = 1000
    x, y, z = f64("x", (n,)), f64("y", (n,)), f64("z", (n,))
    sn = StaticSymbol("n", n + 1)
    writer_code = cpu.raw_kernel(SLOW_COPY, "slow_copy", [raw.write(y), raw.read(x)], statics=[sn],
                                 bindings={sn: n})
    ctx = dev.make_context().init_from_host(x, np.arange(n, dtype=np.float64))
    ctx = ctx.init_from_host(y, np.zeros(n))
    writer = ctx.link(writer_code)
    with dev.new_stream() as s2:
        reader = ctx.with_stream(s2).link(cpu.compile(ir.Comp.of(ir.apply(Op.MUL, y, 2.0, into=z)), name="dbl"))
        writer.run()
        reader.run()  # waits, on the device side, for the raw kernel's write of y
        np.testing.assert_array_equal(reader.context.read(z), 2 * (np.arange(n) + 1.0))
    ctx.finalize()


def test_generated_writer_then_raw_reader_then_generated_overwrite(cpu: Backend) -> None:
    """The raw reader is slow: a later writer of its input on another stream must wait for it."""
    dev = cpu.get_device(0)
    n = 1000
    x, s = f64("x", (n,)), f64("s", (1,))
    sn = StaticSymbol("n", n + 1)
    reader_code = cpu.raw_kernel(SLOW_READ, "slow_sum", [raw.write(s), raw.read(x)], statics=[sn],
                                 bindings={sn: n})
    ctx = dev.make_context().init_from_host(x, np.zeros(n))
    fill = ctx.link(cpu.compile(ir.Comp.of(ir.apply(Op.ADD, x, 1.0, into=x)), name="inc"))
    reader = ctx.link(reader_code)
    with dev.new_stream() as s2:
        overwrite = ctx.with_stream(s2).link(cpu.compile(ir.Comp.of(ir.apply(Op.MUL, x, 100.0, into=x)),
                                                        name="scale"))
        fill.run()
        reader.run()  # after fill: x = 1
        overwrite.run()  # on s2: after the slow reader has read x
        np.testing.assert_array_equal(reader.context.read(s), [float(n)])
        np.testing.assert_array_equal(ctx.read(x), np.full(n, 100.0))
    ctx.finalize()


def test_ordered_across_devices_without_waits() -> None:
    backend = create_backend(num_devices=2)
    d0, d1 = backend.get_device(0), backend.get_device(1)
    n = 500
    x, y, z = f64("x", (n,)), f64("y", (n,)), f64("z", (n,))
    sn = StaticSymbol("n", n + 1)
    code = backend.raw_kernel(SLOW_COPY, "slow_copy", [raw.write(y), raw.read(x)], statics=[sn], bindings={sn: n})
    c0 = d0.make_context().init_from_host(x, np.arange(n, dtype=np.float64)).init_from_host(y, np.zeros(n))
    c1 = d1.make_context().init_from_host(y, np.full(n, -1.0))
    writer = c0.link(code)
    reader = c1.link(backend.compile(ir.Comp.of(ir.apply(Op.NEG, y, into=z)), name="neg"))
    writer.run()
    device_to_device(y, dst=c1, src=c0)  # waits for the raw kernel on device 0
    reader.run()
    np.testing.assert_array_equal(reader.context.read(z), -(np.arange(n) + 1.0))
    c0.finalize()
    c1.finalize()
    backend.close()


# -- hostile input ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["1abc", "a b", "k(){}; void evil", "", "x" * 200, "naïve", "a-b", "k\n"])
def test_kernel_names_must_be_c_identifiers(cpu: Backend, name: str) -> None:
    x = f32("x", (4,))
    compiles = _compiles(cpu)
    with pytest.raises(InvalidArgumentError) as info:
        cpu.raw_kernel("void k(float* x) {}", name, [raw.write(x)])
    assert repr(name)[:40] in str(info.value)
    assert _compiles(cpu) == compiles  # nothing reached a compiler


@pytest.mark.parametrize("name", ["pj_scratch_fn", "pj_scratch_tag_fn", "helper"])
def test_a_kernel_named_like_the_runtimes_scratch_pointers_runs(cpu: Backend, name: str) -> None:
    """Generated modules get the runtime's scratch memory through two pointers found by
    name at load. A user's function of either name (the kernel, or a helper beside it) is
    left alone: writing the pointer into its code crashed the process."""
    v = Node("v", (4,), dtypes.float64)
    helper = "void pj_scratch_tag_fn(void) {}\n" if name == "helper" else ""
    kernel = "k" if name == "helper" else name
    code = cpu.raw_kernel(f"{helper}void {kernel}(double* v) {{ for (int i = 0; i < 4; i++) v[i] += 1; }}\n",
                          kernel, [raw.read_write(v)])
    r = cpu.get_device(0).make_context().init_from_host(v, np.zeros(4)).link(code)
    r.run()
    np.testing.assert_array_equal(r.context.read(v), np.ones(4))
    r.context.finalize()


def test_more_statics_than_the_runtime_passes_is_an_error_not_a_dropped_launch(cpu: Backend) -> None:
    """The runtime copies at most 16 statics a launch; with 17 it dropped the launch, silently."""
    from polyjit.backends.cpu.native import MAX_STATICS
    from polyjit.core.errors import UnsupportedError

    syms = [StaticSymbol(f"s{k}", 100) for k in range(MAX_STATICS + 1)]
    v = Node("v", (4,), dtypes.float64)
    params = ", ".join(f"long long s{k}" for k in range(len(syms)))
    src = f"void many(double* v, {params}) {{ for (int i = 0; i < 4; i++) v[i] = s0 + s{len(syms) - 1}; }}\n"
    code = cpu.raw_kernel(src, "many", [raw.write(v)], statics=syms, bindings={s: 7 for s in syms})
    r = cpu.get_device(0).make_context().link(code)
    with pytest.raises(UnsupportedError, match="17 static values"):
        r.run()
    r.context.finalize()


def test_malformed_arguments_are_typed_errors(cpu: Backend) -> None:
    x, y = f32("x", (4,)), f32("y", (4,))
    src = "void k(float* x) {}"
    s = StaticSymbol("s", 4)
    bad: list[tuple[object, ...]] = [
        (src, "k", x),  # not a sequence
        (src, "k", [x]),  # no access
        (src, "k", [(x, "x")]),  # an unknown access
        (src, "k", [("x", "r")]),  # not a node
        (src, "k", [raw.read(x), raw.write(x)]),  # twice
        (b"void k(float* x) {}", "k", [raw.write(x)]),  # bytes
        ("void k(float* x) {}\x00", "k", [raw.write(x)]),  # a NUL
        (12, "k", [raw.write(x)]),
        (src, None, [raw.write(x)]),
    ]
    for source, name, params in bad:
        with pytest.raises(InvalidArgumentError):
            cpu.raw_kernel(source, name, params)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="statics"):
        cpu.raw_kernel(src, "k", [raw.write(y)], statics=["s"])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match="statics"):
        cpu.raw_kernel(src, "k", [raw.write(y)], statics=[s, s])
    with pytest.raises(BindingError):
        cpu.raw_kernel(src, "k", [raw.write(y)], statics=[s], bindings={s: 4})  # out of range
    with pytest.raises(BindingError):
        cpu.raw_kernel(src, "k", [raw.write(y)], bindings={s: 1})  # not a static of it
    with pytest.raises(InvalidArgumentError, match="global_size"):
        cpu.raw_kernel(src, "k", [raw.write(y)], global_size=0)
    with pytest.raises(InvalidArgumentError, match="multiple"):
        cpu.raw_kernel(src, "k", [raw.write(y)], global_size=100, local_size=64)
    with pytest.raises(InvalidArgumentError):
        cpu.raw_kernel(src, "k", [raw.write(y)], global_size=(1, 2, 3, 4))
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        cpu.raw_kernel(Path("/nonexistent/kernel.c"), "k", [raw.write(y)])


def test_wrong_parameter_counts_and_missing_functions_are_compile_errors(cpu: Backend) -> None:
    x, y = f32("x", (4,)), f32("y", (4,))
    src = "void k(float* out, const float* in) { out[0] = in[0]; }\n"
    with pytest.raises(CompileError, match="too many arguments"):
        cpu.raw_kernel(src, "k", [raw.write(x), raw.read(y), raw.read(f32("z", (4,)))])
    with pytest.raises(CompileError, match="too few arguments"):
        cpu.raw_kernel(src, "k", [raw.write(x)])
    with pytest.raises(CompileError, match="implicit declaration"):
        cpu.raw_kernel(src, "not_defined", [raw.write(x), raw.read(y)])
    with pytest.raises(CompileError):  # a static where the function takes a pointer
        cpu.raw_kernel(src, "k", [raw.write(x)], statics=[StaticSymbol("s", 4)])
    # a static the function takes as anything but a 64-bit integer (found by review: an int
    # took 2**32 + 5 as 5, a double took the integer's bits as a tiny float)
    for param in ("int s", "double s", "float s", "char s"):
        with pytest.raises(CompileError, match="may change value"):
            cpu.raw_kernel(f"void k(float* out, {param}) {{ out[0] = s; }}\n", "k", [raw.write(x)],
                           statics=[StaticSymbol("s", 1 << 40)])
    for param in ("long long s", "long s", "int64_t s", "unsigned long long s", "size_t s"):  # 64 bits
        cpu.raw_kernel(f"#include <stdint.h>\n#include <stddef.h>\nvoid k(float* out, {param}) {{ out[0] = s; }}\n",
                       "k", [raw.write(x)], statics=[StaticSymbol("s", 1 << 40)])


def test_compile_errors_name_the_file(cpu: Backend, tmp_path: Path) -> None:
    path = tmp_path / "broken_kernel.c"
    path.write_text("void k(float* x) {\n  x[0] = undefined_thing;\n}\n")
    with pytest.raises(CompileError) as info:
        cpu.raw_kernel(path, "k", [raw.write(f32("x", (4,)))])
    assert str(path) in str(info.value) and "undefined_thing" in info.value.log
    assert ">>     2 |   x[0] = undefined_thing;" in str(info.value)
    with pytest.raises(CompileError, match="<raw kernel k>"):
        cpu.raw_kernel("void k(float* x) { nope; }", "k", [raw.write(f32("x", (4,)))])


def test_linking_checks_nodes_like_generated_code(cpu: Backend) -> None:
    n = 8
    _out, x, y, *_, code = _saxpy(cpu, n)
    dev = cpu.get_device(0)
    ctx = dev.make_context().init_from_host(x, np.ones(n, np.float32))
    before = dev.used_memory()
    with pytest.raises(NodeNotInContextError, match="y"):
        ctx.link(code)  # y is read but has no buffer here
    assert dev.used_memory() == before  # the failed link allocated nothing that stays
    const = cpu.compile(ir.Comp.of(ir.apply(Op.ADD, x, 1.0, into=y)), name="y_of_x")
    full = ctx.link(const).context
    with pytest.raises(InvalidArgumentError):
        full.link(code.batch)  # type: ignore[arg-type]
    r = full.link(code)
    assert r.context.buffers[y] == full.buffers[y]
    ro = f32("ro", (4,))
    c2 = dev.make_context()
    ro_ctx = c2.link(cpu.compile(ir.Comp.of(ir.Fetch(ro, ir.Constant(np.ones(4, np.float32)))), name="c")).context
    assert ro in ro_ctx.read_only
    writes_const = cpu.raw_kernel("void w(float* x) { x[0] = 1; }", "w", [raw.write(ro)])
    with pytest.raises(ReadOnlyNodeError):
        ro_ctx.link(writes_const)
    ctx.finalize()
    c2.finalize()


# -- lifetimes and threads ----------------------------------------------------------------------


def test_dropped_objects_while_in_flight(cpu: Backend) -> None:
    dev = cpu.get_device(0)
    n = 200
    x, y = f64("x", (n,)), f64("y", (n,))
    sn = StaticSymbol("n", n + 1)
    base = settled_memory(dev)
    stream = dev.new_stream()
    ctx = dev.make_context(stream).init_from_host(x, np.arange(n, dtype=np.float64))
    r = ctx.link(cpu.raw_kernel(SLOW_COPY, "slow_copy", [raw.write(y), raw.read(x)], statics=[sn],
                                bindings={sn: n}))
    r.run()  # sleeps 150 ms on the stream's worker while everything below is dropped
    out = r.context
    assert not stream.record().is_done()
    del r
    gc.collect()
    np.testing.assert_array_equal(out.read(y), np.arange(n) + 1.0)  # the routine's work completed

    r2 = out.link(cpu.raw_kernel(SLOW_COPY, "slow_copy", [raw.write(y), raw.read(x)], statics=[sn],
                                 bindings={sn: n}))
    r2.run()
    del r2, out, ctx, stream  # routine, code, contexts and stream, all while the kernel sleeps
    assert settled_memory(dev) == base


def test_threads_compile_link_and_run_raw_kernels(cpu: Backend) -> None:
    dev = cpu.get_device(0)
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work(k: int) -> None:
        try:
            n = 100 + k
            out, x, y, _sn, _sa, code = _saxpy(cpu, n, a=k % 16)
            hx, hy = np.full(n, k, np.float32), np.ones(n, np.float32)
            ctx = dev.make_context(dev.new_stream()).init_from_host(x, hx).init_from_host(y, hy)
            r = ctx.link(code)
            for _ in range(5):
                r.run()
            np.testing.assert_allclose(r.context.read(out), (k % 16) * hx + hy)
            ctx.finalize()
            ctx.stream.close()
        except BaseException as e:  # reported by the main thread
            with lock:
                errors.append(e)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(work, range(16)))
    assert not errors, errors[:3]
    assert time.perf_counter() - t0 < 120


def test_the_cpu_example_of_the_docs_runs_as_written() -> None:
    import contextlib
    import io
    import re

    doc = Path(__file__).resolve().parents[1] / "docs" / "raw-kernels.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
    (code,) = [b for b in blocks if 'get_backend("cpu")' in b]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(doc), "exec"), {})
    expected = re.search(r"# (\[.*\])", code)
    assert expected is not None and out.getvalue().strip() == expected.group(1)


BIG_STACK = r"""
import numpy as np
from polyjit import get_backend
from polyjit.core import raw
from polyjit.core import dtypes
from polyjit.core.ir import Node
SRC = '''
#include <string.h>
void big(float* out) {
    volatile char scratch[16 << 20];  /* 16 MiB on the stack: more than a host thread's 8 */
    memset((char*)scratch, 1, sizeof scratch);
    out[0] = (float)scratch[12345];
}
'''
be = get_backend("cpu")
out = Node("out", (1,), dtypes.float32)
r = be.get_device(0).make_context().link(be.raw_kernel(SRC, "big", [raw.write(out)]))
for _ in range(50):
    r.run()
    r.context.stream.synchronize()
print(float(r.context.read(out)[0]))
"""


def test_a_users_kernel_keeps_the_workers_stack_on_a_contended_machine() -> None:
    """Waiting threads run generated kernels on a busy machine, but never a user's: its C may
    keep large arrays on the stack, as the worker's 64 MiB stack allows."""
    env = {**os.environ, "POLYJIT_CPU_CONTENTION": "on"}
    proc = subprocess.run([sys.executable, "-c", BIG_STACK], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["1.0"]


def test_a_raw_kernel_that_writes_part_of_a_new_node_leaves_the_rest_zero(cpu: Backend) -> None:
    """A user's kernel may write any cells of its outputs: a node the link creates for it
    starts at zero, never with what a freed context left in the reused memory."""
    out = f64("part_out", (4096,))
    src = "void part(double* out) {\n  out[0] = 1.0;\n  out[4095] = 2.0;\n}\n"
    code = cpu.raw_kernel(src, "part", [raw.write(out)])
    dev = cpu.get_device(0)
    for _ in range(3):
        secret = f64("secret", (1 << 15,))
        with dev.make_context() as other:
            other.init_from_host(secret, np.full(1 << 15, 123.0)).stream.synchronize()
        with dev.make_context() as ctx:
            r = ctx.link(code)
            r.run()
            want = np.zeros(4096)
            want[0], want[-1] = 1.0, 2.0
            np.testing.assert_array_equal(r.context.read(out), want)


def test_a_dialect_with_its_own_calling_convention_must_say_how_users_kernels_bind() -> None:
    """Found by the review of this session's change: the default binding is C's trampoline,
    which a dialect that spells its own kernel_open would have appended, silently, to its
    users' kernels. It refuses such a dialect, naming what to override."""
    from polyjit.core.codegen import Dialect, KernelPlan, KernelSpec, LaunchShape, Names
    from polyjit.core.errors import UnsupportedError

    class Mine(Dialect):
        name = "mine"

        def kernel_open(self, spec: KernelSpec, names: Names) -> list[str]:
            return [f"kernel void {spec.name}(...) {{"]

    spec = KernelSpec("k", (), None, (), LaunchShape(), (), (), KernelPlan(raw.RAW, LaunchShape()))
    with pytest.raises(UnsupportedError, match=r"override Dialect\.raw_binding"):
        Mine().raw_binding("kernel void k() {}", spec)
    text, entry = Dialect().raw_binding("void k(void) {}", spec)
    assert entry == "pj_raw_k" and "k();" in text
