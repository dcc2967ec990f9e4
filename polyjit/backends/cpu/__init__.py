"""The CPU backend: C with OpenMP through the system compiler, streams as C worker threads.

- ``driver.py``: the Driver (pools, streams, events, load, launch);
- ``dialect.py``: the C dialect (spellings) and ``tiles.py`` what only the CPU does with
  kernels (vector tiles, column and staged reductions, streaming stores, block transposes);
- ``native.py`` + ``runtime.c``: the stream runtime in C; ``compiler.py``: the C compiler
  through the verified compile cache; ``host.py``: this host's CPU.
"""

from polyjit.backends.cpu.dialect import CpuDialect
from polyjit.backends.cpu.driver import CpuDriver, create_backend, split_cores
from polyjit.backends.cpu.host import cpu_model

__all__ = ["CpuDialect", "CpuDriver", "cpu_model", "create_backend", "split_cores"]
