"""The Python blocks of the README and the docs site, as the docs tests of both tiers read them.

A block preceded by ``<!-- test: python -->`` is a complete example run as a script in a fresh
directory, ``<!-- test: torchrun N -->`` one run under ``torch.distributed.run`` with N
processes (gloo on CPU), ``<!-- test: ray -->`` one run as a driver of the Ray instance of
tests/integration/test_ray.py (``RAY_ADDRESS``); every other Python block is a fragment."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(?:<!-- test: (?P<how>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)


def _blocks() -> list[tuple[str, str | None, str]]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            line = text[: m.start()].count("\n") + 1
            found.append((f"{page.relative_to(ROOT)}:{line}", m.group("how"),
                          textwrap.dedent(m.group("code"))))
    return found


BLOCKS = _blocks()
RUNNABLE = [(where, how, code) for where, how, code in BLOCKS if how and how != "ray"]
RAY_EXAMPLES = [(where, code) for where, how, code in BLOCKS if how == "ray"]
FRAGMENTS = [(where, code) for where, how, code in BLOCKS if not how]
