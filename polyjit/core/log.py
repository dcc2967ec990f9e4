"""polyjit's log: the ``polyjit`` logger (standard ``logging``).

It says, at DEBUG, where generated source goes, what compiles (the command), cache hits and
misses, links and launches. ``POLYJIT_LOG=debug`` (or ``info``, ``warning``; ``1`` means
debug) attaches a handler to stderr at import; otherwise configure ``logging`` as usual.
"""

from __future__ import annotations

import logging
import os

__all__ = ["LOG_ENV", "logger"]

LOG_ENV = "POLYJIT_LOG"
logger = logging.getLogger("polyjit")


def _configure() -> None:
    level = os.environ.get(LOG_ENV, "").strip().lower()
    if not level or level == "0":
        return
    value = logging.DEBUG if level in ("1", "debug", "true") else getattr(logging, level.upper(), logging.DEBUG)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("polyjit %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(value)


_configure()


_source_dir = None


def log_source(what: str, text: str, suffix: str) -> None:
    """At DEBUG: write generated source where a user can open it, and say where."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    import hashlib
    import tempfile
    from pathlib import Path

    global _source_dir
    if _source_dir is None:  # a directory of our own: /tmp is everyone's
        _source_dir = Path(tempfile.mkdtemp(prefix="polyjit-source-"))
    path = _source_dir / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}{suffix}"
    path.write_text(text)
    logger.debug("%s: generated source in %s", what, path)
