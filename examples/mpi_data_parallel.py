"""Data-parallel training of the two-spirals classifier across MPI ranks (and devices).

    pip install 'polyjit[mpi]'
    mpiexec -n 2 python examples/mpi_data_parallel.py                   # 2 ranks x 1 cpu device
    mpiexec -n 2 python examples/mpi_data_parallel.py --devices 2       # 2 ranks x 2 devices
    mpiexec -n 3 python examples/mpi_data_parallel.py --steps 300       # any number of ranks

(Open MPI's mpiexec wants ``--oversubscribe`` for more ranks than cores and, as root,
``--allow-run-as-root``; the mpich wheel's needs neither.)

Every rank builds the same model and calls ``data_parallel(..., comm=Comm())``. Each step,
every rank passes the same global batch; rank r trains on rows ``[r*B/R, (r+1)*B/R)``,
split again over its devices. Gradients are summed by the merge-buffer tree inside each
rank, one MPI all-reduce among the ranks, and the tree back down; every replica on every
rank applies the same Adam update, so all parameters stay equal (the run checks it). Rank 0
prints the progress and the accuracy of an evaluation plan that reads the parameters where
they are.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from polyjit import tensor as pt
from polyjit.backends.cpu import create_backend
from polyjit.demo.datasets import two_spirals
from polyjit.distributed import Comm, bind_to_cores


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=1, help="cpu devices per rank")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=256, help="global batch (over every rank and device)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--no-bind", action="store_true", help="do not pin each rank to its own cores")
    args = p.parse_args(argv)

    comm = Comm()  # over MPI.COMM_WORLD; a collective call, like every call below
    cores = None if args.no_bind else bind_to_cores()  # before the cpu backend starts
    backend = create_backend(num_devices=args.devices)
    devices = backend.devices()
    replicas = comm.size * len(devices)
    batch = args.batch - args.batch % replicas

    x_all, y_all = two_spirals(4096, seed=0)
    model = pt.MLP("mlp", [2, args.hidden, args.hidden, 2], activation="relu", seed=0)

    def model_step(x: pt.Tensor, y: pt.Tensor) -> pt.Tensor:
        """The loss of one shard: called once, with tensors of the shard's shape."""
        return pt.cross_entropy(model(x), y)

    dp = pt.data_parallel(model_step, {"x": ((batch, 2), "float32"), "y": ((batch,), "int32")},
                          optimizer=pt.Adam(lr=0.01), devices=devices, comm=comm)
    x_eval, y_eval = pt.input("x_eval", x_all.shape), pt.input("y_eval", y_all.shape, "int32")
    evaluate = pt.compile({"correct": pt.accuracy_count(model(x_eval), y_eval)}, share=dp)

    lead = comm.rank == 0
    if lead:
        print(f"{comm.size} ranks x {len(devices)} device(s) = {replicas} replicas, global batch {batch} "
              f"({dp.shard} per replica); rank 0 on cores {cores}", flush=True)
    rng = np.random.default_rng(1)  # the same seed on every rank: the same global batches
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        idx = rng.integers(0, len(x_all), batch)
        loss = dp.step(x=x_all[idx], y=y_all[idx])  # the mean loss over every rank
        if lead and (step % max(args.steps // 8, 1) == 0 or step == args.steps):
            rate = step * batch / (time.perf_counter() - t0)
            print(f"step {step:5d}  loss {loss:.4f}  {rate:9.0f} samples/s", flush=True)
    accuracy = float(evaluate.run(x_eval=x_all, y_eval=y_all)["correct"]) / len(x_all)
    spread = dp.rank_spread()  # collective: every rank calls it
    if lead:
        print(f"accuracy {accuracy:.1%}; ranks differ by {spread:.1e}, replicas by {dp.replica_spread():.1e}")
    evaluate.close()
    dp.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
