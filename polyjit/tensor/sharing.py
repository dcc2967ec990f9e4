"""Plans that share state (``compile(..., share=other)``): who shares whose, and the locks
they take together.

A plan made with ``share=`` links into another plan's (or a data_parallel's) state context:
the same parameter buffers. Whatever reads or writes that state (a run, a step, a state
call, a reset) of any plan of such a tree takes the locks of the whole tree, in one order
(a data_parallel's own lock first, then the plans' by id), so no call sees another's step
half enqueued. A plan that shares nothing takes its own lock only.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

if TYPE_CHECKING:
    from polyjit.tensor.plan import Plan

P = ParamSpec("P")
R = TypeVar("R")


_plan_type: list[type] = []  # Plan, once imported (plan.py imports this module)


def _is_plan(x: Any) -> bool:
    if not _plan_type:
        from polyjit.tensor.plan import Plan

        _plan_type.append(Plan)
    return isinstance(x, _plan_type[0])


# Who shares whose state (share=): the owner (a plan or a data_parallel) -> the plans made
# with share=owner. Weak both ways: sharing keeps nothing alive.
_SHARING = threading.Lock()
_SHARERS: weakref.WeakKeyDictionary[Any, weakref.WeakSet[Plan]] = weakref.WeakKeyDictionary()
# The lock order of each sharing tree (_shared_locks), made again once a plan joins any tree
_LOCKS: weakref.WeakKeyDictionary[Any, tuple[int, tuple[Any, ...]]] = weakref.WeakKeyDictionary()
_joined = [0]  # plans that joined a tree so far


def join(plan: Plan, share: Any) -> None:
    """Record that ``plan`` was made with ``share=share`` (a plan or a data_parallel)."""
    with _SHARING:
        _SHARERS.setdefault(share, weakref.WeakSet()).add(plan)
        _joined[0] += 1
        if _is_plan(share):
            share._shared = True


def state_owner(plan: Plan) -> Any:
    """Who owns the state a plan uses: the first plan of its ``share=`` chain, or a data_parallel."""
    owner: Any = plan
    while _is_plan(owner) and owner._share is not None:
        owner = owner._share
    return owner


def _sharing_plans(owner: Any) -> list[Plan]:
    """The plans sharing ``owner``'s state, directly or through another sharer (``owner`` too,
    if it is a plan), in the order their locks are taken (by id). _SHARING held."""
    plans, todo = [], [owner]
    while todo:
        sharer = todo.pop()
        if _is_plan(sharer):
            plans.append(sharer)
        todo.extend(list(_SHARERS.get(sharer, ())))
    return sorted(plans, key=id)


def _shared_locks(owner: Any) -> tuple[Any, ...]:
    """The locks of ``owner``'s sharing tree in the one order they are taken: a data_parallel's
    own first, then the plans' by id. Kept until a plan joins a tree (the walk cost more than
    the step of a small plan); a sharer gone since only leaves its lock here."""
    with _SHARING:
        cached = _LOCKS.get(owner)
        if cached is not None and cached[0] == _joined[0]:
            return cached[1]
        locks = ((owner._lock,) if not _is_plan(owner) else ()) + tuple(p._lock for p in _sharing_plans(owner))
        _LOCKS[owner] = (_joined[0], locks)
        return locks


def _holding(owner: Any, call: Callable[[], R]) -> R:
    """``call()`` holding the locks of ``owner``'s sharing tree, in their one order
    (:func:`_shared_locks`). Found by review: a sharer's ``state_dict()`` held its own lock
    only, so it read parameters from different steps of the owner's training thread, and a
    ``load_state_dict()`` came out torn."""
    locks = _shared_locks(owner)
    taken = 0
    try:
        for lock in locks:
            lock.acquire()
            taken += 1
        return call()
    finally:
        for lock in reversed(locks[:taken]):
            lock.release()


def reset_shared(owner: Any, reset_owner: Callable[[], None] | None = None) -> None:
    """Reset the state of ``owner`` (a plan, or a data_parallel: ``reset_owner`` resets its
    replicas) and of every plan sharing it, holding all their locks, so no step of theirs is
    half enqueued meanwhile."""
    def reset() -> None:
        if reset_owner is not None:
            reset_owner()
        with _SHARING:
            plans = _sharing_plans(owner)
        for plan in plans:
            if not plan._state.context.finalized:  # a closed sharer's buffers are gone
                plan._state.reset(plan.program.persistent)
    _holding(owner, reset)


def whole_state(method: Callable[Concatenate[Plan, P], R]) -> Callable[Concatenate[Plan, P], R]:
    """``@serialized`` for what reads or writes a plan's state: a plan that shares state
    (``share=``, either side) takes the locks of everything sharing it, so no call of one
    sees another's step half enqueued; any other plan takes its own."""
    @functools.wraps(method)
    def locked(self: Plan, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._share is None and not self._shared:
            with self._lock:
                return method(self, *args, **kwargs)
        return _holding(state_owner(self), lambda: method(self, *args, **kwargs))
    return locked
