"""Import hygiene, checked from source with ``ast`` (nothing here imports vjpkit).

1. No import cycle inside ``vjpkit/``, lazy imports included: every ``import`` and
   ``from ... import ...`` anywhere in a file (module level, inside functions, under
   ``if TYPE_CHECKING:``) is an edge, and so is ``importlib.import_module("literal")``.
2. An ``ImportError`` inside vjpkit fails a test, never skips it: ``pytest.importorskip`` is
   only for optional third-party packages, an ``except ImportError`` that skips guards only
   third-party imports, and conftest.py swallows no ``ImportError``.

Edge rules of the module graph (restricted to ``vjpkit.*``):

* ``import a.b.c`` and ``import_module("a.b.c")`` are edges to ``a.b.c``.
* ``from X import n1, n2`` is an edge to ``X.n`` for every ``n`` that is a submodule of ``X``,
  and an edge to ``X`` itself (its ``__init__``) when some ``n`` is not a submodule, or when
  ``X`` is not the importer itself or one of its parent packages. So ``from . import _sib``
  is an edge to ``_sib`` only, and ``from .pkg import name`` is an edge to ``pkg`` (and to
  ``pkg.name`` if that is a submodule).
* Reaching a module also runs the ``__init__`` of each package on the way (``import a.b.c``
  runs ``a`` and ``a.b``): those packages are edges too, except the importer's own parent
  packages, which Python imported before the importer and which no statement asked for.
* A module importing itself is not an edge.
"""

from __future__ import annotations

import ast
import itertools
import pathlib
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "vjpkit"
TESTS = ROOT / "tests"

# ---------------------------------------------------------------------------------------------
# 1. the module graph of vjpkit/ and its cycles
# ---------------------------------------------------------------------------------------------


def _is_ours(name: str, package: str = PACKAGE) -> bool:
    return name == package or name.startswith(package + ".")


