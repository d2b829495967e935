"""Test tiers, one XLA compilation cache for every xdist worker, and a per-file CPU-time report.

* **Tiers.** ``python -m pytest -q`` (the README's command) runs the *default tier*: every
  feature at least once, jitted and eagerly, in under 8 minutes on 2 cores on Python 3.13 (README).
  ``python -m pytest -q --full`` (CI) runs the *full tier*: every test. What only the full tier
  runs (``_full_only``): tests marked ``slow``; the files in ``FULL_ONLY_FILES`` (subprocess and
  multi-device scripts, the BackPACK and kfac-jax oracles, the examples, the docs pages and the
  benchmark smoke runs); and the eager twin (``eager`` in the test id: the ``maybe_jit``
  fixture, or a test's own ``eager``/``jit`` parameter) of every test but one in each file, so
  that each file's feature still runs eagerly once: the first that has one, or the test a file
  names in ``DEFAULT_TIER_EAGER`` (a cheaper one, where the first's eager run is slow).
  ``--tier-complement`` runs exactly what the default tier leaves out (CI: the default tier,
  then its complement, is the full tier once).
* **One compilation cache.** The controller makes one directory and hands it to its workers
  (``pytest_configure_node``), so a program compiled by one worker is a cache hit in the other;
  The cache has no size cap: a capped cache rescans its whole directory on every write (a
  default tier went from about 8 to over 15 minutes). Without a cap JAX does not lock the
  files, so a worker could read an entry the other is still writing: a truncated executable
  crashed a worker once (a segfault in ``compilation_cache.get_executable_and_time``, jax
  0.10.1). ``_atomic_cache_writes`` makes each write a rename of a finished file, so a reader
  sees a whole entry or none.
  ``VJPKIT_TEST_XLA_CACHE`` names a directory to use (and keep) instead: CI shares one cache
  between the two runs of a stage. Otherwise nothing carries over between sessions.
* **Memory mappings.** After each test file, JAX's caches are cleared once the worker holds a
  third of the kernel's limit on memory mappings (``_release_executables``): the executables
  they keep alive hold mapped code, and the full tier on jax 0.10.1 ran a worker into the limit.
* **Fast code generation.** The default tier sets ``--xla_backend_optimization_level=0`` in
  ``XLA_FLAGS`` (``_fast_codegen``; read when JAX starts its CPU backend, at the first
  computation, after ``pytest_configure``): its run is mostly XLA compiling, and LLVM's
  optimisations are a fifth of it. The HLO passes (fusion, simplification) are unchanged, so the
  programs are the same up to instruction selection; the full tier compiles with the defaults.
* **LAPACK threads.** ``OPENBLAS_NUM_THREADS=1`` unless set (before jax loads scipy's OpenBLAS,
  which its CPU LAPACK calls use): OpenBLAS's threads spin against XLA's and the other worker's.
* **CPU time per file.** ``--cpu-report N`` prints the N test files that took the most CPU time
  (the worker's, XLA's compiler threads included, plus the subprocesses a test ran and waited
  for) and wall time, summed over their tests' setup, call and teardown.
"""

from __future__ import annotations

import collections
import gc
import importlib
import importlib.util
import os
import pathlib
import shutil
import tempfile

# LAPACK (K-FAC's inverses, eigh) runs on scipy's OpenBLAS, whose threads contend with XLA's and
# the other worker's: a refresh took 10-20x longer (docs/curvature.md, "LAPACK threads")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")

# Whole files only the full tier runs: subprocess and multi-device scripts, the BackPACK and
# kfac-jax oracles, the examples, the docs pages and the benchmark smoke runs.
FULL_ONLY_FILES = frozenset(
    {
        # subprocess and multi-device scripts
        "test_sharding.py", "test_plain_sharded.py", "test_curvature_sharded.py",
        "test_mesh_delivery.py", "test_resume.py", "test_multiprocess_fit.py",
        # oracles
        "test_curvature_backpack.py", "test_curvature_kfac_jax.py", "test_kfac_jax_matcher.py",
        # examples
        "test_backward_seed_example.py", "test_explain_shapes_example.py", "test_foreign_examples.py",
        "test_grad_moderation_example.py", "test_kfac_digits_example.py", "test_per_example_dp_example.py",
        "test_plain_jax_example.py", "test_train_digits_example.py",
        # docs pages, figures and benchmark smoke runs
        "test_docs.py", "test_doc_images.py", "test_benchmarks_smoke.py", "test_kfac_floor.py",
    }
)  # fmt: skip

