"""Kernel plans: how each kernel runs, decided once, here, for every dialect.

:func:`plan_kernel` gives a kernel its :class:`KernelPlan`: its kind, the special shape a
dialect writes it in (if any), its tiles and its launch shape. Codegen carries the plan on
the kernel's ``KernelSpec``; the emitters (core/codegen.py, core/gpu.py, the CPU's tiles)
follow it and decide nothing. A dialect only declares what its target is (how parallel
loops map onto it, its work-group sizes, which shapes it can write, the sizes worth tiling):

``serial``
    no parallel nest: one thread runs the body (serial loops, a short full reduction).
``elementwise`` / ``reduction``
    a parallel nest over the cells, one thread (work-item) per cell, around a store or a
    per-cell reduction. On the C dialect OpenMP threads share the outer loops
    (``team``), or the loops of a long full reduction; OpenCL maps the nest onto global
    ids (``dims``), CUDA flattens it onto a grid-stride loop.
``group_reduction``
    few cells and long reductions: a work-group (block) per cell, strided shares, then a
    tree in local memory (GPU dialects).
``contraction``
    ``out[i, j] (+)= sum_k x[i, k] * y[k, j]`` (:func:`match_contraction`, the one matcher)
    as tiles: register tiles with vector extensions on the CPU, shared-memory tiles on GPUs.

The CPU's shapes (``register_tiles``, ``column``, ``staged``, ``streaming``, ``transpose``)
are chosen here too; ``backends/cpu/tiles.py`` only writes them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import attrs

from polyjit.core import ir
from polyjit.core.ir import Affine, Symbol
from polyjit.core.loops import (
    Call,
    Const,
    Kernel,
    Load,
    Loop,
    Reduce,
    Segment,
    Seq,
    Stmt,
    Store,
    inner_work,
    walk_exprs,
    walk_stmts,
)

if TYPE_CHECKING:
    from polyjit.core.codegen import Dialect

# Kinds
SERIAL = "serial"
ELEMENTWISE = "elementwise"
REDUCTION = "reduction"
GROUP_REDUCTION = "group_reduction"
CONTRACTION = "contraction"

# How a dialect maps a parallel nest (Dialect.mapping)
LOOPS = "loops"  # for loops; OpenMP threads share the outer ones (C)
GLOBAL_IDS = "global_ids"  # a work-item per cell, a global id per dimension (OpenCL)
GRID_STRIDE = "grid_stride"  # the flat nest on a 1-D grid-stride loop (CUDA)

# The CPU's shapes (a dialect that writes them lists them in Dialect.shape_emitters)
REGISTER_TILES = "register_tiles"
COLUMN = "column"
STAGED = "staged"
STREAMING = "streaming"
TRANSPOSE = "transpose"


@attrs.frozen
class LaunchShape:
    """How a kernel is launched. ``global_size``/``local_size`` are in work items (OpenCL style);
    CUDA reads grid = global // local. The CPU ignores them (OpenMP decides)."""

    global_size: tuple[int, ...] = (1,)
    local_size: tuple[int, ...] | None = None
    shared_bytes: int = 0


@attrs.frozen
class Tiles:
    """A contraction's tiles: blocks of ``bm`` x ``bn`` outputs (a work-group's, or one CPU
    thread's registers), ``tm`` x ``tn`` of them per thread, ``bk``-deep slices of the
    operands staged in local memory (1: none), vectors of ``lanes`` elements."""

    bm: int
    bn: int
    bk: int
    tm: int
    tn: int
    lanes: int = 4

    @property
    def threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)


# GPU tiles: 128x128 blocks (8x8 outputs per thread) for big outputs, 64x64 (4x4) otherwise.
TILES_LARGE = Tiles(128, 128, 8, 8, 8)
TILES_SMALL = Tiles(64, 64, 16, 4, 4)
# The CPU's register tiles: 6 rows x 2 vectors of the output while k runs (12 accumulators
# and 2 vectors of y in 16 registers), 6 x 4 where the host has 32 (AVX-512, Arm): each
# broadcast of x then feeds 4 FMAs, not 2. On the 2-core AVX-512 VM of session 9 the MLP's
# 51M-multiply-add matmuls went 323 -> 358 GFLOP/s (x @ w) and 254 -> 304 (x.T @ dh), its step
# 990 -> 913 us, a 1024^3 matmul 327 -> 389; char_lm's step 70.2 -> 67.7 us.
REGISTER_ROWS = 6


