"""Side-by-side step-time benchmark: vjpkit variants against raw JAX, in one process and run.

Each variant is a jitted optax SGD step on the same model, params and data. Timing uses
interleaved rounds: every round times each variant (in a shuffled order) over a block of
steps, and the reported figure is the median over rounds of the per-step time. Ratios are
medians of the per-round ratios to raw JAX, so slow drifts of the machine cancel out.

Usage: ``python benchmarks/run.py [--quick] [--models cnn,mlp_small] [--rounds 15]``
"""

from __future__ import annotations

import argparse
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

from models import MODELS, data, loss_of

import vjpkit as vk

HERE = pathlib.Path(__file__).resolve().parent


def make_steps(model, raw_apply, x, y):
    """The variants: name -> (jitted step, initial carry)."""
    params = model.init(jax.random.key(0), x)
    opt = optax.sgd(0.01, momentum=0.9)
    raw_loss, vk_loss = loss_of(raw_apply), loss_of(model.apply)
    norms = vk.capture("*", fields=["grad_output", "grad_input", "grad_params"], reduce="norm")
    delivered = []
    host = vk.capture(
        "*",
        fields=["grad_output", "grad_input", "grad_params"],
        reduce="norm",
        host=vk.on_host(delivered.append),
    )

    def sgd(value_and_grad, with_capture):
        def step(carry, x, y):
            p, s = carry
            out = value_and_grad(p, x, y)
            (loss, grads), extra = (out[0], out[1]) if with_capture else (out, None)
            updates, s = opt.update(grads, s, p)
            return (optax.apply_updates(p, updates), s), loss, extra

        return jax.jit(step)

    carry = (params, opt.init(params))
    variants = {
        "raw JAX": sgd(jax.value_and_grad(raw_loss), False),
        "vjpkit, no hooks": sgd(vk.value_and_grad(vk_loss), False),
        "vjpkit, capture norms": sgd(vk.value_and_grad(vk_loss, capture=norms), True),
        "vjpkit, capture + host every step": sgd(vk.value_and_grad(vk_loss, capture=host), True),
    }
    return variants, carry


def time_block(step, carry, x, y, n):
    out = None
    start = time.perf_counter()
    for _ in range(n):
        carry, loss, extra = step(carry, x, y)
        out = (loss, extra)
    jax.block_until_ready(out)
    jax.effects_barrier()
    return (time.perf_counter() - start) / n


def bench_model(key, rounds, block, warmup=3):
    title, model, raw_apply, shape, classes = MODELS[key]()
    x, y = data(shape, classes)
    variants, carry = make_steps(model, raw_apply, x, y)
    compile_s = {}
    for name, step in variants.items():
        t0 = time.perf_counter()
        jax.block_until_ready(step(carry, x, y)[1])
        compile_s[name] = time.perf_counter() - t0
        for _ in range(warmup):
            step(carry, x, y)
    times = {name: [] for name in variants}
    order = list(variants)
    for _ in range(rounds):
        random.shuffle(order)
        for name in order:
            times[name].append(time_block(variants[name], carry, x, y, block))
    base = times["raw JAX"]
    rows = []
    for name in variants:
        ratios = [t / b for t, b in zip(times[name], base)]
        rows.append(
            {
                "variant": name,
                "median_step_us": 1e6 * statistics.median(times[name]),
                "ratio_to_raw": statistics.median(ratios),
                "first_call_s": compile_s[name],
                "compile_ratio": compile_s[name] / compile_s["raw JAX"],
            }
        )
    return {"model": key, "title": title, "rows": rows}


def markdown(results):
    lines = []
    for res in results:
        lines.append(f"\n**{res['title']}**\n")
        lines.append("| variant | median step (µs) | ratio to raw JAX | first call (s) |")
        lines.append("|---|---:|---:|---:|")
        for r in res["rows"]:
            cells = [
                r["variant"],
                f"{r['median_step_us']:.0f}",
                f"{r['ratio_to_raw']:.3f}",
                f"{r['first_call_s']:.2f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds, small blocks (a smoke run)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--block", type=int, default=20, help="steps per timed block")
    parser.add_argument("--out", default=str(HERE / "results.json"))
    args = parser.parse_args(argv)
    rounds, block = (3, 3) if args.quick else (args.rounds, args.block)
    keys = [k for k in args.models.split(",") if k]
    unknown = [k for k in keys if k not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    results = [bench_model(k, rounds, block) for k in keys]
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "numpy": np.__version__,
        "rounds": rounds,
        "block": block,
    }
    pathlib.Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"{meta['date']} | {meta['machine']} | jax {meta['jax']} ({meta['backend']})")
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
