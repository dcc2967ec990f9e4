"""CPU backend benchmarks (``polyjit bench cpu``): every ratio is measured in one run.

- fused chain ``a*b + c*d - e`` on 2^24 float32: vs numpy, and vs this machine's copy bandwidth
- ``routine.run()`` + wait for a tiny kernel vs a bare ctypes call of the same function
- float32 matmul 1024^3 through ``ir.einsum`` vs numpy's GFLOP/s, and both against the FMA
  peak of the device's cores (a raw kernel of FMAs in registers)
- a cached compile of a batch
- a 64 MiB node handed to numpy and back through DLPack (``Context.export`` /
  ``init_from_dlpack``) vs ``to_host``: the DLPack way copies nothing

``--quick`` runs every group at small sizes (a smoke run: its ratios mean little).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
from collections.abc import Sequence
from typing import Any

import numpy as np

from polyjit.backends import get_backend
from polyjit.backends.cpu import cpu_model
from polyjit.bench.common import Target, linked_matmul, print_targets
from polyjit.bench.timing import best_of, best_of_blocks, best_of_each, median_ns
from polyjit.cli import count, output_file
from polyjit.core import ir
from polyjit.core.compile_cache import SharedLibrary
from polyjit.core.routine import Routine
from polyjit.demo import chain_program


def bench_chain(n: int) -> dict[str, float]:
    backend = get_backend("cpu")
    dev = backend.get_device(0)
    comp, inputs, _ = chain_program(n)
    rng = np.random.default_rng(0)
    host = {node: rng.random(n, dtype=np.float32) for node in inputs}
    ctx = dev.make_context()
    for node, value in host.items():
        ctx = ctx.init_from_host(node, value)
    routine = ctx.link(backend.compile(comp, name="bench_chain"))

    # this machine's copy bandwidth: a polyjit copy kernel (all cores) and numpy's (one core)
    src, dst = ir.Node("src", (n,)), ir.Node("dst", (n,))
    copy_ctx = dev.make_context().init_from_host(src, host[inputs[0]])
    copy = copy_ctx.link(backend.compile(ir.Comp.of(ir.apply(ir.Op.ID, src, into=dst)), name="bench_copy"))
    a, b, c, d, e = (host[node] for node in inputs)
    y, tmp = np.empty_like(a), np.empty_like(a)

    def numpy_chain() -> None:
        np.multiply(a, b, out=y)
        np.multiply(c, d, out=tmp)
        np.add(y, tmp, out=y)
        np.subtract(y, e, out=y)

    # in turns: the VM's memory bandwidth drifts, and the targets are ratios
    t = best_of_each({"chain": lambda: run_and_wait(routine), "numpy_chain": numpy_chain,
                      "copy": lambda: run_and_wait(copy),
                      "numpy_copy": lambda: np.copyto(y, a)})
    t_pj, t_np = t["chain"], t["numpy_chain"]
    copy_bw = 2 * a.nbytes / min(t["copy"], t["numpy_copy"])
    chain_bw = 6 * a.nbytes / t_pj
    copy.context.finalize()
    routine.context.finalize()
    return {
        "chain_ms": t_pj * 1e3,
        "numpy_chain_ms": t_np * 1e3,
        "speedup_vs_numpy": t_np / t_pj,
        "chain_GBps": chain_bw / 1e9,
        "copy_GBps": copy_bw / 1e9,
        "fraction_of_copy_bw": chain_bw / copy_bw,
    }


def bench_launch() -> dict[str, float]:
    backend = get_backend("cpu")
    x, y = ir.Node("x", (4,)), ir.Node("y", (4,))
    code = backend.compile(ir.Comp.of(ir.apply(ir.Op.ADD, x, 1.0, into=y)), name="bench_tiny")
    ctx = backend.get_device(0).make_context().init_from_host(x, np.ones(4, np.float32))
    routine = ctx.link(code)
    stream = routine.context.stream
    library = SharedLibrary(code.batch.binary.data, "bench")
    lib = library.lib
    fn = lib.bench_tiny_0
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    fn.restype = None
    bufs = routine._prepared.keep[0]  # the very buffers the routine passes
    chunks = routine.kernels[0].plan.chunks  # its whole range: what one launch computes
    bare = median_ns(lambda: fn(bufs, None, 0, chunks))

    def run_and_wait() -> None:
        routine.run()
        stream.synchronize()

    full = median_ns(run_and_wait)
    enqueue = median_ns(routine.run, 5000)
    stream.synchronize()
    routine.context.finalize()
    return {"bare_ctypes_us": bare / 1e3, "run_and_wait_us": full / 1e3,
            "overhead_us": (full - bare) / 1e3, "run_enqueue_only_us": enqueue / 1e3}


def run_and_wait(routine: Routine) -> None:
    routine.run()
    routine.context.stream.synchronize()


# The FMA peak of the device's cores: every thread of an OpenMP team runs independent chains of
# vector FMAs held in registers (no memory traffic), through a raw kernel, so its figure is
# this backend's compiler and threads, as the matmul's. A matmul's GFLOP/s over it says how
# far a kernel is from the hardware, whatever the VM's clock that day. Chains: enough to fill
# two FMA pipes of 4-cycle latency, with registers left for the multiplier and the addend.
FMA_PEAK_ROUNDS = 1 << 22
FMA_PEAK_SOURCE = """\
#include <stdint.h>
#include <omp.h>
typedef float pj_v __attribute__((vector_size(VBYTES)));
void fma_peak(float* out, int64_t* threads, int64_t rounds) {
  #pragma omp parallel
  {
    pj_v acc[CHAINS], mul, add;
    for (int l = 0; l < (int)(VBYTES / sizeof(float)); ++l) { mul[l] = 0.999999f; add[l] = 1e-7f; }
    for (int c = 0; c < CHAINS; ++c) acc[c] = mul * (float)(c + omp_get_thread_num());
    for (int64_t r = 0; r < rounds; ++r) {
      #pragma GCC unroll 32
      for (int c = 0; c < CHAINS; ++c) acc[c] = acc[c] * mul + add;
    }
    float s = 0;
    for (int c = 0; c < CHAINS; ++c)
      for (int l = 0; l < (int)(VBYTES / sizeof(float)); ++l) s += acc[c][l];
    if (omp_get_thread_num() < 256) out[omp_get_thread_num()] = s;  /* kept: not dead code */
    #pragma omp single
    threads[0] = omp_get_num_threads();
  }
}
"""


def fma_shape() -> tuple[int, int]:
    """(chains, float32 lanes of each) of the FMA peak kernel on this host."""
    dialect = get_backend("cpu").driver.dialect
    return min(24, dialect.vector_registers - 4), dialect.vector_bytes // 4


def fma_peak(rounds: int = FMA_PEAK_ROUNDS) -> tuple[Routine, float]:
    """A linked routine whose every run does the returned number of float32 FLOPs in
    registers, on as many threads as OpenMP gives the device's kernels."""
    backend = get_backend("cpu")
    dialect = backend.driver.dialect
    chains, lanes = fma_shape()
    out, threads = ir.Node("fma_out", (256,)), ir.Node("fma_threads", (1,), "int64")
    rounds_sym = ir.StaticSymbol("rounds", rounds + 1)
    source = FMA_PEAK_SOURCE.replace("VBYTES", str(dialect.vector_bytes)).replace("CHAINS", str(chains))
    code = backend.raw_kernel(source, "fma_peak", [(out, "w"), (threads, "w")], statics=[rounds_sym],
                              bindings={rounds_sym: rounds})
    routine = backend.get_device(0).make_context().link(code)
    run_and_wait(routine)
    team = int(routine.context.read(threads)[0])
    return routine, 2.0 * lanes * chains * rounds * team


