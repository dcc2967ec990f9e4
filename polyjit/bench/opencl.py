"""OpenCL backend benchmarks (``polyjit bench opencl``): each polyjit number is measured beside a
hand-written pyopencl equivalent in the same run, on the same device.

- elementwise copy, add and the fused chain ``a*b + c*d - e`` on 2^24 float32 (64 MiB per array: memory-bound, not cache-bound):
  time of a hand-written pyopencl kernel / time of the polyjit routine (target >= 0.9)
- float32 matmul 1024^3: GFLOP/s of the tiled kernel vs a naive one-work-item-per-cell
  kernel (target >= 10x) and vs numpy
- ``routine.run()`` of a tiny kernel vs a bare ``cl.enqueue_nd_range_kernel`` of the same
  kernel, per enqueue, until the queue is finished (target <= 2x); the host's time in
  each loop alone; and, for reference, the bare enqueue paced like ``routine.run()`` (each
  followed by a spin as long as run()'s extra host time)
- device-to-device copy of 64 MiB between two devices of one platform vs ``cl.enqueue_copy``
  between the same buffers (target >= 0.8); PoCL shows two devices with
  ``POCL_DEVICES="pthread pthread"``, which ``main`` sets unless it is set already

Timings are the best of several repetitions: on a shared machine the minimum is the
least disturbed run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from polyjit.bench.common import Target, linked_matmul, print_targets
from polyjit.bench.timing import best_of, best_of_each
from polyjit.cli import count, output_file

Report = Callable[[str, float, str], None]


def print_report(name: str, value: float, unit: str) -> None:
    print(f"  {name:40s} {value:12.3f} {unit}", flush=True)


def _queue_of(routine: Any) -> Any:
    return routine.context.stream.handle.queue


# ---------------------------------------------------------------------------
# Elementwise


HAND_ELEMENTWISE = {
    "copy": ("__global const float* a", "out[i] = a[i];", 1),
    "add": ("__global const float* a, __global const float* b", "out[i] = a[i] + b[i];", 2),
    "chain": ("__global const float* a, __global const float* b, __global const float* c, "
              "__global const float* d, __global const float* e",
              "out[i] = a[i] * b[i] + c[i] * d[i] - e[i];", 5),
}


def _elementwise_comp(kind: str, n: int) -> tuple[Any, list[Any], Any]:
    from polyjit.core import ir
    from polyjit.demo import chain_program

    if kind == "chain":
        return chain_program(n)
    a, b, out = ir.Node("a", (n,)), ir.Node("b", (n,)), ir.Node("out", (n,))
    if kind == "copy":
        return ir.Comp.of(ir.apply(ir.Op.ID, a, into=out)), [a], out
    return ir.Comp.of(ir.apply(ir.Op.ADD, a, b, into=out)), [a, b], out


def bench_elementwise(report: Report, n: int = 1 << 24, repeat: int = 30) -> dict[str, float]:
    import pyopencl as cl

    from polyjit.backends import get_backend

    backend = get_backend("opencl")
    dev = backend.get_device(0)
    rng = np.random.default_rng(0)
    results: dict[str, float] = {}
    for kind, (params, body, arity) in HAND_ELEMENTWISE.items():
        comp, inputs, out = _elementwise_comp(kind, n)
        host = [rng.random(n, dtype=np.float32) for _ in range(arity)]
        ctx = dev.make_context()
        for node, value in zip(inputs, host):
            ctx = ctx.init_from_host(node, value)
        routine = ctx.link(backend.compile(comp, name=f"bench_{kind}"))
        stream = routine.context.stream

        def polyjit_run(routine: Any = routine, stream: Any = stream) -> None:
            routine.run()
            stream.synchronize()

        # The hand-written kernel: plain pointers, the exact global size, the runtime's choice of
        # work-group, on a copy of the very buffers the routine uses (so memory placement is equal).
        queue = _queue_of(routine)
        cl_ctx = queue.context
        mf = cl.mem_flags
        bufs = []
        for node in inputs:
            loc = routine.context.buffers[node]
            buf = cl.Buffer(cl_ctx, mf.READ_WRITE, size=n * 4)
            cl.enqueue_copy(queue, buf, dev.pool_handle(loc.pool_id), byte_count=n * 4, src_offset=loc.offset)
            bufs.append(buf)
        res = cl.Buffer(cl_ctx, mf.READ_WRITE, size=n * 4)
        cl.enqueue_fill_buffer(queue, res, np.zeros(1, np.float32), 0, n * 4)
        src = f"__kernel void hand({params}, __global float* out) {{ size_t i = get_global_id(0); {body} }}"
        kernel = cl.Program(cl_ctx, src).build().hand
        kernel.set_args(*bufs, res)

        def hand_run(queue: Any = queue, kernel: Any = kernel) -> None:
            cl.enqueue_nd_range_kernel(queue, kernel, (n,), None).wait()

        t = best_of_each({"polyjit": polyjit_run, "hand": hand_run}, repeat)
        t_pj, t_hand = t["polyjit"], t["hand"]
        want = np.empty(n, np.float32)
        cl.enqueue_copy(queue, want, res)
        got = routine.context.read(out)
        assert np.allclose(got, want, rtol=1e-6, atol=1e-6), f"{kind}: polyjit and the hand kernel differ"
        gbs = (arity + 1) * n * 4 / t_pj / 1e9
        results[f"{kind}_polyjit_ms"] = t_pj * 1e3
        results[f"{kind}_hand_ms"] = t_hand * 1e3
        results[f"{kind}_ratio"] = t_hand / t_pj
        report(f"elementwise {kind}: polyjit", t_pj * 1e3, f"ms ({gbs:.1f} GB/s)")
        report(f"elementwise {kind}: hand-written pyopencl", t_hand * 1e3, "ms")
        report(f"elementwise {kind}: hand / polyjit", t_hand / t_pj, "(target >= 0.9)")
        routine.context.finalize()
    return results


# ---------------------------------------------------------------------------
# Matmul


NAIVE_MATMUL = """
__kernel void naive(__global const float* a, __global const float* b, __global float* c) {
  const int j = get_global_id(0), i = get_global_id(1);
  float acc = 0.0f;
  for (int k = 0; k < %(n)d; ++k) acc += a[i * %(n)d + k] * b[k * %(n)d + j];
  c[i * %(n)d + j] = acc;
}
"""


def bench_matmul(report: Report, m: int = 1024, repeat: int = 5) -> dict[str, float]:
    import pyopencl as cl

    routine, xa, xb, c = linked_matmul("opencl", m)
    stream = routine.context.stream
    def polyjit_run() -> None:
        routine.run()
        stream.synchronize()

    t_pj = best_of(polyjit_run, repeat=repeat)
    expected = xa @ xb
    err = float(np.abs(routine.context.read(c) - expected).max() / np.abs(expected).max())

    queue = _queue_of(routine)
    mf = cl.mem_flags
    ba = cl.Buffer(queue.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=xa)
    bb = cl.Buffer(queue.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=xb)
    bc = cl.Buffer(queue.context, mf.WRITE_ONLY, size=m * m * 4)
    naive = cl.Program(queue.context, NAIVE_MATMUL % {"n": m}).build().naive
    naive.set_args(ba, bb, bc)
    t_naive = best_of(lambda: cl.enqueue_nd_range_kernel(queue, naive, (m, m), None).wait(),
                      repeat=1, warmup=1)
    t_np = best_of(lambda: xa @ xb, repeat=repeat)
    routine.context.finalize()
    flops = 2.0 * m**3
    out = {
        "polyjit_GFLOPs": flops / t_pj / 1e9,
        "naive_GFLOPs": flops / t_naive / 1e9,
        "numpy_GFLOPs": flops / t_np / 1e9,
        "speedup_vs_naive": t_naive / t_pj,
        "fraction_of_numpy": t_np / t_pj,
        "rel_error": err,
    }
    report(f"matmul {m}^3 float32: polyjit tiled", out["polyjit_GFLOPs"], "GFLOP/s")
    report("matmul: naive one-work-item-per-cell", out["naive_GFLOPs"], "GFLOP/s")
    report("matmul: numpy", out["numpy_GFLOPs"], "GFLOP/s")
    report("matmul: polyjit / naive", out["speedup_vs_naive"], "x (target >= 10)")
    report("matmul: max relative error", err, "")
    return out


# ---------------------------------------------------------------------------
# Enqueue overhead


def bench_launch(report: Report, calls: int = 500, rounds: int = 40) -> dict[str, float]:
    import pyopencl as cl

    from polyjit.backends import get_backend
    from polyjit.core import ir

    backend = get_backend("opencl")
    x = ir.Node("x", (4,))
    code = backend.compile(ir.Comp.of(ir.apply(ir.Op.ADD, x, 1.0, into=x, accum=None)),
                           name="bench_tiny")
    ctx = backend.get_device(0).make_context().init_from_host(x, np.zeros(4, np.float32))
    routine = ctx.link(code)
    queue = _queue_of(routine)
    launch = routine._prepared.launches[0]  # the very cl.Kernel the routine enqueues
    kernel, gsize, lsize = launch.kernel, launch.global_size, launch.local_size
    enqueue = cl.enqueue_nd_range_kernel

    host = {"polyjit": float("inf"), "bare": float("inf")}  # the enqueue loop alone, before finish()

    def bare() -> None:
        t0 = time.perf_counter()
        for _ in range(calls):
            enqueue(queue, kernel, gsize, lsize)
        host["bare"] = min(host["bare"], time.perf_counter() - t0)
        queue.finish()

    def polyjit() -> None:
        run = routine.run
        t0 = time.perf_counter()
        for _ in range(calls):
            run()
        host["polyjit"] = min(host["polyjit"], time.perf_counter() - t0)
        queue.finish()

    # Many short rounds, alternating: the minimum of each is the least disturbed.
    t = best_of_each({"polyjit": polyjit, "bare": bare}, rounds)
    t_pj, t_bare = t["polyjit"], t["bare"]

    # The bare enqueue again, each followed by as much host time as routine.run() spends
    # beyond it (a spin): what the driver costs when the host feeds it at run()'s pace.
    gap = max(0.0, (host["polyjit"] - host["bare"]) / calls)

    def paced() -> None:
        clock = time.perf_counter
        for _ in range(calls):
            enqueue(queue, kernel, gsize, lsize)
            until = clock() + gap
            while clock() < until:
                pass
        queue.finish()

    t_paced = best_of_each({"paced": paced}, rounds)["paced"]
    routine.context.finalize()
    out = {"bare_enqueue_us": t_bare / calls * 1e6, "routine_run_us": t_pj / calls * 1e6,
           "ratio": t_pj / t_bare, "bare_host_us": host["bare"] / calls * 1e6,
           "routine_host_us": host["polyjit"] / calls * 1e6, "paced_bare_us": t_paced / calls * 1e6,
           "ratio_to_paced": t_pj / t_paced}
    report("enqueue: bare cl.enqueue_nd_range_kernel", out["bare_enqueue_us"], "us per kernel")
    report("enqueue: routine.run()", out["routine_run_us"], "us per kernel")
    report("enqueue: routine / bare", out["ratio"], "(target <= 2)")
    # Host time alone: a bare loop outruns PoCL's execution of a tiny kernel and leaves a
    # backlog for finish(); routine.run() does not, so each of its enqueues also wakes PoCL's
    # idle worker threads.
    report("enqueue: bare, host side only", out["bare_host_us"], "us per kernel")
    report("enqueue: routine.run(), host side only", out["routine_host_us"], "us per kernel")
    # A reference, not a target: when the host is slower than PoCL runs a tiny kernel, its
    # workers go idle between kernels and every enqueue costs more, the bare one too.
    report("enqueue: bare, paced like routine.run()", out["paced_bare_us"], "us per kernel")
    report("enqueue: routine / paced bare", out["ratio_to_paced"], "")
    return out


# ---------------------------------------------------------------------------
# Device to device


def bench_d2d(report: Report, nbytes: int = 64 << 20, repeat: int = 20) -> dict[str, float]:
    import pyopencl as cl

    from polyjit.backends import get_backend
    from polyjit.core import ir, runtime

    backend = get_backend("opencl")
    if backend.num_devices() < 2:
        report("d2d: skipped, devices", backend.num_devices(), "(needs 2 devices of one platform)")
        return {}
    d0, d1 = backend.get_device(0), backend.get_device(1)
    n = nbytes // 4
    node = ir.Node("payload", (n,))
    host = np.random.default_rng(0).random(n, dtype=np.float32)
    src = d0.make_context().init_from_host(node, host)
    dst = d1.make_context().init_from_host(node, np.zeros(n, np.float32))
    src.stream.synchronize()
    copy = runtime.device_to_device(node, dst=dst, src=src)
    assert copy is not None
    assert np.array_equal(dst.read(node), host)

    def polyjit_copy() -> None:
        copy.run()
        dst.stream.synchronize()

    queue = dst.stream.handle.queue
    sbuf = d0.pool_handle(src.buffers[node].pool_id)
    dbuf = d1.pool_handle(dst.buffers[node].pool_id)

    def bare_copy() -> None:
        cl.enqueue_copy(queue, dbuf, sbuf, byte_count=nbytes).wait()

    t = best_of_each({"polyjit": polyjit_copy, "bare": bare_copy}, repeat)
    t_pj, t_cl = t["polyjit"], t["bare"]
    dst.finalize()
    src.finalize()
    out = {"polyjit_GBs": nbytes / t_pj / 1e9, "enqueue_copy_GBs": nbytes / t_cl / 1e9,
           "ratio": t_cl / t_pj}
    report(f"d2d {nbytes >> 20} MiB: polyjit device_to_device", out["polyjit_GBs"], "GB/s")
    report("d2d: bare cl.enqueue_copy", out["enqueue_copy_GBs"], "GB/s")
    report("d2d: polyjit / bare", out["ratio"], "(target >= 0.8)")
    return out


TARGETS: list[Target] = [
    ("elementwise", "copy_ratio", ">=", 0.9),
    ("elementwise", "add_ratio", ">=", 0.9),
    ("elementwise", "chain_ratio", ">=", 0.9),
    ("matmul", "speedup_vs_naive", ">=", 10.0),
    ("launch", "ratio", "<=", 2.0),
    ("d2d", "ratio", ">=", 0.8),
]


def run(report: Report = print_report, *, size: int = 1 << 24, matmul: int = 1024) -> dict[str, dict[str, float]]:
    """Every benchmark, each number passed to ``report(name, value, unit)`` as it is measured."""
    from polyjit.backends import get_backend

    backend = get_backend("opencl")
    if backend.num_devices() == 0:
        reason = getattr(backend.driver, "unavailable_reason", None)
        raise SystemExit(f"no OpenCL device: {reason}")
    dev = backend.get_device(0)
    print(f"device 0: {dev.name} ({dev.properties.get('platform')}), "
          f"{backend.num_devices()} device(s), {os.cpu_count()} host cores", flush=True)
    results = {
        "elementwise": bench_elementwise(report, size),
        "matmul": bench_matmul(report, matmul),
        "launch": bench_launch(report),
        "d2d": bench_d2d(report),
    }
    return results


def main(argv: Sequence[str] = ()) -> int:
    p = argparse.ArgumentParser(prog="polyjit bench opencl")
    p.add_argument("--size", type=count, default=1 << 24, help="elements of the elementwise benchmarks")
    p.add_argument("--matmul", type=count, default=1024)
    p.add_argument("--json", type=output_file, help="write the results to this file")
    args = p.parse_args(list(argv))
    os.environ.setdefault("POCL_DEVICES", "pthread pthread")  # before OpenCL starts: two PoCL devices
    results = run(size=args.size, matmul=args.matmul)
    print_targets(results, TARGETS)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
