"""The kernels CUDA and OpenCL share, written from a kernel's plan (core/patterns.py) in the
spelling a dialect gives (:class:`GpuSpelling`: ids, barriers, qualifiers, vector loads).

- ``serial``: one work-item runs the body.
- ``elementwise`` / ``reduction``, one work-item per cell: a global id per dimension
  (``GLOBAL_IDS``, guarded against the rounded-up size), or the flat nest on a grid-stride
  loop (``GRID_STRIDE``), split into the nest's symbols with div/mod (32-bit when it fits).
- ``group_reduction``: a group per output cell, striding over the cells: every work-item
  accumulates a strided share of the reduction, then the group combines the shares as a
  tree in local (shared) memory. The combining order differs from a serial loop: float
  sums agree with it to rounding, integer and max/min results exactly.
- ``contraction``: a group per ``bm`` x ``bn`` block of the output, ``tm`` x ``tn``
  outputs per thread (its columns in runs of 4, a warp's width apart: conflict-free reads
  of local memory, and stores a warp wide), ``bk``-deep slices of x and y staged in local
  memory (vector loads where the plan says so, bounds checks unless the sizes divide the
  tiles). With vector loads on both sides the next slice is loaded into registers while the
  multiply-adds of this one run (on an H200: a 4096 matmul 19 -> 45 TFLOP/s).
  A dialect may add a variant compiled instead under a macro (OpenCL's register tiles for
  CPU devices, ``-D PJ_CPU``): :attr:`GpuSpelling.host_tiles`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs

from polyjit.core import ir
from polyjit.core.ir import Affine, Symbol
from polyjit.core.loops import Kernel, Reduce
from polyjit.core.patterns import (
    COLUMN_ROWS,
    CONTRACTION,
    GLOBAL_IDS,
    GROUP_REDUCTION,
    MAX_GRID_BLOCKS,
    MAX_GROUPS,
    SERIAL,
    KernelPlan,
    column_reduction,
)

if TYPE_CHECKING:
    from polyjit.core.codegen import Emitter, Names

# A variant of the contraction's body: (em, plan, names, spelling) -> lines.
TileEmitter = Callable[["Emitter", KernelPlan, "Names", "GpuSpelling"], list[str]]


@attrs.frozen
class GpuSpelling:
    """How a GPU dialect spells work-items, groups and local memory."""

    group_ids: tuple[str, str, str]  # this group's index in dims 0, 1, 2
    groups: str  # groups in dim 0
    local: str  # this work-item's index in its group (dim 0)
    size: str  # work-items of a group (dim 0)
    barrier: str  # a group barrier over local memory
    shared: str  # qualifier of a group-local array
    shared_aligned: str  # the same, 16-byte aligned (for vector accesses)
    long: str  # a signed 64-bit integer
    long_suffix: str  # its literal suffix
    uint: tuple[str, str]  # 32-bit unsigned type and literal suffix
    ulong: tuple[str, str]  # 64-bit unsigned type and literal suffix
    pointer: str  # a pointer into global memory: "{const}" and "{t}" are filled in
    vector_load: str  # the 4-vector "{v}" at "&{p}"
    vector_store: str  # store "{x}" as the 4-vector "{v}" at "&{p}" (a statement)
    global_id: str = ""  # the global id in dim "{d}" (GLOBAL_IDS)
    unroll: str = "#pragma unroll"
    host_tiles: tuple[str, TileEmitter] | None = None  # (macro, variant compiled when it is defined)
    # unrolls "{n}" trips of the outer loop of a nest a thread reduces for its cell (the
    # compiler unrolls the inner loops, and single loops, by itself): their loads are in
    # flight together rather than one trip's at a time ("": no pragma)
    cell_reduction: str = ""
    # the macro under which a column reduction's work-items step through its rows together (a
    # group barrier every patterns.COLUMN_ROWS rows): a CPU device (PoCL) then runs each step across the
    # group's items, as vector lanes over contiguous outputs, where each item alone walked its
    # column a cache line a value (a 4096^2 column sum 148 ms, 7 ms stepped); "": never
    host_lockstep: str = ""


def emit_body(em: Emitter, kernel: Kernel, plan: KernelPlan, names: Names, s: GpuSpelling) -> list[str]:
    """The body of a kernel (inside its signature) on a GPU dialect."""
    if plan.kind == CONTRACTION:
        return emit_tiles(em, plan, names, s)
    if plan.kind == GROUP_REDUCTION:
        assert isinstance(kernel.body, Reduce)
        return emit_group_reduce(em, kernel, kernel.body, names, plan.threads, s)
    if plan.kind == SERIAL:
        return [f"  if ({s.group_ids[0]} != 0 || {s.local} != 0) return;", *em.stmt(kernel.body, 1)]
    if em.d.mapping == GLOBAL_IDS:
        return emit_global_ids(em, kernel, plan, names, s)
    return emit_grid_stride(em, kernel, plan, names, s)


def index_type(total: int, s: GpuSpelling) -> tuple[str, str]:
    """The flat-index type and its literal suffix: 32-bit unsigned when it cannot overflow."""
    return s.uint if total < (1 << 31) else s.ulong


def decompose(flat: str, nest: Sequence[tuple[Symbol, int]], names: Names, suffix: str, pad: str,
              s: GpuSpelling) -> list[str]:
    """``const long iK = (flat / stride) % extent`` for each symbol of a row-major nest."""
    strides = [math.prod(n for _, n in nest[pos + 1:]) for pos in range(len(nest))]
    out = []
    for pos, ((sym, n), st) in enumerate(zip(nest, strides)):
        e = flat if st == 1 else f"({flat} / {st}{suffix})"
        if pos > 0:
            e = f"({e} % {n}{suffix})"
        out.append(f"{pad}const {s.long} {names.var(sym)} = ({s.long}){e};")
    return out


def emit_global_ids(em: Emitter, kernel: Kernel, plan: KernelPlan, names: Names, s: GpuSpelling) -> list[str]:
    """Each parallel loop variable from a global id, guarded against the rounded-up size (a
    column reduction stepped in lockstep clamps its id instead: every item meets the barriers)."""
    lockstep = bool(s.host_lockstep) and len(plan.dims) == 1 and isinstance(kernel.body, Reduce) and \
        column_reduction(kernel) is not None
    lines: list[str] = []
    guarded = False
    for d, loops in enumerate(plan.dims):
        total = math.prod(n for _, n in loops)
        gid = s.global_id.format(d=d)
        rounded = plan.launch.global_size[d] != total
        guarded = guarded or rounded
        if rounded and lockstep:  # the last cell again, not stored (pj_live)
            lines.append(f"  const int pj_live = ({s.long}){gid} < {total};")
            gid = f"(pj_live ? ({s.long}){gid} : {total - 1})"
        if len(loops) == 1:
            v = names.var(loops[0][0])
            lines.append(f"  const {s.long} {v} = ({s.long}){gid};")
            if rounded and not lockstep:
                lines.append(f"  if ({v} >= {total}) return;")
            continue
        lines.append(f"  {s.long} pj_flat = ({s.long}){gid};")
        if rounded and not lockstep:
            lines.append(f"  if (pj_flat >= {total}) return;")
        for k, (sym, n) in enumerate(reversed(loops)):
            v = names.var(sym)
            if k == len(loops) - 1:
                lines.append(f"  const {s.long} {v} = pj_flat;")
            else:
                lines.append(f"  const {s.long} {v} = pj_flat % {n};")
                lines.append(f"  pj_flat /= {n};")
    if lockstep:
        assert isinstance(kernel.body, Reduce)
        return lines + lockstep_reduce(em, kernel.body, s, "pj_live" if guarded else None)
    return lines + em.stmt(kernel.body, 1)


def lockstep_reduce(em: Emitter, r: Reduce, s: GpuSpelling, live: str | None) -> list[str]:
    """A work-item's reduction for its output cell, its innermost loop COLUMN_ROWS rows at a
    time with a group barrier after each (compiled in where ``s.host_lockstep`` is defined):
    the items of a group take the same rows between two barriers, so a CPU device runs them
    as a loop across the items, reading each row contiguously. Each cell still combines its
    rows in order. ``live``: the flag of an item past the last cell (it stores nothing)."""
    t, pad = em.ctype(r.node.dtype), "  "
    target, init = em.reduce_cell(r)
    lines = [f"{pad}{{", f"{pad}  {t} pj_acc = {init};"]
    depth = 2
    for sym, n in r.loops[:-1]:
        v = em.names.var(sym)
        lines.append(f"{'  ' * depth}for ({s.long} {v} = 0; {v} < {n}; ++{v}) {{")
        depth += 1
    n, q = r.loops[-1][1], "  " * depth

    def rows(count: int, base: str) -> list[str]:
        return [f"{q}  {step}" for step in em.folded_rows(r, "pj_acc", base, count, s.long)]

    full = n - n % COLUMN_ROWS
    if full:
        lines += [f"{q}for ({s.long} pj_r = 0; pj_r < {full}; pj_r += {COLUMN_ROWS}) {{", *rows(COLUMN_ROWS, "pj_r"),
                  f"#ifdef {s.host_lockstep}", f"{q}  {s.barrier}", "#endif", f"{q}}}"]
    if n % COLUMN_ROWS:
        lines += [f"{q}{{", *rows(n % COLUMN_ROWS, str(full)), f"{q}}}"]
    for d in range(depth - 1, 1, -1):
        lines.append(f"{'  ' * d}}}")
    store = em.store(r.node, target, "pj_acc")
    return lines + [f"{pad}  {f'if ({live}) ' if live else ''}{store};", f"{pad}}}"]


def emit_grid_stride(em: Emitter, kernel: Kernel, plan: KernelPlan, names: Names, s: GpuSpelling) -> list[str]:
    """The flat nest on a grid-stride loop (the launch may have fewer blocks than cells); with
    ``plan.unroll`` U > 1 a thread takes U cells a block apart per trip (unrolled: their loads
    are independent, in flight together), guarded only where the cells are not a multiple of
    a trip's."""
    work = kernel.work
    if work == 0:  # an empty nest: nothing to do (a loop to 0u would draw a warning)
        return []
    u = plan.unroll
    ft, suf = index_type(work + MAX_GRID_BLOCKS * em.d.work_group * u, s)
    if u == 1:
        lines = [f"  for ({ft} pj_flat = ({ft}){s.group_ids[0]} * {s.size} + {s.local}; pj_flat < {work}{suf}; "
                 f"pj_flat += ({ft}){s.groups} * {s.size}) {{"]
        lines += decompose("pj_flat", kernel.parallel, names, suf, "    ", s)
        body = kernel.body
        pragma = _cell_reduction_pragma(body, s) if isinstance(body, Reduce) else None
        lines += em.reduce(body, 2, pragma) if pragma and isinstance(body, Reduce) else em.stmt(body, 2)
        lines.append("  }")
        return lines
    threads = plan.threads
    guard = work % (threads * u) != 0
    lines = [f"  for ({ft} pj_base = ({ft}){s.group_ids[0]} * {threads * u}{suf} + {s.local}; "
             f"pj_base < {work}{suf}; pj_base += ({ft}){s.groups} * {threads * u}{suf}) {{",
             f"    {s.unroll}",
             f"    for (int pj_u = 0; pj_u < {u}; ++pj_u) {{",
             f"      const {ft} pj_flat = pj_base + ({ft})pj_u * {threads}{suf};"]
    pad, depth = ("        ", 4) if guard else ("      ", 3)
    if guard:
        lines.append(f"      if (pj_flat < {work}{suf}) {{")
    lines += decompose("pj_flat", kernel.parallel, names, suf, pad, s)
    lines += em.stmt(kernel.body, depth)
    if guard:
        lines.append("      }")
    return lines + ["    }", "  }"]


