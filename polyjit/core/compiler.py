"""Helpers shared by backends that shell out to a compiler."""

from __future__ import annotations

import re


def source_excerpt(source: str, log: str, context: int = 3, max_faults: int = 3) -> str:
    """The numbered source lines around each line a compiler log points at (``file:LINE:``)."""
    lines = source.splitlines()
    faults: list[int] = []
    for m in re.finditer(r"(?::|\()(\d+)(?::\d+)?(?::|\))", log):
        n = int(m.group(1))
        if 1 <= n <= len(lines) and n not in faults:
            faults.append(n)
        if len(faults) >= max_faults:
            break
    if not faults:  # no line numbers: show the start of the source
        faults = [1]
    out: list[str] = []
    for n in faults:
        lo, hi = max(1, n - context), min(len(lines), n + context)
        for i in range(lo, hi + 1):
            mark = ">>" if i == n else "  "
            out.append(f"{mark} {i:5d} | {lines[i - 1]}")
        out.append("   ...")
    return "\n".join(out)
