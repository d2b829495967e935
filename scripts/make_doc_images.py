"""Remake every image in docs/img from the code that draws it, and check that none is left over.

Run from anywhere: ``python scripts/make_doc_images.py`` (about 20 seconds on 2 CPU cores).
Needs the ``examples`` extra (scikit-learn and matplotlib): ``pip install -e ".[examples]"``.

Each image the docs show (``![...](img/NAME)`` in ``README.md`` or ``docs/*.md``) must come from
one of ``MAKERS``: an example script run with its arguments and ``--out docs/img``. The script
runs every maker, then fails if an image the docs reference was not made, or if ``docs/img``
holds a file that no maker writes (a stale picture). ``--out DIR`` writes elsewhere (the check
of ``docs/img``'s contents is then skipped). ``tests/test_doc_images.py`` checks what the docs
say about these pictures against the same runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
IMG = ROOT / "docs" / "img"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# example script -> the arguments the docs' pictures are made with (before --out) and what it writes
MAKERS = {
    "plot_gradients": dict(args=[], files=("gradient_flow.png", "histograms.png", "backward_shapes.png")),
}


def referenced_images() -> dict[str, list[str]]:
    """``{image file name: [pages that show it]}`` for every ``img/NAME`` image link in the docs."""
    found: dict[str, list[str]] = {}
    for page in PAGES:
        for name in re.findall(r"!\[[^\]]*\]\((?:docs/)?img/([^)\s]+)\)", page.read_text()):
            found.setdefault(name, []).append(str(page.relative_to(ROOT)))
    return found


def load_example(name: str):
    """Imports ``examples/<name>.py`` with its folder on ``sys.path``, as running the script would."""
    folder = str(ROOT / "examples")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> dict[str, pathlib.Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(IMG), help="where to write the images (default: docs/img)")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import matplotlib

    matplotlib.use("Agg")  # files only, whatever the machine's display
    made: dict[str, pathlib.Path] = {}
    for name, maker in MAKERS.items():
        print("== examples/" + " ".join([f"{name}.py", *maker["args"], "--out", str(out)]))
        result = load_example(name).main([*maker["args"], "--out", str(out)])
        written = [pathlib.Path(p).name for p in result["paths"]]
        if sorted(written) != sorted(maker["files"]):
            raise SystemExit(f"examples/{name}.py wrote {written}, MAKERS says {list(maker['files'])}")
        made.update({file: out / file for file in written})

    problems = [
        f"{name} (shown in {', '.join(pages)}) is made by no maker"
        for name, pages in referenced_images().items()
        if name not in made
    ]
    if out.resolve() == IMG.resolve():
        problems += [
            f"docs/img/{p.name} is made by no maker" for p in sorted(IMG.iterdir()) if p.name not in made
        ]
    if problems:
        raise SystemExit("make_doc_images: " + "; ".join(problems))
    print(f"made {len(made)} images in {out}: {', '.join(sorted(made))}")
    return made


if __name__ == "__main__":
    main()
