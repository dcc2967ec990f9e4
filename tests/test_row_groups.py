"""Row groups (core/fusion.py ``fuse_rows``): adjacent kernels over the rows of one outer loop
run as one kernel, each row's statements in turn, when every node one writes and another
touches is accessed only within the iteration's own row. The values of every case are
checked against the reference by the catalog (``rows.*``) on every backend; here, which
kernels merge, how the CPU writes them, and the renaming that keeps a member's loops apart."""

from __future__ import annotations

import pytest
from catalog_check import backend_or_skip, kernel_comments
from sharing import shared_every_run

from polyjit.core import ir
from polyjit.core.fusion import fuse_rows
from polyjit.core.ir import AccumOp, MemoryMode, Node, Symbol
from polyjit.core.loops import Kernel, Load, Loop, Reduce, Seq, Store
from polyjit.testing.programs import by_name


@pytest.mark.parametrize("backend", ["cpu", "opencl"])
@pytest.mark.parametrize(("program", "kernels"), [
    ("rows.softmax", 1),  # max, shift, sum of exp, log, divide: one kernel
    ("rows.loop_names_taken", 1),  # its loops renamed apart from the row loop
    ("rows.reads_other_rows", 2),  # the column sum reads every row: apart
    ("rows.overwrites_what_others_read", 2),  # the scaling overwrites rows the sum still reads
    ("rows.joins_past_independent", 2),  # the consumer moves up past the lse's total
    ("rows.waits_for_what_runs_between", 3),  # it reads that total: it stays after it
])
def test_which_kernels_share_their_rows(backend: str, program: str, kernels: int) -> None:
    for dt in ("float32", "float64"):
        assert len(kernel_comments(backend, f"{program}.{dt}")) == kernels


def test_the_cpu_runs_a_row_group_in_blocks_of_rows() -> None:
    """Each statement runs over a block of rows before the next starts: one row at a time,
    each row would wait on its max's and its sum's fold before the next statement."""
    text = backend_or_skip("cpu").compile(by_name("rows.softmax.float32").comps[0], name="sm").source
    assert text.count("void sm_") == 1 and "pj_rb += 8" in text
    assert text.count("for (int64_t i0 = pj_rb; i0 < pj_re; ++i0)") == 5
    assert "no-tree-loop-vectorize" not in text  # its float folds are staged, read forwards


def test_gpus_keep_long_rows_apart() -> None:
    """A GPU runs a row group one row per work-item: rows longer than its limit stay apart."""
    from polyjit.backends.opencl import OpenCLDialect

    x, m, s = Node("x", (8, 1000)), Node("m", (8, 1)), Node("s", (8, 1000))
    i, j = Symbol("i"), Symbol("j")
    pr = ir.Projections(((i, 8), (j, 1000)), (ir.as_affine(i), ir.fixed(0)), ((ir.as_affine(i), ir.as_affine(j)),))
    comp = ir.Comp.of(ir.Accum(m, AccumOp.MAX, ir.Op.ID, (x,), pr, init_neutral=True),
                      ir.apply(ir.Op.SUB, x, m, into=s))
    assert OpenCLDialect.row_group_max_row < 1000
    assert len(backend_or_skip("opencl").compile_batch([comp]).lowered.kernels) == 2
    assert len(backend_or_skip("cpu").compile_batch([comp]).lowered.kernels) == 1


def test_a_member_loop_named_like_the_row_symbol_is_renamed_apart() -> None:
    """The second kernel's outer loop is ``j`` and its inner one ``i``, the group's row symbol:
    its ``i`` becomes a loop of its own, and its rows read the first kernel's row ``j``."""
    i, j, k = Symbol("i"), Symbol("j"), Symbol("k")
    x, r, y = Node("x", (4, 3)), Node("r", (4,)), Node("y", (4, 3))
    first = Kernel("a", ((i, 4),), Reduce(r, ir.as_affine(i), AccumOp.ADD, None, ((k, 3),),
                                          Load(x, ir.affine((3, i), (1, k)))))
    second = Kernel("b", ((j, 4), (i, 3)), Store(y, ir.affine((3, j), (1, i)), Load(r, ir.as_affine(j))))
    (fused,) = fuse_rows([first, second], lambda _: True)
    assert fused.parallel == ((i, 4),) and isinstance(fused.body, Seq)
    loop = fused.body.body[1]
    assert isinstance(loop, Loop) and loop.sym == Symbol("i_own") and loop.extent == 3
    assert isinstance(loop.body, Store)
    assert loop.body.index == ir.affine((3, i), (1, Symbol("i_own")))
    assert loop.body.value == Load(r, ir.as_affine(i))


