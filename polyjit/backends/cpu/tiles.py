"""What only the CPU's C writes: the shapes core/patterns.py gives some kernels on the CPU
(listed in ``SHAPES``, which the C dialect registers), and the vector helpers they call.

``register_tiles``
    a matmul-shaped kernel as tiles of rows x vectors of the output held in registers while
    k runs, with GCC vector extensions (portable across x86 and Arm, sized to the host's
    widest vector unit). Edge tiles run the same code with fewer rows or vectors and a last
    vector under a lane mask, so narrow outputs (a 256x10 classifier head) stay vectorized;
    one narrower than a vector whose x runs along its columns (the head's weight gradient)
    is tiled with i and j exchanged, its vectors down the columns.
    Tiles are shared among threads j-panel by j-panel so a panel of the right operand stays
    in cache while its i-tiles run; full-width tiles read that panel packed into contiguous
    memory (``_pack``).
``column``
    a column reduction (``x.sum(axis=0)``) keeps a block of outputs in a local array while
    the reduced axis runs outside it: the inner loop is contiguous and vectorizes, and every
    output still sums in order.
``staged``
    a row reduction of costly values (``sum_j exp(x[i, j])``) as a vectorized map into a
    local array, then an in-order fold.
``streaming``
    a large contiguous elementwise kernel writes its output with non-temporal (streaming)
    stores where the host has AVX: the output is not read first (no write-allocate), which
    saves a sixth of the memory traffic of ``a*b + c*d - e``.
``transpose``
    a stored transpose of 4-byte values (autodiff's ``w^T`` for ``g @ w^T``) as 8x8 blocks:
    eight rows loaded as vectors, transposed with shuffles in registers, stored as rows.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from polyjit.core import dtypes, ir
from polyjit.core.codegen import (
    Emitter,
    Names,
    ShapeEmitter,
    emit_loops,
    hoist_invariant_loads,
    range_loops,
)
from polyjit.core.loops import Kernel, Load, Reduce, Store, walk_expr
from polyjit.core.patterns import (
    COLUMN,
    COLUMN_BLOCK,
    COLUMN_ROWS,
    REGISTER_TILES,
    STAGED,
    STREAMING,
    TRANSPOSE,
    TRANSPOSE_BLOCK,
    Contraction,
    KernelPlan,
    stageable,
    transpose_loops,
)

# float32 exp and tanh that GCC vectorizes (libm's expf/tanhf are calls, one lane at a time:
# tanhf costs ~18 ns, this 0.8 ns). exp: Cody-Waite reduction by ln 2 (ln2_hi has trailing
# zero bits, so n * ln2_hi is exact), Taylor to r^7 (|r| <= ln2 / 2: truncation < 2^-27),
# 2^n as two factors so subnormal results come out right. tanh: its odd Taylor series to
# x^17 below 0.55 (truncation < 2^-27 relative), 1 - 2 / (exp(2|x|) + 1) above, with exp's
# argument in [0, 20]: no clamp, no NaN, and 2^n one factor (the same bits as exp's own;
# the vector tanh 1.3x faster, session 23). Measured
# against float64 numpy over 4.6M points: exp within 0.92 ulp, tanh within 1.6 ulp (glibc's
# tanhf: 2.1, numpy's: 1.4); NaN, +-inf, +-0 and subnormal results as libm gives them.
# exp's Taylor coefficients, r^7 first, and tanh's odd series', x^17 first (Horner), which the
# scalar and the vector helpers both run, op for op, so that they give the same bits.
_EXP_TAYLOR = ("1.0f / 5040.0f", "+ 1.0f / 720.0f", "+ 1.0f / 120.0f", "+ 1.0f / 24.0f", "+ 1.0f / 6.0f",
               "+ 0.5f", "+ 1.0f", "+ 1.0f")
_TANH_SERIES = ("6404582.0f / 10854718875.0f", "- 929569.0f / 638512875.0f", "+ 21844.0f / 6081075.0f",
                "- 1382.0f / 155925.0f", "+ 62.0f / 2835.0f", "- 17.0f / 315.0f", "+ 2.0f / 15.0f", "- 1.0f / 3.0f")


def _exp_core(t: str, splat: str) -> list[str]:
    """exp's lines on ``y`` (clamped, not NaN) in type ``t``, up to its polynomial ``p``; ``splat``
    makes a scalar constant a ``t`` ("" for float, "zero + " for a vector)."""
    first, *rest = _EXP_TAYLOR
    return [f"  const {t} n = (y * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* y over ln 2, rounded */",
            f"  const {t} r = (y - n * 0.693145751953125f) - n * 1.428606820309417232e-6f;",
            f"  {t} p = {splat}{first};", *(f"  p = p * r {c};" for c in rest)]


def _tanh_series(t: str, splat: str) -> list[str]:
    """tanh's odd series in type ``t``: ``small``, from ``x`` and ``z = x * x``."""
    first, *rest = _TANH_SERIES
    return [f"  {t} q = {splat}{first};", *(f"  q = q * z {c};" for c in rest),
            f"  const {t} small = x + x * z * q;"]


