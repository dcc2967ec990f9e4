"""Compiled plans: a tensor graph linked into a device context, run again and again.

A plan owns a *state context* holding the persistent buffers (parameters,
optimizer state) and the input buffers; the routines are linked as its child.
Each run copies the inputs in, enqueues the routines and copies the outputs
into host arrays allocated once. Plans of one model share parameters by
linking into the same state context (``compile(..., share=other_plan)``).

Dispatch modes: ``"compiled"`` links one fused batch on the first run and
replays it; ``"dynamic"`` runs one routine per op with every intermediate
stored (readable with ``plan.read``); ``"auto"`` runs dynamic for the first
``AUTO_DYNAMIC_STEPS`` runs, then compiles.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import numpy as np

from polyjit.core.errors import (
    FinalizedError,
    InvalidArgumentError,
    InvalidProgramError,
    NodeNotInContextError,
    ShapeMismatchError,
)
from polyjit.core.interop import Exported, dlpack_device
from polyjit.core.interrupts import whole
from polyjit.core.ir import MemoryMode, Node
from polyjit.core.runtime import Backend, Context, Device, Event, Replay, Routine
from polyjit.core.serial import serialized
from polyjit.tensor.autograd import grad, topo_order
from polyjit.tensor.devices import DeviceLike, resolve_device
from polyjit.tensor.hostio import Feed, check_names, enqueue_to_host
from polyjit.tensor.optim import Optimizer, checked_params
from polyjit.tensor.program import Program, check_tensor, named_outputs
from polyjit.tensor.sharing import join, reset_shared, state_owner, whole_state
from polyjit.tensor.state import StateContext, stage_state
from polyjit.tensor.tensor import Kind, Tensor, full

Array = np.ndarray[Any, Any]
Mode = Literal["compiled", "dynamic", "auto"]
MODES = ("compiled", "dynamic", "auto")
AUTO_DYNAMIC_STEPS = 3



class SharesState(Protocol):
    """What ``share=`` accepts: something with a device and a context holding persistent state."""

    @property
    def device(self) -> Device: ...

    @property
    def state_context(self) -> Context: ...


class _Captured:
    """A linked fused batch, captured for replay (``Backend.capture``: a CUDA graph on CUDA)
    with the inputs' copies in and the outputs' copies out, so that a run is one enqueue; a
    training step in two parts, split after the kernel that writes the loss
    (``Routine.split_after``), so that ``step()`` waits for the head's loss only while the
    backward pass and the update run (the stream keeps them in order)."""

    __slots__ = ("full", "split")

    def __init__(self, backend: Backend, routines: list[Routine], feeds: list[Node], outputs: list[Node],
                 loss: Node | None) -> None:
        self.full = backend.capture(routines, inputs=feeds, outputs=outputs)
        self.split: tuple[Replay, Replay] | None = None
        try:
            parts = routines[0].split_after(loss) if len(routines) == 1 and loss is not None else None
            if parts is not None and loss is not None:
                head, tail = parts
                first = backend.capture([head], inputs=feeds, outputs=[loss])
                try:
                    self.split = (first, backend.capture([tail]))
                except BaseException:
                    first.close()
                    raise
        except BaseException:
            self.full.close()
            raise

    def close(self) -> None:
        for replay in (self.full, *(self.split or ())):
            replay.close()


class _Linked:
    """A batch linked into the state context: a fused batch captured (:class:`_Captured`),
    dynamic mode's routines run one by one. If the capture fails, the caller finalizes the
    routines' context."""

    __slots__ = ("captured", "context", "feeds", "kind", "outputs", "routines")

    def __init__(self, kind: str, routines: list[Routine], context: Context, backend: Backend,
                 feeds: list[Node], outputs: list[Node], loss: Node | None) -> None:
        self.kind = kind
        self.routines = routines
        self.context = context
        self.feeds = feeds
        self.outputs = outputs
        compiled = kind == "compiled" and routines
        self.captured = _Captured(backend, routines, feeds, outputs, loss) if compiled else None

    def run(self, base: Context, arrays: Sequence[Array], results: Sequence[Array] | None) -> Event:
        """Copy ``arrays`` into the inputs, run, copy the outputs into ``results`` (None: leave
        them on the device); the event behind it all."""
        if self.captured is not None:
            return self.captured.full._replay_prepared(arrays, results or ())
        with whole():  # routines one by one: Ctrl-C between two would leave a training run half done
            for node, arr in zip(self.feeds, arrays):
                base.from_host(node, arr)
            for r in self.routines:
                r.run()
            ctx = self.context
            for node, arr in zip(self.outputs, results or ()):
                enqueue_to_host(ctx, node, arr)
            return ctx.stream.record()

    def step(self, base: Context, arrays: Sequence[Array], loss_node: Node, loss: Array) -> Event:
        """A training step: the event behind the loss's copy into ``loss`` (a split step's
        backward pass and update are enqueued behind it)."""
        split = self.captured.split if self.captured is not None else None
        with whole():  # Ctrl-C between the parts would leave the step half applied
            if split is None:  # the whole, then the loss's copy
                self.run(base, arrays, None)
                enqueue_to_host(self.context, loss_node, loss)
                return self.context.stream.record()
            head, tail = split
            ready = head._replay_prepared(arrays, (loss,))
            tail._replay_prepared()
        return ready

    def finalize(self) -> None:
        if self.captured is not None:
            self.captured.close()
            self.captured = None
        if self.routines:
            self.routines[0].context.finalize()