def bench_matmul(m: int, peak_rounds: int = FMA_PEAK_ROUNDS) -> dict[str, float]:
    routine, xa, xb, c = linked_matmul("cpu", m)
    peak, peak_run_flops = fma_peak(peak_rounds)
    t = best_of_blocks({"polyjit": lambda: run_and_wait(routine), "numpy": lambda: xa @ xb,
                        "fma_peak": lambda: run_and_wait(peak)})
    t_pj, t_np = t["polyjit"], t["numpy"]
    err = float(np.abs(routine.context.read(c) - xa @ xb).max() / np.abs(xa @ xb).max())
    routine.context.finalize()
    peak.context.finalize()
    flops = 2 * m**3
    peak_flops = peak_run_flops / t["fma_peak"]
    return {"polyjit_GFLOPs": flops / t_pj / 1e9, "numpy_GFLOPs": flops / t_np / 1e9,
            "fraction_of_numpy": t_np / t_pj, "rel_error": err, "fma_peak_GFLOPs": peak_flops / 1e9,
            "polyjit_of_peak": flops / t_pj / peak_flops, "numpy_of_peak": flops / t_np / peak_flops}


def bench_cached_compile() -> dict[str, float]:
    backend = get_backend("cpu")
    chain, _, _ = chain_program(4096)
    a, b, c = ir.Node("a", (64, 64)), ir.Node("b", (64, 64)), ir.Node("c", (64, 64))
    s = ir.Node("s", (64,))
    comps = [chain, ir.Comp.of(ir.einsum("ik,kj->ij", a, b, into=c)),
             ir.Comp.of(ir.einsum("ij->i", a, into=s, accum=ir.AccumOp.MAX))]
    backend.compile_batch(comps, names=["chain", "mm", "rowmax"])  # compiles once (or hits disk)
    t = best_of(lambda: backend.compile_batch(comps, names=["chain", "mm", "rowmax"]), repeat=20)
    return {"cached_compile_ms": t * 1e3}


