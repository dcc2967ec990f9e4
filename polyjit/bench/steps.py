"""The contenders' training steps for ``peers.py``: the same two models written for polyjit,
numpy (hand-written gradients), PyTorch (eager and ``torch.compile``) and ``jax.jit``, on the
same data. Each builder returns a function that runs one step; a framework that is not
installed raises :class:`Absent`."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]
Step = Callable[[], object]

MODELS = ("mlp", "char_lm")
PEERS = ("numpy", "torch", "torch_compile", "jax")
CONTENDERS = ("polyjit", *PEERS)


class Absent(Exception):
    """The contender's framework is not installed here."""


# ---------------------------------------------------------------------------
# The models' data


def mnist_like(batch: int, seed: int = 0) -> tuple[Array, Array]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, 784)).astype(np.float32), rng.integers(0, 10, batch).astype(np.int32)


def char_lm_batches(batch: int, count: int = 8, seed: int = 0) -> list[tuple[Array, Array]]:
    """``count`` batches of (contexts, next symbols) of the char_lm text, cycled through by
    every contender alike."""
    from polyjit.demo import char_lm
    from polyjit.demo.datasets import context_windows, encode_text

    contexts, targets = context_windows(encode_text(char_lm.TEXT.read_text()), char_lm.CONTEXT)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        idx = rng.integers(0, len(contexts), batch)
        out.append((contexts[idx], targets[idx]))
    return out


def _cycle(batches: list[tuple[Array, Array]]) -> Callable[[], tuple[Array, Array]]:
    it = iter(range(1 << 62))
    return lambda: batches[next(it) % len(batches)]


def _glorot(rng: np.random.Generator, n_in: int, n_out: int) -> Array:
    limit = np.sqrt(6.0 / (n_in + n_out))
    return rng.uniform(-limit, limit, (n_in, n_out)).astype(np.float32)


def _char_lm_params(seed: int = 0) -> dict[str, Array]:
    from polyjit.demo import char_lm as m

    rng = np.random.default_rng(seed)
    return {"embed": rng.normal(0, 0.3, (m.VOCAB, m.EMBED)).astype(np.float32),
            "w1": _glorot(rng, m.CONTEXT * m.EMBED, m.HIDDEN), "b1": np.zeros(m.HIDDEN, np.float32),
            "w2": _glorot(rng, m.HIDDEN, m.VOCAB), "b2": np.zeros(m.VOCAB, np.float32)}


# ---------------------------------------------------------------------------
# polyjit


class PlanStep:
    """A polyjit training step; ``finish()`` waits for what a step leaves running (its
    backward pass and update: ``Plan.step`` returns with the loss). The timing loops call it
    at the end of each timed block, so every block's rate counts all of its work."""

    def __init__(self, step: Step, plan: Any) -> None:
        self._step, self._plan = step, plan

    def __call__(self) -> object:
        return self._step()

    def finish(self) -> None:
        self._plan.synchronize()


def finish(step: Step) -> None:
    """Wait for the work of ``step`` that may still run (a :class:`PlanStep`'s); else nothing."""
    done = getattr(step, "finish", None)
    if done is not None:
        done()


def polyjit_mlp_step(batch: int, device: Any = None) -> Step:
    from polyjit import tensor as pt

    x, y = pt.input("x", (batch, 784)), pt.input("y", (batch,), "int32")
    mlp = pt.MLP("mlp", [784, 256, 10], seed=0)
    plan = pt.compile(loss=pt.cross_entropy(mlp(x), y), optimizer=pt.SGD(0.01, momentum=0.9), device=device)
    xs, ys = mnist_like(batch)
    return PlanStep(lambda: plan.step(x=xs, y=ys), plan)


def polyjit_char_lm_step(batch: int, device: str = "cpu") -> Step:
    from polyjit import tensor as pt
    from polyjit.demo import char_lm

    model = char_lm.CharModel()
    ctx, nxt = pt.input("context", (batch, char_lm.CONTEXT), "int32"), pt.input("next", (batch,), "int32")
    plan = pt.compile(loss=pt.cross_entropy(model(ctx), nxt), optimizer=pt.AdamW(lr=0.01), device=device)
    data = _cycle(char_lm_batches(batch))

    def step() -> object:
        c, n = data()
        return plan.step(context=c, next=n)

    return PlanStep(step, plan)


# ---------------------------------------------------------------------------
# numpy, with hand-written gradients


