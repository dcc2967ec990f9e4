"""The examples (as subprocesses, with small step counts), the demo, and its PNG and ASCII output."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from polyjit import demo
from polyjit.demo.plot import ascii_chart
from polyjit.demo.png import encode_png, line_chart

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _run(script: str, *args: str, timeout: float = 120) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "POLYJIT_HYPOTHESIS_EXAMPLES": "3"}
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_mlp_data_parallel_example() -> None:
    out = _run("mlp_data_parallel.py", "--steps", "40", "--devices", "2")
    assert "all-reduce rounds: [[(0, 1)]]" in out
    assert "replicas differ by 0.0e+00" in out
    assert "samples/s" in out


def test_char_lm_example() -> None:
    out = _run("char_lm.py", "--steps", "30", "--sample", "30", "--mode", "auto")
    assert "samples/s" in out
    sample = out.split("sample:", 1)[1].strip().split("|", 1)[1]
    assert len(sample) == 30 and set(sample) <= set("abcdefghijklmnopqrstuvwxyz ")
    first, last = (float(v) for v in out.split("loss ")[-1].split("(")[0].split("->"))
    assert last < first


def test_char_lm_text_is_in_range() -> None:
    size = (Path(demo.__file__).with_name("data") / "lighthouse.txt").stat().st_size
    assert 5_000 <= size <= 20_000


def test_transfers_example() -> None:
    out = _run("transfers.py", "--mib", "1", "--repeats", "1")
    assert "cpu:0 host->device" in out and "cpu:1 device->host" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("cpu:0 ", "cpu:1 ")) and "->" not in line]
    assert len(rows) == 2 and all(float(v) > 0 for row in rows for v in row[1:])


def test_custom_backend_passes_the_conformance_kit() -> None:
    out = _run("custom_backend.py", timeout=300)
    total = re.search(r"(\d+) checks", out)
    counts = re.search(r"(\d+) passed, (\d+) skipped, 0 failed", out)
    assert total and counts and "FAIL" not in out, out
    passed, skipped = int(counts.group(1)), int(counts.group(2))
    assert passed + skipped == int(total.group(1)) and skipped == out.count(" skip (")  # a skip is no pass


def _decode_png(data: bytes) -> np.ndarray:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks.append((kind, body))
        pos += 12 + length
    assert [k for k, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    w, h, depth, color = struct.unpack(">IIBB", chunks[0][1][:10])
    assert (depth, color) == (8, 2)
    raw = np.frombuffer(zlib.decompress(chunks[1][1]), np.uint8).reshape(h, 1 + 3 * w)
    assert (raw[:, 0] == 0).all()
    return raw[:, 1:].reshape(h, w, 3)


def test_png_round_trip_and_chart() -> None:
    img = np.random.default_rng(0).integers(0, 256, (7, 5, 3), dtype=np.uint8)
    np.testing.assert_array_equal(_decode_png(encode_png(img)), img)
    chart = line_chart(np.exp(-np.linspace(0, 5, 100)), width=320, height=200, log_y=True)
    assert chart.shape == (200, 320, 3)
    assert (chart == [31, 119, 180]).all(axis=2).sum() > 100  # the curve is drawn


def test_ascii_chart() -> None:
    text = ascii_chart([4.0, 3.0, 2.0, 1.0], width=4, height=4, title="loss")
    lines = text.splitlines()
    assert lines[0] == "loss" and lines[1].startswith("4 |*") and lines[4].startswith("1 |   *")


def test_demo_trains_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "loss.png"
    assert demo.run(["--steps", "60", "--devices", "2", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "on 2 device(s)" in out and "accuracy" in out and "samples/s" in out
    assert "training loss" in out  # the ASCII curve
    assert _decode_png(png.read_bytes()).shape == (360, 640, 3)


@pytest.mark.parametrize("argv, says", [
    (["--steps", "0"], "--steps: must be at least 1"),
    (["--devices", "-1"], "--devices: must be at least 1"),
    (["--kernels", "--size", "0"], "--size: must be at least 1"),
    (["--batch", "x"], "--batch: not a whole number"),
    (["--seed", "-1"], "--seed: must be at least 0, got -1"),  # was numpy's ValueError, a traceback
])
def test_demo_options_out_of_range_are_refused_by_the_parser(argv: list[str], says: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Found by review: each ended in a traceback (an IndexError of an empty loss list, a
    ValueError from the cpu driver, a numpy reduction of nothing)."""
    with pytest.raises(SystemExit) as stop:
        demo.run(argv)
    assert stop.value.code == 2 and says in capsys.readouterr().err


def test_demo_of_one_step_draws_its_one_point_chart(capsys: pytest.CaptureFixture[str]) -> None:
    """Found by review: ``polyjit demo --steps 1`` trained, then raised an IndexError drawing
    the chart of one loss (two columns for one value: an empty bucket's NaN row)."""
    lines = ascii_chart([0.5], height=3).splitlines()
    assert lines == ["0.5 | ", "    | ", "0.5 |*", "    +-", "     0 1"]
    assert demo.run(["--steps", "1", "--devices", "1", "--batch", "8"]) == 0
    assert "training loss" in capsys.readouterr().out


def test_demo_kernels_refuses_a_size_that_cannot_fit(capsys: pytest.CaptureFixture[str]) -> None:
    """Found by review: ``--kernels --size 1099511627776`` was numpy's MemoryError traceback."""
    assert demo.run(["--kernels", "--size", str(1 << 40)]) == 2
    err = capsys.readouterr().err
    assert "--size 1099511627776: the chain's 6 float32 arrays need 24.0 TiB on each device" in err


def test_demo_refuses_a_plot_it_could_not_write_before_training(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    for where, says in ((tmp_path / "no" / "loss.png", "no directory"), (tmp_path, "is a directory")):
        assert demo.run(["--steps", "2", "--plot", str(where)]) == 2
        err = capsys.readouterr()
        assert says in err.err and "two spirals" not in err.out  # nothing trained
    assert demo.run(["--steps", "2", "--devices", "2", "--batch", "1"]) == 2
    assert "less than one row for each of 2 devices" in capsys.readouterr().err


def test_bench_tensor_runs(tmp_path: Path) -> None:
    out = _run_bench(["--steps", "2", "--batch", "32", "--dp-batch", "64", "--lm-batch", "16",
                      "--json", str(tmp_path / "bench.json")])
    assert "[dispatch]" in out and "[data_parallel]" in out and "[mlp]" in out
    mlp = json.loads((tmp_path / "bench.json").read_text())["mlp"]
    assert mlp["fraction_of_matmul"] > 0 and mlp["step_of_numpy_products"] > 0  # both references
    assert mlp["fraction_of_matmul_call"] > 0 and mlp["matmul_GFLOPs"] > 0


def _run_bench(args: list[str]) -> str:
    proc = subprocess.run([sys.executable, "-m", "polyjit", "bench", "tensor", *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout
