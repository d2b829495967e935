"""Time to a target loss: K-FAC from vjpkit's records against tuned Adam and SGD (issue 32, item 6).

Each problem trains one model from one initialisation on the same batches (seeds fixed), through
``vk.train.make_step`` (one jitted step per optimizer setting), with each optimizer tuned on a
grid: **Adam** over 7 learning rates (1e-4 ... 1e-1), **SGD with momentum 0.9** over 6 (3e-3 ...
1), **K-FAC** (``vk.curvature.kfac``, ``stats("*", ["kfac"])`` every step, with ``"grad_rows"`` on
the MLP and the autoencoder for the records form, momentum 0.9, inverses refreshed every
``--update-every`` steps) over 6 learning rates (3e-3 ... 1) x 2 dampings,
the same K-FAC with its statistics on every 10th step only (``make_step(...,
curvature_every=10)``), and **EKFAC** (``stats("*", ["ekfac"])``, ``estimator="ekfac"``: the
scaling corrected every step, the eigenbasis refreshed every ``--update-every`` steps) on
K-FAC's grid. Problems, all on
scikit-learn's digits (8x8 images; no MNIST offline here), batch 128:

* ``mlp``: 64-512-512-10 with ReLUs, softmax cross-entropy (the 784-512-512-10 MLP of the
  issue, on the digits' 64 inputs);
* ``cnn``: ``examples/_digits.py``'s small CNN, softmax cross-entropy;
* ``autoencoder``: the classic deep autoencoder shape (Martens & Grosse 2015), 64-1000-500-250-30
  mirrored, sigmoid units and a linear code, sigmoid cross-entropy against the pixel
  intensities scaled to [0, 1];
* ``lm``: ``examples/plain_jax.py``'s plain-``jnp`` transformer (an embedding tied to the head,
  2 pre-norm blocks under ``lax.scan`` over stacked weights, residual biases, layer norms; its
  defaults: vocabulary 16, d = 32, 16 positions) on its copy task (each sequence repeats a
  random pattern of 4 tokens), next-token softmax cross-entropy over every position: per
  sequence, ``(B, T, V)`` logits.

**kfac-jax** (``kfac_jax.Optimizer``, fixed learning rate, momentum 0.9 and damping, the same
EMA decay 0.95 and inverse period, its graph matcher registering the layers) runs in its side
environment (made by ``python benchmarks/kfac_jax_env.py``: jax 0.9.1; ``kfac_jax_side.py race``;
without it its rows say so) on the same batches from
the same initial weights, tuned on K-FAC's grid, with the target passed in; it also runs Adam at
the best Adam learning rate in its own process, so that its time ratio is to an Adam step on
its own jax. It cannot run the ``lm``: on a dense layer under ``lax.scan`` kfac-jax 0.0.8 raises
``ValueError: The following parameter indices were not assigned a block`` (tried on a 2-block
scanned MLP in its side environment); the table says so.

The loss of a run is its batches' loss, a 10-step running mean. The **target** of a problem is
the best-tuned Adam's final loss; each optimizer's best setting is the one reaching the target
in the fewest steps, and its wall time to the target is measured (compilation excluded: each
setting's step is compiled and run once before its timed run). The K-FAC and EKFAC rows also give the
median time of a step that refreshes the inverses and of one that does not. The settings' runs
are interleaved (shuffled, seeded) on one process; ``os.getloadavg()`` is reported at the start
and the end.

Usage: ``python benchmarks/curvature_race.py [--quick] [--steps 300] [--problems mlp,cnn,autoencoder,lm]
[--optimizers adam,sgd,kfac,kfac-every,ekfac,kfac-jax] [--out benchmarks/curvature_race.json]
[--plot benchmarks/curvature_race.png]``. Needs the
``examples`` extra (scikit-learn; matplotlib for ``--plot``).
"""

from __future__ import annotations

import os

# K-FAC's refresh (inverses, eigh) calls LAPACK through scipy's OpenBLAS, whose threads contend with
# XLA's on CPU: one thread each (before jax loads it), docs/curvature.md, "LAPACK threads"
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import math
import pathlib
import random
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

