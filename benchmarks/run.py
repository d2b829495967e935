"""Side-by-side step-time benchmark: vjpkit variants against raw JAX and peer frameworks, in one run.

Each variant is a training step (SGD, lr 0.01, momentum 0.9, softmax cross-entropy) on the same
model, initial weights and data. The JAX variants (raw JAX, vjpkit, Flax NNX, Equinox) are
jitted and run in this process; PyTorch runs eagerly in a worker subprocess (``peers.py``).
Timing uses interleaved rounds: every round times each variant (in a shuffled order) over a
block of steps, and the reported figure is the median over rounds of the per-step time. Ratios
are medians of the per-round ratios, so slow drifts of the machine cancel out. It also runs
``per_example_bench.py``'s comparison of per-example gradient norms (``--no-per-example``
skips it), ``eager_bench.py``'s eager-call comparison (eager hooked ``vk.grad`` against eager
``jax.grad``, inner-jit traces, memory growth; ``--no-eager`` skips it), and ``host_bench.py``'s
host delivery (per-layer ``vk.on_host`` hooks, ``every=100``, ``fit`` with ``on_records`` every
step; ``--no-host`` skips it),
``quickstart_bench.py``'s peak memory of the quickstart with and without its hooks
(``--no-quickstart`` skips it), and ``plain_bench.py``'s plain-JAX models through vjpkit's
matching (steps, per-example norms of a transformer block, trace-time matching; ``--no-plain``
skips it, ``--plain-parts`` picks some), and ``curvature_bench.py``'s curvature statistics and
K-FAC updates against a gradient step (``--no-curvature`` skips it; ``--no-kfac-jax`` only its
kfac-jax part), and ``real_models_bench.py``'s per-example gradient norms on a GPT-2-, a ViT- and
a ResNet-shaped plain-JAX model (``--no-real-models`` skips it). The wall time of each part is in
the JSON's ``meta["part_s"]``.

Usage: ``python benchmarks/run.py [--quick] [--models cnn,mlp_small] [--rounds 15] [--block 20]
[--compile-repeats 3] [--peers flax,equinox,torch] [--only-first-call] [--no-per-example]
[--no-eager] [--no-host] [--no-quickstart] [--no-plain] [--plain-parts steps,per_example,trace]
[--no-curvature] [--no-kfac-jax] [--no-real-models] [--out PATH] [--write-docs]``. What the rows,
columns and memory figures are: ``benchmarks/README.md``. ``--write-docs`` also rewrites the
step-time table of ``docs/performance.md`` (between its ``run.py:step-table`` markers) from the
run's results, and its real-model per-example table (between its ``run.py:real-models-table``
markers) unless ``--no-real-models``.
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
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import curvature_bench
import eager_bench
import peers
import plain_bench
import quickstart_bench
import real_models_bench
from models import EXTRA_RAW, MODELS, data, loss_of, probed_norms_loss
from peers import cpu_times, other_cpu_share

import vjpkit as vk

HERE = pathlib.Path(__file__).resolve().parent
RAW = "raw JAX"
NO_HOOKS, CAPTURE = "vjpkit, no hooks", "vjpkit, capture norms"
HOST, HOOK = "vjpkit, capture + host every step", "vjpkit, traced modifying hook on every layer"
VJPKIT_ROWS = (NO_HOOKS, CAPTURE, HOST, HOOK)
# The capture row's norms written in raw JAX (zero probes, models.probed_norms_loss): what the
# same numbers cost without vjpkit, the floor of the capture row's first call and step.
BY_HAND = "raw JAX, the same norms by hand (zero probes)"
TORCH_HOOKS = peers.TORCH_ROWS[1]
WARMUP = 3


def clip_layer_grads(rec):
    """The traced hook of the modifying row: clips each layer's parameter gradient to norm 1."""
    if not rec.grad_params:  # relu, pool, flatten: nothing to clip
        return None
    scale = jnp.minimum(1.0, 1.0 / (optax.global_norm(rec.grad_params) + 1e-6))
    return rec.replace(grad_params=jax.tree.map(lambda g: g * scale, rec.grad_params))


