"""Epilogue fusion (core/fusion.py ``fuse_epilogues``): on a dialect that tiles contractions
with an epilogue (the CPU's register tiles), an elementwise kernel right after a contraction
that reads its product at the cell each iteration writes runs on each output tile, in the
contraction's kernel; anything else stays apart. The values of every case are checked
against the reference by the catalog (``epilogue.*``) on every backend; here, which kernels
merge."""

from __future__ import annotations

import pytest
from catalog_check import backend_or_skip, kernel_comments

from polyjit.core import ir
from polyjit.core.fusion import _onto
from polyjit.core.ir import Symbol
from polyjit.testing.programs import by_name


@pytest.mark.parametrize("dt", ["float32", "float64"])
@pytest.mark.parametrize(("program", "kernels"), [
    ("epilogue.bias_relu", 1),  # bias and relu on each tile; the product is stored too
    ("epilogue.update_in_place", 2),  # momentum on each tile; the weight's update reads it after
    ("epilogue.batched_bias", 1),  # a batched product
    ("epilogue.relu_mask", 1),  # a relu's backward mask (where) on the product
    ("epilogue.consumer_writes_operand", 2),  # later tiles read the operand: apart
    ("epilogue.transposed_read", 2),  # the consumer reads another tile's cells: apart
])
def test_which_consumers_run_on_the_tiles(program: str, kernels: int, dt: str) -> None:
    comments = kernel_comments("cpu", f"{program}.{dt}")
    assert len(comments) == kernels, comments
    if kernels == 1 or program == "epilogue.update_in_place":
        assert "add= mul; " in comments[0]  # the product's kernel carries its consumer


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
