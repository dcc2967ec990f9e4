"""The CPU backend's C dialect: the generic C emitter, plus two specialisations.

A matmul-shaped kernel (``lower.match_contraction``) is emitted as tiles of
MR rows x NV vectors of the output held in registers while k runs, with GCC
vector extensions (portable across x86 and Arm, sized to the host's widest
vector unit). Tiles are shared among OpenMP threads j-panel by j-panel so a
panel of the right operand stays in cache while its i-tiles run.

A large contiguous elementwise kernel writes its output with non-temporal
(streaming) stores where the host has AVX: the output is not read first
(no write-allocate), which saves a sixth of the memory traffic of
``a*b + c*d - e``.
"""

from __future__ import annotations

import functools
from pathlib import Path

from polyjit.core import dtypes, ir
from polyjit.core.codegen import Dialect, Emitter, KernelSpec, Names
from polyjit.core.lower import Contraction, Kernel, Load, Store, match_contraction, walk_exprs

# Streaming stores bypass the cache: only worth it for outputs far larger than it.
STREAMING_MIN_BYTES = 8 << 20


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

    def prelude(self, batch_dtypes: set[dtypes.DType]) -> list[str]:
        return ["#include <stdint.h>", "#include <math.h>", "#if defined(__AVX__)",
                "#include <immintrin.h>", "#endif", ""]

    def emit_kernel(self, em: Emitter, kernel: Kernel, spec: KernelSpec, names: Names) -> list[str]:
        c = match_contraction(kernel)
        if c is not None:
            return [*self.kernel_open(spec, names), *self._tiled(em, c, names), "}"]
        if self._streams(kernel):
            return [*self.kernel_open(spec, names), *self._streaming(em, kernel, names), "}"]
        return super().emit_kernel(em, kernel, spec, names)

    def _streams(self, kernel: Kernel) -> bool:
        """A flat elementwise kernel over a large, aligned float output, reading contiguously."""
        body = kernel.body
        if len(kernel.parallel) != 1 or not isinstance(body, Store) or body.accum is not None:
            return False
        if self.vector_bytes < 32 or body.node.dtype not in (dtypes.float32, dtypes.float64):
            return False
        (sym, n), = kernel.parallel
        if body.index != ir.as_affine(sym) or n * body.node.dtype.itemsize < STREAMING_MIN_BYTES:
            return False
        loads = [e for e in walk_exprs(body) if isinstance(e, Load)]
        return all(ld.index.coeff(sym) in (0, 1) for ld in loads) and all(
            ld.node is not body.node for ld in loads
        )

    def _streaming(self, em: Emitter, kernel: Kernel, names: Names) -> list[str]:
        body = kernel.body
        assert isinstance(body, Store)
        (sym, n), = kernel.parallel
        dt = body.node.dtype
        t = self.type_name(dt)
        lanes = self.vector_bytes // dt.itemsize
        suffix = "ps" if dt is dtypes.float32 else "pd"
        width, guard = ("512", "__AVX512F__") if self.vector_bytes == 64 else ("256", "__AVX__")
        i, out, value = names.var(sym), names.buffer(body.node), em.expr(body.value)
        blocks = n // lanes
        return [
            f"#if defined({guard})",
            f"  #pragma omp parallel for schedule(static) if({n} >= {self.omp_min_work})",
            f"  for (int64_t pj_blk = 0; pj_blk < {blocks}; ++pj_blk) {{",
            f"    {t} pj_tmp[{lanes}] __attribute__((aligned({self.vector_bytes})));",
            f"    for (int pj_l = 0; pj_l < {lanes}; ++pj_l) {{",
            f"      const int64_t {i} = pj_blk * {lanes} + pj_l;",
            f"      pj_tmp[pj_l] = {value};",
            "    }",
            f"    _mm{width}_stream_{suffix}(&{out}[pj_blk * {lanes}], _mm{width}_load_{suffix}(pj_tmp));",
            "  }",
            "  _mm_sfence();  /* streaming stores are weakly ordered */",
            f"  for (int64_t {i} = {blocks * lanes}; {i} < {n}; ++{i}) {out}[{i}] = {value};",
            "#else",
            *super().emit_parallel(em, kernel, names, 1),
            "#endif",
        ]

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
