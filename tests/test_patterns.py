"""Lowering's decisions and the kernel plans (core/lower.py, core/patterns.py), without a device.

- why a node is or is not inlined: one test per rule of lower.py's memory-mode inference;
- when a full reduction splits, and into how many parts;
- the one contraction matcher (its roles, and the row-major layout tiles need);
- which KernelPlan (kind, shape, tiles, launch shape) each dialect gives: an elementwise chain,
  a small and a big reduction, few long reductions, a matmul big enough for tiles and one
  too small, and on the CPU a column reduction, a staged reduction, streaming stores and
  block transposes.
"""

from __future__ import annotations

import pytest

from polyjit.backends.cpu.dialect import CpuDialect
from polyjit.backends.cuda.dialect import CudaDialect
from polyjit.backends.opencl.dialect import OpenCLDialect
from polyjit.core import ir, lower, patterns
from polyjit.core.codegen import Dialect, generate
from polyjit.core.errors import InvalidProgramError
from polyjit.core.ir import AccumOp, MemoryMode, Node, Op
from polyjit.core.loops import Kernel, Reduce
from polyjit.core.patterns import (
    COLUMN,
    CONTRACTION,
    ELEMENTWISE,
    GROUP_REDUCTION,
    REDUCTION,
    REGISTER_TILES,
    SERIAL,
    STAGED,
    STREAMING,
    TILES_LARGE,
    TRANSPOSE,
    KernelPlan,
    LaunchShape,
    plan_kernel,
)

# ---------------------------------------------------------------------------
# Memory modes: why a node is (not) inlined


def _modes(*comps: ir.Comp) -> lower.Inference:
    return lower.infer_modes(comps)


def _why(node: Node, *comps: ir.Comp) -> str:
    inference = _modes(*comps)
    assert inference.modes[node] is MemoryMode.LOCAL
    return inference.why_not[node]


def test_an_elementwise_intermediate_read_once_is_inlined() -> None:
    a, t, out = Node("a", (8,)), Node("t", (8,)), Node("out", (8,))
    writer = ir.apply(Op.EXP, a, into=t)
    inference = _modes(ir.Comp.of(writer, ir.apply(Op.NEG, t, into=out)))
    assert inference.modes[t] is MemoryMode.VIRTUAL and inference.writer[t] is writer
    assert inference.modes[out] is MemoryMode.MATERIALIZED  # a result: embedded
    assert t not in inference.why_not


def test_not_inlined_when_written_more_than_once() -> None:
    a, t, out = Node("a", (8,)), Node("t", (8,)), Node("out", (8,))
    comp = ir.Comp.of(ir.apply(Op.EXP, a, into=t), ir.apply(Op.NEG, a, into=t, accum=AccumOp.ADD, init_neutral=False),
                      ir.apply(Op.NEG, t, into=out))
    assert _why(t, comp) == "it is written more than once"


def test_not_inlined_when_its_writer_is_a_reduction() -> None:
    a, t, out = Node("a", (4, 8)), Node("t", (4,)), Node("out", (4,))
    comp = ir.Comp.of(ir.einsum("ij->i", a, into=t), ir.apply(Op.NEG, t, into=out))
    assert "not elementwise" in _why(t, comp)


def test_not_inlined_when_read_twice() -> None:
    a, t, out = Node("a", (8,)), Node("t", (8,)), Node("out", (8,))
    comp = ir.Comp.of(ir.apply(Op.EXP, a, into=t), ir.apply(Op.MUL, t, t, into=out))
    assert _why(t, comp) == "it is read 2 times, not once"


def test_not_inlined_when_read_before_it_is_written() -> None:
    a, t, out = Node("a", (8,)), Node("t", (8,)), Node("out", (8,))
    comp = ir.Comp.of(ir.apply(Op.NEG, t, into=out), ir.apply(Op.EXP, a, into=t))
    assert _why(t, comp) == "it is read before it is written"


def test_not_inlined_when_read_through_a_reshape() -> None:
    a, t, r, out = Node("a", (8,)), Node("t", (8,)), Node("r", (2, 4)), Node("out", (2, 4))
    comp = ir.Comp.of(ir.apply(Op.EXP, a, into=t), ir.reshape(r, t), ir.apply(Op.NEG, r, into=out))
    assert "reshape" in _why(t, comp)


def test_not_inlined_when_read_by_another_computation_of_the_batch() -> None:
    a, t, out = Node("a", (8,)), Node("t", (8,)), Node("out", (8,))
    first = ir.Comp.of(ir.apply(Op.EXP, a, into=t), embedded=[])
    second = ir.Comp.of(ir.apply(Op.NEG, t, into=out))
    assert _why(t, first, second) == "its reader is in another computation of the batch"


def test_not_inlined_when_its_reader_broadcasts_it() -> None:
    a, t, b, out = Node("a", (4,)), Node("t", (4,)), Node("b", (3, 4)), Node("out", (3, 4))
    comp = ir.Comp.of(ir.apply(Op.EXP, a, into=t), ir.apply(Op.ADD, t, b, into=out))
    assert "several times" in _why(t, comp)


