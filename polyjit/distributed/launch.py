"""Starting jobs and placing ranks: find ``mpiexec``, build its command line, pin each rank to
its own cores.

``find_mpiexec()`` looks, in order, at ``$POLYJIT_MPIEXEC``, next to the Python executable
(where pip puts the ``mpich`` wheel's ``mpiexec``, in a virtual environment too), in
Python's scripts directory and under ``sys.prefix``, then on ``PATH`` (``mpiexec``,
``mpirun``). ``mpiexec_command(n, ...)`` adds Open MPI's ``--oversubscribe`` (more ranks than
cores) and, as root, ``--allow-run-as-root``; MPICH's Hydra needs neither.

This module imports nothing from MPI at import time (tests load it to find ``mpiexec``
without starting MPI in their own process).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from polyjit.core.dtypes import is_int
from polyjit.core.errors import InvalidArgumentError, PolyjitError

ENV = "POLYJIT_MPIEXEC"
NAMES = ("mpiexec", "mpirun")


class MpiexecNotFoundError(PolyjitError, FileNotFoundError):
    """No ``mpiexec`` was found (``pip install 'polyjit[mpi]'`` installs one)."""


def _candidates() -> list[Path]:
    dirs = [Path(sys.executable).parent]
    scripts = sysconfig.get_path("scripts")
    if scripts:
        dirs.append(Path(scripts))
    dirs.append(Path(sys.prefix) / "bin")
    out = [d / name for d in dict.fromkeys(dirs) for name in NAMES]
    for name in NAMES:
        found = shutil.which(name)
        if found:
            out.append(Path(found))
    return out


def find_mpiexec() -> str:
    """The ``mpiexec`` to start jobs with (see the module docstring for where it looks)."""
    forced = os.environ.get(ENV, "").strip()
    if forced:
        found = shutil.which(forced) or (forced if os.path.isfile(forced) and os.access(forced, os.X_OK) else None)
        if found is None:
            raise MpiexecNotFoundError(f"{ENV}={forced!r} is not an executable")
        return str(found)
    for path in _candidates():
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    raise MpiexecNotFoundError(
        "no mpiexec next to the Python executable, in its scripts directory or on PATH; "
        f"pip install 'polyjit[mpi]' (mpi4py and the mpich wheel), or set {ENV}")


@functools.cache
def mpiexec_flavor(mpiexec: str) -> str:
    """"openmpi", "mpich" (Hydra) or "unknown", from ``mpiexec --version``."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
        text = (out.stdout + out.stderr).lower()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if "open mpi" in text or "openrte" in text or "open-mpi" in text or "prte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text or "intel" in text:
        return "mpich"
    return "unknown"


def mpiexec_command(n: int, *args: str, mpiexec: str | None = None, python: bool = True) -> list[str]:
    """``[mpiexec, flags..., -n, N, python, *args]`` (``python=False``: no interpreter)."""
    if not is_int(n) or n < 1:  # found by review: 0, -3, 2.9 and True became -n 0, -n -3, -n 2, -n 1
        raise InvalidArgumentError(f"mpiexec_command: n is a number of ranks (an int >= 1), got {n!r}")
    exe = mpiexec or find_mpiexec()
    flags: list[str] = []
    if mpiexec_flavor(exe) == "openmpi":
        flags.append("--oversubscribe")
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            flags.append("--allow-run-as-root")
    return [exe, *flags, "-n", str(int(n)), *([sys.executable] if python else []), *args]


def local_rank(comm: Any = None, *, timeout: float | None = None) -> tuple[int, int]:
    """(this rank's index among the ranks on its machine, how many ranks are on it): a
    collective call over ``comm`` (default: COMM_WORLD), within ``timeout`` seconds (default:
    the Comm's)."""
    return _local_rank(comm, timeout)


