"""CUDA-aware MPI: whether the MPI library reads and writes CUDA device memory itself.

``mpi_cuda_aware()`` asks the library (``MPIX_Query_cuda_support``: through mpi4py when it
exposes it, else through ctypes on the MPI library mpi4py loaded). ``POLYJIT_MPI_CUDA_AWARE``
(``0`` / ``1``) overrides the answer. When it is true and a node lives on a CUDA device, the
collectives hand ``Context.export(node)`` (``__dlpack__`` and ``__cuda_array_interface__``)
to mpi4py instead of staging the node through host memory.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from polyjit.core.context import Context

ENV = "POLYJIT_MPI_CUDA_AWARE"


@functools.cache
def _library_answer() -> bool:
    from mpi4py import MPI

    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query())
        except Exception:  # pragma: no cover - an MPI without the extension
            return False
    try:
        lib = ctypes.CDLL(MPI.__file__)  # dlsym searches the module's MPI library too
        fn = lib.MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return False
    fn.restype = ctypes.c_int
    fn.argtypes = []
    try:
        return bool(fn())
    except Exception:  # pragma: no cover
        return False


def mpi_cuda_aware() -> bool:
    """Whether MPI can read and write CUDA device memory (``POLYJIT_MPI_CUDA_AWARE`` overrides)."""
    forced = os.environ.get(ENV, "").strip().lower()
    if forced in ("1", "true", "yes", "on"):
        return True
    if forced in ("0", "false", "no", "off"):
        return False
    return _library_answer()


def on_cuda(ctx: Context) -> bool:
    """Whether the context's buffers are CUDA device memory (DLPack device kDLCUDA)."""
    fn: Any = getattr(ctx.device.driver, "dlpack_device", None)
    if fn is None:
        return False
    try:
        return int(fn(ctx.device.ordinal)[0]) == 2
    except Exception:
        return False
