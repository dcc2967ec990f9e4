"""Misuse of the runtime's public API, each with the typed error it must raise.

:func:`misuse_table` lists (what, expected error, call) for one backend; :func:`try_misuse`
runs them and describes every call that raised something else, or nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import polyjit
from polyjit.core import dtypes, ir, lower
from polyjit.core.errors import (
    BindingError,
    DTypeMismatchError,
    FinalizedError,
    InvalidArgumentError,
    InvalidProgramError,
    NodeNotInContextError,
    PolyjitError,
    ReadOnlyNodeError,
    ShapeMismatchError,
    StreamClosedError,
    UnknownDeviceError,
    ValueRangeError,
)
from polyjit.core.ir import Node, Op, StaticSymbol
from polyjit.core.runtime import Backend

__all__ = ["misuse_table", "try_misuse"]


def misuse_table(backend: Backend) -> list[tuple[str, type[PolyjitError], Callable[[], Any]]]:
    """(what, the error it must raise, the call) for the runtime's public API."""
    dev = backend.get_device(0)
    a, out = Node("mis_a", (16,)), Node("mis_out", (16,))
    comp = ir.Comp.of(ir.apply(Op.EXP, a, into=out))
    code = backend.compile(comp, name="mis")
    batch = backend.compile_batch([comp], names=["mis_batch"])
    ctx = dev.make_context().init_from_host(a, np.ones(16, np.float32))
    b = StaticSymbol("b", 4)
    row, src = Node("mis_row", (3,)), Node("mis_src", (4, 3))
    sliced = backend.compile(ir.Comp.of(ir.slice_at(row, src, b)), name="mis_slice")
    sctx = ctx.init_from_host(src, np.zeros((4, 3), np.float32))
    routine = sctx.link(sliced)
    k = Node("mis_k", (16,), mode=ir.MemoryMode.MATERIALIZED)  # a constant readable from the host
    with_const = backend.compile(ir.Comp.of(ir.constant(k, np.arange(16, dtype=np.float32)),
                                            ir.apply(Op.ADD, a, k, into=out)), name="mis_const")
    const_ctx = ctx.link(with_const).context
    writes_const = backend.compile(ir.Comp.of(ir.fill(k, 5.0)), name="mis_writes_const")
    plain_k = dev.make_context().init_from_host(k, np.zeros(16, np.float32))
    read_only = np.ones(16, np.float32)
    read_only.setflags(write=False)
    dead = dev.make_context().init_from_host(a, np.ones(16, np.float32))
    dead.finalize()
    closed = dev.new_stream()
    closed.close()
    ints, ints_out = Node("mis_ints", (16,), dtypes.int32), Node("mis_ints_out", (16,), dtypes.int32)
    pool = ctx.loc(a, "misuse").pool_id

    def bind(value: Any) -> Callable[[], None]:
        def run() -> None:
            routine.bindings[b] = value
            try:
                routine.run()
            finally:
                routine.bindings[b] = 0
        return run

    return [
        ("link of a CodeBatch", InvalidArgumentError, lambda: ctx.link(batch)),  # type: ignore[arg-type]
        ("link of a string", InvalidArgumentError, lambda: ctx.link("mis")),  # type: ignore[arg-type]
        ("link_batch of a Code", InvalidArgumentError, lambda: ctx.link_batch(code)),  # type: ignore[arg-type]
        ("compile of a number", InvalidArgumentError, lambda: backend.compile(42)),  # type: ignore[arg-type]
        ("compile_batch of one Comp", InvalidArgumentError, lambda: backend.compile_batch(comp)),  # type: ignore[arg-type]
        ("compile_batch with an occupancy that is not a function", InvalidArgumentError,
         lambda: backend.compile_batch([comp], occupancy=1)),  # type: ignore[arg-type]
        ("a static bound that is not an integer", InvalidArgumentError, lambda: StaticSymbol("s", 2.5)),
        ("a static bound beyond int64", ValueRangeError, lambda: StaticSymbol("s", 2**64)),
        ("raw_kernel bindings that are not a mapping", BindingError,
         lambda: backend.raw_kernel("", "mis_raw", [], statics=[b], bindings=5)),  # type: ignore[arg-type]
        ("raw_kernel with more work-items in a dimension than the backend takes", InvalidArgumentError,
         lambda: backend.raw_kernel("", "mis_raw", [], global_size=backend.driver.dialect.max_work_items + 1)),
        ("a binding given as a string", BindingError, bind("1")),
        ("a binding given as a float", BindingError, bind(2.7)),
        ("a binding given as a bool", BindingError, bind(True)),
        ("a binding out of range", BindingError, bind(4)),
        ("a negative binding", BindingError, bind(-1)),
        ("compile with a float binding", BindingError,
         lambda: backend.compile(ir.Comp.of(ir.slice_at(row, src, b)), bindings={b: 1.5})),  # type: ignore[dict-item]
        ("from_host into a constant", ReadOnlyNodeError, lambda: const_ctx.from_host(k, np.zeros(16, np.float32))),
        ("linking a write into a constant", ReadOnlyNodeError, lambda: const_ctx.link(writes_const)),
        ("device_to_device into a constant", ReadOnlyNodeError,
         lambda: polyjit.device_to_device(k, dst=const_ctx, src=plain_k)),
        ("read of a finalized context", FinalizedError, lambda: dead.read(a)),
        # the device's own pool calls: a driver would take any range (the cpu one wrote past the pool)
        ("memset_zero past the end of a pool", InvalidArgumentError, lambda: dev.memset_zero(pool, 0, 1 << 40)),
        ("memset_zero at a negative offset", InvalidArgumentError, lambda: dev.memset_zero(pool, -64, 32)),
        ("memset_zero of a negative length", InvalidArgumentError, lambda: dev.memset_zero(pool, 0, -1)),
        ("memset_zero of a float length", InvalidArgumentError, lambda: dev.memset_zero(pool, 0, 8.0)),  # type: ignore[arg-type]
        ("memset_zero of a pool that does not exist", InvalidProgramError, lambda: dev.memset_zero(1 << 40, 0, 8)),
        ("alloc_pool of a negative size", InvalidArgumentError, lambda: dev.alloc_pool(1 << 41, -100, 64)),
        ("alloc_pool aligned to 0 bytes", InvalidArgumentError, lambda: dev.alloc_pool(1 << 41, 64, 0)),
        ("get_device of a string", UnknownDeviceError, lambda: backend.get_device("0")),  # type: ignore[arg-type]
        ("get_device of a bool", UnknownDeviceError, lambda: backend.get_device(True)),
        ("get_device of a float", UnknownDeviceError, lambda: backend.get_device(0.0)),  # type: ignore[arg-type]
        ("get_device past the end", UnknownDeviceError, lambda: backend.get_device(99)),
        ("a context on a closed stream", StreamClosedError, lambda: dev.make_context(closed)),
        ("with_stream of a closed stream", StreamClosedError, lambda: ctx.with_stream(closed)),
        ("read of a string", InvalidArgumentError, lambda: ctx.read("mis_a")),  # type: ignore[arg-type]
        ("read of a node without a buffer", NodeNotInContextError, lambda: ctx.read(Node("nope", (2,)))),
        ("from_host of a list", DTypeMismatchError, lambda: ctx.from_host(a, [1.0] * 16)),  # type: ignore[arg-type]
        ("from_host of the wrong shape", ShapeMismatchError, lambda: ctx.from_host(a, np.ones(15, np.float32))),
        ("from_host of the wrong dtype", DTypeMismatchError, lambda: ctx.from_host(a, np.ones(16, np.float64))),
        ("to_host into a read-only array", ShapeMismatchError, lambda: ctx.to_host(a, read_only)),
        ("init_from_host with a node of another dtype", DTypeMismatchError,
         lambda: ctx.init_from_host(Node("i", (16,), dtypes.int32), np.ones(16, np.float32))),
        # programs: caught when the assignment is built, before any source is written
        ("a string as a scalar operand", DTypeMismatchError,
         lambda: ir.apply(Op.ADD, a, "1); abort(); (", into=out)),  # type: ignore[arg-type]
        ("NaN added to an integer node", ValueRangeError,
         lambda: ir.apply(Op.ADD, ints, float("nan"), into=ints_out)),
        ("1e30 added to an int32 node", ValueRangeError, lambda: ir.apply(Op.ADD, ints, 1e30, into=ints_out)),
        ("a fill of inf into an integer node", ValueRangeError,
         lambda: ir.fill(Node("u8", (4,), dtypes.uint8), float("inf"))),
        ("a shape of floats", ShapeMismatchError, lambda: Node("f", (2.5, 4))),  # type: ignore[arg-type]
        ("a node named by a number", InvalidArgumentError, lambda: Node(7, (4,))),  # type: ignore[arg-type]
        ("a stream waiting for something that is not an event", InvalidArgumentError,
         lambda: dev.default_stream.wait(None)),  # type: ignore[arg-type]
        ("a context on something that is not a stream", InvalidArgumentError,
         lambda: dev.make_context("s")),  # type: ignore[arg-type]
        ("an export of a string", InvalidArgumentError, lambda: ctx.export("mis_a")),  # type: ignore[arg-type]
        ("device_to_device from a string", InvalidArgumentError,
         lambda: polyjit.device_to_device(a, dst=ctx, src="x")),  # type: ignore[arg-type]
        ("a binding keyed by a string", BindingError,
         lambda: backend.compile(comp, bindings={"b": 1})),  # type: ignore[dict-item]
        ("an einsum spec that is not a str", InvalidProgramError,
         lambda: ir.einsum(5, a, into=Node("s", ()))),  # type: ignore[arg-type]
        # the IR's constructors check their parts (each was an AttributeError, a TypeError, a
        # ValueError or an OverflowError from inside polyjit, some only at compile)
        ("an assignment into a string", InvalidArgumentError, lambda: ir.apply(Op.ADD, a, 1.0, into="y")),  # type: ignore[arg-type]
        ("an op given as a string", InvalidArgumentError, lambda: ir.apply("add", a, 1.0, into=out)),  # type: ignore[arg-type]
        ("an accumulation given as a string", InvalidArgumentError,
         lambda: ir.apply(Op.ADD, a, 1.0, into=out, accum="add")),  # type: ignore[arg-type]
        ("init_neutral that is not a bool", InvalidArgumentError,
         lambda: ir.apply(Op.ADD, a, 1.0, into=out, accum=ir.AccumOp.ADD, init_neutral="no")),  # type: ignore[arg-type]
        ("a memory mode that does not exist", InvalidArgumentError, lambda: Node("m", (4,), mode="scratch")),
        ("a node of 2**62 x 8 elements", ShapeMismatchError, lambda: Node("huge", (1 << 62, 8))),
        ("an integer literal beyond every float", ValueRangeError, lambda: ir.apply(Op.ADD, a, 10**400, into=out)),
        ("a constant of strings", DTypeMismatchError, lambda: ir.constant(out, ["a"] * 16)),
        ("a NaN in an integer constant", ValueRangeError, lambda: ir.constant(ints, [float("nan")] + [1.0] * 15)),
        ("1e12 in an int32 constant", ValueRangeError, lambda: ir.constant(ints, [1e12] + [1.0] * 15)),
        ("2.7 in an int32 constant", ValueRangeError, lambda: ir.constant(ints, [2.7] + [1.0] * 15)),
        ("2**40 in an int32 constant", ValueRangeError, lambda: ir.constant(ints, np.full(16, 2**40))),
        ("a bfloat16 NaN in an int32 constant", ValueRangeError,
         lambda: ir.constant(ints, np.full(16, np.nan, dtypes.bfloat16.np))),
        ("an int32 constant of digits", DTypeMismatchError, lambda: ir.constant(ints, ["3"] * 16)),
        ("an object array of 1.5 in an int32 constant", ValueRangeError,
         lambda: ir.constant(ints, np.full(16, 1.5, dtype=object))),
        ("lowering with fewer names than computations", InvalidProgramError, lambda: lower.lower([comp], [])),
        ("lowering an assignment, not a computation", InvalidProgramError,
         lambda: lower.lower([ir.apply(Op.ADD, a, 1.0, into=out)], ["k"])),  # type: ignore[list-item]
        ("a reshape of an array", InvalidArgumentError, lambda: ir.reshape(out, np.ones(16))),  # type: ignore[arg-type]
        ("a product space of bare symbols", InvalidProgramError,
         lambda: ir.projections([ir.Symbol("i")], [ir.Symbol("i")])),  # type: ignore[list-item]
        ("an extent given as a string", InvalidProgramError,
         lambda: ir.projections([(ir.Symbol("i"), "16")], [ir.Symbol("i")])),  # type: ignore[list-item]
        ("a computation embedding a string", InvalidArgumentError,
         lambda: ir.Comp.of(ir.apply(Op.EXP, a, into=out), embedded=["mis_out"])),  # type: ignore[list-item]
    ]


def try_misuse(backend: Backend) -> tuple[int, list[str]]:
    """Run every call of the table; returns (how many were tried, what went wrong)."""
    table = misuse_table(backend)
    wrong = []
    for what, expected, call in table:
        try:
            call()
        except expected as e:
            if not str(e):
                wrong.append(f"{what}: {expected.__name__} with an empty message")
        except Exception as e:
            wrong.append(f"{what}: {type(e).__name__}: {e} (expected {expected.__name__})")
        else:
            wrong.append(f"{what}: nothing raised (expected {expected.__name__})")
    return len(table), wrong
