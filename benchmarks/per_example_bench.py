"""Per-example gradient norms: vjpkit's records against ``jax.vmap(jax.grad)`` followed by norms.

Model: MLP 784-512-512-10 (``benchmarks/models.py``'s ``mlp_mnist``) at batch 256, mean
cross-entropy. Variants, each ``jax.jit``-compiled and returning per-example norms (total and
per parameter leaf):

* ``vjpkit``: ``vk.inspect.per_example_grad_norms(loss_fn)``: one forward and one backward
  pass, records captured in the graph, ``||x_i|| * ||d_i||`` per dense layer (it also returns
  the loss and the batch gradient, and runs its consistency check);
* ``vmap(grad)``: ``jax.vmap(jax.grad(l_i))`` over the batch, then the norms;
* ``value_and_grad`` (context only): one plain ``jax.value_and_grad`` of the batch loss;
* ``vjpkit (Flax linen)`` and ``vmap(grad) (Flax linen)``: the same two on the same MLP written
  as a Flax linen module (``nn.Dense`` x 3, the same weights), whose ``Dense`` calls vjpkit
  records with no wrapping (when Flax is installed; ``--no-flax`` leaves them out).

Time: interleaved rounds after a warm-up; each round times every variant, in a shuffled order,
over a block of calls; the figure is the median over rounds of the per-call time, and the
speed-up the median over rounds of the per-round ratio.

Peak memory, each variant in a fresh subprocess:

* ``xla_peak_mb``: XLA's compiled ``memory_analysis()``: temp + argument + output - alias bytes (the
  buffers the executable needs at once; deterministic). The target is judged on this one.
* ``rss_run_mb``: the resident-set high-water mark while running the compiled function 5
  times, above the RSS before running (the high-water mark is reset with
  ``/proc/self/clear_refs`` after compiling, so compilation does not count);
* ``rss_total_mb``: ``ru_maxrss`` after running minus before compiling (compilation included).

Usage: ``python benchmarks/per_example_bench.py [--rounds 15] [--block 10] [--batch 256]
[--quick] [--no-flax] [--out benchmarks/per_example_results.json]``. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import random
import resource
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import optax

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from models import data, mlp_mnist  # noqa: E402
from peers import xla_memory  # noqa: E402

from vjpkit.inspect import per_example_grad_norms  # noqa: E402

VARIANTS = ("vjpkit", "vmap(grad)", "value_and_grad")
FLAX_VARIANTS = ("vjpkit (Flax linen)", "vmap(grad) (Flax linen)")
TARGET_SPEEDUP, TARGET_MEMORY = 3.0, 5.0


def have_flax() -> bool:
    try:
        import flax.linen  # noqa: F401
    except ImportError:
        return False
    return True


def variants(flax: bool) -> tuple[str, ...]:
    return VARIANTS + (FLAX_VARIANTS if flax else ())


def _naive(loss_fn, batch: int):
    def naive(params, x, y):
        def single(p, xi, yi):
            return loss_fn(p, xi[None], yi[None])

        grads = jax.vmap(jax.grad(single), in_axes=(None, 0, 0))(params, x, y)
        per_leaf = jax.tree.map(lambda g: jnp.sqrt(jnp.sum(jnp.square(g.reshape(batch, -1)), axis=1)), grads)
        total = jnp.sqrt(sum(jnp.square(n) for n in jax.tree.leaves(per_leaf)))
        return total, per_leaf

    return naive


def _flax_mlp():
    import flax.linen as fnn

    class MLP(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            x = fnn.relu(fnn.Dense(512, name="fc1")(x))
            x = fnn.relu(fnn.Dense(512, name="fc2")(x))
            return fnn.Dense(10, name="fc3")(x)

    return MLP()


def setup(batch: int, flax: bool = False):
    """``({variant: jitted fn}, args)``; with ``flax``, also the Flax linen variants (the args
    then end with the linen params, the same weights as the vjpkit model's)."""
    _, model, _, shape, classes = mlp_mnist()
    x, y = data((batch, shape[1]), classes)
    params = model.init(jax.random.key(0), x)

    def loss_fn(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()

    fns = {
        "vjpkit": jax.jit(per_example_grad_norms(loss_fn)),
        "vmap(grad)": jax.jit(_naive(loss_fn, batch)),
        "value_and_grad": jax.jit(jax.value_and_grad(loss_fn)),
    }
    if not flax:
        return fns, (params, x, y)
    mlp = _flax_mlp()
    flax_params = {"params": {k: {"kernel": v["weight"], "bias": v["bias"]} for k, v in params.items()}}

    def flax_loss(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(mlp.apply(params, x), y).mean()

    # each takes the vjpkit args and ignores them for the linen params (the same weights)
    fns["vjpkit (Flax linen)"] = _on_flax(per_example_grad_norms(flax_loss))
    fns["vmap(grad) (Flax linen)"] = _on_flax(_naive(flax_loss, batch))
    return fns, (params, x, y, flax_params)


def _on_flax(fn):
    return jax.jit(lambda params, x, y, flax_params: fn(flax_params, x, y))


def _base_args(variant, args):
    """The arguments ``fns[variant]`` takes."""
    return args if variant in FLAX_VARIANTS else args[:3]


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def child(variant: str, batch: int) -> dict:
    """Memory of one variant, measured in this (fresh) process."""
    fns, args = setup(batch, flax=variant in FLAX_VARIANTS)
    args = _base_args(variant, args)
    jax.block_until_ready(args)
    before_compile = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    compiled = fns[variant].lower(*args).compile()
    mem = xla_memory(compiled)
    reset = False
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the resident-set high-water mark
        reset = True
    except OSError:
        pass
    rss_before_run = _status_kb("VmRSS")
    for _ in range(5):
        jax.block_until_ready(compiled(*args))
    hwm = _status_kb("VmHWM")
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return dict(
        xla_temp_mb=mem["temp_mb"],
        xla_argument_mb=mem["argument_mb"],
        xla_output_mb=mem["output_mb"],
        xla_peak_mb=mem["peak_mb"],
        rss_run_mb=(hwm - rss_before_run) / 1e3 if reset and hwm and rss_before_run else None,
        rss_total_mb=(after - before_compile) / 1e3,
    )


def memory(variant: str, batch: int) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--batch", str(batch)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def timing(batch: int, rounds: int, block: int, flax: bool = False, fns_args=None) -> dict:
    """``fns_args``: ``setup(batch, flax)``'s result, if the caller has it (compiled already)."""
    fns, args = fns_args or setup(batch, flax)
    names = variants(flax)
    for v in names:  # compile and warm up
        for _ in range(2):
            jax.block_until_ready(fns[v](*_base_args(v, args)))
    per_call = {v: [] for v in names}
    rng = random.Random(0)
    for _ in range(rounds):
        order = list(names)
        rng.shuffle(order)
        for v in order:
            a = _base_args(v, args)
            start = time.perf_counter()
            for _ in range(block):
                out = fns[v](*a)
            jax.block_until_ready(out)
            per_call[v].append((time.perf_counter() - start) / block)
    ratios = [n / k for n, k in zip(per_call["vmap(grad)"], per_call["vjpkit"])]
    out = dict(
        median_ms={v: statistics.median(t) * 1e3 for v, t in per_call.items()},
        speedup=statistics.median(ratios),
        speedup_range=(min(ratios), max(ratios)),
    )
    if flax:
        flax_ratios = [
            n / k for n, k in zip(per_call["vmap(grad) (Flax linen)"], per_call["vjpkit (Flax linen)"])
        ]
        out["flax_speedup"] = statistics.median(flax_ratios)
        out["flax_speedup_range"] = (min(flax_ratios), max(flax_ratios))
        # the Flax model has the vjpkit model's weights: the norms must agree
        a, b = fns["vjpkit"](*args[:3])[2].total, fns["vjpkit (Flax linen)"](*args)[2].total
        out["flax_max_rel_diff"] = float(jnp.max(jnp.abs(a - b) / jnp.abs(a)))
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 2 calls: a smoke run")
    parser.add_argument("--out", default=str(HERE / "per_example_results.json"))
    parser.add_argument("--no-flax", action="store_true", help="leave out the Flax linen rows")
    parser.add_argument("--child", choices=VARIANTS + FLAX_VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.batch)))
        return {}
    if args.quick:
        args.rounds, args.block = 3, 2

    flax = not args.no_flax and have_flax()
    load_before = os.getloadavg()[0]
    mem = {v: memory(v, args.batch) for v in variants(flax)}
    t = timing(args.batch, args.rounds, args.block, flax)
    memory_ratio = mem["vmap(grad)"]["xla_peak_mb"] / mem["vjpkit"]["xla_peak_mb"]
    rss = [mem[v]["rss_run_mb"] for v in ("vmap(grad)", "vjpkit")]
    rss_ratio = rss[0] / max(rss[1], 1e-3) if None not in rss else None

    print(f"Per-example gradient norms, MLP 784-512-512-10, batch {args.batch}")
    print(f"(jax {jax.__version__}, {platform.machine()}, {os.cpu_count()} cores, load {load_before:.2f})\n")
    print(
        "| variant | median call (ms) | XLA peak: temp + args + out (MB) "
        "| RSS while running (MB) | RSS incl. compile (MB) |"
    )
    print("|---|---:|---:|---:|---:|")
    for v in variants(flax):
        m = mem[v]
        run_mb = "n/a" if m["rss_run_mb"] is None else f"{m['rss_run_mb']:.1f}"
        print(
            f"| {v} | {t['median_ms'][v]:.2f} | {m['xla_peak_mb']:.1f} "
            f"({m['xla_temp_mb']:.1f} + {m['xla_argument_mb']:.1f} + {m['xla_output_mb']:.1f}) "
            f"| {run_mb} | {m['rss_total_mb']:.1f} |"
        )
    lo, hi = t["speedup_range"]
    ok_t, ok_m = t["speedup"] >= TARGET_SPEEDUP, memory_ratio >= TARGET_MEMORY
    print(
        f"\nvjpkit vs vmap(grad): {t['speedup']:.1f}x faster (per-round {lo:.1f}-{hi:.1f}; target >= "
        f"{TARGET_SPEEDUP:.0f}x {'met' if ok_t else 'NOT met'}), {memory_ratio:.1f}x less XLA peak memory "
        f"(target >= {TARGET_MEMORY:.0f}x {'met' if ok_m else 'NOT met'})"
        + (f", {rss_ratio:.1f}x less RSS while running" if rss_ratio else "")
    )
    flax_memory_ratio = None
    if flax:
        flax_memory_ratio = (
            mem["vmap(grad) (Flax linen)"]["xla_peak_mb"] / mem["vjpkit (Flax linen)"]["xla_peak_mb"]
        )
        flo, fhi = t["flax_speedup_range"]
        print(
            f"Flax linen: vjpkit vs vmap(grad) {t['flax_speedup']:.1f}x faster "
            f"(per-round {flo:.1f}-{fhi:.1f}), "
            f"{flax_memory_ratio:.1f}x less XLA peak memory; vjpkit on Flax / on vjpkit.nn: "
            f"{t['median_ms']['vjpkit (Flax linen)'] / t['median_ms']['vjpkit']:.2f}x the time; "
            f"norms agree to {t['flax_max_rel_diff']:.1e} (relative)"
        )
    result = dict(
        meta=dict(
            date=datetime.datetime.now().isoformat(timespec="seconds"),
            machine=platform.machine(),
            cores=os.cpu_count(),
            load_average=load_before,
            jax=jax.__version__,
            backend=jax.default_backend(),
            batch=args.batch,
            rounds=args.rounds,
            block=args.block,
        ),
        median_ms=t["median_ms"],
        speedup=t["speedup"],
        speedup_range=list(t["speedup_range"]),
        memory=mem,
        xla_peak_memory_ratio=memory_ratio,
        flax=None
        if not flax
        else dict(
            speedup=t["flax_speedup"],
            speedup_range=list(t["flax_speedup_range"]),
            xla_peak_memory_ratio=flax_memory_ratio,
            max_rel_diff_vs_nn=t["flax_max_rel_diff"],
        ),
        rss_run_memory_ratio=rss_ratio,
        targets=dict(speedup=TARGET_SPEEDUP, memory=TARGET_MEMORY, speedup_met=ok_t, memory_met=ok_m),
    )
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
