"""Layer calls inside a ``jax.shard_map`` of the differentiated function (issue 33, item 3).

Run in a subprocess by tests/test_shard_map_records.py with 4 host devices. Prints one line
``RESULT <json>``: per check, the largest absolute difference from its oracle (or a string
saying why there is none), or a value the parent test checks. The loss is the mean over the
shards (``pmean``) of each shard's own loss, so the function equals the loss of the whole batch.

* ``mlp``: a plain-JAX MLP (layers found by matching), ``vk.grad(loss, capture="*")`` eagerly
  and under ``jax.jit``. Oracles: ``jax.grad`` of the same function; per shard, its rows, the
  plain forward pass and ``jax.vjp`` of the function at each layer's output of that shard
  (input, output, grad_output); ``grad_params`` of the replicated params is ``jax.grad``'s
  (summed over the shards). The same records from ``vk.grad`` inside the shard_map body.
* ``scan``: blocks under ``lax.scan`` over stacked weights inside the shard_map: records
  stacked (shards, iterations, ...); oracles the hand-run forward pass per shard and iteration
  and ``jax.vjp`` at each block's output.
* ``nested``: the shard_map inside an inner ``jax.jit`` and a ``jax.checkpoint``.
* ``hooks``: ``vk.scale(0.5, "grad_input")`` on the last layer (oracle: ``jax.grad``, halved
  below it);
  ``vk.ema_normalize`` with its state per shard (oracle: the same hook on the loss without
  shard_map, whose gradient each shard's replicated gradient equals), two steps; an
  ``vk.on_host`` hook (one call per step per layer, the shards leading, equal to the capture);
  capture ``reduce="norm"`` (each shard's norm).
* ``structures``: a ``lax.cond``, a ``vmap``, ``check_vma=False``, Flax and Equinox models inside
  the body (when installed), grad-of-grad around it: ``jax.grad``'s gradient, a record per shard.
* ``errors``: per-example and curvature statistics of such a function raise ``ConfigError``.
"""

from __future__ import annotations

import io
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import vjpkit as vk
from tests._plain_sharded_script import PARAMS, X, Y, diff, loss, pre1, pre2, tree_diff

jax.config.update("jax_numpy_dtype_promotion", "strict")

MESH = Mesh(np.array(jax.devices()), ("data",))
N = MESH.shape["data"]
SPECS = {"mesh": MESH, "in_specs": (P(), P("data"), P("data"))}


def shard_loss(p, x, y):
    return jax.lax.pmean(loss(p, x, y), "data")


def mapped(p, x, y):
    return jax.shard_map(shard_loss, out_specs=P(), **SPECS)(p, x, y)


def blocks(x):
    return x.reshape(N, -1, *x.shape[1:])  # shard k's rows: the k-th block


def per_shard_oracle(rec_of, fields) -> dict:
    """Max difference of each field of each shard's record from the plain computation."""
    out = {}
    for k, (x, y) in enumerate(zip(blocks(X), blocks(Y))):
        z1 = pre1(PARAMS, x)
        z2 = pre2(PARAMS, z1)
        # the function is the mean over the shards: shard k's cotangents carry 1/N
        one = jnp.asarray(1.0 / N, jnp.float32)
        d2 = jax.vjp(lambda z, y=y: jnp.mean((z - y) ** 2), z2)[1](one)[0]
        d1 = jax.vjp(lambda z, y=y: jnp.mean((pre2(PARAMS, z) - y) ** 2), z1)[1](one)[0]
        want = {
            "fc1": {"input": x, "output": z1, "grad_output": d1},
            "fc2": {"input": jnp.tanh(z1), "output": z2, "grad_output": d2},
        }
        for name in ("fc1", "fc2"):
            rec = rec_of(name)
            for f in fields:
                out[f"{name}[{k}].{f}"] = diff(getattr(rec, f)[k], want[name][f])
    return out


def mlp() -> dict:
    reference = jax.grad(mapped)(PARAMS, X, Y)

    def body(p, x, y):  # the same records from vk.grad inside the body
        _, c = vk.grad(shard_loss, capture="*")(p, x, y)
        return jax.tree.map(lambda a: a[None], c)

    inside = jax.jit(jax.shard_map(body, out_specs=P("data"), **SPECS))(PARAMS, X, Y)
    out = {}
    for how, f in (("eager", vk.grad(mapped, capture="*")), ("jit", jax.jit(vk.grad(mapped, capture="*")))):
        grads, cap = f(PARAMS, X, Y)
        out[how] = {
            "keys": sorted(cap),
            "leading": {k: list(np.shape(v.input)[:1]) for k, v in cap.items()},
            "grads": tree_diff(grads, reference),
            "per_shard": per_shard_oracle(lambda n, cap=cap: cap[n], ("input", "output", "grad_output")),
            "grad_params": {
                f"{n}[{k}]": tree_diff(jax.tree.map(lambda a, k=k: a[k], cap[n].grad_params), reference[n])
                for n in ("fc1", "fc2")
                for k in range(N)
            },
            "as_inside_body": tree_diff(cap, inside),
        }
    return out


