"""Your own kernels: ``Backend.raw_kernel`` turns a user's source (C for cpu, OpenCL C, CUDA C)
into a :class:`~polyjit.core.routine.Code` that ``Context.link`` takes like generated code.

The user names the kernel, its buffer parameters as nodes in the kernel's parameter order,
each read, written or both (:func:`read`, :func:`write`, :func:`read_write`, or
``(node, "r" | "w" | "rw")``), then its int64 statics (``ir.StaticSymbol``, bound through
``routine.bindings``), and its launch shape. The source is compiled through the backend's
compile cache, and a linked routine takes part in the per-node events like a generated one.

polyjit adds nothing to the source but the parameter binding, which is the dialect's
(``Dialect.raw_binding``; a driver's ``raw_source`` may refuse): on cpu a trampoline that
unpacks the runtime's argument array into the user's function's parameters; on OpenCL
sub-buffers of the pools, on CUDA base + offset pointers, bound when the routine is linked.
The kernel name is the one user string that can reach generated text: it must be a C
identifier.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from polyjit.core import patterns
from polyjit.core.codegen import (
    IDENTIFIER_MAX,
    KernelPlan,
    KernelSpec,
    LaunchShape,
    Source,
    c_trampoline,
)
from polyjit.core.dtypes import is_int
from polyjit.core.errors import BindingError, CompileError, InvalidArgumentError
from polyjit.core.ir import Node, StaticSymbol
from polyjit.core.log import log_source
from polyjit.core.loops import LoweredBatch, LoweredComp
from polyjit.core.routine import Code, CodeBatch, check_binding

if TYPE_CHECKING:
    from polyjit.core.runtime import Backend

__all__ = ["RAW", "Param", "c_trampoline", "raw_code", "raw_source", "read", "read_write", "write"]

RAW = "raw"  # the KernelPlan kind of a user's kernel: its launch shape is the user's, exactly
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ACCESS = {"r": "r", "read": "r", "w": "w", "write": "w", "rw": "rw", "readwrite": "rw", "read_write": "rw"}
_SUFFIX = {"c": ".c", "opencl": ".cl", "cuda": ".cu"}


@attrs.frozen
class Param:
    """A buffer parameter of a user's kernel: a node, read (``"r"``), written (``"w"``) or both."""

    node: Node
    access: str

    @property
    def reads(self) -> bool:
        return "r" in self.access

    @property
    def writes(self) -> bool:
        return "w" in self.access


def read(node: Node) -> Param:
    return Param(node, "r")


def write(node: Node) -> Param:
    return Param(node, "w")


def read_write(node: Node) -> Param:
    return Param(node, "rw")


def raw_source(driver: Any, text: str, spec: KernelSpec) -> tuple[str, str]:
    """The source to compile and its entry point for the user's kernel ``spec.name``: the
    driver's (``Driver.raw_source``, which may refuse), else its dialect's binding
    (``Dialect.raw_binding``: the calling convention its ``kernel_open`` spells)."""
    hook = getattr(driver, "raw_source", None)
    if hook is None:
        return driver.dialect.raw_binding(text, spec)
    out, entry = hook(text, spec)
    return str(out), str(entry)


def _params(params: Any) -> tuple[Param, ...]:
    if isinstance(params, (str, bytes, Node, Param)) or not isinstance(params, Sequence):
        raise InvalidArgumentError(
            f"raw_kernel: params must be a sequence of raw.read(node) / raw.write(node) / "
            f"(node, 'r' | 'w' | 'rw'), in the kernel's parameter order; got {type(params).__name__}")
    out: list[Param] = []
    for k, p in enumerate(params):
        if isinstance(p, tuple) and len(p) == 2:
            node, access = p
            if not isinstance(access, str) or access.lower() not in _ACCESS:
                raise InvalidArgumentError(f"raw_kernel: parameter {k}: access {access!r} is not 'r', 'w' or 'rw'")
            p = Param(node, _ACCESS[access.lower()])
        if not isinstance(p, Param) or not isinstance(p.node, Node):
            raise InvalidArgumentError(f"raw_kernel: parameter {k} is {p!r}, not a node with its access")
        if p.access not in ("r", "w", "rw"):
            raise InvalidArgumentError(f"raw_kernel: parameter {k}: access {p.access!r} is not 'r', 'w' or 'rw'")
        if any(q.node is p.node for q in out):
            raise InvalidArgumentError(f"raw_kernel: {p.node.label} is given twice; pass it once, as 'rw'")
        out.append(p)
    return tuple(out)


