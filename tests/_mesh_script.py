"""Host delivery counts on a mesh, run in a subprocess by tests/test_mesh_delivery.py.

Usage: ``XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/_mesh_script.py``.
Prints one line ``RESULT <json>`` with, per delivery path, how many times the host function ran
and the shapes it saw; the parent test compares them with the counts of one device. Under
``jax.pmap`` (``pmap_delivery``) each delivery is also matched against an oracle of each shard:
the shard's rows, the plain forward pass on them and ``jax.grad`` of the plain loss on them.
"""

from __future__ import annotations

import json
import sys
import threading
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

    # on_host(every=2) without hook_state inside shard_map: each device counts its own steps
    shard_rows = X.reshape(n, -1, X.shape[1])
    seen = []

    def which_shard(r):
        found = [k for k in range(n) if _close(r.input, shard_rows[k])]
        seen.append(str(found[0]) if len(found) == 1 else "None")

    hooked = vk.grad(loss, hooks={"fc1": vk.on_host(which_shard, every=2)})
    f = jax.jit(
        jax.shard_map(
            lambda p, x, y: jax.lax.pmean(hooked(p, x, y), "data"),
            mesh=mesh,
            in_specs=(P(), P("data"), P("data")),
            out_specs=P(),
        )
    )
    steps = []
    for _ in range(4):
        start = len(seen)
        jax.block_until_ready(f(PARAMS, xs, ys))
        steps.append(sorted(seen[start:]))
    out["shard_map_every2_host"] = steps

    out["pmap"] = pmap_delivery(n)
    return out


def _close(a, b) -> bool:
    return bool(np.shape(a) == np.shape(b) and np.allclose(a, b, rtol=1e-5, atol=1e-6))


def _averaged_step(hook):
    """A pmap body: the shard's loss and the gradients averaged over the ``"data"`` axis."""

    def step(p, x, y):
        value, grads = vk.value_and_grad(loss, hooks={"fc*": hook})(p, x, y)
        return value, jax.lax.pmean(grads, "data")

    return step


def pmap_delivery(n: int) -> dict:
    """Host deliveries of a hooked ``vk.grad`` / ``vk.value_and_grad`` called inside ``jax.pmap``.

    Each device runs the program on its own shard, so each delivery is named by the shard whose
    oracle it equals (its index on the pmap axis), or ``None`` when it equals none of them.
    """
    xs, ys = X.reshape(n, -1, X.shape[1]), Y.reshape(n, -1, Y.shape[1])
    oracle = []  # per shard: what each layer's record must hold
    for x, y in zip(xs, ys):
        hidden = jax.nn.relu(x @ PARAMS["fc1"]["weight"] + PARAMS["fc1"]["bias"])
        oracle.append(
            {
                "loss": float(loss(PARAMS, x, y)),
                "grads": jax.grad(loss)(PARAMS, x, y),
                "input": {"fc1": x, "fc2": hidden},
            }
        )

    def shard_of(name, inp, grad_params) -> int | None:
        """The shard whose oracle this record of layer ``name`` equals."""
        found = [
            k
            for k, o in enumerate(oracle)
            if _close(inp, o["input"][name])
            and all(_close(grad_params[w], o["grads"][name][w]) for w in ("weight", "bias"))
        ]
        return found[0] if len(found) == 1 else None

    result = {"shards": n}
    pmapped = lambda f, *axes: jax.pmap(f, axis_name="data", in_axes=(None, 0, 0, *axes))

    # vk.on_host hooks: per step, [name, shard, thread] of every delivery, in arrival order
    for label, wrap in (("pmap", lambda f: f), ("jit_pmap", jax.jit)):
        seen = []

        def on_record(r, seen=seen):
            seen.append([r.name, shard_of(r.name, r.input, r.grad_params), threading.get_ident()])

        f = wrap(pmapped(_averaged_step(vk.on_host(on_record))))
        steps, losses, grads_ok = [], [], True
        for _ in range(STEPS):
            start = len(seen)
            value, grads = jax.block_until_ready(f(PARAMS, xs, ys))
            steps.append(seen[start:])
            losses.append(bool(all(np.isclose(v, o["loss"], rtol=1e-5) for v, o in zip(value, oracle))))
            global_grads = jax.grad(loss)(PARAMS, X, Y)  # the pmean of the shards' gradients
            grads_ok &= all(
                _close(a[k], b)
                for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(global_grads))
                for k in range(n)
            )
        result[f"{label}_on_host"] = steps
        result[f"{label}_losses"] = losses
        result[f"{label}_grads_equal"] = bool(grads_ok)

    # every=2 with hook_state= threaded through pmap: one counter per device (stacked on axis 0)
    seen = []
    g = vk.grad(
        loss,
        hooks={"fc1": vk.on_host(lambda r: seen.append(shard_of("fc1", r.input, r.grad_params)), every=2)},
    )
    state = vk.init_hook_state(g, PARAMS, xs[0], ys[0])
    state = jax.tree.map(lambda a: jnp.stack([a] * n), state)
    f = pmapped(lambda p, x, y, s: g(p, x, y, hook_state=s), 0)
    steps = []
    for _ in range(4):
        start = len(seen)
        _, state = jax.block_until_ready(f(PARAMS, xs, ys, state))
        steps.append(sorted(map(str, seen[start:])))
    result["every2_state"] = steps
    result["every2_state_counter"] = [[float(c) for c in v["count"]] for v in state.host.values()]

    # every=2 counted on the host (no hook_state)
    seen = []
    g = vk.grad(
        loss,
        hooks={"fc1": vk.on_host(lambda r: seen.append(shard_of("fc1", r.input, r.grad_params)), every=2)},
    )
    f = pmapped(lambda p, x, y: g(p, x, y))
    steps = []
    for _ in range(4):
        start = len(seen)
        jax.block_until_ready(f(PARAMS, xs, ys))
        steps.append(sorted(map(str, seen[start:])))
    result["every2_host"] = steps

    # capture host=: each device's captured dict; the returned records stack the devices on axis 0
    seen = []

    def on_captured(c):
        seen.append(sorted([key, shard_of(key, rec.input, rec.grad_params)] for key, rec in c.items()))

    g = vk.grad(loss, capture=vk.capture("fc*", host=vk.on_host(on_captured)))
    f = pmapped(lambda p, x, y: g(p, x, y))
    steps = []
    for _ in range(STEPS):
        start = len(seen)
        _, captured = jax.block_until_ready(f(PARAMS, xs, ys))
        steps.append(sorted(seen[start:]))
    result["capture_host"] = steps
    result["capture_returned"] = {
        key: [
            shard_of(key, rec.input[k], jax.tree.map(lambda a, k=k: a[k], rec.grad_params)) for k in range(n)
        ]
        for key, rec in sorted(captured.items())
    }
    return result


if __name__ == "__main__":
    result = main()
    print("RESULT " + json.dumps(result))
    sys.stdout.flush()
