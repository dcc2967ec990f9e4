"""The generic runtime: raises a backend's ``Driver`` into the full Backend / Device / Stream /
Event / Context / Routine objects.

Everything a backend would otherwise write again lives here, once: contexts, linking and
host transfers (``core/context.py``), routines, replays and device_to_device
(``core/routine.py``), devices with their slab pools, constants, modules and merge buffer
(``core/device.py``), streams, events, per-node events and the lifetimes of queued work
(``core/streams.py``), users' own kernels (``core/raw.py``), compile caching
(``core/compile_cache.py``). This module holds the Backend and is where users import the
runtime's names from.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from polyjit.core import ir
from polyjit.core.codegen import Dialect, Source, generate
from polyjit.core.context import Context
from polyjit.core.device import Device, LoadedModule, driver_call
from polyjit.core.dtypes import is_int
from polyjit.core.errors import (
    BindingError,
    InvalidArgumentError,
    InvalidProgramError,
    StreamClosedError,
    UnknownDeviceError,
)
from polyjit.core.ir import Node, StaticSymbol, Symbol
from polyjit.core.log import log_source
from polyjit.core.loops import Kernel, Load
from polyjit.core.lower import lower
from polyjit.core.patterns import plan_kernel, row_fusable, segmentable, transposable_contraction
from polyjit.core.protocol import Driver
from polyjit.core.raw import Param, raw_code
from polyjit.core.routine import (
    Code,
    CodeBatch,
    Replay,
    Routine,
    TransferRoutine,
    check_binding,
    check_takes,
    device_to_device,
    init_from_device,
)
from polyjit.core.streams import AllOf, Event, Stream

__all__ = [
    "AllOf",
    "Backend",
    "Code",
    "CodeBatch",
    "Context",
    "Device",
    "Event",
    "LoadedModule",
    "Replay",
    "Routine",
    "Stream",
    "TransferRoutine",
    "device_to_device",
    "init_from_device",
]

_IDENT = re.compile(r"[^A-Za-z0-9_]")
_ASSIGNMENTS = (ir.Accum, ir.Fetch, ir.Seq, ir.Block)


def _c_name(name: str, taken: set[str]) -> str:
    """A computation's name as a short identifier, unique in its batch (codegen makes the
    kernel names it derives safe against macros and headers)."""
    base = _IDENT.sub("_", name) or "comp"
    if base[0].isdigit():
        base = "k_" + base
    if len(base) > 64:  # keep routine names and messages short; the hash keeps them distinct
        base = f"{base[:48]}_{hashlib.sha256(name.encode(errors='replace')).hexdigest()[:12]}"
    out, k = base, 1
    while out in taken:
        out, k = f"{base}_{k}", k + 1
    taken.add(out)
    return out


def _as_comp(comp: Any, k: int) -> ir.Comp:
    """A computation; one assignment is a computation of one assignment."""
    if isinstance(comp, ir.Comp):
        return comp
    if isinstance(comp, _ASSIGNMENTS):
        return ir.Comp.of(comp)
    raise InvalidArgumentError(
        f"computation {k} is a {type(comp).__name__}; compile takes an ir.Comp or one assignment "
        "(ir.Accum, ir.Fetch, ir.Seq, ir.Block)")


def _transposed_y(k: Kernel, dialect: Dialect) -> tuple[Load, Symbol, Symbol] | None:
    c = transposable_contraction(k, dialect)
    return None if c is None else (c.y, c.k, c.j)


def _after_fork_in_child() -> None:
    for backend in list(_BACKENDS):
        backend.after_fork_in_child()


_BACKENDS: weakref.WeakSet[Backend] = weakref.WeakSet()  # every Backend made: for the fork and exit hooks


def live_backends() -> list[Backend]:
    return list(_BACKENDS)

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Backend:
    """A backend: its devices and its compiler, over one Driver."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_takes(cls, "capture", ("inputs", "outputs"),
                    "capture(routines, *, stream=None, inputs=(), outputs=()), passing them to Replay")

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.name: str = driver.name
        self._devices: dict[int, Device] = {}
        self._lock = threading.Lock()
        self._compiles = threading.Condition()  # guards the two below
        self._compiling = 0  # driver compiles under way (a daemon thread's, at exit)
        self._exiting = False
        # The driver handles of the streams its devices made and did not close themselves: a
        # pool of a device gone in a garbage cycle waits for them (Driver.free_when_idle)
        self.stream_handles: set[Any] = set()
        _BACKENDS.add(self)

    def driver_compile(self, what: str, source: Source) -> Any:
        """``driver.compile(source)``, refused once the process is exiting (an exit hook waits
        for compiles under way: a thread inside the driver's compiler while its library's exit
        code ran crashed the process)."""
        with self._compiles:
            if self._exiting:
                raise StreamClosedError(f"backend {self.name}: {what} refused: the process is exiting")
            self._compiling += 1
        try:
            return driver_call(f"backend {self.name}", what, self.driver.compile, source)
        finally:
            with self._compiles:
                self._compiling -= 1
                self._compiles.notify_all()

    def close_compiles_at_exit(self, deadline: float) -> None:
        """For an exit hook: refuse new compiles, and wait for those under way until ``deadline``
        (``time.monotonic()``)."""
        with self._compiles:
            self._exiting = True
            while self._compiling and time.monotonic() < deadline:
                self._compiles.wait(deadline - time.monotonic())

    @property
    def unavailable_reason(self) -> str | None:
        """Why this backend has no devices here (None when it has some, or cannot say)."""
        return getattr(self.driver, "unavailable_reason", None)

    def num_devices(self) -> int:
        return int(driver_call(f"backend {self.name}", "device_count", self.driver.device_count))

    def get_device(self, ordinal: int) -> Device:
        n = self.num_devices()
        if n == 0:
            reason = self.unavailable_reason or "the driver reports none"
            raise UnknownDeviceError(f"{self.name} has no devices here: {reason}")
        if not is_int(ordinal) or not 0 <= ordinal < n:
            raise UnknownDeviceError(
                f"{self.name} has {n} device(s) (ordinals 0..{n - 1}); there is no device {ordinal!r}"
            )
        with self._lock:
            dev = self._devices.get(int(ordinal))
            if dev is None:
                dev = self._devices[int(ordinal)] = Device(self, int(ordinal))
        return dev

    def after_fork_in_child(self) -> None:
        """This process is a fork of the one that made the backend: its devices refuse work
        (Device.after_fork_in_child)."""
        self._lock = threading.Lock()
        self._compiles = threading.Condition()  # the parent's compiles under way are not this process's
        self._compiling = 0
        for dev in self._devices.values():
            dev.after_fork_in_child()

    def close(self) -> None:
        """Close every device made so far (see Device.close): for a Backend made for a while
        over a driver that outlives it."""
        with self._lock:
            made = list(self._devices.values())
            self._devices.clear()
        for dev in made:
            dev.close()

    def devices(self) -> list[Device]:
        return [self.get_device(k) for k in range(self.num_devices())]

    def static_properties(self) -> dict[str, Any]:
        return {"name": self.name, "dialect": self.driver.dialect.name, "num_devices": self.num_devices()}

    def capture(self, routines: Sequence[Routine], *, stream: Stream | None = None,
                inputs: Sequence[Node] = (), outputs: Sequence[Node] = ()) -> Replay:
        """Routines to run again and again as one unit, in this order: ``replay()`` does what
        ``run()`` of each would, in one enqueue. Here that is all it does; a backend with
        something cheaper to launch overrides it (CUDA records a graph: ``CudaBackend.capture``).
        ``stream``: where to replay (default: the first routine's context stream).
        ``inputs`` (nodes of the first routine's context) and ``outputs`` (of the last's):
        what ``replay(inputs, outputs)`` copies in from host arrays before the routines and out
        into host arrays after them (a training step's batch and loss), in the same enqueue."""
        return Replay(routines, stream, inputs, outputs)

    def compile(
        self, comp: ir.Comp | ir.Assignment, name: str | None = None,
        bindings: Mapping[StaticSymbol, int] | None = None
    ) -> Code:
        """Compile one computation (or one assignment) into a Code to link."""
        batch = self.compile_batch([comp], names=[name or "comp"], bindings=[bindings or {}])
        return Code(batch, 0)

    def compile_batch(
        self,
        comps: Sequence[ir.Comp | ir.Assignment],
        names: Sequence[str] | None = None,
        occupancy: Callable[[str], bool] | None = None,
        bindings: Sequence[Mapping[StaticSymbol, int]] | None = None,
    ) -> CodeBatch:
        """Compile several computations into one source and one binary.

        ``occupancy(name)`` returning False leaves that computation out (the
        batch keeps the others, in order).
        """
        if isinstance(comps, (ir.Comp, *_ASSIGNMENTS)) or not isinstance(comps, Sequence):
            raise InvalidArgumentError(f"compile_batch takes a sequence of computations, not {type(comps).__name__}")
        comp_list = [_as_comp(c, k) for k, c in enumerate(comps)]
        names = list(names) if names is not None else [f"comp{k}" for k in range(len(comp_list))]
        if len(names) != len(comp_list):
            raise InvalidProgramError(f"{len(comp_list)} computations but {len(names)} names")
        if any(not isinstance(n, str) for n in names):
            raise InvalidArgumentError(f"computation names must be strings: {names!r}")
        bindings = list(bindings) if bindings is not None else [{} for _ in comp_list]
        if len(bindings) != len(comp_list):
            raise InvalidProgramError(f"{len(comp_list)} computations but {len(bindings)} binding maps")
        if any(not isinstance(b, Mapping) for b in bindings):
            raise BindingError(f"bindings are one mapping (ir.StaticSymbol -> int) per computation: {bindings!r}")
        checked = [{s: check_binding(f"compile of {names[k]}", s, v) for s, v in dict(b).items()}
                   for k, b in enumerate(bindings)]
        if occupancy is not None and not callable(occupancy):
            raise InvalidArgumentError(f"compile_batch: occupancy is a function of a name, not {occupancy!r}")
        keep = [k for k, n in enumerate(names) if occupancy is None or occupancy(n)]
        taken: set[str] = set()
        c_names = tuple(_c_name(names[k], taken) for k in keep)
        dialect = self.driver.dialect
        tiled = (lambda k: plan_kernel(k, dialect).contraction is not None) if dialect.matmul_epilogues else None
        lowered = lower([comp_list[k] for k in keep], c_names, epilogues=tiled,
                        rows=lambda k: row_fusable(k, dialect), segments=lambda k: segmentable(k, dialect),
                        scatter_scan=dialect.scatter_scan, transposes=lambda k: _transposed_y(k, dialect))
        source = generate(lowered, dialect)
        log_source(f"{self.name} batch {', '.join(c_names[:3])}{'...' if len(c_names) > 3 else ''}", source.text,
                   {"c": ".c", "opencl": ".cl", "cuda": ".cu"}.get(source.dialect, ".txt"))
        binary = self.driver_compile("compile", source)
        return CodeBatch(self, lowered, source, binary, c_names, tuple(checked[k] for k in keep))

    def raw_kernel(
        self,
        source: str | os.PathLike[str],
        name: str,
        params: Sequence[Param | tuple[ir.Node, str]],
        *,
        global_size: int | Sequence[int] | None = None,
        local_size: int | Sequence[int] | None = None,
        statics: Sequence[StaticSymbol] = (),
        bindings: Mapping[StaticSymbol, int] | None = None,
    ) -> Code:
        """A Code from your own kernel source (C for cpu, OpenCL C, CUDA C ``extern "C"
        __global__``), like CuPy's ``RawKernel`` and pyopencl's ``Program``: ``Context.link``
        takes it like generated code, and its routine is ordered by the per-node events.

        ``source``: the text, or a path to read it from. ``name``: the kernel (a C
        identifier). ``params``: its buffer parameters in order, each a node with its access
        (``raw.read(x)``, ``raw.write(y)``, ``raw.read_write(z)`` or ``(x, "r")``); nodes it
        reads must be in the context it is linked into, new nodes it writes get buffers
        there. ``statics``: int64 parameters after the buffers (``routine.bindings`` sets
        them). ``global_size`` / ``local_size``: work-items in all and per work-group (CUDA:
        threads per block; grid = global / local); on cpu the function runs once per launch
        and the shape is not used. See docs/raw-kernels.md."""
        return raw_code(self, source, name, params, global_size=global_size, local_size=local_size,
                        statics=statics, bindings=bindings)

    def __repr__(self) -> str:
        return f"Backend({self.name})"
