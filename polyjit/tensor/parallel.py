"""Data parallelism: one replica of a training step per device, gradients all-reduced through
merge buffers.

Each step, every device runs the forward and backward pass on its shard of the
batch and packs its gradients into one flat buffer. A tree reduction sums the
buffers in ceil(log2 n) rounds (in round r, device i receives device i + 2**r's
buffer into its merge buffer with ``device_to_device(..., MergeBuffer.COPY)``
and adds ``ir.merge(g)`` into its own), then the sum travels back down the
same tree. Every replica applies the identical update to identical state, so
the replicas stay equal without ever exchanging parameters.

Across processes (``comm=``, a ``polyjit.distributed.Comm`` or an mpi4py communicator) the
all-reduce is hierarchical: the tree inside each rank as above, then one MPI all-reduce of
rank-sum buffers among the ranks (``Comm.all_reduce`` on replica 0's context, ordered by the
per-node events), then the global sum travels back down each rank's tree. The global batch
splits into ``ranks * devices`` equal contiguous shards: rank r takes rows
``[r * B / R, (r + 1) * B / R)`` and its device d the d-th shard of those (shard ``r * D + d``).
"""

from __future__ import annotations

import math
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from polyjit.core import ir
from polyjit.core.dtypes import DType, as_dtype, is_int
from polyjit.core.errors import (
    DTypeMismatchError,
    FinalizedError,
    InvalidArgumentError,
    InvalidProgramError,
    PolyjitError,
    ShapeMismatchError,
    UnknownDeviceError,
)
from polyjit.core.interrupts import whole
from polyjit.core.protocol import MergeBuffer
from polyjit.core.runtime import (
    Backend,
    CodeBatch,
    Context,
    Device,
    Replay,
    Routine,
    TransferRoutine,
    device_to_device,
)
from polyjit.core.serial import serialized
from polyjit.tensor import ops
from polyjit.tensor.autograd import grad
from polyjit.tensor.devices import DeviceLike, resolve_devices
from polyjit.tensor.hostio import Feed, check_names
from polyjit.tensor.optim import Optimizer, checked_params
from polyjit.tensor.plan import trainable_params
from polyjit.tensor.program import Program
from polyjit.tensor.sharing import reset_shared
from polyjit.tensor.state import StateContext, stage_state
from polyjit.tensor.tensor import DTypeLike, Tensor, input

if TYPE_CHECKING:
    from polyjit.distributed.comm import Comm
    from polyjit.distributed.data_parallel import RankReduce

Array = np.ndarray[Any, Any]
InputSpec = tuple[Sequence[int], DTypeLike]


def tree_rounds(n: int) -> list[list[tuple[int, int]]]:
    """The reduction rounds over n replicas: (receiver, sender) pairs; device 0 ends with the sum."""
    rounds = []
    stride = 1
    while stride < n:
        rounds.append([(i, i + stride) for i in range(0, n, 2 * stride) if i + stride < n])
        stride *= 2
    return rounds


class _Replica:
    """One device's contexts, staging arrays and routines."""

    def __init__(self, device: Device, loss: ir.Node) -> None:
        self.device = device
        self.state = StateContext(device)
        self.feeds: list[Feed] = []
        self.loss = np.zeros(loss.shape, loss.dtype.np)
        self.compute: Routine | None = None
        self.update: Routine | None = None
        # what a step runs: the two routines captured (one CUDA graph each on CUDA)
        self.compute_replay: Replay | None = None
        self.update_replay: Replay | None = None
        self.linked: Context = self.state.context


