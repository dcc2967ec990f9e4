"""Tensor front-end benchmarks (``polyjit bench tensor``).

- MLP 784-256-10 training step (SGD with momentum), batch 256, float32: polyjit on the
  CPU backend vs the same model in numpy with hand-written gradients, and PyTorch's CPU
  build beside them when it is importable (samples/s; target: polyjit >= numpy);
- the char_lm model of examples/char_lm.py in compiled mode (samples/s), on the CPU or on
  the device ``--lm-device`` names (``--lm-device cuda:0 --only char_lm`` on a GPU);
- host time per step, compiled vs dynamic dispatch (target: compiled <= 20% of dynamic);
- data parallel on 2 CPU devices of one core each vs 1 device of one core
  (target: >= 1.6x), with the all-reduce time per step, and the ceiling this machine
  puts on it: how much faster the two devices run their compute routines together than
  one after the other (2.0 on independent cores; vCPUs that share a physical core's
  vector units give much less).

Every figure is the best of several timed blocks: the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from polyjit import tensor as pt
from polyjit.backends import get_backend
from polyjit.backends.cpu import cpu_model, create_backend
from polyjit.bench.common import Target, print_targets
from polyjit.bench.timing import best_of
from polyjit.demo.datasets import context_windows, encode_text
from polyjit.tensor.plan import Mode

Array = np.ndarray[Any, Any]
ROOT = Path(__file__).resolve().parent.parent
TARGETS: list[Target] = [
    ("mlp", "polyjit_vs_numpy", ">=", 1.0),
    ("dispatch", "host_ratio", "<=", 0.2),
    ("data_parallel", "speedup", ">=", 1.6),
]


def best_rates(steps: dict[str, Callable[[], Any]], samples_per_step: int, n: int, rounds: int = 3,
               blocks: int = 3) -> dict[str, float]:
    """Samples per second of the fastest block of ``n`` calls of each step function. The
    contenders take turns, round after round, so that a burst of load on a shared machine hits
    them alike; each turn starts with untimed steps (thread pools that spin after their last
    job must not slow the next contender's timed blocks)."""
    best = dict.fromkeys(steps, 0.0)
    for _ in range(rounds):
        for name, step in steps.items():
            for _ in range(max(3, n // 4)):
                step()
            for _ in range(blocks):
                t0 = time.perf_counter()
                for _ in range(n):
                    step()
                best[name] = max(best[name], samples_per_step * n / (time.perf_counter() - t0))
    return best


def mnist_like(batch: int, seed: int = 0) -> tuple[Array, Array]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, 784)).astype(np.float32), rng.integers(0, 10, batch).astype(np.int32)


# ---------------------------------------------------------------------------
# MLP 784-256-10


def polyjit_mlp_step(batch: int, device: Any = None) -> Callable[[], float]:
    x, y = pt.input("x", (batch, 784)), pt.input("y", (batch,), "int32")
    mlp = pt.MLP("mlp", [784, 256, 10], seed=0)
    plan = pt.compile(loss=pt.cross_entropy(mlp(x), y), optimizer=pt.SGD(0.01, momentum=0.9), device=device)
    xs, ys = mnist_like(batch)
    return lambda: plan.step(x=xs, y=ys)


def numpy_mlp_step(batch: int) -> Callable[[], float]:
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((784, 256)) * np.sqrt(2 / 784)).astype(np.float32)
    w2 = (rng.standard_normal((256, 10)) * np.sqrt(2 / 256)).astype(np.float32)
    b1, b2 = np.zeros(256, np.float32), np.zeros(10, np.float32)
    params = [w1, b1, w2, b2]
    moments = [np.zeros_like(p) for p in params]
    xs, ys = mnist_like(batch)
    rows = np.arange(batch)

    def step() -> float:
        h = xs @ w1 + b1
        a = np.maximum(h, 0)
        logits = a @ w2 + b2
        z = logits - logits.max(1, keepdims=True)
        e = np.exp(z)
        s = e.sum(1, keepdims=True)
        loss = float(np.mean(np.log(s[:, 0]) - z[rows, ys]))
        d = e / s
        d[rows, ys] -= 1
        d /= batch
        da = d @ w2.T
        da[h <= 0] = 0
        grads = [xs.T @ da, da.sum(0), a.T @ d, d.sum(0)]
        for p, m, g in zip(params, moments, grads):
            m *= 0.9
            m += g
            p -= 0.01 * m
        return loss

    return step