_CACHE_KEY = "vjpkit_xla_cache"
_OWN_CACHE: list[str] = []


@pytest.fixture
def x64():
    """float64 for the test's duration (strict promotion stays on); modules that compare in
    float64 throughout use it with ``pytestmark = pytest.mark.usefixtures("x64")``."""
    with jax.enable_x64(True):
        yield


def pytest_addoption(parser):
    group = parser.getgroup("vjpkit")
    group.addoption("--full", action="store_true", help="run the full tier (every test), as CI does")
    group.addoption(
        "--tier-complement", action="store_true", help="run only what the default tier leaves out"
    )
    group.addoption(
        "--cpu-report", type=int, default=0, metavar="N", help="print the N test files with the most CPU time"
    )


def _cache_dir() -> str:
    given = os.environ.get("VJPKIT_TEST_XLA_CACHE")
    if given:
        os.makedirs(given, exist_ok=True)
        return given
    if not _OWN_CACHE:
        _OWN_CACHE.append(tempfile.mkdtemp(prefix="vjpkit-tests-xla-cache-"))
    return _OWN_CACHE[0]


def _atomic_cache_writes() -> None:
    """JAX's uncapped persistent cache writes an entry in place (``LRUCache.put``); written to a
    temporary file and renamed instead, another worker never reads a partial entry. Left as it
    is if JAX's cache class is not the one this knows (another JAX version)."""
    if importlib.util.find_spec("jax._src.lru_cache") is None:
        return
    lru_cache = importlib.import_module("jax._src.lru_cache")
    cls, suffix = getattr(lru_cache, "LRUCache", None), getattr(lru_cache, "_CACHE_SUFFIX", None)
    if cls is None or suffix is None or getattr(cls.put, "_vjpkit_atomic", False):
        return
    original = cls.put

    def put(self, key, value):
        path = getattr(self, "path", None)
        if getattr(self, "eviction_enabled", True) or not isinstance(path, pathlib.Path) or not key:
            return original(self, key, value)  # a capped cache locks its files itself
        target = path / f"{key}{suffix}"
        if target.exists():
            return None
        tmp = path / f".{key}{suffix}.{os.getpid()}.tmp"
        tmp.write_bytes(value)
        tmp.replace(target)
        return None

    put._vjpkit_atomic = True
    cls.put = put


def pytest_configure(config):
    _atomic_cache_writes()
    worker = getattr(config, "workerinput", None)
    path = worker[_CACHE_KEY] if worker is not None and _CACHE_KEY in worker else _cache_dir()
    # Eager calls of a hooked transform dispatch small programs that miss JAX's in-memory caches;
    # the persistent cache (keyed by the program's HLO: a hit returns what compiling would have)
    # compiles each once for the whole session, across workers.
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    config._vjpkit_cpu = collections.defaultdict(lambda: [0.0, 0.0, 0])
    if not (config.getoption("--full") or config.getoption("--tier-complement")):
        _fast_codegen()


def _fast_codegen() -> None:
    """The default tier compiles with LLVM's optimisation level 0 (``XLA_FLAGS``), unless the
    flag is already set: its tests are mostly compile time, which this cuts by about a fifth.
    XLA's own (HLO) passes, fusion included, still run; the full tier compiles as users do."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist controller: every worker uses the controller's cache directory."""
    node.workerinput[_CACHE_KEY] = _cache_dir()


def pytest_unconfigure(config):
    if getattr(config, "workerinput", None) is None:
        for path in _OWN_CACHE:
            shutil.rmtree(path, ignore_errors=True)


# --- tiers ---------------------------------------------------------------------------------------


