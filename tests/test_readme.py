"""The README's example runs and prints what it says."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs_as_written() -> None:
    text = README.read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S)
    assert block is not None
    code = block.group(1)
    assert len(code.strip().splitlines()) <= 12
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {})
    expected = re.search(r"# (\[.*\])", code)
    assert expected is not None
    assert out.getvalue().strip() == expected.group(1)


def test_readme_gives_exactly_two_setup_commands() -> None:
    text = README.read_text()
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)```", setup, re.S)
    assert [c.strip() for c in commands] == [
        "pip install -e . && polyjit demo",
        "pip install -e '.[opencl,cuda,dev,mpi,interop]' && python -m pytest",
    ]
