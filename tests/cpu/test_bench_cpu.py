"""The CPU benchmarks' own measuring instruments (what `polyjit bench cpu` reports rests on them)."""

from __future__ import annotations

import numpy as np
import pytest

from polyjit.bench.cpu import bench_matmul, fma_peak, fma_shape, run_and_wait


def test_the_fma_peak_kernel_does_the_flops_it_counts() -> None:
    """Each thread's chains hold what `rounds` FMAs give them, as numpy computes it step by
    step in float32, and the FLOPs reported are those chains' FMAs on every thread that ran."""
    (chains, lanes), rounds = fma_shape(), 300
    routine, flops = fma_peak(rounds)
    try:
        team = flops / (2 * lanes * chains * rounds)
        assert team == int(team) and team >= 1
        run_and_wait(routine)
        out = routine.context.read(next(n for n in routine.outputs if n.name == "fma_out"))
        mul, add = np.float32(0.999999), np.float32(1e-7)
        for t in range(min(int(team), 256)):
            acc = mul * np.arange(t, t + chains, dtype=np.float32)
            for _ in range(rounds):
                acc = acc * mul + add
            np.testing.assert_allclose(out[t], lanes * acc.astype(np.float64).sum(), rtol=1e-4)
    finally:
        routine.context.finalize()


def test_bench_matmul_reports_the_peak_beside_the_matmul() -> None:
    r = bench_matmul(64, peak_rounds=1 << 10)
    assert r["rel_error"] < 1e-5
    assert r["fma_peak_GFLOPs"] > 0
    assert r["polyjit_of_peak"] == pytest.approx(r["polyjit_GFLOPs"] / r["fma_peak_GFLOPs"])


def test_a_race_report_names_the_best_peer_and_jax() -> None:
    """flatten: each contender's figures, polyjit against the best peer per load, and alone
    against jax.jit (char_lm's 2.5x target) only where jax ran."""
    from polyjit.bench.peers import flatten

    race = {"polyjit": {"samples_s": 300.0, "samples_s_busy1": 150.0},
            "numpy": {"samples_s": 100.0, "samples_s_busy1": 60.0},
            "jax": {"samples_s": 120.0, "samples_s_busy1": 50.0},
            "torch": "not installed"}
    out = flatten(race, [1])
    assert (out["best_peer"], out["best_peer_busy1"]) == ("jax", "numpy")
    assert out["polyjit_vs_best_peer"] == pytest.approx(2.5) and out["polyjit_vs_best_peer_busy1"] == pytest.approx(2.5)
    assert out["polyjit_vs_jax"] == pytest.approx(2.5) and out["torch"] == "not installed"
    assert "polyjit_vs_jax" not in flatten({k: v for k, v in race.items() if k != "jax"}, [1])


@pytest.mark.parametrize("suite", ["tensor", "reliability"])
def test_an_unknown_group_is_refused_before_anything_runs(suite: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--only`` with a typo used to run nothing and print empty targets; it is argparse's
    usage error now (exit 2), naming the groups."""
    import importlib

    main = importlib.import_module(f"polyjit.bench.{suite}").main
    with pytest.raises(SystemExit) as stop:
        main(["--only", "bogus"])
    assert stop.value.code == 2
    assert "unknown group: bogus (choose from" in capsys.readouterr().err
