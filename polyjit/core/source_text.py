"""User text in generated source: comments and kernel identifiers, the check that nothing
else escaped into a source, and which helper definitions a source needs (core/codegen.py
re-exports these)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

from polyjit.core.errors import CompileError

# ---------------------------------------------------------------------------
# User text in the source: comments and identifiers

# What a comment keeps of user text: printable ASCII that can neither end the comment (no
# '*', '/'), nor splice or end a line (no backslash, no control character), nor spell a
# trigraph (no '?'), nor open a literal (no quotes). Everything else becomes '_'.
_COMMENT_KEEPS = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _-.,:;=+#()[]<>!%&|^~@$"
)
COMMENT_MAX = 160  # characters of user text a comment keeps
IDENTIFIER_MAX = 96  # characters of a kernel name kept as it is
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NOT_IDENTIFIER_CHAR = re.compile(r"[^A-Za-z0-9_]")
# Names a kernel must not take: the implementation's (``_X``, ``__``), math.h's constants
# (``M_PI_2``: a computation "M_PI" has a kernel "M_PI_2") and OpenCL's (``CL_VERSION_1_2``).
_RESERVED = re.compile(r"M_|CL_|_[A-Z_]")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NOT_SOURCE_CHAR = re.compile(r"[^\x20-\x7e\n\t]")
_COMMENTS = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)


def comment_text(text: str, limit: int = COMMENT_MAX) -> str:
    """``text`` made safe to write inside a ``/* */`` comment of any dialect: only the
    characters of a safe printable-ASCII set are kept (the others become ``_``), and at most
    ``limit`` of them (then ``...``). The one place user text (node names, labels) is
    rendered into generated source."""
    if len(text) > limit:
        text = text[: max(0, limit - 3)] + "..."
    return "".join(ch if ch in _COMMENT_KEEPS else "_" for ch in text)


def comment(text: str) -> str:
    """A one-line ``/* ... */`` comment of user text (see :func:`comment_text`)."""
    return f"/* {comment_text(text)} */"


def kernel_identifier(name: str, taken: set[str]) -> str:
    """A kernel's name in the source, unique in ``taken`` (which it joins).

    The name itself when it is a C identifier of at most ``IDENTIFIER_MAX`` characters,
    not taken yet and not in a namespace the headers or compilers own (lowering makes
    kernel names so from names that ``runtime._c_name`` sanitized); otherwise ``k_`` and its
    identifier characters (others become ``_``), cut to fit, and a hash of the whole name,
    so that two names that sanitize alike stay apart."""
    if (_IDENTIFIER.fullmatch(name) and len(name) <= IDENTIFIER_MAX and name not in taken
            and not _RESERVED.match(name)):
        taken.add(name)
        return name
    base = "k_" + _NOT_IDENTIFIER_CHAR.sub("_", name)
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    base = f"{base[: IDENTIFIER_MAX - len(digest) - 8]}_{digest}"
    out, k = base, 1
    while out in taken:
        out, k = f"{base}_{k}", k + 1
    taken.add(out)
    return out


def check_source(text: str, dialect: str) -> None:
    """Generated source is printable ASCII in lines: anything else (a NUL, a CR, a
    non-ASCII character) can only be user text that escaped :func:`comment_text`."""
    bad = _NOT_SOURCE_CHAR.search(text)
    if bad is not None:
        raise CompileError(
            f"the {dialect} dialect wrote the character {bad.group()!r} into generated source "
            "(user text must go through codegen.comment / kernel_identifier)",
            source=text,
        )


def used_helpers(definitions: Sequence[tuple[str, list[str]]], text: str) -> list[str]:
    """The lines of the helper definitions that ``text`` names outside its comments, and of
    those they name in turn, in the order of ``definitions``."""
    lines_of = dict(definitions)
    words_of = {name: set(_WORD.findall(_COMMENTS.sub(" ", "\n".join(lines)))) for name, lines in definitions}
    wanted = [name for name in set(_WORD.findall(_COMMENTS.sub(" ", text))) if name in lines_of]
    used: set[str] = set()
    while wanted:
        name = wanted.pop()
        if name not in used:
            used.add(name)
            wanted += [other for other in words_of[name] if other in lines_of and other not in used]
    return [line for name, lines in definitions if name in used for line in lines]
