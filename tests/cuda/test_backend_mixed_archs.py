"""polyjit's CUDA backend on stub GPUs of three archs: 9.0 and 8.6 load CUBINs compiled
for them, 12.3 (newer than NVRTC knows) gets PTX, which the driver JIT-compiles."""

from __future__ import annotations

from typing import Any

import numpy as np
import scenarios
from scenarios import f32

from polyjit.backends import cuda
from polyjit.core import ir
from polyjit.core.ir import Op

STUB_ENV = {"PJSTUB_DEVICES": "3", "PJSTUB_CC": "9.0,8.6,12.3"}  # as test_stub_strictness.py


def test_each_device_runs_code_for_its_arch(backend: Any) -> None:
    from polyjit import device_to_device

    assert backend.static_properties()["archs"] == ("sm_90", "sm_86", "sm_123")
    n = 3000
    x, y = f32("x", (n,)), f32("y", (n,))
    h = np.linspace(-3, 3, n, dtype=np.float32)
    code = backend.compile(ir.Comp.of(ir.apply(Op.TANH, x, into=y)), name="tanh")
    binary = code.batch.binary
    assert [binary.image(a)[0] for a in ("sm_90", "sm_86", "sm_123")] == ["cubin", "cubin", "ptx"]
    contexts = []
    for k in range(3):
        ctx = backend.get_device(k).make_context().init_from_host(x, h)
        r = ctx.link(code)
        r.run()
        np.testing.assert_allclose(r.context.read(y), np.tanh(h), rtol=1e-5, atol=1e-6)
        contexts += [r.context, ctx]
    device_to_device(y, dst=contexts[4], src=contexts[0])  # device 0 -> device 2
    np.testing.assert_allclose(contexts[4].read(y), np.tanh(h), rtol=1e-5, atol=1e-6)
    for ctx in contexts:
        ctx.finalize()


def test_conformance_catalog_from_ptx(backend: Any) -> None:
    """The catalog's programs on the device that runs PTX (kernel names and parameter
    layouts come from the PTX's .entry directives)."""
    from polyjit.testing.harness import run_programs

    progs = [p for p in scenarios.all_programs() if not p.name.startswith(("elementwise.", "cast.", "cuda."))]
    failures = run_programs(backend, progs, ordinal=2)
    assert not failures, "\n".join(str(f) for f in failures[:20])
    assert isinstance(backend.driver, cuda.CudaDriver)
