"""Device memory counts that earlier tests cannot move. Under pytest-xdist any test may
follow any other, and what an earlier test dropped is freed when the garbage collector gets
to it, maybe in the middle of a later test's count: count after collecting and waiting."""

from __future__ import annotations

import gc
from typing import Any


def settled_memory(dev: Any) -> int:
    """``dev.used_memory()`` once dropped objects are collected and the device is idle."""
    gc.collect()
    dev.synchronize()
    return int(dev.used_memory())