import plain_jax  # noqa: E402
from _digits import cnn, load_data  # noqa: E402
from kfac_jax_env import side_env, side_python, side_reason  # noqa: E402

import vjpkit as vk  # noqa: E402
from vjpkit import nn  # noqa: E402

PROBLEMS = ("mlp", "cnn", "autoencoder", "lm")
KFAC_JAX = "kfac-jax"
# kfac-jax 0.0.8 on a dense layer under lax.scan (a 2-block scanned MLP, tried in its side
# environment): "ValueError: The following parameter indices were not assigned a block: {0, 1}"
KFAC_JAX_CANNOT = {"lm": "not run: kfac-jax assigns no block to a layer under lax.scan (ValueError)"}
KFAC_EVERY = "K-FAC, statistics every 10"  # make_step(..., curvature_every=10)
ROWS_PROBLEMS = ("mlp", "autoencoder")  # K-FAC asks for grad_rows there (its records form)
GRIDS = {
    "Adam": [(lr,) for lr in (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)],
    "SGD": [(lr,) for lr in (0.003, 0.01, 0.03, 0.1, 0.3, 1.0)],
    "K-FAC": [(lr, dmp) for lr in (0.003, 0.01, 0.03, 0.1, 0.3, 1.0) for dmp in (1e-2, 1e-1)],
    KFAC_EVERY: [(lr, dmp) for lr in (0.003, 0.01, 0.03, 0.1, 0.3, 1.0) for dmp in (1e-2, 1e-1)],
    "EKFAC": [(lr, dmp) for lr in (0.003, 0.01, 0.03, 0.1, 0.3, 1.0) for dmp in (1e-2, 1e-1)],
    KFAC_JAX: [(lr, dmp) for lr in (0.003, 0.01, 0.03, 0.1, 0.3, 1.0) for dmp in (1e-2, 1e-1)],
}
QUICK_GRIDS = {
    "Adam": [(1e-3,)], "SGD": [(0.1,)], "K-FAC": [(0.1, 1e-1)], KFAC_EVERY: [(0.1, 1e-1)],
    "EKFAC": [(0.1, 1e-1)], KFAC_JAX: [(0.1, 1e-1)],
}  # fmt: skip
CURVATURE = ("K-FAC", KFAC_EVERY, "EKFAC")
NAMES = {
    "adam": "Adam", "sgd": "SGD", "kfac": "K-FAC", "kfac-every": KFAC_EVERY, "ekfac": "EKFAC",
    "kfac-jax": KFAC_JAX,
}  # fmt: skip


def problem(name: str, seed: int):
    """``(loss_fn, params, x, y)`` of the problem: the loss registered for curvature."""
    if name == "lm":
        length, period, vocab = 16, 4, 16
        tokens = plain_jax.make_data(np.random.default_rng(seed), 2048, length, period, vocab)
        params = plain_jax.init_params(jax.random.key(seed), vocab, 32, 2, length)

        def lm_loss(p, batch):
            xb, yb = batch  # (B, T) tokens and their next tokens: the loss per sequence
            return vk.curvature.softmax_cross_entropy(plain_jax.apply(p, xb), yb)

        return lm_loss, params, tokens[:, :-1], tokens[:, 1:]
    (x, y), _ = load_data(seed)
    x = np.asarray(x, np.float32)
    if name == "cnn":
        model = cnn(fc=nn.dense(10))
    elif name == "mlp":
        model = nn.serial(
            flat=nn.flatten(),
            fc1=nn.dense(512),
            r1=nn.relu(),
            fc2=nn.dense(512),
            r2=nn.relu(),
            fc3=nn.dense(10),
        )
    else:
        layers, widths = {"flat": nn.flatten()}, (1000, 500, 250, 30, 250, 500, 1000)
        for i, w in enumerate(widths):
            layers[f"fc{i + 1}"] = nn.dense(w)
            if w != 30:  # a linear code layer
                layers[f"s{i + 1}"] = nn.sigmoid()
        layers["out"] = nn.dense(x[0].size)
        model = nn.serial(**layers)
        y = x.reshape(len(x), -1) / max(float(x.max()), 1.0)  # intensities in [0, 1]
    params = model.init(jax.random.key(seed), jnp.asarray(x[:1]))

    def loss_fn(p, batch):
        xb, yb = batch
        out = model.apply(p, xb)
        if name == "autoencoder":
            return vk.curvature.sigmoid_binary_cross_entropy(out, yb)
        return vk.curvature.softmax_cross_entropy(out, yb)

    return loss_fn, params, x, y


