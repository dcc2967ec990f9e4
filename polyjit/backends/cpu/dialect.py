"""The CPU backend's C dialect: the generic C emitter, plus three specialisations.

A matmul-shaped kernel (``lower.match_contraction``) is emitted as tiles of
MR rows x NV vectors of the output held in registers while k runs, with GCC
vector extensions (portable across x86 and Arm, sized to the host's widest
vector unit). Edge tiles run the same code with fewer rows or vectors and a
last vector under a lane mask, so narrow outputs (a 256x10 classifier head)
stay vectorized. Tiles are shared among OpenMP threads j-panel by j-panel so a
panel of the right operand stays in cache while its i-tiles run.

A column reduction (``x.sum(axis=0)``) keeps a block of outputs in a local
array while the reduced axis runs outside it: the inner loop is contiguous and
vectorizes, and every output still sums in order.

A large contiguous elementwise kernel writes its output with non-temporal
(streaming) stores where the host has AVX: the output is not read first
(no write-allocate), which saves a sixth of the memory traffic of
``a*b + c*d - e``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from polyjit.backends.cpu.host import host_cpu
from polyjit.core import dtypes, ir
from polyjit.core.codegen import Dialect, Emitter, KernelSpec, Names
from polyjit.core.lower import (
    Call,
    Contraction,
    Kernel,
    Load,
    Reduce,
    Store,
    match_contraction,
    walk_exprs,
)

# Outputs of a column reduction accumulated together (a local array of this many).
COLUMN_BLOCK = 512

# float32 exp and tanh that GCC vectorizes (libm's expf/tanhf are calls, one lane at a time:
# tanhf costs ~18 ns, this 0.8 ns). exp: Cody-Waite reduction by ln 2 (ln2_hi has trailing
# zero bits, so n * ln2_hi is exact), Taylor to r^7 (|r| <= ln2 / 2: truncation < 2^-27),
# 2^n as two factors so subnormal results come out right. tanh: its odd Taylor series to
# x^17 below 0.55 (truncation < 2^-27 relative), 1 - 2 / (exp(2|x|) + 1) above. Measured
# against float64 numpy over 4.6M points: exp within 0.92 ulp, tanh within 1.6 ulp (glibc's
# tanhf: 2.1, numpy's: 1.4); NaN, +-inf, +-0 and subnormal results as libm gives them.
_FLOAT32_MATH: list[tuple[str, list[str]]] = [
    ("pj_pow2i_f32", """\
static inline float pj_pow2i_f32(int32_t k) {  /* 2^k, k in [-126, 127] */
  const int32_t bits = (k + 127) << 23;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}""".splitlines()),
    ("pj_exp_f32", """\
static inline float pj_exp_f32(float x) {
  const float y = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x);
  const float n = (y * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round(y / ln 2) */
  const float r = (y - n * 0.693145751953125f) - n * 1.428606820309417232e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t k = (int32_t)n, k1 = k >> 1;
  const float v = p * pj_pow2i_f32(k1) * pj_pow2i_f32(k - k1);
  return x != x ? x : v;
}""".splitlines()),
    ("pj_tanh_f32", """\
