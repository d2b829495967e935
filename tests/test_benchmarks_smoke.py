"""The benchmark script runs and writes well-formed JSON (timings are never asserted)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_benchmark_quick_run_writes_json(tmp_path):
    out = tmp_path / "results.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "run.py"),
        "--quick",
        "--models",
        "mlp_small",
        "--out",
        str(out),
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    data = json.loads(out.read_text())
    assert {"date", "machine", "jax", "backend"} <= set(data["meta"])
    (result,) = data["results"]
    assert result["model"] == "mlp_small"
    variants = [row["variant"] for row in result["rows"]]
    assert variants[0] == "raw JAX" and len(variants) == 4
    for row in result["rows"]:
        assert row["median_step_us"] > 0 and row["ratio_to_raw"] > 0