class DataParallel:
    """A training step replicated on several devices. Build it with :func:`data_parallel`."""

    def __init__(
        self,
        model_step: Callable[..., Tensor],
        inputs: Mapping[str, InputSpec],
        *,
        optimizer: Optimizer,
        devices: Sequence[DeviceLike] | Backend | str | None = None,
        params: Sequence[Tensor] | None = None,
        name: str = "dp",
        comm: Any = None,
    ) -> None:
        self._lock = threading.RLock()  # threads that share it take turns (state.serialized)
        if not isinstance(name, str):
            raise InvalidArgumentError(f"data_parallel's name is a str, not {type(name).__name__}")
        self.devices = resolve_devices(devices)
        n = len(self.devices)
        self._rank_reduce: RankReduce | None = _rank_reduce(comm)
        self.comm: Comm | None = self._rank_reduce.comm if self._rank_reduce is not None else None
        self.ranks = self.comm.size if self.comm is not None else 1
        self.rank = self.comm.rank if self.comm is not None else 0
        try:
            self._build(model_step, inputs, optimizer, params, name, n)
        except BaseException:  # a Comm made here is freed (found by review: a refused set-up kept it)
            if self._rank_reduce is not None:
                self._rank_reduce.close()
            raise

    def _build(self, model_step: Callable[..., Tensor], inputs: Mapping[str, InputSpec], optimizer: Optimizer,
               params: Sequence[Tensor] | None, name: str, n: int) -> None:
        """The rest of the constructor: the programs, the replicas, their routines."""
        problem: PolyjitError | None = None
        specs: dict[str, tuple[tuple[int, ...], DType]] = {}
        try:
            specs = _batch_inputs(inputs)
            sizes = {int(shape[0]) for shape, _ in specs.values()}
            if len(sizes) != 1:
                raise ShapeMismatchError(f"every input needs the same batch size (axis 0), got {sorted(sizes)}")
            self.batch_size = sizes.pop()
        except PolyjitError as e:
            problem = e
        total = n * self.ranks
        if self._rank_reduce is not None and self.comm is not None:
            # every rank must build the same thing: a refusal on one rank is one on all (found
            # by review: the others waited out their timeout in the check below)
            problem = problem or self._rank_reduce.claim(self, name)
            if problem is not None:
                self.comm.refuse(problem, "check")
            self.comm.check_same("data_parallel set-up (devices per rank, global batch, name's hash)",
                                 [n, self.batch_size, zlib.crc32(name.encode())])
        if problem is not None:
            raise problem
        if self.batch_size == 0:
            raise ShapeMismatchError(f"a batch of 0 rows (inputs {', '.join(sorted(specs))}): each device needs "
                                     "a shard of at least one row")
        if self.batch_size % total:
            over = f"{n} devices" + (f" x {self.ranks} ranks" if self.comm is not None else "")
            raise ShapeMismatchError(f"a batch of {self.batch_size} does not split evenly over {over}")
        self.shard = self.batch_size // total
        self.rank_rows = self.batch_size // self.ranks  # the rows of one rank
        local = {k: input(k, (self.shard, *tuple(shape)[1:]), dt) for k, (shape, dt) in specs.items()}
        loss = model_step(**local)
        if not isinstance(loss, Tensor) or loss.shape != ():
            raise InvalidProgramError("model_step must return the loss: a scalar Tensor (the mean over its shard)")
        self.params = checked_params(params) if params is not None else trainable_params(loss)
        if not self.params:
            raise InvalidProgramError(f"data_parallel {name!r}: nothing to train (params is empty, or the loss "
                                      "depends on no parameter)")
        if len({p.dtype for p in self.params}) > 1:
            raise DTypeMismatchError("data_parallel packs the gradients into one buffer: use one dtype")
        grads = grad(loss, self.params)
        pieces = [ops.reshape(g, (-1,)) for g in grads]
        if self.comm is not None:  # the loss rides along: one all-reduce gives the global loss too
            dtype = self.params[0].dtype
            pieces.append(ops.reshape(loss if loss.dtype == dtype else ops.cast(loss, dtype), (1,)))
        # with comm, a node of its own (the loss rides along) named by the model: the ranks'
        # all-reduce headers tell models over one Comm apart by it
        flat = ops.concat(pieces, name=f"{name}_grads").named("grads")
        self.grads_node = flat.node
        self.loss_node = loss.node
        # The update reads the packed (all-reduced) gradients as a leaf: its computation is elsewhere.
        leaf = Tensor(flat.node, name="grads", requires_grad=False)
        views, offset = [], 0
        for p in self.params:
            views.append(ops.flat_view(leaf, offset, p.shape, name=f"grad_{p.name}"))
            offset += p.size
        self.compute_program = Program({"loss": loss, "grads": flat}, name=f"{name}_grad")
        self.update_program = Program({}, optimizer.updates(self.params, views, grad_scale=1.0 / total),
                                      name=f"{name}_update")
        self.persistent = _union(self.compute_program.persistent, self.update_program.persistent)
        # Declared inputs the model does not read are still taken (and their shapes checked).
        self._input_names = frozenset(specs)
        read = {t.name for t in self.compute_program.inputs}
        self._unread = {k: v for k, v in specs.items() if k not in read}
        g = self.grads_node
        self._reduce_comp = ir.Comp.of(ir.apply(ir.Op.ADD, g, ir.merge(g), into=g), embedded=[g])
        self._batches: dict[int, tuple[CodeBatch, CodeBatch]] = {}
        self.replicas = [_Replica(d, self.loss_node) for d in self.devices]
        self._setup()
        self.rounds = tree_rounds(n)
        self._reduce: list[tuple[TransferRoutine, Routine]] = []
        self._broadcast: list[TransferRoutine] = []
        self._link_allreduce()
        self.steps = 0
        self._closed = False
        self.timings: dict[str, list[float]] = {"compute": [], "allreduce": [], "update": []}
        if self.comm is not None:
            self.timings["mpi"] = []  # the MPI all-reduce alone (inside "allreduce")
        self._global_loss: float | None = None
        self._take_rank_0_state()

    def _take_rank_0_state(self) -> None:
        """With ``comm``: every rank's replicas take rank 0's parameters and optimizer state
        (a collective call), as PyTorch's DistributedDataParallel starts. Found by review: ranks
        whose parameters started apart (a seed per rank) trained apart, and reported one loss."""
        if self.comm is not None:
            mine = self.replicas[0].state.state_dict(self.persistent)
            self._write_from_rank_0([(t, mine[t.name]) for t in self.persistent])

    def _write_from_rank_0(self, staged: Sequence[tuple[Tensor, Array]]) -> None:
        """Write checked host arrays into every replica's buffers; with ``comm``, rank 0's: the
        ranks agree on the tensors (names, shapes, dtypes: found by review, other optimizers'
        states paired apart), then one broadcast of their bytes."""
        if self.comm is not None:
            layout = "\0".join(f"{t.name}:{a.shape}:{a.dtype.name}" for t, a in staged)
            self.comm.check_same("the state to write (a hash of its names, shapes and dtypes)",
                                 [zlib.crc32(layout.encode())])
            packed = np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for _, a in staged]) \
                if staged else np.empty(0, np.uint8)
            packed = self.comm.broadcast_array(packed, 0)
            offset, agreed = 0, []
            for t, a in staged:
                agreed.append((t, packed[offset:offset + a.nbytes].view(a.dtype).reshape(a.shape)))
                offset += a.nbytes
            staged = agreed
        for rep in self.replicas:
            rep.state.write(staged)

    # -- setup ------------------------------------------------------------------------

    def _compiled(self, backend: Backend) -> tuple[CodeBatch, CodeBatch]:
        hit = self._batches.get(id(backend))
        if hit is None:
            main = backend.compile_batch(
                [self.compute_program.compiled_comp(), self.update_program.compiled_comp()],
                names=[self.compute_program.name, self.update_program.name],
            )
            reduce = backend.compile_batch([self._reduce_comp], names=["allreduce_add"])
            hit = self._batches[id(backend)] = (main, reduce)
        return hit

    def _setup(self) -> None:
        for rep in self.replicas:
            for t in self.persistent:
                assert t.init is not None
                rep.state.add(t.node, t.init)
            for feed in self.compute_program.feeds():
                rep.feeds.append(feed)
                rep.state.add(feed.node, feed.staging)
            main, _ = self._compiled(rep.device.backend)
            rep.compute, rep.update = rep.state.context.link_batch(main)
            rep.linked = rep.compute.context
            backend = rep.device.backend
            rep.compute_replay = backend.capture([rep.compute], inputs=[f.node for f in rep.feeds])
            rep.update_replay = backend.capture([rep.update], outputs=[self.loss_node])

    def _link_allreduce(self) -> None:
        reps, g = self.replicas, self.grads_node
        for pairs in self.rounds:
            for dst, src in pairs:
                xfer = device_to_device(g, dst=reps[dst].linked, src=reps[src].linked,
                                        into_merge_buffer=MergeBuffer.COPY)
                assert xfer is not None
                _, reduce = self._compiled(reps[dst].device.backend)
                (add,) = xfer.context.link_batch(reduce)
                self._reduce.append((xfer, add))
        for pairs in reversed(self.rounds):
            for dst, src in pairs:  # the sum goes back down: the receiver of a round sends
                back = device_to_device(g, dst=reps[src].linked, src=reps[dst].linked)
                if back is not None:
                    self._broadcast.append(back)
        for rep in reps:
            rep.device.synchronize()

    # -- stepping -----------------------------------------------------------------------

    @property
    def device(self) -> Device:
        return self.devices[0]

    @property
    def state_context(self) -> Context:
        """Replica 0's context with the parameters: ``compile(..., share=dp)`` links there."""
        return self.replicas[0].state.context

    def _compute(self, inputs: Mapping[str, Any], sync: bool = False) -> None:
        check_names(inputs, self._input_names, "data_parallel inputs")
        s = self.shard
        first = {f.name: self._first_row(f.name, f.node.shape, f.node.dtype, inputs[f.name])
                 for f in self.replicas[0].feeds}  # per input: the row of the given array where this rank's rows begin
        for key, (shape, dt) in self._unread.items():
            self._first_row(key, shape, dt, inputs[key])
        base = self.rank * self.rank_rows  # row numbers in messages are rows of the global batch
        # Every shard is checked (dtype, range, class labels) before anything is copied.
        arrays = [[f.host_array(inputs[f.name][first[f.name] + k * s : first[f.name] + (k + 1) * s],
                                row0=base + k * s) for f in rep.feeds]
                  for k, rep in enumerate(self.replicas)]
        for rep, shards in zip(self.replicas, arrays):
            assert rep.compute_replay is not None
            rep.compute_replay.replay(shards)  # the shards' copies and the routine: one enqueue
        if sync:
            self._sync()

    def _first_row(self, key: str, shape: Sequence[int], dt: DType, value: Any) -> int:
        """Where this rank's rows begin in the array given for input ``key``: the global batch,
        or with ``comm`` this rank's slice of it; any other shape is refused."""
        try:
            got = np.shape(value)
        except ValueError as e:  # a ragged nested list
            raise ShapeMismatchError(f"input {key!r}: {e}") from None
        want = (self.batch_size, *shape[1:])
        if got == want:
            return self.rank * self.rank_rows
        if self.comm is not None and got == (self.rank_rows, *shape[1:]):
            return 0  # this rank's slice only
        if self.comm is not None:
            raise ShapeMismatchError(f"input {key!r} ({dt}): got shape {got}, expected {want} (the global batch) "
                                     f"or {(self.rank_rows, *shape[1:])} (rank {self.rank}'s slice of it)")
        raise ShapeMismatchError(f"input {key!r} ({dt}): got shape {got}, expected {want} (the global batch)")

    def _guarded(self, local: Callable[[], None]) -> None:
        """Run this rank's part of a step before the all-reduce between the ranks. With
        ``comm``, an error there (an input that fails its checks on this rank only, a device
        fault) is told to the other ranks before it is raised: this rank joins the step's
        all-reduce with its refusal flag (Comm.refuse), so every rank raises in the same step
        (the others CollectiveRefusedError naming it), none applies an update, and the
        replicas stay in step."""
        if self.comm is None:
            local()
            return
        try:
            local()
        except Exception as e:
            self.comm.refuse(e, "all_reduce", self.grads_node)

    def _tree_up(self) -> None:
        for xfer, add in self._reduce:
            # the copy into the receiver's merge buffer and the add that reads it, as one: another
            # data_parallel (or any thread) on the device copies into that buffer too
            with add.context.device.merge_lock:
                xfer.run()
                add.run()

    def _allreduce(self, profile: bool = False) -> None:
        self._guarded(self._tree_up)
        if self._rank_reduce is not None:
            t0 = time.perf_counter()
            self._global_loss = None
            self._rank_reduce(self.replicas[0].linked, self.grads_node, self._peek_loss)
            if profile:
                self.timings["mpi"].append(time.perf_counter() - t0)
        for back in self._broadcast:
            back.run()

    def _peek_loss(self, reduced: Array) -> None:
        """The global sum of the replicas' losses: the last element of the reduced buffer."""
        self._global_loss = float(reduced[-1])

    def _update(self) -> float:
        peeked = self._global_loss
        with whole():  # every replica's update or none: Ctrl-C between two would part them for good
            for rep in self.replicas:
                assert rep.update_replay is not None
                rep.update_replay.replay(None, None if peeked is not None else [rep.loss])  # and the loss out
        total = 0.0
        for rep in self.replicas:
            rep.linked.stream.synchronize()
            total += float(rep.loss) if peeked is None else 0.0
        self.steps += 1
        if self.comm is None:
            return total / len(self.replicas)
        if peeked is None:  # the reduced buffer stayed in device memory (CUDA-aware MPI)
            total = float(self.comm.all_reduce_array(np.array([total]), "sum")[0])
        else:
            total = peeked
        return total / (len(self.replicas) * self.ranks)

    @serialized
    def step(self, **inputs: Any) -> float:
        """One data-parallel training step on a global batch; returns the mean loss. With
        ``comm``, an error on one rank before the all-reduce between the ranks is raised on
        every rank in this step: that rank's own error there, CollectiveRefusedError naming it
        elsewhere; no replica applies the step."""
        self._check_open("step()")
        self._guarded(lambda: self._compute(inputs))
        self._allreduce()
        return self._update()

    @serialized
    def step_profiled(self, **inputs: Any) -> float:
        """Like step(), with a sync between phases; the times go to ``self.timings``."""
        self._check_open("step_profiled()")
        t0 = time.perf_counter()
        self._guarded(lambda: self._compute(inputs, sync=True))
        t1 = time.perf_counter()
        self._allreduce(profile=True)
        self._sync()
        t2 = time.perf_counter()
        loss = self._update()
        t3 = time.perf_counter()
        for key, dt in (("compute", t1 - t0), ("allreduce", t2 - t1), ("update", t3 - t2)):
            self.timings[key].append(dt)
        return loss

    def _sync(self) -> None:
        for rep in self.replicas:
            rep.linked.stream.synchronize()

    # -- state ----------------------------------------------------------------------------

    @serialized
    def state_dict(self, replica: int = 0) -> dict[str, Array]:
        """Parameters and optimizer state of one replica, by name."""
        self._check_open("state_dict()")
        return self._replica(replica).state.state_dict(self.persistent)

    @serialized
    def load_state_dict(self, values: Mapping[str, Any], strict: bool = True) -> None:
        """Set parameters and optimizer state on every replica (checked as Plan.load_state_dict
        checks them: on an error nothing has changed). With ``comm``, a collective call: every
        rank ends with rank 0's values."""
        self._check_open("load_state_dict()")
        self.write_state(lambda: stage_state(self.persistent, values, strict, "this data_parallel"))

    @serialized
    def write_state(self, stage: Callable[[], Sequence[tuple[Tensor, Array]]]) -> None:
        """Copy the host arrays that ``stage()`` checks and converts (``state.stage_state``)
        into every replica's buffers (a plan sharing this state loads through here). With
        ``comm``, collective, as load_state_dict: where ``stage()`` fails on one rank, nothing
        is written anywhere, that rank raises its error and the others CollectiveRefusedError."""
        self._check_open("load_state_dict()")
        try:
            staged = stage()
        except PolyjitError as e:
            if self.comm is not None:
                self.comm.refuse(e, "check")
            raise
        self._write_from_rank_0(staged)

    @serialized
    def parameters(self, replica: int = 0) -> dict[str, Array]:
        self._check_open("parameters()")
        return self._replica(replica).state.state_dict(self.params)

    def _check_open(self, call: str) -> None:
        """Refuse ``call`` on a closed data_parallel by the name of what was called, as a
        Plan's calls are (its replicas' memory was freed)."""
        if self._closed:
            raise FinalizedError(f"{self!r}: {call} after close(): its replicas' device memory was freed; "
                                 "make a new data_parallel")

    def _replica(self, k: int) -> _Replica:
        n = len(self.replicas)
        if not is_int(k) or not -n <= k < n:
            raise UnknownDeviceError(f"replica {k!r}: this data_parallel has {n} replicas (0..{n - 1})")
        return self.replicas[k]

    @serialized
    def rank_spread(self) -> float:
        """The largest difference of any parameter between the ranks (0.0: equal; NaN when a
        parameter is NaN on any rank: MPI's max and min may drop a NaN, so it is counted
        apart); a collective call with ``comm`` (every rank calls it), 0.0 without."""
        self._check_open("rank_spread()")
        if self.comm is None:
            return 0.0
        diffs, nan = [0.0], False
        for value in self.parameters(0).values():
            flat = value.reshape(-1).astype(np.float64)
            nan = nan or bool(np.isnan(flat).any())
            hi = self.comm.all_reduce_array(flat, "max")
            lo = self.comm.all_reduce_array(flat, "min")
            diffs.append(_gap(hi, lo))
        if self.comm.all_reduce_array(np.array(nan), "max").any():
            return math.nan
        return float(np.max(diffs))

    @serialized
    def replica_spread(self) -> float:
        """The largest difference of any parameter between replica 0 and another of this
        process (0.0: equal; NaN when a parameter of any replica is NaN);
        :meth:`rank_spread` compares the ranks."""
        self._check_open("replica_spread()")
        ref = self.parameters(0)
        diffs = [0.0]
        for k in range(len(self.replicas)):  # replica 0 against itself: NaN where it holds one
            diffs += [_gap(value, ref[name]) for name, value in self.parameters(k).items()]
        return float(np.max(diffs))

    @serialized
    def reset(self) -> None:
        """Put the parameters and optimizer state back to their initial values on every
        replica (with ``comm``, a collective call: rank 0's), and the state of every plan
        compiled with ``share=`` this (their own parameters and optimizer state)."""
        self._check_open("reset()")

        def replicas() -> None:
            for rep in self.replicas:
                rep.state.reset(self.persistent)
            self._take_rank_0_state()
        reset_shared(self, replicas)

    @serialized
    def close(self) -> None:
        """Release the replicas' memory and routines; with ``comm`` given as an mpi4py
        communicator, free the Comm made from it (every rank closes)."""
        first = not self._closed
        self._closed = True
        for rep in self.replicas:
            rep.device.synchronize()
            for replay in (rep.compute_replay, rep.update_replay):
                if replay is not None:
                    replay.close()
            rep.linked.finalize()
            rep.state.close()
        if first and self._rank_reduce is not None:
            self._rank_reduce.close()

    def __enter__(self) -> DataParallel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        ids = ", ".join(d.device_id for d in self.devices)
        ranks = f", rank {self.rank} of {self.ranks}" if self.comm is not None else ""
        return (f"DataParallel([{ids}]{ranks}, batch {self.batch_size}, {len(self.params)} params, "
                f"{self.steps} steps)")


