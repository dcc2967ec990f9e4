"""Huge pages for the large host buffers handed to MPI.

MPI's shared-memory transport copies and reduces through the user's buffer; on 4 KiB pages
a 64 MiB node costs about a quarter more time than the same array on 2 MiB pages (numpy
asks the kernel for huge pages for its large arrays; the cpu backend's pools do not). The
first time a node of at least ``HUGE_PAGES_FROM`` bytes of host memory goes to MPI, its
2 MiB-aligned interior is marked ``MADV_HUGEPAGE`` and collapsed into huge pages now
(``MADV_COLLAPSE``, Linux 6.1+; tens of milliseconds once). The addresses and values do not
change. Where the kernel refuses, nothing happens. ``POLYJIT_MPI_HUGEPAGES=0`` turns it off.

(The right place is the cpu backend's allocator: ``madvise(MADV_HUGEPAGE)`` on large pools
before their first touch; see docs/distributed.md, "What the runtime should offer".)
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from typing import Any

import numpy as np

HUGE_PAGES_FROM = 8 << 20
ENV = "POLYJIT_MPI_HUGEPAGES"
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25

_done: set[tuple[int, int]] = set()
_lock = threading.Lock()
_madvise: Any = None


def _libc_madvise() -> Any:
    global _madvise
    if _madvise is None:
        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        _madvise = fn
    return _madvise


def huge_pages(values: np.ndarray[Any, Any]) -> bool:
    """Back the array's memory by huge pages, once per (address, size); True if it was done
    now. Best effort: on any refusal, the memory stays as it was."""
    if not sys.platform.startswith("linux") or os.environ.get(ENV, "1").strip() in ("0", "off", "no", "false"):
        return False
    start = int(values.ctypes.data)
    lo = (start + _HUGE - 1) // _HUGE * _HUGE
    hi = (start + values.nbytes) // _HUGE * _HUGE
    if hi <= lo:
        return False
    key = (start, int(values.nbytes))
    with _lock:
        if key in _done:
            return False
        _done.add(key)
    try:
        madvise = _libc_madvise()
        if madvise(lo, hi - lo, _MADV_HUGEPAGE) != 0:
            return False
        return bool(madvise(lo, hi - lo, _MADV_COLLAPSE) == 0)
    except (OSError, AttributeError):
        return False