def torch_mlp_step(batch: int) -> Callable[[], float] | None:
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    lossf = torch.nn.CrossEntropyLoss()
    xs, ys = mnist_like(batch)
    xt, yt = torch.from_numpy(xs), torch.from_numpy(ys.astype(np.int64))

    def step() -> float:
        opt.zero_grad()
        loss = lossf(model(xt), yt)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def torch_mlp_rate(batch: int, steps: int) -> float | None:
    """PyTorch's samples/s, measured in a child process: its thread pool keeps spinning after
    a step, and on a small machine that would slow whatever this process runs next."""
    proc = subprocess.run([sys.executable, __file__, "--torch-mlp", "--batch", str(batch), "--steps", str(steps)],
                          capture_output=True, text=True, check=False)
    lines = proc.stdout.split()
    return float(lines[-1]) if proc.returncode == 0 and lines and lines[-1] != "none" else None


def bench_mlp(batch: int, steps: int) -> dict[str, float]:
    contenders = {"polyjit": polyjit_mlp_step(batch), "numpy": numpy_mlp_step(batch)}
    out = {f"{k}_samples_s": v for k, v in best_rates(contenders, batch, steps).items()}
    torch_rate = torch_mlp_rate(batch, steps)
    if torch_rate is not None:
        out["torch_samples_s"] = torch_rate
    out["polyjit_vs_numpy"] = out["polyjit_samples_s"] / out["numpy_samples_s"]
    return out


# ---------------------------------------------------------------------------
# char_lm and dispatch modes


def char_lm_plan(batch: int, mode: Mode, device: str = "cpu") -> tuple[pt.Plan, Callable[[], dict[str, Array]]]:
    from polyjit.demo import char_lm
    codes = encode_text(char_lm.TEXT.read_text())
    contexts, targets = context_windows(codes, char_lm.CONTEXT)
    model = char_lm.CharModel()
    ctx, nxt = pt.input("context", (batch, char_lm.CONTEXT), "int32"), pt.input("next", (batch,), "int32")
    plan = pt.compile(loss=pt.cross_entropy(model(ctx), nxt), optimizer=pt.AdamW(lr=0.01), mode=mode,
                      device=device)
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(8):
        idx = rng.integers(0, len(contexts), batch)
        batches.append({"context": contexts[idx], "next": targets[idx]})
    it = iter(range(1 << 62))
    return plan, lambda: batches[next(it) % len(batches)]


def bench_char_lm(batch: int, steps: int, device: str) -> dict[str, float]:
    plan, data = char_lm_plan(batch, "compiled", device)
    return {"compiled_samples_s": best_rates({"lm": lambda: plan.step(**data())}, batch, steps)["lm"]}


def host_and_wall(plan: pt.Plan, data: Callable[[], dict[str, Array]], steps: int) -> tuple[float, float]:
    """Seconds per step the host spends enqueueing (inputs + routines), and per whole step."""
    host = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        batch = data()
        t1 = time.perf_counter()
        plan._launch(batch, None)
        host += time.perf_counter() - t1
        plan.context.stream.synchronize()
    return host / steps, (time.perf_counter() - t0) / steps


def bench_dispatch(batch: int, steps: int) -> dict[str, float]:
    compiled, data_c = char_lm_plan(batch, "compiled")
    dynamic, data_d = char_lm_plan(batch, "dynamic")
    for _ in range(5):
        compiled.step(**data_c())
        dynamic.step(**data_d())
    host_c = wall_c = host_d = wall_d = float("inf")
    for _ in range(7):  # alternate: load bursts on a shared machine hit both alike
        h, w = host_and_wall(compiled, data_c, steps)
        host_c, wall_c = min(host_c, h), min(wall_c, w)
        h, w = host_and_wall(dynamic, data_d, steps)
        host_d, wall_d = min(host_d, h), min(wall_d, w)
    return {"compiled_host_us": host_c * 1e6, "dynamic_host_us": host_d * 1e6,
            "host_ratio": host_c / host_d, "compiled_step_us": wall_c * 1e6, "dynamic_step_us": wall_d * 1e6,
            "dynamic_routines": float(len(dynamic.program.steps))}


