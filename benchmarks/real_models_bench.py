"""Per-example gradient norms on real-model structures (issue 31, item 7).

Three models written in plain ``jnp`` / ``lax`` on a dict of arrays (no layer library), each
under its mean softmax cross-entropy (``optax.softmax_cross_entropy_with_integer_labels``):

* **gpt2**: a GPT-2-shaped language model: vocabulary 50,257, d=256, 4 pre-norm blocks under
  ``lax.scan`` over stacked weights (``jnp`` layer norms, einsum causal attention with 4 heads,
  GELU MLP of width 4d whose output projection's bias is written ``x + h @ W + b``), a learned
  positional table, the token embedding tied to the head (``h @ params["embed"].T``), T=128,
  batch 8, mean next-token cross-entropy. Parameters, layer norm and attention are
  ``examples/plain_jax.py``'s; the block and the model are written here (no embedding scale).
* **vit**: a ViT-shaped classifier: 32x32x3 images, a patch embedding by a strided
  ``lax.conv_general_dilated`` (NHWC/HWIO, 4x4 patches, stride 4: 64 tokens), a class token and a
  learned positional table, 4 pre-norm blocks (d=192, 3 heads, MLP 768) under ``lax.scan``, a
  final layer norm, the class token's dense head (10 classes), batch 32.
* **resnet**: a ResNet-shaped CNN without batch norm (each example's forward is its own): a
  3x3 stem (32 channels), then stages of widths 32, 64 and 128, each a residual block of two 3x3
  convs with group norm (8 groups, ``jnp``) and ReLU, the 64 and 128 stages entered by a
  stride-2 conv and a stride-2 1x1 projection on the shortcut; global average pool, dense head
  (10 classes), 32x32x3 images, batch 32.

Rows, each ``jax.jit``-compiled once (``.lower(*args).compile()``) and called compiled:
``value_and_grad`` (the reference: what the per-example call also returns, the loss and the
batch gradient), ``vk.inspect.per_example_grad_norms`` (default ``check=True``), the same with
``check=False``, ``vmap(grad) + norms`` (``jax.vmap(jax.grad)`` over the examples, then the
norms) and ``vk.value_and_grad`` capturing every matched layer's norms
(``capture=vk.capture("*", fields=["grad_output", "grad_input", "grad_params"],
reduce="norm")``), and ``value_and_grad`` with a host callback in a ``lax.cond`` branch never
taken (what ``check=True``'s warning adds to the program, alone: no target). Time: interleaved,
shuffled rounds over small blocks of calls after a warm-up, medians of the per-round ratios to
``value_and_grad``. Memory: XLA's ``memory_analysis().temp_size_in_bytes`` of each compiled
function; the number of fusions in its optimized HLO beside it. Targets (judged, never
asserted): per-example norms (``check=True``) <= 1.3x time and <= 1.5x temp memory; capture <=
1.10x time. Also: the largest relative difference of vjpkit's total norms from ``vmap(grad)``'s,
and every ``UserWarning`` raised while each row is traced, compiled and called (vjpkit's
fallback warnings name the layers that left the fast paths): in the JSON and the printed table.

Usage: ``python benchmarks/real_models_bench.py [--quick] [--rounds 7] [--models gpt2,vit,resnet]
[--out benchmarks/real_models_results.json]``. ``run.py`` runs it too (``--no-real-models``
skips it) and keeps the result under ``"real_models"``. ``--quick`` uses tiny sizes (seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import statistics
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.append(str(ROOT / "examples"))  # last: nothing there shadows benchmarks/ or the packages

import peers  # noqa: E402
import plain_jax  # noqa: E402  (examples/plain_jax.py: params, layer norm, attention)
from peers import cpu_times, other_cpu_share  # noqa: E402

import vjpkit as vk  # noqa: E402

VAG = "value_and_grad"
PEX = "vk.inspect.per_example_grad_norms"
PEX_NO_CHECK = "vk.inspect.per_example_grad_norms, check=False"
VMAP = "vmap(grad) + norms"
CAPTURE = "vk.value_and_grad capture every layer's norms"
IDLE_CALLBACK = "value_and_grad + a host callback never called"
ROWS = (VAG, PEX, PEX_NO_CHECK, VMAP, CAPTURE, IDLE_CALLBACK)
TARGET_PEX_TIME, TARGET_PEX_TEMP, TARGET_CAPTURE_TIME = 1.3, 1.5, 1.10
MODELS = ("gpt2", "vit", "resnet")
WARMUP = 2

SIZES = {
    "gpt2": dict(vocab=50257, d=256, blocks=4, heads=4, seq=128, batch=8),
    "vit": dict(image=32, patch=4, d=192, blocks=4, heads=3, batch=32, classes=10),
    "resnet": dict(image=32, widths=(32, 64, 128), groups=8, batch=32, classes=10),
}
QUICK_SIZES = {
    "gpt2": dict(vocab=257, d=32, blocks=2, heads=4, seq=16, batch=4),
    "vit": dict(image=16, patch=4, d=32, blocks=2, heads=2, batch=4, classes=10),
    "resnet": dict(image=16, widths=(8, 16, 32), groups=4, batch=4, classes=10),
}
BLOCK = {"gpt2": 1, "vit": 2, "resnet": 2}  # calls per timed block (full size)


# --- GPT-2-shaped LM ---------------------------------------------------------------------------


def gpt2_block(x, p, heads):
    """Pre-norm block; the MLP's output projection is ``x + h @ W + b`` (residual, then bias)."""
    x = x + plain_jax.attention(plain_jax.layer_norm(x, p["ln1"]), p["attn"], heads)
    h = jax.nn.gelu(plain_jax.layer_norm(x, p["ln2"]) @ p["mlp"]["fc"]["w"] + p["mlp"]["fc"]["b"])
    return x + h @ p["mlp"]["proj"]["w"] + p["mlp"]["proj"]["b"]


