"""Timing helpers shared by the benchmark suites in this folder.

``best_of`` gives the minimum, the least disturbed run on a shared machine (``best_of_each``
for several contenders taking turns); ``median_ns`` the
median latency of single calls; ``median_per_call`` the median throughput of rounds of calls.
The suites import it as ``polyjit.bench.timing``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def best_of(fn: Callable[[], object], repeat: int = 10, warmup: int = 2) -> float:
    """The shortest time in seconds of ``repeat`` timed calls of ``fn``, after ``warmup``
    untimed calls."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def best_of_each(fns: dict[str, Callable[[], object]], repeat: int = 10, warmup: int = 1) -> dict[str, float]:
    """The shortest time in seconds of each function, run in turns (one call of each per round)
    so that all see the same machine: a ratio of two of them survives a machine whose memory
    bandwidth or load drifts between one measurement and the next."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def best_of_blocks(fns: dict[str, Callable[[], object]], rounds: int = 4, calls: int = 3,
                   settle: float = 0.15, warmup: int = 8) -> dict[str, float]:
    """Like :func:`best_of_each`, but each turn is a block of ``calls`` calls with ``settle``
    seconds of quiet after it: for contenders whose thread pools keep spinning after a call
    (OpenBLAS's spin for ~0.1 s on their cores), which would slow the next contender and
    teach an adaptive runtime that its cores are taken. ``warmup`` untimed calls of each
    first (the CPU runtime times a kernel's team sizes in its first runs)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
        time.sleep(settle)
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
            time.sleep(settle)
    return best


def median_ns(fn: Callable[[], object], n: int = 20000, warmup: int = 2000) -> float:
    """The median in nanoseconds of ``n`` individually timed calls of ``fn`` (latency, not
    throughput), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        fn()
        samples.append(clock() - t0)
    return float(statistics.median(samples))


def median_per_call(fn: Callable[[], object], sync: Callable[[], object] | None = None, *,
                    reps: int, rounds: int = 5, warmup: int = 1) -> float:
    """Median over ``rounds`` of the seconds per call in a round of ``reps`` calls of ``fn``
    followed by one ``sync()`` (when given). First ``warmup`` untimed calls, then a sync."""
    for _ in range(warmup):
        fn()
    if warmup and sync is not None:
        sync()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(rounds):
        t0 = clock()
        for _ in range(reps):
            fn()
        if sync is not None:
            sync()
        samples.append((clock() - t0) / reps / 1e9)
    return statistics.median(samples)
