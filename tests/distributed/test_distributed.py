"""polyjit.distributed under ``mpiexec -n 2`` and ``-n 3``: the scenarios of scenarios.py run
as MPI jobs in subprocesses (the pytest process itself never starts MPI).

Without mpi4py these tests skip, saying why (``pip install 'polyjit[mpi]'``); CI installs
the extra, and under CI (``$CI`` set) a missing mpi4py fails instead of skipping.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = Path(__file__).resolve().parent / "scenarios.py"

if importlib.util.find_spec("mpi4py") is None:
    if os.environ.get("CI"):
        pytest.fail("mpi4py is not installed, and CI must run the MPI tests: pip install -e '.[mpi]'",
                    pytrace=False)
    pytest.skip("mpi4py is not installed: pip install 'polyjit[mpi]' (mpi4py and the mpich wheel)",
                allow_module_level=True)


def _standalone(module: str) -> ModuleType:
    """polyjit/distributed/<module>.py loaded alone, without the package (which would start MPI
    here): launch.py and header.py need no more than the standard library and numpy."""
    spec = importlib.util.spec_from_file_location(f"_pj_{module}", ROOT / "polyjit" / "distributed" / f"{module}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


launch = _standalone("launch")


def test_headers_that_differ_past_what_a_message_shows_say_so() -> None:
    """Found by review: values past the 10th (check_same) or dims past the 10th made the
    mismatch message read as if the ranks agreed ("ranks 0, 1: check values (1, ..., 1)")."""
    header = _standalone("header")
    a = header.make(3, "check", dtype="int64", shape=[1] * 12)
    b = header.make(3, "check", dtype="int64", shape=[1] * 11 + [2])
    text = header.disagreement([a, b, a])
    assert text is not None and text.startswith("ranks 0, 2: ") and "; rank 1: " in text, text
    assert "..." in text and "[hash " in text, text  # the two sides read apart
    assert header.disagreement([a, a]) is None
    deep = [header.make(0, "all_reduce", op="sum", dtype="float32", shape=[1] * 11 + [n]) for n in (2, 3)]
    text = header.disagreement(deep)
    assert text is not None and text.count("[hash ") == 2, text
    # the node's name is compared, and shown as far as the header carries it
    x, y = (header.make(5, "all_reduce", op="sum", dtype="float32", shape=(4,), name=n)
            for n in ("grads_of_the_first_layer", "grads_b"))
    text = header.disagreement([x, y])
    assert text is not None and "of 'grads_of_the_fir…'" in text and "of 'grads_b'" in text, text
    assert "[hash " not in text, text
    # found by review: a name of exactly 16 bytes read as cut, a cut inside a character as U+FFFD
    exact, accented = (header.make(1, "barrier", shape=(), name=n) for n in ("a" * 16, "a" * 15 + "é!"))
    assert "of 'aaaaaaaaaaaaaaaa'" in header.describe(exact), header.describe(exact)
    assert "of 'aaaaaaaaaaaaaaa…'" in header.describe(accented), header.describe(accented)


class Job:
    """One finished ``mpiexec -n N python scenarios.py ...``."""

    def __init__(self, n: int, names: tuple[str, ...], rc: int, out: str, err: str, logs: dict[int, str],
                 seconds: float) -> None:
        self.n, self.names, self.rc, self.out, self.err, self.logs, self.seconds = n, names, rc, out, err, logs, seconds

    def text(self) -> str:
        return f"mpiexec -n {self.n} {' '.join(self.names)}: exit {self.rc} after {self.seconds:.1f} s\n" \
               f"--- stdout\n{self.out[-6000:]}\n--- stderr\n{self.err[-6000:]}"

    def lines(self, rank: int, prefix: str) -> list[str]:
        return [ln for ln in self.logs.get(rank, "").splitlines() if ln.startswith(prefix)]

    def passed(self, name: str) -> None:
        """Every rank passed scenario ``name`` (or, for an optional one, every rank skipped it)."""
        skips = [ln for r in range(self.n) for ln in self.lines(r, f"SKIP {name} ")]
        if skips and len(skips) == self.n:
            pytest.skip(skips[0].split(": ", 1)[-1])
        missing = [r for r in range(self.n) if f"PASS {name} rank {r}" not in self.lines(r, "PASS ")]
        assert not missing, f"scenario {name}: no PASS from ranks {missing}\n{self.text()}"


def run_job(n: int, *names: str, env: dict[str, str] | None = None, timeout: float = 240) -> Job:
    cmd = launch.mpiexec_command(n, str(SCENARIOS), *names)
    with tempfile.TemporaryDirectory(prefix="pj-mpi-") as out_dir:
        full_env = {**os.environ, "SCENARIO_OUT": out_dir, "PYTHONUNBUFFERED": "1", **(env or {})}
        t0 = time.monotonic()
        # its own process group: on a hang, the ranks go with mpiexec
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                                cwd=ROOT, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s (a hang):\n{out[-4000:]}\n{err[-4000:]}")
        seconds = time.monotonic() - t0
        logs = {r: (Path(out_dir) / f"rank{r}.log").read_text() for r in range(n)
                if (Path(out_dir) / f"rank{r}.log").exists()}
    return Job(n, names, proc.returncode, out, err, logs, seconds)


@pytest.fixture(scope="module")
def mpiexec() -> str:
    try:
        return str(launch.find_mpiexec())
    except FileNotFoundError as e:  # mpi4py is here, its mpiexec is not: fail, do not skip
        pytest.fail(str(e))


JOB2 = ("collectives", "bfloat16", "ordering", "mismatch", "local_failure", "export_path", "staged", "data_parallel:2",
        "dp_local_failure", "spread_nan", "world_threads", "comm_threads", "comm_lifetimes", "nan_fold", "late_rank",
        "lock_timeout", "nccl_id", "nccl_refusal", "dp_rank0_state", "dp_two_models", "dp_names", "half_mean",
        "bind_refused", "intercomm", "dup_retry", "interrupted", "timeout")
JOB3 = ("collectives", "bfloat16", "mismatch", "local_failure", "data_parallel:2", "dp_local_failure", "spread_nan",
        "comm_threads", "nan_fold", "gave_up_while_missing", "dp_rank0_state", "dp_two_models", "dp_names", "half_mean",
        "bind_refused", "dup_retry", "interrupted", "timeout")


@pytest.fixture(scope="module")
def job2(mpiexec: str) -> Job:
    job = run_job(2, *JOB2)
    assert job.rc == 0, job.text()
    return job


@pytest.fixture(scope="module")
def job3(mpiexec: str) -> Job:
    job = run_job(3, *JOB3)
    assert job.rc == 0, job.text()
    return job


@pytest.fixture(params=[2, 3], ids=["2_ranks", "3_ranks"])
def job(request: pytest.FixtureRequest) -> Job:
    fixture: Job = request.getfixturevalue(f"job{request.param}")
    return fixture


# ---------------------------------------------------------------------------------------------


def test_every_collective_and_op_matches_numpy(job: Job) -> None:
    job.passed("collectives")


def test_bfloat16_goes_through_every_collective_and_data_parallel(job: Job) -> None:
    job.passed("bfloat16")


def test_collectives_order_with_routines_before_and_after_without_waits(job2: Job) -> None:
    job2.passed("ordering")


def test_mismatched_calls_raise_on_every_rank_before_data_moves(job: Job) -> None:
    job.passed("mismatch")
    for r in range(job.n):
        (line,) = job.lines(r, "MISMATCH ")
        assert "(4, 3)" in line and "(5, 3)" in line and "no data was moved" in line, line


def test_a_rank_whose_call_fails_locally_still_joins_and_the_comm_carries_on(job: Job) -> None:
    job.passed("local_failure")


@pytest.mark.parametrize(("n", "devices"), [(2, 2), (3, 2)], ids=["2x2", "3x2"])
def test_hierarchical_data_parallel_matches_one_device(n: int, devices: int, request: pytest.FixtureRequest) -> None:
    job: Job = request.getfixturevalue(f"job{n}")
    job.passed(f"data_parallel:{devices}")


def test_a_data_parallel_step_that_fails_on_one_rank_fails_on_every_rank_in_step(job: Job) -> None:
    job.passed("dp_local_failure")


def test_a_nan_parameter_shows_in_the_spreads(job: Job) -> None:
    job.passed("spread_nan")


def test_every_rank_starts_loads_and_resets_with_rank_0s_state(job: Job) -> None:
    job.passed("dp_rank0_state")


def test_two_data_parallels_over_one_comm_never_sum_each_others_gradients(job: Job) -> None:
    job.passed("dp_two_models")


def test_data_parallel_names_are_given_back_and_refused_on_every_rank(job: Job) -> None:
    job.passed("dp_names")


def test_half_means_reduce_in_float32(job: Job) -> None:
    job.passed("half_mean")


def test_bind_to_cores_refused_on_one_rank_is_refused_on_every_rank(job: Job) -> None:
    job.passed("bind_refused")


def test_a_comm_made_after_one_timed_out_pairs_with_the_peers(job: Job) -> None:
    job.passed("dup_retry")


def test_an_interrupted_call_breaks_the_comm_at_once_on_every_rank(job: Job) -> None:
    job.passed("interrupted")


def test_threads_sharing_a_comm_never_get_each_others_values(job: Job) -> None:
    job.passed("comm_threads")


def test_a_rank_that_gives_up_first_does_not_hide_the_one_missing(job3: Job) -> None:
    job3.passed("gave_up_while_missing")


def test_a_call_waiting_for_another_threads_call_keeps_its_own_timeout(job2: Job) -> None:
    job2.passed("lock_timeout")


def test_a_rank_late_to_a_call_others_gave_up_fails_at_once(job2: Job) -> None:
    job2.passed("late_rank")


def test_a_nan_in_a_max_or_min_reaches_every_rank(job: Job) -> None:
    job.passed("nan_fold")


def test_comms_are_freed_by_with_and_by_data_parallel_and_running_out_is_a_driver_error(job2: Job) -> None:
    job2.passed("comm_lifetimes")


def test_world_from_several_threads_is_one_comm(job2: Job) -> None:
    job2.passed("world_threads")


def test_a_rank_that_never_joins_is_named_by_the_others(job: Job) -> None:
    job.passed("timeout")
    last = job.n - 1
    for r in range(last):
        (line,) = job.lines(r, "TIMEOUT ")
        assert f"rank {last} of {job.n} did not join" in line and "all_reduce" in line and "to_grads" in line, line


def test_device_memory_path_on_host_exports(job2: Job) -> None:
    """The CUDA-aware code path (exports, event waits, the mean as a routine), on the cpu."""
    job2.passed("export_path")


def test_staged_path_through_a_backend_with_its_own_memory(job2: Job) -> None:
    job2.passed("staged")


def test_nccl_unique_id_reaches_every_rank(job2: Job) -> None:
    job2.passed("nccl_id")


def test_nccl_call_refused_where_its_preparation_failed(job2: Job) -> None:
    job2.passed("nccl_refusal")


def test_an_exception_on_one_rank_aborts_the_job_with_its_traceback(mpiexec: str) -> None:
    job = run_job(2, "abort", timeout=120)
    assert job.rc != 0, job.text()
    assert job.seconds < 60, job.text()  # rank 0 waited in a collective with a 120 s timeout
    assert "[rank 1] Traceback (most recent call last):" in job.err, job.text()
    assert "[rank 1] RuntimeError: boom on purpose" in job.err, job.text()
    assert "aborting the job" in job.err, job.text()
    assert f"on rank 1 of 2 (host {socket.gethostname()}, pid " in job.err, job.text()  # where to look
    assert not any(job.lines(r, "NOT ABORTED") for r in range(2)), job.text()


def test_an_exception_that_ends_a_thread_aborts_the_job_too(mpiexec: str) -> None:
    job = run_job(2, "thread_abort", timeout=120)
    assert job.rc != 0, job.text()
    assert job.seconds < 50, job.text()  # rank 0 waited in a collective with a 120 s timeout
    assert "[rank 1] ValueError: bad batch on rank 1's thread" in job.err, job.text()
    assert "aborting the job" in job.err, job.text()
    assert not any(job.lines(r, "NOT ABORTED") for r in range(2)), job.text()


def test_sys_exit_on_one_rank_ends_the_job_under_the_mpi4py_runner(mpiexec: str) -> None:
    """A SystemExit never reaches sys.excepthook, so the hook cannot end the job (docs: "One
    rank fails, the job ends"): under ``python -m mpi4py`` the runner aborts it with the exit
    code; under plain ``python`` the other rank waits out its timeout and names the rank."""
    cmd = launch.mpiexec_command(2, "-m", "mpi4py", str(SCENARIOS), "sysexit")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, start_new_session=True)
    assert proc.returncode == 3 and time.monotonic() - t0 < 60, proc.stdout + proc.stderr
    assert "NOT ABORTED" not in proc.stdout, proc.stdout
    job = run_job(2, "sysexit", env={"SYSEXIT_TIMEOUT": "3"}, timeout=120)
    (line,) = job.lines(0, "SYSEXIT ")
    assert "rank 1 of 2 did not join" in line, job.text()


def test_the_example_trains_across_two_ranks(mpiexec: str) -> None:
    cmd = launch.mpiexec_command(2, str(ROOT / "examples" / "mpi_data_parallel.py"), "--steps", "40")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 ranks x 1 device(s) = 2 replicas" in proc.stdout and "samples/s" in proc.stdout, proc.stdout
    assert "ranks differ by 0.0e+00, replicas by 0.0e+00" in proc.stdout, proc.stdout


# ---------------------------------------------------------------------------------------------
# One process


def _python(code: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_import_polyjit_does_not_import_mpi4py() -> None:
    out = _python("import sys, polyjit, polyjit.tensor; print('mpi4py' in sys.modules)\n"
                  "import polyjit.distributed; print('mpi4py' in sys.modules)")
    assert out.split() == ["False", "True"]


def test_the_excepthook_is_installed_unless_opted_out() -> None:
    code = "import polyjit.distributed as d; print(d.excepthook_installed())"
    assert _python(code).strip() == "True"
    assert _python(code, {"POLYJIT_MPI_ABORT": "0"}).strip() == "False"
    off = _python("import polyjit.distributed as d; d.uninstall_excepthook(); print(d.excepthook_installed())")
    assert off.strip() == "False"


def test_one_rank_without_mpiexec_passes_the_exception_on() -> None:
    proc = subprocess.run([sys.executable, "-c", "import polyjit.distributed; raise ValueError('alone')"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 1 and "ValueError: alone" in proc.stderr and "[rank" not in proc.stderr
    code = ("import threading, polyjit.distributed\n"
            "def f(): raise ValueError('alone in a thread')\n"
            "t = threading.Thread(target=f); t.start(); t.join(); print('carried on')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0 and "carried on" in proc.stdout, proc
    assert "ValueError: alone in a thread" in proc.stderr and "[rank" not in proc.stderr, proc


def test_timeouts_are_checked() -> None:
    out = _python(
        "import polyjit.distributed as d\n"
        "from polyjit.core.errors import InvalidArgumentError\n"
        "print(d.default_timeout())\n"
        "d.set_default_timeout(12.5); print(d.Comm().timeout)\n"
        "for bad in (0, -1, float('nan'), 'soon', '5', True):\n"  # found by review: '5' and True were taken
        "    try: d.Comm(timeout=bad)\n"
        "    except InvalidArgumentError: print('refused')\n"
        "try: d.Comm(d.MPI.COMM_NULL)\n"  # found by review: mpi4py's own exception
        "except InvalidArgumentError as e: print('null' if 'COMM_NULL' in str(e) else e)\n",
        {"POLYJIT_MPI_TIMEOUT": "42"})
    assert out.split() == ["42.0", "12.5", *["refused"] * 6, "null"]


def test_a_timeout_set_later_is_checked_too() -> None:
    """Found by review: ``comm.timeout = nan`` waited for ever, ``-1`` made the ranks disagree;
    NcclComm(timeout=) took anything float() took."""
    out = _python(
        "import math\n"
        "import polyjit.distributed as d\n"
        "from polyjit.core.errors import InvalidArgumentError\n"
        "from polyjit.distributed.nccl import NcclComm\n"
        "c = d.Comm(timeout=5)\n"
        "for bad in (float('nan'), 0, -1, 'soon', None):\n"
        "    try: c.timeout = bad\n"
        "    except InvalidArgumentError: print('refused')\n"
        "print(c.timeout)\n"
        "c.timeout = math.inf; print(c.timeout)\n"
        "for bad in (float('nan'), -1):\n"
        "    try: NcclComm(c, None, timeout=bad)\n"
        "    except InvalidArgumentError: print('nccl refused')\n")
    assert out.split() == ["refused"] * 5 + ["5.0", "inf", "nccl", "refused", "nccl", "refused"], out


def test_one_node_as_both_sides_of_a_gather_is_refused_by_name() -> None:
    """Found by review: all_gather(ctx, x, x) in a job of one rank raised mpi4py's bare
    Exception (MPI cannot send from and receive into one buffer)."""
    out = _python(
        "import numpy as np\n"
        "from polyjit.backends.cpu import create_backend\n"
        "from polyjit.core.errors import InvalidArgumentError\n"
        "from polyjit.core.ir import Node\n"
        "from polyjit.distributed import Comm\n"
        "c = Comm(timeout=10)\n"
        "x = Node('same_x', (3,), 'float32')\n"
        "ctx = create_backend(num_devices=1).get_device(0).make_context().init_from_host(x, np.ones(3, np.float32))\n"
        "for call in (lambda: c.all_gather(ctx, x, x), lambda: c.reduce_scatter(ctx, x, x)):\n"
        "    try: call()\n"
        "    except InvalidArgumentError as e: print('refused', 'same_x' in str(e))\n"
        "c.barrier(); print('usable')\n")
    assert out.split() == ["refused", "True", "refused", "True", "usable"], out


def test_mpiexec_command_refuses_what_is_not_a_number_of_ranks(tmp_path: Path) -> None:
    """Found by review: 0, -3, 2.9 and True became -n 0, -n -3, -n 2 and -n 1; "abc" and None
    a bare ValueError / TypeError."""
    from polyjit.core.errors import InvalidArgumentError

    for n in (0, -3, 2.9, True, "abc", None):
        with pytest.raises(InvalidArgumentError, match="number of ranks"):
            launch.mpiexec_command(n, "x.py", mpiexec=str(tmp_path / "mpiexec"))  # type: ignore[arg-type]


def test_a_refusal_that_is_no_exception_is_refused() -> None:
    """Found by review: refuse("text") raised a bare TypeError after the join."""
    out = _python(
        "from polyjit.core.errors import InvalidArgumentError\n"
        "from polyjit.distributed import Comm\n"
        "c = Comm(timeout=10)\n"
        "try: c.refuse('the loader failed')\n"
        "except InvalidArgumentError as e: print('refused', 'exception to raise' in str(e))\n"
        "c.barrier(); print('usable')\n")
    assert out.split() == ["refused", "True", "usable"], out


def test_an_intercommunicator_is_refused(job2: Job) -> None:
    job2.passed("intercomm")


def test_mpiexec_command_adds_open_mpi_flags(tmp_path: Path) -> None:
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'mpiexec (OpenRTE) 4.1.5'\n")
    fake.chmod(0o755)
    cmd = launch.mpiexec_command(3, "x.py", mpiexec=str(fake))
    assert cmd[0] == str(fake) and "--oversubscribe" in cmd and cmd[-4:] == ["-n", "3", sys.executable, "x.py"]
    assert ("--allow-run-as-root" in cmd) == (os.geteuid() == 0)
    hydra = tmp_path / "hydra" / "mpiexec"
    hydra.parent.mkdir()
    hydra.write_text("#!/bin/sh\necho 'HYDRA build details:'\n")
    hydra.chmod(0o755)
    assert launch.mpiexec_command(2, "x.py", mpiexec=str(hydra)) == [str(hydra), "-n", "2", sys.executable, "x.py"]


def test_find_mpiexec_honours_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from polyjit.core.errors import PolyjitError

    monkeypatch.setenv("POLYJIT_MPIEXEC", str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="POLYJIT_MPIEXEC") as caught:
        launch.find_mpiexec()
    assert isinstance(caught.value, PolyjitError)  # found by review: only a FileNotFoundError
    monkeypatch.setenv("POLYJIT_MPIEXEC", str(tmp_path))  # found by review: a directory was taken
    with pytest.raises(launch.MpiexecNotFoundError, match="not an executable"):
        launch.find_mpiexec()


def test_bind_to_cores_refuses_what_binds_nothing() -> None:
    """Found by review: cores=[] raised ZeroDivisionError, cores_per_rank=-1 an OSError."""
    out = _python(
        "from polyjit.core.errors import InvalidArgumentError\n"
        "from polyjit.distributed import bind_to_cores\n"
        "for kw in ({'cores': []}, {'cores_per_rank': -1}, {'cores_per_rank': 0}, {'cores': [99999]},\n"
        "           {'cores': [-1]}, {'cores': ['a']}, {'cores': 3}):\n"
        "    try: bind_to_cores(**kw)\n"
        "    except InvalidArgumentError as e: print('refused')\n"
        "import numpy as np\n"
        "print(bind_to_cores(np.int64(1), cores=(c for c in [0])))\n")  # any iterable, numpy ints
    assert out.split() == ["refused"] * 7 + ["[0]"], out


def test_nccl_host_side_without_a_gpu() -> None:
    """Found by review, the parts of NcclComm that run on the host: float16 and bfloat16 had no
    NCCL datatype (KeyError); the watchdog started only for a finite timeout, so asynchronous
    errors went unpolled under ``inf``; close() destroyed the communicator while the watchdog
    could still be calling into it. (A fake library and stream stand in for NCCL and CUDA.)"""
    out = _python(
        "import math, threading, types\n"
        "import polyjit.core.streams as streams\n"
        "from polyjit.core.ir import Node\n"
        "from polyjit.distributed import nccl\n"
        "print(*((nccl._nccl_dtype(n), nccl._nccl_op(n, 'max')) for n in (Node('t', (2,), d) for d in ('float16', 'bfloat16', 'bool'))))\n"
        "class Lib:\n"
        "    def ncclCommGetAsyncError(self, handle, err): return 0\n"
        "    def ncclCommDestroy(self, handle):\n"
        "        print('destroy with the watchdog', 'alive' if nc._watch.thread.is_alive() else 'stopped'); return 0\n"
        "class Pending:\n"
        "    def is_done(self): return False\n"
        "streams.enqueue = lambda *a: Pending()\n"
        "nc = object.__new__(nccl.NcclComm)\n"
        "nc.lib, nc.handle, nc._broken = Lib(), None, None\n"
        "nc.device = types.SimpleNamespace(synchronize=lambda: None)\n"
        "nc._watch = nccl._Watchdog(nc)\n"
        "ctx = types.SimpleNamespace(device=types.SimpleNamespace(driver=types.SimpleNamespace(\n"
        "    foreign_stream=lambda h: 0)), stream=types.SimpleNamespace(handle=0))\n"
        "nc._enqueue(nccl._Call(ctx, 'all_reduce', Node('g', (2,)), 7, (), None, (), (), math.inf), None)\n"
        "print('watchdog', 'started' if nc._watch.thread is not None else 'not started')\n"
        "nc._watch.track(Pending(), math.inf, 'another call')  # a running watchdog, either way\n"
        "nc.close()\n")
    assert out.splitlines() == ["(6, 2) (9, 2) (1, 2)", "watchdog started", "destroy with the watchdog stopped"], out


# ---------------------------------------------------------------------------------------------
# CUDA nodes without a GPU: tests/cuda's stub driver (its "device memory" is host memory, so
# an MPI that is not CUDA-aware can stand in for one that is)


@pytest.fixture(scope="module")
def stub_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    cuda_tests = ROOT / "tests" / "cuda"
    sys.path.insert(0, str(cuda_tests))
    try:
        spec = importlib.util.spec_from_file_location("_pj_stub", cuda_tests / "stub.py")
        assert spec is not None and spec.loader is not None
        stub = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(stub)
    finally:
        sys.path.remove(str(cuda_tests))
    if stub.c_compiler() is None:
        pytest.skip("no C compiler to build tests/cuda's stub driver")
    base = tmp_path_factory.mktemp("cuda-stub")
    env: dict[str, str] = stub.stub_env(stub.build_stub(base), base / "kernels", base / "host-cache",
                                        PJSTUB_DEVICES="2")
    return env


@pytest.mark.parametrize("aware", ["1", "0"], ids=["cuda_aware", "staged"])
def test_cuda_nodes_on_the_stub_driver(stub_env: dict[str, str], aware: str) -> None:
    names = ("cuda_staged", "cuda_aware", "cuda_data_parallel") if aware == "1" else ("cuda_data_parallel",)
    job = run_job(2, *names, env={**stub_env, "POLYJIT_MPI_CUDA_AWARE": aware})
    assert job.rc == 0, job.text()
    for name in names:
        job.passed(name)


# ---------------------------------------------------------------------------------------------
# With a GPU


gpu = pytest.mark.gpu


def _cuda_devices() -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-c", "from polyjit.backends import get_backend\n"
                          "b = get_backend('cuda'); print(b.num_devices()); print(b.unavailable_reason)"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = out.stdout.splitlines()
    return (int(lines[0]), lines[1]) if len(lines) == 2 else (0, out.stderr.strip()[-300:])


@pytest.fixture(scope="module")
def cuda_count(mpiexec: str) -> int:
    count, reason = _cuda_devices()
    if count == 0:
        pytest.skip(f"no CUDA device: {reason}")
    return count


@pytest.fixture(scope="module")
def cuda_job(cuda_count: int) -> Job:
    job = run_job(2, "cuda_staged", "cuda_aware", "cuda_data_parallel")  # two ranks may share a GPU
    assert job.rc == 0, job.text()
    return job


@gpu
def test_cuda_nodes_staged_through_host_copies(cuda_job: Job) -> None:
    cuda_job.passed("cuda_staged")


@gpu
def test_cuda_nodes_with_cuda_aware_mpi(cuda_job: Job) -> None:
    cuda_job.passed("cuda_aware")


@gpu
def test_data_parallel_with_a_gpu_per_rank(cuda_job: Job) -> None:
    cuda_job.passed("cuda_data_parallel")


@gpu
def test_nccl_collectives_on_the_context_stream(cuda_count: int) -> None:
    """One rank per GPU (NCCL refuses two ranks on one device): 2 ranks, or 1 on one GPU."""
    job = run_job(min(cuda_count, 2), "nccl")
    assert job.rc == 0, job.text()
    job.passed("nccl")
