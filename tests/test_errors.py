"""Every misuse of the runtime is a specific PolyjitError naming what is wrong, and the
context stays usable afterwards. The table of bad inputs is counted in docs/reliability.md."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from polyjit import ir
from polyjit.core.errors import (
    ReadOnlyNodeError,
)
from polyjit.core.ir import Node, Op, StaticSymbol
from polyjit.core.runtime import Backend
from polyjit.testing.misuse import try_misuse

ROOT = Path(__file__).resolve().parent.parent


def _still_usable(backend: Backend, ctx: Any) -> None:
    x, y = Node("usable_x", (8,)), Node("usable_y", (8,))
    r = ctx.init_from_host(x, np.arange(8, dtype=np.float32)).link(
        backend.compile(ir.Comp.of(ir.apply(Op.MUL, x, x, into=y)), name="usable"))
    r.run()
    np.testing.assert_array_equal(r.context.read(y), np.arange(8, dtype=np.float32) ** 2)


def test_every_misuse_is_typed_and_leaves_the_context_usable(backend: Backend) -> None:
    tried, wrong = try_misuse(backend)
    assert tried >= 25
    assert not wrong, "\n".join(wrong)
    _still_usable(backend, backend.get_device(0).make_context())


def test_a_constant_stays_what_it_was_for_every_context(backend: Backend) -> None:
    dev = backend.get_device(0)
    a, out = Node("c_a", (16,)), Node("c_out", (16,))
    k = Node("c_k", (16,), mode=ir.MemoryMode.MATERIALIZED)
    values = np.arange(16, dtype=np.float32)
    code = backend.compile(ir.Comp.of(ir.constant(k, values), ir.apply(Op.ADD, a, k, into=out)), name="c")
    one = dev.make_context().init_from_host(a, np.zeros(16, np.float32)).link(code)
    two = dev.make_context().init_from_host(a, np.zeros(16, np.float32)).link(code)
    with pytest.raises(ReadOnlyNodeError, match="c_k"):
        one.context.from_host(k, np.full(16, 99, np.float32))
    two.run()
    np.testing.assert_array_equal(two.context.read(out), values)


def test_a_constant_is_its_values_when_made_whatever_the_caller_does_next(backend: Backend) -> None:
    """ir.constant keeps its own read-only copy: the caller's array, changed after the IR is
    built (before compile, and again between link and run), changes nothing."""
    dev = backend.get_device(0)
    a, out = Node("cm_a", (16,)), Node("cm_out", (16,))
    k = Node("cm_k", (16,), mode=ir.MemoryMode.MATERIALIZED)
    values = np.arange(16, dtype=np.float32)
    fetch = ir.constant(k, values)
    values[:] = -1
    code = backend.compile(ir.Comp.of(fetch, ir.apply(Op.ADD, a, k, into=out)), name="cm")
    r = dev.make_context().init_from_host(a, np.zeros(16, np.float32)).link(code)
    values[:] = -2
    r.run()
    np.testing.assert_array_equal(r.context.read(out), np.arange(16, dtype=np.float32))
    assert isinstance(fetch.value, ir.Constant) and not fetch.value.values.flags.writeable


def test_one_assignment_compiles_like_a_computation(backend: Backend) -> None:
    a, out = Node("one_a", (5,)), Node("one_out", (5,))
    code = backend.compile(ir.apply(Op.EXP, a, into=out), name="one")
    r = backend.get_device(0).make_context().init_from_host(a, np.zeros(5, np.float32)).link(code)
    r.run()
    np.testing.assert_array_equal(r.context.read(out), np.ones(5, np.float32))


def test_integer_bindings_of_numpy_types_are_accepted(backend: Backend) -> None:
    b = StaticSymbol("b", 4)
    row, src = Node("nb_row", (3,)), Node("nb_src", (4, 3))
    code = backend.compile(ir.Comp.of(ir.slice_at(row, src, b)), name="nb", bindings={b: np.int64(2)})
    values = np.arange(12, dtype=np.float32).reshape(4, 3)
    r = backend.get_device(0).make_context().init_from_host(src, values).link(code)
    r.run()
    np.testing.assert_array_equal(r.context.read(row), values[2])
    r.bindings[b] = np.uint8(3)
    r.run()
    np.testing.assert_array_equal(r.context.read(row), values[3])


def test_get_device_without_devices_says_why() -> None:
    """The driver's own reason, not 'ordinals 0..-1'."""
    code = textwrap.dedent("""
        import os
        from polyjit.backends import get_backend
        from polyjit.core.errors import UnknownDeviceError
        be = get_backend("opencl")
        try:
            be.get_device(0)
        except UnknownDeviceError as e:
            print(e)
    """)
    env = {**os.environ, "OCL_ICD_VENDORS": str(ROOT / "no-such.icd")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "opencl has no devices here" in out.stdout, out.stdout + out.stderr
    assert "0..-1" not in out.stdout


def test_whole_numbers_are_ints_or_numpy_integers_never_bools() -> None:
    """One rule for every count, size, offset, ordinal and bound (core.dtypes.is_int). It was
    spelled a dozen ways: users' launch sizes and the cpu backend's device count refused numpy
    integers, and an MPI rank or tag took True for 1."""
    from polyjit.backends.cpu import CpuDriver
    from polyjit.core import dtypes, raw
    from polyjit.core.errors import BackendUnavailableError, InvalidArgumentError

    assert all(dtypes.is_int(v) for v in (0, 7, -1, np.int64(2), np.uint8(1), np.int32(-3)))
    assert not any(dtypes.is_int(v) for v in (True, False, np.bool_(True), 2.0, np.float32(1), "2", None))
    assert CpuDriver(num_devices=np.int64(1)).device_count() == 1
    with pytest.raises(BackendUnavailableError):
        CpuDriver(num_devices=True)
    backend = Backend(CpuDriver())
    y = Node("whole_y", (4,))
    src = "void k(float* y) { for (int i = 0; i < 4; i++) y[i] = (float)i; }\n"
    code = backend.raw_kernel(src, "k", [raw.write(y)], global_size=np.int64(1))
    r = backend.get_device(0).make_context().link(code)
    r.run()
    np.testing.assert_array_equal(r.context.read(y), np.arange(4, dtype=np.float32))
    with pytest.raises(InvalidArgumentError, match="global_size"):
        backend.raw_kernel(src, "k", [raw.write(y)], global_size=True)
