"""The OpenCL backend (pyopencl), tested on PoCL.

``OCL_ICD_VENDORS`` is pointed at a PoCL that builds on this host by ``tests/conftest.py``
(pip's, else the system's), unless it is set already. Tests that need two
devices run here when the platform shows two (``POCL_DEVICES="pthread pthread"``);
otherwise ``test_two_device_tests_in_a_subprocess`` runs them in a subprocess with that
variable set, so one plain ``pytest`` run covers them.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from polyjit.backends import get_backend
from polyjit.backends.opencl import OpenCLDialect, OpenCLDriver, create_backend
from polyjit.core import dtypes, ir
from polyjit.core.codegen import Source, generate
from polyjit.core.errors import CompileError, PoolExhaustedError, UnsupportedError
from polyjit.core.ir import AccumOp, Node, Op, StaticSymbol
from polyjit.core.lower import lower
from polyjit.core.protocol import MergeBuffer
from polyjit.core.runtime import Backend, device_to_device, init_from_device
from polyjit.testing import ConformanceSuite, required_backends

cl: Any = pytest.importorskip("pyopencl")

ROOT = Path(__file__).resolve().parent.parent
IN_SUBPROCESS = "POLYJIT_OPENCL_TEST_SUBPROCESS"
Array = np.ndarray[Any, Any]


def _required() -> bool:
    return "opencl" in required_backends()


@pytest.fixture(scope="module")
def backend() -> Backend:
    be = get_backend("opencl")
    if be.num_devices() == 0:
        reason = f"no OpenCL device: {be.driver.unavailable_reason}"  # type: ignore[attr-defined]
        if _required():
            pytest.fail(reason)
        pytest.skip(reason)
    return be


@pytest.fixture(scope="module")
def two_devices(backend: Backend) -> Backend:
    if backend.num_devices() < 2:
        pytest.skip("needs two OpenCL devices (POCL_DEVICES='pthread pthread'); "
                    "test_two_device_tests_in_a_subprocess runs these with two")
    return backend


def f32(name: str, shape: tuple[int, ...]) -> Node:
    return Node(name, shape, dtypes.float32)


def run_comps(backend: Backend, comps: Sequence[ir.Comp], inputs: Mapping[Node, Array],
              outputs: Sequence[Node], ordinal: int = 0,
              bindings: Mapping[StaticSymbol, int] | None = None) -> dict[Node, Array]:
    """Compile, link on a fresh context of the device, run every routine once, read outputs."""
    dev = backend.get_device(ordinal)
    root = dev.make_context()
    ctx = root
    for node, value in inputs.items():
        ctx = ctx.init_from_host(node, value)
    batch = backend.compile_batch(list(comps), names=[f"c{k}" for k in range(len(comps))])
    routines = ctx.link_batch(batch)
    for r in routines:
        if bindings:
            r.bindings.update(bindings)
        r.run()
    out = {n: routines[-1].context.read(n) for n in outputs}
    root.finalize()
    return out


def source_of(comps: Sequence[ir.Comp], dialect: OpenCLDialect | None = None) -> Source:
    lowered = lower(list(comps), [f"c{k}" for k in range(len(comps))])
    return generate(lowered, dialect or OpenCLDialect())


# ---------------------------------------------------------------------------
# The dialect (needs no device)


def test_kernel_takes_pools_plus_offsets_and_long_statics() -> None:
    k = StaticSymbol("k", 4)
    src, row, out = f32("src", (4, 5)), f32("row", (5,)), f32("out", (5,))
    comp = ir.Comp.of(ir.slice_at(row, src, k), ir.apply(Op.MUL, row, 2.0, into=out))
    text = source_of([comp]).text
    assert "__kernel void c0_" in text
    assert "__global char* p0, ulong o0, __global char* p1, ulong o1, long s0" in text
    assert "__global float* restrict b0 = (__global float*)(p0 + o0);" in text
    assert "__global const float* restrict b1 = (__global const float*)(p1 + o1);" in text
    assert "get_global_id(0)" in text
    assert "cl_khr_fp64" not in text


def test_float64_enables_fp64_and_math_is_overloaded() -> None:
    x, y = Node("x", (9,), dtypes.float64), Node("y", (9,), dtypes.float64)
    text = source_of([ir.Comp.of(ir.apply(Op.EXP, x, into=y))]).text
    assert "#pragma OPENCL EXTENSION cl_khr_fp64 : enable" in text
    assert "exp(b1[" in text and "expf" not in text
    a, b = f32("a", (9,)), f32("b", (9,))
    text = source_of([ir.Comp.of(ir.apply(Op.ABS, a, into=b))]).text
    assert "fabs(b1[" in text and "cl_khr_fp64" not in text


def test_bool_is_stored_as_uchar() -> None:
    a, b, m = f32("a", (6,)), f32("b", (6,)), Node("m", (6,), dtypes.bool_)
    text = source_of([ir.Comp.of(ir.apply(Op.LT, a, b, into=m))]).text
    assert "__global uchar* restrict b0" in text


def test_launch_sizes_are_rounded_and_guarded() -> None:
    d = OpenCLDialect()
    a, t = f32("a", (37, 1001)), f32("t", (1001, 37))
    comp = ir.Comp.of(ir.einsum("ij->ji", a, into=t))
    (kernel,) = lower([comp], ["c0"]).kernels
    launch = d.launch_shape(kernel)
    assert launch.local_size is not None and len(launch.global_size) == 2
    assert int(np.prod(launch.local_size)) <= d.work_group
    for g, lsz, e in zip(launch.global_size, launch.local_size, (37, 1001)):
        assert g % lsz == 0 and g >= e
    text = source_of([comp]).text
    assert "if (i0 >= 37) return;" in text or "if (i1 >= 37) return;" in text


def test_more_than_three_parallel_loops_share_dim_2() -> None:
    a, t = f32("a", (2, 3, 4, 5, 6)), f32("t", (6, 5, 4, 3, 2))
    comp = ir.Comp.of(ir.einsum("abcde->edcba", a, into=t))
    (kernel,) = lower([comp], ["c0"]).kernels
    assert len(kernel.parallel) == 5
    launch = OpenCLDialect().launch_shape(kernel)
    assert len(launch.global_size) == 3
    assert "pj_flat" in source_of([comp]).text


def test_matmul_shaped_kernels_get_the_tiled_kernel() -> None:
    a, b, c = f32("a", (64, 48)), f32("b", (48, 80)), f32("c", (64, 80))
    comp = ir.Comp.of(ir.einsum("ik,kj->ij", a, b, into=c))
    (kernel,) = lower([comp], ["c0"]).kernels
    d = OpenCLDialect()
    assert d.contraction(kernel) is not None
    launch = d.launch_shape(kernel)
    assert launch.local_size == (d.tiles.lx, d.tiles.ly, 1)
    text = source_of([comp]).text
    assert "PJ_MATMUL_WG" in text and "__local float pj_xs" in text and "vload8" in text
    small = ir.Comp.of(ir.einsum("ik,kj->ij", f32("a", (4, 4)), f32("b", (4, 4)), into=f32("c", (4, 4))))
    assert "PJ_MATMUL_WG void" not in source_of([small]).text
    assert "PJ_MATMUL_WG void" not in source_of([comp], OpenCLDialect(matmul=False)).text


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
# Programs against numpy


def test_fused_elementwise_chain(backend: Backend) -> None:
    n = 10_007
    a, b, c, t, u, out = (f32(s, (n,)) for s in ("a", "b", "c", "t", "u", "out"))
    comp = ir.Comp.of(ir.apply(Op.MUL, a, b, into=t), ir.apply(Op.TANH, t, into=u),
                      ir.apply(Op.SUB, u, c, into=out))
    batch = backend.compile_batch([comp], names=["chain"])
    assert len(batch.source.all_kernels) == 1  # fused into one kernel
    rng = np.random.default_rng(0)
    xs = {a: rng.standard_normal(n).astype(np.float32), b: rng.standard_normal(n).astype(np.float32),
          c: rng.standard_normal(n).astype(np.float32)}
    got = run_comps(backend, [comp], xs, [out])[out]
    np.testing.assert_allclose(got, np.tanh(xs[a] * xs[b]) - xs[c], rtol=1e-5, atol=1e-6)


def test_reductions(backend: Backend) -> None:
    rng = np.random.default_rng(1)
    x = f32("x", (33, 129))
    rows, cols, total = f32("rows", (33,)), f32("cols", (129,)), f32("total", ())
    li = Node("li", (9, 17), dtypes.int64)
    lmax, lmin = Node("lmax", (9,), dtypes.int64), Node("lmin", (17,), dtypes.int64)
    comps = [
        ir.Comp.of(ir.einsum("ij->i", x, into=rows)),
        ir.Comp.of(ir.einsum("ij->j", x, into=cols, accum=AccumOp.MAX)),
        ir.Comp.of(ir.einsum("ij->", x, into=total)),  # no parallel nest: one work-item
        ir.Comp.of(ir.einsum("ij->i", li, into=lmax, accum=AccumOp.MAX)),  # INT64_MIN neutral
        ir.Comp.of(ir.einsum("ij->j", li, into=lmin, accum=AccumOp.MIN)),  # INT64_MAX neutral
    ]
    xv = rng.standard_normal((33, 129)).astype(np.float32)
    lv = rng.integers(-(2**62), 2**62, (9, 17), dtype=np.int64)
    got = run_comps(backend, comps, {x: xv, li: lv}, [rows, cols, total, lmax, lmin])
    np.testing.assert_allclose(got[rows], xv.sum(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[cols], xv.max(0))
    np.testing.assert_allclose(got[total], xv.sum(), rtol=1e-4)
    np.testing.assert_array_equal(got[lmax], lv.max(1))
    np.testing.assert_array_equal(got[lmin], lv.min(0))


def test_bools_and_where(backend: Backend) -> None:
    rng = np.random.default_rng(2)
    a, b, r = f32("a", (50,)), f32("b", (50,)), f32("r", (50,))
    m = Node("m", (50,), dtypes.bool_)
    comps = [ir.Comp.of(ir.apply(Op.GT, a, b, into=m), ir.apply(Op.WHERE, m, a, b, into=r),
                        embedded=[m, r])]
    av, bv = rng.standard_normal(50).astype(np.float32), rng.standard_normal(50).astype(np.float32)
    got = run_comps(backend, comps, {a: av, b: bv}, [m, r])
    np.testing.assert_array_equal(got[m], av > bv)
    np.testing.assert_array_equal(got[r], np.maximum(av, bv))


def test_five_dimensional_transpose(backend: Backend) -> None:
    a, t = f32("a", (2, 3, 4, 5, 6)), f32("t", (6, 5, 4, 3, 2))
    av = np.arange(720, dtype=np.float32).reshape(a.shape)
    got = run_comps(backend, [ir.Comp.of(ir.einsum("abcde->edcba", a, into=t))], {a: av}, [t])[t]
    np.testing.assert_array_equal(got, av.transpose(4, 3, 2, 1, 0))


def test_statics_are_bound_at_each_run(backend: Backend) -> None:
    k = StaticSymbol("k", 6)
    src, row = f32("src", (6, 40)), f32("row", (40,))
    code = backend.compile(ir.Comp.of(ir.slice_at(row, src, k)), name="pick")
    sv = np.arange(240, dtype=np.float32).reshape(6, 40)
    ctx = backend.get_device(0).make_context().init_from_host(src, sv)
    r = ctx.link(code)
    for v in (3, 0, 5):
        r.bindings[k] = v
        r.run()
        np.testing.assert_array_equal(r.context.read(row), sv[v])
    ctx.finalize()


def _matmul_backend(variant: str) -> Backend:
    be = create_backend(matmul_variant=variant)
    be.driver.dialect.matmul_min_side = 1  # type: ignore[attr-defined]  # tile even small cases
    be.driver.dialect.matmul_min_work = 0  # type: ignore[attr-defined]
    return be


@pytest.fixture(scope="module", params=["auto", "local", "off"])
def matmul_backend(request: pytest.FixtureRequest, backend: Backend) -> Backend:
    return _matmul_backend(request.param)


MATMUL_CASES = {
    "edges": ("ik,kj->ij", (100, 70), (70, 50)),
    "whole_tiles": ("ik,kj->ij", (64, 32), (32, 128)),
    "transposed_x": ("ki,kj->ij", (37, 45), (37, 29)),
    "batched": ("bik,bkj->bij", (3, 20, 17), (3, 17, 24)),
    "tiny": ("ik,kj->ij", (1 + 2, 5), (5, 9)),
}


@pytest.mark.parametrize("case", sorted(MATMUL_CASES))
def test_matmul(matmul_backend: Backend, case: str) -> None:
    spec, sa, sb = MATMUL_CASES[case]
    rng = np.random.default_rng(3)
    a, b = f32("a", sa), f32("b", sb)
    want_np = np.einsum(spec, np.ones(sa, np.float32), np.ones(sb, np.float32))
    c = f32("c", want_np.shape)
    av, bv = rng.standard_normal(sa).astype(np.float32), rng.standard_normal(sb).astype(np.float32)
    got = run_comps(matmul_backend, [ir.Comp.of(ir.einsum(spec, a, b, into=c))], {a: av, b: bv}, [c])[c]
    np.testing.assert_allclose(got, np.einsum(spec, av, bv), rtol=1e-4, atol=1e-4)


def test_matmul_accumulates_onto_the_context_and_float64(matmul_backend: Backend) -> None:
    rng = np.random.default_rng(4)
    a, b, c = f32("a", (40, 30)), f32("b", (30, 50)), f32("c", (40, 50))
    av, bv = rng.standard_normal((40, 30)).astype(np.float32), rng.standard_normal((30, 50)).astype(np.float32)
    cv = rng.standard_normal((40, 50)).astype(np.float32)
    onto = ir.Comp.of(ir.einsum("ik,kj->ij", a, b, into=c, init_neutral=False))
    got = run_comps(matmul_backend, [onto], {a: av, b: bv, c: cv}, [c])[c]
    np.testing.assert_allclose(got, cv + av @ bv, rtol=1e-4, atol=1e-4)
    if not matmul_backend.get_device(0).properties["fp64"]:
        return
    x, y, z = (Node(n, s, dtypes.float64) for n, s in (("x", (33, 21)), ("y", (21, 19)), ("z", (33, 19))))
    xv, yv = rng.standard_normal((33, 21)), rng.standard_normal((21, 19))
    got = run_comps(matmul_backend, [ir.Comp.of(ir.einsum("ik,kj->ij", x, y, into=z))], {x: xv, y: yv}, [z])[z]
    np.testing.assert_allclose(got, xv @ yv, rtol=1e-12, atol=1e-12)


def test_matmul_with_a_static_index_and_the_merge_buffer(backend: Backend) -> None:
    be = _matmul_backend("auto")
    dev = be.get_device(0)
    rng = np.random.default_rng(5)
    s = StaticSymbol("s", 3)
    stack, w, row_mm = f32("stack", (3, 24, 16)), f32("w", (16, 40)), f32("out", (24, 40))
    sv, wv = rng.standard_normal((3, 24, 16)).astype(np.float32), rng.standard_normal((16, 40)).astype(np.float32)
    # x[i, k] = stack[s, i, k]: the static goes into the tiled kernel's index expressions
    i, j, k = ir.Symbol("i"), ir.Symbol("j"), ir.Symbol("k")
    pr = ir.projections([(i, 24), (j, 40), (k, 16)], [i, j], [s, i, k], [k, j])
    comp = ir.Comp.of(ir.Accum(row_mm, AccumOp.ADD, Op.MUL, (stack, w), pr))
    ctx = dev.make_context().init_from_host(stack, sv).init_from_host(w, wv)
    r = ctx.link(be.compile(comp, name="static_mm"))
    assert "PJ_MATMUL_WG void" in r.source.text
    for v in (2, 0):
        r.bindings[s] = v
        r.run()
        np.testing.assert_allclose(r.context.read(row_mm), sv[v] @ wv, rtol=1e-4, atol=1e-4)
    # the right operand read from the merge buffer of the same device
    mctx = device_to_device(w, dst=ctx, src=ctx, into_merge_buffer=MergeBuffer.COPY)
    assert mctx is not None
    a, out2 = f32("a2", (24, 16)), f32("out2", (24, 40))
    merged = ir.Comp.of(ir.einsum("ik,kj->ij", a, ir.merge(w), into=out2))
    mc = mctx.context.init_from_host(a, sv[1])
    r2 = mc.link(be.compile(merged, name="merge_mm"))
    r2.run()
    np.testing.assert_allclose(r2.context.read(out2), sv[1] @ wv, rtol=1e-4, atol=1e-4)
    ctx.finalize()


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
    with pytest.raises(ValueError, match="binary_cache"):
        create_backend(binary_cache="sometimes")


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
    assert time.perf_counter() - t0 < 1.0
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
    assert time.perf_counter() - t0 < 1.0
    gc.collect()
    retained = ctx.stream.retained  # the runtime keeps the array and pyopencl's NannyEvent
    assert len(retained) == 1
    time.sleep(0.05)
    assert not ctx.stream.record().is_done()
    gate.set_status(cl.command_execution_status.COMPLETE)
    np.testing.assert_array_equal(ctx.read(x), np.arange(100_000, dtype=np.float32))
    assert len(retained) == 0  # released once the copy is done
    ctx.finalize()


def _slow_accumulate(n: int = 1 << 20) -> tuple[ir.Comp, Node, Node]:
    x, acc = f32("slow_x", (n,)), f32("slow_acc", (n,))
    return ir.Comp.of(ir.apply(Op.ID, x, into=acc, accum=AccumOp.ADD, init_neutral=False)), x, acc


def test_two_streams_on_one_device(backend: Backend) -> None:
    dev = backend.get_device(0)
    comp, x, acc = _slow_accumulate()
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
        comp, x, acc = _slow_accumulate()
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


def _is_pocl(backend: Backend) -> bool:
    return "portable computing language" in str(backend.get_device(0).properties["platform"]).lower()


def test_two_device_tests_in_a_subprocess(backend: Backend) -> None:
    """Runs the two-device tests (mine and the conformance kit's) with POCL_DEVICES='pthread pthread'
    when this process has a single device."""
    if os.environ.get(IN_SUBPROCESS):
        pytest.skip("already in the subprocess")
    if backend.num_devices() >= 2:
        pytest.skip("this process has two devices: the two-device tests ran here")
    if not _is_pocl(backend):
        pytest.skip("only PoCL can be asked for a second device (POCL_DEVICES)")
    from polyjit.testing.suite import CHECKS, check_name, needs_multi_device

    multi = [f"test_{check_name(c)}" for c in CHECKS if needs_multi_device(c)]
    select = "TestTwoDevices or (TestOpenCLConformance and (" + " or ".join(multi) + "))"
    env = {**os.environ, "POCL_DEVICES": "pthread pthread", IN_SUBPROCESS: "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)), "-k", select],
        env=env, capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    tail = (out.stdout + out.stderr)[-6000:]
    assert out.returncode == 0, tail
    assert "skipped" not in out.stdout.splitlines()[-1], tail  # two devices: nothing may skip
    assert f"{len(multi) + 5} passed" in out.stdout, tail


# ---------------------------------------------------------------------------
# The conformance kit


class TestOpenCLConformance(ConformanceSuite):
    backend_name = "opencl"

    def multi_device_backend(self) -> Backend | None:
        be = self.backend()
        return be if be.num_devices() >= 2 else None


# ---------------------------------------------------------------------------
# The benchmark still runs (small sizes)


def test_benchmark_smoke(backend: Backend) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_opencl
    finally:
        sys.path.pop(0)
    seen: list[str] = []

    def report(name: str, value: float, unit: str) -> None:
        seen.append(name)

    assert bench_opencl.bench_elementwise(report, n=4096, repeat=2)["copy_ratio"] > 0
    assert bench_opencl.bench_matmul(report, m=64, repeat=1)["speedup_vs_naive"] > 0
    assert bench_opencl.bench_launch(report, calls=20, rounds=2)["ratio"] > 0
    bench_opencl.bench_d2d(report, nbytes=1 << 16, repeat=2)
    assert len(seen) >= 14


def _long_reductions() -> list[Any]:
    """Few cells, long reductions: every AccumOp, integer and float, onto what the context
    holds too (init_neutral=False), with and without a parallel nest."""
    from polyjit.testing.programs import program, values

    out = []
    every = list(AccumOp)
    for dt, accums in ((dtypes.float32, every), (dtypes.int32, every), (dtypes.float64, [AccumOp.ADD])):
        for accum in accums:
            kind = "unit" if accum is AccumOp.MUL else ("quarter" if dt.is_float else "any")
            for spec, shape in (("i->", (3000,)), ("ij->i", (5, 1200)), ("ij->j", (900, 7)),
                                ("ijk->j", (9, 3, 80))):
                x = Node("x", shape, dt)
                out_shape = tuple(n for c, n in zip(spec.split("->")[0], shape) if c in spec.split("->")[1])
                o = Node("o", out_shape, dt)
                for neutral in (True, False):
                    inputs = [(x, values(dt, shape, kind))] + ([] if neutral else [(o, values(dt, out_shape, kind))])
                    out.append(program(f"group.{dt}.{accum.value}.{spec}.{neutral}",
                                       ir.einsum(spec, x, into=o, accum=accum, init_neutral=neutral),
                                       inputs=inputs, outputs=[o], rtol=1e-4, atol=1e-4))
    return out


def test_group_reductions_match_the_reference() -> None:
    """The work-group-per-cell reduction (core/group_reduce.py; the default on GPU platforms,
    off on PoCL's CPU devices) forced on, against the reference interpreter."""
    from polyjit.testing import run_programs

    be = create_backend(group_reductions="on")
    progs = _long_reductions()
    x, o = Node("x", (4096,)), Node("o", ())
    assert "pj_red[" in be.compile(ir.Comp.of(ir.einsum("i->", x, into=o)), name="g").source
    failures = run_programs(be, progs)
    assert not failures, "\n\n".join(str(f) for f in failures[:5])
    # and the default on this platform of CPU devices: one work-item per cell
    assert "pj_red[" not in create_backend().compile(ir.Comp.of(ir.einsum("i->", x, into=o)), name="g").source
    with pytest.raises(ValueError, match="group_reductions"):
        create_backend(group_reductions="sometimes")
