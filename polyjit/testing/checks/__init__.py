"""The conformance checks, by topic; :data:`polyjit.testing.CHECKS` lists them in order.

- :mod:`~polyjit.testing.checks.common`: what the checks share (``CheckSkipped``, ``KitNote``,
  the multi-device mark, helpers);
- :mod:`~polyjit.testing.checks.memory`: pools, memset, exhaustion, finalize, memory that comes back;
- :mod:`~polyjit.testing.checks.transfers`: host transfers, device_to_device, merge buffers, copies
  at offsets;
- :mod:`~polyjit.testing.checks.compute`: the catalog and random programs against the reference,
  routines and batches, static bindings;
- :mod:`~polyjit.testing.checks.kernels`: users' own kernels (``Backend.raw_kernel``), spelled per
  dialect in ``RAW_KERNELS``;
- :mod:`~polyjit.testing.checks.streams`: events, ordering across streams and devices, closing;
- :mod:`~polyjit.testing.checks.robustness`: threads, injected faults, misuse.
"""
