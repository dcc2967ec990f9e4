"""polyjit.distributed benchmarks, run under MPI:

    polyjit bench distributed      # starts an mpiexec job of 2 ranks (or run it under mpiexec)

- all_reduce of a 64 MiB float32 node between the ranks, against mpi4py's ``Allreduce`` on
  numpy arrays of the same size (in place, and into a second array), measured in turns in
  one run (target: polyjit >= 90% of the faster of the two);
- the MLP 784-256-10 (SGD with momentum, global batch 1024) data parallel over 2 ranks x 1
  core against 1 rank x 1 core: each rank is pinned to its own core (``bind_to_cores``) with
  one cpu device; the one-rank figure is rank 0 training the whole batch alone while rank 1
  waits, in turns with the two-rank blocks (target: >= 1.6x samples/s), with the all-reduce
  time per step (the tree inside the rank is empty with one device: it is the MPI part).

Every figure is the best (or the median, where so named) of several timed blocks: the
machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from polyjit.bench.common import Target, print_results, print_targets
from polyjit.cli import count, output_file, subset_of
from polyjit.distributed import MPI, Comm, bind_to_cores, mpiexec_command

Array = np.ndarray[Any, Any]
TARGETS: list[Target] = [
    ("allreduce", "vs_mpi4py", ">=", 0.9),
    ("data_parallel", "speedup", ">=", 1.6),
]
WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


def bench_allreduce(mib: int, rounds: int) -> dict[str, float]:
    """Seconds per all_reduce of ``mib`` MiB: polyjit vs mpi4py, the contenders in turns."""
    from polyjit.backends.cpu import create_backend
    from polyjit.core.ir import Node

    n = mib * (1 << 20) // 4
    comm = Comm()
    node = Node("grads", (n,), "float32")
    ctx = create_backend(num_devices=1).get_device(0).make_context().init_from_host(node, np.ones(n, np.float32))
    a, b = np.ones(n, np.float32), np.empty(n, np.float32)
    world = WORLD

    def polyjit() -> None:
        comm.all_reduce(ctx, node, "sum")

    def mpi_in_place() -> None:
        world.Allreduce(MPI.IN_PLACE, a, MPI.SUM)

    def mpi_two_arrays() -> None:
        world.Allreduce(a, b, MPI.SUM)

    fns: dict[str, Callable[[], None]] = {"polyjit": polyjit, "mpi4py_in_place": mpi_in_place,
                                          "mpi4py": mpi_two_arrays}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm up: first touches, MPI's buffers
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            world.Barrier()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            times[name].append(world.allreduce(dt, op=MPI.MAX))  # the slowest rank's time
    out: dict[str, float] = {"mib": float(mib), "ranks": float(SIZE)}
    for name, ts in times.items():
        out[f"{name}_best_ms"] = min(ts) * 1e3
        out[f"{name}_median_ms"] = float(np.median(ts)) * 1e3
        out[f"{name}_gib_s"] = mib / 1024 / float(np.median(ts))
    best_mpi = min(float(np.median(times["mpi4py"])), float(np.median(times["mpi4py_in_place"])))
    out["vs_mpi4py"] = best_mpi / float(np.median(times["polyjit"]))  # throughput ratio, medians
    out["vs_mpi4py_best"] = min(min(times["mpi4py"]), min(times["mpi4py_in_place"])) / min(times["polyjit"])
    out["vs_mpi4py_two_arrays"] = float(np.median(times["mpi4py"])) / float(np.median(times["polyjit"]))
    return out


def bench_data_parallel(batch: int, steps: int, rounds: int) -> dict[str, float]:
    from polyjit import tensor as pt
    from polyjit.backends.cpu import create_backend

    backend = create_backend(num_devices=1)  # the cores this rank is pinned to
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((batch, 784)).astype(np.float32)
    ys = rng.integers(0, 10, batch).astype(np.int32)
    comm = Comm()

    def make(with_comm: bool) -> Any:
        mlp = pt.MLP("mlp", [784, 256, 10], seed=0)
        return pt.data_parallel(lambda x, y: pt.cross_entropy(mlp(x), y),
                                {"x": ((batch, 784), "float32"), "y": ((batch,), "int32")},
                                optimizer=pt.SGD(0.01, momentum=0.9), devices=backend.devices(),
                                comm=comm if with_comm else None)

    one = make(False) if RANK == 0 else None
    many = make(True)
    best = {"one": 0.0, "many": 0.0}
    for _ in range(rounds):
        comm.barrier()
        if one is not None:  # rank 0 alone: the others wait in the barrier (sleeping)
            for _ in range(3):
                one.step(x=xs, y=ys)
            t0 = time.perf_counter()
            for _ in range(steps):
                one.step(x=xs, y=ys)
            best["one"] = max(best["one"], batch * steps / (time.perf_counter() - t0))
        comm.barrier()
        for _ in range(3):
            many.step(x=xs, y=ys)
        t0 = time.perf_counter()
        for _ in range(steps):
            many.step(x=xs, y=ys)
        best["many"] = max(best["many"], batch * steps / (time.perf_counter() - t0))
    for _ in range(steps):
        many.step_profiled(x=xs, y=ys)
    result = {
        "global_batch": float(batch),
        "one_rank_samples_s": best["one"],
        f"{SIZE}_ranks_samples_s": best["many"],
        "speedup": best["many"] / best["one"] if best["one"] else 0.0,
        "allreduce_ms": float(np.median(many.timings["allreduce"])) * 1e3,
        "mpi_allreduce_ms": float(np.median(many.timings["mpi"])) * 1e3,
        "compute_ms": float(np.median(many.timings["compute"])) * 1e3,
        "gradient_kib": many.grads_node.nbytes / 1024,
    }
    many.close()
    if one is not None:
        one.close()
    return result


GROUPS = ("allreduce", "data_parallel")


def run(args: argparse.Namespace) -> int:
    cores = bind_to_cores(1)  # before the cpu backend exists: one core per rank
    wanted = set(args.only) or set(GROUPS)
    results: dict[str, dict[str, Any]] = {"machine": {"ranks": SIZE, "cores_of_rank_0": str(cores),
                                                      "mpi": MPI.Get_library_version().splitlines()[0]}}
    if "allreduce" in wanted:
        results["allreduce"] = bench_allreduce(args.mib, args.rounds * 5)
    if "data_parallel" in wanted:
        results["data_parallel"] = bench_data_parallel(args.batch, args.steps, args.rounds)
    if RANK != 0:
        return 0
    print_results(results, width=24)
    print_targets(results, TARGETS)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def main(argv: Sequence[str] = ()) -> int:
    p = argparse.ArgumentParser(prog="polyjit bench distributed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=count, default=64, help="size of the all-reduced node")
    p.add_argument("--batch", type=count, default=1024, help="global batch of the data-parallel MLP")
    p.add_argument("--steps", type=count, default=20, help="steps per timed block")
    p.add_argument("--rounds", type=count, default=3, help="timed blocks per contender")
    p.add_argument("--ranks", type=count, default=2, help="ranks to start when run without mpiexec")
    p.add_argument("--only", type=subset_of(GROUPS, "group"), default="",
                   help=f"comma-separated subset: {','.join(GROUPS)}")
    p.add_argument("--json", type=output_file, help="write the results to this file (rank 0)")
    args = p.parse_args(list(argv))
    if SIZE == 1 and args.ranks > 1:  # not under mpiexec: start the job
        cmd = mpiexec_command(args.ranks, str(Path(__file__).resolve()), *argv)
        return subprocess.run(cmd, env={**os.environ, "POLYJIT_CPU_DEVICES": "1"}).returncode
    return run(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
