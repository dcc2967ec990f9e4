"""Per-kernel device times of a plan: each kernel of the linked batch is launched alone and
timed with a sync around it (the sync costs a few microseconds: compare kernels, not sums)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from polyjit.tensor.plan import Plan


@attrs.frozen
class KernelTime:
    name: str
    comment: str
    seconds: float
    work: int  # iterations of the parallel nest


def profile_kernels(plan: Plan, inputs: Mapping[str, Any], repeats: int = 10) -> list[KernelTime]:
    """Run the plan once (to link it and load its inputs), then time every kernel of its batch
    alone ``repeats`` times; slowest first. Kernels that write persistent state (optimizer
    updates) run ``repeats`` extra times: profile a copy of a model you still train with care."""
    plan.run(**inputs)
    linked = plan._linked
    assert linked is not None
    batch = plan.program.batch(plan.backend, linked.kind)
    comments = {k.name: k.comment for k in batch.lowered.kernels}
    works = {k.name: k.work for k in batch.lowered.kernels}
    out = []
    for routine in linked.routines:
        for spec, seconds in routine.time_kernels(repeats):
            out.append(KernelTime(spec.name, comments.get(spec.name, ""), seconds, works.get(spec.name, 0)))
    return sorted(out, key=lambda k: -k.seconds)


def format_profile(times: list[KernelTime], top: int = 15) -> str:
    total = sum(k.seconds for k in times) or 1.0
    lines = [f"{len(times)} kernels, {total * 1e3:.3f} ms in all"]
    for k in times[:top]:
        lines.append(f"  {k.seconds * 1e6:9.1f} us {k.seconds / total:6.1%}  {k.name:28s} {k.comment}")
    return "\n".join(lines)
