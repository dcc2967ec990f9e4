"""The OpenCL dialect: the kernels it writes (needs no device), and the work-group reductions
it can be asked for."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from opencl_helpers import f32, source_of

from polyjit.backends.opencl import OpenCLDialect, create_backend
from polyjit.core import dtypes, ir
from polyjit.core.errors import BackendUnavailableError
from polyjit.core.ir import AccumOp, Node, Op, StaticSymbol
from polyjit.core.lower import lower

pytest.importorskip("pyopencl")


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
    plan = d.plan(kernel)
    assert plan.kind == "contraction" and plan.contraction is not None and plan.tiles is not None
    launch = d.launch_shape(kernel)
    assert launch.local_size == (plan.tiles.threads, 1, 1)
    text = source_of([comp]).text
    assert "PJ_MATMUL_WG" in text and "__local float pj_As" in text and "vload8" in text
    small = ir.Comp.of(ir.einsum("ik,kj->ij", f32("a", (4, 4)), f32("b", (4, 4)), into=f32("c", (4, 4))))
    assert "PJ_MATMUL_WG void" not in source_of([small]).text
    assert "PJ_MATMUL_WG void" not in source_of([comp], OpenCLDialect(matmul=False)).text


# ---------------------------------------------------------------------------
# Work-group reductions



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


@pytest.mark.parametrize(("spec", "shape", "accum", "dtype"), [
    ("ij->j", (4096, 512), AccumOp.ADD, "float32"),  # the shape of the measurement, cut down
    ("ij->j", (7, 1000), AccumOp.ADD, "float32"),  # 4 rows and a remainder of 3
    ("ij->j", (2, 33), AccumOp.MAX, "float32"),  # the remainder alone
    ("kij->j", (3, 5, 100), AccumOp.MIN, "float32"),  # an outer reduced loop around them
    ("ij->j", (9, 300), AccumOp.ADD, "int32"),
    ("j,ji->i", (13, 257), AccumOp.ADD, "float32"),  # x @ W for one row (the product may fuse)
])
def test_column_reductions_step_through_rows_together_on_cpu_devices(spec: str, shape: tuple[int, ...],
                                                                     accum: AccumOp, dtype: str) -> None:
    """One work-item per output walked its column alone, a cache line a value (a 4096^2
    column sum 85 ms, numpy 4): on CPU devices (PJ_CPU) the items of a group now take four
    rows between two barriers, which PoCL runs as a loop across the items (8.7 ms). Each
    output still folds its rows in order: the bits of numpy folding them one at a time."""
    be = create_backend()
    rng = np.random.default_rng(len(spec) + shape[-1])
    if spec == "j,ji->i":
        rows, cols = shape
        ins = [Node("v", (rows,), dtype), Node("x", shape, dtype)]
    else:
        rows, cols = int(np.prod(shape[:-1])), shape[-1]
        ins = [Node("x", shape, dtype)]
    out = Node("o", (cols,), dtype)
    comp = ir.Comp.of(ir.einsum(spec, *ins, into=out, accum=accum))
    code = be.compile(comp, name="cols")
    inner = shape[-2] if len(shape) > 2 else rows  # the innermost reduced loop's rows
    assert ("#ifdef PJ_CPU" in code.source) == (inner >= 4), code.source  # a barrier each four rows
    values = [(rng.standard_normal(n.shape) * 50).astype(dtype) for n in ins]
    ctx = be.get_device(0).make_context()
    for n, v in zip(ins, values):
        ctx = ctx.init_from_host(n, v)
    routine = ctx.link(code)
    routine.run()
    got = routine.context.read(out)
    fold = {AccumOp.ADD: np.add, AccumOp.MAX: np.maximum, AccumOp.MIN: np.minimum}[accum]
    if spec == "j,ji->i":
        terms = values[1] * values[0][:, None]
        np.testing.assert_allclose(got, terms.astype(np.float64).sum(0), rtol=1e-4, atol=1e-2)
        return
    flat = values[0].reshape(rows, cols)
    want = flat[0].copy() if accum is not AccumOp.ADD else fold(np.zeros(cols, dtype), flat[0])
    for row in flat[1:]:  # the kernel's order
        want = fold(want, row)
    np.testing.assert_array_equal(got, want)


def test_group_reductions_match_the_reference() -> None:
    """The work-group-per-cell reduction (core/gpu.py; the default on GPU platforms,
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
    with pytest.raises(BackendUnavailableError, match="group_reductions"):  # as the cpu backend's bad num_devices
        create_backend(group_reductions="sometimes")
