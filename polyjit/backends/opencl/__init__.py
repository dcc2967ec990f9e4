"""The OpenCL backend on pyopencl: ``driver.py`` (platforms, queues, programs, launches) and
``dialect.py`` (OpenCL C)."""

from polyjit.backends.opencl.dialect import OpenCLDialect
from polyjit.backends.opencl.driver import (
    OpenCLDriver,
    create_backend,
    pip_pocl_icd,
    working_pocl_icd,
)

__all__ = ["OpenCLDialect", "OpenCLDriver", "create_backend", "pip_pocl_icd", "working_pocl_icd"]
