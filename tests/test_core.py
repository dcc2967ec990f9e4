"""Lowering, memory modes, the slab planner, the compile cache and IR validation."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
from settle import settled_memory

from polyjit.backends import get_backend
from polyjit.backends.cpu.compiler import build_shared
from polyjit.core import codegen, ir, lower, patterns, slab
from polyjit.core.errors import (
    CompileError,
    DTypeMismatchError,
    InvalidProgramError,
    ShapeMismatchError,
)
from polyjit.core.ir import MemoryMode
from polyjit.demo import chain_program


def test_fused_chain_is_one_kernel_without_intermediates() -> None:
    comp, inputs, out = chain_program(1000)
    batch = lower.lower([comp], ["chain"])
    (lc,) = batch.comps
    assert len(lc.kernels) == 1
    kernel = lc.kernels[0]
    assert set(kernel.inputs) == set(inputs)
    assert kernel.outputs == (out,)
    virtual = [n for n, m in batch.modes.items() if m is MemoryMode.VIRTUAL]
    assert sorted(n.name for n in virtual) == ["ab", "cd", "s"]
    assert lc.outputs == (out,)


def test_fused_chain_runs_and_leaves_intermediates_out_of_the_context() -> None:
    backend = get_backend("cpu")
    comp, inputs, out = chain_program(4096)
    rng = np.random.default_rng(1)
    ctx = backend.get_device(0).make_context()
    host = {n: rng.standard_normal(n.shape).astype(np.float32) for n in inputs}
    for n, v in host.items():
        ctx = ctx.init_from_host(n, v)
    routine = ctx.link(backend.compile(comp, name="chain"))
    routine.run()
    a, b, c, d, e = (host[n] for n in inputs)
    np.testing.assert_allclose(routine.context.read(out), a * b + c * d - e, rtol=1e-5, atol=1e-5)
    names = {n.name for n in routine.context.buffers}
    assert not names & {"ab", "cd", "s"}


def test_a_node_read_twice_is_stored_as_scratch() -> None:
    a, t, out = ir.Node("a", (8,)), ir.Node("t", (8,)), ir.Node("out", (8,))
    comp = ir.Comp.of(ir.apply(ir.Op.EXP, a, into=t), ir.apply(ir.Op.MUL, t, t, into=out))
    batch = lower.lower([comp], ["f"])
    assert batch.modes[t] is MemoryMode.LOCAL
    assert batch.comps[0].scratch == (t,)


def test_explicit_virtual_that_cannot_inline_is_an_error() -> None:
    a = ir.Node("a", (4, 4))
    s = ir.Node("s", (4,), mode=MemoryMode.VIRTUAL)
    out = ir.Node("out", (4,))
    comp = ir.Comp.of(ir.einsum("ij->i", a, into=s), ir.apply(ir.Op.NEG, s, into=out))
    with pytest.raises(InvalidProgramError, match="cannot be inlined"):
        lower.lower([comp], ["f"])


@pytest.mark.parametrize("backend", ["cpu", "opencl"])
def test_a_context_holding_a_node_the_batch_keeps_apart_is_refused_at_link(backend: str) -> None:
    """Lowering cannot know what a context holds. A node it inlines (VIRTUAL) is never
    stored, and one written at some cells, then read (LOCAL scratch), starts at zero: a
    context holding either would keep a stale value or lose its other cells, where the
    reference keeps them (found by review: the partial write zeroed the held rows, and the
    result computed from them). Refused at link; marked MATERIALIZED, each runs as the
    reference does."""
    from polyjit.core.reference import run_reference

    be = get_backend(backend)
    if be.num_devices() == 0:
        pytest.skip(f"no {backend} device")
    i, r = ir.Symbol("i"), 4
    x, y = ir.Node("x", (r,)), ir.Node("y", (r, r))
    for mode in (None, MemoryMode.MATERIALIZED):
        q, v = ir.Node("q", (r, r), mode=mode), ir.Node("v", (r, r), mode=mode)
        partial = ir.Comp.of(ir.Accum(q, None, ir.Op.ID, (x,), ir.projections([(i, r)], [0, i], [i])),
                             ir.apply(ir.Op.MUL, q, 2.0, into=y))  # q[0, :] = x; y = 2 q
        inlined = ir.Comp.of(ir.apply(ir.Op.EXP, q, into=v), ir.apply(ir.Op.MUL, v, 2.0, into=y))
        for comp, held, says in ((partial, q, "starts at zero"), (inlined, v, "never storing it")):
            host = {x: np.arange(r, dtype=np.float32), q: np.full((r, r), 0.5, np.float32),
                    held: np.full((r, r), 5, np.float32)}
            ctx = be.get_device(0).make_context()
            for node, values in host.items():
                ctx = ctx.init_from_host(node, values)
            code = be.compile(comp, name="held")
            if mode is None:
                with pytest.raises(InvalidProgramError, match=f"{held.name}#.*{says}.*holds {held.name}#"):
                    ctx.link(code)
                continue
            routine = ctx.link(code)
            routine.run()
            want = run_reference([comp], host)
            for node in (held, y):
                np.testing.assert_allclose(routine.context.read(node), want[node], rtol=1e-6, err_msg=node.label)
            routine.context.finalize()


def test_elementwise_2d_loops_merge_into_one() -> None:
    a, out = ir.Node("a", (64, 32)), ir.Node("out", (64, 32))
    batch = lower.lower([ir.Comp.of(ir.apply(ir.Op.EXP, a, into=out))], ["f"])
    (kernel,) = batch.kernels
    assert [n for _, n in kernel.parallel] == [64 * 32]


def test_matmul_is_recognised_as_a_contraction() -> None:
    a, b, c = ir.Node("a", (8, 4)), ir.Node("b", (4, 6)), ir.Node("c", (8, 6))
    (kernel,) = lower.lower([ir.Comp.of(ir.einsum("ik,kj->ij", a, b, into=c))], ["mm"]).kernels
    match = patterns.match_contraction(kernel)
    assert match is not None and (match.m, match.n, match.kk) == (8, 6, 4)


def test_non_surjective_accumulation_zero_fills_first() -> None:
    a, out = ir.Node("a", (4,)), ir.Node("out", (8,))
    i = ir.Symbol("i")
    acc = ir.Accum(out, ir.AccumOp.ADD, ir.Op.ID, (a,),
                   ir.projections([(i, 4)], [ir.affine((2, i))], [i]))
    kernels = lower.lower([ir.Comp.of(acc)], ["f"]).kernels
    assert [k.name for k in kernels] == ["f_0_init", "f_0"]


def test_planner_reuses_space_between_disjoint_lifetimes() -> None:
    reqs = [slab.Request("a", 100, 4, 0, 1), slab.Request("b", 100, 4, 2, 3),
            slab.Request("c", 50, 4, 0, 3)]
    plan = slab.plan(reqs, 64)
    assert plan.offsets["a"] == plan.offsets["b"]
    assert plan.offsets["c"] >= 128 or plan.offsets["c"] + 50 <= plan.offsets["a"]
    assert plan.nbytes == 192
    for r in reqs:
        assert plan.offsets[r.key] % 64 == 0


def test_link_packs_scratch_nodes_into_less_space() -> None:
    n = 1024
    x = ir.Node("x", (n,))
    t1, t2, t3, out = (ir.Node(f"t{k}", (n,)) for k in range(4))
    # each scratch node is read twice, so none is inlined; t1 is dead once t2 exists
    comp = ir.Comp.of(
        ir.apply(ir.Op.MUL, x, x, into=t1),
        ir.apply(ir.Op.ADD, t1, t1, into=t2),
        ir.apply(ir.Op.MUL, t2, t2, into=t3),
        ir.apply(ir.Op.ADD, t3, t3, into=out),
    )
    backend = get_backend("cpu")
    dev = backend.get_device(0)
    ctx = dev.make_context().init_from_host(x, np.full(n, 2, np.float32))
    before = settled_memory(dev)
    r = ctx.link(backend.compile(comp, name="packed"))
    grown = dev.used_memory() - before
    assert grown < 4 * n * 4  # out + 3 scratch would be 4 buffers without reuse
    r.run()
    np.testing.assert_allclose(r.context.read(out), np.full(n, 2 * 64, np.float32))
    r.context.finalize()
    assert dev.used_memory() == before


def test_ir_validation_errors_name_the_problem() -> None:
    a, b = ir.Node("a", (3,)), ir.Node("b", (4,))
    with pytest.raises(ShapeMismatchError, match="do not broadcast"):
        ir.apply(ir.Op.ADD, a, b, into=ir.Node("c", (3,)))
    with pytest.raises(DTypeMismatchError, match="cast first"):
        ir.apply(ir.Op.ADD, a, ir.Node("i", (3,), "int32"), into=ir.Node("c", (3,)))
    with pytest.raises(DTypeMismatchError, match="floating"):
        ir.apply(ir.Op.EXP, ir.Node("i", (3,), "int32"), into=ir.Node("c", (3,), "int32"))
    i = ir.Symbol("i")
    with pytest.raises(ShapeMismatchError, match="axis has size 3"):
        ir.Accum(a, None, ir.Op.ID, (b,), ir.projections([(i, 4)], [i], [i]))


def test_compile_error_shows_log_and_source_lines() -> None:
    src = "int ok(void) { return 1; }\nint broken(void) { return nope; }\n"
    with pytest.raises(CompileError) as info:
        build_shared(src)
    msg = str(info.value)
    assert "nope" in info.value.log
    assert ">>     2 | int broken(void) { return nope; }" in msg


def test_a_second_process_reuses_the_compiled_library(tmp_path: object) -> None:
    script = textwrap.dedent("""
        import sys
        from polyjit.backends import get_backend
        from polyjit.backends.cpu.compiler import SHARED_CACHE
        from polyjit.demo import chain_program
        comp, _, _ = chain_program(777)
        get_backend("cpu").compile(comp, name="cached_chain")
        print(SHARED_CACHE.compiles)
    """)
    env = {**os.environ, "POLYJIT_CACHE_DIR": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert int(first.stdout.split()[-1]) >= 1
    assert int(second.stdout.split()[-1]) == 0


def test_source_of_a_batch_is_one_file_with_every_kernel() -> None:
    comp, _, _ = chain_program(64)
    a, b, c = ir.Node("a", (8, 4)), ir.Node("b", (4, 6)), ir.Node("c", (8, 6))
    batch = lower.lower([comp, ir.Comp.of(ir.einsum("ik,kj->ij", a, b, into=c))], ["chain", "mm"])
    src = codegen.generate(batch, codegen.Dialect())
    assert src.text.count("void chain_3(") == 1 and src.text.count("void mm_0(") == 1
    assert [len(k) for k in src.kernels] == [1, 1]


def test_gather_and_scatter_add_refuse_bad_programs_naming_the_nodes() -> None:
    t, i = ir.Node("table", (5, 3)), ir.Node("idx", (4,), "int32")
    with pytest.raises(ShapeMismatchError, match=r"gather into out#\d+: out#\d+ has shape \(4, 2\), expected \(4, 3\)"):
        ir.gather(t, i, ir.Node("out", (4, 2)))
    with pytest.raises(DTypeMismatchError, match=r"indices f#\d+ are float32, not integers"):
        ir.gather(t, ir.Node("f", (4,)), ir.Node("out", (4, 3)))
    with pytest.raises(DTypeMismatchError, match=r"scatter_add into d#\d+ \(float64\) from v#\d+ \(float32\)"):
        ir.scatter_add(i, ir.Node("v", (4, 3)), ir.Node("d", (5, 3), "float64"))
    with pytest.raises(ShapeMismatchError, match="has no rows to pick"):
        ir.gather(ir.Node("empty", (0, 3)), i, ir.Node("out", (4, 3)))
    v = ir.Node("v", (4, 3))
    with pytest.raises(InvalidProgramError, match=r"scatter_add into v#\d+ reads v#\d+"):
        ir.scatter_add(i, v, v)
    ir.gather(ir.Node("empty", (0, 3)), ir.Node("none", (0,), "int32"), ir.Node("out", (0, 3)))  # nothing to pick


def test_a_base_alignment_that_is_not_a_power_of_two_is_the_drivers_to_say() -> None:
    """Found by the review of alloc_pool's new checks: they refused a driver's own
    base_alignment of 48 on every allocation; only an alignment below 1 is refused."""
    import attrs

    from polyjit.backends.cpu import CpuDriver
    from polyjit.core.protocol import DeviceInfo
    from polyjit.core.runtime import Backend

    class Aligned48(CpuDriver):
        def device_info(self, ordinal: int) -> DeviceInfo:
            return attrs.evolve(super().device_info(ordinal), base_alignment=48)

    be = Backend(Aligned48(1))
    a, b = ir.Node("a48", (5,)), ir.Node("b48", (7,))
    ctx = be.get_device(0).make_context().init_from_host(a, np.arange(5, dtype=np.float32))
    ctx = ctx.init_from_host(b, np.ones(7, np.float32))
    assert ctx.read(a).tolist() == [0, 1, 2, 3, 4] and ctx.read(b).tolist() == [1] * 7
    be.close()


def test_events_sync_by_design_md_name_and_by_cupy_and_pytorchs() -> None:
    """DESIGN.md names the host wait of an Event ``sync()`` (OCANNL's); CuPy and PyTorch call it
    ``synchronize()``. Both are the one wait, and so is ``Device.all_work()``'s."""
    from polyjit.backends.cpu import CpuDriver
    from polyjit.core.runtime import Backend

    be = Backend(CpuDriver(1))
    dev = be.get_device(0)
    x, y = ir.Node("sync_x", (64,)), ir.Node("sync_y", (64,))
    ctx = dev.make_context().init_from_host(x, np.arange(64, dtype=np.float32))
    r = ctx.link(be.compile(ir.Comp.of(ir.apply(ir.Op.MUL, x, x, into=y)), name="sync_sq"))
    r.run()
    ev = r.context.stream.record()
    ev.sync()
    assert ev.is_done()
    r.run()
    dev.all_work().sync()
    assert dev.is_idle()
    np.testing.assert_array_equal(r.context.read(y), np.arange(64, dtype=np.float32) ** 2)
    be.close()


def test_a_sum_of_one_term_starts_from_plus_zero(backend: Any) -> None:
    """Found by review: a sum with no axis to reduce (``i,i->i``, ``i,j->ij``, an elementwise
    product accumulated into a fresh output) was stored as is, so a -0.0 term stayed -0.0
    where 0 + (-0.0) is +0.0 (the reference's and numpy's): 1 / it gave -inf, not +inf."""
    be = backend
    a, b, o, r, outer = (ir.Node(n, s) for n, s in (("a", (3,)), ("b", (3,)), ("o", (3,)), ("r", (3,)), ("outer", (3, 3))))
    av, bv = np.array([-1, 0, 2], np.float32), np.array([0, -1, 5], np.float32)
    comp = ir.Comp.of(ir.einsum("i,i->i", a, b, into=o), ir.apply(ir.Op.DIV, 1.0, o, into=r),
                      ir.einsum("i,j->ij", a, b, into=outer), embedded=[o, r, outer])
    ctx = be.get_device(0).make_context().init_from_host(a, av).init_from_host(b, bv)
    routine = ctx.link(be.compile(comp, name="plus_zero"))
    routine.run()
    got_o, got_r, got_outer = (routine.context.read(n) for n in (o, r, outer))
    np.testing.assert_array_equal(np.signbit(got_o), [False, False, False])
    np.testing.assert_array_equal(got_r, np.array([np.inf, np.inf, 0.1], np.float32))
    np.testing.assert_array_equal(np.signbit(got_outer), np.signbit(np.einsum("i,j->ij", av, bv)))
    routine.context.finalize()
