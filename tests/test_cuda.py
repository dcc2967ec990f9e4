"""The CUDA backend.

Without a GPU (this file's default):
- every conformance program (and the CUDA-specific ones below: tiled matmuls,
  block reductions, grid-stride nests) compiles through NVRTC to CUBIN for sm_80
  and sm_90, and ptxas accepts the PTX;
- the generated kernels *run* on the host: the CUDA source is compiled by the C++
  compiler against a small shim (blocks run one after another, the threads of a
  block are ucontext coroutines, ``__syncthreads`` switches between them) and every
  program is checked against the reference interpreter, with 1-D grids cut to 3
  blocks so that the grid-stride loops really stride;
- the backend reports zero devices and why, imports without the cuda packages, and
  turns NVRTC errors into CompileError with the log and the numbered lines.

With a GPU (``@pytest.mark.gpu``; skipped, with the reason, where there is no
driver or device): the conformance kit, graph replay, host transfers larger than
the staging ring, copies between contexts on two streams, peer copies.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from polyjit.backends import cuda, get_backend
from polyjit.backends.cuda_dialect import CudaDialect, matmul_shape, plan_kernel
from polyjit.core import dtypes, ir
from polyjit.core.codegen import KernelSpec, Source, generate
from polyjit.core.errors import CompileError
from polyjit.core.ir import AccumOp, Node, Op, StaticSymbol, Symbol
from polyjit.core.lower import LoweredBatch, lower
from polyjit.testing import ConformanceSuite
from polyjit.testing.harness import compare, group_programs, program_rng
from polyjit.testing.programs import Program, catalog, program, values
from polyjit.testing.reference import run_reference

Array = np.ndarray[Any, Any]

# ---------------------------------------------------------------------------
# Programs that reach the CUDA dialect's special shapes (the catalog's sizes are small)


def _f32(name: str, shape: tuple[int, ...]) -> Node:
    return Node(name, shape, dtypes.float32)


@functools.cache
def cuda_programs() -> tuple[Program, ...]:
    q32 = functools.partial(values, dtypes.float32, kind="quarter")
    out: list[Program] = []

    def mm(name: str, spec: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...],
           c_shape: tuple[int, ...], **kw: Any) -> None:
        a, b, c = _f32("a", a_shape), _f32("b", b_shape), _f32("c", c_shape)
        init = kw.pop("init_neutral", True)
        inputs = [(a, q32(a_shape)), (b, q32(b_shape))]
        if not init:
            inputs.append((c, q32(c_shape)))
        out.append(program(name, ir.einsum(spec, a, b, into=c, init_neutral=init),
                           inputs=inputs, outputs=[c], **kw))

    mm("cuda.matmul.large_tiles_vec", "ik,kj->ij", (256, 64), (64, 256), (256, 256))
    mm("cuda.matmul.small_tiles_vec", "ik,kj->ij", (64, 48), (48, 128), (64, 128))
    mm("cuda.matmul.transposed_vec", "ki,jk->ij", (16, 256), (256, 16), (256, 256))
    mm("cuda.matmul.output_transposed", "ik,kj->ji", (128, 32), (32, 64), (64, 128))
    mm("cuda.matmul.batched_vec", "bik,bkj->bij", (2, 128, 64), (2, 64, 128), (2, 128, 128))
    mm("cuda.matmul.unaligned", "ik,kj->ij", (70, 61), (61, 97), (70, 97))
    mm("cuda.matmul.unaligned_large", "ik,kj->ij", (300, 9), (9, 260), (300, 260))
    mm("cuda.matmul.accumulate", "ik,kj->ij", (64, 64), (64, 64), (64, 64), init_neutral=False,
       runs=({}, {}))
    # a static symbol in the A operand: c[i, j] = sum_k x[$b, i, k] * w[k, j]
    bsym = StaticSymbol("b", 3)
    i, j, k = Symbol("i"), Symbol("j"), Symbol("k")
    x, w, c = _f32("x", (3, 64, 32)), _f32("w", (32, 128)), _f32("c", (64, 128))
    acc = ir.Accum(c, AccumOp.ADD, Op.MUL, (x, w),
                   ir.projections([(i, 64), (j, 128), (k, 32)], [i, j], [bsym, i, k], [k, j]))
    out.append(program("cuda.matmul.static_operand", acc, inputs=[(x, q32(x.shape)), (w, q32(w.shape))],
                       outputs=[c], runs=({bsym: 2}, {bsym: 0})))

    def red(name: str, spec: str, shape: tuple[int, ...], rshape: tuple[int, ...], dt: dtypes.DType = dtypes.float32,
            accum: AccumOp = AccumOp.ADD, kind: str = "quarter", init: bool = True, **kw: Any) -> None:
        a, r = Node("a", shape, dt), Node("r", rshape, dt)
        inputs = [(a, values(dt, shape, kind))]
        if not init:
            inputs.append((r, values(dt, rshape, kind)))
        out.append(program(name, ir.einsum(spec, a, into=r, accum=accum, init_neutral=init),
                           inputs=inputs, outputs=[r], **kw))

    red("cuda.reduce.rows_block", "ij->i", (40, 3000), (40,))
    red("cuda.reduce.columns_threads", "ij->j", (600, 5000), (5000,))
    red("cuda.reduce.columns_block", "ij->j", (3000, 100), (100,))
    # a prime length stays one kernel (a block of 1024 threads); others split into partials
    red("cuda.reduce.full_max_1024_threads", "i->", (65_537,), (), accum=AccumOp.MAX, kind="any")
    red("cuda.reduce.full_sum_split", "i->", (200_000,), (), kind="quarter")
    red("cuda.reduce.rows_onto_context", "ij->i", (8, 2000), (8,), init=False, runs=({}, {}))
    red("cuda.reduce.uint8_min_block", "ij->i", (5, 1000), (5,), dt=dtypes.uint8, accum=AccumOp.MIN, kind="any")
    red("cuda.reduce.float64_prod_block", "ij->i", (3, 700), (3,), dt=dtypes.float64, accum=AccumOp.MUL, kind="unit",
        rtol=1e-9)
    red("cuda.reduce.int64_sum_2d_block", "ijk->j", (30, 4, 40), (4,), dt=dtypes.int64, kind="any")
    t3 = Node("t3", (7, 9, 11), dtypes.int32)
    r3 = Node("r3", (11, 9, 7), dtypes.int32)
    out.append(program("cuda.grid.3d_decompose", ir.einsum("ijk->kji", t3, into=r3),
                       inputs=[(t3, values(dtypes.int32, t3.shape))], outputs=[r3]))
    big, bo = _f32("big", (3, 100_000)), _f32("bo", (3, 100_000))
    out.append(program("cuda.grid.many_strides", ir.apply(Op.SIGMOID, big, into=bo),
                       inputs=[(big, values(dtypes.float32, big.shape))], outputs=[bo]))
    return tuple(out)


def all_programs() -> list[Program]:
    return [*catalog(), *cuda_programs()]


def _groups(programs: Sequence[Program], size: int = 48) -> list[list[Program]]:
    return group_programs(programs, size)


def _batch(group: Sequence[Program]) -> tuple[LoweredBatch, Source, list[tuple[int, int]]]:
    """One lowered batch and CUDA source for a group; per program, its (first comp, count)."""
    comps: list[ir.Comp] = []
    names: list[str] = []
    spans = []
    for pk, p in enumerate(group):
        spans.append((len(comps), len(p.comps)))
        for ck, c in enumerate(p.comps):
            comps.append(c)
            names.append(f"p{pk}_{ck}_{p.name.replace('.', '_')}")
    lowered = lower(comps, names)
    return lowered, generate(lowered, CudaDialect()), spans


@functools.cache
def _all_batches() -> tuple[tuple[tuple[Program, ...], LoweredBatch, Source, tuple[tuple[int, int], ...]], ...]:
    out = []
    for g in _groups(all_programs()):
        lowered, source, spans = _batch(g)
        out.append((tuple(g), lowered, source, tuple(spans)))
    return tuple(out)


def _no_gpu_reason() -> str:
    return getattr(get_backend("cuda"), "unavailable_reason", None) or "no CUDA device"


# ---------------------------------------------------------------------------
# Without a GPU: devices, import, errors


def test_backend_reports_zero_devices_with_a_reason_without_a_driver() -> None:
    backend = get_backend("cuda")
    assert isinstance(backend, cuda.CudaBackend)
    if backend.num_devices() > 0:
        assert backend.unavailable_reason is None
        pytest.skip("a CUDA device is present")
    assert backend.num_devices() == 0
    reason = backend.unavailable_reason
    assert reason and isinstance(reason, str)
    props = backend.static_properties()
    assert props["num_devices"] == 0 and props["unavailable_reason"] == reason
    assert props["dialect"] == "cuda"


def _run_isolated(code: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_imports_and_reports_zero_devices_without_the_cuda_packages() -> None:
    out = _run_isolated("""
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "cuda" or name.startswith("cuda."):
                    raise ImportError(f"blocked {name}")
                return None
        sys.meta_path.insert(0, Block())
        from polyjit.backends import cuda as c
        b = c.create_backend()
        print(b.num_devices(), "|", b.unavailable_reason)
    """)
    count, reason = out.strip().split(" | ", 1)
    assert count == "0"
    assert "cuda-bindings" in reason


def test_disabled_by_environment() -> None:
    out = _run_isolated("""
        import polyjit
        b = polyjit.get_backend("cuda")
        print(b.num_devices(), "|", b.unavailable_reason)
    """, env={"POLYJIT_CUDA_DISABLE": "1"})
    assert out.strip() == "0 | disabled by POLYJIT_CUDA_DISABLE"


def test_compile_error_carries_the_log_and_numbered_lines() -> None:
    text = 'extern "C" __global__ void k(float* x) {\n  x[0] = 1.0f;\n  x[1] = no_such_name;\n}\n'
    with pytest.raises(CompileError) as info:
        cuda.nvrtc_compile(text, "sm_90")
    err = info.value
    assert "no_such_name" in err.log
    assert "no_such_name" in str(err)
    assert ">>     3 |   x[1] = no_such_name;" in str(err)
    assert err.source == text


def test_backend_compile_without_devices_targets_the_default_arch() -> None:
    backend = get_backend("cuda")
    a, r = _f32("a", (1000,)), _f32("r", (1000,))
    code = backend.compile(ir.Comp.of(ir.apply(Op.EXP, a, into=r)), name="exp")
    binary = code.batch.binary
    assert isinstance(binary, cuda.CudaBinary)
    if backend.num_devices() == 0:
        assert binary.archs == (cuda.DEFAULT_ARCH,)
    kind, image = binary.image(cuda.DEFAULT_ARCH)
    assert kind == "cubin" and image[:4] == b"\x7fELF"
    assert 'extern "C" __global__' in code.source


def test_compile_is_cached_on_disk_across_processes(tmp_path: Path) -> None:
    script = """
        from polyjit.backends import cuda as c
        from polyjit.core import ir
        a = ir.Node("a", (64,)); r = ir.Node("r", (64,))
        b = c.create_backend()
        b.compile(ir.Comp.of(ir.apply(ir.Op.SQRT, a, into=r)), name="cached_sqrt")
        print(c.CUBIN_CACHE.compiles)
    """
    env = {"POLYJIT_CACHE_DIR": str(tmp_path), "POLYJIT_CUDA_DISABLE": "1"}
    assert _run_isolated(script, env).strip() == "1"
    assert _run_isolated(script, env).strip() == "0"  # a second process never calls NVRTC
    assert list((tmp_path / "cuda").glob("*.cubin"))


def test_the_cache_key_covers_arch_and_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLYJIT_CACHE_DIR", str(tmp_path))
    text = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] *= 2.0f; }\n'
    a = cuda.nvrtc_compile(text, "sm_80")
    b = cuda.nvrtc_compile(text, "sm_90")
    c = cuda.nvrtc_compile(text, "sm_90", options=(*cuda.NVRTC_OPTIONS, "--use_fast_math"))
    assert a != b and a[:4] == b[:4] == c[:4] == b"\x7fELF"
    assert len(list((tmp_path / "cuda").glob("*.cubin"))) == 3


def test_fast_math_is_off_by_default() -> None:
    assert "--use_fast_math" not in cuda.NVRTC_OPTIONS
    assert cuda.CudaDriver().options == cuda.NVRTC_OPTIONS
    assert "--use_fast_math" in cuda.CudaDriver(fast_math=True).options
    assert {"-lineinfo", "--std=c++17"} <= set(cuda.NVRTC_OPTIONS)


def test_newer_arch_than_nvrtc_falls_back_to_ptx() -> None:
    a, r = _f32("a", (10,)), _f32("r", (10,))
    lowered = lower([ir.Comp.of(ir.apply(Op.NEG, a, into=r))], ["neg"])
    binary = cuda.CudaBinary(generate(lowered, CudaDialect()))
    newest = max(cuda.nvrtc_supported_archs())
    kind, image = binary.image(f"sm_{newest + 500}")
    assert kind == "ptx" and b".target sm_" in image and image.endswith(b"\x00")


# ---------------------------------------------------------------------------
# Without a GPU: the dialect


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_program_compiles_to_cubin(arch: str) -> None:
    failures = []
    for group, _, source, _ in _all_batches():
        try:
            image = cuda.nvrtc_compile(source.text, arch)
            assert image[:4] == b"\x7fELF"
        except CompileError as e:
            failures.append(f"{[p.name for p in group]}:\n{e}")
    assert not failures, "\n\n".join(failures)


def test_the_tensor_examples_fused_steps_compile_to_cubin() -> None:
    """The MLP 784-256-10 and char_lm training steps (what the tensor benchmarks run on a GPU)
    through NVRTC for sm_90: every kernel shape they use (tiled matmuls, block reductions,
    gathers) compiles."""
    from polyjit import tensor as pt

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    try:
        import char_lm
    finally:
        sys.path.pop(0)
    x, y = pt.input("x", (256, 784)), pt.input("y", (256,), "int32")
    mlp = pt.MLP("mlp", [784, 256, 10], seed=0)
    ctx, nxt = pt.input("context", (128, char_lm.CONTEXT), "int32"), pt.input("next", (128,), "int32")
    steps = [(pt.cross_entropy(mlp(x), y), pt.SGD(0.01, momentum=0.9)),
             (pt.cross_entropy(char_lm.CharModel()(ctx), nxt), pt.AdamW(lr=0.01))]
    for loss, opt in steps:
        plan = pt.compile(loss=loss, optimizer=opt)  # on the CPU: only its program is used here
        lowered = lower([plan.program.fused()], ["step"])
        source = generate(lowered, CudaDialect())
        kinds = {plan_kernel(k).kind for k in lowered.kernels}
        assert cuda.nvrtc_compile(source.text, "sm_90")[:4] == b"\x7fELF"
        assert {"matmul", "grid"} <= kinds, kinds
        plan.close()


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas is not on PATH")
def test_ptxas_accepts_the_ptx(tmp_path: Path) -> None:
    for k, (_, _, source, _) in enumerate(_all_batches()):
        ptx = cuda.nvrtc_compile(source.text, "sm_90", kind="ptx")
        path = tmp_path / f"batch{k}.ptx"
        path.write_bytes(ptx.rstrip(b"\x00"))
        proc = subprocess.run(["ptxas", "-arch=sm_90", str(path), "-o", os.devnull],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr


def test_kernels_are_extern_c_global_with_device_pointers_and_long_long_statics() -> None:
    p = next(p for p in catalog() if p.name == "static.accum_projection")
    lowered = lower(list(p.comps), ["st"])
    text = generate(lowered, CudaDialect()).text
    assert 'extern "C" __global__ void __launch_bounds__(' in text
    assert "float* __restrict__ b0" in text and "const float* __restrict__ b1" in text
    assert "long long s0" in text
    assert "#include" not in text  # NVRTC compiles it without headers


def _plans(name: str) -> list[str]:
    p = next(p for p in all_programs() if p.name == name)
    lowered = lower(list(p.comps), [f"c{k}" for k in range(len(p.comps))])
    return [plan_kernel(k).kind for k in lowered.kernels]


def test_kernel_shapes_are_chosen_by_size() -> None:
    assert _plans("elementwise.exp.float32") == ["grid"]
    assert _plans("cuda.reduce.rows_block") == ["block_reduce"]
    assert _plans("cuda.reduce.columns_threads") == ["grid"]
    assert _plans("cuda.reduce.columns_block") == ["block_reduce"]
    assert _plans("cuda.reduce.full_max_1024_threads") == ["block_reduce"]
    assert _plans("cuda.reduce.full_sum_split") == ["block_reduce", "single"]  # 250 parts of 800
    assert set(_plans("reduce.add.float32")) == {"grid", "single"}  # short reductions: a thread per cell
    assert _plans("write.non_injective_convolution")[-1] == "single"
    for name in ("cuda.matmul.large_tiles_vec", "cuda.matmul.small_tiles_vec", "cuda.matmul.transposed_vec",
                 "cuda.matmul.batched_vec", "cuda.matmul.unaligned", "cuda.matmul.static_operand",
                 "large.matmul"):
        assert _plans(name) == ["matmul"], name
    assert _plans("matmul.float64.13x17x37") == ["grid"]


def test_matmul_vector_loads_only_where_aligned() -> None:
    def shape(name: str) -> Any:
        p = next(p for p in all_programs() if p.name == name)
        (kernel,) = lower(list(p.comps), ["m"]).kernels
        return matmul_shape(kernel)

    big = shape("cuda.matmul.large_tiles_vec")
    assert big.tiles.bm == 128 and big.aligned and (big.a_vec, big.b_vec) == ("k", "n")
    tr = shape("cuda.matmul.transposed_vec")
    assert (tr.a_vec, tr.b_vec) == ("m", "k")
    assert shape("cuda.matmul.batched_vec").batch is not None
    un = shape("cuda.matmul.unaligned")
    assert not un.aligned and un.a_vec is None and un.b_vec is None
    assert shape("cuda.matmul.static_operand").a_vec == "k"


def test_launch_configs() -> None:
    a, r = _f32("a", (10_000_000,)), _f32("r", (10_000_000,))
    (kernel,) = lower([ir.Comp.of(ir.apply(Op.EXP, a, into=r))], ["e"]).kernels
    launch = plan_kernel(kernel).launch
    assert launch.local_size == (256,)
    grid, block = cuda.grid_and_block(launch, sm_count=132)
    assert block == (256, 1, 1) and grid == (32 * 132, 1, 1)
    grid, _ = cuda.grid_and_block(launch)
    assert grid[0] == launch.global_size[0] // 256
    small = _f32("s", (10,))
    (k2,) = lower([ir.Comp.of(ir.apply(Op.EXP, small, into=_f32("t", (10,))))], ["s"]).kernels
    assert plan_kernel(k2).launch.local_size == (32,)


# ---------------------------------------------------------------------------
# Without a GPU: the kernels run on the host through a CUDA shim

_SHIM = r"""
#include <cstdint>
#include <cstring>
#include <cmath>
#include <cstdlib>
#include <ucontext.h>
#define PJ_HAVE_STDINT 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
struct pj_dim3 { unsigned int x, y, z; };
static pj_dim3 threadIdx, blockIdx, blockDim, gridDim;
struct alignas(16) float4 { float x, y, z, w; };
static inline float __int_as_float(long long i) { int v = (int)i; float f; std::memcpy(&f, &v, 4); return f; }
static inline double __longlong_as_double(long long i) { double d; std::memcpy(&d, &i, 8); return d; }
static ucontext_t pj_sched;
static ucontext_t* pj_ctxs;
static int pj_cur, pj_finished;
static void __syncthreads() { swapcontext(&pj_ctxs[pj_cur], &pj_sched); }
static void (*pj_thunk)();
static void pj_entry() { pj_thunk(); pj_finished = 1; }
static void* pj_args[64];
static long long pj_sargs[16];
static void pj_run(void (*thunk)(), unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz) {
  const unsigned nt = bx * by * bz;
  const size_t stack = 1 << 16;
  char* stacks = (char*)std::malloc(stack * nt);
  ucontext_t* ctxs = (ucontext_t*)std::malloc(sizeof(ucontext_t) * nt);
  char* alive = (char*)std::malloc(nt);
  pj_ctxs = ctxs; pj_thunk = thunk;
  gridDim = {gx, gy, gz}; blockDim = {bx, by, bz};
  for (unsigned z = 0; z < gz; ++z) for (unsigned y = 0; y < gy; ++y) for (unsigned x = 0; x < gx; ++x) {
    blockIdx = {x, y, z};
    for (unsigned t = 0; t < nt; ++t) {
      getcontext(&ctxs[t]);
      ctxs[t].uc_stack.ss_sp = stacks + t * stack;
      ctxs[t].uc_stack.ss_size = stack;
      ctxs[t].uc_link = &pj_sched;
      makecontext(&ctxs[t], pj_entry, 0);
      alive[t] = 1;
    }
    unsigned left = nt;
    while (left) {
      for (unsigned t = 0; t < nt; ++t) {
        if (!alive[t]) continue;
        pj_cur = (int)t;
        threadIdx = {t % bx, (t / bx) % by, t / (bx * by)};
        pj_finished = 0;
        swapcontext(&pj_sched, &ctxs[t]);
        if (pj_finished) { alive[t] = 0; --left; }
      }
    }
  }
  std::free(stacks); std::free(ctxs); std::free(alive);
}
"""


def _thunk(spec: KernelSpec, namespace: str) -> str:
    dialect = CudaDialect()
    args = [f"({dialect.type_name(n.dtype)}*)pj_args[{k}]" for k, n in enumerate(spec.buffers)]
    if spec.merge is not None:
        args.append(f"({dialect.type_name(spec.merge.dtype)}*)pj_args[{len(spec.buffers)}]")
    args += [f"pj_sargs[{k}]" for k in range(len(spec.statics))]
    return (f"static void pj_t_{spec.name}() {{ {namespace}::{spec.name}({', '.join(args)}); }}\n"
            f'extern "C" void pj_emu_{spec.name}(void** a, const long long* s, unsigned gx, unsigned gy, '
            f"unsigned gz, unsigned bx, unsigned by, unsigned bz) {{\n"
            f"  for (int k = 0; k < 64; ++k) pj_args[k] = a[k];\n"
            f"  for (int k = 0; k < 16; ++k) pj_sargs[k] = s[k];\n"
            f"  pj_run(pj_t_{spec.name}, gx, gy, gz, bx, by, bz);\n}}\n")


def _emulator_library(sources: Sequence[Source], directory: Path) -> ctypes.CDLL:
    parts = [_SHIM]
    for k, source in enumerate(sources):
        parts.append(f"namespace pj_g{k} {{\n{source.text}\n}}\n")
        parts += [_thunk(spec, f"pj_g{k}") for spec in source.all_kernels]
    text = "\n".join(parts)
    key = hashlib.sha256(text.encode()).hexdigest()[:24]
    lib = directory / f"emu_{key}.so"
    if not lib.exists():
        src = directory / f"emu_{key}.cpp"
        src.write_text(text)
        cxx = os.environ.get("CXX") or "g++"
        proc = subprocess.run([cxx, "-std=c++17", "-O1", "-fno-strict-aliasing", "-shared", "-fPIC",
                               "-w", "-o", str(lib), str(src)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[:5000]
    return ctypes.CDLL(str(lib))


def _emulate_group(lib: ctypes.CDLL, group: Sequence[Program], lowered: LoweredBatch, source: Source,
                   spans: Sequence[tuple[int, int]]) -> list[str]:
    problems: list[str] = []
    for p, (first, count) in zip(group, spans):
        host = p.generate(program_rng(p.name, 0))
        rng = np.random.default_rng(7)
        arrays: dict[Node, Array] = {n: a.copy() for n, a in host.items()}
        comps = lowered.comps[first : first + count]
        for comp in comps:
            for node, vals in comp.constants:
                arrays[node] = np.array(vals, copy=True)
            for kernel in comp.kernels:
                for node in kernel.buffers:
                    if node not in arrays:  # device memory is not zeroed: start from garbage
                        arrays[node] = rng.integers(0, 256, node.nbytes, dtype=np.uint8).view(node.dtype.np).reshape(node.shape)
        state: dict[Node, Array] = dict(host)
        for run, bindings in enumerate(p.runs):
            for ci in range(len(comps)):
                for spec in source.kernels[first + ci]:
                    ptrs = [arrays[n].ctypes.data for n in spec.buffers]
                    ptr_arr = (ctypes.c_void_p * 64)(*ptrs)
                    st = (ctypes.c_longlong * 16)(*[bindings[s] for s in spec.statics])
                    grid, block = cuda.grid_and_block(spec.launch)
                    if len(spec.launch.global_size) == 1:
                        grid = (min(grid[0], 3), 1, 1)  # make the grid-stride loops stride
                    getattr(lib, f"pj_emu_{spec.name}")(ptr_arr, st, *grid, *block)
            state = run_reference(p.comps, state, bindings)
            for node in p.outputs:
                rtol, atol = p.tolerance(node.dtype)
                if node.dtype is dtypes.float32:  # parallel sums: another order than the reference
                    rtol, atol = max(rtol, 1e-5), max(atol, 1e-5)
                msg = compare(f"{p.name} {node.label} run {run + 1}", arrays[node], state[node], rtol, atol)
                if msg:
                    problems.append(msg)
    return problems


@pytest.fixture(scope="session")
def emu_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cuda_emu")


@pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None, reason="no C++ compiler for the shim")
def test_generated_kernels_run_correctly_on_the_host_shim(emu_dir: Path) -> None:
    batches = _all_batches()
    chunks = [batches[k::4] for k in range(4)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        libs = list(pool.map(lambda ch: _emulator_library([b[2] for b in ch], emu_dir), chunks))
    problems: list[str] = []
    for lib, chunk in zip(libs, chunks):
        for group, lowered, source, spans in chunk:
            problems += _emulate_group(lib, group, lowered, source, spans)
    assert not problems, "\n".join(problems[:40])


# ---------------------------------------------------------------------------
# Without a GPU: the driver end to end, over a fake cuda.bindings.driver
#
# Streams are deferred queues (work runs only when an event or stream is synced, or a
# stream waits on it), so a staging segment reused too early, a copy-out before its DMA,
# or a missing cross-stream wait shows up as wrong data. Device memory is host memory;
# kernels run through the host shim above. Two devices with peer access.


class _FakeOp:
    __slots__ = ("fn", "wait")

    def __init__(self, fn: Any = None, wait: tuple[Any, int] | None = None) -> None:
        self.fn, self.wait = fn, wait


class _FakeStream:
    def __init__(self, ctx: int) -> None:
        self.ctx = ctx
        self.ops: list[_FakeOp] = []
        self.done = 0

    def __int__(self) -> int:
        return id(self)


class _FakeEvent:
    def __init__(self) -> None:
        self.stream: _FakeStream | None = None
        self.seq = 0


class _FakeFunction:
    def __init__(self, lib: ctypes.CDLL, spec: KernelSpec) -> None:
        self.lib, self.spec = lib, spec


class _FakeGraph:
    def __init__(self) -> None:
        self.nodes: list[list[Any]] = []  # [function, grid, block, args, statics]


class _FakeCuda:
    """The subset of cuda.bindings.driver the backend uses."""

    def __init__(self, emu_dir: Path, sources: dict[bytes, Source], devices: int = 2,
                 others_first: bool = False) -> None:
        from cuda.bindings import driver as real

        self.others_first = others_first  # the schedule: see _sync
        self.CUresult = real.CUresult
        self.CUdevice_attribute = real.CUdevice_attribute
        self.CUstream_flags = real.CUstream_flags
        self.CUevent_flags = real.CUevent_flags
        self.CU_MEMHOSTALLOC_PORTABLE = real.CU_MEMHOSTALLOC_PORTABLE
        self.ok = real.CUresult.CUDA_SUCCESS
        self.emu_dir, self.sources, self.n = emu_dir, sources, devices
        self.current = -1
        self.streams: list[_FakeStream] = []
        self.memory: dict[int, Array] = {}
        self.freed: list[Array] = []
        self.launches = 0
        self.graph_launches = 0
        self.peer_enabled: set[tuple[int, int]] = set()

    class CUDA_KERNEL_NODE_PARAMS:  # the bindings' name
        func: Any = None
        kernelParams = 0
        extra = 0
        sharedMemBytes = 0
        gridDimX = gridDimY = gridDimZ = blockDimX = blockDimY = blockDimZ = 1

    # -- the engine
    def _run_until(self, s: _FakeStream, seq: int) -> None:
        while s.done < seq:
            op = s.ops[s.done]
            if op.wait is not None:
                self._run_until(*op.wait)
            else:
                op.fn()
            s.done += 1

    def _sync(self, s: _FakeStream, seq: int) -> None:
        """Run a stream up to ``seq``; with ``others_first``, every other stream runs as far as it
        can first (both are schedules a GPU may pick: only waits order streams)."""
        if self.others_first:
            for other in self.streams:
                if other is not s:
                    self._run_until(other, len(other.ops))
        self._run_until(s, seq)

    def _enqueue(self, s: _FakeStream, fn: Any) -> tuple[Any]:
        assert s.ctx == self.current, "work enqueued while another device's context is current"
        s.ops.append(_FakeOp(fn))
        return (self.ok,)

    def _drain(self) -> None:
        for s in self.streams:
            self._sync(s, len(s.ops))

    # -- init and devices
    def cuInit(self, flags: int) -> tuple[Any]:
        return (self.ok,)

    def cuDeviceGetCount(self) -> tuple[Any, int]:
        return (self.ok, self.n)

    def cuDeviceGet(self, k: int) -> tuple[Any, int]:
        return (self.ok, k)

    def cuDeviceCanAccessPeer(self, a: int, b: int) -> tuple[Any, int]:
        return (self.ok, 1)

    def cuDeviceGetName(self, n: int, dev: int) -> tuple[Any, bytes]:
        return (self.ok, f"Fake GPU {dev}".encode() + b"\x00" * 8)

    def cuDeviceTotalMem(self, dev: int) -> tuple[Any, int]:
        return (self.ok, 1 << 30)

    def cuDeviceGetAttribute(self, attr: Any, dev: int) -> tuple[Any, int]:
        name = attr.name.replace("CU_DEVICE_ATTRIBUTE_", "")
        return (self.ok, {"COMPUTE_CAPABILITY_MAJOR": 9, "COMPUTE_CAPABILITY_MINOR": 0,
                          "MULTIPROCESSOR_COUNT": 1, "WARP_SIZE": 32}.get(name, 7))

    def cuDriverGetVersion(self) -> tuple[Any, int]:
        return (self.ok, 13000)

    def cuGetErrorName(self, err: Any) -> tuple[Any, bytes]:
        return (self.ok, str(err).encode())

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple[Any, int]:
        return (self.ok, dev)

    def cuCtxSetCurrent(self, ctx: int) -> tuple[Any]:
        self.current = ctx
        return (self.ok,)

    def cuCtxEnablePeerAccess(self, peer: int, flags: int) -> tuple[Any]:
        key = (self.current, peer)
        if key in self.peer_enabled:
            return (self.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,)
        self.peer_enabled.add(key)
        return (self.ok,)

    # -- memory
    def cuMemAlloc(self, n: int) -> tuple[Any, int]:
        arr = np.full(n + 256, 0xAB, np.uint8)  # not zeroed, like device memory
        ptr = (arr.ctypes.data + 255) // 256 * 256
        self.memory[ptr] = arr
        return (self.ok, ptr)

    def cuMemFree(self, ptr: int) -> tuple[Any]:
        self._drain()
        arr = self.memory.pop(int(ptr))
        arr.fill(0xCD)  # a read after free gives garbage
        self.freed.append(arr)
        return (self.ok,)

    def cuMemHostAlloc(self, n: int, flags: int) -> tuple[Any, int]:
        return self.cuMemAlloc(n)

    def cuMemFreeHost(self, ptr: int) -> tuple[Any]:
        return self.cuMemFree(ptr)

    def cuMemsetD8Async(self, ptr: int, value: int, n: int, s: _FakeStream) -> tuple[Any]:
        return self._enqueue(s, lambda: ctypes.memset(int(ptr), value, n))

    def _copy(self, dst: int, src: int, n: int, s: _FakeStream) -> tuple[Any]:
        return self._enqueue(s, lambda: ctypes.memmove(int(dst), int(src), n))

    def cuMemcpyHtoDAsync(self, dst: int, src: int, n: int, s: _FakeStream) -> tuple[Any]:
        return self._copy(dst, src, n, s)

    def cuMemcpyDtoHAsync(self, dst: int, src: int, n: int, s: _FakeStream) -> tuple[Any]:
        return self._copy(dst, src, n, s)

    def cuMemcpyDtoDAsync(self, dst: int, src: int, n: int, s: _FakeStream) -> tuple[Any]:
        return self._copy(dst, src, n, s)

    def cuMemcpyPeerAsync(self, dst: int, dctx: int, src: int, sctx: int, n: int, s: _FakeStream) -> tuple[Any]:
        assert dctx != sctx and s.ctx == dctx
        return self._copy(dst, src, n, s)

    # -- streams and events
    def cuStreamCreate(self, flags: Any) -> tuple[Any, _FakeStream]:
        assert flags == self.CUstream_flags.CU_STREAM_NON_BLOCKING
        s = _FakeStream(self.current)
        self.streams.append(s)
        return (self.ok, s)

    def cuStreamSynchronize(self, s: _FakeStream) -> tuple[Any]:
        self._sync(s, len(s.ops))
        return (self.ok,)

    def cuEventCreate(self, flags: Any) -> tuple[Any, _FakeEvent]:
        assert flags == self.CUevent_flags.CU_EVENT_DISABLE_TIMING
        return (self.ok, _FakeEvent())

    def cuEventRecord(self, ev: _FakeEvent, s: _FakeStream) -> tuple[Any]:
        ev.stream, ev.seq = s, len(s.ops)
        return (self.ok,)

    def cuEventQuery(self, ev: _FakeEvent) -> tuple[Any]:
        if ev.stream is None or ev.stream.done >= ev.seq:
            return (self.ok,)
        return (self.CUresult.CUDA_ERROR_NOT_READY,)

    def cuEventSynchronize(self, ev: _FakeEvent) -> tuple[Any]:
        if ev.stream is not None:
            self._sync(ev.stream, ev.seq)
        return (self.ok,)

    def cuStreamWaitEvent(self, s: _FakeStream, ev: _FakeEvent, flags: int) -> tuple[Any]:
        if ev.stream is not None:
            s.ops.append(_FakeOp(wait=(ev.stream, ev.seq)))
        return (self.ok,)

    # -- modules and launches
    def cuModuleLoadData(self, image: bytes) -> tuple[Any, Any]:
        source = self.sources[bytes(image)]
        return (self.ok, (_emulator_library([source], self.emu_dir), source))

    def cuModuleGetFunction(self, module: Any, name: bytes) -> tuple[Any, _FakeFunction]:
        lib, source = module
        spec = next(k for k in source.all_kernels if k.name == name.decode())
        return (self.ok, _FakeFunction(lib, spec))

    @staticmethod
    def _read_params(f: _FakeFunction, params: int) -> tuple[Any, Any]:
        spec = f.spec
        nb = len(spec.buffers) + (spec.merge is not None)
        slots = (ctypes.c_void_p * (nb + len(spec.statics))).from_address(params)
        addr = [int(slots[k] or 0) for k in range(nb + len(spec.statics))]
        args = (ctypes.c_void_p * 64)(*[ctypes.c_uint64.from_address(addr[k]).value for k in range(nb)])
        statics = (ctypes.c_longlong * 16)(
            *[ctypes.c_longlong.from_address(addr[nb + k]).value for k in range(len(spec.statics))])
        return args, statics

    def _launch(self, f: _FakeFunction, grid: tuple[int, ...], block: tuple[int, ...], args: Any, statics: Any) -> None:
        self.launches += 1
        getattr(f.lib, f"pj_emu_{f.spec.name}")(args, statics, *grid, *block)

    def cuLaunchKernel(self, f: _FakeFunction, gx: int, gy: int, gz: int, bx: int, by: int, bz: int,
                       shared: int, s: _FakeStream, params: int, extra: int) -> tuple[Any]:
        args, statics = self._read_params(f, params)  # kernel arguments are copied at launch
        return self._enqueue(s, lambda: self._launch(f, (gx, gy, gz), (bx, by, bz), args, statics))

    def cuGraphCreate(self, flags: int) -> tuple[Any, _FakeGraph]:
        return (self.ok, _FakeGraph())

    def cuGraphAddKernelNode(self, g: _FakeGraph, deps: Any, n: int, p: Any) -> tuple[Any, int]:
        assert n == (len(g.nodes) > 0), "kernel nodes form a chain"
        args, statics = self._read_params(p.func, p.kernelParams)
        g.nodes.append([p.func, (p.gridDimX, p.gridDimY, p.gridDimZ), (p.blockDimX, p.blockDimY, p.blockDimZ),
                        args, statics])
        return (self.ok, len(g.nodes) - 1)

    def cuGraphInstantiate(self, g: _FakeGraph, flags: int) -> tuple[Any, _FakeGraph]:
        ex = _FakeGraph()
        ex.nodes = [list(node) for node in g.nodes]
        return (self.ok, ex)

    def cuGraphExecKernelNodeSetParams(self, ex: _FakeGraph, node: int, p: Any) -> tuple[Any]:
        ex.nodes[node][3], ex.nodes[node][4] = self._read_params(p.func, p.kernelParams)
        return (self.ok,)

    def cuGraphLaunch(self, ex: _FakeGraph, s: _FakeStream) -> tuple[Any]:
        nodes = [tuple(n) for n in ex.nodes]  # the launch uses the parameters set so far
        self.graph_launches += 1

        def run() -> None:
            for n in nodes:
                self._launch(*n)

        return self._enqueue(s, run)

    def cuGraphExecDestroy(self, ex: _FakeGraph) -> tuple[Any]:
        return (self.ok,)

    def cuGraphDestroy(self, g: _FakeGraph) -> tuple[Any]:
        return (self.ok,)


@pytest.fixture(params=["target_first", "others_first"])
def fake_cuda(request: pytest.FixtureRequest, emu_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A CudaBackend whose driver runs over _FakeCuda (two devices, 1 MiB staging rings),
    under each of two schedules."""
    if shutil.which(os.environ.get("CXX") or "g++") is None:
        pytest.skip("no C++ compiler for the shim")
    sources: dict[bytes, Source] = {}

    def image(self: cuda.CudaBinary, arch: str) -> tuple[str, bytes]:
        key = hashlib.sha256(self.text.encode()).hexdigest().encode()
        sources[key] = self.source
        return ("cubin", key)

    fake = _FakeCuda(emu_dir, sources, others_first=request.param == "others_first")
    monkeypatch.setattr(cuda, "_driver_mod", fake)
    monkeypatch.setattr(cuda.CudaBinary, "image", image)
    backend = cuda.CudaBackend(cuda.CudaDriver(staging_bytes=1 << 20))
    backend.fake = fake  # type: ignore[attr-defined]
    return backend


