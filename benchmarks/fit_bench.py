"""``vk.train.fit`` against a hand-written jitted optax loop: issue 5's target, fit <= 1.05x.

Both sides train the same benchmark model (``benchmarks/models.py``, the ``vjpkit.nn``
version) with optax SGD, momentum 0.9, from the same params, on the same in-memory numpy data,
with the same batches: batch ``t`` is rows ``perm[i * b : (i + 1) * b]`` of epoch
``t // batches_per_epoch``, where ``perm`` is ``np.random.default_rng([seed, epoch])``'s
permutation (what ``fit`` draws for array data). Each run is ``2 * W`` steps.

* ``fit``: ``vk.train.fit(loss, opt, params, (x, y), batch_size=b, steps=2 * W, hooks=None,
  capture=None, progress=False, scan_steps=K)`` with its defaults otherwise (``nan_policy="stop"``,
  metrics fetched every 50 steps), for ``K = 1`` and ``K = 8``. Its ``eval_fn`` only reads the
  clock, every ``W`` steps; ``fit`` calls it after fetching the metrics, that is with the device
  idle, at step ``W`` and at the end.
* hand loop: the natural user loop: ``step = jax.jit(step_fn)`` (no donation), numpy
  indexing of the batch each step, the losses kept as device arrays and fetched with one
  ``jax.device_get`` at step ``W`` (for the clock) and at the end.

Figures, per round: ``step``: the time of the second ``W`` steps divided by ``W`` (compiled,
steady state); ``run``: the whole call, from before ``fit`` (or the hand loop's ``jax.jit``)
to the fetched losses, compilation included (both compile their step in every call). Rounds
are interleaved (each round runs every variant once, in a shuffled order) and the ratios are
medians over rounds of the per-round ratio fit/hand, as in ``run.py``. Both sides must end with
the same params; the largest difference is reported.

Usage: ``python benchmarks/fit_bench.py [--quick] [--models cnn,mlp_small] [--rounds 9]``.
Writes ``benchmarks/fit_results.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import platform
import random
import statistics
import sys
import time

import jax
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from run import HERE, MODELS, cpu_times, data, loss_of, other_cpu_share

import vjpkit as vk

TARGET = 1.05
SCANS = (1, 8)
BATCHES_PER_EPOCH = 16
WINDOW = {"mlp_small": 256, "mlp_mnist": 256, "cnn": 16}  # W: steps per timed half, multiples of 8
QUICK_WINDOW = 16


def setup(key: str, seed: int = 0) -> dict:
    """The model, params, loss and numpy data (BATCHES_PER_EPOCH batches) of one benchmark model."""
    title, model, _, shape, classes = MODELS[key]()
    batch = shape[0]
    x, y = data((batch * BATCHES_PER_EPOCH, *shape[1:]), classes, seed)
    x, y = np.asarray(x), np.asarray(y)
    params = model.init(jax.random.key(0), x[:batch])
    loss = loss_of(model.apply)  # loss(params, x, y): plain JAX outside a vjpkit transform
    return dict(title=title, params=params, loss=loss, x=x, y=y, batch=batch, seed=seed)


def optimizer() -> optax.GradientTransformation:
    return optax.sgd(0.01, momentum=0.9)


def run_fit(
    cfg: dict, window: int, scan_steps: int = 1, capture=None, on_records=None, nan_policy: str = "stop"
) -> dict:
    """One ``fit`` run of ``2 * window`` steps; ``step`` is the second window's time per step."""
    loss = cfg["loss"]
    start = time.perf_counter()
    state, history = vk.train.fit(
        lambda params, batch: loss(params, *batch),
        optimizer(),
        cfg["params"],
        (cfg["x"], cfg["y"]),
        batch_size=cfg["batch"],
        steps=2 * window,
        hooks=None,
        capture=capture,
        on_records=on_records,
        progress=False,
        scan_steps=scan_steps,
        nan_policy=nan_policy,
        seed=cfg["seed"],
        eval_fn=lambda params: {"clock": time.perf_counter()},
        eval_every=window,
    )
    end = time.perf_counter()
    clocks = [e["clock"] for e in history["eval"]]
    assert [e["step"] for e in history["eval"]] == [window, 2 * window], history["eval"]
    return dict(step=(clocks[1] - clocks[0]) / window, run=end - start, params=state.params)


