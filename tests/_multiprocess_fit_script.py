"""``vk.train.fit`` across processes, run by tests/test_multiprocess_fit.py.

Usage: ``python -m vjpkit.train.launch -n P --cpu-devices D tests/_multiprocess_fit_script.py
SCENARIO --dir DIR`` (or the script alone, one process, for the reference run). Each process
prints one line ``RESULT <json>``; the launcher prefixes it with the process number.

Scenarios:
- ``kill`` (run first): the checkpointed run in ``DIR/killed<P>``, whose process ``P - 1`` kills
  itself (SIGKILL) when it reads batch ``DIE_AT``: the launch fails.
- ``all``: plain training with unreduced records, norms, ``on_host`` hooks (``every=1`` and
  ``every=2``) and ``on_metrics``; curvature statistics; the model run inside a ``jax.shard_map``
  of the loss, its records captured (one per shard). With several processes also:
  process-local data (an iterable of local batches, and local arrays against the global
  batches they make), two mismatched local datasets, an uninterrupted checkpointed run, the
  killed run rerun (it resumes), then rerun after process 0 flipped a bit in the newest
  checkpoint's data files (it must warn and resume from the checkpoint before), and an array
  split over every process checkpointed with one shard's recorded checksum changed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import warnings

import vjpkit as vk

if "VJPKIT_COORDINATOR" in os.environ:
    vk.train.initialize()  # before any JAX computation

import jax
import numpy as np
import optax

from vjpkit import nn
from vjpkit.train import batch_sharding, data_mesh
from vjpkit.train._checkpoint import Checkpointer
from vjpkit.train._data import ArrayBatches

jax.config.update("jax_numpy_dtype_promotion", "strict")

N, BATCH, STEPS, SEED = 96, 16, 6, 2
CKPT_STEPS, DIE_AT = 8, 5
# fc1's weight (4 KiB) is large enough for orbax to keep it in the data files each process writes
model = nn.serial(fc1=nn.dense(64), act=nn.relu(), fc2=nn.dense(3))
rng = np.random.default_rng(0)
X = rng.normal(size=(N, 16)).astype(np.float32)
Y = rng.integers(0, 3, size=N).astype(np.int32)
PARAMS = jax.tree.map(np.asarray, model.init(jax.random.key(0), X[:2]))
OPT = optax.sgd(0.1, momentum=0.9)
P, ME = jax.process_count(), jax.process_index()


def loss_fn(params, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()


def mapped_loss(params, batch):
    """``loss_fn`` as the mean of each shard's own loss, the model run inside a shard_map."""

    def body(p, x, y):
        return jax.lax.pmean(loss_fn(p, (x, y)), "data")

    spec = jax.sharding.PartitionSpec
    mapped = jax.shard_map(
        body, mesh=data_mesh(), in_specs=(spec(), spec("data"), spec("data")), out_specs=spec()
    )
    return mapped(params, *batch)


def curvature_loss(params, batch):
    x, y = batch
    return vk.curvature.softmax_cross_entropy(model.apply(params, x), y)


