"""The conformance checks every backend runs.

Each check is a plain function ``check_xxx(backend) -> None`` that raises
AssertionError with a clear message on failure (or :class:`CheckSkipped`);
they live in :mod:`polyjit.testing.checks`, one module per topic, and are
listed, in order, in :data:`CHECKS`. Checks that need two devices
(see :func:`needs_multi_device`) are given a backend with at least two devices.

For pytest, subclass :class:`ConformanceSuite` in a ``Test*`` class and set
``backend_name`` (or override :meth:`ConformanceSuite.backend`); the subclass gets
one ``test_<check>`` method per check. Override
:meth:`ConformanceSuite.multi_device_backend` to hand the multi-device checks a
backend with two devices (return None when there is none: those checks are then
skipped, with the reason, and only then).

A check that passes but left something out (the float64 programs on a device without
fp64, say) says so with a :class:`KitNote` warning: pytest lists it in its warnings
summary, ``polyjit selftest`` prints it beside the check.
"""

from __future__ import annotations

import functools
import os
import time
import traceback
import warnings
from collections.abc import Callable
from typing import ClassVar

from polyjit.core.errors import BackendUnavailableError, PolyjitError
from polyjit.core.runtime import Backend
from polyjit.testing.checks.common import MULTI_DEVICE, CheckFn, CheckSkipped, KitNote
from polyjit.testing.checks.compute import (
    check_catalog_programs,
    check_half_special_values,
    check_nan_propagation,
    check_random_affine_programs,
    check_random_einsum_programs,
    check_random_elementwise_programs,
    check_random_gather_programs,
    check_random_matmul_programs,
    check_routines_and_batches,
    check_static_bindings,
)
from polyjit.testing.checks.kernels import check_raw_kernels
from polyjit.testing.checks.memory import (
    check_alloc_and_memset,
    check_dropped_work,
    check_finalize,
    check_free_returns_memory,
    check_pool_exhausted,
)
from polyjit.testing.checks.robustness import (
    check_fault_typing,
    check_node_not_in_context,
    check_threads,
    check_unknown_device,
)
from polyjit.testing.checks.streams import (
    check_cross_device_ordering,
    check_cross_stream_ordering,
    check_events_and_device_sync,
    check_stream_close,
)
from polyjit.testing.checks.transfers import (
    check_copy_offsets_one_device,
    check_copy_offsets_two_devices,
    check_device_to_device_one_device,
    check_device_to_device_two_devices,
    check_host_round_trips,
    check_host_transfer_errors,
    check_merge_buffer_all_reduce,
)

__all__ = [
    "CHECKS",
    "CheckFn",
    "CheckSkipped",
    "ConformanceSuite",
    "KitNote",
    "default_multi_device_backend",
    "needs_multi_device",
    "run_check",
    "run_selftest",
]

# The checks, in the order they run (ConformanceSuite's test methods and polyjit selftest follow it).
CHECKS: list[CheckFn] = [
    check_alloc_and_memset,
    check_pool_exhausted,
    check_host_round_trips,
    check_host_transfer_errors,
    check_catalog_programs,
    check_half_special_values,
    check_nan_propagation,
    check_random_elementwise_programs,
    check_random_einsum_programs,
    check_random_matmul_programs,
    check_random_affine_programs,
    check_random_gather_programs,
    check_routines_and_batches,
    check_static_bindings,
    check_raw_kernels,
    check_events_and_device_sync,
    check_cross_stream_ordering,
    check_device_to_device_one_device,
    check_device_to_device_two_devices,
    check_merge_buffer_all_reduce,
    check_cross_device_ordering,
    check_copy_offsets_one_device,
    check_copy_offsets_two_devices,
    check_finalize,
    check_free_returns_memory,
    check_dropped_work,
    check_stream_close,
    check_threads,
    check_fault_typing,
    check_unknown_device,
    check_node_not_in_context,
]

# Those of CHECKS that must be given a backend with two devices (marked @multi_device).
_MULTI_DEVICE: set[CheckFn] = set(MULTI_DEVICE)


def needs_multi_device(check: CheckFn) -> bool:
    """Whether the check must be given a backend with at least two devices."""
    return check in _MULTI_DEVICE


def check_name(check: CheckFn) -> str:
    return check.__name__.removeprefix("check_")


# ---------------------------------------------------------------------------
# Running the checks


def run_check(check: CheckFn, backend: Backend, multi_device_backend: Backend | None = None) -> None:
    """Run one check with the right backend; raises CheckSkipped when it cannot run here."""
    if needs_multi_device(check):
        if multi_device_backend is None or multi_device_backend.num_devices() < 2:
            raise CheckSkipped(f"needs a backend with two devices; none is available for {backend.name!r}")
        check(multi_device_backend)
    else:
        check(backend)