FLOAT32_MATH: list[tuple[str, list[str]]] = [
    ("pj_pow2i_f32", """\
static inline float pj_pow2i_f32(int32_t k) {  /* 2^k, k in [-126, 127] */
  const int32_t bits = (k + 127) << 23;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}""".splitlines()),
    ("pj_exp_f32", [
        "static inline float pj_exp_f32(float x) {",
        "  const float y = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : (x != x ? 0.0f : x));  /* no NaN to cast */",
        *_exp_core("float", ""),
        "  const int32_t k = (int32_t)n, k1 = k >> 1;",
        "  const float v = p * pj_pow2i_f32(k1) * pj_pow2i_f32(k - k1);",
        "  return x != x ? x : v;",
        "}"]),
    ("pj_tanh_f32", [
        "static inline float pj_tanh_f32(float x) {",
        "  const float a = fabsf(x), z = x * x;",
        *_tanh_series("float", ""),
        "  const float y = 2.0f * (a < 10.0f ? a : 10.0f);",
        *_exp_core("float", ""),
        "  const float e = p * pj_pow2i_f32((int32_t)n);",
        "  const float v = copysignf(a < 0.55f ? small : 1.0f - 2.0f / (e + 1.0f), x);",
        "  return x != x ? x : v;",
        "}"]),
]


# The same exp and tanh on a vector of the host's width (Emitter.lanes), each op the same as
# the scalar one's (the results are the same bits: checked over 5M float32s, NaN and +-inf
# among them), its selects spelled as bitwise ops on lane masks. A loop GCC vectorizes on
# its own must not branch, and where the host has no masked vector ops (AVX2, SSE, NEON)
# it leaves one scalar whose selects compute anything that might trap (-ftrapping-math;
# session 20 measured char_lm's tanh epilogue as 24% of its step).
def vector_math(vector_bytes: int) -> list[tuple[str, list[str]]]:
    """The vector exp and tanh of float32 (on ``pj_vf32``, from :func:`tail_helpers`), and
    the int32 lane masks and the select they use."""
    mask = ("pj_vi32", [f"typedef int32_t pj_vi32 __attribute__((vector_size({vector_bytes})));"])
    return [mask, *VECTOR_MATH]


VECTOR_MATH: list[tuple[str, list[str]]] = [
    ("pj_vsel_f32", """\
static inline pj_vf32 pj_vsel_f32(pj_vi32 m, pj_vf32 a, pj_vf32 b) {  /* m ? a : b, lane by lane */
  return (pj_vf32)((m & (pj_vi32)a) | (~m & (pj_vi32)b));
}""".splitlines()),
    ("pj_exp_vf32", [
        "static inline pj_vf32 pj_exp_vf32(pj_vf32 x) {",
        "  const pj_vf32 zero = {0};",
        "  const pj_vi32 nan = x != x;",
        "  pj_vf32 y = pj_vsel_f32(x < -104.0f, zero - 104.0f, x);",
        "  y = pj_vsel_f32(y > 89.0f, zero + 89.0f, y);",
        "  y = pj_vsel_f32(nan, zero, y);  /* a NaN comes back as it came, below */",
        *_exp_core("pj_vf32", "zero + "),
        "  const pj_vi32 k = __builtin_convertvector(n, pj_vi32), k1 = k >> 1;",
        "  const pj_vf32 v = p * (pj_vf32)((k1 + 127) << 23) * (pj_vf32)((k - k1 + 127) << 23);",
        "  return pj_vsel_f32(nan, x, v);",
        "}"]),
    ("pj_tanh_vf32", [
        "static inline pj_vf32 pj_tanh_vf32(pj_vf32 x) {",
        "  const pj_vf32 zero = {0};",
        "  const pj_vi32 sign = (pj_vi32)-zero;  /* the sign bit */",
        "  const pj_vf32 a = (pj_vf32)((pj_vi32)x & ~sign), z = x * x;",
        *_tanh_series("pj_vf32", "zero + "),
        "  const pj_vf32 y = 2.0f * pj_vsel_f32(a < 10.0f, a, zero + 10.0f);",
        *_exp_core("pj_vf32", "zero + "),
        "  const pj_vf32 e = p * (pj_vf32)((__builtin_convertvector(n, pj_vi32) + 127) << 23);",
        "  const pj_vf32 m = pj_vsel_f32(a < 0.55f, small, 1.0f - 2.0f / (e + 1.0f));",
        "  const pj_vf32 v = (pj_vf32)(((pj_vi32)m & ~sign) | ((pj_vi32)x & sign));",
        "  return pj_vsel_f32(x != x, x, v);",
        "}"]),
]


# A bool as 0.0 or 1.0 through its bits: GCC 12 rewrites ``x - (float)c`` (the cross-entropy
# gradient's ``softmax - onehot``) as ``c ? x - 1 : x``, a branch holding a float op, which
# its vectorizer then leaves scalar on hosts without masked vector ops (AVX2).
BOOL_TO_FLOAT: dict[dtypes.DType, tuple[str, list[str]]] = {
    dt: (f"pj_bool_{sfx}", [
        f"static inline {ct} pj_bool_{sfx}(int c) {{",
        f"  const {ut} u = -({ut})(c != 0) & {one}; {ct} f; __builtin_memcpy(&f, &u, sizeof f); return f;",
        "}"])
    for dt, sfx, ct, ut, one in ((dtypes.float32, "f32", "float", "uint32_t", "0x3f800000u"),
                                 (dtypes.float64, "f64", "double", "uint64_t", "0x3ff0000000000000ull"))
}


VEC_SUFFIX = {dtypes.float32: "f32", dtypes.float64: "f64"}


