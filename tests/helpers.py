"""The one tree comparison helper, and small shared fixtures' building blocks."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import types

import jax
import numpy as np


def tree_allclose(a, b, *, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    """Asserts two pytrees have the same structure, shapes, dtypes and close values."""
    leaves_a, def_a = jax.tree_util.tree_flatten_with_path(a)
    leaves_b, def_b = jax.tree_util.tree_flatten_with_path(b)
    assert def_a == def_b, f"structure differs:\n{def_a}\n{def_b}"
    for (path, x), (_, y) in zip(leaves_a, leaves_b):
        where = jax.tree_util.keystr(path)
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape, f"{where}: shape {x.shape} != {y.shape}"
        assert x.dtype == y.dtype, f"{where}: dtype {x.dtype} != {y.dtype}"
        wide = np.complex128 if np.iscomplexobj(x) else np.float64  # complex: both parts compared
        np.testing.assert_allclose(x.astype(wide), y.astype(wide), rtol=rtol, atol=atol, err_msg=where)


EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str) -> types.ModuleType:
    """Imports ``examples/<name>.py`` as a module (its ``main`` is not run).

    ``examples/`` goes on ``sys.path`` first, as it is for ``python examples/<name>.py``, so
    that an example can import its shared helpers (``examples/_digits.py``).
    """
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_with_devices(script: pathlib.Path, devices: int, *args: str) -> dict:
    """Runs ``script`` in a subprocess with ``devices`` host CPU devices; returns the JSON of its
    ``RESULT <json>`` line (a non-zero exit fails with the end of its stderr)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(pathlib.Path(__file__).resolve().parents[1]))
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    proc = subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def assert_small(diffs, where: str, tol: float) -> None:
    """Every difference in a (nested) dict of them, as a subprocess script reports them (a
    float, or a string saying why there is none), is a number within ``tol``."""
    if isinstance(diffs, dict):
        for key, value in diffs.items():
            assert_small(value, f"{where}/{key}", tol)
        return
    assert isinstance(diffs, float), f"{where}: {diffs}"
    assert diffs <= tol, f"{where}: off by {diffs}"