def run_hand(cfg: dict, window: int) -> dict:
    """The loop a user writes by hand."""
    loss, x, y, batch, seed = cfg["loss"], cfg["x"], cfg["y"], cfg["batch"], cfg["seed"]
    opt = optimizer()
    start = time.perf_counter()

    @jax.jit
    def step(params, opt_state, xb, yb):
        value, grads = jax.value_and_grad(loss)(params, xb, yb)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params, opt_state = cfg["params"], opt.init(cfg["params"])
    per_epoch = len(x) // batch
    losses, fetched, clocks = [], [], []
    for t in range(2 * window):
        epoch, i = divmod(t, per_epoch)
        if i == 0:
            perm = np.random.default_rng([seed, epoch]).permutation(len(x))
        rows = perm[i * batch : (i + 1) * batch]
        params, opt_state, value = step(params, opt_state, x[rows], y[rows])
        losses.append(value)
        if t + 1 in (window, 2 * window):
            fetched += jax.device_get(losses)
            losses = []
            clocks.append(time.perf_counter())
    end = time.perf_counter()
    assert len(fetched) == 2 * window
    return dict(step=(clocks[1] - clocks[0]) / window, run=end - start, params=params)


def max_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def bench_model(key: str, rounds: int, window: int, warmup: int = 1) -> dict:
    cfg = setup(key)
    variants = {"hand loop": lambda: run_hand(cfg, window)}
    for k in SCANS:
        variants[f"fit, scan_steps={k}"] = lambda k=k: run_fit(cfg, window, k)
    times = {name: {"step": [], "run": []} for name in variants}
    diffs = {}
    order = list(variants)
    for r in range(warmup + rounds):
        random.shuffle(order)
        results = {}
        for name in order:
            gc.collect()
            results[name] = variants[name]()
        for name in variants:
            if name != "hand loop":
                diffs[name] = max(
                    diffs.get(name, 0.0), max_diff(results[name]["params"], results["hand loop"]["params"])
                )
        if r >= warmup:
            for name, res in results.items():
                times[name]["step"].append(res["step"])
                times[name]["run"].append(res["run"])
    base = times["hand loop"]
    rows = []
    for name in variants:
        t = times[name]
        rows.append(
            {
                "variant": name,
                "median_step_us": 1e6 * statistics.median(t["step"]),
                "median_run_s": statistics.median(t["run"]),
                "step_ratio": statistics.median(a / b for a, b in zip(t["step"], base["step"])),
                "run_ratio": statistics.median(a / b for a, b in zip(t["run"], base["run"])),
                "step_ratios": [a / b for a, b in zip(t["step"], base["step"])],
                "max_param_diff": diffs.get(name, 0.0),
            }
        )
    return {"model": key, "title": cfg["title"], "window": window, "rows": rows}


def quartiles(values: list[float]) -> str:
    """The interquartile range of the per-round ratios, as ``lo-hi``."""
    if len(values) < 2:
        return "n/a"
    q1, _, q3 = statistics.quantiles(values, n=4)
    return f"{q1:.2f}-{q3:.2f}"


def ratio_cell(row: dict) -> str:
    ok = "✓" if row["step_ratio"] <= TARGET else "✗"
    return f"{row['step_ratio']:.3f} [{quartiles(row['step_ratios'])}] {ok}"


def markdown(results: list[dict]) -> str:
    lines = [
        f"| model | hand loop step (µs) | fit step (µs), scan 1 / 8 | **step ratio fit/hand**, scan 1 / 8 "
        f"[quartiles] (target ≤ {TARGET}) | whole-run ratio (compile incl.), scan 1 / 8 "
        "| max \\|Δparams\\|, scan 1 / 8 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        hand, *fits = res["rows"]
        lines.append(
            f"| {res['title']} | {hand['median_step_us']:.0f} | "
            + " / ".join(f"{r['median_step_us']:.0f}" for r in fits)
            + " | "
            + " / ".join(ratio_cell(r) for r in fits)
            + " | "
            + " / ".join(f"{r['run_ratio']:.3f}" for r in fits)
            + " | "
            + " / ".join(f"{r['max_param_diff']:.0e}" for r in fits)
            + " |"
        )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"2 rounds of {2 * QUICK_WINDOW} steps: a smoke run"
    )
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default=str(HERE / "fit_results.json"))
    args = parser.parse_args(argv)
    keys = [k for k in args.models.split(",") if k]
    unknown = [k for k in keys if k not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    rounds = 2 if args.quick else args.rounds
    started, cpu_before = time.perf_counter(), cpu_times()
    results = []
    for k in keys:
        window = QUICK_WINDOW if args.quick else WINDOW[k]
        results.append(bench_model(k, rounds, window, warmup=0 if args.quick else 1))
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "numpy": np.__version__,
        "optax": optax.__version__,
        "rounds": rounds,
        "seconds": time.perf_counter() - started,
        "other_cpu_share": other_cpu_share(cpu_before, cpu_times()),
    }
    pathlib.Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    busy = meta["other_cpu_share"]
    print(
        f"{meta['date']} | {meta['machine']} | jax {meta['jax']} ({meta['backend']}) | {rounds} rounds | "
        f"{meta['seconds']:.0f} s"
        + (f" | other processes used {100 * busy:.0f}% of the CPU meanwhile" if busy is not None else "")
    )
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
