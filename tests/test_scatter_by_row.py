"""A scatter-add computed by row (core/lower.py ``scatter_by_owner``, what GPU dialects ask
for with ``scatter_scan``): one parallel kernel whose cells each sum the updates that pick
their row, in row-major order from zero, is the serial kernel bit for bit, whatever the
indices (repeated, out of range: clamped) and the values (NaN, infinities, signed zeros),
but for which NaN a cell holds where two different NaNs met."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from polyjit.backends import get_backend
from polyjit.backends.cuda.dialect import CudaDialect
from polyjit.core import dtypes, ir
from polyjit.core.codegen import generate
from polyjit.core.ir import Node
from polyjit.core.loops import Reduce
from polyjit.core.lower import lower
from polyjit.core.patterns import GROUP_REDUCTION, REDUCTION, plan_kernel


def _scatter(rows: int, cols: tuple[int, ...], updates: tuple[int, ...],
             index_dtype: dtypes.DType = dtypes.int32) -> tuple[Node, Node, Node, ir.Comp]:
    idx = Node("idx", updates, index_dtype)
    vals = Node("vals", (*updates, *cols))
    table = Node("table", (rows, *cols))
    return idx, vals, table, ir.Comp.of(ir.scatter_add(idx, vals, into=table))


def test_the_lowering_picks_by_row_up_to_the_scan_it_is_given() -> None:
    *_, comp = _scatter(27, (16,), (128, 8))
    serial = lower([comp], ["s"]).kernels
    assert len(serial) == 2 and not serial[1].parallel  # zeros, then one serial kernel
    (by_row,) = lower([comp], ["s"], scatter_scan=27 * 1024).kernels
    assert isinstance(by_row.body, Reduce) and by_row.body.ordered and by_row.work == 27 * 16
    assert len(lower([comp], ["s"], scatter_scan=27 * 1024 - 1).kernels) == 2
    # on a GPU: a thread per cell, in order; never a group's tree
    on_gpu = plan_kernel(by_row, CudaDialect())
    assert on_gpu.kind == REDUCTION and on_gpu.launch.local_size == (32,)  # 14 blocks: spread over SMs
    text = generate(lower([comp], ["s"], scatter_scan=1 << 22), CudaDialect()).text
    assert "#pragma unroll 4\n      for (int64_t" in text  # 4 trips of its loop: their loads in flight together
    bias = Node("g", (128, 27))
    single = generate(lower([ir.Comp.of(ir.einsum("ij->j", bias, into=Node("b", (27,))))], ["b"]), CudaDialect())
    assert "#pragma unroll " not in single.text  # one loop: nvcc unrolls all of it unasked, a pragma would cap it
    *_, long_comp = _scatter(2, (1,), (1 << 16,))
    (few_cells,) = lower([long_comp], ["s"], scatter_scan=1 << 20).kernels
    assert plan_kernel(few_cells, CudaDialect()).kind != GROUP_REDUCTION


@pytest.fixture(scope="module")
def cpu() -> Iterator[object]:
    yield get_backend("cpu")


def _run(backend: object, comp: ir.Comp, table: Node, feeds: dict[Node, np.ndarray], scan: int) -> np.ndarray:
    dialect = backend.driver.dialect  # type: ignore[attr-defined]
    dialect.scatter_scan = scan
    try:
        code = backend.compile(comp, name="scatter")  # type: ignore[attr-defined]
    finally:
        del dialect.scatter_scan
    ctx = backend.get_device(0).make_context()  # type: ignore[attr-defined]
    for node, value in feeds.items():
        ctx = ctx.init_from_host(node, value)
    r = ctx.link(code)
    r.run()
    out = r.context.read(table)
    r.context.finalize()
    return out


SPECIAL = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1e30, -1e30, 1e-30, 3.0, -3.0]


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 9), cols=st.sampled_from([(1,), (3,), (2, 3)]),
       updates=st.sampled_from([(1,), (7,), (4, 5)]), seed=st.integers(0, 2**32 - 1),
       index_dtype=st.sampled_from([dtypes.int32, dtypes.int64]))
# CI's draw at 743f1d3: one cell adds inf, -inf, then a NaN (the serial kernel kept the first NaN)
@example(rows=2, cols=(2, 3), updates=(4, 5), seed=1351430, index_dtype=dtypes.int32)
def test_by_row_is_the_serial_kernel_bit_for_bit(cpu: object, rows: int, cols: tuple[int, ...],
                                                  updates: tuple[int, ...], seed: int,
                                                  index_dtype: dtypes.DType) -> None:
    rng = np.random.default_rng(seed)
    idx, vals, table, comp = _scatter(rows, cols, updates, index_dtype)
    iv = rng.integers(-2, rows + 2, updates).astype(index_dtype.np)  # repeats and clamped ones
    vv = (rng.standard_normal((*updates, *cols)) * rng.choice([1e-3, 1.0, 1e3])).astype(np.float32)
    special = rng.random(vv.shape) < 0.2
    vv[special] = rng.choice(SPECIAL, int(special.sum()))
    feeds = {idx: iv, vals: vv}
    serial = _run(cpu, comp, table, feeds, scan=0)
    by_row = _run(cpu, comp, table, feeds, scan=1 << 30)
    want = np.zeros((rows, *cols), np.float32)
    with np.errstate(all="ignore"):
        np.add.at(want, np.clip(iv, 0, rows - 1), vv)  # in row-major order, float32 sums
    nan = np.isnan(want)  # a NaN's sign and payload are the hardware's, not numpy's
    assert np.array_equal(np.isnan(serial), nan) and serial[~nan].tobytes() == want[~nan].tobytes()
    # Where two different NaNs meet in a sum (inf - inf's negative default NaN, and an input's
    # positive one), x86 returns the first operand's, and a compiler may swap an add's operands:
    # the by-row kernel's vector add and the serial kernel's scalar one need not pick the same.
    assert np.array_equal(np.isnan(by_row), nan) and by_row[~nan].tobytes() == serial[~nan].tobytes()


def test_what_keeps_the_serial_kernel_or_its_order() -> None:
    """From a hostile review: a half type's table rounds after every update (a sum by row
    would round once: 1000 + 63 x 0.1 gave 1006.5 in float16, the serial kernel 1000); a
    table of one row has no parallel loop, and its long sum must not be split into partial
    sums; an empty inner loop has nothing to unroll."""
    idx, vals = Node("idx", (8,), dtypes.int32), Node("vals", (8, 2), dtypes.float16)
    half = ir.Comp.of(ir.scatter_add(idx, vals, into=Node("table", (4, 2), dtypes.float16)))
    assert len(lower([half], ["s"], scatter_scan=1 << 30).kernels) == 2  # zeros, then serial
    *_, one_row = _scatter(1, (), (1 << 16,))
    (k,) = lower([one_row], ["s"], scatter_scan=1 << 30).kernels
    assert isinstance(k.body, Reduce) and k.body.ordered and not k.body.reassociable
    *_, empty = _scatter(3, (2,), (4, 0))
    generate(lower([empty], ["s"], scatter_scan=1 << 30), CudaDialect())
    x = Node("x", (64, 4, 0))
    generate(lower([ir.Comp.of(ir.einsum("ijk->i", x, into=Node("r", (64,))))], ["r"]), CudaDialect())


def test_one_row_of_many_updates_is_summed_in_order(cpu: object) -> None:
    idx, vals, table, comp = _scatter(1, (), (1 << 16,))
    rng = np.random.default_rng(5)
    feeds = {idx: np.zeros(1 << 16, np.int32), vals: rng.standard_normal(1 << 16).astype(np.float32) * 100}
    serial = _run(cpu, comp, table, feeds, scan=0)
    by_row = _run(cpu, comp, table, feeds, scan=1 << 30)
    want = np.zeros(1, np.float32)
    np.add.at(want, feeds[idx], feeds[vals])
    assert serial.tobytes() == want.tobytes() and by_row.tobytes() == serial.tobytes()
