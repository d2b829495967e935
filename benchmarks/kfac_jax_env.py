"""The side environment in which kfac-jax runs: its own venv with jax 0.9.1, used as a subprocess.

kfac-jax 0.0.8, the package index's only release, raises ``ValueError: too many values to
unpack`` in its curvature update on jax >= 0.9.2, and vjpkit needs jax >= 0.10.1: the two cannot
share a process. ``side_python()`` returns the Python of an environment in which kfac-jax works
(``kfac_jax_side.py`` runs there; nothing here imports kfac-jax), or ``None``, with the reason in
``side_reason()``, when none can be had (no network, a pip error): callers then skip.

Where it comes from, in order:

1. ``$VJPKIT_KFAC_JAX_PYTHON``, if set and that Python imports kfac_jax;
2. a venv under ``$VJPKIT_KFAC_JAX_VENV`` (default ``~/.cache/vjpkit/kfac-jax-venv``), made once
   with ``python3.11 -m venv`` (``$VJPKIT_KFAC_JAX_BASE_PYTHON`` names another interpreter) and
   ``pip install`` of ``PINS``, and reused while its stamp file names the same pins. It takes about
   670 MB (jaxlib, scipy, tfp-nightly, ...); making it took 45 s, 106 s and 112 s on the development
   machine (2 shared cores, most wheels from the package index's local mirror there). A failed
   attempt is remembered for an hour (a stamp beside the venv; remove it to retry at once) so
   that a test run without network does not retry pip in every process. Concurrent callers
   (pytest-xdist workers) wait on a file lock while one of them makes it.

``python benchmarks/kfac_jax_env.py`` prints the Python (or the reason) and how long it took.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

# The exact set that works, pinned so that the side stays as verified. pip resolves kfac-jax's
# requirements on its own beside jax 0.9.1 (nothing extra is needed); these are the versions it
# chose when this was written (kfac-jax imports distrax, which imports tfp-nightly's JAX
# substrate; chex and optax are kfac-jax's own requirements), so a later release of any of them
# cannot change the oracle.
PINS = (
    "jax==0.9.1",
    "jaxlib==0.9.1",
    "kfac-jax==0.0.8",
    "distrax==0.1.9",
    "tfp-nightly==0.26.0.dev20261027",
    "chex==0.1.92",
    "optax==0.2.8",
    "dm-tree==0.1.10",
    "numpy==2.4.6",
)
PYTHON = os.environ.get("VJPKIT_KFAC_JAX_BASE_PYTHON", "python3.11")
FAILURE_TTL_S = 3600
PIP_TIMEOUT_S = 1800
_CHECK = "import jax, kfac_jax, optax; assert jax.__version__ == '0.9.1', jax.__version__"

READY, OWNED = "vjpkit-ready.json", "vjpkit-owned"

_cache: dict[str, tuple[str | None, str]] = {}


def venv_dir() -> pathlib.Path:
    env = os.environ.get("VJPKIT_KFAC_JAX_VENV")
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path("~/.cache/vjpkit/kfac-jax-venv").expanduser()


def _imports(python: str, check: str = "import kfac_jax") -> str | None:
    """None if ``python -c check`` succeeds, else the tail of its error."""
    try:
        proc = subprocess.run(
            [python, "-c", check], capture_output=True, text=True, timeout=300, env=_side_env()
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python}: {e}"
    if proc.returncode == 0:
        return None
    return f"{python} -c {check!r} failed: {proc.stderr.strip()[-800:]}"


def _side_env() -> dict[str, str]:
    """The environment for the side Python: this process's, without a venv or PYTHONPATH of ours."""
    env = dict(os.environ)
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(name, None)
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def side_env() -> dict[str, str]:
    """The environment in which to run the side Python (``subprocess.run(..., env=side_env())``)."""
    return _side_env()


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(cmd: list[str], timeout: float) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_side_env())
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{' '.join(cmd[:4])} ...: {e}"
    if proc.returncode:
        tail = (proc.stderr or proc.stdout).strip()[-1500:]
        return f"{' '.join(cmd[:4])} ... exited {proc.returncode}: {tail}"
    return None