def bench_interop(nbytes: int) -> dict[str, float]:
    """Export a node to numpy and import a numpy array as a node (zero-copy both ways), beside
    ``to_host`` of the same node into a preallocated array (one copy)."""
    backend = get_backend("cpu")
    n = nbytes // 4
    x = ir.Node("x", (n,))
    host = np.arange(n, dtype=np.float32)
    ctx = backend.get_device(0).make_context().init_from_host(x, host)
    out = np.empty_like(host)
    to_host = best_of(lambda: ctx.to_host(x, out), repeat=10)
    exported = best_of(lambda: np.from_dlpack(ctx.export(x)), repeat=10)
    view = np.from_dlpack(ctx.export(x))
    view[0] = -1.0  # written through the export: the node's own memory, not a copy
    shared = float(ctx.read(x)[0]) == -1.0
    y = ir.Node("y", (n,))
    imported = best_of(lambda: ctx.init_from_dlpack(y, host).finalize(), repeat=10)
    del view
    ctx.finalize()
    return {"MiB": nbytes / 2**20, "to_host_ms": to_host * 1e3, "export_ms": exported * 1e3,
            "import_ms": imported * 1e3, "export_vs_to_host": to_host / exported, "shared": float(shared)}


TARGETS: list[Target] = [
    ("chain", "speedup_vs_numpy", ">=", 2.0),
    ("chain", "fraction_of_copy_bw", ">=", 0.75),
    ("launch", "overhead_us", "<=", 5.0),
    ("matmul", "fraction_of_numpy", ">=", 0.25),
    ("compile", "cached_compile_ms", "<=", 5.0),
    ("interop", "export_vs_to_host", ">=", 10.0),
]


def main(argv: Sequence[str] = ()) -> int:
    p = argparse.ArgumentParser(prog="polyjit bench cpu")
    p.add_argument("--size", type=count, default=1 << 24)
    p.add_argument("--matmul", type=count, default=1024)
    p.add_argument("--json", type=output_file, help="write the results to this file")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not a measurement")
    args = p.parse_args(list(argv))
    if args.quick:
        args.size, args.matmul = min(args.size, 1 << 16), min(args.matmul, 64)
    results: dict[str, Any] = {
        "machine": {"cpu": cpu_model(), "python": platform.python_version(),
                    "numpy": np.__version__, "devices": get_backend("cpu").num_devices()},
        "chain": bench_chain(args.size),
        "launch": bench_launch(),
        "matmul": bench_matmul(args.matmul, (1 << 12) if args.quick else FMA_PEAK_ROUNDS),
        "compile": bench_cached_compile(),
        "interop": bench_interop((1 << 20) if args.quick else (64 << 20)),
    }
    print(f"machine: {results['machine']}")
    for group in ("chain", "launch", "matmul", "compile", "interop"):
        print(f"[{group}]")
        for key, val in results[group].items():
            print(f"  {key:24s} {val:10.3f}")
    print_targets(results, TARGETS)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
