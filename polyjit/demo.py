"""``polyjit demo --kernels``: a fused elementwise chain and a matmul on every device of a
backend, checked against numpy (the training demo is ``polyjit.tensor.demo``)."""

from __future__ import annotations

import argparse
import time

import numpy as np

from polyjit.backends import get_backend
from polyjit.core import ir


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


def main(args: argparse.Namespace) -> int:
    backend = get_backend(args.backend)
    n, m = args.size, 256
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
