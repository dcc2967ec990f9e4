"""Generated source is safe and clean.

- No user text reaches generated source raw: hostile node names and computation names
  (comment terminators, line splices, trigraphs, preprocessor lines, constructors that
  call system(), NUL, CR, non-ASCII, RTL marks, 100k characters) come out of every
  dialect as sanitized comments and safe identifiers; the kernels still compile (gcc,
  PoCL, NVRTC), run on the CPU and OpenCL backends and match numpy, and no payload runs.
- NVRTC's buffers are fresh: after compiling, ``b" "`` is still a space. Generated code
  compiles without a warning: an empty NVRTC log for every program of the catalog, no
  gcc warning under -Wall -Wunused-function, and every helper a source defines is used.
- The C dialect's workaround for GCC's miscompiled reversed float reductions is keyed to
  the compiler, not to the dialect's name: a renamed subclass computes them right.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from polyjit.backends import get_backend
from polyjit.backends.cpu.dialect import CpuDialect
from polyjit.backends.cuda.dialect import CudaDialect
from polyjit.backends.opencl import OpenCLDialect
from polyjit.core import dtypes, ir
from polyjit.core.codegen import (
    COMMENT_MAX,
    IDENTIFIER_MAX,
    Dialect,
    Source,
    comment,
    comment_text,
    generate,
    kernel_identifier,
    row_group,
    segments,
)
from polyjit.core.ir import AccumOp, Node, Op
from polyjit.core.lower import LoweredBatch, lower
from polyjit.core.patterns import row_fusable, segmentable
from polyjit.core.runtime import Backend
from polyjit.testing.harness import group_programs, run_programs
from polyjit.testing.programs import CatalogProgram, catalog

Array = np.ndarray[Any, Any]

# ---------------------------------------------------------------------------
# Hostile text

_CTOR = ("__attribute__((constructor)) static void pj_evil(void) {{ extern int system(const char*); "
         'system("touch {marker}"); }}')

# {marker}: the path of a file that must never be created
HOSTILE_TEMPLATES: tuple[str, ...] = (
    "q\"uo'te`s",
    "end */ int pj_inject_1 = 1; /*",
    "x *\\\n/ " + _CTOR + " /* ",  # line splicing joins '*' and '/' before comments go
    "x *\\\r\n/ " + _CTOR + " /* ",
    "*/ " + _CTOR + " /*",
    "a\\\nb\\",
    "// line comment\nint pj_inject_2;\n",
    "\n#include <stdio.h>\nint pj_inject_3;\n",
    "\n#define float double\n",
    "\n#pragma omp parallel\n#error pj_inject_4\n",
    "nul\x00byte */ int pj_inject_5; /*",
    "cr\ronly */\r int pj_inject_6; /*",
    "x *??/\n/ int pj_inject_7; /* ??= ??( ??) ??' ??< ??> ??! ??-",
    "na\u00efve \u00f1 \u65e5\u672c\u8a9e \U0001f600 \u2028 \u2029 \x85",
    "rtl \u202e*/ int pj_inject_8; /*\u202d \u200f \u2066 \u2069",
    "esc \x1b[31m \x0b \x0c \x7f \ud800",
    "*\\\n/" + "y" * 100_000,
    "z" * 99_990 + "*\\\n/ int pj_inject_9; /*",
    "",
    "0123 starts with a digit",
)
# computation names that collide once sanitized, or that headers own as macros
COLLIDING_NAMES = ("a-b", "a_b", "a b", "a.b", "a\u00e9b", "M_PI", "CL_VERSION_1", "__FILE__", "_Bool")
# what may appear in generated source only inside a sanitized comment
PAYLOAD_TOKENS = ("pj_evil", "pj_inject", "system", "constructor", "stdio", "#define float", "#error",
                  "touch", "#pragma omp parallel\n")
_SAFE_COMMENT = re.compile(r"[A-Za-z0-9 _\-.,:;=+#()\[\]<>!%&|^~@$]*")


def hostile_texts(marker: Path) -> list[str]:
    return [t.replace("{marker}", str(marker)) for t in HOSTILE_TEMPLATES]


def _comp_for(name: str, k: int) -> tuple[ir.Comp, dict[Node, Array], dict[Node, Array]]:
    """A computation whose every node carries ``name``: a fused elementwise chain, a max
    over rows with its consumer (a row group, where the dialect makes them), a sum over columns,
    and an elementwise kernel of another size independent of the chain (a batch with it); its
    inputs and expected outputs."""
    rng = np.random.default_rng(k)
    x = Node(name, (4, 6), dtypes.float32)
    y = Node(name + "\\", (4, 6), dtypes.float32)
    t = Node(name + "*/", (4, 6), dtypes.float32)  # VIRTUAL: inlined
    out = Node(name, (4, 6), dtypes.float32)
    mx = Node(name, (4,), dtypes.float32)
    ex = Node(name + "*/", (4,), dtypes.float32)
    col = Node(name, (6,), dtypes.float32)
    z, neg = Node(name + "\\", (5,), dtypes.float32), Node(name, (5,), dtypes.float32)
    comp = ir.Comp.of(
        ir.apply(Op.MUL, x, y, into=t),
        ir.apply(Op.ADD, t, 1.5, into=out),
        ir.einsum("ij->i", out, into=mx, accum=AccumOp.MAX),
        ir.apply(Op.EXP, mx, into=ex),
        ir.einsum("ij->j", x, into=col),
        ir.apply(Op.NEG, z, into=neg),
        embedded=[out, mx, ex, col, neg],
    )
    xv = rng.uniform(-2, 2, x.shape).astype(np.float32)
    yv = rng.uniform(-2, 2, y.shape).astype(np.float32)
    zv = rng.uniform(-2, 2, z.shape).astype(np.float32)
    ov = xv * yv + np.float32(1.5)
    return comp, {x: xv, y: yv, z: zv}, {out: ov, mx: ov.max(axis=1), ex: np.exp(ov.max(axis=1)),
                                         col: xv.sum(axis=0), neg: -zv}


def _hostile_batch(marker: Path) -> tuple[list[ir.Comp], list[str], dict[Node, Array], dict[Node, Array]]:
    texts = hostile_texts(marker)
    names = [*texts, *COLLIDING_NAMES]
    comps: list[ir.Comp] = []
    inputs: dict[Node, Array] = {}
    expected: dict[Node, Array] = {}
    for k in range(len(names)):  # node names: the hostile texts again, in another order
        comp, ins, outs = _comp_for(texts[(k * 7) % len(texts)], k)
        comps.append(comp)
        inputs.update(ins)
        expected.update(outs)
    return comps, names, inputs, expected


# ---------------------------------------------------------------------------
# What safe source looks like


def _split_comments(text: str) -> tuple[str, list[str]]:
    """The source with its ``/* */`` comments blanked, and the comments' contents; every
    comment opens and closes on one line."""
    code_lines: list[str] = []
    comments: list[str] = []

    def blank(m: re.Match[str]) -> str:
        comments.append(m.group(1))
        return " "

    for line in text.split("\n"):
        code = re.sub(r"/\*(.*?)\*/", blank, line)
        assert "/*" not in code and "*/" not in code, f"a comment spans lines or is unbalanced: {line[:200]!r}"
        code_lines.append(code)
    return "\n".join(code_lines), comments


def assert_safe_source(source: Source) -> None:
    text = source.text
    assert re.fullmatch(r"[\x20-\x7e\n]*", text), "generated source holds a character outside printable ASCII"
    assert "\\" not in text and "??" not in text and "//" not in text and "\r" not in text
    code, comments = _split_comments(text)
    for c in comments:  # the dialects' own comments may hold an apostrophe; user text cannot
        assert len(c) <= COMMENT_MAX + 2 and _SAFE_COMMENT.fullmatch(c.replace("'", "")), c[:200]
    names = [k.name for k in source.all_kernels]
    assert len(set(names)) == len(names), "two kernels share a name"
    for name in names:
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) and len(name) <= IDENTIFIER_MAX, name[:200]
        assert not re.match(r"M_|CL_|_[A-Z_]", name), name
        assert len(re.findall(rf"\b{name}\(", code)) == 1, f"kernel {name} is not defined once"
        code = re.sub(rf"\b{name}\b", "KERNEL", code)  # an identifier: its letters may spell anything
    for token in PAYLOAD_TOKENS:
        assert token not in code, f"{token!r} reached the source outside a comment or a kernel name"


def _dialects() -> list[Dialect]:
    return [CpuDialect(), OpenCLDialect(), CudaDialect(), Dialect()]


# ---------------------------------------------------------------------------
# The renderers


def test_comment_text_keeps_only_a_safe_alphabet_and_is_capped() -> None:
    assert comment_text("x#3 add= mul (serial)") == "x#3 add= mul (serial)"
    for t in ("*\\\n/", "*/", "/*", "??/", "//", "\x00\r\n\u202e\u2028\\'\"`?"):
        out = comment_text(t)
        assert _SAFE_COMMENT.fullmatch(out) and len(out) == len(t), repr(out)
    long = comment_text("*/" * 100_000)
    assert len(long) == COMMENT_MAX and long.endswith("...") and "*" not in long and "/" not in long
    assert comment("a*/b\nc") == "/* a__b_c */"


def test_kernel_identifiers_are_safe_capped_unique_and_stable() -> None:
    taken: set[str] = set()
    assert kernel_identifier("comp_0", taken) == "comp_0"
    again = kernel_identifier("comp_0", taken)
    assert again != "comp_0" and again in taken
    hostile = ["a-b", "a_b!", "a b", "1abc", "", "\u00e9", "x" * 100_000, "x" * 100_001, "M_PI_2",
               "CL_VERSION_1_2", "__LINE__", "_Bool", "*/\\\n"]
    out = [kernel_identifier(h, taken) for h in hostile]
    assert len(set(out)) == len(out) and not set(out) & {"comp_0", again}
    for name in out:
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) and len(name) <= IDENTIFIER_MAX
        assert not re.match(r"M_|CL_|_[A-Z_]", name)
    assert kernel_identifier("a-b", set()) == out[0]  # a function of the name alone


# ---------------------------------------------------------------------------
# Hostile names through codegen, in every dialect


@pytest.fixture(scope="module")
def hostile_lowered(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoweredBatch, Path]:
    marker = tmp_path_factory.mktemp("safety") / "pwned"
    comps, names, _, _ = _hostile_batch(marker)
    # straight to lower(): the names skip the runtime's _c_name, so codegen alone must cope;
    # with the CPU's row groups and batches, whose kernels join their members' comments
    cpu = CpuDialect()
    lowered = lower(comps, names, rows=lambda k: row_fusable(k, cpu), segments=lambda k: segmentable(k, cpu))
    assert any(row_group(k) for k in lowered.kernels) and any(segments(k) for k in lowered.kernels)
    return lowered, marker


@pytest.mark.parametrize("dialect", _dialects(), ids=lambda d: f"{type(d).__name__}")
def test_hostile_names_reach_no_dialect_raw(hostile_lowered: tuple[LoweredBatch, Path], dialect: Dialect) -> None:
    lowered, marker = hostile_lowered
    source = generate(lowered, dialect)
    assert_safe_source(source)
    assert str(marker) not in source.text
    assert len(source.all_kernels) == len(lowered.kernels)


@pytest.mark.parametrize("dialect", _dialects(), ids=lambda d: f"{type(d).__name__}")
def test_hostile_names_through_the_lowerings_own_scratch(tmp_path: Path, dialect: Dialect) -> None:
    """Session 35's lowering makes nodes and comments of its own from a node's name: b laid out
    for a product (``<b>_t``, "<b> laid out [.., k, j]") and the parts of a reduction of short
    loops (``<s>_parts``). Hostile names stay out of the source there too."""
    from polyjit.core.runtime import _transposed_y

    marker = tmp_path / "pwned"
    texts = hostile_texts(marker)
    comps = []
    for text in texts:
        a, b, c = Node(f"{text}a", (64, 48)), Node(text, (40, 48)), Node(f"{text}c", (64, 40))
        x, t = Node(f"{text}x", (30, 30, 30, 30)), Node(text, ())
        comps.append(ir.Comp.of(ir.einsum("ik,jk->ij", a, b, into=c), ir.einsum("ijkl->", x, into=t)))
    lowered = lower(comps, [f"c{k}" for k in range(len(comps))],
                    transposes=lambda kern: _transposed_y(kern, CpuDialect()))
    assert any(k.name.endswith("_t") for k in lowered.kernels) and any(k.name.endswith("_parts") for k in lowered.kernels)
    source = generate(lowered, dialect)
    assert_safe_source(source)
    assert str(marker) not in source.text


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
def test_hostile_names_compile_in_c_without_warnings(hostile_lowered: tuple[LoweredBatch, Path],
                                                     tmp_path: Path) -> None:
    lowered, _ = hostile_lowered
    for dialect in (CpuDialect(), Dialect()):
        log = _gcc_warnings(generate(lowered, dialect).text, tmp_path)
        assert log == "", log


@pytest.mark.parametrize("shape", [(1 << 20,), (1024, 1024), (40000, 3)])
def test_the_base_dialects_openmp_kernels_compile(shape: tuple[int, ...], tmp_path: Path) -> None:
    """Kernels large enough for an OpenMP team, from the base dialect (C with OpenMP, whose
    loops are not ranged): the ``parallel for`` heads the loop, and no ``simd`` pragma comes
    between them (it did: "for statement expected before '#pragma'")."""
    a, b, o = Node("a", shape), Node("b", shape), Node("o", shape)
    t = Node("t", shape[::-1])
    move = ir.einsum("ij->ji" if len(shape) == 2 else "i->i", a, into=t)  # a transpose, in 2-D
    lowered = lower([ir.Comp.of(ir.apply(Op.ADD, a, b, into=o)), ir.Comp.of(move)], ["add", "move"])
    text = generate(lowered, Dialect()).text
    assert "#pragma omp parallel for" in text
    assert _gcc_warnings(text, tmp_path) == ""


def test_hostile_names_compile_with_nvrtc(hostile_lowered: tuple[LoweredBatch, Path]) -> None:
    cuda = _cuda_or_skip()
    lowered, _ = hostile_lowered
    source = generate(lowered, CudaDialect())
    assert cuda.nvrtc_log(source.text, "sm_90") == ""
    assert len(cuda.nvrtc_compile(source.text, "sm_90")) > 0
    _assert_space_is_a_space()


def _run_hostile_batch(backend: Backend, marker: Path) -> Source:
    comps, names, inputs, expected = _hostile_batch(marker)
    batch = backend.compile_batch(comps, names=names)
    assert not marker.exists()
    ctx = backend.get_device(0).make_context()
    for node, value in inputs.items():
        ctx = ctx.init_from_host(node, value)
    routines = ctx.link_batch(batch)  # loads the module: a constructor in it would run now
    for r in routines:
        r.run()
    for node, want in expected.items():
        got = next(r for r in routines if node in r.outputs).context.read(node)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=node.label[:80])
    assert not marker.exists(), "a payload in a name ran"
    return batch.source


def test_hostile_names_run_on_the_cpu_backend(tmp_path: Path) -> None:
    source = _run_hostile_batch(get_backend("cpu"), tmp_path / "pwned")
    assert_safe_source(source)


@pytest.mark.parametrize("splice", ["\\\n", "\\\r\n", "??/\n"], ids=["lf", "crlf", "trigraph"])
def test_a_constructor_in_a_node_name_never_runs(tmp_path: Path, splice: str) -> None:
    """The payload alone (so that it would compile): ``*`` + a line splice + ``/`` once
    ended the comment it was written into, and the constructor ran when the library loaded."""
    marker = tmp_path / "pwned"
    payload = "x *" + splice + "/ " + _CTOR.format(marker=marker) + " /* "
    backend = get_backend("cpu")
    x, y = Node("x", (5,), dtypes.float32), Node(payload, (5,), dtypes.float32)
    code = backend.compile(ir.Comp.of(ir.apply(Op.NEG, x, into=y)), name=payload)
    values = np.arange(5, dtype=np.float32)
    r = backend.get_device(0).make_context().init_from_host(x, values).link(code)
    r.run()
    np.testing.assert_array_equal(r.context.read(y), -values)
    assert not marker.exists(), "the constructor in the node name ran"
    assert_safe_source(code.batch.source)


def test_hostile_names_run_on_the_opencl_backend(tmp_path: Path) -> None:
    pytest.importorskip("pyopencl")
    backend = get_backend("opencl")
    if backend.num_devices() == 0:
        pytest.skip("no OpenCL device")
    source = _run_hostile_batch(backend, tmp_path / "pwned")
    assert_safe_source(source)


def test_a_source_with_a_control_character_is_refused() -> None:
    """The last line of defence: a dialect that writes user text raw is caught in generate()."""
    from polyjit.core.errors import CompileError

    class Leaky(Dialect):
        def prelude(self, batch_dtypes: set[dtypes.DType]) -> list[str]:
            return ["/* \u202e */", *super().prelude(batch_dtypes)]

    x, y = Node("x", (3,)), Node("y", (3,))
    with pytest.raises(CompileError, match="generated source"):
        generate(lower([ir.Comp.of(ir.apply(Op.NEG, x, into=y))], ["c"]), Leaky())


def test_a_dtype_built_by_hand_writes_no_type_names() -> None:
    from polyjit.core.dtypes import DType
    from polyjit.core.errors import UnsupportedError

    forged = DType("float32", np.dtype(np.float32), "float; int pj_inject_10", "float", "float", True, True)
    x, y = Node("x", (3,), forged), Node("y", (3,), forged)
    lowered = lower([ir.Comp.of(ir.apply(Op.NEG, x, into=y))], ["c"])
    for dialect in _dialects():
        with pytest.raises(UnsupportedError, match="dtype"):
            generate(lowered, dialect)


# ---------------------------------------------------------------------------
# Clean code: no warnings, no unused helpers, NVRTC's buffers


def _catalog_batches(size: int = 48) -> Iterator[LoweredBatch]:
    for group in group_programs(catalog(), size):
        comps: list[ir.Comp] = []
        names: list[str] = []
        for pk, p in enumerate(group):
            for ck, c in enumerate(p.comps):
                comps.append(c)
                names.append(f"p{pk}_{ck}_{p.name.replace('.', '_')}")
        yield lower(comps, names)


def _assert_space_is_a_space() -> None:
    """NVRTC never wrote into the interpreter's shared one-byte ``b" "``. ``bytes([32]) == b" "``
    alone cannot tell: both sides are that same cached object, whatever it holds."""
    assert bytes([32]) == b" "
    assert list(b" ") == [32] and b" " != b"\x00" and b"a b".split(b" ") == [b"a", b"b"]


def _cuda_or_skip() -> Any:
    from polyjit.backends import cuda
    from polyjit.core.errors import BackendUnavailableError

    try:
        cuda.nvrtc_version()
    except BackendUnavailableError as e:
        pytest.skip(str(e))
    return cuda


def _gcc_warnings(text: str, tmp: Path) -> str:
    src = tmp / "kernels.c"
    src.write_text(text)
    flags = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-std=gnu11", "-fno-math-errno",
             "-Wall", "-Wunused-function"]
    proc = subprocess.run(["gcc", *flags, "-c", "-o", str(tmp / "kernels.o"), str(src)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[:4000]
    return (proc.stdout + proc.stderr).strip()


def _defined_helpers(text: str) -> list[str]:
    """Names of the file-scope functions and macros a source defines, other than kernels."""
    code, _ = _split_comments(text)
    funcs = re.findall(r"^static[^(=;]*?\b(pj_\w+)\(", code, re.M)
    macros = re.findall(r"^#define (\w+)", code, re.M)
    return funcs + macros


def test_every_helper_a_source_defines_is_used() -> None:
    for lowered in _catalog_batches():
        for dialect in _dialects():
            text = generate(lowered, dialect).text
            code, _ = _split_comments(text)
            for name in _defined_helpers(text):
                uses = len(re.findall(rf"\b{name}\b", code))
                assert uses >= 2, f"{dialect.name}: {name} is defined but never used"


def test_nvrtc_log_is_empty_for_every_catalog_program() -> None:
    cuda = _cuda_or_skip()
    for lowered in _catalog_batches():
        text = generate(lowered, CudaDialect()).text
        log = cuda.nvrtc_log(text, "sm_90")
        assert log == "", log[:3000]
        _assert_space_is_a_space()
    assert len(cuda.nvrtc_compile(text, "sm_90", kind="ptx")) > 0
    _assert_space_is_a_space()


def test_nvrtc_reads_into_fresh_buffers() -> None:
    """An empty log is one byte (a NUL): it must not be written into the shared b" "."""
    cuda = _cuda_or_skip()
    text = 'extern "C" __global__ void pj_k(float* x) { x[threadIdx.x] = 1.0f; }\n'
    for kind in ("cubin", "ptx"):
        from polyjit.backends.cuda import nvrtc

        assert nvrtc._run(text, ("--gpu-architecture=sm_90", "-lineinfo"), kind, "t.cu")[0]
        _assert_space_is_a_space()
    assert cuda.nvrtc_log(text) == ""
    _assert_space_is_a_space()


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
def test_c_dialect_compiles_without_warnings(tmp_path: Path) -> None:
    for k, lowered in enumerate(_catalog_batches()):
        if k % 2:  # every other batch: each is a few seconds of gcc -O3
            continue
        log = _gcc_warnings(generate(lowered, CpuDialect()).text, tmp_path)
        assert log == "", log[:4000]


# ---------------------------------------------------------------------------
# Compiler workarounds keyed to the compiler


class RenamedCpuDialect(CpuDialect):
    """A user's CPU dialect under another name: it must emit the same safe code."""

    name = "mycpu"


