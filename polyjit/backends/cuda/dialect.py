"""The CUDA C dialect: how the loop IR maps onto blocks and threads.

Every kernel is ``extern "C" __global__``; buffer parameters are device
pointers (pool base + offset, computed on the host), outputs first, then the
inputs, then the merge buffer; statics are ``long long`` arguments after them.

Each kernel gets one of four shapes, chosen from its sizes by :func:`plan_kernel`
(the same choice fixes its launch configuration):

``single``
    no parallel nest: one thread runs the body (serial loops, scalars).
``grid``
    the parallel nest flattened onto a 1-D grid with a grid-stride loop; the flat
    index is split into the nest's symbols with div/mod (32-bit when it fits).
    Reductions with many cells or short loops run here, one thread per cell.
``block_reduce``
    few cells and a long reduction: one block per cell (grid-stride over cells),
    each thread accumulates a strided share of the reduction, then a tree in
    shared memory with ``__syncthreads`` (``core/group_reduce.py``, shared with
    the OpenCL dialect).
``matmul``
    a float32 ``Reduce`` with one ADD loop whose value is the product of two
    loads, one indexed by (m, k) and one by (k, n), over a parallel (m, n)
    nest (plus an optional batch symbol on ``blockIdx.z``): shared-memory tiles
    (64x64 or 128x128, 4x4 or 8x8 outputs per thread), float4 loads when the
    sizes divide the tiles and the operands are contiguous and 16-byte aligned.

Launch configurations are OpenCL-style (``global_size`` in threads); the CUDA
grid is ``global // local``. Every 1-D launch (``single``, ``grid`` and
``block_reduce``) loops over its work with a grid stride, so the driver may
launch fewer blocks than the configuration says (it caps them at 32 per SM).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from polyjit.core import dtypes, group_reduce, ir
from polyjit.core.codegen import Dialect, Emitter, KernelSpec, LaunchShape, Names
from polyjit.core.dtypes import DType
from polyjit.core.ir import Affine, StaticSymbol, Symbol
from polyjit.core.lower import Call, Const, Kernel, Load, Reduce

THREADS = 256  # threads per block of grid-stride and most block-reduce kernels
MAX_BLOCKS = 1 << 16  # blocks of a 1-D launch in the configuration (the driver caps further)
MAX_GRID_YZ = 65535

# matmul: at least this many multiply-adds, and both output sides at least this long
MATMUL_MIN_FLOPS = 1 << 18
MATMUL_MIN_SIDE = 32
# __launch_bounds__(256, N) for the tiled matmul: 1 lets it keep its ~150 registers with no
# spills (one block per SM); 2 caps it at 128 registers (a few bytes spill). Tune on a GPU.
MATMUL_MIN_BLOCKS_PER_SM = 1


@attrs.frozen
class MatmulTiles:
    """One output tile per block: BM x BN outputs, TM x TN per thread, BK deep in shared memory."""

    bm: int
    bn: int
    bk: int
    tm: int
    tn: int

    @property
    def threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)


TILES_LARGE = MatmulTiles(128, 128, 8, 8, 8)
TILES_SMALL = MatmulTiles(64, 64, 16, 4, 4)


@attrs.frozen
class MatmulShape:
    """What a matmul-shaped Reduce computes: C[m, n] (+)= sum_k A[m, k] * B[k, n]."""

    reduce: Reduce
    a: Load  # indexed by m and k
    b: Load  # indexed by k and n
    m: Symbol
    n: Symbol
    k: Symbol
    batch: Symbol | None
    sizes: tuple[int, int, int, int]  # M, N, K, batch extent (1 without batch)
    tiles: MatmulTiles
    aligned: bool  # sizes divide the tiles: no bounds checks
    a_vec: str | None  # "k" or "m": the contiguous side of A, float4-loadable; None: scalar loads
    b_vec: str | None  # "n" or "k"


@attrs.frozen
class KernelPlan:
    kind: str  # "single", "grid", "block_reduce", "matmul"
    threads: int
    blocks: tuple[int, int, int]
    matmul: MatmulShape | None = None

    @property
    def launch(self) -> LaunchShape:
        gx, gy, gz = self.blocks
        if self.kind == "matmul":
            return LaunchShape((gx * self.threads, gy, gz), (self.threads, 1, 1))
        return LaunchShape((gx * self.threads,), (self.threads,))


# ---------------------------------------------------------------------------
# Choosing the shape of a kernel


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _threads_for(work: int) -> int:
    """256 threads, or fewer (a multiple of 32) for a small nest."""
    return THREADS if work >= THREADS else max(32, _ceil_div(work, 32) * 32)


def _grid_plan(work: int) -> KernelPlan:
    threads = _threads_for(work)
    return KernelPlan("grid", threads, (max(1, min(_ceil_div(work, threads), MAX_BLOCKS)), 1, 1))


def plan_kernel(kernel: Kernel) -> KernelPlan:
    """The shape and launch configuration of one kernel (see the module docstring)."""
    body = kernel.body
    if isinstance(body, Reduce) and kernel.parallel:
        mm = matmul_shape(kernel)
        if mm is not None:
            t = mm.tiles
            M, N, _, nb = mm.sizes
            return KernelPlan("matmul", t.threads, (_ceil_div(N, t.bn), _ceil_div(M, t.bm), nb), mm)
    if group_reduce.wants_group_reduce(kernel):
        assert isinstance(body, Reduce)
        long_and_few = kernel.work <= 64 and group_reduce.reduction_length(body) >= 1 << 16
        return KernelPlan("block_reduce", 1024 if long_and_few else THREADS, (group_reduce.group_count(kernel), 1, 1))
    if not kernel.parallel:
        return KernelPlan("single", 1, (1, 1, 1))
    return _grid_plan(kernel.work)


def _only(a: Affine, allowed: set[Symbol]) -> bool:
    return all(isinstance(v, StaticSymbol) or v in allowed for v in a.vars)


def matmul_shape(kernel: Kernel) -> MatmulShape | None:
    """The kernel's matmul structure, if it has one worth tiling (see the module docstring)."""
    r = kernel.body
    if not isinstance(r, Reduce) or r.accum is not ir.AccumOp.ADD or len(r.loops) != 1:
        return None
    if r.node.dtype is not dtypes.float32 or not (r.init is None or isinstance(r.init, Const)):
        return None
    v = r.value
    if not (isinstance(v, Call) and v.op is ir.Op.MUL and len(v.args) == 2):
        return None
    x, y = v.args
    if not (isinstance(x, Load) and isinstance(y, Load)):
        return None
    if x.dtype is not dtypes.float32 or y.dtype is not dtypes.float32:
        return None
    if len(kernel.parallel) not in (2, 3):
        return None
    k, K = r.loops[0]
    psyms = [s for s, _ in kernel.parallel]
    extent = dict(kernel.parallel)
    # m: the parallel symbol A reads; n: the one B reads; batch: the rest.
    for a, b in ((x, y), (y, x)):
        m_cands = [s for s in psyms if a.index.coeff(s) != 0 and b.index.coeff(s) == 0]
        n_cands = [s for s in psyms if b.index.coeff(s) != 0 and a.index.coeff(s) == 0]
        if len(m_cands) == 1 and len(n_cands) == 1:
            break
    else:
        return None
    m, n = m_cands[0], n_cands[0]
    rest = [s for s in psyms if s not in (m, n)]
    batch = rest[0] if rest else None
    if a.index.coeff(k) == 0 or b.index.coeff(k) == 0:
        return None
    common = {batch} if batch is not None else set()
    if not (_only(a.index, {m, k} | common) and _only(b.index, {k, n} | common)):
        return None
    if not _only(r.index, {m, n} | common) or r.index.coeff(m) == 0 or r.index.coeff(n) == 0:
        return None
    M, N = extent[m], extent[n]
    nb = extent[batch] if batch is not None else 1
    if M < MATMUL_MIN_SIDE or N < MATMUL_MIN_SIDE or M * N * K < MATMUL_MIN_FLOPS:
        return None
    tiles = TILES_LARGE if (M >= 256 and N >= 256) else TILES_SMALL
    if _ceil_div(M, tiles.bm) > MAX_GRID_YZ or nb > MAX_GRID_YZ:
        return None
    aligned = M % tiles.bm == 0 and N % tiles.bn == 0 and K % tiles.bk == 0
    a_vec = b_vec = None
    if aligned:
        a_vec = _vector_side(a.index, {"k": k, "m": m})
        b_vec = _vector_side(b.index, {"n": n, "k": k})
    return MatmulShape(r, a, b, m, n, k, batch, (M, N, K, nb), tiles, aligned, a_vec, b_vec)


