"""Plain-JAX models through vjpkit's matching (issue 22): step time, per-example norms, trace time.

The models here use no layer library: ``jnp`` and ``lax`` code on a dict of arrays, which
vjpkit's plain-JAX matching (``vjpkit/_engine/_match.py``) turns into layer calls named by
parameter path. Three parts:

* **Steps.** A jitted SGD step (lr 0.01, momentum 0.9, as ``run.py``'s) of each plain model,
  with the same loss function differentiated three ways: raw JAX ``jax.value_and_grad``;
  ``vk.value_and_grad`` with matching on and no hooks (target <= 1.02x raw JAX); and with
  ``capture=vk.capture("*", fields=[grad_output, grad_input, grad_params], reduce="norm")``,
  per-layer norms of every matched layer (target <= 1.10x). Models: the MLP 784-512-512-10 at
  batch 128 and the CNN 1-16-32 of ``models.py`` (their ``raw`` functions, which are plain
  ``jnp``), and a plain transformer LM (token and position embeddings, einsum causal
  attention, GELU MLP, ``jnp`` layer norms, its blocks stacked under ``lax.scan``). Timing as in
  ``run.py``: interleaved, shuffled rounds over blocks of steps (a quarter of the block for the
  transformer); medians of per-round ratios.
* **Per-example gradient norms** (``vk.inspect.per_example_grad_norms``) of one transformer
  block, written in plain ``jnp`` and as a Flax linen module (``LayerNorm``,
  ``MultiHeadDotProductAttention`` with a causal mask, ``Dense``), under a mean squared error
  loss, at T=128, d=512, d_ff=2048, 8 heads, batch 32 (``--pex-*`` flags; ``--quick``: a small
  size). Against a jitted ``jax.value_and_grad`` of the same loss (what the per-example call
  also returns: the loss and the batch gradient): time (target <= 1.3x) and
  XLA's temp memory, ``memory_analysis().temp_size_in_bytes`` of the compiled function (target
  <= 1.5x), judged on the default call (``check=True``: its consistency checks included);
  ``check=False`` and ``vmap(grad)`` followed by the norms are reported beside them (no
  target). The norms of vjpkit and ``vmap(grad)`` must agree (their largest relative
  difference is reported), and vjpkit's fallback warnings, if any, are listed.
* **Trace-time matching** of a plain transformer LM whose blocks are a Python loop (unrolled,
  no scan), for 6, 12 and 24 blocks: ``jax.make_jaxpr`` of the loss alone, and followed by
  ``vjpkit._engine._match.rewrite`` (what ``vk.value_and_grad`` adds at trace time), interleaved
  repeats, medians; and ``rewrite`` alone on the traced program. Targets: matching 24 blocks
  under 1 s, and linear in the number of equations (per-equation cost at 24 blocks <= 1.5x that
  at 6 blocks). Equations are counted with nested programs (``pjit``, ``custom_jvp`` bodies).

Usage: ``python benchmarks/plain_bench.py [--quick] [--rounds 15] [--block 20] [--pex-rounds 5]
[--pex-seq 128] [--pex-d 512] [--pex-ff 2048] [--pex-heads 8] [--pex-batch 32] [--trace-repeats 7]
[--out benchmarks/plain_results.json]``. ``run.py`` runs it too (``--no-plain`` skips it) and
puts its result under ``"plain"`` in its JSON. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jcore

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import peers  # noqa: E402
from models import cnn, data, loss_of, mlp_mnist  # noqa: E402

import vjpkit as vk  # noqa: E402
from vjpkit._engine import _match  # noqa: E402  (the matcher itself, for the trace-time part)

RAW, NO_HOOKS, CAPTURE = "raw JAX", "vjpkit, matched, no hooks", "vjpkit, matched, capture norms"
STEP_ROWS = (RAW, NO_HOOKS, CAPTURE)
TARGET_NO_HOOKS, TARGET_CAPTURE = 1.02, 1.10
PEX_VJPKIT, PEX_NO_CHECK = "vjpkit per_example_grad_norms", "vjpkit per_example_grad_norms, check=False"
PEX_ROWS = ("value_and_grad", PEX_VJPKIT, PEX_NO_CHECK, "vmap(grad) + norms")
TARGET_PEX_TIME, TARGET_PEX_TEMP = 1.3, 1.5
TRACE_BLOCKS, QUICK_TRACE_BLOCKS = (6, 12, 24), (2, 4, 8)
TARGET_TRACE_S, TARGET_LINEAR = 1.0, 1.5
WARMUP = 3


# --- plain-jnp transformer ------------------------------------------------------------------


def layer_norm(x, p):
    mu = x.mean(-1, keepdims=True)
    var = jnp.square(x - mu).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def block(p, h):
    """A pre-norm transformer block: einsum causal self-attention, GELU MLP, jnp layer norms."""
    x = layer_norm(h, p["ln1"])
    q = jnp.einsum("btd,dhk->bthk", x, p["attn"]["wq"])
    k = jnp.einsum("btd,dhk->bthk", x, p["attn"]["wk"])
    v = jnp.einsum("btd,dhk->bthk", x, p["attn"]["wv"])
    s = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[-1])
    n = h.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -1e9)
    o = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(s, -1), v)
    h = h + jnp.einsum("bthk,hkd->btd", o, p["attn"]["wo"])
    x = layer_norm(h, p["ln2"])
    return h + jax.nn.gelu(x @ p["mlp"]["w1"] + p["mlp"]["b1"]) @ p["mlp"]["w2"] + p["mlp"]["b2"]


def block_params(key, d, heads, ff):
    ks = jax.random.split(key, 6)
    dk = d // heads

    def normal(k, shape, fan_in):
        return jax.random.normal(k, shape) / np.sqrt(fan_in)

    return {
        "ln1": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
        "attn": {
            "wq": normal(ks[0], (d, heads, dk), d),
            "wk": normal(ks[1], (d, heads, dk), d),
            "wv": normal(ks[2], (d, heads, dk), d),
            "wo": normal(ks[3], (heads, dk, d), d),
        },
        "ln2": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
        "mlp": {"w1": normal(ks[4], (d, ff), d), "b1": jnp.zeros(ff), "w2": normal(ks[5], (ff, d), ff),
                "b2": jnp.zeros(d)},
    }  # fmt: skip


def lm_params(key, vocab, seq, d, heads, ff, n_blocks, stacked):
    """Token and position embeddings, ``n_blocks`` blocks (stacked on axis 0 for ``lax.scan``,
    else a list), a final layer norm and an untied head."""
    k_emb, k_pos, k_head, k_blocks = jax.random.split(key, 4)
    blocks = [block_params(k, d, heads, ff) for k in jax.random.split(k_blocks, n_blocks)]
    return {
        "embed": jax.random.normal(k_emb, (vocab, d)) * 0.02,
        "pos": jax.random.normal(k_pos, (seq, d)) * 0.02,
        "blocks": jax.tree.map(lambda *a: jnp.stack(a), *blocks) if stacked else blocks,
        "ln_f": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
        "head": {"w": jax.random.normal(k_head, (d, vocab)) / np.sqrt(d), "b": jnp.zeros(vocab)},
    }


def lm_scan(p, tok):
    """The LM with its blocks under ``lax.scan`` over the stacked block params."""
    h = p["embed"][tok] + p["pos"][: tok.shape[1]]
    h, _ = jax.lax.scan(lambda h, bp: (block(bp, h), None), h, p["blocks"])
    return layer_norm(h, p["ln_f"]) @ p["head"]["w"] + p["head"]["b"]


def lm_unrolled(p, tok):
    """The LM with its blocks in a Python loop: one copy of the block per layer in the program."""
    h = p["embed"][tok] + p["pos"][: tok.shape[1]]
    for bp in p["blocks"]:
        h = block(bp, h)
    return layer_norm(h, p["ln_f"]) @ p["head"]["w"] + p["head"]["b"]


def lm_loss(apply):
    def loss(params, tok, y):
        return optax.softmax_cross_entropy_with_integer_labels(apply(params, tok), y).mean()

    return loss


# --- steps ------------------------------------------------------------------------------------

LM = dict(vocab=256, seq=64, d=128, heads=4, ff=512, n_blocks=2, batch=16)
LM_QUICK = dict(vocab=64, seq=16, d=32, heads=2, ff=64, n_blocks=2, batch=4)


def step_model(key, lm=LM):
    """``(title, loss, params, x, y)`` of a plain model of the step comparison (``STEP_MODELS``)."""
    if key in ("plain_mlp", "plain_cnn"):
        title, model, raw, shape, classes = (mlp_mnist if key == "plain_mlp" else cnn)()
        x, y = data(shape, classes)
        params = model.init(jax.random.key(0), x)  # the same leaves as the raw function's
        return f"plain jnp {title}", loss_of(raw), params, x, y
    c = lm
    params = lm_params(
        jax.random.key(0), c["vocab"], c["seq"], c["d"], c["heads"], c["ff"], c["n_blocks"], True
    )
    tok = jax.random.randint(jax.random.key(1), (c["batch"], c["seq"] + 1), 0, c["vocab"])
    title = (
        f"plain jnp transformer LM, {c['n_blocks']} blocks under lax.scan, d={c['d']}, {c['heads']} heads, "
        f"d_ff={c['ff']}, T={c['seq']}, vocab {c['vocab']}, batch {c['batch']}"
    )
    return title, lm_loss(lm_scan), params, tok[:, :-1], tok[:, 1:]


def step_variants(loss, params, x, y):
    """name -> ``peers.JaxVariant`` of a jitted SGD step."""
    opt = optax.sgd(peers.LR, momentum=peers.MOMENTUM)
    norms = vk.capture("*", fields=["grad_output", "grad_input", "grad_params"], reduce="norm")

    def sgd(value_and_grad, with_capture):
        def step(carry, x, y):
            p, s = carry
            out = value_and_grad(p, x, y)
            (value, grads), extra = (out[0], out[1]) if with_capture else (out, None)
            updates, s = opt.update(grads, s, p)
            return (optax.apply_updates(p, updates), s), value, extra

        return jax.jit(step)

    steps = {
        RAW: sgd(jax.value_and_grad(loss), False),
        NO_HOOKS: sgd(vk.value_and_grad(loss), False),
        CAPTURE: sgd(vk.value_and_grad(loss, capture=norms), True),
    }
    carry = (params, opt.init(params))
    out = {}
    for name, step in steps.items():
        out[name] = peers.JaxVariant(step, carry, x, y, lambda step=step: step.lower(carry, x, y))
    return out


def bench_steps(key, rounds, block_steps, rng, lm=LM):
    """One model's rows; the transformer times blocks of ``block_steps // 4`` steps (its step is
    about 100x the MLP's: the run stays within minutes)."""
    if key == "plain_transformer":
        block_steps = max(1, block_steps // 4)
    title, loss, params, x, y = step_model(key, lm)
    variants = step_variants(loss, params, x, y)
    first, loss0 = {}, {}
    order = list(variants)
    rng.shuffle(order)
    for name in order:
        first[name], loss0[name] = variants[name].first_call()
    # the layers the capture row recorded: those the matching found (one more step, not kept)
    _, _, captured = variants[CAPTURE].step(variants[CAPTURE].carry, x, y)
    layers = sorted(captured)
    memory, cost = {}, {}
    for name, v in variants.items():
        v.warm_up(WARMUP)
        compiled = v.lower().compile()
        memory[name] = peers.xla_memory(compiled)
        cost[name] = _cost(compiled)
    times = {name: [] for name in variants}
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            times[name].append(variants[name].time(block_steps))
    rows = [
        {
            "variant": name,
            "median_step_us": 1e6 * statistics.median(times[name]),
            "ratio_to_raw": _ratio(times[name], times[RAW]),
            "first_call_s": first[name],
            "peak_memory_mb": memory[name]["peak_mb"],
            "memory": memory[name],
            "xla_cost": cost[name],
            "xla_flops_ratio_to_raw": _flops_ratio(cost[name], cost[RAW]),
            "first_loss": loss0[name],
            "step_s_per_round": times[name],
        }
        for name in STEP_ROWS
    ]
    no_hooks, capture = rows[1]["ratio_to_raw"], rows[2]["ratio_to_raw"]
    return {
        "model": key,
        "title": title,
        "block": block_steps,
        "rows": rows,
        "matched_layers": layers,
        "max_first_loss_diff": max(abs(loss0[n] - loss0[RAW]) for n in loss0),
        "targets": [
            _target(f"{title}: {NO_HOOKS} / raw JAX <= {TARGET_NO_HOOKS}", no_hooks, TARGET_NO_HOOKS),
            _target(f"{title}: {CAPTURE} / raw JAX <= {TARGET_CAPTURE}", capture, TARGET_CAPTURE),
        ],
    }


def _cost(compiled) -> dict:
    """XLA's cost analysis of a compiled step: flops and bytes accessed (independent of load)."""
    ca = compiled.cost_analysis()
    ca = (ca[0] if ca else {}) if isinstance(ca, list) else (ca or {})
    return {"flops": ca.get("flops"), "bytes_accessed": ca.get("bytes accessed")}


def _flops_ratio(a, b):
    return a["flops"] / b["flops"] if a["flops"] and b["flops"] else None


def _ratio(a, b):
    """Median over rounds of the per-round ratio."""
    return statistics.median(x / y for x, y in zip(a, b))


def _target(text, value, limit):
    return {"target": text, "value": value, "met": value <= limit}


# --- per-example gradient norms ----------------------------------------------------------------


def flax_block(d, heads, ff):
    import flax.linen as fnn

    class Block(fnn.Module):
        @fnn.compact
        def __call__(self, h):
            x = fnn.LayerNorm(name="ln1")(h)
            mask = fnn.make_causal_mask(jnp.ones(h.shape[:2]))
            h = h + fnn.MultiHeadDotProductAttention(num_heads=heads, qkv_features=d, name="attn")(
                x, x, mask=mask
            )
            x = fnn.LayerNorm(name="ln2")(h)
            return h + fnn.Dense(d, name="fc2")(fnn.gelu(fnn.Dense(ff, name="fc1")(x)))

    return Block()


def pex_setup(which, seq, d, ff, heads, batch):
    """``(fns, args)``: the jitted ``PEX_ROWS`` functions of one block (``"plain"`` or
    ``"flax"``) under a mean squared error loss, and their arguments."""
    kx, kt, kp = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (batch, seq, d))
    target = jax.random.normal(kt, (batch, seq, d))
    if which == "plain":
        apply, params = block, block_params(kp, d, heads, ff)
    else:
        model = flax_block(d, heads, ff)
        apply, params = model.apply, model.init(kp, x[:1])

    def loss(p, x, t):
        return jnp.mean(jnp.square(apply(p, x) - t))

    def naive(p, x, t):
        def single(p, xi, ti):
            return loss(p, xi[None], ti[None])

        grads = jax.vmap(jax.grad(single), in_axes=(None, 0, 0))(p, x, t)
        sq = [jnp.sum(jnp.square(g.reshape(g.shape[0], -1)), axis=1) for g in jax.tree.leaves(grads)]
        return jnp.sqrt(sum(sq))

    fns = {
        "value_and_grad": jax.jit(jax.value_and_grad(loss)),
        PEX_VJPKIT: jax.jit(vk.inspect.per_example_grad_norms(loss)),
        PEX_NO_CHECK: jax.jit(vk.inspect.per_example_grad_norms(loss, check=False)),
        "vmap(grad) + norms": jax.jit(naive),
    }
    return fns, (params, x, target)