def test_not_inlined_when_its_writer_reads_the_merge_buffer() -> None:
    m, t, out = Node("m", (8,)), Node("t", (8,)), Node("out", (8,))
    comp = ir.Comp.of(ir.apply(Op.EXP, ir.merge(m), into=t), ir.apply(Op.NEG, t, into=out))
    assert _why(t, comp) == "its writer reads the merge buffer"


def test_not_inlined_when_what_its_writer_reads_changes_before_the_read() -> None:
    a, b, t, out = Node("a", (8,)), Node("b", (8,)), Node("t", (8,)), Node("out", (8,))
    comp = ir.Comp.of(ir.apply(Op.EXP, a, into=t), ir.apply(Op.NEG, b, into=a), ir.apply(Op.NEG, t, into=out))
    assert _why(t, comp).startswith(a.label) and "changes before the read" in _why(t, comp)


def test_explicit_modes_win_where_they_can() -> None:
    a, t, u, out = Node("a", (8,)), Node("t", (8,), mode=MemoryMode.LOCAL), Node("u", (8,)), Node("out", (8,))
    kept = u.with_mode(MemoryMode.ON_DEVICE)
    comp = ir.Comp.of(ir.apply(Op.EXP, a, into=t), ir.apply(Op.NEG, t, into=kept), ir.apply(Op.NEG, kept, into=out))
    inference = _modes(comp)
    assert inference.modes[t] is MemoryMode.LOCAL and inference.why_not[t] == "it is marked LOCAL"
    assert inference.modes[kept] is MemoryMode.ON_DEVICE  # stored, though read once
    virtual = Node("v", (4,), mode=MemoryMode.VIRTUAL)
    with pytest.raises(InvalidProgramError, match="cannot be inlined: its writer is not elementwise"):
        _modes(ir.Comp.of(ir.einsum("ij->i", Node("x", (4, 4)), into=virtual),
                          ir.apply(Op.NEG, virtual, into=Node("o", (4,)))))
    with pytest.raises(InvalidProgramError, match="embedded"):
        _modes(ir.Comp.of(ir.apply(Op.NEG, a, into=Node("r", (8,), mode=MemoryMode.VIRTUAL))))


# ---------------------------------------------------------------------------
# Splitting long full reductions


def _reduction_kernels(shape: tuple[int, ...], spec: str) -> list[Kernel]:
    x, out_shape = Node("x", shape), tuple(n for c, n in zip(spec.split("->")[0], shape) if c in spec.split("->")[1])
    return lower.lower([ir.Comp.of(ir.einsum(spec, x, into=Node("o", out_shape)))], ["r"]).kernels


def _parts(kernels: list[Kernel]) -> tuple[int, int] | None:
    """(parts, values per part) of a split reduction (with no tail); None when it stayed one kernel."""
    if len(kernels) == 1:
        return None
    first, second = kernels
    assert isinstance(first.body, Reduce) and first.body.reassociable and not second.parallel
    ((_, parts),) = first.parallel
    return parts, first.body.length


def _tail(kernels: list[Kernel]) -> tuple[int, int, int]:
    """(parts, values per part, values in the tail) of a split reduction with a tail: the tail
    is one more partial result, which the last kernel reduces with the others."""
    first, tail, last = kernels
    assert isinstance(first.body, Reduce) and first.body.reassociable and not tail.parallel
    assert isinstance(tail.body, Reduce) and tail.body.node is first.body.node  # the last partial
    ((_, parts),) = first.parallel
    assert isinstance(last.body, Reduce) and last.body.length == parts + 1
    return parts, first.body.length, tail.body.length


@pytest.mark.parametrize(("n", "parts"), [
    ((1 << 15) - 1, None),  # shorter than SPLIT_MIN_LENGTH: one kernel
    (1 << 15, (256, 128)),  # a divisor near SPLIT_PARTS...
    (200_000, (250, 800)),  # ... the closest one
    (32 * 1031, (32, 1031)),  # the only divisor in range
])
def test_a_long_full_reduction_splits_into_partial_results(n: int, parts: tuple[int, int] | None) -> None:
    assert _parts(_reduction_kernels((n,), "i->")) == parts


def test_a_length_no_divisor_splits_gets_a_tail() -> None:
    """Found by review: a prime length (no divisor between 32 and 1024) stayed one kernel, which
    the cpu backend shared among OpenMP threads with a reduction clause: its bits changed with
    the team size and the order the threads finished, so from run to run and under load."""
    assert _tail(_reduction_kernels((65_537,), "i->")) == (256, 256, 1)
    assert _tail(_reduction_kernels(((1 << 20) + 1,), "i->")) == (256, 4096, 1)
    # of the loops long enough, the one with the shortest tail: 1031 = 4 * 256 + 7 rows of 1031
    assert _tail(_reduction_kernels((1031, 1031), "ij->")) == (256, 4 * 1031, 7 * 1031)
    assert _tail(_reduction_kernels((3, 65_537), "ij->")) == (256, 3 * 256, 3)


