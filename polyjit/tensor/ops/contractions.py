"""Contractions: ``einsum`` and ``matmul`` (``ir.einsum``), with their gradients."""

from __future__ import annotations

from collections.abc import Sequence

from polyjit.core import ir
from polyjit.core.errors import (
    InvalidArgumentError,
    InvalidProgramError,
    ShapeMismatchError,
    UnsupportedError,
)
from polyjit.core.ir import Affine, Symbol
from polyjit.tensor.ops.indexing import gather, scatter_add, transpose
from polyjit.tensor.ops.shape import reshape
from polyjit.tensor.tensor import Tensor, tensor_arg


def _parse_einsum(spec: str, count: int) -> tuple[list[str], str]:
    """The operands' letters and the output's, each misuse a typed error (a bad spec raised a
    bare KeyError, ValueError or TypeError) naming the spec."""
    if not isinstance(spec, str):
        raise InvalidArgumentError(f"einsum's spec is a str such as 'ik,kj->ij', got {type(spec).__name__}")
    if count == 0:
        raise InvalidProgramError(f"einsum {spec!r} of no operands")
    if spec.count("->") != 1:
        raise InvalidProgramError(f"einsum spec {spec!r} needs one explicit '->' output")
    lhs, out = spec.replace(" ", "").split("->")
    ins = lhs.split(",")
    if len(ins) != count:
        raise InvalidProgramError(f"einsum {spec!r} names {len(ins)} operands, got {count}")
    unknown = sorted(set(out) - set(lhs) | set(out) & {","})
    if unknown:
        raise InvalidProgramError(f"einsum {spec!r}: output letter(s) {', '.join(map(repr, unknown))} name no operand's axis")
    if len(set(out)) != len(out):  # numpy refuses it too: an output axis is one letter
        raise InvalidProgramError(f"einsum {spec!r}: a letter repeats in the output")
    return ins, out


def einsum(spec: str, *operands: Tensor, name: str = "einsum") -> Tensor:
    """``einsum("ik,kj->ij", a, b)``: multiply, sum over the letters the output drops (one or two operands)."""
    ins, out = _parse_einsum(spec, len(operands))
    operands = tuple(tensor_arg(t, f"einsum {spec!r}") for t in operands)
    extents: dict[str, int] = {}
    for letters, t in zip(ins, operands):
        if len(letters) != t.ndim:
            raise ShapeMismatchError(f"einsum {spec!r}: {letters!r} for a tensor of shape {t.shape}")
        for ch, n in zip(letters, t.shape):
            if extents.setdefault(ch, n) != n:
                raise ShapeMismatchError(f"einsum {spec!r}: axis {ch!r} has sizes {extents[ch]} and {n}")
    shape = tuple(extents[ch] for ch in out)
    node = ir.Node(name, shape, operands[0].dtype)
    assign = ir.einsum(f"{','.join(ins)}->{out}", *(t.node for t in operands), into=node)

    def backward(g: Tensor, needs: Sequence[bool]) -> list[Tensor | None]:
        grads: list[Tensor | None] = []
        for k, (letters, t) in enumerate(zip(ins, operands)):
            if not needs[k]:
                grads.append(None)
                continue
            others = [(ins[j], operands[j]) for j in range(len(operands)) if j != k]
            grads.append(_einsum_grad(g, out, others, letters, t.shape))
        return grads

    return Tensor(node, (assign,), operands, backward if node.dtype.is_float else None)


