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
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import IO, Any

import numpy as np

from polyjit.bench.steps import (
    CONTENDERS,
    MODELS,
    PEERS,
    Absent,
    Step,
    build_step,
    finish,
    mnist_like,
)
from polyjit.cli import count, duration, natural, output_file, subset_of

__all__ = ["BATCH", "CONTENDERS", "MODELS", "PEERS", "Absent", "build_step", "mnist_like", "race"]

BATCH = {"mlp": 256, "char_lm": 128}
# Targets with busy processes beside (issue 14): the best peer's throughput with one, and
# these fractions of polyjit's own throughput alone.
RETAINED_TARGETS = {1: 0.55, 2: 0.30}

_REPLY = "@@"  # prefix of the child's protocol lines (frameworks may print to stdout too)


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
            if clock() - t0 >= block:
                finish(step)  # the work a step leaves running counts in its block
                elapsed = clock() - t0
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
    absent peers as strings, polyjit against the best peer (alone and per load), and alone
    against ``jax.jit`` (issue 14's char_lm target) where it ran."""
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
        if peers.get("jax", {}).get("samples_s"):
            out["polyjit_vs_jax"] = ours.get("samples_s", 0.0) / peers["jax"]["samples_s"]
    return out


def contention_targets(group: str, contention: Sequence[int]) -> list[tuple[str, str, str, float]]:
    """The targets of a race with busy processes: polyjit's retained fraction per load, and
    at least the best peer's throughput beside one busy process."""
    out = [(group, f"polyjit_retained_busy{n}", ">=", RETAINED_TARGETS[n])
           for n in contention if n in RETAINED_TARGETS]
    if 1 in contention:
        out.append((group, "polyjit_vs_best_peer_busy1", ">=", 1.0))
    return out


def contention_list(text: str) -> list[int]:
    """An argparse type: numbers of busy processes, ``1`` or ``1,2``."""
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"numbers of busy processes, e.g. 1 or 1,2; got {text!r}") from None
    if any(n < 0 for n in values):
        raise argparse.ArgumentTypeError("the number of busy processes cannot be negative")
    return values


def add_race_arguments(p: argparse.ArgumentParser) -> None:
    """The options ``polyjit bench peers`` and ``polyjit bench tensor`` share."""
    p.add_argument("--peers", type=subset_of(PEERS, "peers"), default=",".join(PEERS),
                   help=f"comma-separated peers to race polyjit against (default: all of {', '.join(PEERS)}; "
                        "'none' for none); those not installed are reported as absent")
    p.add_argument("--contention", type=contention_list, default="",
                   help="numbers of busy processes (one core spinning each) to time every contender "
                        "beside as well, e.g. 1 or 1,2; reports each contender's retained fraction")
    p.add_argument("--rounds", type=count, default=3, help="rounds of turns (the best block counts)")
    p.add_argument("--seconds", type=duration, default=1.0, help="seconds each contender is timed per turn")


def main(argv: Sequence[str] = ()) -> int:
    p = argparse.ArgumentParser(prog="polyjit bench peers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=subset_of(MODELS, "models"), default=",".join(MODELS),
                   help="comma-separated: mlp,char_lm")
    p.add_argument("--batch", type=natural, default=0, help="batch (default: 256 for mlp, 128 for char_lm)")
    p.add_argument("--json", type=output_file, help="write the results to this file")
    p.add_argument("--serve", nargs=2, metavar=("MODEL", "CONTENDER"), help=argparse.SUPPRESS)
    add_race_arguments(p)
    args = p.parse_args(list(argv))
    if args.serve:
        return serve(args.serve[0], args.serve[1], args.batch or BATCH[args.serve[0]])
    from polyjit.bench.common import print_results, print_targets

    contention = args.contention
    contenders = ["polyjit", *args.peers]
    results: dict[str, dict[str, Any]] = {"machine": machine_info()}
    targets = []
    for model in args.models:
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