# ---------------------------------------------------------------------------
# Data parallel


def concurrent_scaling(dp: pt.DataParallel, repeats: int = 20) -> float:
    """How much faster two devices get through their compute routines together than one after
    the other: 2.0 on independent cores; less where the cores share execution units."""
    def seconds(replicas: list[Any]) -> float:
        def block() -> None:
            for _ in range(repeats):
                for rep in replicas:
                    rep.compute.run()
                for rep in replicas:
                    rep.linked.stream.synchronize()

        return best_of(block, repeat=5, warmup=0) / repeats

    alone = sum(seconds([rep]) for rep in dp.replicas)
    return alone / seconds(dp.replicas)


def bench_data_parallel(batch: int, steps: int) -> dict[str, float]:
    backend = create_backend(num_devices=2)  # one core each on a 2-core machine
    xs, ys = mnist_like(batch)
    dps = {}
    for n in (1, 2):
        mlp = pt.MLP("mlp", [784, 256, 10], seed=0)
        dps[n] = pt.data_parallel(lambda x, y, mlp=mlp: pt.cross_entropy(mlp(x), y),
                                  {"x": ((batch, 784), "float32"), "y": ((batch,), "int32")},
                                  optimizer=pt.SGD(0.01, momentum=0.9), devices=backend.devices()[:n])
    rates = best_rates({"1": lambda: dps[1].step(x=xs, y=ys), "2": lambda: dps[2].step(x=xs, y=ys)},
                       batch, steps)
    for _ in range(steps):
        dps[2].step_profiled(x=xs, y=ys)
    allreduce = float(np.median(dps[2].timings["allreduce"]))
    scaling = concurrent_scaling(dps[2])
    for dp in dps.values():
        dp.close()
    cores = backend.get_device(0).properties["cores"]
    return {"one_device_samples_s": rates["1"], "two_devices_samples_s": rates["2"],
            "speedup": rates["2"] / rates["1"],
            "allreduce_ms": allreduce * 1e3, "cores_per_device": float(len(cores)),
            "compute_scaling_ceiling": scaling}


def main(argv: Sequence[str] = ()) -> int:
    p = argparse.ArgumentParser(prog="polyjit bench tensor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="steps per timed block")
    p.add_argument("--batch", type=int, default=256, help="MLP batch")
    p.add_argument("--dp-batch", type=int, default=1024,
                   help="global batch of the data-parallel MLP (512 per device on 2 devices)")
    p.add_argument("--lm-batch", type=int, default=128, help="char_lm batch")
    p.add_argument("--lm-device", default="cpu",
                   help="device of the char_lm group, e.g. cuda:0 (the other groups run on the CPU)")
    p.add_argument("--only", default="", help="comma-separated subset: mlp,char_lm,dispatch,data_parallel")
    p.add_argument("--json", help="write the results to this file")
    p.add_argument("--torch-mlp", action="store_true", help=argparse.SUPPRESS)  # the child of torch_mlp_rate
    args = p.parse_args(list(argv))
    if args.torch_mlp:
        step = torch_mlp_step(args.batch)
        print("none" if step is None else best_rates({"torch": step}, args.batch, args.steps)["torch"])
        return 0
    wanted = set(filter(None, args.only.split(","))) or {"mlp", "char_lm", "dispatch", "data_parallel"}
    results: dict[str, dict[str, Any]] = {
        "machine": {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
                    "numpy": np.__version__, "devices": get_backend("cpu").num_devices()},
    }
    if "mlp" in wanted:
        results["mlp"] = bench_mlp(args.batch, args.steps)
    if "char_lm" in wanted:
        results["char_lm"] = {"device": args.lm_device,
                              **bench_char_lm(args.lm_batch, args.steps * 3, args.lm_device)}
    if "dispatch" in wanted:
        results["dispatch"] = bench_dispatch(args.lm_batch, args.steps)
    if "data_parallel" in wanted:
        results["data_parallel"] = bench_data_parallel(args.dp_batch, args.steps)
    print(f"machine: {results['machine']}")
    for group, values in results.items():
        if group == "machine":
            continue
        print(f"[{group}]")
        for key, val in values.items():
            print(f"  {key:24s} {val:14.3f}" if isinstance(val, float) else f"  {key:24s} {val:>14}")
    print_targets(results, TARGETS)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
