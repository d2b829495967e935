"""kfac-jax's side of the comparisons with ``vk.curvature``: runs in the side environment only.

kfac-jax 0.0.8 needs jax <= 0.9.1 (its curvature update raises ``ValueError: too many values
to unpack`` on jax >= 0.9.2) and vjpkit needs jax >= 0.10.1, so this script imports only jax,
numpy, kfac_jax and optax, and runs in the Python that ``kfac_jax_env.side_python()`` returns.
Arrays cross over as ``.npz`` files, results as ``.npz`` or JSON.

Modes:

* ``factors --in X.npz --out Y.npz``: an MLP (dense layers with biases, tanh between, softmax
  cross-entropy, a mean over the batch) from ``X.npz``'s ``w0, b0, w1, b1, ...`` (weights
  ``(in, out)``), ``x (N, d)``, ``y (N,)`` integer labels, ``key_one`` and ``key`` (raw
  ``uint32[2]`` PRNG keys: the rng of the one-sample and of the M-sample Monte-Carlo runs;
  ``key_one`` defaults to ``key``) and ``num_samples`` (M, default 3), in float64. For both kinds of layer
  registration (``manual``: ``kfac_jax.register_dense`` on every layer; ``auto``: kfac-jax's
  graph matcher) it writes, per layer ``i``, kfac-jax's K-FAC factors ``{reg}_{mode}_A{i}``
  (inputs, with the bias's ones column) and ``{reg}_{mode}_G{i}`` (output cotangents) for the
  estimation modes ``ggn_exact``, ``fisher_exact``, ``fisher_gradients`` (one sample, rng =
  ``key_one``) and ``fisher_gradients_m`` (``num_samples=M``, rng = ``key``), each from one
  ``update_curvature_matrix_estimate`` of a fresh state (``ema_old=0``, ``ema_new=1``). It also
  writes how kfac-jax derives its sampling keys, checked on the arrays (``key_*`` entries; see
  ``key_semantics``).
* ``bench --out Z.json [--in X.npz] [--quick]``: on the MLP 784-512-512-10 (ReLU, batch 128,
  float32; ``benchmarks/models.py``'s ``mlp_mnist`` raw model, with its weights and data from
  ``--in`` when given), times jitted calls in interleaved, shuffled rounds over blocks:
  ``value_and_grad``; kfac-jax's curvature update alone (``fisher_gradients``, one sample);
  the fused value-and-grad-plus-curvature update (both in one jitted function, the same batch);
  and ``kfac_jax.Optimizer.step`` (fixed learning rate, momentum and damping, inverses every 5
  steps, the default) and with the adaptive learning rate, momentum and damping of kfac-jax's
  README (``--no-optimizer`` skips both). It reports the median milliseconds, the medians of
  the per-round ratios to ``value_and_grad``, and the versions (jax, jaxlib, kfac_jax, optax).
* ``race --in X.npz --out Z.json``: ``curvature_race.py``'s kfac-jax runs. ``X.npz`` holds the
  ``problem`` (``mlp``, ``cnn`` or ``autoencoder``), its layers' ``w{i}``, ``b{i}`` in order
  (dense ``(in, out)``, conv HWIO), the batches ``x (steps, B, 8, 8, 1)`` and ``y``, the
  ``grid`` of ``(learning rate, damping)``, ``update_every``, ``adam_lr`` and ``seed``. Each
  setting trains a ``kfac_jax.Optimizer`` (fixed learning rate, momentum 0.9 and damping,
  ``curvature_ema`` 0.05, i.e. vjpkit's decay 0.95, inverses every ``update_every`` steps, the
  layers found by its graph matcher, the loss registered as vjpkit's: softmax cross-entropy,
  or sigmoid cross-entropy averaged over the pixels too) from the same weights on the same
  batches, then ``optax.adam(adam_lr)`` runs the same way, all in this process; each run is
  compiled and stepped twice before it is timed. It writes each run's losses and cumulative
  seconds.
"""

from __future__ import annotations

import os

# K-FAC's refresh (inverses, eigh) calls LAPACK through scipy's OpenBLAS, whose threads contend with
# XLA's on CPU: one thread each (before jax loads it), as vjpkit's side (docs/curvature.md)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import random
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import kfac_jax
import numpy as np
import optax

MODES = ("ggn_exact", "fisher_exact", "fisher_gradients", "fisher_gradients_m")

