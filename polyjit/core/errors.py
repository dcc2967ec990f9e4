"""The error hierarchy. Every error polyjit raises on purpose derives from PolyjitError.

Each subclass also derives from the builtin exception a Python user would
expect (KeyError for a missing node, MemoryError for an exhausted pool, ...),
so generic handlers keep working.
"""

from __future__ import annotations


class PolyjitError(Exception):
    """Base class of all polyjit errors."""


class InvalidProgramError(PolyjitError, ValueError):
    """The IR itself is malformed: bad projections, unknown op, an index out of bounds."""


class ShapeMismatchError(PolyjitError, ValueError):
    """An array or node has the wrong shape for where it is used."""


class DTypeMismatchError(PolyjitError, TypeError):
    """An array or node has the wrong dtype for where it is used."""


class UnsupportedError(PolyjitError, NotImplementedError):
    """The operation is valid but this backend or device cannot do it (float64 without fp64, ...)."""


class UnknownBackendError(PolyjitError, LookupError):
    """No backend of that name is registered."""


class BackendUnavailableError(PolyjitError, RuntimeError):
    """The backend is registered but cannot run here (no driver, no platform, ...)."""


class UnknownDeviceError(PolyjitError, LookupError):
    """A device ordinal outside the backend's range."""


class NodeNotInContextError(PolyjitError, KeyError):
    """A node that a routine or transfer needs has no buffer in the context."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class MergeBufferMismatchError(PolyjitError, ValueError):
    """A routine reads the merge buffer expecting one node, but it holds another (or none)."""


class CompileError(PolyjitError, RuntimeError):
    """The backend's compiler rejected generated source. The message holds the log and the lines."""

    def __init__(self, message: str, *, source: str = "", log: str = "") -> None:
        super().__init__(message)
        self.source = source
        self.log = log


class PoolExhaustedError(PolyjitError, MemoryError):
    """A pool allocation does not fit in the device's memory."""


class FinalizedError(PolyjitError, RuntimeError):
    """A context (or a routine linked into it) was used after finalize()."""


class BindingError(PolyjitError, ValueError):
    """A static-symbol binding is missing or out of its range."""


class StreamClosedError(FinalizedError):
    """Work was enqueued on a stream after ``Stream.close()``."""


class ForkedError(StreamClosedError):
    """A device (one of its streams or contexts) made before ``os.fork()`` was used in the
    child: the driver's threads and queues it ran on stayed in the parent. Get the device
    again in the child (``polyjit.device``, ``get_backend``): that one works."""


class DriverError(PolyjitError, RuntimeError):
    """A driver call failed when it was made (the message names the device and the operation)."""


class DeviceFaultError(PolyjitError, RuntimeError):
    """Work already enqueued failed on the device (a faulting kernel, a lost device), reported
    at the next sync of its stream, naming the routines that were in flight. That stream stays
    faulted; other streams and devices keep working."""


class ReadOnlyNodeError(PolyjitError, ValueError):
    """A write (a routine's output, from_host, a copy) into a read-only constant node."""


class InvalidArgumentError(PolyjitError, TypeError):
    """An argument of the wrong kind: a CodeBatch where one Code is expected, a binding that is
    not an integer, an array where a node is expected."""


class IndexOutOfRangeError(PolyjitError, IndexError):
    """An index is outside the axis it indexes: one fed from the host (a class label of
    ``cross_entropy``, an index of ``one_hot`` or ``embedding`` that is negative or at least the
    number of classes, the vocabulary size; checked on the host before the copy to the device),
    or an integer of ``x[k]`` when the expression is built."""


class AliasedMemoryError(PolyjitError, ValueError):
    """``init_from_dlpack`` would give a node memory that another node of the context already
    uses (the same tensor imported twice, or a polyjit export taken back in as another node).
    Kernels assume distinct nodes never overlap (their pointers are ``restrict``, and fusion
    reorders and merges work on distinct nodes): use the one node."""


class ValueRangeError(PolyjitError, ValueError):
    """A value does not fit the dtype it is given to: an integer outside the dtype's range, a
    non-integral (or NaN, or infinite) float for an integer tensor."""


class SymbolicTensorError(PolyjitError, TypeError):
    """A symbolic tensor was used where values are needed (``np.asarray``, ``bool()``,
    ``float()``, a numpy function): a tensor has values only once a plan runs it."""


class StateDictKeyError(PolyjitError, KeyError):
    """A state dict names a parameter (or optimizer state) that the plan does not have, or lacks
    one that it has."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class CollectiveTimeoutError(PolyjitError, TimeoutError):
    """A collective (or a send / recv) of ``polyjit.distributed`` did not complete before its
    deadline. The message names the collective, the node and the ranks that did not join
    (``missing``); an empty ``missing`` means every rank joined but the data did not arrive.
    MPI cannot cancel a collective: the communicator cannot be used again."""

    def __init__(self, message: str, *, collective: str = "", node: str = "",
                 missing: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.collective = collective
        self.node = node
        self.missing = tuple(missing)


class CollectiveMismatchError(PolyjitError, ValueError):
    """The ranks called a collective (or a send and its recv) with different shapes, dtypes,
    ops or roots, or called different collectives: raised on every rank taking part, before
    any data moves."""


class CollectiveRefusedError(CollectiveMismatchError):
    """Another rank could not take part in a collective (or in the other side of a send /
    recv): its own arguments were wrong, or preparing the call failed there (a device fault in
    the node's writer, a bad input to a data-parallel step). Raised on every other rank of the
    call, after the join and before any data moves; the failing rank raises its own error, and
    the communicator stays usable. ``ranks``: the ranks that refused; ``collective``: the call."""

    def __init__(self, message: str, *, collective: str = "", ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.collective = collective
        self.ranks = tuple(ranks)
