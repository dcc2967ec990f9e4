"""One call at a time on an object that threads share: ``@serialized`` methods take the
object's reentrant ``_lock``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar


class _Serial(Protocol):
    @property
    def _lock(self) -> AbstractContextManager[Any]: ...


S = TypeVar("S", bound=_Serial)
P = ParamSpec("P")
R = TypeVar("R")


def serialized(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """One call at a time on an object that owns state its calls must not interleave on (a
    Plan's staging and result arrays, a Comm's call numbers): threads that share it take
    turns. The lock is reentrant, so a serialized method may call another."""
    @functools.wraps(method)
    def one_at_a_time(self: S, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._lock:
            return method(self, *args, **kwargs)
    return one_at_a_time
