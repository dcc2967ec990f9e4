"""Node buffers for other libraries and theirs for polyjit: DLPack both ways, and
``__cuda_array_interface__`` on CUDA.

``Context.export(node)`` gives an :class:`Exported` view of the node's buffer, zero-copy:
its ``__dlpack__`` orders the consumer after the node's last writer (on the host, a sync;
on CUDA, the consumer's stream waits for it), and it keeps the buffer's pool alive while
it (or a capsule made from it) lives, even if the context is finalized. What the consumer
writes through the view after that is the consumer's to order, as with CuPy's exports.

``Context.init_from_dlpack(node, obj)`` takes another library's tensor into a child
context: zero-copy when it lives on this device, is C-contiguous and aligned as polyjit's
kernels need; a host tensor for another device is copied; anything else is a typed error.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from polyjit.core import dlpack
from polyjit.core.errors import (
    AliasedMemoryError,
    DTypeMismatchError,
    InvalidArgumentError,
    ShapeMismatchError,
    UnsupportedError,
)
from polyjit.core.ir import Node
from polyjit.core.slab import BufferLoc

if TYPE_CHECKING:
    from polyjit.core.context import Context
    from polyjit.core.streams import Event

__all__ = ["Exported", "dlpack_device", "export", "host_view", "init_from_dlpack"]


def dlpack_device(ctx: Context) -> tuple[int, int]:
    """Where ``ctx``'s buffers are, as DLPack says it; UnsupportedError where another library
    cannot address them (OpenCL)."""
    fn = getattr(ctx.device.driver, "dlpack_device", None)
    where = fn(ctx.device.ordinal) if fn is not None else None
    if where is None:
        raise UnsupportedError(
            f"{ctx.device.device_id} ({ctx.device.name}): the {ctx.device.backend.name} backend's memory has no "
            "address another library can use (no DLPack device); read it with to_host instead")
    return (int(where[0]), int(where[1]))


class _Pin:
    """A pool kept allocated for an export and every view made of it: the views (numpy's,
    torch's, through the capsule's owner) hold the pin, not the export, so the pool is
    unpinned once the export is released or dropped *and* every view is gone (found by
    review: ``release()``, and ``host_view``'s end, unpinned under live views, and reading
    one after ``finalize()`` crashed)."""

    __slots__ = ("device", "pool")

    def __init__(self, device: Any, pool: int) -> None:
        self.device, self.pool = device, pool

    def __del__(self) -> None:
        """The garbage collector may run anywhere, a thread holding a stream's lock included:
        the unpin waits for the device's next safe point, as every dropped object's release
        does (taking the device lock here deadlocked, or freed a pool twice)."""
        self.device.release_later(functools.partial(self.device.unpin, self.pool))


class Exported:
    """A node's buffer as other libraries see it (DLPack; on CUDA, __cuda_array_interface__)."""

    def __init__(self, ctx: Context, node: Node, *, read_only: bool | None = None) -> None:
        """``read_only`` (default: whether the node is read-only in ``ctx``, a constant say):
        the consumer is told so (DLPack's flag, numpy's writeable flag, the CUDA array
        interface's), and a consumer that cannot be told gets a BufferError."""
        self._pin: _Pin | None = None
        ctx.check_alive()
        loc = ctx.loc(node, "export")  # a Node of the context, first
        self.node, self.context = node, ctx
        self.read_only = node in ctx.read_only if read_only is None else read_only
        self.shape, self.dtype = node.shape, node.dtype
        self.device_type, self.device_id = dlpack_device(ctx)
        device = ctx.device
        with device.lock:
            ctx.check_alive()  # again, under the lock: a finalize() in between freed the pool
            if device.released:  # a safe point: dropped exports' unpins (a loop that only exports grew them)
                device.reap()
            self.address = int(device.driver.address(device.pool_handle(loc.pool_id), loc.offset))  # type: ignore[attr-defined]
            self._loc = loc
            device.pin(loc.pool_id)
            self._pin = _Pin(device, loc.pool_id)

    def _writer(self) -> Event | None:
        """The node's last writer now. Found by review: the writer seen at export was kept, so
        a view taken after a later run of a routine writing the node was handed over while
        that write still ran (every time, in the review's script)."""
        device = self.context.device
        with device.lock:
            st = device.tracker.locs.get(self._loc)
            return st.writer if st is not None else None

    def _ordered(self, stream: int | None) -> None:
        """The consumer sees the node's last write: its stream waits (CUDA) or the host does."""
        writer = self._writer()
        if writer is None or writer.is_done():
            return
        wait = getattr(self.context.device.driver, "wait_foreign", None)
        if self.device_type == dlpack.CUDA and stream not in (None, -1) and wait is not None:
            wait(self.context.device.ordinal, int(stream), writer.handle)
        else:
            writer.synchronize()

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self.device_type, self.device_id)

    def __dlpack__(self, *, stream: int | None = None, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> Any:
        if copy:
            raise BufferError("polyjit exports its buffers without copies (copy=True asked for one)")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"the buffer is on DLPack device {self.__dlpack_device__()}, not {tuple(dl_device)}")
        pin = self._live_pin()
        self._ordered(stream)
        versioned = max_version is not None and max_version[0] >= 1
        return dlpack.make_capsule(self.address, self.shape, self.dtype, self.__dlpack_device__(), pin, versioned,
                                   self.read_only)

    def _live_pin(self) -> _Pin:
        pin = self._pin
        if pin is None:
            raise BufferError(f"{self!r} was released: export the node again")
        return pin

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if self.device_type != dlpack.CUDA:
            raise AttributeError("__cuda_array_interface__: the buffer is not in CUDA device memory")
        self._live_pin()
        self._ordered(None)
        return {"shape": self.shape, "typestr": np.dtype(self.dtype.np).str, "data": (self.address, self.read_only),
                "version": 3, "strides": None, "stream": None}

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """Host memory only: a numpy view of the buffer (``copy=True``: a copy)."""
        if self.device_type != dlpack.CPU:
            raise UnsupportedError("only a buffer in host memory converts to numpy without a copy; "
                                   "use Context.read (or to_host)")
        pin = self._live_pin()
        self._ordered(None)
        if self.dtype.name == "bfloat16":  # numpy's from_dlpack has no bfloat16: wrap the memory
            nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
            raw = (ctypes.c_ubyte * nbytes).from_address(self.address)
            raw._owner = pin  # type: ignore[attr-defined]  # the view keeps the pool alive
            view = np.frombuffer(memoryview(raw), dtype=self.dtype.np).reshape(self.shape)
        else:
            view = np.from_dlpack(self)
        if self.read_only:
            view.flags.writeable = False
        if dtype is not None:
            view = view.astype(dtype, copy=bool(copy))
        return view.copy() if copy else view

    def release(self) -> None:
        """This export is done with: its pool is unpinned once no view made of it remains
        (a view keeps the pool; a later __dlpack__ of this export is refused)."""
        self._pin = None

    def __repr__(self) -> str:
        return f"Exported({self.node.label} {self.shape} {self.dtype} on {self.context.device.device_id})"