def test_host_copy_splits_large_copies() -> None:
    src = np.random.default_rng(5).integers(0, 256, (9 << 20) + 7, dtype=np.uint8)
    dst = np.zeros_like(src)
    cuda._host_copy(dst, src)
    np.testing.assert_array_equal(dst, src)


def test_fake_driver_devices_and_peers(fake_cuda: Any) -> None:
    assert fake_cuda.num_devices() == 2 and fake_cuda.unavailable_reason is None
    d0, d1 = fake_cuda.get_device(0), fake_cuda.get_device(1)
    assert d0.name == "Fake GPU 0" and d0.properties["arch"] == "sm_90"
    assert d0.properties["peer_access"] == (False, True)
    assert d0.properties["base_alignment"] == cuda.BASE_ALIGNMENT
    assert {(0, 1), (1, 0)} <= fake_cuda.fake.peer_enabled
    assert fake_cuda.static_properties()["archs"] == ("sm_90", "sm_90")
    assert d1.device_id == "cuda:1"


def test_fake_driver_runs_the_conformance_catalog(fake_cuda: Any) -> None:
    from polyjit.testing.harness import run_programs

    progs = [p for p in all_programs() if not p.name.startswith(("elementwise.", "cast."))]
    failures = run_programs(fake_cuda, progs)
    assert not failures, "\n".join(str(f) for f in failures[:20])
    assert fake_cuda.fake.launches > 100


