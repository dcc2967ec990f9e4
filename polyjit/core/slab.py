"""Slab allocation: buffers are (pool id, offset) pairs; one pool per link.

A ``BufferLoc`` is two plain integers, never a pointer: only a backend turns
it into an address (pool base + offset). Linking packs the new nodes of a
batch into one fresh pool; ``plan`` reuses space between nodes whose lifetimes
inside the batch do not overlap.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

MERGE_POOL = 0  # each device's merge buffer; grown on demand
FIRST_POOL = 1  # pool ids handed out by links and the constant table start here


@attrs.frozen(order=True, cache_hash=True)  # hashed on every Routine.run
class BufferLoc:
    pool_id: int
    offset: int


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@attrs.frozen
class Request:
    """Space for one buffer: ``nbytes`` aligned to ``alignment``, live over kernels [first, last].

    Persistent buffers (results that stay in the context) are live for the whole batch.
    """

    key: object
    nbytes: int
    alignment: int
    first: int
    last: int

    def overlaps_in_time(self, other: Request) -> bool:
        return self.first <= other.last and other.first <= self.last


@attrs.frozen
class Plan:
    nbytes: int
    offsets: dict[object, int]


def plan(requests: Sequence[Request], base_alignment: int) -> Plan:
    """Greedy best-fit packing: largest first, each at the lowest offset that collides with no
    buffer alive at the same time. Deterministic for a given request list."""
    order = sorted(range(len(requests)), key=lambda k: (-requests[k].nbytes, k))
    placed: list[tuple[int, int, Request]] = []  # (start, end, request)
    offsets: dict[object, int] = {}
    for k in order:
        req = requests[k]
        align = max(req.alignment, base_alignment)
        size = max(req.nbytes, 1)
        busy = sorted((s, e) for s, e, other in placed if other.overlaps_in_time(req))
        offset = 0
        for s, e in busy:
            if offset + size <= s:
                break
            offset = max(offset, align_up(e, align))
        offsets[req.key] = offset
        placed.append((offset, offset + size, req))
    total = max((e for _, e, _ in placed), default=0)
    return Plan(align_up(total, base_alignment) if total else 0, offsets)


class PoolIds:
    """Deterministic pool ids for one device: the same sequence of links gives the same ids."""

    def __init__(self) -> None:
        self._next = FIRST_POOL

    def take(self) -> int:
        pid = self._next
        self._next += 1
        return pid