L, D = 3, 4
SCAN_PARAMS = {
    "blocks": {
        "w": (0.5 * np.random.default_rng(1).standard_normal((L, D, D))).astype(np.float32),
        "b": (0.1 * np.random.default_rng(2).standard_normal((L, D))).astype(np.float32),
    }
}


def scan_loss(p, x):
    def step(h, wb):
        w, b = wb
        return jnp.tanh(h @ w + b), None

    h, _ = jax.lax.scan(step, x, (p["blocks"]["w"], p["blocks"]["b"]))
    return jax.lax.pmean(jnp.mean(h**2), "data")


def scan() -> dict:
    f = lambda p, x: jax.shard_map(scan_loss, mesh=MESH, in_specs=(P(), P("data")), out_specs=P())(p, x)
    grads, cap = jax.jit(vk.grad(f, capture="*"))(SCAN_PARAMS, X)
    rec = cap["blocks"]
    out = {
        "keys": sorted(cap),
        "shape": list(np.shape(rec.input)),
        "grads": tree_diff(grads, jax.grad(f)(SCAN_PARAMS, X)),
    }
    w, b = SCAN_PARAMS["blocks"]["w"], SCAN_PARAMS["blocks"]["b"]
    one = jnp.asarray(1.0 / N, jnp.float32)
    for k, x in enumerate(blocks(X)):
        hs = [x]
        for i in range(L):
            hs.append(jnp.tanh(hs[-1] @ w[i] + b[i]))
        for i in range(L):

            def rest(z, i=i):  # the shard's loss from block i's output on
                h = jnp.tanh(z)
                for j in range(i + 1, L):
                    h = jnp.tanh(h @ w[j] + b[j])
                return jnp.mean(h**2)

            pre = hs[i] @ w[i] + b[i]
            out[f"[{k},{i}].input"] = diff(rec.input[k, i], hs[i])
            out[f"[{k},{i}].output"] = diff(rec.output[k, i], pre)
            out[f"[{k},{i}].grad_output"] = diff(rec.grad_output[k, i], jax.vjp(rest, pre)[1](one)[0])
    return out


def nested() -> dict:
    inner = jax.jit(mapped)
    f = lambda p, x, y: jax.checkpoint(inner)(p, x, y)
    grads, cap = jax.jit(vk.grad(f, capture="*"))(PARAMS, X, Y)
    _, want = jax.jit(vk.grad(mapped, capture="*"))(PARAMS, X, Y)
    return {"grads": tree_diff(grads, jax.grad(mapped)(PARAMS, X, Y)), "records": tree_diff(cap, want)}


def hooks() -> dict:
    out = {}
    half = jax.jit(vk.grad(mapped, hooks={"fc2": vk.scale(0.5, "grad_input")}))(PARAMS, X, Y)
    reference = jax.grad(mapped)(PARAMS, X, Y)  # below fc2, every gradient is halved
    out["scale"] = tree_diff(
        half, {"fc1": jax.tree.map(lambda g: 0.5 * g, reference["fc1"]), "fc2": reference["fc2"]}
    )

    ema = {"fc*": vk.ema_normalize(0.5)}
    g = jax.jit(vk.grad(mapped, hooks=ema))
    plain = jax.jit(vk.grad(loss, hooks=ema))  # every shard's replicated gradient is this loss's
    state, ref_state = vk.init_hook_state(g, PARAMS, X, Y), vk.init_hook_state(plain, PARAMS, X, Y)
    out["state_leading"] = sorted({int(np.shape(a)[0]) for a in jax.tree.leaves(state.layers)})
    for step in range(2):
        grads, state = g(PARAMS, X, Y, hook_state=state)
        want, ref_state = plain(PARAMS, X, Y, hook_state=ref_state)
        out[f"ema_step{step}"] = tree_diff(grads, want)
        out[f"ema_state{step}"] = tree_diff(
            state.layers, jax.tree.map(lambda a: jnp.broadcast_to(a, (N, *a.shape)), ref_state.layers)
        )

    seen: list = []
    host = vk.on_host(lambda rec: seen.append((rec.key, np.asarray(rec.grad_output))))
    f = jax.jit(vk.grad(mapped, hooks={"fc*": host}, capture="*"))
    for _ in range(2):
        _, cap = jax.block_until_ready(f(PARAMS, X, Y))
    out["host_calls"] = [key for key, _ in seen]
    out["host_values"] = {
        f"{i}:{key}": diff(value, cap[key].grad_output) for i, (key, value) in enumerate(seen)
    }

    spec = vk.capture("*", fields=["grad_output"], reduce="norm")
    _, norms = jax.jit(vk.grad(mapped, capture=spec))(PARAMS, X, Y)
    _, whole = jax.jit(vk.grad(mapped, capture="*"))(PARAMS, X, Y)
    out["norm"] = {
        name: diff(
            norms[name].grad_output,
            [np.linalg.norm(np.asarray(whole[name].grad_output[k])) for k in range(N)],
        )
        for name in ("fc1", "fc2")
    }
    return out