def test_an_access_outside_the_row_keeps_kernels_apart() -> None:
    """The consumer reads the producer's mirrored row (``r[3 - i]``): not its own, so they
    stay two kernels; reading ``r[i]`` they merge."""
    i, k = Symbol("i"), Symbol("k")
    x, r, y = Node("x", (4, 3)), Node("r", (4,)), Node("y", (4,))
    first = Kernel("a", ((i, 4),), Reduce(r, ir.as_affine(i), AccumOp.ADD, None, ((k, 3),),
                                          Load(x, ir.affine((3, i), (1, k)))))
    second = Kernel("b", ((i, 4),), Store(y, ir.as_affine(i), Load(r, ir.affine((-1, i), const=3))))
    assert len(fuse_rows([first, second], lambda _: True)) == 2
    own = Kernel("b", ((i, 4),), Store(y, ir.as_affine(i), Load(r, ir.as_affine(i))))
    assert len(fuse_rows([first, own], lambda _: True)) == 1


def test_a_kernel_joins_the_group_that_wrote_what_it_reads() -> None:
    """Two row groups it could join: the newer one (its own group: it reads ``r``'s mirrored
    rows, so it could not join the first) and the one that wrote what it reads, where those
    values were just computed: it joins that one."""
    i, k = Symbol("i"), Symbol("k")
    x, r, o, y = Node("x", (4, 3)), Node("r", (4,)), Node("o", (4,)), Node("y", (4,))
    producer = Kernel("a", ((i, 4),), Reduce(r, ir.as_affine(i), AccumOp.ADD, None, ((k, 3),),
                                             Load(x, ir.affine((3, i), (1, k)))))
    newer = Kernel("b", ((i, 4),), Store(o, ir.as_affine(i), Load(r, ir.affine((-1, i), const=3))))
    consumer = Kernel("c", ((i, 4),), Store(y, ir.as_affine(i), Load(r, ir.as_affine(i))))
    fused = fuse_rows([producer, newer, consumer], lambda _: True)
    assert [kern.name for kern in fused] == ["a", "b"]
    first = fused[0].body
    assert isinstance(first, Seq) and len(first.body) == 2 and isinstance(first.body[1], Store)
    assert first.body[1].node is y


def test_a_members_loop_is_vectorized_only_where_its_iterations_write_their_own_cells() -> None:
    """``omp simd`` on a row group's serial loop (a member's inner parallel loop) when each
    iteration stores its own cell and reads the stored node only there; not on a loop that
    accumulates, stores one cell, or reads another iteration's cell."""
    from polyjit.core.codegen import independent_iterations

    j = Symbol("j")
    x, y = Node("x", (4, 27)), Node("y", (4, 27))
    row = ir.affine((27, Symbol("i")), (1, j))
    assert independent_iterations(Loop(j, 27, Store(y, row, Load(x, row))))
    assert independent_iterations(Loop(j, 27, Store(y, row, Load(y, row))))
    assert not independent_iterations(Loop(j, 27, Store(y, row, Load(x, row), accum=AccumOp.ADD)))
    assert not independent_iterations(Loop(j, 27, Store(y, ir.affine((27, Symbol("i"))), Load(x, row))))
    assert not independent_iterations(Loop(j, 26, Store(y, row, Load(y, row + ir.as_affine(1)))))
    text = backend_or_skip("cpu").compile(by_name("rows.joins_past_independent.float32").comps[0], name="j").source
    (group,) = [f for f in text.split("\nvoid ")[1:] if "pj_rb" in f]
    lines = group.splitlines()
    marked = [lines[k + 1] for k, line in enumerate(lines) if "#pragma omp simd" in line]
    # the shift, and the gradient's two passes (its exps a vector at a time: Emitter.lanes)
    # over its chunks and its tail; not the folds
    assert len(marked) == 5 and not any("pj_acc" in line for line in marked)


