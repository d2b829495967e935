"""Every script in examples/ is in the gallery (docs/examples.md), with what it needs, and the
README's tour links the gallery with the number of scripts.

Private helpers (``examples/_*.py``) are not examples. A script missing from the gallery, a
listed script that does not exist, a count that is off (the gallery's or the README's), or a
"needs" entry that leaves out an extra the script imports (Flax, Equinox, scikit-learn,
matplotlib) fails.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))
NUMBERS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
]


def rows(table_text: str, pattern: str) -> dict[str, str]:
    """``{script: needs cell}`` from the table rows whose first cell matches ``pattern``."""
    found = {}
    for line in table_text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(pattern, cells[0]) if cells else None
        if match:
            assert match[1] not in found, f"{match[1]} is listed twice"
            found[match[1]] = cells[2]
    return found


README_TEXT = (ROOT / "README.md").read_text()
GALLERY_TEXT = (ROOT / "docs" / "examples.md").read_text()
GALLERY = rows(GALLERY_TEXT, r"`examples/(\w+)\.py`")


def test_every_script_is_listed_in_the_gallery():
    assert SCRIPTS, "no example scripts found"
    assert sorted(GALLERY) == SCRIPTS, (
        f"docs/examples.md: missing {set(SCRIPTS) - set(GALLERY)}, extra {set(GALLERY) - set(SCRIPTS)}"
    )


def test_gallery_count_is_the_number_of_scripts():
    count = re.match(r"# Examples gallery\s+(\w+) scripts", GALLERY_TEXT)
    assert count, "docs/examples.md no longer opens with '<number> scripts'"
    assert count[1].lower() == NUMBERS[len(SCRIPTS)], (count[1], len(SCRIPTS))


def test_the_readme_links_the_gallery_with_the_number_of_scripts():
    """The README lists no scripts itself (the gallery does): its tour links the gallery."""
    entry = re.search(
        r"^- \*\*Examples\*\* \(\[docs/examples\.md\]\(docs/examples\.md\)\): (\w+) scripts in `examples/`",
        README_TEXT,
        re.M,
    )
    assert entry, "README.md's tour no longer links docs/examples.md with '<number> scripts in `examples/`'"
    assert entry[1].lower() == NUMBERS[len(SCRIPTS)], (entry[1], len(SCRIPTS))


def required_extras(script: str) -> set[str]:
    """The extras a script's imports need: any one of each alternative set must be named."""
    source = (ROOT / "examples" / f"{script}.py").read_text()
    modules = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module.split(".")[0])
    needs = set()
    if "flax" in modules:
        needs.add("flax")
    if "equinox" in modules:
        needs.add("equinox")
    if "_digits" in modules or "sklearn" in modules:
        needs.add("examples")  # scikit-learn
    if "matplotlib" in modules or re.search(r"\bplot_(gradient_flow|histograms|backward_shapes)\b", source):
        needs.add("plot|examples")  # matplotlib: in both extras
    return needs


@pytest.mark.parametrize("script", SCRIPTS)
def test_needs_names_the_extras_the_script_imports(script):
    if script not in GALLERY:
        return  # reported by the test above
    named = set(re.findall(r"\w+", GALLERY[script].split("[", 1)[1])) if "[" in GALLERY[script] else set()
    for extra in required_extras(script):
        assert named & set(extra.split("|")), (
            f"docs/examples.md: {script} needs the {extra} extra, listed as {GALLERY[script]!r}"
        )
