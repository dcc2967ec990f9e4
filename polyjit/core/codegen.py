"""One C-family emitter for the loop IR, parameterized by a Dialect.

The emitter writes expressions, stores, reductions and serial loops the same
way for C, OpenCL C and CUDA C. A ``Dialect`` supplies what differs: type
names, math functions, the kernel signature and how its buffer parameters are
declared, and how the nest of parallel loops maps onto hardware (OpenMP,
global ids, blocks and threads), which also fixes the launch configuration.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np

from polyjit.core import dtypes, ir
from polyjit.core.dtypes import DType
from polyjit.core.ir import Affine, Symbol
from polyjit.core.lower import (
    Call,
    Const,
    Expr,
    IndexValue,
    Kernel,
    Load,
    Loop,
    LoweredBatch,
    Reduce,
    Stmt,
    Store,
    walk_exprs,
    walk_stmts,
)

# ---------------------------------------------------------------------------
# What a compiled batch describes about each kernel


@attrs.frozen
class LaunchConfig:
    """How a kernel is launched. ``global_size``/``local_size`` are in work items (OpenCL style);
    CUDA reads grid = global // local. The CPU ignores them (OpenMP decides)."""

    global_size: tuple[int, ...] = (1,)
    local_size: tuple[int, ...] | None = None
    shared_bytes: int = 0


@attrs.frozen
class KernelSpec:
    """A kernel of a compiled module: its parameters in order, then the statics."""

    name: str
    buffers: tuple[ir.Node, ...]  # outputs first; the merge buffer (if any) is not among them
    merge: ir.Node | None  # passed after the buffers
    statics: tuple[ir.StaticSymbol, ...]
    launch: LaunchConfig
    outputs: tuple[ir.Node, ...]
    inputs: tuple[ir.Node, ...]


# ---------------------------------------------------------------------------
# Dialect: what differs between C, OpenCL C and CUDA C


class Dialect:
    """The C dialect (the CPU backend); OpenCL and CUDA subclass it."""

    name = "c"
    function_qualifier = "static inline"
    restrict = "restrict"
    # A kernel of less work than this (innermost iterations) runs on one thread: a team
    # costs microseconds.
    omp_min_work = 32768

    def type_name(self, dt: DType) -> str:
        return dt.c

    def prelude(self, batch_dtypes: set[DType]) -> list[str]:
        return ["#include <stdint.h>", "#include <math.h>", ""]

    def math_call(self, fn: str, dt: DType, args: Sequence[str]) -> str:
        suffix = "f" if dt is dtypes.float32 else ""
        name = {"abs": "fabs"}.get(fn, fn)
        return f"{name}{suffix}({', '.join(args)})"

    def float_literal(self, value: float, dt: DType) -> str:
        if math.isnan(value):
            return "NAN"
        if math.isinf(value):
            return "INFINITY" if value > 0 else "(-INFINITY)"
        if dt is dtypes.float32:
            return f"{float(np.float32(value))!r}f"
        return repr(float(value))

    # -- kernel signature and the parallel nest --------------------------------

    def kernel_open(self, spec: KernelSpec, names: Names) -> list[str]:
        lines = [f"void {spec.name}(void* const* {self.restrict} pj_bufs, "
                 f"const int64_t* {self.restrict} pj_statics) {{"]
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

    def launch_config(self, kernel: Kernel) -> LaunchConfig:
        return LaunchConfig((max(1, kernel.work),))

    def emit_parallel(self, em: Emitter, kernel: Kernel, names: Names, indent: int) -> list[str]:
        """C: the parallel nest as for loops, the outermost under ``#pragma omp parallel for``."""
        lines: list[str] = []
        nest = list(kernel.parallel)
        pad = "  " * indent
        if nest and kernel.total_work >= self.omp_min_work:
            collapse = 1
            if len(nest) > 1 and nest[0][1] < 64:  # a short outer loop: share the next ones too
                collapse = len(nest) - 1
            clause = f" collapse({collapse})" if collapse > 1 else ""
            lines.append(f"{pad}#pragma omp parallel for{clause} schedule(static)")
        elif not nest and isinstance(kernel.body, Reduce) and _omp_reduction_op(kernel.body):
            return em.reduce_parallel_c(kernel.body, indent, _omp_reduction_op(kernel.body) or "")
        depth = indent
        for sym, n in nest:
            lines.append(f"{'  ' * depth}for (int64_t {names.var(sym)} = 0; {names.var(sym)} < {n}; ++{names.var(sym)}) {{")
            depth += 1
        lines += em.stmt(kernel.body, depth)
        for d in range(depth - 1, indent - 1, -1):
            lines.append(f"{'  ' * d}}}")
        return lines

    def emit_kernel(self, em: Emitter, kernel: Kernel, spec: KernelSpec, names: Names) -> list[str]:
        return [*self.kernel_open(spec, names), *self.emit_parallel(em, kernel, names, 1), "}"]

    def reduce_pragma(self, r: Reduce) -> str | None:
        """C: a reduction whose order is free (``Reduce.reassociable``) vectorizes with one
        accumulator per lane (``omp simd``)."""
        op = _OMP_REDUCTION_OPS[r.accum]
        if self.name != "c" or not r.reassociable or not r.node.dtype.is_float:
            return None
        collapse = f" collapse({len(r.loops)})" if len(r.loops) > 1 else ""
        return f"#pragma omp simd reduction({op}:pj_acc){collapse}"

    def kernel_prefix(self, kernel: Kernel) -> list[str]:
        """Lines before a kernel's definition.

        C: GCC 12's loop vectorizer miscompiles in-order (fold-left) float reductions
        that read with a negative stride (``sum_k x[n - k]`` gives wrong sums at -O3);
        vectorizing an in-order float reduction gains nothing on the CPU anyway, so
        kernels holding one are compiled without the loop vectorizer.
        """
        if self.name != "c" or not _has_float_serial_accumulation(kernel):
            return []
        return ["#if defined(__GNUC__) && !defined(__clang__)",
                '__attribute__((optimize("no-tree-loop-vectorize")))',
                "#endif"]


