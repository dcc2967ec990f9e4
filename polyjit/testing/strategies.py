"""Hypothesis strategies: random programs checked against the reference interpreter.

- :func:`elementwise_programs`: random DAGs of elementwise ops over a few input
  nodes of mixed dtypes and broadcastable shapes (fused into kernels by the
  lowering, or stored when a node is read twice);
- :func:`einsum_programs`: random einsum specs (transposes, reductions, products)
  with each AccumOp, with and without ``init_neutral``;
- :func:`matmul_programs`: matmul-shaped einsums of sizes that cut register and
  work-group tiles at every edge (rows, whole vectors, lanes), with transposed
  operands, a batch axis, and accumulation onto what the context holds;
- :func:`affine_programs`: random affine projections (offsets, strides, reversed
  axes, fixed indices, diagonals, non-injective and non-surjective writes).

Hypothesis draws the structure; the input values come from a numpy generator
seeded by a drawn integer. Every value range is tracked with interval arithmetic
so that no program overflows, divides by zero or takes the logarithm of a
negative, and a float error bound is tracked alongside so that each output gets
a tolerance that fits the computation (integers and bools compare exactly; a
float is only compared, or cast to an integer, while it is exact).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
from hypothesis import strategies as st

from polyjit.core import dtypes, ir
from polyjit.core.dtypes import DType
from polyjit.core.ir import AccumOp, Node, Op, Symbol
from polyjit.testing.programs import CatalogProgram, Gen

__all__ = [
    "affine_programs",
    "describe",
    "einsum_programs",
    "elementwise_programs",
    "gather_programs",
    "matmul_programs",
    "programs",
    "shapes",
]

Array = np.ndarray[Any, Any]
_EPS = {dtypes.float32: 2.0**-23, dtypes.float64: 2.0**-52, dtypes.float16: 2.0**-10, dtypes.bfloat16: 2.0**-7}
_CAP = {dtypes.float32: 1e4, dtypes.float64: 1e6, dtypes.int32: 2.0**30, dtypes.int64: 2.0**52,
        dtypes.float16: 1e3, dtypes.bfloat16: 1e4}
# significand bits: a float type holds the values of another of fewer (same range or
# smaller), and integers below 2**bits, exactly
_BITS = {dtypes.float16: 11, dtypes.bfloat16: 8, dtypes.float32: 24, dtypes.float64: 53}
_WIDER = {dtypes.float16: (dtypes.float32, dtypes.float64), dtypes.bfloat16: (dtypes.float32, dtypes.float64),
          dtypes.float32: (dtypes.float64,)}
_INT_RANGE = {dtypes.int32: (-(2.0**31), 2.0**31 - 1), dtypes.int64: (-(2.0**63), 2.0**63 - 1)}
_UNARY_MATH = (Op.EXP, Op.LOG, Op.SQRT, Op.TANH, Op.SIGMOID)


def describe(comps: Sequence[ir.Comp]) -> str:
    """A readable listing of the assignments of a batch (for failure messages)."""
    lines = []
    for c in comps:
        for leaf in c.leaves():
            if isinstance(leaf, ir.Fetch):
                lines.append(f"  {leaf.node!r} <- {leaf.value!r}")
                continue
            pr = leaf.projections
            space = ", ".join(f"{s!r}<{n}" for s, n in pr.product_space)
            tensors = iter(pr.rhs)
            args = []
            for x in leaf.rhs:
                if isinstance(x, (Node, ir.MergeRead)):
                    idx = ", ".join(map(repr, next(tensors)))
                    args.append(f"{x!r}[{idx}]")
                else:
                    args.append(repr(x))
            acc = "=" if leaf.accum is None else f"{leaf.accum.value}="
            init = "" if leaf.init_neutral or leaf.accum is None else " (onto the context)"
            lhs = ", ".join(map(repr, pr.lhs))
            lines.append(f"  for {space}: {leaf.lhs!r}[{lhs}] {acc} {leaf.op.value}({', '.join(args)}){init}")
    return "\n".join(lines)


def shapes(max_rank: int = 3, max_side: int = 5, min_side: int = 1) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(st.integers(min_side, max_side), min_size=0, max_size=max_rank).map(tuple)


@st.composite
def _broadcastable_to(draw: st.DrawFn, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts to ``shape``: leading axes dropped, some axes of size 1."""
    drop = draw(st.integers(0, len(shape)))
    kept = shape[drop:]
    return tuple(1 if draw(st.booleans()) and n != 1 and draw(st.booleans()) else n for n in kept)