class _Slot:
    """Host arrays of one run: its inputs' staging (a pipelined run's own) and its results."""

    __slots__ = ("inputs", "result_arrays", "results")

    def __init__(self, feeds: Sequence[Feed], outputs: Sequence[tuple[str, Any, Array]]) -> None:
        self.inputs = [np.zeros_like(f.staging) for f in feeds]
        self.results = {name: np.empty_like(arr) for name, _, arr in outputs}
        self.result_arrays = list(self.results.values())


class _Written:
    """The result arrays of a pipelined call's earlier runs, which a later run's input may be
    (the previous call's results fed back): by identity, and as byte ranges sorted by start
    (the results own their memory, so the ranges are disjoint: one bisection finds the only
    range an input can overlap)."""

    def __init__(self) -> None:
        self.ids: set[int] = set()
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, arrays: list[Array]) -> None:
        for r in arrays:
            self.ids.add(id(r))
            if r.size:
                lo, hi = _byte_range(r)
                at = bisect.bisect(self.starts, lo)
                self.starts.insert(at, lo)
                self.ends.insert(at, hi)

    def overlaps(self, arr: Array) -> bool:
        if not arr.size:
            return False
        lo, hi = _byte_range(arr)
        at = bisect.bisect_left(self.starts, hi) - 1  # the last range that starts before arr ends
        return at >= 0 and self.ends[at] > lo

    def unaliased(self, arrays: list[Array], staging: list[Array]) -> list[Array]:
        """A run's input arrays, each one that overlaps an earlier run's result copied into the
        run's own staging array before the call enqueues anything: its copy to the device
        would come behind the earlier run's copy out, which overwrites it. An array the caller
        owns (or a view of one) costs one identity test."""
        out = arrays
        for k, arr in enumerate(arrays):
            owner = arr if arr.base is None else arr.base
            owned = isinstance(owner, np.ndarray) and owner.base is None and owner.flags.owndata
            if (id(owner) in self.ids) if owned else self.overlaps(arr):
                if out is arrays:
                    out = list(arrays)
                np.copyto(staging[k], arr)
                out[k] = staging[k]
        return out


def _byte_range(a: Array) -> tuple[int, int]:
    """The addresses ``[lo, hi)`` that the array's elements span (numpy's byte_bounds)."""
    lo = hi = int(a.__array_interface__["data"][0])
    for n, stride in zip(a.shape, a.strides):
        if stride < 0:
            lo += (n - 1) * stride
        else:
            hi += (n - 1) * stride
    return lo, hi + a.itemsize


def trainable_params(loss: Tensor) -> list[Tensor]:
    """The parameters a tensor depends on, in the order the graph reaches them."""
    return [t for t in topo_order([loss]) if t.kind is Kind.PARAM]