def jax_variants(key, model, raw_apply, x, y):
    """raw JAX and the vjpkit rows: name -> JaxVariant, plus the initial params."""
    params = model.init(jax.random.key(0), x)
    opt = optax.sgd(peers.LR, momentum=peers.MOMENTUM)
    vk_loss = loss_of(model.apply)
    fields = ["grad_output", "grad_input", "grad_params"]
    norms = vk.capture("*", fields=fields, reduce="norm")
    delivered = []

    def keep_last(records):  # the host callback: keeps the latest step's norms
        delivered[:] = [records]

    host = vk.capture("*", fields=fields, reduce="norm", host=vk.on_host(keep_last))

    def sgd(value_and_grad, with_capture):
        def step(carry, x, y):
            p, s = carry
            out = value_and_grad(p, x, y)
            (loss, grads), extra = (out[0], out[1]) if with_capture else (out, None)
            updates, s = opt.update(grads, s, p)
            return (optax.apply_updates(p, updates), s), loss, extra

        return jax.jit(step)

    steps = {RAW: sgd(jax.value_and_grad(loss_of(raw_apply)), False)}
    for name, extra_raw in EXTRA_RAW.get(key, {}).items():
        steps[name] = sgd(jax.value_and_grad(loss_of(extra_raw)), False)
    steps[BY_HAND] = sgd(probed_norms_loss(raw_apply), True)
    steps[NO_HOOKS] = sgd(vk.value_and_grad(vk_loss), False)
    steps[CAPTURE] = sgd(vk.value_and_grad(vk_loss, capture=norms), True)
    steps[HOST] = sgd(vk.value_and_grad(vk_loss, capture=host), True)
    steps[HOOK] = sgd(vk.value_and_grad(vk_loss, hooks={"*": clip_layer_grads}), False)
    carry = (params, opt.init(params))
    variants = {}
    for name, step in steps.items():
        variants[name] = peers.JaxVariant(step, carry, x, y, None)
        variants[name].lower = lambda step=step: step.lower(carry, x, y)
        variants[name].trace = lambda step=step: step.trace(carry, x, y)
    return variants, params


def jax_peer_variants(key, params, x, y, selected):
    """The Flax NNX and Equinox rows (``peers.peer_rows``): name -> JaxVariant, or a 'skipped: ...' string."""
    out = {}
    for peer, build in (("flax", peers.flax_variants), ("equinox", peers.equinox_variants)):
        rows = peers.peer_rows(peer, key)
        if peer not in selected:
            out.update(dict.fromkeys(rows, "skipped: not in --peers"))
            continue
        try:
            out.update(build(key, params, x, y))
        except ImportError as err:
            out.update(dict.fromkeys(rows, f"skipped: {type(err).__name__}: {err}"))
    return out


def torch_peer_variants(key, params, x, y, selected, torch_client, tmpdir):
    """The PyTorch rows: name -> TorchVariant (set up in the worker), or a 'skipped: ...' string."""
    rows = peers.TORCH_ROWS
    if "torch" not in selected:
        return dict.fromkeys(rows, "skipped: not in --peers")
    hello = torch_client.hello()
    if not hello["ok"]:
        return dict.fromkeys(rows, f"skipped: {hello['error']}")
    return peers.torch_variants(torch_client, key, params, x, y, tmpdir)