def _modules(package_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """``{dotted module name: file}`` for every importable ``.py`` file under ``package_dir``."""
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if all(part.isidentifier() for part in parts):
            found[".".join(parts)] = path
    return found


def _where(stack: list[str]) -> str:
    return ", ".join(stack) if stack else "module level"


def _walk_imports(tree: ast.AST) -> Iterator[tuple[ast.AST, str]]:
    """Every import statement / ``import_module`` call in ``tree``, with where it sits."""

    def visit(node: ast.AST, stack: list[str]) -> Iterator[tuple[ast.AST, str]]:
        for child in ast.iter_child_nodes(node):
            inner = stack
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                inner = [*stack, f"in def {child.name}"]
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                inner = [*stack, "under TYPE_CHECKING"]
            if isinstance(child, ast.Import | ast.ImportFrom) or _literal_import_call(child):
                yield child, _where(stack)
            yield from visit(child, inner)

    yield from visit(tree, [])


def _literal_import_call(node: ast.AST) -> str | None:
    """The module of ``importlib.import_module("m")`` / ``__import__("m")``, else None."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    first = node.args[0]
    literal = isinstance(first, ast.Constant) and isinstance(first.value, str)
    if name in ("import_module", "__import__") and literal and not first.value.startswith("."):
        return first.value
    return None


def _targets(node: ast.AST, module: str, is_package: bool, known: set[str]) -> Iterator[str]:
    """The modules an import statement in ``module`` explicitly names (before prefix edges)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    if not isinstance(node, ast.ImportFrom):
        literal = _literal_import_call(node)
        if literal:
            yield literal
        return
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        if node.level - 1 >= len(package):
            return  # beyond the top-level package: an ImportError at runtime, not an edge
        parts = package[: len(package) - (node.level - 1)]
        base = ".".join([*parts, *([node.module] if node.module else [])])
    else:
        base = node.module or ""
    from_namespace = False
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        if alias.name != "*" and submodule in known:
            yield submodule
        else:
            from_namespace = True
    own_ancestor = module == base or module.startswith(base + ".")
    if from_namespace or not own_ancestor:
        yield base


def import_graph(package_dir: pathlib.Path) -> dict[str, dict[str, str]]:
    """``{module: {imported module: "file:line (where)"}}`` for the package at ``package_dir``."""
    modules = _modules(package_dir)
    known = set(modules)
    package = package_dir.name
    graph: dict[str, dict[str, str]] = {name: {} for name in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        ancestors = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
        for node, where in _walk_imports(tree):
            for target in _targets(node, module, is_package, known):
                if not _is_ours(target, package):
                    continue
                # the target, and each package Python runs on the way that is not our own parent
                pieces = target.split(".")
                reached = [".".join(pieces[:i]) for i in range(1, len(pieces) + 1)]
                for name in reached:
                    implicit = name != target
                    if name in known and name != module and not (implicit and name in ancestors):
                        origin = f"{path.relative_to(package_dir.parent)}:{node.lineno} ({where})"
                        graph[module].setdefault(name, origin)
    return graph


def _successors(graph: dict[str, object]) -> dict[str, list[str]]:
    nodes = sorted(set(graph) | {s for succ in graph.values() for s in succ})
    return {n: sorted(graph.get(n, ())) for n in nodes}


def tangles(graph: dict[str, object]) -> list[list[str]]:
    """The strongly connected components that hold a cycle, each sorted, in sorted order (Tarjan).

    ``graph`` maps each node to an iterable of its successors (a dict's keys do).
    """
    succ = _successors(graph)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            components.append(sorted(component))

    for v in succ:
        if v not in index:
            strongconnect(v)
    return sorted(c for c in components if len(c) > 1 or c[0] in succ[c[0]])


def find_cycles(graph: dict[str, object]) -> list[list[str]]:
    """One concrete cycle ``[a, b, ..., a]`` per tangle: a shortest one through its smallest node."""
    succ = _successors(graph)
    cycles = []
    for component in tangles(graph):
        members = set(component)
        start = component[0]
        parent: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in parent:
            following = []
            for v in frontier:
                for w in succ[v]:
                    if w in members and w not in parent:
                        parent[w] = v
                        following.append(w)
            frontier = following
        backwards = [start, parent[start]]
        while backwards[-1] != start:
            backwards.append(parent[backwards[-1]])
        cycles.append(backwards[::-1])
    return cycles


def _cycle_report(graph: dict[str, dict[str, str]], cycles: list[list[str]]) -> str:
    lines = [f"{len(cycles)} import cycle(s) inside {PACKAGE}/ (lazy imports count):"]
    for cycle, component in zip(cycles, tangles(graph), strict=True):
        lines.append("  " + " -> ".join(cycle))
        lines.extend(f"      {a} -> {b}: {graph[a][b]}" for a, b in itertools.pairwise(cycle))
        if len(component) > len(cycle) - 1:
            lines.append(f"    (one path of a tangle of {len(component)}: {', '.join(component)})")
    return "\n".join(lines)


def test_find_cycles_finds_a_cycle_and_only_real_ones():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"a": {"a"}}) == [["a", "a"]]
    # two separate cycles, each reported once; the shortest path through the smallest node
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": {"a"}, "x": {"y"}, "y": {"z"}, "z": {"x"}}
    assert find_cycles(graph) == [["a", "b", "a"], ["x", "y", "z", "x"]]
    assert tangles(graph) == [["a", "b", "c"], ["x", "y", "z"]]


