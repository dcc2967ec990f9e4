"""Replays with host copies (``Backend.capture(routines, inputs=, outputs=)``): one enqueue per
replay, checked against numpy; hostile arguments, dropped arrays, threads sharing a replay,
and a driver call failing halfway through."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from polyjit import ir
from polyjit.core.errors import (
    DriverError,
    DTypeMismatchError,
    FinalizedError,
    InvalidArgumentError,
    NodeNotInContextError,
    ReadOnlyNodeError,
    ShapeMismatchError,
)
from polyjit.core.ir import Node, Op
from polyjit.core.routine import Replay, Routine
from polyjit.core.runtime import Backend

N = 1000


@pytest.fixture
def exp(backend: Backend) -> Iterator[tuple[Routine, Node, Node]]:
    """A routine ``out = exp(a)`` linked in a context holding both."""
    a, out = Node("a", (N,)), Node("out", (N,))
    code = backend.compile(ir.Comp.of(ir.apply(Op.EXP, a, into=out)), name="exp")
    with backend.get_device(0).make_context() as root:
        ctx = root.init_from_host(a, np.zeros(N, np.float32))
        r = ctx.link(code)
        yield r, a, out
        r.context.finalize()


def _values(k: int) -> np.ndarray:
    return (np.arange(N, dtype=np.float32) % 7 - 3) / (k + 1)


def test_a_replay_copies_in_runs_and_copies_out(backend: Backend, exp: tuple[Routine, Node, Node]) -> None:
    r, a, out = exp
    replay = backend.capture([r], inputs=[a], outputs=[out])
    assert replay.inputs == (a,) and replay.outputs == (out,)
    seq = r.context.stream.seq
    results = []
    for k in range(5):
        got = np.empty(N, np.float32)
        results.append((k, got, replay.replay([_values(k)], [got])))
    assert r.context.stream.seq == seq + 5  # one event per replay, copies and all
    for k, got, ev in results:
        ev.synchronize()
        np.testing.assert_allclose(got, np.exp(_values(k)), rtol=1e-6)
    # without arrays, no copies: the routine runs on what the node holds (the last input)
    replay.replay()
    np.testing.assert_allclose(r.context.read(out), np.exp(_values(4)), rtol=1e-6)
    # a non-contiguous input is copied from as it is (like from_host)
    strided = np.repeat(_values(9), 2)[::2]
    got = np.empty(N, np.float32)
    replay.replay([strided], [got]).synchronize()
    np.testing.assert_allclose(got, np.exp(_values(9)), rtol=1e-6)


def test_bad_arrays_are_refused_before_anything_is_enqueued(
        backend: Backend, exp: tuple[Routine, Node, Node]) -> None:
    r, a, out = exp
    replay = backend.capture([r], inputs=[a], outputs=[out])
    good_in, good_out = _values(1), np.empty(N, np.float32)
    bad: list[tuple[dict[str, Any], type[Exception], str]] = [
        (dict(inputs=[good_in, good_in]), InvalidArgumentError, "takes 1 arrays, one per captured input node, got 2"),
        (dict(inputs=good_in), InvalidArgumentError, "list or tuple of numpy arrays, got ndarray"),
        (dict(inputs=(a for a in [good_in])), InvalidArgumentError, "got generator"),
        (dict(inputs={"a": good_in}), InvalidArgumentError, "got dict"),
        (dict(inputs=5), InvalidArgumentError, "got int"),
        (dict(inputs=[good_in[:10]]), ShapeMismatchError, r"replay input of a#\d+: array has shape \(10,\)"),
        (dict(inputs=[good_in.astype(np.float64)]), DTypeMismatchError, "float64"),
        (dict(inputs=[list(good_in)]), DTypeMismatchError, "numpy array, got list"),
        (dict(inputs=[good_in], outputs=[np.empty(N, np.float32)[::1].reshape(N)[::-1]]),
         ShapeMismatchError, r"replay output of out#\d+ needs a writeable C-contiguous"),
        (dict(inputs=[good_in], outputs=[]), InvalidArgumentError, "one per captured output node, got 0"),
    ]
    frozen = np.empty(N, np.float32)
    frozen.flags.writeable = False
    bad.append((dict(inputs=[good_in], outputs=[frozen]), ShapeMismatchError, "writeable"))
    stream = r.context.stream
    for kwargs, error, match in bad:
        seq = stream.seq
        with pytest.raises(error, match=match):
            replay.replay(**kwargs)
        assert stream.seq == seq, kwargs  # nothing was enqueued
    replay.replay([good_in], [good_out]).synchronize()  # still usable
    np.testing.assert_allclose(good_out, np.exp(good_in), rtol=1e-6)
    replay.close()
    with pytest.raises(FinalizedError):
        replay.replay([good_in], [good_out])


def test_bad_captures_are_refused(backend: Backend, exp: tuple[Routine, Node, Node]) -> None:
    r, a, out = exp
    with pytest.raises(InvalidArgumentError, match="more than once"):
        backend.capture([r], inputs=[a, a])
    for bad, kind in ((a, "Node"), (None, "NoneType"), ({a}, "set"), ((n for n in [a]), "generator"),
                      ({a: 1}, "dict")):
        with pytest.raises(InvalidArgumentError, match=f"list or tuple of Nodes, got {kind}"):
            backend.capture([r], inputs=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="list or tuple of Nodes, got str"):
        backend.capture([r], outputs=["out"])  # type: ignore[list-item]
    with pytest.raises(NodeNotInContextError, match="capture"):
        backend.capture([r], outputs=[Node("elsewhere", (3,))])
    k = Node("k", (N,), mode=ir.MemoryMode.MATERIALIZED)
    code = backend.compile(ir.Comp.of(ir.constant(k, np.ones(N, np.float32)),
                                      ir.apply(Op.ADD, a, k, into=out)), name="plus_one")
    plus = r.context.link(code)
    with pytest.raises(ReadOnlyNodeError, match=f"capture\\(inputs=\\): {k.label} is read-only .*a constant"):
        backend.capture([plus], inputs=[k])
    got = np.empty(N, np.float32)
    backend.capture([plus], outputs=[k, out]).replay(None, [np.empty(N, np.float32), got]).synchronize()
    np.testing.assert_array_equal(got, r.context.read(a) + 1)
    plus.context.finalize()


def test_arrays_live_until_the_replay_is_done_and_no_longer(
        backend: Backend, exp: tuple[Routine, Node, Node]) -> None:
    r, a, out = exp
    replay = backend.capture([r], inputs=[a], outputs=[out])
    refs = []
    for k in range(30):
        src, dst = _values(k), np.empty(N, np.float32)
        ev = replay.replay([src], [dst])
        refs.append((weakref.ref(src), weakref.ref(dst)))
        del src, dst
        gc.collect()
        alive = all(w() is not None for w in refs[-1])
        assert alive or ev.is_done()  # released only once its work is known complete
    r.context.stream.synchronize()
    gc.collect()
    assert all(w() is None for pair in refs for w in pair)  # and then released


def test_threads_sharing_a_replay_each_get_their_own_results(
        backend: Backend, exp: tuple[Routine, Node, Node]) -> None:
    """A replay's copies in, launches and copies out are one enqueue: threads replaying one
    capture on one stream never see each other's inputs in their outputs."""
    r, a, out = exp
    replay = backend.capture([r], inputs=[a], outputs=[out])
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for k in range(40):
                src, dst = _values(10 * t + k), np.empty(N, np.float32)
                replay.replay([src], [dst]).synchronize()
                np.testing.assert_allclose(dst, np.exp(src), rtol=1e-6)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[0]