def bench_model(key, rounds, block, selected, torch_client, tmpdir, compile_repeats=1, only_first_call=False):
    """One model's rows, targets and first calls; ``only_first_call``: no step timing, memory or PyTorch."""
    title, model, raw_apply, shape, classes = MODELS[key]()
    x, y = data(shape, classes)
    rng = random.Random(0)
    firsts, stages, loss0 = {}, {}, {}
    for _ in range(compile_repeats):  # first calls, each time from empty caches, in a shuffled order
        jax.clear_caches()
        variants, params = jax_variants(key, model, raw_apply, x, y)
        variants.update(jax_peer_variants(key, params, x, y, selected))
        order = [n for n, v in variants.items() if not isinstance(v, str)]
        rng.shuffle(order)
        for name in order:
            t, loss0[name] = variants[name].first_call()
            firsts.setdefault(name, []).append(t)
        # The same compilation in stages (trace, lower, XLA compile) of the rows built here (their
        # steps are ``jax.jit``s), on fresh step functions, each from empty caches: the first
        # trace after ``jax.clear_caches()`` also re-traces the jitted library helpers that the
        # steps share (``jax.nn.relu``, optax's, ...), which would otherwise land on one row.
        staged, _ = jax_variants(key, model, raw_apply, x, y)
        order = list(staged)
        rng.shuffle(order)
        for name in order:
            jax.clear_caches()
            stages.setdefault(name, []).append(staged[name].staged_first_call())
    if only_first_call:
        variants.update(dict.fromkeys(peers.TORCH_ROWS, "skipped: --only-first-call"))
    else:
        variants.update(torch_peer_variants(key, params, x, y, selected, torch_client, tmpdir))
    live = {n: v for n, v in variants.items() if not isinstance(v, str)}
    memory = {}
    for name, v in live.items():
        if isinstance(v, peers.TorchVariant):
            firsts[name] = [v.info["first_call_s"]]
            loss0[name], memory[name] = v.info["first_loss"], v.info["memory"]
        elif not only_first_call:
            v.warm_up(WARMUP)
            memory[name] = v.memory()
    first = {name: statistics.median(f) for name, f in firsts.items()}
    times = None if only_first_call else {name: [] for name in live}
    order = list(live)
    for _ in range(0 if only_first_call else rounds):
        rng.shuffle(order)
        for name in order:
            times[name].append(live[name].time(block))
    rows = []
    for name, v in variants.items():
        if isinstance(v, str):
            rows.append({"variant": name, "status": v})
            continue
        timed = times is not None
        rows.append(
            {
                "variant": name,
                "status": "ok",
                "median_step_us": 1e6 * statistics.median(times[name]) if timed else None,
                "ratio_to_raw": ratio(times, name, RAW) if timed else None,
                "first_call_s": first[name],
                "compile_ratio": compile_ratio(firsts, name),
                "first_call_split": first_call_split(stages, name),
                "peak_memory_mb": memory[name]["peak_mb"] if name in memory else None,
                "memory": memory.get(name),
                "first_loss": loss0[name],
                "step_s_per_round": times[name] if timed else None,
                "first_call_s_samples": firsts[name],
            }
        )
    result = {"model": key, "title": title, "rows": rows}
    compile_ratios = {r["variant"]: r["compile_ratio"] for r in rows if r["status"] == "ok"}
    result["targets"] = targets(times, compile_ratios)
    result["first_call_split_info"] = split_info(rows)
    result["by_hand"] = {
        "first_call_ratio_to_raw": compile_ratios[BY_HAND],
        "capture_first_call_over_by_hand": ratio(firsts, CAPTURE, BY_HAND),
        "capture_step_over_by_hand": ratio(times, CAPTURE, BY_HAND) if times is not None else None,
    }
    result["max_first_loss_diff"] = max(abs(loss0[n] - loss0[RAW]) for n in loss0)
    return result


STAGES = ("trace_s", "lower_s", "xla_compile_s", "total_s")


def first_call_split(stages, name):
    """A row's first call in stages (``JaxVariant.staged_first_call``): the medians of each part,
    their ratios to raw JAX's (medians of per-repeat ratios) and the samples; None if not staged.
    """
    if name not in stages:
        return None
    samples, raw = stages[name], stages[RAW]
    out = {part: statistics.median(s[part] for s in samples) for part in STAGES}
    for part in STAGES:
        ratio_key = part.removesuffix("_s") + "_ratio"
        out[ratio_key] = statistics.median(s[part] / r[part] for s, r in zip(samples, raw))
    out["samples"] = samples
    return out


