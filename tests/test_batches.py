"""Batches (core/fusion.py ``fuse_segments``): independent elementwise kernels of different
sizes run as segments of one launch (an optimizer's updates of every parameter: one kernel).
The catalog (``batch.*``) checks their values on every backend; here, which kernels batch,
how each dialect writes a batch, and that dependent kernels stay apart."""

from __future__ import annotations

import pytest
from catalog_check import backend_or_skip, kernel_comments

from polyjit.core import ir
from polyjit.core.fusion import fuse_segments
from polyjit.core.ir import Node, Symbol
from polyjit.core.loops import Call, Kernel, Load, Segment, Seq, Store
from polyjit.testing.programs import by_name


@pytest.mark.parametrize("backend", ["cpu", "opencl"])
@pytest.mark.parametrize(("program", "kernels"), [
    ("batch.updates_small", 1),  # three parameters' momentum and weight updates: one launch
    ("batch.updates_large", 1),
    ("batch.dependent", 2),  # the second reads what the first writes: apart
])
def test_which_kernels_batch(backend: str, program: str, kernels: int) -> None:
    for dt in ("float32", "float64"):
        assert len(kernel_comments(backend, f"{program}.{dt}")) == kernels


def test_the_cpu_gives_each_member_its_loop_and_clips_shared_ranges() -> None:
    """On loops each member keeps a loop of its own (it vectorizes as before); when threads
    share the batch's range, each loop is clipped to the call's part of it."""
    cpu = backend_or_skip("cpu")
    small = cpu.compile(by_name("batch.updates_small.float32").comps[0], name="b").source
    assert "for (int64_t i0 = 432; i0 < 496; ++i0)" in small and " if (i0 >= " not in small
    large = cpu.compile(by_name("batch.updates_large.float32").comps[0], name="b").source
    assert "for (int64_t i0 = (30000 > pj_lo ? 30000 : pj_lo); i0 < (80001 < pj_hi ? 80001 : pj_hi); ++i0)" in large


def test_gpus_guard_each_member_by_its_segment() -> None:
    text = backend_or_skip("opencl").compile(by_name("batch.updates_small.float32").comps[0], name="b").source
    assert "if (i0 >= 432 && i0 < 496) {" in text and "b2[i0 - 432]" in text


def test_a_member_is_written_over_the_batch_range() -> None:
    i, j = Symbol("i"), Symbol("j")
    a, b, c, d = Node("a", (5,)), Node("b", (5,)), Node("c", (3,)), Node("d", (3,))
    first = Kernel("k0", ((i, 5),), Store(b, ir.as_affine(i), Load(a, ir.as_affine(i))), "b")
    second = Kernel("k1", ((j, 3),), Store(d, ir.as_affine(j), Load(c, ir.as_affine(j))), "d")
    (batch,) = fuse_segments([first, second], lambda _: True)
    assert batch.parallel == ((i, 8),) and isinstance(batch.body, Seq)
    seg = batch.body.body[1]
    assert isinstance(seg, Segment) and (seg.sym, seg.lo, seg.hi) == (i, 5, 8)
    shifted = ir.affine((1, i), const=-5)
    assert seg.body == Store(d, shifted, Load(c, shifted))


def test_kernels_that_share_a_written_node_stay_apart() -> None:
    """Segments run at once: a member may not read or write what another writes, even where
    the schedule would keep them in order."""
    i = Symbol("i")
    a, b, c = Node("a", (5,)), Node("b", (5,)), Node("c", (3,))
    writes_b = Kernel("k0", ((i, 5),), Store(b, ir.as_affine(i), Load(a, ir.as_affine(i))))
    reads_b = Kernel("k1", ((i, 3),), Store(c, ir.as_affine(i), Load(b, ir.as_affine(i))))
    also_writes_b = Kernel("k2", ((i, 3),), Store(b, ir.as_affine(i), Load(c, ir.as_affine(i))))
    assert len(fuse_segments([writes_b, reads_b], lambda _: True)) == 2
    assert len(fuse_segments([writes_b, also_writes_b], lambda _: True)) == 2
    assert len(fuse_segments([reads_b, writes_b], lambda _: True)) == 2  # a write after a read, too


def test_a_kernel_moves_only_past_what_it_does_not_touch() -> None:
    """k2 could batch with k0, but k1 between reads what k2 writes and writes what k0 reads:
    neither can move past it."""
    i = Symbol("i")
    x, y, z, w = (Node(n, (4,)) for n in "xyzw")
    k0 = Kernel("k0", ((i, 4),), Store(y, ir.as_affine(i), Load(x, ir.as_affine(i))))
    k1 = Kernel("k1", ((i, 4), (Symbol("j"), 2)), Store(x, ir.as_affine(i), Load(z, ir.as_affine(i))))
    k2 = Kernel("k2", ((i, 4),), Store(z, ir.as_affine(i), Load(w, ir.as_affine(i))))
    joins = lambda k: len(k.parallel) == 1  # noqa: E731
    assert [k.name for k in fuse_segments([k0, k1, k2], joins)] == ["k0", "k1", "k2"]


def test_a_batch_takes_at_most_48_buffers() -> None:
    """OpenCL guarantees 1024 bytes of kernel arguments (16 a buffer): 16 members of five
    buffers each make two batches, none over the limit."""
    from polyjit.core.fusion import MAX_BATCH_BUFFERS

    i = Symbol("i")

    def member(n: int) -> Kernel:
        ins = [Load(Node(f"a{n}_{k}", (3,)), ir.as_affine(i)) for k in range(4)]
        add, dt = ir.Op.ADD, ins[0].dtype
        expr = Call(add, (Call(add, (ins[0], ins[1]), dt), Call(add, (ins[2], ins[3]), dt)), dt)
        return Kernel(f"k{n}", ((i, 3),), Store(Node(f"o{n}", (3,)), ir.as_affine(i), expr))

    out = fuse_segments([member(n) for n in range(16)], lambda _: True)
    assert len(out) == 2 and all(len(k.buffers) <= MAX_BATCH_BUFFERS for k in out)
