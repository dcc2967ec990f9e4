"""Reductions run by a whole work-group (OpenCL) or block (CUDA) per output cell.

A kernel whose body is a ``Reduce`` normally gives each output cell to one
work-item, which then walks the reduction alone: right for many cells, wrong
for a few long reductions (a loss summed over a batch runs on one work-item of
the whole device). :func:`wants_group_reduce` picks the kernels that should
instead give each cell to a group: every work-item accumulates a strided share
of the reduction, then the group combines the shares as a tree in local
(shared) memory. Groups walk the cells with a stride, so the launch may have
fewer groups than cells.

The OpenCL and CUDA dialects share this code; :class:`GroupIds` names what
differs (ids, barrier, local-memory qualifier, the 64-bit integer type).
The combining order differs from a serial loop: float sums agree with it to
rounding, integer and max/min results exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from polyjit.core.codegen import Emitter, Names
from polyjit.core.ir import Symbol
from polyjit.core.lower import Kernel, Load, Reduce, walk_exprs

# A reduction at least this long, over at most this many cells...
MIN_LENGTH = 512
MAX_CELLS = 1 << 22
# ... unless the cells are contiguous in memory and many: one work-item per cell coalesces then.
WORK_ITEM_PER_CELL_MIN_CELLS = 4096
MAX_GROUPS = 1 << 16  # groups of a launch; they stride over the cells beyond


@attrs.frozen
class GroupIds:
    """The spelling of a dialect's group-level builtins."""

    group: str
    groups: str
    local: str
    size: str
    barrier: str
    shared: str  # qualifier of a group-local array
    long: str  # a signed 64-bit integer
    uint: tuple[str, str]  # 32-bit unsigned type and literal suffix
    ulong: tuple[str, str]  # 64-bit unsigned type and literal suffix


CUDA = GroupIds("blockIdx.x", "gridDim.x", "threadIdx.x", "blockDim.x", "__syncthreads();", "__shared__",
                "long long", ("unsigned int", "u"), ("unsigned long long", "ull"))
OPENCL = GroupIds("get_group_id(0)", "get_num_groups(0)", "get_local_id(0)", "get_local_size(0)",
                  "barrier(CLK_LOCAL_MEM_FENCE);", "__local", "long", ("uint", "u"), ("ulong", "UL"))


def reduction_length(r: Reduce) -> int:
    return math.prod(n for _, n in r.loops)


def wants_group_reduce(kernel: Kernel) -> bool:
    """Few cells and long reductions: a group per cell (see the module docstring)."""
    r = kernel.body
    if not isinstance(r, Reduce) or not r.loops or reduction_length(r) < MIN_LENGTH:
        return False
    if not kernel.parallel:
        return True
    cells = kernel.work
    if cells > MAX_CELLS:
        return False
    inner_cell, inner_red = kernel.parallel[-1][0], r.loops[-1][0]
    loads = [e for e in walk_exprs(r) if isinstance(e, Load)]
    cell_contiguous = any(ld.index.coeff(inner_cell) == 1 for ld in loads)
    red_contiguous = any(ld.index.coeff(inner_red) == 1 for ld in loads)
    return not (cell_contiguous and not red_contiguous and cells >= WORK_ITEM_PER_CELL_MIN_CELLS)


def group_count(kernel: Kernel) -> int:
    return max(1, min(kernel.work, MAX_GROUPS))  # work is 1 without a parallel nest


def index_type(total: int, ids: GroupIds) -> tuple[str, str]:
    """The flat-index type and its literal suffix: 32-bit unsigned when it cannot overflow."""
    return ids.uint if total < (1 << 31) else ids.ulong


def decompose(flat: str, nest: Sequence[tuple[Symbol, int]], names: Names, suffix: str, pad: str,
              ids: GroupIds) -> list[str]:
    """``const long iK = (flat / stride) % extent`` for each symbol of a row-major nest."""
    strides = [math.prod(n for _, n in nest[pos + 1:]) for pos in range(len(nest))]
    out = []
    for pos, ((sym, n), st) in enumerate(zip(nest, strides)):
        e = flat if st == 1 else f"({flat} / {st}{suffix})"
        if pos > 0:
            e = f"({e} % {n}{suffix})"
        out.append(f"{pad}const {ids.long} {names.var(sym)} = ({ids.long}){e};")
    return out


def emit_group_reduce(em: Emitter, kernel: Kernel, r: Reduce, names: Names, threads: int,
                      ids: GroupIds) -> list[str]:
    """The body of a group-per-cell reduction for groups of at most ``threads`` work-items
    (a power of two: the tree halves the group size)."""
    dt = r.node.dtype
    t = em.d.type_name(dt)
    cells = kernel.work  # 1 without a parallel nest, 0 for an empty one
    if cells == 0:  # nothing to do (a loop to 0u would draw a warning)
        return []
    length = reduction_length(r)
    cft, csuf = index_type(cells + MAX_GROUPS, ids)
    rft, rsuf = index_type(length + threads, ids)
    neutral = em.literal(r.accum.neutral(dt), dt)
    target, start = em.reduce_cell(r)
    shared = f"pj_red[{ids.local}]"
    lines = [f"  {ids.shared} {t} pj_red[{threads}];",
             f"  for ({cft} pj_cell = {ids.group}; pj_cell < {cells}{csuf}; pj_cell += {ids.groups}) {{"]
    lines += decompose("pj_cell", kernel.parallel, names, csuf, "    ", ids)
    lines += [f"    {t} pj_acc = {neutral};",
              f"    for ({rft} pj_r = {ids.local}; pj_r < {length}{rsuf}; pj_r += {ids.size}) {{"]
    lines += decompose("pj_r", r.loops, names, rsuf, "      ", ids)
    lines += [f"      pj_acc = {em.combine(r.accum, dt, 'pj_acc', em.expr(r.value))};",
              "    }",
              f"    {shared} = pj_acc;",
              f"    {ids.barrier}",
              f"    for (unsigned int pj_s = {ids.size} >> 1; pj_s > 0u; pj_s >>= 1) {{",
              f"      if ({ids.local} < pj_s) {{",
              f"        {shared} = {em.combine(r.accum, dt, shared, f'pj_red[{ids.local} + pj_s]')};",
              "      }",
              f"      {ids.barrier}",
              "    }",
              f"    if ({ids.local} == 0) {target} = {em.combine(r.accum, dt, start, 'pj_red[0]')};",
              f"    {ids.barrier}",
              "  }"]
    return lines
