"""The conformance kit on the cpu backend, and checks that the kit itself has teeth."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

from polyjit.backends.cpu import CpuDriver, create_backend
from polyjit.core.runtime import Backend
from polyjit.testing import CHECKS, ConformanceSuite, run_programs, run_selftest
from polyjit.testing import suite as suite_mod
from polyjit.testing.programs import catalog


@functools.cache
def _two_device_cpu() -> Backend:
    return create_backend(num_devices=2)


class TestCpuConformance(ConformanceSuite):
    backend_name = "cpu"

    def multi_device_backend(self) -> Backend | None:
        return _two_device_cpu()


def test_every_check_is_a_test_method() -> None:
    names = {n for n in dir(TestCpuConformance) if n.startswith("test_")}
    for check in CHECKS:
        assert f"test_{check.__name__.removeprefix('check_')}" in names
    assert len(CHECKS) >= 15


# -- the kit catches broken backends ---------------------------------------------


class _NoWaitDriver(CpuDriver):
    """A driver whose streams never wait for each other's events."""

    def wait(self, stream: Any, event: Any) -> None:
        return None


class _SubIsAddDialect(type(CpuDriver().dialect)):  # type: ignore[misc]
    """A dialect that emits ``a - b`` as ``a + b``."""

    def emit_kernel(self, em: Any, kernel: Any, spec: Any, names: Any) -> list[str]:
        lines = super().emit_kernel(em, kernel, spec, names)
        return [line.replace(" - ", " + ") for line in lines]


@functools.cache
def _no_wait_backend() -> Backend:
    return Backend(_NoWaitDriver())


def test_kit_detects_missing_cross_stream_waits() -> None:
    with pytest.raises(AssertionError, match="stream"):
        suite_mod.check_cross_stream_ordering(_no_wait_backend())


def test_kit_detects_wrong_arithmetic() -> None:
    driver = CpuDriver()
    driver.dialect = _SubIsAddDialect()
    broken = Backend(driver)
    subs = [p for p in catalog() if p.name.startswith("elementwise.sub.")]
    assert len(subs) == 7  # float32 float64 int32 int64 uint8 float16 bfloat16
    failures = run_programs(broken, subs)
    assert {f.program for f in failures} == {p.name for p in subs}


class _FlushesNegativeZeroDialect(type(CpuDriver().dialect)):  # type: ignore[misc]
    """A dialect whose half stores turn -0.0 into +0.0."""

    def half_store(self, dt: Any, ref: str, value: str) -> str:
        return str(super().half_store(dt, ref, f"(({value}) + 0.0f)"))


def test_kit_detects_a_zero_of_the_wrong_sign() -> None:
    """Found by review: the kit's exact comparisons (tolerance 0) took -0.0 for +0.0, so a
    backend that lost a zero's sign passed check_half_special_values."""
    from polyjit.testing.checks.compute import check_half_special_values
    from polyjit.testing.harness import compare

    assert compare("z", np.array([0.0]), np.array([-0.0]), 0.0, 0.0) is not None
    assert compare("z", np.array([0.0]), np.array([-0.0]), 1e-6, 0.0) is None  # within a tolerance
    driver = CpuDriver()
    driver.dialect = _FlushesNegativeZeroDialect()
    with pytest.raises(AssertionError, match="half"):
        check_half_special_values(Backend(driver))


# -- the selftest command -------------------------------------------------------------


def test_run_selftest_reports_each_check(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def check_ok(backend: Backend) -> None:
        assert backend.num_devices() >= 1

    def check_bad(backend: Backend) -> None:
        raise AssertionError("this check fails on purpose")

    def check_two(backend: Backend) -> None:
        assert backend.num_devices() >= 2

    monkeypatch.setattr(suite_mod, "CHECKS", [check_ok, check_bad, check_two])
    monkeypatch.setattr(suite_mod, "_MULTI_DEVICE", {check_two})
    failures = run_selftest("cpu", verbose=False)
    out = capsys.readouterr().out
    assert failures == 1
    lines = out.splitlines()
    assert any(line.startswith("pass") and "ok" in line for line in lines)
    assert any(line.startswith("FAIL") and "bad" in line for line in lines)
    assert "this check fails on purpose" in out
    assert any(line.startswith("pass") and "two" in line for line in lines)  # a 2-device cpu backend
    assert lines[-1] == "2 passed, 1 failed"


def test_run_selftest_unknown_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_selftest("no-such-backend", verbose=False) == 1
    assert "0 passed, 1 failed" in capsys.readouterr().out