def bench_per_example(which, size, rounds, rng):
    seq, d, ff, heads, batch = size
    name = "plain jnp" if which == "plain" else "Flax linen"
    title = (
        f"Per-example gradient norms, {name} transformer block, T={seq}, d={d}, d_ff={ff}, {heads} heads, "
        f"batch {batch}"
    )
    fns, args = pex_setup(which, seq, d, ff, heads, batch)
    compiled, memory = {}, {}
    with warnings.catch_warnings(record=True) as caught:  # vjpkit says when a leaf falls back
        warnings.simplefilter("always")
        for v in PEX_ROWS:
            compiled[v] = fns[v].lower(*args).compile()
            memory[v] = peers.xla_memory(compiled[v])
        outs = {v: jax.block_until_ready(compiled[v](*args)) for v in PEX_ROWS}  # first calls
    fallbacks = sorted(
        {str(w.message).splitlines()[0] for w in caught if issubclass(w.category, UserWarning)}
    )
    ours, ref = outs[PEX_VJPKIT][2].total, outs["vmap(grad) + norms"]
    max_rel_diff = float(jnp.max(jnp.abs(ours - ref) / jnp.abs(ref)))
    times = {v: [] for v in PEX_ROWS}
    order = list(PEX_ROWS)
    for _ in range(rounds):
        rng.shuffle(order)
        for v in order:
            start = time.perf_counter()
            jax.block_until_ready(compiled[v](*args))
            times[v].append(time.perf_counter() - start)
    base = "value_and_grad"
    temp = {v: memory[v]["temp_mb"] for v in PEX_ROWS}
    time_ratio = _ratio(times[PEX_VJPKIT], times[base])
    temp_ratio = temp[PEX_VJPKIT] / temp[base]
    return {
        "model": which,
        "title": title,
        "size": dict(seq=seq, d=d, d_ff=ff, heads=heads, batch=batch),
        "rounds": rounds,
        "median_ms": {v: 1e3 * statistics.median(t) for v, t in times.items()},
        "time_ratio_to_value_and_grad": {v: _ratio(times[v], times[base]) for v in PEX_ROWS},
        "xla_memory": memory,
        "temp_ratio_to_value_and_grad": {v: temp[v] / temp[base] for v in PEX_ROWS},
        "norms_max_rel_diff_vs_vmap_grad": max_rel_diff,
        "fallback_warnings": fallbacks,
        "call_s_per_round": times,
        "targets": [
            _target(f"{title}: vjpkit / value_and_grad time <= {TARGET_PEX_TIME}", time_ratio,
                    TARGET_PEX_TIME),
            _target(f"{title}: vjpkit / value_and_grad XLA temp memory <= {TARGET_PEX_TEMP}", temp_ratio,
                    TARGET_PEX_TEMP),
        ],
    }  # fmt: skip