def export(ctx: Context, node: Node) -> Exported:
    return Exported(ctx, node)


def init_from_dlpack(ctx: Context, node: Node, obj: Any) -> Context:
    """A child of ``ctx`` whose buffer for ``node`` is ``obj``'s memory (see the module
    docstring for when it is a copy)."""
    ctx.check_alive()
    if not isinstance(node, Node):
        raise InvalidArgumentError(f"init_from_dlpack needs a Node first, got {type(node).__name__}")
    device = ctx.device
    stream_of = getattr(device.driver, "foreign_stream", None)
    consumer = stream_of(ctx.stream.handle) if stream_of is not None else None
    try:
        taken: dlpack.Imported | None = dlpack.take_capsule(obj, stream=consumer)
    except DTypeMismatchError as e:
        raise DTypeMismatchError(f"init_from_dlpack of {node.label}: {e}") from e
    assert taken is not None
    try:
        if taken.dtype != node.dtype:
            raise DTypeMismatchError(f"init_from_dlpack of {node.label}: the tensor is {taken.dtype}, the node {node.dtype}")
        if taken.shape != node.shape:
            raise ShapeMismatchError(f"init_from_dlpack of {node.label}: the tensor has shape {taken.shape}, "
                                     f"the node {node.shape}")
        if not taken.contiguous:
            raise ShapeMismatchError(f"init_from_dlpack of {node.label}: the tensor is not C-contiguous "
                                     f"(strides {taken.strides}); make it contiguous first")
        fn = getattr(device.driver, "dlpack_device", None)
        here = fn(device.ordinal) if fn is not None else None
        need = max(device.info.import_alignment or device.info.base_alignment, node.dtype.itemsize)
        aligned = taken.address % need == 0
        if here is not None and taken.device == tuple(here) and aligned and taken.nbytes:
            own = _place(ctx, node, taken.address, taken.nbytes)
            read_only = frozenset([node]) if taken.read_only else frozenset()  # no write may reach it
            if own is not None:  # the node's own memory back: the same buffer, its events and all
                return ctx._child({node: own}, read_only=read_only)
            handle = device.driver.wrap_address(device.ordinal, taken.address, taken.nbytes)  # type: ignore[attr-defined]
            pid = device.adopt_pool(handle, taken.nbytes, taken.release)
            taken = None  # the pool gives it back now
            return ctx._child({node: BufferLoc(pid, 0)}, own_pools=[pid], read_only=read_only)
        if taken.device[0] == dlpack.CPU:  # host memory: a copy into a new buffer
            host = np.empty(node.shape, node.dtype.np)
            if taken.nbytes:
                ctypes.memmove(host.ctypes.data, taken.address, taken.nbytes)
            return ctx.init_from_host(node, host)
        raise UnsupportedError(f"init_from_dlpack of {node.label}: the tensor is on DLPack device {taken.device}; "
                               f"{device.device_id} takes its own device's memory or host memory")
    finally:
        if taken is not None:
            taken.release()


