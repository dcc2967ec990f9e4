"""What the CUDA tests share: the CUDA-specific programs (on top of the conformance
catalog) and the checks that run on a GPU as on the stub driver."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import numpy as np

from polyjit.backends import cuda
from polyjit.core import dtypes, ir
from polyjit.core.ir import AccumOp, Node, Op, StaticSymbol, Symbol
from polyjit.testing.programs import CatalogProgram, catalog, program, values
from polyjit.testing.programs.nan import nan_programs

REPO = Path(__file__).resolve().parents[2]


def f32(name: str, shape: tuple[int, ...]) -> Node:
    return Node(name, shape, dtypes.float32)


@functools.cache
def cuda_programs() -> tuple[CatalogProgram, ...]:
    q32 = functools.partial(values, dtypes.float32, kind="quarter")
    out: list[CatalogProgram] = []

    def mm(name: str, spec: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...],
           c_shape: tuple[int, ...], **kw: Any) -> None:
        a, b, c = f32("a", a_shape), f32("b", b_shape), f32("c", c_shape)
        init = kw.pop("init_neutral", True)
        inputs = [(a, q32(a_shape)), (b, q32(b_shape))]
        if not init:
            inputs.append((c, q32(c_shape)))
        out.append(program(name, ir.einsum(spec, a, b, into=c, init_neutral=init),
                           inputs=inputs, outputs=[c], **kw))

    mm("cuda.matmul.large_tiles_vec", "ik,kj->ij", (256, 64), (64, 256), (256, 256))
    mm("cuda.matmul.small_tiles_vec", "ik,kj->ij", (64, 48), (48, 128), (64, 128))
    mm("cuda.matmul.transposed_vec", "ki,jk->ij", (16, 256), (256, 16), (256, 256))
    mm("cuda.matmul.x_transposed_vec", "ki,kj->ij", (16, 256), (16, 256), (256, 256))
    mm("cuda.matmul.y_transposed_vec", "ik,jk->ij", (256, 16), (256, 16), (256, 256))
    mm("cuda.matmul.output_transposed", "ik,kj->ji", (128, 32), (32, 64), (64, 128))
    mm("cuda.matmul.batched_vec", "bik,bkj->bij", (2, 128, 64), (2, 64, 128), (2, 128, 128))
    mm("cuda.matmul.unaligned", "ik,kj->ij", (70, 61), (61, 97), (70, 97))
    mm("cuda.matmul.unaligned_large", "ik,kj->ij", (300, 9), (9, 260), (300, 260))
    mm("cuda.matmul.accumulate", "ik,kj->ij", (64, 64), (64, 64), (64, 64), init_neutral=False,
       runs=({}, {}))
    # one operand with vector loads, the other element by element (its rows 66 apart)
    i, j, k = Symbol("i"), Symbol("j"), Symbol("k")
    for name, xs, ys, xi, yi in (("x_only", (64, 64), (64, 66), [i, k], [k, j]),
                                 ("y_only", (64, 66), (64, 64), [i, k], [k, j])):
        x, y, c = f32("x", xs), f32("y", ys), f32("c", (64, 64))
        acc = ir.Accum(c, AccumOp.ADD, Op.MUL, (x, y), ir.projections([(i, 64), (j, 64), (k, 64)], [i, j], xi, yi))
        out.append(program(f"cuda.matmul.vector_{name}", acc, inputs=[(x, q32(xs)), (y, q32(ys))], outputs=[c]))
    # a static symbol in the A operand: c[i, j] = sum_k x[$b, i, k] * w[k, j]
    bsym = StaticSymbol("b", 3)
    x, w, c = f32("x", (3, 64, 32)), f32("w", (32, 128)), f32("c", (64, 128))
    acc = ir.Accum(c, AccumOp.ADD, Op.MUL, (x, w),
                   ir.projections([(i, 64), (j, 128), (k, 32)], [i, j], [bsym, i, k], [k, j]))
    out.append(program("cuda.matmul.static_operand", acc, inputs=[(x, q32(x.shape)), (w, q32(w.shape))],
                       outputs=[c], runs=({bsym: 2}, {bsym: 0})))

    def red(name: str, spec: str, shape: tuple[int, ...], rshape: tuple[int, ...], dt: dtypes.DType = dtypes.float32,
            accum: AccumOp = AccumOp.ADD, kind: str = "quarter", init: bool = True, **kw: Any) -> None:
        a, r = Node("a", shape, dt), Node("r", rshape, dt)
        inputs = [(a, values(dt, shape, kind))]
        if not init:
            inputs.append((r, values(dt, rshape, kind)))
        out.append(program(name, ir.einsum(spec, a, into=r, accum=accum, init_neutral=init),
                           inputs=inputs, outputs=[r], **kw))

    red("cuda.reduce.rows_block", "ij->i", (40, 3000), (40,))
    red("cuda.reduce.columns_threads", "ij->j", (600, 5000), (5000,))
    red("cuda.reduce.columns_block", "ij->j", (3000, 100), (100,))
    # a prime length splits into 256 partials and a tail; others into partials alone
    red("cuda.reduce.full_max_ragged", "i->", (65_537,), (), accum=AccumOp.MAX, kind="any")
    red("cuda.reduce.full_sum_split", "i->", (200_000,), (), kind="quarter")
    red("cuda.reduce.rows_onto_context", "ij->i", (8, 2000), (8,), init=False, runs=({}, {}))
    red("cuda.reduce.uint8_min_block", "ij->i", (5, 1000), (5,), dt=dtypes.uint8, accum=AccumOp.MIN, kind="any")
    red("cuda.reduce.float64_prod_block", "ij->i", (3, 700), (3,), dt=dtypes.float64, accum=AccumOp.MUL, kind="unit",
        rtol=1e-9)
    red("cuda.reduce.int64_sum_2d_block", "ijk->j", (30, 4, 40), (4,), dt=dtypes.int64, kind="any")
    t3 = Node("t3", (7, 9, 11), dtypes.int32)
    r3 = Node("r3", (11, 9, 7), dtypes.int32)
    out.append(program("cuda.grid.3d_decompose", ir.einsum("ijk->kji", t3, into=r3),
                       inputs=[(t3, values(dtypes.int32, t3.shape))], outputs=[r3]))
    big, bo = f32("big", (3, 100_000)), f32("bo", (3, 100_000))
    out.append(program("cuda.grid.many_strides", ir.apply(Op.SIGMOID, big, into=bo),
                       inputs=[(big, values(dtypes.float32, big.shape))], outputs=[bo]))
    return tuple(out)


def all_programs() -> list[CatalogProgram]:
    return [*catalog(), *cuda_programs(), *nan_programs()]


def check_tensor_plans_replay_a_graph(backend: Any) -> int:
    """mode="compiled" replays the fused batch as CUDA graphs from its first run (a training
    step as two: up to the loss, and the backward pass and update); the losses match the
    CPU backend's step for step, and dynamic mode's. Returns the graph launches."""
    from polyjit import tensor as pt

    rng = np.random.default_rng(0)
    xs, ys = rng.standard_normal((24, 12)).astype(np.float32), rng.integers(0, 3, 24).astype(np.int32)

    def losses(device: Any, mode: str) -> tuple[list[float], Any]:
        x, y = pt.input("x", (24, 12)), pt.input("y", (24,), "int32")
        mlp = pt.MLP("mlp", [12, 16, 3], seed=1)
        plan = pt.compile(loss=pt.cross_entropy(mlp(x), y), optimizer=pt.SGD(0.1, momentum=0.9),
                          device=device, mode=mode)
        return [plan.step(x=xs, y=ys) for _ in range(4)], plan

    want, cpu_plan = losses("cpu", "compiled")
    got, plan = losses(backend.get_device(0), "compiled")
    captured = plan._linked.captured
    assert captured is not None and captured.split is not None
    assert all(isinstance(r, cuda.CudaGraph) for r in captured.split)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    dynamic, dyn_plan = losses(backend.get_device(0), "dynamic")
    assert dyn_plan._linked.captured is None
    np.testing.assert_allclose(dynamic, want, rtol=1e-5)
    for p in (plan, dyn_plan, cpu_plan):
        p.close()
    return 2 * 4  # two graphs for each of the compiled plan's four steps


def bench_module() -> Any:
    """polyjit.bench.cuda, the suite ``polyjit bench cuda`` runs."""
    import polyjit.bench.cuda

    return polyjit.bench.cuda


def char_lm() -> Any:
    """examples/char_lm.py."""
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import char_lm as mod
    finally:
        sys.path.pop(0)
    return mod
