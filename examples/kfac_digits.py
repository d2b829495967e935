"""K-FAC from vjpkit's records against Adam and SGD on scikit-learn's digits, at equal steps and time.

Each optimizer trains the same model from the same initialisation on the same batches, through
``vk.train.make_step`` (one jitted step each):

* **K-FAC**: the step's ``vk.value_and_grad`` captures ``vk.curvature.stats("*", ["kfac"])`` (the
  Monte-Carlo Fisher factors of every layer, one sampled label per example, from one extra
  backward pass), and ``vk.curvature.kfac`` (an optax transformation) keeps their EMA, inverts
  them every ``--update-every`` steps and preconditions each layer's gradient;
* **Adam**, tuned: the best of ``--adam-lrs`` (five learning rates by default) on the same
  batches, by final loss (each candidate is a full run; only the best is shown);
* **SGD with momentum**: the same loss, plain ``optax``.

It prints the training loss of each at equal steps and at equal wall time (the time the fastest
run took, compilation excluded), and with ``--plot PATH`` draws the loss against steps and
against seconds. The model is an MLP 64-64-64-10 (``--model mlp``) or ``_digits.py``'s small
CNN (``--model cnn``).

Run: ``python examples/kfac_digits.py`` (``--steps 30`` for a run of a few seconds).
Needs the ``examples`` extra (scikit-learn, matplotlib): ``pip install -e ".[examples]"``.
"""

from __future__ import annotations

import os

# K-FAC's refresh (inverses, eigh) calls LAPACK through scipy's OpenBLAS, whose threads contend with
# XLA's on CPU: one thread each (before jax loads it), docs/curvature.md, "LAPACK threads"
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _digits import cnn, load_data

import vjpkit as vk
from vjpkit import nn


def make_model(kind: str) -> nn.Layer:
    if kind == "cnn":
        return cnn(fc=nn.dense(10))
    return nn.serial(
        flat=nn.flatten(),
        fc1=nn.dense(64),
        relu1=nn.relu(),
        fc2=nn.dense(64),
        relu2=nn.relu(),
        fc3=nn.dense(10),
    )


def make_loss(model: nn.Layer):
    def loss_fn(params, batch):
        x, y = batch
        return vk.curvature.softmax_cross_entropy(model.apply(params, x), y)

    return loss_fn


def batches(x: np.ndarray, y: np.ndarray, size: int, steps: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [
        tuple(a[i] for a in (x, y)) for i in (rng.choice(len(x), size, replace=False) for _ in range(steps))
    ]


def kfac_optimizer(
    loss_fn, params, batch, args
) -> tuple[optax.GradientTransformation, vk.curvature.StatsSpec]:
    spec = vk.curvature.stats("*", ["kfac"])
    grad_fn = vk.value_and_grad(loss_fn, capture=spec)
    like = jax.eval_shape(lambda p, b: grad_fn(p, b, key=jax.random.key(0))[1], params, batch)
    opt = vk.curvature.kfac(
        args.kfac_lr, like=like, damping=args.damping, momentum=0.9, update_every=args.update_every
    )
    return opt, spec


def train(name, loss_fn, optimizer, params, data, capture=None) -> dict:
    step = vk.train.make_step(loss_fn, optimizer, capture=capture)
    state = vk.train.TrainState.create(params, optimizer, seed=1)
    state, _ = step(state, data[0])  # compile (the first step is not timed, nor kept)
    state = vk.train.TrainState.create(params, optimizer, seed=1)
    losses, seconds = [], []
    start = time.perf_counter()
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))  # waits for the step: the clock is honest
        seconds.append(time.perf_counter() - start)
    return {"name": name, "loss": np.array(losses), "seconds": np.array(seconds), "params": state.params}


def tuned_adam(loss_fn, params, data, lrs: list[float]) -> dict:
    """The Adam run with the lowest final loss (10-step mean) over the learning rates ``lrs``."""
    runs = [train("Adam", loss_fn, optax.adam(lr), params, data) | {"lr": lr} for lr in lrs]
    best = min(runs, key=lambda r: np.nan_to_num(np.mean(r["loss"][-10:]), nan=np.inf))
    best["name"] = f"Adam (lr {best['lr']:g}, best of {len(lrs)})"
    return best


def loss_at(run: dict, t: float) -> float:
    """The training loss (a 10-step running mean) of the last step finished by time ``t``."""
    i = max(int(np.searchsorted(run["seconds"], t, side="right")) - 1, 0)
    return float(np.mean(run["loss"][max(0, i - 9) : i + 1]))


def accuracy(model, params, x, y) -> float:
    return float(jnp.mean(jnp.argmax(model.apply(params, x), -1) == y))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--kfac-lr", type=float, default=0.05)
    parser.add_argument("--damping", type=float, default=0.1)
    parser.add_argument("--update-every", type=int, default=5)
    parser.add_argument(
        "--adam-lrs", default="3e-4,1e-3,3e-3,1e-2,3e-2", help="Adam's learning rates; the best is shown"
    )
    parser.add_argument("--sgd-lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=None, help="save the loss curves to this image file")
    args = parser.parse_args(argv)

    (x_train, y_train), (x_test, y_test) = load_data(args.seed)
    model = make_model(args.model)
    params = model.init(jax.random.key(args.seed), jnp.asarray(x_train[:1]))
    loss_fn = make_loss(model)
    data = batches(x_train, y_train, args.batch_size, args.steps, args.seed)
    opt, spec = kfac_optimizer(loss_fn, params, data[0], args)
    runs = [
        train("K-FAC", loss_fn, opt, params, data, capture=spec),
        tuned_adam(loss_fn, params, data, [float(v) for v in args.adam_lrs.split(",")]),
        train("SGD", loss_fn, optax.sgd(args.sgd_lr, momentum=0.9), params, data),
    ]
    equal_time = min(r["seconds"][-1] for r in runs)
    print(f"{args.model}, batch {args.batch_size}, {args.steps} steps (losses: 10-step running means)")
    print(f"{'optimizer':<26} {'loss @ last step':>16} {'seconds':>8} {'ms/step':>8} "
          f"{f'loss @ {equal_time:.2f} s':>16} {'test acc':>9}")  # fmt: skip
    for r in runs:
        r["final"] = float(np.mean(r["loss"][-10:]))
        r["at_equal_time"] = loss_at(r, equal_time)
        r["test_accuracy"] = accuracy(model, r["params"], x_test, y_test)
        ms = 1e3 * r["seconds"][-1] / len(r["loss"])
        print(
            f"{r['name']:<26} {r['final']:>16.4f} {r['seconds'][-1]:>8.2f} {ms:>8.2f} "
            f"{r['at_equal_time']:>16.4f} {r['test_accuracy']:>9.3f}"
        )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
        for r in runs:
            ax1.plot(np.arange(1, len(r["loss"]) + 1), r["loss"], label=r["name"], lw=1)
            ax2.plot(r["seconds"], r["loss"], label=r["name"], lw=1)
        for ax, xlabel in ((ax1, "step"), (ax2, "seconds (compilation excluded)")):
            ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("training loss")
            ax.legend()
        fig.suptitle(f"K-FAC from vjpkit records vs Adam and SGD, digits {args.model}")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"saved {args.plot}")
    return {
        r["name"].split(" (")[0]: {
            k: r[k] for k in ("loss", "seconds", "final", "at_equal_time", "test_accuracy")
        }
        for r in runs
    }


if __name__ == "__main__":
    main()
