"""Data-parallel training of a small classifier on two spirals, on every device of a backend.

    python examples/mlp_data_parallel.py                       # the CPU split into 2 devices
    python examples/mlp_data_parallel.py --devices 4 --steps 500
    python examples/mlp_data_parallel.py --backend opencl

Each device runs the forward and backward pass on its shard of the batch; the
gradients are summed with a tree all-reduce through the devices' merge
buffers; every replica applies the same Adam update. An evaluation plan links
into replica 0's context and reads the trained parameters where they are.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from polyjit import tensor as pt
from polyjit.backends import get_backend
from polyjit.demo.datasets import two_spirals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--devices", type=int, default=2, help="devices (the cpu backend is split into this many)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--hidden", type=int, default=64)
    args = p.parse_args(argv)

    if args.backend == "cpu":
        from polyjit.backends.cpu import create_backend

        backend = create_backend(num_devices=args.devices)
    else:
        backend = get_backend(args.backend)
    devices = backend.devices()[: args.devices]
    batch = args.batch - args.batch % len(devices)

    x_all, y_all = two_spirals(4096, seed=0)
    model = pt.MLP("mlp", [2, args.hidden, args.hidden, 2], activation="relu", seed=0)

    def model_step(x: pt.Tensor, y: pt.Tensor) -> pt.Tensor:
        """The loss of one shard: called once, with tensors of the shard's shape."""
        return pt.cross_entropy(model(x), y)

    dp = pt.data_parallel(
        model_step,
        {"x": ((batch, 2), "float32"), "y": ((batch,), "int32")},
        optimizer=pt.Adam(lr=0.01),
        devices=devices,
    )
    x_eval, y_eval = pt.input("x_eval", x_all.shape), pt.input("y_eval", y_all.shape, "int32")
    evaluate = pt.compile({"correct": pt.accuracy_count(model(x_eval), y_eval)}, share=dp)

    print(f"{len(devices)} device(s): {', '.join(d.device_id for d in devices)}; "
          f"all-reduce rounds: {dp.rounds}")
    rng = np.random.default_rng(1)
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        idx = rng.integers(0, len(x_all), batch)
        loss = dp.step(x=x_all[idx], y=y_all[idx])
        if step % max(args.steps // 8, 1) == 0 or step == args.steps:
            rate = step * batch / (time.perf_counter() - t0)  # everything is compiled and linked before
            print(f"step {step:5d}  loss {loss:.4f}  {rate:9.0f} samples/s")
    accuracy = float(evaluate.run(x_eval=x_all, y_eval=y_all)["correct"]) / len(x_all)
    print(f"accuracy {accuracy:.1%}; replicas differ by {dp.replica_spread():.1e}")
    evaluate.close()
    dp.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
