"""The CUDA backend.

Without a GPU (this file's default):
- every conformance program (and the CUDA-specific ones of tests/cuda/scenarios.py:
  tiled matmuls, block reductions, grid-stride nests) compiles through NVRTC to CUBIN
  for sm_80 and sm_90, and ptxas accepts the PTX;
- the generated kernels *run* on the host: the CUDA source is compiled by the C++
  compiler against tests/cuda/host_shim.h (blocks run one after another, the threads
  of a block that synchronises are ucontext coroutines, ``__syncthreads`` switches
  between them) and every program is checked against the reference interpreter, with
  1-D grids cut to 3 blocks so that the grid-stride loops really stride;
- the backend reports zero devices and why, imports without the cuda packages, and
  turns NVRTC errors into CompileError with the log and the numbered lines.

The driver end to end, without a GPU: tests/cuda runs the backend, cuda.bindings and
cuda.core over a strict stub of the driver library (see tests/cuda/README.md).

With a GPU (``@pytest.mark.gpu``; skipped, with the reason, where there is no
driver or device): the conformance kit, graph replay, host transfers larger than
the staging ring, copies between contexts on two streams, peer copies.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
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
from polyjit.backends.cuda.dialect import CudaDialect
from polyjit.core import dtypes, ir
from polyjit.core.codegen import Source, generate
from polyjit.core.errors import CompileError
from polyjit.core.ir import AccumOp, Node, Op, StaticSymbol, Symbol
from polyjit.core.lower import LoweredBatch, lower
from polyjit.core.patterns import plan_kernel
from polyjit.core.reference import run_reference
from polyjit.testing import ConformanceSuite
from polyjit.testing.harness import compare, group_programs, program_rng
from polyjit.testing.programs import CatalogProgram, catalog

Array = np.ndarray[Any, Any]
CUDA_TESTS = Path(__file__).resolve().parent / "cuda"


def _helper(name: str) -> Any:
    """A helper module of tests/cuda (shared with the tests there, under the same name)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, CUDA_TESTS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


scenarios = _helper("scenarios")
host_code = _helper("host_code")
_f32 = scenarios.f32
cuda_programs = scenarios.cuda_programs

def all_programs() -> list[CatalogProgram]:
    return list(scenarios.all_programs())


def _groups(programs: Sequence[CatalogProgram], size: int = 48) -> list[list[CatalogProgram]]:
    return group_programs(programs, size)


def _batch(group: Sequence[CatalogProgram]) -> tuple[LoweredBatch, Source, list[tuple[int, int]]]:
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
def _all_batches() -> tuple[tuple[tuple[CatalogProgram, ...], LoweredBatch, Source, tuple[tuple[int, int], ...]], ...]:
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