def tail_helpers(dt: dtypes.DType, t: str, vb: int) -> list[tuple[str, list[str]]]:
    """The vector type of ``vb`` bytes of ``dt`` (C type ``t``), and loads/stores of its
    first ``n`` lanes (the other lanes load as zero) with AVX-512 masks or AVX2 lane masks
    where the host has them, else a short memcpy; ``n`` is a constant at every call, so the
    mask is too."""
    sfx = VEC_SUFFIX[dt]
    v, ps, lanes = f"pj_v{sfx}", ("ps" if dt is dtypes.float32 else "pd"), vb // dt.itemsize
    reg = f"__m{vb * 8}{'' if ps == 'ps' else 'd'}"
    masked: tuple[str, str, str] | None = None  # (guard, load, store)
    if vb == 64:
        mask = f"(__mmask{max(8, lanes)})((1u << n) - 1u)"
        masked = ("__AVX512F__", f"_mm512_maskz_loadu_{ps}({mask}, p)",
                  f"_mm512_mask_storeu_{ps}(p, {mask}, ({reg})x)")
    elif vb == 32:
        bits, ramp = ("32", "0, 1, 2, 3, 4, 5, 6, 7") if ps == "ps" else ("64", "0, 1, 2, 3")
        x = "x" if bits == "64" else ""
        mask = f"_mm256_cmpgt_epi{bits}(_mm256_set1_epi{bits}{x}(n), _mm256_setr_epi{bits}{x}({ramp}))"
        masked = ("__AVX2__", f"_mm256_maskload_{ps}(p, {mask})", f"_mm256_maskstore_{ps}(p, {mask}, ({reg})x)")
    generic_load = [f"  {v} x = {{0}};", f"  __builtin_memcpy(&x, p, (unsigned)n * sizeof({t}));", "  return x;"]
    generic_store = [f"  __builtin_memcpy(p, &x, (unsigned)n * sizeof({t}));"]
    if masked is not None:
        guard, load, store = masked
        generic_load = [f"#if defined({guard})", f"  return ({v}){load};", "#else", *generic_load, "#endif"]
        generic_store = [f"#if defined({guard})", f"  {store};", "#else", *generic_store, "#endif"]
    return [
        (v, [f"typedef {t} {v} __attribute__((vector_size({vb})));"]),
        (f"pj_load_tail_{sfx}", [f"static inline {v} pj_load_tail_{sfx}(const {t}* p, int n) {{", *generic_load, "}"]),
        (f"pj_store_tail_{sfx}", [f"static inline void pj_store_tail_{sfx}({t}* p, {v} x, int n) {{", *generic_store, "}"]),
    ]


def _open_nest(loops: list[tuple[str, int]], parallel: bool) -> tuple[list[str], int]:
    """``for`` loops over ``loops`` (outermost first), all shared by the threads (the kernel's
    range, ``codegen.range_loops``) when ``parallel``; returns the lines and the indent
    depth inside."""
    if parallel:
        return range_loops(loops, 1)
    lines = []
    for depth, (v, n) in enumerate(loops, start=1):
        lines.append(f"{'  ' * depth}for (int64_t {v} = 0; {v} < {n}; ++{v}) {{")
    return lines, len(loops) + 1


def _close_nest(depth: int) -> list[str]:
    return [f"{'  ' * d}}}" for d in range(depth - 1, 0, -1)]


# ---------------------------------------------------------------------------
# register_tiles


def register_tiles(em: Emitter, kernel: Kernel, plan: KernelPlan, names: Names) -> list[str]:
    """Tiles of ``tm`` rows x ``tn`` columns (whole vectors); edge tiles are the same code with
    fewer rows, fewer vectors, and a last vector loaded and stored under a lane mask, so no
    part of the output falls back to scalar loops (a 256x10 head is all edge)."""
    c, t = plan.contraction, plan.tiles
    assert c is not None and t is not None
    dt, lanes, mr, nr = c.reduce.node.dtype, t.lanes, t.tm, t.tn
    nv = nr // lanes
    full_i, rows_left = divmod(c.m, mr)
    full_j, cols_left = divmod(c.n, nr)
    tiles_i, tiles_j = full_i + (rows_left > 0), full_j + (cols_left > 0)
    ty = em.d.type_name(dt)
    # which operand's panel is packed (see _pack): x's, when it lies across k, or y's
    pack = "x" if packs_x(c, tiles_i, tiles_j, dt.itemsize * mr) else \
        "y" if full_j > 0 and tiles_i > 1 and PACK_MIN_BYTES < c.kk * nv * em.d.vector_bytes <= PACK_MAX_BYTES \
        and c.y.node is not c.reduce.node else ""
    # the packed panel's loop outside the other, so that every tile of the panel reads it
    tile_loops = [("pj_ti", tiles_i), ("pj_tj", tiles_j)] if pack == "x" else [("pj_tj", tiles_j), ("pj_ti", tiles_i)]
    loops = [(names.var(s), n) for s, n in c.batch] + tile_loops
    nest, depth = _open_nest(loops, plan.team > 0)
    lines = [f"  typedef {ty} pj_vec __attribute__((vector_size({em.d.vector_bytes})));"]
    if c.epilogue:  # an optimizer's learning rate and bias corrections, read once
        lines += hoist_invariant_loads(em, kernel, 1)
    if pack:
        cell, width = ("pj_vec", nv) if pack == "y" else (ty, mr)
        lines += [f"  {cell} (*pj_panel)[{width}] = {SCRATCH_FN} ? "
                  f"({cell} (*)[{width}]){SCRATCH_FN}(sizeof({cell}) * {c.kk * width}) : 0;",
                  "  int64_t pj_packed = -1;",
                  f"  int64_t* pj_tag = pj_panel && {SCRATCH_TAG_FN} ? {SCRATCH_TAG_FN}() : 0;",
                  f"  if (pj_tag && pj_tag[0] && pj_tag[1] == pj_tag[0] && pj_tag[3] == {c.kk * width}) "
                  "pj_packed = pj_tag[2];"]
    lines += nest
    p = "  " * depth
    lines.append(f"{p}const int64_t pj_i0 = pj_ti * {mr}, pj_j0 = pj_tj * {nr};")
    # (rows, full vectors, lanes of a masked last vector) of each kind of tile that occurs
    row_kinds = [(f"pj_ti < {full_i}", mr)] if full_i else []
    row_kinds += [("1", rows_left)] if rows_left else []
    col_kinds = [(f"pj_tj < {full_j}", nv, 0)] if full_j else []
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
        packed: list[str] = []
        if (pack == "y" and vecs == nv and tail == 0) or (pack == "x" and rows == mr):  # else read in place
            key = "0"
            for v, n in loops[:-1]:  # the panel: the batch index and the outer tile loop, flattened
                key = v if key == "0" else f"({key}) * {n} + {v}"
            packed = _pack(em, plan, names, key, pack) + _tile(em, plan, names, rows, vecs, tail, pack)
        tile = _tile(em, plan, names, rows, vecs, tail)
        if packed:
            tile = ["if (pj_panel) {", *[f"  {ln}" for ln in packed], "} else {", *[f"  {ln}" for ln in tile], "}"]
        lines += [f"{p}  {ln}" for ln in tile]
    lines.append(f"{p}}}")
    em.hoisted.clear()
    return lines + _close_nest(depth)