def _union(*groups: Sequence[Tensor]) -> list[Tensor]:
    return list(dict.fromkeys(t for group in groups for t in group))


def _rank_reduce(comm: Any) -> RankReduce | None:
    """The all-reduce between the ranks for ``comm``: a polyjit.distributed.Comm, an
    NcclComm, or an mpi4py communicator (wrapped in a Comm: a collective call). Only here is
    polyjit.distributed (and so mpi4py) imported."""
    if comm is None:
        return None
    from polyjit.distributed.data_parallel import RankReduce

    return RankReduce(comm)


def _gap(a: Array, b: Array) -> float:
    """The largest ``|a - b|``: 0 where the values are equal (infinities too: inf - inf is
    NaN), NaN where either is NaN (numpy's max keeps it; builtin max() would drop it)."""
    with np.errstate(invalid="ignore"):
        return float(np.max(np.where(a == b, 0.0, np.abs(a - b)))) if a.size else 0.0


def _batch_inputs(inputs: Mapping[str, InputSpec]) -> dict[str, tuple[tuple[int, ...], DType]]:
    """Each input's (shape, dtype), refusing by name a shape with no batch axis to split."""
    out = {}
    for key, (shape, dt) in inputs.items():
        if not isinstance(shape, (tuple, list)) or not shape:
            raise ShapeMismatchError(f"input {key!r}: shape {shape!r} has no batch axis (axis 0) to split "
                                     "over the devices")
        out[key] = (ir.as_shape(shape), as_dtype(dt))
    return out