def test_a_bad_staging_size_is_an_error_naming_it_not_a_failed_import() -> None:
    """Found by review: $POLYJIT_CUDA_STAGING_MB was parsed at import, so "64MB" made
    importing the CUDA backend (and get_backend("cuda")) raise a bare ValueError."""
    bad = ("64MB", "nan", "abc", "-1", "0")
    out = _run_isolated(f"""
        import os
        from polyjit.backends import cuda  # imports whatever the variable says
        from polyjit.core.errors import InvalidArgumentError
        for text in {bad!r}:
            os.environ["POLYJIT_CUDA_STAGING_MB"] = text
            try:
                cuda.CudaDriver()
            except InvalidArgumentError as e:
                print(e)
        print(cuda.CudaDriver(staging_bytes=2 << 20).staging_bytes)
        os.environ["POLYJIT_CUDA_STAGING_MB"] = "1.5"
        print(cuda.CudaDriver().staging_bytes)
    """, env={"POLYJIT_CUDA_STAGING_MB": "64MB"})
    assert out.splitlines() == [f"POLYJIT_CUDA_STAGING_MB={t!r} is not a positive number of MiB" for t in bad] + [
        str(2 << 20), str(3 << 19)]


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
        from polyjit.backends.cuda import nvrtc
        from polyjit.core import ir
        a = ir.Node("a", (64,)); r = ir.Node("r", (64,))
        b = c.create_backend()
        b.compile(ir.Comp.of(ir.apply(ir.Op.SQRT, a, into=r)), name="cached_sqrt")
        print(nvrtc.CACHE.compiles)
    """
    env = {"POLYJIT_CACHE_DIR": str(tmp_path), "POLYJIT_CUDA_DISABLE": "1"}
    assert _run_isolated(script, env).strip() == "1"
    assert _run_isolated(script, env).strip() == "0"  # a second process never calls NVRTC
    assert list((tmp_path / "cuda").glob("*.img"))


def test_the_cache_key_covers_arch_and_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLYJIT_CACHE_DIR", str(tmp_path))
    text = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] *= 2.0f; }\n'
    a = cuda.nvrtc_compile(text, "sm_80")
    b = cuda.nvrtc_compile(text, "sm_90")
    c = cuda.nvrtc_compile(text, "sm_90", options=(*cuda.NVRTC_OPTIONS, "--use_fast_math"))
    assert a != b and a[:4] == b[:4] == c[:4] == b"\x7fELF"
    assert len(list((tmp_path / "cuda").glob("*.img"))) == 3


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
        lowered = lower([plan.program.compiled_comp()], ["step"])
        source = generate(lowered, CudaDialect())
        kinds = {plan_kernel(k, CudaDialect()).kind for k in lowered.kernels}
        assert cuda.nvrtc_compile(source.text, "sm_90")[:4] == b"\x7fELF"
        assert {"contraction", "elementwise", "reduction"} <= kinds, kinds
        plan.close()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_the_source_compiles_with_nvcc_too(tmp_path: Path) -> None:
    """Found by review: the prelude declared int64_t unless PJ_HAVE_STDINT was defined, and nvcc
    declares it already, so no generated source compiled with nvcc (compute-sanitizer builds,
    a user's own)."""
    _, _, source, _ = _all_batches()[0]
    path = tmp_path / "batch.cu"
    path.write_text(source.text)
    proc = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", str(path), "-o", str(tmp_path / "batch.cubin")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


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
    return [plan_kernel(k, CudaDialect()).kind for k in lowered.kernels]


def test_kernel_shapes_are_chosen_by_size() -> None:
    assert _plans("elementwise.exp.float32") == ["elementwise"]
    assert _plans("cuda.reduce.rows_block") == ["group_reduction"]
    assert _plans("cuda.reduce.columns_threads") == ["reduction"]
    assert _plans("cuda.reduce.columns_block") == ["group_reduction"]
    assert _plans("cuda.reduce.full_max_ragged") == ["reduction", "serial", "serial"]  # 256 parts of 256, a tail
    assert _plans("cuda.reduce.full_sum_split") == ["group_reduction", "serial"]  # 250 parts of 800
    assert set(_plans("reduce.add.float32")) == {"reduction", "serial"}  # short reductions: a thread per cell
    assert _plans("write.non_injective_convolution")[-1] == "serial"
    for name in ("cuda.matmul.large_tiles_vec", "cuda.matmul.small_tiles_vec", "cuda.matmul.transposed_vec",
                 "cuda.matmul.batched_vec", "cuda.matmul.unaligned", "cuda.matmul.static_operand",
                 "large.matmul"):
        assert _plans(name) == ["contraction"], name
    assert _plans("matmul.float64.13x17x37") == ["reduction"]


def test_matmul_vector_loads_only_where_aligned() -> None:
    def shape(name: str) -> Any:
        p = next(p for p in all_programs() if p.name == name)
        (kernel,) = lower(list(p.comps), ["m"]).kernels
        return plan_kernel(kernel, CudaDialect())

    big = shape("cuda.matmul.large_tiles_vec")
    assert big.tiles.bm == 128 and big.aligned and (big.x_vector, big.y_vector) == ("k", "n")
    tr = shape("cuda.matmul.transposed_vec")
    assert (tr.x_vector, tr.y_vector) == ("m", "k")
    assert shape("cuda.matmul.batched_vec").contraction.batch
    un = shape("cuda.matmul.unaligned")
    assert not un.aligned and un.x_vector is None and un.y_vector is None
    assert shape("cuda.matmul.static_operand").x_vector == "k"


def test_launch_shapes() -> None:
    a, r = _f32("a", (10_000_000,)), _f32("r", (10_000_000,))
    (kernel,) = lower([ir.Comp.of(ir.apply(Op.EXP, a, into=r))], ["e"]).kernels
    launch = plan_kernel(kernel, CudaDialect()).launch
    assert launch.local_size == (256,)
    grid, block = cuda.grid_and_block(launch)
    assert block == (256, 1, 1)
    assert grid == (-(-10_000_000 // (256 * CudaDialect.grid_stride_unroll)), 1, 1)  # no cap per SM
    small = _f32("s", (10,))
    (k2,) = lower([ir.Comp.of(ir.apply(Op.EXP, small, into=_f32("t", (10,))))], ["s"]).kernels
    assert plan_kernel(k2, CudaDialect()).launch.local_size == (32,)


# ---------------------------------------------------------------------------
# Without a GPU: the kernels run on the host through the CUDA shim (tests/cuda/host_shim.h)


def _host_library(sources: Sequence[Source], directory: Path) -> ctypes.CDLL:
    """The generated kernels built for the host (tests/cuda/host_code.py)."""
    return ctypes.CDLL(str(host_code.build_library([s.text for s in sources], directory)))


def _kernel_args(spec: Any, arrays: dict[Node, Array], bindings: Any) -> list[Any]:
    """A kernel's arguments in signature order: buffers, merge buffer, statics."""
    args: list[Any] = [ctypes.c_void_p(arrays[n].ctypes.data) for n in spec.buffers]
    if spec.merge is not None:
        args.append(ctypes.c_void_p(arrays[spec.merge].ctypes.data))
    args += [ctypes.c_longlong(bindings[s]) for s in spec.statics]
    return args


def _emulate_group(lib: ctypes.CDLL, group: Sequence[CatalogProgram], lowered: LoweredBatch, source: Source,
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
                    grid, block = cuda.grid_and_block(spec.launch)
                    if len(spec.launch.global_size) == 1:
                        grid = (min(grid[0], 3), 1, 1)  # make the grid-stride loops stride
                    host_code.call_kernel(lib, spec.name, _kernel_args(spec, arrays, bindings), grid, block)
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


@pytest.mark.skipif(host_code.compiler() is None, reason="no C++ compiler for the host shim")
def test_generated_kernels_run_correctly_on_the_host_shim(emu_dir: Path) -> None:
    batches = _all_batches()
    chunks = [batches[k::4] for k in range(4)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        libs = list(pool.map(lambda ch: _host_library([b[2] for b in ch], emu_dir), chunks))
    problems: list[str] = []
    for lib, chunk in zip(libs, chunks):
        for group, lowered, source, spans in chunk:
            problems += _emulate_group(lib, group, lowered, source, spans)
    assert not problems, "\n".join(problems[:40])


# ---------------------------------------------------------------------------
# Without a GPU: host helpers of the driver (its end to end tests: tests/cuda)


def test_host_copy_splits_large_copies() -> None:
    src = np.random.default_rng(5).integers(0, 256, (9 << 20) + 7, dtype=np.uint8)
    dst = np.zeros_like(src)
    from polyjit.backends.cuda.staging import host_copy

    host_copy(dst, src)
    np.testing.assert_array_equal(dst, src)


def test_benchmark_without_a_gpu_says_why() -> None:
    proc = subprocess.run([sys.executable, "-m", "polyjit", "bench", "cuda"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "POLYJIT_CUDA_DISABLE": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "skipped, no CUDA device: disabled by POLYJIT_CUDA_DISABLE" in proc.stdout


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
    scenarios.check_tensor_plans_replay_a_graph(cuda_backend)


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
    ev.synchronize()
    assert ev.is_done()
    dev.synchronize()
    assert dev.is_idle()


class TestCudaConformance(ConformanceSuite):
    """The conformance kit on the real backend (its checks skip, with the reason, without a device)."""

    backend_name = "cuda"
