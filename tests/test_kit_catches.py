"""The conformance kit fails drivers that break the contract, and passes the ones that keep it.

Each broken driver is the CPU driver (or, where it is cheap, the OpenCL driver) with one
primitive subtly wrong: a ``copy_device`` that ignores the source or the destination
offset, a ``free`` that does nothing. Each must fail the kit check that covers it with
a message that says what went wrong, while the unbroken driver passes the same check. A
driver whose device has no fp64 passes the catalog check, which skips the float64
programs and says so.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable
from typing import Any

import attrs
import pytest

from polyjit.backends.cpu import CpuDriver
from polyjit.core import raw
from polyjit.core.codegen import KernelSpec, Source
from polyjit.core.errors import UnsupportedError
from polyjit.core.protocol import DeviceInfo, DriverDefaults
from polyjit.core.runtime import Backend
from polyjit.testing import (
    CheckSkipped,
    KitNote,
    catalog,
    run_check,
    run_selftest,
    unsupported_reason,
)
from polyjit.testing import suite as suite_mod
from polyjit.testing.checks import common as checks_common
from polyjit.testing.checks import compute as checks_compute
from polyjit.testing.checks import kernels as checks_kernels

CheckFn = Callable[[Backend], None]

COPY_CHECKS = (suite_mod.check_copy_offsets_one_device, suite_mod.check_copy_offsets_two_devices)
FREE_CHECKS = (suite_mod.check_free_returns_memory, suite_mod.check_dropped_work)


# -- broken CPU drivers ----------------------------------------------------------------


class _IgnoresSourceOffset(CpuDriver):
    """copy_device reads from the start of the source pool."""

    def copy_device(self, stream: int, dst: tuple[int, int, int], src: tuple[int, int, int], nbytes: int) -> None:
        super().copy_device(stream, dst, (src[0], src[1], 0), nbytes)


class _IgnoresDestinationOffset(CpuDriver):
    """copy_device writes to the start of the destination pool."""

    def copy_device(self, stream: int, dst: tuple[int, int, int], src: tuple[int, int, int], nbytes: int) -> None:
        super().copy_device(stream, (dst[0], dst[1], 0), src, nbytes)


class _CopiesPastTheEnd(CpuDriver):
    """copy_device copies 4 bytes more than asked: past the end of the destination node."""

    def copy_device(self, stream: int, dst: tuple[int, int, int], src: tuple[int, int, int], nbytes: int) -> None:
        super().copy_device(stream, dst, src, nbytes + 4 if nbytes else 0)


class _MemsetStopsShort(CpuDriver):
    """memset_zero leaves the last byte of the range as it was."""

    def memset_zero(self, stream: int, pool: int, offset: int, nbytes: int) -> None:
        super().memset_zero(stream, pool, offset, max(0, nbytes - 1))


class _MemsetWholeWords(CpuDriver):
    """memset_zero rounds its offset down and its length up to whole 4-byte words."""

    def memset_zero(self, stream: int, pool: int, offset: int, nbytes: int) -> None:
        start, end = offset // 4 * 4, (offset + nbytes + 3) // 4 * 4
        super().memset_zero(stream, pool, start, end - start)


class _RawUnbound(CpuDriver):
    """No parameter binding for users' kernels: the C function is called as name(bufs, statics, lo, hi)."""

    def raw_source(self, text: str, spec: KernelSpec) -> tuple[str, str]:
        return text, spec.name


class _RawAtPoolStart(CpuDriver):
    """prepare binds a user's kernel's buffers at the start of their pools."""

    def prepare(self, ordinal: int, module: Any, kernels: Any) -> Any:
        return super().prepare(ordinal, module, [
            (spec, [(pool, 0) for pool, _ in args] if spec.plan.kind == raw.RAW else args) for spec, args in kernels])


class _RawUnsupported(CpuDriver):
    """A driver that takes no users' kernels, and says so."""

    def raw_source(self, text: str, spec: KernelSpec) -> tuple[str, str]:
        raise UnsupportedError("this device runs only generated kernels")


class _MineDialect(type(CpuDriver().dialect)):  # type: ignore[misc]
    """The cpu dialect under a name the kit has no raw kernel for."""

    name = "mine"


class _UnknownDialect(CpuDriver):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dialect = _MineDialect()


class _FreeDoesNothing(CpuDriver):
    """free() keeps every pool."""

    def free(self, ordinal: int, pool: int) -> None:
        return None


