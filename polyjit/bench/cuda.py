"""Benchmarks of the CUDA backend (needs a GPU; compares with CuPy when it is importable).

1. bandwidth: an elementwise kernel and a fused elementwise chain vs cuMemcpyDtoD;
2. launch overhead: Routine.run() and the driver's bare launch vs a CuPy RawKernel of the
   same generated kernel;
3. graph replay: time per kernel of a replayed CUDA graph (cuda.capture) vs Routine.run();
4. float32 matmul 4096 x 4096 vs cupy.matmul;
5. a 1 GiB device-to-device copy (polyjit device_to_device) vs a bare cuMemcpyPeerAsync
   (between two GPUs when there are two, else within one).

    polyjit bench cuda [--quick] [--json out.json] [--require-gpu]

Without a GPU it prints why and exits 0 (1 with ``--require-gpu``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from polyjit import device_to_device
from polyjit.backends import cuda
from polyjit.bench.timing import median_per_call
from polyjit.cli import output_file
from polyjit.core import ir
from polyjit.core.ir import Node, Op

Result = dict[str, Any]


def _cupy() -> Any:
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
        return cupy
    except Exception:
        return None


def _line(name: str, value: float, unit: str, ref: float | None = None, ref_name: str = "") -> Result:
    extra = f"   ({ref_name}: {ref:.3f} {unit}, ratio {value / ref:.2f})" if ref else ""
    print(f"  {name:<48} {value:10.3f} {unit}{extra}")
    return {"name": name, "value": value, "unit": unit, "ref": ref, "ref_name": ref_name}


# ---------------------------------------------------------------------------


def bench_bandwidth(backend: cuda.CudaBackend, cp: Any, n: int) -> list[Result]:
    print(f"bandwidth, {n * 4 / 2**20:.0f} MiB float32 arrays (GB/s of reads + writes)")
    dev = backend.get_device(0)
    x, y, t1, t2, z = (Node(k, (n,)) for k in ("x", "y", "t1", "t2", "z"))
    host = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    ctx = dev.make_context().init_from_host(x, host)
    scale = ctx.link(backend.compile(ir.Comp.of(ir.apply(Op.MUL, x, 2.0, into=y)), name="scale"))
    chain = ctx.link(backend.compile(ir.Comp.of(
        ir.apply(Op.MUL, x, 1.5, into=t1), ir.apply(Op.ADD, t1, 0.25, into=t2), ir.apply(Op.TANH, t2, into=z)),
        name="chain"))
    sync = ctx.stream.synchronize
    out: list[Result] = []
    nbytes = 2 * n * 4
    drv = backend.driver
    cu = cuda.driver._cu()
    src_loc, dst_loc = ctx.buffers[x], scale.context.buffers[y]
    src_ptr = dev.pool_handle(src_loc.pool_id).ptr + src_loc.offset
    dst_ptr = dev.pool_handle(dst_loc.pool_id).ptr + dst_loc.offset
    stream = ctx.stream.handle

    def memcpy() -> None:  # the reference: a bare driver copy (raw cuda.bindings)
        drv._current(0)
        cu.cuMemcpyDtoDAsync(dst_ptr, src_ptr, n * 4, stream.handle)

    t_copy = median_per_call(memcpy, sync, reps=20)
    copy_bw = nbytes / t_copy / 1e9
    out.append(_line("cuMemcpyDtoDAsync", copy_bw, "GB/s"))
    out.append(_line("elementwise y = 2 x", nbytes / median_per_call(scale.run, sync, reps=20) / 1e9,
                     "GB/s", copy_bw, "memcpy"))
    out.append(_line("fused chain z = tanh(1.5 x + 0.25)",
                     nbytes / median_per_call(chain.run, sync, reps=20) / 1e9, "GB/s", copy_bw, "memcpy"))
    if cp is not None:
        cx = cp.asarray(host)
        t_cupy = median_per_call(lambda: cx * 2.0, cp.cuda.Device().synchronize, reps=20)
        out.append(_line("cupy y = 2 x", nbytes / t_cupy / 1e9, "GB/s"))
    for c in (chain.context, scale.context, ctx):
        c.finalize()
    return out


def bench_launch(backend: cuda.CudaBackend, cp: Any, reps: int) -> list[Result]:
    print("launch overhead of a one-element kernel (microseconds per launch, host side)")
    dev = backend.get_device(0)
    a, b = Node("a", (1,)), Node("b", (1,))
    ctx = dev.make_context().init_from_host(a, np.ones(1, np.float32))
    code = backend.compile(ir.Comp.of(ir.apply(Op.ADD, a, 1.0, into=b)), name="tiny")
    r = ctx.link(code)
    sync = ctx.stream.synchronize
    out: list[Result] = []
    t_run = median_per_call(r.run, sync, reps=reps) * 1e6
    prepared = r._prepared
    drv = backend.driver
    stream = ctx.stream.handle
    t_bare = median_per_call(lambda: drv.launch(stream, prepared, ()), sync, reps=reps) * 1e6
    ref = None
    if cp is not None:
        spec = code.batch.source.all_kernels[0]
        kern = cp.RawKernel(code.source, spec.name, options=("--std=c++17",))
        ca, cb = cp.ones(1, cp.float32), cp.zeros(1, cp.float32)
        grid, block = cuda.grid_and_block(spec.launch)
        ref = median_per_call(lambda: kern(grid, block, (cb, ca)), cp.cuda.Device().synchronize, reps=reps) * 1e6
    out.append(_line("Routine.run()", t_run, "us", ref, "cupy RawKernel"))
    out.append(_line("driver.launch (cuda.core launch, prepared args)", t_bare, "us", ref, "cupy RawKernel"))
    r.context.finalize()
    ctx.finalize()
    return out


def bench_graph(backend: cuda.CudaBackend, kernels: int, reps: int) -> list[Result]:
    print(f"graph replay of {kernels} small kernels (microseconds per kernel)")
    dev = backend.get_device(0)
    nodes = [Node(f"g{k}", (1024,)) for k in range(kernels + 1)]
    ctx = dev.make_context().init_from_host(nodes[0], np.zeros(1024, np.float32))
    comps = [ir.Comp.of(ir.apply(Op.ADD, nodes[k], 1.0, into=nodes[k + 1])) for k in range(kernels)]
    routines = ctx.link_batch(backend.compile_batch(comps, names=[f"step{k}" for k in range(kernels)]))
    sync = ctx.stream.synchronize

    def run_all() -> None:
        for r in routines:
            r.run()

    t_runs = median_per_call(run_all, sync, reps=max(1, reps // kernels)) / kernels * 1e6
    plan = cuda.capture(routines)
    t_replay = median_per_call(plan.replay, sync, reps=max(1, reps // kernels)) / kernels * 1e6
    want = np.full(1024, float(kernels), np.float32)
    got = routines[-1].context.read(nodes[-1])
    assert np.array_equal(got, want), "graph replay computed a wrong result"
    out = [_line("Routine.run() each", t_runs, "us"), _line("CudaGraph.replay()", t_replay, "us", t_runs, "run()")]
    plan.close()
    routines[0].context.finalize()
    ctx.finalize()
    return out


def bench_matmul(backend: cuda.CudaBackend, cp: Any, n: int) -> list[Result]:
    print(f"float32 matmul {n} x {n} x {n} (TFLOP/s)")
    dev = backend.get_device(0)
    a, b, c = Node("a", (n, n)), Node("b", (n, n)), Node("c", (n, n))
    rng = np.random.default_rng(1)
    ha, hb = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
    ctx = dev.make_context().init_from_host(a, ha).init_from_host(b, hb)
    r = ctx.link(backend.compile(ir.Comp.of(ir.einsum("ik,kj->ij", a, b, into=c)), name="matmul"))
    flops = 2.0 * n**3
    t = median_per_call(r.run, ctx.stream.synchronize, reps=5, rounds=3)
    ref = None
    if cp is not None:
        ca, cb = cp.asarray(ha), cp.asarray(hb)
        t_ref = median_per_call(lambda: cp.matmul(ca, cb), cp.cuda.Device().synchronize, reps=5, rounds=3)
        ref = flops / t_ref / 1e12
    got = r.context.read(c)
    rows = slice(0, 64)
    err = float(np.max(np.abs(got[rows] - ha[rows].astype(np.float64) @ hb)))
    out = [_line("polyjit tiled matmul", flops / t / 1e12, "TFLOP/s", ref, "cupy.matmul")]
    print(f"  max abs error on 64 rows: {err:.2e}")
    r.context.finalize()
    ctx.finalize()
    return out


def bench_copy(backend: cuda.CudaBackend, nbytes: int) -> list[Result]:
    two = backend.num_devices() >= 2
    print(f"device-to-device copy of {nbytes / 2**30:.2f} GiB ({'two GPUs' if two else 'one GPU'}; GB/s)")
    d0 = backend.get_device(0)
    d1 = backend.get_device(1) if two else d0
    x = Node("x", (nbytes // 4,))
    c0 = d0.make_context().init_from_host(x, np.zeros(nbytes // 4, np.float32))
    c1 = d1.make_context(d1.new_stream()).init_from_host(x, np.zeros(nbytes // 4, np.float32))
    routine = device_to_device(x, dst=c1, src=c0)
    assert routine is not None
    sync = c1.stream.synchronize
    t = median_per_call(routine.run, sync, reps=5)
    drv, cu = backend.driver, cuda.driver._cu()
    sloc, dloc = c0.buffers[x], c1.buffers[x]
    sptr = d0.pool_handle(sloc.pool_id).ptr + sloc.offset
    dptr = d1.pool_handle(dloc.pool_id).ptr + dloc.offset
    stream = c1.stream.handle

    ctx0 = cu.cuDevicePrimaryCtxRetain(d0.ordinal)[1]
    ctx1 = cu.cuDevicePrimaryCtxRetain(d1.ordinal)[1]

    def peer() -> None:  # the reference: a bare peer copy (raw cuda.bindings)
        drv._current(d1.ordinal)
        cu.cuMemcpyPeerAsync(dptr, ctx1, sptr, ctx0, nbytes, stream.handle)

    t_peer = median_per_call(peer, sync, reps=5)
    out = [_line("device_to_device routine", nbytes / t / 1e9, "GB/s", nbytes / t_peer / 1e9, "cuMemcpyPeerAsync")]
    c1.finalize()
    c0.finalize()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="polyjit bench cuda", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer repetitions")
    ap.add_argument("--json", type=output_file, help="write the results to this file")
    ap.add_argument("--require-gpu", action="store_true", help="exit 1 when there is no GPU")
    args = ap.parse_args(argv)
    try:
        backend = cuda.create_backend()
        count = backend.num_devices()
    except Exception as e:  # the cuda packages themselves are broken
        print(f"bench_cuda: the CUDA backend cannot start: {type(e).__name__}: {e}")
        return 1 if args.require_gpu else 0
    if count == 0:
        print(f"bench_cuda: skipped, no CUDA device: {backend.unavailable_reason}")
        return 1 if args.require_gpu else 0
    cp = _cupy()
    dev = backend.get_device(0)
    print(f"polyjit cuda on {dev.name} ({dev.properties['arch']}, {dev.properties['sm_count']} SMs), "
          f"{count} device(s); cupy: {'yes' if cp is not None else 'not importable'}")
    q = args.quick
    results: list[Result] = []
    results += bench_bandwidth(backend, cp, (1 << 24) if q else (1 << 26))
    results += bench_launch(backend, cp, 2000 if q else 20000)
    results += bench_graph(backend, 32, 2000 if q else 20000)
    results += bench_matmul(backend, cp, 1024 if q else 4096)
    results += bench_copy(backend, (1 << 28) if q else (1 << 30))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev.name, "properties": {k: v for k, v in dev.properties.items()
                                                          if isinstance(v, (int, float, str, bool))},
                       "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
