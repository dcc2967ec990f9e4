"""A tiny PNG writer (zlib + numpy, no matplotlib) and a line chart drawn into pixels."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]

# 3x5 glyphs for axis labels: each row of a glyph is 3 bits, most significant on the left.
_FONT = {
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7),
    "4": (5, 5, 7, 1, 1), "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 1, 1, 1),
    "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7), ".": (0, 0, 0, 0, 2), "-": (0, 0, 7, 0, 0),
    "e": (0, 7, 7, 4, 7), "+": (0, 2, 7, 2, 0), " ": (0, 0, 0, 0, 0),
}


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(rgb: Array) -> bytes:
    """PNG bytes of an (height, width, 3) uint8 image (8-bit RGB, no filtering)."""
    img = np.ascontiguousarray(rgb, dtype=np.uint8)
    if img.ndim != 3 or img.shape[2] != 3:
        raise ValueError(f"expected an (h, w, 3) image, got {img.shape}")
    h, w, _ = img.shape
    rows = np.concatenate([np.zeros((h, 1), np.uint8), img.reshape(h, w * 3)], axis=1)  # filter 0 per row
    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header)
            + _chunk(b"IDAT", zlib.compress(rows.tobytes(), 9)) + _chunk(b"IEND", b""))


def write_png(path: str | Path, rgb: Array) -> None:
    Path(path).write_bytes(encode_png(rgb))


def _text(img: Array, x: int, y: int, text: str, color: tuple[int, int, int], scale: int = 2) -> None:
    for ch in text:
        glyph = _FONT.get(ch, _FONT[" "])
        for r, bits in enumerate(glyph):
            for c in range(3):
                if bits >> (2 - c) & 1:
                    y0, x0 = y + r * scale, x + c * scale
                    img[y0 : y0 + scale, x0 : x0 + scale] = color
        x += 4 * scale


def _line(img: Array, p: tuple[float, float], q: tuple[float, float], color: tuple[int, int, int]) -> None:
    n = int(max(abs(q[0] - p[0]), abs(q[1] - p[1]))) + 2
    xs = np.rint(np.linspace(p[0], q[0], n)).astype(int)
    ys = np.rint(np.linspace(p[1], q[1], n)).astype(int)
    h, w, _ = img.shape
    ok = (xs >= 0) & (xs < w) & (ys >= 0) & (ys < h)
    img[ys[ok], xs[ok]] = color
    img[np.clip(ys[ok] + 1, 0, h - 1), xs[ok]] = color  # two pixels thick


def _label(v: float) -> str:
    return f"{v:.3g}" if 1e-3 <= abs(v) < 1e4 or v == 0 else f"{v:.1e}"


def line_chart(values: Sequence[float] | Array, width: int = 640, height: int = 360, log_y: bool = False) -> Array:
    """An RGB image of a line chart of ``values`` with min/max labels on the y axis."""
    img = np.full((height, width, 3), 255, np.uint8)
    left, right, top, bottom = 70, 15, 15, 30
    pw, ph = width - left - right, height - top - bottom
    grey, blue, black = (200, 200, 200), (31, 119, 180), (0, 0, 0)
    for k in range(5):  # horizontal grid
        y = top + k * ph // 4
        img[y, left : left + pw] = grey
    img[top : top + ph + 1, left] = black
    img[top + ph, left : left + pw + 1] = black
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return img
    if log_y:
        v = np.log10(np.maximum(v, 1e-12))
    lo, hi = float(v.min()), float(v.max())
    span = hi - lo or 1.0
    xs = left + np.linspace(0, pw, max(len(v), 2))[: len(v)]
    ys = top + ph - (v - lo) / span * ph
    for k in range(len(v) - 1):
        _line(img, (xs[k], ys[k]), (xs[k + 1], ys[k + 1]), blue)
    shown = (lambda t: 10.0 ** t) if log_y else (lambda t: t)
    _text(img, 4, top, _label(shown(hi)), black)
    _text(img, 4, top + ph - 10, _label(shown(lo)), black)
    _text(img, left, top + ph + 8, "0", black)
    steps = str(len(values))
    _text(img, left + pw - 8 * len(steps), top + ph + 8, steps, black)
    return img
