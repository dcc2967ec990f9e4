"""Reshapes as views (core/lower.py): a reshape only renames indices, so every reader loads
its source at the same flat index and no copy kernel runs, however many readers it has,
unless the source changes before a read. Results equal the reference on cpu and OpenCL."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from catalog_check import check_program

from polyjit.core import ir
from polyjit.core.ir import MemoryMode, Node, Op
from polyjit.core.loops import Kernel, Load, walk_exprs
from polyjit.core.lower import infer_modes, lower
from polyjit.testing.programs import CatalogProgram

Array = np.ndarray[Any, Any]
BACKENDS = ("cpu", "opencl")



def _uniform(shape: tuple[int, ...]) -> Callable[..., Array]:
    return lambda rng: rng.uniform(-1, 1, shape).astype("float32")


def _kernels(comp: ir.Comp) -> list[Kernel]:
    return list(lower([comp], ["c0"]).kernels)



def _copies(kernels: list[Kernel]) -> list[Kernel]:
    return [k for k in kernels if "reshape" in k.comment]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_reshape_read_twice_is_a_view(backend: str) -> None:
    """r = x viewed as 4 x 6, read by a transpose-free product and a row sum: no copy."""
    x, r = Node("x", (24,)), Node("r", (4, 6))
    y, s = Node("y", (4, 6)), Node("s", (4,))
    comp = ir.Comp.of(ir.reshape(r, x), ir.apply(Op.MUL, r, 3.0, into=y), ir.einsum("ij->i", r, into=s),
                      embedded=[y, s])
    assert infer_modes([comp]).modes[r] is MemoryMode.VIRTUAL
    kernels = _kernels(comp)
    assert not _copies(kernels)
    loaded = {e.node for k in kernels for e in walk_exprs(k.body) if isinstance(e, Load)}
    assert loaded == {x}
    check_program(CatalogProgram("views.twice", (comp,), ((x, _uniform((24,))),), (y, s)), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_reshape_of_a_reshape_is_a_view_of_the_first_source(backend: str) -> None:
    """The embedding's chain: a matmul's rows regrouped twice, then read by a contraction
    and an elementwise kernel."""
    a, b = Node("a", (8, 3)), Node("b", (3, 4))
    m, r1, r2 = Node("m", (8, 4)), Node("r1", (2, 4, 4)), Node("r2", (2, 16))
    w, out, z = Node("w", (16, 5)), Node("out", (2, 5)), Node("z", (2, 16))
    comp = ir.Comp.of(ir.einsum("ik,kj->ij", a, b, into=m), ir.reshape(r1, m), ir.reshape(r2, r1),
                      ir.einsum("ik,kj->ij", r2, w, into=out), ir.apply(Op.TANH, r2, into=z),
                      embedded=[out, z])
    kernels = _kernels(comp)
    assert not _copies(kernels)
    inputs = ((a, _uniform((8, 3))), (b, _uniform((3, 4))), (w, _uniform((16, 5))))
    check_program(CatalogProgram("views.chain", (comp,), inputs, (out, z), rtol=1e-5, atol=1e-5), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_reshape_whose_source_changes_before_a_read_stays_a_copy(backend: str) -> None:
    """x changes in place between the reshape and its second reader: that reader must see
    the old values, so the reshape is copied."""
    x, r = Node("x", (12,)), Node("r", (3, 4))
    y, z = Node("y", (3, 4)), Node("z", (3, 4))
    comp = ir.Comp.of(ir.reshape(r, x), ir.apply(Op.NEG, r, into=y), ir.apply(Op.ADD, x, 1.0, into=x),
                      ir.apply(Op.MUL, r, 2.0, into=z), embedded=[x, y, z])
    inference = infer_modes([comp])
    assert inference.modes[r] is MemoryMode.LOCAL
    assert "changes before a read" in inference.why_not[r]
    assert _copies(_kernels(comp))
    program = CatalogProgram("views.changed", (comp,), ((x, _uniform((12,))),), (x, y, z), runs=({}, {}))
    check_program(program, backend)


def test_a_reshape_read_by_another_computation_stays_a_buffer() -> None:
    x, r, y = Node("x", (6,)), Node("r", (2, 3)), Node("y", (2, 3))
    first = ir.Comp.of(ir.reshape(r, x), embedded=[])
    second = ir.Comp.of(ir.apply(Op.NEG, r, into=y))
    inference = infer_modes([first, second])
    assert inference.modes[r] is not MemoryMode.VIRTUAL


# ---------------------------------------------------------------------------
# Chains: an inlined node is computed where it is finally used, from the stored nodes at the
# end of its chain (found by a hostile review: each case gave wrong values)


def _transpose(into: Node, source: Node) -> ir.Accum:
    return ir.einsum("ij->ji", source, into=into)


CHAINS = {
    # r2's readers load x: x changes between r2 and its reader
    "chain_changed": lambda x, n: ([ir.reshape(r1 := Node("r1", (n, n)), x), ir.reshape(r2 := Node("r2", (n * n,)), r1),
                                    ir.apply(Op.ADD, x, 1.0, into=x), ir.apply(Op.MUL, r2, 2.0, into=Node("z", (n * n,)))]),
    # t is inlined into y, after x changed; r has a second reader, so it is a view
    "reader_inlined_later": lambda x, n: ([ir.reshape(r := Node("r", (n * n,)), x), ir.apply(Op.MUL, r, 2.0, into=(t := Node("t", (n * n,)))),
                                           ir.apply(Op.ADD, r, 1.0, into=Node("z", (n * n,))), ir.apply(Op.ADD, x, 1.0, into=x),
                                           ir.apply(Op.NEG, t, into=Node("y", (n * n,)))]),
    # x = (2 x)^T through a view and an inlined node: one kernel would read x[j, i] and write x[i, j]
    "transposed_in_place": lambda x, n: ([ir.reshape(r := Node("r", (n, n)), x), ir.apply(Op.ADD, r, 1.0, into=Node("z", (n, n))),
                                          ir.apply(Op.MUL, r, 2.0, into=(t := Node("t", (n, n)))), _transpose(x, t)]),
    # the same through two reshapes
    "chain_transposed_in_place": lambda x, n: ([ir.reshape(r1 := Node("r1", (n * n,)), x), ir.reshape(r2 := Node("r2", (n, n)), r1),
                                                _transpose(x, r2)]),
    # without views: a = exp(x) inlined into b, b inlined into y, x changed in between
    "elementwise_chain": lambda x, n: ([ir.apply(Op.EXP, x, into=(a := Node("a", (n, n)))), ir.apply(Op.MUL, a, 2.0, into=(b := Node("b", (n, n)))),
                                        ir.apply(Op.ADD, x, 1.0, into=x), ir.apply(Op.NEG, b, into=Node("y", (n, n)))]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CHAINS))
def test_inlined_chains_see_the_values_of_their_sources_at_their_writer(case: str, backend: str) -> None:
    n = 8
    x = Node("x", (n, n))
    leaves = CHAINS[case](x, n)
    results = [x] + [ir.writes(leaf) for leaf in leaves if ir.writes(leaf).name in ("y", "z")]
    comp = ir.Comp.of(*leaves, embedded=list(dict.fromkeys(results)))
    program = CatalogProgram(f"views.{case}", (comp,), ((x, _uniform((n, n))),), tuple(dict.fromkeys(results)),
                             runs=({}, {}))
    check_program(program, backend)
