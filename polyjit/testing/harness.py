"""Running test programs on a backend and checking them against the reference interpreter."""

from __future__ import annotations

import traceback
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from polyjit.core import dtypes, ir, lower
from polyjit.core.dtypes import DType
from polyjit.core.ir import MemoryMode, Node
from polyjit.core.reference import run_reference
from polyjit.core.runtime import Backend, Context, Routine
from polyjit.testing.programs import CatalogProgram

__all__ = ["Failure", "compare", "kernel_dtypes", "program_rng", "run_programs", "unsupported_reason"]

Array = np.ndarray[Any, Any]


@attrs.frozen
class Failure:
    program: str
    message: str

    def __str__(self) -> str:
        return f"[{self.program}] {self.message}"


def program_rng(name: str, seed: int = 0) -> np.random.Generator:
    """The random generator of a program's inputs: fixed by its name and the seed."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def compare(label: str, got: Array, want: Array, rtol: float, atol: float, show: int = 5) -> str | None:
    """None when ``got`` matches ``want`` (exactly for integers and bools, and for floats at
    zero tolerance: the sign of a zero too), else a message."""
    if got.shape != want.shape:
        return f"{label}: shape {got.shape}, expected {want.shape}"
    if got.dtype != want.dtype:
        return f"{label}: dtype {got.dtype}, expected {want.dtype}"
    if got.dtype in (dtypes.float16.np, dtypes.bfloat16.np):
        # as float32 (exactly their values): bfloat16 is not of numpy's kind "f", and isclose
        # would compute a float16 difference and tolerance in float16
        got, want = got.astype(np.float32), want.astype(np.float32)
    if got.dtype.kind == "f":
        with np.errstate(all="ignore"):
            ok = np.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
        if rtol == 0 and atol == 0:  # exactly: -0.0 is not +0.0 (isclose says it is)
            ok &= (got != 0) | (np.signbit(got) == np.signbit(want))
    else:
        ok = got == want
    ok = np.asarray(ok)
    if ok.all():
        return None
    bad = np.argwhere(~ok) if ok.ndim else np.zeros((1, 0), dtype=np.int64)
    lines = [f"{label}: {len(bad)} of {got.size} values differ (rtol={rtol:g}, atol={atol:g})"]
    for idx in bad[:show]:
        t = tuple(int(k) for k in idx)
        lines.append(f"    at {t}: got {got[t]!r}, expected {want[t]!r}")
    if got.dtype.kind == "f":
        with np.errstate(all="ignore"):
            err = np.abs(got.astype(np.float64) - want.astype(np.float64))
        lines.append(f"    max abs error {np.nanmax(err) if err.size else 0:g}")
    return "\n".join(lines)


def _describe(e: BaseException) -> str:
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    return f"{type(e).__name__}: {e}\n" + "".join(tb[-4:]).rstrip()


def _check_modes(p: CatalogProgram, ctx: Context) -> list[str]:
    problems = []
    modes = lower.infer_modes(p.comps).modes
    for n in p.virtual:
        if modes.get(n) is not MemoryMode.VIRTUAL:
            problems.append(f"{n.label} should be inferred VIRTUAL, is {modes.get(n)}")
        if n in ctx.buffers:
            problems.append(f"{n.label} is VIRTUAL but has a buffer in the context")
    for n in p.absent:
        if n in ctx.buffers:
            problems.append(f"{n.label} ({modes.get(n)}) should not be in the context")
    for n in p.present:
        if n not in ctx.buffers:
            problems.append(f"{n.label} ({modes.get(n)}) should be in the context")
    return problems


def _execute(p: CatalogProgram, routines: Sequence[Routine], host: dict[Node, Array]) -> list[str]:
    """Run the program's routines for each of its runs; compare with the reference after each."""
    problems: list[str] = []
    ctx = routines[-1].context
    problems += _check_modes(p, ctx)
    state: dict[Node, Array] = dict(host)
    for k, bindings in enumerate(p.runs):
        for r in routines:
            for sym, v in bindings.items():
                r.bindings[sym] = v
            r.run()
        state = run_reference(p.comps, state, bindings)
        for node in p.outputs:
            got = ctx.read(node)
            rtol, atol = p.tolerance(node.dtype)
            run = f" run {k + 1}/{len(p.runs)}" + (f" {dict(bindings)}" if bindings else "")
            msg = compare(f"{node.label}{run}", got, state[node], rtol, atol)
            if msg:
                problems.append(msg)
        if problems:
            break
    return problems


