"""Checks of transfers: host round trips and their errors, device_to_device and merge buffers, and
device-side copies between nodes at non-zero offsets."""

from __future__ import annotations

from typing import Any

import numpy as np

from polyjit.core import dtypes, ir
from polyjit.core.errors import (
    DTypeMismatchError,
    MergeBufferMismatchError,
    NodeNotInContextError,
    ShapeMismatchError,
)
from polyjit.core.ir import AccumOp, Node, Op
from polyjit.core.protocol import MergeBuffer
from polyjit.core.reference import run_reference
from polyjit.core.runtime import Backend, Context, Device, device_to_device, init_from_device
from polyjit.testing.checks.common import (
    Array,
    assert_equal,
    assert_usable,
    expect,
    f32,
    finalizing,
    multi_device,
    require_devices,
    settled_memory,
    small_ints,
)

# ---------------------------------------------------------------------------
# Host transfers


_ROUND_TRIP_SHAPES: tuple[tuple[int, ...], ...] = ((), (0,), (3, 0, 2), (1,), (7,), (5, 13), (2, 3, 4))


def _random(dt: dtypes.DType, shape: tuple[int, ...], rng: np.random.Generator) -> Array:
    if dt.is_bool:
        return np.asarray(rng.random(shape) < 0.5)
    if dt.is_float:
        return np.asarray(rng.standard_normal(shape)).astype(dt.np)
    info = np.iinfo(dt.np)
    return np.asarray(rng.integers(info.min, info.max, shape, dtype=dt.np, endpoint=True))


def check_host_round_trips(backend: Backend) -> None:
    """init_from_host / from_host / to_host (blocking or not) / read for every dtype, 0-d and empty shapes."""
    require_devices(backend, 1)
    dev = backend.get_device(0)
    rng = np.random.default_rng(2)
    base = settled_memory(dev)
    with finalizing(dev.make_context()) as held:
        for dt in dtypes.ALL:
            for shape in _ROUND_TRIP_SHAPES:
                node = Node(f"rt_{dt}", shape, dt)
                label = f"{dt} {shape}"
                first = _random(dt, shape, rng)
                ctx = held[-1].init_from_host(node, first)
                held.append(ctx)
                assert_equal(f"read after init_from_host, {label}", ctx.read(node), first)
                second = _random(dt, shape, rng)
                if ctx.from_host(node, second) is not True:
                    raise AssertionError(f"from_host of a node with a buffer must return True ({label})")
                out = np.empty(shape, dt.np)
                if ctx.to_host(node, out) is not True:
                    raise AssertionError(f"to_host of a node with a buffer must return True ({label})")
                assert_equal(f"to_host after from_host, {label}", out, second)
                # a non-blocking to_host holds the value once the stream is past it
                third, late = _random(dt, shape, rng), np.empty(shape, dt.np)
                ctx.from_host(node, third)
                if ctx.to_host(node, late, blocking=False) is not True:
                    raise AssertionError(f"a non-blocking to_host must return True ({label})")
                ctx.stream.synchronize()
                assert_equal(f"to_host(blocking=False) after a sync, {label}", late, third)
                # a non-contiguous source array is accepted (copied)
                if len(shape) >= 1 and shape[0] > 1 and np.prod(shape) > 0:
                    wide = _random(dt, (shape[0] * 2, *shape[1:]), rng)
                    ctx.from_host(node, wide[::2])
                    assert_equal(f"from_host of a strided array, {label}", ctx.read(node), wide[::2])
        # transfers of a node the context does not hold return False
        stranger = Node("rt_stranger", (3,), dtypes.float32)
        ctx = held[-1]
        if ctx.from_host(stranger, np.zeros(3, np.float32)) is not False:
            raise AssertionError("from_host of a node without a buffer must return False")
        if ctx.to_host(stranger, np.zeros(3, np.float32)) is not False:
            raise AssertionError("to_host of a node without a buffer must return False")
        expect(NodeNotInContextError, lambda: ctx.read(stranger), "Context.read of a node without a buffer",
                contains=stranger.label)
    if dev.used_memory() != base:
        raise AssertionError(f"used_memory after finalize is {dev.used_memory()}, expected {base}")


