"""The CUDA backend: ``driver.py`` (devices, memory, streams, launches), ``dialect.py`` (CUDA C),
NVRTC and graph replay."""

from polyjit.backends.cuda.dialect import CudaDialect
from polyjit.backends.cuda.driver import *  # noqa: F403
from polyjit.backends.cuda.driver import __all__ as _driver_all

__all__ = ["CudaDialect", *_driver_all]