class Plan:
    """A program linked on one device. Results come back in host arrays that the plan reuses:
    copy them if you keep them past the next run."""

    def __init__(self, program: Program, device: Device, *, mode: Mode = "compiled",
                 share: SharesState | None = None) -> None:
        if mode not in MODES:
            raise InvalidProgramError(f"mode must be one of {MODES}, got {mode!r}")
        _check_share(share)
        if share is not None and share.device is not device:
            raise InvalidProgramError(f"cannot share state of {share.device.device_id} on {device.device_id}")
        self.program = program
        self.device = device
        self.backend = device.backend
        self.mode: Mode = mode
        if share is not None:
            _check_same_tensors(program, share.state_context)
        self._state = StateContext(device, share.state_context if share is not None else None)
        self._share = share  # reset() of any plan sharing one state resets the state of all
        for t in program.persistent:
            assert t.init is not None
            self._state.add(t.node, t.init)
        self._feeds = program.feeds()
        for f in self._feeds:
            self._state.add(f.node, f.staging)
        self._input_names = frozenset(f.name for f in self._feeds)
        self._outputs = [(name, t.node, np.empty(t.shape, t.dtype.np)) for name, t in program.outputs.items()]
        self._loss = next(((node, arr) for name, node, arr in self._outputs if name == "loss"), None)
        # The host arrays run() and run_pipelined() reuse, one set per calling thread: a plan
        # shared by threads must not overwrite what another thread is still reading.
        self._by_thread = threading.local()
        self._linked: _Linked | None = None
        self._lock = threading.RLock()
        self._shared = False  # whether another plan shares this one's state (share=self)
        self._closed = False
        self.runs = 0
        if share is not None:  # last: a plan whose construction failed shares nothing
            join(self, share)

    # -- contexts --------------------------------------------------------------------

    @property
    def state_context(self) -> Context:
        """The context with the persistent buffers and the inputs (what other plans link into)."""
        return self._state.context

    @property
    def context(self) -> Context:
        """The context the routines run in (the state context before the first run)."""
        return self._linked.context if self._linked is not None else self._state.context

    @property
    def input_names(self) -> list[str]:
        return [f.name for f in self._feeds]

    def _check_open(self, call: str) -> None:
        """Refuse ``call`` (``"run()"``, ...) on a closed plan, or on one whose shared state
        (``share=``) was freed, by the name of what was called."""
        if self._closed:
            raise FinalizedError(f"{self!r}: {call} after close(): its device memory was freed; "
                                 "compile a new plan")
        if self._state.context.finalized:
            raise FinalizedError(f"{self!r}: {call} after the plan (or data_parallel) whose state it "
                                 "shares (share=) was closed, which freed that state; compile a new plan")

    def _kind(self) -> str:
        if self.mode == "dynamic" or (self.mode == "auto" and self.runs < AUTO_DYNAMIC_STEPS):
            return "dynamic"
        return "compiled"

    def _routines(self) -> list[Routine]:
        kind = self._kind()
        linked = self._linked
        if linked is None or linked.kind != kind:
            linked = self._link(kind)
        return linked.routines

    def _link(self, kind: str) -> _Linked:
        """Compile (cached per backend) and link; the routines of an earlier kind are freed
        once the new ones are linked and captured (if that fails, the plan keeps the old)."""
        batch = self.program.batch(self.backend, kind)
        routines = self._state.context.link_batch(batch)
        try:
            linked = _Linked(kind, routines, routines[0].context if routines else self._state.context,
                             self.backend, [f.node for f in self._feeds],
                             [node for _, node, _ in self._outputs], self._loss[0] if self._loss else None)
        except BaseException:
            if routines:
                routines[0].context.finalize()
            raise
        if self._linked is not None:
            self._linked.finalize()
        self._linked = linked
        return linked

    @serialized
    def build(self) -> Plan:
        """Compile and link now rather than on the first run; returns the plan."""
        self._check_open("build()")
        self._routines()
        return self

    # -- running ---------------------------------------------------------------------

    def _prepare(self, inputs: Mapping[str, Any], slot: _Slot | None) -> list[Array]:
        """The host arrays of one run, every value checked: nothing is copied if one is refused."""
        check_names(inputs, self._input_names, "plan inputs")
        return [f.host_array(inputs[f.name], None if slot is None else slot.inputs[k])
                for k, f in enumerate(self._feeds)]

    def _prepare_own(self, inputs: Mapping[str, Any]) -> list[Array]:
        """Host arrays of one run that no later call reuses and the caller cannot change: for a
        run nothing waits for (run_on_device), whose input copies may run after it returns."""
        check_names(inputs, self._input_names, "plan inputs")
        arrays = []
        for f in self._feeds:
            mine = np.empty_like(f.staging)
            arr = f.host_array(inputs[f.name], mine)
            if arr is not mine:  # the caller's own array, which fits: copied into ours
                np.copyto(mine, arr)
            arrays.append(mine)
        return arrays

    def _run(self, arrays: Sequence[Array], results: Sequence[Array] | None) -> Event:
        self._routines()
        assert self._linked is not None
        ready = self._linked.run(self._state.context, arrays, results)
        self.runs += 1
        return ready

    def _mine(self) -> _Slot:
        """The calling thread's result arrays (and pipelined slots), made on its first run."""
        mine: _Slot | None = getattr(self._by_thread, "results", None)
        if mine is None:
            mine = self._by_thread.results = _Slot((), self._outputs)
            self._by_thread.slots = []
        return mine

    @whole_state
    def run(self, **inputs: Any) -> dict[str, Array]:
        """One run: returns every output, in arrays this plan reuses on the calling thread's
        next run."""
        self._check_open("run()")
        mine = self._mine()
        self._run(self._prepare(inputs, None), mine.result_arrays).synchronize()
        return dict(mine.results)  # a new dict each run (the arrays are reused): the caller may edit it

    @whole_state
    def run_on_device(self, **inputs: Any) -> dict[str, Exported]:
        """One run whose outputs stay on the device: zero-copy views of the output buffers
        (DLPack; ``np.from_dlpack``, ``torch.from_dlpack``), which show the values of this run
        until the next run writes them."""
        self._check_open("run_on_device()")
        dlpack_device(self._state.context)  # refused before anything runs (OpenCL has no export)
        self._run(self._prepare_own(inputs), None)
        ctx = self.context
        return {name: ctx.export(node) for name, node, _ in self._outputs}

    @whole_state
    def step(self, **inputs: Any) -> float:
        """One training step (forward, backward, update); returns the loss.

        It returns once the loss is computed: the backward pass and the update may still be
        running, in order before anything enqueued later (the next step, ``read``,
        ``state_dict``: each waits for the buffers it touches). ``synchronize()`` waits for
        them."""
        self._check_open("step()")
        if self._loss is None:
            raise InvalidProgramError("step() needs a plan compiled with loss=...")
        arrays = self._prepare(inputs, None)
        self._routines()
        assert self._linked is not None
        node, loss = self._loss
        ready = self._linked.step(self._state.context, arrays, node, loss)
        self.runs += 1
        ready.synchronize()
        return float(loss)

    def synchronize(self) -> None:
        """Wait for all the work this plan enqueued (the last step's update, too)."""
        self.context.stream.synchronize()

    @whole_state
    def run_pipelined(self, runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Array]]:
        """Enqueue several runs back to back and synchronize once; one result dict per run
        (host arrays reused by the calling thread's next pipelined call)."""
        self._check_open("run_pipelined()")
        if isinstance(runs, (str, bytes, Mapping)) or not isinstance(runs, Sequence):
            raise InvalidArgumentError(f"run_pipelined takes a list of input mappings (one per run), "
                                       f"not {type(runs).__name__}")
        self._mine()
        slots: list[_Slot] = self._by_thread.slots
        while len(slots) < len(runs):
            slots.append(_Slot(self._feeds, self._outputs))
        prepared = [self._prepare(inputs, slot) for inputs, slot in zip(runs, slots)]
        written = _Written()  # the result arrays of the earlier runs
        for k, slot in enumerate(slots[: len(runs)]):  # all before the first run is enqueued
            if k:
                prepared[k] = written.unaliased(prepared[k], slot.inputs)
            written.add(slot.result_arrays)
        for arrays, slot in zip(prepared, slots):
            self._run(arrays, slot.result_arrays)
        self.context.stream.synchronize()
        return [dict(slot.results) for slot in slots[: len(runs)]]

    # -- state -----------------------------------------------------------------------

    def reset(self) -> None:
        """Put every parameter and optimizer state back to its initial value: this plan's, and
        when plans share state (``share=``), those of every plan sharing it (a training plan's
        optimizer state too, when an evaluation plan sharing its parameters is reset), and of
        the ``data_parallel`` they share, on all its replicas. It takes the locks of all those
        plans (in one order), so no step of any of them is half enqueued meanwhile."""
        self._check_open("reset()")
        owner = state_owner(self)
        if isinstance(owner, Plan):
            reset_shared(owner)
        else:
            owner.reset()  # a data_parallel's: every replica, then reset_shared

    @whole_state
    def state_dict(self) -> dict[str, Array]:
        """Copies of the persistent buffers (parameters, optimizer state), by name."""
        self._check_open("state_dict()")
        return self._state.state_dict(self.program.persistent)

    @whole_state
    def load_state_dict(self, values: Mapping[str, Any], strict: bool = True) -> None:
        """Set parameters and optimizer state from arrays by name (what ``state_dict()`` gives).

        Every entry is checked before anything is written: the shape must be the tensor's
        (``ShapeMismatchError``), the values must convert to its dtype the way inputs do
        (``DTypeMismatchError``, ``ValueRangeError``), and with ``strict`` the names must be
        exactly the plan's (``StateDictKeyError``); without it, unknown and missing names are
        skipped. On an error nothing has changed.
        """
        self._check_open("load_state_dict()")
        owner = state_owner(self)
        if isinstance(owner, Plan):  # one copy of the state, whoever owns it
            self._state.load_state_dict(self.program.persistent, values, strict, "this plan")
            return
        # A data_parallel's: what it shares goes to every replica (found by review: it went to
        # replica 0 only, and the replicas stayed apart for good); this plan's own state here.
        self._state.context.check_alive()
        replicated = {t.node for t in owner.persistent}
        staged: list[tuple[Tensor, Array]] = []

        def shared() -> list[tuple[Tensor, Array]]:  # checked inside write_state: with comm, collective
            staged.extend(stage_state(self.program.persistent, values, strict, "this plan"))
            return [(t, a) for t, a in staged if t.node in replicated]

        owner.write_state(shared)
        self._state.write([(t, a) for t, a in staged if t.node not in replicated])

    @whole_state
    def read(self, tensor: Tensor) -> Array:
        """The current value of a stored tensor: outputs and state; every op's result in dynamic mode."""
        self._check_open("read()")
        if not isinstance(tensor, Tensor):
            raise InvalidArgumentError(f"Plan.read takes a Tensor (run() returns outputs by name), "
                                       f"not {type(tensor).__name__}")
        try:
            return self.context.read(tensor.node)
        except NodeNotInContextError:
            raise NodeNotInContextError(
                f"{tensor!r} is not stored in this plan's context (in compiled mode intermediates are "
                "inlined or scratch; compile with mode='dynamic' to read them)"
            ) from None

    # -- introspection ------------------------------------------------------------------

    @property
    def source(self) -> str:
        """The generated source of the batch in use (the fused one before the first run)."""
        kind = self._linked.kind if self._linked is not None else "compiled"
        return self.program.batch(self.backend, kind).source.text

    def memory_modes(self) -> dict[str, MemoryMode]:
        """The inferred memory mode of every node the fused batch writes, by label."""
        batch = self.program.batch(self.backend, "compiled")
        return {node.label: mode for node, mode in batch.lowered.modes.items()}

    @serialized
    def close(self) -> None:
        """Free the device memory this plan allocated (plans sharing its state become unusable)."""
        if self._linked is not None:
            self._linked.finalize()
            self._linked = None
        self._state.close()
        self._closed = True

    def __enter__(self) -> Plan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Plan({self.program.name} on {self.device.device_id}, mode={self.mode}, "
                f"{len(self.program.steps)} ops, {self.runs} runs)")