def check_host_transfer_errors(backend: Backend) -> None:
    """Wrong shapes and dtypes raise ShapeMismatchError / DTypeMismatchError; the context survives."""
    require_devices(backend, 1)
    dev = backend.get_device(0)
    node = Node("xfer", (4, 5), dtypes.float32)
    good = np.arange(20, dtype=np.float32).reshape(4, 5)
    ctx = dev.make_context().init_from_host(node, good)
    with finalizing(ctx):
        for name, call in (("from_host", ctx.from_host), ("to_host", ctx.to_host),
                           ("init_from_host", ctx.init_from_host)):
            expect(ShapeMismatchError, lambda call=call: call(node, np.zeros((5, 4), np.float32)),  # type: ignore[misc]
                    f"{name} with a (5, 4) array for a (4, 5) node")
            expect(ShapeMismatchError, lambda call=call: call(node, np.zeros((20,), np.float32)),  # type: ignore[misc]
                    f"{name} with a flat array for a (4, 5) node")
            expect(DTypeMismatchError, lambda call=call: call(node, np.zeros((4, 5), np.float64)),  # type: ignore[misc]
                    f"{name} with a float64 array for a float32 node")
            expect(DTypeMismatchError, lambda call=call: call(node, np.zeros((4, 5), np.int32)),  # type: ignore[misc]
                    f"{name} with an int32 array for a float32 node")
        assert_equal("the node after rejected transfers", ctx.read(node), good)
        assert_usable(backend, ctx, "ShapeMismatchError/DTypeMismatchError")


# ---------------------------------------------------------------------------
# Device to device, merge buffers


def _merge_reader(node: Node) -> ir.Comp:
    """node += merge(node): sums what device_to_device(..., COPY) brought into the local node."""
    return ir.Comp.of(ir.apply(Op.ID, ir.merge(node), into=node, accum=AccumOp.ADD, init_neutral=False),
                      embedded=[node])


def _transfers(backend: Backend, d0: int, d1: int) -> None:
    dev0, dev1 = backend.get_device(d0), backend.get_device(d1)
    where = f"{dev0.device_id} -> {dev1.device_id}"
    rng = np.random.default_rng(5)
    x, y = Node("d2d_x", (33, 7), dtypes.float32), Node("d2d_y", (5,), dtypes.int64)
    xa, xb = small_ints(rng, x.shape), small_ints(rng, x.shape)
    ya, yb = rng.integers(-9, 9, y.shape), rng.integers(-9, 9, y.shape)
    src = dev0.make_context().init_from_host(x, xa).init_from_host(y, ya)
    dst = dev1.make_context().init_from_host(x, xb).init_from_host(y, yb)
    with finalizing(src, dst) as held:
        # MergeBuffer.NO: into the node's own buffer
        r = device_to_device(x, dst=dst, src=src, into_merge_buffer=MergeBuffer.NO)
        if r is None:
            raise AssertionError(f"device_to_device between distinct buffers ({where}) returned None")
        assert_equal(f"{x.label} after device_to_device {where}", dst.read(x), xa)
        assert_equal(f"{x.label} on the source after device_to_device", src.read(x), xa)
        xc = small_ints(rng, x.shape)
        src.from_host(x, xc)
        r.run()
        assert_equal(f"{x.label} after the transfer routine's run() {where}", dst.read(x), xc)
        if device_to_device(x, dst=src, src=src) is not None:
            raise AssertionError("device_to_device of a buffer onto itself must return None")
        # init_from_device: a new buffer filled from the other device
        z = Node("d2d_z", (4, 4), dtypes.uint8)
        zv = rng.integers(0, 256, z.shape).astype(np.uint8)
        src_z = src.init_from_host(z, zv)
        held.append(src_z)
        made = init_from_device(z, dst=dst, src=src_z)
        held.append(made)
        if z in dst.buffers:
            raise AssertionError("init_from_device must not change dst (it returns a child)")
        assert_equal(f"{z.label} after init_from_device {where}", made.read(z), zv)
        # MergeBuffer.COPY: into dst's merge buffer; a reader sums it into the local node
        reader = backend.compile(_merge_reader(x), name="merge_sum")
        rc = device_to_device(x, dst=dst, src=src, into_merge_buffer=MergeBuffer.COPY)
        if rc is None:
            raise AssertionError("device_to_device(..., COPY) returned None")
        local = dst.read(x)
        merged = rc.context.link(reader)
        if merged.merge_buffer_input is not x:
            raise AssertionError(f"the merge reader's merge_buffer_input is {merged.merge_buffer_input}, not {x.label}")
        merged.run()
        want = run_reference([_merge_reader(x)], {x: local}, merge={x: xc})[x]
        assert_equal(f"{x.label} + merge({x.label}) {where}", merged.context.read(x), want)
        # a reader linked against a context whose merge buffer holds nothing, or another node
        expect(MergeBufferMismatchError, lambda: dst.link(reader),
                "linking a merge reader against a context without the merge copy")
        ry = device_to_device(y, dst=dst, src=src, into_merge_buffer=MergeBuffer.COPY)
        assert ry is not None
        expect(MergeBufferMismatchError, lambda: ry.context.link(reader),
                f"linking a reader of merge({x.label}) against a context whose merge buffer holds {y.label}")
        assert_usable(backend, dst, "MergeBufferMismatchError")