def optimizer(kind: str, setting: tuple, loss_fn, params, batch, update_every: int, name: str = ""):
    """``(optax transformation, capture or None)`` of one setting."""
    if kind == "Adam":
        return optax.adam(setting[0]), None
    if kind == "SGD":
        return optax.sgd(setting[0], momentum=0.9), None
    estimator = "ekfac" if kind == "EKFAC" else "kfac"
    # on the wide MLP and autoencoder K-FAC also keeps the gradient's rows, for its records form
    # (a layer wider than the batch); the CNN's and the LM's layers are narrower than their rows
    # (the records form would not be taken), and capturing the rows costs the steps between
    # statistics their plain gradient (the LM's: 10.6 ms against 7.9)
    rows = ["grad_rows"] if estimator == "kfac" and name in ROWS_PROBLEMS else []
    spec = vk.curvature.stats("*", [estimator, *rows])
    grad_fn = vk.value_and_grad(loss_fn, capture=spec)
    like = jax.eval_shape(lambda p, b: grad_fn(p, b, key=jax.random.key(0))[1], params, batch)
    opt = vk.curvature.kfac(
        setting[0], like=like, estimator=estimator, damping=setting[1], momentum=0.9,
        update_every=update_every,
    )  # fmt: skip
    return opt, spec


def run_one(loss_fn, opt, capture, params, data, every: int = 1) -> dict:
    step = vk.train.make_step(loss_fn, opt, capture=capture, curvature_every=every)
    state = vk.train.TrainState.create(params, opt, seed=1)
    state, _ = step(state, data[0])  # compile; not timed, not kept
    if every > 1:  # the step without statistics is a second program (make_step's host dispatch)
        state, _ = step(state, data[1])
    jax.block_until_ready(state)
    state = vk.train.TrainState.create(params, opt, seed=1)
    losses, ends = [], []
    start = time.perf_counter()
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))  # waits for the step
        ends.append(time.perf_counter() - start)
    return {"loss": np.asarray(losses), "seconds": np.asarray(ends)}


def smooth(loss: np.ndarray) -> np.ndarray:
    """The 10-step running mean (over the steps so far, for the first nine)."""
    c = np.cumsum(loss)
    n = np.arange(1, len(loss) + 1)
    return np.where(n < 10, c / n, (c - np.concatenate([np.zeros(10), c[:-10]])) / np.minimum(n, 10))


