"""README's usage example runs as written (it is the first thing a new user copies)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path


def test_readme_usage_example_runs():
    text = (Path(__file__).parents[1] / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "README.md", "exec"), {})
    assert "chosen deepgemm" in out.getvalue()
