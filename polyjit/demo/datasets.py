"""Small synthetic data sets for examples, the demo and benchmarks."""

from __future__ import annotations

from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]


def two_spirals(n: int, noise: float = 0.05, turns: float = 1.5, seed: int = 0) -> tuple[Array, Array]:
    """Two interleaved spirals in the plane: (points float32 (n, 2), labels int32 (n,)), classes alternating."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n, dtype=np.int32) % 2
    t = np.sqrt(rng.uniform(0.05, 1.0, n)) * turns * 2 * np.pi
    r = t / (turns * 2 * np.pi)
    angle = t + np.pi * labels
    pts = np.stack([r * np.cos(angle), r * np.sin(angle)], axis=1)
    pts += rng.normal(0.0, noise, pts.shape)
    return pts.astype(np.float32), labels


ALPHABET = "abcdefghijklmnopqrstuvwxyz "


def encode_text(text: str) -> Array:
    """Lower-case letters and spaces as int32 codes 0..26; every other character becomes a space
    and runs of spaces collapse to one."""
    cleaned = "".join(ch if ch in ALPHABET else " " for ch in text.lower())
    cleaned = " ".join(cleaned.split())
    lookup = {ch: k for k, ch in enumerate(ALPHABET)}
    return np.array([lookup[ch] for ch in cleaned], np.int32)


def decode_text(codes: Array) -> str:
    return "".join(ALPHABET[int(c)] for c in codes)


def context_windows(codes: Array, context: int) -> tuple[Array, Array]:
    """All (previous ``context`` symbols, next symbol) pairs of a sequence."""
    n = len(codes) - context
    idx = np.arange(n)[:, None] + np.arange(context)[None, :]
    return codes[idx].astype(np.int32), codes[context:].astype(np.int32)
