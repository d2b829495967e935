"""The quickstart's peak memory and time with its hooks against the same script without them.

``examples/quickstart.py`` keeps only the records it prints (``--keep 1``); ``--no-hooks``
trains the same model with plain ``jax.value_and_grad``. Each round runs both as child
processes, in random order; each child reports its own peak resident memory (Linux's
``VmHWM``). Target (issue 14): peak memory with hooks <= 1.5x without (median of per-round ratios).

    python benchmarks/quickstart_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
SCRIPT = HERE.parent / "examples" / "quickstart.py"
TARGET = 1.5  # peak memory with hooks / without
HOOKED, BARE = "quickstart, on_host hooks (--keep 1)", "quickstart --no-hooks"  # the target's pair
ROWS = {  # name -> the quickstart's extra arguments; the last shows what keeping every record costs
    HOOKED: [],
    BARE: ["--no-hooks"],
    "quickstart, on_host hooks, every record kept": ["--keep", "1000000"],
}


# runs the script in the child, then reports the child's own peak resident memory in kB: Linux's
# VmHWM, not wait4's ru_maxrss, which on Linux counts the forked copy of this (large) process;
# elsewhere the child's own ru_maxrss (bytes on macOS)
CHILD = """
import os, resource, runpy, sys
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
if os.path.exists("/proc/self/status"):
    peak = [int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")][0]
else:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // (1024 if sys.platform == "darwin" else 1)
print("VmHWM", peak, file=sys.stderr)
"""


def run_child(extra: list, steps: int) -> dict:
    """One quickstart process: its wall time (s) and peak resident memory (MB)."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(SCRIPT), "--steps", str(steps), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    seconds = time.perf_counter() - start
    peak = [line.split()[1] for line in proc.stderr.splitlines() if line.startswith("VmHWM ")]
    if proc.returncode or not peak:
        raise RuntimeError(f"quickstart {extra} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return {"seconds": seconds, "peak_mb": int(peak[0]) / 1024}


def run(quick: bool = False) -> dict:
    rounds, steps = (1, 50) if quick else (3, 1500)
    samples = {name: [] for name in ROWS}
    order = list(ROWS)
    for _ in range(rounds):
        random.shuffle(order)
        for name in order:
            samples[name].append(run_child(ROWS[name], steps))
    ratio = statistics.median(a["peak_mb"] / b["peak_mb"] for a, b in zip(samples[HOOKED], samples[BARE]))
    rows = {
        name: {
            "peak_mb": statistics.median(s["peak_mb"] for s in runs),
            "seconds": statistics.median(s["seconds"] for s in runs),
        }
        for name, runs in samples.items()
    }
    target = {
        "target": f"quickstart peak memory, hooks / no hooks <= {TARGET}",
        "value": ratio,
        "limit": TARGET,
        "met": ratio <= TARGET,
    }
    return {"steps": steps, "rounds": rounds, "rows": rows, "samples": samples, "targets": [target]}


def markdown(res: dict) -> str:
    lines = [f"Quickstart ({res['steps']} steps), peak resident memory of the process", ""]
    lines += ["| variant | peak memory (MB) | wall time (s) |", "|---|---:|---:|"]
    for name, row in res["rows"].items():
        lines.append(f"| {name} | {row['peak_mb']:.0f} | {row['seconds']:.1f} |")
    t = res["targets"][0]
    lines += ["", f"{t['target']}: {t['value']:.2f} ({'met' if t['met'] else 'NOT met'})"]
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round of 50 steps: a smoke run")
    parser.add_argument("--out", default=str(HERE / "quickstart_results.json"))
    args = parser.parse_args(argv)
    res = run(args.quick)
    pathlib.Path(args.out).write_text(json.dumps(res, indent=1))
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
