"""The OpenCL C dialect: ``__kernel`` functions, ``__global`` pointers, parallel loops on
global ids, and the tiled contraction kernel (a vector-register variant for CPU devices,
``-D PJ_CPU``, and a local-memory variant for the others)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from polyjit.core import dtypes, group_reduce
from polyjit.core.codegen import Dialect, Emitter, KernelSpec, LaunchShape, Names
from polyjit.core.dtypes import DType
from polyjit.core.ir import Symbol
from polyjit.core.lower import Const, Contraction, Kernel, Reduce, match_contraction


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


CPU_BUILD_OPTION = "-D PJ_CPU=1"  # selects the CPU variant of tiled kernels


@attrs.frozen
class MatmulTiles:
    """Each work-item computes rm x rn outputs; a work-group is lx x ly work-items;
    the local-memory variant stages tk-deep slices of the operands."""

    rm: int = 8
    rn: int = 8
    lx: int = 8
    ly: int = 8
    tk: int = 16

    @property
    def bm(self) -> int:
        return self.rm * self.ly

    @property
    def bn(self) -> int:
        return self.rn * self.lx


class OpenCLDialect(Dialect):
    """OpenCL C: ``__kernel`` functions, ``__global`` pointers, parallel loops on global ids."""

    name = "opencl"
    function_qualifier = "static inline"
    restrict = "restrict"
    work_group = 256  # work-items of a generic kernel's work-group
    tiles = MatmulTiles()
    # A contraction gets the tiled kernel when it is at least this big.
    matmul_min_side = 16
    matmul_min_work = 1 << 15  # m * n * k

    def __init__(self, matmul: bool = True, group_reductions: bool = True) -> None:
        self.matmul = matmul
        # A work-group per cell for few, long reductions (core/group_reduce.py). Right for GPUs;
        # PoCL's CPU devices run a work-group's items one after the other, so there the
        # strided shares are slower than one work-item walking its row (3.6 vs 9.8 ms for a
        # 2^22 sum): the driver turns them off on platforms of CPU devices only.
        self.group_reductions = group_reductions

    def type_name(self, dt: DType) -> str:
        return dt.opencl

    def prelude(self, batch_dtypes: set[DType]) -> list[str]:
        lines = ["/* polyjit OpenCL kernels */"]
        if dtypes.float64 in batch_dtypes:
            lines.append("#pragma OPENCL EXTENSION cl_khr_fp64 : enable")
        lines += ["typedef long int64_t;  /* the emitter's index type */", ""]
        return lines

    def helper_definitions(self, batch_dtypes: set[DType]) -> list[tuple[str, list[str]]]:
        """The tiled kernels' work-group attribute (a macro: PJ_CPU drops it), then max/min."""
        t = self.tiles
        wg = ["#ifdef PJ_CPU",
              "#define PJ_MATMUL_WG",
              "#else",
              f"#define PJ_MATMUL_WG __attribute__((reqd_work_group_size({t.lx}, {t.ly}, 1)))",
              "#endif"]
        return [("PJ_MATMUL_WG", wg), *super().helper_definitions(batch_dtypes)]

    def reduce_pragma(self, r: Reduce) -> str | None:
        return None  # no OpenMP in OpenCL C

    def kernel_prefix(self, kernel: Kernel) -> list[str]:
        return []  # the GCC workaround of the C dialect: no OpenCL compiler is GCC

    def math_call(self, fn: str, dt: DType, args: Sequence[str]) -> str:
        # OpenCL C overloads the math functions on float and double: no suffix.
        name = "fabs" if fn == "abs" else fn
        return f"{name}({', '.join(args)})"

    # -- kernel signature ------------------------------------------------------

    def kernel_open(self, spec: KernelSpec, names: Names, attributes: str = "") -> list[str]:
        """Each buffer is a pool (``__global char*``) plus a byte offset; statics are ``long``."""
        params: list[str] = []
        for k in range(len(spec.buffers)):
            params += [f"__global char* p{k}", f"ulong o{k}"]
        if spec.merge is not None:
            params += ["__global char* pm", "ulong om"]
        params += [f"long {names.var(s)}" for s in spec.statics]
        lines = [f"__kernel {attributes}void {spec.name}({', '.join(params) or 'void'}) {{"]
        for k, node in enumerate(spec.buffers):
            t = self.type_name(node.dtype)
            const = "" if node in spec.outputs else "const "
            lines.append(f"  __global {const}{t}* restrict {names.buffer(node)} = "
                         f"(__global {const}{t}*)(p{k} + o{k});")
        if spec.merge is not None:
            t = self.type_name(spec.merge.dtype)
            lines.append(f"  __global const {t}* restrict {names.merge} = (__global const {t}*)(pm + om);")
        return lines

    # -- launch configuration ----------------------------------------------------

    def contraction(self, kernel: Kernel) -> Contraction | None:
        """The kernel's matmul structure, when it is worth the tiled kernel."""
        if not self.matmul:
            return None
        c = match_contraction(kernel)
        if c is None or not (c.reduce.init is None or _is_zero(c.reduce)):
            return None
        if min(c.m, c.n) < self.matmul_min_side or c.m * c.n * c.kk < self.matmul_min_work:
            return None
        return c

    def group_reduction(self, kernel: Kernel) -> bool:
        """Whether the kernel gets a work-group per output cell (core/group_reduce.py)."""
        return self.group_reductions and group_reduce.wants_group_reduce(kernel)

    @staticmethod
    def dims(kernel: Kernel) -> list[list[tuple[Symbol, int]]]:
        """The parallel loops on each global dimension: dim 0 is the innermost loop; beyond
        three loops, the outer ones share dim 2 (flattened)."""
        nest = list(kernel.parallel)
        if len(nest) <= 3:
            return [[lp] for lp in reversed(nest)]
        return [[nest[-1]], [nest[-2]], nest[:-2]]

    def launch_shape(self, kernel: Kernel) -> LaunchShape:
        c = self.contraction(kernel)
        if c is not None:
            t = self.tiles
            gx = _ceil_div(c.n, t.bn) * t.lx
            gy = _ceil_div(c.m, t.bm) * t.ly
            nb = math.prod(n for _, n in c.batch)
            return LaunchShape((gx, gy, nb), (t.lx, t.ly, 1))
        if self.group_reduction(kernel):
            return LaunchShape((group_reduce.group_count(kernel) * self.work_group,), (self.work_group,))
        if not kernel.parallel:
            return LaunchShape((1,), (1,))
        extents = [math.prod(n for _, n in loops) for loops in self.dims(kernel)]
        local: list[int] = []
        room = self.work_group
        for e in extents:  # fill the work-group from dim 0 (contiguous in memory) outwards
            size = min(_pow2_at_least(e), room)
            local.append(size)
            room //= size
        glob = tuple(_ceil_div(e, lsz) * lsz for e, lsz in zip(extents, local))
        return LaunchShape(glob, tuple(local))

    # -- kernel bodies -------------------------------------------------------------

    def emit_kernel(self, em: Emitter, kernel: Kernel, spec: KernelSpec, names: Names) -> list[str]:
        c = self.contraction(kernel)
        if c is not None:
            return [*self.kernel_open(spec, names, "PJ_MATMUL_WG "), *_emit_matmul(self, em, c, names), "}"]
        if self.group_reduction(kernel):
            assert isinstance(kernel.body, Reduce)
            body = group_reduce.emit_group_reduce(em, kernel, kernel.body, names, self.work_group, group_reduce.OPENCL)
            size = f"__attribute__((reqd_work_group_size({self.work_group}, 1, 1))) "
            return [*self.kernel_open(spec, names, size), *body, "}"]
        return [*self.kernel_open(spec, names), *self.emit_parallel(em, kernel, names, 1), "}"]

    def emit_parallel(self, em: Emitter, kernel: Kernel, names: Names, indent: int) -> list[str]:
        """Each parallel loop variable from a global id, guarded against the rounded-up size."""
        pad = "  " * indent
        launch = self.launch_shape(kernel)
        lines: list[str] = []
        for d, loops in enumerate(self.dims(kernel)):
            total = math.prod(n for _, n in loops)
            if len(loops) == 1:
                v = names.var(loops[0][0])
                lines.append(f"{pad}const long {v} = (long)get_global_id({d});")
                if launch.global_size[d] != total:
                    lines.append(f"{pad}if ({v} >= {total}) return;")
                continue
            lines.append(f"{pad}long pj_flat = (long)get_global_id({d});")
            if launch.global_size[d] != total:
                lines.append(f"{pad}if (pj_flat >= {total}) return;")
            for k, (sym, n) in enumerate(reversed(loops)):
                v = names.var(sym)
                if k == len(loops) - 1:
                    lines.append(f"{pad}const long {v} = pj_flat;")
                else:
                    lines.append(f"{pad}const long {v} = pj_flat % {n};")
                    lines.append(f"{pad}pj_flat /= {n};")
        return lines + em.stmt(kernel.body, indent)