def check_device_to_device_one_device(backend: Backend) -> None:
    """device_to_device (NO and COPY) and init_from_device between two contexts of one device;
    linking a merge reader against the wrong context raises MergeBufferMismatchError."""
    require_devices(backend, 1)
    _transfers(backend, 0, 0)


@multi_device
def check_device_to_device_two_devices(backend: Backend) -> None:
    """device_to_device (NO and COPY) and init_from_device between two devices, both ways."""
    require_devices(backend, 2)
    _transfers(backend, 0, 1)
    _transfers(backend, 1, 0)


@multi_device
def check_merge_buffer_all_reduce(backend: Backend) -> None:
    """An all-reduce over every device: merge-buffer copies summed into the local nodes, then
    copied back; checked against the reference."""
    require_devices(backend, 2)
    n = backend.num_devices()
    devs = [backend.get_device(k) for k in range(n)]
    g = Node("grad", (129,), dtypes.float32)
    rng = np.random.default_rng(6)
    values = [small_ints(rng, g.shape) for _ in devs]
    ctxs = [d.make_context().init_from_host(g, v) for d, v in zip(devs, values)]
    reader = backend.compile(_merge_reader(g), name="all_reduce_sum")
    with finalizing(*ctxs):
        # reduce into device 0: one merge copy and one sum per other device
        acc = ctxs[0]
        state = values[0]
        for k in range(1, n):
            rc = device_to_device(g, dst=acc, src=ctxs[k], into_merge_buffer=MergeBuffer.COPY)
            assert rc is not None
            r = rc.context.link(reader)
            r.run()
            state = run_reference([_merge_reader(g)], {g: state}, merge={g: values[k]})[g]
            acc = r.context
        total = np.asarray(np.sum(np.stack(values), axis=0, dtype=np.float32))
        assert_equal(f"{g.label} reduced on {devs[0].device_id}", acc.read(g), total)
        # broadcast back
        for k in range(1, n):
            device_to_device(g, dst=ctxs[k], src=acc)
        for k in range(n):
            assert_equal(f"{g.label} on {devs[k].device_id} after the all-reduce", ctxs[k].read(g), total)


# ---------------------------------------------------------------------------
# Device-side copies between nodes that do not start their pools


_OffsetNodes = tuple[Node, Node, Node, Node, Node, Node]


