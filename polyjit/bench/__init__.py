"""The benchmark suites of ``polyjit bench SUITE`` (one module per suite; ``common`` and
``timing`` are their shared helpers). Each suite measures polyjit beside its peers in the
same run and prints the targets it checks; see docs/benchmarks.md."""