def test_import_graph_follows_the_edge_rules(tmp_path):
    files = {
        "pkg/__init__.py": "from ._a import A\nfrom . import sub\n",
        # lazy and TYPE_CHECKING imports count; `from . import _b` is an edge to _b, not to pkg
        "pkg/_a.py": (
            "from typing import TYPE_CHECKING\nimport os\nfrom . import _b\n"
            "if TYPE_CHECKING:\n    from .sub import _s\n"
            "def f():\n    import pkg._c\n"
        ),
        "pkg/_b.py": "",
        "pkg/_c.py": "import importlib\nmod = importlib.import_module('pkg._b')\n",
        "pkg/sub/__init__.py": "X = 1\n",
        # `from .. import A` needs pkg's namespace: an explicit edge to the parent package
        "pkg/sub/_s.py": "from .. import A\nfrom . import X\n",
        "pkg/sub/_t.py": "from .. import _b\nfrom pkg import sub\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path / "pkg")
    edges = {module: set(targets) for module, targets in graph.items()}
    assert edges == {
        "pkg": {"pkg._a", "pkg.sub"},
        "pkg._a": {"pkg._b", "pkg._c", "pkg.sub", "pkg.sub._s"},
        "pkg._b": set(),
        "pkg._c": {"pkg._b"},
        "pkg.sub": set(),
        "pkg.sub._s": {"pkg", "pkg.sub"},
        "pkg.sub._t": {"pkg._b", "pkg.sub"},
    }
    assert graph["pkg._a"]["pkg._c"] == "pkg/_a.py:7 (in def f)"
    assert graph["pkg._a"]["pkg.sub._s"] == "pkg/_a.py:5 (under TYPE_CHECKING)"
    assert find_cycles(graph) == [["pkg", "pkg._a", "pkg.sub._s", "pkg"]]


def test_no_import_cycle_inside_vjpkit():
    graph = import_graph(ROOT / PACKAGE)
    assert len(graph) > 1, f"no modules found under {ROOT / PACKAGE}"
    cycles = find_cycles(graph)
    assert not cycles, _cycle_report(graph, cycles)


# ---------------------------------------------------------------------------------------------
# 2. an ImportError inside vjpkit fails a test, never skips it
# ---------------------------------------------------------------------------------------------

_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
_SKIPS = {"skip", "xfail", "importorskip"}
_COLLECTION_HOOKS = {"pytest_ignore_collect", "pytest_make_collect_report", "pytest_collectreport"}


def _pytest_names(nodes: list[ast.AST]) -> tuple[set[str], dict[str, str]]:
    """Names bound to the pytest module, and ``{local name: pytest function}`` of from-imports."""
    modules, functions = {"pytest"}, {}
    for node in nodes:
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "pytest"}
        elif isinstance(node, ast.ImportFrom) and node.module == "pytest" and not node.level:
            functions |= {a.asname or a.name: a.name for a in node.names}
    return modules, functions


def _pytest_call(node: ast.AST, modules: set[str], functions: dict[str, str]) -> str | None:
    """``"skip"`` for ``pytest.skip(...)`` (or a from-imported ``skip(...)``), etc.; else None."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in modules:
        return func.attr
    if isinstance(func, ast.Name):
        return functions.get(func.id)
    return None


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    caught = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    names = {c.attr if isinstance(c, ast.Attribute) else getattr(c, "id", None) for c in caught}
    return bool(names & _IMPORT_ERRORS)


def _imports_in(statements: list[ast.stmt]) -> Iterator[tuple[int, str | None]]:
    """``(line, module)`` of every import in ``statements``; module None when not a literal."""
    for statement in statements:
        for node in ast.walk(statement):
            if isinstance(node, ast.Import):
                yield from ((node.lineno, a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                # relative imports in tests/ name tests' own helpers, never vjpkit
                yield node.lineno, ("." * node.level) + (node.module or "")
            elif isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if name in ("import_module", "__import__", "importorskip", "find_spec"):
                    first = node.args[0] if node.args else None
                    literal = isinstance(first, ast.Constant) and isinstance(first.value, str)
                    yield node.lineno, first.value if literal else None


def _vjpkit_bindings(nodes: list[ast.AST]) -> set[str]:
    """Local names bound to vjpkit modules or objects (``import vjpkit``, ``from vjpkit.nn import X``)."""
    bound = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            bound |= {a.asname or a.name.partition(".")[0] for a in node.names if _is_ours(a.name)}
        elif isinstance(node, ast.ImportFrom) and not node.level and _is_ours(node.module or ""):
            bound |= {a.asname or a.name for a in node.names}
    return bound


def skip_problems(source: str, filename: str = "<test>", conftest: bool = False) -> list[str]:
    """Where a test file's source could turn an ImportError inside vjpkit into a skip."""
    if not any(word in source for word in ("importorskip", "except", "collect_ignore", *_COLLECTION_HOOKS)):
        return []  # nothing below can fire: spare the parse
    tree = ast.parse(source, filename=filename)
    nodes = list(ast.walk(tree))
    modules, functions = _pytest_names(nodes)
    ours = _vjpkit_bindings(nodes)
    problems = []
    for node in nodes:
        called = _pytest_call(node, modules, functions)
        if called == "importorskip":
            args = [*node.args[:1], *(k.value for k in node.keywords if k.arg == "modname")]
            for arg in args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _is_ours(arg.value):
                    problems.append(
                        f"{filename}:{node.lineno}: pytest.importorskip({arg.value!r}) skips when vjpkit "
                        "fails to import; import it plainly (importorskip is for optional third-party "
                        "packages)"
                    )
            if conftest:
                problems.append(f"{filename}:{node.lineno}: importorskip in conftest skips whole directories")
        if not isinstance(node, ast.Try | ast.TryStar):
            continue
        for handler in node.handlers:
            if not _catches_import_error(handler):
                continue
            body = [n for statement in handler.body for n in ast.walk(statement)]
            skips = any(_pytest_call(n, modules, functions) in _SKIPS for n in body)
            reraises = any(isinstance(n, ast.Raise) for n in body)
            caught = ast.unparse(handler.type) if handler.type else "(bare)"
            where = f"{filename}:{handler.lineno}: except {caught}"
            if conftest and not reraises:
                problems.append(f"{where} in conftest swallows ImportError; let it propagate")
                continue
            if not skips:
                continue
            for line, module in _imports_in(node.body):
                if module is None:
                    problems.append(f"{where} skips, and the import at line {line} is not a literal name")
                elif _is_ours(module):
                    problems.append(f"{where} skips when {module!r} (line {line}) fails to import")
            used = sorted({n.id for s in node.body for n in ast.walk(s) if isinstance(n, ast.Name)} & ours)
            if used:
                problems.append(f"{where} skips, and the try block runs vjpkit code ({', '.join(used)})")
    if conftest:
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in _COLLECTION_HOOKS:
                problems.append(f"{filename}:{node.lineno}: {node.name} in conftest can hide a test module")
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if isinstance(target, ast.Name) and target.id.startswith("collect_ignore"):
                    problems.append(f"{filename}:{node.lineno}: {target.id} in conftest hides test modules")
    return problems


