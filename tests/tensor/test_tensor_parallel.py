"""Data parallelism: a tree all-reduce through merge buffers keeps replicas equal and matches
one device."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from polyjit import tensor as pt
from polyjit.backends.cpu import create_backend
from polyjit.core.errors import BindingError, InvalidProgramError, ShapeMismatchError
from polyjit.core.runtime import Backend
from polyjit.demo.datasets import two_spirals
from polyjit.tensor.parallel import tree_rounds

Array = np.ndarray[Any, Any]
BATCH = 48  # splits over 1, 2 and 3 devices


@pytest.fixture(scope="module")
def three_devices() -> Backend:
    return create_backend(num_devices=3)


def _train(devices: list[Any], make_opt: Callable[[], pt.Optimizer], steps: int = 20
           ) -> tuple[dict[str, Array], list[float], float]:
    mlp = pt.MLP("mlp", [2, 32, 32, 2], activation="tanh", seed=3)

    def model_step(x: pt.Tensor, y: pt.Tensor) -> pt.Tensor:
        return pt.cross_entropy(mlp(x), y)

    dp = pt.data_parallel(model_step, {"x": ((BATCH, 2), "float32"), "y": ((BATCH,), "int32")},
                          optimizer=make_opt(), devices=devices)
    xs, ys = two_spirals(BATCH * steps, seed=1)
    losses = [dp.step(x=xs[k * BATCH : (k + 1) * BATCH], y=ys[k * BATCH : (k + 1) * BATCH])
              for k in range(steps)]
    spread = dp.replica_spread()
    params = dp.parameters()
    dp.close()
    return params, losses, spread


@pytest.mark.parametrize("make_opt", [lambda: pt.SGD(0.1, momentum=0.9), lambda: pt.Adam(0.01)],
                         ids=["sgd_momentum", "adam"])
def test_two_devices_match_one_device_after_20_steps(three_devices: Backend,
                                                     make_opt: Callable[[], pt.Optimizer]) -> None:
    devs = three_devices.devices()
    one, losses1, _ = _train(devs[:1], make_opt)
    two, losses2, spread = _train(devs[:2], make_opt)
    assert spread == 0.0  # every replica applied the same update to the same state
    np.testing.assert_allclose(losses2, losses1, rtol=1e-5)
    for name, value in one.items():
        scale = float(np.abs(value).max())
        np.testing.assert_allclose(two[name], value, rtol=1e-5, atol=1e-5 * scale, err_msg=name)


def test_three_devices_use_an_uneven_tree(three_devices: Backend) -> None:
    devs = three_devices.devices()
    one, _, _ = _train(devs[:1], lambda: pt.SGD(0.1), steps=5)
    three, _, spread = _train(devs, lambda: pt.SGD(0.1), steps=5)
    assert spread == 0.0
    for name, value in one.items():
        np.testing.assert_allclose(three[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_tree_rounds() -> None:
    assert tree_rounds(1) == []
    assert tree_rounds(2) == [[(0, 1)]]
    assert tree_rounds(4) == [[(0, 1), (2, 3)], [(0, 2)]]
    assert tree_rounds(5) == [[(0, 1), (2, 3)], [(0, 2)], [(0, 4)]]
    for n in range(1, 9):  # log2 rounds; every device but 0 sends exactly once
        rounds = tree_rounds(n)
        assert len(rounds) == int(np.ceil(np.log2(n)))
        senders = sorted(s for r in rounds for _, s in r)
        assert senders == list(range(1, n))


def test_evaluation_plan_shares_replica_zero(three_devices: Backend) -> None:
    devs = three_devices.devices()[:2]
    mlp = pt.MLP("mlp", [2, 8, 2], seed=0)
    dp = pt.data_parallel(lambda x, y: pt.cross_entropy(mlp(x), y),
                          {"x": ((8, 2), "float32"), "y": ((8,), "int32")},
                          optimizer=pt.SGD(0.5), devices=devs)
    xe = pt.input("xe", (8, 2))
    evaluate = pt.compile({"logits": mlp(xe)}, share=dp)
    xs, ys = two_spirals(8, seed=0)
    before = evaluate.run(xe=xs)["logits"].copy()
    dp.step(x=xs, y=ys)
    after = evaluate.run(xe=xs)["logits"]
    assert not np.allclose(before, after)
    p = dp.parameters()
    h = np.maximum(xs @ p["mlp.0.weight"] + p["mlp.0.bias"], 0)
    np.testing.assert_allclose(after, h @ p["mlp.1.weight"] + p["mlp.1.bias"], rtol=1e-5, atol=1e-6)
    with pytest.raises(ShapeMismatchError):
        dp.step(x=xs[:4], y=ys[:4])
    evaluate.reset()  # resets what it shares: every replica, not replica 0's parameters only
    assert dp.replica_spread() == 0.0
    np.testing.assert_array_equal(evaluate.run(xe=xs)["logits"], before)
    # so does a load through it (found by review: replica 0 only, and the replicas stayed apart)
    zeros = {name: np.zeros_like(v) for name, v in evaluate.state_dict().items()}
    evaluate.load_state_dict(zeros)
    assert dp.replica_spread() == 0.0
    assert not any(v.any() for v in dp.parameters(1).values())
    dp.step(x=xs, y=ys)
    assert dp.replica_spread() == 0.0
    dp.close()


def test_batch_must_split_evenly(three_devices: Backend) -> None:
    w = pt.param("w", (2, 2))
    with pytest.raises(ShapeMismatchError, match="split evenly"):
        pt.data_parallel(lambda x: pt.sum(x @ w), {"x": ((4, 2), "float32")},
                         optimizer=pt.SGD(0.1), devices=three_devices)


def test_a_parameter_listed_twice_is_refused(three_devices: Backend) -> None:
    """As compile() does (``optim.checked_params``): listed twice, it would be updated twice a step."""
    w = pt.param("dp_twice", (4, 2), init="ones")
    with pytest.raises(InvalidProgramError, match="dp_twice more than once"):
        pt.data_parallel(lambda x: ((x @ w) ** 2.0).mean(), {"x": ((2, 4), "float32")},
                         optimizer=pt.SGD(0.1), devices=three_devices.devices()[:2], params=[w, w])
    opt = pt.SGD(0.1)
    with pytest.raises(InvalidProgramError, match="dp_twice more than once"):
        opt.updates([w, w], [w, w])
    opt.lr = 0.5  # a refused updates() built nothing


def test_an_input_needs_a_batch_axis(three_devices: Backend) -> None:
    """A 0-d input (or a shape that is not a tuple) is refused by name, not by a StopIteration."""
    w = pt.param("w", (2, 2))
    for shape in ((), 4):
        with pytest.raises(ShapeMismatchError, match=r"input 'x'.*no batch axis"):
            pt.data_parallel(lambda x: pt.sum(x * w), {"x": (shape, "float32")},
                             optimizer=pt.SGD(0.1), devices=three_devices)


def test_an_empty_batch_or_nothing_to_train_is_refused(three_devices: Backend) -> None:
    """A batch of 0 rows made 0-row shards and a NaN loss; a model without parameters failed
    inside concat ("concat of no tensors")."""
    w = pt.param("w", (2, 2))
    with pytest.raises(ShapeMismatchError, match="batch of 0 rows"):
        pt.data_parallel(lambda x: pt.sum(x @ w), {"x": ((0, 2), "float32")},
                         optimizer=pt.SGD(0.1), devices=three_devices)
    for params, model in (([], lambda x: pt.sum(x @ w)), (None, lambda x: pt.sum(x * 2.0))):
        with pytest.raises(InvalidProgramError, match="nothing to train"):
            pt.data_parallel(model, {"x": ((3, 2), "float32")}, optimizer=pt.SGD(0.1), devices=three_devices,
                             params=params)


def test_replicas_equal_at_inf_have_no_spread(three_devices: Backend) -> None:
    """Found by review: replica_spread() gave NaN for replicas holding the same inf (inf - inf)."""
    w = pt.param("w", (4, 2), init="ones")
    dp = pt.data_parallel(lambda x: pt.mean((x @ w) ** 2), {"x": ((3, 4), "float32")},
                          optimizer=pt.SGD(0.1), devices=three_devices)
    v = np.ones((4, 2), np.float32)
    v[0, 0] = np.inf
    dp.load_state_dict({"w": v})
    assert dp.replica_spread() == 0.0
    v[1, 1] = np.nan
    dp.load_state_dict({"w": v})
    assert np.isnan(dp.replica_spread())
    dp.close()


def test_reset_reaches_every_plan_sharing_a_data_parallel(three_devices: Backend) -> None:
    """Found by review: two plans compiled with share=dp; A.reset() left B's own parameter,
    and dp.reset() left both plans' own parameters."""
    w = pt.param("w", (4, 2), init="ones")
    dp = pt.data_parallel(lambda x: pt.mean((x @ w) ** 2), {"x": ((3, 4), "float32")},
                          optimizer=pt.SGD(0.1), devices=three_devices)
    xe = pt.input("xe", (2, 4))
    own = [pt.param(f"own{k}", (), init="ones") for k in range(2)]
    plans = [pt.compile({"y": pt.sum(xe @ w) * s}, share=dp) for s in own]
    for reset in (plans[0].reset, plans[1].reset, dp.reset):
        dp.step(x=np.ones((3, 4), np.float32))
        for plan, s in zip(plans, own):
            plan.load_state_dict({s.name: np.float32(3.0)}, strict=False)
        reset()
        for plan, s in zip(plans, own):
            assert plan.state_dict()[s.name] == 1.0, (reset, s.name)
        assert all(np.array_equal(dp.parameters(k)["w"], np.ones((4, 2))) for k in range(3)), reset
    dp.close()


