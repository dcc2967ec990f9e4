"""The conformance kit on OpenCL, the two-device tests in a subprocess with two PoCL devices, and
the benchmark."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from opencl_helpers import ROOT

from polyjit.core.runtime import Backend
from polyjit.testing import ConformanceSuite

pytest.importorskip("pyopencl")

HERE = Path(__file__).resolve().parent  # the OpenCL tests: the subprocess collects them all
IN_SUBPROCESS = "POLYJIT_OPENCL_TEST_SUBPROCESS"


# ---------------------------------------------------------------------------
# The conformance kit


class TestOpenCLConformance(ConformanceSuite):
    backend_name = "opencl"

    def multi_device_backend(self) -> Backend | None:
        be = self.backend()
        return be if be.num_devices() >= 2 else None


# ---------------------------------------------------------------------------
# Two devices in a subprocess



def _is_pocl(backend: Backend) -> bool:
    return "portable computing language" in str(backend.get_device(0).properties["platform"]).lower()


def test_two_device_tests_in_a_subprocess(backend: Backend) -> None:
    """Runs the two-device tests (TestTwoDevices of test_opencl_transfers.py and the conformance
    kit's) with POCL_DEVICES='pthread pthread' when this process has a single device."""
    if os.environ.get(IN_SUBPROCESS):
        pytest.skip("already in the subprocess")
    if backend.num_devices() >= 2:
        pytest.skip("this process has two devices: the two-device tests ran here")
    if not _is_pocl(backend):
        pytest.skip("only PoCL can be asked for a second device (POCL_DEVICES)")
    from polyjit.testing.suite import CHECKS, check_name, needs_multi_device

    multi = [f"test_{check_name(c)}" for c in CHECKS if needs_multi_device(c)]
    select = "TestTwoDevices or (TestOpenCLConformance and (" + " or ".join(multi) + "))"
    env = {**os.environ, "POCL_DEVICES": "pthread pthread", IN_SUBPROCESS: "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", str(HERE), "-k", select],
        env=env, capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    tail = (out.stdout + out.stderr)[-6000:]
    assert out.returncode == 0, tail
    assert "skipped" not in out.stdout.splitlines()[-1], tail  # two devices: nothing may skip
    assert f"{len(multi) + 5} passed" in out.stdout, tail


# ---------------------------------------------------------------------------
# The benchmark still runs (small sizes)


def test_benchmark_smoke(backend: Backend) -> None:
    from polyjit.bench import opencl as bench_opencl

    seen: list[str] = []

    def report(name: str, value: float, unit: str) -> None:
        seen.append(name)

    assert bench_opencl.bench_elementwise(report, n=4096, repeat=2)["copy_ratio"] > 0
    assert bench_opencl.bench_matmul(report, m=64, repeat=1)["speedup_vs_naive"] > 0
    launch = bench_opencl.bench_launch(report, calls=20, rounds=2)
    assert launch["ratio"] > 0 and launch["paced_bare_us"] > 0
    bench_opencl.bench_d2d(report, nbytes=1 << 16, repeat=2)
    assert len(seen) >= 14
