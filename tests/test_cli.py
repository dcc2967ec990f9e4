"""The ``polyjit`` command's misuse: a bad option is argparse's one-line error (exit status 2)
before any work; never a traceback, and never after a whole benchmark has run."""

from __future__ import annotations

from pathlib import Path

import pytest

import polyjit
from polyjit.cli import main

SUITES_WITH_JSON = ["cpu", "opencl", "cuda", "reliability", "peers", "tensor", "distributed"]


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("polyjit"), err
    return err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.strip() == f"polyjit {polyjit.__version__}"


@pytest.mark.parametrize("suite", SUITES_WITH_JSON)
def test_bench_json_that_cannot_be_written_is_refused_before_the_run(
        suite: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by review: ``bench cpu --quick --json /nonexistent/dir/x.json`` ran the whole bench,
    then raised FileNotFoundError."""
    missing = tmp_path / "no" / "x.json"
    err = _refused(["bench", suite, "--json", str(missing)], capsys)
    assert f"polyjit bench {suite}: error: argument --json: {missing}: no directory" in err
    err = _refused(["bench", suite, "--json", str(tmp_path)], capsys)
    assert "is a directory" in err


@pytest.mark.parametrize("argv, says", [
    (["bench", "cpu", "--quick", "--matmul", "0"], "--matmul: must be at least 1, got 0"),
    (["bench", "cpu", "--quick", "--size", "-5"], "--size: must be at least 1, got -5"),
    (["bench", "opencl", "--size", "x"], "--size: not a whole number: 'x'"),
    (["bench", "tensor", "--steps", "0", "--only", "dispatch"], "--steps: must be at least 1, got 0"),
    (["bench", "tensor", "--only", "bogus"], "--only: unknown group: bogus (choose from"),
    (["bench", "tensor", "--contention", "-1"], "--contention: the number of busy processes"),
    (["bench", "peers", "--models", "bogus"], "--models: unknown models: bogus"),
    (["bench", "reliability", "--seeds", "0"], "--seeds: must be at least 1"),
    (["bench", "distributed", "--steps", "0"], "--steps: must be at least 1"),
    (["bench", "peers", "--batch", "-1"], "--batch: must be at least 0"),
    (["bench", "peers", "--seconds", "nan"], "--seconds: must be a finite number of seconds above 0"),
    (["bench", "tensor", "--seconds", "0"], "--seconds: must be a finite number of seconds above 0"),
])
def test_bench_options_out_of_range_are_refused_by_the_parser(
        argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by review: ``--matmul 0`` was a numpy ValueError after the chain and launch groups
    had run, ``bench tensor --steps 0`` a ZeroDivisionError; ``--only bogus`` exited 1."""
    assert says in _refused(argv, capsys)
