"""Checks of what routines compute: the catalog and random programs against the reference
interpreter, routines and batches, static bindings."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from polyjit.core import ir
from polyjit.core.errors import BindingError
from polyjit.core.ir import Op, StaticSymbol
from polyjit.core.reference import run_reference
from polyjit.core.runtime import Backend
from polyjit.testing.checks.common import (
    SLOW_RUNS,
    CheckSkipped,
    assert_equal,
    assert_usable,
    expect,
    f32,
    finalizing,
    note,
    require_devices,
    slow_accumulate,
    small_ints,
)
from polyjit.testing.harness import run_programs, unsupported_reason
from polyjit.testing.programs import CatalogProgram, catalog
from polyjit.testing.programs import half as half_programs
from polyjit.testing.programs import nan as nan_programs

# ---------------------------------------------------------------------------
# Programs against the reference


HYPOTHESIS_EXAMPLES = int(os.environ.get("POLYJIT_HYPOTHESIS_EXAMPLES", "25") or 25)


def check_catalog_programs(backend: Backend) -> None:
    """Every program of the catalog (polyjit.testing.programs) matches the reference interpreter.
    On a device whose property ``fp64`` is False, the programs whose kernels compute in float64
    are left out, and a KitNote says how many and why."""
    require_devices(backend, 1)
    dev = backend.get_device(0)
    progs = catalog()
    reasons = {p.name: unsupported_reason(dev.properties, p) for p in progs}
    runnable = [p for p in progs if reasons[p.name] is None]
    skipped = _skip_summary(reasons, len(progs), f"catalog programs on {dev.label}")
    if not runnable:
        raise CheckSkipped(skipped or f"no catalog program can run on {dev.label}")
    failures = run_programs(backend, runnable, batch_size=100)
    if failures:
        names = sorted({f.program for f in failures})
        shown = "\n\n".join(str(f) for f in failures[:12])
        more = f"\n... and {len(failures) - 12} more" if len(failures) > 12 else ""
        left = f" ({skipped})" if skipped else ""
        raise AssertionError(f"{len(names)} of {len(runnable)} programs differ from the reference{left}: "
                             f"{', '.join(names)}\n\n{shown}{more}")
    if skipped:
        note(skipped)


def check_half_special_values(backend: Backend) -> None:
    """float16 and bfloat16 stores and ops on hostile values (NaN, +-inf, +-0, overflow to inf,
    subnormals, values that vanish, exact ties between two halves) give exactly the reference's
    values, which are numpy's and ml_dtypes' conversions (round to nearest even)."""
    _all_match(backend, half_programs.hostile(), "half-type")


def check_nan_propagation(backend: Backend) -> None:
    """max, min and relu, elementwise and in every kind of reduction, are NaN where an operand
    is (numpy's ``maximum`` and ``max``), exactly as the reference computes them: a kernel
    spelled ``a > b ? a : b``, or a parallel reduction combined by the compiler's own max,
    drops a NaN and hides a diverged model behind finite values. Over +0 and -0: elementwise,
    ``b`` where equal; a reduction exact but for its zero's sign, which is the backend's."""
    _all_match(backend, nan_programs.nan_programs() + nan_programs.signed_zero_programs(), "NaN and signed-zero")


def _all_match(backend: Backend, progs: list[CatalogProgram], what: str) -> None:
    """Run a set of programs kept apart from the catalog; raise naming those that differ."""
    require_devices(backend, 1)
    failures = run_programs(backend, progs)
    if failures:
        raise AssertionError(f"{len({f.program for f in failures})} of {len(progs)} {what} programs differ "
                             "from the reference:\n\n" + "\n\n".join(str(f) for f in failures[:6]))


def _skip_summary(reasons: dict[str, str | None], total: int, what: str) -> str:
    """'N of M <what> skipped: <reason>' per reason, or '' when nothing was skipped."""
    by_reason: dict[str, int] = {}
    for reason in reasons.values():
        if reason is not None:
            by_reason[reason] = by_reason.get(reason, 0) + 1
    return "; ".join(f"{n} of {total} {what} skipped: {reason}" for reason, n in by_reason.items())


def _hypothesis_check(backend: Backend, strategy_name: str) -> None:
    try:
        from hypothesis import HealthCheck, given, settings
        from hypothesis import strategies as st

        from polyjit.testing import strategies
    except ImportError as e:  # pragma: no cover - hypothesis is a dev dependency
        raise CheckSkipped(f"hypothesis is not installed ({e})") from e
    require_devices(backend, 1)
    strategy = getattr(strategies, strategy_name)()
    properties = backend.get_device(0).properties
    reasons: dict[str, str | None] = {}

    @settings(max_examples=HYPOTHESIS_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy, st.integers(0, 2**32 - 1))
    def run(program: Any, seed: int) -> None:
        reason = reasons[f"{len(reasons)}"] = unsupported_reason(properties, program)
        if reason is not None:  # float64 on a device without fp64: not this device's failure
            return
        failures = run_programs(backend, [program], seed=seed)
        if failures:
            raise AssertionError("\n".join(str(f) for f in failures))

    run()
    skipped = _skip_summary(reasons, len(reasons), f"generated {strategy_name}")
    if skipped and all(r is not None for r in reasons.values()):
        raise CheckSkipped(skipped)
    if skipped:
        note(skipped)


def check_random_elementwise_programs(backend: Backend) -> None:
    """Hypothesis: random DAGs of elementwise ops (dtypes, broadcasting, casts) match the reference."""
    _hypothesis_check(backend, "elementwise_programs")


def check_random_einsum_programs(backend: Backend) -> None:
    """Hypothesis: random einsums (every AccumOp, with and without init_neutral) match the reference."""
    _hypothesis_check(backend, "einsum_programs")


def check_random_matmul_programs(backend: Backend) -> None:
    """Hypothesis: matmuls of sizes that cut every kind of tile edge match the reference."""
    _hypothesis_check(backend, "matmul_programs")


def check_random_gather_programs(backend: Backend) -> None:
    """Hypothesis: gathers and scatter-adds (rows picked by data, some out of range) match the reference."""
    _hypothesis_check(backend, "gather_programs")


def check_random_affine_programs(backend: Backend) -> None:
    """Hypothesis: random affine projections (strides, offsets, repeated writes) match the reference."""
    _hypothesis_check(backend, "affine_programs")


# ---------------------------------------------------------------------------
# Routines and batches


def check_routines_and_batches(backend: Backend) -> None:
    """Routine metadata; compile_batch with names and occupancy; link_batch shares one context."""
    require_devices(backend, 1)
    dev = backend.get_device(0)
    a, b, s, p = f32("rb_a", (6,)), f32("rb_b", (6,)), f32("rb_s", (6,)), f32("rb_p", ())
    sum_comp = ir.Comp.of(ir.apply(Op.ADD, a, b, into=s))
    dot_comp = ir.Comp.of(ir.einsum("i,i->", a, s, into=p))
    skipped = ir.Comp.of(ir.apply(Op.NEG, a, into=f32("rb_unused", (6,))))
    batch = backend.compile_batch([sum_comp, skipped, dot_comp], names=["sum", "skipped", "dot"],
                                  occupancy=lambda name: name != "skipped")
    rng = np.random.default_rng(3)
    av, bv = small_ints(rng, (6,)), small_ints(rng, (6,))
    ctx = dev.make_context().init_from_host(a, av).init_from_host(b, bv)
    with finalizing(ctx):
        routines = ctx.link_batch(batch)
        if len(routines) != 2:
            raise AssertionError(f"occupancy left out one computation of three: expected 2 routines, got {len(routines)}")
        r_sum, r_dot = routines
        if r_sum.inputs != frozenset({a, b}) or r_sum.outputs != frozenset({s}):
            raise AssertionError(f"sum routine: inputs {set(r_sum.inputs)} outputs {set(r_sum.outputs)}, "
                                 f"expected inputs {{a, b}} and outputs {{s}}")
        if r_dot.outputs != frozenset({p}) or r_sum.merge_buffer_input is not None:
            raise AssertionError(f"dot routine: outputs {set(r_dot.outputs)}, expected {{p}}")
        if r_sum.context is not r_dot.context:
            raise AssertionError("the routines of one link_batch must share one child context")
        if ctx.buffers.keys() - r_sum.context.buffers.keys():
            raise AssertionError("the child context must hold every buffer of its parent")
        if s in ctx.buffers:
            raise AssertionError("linking must not change the parent context (contexts never change)")
        r_sum.run()
        r_dot.run()
        want = run_reference([sum_comp, dot_comp], {a: av, b: bv})
        assert_equal(s.label, r_sum.context.read(s), want[s])
        assert_equal(p.label, r_dot.context.read(p), want[p])
        # Backend.compile of one computation links with Context.link
        code = backend.compile(dot_comp, name="dot_again")
        r2 = r_sum.context.link(code)
        r2.run()
        assert_equal(f"{p.label} (Backend.compile)", r2.context.read(p), want[p])


# ---------------------------------------------------------------------------
# Static bindings


def check_static_bindings(backend: Backend) -> None:
    """routine.bindings are read when run() enqueues; unbound or out-of-range values raise BindingError."""
    require_devices(backend, 1)
    dev = backend.get_device(0)
    k = StaticSymbol("k", 4)
    src, row = f32("sb_src", (4, 5)), f32("sb_row", (5,))
    comp = ir.Comp.of(ir.slice_at(row, src, k))
    slow, sx, sacc = slow_accumulate()
    rng = np.random.default_rng(4)
    srcv = small_ints(rng, src.shape)
    ctx = (dev.make_context().init_from_host(src, srcv)
           .init_from_host(sx, np.ones(sx.shape, np.float32)).init_from_host(sacc, np.zeros(sacc.shape, np.float32)))
    with finalizing(ctx):
        r = ctx.link(backend.compile(comp, name="static_row"))
        busy = ctx.link(backend.compile(slow, name="busy"))
        expect(BindingError, r.run, "run() with an unbound static symbol", contains="k")
        for bad in (4, -1, 100):
            r.bindings[k] = bad
            expect(BindingError, r.run, f"run() with {k!r} = {bad} (bound 4)")
        for v in (2, 0, 3):
            for _ in range(SLOW_RUNS // 4):
                busy.run()  # keep the stream busy so that run() below is only enqueued
            r.bindings[k] = v
            r.run()
            r.bindings[k] = (v + 1) % 4  # changed after enqueueing: must not affect that run
            assert_equal(f"{row.label} with {k!r} = {v}", r.context.read(row), srcv[v])
        assert_usable(backend, ctx, "BindingError")