def _reversed_reductions() -> list[CatalogProgram]:
    progs = [p for p in catalog() if p.name.startswith("reduce.reversed")]
    assert len(progs) >= 8
    return progs


def test_renamed_c_dialect_emits_the_gcc_workaround() -> None:
    progs = _reversed_reductions()
    comps = [c for p in progs for c in p.comps]
    lowered = lower(comps, [f"c{k}" for k in range(len(comps))])
    plain, renamed = generate(lowered, CpuDialect()).text, generate(lowered, RenamedCpuDialect()).text
    assert "no-tree-loop-vectorize" in renamed and "__GNUC__" in renamed
    assert renamed == plain
    for batch in _catalog_batches():  # the same code for every program, not only these
        assert generate(batch, RenamedCpuDialect()).text == generate(batch, CpuDialect()).text
    for other in (OpenCLDialect(), CudaDialect()):
        text = generate(lowered, other).text
        assert "no-tree-loop-vectorize" not in text and "#pragma omp" not in text


def test_renamed_cpu_dialect_sums_reversed_reductions_right() -> None:
    from polyjit.backends.cpu import CpuDriver

    driver = CpuDriver()
    driver.dialect = RenamedCpuDialect()
    backend = Backend(driver)
    assert backend.driver.dialect.name == "mycpu"
    failures = run_programs(backend, _reversed_reductions())  # against the numpy reference
    assert not failures, "\n".join(str(f) for f in failures)


def test_renamed_cpu_dialect_matches_numpy_on_a_reversed_nested_sum() -> None:
    from polyjit.backends.cpu import CpuDriver

    driver = CpuDriver()
    driver.dialect = RenamedCpuDialect()
    backend = Backend(driver)
    for dt in (np.float32, np.float64):
        yy, nest = Node("yy", (20, 16), dt), Node("nest", (), dt)
        s0, s1 = ir.Symbol("s0"), ir.Symbol("s1")
        comp = ir.Comp.of(ir.Accum(nest, AccumOp.ADD, Op.ID, (yy,),
                                   ir.projections([(s0, 20), (s1, 16)], [], [s0, ir.affine((-1, s1), const=15)])))
        values = np.random.default_rng(0).integers(-8, 8, yy.shape).astype(dt)
        ctx = backend.get_device(0).make_context().init_from_host(yy, values)
        r = ctx.link(backend.compile(comp, name="rev"))
        r.run()
        assert r.context.read(nest) == values.sum()