def _einsum_grad(
    g: Tensor, out: str, others: Sequence[tuple[str, Tensor]], letters: str, shape: tuple[int, ...]
) -> Tensor:
    """d/d(operand): einsum of the output gradient with the other operands, broadcast over the
    letters only this operand has, then placed on the diagonal of a letter it repeats."""
    avail = set(out).union(*(set(s) for s, _ in others))
    uniq = "".join(dict.fromkeys(letters))
    present = "".join(ch for ch in uniq if ch in avail)
    spec = ",".join([out, *(s for s, _ in others)]) + "->" + present
    r = einsum(spec, g, *(t for _, t in others), name="d_einsum")
    extent = dict(zip(letters, shape))
    if present != uniq:
        def spread(syms: Sequence[Symbol]) -> tuple[Affine, ...]:
            return tuple(ir.as_affine(syms[uniq.index(ch)]) for ch in present)

        r = gather(r, tuple(extent[ch] for ch in uniq), spread, name="d_einsum_bcast")
    if uniq == letters:
        return r

    # "ii": only the diagonal was read, so only it gets a gradient (the rest stays 0)
    def diagonal(syms: Sequence[Symbol]) -> tuple[Affine, ...]:
        return tuple(ir.as_affine(syms[uniq.index(ch)]) for ch in letters)

    return scatter_add(r, shape, diagonal, name="d_einsum_diag")


_BATCH_LETTERS = "pqrstuvw"


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` as numpy does for 1-D and 2-D operands and batched stacks (batch shapes equal,
    or one operand without batch axes)."""
    a, b = tensor_arg(a, "matmul"), tensor_arg(b, "matmul")
    if a.ndim == 0 or b.ndim == 0:
        raise ShapeMismatchError("matmul of a 0-d tensor; use *")
    a2 = reshape(a, (1, a.shape[0])) if a.ndim == 1 else a
    b2 = reshape(b, (b.shape[0], 1)) if b.ndim == 1 else b
    if a2.shape[-1] != b2.shape[-2]:
        raise ShapeMismatchError(f"matmul of {a.shape} and {b.shape}: inner sizes differ")
    ba, bb = a2.shape[:-2], b2.shape[:-2]
    if ba and not bb:
        # A stack times one matrix is one tall matmul: (batch*n, k) @ (k, m), both reshapes inlined;
        # its weight gradient becomes a plain 2-D contraction too.
        flat = _matmul_core(reshape(a2, (-1, a2.shape[-1])), b2, "ik", "kj", "ij")
        out = reshape(flat, (*ba, a2.shape[-2], b2.shape[-1]))
        return reshape(out, out.shape[:-1]) if b.ndim == 1 else out
    if ba and bb and ba != bb:
        raise UnsupportedError(f"matmul batch shapes {ba} and {bb} must be equal (or one absent)")
    batch = ba or bb
    if len(batch) > len(_BATCH_LETTERS):
        raise UnsupportedError(f"matmul with {len(batch)} batch axes")
    letters = _BATCH_LETTERS[: len(batch)]
    sa, sb = (letters if ba else "") + "ik", (letters if bb else "") + "kj"
    so = letters + "ij"
    out = _matmul_core(a2, b2, sa, sb, so)
    if a.ndim == 1:
        out = reshape(out, out.shape[:-2] + out.shape[-1:])
    if b.ndim == 1:
        out = reshape(out, out.shape[:-1])
    return out


def _matmul_core(a: Tensor, b: Tensor, sa: str, sb: str, so: str) -> Tensor:
    shape_out = tuple({**dict(zip(sa, a.shape)), **dict(zip(sb, b.shape))}[ch] for ch in so)
    node = ir.Node("matmul", shape_out, a.dtype)
    assign = ir.einsum(f"{sa},{sb}->{so}", a.node, b.node, into=node)

    def backward(g: Tensor, needs: Sequence[bool]) -> list[Tensor | None]:
        ga = gb = None
        if needs[0]:
            # g @ b^T with b^T stored: the contraction then runs on contiguous rows (tiled kernels).
            bt = transpose(b, tuple(range(b.ndim - 2)) + (b.ndim - 1, b.ndim - 2))
            ga = einsum(f"{so},{sb[:-2]}jk->{sa}", g, bt, name="d_matmul_a")
        if needs[1]:
            gb = einsum(f"{sa},{so}->{sb}", a, g, name="d_matmul_b")
        return [ga, gb]

    return Tensor(node, (assign,), (a, b), backward if node.dtype.is_float else None)