def _vector_side(index: Affine, sides: dict[str, Symbol]) -> str | None:
    """Which side (by name, in order of preference) is contiguous with float4-aligned rows:
    coefficient 1 there, and every other coefficient and the constant a multiple of 4."""
    for side, sym in sides.items():
        if index.coeff(sym) != 1:
            continue
        others = [c for v, c in index.terms if v != sym]
        if all(c > 0 and c % 4 == 0 for c in others) and index.const % 4 == 0:
            return side
    return None


# ---------------------------------------------------------------------------
# The dialect


class CudaDialect(Dialect):
    """CUDA C for NVRTC (no headers: the few types it needs are defined in the prelude)."""

    name = "cuda"
    function_qualifier = "static __device__ __forceinline__"
    restrict = "__restrict__"

    def type_name(self, dt: DType) -> str:
        return dt.cuda

    def prelude(self, batch_dtypes: set[DType]) -> list[str]:
        return [
            "/* polyjit CUDA kernels (NVRTC) */",
            "#ifndef PJ_HAVE_STDINT",
            "typedef long long int64_t;",
            "typedef int int32_t;",
            "typedef unsigned char uint8_t;",
            "#endif",
            "",
        ]

    def reduce_pragma(self, r: Reduce) -> str | None:
        return None  # no OpenMP in CUDA C

    def kernel_prefix(self, kernel: Kernel) -> list[str]:
        return []  # the GCC workaround of the C dialect: NVRTC is not GCC

    def float_literal(self, value: float, dt: DType) -> str:
        if math.isnan(value):
            return "__int_as_float(0x7fc00000)" if dt is dtypes.float32 else "__longlong_as_double(0x7ff8000000000000LL)"
        if math.isinf(value):
            if dt is dtypes.float32:
                return "__int_as_float(0x7f800000)" if value > 0 else "__int_as_float(0xff800000)"
            bits = "0x7ff0000000000000LL" if value > 0 else "(long long)0xfff0000000000000ULL"
            return f"__longlong_as_double({bits})"
        return super().float_literal(value, dt)

    def launch_shape(self, kernel: Kernel) -> LaunchShape:
        return plan_kernel(kernel).launch

    # -- the kernel ------------------------------------------------------------------

    def signature(self, spec: KernelSpec, names: Names, threads: int, min_blocks: int = 1) -> str:
        params = []
        for node in spec.buffers:
            t = self.type_name(node.dtype)
            const = "" if node in spec.outputs else "const "
            params.append(f"{const}{t}* __restrict__ {names.buffer(node)}")
        if spec.merge is not None:
            params.append(f"const {self.type_name(spec.merge.dtype)}* __restrict__ {names.merge}")
        for s in spec.statics:
            params.append(f"long long {names.var(s)}")
        bounds = f"{threads}, {min_blocks}" if min_blocks > 1 else f"{threads}"
        return (f'extern "C" __global__ void __launch_bounds__({bounds}) '
                f"{spec.name}({', '.join(params) or 'void'}) {{")

    def emit_parallel(self, em: Emitter, kernel: Kernel, names: Names, indent: int) -> list[str]:
        plan = plan_kernel(kernel)
        if plan.kind == "matmul":
            assert plan.matmul is not None
            return _emit_matmul(em, kernel, plan.matmul, names)
        if plan.kind == "block_reduce":
            assert isinstance(kernel.body, Reduce)
            return group_reduce.emit_group_reduce(em, kernel, kernel.body, names, plan.threads, group_reduce.CUDA)
        if plan.kind == "single":
            return ["  if (blockIdx.x != 0 || threadIdx.x != 0) return;", *em.stmt(kernel.body, 1)]
        return _emit_grid(em, kernel, names)

    def emit_kernel(self, em: Emitter, kernel: Kernel, spec: KernelSpec, names: Names) -> list[str]:
        plan = plan_kernel(kernel)
        min_blocks = MATMUL_MIN_BLOCKS_PER_SM if plan.kind == "matmul" else 1
        return [self.signature(spec, names, plan.threads, min_blocks), *self.emit_parallel(em, kernel, names, 1), "}"]