def _has_float_serial_accumulation(kernel: Kernel) -> bool:
    stmts = list(walk_stmts(kernel.body))
    if any(isinstance(s, Reduce) and s.node.dtype.is_float and not s.reassociable for s in stmts):
        return True
    serial = any(isinstance(s, Loop) for s in stmts)
    return serial and any(isinstance(s, Store) and s.accum is not None and s.node.dtype.is_float for s in stmts)


_OMP_REDUCTION_OPS = {ir.AccumOp.ADD: "+", ir.AccumOp.MUL: "*", ir.AccumOp.MAX: "max", ir.AccumOp.MIN: "min"}


def _omp_reduction_op(r: Reduce) -> str | None:
    """A full reduction (no parallel nest) worth splitting across threads with OpenMP."""
    if not r.loops or math.prod(n for _, n in r.loops) < 65536:
        return None
    return _OMP_REDUCTION_OPS[r.accum]


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
_MATH = {ir.Op.EXP: "exp", ir.Op.LOG: "log", ir.Op.SQRT: "sqrt", ir.Op.TANH: "tanh", ir.Op.POW: "pow"}


class Emitter:
    def __init__(self, dialect: Dialect, names: Names) -> None:
        self.d = dialect
        self.names = names

    # -- expressions ---------------------------------------------------------

    def index(self, a: Affine) -> str:
        parts = [(self.names.var(v) if c == 1 else f"{c}*{self.names.var(v)}") for v, c in a.terms]
        if a.const or not parts:
            parts.append(str(a.const))
        return " + ".join(parts).replace("+ -", "- ")

    def literal(self, value: float | int | bool, dt: DType) -> str:
        if dt.is_float:
            return self.d.float_literal(float(value), dt)
        if dt.is_bool:
            return "1" if value else "0"
        v = int(value)
        if dt is dtypes.int64:
            return f"((int64_t){v}LL)" if self.d.name == "c" else f"(({self.d.type_name(dt)}){v})"
        return f"(({self.d.type_name(dt)}){v})"

    def expr(self, e: Expr) -> str:
        if isinstance(e, Load):
            base = self.names.merge if e.merge else self.names.buffer(e.node)
            return f"{base}[{self.index(e.index)}]"
        if isinstance(e, Const):
            return self.literal(e.value, e.dtype)
        if isinstance(e, IndexValue):
            return f"((int64_t)({self.index(e.index)}))" if self.d.name == "c" else f"({self.index(e.index)})"
        return self.call(e)

    def call(self, e: Call) -> str:
        op, dt = e.op, e.dtype
        args = [self.expr(a) for a in e.args]
        t = self.d.type_name(dt)
        arg_dt = e.args[0].dtype if e.args else dt
        if op in _INFIX:
            s = f"({args[0]} {_INFIX[op]} {args[1]})"
            # C computes narrow integers in int: wrap like numpy does.
            return f"(({t})({s}))" if dt in (dtypes.uint8,) else s
        if op is ir.Op.NEG:
            return f"(({t})(-{args[0]}))"
        if op is ir.Op.ABS:
            if dt.is_float:
                return self.d.math_call("abs", dt, args)
            return f"(({t})(({args[0]}) < 0 ? -({args[0]}) : ({args[0]})))"
        if op in _MATH:
            return self.d.math_call(_MATH[op], dt, args)
        if op is ir.Op.SIGMOID:
            one = self.literal(1, dt)
            return f"({one} / ({one} + {self.d.math_call('exp', dt, [f'-{args[0]}'])}))"
        if op is ir.Op.RELU:
            zero = self.literal(0, dt)
            return f"pj_max_{arg_dt.name}({args[0]}, {zero})"
        if op in (ir.Op.MAX, ir.Op.MIN):
            return f"pj_{op.value}_{dt.name}({args[0]}, {args[1]})"
        if op is ir.Op.CAST:
            if dt.is_bool:
                return f"(({t})(({args[0]}) != 0))"
            return f"(({t})({args[0]}))"
        if op is ir.Op.WHERE:
            return f"(({args[0]}) ? ({args[1]}) : ({args[2]}))"
        if op is ir.Op.ID:
            return args[0]
        raise AssertionError(f"unhandled op {op}")

    # -- statements ----------------------------------------------------------

    def combine(self, accum: ir.AccumOp, dt: DType, old: str, new: str) -> str:
        if accum is ir.AccumOp.ADD:
            return f"{old} + {new}"
        if accum is ir.AccumOp.MUL:
            return f"{old} * {new}"
        return f"pj_{accum.value}_{dt.name}({old}, {new})"

    def stmt(self, s: Stmt, indent: int) -> list[str]:
        pad = "  " * indent
        if isinstance(s, Store):
            target = f"{self.names.buffer(s.node)}[{self.index(s.index)}]"
            value = self.expr(s.value)
            if s.accum is not None:
                value = self.combine(s.accum, s.node.dtype, target, value)
            return [f"{pad}{target} = {value};"]
        if isinstance(s, Loop):
            v = self.names.var(s.sym)
            return [f"{pad}for (int64_t {v} = 0; {v} < {s.extent}; ++{v}) {{",
                    *self.stmt(s.body, indent + 1), f"{pad}}}"]
        return self.reduce(s, indent)

    def reduce_cell(self, r: Reduce) -> tuple[str, str]:
        """A reduction's output cell and the value it starts from (the cell itself when the
        reduction accumulates onto what the context holds)."""
        target = f"{self.names.buffer(r.node)}[{self.index(r.index)}]"
        return target, target if r.init is None else self.expr(r.init)

    def reduce(self, r: Reduce, indent: int, pragma: str | None = None) -> list[str]:
        pragma = pragma or self.d.reduce_pragma(r)
        pad = "  " * indent
        t = self.d.type_name(r.node.dtype)
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
        lines += [f"{pad}  {target} = pj_acc;", f"{pad}}}"]
        return lines

    def reduce_parallel_c(self, r: Reduce, indent: int, op: str) -> list[str]:
        pragma = f"#pragma omp parallel for reduction({op}:pj_acc) schedule(static)"
        if len(r.loops) > 1:
            pragma = pragma.replace("for ", f"for collapse({len(r.loops)}) ")
        return self.reduce(r, indent, pragma)