@functools.cache
def _split_cpu_backend() -> Backend:
    from polyjit.backends.cpu import create_backend

    return create_backend(num_devices=2)


def default_multi_device_backend(backend: Backend) -> Backend | None:
    """The backend itself when it has two devices or more; for ``cpu``, a backend that splits the
    machine into two devices; else None."""
    if backend.num_devices() >= 2:
        return backend
    if backend.name == "cpu":
        return _split_cpu_backend()
    return None


def required_backends() -> list[str]:
    """The backends ``$POLYJIT_REQUIRE_BACKENDS`` names (comma-separated): where they are
    missing, their tests fail instead of skipping. Read here and nowhere else."""
    return [b.strip() for b in os.environ.get("POLYJIT_REQUIRE_BACKENDS", "").split(",") if b.strip()]


class ConformanceSuite:
    """Subclass as ``class TestMyBackend(ConformanceSuite): backend_name = "mine"``: pytest then
    collects one ``test_<check>`` per check of :data:`CHECKS`."""

    backend_name: ClassVar[str | None] = None

    def backend(self) -> Backend:
        if self.backend_name is None:
            raise NotImplementedError("set backend_name or override backend()")
        from polyjit.backends import get_backend

        return get_backend(self.backend_name)

    def multi_device_backend(self) -> Backend | None:
        """A backend of the same kind with at least two devices, or None when there is none."""
        return default_multi_device_backend(self.backend())

    def _run(self, check: CheckFn) -> None:
        import pytest

        name = self.backend_name or type(self).__name__
        try:
            backend = self.backend()
            devices = backend.num_devices()
        except BackendUnavailableError as e:
            if name in required_backends():
                raise AssertionError(f"required backend {name!r} is unavailable: {e}") from e
            pytest.skip(f"backend {name!r} is unavailable: {e}")
        if devices == 0 and check is not check_unknown_device:
            if name in required_backends():
                raise AssertionError(f"required backend {name!r} has no devices")
            pytest.skip(f"backend {name!r} has no devices")
        try:
            run_check(check, backend, self.multi_device_backend() if needs_multi_device(check) else None)
        except CheckSkipped as e:
            pytest.skip(str(e))


def _make_test(check: CheckFn) -> Callable[[ConformanceSuite], None]:
    def test(self: ConformanceSuite) -> None:
        self._run(check)

    test.__name__ = f"test_{check_name(check)}"
    test.__qualname__ = f"ConformanceSuite.{test.__name__}"
    test.__doc__ = check.__doc__
    return test


for _check in CHECKS:
    setattr(ConformanceSuite, f"test_{check_name(_check)}", _make_test(_check))
del _check


# ---------------------------------------------------------------------------
# The CLI


def run_selftest(backend_name: str, *, verbose: bool = False) -> int:
    """Run every check on a backend, print one line per check, return the number of failures."""
    try:
        from polyjit.backends import get_backend

        backend = get_backend(backend_name)
        n = backend.num_devices()
    except PolyjitError as e:
        print(f"FAIL  backend {backend_name!r} cannot start: {type(e).__name__}: {e}")
        print("0 passed, 1 failed")
        return 1
    if n == 0:
        print(f"FAIL  backend {backend_name!r} has no devices")
        print("0 passed, 1 failed")
        return 1
    multi = default_multi_device_backend(backend)
    print(f"polyjit selftest: backend {backend_name!r}, {n} device(s)"
          + (f"; multi-device checks on {multi.num_devices()} devices" if multi is not None else ""))
    passed = failed = skipped = 0
    width = max(len(check_name(c)) for c in CHECKS)
    for check in CHECKS:
        t0 = time.perf_counter()
        status, detail = "pass", ""
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always", KitNote)
                run_check(check, backend, multi)
            passed += 1
            detail = "; ".join(str(w.message) for w in seen if issubclass(w.category, KitNote))
            for w in seen:  # other warnings as they would have shown
                if not issubclass(w.category, KitNote):
                    warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        except CheckSkipped as e:
            status, detail = "skip", str(e)
            skipped += 1
        except Exception as e:
            status = "FAIL"
            failed += 1
            detail = (traceback.format_exc() if verbose or not isinstance(e, AssertionError)
                      else f"{e}")
        dt = time.perf_counter() - t0
        shown = f"  ({detail})" if status == "skip" else (f"  (note: {detail})" if status == "pass" and detail else "")
        print(f"{status:4}  {check_name(check):{width}}  {dt:7.2f}s{shown}")
        if status == "FAIL":
            lines = detail.rstrip().splitlines()
            if not verbose and len(lines) > 30:
                lines = [*lines[:30], f"... ({len(lines) - 30} more lines; use --verbose)"]
            for line in lines:
                print(f"      {line}")
        elif verbose and check.__doc__:
            print(f"      {check.__doc__.strip().splitlines()[0]}")
    print(f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
    return failed
