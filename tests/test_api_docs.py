"""Every public name has a docstring and a place in the API reference, and the site builds strictly.

The public names are the ``__all__`` of ``vjpkit``, ``vjpkit.nn``, ``vjpkit.train`` and
``vjpkit.inspect``. ``docs/api/`` has one page per module, each rendering its module with a
mkdocstrings ``::: module`` directive, which documents every name in the module's ``__all__``;
the slow test builds the site with ``mkdocs build --strict`` and checks each name's anchor in
the HTML of its module's page.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
API_DIR = ROOT / "docs" / "api"
PAGE = {
    "vjpkit": "vjpkit",
    "vjpkit.nn": "nn",
    "vjpkit.train": "train",
    "vjpkit.inspect": "inspect",
    "vjpkit.curvature": "curvature",
    "vjpkit.stats": "stats",
}
MODULES = ("vjpkit", "vjpkit.nn", "vjpkit.train", "vjpkit.inspect", "vjpkit.curvature", "vjpkit.stats")


def _public_modules() -> list:
    """The documented modules that declare ``__all__`` (an ImportError here fails the test)."""
    found = []
    for name in MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "__all__"):
            found.append(module)
    return found


PUBLIC = [(module.__name__, name) for module in _public_modules() for name in module.__all__]


def _directives() -> dict[str, str]:
    """``{module: options text}`` for every ``::: module`` directive of the API pages."""
    found = {}
    for page in sorted(API_DIR.glob("*.md")):
        for match in re.finditer(r"^:::[ \t]+(\S+)[ \t]*\n((?:[ \t]+\S.*\n?)*)", page.read_text(), re.M):
            found[match.group(1)] = match.group(2)
    return found


def _own_docstring(obj) -> str:
    """The object's own docstring: never inherited, never a namedtuple's generated one."""
    doc = obj.__doc__ if isinstance(obj, type) else getattr(obj, "__doc__", None)
    doc = (doc or "").strip()
    fields = getattr(obj, "_fields", None)
    if isinstance(obj, type) and fields is not None and doc == f"{obj.__name__}({', '.join(fields)})":
        return ""  # collections.namedtuple / typing.NamedTuple's placeholder
    return doc


def test_the_public_surface_is_found():
    modules = {module.__name__ for module in _public_modules()}
    assert {"vjpkit", "vjpkit.nn", "vjpkit.train"} <= modules
    assert len(PUBLIC) > 40


@pytest.mark.parametrize(("module", "name"), PUBLIC, ids=[f"{m}.{n}" for m, n in PUBLIC])
def test_every_public_name_has_a_docstring(module, name):
    obj = getattr(importlib.import_module(module), name)
    assert _own_docstring(obj), f"{module}.{name} has no docstring of its own"


def test_api_page_renders_every_public_module():
    directives = _directives()
    for module in _public_modules():
        assert module.__name__ in directives, f"docs/api/ has no '::: {module.__name__}' directive"
        page = API_DIR / f"{PAGE[module.__name__]}.md"
        assert f"::: {module.__name__}" in page.read_text(), f"{page} does not render {module.__name__}"


@pytest.mark.parametrize(("module", "name"), PUBLIC, ids=[f"{m}.{n}" for m, n in PUBLIC])
def test_api_page_does_not_filter_out_public_names(module, name):
    options = _directives().get(module, "")
    members = re.search(r"members:\s*(\[[^\]]*\]|(?:\n\s*-\s*\S+)+)", options)
    if members:  # an explicit member list must name it
        assert re.search(rf"\b{re.escape(name)}\b", members.group(1)), (
            f"'{name}' missing from {module}'s members"
        )
    assert not name.startswith("_")  # mkdocs.yml filters out private names only


def _missing(module_name: str) -> str | None:
    """``module_name`` if it cannot be imported, else None.

    ``find_spec("a.b")`` imports ``a`` and raises ``ModuleNotFoundError`` when ``a`` is
    missing (it returns None only when ``a`` exists and ``a.b`` does not): both mean absent.
    """
    try:
        return None if importlib.util.find_spec(module_name) else module_name
    except ModuleNotFoundError:
        return module_name


def _built_site(tmp_path) -> pathlib.Path:
    """The site: ``$VJPKIT_DOCS_SITE`` when CI has built it (``mkdocs build --strict``, its log
    checked for warnings there: the docs are built once per CI run), else built here."""
    given = os.environ.get("VJPKIT_DOCS_SITE")
    if given:
        return pathlib.Path(given)
    missing = [
        m for m in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python", "material") if _missing(m)
    ]
    if missing:
        pytest.skip(f"the docs toolchain is not installed ({', '.join(missing)}): pip install -e '.[docs]'")
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(site),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = run.stdout + run.stderr
    assert run.returncode == 0, log
    assert "WARNING" not in log, log
    return site


@pytest.mark.slow
def test_mkdocs_build_is_strict_clean_and_documents_every_public_name(tmp_path):
    site = _built_site(tmp_path)
    html = {m: (site / "api" / page / "index.html").read_text() for m, page in PAGE.items()}
    # a submodule named in vjpkit's __all__ (vjpkit.nn) is documented on its own page
    absent = [f"{m}.{n}" for m, n in PUBLIC if f'id="{m}.{n}"' not in html.get(f"{m}.{n}", html[m])]
    assert not absent, f"not in the rendered API reference: {absent}"
    for module in _public_modules():
        assert f'id="{module.__name__}"' in html[module.__name__]
    # a multi-line Returns section is one entry (returns_multiple_items: false), not one per line
    fit_returns = html["vjpkit.train"].split('id="vjpkit.train.fit"')[1].split("Returns:")[1][:2000]
    assert fit_returns.count("<li") <= 1 and fit_returns.count("<tr") <= 2, fit_returns
