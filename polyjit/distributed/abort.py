"""An uncaught exception on one rank ends the whole job, with that rank's traceback.

Without this, a rank that raises exits while the others wait in their next collective
until its timeout (or for ever, in plain MPI). ``import polyjit.distributed`` installs a
``sys.excepthook`` that, in a job of more than one rank, prints the traceback with every
line tagged ``[rank R]`` to stderr, flushes it, gives the launcher 0.1 s to forward it, and
calls ``MPI_Abort`` on COMM_WORLD, so
``mpiexec`` kills every rank and exits non-zero at once.

Opt out with ``POLYJIT_MPI_ABORT=0`` in the environment (read at import), or
``polyjit.distributed.uninstall_excepthook()``. In a single process (no ``mpiexec``, or
``-n 1``) the hook hands over to the previous one. An exception that ends a thread other
than the main one (``threading.excepthook``: a server's or a notebook's worker) aborts the
job the same way: the other ranks would otherwise wait in their next collective.

A ``SystemExit`` (``sys.exit(n)``) never reaches ``sys.excepthook``, and nothing a library can
hook sees its code, so it does not end the job: the other ranks time out. Starting the ranks
with ``python -m mpi4py script.py`` makes a non-zero exit abort the job (docs/distributed.md).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import Any

ENV = "POLYJIT_MPI_ABORT"
ABORT_CODE = 1
# MPI_Abort kills the ranks at once, and the launcher forwards a rank's stderr on its own
# time: a line written just before the abort was lost once in a loaded test run. The abort
# waits this long after the flush, for the launcher to read it.
FORWARD_PAUSE_S = 0.1

_previous: Any = None
_previous_thread: Any = None


def enabled_by_environment() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def tagged_traceback(rank: int, exc_type: type[BaseException], exc: BaseException,
                     tb: TracebackType | None) -> str:
    """The traceback as Python prints it, every line starting with ``[rank R] ``."""
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    prefix = f"[rank {rank}] "
    return "".join(prefix + line for line in text.splitlines(keepends=True))


def _where() -> str:
    """The machine and process of this rank: on several machines, where to look."""
    return f"host {socket.gethostname()}, pid {os.getpid()}"


def _abort_job(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> bool:
    """In a live job of more than one rank: print the tagged traceback and abort the job
    (does not return). Else False: the caller hands over to the hook before polyjit's."""
    from mpi4py import MPI

    try:
        world = MPI.COMM_WORLD
        rank, size = world.Get_rank(), world.Get_size()
        alive = MPI.Is_initialized() and not MPI.Is_finalized()
    except Exception:
        return False
    if size <= 1 or not alive:
        return False
    try:
        sys.stderr.write(tagged_traceback(rank, exc_type, exc, tb)
                         + f"[rank {rank}] polyjit.distributed: an uncaught exception on rank {rank} of {size} "
                         f"({_where()}): aborting the job (MPI_Abort; {ENV}=0 turns this off)\n")
        sys.stderr.flush()
        sys.stdout.flush()
        time.sleep(FORWARD_PAUSE_S)
    finally:
        world.Abort(ABORT_CODE)
    return True  # not reached: MPI_Abort ends the process


def _hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if not _abort_job(exc_type, exc, tb):
        (_previous or sys.__excepthook__)(exc_type, exc, tb)


def _thread_hook(args: threading.ExceptHookArgs) -> None:
    """An exception that ends a thread other than the main one: as :func:`_hook` (a
    SystemExit ends only its thread, as Python's own hook has it)."""
    if args.exc_type is SystemExit or args.exc_value is None or \
            not _abort_job(args.exc_type, args.exc_value, args.exc_traceback):
        (_previous_thread or threading.__excepthook__)(args)


def install_excepthook() -> None:
    """Tag and abort on an uncaught exception, in any thread (see the module docstring);
    idempotent."""
    global _previous, _previous_thread
    if sys.excepthook is not _hook:
        _previous = sys.excepthook
        sys.excepthook = _hook
    if threading.excepthook is not _thread_hook:
        _previous_thread = threading.excepthook
        threading.excepthook = _thread_hook


def uninstall_excepthook() -> None:
    """Put back the hooks that were there before :func:`install_excepthook`."""
    global _previous, _previous_thread
    if sys.excepthook is _hook:
        sys.excepthook = _previous or sys.__excepthook__
    if threading.excepthook is _thread_hook:
        threading.excepthook = _previous_thread or threading.__excepthook__
    _previous = _previous_thread = None


def excepthook_installed() -> bool:
    return sys.excepthook is _hook and threading.excepthook is _thread_hook