KEY_SEMANTICS = (
    "kfac-jax 0.0.8, BlockDiagonalCurvature.update_curvature_matrix_estimate(rng=k, "
    "estimation_mode='fisher_gradients'): with num_samples == 1 the single loss is sampled "
    "with k itself (_maybe_do_multiple_updates calls update_func(state, rng, ...) directly; "
    "with several registered losses k is first split into one key per loss), as "
    "CategoricalLogitsNegativeLogProbLoss.sample(k) = distrax.Categorical(logits).sample(seed=k) "
    "= jax.random.categorical(k, logits, axis=-1, shape=(1, N)) (reshaped to (N,)); with "
    "num_samples == M > 1 sample m uses jax.random.split(k, M)[m] (a lax.scan, or a vmap with "
    "should_vmap_samples) and the factors are the mean over samples. kfac_jax.Optimizer.step "
    "passes its step rng unchanged to the estimator when value_func_has_rng=False, and "
    "jax.random.split(rng)[0] when it is True (split(rng)[1] goes to the loss)."
)


def _categorical_probs(logits):
    return jax.nn.softmax(logits, axis=-1)


def mlp_logits(params, x, act, register):
    h = x
    for i, (w, b) in enumerate(params):
        y = h @ w + b
        if register:
            y = kfac_jax.register_dense(y, h, w, b)
        h = act(y) if i + 1 < len(params) else y
    return h


def make_loss(act, register):
    def loss(params, batch):
        x, y = batch
        logits = mlp_logits(params, x, act, register)
        kfac_jax.register_softmax_cross_entropy_loss(logits, y)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))

    return loss


def _layer_blocks(estimator, params):
    """Block index per layer, matched by the parameter shapes (asserted unique)."""
    shapes = [(tuple(w.shape), tuple(b.shape)) for w, b in params]
    assert len(set(shapes)) == len(shapes), f"layer shapes must differ to match blocks: {shapes}"
    by_shape = {}
    for j, block in enumerate(estimator.blocks):
        by_shape[tuple(tuple(s) for s in block.parameters_shapes)] = j
    missing = [s for s in shapes if s not in by_shape]
    assert not missing, f"no kfac-jax block for layers {missing}; blocks: {list(by_shape)}"
    return [by_shape[s] for s in shapes]


def kfac_jax_factors(loss, params, batch, key, mode, num_samples, auto):
    est = kfac_jax.BlockDiagonalCurvature(
        func=loss,
        default_estimation_mode="ggn_exact",
        auto_register_tags=auto,
        num_samples=num_samples,
    )
    func_args = (params, batch)
    state = est.init(jax.random.PRNGKey(0), func_args, None, None)
    n = batch[0].shape[0]

    def update(state, key):
        return est.update_curvature_matrix_estimate(
            state,
            ema_old=0.0,
            ema_new=1.0,
            identity_weight=0.0,
            batch_size=n,
            rng=key,
            func_args=func_args,
            estimation_mode=mode,
        )

    state = jax.jit(update)(state, key)
    out = []
    for j in _layer_blocks(est, params):
        factors = state.blocks_states[j].factors
        out.append((np.asarray(factors[0].value), np.asarray(factors[1].value)))
    return out


def _key_checks(params, x, key_one, key, m, act):
    """The sampling keys, checked: kfac-jax's own sampling against jax.random.categorical."""
    logits = mlp_logits(params, x, act, register=False)
    loss_obj = kfac_jax.CategoricalLogitsNegativeLogProbLoss(logits)
    drawn = np.asarray(loss_obj.sample(key_one))
    direct = np.asarray(jax.random.categorical(key_one, logits, axis=-1))
    per_sample = np.stack(
        [np.asarray(jax.random.categorical(k, logits, axis=-1)) for k in jax.random.split(key, m)]
    )
    return {
        "key_labels_one_sample": drawn,  # what fisher_gradients samples with rng = key_one
        "key_labels_categorical_key": direct,
        "key_labels_split_m": per_sample,  # (M, N): categorical(split(key, M)[m], logits)
        "key_one_sample_is_categorical_of_key": np.asarray(bool(np.array_equal(drawn, direct))),
        "key_one_sample_is_split_1_0": np.asarray(
            bool(
                np.array_equal(
                    drawn,
                    np.asarray(jax.random.categorical(jax.random.split(key_one, 1)[0], logits, axis=-1)),
                )
            )
        ),
        "logits": np.asarray(logits),
    }