static inline float pj_tanh_f32(float x) {
  const float a = fabsf(x), z = x * x;
  float q = 6404582.0f / 10854718875.0f;
  q = q * z - 929569.0f / 638512875.0f;
  q = q * z + 21844.0f / 6081075.0f;
  q = q * z - 1382.0f / 155925.0f;
  q = q * z + 62.0f / 2835.0f;
  q = q * z - 17.0f / 315.0f;
  q = q * z + 2.0f / 15.0f;
  q = q * z - 1.0f / 3.0f;
  const float small = x + x * z * q;
  const float e = pj_exp_f32(2.0f * (a < 10.0f ? a : 10.0f));
  const float v = copysignf(a < 0.55f ? small : 1.0f - 2.0f / (e + 1.0f), x);
  return x != x ? x : v;
}""".splitlines()),
]

_VEC_SUFFIX = {dtypes.float32: "f32", dtypes.float64: "f64"}

# Streaming stores bypass the cache: only worth it for outputs far larger than it.
STREAMING_MIN_BYTES = 8 << 20


class CpuDialect(Dialect):
    """C + OpenMP, with tiled contractions."""

    name = "c"
    mr = 6  # output rows per tile
    nv = 2  # output vectors per tile row

    def __init__(self, vector_bytes: int | None = None) -> None:
        self.vector_bytes = vector_bytes or host_cpu().vector_bytes

    def prelude(self, batch_dtypes: set[dtypes.DType]) -> list[str]:
        return ["#include <stdint.h>", "#include <math.h>", "#if defined(__AVX__)",
                "#include <immintrin.h>", "#endif", ""]

    def helper_definitions(self, batch_dtypes: set[dtypes.DType]) -> list[tuple[str, list[str]]]:
        """Tail loads/stores of the tiles and float32 exp/tanh, then max/min: ``generate``
        keeps those the kernels call."""
        out: list[tuple[str, list[str]]] = []
        for dt in sorted(batch_dtypes & set(_VEC_SUFFIX), key=lambda d: d.name):
            out += self._tail_helpers(dt)
        if dtypes.float32 in batch_dtypes:
            out += _FLOAT32_MATH
        return out + super().helper_definitions(batch_dtypes)

    def math_call(self, fn: str, dt: dtypes.DType, args: Sequence[str]) -> str:
        if dt is dtypes.float32 and fn in ("exp", "tanh"):
            return f"pj_{fn}_f32({', '.join(args)})"
        return super().math_call(fn, dt, args)

    def _tail_helpers(self, dt: dtypes.DType) -> list[tuple[str, list[str]]]:
        """Load/store the first ``n`` lanes of a vector (the other lanes load as zero) with
        AVX-512 masks or AVX2 lane masks where the host has them, else a short memcpy; ``n``
        is a constant at every call, so the mask is too."""
        t, sfx, vb = self.type_name(dt), _VEC_SUFFIX[dt], self.vector_bytes
        v, ps, lanes = f"pj_v{sfx}", ("ps" if dt is dtypes.float32 else "pd"), vb // dt.itemsize
        reg = f"__m{vb * 8}{'' if ps == 'ps' else 'd'}"
        masked: tuple[str, str, str] | None = None  # (guard, load, store)
        if vb == 64:
            mask = f"(__mmask{max(8, lanes)})((1u << n) - 1u)"
            masked = ("__AVX512F__", f"_mm512_maskz_loadu_{ps}({mask}, p)",
                      f"_mm512_mask_storeu_{ps}(p, {mask}, ({reg})x)")
        elif vb == 32:
            bits, ramp = ("32", "0, 1, 2, 3, 4, 5, 6, 7") if ps == "ps" else ("64", "0, 1, 2, 3")
            mask = f"_mm256_cmpgt_epi{bits}(_mm256_set1_epi{bits}{'x' if bits == '64' else ''}(n), _mm256_setr_epi{bits}{'x' if bits == '64' else ''}({ramp}))"
            masked = ("__AVX2__", f"_mm256_maskload_{ps}(p, {mask})", f"_mm256_maskstore_{ps}(p, {mask}, ({reg})x)")
        generic_load = [f"  {v} x = {{0}};", f"  __builtin_memcpy(&x, p, (unsigned)n * sizeof({t}));", "  return x;"]
        generic_store = [f"  __builtin_memcpy(p, &x, (unsigned)n * sizeof({t}));"]
        if masked is not None:
            guard, load, store = masked
            generic_load = [f"#if defined({guard})", f"  return ({v}){load};", "#else", *generic_load, "#endif"]
            generic_store = [f"#if defined({guard})", f"  {store};", "#else", *generic_store, "#endif"]
        return [
            (v, [f"typedef {t} {v} __attribute__((vector_size({vb})));"]),
            (f"pj_load_tail_{sfx}",
             [f"static inline {v} pj_load_tail_{sfx}(const {t}* p, int n) {{", *generic_load, "}"]),
            (f"pj_store_tail_{sfx}",
             [f"static inline void pj_store_tail_{sfx}({t}* p, {v} x, int n) {{", *generic_store, "}"]),
        ]

    def kernel_prefix(self, kernel: Kernel) -> list[str]:
        # Tiles and column reductions vectorize across outputs, never along a reduction.
        if any(f(kernel) is not None for f in (match_contraction, _column_reduction, _staged_reduction)):
            return []
        return super().kernel_prefix(kernel)

    def emit_kernel(self, em: Emitter, kernel: Kernel, spec: KernelSpec, names: Names) -> list[str]:
        c = match_contraction(kernel)
        if c is not None:
            return [*self.kernel_open(spec, names), *self._tiled(em, c, names), "}"]
        r = _column_reduction(kernel)
        if r is not None:
            return [*self.kernel_open(spec, names), *self._column_reduce(em, kernel, r, names), "}"]
        if _staged_reduction(kernel) is not None:
            return super().emit_kernel(_StagingEmitter(self, names), kernel, spec, names)
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

    def _column_reduce(self, em: Emitter, kernel: Kernel, r: Reduce, names: Names) -> list[str]:
        """``out[j] = sum_k x[k, j]``: a block of outputs accumulates in a local array while k
        runs outside it, so the j loop vectorizes and reads rows contiguously; each output
        still sums in k order, as the plain loop would."""
        (j_sym, nj), outer = kernel.parallel[-1], kernel.parallel[:-1]
        blocks = -(-nj // COLUMN_BLOCK)
        width = min(nj, COLUMN_BLOCK)
        last = nj - (blocks - 1) * width
        t, j = self.type_name(r.node.dtype), names.var(j_sym)
        loops = [(names.var(sym), n) for sym, n in outer] + [("pj_jb", blocks)]
        big = kernel.total_work >= self.omp_min_work * 8
        lines, depth = _open_nest(loops, big and math.prod(n for _, n in loops) > 1)
        p = "  " * depth
        target, init = em.reduce_cell(r)
        each = f"for (int64_t pj_jj = 0; pj_jj < pj_jn; ++pj_jj) {{ const int64_t {j} = pj_jb * {width} + pj_jj;"
        # a start value that does not read the output cell (a constant) needs no j
        each_init = each if re.search(rf"\b{j}\b", init) else "for (int64_t pj_jj = 0; pj_jj < pj_jn; ++pj_jj) {"
        lines += [f"{p}{t} pj_acc[{width}];",
                  f"{p}const int64_t pj_jn = " + (f"pj_jb < {blocks - 1} ? {width} : {last};" if last != width else f"{width};"),
                  f"{p}{each_init} pj_acc[pj_jj] = {init}; }}"]
        for d, (sym, n) in enumerate(r.loops):
            v = names.var(sym)
            lines.append(f"{p}{'  ' * d}for (int64_t {v} = 0; {v} < {n}; ++{v}) {{")
        q = p + "  " * len(r.loops)
        value = em.combine(r.accum, r.node.dtype, "pj_acc[pj_jj]", em.expr(r.value))
        lines.append(f"{q}{each} pj_acc[pj_jj] = {value}; }}")
        for d in range(len(r.loops) - 1, -1, -1):
            lines.append(f"{p}{'  ' * d}}}")
        lines.append(f"{p}{each} {target} = pj_acc[pj_jj]; }}")
        return lines + _close_nest(depth)

    def _tiled(self, em: Emitter, c: Contraction, names: Names) -> list[str]:
        """Tiles of ``mr`` rows x ``nv`` vectors; edge tiles are the same code with fewer rows,
        fewer vectors, and a last vector loaded and stored under a lane mask, so no part of
        the output falls back to scalar loops (a 256x10 head is all edge)."""
        dt = c.reduce.node.dtype
        lanes = self.vector_bytes // dt.itemsize
        mr, nr = self.mr, self.nv * lanes
        full_i, rows_left = divmod(c.m, mr)
        full_j, cols_left = divmod(c.n, nr)
        tiles_i, tiles_j = full_i + (rows_left > 0), full_j + (cols_left > 0)
        loops = [(names.var(s), n) for s, n in c.batch] + [("pj_tj", tiles_j), ("pj_ti", tiles_i)]
        nest, depth = _open_nest(loops, c.kernel.total_work >= self.omp_min_work)
        lines = [f"  typedef {self.type_name(dt)} pj_vec __attribute__((vector_size({self.vector_bytes})));", *nest]
        p = "  " * depth
        lines.append(f"{p}const int64_t pj_i0 = pj_ti * {mr}, pj_j0 = pj_tj * {nr};")
        # (rows, full vectors, lanes of a masked last vector) of each kind of tile that occurs
        row_kinds = [(f"pj_ti < {full_i}", mr)] if full_i else []
        row_kinds += [("1", rows_left)] if rows_left else []
        col_kinds = [(f"pj_tj < {full_j}", self.nv, 0)] if full_j else []
        col_kinds += [("1", *divmod(cols_left, lanes))] if cols_left else []
        branches = [(" && ".join(x for x in (ri, cj) if x != "1") or "1", rows, vecs, tail)
                    for ri, rows in row_kinds for cj, vecs, tail in col_kinds]
        for n, (cond, rows, vecs, tail) in enumerate(branches):
            if len(branches) == 1:
                opener = "{"
            elif n == 0:
                opener = f"if ({cond}) {{"
            else:
                opener = "} else {" if n == len(branches) - 1 else f"}} else if ({cond}) {{"
            lines.append(p + opener)
            lines += [f"{p}  {ln}" for ln in self._tile(em, c, names, rows, vecs, tail, lanes)]
        lines.append(f"{p}}}")
        return lines + _close_nest(depth)

    def _tile(self, em: Emitter, c: Contraction, names: Names, rows: int, vecs: int, tail: int,
              lanes: int) -> list[str]:
        """One tile at (pj_i0, pj_j0): ``rows`` x (``vecs`` vectors + one of ``tail`` lanes)."""
        dt = c.reduce.node.dtype
        t, suffix = self.type_name(dt), _VEC_SUFFIX[dt]
        i, j, k = names.var(c.i), names.var(c.j), names.var(c.k)
        out = f"{names.buffer(c.reduce.node)}[{em.index(c.reduce.index)}]"
        x, y = em.expr(c.x), em.expr(c.y)
        nvt = vecs + (tail > 0)

        def load(dst: str, src: str, v: int) -> str:
            if tail and v == vecs:
                return f"{dst} = pj_load_tail_{suffix}(&{src}, {tail});"
            return f"__builtin_memcpy(&{dst}, &{src}, sizeof(pj_vec));"

        def store(dst: str, src: str, v: int) -> str:
            if tail and v == vecs:
                return f"pj_store_tail_{suffix}(&{dst}, {src}, {tail});"
            return f"__builtin_memcpy(&{dst}, &{src}, sizeof(pj_vec));"

        lines = [f"pj_vec acc[{rows}][{nvt}];"]
        for r in range(rows):
            for v in range(nvt):
                if c.reduce.init is not None:
                    lines.append(f"acc[{r}][{v}] = (pj_vec){{0}};")
                else:
                    lines += ["{", f"  const int64_t {i} = pj_i0 + {r}, {j} = pj_j0 + {v * lanes};",
                              f"  {load(f'acc[{r}][{v}]', out, v)}", "}"]
        lines += [f"for (int64_t {k} = 0; {k} < {c.kk}; ++{k}) {{", f"  pj_vec bv[{nvt}];"]
        for v in range(nvt):
            lines += ["  {", f"    const int64_t {j} = pj_j0 + {v * lanes};", f"    {load(f'bv[{v}]', y, v)}", "  }"]
        for r in range(rows):
            lines += ["  {", f"    const int64_t {i} = pj_i0 + {r};", f"    const {t} pj_a = {x};"]
            lines += [f"    acc[{r}][{v}] += pj_a * bv[{v}];" for v in range(nvt)]
            lines.append("  }")
        lines.append("}")
        for r in range(rows):
            for v in range(nvt):
                lines += ["{", f"  const int64_t {i} = pj_i0 + {r}, {j} = pj_j0 + {v * lanes};",
                          f"  {store(out, f'acc[{r}][{v}]', v)}", "}"]
        return lines


class _StagingEmitter(Emitter):
    """Emits a row reduction as map, then fold: the values (with their exp or tanh) go to a
    local array in a loop that vectorizes, then a plain loop sums them in order."""

    def reduce(self, r: Reduce, indent: int, pragma: str | None = None) -> list[str]:
        if pragma is not None:
            return super().reduce(r, indent, pragma)
        (sym, n), = r.loops
        pad, t, k = "  " * indent, self.d.type_name(r.node.dtype), self.names.var(sym)
        target, init = self.reduce_cell(r)
        return [f"{pad}{{",
                f"{pad}  {t} pj_vals[{n}];",
                f"{pad}  for (int64_t {k} = 0; {k} < {n}; ++{k}) pj_vals[{k}] = {self.expr(r.value)};",
                f"{pad}  {t} pj_acc = {init};",
                f"{pad}  for (int64_t {k} = 0; {k} < {n}; ++{k}) "
                f"pj_acc = {self.combine(r.accum, r.node.dtype, 'pj_acc', f'pj_vals[{k}]')};",
                f"{pad}  {target} = pj_acc;",
                f"{pad}}}"]


# Values worth staging: what the vector unit computes much faster than a scalar loop.
_STAGED_OPS = frozenset({ir.Op.EXP, ir.Op.TANH, ir.Op.SIGMOID, ir.Op.SQRT, ir.Op.DIV})
STAGED_MAX_LENGTH = 4096  # the local array: 16 KiB of float32


def _staged_reduction(kernel: Kernel) -> Reduce | None:
    """A float reduction along one short loop whose value costs more than its loads
    (``sum_j exp(x[i, j] - m[i])``): staged by :class:`_StagingEmitter`. The fold reads the
    staged values forwards, so GCC may vectorize it in order without the miscompile that
    ``Dialect.kernel_prefix`` guards against (reads with a negative stride)."""
    r = kernel.body
    if not isinstance(r, Reduce) or r.node.dtype not in _VEC_SUFFIX or len(r.loops) != 1:
        return None
    if not 8 <= r.loops[0][1] <= STAGED_MAX_LENGTH:
        return None
    costly = any(isinstance(e, Call) and e.op in _STAGED_OPS for e in walk_exprs(r))
    return r if costly else None


def _open_nest(loops: list[tuple[str, int]], parallel: bool) -> tuple[list[str], int]:
    """``for`` loops over ``loops`` (outermost first), all shared by OpenMP when ``parallel``;
    returns the lines and the indent depth inside."""
    lines = [f"  #pragma omp parallel for collapse({len(loops)}) schedule(static)"] if parallel else []
    for depth, (v, n) in enumerate(loops, start=1):
        lines.append(f"{'  ' * depth}for (int64_t {v} = 0; {v} < {n}; ++{v}) {{")
    return lines, len(loops) + 1


def _close_nest(depth: int) -> list[str]:
    return [f"{'  ' * d}}}" for d in range(depth - 1, 0, -1)]


def _column_reduction(kernel: Kernel) -> Reduce | None:
    """A reduction whose innermost output axis is contiguous in the output and in what it
    reads, while the reduced axes are strided (``x.sum(axis=0)``): the plain loop would
    walk a column per output."""
    r = kernel.body
    if not isinstance(r, Reduce) or not kernel.parallel or kernel.parallel[-1][1] < 4:
        return None
    j = kernel.parallel[-1][0]
    loads = [e for e in walk_exprs(r) if isinstance(e, Load)]
    if r.index.coeff(j) != 1 or any(ld.node is r.node or ld.index.coeff(j) not in (0, 1) for ld in loads):
        return None
    reduced = {sym for sym, _ in r.loops}
    return r if any(ld.index.coeff(j) == 1 and any(ld.index.coeff(s) for s in reduced) for ld in loads) else None
