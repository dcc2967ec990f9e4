"""float16 and bfloat16 as node dtypes: the dtype table, the conversions every dialect writes
(exhaustively against numpy and ml_dtypes), arithmetic and reductions on the backends against
numpy's own half arithmetic, the reference interpreter's semantics, lowering and kernel plans,
DLPack, the kit, and the tensor front end's mixed precision."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from polyjit import get_backend, ir
from polyjit import tensor as pt
from polyjit.backends.cpu.dialect import CpuDialect
from polyjit.backends.cuda.dialect import CudaDialect
from polyjit.backends.opencl.dialect import OpenCLDialect
from polyjit.core import codegen, dlpack, dtypes, half, lower, patterns
from polyjit.core.dtypes import DType
from polyjit.core.errors import InvalidProgramError, ValueRangeError
from polyjit.core.ir import AccumOp, Node, Op, Symbol
from polyjit.core.reference import run_reference
from polyjit.core.runtime import Backend

torch: Any = None
with contextlib.suppress(ImportError):
    import torch

Array = np.ndarray[Any, Any]
F16, BF16 = dtypes.float16, dtypes.bfloat16
HERE = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------
# Values the conversions must get right


def _half_bits() -> Array:
    """Every 16-bit pattern."""
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def _float32_cases(dt: DType) -> Array:
    """float32 values for a store to ``dt``: a sweep over all float32 bit patterns (every 4099th),
    every tie between two neighbouring values of ``dt`` and the floats on either side of it,
    and the edges (overflow to inf, subnormals, values that vanish, signed zeros, NaN)."""
    sweep = (np.arange(0, 1 << 32, 4099, dtype=np.uint64)).astype(np.uint32).view(np.float32)
    values = _half_bits().view(dt.np).astype(np.float32)
    finite = np.unique(values[np.isfinite(values)].astype(np.float64))
    ties = ((finite[:-1] + finite[1:]) / 2).astype(np.float32)  # exact in float32
    around = np.concatenate([np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(-np.inf))])
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.996, 65520, 65536, 3.389e38, 3.3961776e38,
                      np.finfo(np.float32).max, 2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 2.0**-133, 1e-45], np.float32)
    return np.concatenate([sweep, ties, around, edges, -edges])


def _same(got: Array, want: Array) -> Array:
    """Equal bits, or both NaN (payloads and NaN signs are free)."""
    g, w = got.astype(np.float32), want.astype(np.float32)
    return (g.view(np.uint32) == w.view(np.uint32)) | (np.isnan(g) & np.isnan(w))


def _assert_same(label: str, got: Array, want: Array, inputs: Array) -> None:
    ok = _same(got, want)
    if not ok.all():
        bad = np.flatnonzero(~ok)[:5]
        shown = ", ".join(f"{inputs[k]!r} -> {got[k]!r} (want {want[k]!r})" for k in bad)
        raise AssertionError(f"{label}: {int((~ok).sum())} of {ok.size} differ: {shown}")


def _bf16_oracle(x: Array) -> Array:
    """float64 -> bfloat16, correctly rounded (to nearest even), for normal values: the two
    neighbours by truncation, their distances exact (Sterbenz), the nearer one."""
    x = np.asarray(x, np.float64)
    f = x.astype(np.float32)
    f = np.where(np.abs(f.astype(np.float64)) > np.abs(x), np.nextafter(f, np.float32(0)), f)
    lo_bits = f.view(np.uint32) & np.uint32(0xFFFF0000)
    lo = lo_bits.view(np.float32).astype(np.float64)
    hi = (lo_bits + np.uint32(0x10000)).view(np.float32).astype(np.float64)
    d_lo, d_hi = np.abs(x - lo), np.abs(hi - x)
    even = (lo_bits >> np.uint32(16)) & np.uint32(1) == 0
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & ~even)
    return np.where(pick_hi, hi, lo).astype(np.float32).astype(BF16.np)


# ---------------------------------------------------------------------------
# The dtype table


def test_half_dtypes_compare_like_numpy_dtypes() -> None:
    assert np.float16 == F16 and np.dtype("float16") == F16 and F16 == "float16"
    assert ml_dtypes.bfloat16 == BF16 and np.dtype(ml_dtypes.bfloat16) == BF16 and BF16 == "bfloat16"
    assert F16 != BF16 and np.float16 != BF16 and np.float32 != F16
    assert dtypes.as_dtype("bfloat16") is BF16 and dtypes.as_dtype(np.float16) is F16
    assert dtypes.as_dtype(ml_dtypes.bfloat16) is BF16
    assert {dtypes.as_dtype(np.dtype(ml_dtypes.bfloat16))} == {BF16}
    for dt in dtypes.HALF:
        assert dt.itemsize == 2 and dt.is_float and dt.is_half and dt.compute is dtypes.float32
        assert np.empty(3, dt).dtype == dt.np and dt in dtypes.ALL
    assert dtypes.float32.compute is dtypes.float32 and not dtypes.float64.is_half


def test_to_half_rounds_float64_once() -> None:
    """float64 -> half goes through float32 rounded to odd: correctly rounded, where
    float64 -> float32 -> half would round twice (ml_dtypes' own cast does)."""
    eps = 2.0**-8
    x = np.array([1 + eps + 2.0**-30, 1 + eps - 2.0**-30, -(1 + eps + 2.0**-40)])
    assert dtypes.to_half(x, BF16).astype(np.float64).tolist() == [1 + 2 * eps, 1.0, -(1 + 2 * eps)]
    assert x.astype(ml_dtypes.bfloat16)[0] == 1.0  # what the double rounding gives
    rng = np.random.default_rng(0)
    wide = np.concatenate([rng.standard_normal(200_000) * 10.0 ** rng.integers(-30, 30, 200_000),
                           (rng.integers(1, 1 << 16, 200_000) + 0.5) * 2.0 ** rng.integers(-20, 20, 200_000)])
    np.testing.assert_array_equal(dtypes.to_half(wide, BF16).astype(np.float32), _bf16_oracle(wide).astype(np.float32))
    small = rng.standard_normal(200_000) * 10.0 ** rng.integers(-9, 5, 200_000)
    ties = (np.arange(2048, 4096) + 0.5) * 2.0 ** rng.integers(-24, 4, 2048)
    for vals in (small, ties, ties + 2.0**-40, ties - 2.0**-40):
        with np.errstate(over="ignore"):
            want = vals.astype(np.float16)  # numpy rounds float64 -> float16 correctly
        assert _same(dtypes.to_half(vals, F16), want).all()
    assert np.isnan(dtypes.to_half(np.array([np.nan]), F16)).all()
    assert dtypes.to_half(np.array([1e300, -1e300, 65520.0, 65519.99]), F16).tolist() == [np.inf, -np.inf, np.inf, 65504]
    assert dtypes.round_scalar(0.1, F16) == float(np.float16(0.1)) and dtypes.round_scalar(0.1, dtypes.float32) == 0.1


# ---------------------------------------------------------------------------
# The conversions of each dialect, exhaustively


_C_DRIVER = """
void pj_test_ld_{n}(const {u16}* in, float* out, long n) {{ for (long i = 0; i < n; ++i) out[i] = {ld}; }}
void pj_test_st_{n}(const float* in, {u16}* out, long n) {{ for (long i = 0; i < n; ++i) {st}; }}
void pj_test_rnd_{n}(const float* in, float* out, long n) {{ for (long i = 0; i < n; ++i) out[i] = {rnd}; }}
"""


def _host_library(tmp: Path, dialect: codegen.Dialect, compiler: list[str], head: list[str], name: str) -> ctypes.CDLL:
    """The dialect's half helpers and a load/store/round loop per half type, built for the host."""
    lines = list(head)
    for _, body in half.helpers(dialect.half_spelling, {F16, BF16, dtypes.float64}):
        lines += body
    lines.append('extern "C" {' if "++" in compiler[0] else "")
    for dt in dtypes.HALF:
        u16 = dialect.half_spelling.u16
        lines.append(_C_DRIVER.format(n=dt.name, u16=u16, ld=dialect.half_load(dt, "in[i]"),
                                      st=dialect.half_store(dt, "out[i]", "in[i]"), rnd=dialect.half_round(dt, "in[i]")))
    lines.append(f"void pj_test_odd(const double* in, float* out, long n) {{ for (long i = 0; i < n; ++i) "
                 f"out[i] = {half.F64_TO_F32_ODD}(in[i]); }}")
    lines.append("}" if "++" in compiler[0] else "")
    src, lib = tmp / f"{name}.src", tmp / f"{name}.so"
    src.write_text("\n".join(lines) + "\n")
    language = ["-x", "c++"] if "++" in compiler[0] else ["-x", "c"]
    proc = subprocess.run([*compiler, *language, "-shared", "-fPIC", "-o", str(lib), str(src)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[:4000]
    return ctypes.CDLL(str(lib))


def _run(lib: Any, fn: str, x: Array, out_dtype: Any) -> Array:
    out = np.empty(x.size, out_dtype)
    getattr(lib, fn)(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_long(x.size))
    return out


def _check_conversions(lib: Any, label: str) -> None:
    for dt in dtypes.HALF:
        bits = _half_bits()
        loaded = _run(lib, f"pj_test_ld_{dt.name}", bits, np.float32)
        _assert_same(f"{label} load {dt}", loaded, bits.view(dt.np).astype(np.float32), bits.view(dt.np))
        xs = _float32_cases(dt)
        with np.errstate(all="ignore"):
            want = xs.astype(dt.np)  # numpy / ml_dtypes: round to nearest even
        stored = _run(lib, f"pj_test_st_{dt.name}", xs, np.uint16).view(dt.np)
        _assert_same(f"{label} store {dt}", stored, want, xs)
        assert (np.signbit(stored.astype(np.float32)) == np.signbit(xs))[~np.isnan(xs)].all(), f"{label}: signs"
        rounded = _run(lib, f"pj_test_rnd_{dt.name}", xs, np.float32)
        _assert_same(f"{label} round {dt}", rounded, want.astype(np.float32), xs)
    rng = np.random.default_rng(1)
    d = np.concatenate([rng.standard_normal(100_000) * 10.0 ** rng.integers(-50, 50, 100_000),
                        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e300, -1e300, 1e-300, -1e-300, 3.4028235e38,
                                  3.4028236e38, 1.0 + 2.0**-30])])
    odd = _run(lib, "pj_test_odd", d, np.float32)
    _assert_same(f"{label} float64 -> float32 rounded to odd", odd, dtypes.float32_round_to_odd(d), d)


def _cc() -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    return cc


@pytest.mark.parametrize("native", [True, False], ids=["Float16", "portable"])
def test_c_conversions_are_exact(tmp_path: Path, native: bool) -> None:
    """The C dialect's helpers: _Float16 where the compiler has it, the portable bit
    conversions otherwise (forced here with -DPJ_NO_FLOAT16)."""
    flags = [_cc(), "-O3", "-march=native", "-std=gnu11"] + ([] if native else ["-DPJ_NO_FLOAT16"])
    lib = _host_library(tmp_path, CpuDialect(), flags, ["#include <stdint.h>", "#include <math.h>"],
                        "c_native" if native else "c_portable")
    _check_conversions(lib, "C" + (" (_Float16)" if native else " (portable)"))


def test_cuda_host_conversions_are_exact(tmp_path: Path) -> None:
    """The CUDA dialect's helpers compiled for the host (what the host shim runs: the portable
    forms, __CUDA_ARCH__ undefined)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    lib = _host_library(tmp_path, CudaDialect(), [cxx, "-O1", "-std=c++17", f"-I{HERE / 'cuda'}"],
                        ['#include "host_shim.h"'], "cuda_host")
    _check_conversions(lib, "CUDA on the host")


def test_cuda_device_conversions_are_the_ptx_instructions() -> None:
    """On the device the conversions are cvt instructions (bfloat16's store from sm_80); NVRTC
    compiles them for every arch it supports, with no toolkit headers."""
    nvrtc = pytest.importorskip("polyjit.backends.cuda.nvrtc")
    from polyjit.core.errors import BackendUnavailableError

    a, b, c = Node("a", (8,), F16), Node("b", (8,), BF16), Node("c", (8,), dtypes.float64)
    r1, r2, r3 = Node("r1", (8,), F16), Node("r2", (8,), BF16), Node("r3", (8,), F16)
    comp = ir.Comp.of(ir.apply(Op.EXP, a, into=r1), ir.apply(Op.MUL, b, b, into=r2), ir.apply(Op.CAST, c, into=r3))
    text = codegen.generate(lower.lower([comp], ["k"]), CudaDialect()).text
    assert "#include" not in text
    try:
        archs = nvrtc.nvrtc_supported_archs()
    except BackendUnavailableError as e:
        pytest.skip(str(e))
    for arch in (min(archs), 80, 90):
        ptx = nvrtc.nvrtc_compile(text, f"sm_{arch}", kind="ptx").decode(errors="replace")
        assert "cvt.f32.f16" in ptx and "cvt.rn.f16.f32" in ptx, arch
        assert ("cvt.rn.bf16.f32" in ptx) == (arch >= 80), arch
        assert nvrtc.nvrtc_compile(text, f"sm_{arch}")[:4] == b"\x7fELF"


def _opencl_backend() -> Backend:
    try:
        be = get_backend("opencl")
    except Exception as e:  # pyopencl or a platform missing
        pytest.skip(f"no OpenCL: {e}")
    if be.num_devices() == 0:
        pytest.skip("no OpenCL device")
    return be


def test_opencl_conversions_are_exact() -> None:
    """OpenCL: vload_half / vstore_half_rte (and a private half for rounding) for float16, the
    portable bit conversions for bfloat16, on the OpenCL device."""
    _opencl_backend()
    import pyopencl as cl

    d = OpenCLDialect()
    lines = ["#pragma OPENCL EXTENSION cl_khr_fp64 : enable"]
    for _, body in half.helpers(d.half_spelling, {F16, BF16, dtypes.float64}):
        lines += body
    for dt in dtypes.HALF:
        t = d.type_name(dt)
        lines.append(
            f"__kernel void ld_{dt.name}(__global const {t}* in, __global float* out) "
            f"{{ size_t i = get_global_id(0); out[i] = {d.half_load(dt, 'in[i]')}; }}\n"
            f"__kernel void st_{dt.name}(__global const float* in, __global {t}* out) "
            f"{{ size_t i = get_global_id(0); {d.half_store(dt, 'out[i]', 'in[i]')}; }}\n"
            f"__kernel void rnd_{dt.name}(__global const float* in, __global float* out) "
            f"{{ size_t i = get_global_id(0); out[i] = {d.half_round(dt, 'in[i]')}; }}")
    lines.append(f"__kernel void odd(__global const double* in, __global float* out) "
                 f"{{ size_t i = get_global_id(0); out[i] = {half.F64_TO_F32_ODD}(in[i]); }}")
    ctx = cl.Context([cl.get_platforms()[0].get_devices()[0]])
    if "cl_khr_fp64" not in ctx.devices[0].extensions:
        pytest.skip("the OpenCL device has no fp64")
    queue = cl.CommandQueue(ctx)
    program = cl.Program(ctx, "\n".join(lines)).build()

    def run(name: str, x: Array, out_dtype: Any) -> Array:
        mf = cl.mem_flags
        xb = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(x).view(np.uint8))
        out = np.empty(x.size, out_dtype)
        ob = cl.Buffer(ctx, mf.WRITE_ONLY, max(out.nbytes, 1))
        getattr(program, name)(queue, (x.size,), None, xb, ob)
        cl.enqueue_copy(queue, out, ob)
        queue.finish()
        return out

    for dt in dtypes.HALF:
        bits = _half_bits()
        _assert_same(f"OpenCL load {dt}", run(f"ld_{dt.name}", bits, np.float32), bits.view(dt.np).astype(np.float32),
                     bits.view(dt.np))
        xs = _float32_cases(dt)
        with np.errstate(all="ignore"):
            want = xs.astype(dt.np)
        _assert_same(f"OpenCL store {dt}", run(f"st_{dt.name}", xs, np.uint16).view(dt.np), want, xs)
        _assert_same(f"OpenCL round {dt}", run(f"rnd_{dt.name}", xs, np.float32), want.astype(np.float32), xs)
    dd = np.random.default_rng(2).standard_normal(50_000) * 10.0 ** np.random.default_rng(3).integers(-40, 40, 50_000)
    _assert_same("OpenCL float64 -> float32 rounded to odd", run("odd", dd, np.float32),
                 dtypes.float32_round_to_odd(dd), dd)


# ---------------------------------------------------------------------------
# Arithmetic and reductions on the backends


@pytest.fixture(params=["cpu", "opencl"])
def backend(request: pytest.FixtureRequest) -> Backend:
    return get_backend("cpu") if request.param == "cpu" else _opencl_backend()


def _run_comp(be: Backend, comp: ir.Comp, inputs: dict[Node, Array], outputs: list[Node]) -> list[Array]:
    ctx = be.get_device(0).make_context()
    for node, arr in inputs.items():
        ctx = ctx.init_from_host(node, arr)
    r = ctx.link(be.compile(comp, name="half_test"))
    r.run()
    try:
        return [r.context.read(n) for n in outputs]
    finally:
        r.context.finalize()


_OPS: dict[Op, Callable[[Array, Array], Array]] = {
    Op.ADD: np.add, Op.SUB: np.subtract, Op.MUL: np.multiply, Op.DIV: np.divide,
}


@pytest.mark.parametrize("dt", dtypes.HALF, ids=str)
def test_arithmetic_is_ieee_half_arithmetic(backend: Backend, dt: DType) -> None:
    """+ - * / sqrt, max, min, neg, abs on every kind of half value (random bit patterns:
    subnormals, overflow to inf, NaN, signed zeros) give exactly numpy's float16 (and
    ml_dtypes' bfloat16) results: float32 arithmetic rounded once per op is exact there."""
    n = 8192
    rng = np.random.default_rng(5)
    av, bv = (rng.integers(0, 1 << 16, n).astype(np.uint16).view(dt.np) for _ in range(2))
    a, b = Node("a", (n,), dt), Node("b", (n,), dt)
    outs: list[Node] = []
    assigns: list[ir.Assignment] = []
    wants: list[Array] = []
    with np.errstate(all="ignore"):
        for op, fn in _OPS.items():
            outs.append(Node(op.value, (n,), dt))
            assigns.append(ir.apply(op, a, b, into=outs[-1]))
            wants.append(fn(av, bv))
        for op, fn1 in ((Op.SQRT, np.sqrt), (Op.NEG, np.negative), (Op.ABS, np.abs)):
            outs.append(Node(op.value, (n,), dt))
            assigns.append(ir.apply(op, a, into=outs[-1]))
            wants.append(fn1(av))
        for op in (Op.MAX, Op.MIN):  # a > b || a != a ? a : b: NaN where either is, b at ties
            outs.append(Node(op.value, (n,), dt))
            assigns.append(ir.apply(op, a, b, into=outs[-1]))
            nan_a = np.isnan(av)
            wants.append(np.where((av > bv) | nan_a, av, bv) if op is Op.MAX else np.where((av < bv) | nan_a, av, bv))
        lt = Node("lt", (n,), dtypes.bool_)
        assigns.append(ir.apply(Op.LT, a, b, into=lt))
    got = _run_comp(backend, ir.Comp.of(*assigns, embedded=[*outs, lt]), {a: av, b: bv}, [*outs, lt])
    for node, g, w in zip(outs, got, wants):
        _assert_same(f"{backend.name} {node.name} {dt}", g, np.asarray(w).astype(dt.np), av)
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(got[-1], av < bv)
    ref = run_reference([ir.Comp.of(*assigns)], {a: av, b: bv})
    for node, w in zip(outs, wants):
        _assert_same(f"reference {node.name} {dt}", ref[node], np.asarray(w).astype(dt.np), av)


@pytest.mark.parametrize("dt", dtypes.HALF, ids=str)
def test_stores_overflow_vanish_and_tie_like_numpy(backend: Backend, dt: DType) -> None:
    """float32 -> half stores on a backend: the edge cases exactly as numpy / ml_dtypes round."""
    xs = _float32_cases(dt)[-200_000:]
    x, h = Node("x", xs.shape, dtypes.float32), Node("h", xs.shape, dt)
    (got,) = _run_comp(backend, ir.Comp.of(ir.apply(Op.CAST, x, into=h)), {x: xs}, [h])
    with np.errstate(all="ignore"):
        _assert_same(f"{backend.name} store {dt}", got, xs.astype(dt.np), xs)


def test_reductions_accumulate_in_float32_and_serial_updates_round_each(backend: Backend) -> None:
    """A reduction of float16 values keeps a float32 accumulator and rounds once (2048 + 1 + 1
    + 1 = 2051, stored as 2052); accumulation that lowering leaves serial (two iterations may
    hit one cell) rounds at every update, in order (2048 + 1 ties back to 2048, three times)."""
    i, j = Symbol("i"), Symbol("j")
    x = Node("x", (4, 4), F16)
    xv = np.ones((4, 4), np.float16)
    xv[0, :] = [2048, 1, 1, 1]
    xv[0, 3], xv[3, 0] = 2048, 1  # the anti-diagonal (cell 3 of out[i + j]) is 2048, 1, 1, 1 in order
    rows, diag = Node("rows", (4,), F16), Node("diag", (7,), F16)
    serial = ir.Accum(diag, AccumOp.ADD, Op.ID, (x,), ir.projections([(i, 4), (j, 4)], [ir.affine((1, i), (1, j))],
                                                                      [i, j]))
    comp = ir.Comp.of(ir.einsum("ij->i", x, into=rows), serial)
    kernels = lower.lower([comp], ["r"]).kernels
    assert any(isinstance(k.body, lower.Reduce) for k in kernels)
    assert any(isinstance(k.body, lower.Loop) for k in kernels)  # the serial one
    got_rows, got_diag = _run_comp(backend, comp, {x: xv}, [rows, diag])
    ref = run_reference([comp], {x: xv})
    assert got_rows[0] == ref[rows][0] == 4096  # 2048 + 1 + 1 + 2048 in float32: exact
    np.testing.assert_array_equal(got_rows, ref[rows])
    assert got_diag[3] == ref[diag][3] == 2048  # per update: 2048 + 1 rounds back to 2048 (to even)
    np.testing.assert_array_equal(got_diag, ref[diag])
    row = Node("row", (1, 4), F16)
    single = Node("single", (1,), F16)
    one = ir.Comp.of(ir.einsum("ij->i", row, into=single))
    (got,) = _run_comp(backend, one, {row: np.array([[2048, 1, 1, 1]], np.float16)}, [single])
    assert got[0] == 2052 == run_reference([one], {row: np.array([[2048, 1, 1, 1]], np.float16)})[single][0]


def test_long_half_reductions_split_into_float32_partials(backend: Backend) -> None:
    n = 1 << 16
    x, s = Node("x", (n,), BF16), Node("s", (), BF16)
    comp = ir.Comp.of(ir.einsum("i->", x, into=s))
    batch = lower.lower([comp], ["s"])
    (partial,) = batch.comps[0].scratch
    assert partial.dtype is dtypes.float32  # the partial sums are not rounded to bfloat16
    xv = np.ones(n, BF16.np)
    (got,) = _run_comp(backend, comp, {x: xv}, [s])
    assert float(got) == n  # one rounding of the exact float32 sum; bfloat16 steps would stop at 256


@pytest.mark.parametrize("dt", [F16, BF16])
def test_a_half_sum_no_divisor_splits_is_rounded_once(backend: Backend, dt: dtypes.DType) -> None:
    """Found by the review of session 34's change: the tail of a length no divisor splits was
    added into the half-typed cell after the partial results, a second rounding (2048 + 1 + 1
    gave 2048, not 2050). The tail is now one more float32 partial result."""
    n = 32_771  # prime
    x, s = Node("x", (n,), dt), Node("s", (), dt)
    comp = ir.Comp.of(ir.einsum("i->", x, into=s))
    v = np.zeros(n)
    v[0], v[1], v[-1] = (2048.0 if dt is F16 else 256.0), 1.0, 1.0  # the last value is in the tail
    xv = dtypes.to_half(v, dt)
    (got,) = _run_comp(backend, comp, {x: xv}, [s])
    assert float(np.float32(got)) == float(v.sum()) == float(np.float32(run_reference([comp], {x: xv})[s]))


# ---------------------------------------------------------------------------
# Plans and generated code


def test_half_kernels_take_their_plans_with_float_accumulators() -> None:
    """No tiles for half contractions (they hold the stored type), no streaming stores (ps/pd
    only); the CPU's column and staged reductions and the GPU's group reductions hold float."""
    a, b, c = Node("a", (64, 64), F16), Node("b", (64, 64), F16), Node("c", (64, 64), F16)
    big, big2 = Node("big", (1 << 22,), F16), Node("big2", (1 << 22,), F16)
    col, cs = Node("col", (64, 512), BF16), Node("cs", (512,), BF16)
    g, gs = Node("g", (4, 4096), BF16), Node("gs", (4,), BF16)
    comps = [ir.Comp.of(ir.einsum("ik,kj->ij", a, b, into=c)), ir.Comp.of(ir.apply(Op.NEG, big, into=big2)),
             ir.Comp.of(ir.einsum("ij->j", col, into=cs)), ir.Comp.of(ir.einsum("ij->i", g, into=gs))]
    batch = lower.lower(comps, ["mm", "neg", "col", "grp"])
    cpu = CpuDialect(vector_bytes=32)
    plans = [patterns.plan_kernel(k, cpu) for k in batch.kernels]
    assert plans[0].kind != patterns.CONTRACTION and plans[1].shape != patterns.STREAMING
    assert plans[2].shape == patterns.COLUMN
    src = codegen.generate(batch, cpu).text
    assert "float pj_acc[512]" in src and "_mm256_stream" not in src
    s0, t, es = Node("s0", (8, 100), F16), Node("t", (8, 100), F16), Node("es", (8,), F16)
    staged = lower.lower([ir.Comp.of(ir.apply(Op.EXP, s0, into=t), ir.einsum("ij->i", t, into=es))], ["staged"])
    assert patterns.plan_kernel(staged.kernels[0], cpu).shape == patterns.STAGED
    assert "float pj_vals[100]" in codegen.generate(staged, cpu).text
    for d in (CudaDialect(), OpenCLDialect()):
        text = codegen.generate(batch, d).text
        assert "float pj_red[" in text and "pj_As" not in text, d.name
    assert "vload_half(0, &" in codegen.generate(batch, OpenCLDialect()).text


def test_literals_and_casts_round_once() -> None:
    x, y, z = Node("x", (4,), F16), Node("y", (4,), F16), Node("z", (4,), dtypes.float64)
    comp = ir.Comp.of(ir.apply(Op.ADD, x, 0.1, into=y), ir.apply(Op.CAST, y, into=z), embedded=[y, z])
    text = codegen.generate(lower.lower([comp], ["k"]), CpuDialect(vector_bytes=32)).text
    assert f"{float(np.float16(0.1))!r}f" in text  # the literal is the float16 value
    assert "pj_st_float16(" in text and "((double)(pj_ld_float16(" in text
    # a store rounds: the op's own rounding is left to it
    assert "pj_st_float16(pj_rnd_float16(" not in text
    fused = codegen.generate(lower.lower([ir.Comp.of(ir.apply(Op.ADD, x, 0.1, into=(y2 := Node("y2", (4,), F16))),
                                                     ir.apply(Op.CAST, y2, into=z))], ["f"]), CpuDialect(32)).text
    assert "((double)(pj_rnd_float16(" in fused  # inlined: rounded as if it had been stored


# ---------------------------------------------------------------------------
# DLPack


@pytest.mark.skipif(torch is None, reason="PyTorch is not installed")
@pytest.mark.parametrize("dt", dtypes.HALF, ids=str)
def test_dlpack_both_ways_with_torch(dt: DType) -> None:
    be = get_backend("cpu")
    tdt = {F16: torch.float16, BF16: torch.bfloat16}[dt]
    a, out = Node("a", (3, 4), dt), Node("out", (3, 4), dt)
    vals = dtypes.to_half(np.arange(12, dtype=np.float32).reshape(3, 4) / 3, dt)
    r = be.get_device(0).make_context().init_from_host(a, vals).link(
        be.compile(ir.Comp.of(ir.apply(Op.MUL, a, 1.5, into=out)), name="m"))
    r.run()
    exported = r.context.export(out)
    t = torch.from_dlpack(exported)
    assert t.dtype == tdt and tuple(t.shape) == (3, 4)
    want = run_reference([ir.Comp.of(ir.apply(Op.MUL, a, 1.5, into=out))], {a: vals})[out]
    np.testing.assert_array_equal(t.float().numpy(), want.astype(np.float32))
    src = torch.linspace(-1, 1, 12, dtype=tdt).reshape(3, 4)
    b = Node("b", (3, 4), dt)
    ctx = r.context.init_from_dlpack(b, src)
    np.testing.assert_array_equal(ctx.read(b).astype(np.float32), src.float().numpy())
    with pytest.raises(Exception, match=r"float32|dtype"):
        r.context.init_from_dlpack(Node("wrong", (3, 4), dtypes.float32), src)
    r.context.finalize()


def test_numpy_takes_float16_and_refusing_bfloat16_frees_the_capsule(monkeypatch: pytest.MonkeyPatch) -> None:
    be = get_backend("cpu")
    f, g = Node("f", (5,), F16), Node("g", (5,), BF16)
    ctx = be.get_device(0).make_context().init_from_host(f, np.arange(5, dtype=np.float16))
    ctx = ctx.init_from_host(g, np.arange(5).astype(BF16.np))
    np.testing.assert_array_equal(np.from_dlpack(ctx.export(f)), np.arange(5, dtype=np.float16))
    gc.collect()
    live = len(dlpack._live)
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    # numpy has no bfloat16: its own error (RuntimeError "Unsupported dtype in DLTensor.", as for
    # torch's bfloat16 tensors), not a SystemError, and nothing reported as unraisable
    with pytest.raises((RuntimeError, BufferError), match=r"(?i)dtype"):
        np.from_dlpack(ctx.export(g))
    gc.collect()
    assert not unraisable, [(u.exc_type, u.exc_value, u.object) for u in unraisable]
    assert len(dlpack._live) == live  # the refused capsule released what it held
    ctx.finalize()


# ---------------------------------------------------------------------------
# The kit


def test_the_kit_states_a_tolerance_per_float_dtype_and_covers_the_half_types() -> None:
    from hypothesis import HealthCheck, find, settings

    from polyjit.testing import strategies
    from polyjit.testing.harness import kernel_dtypes
    from polyjit.testing.programs import TOLERANCES, catalog, default_tolerance
    from polyjit.testing.programs import half as half_programs

    assert set(TOLERANCES) == {d for d in dtypes.ALL if d.is_float}
    assert default_tolerance(F16) == TOLERANCES[F16] and default_tolerance(dtypes.int32) == (0.0, 0.0)
    names = {p.name for p in catalog()}
    for dt in dtypes.HALF:
        assert {f"reduce.add.{dt}", f"half.fused_chain.{dt}", f"half.mixed_precision_layer.{dt}",
                f"cast.float64_to_{dt}", f"cast.{dt}_to_int32", f"elementwise.exp.{dt}"} <= names
    assert all(p.name.startswith("half.") for p in half_programs.hostile())
    quiet = settings(max_examples=300, database=None, suppress_health_check=list(HealthCheck))
    for strategy in (strategies.elementwise_programs(), strategies.einsum_programs(), strategies.matmul_programs(),
                     strategies.affine_programs()):
        for dt in dtypes.HALF:
            def uses(p: Any, dt: DType = dt) -> bool:
                return dt in kernel_dtypes(p)

            found = find(strategy, uses, settings=quiet)
            assert dt in kernel_dtypes(found)


# ---------------------------------------------------------------------------
# The front end


def test_half_tensors_cast_and_take_inputs_rounded_once() -> None:
    x = pt.input("x", (4,), "bfloat16")
    y = (x * 2.0 + 1.0).astype("float32")
    h = x.astype("float16")
    assert x.dtype is BF16 and h.dtype is F16 and y.dtype is dtypes.float32
    plan = pt.compile({"y": y, "h": h})
    value = np.array([1 + 2.0**-8 + 2.0**-30, 3.0, -0.5, np.inf])  # float64: rounded once into bfloat16
    with pytest.raises(ValueRangeError, match=r"value 1e\+39 at index \(3,\) does not fit bfloat16"):
        plan.run(x=np.array([1.0, 3.0, -0.5, 1e39]))  # finite, too large for bfloat16: not turned into inf
    out = plan.run(x=value)
    assert out["h"].dtype == np.float16 and out["y"].dtype == np.float32
    assert out["y"].tolist()[:3] == [2 * (1 + 2.0**-7) + 1, 7.0, 0.0] and math.isinf(out["y"][3])
    assert out["h"].tolist()[:3] == [1 + 2.0**-7, 3.0, -0.5]
    from polyjit.tensor.reference import evaluate

    ref, _ = evaluate({"y": y, "h": h}, {"x": value})
    np.testing.assert_array_equal(ref["y"], out["y"])
    plan.close()


def _blobs(n: int, d: int, k: int, seed: int) -> tuple[Array, Array]:
    """Overlapping Gaussian clusters: a loss that stays well above zero (about 0.34 here)."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(0.0, 1.0, (k, d))
    labels = rng.integers(0, k, n).astype(np.int32)
    return (centers[labels] + rng.normal(0.0, 1.0, (n, d))).astype(np.float32), labels


def _train(compute: str | None, loss_scale: float, steps: int = 120) -> tuple[list[float], pt.Plan]:
    xs, ys = _blobs(512, 4, 4, seed=3)
    x, y = pt.input("x", xs.shape), pt.input("y", ys.shape, "int32")
    model = pt.MLP("mlp", [4, 32, 4], seed=7, compute_dtype=compute)
    loss = pt.cross_entropy(model(x).astype("float32"), y)
    plan = pt.compile(loss=loss, optimizer=pt.Adam(lr=0.01), loss_scale=loss_scale)
    return [plan.step(x=xs, y=ys) for _ in range(steps)], plan


def test_mixed_precision_mlp_trains_like_float32() -> None:
    """float32 master weights, half activations (and gradients) through the casts: the loss
    follows float32's, and the parameters and Adam's state stay float32."""
    full, p32 = _train(None, 1.0)
    p32.close()
    assert 0.2 < full[-1] < 0.2 * full[0]
    for compute, scale in (("float16", 256.0), ("bfloat16", 1.0)):
        losses, plan = _train(compute, scale)
        assert f"pj_ld_{compute}" in plan.source  # the forward and backward passes run in half
        assert all(v.dtype == np.float32 for v in plan.state_dict().values())
        assert abs(losses[-1] - full[-1]) < 0.03 * full[-1], (compute, losses[-1], full[-1])
        assert losses[0] != full[0]  # the half forward pass rounds differently
        plan.close()


def test_loss_scale_needs_an_optimizer_and_a_positive_number() -> None:
    x = pt.input("x", (2,))
    loss = (pt.param("w", (2,), init="ones") * x).sum()
    for bad in (0.0, -1.0, float("inf"), True, "8"):
        with pytest.raises(InvalidProgramError, match="loss_scale"):
            pt.compile(loss=loss, optimizer=pt.SGD(), loss_scale=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidProgramError, match="optimizer"):
        pt.compile(loss=loss, loss_scale=8.0)
    # gradients of loss * 8, divided by 8 again: the same step as unscaled
    steps = []
    for scale in (1.0, 8.0):
        w = pt.param("w", (2,), init="ones")
        plan = pt.compile(loss=(w * x).sum(), optimizer=pt.SGD(lr=0.5), loss_scale=scale)
        plan.step(x=np.array([1.0, -2.0], np.float32))
        steps.append(plan.state_dict()["w"])
        plan.close()
    np.testing.assert_array_equal(steps[0], steps[1])
    np.testing.assert_array_equal(steps[0], [0.5, 2.0])


def test_adam_on_half_parameters_counts_steps_in_float32() -> None:
    x = pt.input("x", (8, 3), "float16")
    w = pt.param("w", (3, 1), dtype="float16", rng=0)
    b32 = pt.param("b", (1,), init="zeros")  # a float32 parameter beside them
    pred = (x @ w).astype("float32") + b32
    loss = (pred * pred).mean()
    plan = pt.compile(loss=loss, optimizer=pt.Adam(lr=0.01))
    xs = np.random.default_rng(0).normal(size=(8, 3))
    first = plan.step(x=xs)
    for _ in range(30):
        last = plan.step(x=xs)
    state = plan.state_dict()
    assert state["adam.step"].dtype == np.float32 and float(state["adam.step"]) == 31
    assert state["w"].dtype == np.float16 and state["w.m"].dtype == np.float16 and state["b"].dtype == np.float32
    assert last < first
    plan.close()


def test_catalog_half_programs_on_the_backend(backend: Backend) -> None:
    """The kit's half programs (the catalog's and the hostile ones) on this backend."""
    from polyjit.testing import run_programs
    from polyjit.testing.programs import catalog
    from polyjit.testing.programs import half as half_programs

    progs = [p for p in catalog() if p.name.startswith("half.")] + half_programs.hostile()
    failures = run_programs(backend, progs)
    assert not failures, "\n\n".join(str(f) for f in failures[:4])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
