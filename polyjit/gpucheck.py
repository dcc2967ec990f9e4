"""``polyjit gpucheck DIR``: what a first run on a GPU must check, in one process, in a few
minutes, written to ``DIR/gpucheck.md`` and ``DIR/gpucheck.json``.

1. versions: polyjit, the driver, NVRTC, cuda.core and cuda.bindings, and every device;
2. the conformance kit on CUDA (its multi-device checks on two GPUs when there are two),
   and the catalog on every GPU;
3. the GPU-marked tests (``pytest -m gpu``) when the source checkout is at hand;
4. compute-sanitizer's memcheck and racecheck on the catalog and a graph replay, when the
   tool is on the PATH (each runs this module again as its target: a child process);
5. ``polyjit bench cuda`` and char_lm on ``cuda:0`` (``polyjit bench tensor``).

Each step's failure is recorded and the next one runs; the exit status is 0 only if every
step that ran passed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


class Report:
    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def run(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run one step, capturing what it prints; a step raises to fail."""
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                result = fn()
            status = result.pop("status", "passed")
        except Exception as e:
            result, status = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}, "failed"
        step = {"name": name, "status": status, "seconds": round(time.perf_counter() - t0, 1),
                "output": out.getvalue()[-20000:], **result}
        self.steps.append(step)
        print(f"   {status} in {step['seconds']} s", flush=True)
        return step

    def write(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "gpucheck.json").write_text(json.dumps({"steps": self.steps}, indent=2, default=str))
        lines = ["# polyjit gpucheck", ""]
        for s in self.steps:
            lines += [f"## {s['name']}: {s['status']} ({s['seconds']} s)", ""]
            for key, value in s.items():
                if key not in ("name", "status", "seconds", "output", "traceback"):
                    lines.append(f"- {key}: {value}")
            if s.get("output"):
                lines += ["", "```", s["output"].rstrip()[-6000:], "```"]
            if s.get("traceback"):
                lines += ["", "```", s["traceback"].rstrip(), "```"]
            lines.append("")
        (directory / "gpucheck.md").write_text("\n".join(lines))

    @property
    def ok(self) -> bool:
        return all(s["status"] in ("passed", "skipped") for s in self.steps)


def step_versions() -> dict[str, Any]:
    import numpy

    import polyjit
    from polyjit.backends import cuda, get_backend

    backend = get_backend("cuda")
    devices = []
    for k in range(backend.num_devices()):
        dev = backend.get_device(k)
        devices.append({"ordinal": k, "name": dev.name, "arch": dev.properties["arch"],
                        "memory_gib": round(dev.info.memory_bytes / 2**30, 1),
                        "sm_count": dev.properties["sm_count"], "peer_access": dev.properties["peer_access"]})
    out = {"polyjit": polyjit.__version__, "python": platform.python_version(), "numpy": numpy.__version__,
           **cuda.versions(), "devices": devices}
    if not devices:
        out.update(status="failed", reason=backend.unavailable_reason)
    return out


def step_kit() -> dict[str, Any]:
    from polyjit.backends import get_backend
    from polyjit.testing import CHECKS, CheckSkipped, catalog, run_check, run_programs
    from polyjit.testing.suite import check_name

    backend = get_backend("cuda")
    two = backend if backend.num_devices() >= 2 else None
    results: dict[str, str] = {}
    for check in CHECKS:
        try:
            run_check(check, backend, two)
            results[check_name(check)] = "passed"
        except CheckSkipped as e:
            results[check_name(check)] = f"skipped: {e}"
        except Exception as e:
            results[check_name(check)] = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
    for k in range(1, backend.num_devices()):  # the catalog on every other GPU
        failures = run_programs(backend, catalog(), ordinal=k)
        results[f"catalog on cuda:{k}"] = "passed" if not failures else f"FAILED: {len(failures)} programs"
    failed = [name for name, r in results.items() if r.startswith("FAILED")]
    print("\n".join(f"{name}: {r}" for name, r in results.items()))
    return {"checks": len(results), "failed": failed, "status": "failed" if failed else "passed"}


