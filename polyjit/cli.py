"""The ``polyjit`` command: devices, selftest, demo, bench.

It also holds the argument types its subcommands' parsers share (the demo's, the bench
suites'): a misused option ends in argparse's one-line error and exit status 2, before any
work, never in a traceback after it."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import polyjit
from polyjit.backends import backends, get_backend
from polyjit.core.errors import PolyjitError


def _whole(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def count(text: str) -> int:
    """An option that counts something (steps, elements, rows): a whole number of at least 1."""
    return _whole(text, 1)


def natural(text: str) -> int:
    """A whole number of at least 0 (a seed)."""
    return _whole(text, 0)


def duration(text: str) -> float:
    """A duration: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0, got {text}")
    return value


def subset_of(allowed: Sequence[str], what: str) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated subset of ``allowed`` (``none`` or empty: nothing);
    anything else is argparse's error (exit status 2)."""
    def parse(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",") if s.strip() and s.strip() != "none"]
        bad = [s for s in items if s not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what}: {', '.join(bad)} (choose from {', '.join(allowed)})")
        return list(dict.fromkeys(items))
    return parse


def file_problem(path: str) -> str | None:
    """Why a file could not be written at ``path`` (checked before the work that makes it)."""
    target = Path(path)
    if target.is_dir():
        return f"{path}: is a directory"
    parent = target.parent
    if not parent.is_dir():
        return f"{path}: no directory {parent}"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{path}: cannot write in {parent}"
    return None


def output_file(text: str) -> str:
    """An option naming a file to write (``--json``): refused up front if it cannot be written."""
    problem = file_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def cmd_devices(args: argparse.Namespace) -> int:
    rows = [("backend", "device", "name", "memory", "compute units", "details")]
    notes = []
    for name in backends():
        try:
            be = get_backend(name)
            n = be.num_devices()
        except PolyjitError as e:
            notes.append(f"{name}: unavailable ({e})")
            continue
        if n == 0:
            reason = getattr(be.driver, "unavailable_reason", "") or "no devices"
            notes.append(f"{name}: 0 devices ({reason})")
        for k in range(n):
            dev = be.get_device(k)
            skip = {"memory_bytes", "compute_units"}
            details = ", ".join(f"{key}={val}" for key, val in dev.properties.items() if key not in skip)
            rows.append((name, str(k), dev.name, fmt_bytes(dev.info.memory_bytes),
                         str(dev.info.compute_units), details))
    widths = [max(len(r[c]) for r in rows) for c in range(5)]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r[:5], widths)) + "  " + r[5])
    for note in notes:
        print(note)
    if "cuda" in backends():  # what a first run on a GPU must know, with a driver or without
        try:
            from polyjit.backends.cuda import versions

            print("cuda versions: " + ", ".join(f"{k}={v}" for k, v in versions().items()))
        except ImportError as e:
            print(f"cuda versions: unavailable ({e})")
    return 0


def _shown(text: object, stream: object) -> str:
    """A path (or a message naming one) as text the stream can always print: bytes of the name
    that are not UTF-8, and characters the stream cannot encode, as backslash escapes (a strict
    UTF-8 stdout raised UnicodeEncodeError, after `cache clear` had cleared)."""
    plain = os.fsencode(str(text)).decode("utf-8", "backslashreplace")
    encoding = getattr(stream, "encoding", None) or "utf-8"
    return plain.encode(encoding, "backslashreplace").decode(encoding)


_REFUSED_SAYS = {"info": "to show", "clear": "cleared", "trim": "trimmed"}


def cmd_cache(args: argparse.Namespace) -> int:
    from polyjit.core.cache import cache_clear, cache_dir, cache_info, cache_trim, refused_cache_dir

    refused = refused_cache_dir()
    if refused is not None:  # not the private temporary directory a process would use instead
        place, why = refused
        print(_shown(f"polyjit cache: refusing the configured cache directory {place}: {why}; "
                     f"nothing {_REFUSED_SAYS[args.action]} (polyjit compiles into a "
                     "private temporary directory while it is refused)", sys.stderr), file=sys.stderr)
        return 1
    if args.action == "clear":
        print(f"removed {cache_clear()} entries from {_shown(cache_dir(), sys.stdout)}")
        return 0
    if args.action == "trim":
        print(f"removed {cache_trim()} least recently used entries from {_shown(cache_dir(), sys.stdout)}")
        return 0
    info = cache_info()
    bound = info["max_bytes"]
    limit = "no bound" if bound is None else f"bound {fmt_bytes(bound)}"  # type: ignore[arg-type]
    print(f"compile cache: {_shown(info['directory'], sys.stdout)} ({limit}, $POLYJIT_CACHE_MAX_BYTES)")
    for space, counts in info["namespaces"].items():  # type: ignore[attr-defined]
        line = f"  {space:10s} {counts['entries']:6d} entries  {fmt_bytes(counts['bytes'])}"
        if counts.get("orphans"):  # an entry without its hash, or a hash without its entry
            line += f"; {counts['orphans']} orphaned files {fmt_bytes(counts['orphan_bytes'])}"
        if counts.get("temporary"):  # builds in progress, or left by a killed process
            line += f"; {counts['temporary']} temporary files {fmt_bytes(counts['temporary_bytes'])}"
        print(line)
    return 0


def cmd_gpucheck(args: argparse.Namespace) -> int:
    from polyjit.gpucheck import main as gpucheck_main

    return gpucheck_main(args.rest)


def cmd_selftest(args: argparse.Namespace) -> int:
    from polyjit.testing import run_selftest

    failures = run_selftest(args.backend, verbose=args.verbose)
    return 1 if failures else 0


def cmd_demo(args: argparse.Namespace) -> int:
    from polyjit.demo import main as demo_main

    return demo_main(args)


def bench_suites() -> list[str]:
    """The suites of ``polyjit.bench`` (its modules, less the shared helpers)."""
    import pkgutil

    import polyjit.bench

    return sorted(m.name for m in pkgutil.iter_modules(polyjit.bench.__path__)
                  if m.name not in ("common", "timing"))


def cmd_bench(args: argparse.Namespace) -> int:
    suites = bench_suites()
    if args.suite not in suites:  # never import a module a user string names
        print(f"no benchmark suite {args.suite!r}; there are: {', '.join(suites)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"polyjit.bench.{args.suite}")
    return int(module.main(args.rest) or 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="polyjit", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"polyjit {polyjit.__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("devices", help="list backends and their devices")
    d.set_defaults(func=cmd_devices)
    s = sub.add_parser("selftest", help="run the conformance kit on a backend")
    s.add_argument("--backend", default="cpu")
    s.add_argument("-v", "--verbose", action="store_true")
    s.set_defaults(func=cmd_selftest)
    m = sub.add_parser("demo", help="train an MLP data-parallel on every device of a backend")
    from polyjit.demo import add_arguments

    add_arguments(m)
    m.set_defaults(func=cmd_demo)
    c = sub.add_parser("cache", help="what the compile cache holds (info), empty it (clear), or remove its "
                       "least recently used entries down to 80%% of its bound (trim)")
    c.add_argument("action", choices=("info", "clear", "trim"), nargs="?", default="info")
    c.set_defaults(func=cmd_cache)
    g = sub.add_parser("gpucheck", help="everything a first run on a GPU checks, into one report")
    g.add_argument("rest", nargs=argparse.REMAINDER)
    g.set_defaults(func=cmd_gpucheck)
    b = sub.add_parser("bench", help="run a benchmark suite: cpu, opencl, cuda, ...")
    b.add_argument("suite", nargs="?", default="cpu")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except PolyjitError as e:
        print(f"polyjit: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
