"""Curvature on several devices, run in a subprocess by tests/test_curvature_sharded.py.

Usage: ``python tests/_curvature_sharded_script.py`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` and ``JAX_PLATFORMS=cpu``. Prints one line
``RESULT <json>``; a check that fails raises (non-zero exit, traceback on stderr).

* ``sharded``: ``vk.curvature.stats`` under ``jax.jit`` on a batch sharded over all devices
  equals the same call on the batch held by one device (the statistics are global).
* ``shard_map``: inside ``jax.shard_map`` over the devices, each shard's statistics (its own
  records) averaged by ``vk.curvature.kfac(axis_name="data")`` give the update computed from the
  whole batch at once.
* ``ekfac_shard_map``: EKFAC inside ``jax.shard_map``: ``axis_name="data"`` averages the factors
  and gathers the rows (``g`` scaled by ``1 / sqrt(shards)``), which equals each shard's
  statistics computed alone (the same key) and combined by hand, given to an EKFAC optimizer
  without an axis (the Monte-Carlo labels are drawn per shard, so the whole batch's own draw is
  not the reference).
* ``fit``: ``vk.train.fit`` with the K-FAC optimizer on a ``data_mesh`` of all devices: the
  final params (compared across device counts by the parent test).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

import vjpkit as vk

jax.config.update("jax_numpy_dtype_promotion", "strict")

BATCH, FEATURES, HIDDEN, CLASSES = 32, 5, 8, 3
STATS = ["kflr", "kfac_empirical", "diag_ggn", "sum_grad_squared", "batch_l2", "backpack_variance"]


def problem():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {
        "fc1": {"w": jax.random.normal(k1, (FEATURES, HIDDEN)) / 2, "b": jnp.full(HIDDEN, 0.1, jnp.float32)},
        "fc2": {"w": jax.random.normal(k2, (HIDDEN, CLASSES)) / 3, "b": jnp.zeros(CLASSES)},
    }
    x = jax.random.normal(k3, (BATCH, FEATURES))
    y = jax.random.randint(k4, (BATCH,), 0, CLASSES)
    return params, x, y


def loss_fn(p, x, y):
    h = jnp.tanh(x @ p["fc1"]["w"] + p["fc1"]["b"])
    return vk.curvature.softmax_cross_entropy(h @ p["fc2"]["w"] + p["fc2"]["b"], y)


def close(a, b, what):
    for (path, u), v in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_allclose(
            np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-6, err_msg=f"{what}{path}"
        )


def sharded() -> dict:
    params, x, y = problem()
    mesh = vk.train.data_mesh()
    f = jax.jit(vk.value_and_grad(loss_fn, capture=vk.curvature.stats("*", STATS)))
    one = jax.devices()[0]
    (l1, g1), c1 = f(*jax.device_put((params, x, y), one))
    batch = NamedSharding(mesh, PartitionSpec("data"))
    (l2, g2), c2 = f(params, jax.device_put(x, batch), jax.device_put(y, batch))
    close((l2, g2, c2), (l1, g1, c1), "sharded vs one device: ")
    return {"loss": float(l2), "layers": sorted(c2)}


def shard_map() -> dict:
    params, x, y = problem()
    mesh = vk.train.data_mesh()
    spec = vk.curvature.stats("*", ["kflr"])
    like = jax.eval_shape(vk.value_and_grad(loss_fn, capture=spec), params, x, y)[1]
    opt = vk.curvature.kfac(0.1, like=like, estimator="kflr", damping=1e-2, axis_name="data")
    state = opt.init(params)

    def body(p, s, xs, ys):
        (_, grads), curvature = vk.value_and_grad(loss_fn, capture=spec)(p, xs, ys)
        # JAX sums a replicated parameter's gradient over the shards (pvary's transpose is psum):
        # the shards' mean losses sum to n_shards times the whole batch's mean loss
        grads = jax.tree.map(lambda g: g / jax.lax.psum(1, "data"), grads)
        updates, _ = opt.update(grads, s, p, curvature=curvature)
        return updates

    P = PartitionSpec
    per_shard = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=P())
    )(params, state, x, y)
    whole = vk.curvature.kfac(0.1, like=like, estimator="kflr", damping=1e-2)
    (_, grads), curvature = jax.jit(vk.value_and_grad(loss_fn, capture=spec))(params, x, y)
    expected, _ = whole.update(grads, whole.init(params), params, curvature=curvature)
    close(per_shard, expected, "shard_map + axis_name vs whole batch: ")
    return {"update_norm": float(optax.global_norm(per_shard))}


def ekfac_shard_map() -> dict:
    params, x, y = problem()
    mesh, n, key = vk.train.data_mesh(), jax.device_count(), jax.random.key(1)
    spec = vk.curvature.stats("*", ["ekfac"])
    grad_fn = vk.value_and_grad(loss_fn, capture=spec)
    like = jax.eval_shape(grad_fn, params, x, y, key=key)[1]
    opt = vk.curvature.kfac(0.1, like=like, estimator="ekfac", damping=1e-2, axis_name="data")

    def body(p, s, xs, ys):
        (_, grads), curvature = grad_fn(p, xs, ys, key=key)
        grads = jax.tree.map(lambda g: g / jax.lax.psum(1, "data"), grads)
        updates, new = opt.update(grads, s, p, curvature=curvature)
        return jax.tree.map(lambda a: a[None], (updates, new.factors))  # each shard's own copy

    P = PartitionSpec
    copies = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=P("data"))
    )(params, opt.init(params), x, y)
    shards = [jax.jit(grad_fn)(params, xs, ys, key=key) for xs, ys in zip(np.split(x, n), np.split(y, n))]
    grads = jax.tree.map(lambda *g: sum(g) / n, *[g for (_, g), _ in shards])
    combined = {}
    for name, rec in shards[0][1].items():
        st = [c[name].ekfac for _, c in shards]
        combined[name] = dataclasses.replace(
            rec,
            ekfac=vk.curvature.Ekfac(
                sum(s.A for s in st) / n, sum(s.G for s in st) / n,
                jnp.concatenate([s.a for s in st], axis=-3),
                jnp.concatenate([s.g for s in st], axis=-3) / np.sqrt(n).astype(np.float32),
            ),
        )  # fmt: skip
    whole = vk.curvature.kfac(0.1, like=like, estimator="ekfac", damping=1e-2)
    expected, state = whole.update(grads, whole.init(params), params, curvature=combined)
    for i in range(n):  # every shard holds the same update and statistics
        per_shard, factors = jax.tree.map(lambda a, i=i: a[i], copies)
        close(per_shard, expected, f"ekfac shard_map + axis_name vs the shards combined, shard {i}: ")
        close(factors, state.factors, f"ekfac shard_map statistics vs the shards combined, shard {i}: ")
    return {"update_norm": float(optax.global_norm(expected))}


def fit() -> dict:
    params, x, y = problem()
    spec = vk.curvature.stats("*", ["kfac"])
    batch_loss = lambda p, batch, key: loss_fn(p, *batch)
    like = jax.eval_shape(
        lambda p: vk.value_and_grad(batch_loss, capture=spec)(p, (x, y), key=jax.random.key(0))[1], params
    )
    opt = vk.curvature.kfac(0.05, like=like, damping=1e-2, momentum=0.9)
    state, history = vk.train.fit(
        batch_loss, opt, params, (x, y), batch_size=16, steps=4, capture=spec, mesh=vk.train.data_mesh(),
        progress=False, seed=0,
    )  # fmt: skip
    return {
        "params": [np.asarray(a).tolist() for a in jax.tree.leaves(state.params)],
        "loss": [float(v) for v in history["loss"]],
    }


if __name__ == "__main__":
    out = {
        "devices": jax.device_count(), "sharded": sharded(), "shard_map": shard_map(),
        "ekfac_shard_map": ekfac_shard_map(), "fit": fit(),
    }  # fmt: skip
    print("RESULT " + json.dumps(out))