def step_gpu_tests() -> dict[str, Any]:
    tests = ROOT / "tests"
    if not tests.is_dir():
        return {"status": "skipped", "reason": "no source checkout (tests/ is not beside the package)"}
    import pytest

    env = os.environ.copy()
    os.environ["POLYJIT_REQUIRE_BACKENDS"] = "cuda"
    try:
        # in this process (-o addopts= drops pyproject's -n auto): the GPU tests count the
        # device's memory and time it, as if it were theirs, and xdist need not be installed
        rc = pytest.main(["-o", "addopts=", "-q", "-m", "gpu", "-p", "no:cacheprovider", str(tests)])
    finally:
        os.environ.clear()
        os.environ.update(env)
    return {"pytest_exit": int(rc), "status": "passed" if rc in (0, 5) else "failed"}


def step_sanitizer(tool: str) -> dict[str, Any]:
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        return {"status": "skipped", "reason": "compute-sanitizer is not on the PATH"}
    found = {}
    for target in ("catalog", "graph"):
        cmd = [exe, "--tool", tool, "--error-exitcode", "99", sys.executable, "-m", "polyjit.gpucheck",
               "--sanitizer-target", target]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        print(done.stdout[-4000:], done.stderr[-4000:])
        found[target] = "clean" if done.returncode == 0 else f"exit {done.returncode}"
    return {**found, "status": "passed" if all(v == "clean" for v in found.values()) else "failed"}


def sanitizer_target(which: str) -> int:
    """What compute-sanitizer watches: the catalog on cuda:0, or a replayed graph."""
    import numpy as np

    from polyjit.backends import get_backend
    from polyjit.core import ir

    backend = get_backend("cuda")
    if which == "catalog":
        from polyjit.testing import catalog, run_programs

        failures = run_programs(backend, catalog(), ordinal=0)
        return 1 if failures else 0
    dev = backend.get_device(0)
    nodes = [ir.Node(f"g{k}", (4096,)) for k in range(9)]
    ctx = dev.make_context().init_from_host(nodes[0], np.zeros(4096, np.float32))
    comps = [ir.Comp.of(ir.apply(ir.Op.ADD, nodes[k], 1.0, into=nodes[k + 1])) for k in range(8)]
    routines = ctx.link_batch(backend.compile_batch(comps, names=[f"step{k}" for k in range(8)]))
    graph = backend.capture(routines)
    for _ in range(10):
        graph.replay()
    ok = bool(np.all(routines[-1].context.read(nodes[-1]) == 8.0))
    graph.close()
    return 0 if ok else 1


def step_bench(suite: str, args: Sequence[str]) -> dict[str, Any]:
    from polyjit.cli import main as cli_main

    rc = cli_main(["bench", suite, *args])
    return {"exit": rc, "status": "passed" if rc == 0 else "failed"}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="polyjit gpucheck", description=__doc__.splitlines()[0])
    p.add_argument("directory", nargs="?", default="gpucheck-report", help="where the report goes")
    p.add_argument("--quick", action="store_true", help="smaller benchmark sizes")
    p.add_argument("--skip", default="", help="steps to leave out: versions,kit,tests,sanitizer,bench,char_lm")
    p.add_argument("--sanitizer-target", choices=("catalog", "graph"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.sanitizer_target:
        return sanitizer_target(args.sanitizer_target)
    out = Path(args.directory)
    skip = set(args.skip.split(","))
    report = Report()
    first = report.run("versions and devices", step_versions)
    if first["status"] == "failed":
        report.write(out)
        print(f"no CUDA device: {first.get('reason')}; report in {out}")
        return 1
    steps: list[tuple[str, str, Callable[[], dict[str, Any]]]] = [
        ("kit", "conformance kit", step_kit),
        ("tests", "GPU-marked tests", step_gpu_tests),
        ("sanitizer", "compute-sanitizer memcheck", lambda: step_sanitizer("memcheck")),
        ("sanitizer", "compute-sanitizer racecheck", lambda: step_sanitizer("racecheck")),
        ("bench", "polyjit bench cuda", lambda: step_bench("cuda", [*(["--quick"] if args.quick else []),
                                                                    "--json", str(out / "bench_cuda.json")])),
        ("char_lm", "char_lm on cuda:0", lambda: step_bench("tensor", ["--only", "char_lm", "--lm-device", "cuda:0"])),
    ]
    for key, name, fn in steps:
        if key not in skip:
            report.run(name, fn)
            report.write(out)  # after every step: a crash later keeps what was measured
    print(f"report: {out / 'gpucheck.md'}, {out / 'gpucheck.json'}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
