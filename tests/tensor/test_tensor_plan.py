"""Compiled plans: training steps, optimizers against numpy, dispatch modes, allocation-free
runs, pipelining, shared parameters, reset and state."""

from __future__ import annotations

import gc
import itertools
import threading
import tracemalloc
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from settle import settled_memory

from polyjit import tensor as pt
from polyjit.core.errors import (
    BindingError,
    IndexOutOfRangeError,
    InvalidArgumentError,
    InvalidProgramError,
    NodeNotInContextError,
    ShapeMismatchError,
    UnsupportedError,
    ValueRangeError,
)
from polyjit.core.ir import MemoryMode
from polyjit.demo.datasets import two_spirals
from polyjit.tensor.program import Program
from polyjit.tensor.reference import evaluate

Array = np.ndarray[Any, Any]
B = 32


def _classifier(seed: int = 0, hidden: int = 16) -> tuple[pt.MLP, pt.Tensor, pt.Tensor, pt.Tensor]:
    x, y = pt.input("x", (B, 2)), pt.input("y", (B,), "int32")
    mlp = pt.MLP("mlp", [2, hidden, 2], activation="tanh", seed=seed)
    return mlp, x, y, pt.cross_entropy(mlp(x), y)


def _batches(n: int, seed: int = 0) -> list[dict[str, Array]]:
    xs, ys = two_spirals(n * B, seed=seed)
    return [{"x": xs[k * B : (k + 1) * B], "y": ys[k * B : (k + 1) * B]} for k in range(n)]


def test_training_step_is_one_kernel_batch_with_a_memory_plan() -> None:
    mlp, _, _, loss = _classifier()
    plan = pt.compile(loss=loss, optimizer=pt.Adam(0.01))
    data = _batches(40)
    first = plan.step(**data[0])
    for batch in data[1:] * 3:
        last = plan.step(**batch)
    assert last < first
    modes = plan.memory_modes()
    params = {p.node.label for p in mlp.params}
    assert all(modes[label] is MemoryMode.MATERIALIZED for label in params)
    assert sum(m is MemoryMode.VIRTUAL for m in modes.values()) > 10  # fused elementwise chains
    stored = {n.name for n in plan.context.buffers}
    # parameters, their Adam moments, the step count, the inputs and the loss: no intermediates
    assert stored == ({p.name for p in mlp.params} | {f"{p.name}.{k}" for p in mlp.params for k in "mv"}
                      | {"adam.step", "x", "y", "cross_entropy"})
    assert len(plan.program.batch(plan.backend, "compiled")) == 1  # one computation, one routine
    plan.close()


@pytest.mark.parametrize("make", [lambda: pt.SGD(0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
                                  lambda: pt.Adam(0.05, weight_decay=0.1), lambda: pt.AdamW(0.05)],
                         ids=["sgd_nesterov", "adam_l2", "adamw"])
def test_optimizers_match_numpy(make: Any) -> None:
    """Three steps on a quadratic in float64, against the textbook formulas."""
    w = pt.param("w", (4,), init=np.array([1.0, -2.0, 3.0, 0.5]), dtype="float64")
    target = np.array([0.5, 0.5, -1.0, 2.0])
    loss = pt.sum((w - pt.constant(target, "float64")) ** 2.0)
    opt = make()
    plan = pt.compile(loss=loss, optimizer=opt)
    p = np.array([1.0, -2.0, 3.0, 0.5])
    m = np.zeros(4)
    v = np.zeros(4)
    for t in range(1, 4):
        plan.step()
        g = 2 * (p - target)
        if isinstance(opt, pt.SGD):
            g = g + opt.weight_decay * p
            m = opt.momentum * m + g
            p = p - opt.lr * (g + opt.momentum * m)
        else:
            b1, b2 = opt.betas
            if not isinstance(opt, pt.AdamW):
                g = g + opt.weight_decay * p
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            step = opt.lr / (1 - b1**t) * m / (np.sqrt(v) / np.sqrt(1 - b2**t) + opt.eps)
            p = (p * (1 - opt.lr * opt.weight_decay) if isinstance(opt, pt.AdamW) else p) - step
        np.testing.assert_allclose(plan.state_dict()["w"], p, rtol=1e-12, err_msg=f"step {t}")
    plan.close()


@pytest.mark.parametrize("order", list(itertools.permutations(["w0", "v", "w1"])), ids="-".join)
def test_a_step_is_the_same_whatever_the_order_of_params(order: tuple[str, ...]) -> None:
    """Every gradient is of the parameters before the step. ``v``'s gradient reads ``w1``
    (``z = (y @ v) @ w1 + x @ w0``); computed lazily before its own update, it read the new
    ``w1`` whenever ``w1`` came earlier in ``params``: half of the orders stepped ``v`` wrong.
    Checked against the gradients written out in numpy."""
    rng = np.random.default_rng(1)
    init = {"w0": rng.standard_normal((3, 2)), "v": rng.standard_normal((3, 3)), "w1": rng.standard_normal((3, 2))}
    xs, ys = rng.standard_normal((4, 3)), rng.standard_normal((4, 3))
    z = (ys @ init["v"]) @ init["w1"] + xs @ init["w0"]
    dz = 2 * z
    want = {"w0": init["w0"] - 0.1 * (xs.T @ dz), "w1": init["w1"] - 0.1 * ((ys @ init["v"]).T @ dz),
            "v": init["v"] - 0.1 * (ys.T @ (dz @ init["w1"].T))}
    ps = {k: pt.param(k, v.shape, init=v, dtype="float64") for k, v in init.items()}
    x, y = pt.input("x", (4, 3), "float64"), pt.input("y", (4, 3), "float64")
    loss = pt.sum(((y @ ps["v"]) @ ps["w1"] + x @ ps["w0"]) ** 2.0)
    plan = pt.compile(loss=loss, optimizer=pt.SGD(0.1), params=[ps[k] for k in order])
    plan.step(x=xs, y=ys)
    got = plan.state_dict()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-12, err_msg=k)
    _, after = evaluate({"loss": loss}, {"x": xs, "y": ys}, writes=plan.program.writes,
                        computed_first=plan.program.computed_first)
    for k in want:
        np.testing.assert_allclose(after[k], want[k], rtol=1e-12, atol=1e-12, err_msg=f"reference {k}")
    plan.close()


