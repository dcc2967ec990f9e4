"""The catalog of named test programs of the conformance kit.

Every program carries its computations, a generator of random inputs whose
ranges avoid NaN, overflow, logarithms of negatives and integer division by
zero, the nodes to check, and a tolerance. It is run on a backend and checked
against :func:`polyjit.core.reference.run_reference`, never against
hard-coded numbers (see :mod:`polyjit.testing.harness`).

The catalog covers every op on every dtype where it is defined (see
``ir.result_dtype``), casts between all dtypes, and every IR construct:
broadcasting, transposes, reductions with each AccumOp, matmul and batched
matmul, accumulation onto what the context holds, non-surjective and
non-injective writes, fused elementwise chains (whose intermediates must be
VIRTUAL and absent from the context), fetches (fill, range, constant, slice at
a static index bound at run time), Seq/Block, and explicit memory modes.

The programs are built in one module per topic (:mod:`.elementwise`, :mod:`.shapes`,
:mod:`.reductions`, :mod:`.writes`, :mod:`.structure`, :mod:`.half`) from the blocks of
:mod:`.base`; :data:`TOLERANCES` is the table of tolerances per dtype.
"""

from __future__ import annotations

import functools

from polyjit.testing.programs import elementwise, half, reductions, shapes, structure, writes
from polyjit.testing.programs.base import (
    TOLERANCES,
    CatalogProgram,
    Gen,
    default_tolerance,
    program,
    values,
)

__all__ = [
    "TOLERANCES",
    "CatalogProgram",
    "Gen",
    "by_name",
    "catalog",
    "default_tolerance",
    "program",
    "values",
]


@functools.cache
def catalog() -> tuple[CatalogProgram, ...]:
    """Every program of the catalog (names are unique)."""
    progs = [
        *elementwise.elementwise(), *elementwise.guarded_division(), *elementwise.special_scalars(), *elementwise.integer_edges(), *elementwise.casts(), *shapes.broadcasting(), *shapes.transposes(),
        *reductions.reductions(), *reductions.matmuls(), *writes.accumulate_onto_context(), *writes.writes(),
        *writes.fusion(), *writes.own_target(), *writes.epilogues(), *writes.rows(), *writes.rows_past_independent(), *writes.folding(), *writes.batches(), *structure.fetches(), *structure.rows_by_data(), *shapes.reshapes(), *structure.structure(), *structure.large(),
        *half.half_programs(),
    ]
    names = [p.name for p in progs]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:  # pragma: no cover - a catalog bug
        raise AssertionError(f"duplicate program names: {sorted(dupes)}")
    return tuple(progs)


def by_name(name: str) -> CatalogProgram:
    for p in catalog():
        if p.name == name:
            return p
    raise KeyError(name)
