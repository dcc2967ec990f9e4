"""Graph replay: linked routines recorded once into a CUDA graph, launched with one call.

The graph is a ``cuda.core`` GraphDefinition with one kernel node per kernel of the
routines, in order; ``replay()`` updates the nodes whose static arguments changed
(executable-node updates, no new graph) and launches it on the replay's stream, ordered
by the per-node events like ``Routine.run()``, between the replay's host copies (one
enqueue: :meth:`Replay.replay`). A graph
built by stream capture (GraphBuilder) would have to be captured again to change one
kernel's arguments; a definition updates them in place.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from polyjit.backends.cuda.driver import CudaDriver
from polyjit.backends.cuda.handles import PreparedLaunch
from polyjit.core.errors import InvalidProgramError, MergeBufferMismatchError
from polyjit.core.ir import Node, StaticSymbol
from polyjit.core.routine import Replay, Routine
from polyjit.core.streams import Operation, Stream

__all__ = ["CudaGraph", "capture"]


class CudaGraph(Replay):
    """Linked CUDA routines as one graph (build it with :func:`capture` or
    ``backend.capture(routines)``); ``bindings`` / ``bind(name=value)`` set the statics the
    next ``replay()`` uses. It may replay on any stream of the routines' device."""

    same_stream = False

    def __init__(self, routines: Sequence[Routine], stream: Stream | None = None,
                 inputs: Sequence[Node] = (), outputs: Sequence[Node] = ()) -> None:
        super().__init__(routines, stream, inputs, outputs)
        driver = self.device.driver
        if not isinstance(driver, CudaDriver):
            raise InvalidProgramError(f"a CUDA graph needs routines of the cuda backend, not {self.device.backend.name}")
        self._driver: CudaDriver = driver
        self._merge_generation = self.device.merge.generation
        from cuda.core.graph import GraphDefinition

        driver.make_current(self.device.ordinal)
        self._definition = GraphDefinition()
        self._nodes: list[tuple[int, Any, Any]] = []  # (routine index, kernel node, its launch)
        self._last: list[tuple[int, ...] | None] = []
        previous: Any = None
        for k, r in enumerate(self.routines):
            r.check_merge()
            prepared = r.prepared()  # the routine's public launch record
            assert isinstance(prepared, PreparedLaunch)
            # statics may be bound after capture: unbound ones are recorded as 0 and set
            # (checked) by the first replay, which finds _last None and updates the nodes
            bound = all(s in self.bindings for s in r.statics)
            statics = r.static_values(self.bindings) if bound else (0,) * len(r.statics)
            self._last.append(statics if bound else None)
            for ln in prepared.launches:
                owner = self._definition if previous is None else previous
                previous = owner.launch(ln.config, ln.kernel, *ln.arguments(statics))
                self._nodes.append((k, previous, ln))
        self._graph = self._definition.instantiate()

    @property
    def kernel_count(self) -> int:
        return len(self._nodes)

    def _launches(self) -> list[Operation]:
        if self.device.merge.generation != self._merge_generation and any(
                r.merge_buffer_input is not None for r in self.routines):
            raise MergeBufferMismatchError(
                "a routine of this graph reads the merge buffer, which has grown and moved since "
                "capture; capture again")
        # every routine's statics are checked before any node changes: a bad binding leaves
        # the graph as the last replay ran it
        values = [r.static_values(self.bindings) if r.statics else () for r in self.routines]
        changed = {k for k, v in enumerate(values) if v != self._last[k]}
        self._driver.make_current(self.device.ordinal)
        try:
            for k, node, ln in self._nodes:
                if k in changed:
                    self._graph[node].update(config=ln.config, kernel=ln.kernel, args=ln.arguments(values[k]))
        except BaseException:
            for k in changed:  # some of their nodes may hold the new values: update all next time
                self._last[k] = None
            raise
        for k in changed:
            self._last[k] = values[k]
        return [(self._graph.launch, (self.stream.handle.core,))]

    def close(self) -> None:
        """Destroy the graph once its last launch is done (the routines stay usable)."""
        with self.device.lock:  # a replay checks `closed` under it: none is between check and launch
            if self.closed:
                return
            self.closed = True
        self.stream.synchronize()
        self._graph.close()


def capture(routines: Routine | Iterable[Routine], *, stream: Stream | None = None,
            bindings: Mapping[StaticSymbol, int] | None = None, inputs: Sequence[Node] = (),
            outputs: Sequence[Node] = ()) -> CudaGraph:
    """Capture linked cuda routines (run in this order) into a CUDA graph; ``stream`` defaults
    to the first routine's context stream; ``inputs`` / ``outputs``: nodes that ``replay()``
    copies in from host arrays before the graph and out after it. Set ``graph.bindings[sym]``
    (or ``graph.bind(name=value)``) and call ``graph.replay()``."""
    rs = [routines] if isinstance(routines, Routine) else list(routines)
    graph = CudaGraph(rs, stream, inputs, outputs)
    if bindings:
        graph.bindings.update(bindings)
    return graph
