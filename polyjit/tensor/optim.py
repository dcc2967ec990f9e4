"""Optimizers as assignments: each one turns (parameters, gradients) into in-place writes of the
parameters and of its state, so that a whole training step is one routine batch.

Adam's step count is a persistent scalar updated by an assignment; the bias
corrections ``1 - beta**t`` are computed on the device from it.

Hyperparameters are constants of the generated kernels: they are checked when set
(``InvalidProgramError`` for an unknown name or a bad value, as PyTorch refuses a
negative learning rate), and setting one after ``updates()`` has built a plan's writes
is an error rather than a change that would silently not happen.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence
from numbers import Real
from typing import Any

import numpy as np

from polyjit.core import dtypes
from polyjit.core.dtypes import DType
from polyjit.core.errors import InvalidProgramError
from polyjit.tensor import ops
from polyjit.tensor.program import Write
from polyjit.tensor.tensor import Kind, Tensor, state


def _real(owner: str, name: str, value: Any, upper: float | None = None) -> float:
    """A finite real ``>= 0`` (``< upper`` when given), as a Python float."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Real):
        raise InvalidProgramError(f"{owner}: {name} must be a real number, got {value!r}")
    v = float(value)
    if not (math.isfinite(v) and v >= 0.0 and (upper is None or v < upper)):
        bound = f"in [0, {upper})" if upper is not None else ">= 0"
        raise InvalidProgramError(f"{owner}: {name} must be {bound}, got {value!r}")
    return v


def _hyperparameter(owner: str, name: str, value: Any) -> Any:
    """A checked hyperparameter value (Python scalars: they become literals of the kernels)."""
    if name == "nesterov":
        if not isinstance(value, (bool, np.bool_)):
            raise InvalidProgramError(f"{owner}: nesterov must be a bool, got {value!r}")
        return bool(value)
    if name == "betas":
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
            raise InvalidProgramError(f"{owner}: betas must be a pair (beta1, beta2), got {value!r}")
        return (_real(owner, "betas[0]", value[0], 1.0), _real(owner, "betas[1]", value[1], 1.0))
    return _real(owner, name, value, 1.0 if name == "momentum" else None)


def checked_params(params: Any) -> list[Tensor]:
    """A user's ``params=``: an iterable of parameters (``pt.param``), each refused by name
    here rather than failing somewhere inside autodiff, and each listed once (one listed twice
    would be updated once per mention; PyTorch refuses it too). ``compile``, ``data_parallel``
    and ``Optimizer.updates`` all check through here."""
    if isinstance(params, (str, bytes, Tensor)) or not isinstance(params, Iterable):
        raise InvalidProgramError(f"params must be a list of parameters, got {params!r}")
    out = list(params)
    for p in out:
        if not isinstance(p, Tensor) or p.kind is not Kind.PARAM:
            raise InvalidProgramError(f"params holds {p!r}, not a parameter (pt.param)")
    twice = sorted({p.name for k, p in enumerate(out) if any(p is q for q in out[:k])})
    if twice:
        raise InvalidProgramError(f"params lists {', '.join(twice)} more than once")
    return out


