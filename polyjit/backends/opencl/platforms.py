"""OpenCL platforms and devices: which PoCL builds on this host, discovery, what each device is.

Devices are every device of every platform pyopencl finds, in the order (platform index,
device index), or only those of ``POLYJIT_OPENCL_PLATFORM`` (a platform name substring or
index). All devices of a platform share one ``cl.Context``. A platform whose compiler
cannot build a trivial kernel here (pip's PoCL 3.0 on CPUs newer than its LLVM) is left
out at discovery, with the reason, instead of failing every later build.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from polyjit.backends.opencl.dialect import CPU_BUILD_OPTION
from polyjit.core.protocol import DeviceInfo

try:
    import pyopencl as cl
except ImportError as _e:  # the dialect still works (code generation needs no driver)
    cl = None  # type: ignore[assignment]
    IMPORT_ERROR: str | None = f"pyopencl cannot be imported: {_e}"
else:
    IMPORT_ERROR = None

__all__ = ["PLATFORM_ENV", "ClDevice", "cl", "cl_name", "discover", "pip_pocl_icd", "working_pocl_icd"]

PLATFORM_ENV = "POLYJIT_OPENCL_PLATFORM"
MIN_BASE_ALIGNMENT = 64  # bytes; pool offsets are multiples of max(this, the device's alignment)
PROBE_KERNEL = "__kernel void pj_probe(__global int* a) { a[0] = 1; }"
SYSTEM_POCL_ICDS = ("/etc/OpenCL/vendors/pocl.icd",)  # Debian's pocl-opencl-icd


def pip_pocl_icd() -> str | None:
    """The ``pocl.icd`` file shipped inside pyopencl's wheel (``pyopencl[pocl]``), if any.

    Setting ``OCL_ICD_VENDORS`` to this *file* (not its folder: pyopencl's loader
    reads that folder anyway, and PoCL would show up twice) makes the ICD loader
    offer pip's PoCL alone, whatever OpenCL drivers the system has.
    """
    spec = importlib.util.find_spec("pyopencl")
    if spec is None or spec.origin is None:
        return None
    icd = Path(spec.origin).parent / ".libs" / "pocl.icd"
    return str(icd) if icd.is_file() else None


def working_pocl_icd() -> str | None:
    """An ICD file of a PoCL that builds kernels on this host: pip's (see :func:`pip_pocl_icd`)
    when it can, else the system's. pip's PoCL 3.0 is built on LLVM 14, which does not know
    CPUs newer than it (AMD Zen 5: "unknown target CPU 'generic'"); Debian's PoCL does.
    Each candidate is tried in a child process: OpenCL reads ``OCL_ICD_VENDORS`` once."""
    import subprocess
    import sys

    probe = ("import pyopencl as cl\n"
             "for p in cl.get_platforms():\n"
             "    cl.Program(cl.Context(devices=p.get_devices()), PROBE).build(cache_dir=False)\n")
    for icd in (pip_pocl_icd(), *SYSTEM_POCL_ICDS):
        if not icd or not Path(icd).is_file():
            continue
        env = {**os.environ, "OCL_ICD_VENDORS": icd}
        code = f"PROBE = {PROBE_KERNEL!r}\n{probe}"
        try:
            done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0:
            return icd
    return None


@attrs.define(eq=False)
class ClDevice:
    """One OpenCL device as the driver uses it."""

    ordinal: int
    platform_index: int
    device_index: int
    platform: Any  # cl.Platform
    device: Any  # cl.Device
    context: Any  # cl.Context, shared by the platform's devices
    group: int  # devices of one group share a build (same context and options)
    options: str
    fp64: bool
    is_cpu: bool
    max_alloc: int
    info: DeviceInfo
    staging: Any = None  # a queue for blocking reads when copying across platforms


def cl_name(value: Any) -> str:
    return str(value).strip()


def _device_type(flags: int) -> str:
    for name in ("GPU", "ACCELERATOR", "CPU", "CUSTOM"):
        if flags & getattr(cl.device_type, name):
            return name.lower()
    return "other"


def _platform_filter(platforms: Sequence[Any], want: str) -> list[int]:
    want = want.strip()
    if want.isdigit():
        k = int(want)
        return [k] if k < len(platforms) else []
    low = want.lower()
    return [k for k, p in enumerate(platforms) if low in cl_name(p.name).lower()]


# The process that opened the OpenCL platforms. In a child forked after that, the drivers'
# threads (PoCL's device workers) are gone while their state says otherwise: work there
# never completes (a read waited forever), so the child gets no devices, and the reason.
_opened_in: int | None = None


POCL_CACHE_ENV = "POCL_CACHE_DIR"


def _private_pocl_cache() -> str | None:
    """PoCL keeps the native code of its builds in its own kernel cache and dlopens it in
    later processes, unverified. Unless the user chose its place, that cache goes in polyjit's
    cache root, whose directories the cache module checks (ours alone: no other user can
    plant a library there; a refused root falls back to a private temporary directory).
    PoCL reads the variable when it starts (the first ``get_platforms``). Returns why OpenCL
    cannot start where no directory has room for PoCL's builds (its LLVM aborts the whole
    process on a full disk: no device is better)."""
    if POCL_CACHE_ENV in os.environ:
        return None
    from polyjit.core.cache import POCL_NAMESPACE, CacheError, NoRoomError, hand_over

    try:
        os.environ[POCL_CACHE_ENV] = str(hand_over(POCL_NAMESPACE))
    except NoRoomError as e:
        return str(e)
    except CacheError:
        pass  # PoCL's default (the user's own cache directory)
    return None


def discover(platform_filter: str | None, cpu_options: bool) -> tuple[list[ClDevice], str | None]:
    """The usable devices and, when there are none, why. ``cpu_options``: build CPU devices'
    programs with ``-D PJ_CPU`` (their register-tiled matmul variant)."""
    global _opened_in
    if cl is None:
        return [], IMPORT_ERROR
    if _opened_in is not None and _opened_in != os.getpid():
        return [], (f"OpenCL was opened in the parent process (pid {_opened_in}) before os.fork(): its "
                    "drivers' threads are not in this child, and work here would never complete; "
                    "start such processes with the 'spawn' method (multiprocessing.get_context('spawn'))")
    no_room = _private_pocl_cache()
    if no_room is not None:
        return [], no_room
    try:
        platforms = list(cl.get_platforms())
    except cl.Error as e:  # no ICD loader configuration, or no driver behind it
        return [], f"no OpenCL platform: {e}".strip()
    _opened_in = os.getpid()
    indices = list(range(len(platforms)))
    if platform_filter:
        indices = _platform_filter(platforms, platform_filter)
        if not indices:
            names = ", ".join(f"{k}: {cl_name(p.name)}" for k, p in enumerate(platforms))
            return [], f"{PLATFORM_ENV}={platform_filter!r} matches no OpenCL platform ({names or 'none'})"
    out: list[ClDevice] = []
    problems: list[str] = []
    groups: dict[tuple[int, str], int] = {}
    for pk in indices:
        plat = platforms[pk]
        try:
            devs = list(plat.get_devices())
            ctx = cl.Context(devices=devs) if devs else None
        except cl.Error as e:
            problems.append(f"{cl_name(plat.name)}: {e}")
            continue
        broken = _cannot_build(ctx, devs) if devs else None
        if broken:
            problems.append(f"{cl_name(plat.name)} ({cl_name(plat.version)}) cannot build kernels here: {broken}")
            continue
        for dk, dev in enumerate(devs):
            is_cpu = bool(dev.type & cl.device_type.CPU)
            options = CPU_BUILD_OPTION if (is_cpu and cpu_options) else ""
            group = groups.setdefault((pk, options), len(groups))
            out.append(_describe(len(out), pk, dk, plat, dev, ctx, group, options, is_cpu))
    if not out:
        return [], "no OpenCL device" + (f" ({'; '.join(problems)})" if problems else "")
    return out, None


def _describe(ordinal: int, pk: int, dk: int, plat: Any, dev: Any, ctx: Any, group: int,
              options: str, is_cpu: bool) -> ClDevice:
    extensions = cl_name(dev.extensions).split()
    try:
        double_config = int(dev.double_fp_config)
    except cl.Error:
        double_config = 0
    fp64 = "cl_khr_fp64" in extensions or double_config != 0
    # Sub-buffers (users' own kernels) must start at multiples of this: so must pool offsets.
    align = max(MIN_BASE_ALIGNMENT, int(dev.mem_base_addr_align) // 8)  # the query is in bits
    info = DeviceInfo(
        name=cl_name(dev.name),
        memory_bytes=int(dev.global_mem_size),
        compute_units=int(dev.max_compute_units),
        base_alignment=align,
        properties={
            "platform": cl_name(plat.name),
            "platform_index": pk,
            "device_index": dk,
            "vendor": cl_name(dev.vendor),
            "driver_version": cl_name(dev.driver_version),
            "opencl_version": cl_name(dev.version),
            "device_type": _device_type(dev.type),
            "fp64": fp64,
            "max_mem_alloc_size": int(dev.max_mem_alloc_size),
            "max_work_group_size": int(dev.max_work_group_size),
            "local_mem_size": int(dev.local_mem_size),
        },
    )
    return ClDevice(ordinal, pk, dk, plat, dev, ctx, group, options, fp64, is_cpu, int(dev.max_mem_alloc_size), info)


def build_log(program: Any, devices: Sequence[Any]) -> str:
    """The build logs of a program on these cl.Devices (each distinct log once)."""
    logs: list[str] = []
    with warnings.catch_warnings():
        # A failed build of pyopencl's cached path leaves no program: asking makes an empty one
        # (with a warning), and the log is in the error's message instead.
        warnings.simplefilter("ignore")
        for d in devices:
            with contextlib.suppress(cl.Error):
                log = str(program.get_build_info(d, cl.program_build_info.LOG)).strip()
                if log and log not in logs:
                    logs.append(log)
    return "\n".join(logs)


def _cannot_build(ctx: Any, devs: Sequence[Any]) -> str | None:
    """Why a platform cannot build a trivial kernel (None when it can)."""
    program = cl.Program(ctx, PROBE_KERNEL)
    try:
        program.build(devices=devs, cache_dir=False)  # type: ignore[arg-type]  # False: no pyopencl cache
    except cl.Error as e:
        log = " ".join(ln for ln in build_log(program, devs).splitlines() if ln.strip()) or str(e)
        hint = ""
        if "unknown target CPU" in log:
            hint = ("; its LLVM does not know this CPU: install a newer PoCL (Debian: "
                    "apt install pocl-opencl-icd) and point OCL_ICD_VENDORS at its .icd file")
        return log[:500] + hint
    return None
