"""`vk.train.fit` across processes: 2 local processes of 2 CPU devices, as on 2 hosts.

JAX's multi-controller model: every process runs this same script, `jax.distributed` joins them
into one job, and one mesh spans every process's devices. Each process loads only its own rows
(`local_data=True`: `fit` assembles each step's global batch with
`jax.make_array_from_process_local_data`), and the step is one program over all 4 devices.
Process 0 alone prints, calls `on_records` (here with each layer's gradient norm, the global
one) and warns; every process writes its shards of each checkpoint, and a rerun with the same
`--checkpoint-dir` resumes. At the end every process checks that all hold the same parameters.

Run: `python examples/multiprocess_fit.py` (`--steps N`, `--checkpoint-dir DIR` to checkpoint
and resume). Without the launcher's environment the script starts itself as 2 processes with
`python -m vjpkit.train.launch -n 2 --cpu-devices 2`, which you can also type yourself. On real
hosts, start it once per host instead (docs/training-scale.md). Needs only `pip install -e .`.
"""

from __future__ import annotations

import argparse
import os
import sys

import vjpkit as vk


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch, all processes")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--processes", type=int, default=2, help="when it starts itself")
    parser.add_argument("--cpu-devices", type=int, default=2, help="per process, when it starts itself")
    args = parser.parse_args(argv)
    if "VJPKIT_COORDINATOR" not in os.environ:  # not started by the launcher: start it
        from vjpkit.train import launch

        code = launch.launch(
            [os.path.abspath(__file__), *(sys.argv[1:] if argv is None else argv)],
            args.processes,
            cpu_devices=args.cpu_devices,
        )
        if code:
            raise SystemExit(code)
        return None
    vk.train.initialize()  # first, before any JAX computation
    return train(args)


def train(args) -> dict:
    import jax
    import numpy as np
    import optax
    from jax.experimental import multihost_utils

    from vjpkit import nn

    me, processes = jax.process_index(), jax.process_count()
    model = nn.serial(fc1=nn.dense(32), act=nn.relu(), fc2=nn.dense(3))

    # This process's rows only: a stand-in for reading shard `me` of a dataset.
    rng = np.random.default_rng(me)
    x = rng.normal(size=(1024, 4)).astype(np.float32)
    y = ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0)).astype(np.int32)
    params = model.init(jax.random.key(0), x[:2])  # the same key in every process

    def loss_fn(params, batch):
        xb, yb = batch
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, xb), yb).mean()

    norms = {}
    state, history = vk.train.fit(
        loss_fn,
        optax.sgd(0.1, momentum=0.9),
        params,
        (x, y),
        batch_size=args.batch_size,  # global: each process takes batch_size / processes rows
        steps=args.steps,
        local_data=True,
        mesh=vk.train.data_mesh(),  # every device of every process
        capture=vk.capture("fc*", fields=["grad_params"], reduce="norm"),
        on_records=lambda step, rec: norms.update({step: float(rec["fc1"].grad_params["weight"])}),
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=max(1, args.steps // 2) if args.checkpoint_dir else None,
        progress=False,
    )
    # Every process holds the same replicated parameters: gather a checksum of each to compare.
    total = np.float32(sum(float(np.asarray(leaf).sum()) for leaf in jax.tree.leaves(state.params)))
    agree = bool(np.all(multihost_utils.process_allgather(total) == total))
    if me == 0:
        print(f"{processes} processes, {jax.device_count()} devices, {len(history['loss'])} steps")
        print(f"loss {history['loss'][0]:.3f} -> {history['loss'][-1]:.3f}")
        print(
            f"on_records calls on process 0: {len(norms)}; last |dL/dW fc1| {norms[max(norms)]:.4f}"
            if norms
            else ""
        )
        print(f"every process holds the same parameters: {agree}")
    return {"loss": history["loss"], "agree": agree, "norms": norms}


if __name__ == "__main__":
    main()