def test_a_reduction_of_short_loops_splits_over_its_outer_ones() -> None:
    """No loop of 32 to 1024 values, none of 256 or more (30^4): such a sum ran on one thread,
    at 12x numpy's time. Its outer loops, the fewest whose product reaches 32, now index the
    parts, and the loops each part reduces merge where they walk memory as one."""
    first, last = _reduction_kernels((31, 31, 31, 31, 2), "ijklm->")
    assert isinstance(first.body, Reduce) and first.body.reassociable and not last.parallel
    assert [n for _, n in first.parallel] == [961] and [n for _, n in first.body.loops] == [1922]
    first, _ = _reduction_kernels((30, 30, 30, 30), "ijkl->")
    assert [n for _, n in first.parallel] == [900] and [n for _, n in first.body.loops] == [900]
    x, y = Node("x", (30, 30, 30)), Node("y", (30, 30))
    first, _ = lower.lower([ir.Comp.of(ir.einsum("ijk,kl->", x, y, into=Node("o", ())))], ["r"]).kernels
    assert isinstance(first.body, Reduce)  # y's rows are not x's: k and l stay two loops
    assert [n for _, n in first.parallel] == [900] and [n for _, n in first.body.loops] == [30, 30]
    first, _ = _reduction_kernels((2, 2, 31, 31, 31), "ijklm->")
    assert [n for _, n in first.parallel] == [124] and [n for _, n in first.body.loops] == [961]
    first, _ = _reduction_kernels((20, 20, 20, 5), "ijkl->")  # 400 parts of 100 values would be too short:
    assert [n for _, n in first.parallel] == [20] and [n for _, n in first.body.loops] == [2000]  # 20 of 2000
    assert len(_reduction_kernels((1, 1, 200, 200), "ijkl->")) == 2  # unit loops vanish first
    assert len(_reduction_kernels((300, 300), "ij->")) == 2


def test_a_parts_loops_merge_where_they_walk_memory_as_one() -> None:
    """Found by review: a full sum of an (N, 3) array split its rows into parts, each a
    collapsed simd nest over (rows, 3), 10-13x numpy's time; one loop of 3 * rows now."""
    first, _ = _reduction_kernels((1 << 20, 3), "ij->")
    assert isinstance(first.body, Reduce) and [n for _, n in first.body.loops] == [3 * 4096]
    first, _, _ = _reduction_kernels((1_000_003, 3), "ij->")  # a prime: parts and a tail
    assert isinstance(first.body, Reduce) and [n for _, n in first.body.loops] == [3 * 3906]
    x = Node("x", (3, 1 << 20))
    first, _ = lower.lower([ir.Comp.of(ir.einsum("ji->", x, into=Node("o", ())))], ["r"]).kernels
    assert isinstance(first.body, Reduce) and len(first.body.loops) == 2  # 3 runs of 4096 values, 2^20 apart: no merge


def test_a_split_takes_the_outermost_reduced_loop() -> None:
    kernels = _reduction_kernels((300, 400), "ij->")
    assert _parts(kernels) == (300, 400)  # 300 parts (the divisor of 300 closest to 256) of one row
    assert _parts(_reduction_kernels((7, 9000), "ij->")) == (250, 252)  # 7 has none: the next loop


def test_reductions_into_many_cells_fold_contiguous_rows_in_lanes() -> None:
    """Found by review: a row sum, a row's max and a matrix-vector product folded each row in
    loop order, which GCC does not vectorize: 3-9x numpy's time. A reduction whose innermost
    loop reads memory contiguously is now reassociable (lanes, in an order fixed by the sizes
    and the vector width); one read down columns or backwards, or a product, is not."""
    def reduce_of(comp: ir.Comp) -> Reduce:
        (k,) = lower.lower([comp], ["r"]).kernels
        assert isinstance(k.body, Reduce)
        return k.body

    x, v = Node("x", (64, 100)), Node("v", (100,))
    rows, cols = Node("rows", (64,)), Node("cols", (100,))
    assert reduce_of(ir.Comp.of(ir.einsum("ij->i", x, into=rows))).reassociable
    assert reduce_of(ir.Comp.of(ir.einsum("ij->i", x, into=rows, accum=AccumOp.MAX))).reassociable
    assert reduce_of(ir.Comp.of(ir.einsum("ij,j->i", x, v, into=rows))).reassociable  # matrix-vector
    assert not reduce_of(ir.Comp.of(ir.einsum("ij->i", x, into=rows, accum=AccumOp.MUL))).reassociable
    assert not reduce_of(ir.Comp.of(ir.einsum("ij->j", x, into=cols))).reassociable  # down the columns
    xi, ri = Node("xi", (64, 100), "int32"), Node("ri", (64,), "int32")
    assert not reduce_of(ir.Comp.of(ir.einsum("ij->i", xi, into=ri))).reassociable  # exact anyway
    i, j = ir.Symbol("i"), ir.Symbol("j")
    backwards = ir.Accum(rows, AccumOp.ADD, Op.ID, (x,),
                         ir.projections([(i, 64), (j, 100)], [i], [i, ir.affine((-1, j), const=99)]))
    assert not reduce_of(ir.Comp.of(backwards)).reassociable  # GCC's fold-left bug reads backwards
    unit = Node("unit", (64, 1))  # no loop left once the unit one goes (found by review: an IndexError)
    assert not reduce_of(ir.Comp.of(ir.einsum("ij->i", unit, into=rows, accum=AccumOp.MAX))).reassociable
    cube, first = Node("cube", (8, 16, 32)), Node("first", (8,))
    r = reduce_of(ir.Comp.of(ir.einsum("ijk->i", cube, into=first)))
    assert r.reassociable and [n for _, n in r.loops] == [16 * 32]  # one contiguous loop


