"""The Driver contract: what a backend author implements.

A driver is a small set of primitives (allocate, copy, streams, events, compile,
load, launch) plus a codegen ``Dialect``; ``core/runtime.py`` raises it into the
objects users hold (Backend, Device, Stream, Event, Context, Routine), which are
the runtime's classes themselves. docs/writing-a-backend.md states what the
runtime guarantees a driver and what a driver may assume.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np

from polyjit.core.codegen import Dialect, KernelSpec, Source


class MergeBuffer(enum.Enum):
    """Where device_to_device puts the data: the node's own buffer, or the device's merge buffer."""

    NO = "no"
    COPY = "copy"


@attrs.frozen
class DeviceInfo:
    """What a driver reports about one device."""

    name: str
    memory_bytes: int
    compute_units: int
    base_alignment: int = 64  # bytes; every pool offset is a multiple of it
    # bytes; a foreign buffer (init_from_dlpack) at an address that is a multiple of this and
    # of its dtype's size is taken zero-copy (0: the base alignment)
    import_alignment: int = 0
    properties: Mapping[str, Any] = attrs.field(factory=dict)


@runtime_checkable
class Driver(Protocol):
    """The primitives of one backend. Handles (pools, streams, events, modules) are opaque to
    the runtime; it only passes them back. Streams are in-order queues; every operation that
    takes a stream is enqueued on it and returns without waiting.

    Lifetimes are the runtime's: whatever an enqueued operation reads or writes (the host
    array of a copy, the prepared launch, the module, the pools) stays alive until an event
    recorded after it completes. An enqueuing primitive may return a token (e.g. pyopencl's
    NannyEvent); the runtime keeps it alive just as long. A driver keeps no lifetimes of its
    own.

    Optional primitives (the runtime uses them when present; see :class:`DriverDefaults`):
    ``unload(ordinal, module)``, ``close_stream(stream)``, ``allocated_bytes(ordinal)``,
    ``raw_source(text, spec)`` (users' own kernels), ``discard_queued()`` (at exit: drop work
    not yet begun on every stream) and the attribute ``unavailable_reason``.
    """

    name: str

    @property
    def dialect(self) -> Dialect: ...

    # devices
    def device_count(self) -> int: ...
    def device_info(self, ordinal: int) -> DeviceInfo: ...

    # memory: one allocation per pool (never of zero bytes; need not be zeroed)
    def alloc(self, ordinal: int, nbytes: int, alignment: int) -> Any: ...
    def free(self, ordinal: int, pool: Any) -> None: ...

    # streams and events
    def new_stream(self, ordinal: int) -> Any: ...
    def record(self, stream: Any) -> Any: ...
    def wait(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait for ``event``, which may belong to another device of this
        backend (whose stream then runs a ``copy_device``)."""
        ...

    def event_done(self, event: Any) -> bool:
        """Whether the work before ``event`` is complete, device-to-host copies included: false
        until their bytes have landed in the host array."""
        ...

    def event_sync(self, event: Any) -> None:
        """Block until ``event`` is done (see event_done). Raise when that work failed on the
        device: the runtime reports it as a DeviceFaultError naming the routines in flight."""
        ...

    # transfers, enqueued on a stream; arrays are C-contiguous
    def memset_zero(self, stream: Any, pool: Any, offset: int, nbytes: int) -> Any: ...
    def copy_from_host(self, stream: Any, pool: Any, offset: int, array: np.ndarray) -> Any: ...
    def copy_to_host(self, stream: Any, pool: Any, offset: int, array: np.ndarray) -> Any: ...
    def copy_device(
        self, stream: Any, dst: tuple[int, Any, int], src: tuple[int, Any, int], nbytes: int
    ) -> Any:
        """Copy between two devices of this backend (or within one): (ordinal, pool, offset)."""
        ...

    # code
    def compile(self, source: Source) -> Any:
        """Source -> a binary, cached by content: give a ``core/compile_cache.CachingCompiler``
        subclass your uncached compile and let it key, verify, log and count."""
        ...

    def load(self, ordinal: int, binary: Any) -> Any: ...
    def prepare(
        self, ordinal: int, module: Any, kernels: Sequence[tuple[KernelSpec, Sequence[tuple[Any, int]]]]
    ) -> Any:
        """Bind each kernel to its buffers, (pool, offset) per parameter, merge buffer last.
        The result is launched many times with different statics. A kernel whose
        ``spec.plan.kind`` is ``core.raw.RAW`` is a user's own: bind its buffers as its source
        declares them (a typed pointer, pool base + offset; on OpenCL a sub-buffer), check its
        parameters where the platform can tell, and launch ``spec.launch`` exactly."""
        ...

    def launch(self, stream: Any, prepared: Any, statics: Sequence[int]) -> Any: ...


class DriverDefaults:
    """Defaults of the optional Driver primitives, for drivers with nothing to release."""

    unavailable_reason: str | None = None  # why device_count() is 0 here, when it is

    def unload(self, ordinal: int, module: Any) -> None:
        """Unload a module no routine and no queued launch uses any more."""

    def close_stream(self, stream: Any) -> None:
        """End a stream whose work is done (its worker thread, its driver queue)."""

    def raw_source(self: Driver, text: str, spec: KernelSpec) -> tuple[str, str]:
        """A user's kernel ``spec.name`` in ``text`` (``Backend.raw_kernel``): the source to
        compile and the name of its entry point. By default the dialect's binding
        (``Dialect.raw_binding``, the calling convention its kernels use); a driver that takes
        no users' kernels raises ``UnsupportedError`` here."""
        return self.dialect.raw_binding(text, spec)

    def allocated_bytes(self, ordinal: int) -> int | None:
        """Bytes the driver really holds in pools on this device (None: cannot tell). The
        conformance kit checks that freed pools come back."""
        return None