def _local_rank(comm: Any, timeout: float | None, check: tuple[str, list[int], Exception | None] | None = None
                ) -> tuple[int, int]:
    """The exchange of local_rank through a Comm (a timeout, a rank's refusal: found by review,
    MPI's Split_type blocked for ever where one rank refused its arguments first); ``timeout``
    None: a Comm's own, else the default. ``check``: (what, values, problem) for a check_same
    first; with ``problem`` this rank refuses it: it raises that, the others
    CollectiveRefusedError."""
    from polyjit.distributed.comm import Comm

    if timeout is None and isinstance(comm, Comm):
        timeout = comm.timeout
    with Comm(comm, timeout=timeout) as c:
        if check is not None:
            what, values, problem = check
            if problem is not None:
                c.refuse(problem, "check")
            c.check_same(what, values)
        machines = np.zeros(c.size, np.int64)  # each rank's machine, by a hash of its name
        machines[c.rank] = int.from_bytes(hashlib.blake2b(socket.gethostname().encode(), digest_size=7).digest(),
                                          "little")
        machines = c.all_reduce_array(machines, "sum")
    mine = machines[c.rank]
    return int((machines[: c.rank] == mine).sum()), int((machines == mine).sum())


def bind_to_cores(cores_per_rank: int | None = None, comm: Any = None,
                  cores: Sequence[int] | None = None, *, timeout: float | None = None) -> list[int]:
    """Pin this process to its own share of the machine's cores and return them.

    The ranks of one machine split ``cores`` (default: the cores this process may use) into
    equal consecutive groups of ``cores_per_rank`` (default: as many as divide evenly, at
    least one); with more ranks than cores, ranks share. Call it before the cpu backend is
    first used: a cpu device is the set of cores the process may use when it starts
    (``POLYJIT_CPU_DEVICES`` then splits that set). A collective call (:func:`local_rank`):
    a rank whose arguments are refused raises its InvalidArgumentError, the others
    CollectiveRefusedError; ``cores_per_rank`` must be the same on every rank
    (CollectiveMismatchError).
    """
    problem: Exception | None = None
    allowed: list[int] = []
    try:
        if cores_per_rank is not None and (not is_int(cores_per_rank) or cores_per_rank < 1):
            raise InvalidArgumentError(f"bind_to_cores: cores_per_rank is a positive int, got {cores_per_rank!r}")
        allowed = sorted(_core_numbers(cores)) if cores is not None else sorted(os.sched_getaffinity(0))
        if not allowed:
            raise InvalidArgumentError("bind_to_cores: cores=[] leaves no core to bind to")
    except InvalidArgumentError as e:
        problem = e
    # the ranks agree on cores_per_rank (found by review: 2 on one rank, 1 on another overlapped)
    per_rank = 0 if problem is not None or cores_per_rank is None else int(cores_per_rank)
    here, count = _local_rank(comm, timeout, ("bind_to_cores (cores_per_rank; 0: the default)", [per_rank], problem))
    per = cores_per_rank or max(len(allowed) // count, 1)
    start = (here * per) % len(allowed)
    mine = [allowed[(start + k) % len(allowed)] for k in range(min(per, len(allowed)))]
    try:
        os.sched_setaffinity(0, mine)
    except (OSError, ValueError) as e:  # ValueError: a negative core number
        raise InvalidArgumentError(f"bind_to_cores: cannot bind rank {here} of this machine to cores {mine}: "
                                   f"{getattr(e, 'strerror', None) or e}") from None
    return mine


def _core_numbers(cores: Any) -> list[int]:
    """``cores=`` as a list of ints (any iterable of them, read once), refused by name else."""
    try:
        out = list(cores)
    except TypeError:
        raise InvalidArgumentError(f"bind_to_cores: cores is a list of core numbers, got {cores!r}") from None
    for c in out:
        if not is_int(c):
            raise InvalidArgumentError(f"bind_to_cores: cores holds {c!r}, not a core number")
    return [int(c) for c in out]
