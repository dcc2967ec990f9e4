"""The CPU backend's C dialect: the generic C emitter, plus register-tiled matmul kernels.

A matmul-shaped kernel (``lower.match_contraction``) is emitted as tiles of
MR rows x NV vectors of the output held in registers while k runs, with GCC
vector extensions (portable across x86 and Arm, sized to the host's widest
vector unit). Tiles are shared among OpenMP threads j-panel by j-panel so a
panel of the right operand stays in cache while its i-tiles run.
"""

from __future__ import annotations

import functools
from pathlib import Path

from polyjit.core.codegen import Dialect, Emitter, KernelSpec, Names
from polyjit.core.lower import Contraction, Kernel, match_contraction


@functools.cache
def host_vector_bytes() -> int:
    """The widest SIMD register of this host, in bytes."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return 16
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    if "avx512f" in flags:
        return 64
    if "avx2" in flags or "avx" in flags:
        return 32
    return 16


class CpuDialect(Dialect):
    """C + OpenMP, with tiled contractions."""

    name = "c"
    mr = 6  # output rows per tile
    nv = 2  # output vectors per tile row

    def __init__(self, vector_bytes: int | None = None) -> None:
        self.vector_bytes = vector_bytes or host_vector_bytes()

    def emit_kernel(self, em: Emitter, kernel: Kernel, spec: KernelSpec, names: Names) -> list[str]:
        c = match_contraction(kernel)
        if c is None:
            return super().emit_kernel(em, kernel, spec, names)
        return [*self.kernel_open(spec, names), *self._tiled(em, c, names), "}"]

    def _tiled(self, em: Emitter, c: Contraction, names: Names) -> list[str]:
        dt = c.reduce.node.dtype
        t = self.type_name(dt)
        lanes = self.vector_bytes // dt.itemsize
        mr, nv, nr = self.mr, self.nv, self.nv * lanes
        i, j, k = names.var(c.i), names.var(c.j), names.var(c.k)
        out = f"{names.buffer(c.reduce.node)}[{em.index(c.reduce.index)}]"
        x, y = em.expr(c.x), em.expr(c.y)
        init_zero = c.reduce.init is not None
        tiles_i, tiles_j = -(-c.m // mr), -(-c.n // nr)
        work = c.kernel.work * c.kk
        loops = [(names.var(s), n) for s, n in c.batch] + [("pj_tj", tiles_j), ("pj_ti", tiles_i)]
        lines = [f"  typedef {t} pj_vec __attribute__((vector_size({self.vector_bytes})));"]
        if work >= self.omp_min_work:
            lines.append(f"  #pragma omp parallel for collapse({len(loops)}) schedule(static)")
        depth = 1
        for v, n in loops:
            lines.append(f"{'  ' * depth}for (int64_t {v} = 0; {v} < {n}; ++{v}) {{")
            depth += 1
        p = "  " * depth
        zero = em.literal(0, dt)
        lines += [
            f"{p}const int64_t pj_i0 = pj_ti * {mr}, pj_j0 = pj_tj * {nr};",
            f"{p}if (pj_i0 + {mr} <= {c.m} && pj_j0 + {nr} <= {c.n}) {{",
            f"{p}  pj_vec acc[{mr}][{nv}];",
            f"{p}  #pragma GCC unroll {mr}",
            f"{p}  for (int pj_r = 0; pj_r < {mr}; ++pj_r) {{",
            f"{p}    const int64_t {i} = pj_i0 + pj_r;",
            f"{p}    #pragma GCC unroll {nv}",
            f"{p}    for (int pj_v = 0; pj_v < {nv}; ++pj_v) {{",
            f"{p}      const int64_t {j} = pj_j0 + pj_v * {lanes};",
            (f"{p}      acc[pj_r][pj_v] = (pj_vec){{0}};" if init_zero
             else f"{p}      __builtin_memcpy(&acc[pj_r][pj_v], &{out}, sizeof(pj_vec));"),
            f"{p}    }}",
            f"{p}  }}",
            f"{p}  for (int64_t {k} = 0; {k} < {c.kk}; ++{k}) {{",
            f"{p}    pj_vec bv[{nv}];",
            f"{p}    #pragma GCC unroll {nv}",
            f"{p}    for (int pj_v = 0; pj_v < {nv}; ++pj_v) {{",
            f"{p}      const int64_t {j} = pj_j0 + pj_v * {lanes};",
            f"{p}      __builtin_memcpy(&bv[pj_v], &{y}, sizeof(pj_vec));",
            f"{p}    }}",
            f"{p}    #pragma GCC unroll {mr}",
            f"{p}    for (int pj_r = 0; pj_r < {mr}; ++pj_r) {{",
            f"{p}      const int64_t {i} = pj_i0 + pj_r;",
            f"{p}      const {t} pj_a = {x};",
            f"{p}      #pragma GCC unroll {nv}",
            f"{p}      for (int pj_v = 0; pj_v < {nv}; ++pj_v) acc[pj_r][pj_v] += pj_a * bv[pj_v];",
            f"{p}    }}",
            f"{p}  }}",
            f"{p}  #pragma GCC unroll {mr}",
            f"{p}  for (int pj_r = 0; pj_r < {mr}; ++pj_r) {{",
            f"{p}    const int64_t {i} = pj_i0 + pj_r;",
            f"{p}    #pragma GCC unroll {nv}",
            f"{p}    for (int pj_v = 0; pj_v < {nv}; ++pj_v) {{",
            f"{p}      const int64_t {j} = pj_j0 + pj_v * {lanes};",
            f"{p}      __builtin_memcpy(&{out}, &acc[pj_r][pj_v], sizeof(pj_vec));",
            f"{p}    }}",
            f"{p}  }}",
            f"{p}}} else {{  /* an edge tile: plain loops */",
            f"{p}  for (int64_t {i} = pj_i0; {i} < pj_i0 + {mr} && {i} < {c.m}; ++{i}) {{",
            f"{p}    for (int64_t {j} = pj_j0; {j} < pj_j0 + {nr} && {j} < {c.n}; ++{j}) {{",
            f"{p}      {t} pj_acc = {zero if init_zero else out};",
            f"{p}      for (int64_t {k} = 0; {k} < {c.kk}; ++{k}) pj_acc += {x} * {y};",
            f"{p}      {out} = pj_acc;",
            f"{p}    }}",
            f"{p}  }}",
            f"{p}}}",
        ]
        for d in range(depth - 1, 0, -1):
            lines.append(f"{'  ' * d}}}")
        return lines
