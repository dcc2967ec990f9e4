"""What the CPU backend needs to know about this host, read from ``/proc/cpuinfo`` once."""

from __future__ import annotations

import functools
import hashlib
import platform
from pathlib import Path

import attrs


@attrs.frozen
class HostCpu:
    model: str
    flags: frozenset[str]

    @property
    def vector_bytes(self) -> int:
        """The widest SIMD register, in bytes."""
        if "avx512f" in self.flags:
            return 64
        if "avx2" in self.flags or "avx" in self.flags:
            return 32
        return 16

    @property
    def vector_registers(self) -> int:
        """How many of those registers the compiler can use: 32 with AVX-512 and on Arm
        (NEON), 16 with AVX, AVX2 or SSE."""
        if "avx512f" in self.flags or platform.machine().lower() in ("aarch64", "arm64"):
            return 32
        return 16

    @property
    def digest(self) -> str:
        """-march=native depends on the host: this goes into every kernel's cache key."""
        text = f"{platform.machine()} {self.model} {' '.join(sorted(self.flags))}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.cache
def host_cpu() -> HostCpu:
    model, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1]
    except OSError:
        pass
    return HostCpu(model or platform.processor() or platform.machine(), frozenset(flags.split()))


def cpu_model() -> str:
    return host_cpu().model