def test_a_declared_input_the_model_does_not_read_is_taken(three_devices: Backend) -> None:
    """An input of the spec that model_step ignores is taken by step() (it was refused as
    "unknown"), its shape still checked; leaving it out is refused, as for any input."""
    w = pt.param("w", (4, 2), init="ones")
    dp = pt.data_parallel(lambda x, mask: pt.mean((x @ w) ** 2), {"x": ((3, 4), "float32"), "mask": ((3,), "float32")},
                          optimizer=pt.SGD(0.1), devices=three_devices)
    x = np.ones((3, 4), np.float32)
    assert dp.step(x=x, mask=np.ones(3, np.float32)) == 16.0
    with pytest.raises(ShapeMismatchError, match="input 'mask'"):
        dp.step(x=x, mask=np.ones(4, np.float32))
    with pytest.raises(BindingError, match="missing mask"):
        dp.step(x=x)
    dp.close()


def test_load_state_dict_sets_every_replica(three_devices: Backend) -> None:
    mlp = pt.MLP("lsd", [2, 8, 2], activation="tanh", seed=5)

    def model_step(x: pt.Tensor, y: pt.Tensor) -> pt.Tensor:
        return pt.cross_entropy(mlp(x), y)

    dp = pt.data_parallel(model_step, {"x": ((12, 2), "float32"), "y": ((12,), "int32")},
                          optimizer=pt.SGD(0.1), devices=three_devices.devices())
    state = dp.state_dict()
    new = {k: np.full_like(v, 0.25) for k, v in state.items()}
    dp.load_state_dict(new)
    for k in range(3):
        for name, value in dp.state_dict(k).items():
            np.testing.assert_array_equal(value, new[name])
    with pytest.raises(ShapeMismatchError):
        dp.load_state_dict({**new, next(iter(new)): np.zeros(1, np.float32)})
    assert all(np.array_equal(v, new[n]) for n, v in dp.state_dict(2).items())  # nothing changed
    dp.close()


