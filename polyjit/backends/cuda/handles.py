"""The CUDA driver's handles: pools, streams, events, modules, and the launch record.

The runtime only hands these back to the driver. ``prepare`` turns each kernel into a :class:`KernelLaunch` (its cuda.core ``Kernel``,
``LaunchConfig`` and device pointers, pool base + offset); ``launch`` adds the statics.
CUDA graph capture (``graph.py``) reads the same record through ``Routine.prepared()``.
A user's own kernel (``Backend.raw_kernel``) is launched exactly as asked (grid = global
size / block size, no grid-stride cap), and its parameters are checked against the image:
as many as the buffers and statics named, each of 8 bytes (a pointer, a ``long long``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from polyjit.core.codegen import KernelSpec, LaunchShape
from polyjit.core.errors import InvalidArgumentError, InvalidProgramError, UnsupportedError
from polyjit.core.raw import RAW

__all__ = ["EventHandle", "KernelLaunch", "Module", "Pool", "PreparedLaunch", "StreamHandle",
           "grid_and_block", "prepare_launches"]

RAW_BLOCK = 256  # the most threads per block of a user's kernel launched without a block size


MAX_GRID = (2**31 - 1, 65535, 65535)  # blocks per grid dimension, every compute capability since 3.0
MAX_BLOCK = (1024, 1024, 64)  # threads per block dimension


def grid_and_block(launch: LaunchShape) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """CUDA grid and block from an OpenCL-style launch shape. A grid-stride kernel gets the
    blocks its plan asks for (capped at MAX_GRID_BLOCKS by the plan): on an H200 capping them
    at 32 per SM cost y = 2x 7% of its bandwidth (docs/benchmarks.md, session 13)."""
    local = tuple(launch.local_size or (1,) * len(launch.global_size))
    grid = [max(1, g // max(1, b)) for g, b in zip(launch.global_size, local)]
    g3, b3 = (grid + [1, 1, 1])[:3], (list(local) + [1, 1, 1])[:3]
    return (g3[0], g3[1], g3[2]), (b3[0], b3[1], b3[2])


@attrs.frozen(eq=False)
class Pool:
    ordinal: int
    ptr: int  # the aligned base kernels see
    buffer: Any  # the cuda.core Buffer (freed with close()); None: memory another library lent
    nbytes: int


@attrs.frozen(eq=False)
class StreamHandle:
    ordinal: int
    core: Any  # cuda.core Stream
    handle: Any  # its CUstream, for other libraries' streams (DLPack) and bare driver calls


class EventHandle:
    """A recorded cuda.core Event; it goes back to its device's free list when dropped, so
    whoever waits on it must hold the handle, not only ``core`` (a recycled event is recorded
    again elsewhere, and would report that record's completion)."""

    __slots__ = ("core", "free", "ordinal")

    def __init__(self, ordinal: int, core: Any, free: list[Any]) -> None:
        self.ordinal = ordinal
        self.core = core
        self.free = free

    @property
    def is_done(self) -> bool:
        return bool(self.core.is_done)

    def sync(self) -> None:
        self.core.sync()

    def __del__(self) -> None:
        self.free.append(self.core)


@attrs.frozen(eq=False)
class Module:
    ordinal: int
    code: Any  # cuda.core ObjectCode
    kind: str  # "cubin" or "ptx"
    kernels: dict[str, Any] = attrs.field(factory=dict)

    def kernel(self, name: str) -> Any:
        k = self.kernels.get(name)
        if k is None:
            k = self.kernels[name] = self.code.get_kernel(name)
        return k


@attrs.frozen(eq=False)
class KernelLaunch:
    """One kernel of a prepared routine: its Kernel, launch configuration and pointers."""

    name: str
    kernel: Any  # cuda.core Kernel (it keeps the library loaded)
    config: Any  # cuda.core LaunchConfig
    pointers: tuple[Any, ...]  # np.uint64 device pointers, then the statics follow

    @property
    def grid(self) -> tuple[int, int, int]:
        return tuple(self.config.grid)

    @property
    def block(self) -> tuple[int, int, int]:
        return tuple(self.config.block)

    def arguments(self, statics: Sequence[int]) -> list[Any]:
        """The kernel's arguments as cuda.core takes them: pointers, then ``long long`` statics."""
        return [*self.pointers, *(np.int64(v) for v in statics)]


@attrs.frozen(eq=False)
class PreparedLaunch:
    """What ``CudaDriver.prepare`` returns: the public launch record of a routine."""

    ordinal: int
    launches: tuple[KernelLaunch, ...]
    n_statics: int


def prepare_launches(ordinal: int, module: Module, kernels: Sequence[tuple[KernelSpec, Sequence[tuple[Any, int]]]],
                     max_threads: int) -> PreparedLaunch:
    from cuda.core import LaunchConfig

    n_statics = len(kernels[0][0].statics) if kernels else 0
    launches = []
    for spec, args in kernels:
        if len(spec.statics) != n_statics:
            raise InvalidProgramError(f"kernel {spec.name} takes {len(spec.statics)} statics, not {n_statics}")
        kernel = module.kernel(spec.name)
        if 0 in tuple(spec.launch.global_size):  # nothing to compute (found by review: a grid of 0
            continue  # became 1, and a batch-0 matmul's tiles, unguarded, wrote past its buffer)
        if spec.plan.kind == RAW:
            grid, block = _raw_shape(spec, kernel, len(args), max_threads)
        else:
            grid, block = grid_and_block(spec.launch)
        config = LaunchConfig(grid=grid, block=block, shmem_size=spec.launch.shared_bytes)
        launches.append(KernelLaunch(spec.name, kernel, config,
                                     tuple(np.uint64(pool.ptr + off) for pool, off in args)))
    return PreparedLaunch(ordinal, tuple(launches), n_statics)


def _raw_shape(spec: KernelSpec, kernel: Any, n_buffers: int,
               max_threads: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """A user's kernel: its parameters checked, its grid exactly global / block."""
    sizes = _parameter_sizes(kernel)
    want = n_buffers + len(spec.statics)
    if sizes is not None and len(sizes) != want:
        raise InvalidArgumentError(
            f"CUDA kernel {spec.name} takes {len(sizes)} parameters, but raw_kernel names {want} "
            f"({n_buffers} buffers, {len(spec.statics)} statics)")
    wrong = [k for k, n in enumerate(sizes or ()) if n != 8]
    if wrong:
        raise InvalidArgumentError(
            f"CUDA kernel {spec.name}: parameters {wrong} are not 8 bytes; buffers are passed as device "
            "pointers and statics as long long")
    glob = tuple(spec.launch.global_size)
    local = tuple(spec.launch.local_size or _default_block(glob))
    limit = min(max_threads, int(kernel.attributes.max_threads_per_block))
    if math.prod(local) > limit or any(b > m for b, m in zip(local, MAX_BLOCK)):
        raise UnsupportedError(f"CUDA kernel {spec.name}: blocks of {local} threads exceed the {limit} it may use "
                               f"or CUDA's {MAX_BLOCK} per dimension")
    grid, block = grid_and_block(LaunchShape(glob, local))
    if any(g > m for g, m in zip(grid, MAX_GRID)):  # found by review: CUDA_ERROR_INVALID_VALUE at run()
        raise UnsupportedError(f"CUDA kernel {spec.name}: a grid of {grid} blocks (global size {glob} over blocks "
                               f"of {local}) exceeds CUDA's {MAX_GRID}")
    return grid, block


def _parameter_sizes(kernel: Any) -> list[int] | None:
    """Each parameter's bytes, or None where the driver cannot tell (before CUDA 12.4:
    cuKernelGetParamInfo): the launch then goes unchecked."""
    try:
        return [int(info[1]) for info in kernel.arguments_info]  # (offset, size) per parameter
    except Exception:
        return None


def _default_block(glob: tuple[int, ...]) -> tuple[int, ...]:
    """Without a block size: dimension 0 gets the largest divisor of its global size up to
    RAW_BLOCK threads, so that the grid covers exactly the global size."""
    first = max(d for d in range(1, min(glob[0], RAW_BLOCK) + 1) if glob[0] % d == 0)
    return (first, *(1,) * (len(glob) - 1))
