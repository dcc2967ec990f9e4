"""core/interrupts.py: Ctrl-C inside a step's parts is held until they are all queued."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator

import pytest

from polyjit.core import interrupts
from polyjit.core.interrupts import whole


@pytest.fixture(autouse=True)
def default_sigint(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Python's own SIGINT handler, as a program starts with (a test runner may set its own)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setattr(interrupts, "_installed", False)
    yield
    signal.signal(signal.SIGINT, before)


def test_a_ctrl_c_inside_is_raised_at_the_end_and_outside_at_once() -> None:
    parts = []
    with pytest.raises(KeyboardInterrupt), whole():
        parts.append(1)
        signal.raise_signal(signal.SIGINT)
        parts.append(2)  # the block goes on: the step's later parts are queued
    assert parts == [1, 2]
    assert signal.getsignal(signal.SIGINT) is interrupts._on_sigint
    with pytest.raises(KeyboardInterrupt):  # outside a block, as Python's default
        signal.raise_signal(signal.SIGINT)
        parts.append(3)
    assert parts == [1, 2]


def test_a_second_ctrl_c_is_not_held() -> None:
    """A part stuck in a wait (a full backlog, a hung device) can still be left."""
    parts = []
    with pytest.raises(KeyboardInterrupt), whole():
        signal.raise_signal(signal.SIGINT)
        parts.append(1)
        signal.raise_signal(signal.SIGINT)
        parts.append(2)
    assert parts == [1]
    with whole():  # nothing is left held for the next block
        parts.append(3)
    assert parts == [1, 3]


def test_nested_blocks_raise_once_at_the_outermost_end() -> None:
    parts = []
    with pytest.raises(KeyboardInterrupt), whole():
        with whole():
            signal.raise_signal(signal.SIGINT)
            parts.append(1)
        parts.append(2)
    assert parts == [1, 2]


def test_a_handler_of_the_programs_own_is_kept() -> None:
    seen = []
    signal.signal(signal.SIGINT, lambda s, f: seen.append(s))
    with whole():
        signal.raise_signal(signal.SIGINT)
    assert seen == [signal.SIGINT]  # its handler ran, at once: no holding without Python's default


def test_other_threads_need_nothing() -> None:
    done = []

    def step() -> None:
        with whole():
            done.append(threading.get_ident())

    t = threading.Thread(target=step)
    t.start()
    t.join()
    assert done and interrupts._depth == 0
