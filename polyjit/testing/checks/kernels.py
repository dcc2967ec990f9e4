"""Checks of users' own kernels (``Backend.raw_kernel``): the kit writes a small kernel as a user
of the backend's dialect would, links it and runs it, and compares with numpy.

The kernels are spelled per dialect family, by the name of the driver's dialect
(``driver.dialect.name``), in :data:`RAW_KERNELS`: ``"c"`` (``codegen.Dialect``, the cpu
backend's and the ``sync`` example's: a C function), ``"opencl"`` and ``"cuda"``. A backend
whose dialect is none of those fails the check with a message that says how to add its
spelling: the kit cannot write a kernel in a language it does not know, and a check that
skipped there would let a backend whose users' kernels compute garbage look conformant. A
backend that does not take users' kernels at all raises ``UnsupportedError`` from
``raw_source`` (or ``compile``); the check then skips, with that reason.
"""

from __future__ import annotations

import attrs
import numpy as np

from polyjit.core import dtypes, ir, raw
from polyjit.core.errors import UnsupportedError
from polyjit.core.ir import Node, StaticSymbol
from polyjit.core.routine import Code
from polyjit.core.runtime import Backend
from polyjit.testing.checks.common import (
    CheckSkipped,
    assert_equal,
    f32,
    finalizing,
    require_devices,
    small_ints,
)


@attrs.frozen
class RawSpelling:
    """The kit's two kernels in one dialect, as a user would write them.

    ``first`` defines ``pj_kit_raw_first(float* out, const int32* x, int64 a)``, which sets
    ``out[0] = (float)(x[0] * a) + 0.25f`` (one work-item, or all of them, writing the same
    value); ``each`` defines ``pj_kit_raw_each(float* out, const int32* x, int64 a, int64 n)``,
    which sets ``out[i] = (float)(x[i] * a) + 0.25f`` for every ``i < n``, launched on one
    work-item per cell (``global_size = n``, ``local_size`` left to the backend)."""

    first: str
    each: str


C_KERNELS = RawSpelling(
    first="""#include <stdint.h>
void pj_kit_raw_first(float* out, const int32_t* x, int64_t a) {
  out[0] = (float)(x[0] * a) + 0.25f;
}
""",
    each="""#include <stdint.h>
void pj_kit_raw_each(float* out, const int32_t* x, int64_t a, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = (float)(x[i] * a) + 0.25f;
}
""")

OPENCL_KERNELS = RawSpelling(
    first="""__kernel void pj_kit_raw_first(__global float* out, __global const int* x, long a) {
  if (get_global_id(0) == 0) out[0] = (float)(x[0] * a) + 0.25f;
}
""",
    each="""__kernel void pj_kit_raw_each(__global float* out, __global const int* x, long a, long n) {
  long i = (long)get_global_id(0);
  if (i < n) out[i] = (float)(x[i] * a) + 0.25f;
}
""")

CUDA_KERNELS = RawSpelling(
    first="""extern "C" __global__ void pj_kit_raw_first(float* out, const int* x, long long a) {
  if (blockIdx.x == 0 && threadIdx.x == 0) out[0] = (float)(x[0] * a) + 0.25f;
}
""",
    each="""extern "C" __global__ void pj_kit_raw_each(float* out, const int* x, long long a, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = (float)(x[i] * a) + 0.25f;
}
""")

# The kit's kernels by the name of the driver's dialect. A backend with a dialect of its own
# adds its spelling here before the kit runs (in its conftest.py, say):
# ``polyjit.testing.checks.kernels.RAW_KERNELS["mine"] = RawSpelling(first=..., each=...)``.
RAW_KERNELS: dict[str, RawSpelling] = {"c": C_KERNELS, "opencl": OPENCL_KERNELS, "cuda": CUDA_KERNELS}

_N = 300  # cells of the kernel that writes each; not a multiple of any work-group size


def _expected(x: np.ndarray, a: int) -> np.ndarray:
    return np.asarray((x.astype(np.int64) * a).astype(np.float32) + np.float32(0.25))


def _spelling(backend: Backend) -> RawSpelling:
    dialect = backend.driver.dialect.name
    spelling = RAW_KERNELS.get(dialect)
    if spelling is None:
        raise AssertionError(
            f"the kit has no raw kernel in the dialect {dialect!r} of backend {backend.name!r} (it knows "
            f"{sorted(RAW_KERNELS)}), so it cannot check that users' own kernels (Backend.raw_kernel) run: "
            f"add the two kernels of polyjit.testing.checks.kernels.RawSpelling, spelled as your users "
            f"would write them, before the kit runs (in your conftest.py, say): "
            f"polyjit.testing.checks.kernels.RAW_KERNELS[{dialect!r}] = RawSpelling(first=..., each=...)")
    return spelling


def _raw(backend: Backend, source: str, name: str, out: Node, x: Node, statics: list[StaticSymbol],
         bindings: dict[StaticSymbol, int], global_size: int) -> Code:
    try:
        return backend.raw_kernel(source, name, [raw.write(out), raw.read(x)], statics=statics,
                                  bindings=bindings, global_size=global_size)
    except UnsupportedError as e:
        raise CheckSkipped(f"backend {backend.name!r} does not take users' own kernels: {e}") from e


