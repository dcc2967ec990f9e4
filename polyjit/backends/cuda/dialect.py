"""The CUDA C dialect (for NVRTC): how the shared GPU kernels (core/gpu.py) are spelled with
blocks and threads.

Every kernel is ``extern "C" __global__`` with ``__launch_bounds__`` of its plan's threads;
buffer parameters are device pointers (pool base + offset, computed on the host), outputs
first, then the inputs, then the merge buffer; statics are ``long long`` arguments after
them. Parallel nests run on a 1-D grid-stride loop (elementwise nests of a million cells or
more take 4 cells a thread per trip); CUDA's grid is the launch shape's global // local
size. Tiled contractions are float32 only.

The half types are their bits (``unsigned short``), with no header: NVRTC has no
cuda_fp16.h without a toolkit's include directory. On the device the conversions are the
PTX instructions cuda_fp16.h and cuda_bf16.h use (``cvt.f32.f16``, ``cvt.rn.f16.f32``,
``cvt.rn.bf16.f32`` from sm_80); compiled for the host (``__CUDA_ARCH__`` undefined: the
tests' host builds) they are core/half.py's portable ones, which give the same bits.
"""

from __future__ import annotations

import math

from polyjit.core import dtypes, half, patterns
from polyjit.core.codegen import Dialect, KernelSpec, Names
from polyjit.core.dtypes import DType
from polyjit.core.gpu import GpuSpelling
from polyjit.core.patterns import CONTRACTION, TILES_LARGE, TILES_SMALL

__all__ = ["CudaDialect"]

SPELLING = GpuSpelling(
    group_ids=("blockIdx.x", "blockIdx.y", "blockIdx.z"),
    groups="gridDim.x",
    local="threadIdx.x",
    size="blockDim.x",
    barrier="__syncthreads();",
    shared="__shared__",
    shared_aligned="__shared__ __align__(16)",
    long="long long",
    long_suffix="LL",
    uint=("unsigned int", "u"),
    ulong=("unsigned long long", "ull"),
    pointer="{const}{t}* __restrict__",
    vector_load="*reinterpret_cast<const {v}*>(&{p})",
    vector_store="*reinterpret_cast<{v}*>(&{p}) = {x};",
    # char_lm's scatter by row (128 x 8 updates a cell) issued 16 loads a trip, then waited:
    # with 4 trips unrolled, 64 (36.5 -> 22.5 us on an H200; docs/benchmarks.md, session 13)
    cell_reduction="#pragma unroll {n}",
)


class CudaDialect(Dialect):
    """CUDA C for NVRTC (no headers: the few types it needs are defined in the prelude)."""

    name = "cuda"
    function_qualifier = "static __device__ __forceinline__"
    restrict = "__restrict__"
    index_value = "({})"
    int64_suffix = ""
    parallel_for_pragma = simd_reduction_pragma = simd_for_pragma = None  # no OpenMP
    ordered_float_prefix = ()  # the C dialect's GCC workaround: NVRTC is not GCC
    mapping = patterns.GRID_STRIDE
    gpu = SPELLING
    work_group = 256  # threads of a grid-stride block and of most group reductions
    max_work_group = 1024  # a block per cell of a few very long reductions
    # y = 2x on an H200 at 0.72 of cuMemcpyDtoD with 1 cell a trip, 0.90 with 2, 1.00 with 4
    # (0.96 with 8): docs/benchmarks.md, session 13
    grid_stride_unroll = 4
    # char_lm's embedding gradient (27 rows x 1024 updates) was one serial thread: 670 us on an H200
    scatter_scan = 1 << 22
    reduction_min_blocks = 128  # about an H100's or H200's multiprocessors (132)
    group_reductions = True
    matmul = True
    matmul_dtypes = (dtypes.float32,)
    matmul_tiles = (TILES_LARGE, TILES_SMALL)
    matmul_min_side = 32
    matmul_min_work = 1 << 18  # multiply-adds
    # __launch_bounds__(256, N) for tiled contractions: the 128 x 128 tiles take 127 registers
    # either way; on an H200 N = 1 and 2 ran a 4096 matmul alike (45.4 TFLOP/s)
    matmul_min_blocks_per_sm = 1

    half_spelling = half.HalfSpelling(
        qualifier="static __device__ __forceinline__", u32="unsigned int", u16="unsigned short",
        f2u="__float_as_uint({})", u2f="__uint_as_float({})",
        native=(
            ("pj_f16_to_f32", ("defined(__CUDA_ARCH__)",
                               ['  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;'])),
            ("pj_f32_to_f16", ("defined(__CUDA_ARCH__)",
                               ['  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;'])),
            (half.store_name(dtypes.bfloat16), ("defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800",
                                                ['  unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));',
                                                 "  return h;"])),
        ),
    )

    def type_name(self, dt: DType) -> str:
        return dt.cuda

    def unsigned_name(self, dt: DType) -> str:
        return "unsigned " + dt.cuda  # unsigned int, unsigned long long

    def prelude(self, batch_dtypes: set[DType]) -> list[str]:
        return [
            "/* polyjit CUDA kernels (NVRTC; nvcc too) */",
            "#if defined(__CUDACC_RTC__) && !defined(PJ_HAVE_STDINT)  /* nvcc declares them itself */",
            "typedef long long int64_t;",
            "typedef int int32_t;",
            "typedef unsigned char uint8_t;",
            "#endif",
            "",
        ]

    def float_literal(self, value: float, dt: DType) -> str:
        # a zero as its bits: NVRTC warns of a division by a literal zero (IEEE: inf or NaN)
        if value == 0.0 and dt in (dtypes.float32, dtypes.float64):
            negative = math.copysign(1.0, value) < 0
            if dt is dtypes.float32:
                return f"__int_as_float({'0x80000000' if negative else '0'})"
            return f"__longlong_as_double({'(long long)0x8000000000000000ULL' if negative else '0LL'})"
        return super().float_literal(value, dt)

    def special_float(self, dt: DType, which: str) -> str:
        # the bits: NVRTC has no math.h macros without a toolkit's headers
        if dt is dtypes.float32:
            bits = {"nan": "0x7fc00000", "-nan": "0xffc00000", "inf": "0x7f800000", "-inf": "0xff800000"}[which]
            return f"__int_as_float({bits})"
        bits = {"nan": "0x7ff8000000000000LL", "-nan": "(long long)0xfff8000000000000ULL", "inf": "0x7ff0000000000000LL",
                "-inf": "(long long)0xfff0000000000000ULL"}[which]
        return f"__longlong_as_double({bits})"

    def raw_binding(self, text: str, spec: KernelSpec) -> tuple[str, str]:
        """A user's kernel takes its parameters as it declares them: its text, as it is."""
        return text, spec.name

    def kernel_open(self, spec: KernelSpec, names: Names) -> list[str]:
        params = []
        for node in spec.buffers:
            t = self.type_name(node.dtype)
            const = "" if node in spec.outputs else "const "
            params.append(f"{const}{t}* __restrict__ {names.buffer(node)}")
        if spec.merge is not None:
            params.append(f"const {self.type_name(spec.merge.dtype)}* __restrict__ {names.merge}")
        for s in spec.statics:
            params.append(f"long long {names.var(s)}")
        min_blocks = self.matmul_min_blocks_per_sm if spec.plan.kind == CONTRACTION else 1
        bounds = f"{spec.plan.threads}, {min_blocks}" if min_blocks > 1 else f"{spec.plan.threads}"
        return [f'extern "C" __global__ void __launch_bounds__({bounds}) '
                f"{spec.name}({', '.join(params) or 'void'}) {{"]