def split_info(rows):
    """Informational lines (no target): each vjpkit row's trace time, engine included, against raw JAX's."""
    split = {r["variant"]: r["first_call_split"] for r in rows if r.get("first_call_split")}
    raw = split[RAW]
    return [
        {
            "variant": name,
            "trace_s": split[name]["trace_s"],
            "trace_over_raw_s": split[name]["trace_s"] - raw["trace_s"],
            "trace_ratio": split[name]["trace_ratio"],
            "lower_ratio": split[name]["lower_ratio"],
            "xla_compile_ratio": split[name]["xla_compile_ratio"],
        }
        for name in VJPKIT_ROWS
    ]


def compile_ratio(firsts, name):
    """First call / raw JAX's: the median of per-repeat ratios (PyTorch: one sample, to the median)."""
    if len(firsts[name]) == len(firsts[RAW]):
        return ratio(firsts, name, RAW)
    return statistics.median(firsts[name]) / statistics.median(firsts[RAW])


def ratio(times, a, b):
    """Median over rounds of the per-round ratio time(a) / time(b)."""
    return statistics.median(ta / tb for ta, tb in zip(times[a], times[b]))


def targets(times, compile_ratios):
    """The issue's targets, judged on this run's numbers (met is None when a peer was skipped).

    ``times`` is None when the steps were not timed (``--only-first-call``): first calls only.

    The Flax NNX and Equinox targets are judged against ``peers.PEER_ROWS``, whose CNN pools as
    vjpkit's does; ``peers.OWN_POOL_ROWS`` (their own ``reduce_window`` pool) have no target.
    """
    out = []

    def add(text, value, limit, against=None, strict=False):
        if against is not None and against not in (times or {}):
            out.append({"target": text, "value": None, "met": None, "note": f"{against} skipped"})
            return
        v = value()
        out.append({"target": text, "value": v, "met": v < limit if strict else v <= limit})

    if times is not None:
        add("vjpkit, no hooks / raw JAX <= 1.02", lambda: ratio(times, NO_HOOKS, RAW), 1.02)
        add("vjpkit, capture norms / raw JAX <= 1.10", lambda: ratio(times, CAPTURE, RAW), 1.10)
        add(
            f"vjpkit, capture norms / {TORCH_HOOKS} < 1",
            lambda: ratio(times, CAPTURE, TORCH_HOOKS),
            1.0,
            TORCH_HOOKS,
            strict=True,
        )
        for peer in (*peers.FLAX_ROWS, *peers.EQUINOX_ROWS):
            vs_peer = lambda peer=peer: ratio(times, NO_HOOKS, peer)
            add(f"vjpkit, no hooks / {peer} <= 1.0", vs_peer, 1.0, peer)
    for name in VJPKIT_ROWS:
        add(f"first call: {name} / raw JAX <= 1.3", lambda name=name: compile_ratios[name], 1.3)
    return out


def per_example(quick):
    """per_example_bench.py's comparison: its timing, and XLA's peak memory computed here."""
    import per_example_bench as peb

    batch, rounds, block = (32, 3, 2) if quick else (256, 15, 10)
    fns, args = peb.setup(batch)
    mem = {v: peers.xla_memory(fns[v].lower(*args).compile()) for v in peb.VARIANTS}
    t = peb.timing(batch, rounds, block, fns_args=(fns, args))  # the same jitted functions: no recompile
    mem_ratio = mem["vmap(grad)"]["peak_mb"] / mem["vjpkit"]["peak_mb"]
    return {
        "title": f"Per-example gradient norms, MLP 784-512-512-10, batch {batch}",
        "batch": batch,
        "rounds": rounds,
        "block": block,
        "median_ms": t["median_ms"],
        "xla_memory": mem,
        "speedup": t["speedup"],
        "speedup_range": list(t["speedup_range"]),
        "xla_peak_memory_ratio": mem_ratio,
        "targets": [
            {"target": f"vmap(grad) / vjpkit time >= {peb.TARGET_SPEEDUP:.0f}", "value": t["speedup"],
             "met": t["speedup"] >= peb.TARGET_SPEEDUP},
            {"target": f"vmap(grad) / vjpkit XLA peak memory >= {peb.TARGET_MEMORY:.0f}", "value": mem_ratio,
             "met": mem_ratio >= peb.TARGET_MEMORY},
        ],
    }  # fmt: skip


