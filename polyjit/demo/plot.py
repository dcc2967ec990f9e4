"""Terminal output for training loops: a progress bar and an ASCII line chart."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import numpy as np


def ascii_chart(values: Sequence[float] | np.ndarray[Any, Any], width: int = 60, height: int = 12, title: str = "") -> str:
    """A line chart of ``values`` in text: the y axis labelled with min and max, one column per
    bucket of consecutive values (their mean)."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return f"{title}\n(no values)"
    width = max(1, min(width, v.size))  # a column per value at most: no empty bucket
    buckets = np.array_split(v, width)
    cols = np.array([b.mean() for b in buckets])
    lo, hi = float(cols.min()), float(cols.max())
    span = hi - lo or 1.0
    rows = np.rint((cols - lo) / span * (height - 1)).astype(int)
    grid = [[" "] * width for _ in range(height)]
    for x, r in enumerate(rows):
        grid[height - 1 - r][x] = "*"
    label_w = max(len(f"{hi:.4g}"), len(f"{lo:.4g}"))
    lines = [title] if title else []
    for k, row in enumerate(grid):
        label = f"{hi:.4g}" if k == 0 else f"{lo:.4g}" if k == height - 1 else ""
        lines.append(f"{label:>{label_w}} |{''.join(row)}")
    lines.append(f"{'':>{label_w}} +{'-' * width}")
    n = str(len(values))
    lines.append(f"{'':>{label_w}}  0{n:>{max(width - 1, len(n) + 1)}}")  # "0 1" under one column
    return "\n".join(lines)


class Progress:
    """``[#####-----] 120/300 loss 0.4321  51234 samples/s``: redrawn in place on a terminal,
    one line per tenth of the run otherwise (logs stay short)."""

    def __init__(self, total: int, width: int = 30, stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.width = width
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self.samples = 0
        self._next_line = 0

    def update(self, step: int, loss: float, samples: int) -> None:
        self.samples += samples
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        done = int(self.width * step / self.total)
        text = (f"[{'#' * done}{'-' * (self.width - done)}] {step}/{self.total} "
                f"loss {loss:.4f}  {self.samples / elapsed:8.0f} samples/s")
        if self.tty:
            self.stream.write("\r" + text)
            if step >= self.total:
                self.stream.write("\n")
            self.stream.flush()
        elif step >= self._next_line or step >= self.total:
            self.stream.write(text + "\n")
            self._next_line = step + max(self.total // 10, 1)

    @property
    def rate(self) -> float:
        return self.samples / max(time.perf_counter() - self.start, 1e-9)
