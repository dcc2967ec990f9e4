"""Neural-network functions built from the primitive ops: softmax, cross-entropy, one-hot,
embedding lookup, and small layer helpers.

Mixed precision: a layer built with ``compute_dtype="float16"`` (or ``"bfloat16"``) keeps
its parameters (the master weights) in their own dtype, float32 by default, and casts them
to ``compute_dtype`` in the forward pass, its input too: activations are half, and the
gradients that reach the parameters come back through the casts in float32, so the
optimizer updates float32 weights. Compute the loss in float32 (``logits.astype("float32")``)
and, where small gradients would vanish in float16, scale it: ``compile(...,
loss_scale=...)``."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from polyjit.core import dtypes, ir
from polyjit.core.dtypes import as_dtype
from polyjit.core.errors import DTypeMismatchError, ShapeMismatchError
from polyjit.core.ir import Op
from polyjit.tensor import ops
from polyjit.tensor.init import Init
from polyjit.tensor.tensor import DTypeLike, IndexBound, Tensor, arange, param, tensor_arg


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    """exp(x - max) / sum(exp(x - max)): the max (with no gradient) keeps exp from overflowing."""
    x = tensor_arg(x, "softmax")
    z = x - ops.detach(ops.max(x, axis, keepdims=True))
    e = ops.exp(z)
    return e / ops.sum(e, axis, keepdims=True)


def log_softmax(x: Tensor, axis: int = -1) -> Tensor:
    """x - max - log(sum(exp(x - max))), numerically stable for large logits."""
    x = tensor_arg(x, "log_softmax")
    z = x - ops.detach(ops.max(x, axis, keepdims=True))
    return z - ops.log(ops.sum(ops.exp(z), axis, keepdims=True))


def one_hot(indices: Tensor, depth: int, dtype: DTypeLike = dtypes.float32) -> Tensor:
    """``out[..., c] = 1 if indices[...] == c else 0``: a comparison against a Range, cast to dtype.

    The IR indexes only with affine expressions, so a lookup by tensor values
    goes through a one-hot matrix (fine for small vocabularies). Indices fed from an
    input are checked on the host: outside ``0..depth-1`` is an ``IndexOutOfRangeError``.
    """
    return _one_hot(indices, depth, dtype, f"one_hot of depth {depth}")


def _one_hot(indices: Tensor, depth: int, dtype: DTypeLike, what: str) -> Tensor:
    """one_hot, its indices bounded by ``depth`` (``what`` names the use in error messages)."""
    indices = tensor_arg(indices, what)
    if indices.dtype.is_float or indices.dtype.is_bool:
        raise DTypeMismatchError(f"one_hot needs integer indices, got {indices.dtype}")
    # One comparison per cell, reading indices[...] and range[c]: both inline into the cast's kernel.
    hit = ops.indexed(Op.EQ, (*indices.shape, depth),
                      [(indices, lambda s: tuple(ir.as_affine(v) for v in s[:-1])),
                       (arange(depth, indices.dtype), lambda s: (ir.as_affine(s[-1]),))], name="one_hot")
    hit.index_bounds = (IndexBound(indices, depth, what),)
    return ops.cast(hit, dtype)


def embedding(indices: Tensor, table: Tensor) -> Tensor:
    """Rows of ``table`` (vocab x dim) picked by integer ``indices`` (``take``: a gather; the
    gradient adds each row of the incoming gradient into the row it came from)."""
    table, indices = tensor_arg(table, "embedding's table"), tensor_arg(indices, "embedding's indices")
    if table.ndim != 2:
        raise ShapeMismatchError(f"an embedding table is 2-D (vocab, dim), got {table.shape}")
    vocab = table.shape[0]
    out = ops.take(table, indices, name="embedding")
    out.index_bounds = (IndexBound(indices, vocab, f"embedding of a vocabulary of {vocab}"),)
    return out


def cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean over the batch of -log softmax(logits)[label], with integer labels of shape logits.shape[:-1]."""
    logits, labels = tensor_arg(logits, "cross_entropy's logits"), tensor_arg(labels, "cross_entropy's labels")
    if labels.shape != logits.shape[:-1]:
        raise ShapeMismatchError(f"labels of shape {labels.shape} for logits of shape {logits.shape}")
    z = logits - ops.detach(ops.max(logits, -1, keepdims=True))
    lse = ops.log(ops.sum(ops.exp(z), -1, keepdims=True))
    n = logits.shape[-1]
    hot = _one_hot(labels, n, logits.dtype, f"cross_entropy labels over {n} classes")  # for the gradient
    rows = math.prod(labels.shape)
    scale = 1.0 / rows if rows else math.nan  # the mean of no rows is NaN, as pt.mean's, numpy's and torch's
    # z at each label, picked by a gather from z's flat view (one logit a row): rows terms to
    # sum, not rows * n products with a one-hot
    at_dtype = dtypes.int32 if rows * n < 2**31 else dtypes.int64
    at = ops.cast(labels.reshape(rows), at_dtype) + arange(rows, at_dtype) * n
    picked = ops.take(z.reshape(rows * n, 1), at, name="label_logit")
    # the forward pass reads the labels too: a plan without an optimizer checks them as well
    picked.index_bounds = (IndexBound(labels, n, f"cross_entropy labels over {n} classes"),)
    loss = ops.elementwise(Op.MUL, ops.sum(lse.reshape(rows, 1) - picked), scale, name="cross_entropy")

    def backward(g: Tensor, needs: Sequence[bool]) -> list[Tensor | None]:
        # d loss / d logits = (softmax - one_hot) / n: one fused kernel instead of the chain
        # rule through log, sum, exp and the max.
        return [None, (ops.exp(z - lse) - hot) * (g * scale) if needs[1] else None]

    # An alias of the loss whose gradient skips the forward graph (its parent only for ordering).
    return Tensor(loss.node, (), (loss, logits), backward, name="cross_entropy")