def test_a_driver_call_failing_halfway_keeps_what_was_enqueued_alive(
        backend: Backend, exp: tuple[Routine, Node, Node], monkeypatch: pytest.MonkeyPatch) -> None:
    """The input's copy and the launch are on the stream when the output's copy fails: the replay raises a DriverError that says so, an event is recorded behind what
    did reach the stream, the arrays live until it is done, and the context stays usable."""
    r, a, out = exp
    replay = backend.capture([r], inputs=[a], outputs=[out])
    driver = r.context.device.driver

    def refuse(*args: Any) -> None:
        raise RuntimeError("copy refused")

    monkeypatch.setattr(driver, "copy_to_host", refuse)
    src = _values(3)
    ref = weakref.ref(src)
    stream = r.context.stream
    seq = stream.seq
    with pytest.raises(DriverError, match=r"after 2 of its operations were enqueued: RuntimeError: copy refused"):
        replay.replay([src], [np.empty(N, np.float32)])
    assert stream.seq == seq + 1  # an event behind the work that did reach the stream
    assert stream.backlog() > 0 or stream.done_seq > seq  # what it uses is kept until then
    del src
    gc.collect()
    assert ref() is not None or stream.done_seq > seq  # the input's copy keeps its array
    # the first operation failing is the plain error of one enqueue: nothing reached the stream
    monkeypatch.setattr(driver, "launch", refuse)
    with pytest.raises(DriverError, match="failed: RuntimeError: copy refused"):
        replay.replay()
    assert stream.seq == seq + 1
    monkeypatch.undo()
    stream.synchronize()
    got = np.empty(N, np.float32)
    replay.replay([_values(5)], [got]).synchronize()
    np.testing.assert_allclose(got, np.exp(_values(5)), rtol=1e-6)
    np.testing.assert_allclose(r.context.read(a), _values(5))


