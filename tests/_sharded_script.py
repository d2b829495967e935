"""Scenarios run in a subprocess by tests/test_sharding.py, with a chosen number of CPU devices.

Usage: ``python tests/_sharded_script.py SCENARIO``, with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` and ``JAX_PLATFORMS=cpu``. Each scenario
is a function in :data:`SCENARIOS` that returns a JSON-able dict; it is printed as one line
``RESULT <json>`` on stdout, and the parent test compares the dicts of different runs. A
scenario that checks something itself raises, which exits non-zero with the traceback on stderr.

The ``multiprocess`` scenario is one process of a multi-controller run: it reads
``VJPKIT_COORDINATOR``, ``VJPKIT_NUM_PROCESSES`` and ``VJPKIT_PROCESS_ID`` and calls
``jax.distributed.initialize`` before any computation.

To add a scenario (for example one that calls ``vjpkit.train.fit(..., mesh=...)``), write
``def scenario_name() -> dict`` and register it in ``SCENARIOS``; reuse :func:`make_problem`
and :func:`flat_floats`.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np
import optax

import vjpkit as vk
from vjpkit import nn
from vjpkit.train._sharding import batch_sharding, data_mesh, replicate, replicated, shard_batch

jax.config.update("jax_numpy_dtype_promotion", "strict")

STEPS = 5
BATCH = 32
FEATURES = 4
CLASSES = 3
LR = 0.1


def make_problem():
    """The model, initial params, optimizer, loss and STEPS batches (host numpy), all deterministic."""
    model = nn.serial(fc1=nn.dense(16), act=nn.relu(), fc2=nn.dense(CLASSES))
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(STEPS, BATCH, FEATURES)).astype(np.float32)
    ys = rng.integers(0, CLASSES, size=(STEPS, BATCH)).astype(np.int32)
    params = jax.tree.map(np.asarray, model.init(jax.random.key(0), xs[0]))

    def loss(params, x, y):
        logits = model.apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return model, params, optax.sgd(LR), loss, xs, ys


def flat_floats(tree) -> dict[str, list]:
    """Every array leaf of ``tree`` as a (nested) list of floats, keyed by its tree path."""
    return {
        jax.tree_util.keystr(path): np.asarray(leaf, dtype=np.float64).tolist()
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def _value_and_grad(loss):
    spec = vk.capture("*", fields=["grad_output", "grad_params"], reduce="norm")
    return vk.value_and_grad(loss, capture=spec)


def _process_local(batch, mesh):
    """Each process gives only its own rows; JAX assembles the global batch (multi-process)."""
    rows = len(jax.tree.leaves(batch)[0]) // jax.process_count()
    local = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)
    sharding = batch_sharding(mesh)
    return jax.tree.map(lambda a: jax.make_array_from_process_local_data(sharding, a[local]), batch)


def _train(mesh=None, explicit_shardings=False, feed=shard_batch) -> dict:
    """STEPS SGD steps of the MLP; on ``mesh`` the batch is sharded and the state replicated.

    ``feed(batch, mesh)`` places each global host batch on the mesh (``shard_batch``, or
    ``_process_local`` in a multi-process run).
    """
    _, params, opt, loss, xs, ys = make_problem()
    g = _value_and_grad(loss)

    def step(params, opt_state, x, y):
        (value, grads), captured = g(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, captured

    opt_state = opt.init(params)
    if mesh is None:
        jitted = jax.jit(step)
    elif explicit_shardings:
        rep, data = replicated(mesh), batch_sharding(mesh)
        jitted = jax.jit(step, in_shardings=(rep, rep, data, data), out_shardings=rep)
    else:
        jitted = jax.jit(step)
        params, opt_state = replicate((params, opt_state), mesh)

    losses, norms, input_devices, input_shard_rows = [], [], set(), set()
    for i in range(STEPS):
        x, y = xs[i], ys[i]
        if mesh is not None and not explicit_shardings:
            x, y = feed((x, y), mesh)
            input_devices.add(len(x.sharding.device_set))
            input_shard_rows.update(s.data.shape[0] for s in x.addressable_shards)
        params, opt_state, value, captured = jitted(params, opt_state, x, y)
        losses.append(float(value))
        norms.append(flat_floats(captured))
    if mesh is not None and explicit_shardings:  # the compiled step's own view of its inputs
        (_, _, x_sharding, _), _ = jitted.lower(params, opt_state, xs[0], ys[0]).compile().input_shardings
        input_devices.add(len(x_sharding.device_set))
        input_shard_rows.add(x_sharding.shard_shape(xs[0].shape)[0])

    leaves = jax.tree.leaves(params)
    return {
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "params": flat_floats(params),
        "losses": losses,
        "norms": norms,
        "input_devices": sorted(input_devices),
        "input_shard_rows": sorted(input_shard_rows),
        "param_devices": sorted({len(leaf.sharding.device_set) for leaf in leaves}),
        "params_replicated": all(leaf.sharding.is_fully_replicated for leaf in leaves),
        "captured_keys": sorted(captured),
    }


def scenario_step() -> dict:
    """The hand-written jitted step: unsharded, then on a mesh over every device, two ways."""
    return {
        "single": _train(mesh=None),
        "sharded": _train(mesh=data_mesh()),
        "sharded_in_shardings": _train(mesh=data_mesh(), explicit_shardings=True),
    }


def scenario_uneven() -> dict:
    """A batch of 10 over every device must raise ConfigError before any transfer; a stack of
    batches ``(steps, batch, ...)`` is split along ``batch_dim=1``."""
    result = {"devices": jax.device_count(), "error": None, "message": ""}
    try:
        shard_batch(np.zeros((10, FEATURES), np.float32), data_mesh())
    except vk.ConfigError as e:
        result.update(error=type(e).__name__, message=str(e))
    stacked = shard_batch(np.zeros((3, BATCH, FEATURES), np.float32), data_mesh(), batch_dim=1)
    result["stacked_shard_shapes"] = sorted({s.data.shape for s in stacked.addressable_shards})
    return result


def scenario_multiprocess() -> dict:
    """One process of a multi-controller run: the mesh spans every process's devices."""
    jax.distributed.initialize(
        coordinator_address=os.environ["VJPKIT_COORDINATOR"],
        num_processes=int(os.environ["VJPKIT_NUM_PROCESSES"]),
        process_id=int(os.environ["VJPKIT_PROCESS_ID"]),
        initialization_timeout=120,
    )
    result = _train(mesh=data_mesh(), feed=_process_local)
    result["process_index"] = jax.process_index()
    result["local_devices"] = jax.local_device_count()
    return result