def test_a_parameter_listed_twice_is_refused() -> None:
    w = pt.param("twice", (3,), init=np.ones(3))
    with pytest.raises(InvalidProgramError, match="twice more than once"):
        pt.compile(loss=pt.sum(w * w), optimizer=pt.SGD(0.1), params=[w, w])
    with pytest.raises(InvalidProgramError, match="not a tensor"):
        Program({"loss": pt.sum(w * w)}, computed_first=[None])  # type: ignore[list-item]


def test_training_step_matches_the_reference_interpreter() -> None:
    _, _, _, loss = _classifier()
    plan = pt.compile(loss=loss, optimizer=pt.AdamW(0.01))
    batch = _batches(1)[0]
    before = plan.state_dict()
    got = plan.step(**batch)
    outs, after = evaluate({"loss": loss}, batch, state=before, writes=plan.program.writes,
                           computed_first=plan.program.computed_first)
    np.testing.assert_allclose(got, outs["loss"], rtol=1e-6)
    for name, value in plan.state_dict().items():
        np.testing.assert_allclose(value, after[name], rtol=1e-5, atol=1e-7, err_msg=name)
    plan.close()


def test_dispatch_modes_give_the_same_numbers() -> None:
    data = _batches(6)
    results = {}
    for mode in ("compiled", "dynamic", "auto"):
        _, _, _, loss = _classifier()
        plan = pt.compile(loss=loss, optimizer=pt.Adam(0.02), mode=mode)
        kinds: list[str] = []
        losses: list[float] = []
        for batch in data:
            losses.append(plan.step(**batch))
            assert plan._linked is not None
            kinds.append(plan._linked.kind)
        results[mode] = (losses, plan.state_dict())
        expected_kinds = {"compiled": ["compiled"] * 6, "dynamic": ["dynamic"] * 6,
                          "auto": ["dynamic"] * pt.AUTO_DYNAMIC_STEPS + ["compiled"] * (6 - pt.AUTO_DYNAMIC_STEPS)}
        assert kinds == expected_kinds[mode]
        plan.close()
    ref_losses, ref_state = results["compiled"]
    for mode in ("dynamic", "auto"):
        losses, state = results[mode]
        np.testing.assert_allclose(np.array(losses), np.array(ref_losses), rtol=1e-5)
        for name, value in state.items():  # fused and unfused float32 differ in the last bits
            np.testing.assert_allclose(value, ref_state[name], rtol=1e-4, atol=1e-6, err_msg=f"{mode} {name}")


def test_dynamic_mode_keeps_every_intermediate_readable() -> None:
    x = pt.input("x", (3,))
    hidden = pt.exp(x * 2.0).named("hidden")
    out = (hidden + 1.0).named("out")
    dynamic = pt.compile([out], mode="dynamic")
    dynamic.run(x=np.array([0.0, 1.0, 2.0], np.float32))
    np.testing.assert_allclose(dynamic.read(hidden), np.exp([0.0, 2.0, 4.0]), rtol=1e-6)
    compiled = pt.compile([out])
    compiled.run(x=np.zeros(3, np.float32))
    with pytest.raises(NodeNotInContextError, match="dynamic"):
        compiled.read(hidden)  # inlined into out's kernel: never stored
    dynamic.close()
    compiled.close()


def _fill_free_lists() -> None:
    """Fill CPython's free lists of small tuples and lists (2000 tuples of each size), so that
    the temporaries of a run reuse them instead of counting as new memory while they fill."""
    junk = [tuple(range(n)) for n in range(1, 6) for _ in range(2500)] + [[k] for k in range(200)]
    del junk


