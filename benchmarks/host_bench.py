"""Host delivery: per-layer ``vk.on_host`` hooks and ``fit(on_records=...)`` against their bare steps.

Two comparisons (issue 14's targets), each timed in interleaved rounds with medians of per-round
ratios, as in ``run.py``:

* **Per-layer host hooks**, on the forum MLP (3-20-30-2, batch 64): a jitted SGD step with
  ``vk.value_and_grad`` and no hooks ("bare"), the same step with ``vk.on_host`` on all 5 layers
  (one transfer per backward pass; target <= 3x bare), and with ``vk.on_host(..., every=100)``
  and the hook state threaded, so the decision is made in the graph (target <= 1.2x bare).
  Steps are chained (each uses the previous step's params), the host functions append to a list,
  and the loop blocks on the last step's outputs.
* **fit with records every step**, on the three benchmark models (``models.py``): ``fit`` with
  ``capture`` of the per-layer norms (``grad_output``, ``grad_input``, ``grad_params``) and
  ``on_records`` every step, against ``fit`` with no capture (target <= 1.10x), and against
  ``fit`` with the same capture but no ``on_records`` (the cost of delivery alone); all with
  ``fit``'s default ``nan_policy="stop"``. The pair "no capture" / "capture + on_records" is
  timed again under ``nan_policy="continue"``, and its ratio has the same target. The step
  time is the second half of a run (compiled, steady state), read by an ``eval_fn`` clock as in
  ``fit_bench.py``.

Usage: ``python benchmarks/host_bench.py [--quick]``. Writes ``benchmarks/host_results.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sys
import time

import jax
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import eager_bench
import fit_bench
from models import MODELS

import vjpkit as vk

TARGET_HOOKS = 3.0  # on_host on every layer / bare step
TARGET_EVERY = 1.2  # on_host(every=100) with hook_state / bare step
TARGET_FIT = 1.10  # fit with records every step / fit with none
HOOK_ROWS = ("bare jitted step", "on_host on all 5 layers", "on_host(every=100) on all 5 layers")
FIT_ROWS = ("fit, no capture", "fit, capture norms, no on_records", "fit, capture norms + on_records")
# the same pair under nan_policy="continue": no per-step gate of the update on the gradients'
# finiteness, which costs capture on the CNN about 10% more under "stop" (docs/performance.md)
CONTINUE_ROWS = ("fit, no capture, continue", "fit, capture norms + on_records, continue")


def hook_steps() -> dict:
    """name -> (step(carry) -> carry, initial carry, host list) for the per-layer hook rows."""
    loss, (params, x, y), _ = eager_bench.setup()
    opt = optax.sgd(0.01, momentum=0.9)
    seen: list = []
    every_hook = vk.on_host(seen.append, every=100)
    grads = {
        HOOK_ROWS[0]: vk.value_and_grad(loss),
        HOOK_ROWS[1]: vk.value_and_grad(loss, hooks={"*": vk.on_host(seen.append)}),
        HOOK_ROWS[2]: vk.value_and_grad(loss, hooks={"*": every_hook}),
    }
    hook_state = vk.init_hook_state(grads[HOOK_ROWS[2]], params, x, y)
    out = {}
    for name, g in grads.items():
        stateful = name == HOOK_ROWS[2]

        @jax.jit
        def step(carry, g=g, stateful=stateful):
            p, s, hs = carry
            if stateful:
                (_, grads), hs = g(p, x, y, hook_state=hs)
            else:
                _, grads = g(p, x, y)
            updates, s = opt.update(grads, s, p)
            return optax.apply_updates(p, updates), s, hs

        out[name] = (step, (params, opt.init(params), hook_state if stateful else None))
    return out, seen


def time_chain(step, carry, n: int) -> tuple[float, tuple]:
    start = time.perf_counter()
    for _ in range(n):
        carry = step(carry)
    jax.block_until_ready(carry)
    return (time.perf_counter() - start) / n, carry


def bench_hooks(rounds: int, block: int) -> dict:
    steps, seen = hook_steps()
    carries = {}
    for name, (step, carry) in steps.items():
        _, carries[name] = time_chain(step, carry, 3)  # compile and warm up
    times = {name: [] for name in steps}
    order = list(steps)
    for _ in range(rounds):
        random.shuffle(order)
        for name in order:
            t, carries[name] = time_chain(steps[name][0], carries[name], block)
            times[name].append(t)
            seen.clear()
    return summarize(times, HOOK_ROWS[0])


def median_ratio(times: list, base: list) -> float:
    return statistics.median(a / b for a, b in zip(times, base))


def summarize(times: dict, base: str) -> dict:
    return {
        name: {
            "median_step_us": 1e6 * statistics.median(t),
            "ratio": statistics.median(a / b for a, b in zip(t, times[base])),
            "ratios": [a / b for a, b in zip(t, times[base])],
        }
        for name, t in times.items()
    }


def bench_fit(key: str, rounds: int, window: int) -> dict:
    cfg = fit_bench.setup(key)
    spec = vk.capture("*", fields=["grad_output", "grad_input", "grad_params"], reduce="norm")
    delivered = []
    keep = lambda step, captured: delivered.append(step)
    cont = {"nan_policy": "continue"}
    variants = {
        FIT_ROWS[0]: lambda: fit_bench.run_fit(cfg, window)["step"],
        FIT_ROWS[1]: lambda: fit_bench.run_fit(cfg, window, capture=spec)["step"],
        FIT_ROWS[2]: lambda: fit_bench.run_fit(cfg, window, capture=spec, on_records=keep)["step"],
        CONTINUE_ROWS[0]: lambda: fit_bench.run_fit(cfg, window, **cont)["step"],
        CONTINUE_ROWS[1]: lambda: fit_bench.run_fit(cfg, window, capture=spec, on_records=keep, **cont)[
            "step"
        ],
    }
    times = {name: [] for name in variants}
    order = list(variants)
    for r in range(1 + rounds):  # the first round compiles: not timed
        random.shuffle(order)
        for name in order:
            delivered.clear()
            t = variants[name]()
            if name in (FIT_ROWS[2], CONTINUE_ROWS[1]):
                assert delivered == list(range(2 * window)), "a record was lost or repeated"
            if r:
                times[name].append(t)
    res = summarize(times, FIT_ROWS[0])
    res["delivery alone"] = {"ratio": median_ratio(times[FIT_ROWS[2]], times[FIT_ROWS[1]])}
    res[CONTINUE_ROWS[1]]["ratio"] = median_ratio(times[CONTINUE_ROWS[1]], times[CONTINUE_ROWS[0]])
    return {"model": key, "title": cfg["title"], "window": window, "rows": res}


def targets(hooks: dict, fits: list) -> list:
    out = [
        {
            "target": f"on_host on all 5 layers / bare step <= {TARGET_HOOKS}",
            "value": hooks[HOOK_ROWS[1]]["ratio"],
            "limit": TARGET_HOOKS,
        },
        {
            "target": f"on_host(every=100), hook_state threaded / bare step <= {TARGET_EVERY}",
            "value": hooks[HOOK_ROWS[2]]["ratio"],
            "limit": TARGET_EVERY,
        },
    ]
    for res in fits:
        for row, policy in ((FIT_ROWS[2], "stop"), (CONTINUE_ROWS[1], "continue")):
            out.append(
                {
                    "target": f"{res['title']}: fit with records every step / fit with none, "
                    f"nan_policy={policy!r} <= {TARGET_FIT}",
                    "value": res["rows"][row]["ratio"],
                    "limit": TARGET_FIT,
                }
            )
    for t in out:
        t["met"] = t["value"] <= t["limit"]
    return out


def run(quick: bool = False, models=tuple(MODELS)) -> dict:
    """Both comparisons; ``fit`` on the benchmark ``models`` (keys of ``models.MODELS``)."""
    rounds, block = (3, 20) if quick else (15, 300)
    hooks = bench_hooks(rounds, block)
    fits = []
    for key in models:
        window = fit_bench.QUICK_WINDOW if quick else fit_bench.WINDOW[key]
        fits.append(bench_fit(key, 1 if quick else 7, window))
    return {"hooks": hooks, "fit": fits, "targets": targets(hooks, fits), "quick": quick}


def markdown(res: dict) -> str:
    lines = ["Host delivery: forum MLP 3-20-30-2, batch 64, jitted SGD steps", ""]
    lines += ["| variant | median step (µs) | ratio to bare |", "|---|---:|---:|"]
    for name, row in res["hooks"].items():
        lines.append(f"| {name} | {row['median_step_us']:.0f} | {row['ratio']:.2f} |")
    lines += [
        "",
        "fit with records every step (ratio to fit with no capture under the same nan_policy; "
        "delivery alone: to fit with capture)",
    ]
    names = (*FIT_ROWS, *CONTINUE_ROWS)
    lines += ["", "| model | " + " | ".join(names) + " | delivery alone |", "|---|" + "---:|" * 6]
    for fit in res["fit"]:
        rows = fit["rows"]
        cells = [f"{rows[n]['median_step_us']:.0f} µs ({rows[n]['ratio']:.3f})" for n in names]
        lines.append(
            f"| {fit['title']} | " + " | ".join(cells) + f" | {rows['delivery alone']['ratio']:.3f} |"
        )
    lines.append("")
    for t in res["targets"]:
        lines.append(f"- {t['target']}: {t['value']:.2f} ({'met' if t['met'] else 'NOT met'})")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent / "host_results.json"))
    args = parser.parse_args(argv)
    res = run(args.quick)
    pathlib.Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