def _cross_entropy_grad(logits: Array, labels: Array) -> tuple[float, Array]:
    """The mean softmax cross-entropy of the rows and its gradient with respect to the logits."""
    rows = np.arange(len(labels))
    z = logits - logits.max(1, keepdims=True)
    e = np.exp(z)
    s = e.sum(1, keepdims=True)
    loss = float(np.mean(np.log(s[:, 0]) - z[rows, labels]))
    d = e / s
    d[rows, labels] -= 1
    d /= len(labels)
    return loss, d


def numpy_mlp_step(batch: int) -> Step:
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((784, 256)) * np.sqrt(2 / 784)).astype(np.float32)
    w2 = (rng.standard_normal((256, 10)) * np.sqrt(2 / 256)).astype(np.float32)
    b1, b2 = np.zeros(256, np.float32), np.zeros(10, np.float32)
    params = [w1, b1, w2, b2]
    moments = [np.zeros_like(p) for p in params]
    xs, ys = mnist_like(batch)

    def step() -> float:
        h = xs @ w1 + b1
        a = np.maximum(h, 0)
        loss, d = _cross_entropy_grad(a @ w2 + b2, ys)
        da = d @ w2.T
        da[h <= 0] = 0
        grads = [xs.T @ da, da.sum(0), a.T @ d, d.sum(0)]
        for p, m, g in zip(params, moments, grads):
            m *= 0.9
            m += g
            p -= 0.01 * m
        return loss

    return step


def numpy_char_lm_step(batch: int) -> Step:
    from polyjit.demo import char_lm as m

    params = _char_lm_params()
    names = list(params)
    first = {k: np.zeros_like(v) for k, v in params.items()}
    second = {k: np.zeros_like(v) for k, v in params.items()}
    data = _cycle(char_lm_batches(batch))
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.999, 1e-8, 0.01
    t = 0

    def step() -> float:
        nonlocal t
        ctx, nxt = data()
        p = params
        feats = p["embed"][ctx].reshape(batch, m.CONTEXT * m.EMBED)
        a = np.tanh(feats @ p["w1"] + p["b1"])
        loss, d = _cross_entropy_grad(a @ p["w2"] + p["b2"], nxt)
        dh = (d @ p["w2"].T) * (1 - a * a)
        dfeats = (dh @ p["w1"].T).reshape(batch * m.CONTEXT, m.EMBED)
        gembed = np.zeros_like(p["embed"])
        np.add.at(gembed, ctx.reshape(-1), dfeats)
        grads = {"embed": gembed, "w1": feats.T @ dh, "b1": dh.sum(0), "w2": a.T @ d, "b2": d.sum(0)}
        t += 1
        step_size, inv_c2 = lr / (1 - b1**t), 1 / np.sqrt(1 - b2**t)
        for k in names:
            g, mk, vk = grads[k], first[k], second[k]
            mk *= b1
            mk += (1 - b1) * g
            vk *= b2
            vk += (1 - b2) * (g * g)
            p[k] *= 1 - lr * wd
            p[k] -= step_size * mk / (np.sqrt(vk) * inv_c2 + eps)
        return loss

    return step


# ---------------------------------------------------------------------------
# PyTorch (eager, and torch.compile)


def _torch() -> Any:
    try:
        torch = importlib.import_module("torch")
    except ImportError as e:
        raise Absent(f"PyTorch is not installed ({e})") from None
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(0)
    return torch


