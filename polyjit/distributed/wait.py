"""Waiting for non-blocking MPI requests until a deadline.

MPI has no blocking call with a timeout, so every collective of ``polyjit.distributed`` is
posted as a non-blocking request (``Iallreduce``, ``Ibcast``, ``Isend``, ...) and tested in a
loop until it completes or its deadline passes. Testing is also what drives MPI's progress
(MPICH has no progress thread by default), so the loop spins while data moves; while it
waits for other ranks to *arrive* it backs off to short sleeps, so a rank that waits long
for a late one does not burn its core.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

# While waiting for ranks to arrive: spin this long, then sleep, doubling up to MAX_SLEEP_S.
SPIN_S = 2e-3
MIN_SLEEP_S = 20e-6
MAX_SLEEP_S = 1e-3
YIELD_EVERY = 64  # tests between two sched_yield()s while spinning (oversubscribed hosts)


def poll(requests: Sequence[Any], deadline: float, *, patient: bool = False,
         stop: Callable[[], bool] | None = None) -> list[int]:
    """Test ``requests`` until all are complete, ``time.monotonic()`` passes ``deadline``, or
    ``stop()`` (tested along with them) is true.

    Returns the indices of the requests still pending (empty: all completed). ``patient``:
    the requests wait for other ranks to arrive (back off to sleeps after ``SPIN_S``);
    otherwise data is moving and the loop spins, yielding the core now and then.
    """
    pending = [i for i, r in enumerate(requests) if not r.Test()]
    if not pending or (stop is not None and stop()):
        return pending
    start = time.monotonic()
    spins = 0
    nap = MIN_SLEEP_S
    while True:
        if len(pending) == 1:  # the common case: one request, a tight loop
            req = requests[pending[0]]
            done = req.Test()
            pending = [] if done else pending
        else:
            pending = [i for i in pending if not requests[i].Test()]
        if not pending or (stop is not None and stop()):
            return pending
        now = time.monotonic()
        if now >= deadline:
            return pending
        spins += 1
        if patient and now - start > SPIN_S:
            time.sleep(nap)
            nap = min(nap * 2, MAX_SLEEP_S)
        elif spins % YIELD_EVERY == 0:
            os.sched_yield()
