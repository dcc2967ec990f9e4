"""Running hand-built catalog programs on a named backend against the reference (shared by
the lowering tests: test_horizontal_fusion.py, test_views.py)."""

from __future__ import annotations

import pytest

from polyjit.backends import get_backend
from polyjit.core.runtime import Backend
from polyjit.testing.harness import run_programs
from polyjit.testing.programs import CatalogProgram


def backend_or_skip(name: str) -> Backend:
    be = get_backend(name)
    if be.num_devices() == 0:
        pytest.skip(f"no {name} device")
    return be


def check_program(program: CatalogProgram, backend: str) -> None:
    """The program on ``backend`` equals the reference interpreter's result."""
    failures = run_programs(backend_or_skip(backend), [program])
    assert not failures, "\n".join(f"{f.program}: {f.message}" for f in failures)


def kernel_comments(backend: str, program: str) -> list[str]:
    """What each kernel of a catalog program computes, as ``backend`` lowers it (one entry
    per kernel: which writes fusion merged)."""
    from polyjit.testing.programs import by_name

    p = by_name(program)
    batch = backend_or_skip(backend).compile_batch(list(p.comps), names=[f"c{k}" for k in range(len(p.comps))])
    return [k.comment for k in batch.lowered.kernels]
