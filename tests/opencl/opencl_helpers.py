"""What the OpenCL tests share: paths, node and program helpers (the fixtures are in conftest.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from polyjit.backends.opencl import OpenCLDialect
from polyjit.core import dtypes, ir
from polyjit.core.codegen import Source, generate
from polyjit.core.ir import AccumOp, Node, Op, StaticSymbol
from polyjit.core.lower import lower
from polyjit.core.runtime import Backend

ROOT = Path(__file__).resolve().parents[2]
Array = np.ndarray[Any, Any]


def f32(name: str, shape: tuple[int, ...]) -> Node:
    return Node(name, shape, dtypes.float32)


def run_comps(backend: Backend, comps: Sequence[ir.Comp], inputs: Mapping[Node, Array],
              outputs: Sequence[Node], ordinal: int = 0,
              bindings: Mapping[StaticSymbol, int] | None = None) -> dict[Node, Array]:
    """Compile, link on a fresh context of the device, run every routine once, read outputs."""
    dev = backend.get_device(ordinal)
    root = dev.make_context()
    ctx = root
    for node, value in inputs.items():
        ctx = ctx.init_from_host(node, value)
    batch = backend.compile_batch(list(comps), names=[f"c{k}" for k in range(len(comps))])
    routines = ctx.link_batch(batch)
    for r in routines:
        if bindings:
            r.bindings.update(bindings)
        r.run()
    out = {n: routines[-1].context.read(n) for n in outputs}
    root.finalize()
    return out


def source_of(comps: Sequence[ir.Comp], dialect: OpenCLDialect | None = None) -> Source:
    lowered = lower(list(comps), [f"c{k}" for k in range(len(comps))])
    return generate(lowered, dialect or OpenCLDialect())


def slow_accumulate(n: int = 1 << 20) -> tuple[ir.Comp, Node, Node]:
    x, acc = f32("slow_x", (n,)), f32("slow_acc", (n,))
    return ir.Comp.of(ir.apply(Op.ID, x, into=acc, accum=AccumOp.ADD, init_neutral=False)), x, acc
