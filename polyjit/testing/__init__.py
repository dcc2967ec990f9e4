"""The conformance kit: what any polyjit backend runs to prove itself.

- :func:`run_reference` (from :mod:`polyjit.core.reference`): the numpy interpreter of the IR,
  the oracle of every check;
- :mod:`polyjit.testing.programs`: a catalog of named test programs covering every op,
  dtype (float16 and bfloat16 included) and IR construct, and :data:`TOLERANCES`, the
  (rtol, atol) each float dtype is compared with; :mod:`polyjit.testing.strategies`:
  hypothesis strategies for random programs (imported on demand: it needs hypothesis);
- :data:`CHECKS` and :class:`ConformanceSuite`: the checks (:mod:`polyjit.testing.checks`, one
  module per topic), as plain functions and as a pytest base class
  (``class TestMine(ConformanceSuite): backend_name = "mine"``);
  :func:`run_check` runs one (raising :class:`CheckSkipped` when it cannot run here); a
  check that passed but left work out (float64 programs on a device without fp64) warns
  with a :class:`KitNote`;
- :mod:`polyjit.testing.concurrency` (threads) and :mod:`polyjit.testing.faults` (injected
  driver failures), which checks of the kit drive;
- :func:`run_selftest`: ``polyjit selftest --backend NAME``.
"""

from polyjit.core.reference import run_reference
from polyjit.testing.harness import Failure, run_programs, unsupported_reason
from polyjit.testing.programs import TOLERANCES, CatalogProgram, catalog
from polyjit.testing.suite import (
    CHECKS,
    CheckSkipped,
    ConformanceSuite,
    KitNote,
    default_multi_device_backend,
    needs_multi_device,
    required_backends,
    run_check,
    run_selftest,
)

__all__ = [
    "CHECKS",
    "TOLERANCES",
    "CatalogProgram",
    "CheckSkipped",
    "ConformanceSuite",
    "Failure",
    "KitNote",
    "catalog",
    "default_multi_device_backend",
    "needs_multi_device",
    "required_backends",
    "run_check",
    "run_programs",
    "run_reference",
    "run_selftest",
    "unsupported_reason",
]
