"""Subprocess for the kill-and-resume test: a small fit run with checkpoints.

Usage: python _resume_script.py CKPT_DIR OUT_NPZ STEPS SLOW
Prints "step N" after each step when SLOW is 1 (and sleeps a little, so a kill lands mid-run).
"""

from __future__ import annotations

import sys
import time

import jax
import numpy as np
import optax

import vjpkit as vk
from vjpkit import nn

model = nn.serial(fc1=nn.dense(16), act=nn.tanh(), drop=nn.dropout(0.2), fc2=nn.dense(2))


def loss_fn(params, batch, *, key):
    x, y = batch
    logits = model.apply(params, x, key=key)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def main(ckpt_dir: str, out: str, steps: int, slow: bool) -> None:
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(200, 3)).astype(np.float32)
    y = (x.sum(axis=1) > 1.5).astype(np.int32)
    params = model.init(jax.random.key(0), x[:2])

    def eval_fn(params):
        if slow:
            print("step", flush=True)
            time.sleep(0.01)
        return {}

    state, _ = vk.train.fit(
        loss_fn,
        optax.adam(1e-2),
        params,
        (x, y),
        batch_size=20,
        steps=steps,
        hooks={"fc1": vk.ema_normalize(0.9)},
        checkpoint_dir=ckpt_dir if ckpt_dir != "-" else None,
        checkpoint_every=4 if ckpt_dir != "-" else None,
        eval_fn=eval_fn,
        eval_every=1,
        log_every=1,
        seed=7,
    )
    leaves = jax.tree.leaves(state)
    np.savez(out, *[np.asarray(leaf) for leaf in leaves])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1")