def test_runs_do_not_allocate() -> None:
    """A run allocates nothing that outlives it (but the dict of its results, a new one each run:
    the arrays are the plan's): of five windows of 30 runs, the best grows
    the heap by less than 4 KiB (a window may see a one-off: a dict of the runtime resizing,
    a context an earlier test dropped being given back; three windows once all did, in a
    full CI run); a leak grows every window."""
    x = pt.input("x", (256, 256))
    w = pt.param("w", (256, 64))
    plan = pt.compile({"y": pt.tanh(x @ w)})
    xs = np.ones((256, 256), np.float32)  # 256 KiB in, 64 KiB out
    xs64 = xs.astype(np.float64)  # goes through the staging array
    first = plan.run(x=xs)
    for value in (xs, xs64):
        for _ in range(3):
            plan.run(x=value)
        gc.collect()  # what earlier tests dropped is given back now, not during the count
        _fill_free_lists()
        plan.device.synchronize()
        growth, peaks = [], []
        tracemalloc.start()
        try:
            for _ in range(5):
                before, _ = tracemalloc.get_traced_memory()
                tracemalloc.reset_peak()
                for _ in range(30):
                    out = plan.run(x=value)
                after, peak = tracemalloc.get_traced_memory()
                growth.append(after - before)
                peaks.append(peak - before)
        finally:
            tracemalloc.stop()
        assert out["y"] is first["y"]  # the same arrays every run
        assert min(peaks) < 16 * 1024, f"a run allocated {peaks} bytes"
        assert min(growth) < 4 * 1024, f"30 runs kept {growth} bytes"
    plan.close()


def test_run_pipelined_equals_runs_one_by_one() -> None:
    x = pt.input("x", (64,))
    acc = pt.param("acc", (64,), init="zeros")
    y = (pt.sigmoid(x) + acc).named("y")
    plan = pt.compile([y])
    runs = [{"x": np.full(64, k, np.float32)} for k in range(5)]
    one_by_one = [plan.run(**r)["y"].copy() for r in runs]
    pipelined = plan.run_pipelined(runs)
    assert len(pipelined) == 5
    for got, want in zip(pipelined, one_by_one):
        np.testing.assert_array_equal(got["y"], want)
    again = plan.run_pipelined(runs[:3])
    assert again[0]["y"] is pipelined[0]["y"]  # host arrays are reused (in new dicts)
    plan.close()


@pytest.mark.parametrize("mode", ["compiled", "dynamic"])
def test_run_pipelined_reads_inputs_before_its_runs_overwrite_them(mode: str) -> None:
    """Results of one pipelined call fed back (swapped, or a view of one) into the next: an
    earlier run of the call writes that array before a later run's copy in reads it, so such an
    input is copied when the call starts; each run sees the values the caller passed."""
    x = pt.input("x", (2, 4))
    plan = pt.compile({"y": x + 1.0}, mode=mode)
    first = plan.run_pipelined([{"x": np.zeros((2, 4), np.float32)},
                                {"x": np.full((2, 4), 10, np.float32)}])
    a, b = first[0]["y"], first[1]["y"]  # 1s and 11s; the next call writes into them
    second = plan.run_pipelined([{"x": b}, {"x": a}, {"x": a}])
    np.testing.assert_array_equal(second[0]["y"], 12.0)
    np.testing.assert_array_equal(second[1]["y"], 2.0)
    np.testing.assert_array_equal(second[2]["y"], 2.0)
    flat = second[0]["y"].reshape(-1)  # 12s; views of it overlap it without being it
    through_buffer = np.asarray(memoryview(flat)).reshape(2, 4)  # no ndarray owner to find
    third = plan.run_pipelined([{"x": np.zeros((2, 4), np.float32)}, {"x": flat.reshape(2, 4)},
                                {"x": through_buffer}])
    np.testing.assert_array_equal(third[0]["y"], 1.0)
    np.testing.assert_array_equal(third[1]["y"], 13.0)
    np.testing.assert_array_equal(third[2]["y"], 13.0)
    plan.close()


def test_forward_plan_shares_parameters_without_copies() -> None:
    mlp, _, _, loss = _classifier(hidden=8)
    train = pt.compile(loss=loss, optimizer=pt.SGD(0.5))
    xe = pt.input("x_eval", (5, 2))
    infer = pt.compile({"logits": mlp(xe)}, share=train)
    for p in mlp.params:  # the same buffers: nothing was copied or uploaded again
        assert infer.state_context.buffers[p.node] == train.state_context.buffers[p.node]
    probe = np.random.default_rng(0).standard_normal((5, 2)).astype(np.float32)
    before = infer.run(x_eval=probe)["logits"].copy()
    for batch in _batches(5):
        train.step(**batch)
    after = infer.run(x_eval=probe)["logits"].copy()
    assert not np.allclose(before, after)  # sees the trained parameters
    w = train.state_dict()
    h = np.tanh(probe @ w["mlp.0.weight"] + w["mlp.0.bias"])
    np.testing.assert_allclose(after, h @ w["mlp.1.weight"] + w["mlp.1.bias"], rtol=1e-5, atol=1e-6)
    train.reset()  # parameters back to their initial values, seen by the forward plan too
    np.testing.assert_allclose(infer.run(x_eval=probe)["logits"], before, rtol=1e-6)
    train.close()


def test_reset_restarts_training_exactly() -> None:
    _, _, _, loss = _classifier()
    plan = pt.compile(loss=loss, optimizer=pt.Adam(0.05))
    data = _batches(4)
    first = [plan.step(**b) for b in data]
    state = plan.state_dict()
    assert state["adam.step"] == 4.0
    plan.reset()
    assert plan.state_dict()["adam.step"] == 0.0
    assert [plan.step(**b) for b in data] == first
    plan.load_state_dict(state)
    np.testing.assert_array_equal(plan.state_dict()["mlp.0.weight"], state["mlp.0.weight"])
    plan.close()


