"""The OpenCL C dialect: ``__kernel`` functions taking pools plus byte offsets, ``__global``
pointers, work-items from global ids, and the spellings core/gpu.py writes the shared GPU
kernels in. Tiled contractions carry a variant for CPU devices (``tiles.py``, under
``-D PJ_CPU``) next to the shared-memory one."""

from __future__ import annotations

from collections.abc import Sequence

from polyjit.backends.opencl import tiles
from polyjit.backends.opencl.tiles import CPU_BUILD_OPTION
from polyjit.core import dtypes, half, patterns
from polyjit.core.codegen import Dialect, KernelSpec, Names
from polyjit.core.dtypes import DType
from polyjit.core.gpu import GpuSpelling
from polyjit.core.patterns import CONTRACTION, GROUP_REDUCTION, Tiles

__all__ = ["CPU_BUILD_OPTION", "OpenCLDialect"]

SPELLING = GpuSpelling(
    group_ids=("get_group_id(0)", "get_group_id(1)", "get_group_id(2)"),
    groups="get_num_groups(0)",
    local="get_local_id(0)",
    size="get_local_size(0)",
    barrier="barrier(CLK_LOCAL_MEM_FENCE);",
    shared="__local",
    shared_aligned="__local",  # vload/vstore need no more than the element's alignment
    long="long",
    long_suffix="L",
    uint=("uint", "u"),
    ulong=("ulong", "UL"),
    pointer="__global {const}{t}* restrict",
    vector_load="vload4(0, &{p})",
    vector_store="vstore4({x}, 0, &{p});",
    global_id="get_global_id({d})",
    host_tiles=(tiles.MACRO, tiles.register_tiles),
    host_lockstep=tiles.MACRO,
)


class OpenCLDialect(Dialect):
    """OpenCL C: ``__kernel`` functions, ``__global`` pointers, parallel loops on global ids."""

    name = "opencl"
    index_value = "({})"
    int64_suffix = ""
    parallel_for_pragma = simd_reduction_pragma = simd_for_pragma = None  # no OpenMP
    ordered_float_prefix = ()  # the C dialect's GCC workaround: no OpenCL compiler is GCC
    mapping = patterns.GLOBAL_IDS
    max_work_items = 2**32 - 1  # PoCL dies (SIGILL) on 2**32 work-groups in a dimension
    gpu = SPELLING
    work_group = max_work_group = 256
    # 64x64 blocks of 8x8 outputs per work-item: the register variant's 8x8 blocks of float8
    matmul_tiles = (Tiles(64, 64, 16, 8, 8),)
    matmul_rows = True  # the register variant loads rows of y and the output as vectors
    matmul_min_side = 16
    matmul_min_work = 1 << 15  # m * n * k

    # The half types: float16 buffers are ``half`` and go through vload_half/vstore_half_rte
    # (core OpenCL: no cl_khr_fp16 needed; the arithmetic is float32 either way, so a device
    # with the extension computes the same bits); bfloat16 is its bits, as in C.
    half_spelling = half.HalfSpelling(
        qualifier="static inline", u32="uint", u16="ushort", f2u="as_uint({})", u2f="as_float({})",
        native=((half.round_name(dtypes.float16), ("", [
            "  ushort h;  /* a private half: vstore rounds, vload reads back */",
            "  vstore_half_rte(f, 0, (half*)&h);",
            "  return vload_half(0, (const half*)&h);",
        ])),),
    )

    def __init__(self, matmul: bool = True, group_reductions: bool = True) -> None:
        self.matmul = matmul
        # A work-group per cell for few, long reductions. Right for GPUs; PoCL's CPU devices
        # run a work-group's items one after the other, so there the strided shares are
        # slower than one work-item walking its row (3.6 vs 9.8 ms for a 2^22 sum): the
        # driver turns them off on platforms of CPU devices only.
        self.group_reductions = group_reductions

    def special_float(self, dt: DType, which: str) -> str:
        # NAN and INFINITY are float constants in OpenCL C: pow(double, NAN) was ambiguous
        spelled = super().special_float(dt, which)
        return f"((double){spelled})" if dt is dtypes.float64 else spelled

    def type_name(self, dt: DType) -> str:
        return dt.opencl

    def half_load(self, dt: DType, ref: str) -> str:
        return f"vload_half(0, &{ref})" if dt is dtypes.float16 else super().half_load(dt, ref)

    def half_store(self, dt: DType, ref: str, value: str) -> str:
        if dt is dtypes.float16:
            return f"vstore_half_rte({value}, 0, &{ref})"
        return super().half_store(dt, ref, value)

    def prelude(self, batch_dtypes: set[DType]) -> list[str]:
        lines = ["/* polyjit OpenCL kernels */"]
        if dtypes.float64 in batch_dtypes:
            lines.append("#pragma OPENCL EXTENSION cl_khr_fp64 : enable")
        lines += ["typedef long int64_t;  /* the emitter's index type */", ""]
        return lines

    def helper_definitions(self, batch_dtypes: set[DType]) -> list[tuple[str, list[str]]]:
        """The tiled kernels' work-group attribute (a macro: PJ_CPU drops it), then max/min."""
        (threads,) = {t.threads for t in self.matmul_tiles}
        wg = [f"#ifdef {tiles.MACRO}",
              "#define PJ_MATMUL_WG",
              "#else",
              f"#define PJ_MATMUL_WG __attribute__((reqd_work_group_size({threads}, 1, 1)))",
              "#endif"]
        return [("PJ_MATMUL_WG", wg), *super().helper_definitions(batch_dtypes)]

    def math_call(self, fn: str, dt: DType, args: Sequence[str]) -> str:
        # OpenCL C overloads the math functions on float and double: no suffix.
        name = "fabs" if fn == "abs" else fn
        return f"{name}({', '.join(args)})"

    def raw_binding(self, text: str, spec: KernelSpec) -> tuple[str, str]:
        """A user's kernel takes its parameters as it declares them: its text, as it is."""
        return text, spec.name

    def kernel_open(self, spec: KernelSpec, names: Names) -> list[str]:
        """Each buffer is a pool (``__global char*``) plus a byte offset; statics are ``long``."""
        attributes = ""
        if spec.plan.kind == CONTRACTION:
            attributes = "PJ_MATMUL_WG "
        elif spec.plan.kind == GROUP_REDUCTION:
            attributes = f"__attribute__((reqd_work_group_size({spec.plan.threads}, 1, 1))) "
        params: list[str] = []
        for k in range(len(spec.buffers)):
            params += [f"__global char* p{k}", f"ulong o{k}"]
        if spec.merge is not None:
            params += ["__global char* pm", "ulong om"]
        params += [f"long {names.var(s)}" for s in spec.statics]
        lines = [f"__kernel {attributes}void {spec.name}({', '.join(params) or 'void'}) {{"]
        for k, node in enumerate(spec.buffers):
            t = self.type_name(node.dtype)
            const = "" if node in spec.outputs else "const "
            lines.append(f"  __global {const}{t}* restrict {names.buffer(node)} = "
                         f"(__global {const}{t}*)(p{k} + o{k});")
        if spec.merge is not None:
            t = self.type_name(spec.merge.dtype)
            lines.append(f"  __global const {t}* restrict {names.merge} = (__global const {t}*)(pm + om);")
        return lines
