"""polyjit installed from its wheel, not run from the checkout: the wheel is built, installed
into a fresh venv, and its command line lists devices, runs a quick CPU benchmark and the
demo from a directory that is not the checkout (issue 12: installed, not only checked out)."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 300) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A venv holding the wheel. It sees this interpreter's packages (numpy, attrs, ml_dtypes:
    no download), but imports polyjit from its own site-packages, as the test checks."""
    tmp = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    # built from a copy: each xdist worker that reaches a test here builds one, and two builds
    # in the checkout share its build/ directory (one failed on a file the other removed)
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "*.egg-info", "__pycache__", ".hypothesis", ".pytest_cache", ".mypy_cache", ".ruff_cache",
        ".venv", ".whl"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", str(tmp / "dist"), str(src)], tmp, env)
    (wheel,) = (tmp / "dist").glob("polyjit-*.whl")
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(tmp / "venv")], tmp, env)
    bin_dir = tmp / "venv" / "bin"
    # --system-site-packages reaches the base interpreter's packages only; when this one is a
    # venv itself (the README's fresh venv), its site-packages come after the new venv's own.
    # A path line only: the .pth files there (an editable polyjit's finder) are not run.
    own = _run([str(bin_dir / "python"), "-c", "import site; print(site.getsitepackages()[0])"], tmp, env)
    (Path(own.strip()) / "_parent_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], tmp, env)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(tmp / "venv")
    return tmp, env


def test_the_wheel_is_what_runs(venv: tuple[Path, dict[str, str]]) -> None:
    tmp, env = venv
    where = _run(["python", "-c", "import polyjit; print(polyjit.__file__)"], tmp, env).strip()
    assert where.startswith(str(tmp / "venv")), f"polyjit imported from {where}, not the wheel"
    assert ROOT not in Path(where).parents
    # the data the benchmarks and gpucheck train on ships in the wheel
    assert _run(["python", "-c", "from polyjit.demo.char_lm import TEXT; print(TEXT.stat().st_size)"],
                tmp, env).strip() != "0"


def test_devices_bench_and_demo_from_the_wheel(venv: tuple[Path, dict[str, str]]) -> None:
    tmp, env = venv
    assert "cpu" in _run(["polyjit", "devices"], tmp, env)
    out = _run(["polyjit", "bench", "cpu", "--quick"], tmp, env)
    assert "[interop]" in out and "[targets]" in out
    demo = _run(["polyjit", "demo", "--steps", "20"], tmp, env)
    assert "step" in demo or "loss" in demo, demo[-2000:]