def test_reset_of_a_sharer_resets_the_whole_shared_state() -> None:
    """``reset()`` of either plan resets both: the evaluation plan's reset puts the training
    plan's optimizer state back too (step count, moments), and the training plan's reset a
    parameter only the evaluation plan has; training then restarts exactly."""
    _, x, _, loss = _classifier()
    train = pt.compile(loss=loss, optimizer=pt.Adam(0.05))
    scale = pt.param("eval_scale", (), init="ones")  # the evaluation plan's own
    infer = pt.compile({"s": pt.sum(x) * scale}, share=train)
    sharer_of_sharer = pt.compile({"s2": pt.sum(x) * scale}, share=infer)
    data = _batches(3)
    first = [train.step(**b) for b in data]
    infer.load_state_dict({"eval_scale": np.float32(3.0)}, strict=False)
    for plan in (infer, sharer_of_sharer, train):
        assert train.state_dict()["adam.step"] == 3.0
        plan.reset()
        state = train.state_dict()
        assert state["adam.step"] == 0.0, plan
        assert not state["mlp.0.weight.m"].any() and not state["mlp.0.weight.v"].any(), plan
        assert infer.state_dict()["eval_scale"] == 1.0, plan
        assert [train.step(**b) for b in data] == first, plan
        infer.load_state_dict({"eval_scale": np.float32(3.0)}, strict=False)
    sharer_of_sharer.close()  # a closed sharer leaves the others' reset alone
    train.reset()
    assert train.state_dict()["adam.step"] == 0.0
    train.close()


def test_initial_values_are_copies_the_caller_cannot_change() -> None:
    """Found by review: param(init=array) kept the caller's array, so changing it later changed
    what reset() put back and what later plans uploaded."""
    w0 = np.ones(3, np.float32)
    s0 = np.zeros(2, np.float32)
    w, s = pt.param("w", (3,), init=w0), pt.state("s", s0)
    assert w.init is not w0 and s.init is not s0 and not w.init.flags.writeable
    plan = pt.compile({"o": pt.sum(w * w) + pt.sum(s)}, share=None)
    train = pt.compile(loss=pt.sum(w * w), optimizer=pt.SGD(0.1))
    train.step()
    w0 *= 100
    s0 += 7
    train.reset()
    np.testing.assert_array_equal(train.state_dict()["w"], [1, 1, 1])
    assert plan.run()["o"] == 3.0
    plan.close()
    train.close()


def test_run_returns_a_new_dict_each_call() -> None:
    """Found by review: run() and run_pipelined() returned the same dict object every call, so
    popping an output to keep it made every later run return the edited dict."""
    x = pt.input("x", (3,))
    plan = pt.compile({"y": x * 2.0, "z": x + 1.0})
    first = plan.run(x=np.ones(3))
    kept = first.pop("y")
    first["mine"] = np.zeros(1)
    second = plan.run(x=np.full(3, 5.0))
    assert set(second) == {"y", "z"} and second is not first
    np.testing.assert_array_equal(second["y"], [10, 10, 10])
    assert kept is second["y"]  # the arrays are the plan's, reused: copy what you keep
    [p1] = plan.run_pipelined([{"x": np.ones(3)}])
    p1.clear()
    [p2] = plan.run_pipelined([{"x": np.ones(3)}])
    assert set(p2) == {"y", "z"}
    plan.close()


def test_a_sharers_state_calls_never_see_a_step_half_done() -> None:
    """Found by review: an evaluation plan's state_dict() and load_state_dict() took its own lock
    only, so from another thread they read parameters from different steps of the training
    plan (hundreds of 1000 snapshots) and loads came out torn. Every gradient is 1 (SGD, lr 1):
    after a whole number of steps every parameter holds the same value."""
    ws = [pt.param(f"w{k}", (64,), init="zeros") for k in range(12)]
    loss = pt.sum(ws[0])
    for w in ws[1:]:
        loss = loss + pt.sum(w)
    train = pt.compile(loss=loss, optimizer=pt.SGD(1.0))
    x = pt.input("x", (64,))
    out = ws[0] * x
    for w in ws[1:]:
        out = out + w * x
    evaluate = pt.compile({"o": out}, share=train)
    train.step()
    stop = threading.Event()
    failures: list[BaseException] = []

    def stepping() -> None:
        try:
            while not stop.is_set():
                train.step()
        except BaseException as e:  # pragma: no cover - reported below
            failures.append(e)

    worker = threading.Thread(target=stepping)
    worker.start()
    try:
        zeros = {f"w{k}": np.zeros(64, np.float32) for k in range(12)}
        for _ in range(150):
            snapshot = evaluate.state_dict()
            assert len({float(v[0]) for v in snapshot.values()}) == 1
            evaluate.load_state_dict(zeros)
            assert len({float(v[0]) for v in train.state_dict().values()}) == 1
    finally:
        stop.set()
        worker.join()
    assert not failures
    evaluate.close()
    train.close()


