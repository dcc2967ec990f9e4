"""Fault injection: a Driver wrapper whose primitives fail at random points.

:class:`FaultyDriver` passes every call to a real driver, except that, with probability
``rate``, allocation, compilation, loading, preparing, launches and copies raise
:class:`InjectedFault` before doing anything (a synchronous failure), and event waits
report that the work before them failed (an asynchronous device fault). The runtime must
turn each into a typed PolyjitError, stay consistent, and give every byte back on
``finalize()``: :func:`fault_storm` drives it through the public API and counts.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from polyjit.core import ir
from polyjit.core.errors import DeviceFaultError, PolyjitError
from polyjit.core.ir import Node, Op
from polyjit.core.protocol import Driver
from polyjit.core.runtime import Backend, Context

__all__ = ["FaultyDriver", "InjectedFault", "fault_storm"]

INJECTABLE = ("alloc", "compile", "load", "prepare", "launch", "memset_zero", "copy_from_host",
              "copy_to_host", "copy_device", "new_stream")


class InjectedFault(RuntimeError):
    """What FaultyDriver raises: deliberately not a PolyjitError."""


class FaultyDriver:
    """A driver that fails at random (``rate`` per call of each kind in ``kinds``)."""

    def __init__(self, inner: Driver, rate: float = 0.05, seed: int = 0,
                 kinds: Sequence[str] = (*INJECTABLE, "event_sync")) -> None:
        self.inner = inner
        self.name = f"faulty-{inner.name}"
        self.rate = rate
        self.kinds = frozenset(kinds)
        self.rng = random.Random(seed)
        self.injected: dict[str, int] = {}
        self.armed = True
        self._lock = threading.Lock()

    def _roll(self, kind: str) -> None:
        if not self.armed or kind not in self.kinds:
            return
        with self._lock:
            hit = self.rng.random() < self.rate
            if hit:
                self.injected[kind] = self.injected.get(kind, 0) + 1
        if hit:
            raise InjectedFault(f"injected {kind} failure")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in INJECTABLE:
            return attr

        def call(*args: Any) -> Any:
            self._roll(name)
            return attr(*args)

        return call

    @property
    def dialect(self) -> Any:
        return self.inner.dialect

    # Asynchronous faults: the work before the event failed on the device.
    def event_sync(self, event: Any) -> None:
        self.inner.event_sync(event)
        self._roll("event_sync")

    def event_done(self, event: Any) -> bool:
        return bool(self.inner.event_done(event))

    # Releases never fail here: a driver that cannot free has bigger problems.
    def free(self, ordinal: int, pool: Any) -> None:
        self.inner.free(ordinal, pool)


def fault_storm(backend: Backend, operations: int = 1000, seed: int = 0) -> dict[str, int]:
    """``operations`` random public-API operations on ``backend`` (a FaultyDriver's). Every
    failure must be a PolyjitError; returns counts by error type (and "ok")."""
    rng = random.Random(seed)
    dev = backend.get_device(0)
    n = 2048
    a, b, out = Node("fs_a", (n,)), Node("fs_b", (n,)), Node("fs_out", (n,))
    counts: dict[str, int] = {}
    held: list[Context] = []
    routines: list[Any] = []
    codes: list[Any] = []
    root = dev.make_context()

    def note(key: str) -> None:
        counts[key] = counts.get(key, 0) + 1

    for k in range(operations):
        choice = rng.random()
        try:
            if choice < 0.15 or not codes:
                scale = Node("fs_s", ())
                comp = ir.Comp.of(ir.fill(scale, float(rng.randrange(5))), ir.apply(Op.MUL, a, scale, into=b),
                                  ir.apply(Op.ADD, b, a, into=out))
                codes.append(backend.compile(comp, name=f"storm{k % 7}"))
            elif choice < 0.35:
                base = held[-1] if held and rng.random() < 0.5 else root
                held.append(base.init_from_host(a, np.full(n, k % 9, np.float32)))
            elif choice < 0.55 and held:
                r = rng.choice(held).link(rng.choice(codes))
                routines.append(r)
                r.run()
            elif choice < 0.7 and routines:
                r = rng.choice(routines)
                r.run()
                r.context.read(out)
            elif choice < 0.8 and held:
                ctx = rng.choice(held)
                ctx.from_host(a, np.ones(n, np.float32))
                ctx.read(a)
            elif choice < 0.9 and held:
                ctx = held.pop(rng.randrange(len(held)))
                ctx.finalize()
                routines = [r for r in routines if not r.context.finalized]
            else:
                dev.synchronize()
            note("ok")
        except DeviceFaultError:
            note("DeviceFaultError")
        except PolyjitError as e:
            note(type(e).__name__)
    for ctx in held:
        ctx.finalize()
    root.finalize()
    return counts
