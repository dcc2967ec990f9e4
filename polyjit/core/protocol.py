"""The runtime protocols, after OCANNL's backend interface.

Two layers:
- the public objects users hold: Backend, Device, Stream, Event, Context, Routine
  (``core/runtime.py`` implements them once, for every backend);
- the ``Driver`` a backend author writes: a small set of primitives (allocate,
  copy, streams, events, compile, load, launch) plus a codegen ``Dialect``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np

from polyjit.alloc.slab import BufferLoc
from polyjit.core.codegen import Dialect, KernelSpec, Source
from polyjit.core.ir import Node, StaticSymbol


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
    properties: Mapping[str, Any] = attrs.field(factory=dict)


# ---------------------------------------------------------------------------
# What a backend author implements


@runtime_checkable
class Driver(Protocol):
    """The primitives of one backend. Handles (pools, streams, events, modules) are opaque to
    the runtime; it only passes them back. Streams are in-order queues; every operation that
    takes a stream is enqueued on it and returns without waiting."""

    name: str

    @property
    def dialect(self) -> Dialect: ...

    # devices
    def device_count(self) -> int: ...
    def device_info(self, ordinal: int) -> DeviceInfo: ...

    # memory: one allocation per pool
    def alloc(self, ordinal: int, nbytes: int, alignment: int) -> Any: ...
    def free(self, ordinal: int, pool: Any) -> None: ...

    # streams and events
    def new_stream(self, ordinal: int) -> Any: ...
    def record(self, stream: Any) -> Any: ...
    def wait(self, stream: Any, event: Any) -> None: ...
    def event_done(self, event: Any) -> bool: ...
    def event_sync(self, event: Any) -> None: ...

    # transfers, enqueued on a stream. copy_from_host keeps ``array`` alive until it is read.
    def memset_zero(self, stream: Any, pool: Any, offset: int, nbytes: int) -> None: ...
    def copy_from_host(self, stream: Any, pool: Any, offset: int, array: np.ndarray) -> None: ...
    def copy_to_host(self, stream: Any, pool: Any, offset: int, array: np.ndarray) -> None: ...
    def copy_device(
        self, stream: Any, dst: tuple[int, Any, int], src: tuple[int, Any, int], nbytes: int
    ) -> None:
        """Copy between two devices of this backend (or within one): (ordinal, pool, offset)."""
        ...

    # code
    def compile(self, source: Source) -> Any:
        """Source -> a binary; must be cached by content (see core/cache.py)."""
        ...

    def load(self, ordinal: int, binary: Any) -> Any: ...
    def prepare(
        self, ordinal: int, module: Any, kernels: Sequence[tuple[KernelSpec, Sequence[tuple[Any, int]]]]
    ) -> Any:
        """Bind each kernel to its buffers, (pool, offset) per parameter, merge buffer last.
        The result is launched many times with different statics."""
        ...

    def launch(self, stream: Any, prepared: Any, statics: Sequence[int]) -> None: ...


# ---------------------------------------------------------------------------
# What users hold


class Event(Protocol):
    def sync(self) -> None: ...
    def is_done(self) -> bool: ...


class Stream(Protocol):
    device: Device

    def record(self) -> Event: ...
    def wait(self, event: Event) -> None: ...
    def synchronize(self) -> None: ...


class Routine(Protocol):
    context: Context
    name: str
    inputs: frozenset[Node]
    outputs: frozenset[Node]
    merge_buffer_input: Node | None
    bindings: dict[StaticSymbol, int]

    def run(self) -> None: ...


class Context(Protocol):
    device: Device
    stream: Stream
    parent: Context | None
    buffers: Mapping[Node, BufferLoc]

    def link(self, code: Any) -> Routine: ...
    def link_batch(self, batch: Any) -> list[Routine]: ...
    def from_host(self, node: Node, array: np.ndarray) -> bool: ...
    def to_host(self, node: Node, array: np.ndarray) -> bool: ...
    def init_from_host(self, node: Node, array: np.ndarray) -> Context: ...
    def read(self, node: Node) -> np.ndarray: ...
    def with_stream(self, stream: Stream) -> Context: ...
    def will_wait_for(self, event: Event) -> None: ...
    def finalize(self) -> None:
        """Free the pools this context and its descendants created (never its ancestors');
        using any of them afterwards raises FinalizedError."""
        ...


class Device(Protocol):
    ordinal: int
    device_id: str
    name: str
    properties: Mapping[str, Any]

    def new_stream(self) -> Stream: ...
    def make_context(self, stream: Stream | None = None) -> Context: ...
    def all_work(self) -> Event: ...
    def synchronize(self) -> None: ...
    def is_idle(self) -> bool: ...
    def used_memory(self) -> int: ...
    def alloc_pool(self, pool_id: int, nbytes: int, alignment: int) -> None: ...
    def free_pool(self, pool_id: int) -> None: ...
    def memset_zero(self, pool_id: int, offset: int, nbytes: int) -> None: ...


class Backend(Protocol):
    name: str

    def num_devices(self) -> int: ...
    def get_device(self, ordinal: int) -> Device: ...
    def compile(self, comp: Any, name: str | None = None, bindings: Any = None) -> Any: ...
    def compile_batch(self, comps: Sequence[Any], names: Sequence[str] | None = None, occupancy: Any = None) -> Any: ...
    def static_properties(self) -> Mapping[str, Any]: ...