# ---------------------------------------------------------------------------
# Elementwise DAGs


@attrs.frozen
class _Val:
    """A tensor or scalar operand under construction: its value interval and error bound."""

    dtype: DType
    lo: float
    hi: float
    err: float = 0.0  # bound on |value - exact value| (0: every correct implementation agrees)
    node: Node | None = None
    scalar: int | float | bool | None = None

    @property
    def mag(self) -> float:
        return max(abs(self.lo), abs(self.hi))

    @property
    def operand(self) -> ir.Operand:
        if self.node is not None:
            return self.node
        assert self.scalar is not None
        return self.scalar


def _fits(dt: DType, lo: float, hi: float) -> bool:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return False
    if dt.is_float or dt in _CAP:
        cap = _CAP.get(dt)
        return cap is None or max(abs(lo), abs(hi)) <= cap
    return True


def _wrap_uint8(lo: float, hi: float) -> tuple[float, float]:
    return (lo, hi) if lo >= 0 and hi <= 255 else (0.0, 255.0)


def _corners(f: Callable[[float, float], float], a: _Val, b: _Val) -> tuple[float, float]:
    vals = [f(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    return min(vals), max(vals)


def _result(op: Op, args: Sequence[_Val], out: DType) -> tuple[float, float, float] | None:
    """(lo, hi, err) of ``op(args)``, or None if the op is unsafe on these intervals."""
    a = args[0]
    dt = a.dtype if op is not Op.WHERE else args[1].dtype
    fl = dt.is_float
    eps = _EPS.get(dt, 0.0)
    lo: float
    hi: float
    err = 0.0
    if op in ir.COMPARISONS:
        if any(x.err for x in args):
            return None  # a rounding difference could flip it
        return 0.0, 1.0, 0.0
    if op is Op.CAST:
        if out.is_bool:
            return (0.0, 1.0, 0.0) if a.err == 0 else None
        if out.is_float:
            exact = (dt is out or out in _WIDER.get(dt, ()) or
                     (not dt.is_float and a.mag < 2.0 ** _BITS[out]))
            rounding = 0.0 if exact else _EPS[out] * a.mag
            return a.lo, a.hi, a.err + rounding
        if a.err:
            return None  # truncating a value that is not exact could differ by one
        if out is dtypes.uint8:
            if dt.is_float:
                return (math.trunc(a.lo), math.trunc(a.hi), 0.0) if a.lo > -1 and a.hi < 256 else None
            return (*_wrap_uint8(a.lo, a.hi), 0.0)
        lo, hi = (math.trunc(a.lo), math.trunc(a.hi)) if dt.is_float else (a.lo, a.hi)
        rlo, rhi = _INT_RANGE[out]
        return (lo, hi, 0.0) if rlo <= lo and hi <= rhi else None
    if op is Op.WHERE:
        x, y = args[1], args[2]
        return min(x.lo, y.lo), max(x.hi, y.hi), max(x.err, y.err)
    if op is Op.ID:
        return a.lo, a.hi, a.err
    rounds = op not in (Op.NEG, Op.ABS, Op.RELU, Op.MAX, Op.MIN)  # those are exact
    if op is Op.NEG:
        lo, hi, err = -a.hi, -a.lo, a.err
    elif op is Op.ABS:
        lo = 0.0 if a.lo <= 0 <= a.hi else min(abs(a.lo), abs(a.hi))
        hi, err = a.mag, a.err
        if dt is dtypes.uint8:
            lo, hi = a.lo, a.hi
    elif op is Op.RELU:
        lo, hi, err = max(a.lo, 0.0), max(a.hi, 0.0), a.err
    elif op is Op.EXP:
        if a.hi > 5:
            return None
        lo, hi = math.exp(a.lo), math.exp(a.hi)
        err = hi * a.err + 4 * eps * hi
    elif op is Op.LOG:
        if a.lo < 0.25:
            return None
        lo, hi = math.log(a.lo), math.log(a.hi)
        err = a.err / a.lo + 4 * eps * max(abs(lo), abs(hi), 1.0)
    elif op is Op.SQRT:
        if a.lo < 0.25:
            return None
        lo, hi = math.sqrt(a.lo), math.sqrt(a.hi)
        err = a.err / (2 * math.sqrt(a.lo)) + 4 * eps * hi
    elif op is Op.TANH:
        lo, hi = math.tanh(a.lo), math.tanh(a.hi)
        err = a.err + 4 * eps
    elif op is Op.SIGMOID:
        lo, hi = 1 / (1 + math.exp(-a.lo)), 1 / (1 + math.exp(-a.hi))
        err = a.err / 4 + 4 * eps
    else:
        b = args[1]
        if op is Op.ADD:
            lo, hi, err = a.lo + b.lo, a.hi + b.hi, a.err + b.err
        elif op is Op.SUB:
            lo, hi, err = a.lo - b.hi, a.hi - b.lo, a.err + b.err
        elif op is Op.MUL:
            lo, hi = _corners(lambda x, y: x * y, a, b)
            err = a.mag * b.err + b.mag * a.err + a.err * b.err
        elif op is Op.MAX:
            lo, hi, err = max(a.lo, b.lo), max(a.hi, b.hi), max(a.err, b.err)
        elif op is Op.MIN:
            lo, hi, err = min(a.lo, b.lo), min(a.hi, b.hi), max(a.err, b.err)
        elif op is Op.DIV:
            if fl:
                if not (b.lo >= 0.25 or b.hi <= -0.25) or b.err > 0.05:
                    return None
                lo, hi = _corners(lambda x, y: x / y, a, b)
                d = min(abs(b.lo), abs(b.hi)) - b.err
                err = (a.err + max(abs(lo), abs(hi)) * b.err) / d
            else:
                if not (b.lo >= 1 or b.hi <= -1):
                    return None
                lo, hi = -a.mag, a.mag
        elif op is Op.POW:
            if a.lo < 0.25 or a.hi > 8 or b.mag > 3:
                return None
            lo, hi = _corners(lambda x, y: x**y, a, b)
            log_mag = max(abs(math.log(a.lo)), abs(math.log(a.hi)))
            err = hi * (b.mag / a.lo * a.err + log_mag * b.err) + 4 * eps * hi
        else:  # pragma: no cover
            return None
    if dt is dtypes.uint8:
        lo, hi = _wrap_uint8(lo, hi)
    if not fl:
        err = 0.0
    elif rounds:  # (float16's subnormals round to 2**-24 whatever the magnitude)
        err += eps * max(abs(lo), abs(hi)) + (2.0**-24 if dt is dtypes.float16 else 0.0)
    if not _fits(dt, lo, hi) or not math.isfinite(err):
        return None
    return lo, hi, err


_SCALARS: dict[str, tuple[int | float | bool, ...]] = {
    "float": (-1.5, -0.5, 0.5, 2.0, 3.0),
    "int": (-3, -1, 2, 5),
    "uint8": (1, 3, 200),
    "bool": (True, False),
}


def _scalar_choices(dt: DType) -> tuple[int | float | bool, ...]:
    if dt.is_bool:
        return _SCALARS["bool"]
    if dt.is_float:
        return _SCALARS["float"]
    return _SCALARS["uint8"] if dt is dtypes.uint8 else _SCALARS["int"]


def _scalar_val(dt: DType, v: int | float | bool) -> _Val:
    return _Val(dt, float(v), float(v), 0.0, None, v)


_INPUT_RANGES: dict[str, list[tuple[float, float]]] = {
    "float": [(-2.0, 2.0), (0.25, 3.0), (-0.5, 0.5)],
    "int": [(-20, 20), (1, 9), (-3, 3)],
    "uint8": [(0, 255), (1, 20)],
}


def _input_gen(dt: DType, shape: tuple[int, ...], lo: float, hi: float, exact_zeros: bool) -> Gen:
    def gen(rng: np.random.Generator) -> Array:
        if dt.is_bool:
            return rng.random(shape) < 0.5
        if dt.is_float:
            x = rng.uniform(lo, hi, shape)
            if exact_zeros and lo <= 0 <= hi:
                x = np.where(rng.random(shape) < 0.2, 0.0, x)
            return np.asarray(x).astype(dt.np)
        return rng.integers(int(lo), int(hi) + 1, shape).astype(dt.np)

    return gen


_ALL_OPS = (Op.ID, Op.NEG, Op.ABS, Op.EXP, Op.LOG, Op.SQRT, Op.TANH, Op.SIGMOID, Op.RELU, Op.CAST,
            Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MAX, Op.MIN, Op.POW,
            Op.LT, Op.LE, Op.GT, Op.GE, Op.EQ, Op.NE, Op.WHERE)


_Option = tuple[Op, tuple[_Val, ...], DType, tuple[float, float, float]]


def _tolerance_for(v: _Val) -> tuple[float, float]:
    if not v.dtype.is_float:
        return 0.0, 0.0
    eps = _EPS[v.dtype]
    return 8 * eps, 4 * v.err + 1e-300


@st.composite
def elementwise_programs(draw: st.DrawFn, max_inputs: int = 3, max_ops: int = 5) -> CatalogProgram:
    """A random DAG of elementwise ops (mixed dtypes, broadcasting, scalars, casts)."""
    shape = draw(shapes(max_rank=3, max_side=5))
    vals: list[_Val] = []
    inputs: list[tuple[Node, Gen]] = []
    for k in range(draw(st.integers(1, max_inputs))):
        dt = draw(st.sampled_from(dtypes.ALL))
        in_shape = draw(_broadcastable_to(shape))
        if dt.is_bool:
            lo, hi = 0.0, 1.0
        else:
            family = "float" if dt.is_float else ("uint8" if dt is dtypes.uint8 else "int")
            lo, hi = draw(st.sampled_from(_INPUT_RANGES[family]))
        node = Node(f"in{k}", in_shape, dt)
        inputs.append((node, _input_gen(dt, in_shape, lo, hi, exact_zeros=draw(st.booleans()))))
        vals.append(_Val(dt, lo, hi, 0.0, node))

    assignments: list[ir.Assignment] = []
    made: list[_Val] = []
    read: set[Node] = set()
    for step in range(draw(st.integers(1, max_ops))):
        options: list[_Option] = []
        for op in _ALL_OPS:
            options += _options(op, vals)
        if not options:
            break
        op, args, out_dt, (lo, hi, err) = draw(st.sampled_from(options))
        if op.arity == 2 and args[0].node is not None and draw(st.booleans()):
            # the second operand becomes a Python scalar (of the first's dtype)
            s = draw(st.sampled_from(_scalar_choices(args[0].dtype)))
            sv = _scalar_val(args[0].dtype, s)
            checked = _result(op, (args[0], sv), out_dt)
            if checked is not None and (op is not Op.POW or args[0].dtype.is_float):
                args = (args[0], sv)
                lo, hi, err = checked
        node = Node(f"t{step}", shape, out_dt)
        assignments.append(ir.apply(op, *(a.operand for a in args), into=node))
        read.update(a.node for a in args if a.node is not None)
        v = _Val(out_dt, lo, hi, err, node)
        vals.append(v)
        made.append(v)
    if not made:  # nothing applied: copy the first input
        v0 = vals[0]
        node = Node("copy", shape, v0.dtype)
        assignments.append(ir.apply(Op.ID, v0.node if v0.node is not None else 0, into=node))
        made.append(_Val(v0.dtype, v0.lo, v0.hi, 0.0, node))
    comp = ir.Comp.of(*assignments)
    outs = [v for v in made if v.node is not None and v.node in comp.embedded]
    rtol = max(_tolerance_for(v)[0] for v in outs)
    atol = max(_tolerance_for(v)[1] for v in outs)
    p = CatalogProgram("hypothesis.elementwise", (comp,), tuple(inputs), tuple(v.node for v in outs if v.node),
                rtol=rtol, atol=atol)
    return attrs.evolve(p, description=describe(p.comps))


def _options(op: Op, vals: Sequence[_Val]) -> list[_Option]:
    out: list[_Option] = []
    if op is Op.CAST:
        for a in vals:
            for dst in dtypes.ALL:
                r = _result(op, (a,), dst)
                if r is not None:
                    out.append((op, (a,), dst, r))
        return out
    if op is Op.WHERE:
        conds = [c for c in vals if c.dtype.is_bool]
        for c in conds[:2]:
            for a in vals:
                for b in vals:
                    if a.dtype is b.dtype and a is not b:
                        r = _result(op, (c, a, b), a.dtype)
                        if r is not None:
                            out.append((op, (c, a, b), a.dtype, r))
        return out
    for combo in _combos(vals, op.arity):
        dts = [x.dtype for x in combo]
        try:
            rdt = ir.result_dtype(op, dts, dts[0])
        except ir.DTypeMismatchError:
            continue
        r = _result(op, combo, rdt)
        if r is not None:
            out.append((op, combo, rdt, r))
    return out


def _combos(vals: Sequence[_Val], arity: int) -> list[tuple[_Val, ...]]:
    if arity == 1:
        return [(a,) for a in vals]
    return [(a, b) for a in vals for b in vals if a.dtype is b.dtype]


# ---------------------------------------------------------------------------
# Einsum programs


_LETTERS = "ijkl"


@st.composite
def einsum_programs(draw: st.DrawFn) -> CatalogProgram:
    """A random einsum (one or two operands) with a random AccumOp and init_neutral."""
    extents = {ch: draw(st.integers(0, 5) if draw(st.integers(0, 9)) == 0 else st.integers(1, 5))
               for ch in _LETTERS}
    n_ops = draw(st.integers(1, 2))
    specs = []
    for _ in range(n_ops):
        rank = draw(st.integers(0, 3))
        specs.append("".join(draw(st.permutations(_LETTERS))[:rank]))
    used = sorted(set("".join(specs)))
    out_rank = draw(st.integers(0, len(used)))
    out_letters = "".join(draw(st.permutations(used))[:out_rank])
    spec = ",".join(specs) + "->" + out_letters
    dt = draw(st.sampled_from([dtypes.float32, dtypes.float64, dtypes.int32, dtypes.int64, dtypes.uint8,
                               *dtypes.HALF]))
    accum = draw(st.sampled_from(list(AccumOp)))
    init_neutral = draw(st.booleans())
    reduced = [ch for ch in used if ch not in out_letters]
    n_red = math.prod(extents[ch] for ch in reduced)
    lo: float
    hi: float
    if dt is dtypes.uint8:
        lo, hi = 0, 255  # uint8 wraps: any values
    elif accum is AccumOp.MUL:
        lo, hi = (0.97, 1.03) if dt.is_float else (-1, 1)
    elif dt.is_float:
        lo, hi = (-2.0, 2.0)
    else:
        lo, hi = (-10, 10)
    operands = [Node(f"x{k}", tuple(extents[ch] for ch in s), dt) for k, s in enumerate(specs)]
    out = Node("out", tuple(extents[ch] for ch in out_letters), dt)
    inputs: list[tuple[Node, Gen]] = [(x, _input_gen(dt, x.shape, lo, hi, False)) for x in operands]
    if not init_neutral:
        ilo, ihi = (0.5, 1.5) if accum is AccumOp.MUL and dt.is_float else (lo, hi)
        inputs.append((out, _input_gen(dt, out.shape, ilo, ihi, False)))
    acc = ir.einsum(spec, *operands, into=out, accum=accum, init_neutral=init_neutral)
    rtol, atol = 0.0, 0.0
    if dt.is_float:
        # the half types accumulate in float32 (both sides round the same products to half),
        # then the result's rounding to half may flip: 4 units of its last place, and a
        # float16 subnormal
        eps, acc_eps = _EPS[dt], _EPS[dt.compute]
        last = (4 * eps, 2.0**-24) if dt.is_half else (0.0, 0.0)
        term = max(abs(lo), abs(hi)) ** n_ops
        if accum is AccumOp.ADD:
            atol = 4 * acc_eps * (n_red + 2) * (n_red * term + (max(abs(lo), abs(hi)) if not init_neutral else 0))
            rtol = 4 * eps
        elif accum is AccumOp.MUL:
            rtol = 4 * acc_eps * (n_ops * n_red + 2) + last[0]
            atol = 1e-300
        else:
            rtol, atol = 2 * eps, 1e-300
        atol += last[1]
    p = CatalogProgram(f"hypothesis.einsum[{spec}]", (ir.Comp.of(acc),), tuple(inputs), (out,),
                rtol=rtol, atol=atol)
    return attrs.evolve(p, description=f"  einsum {spec!r} accum={accum.value} init_neutral={init_neutral} "
                                       f"dtype={dt} extents={extents}\n" + describe(p.comps))


@st.composite
def matmul_programs(draw: st.DrawFn) -> CatalogProgram:
    """``[b]ik,[b]kj->[b]ij`` (operands possibly stored transposed) with m, k, n up to 70:
    enough to cross the CPU's 6-row x 2-vector tiles and the GPUs' 16..64-wide tiles."""
    m, k, n = (draw(st.integers(1, 70)) for _ in range(3))
    batch = draw(st.sampled_from(["", "b"]))
    a_spec = batch + draw(st.sampled_from(["ik", "ki"]))
    b_spec = draw(st.sampled_from([batch, ""])) + draw(st.sampled_from(["kj", "jk"]))
    extents = {"b": draw(st.integers(1, 3)), "i": m, "k": k, "j": n}
    dt = draw(st.sampled_from([dtypes.float32, dtypes.float64, *dtypes.HALF]))
    init_neutral = draw(st.booleans())
    a = Node("a", tuple(extents[c] for c in a_spec), dt)
    b = Node("b", tuple(extents[c] for c in b_spec), dt)
    out = Node("out", tuple(extents[c] for c in batch + "ij"), dt)
    inputs: list[tuple[Node, Gen]] = [(a, _input_gen(dt, a.shape, -2.0, 2.0, False)),
                                      (b, _input_gen(dt, b.shape, -2.0, 2.0, False))]
    if not init_neutral:
        inputs.append((out, _input_gen(dt, out.shape, -2.0, 2.0, False)))
    spec = f"{a_spec},{b_spec}->{batch}ij"
    acc = ir.einsum(spec, a, b, into=out, init_neutral=init_neutral)
    eps, acc_eps = _EPS[dt], _EPS[dt.compute]  # half types: float32 accumulators, one rounding
    p = CatalogProgram(f"hypothesis.matmul[{spec}]", (ir.Comp.of(acc),), tuple(inputs), (out,),
                rtol=4 * eps, atol=4 * acc_eps * (k + 2) * (4 * k + 2) + (2.0**-24 if dt.is_half else 0.0))
    return attrs.evolve(p, description=f"  matmul {spec!r} init_neutral={init_neutral} dtype={dt} "
                                       f"extents={extents}\n" + describe(p.comps))


# ---------------------------------------------------------------------------
# Affine projections


@st.composite
def _affine_index(draw: st.DrawFn, space: Sequence[tuple[Symbol, int]]) -> tuple[ir.Affine, int]:
    """An index expression over the symbols and the size of the axis it needs."""
    terms: dict[ir.Var, int] = {}
    for sym, _ in space:
        if draw(st.integers(0, 2)) == 0:
            terms[sym] = draw(st.sampled_from([-1, 1, 1, 2]))
    extents = dict(space)
    lo = sum(min(0, c * (extents[s] - 1)) for s, c in terms.items() if isinstance(s, Symbol))
    hi = sum(max(0, c * (extents[s] - 1)) for s, c in terms.items() if isinstance(s, Symbol))
    const = -lo + draw(st.integers(0, 2))
    return ir.Affine.of(terms, const), hi + const + 1 + draw(st.integers(0, 1))


def _small_ints(dt: DType, shape: tuple[int, ...]) -> Gen:
    """Integers in [-9, 9] (exact in every dtype: sums in any order agree); bfloat16, whose
    integers are exact up to 256 only: in [-1, 1] (an affine program sums at most 64 pairs)."""
    top = 1 if dt is dtypes.bfloat16 else 9
    return lambda rng: rng.integers(-top, top + 1, shape).astype(dt.np)


@st.composite
def affine_programs(draw: st.DrawFn) -> CatalogProgram:
    """An Accum with random affine lhs and rhs indices (strides, offsets, reversed and fixed
    indices, diagonals); writes that miss cells or hit one cell several times included."""
    n_syms = draw(st.integers(1, 3))
    space = [(Symbol(f"s{k}"), draw(st.integers(1, 4))) for k in range(n_syms)]
    dt = draw(st.sampled_from([dtypes.float32, dtypes.float64, dtypes.int32, dtypes.int64, *dtypes.HALF]))
    accum = draw(st.sampled_from([None, None, AccumOp.ADD, AccumOp.MAX, AccumOp.MIN]))
    init_neutral = draw(st.booleans())

    def node(name: str) -> tuple[Node, tuple[ir.Affine, ...]]:
        rank = draw(st.integers(1, 3))
        idx = [draw(_affine_index(space)) for _ in range(rank)]
        return Node(name, tuple(n for _, n in idx), dt), tuple(e for e, _ in idx)

    lhs, lidx = node("lhs")
    x, xidx = node("x")
    rhs: tuple[Node, ...]
    ridx: tuple[tuple[ir.Affine, ...], ...]
    if draw(st.booleans()):
        y, yidx = node("y")
        op, rhs, ridx = Op.ADD, (x, y), (xidx, yidx)
    else:
        op, rhs, ridx = draw(st.sampled_from([Op.ID, Op.NEG])), (x,), (xidx,)
    pr = ir.Projections(tuple(space), lidx, ridx)
    a = ir.Accum(lhs, accum, op, rhs, pr, init_neutral)
    inputs: list[tuple[Node, Gen]] = [(n, _small_ints(dt, n.shape)) for n in (*rhs, lhs)]
    p = CatalogProgram("hypothesis.affine", (ir.Comp.of(a),), tuple(inputs), (lhs,), rtol=0.0, atol=0.0)
    return attrs.evolve(p, description=describe(p.comps))


@st.composite
def gather_programs(draw: st.DrawFn) -> CatalogProgram:
    """Rows picked by data: a gather of a random table by random indices (any integer dtype,
    repeated, some out of range: clamped), its scatter-add back, and a value computed from
    the gathered rows (an elementwise reader of a stored gather)."""
    rows = draw(st.integers(1, 9))
    row_shape = draw(shapes(max_rank=2, max_side=5))
    idx_shape = draw(shapes(max_rank=3, max_side=5))
    dt = draw(st.sampled_from([dtypes.float32, dtypes.float64, dtypes.int32, dtypes.int64, *dtypes.HALF]))
    idt = draw(st.sampled_from([dtypes.int32, dtypes.int64, dtypes.uint8]))
    table, idx = Node("table", (rows, *row_shape), dt), Node("idx", idx_shape, idt)
    picked, summed = Node("picked", (*idx_shape, *row_shape), dt), Node("summed", table.shape, dt)
    doubled = Node("doubled", picked.shape, dt)
    lo = 0 if idt is dtypes.uint8 else -3
    source = draw(st.sampled_from(["input", "computed", "view"]))  # where the table comes from
    made: list[ir.Assignment]
    given, made = table, []
    if source == "computed":  # in the same computation: stored for the gather, never inlined
        given = Node("given", table.shape, dt)
        made = [ir.apply(Op.NEG, given, into=table)]
    elif source == "view":  # a reshape of a flat input: the gather reads its source
        given = Node("given", (table.size,), dt)
        made = [ir.reshape(table, given)]
    comps = (ir.Comp.of(*made, ir.gather(table, idx, picked), ir.apply(Op.ADD, picked, picked, into=doubled),
                        embedded=(picked, doubled)),
             ir.Comp.of(ir.scatter_add(idx, picked, summed)))
    inputs: list[tuple[Node, Gen]] = [
        (given, _small_ints(dt, given.shape)),  # sums exact in any order
        (idx, lambda rng: rng.integers(lo, rows + 3, idx_shape).astype(idt.np))]
    p = CatalogProgram("hypothesis.gather", comps, tuple(inputs), (picked, doubled, summed), rtol=0.0, atol=0.0)
    return attrs.evolve(p, description=f"  table {table.shape} {dt} ({source}), indices {idx_shape} {idt}\n"
                                       + describe(p.comps))


def programs() -> st.SearchStrategy[CatalogProgram]:
    """Any of the random program strategies."""
    return st.one_of(elementwise_programs(), einsum_programs(), matmul_programs(), affine_programs(),
                     gather_programs())
