"""A plain-JAX MLP on a mesh, run in a subprocess by tests/test_plain_sharded.py (issue 22, item 3).

Usage: ``XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/_plain_sharded_script.py``.
The model is a nested dict of arrays applied with ``jnp`` (no vjpkit layers): its layers are
found by matching. Prints one line ``RESULT <json>``: per check, the largest absolute difference
from its oracle (or a string saying why there is none), which the parent test bounds.

* ``jit``: ``jax.jit(vk.value_and_grad(loss, capture="*"))`` on a batch sharded over the
  ``"data"`` axis (``NamedSharding(mesh, P("data"))``). Oracles: ``jax.grad`` of the loss by
  path, the plain forward pass (each record's ``input`` / ``output``, the global arrays) and
  ``jax.vjp`` of the rest of the model at each layer's output (its ``grad_output``).
* ``shard_map``: ``vk.grad(loss, capture="*")`` inside a ``jax.shard_map`` body over the mesh,
  the records stacked over the shards on axis 0. Oracles: ``jax.grad`` inside the same
  shard_map (the gradient of the replicated params, summed over the shards) for the gradient
  and every shard's ``grad_params``; per shard, its rows, the plain forward pass on them and
  ``jax.vjp`` of the shard's own loss for ``input``, ``output`` and ``grad_output``.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import vjpkit as vk

jax.config.update("jax_numpy_dtype_promotion", "strict")

BATCH, FEATURES, HIDDEN, OUT = 16, 4, 8, 3
LAYERS = ("fc1", "fc2")


def _normal(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return (0.5 * rng.standard_normal(shape)).astype(np.float32)


RNG = np.random.default_rng(0)
PARAMS = {
    "fc1": {"w": _normal(RNG, FEATURES, HIDDEN), "b": _normal(RNG, HIDDEN)},
    "fc2": {"w": _normal(RNG, HIDDEN, OUT), "b": _normal(RNG, OUT)},
}
X = _normal(RNG, BATCH, FEATURES)
Y = _normal(RNG, BATCH, OUT)


def pre1(p, x):
    return x @ p["fc1"]["w"] + p["fc1"]["b"]


def pre2(p, z1):
    return jnp.tanh(z1) @ p["fc2"]["w"] + p["fc2"]["b"]


def error(z2, y):
    return jnp.mean((z2 - y) ** 2)


def loss(p, x, y):
    return error(pre2(p, pre1(p, x)), y)


def oracle(x, y) -> dict:
    """Per layer, what its record must hold on rows ``x``: input, output and grad_output."""
    z1 = pre1(PARAMS, x)
    z2 = pre2(PARAMS, z1)
    one = jnp.ones((), jnp.float32)
    d2 = jax.vjp(lambda z: error(z, y), z2)[1](one)[0]
    d1 = jax.vjp(lambda z: error(pre2(PARAMS, z), y), z1)[1](one)[0]
    return {
        "fc1": {"input": x, "output": z1, "grad_output": d1},
        "fc2": {"input": jnp.tanh(z1), "output": z2, "grad_output": d2},
    }


def diff(got, want) -> float | str:
    """The largest absolute difference, or why the two cannot be compared."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return f"shape {list(got.shape)} != {list(want.shape)}"
    return float(np.max(np.abs(got - want))) if got.size else 0.0


def by_path(tree) -> dict:
    return {
        jax.tree_util.keystr(k, simple=True, separator="/"): v
        for k, v in jax.tree_util.tree_leaves_with_path(tree)
    }


def tree_diff(got, want) -> dict:
    got, want = by_path(got), by_path(want)
    if set(got) != set(want):
        return {"paths": f"{sorted(got)} != {sorted(want)}"}
    return {k: diff(got[k], want[k]) for k in want}


def jitted_on_sharded_batch(mesh: Mesh) -> dict:
    xs = jax.device_put(X, NamedSharding(mesh, P("data")))
    ys = jax.device_put(Y, NamedSharding(mesh, P("data")))
    f = jax.jit(vk.value_and_grad(loss, capture="*"))
    (value, grads), captured = f(PARAMS, xs, ys)
    reference = jax.grad(loss)(PARAMS, X, Y)
    want = oracle(X, Y)
    out = {
        "shards": len(xs.addressable_shards),
        "keys": sorted(captured),
        "value": diff(value, loss(PARAMS, X, Y)),
        "grads": tree_diff(grads, reference),
    }
    for name in LAYERS:
        if name not in captured:
            continue
        rec = captured[name]
        out[name] = {
            "grad_params": tree_diff(rec.grad_params, reference[name]),
            "params": tree_diff(rec.params, PARAMS[name]),
            **{
                field: diff(getattr(rec, field), want[name][field])
                for field in ("input", "output", "grad_output")
            },
        }
    return out


def inside_shard_map(mesh: Mesh) -> dict:
    n = mesh.shape["data"]
    xs = jax.device_put(X, NamedSharding(mesh, P("data")))
    ys = jax.device_put(Y, NamedSharding(mesh, P("data")))
    specs = {"mesh": mesh, "in_specs": (P(), P("data"), P("data"))}

    def body(p, x, y):
        grads, captured = vk.grad(loss, capture="*")(p, x, y)
        return grads, jax.tree.map(lambda a: a[None], captured)  # one record per shard, stacked

    grads, captured = jax.jit(jax.shard_map(body, out_specs=(P(), P("data")), **specs))(PARAMS, xs, ys)
    reference = jax.jit(jax.shard_map(jax.grad(loss), out_specs=P(), **specs))(PARAMS, xs, ys)
    rows = list(zip(X.reshape(n, -1, FEATURES), Y.reshape(n, -1, OUT)))  # shard k: the k-th block
    out = {"shards": n, "keys": sorted(captured), "grads": tree_diff(grads, reference)}
    for name in LAYERS:
        if name not in captured:
            continue
        rec = captured[name]
        per = []
        for k, (x, y) in enumerate(rows):
            want = oracle(x, y)[name]
            shard = jax.tree.map(lambda a, k=k: a[k], rec)
            per.append(
                {
                    "grad_params": tree_diff(shard.grad_params, reference[name]),
                    **{
                        field: diff(getattr(shard, field), want[field])
                        for field in ("input", "output", "grad_output")
                    },
                }
            )
        out[name] = {"leading": int(np.shape(rec.input)[0]), "per_shard": per}
    return out


def main() -> dict:
    mesh = Mesh(np.array(jax.devices()), ("data",))
    return {
        "devices": jax.device_count(),
        "jit": jitted_on_sharded_batch(mesh),
        "shard_map": inside_shard_map(mesh),
    }


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()))
    sys.stdout.flush()