def test_a_model_built_again_cannot_share_by_name() -> None:
    """Found by review: share= matches parameters by tensor, so a model built again with the
    same names got fresh, unshared parameters, silently (the evaluation plan never saw the
    training). It is refused, naming the parameter; the same model shares."""
    x, y = pt.input("x", (8, 3)), pt.input("y", (8,), "int32")
    mlp = pt.MLP("mlp", [3, 4, 2])
    train = pt.compile(loss=pt.cross_entropy(mlp(x), y), optimizer=pt.SGD(1.0))
    xe = pt.input("xe", (8, 3))
    with pytest.raises(InvalidProgramError, match=r"this program's 'mlp.0.weight' is another tensor"):
        pt.compile({"o": pt.MLP("mlp", [3, 4, 2])(xe)}, share=train)
    evaluate = pt.compile({"o": mlp(xe)}, share=train)
    train.step(x=np.ones((8, 3), np.float32), y=np.zeros(8, np.int32))
    np.testing.assert_array_equal(evaluate.state_dict()["mlp.0.weight"], train.state_dict()["mlp.0.weight"])
    evaluate.close()
    train.close()


def test_input_errors() -> None:
    x = pt.input("x", (2, 3))
    plan = pt.compile({"y": x * 2.0})
    with pytest.raises(BindingError, match="missing x"):
        plan.run()
    with pytest.raises(BindingError, match="unknown z"):
        plan.run(x=np.zeros((2, 3)), z=1)
    with pytest.raises(ShapeMismatchError):
        plan.run(x=np.zeros((3, 2)))
    np.testing.assert_array_equal(plan.run(x=[[1, 2, 3], [4, 5, 6]])["y"], [[2, 4, 6], [8, 10, 12]])
    plan.close()


def test_in_place_writes_that_read_other_cells_are_staged() -> None:
    """``w := w.T`` inlined cell by cell would read cells it already overwrote: the program
    computes the value into scratch first; optimizer updates (same-cell reads) are not staged."""
    w = pt.param("w", (4, 4), init=np.arange(16.0).reshape(4, 4))
    plan = pt.Plan(pt.Program({}, [pt.Write(w, w.T * 1.0)]), pt.compile().device)
    assert [s.name for s in plan.program.steps][-2:] == ["stage_w", "update_w"]
    plan.run()
    np.testing.assert_array_equal(plan.state_dict()["w"], np.arange(16.0).reshape(4, 4).T)
    _, _, _, loss = _classifier()
    train = pt.compile(loss=loss, optimizer=pt.Adam(0.01))
    assert not any(s.name.startswith("stage_") for s in train.program.steps)
    plan.close()
    train.close()


def test_profile_kernels_times_every_kernel() -> None:
    from polyjit.tensor.profile import format_profile, profile_kernels

    x = pt.input("x", (64, 32))
    w = pt.param("w", (32, 16))
    plan = pt.compile({"p": pt.softmax(x @ w)})
    times = profile_kernels(plan, {"x": np.ones((64, 32), np.float32)}, repeats=2)
    assert len(times) == plan.source.count("\nvoid ")
    assert all(t.seconds > 0 for t in times)
    assert "kernels" in format_profile(times)
    plan.close()


def test_compiled_plans_replay_a_capture_with_their_copies() -> None:
    """A compiled plan is captured when it links, with its inputs' and outputs' copies: every
    run is one replay."""
    from polyjit.core.errors import InvalidProgramError
    from polyjit.core.runtime import Replay

    x = pt.input("x", (4, 3))
    plan = pt.compile({"y": (x * 2.0).sum()})
    assert plan._linked is None
    first = plan.run(x=np.ones((4, 3), np.float32))["y"].copy()
    assert first == 24.0
    replay = plan._linked.captured.full  # type: ignore[union-attr]
    assert isinstance(replay, Replay) and len(replay.routines) >= 1
    assert replay.inputs == (x.node,) and len(replay.outputs) == 1
    np.testing.assert_array_equal(plan.run(x=np.ones((4, 3), np.float32))["y"], first)
    np.testing.assert_array_equal(plan.run(x=np.full((4, 3), 2, np.float32))["y"], 48.0)
    with pytest.raises(InvalidProgramError, match="another stream"):
        plan.backend.capture(replay.routines, stream=plan.device.new_stream())
    with pytest.raises(InvalidProgramError, match="at least one routine"):
        plan.backend.capture([])
    plan.close()


@pytest.mark.parametrize("device", ["cpu", "opencl"])
def test_a_step_waits_for_its_loss_and_later_work_for_its_update(device: str) -> None:
    """A compiled step is split after the kernel that writes the loss: step() returns the
    loss while the backward pass and the update may still run, and everything enqueued
    later (a read, the next step) comes after them. Bit for bit the numbers of a plan
    synchronized after every step."""
    from polyjit.backends import get_backend

    if get_backend(device).num_devices() == 0:
        pytest.skip(f"no {device} device")
    data = _batches(6)
    plans = []
    for _ in range(2):
        mlp, _, _, loss = _classifier(hidden=64)
        plans.append((mlp, pt.compile(loss=loss, optimizer=pt.Adam(0.01), device=device)))
    (mlp, eager), (mlp2, synced) = plans
    for batch in data:
        a = eager.step(**batch)
        w_eager = eager.read(mlp.params[0]).copy()  # waits for this step's update
        b = synced.step(**batch)
        synced.synchronize()
        assert a == b
        np.testing.assert_array_equal(w_eager, synced.read(mlp2.params[0]))
    linked = eager._linked
    assert linked is not None and linked.captured is not None and linked.captured.split is not None
    head, tail = (replay.routines[0] for replay in linked.captured.split)
    assert eager._loss is not None
    assert any(eager._loss[0] in spec.outputs for spec in head.kernels) and tail.kernels
    assert len(head.kernels) + len(tail.kernels) == len(linked.routines[0].kernels)
    for _, p in plans:
        p.close()