class _CannotTell(CpuDriver):
    """A driver that cannot say what it holds."""

    def allocated_bytes(self, ordinal: int) -> int | None:  # type: ignore[override]
        return None


class _NoFp64(CpuDriver):
    """A device without fp64, like an OpenCL device without cl_khr_fp64: it says so in its
    properties and refuses to build kernels that compute in double."""

    def device_info(self, ordinal: int) -> DeviceInfo:
        info = super().device_info(ordinal)
        return attrs.evolve(info, properties={**info.properties, "fp64": False})

    def compile(self, source: Source) -> Any:
        if re.search(r"\bdouble\b", source.text):
            raise UnsupportedError("this device has no fp64: a kernel computes in double")
        return super().compile(source)


_BACKENDS: dict[str, tuple[Backend, Backend]] = {}


def _backends(cls: type[CpuDriver]) -> tuple[Backend, Backend]:
    """One device and two devices, once per driver class."""
    if cls.__name__ not in _BACKENDS:
        _BACKENDS[cls.__name__] = Backend(cls(1)), Backend(cls(2))
    return _BACKENDS[cls.__name__]


def _run(cls: type[CpuDriver], check: CheckFn) -> None:
    one, two = _backends(cls)
    run_check(check, one, two)


# -- copies at offsets -----------------------------------------------------------------


@pytest.mark.parametrize("check", COPY_CHECKS, ids=suite_mod.check_name)
def test_copy_offsets_pass_on_the_cpu_driver(check: CheckFn) -> None:
    _run(CpuDriver, check)


@pytest.mark.parametrize("check", COPY_CHECKS, ids=suite_mod.check_name)
@pytest.mark.parametrize("cls", [_IgnoresSourceOffset, _IgnoresDestinationOffset], ids=lambda c: c.__name__)
def test_a_copy_device_that_ignores_an_offset_fails(cls: type[CpuDriver], check: CheckFn) -> None:
    with pytest.raises(AssertionError) as info:
        _run(cls, check)
    message = str(info.value)
    assert "device_to_device of off_x" in message, message
    assert re.search(r"from offset [1-9]\d* of pool \d+ on cpu:\d to offset [1-9]\d* of pool", message), message
    assert "values differ" in message, message


@pytest.mark.parametrize("check", COPY_CHECKS, ids=suite_mod.check_name)
def test_a_copy_device_that_writes_past_the_node_fails(check: CheckFn) -> None:
    """Found by review: the copied nodes ended inside the alignment padding of their pool, so
    an overrun of up to 44 bytes wrote only padding that no check read."""
    with pytest.raises(AssertionError) as info:
        _run(_CopiesPastTheEnd, check)
    message = str(info.value)
    assert re.match(r"off_g#\d+ \(offset (\d+) .*\) after device_to_device of off_w#\d+ .* to offset \d+ .*"
                    r"a neighbour of the copied node must stay untouched", message), message


@pytest.mark.parametrize("alignment", [1, 2, 8, 4096])
def test_copy_offsets_pass_whatever_the_base_alignment(alignment: int) -> None:
    """Found by the review of the guard node: it was alignment // 4 float32 cells, none for a
    driver aligned to 1 or 2 bytes, whose correct copies then failed the check."""

    class Aligned(CpuDriver):
        def device_info(self, ordinal: int) -> DeviceInfo:
            return attrs.evolve(super().device_info(ordinal), base_alignment=alignment)

    Aligned.__name__ = f"Aligned{alignment}"  # _backends keeps one backend per class name
    for check in COPY_CHECKS:
        _run(Aligned, check)


def test_the_existing_transfer_checks_miss_what_the_offset_checks_catch() -> None:
    """Why the offset checks exist: nodes that start their pools hide an ignored offset."""
    _run(_IgnoresSourceOffset, suite_mod.check_device_to_device_one_device)
    _run(_IgnoresDestinationOffset, suite_mod.check_device_to_device_two_devices)


# -- memset_zero ------------------------------------------------------------------------


def test_memset_check_passes_on_the_cpu_driver() -> None:
    _run(CpuDriver, suite_mod.check_alloc_and_memset)


def test_a_memset_that_stops_one_byte_short_fails() -> None:
    """Found by review: the check zeroed int32 cells of small values, whose last byte (little
    endian) was already 0, so a memset one to three bytes short passed."""
    with pytest.raises(AssertionError, match=r"after memset_zero of 32 bytes at offset 64 .* 1 of 256 values differ"):
        _run(_MemsetStopsShort, suite_mod.check_alloc_and_memset)


