"""Every public name has a docstring and a place in the API reference, and the site builds strictly.

The public names are the ``__all__`` of ``vjpkit``, ``vjpkit.nn``, ``vjpkit.train`` and
``vjpkit.inspect``. ``docs/api.md`` renders each of those modules with a mkdocstrings
``::: module`` directive, which documents every name in the module's ``__all__``; the slow
test builds the site with ``mkdocs build --strict`` and checks each name's anchor in the HTML.
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
API_PAGE = ROOT / "docs" / "api.md"
MODULES = ("vjpkit", "vjpkit.nn", "vjpkit.train", "vjpkit.inspect")


def _public_modules() -> list:
    """The documented modules that exist and declare ``__all__``."""
    found = []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        if hasattr(module, "__all__"):
            found.append(module)
    return found


PUBLIC = [(module.__name__, name) for module in _public_modules() for name in module.__all__]


def _directives() -> dict[str, str]:
    """``{module: options text}`` for every ``::: module`` directive of the API page."""
    text = API_PAGE.read_text()
    found = {}
    for match in re.finditer(r"^:::[ \t]+(\S+)[ \t]*\n((?:[ \t]+\S.*\n?)*)", text, re.M):
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
        assert module.__name__ in directives, f"docs/api.md has no '::: {module.__name__}' directive"


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


@pytest.mark.slow
def test_mkdocs_build_is_strict_clean_and_documents_every_public_name(tmp_path):
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
    html = (site / "api" / "index.html").read_text()
    absent = [f"{m}.{n}" for m, n in PUBLIC if f'id="{m}.{n}"' not in html]
    assert not absent, f"not in the rendered API reference: {absent}"
    for module in _public_modules():
        assert f'id="{module.__name__}"' in html