def gpt2_apply(params, tokens, heads):
    x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
    x, _ = lax.scan(lambda h, p: (gpt2_block(h, p, heads), None), x, params["blocks"])
    return plain_jax.layer_norm(x, params["ln_f"]) @ params["embed"].T  # tied head


def gpt2(c):
    params = plain_jax.init_params(jax.random.key(0), c["vocab"], c["d"], c["blocks"], c["seq"])
    tok = jax.random.randint(jax.random.key(1), (c["batch"], c["seq"] + 1), 0, c["vocab"])

    def loss(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(gpt2_apply(p, x, c["heads"]), y).mean()

    title = (
        f"GPT-2-shaped LM: vocab {c['vocab']:,}, d={c['d']}, {c['blocks']} blocks under lax.scan, "
        f"{c['heads']} heads, MLP {4 * c['d']}, tied head, T={c['seq']}, batch {c['batch']}"
    )
    return title, loss, params, (tok[:, :-1], tok[:, 1:])


# --- ViT-shaped classifier ---------------------------------------------------------------------


def _normal(key, shape, fan_in):
    return jax.random.normal(key, shape) / np.sqrt(fan_in)


def _norm(d, *lead):
    return {"scale": jnp.ones((*lead, d)), "bias": jnp.zeros((*lead, d))}


def vit_params(key, c):
    d, n, p = c["d"], c["blocks"], c["patch"]
    tokens = (c["image"] // p) ** 2 + 1
    ks = iter(jax.random.split(key, 12))
    return {
        "patch": {"w": _normal(next(ks), (p, p, 3, d), p * p * 3), "b": jnp.zeros(d)},
        "cls": 0.02 * jax.random.normal(next(ks), (1, 1, d)),
        "pos": 0.02 * jax.random.normal(next(ks), (tokens, d)),
        "blocks": {
            "ln1": _norm(d, n),
            "attn": {name: _normal(next(ks), (n, d, d), d) for name in ("q", "k", "v", "o")},
            "ln2": _norm(d, n),
            "mlp": {
                "fc": {"w": _normal(next(ks), (n, d, 4 * d), d), "b": jnp.zeros((n, 4 * d))},
                "proj": {"w": _normal(next(ks), (n, 4 * d, d), 4 * d), "b": jnp.zeros((n, d))},
            },
        },
        "ln_f": _norm(d),
        "head": {"w": _normal(next(ks), (d, c["classes"]), d), "b": jnp.zeros(c["classes"])},
    }


def vit_block(x, p, heads):
    x = x + plain_jax.attention(plain_jax.layer_norm(x, p["ln1"]), p["attn"], heads)
    h = jax.nn.gelu(plain_jax.layer_norm(x, p["ln2"]) @ p["mlp"]["fc"]["w"] + p["mlp"]["fc"]["b"])
    return x + h @ p["mlp"]["proj"]["w"] + p["mlp"]["proj"]["b"]


def vit_apply(params, images, patch, heads):
    x = lax.conv_general_dilated(
        images, params["patch"]["w"], (patch, patch), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    x = x + params["patch"]["b"]
    b, h, w, d = x.shape
    x = x.reshape(b, h * w, d)
    cls = jnp.broadcast_to(params["cls"], (b, 1, d))
    x = jnp.concatenate([cls, x], axis=1) + params["pos"]
    x, _ = lax.scan(lambda h, p: (vit_block(h, p, heads), None), x, params["blocks"])
    return plain_jax.layer_norm(x[:, 0], params["ln_f"]) @ params["head"]["w"] + params["head"]["b"]


def vit(c):
    params = vit_params(jax.random.key(0), c)
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (c["batch"], c["image"], c["image"], 3))
    y = jax.random.randint(ky, (c["batch"],), 0, c["classes"])

    def loss(p, x, y):
        logits = vit_apply(p, x, c["patch"], c["heads"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    tokens = (c["image"] // c["patch"]) ** 2
    title = (
        f"ViT-shaped: {c['image']}x{c['image']}x3, patch {c['patch']} (strided conv, {tokens} tokens + class "
        f"token), d={c['d']}, {c['blocks']} blocks under lax.scan, {c['heads']} heads, batch {c['batch']}, "
        f"{c['classes']} classes"
    )
    return title, loss, params, (x, y)


# --- ResNet-shaped CNN -------------------------------------------------------------------------

DN = ("NHWC", "HWIO", "NHWC")


def conv(x, w, stride=1):
    return lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=DN)


def group_norm(x, p, groups):
    b, h, w, ch = x.shape
    g = x.reshape(b, h, w, groups, ch // groups)
    mu = g.mean((1, 2, 4), keepdims=True)
    var = jnp.square(g - mu).mean((1, 2, 4), keepdims=True)
    g = (g - mu) * lax.rsqrt(var + 1e-5)
    return g.reshape(b, h, w, ch) * p["scale"] + p["bias"]


def resnet_params(key, c):
    ks = iter(jax.random.split(key, 16))
    widths = c["widths"]

    def kernel(k, cin, cout):
        return _normal(next(ks), (k, k, cin, cout), k * k * cin)

    params = {"stem": {"w": kernel(3, 3, widths[0])}, "stem_gn": _norm(widths[0])}
    cin = widths[0]
    for i, width in enumerate(widths):
        stage = {
            "conv1": {"w": kernel(3, cin, width)},
            "gn1": _norm(width),
            "conv2": {"w": kernel(3, width, width)},
            "gn2": _norm(width),
        }
        if width != cin:
            stage["proj"] = {"w": kernel(1, cin, width)}
        params[f"stage{i + 1}"] = stage
        cin = width
    params["head"] = {"w": _normal(next(ks), (cin, c["classes"]), cin), "b": jnp.zeros(c["classes"])}
    return params


def resnet_apply(params, x, groups):
    x = jax.nn.relu(group_norm(conv(x, params["stem"]["w"]), params["stem_gn"], groups))
    i = 1
    while f"stage{i}" in params:
        p = params[f"stage{i}"]
        stride = 2 if "proj" in p else 1
        h = jax.nn.relu(group_norm(conv(x, p["conv1"]["w"], stride), p["gn1"], groups))
        h = group_norm(conv(h, p["conv2"]["w"]), p["gn2"], groups)
        shortcut = conv(x, p["proj"]["w"], stride) if "proj" in p else x
        x = jax.nn.relu(shortcut + h)
        i += 1
    return x.mean((1, 2)) @ params["head"]["w"] + params["head"]["b"]  # global average pool


def resnet(c):
    params = resnet_params(jax.random.key(0), c)
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (c["batch"], c["image"], c["image"], 3))
    y = jax.random.randint(ky, (c["batch"],), 0, c["classes"])

    def loss(p, x, y):
        logits = resnet_apply(p, x, c["groups"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    title = (
        f"ResNet-shaped CNN: {c['image']}x{c['image']}x3, widths {'-'.join(map(str, c['widths']))}, "
        f"stride-2 convs, group norm ({c['groups']} groups), residual adds, global average pool, "
        f"batch {c['batch']}, {c['classes']} classes"
    )
    return title, loss, params, (x, y)


BUILD = {"gpt2": gpt2, "vit": vit, "resnet": resnet}


# --- the rows ----------------------------------------------------------------------------------


def vmap_grad_norms(loss):
    """``jax.vmap(jax.grad)`` of the loss on one example, then each example's total norm."""

    def naive(p, x, y):
        def single(p, xi, yi):
            return loss(p, xi[None], yi[None])

        grads = jax.vmap(jax.grad(single), in_axes=(None, 0, 0))(p, x, y)
        sq = [jnp.sum(jnp.square(g.reshape(g.shape[0], -1)), axis=1) for g in jax.tree.leaves(grads)]
        return jnp.sqrt(sum(sq))

    return naive


def row_fns(loss):
    norms = vk.capture("*", fields=["grad_output", "grad_input", "grad_params"], reduce="norm")
    return {
        VAG: jax.jit(jax.value_and_grad(loss)),
        PEX: jax.jit(vk.inspect.per_example_grad_norms(loss)),
        PEX_NO_CHECK: jax.jit(vk.inspect.per_example_grad_norms(loss, check=False)),
        VMAP: jax.jit(vmap_grad_norms(loss)),
        CAPTURE: jax.jit(vk.value_and_grad(loss, capture=norms)),
        IDLE_CALLBACK: jax.jit(idle_callback(jax.value_and_grad(loss))),
    }


def idle_callback(fn):
    """``fn`` with a ``jax.debug.callback`` in a ``lax.cond`` branch never taken, as
    ``check=True`` warns: what a host callback's presence alone costs a step (no target)."""

    def wrapped(*args):
        value, grads = fn(*args)
        lax.cond(jnp.isnan(value), lambda v: jax.debug.callback(lambda v: None, v), lambda v: None, value)
        return value, grads

    return wrapped


def _warning(w, phase):
    return {
        "phase": phase,
        "category": w.category.__name__,
        "source": f"{pathlib.Path(w.filename).name}:{w.lineno}",
        "message": str(w.message),
    }


def _ratio(a, b):
    """Median over rounds of the per-round ratio."""
    return statistics.median(x / y for x, y in zip(a, b))


def _target(text, value, limit):
    return {"target": text, "value": value, "limit": limit, "met": value <= limit}


def _rel_diff(ours, ref):
    return float(jnp.max(jnp.abs(ours - ref) / jnp.abs(ref)))


def bench_model(key, rounds, rng, quick):
    size = (QUICK_SIZES if quick else SIZES)[key]
    title, loss, params, batch = BUILD[key](size)
    args = (params, *batch)
    block = 1 if quick else BLOCK[key]
    fns = row_fns(loss)
    compiled, memory, compile_s, first_s, outs, fusions = {}, {}, {}, {}, {}, {}
    caught = {}
    order = list(ROWS)
    rng.shuffle(order)
    for v in order:  # trace + compile, then the first call: every warning kept, per row
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            compiled[v] = fns[v].lower(*args).compile()
            compile_s[v] = time.perf_counter() - t0
            t0 = time.perf_counter()
            outs[v] = jax.block_until_ready(compiled[v](*args))
            first_s[v] = time.perf_counter() - t0
            jax.effects_barrier()
        caught[v] = [_warning(w, "trace, compile and first call") for w in ws]
        memory[v] = peers.xla_memory(compiled[v])
        fusions[v] = compiled[v].as_text().count(" fusion(")
    ref = outs[VMAP]
    agreement = {
        PEX: _rel_diff(outs[PEX][2].total, ref),
        PEX_NO_CHECK: _rel_diff(outs[PEX_NO_CHECK][2].total, ref),
    }
    loss_diff = {v: abs(float(outs[v][0]) - float(outs[VAG][0])) for v in (PEX, PEX_NO_CHECK)}
    loss_diff[CAPTURE] = abs(float(outs[CAPTURE][0][0]) - float(outs[VAG][0]))
    pex_layers = sorted(outs[PEX][2].layers)
    captured_layers = sorted(outs[CAPTURE][1])
    del outs
    times = {v: [] for v in ROWS}
    with warnings.catch_warnings(record=True) as ws:  # the check's host callback warns at run time
        warnings.simplefilter("always")
        for v in ROWS:
            for _ in range(WARMUP):
                jax.block_until_ready(compiled[v](*args))
        for _ in range(rounds):
            rng.shuffle(order)
            for v in order:
                start = time.perf_counter()
                for _ in range(block):
                    out = compiled[v](*args)
                jax.block_until_ready(out)
                times[v].append((time.perf_counter() - start) / block)
        jax.effects_barrier()
    timed_warnings = [_warning(w, "timed calls") for w in ws]
    unique_timed = []
    for w in timed_warnings:  # the same warning every call: once, with its count
        for u in unique_timed:
            if (u["category"], u["message"]) == (w["category"], w["message"]):
                u["count"] += 1
                break
        else:
            unique_timed.append({**w, "count": 1})
    temp = {v: memory[v]["temp_mb"] for v in ROWS}
    time_ratio = {v: _ratio(times[v], times[VAG]) for v in ROWS}
    temp_ratio = {v: temp[v] / temp[VAG] if temp[VAG] else None for v in ROWS}
    short = key
    targets = [
        _target(f"{short}: {PEX} / {VAG} time <= {TARGET_PEX_TIME}", time_ratio[PEX], TARGET_PEX_TIME),
        _target(f"{short}: {PEX} / {VAG} XLA temp memory <= {TARGET_PEX_TEMP}", temp_ratio[PEX],
                TARGET_PEX_TEMP),
        _target(f"{short}: {CAPTURE} / {VAG} time <= {TARGET_CAPTURE_TIME}", time_ratio[CAPTURE],
                TARGET_CAPTURE_TIME),
    ]  # fmt: skip
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    return {
        "model": key,
        "title": title,
        "size": {k: list(v) if isinstance(v, tuple) else v for k, v in size.items()},
        "parameters": n_params,
        "rounds": rounds,
        "block": block,
        "rows": [
            {
                "variant": v,
                "median_ms": 1e3 * statistics.median(times[v]),
                "time_ratio": time_ratio[v],
                "temp_mb": temp[v],
                "temp_ratio": temp_ratio[v],
                "memory": memory[v],
                "compile_s": compile_s[v],
                "xla_fusions": fusions[v],
                "first_call_s": first_s[v],
                "warnings": caught[v],
                "call_s_per_round": times[v],
            }
            for v in ROWS
        ],
        "norms_max_rel_diff_vs_vmap_grad": agreement,
        "loss_abs_diff_vs_value_and_grad": loss_diff,
        "per_example_layers": pex_layers,
        "captured_layers": captured_layers,
        "timed_call_warnings": unique_timed,
        "targets": targets,
    }


def git_commit():
    """``(short commit, files under vjpkit/ that differ from it, the repository)`` of the vjpkit
    this process imported (``PYTHONPATH`` can point at another checkout), or Nones."""
    repo = pathlib.Path(vk.__file__).resolve().parents[1]

    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=repo, capture_output=True, text=True, check=True).stdout

    try:
        head = git("rev-parse", "--short", "HEAD").strip()
        dirty = git("status", "--porcelain", "--", "vjpkit").splitlines()
    except (OSError, subprocess.CalledProcessError):
        return None, None, str(repo)
    return head, [line[3:] for line in dirty], str(repo)


def run(quick=False, models=MODELS, rounds=7) -> dict:
    """The three models' rows (or those in ``models``); ``quick``: tiny sizes, 2 rounds."""
    if quick:
        rounds = 2
    rng = random.Random(0)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    commit, dirty, repo = git_commit()
    date = time.strftime("%Y-%m-%d %H:%M")
    start, cpu_before = time.perf_counter(), cpu_times()
    results = [bench_model(key, rounds, rng, quick) for key in models]
    other = other_cpu_share(cpu_before, cpu_times())
    return {
        "title": "Per-example gradient norms on real-model structures",
        "quick": quick,
        "models": list(models),
        "rounds": rounds,
        "results": results,
        "targets": [t for r in results for t in r["targets"]],
        "wall_s": time.perf_counter() - start,
        "meta": {
            "date": date,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
            "load_average_at_start": load,
            "other_cpu_share": other,
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "commit": commit,
            "vjpkit_uncommitted": dirty,
            "vjpkit_repository": repo,
        },
    }


def _mark(met):
    return "met" if met else "NOT met"


def _warning_lines(r):
    """Every warning of a model's rows, once each, with the rows that raised it."""
    seen = {}
    for row in r["rows"]:
        for w in row["warnings"]:
            seen.setdefault((w["category"], w["message"]), []).append(row["variant"])
    for w in r["timed_call_warnings"]:
        seen.setdefault((w["category"], w["message"]), []).append(f"timed calls (x{w['count']})")
    return [
        f"  - {cat} [{', '.join(rows)}]: " + " ".join(msg.split())
        for (cat, msg), rows in seen.items()
    ]  # fmt: skip


def markdown(res: dict) -> str:
    lines = []
    for r in res["results"]:
        lines += [f"\n**{r['title']}** ({r['parameters']:,} parameters; {r['rounds']} rounds of {r['block']} "
                  "call(s))\n",
                  "| variant | median call (ms) | time / value_and_grad | XLA temp (MB) "
                  "| temp / value_and_grad | XLA fusions | warnings |",
                  "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for row in r["rows"]:
            tr = "—" if row["temp_ratio"] is None else f"{row['temp_ratio']:.2f}"
            lines.append(
                f"| {row['variant']} | {row['median_ms']:.1f} | {row['time_ratio']:.2f} | "
                f"{row['temp_mb']:.1f} | {tr} | {row['xla_fusions']} | {len(row['warnings'])} |"
            )
        agree = r["norms_max_rel_diff_vs_vmap_grad"]
        lines.append(
            f"\n- total norms against vmap(grad)'s, largest relative difference: {agree[PEX]:.1e} "
            f"(check=False: {agree[PEX_NO_CHECK]:.1e})"
        )
        warned = _warning_lines(r)
        lines.append("- warnings:" + (" none" if not warned else ""))
        lines += warned
    lines.append("")
    for t in res["targets"]:
        lines.append(f"- {t['target']}: {t['value']:.3f} ({_mark(t['met'])})")
    return "\n".join(lines)


def _cell(value, limit):
    if limit is None:
        return f"{value:.2f}"
    return f"{value:.2f} ✓" if value <= limit else f"**{value:.2f} ✗**"


def _busy(meta):
    share = meta.get("other_cpu_share")
    return "" if share is None else f" | other processes used {100 * share:.0f}% of the CPU meanwhile"


def docs_table(res: dict) -> str:
    """``docs/performance.md``'s table (between its ``run.py:real-models-table`` markers)."""
    m = res["meta"]
    commit = m["commit"] or "unknown commit"
    if m["vjpkit_uncommitted"]:
        commit += f" (with uncommitted changes to {', '.join(m['vjpkit_uncommitted'])})"
    lines = [
        f"Measured {m['date']} | {m['machine']} | load {m['load_average_at_start'] or 0:.2f} at the "
        f"start | jax {m['jax']} ({m['backend']}) | commit {commit} | {res['rounds']} rounds "
        f"| {res['wall_s']:.0f} s" + _busy(m) + ".",
        "",
        "Each cell: time / temp memory, as ratios to the model's `value_and_grad` (✓/✗ against the "
        "target in the row's label).",
        "",
        "| row | " + " | ".join(r["model"] for r in res["results"]) + " |",
        "|---|" + "---:|" * len(res["results"]),
    ]
    limits = {PEX: (TARGET_PEX_TIME, TARGET_PEX_TEMP), CAPTURE: (TARGET_CAPTURE_TIME, None)}
    for v in ROWS:
        t_lim, m_lim = limits.get(v, (None, None))
        label = v
        if v == PEX:
            label += f" (≤ {TARGET_PEX_TIME} / ≤ {TARGET_PEX_TEMP})"
        elif v == CAPTURE:
            label += f" (≤ {TARGET_CAPTURE_TIME:.2f} time)"
        cells = []
        for r in res["results"]:
            row = next(x for x in r["rows"] if x["variant"] == v)
            if v == VAG:
                cells.append(f"{row['median_ms']:.1f} ms, {row['temp_mb']:.1f} MB")
            else:
                cells.append(f"{_cell(row['time_ratio'], t_lim)} / {_cell(row['temp_ratio'], m_lim)}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    agree = [f"{r['norms_max_rel_diff_vs_vmap_grad'][PEX]:.1e}" for r in res["results"]]
    lines.append("| total norms: largest relative difference from vmap(grad)'s | " + " | ".join(agree) + " |")
    lines.append("")
    for r in res["results"]:
        warned = _warning_lines(r)
        lines.append(f"- **{r['model']}** warnings:" + (" none" if not warned else ""))
        lines += warned
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds of 1 call (a smoke run)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {MODELS}")
    parser.add_argument("--out", default=str(HERE / "real_models_results.json"))
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    if set(models) - set(MODELS):
        parser.error(f"unknown model(s) {sorted(set(models) - set(MODELS))}; choose from {MODELS}")
    res = run(args.quick, models, args.rounds)
    pathlib.Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    m = res["meta"]
    print(
        f"{m['date']} | {m['machine']} | load {m['load_average_at_start'] or 0:.2f} | jax {m['jax']} "
        f"| commit {m['commit']} | {res['rounds']} rounds | {res['wall_s']:.0f} s" + _busy(m)
    )
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