def test_the_generic_replay_is_one_enqueue_of_all_its_routines(backend: Backend) -> None:
    """Two routines and two copies: one event, results as the routines run one by one."""
    a, b, c = Node("a", (N,)), Node("b", (N,)), Node("c", (N,))
    first = backend.compile(ir.Comp.of(ir.apply(Op.EXP, a, into=b)), name="first")
    second = backend.compile(ir.Comp.of(ir.apply(Op.NEG, b, into=c)), name="second")
    with backend.get_device(0).make_context() as root:
        ctx = root.init_from_host(a, np.zeros(N, np.float32))
        r1 = ctx.link(first)
        r2 = r1.context.link(second)
        replay = backend.capture([r1, r2], inputs=[a], outputs=[b, c])
        assert type(replay) is Replay or backend.name == "cuda"
        got_b, got_c = np.empty(N, np.float32), np.empty(N, np.float32)
        seq = ctx.stream.seq
        replay.replay([_values(2)], [got_b, got_c]).synchronize()
        assert ctx.stream.seq == seq + 1  # one event for the copies and both launches
        np.testing.assert_allclose(got_b, np.exp(_values(2)), rtol=1e-6)
        np.testing.assert_allclose(got_c, -np.exp(_values(2)), rtol=1e-6)
        r2.context.finalize()