def _mark(met):
    return "n/a" if met is None else ("met" if met else "NOT met")


def _fmt(value, spec):
    return "—" if value is None else format(value, spec)


def markdown(results, pex=None):
    lines = []
    for res in results:
        lines.append(f"\n**{res['title']}**\n")
        lines.append(
            "| variant | median step (µs) | ratio to raw JAX | first call (s) "
            "| first call / raw JAX | trace + lower + XLA compile (s) | trace / raw JAX "
            "| XLA compile / raw JAX | peak memory (MB) |"
        )
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in res["rows"]:
            if r["status"] != "ok":
                lines.append(f"| {r['variant']} | {r['status']} |" + " — |" * 7)
                continue
            s = r.get("first_call_split")
            cells = [
                r["variant"],
                _fmt(r["median_step_us"], ".0f"),
                _fmt(r["ratio_to_raw"], ".3f"),
                f"{r['first_call_s']:.2f}",
                f"{r['compile_ratio']:.2f}",
                "—" if s is None else f"{s['trace_s']:.3f} + {s['lower_s']:.3f} + {s['xla_compile_s']:.3f}",
                "—" if s is None else f"{s['trace_ratio']:.2f}",
                "—" if s is None else f"{s['xla_compile_ratio']:.2f}",
                _fmt(r["peak_memory_mb"], ".2f"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        for t in res["targets"]:
            value = t.get("note") if t["value"] is None else f"{t['value']:.3f}"
            lines.append(f"- {t['target']}: {value} ({_mark(t['met'])})")
        raw = next(r["first_call_split"] for r in res["rows"] if r["variant"] == RAW)
        for i in res.get("first_call_split_info", []):
            lines.append(
                f"- first call in stages, {i['variant']} (informational, no target): trace (vjpkit's "
                f"engine included) {i['trace_s']:.3f} s, {i['trace_ratio']:.2f}x raw JAX's "
                f"{raw['trace_s']:.3f} s ({1e3 * i['trace_over_raw_s']:+.0f} ms); lower "
                f"{i['lower_ratio']:.2f}x, XLA compile {i['xla_compile_ratio']:.2f}x raw JAX's"
            )
        h = res["by_hand"]
        lines.append(
            f"- the same norms by hand in raw JAX (informational, no target): first call "
            f"{h['first_call_ratio_to_raw']:.2f}x raw JAX's; {CAPTURE} / by hand: first call "
            f"{h['capture_first_call_over_by_hand']:.2f}x, "
            f"step {_fmt(h['capture_step_over_by_hand'], '.3f')}x"
        )
        lines.append(f"- first-step losses: all within {res['max_first_loss_diff']:.1e} of raw JAX's")
    if pex:
        lines.append(f"\n**{pex['title']}**\n")
        lines.append("| variant | median call (ms) | XLA peak: temp + args + out (MB) |")
        lines.append("|---|---:|---:|")
        for v, ms in pex["median_ms"].items():
            m = pex["xla_memory"][v]
            lines.append(
                f"| {v} | {ms:.2f} | {m['peak_mb']:.1f} ({m['temp_mb']:.1f} + {m['argument_mb']:.1f} "
                f"+ {m['output_mb']:.1f}) |"
            )
        lines.append("")
        lo, hi = pex["speedup_range"]
        for t in pex["targets"]:
            lines.append(f"- {t['target']}: {t['value']:.2f} ({_mark(t['met'])})")
        lines.append(f"- per-round time ratios vmap(grad) / vjpkit: {lo:.2f}-{hi:.2f}")
    return "\n".join(lines)


DOCS_PAGE = HERE.parent / "docs" / "performance.md"
STEP_TABLE_MARKERS = ("<!-- run.py:step-table:start -->", "<!-- run.py:step-table:end -->")
REAL_MODELS_MARKERS = ("<!-- run.py:real-models-table:start -->", "<!-- run.py:real-models-table:end -->")


def _limit(target):
    """A target's text, ``"<a> / <b> <= <limit>"`` (or ``< <limit>``), as ``(a, b, "≤ <limit>")``."""
    lhs, _, rhs = target["target"].rpartition(" / ")
    against, op, limit = rhs.rsplit(" ", 2)
    return lhs, against, f"{'≤' if op == '<=' else op} {limit}"


def _checked(value, spec, met):
    """A cell: the value, then ✓ or ✗ when it has a target (bold when missed)."""
    if met is None:
        return _fmt(value, spec)
    return f"{_fmt(value, spec)} ✓" if met else f"**{_fmt(value, spec)} ✗**"


def step_table(results, meta):
    """``docs/performance.md``'s step-time table from ``main``'s results: a row per variant (ratio
    to raw JAX), then a row per other target (against a peer, first calls), a column per model."""
    variant_rows, target_rows = {}, {}  # label -> {model title: cell}, in first-seen order

    def put(rows, label, title, cell):
        rows.setdefault(label, {})[title] = cell

    for res in results:
        title = res["title"]
        by_variant = {r["variant"]: r for r in res["rows"]}
        step_targets, other_targets = {}, []
        for t in res["targets"]:
            lhs, against, limit = _limit(t)
            if against == RAW and not lhs.startswith("first call: "):
                step_targets[lhs] = (t, limit)
            else:
                other_targets.append((t, lhs, against, limit))
        put(variant_rows, "raw JAX: step time", title, _fmt(by_variant[RAW]["median_step_us"], ".0f") + " µs")
        for name, r in by_variant.items():
            if name == RAW:
                continue
            target, limit = step_targets.get(name, (None, None))
            label = name if limit is None else f"{name} ({limit})"
            if r["status"] != "ok":
                put(variant_rows, label, title, r["status"])
            else:
                put(variant_rows, label, title, _checked(r["ratio_to_raw"], ".3f", target and target["met"]))
        for t, lhs, against, limit in other_targets:  # a peer skipped: its targets too
            value = "skipped" if t["value"] is None else _checked(t["value"], ".2f", t["met"])
            put(target_rows, f"{lhs} / {against} ({limit})", title, value)
        h = res["by_hand"]
        put(
            target_rows,
            f"first call: {BY_HAND} / raw JAX (no target)",
            title,
            _fmt(h["first_call_ratio_to_raw"], ".2f"),
        )
        put(
            target_rows,
            f"first call: {CAPTURE} / {BY_HAND}",
            title,
            _fmt(h["capture_first_call_over_by_hand"], ".2f"),
        )
    titles = [res["title"] for res in results]
    lines = [
        f"Measured {run_line(meta)}.",
        "",
        "Step time as a ratio to raw JAX (lower is faster; ✓/✗ against the target in the row's "
        "label), then the run's other targets: first calls against raw JAX's, and step times "
        "against the peers':",
        "",
        "| variant | " + " | ".join(titles) + " |",
        "|---|" + "---:|" * len(titles),
    ]
    for label, by_title in {**variant_rows, **target_rows}.items():
        lines.append(f"| {label} | " + " | ".join(by_title.get(t, "") for t in titles) + " |")
    return "\n".join(lines)


def replace_marked(text, body, markers=STEP_TABLE_MARKERS):
    """``text`` with what stands between the two marker lines replaced by ``body``; the markers
    and everything outside them are kept as they are."""
    start, end = markers
    if not (text.count(start) == text.count(end) == 1 and text.index(start) < text.index(end)):
        raise ValueError(f"expected the markers {start!r} and {end!r} once each, in that order")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return head + start + "\n" + body.strip("\n") + "\n" + end + tail


def write_docs(results, meta, page=DOCS_PAGE, real_models=None):
    """Rewrite the step-time table of ``docs/performance.md`` from this run's results, and with
    ``real_models`` (``real_models_bench.run``'s result) its real-model per-example table too."""
    page = pathlib.Path(page)
    text = replace_marked(page.read_text(), step_table(results, meta))
    if real_models is not None:
        text = replace_marked(text, real_models_bench.docs_table(real_models), REAL_MODELS_MARKERS)
    page.write_text(text)
    return page


def run_line(meta):
    """One line saying when, where and how the run was made (printed first, and in the docs)."""
    v, busy, load = meta["versions"], meta["other_cpu_share"], meta["load_average_at_start"]
    rounds = (
        "first calls only" if meta["only_first_call"] else f"{meta['rounds']} rounds of {meta['block']} steps"
    )
    return (
        f"{meta['date']} | {meta['machine']} ({meta['cpu']}) | load {load or 0:.2f} | jax {v['jax']} "
        f"({meta['backend']}), flax {v['flax']}, equinox {v['equinox']}, torch {v['torch']}"
        f" | {rounds} | {meta['compile_repeats']} first call(s) per variant | {meta['wall_s']:.0f} s"
        + ("" if busy is None else f" | other processes used {100 * busy:.0f}% of the CPU meanwhile")
    )


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def versions(torch_client):
    out = {"python": platform.python_version(), "jax": jax.__version__, "numpy": np.__version__}
    out["optax"] = optax.__version__
    for mod in ("flax", "equinox"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError as err:
            out[mod] = f"not available ({err})"
    if torch_client is None:
        out["torch"] = "not run"
    else:
        hello = torch_client.hello()
        out["torch"] = hello["torch"] if hello["ok"] else f"not available ({hello['error']})"
        if hello["ok"]:
            out["torch_threads"] = hello["threads"]
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds, small blocks (a smoke run)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--block", type=int, default=20, help="steps per timed block")
    parser.add_argument(
        "--peers", default=",".join(peers.PEERS), help="comma-separated peers to run ('none': none)"
    )
    parser.add_argument(
        "--compile-repeats", type=int, default=3, help="first calls per variant, from empty caches"
    )
    parser.add_argument(
        "--only-first-call",
        action="store_true",
        help="first calls (and their trace / lower / XLA compile split) only: no step timing, "
        "memory, PyTorch or other benchmarks",
    )
    parser.add_argument("--no-per-example", action="store_true", help="skip the per-example-norms table")
    parser.add_argument("--no-host", action="store_true", help="skip host_bench.py's host-delivery tables")
    parser.add_argument(
        "--no-quickstart", action="store_true", help="skip quickstart_bench.py's memory comparison"
    )
    parser.add_argument(
        "--no-plain", action="store_true", help="skip plain_bench.py's plain-JAX (matching) tables"
    )
    parser.add_argument(
        "--plain-parts",
        default=",".join(plain_bench.PARTS),
        help=f"plain_bench.py's parts to run, comma-separated, of {plain_bench.PARTS}",
    )
    parser.add_argument(
        "--no-curvature", action="store_true", help="skip curvature_bench.py's curvature tables"
    )
    parser.add_argument("--no-eager", action="store_true", help="skip eager_bench.py's eager-call comparison")
    parser.add_argument("--no-kfac-jax", action="store_true", help="skip curvature_bench.py's kfac-jax part")
    parser.add_argument(
        "--no-real-models",
        action="store_true",
        help="skip real_models_bench.py's per-example norms on GPT-2-, ViT- and ResNet-shaped models",
    )
    parser.add_argument("--out", default=str(HERE / "results.json"))
    parser.add_argument(
        "--write-docs",
        action="store_true",
        help="after the run, rewrite docs/performance.md's step-time table (between its "
        "run.py:step-table markers) and, unless --no-real-models, its real-model per-example table "
        "(run.py:real-models-table markers) from its results",
    )
    args = parser.parse_args(argv)
    if args.write_docs and (args.quick or args.only_first_call):
        parser.error("--write-docs needs a full run: not with --quick or --only-first-call")
    if args.write_docs:  # before the run, not after it: the page must have its markers
        try:
            replace_marked(DOCS_PAGE.read_text(), "")
            if not args.no_real_models:
                replace_marked(DOCS_PAGE.read_text(), "", REAL_MODELS_MARKERS)
        except (OSError, ValueError) as err:
            parser.error(f"--write-docs: {DOCS_PAGE}: {err}")
    rounds, block = (3, 3) if args.quick else (args.rounds, args.block)
    repeats = 1 if args.quick else args.compile_repeats
    plain_parts = tuple(p for p in plain_bench.PARTS if p in args.plain_parts.split(","))
    if set(args.plain_parts.split(",")) - set(plain_parts):
        parser.error(f"unknown --plain-parts {args.plain_parts!r}; choose from {plain_bench.PARTS}")
    keys = [k for k in args.models.split(",") if k]
    unknown = [k for k in keys if k not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    selected = [p for p in args.peers.split(",") if p and p != "none"]
    if set(selected) - set(peers.PEERS):
        parser.error(f"unknown peer(s) {sorted(set(selected) - set(peers.PEERS))}; choose from {peers.PEERS}")
    only_first = args.only_first_call
    if only_first:  # PyTorch has no compilation; the other benchmarks time steady-state calls
        selected = [p for p in selected if p != "torch"]
        args.no_per_example = args.no_host = args.no_quickstart = args.no_plain = True
        args.no_curvature = args.no_eager = args.no_real_models = True
    threads = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    start, cpu_before = time.perf_counter(), cpu_times()
    torch_client = peers.TorchClient(threads) if "torch" in selected else None
    try:
        if torch_client is not None:
            torch_client.hello()  # wait for its import of torch: no competition for the CPU later
        with tempfile.TemporaryDirectory() as tmpdir:
            bench = (rounds, block, selected, torch_client, tmpdir, repeats, only_first)
            results = [bench_model(k, *bench) for k in keys]
        meta_versions = versions(torch_client)
    finally:
        if torch_client is not None:
            torch_client.close()
    part_s = {"models": time.perf_counter() - start}

    def part(name, skip, fn):  # one benchmark part, or None when skipped; its wall time in part_s
        if skip:
            return None
        t0 = time.perf_counter()
        out = fn()
        part_s[name] = time.perf_counter() - t0
        return out

    pex = part("per_example", args.no_per_example, lambda: per_example(args.quick))
    eager = part("eager", only_first or args.no_eager, lambda: eager_bench.run(args.quick))

    def host_run():
        import host_bench  # here: it imports fit_bench, which imports this module

        return host_bench.run(args.quick, keys)

    host = part("host", args.no_host, host_run)
    quick_mem = part("quickstart", args.no_quickstart, lambda: quickstart_bench.run(args.quick))
    plain = part("plain", args.no_plain, lambda: plain_bench.run(args.quick, parts=plain_parts))
    curvature = part(
        "curvature",
        args.no_curvature,
        lambda: curvature_bench.run(args.quick, kfac_jax=not args.no_kfac_jax),
    )
    real_models = part("real_models", args.no_real_models, lambda: real_models_bench.run(args.quick))
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": load,
        "other_cpu_share": other_cpu_share(cpu_before, cpu_times()),
        "backend": jax.default_backend(),
        "versions": meta_versions,
        "jax": jax.__version__,
        "rounds": rounds,
        "block": block,
        "compile_repeats": repeats,
        "quick": args.quick,
        "only_first_call": only_first,
        "peers": selected,
        "wall_s": time.perf_counter() - start,
        "part_s": part_s,
    }
    out = {
        "meta": meta,
        "results": results,
        "per_example": pex,
        "eager": eager,
        "host": host,
        "quickstart": quick_mem,
        "plain": plain,
        "curvature": curvature,
        "real_models": real_models,
    }
    pathlib.Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(run_line(meta))
    print(markdown(results, pex))
    if eager is not None:
        print(eager_bench.markdown(eager))
    if host is not None:
        import host_bench

        print(host_bench.markdown(host))
    if quick_mem is not None:
        print(quickstart_bench.markdown(quick_mem))
    if plain is not None:
        print(plain_bench.markdown(plain))
    if curvature is not None:
        print(curvature_bench.markdown(curvature))
    if real_models is not None:
        print(real_models_bench.markdown(real_models))
    if args.write_docs:
        which = "step-time table" if real_models is None else "step-time and real-model tables"
        print(f"wrote the {which} of {write_docs(results, meta, real_models=real_models)}")
    return out


if __name__ == "__main__":
    main()