def test_threads_sharing_a_data_parallel_take_turns(three_devices: Backend) -> None:
    """Found by review: two threads stepping one data_parallel interleaved a step's compute,
    all-reduce and update with the other's (replicas 0.2 apart, no error). Steps take turns,
    as a Plan's do: 2 x 15 threaded steps leave the state 30 serial steps leave, bit for bit,
    while a third thread reads the state."""
    import threading

    devs = three_devices.devices()[:2]
    xs, ys = two_spirals(BATCH, seed=2)

    def build() -> Any:
        mlp = pt.MLP("mlp", [2, 16, 2], seed=4)
        return pt.data_parallel(lambda x, y: pt.cross_entropy(mlp(x), y),
                                {"x": ((BATCH, 2), "float32"), "y": ((BATCH,), "int32")},
                                optimizer=pt.SGD(0.1, momentum=0.9), devices=devs)

    shared, serial = build(), build()
    errors: list[BaseException] = []

    def steps() -> None:
        try:
            for _ in range(15):
                shared.step(x=xs, y=ys)
        except BaseException as e:  # reported below
            errors.append(e)

    def reads() -> None:
        try:
            for _ in range(15):
                assert shared.replica_spread() == 0.0
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=steps), threading.Thread(target=steps), threading.Thread(target=reads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors and not any(th.is_alive() for th in threads), errors
    for _ in range(30):
        serial.step(x=xs, y=ys)
    got, want = shared.state_dict(), serial.state_dict()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    for dp in (shared, serial):
        dp.close()


def test_two_data_parallels_on_the_same_devices_train_from_two_threads(three_devices: Backend,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: each device has one merge buffer, and the all-reduce's copy into it
    and the add that reads it were two enqueues. A second model trained from another thread
    on the same devices copied its gradients into that buffer in between, and the step failed
    with MergeBufferMismatchError (2-6 of 400 steps). The copy and its add are one unit now
    (``Device.merge_lock``). Here the other model's step starts right after the first model's
    copy, and is given a second to copy into the buffer before the first model's add runs: both
    steps apply, and leave each model's state as a step alone leaves it."""
    import threading

    devs = three_devices.devices()[:2]
    xs, ys = two_spirals(BATCH, seed=7)

    def build(seed: int) -> Any:
        mlp = pt.MLP("mlp", [2, 16, 2], seed=seed)
        return pt.data_parallel(lambda x, y: pt.cross_entropy(mlp(x), y),
                                {"x": ((BATCH, 2), "float32"), "y": ((BATCH,), "int32")},
                                optimizer=pt.SGD(0.1, momentum=0.9), devices=devs)

    first, second, first_alone, second_alone = build(8), build(9), build(8), build(9)
    (xfer, _), = first._reduce
    (other, _), = second._reduce
    copy_first, copy_other = xfer.run, other.run
    copied, results, threads = threading.Event(), [], []

    def other_copies() -> None:
        copy_other()
        copied.set()

    def second_steps() -> None:
        try:
            results.append(second.step(x=xs, y=ys))
        except BaseException as e:  # reported below
            results.append(e)

    def then_the_other_model_steps() -> None:
        copy_first()
        if not threads:  # the first model's gradient is in cpu:0's merge buffer: the second model steps
            threads.append(threading.Thread(target=second_steps))
            threads[0].start()
            copied.wait(timeout=1.0)  # its copy into that buffer lands here, or waits for the add

    monkeypatch.setattr(xfer, "run", then_the_other_model_steps)
    monkeypatch.setattr(other, "run", other_copies)
    loss = first.step(x=xs, y=ys)
    threads[0].join(timeout=60)
    monkeypatch.undo()
    assert copied.is_set() and results and not isinstance(results[0], BaseException), results
    assert loss == first_alone.step(x=xs, y=ys)
    assert results[0] == second_alone.step(x=xs, y=ys)
    for dp, alone in ((first, first_alone), (second, second_alone)):
        assert dp.replica_spread() == 0.0
        for name, value in alone.state_dict().items():
            np.testing.assert_array_equal(dp.state_dict()[name], value, err_msg=name)
        dp.close()
        alone.close()


def test_ctrl_c_between_two_replicas_updates_keeps_them_equal(three_devices: Backend,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the concurrency review: a KeyboardInterrupt after replica 0's update was queued
    and before replica 1's parted the replicas for good (replica_spread() 0.005-0.011). The
    interrupt now waits for every replica's update, then is raised."""
    import signal

    from polyjit.core import interrupts

    devs = three_devices.devices()[:2]
    xs, ys = two_spirals(BATCH, seed=5)

    def build() -> Any:
        mlp = pt.MLP("mlp", [2, 16, 2], seed=6)
        return pt.data_parallel(lambda x, y: pt.cross_entropy(mlp(x), y),
                                {"x": ((BATCH, 2), "float32"), "y": ((BATCH,), "int32")},
                                optimizer=pt.Adam(0.01), devices=devs)

    dp, ref = build(), build()
    for d in (dp, ref):
        d.step(x=xs, y=ys)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as a program starts
    monkeypatch.setattr(interrupts, "_installed", False)
    try:
        first = dp.replicas[0].update_replay
        real = first.replay

        def then_ctrl_c(*args: Any, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)
            signal.raise_signal(signal.SIGINT)  # taken by Python at the next line, as a real one
            return out

        monkeypatch.setattr(first, "replay", then_ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            dp.step(x=xs, y=ys)
    finally:
        monkeypatch.undo()
        signal.signal(signal.SIGINT, before)
    assert dp.replica_spread() == 0.0
    ref.step(x=xs, y=ys)
    assert dp.step(x=xs, y=ys) == ref.step(x=xs, y=ys)
    for k, v in ref.parameters().items():
        np.testing.assert_array_equal(dp.parameters()[k], v, err_msg=k)
    dp.close()
    ref.close()


def test_calls_on_a_closed_data_parallel_name_the_call(three_devices: Backend) -> None:
    """As a Plan's do: a FinalizedError saying which call came after close() (they named an
    internal replay or context)."""
    from polyjit.core.errors import FinalizedError

    w = pt.param("closed_w", (4, 1))
    dp = pt.data_parallel(lambda x: pt.mean((x @ w) ** 2), {"x": ((4, 4), "float32")},
                          optimizer=pt.SGD(0.1), devices=three_devices.devices()[:2])
    x = np.ones((4, 4), np.float32)
    dp.step(x=x)
    dp.close()
    calls = {"step()": lambda: dp.step(x=x), "step_profiled()": lambda: dp.step_profiled(x=x),
             "state_dict()": dp.state_dict, "load_state_dict()": lambda: dp.load_state_dict({}, strict=False),
             "parameters()": dp.parameters, "rank_spread()": dp.rank_spread,
             "replica_spread()": dp.replica_spread, "reset()": dp.reset}
    for call, fn in calls.items():
        with pytest.raises(FinalizedError, match=rf"{re.escape(call)} after close\(\)"):
            fn()
    dp.close()  # again: fine
