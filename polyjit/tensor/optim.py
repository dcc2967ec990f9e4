"""Optimizers as assignments: each one turns (parameters, gradients) into in-place writes of the
parameters and of its state, so that a whole training step is one routine batch.

Adam's step count is a persistent scalar updated by an assignment; the bias
corrections ``1 - beta**t`` are computed on the device from it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from polyjit.core import dtypes
from polyjit.core.dtypes import DType
from polyjit.core.errors import InvalidProgramError
from polyjit.tensor import ops
from polyjit.tensor.program import Write
from polyjit.tensor.tensor import Kind, Tensor, state


class Optimizer:
    """Base class: ``updates(params, grads)`` returns the writes of one step."""

    prefix = "opt"

    def __init__(self) -> None:
        self._state: dict[tuple[Tensor, str], Tensor] = {}
        self._counter: Tensor | None = None

    def slot(self, p: Tensor, kind: str) -> Tensor:
        """Per-parameter state (zeros like the parameter), one tensor per (parameter, kind)."""
        key = (p, kind)
        t = self._state.get(key)
        if t is None:
            t = self._state[key] = state(f"{p.name}.{kind}", np.zeros(p.shape, p.dtype.np))
        return t

    def counter(self, dtype: DType = dtypes.float32) -> Tensor:
        """The step count t, in the parameters' dtype (float32 counts exactly up to 2**24 steps)."""
        if self._counter is None:
            self._counter = state(f"{self.prefix}.step", np.zeros((), dtype.np))
        return self._counter

    @property
    def state_tensors(self) -> list[Tensor]:
        return list(self._state.values()) + ([self._counter] if self._counter is not None else [])

    def updates(self, params: Sequence[Tensor], grads: Sequence[Tensor], grad_scale: float = 1.0) -> list[Write]:
        if len(params) != len(grads):
            raise InvalidProgramError(f"{len(params)} parameters but {len(grads)} gradients")
        for p in params:
            if p.kind is not Kind.PARAM:
                raise InvalidProgramError(f"{p!r} is not a parameter")
        return self._updates(list(params), [g if grad_scale == 1.0 else g * grad_scale for g in grads])

    def _updates(self, params: list[Tensor], grads: list[Tensor]) -> list[Write]:
        raise NotImplementedError


class SGD(Optimizer):
    """``v = momentum*v + g (+ weight_decay*p); p -= lr * v`` (PyTorch's form; nesterov optional)."""

    prefix = "sgd"

    def __init__(self, lr: float = 0.01, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False) -> None:
        super().__init__()
        self.lr, self.momentum, self.weight_decay, self.nesterov = lr, momentum, weight_decay, nesterov

    def _updates(self, params: list[Tensor], grads: list[Tensor]) -> list[Write]:
        writes = []
        for p, g in zip(params, grads):
            if self.weight_decay:
                g = g + self.weight_decay * p
            if self.momentum:
                v = self.slot(p, "momentum")
                writes.append(Write(v, self.momentum * v + g))
                step = g + self.momentum * v if self.nesterov else v  # v: the value just written
            else:
                step = g
            writes.append(Write(p, p - self.lr * step))
        return writes


class Adam(Optimizer):
    """Adam with bias correction; ``weight_decay`` adds ``wd*p`` to the gradient (L2)."""

    prefix = "adam"
    decoupled = False

    def __init__(self, lr: float = 0.001, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        super().__init__()
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay

    def _updates(self, params: list[Tensor], grads: list[Tensor]) -> list[Write]:
        b1, b2 = self.betas
        t = self.counter(params[0].dtype if params else dtypes.float32)
        writes = [Write(t, t + 1.0)]
        # Scalars read by every parameter's update (computed once per step, after t advances).
        step_size = self.lr / (1.0 - ops.pow(b1, t))
        inv_sqrt_c2 = 1.0 / ops.sqrt(1.0 - ops.pow(b2, t))
        for p, g in zip(params, grads):
            if self.weight_decay and not self.decoupled:
                g = g + self.weight_decay * p
            m, v = self.slot(p, "m"), self.slot(p, "v")
            writes.append(Write(m, b1 * m + (1.0 - b1) * g))
            writes.append(Write(v, b2 * v + (1.0 - b2) * (g * g)))
            update = step_size * m / (ops.sqrt(v) * inv_sqrt_c2 + self.eps)
            decayed = p * (1.0 - self.lr * self.weight_decay) if self.weight_decay and self.decoupled else p
            writes.append(Write(p, decayed - update))
        return writes


class AdamW(Adam):
    """Adam with decoupled weight decay: ``p *= 1 - lr*wd`` beside the Adam step."""

    prefix = "adamw"
    decoupled = True

    def __init__(self, lr: float = 0.001, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01) -> None:
        super().__init__(lr, betas, eps, weight_decay)