class Optimizer:
    """Base class: ``updates(params, grads)`` returns the writes of one step.

    A subclass that lists its ``hyperparameters`` gets them checked when set (see
    ``_hyperparameter``), unknown attribute names refused, and changes after its writes were
    built refused.
    """

    prefix = "opt"
    hyperparameters: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._state: dict[tuple[Tensor, str], Tensor] = {}
        self._counter: Tensor | None = None
        self._built = False
        self._lock = threading.RLock()  # a setting and a compile building the updates take turns

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or not self.hyperparameters:
            object.__setattr__(self, name, value)
            return
        owner = type(self).__name__
        if name not in self.hyperparameters:
            raise InvalidProgramError(f"{owner} has no hyperparameter {name!r} "
                                      f"(its hyperparameters: {', '.join(self.hyperparameters)})")
        with self._lock:
            self._set(owner, name, value)

    def _set(self, owner: str, name: str, value: Any) -> None:
        if self._built:
            raise InvalidProgramError(
                f"{owner}.{name} = {value!r}: this optimizer's updates are already built into a plan "
                f"with {name}={getattr(self, name)!r} (hyperparameters are constants of the kernels); "
                "set it before compile(), or build a new optimizer and plan"
            )
        missing = object()
        old = self.__dict__.get(name, missing)
        object.__setattr__(self, name, _hyperparameter(owner, name, value))
        try:
            self._check()
        except InvalidProgramError:  # the optimizer keeps its valid settings
            if old is missing:
                object.__delattr__(self, name)
            else:
                object.__setattr__(self, name, old)
            raise

    def _check(self) -> None:
        """Checks across hyperparameters (once all are set)."""

    def slot(self, p: Tensor, kind: str) -> Tensor:
        """Per-parameter state (zeros like the parameter), one tensor per (parameter, kind)."""
        key = (p, kind)
        t = self._state.get(key)
        if t is None:
            t = self._state[key] = state(f"{p.name}.{kind}", np.zeros(p.shape, p.dtype.np))
        return t

    def counter(self, dtype: DType = dtypes.float32) -> Tensor:
        """The step count t, in the parameters' dtype (float32 counts exactly up to 2**24 steps;
        the half types, which count exactly only to 2048 or 256, count in float32)."""
        dtype = dtype.compute
        if self._counter is None:
            self._counter = state(f"{self.prefix}.step", np.zeros((), dtype.np))
        return self._counter

    @property
    def state_tensors(self) -> list[Tensor]:
        return list(self._state.values()) + ([self._counter] if self._counter is not None else [])

    def updates(self, params: Sequence[Tensor], grads: Sequence[Tensor], grad_scale: float = 1.0) -> list[Write]:
        params = checked_params(params)
        if len(params) != len(grads):
            raise InvalidProgramError(f"{len(params)} parameters but {len(grads)} gradients")
        with self._lock:
            writes = self._updates(params, [g if grad_scale == 1.0 else g * grad_scale for g in grads])
            self._built = True
            return writes

    def _updates(self, params: list[Tensor], grads: list[Tensor]) -> list[Write]:
        raise NotImplementedError


class SGD(Optimizer):
    """``v = momentum*v + g (+ weight_decay*p); p -= lr * v`` (PyTorch's form; nesterov optional)."""

    prefix = "sgd"
    hyperparameters = ("lr", "momentum", "weight_decay", "nesterov")

    def __init__(self, lr: float = 0.01, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False) -> None:
        super().__init__()
        self.lr, self.momentum, self.weight_decay, self.nesterov = lr, momentum, weight_decay, nesterov

    def _check(self) -> None:
        if getattr(self, "nesterov", False) and not getattr(self, "momentum", 1.0):
            raise InvalidProgramError("SGD: nesterov=True needs a momentum > 0")

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
    hyperparameters = ("lr", "betas", "eps", "weight_decay")

    def __init__(self, lr: float = 0.001, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        super().__init__()
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay

    def _updates(self, params: list[Tensor], grads: list[Tensor]) -> list[Write]:
        b1, b2 = self.betas
        t = self.counter(params[0].dtype if params else dtypes.float32)
        writes = [Write(t, t + 1.0)]
        # Scalars read by every parameter's update (computed once per step, after t advances),
        # cast once to each other dtype of the parameters (a half type's t counts in float32).
        scalars = {t.dtype: (self.lr / (1.0 - ops.pow(b1, t)), 1.0 / ops.sqrt(1.0 - ops.pow(b2, t)))}
        for p, g in zip(params, grads):
            if p.dtype not in scalars:
                first, second = scalars[t.dtype]
                scalars[p.dtype] = (ops.cast(first, p.dtype), ops.cast(second, p.dtype))
            step_size, inv_sqrt_c2 = scalars[p.dtype]
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