# A full-width tile reads, at each k, ``nv`` vectors of one row of y: rows a whole row of y
# apart. Copied once per panel into contiguous memory (the thread's scratch memory, at most
# this many bytes), the rows are read in order by every row tile of the panel the thread runs: the
# prefetchers follow them, and rows of a power-of-two width no longer fall into the same
# few cache sets (a 1024^3 float32 matmul: 126 -> 351 GFLOP/s on two Intel cores; the MLP's
# 784-deep panels: its step 3% faster). A panel of at most PACK_MIN_BYTES stays in the L1 cache
# as it is, and copying it cost more than it saved (char_lm's 128-deep panels: 2 us a step,
# at 2 vectors and again at 4, where they are 32 KiB: 71.7 -> 69.4 us unpacked, session 9).
# PACK_MAX_BYTES takes 1024-deep panels of 4 AVX-512 vectors (a 1024^3 matmul read in place
# ran at 144 GFLOP/s, packed at 389).
PACK_MIN_BYTES = 32 << 10
PACK_MAX_BYTES = 256 << 10

# The panel lives in the runtime's per-thread scratch memory (runtime.c, pj_scratch), not on
# the stack: a kernel's range may run on a host thread that helps or on an OpenMP team
# thread, whose stacks may be small (a 256 KiB panel overflowed a 256 KiB thread stack).
# The module reaches it through this pointer, which the driver sets when it loads the module;
# unset, or out of memory, the tiles read y in place.
SCRATCH_FN = "pj_scratch_fn"
SCRATCH_HELPER = (SCRATCH_FN, [
    "/* per-thread scratch memory of the CPU runtime (set by the driver at load) */",
    f"void* (*{SCRATCH_FN})(size_t) = 0;",
])
# What the thread's scratch memory holds (runtime.c, t_scratch_tag): [0] the launch whose
# grains this thread runs now (0: none), [1] the launch that packed the panel there, [2] which
# panel, [3] its size in vectors. A grain reuses the panel an earlier grain of its launch packed
# on this thread; each grain used to pack it again (the MLP's x @ w1 on two cores: 12 packings
# of 200 KiB, not 4). A kernel packs at one site (y's panel, keyed by batch index and column
# block): a second site would need keys of its own.
SCRATCH_TAG_FN = "pj_scratch_tag_fn"
SCRATCH_TAG_HELPER = (SCRATCH_TAG_FN, [
    "/* what that scratch memory holds (set by the driver at load) */",
    f"int64_t* (*{SCRATCH_TAG_FN})(void) = 0;",
])


def _pack(em: Emitter, plan: KernelPlan, names: Names, key: str, operand: str) -> list[str]:
    """Copy the panel ``key`` of the ``operand`` into ``pj_panel`` unless it holds it already:
    y's vectors at pj_j0, or x's ``tm`` values at pj_i0, for every k."""
    c, t = plan.contraction, plan.tiles
    assert c is not None and t is not None
    k = names.var(c.k)
    width = t.tn // t.lanes if operand == "y" else t.tm
    lines = [f"if (pj_packed != {key}) {{", f"  pj_packed = {key};",
             f"  if (pj_tag) {{ pj_tag[1] = pj_tag[0]; pj_tag[2] = {key}; pj_tag[3] = {c.kk * width}; }}",
             f"  for (int64_t {k} = 0; {k} < {c.kk}; ++{k}) {{"]
    for v in range(width):
        if operand == "y":
            lines += ["    {", f"      const int64_t {names.var(c.j)} = pj_j0 + {v * t.lanes};",
                      f"      __builtin_memcpy(&pj_panel[{k}][{v}], &{em.expr(c.y)}, sizeof(pj_vec));", "    }"]
        else:
            lines += ["    {", f"      const int64_t {names.var(c.i)} = pj_i0 + {v};",
                      f"      pj_panel[{k}][{v}] = {em.expr(c.x)};", "    }"]
    return [*lines, "  }", "}"]


