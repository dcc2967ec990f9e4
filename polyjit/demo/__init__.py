"""``polyjit demo``: train a small MLP on two spirals, data-parallel on every device of a backend;
``polyjit demo --kernels``: a fused elementwise chain and a matmul on every device of a backend,
checked against numpy.

Options (argparse attributes read by :func:`main`): ``backend`` (str),
``devices`` (int or None: how many devices; for the cpu backend, the machine
is split into that many), ``steps`` (int), ``batch`` (int), ``lr`` (float),
``seed`` (int), ``plot`` (a PNG path or None), ``kernels`` (bool: the kernels
demo instead of training), ``size`` (int: with ``kernels``, elements of the chain).

The demo's data set, terminal charts and PNG writer are :mod:`polyjit.demo.datasets`,
:mod:`polyjit.demo.plot` and :mod:`polyjit.demo.png`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

import numpy as np

from polyjit import tensor as pt
from polyjit.backends import get_backend
from polyjit.cli import count, file_problem, fmt_bytes, natural
from polyjit.core import ir
from polyjit.core.runtime import Backend
from polyjit.demo.datasets import two_spirals
from polyjit.demo.plot import Progress, ascii_chart
from polyjit.demo.png import line_chart, write_png

__all__ = ["add_arguments", "chain_program", "kernels", "main", "pick_backend", "run", "train"]


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The demo's options (``polyjit demo`` uses the same)."""
    p.add_argument("--backend", default="cpu", help="backend name (default: cpu)")
    p.add_argument("--devices", type=count, default=None,
                   help="devices to train on (default: all; the cpu backend is split into this many)")
    p.add_argument("--steps", type=count, default=300, help="training steps (default: 300)")
    p.add_argument("--batch", type=count, default=256, help="global batch size (default: 256)")
    p.add_argument("--lr", type=float, default=0.01, help="Adam learning rate (default: 0.01)")
    p.add_argument("--seed", type=natural, default=0, help="seed of the data and the weights (default: 0)")
    p.add_argument("--plot", default=None, metavar="FILE", help="also write the loss curve as a PNG")
    p.add_argument("--kernels", action="store_true",
                   help="instead: a fused chain and a matmul on every device, checked against numpy")
    p.add_argument("--size", type=count, default=1 << 20, help="with --kernels: elements of the chain")
    return p


def _options(args: argparse.Namespace) -> argparse.Namespace:
    """The parsed options, with defaults for any the caller's parser does not define."""
    defaults = add_arguments(argparse.ArgumentParser(add_help=False)).parse_args([])
    return argparse.Namespace(**{**vars(defaults), **vars(args)})


def main(args: argparse.Namespace) -> int:
    """Run the demo the options ask for: :func:`kernels` with ``kernels``, else :func:`train`."""
    args = _options(args)
    return kernels(args) if args.kernels else train(args)


def run(argv: Sequence[str] | None = None) -> int:
    """``python -m polyjit.demo [options]``."""
    parser = add_arguments(argparse.ArgumentParser(prog="polyjit demo", description=__doc__))
    return main(parser.parse_args(argv))


# ---------------------------------------------------------------------------
# Training


def pick_backend(name: str, devices: int | None) -> Backend:
    """The backend to train on. The CPU can be split freely: without POLYJIT_CPU_DEVICES it is
    split into --devices devices (default: 2 on a machine with 2 cores or more)."""
    if name == "cpu" and (devices is not None or "POLYJIT_CPU_DEVICES" not in os.environ):
        from polyjit.backends.cpu import create_backend

        cores = len(os.sched_getaffinity(0))
        return create_backend(num_devices=devices if devices is not None else min(2, cores))
    return get_backend(name)


def train(args: argparse.Namespace) -> int:
    """Train the MLP data-parallel; print the loss curve and the accuracy."""
    args = _options(args)
    problem = file_problem(args.plot) if args.plot else None
    if problem is not None:  # before the training, not after it
        print(f"polyjit demo: --plot {problem}", file=sys.stderr)
        return 2
    backend = pick_backend(args.backend, args.devices)
    devices = backend.devices()[: args.devices] if args.devices else backend.devices()
    if not devices:
        print(f"backend {backend.name} has no devices", file=sys.stderr)
        return 1
    batch = args.batch - args.batch % len(devices)
    if batch < 1:
        print(f"polyjit demo: --batch {args.batch} is less than one row for each of {len(devices)} devices",
              file=sys.stderr)
        return 2
    x_all, y_all = two_spirals(4096, seed=args.seed)
    mlp = pt.MLP("mlp", [2, 64, 64, 2], activation="relu", seed=args.seed)

    def model_step(x: pt.Tensor, y: pt.Tensor) -> pt.Tensor:
        return pt.cross_entropy(mlp(x), y)

    print(f"two spirals: MLP 2-64-64-2, Adam lr {args.lr}, batch {batch}, {args.steps} steps on "
          f"{len(devices)} device(s) of {backend.name}:")
    for d in devices:
        print(f"  {d.device_id:8s} {d.name}")
    t0 = time.perf_counter()
    dp = pt.data_parallel(model_step, {"x": ((batch, 2), "float32"), "y": ((batch,), "int32")},
                          optimizer=pt.Adam(args.lr), devices=devices)
    xe, ye = pt.input("x_eval", x_all.shape), pt.input("y_eval", y_all.shape, "int32")
    evaluate = pt.compile({"correct": pt.accuracy_count(mlp(xe), ye)}, share=dp).build()
    print(f"compiled and linked in {time.perf_counter() - t0:.2f} s")
    rng = np.random.default_rng(args.seed + 1)
    losses: list[float] = []
    bar = Progress(args.steps)
    for step in range(1, args.steps + 1):
        idx = rng.integers(0, len(x_all), batch)
        losses.append(dp.step(x=x_all[idx], y=y_all[idx]))
        bar.update(step, losses[-1], batch)
    correct = float(evaluate.run(x_eval=x_all, y_eval=y_all)["correct"])
    accuracy = correct / len(x_all)
    print(f"final loss {losses[-1]:.4f}, accuracy {accuracy:.1%} on {len(x_all)} points, "
          f"{bar.rate:.0f} samples/s, replicas differ by {dp.replica_spread():.1e}")
    print(ascii_chart(losses, title="training loss"))
    if args.plot:
        write_png(args.plot, line_chart(losses, log_y=True))
        print(f"loss curve written to {args.plot}")
    evaluate.close()
    dp.close()
    return 0 if accuracy > 0.5 or args.steps < 50 else 1