def race(name: str, steps: int, grids: dict, update_every: int, seed: int, batch_size: int = 128) -> dict:
    loss_fn, params, x, y = problem(name, seed)
    rng = np.random.default_rng(seed)
    data = [
        (jnp.asarray(x[i]), jnp.asarray(y[i]))
        for i in (rng.choice(len(x), batch_size, replace=False) for _ in range(steps))
    ]
    jobs = [(kind, s) for kind, grid in grids.items() if kind != KFAC_JAX for s in grid]
    random.Random(seed).shuffle(jobs)  # the settings' runs interleaved
    runs = {}
    for kind, setting in jobs:
        opt, capture = optimizer(kind, setting, loss_fn, params, data[0], update_every, name)
        r = run_one(loss_fn, opt, capture, params, data, 10 if kind == KFAC_EVERY else 1)
        r["smooth"] = smooth(r["loss"])
        runs[(kind, setting)] = r
    adam = [r for (k, _), r in runs.items() if k == "Adam"]
    target = float(min(r["smooth"][-1] for r in adam if np.isfinite(r["smooth"][-1])))
    notes, side_adam = {}, None
    if KFAC_JAX in grids:
        if name in KFAC_JAX_CANNOT:
            notes[KFAC_JAX] = KFAC_JAX_CANNOT[name]
        else:
            adams = [(r["smooth"][-1], s[0]) for (k, s), r in runs.items() if k == "Adam"]
            adam_lr = min((v, lr) for v, lr in adams if np.isfinite(v))[1]
            side = kfac_jax_runs(name, params, data, grids[KFAC_JAX], update_every, seed, adam_lr)
            if isinstance(side, str):
                notes[KFAC_JAX] = side
            else:
                for run in side["runs"]:
                    r = {k: np.asarray(run[k]) for k in ("loss", "seconds")}
                    runs[(KFAC_JAX, tuple(run["setting"]))] = {**r, "smooth": smooth(r["loss"])}
                side_adam = {k: np.asarray(side["adam"][k]) for k in ("loss", "seconds")}
                notes["kfac-jax versions"] = side["versions"]
    rows = {}
    for kind in grids:
        if kind == KFAC_JAX and kind in notes:
            rows[kind] = {"note": notes[kind]}
            continue
        best = None
        for (k, setting), r in runs.items():
            if k != kind:
                continue
            hit = np.nonzero(r["smooth"] <= target)[0]
            reach = int(hit[0]) + 1 if len(hit) else None
            final = float(r["smooth"][-1])
            score = (reach is None, reach or 0, final if np.isfinite(final) else np.inf)
            if best is None or score < best[0]:
                best = (score, setting, reach, r)
        _, setting, reach, r = best
        step_s = np.diff(np.concatenate([[0.0], r["seconds"]]))
        row = {
            "setting": list(setting),
            "steps_to_target": reach,
            "seconds_to_target": None if reach is None else float(r["seconds"][reach - 1]),
            "final_loss": float(r["smooth"][-1]),
            "median_step_ms": 1e3 * float(np.median(step_s)),
            "mean_step_ms": 1e3 * float(r["seconds"][-1]) / steps,  # amortized: refreshes, statistics
            "curve": r["smooth"].tolist(),
        }
        if kind == KFAC_JAX:  # Adam's steps to the target, timed in kfac-jax's process and jax
            reach_adam = rows["Adam"]["steps_to_target"]
            row["adam_seconds_to_target_same_process"] = float(side_adam["seconds"][reach_adam - 1])
        if kind in (*CURVATURE, KFAC_JAX):  # the step that refreshes the inverses (count % update_every == 0)
            period = math.lcm(update_every, 10) if kind == KFAC_EVERY else update_every
            refresh = np.arange(steps) % period == 0
            row["refresh_step_ms"] = 1e3 * float(np.median(step_s[refresh]))
            row["other_step_ms"] = 1e3 * float(np.median(step_s[~refresh])) if (~refresh).any() else None
        rows[kind] = row
    return {"problem": name, "target": target, "steps": steps, "rows": rows, "notes": notes}