def register_vectors(d: Dialect) -> int:
    """Vectors of the output a register tile holds per row, for this dialect's registers."""
    return 4 if d.vector_registers >= 32 else 2


def column_vectors(d: Dialect, n: int) -> int:
    """Vectors down each of the n columns a tile down the columns holds (as many
    accumulators as a tile along the rows, at most as many vectors per column)."""
    vecs = register_vectors(d)
    return max(1, min(vecs, REGISTER_ROWS * vecs // n))


def down_columns(c: Contraction, lanes: int) -> bool:
    """Whether the register tiles should run their vectors down the output's columns (along
    i), not along its rows (j): the output is narrower than a vector, x is contiguous along i,
    and k is deep enough to pay for writing the cells one by one. A weight gradient
    ``h.T @ dy`` of a 10-class head is such a product: along j each FMA fills 10 of 16 lanes;
    down i, all 16 (the MLP's, 655K multiply-adds: 19.4 -> 12.8 us). A shallow k has too few
    FMAs to pay for the cells: 2048x10 under a momentum update took 1.3-1.4x the time with k
    4-8 (a small batch's gradient), about the same with 16, 0.7-0.75x from 24 on."""
    return c.n < lanes <= c.m and c.kk >= DOWN_COLUMNS_MIN_K and c.x.index.coeff(c.i) == 1


DOWN_COLUMNS_MIN_K = 16


def column_tiles_pay(c: Contraction, lanes: int, down: int, shared: bool) -> bool:
    """Whether tiles down the columns (``down`` vectors each) issue fewer vector FMAs per k
    on the busiest thread than tiles along the rows (a row of one vector each, so about m):
    n per vector of each column, ``ceil(m / lanes)`` of them, against m rounded up to whole
    tiles; a product big enough to share (``shared``) counted on two threads where it has
    two tiles or more. Down the columns a column's last vector may hold one row (17 rows of
    16 lanes: twice the FMAs of 16), and one tile of it may be all there is to share (a
    64x5 gradient over a batch of 2048, 11.7 us on one thread, against 18.1 for the rows'
    tiles on two; 16x15: the rows' three tiles win on two threads)."""
    def per_thread(fmas: int, tiles: int) -> float:
        return fmas / min(tiles, 2) if shared else fmas

    b, m, n = c.batch_size, c.m, c.n
    columns = per_thread(b * n * -(-m // lanes), b * -(-m // (down * lanes)))
    rows = per_thread(b * REGISTER_ROWS * -(-m // REGISTER_ROWS), b * -(-m // REGISTER_ROWS))
    return columns < rows


def swapped(c: Contraction) -> Contraction:
    """``c`` with the roles of i and j (and of x and y) exchanged: the same sums, whose
    output the tiles then write cell by cell (``KernelPlan.transposed``)."""
    return attrs.evolve(c, x=c.y, y=c.x, i=c.j, m=c.n, j=c.i, n=c.m)


@attrs.frozen
class Contraction:
    """``out[.., i, j] (+)= sum_k x[.., i, k] * y[.., k, j]``: ``x`` reads i (not j), ``y``
    reads j (not i), both read k; batch symbols are the other parallel symbols. The loads
    keep their general affine indices (transposes, statics, the merge buffer)."""

    kernel: Kernel
    reduce: Reduce
    x: Load
    y: Load
    batch: tuple[tuple[Symbol, int], ...]
    i: Symbol
    m: int
    j: Symbol
    n: int
    k: Symbol
    kk: int
    # Elementwise stores run on each output cell once its sum is stored (they read it back at
    # its own index: core/fusion.py's fuse_epilogues); () for a plain contraction.
    epilogue: tuple[Stmt, ...] = ()

    @property
    def row_major(self) -> bool:
        """j is the innermost parallel loop and i the next, and the output and y are
        contiguous along j: the layout that tiles loading rows as vectors need."""
        (pi, _), (pj, _) = self.kernel.parallel[-2:]
        contiguous = self.reduce.index.coeff(self.j) == 1 and self.y.index.coeff(self.j) == 1
        return (pi, pj) == (self.i, self.j) and contiguous

    @property
    def batch_size(self) -> int:
        return math.prod(n for _, n in self.batch)


def match_contraction(k: Kernel) -> Contraction | None:
    """The kernel as a :class:`Contraction` (a float sum of products of two loads over one
    loop), if it is one: the one matcher every dialect's plan starts from. A ``Seq`` whose
    first statement is such a sum and the rest elementwise stores is one with an epilogue."""
    body = k.body
    stmts = body.body if isinstance(body, Seq) else (body,)
    r, epilogue = stmts[0], stmts[1:]
    if any(not isinstance(st, Store) for st in epilogue):
        return None
    if not isinstance(r, Reduce) or r.accum is not ir.AccumOp.ADD or len(r.loops) != 1:
        return None
    if len(k.parallel) < 2 or not r.node.dtype.is_float or not (r.init is None or isinstance(r.init, Const)):
        return None
    v = r.value
    if not (isinstance(v, Call) and v.op is ir.Op.MUL and len(v.args) == 2):
        return None
    a, b = v.args
    if not (isinstance(a, Load) and isinstance(b, Load)):
        return None
    roles = _roles(k, a, b)
    if roles is None:
        return None
    x, y, i, j = roles
    ks, kk = r.loops[0]
    if x.index.coeff(ks) == 0 or y.index.coeff(ks) == 0:
        return None
    extent = dict(k.parallel)
    batch = tuple((s, n) for s, n in k.parallel if s not in (i, j))
    return Contraction(k, r, x, y, batch, i, extent[i], j, extent[j], ks, kk, epilogue)


def _roles(k: Kernel, a: Load, b: Load) -> tuple[Load, Load, Symbol, Symbol] | None:
    """(x, y, i, j): x reads i and not j, y reads j and not i. First the innermost two
    parallel loops (the output's layout), else the one symbol only one load reads."""
    orders = ((a, b), (b, a))
    (i, _), (j, _) = k.parallel[-2:]
    for x, y in orders:
        if _only_one_reads(x, y, i) and _only_one_reads(y, x, j):
            return x, y, i, j
    syms = [s for s, _ in k.parallel]
    for x, y in orders:
        rows = [s for s in syms if _only_one_reads(x, y, s)]
        cols = [s for s in syms if _only_one_reads(y, x, s)]
        if len(rows) == 1 and len(cols) == 1:
            return x, y, rows[0], cols[0]
    return None


def _only_one_reads(reader: Load, other: Load, s: Symbol) -> bool:
    return reader.index.coeff(s) != 0 and other.index.coeff(s) == 0


# ---------------------------------------------------------------------------
# The plan


@attrs.frozen
class KernelPlan:
    """How one kernel runs (see the module docstring)."""

    kind: str  # SERIAL, ELEMENTWISE, REDUCTION, GROUP_REDUCTION or CONTRACTION
    launch: LaunchShape
    shape: str = ""  # a shape of the dialect's own (Dialect.shape_emitters); "": the kind's generic one
    team: int = 0  # LOOPS: the outer loops threads share (0: one thread)
    chunks: int = 1  # LOOPS: the iterations of those loops, flattened: the range a ranged
    # dialect's kernel takes (Dialect.ranged), which the runtime shares among its threads
    optional: bool = False  # LOOPS: the runtime shares that range only while sharing pays
    # (it times itself both ways), else one thread runs it: mid-sized matmuls
    # (Dialect.optional_matmul_min_work), and kernels shared for what they call (sharing_work)
    dims: tuple[tuple[tuple[Symbol, int], ...], ...] = ()  # GLOBAL_IDS: the parallel loops of each dim
    contraction: Contraction | None = None
    tiles: Tiles | None = None
    # LOOPS register tiles: ``contraction`` is the kernel's with i and j exchanged
    # (down_columns), so its vectors run down the output's columns, written cell by cell
    transposed: bool = False
    aligned: bool = False  # the sizes divide the tiles: no bounds checks
    x_vector: str | None = None  # "k" or "m": the side along which x loads vectors (None: scalars)
    y_vector: str | None = None  # "n" or "k"
    ordered_float: bool = False  # sums floats in loop order (the C dialect's GCC workaround)
    unroll: int = 1  # GRID_STRIDE: cells a thread takes per trip, a block apart

    @property
    def threads(self) -> int:
        """Work-items of a work-group (CUDA: threads of a block)."""
        return math.prod(self.launch.local_size or (1,))


def plan_kernel(kernel: Kernel, dialect: Dialect) -> KernelPlan:
    """The kernel's plan on ``dialect``'s target."""
    plan = _loops_plan(kernel, dialect) if dialect.mapping == LOOPS else _gpu_plan(kernel, dialect)
    if _has_float_serial_accumulation(kernel) and plan.shape not in (REGISTER_TILES, COLUMN, STAGED):
        plan = attrs.evolve(plan, ordered_float=True)  # tiles and column blocks vectorize across outputs
    return plan


def _kind(kernel: Kernel) -> str:
    if not kernel.parallel:
        return SERIAL
    return REDUCTION if isinstance(kernel.body, Reduce) else ELEMENTWISE


def _has_float_serial_accumulation(kernel: Kernel) -> bool:
    stmts = list(walk_stmts(kernel.body))
    if any(isinstance(s, Reduce) and s.node.dtype.is_float and not s.reassociable for s in stmts):
        return True
    serial = any(isinstance(s, Loop) for s in stmts)
    # A scatter's updates (a row picked by data) fold nothing into one accumulator: each
    # inner iteration updates its own cell, and vectorizing the row keeps each cell's order.
    return serial and any(isinstance(s, Store) and s.accum is not None and s.node.dtype.is_float
                          and s.row is None for s in stmts)


def _contraction(kernel: Kernel, d: Dialect) -> Contraction | None:
    """The kernel's contraction, when the dialect tiles it."""
    if not d.matmul:
        return None
    c = match_contraction(kernel)
    if c is None or (d.matmul_rows and not c.row_major) or not _tiles(c, d):
        return None
    return c


def _tiles(c: Contraction, d: Dialect) -> bool:
    """Whether the dialect tiles ``c``, its layout aside."""
    if c.epilogue and not d.matmul_epilogues:
        return False
    if c.reduce.node.dtype not in d.matmul_dtypes:
        return False
    if c.reduce.node.dtype.is_half:  # the tiles hold and load the stored type: no half conversions
        return False
    return min(c.m, c.n) >= max(1, d.matmul_min_side) and c.m * c.n * c.kk >= d.matmul_min_work  # no empty tiles


def transposable_contraction(kernel: Kernel, d: Dialect) -> Contraction | None:
    """A contraction the dialect would tile but for ``y``'s layout (``y`` not contiguous along
    the output's columns: ``a @ b.T`` as ``einsum("ik,jk->ij")``): the lowering copies ``y``
    to a scratch node laid out ``[.., k, j]`` first (lower.transpose_y). Without the copy each
    cell was an in-order dot product: 34-327x numpy's time."""
    if not (d.matmul and d.matmul_rows):
        return None
    c = match_contraction(kernel)
    if c is None or c.row_major or not _tiles(c, d):
        return None
    (pi, _), (pj, _) = kernel.parallel[-2:]
    if (pi, pj) != (c.i, c.j) or c.reduce.index.coeff(c.j) != 1:  # the output's layout is the tiles' too
        return None
    extent: dict[ir.Var, int] = dict((*kernel.parallel, *c.reduce.loops))
    if c.y.merge or c.y.row is not None or any(v not in extent for v in c.y.index.vars):  # statics
        return None
    if math.prod([extent[v] for v in c.y.index.vars]) > c.y.node.size:  # the copy would outgrow y
        return None  # (y[3 * j + k], a convolution's window: 8 MB laid out from 28 KB)
    return c


# ---------------------------------------------------------------------------
# LOOPS (C): OpenMP teams and the CPU's shapes

# Outputs of a column reduction accumulated together (a local array of this many).
COLUMN_BLOCK = 512
# Rows a column reduction takes in one pass over its outputs (the cpu's block of them, an
# OpenCL CPU device's work-group between two barriers): each output's accumulator is loaded
# and stored once for them, and the rows are read as that many streams.
COLUMN_ROWS = 4
# Values worth staging: what the vector unit computes much faster than a scalar loop.
STAGED_OPS = frozenset({ir.Op.EXP, ir.Op.TANH, ir.Op.SIGMOID, ir.Op.SQRT, ir.Op.DIV})
STAGED_MAX_LENGTH = 4096  # the local array: 16 KiB of float32
# ... and at most this many bytes of it: it is on the stack of whichever thread runs the grain,
# a helping host thread's too, whose stack may be small (Python's smallest, 32 KiB: a row of
# 4096 float64 values, 32 KiB, crashed it)
STAGED_MAX_BYTES = 16 << 10
# Streaming stores bypass the cache: only worth it for outputs far larger than it.
STREAMING_MIN_BYTES = 8 << 20
# A transpose's square blocks: eight 32-byte vectors of 4-byte values.
TRANSPOSE_BLOCK = 8


def _share_from(d: Dialect) -> int:
    """The multiply-adds from which the dialect's threads may share a matmul."""
    return d.shared_matmul_min_work if d.optional_matmul_min_work is None else d.optional_matmul_min_work


def _loops_plan(kernel: Kernel, d: Dialect) -> KernelPlan:
    launch = LaunchShape((max(1, kernel.work),))
    shapes = d.shape_emitters
    c = _contraction(kernel, d) if REGISTER_TILES in shapes else None
    if c is not None:
        lanes = d.vector_bytes // c.reduce.node.dtype.itemsize
        rows, vecs = REGISTER_ROWS, register_vectors(d)
        down = column_vectors(d, c.n)
        # a tile holds every column of the output and vectors down it, where that issues
        # fewer FMAs per thread (column_tiles_pay)
        transposed = down_columns(c, lanes) and \
            column_tiles_pay(c, lanes, down, kernel.total_work >= _share_from(d))
        if transposed:
            c, rows, vecs = swapped(c), c.n, down
        tiles = Tiles(rows, vecs * lanes, 1, rows, vecs * lanes, lanes)
        work, tiles_ij = kernel.total_work, -(-c.m // tiles.tm) * -(-c.n // tiles.tn)
        optional = d.optional_matmul_min_work is not None and c.batch_size * tiles_ij > 1 and \
            d.optional_matmul_min_work <= work < d.shared_matmul_min_work
        team = len(c.batch) + 2 if work >= d.shared_matmul_min_work or optional else 0
        return KernelPlan(CONTRACTION, launch, REGISTER_TILES, team, c.batch_size * tiles_ij if team else 1,
                          contraction=c, tiles=tiles, optional=optional, transposed=transposed)
    if COLUMN in shapes and column_reduction(kernel) is not None:
        blocks = -(-kernel.parallel[-1][1] // COLUMN_BLOCK)
        loops = [n for _, n in kernel.parallel[:-1]] + [blocks]
        big = kernel.total_work >= d.omp_min_work * 8 and math.prod(loops) > 1
        return KernelPlan(REDUCTION, launch, COLUMN, len(loops) if big else 0, math.prod(loops) if big else 1)
    shape = ""
    if STAGED in shapes and staged_reduction(kernel):
        shape = STAGED
    elif STREAMING in shapes and streams(kernel, d.vector_bytes):
        shape = STREAMING
    elif TRANSPOSE in shapes and d.vector_bytes >= 32 and block_transpose(kernel):
        block_loops = transpose_loops(kernel)  # threads share them as they share tiles
        big = kernel.total_work >= d.omp_min_work
        return KernelPlan(ELEMENTWISE, launch, TRANSPOSE, len(block_loops) if big else 0,
                          math.prod(block_loops) if big else 1)
    nest = kernel.parallel
    plain = kernel.total_work >= d.omp_min_work
    # what it calls makes it worth sharing: only while sharing pays, where the runtime times that
    costly = bool(nest) and not plain and d.optional_matmul_min_work is not None and \
        sharing_work(kernel) >= d.omp_min_work
    if nest and (plain or costly):
        # a short outer loop: share the next ones too
        team = len(nest) - 1 if len(nest) > 1 and nest[0][1] < 64 else 1
        return KernelPlan(_kind(kernel), launch, shape, team, math.prod(n for _, n in nest[:team]), optional=costly)
    # A full reduction is serial: a long one was split (lower.split_long_reduction), and one
    # shared by an OpenMP reduction clause summed in the order its threads finished (and its
    # team was the tuner's): other bits from run to run, and under load.
    return KernelPlan(_kind(kernel), launch, shape)


# A call of exp, log, tanh, sigmoid or pow costs several to tens of cycles an element, where a
# load or an add costs about one: a kernel whose statements make one per iteration may be
# worth sharing from fewer iterations than omp_min_work counts for plain ones. Such a kernel
# under omp_min_work is shared only while sharing pays (KernelPlan.optional: the runtime
# times the stream both ways). char_lm's softmax and cross-entropy (128x27 logits, two exps
# and a log a row), shared: its step 0.96-0.97x the time (11 of 12 and 13 of 16 rounds
# faster; the MLP's 0.98, session 25). Sharing its 8K-iteration gather and weight
# transposes instead (a plain threshold of 8192): 1.02x.
COSTLY_OPS = frozenset({ir.Op.EXP, ir.Op.LOG, ir.Op.TANH, ir.Op.SIGMOID, ir.Op.POW})
COSTLY_OP_WEIGHT = 16


def sharing_work(kernel: Kernel) -> int:
    """The kernel's iterations as its loops plan weighs them against ``omp_min_work``: each
    statement's counted ``COSTLY_OP_WEIGHT`` times where it calls one of ``COSTLY_OPS``; a
    batch's members each over their own segment (one small exp does not weigh its
    neighbours)."""
    body = kernel.body
    members = body.body if isinstance(body, Seq) else (body,)
    if members and all(isinstance(st, Segment) for st in members):
        return sum((st.hi - st.lo) * inner_work(st.body, _cost) for st in members if isinstance(st, Segment))
    return kernel.work * inner_work(body, _cost)


def _cost(s: Stmt) -> int:
    costly = any(isinstance(e, Call) and e.op in COSTLY_OPS for e in walk_exprs(s))
    return COSTLY_OP_WEIGHT if costly else 1


def column_reduction(kernel: Kernel) -> Reduce | None:
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


def staged_reduction(kernel: Kernel) -> bool:
    """A float reduction along one short loop whose value costs more than its loads
    (``sum_j exp(x[i, j] - m[i])``): staged as a vectorized map into a local array, then an
    in-order fold. The fold reads the staged values forwards, so GCC may vectorize it in
    order without the miscompile the C dialect's GCC workaround guards against. A row group
    (core/fusion.py) is staged when one of its reductions is worth it and all its float
    reductions can be (each is then staged: none is left to that miscompile)."""
    floats = [st for st in walk_stmts(kernel.body) if isinstance(st, Reduce) and st.node.dtype.is_float]
    if not isinstance(kernel.body, (Reduce, Seq)) or not floats or not all(stageable(r) for r in floats):
        return False
    return any(isinstance(e, Call) and e.op in STAGED_OPS for r in floats for e in walk_exprs(r))


def stageable(r: Reduce) -> bool:
    """The reduction's values fit the staged shape's local array."""
    n = r.loops[0][1] if len(r.loops) == 1 else 0
    return 8 <= n <= STAGED_MAX_LENGTH and n * r.node.dtype.compute.itemsize <= STAGED_MAX_BYTES


def elementwise_stores(kernel: Kernel) -> tuple[Store, ...] | None:
    """The kernel's statements when all are stores at cells of its own (no row picked by
    data): an elementwise kernel, or several that horizontal fusion merged. None otherwise."""
    stmts = kernel.body.body if isinstance(kernel.body, Seq) else (kernel.body,)
    stores = tuple(st for st in stmts if isinstance(st, Store) and st.row is None)
    return stores if len(stores) == len(stmts) else None


def segmentable(kernel: Kernel, d: Dialect) -> bool:
    """Whether ``kernel`` may join a batch on ``d`` (core/fusion.py, ``fuse_segments``): one
    parallel loop of at most ``d.batch_max_work`` iterations around stores (an elementwise
    kernel, or several that horizontal fusion merged), no merge buffer, no scatter, and no
    shape of its own on ``d``."""
    if not d.batch_segments or len(kernel.parallel) != 1 or kernel.merge_input is not None:
        return False
    if not 0 < kernel.work <= d.batch_max_work:
        return False
    if elementwise_stores(kernel) is None:
        return False
    plan = plan_kernel(kernel, d)
    return plan.shape == "" and plan.contraction is None


def row_fusable(kernel: Kernel, d: Dialect) -> bool:
    """Whether ``kernel`` may join a row group on ``d`` (core/fusion.py, ``fuse_rows``): a
    parallel nest whose rows (its iterations per outer iteration) are at most the dialect's
    ``row_group_max_row``, no merge buffer, no scatter, and no shape that needs the kernel
    alone (tiles, column blocks, streaming stores, block transposes, group reductions)."""
    if not kernel.parallel or kernel.work == 0 or kernel.merge_input is not None or d.row_group_max_row <= 0:
        return False
    if kernel.total_work // kernel.parallel[0][1] > d.row_group_max_row:
        return False
    if any(isinstance(st, Store) and st.row is not None for st in walk_stmts(kernel.body)):
        return False
    plan = plan_kernel(kernel, d)
    return plan.contraction is None and plan.shape in ("", STAGED) and plan.kind != GROUP_REDUCTION


def streams(kernel: Kernel, vector_bytes: int) -> bool:
    """A flat elementwise kernel over a large, aligned float output, reading contiguously:
    worth non-temporal stores where the host has 32-byte vectors or wider."""
    body = kernel.body
    if len(kernel.parallel) != 1 or not isinstance(body, Store) or body.accum is not None:
        return False
    if vector_bytes < 32 or not body.node.dtype.is_float or body.node.dtype.is_half:  # ps and pd only
        return False
    (sym, n), = kernel.parallel
    if body.index != ir.as_affine(sym) or n * body.node.dtype.itemsize < STREAMING_MIN_BYTES:
        return False
    loads = [e for e in walk_exprs(body) if isinstance(e, Load)]
    return all(ld.index.coeff(sym) in (0, 1) for ld in loads) and all(ld.node is not body.node for ld in loads)


def block_transpose(kernel: Kernel) -> bool:
    """``out[.., a, b] = x[.., b, a]`` of a 4-byte type: the innermost loop (b) contiguous in the
    output and the next (a) contiguous in what it copies. The plain loop reads one element
    per cache line (GCC gathers them: a 128x64 float32 transpose took 4.5 us on Zen 4);
    ``TRANSPOSE_BLOCK``-square blocks transposed in registers took 0.96."""
    body = kernel.body
    if len(kernel.parallel) < 2 or not isinstance(body, Store) or body.accum is not None or body.row is not None:
        return False
    src = body.value
    if not isinstance(src, Load) or src.merge or src.row is not None or src.node is body.node:
        return False
    if src.node.dtype is not body.node.dtype or body.node.dtype.itemsize != 4:
        return False
    (a, na), (b, nb) = kernel.parallel[-2:]
    return (min(na, nb) >= TRANSPOSE_BLOCK and body.index.coeff(b) == 1 and src.index.coeff(a) == 1
            and body.index.coeff(a) != 1 and src.index.coeff(b) not in (0, 1))


def transpose_loops(kernel: Kernel) -> list[int]:
    """A block transpose's loops: the outer axes, then its blocks along a and along b (the
    range threads share is their product, which the emitter decodes)."""
    nest = kernel.parallel
    return [n for _, n in nest[:-2]] + [-(-n // TRANSPOSE_BLOCK) for _, n in nest[-2:]]


def fusable(kernel: Kernel) -> bool:
    """A kernel that horizontal fusion (core/fusion.py) may merge with others of its iteration
    space: one ``Store`` in its parallel nest (an elementwise kernel: no reduction, no serial
    loop, no contraction), no merge buffer, and no shape of its own on any dialect (not a
    streaming-store candidate whatever the host's vectors)."""
    if not isinstance(kernel.body, Store) or kernel.merge_input is not None:
        return False
    return not streams(kernel, 1 << 10)


# ---------------------------------------------------------------------------
# GPU dialects: global ids or grid-stride loops, group reductions, shared-memory tiles

# A reduction at least this long, over at most this many cells, gets a group per cell...
GROUP_MIN_LENGTH = 512
GROUP_MAX_CELLS = 1 << 22
# ... unless the cells are contiguous in memory and many: one work-item per cell coalesces then.
WORK_ITEM_PER_CELL_MIN_CELLS = 4096
MAX_GROUPS = 1 << 16  # groups of a group-reduction launch; they stride over the cells beyond
MAX_GRID_BLOCKS = 1 << 16  # blocks of a grid-stride launch (the CUDA driver caps them further)
MAX_GRID_YZ = 65535  # CUDA's grid limit in y and z


def wants_group_reduce(kernel: Kernel) -> bool:
    """Few cells and long reductions: a group per cell."""
    r = kernel.body
    if not isinstance(r, Reduce) or not r.loops or r.length < GROUP_MIN_LENGTH or r.ordered:
        return False
    if not kernel.parallel:
        return True
    cells = kernel.work
    if cells > GROUP_MAX_CELLS:
        return False
    inner_cell, inner_red = kernel.parallel[-1][0], r.loops[-1][0]
    loads = [e for e in walk_exprs(r) if isinstance(e, Load)]
    cell_contiguous = any(ld.index.coeff(inner_cell) == 1 for ld in loads)
    red_contiguous = any(ld.index.coeff(inner_red) == 1 for ld in loads)
    return not (cell_contiguous and not red_contiguous and cells >= WORK_ITEM_PER_CELL_MIN_CELLS)


def group_count(kernel: Kernel) -> int:
    return max(1, min(kernel.work, MAX_GROUPS))  # work is 1 without a parallel nest


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _gpu_plan(kernel: Kernel, d: Dialect) -> KernelPlan:
    plan = _tiles_plan(kernel, d)
    if plan is not None:
        return plan
    if d.group_reductions and wants_group_reduce(kernel):
        assert isinstance(kernel.body, Reduce)
        long_and_few = kernel.work <= 64 and kernel.body.length >= 1 << 16
        threads = d.max_work_group if long_and_few else d.work_group
        return KernelPlan(GROUP_REDUCTION, LaunchShape((group_count(kernel) * threads,), (threads,)))
    if not kernel.parallel:
        return KernelPlan(SERIAL, LaunchShape((1,), (1,)))
    if d.mapping == GRID_STRIDE:
        work = kernel.work
        # a full work-group, or fewer threads (a multiple of 32) for a small nest
        threads = d.work_group if work >= d.work_group else max(32, _ceil_div(work, 32) * 32)
        kind = _kind(kernel)
        if kind == REDUCTION and d.reduction_min_blocks:  # a serial loop per cell: cells spread
            threads = min(threads, max(32, _ceil_div(_ceil_div(work, d.reduction_min_blocks), 32) * 32))
        unroll = d.grid_stride_unroll if kind == ELEMENTWISE and work >= d.grid_stride_unroll_min_work else 1
        blocks = max(1, min(_ceil_div(work, threads * unroll), MAX_GRID_BLOCKS))
        return KernelPlan(kind, LaunchShape((blocks * threads,), (threads,)), unroll=unroll)
    dims = global_dims(kernel)
    extents = [math.prod(n for _, n in loops) for loops in dims]
    local: list[int] = []
    room = d.work_group
    for e in extents:  # fill the work-group from dim 0 (contiguous in memory) outwards
        size = min(_pow2_at_least(e), room)
        local.append(size)
        room //= size
    glob = tuple(_ceil_div(e, lsz) * lsz for e, lsz in zip(extents, local))
    return KernelPlan(_kind(kernel), LaunchShape(glob, tuple(local)), dims=dims)


def global_dims(kernel: Kernel) -> tuple[tuple[tuple[Symbol, int], ...], ...]:
    """The parallel loops on each global dimension: dim 0 is the innermost loop; beyond three
    loops, the outer ones share dim 2 (flattened)."""
    nest = kernel.parallel
    if len(nest) <= 3:
        return tuple((lp,) for lp in reversed(nest))
    return ((nest[-1],), (nest[-2],), nest[:-2])


def _tiles_plan(kernel: Kernel, d: Dialect) -> KernelPlan | None:
    """Shared-memory tiles: a work-group per ``bm`` x ``bn`` block of the output (and batch
    index), ``tm`` x ``tn`` outputs per thread; vector loads where the sizes divide the tiles
    and an operand is contiguous with 4-aligned rows."""
    c = _contraction(kernel, d)
    if c is None or not d.matmul_tiles or 0 in (c.batch_size, c.m, c.n):  # empty: no "aligned" tiles
        return None
    t = next((t for t in d.matmul_tiles if c.m >= 2 * t.bm and c.n >= 2 * t.bn), d.matmul_tiles[-1])
    if _ceil_div(c.m, t.bm) > MAX_GRID_YZ or c.batch_size > MAX_GRID_YZ:
        return None
    aligned = c.m % t.bm == 0 and c.n % t.bn == 0 and c.kk % t.bk == 0
    x_vec = _vector_side(c.x.index, {"k": c.k, "m": c.i}) if aligned else None
    y_vec = _vector_side(c.y.index, {"n": c.j, "k": c.k}) if aligned else None
    launch = LaunchShape((_ceil_div(c.n, t.bn) * t.threads, _ceil_div(c.m, t.bm), c.batch_size), (t.threads, 1, 1))
    return KernelPlan(CONTRACTION, launch, contraction=c, tiles=t, aligned=aligned, x_vector=x_vec, y_vector=y_vec)


def _vector_side(index: Affine, sides: dict[str, Symbol]) -> str | None:
    """Which side (by name, in order of preference) is contiguous with 4-aligned rows:
    coefficient 1 there, and every other coefficient and the constant a multiple of 4."""
    for side, sym in sides.items():
        if index.coeff(sym) != 1:
            continue
        others = [c for v, c in index.terms if v != sym]
        if all(c > 0 and c % 4 == 0 for c in others) and index.const % 4 == 0:
            return side
    return None
