"""One C-family emitter for the loop IR; a ``Dialect`` only spells.

Each kernel's plan (core/patterns.py: its kind, shape, tiles and launch shape) is decided
once, carried on its ``KernelSpec``, and followed here: the :class:`Emitter` writes
expressions, stores, reductions and serial loops the same way for C, OpenCL C and CUDA C;
:func:`emit_loops` writes a parallel nest as for loops (OpenMP threads share the outer ones);
core/gpu.py writes the kernels the GPU dialects share. A ``Dialect`` supplies spellings
(type names, math functions, qualifiers, the kernel signature, pragmas, the GPU builtins)
and declares what its target is (how parallel loops map onto it, its work-group sizes, the
sizes worth tiling, the shapes only it writes). Its defaults spell C99 with OpenMP.

The half types (float16, bfloat16) are stored in 2 bytes and computed in float32: the
emitter writes every expression of a half dtype as a float32 one, loads through
``Dialect.half_load``, rounds the result of each op that can be inexact through
``Dialect.half_round`` and stores through ``Dialect.half_store`` (core/half.py holds the
conversions); accumulators are float32 and round once, when they store.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence

import attrs
import numpy as np

from polyjit.core import dtypes, gpu, half, ir, patterns
from polyjit.core.dtypes import DType
from polyjit.core.errors import UnsupportedError
from polyjit.core.gpu import GpuSpelling
from polyjit.core.ir import Affine, Symbol
from polyjit.core.loops import (
    Call,
    Const,
    Expr,
    IndexValue,
    Kernel,
    Load,
    Loop,
    LoweredBatch,
    Reduce,
    Row,
    Segment,
    Seq,
    Stmt,
    Store,
    walk_exprs,
    walk_stmts,
)
from polyjit.core.patterns import KernelPlan, LaunchShape, Tiles, plan_kernel
from polyjit.core.source_text import (
    COMMENT_MAX,
    IDENTIFIER_MAX,
    check_source,
    comment,
    comment_text,
    kernel_identifier,
    used_helpers,
)

__all__ = [
    "COMMENT_MAX", "IDENTIFIER_MAX", "Dialect", "Emitter", "KernelPlan", "KernelSpec", "LaunchShape",
    "Names", "Source", "comment", "comment_text", "emit_loops", "generate", "kernel_identifier",
    "kernel_spec", "used_helpers",
]

# ---------------------------------------------------------------------------
# What a compiled batch describes about each kernel


@attrs.frozen
class KernelSpec:
    """A kernel of a compiled module: its parameters in order, then the statics; its plan."""

    name: str
    buffers: tuple[ir.Node, ...]  # outputs first; the merge buffer (if any) is not among them
    merge: ir.Node | None  # passed after the buffers
    statics: tuple[ir.StaticSymbol, ...]
    launch: LaunchShape
    outputs: tuple[ir.Node, ...]
    inputs: tuple[ir.Node, ...]
    plan: KernelPlan = attrs.field(eq=False)


@attrs.frozen
class VectorMath:
    """A math function on a vector (Dialect.vector_math): the helper's name, the C type of the
    vector it takes and gives back, its lanes and the C type of one."""

    helper: str
    vector: str
    lanes: int
    scalar: str


# A shape only one dialect writes (Dialect.shape_emitters): the lines inside the signature.
ShapeEmitter = Callable[["Emitter", Kernel, KernelPlan, "Names"], list[str]]


def c_trampoline(text: str, spec: KernelSpec, ranged: bool = False) -> tuple[str, str]:
    """The C calling convention's binding of a user's kernel (:meth:`Dialect.raw_binding`:
    ``void k(void* const* bufs, const int64_t* statics)``, plus ``int64_t lo, int64_t hi``
    when ``ranged``, the CPU's, which it ignores: a user's kernel runs whole): a function
    that passes buffer k as the user's parameter k, then the statics, appended to the
    user's source. Pointers convert from ``void*`` as C does, so the user's function may
    take any pointer types."""
    entry = f"pj_raw_{spec.name}"
    args = [f"pj_bufs[{k}]" for k in range(len(spec.buffers))]
    args += [f"pj_statics[{k}]" for k in range(len(spec.statics))]
    lines = [text.rstrip("\n"), "",
             f"/* polyjit: the parameter binding of {spec.name} */",
             # The call must find the user's function and match its parameters' kinds.
             '#pragma GCC diagnostic error "-Wimplicit-function-declaration"',
             '#pragma GCC diagnostic error "-Wint-conversion"',
             # a static that is not a 64-bit integer (an int, a double) would lose its value
             # silently (found by review: 2**32 + 5 came in as 5, 3 as 1.5e-323 on OpenCL)
             '#pragma GCC diagnostic error "-Wconversion"',
             '#pragma GCC diagnostic ignored "-Wsign-conversion"',
             f"void {entry}(void* const* pj_bufs, const long long* pj_statics"
             f"{', long long pj_lo, long long pj_hi' if ranged else ''}) {{",
             "  (void)pj_bufs;",
             "  (void)pj_statics;",
             *(["  (void)pj_lo;", "  (void)pj_hi;"] if ranged else []),
             f"  {spec.name}({', '.join(args)});",
             "}", ""]
    return "\n".join(lines), entry


# ---------------------------------------------------------------------------
# Dialect: spellings, and what the target is


class Dialect:
    """A C-family language: spellings (the defaults are C99 with OpenMP) and the target's
    declarations that core/patterns.py plans kernels from. Subclasses override attributes
    and spelling methods; none decides how a kernel runs."""

    name = "c"
    function_qualifier = "static inline"
    restrict = "restrict"
    int64_suffix = "LL"  # int64_t literals
    index_value = "((int64_t)({}))"  # an index used as an int64 value
    reduction_ops = {ir.AccumOp.ADD: "+", ir.AccumOp.MUL: "*", ir.AccumOp.MAX: "max", ir.AccumOp.MIN: "min"}
    parallel_for_pragma: str | None = "#pragma omp parallel for{collapse} schedule(static)"
    # A ranged dialect's kernels take ``int64_t pj_lo, int64_t pj_hi`` after the statics and
    # compute those iterations of their shared loops (KernelPlan.team), flattened, instead
    # of opening an OpenMP team: the runtime shares the range (the CPU's, runtime.c).
    ranged = False
    # a reduction whose order is free (Reduce.reassociable): one accumulator per vector lane
    simd_reduction_pragma: str | None = "#pragma omp simd reduction({op}:pj_acc){collapse}"
    # The innermost loop of a parallel nest that only stores (its iterations are independent
    # by construction): GCC 12's cost model left a gather's row copy (16 floats a row, from a
    # row picked by data) as 16 scalar moves; told to vectorize, 4.5 -> 1.0 us for char_lm's
    # embedding (docs/benchmarks.md, session 11).
    simd_for_pragma: str | None = "#pragma omp simd"
    # Lines before a kernel that sums floats in loop order (KernelPlan.ordered_float). C: GCC
    # 12's loop vectorizer miscompiles in-order (fold-left) float reductions that read with a
    # negative stride (``sum_k x[n - k]`` gives wrong sums at -O3), and vectorizing them
    # gains nothing on the CPU anyway. Keyed to the compiler that reads the source (clang,
    # which also defines ``__GNUC__``, is left out), never to a dialect's name, and kept
    # for every GCC version: no later one is known here to be fixed, and it costs nothing.
    ordered_float_prefix: tuple[str, ...] = (
        "#if defined(__GNUC__) && !defined(__clang__)",
        '__attribute__((optimize("no-tree-loop-vectorize")))',
        "#endif",
    )

    # -- what the target is (core/patterns.py reads these) --------------------------------
    mapping = patterns.LOOPS  # how a parallel nest maps onto the target
    # the most work-items a raw kernel may ask for in one dimension (its statics are int64)
    max_work_items = 2**63 - 1
    # A kernel of less work than this (innermost iterations) runs on one thread: a team
    # costs microseconds.
    omp_min_work = 32768
    # A tiled contraction of fewer multiply-adds than this runs on one thread (its operands
    # would move between cores for little compute).
    shared_matmul_min_work = 32768
    # One of fewer, but at least this many (None: no such band), has a range that the
    # runtime shares only while sharing pays there (KernelPlan.optional).
    optional_matmul_min_work: int | None = None
    work_group = 256  # work-items of a generic work-group (GPU mappings)
    max_work_group = 256  # of a group reduction's few, very long cells
    # GRID_STRIDE: cells a thread takes per trip of an elementwise kernel of at least
    # grid_stride_unroll_min_work cells (independent loads in flight: a memory-bound kernel
    # needs several per thread to cover the latency of high-bandwidth memory)
    grid_stride_unroll = 1
    grid_stride_unroll_min_work = 1 << 20
    # Scatter-adds of at most this many rows x updates are computed by row, in parallel (each
    # cell scans every update's index; 0: never): core/lower.py scatter_by_owner
    scatter_scan = 0
    # GRID_STRIDE: a reduction with a thread per cell runs on at least this many blocks (of
    # 32 threads or more) when it has the cells: each thread's loop is long, and a few full
    # blocks would leave most of a GPU's multiprocessors idle (0: full blocks)
    reduction_min_blocks = 0
    group_reductions = False  # a work-group per cell for few, long reductions
    matmul = False  # contractions as tiles
    matmul_dtypes: tuple[DType, ...] = (dtypes.float32, dtypes.float64)
    matmul_rows = False  # the tiles load rows of y and the output as vectors (Contraction.row_major)
    # the tiles run an elementwise epilogue on each output tile (Contraction.epilogue): lowering
    # then merges a contraction with the elementwise kernel right after it that reads it
    matmul_epilogues = False
    # Kernels over rows of at most this many iterations each (per iteration of their outer
    # loop) join a row group with their neighbours (core/fusion.py, ``fuse_rows``): softmax's
    # four kernels become one. On a GPU a row group runs a row per thread, so rows stay short;
    # 0 turns row groups off.
    row_group_max_row = 64
    # Independent elementwise kernels of at most ``batch_max_work`` iterations run as segments
    # of one launch (core/fusion.py, ``fuse_segments``): an optimizer's updates of every small
    # parameter become one kernel. A larger kernel's launch costs little beside its work, and
    # on PoCL the segments' guards cost more than that (the MLP's 200K-cell update).
    batch_segments = True
    batch_max_work = 1 << 16
    matmul_min_side = 0  # tiles for contractions with both output sides at least this long...
    matmul_min_work = 0  # ... and at least this many multiply-adds
    matmul_tiles: tuple[Tiles, ...] = ()  # GPU tiles, biggest first
    vector_bytes = 0  # the host's vector registers (the CPU's shapes) ...
    vector_registers = 16  # ... and how many of them there are
    shape_emitters: Mapping[str, ShapeEmitter] = {}  # the shapes only this dialect writes
    gpu: GpuSpelling | None = None  # the GPU builtins (GPU mappings)
    # how the half types' conversions are spelled (C: through memcpy; _Float16 where the
    # compiler has it, which GCC 12+ and clang 15+ turn into F16C instructions on x86)
    half_spelling = half.HalfSpelling(
        qualifier="static inline", u32="uint32_t", u16="uint16_t", f2u="pj_f32_bits({})", u2f="pj_bits_f32({})",
        prelude=(
            ("pj_f32_bits", ["static inline uint32_t pj_f32_bits(float f) {",
                             "  uint32_t u; __builtin_memcpy(&u, &f, 4); return u;", "}"]),
            ("pj_bits_f32", ["static inline float pj_bits_f32(uint32_t u) {",
                             "  float f; __builtin_memcpy(&f, &u, 4); return f;", "}"]),
        ),
        native=tuple((name, ("defined(__FLT16_MAX__) && !defined(PJ_NO_FLOAT16)", lines)) for name, lines in (
            (half.load_name(dtypes.float16), ["  _Float16 v; __builtin_memcpy(&v, &h, 2); return (float)v;"]),
            (half.store_name(dtypes.float16),
             ["  const _Float16 v = (_Float16)f; uint16_t h; __builtin_memcpy(&h, &v, 2); return h;"]),
            (half.round_name(dtypes.float16), ["  return (float)(_Float16)f;"]),
        )),
    )

    def type_name(self, dt: DType) -> str:
        return dt.c

    # -- the half types: stored in 2 bytes, computed in float32 (core/half.py) ---------------

    def half_load(self, dt: DType, ref: str) -> str:
        """The float32 value of the stored element ``ref`` (an lvalue) of a half type."""
        return f"{half.load_name(dt)}({ref})"

    def half_store(self, dt: DType, ref: str, value: str) -> str:
        """The statement (without its ``;``) that stores the float32 ``value`` into ``ref``."""
        return f"{ref} = {half.store_name(dt)}({value})"

    def half_round(self, dt: DType, value: str) -> str:
        """The float32 ``value`` rounded to the half type (still a float32)."""
        return f"{half.round_name(dt)}({value})"

    def prelude(self, batch_dtypes: set[DType]) -> list[str]:
        """Lines at the top of every source: includes, typedefs (definitions that no compiler
        warns about when they go unused). Functions go in :meth:`helper_definitions`."""
        return ["#include <stdint.h>", "#include <math.h>", ""]

    def helper_definitions(self, batch_dtypes: set[DType]) -> list[tuple[str, list[str]]]:
        """The helpers kernels may call, as (name, lines of its definition), in an order where
        each comes after the helpers it uses. :func:`generate` emits only those the batch's
        kernels name (and the helpers those name), so that no compiler warns about an
        unused one. Here: the half types' conversions, and max/min and where of each dtype
        kernels compute in (as functions: arguments are evaluated once, and both of where's
        values always: GCC 12.2 at -O3 miscompiled ``c ? x[i] : 0`` in a nest whose inner loop
        runs 16 times, loading each vector of x under the previous vector's mask).

        A float max or min is NaN where either operand is (``a != a``), as numpy's ``maximum``
        and PyTorch's are: ``a > b ? a : b`` alone would drop a NaN ``a``, so relu and row
        maxima would hide a NaN that the reference shows. An OpenMP dialect declares each
        as a reduction too (:meth:`reduction_op`): OpenMP's own ``max`` combines its lanes'
        partial results with no NaN rule."""
        q = self.function_qualifier
        out = half.helpers(self.half_spelling, batch_dtypes)
        computed = {d.compute for d in batch_dtypes}  # kernels compute half values in float32
        openmp = self.simd_reduction_pragma is not None
        for dt in sorted(computed, key=lambda d: d.name):
            t = self.type_name(dt)
            for fn, cmp in (("max", ">"), ("min", "<")):
                name = f"pj_{fn}_{dt.name}"
                test = f"a {cmp} b || a != a" if dt.is_float else f"a {cmp} b"
                out.append((name, [f"{q} {t} {name}({t} a, {t} b) {{ return ({test}) ? a : b; }}"]))
                if openmp and dt.is_float:  # a max is idempotent: each lane may start from the original
                    out.append((f"{name}_omp", [f"#pragma omp declare reduction({name}_omp : {t} : "
                                                f"omp_out = {name}(omp_out, omp_in)) initializer(omp_priv = omp_orig)"]))
            name = f"pj_where_{dt.name}"
            out.append((name, [f"{q} {t} {name}(int c, {t} a, {t} b) {{ return c ? a : b; }}"]))
            if not dt.is_float:
                out.append(self._int_div(dt))
        return out

    def _int_div(self, dt: DType) -> tuple[str, list[str]]:
        """Integer division as the reference defines it: toward zero, 0 for a zero divisor,
        and the minimum over -1 wraps to itself. C's ``/`` traps on both (SIGFPE on x86)."""
        q, t, name = self.function_qualifier, self.type_name(dt), f"pj_div_{dt.name}"
        if not dt.is_signed:
            return name, [f"{q} {t} {name}({t} a, {t} b) {{ return b == 0 ? 0 : ({t})(a / b); }}"]
        u = self.unsigned_name(dt)
        return name, [f"{q} {t} {name}({t} a, {t} b) {{",
                      f"  return b == 0 ? 0 : b == -1 ? ({t})(({u})0 - ({u})a) : a / b;",
                      "}"]

    def unsigned_name(self, dt: DType) -> str:
        """The unsigned type of a signed integer type's width: signed arithmetic is spelled in
        it, since a signed overflow is undefined in C (and compilers use that), while the
        reference wraps, as numpy does."""
        return "u" + self.type_name(dt)

    def vector_math(self, fn: str, dt: DType) -> VectorMath | None:
        """The helper that computes ``fn`` of ``dt`` on a vector of lanes, where the target has
        one that a loop's lanes should share (:meth:`Emitter.lanes`); None here."""
        return None

    def bool_to_float(self, dt: DType, arg: str) -> str:
        """A bool (0 or 1) as 0.0 or 1.0 of the float type ``dt``."""
        return f"(({self.type_name(dt)})({arg}))"

    def math_call(self, fn: str, dt: DType, args: Sequence[str]) -> str:
        suffix = "f" if dt is dtypes.float32 else ""
        name = {"abs": "fabs"}.get(fn, fn)
        return f"{name}{suffix}({', '.join(args)})"

    def float_literal(self, value: float, dt: DType) -> str:
        if dt is dtypes.float32:
            with np.errstate(over="ignore"):
                value = float(np.float32(value))  # 1e40 is inf in float32: INFINITY, not "inff"
        if math.isnan(value):  # its sign kept (numpy's -nan stays negative through a copy)
            return self.special_float(dt, "-nan" if math.copysign(1.0, value) < 0 else "nan")
        if math.isinf(value):
            return self.special_float(dt, "inf" if value > 0 else "-inf")
        return f"{value!r}f" if dt is dtypes.float32 else repr(float(value))

    def special_float(self, dt: DType, which: str) -> str:
        """NaN ("nan", "-nan"), or an infinity ("inf", "-inf"), of a float type, as this language
        spells it."""
        return {"nan": "NAN", "-nan": "(-NAN)", "inf": "INFINITY", "-inf": "(-INFINITY)"}[which]

    def reduction_op(self, accum: ir.AccumOp, dt: DType) -> str:
        """The OpenMP reduction identifier of ``accum`` over values that compute in ``dt``: a
        float max or min is the one :meth:`helper_definitions` declares, which keeps NaN."""
        if accum in (ir.AccumOp.MAX, ir.AccumOp.MIN) and dt.is_float:
            return f"pj_{accum.value}_{dt.compute.name}_omp"
        return self.reduction_ops[accum]

    def pragma(self, template: str | None, collapse: int, accum: ir.AccumOp | None = None,
               dt: DType | None = None) -> str | None:
        """A pragma template with its collapse clause (and the reduction of ``accum`` over
        ``dt``) filled in."""
        if template is None:
            return None
        clause = f" collapse({collapse})" if collapse > 1 else ""
        op = self.reduction_op(accum, dt) if accum is not None and dt is not None else ""
        return template.format(collapse=clause, op=op)

    def kernel_open(self, spec: KernelSpec, names: Names) -> list[str]:
        """The signature and what precedes the body: C takes the buffers as an array of
        pointers and the statics as an array of int64."""
        lines = [f"void {spec.name}(void* const* {self.restrict} pj_bufs, "
                 f"const int64_t* {self.restrict} pj_statics"
                 f"{', int64_t pj_lo, int64_t pj_hi' if self.ranged else ''}) {{"]
        for k, node in enumerate(spec.buffers):
            t = self.type_name(node.dtype)
            const = "" if node in spec.outputs else "const "
            lines.append(f"  {const}{t}* {self.restrict} {names.buffer(node)} = ({const}{t}*)pj_bufs[{k}];")
        if spec.merge is not None:
            t = self.type_name(spec.merge.dtype)
            lines.append(f"  const {t}* {self.restrict} {names.merge} = (const {t}*)pj_bufs[{len(spec.buffers)}];")
        for k, s in enumerate(spec.statics):
            lines.append(f"  const int64_t {names.var(s)} = pj_statics[{k}];")
        return lines

    def raw_binding(self, text: str, spec: KernelSpec) -> tuple[str, str]:
        """A user's kernel ``spec.name`` in ``text`` (``Backend.raw_kernel``) bound to the
        calling convention :meth:`kernel_open` spells: the source to compile and its entry
        point. C's passes argument arrays, so a trampoline calls the user's function with
        them unpacked; a dialect whose kernels take their parameters as declared (OpenCL,
        CUDA) returns the text as it is. A dialect that overrides one overrides both: this
        default refuses a dialect whose kernel_open is its own."""
        if type(self).kernel_open is not Dialect.kernel_open:
            raise UnsupportedError(
                f"dialect {self.name!r} spells its own calling convention (kernel_open) but not how a "
                "user's kernel is bound to it: override Dialect.raw_binding to take users' kernels")
        return c_trampoline(text, spec, ranged=self.ranged)

    def emit_kernel(self, em: Emitter, kernel: Kernel, spec: KernelSpec, names: Names) -> list[str]:
        """The whole kernel, as its plan says (core's emitters; a dialect does not override
        this to decide anything)."""
        return [*self.kernel_open(spec, names), *emit_body(em, kernel, spec.plan, names), "}"]

    # -- conveniences over core/patterns.py ----------------------------------------------

    def plan(self, kernel: Kernel) -> KernelPlan:
        return plan_kernel(kernel, self)

    def launch_shape(self, kernel: Kernel) -> LaunchShape:
        return plan_kernel(kernel, self).launch


# ---------------------------------------------------------------------------
# Names


class Names:
    """C identifiers for the buffers, loop symbols and statics of one kernel."""

    merge = "pj_merge"

    def __init__(self, spec: KernelSpec) -> None:
        self._buffers = {node: f"b{k}" for k, node in enumerate(spec.buffers)}
        self._vars: dict[ir.Var, str] = {s: f"s{k}" for k, s in enumerate(spec.statics)}

    def buffer(self, node: ir.Node) -> str:
        return self._buffers[node]

    def var(self, v: ir.Var) -> str:
        if v not in self._vars:
            self._vars[v] = f"i{sum(1 for x in self._vars if isinstance(x, Symbol))}"
        return self._vars[v]


# ---------------------------------------------------------------------------
# The emitter


_INFIX = {ir.Op.ADD: "+", ir.Op.SUB: "-", ir.Op.MUL: "*", ir.Op.DIV: "/",
          ir.Op.LT: "<", ir.Op.LE: "<=", ir.Op.GT: ">", ir.Op.GE: ">=", ir.Op.EQ: "==", ir.Op.NE: "!="}
_WRAPPING = frozenset({ir.Op.ADD, ir.Op.SUB, ir.Op.MUL})
_MATH = {ir.Op.EXP: "exp", ir.Op.LOG: "log", ir.Op.SQRT: "sqrt", ir.Op.TANH: "tanh", ir.Op.POW: "pow"}
# Ops whose result on half values is a half value again: no rounding after them.
_EXACT_ON_HALF = frozenset({ir.Op.ID, ir.Op.NEG, ir.Op.ABS, ir.Op.RELU, ir.Op.MAX, ir.Op.MIN, ir.Op.WHERE})


def _used_declarations(decls: Sequence[str], lines: Sequence[str]) -> list[str]:
    """Of ``decls`` (``const int64_t a = ..., b = ...;``, each reading only those before it),
    those whose variables ``lines`` or a kept later declaration read."""
    kept: list[str] = []
    text = "\n".join(lines)
    for d in reversed(decls):
        names = re.findall(r"(?:int64_t|,)\s*(\w+)\s*=", d)
        if any(re.search(rf"\b{name}\b", text) for name in names):
            kept.append(d)
            text += "\n" + d.split("=", 1)[1]
    return kept[::-1]


def _rounds(e: Call) -> bool:
    """The call's float32 result must be rounded to its half type."""
    if not e.dtype.is_half or e.op in _EXACT_ON_HALF:
        return False
    return not (e.op is ir.Op.CAST and e.args[0].dtype is e.dtype)


class Emitter:
    """Writes the loop IR's expressions and statements in a dialect's spelling."""

    def __init__(self, dialect: Dialect, names: Names) -> None:
        self.d = dialect
        self.names = names
        self.hoisted: dict[tuple[ir.Node, int], str] = {}  # constant-index loads read once (emit_loops)
        # A kernel's private nodes (Kernel.private) where a shape holds them, read there: the
        # value of the one cell every load of them reads (the cell the statement works on)
        self.held: dict[ir.Node, str] = {}
        # While :meth:`lanes` renders a loop's bodies: the calls it computes a vector at a time
        # (helper, argument, lanes), each read back as its lane of a local array
        self.staged: list[tuple[VectorMath, str]] | None = None

    # -- expressions ---------------------------------------------------------

    def index(self, a: Affine) -> str:
        parts = [(self.names.var(v) if c == 1 else f"{c}*{self.names.var(v)}") for v, c in a.terms]
        if a.const or not parts:
            parts.append(str(a.const))
        return " + ".join(parts).replace("+ -", "- ")

    def element(self, base: str, index: Affine, r: Row | None) -> str:
        """An element of a buffer; with a row picked by data, of that row, whose value is
        clamped into the rows (no read or write leaves the buffer, whatever the data). The
        row's start is a pointer of its own: GCC then copies a row as whole vectors."""
        if r is None:
            return f"{base}[{self.index(index)}]"
        # int64 before the row's offset is made (GPU dialects index in 32 bits: a table of more
        # than 2**31 elements overflowed); a clamp the index type cannot need is left out (the
        # compilers warn of a pointless comparison of an unsigned index with 0, or with a row
        # beyond its range)
        dt, top = r.value.dtype, r.rows - 1
        v = f"(({self.d.type_name(dtypes.int64)})({self.expr(r.value)}))"
        if dt.is_signed:
            row = f"({v} < 0 ? 0 : {v} > {top} ? {top} : {v})"
        elif top < int(np.iinfo(dt.np).max):
            row = f"({v} > {top} ? {top} : {v})"
        else:
            row = v
        return f"({base} + {row} * {r.size})[{self.index(index)}]"

    def ctype(self, dt: DType) -> str:
        """The type kernels compute values of ``dt`` in (float for the half types)."""
        return self.d.type_name(dt.compute)

    def load(self, node: ir.Node, ref: str) -> str:
        """The value of ``ref``, a stored element of ``node``, as kernels compute with it."""
        return self.d.half_load(node.dtype, ref) if node.dtype.is_half else ref

    def store(self, node: ir.Node, ref: str, value: str) -> str:
        """The statement (without its ``;``) that stores ``value`` into ``ref``, an element of ``node``."""
        return self.d.half_store(node.dtype, ref, value) if node.dtype.is_half else f"{ref} = {value}"

    def literal(self, value: float | int | bool, dt: DType) -> str:
        if dt.is_half:  # the value the half type holds, as a float32 literal
            return self.d.float_literal(dtypes.round_scalar(float(value), dt), dtypes.float32)
        if dt.is_float:
            return self.d.float_literal(float(value), dt)
        if dt.is_bool:
            return "1" if value else "0"
        v = dtypes.wrap_int(int(value), dt)  # as C converts it: no literal out of the type's range
        if dt is dtypes.int64:
            suffix = self.d.int64_suffix
            if v == -(1 << 63):  # the literal 9223372036854775808 does not fit a signed type
                return f"(({self.d.type_name(dt)})(-9223372036854775807{suffix} - 1))"
            return f"(({self.d.type_name(dt)}){v}{suffix})"
        return f"(({self.d.type_name(dt)}){v})"

    def expr(self, e: Expr) -> str:
        if isinstance(e, Load):
            if not e.index.terms and e.row is None and (e.node, e.index.const) in self.hoisted and not e.merge:
                return self.hoisted[(e.node, e.index.const)]
            if e.node in self.held and not e.merge:
                return self.held[e.node]
            base = self.names.merge if e.merge else self.names.buffer(e.node)
            return self.load(e.node, self.element(base, e.index, e.row))
        if isinstance(e, Const):
            return self.literal(e.value, e.dtype)
        if isinstance(e, IndexValue):
            return self.d.index_value.format(self.index(e.index))
        return self.call(e)

    def call(self, e: Call) -> str:
        value = self._call(e)
        return self.d.half_round(e.dtype, value) if _rounds(e) else value

    def stored_value(self, e: Expr) -> str:
        """``e`` as the value of a store into its own dtype: a half type's store rounds, so
        the rounding of ``e``'s own op is left to it (to nearest even either way)."""
        return self._call(e) if isinstance(e, Call) and _rounds(e) else self.expr(e)

    def _call(self, e: Call) -> str:
        """The op in the dtypes kernels compute in (a half type's value in float32, not rounded)."""
        op, dt = e.op, e.dtype.compute
        args = [self.expr(a) for a in e.args]
        t = self.d.type_name(dt)
        arg_dt = e.args[0].dtype.compute if e.args else dt
        if op is ir.Op.DIV and not dt.is_float:
            return f"pj_div_{dt.name}({args[0]}, {args[1]})"
        wraps = dt.is_signed and not dt.is_float  # int32, int64: computed unsigned (see unsigned_name)
        if op in _INFIX:
            if wraps and op in _WRAPPING:
                return self.arith(dt, args[0], _INFIX[op], args[1])
            s = f"({args[0]} {_INFIX[op]} {args[1]})"
            # C computes narrow integers in int: wrap like numpy does.
            return f"(({t})({s}))" if dt in (dtypes.uint8,) else s
        if op is ir.Op.NEG:
            if wraps:
                return f"(({t})(-({self.d.unsigned_name(dt)})({args[0]})))"
            return f"(({t})(-({args[0]})))"  # a negative literal: -(-0.5f), not --0.5f
        if op is ir.Op.ABS:
            if dt.is_float:
                return self.d.math_call("abs", dt, args)
            if not dt.is_signed:  # uint8, bool: abs is the value itself
                return f"(({t})({args[0]}))"
            u = self.d.unsigned_name(dt)  # abs of the minimum is the minimum, as numpy's
            return f"(({t})(({args[0]}) < 0 ? -({u})({args[0]}) : ({u})({args[0]})))"
        if op in _MATH:
            return self.math(e, _MATH[op], dt, args)
        if op is ir.Op.SIGMOID:
            one = self.literal(1, dt)
            return f"({one} / ({one} + {self.math(e, 'exp', dt, [f'-({args[0]})'])}))"
        if op is ir.Op.RELU:
            zero = self.literal(0, dt)
            return f"pj_max_{arg_dt.name}({args[0]}, {zero})"
        if op in (ir.Op.MAX, ir.Op.MIN):
            return f"pj_{op.value}_{dt.name}({args[0]}, {args[1]})"
        if op is ir.Op.CAST:
            if dt.is_bool:
                return f"(({t})(({args[0]}) != 0))"
            if e.dtype.is_half and e.args[0].dtype is dtypes.float64:  # round once, not twice
                return f"{half.F64_TO_F32_ODD}({args[0]})"
            if e.args[0].dtype.is_bool and dt.is_float:
                return self.d.bool_to_float(dt, args[0])
            if e.args[0].dtype.is_float and dt is dtypes.uint8:
                # through int64: a float out of uint8's range wraps as the reference's does
                # (C leaves it undefined; PoCL saturated where GCC wrapped)
                return f"(({t})({self.d.type_name(dtypes.int64)})({args[0]}))"
            return f"(({t})({args[0]}))"
        if op is ir.Op.WHERE:
            return f"pj_where_{dt.name}({args[0]}, {args[1]}, {args[2]})"
        if op is ir.Op.ID:
            return args[0]
        raise AssertionError(f"unhandled op {op}")

    def math(self, e: Call, fn: str, dt: DType, args: Sequence[str]) -> str:
        """``fn(args)``; in :meth:`lanes`, where the dialect has it on vectors, the lane of the
        local array it was computed into."""
        staged = self.staged
        vm = None if staged is None or len(args) != 1 else self.d.vector_math(fn, dt)
        if staged is None or vm is None:
            return self.d.math_call(fn, dt, args)
        staged.append((vm, args[0]))
        return f"pj_lv{len(staged) - 1}[pj_l]"

    # -- statements ----------------------------------------------------------

    def combine(self, accum: ir.AccumOp, dt: DType, old: str, new: str) -> str:
        """``accum(old, new)`` in the dtype kernels compute ``dt`` in (not rounded to a half type:
        a store rounds). A signed integer sum or product wraps, as in :meth:`_call` (LLVM took a
        sum of non-negative int32 values for non-negative however it overflowed)."""
        if accum in (ir.AccumOp.ADD, ir.AccumOp.MUL):
            return self.arith(dt.compute, old, "+" if accum is ir.AccumOp.ADD else "*", new)
        return f"pj_{accum.value}_{dt.compute.name}({old}, {new})"

    def arith(self, dt: DType, left: str, sign: str, right: str) -> str:
        """``left sign right`` in ``dt``; a signed integer one wraps, spelled in the unsigned
        type of its width (:meth:`Dialect.unsigned_name`)."""
        if dt.is_signed and not dt.is_float:
            t, u = self.d.type_name(dt), self.d.unsigned_name(dt)
            return f"(({t})(({u})({left}) {sign} ({u})({right})))"
        return f"{left} {sign} {right}"

    def stmt(self, s: Stmt, indent: int) -> list[str]:
        pad = "  " * indent
        if isinstance(s, Store):
            target = self.element(self.names.buffer(s.node), s.index, s.row)
            if s.accum is None:
                value = self.stored_value(s.value) if s.value.dtype is s.node.dtype else self.expr(s.value)
            else:
                value = self.combine(s.accum, s.node.dtype, self.load(s.node, target), self.expr(s.value))
            return [f"{pad}{self.store(s.node, target, value)};"]
        if isinstance(s, Loop):
            v, body = self.names.var(s.sym), s.body
            if independent_iterations(s):
                return self.lanes(v, "0", str(s.extent), self.bodies(body), indent, pragma=self.d.simd_for_pragma,
                                  repeatable=repeatable(body))
            return [f"{pad}for (int64_t {v} = 0; {v} < {s.extent}; ++{v}) {{", *self.stmt(body, indent + 1), f"{pad}}}"]
        if isinstance(s, Seq):  # a fused kernel's statements, in order, in each iteration
            return [line for st in s.body for line in self.stmt(st, indent)]
        if isinstance(s, Segment):  # one member of a batch, on its iterations only
            v = self.names.var(s.sym)
            return [f"{pad}if ({v} >= {s.lo} && {v} < {s.hi}) {{", *self.stmt(s.body, indent + 1), f"{pad}}}"]
        return self.reduce(s, indent)

    def bodies(self, s: Stmt) -> list[Callable[[int], list[str]]]:
        """The renderers of ``s``'s statements in order (a Seq's one by one), for :meth:`lanes`."""
        if isinstance(s, Seq):
            return [r for st in s.body for r in self.bodies(st)]
        return [functools.partial(self.stmt, s)]

    def lanes(self, var: str, lo: str, hi: str, bodies: Sequence[Callable[[int], list[str]]], indent: int,
              head: Sequence[str] = (), pragma: str | None = None, repeatable: bool = False) -> list[str]:
        """``for (var = lo; var < hi; ++var) { head; bodies }``, a loop whose iterations touch
        disjoint cells: each body's lines come from its renderer, given their indent. Where
        the dialect computes exp or tanh on vectors (:meth:`Dialect.vector_math`; GCC
        vectorizes a loop that calls the scalar ones only where it has masked vector ops,
        AVX-512, not on AVX2), the loop runs in chunks of a vector's lanes: each body's calls
        first, an argument a lane into a local array, the function on the array as one
        vector, then the body, reading its lanes. Each body's lanes run before the next
        body's, which the disjoint cells allow. A tail shorter than a vector goes through the
        local arrays a lane at a time, and the vector read of lanes just stored one by one
        waits for the stores to retire (a failed store-to-load forward); where the bodies are
        ``repeatable`` (:func:`repeatable`) and the count is known and over a vector, the tail
        is instead the last whole vector, some iterations again (char_lm's softmax and
        cross-entropy kernel, 27-wide rows: 11 against 15 us, the same bits)."""
        pad = "  " * indent
        outer, self.staged = self.staged, None if self.staged is not None else []  # a loop in a chunk: plain
        try:
            phases: list[tuple[int, list[str]]] = []  # (calls staged before, lines) of each body
            for body in bodies:
                phases.append((len(self.staged or ()), body(indent + 3)))
            staged = self.staged or []
        finally:
            self.staged = outer
        loop = [f"{pad}{pragma}"] if pragma else []
        loop.append(f"{pad}for (int64_t {var} = {lo}; {var} < {hi}; ++{var}) {{")
        if not staged:  # the lines one level in, not three
            lines = [ln[4:] if ln.startswith("    ") else ln for _, body_lines in phases for ln in body_lines]
            return [*loop, *(f"{pad}  {h}" for h in head), *lines, f"{pad}}}"]
        lanes = staged[0][0].lanes
        assert all(vm.lanes == lanes for vm, _ in staged)
        arrays = " ".join(f"{vm.scalar} pj_lv{k}[{lanes}] = {{0}};" for k, (vm, _) in enumerate(staged))

        def lane_loop(n: str, lines: list[str]) -> list[str]:
            # the loop's variable and head, those the pass reads (no unused variables)
            decls = _used_declarations([f"const int64_t {var} = pj_lc + pj_l;", *head], lines)
            return [*([f"{pad}    {pragma}"] if pragma else []), f"{pad}    for (int pj_l = 0; pj_l < {n}; ++pj_l) {{",
                    *(f"{pad}      {h}" for h in decls), *lines, f"{pad}    }}"]

        def chunk(n: str) -> list[str]:
            out = [f"{pad}    {arrays}"]
            for i, (first, lines) in enumerate(phases):
                last = phases[i + 1][0] if i + 1 < len(phases) else len(staged)
                for k in range(first, last):
                    vm, arg = staged[k]
                    out += lane_loop(n, [f"{pad}      pj_lv{k}[pj_l] = {arg};"])
                    out.append(f"{pad}    {{ {vm.vector} pj_vx; __builtin_memcpy(&pj_vx, pj_lv{k}, sizeof pj_vx); "
                               f"pj_vx = {vm.helper}(pj_vx); __builtin_memcpy(pj_lv{k}, &pj_vx, sizeof pj_vx); }}")
                out += lane_loop(n, lines)
            return out

        count = int(hi) - int(lo) if lo.isdigit() and hi.isdigit() else None  # known here, or only when it runs
        lines = [f"{pad}{{", f"{pad}  int64_t pj_lc = {lo};"]
        if count is None or count >= lanes:
            lines += [f"{pad}  for (; pj_lc + {lanes} <= {hi}; pj_lc += {lanes}) {{", *chunk(str(lanes)), f"{pad}  }}"]
        if repeatable and count is not None and count > lanes and count % lanes:
            lines += [f"{pad}  {{", f"{pad}    pj_lc = {int(hi) - lanes};", *chunk(str(lanes)), f"{pad}  }}"]
        elif count is None or count % lanes:
            lines += [f"{pad}  if (pj_lc < {hi}) {{", f"{pad}    const int pj_ln = (int)({hi} - pj_lc);",
                      *chunk("pj_ln"), f"{pad}  }}"]
        return [*lines, f"{pad}}}"]

    def reduce_cell(self, r: Reduce) -> tuple[str, str]:
        """A reduction's output cell (an lvalue: store into it with :meth:`store`) and the
        value it starts from (what the cell holds when the reduction accumulates onto the
        context)."""
        target = f"{self.names.buffer(r.node)}[{self.index(r.index)}]"
        return target, self.load(r.node, target) if r.init is None else self.expr(r.init)

    def folded_rows(self, r: Reduce, acc: str, base: str, count: int, index_type: str = "int64_t") -> list[str]:
        """Rows ``base .. base + count - 1`` of the reduction's innermost loop folded into
        ``acc`` in order, each under its own binding of the loop variable (a column
        reduction's pass over several rows: patterns.COLUMN_ROWS)."""
        v, value = self.names.var(r.loops[-1][0]), self.expr(r.value)
        return [f"{{ const {index_type} {v} = {base} + {k}; {acc} = {self.combine(r.accum, r.node.dtype, acc, value)}; }}"
                for k in range(count)]

    def reduce(self, r: Reduce, indent: int, pragma: str | None = None) -> list[str]:
        if pragma is None and r.reassociable and r.node.dtype.is_float:
            pragma = self.d.pragma(self.d.simd_reduction_pragma, len(r.loops), r.accum, r.node.dtype)
        pad = "  " * indent
        t = self.ctype(r.node.dtype)  # half types accumulate in float32
        target, init = self.reduce_cell(r)
        lines = [f"{pad}{{", f"{pad}  {t} pj_acc = {init};"]
        depth = indent + 1
        for k, (sym, n) in enumerate(r.loops):
            v = self.names.var(sym)
            if k == 0 and pragma:
                lines.append(f"{'  ' * depth}{pragma}")
            lines.append(f"{'  ' * depth}for (int64_t {v} = 0; {v} < {n}; ++{v}) {{")
            depth += 1
        value = self.combine(r.accum, r.node.dtype, "pj_acc", self.expr(r.value))
        lines.append(f"{'  ' * depth}pj_acc = {value};")
        for d in range(depth - 1, indent, -1):
            lines.append(f"{'  ' * d}}}")
        lines += [f"{pad}  {self.store(r.node, target, 'pj_acc')};", f"{pad}}}"]
        return lines


# ---------------------------------------------------------------------------
# Kernel bodies


def emit_body(em: Emitter, kernel: Kernel, plan: KernelPlan, names: Names) -> list[str]:
    """The lines inside a kernel's signature, as its plan says."""
    special = em.d.shape_emitters.get(plan.shape) if plan.shape else None
    if special is not None:  # a shape only this dialect writes (the CPU's)
        return special(em, kernel, plan, names)
    if em.d.mapping == patterns.LOOPS:
        return emit_loops(em, kernel, plan, 1)
    assert em.d.gpu is not None, f"the {em.d.name} dialect maps onto {em.d.mapping} but spells no GPU builtins"
    return gpu.emit_body(em, kernel, plan, names, em.d.gpu)


def range_loop(loops: Sequence[tuple[str, int]]) -> tuple[str, list[str]]:
    """A ranged kernel's shared loops (variable, extent; outermost first) as one loop over its
    range ``[pj_lo, pj_hi)`` of their iterations, flattened: the loop's variable, and the
    lines that decode each of theirs from it."""
    if len(loops) == 1:
        return loops[0][0], []
    decoded, stride = [], 1
    for k in range(len(loops) - 1, -1, -1):
        v, n = loops[k]
        flat = "pj_it" if stride == 1 else f"pj_it / {stride}"
        decoded.append(f"{v} = {flat}" if k == 0 else f"{v} = {flat} % {n}")
        stride *= n
    return "pj_it", [f"const int64_t {', '.join(reversed(decoded))};"]


def range_loops(loops: Sequence[tuple[str, int]], indent: int) -> tuple[list[str], int]:
    """:func:`range_loop` opened: its lines, and the indent depth inside."""
    p = "  " * indent
    v, head = range_loop(loops)
    return [f"{p}for (int64_t {v} = pj_lo; {v} < pj_hi; ++{v}) {{", *(f"{p}  {h}" for h in head)], indent + 1


def emit_loops(em: Emitter, kernel: Kernel, plan: KernelPlan, indent: int) -> list[str]:
    """The parallel nest as for loops; threads share the plan's ``team`` of outer loops (a
    ranged dialect's range of them, else an OpenMP team), or, without a nest, the loops of
    the reduction (OpenMP)."""
    d, nest = em.d, kernel.parallel
    lines: list[str] = []
    if isinstance(kernel.body, Seq) and nest:
        lines += hoist_invariant_loads(em, kernel, indent)
    shape = (_row_blocks if row_group(kernel) and len(nest) == 1 else
             _segment_loops if segments(kernel) and (d.ranged or not plan.team) else None)
    if shape is not None:  # a row group or a batch: loops of their own
        lines += shape(em, kernel, plan, indent)
        em.hoisted.clear()
        return lines
    loops: list[tuple[str, str, str, list[str]]] = []  # variable, start, stop, head: outermost first
    if plan.team and nest and d.ranged:
        v, head = range_loop([(em.names.var(s), n) for s, n in nest[:plan.team]])
        loops.append((v, "pj_lo", "pj_hi", head))
        nest = nest[plan.team:]
    elif plan.team and nest:
        pragma = d.pragma(d.parallel_for_pragma, plan.team)
        lines += [f"{'  ' * indent}{pragma}"] if pragma else []
    loops += [(em.names.var(s), "0", str(n), []) for s, n in nest]
    # not on a loop an OpenMP ``parallel for`` already heads (a dialect that is not ranged)
    covered = bool(plan.team) and not d.ranged and plan.team >= len(nest)
    independent = bool(loops) and not covered and only_stores(kernel.body)
    depth = indent
    for v, start, stop, head in loops[:-1] if independent else loops:
        lines += [f"{'  ' * depth}for (int64_t {v} = {start}; {v} < {stop}; ++{v}) {{", *(f"{'  ' * depth}  {h}" for h in head)]
        depth += 1
    if independent:  # the innermost loop's iterations write their own cells
        v, start, stop, head = loops[-1]
        simd = d.simd_for_pragma if nest else None  # a nest's loop, not the range's flattened one
        lines += em.lanes(v, start, stop, em.bodies(kernel.body), depth, head, simd, repeatable(kernel.body))
    else:
        lines += em.stmt(kernel.body, depth)
    em.hoisted.clear()
    for dd in range(depth - 1, indent - 1, -1):
        lines.append(f"{'  ' * dd}}}")
    return lines


# Rows of a row group each statement runs before the next statement starts (on loops): the
# rows' reductions then overlap, where one row at a time would wait on each fold's latency.
ROW_BLOCK = 8


def row_group(kernel: Kernel) -> bool:
    """A row group (core/fusion.py, ``fuse_rows``): a Seq that holds reductions or loops."""
    return isinstance(kernel.body, Seq) and any(isinstance(st, (Reduce, Loop)) for st in kernel.body.body)


def segments(kernel: Kernel) -> bool:
    """A batch of independent kernels (core/fusion.py, ``fuse_segments``): a Seq of Segments."""
    return isinstance(kernel.body, Seq) and all(isinstance(st, Segment) for st in kernel.body.body)


def _segment_loops(em: Emitter, kernel: Kernel, plan: KernelPlan, indent: int) -> list[str]:
    """A batch on loops: each member's own loop over its segment (clipped to this call's
    range when threads share it), so that each vectorizes like the kernel it was."""
    assert isinstance(kernel.body, Seq)
    ((sym, n),) = kernel.parallel
    v, p = em.names.var(sym), "  " * indent
    lo, hi = ("pj_lo", "pj_hi") if plan.team else ("0", str(n))
    lines = []
    for seg in kernel.body.body:
        assert isinstance(seg, Segment)
        start = f"({seg.lo} > {lo} ? {seg.lo} : {lo})" if plan.team else str(seg.lo)
        stop = f"({seg.hi} < {hi} ? {seg.hi} : {hi})" if plan.team else str(seg.hi)
        body = seg.body
        if only_stores(body):
            lines += em.lanes(v, start, stop, em.bodies(body), indent, repeatable=repeatable(body))
        else:
            lines += [f"{p}for (int64_t {v} = {start}; {v} < {stop}; ++{v}) {{", *em.stmt(body, indent + 1), f"{p}}}"]
    return lines


def _row_blocks(em: Emitter, kernel: Kernel, plan: KernelPlan, indent: int) -> list[str]:
    """A row group's loop in blocks of ROW_BLOCK rows, each statement over the block's rows in
    turn (as valid as one row at a time: a statement reads only its own row of what the
    earlier ones wrote); threads share the blocks (the range's rows, or an OpenMP team)."""
    assert isinstance(kernel.body, Seq)
    ((sym, n),) = kernel.parallel
    d, v, p = em.d, em.names.var(sym), "  " * indent
    ranged = bool(plan.team and d.ranged)
    lo, hi = ("pj_lo", "pj_hi") if ranged else ("0", str(n))
    pragma = d.pragma(d.parallel_for_pragma, 1) if plan.team and not ranged else None
    lines = [f"{p}{pragma}"] if pragma else []
    lines += [f"{p}for (int64_t pj_rb = {lo}; pj_rb < {hi}; pj_rb += {ROW_BLOCK}) {{",
             f"{p}  const int64_t pj_re = pj_rb + {ROW_BLOCK} < {hi} ? pj_rb + {ROW_BLOCK} : {hi};"]
    for st in kernel.body.body:
        lines += [f"{p}  for (int64_t {v} = pj_rb; {v} < pj_re; ++{v}) {{", *em.stmt(st, indent + 2), f"{p}  }}"]
    return [*lines, f"{p}}}"]


def only_stores(body: Stmt) -> bool:
    """Whether a nest's body is stores at affine places only: no reduction (a vectorized
    outer loop would reorder nothing, but GCC 12 miscompiles some in-order float folds) and
    no row picked by data (two iterations might write one place)."""
    return all(isinstance(st, Store) and st.row is None for st in walk_stmts(body) if not isinstance(st, Seq))


def repeatable(body: Stmt) -> bool:
    """Whether running some iterations of a loop over ``body`` twice leaves what running each
    once does (``Emitter.lanes`` recomputes the last whole vector over a tail): every statement
    is a plain store at an affine place (no accumulation, no row picked by data), and none
    reads a node one of them stores (``x = exp(x)`` would take exp twice)."""
    if not only_stores(body):
        return False
    stores = [st for st in walk_stmts(body) if isinstance(st, Store)]
    stored = {st.node for st in stores}
    return all(st.accum is None for st in stores) and not any(
        isinstance(e, Load) and e.node in stored for e in walk_exprs(body))


def independent_iterations(loop: Loop) -> bool:
    """Whether the iterations of a serial loop touch disjoint cells: its body is one store (no
    accumulation, no row picked by data) at an index that moves with the loop, which reads
    the node it writes at that index only. The loops a row group makes of a member's inner
    parallel loops are such loops: marked ``omp simd``, GCC vectorizes a 27-wide row with a
    masked tail, not a scalar one (char_lm's cross-entropy gradient: three scalar exps a row)."""
    st = loop.body
    if not isinstance(st, Store) or st.accum is not None or st.row is not None or st.index.coeff(loop.sym) == 0:
        return False
    return all(e.index == st.index and e.row is None
               for e in walk_exprs(st) if isinstance(e, Load) and e.node is st.node)


def hoist_invariant_loads(em: Emitter, kernel: Kernel, indent: int) -> list[str]:
    """A fused kernel's loads at a constant index of nodes it does not write (an optimizer's
    learning rate and bias corrections), read once before the loops: GCC 12 does not
    vectorize a loop that stores to several arrays and reads two such scalars in it."""
    written = {st.node for st in walk_stmts(kernel.body) if isinstance(st, (Store, Reduce))}
    lines = []
    for e in walk_exprs(kernel.body):
        if isinstance(e, Load) and not e.merge and e.row is None and not e.index.terms and e.node not in written:
            key = (e.node, e.index.const)
            if key not in em.hoisted:
                name = f"pj_inv{len(em.hoisted)}"
                lines.append(f"{'  ' * indent}const {em.ctype(e.node.dtype)} {name} = {em.expr(e)};")
                em.hoisted[key] = name
    return lines


# ---------------------------------------------------------------------------
# Whole batches


def kernel_spec(kernel: Kernel, dialect: Dialect, statics: tuple[ir.StaticSymbol, ...]) -> KernelSpec:
    """The kernel's spec and plan (every kernel of a computation takes all of its statics,
    in one order)."""
    plan = plan_kernel(kernel, dialect)
    return KernelSpec(kernel.name, kernel.buffers, kernel.merge_input, statics, plan.launch,
                      kernel.outputs, kernel.inputs, plan)


def _dtypes_of(kernels: Sequence[Kernel]) -> set[DType]:
    found: set[DType] = set()
    for k in kernels:
        found.update(n.dtype for n in k.buffers)
        for e in walk_exprs(k.body):
            found.add(e.dtype)
        if k.merge_input is not None:
            found.add(k.merge_input.dtype)
    return found


@attrs.frozen
class Source:
    """One source file for a whole batch, and the spec of each kernel in it, per computation."""

    text: str
    dialect: str
    kernels: tuple[tuple[KernelSpec, ...], ...]  # per computation of the batch

    @property
    def all_kernels(self) -> list[KernelSpec]:
        return [k for comp in self.kernels for k in comp]


_NODE_ID = re.compile(r"#(\d+)")


def _renumbered(text: str, ids: dict[str, str]) -> str:
    """A comment's node labels (``name#id``) numbered in the batch's order: ids come from a
    process-wide counter, and the same program built again (a plan compiled twice, autodiff's
    fresh nodes) must be the same source, one compile and one cache entry."""
    return _NODE_ID.sub(lambda m: "#" + ids.setdefault(m.group(1), str(len(ids) + 1)), text)


def generate(batch: LoweredBatch, dialect: Dialect) -> Source:
    kernels = batch.kernels
    used = _dtypes_of(kernels)
    for dt in used:  # a DType built by hand would write its own strings as type names
        if all(dt is not known for known in dtypes.ALL):  # by identity: DTypes equal by name
            raise UnsupportedError(f"{dt.name!r} is not a dtype of polyjit's table (polyjit.core.dtypes.ALL)")
    body: list[str] = []
    specs: list[tuple[KernelSpec, ...]] = []
    taken: set[str] = set()
    ids: dict[str, str] = {}
    for comp in batch.comps:
        comp_specs = []
        for kernel in comp.kernels:
            spec = kernel_spec(kernel, dialect, comp.statics)
            spec = attrs.evolve(spec, name=kernel_identifier(spec.name, taken))
            names = Names(spec)
            em = Emitter(dialect, names)
            if kernel.comment:
                body.append(comment(_renumbered(kernel.comment, ids)))
            body += dialect.ordered_float_prefix if spec.plan.ordered_float else ()
            body += dialect.emit_kernel(em, kernel, spec, names)
            body.append("")
            comp_specs.append(spec)
        specs.append(tuple(comp_specs))
    helpers = used_helpers(dialect.helper_definitions(used), "\n".join(body))
    lines = [*dialect.prelude(used), *helpers, *([""] if helpers else []), *body]
    text = "\n".join(lines) + "\n"
    check_source(text, dialect.name)
    return Source(text, dialect.name, tuple(specs))