def _manual_g_last(params, x, labels_by_sample, act):
    """The last layer's G rebuilt from given sampled labels: (1/(N M)) sum (p - e_y)(p - e_y)^T."""
    logits = mlp_logits(params, x, act, register=False)
    p = np.asarray(_categorical_probs(logits))
    n, c = p.shape
    total = np.zeros((c, c))
    for labels in labels_by_sample:
        r = p - np.eye(c)[labels]
        total += r.T @ r
    return total / (n * len(labels_by_sample))


def cmd_factors(args):
    jax.config.update("jax_enable_x64", True)
    data = np.load(args.inp)
    count = len([k for k in data.files if k.startswith("w")])
    params = [
        (jnp.asarray(data[f"w{i}"], jnp.float64), jnp.asarray(data[f"b{i}"], jnp.float64))
        for i in range(count)
    ]
    x = jnp.asarray(data["x"], jnp.float64)
    y = jnp.asarray(data["y"], jnp.int32)
    key = jnp.asarray(data["key"], jnp.uint32)
    key_one = jnp.asarray(data["key_one"], jnp.uint32) if "key_one" in data.files else key
    m = int(data["num_samples"]) if "num_samples" in data.files else 3
    act = {"tanh": jnp.tanh, "relu": jax.nn.relu}[
        str(data["activation"]) if "activation" in data.files else "tanh"
    ]
    out = {}
    for reg in ("manual", "auto"):
        loss = make_loss(act, register=reg == "manual")
        for mode in MODES:
            kmode = "fisher_gradients" if mode == "fisher_gradients_m" else mode
            samples = m if mode == "fisher_gradients_m" else 1
            rng = key if mode == "fisher_gradients_m" else key_one
            factors = kfac_jax_factors(loss, params, (x, y), rng, kmode, samples, auto=reg == "auto")
            for i, (a, g) in enumerate(factors):
                out[f"{reg}_{mode}_A{i}"] = a
                out[f"{reg}_{mode}_G{i}"] = g
    checks = _key_checks(params, x, key_one, key, m, act)
    out.update(checks)
    last = count - 1
    g1 = _manual_g_last(params, x, [checks["key_labels_categorical_key"]], act)
    gm = _manual_g_last(params, x, list(checks["key_labels_split_m"]), act)
    out["key_g_last_one_sample_err"] = np.asarray(
        np.max(np.abs(out[f"manual_fisher_gradients_G{last}"] - g1))
    )
    out["key_g_last_m_samples_err"] = np.asarray(
        np.max(np.abs(out[f"manual_fisher_gradients_m_G{last}"] - gm))
    )
    out["key_semantics"] = np.asarray(KEY_SEMANTICS)
    out["num_samples"] = np.asarray(m)
    out["versions"] = np.asarray(json.dumps(versions()))
    np.savez(args.out, **out)
    print(
        json.dumps(
            {
                "layers": count,
                "one_sample_key_is_rng": bool(checks["key_one_sample_is_categorical_of_key"]),
                "g_last_one_sample_err": float(out["key_g_last_one_sample_err"]),
                "g_last_m_samples_err": float(out["key_g_last_m_samples_err"]),
                **versions(),
            }
        )
    )


def versions():
    import jaxlib
    import optax

    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "kfac_jax": kfac_jax.__version__,
        "optax": optax.__version__,
        "python": sys.version.split()[0],
    }


# ------------------------------------------------------------------------------------ bench


def _bench_setup(path):
    if path:
        data = np.load(path)
        count = len([k for k in data.files if k.startswith("w")])
        params = [(jnp.asarray(data[f"w{i}"]), jnp.asarray(data[f"b{i}"])) for i in range(count)]
        x, y = jnp.asarray(data["x"]), jnp.asarray(data["y"], jnp.int32)
    else:  # models.py's mlp_mnist shapes and data (x ~ N(0, 1), y uniform), lecun-normal weights
        sizes = (784, 512, 512, 10)
        keys = jax.random.split(jax.random.key(0), len(sizes) - 1)
        params = [
            (jax.random.normal(k, (m, n)) / np.sqrt(m), jnp.zeros((n,)))
            for k, m, n in zip(keys, sizes[:-1], sizes[1:])
        ]
        kx, ky = jax.random.split(jax.random.key(0))
        x, y = jax.random.normal(kx, (128, 784)), jax.random.randint(ky, (128,), 0, 10)
    assert all(w.dtype == jnp.float32 for w, _ in params) and x.dtype == jnp.float32
    return params, (x, y)


