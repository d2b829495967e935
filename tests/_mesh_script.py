"""Host delivery counts on a mesh, run in a subprocess by tests/test_mesh_delivery.py.

Usage: ``XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/_mesh_script.py``.
Prints one line ``RESULT <json>`` with, per delivery path, how many times the host function ran
and the shapes it saw; the parent test compares them with the counts of one device.
"""

from __future__ import annotations

import json
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import vjpkit as vk
from vjpkit import nn

jax.config.update("jax_numpy_dtype_promotion", "strict")

STEPS = 2
MODEL = nn.serial(fc1=nn.dense(8), act=nn.relu(), fc2=nn.dense(3))
X = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
Y = np.random.default_rng(1).normal(size=(16, 3)).astype(np.float32)
PARAMS = MODEL.init(jax.random.key(0), X)


def loss(p, x, y):
    return jnp.mean((MODEL.apply(p, x) - y) ** 2)


def main() -> dict:
    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    xs = jax.device_put(X, NamedSharding(mesh, P("data")))
    ys = jax.device_put(Y, NamedSharding(mesh, P("data")))
    out = {"devices": n}

    seen = []
    g = jax.jit(
        vk.grad(loss, hooks={"fc*": vk.on_host(lambda r: seen.append([r.name, list(r.input.shape)]))})
    )
    for _ in range(STEPS):
        grads = jax.block_until_ready(g(PARAMS, xs, ys))
    out["on_host"] = seen
    out["grads_equal"] = bool(
        all(
            np.allclose(a, b, atol=1e-6)
            for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(jax.grad(loss)(PARAMS, X, Y)))
        )
    )

    every = []
    g = jax.jit(vk.grad(loss, hooks={"fc1": vk.on_host(lambda r: every.append(1), every=2)}))
    state = vk.init_hook_state(g, PARAMS, xs, ys)
    for _ in range(4):
        _, state = g(PARAMS, xs, ys, hook_state=state)
    jax.block_until_ready(state)
    out["every2_calls"] = len(every)
    out["every2_counter"] = [float(v["count"]) for v in state.host.values()]

    captured = []
    g = jax.jit(
        vk.grad(loss, capture=vk.capture("fc*", host=vk.on_host(lambda c: captured.append(sorted(c)))))
    )
    for _ in range(STEPS):
        jax.block_until_ready(g(PARAMS, xs, ys))
    out["capture_host"] = captured

    fit_seen, records = [], []
    data = (np.concatenate([X] * STEPS), np.concatenate([Y] * STEPS))
    vk.train.fit(
        lambda p, batch: loss(p, *batch),
        optax.sgd(0.1),
        PARAMS,
        data,
        batch_size=16,
        steps=STEPS,
        hooks={"fc2": vk.on_host(lambda r: fit_seen.append(list(r.input.shape)))},
        capture=vk.capture("fc1", reduce="norm"),
        on_records=lambda step, c: records.append(step),
        mesh=vk.train.data_mesh() if n > 1 else None,
        progress=False,
    )
    out["fit_hooks"] = fit_seen
    out["fit_records"] = records

    # inside shard_map: per-shard records, or a clear error; never an empty result
    def sharded_grads(p, x, y):
        grads, cap = vk.grad(loss, capture="fc1")(p, x, y)
        return jax.lax.pmean(grads, "data"), jax.tree.map(lambda a: a[None], cap)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            f = jax.shard_map(
                sharded_grads, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P("data"))
            )
            _, cap = jax.jit(f)(PARAMS, xs, ys)
        out["shard_map"] = {k: list(np.shape(v.grad_params["weight"])) for k, v in cap.items()}
    except Exception as err:  # the test checks the message
        out["shard_map"] = f"{type(err).__name__}: {err}"
    return out


if __name__ == "__main__":
    result = main()
    print("RESULT " + json.dumps(result))
    sys.stdout.flush()
