"""Horizontal fusion (core/fusion.py): elementwise kernels over one iteration space merge
into one kernel when every value one reads of another's is its own iteration's; the results
equal the reference on the CPU and OpenCL backends, and unsafe groups stay apart."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from catalog_check import check_program
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polyjit.backends.cuda.dialect import CudaDialect
from polyjit.backends.opencl import OpenCLDialect
from polyjit.core import dtypes, fusion, ir
from polyjit.core.codegen import Dialect, generate
from polyjit.core.ir import AccumOp, Node, Op, Symbol
from polyjit.core.loops import Kernel, Seq, Store
from polyjit.core.lower import lower
from polyjit.testing.programs import CatalogProgram
from polyjit.testing.strategies import elementwise_programs

Array = np.ndarray[Any, Any]
BACKENDS = ("cpu", "opencl")



def _kernels(comps: Sequence[ir.Comp], horizontal: bool = True) -> list[Kernel]:
    return lower(list(comps), [f"c{k}" for k in range(len(comps))], horizontal=horizontal).kernels


def _uniform(lo: float, hi: float, shape: tuple[int, ...], dt: str = "float32") -> Callable[..., Array]:
    return lambda rng: rng.uniform(lo, hi, shape).astype(dt)



def _reversed(into: Node, source: Node) -> ir.Accum:
    """``into[i] = source[n - 1 - i]`` (1-D)."""
    (n,) = into.shape
    i = Symbol("i")
    return ir.Accum(into, None, Op.ID, (source,),
                    ir.projections([(i, n)], [i], [ir.affine((-1, i), const=n - 1)]))


# ---------------------------------------------------------------------------
# AdamW-like programs: several elementwise outputs of one shape


def _adamw(shape: tuple[int, ...], name: str, lr: Node, scale: Node) -> tuple[list[ir.Assignment], list[Node]]:
    """The three updates of one parameter: m, v in place from g, then w from m and v."""
    w, g, m, v = (Node(f"{name}.{k}", shape) for k in ("w", "g", "m", "v"))
    t = [Node(f"{name}.t{k}", shape) for k in range(8)]
    out = [
        ir.apply(Op.MUL, m, 0.9, into=t[0]), ir.apply(Op.MUL, g, 0.1, into=t[1]),
        ir.apply(Op.ADD, t[0], t[1], into=m),
        ir.apply(Op.MUL, v, 0.99, into=t[2]), ir.apply(Op.MUL, g, g, into=t[3]),
        ir.apply(Op.MUL, t[3], 0.01, into=t[4]), ir.apply(Op.ADD, t[2], t[4], into=v),
        ir.apply(Op.SQRT, v, into=t[5]), ir.apply(Op.ADD, t[5], scale, into=t[6]),
        ir.apply(Op.DIV, m, t[6], into=t[7]),
    ]
    upd = Node(f"{name}.u", shape)
    out += [ir.apply(Op.MUL, t[7], lr, into=upd), ir.apply(Op.SUB, w, upd, into=w)]
    return out, [w, g, m, v]


def _adamw_program(shapes: Sequence[tuple[int, ...]]) -> tuple[CatalogProgram, ir.Comp]:
    step, lr, scale = Node("step", ()), Node("lr", ()), Node("scale", ())
    # scalars between the moments and the weights (as the tensor front end orders them)
    assignments: list[ir.Assignment] = [ir.apply(Op.ADD, step, 1.0, into=step)]
    inputs: list[tuple[Node, Any]] = [(step, lambda rng: np.zeros((), np.float32))]
    outputs: list[Node] = [step]
    for k, shape in enumerate(shapes):
        ups, (w, g, m, v) = _adamw(shape, f"p{k}", lr, scale)
        if k == 0:  # lr and scale from the step, written after the first moments
            ups = ups[:7] + [ir.apply(Op.MUL, step, 0.001, into=lr), ir.apply(Op.ADD, step, 1e-3, into=scale),
                             *ups[7:]]
        assignments += ups
        inputs += [(w, _uniform(-1, 1, shape)), (g, _uniform(-1, 1, shape)),
                   (m, _uniform(-0.1, 0.1, shape)), (v, _uniform(0, 0.1, shape))]
        outputs += [w, m, v]
    comp = ir.Comp.of(*assignments, embedded=[*outputs, lr, scale])
    program = CatalogProgram("fusion.adamw", (comp,), tuple(inputs), (*outputs, lr, scale),
                             runs=({}, {}, {}), rtol=1e-5, atol=1e-6)
    return program, comp


def test_adamw_updates_fuse_into_one_kernel_per_parameter() -> None:
    _, comp = _adamw_program([(64,), (8, 16), (3,)])
    unfused, fused = _kernels([comp], horizontal=False), _kernels([comp])
    # step, lr, scale: one serial kernel; then one kernel of m, v and w per parameter
    assert len(unfused) == 1 + 2 + 3 * 3
    assert len(fused) == 1 + 3
    assert all(isinstance(k.body, Seq) and len(k.body.body) == 3 for k in fused)  # step, lr, scale too
    for k in fused:  # each fused kernel writes m and v before w reads them
        if isinstance(k.body, Seq) and k.parallel:
            labels = [st.node.name for st in k.body.body if isinstance(st, Store)]
            assert [x.split(".")[1] for x in labels] == ["m", "v", "w"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_adamw_like_program_matches_the_reference(backend: str) -> None:
    program, _ = _adamw_program([(64,), (8, 16), (3,), (1000,)])
    check_program(program, backend)


@pytest.mark.parametrize("dialect", [Dialect(), OpenCLDialect(), CudaDialect()], ids=lambda d: d.name)
def test_every_dialect_writes_the_fused_stores_in_order(dialect: Dialect) -> None:
    _, comp = _adamw_program([(64,)])
    text = generate(lower([comp], ["adam"]), dialect).text
    body = text[text.index("p0.m"):]
    assert body.index("p0.v") < body.index("p0.w")  # the comment names them in order
    assert text.count("sqrt") >= 1


def test_kernels_with_a_dependent_kernel_between_do_not_fuse_across_it() -> None:
    """y and z share a shape, but z reads s, a reduction of y: z cannot move up past it, nor
    y down past it."""
    n = 32
    x, y, z, s = Node("x", (n,)), Node("y", (n,)), Node("z", (n,)), Node("s", ())
    comp = ir.Comp.of(ir.apply(Op.MUL, x, 2.0, into=y), ir.einsum("i->", y, into=s),
                      ir.apply(Op.ADD, y, s, into=z), embedded=[y, s, z])
    kernels = _kernels([comp])
    assert len(kernels) == 3 and not any(isinstance(k.body, Seq) for k in kernels)
    program = CatalogProgram("fusion.reduction_between", (comp,), ((x, _uniform(-1, 1, (n,))),), (y, s, z),
                             rtol=1e-5, atol=1e-5)
    for backend in BACKENDS:
        check_program(program, backend)


def test_independent_kernels_between_are_passed() -> None:
    """A scalar kernel between the moments and the weight does not keep them apart."""
    n = 16
    x, y, c, z = Node("x", (n,)), Node("y", (n,)), Node("c", ()), Node("z", (n,))
    comp = ir.Comp.of(ir.apply(Op.MUL, x, 2.0, into=y), ir.apply(Op.ADD, c, 1.0, into=c),
                      ir.apply(Op.ADD, y, c, into=z), embedded=[y, c, z])
    kernels = _kernels([comp])
    assert len(kernels) == 2
    assert [type(k.body) for k in kernels] == [Store, Seq]  # c first: z reads it
    program = CatalogProgram("fusion.passed", (comp,), ((x, _uniform(-1, 1, (n,))), (c, _uniform(0, 1, ()))),
                             (y, c, z), runs=({}, {}), rtol=1e-6, atol=1e-6)
    for backend in BACKENDS:
        check_program(program, backend)


# ---------------------------------------------------------------------------
# Unsafe groups stay apart


def test_a_reversed_read_of_an_earlier_output_is_not_fused() -> None:
    n = 33
    x, y, z = Node("x", (n,)), Node("y", (n,)), Node("z", (n,))
    comp = ir.Comp.of(ir.apply(Op.MUL, x, 2.0, into=y), _reversed(z, y), embedded=[y, z])
    assert len(_kernels([comp])) == 2
    program = CatalogProgram("fusion.reversed", (comp,), ((x, _uniform(-1, 1, (n,))),), (y, z))
    for backend in BACKENDS:
        check_program(program, backend)


def test_a_write_over_what_an_earlier_kernel_reads_elsewhere_is_not_fused() -> None:
    """z reads x reversed, then x is updated in place: fused, late iterations would read
    updated values."""
    n = 64
    x, z = Node("x", (n,)), Node("z", (n,))
    comp = ir.Comp.of(_reversed(z, x), ir.apply(Op.ADD, x, 1.0, into=x), embedded=[x, z])
    assert len(_kernels([comp])) == 2
    program = CatalogProgram("fusion.war", (comp,), ((x, _uniform(-1, 1, (n,))),), (x, z), runs=({}, {}))
    for backend in BACKENDS:
        check_program(program, backend)


def test_a_transposed_read_of_an_earlier_output_is_not_fused() -> None:
    x, y, z = Node("x", (8, 8)), Node("y", (8, 8)), Node("z", (8, 8))
    comp = ir.Comp.of(ir.apply(Op.MUL, x, 2.0, into=y), ir.einsum("ij->ji", y, into=z),
                      ir.apply(Op.ADD, z, 1.0, into=z, accum=None), embedded=[y, z])
    kernels = _kernels([comp])
    for k in kernels:  # z's kernels may fuse with each other, never with y's
        written = {n.name for n in k.outputs}
        assert written in ({"y"}, {"z"})
    program = CatalogProgram("fusion.transposed", (comp,), ((x, _uniform(-1, 1, (8, 8))),), (y, z))
    for backend in BACKENDS:
        check_program(program, backend)


def test_reductions_and_scratch_chains_are_not_fused() -> None:
    n = 16
    x, a, b, y = Node("x", (4, n)), Node("a", (4,)), Node("b", (4,)), Node("y", (4,))
    t = Node("t", (4,))  # scratch read twice: LOCAL, its space reusable
    comp = ir.Comp.of(ir.einsum("ij->i", x, into=a), ir.einsum("ij->i", x, into=b, accum=AccumOp.MAX),
                      ir.apply(Op.ADD, a, b, into=t), ir.apply(Op.MUL, t, t, into=y), embedded=[a, b, y])
    kernels = _kernels([comp])
    assert not any(isinstance(k.body, Seq) for k in kernels)
    assert len(kernels) == 4


# ---------------------------------------------------------------------------
# Random programs against the reference


@st.composite
def pointwise_state_programs(draw: st.DrawFn) -> CatalogProgram:
    """Steps over nodes of one shape: each writes a new node or updates a state node in
    place from nodes written before (read pointwise, sometimes reversed along the first axis,
    sometimes broadcast from a row), shared reads everywhere."""
    shape = draw(st.sampled_from([(5,), (7,), (3, 4), (2, 3, 2)]))
    dt = draw(st.sampled_from([dtypes.float32, dtypes.int32, dtypes.float64]))
    gen = (lambda rng: rng.integers(-50, 50, shape).astype(dt.np)) if not dt.is_float else _uniform(-1, 1, shape, dt.name)
    nodes = [Node(f"s{k}", shape, dt) for k in range(draw(st.integers(1, 3)))]
    row = Node("row", shape[1:], dt) if len(shape) > 1 else None
    inputs: list[tuple[Node, Any]] = [(n, gen) for n in nodes]
    if row is not None:
        inputs.append((row, lambda rng: np.ones(row.shape, dt.np)))
    assignments: list[ir.Assignment] = []
    for step in range(draw(st.integers(2, 7))):
        op = draw(st.sampled_from([Op.ADD, Op.SUB, Op.MAX, Op.MIN]))
        a = draw(st.sampled_from(nodes))
        b: Node = draw(st.sampled_from(nodes + ([row] if row is not None else [])))
        target = draw(st.sampled_from([*nodes, None]))
        if target is None:
            target = Node(f"o{step}", shape, dt)
            nodes.append(target)
        if len(shape) == 1 and b is not a and draw(st.booleans()):  # b reversed into a stored copy first
            flipped = Node(f"r{step}", shape, dt)
            assignments.append(_reversed(flipped, b))
            nodes.append(flipped)
            b = flipped
        assignments.append(ir.apply(op, a, b, into=target))
    written = {ir.writes(leaf) for a in assignments for leaf in ir.flatten(a)}
    comp = ir.Comp.of(*assignments, embedded=written)
    outs = tuple(n for n in nodes if n in written)
    return CatalogProgram("fusion.hypothesis", (comp,), tuple(inputs), outs, runs=({}, {}),
                          rtol=1e-5, atol=1e-5, description=str(assignments))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=pointwise_state_programs())
def test_random_pointwise_state_programs_match_the_reference(backend: str, program: CatalogProgram) -> None:
    fused = _kernels(program.comps)
    assert len(fused) <= len(_kernels(program.comps, horizontal=False))
    check_program(program, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=elementwise_programs())
def test_random_elementwise_programs_match_the_reference(backend: str, program: CatalogProgram) -> None:
    check_program(program, backend)


def test_fusion_never_groups_kernels_of_different_spaces_or_beyond_the_cap() -> None:
    x = Node("x", (4,))
    outs = [Node(f"y{k}", (4,)) for k in range(fusion.MAX_STATEMENTS + 3)]
    other = Node("z", (5,))
    comp = ir.Comp.of(*(ir.apply(Op.ADD, x, float(k), into=y) for k, y in enumerate(outs)),
                      ir.apply(Op.ID, 1.0, into=other), embedded=[*outs, other])
    kernels = _kernels([comp])
    assert [len(k.body.body) if isinstance(k.body, Seq) else 1 for k in kernels] == [fusion.MAX_STATEMENTS, 3, 1]


def test_a_fused_c_kernel_reads_its_scalars_once_before_the_loop() -> None:
    """GCC 12 leaves a loop that stores to several arrays and reads two scalars unvectorized
    (AdamW fused: 15% slower on char_lm), so the C emitter reads constant-index loads of nodes
    the kernel does not write into locals before the loop."""
    _, comp = _adamw_program([(64,)])
    text = generate(lower([comp], ["adam"]), Dialect()).text
    fused = text[text.index("p0.m"):]
    fused = fused[: fused.index("\n}\n")]
    loop = fused[fused.index("for ("):]
    assert "pj_inv0" in fused[: fused.index("for (")]  # declared before the loop
    assert "pj_inv0" in loop and "[0]" not in loop  # the loop reads the locals only