def test_split_after_a_node_the_last_kernel_writes_is_no_split() -> None:
    x = pt.input("x", (4, 3))
    y = (x * 2.0).sum()
    plan = pt.compile({"y": y}).build()
    assert plan._linked is not None
    (routine,) = plan._linked.routines
    assert routine.split_after(y.node) is None  # written by the last kernel
    assert routine.split_after(pt.input("other", (2,)).node) is None  # written by none
    plan.close()


def test_plans_dropped_right_after_a_step_free_everything_once_their_work_is_done() -> None:
    """The tail of each step is still queued when the plan goes: the runtime keeps what it
    uses until it has run, then the memory comes back."""
    import polyjit

    dev = polyjit.default_device()
    data = _batches(2)

    def one() -> float:
        _, _, _, loss = _classifier(hidden=256)
        plan = pt.compile(loss=loss, optimizer=pt.AdamW(0.01), device=dev)
        return plan.step(**data[0]) + plan.step(**data[1])  # dropped with the second update queued

    first = one()
    base = settled_memory(dev)
    for _ in range(10):
        assert one() == first
    assert settled_memory(dev) == base


def test_threads_sharing_a_plan_take_turns() -> None:
    """Four threads step one plan on the same batch: the steps take turns (a step's two
    parts never interleave with another's), so 20 of them leave the state 20 serial steps
    leave, bit for bit."""
    import threading

    batch = _batches(1)[0]
    plans = []
    for _ in range(2):
        _, _, _, loss = _classifier(hidden=32)
        plans.append(pt.compile(loss=loss, optimizer=pt.Adam(0.01)))
    shared, serial = plans
    errors: list[BaseException] = []

    def steps() -> None:
        try:
            for _ in range(5):
                shared.step(**batch)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=steps) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors and not any(th.is_alive() for th in threads)
    for _ in range(20):
        serial.step(**batch)
    got, want = shared.state_dict(), serial.state_dict()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    for p in plans:
        p.close()


def test_what_a_no_op_returns_is_an_alias_to_name() -> None:
    """Found by review: a no-op (a cast to the same dtype, a reshape to the same shape)
    returned its operand, and .named() on it renamed the input or parameter itself: the plan
    then wanted the input under the new name, and the state dict's key changed. A no-op now
    returns an alias; .named() on a parameter itself still renames it (and it still trains)."""
    x = pt.input("x", (2, 2))
    w = pt.param("layer.weight", (2, 2), init=np.arange(4, dtype=np.float32).reshape(2, 2))
    y = x.astype("float32").named("y")
    shown = w.reshape(2, 2).named("weight_view")
    assert (x.name, w.name) == ("x", "layer.weight")
    (gw,) = pt.grad(pt.sum(shown * 3.0), [w])
    plan = pt.compile({"y": y, "shown": shown, "out": x @ w, "gw": gw})
    assert plan.input_names == ["x"] and list(plan.state_dict()) == ["layer.weight"]
    xv = np.ones((2, 2), np.float32)
    got = plan.run(x=xv)
    np.testing.assert_array_equal(got["y"], xv)
    np.testing.assert_array_equal(got["shown"], w.init)
    np.testing.assert_array_equal(got["gw"], np.full((2, 2), 3.0))
    with pytest.raises(InvalidArgumentError, match="name"):
        x.named(3)  # type: ignore[arg-type]
    plan.close()
    v = pt.param("v", (3,), init=np.ones(3, np.float32))
    renamed = v.named("V")
    assert renamed is v
    (gv,) = pt.grad(pt.sum(v * v), [renamed])
    np.testing.assert_array_equal(pt.compile({"gv": gv}).run()["gv"], np.full(3, 2.0))
    trained = pt.compile(loss=pt.sum(v * v), optimizer=pt.SGD(0.1), params=[renamed])
    trained.step()
    assert list(trained.state_dict()) == ["V"]
    np.testing.assert_allclose(trained.state_dict()["V"], np.full(3, 0.8))
    trained.close()


def test_each_thread_gets_results_of_its_own() -> None:
    """Found by review: run() handed every thread the plan's one set of result arrays, so
    another thread's run overwrote a result before its thread could copy it. Each thread's
    results (run and run_pipelined) now survive the other's runs; a thread's own next run
    reuses them."""
    import threading

    x = pt.input("x", (64,))
    plan = pt.compile({"y": x * 2.0})
    got: dict[str, Any] = {}

    def run(tag: str, value: float) -> None:
        got[tag] = plan.run(x=np.full(64, value, np.float32))
        got[tag + "_piped"] = plan.run_pipelined([{"x": np.full(64, value + 1, np.float32)}])

    for tag, value in (("a", 1.0), ("b", 5.0)):
        th = threading.Thread(target=run, args=(tag, value))
        th.start()
        th.join()
    np.testing.assert_array_equal(got["a"]["y"], 2.0)
    np.testing.assert_array_equal(got["a_piped"][0]["y"], 4.0)
    np.testing.assert_array_equal(got["b"]["y"], 10.0)
    mine = plan.run(x=np.zeros(64, np.float32))
    assert plan.run(x=np.ones(64, np.float32))["y"] is mine["y"]  # reused by this thread's next run
    np.testing.assert_array_equal(got["a"]["y"], 2.0)
    plan.close()


