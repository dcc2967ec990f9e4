"""Training steps raced against their peers, each contender in its own process, in turns, alone
and beside busy processes (``polyjit bench peers``; ``polyjit bench tensor`` runs the same race
for its mlp and char_lm groups).

Models (float32, CPU):

- ``mlp``: 784-256-10 with ReLU, cross-entropy, SGD with momentum 0.9 (lr 0.01), batch 256;
- ``char_lm``: the model of ``polyjit/demo/char_lm.py`` (an embedding of 8 symbols, a tanh
  layer of 64, a head of 27), cross-entropy, AdamW (lr 0.01, weight decay 0.01), batch 128.

Contenders: ``polyjit``, ``numpy`` (hand-written gradients), ``torch`` (eager), ``torch_compile``
(the forward pass and loss under ``torch.compile``) and ``jax`` (the whole step under
``jax.jit``). A peer that is not installed is reported as absent, not failed.

Each contender is a child process that builds and warms its step once, then times it
whenever the parent asks: every contender's thread pool lives and spins in its own process, so
none slows the next one timed, and all of them are timed in turns, round after round, so that
load from elsewhere on the machine hits them alike. With ``--contention N`` each round times
everything alone and again beside N busy processes (one core spinning each); a contender's
*retained fraction* is its best throughput with them over its best throughput alone.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import IO, Any

import numpy as np

Array = np.ndarray[Any, Any]
Step = Callable[[], object]

MODELS = ("mlp", "char_lm")
BATCH = {"mlp": 256, "char_lm": 128}
PEERS = ("numpy", "torch", "torch_compile", "jax")
CONTENDERS = ("polyjit", *PEERS)
# Targets with busy processes beside (issue 14): the best peer's throughput with one, and
# these fractions of polyjit's own throughput alone.
RETAINED_TARGETS = {1: 0.55, 2: 0.30}

_REPLY = "@@"  # prefix of the child's protocol lines (frameworks may print to stdout too)


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


def polyjit_mlp_step(batch: int, device: Any = None) -> Step:
    from polyjit import tensor as pt

    x, y = pt.input("x", (batch, 784)), pt.input("y", (batch,), "int32")
    mlp = pt.MLP("mlp", [784, 256, 10], seed=0)
    plan = pt.compile(loss=pt.cross_entropy(mlp(x), y), optimizer=pt.SGD(0.01, momentum=0.9), device=device)
    xs, ys = mnist_like(batch)
    return lambda: plan.step(x=xs, y=ys)


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

    return step


# ---------------------------------------------------------------------------
# numpy, with hand-written gradients


def numpy_mlp_step(batch: int) -> Step:
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((784, 256)) * np.sqrt(2 / 784)).astype(np.float32)
    w2 = (rng.standard_normal((256, 10)) * np.sqrt(2 / 256)).astype(np.float32)
    b1, b2 = np.zeros(256, np.float32), np.zeros(10, np.float32)
    params = [w1, b1, w2, b2]
    moments = [np.zeros_like(p) for p in params]
    xs, ys = mnist_like(batch)
    rows = np.arange(batch)

    def step() -> float:
        h = xs @ w1 + b1
        a = np.maximum(h, 0)
        logits = a @ w2 + b2
        z = logits - logits.max(1, keepdims=True)
        e = np.exp(z)
        s = e.sum(1, keepdims=True)
        loss = float(np.mean(np.log(s[:, 0]) - z[rows, ys]))
        d = e / s
        d[rows, ys] -= 1
        d /= batch
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
    rows = np.arange(batch)
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.999, 1e-8, 0.01
    t = 0

    def step() -> float:
        nonlocal t
        ctx, nxt = data()
        p = params
        feats = p["embed"][ctx].reshape(batch, m.CONTEXT * m.EMBED)
        a = np.tanh(feats @ p["w1"] + p["b1"])
        logits = a @ p["w2"] + p["b2"]
        z = logits - logits.max(1, keepdims=True)
        e = np.exp(z)
        s = e.sum(1, keepdims=True)
        loss = float(np.mean(np.log(s[:, 0]) - z[rows, nxt]))
        d = e / s
        d[rows, nxt] -= 1
        d /= batch
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


# ---------------------------------------------------------------------------
# Timing (in the child)


def time_blocks(step: Step, samples_per_step: int, seconds: float, block: float,
                warmup: float = 0.2) -> dict[str, float]:
    """Samples per second of blocks of steps at least ``block`` seconds long, for ``seconds``
    in all, after ``warmup`` seconds of untimed steps (other thread pools that still spin from
    their last job have gone quiet by then). Blocks span many scheduler time slices, so a
    block's rate is what the step gets of a shared machine, not a lucky moment."""
    clock = time.perf_counter
    end = clock() + warmup
    while clock() < end:
        step()
    rates: list[float] = []
    end = clock() + seconds
    while not rates or clock() < end:
        n, t0 = 0, clock()
        while True:
            step()
            n += 1
            elapsed = clock() - t0
            if elapsed >= block:
                break
        rates.append(samples_per_step * n / elapsed)
    rates.sort()
    return {"best": rates[-1], "median": rates[len(rates) // 2], "blocks": float(len(rates))}


def serve(model: str, contender: str, batch: int) -> int:
    """The child: build and warm the step, say ``ready`` (or ``absent``/``failed``), then answer
    ``time SECONDS BLOCK`` with the rates until ``quit`` or the end of input."""
    def reply(*words: str) -> None:
        print(_REPLY, *words, flush=True)

    try:
        step = build_step(model, contender, batch)
        for _ in range(3):
            step()
    except Absent as e:
        reply("absent", str(e))
        return 0
    except Exception as e:  # reported in the parent's table, not raised there
        reply("failed", f"{type(e).__name__}: {e}".replace("\n", " ")[:300])
        return 0
    reply("ready")
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        if words[0] == "time":
            reply("rates", json.dumps(time_blocks(step, batch, float(words[1]), float(words[2]))))
    return 0


# ---------------------------------------------------------------------------
# The parent: contenders in child processes, busy processes


# A busy process: one core spinning, until its parent goes (never outlives the benchmark).
_BUSY = "import os\np = os.getppid()\nwhile os.getppid() == p:\n    for _ in range(100000): pass\n"


@contextmanager
def busy_processes(n: int, settle: float = 0.2) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` processes beside this one, each spinning on one core, for the ``with`` block."""
    procs = [subprocess.Popen([sys.executable, "-S", "-c", _BUSY], stdin=subprocess.DEVNULL)
             for _ in range(n)]
    try:
        if procs:
            time.sleep(settle)  # started and spinning before anything is timed
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


class Contender:
    """One contender's child process (``python -m polyjit.bench.peers --serve``); ``env``
    adds to its environment, ``label`` names it (default: the contender's name)."""

    def __init__(self, model: str, name: str, batch: int, env: Mapping[str, str] | None = None,
                 label: str = "") -> None:
        self.model, self.batch, self.name = model, batch, label or name
        self.status, self.reason = "starting", ""
        # the child's stderr, read when it fails; closed by close()
        self._log: IO[str] = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "polyjit.bench.peers", "--serve", model, name, "--batch", str(batch)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1,
            env={**os.environ, **env} if env else None)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(_REPLY):
                self._lines.put(line[len(_REPLY):].strip())
        self._lines.put(None)

    def _next(self, timeout: float) -> tuple[str, str]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            return "failed", f"no answer in {timeout:.0f} s"
        if line is None:
            self._log.seek(0)
            tail = self._log.read()[-300:].strip().replace("\n", " | ")
            return "failed", f"exited with {self.proc.wait()}: {tail}"
        word, _, rest = line.partition(" ")
        return word, rest

    def wait_ready(self, timeout: float) -> None:
        self.status, self.reason = self._next(timeout)

    def time(self, seconds: float, block: float) -> dict[str, float] | None:
        if self.status != "ready":
            return None
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"time {seconds} {block}\n")
        word, rest = self._next(seconds * 10 + 120)
        if word != "rates":
            self.status, self.reason = "failed", rest
            return None
        out: dict[str, float] = json.loads(rest)
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def race(model: str, contenders: Sequence[str], batch: int, contention: Sequence[int] = (),
         rounds: int = 3, seconds: float = 1.0, block: float = 0.25,
         start_timeout: float = 900.0) -> dict[str, Any]:
    """Samples/s of each contender's step, alone and beside each number of busy processes in
    ``contention``: every contender times ``seconds`` per turn; each round gives every load a
    turn, every contender timed in it (in an order that rotates from round to round); the
    best block over the rounds counts. Returns, per contender, ``samples_s`` (alone),
    ``samples_s_busyN`` and ``retained_busyN``, or its status (``absent: ...``,
    ``failed: ...``)."""
    loads = [0, *dict.fromkeys(n for n in contention if n > 0)]
    children = [Contender(model, name, batch) for name in contenders]  # they build at once
    try:
        deadline = time.monotonic() + start_timeout
        for c in children:
            c.wait_ready(max(1.0, deadline - time.monotonic()))
        best: dict[str, dict[int, float]] = {c.name: {} for c in children}
        for r in range(rounds):
            for load in loads:
                ready = [c for c in children if c.status == "ready"]
                if not ready:
                    break
                turn = r % len(ready)
                with busy_processes(load):
                    for c in ready[turn:] + ready[:turn]:
                        rates = c.time(seconds, block)
                        if rates is not None:
                            best[c.name][load] = max(best[c.name].get(load, 0.0), rates["best"])
    finally:
        for c in children:
            c.close()
    out: dict[str, Any] = {}
    for c in children:
        if c.status != "ready":
            out[c.name] = f"{c.status}: {c.reason}"
            continue
        mine = best[c.name]
        out[c.name] = {"samples_s": mine.get(0, 0.0)}
        for n in loads[1:]:
            out[c.name][f"samples_s_busy{n}"] = mine.get(n, 0.0)
            out[c.name][f"retained_busy{n}"] = mine.get(n, 0.0) / mine[0] if mine.get(0) else 0.0
    return out


def flatten(result: dict[str, Any], contention: Sequence[int]) -> dict[str, Any]:
    """A race's result as one group of a benchmark report: ``<contender>_samples_s``, ...,
    absent peers as strings, and polyjit against the best peer (alone and per load)."""
    out: dict[str, Any] = {}
    for name, value in result.items():
        if isinstance(value, str):
            out[name] = value
            continue
        out.update({f"{name}_{key}": v for key, v in value.items()})
    ours = result.get("polyjit")
    peers = {k: v for k, v in result.items() if k != "polyjit" and isinstance(v, dict)}
    if isinstance(ours, dict) and peers:
        for suffix in ["", *(f"_busy{n}" for n in contention if n > 0)]:
            key = f"samples_s{suffix}"
            top = max(peers, key=lambda k: peers[k].get(key, 0.0))
            if peers[top].get(key):
                out[f"best_peer{suffix}"] = top
                out[f"polyjit_vs_best_peer{suffix}"] = ours.get(key, 0.0) / peers[top][key]
    return out


def contention_targets(group: str, contention: Sequence[int]) -> list[tuple[str, str, str, float]]:
    """The targets of a race with busy processes: polyjit's retained fraction per load, and
    at least the best peer's throughput beside one busy process."""
    out = [(group, f"polyjit_retained_busy{n}", ">=", RETAINED_TARGETS[n])
           for n in contention if n in RETAINED_TARGETS]
    if 1 in contention:
        out.append((group, "polyjit_vs_best_peer_busy1", ">=", 1.0))
    return out


def parse_list(text: str, allowed: Sequence[str], what: str) -> list[str]:
    """A comma-separated subset of ``allowed`` (``none`` or empty: nothing)."""
    items = [s.strip() for s in text.split(",") if s.strip() and s.strip() != "none"]
    bad = [s for s in items if s not in allowed]
    if bad:
        raise SystemExit(f"unknown {what}: {', '.join(bad)} (choose from {', '.join(allowed)})")
    return list(dict.fromkeys(items))


def parse_contention(text: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--contention takes numbers of busy processes, e.g. 1 or 1,2; got {text!r}") from None
    if any(n < 0 for n in values):
        raise SystemExit("--contention: the number of busy processes cannot be negative")
    return values


def add_race_arguments(p: argparse.ArgumentParser) -> None:
    """The options ``polyjit bench peers`` and ``polyjit bench tensor`` share."""
    p.add_argument("--peers", default=",".join(PEERS),
                   help=f"comma-separated peers to race polyjit against (default: all of {', '.join(PEERS)}; "
                        "'none' for none); those not installed are reported as absent")
    p.add_argument("--contention", default="",
                   help="numbers of busy processes (one core spinning each) to time every contender "
                        "beside as well, e.g. 1 or 1,2; reports each contender's retained fraction")
    p.add_argument("--rounds", type=int, default=3, help="rounds of turns (the best block counts)")
    p.add_argument("--seconds", type=float, default=1.0, help="seconds each contender is timed per turn")


def main(argv: Sequence[str] = ()) -> int:
    p = argparse.ArgumentParser(prog="polyjit bench peers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: mlp,char_lm")
    p.add_argument("--batch", type=int, default=0, help="batch (default: 256 for mlp, 128 for char_lm)")
    p.add_argument("--json", help="write the results to this file")
    p.add_argument("--serve", nargs=2, metavar=("MODEL", "CONTENDER"), help=argparse.SUPPRESS)
    add_race_arguments(p)
    args = p.parse_args(list(argv))
    if args.serve:
        return serve(args.serve[0], args.serve[1], args.batch or BATCH[args.serve[0]])
    from polyjit.bench.common import print_results, print_targets

    contention = parse_contention(args.contention)
    contenders = ["polyjit", *parse_list(args.peers, PEERS, "peers")]
    results: dict[str, dict[str, Any]] = {"machine": machine_info()}
    targets = []
    for model in parse_list(args.models, MODELS, "models"):
        result = race(model, contenders, args.batch or BATCH[model], contention, args.rounds, args.seconds)
        results[model] = flatten(result, contention)
        targets += contention_targets(model, contention)
    print_results(results)
    print_targets(results, targets)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def machine_info() -> dict[str, Any]:
    import platform

    from polyjit.backends.cpu import cpu_model

    return {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "numpy": np.__version__, "load_average": os.getloadavg()[0]}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