def have_flax() -> str | None:
    """None when Flax linen imports, else why not."""
    try:
        import flax.linen  # noqa: F401
    except ImportError as err:
        return f"skipped: {type(err).__name__}: {err}"
    return None


# --- trace-time matching -------------------------------------------------------------------------


def count_eqns(jaxpr) -> int:
    """Equations of ``jaxpr`` and of every program nested in their params."""
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jcore.ClosedJaxpr):
                    n += count_eqns(sub.jaxpr)
                elif isinstance(sub, jcore.Jaxpr):
                    n += count_eqns(sub)
    return n


def count_matched(jaxpr) -> int:
    """``vjpkit_matched`` equations of ``jaxpr``, nested programs included."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive is _match.match_p:
            n += 1
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jcore.ClosedJaxpr):
                    n += count_matched(sub.jaxpr)
                elif isinstance(sub, jcore.Jaxpr):
                    n += count_matched(sub)
    return n


def leaf_paths(params) -> list[str]:
    """The ``/``-joined path of each leaf, in flattening order (the program's inputs)."""
    out = []
    for keys, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        out.append("/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys))
    return out


def bench_trace(n_blocks, repeats, rng):
    """``jax.make_jaxpr`` of an unrolled LM's loss, with and without ``_match.rewrite`` after it."""
    c = dict(vocab=128, seq=32, d=64, heads=4, ff=256, batch=2)  # shapes only: nothing is computed
    params = lm_params(jax.random.key(0), c["vocab"], c["seq"], c["d"], c["heads"], c["ff"], n_blocks, False)
    tok = jax.random.randint(jax.random.key(1), (c["batch"], c["seq"] + 1), 0, c["vocab"])
    x, y = tok[:, :-1], tok[:, 1:]
    loss = lm_loss(lm_unrolled)
    paths = leaf_paths(params)

    def traced():
        return jax.make_jaxpr(lambda p: loss(p, x, y))(params)

    def traced_and_matched():
        return _match.rewrite(traced(), paths)

    closed = traced()
    rewritten, other = traced_and_matched()
    times = {"make_jaxpr": [], "make_jaxpr + rewrite": [], "rewrite": []}
    fns = {
        "make_jaxpr": traced,
        "make_jaxpr + rewrite": traced_and_matched,
        "rewrite": lambda: _match.rewrite(closed, paths),
    }
    order = list(fns)
    for _ in range(repeats):
        rng.shuffle(order)
        for name in order:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    eqns = count_eqns(closed.jaxpr)
    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "blocks": n_blocks,
        "equations": eqns,
        "top_level_equations": len(closed.jaxpr.eqns),
        "matched_layers": count_matched(rewritten.jaxpr),
        "other_uses": len(other),
        "median_s": med,
        "ratio_with_rewrite": _ratio(times["make_jaxpr + rewrite"], times["make_jaxpr"]),
        "rewrite_us_per_equation": 1e6 * med["rewrite"] / eqns,
        "samples_s": times,
    }


# --- the whole run -------------------------------------------------------------------------------


PARTS = ("steps", "per_example", "trace")
STEP_MODELS = ("plain_mlp", "plain_cnn", "plain_transformer")


def run(quick=False, rounds=15, block_steps=20, pex_rounds=5, pex_size=(128, 512, 2048, 8, 32),
        trace_repeats=7, trace_blocks=TRACE_BLOCKS, parts=PARTS):  # fmt: skip
    """The ``parts`` asked for (all by default); ``quick``: 2 rounds of 2 steps, a tiny LM,
    a small per-example size and 2, 4, 8 blocks for the trace-time part (a smoke run)."""
    lm = LM
    if quick:
        rounds, block_steps, pex_rounds, trace_repeats = 2, 2, 2, 2
        pex_size, trace_blocks, lm = (16, 64, 256, 4, 4), QUICK_TRACE_BLOCKS, LM_QUICK
    rng = random.Random(0)
    start = time.perf_counter()
    wall = {}
    steps, pex, trace, trace_targets = [], [], [], []
    if "steps" in parts:
        steps = [bench_steps(key, rounds, block_steps, rng, lm) for key in STEP_MODELS]
        wall["steps"] = time.perf_counter() - start
    if "per_example" in parts:
        t0 = time.perf_counter()
        pex = [bench_per_example("plain", pex_size, pex_rounds, rng)]
        skipped = have_flax()
        pex.append(bench_per_example("flax", pex_size, pex_rounds, rng) if skipped is None else
                   {"model": "flax", "status": skipped})  # fmt: skip
        wall["per_example"] = time.perf_counter() - t0
    if "trace" in parts:
        t0 = time.perf_counter()
        trace = [bench_trace(n, trace_repeats, rng) for n in trace_blocks]
        small, large = trace[0], trace[-1]
        linear = large["rewrite_us_per_equation"] / small["rewrite_us_per_equation"]
        trace_targets = [
            _target(f"matching (rewrite) of {large['blocks']} unrolled blocks < {TARGET_TRACE_S:.0f} s",
                    large["median_s"]["rewrite"], TARGET_TRACE_S),
            _target(f"matching per equation, {large['blocks']} / {small['blocks']} blocks <= {TARGET_LINEAR} "
                    "(linear in equations)", linear, TARGET_LINEAR),
        ]  # fmt: skip
        wall["trace"] = time.perf_counter() - t0
    targets = [t for s in steps for t in s["targets"]]
    targets += [t for p in pex if "targets" in p for t in p["targets"]] + trace_targets
    return {
        "title": "Plain-JAX models through vjpkit's matching",
        "quick": quick,
        "parts": list(parts),
        "rounds": rounds,
        "block": block_steps,
        "steps": steps,
        "per_example": pex,
        "trace": trace,
        "trace_targets": trace_targets,
        "targets": targets,
        "wall_s": time.perf_counter() - start,
        "wall_s_per_part": wall,
    }


def _mark(met):
    return "met" if met else "NOT met"


def markdown(res: dict) -> str:
    lines = []
    for s in res["steps"]:
        lines += [f"\n**{s['title']}** (matched layers: {len(s['matched_layers'])})\n",
                  "| variant | median step (µs) | ratio to raw JAX | first call (s) | peak memory (MB) "
                  "| XLA flops / raw JAX's |",
                  "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in s["rows"]:
            flops = "—" if r["xla_flops_ratio_to_raw"] is None else f"{r['xla_flops_ratio_to_raw']:.3f}"
            lines.append(
                f"| {r['variant']} | {r['median_step_us']:.0f} | {r['ratio_to_raw']:.3f} | "
                f"{r['first_call_s']:.2f} | {r['peak_memory_mb']:.2f} | {flops} |"
            )
        lines.append(f"\n- first-step losses: all within {s['max_first_loss_diff']:.1e} of raw JAX's")
    for p in res["per_example"]:
        if "status" in p:
            lines.append(f"\n**Per-example gradient norms, {p['model']} transformer block**: {p['status']}")
            continue
        lines += [f"\n**{p['title']}**\n",
                  "| variant | median call (ms) | time / value_and_grad | XLA temp (MB) "
                  "| temp / value_and_grad | XLA peak: temp + args + out (MB) |",
                  "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for v in PEX_ROWS:
            m = p["xla_memory"][v]
            lines.append(
                f"| {v} | {p['median_ms'][v]:.1f} | {p['time_ratio_to_value_and_grad'][v]:.2f} | "
                f"{m['temp_mb']:.1f} | {p['temp_ratio_to_value_and_grad'][v]:.2f} | {m['peak_mb']:.1f} |"
            )
        note = "; ".join(p["fallback_warnings"]) or "none"
        lines.append(
            f"\n- norms agree with vmap(grad)'s to {p['norms_max_rel_diff_vs_vmap_grad']:.1e} (relative); "
            f"fallback warnings: {note}"
        )
    if res["trace"]:
        lines += ["\n**Trace-time matching: plain transformer LM, blocks unrolled (Python loop)**\n",
                  "| blocks | equations (nested included) | matched layers | make_jaxpr (ms) "
                  "| make_jaxpr + rewrite (ms) | ratio | rewrite alone (ms) | rewrite per equation (µs) |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for t in res["trace"]:
        m = t["median_s"]
        lines.append(
            f"| {t['blocks']} | {t['equations']} | {t['matched_layers']} | {1e3 * m['make_jaxpr']:.1f} | "
            f"{1e3 * m['make_jaxpr + rewrite']:.1f} | {t['ratio_with_rewrite']:.2f} | "
            f"{1e3 * m['rewrite']:.1f} | {t['rewrite_us_per_equation']:.2f} |"
        )
    lines.append("")
    for t in res["targets"]:
        lines.append(f"- {t['target']}: {t['value']:.3f} ({_mark(t['met'])})")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 2 steps, small sizes (a smoke run)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--block", type=int, default=20, help="steps per timed block")
    parser.add_argument("--pex-rounds", type=int, default=5, help="timed rounds of one call each")
    parser.add_argument("--pex-seq", type=int, default=128)
    parser.add_argument("--pex-d", type=int, default=512)
    parser.add_argument("--pex-ff", type=int, default=2048)
    parser.add_argument("--pex-heads", type=int, default=8)
    parser.add_argument("--pex-batch", type=int, default=32)
    parser.add_argument("--trace-repeats", type=int, default=7)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    parser.add_argument("--out", default=str(HERE / "plain_results.json"))
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - set(PARTS):
        parser.error(f"unknown part(s) {sorted(set(parts) - set(PARTS))}; choose from {PARTS}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    size = (args.pex_seq, args.pex_d, args.pex_ff, args.pex_heads, args.pex_batch)
    res = run(args.quick, args.rounds, args.block, args.pex_rounds, size, args.trace_repeats, parts=parts)
    res["meta"] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "load_average_at_start": load,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
    }
    pathlib.Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(
        f"{res['meta']['date']} | {res['meta']['machine']} | load {load or 0:.2f} | jax {jax.__version__} "
        f"| {res['rounds']} rounds of {res['block']} steps | parts: {', '.join(parts)} "
        f"| {res['wall_s']:.0f} s"
    )
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
