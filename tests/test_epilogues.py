"""Epilogue fusion (core/fusion.py ``fuse_epilogues``): on a dialect that tiles contractions
with an epilogue (the CPU's register tiles), an elementwise kernel after a contraction (right
after it, or past kernels independent of it) that reads its product at the cell each
iteration writes runs on each output tile, in the contraction's kernel; anything else stays
apart. The values of every case are checked
against the reference by the catalog (``epilogue.*``) on every backend; here, which kernels
merge."""

from __future__ import annotations

import numpy as np
import pytest
from catalog_check import backend_or_skip, kernel_comments

from polyjit.core import ir
from polyjit.core.errors import InvalidProgramError
from polyjit.core.fusion import _onto
from polyjit.core.ir import Symbol
from polyjit.testing.programs import by_name


@pytest.mark.parametrize("dt", ["float32", "float64"])
@pytest.mark.parametrize(("program", "kernels"), [
    ("epilogue.bias_relu", 1),  # bias and relu on each tile; the product is stored too
    ("epilogue.update_in_place", 2),  # momentum on each tile; the weight's update reads it after
    ("epilogue.update_after_other_gradients", 4),  # the momentum moves up past independent kernels
    ("epilogue.update_behind_a_reader", 2),  # a kernel between reads the weight: it moves up
    ("epilogue.update_behind_a_dependent_reader", 3),  # ... and reads the product: all apart
    ("epilogue.batched_bias", 1),  # a batched product
    ("epilogue.relu_mask", 1),  # a relu's backward mask (where) on the product
    ("epilogue.consumer_writes_operand", 2),  # later tiles read the operand: apart
    ("epilogue.transposed_read", 2),  # the consumer reads another tile's cells: apart
])
def test_which_consumers_run_on_the_tiles(program: str, kernels: int, dt: str) -> None:
    comments = kernel_comments("cpu", f"{program}.{dt}")
    assert len(comments) == kernels, comments
    if kernels == 1 or program in ("epilogue.update_in_place", "epilogue.update_after_other_gradients"):
        assert "add= mul; " in comments[0]  # the product's kernel carries its consumer
    if program == "epilogue.update_behind_a_reader":  # the reader first, then the product and update
        assert "add= id" in comments[0] and "add= mul; " in comments[1], comments
    if program == "epilogue.update_behind_a_dependent_reader":
        assert all("add= mul; " not in c for c in comments), comments


def test_the_epilogue_runs_inside_the_tile_kernel() -> None:
    p = by_name("epilogue.bias_relu.float32")
    text = backend_or_skip("cpu").compile(p.comps[0], name="epi").source
    assert text.count("void epi_") == 1 and "pj_er" in text and "pj_vec acc" in text


def test_other_dialects_keep_their_tiles_and_no_epilogue() -> None:
    """OpenCL tiles contractions without epilogues: its kernels stay as they were."""
    assert len(kernel_comments("opencl", "epilogue.bias_relu.float32")) == 2


def test_a_merged_nest_is_written_in_the_contraction_symbols() -> None:
    i, j, k, f = Symbol("i"), Symbol("j"), Symbol("k"), Symbol("f")
    env = _onto(((f, 12),), ((i, 3), (j, 4)))
    assert env == {f: ir.affine((4, i), (1, j))}
    env = _onto(((k, 2), (f, 12)), ((k, 2), (i, 3), (j, 4)))
    assert env is not None and env[f] == ir.affine((4, i), (1, j)) and env[k] == ir.as_affine(k)
    assert _onto(((f, 12),), ((i, 4), (j, 4))) is None  # other extents
    assert _onto(((f, 6), (k, 2)), ((i, 3), (j, 4))) is None  # runs that do not line up


# -- private sums (core/fusion.py private_sums) --------------------------------------------


