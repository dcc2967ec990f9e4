"""What every rank says before a collective moves data: a small fixed-size header.

Each collective starts with an exchange of headers (see ``comm.py``): one int64 record per
rank naming the collective, its sequence number on the communicator, the op, the root (or
peer and tag), the dtype, the shape and the node's name (its hash, and its first 16 bytes
for messages): a call paired with another node's call of the same shape -- threads that
make their calls in another order on each rank, a rank that skipped one -- raises instead
of mixing the two nodes' values. A rank whose header has arrived has joined; once
every header is in, each rank compares them all (every rank sees the same records, so every
rank reaches the same verdict) and raises :class:`CollectiveMismatchError` before any data
moves when they differ.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

MAGIC = 0x706A6D7069  # "pjmpi"
MAX_DIMS = 10  # dims carried inline; longer shapes are compared through their hash too
NAME_BYTES = 16  # of the node's name carried inline, for messages; compared through its hash
LENGTH = 14 + MAX_DIMS

KINDS = ("barrier", "all_reduce", "broadcast", "all_gather", "reduce_scatter", "send", "recv", "check")
OPS = ("sum", "max", "min", "mean")

# field positions
_MAGIC, _SEQ, _KIND, _OP, _ROOT, _DTYPE, _NDIM, _SIZE, _HASH, FLAG, _NAME_HASH, _NAME_LEN = range(12)
_NAME = 12  # NAME_BYTES of the name: two fields
_DIMS = _NAME + NAME_BYTES // 8
# FLAG: 1 when this rank refuses the call (its arguments are wrong); not compared

Array = np.ndarray[Any, Any]


def dtype_code(dtype: Any) -> int:
    """A numpy dtype as an int64: its ``str`` ('<f4') in little-endian bytes; its name for
    ml_dtypes' types ('bfloat16'), whose ``str`` is a bare size ('<V2')."""
    dt = np.dtype(dtype)
    text = (dt.name if dt.kind == "V" else dt.str).encode()[:8]
    return int.from_bytes(text.ljust(8, b"\0"), "little", signed=True)


def dtype_name(code: int) -> str:
    if code == 0:
        return "-"
    text = int(code).to_bytes(8, "little", signed=True).rstrip(b"\0").decode(errors="replace")
    try:
        return str(np.dtype(text))
    except TypeError:
        return text


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _shape_hash(shape: Sequence[int]) -> int:
    return _hash(repr(tuple(int(d) for d in shape)).encode())


def make(seq: int, kind: str, *, op: str | None = None, root: int = -1, dtype: Any = None,
         shape: Sequence[int] = (), name: str = "") -> Array:
    """The header of one call (``root``: the root of a broadcast, the tag of a send / recv;
    ``name``: the node's, compared between the ranks: "" for none)."""
    h = np.zeros(LENGTH, np.int64)
    h[_MAGIC], h[_SEQ], h[_KIND] = MAGIC, seq, KINDS.index(kind)
    h[_OP] = OPS.index(op) + 1 if op is not None else 0
    h[_ROOT] = root
    h[_DTYPE] = dtype_code(dtype) if dtype is not None else 0
    h[_NDIM] = len(shape)
    h[_SIZE] = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    h[_HASH] = _shape_hash(shape)
    dims = [int(d) for d in shape][:MAX_DIMS]
    h[_DIMS : _DIMS + len(dims)] = dims
    if name:
        raw = name.encode("utf-8", "surrogatepass")
        h[_NAME_HASH], h[_NAME_LEN] = _hash(raw), len(raw)
        h[_NAME : _NAME + NAME_BYTES // 8] = np.frombuffer(raw[:NAME_BYTES].ljust(NAME_BYTES, b"\0"), "<i8")
    return h


def _name(h: Array) -> str:
    """The name a header carries, as far as it does (``…`` where it was cut, and a character
    the cut split is left out)."""
    length = int(h[_NAME_LEN])
    raw = h[_NAME : _NAME + NAME_BYTES // 8].astype("<i8").tobytes()[: min(length, NAME_BYTES)]
    cut = length > NAME_BYTES
    return raw.decode("utf-8", "ignore" if cut else "replace") + ("…" if cut else "")


def describe(h: Array) -> str:
    """A header as a person reads it: ``all_reduce(sum) float32 (4, 3)``."""
    if int(h[_MAGIC]) != MAGIC:
        return f"a message that is not a polyjit header ({h[:4].tolist()}...)"
    kind = KINDS[int(h[_KIND])] if 0 <= int(h[_KIND]) < len(KINDS) else f"kind {int(h[_KIND])}"
    parts = [kind]
    if int(h[_OP]):
        parts[0] += f"({OPS[int(h[_OP]) - 1]})"
    if kind == "broadcast":
        parts.append(f"root {int(h[_ROOT])}")
    elif kind in ("send", "recv"):
        parts.append(f"tag {int(h[_ROOT])}")
    if int(h[_NAME_HASH]):
        parts.append(f"of {_name(h)!r}")
    if int(h[_DTYPE]) and kind == "check":
        ndim = int(h[_NDIM])
        values = [str(int(v)) for v in h[_DIMS : _DIMS + min(ndim, MAX_DIMS)]]
        parts.append("values (" + ", ".join(values + (["..."] if ndim > MAX_DIMS else [])) + ")")
    elif int(h[_DTYPE]):
        ndim = int(h[_NDIM])
        dims = [str(int(d)) for d in h[_DIMS : _DIMS + min(ndim, MAX_DIMS)]]
        if ndim > MAX_DIMS:
            dims.append("...")
        shape = "(" + ", ".join(dims) + ("," if ndim == 1 else "") + ")"
        parts.append(f"{dtype_name(int(h[_DTYPE]))} {shape}")
    parts.append(f"(call #{int(h[_SEQ])})")
    if int(h[FLAG]):
        parts.append("[refused]")
    return " ".join(parts)


def _key(h: Array) -> tuple[int, ...]:
    """What must agree: everything but the magic (checked apart) and the refusal flag."""
    return tuple(int(v) for k, v in enumerate(h) if k not in (_MAGIC, FLAG))


def disagreement(headers: Sequence[Array]) -> str | None:
    """None when every rank's header agrees; else which ranks said what."""
    keys = [_key(h) for h in headers]
    if all(int(h[_MAGIC]) == MAGIC for h in headers) and len(set(keys)) == 1:
        return None
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, key in enumerate(keys):
        groups.setdefault(key, []).append(rank)
    texts = {key: describe(headers[ranks[0]]) for key, ranks in groups.items()}
    if len(set(texts.values())) < len(texts):  # they differ past what a message shows
        texts = {key: f"{text} [hash {_hash(repr(key).encode()) & 0xFFFFFF:06x}]" for key, text in texts.items()}
    return "; ".join(f"{_ranks(groups[key])}: {text}" for key, text in texts.items())


def pair_disagreement(send: Array, recv: Array) -> str | None:
    """A send's header against its recv's: the same dtype, shape and tag."""
    if int(send[_MAGIC]) != MAGIC or int(recv[_MAGIC]) != MAGIC:
        return f"send: {describe(send)}; recv: {describe(recv)}"
    same = (int(send[_KIND]) == KINDS.index("send") and int(recv[_KIND]) == KINDS.index("recv")
            and int(send[_SEQ]) == int(recv[_SEQ]) and tuple(send[_ROOT:]) == tuple(recv[_ROOT:]))
    return None if same else f"send: {describe(send)}; recv: {describe(recv)}"


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 2`` / ``ranks 1, 3``."""
    return _ranks(ranks)
