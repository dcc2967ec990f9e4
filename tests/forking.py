"""A forked child's exit status, or a failure when it hangs (the tests of locks a fork copies)."""

from __future__ import annotations

import os
import signal
import time

import pytest


def exit_code(pid: int, what: str, seconds: float = 30.0) -> int:
    """Wait for the child ``pid``; kill it and fail the test (``what`` hung) after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        finished, status = os.waitpid(pid, os.WNOHANG)
        if finished:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the forked child hung: {what}")
        time.sleep(0.05)
