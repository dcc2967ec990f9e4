"""The CUDA backend's pinned staging ring (backends/cuda/staging.py), on host memory and
events the test controls: a segment is never handed out while a DMA in flight still uses
any of its bytes, whatever the sizes, the wraps and the order in which events complete, and
device-to-host bytes land in the user's array."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from polyjit.backends.cuda.staging import Staging

RING = 4096


class _Event:
    def __init__(self) -> None:
        self.is_done = False
        self.synced = False

    def sync(self) -> None:
        self.is_done = self.synced = True


class _Buffer:
    def __init__(self, memory: np.ndarray) -> None:
        self.size = memory.nbytes
        self.handle = memory.ctypes.data


class _Ring:
    """A Staging over host memory; its 'DMA' copies at once, and its events complete when told."""

    def __init__(self) -> None:
        self.memory = np.zeros(RING, np.uint8)
        self.device = np.zeros(1 << 16, np.uint8)
        self.events: list[_Event] = []
        self.ring = Staging(_Buffer(self.memory), self._record, self._copy, self._copy)

    def _record(self, stream: Any) -> _Event:
        self.events.append(_Event())
        return self.events[-1]

    def _copy(self, dst: int, src: int, n: int, stream: Any) -> None:
        import ctypes

        ctypes.memmove(dst, src, n)

    def in_flight(self) -> list[list[Any]]:
        return [s for s in self.ring.segments if not s[2].is_done]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, RING), st.booleans(), st.integers(0, 3)), min_size=1, max_size=40))
def test_no_segment_is_reused_while_its_dma_may_run(steps: list[tuple[int, bool, int]]) -> None:
    r = _Ring()
    ring = r.ring
    for n, to_host, finish in steps:
        before = r.in_flight()
        start_head = ring.head
        if to_host:
            out = np.zeros(n, np.uint8)
            r.device[:n] = np.arange(n) % 251
            ring.to_host(None, out, r.device.ctypes.data)
        else:
            src = (np.arange(n) % 253).astype(np.uint8)
            ring.to_device(None, r.device.ctypes.data, src)
            np.testing.assert_array_equal(r.device[:n], src)
        new = ring.segments[-1]
        for seg in before:  # the new segment's bytes were not in use by a DMA still running
            assert seg[2].is_done or not (seg[0] < new[1] and new[0] < seg[1]), (start_head, seg[:2], new[:2])
        for e in r.events[:finish]:  # some of the oldest DMAs complete
            e.is_done = True
        if to_host:
            ring.poll()
            if r.events[-1].is_done:
                np.testing.assert_array_equal(out, np.arange(n) % 251)
    segs = sorted((s[0], s[1]) for s in ring.segments)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(segs)), segs  # the ring's segments never overlap