@pytest.mark.parametrize("device", ["cpu", "opencl"])
def test_outputs_that_are_inputs_or_constants_come_back_through_the_replay(device: str) -> None:
    """A compiled run is one replay that copies the inputs in and the outputs out: outputs
    that are an input, a constant or a result equal numpy's, from run(), run_pipelined() and
    (DLPack, cpu) run_on_device()."""
    from polyjit.backends import get_backend

    if get_backend(device).num_devices() == 0:
        pytest.skip(f"no {device} device")
    x = pt.input("x", (4, 3))
    c = np.arange(2, dtype=np.float32)
    plan = pt.compile({"x": x, "y": (x * 2.0).sum(), "c": pt.constant(c)}, device=device)
    rng = np.random.default_rng(0)
    for k in range(3):
        xs = rng.standard_normal((4, 3)).astype(np.float32)
        got = plan.run(x=xs)
        np.testing.assert_array_equal(got["x"], xs)
        np.testing.assert_allclose(got["y"], (xs * 2).sum(), rtol=1e-5)
        np.testing.assert_array_equal(got["c"], c)
        np.testing.assert_array_equal(plan.read(x), xs)
        if device == "cpu":
            np.testing.assert_array_equal(np.from_dlpack(plan.run_on_device(x=xs + k)["x"]), xs + k)
    batches = [{"x": rng.standard_normal((4, 3)).astype(np.float32)} for _ in range(3)]
    for b, res in zip(batches, plan.run_pipelined(batches)):
        np.testing.assert_array_equal(res["x"], b["x"])
        np.testing.assert_allclose(res["y"], (b["x"] * 2).sum(), rtol=1e-5)
    plan.close()


@pytest.mark.parametrize("mode", ["compiled", "dynamic"])
def test_a_step_copies_only_the_loss_whatever_its_plan(mode: str) -> None:
    """Split or not, step() fetches the loss alone: the arrays run() returned keep their values."""
    xs = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
    x = pt.input("x", (4, 3))
    w = pt.param("w", (3, 2), init="normal")
    h = x @ w
    for optimizer in (pt.SGD(lr=0.1), None):  # no optimizer: the loss is the last kernel's, no split
        plan = pt.compile({"h": h}, loss=(h * h).mean(), optimizer=optimizer, mode=mode)
        res = plan.run(x=xs)
        before = res["h"].copy()
        w0 = plan.state_dict()["w"]
        assert plan.step(x=2 * xs) == pytest.approx(float((((2 * xs) @ w0) ** 2).mean()), rel=1e-5)
        np.testing.assert_array_equal(res["h"], before)
        plan.close()


def test_a_capture_failing_at_link_leaves_the_plan_as_it_was() -> None:
    """auto mode's switch to compiled links and captures; a capture that fails (a CUDA graph
    out of memory) frees what it made and leaves the dynamic routines in place."""
    from polyjit.core.errors import DriverError

    x = pt.input("x", (4, 3))
    w = pt.param("w", (3, 2), init="normal")
    plan = pt.compile(loss=((x @ w) * (x @ w)).mean(), optimizer=pt.SGD(lr=0.1), mode="auto")
    xs = np.ones((4, 3), np.float32)
    for _ in range(3):
        plan.step(x=xs)  # dynamic
    backend, real = plan.backend, plan.backend.capture
    made: list[Any] = []

    def capture(*args: Any, **kwargs: Any) -> Any:
        if made:
            raise DriverError("graph instantiate: out of memory (simulated)")
        made.append(real(*args, **kwargs))
        return made[-1]

    used = plan.device.used_memory()
    backend.capture = capture  # type: ignore[method-assign]
    try:
        with pytest.raises(DriverError, match="simulated"):
            plan.step(x=xs)
    finally:
        del backend.capture
    assert made and made[0].closed and made[0].routines[0].context.finalized
    assert plan._linked is not None and plan._linked.kind == "dynamic" and not plan._linked.context.finalized
    assert plan.device.used_memory() == used
    w_before = plan.read(w).copy()
    plan.step(x=xs)  # compiles now
    assert plan._linked.kind == "compiled"
    assert not np.array_equal(plan.read(w), w_before)
    plan.close()


