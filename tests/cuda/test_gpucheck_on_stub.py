"""``polyjit gpucheck`` end to end on two stub GPUs, through the real cuda.bindings: the
versions step names the devices, the conformance kit passes on each of them, and the
report lands on disk, so the first real GPU runs a command that has run before. (The GPU
tests, sanitizers and benchmarks need a real device and driver; they are left out.)"""

from __future__ import annotations

import json
from pathlib import Path

import stub

from polyjit.gpucheck import main

STUB_ENV = {"PJSTUB_DEVICES": "2"}


def test_gpucheck_writes_a_passing_report(tmp_path: Path, stub_driver: stub.Driver) -> None:
    out = tmp_path / "report"
    rc = main([str(out), "--quick", "--skip", "tests,sanitizer,bench,char_lm"])
    report = json.loads((out / "gpucheck.json").read_text())
    assert rc == 0, report
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["versions and devices"]["status"] == "passed"
    assert steps["conformance kit"]["status"] == "passed"
    devices = steps["versions and devices"]["devices"]
    assert [d["ordinal"] for d in devices] == [0, 1]
    assert all(d["arch"] and d["sm_count"] > 0 for d in devices)
    assert steps["conformance kit"]["failed"] == [] and steps["conformance kit"]["checks"] > 10
    assert (out / "gpucheck.md").read_text().strip()


def test_char_lm_on_a_gpu_says_where_a_step_goes(stub_driver: stub.Driver) -> None:
    """gpucheck's char_lm step reports samples/s, the host's enqueueing, the host's time in
    each piece of a step, and the device's own time for a step (the plan's two graphs
    replayed back to back, timed by events)."""
    from polyjit.bench.tensor import bench_char_lm_on

    got = bench_char_lm_on(8, 2, "cuda:0")
    assert set(got) == {"compiled_samples_s", "step_us", "enqueue_us", "enqueue_sync_us", "device_step_us",
                        "prepare_us", "head_us", "tail_us", "wait_us"}
    assert all(v > 0 for v in got.values()), got