def test_fake_driver_host_copies_through_the_staging_ring(fake_cuda: Any) -> None:
    dev = fake_cuda.get_device(0)
    n = 700_001  # 2.8 MB: three chunks and more through a 1 MiB ring
    x, y = _f32("x", (n,)), _f32("y", (n,))
    host = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    ctx = dev.make_context().init_from_host(x, host)
    r = ctx.link(fake_cuda.compile(ir.Comp.of(ir.apply(Op.NEG, x, into=y)), name="neg"))
    r.run()
    np.testing.assert_array_equal(r.context.read(y), -host)
    np.testing.assert_array_equal(r.context.read(x), host)
    h2 = host * 3
    r.context.from_host(x, h2)
    h2[:] = 0  # the runtime's from_host has already copied it into pinned staging
    r.run()
    np.testing.assert_array_equal(r.context.read(y), -host * 3)
    before = dev.used_memory()
    r.context.finalize()
    ctx.finalize()
    assert dev.used_memory() < before


def test_fake_driver_statics_and_graph_replay(fake_cuda: Any) -> None:
    rows = StaticSymbol("row", 4)
    i = Symbol("i")
    src, acc, half = _f32("src", (4, 300)), _f32("acc", (300,)), _f32("half", (300,))
    add_row = ir.Accum(acc, AccumOp.ADD, Op.ID, (src,), ir.projections([(i, 300)], [i], [rows, i]),
                       init_neutral=False)
    dev = fake_cuda.get_device(0)
    hsrc = np.arange(1200, dtype=np.float32).reshape(4, 300)
    ctx = dev.make_context().init_from_host(src, hsrc).init_from_host(acc, np.zeros(300, np.float32))
    batch = fake_cuda.compile_batch([ir.Comp.of(add_row), ir.Comp.of(ir.apply(Op.MUL, acc, 0.5, into=half))],
                                    names=["add_row", "half"])
    routines = ctx.link_batch(batch)
    routines[0].bindings[rows] = 1
    routines[0].run()
    routines[1].run()
    want = hsrc[1].copy()
    np.testing.assert_array_equal(routines[1].context.read(half), want * 0.5)
    plan = cuda.capture(routines, bindings={rows: 2})
    assert plan.kernel_count == 2 and plan.bindings[rows] == 2
    for row in (2, 3, 3, 0):
        plan.bindings[rows] = row
        plan.replay()
        want += hsrc[row]
    np.testing.assert_array_equal(routines[1].context.read(half), want * 0.5)
    plan.bind(row=1).replay()
    routines[0].bindings[rows] = 3
    routines[0].run()  # ordered after the replay on the same stream
    want += hsrc[1] + hsrc[3]
    np.testing.assert_array_equal(routines[1].context.read(acc), want)
    # a replay on another stream waits (device side) for the writers on the first
    other = dev.new_stream()
    plan2 = cuda.capture(routines, stream=other)
    plan2.bindings[rows] = 0
    routines[0].run()
    plan2.replay()
    want += hsrc[3] + hsrc[0]
    np.testing.assert_array_equal(routines[1].context.read(half), want * 0.5)
    plan.close()
    plan2.close()
    routines[0].context.finalize()
    ctx.finalize()


