"""Naming devices: a Device, a Backend (its device 0), "cpu" or "cuda:1", or None (the
default device: ``polyjit.default_device()``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

from polyjit.backends import device as named_device
from polyjit.backends import get_backend
from polyjit.core.errors import UnknownDeviceError
from polyjit.core.runtime import Backend, Device

DeviceLike = Union[Device, Backend, str, None]


def resolve_device(device: DeviceLike) -> Device:
    """A device by name or object; None is the default device (``polyjit.default_device``)."""
    return named_device(device)


def resolve_devices(devices: Sequence[DeviceLike] | Backend | str | None) -> list[Device]:
    """Several devices: a list of device names/objects, or every device of a backend (default cpu)."""
    if devices is None:
        devices = get_backend("cpu")
    if isinstance(devices, str) and ":" not in devices:
        devices = get_backend(devices)
    if isinstance(devices, Backend):
        return devices.devices()
    if isinstance(devices, (str, Device)):
        return [resolve_device(devices)]
    out = [resolve_device(d) for d in devices]
    if not out:
        raise UnknownDeviceError("no devices given")
    if len({d.device_id for d in out}) != len(out):
        raise UnknownDeviceError(f"a device is listed twice: {[d.device_id for d in out]}")
    return out