def _place(ctx: Context, node: Node, address: int, nbytes: int) -> BufferLoc | None:
    """Where ``[address, address + nbytes)`` lies among ``ctx``'s buffers: the node's own
    buffer when it is exactly that (its own export taken again: found by review, adopted as a
    new pool it had events of its own, and a reader on another stream no longer waited for
    the parent's writer), else None; raise when it overlaps another node's buffer (two nodes
    on one memory would break every kernel's no-alias assumption)."""
    device = ctx.device
    own = None
    with device.lock:  # the pools must not be freed between the check and the lookups
        ctx.check_alive()  # a finalize() since the caller's check: FinalizedError, not "no pool (freed?)"
        for other, loc in ctx.buffers.items():
            if not other.nbytes:
                continue
            start = device.driver.address(device.pool_handle(loc.pool_id), loc.offset)  # type: ignore[attr-defined]
            if other is node:
                own = loc if start == address and nbytes == node.nbytes else None
            elif start < address + nbytes and address < start + other.nbytes:
                raise AliasedMemoryError(f"init_from_dlpack of {node.label} on {device.device_id}: the tensor's "
                                         f"memory overlaps {other.label}'s buffer in this context; use that node")
    return own


@contextlib.contextmanager
def host_view(ctx: Context, node: Node, *, write: bool = False) -> Iterator[np.ndarray]:
    """The node's values as a numpy array for the length of a ``with`` block, ordered by the
    per-node events: the block starts after the node's last writer (and, to write, after its
    readers too), and what it writes is what the next routine reads. Zero-copy where the
    device's memory is host memory (cpu); elsewhere a copy in and, to write, a copy back."""
    ctx.check_alive()
    loc = ctx.writable_loc(node, "host_view(write=True)") if write else ctx.loc(node, "host_view")
    device = ctx.device
    with device.lock:
        st = device.tracker.locs.get(loc)
        waits = ([] if st is None else st.events() if write else [st.writer] if st.writer else [])
    for ev in waits:
        ev.synchronize()
    fn = getattr(device.driver, "dlpack_device", None)
    if fn is not None and tuple(fn(device.ordinal)) == (dlpack.CPU, 0):
        exported = Exported(ctx, node, read_only=not write)  # a read's view is not a way to write
        try:
            yield np.asarray(exported)  # __array__: numpy's from_dlpack, or a wrap of bfloat16 memory
        finally:
            exported.release()  # the view, if the caller kept it, keeps the pool
        return
    values = ctx.read(node)
    values.flags.writeable = write  # as the zero-copy view: a read's copy is not a way to write
    yield values
    if write:
        ctx.from_host(node, values)