def _block(fn, args, n):
    out = None
    start = time.perf_counter()
    for _ in range(n):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / n


def cmd_bench(args):
    rounds, block = (3, 5) if args.quick else (args.rounds, args.block)
    params, batch = _bench_setup(args.inp)
    n = batch[0].shape[0]
    loss = make_loss(jax.nn.relu, register=False)  # the graph matcher finds the dense layers
    value_and_grad = jax.value_and_grad(loss)
    rng = jax.random.PRNGKey(42)

    est = kfac_jax.BlockDiagonalCurvature(func=loss, default_estimation_mode="fisher_gradients")
    est_state = est.init(jax.random.PRNGKey(0), (params, batch), None, None)

    def curvature(state, params, batch, key):
        return est.update_curvature_matrix_estimate(
            state,
            ema_old=0.95,
            ema_new=1.0,
            identity_weight=0.0,
            batch_size=n,
            rng=key,
            func_args=(params, batch),
        )

    def fused(state, params, batch, key):
        return value_and_grad(params, batch), curvature(state, params, batch, key)

    rows = {
        "value_and_grad": (jax.jit(value_and_grad), (params, batch)),
        "curvature update": (jax.jit(curvature), (est_state, params, batch, rng)),
        "fused value_and_grad + curvature update": (jax.jit(fused), (est_state, params, batch, rng)),
    }

    def optimizer_row(adaptive):
        kw = (
            dict(use_adaptive_learning_rate=True, use_adaptive_momentum=True, use_adaptive_damping=True)
            if adaptive
            else dict(
                learning_rate_schedule=lambda t: 1e-3,
                momentum_schedule=lambda t: 0.9,
                damping_schedule=lambda t: 1e-3,
            )
        )
        opt = kfac_jax.Optimizer(
            value_and_grad_func=value_and_grad,
            l2_reg=0.0,
            initial_damping=1.0 if adaptive else None,
            multi_device=False,
            num_burnin_steps=0,
            **kw,
        )
        own = jax.tree.map(jnp.copy, params)  # the step donates its params and state
        state = opt.init(own, jax.random.PRNGKey(1), batch)
        holder = {"params": own, "state": state, "step": 0}

        def step(key):  # the steady state: params and state carried from step to step
            p, s, stats = opt.step(
                holder["params"], holder["state"], key, batch=batch, global_step_int=holder["step"]
            )
            holder.update(params=p, state=s, step=holder["step"] + 1)
            return stats["loss"]

        return step, (rng,)

    if not args.no_optimizer:
        rows["kfac_jax.Optimizer.step (fixed lr, momentum, damping)"] = optimizer_row(False)
        rows["kfac_jax.Optimizer.step (adaptive, README)"] = optimizer_row(True)
    for fn, a in rows.values():  # compile and warm up
        for _ in range(2 if fn is not rows["value_and_grad"][0] else 3):
            jax.block_until_ready(fn(*a))
    order, times = list(rows), {name: [] for name in rows}
    shuffle = random.Random(0)
    for _ in range(rounds):
        shuffle.shuffle(order)
        for name in order:
            fn, a = rows[name]
            times[name].append(_block(fn, a, block))
    out = []
    for name in rows:
        ratio = statistics.median(t / v for t, v in zip(times[name], times["value_and_grad"]))
        out.append({"row": name, "median_ms": 1e3 * statistics.median(times[name]), "ratio": ratio})
    res = {
        "model": "MLP 784-512-512-10, batch 128, float32",
        "rounds": rounds,
        "block": block,
        "rows": out,
        "versions": versions(),
        "platform": jax.default_backend(),
    }
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(res))


def race_model(problem, params):
    """``(loss(params, batch), value(params, batch))`` of a race problem, as curvature_race.py
    builds it with vjpkit.nn (dense ``x @ w + b``, conv SAME NHWC/HWIO, 2x2 average pool)."""

    def forward(params, x):
        if problem == "cnn":
            h = x
            for w, b in params[:2]:
                dims = ("NHWC", "HWIO", "NHWC")
                h = jax.lax.conv_general_dilated(h, w, (1, 1), "SAME", dimension_numbers=dims)
                h = jax.nn.relu(h + b)
            h = jax.lax.reduce_window(h, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4.0
            w, b = params[2]
            return h.reshape(h.shape[0], -1) @ w + b
        h = x.reshape(x.shape[0], -1)
        for i, (w, b) in enumerate(params):
            h = h @ w + b
            last = i + 1 == len(params)
            if problem == "mlp" and not last:
                h = jax.nn.relu(h)
            elif problem == "autoencoder" and not last and w.shape[1] != 30:  # a linear code layer
                h = jax.nn.sigmoid(h)
        return h

    def loss(params, batch):
        x, y = batch
        out = forward(params, x)
        if problem == "autoencoder":  # vjpkit's: the mean over the examples and the pixels
            kfac_jax.register_sigmoid_cross_entropy_loss(out, y, weight=1.0 / out.shape[1])
            return jnp.mean(jax.nn.softplus(out) - y * out)
        kfac_jax.register_softmax_cross_entropy_loss(out, y)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(out, axis=-1), y[:, None], axis=-1))

    return loss


