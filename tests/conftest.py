"""Session setup for the test suite.

- ``POLYJIT_REQUIRE_BACKENDS`` (comma-separated names): each must load and have at
  least one device, or the run fails at once (instead of skipping its tests);
- ``POLYJIT_CACHE_DIR``: a fresh directory per session unless already set;
- ``OCL_ICD_VENDORS``: unless already set, a PoCL that builds kernels on this host (pip's,
  else the system's; see ``polyjit.backends.opencl.working_pocl_icd``), so a system OpenCL
  install does not change what runs, and a host CPU too new for pip's PoCL does not stop it;
- hypothesis: no deadline (the first example of a program compiles C).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

try:
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("polyjit", deadline=None, print_blob=True)
    _hyp_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "polyjit"))
except ImportError:  # pragma: no cover - hypothesis is a dev dependency
    pass

_OWN_CACHE: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _OWN_CACHE
    if not os.environ.get("POLYJIT_CACHE_DIR"):
        _OWN_CACHE = tempfile.mkdtemp(prefix="polyjit-test-cache-")
        os.environ["POLYJIT_CACHE_DIR"] = _OWN_CACHE
    if "OCL_ICD_VENDORS" not in os.environ:  # read when OpenCL first starts in this process
        try:
            from polyjit.backends.opencl import working_pocl_icd
        except ImportError:
            return
        icd = working_pocl_icd()
        if icd:
            os.environ["OCL_ICD_VENDORS"] = icd


def pytest_unconfigure(config: pytest.Config) -> None:
    global _OWN_CACHE
    if _OWN_CACHE is not None:
        if os.environ.get("POLYJIT_CACHE_DIR") == _OWN_CACHE:
            del os.environ["POLYJIT_CACHE_DIR"]
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
        _OWN_CACHE = None


def _problems() -> list[str]:
    from polyjit.backends import get_backend
    from polyjit.testing import required_backends

    problems = []
    for name in required_backends():
        try:
            n = get_backend(name).num_devices()
        except Exception as e:
            problems.append(f"required backend {name!r} cannot be loaded: {type(e).__name__}: {e}")
            continue
        if n < 1:
            problems.append(f"required backend {name!r} has no devices")
    return problems


def pytest_sessionstart(session: pytest.Session) -> None:
    problems = _problems()
    if problems:
        pytest.exit("POLYJIT_REQUIRE_BACKENDS: " + "; ".join(problems), returncode=1)


@pytest.fixture(params=["cpu", "opencl"])
def backend(request: pytest.FixtureRequest) -> object:
    """Each backend built everywhere (cpu, OpenCL); one with no device here is skipped. CI
    names both in ``POLYJIT_REQUIRE_BACKENDS``, so there a missing one fails the session
    instead. Test directories with their own ``backend`` fixture (cuda, opencl) override it."""
    from polyjit.backends import get_backend

    be = get_backend(request.param)
    if be.num_devices() == 0:
        pytest.skip(f"no {request.param} device: {be.unavailable_reason}")
    return be