def _loss_scale(value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidProgramError(f"loss_scale must be a number, got {value!r}")
    v = float(value)
    if not (np.isfinite(v) and v > 0):
        raise InvalidProgramError(f"loss_scale must be finite and > 0, got {value!r}")
    return v


def _check_same_tensors(program: Program, shared: Context) -> None:
    """A plan shares state by tensor, not by name: a parameter of this program named as one of
    the shared state's, but another tensor (a model built again), would get a buffer of its
    own, initialized afresh, and the plan would never see the training (found by review: no
    error, and the state then held two buffers of one name)."""
    held = {node.name: node for node in shared.buffers}
    for t in program.persistent:
        other = held.get(t.node.name)
        if other is not None and other is not t.node:
            raise InvalidProgramError(
                f"share=: this program's {t.name!r} is another tensor than the shared state's {t.name!r} (a "
                "model built again?); plans share state through the same tensors: build both from one model")


def _check_share(share: Any) -> None:
    if share is not None and not (isinstance(getattr(share, "device", None), Device)
                                  and isinstance(getattr(share, "state_context", None), Context)):
        raise InvalidArgumentError(f"share= takes a Plan (something with a device and a state_context), "
                                   f"not {type(share).__name__}")


def compile(
    outputs: Tensor | Sequence[Tensor] | Mapping[str, Tensor] | None = None,
    *,
    loss: Tensor | None = None,
    optimizer: Optimizer | None = None,
    params: Sequence[Tensor] | None = None,
    device: DeviceLike = None,
    mode: Mode = "compiled",
    share: SharesState | None = None,
    name: str = "plan",
    loss_scale: float = 1.0,
) -> Plan:
    """Turn a tensor graph into a :class:`Plan` on a device.

    ``outputs``: tensors to return from ``run()``. ``loss``: a scalar returned
    as ``"loss"`` (and by ``step()``). ``optimizer``: also compute the gradients
    of the loss with respect to ``params`` (default: every parameter it depends
    on) and update them in place, so that one ``step()`` is forward, backward and
    update in one routine batch. ``share``: link into another plan's state
    context, reusing its parameters (no copies). ``loss_scale``: the gradients are those of
    ``loss * loss_scale``, divided by it again in the parameters' dtype before the update
    (static loss scaling for mixed precision: small half gradients then stay above
    float16's subnormals; an overflow to inf makes the step's update inf, so keep it modest).
    """
    named = named_outputs(outputs)
    _check_share(share)
    if mode not in MODES:  # checked before an optimizer builds its updates (and locks its settings)
        raise InvalidProgramError(f"mode must be one of {MODES}, got {mode!r}")
    dev = share.device if device is None and share is not None else resolve_device(device)
    if loss is not None:
        check_tensor(loss, "loss")
        if loss.shape != ():
            raise ShapeMismatchError(f"the loss must be a scalar (0-d) tensor, got {loss!r}; "
                                     "reduce it first (.mean() or .sum())")
        if named.get("loss", loss) is not loss:
            raise InvalidProgramError("an output is named 'loss' but is not the loss")
        named["loss"] = loss
    if optimizer is None:
        if loss_scale != 1.0:
            raise InvalidProgramError("loss_scale scales the gradients of an optimizer step: it needs an optimizer")
        return Plan(Program(named, [], name=name), dev, mode=mode, share=share)
    if loss is None:
        raise InvalidProgramError("an optimizer needs a loss")
    wrt = checked_params(params) if params is not None else trainable_params(loss)
    scale = _loss_scale(loss_scale)
    seed = None if scale == 1.0 else full((), scale, loss.dtype, name="loss_scale")
    grads = grad(loss, wrt, seed=seed)
    # The optimizer's settings are locked once its updates are in a plan. Under its lock, so
    # that another thread's compile or setting does not land between the build and the plan.
    with optimizer._lock:
        was_built = optimizer._built
        writes = optimizer.updates(wrt, grads, grad_scale=1.0 / scale)
        # Every gradient is of the parameters before the step: computed before the first write
        # (computed lazily instead, a gradient that reads a parameter updated earlier in the list
        # read its new value: ``z = (y @ v) @ w1 + x @ w0`` stepped wrong for half of the orders
        # of ``params``). Last parameter first, the order backprop finishes them in: the last
        # layers' small kernels run while the host thread is back in Python after the loss, and
        # the first layer's large weight gradient, which that thread helps with on the CPU, comes
        # last (the MLP step: 0.977 of its time; docs/benchmarks.md, session 15).
        try:
            return Plan(Program(named, writes, name=name, computed_first=grads[::-1]), dev, mode=mode, share=share)
        except BaseException:  # no plan was made: the settings are as free as they were
            optimizer._built = was_built
            raise