def flat(tree) -> dict:
    """Every leaf as a list of floats (exact for float32), keyed by its tree path."""
    return {
        jax.tree_util.keystr(path): np.asarray(leaf, np.float64).tolist()
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def fit(data, loss=loss_fn, **kwargs):
    kwargs.setdefault("batch_size", BATCH if isinstance(data, tuple) else None)
    kwargs.setdefault("steps", STEPS)
    return vk.train.fit(loss, OPT, PARAMS, data, mesh=data_mesh(), seed=SEED, progress=False, **kwargs)


def global_batches(steps: int, die_at: int | None = None):
    """The global arrays' batches (as fit draws them) as an iterable; process P - 1 kills itself
    at batch ``die_at``."""
    drawn = ArrayBatches((X, Y), BATCH, seed=SEED)
    for t in range(steps):
        if t == die_at and ME == P - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        yield drawn.batch(t)


def train() -> dict:
    records, hosts, metrics = [], {1: [], 2: []}, []
    hooks = {
        "fc1": vk.on_host(lambda rec: hosts[1].append(rec.name)),
        "fc*": vk.on_host(lambda rec: hosts[2].append(rec.name), every=2),
    }
    capture = [
        vk.capture("fc*", fields=["input", "grad_output"]),
        vk.capture("*", fields=["grad_params"], reduce="norm"),
    ]
    state, history = fit(
        (X, Y),
        hooks=hooks,
        capture=capture,
        on_records=lambda step, rec: records.append([step, flat(rec)]),
        on_metrics=lambda step, m: metrics.append(step),
    )
    jax.effects_barrier()
    stats = []
    vk.train.fit(
        curvature_loss,
        OPT,
        PARAMS,
        (X, Y),
        batch_size=BATCH,
        steps=3,
        capture=vk.curvature.stats("fc*", ["kflr", "batch_l2"]),
        on_records=lambda step, rec: stats.append(flat(rec)),
        mesh=data_mesh(),
        progress=False,
    )
    # make_step, unchanged: the state replicated, the global batch sharded, by hand
    mesh, drawn = data_mesh(), ArrayBatches((X, Y), BATCH, seed=SEED)
    step = vk.train.make_step(loss_fn, OPT)
    by_hand = vk.train.replicate(vk.train.TrainState.create(PARAMS, OPT, seed=SEED), mesh)
    step_losses = []
    for t in range(2):
        by_hand, m = step(by_hand, vk.train.shard_batch(drawn.batch(t), mesh))
        step_losses.append(float(m["loss"]))
    # layer calls inside a shard_map of the loss: one record per shard, delivered to process 0
    mapped_records: list = []
    _, mapped_history = fit(
        (X, Y),
        loss=mapped_loss,
        steps=2,
        capture=vk.capture("fc*", fields=["input", "grad_output", "grad_params"]),
        on_records=lambda step, rec: mapped_records.append([step, flat(rec)]),
    )
    jax.effects_barrier()
    return {
        "shard_map": {"losses": mapped_history["loss"], "records": mapped_records},
        "make_step": step_losses,
        "params": flat(state.params),
        "losses": history["loss"],
        "records": records,
        "on_host": {str(k): v for k, v in hosts.items()},
        "metrics": metrics,
        "curvature": stats,
    }


def local_data() -> dict:
    """Process-local data, each against the global run it must equal."""
    b = BATCH // P
    drawn = ArrayBatches((X, Y), BATCH, seed=SEED)
    mine = slice(ME * b, (ME + 1) * b)
    local_iter = [jax.tree.map(lambda a: a[mine], drawn.batch(t)) for t in range(STEPS)]
    a, ha = fit(local_iter, local_data=True)
    rows = N // P
    local = (X[ME * rows : (ME + 1) * rows], Y[ME * rows : (ME + 1) * rows])
    parts = [
        ArrayBatches((X[p * rows : (p + 1) * rows], Y[p * rows : (p + 1) * rows]), b, seed=SEED)
        for p in range(P)
    ]
    glued = [jax.tree.map(lambda *xs: np.concatenate(xs), *[q.batch(t) for q in parts]) for t in range(STEPS)]
    c, hc = fit(local, local_data=True, scan_steps=2)  # stacked local batches, split on dim 1
    d, hd = fit(glued, scan_steps=2)
    errors = []
    x_bad = X.copy()
    x_bad[0] = np.nan  # one bad example: NonFiniteError in every process, at the same step
    try:
        fit((x_bad, Y), steps=STEPS, log_every=2)
    except vk.NonFiniteError as err:
        errors.append(f"NonFiniteError at step {err.step}")
    short = (local[0][: rows - 16 * (ME == P - 1)], local[1][: rows - 16 * (ME == P - 1)])
    bad_leaf = (local[0].astype(np.float64) if ME == P - 1 else local[0], local[1])
    for bad in (short, bad_leaf):
        try:
            with jax.numpy_dtype_promotion("standard"):
                fit(bad, local_data=True)
        except vk.ConfigError as err:
            errors.append(str(err))
    return {
        "iterable": [flat(a.params), ha["loss"]],
        "arrays": [flat(c.params), hc["loss"], flat(d.params), hd["loss"]],
        "errors": errors,
    }


def checkpointed(directory: pathlib.Path, die_at: int | None = None):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, history = fit(
            global_batches(CKPT_STEPS, die_at),
            steps=CKPT_STEPS,
            hooks={"fc1": vk.ema_normalize(0.9)},
            checkpoint_dir=str(directory),
            checkpoint_every=4,
        )
    damaged = [str(w.message) for w in caught if "damaged" in str(w.message)]
    return {
        "state": flat(state),
        "first_step": history["step"][0] if history["step"] else None,
        "warnings": damaged,
    }


def damage(step_dir: pathlib.Path) -> list[str]:
    """Flips one bit in the middle of the largest data file of each OCDBT store of the checkpoint:
    the one each process wrote and the one orbax merges them into (restores read that one)."""
    stores = sorted(
        {p.parent for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"}
    )
    hit = []
    for store in stores:
        path = max(store.iterdir(), key=lambda p: p.stat().st_size)
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        path.write_bytes(bytes(raw))
        hit.append(str(path.relative_to(step_dir)))
    return hit


def sharded(directory: pathlib.Path) -> dict:
    """An array split over every process: checksums per shard, each process checking its own.
    Process 0 then changes the recorded checksum of a shard that only the last process holds."""
    sharding = batch_sharding(data_mesh())
    whole = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    w = jax.make_array_from_callback(whole.shape, sharding, lambda index: whole[index])
    out: dict = {}
    with Checkpointer(directory) as ckpt:
        ckpt.save(1, {"w": w})
        back = ckpt.restore({"w": w})[0]["w"]
        out["intact"] = all(np.array_equal(s.data, whole[s.index]) for s in back.addressable_shards)
        theirs = sorted(
            {
                ",".join(f"{i.start}:{i.stop}" for i in (index[0], slice(0, 32)))
                for device, index in sharding.devices_indices_map(whole.shape).items()
                if device.process_index == P - 1
            }
        )
        record = directory / "1" / "tree" / "metadata"
        if ME == 0:
            tree = json.loads(record.read_text())
            shards = tree["leaves"][0]["shards"]
            out["shard_keys"] = sorted(shards)
            shards[theirs[0]] = "sha256:" + "0" * 64
            record.write_text(json.dumps(tree))
        vk.train._distributed.barrier("checksum changed")
        try:
            ckpt.restore({"w": w})
        except vk.train.CheckpointDamagedError as err:
            out["error"] = str(err)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["all", "kill"])
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    root = pathlib.Path(args.dir)
    out: dict = {"process": ME, "processes": P, "devices": jax.device_count()}
    if args.scenario == "kill":
        checkpointed(root / f"killed{P}", die_at=DIE_AT)
        return
    out["train"] = train()
    if P > 1:
        out["local"] = local_data()
        out["straight"] = checkpointed(root / f"straight{P}")
        out["resumed"] = checkpointed(root / f"killed{P}")  # after the "kill" launch
        if ME == 0:
            out["damaged_files"] = damage(root / f"killed{P}" / str(CKPT_STEPS))
        vk.train._distributed.barrier("damaged")
        out["after_damage"] = checkpointed(root / f"killed{P}")
        out["sharded"] = sharded(root / f"sharded{P}")
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