def _is_zero(r: Reduce) -> bool:
    return isinstance(r.init, Const) and r.init.value == 0


def _emit_matmul(d: OpenCLDialect, em: Emitter, c: Contraction, names: Names) -> list[str]:
    """The tiled kernel of a contraction ``out[i, j] (+)= sum_k x[i, k] * y[k, j]``.

    ``x``/``y``/``out`` are written through the emitter with the loop variables
    ``i``, ``j``, ``k`` declared as locals, so any affine indexing (transposed x,
    statics, the merge buffer) works; ``y`` and ``out`` are contiguous in j.
    """
    t = d.tiles
    dt = c.reduce.node.dtype
    ty = d.type_name(dt)
    i, j, k = names.var(c.i), names.var(c.j), names.var(c.k)
    out = f"{names.buffer(c.reduce.node)}[{em.index(c.reduce.index)}]"
    x, y = em.expr(c.x), em.expr(c.y)
    zero = em.literal(0, dt)
    accumulate = c.reduce.init is None  # add onto what the output holds
    m, n, kk = c.m, c.n, c.kk
    lines: list[str] = []
    if c.batch:  # batch loops: global dim 2 (work-groups are 1 deep there)
        lines.append("  long pj_flat = (long)get_global_id(2);")
        for pos, (sym, ext) in enumerate(reversed(c.batch)):
            v = names.var(sym)
            last = pos == len(c.batch) - 1
            lines.append(f"  const long {v} = pj_flat{'' if last else f' % {ext}'};")
            if not last:
                lines.append(f"  pj_flat /= {ext};")
    rm, rn = t.rm, t.rn
    # -- CPU devices: an rm x rn block per work-item in vector registers ----------
    # 32-byte vectors (float8, double4; wider ones change the ABI of PoCL's builtins on AVX2).
    w = max(1, min(rn, 32 // dt.itemsize))
    nv = rn // w
    vec = f"{ty}{w}"
    lines += [
        "#ifdef PJ_CPU",
        f"  const long pj_i0 = (long)get_global_id(1) * {rm}, pj_j0 = (long)get_global_id(0) * {rn};",
        f"  if (pj_i0 >= {m} || pj_j0 >= {n}) return;",
        f"  if (pj_i0 + {rm} <= {m} && pj_j0 + {rn} <= {n}) {{",
        f"    const long {j} = pj_j0;",
    ]
    for r in range(rm):
        for q in range(nv):
            init = f"vload{w}({q}, &{out})" if accumulate else f"({vec})({zero})"
            lines.append(f"    {vec} pj_c{r}_{q}; {{ const long {i} = pj_i0 + {r}; pj_c{r}_{q} = {init}; }}")
    lines.append(f"    for (long {k} = 0; {k} < {kk}; ++{k}) {{")
    lines += [f"      const {vec} pj_b{q} = vload{w}({q}, &{y});" for q in range(nv)]
    for r in range(rm):
        adds = " ".join(f"pj_c{r}_{q} += pj_a * pj_b{q};" for q in range(nv))
        lines.append(f"      {{ const long {i} = pj_i0 + {r}; const {vec} pj_a = ({vec})({x}); {adds} }}")
    lines.append("    }")
    for r in range(rm):
        stores = " ".join(f"vstore{w}(pj_c{r}_{q}, {q}, &{out});" for q in range(nv))
        lines.append(f"    {{ const long {i} = pj_i0 + {r}; {stores} }}")
    lines += [
        "  } else {  /* an edge block: plain loops */",
        f"    for (long {i} = pj_i0; {i} < pj_i0 + {rm} && {i} < {m}; ++{i}) {{",
        f"      for (long {j} = pj_j0; {j} < pj_j0 + {rn} && {j} < {n}; ++{j}) {{",
        f"        {ty} pj_acc = {out if accumulate else zero};",
        f"        for (long {k} = 0; {k} < {kk}; ++{k}) pj_acc += {x} * {y};",
        f"        {out} = pj_acc;",
        "      }",
        "    }",
        "  }",
        "#else",
    ]
    # -- other devices: local-memory tiles, rm x rn strided outputs per work-item --------
    bm, bn, tk, nt = t.bm, t.bn, t.tk, t.lx * t.ly
    lines += [
        f"  __local {ty} pj_xs[{tk}][{bm}];",
        f"  __local {ty} pj_ys[{tk}][{bn}];",
        "  const int pj_tx = (int)get_local_id(0), pj_ty = (int)get_local_id(1);",
        f"  const int pj_t = pj_ty * {t.lx} + pj_tx;",
        f"  const long pj_gi = (long)get_group_id(1) * {bm}, pj_gj = (long)get_group_id(0) * {bn};",
        f"  {ty} pj_acc[{rm}][{rn}];",
        f"  for (int pj_r = 0; pj_r < {rm}; ++pj_r)",
        f"    for (int pj_s = 0; pj_s < {rn}; ++pj_s) pj_acc[pj_r][pj_s] = {zero};",
        f"  for (long pj_k0 = 0; pj_k0 < {kk}; pj_k0 += {tk}) {{",
        f"    for (int pj_e = pj_t; pj_e < {tk * bm}; pj_e += {nt}) {{",
        f"      const int pj_r = pj_e / {tk}, pj_q = pj_e % {tk};",
        f"      const long {i} = pj_gi + pj_r, {k} = pj_k0 + pj_q;",
        f"      pj_xs[pj_q][pj_r] = ({i} < {m} && {k} < {kk}) ? {x} : {zero};",
        "    }",
        f"    for (int pj_e = pj_t; pj_e < {tk * bn}; pj_e += {nt}) {{",
        f"      const int pj_q = pj_e / {bn}, pj_s = pj_e % {bn};",
        f"      const long {k} = pj_k0 + pj_q, {j} = pj_gj + pj_s;",
        f"      pj_ys[pj_q][pj_s] = ({k} < {kk} && {j} < {n}) ? {y} : {zero};",
        "    }",
        "    barrier(CLK_LOCAL_MEM_FENCE);",
        f"    for (int pj_q = 0; pj_q < {tk}; ++pj_q) {{",
        f"      {ty} pj_a[{rm}], pj_b[{rn}];",
        f"      for (int pj_r = 0; pj_r < {rm}; ++pj_r) pj_a[pj_r] = pj_xs[pj_q][pj_ty + {t.ly} * pj_r];",
        f"      for (int pj_s = 0; pj_s < {rn}; ++pj_s) pj_b[pj_s] = pj_ys[pj_q][pj_tx + {t.lx} * pj_s];",
        f"      for (int pj_r = 0; pj_r < {rm}; ++pj_r)",
        f"        for (int pj_s = 0; pj_s < {rn}; ++pj_s) pj_acc[pj_r][pj_s] += pj_a[pj_r] * pj_b[pj_s];",
        "    }",
        "    barrier(CLK_LOCAL_MEM_FENCE);",
        "  }",
        f"  for (int pj_r = 0; pj_r < {rm}; ++pj_r) {{",
        f"    const long {i} = pj_gi + pj_ty + {t.ly} * pj_r;",
        f"    for (int pj_s = 0; pj_s < {rn}; ++pj_s) {{",
        f"      const long {j} = pj_gj + pj_tx + {t.lx} * pj_s;",
        f"      if ({i} < {m} && {j} < {n}) {out} = {f'{out} + ' if accumulate else ''}pj_acc[pj_r][pj_s];",
        "    }",
        "  }",
        "#endif",
    ]
    return lines


