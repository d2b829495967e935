"""An Equinox MLP made hookable with one call, and the forum's ``grad_dict`` collected from it.

``vk.hookable(model)`` leaves the model as it is (same pytree, same outputs, same
serialisation) and makes each submodule call a vjpkit layer call named by its attribute path:
``eqx.nn.MLP``'s linear layers are ``"layers/0"``, ``"layers/1"``, ``"layers/2"``. The training
step captures every linear layer's record inside the jitted step; ``grad_dict[name]`` collects
each step's parameter gradient of that layer, as in the forum thread's PyTorch hooks.

Run: ``python examples/equinox_mlp.py --steps 300``.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import vjpkit as vk


def make_data(key, n=512):
    """Two interleaved spirals, labels 0 and 1."""
    k1, k2 = jax.random.split(key)
    t = jax.random.uniform(k1, (n,), minval=0.5, maxval=3.0)
    label = (jax.random.uniform(k2, (n,)) < 0.5).astype(jnp.int32)
    angle = t * 2.0 + jnp.pi * label.astype(jnp.float32)
    x = jnp.stack([t * jnp.cos(angle), t * jnp.sin(angle)], axis=1) / 3.0
    return x, label


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    key_data, key_model = jax.random.split(jax.random.key(args.seed))
    x, y = make_data(key_data)
    model = vk.hookable(eqx.nn.MLP(2, 2, 32, 2, activation=jax.nn.tanh, key=key_model))
    params, static = eqx.partition(model, eqx.is_array)

    def loss_fn(params, x, y):
        logits = jax.vmap(eqx.combine(params, static))(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    optimizer = optax.adam(args.lr)
    opt_state = optimizer.init(params)
    value_and_grad = vk.value_and_grad(loss_fn, capture="layers/*")

    @jax.jit
    def step(params, opt_state):
        (loss, grads), captured = value_and_grad(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state, loss, captured

    grad_dict: dict[str, list] = defaultdict(list)  # layer name -> one gradient per step
    for i in range(args.steps):
        params, opt_state, loss, captured = step(params, opt_state)
        for name, rec in captured.items():
            grad_dict[name].append(jax.tree.map(np.asarray, rec.grad_params))
        if (i + 1) % 200 == 0:
            print(f"step {i + 1:4d}  loss {float(loss):.4f}")

    logits = jax.vmap(eqx.combine(params, static))(x)
    accuracy = float(jnp.mean(jnp.argmax(logits, -1) == y))
    print(f"\ntrain accuracy {accuracy:.3f}")
    print("\ngrad_dict: layer -> per-step weight-gradient norms (first, last)")
    for name in sorted(grad_dict):
        norms = [float(np.linalg.norm(g.weight)) for g in grad_dict[name]]
        print(f"  {name:9s} {len(norms)} steps  {norms[0]:.4f} -> {norms[-1]:.4f}")
    return {"accuracy": accuracy, "grad_dict": dict(grad_dict), "params": params, "static": static}


if __name__ == "__main__":
    main()