def cmd_race(args):
    data = np.load(args.inp)
    problem = str(data["problem"])
    count = len([k for k in data.files if k.startswith("w")])
    params = [(jnp.asarray(data[f"w{i}"]), jnp.asarray(data[f"b{i}"])) for i in range(count)]
    xs, ys = data["x"], data["y"]
    batches = [(jnp.asarray(x), jnp.asarray(y)) for x, y in zip(xs, ys)]
    loss = race_model(problem, params)
    value_and_grad = jax.value_and_grad(loss)
    update_every, seed = int(data["update_every"]), int(data["seed"])

    def kfac_run(lr, damping):
        opt = kfac_jax.Optimizer(
            value_and_grad_func=value_and_grad,
            l2_reg=0.0,
            learning_rate_schedule=lambda t: lr,
            momentum_schedule=lambda t: 0.9,
            damping_schedule=lambda t: damping,
            curvature_ema=0.05,
            inverse_update_period=update_every,
            multi_device=False,
            num_burnin_steps=0,
        )

        def fresh():
            p = jax.tree.map(jnp.copy, params)
            return {"params": p, "state": opt.init(p, jax.random.PRNGKey(seed), batches[0]), "step": 0}

        def step(h, batch, key):
            p, s, stats = opt.step(h["params"], h["state"], key, batch=batch, global_step_int=h["step"])
            h.update(params=p, state=s, step=h["step"] + 1)
            return stats["loss"]

        return fresh, step

    def adam_run(lr):
        opt = optax.adam(lr)

        @jax.jit
        def update(p, s, batch):
            value, g = value_and_grad(p, batch)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s, value

        def fresh():
            p = jax.tree.map(jnp.copy, params)
            return {"params": p, "state": opt.init(p)}

        def step(h, batch, key):
            p, s, value = update(h["params"], h["state"], batch)
            h.update(params=p, state=s)
            return value

        return fresh, step

    def timed(fresh, step):
        keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(batches))
        h = fresh()
        for k in range(2):  # compile (the refresh step and the other one); not timed, not kept
            jax.block_until_ready(step(h, batches[k], keys[k]))
        h = fresh()
        losses, ends = [], []
        start = time.perf_counter()
        for batch, key in zip(batches, keys):
            losses.append(float(step(h, batch, key)))  # waits for the step
            ends.append(time.perf_counter() - start)
        return {"loss": losses, "seconds": ends}

    runs = []
    for lr, damping in data["grid"]:
        runs.append({"setting": [float(lr), float(damping)], **timed(*kfac_run(float(lr), float(damping)))})
    adam = timed(*adam_run(float(data["adam_lr"])))
    res = {"problem": problem, "runs": runs, "adam": adam, "versions": versions()}
    with open(args.out, "w") as f:
        json.dump(res, f)
    print(json.dumps({"problem": problem, "runs": len(runs)}))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("factors", help="kfac-jax's K-FAC factors of an MLP (float64)")
    f.add_argument("--in", dest="inp", required=True)
    f.add_argument("--out", required=True)
    b = sub.add_parser("bench", help="time kfac-jax's steps on the MLP 784-512-512-10")
    b.add_argument("--in", dest="inp", default=None)
    b.add_argument("--out", required=True)
    b.add_argument("--quick", action="store_true")
    b.add_argument("--rounds", type=int, default=11)
    b.add_argument("--block", type=int, default=20)
    b.add_argument("--no-optimizer", action="store_true", help="skip the Optimizer.step rows")
    r = sub.add_parser("race", help="curvature_race.py's kfac-jax runs on one problem")
    r.add_argument("--in", dest="inp", required=True)
    r.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    {"factors": cmd_factors, "bench": cmd_bench, "race": cmd_race}[args.cmd](args)


if __name__ == "__main__":
    main()