# ---------------------------------------------------------------------------
# Kernels


def chain_program(n: int) -> tuple[ir.Comp, list[ir.Node], ir.Node]:
    """``out = a*b + c*d - e``: three intermediates, inlined into one kernel."""
    a, b, c, d, e = (ir.Node(name, (n,)) for name in "abcde")
    ab, cd, s, out = ir.Node("ab", (n,)), ir.Node("cd", (n,)), ir.Node("s", (n,)), ir.Node("out", (n,))
    comp = ir.Comp.of(
        ir.apply(ir.Op.MUL, a, b, into=ab),
        ir.apply(ir.Op.MUL, c, d, into=cd),
        ir.apply(ir.Op.ADD, ab, cd, into=s),
        ir.apply(ir.Op.SUB, s, e, into=out),
    )
    return comp, [a, b, c, d, e], out


def _size_problem(n: int, backend: Backend) -> str | None:
    """Why the chain of ``n`` elements would not fit: its six float32 nodes on a device, or
    the host's inputs and numpy's check (about ten float32 arrays of ``n``)."""
    on_device = 6 * 4 * n
    for dev in backend.devices():
        if on_device > dev.info.memory_bytes:
            return (f"the chain's 6 float32 arrays need {fmt_bytes(on_device)} on each device, more than "
                    f"{dev.device_id}'s {fmt_bytes(dev.info.memory_bytes)}")
    on_host = 10 * 4 * n
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if on_host > memory:
        return (f"its inputs and numpy's check need about {fmt_bytes(on_host)} of host memory, "
                f"more than this machine's {fmt_bytes(memory)}")
    return None


def kernels(args: argparse.Namespace) -> int:
    """A fused chain and a matmul on every device of the backend, checked against numpy."""
    args = _options(args)
    backend = get_backend(args.backend)
    n, m = args.size, 256
    problem = _size_problem(n, backend)
    if problem is not None:  # before numpy or a device is asked for the memory
        print(f"polyjit demo: --size {n}: {problem}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    chain, inputs, out = chain_program(n)
    x, y, z = ir.Node("x", (m, m)), ir.Node("y", (m, m)), ir.Node("z", (m, m))
    batch = backend.compile_batch([chain, ir.Comp.of(ir.einsum("ik,kj->ij", x, y, into=z))],
                                  names=["chain", "matmul"])
    host = {node: rng.standard_normal(node.shape).astype(np.float32) for node in [*inputs, x, y]}
    a, b, c, d, e = (host[node] for node in inputs)
    expected_chain = a * b + c * d - e
    expected_mm = host[x] @ host[y]
    print(f"backend {backend.name}: {backend.num_devices()} device(s); "
          f"out = a*b + c*d - e on {n} float32, and a {m}x{m} matmul")
    ok = True
    for dev in backend.devices():
        ctx = dev.make_context()
        for node, value in host.items():
            ctx = ctx.init_from_host(node, value)
        chain_r, mm_r = ctx.link_batch(batch)
        t0 = time.perf_counter()
        chain_r.run()
        mm_r.run()
        dev.synchronize()
        dt = time.perf_counter() - t0
        got_chain, got_mm = chain_r.context.read(out), mm_r.context.read(z)
        err_c = float(np.abs(got_chain - expected_chain).max())
        err_m = float(np.abs(got_mm - expected_mm).max() / np.abs(expected_mm).max())
        good = err_c < 1e-5 and err_m < 1e-5
        ok &= good
        print(f"  {dev.device_id:10s} {dev.name[:48]:48s} {dt * 1e3:7.2f} ms  "
              f"chain err {err_c:.1e}  matmul rel err {err_m:.1e}  {'OK' if good else 'MISMATCH'}")
        chain_r.context.finalize()
        ctx.finalize()
    print("all results match numpy" if ok else "MISMATCH against numpy")
    return 0 if ok else 1
