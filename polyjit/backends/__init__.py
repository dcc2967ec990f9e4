"""The backend registry.

Built-in backends are imported on first use. Third-party backends register
through the entry-point group ``polyjit.backends``: the entry point names a
callable that returns a ``Backend`` (or a ``Driver``, which is raised into one).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import threading
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, Union

from polyjit.core.device import Device, scoped_device
from polyjit.core.errors import (
    BackendUnavailableError,
    PolyjitError,
    UnknownBackendError,
    UnknownDeviceError,
)
from polyjit.core.protocol import Driver
from polyjit.core.runtime import Backend

_BUILTIN = {
    "cpu": "polyjit.backends.cpu:create_backend",
    "opencl": "polyjit.backends.opencl:create_backend",
    "cuda": "polyjit.backends.cuda:create_backend",
}
_factories: dict[str, Callable[[], Any]] = {}
_instances: dict[str, Backend] = {}
_lock = threading.RLock()


def _after_fork_in_child() -> None:
    """In a forked child none of the drivers' threads exist: the parent's devices refuse
    work here (Backend.after_fork_in_child: ForkedError, where a CPU stream waited forever
    for a worker the child lacks), and get_backend makes new backends, whose devices work.
    Runs on the child's only thread; a lock a parent thread held at the fork is replaced."""
    global _lock, _default
    _lock = threading.RLock()
    _instances.clear()  # (their devices: core.runtime's own fork hook)
    if isinstance(_default, Device):  # set_default_device's, by name: the child's new one
        _default = _default.device_id


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _load_target(target: str) -> Callable[[], Any]:
    module, _, attr = target.partition(":")
    factory: Callable[[], Any] = getattr(importlib.import_module(module), attr)
    return factory


def register_backend(name: str, factory: Callable[[], Backend | Driver]) -> None:
    """Register a backend factory under ``name`` (replaces an earlier one of that name)."""
    with _lock:
        _factories[name] = factory
        _instances.pop(name, None)


def backends() -> list[str]:
    """Names of every registered backend, available here or not."""
    names = [n for n in _BUILTIN if _module_exists(_BUILTIN[n])]
    names += [n for n in _factories if n not in names]
    for ep in entry_points(group="polyjit.backends"):
        if ep.name not in names:
            names.append(ep.name)
    return names


def _module_exists(target: str) -> bool:
    return importlib.util.find_spec(target.partition(":")[0]) is not None


def get_backend(name: str = "cpu") -> Backend:
    """The backend of that name (one instance per process)."""
    with _lock:
        hit = _instances.get(name)
        if hit is not None:
            return hit
        factory = _factories.get(name)
        if factory is None:
            eps = {ep.name: ep for ep in entry_points(group="polyjit.backends")}
            if name in eps:
                factory = eps[name].load()
            elif name in _BUILTIN and _module_exists(_BUILTIN[name]):
                try:
                    factory = _load_target(_BUILTIN[name])
                except ImportError as e:
                    raise BackendUnavailableError(f"backend {name!r} cannot be imported: {e}") from e
            else:
                raise UnknownBackendError(f"no backend named {name!r}; registered: {', '.join(backends())}")
        try:
            made = factory()
        except PolyjitError:
            raise
        except Exception as e:
            raise BackendUnavailableError(f"backend {name!r} failed to start: {e}") from e
        backend = made if isinstance(made, Backend) else Backend(made)
        _instances[name] = backend
        return backend


DeviceLike = Union[Device, Backend, str, None]
DEFAULT_DEVICE_ENV = "POLYJIT_DEVICE"
_default: Device | str | None = None


def device(spec: DeviceLike = None) -> Device:
    """A device by name: ``"cuda:1"`` (``"cuda"`` is ``"cuda:0"``), a Device, a Backend (its
    device 0), or None for the default device (:func:`default_device`)."""
    if isinstance(spec, Device):
        return spec
    if isinstance(spec, Backend):
        return spec.get_device(0)
    if spec is None:
        return default_device()
    if not isinstance(spec, str):
        raise UnknownDeviceError(f"not a device: {spec!r} (a name such as 'cpu:0' or 'cuda:1', or a Device)")
    name, _, ordinal = spec.strip().partition(":")
    if ordinal and not ordinal.isdigit():
        raise UnknownDeviceError(f"{spec!r}: the ordinal after ':' must be a number ('{name}:0')")
    return get_backend(name).get_device(int(ordinal) if ordinal else 0)


def default_device() -> Device:
    """The device APIs use when given none: the innermost ``with device:`` of this thread, else
    :func:`set_default_device`'s, else ``$POLYJIT_DEVICE``, else ``cpu:0``."""
    scoped = scoped_device()
    if scoped is not None:
        return scoped
    if _default is not None:
        return device(_default)
    return device(os.environ.get(DEFAULT_DEVICE_ENV) or "cpu:0")


def set_default_device(spec: DeviceLike) -> None:
    """Set the process's default device (None: back to ``$POLYJIT_DEVICE``, else ``cpu:0``)."""
    global _default
    _default = device(spec) if spec is not None else None


def available_backends() -> list[str]:
    """Backends that start here and have at least one device."""
    out = []
    for name in backends():
        try:
            if get_backend(name).num_devices() > 0:
                out.append(name)
        except PolyjitError:
            continue
    return out
