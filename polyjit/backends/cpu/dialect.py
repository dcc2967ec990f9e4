"""The CPU backend's C dialect: C99 + OpenMP spelled for this host (its vector width, AVX
intrinsics, float32 exp and tanh that vectorize), and the shapes only the CPU writes
(``tiles.py``: register tiles, column and staged reductions, streaming stores, block
transposes), which
core/patterns.py gives the kernels they suit."""

from __future__ import annotations

from collections.abc import Sequence

from polyjit.backends.cpu import tiles
from polyjit.backends.cpu.host import host_cpu
from polyjit.core import dtypes
from polyjit.core.codegen import Dialect, VectorMath
from polyjit.core.patterns import STAGED_MAX_LENGTH, STREAMING_MIN_BYTES

__all__ = ["STREAMING_MIN_BYTES", "CpuDialect"]


class CpuDialect(Dialect):
    """C + OpenMP, with tiled contractions and the CPU's shapes."""

    name = "c"
    matmul = True  # register tiles, whatever the size: they never lose to the plain loop
    matmul_rows = True  # they load rows of y and the output as vectors
    matmul_epilogues = True  # and run the elementwise kernel after them on each tile
    shape_emitters = tiles.SHAPES
    ranged = True  # the runtime shares each kernel's range among threads (runtime.c, run_chunks)
    # Ranges are shared from the base's 32768 iterations, and matmuls from 2M multiply-adds
    # (about 20 us on one core): a kernel shared between two cores moves its operands and its
    # output between their caches. On the 2-core Intel VM of session 7 char_lm stepped in
    # 88 us sharing from 8192 iterations and every matmul, in 70 us with these; the MLP's
    # 51M-multiply-add matmuls still run on both cores (docs/benchmarks.md, session 7).
    shared_matmul_min_work = 1 << 21
    # From 512K multiply-adds (the MLP's 256x256x10 products, char_lm's 1M ones) the stream
    # decides by timing itself (runtime.c, share_window): shared, char_lm stepped in 83 us
    # instead of 92 while the VM's two vCPUs shared a cache, and in 150 while they did not.
    optional_matmul_min_work = 1 << 19
    # A row group's rows run on one core each; their staged reductions fit a local array.
    row_group_max_row = STAGED_MAX_LENGTH

    def __init__(self, vector_bytes: int | None = None, vector_registers: int | None = None) -> None:
        host = host_cpu()
        self.vector_bytes = vector_bytes or host.vector_bytes
        # A narrower vector than the host's is taken to be AVX2's or SSE's, with 16 registers.
        same = self.vector_bytes == host.vector_bytes
        self.vector_registers = vector_registers or (host.vector_registers if same else 16)

    def prelude(self, batch_dtypes: set[dtypes.DType]) -> list[str]:
        return ["#include <stddef.h>", "#include <stdint.h>", "#include <math.h>", "#if defined(__AVX__)",
                "#include <immintrin.h>", "#endif", ""]

    def helper_definitions(self, batch_dtypes: set[dtypes.DType]) -> list[tuple[str, list[str]]]:
        """Tail loads/stores of the tiles and float32 exp/tanh, then max/min: ``generate``
        keeps those the kernels call."""
        out: list[tuple[str, list[str]]] = []
        computed = {d.compute for d in batch_dtypes}  # half types compute in float32
        for dt in sorted((batch_dtypes | computed) & set(tiles.VEC_SUFFIX), key=lambda d: d.name):
            out += tiles.tail_helpers(dt, self.type_name(dt), self.vector_bytes)
        if dtypes.float32 in computed:
            out += tiles.FLOAT32_MATH + tiles.vector_math(self.vector_bytes)
        out += [tiles.BOOL_TO_FLOAT[dt] for dt in sorted(computed & set(tiles.BOOL_TO_FLOAT), key=lambda d: d.name)]
        out += [tiles.SCRATCH_HELPER, tiles.SCRATCH_TAG_HELPER, tiles.TRANSPOSE_HELPER]
        return out + super().helper_definitions(batch_dtypes)

    def vector_math(self, fn: str, dt: dtypes.DType) -> VectorMath | None:
        if dt is dtypes.float32 and fn in ("exp", "tanh"):
            return VectorMath(f"pj_{fn}_vf32", "pj_vf32", self.vector_bytes // 4, "float")
        return None

    def bool_to_float(self, dt: dtypes.DType, arg: str) -> str:
        if dt in tiles.BOOL_TO_FLOAT:  # as bits (tiles.BOOL_TO_FLOAT says why)
            return f"{tiles.BOOL_TO_FLOAT[dt][0]}({arg})"
        return super().bool_to_float(dt, arg)

    def math_call(self, fn: str, dt: dtypes.DType, args: Sequence[str]) -> str:
        if dt is dtypes.float32 and fn in ("exp", "tanh"):
            return f"pj_{fn}_f32({', '.join(args)})"
        return super().math_call(fn, dt, args)
