"""polyjit: a multi-backend device layer.

Write a program once as assignments over tensor nodes (``polyjit.ir``), compile
it for a backend (``cpu``, ``opencl``, ``cuda``), link it into a context on the
device you choose, and run it; move data between devices with
``device_to_device`` and merge buffers.
"""

from polyjit.backends import (
    available_backends,
    default_device,
    device,
    get_backend,
    register_backend,
    set_default_device,
)
from polyjit.core import ir
from polyjit.core.errors import (
    AliasedMemoryError,
    BackendUnavailableError,
    BindingError,
    CollectiveMismatchError,
    CollectiveRefusedError,
    CollectiveTimeoutError,
    CompileError,
    DTypeMismatchError,
    FinalizedError,
    ForkedError,
    IndexOutOfRangeError,
    InvalidProgramError,
    MergeBufferMismatchError,
    NodeNotInContextError,
    PolyjitError,
    PoolExhaustedError,
    ShapeMismatchError,
    StateDictKeyError,
    SymbolicTensorError,
    UnknownBackendError,
    UnknownDeviceError,
    UnsupportedError,
    ValueRangeError,
)
from polyjit.core.ir import AccumOp, Comp, MemoryMode, Node, Op, StaticSymbol, Symbol
from polyjit.core.protocol import MergeBuffer
from polyjit.core.runtime import device_to_device, init_from_device

__version__ = "0.1.0"

__all__ = [
    "AccumOp",
    "AliasedMemoryError",
    "BackendUnavailableError",
    "BindingError",
    "CollectiveMismatchError",
    "CollectiveRefusedError",
    "CollectiveTimeoutError",
    "Comp",
    "CompileError",
    "DTypeMismatchError",
    "FinalizedError",
    "ForkedError",
    "IndexOutOfRangeError",
    "InvalidProgramError",
    "MemoryMode",
    "MergeBuffer",
    "MergeBufferMismatchError",
    "Node",
    "NodeNotInContextError",
    "Op",
    "PolyjitError",
    "PoolExhaustedError",
    "ShapeMismatchError",
    "StateDictKeyError",
    "StaticSymbol",
    "Symbol",
    "SymbolicTensorError",
    "UnknownBackendError",
    "UnknownDeviceError",
    "UnsupportedError",
    "ValueRangeError",
    "available_backends",
    "default_device",
    "device",
    "device_to_device",
    "get_backend",
    "init_from_device",
    "ir",
    "register_backend",
    "set_default_device",
]