def accuracy_count(logits: Tensor, labels: Tensor) -> Tensor:
    """How many rows have their label's logit at the row max (a float count; ties count as hits)."""
    logits, labels = tensor_arg(logits, "accuracy_count's logits"), tensor_arg(labels, "accuracy_count's labels")
    best = ops.max(logits, -1, keepdims=True)
    at_max = ops.cast(ops.equal(logits, best), logits.dtype)
    n = logits.shape[-1]
    return ops.sum(at_max * _one_hot(labels, n, logits.dtype, f"accuracy_count labels over {n} classes"))


class Linear:
    """``x @ W + b`` with Glorot-initialised W and zero b. With ``compute_dtype``, W, b and x
    are cast to it in the forward pass (mixed precision: W and b stay ``dtype``)."""

    def __init__(self, name: str, n_in: int, n_out: int, *, bias: bool = True, init: Init = "glorot",
                 dtype: DTypeLike = dtypes.float32, seed: int | None = None,
                 compute_dtype: DTypeLike | None = None) -> None:
        self.weight = param(f"{name}.weight", (n_in, n_out), init, dtype=dtype, rng=seed)
        self.bias = param(f"{name}.bias", (n_out,), "zeros", dtype=dtype) if bias else None
        self.compute_dtype = as_dtype(compute_dtype) if compute_dtype is not None else None

    def __call__(self, x: Tensor) -> Tensor:
        cd = self.compute_dtype
        w, b = self.weight, self.bias
        if cd is not None:
            x, w = ops.cast(x, cd), ops.cast(w, cd)
            b = ops.cast(b, cd) if b is not None else None
        y = ops.matmul(x, w)
        return y + b if b is not None else y

    @property
    def params(self) -> list[Tensor]:
        return [self.weight] + ([self.bias] if self.bias is not None else [])


class MLP:
    """Linear layers with an activation between them (none after the last); ``compute_dtype``
    makes each layer run in it (mixed precision, see the module docstring)."""

    def __init__(self, name: str, sizes: Sequence[int], activation: str = "relu",
                 dtype: DTypeLike = dtypes.float32, seed: int | None = None,
                 compute_dtype: DTypeLike | None = None) -> None:
        self.layers = [
            Linear(f"{name}.{k}", a, b, dtype=dtype, init="he" if activation == "relu" else "glorot",
                   seed=None if seed is None else seed + k, compute_dtype=compute_dtype)
            for k, (a, b) in enumerate(itertools.pairwise(sizes))
        ]
        self.activation = {"relu": ops.relu, "tanh": ops.tanh, "sigmoid": ops.sigmoid}[activation]

    def __call__(self, x: Tensor) -> Tensor:
        for k, layer in enumerate(self.layers):
            x = layer(x)
            if k < len(self.layers) - 1:
                x = self.activation(x)
        return x

    @property
    def params(self) -> list[Tensor]:
        return [p for layer in self.layers for p in layer.params]