def test_a_memset_of_whole_words_fails_at_an_odd_offset() -> None:
    with pytest.raises(AssertionError, match=r"after memset_zero of 37 bytes at offset 131 "):
        _run(_MemsetWholeWords, suite_mod.check_alloc_and_memset)


# -- users' own kernels ------------------------------------------------------------------


def test_raw_kernel_check_passes_on_the_cpu_driver() -> None:
    _run(CpuDriver, suite_mod.check_raw_kernels)


class _DefaultRawSource(CpuDriver):
    """A C-convention driver that takes DriverDefaults' raw_source, as a new driver would."""

    raw_source = DriverDefaults.raw_source


def test_a_c_driver_binds_raw_kernels_by_its_dialect_without_a_raw_source_of_its_own() -> None:
    """Found by review: the default raw_source compiled a user's C function as it was, so a
    C-convention driver that kept the default called it as name(bufs, statics, lo, hi) and
    computed garbage. The binding is the dialect's (Dialect.raw_binding) now."""
    _run(_DefaultRawSource, suite_mod.check_raw_kernels)


def test_a_c_driver_that_does_not_bind_raw_kernels_fails() -> None:
    """Found by review: the sync example had no raw_source, so users' C functions were called
    as name(bufs, statics) and computed garbage, and no check ran a raw kernel. (The C dialect
    binds them now; this driver undoes that.)"""
    with pytest.raises(AssertionError, match=r"raw_first#\d+ after the raw kernel pj_kit_raw_first.*"
                                             r"dialect's raw_binding.*core.raw.c_trampoline"):
        _run(_RawUnbound, suite_mod.check_raw_kernels)


def test_a_driver_that_binds_raw_buffers_at_offset_zero_fails() -> None:
    with pytest.raises(AssertionError, match=r"raw_out#\d+ \(offset [1-9]\d* of pool \d+\) after the raw kernel "
                                             r"pj_kit_raw_each read raw_x#\d+ at offset [1-9]"):
        _run(_RawAtPoolStart, suite_mod.check_raw_kernels)


def test_a_driver_without_raw_kernels_skips_with_its_reason() -> None:
    with pytest.raises(CheckSkipped, match=r"does not take users' own kernels: this device runs only generated"):
        _run(_RawUnsupported, suite_mod.check_raw_kernels)


def test_a_dialect_the_kit_does_not_know_fails_until_its_spelling_is_added(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(AssertionError, match=r"no raw kernel in the dialect 'mine' .*"
                                             r"RAW_KERNELS\['mine'\] = RawSpelling\(first=\.\.\., each=\.\.\.\)"):
        _run(_UnknownDialect, suite_mod.check_raw_kernels)
    monkeypatch.setitem(checks_kernels.RAW_KERNELS, "mine", checks_kernels.C_KERNELS)
    _run(_UnknownDialect, suite_mod.check_raw_kernels)


# -- memory comes back -------------------------------------------------------------------


@pytest.mark.parametrize("check", FREE_CHECKS, ids=suite_mod.check_name)
def test_memory_checks_pass_on_the_cpu_driver(check: CheckFn) -> None:
    _run(CpuDriver, check)


@pytest.mark.parametrize("check", FREE_CHECKS, ids=suite_mod.check_name)
def test_a_free_that_does_nothing_fails(check: CheckFn) -> None:
    with pytest.raises(AssertionError, match=r"the driver still holds \d+ bytes more than before.*"
                                             r"its free\(\) does not release pools"):
        _run(_FreeDoesNothing, check)


def test_a_driver_that_cannot_tell_what_it_holds_skips_that_part() -> None:
    with pytest.raises(CheckSkipped, match=r"allocated_bytes is None"):
        _run(_CannotTell, suite_mod.check_free_returns_memory)


# -- devices without fp64 ----------------------------------------------------------------


def _notes(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, KitNote)]


def test_catalog_skips_float64_programs_without_fp64() -> None:
    progs = catalog()
    expected = sum(unsupported_reason({"fp64": False}, p) is not None for p in progs)
    assert 50 < expected < len(progs)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always", KitNote)
        _run(_NoFp64, suite_mod.check_catalog_programs)  # passes: no float64 program ran
    notes = _notes(record)
    assert len(notes) == 1, notes
    m = re.fullmatch(r"(\d+) of (\d+) catalog programs on cpu:0 \(.*\) skipped: the device has no fp64 "
                     r"\(its property fp64 is False\) and the program's kernels use float64", notes[0])
    assert m is not None, notes[0]
    assert (int(m.group(1)), int(m.group(2))) == (expected, len(progs))