def test_reductions_into_several_cells_never_split() -> None:
    assert len(_reduction_kernels((4, 1 << 16), "ij->i")) == 1


# ---------------------------------------------------------------------------
# The contraction matcher


def _kernel(comp: ir.Comp) -> Kernel:
    (kernel,) = lower.lower([comp], ["k"]).kernels
    return kernel


def _matmul(spec: str, a: tuple[int, ...], b: tuple[int, ...], c: tuple[int, ...], dt: str = "float32") -> Kernel:
    return _kernel(ir.Comp.of(ir.einsum(spec, Node("a", a, dt), Node("b", b, dt), into=Node("c", c, dt))))


@pytest.mark.parametrize(("spec", "a", "b", "c", "laid"), [
    ("ik,jk->ij", (64, 48), (40, 48), (64, 40), (48, 40)),  # a @ b.T
    ("ki,jk->ij", (48, 64), (40, 48), (64, 40), (48, 40)),  # a.T @ b.T
    ("bik,bjk->bij", (3, 64, 48), (3, 40, 48), (3, 64, 40), (3, 48, 40)),  # q @ k.T
])
def test_a_product_with_b_transposed_lays_b_out_first_and_tiles(
        spec: str, a: tuple[int, ...], b: tuple[int, ...], c: tuple[int, ...], laid: tuple[int, ...]) -> None:
    """Found by review: a contraction whose b was not contiguous along the output's columns was
    not tiled: each cell an in-order dot product, 34-327x numpy's time (a @ b.T at 1024^2: 1.5 s).
    b is now copied to scratch laid out [.., k, j], and the product tiles."""
    from polyjit.core.runtime import _transposed_y

    comp = ir.Comp.of(ir.einsum(spec, Node("a", a), Node("b", b), into=Node("c", c)))
    copy, product = lower.lower([comp], ["k"], transposes=lambda k: _transposed_y(k, CPU)).kernels
    assert isinstance(copy.body, lower.Store) and copy.body.node.shape == laid
    assert patterns.plan_kernel(product, CPU).contraction is not None
    (untiled,) = lower.lower([comp], ["k"]).kernels  # without the callback: one kernel, not tiled
    assert patterns.plan_kernel(untiled, CPU).contraction is None


def test_a_copy_larger_than_b_is_not_made() -> None:
    """Found by review: b read through a window (``b[3 * j + k]``, a strided convolution as a
    product) would be laid out as every window, 8 MB from 28 KB; such a product stays as it was."""
    from polyjit.core.runtime import _transposed_y

    i, j, k = ir.Symbol("i"), ir.Symbol("j"), ir.Symbol("k")
    a, b, c = Node("a", (64, 48)), Node("b", (3 * 40 + 48,)), Node("c", (64, 40))
    conv = ir.Accum(c, AccumOp.ADD, Op.MUL, (a, b),
                    ir.projections([(i, 64), (j, 40), (k, 48)], [i, j], [i, k], [ir.affine((3, j), (1, k))]))
    (kernel,) = lower.lower([ir.Comp.of(conv)], ["k"], transposes=lambda kk: _transposed_y(kk, CPU)).kernels
    assert isinstance(kernel.body, Reduce)


def test_the_matcher_finds_roles_in_any_operand_order() -> None:
    c = patterns.match_contraction(_matmul("ik,kj->ij", (8, 4), (4, 6), (8, 6)))
    assert c is not None and (c.m, c.n, c.kk) == (8, 6, 4) and c.x.node.name == "a" and c.row_major
    swapped = patterns.match_contraction(_matmul("kj,ik->ij", (4, 6), (8, 4), (8, 6)))
    assert swapped is not None and swapped.x.node.name == "b" and swapped.row_major
    transposed = patterns.match_contraction(_matmul("ki,jk->ij", (4, 8), (6, 4), (8, 6)))
    assert transposed is not None and not transposed.row_major  # y is contiguous along k
    batched = patterns.match_contraction(_matmul("bik,bkj->bij", (2, 8, 4), (2, 4, 6), (2, 8, 6)))
    assert batched is not None and [n for _, n in batched.batch] == [2] and batched.batch_size == 2