def scenario_fit() -> dict:
    """vk.train.fit with mesh=data_mesh() (when there are several devices), scan_steps=2, capture."""
    _, params, optimizer, loss, xs, ys = make_problem()
    data = (xs.reshape(-1, FEATURES), ys.reshape(-1))
    norms = []
    mesh = data_mesh() if jax.device_count() > 1 else None
    state, history = vk.train.fit(
        lambda p, batch: loss(p, *batch),
        optimizer,
        params,
        data,
        batch_size=BATCH,
        steps=STEPS,
        scan_steps=2,
        capture=vk.capture("*", fields=["grad_output", "grad_params"], reduce="norm"),
        on_records=lambda step, captured: norms.append(flat_floats(captured)),
        mesh=mesh,
    )
    return {
        "devices": jax.device_count(),
        "param_devices": sorted({len(leaf.devices()) for leaf in jax.tree.leaves(state.params)}),
        "params": flat_floats(state.params),
        "losses": history["loss"],
        "norms": norms,
    }


SCENARIOS = {
    "step": scenario_step,
    "uneven": scenario_uneven,
    "multiprocess": scenario_multiprocess,
    "fit": scenario_fit,
}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in SCENARIOS:
        print(f"usage: _sharded_script.py {{{'|'.join(SCENARIOS)}}}", file=sys.stderr)
        return 2
    print("RESULT " + json.dumps(SCENARIOS[argv[0]]()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