def _is_eager_twin(item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and "eager" in callspec.id.split("-")


def _full_only(items) -> list[bool]:
    """For each item, whether only the full tier runs it (see the module's contract)."""
    out, first_eager, slow_only = [], {}, {}
    for item in items:
        path = item.nodeid.split("::")[0]
        name = os.path.basename(path)
        full = name in FULL_ONLY_FILES or item.get_closest_marker("slow") is not None
        if _is_eager_twin(item):
            base = item.originalname if hasattr(item, "originalname") else item.name
            chosen = getattr(item.module, "DEFAULT_TIER_EAGER", None)
            if chosen is not None and not callable(getattr(item.module, chosen, None)):
                raise pytest.UsageError(f"{path}: DEFAULT_TIER_EAGER = {chosen!r} names no test there")
            if base == chosen:  # its eager twins must not all be slow, or the file runs none
                slow_only[path] = slow_only.get(path, True) and full
            if not full:
                full = (chosen or first_eager.setdefault(path, base)) != base
        out.append(full)
    for path, slow in slow_only.items():
        if slow:
            raise pytest.UsageError(f"{path}: the eager twin DEFAULT_TIER_EAGER names is marked slow")
    return out


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full"):
        return
    complement = config.getoption("--tier-complement")
    keep, dropped = [], []
    for item, full in zip(items, _full_only(items)):
        (keep if full == complement else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def pytest_report_header(config):
    if config.getoption("--full"):
        return "vjpkit tests: full tier"
    if config.getoption("--tier-complement"):
        return "vjpkit tests: what the default tier leaves out (--tier-complement)"
    return "vjpkit tests: default tier (`--full` runs every test)"


# --- CPU time per file ---------------------------------------------------------------------------


def _cpu_s() -> float:
    """CPU seconds of this process and of the subprocesses it has waited for (examples, scripts)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _timed(item):
    start = _cpu_s()
    yield
    item.user_properties.append(("cpu_s", _cpu_s() - start))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _timed(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _timed(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield from _timed(item)
    if nextitem is None or nextitem.path != item.path:
        _release_executables()


def _count_lines(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return None


def _map_limit() -> int | None:
    try:
        return int(pathlib.Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None


_MAP_LIMIT = _map_limit()


def _release_executables() -> None:
    """After a test file, JAX's caches are cleared when this process holds more than a third of
    the kernel's limit on memory mappings (``vm.max_map_count``, 65530 by default): each XLA:CPU
    executable a cache keeps alive holds mapped code, and a worker of the full tier on jax 0.10.1
    passed 57,000 mappings by 80% of the run. At the limit an ``mmap`` fails inside XLA, and a
    worker died of it in two CI runs (an abort in ``compilation_cache.put_executable_and_time``,
    a segfault in ``get_executable_and_time``), after which xdist hung."""
    count = None if _MAP_LIMIT is None else _count_lines("/proc/self/maps")
    if count is not None and count > _MAP_LIMIT // 3:
        jax.clear_caches()
        gc.collect()


def pytest_runtest_logreport(report):
    cfg = _CONFIG[0] if _CONFIG else None
    if cfg is None:
        return
    entry = cfg._vjpkit_cpu[report.nodeid.split("::")[0]]
    entry[1] += report.duration
    if report.when == "teardown":
        entry[0] += sum(v for k, v in report.user_properties if k == "cpu_s")
        entry[2] += 1


_CONFIG: list = []


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    _CONFIG[:] = [session.config]


def pytest_terminal_summary(terminalreporter, config):
    n = config.getoption("--cpu-report")
    if not n or getattr(config, "workerinput", None) is not None:
        return
    rows = sorted(config._vjpkit_cpu.items(), key=lambda kv: -kv[1][0])
    total_cpu = sum(v[0] for _, v in rows)
    terminalreporter.section(f"CPU time per test file (top {n} of {len(rows)}; total {total_cpu:.0f} s)")
    for path, (cpu, wall, count) in rows[:n]:
        terminalreporter.write_line(f"{cpu:8.1f} s CPU {wall:8.1f} s wall {count:5d} tests  {path}")


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    """Returns jax.jit or the identity: every test using it runs both ways."""
    return jax.jit if request.param else (lambda f: f)