def kfac_jax_runs(name, params, data, grid, update_every, seed, adam_lr) -> dict | str:
    """kfac-jax's runs on the problem in its side environment (``kfac_jax_side.py race``), or why
    there are none."""
    python = side_python(create=False)  # made by `python benchmarks/kfac_jax_env.py`, never here
    if python is None:
        return f"not run: no kfac-jax side environment ({side_reason(create=False)})"
    layers = [params[k] for k in sorted(params) if isinstance(params[k], dict) and "weight" in params[k]]
    arrays = {f"w{i}": np.asarray(p["weight"]) for i, p in enumerate(layers)}
    arrays.update({f"b{i}": np.asarray(p["bias"]) for i, p in enumerate(layers)})
    arrays.update(
        problem=np.asarray(name), x=np.stack([np.asarray(b[0]) for b in data]),
        y=np.stack([np.asarray(b[1]) for b in data]), grid=np.asarray(grid, np.float64),
        update_every=np.asarray(update_every), adam_lr=np.asarray(adam_lr), seed=np.asarray(seed),
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = pathlib.Path(tmp, "in.npz"), pathlib.Path(tmp, "out.json")
        np.savez(inp, **arrays)
        proc = subprocess.run(
            [python, str(HERE / "kfac_jax_side.py"), "race", "--in", str(inp), "--out", str(out)],
            capture_output=True, text=True, env=side_env(), timeout=3600,
        )  # fmt: skip
        if proc.returncode != 0:
            return f"not run: kfac_jax_side.py race failed: {proc.stderr.strip().splitlines()[-1:]}"
        return json.loads(out.read_text())


def markdown(results: list[dict]) -> str:
    lines = [
        "| problem | target (Adam's best final loss) | optimizer | best setting | steps to target | "
        "seconds to target | final loss | median step (ms) | mean step (ms) | refresh / other step (ms) |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        for kind, r in res["rows"].items():
            if "note" in r:
                lines.append(f"| {res['problem']} | {res['target']:.4f} | {kind} | {r['note']} | | | | | | |")
                continue
            setting = ", ".join(f"{v:g}" for v in r["setting"])
            steps = "—" if r["steps_to_target"] is None else str(r["steps_to_target"])
            secs = "—" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.2f}"
            split = (
                f"{r['refresh_step_ms']:.1f} / {r['other_step_ms']:.1f}"
                if kind in (*CURVATURE, KFAC_JAX) and r.get("other_step_ms") is not None
                else ""
            )
            lines.append(
                f"| {res['problem']} | {res['target']:.4f} | {kind} | {setting} | {steps} | {secs} | "
                f"{r['final_loss']:.4f} | {r['median_step_ms']:.2f} | {r['mean_step_ms']:.2f} | {split} |"
            )
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.4), squeeze=False)
    for ax, res in zip(axes[0], results):
        for kind, r in res["rows"].items():
            if "curve" not in r:
                continue
            ax.plot(np.arange(1, len(r["curve"]) + 1), r["curve"], label=kind, lw=1)
        ax.axhline(res["target"], color="grey", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_title(res["problem"])
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (10-step mean)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one setting each, 20 steps (a smoke run)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--problems", default=",".join(PROBLEMS))
    parser.add_argument("--update-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(HERE / "curvature_race.json"))
    parser.add_argument("--plot", default=None, help="save the best runs' loss curves to this image")
    parser.add_argument(
        "--optimizers",
        default=",".join(NAMES),
        help=f"of {list(NAMES)}, comma-separated (Adam always: the target)",
    )
    args = parser.parse_args(argv)
    steps, grids = (20, QUICK_GRIDS) if args.quick else (args.steps, GRIDS)
    asked = set(args.optimizers.split(","))
    if asked - set(NAMES):
        parser.error(f"unknown optimizers {sorted(asked - set(NAMES))}; choose from {list(NAMES)}")
    grids = {k: v for k, v in grids.items() if k == "Adam" or k in {NAMES[a] for a in asked}}
    load = os.getloadavg()[0]
    start = time.time()
    results = [race(p, steps, grids, args.update_every, args.seed) for p in args.problems.split(",")]
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "jax": jax.__version__,
        "load_average_at_start": load,
        "load_average_at_end": os.getloadavg()[0],
        "wall_s": time.time() - start,
        "update_every": args.update_every,
        "grids": {k: [list(s) for s in v] for k, v in grids.items()},
    }
    print(
        f"{meta['date']} | jax {meta['jax']} | load {load:.2f} at the start, "
        f"{meta['load_average_at_end']:.2f} at the end | {meta['wall_s']:.0f} s | "
        f"inverses refreshed every {args.update_every} steps"
    )
    print(markdown(results))
    out = {"meta": meta, "results": results}
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1))
    if args.plot:
        plot(results, args.plot)
        print(f"saved {args.plot}")
    return out


if __name__ == "__main__":
    main()
