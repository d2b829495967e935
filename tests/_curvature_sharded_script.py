"""Curvature on several devices, run in a subprocess by tests/test_curvature_sharded.py.

Usage: ``python tests/_curvature_sharded_script.py`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` and ``JAX_PLATFORMS=cpu``. Prints one line
``RESULT <json>``; a check that fails raises (non-zero exit, traceback on stderr).

* ``sharded``: ``vk.curvature.stats`` under ``jax.jit`` on a batch sharded over all devices
  equals the same call on the batch held by one device (the statistics are global).
* ``shard_map``: inside ``jax.shard_map`` over the devices, each shard's statistics (its own
  records) averaged by ``vk.curvature.kfac(axis_name="data")`` give the update computed from the
  whole batch at once.
* ``fit``: ``vk.train.fit`` with the K-FAC optimizer on a ``data_mesh`` of all devices: the
  final params (compared across device counts by the parent test).
"""

from __future__ import annotations

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
    out = {"devices": jax.device_count(), "sharded": sharded(), "shard_map": shard_map(), "fit": fit()}
    print("RESULT " + json.dumps(out))
