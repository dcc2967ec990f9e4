"""Set-up shared by the benchmark suites in this folder (imported as ``common``, like
``timing``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from polyjit.backends import get_backend
from polyjit.core import ir
from polyjit.core.runtime import Routine

Array = np.ndarray[Any, Any]


class Matmul(NamedTuple):
    routine: Routine  # c = a @ b, linked on device 0
    a: Array  # the host values of a and b
    b: Array
    c: ir.Node  # the output: routine.context.read(c)


def linked_matmul(backend: str, m: int, name: str = "bench_matmul") -> Matmul:
    """float32 ``c = a @ b`` through ``ir.einsum("ik,kj->ij")`` on random m x m inputs (seed 0),
    compiled by the backend of that name and linked on its device 0."""
    be = get_backend(backend)
    a, b, c = ir.Node("a", (m, m)), ir.Node("b", (m, m)), ir.Node("c", (m, m))
    code = be.compile(ir.Comp.of(ir.einsum("ik,kj->ij", a, b, into=c)), name=name)
    rng = np.random.default_rng(0)
    xa, xb = rng.random((m, m), dtype=np.float32), rng.random((m, m), dtype=np.float32)
    ctx = be.get_device(0).make_context().init_from_host(a, xa).init_from_host(b, xb)
    return Matmul(ctx.link(code), xa, xb, c)


Target = tuple[str, str, str, float]  # (group, key, ">=" or "<=", bound)


def print_targets(results: Mapping[str, Mapping[str, Any]], targets: Sequence[Target]) -> bool:
    """Print ``[targets]``: each target's value and met / MISSED (a group the run left out
    is skipped); returns whether every measured one is met."""
    print("[targets]")
    ok = True
    for group, key, cmp, bound in targets:
        if key not in results.get(group, {}):
            continue
        val = results[group][key]
        met = val >= bound if cmp == ">=" else val <= bound
        ok &= met
        print(f"  {group}.{key} = {val:.3f} (target {cmp} {bound}): {'met' if met else 'MISSED'}")
    return ok


def print_results(results: Mapping[str, Mapping[str, Any]], width: int = 32) -> None:
    """The machine line, then each group's figures, one per line."""
    print(f"machine: {results['machine']}")
    for group, values in results.items():
        if group == "machine":
            continue
        print(f"[{group}]")
        for key, val in values.items():
            print(f"  {key:{width}s} {val:14.3f}" if isinstance(val, float) else f"  {key:{width}s} {val!s:>14}")
