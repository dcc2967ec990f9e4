"""Binding OpenCL kernels to their buffers and fitting their launch to the device.

Generated kernels take each buffer as the pool (``cl.Buffer``) and a byte offset. A user's
own kernel (``Backend.raw_kernel``) takes ``__global T*`` parameters as it declares them:
it gets a sub-buffer of the pool at the node's offset, which the slab planner aligns to
the device's base alignment (``CL_DEVICE_MEM_BASE_ADDR_ALIGN``, as sub-buffers require);
its statics are ``long`` arguments and its launch shape is the user's, exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from polyjit.backends.opencl.platforms import ClDevice, cl
from polyjit.core.codegen import KernelSpec, LaunchShape
from polyjit.core.errors import InvalidArgumentError, UnsupportedError
from polyjit.core.raw import RAW

__all__ = ["Launch", "Prepared", "bind"]


@attrs.frozen(eq=False)
class Launch:
    kernel: Any
    global_size: tuple[int, ...]
    local_size: tuple[int, ...] | None
    first_static: int


@attrs.frozen(eq=False)
class Prepared:
    launches: tuple[Launch, ...]
    keep: tuple[Any, ...]  # the pool buffers (and sub-buffers) the kernels point at
    calls: tuple[tuple[Any, tuple[int, ...], tuple[int, ...] | None], ...] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        calls = tuple((ln.kernel, ln.global_size, ln.local_size) for ln in self.launches)
        object.__setattr__(self, "calls", calls)


def bind(program: Any, spec: KernelSpec, args: Sequence[tuple[Any, int]], dev: ClDevice,
         keep: list[Any]) -> Launch:
    """A kernel of ``program`` with its buffer arguments set (the statics are set per launch)."""
    kernel = cl.Kernel(program, spec.name)
    if spec.plan.kind == RAW:
        return _bind_raw(kernel, spec, args, dev, keep)
    pos = 0
    for buf, offset in args:
        kernel.set_arg(pos, buf)
        kernel.set_arg(pos + 1, np.uint64(offset))
        keep.append(buf)
        pos += 2
    glob, local = _fit_launch(spec.launch, kernel, dev)
    return Launch(kernel, glob, local, pos)


def _bind_raw(kernel: Any, spec: KernelSpec, args: Sequence[tuple[Any, int]], dev: ClDevice,
              keep: list[Any]) -> Launch:
    name = kernel.function_name
    want = len(args) + len(spec.statics)
    if kernel.num_args != want:
        raise InvalidArgumentError(
            f"OpenCL kernel {name} takes {kernel.num_args} parameters, but raw_kernel names {want} "
            f"({len(args)} buffers, {len(spec.statics)} statics)")
    _check_qualifiers(kernel, len(args), want)
    for k, ((pool, offset), node) in enumerate(zip(args, spec.buffers)):
        if offset % dev.info.base_alignment:
            raise UnsupportedError(
                f"{node.label} sits at offset {offset} of its pool, not a multiple of {dev.info.name}'s "
                f"base alignment {dev.info.base_alignment}: no sub-buffer can start there")
        whole = offset == 0 and node.nbytes == pool.size
        # An empty node gets the pool itself (a sub-buffer cannot be empty); the kernel reads none of it.
        buf = pool if whole or node.nbytes == 0 else pool.get_sub_region(offset, node.nbytes)
        _set(kernel, k, buf, f"a buffer (__global {node.dtype.opencl}*) for {node.label}")
        keep.append(buf)
    for k in range(len(spec.statics)):
        _set(kernel, len(args) + k, np.int64(0), f"a 64-bit integer (long) for static {spec.statics[k]!r}")
    glob = tuple(spec.launch.global_size)
    local = spec.launch.local_size
    required = tuple(kernel.get_work_group_info(cl.kernel_work_group_info.COMPILE_WORK_GROUP_SIZE, dev.device))
    if any(required) and (local is None or tuple(local) != required[: len(local)]):
        raise InvalidArgumentError(
            f"OpenCL kernel {name} requires work-groups of {required}: pass local_size={required[: len(glob)]}")
    if local is not None:
        limit = int(kernel.get_work_group_info(cl.kernel_work_group_info.WORK_GROUP_SIZE, dev.device))
        dims = list(dev.device.max_work_item_sizes)
        if math.prod(local) > limit or any(b > m for b, m in zip(local, dims)):
            raise UnsupportedError(f"OpenCL kernel {name}: work-groups of {tuple(local)} exceed what "
                                   f"{dev.info.name} allows it ({limit} work-items, {tuple(dims)} per dimension)")
    return Launch(kernel, glob, None if local is None else tuple(local), len(args))


def _check_qualifiers(kernel: Any, n_buffers: int, n_params: int) -> None:
    """Buffers must be ``__global`` (or ``__constant``) pointers and statics plain values, where
    the platform tells (the program is built with -cl-kernel-arg-info)."""
    q = cl.kernel_arg_address_qualifier
    for k in range(n_params):
        try:
            where = kernel.get_arg_info(k, cl.kernel_arg_info.ADDRESS_QUALIFIER)
            type_name = str(kernel.get_arg_info(k, cl.kernel_arg_info.TYPE_NAME)).strip()
        except cl.Error:
            return  # no argument info here: set_arg's size checks are all there is
        pointer = where in (q.GLOBAL, q.CONSTANT)
        floating = type_name.rstrip("0123456789") in ("float", "double", "half")  # set_arg sees 8 bytes
        if pointer != (k < n_buffers) or (k >= n_buffers and floating):
            want = "a __global pointer (a buffer)" if k < n_buffers else "a long (a static)"
            raise InvalidArgumentError(f"parameter {k} of OpenCL kernel {kernel.function_name} is "
                                       f"{type_name!r}, where raw_kernel passes {want}")


def _set(kernel: Any, index: int, value: Any, what: str) -> None:
    try:
        kernel.set_arg(index, value)
    except cl.Error as e:
        raise InvalidArgumentError(
            f"parameter {index} of OpenCL kernel {kernel.function_name} does not take {what}: {e}") from e


def _fit_launch(launch: LaunchShape, kernel: Any, dev: ClDevice) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """The launch configuration, with the work-group shrunk (halved: the rounded global size
    stays a multiple) to what this kernel may use on this device. On CPU devices, kernels that
    do not require a work-group size let the driver choose: PoCL picks larger work-groups than
    a GPU wants (about 10% faster on a memory-bound copy), and every kernel guards its range."""
    glob = tuple(launch.global_size)
    if launch.local_size is None:
        return glob, None
    required = tuple(kernel.get_work_group_info(cl.kernel_work_group_info.COMPILE_WORK_GROUP_SIZE,
                                                dev.device))
    if dev.is_cpu and not any(required):
        return glob, None
    local = list(launch.local_size)
    limit = int(kernel.get_work_group_info(cl.kernel_work_group_info.WORK_GROUP_SIZE, dev.device))
    dims = list(dev.device.max_work_item_sizes)
    for d in range(len(local)):
        while local[d] > dims[d] and local[d] % 2 == 0:
            local[d] //= 2
    while math.prod(local) > limit:
        d = max(range(len(local)), key=lambda k: local[k])
        if local[d] % 2:
            break
        local[d] //= 2
    if math.prod(local) > limit or any(lsz > mx for lsz, mx in zip(local, dims)):
        raise UnsupportedError(
            f"kernel {kernel.function_name} needs work-groups of {tuple(launch.local_size)}, "
            f"but {dev.info.name} allows {limit} work-items ({tuple(dims)} per dimension)"
        )
    return glob, tuple(local)