def _check_tensor_plans_replay_a_graph(backend: Any) -> int:
    """mode="compiled" runs the fused batch once, then replays it as one CUDA graph; the
    losses match the CPU backend's step for step, and dynamic mode's. Returns the replays."""
    from polyjit import tensor as pt

    rng = np.random.default_rng(0)
    xs, ys = rng.standard_normal((24, 12)).astype(np.float32), rng.integers(0, 3, 24).astype(np.int32)

    def losses(device: Any, mode: str) -> tuple[list[float], Any]:
        x, y = pt.input("x", (24, 12)), pt.input("y", (24,), "int32")
        mlp = pt.MLP("mlp", [12, 16, 3], seed=1)
        plan = pt.compile(loss=pt.cross_entropy(mlp(x), y), optimizer=pt.SGD(0.1, momentum=0.9),
                          device=device, mode=mode)
        return [plan.step(x=xs, y=ys) for _ in range(4)], plan

    want, cpu_plan = losses("cpu", "compiled")
    got, plan = losses(backend.get_device(0), "compiled")
    assert isinstance(plan._linked.replay, cuda.Plan)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    dynamic, dyn_plan = losses(backend.get_device(0), "dynamic")
    assert dyn_plan._linked.replay is None
    np.testing.assert_allclose(dynamic, want, rtol=1e-5)
    for p in (plan, dyn_plan, cpu_plan):
        p.close()
    return 3  # steps 2..4 of the compiled plan


