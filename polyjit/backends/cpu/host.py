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


# What names an Arm core in /proc/cpuinfo, which has no "model name" or "flags" there (a
# big.LITTLE system lists two kinds of core: both go into the model).
_ARM_IDS = ("CPU implementer", "CPU architecture", "CPU variant", "CPU part", "CPU revision")


def parse_cpuinfo(text: str) -> HostCpu:
    """The model and feature flags of ``/proc/cpuinfo``'s text: x86's ``model name`` and
    ``flags``, Arm's ``Features`` and the ids of each kind of core."""
    model, flags = "", ""
    arm: set[str] = set()
    for line in text.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "model name" and not model:
            model = value
        elif key in ("flags", "Features") and not flags:
            flags = value
        elif key in _ARM_IDS:
            arm.add(f"{key} {value}")
    if not model and arm:
        model = "; ".join(sorted(arm))
    return HostCpu(model or platform.processor() or platform.machine(), frozenset(flags.split()))


@functools.cache
def host_cpu() -> HostCpu:
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return parse_cpuinfo("")


def cpu_model() -> str:
    return host_cpu().model