# ---------------------------------------------------------------------------
# Emission


def _emit_grid(em: Emitter, kernel: Kernel, names: Names) -> list[str]:
    work = kernel.work
    if work == 0:  # an empty nest: nothing to do (a loop to 0u would draw a warning)
        return []
    ft, suf = group_reduce.index_type(work + MAX_BLOCKS * THREADS, group_reduce.CUDA)
    lines = [f"  for ({ft} pj_flat = ({ft})blockIdx.x * blockDim.x + threadIdx.x; pj_flat < {work}{suf}; "
             f"pj_flat += ({ft})gridDim.x * blockDim.x) {{"]
    lines += group_reduce.decompose("pj_flat", kernel.parallel, names, suf, "    ", group_reduce.CUDA)
    lines += em.stmt(kernel.body, 2)
    lines.append("  }")
    return lines


def _strip(a: Affine, syms: Sequence[Symbol]) -> Affine:
    """The affine without the terms of ``syms`` (what is left: batch, statics, constant)."""
    return Affine.of({v: c for v, c in a.terms if v not in syms}, a.const)


def _emit_matmul(em: Emitter, kernel: Kernel, mm: MatmulShape, names: Names) -> list[str]:
    t = mm.tiles
    BM, BN, BK, TM, TN, NT = t.bm, t.bn, t.bk, t.tm, t.tn, t.threads
    M, N, K, _ = mm.sizes
    r = mm.reduce
    a_base = names.merge if mm.a.merge else names.buffer(mm.a.node)
    b_base = names.merge if mm.b.merge else names.buffer(mm.b.node)
    c_base = names.buffer(r.node)
    am, ak = mm.a.index.coeff(mm.m), mm.a.index.coeff(mm.k)
    bk, bn = mm.b.index.coeff(mm.k), mm.b.index.coeff(mm.n)
    cm, cn = r.index.coeff(mm.m), r.index.coeff(mm.n)
    L: list[str] = [
        f"  __shared__ __align__(16) float pj_As[{BK * BM}];",
        f"  __shared__ __align__(16) float pj_Bs[{BK * BN}];",
        "  const int pj_tid = threadIdx.x;",
        f"  const int pj_ty = pj_tid / {BN // TN};",
        f"  const int pj_tx = pj_tid % {BN // TN};",
        f"  const long long pj_m0 = (long long)blockIdx.y * {BM};",
        f"  const long long pj_n0 = (long long)blockIdx.x * {BN};",
    ]
    if mm.batch is not None:
        L.append(f"  const long long {names.var(mm.batch)} = (long long)blockIdx.z;")
    L += [
        f"  const float* __restrict__ pj_A = {a_base} + ({em.index(_strip(mm.a.index, [mm.m, mm.k]))});",
        f"  const float* __restrict__ pj_B = {b_base} + ({em.index(_strip(mm.b.index, [mm.k, mm.n]))});",
        f"  float* __restrict__ pj_C = {c_base} + ({em.index(_strip(r.index, [mm.m, mm.n]))});",
        f"  float pj_c[{TM}][{TN}];",
        "  #pragma unroll",
        f"  for (int pj_i = 0; pj_i < {TM}; ++pj_i) {{",
        "    #pragma unroll",
        f"    for (int pj_j = 0; pj_j < {TN}; ++pj_j) pj_c[pj_i][pj_j] = 0.0f;",
        "  }",
        f"  for (long long pj_k0 = 0; pj_k0 < {K}LL; pj_k0 += {BK}) {{",
    ]
    L += _tile_loader("A", mm.a_vec, BM, BK, am, ak, M, K, "pj_m0", NT)
    L += _tile_loader("B", mm.b_vec, BN, BK, bn, bk, N, K, "pj_n0", NT)
    L += [
        "    __syncthreads();",
        "    #pragma unroll",
        f"    for (int pj_kk = 0; pj_kk < {BK}; ++pj_kk) {{",
        f"      float pj_a[{TM}];",
        f"      float pj_b[{TN}];",
        "      #pragma unroll",
        f"      for (int pj_q = 0; pj_q < {TM // 4}; ++pj_q) {{",
        f"        const float4 pj_v = *reinterpret_cast<const float4*>(&pj_As[pj_kk * {BM} + pj_ty * {TM} + 4 * pj_q]);",
        "        pj_a[4 * pj_q] = pj_v.x; pj_a[4 * pj_q + 1] = pj_v.y; pj_a[4 * pj_q + 2] = pj_v.z; pj_a[4 * pj_q + 3] = pj_v.w;",
        "      }",
        "      #pragma unroll",
        f"      for (int pj_q = 0; pj_q < {TN // 4}; ++pj_q) {{",
        f"        const float4 pj_v = *reinterpret_cast<const float4*>(&pj_Bs[pj_kk * {BN} + pj_tx * {TN} + 4 * pj_q]);",
        "        pj_b[4 * pj_q] = pj_v.x; pj_b[4 * pj_q + 1] = pj_v.y; pj_b[4 * pj_q + 2] = pj_v.z; pj_b[4 * pj_q + 3] = pj_v.w;",
        "      }",
        "      #pragma unroll",
        f"      for (int pj_i = 0; pj_i < {TM}; ++pj_i) {{",
        "        #pragma unroll",
        f"        for (int pj_j = 0; pj_j < {TN}; ++pj_j) pj_c[pj_i][pj_j] = fmaf(pj_a[pj_i], pj_b[pj_j], pj_c[pj_i][pj_j]);",
        "      }",
        "    }",
        "    __syncthreads();",
        "  }",
    ]
    # the store: C = init + acc, or C += acc when the Reduce starts from the cell
    cell = f"pj_C[pj_gm * {cm}LL + pj_gn * {cn}LL]"
    start = cell if r.init is None else em.expr(r.init)
    value = em.combine(ir.AccumOp.ADD, dtypes.float32, start, "pj_c[pj_i][pj_j]")
    guard_m = "" if mm.aligned else f"    if (pj_gm >= {M}LL) continue;"
    guard_n = "" if mm.aligned else f"      if (pj_gn >= {N}LL) continue;"
    L += [
        "  #pragma unroll",
        f"  for (int pj_i = 0; pj_i < {TM}; ++pj_i) {{",
        f"    const long long pj_gm = pj_m0 + pj_ty * {TM} + pj_i;",
    ]
    if guard_m:
        L.append(guard_m)
    L += [
        "    #pragma unroll",
        f"    for (int pj_j = 0; pj_j < {TN}; ++pj_j) {{",
        f"      const long long pj_gn = pj_n0 + pj_tx * {TN} + pj_j;",
    ]
    if guard_n:
        L.append(guard_n)
    L += [f"      {cell} = {value};", "    }", "  }"]
    return L