def test_catalog_on_the_cpu_driver_skips_nothing() -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always", KitNote)
        _run(CpuDriver, suite_mod.check_catalog_programs)
    assert _notes(record) == []


def test_without_the_skip_the_float64_programs_fail() -> None:
    """The _NoFp64 driver really cannot run them: the skip is what makes the check pass."""
    from polyjit.testing import run_programs

    float64 = [p for p in catalog() if unsupported_reason({"fp64": False}, p) is not None][:3]
    failures = run_programs(_backends(_NoFp64)[0], float64)
    assert {f.program for f in failures} == {p.name for p in float64}
    assert all("no fp64" in f.message for f in failures)


def test_generated_programs_skip_float64_without_fp64(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("hypothesis")
    monkeypatch.setattr(checks_compute, "HYPOTHESIS_EXAMPLES", 8)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always", KitNote)
        try:
            _run(_NoFp64, suite_mod.check_random_matmul_programs)
        except CheckSkipped as e:  # every example drew float64: allowed, and said
            assert "no fp64" in str(e)
    assert all("generated matmul_programs skipped: the device has no fp64" in n for n in _notes(record))


def test_selftest_prints_notes(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def check_noted(backend: Backend) -> None:
        checks_common.note("3 of 9 things skipped: a reason")

    monkeypatch.setattr(suite_mod, "CHECKS", [check_noted])
    monkeypatch.setattr(suite_mod, "_MULTI_DEVICE", set())
    assert run_selftest("cpu") == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "noted" in ln)
    assert line.startswith("pass") and line.endswith("(note: 3 of 9 things skipped: a reason)"), line


# -- the OpenCL driver, where it is cheap ------------------------------------------------


@functools.cache
def _opencl_classes() -> dict[str, type[Any]]:
    cl = pytest.importorskip("pyopencl")
    del cl
    from polyjit.backends.opencl import OpenCLDriver

    class SourceOffset(OpenCLDriver):
        def copy_device(self, stream: Any, dst: tuple[int, Any, int], src: tuple[int, Any, int], nbytes: int) -> Any:
            return super().copy_device(stream, dst, (src[0], src[1], 0), nbytes)

    class DestinationOffset(OpenCLDriver):
        def copy_device(self, stream: Any, dst: tuple[int, Any, int], src: tuple[int, Any, int], nbytes: int) -> Any:
            return super().copy_device(stream, (dst[0], dst[1], 0), src, nbytes)

    class PastTheEnd(OpenCLDriver):
        def copy_device(self, stream: Any, dst: tuple[int, Any, int], src: tuple[int, Any, int], nbytes: int) -> Any:
            return super().copy_device(stream, dst, src, nbytes + 4 if nbytes else 0)

    class NoFree(OpenCLDriver):
        def free(self, ordinal: int, pool: Any) -> None:
            return None

    return {"good": OpenCLDriver, "source": SourceOffset, "destination": DestinationOffset, "long": PastTheEnd,
            "free": NoFree}


def _opencl(kind: str) -> Backend:
    driver = _opencl_classes()[kind]()
    if driver.device_count() == 0:
        pytest.skip(f"no OpenCL device: {driver.unavailable_reason}")
    return Backend(driver)


@pytest.mark.parametrize("kind", ["good", "source", "destination", "long"])
def test_opencl_copy_offsets(kind: str) -> None:
    backend = _opencl(kind)
    if kind == "good":
        run_check(suite_mod.check_copy_offsets_one_device, backend)
        return
    copied = "off_w" if kind == "long" else "off_x"  # an overrun shows on the node behind off_w
    with pytest.raises(AssertionError, match=rf"device_to_device of {copied}.* from offset [1-9]"):
        run_check(suite_mod.check_copy_offsets_one_device, backend)


@pytest.mark.parametrize("kind", ["good", "free"])
def test_opencl_free(kind: str) -> None:
    backend = _opencl(kind)
    if kind == "good":
        run_check(suite_mod.check_free_returns_memory, backend)
        return
    with pytest.raises(AssertionError, match=r"its free\(\) does not release pools"):
        run_check(suite_mod.check_free_returns_memory, backend)