def _ready(root: pathlib.Path) -> str | None:
    """The venv's Python if it was made here with the current pins."""
    python, stamp = root / "bin" / "python", root / READY
    try:
        if python.exists() and json.loads(stamp.read_text()).get("pins") == list(PINS):
            return str(python)
    except (OSError, ValueError):
        pass
    return None


def _create(root: pathlib.Path) -> tuple[str | None, str]:
    python = root / "bin" / "python"
    failed = root.parent / (root.name + ".failed.json")
    want = {"pins": list(PINS)}
    if _ready(root):
        return str(python), f"side environment {root} (ready)"
    if root.exists() and any(root.iterdir()) and not (root / OWNED).exists():
        return None, (
            f"{root} exists and was not made by kfac_jax_env.py: remove it, or point "
            "$VJPKIT_KFAC_JAX_VENV elsewhere"
        )
    if failed.exists():
        try:
            info = json.loads(failed.read_text())
            if info.get("pins") == want["pins"] and time.time() - info["time"] < FAILURE_TTL_S:
                return None, (
                    f"creating the kfac-jax side environment failed within the hour (remove {failed} "
                    f"to retry now): {info['reason']}"
                )
        except (ValueError, KeyError):
            pass
    base = shutil.which(PYTHON)
    if base is None:
        return None, f"no {PYTHON} on PATH to make the kfac-jax side environment"
    start = time.perf_counter()
    shutil.rmtree(root, ignore_errors=True)
    error = _run([base, "-m", "venv", str(root)], 300)
    if error is None:
        (root / OWNED).write_text("made by vjpkit's benchmarks/kfac_jax_env.py\n")
        pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
        error = _run([*pip, "--quiet", *PINS], PIP_TIMEOUT_S)
    if error is None:
        error = _imports(str(python), _CHECK)
    seconds = time.perf_counter() - start
    if error is not None:
        shutil.rmtree(root, ignore_errors=True)
        failed.write_text(json.dumps({**want, "time": time.time(), "reason": error}))
        return None, f"could not create the kfac-jax side environment: {error}"
    failed.unlink(missing_ok=True)
    (root / READY).write_text(json.dumps({**want, "seconds": seconds, "created": time.time()}))
    return str(python), f"side environment {root} (created in {seconds:.0f} s)"


def _find(create: bool) -> tuple[str | None, str]:
    env_python = os.environ.get("VJPKIT_KFAC_JAX_PYTHON")
    reasons = []
    if env_python:
        error = _imports(env_python)
        if error is None:
            return env_python, f"$VJPKIT_KFAC_JAX_PYTHON={env_python}"
        reasons.append(f"$VJPKIT_KFAC_JAX_PYTHON does not import kfac_jax ({error})")
    root = venv_dir()
    if not create:
        python = _ready(root)
        if python:
            return python, f"side environment {root} (ready)"
        reasons.append(f"no ready kfac-jax side environment at {root} (not created here)")
        return None, "; ".join(reasons)
    with _locked(root.parent / (root.name + ".lock")):
        python, reason = _create(root)
    return python, "; ".join([*reasons, reason])


def side_python(create: bool = True) -> str | None:
    """The side environment's Python, or None (then ``side_reason()`` says why).

    With ``create=False`` only an environment that is already there is used.
    """
    key = f"{create}"
    if key not in _cache:
        _cache[key] = _find(create)
        if _cache[key][0] is not None:
            _cache["False"] = _cache[key]
    return _cache[key][0]


def side_reason(create: bool = True) -> str:
    """Why ``side_python(create)`` returned what it did (the path, or why there is none)."""
    side_python(create)
    return _cache[f"{create}"][1]


if __name__ == "__main__":
    t0 = time.perf_counter()
    python = side_python()
    print(python)
    print(side_reason(), f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