@pytest.mark.parametrize(("program", "private"), [
    ("epilogue.update_in_place.float32", ["g"]),  # the gradient: only the momentum update reads it
    ("epilogue.relu_mask.float32", ["mc"]),
    ("fusion.matmul_bias_relu", ["mm"]),
    ("epilogue.bias_relu.float32", []),  # the product is kept (ON_DEVICE)
    ("epilogue.sum_read_again.float64", []),  # a row sum reads the product too
    ("epilogue.sum_read_by_next_comp.float32", []),  # ... in the next computation
    ("rows.joins_past_independent.float32", []),  # a row group starts with a sum (its max): no tile
    ("rows.waits_for_what_runs_between.float64", []),
])
def test_which_sums_stay_in_the_tiles(program: str, private: list[str]) -> None:
    """A contraction's sum that is scratch and that only its epilogue reads is private to its
    kernel; anything else that reads it, in the batch, or after it, keeps it stored."""
    p = by_name(program)
    batch = backend_or_skip("cpu").compile_batch(list(p.comps), names=[f"c{k}" for k in range(len(p.comps))])
    assert [n.name for k in batch.lowered.kernels for n in k.private] == private


def test_a_private_sum_is_never_stored() -> None:
    """The tiles hand the epilogue the sums from a local array: the sum's buffer (the kernel's
    first, b0) is never written. The values are the reference's (the catalog, every backend)."""
    p = by_name("epilogue.update_in_place.float32")
    text = backend_or_skip("cpu").compile(p.comps[0], name="epi").source
    tile_kernel = text[text.index("void epi_0("):]
    tile_kernel = tile_kernel[:tile_kernel.index("\n}\n")]
    assert "pj_cell[pj_er][pj_ec]" in tile_kernel and "&b0[" not in tile_kernel and "b0[" not in tile_kernel.replace(
        "pj_bufs[0]", "")


def test_a_context_holding_a_private_sum_refuses_the_link() -> None:
    """A sum kept in the kernel never reaches memory: a context that holds its node (and would
    show a stale value after the run) gets a clear error, and stays usable."""
    backend = backend_or_skip("cpu")
    a, d, g, m = (ir.Node(nm, shape) for nm, shape in (("a", (30, 14)), ("d", (30, 50)), ("g", (14, 50)),
                                                     ("m", (14, 50))))
    comp = ir.Comp.of(ir.einsum("ki,kj->ij", a, d, into=g), ir.apply(ir.Op.ADD, m, g, into=m))
    code = backend.compile(comp, name="upd")
    assert [n.name for k in code.batch.lowered.kernels for n in k.private] == ["g"]
    ctx = backend.get_device(0).make_context()
    for n in (a, d, m):
        ctx = ctx.init_from_host(n, np.ones(n.shape, np.float32))
    held = ctx.init_from_host(g, np.zeros(g.shape, np.float32))
    with pytest.raises(InvalidProgramError, match=r"keeps g#\d+ inside a kernel.*mark it ON_DEVICE"):
        held.link(code)
    routine = ctx.link(code)  # without g in the context it links, and runs
    routine.run()
    np.testing.assert_allclose(routine.context.read(m), np.full(m.shape, 31, np.float32))


def test_a_context_holding_an_inlined_node_refuses_the_link() -> None:
    """The same for a VIRTUAL node (inlined into its reader, never stored): before, the
    context's buffer of it silently kept its old value."""
    backend = backend_or_skip("cpu")
    a, v, o = ir.Node("a", (4, 4)), ir.Node("v", (4, 4)), ir.Node("o", (4, 4))
    comp = ir.Comp.of(ir.apply(ir.Op.MUL, a, 2.0, into=v), ir.apply(ir.Op.ADD, v, 1.0, into=o), embedded=[o])
    code = backend.compile(comp, name="vv")
    ctx = backend.get_device(0).make_context().init_from_host(a, np.ones((4, 4), np.float32))
    with pytest.raises(InvalidProgramError, match=r"inlines v#\d+ .*mark it ON_DEVICE"):
        ctx.init_from_host(v, np.zeros((4, 4), np.float32)).link(code)
    routine = ctx.link(code)
    routine.run()
    np.testing.assert_array_equal(routine.context.read(o), np.full((4, 4), 3, np.float32))
