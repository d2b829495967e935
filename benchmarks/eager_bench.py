"""Eager (un-jitted) hooked calls against eager jax.grad, inner-jit retracing and memory.

The forum MLP (3-20-30-2, batch 64) with its model applied through an inner ``jax.jit``, as
research code often is. Each round times, interleaved, one eager call of: ``vk.grad(loss,
hooks={"fc*": ...})``, ``vk.grad(loss, capture=norms)``, a ``vk.grad`` built anew for the call
(same hooks and spec: it must reuse the compiled inner jit), a ``vk.grad`` whose hooks are made
anew for the call too (``vk.scale(0.5)`` and a lambda: equal hooks share traces), and
``jax.grad(loss)``; each ratio is the median of per-round ratios to ``jax.grad``. It also counts
how often the inner jitted function is traced over the rounds, and the growth of the process's
peak resident memory over ``calls`` more hooked calls, and over ``calls`` calls of a transform
built per call.

    python benchmarks/eager_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import vjpkit as vk
from vjpkit import nn

TARGET_RATIO = 3.0  # eager hooked vk.grad / eager jax.grad
TARGET_TRACES = 1  # traces of the inner jit under one hook configuration
TARGET_GROWTH_MB = 50.0  # peak memory growth over the extra calls (flat, up to allocator noise)
TARGET_CAPTURE = 2.0  # eager vk.grad with capture of norms / eager jax.grad (issue 21)
TARGET_PER_CALL = 3.0  # a vk.grad built anew on every call / eager jax.grad (issue 21: no recompiles)
PER_CALL_HOOKS = "vk.grad and its hooks built per call, eager"  # issue 31: hooks made in the loop too


def setup():
    model = nn.serial(fc1=nn.dense(20), relu1=nn.relu(), fc2=nn.dense(30), relu2=nn.relu(), fc3=nn.dense(2))
    x = jax.random.uniform(jax.random.key(0), (64, 3))
    y = (x @ jnp.array([0.1, 2.0, 3.0]) > 2.5).astype(jnp.int32)
    params = model.init(jax.random.key(1), x)
    traces = []

    @jax.jit
    def forward(p, x):
        traces.append(1)
        return model.apply(p, x)

    def loss(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(forward(p, x), y).mean()

    return loss, (params, x, y), traces


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(quick: bool = False) -> dict:
    rounds, calls = (3, 20) if quick else (30, 1000)
    loss, args, traces = setup()
    hook = lambda rec: None
    spec = vk.capture("fc*", reduce="norm")
    hooked = vk.grad(loss, hooks={"fc*": hook})
    captured = vk.grad(loss, capture=spec)
    plain = jax.grad(loss)

    def per_call(*a):  # a new transform on every call, with the same hooks and spec
        return vk.grad(loss, hooks={"fc*": hook}, capture=spec)(*a)

    def hooks_per_call(*a):  # the transform and its hooks made anew on every call, as in a loop
        return vk.grad(loss, hooks={"fc*": [vk.scale(0.5), lambda rec: None]})(*a)

    variants = {
        "vk.grad, hooks, eager": hooked,
        "vk.grad, capture norms, eager": captured,
        "vk.grad built per call (hooks + capture), eager": per_call,
        PER_CALL_HOOKS: hooks_per_call,
        "jax.grad, eager": plain,
    }
    jax.block_until_ready([fn(*args) for fn in variants.values()])  # first calls: compile the kernels
    hooked_traces_before = len(traces)
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    inner_traces = len(traces) - hooked_traces_before + 1  # + the first hooked call's trace
    before = _peak_mb()
    for _ in range(calls):
        jax.block_until_ready(hooked(*args))
    growth = _peak_mb() - before
    before = _peak_mb()
    for _ in range(calls):
        jax.block_until_ready(per_call(*args))
    growth_per_call = _peak_mb() - before

    def rel(name):
        return statistics.median([h / p for h, p in zip(times[name], times["jax.grad, eager"])])

    ratio = rel("vk.grad, hooks, eager")
    ratio_capture = rel("vk.grad, capture norms, eager")
    ratio_per_call = rel("vk.grad built per call (hooks + capture), eager")
    ratio_hooks_per_call = rel(PER_CALL_HOOKS)
    return {
        "title": "Eager calls: forum MLP 3-20-30-2, batch 64, model under an inner jax.jit",
        "rounds": rounds,
        "median_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "ratio": ratio,
        "ratio_capture": ratio_capture,
        "ratio_per_call": ratio_per_call,
        "ratio_hooks_per_call": ratio_hooks_per_call,
        "inner_jit_traces": inner_traces,
        "calls": calls,
        "peak_memory_growth_mb": growth,
        "peak_memory_growth_per_call_mb": growth_per_call,
        "targets": [
            {"target": f"eager vk.grad with hooks / eager jax.grad <= {TARGET_RATIO:.0f}", "value": ratio,
             "met": ratio <= TARGET_RATIO},
            {"target": f"inner jax.jit traces over {rounds + 1} hooked calls <= {TARGET_TRACES}",
             "value": float(inner_traces), "met": inner_traces <= TARGET_TRACES},
            {"target": f"peak memory growth over {calls} more hooked calls <= {TARGET_GROWTH_MB:.0f} MB",
             "value": growth, "met": growth <= TARGET_GROWTH_MB},
            {"target": f"eager vk.grad with capture of norms / eager jax.grad <= {TARGET_CAPTURE:.0f}",
             "value": ratio_capture, "met": ratio_capture <= TARGET_CAPTURE},
            {"target": f"a vk.grad built anew per call / eager jax.grad <= {TARGET_PER_CALL:.0f}",
             "value": ratio_per_call, "met": ratio_per_call <= TARGET_PER_CALL},
            {"target": f"a vk.grad and its hooks made per call / eager jax.grad <= {TARGET_PER_CALL:.0f}",
             "value": ratio_hooks_per_call, "met": ratio_hooks_per_call <= TARGET_PER_CALL},
            {"target": f"peak memory growth over {calls} calls of a vk.grad built per call <= "
                       f"{TARGET_GROWTH_MB:.0f} MB",
             "value": growth_per_call, "met": growth_per_call <= TARGET_GROWTH_MB},
        ],
    }  # fmt: skip


def markdown(res: dict) -> str:
    lines = [f"\n**{res['title']}**\n", "| variant | median call (ms) |", "|---|---:|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in res["median_ms"].items()]
    lines.append("")
    for t in res["targets"]:
        lines.append(f"- {t['target']}: {t['value']:.2f} ({'met' if t['met'] else 'NOT met'})")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds and calls (a smoke run)")
    res = run(parser.parse_args(argv).quick)
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