# ---------------------------------------------------------------------------
# Whole batches


def kernel_spec(kernel: Kernel, dialect: Dialect, statics: tuple[ir.StaticSymbol, ...]) -> KernelSpec:
    """Every kernel of a computation takes all of its statics, in one order."""
    return KernelSpec(
        kernel.name, kernel.buffers, kernel.merge_input, statics,
        dialect.launch_config(kernel), kernel.outputs, kernel.inputs,
    )


def helpers(dialect: Dialect, used: set[DType]) -> list[str]:
    """max/min helpers for each dtype (as functions: arguments are evaluated once)."""
    q = dialect.function_qualifier
    lines = []
    for dt in sorted(used, key=lambda d: d.name):
        t = dialect.type_name(dt)
        lines.append(f"{q} {t} pj_max_{dt.name}({t} a, {t} b) {{ return a > b ? a : b; }}")
        lines.append(f"{q} {t} pj_min_{dt.name}({t} a, {t} b) {{ return a < b ? a : b; }}")
    return lines


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


def generate(batch: LoweredBatch, dialect: Dialect) -> Source:
    kernels = batch.kernels
    used = _dtypes_of(kernels)
    lines = [*dialect.prelude(used), *helpers(dialect, used), ""]
    specs: list[tuple[KernelSpec, ...]] = []
    for comp in batch.comps:
        comp_specs = []
        for kernel in comp.kernels:
            spec = kernel_spec(kernel, dialect, comp.statics)
            names = Names(spec)
            em = Emitter(dialect, names)
            if kernel.comment:
                lines.append(f"/* {kernel.comment.replace('*/', '* /')} */")
            lines += dialect.kernel_prefix(kernel)
            lines += dialect.emit_kernel(em, kernel, spec, names)
            lines.append("")
            comp_specs.append(spec)
        specs.append(tuple(comp_specs))
    return Source("\n".join(lines) + "\n", dialect.name, tuple(specs))