def torch_step(model_name: str, batch: int, compiled: bool) -> Step:
    torch = _torch()
    nn = torch.nn
    if model_name == "mlp":
        model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        xs, ys = mnist_like(batch)
        fixed = (torch.from_numpy(xs), torch.from_numpy(ys.astype(np.int64)))
        data: Callable[[], tuple[Any, Any]] = lambda: fixed  # noqa: E731
    else:
        from polyjit.demo import char_lm as m

        model = nn.Sequential(nn.Embedding(m.VOCAB, m.EMBED), nn.Flatten(), nn.Linear(m.CONTEXT * m.EMBED, m.HIDDEN),
                              nn.Tanh(), nn.Linear(m.HIDDEN, m.VOCAB))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
        batches = [(torch.from_numpy(c.astype(np.int64)), torch.from_numpy(n.astype(np.int64)))
                   for c, n in char_lm_batches(batch)]
        data = _cycle(batches)
    lossf = nn.CrossEntropyLoss()

    def forward(x: Any, y: Any) -> Any:
        return lossf(model(x), y)

    loss_of = torch.compile(forward) if compiled else forward

    def step() -> float:
        x, y = data()
        opt.zero_grad()
        loss = loss_of(x, y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


# ---------------------------------------------------------------------------
# JAX (the whole step under jax.jit)


def jax_step(model_name: str, batch: int) -> Step:
    try:
        jax = importlib.import_module("jax")
    except ImportError as e:
        raise Absent(f"JAX is not installed ({e})") from None
    jnp = jax.numpy

    def cross_entropy(logits: Any, y: Any) -> Any:
        z = logits - jax.lax.stop_gradient(logits.max(1, keepdims=True))
        return jnp.mean(jnp.log(jnp.exp(z).sum(1)) - jnp.take_along_axis(z, y[:, None], 1)[:, 0])

    if model_name == "mlp":
        rng = np.random.default_rng(0)
        params = {"w1": _glorot(rng, 784, 256), "b1": np.zeros(256, np.float32),
                  "w2": _glorot(rng, 256, 10), "b2": np.zeros(10, np.float32)}

        def loss_fn(p: Any, x: Any, y: Any) -> Any:
            return cross_entropy(jnp.maximum(x @ p["w1"] + p["b1"], 0) @ p["w2"] + p["b2"], y)

        def update(p: Any, state: Any, g: Any) -> tuple[Any, Any]:
            mom = jax.tree_util.tree_map(lambda v, gi: 0.9 * v + gi, state, g)
            return jax.tree_util.tree_map(lambda pi, v: pi - 0.01 * v, p, mom), mom

        state: Any = jax.tree_util.tree_map(jnp.zeros_like, params)
        xs, ys = mnist_like(batch)
        fixed = (jnp.asarray(xs), jnp.asarray(ys))
        data: Callable[[], tuple[Any, Any]] = lambda: fixed  # noqa: E731
    else:
        from polyjit.demo import char_lm as m

        params = _char_lm_params()
        lr, b1, b2, eps, wd = 0.01, 0.9, 0.999, 1e-8, 0.01

        def loss_fn(p: Any, x: Any, y: Any) -> Any:
            feats = p["embed"][x].reshape(x.shape[0], m.CONTEXT * m.EMBED)
            return cross_entropy(jnp.tanh(feats @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"], y)

        def update(p: Any, state: Any, g: Any) -> tuple[Any, Any]:
            t, mo, ve = state
            t = t + 1.0
            mo = jax.tree_util.tree_map(lambda a, gi: b1 * a + (1 - b1) * gi, mo, g)
            ve = jax.tree_util.tree_map(lambda a, gi: b2 * a + (1 - b2) * gi * gi, ve, g)
            step_size, inv_c2 = lr / (1 - b1**t), 1 / jnp.sqrt(1 - b2**t)
            new = jax.tree_util.tree_map(
                lambda pi, a, c: pi * (1 - lr * wd) - step_size * a / (jnp.sqrt(c) * inv_c2 + eps), p, mo, ve)
            return new, (t, mo, ve)

        state = (jnp.float32(0), jax.tree_util.tree_map(jnp.zeros_like, params),
                 jax.tree_util.tree_map(jnp.zeros_like, params))  # distinct buffers: both are donated
        data = _cycle([(jnp.asarray(c), jnp.asarray(n)) for c, n in char_lm_batches(batch)])

    def train(p: Any, s: Any, x: Any, y: Any) -> tuple[Any, Any, Any]:
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        p, s = update(p, s, g)
        return p, s, loss

    train_jit = jax.jit(train, donate_argnums=(0, 1))
    held = [jax.tree_util.tree_map(jnp.asarray, params), state]

    def step() -> float:
        x, y = data()
        held[0], held[1], loss = train_jit(held[0], held[1], x, y)
        return float(loss)  # waits for the step

    return step


def build_step(model: str, contender: str, batch: int) -> Step:
    """The contender's training step of the model (raises :class:`Absent` when its framework
    is not installed)."""
    if model not in MODELS or contender not in CONTENDERS:
        raise ValueError(f"no contender {contender!r} for model {model!r}")
    if contender == "polyjit":
        return polyjit_mlp_step(batch) if model == "mlp" else polyjit_char_lm_step(batch)
    if contender == "numpy":
        return numpy_mlp_step(batch) if model == "mlp" else numpy_char_lm_step(batch)
    if contender in ("torch", "torch_compile"):
        return torch_step(model, batch, compiled=contender == "torch_compile")
    return jax_step(model, batch)