def test_the_matcher_rejects_what_is_not_a_float_sum_of_products() -> None:
    assert patterns.match_contraction(_matmul("ik,kj->ij", (8, 4), (4, 6), (8, 6), "int32")) is None
    maxed = ir.einsum("ik,kj->ij", Node("a", (8, 4)), Node("b", (4, 6)), into=Node("c", (8, 6)), accum=AccumOp.MAX)
    assert patterns.match_contraction(_kernel(ir.Comp.of(maxed))) is None
    assert patterns.match_contraction(_kernel(ir.Comp.of(ir.einsum("ij->i", Node("x", (8, 6)), into=Node("s", (8,)))))) is None


# ---------------------------------------------------------------------------
# Kernel plans


def _plans(comp: ir.Comp, dialect: Dialect) -> list[KernelPlan]:
    return [plan_kernel(k, dialect) for k in lower.lower([comp], ["k"]).kernels]


def _plan(comp: ir.Comp, dialect: Dialect) -> KernelPlan:
    (plan,) = _plans(comp, dialect)
    return plan


def _chain(n: int) -> ir.Comp:
    a, b, c, t, out = (Node(name, (n,)) for name in ("a", "b", "c", "t", "out"))
    return ir.Comp.of(ir.apply(Op.MUL, a, b, into=t), ir.apply(Op.SUB, t, c, into=out))


def _reduce(spec: str, shape: tuple[int, ...], out_shape: tuple[int, ...]) -> ir.Comp:
    return ir.Comp.of(ir.einsum(spec, Node("x", shape), into=Node("o", out_shape)))


def _mm(m: int, k: int, n: int) -> ir.Comp:
    return ir.Comp.of(ir.einsum("ik,kj->ij", Node("a", (m, k)), Node("b", (k, n)), into=Node("c", (m, n))))


CPU = CpuDialect(vector_bytes=32)