def test_a_row_groups_tails_run_whole_vectors_with_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Softmax over 27-wide rows: the staged sum of exp and the divide's loop run their
    3-wide tails as the last whole vector again (Emitter.lanes, codegen.repeatable), and give
    the bits of the scalar loops."""
    import numpy as np

    from polyjit.backends.cpu.dialect import CpuDialect

    backend = backend_or_skip("cpu")
    lanes = backend.driver.dialect.vector_bytes // 4
    if 27 % lanes == 0 or lanes > 27:
        pytest.skip(f"{lanes} lanes leave 27-wide rows no tail")
    prog = by_name("rows.softmax.float32")
    rng = np.random.default_rng(3)
    values = [(node, gen(rng)) for node, gen in prog.inputs]
    results = []
    for vector in (True, False):
        if not vector:
            monkeypatch.setattr(CpuDialect, "vector_math", lambda self, fn, dt: None)
        code = backend.compile(prog.comps[0], name="sm")
        if vector:
            assert code.source.count(f"pj_lc = {27 - lanes};") == 2 and "const int pj_ln" not in code.source
        ctx = backend.get_device(0).make_context()
        for node, v in values:
            ctx = ctx.init_from_host(node, v)
        r = ctx.link(code)
        r.run()
        results.append([r.context.read(n).view(np.uint32) for n in prog.outputs])
        ctx.finalize()
    for vec, scalar in zip(*results):
        np.testing.assert_array_equal(vec, scalar)


def test_a_row_group_that_calls_exp_shares_its_rows_with_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Softmax over 251 rows of 27 (char_lm's logits are 128x27): its exps make the group worth
    sharing (patterns.sharing_work), so its blocks of rows are a range the stream's threads
    split (251: a tail block, and grains that start inside a block); the results are the bits
    of the group run whole on one thread, and the reference's values. Shared on every run:
    the stream's tuner off (the group is optional, shared while that pays)."""
    import numpy as np

    from polyjit.core import patterns
    from polyjit.core.reference import run_reference

    backend = backend_or_skip("cpu")
    x, m, s = Node("x", (251, 27)), Node("m", (251, 1), mode=MemoryMode.ON_DEVICE), Node("s", (251, 27))
    z, lse, e, p = Node("z", (251, 1)), Node("lse", (251, 1)), Node("e", (251, 27)), Node("p", (251, 27))
    i, j = Symbol("i"), Symbol("j")
    rows = ir.Projections(((i, 251), (j, 27)), (ir.as_affine(i), ir.fixed(0)), ((ir.as_affine(i), ir.as_affine(j)),))
    comp = ir.Comp.of(ir.Accum(m, AccumOp.MAX, ir.Op.ID, (x,), rows, init_neutral=True),
                      ir.apply(ir.Op.SUB, x, m, into=s),
                      ir.Accum(z, AccumOp.ADD, ir.Op.EXP, (s,), rows, init_neutral=True),
                      ir.apply(ir.Op.LOG, z, into=lse), ir.apply(ir.Op.EXP, s, into=e), ir.apply(ir.Op.DIV, e, z, into=p))
    xv = np.random.default_rng(5).standard_normal((251, 27)).astype(np.float32) * 4
    results = []
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(patterns, "COSTLY_OP_WEIGHT", 1)
        code = backend.compile(comp, name="sm")
        assert code.source.count("void sm_") == 1
        assert ("pj_rb = pj_lo" in code.source) == shared
        ctx = backend.get_device(0).make_context().init_from_host(x, xv)
        r = ctx.link(code)
        runs = []
        with shared_every_run(ctx.stream.handle):
            for _ in range(20):  # the threads split the range differently from run to run
                r.run()
                runs.append([r.context.read(n).view(np.uint32) for n in (m, lse, p)])
        ctx.finalize()
        for run in runs[1:]:
            for a, b in zip(run, runs[0]):
                np.testing.assert_array_equal(a, b)
        results.append(runs[0])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    ref = run_reference([comp], {x: xv.astype(np.float64)})
    np.testing.assert_allclose(results[0][2].view(np.float32), ref[p], rtol=1e-5, atol=1e-7)
