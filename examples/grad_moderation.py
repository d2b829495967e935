"""Gradient moderation: rewrite each conv kernel's gradient from the history of its gradients.

The scenario of the forum thread "What do the grad_in and grad_out of nn.Conv2d consist of?":
keep an exponential moving average (EMA) of the mean and variance of each conv layer's
weight gradient, "just like what is used in batchnorm", and give the kernels a new gradient
made from that history and the current gradient. In PyTorch this needs a custom module to
hold the history. Here it is one stateful hook, ``vk.ema_normalize(decay)``, on the globs
``"conv*"``; its state is an ordinary pytree threaded through the training step:

    grad_fn = vk.value_and_grad(loss_fn, hooks={"conv*": vk.ema_normalize(0.9)})
    hook_state = vk.init_hook_state(grad_fn, params, x, y)
    (loss, grads), hook_state = grad_fn(params, x, y, hook_state=hook_state)

A small CNN learns scikit-learn's bundled 8x8 digits (no download), with optax SGD + momentum,
in two ways that run the same training step on the same batches in the same order:

* ``jit``: one ``jax.jit``-compiled step per Python iteration;
* ``scan``: ``--scan-steps K`` steps per dispatch inside ``jax.lax.scan``, with the params,
  optimizer state and hook state in the scan carry.

The two runs agree to float32 rounding, not bit for bit. Inside the ``while`` loop that
``lax.scan`` compiles to, XLA:CPU (jax 0.10.2) emits the backward pass's convolutions (the conv
kernels' weight gradients and conv2's input gradient) as plain generated loops, where the
jitted step calls its library convolution; the two add up in different orders. So the first
step's loss is the same to the bit, but its conv kernel gradients differ in their last bits (by
at most about 20 float32 ulps of the largest entry). At the defaults the parameters of the two
runs stay within 1e-5 of each other for the first 50 steps; how soon after that the gap grows
depends on the XLA build and the CPU (within 1e-4 for the first 100 steps with jax 0.12.0.1,
up to 5e-4 by step 100 with jax 0.10.x on the same machine); by step 200 they have separated
(by more than 0.1): two different runs of the same training, both of which learn. This
training amplifies any last-bit change, because ``ema_normalize`` scales each kernel gradient to
unit variance however small the gradient gets, so the kernels keep taking full-size steps: the
jitted run alone, started from a kernel with one entry changed by one ulp, separates from itself
by more than 0.05 by step 200 too (0.0995 with jax 0.10.1), while without the hook (plain SGD)
the jitted and scanned runs are still within 1e-3 of each other at step 200. With
``--path both`` the script ends by printing the largest parameter difference between its two
runs after a few steps.

Per step (every ``--print-every`` steps) it prints the EMA state of each conv kernel gradient,
that gradient's std before normalization (recovered exactly from the EMA update), and its std
after normalization (captured in-graph with ``capture=``: capture sees the record *after* the
hooks ran). It ends with the test accuracy.

Run: ``python examples/grad_moderation.py`` (``--steps 20`` for a short run).
Needs the ``examples`` extra (scikit-learn): ``pip install -e ".[examples]"``.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _digits import cnn, load_data

import vjpkit as vk
from vjpkit import nn

CONVS = ("conv1", "conv2")


model = cnn(fc=nn.dense(10))

LEGEND = """\
Columns, for each conv layer's kernel (its 'weight'; the bias is moderated the same way):
  count     ema_normalize's step count (its state)
  ema_mean  EMA of the kernel gradient's mean (state, before bias correction)
  ema_var   EMA of the kernel gradient's variance (state, before bias correction)
  raw_std   std of this step's kernel gradient BEFORE normalization. The captured record is the
            one after the hooks ran, so this is recovered from the EMA update instead:
            sqrt((ema_var[t] - decay * ema_var[t-1]) / (1 - decay))
  norm_std  std of the kernel gradient AFTER ema_normalize, i.e. what SGD receives
            (captured in-graph: vk.capture("conv*", fields=["grad_params"], reduce=["mean", "var"]))"""


def loss_fn(params, x, y):
    logits = model.apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def accuracy(params, x, y) -> float:
    return float(jnp.mean(jnp.argmax(model.apply(params, x), axis=-1) == y))


def make_step(decay: float, optimizer: optax.GradientTransformation):
    """The training step and the hooked gradient function it uses."""
    grad_fn = vk.value_and_grad(
        loss_fn,
        hooks={"conv*": vk.ema_normalize(decay)},
        capture=vk.capture("conv*", fields=["grad_params"], reduce=["mean", "var"]),
    )

    def step(params, opt_state, hook_state, x, y):
        # With capture= and stateful hooks the result is ((loss, grads), captured, new_state).
        (loss, grads), captured, hook_state = grad_fn(params, x, y, hook_state=hook_state)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, hook_state, loss, captured

    return grad_fn, step


def batch_indices(n_train: int, steps: int, batch_size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(n_train, size=batch_size, replace=False) for _ in range(steps)])


def train_jit(step, carry, x_train, y_train, idx):
    """One jitted step per iteration. Returns the final carry and per-step records."""
    step = jax.jit(step)
    history = []
    for t in range(len(idx)):
        params = carry[0]
        *carry, loss, captured = step(*carry, x_train[idx[t]], y_train[idx[t]])
        history.append(dict(params=params, state=carry[2], loss=loss, captured=captured))
    history = jax.device_get(history)
    return tuple(carry), jax.tree.map(lambda *xs: np.stack(xs), *history)


def train_scan(step, carry, x_train, y_train, idx, scan_steps: int):
    """``scan_steps`` steps per dispatch inside ``jax.lax.scan``; the hook state is in the carry."""

    @jax.jit
    def run(carry, xs, ys):
        def body(carry, batch):
            params = carry[0]
            *carry, loss, captured = step(*carry, *batch)
            return tuple(carry), dict(params=params, state=carry[2], loss=loss, captured=captured)

        return jax.lax.scan(body, carry, (xs, ys))

    chunks = []
    for start in range(0, len(idx), scan_steps):
        chunk = idx[start : start + scan_steps]
        carry, stacked = run(carry, x_train[chunk], y_train[chunk])
        chunks.append(jax.device_get(stacked))
    return carry, jax.tree.map(lambda *xs: np.concatenate(xs), *chunks)


def kernel_report(history: dict, init_state: dict, decay: float) -> dict:
    """Per step and conv layer: EMA state of the kernel gradient, its raw and normalized std."""
    report = {}
    for name in CONVS:
        state = history["state"][name]
        var = state.var["weight"].astype(np.float64)
        prev = np.concatenate([[float(init_state[name].var["weight"])], var[:-1]])
        mean = state.mean["weight"].astype(np.float64)
        prev_mean = np.concatenate([[float(init_state[name].mean["weight"])], mean[:-1]])
        report[name] = dict(
            count=state.count,
            ema_mean=state.mean["weight"],
            ema_var=state.var["weight"],
            raw_mean=(mean - decay * prev_mean) / (1 - decay),
            raw_std=np.sqrt(np.maximum((var - decay * prev) / (1 - decay), 0.0)),
            norm_std=np.sqrt(history["captured"][name].grad_params["weight"]["var"]),
        )
    return report


def print_report(report: dict, losses: np.ndarray, every: int) -> None:
    cols = "count   ema_mean    ema_var   raw_std  norm_std"
    print(f"{'':13}" + "".join(f" | {name + ' kernel gradient':<{len(cols)}}" for name in CONVS))
    print(f"{'step':>5} {'loss':>7}" + f" | {cols}" * len(CONVS))
    steps = len(losses)
    for t in range(steps):
        if (t + 1) % every and t != steps - 1:
            continue
        row = f"{t + 1:5d} {losses[t]:7.4f}"
        for name in CONVS:
            r = report[name]
            row += (
                f" | {r['count'][t]:5.0f} {r['ema_mean'][t]:+.3e} {r['ema_var'][t]:.3e}"
                f" {r['raw_std'][t]:.3e} {r['norm_std'][t]:9.3f}"
            )
        print(row)


def param_gap(a: dict, b: dict) -> np.ndarray:
    """The largest difference between two runs' parameters after each step: ``gap[t - 1]`` after step t.

    ``a`` and ``b`` are runs as ``main`` returns them (``out["jit"]``, ``out["scan"]``): the
    params before each step are in ``history["params"]``, the final ones in ``params``.
    """

    def after_each_step(run):
        return jax.tree.map(
            lambda h, final: np.concatenate([h[1:], np.asarray(final)[None]]),
            run["history"]["params"],
            run["params"],
        )

    pairs = zip(jax.tree.leaves(after_each_step(a)), jax.tree.leaves(after_each_step(b)))
    return np.max([np.abs(x - y).reshape(len(x), -1).max(axis=1) for x, y in pairs], axis=0)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--decay", type=float, default=0.9, help="ema_normalize's EMA decay")
    parser.add_argument("--scan-steps", type=int, default=50, help="steps per lax.scan dispatch")
    parser.add_argument("--path", choices=["jit", "scan", "both"], default="both")
    parser.add_argument("--print-every", type=int, default=None, help="default: about 20 lines")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    every = args.print_every or max(1, args.steps // 20)

    (x_train, y_train), (x_test, y_test) = load_data(args.seed)
    params = model.init(jax.random.key(args.seed), x_train[: args.batch_size])
    optimizer = optax.sgd(args.lr, momentum=args.momentum)
    grad_fn, step = make_step(args.decay, optimizer)
    idx = batch_indices(len(x_train), args.steps, args.batch_size, args.seed)
    # {"conv1": EmaNormalizeState(count, mean, var), "conv2": ...}, all zeros.
    hook_state = vk.init_hook_state(grad_fn, params, x_train[idx[0]], y_train[idx[0]])
    carry = (params, optimizer.init(params), hook_state)

    out = dict(idx=idx, init_params=params, init_hook_state=hook_state, args=vars(args))
    print(f"digits: {len(x_train)} train / {len(x_test)} test images, 8x8x1; hooks: conv* <- ema_normalize")
    print(LEGEND)
    paths = ["jit", "scan"] if args.path == "both" else [args.path]
    for path in paths:
        start = time.perf_counter()
        if path == "jit":
            final, history = train_jit(step, carry, x_train, y_train, idx)
            how = "one jax.jit step per iteration"
        else:
            final, history = train_scan(step, carry, x_train, y_train, idx, args.scan_steps)
            how = f"jax.lax.scan, {args.scan_steps} steps per dispatch"
        seconds = time.perf_counter() - start
        report = kernel_report(history, hook_state, args.decay)
        print(f"\n[{path}] {how}")
        print_report(report, history["loss"], every)
        acc = accuracy(final[0], x_test, y_test)
        print(
            f"[{path}] {args.steps} steps in {seconds:.2f} s (compilation included); test accuracy {acc:.4f}"
        )
        out[path] = dict(history=history, report=report, params=final[0], hook_state=final[2], accuracy=acc)
    out["accuracy"] = out[paths[-1]]["accuracy"]
    if args.path == "both":
        gap = param_gap(out["jit"], out["scan"])
        at = sorted({t for t in (1, 10, 50, 100, 200, 400) if t <= args.steps} | {args.steps})
        print(
            "\njit vs scan, the largest difference between their parameters after step "
            + ", ".join(f"{t}: {gap[t - 1]:.1e}" for t in at)
            + "\n(equal to float32 rounding at first; the training amplifies the rounding: see the docstring)"
        )
        out["gap"] = gap
    return out


if __name__ == "__main__":
    main()
