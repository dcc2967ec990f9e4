"""Timing checks on a shared machine. CI runs the suite on two pytest-xdist workers on two
cores, so any timed attempt may lose a core to the other worker (a GCC run, a kernel's team)
for a while. A check that a timing *can* happen (a team pays, two devices overlap, a waiter
is woken soon) tries again until a deadline: a real bug fails every attempt."""

from __future__ import annotations

import time
from collections.abc import Iterator

DEADLINE_S = 30.0


def attempts(seconds: float = DEADLINE_S, at_least: int = 1) -> Iterator[int]:
    """Attempt numbers 0, 1, ... while ``seconds`` have not passed (at least ``at_least``).
    Break out of the loop on success; its ``else:`` runs when every attempt failed."""
    deadline = time.monotonic() + seconds
    n = 0
    while n < at_least or time.monotonic() < deadline:
        yield n
        n += 1
