"""Copy bandwidth of a backend: host -> device, device -> host, and device -> device for every
pair of its devices (the diagonal: a copy between two buffers of one device).

    python examples/transfers.py                      # the CPU split into 2 devices, 64 MiB
    python examples/transfers.py --backend opencl --mib 256

Copies go through the public runtime API: ``Context.from_host`` / ``to_host``
and ``device_to_device``; each is timed from enqueue to a synchronized stream.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import numpy as np

from polyjit import device_to_device, ir
from polyjit.backends import get_backend
from polyjit.core.runtime import Backend, Context


def best_seconds(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm up: first touches of the pages, merge-buffer growth
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(backend: Backend, nbytes: int, repeats: int) -> tuple[list[str], dict[str, float], list[list[float]]]:
    node = ir.Node("payload", (nbytes // 4,), "float32")
    host = np.random.default_rng(0).standard_normal(node.shape).astype(np.float32)
    back = np.empty_like(host)
    devices = backend.devices()
    contexts: list[Context] = [d.make_context().init_from_host(node, host) for d in devices]
    spare: list[Context] = [d.make_context().init_from_host(node, host) for d in devices]
    gbs = lambda s: nbytes / s / 1e9  # noqa: E731

    rows: dict[str, float] = {}
    for d, ctx in zip(devices, contexts):
        def h2d(ctx: Context = ctx) -> None:
            ctx.from_host(node, host)
            ctx.stream.synchronize()

        def d2h(ctx: Context = ctx) -> None:
            ctx.to_host(node, back)

        rows[f"{d.device_id} host->device"] = gbs(best_seconds(h2d, repeats))
        rows[f"{d.device_id} device->host"] = gbs(best_seconds(d2h, repeats))
        np.testing.assert_array_equal(back, host)

    matrix = [[0.0] * len(devices) for _ in devices]
    for i, src in enumerate(contexts):
        for j in range(len(devices)):
            dst = spare[j] if i == j else contexts[j]

            def d2d(dst: Context = dst, src: Context = src) -> None:
                routine = device_to_device(node, dst=dst, src=src)
                assert routine is not None
                dst.stream.synchronize()

            matrix[i][j] = gbs(best_seconds(d2d, repeats))
    for ctx in contexts + spare:
        ctx.finalize()
    return [d.device_id for d in devices], rows, matrix


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--devices", type=int, default=2, help="cpu only: split the machine into this many")
    p.add_argument("--mib", type=float, default=64.0, help="size of each copy in MiB")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    if args.backend == "cpu":
        from polyjit.backends.cpu import create_backend

        backend = create_backend(num_devices=args.devices)
    else:
        backend = get_backend(args.backend)
    nbytes = int(args.mib * (1 << 20)) // 4 * 4
    names, rows, matrix = measure(backend, nbytes, args.repeats)
    print(f"{backend.name}: {len(names)} device(s), copies of {nbytes / (1 << 20):.1f} MiB, best of {args.repeats}")
    for label, value in rows.items():
        print(f"  {label:28s} {value:8.2f} GB/s")
    width = max(len(n) for n in names) + 2
    print("device -> device (GB/s), rows: source, columns: destination")
    print(" " * width + "".join(f"{n:>{width + 4}}" for n in names))
    for name, row in zip(names, matrix):
        print(f"{name:{width}}" + "".join(f"{v:>{width + 4}.2f}" for v in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