def test_tensor_plans_replay_a_cuda_graph_on_the_fake_driver(fake_cuda: Any) -> None:
    before = fake_cuda.fake.graph_launches
    replays = _check_tensor_plans_replay_a_graph(fake_cuda)
    assert fake_cuda.fake.graph_launches - before == replays


def test_char_lm_trains_on_the_fake_driver_like_on_the_cpu(fake_cuda: Any) -> None:
    """examples/char_lm.py's model (gathers, reshape, tanh, AdamW) in compiled mode: the same
    losses on the fake GPU (generated CUDA, graph replays) as on the CPU backend."""
    from polyjit import tensor as pt
    from polyjit.tensor.datasets import context_windows, encode_text

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    try:
        import char_lm
    finally:
        sys.path.pop(0)
    contexts, targets = context_windows(encode_text(char_lm.TEXT.read_text()), char_lm.CONTEXT)
    rng = np.random.default_rng(3)
    picks = [rng.integers(0, len(contexts), 32) for _ in range(4)]

    def losses(device: Any) -> list[float]:
        model = char_lm.CharModel()
        ctx, nxt = pt.input("context", (32, char_lm.CONTEXT), "int32"), pt.input("next", (32,), "int32")
        plan = pt.compile(loss=pt.cross_entropy(model(ctx), nxt), optimizer=pt.AdamW(lr=0.01), device=device)
        out = [plan.step(context=contexts[idx], next=targets[idx]) for idx in picks]
        plan.close()
        return out

    np.testing.assert_allclose(losses(fake_cuda.get_device(0)), losses("cpu"), rtol=2e-5)