def _cell_reduction_pragma(r: Reduce, s: GpuSpelling) -> str | None:
    """Unroll the outer loop of a nested reduction to about 32 of its innermost iterations a
    trip (2 to 8 trips); None for a single loop, which the compiler unrolls itself (nvcc took
    all 128 trips of a bias gradient's loop; a pragma for 4 made it 4x slower)."""
    if not s.cell_reduction or len(r.loops) < 2:
        return None
    inner = math.prod(n for _, n in r.loops[1:])
    if inner == 0:  # an empty inner loop: nothing to unroll
        return None
    trips = min(8, max(2, 32 // inner))
    return s.cell_reduction.format(n=trips) if r.loops[0][1] > trips else None


def emit_group_reduce(em: Emitter, kernel: Kernel, r: Reduce, names: Names, threads: int,
                      s: GpuSpelling) -> list[str]:
    """A group-per-cell reduction for groups of at most ``threads`` work-items (a power of
    two: the tree halves the group size)."""
    dt = r.node.dtype
    t = em.ctype(dt)  # half types accumulate in float32
    cells = kernel.work  # 1 without a parallel nest, 0 for an empty one
    if cells == 0:  # nothing to do (a loop to 0u would draw a warning)
        return []
    cft, csuf = index_type(cells + MAX_GROUPS, s)
    rft, rsuf = index_type(r.length + threads, s)
    neutral = em.literal(r.accum.neutral(dt), dt)
    target, start = em.reduce_cell(r)
    shared = f"pj_red[{s.local}]"
    lines = [f"  {s.shared} {t} pj_red[{threads}];",
             f"  for ({cft} pj_cell = {s.group_ids[0]}; pj_cell < {cells}{csuf}; pj_cell += {s.groups}) {{"]
    lines += decompose("pj_cell", kernel.parallel, names, csuf, "    ", s)
    lines += [f"    {t} pj_acc = {neutral};",
              f"    for ({rft} pj_r = {s.local}; pj_r < {r.length}{rsuf}; pj_r += {s.size}) {{"]
    lines += decompose("pj_r", r.loops, names, rsuf, "      ", s)
    lines += [f"      pj_acc = {em.combine(r.accum, dt, 'pj_acc', em.expr(r.value))};",
              "    }",
              f"    {shared} = pj_acc;",
              f"    {s.barrier}",
              f"    for (unsigned int pj_s = {s.size} >> 1; pj_s > 0u; pj_s >>= 1) {{",
              f"      if ({s.local} < pj_s) {{",
              f"        {shared} = {em.combine(r.accum, dt, shared, f'pj_red[{s.local} + pj_s]')};",
              "      }",
              f"      {s.barrier}",
              "    }",
              f"    if ({s.local} == 0) {em.store(r.node, target, em.combine(r.accum, dt, start, 'pj_red[0]'))};",
              f"    {s.barrier}",
              "  }"]
    return lines


# ---------------------------------------------------------------------------
# The tiled contraction


def decompose_batch(plan: KernelPlan, names: Names, group_z: str, s: GpuSpelling) -> list[str]:
    """The batch symbols of a contraction from the index ``group_z`` of dim 2."""
    assert plan.contraction is not None
    batch = plan.contraction.batch
    if len(batch) == 1:
        return [f"  const {s.long} {names.var(batch[0][0])} = ({s.long}){group_z};"]
    if not batch:
        return []
    return [f"  const {s.long} pj_bz = ({s.long}){group_z};",
            *decompose("pj_bz", batch, names, s.long_suffix, "  ", s)]


def _strip(a: Affine, syms: Sequence[Symbol]) -> Affine:
    """The affine without the terms of ``syms`` (what is left: batch, statics, constant)."""
    return Affine.of({v: c for v, c in a.terms if v not in syms}, a.const)


def emit_tiles(em: Emitter, plan: KernelPlan, names: Names, s: GpuSpelling) -> list[str]:
    """The tiled contraction (see the module docstring), and the dialect's variant if any."""
    if s.host_tiles is None:
        return _shared_tiles(em, plan, names, s)
    macro, variant = s.host_tiles
    return [f"#ifdef {macro}", *variant(em, plan, names, s), "#else", *_shared_tiles(em, plan, names, s), "#endif"]


def _shared_tiles(em: Emitter, plan: KernelPlan, names: Names, s: GpuSpelling) -> list[str]:
    c, t = plan.contraction, plan.tiles
    assert c is not None and t is not None
    BM, BN, BK, TM, TN, NT = t.bm, t.bn, t.bk, t.tm, t.tn, t.threads
    M, N, K = c.m, c.n, c.kk
    r = c.reduce
    dt = r.node.dtype
    ty, L, LL = em.d.type_name(dt), s.long, s.long_suffix
    vec = f"{ty}4"
    a_base = names.merge if c.x.merge else names.buffer(c.x.node)
    b_base = names.merge if c.y.merge else names.buffer(c.y.node)
    am, ak = c.x.index.coeff(c.i), c.x.index.coeff(c.k)
    bk, bn = c.y.index.coeff(c.k), c.y.index.coeff(c.j)
    cm, cn = r.index.coeff(c.i), r.index.coeff(c.j)
    zero = em.literal(0, dt)
    const_ptr = s.pointer.format(const="const ", t=ty)
    # a thread's TN columns are TN/4 runs of 4, a warp's width apart: its lanes read B's tile
    # without bank conflicts and write C in runs a warp wide
    col_run = (BN // TN) * 4
    lines = [
        f"  {s.shared_aligned} {ty} pj_As[{BK * BM}];",
        f"  {s.shared_aligned} {ty} pj_Bs[{BK * BN}];",
        f"  const int pj_tid = {s.local};",
        f"  const int pj_ty = pj_tid / {BN // TN};",
        f"  const int pj_tx = pj_tid % {BN // TN};",
        f"  const {L} pj_m0 = ({L}){s.group_ids[1]} * {BM};",
        f"  const {L} pj_n0 = ({L}){s.group_ids[0]} * {BN};",
        *decompose_batch(plan, names, s.group_ids[2], s),
        f"  {const_ptr} pj_A = {a_base} + ({em.index(_strip(c.x.index, [c.i, c.k]))});",
        f"  {const_ptr} pj_B = {b_base} + ({em.index(_strip(c.y.index, [c.k, c.j]))});",
        f"  {s.pointer.format(const='', t=ty)} pj_C = {names.buffer(r.node)} + "
        f"({em.index(_strip(r.index, [c.i, c.j]))});",
        f"  {ty} pj_c[{TM}][{TN}];",
        f"  {s.unroll}",
        f"  for (int pj_i = 0; pj_i < {TM}; ++pj_i) {{",
        f"    {s.unroll}",
        f"    for (int pj_j = 0; pj_j < {TN}; ++pj_j) pj_c[pj_i][pj_j] = {zero};",
        "  }",
    ]
    a_tile = _VectorTile("A", plan.x_vector, BM, BK, am, ak, NT, vec, s) if plan.x_vector else None
    b_tile = _VectorTile("B", plan.y_vector, BN, BK, bn, bk, NT, vec, s) if plan.y_vector else None
    lines += [*(a_tile.declare() if a_tile else []), *(b_tile.declare() if b_tile else [])]
    if a_tile and b_tile:
        # with vector loads on both sides, the next slice's loads are issued into registers
        # before this slice's multiply-adds (in flight while they run), stored to local memory after
        lines += [*a_tile.load("0", "pj_m0", 1), *b_tile.load("0", "pj_n0", 1),
                  f"  for ({L} pj_k0 = 0; pj_k0 < {K}{LL}; pj_k0 += {BK}) {{",
                  *a_tile.store(2), *b_tile.store(2), f"    {s.barrier}",
                  f"    if (pj_k0 + {BK} < {K}{LL}) {{",
                  *a_tile.load(f"pj_k0 + {BK}", "pj_m0", 3), *b_tile.load(f"pj_k0 + {BK}", "pj_n0", 3),
                  "    }"]
    else:  # each slice loaded, then stored, before its multiply-adds
        lines.append(f"  for ({L} pj_k0 = 0; pj_k0 < {K}{LL}; pj_k0 += {BK}) {{")
        for mover, which, BO, co, ck, extent, o0 in ((a_tile, "A", BM, am, ak, M, "pj_m0"),
                                                     (b_tile, "B", BN, bn, bk, N, "pj_n0")):
            lines += ([*mover.load("pj_k0", o0, 2), *mover.store(2)] if mover
                      else _scalar_tile_loader(which, BO, BK, co, ck, extent, K, o0, NT, zero, s))
        lines.append(f"    {s.barrier}")
    fma = em.d.math_call("fma", dt, ["pj_a[pj_i]", "pj_b[pj_j]", "pj_c[pj_i][pj_j]"])
    lines += [f"    {s.unroll}", f"    for (int pj_kk = 0; pj_kk < {BK}; ++pj_kk) {{",
              f"      {ty} pj_a[{TM}];", f"      {ty} pj_b[{TN}];"]
    for side, tile, width, offset, run in (("a", "pj_As", TM, f"pj_ty * {TM}", 4),
                                           ("b", "pj_Bs", TN, "pj_tx * 4", col_run)):
        v = s.vector_load.format(v=vec, p=f"{tile}[pj_kk * {BM if side == 'a' else BN} + {offset} + {run} * pj_q]")
        lines += [f"      {s.unroll}", f"      for (int pj_q = 0; pj_q < {width // 4}; ++pj_q) {{",
                  f"        const {vec} pj_v = {v};",
                  f"        pj_{side}[4 * pj_q] = pj_v.x; pj_{side}[4 * pj_q + 1] = pj_v.y; "
                  f"pj_{side}[4 * pj_q + 2] = pj_v.z; pj_{side}[4 * pj_q + 3] = pj_v.w;",
                  "      }"]
    lines += [f"      {s.unroll}", f"      for (int pj_i = 0; pj_i < {TM}; ++pj_i) {{", f"        {s.unroll}",
              f"        for (int pj_j = 0; pj_j < {TN}; ++pj_j) pj_c[pj_i][pj_j] = {fma};",
              "      }", "    }", f"    {s.barrier}", "  }"]
    # the store: C = init + acc, or C += acc when the Reduce starts from the cell
    cell = f"pj_C[pj_gm * {cm}{LL} + pj_gn * {cn}{LL}]"
    start = cell if r.init is None else em.expr(r.init)
    value = em.combine(ir.AccumOp.ADD, dt, start, "pj_c[pj_i][pj_j]")
    lines += [f"  {s.unroll}", f"  for (int pj_i = 0; pj_i < {TM}; ++pj_i) {{",
              f"    const {L} pj_gm = pj_m0 + pj_ty * {TM} + pj_i;"]
    if not plan.aligned:
        lines.append(f"    if (pj_gm >= {M}{LL}) continue;")
    lines += [f"    {s.unroll}", f"    for (int pj_j = 0; pj_j < {TN}; ++pj_j) {{",
              f"      const {L} pj_gn = pj_n0 + (pj_j / 4) * {col_run} + pj_tx * 4 + (pj_j % 4);"]
    if not plan.aligned:
        lines.append(f"      if (pj_gn >= {N}{LL}) continue;")
    return lines + [f"      {cell} = {value};", "    }", "  }"]


@attrs.frozen
class _VectorTile:
    """One operand's BK x BO slice moved as vectors through registers (``pj_Ar`` / ``pj_Br``)
    into local memory laid out [k][outer]: ``load`` the slice at k0 from global memory,
    ``store`` it to local memory. ``vec``: "k" (4 k's of one row, stored transposed) or the
    outer side (4 rows of one k)."""

    which: str
    vec: str
    BO: int
    BK: int
    co: int  # the operand's stride along outer
    ck: int  # and along k
    NT: int
    vtype: str
    s: GpuSpelling

    @property
    def count(self) -> int:
        return self.BO * self.BK // 4

    @property
    def regs(self) -> int:
        return -(-self.count // self.NT)

    def declare(self) -> list[str]:
        return [f"  {self.vtype} pj_{self.which}r[{self.regs}];"]

    def _each(self, pad: str, body: Callable[[str], list[str]]) -> list[str]:
        """``body(reg)`` for each of this thread's vectors (pj_o, pj_k set), unrolled."""
        split = ([f"const int pj_o = pj_e / {self.BK // 4};", f"const int pj_k = (pj_e % {self.BK // 4}) * 4;"]
                 if self.vec == "k" else
                 [f"const int pj_k = pj_e / {self.BO // 4};", f"const int pj_o = (pj_e % {self.BO // 4}) * 4;"])
        out = []
        for q in range(self.regs):
            e = f"pj_tid + {q * self.NT}" if q else "pj_tid"
            guard = (q + 1) * self.NT > self.count
            inner = [f"const int pj_e = {e};", *split, *body(f"pj_{self.which}r[{q}]")]
            if guard:
                out += [f"{pad}if ({e} < {self.count}) {{", *(f"{pad}  {x}" for x in inner), f"{pad}}}"]
            else:
                out += [f"{pad}{{", *(f"{pad}  {x}" for x in inner), f"{pad}}}"]
        return out

    def load(self, k0: str, o0: str, indent: int) -> list[str]:
        src, LL = f"pj_{self.which}", self.s.long_suffix
        if self.vec == "k":
            p = f"{src}[({o0} + pj_o) * {self.co}{LL} + ({k0} + pj_k)]"
        else:
            p = f"{src}[({k0} + pj_k) * {self.ck}{LL} + ({o0} + pj_o)]"
        v = self.s.vector_load.format(v=self.vtype, p=p)
        return self._each("  " * indent, lambda reg: [f"{reg} = {v};"])

    def store(self, indent: int) -> list[str]:
        dst = f"pj_{self.which}s"
        if self.vec == "k":
            return self._each("  " * indent, lambda reg: [f"{dst}[(pj_k + {q}) * {self.BO} + pj_o] = {reg}.{lane};"
                                                          for q, lane in enumerate("xyzw")])
        return self._each("  " * indent, lambda reg: [
            self.s.vector_store.format(v=self.vtype, p=f"{dst}[pj_k * {self.BO} + pj_o]", x=reg)])


def _scalar_tile_loader(which: str, BO: int, BK: int, co: int, ck: int, extent: int, K: int,
                        o0: str, NT: int, zero: str, s: GpuSpelling) -> list[str]:
    """Load one BK x BO tile of A (outer = m) or B (outer = n) into pj_As / pj_Bs, laid out
    [k][outer] (outer contiguous), element by element, bounds-checked (an operand with no
    vector side: :class:`_VectorTile` moves the others). ``co``, ``ck``: the operand's
    strides along outer and k; the contiguous side (if any) varies fastest across threads."""
    src, dst, LL = f"pj_{which}", f"pj_{which}s", s.long_suffix
    k_fast = ck == 1 or co != 1
    split = ([f"      const int pj_o = pj_e / {BK};", f"      const int pj_k = pj_e % {BK};"] if k_fast
             else [f"      const int pj_k = pj_e / {BO};", f"      const int pj_o = pj_e % {BO};"])
    return [f"    for (int pj_e = pj_tid; pj_e < {BO * BK}; pj_e += {NT}) {{",
            *split,
            f"      const {s.long} pj_go = {o0} + pj_o;",
            f"      const {s.long} pj_gk = pj_k0 + pj_k;",
            f"      {dst}[pj_k * {BO} + pj_o] = (pj_go < {extent}{LL} && pj_gk < {K}{LL}) ? "
            f"{src}[pj_go * {co}{LL} + pj_gk * {ck}{LL}] : {zero};",
            "    }"]
