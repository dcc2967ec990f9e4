"""Per-kernel device times of a plan, through the public API: the plan's batch is linked
into its state context and each kernel is timed alone by :meth:`Routine.time_kernels` (timed
events around its launches; compare kernels, not sums)."""

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
    """Run the plan once (to load its inputs and state), then time every kernel of its batch
    (fused, unless the plan runs op by op) alone ``repeats`` times; slowest first. Kernels
    that write persistent state (optimizer updates) run ``repeats + 1`` extra times: profile
    a copy of a model you still train with care."""
    plan.run(**inputs)
    batch = plan.program.batch(plan.backend, "dynamic" if plan.mode == "dynamic" else "compiled")
    comments = {k.name: k.comment for k in batch.lowered.kernels}
    works = {k.name: k.work for k in batch.lowered.kernels}
    routines = plan.state_context.link_batch(batch)  # the plan's own buffers stay as they are
    out = []
    try:
        for routine in routines:
            for spec, seconds in routine.time_kernels(repeats):
                out.append(KernelTime(spec.name, comments.get(spec.name, ""), seconds, works.get(spec.name, 0)))
    finally:
        if routines:
            routines[0].context.finalize()
    return sorted(out, key=lambda k: -k.seconds)


def format_profile(times: list[KernelTime], top: int = 15) -> str:
    total = sum(k.seconds for k in times) or 1.0
    lines = [f"{len(times)} kernels, {total * 1e3:.3f} ms in all"]
    for k in times[:top]:
        lines.append(f"  {k.seconds * 1e6:9.1f} us {k.seconds / total:6.1%}  {k.name:28s} {k.comment}")
    return "\n".join(lines)