def test_data_parallel_on_two_fake_gpus_matches_one_cpu_device(fake_cuda: Any) -> None:
    """Two replicas over peer copies, merge buffers and replayed graphs give the parameters
    one CPU device gets."""
    from polyjit import tensor as pt

    rng = np.random.default_rng(2)
    xs, ys = rng.standard_normal((5, 16, 6)).astype(np.float32), rng.integers(0, 3, (5, 16)).astype(np.int32)

    def train(devices: Any) -> dict[str, np.ndarray]:
        mlp = pt.MLP("mlp", [6, 8, 3], seed=4)
        dp = pt.data_parallel(lambda x, y: pt.cross_entropy(mlp(x), y),
                              {"x": ((16, 6), "float32"), "y": ((16,), "int32")},
                              optimizer=pt.SGD(0.1, momentum=0.9), devices=devices)
        for k in range(5):
            dp.step(x=xs[k], y=ys[k])
        assert dp.replica_spread() == 0.0
        params = dp.parameters()
        dp.close()
        return params

    before = fake_cuda.fake.graph_launches
    two = train(fake_cuda.devices())
    assert fake_cuda.fake.graph_launches - before == 5 * 2 * 2  # compute and update, per replica
    one = train(["cpu"])
    for name, value in one.items():
        np.testing.assert_allclose(two[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_fake_driver_copies_across_streams_and_devices(fake_cuda: Any) -> None:
    from polyjit import device_to_device
    from polyjit.core.protocol import MergeBuffer

    d0, d1 = fake_cuda.get_device(0), fake_cuda.get_device(1)
    n = 5000
    x, y = _f32("x", (n,)), _f32("y", (n,))
    h = np.random.default_rng(4).standard_normal(n).astype(np.float32)
    a = d0.make_context(d0.new_stream()).init_from_host(x, h)
    b = d0.make_context(d0.new_stream()).init_from_host(x, np.zeros(n, np.float32))
    inc = a.link(fake_cuda.compile(ir.Comp.of(ir.apply(Op.ADD, x, 1.0, into=x)), name="inc"))
    for _ in range(3):
        inc.run()
    device_to_device(x, dst=b, src=inc.context)  # two contexts, two streams, one device
    np.testing.assert_allclose(b.read(x), h + 3, rtol=1e-6)
    c = d1.make_context().init_from_host(x, np.zeros(n, np.float32))
    inc.run()
    device_to_device(x, dst=c, src=inc.context)  # a peer copy, after the writer on device 0
    np.testing.assert_allclose(c.read(x), h + 4, rtol=1e-6)
    t = device_to_device(x, dst=c, src=b, into_merge_buffer=MergeBuffer.COPY)
    assert t is not None
    r = t.context.link(fake_cuda.compile(ir.Comp.of(ir.apply(Op.MUL, ir.merge(x), 2.0, into=y)), name="m"))
    r.run()
    np.testing.assert_allclose(r.context.read(y), (h + 3) * 2, rtol=1e-6)
    plan = cuda.capture([r])
    plan.replay()
    np.testing.assert_allclose(r.context.read(y), (h + 3) * 2, rtol=1e-6)
    plan.close()
    for ctx in (r.context, c, b, inc.context, a):
        ctx.finalize()


def _bench_module(monkeypatch: pytest.MonkeyPatch) -> Any:
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_cuda.py"
    monkeypatch.syspath_prepend(str(path.parent))  # as `polyjit bench` does: timing.py beside it
    spec = importlib.util.spec_from_file_location("bench_cuda", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_without_a_gpu_says_why() -> None:
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "benchmarks" / "bench_cuda.py")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "POLYJIT_CUDA_DISABLE": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "skipped, no CUDA device: disabled by POLYJIT_CUDA_DISABLE" in proc.stdout


def test_benchmark_code_runs_on_the_fake_driver(fake_cuda: Any, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _bench_module(monkeypatch)
    results = []
    results += bench.bench_bandwidth(fake_cuda, None, 4096)
    results += bench.bench_launch(fake_cuda, None, 3)
    results += bench.bench_graph(fake_cuda, 4, 8)
    results += bench.bench_matmul(fake_cuda, None, 128)
    results += bench.bench_copy(fake_cuda, 1 << 16)
    assert all(r["value"] > 0 for r in results)
    printed = capsys.readouterr().out
    assert "max abs error" in printed
    err = float(printed.split("max abs error on 64 rows: ")[1].split()[0])
    assert err < 1e-3, printed


# ---------------------------------------------------------------------------
# With a GPU

gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_backend() -> Any:
    backend = get_backend("cuda")
    if backend.num_devices() == 0:
        pytest.skip(f"no CUDA device: {_no_gpu_reason()}")
    return backend


@gpu
def test_tensor_plans_replay_a_cuda_graph(cuda_backend: Any) -> None:
    _check_tensor_plans_replay_a_graph(cuda_backend)


@gpu
def test_devices_describe_themselves(cuda_backend: Any) -> None:
    n = cuda_backend.num_devices()
    for k in range(n):
        dev = cuda_backend.get_device(k)
        props = dev.properties
        major, minor = props["compute_capability"]
        assert props["arch"] == f"sm_{major}{minor}"
        assert props["sm_count"] > 0 and props["memory_bytes"] > 0
        assert len(props["peer_access"]) == n and len(props["peer_matrix"]) == n
        assert dev.device_id == f"cuda:{k}"


@gpu
def test_conformance_catalog(cuda_backend: Any) -> None:
    from polyjit.testing.harness import run_programs

    failures = run_programs(cuda_backend, all_programs())
    assert not failures, "\n".join(str(f) for f in failures[:30])


@gpu
def test_large_matmul_matches_numpy(cuda_backend: Any) -> None:
    n = 1024
    a, b, c = _f32("a", (n, n)), _f32("b", (n, n)), _f32("c", (n, n))
    rng = np.random.default_rng(0)
    ha, hb = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
    dev = cuda_backend.get_device(0)
    ctx = dev.make_context().init_from_host(a, ha).init_from_host(b, hb)
    r = ctx.link(cuda_backend.compile(ir.Comp.of(ir.einsum("ik,kj->ij", a, b, into=c)), name="mm"))
    r.run()
    got = r.context.read(c)
    np.testing.assert_allclose(got, ha.astype(np.float64) @ hb, rtol=1e-3, atol=1e-3)
    r.context.finalize()
    ctx.finalize()


@gpu
def test_host_transfers_larger_than_the_staging_ring(cuda_backend: Any) -> None:
    n = (cuda.STAGING_BYTES * 5) // 2 // 4 + 12345  # crosses the ring twice, odd chunk at the end
    x, y = _f32("x", (n,)), _f32("y", (n,))
    host = np.arange(n, dtype=np.float32)
    dev = cuda_backend.get_device(0)
    ctx = dev.make_context().init_from_host(x, host)
    r = ctx.link(cuda_backend.compile(ir.Comp.of(ir.apply(Op.MUL, x, 2.0, into=y)), name="twice"))
    r.run()
    out = r.context.read(y)
    np.testing.assert_array_equal(out, host * 2)
    # from_host of new values, then read back without a kernel in between
    host2 = host[::-1].copy()
    r.context.from_host(x, host2)
    np.testing.assert_array_equal(r.context.read(x), host2)
    r.context.finalize()
    ctx.finalize()
    dev.synchronize()


@gpu
def test_used_memory_returns_after_finalize(cuda_backend: Any) -> None:
    dev = cuda_backend.get_device(0)
    before = dev.used_memory()
    x = _f32("x", (1 << 20,))
    ctx = dev.make_context().init_from_host(x, np.ones(1 << 20, np.float32))
    assert dev.used_memory() >= before + (1 << 22)
    ctx.finalize()
    assert dev.used_memory() == before


@gpu
def test_graph_replay_updates_statics_between_replays(cuda_backend: Any) -> None:
    rows = StaticSymbol("row", 6)
    i = Symbol("i")
    src, acc, scaled = _f32("src", (6, 512)), _f32("acc", (512,)), _f32("scaled", (512,))
    add_row = ir.Accum(acc, AccumOp.ADD, Op.ID, (src,), ir.projections([(i, 512)], [i], [rows, i]),
                       init_neutral=False)
    scale = ir.apply(Op.MUL, acc, 0.5, into=scaled)
    dev = cuda_backend.get_device(0)
    hsrc = np.arange(6 * 512, dtype=np.float32).reshape(6, 512)
    ctx = dev.make_context().init_from_host(src, hsrc).init_from_host(acc, np.zeros(512, np.float32))
    batch = cuda_backend.compile_batch([ir.Comp.of(add_row), ir.Comp.of(scale)], names=["add_row", "scale"])
    routines = ctx.link_batch(batch)
    plan = cuda.capture(routines)
    assert plan.kernel_count == 2
    want = np.zeros(512, np.float32)
    for row in (3, 0, 5, 5, 1):
        plan.bindings[rows] = row
        plan.replay()
        want += hsrc[row]
    out = routines[-1].context.read(scaled)
    np.testing.assert_allclose(out, want * 0.5)
    plan.bind(row=2).replay()
    want += hsrc[2]
    np.testing.assert_allclose(routines[-1].context.read(acc), want)
    # the routines still run on their own, ordered with the replays
    routines[0].bindings[rows] = 4
    routines[0].run()
    plan.replay()
    want += hsrc[4] + hsrc[2]
    np.testing.assert_allclose(routines[-1].context.read(acc), want)
    plan.close()
    routines[0].context.finalize()
    ctx.finalize()


@gpu
def test_graph_replay_rejects_bad_bindings(cuda_backend: Any) -> None:
    from polyjit.core.errors import BindingError

    b = StaticSymbol("b", 3)
    i = Symbol("i")
    src, out = _f32("src", (3, 4)), _f32("out", (4,))
    dev = cuda_backend.get_device(0)
    ctx = dev.make_context().init_from_host(src, np.zeros((3, 4), np.float32))
    acc = ir.Accum(out, None, Op.ID, (src,), ir.projections([(i, 4)], [i], [b, i]))
    r = ctx.link(cuda_backend.compile(ir.Comp.of(acc), name="pick"))
    plan = cuda.capture([r])
    with pytest.raises(BindingError):
        plan.replay()
    plan.bindings[b] = 3
    with pytest.raises(BindingError):
        plan.replay()
    plan.close()
    r.context.finalize()
    ctx.finalize()


@gpu
def test_copies_between_two_contexts_on_two_streams_of_one_gpu(cuda_backend: Any) -> None:
    from polyjit import device_to_device
    from polyjit.core.protocol import MergeBuffer

    dev = cuda_backend.get_device(0)
    s1, s2 = dev.new_stream(), dev.new_stream()
    n = 1 << 20
    x, y = _f32("x", (n,)), _f32("y", (n,))
    h = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    c1 = dev.make_context(s1).init_from_host(x, h)
    c2 = dev.make_context(s2).init_from_host(x, np.zeros(n, np.float32))
    # a slow writer on stream 1, then a copy on stream 2: the copy must wait for it
    r1 = c1.link(cuda_backend.compile(ir.Comp.of(ir.apply(Op.ADD, x, 1.0, into=x)), name="inc"))
    for _ in range(20):
        r1.run()
    device_to_device(x, dst=c2, src=r1.context)
    np.testing.assert_allclose(c2.read(x), h + 20, rtol=1e-6)
    # into the merge buffer, read by a routine on stream 2
    t = device_to_device(x, dst=c2, src=r1.context, into_merge_buffer=MergeBuffer.COPY)
    assert t is not None
    r2 = t.context.link(cuda_backend.compile(ir.Comp.of(ir.apply(Op.MUL, ir.merge(x), 2.0, into=y)), name="dbl"))
    r2.run()
    np.testing.assert_allclose(r2.context.read(y), (h + 20) * 2, rtol=1e-6)
    for ctx in (r2.context, c2, r1.context, c1):
        ctx.finalize()


@gpu
def test_peer_copies_between_gpus(cuda_backend: Any) -> None:
    from polyjit import device_to_device

    if cuda_backend.num_devices() < 2:
        pytest.skip("needs two CUDA devices")
    d0, d1 = cuda_backend.get_device(0), cuda_backend.get_device(1)
    n = 1 << 22
    x = _f32("x", (n,))
    h = np.random.default_rng(2).standard_normal(n).astype(np.float32)
    c0 = d0.make_context().init_from_host(x, h)
    c1 = d1.make_context().init_from_host(x, np.zeros(n, np.float32))
    device_to_device(x, dst=c1, src=c0)
    np.testing.assert_array_equal(c1.read(x), h)
    c1.finalize()
    c0.finalize()


@gpu
def test_events_order_work_across_streams(cuda_backend: Any) -> None:
    dev = cuda_backend.get_device(0)
    s = dev.new_stream()
    ev = s.record()
    ev.sync()
    assert ev.is_done()
    dev.synchronize()
    assert dev.is_idle()


class TestCudaConformance(ConformanceSuite):
    """The conformance kit on the real backend (its checks skip, with the reason, without a device)."""

    backend_name = "cuda"


@pytest.mark.slow
@pytest.mark.parametrize("fake_cuda", ["others_first"], indirect=True)
class TestCudaConformanceOnFakeDriver(ConformanceSuite):
    """The conformance kit on the driver over the fake cuda.bindings (two devices; the schedule
    that runs other streams first, which exposes missing waits)."""

    backend_name = "cuda-fake"
    _backend: Any = None

    @pytest.fixture(autouse=True)
    def _install(self, fake_cuda: Any) -> None:
        self._backend = fake_cuda

    def backend(self) -> Any:
        return self._backend

    def multi_device_backend(self) -> Any:
        return self._backend