def test_an_elementwise_chain() -> None:
    n = 1 << 20
    cpu = _plan(_chain(n), CPU)
    assert (cpu.kind, cpu.shape, cpu.team, cpu.launch) == (ELEMENTWISE, "", 1, LaunchShape((n,)))
    assert _plan(_chain(100), CPU).team == 0  # too little work for an OpenMP team
    ocl = _plan(_chain(n), OpenCLDialect())
    assert (ocl.kind, ocl.launch) == (ELEMENTWISE, LaunchShape((n,), (256,)))
    assert [[e for _, e in loops] for loops in ocl.dims] == [[n]]
    cuda = _plan(_chain(n), CudaDialect())  # a million cells: 4 a thread per trip
    assert (cuda.kind, cuda.launch, cuda.threads, cuda.unroll) == (ELEMENTWISE, LaunchShape((n // 4,), (256,)), 256, 4)
    assert _plan(_chain(n - 1), CudaDialect()).unroll == 1
    assert _plan(_chain(1 << 28), CudaDialect()).launch.global_size == (patterns.MAX_GRID_BLOCKS * 256,)  # grid-stride
    assert _plan(_chain(40), CudaDialect()).launch == LaunchShape((64,), (64,))  # a multiple of 32


def test_kernels_that_call_exp_log_or_tanh_are_shared_from_fewer_iterations_on_the_cpu() -> None:
    """Each iteration of a statement that calls a costly function counts COSTLY_OP_WEIGHT
    times against omp_min_work; a kernel shared only for that is optional (the runtime shares
    it while that pays). Plain ops of the same size, and a dialect whose runtime does not time
    optional kernels, run it on one thread."""
    n = CPU.omp_min_work // patterns.COSTLY_OP_WEIGHT  # the fewest iterations that share

    def one_op(op: Op, size: int) -> ir.Comp:
        x, y = Node("x", (size,)), Node("y", (size,))
        return ir.Comp.of(ir.apply(op, x, x, into=y) if op in (Op.POW, Op.DIV, Op.MUL) else ir.apply(op, x, into=y))

    for op in sorted(patterns.COSTLY_OPS, key=lambda o: o.value):
        at = _plan(one_op(op, n), CPU)
        assert (at.team, at.optional) == (1, True), op
        assert _plan(one_op(op, n - 1), CPU).team == 0, op
        assert _plan(one_op(op, n), Dialect()).team == 0, op  # plain OpenMP: no optional sharing
    big = _plan(one_op(Op.EXP, CPU.omp_min_work), CPU)
    assert (big.team, big.optional) == (1, False)  # shared by its size alone, always
    for op in (Op.SQRT, Op.DIV, Op.MUL):  # a few cycles an element: counted once
        assert _plan(one_op(op, n), CPU).team == 0, op
    assert _plan(_chain(n), CPU).team == 0


def test_a_small_exp_does_not_weigh_the_members_of_its_batch() -> None:
    """A batch (fuse_segments) of plain products and one short exp: each member's iterations
    count by what it calls, so the batch stays on one thread."""
    from polyjit.backends import get_backend

    n = CPU.omp_min_work // patterns.COSTLY_OP_WEIGHT
    sizes = (n, n + 1, n + 2)  # apart: segments of one batch, not one horizontally fused nest
    stmts = [ir.apply(Op.MUL, Node(f"a{k}", (m,)), Node(f"b{k}", (m,)), into=Node(f"c{k}", (m,)))
             for k, m in enumerate(sizes)]
    stmts.append(ir.apply(Op.EXP, Node("s", (8,)), into=Node("t", (8,))))
    backend = get_backend("cpu")
    (kernel,) = backend.compile_batch([ir.Comp.of(*stmts)], names=["c"]).lowered.kernels  # one batch
    assert kernel.work == sum(sizes) + 8
    assert patterns.sharing_work(kernel) == sum(sizes) + 8 * patterns.COSTLY_OP_WEIGHT
    assert plan_kernel(kernel, backend.driver.dialect).team == 0


def test_streaming_stores_for_big_outputs_where_the_host_has_avx() -> None:
    n = patterns.STREAMING_MIN_BYTES // 4
    assert _plan(_chain(n), CPU).shape == STREAMING
    assert _plan(_chain(n), CpuDialect(vector_bytes=16)).shape == ""  # SSE: no streaming
    assert _plan(_chain(n // 2), CPU).shape == ""


def test_a_small_reduction_is_a_thread_per_cell_everywhere() -> None:
    comp = _reduce("ij->i", (8, 64), (8,))
    assert [(p.kind, p.team) for p in [_plan(comp, CPU), _plan(comp, Dialect())]] == [(REDUCTION, 0)] * 2
    assert _plan(comp, OpenCLDialect()).launch == LaunchShape((8,), (8,))
    assert _plan(comp, CudaDialect()).launch == LaunchShape((32,), (32,))
    assert {p.kind for p in (_plan(comp, OpenCLDialect()), _plan(comp, CudaDialect()))} == {REDUCTION}


def test_a_big_reduction_into_many_cells() -> None:
    comp = _reduce("ij->i", (4096, 256), (4096,))
    cpu = _plan(comp, CPU)
    assert (cpu.kind, cpu.shape, cpu.team) == (REDUCTION, "", 1)
    assert _plan(comp, OpenCLDialect()).kind == REDUCTION  # 256 values a cell: too short for a group
    assert _plan(comp, CudaDialect()).launch == LaunchShape((4096,), (32,))  # spread: 128 blocks
    assert _plan(_reduce("ij->i", (1 << 16, 64), (1 << 16,)), CudaDialect()).launch.local_size == (256,)
    full = _plans(_reduce("i->", (1 << 20,), ()), CPU)  # split: partial results, then one thread
    assert [(p.kind, p.team) for p in full] == [(REDUCTION, 1), (SERIAL, 0)]
    ragged = _plans(_reduce("i->", (65_537 * 2,), ()), CPU)  # no divisor fits: parts and a tail
    assert [(p.kind, p.team) for p in ragged] == [(REDUCTION, 1), (SERIAL, 0), (SERIAL, 0)]
    short = _plans(_reduce("ijklm->", (31, 31, 31, 31, 2), ()), CPU)  # every loop short: parts over the outer ones
    assert [(p.kind, p.team) for p in short] == [(REDUCTION, 1), (SERIAL, 0)]
    fewer = _plans(_reduce("ijkl->", (20, 20, 20, 5), ()), CPU)  # fewer, longer parts; never OpenMP's reduction
    assert [(p.kind, p.team) for p in fewer] == [(REDUCTION, 1), (SERIAL, 0)]  # clause (its order varies)


def test_few_long_reductions_get_a_group_per_cell() -> None:
    comp = _reduce("ij->i", (4, 100_000), (4,))
    ocl = _plan(comp, OpenCLDialect())
    assert (ocl.kind, ocl.launch) == (GROUP_REDUCTION, LaunchShape((4 * 256,), (256,)))
    cuda = _plan(comp, CudaDialect())  # few and very long: blocks of 1024 threads
    assert (cuda.kind, cuda.launch) == (GROUP_REDUCTION, LaunchShape((4 * 1024,), (1024,)))
    assert _plan(_reduce("ij->i", (4, 1000), (4,)), CudaDialect()).threads == 256
    assert _plan(comp, OpenCLDialect(group_reductions=False)).kind == REDUCTION  # PoCL's CPU devices
    assert _plan(comp, CPU).kind == REDUCTION
    many = _reduce("ij->j", (600, 5000), (5000,))  # contiguous cells, many: a work-item each coalesces
    assert _plan(many, CudaDialect()).kind == REDUCTION


def test_a_matmul_big_enough_for_tiles() -> None:
    comp = _mm(256, 256, 256)
    cpu = _plan(comp, CPU)
    assert (cpu.kind, cpu.shape, cpu.team) == (CONTRACTION, REGISTER_TILES, 2)
    assert cpu.tiles is not None and (cpu.tiles.tm, cpu.tiles.tn, cpu.tiles.lanes) == (6, 16, 8)  # 6 x 2 float8
    ocl = _plan(comp, OpenCLDialect())
    assert ocl.kind == CONTRACTION and ocl.tiles is not None and ocl.tiles.threads == 64
    assert ocl.launch == LaunchShape((4 * 64, 4, 1), (64, 1, 1))  # a work-group per 64x64 block
    cuda = _plan(comp, CudaDialect())
    assert (cuda.kind, cuda.tiles, cuda.aligned, cuda.x_vector, cuda.y_vector) == (
        CONTRACTION, TILES_LARGE, True, "k", "n")
    assert cuda.launch == LaunchShape((2 * 256, 2, 1), (256, 1, 1))
    small_tiles = _plan(_mm(100, 70, 50), CudaDialect())
    assert small_tiles.tiles == patterns.TILES_SMALL and not small_tiles.aligned and small_tiles.x_vector is None


def test_mid_sized_matmuls_are_shared_only_while_it_pays_on_the_cpu() -> None:
    mid = _plan(_mm(128, 128, 64), CPU)  # 1M multiply-adds: the runtime times both ways
    assert (mid.kind, mid.team, mid.optional) == (CONTRACTION, 2, True) and mid.chunks == 22 * 4
    big = _plan(_mm(256, 256, 256), CPU)  # always shared
    assert (big.team, big.optional) == (2, False)
    small = _plan(_mm(64, 64, 64), CPU)  # 262K: one thread
    assert (small.team, small.chunks, small.optional) == (0, 1, False)
    one_tile = _plan(_mm(6, 6000, 16), CPU)  # 576K in a single tile: nothing to share
    assert (one_tile.team, one_tile.chunks, one_tile.optional) == (0, 1, False)
    assert not _plan(_mm(128, 128, 64), OpenCLDialect()).optional  # no such band off the CPU


def test_narrow_outputs_run_their_vectors_down_the_columns_on_the_cpu() -> None:
    """A weight gradient h.T @ dy of a head narrower than a vector: each tile holds every
    column and vectors down them (x is contiguous along i), i and j swapped; the values are
    checked by the catalog's ``matmul.narrow_columns.*`` and ``epilogue.narrow_update*``."""
    def grad(m: int, k: int, n: int) -> ir.Comp:
        return ir.Comp.of(ir.einsum("ki,kj->ij", Node("h", (k, m)), Node("dy", (k, n)), into=Node("g", (m, n))))

    head = _plan(grad(256, 256, 5), CPU)  # float32 in 32-byte vectors: 8 lanes, 16 registers
    assert head.transposed and head.contraction is not None and head.tiles is not None
    assert (head.contraction.m, head.contraction.n) == (5, 256)  # the swapped roles
    assert (head.tiles.tm, head.tiles.tn) == (5, 16)  # 5 columns x 2 vectors: 10 accumulators
    assert (head.team, head.chunks) == (0, 1)  # 327K multiply-adds: one thread
    wide = CpuDialect(vector_bytes=64, vector_registers=32)
    mlp = _plan(grad(256, 256, 10), wide)  # the MLP's: 16 lanes, 32 registers
    assert mlp.transposed and mlp.tiles is not None and (mlp.tiles.tm, mlp.tiles.tn) == (10, 32)
    assert mlp.optional and mlp.chunks == 8  # 655K: shared while it pays, 8 tiles of 32 rows
    assert not _plan(grad(256, 256, 8), CPU).transposed  # a whole vector wide
    assert not _plan(grad(4, 256, 5), CPU).transposed  # fewer rows than a vector
    assert not _plan(_mm(256, 256, 5), CPU).transposed  # x contiguous along k, not i
    assert not _plan(_mm(256, 256, 256), CPU).transposed
    assert not _plan(grad(256, 8, 5), CPU).transposed  # a batch of 8: writing cells one by one costs more
    # FMAs per k on the busiest thread (column_tiles_pay), 16 lanes: one tile of 64x5 (20)
    # beats the rows' 11 tiles on two threads (33); 16x15 (15 on one) loses to 3 tiles (9),
    # and so does 17x15, whose second vector holds one row (30 on two tiles: 15)
    assert _plan(grad(64, 2048, 5), wide).transposed
    assert not _plan(grad(16, 8192, 15), wide).transposed
    assert not _plan(grad(17, 8192, 15), wide).transposed
    batched = ir.Comp.of(ir.einsum("bki,bkj->bij", Node("h", (4, 4096, 64)), Node("dy", (4, 4096, 5)),
                                   into=Node("g", (4, 64, 5))))
    assert _plan(batched, wide).transposed and _plan(batched, wide).chunks == 4  # a tile per batch index


def test_a_matmul_too_small_for_tiles() -> None:
    comp = _mm(8, 8, 8)
    assert _plan(comp, CPU).shape == REGISTER_TILES  # register tiles never lose on the CPU
    assert _plan(comp, Dialect()).kind == REDUCTION  # the plain C dialect has no tiles
    assert _plan(comp, OpenCLDialect()).kind == REDUCTION
    assert _plan(_mm(16, 16, 128), OpenCLDialect()).kind == CONTRACTION  # OpenCL's threshold
    assert _plan(_mm(16, 16, 128), CudaDialect()).kind == REDUCTION  # CUDA's is higher
    assert _plan(_mm(256, 256, 256), OpenCLDialect(matmul=False)).kind == REDUCTION
    double = ir.Comp.of(ir.einsum("ik,kj->ij", *(Node(x, (64, 64), "float64") for x in "ab"),
                                  into=Node("c", (64, 64), "float64")))
    assert _plan(double, CudaDialect()).kind == REDUCTION  # CUDA tiles float32 only
    assert _plan(double, OpenCLDialect()).kind == CONTRACTION
    transposed = ir.Comp.of(ir.einsum("ki,jk->ij", Node("a", (64, 256)), Node("b", (256, 64)), into=Node("c", (256, 256))))
    assert _plan(transposed, CudaDialect()).kind == CONTRACTION  # any strides
    assert _plan(transposed, OpenCLDialect()).kind == REDUCTION  # its CPU variant loads rows of y


def test_a_column_reduction_on_the_cpu() -> None:
    comp = _reduce("ij->j", (2000, 1500), (1500,))
    cpu = _plan(comp, CPU)
    assert (cpu.kind, cpu.shape, cpu.team) == (REDUCTION, COLUMN, 1)  # 3 blocks of 512 outputs shared
    assert not cpu.ordered_float  # vectorizes across outputs, each still sums in order
    assert _plan(comp, Dialect()).shape == ""
    assert _plan(_reduce("ij->j", (20, 1500), (1500,)), CPU).team == 0  # too little work to share


def test_a_staged_reduction_on_the_cpu() -> None:
    x, e, s = Node("x", (64, 1000)), Node("e", (64, 1000)), Node("s", (64,))
    comp = ir.Comp.of(ir.apply(Op.EXP, x, into=e), ir.einsum("ij->i", e, into=s))
    cpu = _plan(comp, CPU)
    assert (cpu.kind, cpu.shape, cpu.team, cpu.ordered_float) == (REDUCTION, STAGED, 1, False)
    plain = _plan(_reduce("ij->i", (64, 1000), (64,)), CPU)  # nothing costly to stage: vector lanes
    assert (plain.shape, plain.ordered_float) == ("", False)
    assert _plan(comp, CudaDialect()).shape == ""


def test_a_stored_transpose_of_4_byte_values_on_the_cpu() -> None:
    def t(spec: str, shape: tuple[int, ...], out_shape: tuple[int, ...], dtype: str = "float32") -> KernelPlan:
        return _plan(ir.Comp.of(ir.einsum(spec, Node("x", shape, dtype), into=Node("o", out_shape, dtype))), CPU)

    small = t("ij->ji", (128, 64), (64, 128))
    assert (small.kind, small.shape, small.team) == (ELEMENTWISE, TRANSPOSE, 0)
    big = t("ij->ji", (300, 500), (500, 300))  # 38 x 63 blocks, the last ones cut, shared
    assert (big.shape, big.team, big.chunks) == (TRANSPOSE, 2, 38 * 63)
    assert t("bij->bji", (3, 16, 24), (3, 24, 16)).shape == TRANSPOSE  # a batch axis outside
    assert t("ij->ji", (40, 20), (20, 40), "int32").shape == TRANSPOSE  # the bits move, whatever they mean
    assert t("ij->ji", (40, 20), (20, 40), "float64").shape == ""
    assert t("ij->ji", (40, 4), (4, 40)).shape == ""  # narrower than a block
    assert t("ijk->kji", (8, 8, 8), (8, 8, 8)).shape == ""  # contiguous along neither inner loop
    assert t("ij->ij", (64, 64), (64, 64)).shape == ""  # a copy
    assert _plan(_reduce("ij->ji", (64, 64), (64, 64)), Dialect()).shape == ""
    sse = _plan(_reduce("ij->ji", (64, 64), (64, 64)), CpuDialect(vector_bytes=16))
    assert sse.shape == ""  # 32-byte vectors without AVX: slower than the plain loop


def test_the_plan_travels_on_the_kernel_spec() -> None:
    lowered = lower.lower([_mm(256, 256, 256), _reduce("ij->i", (4, 100_000), (4,))], ["mm", "r"])
    for dialect in (CPU, OpenCLDialect(), CudaDialect()):
        specs = generate(lowered, dialect).all_kernels
        plans = [plan_kernel(k, dialect) for k in lowered.kernels]
        assert [s.plan for s in specs] == plans and [s.launch for s in specs] == [p.launch for p in plans]
