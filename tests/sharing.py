"""A CPU stream that shares every kernel's range on every run (its tuner off), for the tests
that check a shared kernel's bits. Contexts of a device use the device's one stream, so the
tuner is turned back on after: a later test on the same xdist worker gets the stream as the
runtime leaves it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from polyjit.backends.cpu.native import load_runtime


@contextlib.contextmanager
def shared_every_run(stream: int) -> Iterator[None]:
    """While inside, the native stream ``stream`` shares its optional kernels and runs every
    ranged kernel on its full team (NativeRuntime.set_adaptive)."""
    rt = load_runtime()
    rt.set_adaptive(stream, False)
    try:
        yield
    finally:
        rt.set_adaptive(stream, True)
