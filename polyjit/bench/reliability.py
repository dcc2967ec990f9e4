"""``polyjit bench reliability``: the figures of docs/reliability.md, measured in one run.

- misuse: the runtime's table of bad inputs (polyjit.testing.misuse), how many raised the
  typed error they must;
- faults: fault_storm over FaultyDriver (random failures of alloc, compile, load, launch,
  copies and event waits): typed errors seen, memory back to its baseline;
- threads: thread_stress (8 threads x 200 mixed operations, several seeds): errors, time;
- leaks: 1000 stream create/close cycles (threads, fds, RSS) and N distinct programs
  linked and dropped (loaded modules, RSS);
- launch: routine.run() + enqueue of a tiny kernel, microseconds per run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from polyjit import get_backend, ir
from polyjit.cli import count, output_file, subset_of
from polyjit.core.ir import Node, Op
from polyjit.core.runtime import Backend
from polyjit.testing.concurrency import thread_stress
from polyjit.testing.faults import FaultyDriver, fault_storm
from polyjit.testing.misuse import try_misuse


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def misuse(name: str) -> dict[str, Any]:
    tried, wrong = try_misuse(get_backend(name))
    return {"tried": tried, "typed": tried - len(wrong), "wrong": wrong}


def faults(name: str, seeds: int, operations: int) -> dict[str, Any]:
    backend = get_backend(name)
    inner_type = type(backend.driver)
    totals: dict[str, int] = {}
    injected = 0
    leaks = 0
    for seed in range(seeds):
        inner: Any = inner_type()
        driver = FaultyDriver(inner, rate=0.04, seed=seed)
        be = Backend(driver)
        before = inner.allocated_bytes(0)
        for k, v in fault_storm(be, operations, seed).items():
            totals[k] = totals.get(k, 0) + v
        injected += sum(driver.injected.values())
        driver.armed = False
        gc.collect()
        dev = be.get_device(0)
        dev.synchronize()
        leaks += int(dev.used_memory() != 0 or inner.allocated_bytes(0) != before)
    return {"runs": seeds, "operations": seeds * operations, "injected": injected, "outcomes": totals,
            "runs_with_memory_not_back": leaks}


def threads(name: str, seeds: int) -> dict[str, Any]:
    backend = get_backend(name)
    errors: list[str] = []
    t0 = time.perf_counter()
    for seed in range(seeds):
        errors += thread_stress(backend, threads=8, ops=200, seed=seed, deadline_s=300)
    return {"rounds": seeds, "threads": 8, "ops": 200, "errors": len(errors),
            "seconds": round(time.perf_counter() - t0, 1), "first_error": errors[0][:500] if errors else ""}


def stream_cycles(name: str, cycles: int) -> dict[str, Any]:
    dev = get_backend(name).get_device(0)
    for _ in range(50):
        with dev.new_stream() as s:
            s.synchronize()
    gc.collect()
    t, f, r = _threads(), _fds(), _rss()
    for _ in range(cycles):
        with dev.new_stream() as s:
            s.synchronize()
    gc.collect()
    return {"cycles": cycles, "threads_delta": _threads() - t, "fds_delta": _fds() - f,
            "rss_delta_mib": round((_rss() - r) / 2**20, 1)}


def program_cycles(name: str, count: int) -> dict[str, Any]:
    backend = get_backend(name)
    dev = backend.get_device(0)
    ones = np.ones(64, np.float32)
    gc.collect()
    rss0, modules0 = _rss(), dev.loaded_modules()
    rss_after_50 = rss0
    t0 = time.perf_counter()
    for k in range(count):
        a, out, scale = Node("a", (64,)), Node("out", (64,)), Node("scale", ())
        comp = ir.Comp.of(ir.fill(scale, k + 0.25), ir.apply(Op.MUL, a, scale, into=out))
        code = backend.compile(comp, name=f"leak{k}")
        with dev.make_context() as root:
            r = root.init_from_host(a, ones).link(code)
            r.run()
            r.context.read(out)
        del r, code
        if k == 49:
            gc.collect()
            rss_after_50 = _rss()
    gc.collect()
    dev.synchronize()
    return {"programs": count, "seconds": round(time.perf_counter() - t0, 1),
            "loaded_modules_delta": dev.loaded_modules() - modules0,
            "rss_growth_after_first_50_mib": round((_rss() - rss_after_50) / 2**20, 1)}


def launch(name: str) -> dict[str, Any]:
    backend = get_backend(name)
    dev = backend.get_device(0)
    a, out = Node("a", (16,)), Node("out", (16,))
    code = backend.compile(ir.Comp.of(ir.apply(Op.EXP, a, into=out)), name="tiny")
    ctx = dev.make_context().init_from_host(a, np.ones(16, np.float32))
    r = ctx.link(code)
    best = float("inf")
    for _ in range(7):
        r.run()
        ctx.stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(2000):
            r.run()
        best = min(best, (time.perf_counter() - t0) / 2000)
        ctx.stream.synchronize()
    ctx.finalize()
    return {"run_us": round(best * 1e6, 2)}


GROUPS = ("misuse", "faults", "threads", "streams", "programs", "launch")


def main(argv: Sequence[str] = ()) -> int:
    p = argparse.ArgumentParser(prog="polyjit bench reliability")
    p.add_argument("--backends", default="cpu,opencl")
    p.add_argument("--seeds", type=count, default=3)
    p.add_argument("--operations", type=count, default=1000)
    p.add_argument("--programs", type=count, default=1000)
    p.add_argument("--streams", type=count, default=1000)
    p.add_argument("--only", type=subset_of(GROUPS, "group"), default=",".join(GROUPS),
                   help=f"comma-separated subset: {','.join(GROUPS)}")
    p.add_argument("--json", type=output_file, help="write the results to this file")
    args = p.parse_args(list(argv))
    groups = args.only
    results: dict[str, dict[str, Any]] = {}
    for name in args.backends.split(","):
        if get_backend(name).num_devices() == 0:
            print(f"{name}: no devices, skipped")
            continue
        res: dict[str, Any] = {}
        if "misuse" in groups:
            res["misuse"] = misuse(name)
        if "faults" in groups:
            res["faults"] = faults(name, args.seeds, args.operations)
        if "threads" in groups:
            res["threads"] = threads(name, args.seeds)
        if "streams" in groups:
            res["streams"] = stream_cycles(name, args.streams)
        if "programs" in groups:
            res["programs"] = program_cycles(name, args.programs)
        if "launch" in groups:
            res["launch"] = launch(name)
        results[name] = res
        print(f"[{name}]  ({threading.active_count()} Python threads alive)")
        for group, values in res.items():
            print(f"  {group}: {json.dumps(values)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
