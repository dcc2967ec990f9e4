"""CUDA devices: the driver library found (``cuInit``) before anything touches it, what each
device is, and the versions a first run on a GPU must know.

Raw ``cuda.bindings`` only where cuda.core has no such feature, each call marked with
which. Without a driver, ``discover`` says why and the backend reports zero devices.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from polyjit.backends.cuda.nvrtc import nvrtc_version
from polyjit.core.errors import DriverError, PolyjitError
from polyjit.core.protocol import DeviceInfo

__all__ = ["BASE_ALIGNMENT", "CudaDriverError", "discover", "versions"]

BASE_ALIGNMENT = 256  # every pool offset is a multiple (float4 loads need 16)


class CudaDriverError(DriverError):
    """A CUDA driver call failed (the message names the call and the CUresult)."""


_import_lock = threading.Lock()
_cu_mod: Any = None


def _cu() -> Any:
    """cuda.bindings.driver (importing it does not load libcuda)."""
    global _cu_mod
    if _cu_mod is None:
        with _import_lock:
            if _cu_mod is None:
                from cuda.bindings import driver

                _cu_mod = driver
    return _cu_mod


def _ok(result: Any, what: str) -> Any:
    """The value(s) of a cuda.bindings ``(err, *values)`` result tuple."""
    if result[0]:
        raise CudaDriverError(f"{what} failed: {_err_name(result[0])}")
    return None if len(result) == 1 else result[1] if len(result) == 2 else result[1:]


def _err_name(err: Any) -> str:
    try:
        res, name = _cu().cuGetErrorName(err)  # raw: the names of the raw calls' CUresults
        if not res and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        pass
    return str(err)


def discover() -> tuple[list[Any], list[DeviceInfo], list[list[bool]], str | None]:
    """(cuda.core Devices, their infos, the peer-access matrix, why there are none)."""
    if os.environ.get("POLYJIT_CUDA_DISABLE", "").strip() not in ("", "0"):
        return [], [], [], "disabled by POLYJIT_CUDA_DISABLE"
    try:
        cu = _cu()
        from cuda.core import Device
    except ImportError as e:
        return [], [], [], f"cuda-core / cuda-bindings are not importable ({e}); install polyjit[cuda]"
    try:  # raw cuInit: without a driver, cuda.core's Device() can hang instead of raising
        (err,) = cu.cuInit(0)
    except Exception as e:  # no libcuda: cuda.bindings raises before calling anything
        return [], [], [], f"no CUDA driver: cuInit failed ({type(e).__name__}: {e})"
    if err:
        return [], [], [], f"cuInit failed: {_err_name(err)}"
    # raw: checked like the raw cuInit before it, before cuda.core touches the driver at all
    count = int(_ok(cu.cuDeviceGetCount(), "cuDeviceGetCount"))
    if count == 0:
        return [], [], [], "the CUDA driver reports no devices"
    devices = [Device(k) for k in range(count)]
    peer = [[i != j and devices[i].can_access_peer(j) for j in range(count)] for i in range(count)]
    return devices, [_describe(devices, peer, k) for k in range(count)], peer, None


def _describe(devices: list[Any], peer: list[list[bool]], ordinal: int) -> DeviceInfo:
    dev = devices[ordinal]
    p = dev.properties
    major, minor = tuple(dev.compute_capability)
    # raw: cuda.core 1.2 has no total-memory query
    memory = int(_ok(_cu().cuDeviceTotalMem(int(dev.device_id)), "cuDeviceTotalMem"))
    props: dict[str, Any] = {
        "compute_capability": (major, minor),
        "arch": f"sm_{major}{minor}",
        "sm_count": p.multiprocessor_count,
        "warp_size": p.warp_size,
        "max_threads_per_block": p.max_threads_per_block,
        "max_threads_per_sm": p.max_threads_per_multiprocessor,
        "shared_memory_per_block": p.max_shared_memory_per_block,
        "shared_memory_per_block_optin": p.max_shared_memory_per_block_optin,
        "registers_per_block": p.max_registers_per_block,
        "l2_cache_bytes": p.l2_cache_size,
        "ecc": bool(p.ecc_enabled),
        "integrated": bool(p.integrated),
        "pci_bus_id": f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}",
        "fp64": True,
        "peer_access": tuple(peer[ordinal]),  # can this device reach device j's memory
        "peer_matrix": tuple(tuple(row) for row in peer),
        **versions(),
    }
    return DeviceInfo(name=dev.name, memory_bytes=memory, compute_units=p.multiprocessor_count,
                      base_alignment=BASE_ALIGNMENT, properties=props)


def versions() -> dict[str, Any]:
    """The versions a first run on a GPU must know: driver, NVRTC, cuda.core, cuda.bindings."""
    out: dict[str, Any] = {}
    try:
        # raw: the driver's integer version (13000); cuda.core.system gives a (major, minor) tuple
        out["driver_version"] = int(_ok(_cu().cuDriverGetVersion(), "cuDriverGetVersion"))
    except (PolyjitError, ImportError, RuntimeError):
        out["driver_version"] = None
    try:
        out["nvrtc_version"] = nvrtc_version()
    except PolyjitError:
        out["nvrtc_version"] = None
    for mod in ("cuda.core", "cuda.bindings"):
        try:
            out[mod.replace(".", "_") + "_version"] = __import__(mod, fromlist=["__version__"]).__version__
        except (ImportError, AttributeError):
            out[mod.replace(".", "_") + "_version"] = None
    return out