def _size(value: Any, what: str, most: int) -> tuple[int, ...] | None:
    if value is None:
        return None
    dims = (value,) if not isinstance(value, Sequence) else tuple(value)
    if not 1 <= len(dims) <= 3 or any(not is_int(d) or not 1 <= d <= most for d in dims):
        raise InvalidArgumentError(f"raw_kernel: {what} must be 1 to 3 integers in [1, {most}], not {value!r}")
    return tuple(int(d) for d in dims)


def _launch(global_size: Any, local_size: Any, needs_shape: bool, most: int) -> LaunchShape:
    glob, local = _size(global_size, "global_size", most), _size(local_size, "local_size", most)
    if glob is None:
        if needs_shape:
            raise InvalidArgumentError("raw_kernel: this backend launches work-items: give global_size")
        if local is not None:
            raise InvalidArgumentError("raw_kernel: local_size without global_size")
        return LaunchShape()
    if local is not None and (len(local) != len(glob) or any(g % b for g, b in zip(glob, local))):
        raise InvalidArgumentError(
            f"raw_kernel: global_size {glob} must have local_size's {len(local)} dimensions and "
            f"be a multiple of local_size {local} in each")
    return LaunchShape(glob, local)


def _text(source: Any, name: str) -> tuple[str, str]:
    """(the source text, what error messages call it)."""
    if isinstance(source, os.PathLike):
        path = Path(source)
        try:
            return path.read_text(), str(path)
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidArgumentError(f"raw_kernel: cannot read the source file {str(path)!r}: {e}") from e
    if not isinstance(source, str):
        raise InvalidArgumentError(f"raw_kernel: source must be a str or a path, not {type(source).__name__}")
    return source, f"<raw kernel {name}>"


def raw_code(backend: Backend, source: str | os.PathLike[str], name: str, params: Sequence[Any], *,
             global_size: int | Sequence[int] | None = None, local_size: int | Sequence[int] | None = None,
             statics: Sequence[StaticSymbol] = (),
             bindings: Mapping[StaticSymbol, int] | None = None) -> Code:
    """See :meth:`Backend.raw_kernel`."""
    if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name) or len(name) > IDENTIFIER_MAX:
        raise InvalidArgumentError(
            f"raw_kernel: the kernel name {name!r} is not a C identifier of at most {IDENTIFIER_MAX} characters")
    text, origin = _text(source, name)
    if "\x00" in text:
        raise InvalidArgumentError(f"raw_kernel: the source of {name} ({origin}) holds a NUL character")
    ps = _params(params)
    if isinstance(statics, (str, StaticSymbol)) or not isinstance(statics, Sequence):
        raise InvalidArgumentError(f"raw_kernel: statics must be a sequence of ir.StaticSymbol, not {statics!r}")
    syms = tuple(statics)
    if any(not isinstance(s, StaticSymbol) for s in syms) or len(set(syms)) != len(syms):
        raise InvalidArgumentError(f"raw_kernel: statics must be distinct ir.StaticSymbol, not {syms!r}")
    if bindings is not None and not isinstance(bindings, Mapping):
        raise BindingError(f"raw_kernel {name}: bindings are a mapping (ir.StaticSymbol -> int), "
                           f"not {type(bindings).__name__}")
    given = dict(bindings or {})
    unknown = [s for s in given if s not in syms]
    if unknown:
        raise BindingError(f"raw_kernel {name}: bindings for {unknown!r}, which are not among its statics {syms!r}")
    checked = {s: check_binding(f"raw_kernel {name}", s, v) for s, v in given.items()}
    driver = backend.driver
    launch = _launch(global_size, local_size, needs_shape=driver.dialect.mapping != patterns.LOOPS,
                     most=driver.dialect.max_work_items)
    nodes = tuple(p.node for p in ps)
    written = tuple(p.node for p in ps if p.writes)
    reads = tuple(p.node for p in ps if p.reads)
    spec = KernelSpec(name, nodes, None, syms, launch, written, reads, KernelPlan(RAW, launch))
    text, entry = raw_source(driver, text, spec)
    spec = attrs.evolve(spec, name=entry)
    src = Source(text, driver.dialect.name, ((spec,),))
    log_source(f"{backend.name} raw kernel {name}", text, _SUFFIX.get(src.dialect, ".txt"))
    try:
        binary = backend.driver_compile(f"compile of raw kernel {name}", src)
    except CompileError as e:
        raise CompileError(f"raw kernel {name} from {origin}: {e}", source=e.source, log=e.log) from e
    comp = LoweredComp(name, (), reads, written, (), (), None, written)  # a user's kernel may write any cells
    batch = CodeBatch(backend, LoweredBatch((comp,), {}), src, binary, (name,), (checked,))
    return Code(batch, 0)