def _tile_loader(which: str, vec: str | None, BO: int, BK: int,
                 co: int, ck: int, extent: int, K: int, o0: str, NT: int) -> list[str]:
    """Load one BK x BO tile of A (outer = m) or B (outer = n) into pj_As / pj_Bs, laid out
    [k][outer] (outer contiguous). ``co``, ``ck``: the operand's strides along outer and k."""
    src, dst = f"pj_{which}", f"pj_{which}s"
    L: list[str] = []
    if vec == "k":  # contiguous along k: a float4 is 4 k's of one row; stored transposed
        n4 = BO * BK // 4
        L += [f"    for (int pj_e = pj_tid; pj_e < {n4}; pj_e += {NT}) {{",
              f"      const int pj_o = pj_e / {BK // 4};",
              f"      const int pj_k = (pj_e % {BK // 4}) * 4;",
              f"      const float4 pj_v = *reinterpret_cast<const float4*>(&{src}[({o0} + pj_o) * {co}LL + (pj_k0 + pj_k)]);",
              f"      {dst}[(pj_k + 0) * {BO} + pj_o] = pj_v.x;",
              f"      {dst}[(pj_k + 1) * {BO} + pj_o] = pj_v.y;",
              f"      {dst}[(pj_k + 2) * {BO} + pj_o] = pj_v.z;",
              f"      {dst}[(pj_k + 3) * {BO} + pj_o] = pj_v.w;",
              "    }"]
    elif vec is not None:  # contiguous along the outer side: a float4 is 4 rows of one k
        n4 = BO * BK // 4
        L += [f"    for (int pj_e = pj_tid; pj_e < {n4}; pj_e += {NT}) {{",
              f"      const int pj_k = pj_e / {BO // 4};",
              f"      const int pj_o = (pj_e % {BO // 4}) * 4;",
              f"      *reinterpret_cast<float4*>(&{dst}[pj_k * {BO} + pj_o]) = "
              f"*reinterpret_cast<const float4*>(&{src}[(pj_k0 + pj_k) * {ck}LL + ({o0} + pj_o)]);",
              "    }"]
    else:  # scalar, bounds-checked; the contiguous side (if any) varies fastest across threads
        k_fast = ck == 1 or co != 1
        split = (f"      const int pj_o = pj_e / {BK};\n      const int pj_k = pj_e % {BK};" if k_fast
                 else f"      const int pj_k = pj_e / {BO};\n      const int pj_o = pj_e % {BO};")
        L += [f"    for (int pj_e = pj_tid; pj_e < {BO * BK}; pj_e += {NT}) {{",
              *split.split("\n"),
              f"      const long long pj_go = {o0} + pj_o;",
              "      const long long pj_gk = pj_k0 + pj_k;",
              f"      {dst}[pj_k * {BO} + pj_o] = (pj_go < {extent}LL && pj_gk < {K}LL) ? "
              f"{src}[pj_go * {co}LL + pj_gk * {ck}LL] : 0.0f;",
              "    }"]
    return L


__all__ = [
    "CudaDialect",
    "KernelPlan",
    "MatmulShape",
    "MatmulTiles",
    "matmul_shape",
    "plan_kernel",
]
