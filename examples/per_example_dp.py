"""DP-SGD with per-example clipping from layer records, against the naive ``vmap(grad)`` version.

DP-SGD clips each example's gradient ``g_i`` to norm ``C``, sums, adds Gaussian noise and
divides by the batch size: ``(sum_i g_i * min(1, C / ||g_i||) + N(0, sigma^2 C^2)) / B``. The
naive way forms every ``g_i`` with ``jax.vmap(jax.grad(...))``: ``B`` copies of the model's
gradient. vjpkit's ``dp_clip`` gets ``||g_i||`` from each dense layer's recorded ``input`` and
``grad_output`` (``||x_i|| * ||d_i||``) and the clipped sum as ``X^T (c * D)`` from the same
records, in one forward and one backward pass (of the loss vmapped over the examples, in which
each layer call stays one call over the batch):

    dp_grad = vk.inspect.dp_clip(l2_norm_clip, noise_multiplier, key)(loss_fn)
    loss, grads, norms = dp_grad(params, x, y, step=t)

Both train the same MLP on scikit-learn's bundled 8x8 digits (no download) from the same
initial params, on the same batches, with the same noise (``vk.inspect.dp_noise(key, t, ...)``).
Each step prints the largest absolute difference between the two DP gradients, and the end
prints the median step time and the compiled temporary memory (XLA's ``memory_analysis``) of
both, and the test accuracy.

Run: ``python examples/per_example_dp.py`` (``--steps 20`` for a few seconds).
Needs the ``examples`` extra (scikit-learn): ``pip install -e ".[examples]"``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

try:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
except ImportError as err:  # the README's first command installs vjpkit alone
    raise ImportError(
        'this example needs scikit-learn, in the examples extra: pip install -e ".[examples]"'
    ) from err

from vjpkit import nn
from vjpkit.inspect import dp_clip, dp_noise


def make_model(width: int) -> nn.Layer:
    return nn.serial(
        fc1=nn.dense(width), relu1=nn.relu(), fc2=nn.dense(width), relu2=nn.relu(), fc3=nn.dense(10)
    )


def load_data(seed: int):
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed)
    return (x_train, y_train), (x_test, y_test)


def make_loss(model: nn.Layer):
    def loss_fn(params, x, y):  # the mean over the batch of per-example cross-entropies
        logits = model.apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return loss_fn


def naive_dp_clip(l2_norm_clip: float, noise_multiplier: float, key):
    """The textbook version: every per-example gradient by vmap(grad), clipped, summed, noised."""

    def decorate(loss_fn):
        def dp_grad(params, x, y, step):
            def single(p, xi, yi):
                return loss_fn(p, xi[None], yi[None])

            grads = jax.vmap(jax.grad(single), in_axes=(None, 0, 0))(params, x, y)  # B x params
            norms = jnp.sqrt(
                sum(jnp.sum(g.reshape(x.shape[0], -1) ** 2, axis=1) for g in jax.tree.leaves(grads))
            )
            factor = jnp.minimum(1.0, l2_norm_clip / norms)
            clipped = jax.tree.map(lambda g: jnp.tensordot(factor, g, axes=1), grads)
            noise = dp_noise(key, step, params, noise_multiplier * l2_norm_clip)
            return jax.tree.map(lambda c, n: (c + n) / x.shape[0], clipped, noise), norms

        return dp_grad

    return decorate


def make_steps(loss_fn, optimizer, clip: float, sigma: float, key):
    vk_dp = dp_clip(clip, sigma, key)(loss_fn)
    naive_dp = naive_dp_clip(clip, sigma, key)(loss_fn)

    @jax.jit
    def vk_step(params, opt_state, x, y, step):
        loss, grads, norms = vk_dp(params, x, y, step=step)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, grads, norms.total, loss

    @jax.jit
    def naive_step(params, opt_state, x, y, step):
        grads, norms = naive_dp(params, x, y, step)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, grads, norms, loss_fn(params, x, y)

    return vk_step, naive_step


def max_abs_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def temp_bytes(step, *args) -> int:
    return int(step.lower(*args).compile().memory_analysis().temp_size_in_bytes)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--clip", type=float, default=1.0, help="l2_norm_clip C")
    parser.add_argument("--sigma", type=float, default=1.0, help="noise_multiplier")
    parser.add_argument("--print-every", type=int, default=None, help="default: about 10 lines")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    every = args.print_every or max(1, args.steps // 10)

    (x_train, y_train), (x_test, y_test) = load_data(args.seed)
    model = make_model(args.width)
    loss_fn = make_loss(model)
    params = model.init(jax.random.key(args.seed), x_train[: args.batch_size])
    optimizer = optax.sgd(args.lr, momentum=0.9)
    vk_step, naive_step = make_steps(loss_fn, optimizer, args.clip, args.sigma, jax.random.key(args.seed + 1))
    rng = np.random.default_rng(args.seed)
    idx = [rng.choice(len(x_train), args.batch_size, replace=False) for _ in range(args.steps)]

    print(
        f"DP-SGD on digits: MLP 64-{args.width}-{args.width}-10, batch {args.batch_size}, "
        f"C={args.clip}, sigma={args.sigma}, {args.steps} steps"
    )
    print(
        f"{'step':>5} {'loss':>8} {'clipped':>8} "
        f"{'max |vk - naive| grad':>22} {'max |vk - naive| params':>24}"
    )
    carry_vk = carry_naive = (params, optimizer.init(params))
    times = {"vjpkit": [], "naive": []}
    grad_diffs, param_diffs = [], []
    first = None
    for t in range(args.steps):
        x, y = jnp.asarray(x_train[idx[t]]), jnp.asarray(y_train[idx[t]])
        step = jnp.int32(t)
        order = [("vjpkit", vk_step), ("naive", naive_step)]
        if t % 2:
            order.reverse()  # interleave, so that drifts of the machine hit both alike
        out = {}
        for name, fn in order:
            carry = carry_vk if name == "vjpkit" else carry_naive
            start = time.perf_counter()
            out[name] = jax.block_until_ready(fn(*carry, x, y, step))
            times[name].append(time.perf_counter() - start)
        if first is None:
            first = dict(params=params, x=x, y=y, grads=out["vjpkit"][2])
        carry_vk, carry_naive = out["vjpkit"][:2], out["naive"][:2]
        grad_diffs.append(max_abs_diff(out["vjpkit"][2], out["naive"][2]))
        param_diffs.append(max_abs_diff(carry_vk[0], carry_naive[0]))
        if t % every == 0 or t == args.steps - 1:
            loss = float(out["vjpkit"][4])  # the batch loss before this step's update
            clipped = float(np.mean(np.asarray(out["vjpkit"][3]) > args.clip))
            print(f"{t:>5} {loss:>8.4f} {clipped:>8.0%} {grad_diffs[-1]:>22.2e} {param_diffs[-1]:>24.2e}")

    x, y = jnp.asarray(x_train[idx[0]]), jnp.asarray(y_train[idx[0]])
    memory = {
        "vjpkit": temp_bytes(vk_step, *carry_vk, x, y, jnp.int32(0)),
        "naive": temp_bytes(naive_step, *carry_naive, x, y, jnp.int32(0)),
    }
    steady = {k: statistics.median(v[1:]) if len(v) > 1 else v[0] for k, v in times.items()}
    predict = jax.jit(lambda p, x: jnp.argmax(model.apply(p, x), axis=1))
    accuracy = float(np.mean(np.asarray(predict(carry_vk[0], x_test)) == y_test))
    print()
    print("| DP gradient | median step (ms) | compiled temp memory (MB) |")
    print("|---|---:|---:|")
    for name in ("vjpkit", "naive"):
        print(f"| {name} | {steady[name] * 1e3:.2f} | {memory[name] / 1e6:.2f} |")
    print(
        f"\nvjpkit is {steady['naive'] / steady['vjpkit']:.1f}x faster and uses "
        f"{memory['naive'] / max(memory['vjpkit'], 1):.1f}x less temporary memory; "
        f"max |vk - naive| over all steps: gradients {max(grad_diffs):.2e}, params {max(param_diffs):.2e}"
    )
    print(f"test accuracy after {args.steps} DP-SGD steps: {accuracy:.3f}")
    return dict(
        args=vars(args),
        grad_diffs=grad_diffs,
        param_diffs=param_diffs,
        times=steady,
        memory=memory,
        accuracy=accuracy,
        first=first,
        loss_fn=loss_fn,
        key=jax.random.key(args.seed + 1),
    )


if __name__ == "__main__":
    main()