def _run_group(backend: Backend, ordinal: int, group: Sequence[CatalogProgram], seed: int) -> list[Failure]:
    device = backend.get_device(ordinal)
    comps: list[ir.Comp] = []
    names: list[str] = []
    for pk, p in enumerate(group):
        for ck, c in enumerate(p.comps):
            comps.append(c)
            names.append(f"p{pk}_{ck}_{p.name.replace('.', '_')}")
    batch = backend.compile_batch(comps, names=names)
    contexts: list[Context] = [device.make_context()]
    hosts: list[dict[Node, Array]] = []
    try:
        for p in group:
            host = p.generate(program_rng(p.name, seed))
            hosts.append(host)
            for node, arr in host.items():
                contexts.append(contexts[-1].init_from_host(node, arr))
        routines = contexts[-1].link_batch(batch)
        contexts.append(routines[0].context if routines else contexts[-1])
        failures: list[Failure] = []
        pos = 0
        for p, host in zip(group, hosts):
            mine = routines[pos : pos + len(p.comps)]
            pos += len(p.comps)
            try:
                problems = _execute(p, mine, host)
            except Exception as e:
                problems = [_describe(e)]
            if problems and p.description:
                problems.append("the program:\n" + p.description)
            failures += [Failure(p.name, m) for m in problems]
        return failures
    finally:
        for ctx in reversed(contexts):
            ctx.finalize()


def program_nodes(p: CatalogProgram) -> set[Node]:
    """Every node a program touches."""
    nodes = {n for n, _ in p.inputs}
    for c in p.comps:
        for leaf in c.leaves():
            nodes.add(ir.writes(leaf))
            nodes.update(ir.operand_node(x) for x in ir.reads(leaf))
    return nodes


def kernel_dtypes(p: CatalogProgram) -> frozenset[DType]:
    """The dtypes the program's kernels compute with: their buffers, the merge buffer and every
    expression (a node that no kernel touches, such as a constant read back as is, is data only)."""
    names = tuple(f"k{k}" for k in range(len(p.comps)))
    found: set[DType] = set()
    for comp in lower.lower(list(p.comps), names).comps:
        for kernel in comp.kernels:
            found.update(n.dtype for n in kernel.buffers)
            if kernel.merge_input is not None:
                found.add(kernel.merge_input.dtype)
            found.update(e.dtype for e in lower.walk_exprs(kernel.body))
    return frozenset(found)


def unsupported_reason(properties: Mapping[str, Any], p: CatalogProgram) -> str | None:
    """Why the program cannot run on a device with these properties (``Device.properties``), or
    None. A device whose ``fp64`` property is False runs no kernel that computes in float64."""
    if properties.get("fp64", True) is False and dtypes.float64 in kernel_dtypes(p):
        return "the device has no fp64 (its property fp64 is False) and the program's kernels use float64"
    return None


def group_programs(programs: Sequence[CatalogProgram], size: int) -> list[list[CatalogProgram]]:
    """Consecutive programs, at most ``size`` a group, no two of a group sharing a node."""
    groups: list[list[CatalogProgram]] = []
    group: list[CatalogProgram] = []
    seen: set[Node] = set()
    for p in programs:
        nodes = program_nodes(p)
        if len(group) >= size or nodes & seen:
            groups.append(group)
            group, seen = [], set()
        group.append(p)
        seen |= nodes
    if group:
        groups.append(group)
    return groups


def run_programs(
    backend: Backend,
    programs: Sequence[CatalogProgram],
    *,
    ordinal: int = 0,
    seed: int = 0,
    batch_size: int = 64,
) -> list[Failure]:
    """Run programs on a device of the backend and compare them with the reference.

    Programs are compiled ``batch_size`` at a time into one batch (one source, one
    binary); when a batch fails to compile or link, its programs are retried one by
    one so that the failure names the program at fault.
    """
    failures: list[Failure] = []
    for group in group_programs(programs, max(1, batch_size)):
        try:
            failures += _run_group(backend, ordinal, group, seed)
        except Exception as e:
            if len(group) == 1:
                failures.append(Failure(group[0].name, _describe(e)))
                continue
            for p in group:
                try:
                    failures += _run_group(backend, ordinal, [p], seed)
                except Exception as e1:
                    failures.append(Failure(p.name, _describe(e1)))
    return failures
