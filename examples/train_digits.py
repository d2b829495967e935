"""Train a small CNN on scikit-learn's digits with ``vk.train.fit``: hooks, capture, checkpoints.

The main training demo. One call to ``vk.train.fit`` runs the whole loop, jit-compiled:

* an ``ema_normalize`` hook on the globs ``"conv*"`` rewrites each conv layer's gradient
  from the history of its gradients (its EMA state is threaded through the steps by ``fit``);
* ``capture=vk.capture("*", fields=["grad_params"], reduce="norm")`` computes the norm of every
  layer's parameter gradient inside the compiled step, and ``on_records`` receives them on the
  host for every step;
* the state (params, optimizer state, hook state, step, rng) is checkpointed with orbax every
  ``--checkpoint-every`` steps and at the end. Running again with the same ``--checkpoint-dir``
  and a larger ``--steps`` resumes where the last run stopped;
* the test accuracy is evaluated every ``--eval-every`` steps, and a tqdm progress bar shows
  the loss and the throughput (on a terminal; ``--no-progress`` turns it off).

It ends by printing the test accuracy and a per-layer table of the captured gradient norms over
the steps it ran. The captured record is the one *after* the hooks ran, so for the conv layers
these are the norms of the ema-normalized gradients, the ones the optimizer received.

Run: ``python examples/train_digits.py`` (``--steps 30`` for a run of a few seconds).
Needs the ``examples`` extra (scikit-learn): ``pip install -e ".[examples]"``.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _digits import cnn, load_data

import vjpkit as vk
from vjpkit import nn

model = cnn(fc=nn.dense(10))

DECAY = 0.9  # ema_normalize's EMA decay
MOMENTUM = 0.9


def hooks() -> dict:
    """The hooks: each conv layer's parameter gradient is normalized by its EMA history."""
    return {"conv*": vk.ema_normalize(DECAY)}


def capture() -> vk.CaptureSpec:
    """What each step captures, in the graph: the norm of every layer's parameter gradients."""
    return vk.capture("*", fields=["grad_params"], reduce="norm")


def loss_fn(params, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()


def make_eval(x_test, y_test):
    """``eval_fn(params) -> {"test_accuracy": float}``, jitted once."""
    predict = jax.jit(lambda params: jnp.argmax(model.apply(params, x_test), axis=-1))

    def eval_fn(params):
        return {"test_accuracy": float(np.mean(np.asarray(predict(params)) == y_test))}

    return eval_fn


class NormRecorder:
    """``on_records(step, captured)``: keeps each layer's gradient norms, step by step.

    ``captured`` maps call keys (``"conv1"``, ...) to ``vk.Cotangents`` whose ``grad_params``
    is ``{"weight": norm, "bias": norm}`` (``{}`` for layers without params), as numpy scalars.
    """

    def __init__(self):
        self.steps: list[int] = []
        self.norms: dict[str, dict[str, list[float]]] = {}

    def __call__(self, step: int, captured: dict) -> None:
        self.steps.append(step)
        for key, rec in captured.items():
            for leaf, norm in rec.grad_params.items():
                self.norms.setdefault(key, {}).setdefault(leaf, []).append(float(norm))

    def arrays(self) -> dict[str, dict[str, np.ndarray]]:
        return {key: {leaf: np.asarray(v) for leaf, v in d.items()} for key, d in self.norms.items()}


def layers_with_params(params) -> list[str]:
    """The layers that have parameters, in forward order."""
    return [name for name, p in params.items() if jax.tree.leaves(p)]


def norm_table(steps: list[int], norms: dict, layers: list[str]) -> str:
    """A per-layer table of the weight-gradient norm: first, median, last and max over the steps."""
    if not steps:
        return "gradient norms: no step ran in this invocation (the checkpoint was already at --steps)."
    lines = [
        f"weight-gradient norm |dL/dW| per layer over steps {steps[0]}..{steps[-1]}, captured AFTER the",
        "hooks ran (conv layers: the ema_normalize'd gradient, the one SGD received; fc: the raw gradient)",
        f"{'layer':<8} {'hook':<14} {'first':>9} {'median':>9} {'last':>9} {'max':>9}",
    ]
    for name in layers:
        w = norms[name]["weight"]
        hook = "ema_normalize" if name.startswith("conv") else "-"
        cells = (w[0], np.median(w), w[-1], np.max(w))
        lines.append(f"{name:<8} {hook:<14} " + " ".join(f"{v:9.4f}" for v in cells))
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="total steps of the run (resumes count)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--checkpoint-dir", default=None, help="default: a fresh temporary directory")
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--scan-steps", type=int, default=1, help="steps per dispatch (lax.scan)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--seed", type=int, default=0, help="seeds the init and the batch order")
    args = parser.parse_args(argv)
    checkpoint_dir = args.checkpoint_dir or tempfile.mkdtemp(prefix="vjpkit-digits-")

    (x_train, y_train), (x_test, y_test) = load_data()
    params = model.init(jax.random.key(args.seed), x_train[: args.batch_size])
    layers = layers_with_params(params)
    recorder = NormRecorder()
    print(
        f"digits: {len(x_train)} train / {len(x_test)} test images, 8x8x1; layers with params: {layers}; "
        "hooks: conv* <- ema_normalize"
    )
    print(f"checkpoints: {checkpoint_dir} (run again with --checkpoint-dir {checkpoint_dir} to resume)")

    start = time.perf_counter()
    state, history = vk.train.fit(
        loss_fn,
        optax.sgd(args.lr, momentum=MOMENTUM),
        params,
        (x_train, y_train),
        batch_size=args.batch_size,
        steps=args.steps,
        hooks=hooks(),
        capture=capture(),
        on_records=recorder,
        scan_steps=args.scan_steps,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        eval_fn=make_eval(x_test, y_test),
        eval_every=args.eval_every,
        progress=False if args.no_progress else None,  # None: a bar when stderr is a terminal
        seed=args.seed,
    )
    seconds = time.perf_counter() - start
    ran = len(history["step"])
    first = history["step"][0] if ran else int(state.step)
    if first > 0:
        print(f"resumed from the checkpoint at step {first}")
    for ev in history["eval"]:
        print(f"step {ev['step']:5d}: test accuracy {ev['test_accuracy']:.4f}")
    accuracy = history["eval"][-1]["test_accuracy"]
    loss = f"; final loss {history['loss'][-1]:.4f}" if ran else ""
    print(f"{ran} steps in {seconds:.2f} s (compilation included){loss}")
    print(f"test accuracy {accuracy:.4f} after {int(state.step)} steps\n")
    norms = recorder.arrays()
    print(norm_table(recorder.steps, norms, layers))
    return dict(
        accuracy=accuracy,
        history=history,
        steps=np.asarray(recorder.steps, dtype=np.int64),
        norms=norms,
        layers=layers,
        state=state,
        init_params=params,
        checkpoint_dir=checkpoint_dir,
        args=vars(args),
    )


if __name__ == "__main__":
    main()