BAD_TEST = """
import pytest
from pytest import importorskip as skip_unless
from vjpkit import nn

def test_a():
    rec = pytest.importorskip("vjpkit.inspect._recorder")

def test_b():
    skip_unless(modname="vjpkit")

def test_c():
    try:
        from vjpkit.train import fit
    except ImportError:
        pytest.skip("no fit")

def test_d():
    try:
        import flax
        nn.Dense(3)
    except (ModuleNotFoundError, OSError) as error:
        pytest.skip(str(error))
"""

GOOD_TEST = """
import importlib
import pytest
import vjpkit

flax = pytest.importorskip("flax", reason="optional")

def test_a():
    try:
        import equinox as eqx
        linen = importlib.import_module("flax.linen")
    except ImportError:
        pytest.skip("equinox is optional")
    try:
        vjpkit.nn.Dense(3)
    except ValueError:
        pytest.skip("not an import error")
"""

BAD_CONFTEST = """
import pytest
try:
    import vjpkit
except Exception:
    pass
collect_ignore = ["test_x.py"]
def pytest_ignore_collect(collection_path, config):
    return False
"""


def test_skip_scanner_flags_vjpkit_skips_and_passes_third_party_ones():
    problems = skip_problems(BAD_TEST, "bad.py")
    assert len(problems) == 4, "\n".join(problems)
    assert any("bad.py:7: pytest.importorskip('vjpkit.inspect._recorder')" in p for p in problems)
    assert any("pytest.importorskip('vjpkit')" in p for p in problems)
    assert any("skips when 'vjpkit.train'" in p for p in problems)
    assert any("runs vjpkit code (nn)" in p for p in problems)
    assert skip_problems(GOOD_TEST, "good.py") == []
    assert len(skip_problems(BAD_CONFTEST, "conftest.py", conftest=True)) == 3
    assert skip_problems("try:\n    import jax\nexcept ImportError:\n    raise\n", conftest=True) == []


def test_tests_never_skip_on_an_import_error_inside_vjpkit():
    files = sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)
    assert files, f"no test files under {TESTS}"
    problems = []
    for path in files:
        name = str(path.relative_to(ROOT))
        problems += skip_problems(path.read_text(encoding="utf-8"), name, conftest=path.name == "conftest.py")
    for path in (ROOT / "conftest.py",):
        if path.exists():
            problems += skip_problems(path.read_text(encoding="utf-8"), "conftest.py", conftest=True)
    assert not problems, "an ImportError inside vjpkit would skip, not fail:\n" + "\n".join(problems)


def test_conftest_does_not_swallow_import_error():
    path = TESTS / "conftest.py"
    assert path.exists(), f"{path} is gone: move this check to where the conftest went"
    assert skip_problems(path.read_text(encoding="utf-8"), "tests/conftest.py", conftest=True) == []
