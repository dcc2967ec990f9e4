"""``polyjit.distributed``: collectives on context nodes and data parallel across processes,
over mpi4py (``pip install 'polyjit[mpi]'``; see docs/distributed.md).

>>> from polyjit.distributed import Comm                  # doctest: +SKIP
>>> comm = Comm()                                          # over MPI.COMM_WORLD
>>> comm.all_reduce(ctx, grads, "sum")                     # ordered by the node's events
>>> dp = pt.data_parallel(step, inputs, optimizer=opt, devices="cpu", comm=comm)

Importing this package imports mpi4py (and so initializes MPI) and installs the excepthook
that aborts the whole job when one rank raises (``POLYJIT_MPI_ABORT=0`` opts out; see
``abort.py``). ``import polyjit`` alone never imports mpi4py.
"""

import threading

from mpi4py import MPI

from polyjit.core.errors import (
    CollectiveMismatchError,
    CollectiveRefusedError,
    CollectiveTimeoutError,
)
from polyjit.distributed.abort import (
    enabled_by_environment,
    excepthook_installed,
    install_excepthook,
    tagged_traceback,
    uninstall_excepthook,
)
from polyjit.distributed.comm import (
    DEFAULT_TIMEOUT,
    Comm,
    default_timeout,
    set_default_timeout,
)
from polyjit.distributed.cuda import mpi_cuda_aware
from polyjit.distributed.header import OPS
from polyjit.distributed.launch import (
    MpiexecNotFoundError,
    bind_to_cores,
    find_mpiexec,
    local_rank,
    mpiexec_command,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "MPI",
    "OPS",
    "CollectiveMismatchError",
    "CollectiveRefusedError",
    "CollectiveTimeoutError",
    "Comm",
    "MpiexecNotFoundError",
    "bind_to_cores",
    "default_timeout",
    "excepthook_installed",
    "find_mpiexec",
    "install_excepthook",
    "local_rank",
    "mpi_cuda_aware",
    "mpiexec_command",
    "set_default_timeout",
    "tagged_traceback",
    "uninstall_excepthook",
    "world",
]

_world: Comm | None = None
_world_lock = threading.Lock()


def world() -> Comm:
    """A Comm over MPI.COMM_WORLD, made on first use (collective: every rank calls it first
    at the same point) and shared; threads that ask at once get the same one."""
    global _world
    with _world_lock:
        if _world is None:
            _world = Comm()
        return _world


if enabled_by_environment():
    install_excepthook()