def check_raw_kernels(backend: Backend) -> None:
    """Users' own kernels (Backend.raw_kernel, in the dialect's spelling from RAW_KERNELS): a
    kernel that reads a node, writes a node and takes statics is linked and run, and matches
    numpy; a new binding is read at run(); nodes at non-zero offsets of a shared pool are bound
    there, their neighbours untouched (catches a driver or dialect that does not bind a user's
    parameters as its kernels take them: a raw_source or Dialect.raw_binding that does not
    match the dialect's kernel_open)."""
    require_devices(backend, 1)
    spelling = _spelling(backend)
    dev = backend.get_device(0)
    rng = np.random.default_rng(21)
    x, out = Node("raw_x", (_N,), dtypes.int32), f32("raw_out", (_N,))
    a, n = StaticSymbol("raw_a", 16), StaticSymbol("raw_n", _N + 1)
    xv = small_ints(rng, x.shape, -99, 99).astype(np.int32)
    hint = ("its parameters do not reach it as its source declares them: the dialect's raw_binding (or the "
            "driver's raw_source) must bind a user's kernel to the calling convention the dialect's "
            "kernel_open spells (the C one, void k(void* const* bufs, const int64_t* statics): "
            "core.raw.c_trampoline); see docs/writing-a-backend.md, 'Users' own kernels'")
    root = dev.make_context()
    with finalizing(root) as held:
        ctx = root.init_from_host(x, xv)
        # One cell first: a driver that does not bind the user's parameters fails here, before a
        # loop over the cells runs with whatever it passed for n.
        one = f32("raw_first", (1,))
        first = _raw(backend, spelling.first, "pj_kit_raw_first", one, x, [a], {a: 3}, 1)
        r = ctx.link(first)
        r.run()
        assert_equal(f"{one.label} after the raw kernel pj_kit_raw_first(out, x, a = 3) on {dev.device_id} "
                     f"wrote out[0] = x[0] * a + 0.25 ({hint})", r.context.read(one), _expected(xv[:1], 3))
        # Every cell, statics read when run() enqueues, in their order
        each = _raw(backend, spelling.each, "pj_kit_raw_each", out, x, [a, n], {a: 3, n: _N}, _N)
        r = ctx.link(each)
        if r.inputs != {x} or r.outputs != {out} or tuple(r.statics) != (a, n):
            raise AssertionError(f"the raw routine's inputs {r.inputs}, outputs {r.outputs} and statics "
                                 f"{r.statics} are not ({x.label},), ({out.label},) and (raw_a, raw_n)")
        r.run()
        want = _expected(xv, 3)
        assert_equal(f"{out.label} after the raw kernel pj_kit_raw_each(out, x, a = 3, n = {_N}) on "
                     f"{dev.device_id} ({hint})", r.context.read(out), want)
        r.bindings[a] = 5
        r.run()
        want = _expected(xv, 5)
        assert_equal(f"{out.label} after routine.bindings[raw_a] = 5 and run() (a raw kernel's statics are "
                     f"read when run() enqueues)", r.context.read(out), want)
        r.bindings[a], r.bindings[n] = 1, 17
        r.run()
        want[:17] = _expected(xv[:17], 1)
        assert_equal(f"{out.label} after bindings raw_a = 1, raw_n = 17 and run() (statics reach the kernel "
                     f"in the order given: only the first 17 cells are written)", r.context.read(out), want)
        # Both nodes at non-zero offsets of one pool, between guards: the kernel writes in place
        lo, hi = f32("raw_lo", (2 * _N,)), f32("raw_hi", (16,))
        nodes = (lo, x, out, hi)
        layout = backend.compile(ir.Comp.of(*(ir.fill(m, 0 if m.dtype is dtypes.int32 else 0.0) for m in nodes)),
                                 name="raw_layout")
        placed = dev.make_context().link(layout)
        placed.run()
        held.append(placed.context)
        pctx = placed.context
        values = {lo: small_ints(rng, lo.shape, -99, 99), x: small_ints(rng, x.shape, -99, 99).astype(np.int32),
                  out: np.full(out.shape, -7.0, np.float32), hi: small_ints(rng, hi.shape, -99, 99)}
        for m, v in values.items():
            pctx.from_host(m, v)
        where = {m: pctx.buffers[m] for m in nodes}
        if len({loc.pool_id for loc in where.values()}) != 1 or where[x].offset == 0 or where[out].offset == 0:
            raise AssertionError(f"the kit's raw layout must place its nodes in one pool, {x.label} and "
                                 f"{out.label} past the first: {where}")
        r = pctx.link(each)
        r.bindings[a] = 2
        r.run()
        values[out] = _expected(values[x], 2)
        for m in (out, x, lo, hi):
            assert_equal(f"{m.label} (offset {where[m].offset} of pool {where[m].pool_id}) after the raw kernel "
                         f"pj_kit_raw_each read {x.label} at offset {where[x].offset} and wrote {out.label} "
                         f"at offset {where[out].offset} (a user's kernel gets its buffers at their offsets; "
                         f"the nodes beside them stay untouched)", r.context.read(m), values[m])
