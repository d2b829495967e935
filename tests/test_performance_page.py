"""``benchmarks/run.py --write-docs`` rewrites docs/performance.md's step-time table between its
markers, from a run's results, and leaves the rest of the page as it is.

The results here are made up (no benchmark runs); their targets come from ``run.targets``, so the
target texts the table parses are the ones a run writes.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "performance.md"


def load_run():
    torch_before, path_before = "torch" in sys.modules, list(sys.path)
    spec = importlib.util.spec_from_file_location("benchmarks_run", ROOT / "benchmarks" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.path[:] = path_before  # run.py puts benchmarks/ first on the path for its own imports
    assert torch_before or "torch" not in sys.modules, "importing benchmarks/run.py imported torch"
    return module


run = load_run()

META = {
    "date": "2031-02-03 04:05",
    "machine": "x86_64, 2 cores, Linux",
    "cpu": "Some CPU",
    "load_average_at_start": 0.25,
    "other_cpu_share": 0.01,
    "backend": "cpu",
    "versions": {"jax": "9.9.9", "flax": "1.2.3", "equinox": "4.5.6", "torch": "not run"},
    "rounds": 11,
    "block": 20,
    "compile_repeats": 3,
    "only_first_call": False,
    "wall_s": 405.2,
}


def fake_result(title, step_s, first_call_ratio, extra_row=None):
    """One model's entry of ``main``'s results: every JAX row timed, Flax NNX too, the rest skipped."""
    times = {name: [t, t * 1.01, t * 0.99] for name, t in step_s.items()}
    compile_ratios = dict.fromkeys(run.VJPKIT_ROWS, first_call_ratio)
    rows = []
    for name in times:  # raw JAX first, then the extra raw row (CNN), as in run.jax_variants
        if name != run.RAW and extra_row and len(rows) == 1:
            rows.append({"variant": extra_row, "status": "ok", "median_step_us": 1.0, "ratio_to_raw": 2.5})
        rows.append(
            {
                "variant": name,
                "status": "ok",
                "median_step_us": 1e6 * sorted(times[name])[1],
                "ratio_to_raw": run.ratio(times, name, run.RAW),
            }
        )
    skipped = ["Flax NNX (split/merge + jax.jit)", "Equinox", *run.peers.TORCH_ROWS]
    rows += [{"variant": name, "status": "skipped: not in --peers"} for name in skipped]
    by_hand = {  # the same norms by hand (run.BY_HAND): 1.25 raw JAX's first call
        "first_call_ratio_to_raw": 1.25,
        "capture_first_call_over_by_hand": first_call_ratio / 1.25,
        "capture_step_over_by_hand": 1.0,
    }
    targets = run.targets(times, compile_ratios)
    return {"model": title, "title": title, "rows": rows, "targets": targets, "by_hand": by_hand}


STEP = {
    run.RAW: 1e-3,
    run.NO_HOOKS: 1.01e-3,
    run.CAPTURE: 1.2e-3,
    run.HOST: 1.3e-3,
    run.HOOK: 1.0e-3,
    "Flax NNX": 1.1e-3,
}
RESULTS = [
    fake_result("MLP A", STEP, 1.1),
    fake_result("CNN B", {k: 10 * v for k, v in STEP.items()}, 1.4, extra_row="raw JAX, other pool"),
]


def split(text):
    start, end = run.STEP_TABLE_MARKERS
    head, rest = text.split(start, 1)
    inside, tail = rest.split(end, 1)
    return head, inside, tail


def test_the_table_between_the_markers_is_replaced_and_nothing_else():
    original = PAGE.read_text()
    updated = run.replace_marked(original, run.step_table(RESULTS, META))
    head, inside, tail = split(updated)
    old_head, old_inside, old_tail = split(original)
    assert (head, tail) == (old_head, old_tail)  # everything outside the markers, byte for byte
    assert inside != old_inside
    assert inside.startswith("\nMeasured 2031-02-03 04:05 | x86_64, 2 cores, Linux (Some CPU) | ")
    assert "jax 9.9.9 (cpu), flax 1.2.3, equinox 4.5.6" in inside
    assert "11 rounds of 20 steps | 3 first call(s) per variant | 405 s" in inside
    table = [line for line in inside.splitlines() if line.startswith("|")]
    assert table[0] == "| variant | MLP A | CNN B |"
    assert all(line.count("|") == 4 for line in table), table  # three cells in every row
    rows = {line.split(" | ")[0][2:]: line for line in table[2:]}
    assert rows["raw JAX: step time"] == "| raw JAX: step time | 1000 µs | 10000 µs |"
    assert rows["vjpkit, no hooks (≤ 1.02)"].endswith("| 1.010 ✓ | 1.010 ✓ |")
    assert rows["vjpkit, capture norms (≤ 1.10)"].endswith("| **1.200 ✗** | **1.200 ✗** |")
    assert rows[run.HOST].endswith("| 1.300 | 1.300 |")  # no target: no mark
    assert rows["Equinox"].endswith("| skipped: not in --peers | skipped: not in --peers |")
    assert rows["raw JAX, other pool"] == "| raw JAX, other pool |  | 2.500 |"  # one model only
    labels = list(rows)
    assert labels.index("raw JAX, other pool") < labels.index("vjpkit, no hooks / Flax NNX (≤ 1.0)")
    first = f"first call: {run.NO_HOOKS} / raw JAX (≤ 1.3)"
    assert rows[first].endswith("| 1.10 ✓ | **1.40 ✗** |")
    assert rows[f"first call: {run.BY_HAND} / raw JAX (no target)"].endswith("| 1.25 | 1.25 |")
    assert rows[f"first call: {run.CAPTURE} / {run.BY_HAND}"].endswith("| 0.88 | 1.12 |")
    assert rows[f"{run.NO_HOOKS} / Flax NNX (≤ 1.0)"].endswith("| 0.92 ✓ | 0.92 ✓ |")
    assert rows[f"{run.NO_HOOKS} / Equinox (≤ 1.0)"].endswith("| skipped | skipped |")
    assert "1210 µs" in old_inside and "1210 µs" not in inside  # the hand-kept table is gone
    # a second run replaces the first one's table the same way
    assert run.replace_marked(updated, run.step_table(RESULTS, META)) == updated


def test_write_docs_rewrites_the_page_in_place(tmp_path):
    page = tmp_path / "performance.md"
    start, end = run.STEP_TABLE_MARKERS
    page.write_text(f"# Title\n\nbefore\n\n{start}\nold table\n{end}\n\nafter\n")
    assert run.write_docs(RESULTS, META, page) == page
    text = page.read_text()
    assert text.startswith(f"# Title\n\nbefore\n\n{start}\nMeasured 2031-02-03 04:05 | ")
    assert text.endswith(f" |\n{end}\n\nafter\n")
    assert "old table" not in text


@pytest.mark.parametrize(
    "text",
    [
        "no markers at all\n",
        f"{run.STEP_TABLE_MARKERS[0]}\nonly the start\n",
        f"{run.STEP_TABLE_MARKERS[1]}\nend before start\n{run.STEP_TABLE_MARKERS[0]}\n",
        "".join(f"{m}\n" for m in run.STEP_TABLE_MARKERS * 2),
    ],
)
def test_missing_or_repeated_markers_are_an_error(text):
    with pytest.raises(ValueError, match="once each, in that order"):
        run.replace_marked(text, "table")