def packs_x(c: Contraction, tiles_i: int, tiles_j: int, row_bytes: int) -> bool:
    """Whether the tiles pack x's panels: x lies across k (a weight gradient ``x.T @ dy``), so
    a tile reads a cache line of x per k for ``tm`` values of it, and the tiles of a row of
    tiles read the same lines again. Packed once per row of tiles (the rows' loop outermost),
    a panel is ``tm`` values per k, in order. A shallow k's lines stay in the L1 cache. The
    MLP's 784x256 gradient over a batch of 256 (session 22's AMD EPYC VM): 0.86-0.88x the time
    on one core, the packing counted; 0.90x (median of 16) through the runtime on two."""
    return c.x.index.coeff(c.k) != 1 and tiles_i > 1 and tiles_j > 1 and c.kk >= PACK_X_MIN_K \
        and c.kk * row_bytes <= PACK_MAX_BYTES and c.x.node is not c.reduce.node


PACK_X_MIN_K = 256


def _tile(em: Emitter, plan: KernelPlan, names: Names, rows: int, vecs: int, tail: int,
          packed: str = "") -> list[str]:
    """One tile at (pj_i0, pj_j0): ``rows`` x (``vecs`` vectors + one of ``tail`` lanes); the
    ``packed`` operand's values ("x" or "y") come from ``pj_panel``."""
    c, t = plan.contraction, plan.tiles
    assert c is not None and t is not None
    dt, lanes = c.reduce.node.dtype, t.lanes
    ty, suffix = em.d.type_name(dt), VEC_SUFFIX[dt]
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

    width = vecs * lanes + tail
    # each cell of the tile, the output's rows outermost so that stores run along them: j
    # innermost, or in a transposed tile (plan.transposed: i and j exchanged) i innermost
    # (variable, extent, head)
    outer, inner = ("pj_er", rows, f"const int64_t {i} = pj_i0 + pj_er;"), ("pj_ec", width, f"const int64_t {j} = pj_j0 + pj_ec;")
    if plan.transposed:
        outer, inner = inner, outer
    cells = [f"for (int64_t {outer[0]} = 0; {outer[0]} < {outer[1]}; ++{outer[0]}) {{", f"  {outer[2]}",
             f"  for (int64_t {inner[0]} = 0; {inner[0]} < {inner[1]}; ++{inner[0]}) {{", f"    {inner[2]}"]
    lines = [*_prefetch_epilogue(em, plan, names, rows, width), f"pj_vec acc[{rows}][{nvt}];"]
    # A sum only the epilogue reads (Kernel.private) goes to a local array, not memory; so do
    # a transposed tile's sums, on their way to memory
    private = bool(c.epilogue) and c.reduce.node in c.kernel.private
    held = private or plan.transposed
    if held:
        zero = " = {0}" if plan.transposed and c.reduce.init is None and tail else ""  # no garbage lanes
        lines.append(f"{ty} pj_cell[{rows}][{nvt * lanes}] __attribute__((aligned({em.d.vector_bytes}))){zero};")
    if c.reduce.init is None and plan.transposed:  # the sums start from the output's cells
        lines += [*cells, f"    pj_cell[pj_er][pj_ec] = {out};", "  }", "}"]
        lines += [f"__builtin_memcpy(&acc[{r}][{v}], &pj_cell[{r}][{v * lanes}], sizeof(pj_vec));"
                  for r in range(rows) for v in range(nvt)]
    for r in range(rows):
        for v in range(nvt):
            if c.reduce.init is not None:
                lines.append(f"acc[{r}][{v}] = (pj_vec){{0}};")
            elif not plan.transposed:
                lines += ["{", f"  const int64_t {i} = pj_i0 + {r}, {j} = pj_j0 + {v * lanes};",
                          f"  {load(f'acc[{r}][{v}]', out, v)}", "}"]
    lines += [f"for (int64_t {k} = 0; {k} < {c.kk}; ++{k}) {{", f"  pj_vec bv[{nvt}];"]
    for v in range(nvt):
        if packed == "y":
            lines.append(f"  bv[{v}] = pj_panel[{k}][{v}];")
        else:
            lines += ["  {", f"    const int64_t {j} = pj_j0 + {v * lanes};", f"    {load(f'bv[{v}]', y, v)}", "  }"]
    for r in range(rows):
        head = [f"    const {ty} pj_a = pj_panel[{k}][{r}];"] if packed == "x" else \
            [f"    const int64_t {i} = pj_i0 + {r};", f"    const {ty} pj_a = {x};"]
        lines += ["  {", *head]
        lines += [f"    acc[{r}][{v}] += pj_a * bv[{v}];" for v in range(nvt)]
        lines.append("  }")
    lines.append("}")
    for r in range(rows):
        for v in range(nvt):
            if held:
                lines.append(f"__builtin_memcpy(&pj_cell[{r}][{v * lanes}], &acc[{r}][{v}], sizeof(pj_vec));")
            else:
                lines += ["{", f"  const int64_t {i} = pj_i0 + {r}, {j} = pj_j0 + {v * lanes};",
                          f"  {store(out, f'acc[{r}][{v}]', v)}", "}"]
    if c.epilogue or plan.transposed:  # each cell's sum is just stored (in the L1 cache)
        if held:
            em.held[c.reduce.node] = "pj_cell[pj_er][pj_ec]"
        bodies: list[Callable[[int], list[str]]] = []
        if plan.transposed and not private:
            bodies.append(lambda ind: [f"{'  ' * ind}{out} = pj_cell[pj_er][pj_ec];"])
        bodies += [r for st in c.epilogue for r in em.bodies(st)]
        # the cells' exp and tanh a vector at a time (Emitter.lanes)
        lines += [*cells[:2], *em.lanes(inner[0], "0", str(inner[1]), bodies, 1, [inner[2]]), "}"]
        em.held.clear()
    return lines