def data_parallel(
    model_step: Callable[..., Tensor],
    inputs: Mapping[str, InputSpec],
    *,
    optimizer: Optimizer,
    devices: Sequence[DeviceLike] | Backend | str | None = None,
    params: Sequence[Tensor] | None = None,
    name: str = "dp",
    comm: Any = None,
) -> DataParallel:
    """Replicate a training step on several devices.

    ``model_step(**tensors) -> loss`` builds the loss (the mean over its shard)
    from input tensors; it is called once, with tensors of the *shard* shape.
    ``inputs`` maps each input name to the (shape, dtype) of the *global*
    batch; axis 0 is split evenly across ``devices`` (a list of devices or
    names, a backend, or a backend name for all of its devices; default: every
    CPU device). ``optimizer`` updates ``params`` (default: every parameter the
    loss depends on) on every replica with the mean gradient.

    ``comm`` (a ``polyjit.distributed.Comm``, an mpi4py communicator, or an ``NcclComm`` for
    CUDA replicas with one GPU per rank; every rank calls
    ``data_parallel`` with the same model, batch and number of devices): data parallel across
    processes too. Rank r takes rows ``[r * B / R, (r + 1) * B / R)`` of the global batch B
    and splits them over its devices; ``step()`` takes the global batch (every rank the same
    arrays) or just the rank's slice, and returns the mean loss over all ranks. Gradients are
    summed by the tree inside each rank, one MPI all-reduce among the ranks, and the tree
    back down. Every rank starts with rank 0's parameters and optimizer state (and
    ``load_state_dict`` / ``reset`` end with them: collective calls); data parallels over one
    Comm need their own ``name``, the same on every rank.
    """
    return DataParallel(model_step, inputs, optimizer=optimizer, devices=devices, params=params, name=name,
                        comm=comm)