@pytest.mark.parametrize("mode", ["compiled", "dynamic"])
def test_a_tensor_listed_twice_among_the_outputs_comes_back_in_both(mode: str) -> None:
    """``compile([logits, loss], loss=loss)`` names the loss twice: the replay copies one node
    into two arrays."""
    xs = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
    x = pt.input("x", (4, 3))
    w = pt.param("w", (3, 2), init="normal")
    logits = x @ w
    loss = (logits * logits).mean()
    plan = pt.compile([logits, loss], loss=loss, optimizer=pt.SGD(lr=0.1), mode=mode)
    w0 = plan.state_dict()["w"]
    got = plan.run(x=xs)
    np.testing.assert_allclose(got[logits.name], xs @ w0, rtol=1e-5)
    assert got[loss.name] == got["loss"] == pytest.approx(float(((xs @ w0) ** 2).mean()), rel=1e-5)
    w1 = plan.state_dict()["w"]  # run() of a training plan updates too
    assert plan.step(x=xs) == pytest.approx(float(((xs @ w1) ** 2).mean()), rel=1e-5)
    twice = pt.compile({"a": logits, "b": logits}, mode=mode)
    res = twice.run(x=xs)
    np.testing.assert_array_equal(res["a"], res["b"])
    for p in (plan, twice):
        p.close()


def test_run_on_device_reads_its_inputs_as_they_were_when_it_was_called() -> None:
    """Found by the concurrency review: run_on_device returns before its input copies run,
    and a converted input went through the plan's one staging array, which the next call (a
    step, or a call refused for a bad label) overwrote first: the queued run trained on the
    next call's batch (20 of 20)."""
    a, b, c = _batches(3, seed=4)
    plans = []
    for _ in range(2):
        *_, loss = _classifier(hidden=256)
        plans.append(pt.compile(loss=loss, optimizer=pt.Adam(0.01)))
    plan, ref = plans
    mine = {"x": a["x"].astype(np.float64), "y": a["y"].copy()}  # float64: converted on the host
    plan.run_on_device(**mine)
    mine["y"][:] = 1 - mine["y"]  # the caller's own array, changed after the call
    with pytest.raises(ValueRangeError):
        plan.run(x=c["x"].astype(np.float64), y=np.full(B, 0.5))  # refused after x was converted
    loss = plan.step(x=b["x"].astype(np.float64), y=b["y"])
    ref.run(**a)
    assert loss == ref.step(**b)
    for k, v in ref.state_dict().items():
        np.testing.assert_array_equal(plan.state_dict()[k], v, err_msg=k)


def test_run_on_device_on_a_backend_without_exports_refuses_before_anything_runs() -> None:
    """Found by the concurrency review: on OpenCL the export failed after the run, so a
    training plan was updated by a call that raised."""
    *_, loss = _classifier()
    plan = pt.compile(loss=loss, optimizer=pt.SGD(0.1), device="opencl")
    before = plan.state_dict()
    with pytest.raises(UnsupportedError, match="no DLPack device"):
        plan.run_on_device(**_batches(1)[0])
    assert plan.runs == 0
    for k, v in plan.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


@pytest.mark.parametrize("mode", ["compiled", "dynamic"])
def test_a_plan_without_an_optimizer_checks_its_labels(mode: str) -> None:
    """Found by the concurrency review: the label check rode on the one-hot only the backward
    pass reads, so an evaluation plan (the README's share=) returned a loss for labels -1 or 99."""
    *_, loss = _classifier()
    plan = pt.compile({"loss": loss}, mode=mode)
    batch = _batches(1)[0]
    for bad in (-1, 2, 99):
        labels = batch["y"].copy()
        labels[5] = bad
        with pytest.raises(IndexOutOfRangeError, match=f"input 'y'.*{bad}"):
            plan.run(x=batch["x"], y=labels)
    assert np.isfinite(plan.run(**batch)["loss"])


def _interrupt_after(obj: Any, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C right after ``obj.name`` has enqueued its part (SIGINT to this process, taken
    by Python at the next line, as a real one is)."""
    import signal

    real = getattr(obj, name)

    def then_ctrl_c(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(obj, name, then_ctrl_c)


@pytest.fixture
def default_sigint(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Python's own SIGINT handler, as a program starts with (a test runner may set its own)."""
    import signal

    from polyjit.core import interrupts

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setattr(interrupts, "_installed", False)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("mode", ["compiled", "dynamic"])
def test_ctrl_c_inside_a_step_applies_the_whole_step_then_raises(mode: str, default_sigint: None,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the concurrency review: a KeyboardInterrupt between a step's two enqueues left
    the forward half queued (with Adam's step count) and the update not: every later step used
    a wrong bias correction (9 of 30 interrupts that landed inside step())."""
    batches = _batches(3, seed=8)
    plans = []
    for _ in range(2):
        *_, loss = _classifier(hidden=32)
        plans.append(pt.compile(loss=loss, optimizer=pt.Adam(0.01), mode=mode))
    plan, ref = plans
    for p in plans:
        p.step(**batches[0])
    linked = plan._linked
    assert linked is not None
    if mode == "compiled":
        assert linked.captured is not None and linked.captured.split is not None
        _interrupt_after(linked.captured.split[0], "_replay_prepared", monkeypatch)
    else:
        _interrupt_after(linked.routines[0], "run", monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        plan.step(**batches[1])
    monkeypatch.undo()
    ref.step(**batches[1])
    assert plan.step(**batches[2]) == ref.step(**batches[2])  # the plan is usable, and was stepped whole
    for k, v in ref.state_dict().items():
        np.testing.assert_array_equal(plan.state_dict()[k], v, err_msg=k)