def _offset_nodes(alignment: int) -> _OffsetNodes:
    """Nodes to copy and guards around them, for devices whose base alignment is ``alignment``:
    a float32 node and a uint8 node of odd sizes (the planner pads them to the alignment), and a
    uint8 node ``off_w`` of a multiple of ``alignment`` bytes (the smallest of at least 16) with
    the guard ``off_g`` of the same size right behind it, so that a copy_device that writes past
    the end of its destination lands in a node the check reads, not in padding. ``off_lo`` is
    the largest: it starts the pool, so every copied node is at a non-zero offset."""
    size = -(-16 // alignment) * alignment
    return (f32("off_lo", (max(64, size // 2),)), f32("off_x", (37,)), f32("off_hi", (16,)),
            Node("off_y", (13,), dtypes.uint8), Node("off_w", (size,), dtypes.uint8),
            Node("off_g", (size,), dtypes.uint8))


def _offset_layout(dev: Device, code: Any, nodes: _OffsetNodes, rng: np.random.Generator
                   ) -> tuple[Context, dict[Node, Array]]:
    """A context on ``dev`` whose nodes share one pool (one link of a batch that creates them;
    the planner puts the largest, a guard, first, and ``off_g`` right behind ``off_w``), filled
    with random values."""
    routine = dev.make_context().link(code)
    routine.run()
    ctx = routine.context
    values: dict[Node, Array] = {}
    for node in nodes:
        if node not in ctx.buffers:
            raise AssertionError(f"linking the layout batch gave {node.label} no buffer")
        values[node] = (rng.integers(0, 256, node.shape).astype(np.uint8) if node.dtype is dtypes.uint8
                        else small_ints(rng, node.shape, -99, 99))
        ctx.from_host(node, values[node])
    _, x, _, y, w, g = nodes
    pools = {ctx.buffers[n].pool_id for n in values}
    if len(pools) != 1 or any(ctx.buffers[n].offset == 0 for n in (x, y, w)):
        raise AssertionError(f"the kit's layout batch must place its nodes in one pool, the copied ones "
                             f"past the first: {dict(ctx.buffers)}")
    if ctx.buffers[g].offset != ctx.buffers[w].offset + w.nbytes:
        raise AssertionError(f"the kit's layout batch must place {g.label} right behind {w.label} "
                             f"({w.nbytes} bytes, a multiple of the base alignment of {dev.device_id}): {dict(ctx.buffers)}")
    for node, want in values.items():
        assert_equal(f"{node.label} at offset {ctx.buffers[node].offset} after from_host", ctx.read(node), want)
    return ctx, values


def _where(ctx: Context, node: Node) -> str:
    loc = ctx.buffers[node]
    return f"offset {loc.offset} of pool {loc.pool_id} on {ctx.device.device_id}"


def _copies_at_offsets(backend: Backend, d0: int, d1: int) -> None:
    """device_to_device (NO, then COPY and a merge reader) from nodes at non-zero offsets to
    nodes at non-zero offsets; the neighbouring bytes on both sides must stay as they were."""
    src_dev, dst_dev = backend.get_device(d0), backend.get_device(d1)
    nodes = _offset_nodes(max(src_dev.info.base_alignment, dst_dev.info.base_alignment))
    lo, x, hi, y, w, g = nodes
    layout = backend.compile(ir.Comp.of(*(ir.fill(n, 0 if n.dtype is dtypes.uint8 else 0.0) for n in nodes)),
                             name="offset_layout")
    reader = backend.compile(_merge_reader(x), name="offset_merge_sum")
    rng = np.random.default_rng(11 + 2 * d0 + d1)
    src, sv = _offset_layout(src_dev, layout, nodes, rng)
    dst, dv = _offset_layout(dst_dev, layout, nodes, rng)
    with finalizing(src, dst) as held:
        if src.buffers[x].pool_id == dst.buffers[x].pool_id and src_dev is dst_dev:
            raise AssertionError("the two layout contexts of one device must not share a pool")

        def untouched(what: str, ctx: Context, want: dict[Node, Array], nodes: tuple[Node, ...]) -> None:
            for n in nodes:
                assert_equal(f"{n.label} ({_where(ctx, n)}) after {what}: a neighbour of the copied "
                              f"node must stay untouched", ctx.read(n), want[n])

        for node in (x, y, w):
            what = (f"device_to_device of {node.label} from {_where(src, node)} to {_where(dst, node)}, "
                    f"{node.nbytes} bytes")
            if device_to_device(node, dst=dst, src=src, into_merge_buffer=MergeBuffer.NO) is None:
                raise AssertionError(f"{what} returned None")
            assert_equal(f"{node.label} after {what} (copy_device must read nbytes at the source "
                          f"offset and write them at the destination offset)", dst.read(node), sv[node])
            dv[node] = sv[node]
            untouched(what, dst, dv, nodes)
            untouched(what, src, sv, nodes)
        # into the merge buffer, then a routine adds it to the destination's own node
        fresh = small_ints(rng, x.shape, -99, 99)
        dst.from_host(x, fresh)
        dv[x] = fresh
        rc = device_to_device(x, dst=dst, src=src, into_merge_buffer=MergeBuffer.COPY)
        what = f"device_to_device of {x.label} from {_where(src, x)} into the merge buffer of {dst_dev.device_id}"
        if rc is None:
            raise AssertionError(f"{what} returned None")
        merged = rc.context.link(reader)
        held.append(merged.context)
        merged.run()
        want = run_reference([_merge_reader(x)], {x: fresh}, merge={x: sv[x]})[x]
        assert_equal(f"{x.label} ({_where(dst, x)}) + merge({x.label}) after {what} (copy_device must read "
                      f"the source at its offset)", merged.context.read(x), want)
        dv[x] = want
        untouched(f"{what} and the merge reader", merged.context, dv, (lo, hi, y, w, g))
        untouched(f"{what} and the merge reader", src, sv, nodes)


def check_copy_offsets_one_device(backend: Backend) -> None:
    """device_to_device (NO, and COPY into the merge buffer read by a routine) between two pools of
    one device, with both nodes at non-zero offsets: catches a copy_device that ignores the source
    or the destination offset, or copies more bytes than asked."""
    require_devices(backend, 1)
    _copies_at_offsets(backend, 0, 0)


@multi_device
def check_copy_offsets_two_devices(backend: Backend) -> None:
    """As copy_offsets_one_device, between two devices, both ways."""
    require_devices(backend, 2)
    _copies_at_offsets(backend, 0, 1)
    _copies_at_offsets(backend, 1, 0)
