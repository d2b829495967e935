"""Every python block of the README and of every page in docs/ runs, and prints exactly its ``# `` lines.

Convention for the docs: a python block is run top to bottom in one namespace per page, and
the whole-line comments starting with ``# `` in a block are what that block prints.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]


# Pages whose snippets use an optional extra: the page's test skips, naming it, when it is absent.
NEEDS = {"docs/inspect.md": ("matplotlib", "plot")}


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_doc_snippets_run_and_print_what_they_show(page):
    if page in NEEDS:
        module, extra = NEEDS[page]
        pytest.importorskip(module, reason=f'{page} needs {module}: pip install -e ".[{extra}]"')
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S)
    namespace: dict = {}
    for block in blocks:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(block, page, "exec"), namespace)
            jax.effects_barrier()
        shown = [line[2:] for line in block.splitlines() if line.startswith("# ")]
        assert [line.rstrip() for line in printed.getvalue().splitlines()] == shown, block
