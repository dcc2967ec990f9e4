"""tests/cuda: CUDA through the real cuda.bindings (and cuda.core) over the stub driver.

The stub (``stub_libcuda.c``) must be *the* ``libcuda.so.1`` of the process that uses
it, and the main pytest process must never load it (other tests check that a machine
without a driver reports zero CUDA devices). So every test here runs in a child
process: the first of these tests that pytest reaches builds the stub and starts one
``python -m pytest`` child per stub configuration (a module's ``STUB_ENV``, e.g.
``{"PJSTUB_DEVICES": "2"}``) on all the selected tests of that configuration, with
``LD_LIBRARY_PATH`` pointing at the stub; each test of the parent then reports what its
run in the child reported (pass, failure with the child's traceback and output, skip,
xfail). In the parent these tests set up no fixtures and run no bodies: fixtures and
bodies run only in the child.

Run a module directly in a child's setting (for debugging) with
``PJSTUB_CHILD=1 LD_LIBRARY_PATH=<stub dir> PJSTUB_KERNELS=<dir> python -m pytest tests/cuda/...``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import host_code
import pytest
import stub

HERE = Path(__file__).resolve().parent
IN_CHILD = os.environ.get("PJSTUB_CHILD") == "1"
CHILD_TIMEOUT_S = float(os.environ.get("PJSTUB_CHILD_TIMEOUT", "900"))


def _ours(item: pytest.Item) -> bool:
    return Path(str(item.path)).resolve().parent == HERE


# ---------------------------------------------------------------------------
# The child: record every report for the parent


def _record(entry: dict[str, Any]) -> None:
    path = os.environ.get("PJSTUB_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


if IN_CHILD:

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
        outcome = yield
        rep = outcome.get_result()  # type: ignore[attr-defined]
        reason = rep.longrepr[2] if rep.skipped and isinstance(rep.longrepr, tuple) else ""
        output = "\n".join(f"--- {title} ---\n{text}" for title, text in rep.sections)
        _record({"nodeid": item.nodeid, "when": rep.when, "outcome": rep.outcome,
                 "xfail": getattr(rep, "wasxfail", None), "reason": reason,
                 "text": rep.longreprtext, "output": output})

    def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
        _record({"nodeid": nodeid, "done": True})


# ---------------------------------------------------------------------------
# The parent: one child per stub configuration, started once


class _Child:
    def __init__(self, env_key: tuple[tuple[str, str], ...], nodeids: list[str], base: Path) -> None:
        self.env_key = env_key
        self.nodeids = nodeids
        name = "_".join(f"{k}-{v}" for k, v in env_key) or "default"
        self.results = base / f"results-{name}.jsonl"
        self.log = base / f"log-{name}.txt"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0

    def start(self, root: Path, stub_dir: Path, base: Path) -> None:
        env = stub.stub_env(stub_dir, base / "kernels", base / "host", PJSTUB_CHILD="1",
                            PJSTUB_RESULTS=str(self.results), **dict(self.env_key))
        # one process (-o addopts= drops the workers of pyproject's -n auto): this child is
        # already one of several, and its reports go to one results file
        cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-q", "--no-header",
               *self.nodeids]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.started = time.monotonic()

    def records(self, nodeid: str) -> list[dict[str, Any]]:
        """The reports of one test, once the child has finished it (or exited)."""
        while True:
            found = self._read(nodeid)
            if any(r.get("done") for r in found):
                return found
            assert self.proc is not None
            if self.proc.poll() is not None:
                return self._read(nodeid)
            if time.monotonic() - self.started > CHILD_TIMEOUT_S:
                self.proc.kill()
                self.proc.wait()
            time.sleep(0.05)

    def _read(self, nodeid: str) -> list[dict[str, Any]]:
        if not self.results.exists():
            return []
        with open(self.results) as f:
            entries = [json.loads(line) for line in f if line.endswith("\n")]
        return [e for e in entries if e["nodeid"] == nodeid]

    def output_tail(self, chars: int = 6000) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text[-chars:]


class _Children:
    def __init__(self, session: pytest.Session) -> None:
        self.session = session
        self.by_item: dict[str, _Child] = {}
        self.skip: str | None = None  # why every test here skips (no compilers)
        self.error: str | None = None  # why every test here fails (the stub does not build)
        self.base = Path(tempfile.mkdtemp(prefix="pjstub-"))
        self._start()

    def _start(self) -> None:
        if host_code.compiler() is None or stub.c_compiler() is None:
            self.skip = "no C and C++ compilers to build the stub driver and the host code of kernels"
            return
        try:
            stub_dir = stub.build_stub(Path(os.environ.get("PJSTUB_CACHE") or self.base))
        except RuntimeError as e:
            self.error = str(e)
            return
        groups: dict[tuple[tuple[str, str], ...], list[str]] = {}
        for item in self.session.items:
            if _ours(item):
                env = getattr(getattr(item, "module", None), "STUB_ENV", {})
                groups.setdefault(tuple(sorted(env.items())), []).append(item.nodeid)
        root = Path(str(self.session.config.rootpath))
        for key, nodeids in groups.items():
            child = _Child(key, nodeids, self.base)
            child.start(root, stub_dir, self.base)
            for nodeid in nodeids:
                self.by_item[nodeid] = child

    def relay(self, item: pytest.Item) -> None:
        """Reports in the parent what the test reported in its child."""
        if self.skip:
            pytest.skip(self.skip)
        if self.error:
            pytest.fail(self.error, pytrace=False)
        child = self.by_item[item.nodeid]
        records = child.records(item.nodeid)
        if not any(r.get("done") for r in records):
            pytest.fail(f"the stub child process did not finish {item.nodeid} (it crashed or timed out); "
                        f"its output ends:\n{child.output_tail()}", pytrace=False)
        for r in records:
            if not r.get("done"):
                _relay_one(r, item)

    def close(self) -> None:
        for child in set(self.by_item.values()):
            if child.proc is not None and child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait()
        if not os.environ.get("PJSTUB_KEEP"):  # PJSTUB_KEEP=1: keep the builds, logs and results
            shutil.rmtree(self.base, ignore_errors=True)


def _xfailed(item: pytest.Item, reason: str) -> None:
    """Fails the way the test failed in the child, for the parent's own xfail marker (an
    instance of its ``raises`` type when it names one)."""
    message = f"xfailed in the stub child: {reason}"
    marker = item.get_closest_marker("xfail")
    raises = marker.kwargs.get("raises") if marker is not None else None
    if isinstance(raises, tuple):
        raises = raises[0] if raises else None
    if isinstance(raises, type) and issubclass(raises, BaseException):
        try:
            error = raises(message)
        except TypeError:
            error = None
        if error is not None:
            raise error
    pytest.fail(message, pytrace=False)


def _relay_one(r: dict[str, Any], item: pytest.Item) -> None:
    detail = r["text"] + ("\n" + r["output"] if r["output"] else "")
    if r["when"] != "call":
        if r["outcome"] == "failed":
            pytest.fail(f"error at {r['when']} in the stub child:\n{detail}", pytrace=False)
        if r["outcome"] == "skipped" and r["xfail"] is None:
            pytest.skip(r["reason"] or "skipped in the stub child")
        if r["outcome"] == "skipped":
            _xfailed(item, r["xfail"])
        return
    if r["outcome"] == "passed":
        return  # a pass, or a non-strict XPASS: the parent's xfail marker decides
    if r["outcome"] == "skipped" and r["xfail"] is None:
        pytest.skip(r["reason"] or "skipped in the stub child")
    if r["outcome"] == "skipped":
        _xfailed(item, r["xfail"])  # xfails here too
    if r["text"].startswith("[XPASS(strict)]"):
        return  # passed in the child: the parent's strict xfail marker fails it the same way
    pytest.fail(f"failed in the stub child:\n{detail}", pytrace=False)


_CHILDREN: _Children | None = None

if not IN_CHILD:

    def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        for item in items:
            if _ours(item):
                item.setup = lambda: None  # type: ignore[method-assign]  # no fixtures here

    @pytest.hookimpl(tryfirst=True)
    def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
        global _CHILDREN
        if not _ours(pyfuncitem):
            return None
        if _CHILDREN is None:
            _CHILDREN = _Children(pyfuncitem.session)
        _CHILDREN.relay(pyfuncitem)
        return True

    def pytest_sessionfinish(session: pytest.Session) -> None:
        if _CHILDREN is not None:
            _CHILDREN.close()


# ---------------------------------------------------------------------------
# Fixtures (set up in the child only)


@pytest.fixture(scope="session")
def stub_driver() -> stub.Driver:
    """The stub's test hooks (fault injection, schedule); cuInit has run."""
    from cuda.bindings import driver as cu

    (err,) = cu.cuInit(0)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    stub.install_nvrtc_hook()
    return stub.driver()


@pytest.fixture(params=["others_first", "target_first"])
def schedule(request: pytest.FixtureRequest, stub_driver: stub.Driver) -> Iterator[str]:
    """Each of the stub's two schedules (others first: the default)."""
    old = stub_driver.set_schedule(stub.OTHERS_FIRST if request.param == "others_first" else stub.TARGET_FIRST)
    yield request.param
    stub_driver.set_schedule(old)


@pytest.fixture(scope="session")
def backend(stub_driver: stub.Driver) -> Any:
    """polyjit's CUDA backend on the stub (1 MiB staging rings, so copies cross them), one
    per process: two CudaDriver instances in one thread invalidate each other's cache of the
    current context (see test_backend_current_context.py)."""
    from polyjit.backends import cuda

    return cuda.CudaBackend(cuda.CudaDriver(staging_bytes=1 << 20))
