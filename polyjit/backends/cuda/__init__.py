"""The CUDA backend on cuda.core: ``driver.py`` (devices, memory, streams, launches),
``dialect.py`` (CUDA C), ``nvrtc.py`` (NVRTC and its cache), ``staging.py`` (pinned host
copies) and ``graph.py`` (graph replay)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from polyjit.backends.cuda.dialect import CudaDialect
from polyjit.backends.cuda.driver import (
    BASE_ALIGNMENT,
    CudaDriver,
    CudaDriverError,
    grid_and_block,
    versions,
)
from polyjit.backends.cuda.graph import CudaGraph, capture
from polyjit.backends.cuda.nvrtc import (
    DEFAULT_ARCH,
    NVRTC_OPTIONS,
    CudaBinary,
    nvrtc_compile,
    nvrtc_log,
    nvrtc_supported_archs,
    nvrtc_version,
)
from polyjit.backends.cuda.staging import STAGING_BYTES
from polyjit.core.errors import PolyjitError
from polyjit.core.ir import Node
from polyjit.core.routine import Routine
from polyjit.core.runtime import Backend
from polyjit.core.streams import Stream

__all__ = [
    "BASE_ALIGNMENT",
    "DEFAULT_ARCH",
    "NVRTC_OPTIONS",
    "STAGING_BYTES",
    "CudaBackend",
    "CudaBinary",
    "CudaDialect",
    "CudaDriver",
    "CudaDriverError",
    "CudaGraph",
    "capture",
    "create_backend",
    "grid_and_block",
    "nvrtc_compile",
    "nvrtc_log",
    "nvrtc_supported_archs",
    "nvrtc_version",
    "versions",
]


class CudaBackend(Backend):
    """The CUDA backend: the generic runtime over a :class:`CudaDriver`; ``capture`` records
    a CUDA graph."""

    driver: CudaDriver

    def __init__(self, driver: CudaDriver | None = None) -> None:
        super().__init__(driver or CudaDriver())

    def capture(self, routines: Sequence[Routine], *, stream: Stream | None = None,
                inputs: Sequence[Node] = (), outputs: Sequence[Node] = ()) -> CudaGraph:
        return capture(routines, stream=stream, inputs=inputs, outputs=outputs)

    def static_properties(self) -> dict[str, Any]:
        props = super().static_properties()
        props["unavailable_reason"] = self.driver.unavailable_reason
        props["default_arch"] = DEFAULT_ARCH
        props["nvrtc_options"] = self.driver.options
        props.update(versions())
        try:
            props["nvrtc_archs"] = tuple(f"sm_{a}" for a in nvrtc_supported_archs())
        except PolyjitError as e:
            props["nvrtc_unavailable_reason"] = str(e)
        props["archs"] = tuple(self.driver.arch(k) for k in range(self.num_devices()))
        return props


def create_backend(*, fast_math: bool = False) -> CudaBackend:
    """The CUDA backend (zero devices, with ``unavailable_reason``, where there is no driver).
    ``fast_math``: NVRTC's ``--use_fast_math``, which gives up what the reference promises:
    float32 subnormals flush to zero (``relu(1e-40)`` is 0; max/min compare them as zeros),
    and division, sqrt, exp, log and the like are approximate (NaN still propagates through
    max and min). Off by default; the conformance kit has not run with it."""
    return CudaBackend(CudaDriver(fast_math=fast_math))