def test_work_on_the_stream_is_kept_alive_when_recording_its_event_fails(
        backend: Backend, exp: tuple[Routine, Node, Node], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call of the replay reached the stream, then the event's record failed: the
    arrays and launch records stay until a later event completes (a crash before)."""
    r, a, out = exp
    replay = backend.capture([r], inputs=[a], outputs=[out])
    driver = r.context.device.driver
    real = driver.record
    fails = iter([True])

    def record_once_refused(handle: Any) -> Any:
        if next(fails, False):
            raise RuntimeError("record refused")
        return real(handle)

    monkeypatch.setattr(driver, "record", record_once_refused)
    stream = r.context.stream
    dst = np.empty(N, np.float32)
    ref = weakref.ref(dst)
    with pytest.raises(DriverError, match=r"recording the event behind .* failed: RuntimeError: record refused"):
        replay.replay([_values(6)], [dst])
    del dst
    gc.collect()
    assert ref() is not None or stream.done_seq == stream.seq  # kept while the copy may be pending
    monkeypatch.undo()
    stream.synchronize()
    gc.collect()
    assert ref() is None and stream.backlog() == 0
    np.testing.assert_allclose(r.context.read(out), np.exp(_values(6)), rtol=1e-6)


def test_an_error_of_polyjit_after_the_first_operation_keeps_its_type(
        backend: Backend, exp: tuple[Routine, Node, Node], monkeypatch: pytest.MonkeyPatch) -> None:
    r, _, out = exp
    replay = backend.capture([r], outputs=[out])
    driver = r.context.device.driver

    def refuse(*args: Any) -> None:
        raise ShapeMismatchError("the driver's own words")

    monkeypatch.setattr(driver, "copy_to_host", refuse)
    with pytest.raises(ShapeMismatchError, match="the driver's own words"):
        replay.replay(None, [np.empty(N, np.float32)])
    monkeypatch.undo()
    r.context.stream.synchronize()


def test_extensions_written_for_the_old_hooks_are_refused_at_once() -> None:
    """A Replay that overrides the old ``_enqueue`` and a Backend whose ``capture`` takes no
    ``inputs=``/``outputs=`` fail when the class is made, saying what to do instead."""
    with pytest.raises(InvalidArgumentError, match="override _launches"):
        type("OldReplay", (Replay,), {"_enqueue": lambda self: None})

    def capture(self: Any, routines: Any, *, stream: Any = None) -> Any:
        return None

    with pytest.raises(InvalidArgumentError, match="must take inputs=, outputs="):
        type("OldBackend", (Backend,), {"capture": capture})
    with pytest.raises(InvalidArgumentError, match="must take inputs=, outputs="):
        type("OldReplayCall", (Replay,), {"replay": lambda self: None})
    with pytest.raises(InvalidArgumentError, match="override _launches"):  # inherited from a mixin, too
        type("Mixed", (type("Mixin", (), {"_enqueue": lambda self: None}), Replay), {})

    def forwarding(self: Any, routines: Any, **kwargs: Any) -> Any:
        return Backend.capture(self, routines, **kwargs)

    type("Forwarding", (Backend,), {"capture": forwarding})  # forwards inputs= / outputs=: fine


def test_capture_refuses_routines_and_streams_it_cannot_use(exp: tuple[Routine, Node, Node]) -> None:
    r, _, _ = exp
    backend = r.context.device.backend
    with pytest.raises(InvalidArgumentError, match="list or tuple of linked routines"):
        backend.capture(r)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="got generator"):
        backend.capture(x for x in [r])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="capture\\(stream=\\) takes a Stream"):
        backend.capture([r], stream="s")  # type: ignore[arg-type]


def test_an_interrupt_between_two_operations_keeps_the_first_ones_arrays(
        backend: Backend, exp: tuple[Routine, Node, Node], monkeypatch: pytest.MonkeyPatch) -> None:
    r, a, out = exp
    replay = backend.capture([r], inputs=[a], outputs=[out])

    def interrupted(*args: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(r.context.device.driver, "launch", interrupted)
    stream = r.context.stream
    seq = stream.seq
    src = _values(2)
    ref = weakref.ref(src)
    with pytest.raises(KeyboardInterrupt):
        replay.replay([src], None)
    assert stream.seq == seq + 1
    del src
    gc.collect()
    assert ref() is not None or stream.done_seq > seq
    monkeypatch.undo()
    stream.synchronize()


def test_a_plans_replay_runs_what_replay_runs_and_keeps_copies_inside_their_arrays(
        backend: Backend, exp: tuple[Routine, Node, Node]) -> None:
    """``_replay_prepared`` (a Plan's arrays, checked when it made them): the same copies and
    launches as ``replay()``, one event. What could copy past an array or a node (a wrong
    count, an array of another byte size, a strided one, a read-only output) is refused
    before anything is enqueued, as are a closed replay and a finalized context."""
    r, a, out = exp
    replay = backend.capture([r], inputs=[a], outputs=[out])
    stream = r.context.stream
    got = np.empty(N, np.float32)
    seq = stream.seq
    replay._replay_prepared([_values(3)], [got]).synchronize()
    assert stream.seq == seq + 1
    np.testing.assert_allclose(got, np.exp(_values(3)), rtol=1e-6)
    replay._replay_prepared([_values(4)]).synchronize()  # in only: the node keeps the result
    np.testing.assert_allclose(r.context.read(out), np.exp(_values(4)), rtol=1e-6)
    read_only = np.empty(N, np.float32)
    read_only.flags.writeable = False
    seq = stream.seq
    for ins, outs, error in (
            ([_values(1), _values(2)], (), InvalidArgumentError),
            ((), [got, got], InvalidArgumentError),
            ([np.zeros(4 * N, np.float32)], (), ShapeMismatchError),    # 4x the node's bytes
            ([np.repeat(_values(1), 2)[::2]], (), ShapeMismatchError),  # strided
            ((), [np.empty(N // 2, np.float32)], ShapeMismatchError),
            ((), [read_only], ShapeMismatchError)):
        with pytest.raises(error):
            replay._replay_prepared(ins, outs)
    assert stream.seq == seq  # nothing was enqueued
    replay._replay_prepared((), [got]).synchronize()
    np.testing.assert_allclose(got, np.exp(_values(4)), rtol=1e-6)
    replay.close()
    with pytest.raises(FinalizedError):
        replay._replay_prepared()


def test_a_plans_replay_refuses_a_finalized_context(backend: Backend) -> None:
    a, out = Node("a", (N,)), Node("out", (N,))
    code = backend.compile(ir.Comp.of(ir.apply(Op.EXP, a, into=out)), name="exp")
    ctx = backend.get_device(0).make_context().init_from_host(a, np.zeros(N, np.float32))
    replay = backend.capture([ctx.link(code)], inputs=[a])
    ctx.finalize()
    with pytest.raises(FinalizedError):
        replay._replay_prepared([_values(0)])
    with pytest.raises(FinalizedError):  # a finalized context comes before bad arrays
        replay.replay([np.zeros(3, np.float32)])


def test_a_subclass_that_overrides_replay_gets_plans_through_it(exp: tuple[Routine, Node, Node]) -> None:
    r, a, out = exp
    calls = []

    class Counting(Replay):
        def replay(self, inputs: Any = None, outputs: Any = None) -> Any:
            calls.append((inputs, outputs))
            return super().replay(inputs, outputs)

    replay = Counting([r], inputs=[a], outputs=[out])
    got = np.empty(N, np.float32)
    replay._replay_prepared([_values(2)], [got]).synchronize()
    replay._replay_prepared().synchronize()
    assert [(len(i or ()), len(o or ())) for i, o in calls] == [(1, 1), (0, 0)]
    np.testing.assert_allclose(got, np.exp(_values(2)), rtol=1e-6)


def test_a_context_finalized_by_another_thread_mid_replay_is_a_finalized_error(
        backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the concurrency review: a plan sharing another's state replayed while its owner
    closed. The replay checked its contexts before taking the device lock, the finalize freed
    their pools in between, and the pool lookup raised InvalidProgramError ("no pool (freed?)")
    in place of FinalizedError. Here the finalize comes right after that first check."""
    from polyjit.core.context import Context

    a, out = Node("race_a", (N,)), Node("race_out", (N,))
    code = backend.compile(ir.Comp.of(ir.apply(Op.EXP, a, into=out)), name="race_exp")
    ctx = backend.get_device(0).make_context().init_from_host(a, np.zeros(N, np.float32))
    r = ctx.link(code)
    replay = backend.capture([r], inputs=[a], outputs=[out])
    check = Context.check_alive
    fired = []

    def finalized_meanwhile(self: Context) -> None:
        check(self)
        if not fired:  # the first check passes; another thread finalizes right after it
            fired.append(self)
            r.context.finalize()

    monkeypatch.setattr(Context, "check_alive", finalized_meanwhile)
    with pytest.raises(FinalizedError):
        replay.replay([_values(1)], [np.empty(N, np.float32)])
    assert fired
