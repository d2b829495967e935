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
# pages whose snippets use optional extras: skipped without them
# Pages whose snippets use an optional extra: the page's test skips, naming it, when it is absent.
NEEDS = {
    "docs/bring-your-own-model.md": {"flax": "flax", "equinox": "equinox"},
    "docs/inspect.md": {"matplotlib": "plot"},
}


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_doc_snippets_run_and_print_what_they_show(page):
    for module, extra in NEEDS.get(page, {}).items():
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


# Pages whose code the lead keeps (they are reformatted with the core, separately).
WIDTH_EXEMPT = {"docs/hooks.md", "docs/capture-and-state.md"}
CODE_WIDTH = 100  # characters; docs/stylesheets/extra.css widens the page to fit them


@pytest.mark.parametrize("page", [p for p in PAGES if p.startswith("docs/") and p not in WIDTH_EXEMPT])
def test_code_lines_fit_the_page(page):
    """Python code lines fit the page; printed-output lines (``# ...`` at column 0) may not."""
    long = [
        line
        for block in re.findall(r"```(?:python|py)[^\n]*\n(.*?)```", (ROOT / page).read_text(), re.S)
        for line in block.splitlines()
        if len(line) > CODE_WIDTH and not line.startswith("# ")
    ]
    assert not long, long
