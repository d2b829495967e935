"""Quickstart: the forum MLP of "Exact meaning of grad_input and grad_output", done right.

A 3-20-30-2 MLP learns whether ``x @ [.1, 2, 3]`` is above its mean. A jit-compiled SGD
step (momentum 0.8) runs ``vk.value_and_grad`` with ``vk.on_host`` hooks on every ``fc*``
layer; the hooks collect each step's records into ``grad_dict`` on the host, like the forum's
``grad_dict``, keeping the last ``--keep`` records per layer (1 by default: only what the
script prints, so its memory stays that of the same script without hooks). At the end the
script prints the test accuracy and what each cotangent of one step is, with its shape.

Run: ``python examples/quickstart.py`` (``--steps N`` for a shorter run; ``--keep N`` to keep
the last N steps' records; ``--no-hooks`` trains with plain ``jax.value_and_grad`` and prints
no records, the baseline of ``benchmarks/quickstart_bench.py``). Needs only ``pip install -e .``.
"""

from __future__ import annotations

import argparse
from collections import defaultdict, deque

import jax
import jax.numpy as jnp
import numpy as np
import optax

import vjpkit as vk
from vjpkit import nn

MEANINGS = {
    "input": "x, what the layer received in the forward pass",
    "output": "y = x @ weight + bias, what it sent up",
    "grad_output": "dL/dy: the cotangent arriving from the layers above (same shape as y)",
    "grad_input": "dL/dx: the cotangent it sends down to the layer below",
    "grad_input_none": "None: x is the data batch, which needs no gradient, so it is never computed",
    "grad_params": "dL/d{name} of this call, keyed like params",
}


def make_data(key, nrows=9000, train_fraction=0.7):
    """The forum's data: X ~ U(0, 1)^3, label = (X @ [.1, 2, 3] >= its mean), 70/30 split."""
    x = jax.random.uniform(key, (nrows, 3))
    score = x @ jnp.array([0.1, 2.0, 3.0])
    y = (score >= score.mean()).astype(jnp.int32)
    n = int(nrows * train_fraction)
    return (x[:n], y[:n]), (x[n:], y[n:])


model = nn.serial(fc1=nn.dense(20), relu1=nn.relu(), fc2=nn.dense(30), relu2=nn.relu(), fc3=nn.dense(2))


def loss_fn(params, x, y):
    logits = model.apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def shape_of(tree):
    if tree is None:
        return "None"
    return str(jax.tree.map(lambda a: tuple(np.shape(a)), tree))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=int, default=1, help="records kept per layer (the last N steps)")
    parser.add_argument("--no-hooks", action="store_true", help="plain jax.value_and_grad: the baseline")
    args = parser.parse_args(argv)

    key_data, key_init = jax.random.split(jax.random.key(args.seed))
    (x_train, y_train), (x_test, y_test) = make_data(key_data)
    params = model.init(key_init, x_train[: args.batch_size])
    optimizer = optax.sgd(args.lr, momentum=0.8)
    opt_state = optimizer.init(params)

    # grad_dict[layer] holds the last --keep records, one per step, filled on the host during backward.
    grad_dict: dict[str, deque[vk.Cotangents]] = defaultdict(lambda: deque(maxlen=args.keep))
    collect = vk.on_host(lambda rec: grad_dict[rec.key].append(rec))
    value_and_grad = (
        jax.value_and_grad(loss_fn) if args.no_hooks else vk.value_and_grad(loss_fn, hooks={"fc*": collect})
    )

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = value_and_grad(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(args.seed)
    for i in range(args.steps):
        idx = rng.choice(len(x_train), size=args.batch_size, replace=False)
        params, opt_state, loss = step(params, opt_state, x_train[idx], y_train[idx])
        if (i + 1) % 500 == 0:
            print(f"step {i + 1:5d}  loss {float(loss):.4f}")
    # each step uses the previous one's outputs: once the last is ready, every host function has run
    jax.block_until_ready((params, opt_state, loss))

    predictions = jnp.argmax(model.apply(params, x_test), axis=-1)
    accuracy = float(jnp.mean(predictions == y_test))
    print(f"\nAccuracy of prediction on test dataset: {accuracy:.4f}")
    if args.no_hooks:
        return {"accuracy": accuracy, "grad_dict": {}, "params": params, "steps": args.steps}

    print(f"\nOne step's records (batch {args.batch_size}), in backward order:")
    last = [grad_dict[name][-1] for name in ("fc3", "fc2", "fc1")]
    for rec in last:
        print(f"\n{rec.name} (call {rec.call})")
        rows = [(f, getattr(rec, f), MEANINGS[f]) for f in ("input", "output", "grad_output")]
        none_input = rec.grad_input is None
        rows.append(
            ("grad_input", rec.grad_input, MEANINGS["grad_input_none" if none_input else "grad_input"])
        )
        rows += [
            (f"grad_params[{p!r}]", g, MEANINGS["grad_params"].format(name=p))
            for p, g in rec.grad_params.items()
        ]
        for field, value, meaning in rows:
            print(f"  {field:<23} {shape_of(value):<10} {meaning}")
    print(
        "\nThe forum's question, answered: grad_output is dL/d(output) and grad_input is dL/d(input);"
        "\nthe weight and bias gradients are separate, named fields, not positions in a tuple."
    )
    return {"accuracy": accuracy, "grad_dict": dict(grad_dict), "params": params, "steps": args.steps}


if __name__ == "__main__":
    main()