def structures() -> dict:
    """Inside the shard_map body: a ``lax.cond``, a ``vmap`` over the rows, ``check_vma=False``,
    a Flax and an Equinox model (when installed); around it, grad-of-grad. Per case: the
    gradient's difference from ``jax.grad`` and the leading axis of each record."""

    def body_cond(p, x, y):
        z = jax.lax.cond(jnp.sum(x) > 0, lambda: pre1(p, x), lambda: 2.0 * pre1(p, x))
        return jax.lax.pmean(jnp.mean((pre2(p, z) - y) ** 2), "data")

    def body_vmap(p, x, y):
        z = jax.vmap(lambda xi: pre2(p, pre1(p, xi)))(x)
        return jax.lax.pmean(jnp.mean((z - y) ** 2), "data")

    def around(body, **kw):
        return lambda p, x, y: jax.shard_map(body, out_specs=P(), **SPECS, **kw)(p, x, y)

    cases = {
        "cond": (around(body_cond), PARAMS),
        "vmap": (around(body_vmap), PARAMS),
        "check_vma_false": (around(shard_loss, check_vma=False), PARAMS),
    }
    try:
        import flax.linen as fnn

        class Mlp(fnn.Module):
            @fnn.compact
            def __call__(self, x):
                return fnn.Dense(3, name="fc2")(jnp.tanh(fnn.Dense(8, name="fc1")(x)))

        model = Mlp()
        body = lambda p, x, y: jax.lax.pmean(jnp.mean((model.apply(p, x) - y) ** 2), "data")
        cases["flax"] = (around(body), model.init(jax.random.key(0), X))
    except ImportError:
        pass
    try:
        import equinox as eqx

        arrays, static = eqx.partition(eqx.nn.MLP(4, 3, 8, 1, key=jax.random.key(1)), eqx.is_array)

        def body_eqx(p, x, y):
            return jax.lax.pmean(jnp.mean((jax.vmap(eqx.combine(p, static))(x) - y) ** 2), "data")

        cases["equinox"] = (around(body_eqx), arrays)
    except ImportError:
        pass
    out = {}
    for name, (f, params) in cases.items():
        grads, cap = jax.jit(vk.grad(f, capture="*"))(params, X, Y)
        want = jax.grad(f)(params, X, Y)
        out[name] = {
            "grads": max(diff(a, b) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want))),
            "leading": sorted({int(np.shape(r.grad_output)[0]) for r in cap.values()}),
            "layers": len(cap),
        }

    def penalty(grad_fn):  # grad-of-grad: the squared gradient norm, differentiated again
        return jax.grad(lambda p: sum(jnp.sum(g**2) for g in jax.tree.leaves(grad_fn(p, X, Y))))(PARAMS)

    got, want = penalty(vk.grad(mapped, hooks={"fc1": vk.scale(1.0)})), penalty(jax.grad(mapped))
    out["grad_of_grad"] = max(diff(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    return out


def errors() -> dict:
    out = {}

    def registered(p, x, y):
        return jax.lax.pmean(vk.curvature.mse(pre2(p, pre1(p, x)), y), "data")

    def model_mapped(p, x, y):  # the model in the shard_map, the registered loss outside it
        z = jax.shard_map(
            lambda p, x: pre2(p, pre1(p, x)), mesh=MESH, in_specs=(P(), P("data")), out_specs=P("data")
        )(p, x)
        return vk.curvature.mse(z, y)

    cases = {
        "per_example": lambda: vk.inspect.per_example_grad_norms(mapped)(PARAMS, X, Y),
        "curvature_loss_inside": lambda: vk.value_and_grad(
            lambda p, x, y: jax.shard_map(registered, out_specs=P(), **SPECS)(p, x, y),
            capture=vk.curvature.stats("*", ["kfac"]),
        )(PARAMS, X, Y),
        "curvature_layers_inside": lambda: vk.value_and_grad(
            model_mapped, capture=vk.curvature.stats("*", ["kfac"])
        )(PARAMS, X, Y),
    }
    for name, run in cases.items():
        try:
            run()
            out[name] = "no error"
        except vk.ConfigError as err:
            out[name] = f"ConfigError: {err}"
        except Exception as err:
            out[name] = f"{type(err).__name__}: {err}"
    return out


if __name__ == "__main__":
    result = {
        "devices": jax.device_count(),
        "mlp": mlp(),
        "scan": scan(),
        "nested": nested(),
        "hooks": hooks(),
    }
    result["structures"] = structures()
    result["errors"] = errors()
    result["explain"] = [list(r["shards"]) for r in vk.explain(mapped, PARAMS, X, Y, file=io.StringIO())]
    print("RESULT " + json.dumps(result))
    sys.stdout.flush()
