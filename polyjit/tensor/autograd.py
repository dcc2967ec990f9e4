"""Reverse-mode gradients: walk the graph from the loss back to the parameters, building the
gradient of every tensor on the way as more tensors (more IR assignments)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from polyjit.core.errors import InvalidArgumentError, InvalidProgramError, ShapeMismatchError
from polyjit.tensor.tensor import Tensor, full


def topo_order(roots: Iterable[Tensor]) -> list[Tensor]:
    """Every tensor the roots depend on, parents before children (iterative: graphs may be deep)."""
    order: list[Tensor] = []
    state: dict[Tensor, bool] = {}  # False: on the stack, True: done
    for root in roots:
        if root in state:
            continue
        stack: list[tuple[Tensor, int]] = [(root, 0)]
        state[root] = False
        while stack:
            t, k = stack[-1]
            if k < len(t.parents):
                stack[-1] = (t, k + 1)
                p = t.parents[k]
                if p not in state:
                    state[p] = False
                    stack.append((p, 0))
            else:
                stack.pop()
                state[t] = True
                order.append(t)
    return order


def grad(loss: Tensor, wrt: Sequence[Tensor], seed: Tensor | None = None) -> list[Tensor]:
    """The gradients of ``loss`` (a 0-d float tensor, unless ``seed`` gives d(something)/d(loss))
    with respect to each tensor of ``wrt``; zeros for those the loss does not depend on.

    A tensor used several times gets the sum of the gradients of its uses;
    broadcasting is undone by summing over the broadcast axes.
    """
    if not isinstance(loss, Tensor):
        raise InvalidArgumentError(f"grad's loss is a Tensor, got {type(loss).__name__}")
    if isinstance(wrt, Tensor) or not isinstance(wrt, Sequence):  # a Tensor iterates its rows
        raise InvalidArgumentError(f"grad's wrt is a list of Tensors (grad(loss, [x])), got {type(wrt).__name__}")
    for k, t in enumerate(wrt):
        if not isinstance(t, Tensor):
            raise InvalidArgumentError(f"grad's wrt[{k}] is a Tensor, got {t!r} ({type(t).__name__})")
    if seed is None:
        if loss.shape != ():
            raise ShapeMismatchError(f"grad needs a scalar loss, got shape {loss.shape}; pass seed=")
        if not loss.dtype.is_float:
            raise InvalidProgramError(f"grad of a {loss.dtype} tensor")
        seed = full((), 1.0, loss.dtype, name="seed")
    elif seed.shape != loss.shape:
        raise ShapeMismatchError(f"seed of shape {seed.shape} for a loss of shape {loss.shape}")
    order = topo_order([loss])
    targets = set(wrt)
    needed: set[Tensor] = set()
    for t in order:  # on a path from a target to the loss; a target may be an input or constant
        if t in targets or (t.backward_rule() is not None and any(p in needed for p in t.parents)):
            needed.add(t)
    grads: dict[Tensor, Tensor] = {loss: seed}
    for t in reversed(order):
        g = grads.get(t)
        rule = t.backward_rule()
        if g is None or rule is None:
            continue
        needs = [p in needed for p in t.parents]
        if not any(needs):
            continue
        for p, gp, need in zip(t.parents, rule(g, needs), needs):
            if need and gp is not None:
                prev = grads.get(p)
                grads[p] = gp if prev is None else prev + gp
    out = []
    for w in wrt:
        g = grads.get(w)
        if g is None:
            g = full(w.shape, 0.0, w.dtype, name=f"d_{w.name}")
        out.append(g)
    return out