# An epilogue's rows are prefetched when what it reads and writes, its own sums aside, spans
# at least this many bytes: the MLP's weight and momentum (1.6 MB) and its hidden layer's
# output (256 KB: exactly the floor, so a batch of 255 would not prefetch it) come from
# beyond the L2 cache by the time a step writes them (prefetching the output too: step
# 0.961, 0.933, 1.005 against a floor of 512 KiB); char_lm's (under 100 KB) are in it, and
# prefetching them only added instructions (its step 3-5% slower).
PREFETCH_MIN_BYTES = 256 << 10
CACHE_LINE = 64


def _prefetch_epilogue(em: Emitter, plan: KernelPlan, names: Names, rows: int, width: int) -> list[str]:
    """Prefetches, at a tile's start, of the tile's rows of what its epilogue reads and writes
    other than its own sums (an optimizer's weights and moments, a layer's output): their
    lines arrive while the k loop runs instead of stalling the epilogue, whose rows lie a
    row apart (the MLP's weight gradient with its momentum update, one core: the update cost
    8-15% of the kernel, half of that once prefetched). One cell a cache line along each row,
    and its last, so a row that straddles a line gets both. Not in a transposed tile, whose
    rows in memory run along its columns (narrow products, not measured)."""
    c = plan.contraction
    assert c is not None
    if not c.epilogue or plan.transposed:
        return []
    refs: dict[tuple[str, str], int] = {}  # (buffer, index) -> 1 if written
    nodes: set[ir.Node] = set()
    for st in c.epilogue:
        assert isinstance(st, Store)
        loads = [e for e in walk_expr(st.value) if isinstance(e, Load) and e.row is None and not e.merge]
        for node, index, write in [(st.node, st.index, 1), *((ld.node, ld.index, 0) for ld in loads)]:
            if node is not c.reduce.node and c.i in index.vars:  # rows apart: not a bias's one row
                key = (names.buffer(node), em.index(index))
                refs[key] = max(refs.get(key, 0), write)
                nodes.add(node)
    if sum(n.nbytes for n in nodes) < PREFETCH_MIN_BYTES:
        return []
    i, j = names.var(c.i), names.var(c.j)
    step = max(1, CACHE_LINE // min(n.dtype.itemsize for n in nodes))
    cells = sorted({*range(0, width, step), width - 1})
    return [f"{{ const int64_t {i} = pj_i0 + {r}, {j} = pj_j0 + {e}; "
            + " ".join(f"__builtin_prefetch(&{buf}[{idx}], {w});" for (buf, idx), w in refs.items()) + " }"
            for r in range(rows) for e in cells]


# ---------------------------------------------------------------------------
# column, staged, streaming


def column(em: Emitter, kernel: Kernel, plan: KernelPlan, names: Names) -> list[str]:
    """``out[j] = sum_k x[k, j]``: a block of outputs accumulates in a local array while k
    runs outside it, so the j loop vectorizes and reads rows contiguously; each output
    still sums in k order, as the plain loop would."""
    r = kernel.body
    assert isinstance(r, Reduce)
    (j_sym, nj), outer = kernel.parallel[-1], kernel.parallel[:-1]
    blocks = -(-nj // COLUMN_BLOCK)
    width = min(nj, COLUMN_BLOCK)
    last = nj - (blocks - 1) * width
    t, j = em.ctype(r.node.dtype), names.var(j_sym)  # half types accumulate in float32
    loops = [(names.var(sym), n) for sym, n in outer] + [("pj_jb", blocks)]
    lines, depth = _open_nest(loops, plan.team > 0)
    p = "  " * depth
    target, init = em.reduce_cell(r)
    each = f"for (int64_t pj_jj = 0; pj_jj < pj_jn; ++pj_jj) {{ const int64_t {j} = pj_jb * {width} + pj_jj;"
    # a start value that does not read the output cell (a constant) needs no j
    each_init = each if re.search(rf"\b{j}\b", init) else "for (int64_t pj_jj = 0; pj_jj < pj_jn; ++pj_jj) {"
    lines += [f"{p}{t} pj_acc[{width}];",
              f"{p}const int64_t pj_jn = " + (f"pj_jb < {blocks - 1} ? {width} : {last};" if last != width else f"{width};"),
              f"{p}{each_init} pj_acc[pj_jj] = {init}; }}"]
    for d, (sym, n) in enumerate(r.loops[:-1]):
        v = names.var(sym)
        lines.append(f"{p}{'  ' * d}for (int64_t {v} = 0; {v} < {n}; ++{v}) {{")
    q = p + "  " * (len(r.loops) - 1)
    lines += _column_rows(em, r, names, each, q)
    for d in range(len(r.loops) - 2, -1, -1):
        lines.append(f"{p}{'  ' * d}}}")
    lines.append(f"{p}{each} {em.store(r.node, target, 'pj_acc[pj_jj]')}; }}")
    return lines + _close_nest(depth)


def _column_rows(em: Emitter, r: Reduce, names: Names, each: str, pad: str) -> list[str]:
    """The innermost reduced loop, COLUMN_ROWS rows a pass over the block of outputs: each
    accumulator is loaded and stored once for them, and the rows are read as that many
    streams (``x @ W`` for one row x, 4096^2: 1.8x faster in a C harness). Each output still
    combines its rows in order, so the bits are those of one row a pass."""
    n, t = r.loops[-1][1], em.ctype(r.node.dtype)

    simd = [f"{pad}  {em.d.simd_for_pragma}"] if em.d.simd_for_pragma else []

    def rows(count: int, base: str) -> list[str]:
        # ``omp simd``: without it GCC 12 (-O3, AVX2) miscompiled int32 and int64 sums of 9-11
        # rows of 9-10 columns (the outputs' loop and the rows' loads as one interleaved group)
        steps = " ".join(em.folded_rows(r, "pj_v", base, count))
        return [*simd, f"{pad}  {each} {t} pj_v = pj_acc[pj_jj]; {steps} pj_acc[pj_jj] = pj_v; }}"]

    full = n - n % COLUMN_ROWS
    lines = []
    if full:
        lines += [f"{pad}for (int64_t pj_r = 0; pj_r < {full}; pj_r += {COLUMN_ROWS}) {{",
                  *rows(COLUMN_ROWS, "pj_r"), f"{pad}}}"]
    if n % COLUMN_ROWS:
        lines += [f"{pad}{{", *rows(n % COLUMN_ROWS, str(full)), f"{pad}}}"]
    return lines


class _StagingEmitter(Emitter):
    """Emits a row reduction as map, then fold: the values (with their exp or tanh) go to a
    local array in a loop that vectorizes, then a plain loop sums them in order (each float
    reduction of a row group: patterns.staged_reduction)."""

    def reduce(self, r: Reduce, indent: int, pragma: str | None = None) -> list[str]:
        if pragma is not None or not (r.node.dtype.is_float and stageable(r)):
            return super().reduce(r, indent, pragma)
        (sym, n), = r.loops
        pad, t, k = "  " * indent, self.ctype(r.node.dtype), self.names.var(sym)
        target, init = self.reduce_cell(r)
        return [f"{pad}{{",
                f"{pad}  {t} pj_vals[{n}];",
                *self.lanes(k, "0", str(n), [lambda ind: [f"{'  ' * ind}pj_vals[{k}] = {self.expr(r.value)};"]],
                            indent + 1, repeatable=True),  # the values go to a local array, which none reads
                f"{pad}  {t} pj_acc = {init};",
                f"{pad}  for (int64_t {k} = 0; {k} < {n}; ++{k}) "
                f"pj_acc = {self.combine(r.accum, r.node.dtype, 'pj_acc', f'pj_vals[{k}]')};",
                f"{pad}  {self.store(r.node, target, 'pj_acc')};",
                f"{pad}}}"]


def staged(em: Emitter, kernel: Kernel, plan: KernelPlan, names: Names) -> list[str]:
    return emit_loops(_StagingEmitter(em.d, names), kernel, plan, 1)


def streaming(em: Emitter, kernel: Kernel, plan: KernelPlan, names: Names) -> list[str]:
    """Blocks of one vector computed into an aligned local array, then streamed out; the
    elements before the first vector-aligned address (an imported buffer need only be
    aligned to its dtype), the tail, and hosts without AVX take the plain loop."""
    body = kernel.body
    assert isinstance(body, Store)
    (sym, n), = kernel.parallel
    d, dt = em.d, body.node.dtype
    lanes = d.vector_bytes // dt.itemsize
    suffix = "ps" if dt is dtypes.float32 else "pd"
    width, guard = ("512", "__AVX512F__") if d.vector_bytes == 64 else ("256", "__AVX__")
    i, out = names.var(sym), names.buffer(body.node)
    lo, hi = ("pj_lo", "pj_hi") if plan.team else ("0", str(n))  # this call's elements

    def into(ref: str) -> Callable[[int], list[str]]:  # the store, rendered where Emitter.lanes stages its exp/tanh
        return lambda indent: [f"{'  ' * indent}{ref} = {em.expr(body.value)};"]

    block = f"const int64_t {i} = pj_start + pj_head + pj_blk * {lanes} + pj_k;"
    return [
        f"#if defined({guard})",
        f"  const int64_t pj_start = {lo}, pj_n = {hi} - pj_start;",
        f"  int64_t pj_head = (int64_t)(((uintptr_t)0 - (uintptr_t)({out} + pj_start)) % {d.vector_bytes});",
        f"  pj_head = pj_head % {dt.itemsize} ? pj_n : pj_head / {dt.itemsize};",
        "  if (pj_head > pj_n) pj_head = pj_n;",
        f"  const int64_t pj_blocks = (pj_n - pj_head) / {lanes};",
        *em.lanes(i, "pj_start", "pj_start + pj_head", [into(f"{out}[{i}]")], 1),
        "  for (int64_t pj_blk = 0; pj_blk < pj_blocks; ++pj_blk) {",
        f"    {d.type_name(dt)} pj_tmp[{lanes}] __attribute__((aligned({d.vector_bytes})));",
        *em.lanes("pj_k", "0", str(lanes), [into("pj_tmp[pj_k]")], 2, [block]),
        f"    _mm{width}_stream_{suffix}(&{out}[pj_start + pj_head + pj_blk * {lanes}], _mm{width}_load_{suffix}(pj_tmp));",
        "  }",
        "  _mm_sfence();  /* streaming stores are weakly ordered */",
        *em.lanes(i, f"pj_start + pj_head + pj_blocks * {lanes}", hi, [into(f"{out}[{i}]")], 1),
        "#else",
        *emit_loops(em, kernel, plan, 1),
        "#endif",
    ]


# ---------------------------------------------------------------------------
# transpose

# An 8x8 block of 4-byte values transposed in eight 32-byte vectors: pairs of rows interleave
# by 1, then by 2, then by 4 lanes (24 shuffles); AVX permutes (patterns.block_transpose asks
# for 32-byte vectors: without AVX, GCC's code for them was 5x slower than the plain loop).
# The bits move untouched, so every 4-byte type (NaN payloads too) shares it. GCC spells a
# constant shuffle __builtin_shuffle, clang __builtin_shufflevector (GCC has it from 12 only).
TRANSPOSE_HELPER = ("pj_transpose8", """\
typedef uint32_t pj_u32x8 __attribute__((vector_size(32)));
typedef int32_t pj_i32x8 __attribute__((vector_size(32)));
#if defined(__clang__)
#define PJ_SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PJ_SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, (pj_i32x8){__VA_ARGS__})
#endif
static inline void pj_transpose8(pj_u32x8* r) {  /* r[i][j] <- r[j][i] */
  pj_u32x8 s[8], u[8];
  for (int k = 0; k < 8; k += 2) {
    s[k] = PJ_SHUFFLE8(r[k], r[k + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    s[k + 1] = PJ_SHUFFLE8(r[k], r[k + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int k = 0; k < 8; k += 4) {
    u[k] = PJ_SHUFFLE8(s[k], s[k + 2], 0, 1, 8, 9, 4, 5, 12, 13);
    u[k + 1] = PJ_SHUFFLE8(s[k], s[k + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    u[k + 2] = PJ_SHUFFLE8(s[k + 1], s[k + 3], 0, 1, 8, 9, 4, 5, 12, 13);
    u[k + 3] = PJ_SHUFFLE8(s[k + 1], s[k + 3], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = PJ_SHUFFLE8(u[k], u[k + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    r[k + 4] = PJ_SHUFFLE8(u[k], u[k + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
}""".splitlines())


def transpose(em: Emitter, kernel: Kernel, plan: KernelPlan, names: Names) -> list[str]:
    """``out[.., a, b] = x[.., b, a]`` (patterns.block_transpose) block by block: a full block
    loads eight rows of x (contiguous along a), transposes them and stores eight rows of the
    output (contiguous along b); blocks cut by the edges copy element by element."""
    body = kernel.body
    assert isinstance(body, Store) and isinstance(body.value, Load)
    blk = TRANSPOSE_BLOCK
    (a_sym, na), (b_sym, nb) = kernel.parallel[-2:]
    a, b = names.var(a_sym), names.var(b_sym)
    outer = [names.var(s) for s, _ in kernel.parallel[:-2]]
    loops = list(zip([*outer, "pj_ab", "pj_bb"], transpose_loops(kernel), strict=True))
    lines, depth = _open_nest(loops, plan.team > 0)
    p = "  " * depth
    out = em.element(names.buffer(body.node), body.index, None)
    src = em.element(names.buffer(body.value.node), body.value.index, None)
    full = [f"{p}  pj_u32x8 pj_r[{blk}];"]
    full += [f"{p}  {{ const int64_t {a} = pj_a0, {b} = pj_b0 + {r}; __builtin_memcpy(&pj_r[{r}], &{src}, 32); }}"
             for r in range(blk)]
    full.append(f"{p}  pj_transpose8(pj_r);")
    full += [f"{p}  {{ const int64_t {a} = pj_a0 + {r}, {b} = pj_b0; __builtin_memcpy(&{out}, &pj_r[{r}], 32); }}"
             for r in range(blk)]
    lines.append(f"{p}const int64_t pj_a0 = pj_ab * {blk}, pj_b0 = pj_bb * {blk};")
    if na % blk == 0 and nb % blk == 0:
        return lines + [f"{p}{{", *full, f"{p}}}"] + _close_nest(depth)
    edge = [f"{p}  const int64_t pj_a1 = pj_a0 + {blk} < {na} ? pj_a0 + {blk} : {na};",
            f"{p}  const int64_t pj_b1 = pj_b0 + {blk} < {nb} ? pj_b0 + {blk} : {nb};",
            f"{p}  for (int64_t {a} = pj_a0; {a} < pj_a1; ++{a})",
            f"{p}    for (int64_t {b} = pj_b0; {b} < pj_b1; ++{b})",
            *em.stmt(body, depth + 3)]
    lines += [f"{p}if (pj_a0 + {blk} <= {na} && pj_b0 + {blk} <= {nb}) {{", *full, f"{p}}} else {{", *edge, f"{p}}}"]
    return lines + _close_nest(depth)


# The shapes the C dialect writes for core/patterns.py
SHAPES: dict[str, ShapeEmitter] = {REGISTER_TILES: register_tiles, COLUMN: column, STAGED: staged,
                                   STREAMING: streaming, TRANSPOSE: transpose}
