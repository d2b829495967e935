"""``vk.value_and_grad`` / ``vk.grad`` with ``capture=vk.curvature.stats(...)``.

Contract. The loss is traced once through the engine with its registered loss's output (the
model output, ``_losses``) as an extra output of the program, and linearized once. The
gradient's backward pass is seeded ``(1, 0)``; an engine handler (``_engine.records``, its own
probe part ``"curvature"``, beside the user's capture) carries every chosen layer's ``params``,
``input``, ``grad_output`` and ``grad_params`` out of it; the curvature passes pull the same
linearization again, vmapped over their seeds ``(0, S_k)``: the loss Hessian's square-root
columns for ``kflr`` / ``diag_ggn``, Monte-Carlo samples for ``kfac`` / ``diag_ggn_mc`` (the
transformed function then takes ``key=``). Each chosen layer's statistics come from those
records (``_stats.layer_stats``), once per iteration under ``lax.scan`` (vmapped over the
stacked records). The result is the transform's usual ``(result, captured)``, with
``captured[name]`` a ``LayerCurvature`` for each chosen layer with parameters, and the records
of any other capture spec beside them.

With ``hooks=``, the same program is planned a second time with the hooks (and any other
capture spec) and pulled once, seeded ``(1, 0)``: that pass gives the returned gradient, the
other records, the host deliveries and the new hook state, so each hook runs once per call.
Every statistic comes from the passes without hooks: the statistics describe the loss, and
hooks change only the gradient returned. Each linearization traces its own backward passes,
so no hook decision is shared through JAX's caches of transposed programs.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .. import _autodiff, _capture, _compat, _engine, _format
from .._capture import CaptureSpec, as_specs
from .._errors import ConfigError
from .._kinds import AffineNorm, LayerKind
from .._names import matches_any
from . import _examples, _local, _losses
from ._stats import (
    BLOCKS,
    DIAGONAL,
    FACTORS,
    FIRST_ORDER,
    MAX_FACTOR_DIM,
    ROWS,
    StatsSpec,
    layer_stats,
    local_stats,
    shared_stats,
)
from ._types import Diagonal, LayerCurvature, Layout, stats_dtype

_PART = "curvature"  # the engine probe part that carries the statistics' records


def _split(capture: Any, name: str) -> tuple[tuple[StatsSpec, ...], tuple[CaptureSpec, ...]]:
    items = _capture.items(capture)
    ours = tuple(c for c in items if isinstance(c, StatsSpec))
    rest = [c for c in items if not isinstance(c, StatsSpec)]
    return ours, (as_specs(rest if len(rest) > 1 else rest[0], name) if rest else ())


def transform(
    name: str,
    fun: Callable,
    argnums: Any,
    has_aux: bool,
    hooks: Any,
    capture: Any,
    match: Any,
    with_value: bool,
) -> Callable:
    """The curvature transform (see the module contract)."""
    specs, others = _split(capture, name)
    for spec in others:
        if spec.host is not None:
            raise ConfigError(f"{name}: capture host= cannot be combined with vk.curvature.stats.")
    globs = tuple(dict.fromkeys(g for s in specs for g in s.layers))
    raw = CaptureSpec(globs, ("params", "input", "grad_output", "grad_params"), None)
    # the statistics' records travel in their own probe part, beside the user's capture
    records = _engine.records(_PART, lambda layer, call: raw if raw.matches(layer, call) else None)
    # with hooks, the gradient's pass has its own plan (hooks + the other specs), pulled once
    with_hooks = _engine.configure(hooks, others, name, match) if hooks else None
    config = _engine.configure(None, () if hooks else others, name, match)
    wanted = _engine.configure(None, (raw,), name, match)  # its globs must each match a layer
    checked = _autodiff._scalar_loss(fun, has_aux, name)

    loss_takes_key = _takes_key(fun)

    def run(*args, hook_state=None, **kwargs):
        if hook_state is not None and with_hooks is None:
            raise ConfigError(f"{name}: hook_state= was given, but the transform has no hooks=.")
        key = kwargs.get("key")
        if key is not None and not loss_takes_key:
            kwargs = {k: v for k, v in kwargs.items() if k != "key"}
        elif key is not None:  # the loss draws from key too: the labels are sampled from another
            key = jax.random.fold_in(key, 0x6B666163)
        nums = _autodiff._argnums(argnums, len(args), name)
        _autodiff._require_differentiable([args[i] for i in nums], nums, name)
        kinds: list[str] = []

        def marked(*a, **kw):
            outer = set(_compat.axis_names())
            with _losses.collecting() as marks:
                out = checked(*a, **kw)
            inner = sorted({ax for m in marks for ax in m.axes} - outer)
            if inner:
                raise ConfigError(
                    f"{name}: the registered vk.curvature.{marks[0].kind} loss runs inside a "
                    f"jax.shard_map (axes {inner}) in the function, so the model output it reads is "
                    "per shard. Compute the statistics inside the shard_map body instead "
                    "(vk.curvature.kfac averages its factors over the shards with axis_name=)."
                )
            loss, aux = out if has_aux else (out, None)
            if not marks:
                raise ConfigError(
                    f"{name}: vk.curvature.stats needs the loss registered: compute it with "
                    "vk.curvature.softmax_cross_entropy(logits, labels), vk.curvature.mse(pred, target) "
                    "or vk.curvature.sigmoid_binary_cross_entropy(logits, labels) inside the loss "
                    "function (they return the mean loss and mark the model output)."
                )
            if len(marks) > 1:
                raise ConfigError(
                    f"{name}: the loss registered {len(marks)} vk.curvature losses "
                    f"({[m.kind for m in marks]}); vk.curvature.stats takes exactly one."
                )
            if loss is not marks[0].value:
                raise ConfigError(
                    f"{name}: the differentiated loss ({_format.describe(loss)}) is not the value the "
                    f"registered vk.curvature.{marks[0].kind} returned: it is computed from it and "
                    "something else (a scale such as 2 * loss, an added term such as a z-loss on the "
                    "logits or weight decay, a sum of losses). The statistics are the curvature of "
                    "the registered term alone, so they would describe another function than the "
                    "one differentiated. Return the registered loss itself (anything else through "
                    "has_aux=True), or compute the statistics with a loss function that does."
                )
            kinds[:] = [marks[0].kind]
            return (loss, marks[0].output), (aux, marks[0].target)

        traced = _engine.trace(config, marked, args, kwargs, argnums=nums, has_aux=True, handlers=[records])
        wanted.check_matched(traced.plan.names)
        _engine.require_unsharded(traced, "curvature statistics")
        (value, output), (aux, target), pull = _engine.linearize(traced)
        mark = _losses.Mark(kinds[0], output, target)
        zero = jnp.zeros_like(value)
        seed = [jnp.ones_like(value), jnp.zeros_like(output)]
        grads, captured, new_state, results = pull(seed)
        plain_grads, recs = grads, results[_PART]
        if with_hooks is not None:  # the returned gradient, the other records and the hooks' state
            hooked = _engine.replan(traced, with_hooks)
            grads, captured, new_state, _ = _engine.linearize(hooked, hook_state)[2](seed)

        def pulled(seeds, with_grads=False):
            def one(s):  # the statistics' records of one seeded pass (and its parameters' gradients)
                g, _, _, results = pull([zero, s])
                return (g, results[_PART]) if with_grads else results[_PART]

            return jax.vmap(one)(seeds)

        n = output.shape[0]
        paths = _leaf_paths([args[i] for i in nums], nums)
        both = sorted(set(captured) & set(recs))
        if both:
            raise ConfigError(
                f"{name}: layer call(s) {both} are chosen both by vk.curvature.stats and by another "
                "capture spec, and captured[name] holds one entry per call. Capture them in a "
                "separate call (vk.capture alone), or choose other layers for one of the two."
            )
        result_captured, chosen, rules = dict(captured), {}, {}  # the other specs' records (after the hooks)
        for k, rec in recs.items():  # the rules first: they say which leaves no layer reads
            site = traced.plan.by_key[k]
            spec = next((s for s in specs if matches_any(site.name, site.call, s.layers)), None)
            if spec is None:
                result_captured[k] = rec
                continue
            if not jax.tree.leaves(rec.params) or traced.plan.contains_calls(site):
                continue  # no parameters, or a container (its layers have their own statistics)
            rule = _rule(site, paths, spec, name)
            rules[k] = rule
            chosen[k] = (spec, _example_axis(traced, site, rule, spec, n, name))
        unread = _unread_leaves(specs, paths, [r if isinstance(r, Layout) else r[1] for r in rules.values()])
        exact_seeds = _losses.sqrt_hessian(mark) if any(s.exact for s in specs) else None
        exact = None if exact_seeds is None else pulled(exact_seeds)
        mc = mc_grads = seeds = None
        sampled = [s for s in specs if s.sampled]
        if sampled:
            if key is None:
                raise ConfigError(
                    f"{name}: the Monte-Carlo statistics {[w for s in sampled for w in s.which]} "
                    "sample labels: pass an RNG key as key= to the transformed function "
                    "(f(params, x, y, key=jax.random.key(0)))."
                )
            seeds = _losses.sampled(mark, key, max(s.mc_samples for s in sampled))
            if any(set(u[3]) & set(_UNREAD) for u in unread):  # the leaves no layer reads: the
                mc_grads, mc = pulled(seeds, with_grads=True)  # passes' parameter gradients too
            else:
                mc = pulled(seeds)
        for k, rule in rules.items():
            spec, axis = chosen[k]
            site, rec = traced.plan.by_key[k], recs[k]
            result_captured[k] = _stacked_stats(
                spec.which, rule, rec, exact and exact[k], mc and mc[k], n, len(site.scans), k, axis,
                spec.max_factor_dim,
            )  # fmt: skip
        _share(traced, recs, result_captured, chosen, exact, mc, n)
        if unread:
            _warn_unread(unread, traced, name, n)
            per_example = _per_example_unread(pull, zero, mark, exact_seeds, seeds, plain_grads, n, name)
            _add_unread(unread, traced.leaves, mc_grads, per_example, result_captured)
        user_grads = grads[0] if isinstance(argnums, int) else tuple(grads)
        if with_value:
            result = ((value, aux), user_grads) if has_aux else (value, user_grads)
        else:
            result = (user_grads, aux) if has_aux else user_grads
        return (result, result_captured, new_state) if hook_state is not None else (result, result_captured)

    run.hook_config = with_hooks  # for vk.init_hook_state
    return run


def _share(traced, captured, result, chosen, exact, mc, n) -> None:
    """A dense weight used by several calls, or closed over by a ``lax.scan`` (one more call per
    iteration): its per-example statistics are the weight's, each example's gradient the sum of
    the calls' (cross terms kept), the same in every call's (and iteration's) entry
    (``_stats.shared_stats``); the K-FAC factors stay per call. ``chosen``: each computed
    call's ``(spec, example axis)``."""
    groups: dict[Any, list] = {}
    for k, stats in result.items():
        layout = getattr(stats, "layout", None)
        known = isinstance(layout, Layout) and layout.weight_leaf is not None  # the leaf it reads
        if known and layout.kind == "dense" and set(layout.scans) <= {"c"}:
            groups.setdefault(layout, []).append(k)
    for layout, keys in groups.items():
        # the blocks' fields stay per call (ekfac's rows too: the optimizer joins a weight's calls)
        which = sorted(
            set.intersection(*({w for w in chosen[k][0].which if w not in (*BLOCKS, *ROWS)} for k in keys))
        )
        if sum(math.prod(traced.plan.by_key[k].scans) for k in keys) < 2 or not which:
            continue
        calls = []
        for k in keys:
            scans, rec, axis = traced.plan.by_key[k].scans, captured[k], chosen[k][1]
            lead, count = len(scans), math.prod(scans)

            def each(a, seeds=0, lead=lead, count=count):  # the iterations on one axis
                return None if a is None else a.reshape(*a.shape[:seeds], count, *a.shape[seeds + lead :])

            ps, gs = _flat(rec.params), _flat(rec.grad_params) if rec.grad_params is not None else {}
            ps, gs = ({p: each(v) for p, v in tree.items()} for tree in (ps, gs))
            x, d = each(rec.input), each(rec.grad_output)
            ex = None if exact is None else each(exact[k].grad_output, 1)
            sm = None if mc is None else each(mc[k].grad_output, 1)
            for i in range(count):
                fields = _examples_first(
                    axis, x[i], d[i], None if ex is None else ex[:, i], None if sm is None else sm[:, i]
                )
                slices = ({p: v[i] for p, v in tree.items()} for tree in (ps, gs))
                calls.append((layout, *slices, *fields))
        shared = shared_stats(which, calls, n)
        for k in keys:
            rekeyed = _rekey(LayerCurvature(**shared, layout=layout), captured[k].params)
            result[k] = dataclasses.replace(
                result[k],
                **{  # each entry (stacked over its iterations) holds the weight's
                    f: jax.tree.map(
                        lambda new, old: jnp.broadcast_to(new, old.shape),
                        getattr(rekeyed, f),
                        getattr(result[k], f),
                    )
                    for f in shared
                },
            )


_UNREAD = ("kfac", "ekfac")  # answered from the whole batch's Monte-Carlo passes (_add_unread)


def _unread_leaves(specs, paths, layouts) -> list[tuple[int, str, Layout, tuple]]:
    """The differentiated leaves no chosen call's layout names (no layer reads it: a class
    token, a bare scale; or a layer reads a value computed from it) that a spec matches by
    path: ``(index in paths, name, Layout, statistics asked)`` each (``grad_rows`` left out: a
    dense call's). Only leaves of the first differentiated argument (the params; ``kfac`` reads
    one tree), named as the layers are (``"arg0/..."`` with several arguments); ``_add_unread``
    skips the non-float ones."""
    covered = set()
    for layout in layouts:
        named = [layout.weight_leaf, layout.bias_leaf, *(p for _, p in layout.leaves)]
        covered.update((layout.argnum, p) for p in named if p is not None)
    first = paths[0][0] if paths else None
    several = len({a for a, _ in paths}) > 1
    out = []
    for i, (argnum, keys) in enumerate(paths):
        if argnum != first or (argnum, keys) in covered:
            continue
        inner = jax.tree_util.keystr(keys, simple=True, separator="/")
        name = f"arg{argnum}/{inner}" if several and inner else inner or f"arg{argnum}"
        asked = tuple(
            dict.fromkeys(
                w for s in specs if matches_any(name, 0, s.layers) for w in s.which if w not in ROWS
            )
        )
        if asked:
            out.append((i, name, Layout("leaf", "", None, argnum=argnum, leaves=(("", keys),)), asked))
    return out


def _add_unread(unread, leaves, mc_grads, per_example, result) -> None:
    """Adds the entry of each leaf of ``_unread_leaves`` (real floating leaves only; keyed by the
    leaf's name, ``"#leaf"`` added if a layer has that name; ``Layout`` kind ``"leaf"``):

    * ``kfac`` / ``ekfac``: ``Diagonal(sum_m (J^T s_m)^2)``, the squared parameter gradient of
      each Monte-Carlo pass of the whole batch (``mc_grads``). With ``E[sum_m s_m s_m^T] = H``
      and the labels drawn independently per position, its expectation is the diagonal of the
      Monte-Carlo Fisher (GGN) of the mean loss for that leaf, cross-example terms averaging to
      zero;
    * every other statistic per example, as a local layer's (``_stats.local_stats``), from
      ``per_example(which, params) -> {statistic: {index: value}}`` (``_per_example_unread``).
    """
    floating = [u for u in unread if jnp.issubdtype(leaves[u[0]].dtype, jnp.floating)]
    rest = [u for u in floating if any(w not in _UNREAD for w in u[3])]
    which = tuple(dict.fromkeys(w for u in rest for w in u[3] if w not in _UNREAD))
    own = per_example(which, {str(u[0]): leaves[u[0]] for u in rest}) if rest else {}
    flat = [] if mc_grads is None else [leaf for g in mc_grads for leaf in jax.tree.leaves(g)]
    for i, name, layout, asked in floating:
        fields = {}
        for w in asked:
            if w in _UNREAD:
                g = flat[i].astype(stats_dtype(flat[i].dtype))
                fields[w] = Diagonal(jnp.sum(jnp.square(g), axis=0))
            else:
                v = own[w]
                fields[w] = Diagonal(v.diagonal[str(i)]) if isinstance(v, Diagonal) else v[str(i)]
        key = f"{name}#leaf" if name in result else name
        result[key] = LayerCurvature(**fields, layout=layout)


def _warn_unread(unread, traced, transform: str, n: int) -> None:
    """The warning for leaves whose per-example statistics take ``_per_example_unread``'s
    masked pulls: which leaves, what reads them, and what to do."""
    slow = [(name, [w for w in asked if w not in _UNREAD]) for _, name, _, asked in unread]
    slow = [(name, which) for name, which in slow if which]
    if not slow:
        return
    uses = {}
    for use in traced.other_uses:
        for leaf in use.leaves:
            uses.setdefault(leaf, []).append(use.primitive + (f" inside {use.where}" if use.where else ""))
    by = {name: ", ".join(dict.fromkeys(uses.get(name, ["a value computed from it"]))) for name, _ in slow}
    listed = "; ".join(f"{name} ({', '.join(which)}; used by {by[name]})" for name, which in slow)
    warnings.warn(
        f"{transform}: vk.curvature.stats: no layer reads the leaves {listed}, so their per-example "
        f"statistics take one backward pass of the whole model per example ({n}) and per seed, as "
        "jax.vmap(jax.grad) would. To give such a leaf a layer's fast path, use it as a layer's "
        "parameter as it is (x * scale, x @ W), or leave it out of the globs.",
        stacklevel=3,
    )


def _per_example_unread(pull, zero, mark, exact, mc, grads, n, where) -> Callable:
    """``per_example(which, params)`` of ``_add_unread``: the leaves' per-example gradients by
    masked pulls of the whole program (``_local.masked``), ``g_i = pull(0, s masked to example
    i)`` for each seed ``s`` at the model output (the gradient's ``dL/d output``, the Hessian's
    square-root columns ``exact``, the Monte-Carlo samples ``mc``; the examples on axis 0): a
    backward pass per example and seed, as ``jax.vmap(jax.grad)`` would take."""
    flat_grads = [leaf for g in grads for leaf in jax.tree.leaves(g)]

    def per_example(which, params):
        at = [int(k) for k in params]

        def leaves_of(g):  # the leaves' gradients of one pull, keyed like params
            got = [leaf for t in pull([zero, g])[0] for leaf in jax.tree.leaves(t)]
            return {str(k): got[k] for k in at}

        d = _losses.output_grad(mark)
        grad_params = {str(k): flat_grads[k] for k in at}
        return local_stats(which, _local.masked(leaves_of), params, grad_params, d, exact, mc, n, where)

    return per_example


def _examples_first(axis: int, x, d, ex, sm) -> tuple:
    """A dense call's input and output cotangents with the examples moved from ``axis`` to 0,
    and its seeds' (seed axis first) to 1."""
    if not axis:
        return x, d, ex, sm
    ex = None if ex is None else jnp.moveaxis(ex, axis + 1, 1)
    sm = None if sm is None else jnp.moveaxis(sm, axis + 1, 1)
    return jnp.moveaxis(x, axis, 0), jnp.moveaxis(d, axis, 0), ex, sm


def _takes_key(fun: Callable) -> bool:
    """Whether ``fun`` accepts a ``key`` keyword (a loss with dropout): it then gets it too."""
    try:
        params = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "key" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _example_axis(traced: Any, site: Any, rule: Any, spec: StatsSpec, n: int, transform: str) -> int:
    """The axis of the call's output that holds the ``n`` examples of the registered loss, found
    by following each candidate axis to the registered output (``_examples``): the one that
    arrives at its axis 0 with no example mixed with another on the way. 0 when only K-FAC
    factors are asked for of a dense or conv call (they read rows, not examples; a local layer's
    K-FAC fields are its per-example diagonal) or when the call does not reach the
    loss (its statistics are zero); a ``ConfigError`` naming the layer when the examples mix
    between it and the loss, or when no axis (or more than one) carries them there."""
    local = not isinstance(rule, Layout)  # its K-FAC fields are per-example diagonals too
    per_example = [w for w in spec.which if w not in ((*ROWS,) if local else (*FACTORS, *ROWS))]
    outs = [v for v in site.eqn.outvars if hasattr(v.aval, "shape")]
    if not per_example or not outs:
        return 0
    shape = tuple(outs[0].aval.shape)
    dense = isinstance(rule, Layout) and rule.kind == "dense"
    candidates = [k for k in range(len(shape) - (1 if dense else 0)) if shape[k] == n]
    if isinstance(rule, Layout) and rule.kind == "conv":
        candidates = candidates[:1] if candidates and candidates[0] == 0 else []
    ends = {}
    for k in candidates:
        seeds = {
            j: k
            for j, v in enumerate(site.eqn.outvars)
            if tuple(getattr(v.aval, "shape", ()))[k : k + 1] == (n,)
        }
        ends[k] = _examples.reaches(traced.closed.jaxpr, site.path, seeds, 1)
    good = [k for k, end in ends.items() if end == 0]
    if len(good) == 1:
        return good[0]
    if ends and all(end is None for end in ends.values()):
        return 0  # the loss does not depend on this call: its statistics are zero
    where = f"layer {site.key!r}"
    out = _format.describe(outs[0].aval)
    head = f"{transform}: vk.curvature.stats{list(per_example)}: {where} (output {out})"
    fix = (
        "Leave it out of the globs (its statistics, diagonal blocks included, are per example)."
        if local
        else f"Ask only for K-FAC factors ({list(FACTORS)}) of this layer, which read its rows and "
        "not its examples, or leave it out of the globs."
    )
    if len(good) > 1:
        raise ConfigError(
            f"{head}: its axes {good} all reach axis 0 of the registered loss's output, so which one "
            f"holds the {n} examples is ambiguous. {fix}"
        )
    if any(end == _examples.MIXED for end in ends.values()):
        raise ConfigError(
            f"{head}: the per-example statistics need this layer's examples kept apart up to the "
            "registered loss, but between this layer and the loss they mix (a batch norm in training "
            "mode, a mean or sum over the batch, a contraction or scan over the examples, or an "
            "operation whose effect on the examples vjpkit cannot read), so a per-example gradient "
            f"of this layer is not defined by its records. {fix}"
        )
    raise ConfigError(
        f"{head}: no axis of its output with {n} entries (the examples of the registered loss) "
        f"reaches axis 0 of the registered loss's output (candidates {candidates}: they end on "
        f"{[ends[k] for k in candidates]}). {fix}"
    )


def _stacked_stats(which, rule, rec, exact, mc, n, n_scans, key, axis=0, max_dim=MAX_FACTOR_DIM) -> Any:
    """The statistics of one call, vmapped over its record's ``n_scans`` stacked scan axes; the
    examples on ``axis`` of its output (and, for a dense layer, of its input)."""
    where = f"layer {key!r}"

    def one(params, grad_params, x, d, ex, sm):
        if isinstance(rule, Layout):
            x, d, ex, sm = _examples_first(axis, x, d, ex, sm)
        if isinstance(rule, Layout):
            g_flat = _flat(grad_params) if grad_params is not None else {}
            stats = layer_stats(which, rule, _flat(params), g_flat, x, d, ex, sm, n, where, max_dim)
            return _rekey(stats, params)
        linearize, layout = rule
        grad_params = grad_params if grad_params is not None else jax.tree.map(jnp.zeros_like, params)
        per_example = linearize(params, x, axis)
        fields = local_stats(which, per_example, params, grad_params, d, ex, sm, n, where, axis)
        return LayerCurvature(**fields, layout=layout)

    ex = exact.grad_output if exact is not None else None
    sm = mc.grad_output if mc is not None else None
    fn = one
    for _ in range(n_scans):
        fn = jax.vmap(fn, in_axes=(0, 0, 0, 0, None if ex is None else 1, None if sm is None else 1))
    return fn(rec.params, rec.grad_params, rec.input, rec.grad_output, ex, sm)


def _flat(tree: Any, is_leaf: Any = None) -> dict[str, Any]:
    return {_format.path(kp): leaf for kp, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf)[0]}


def _rekey(stats: Any, params: Any) -> Any:
    """The param-shaped statistics (flat ``{path: leaf}``) keyed like ``params`` again."""

    def back(flat):
        if flat is None:
            return None
        return jax.tree_util.tree_map_with_path(lambda kp, _: flat.get(_format.path(kp)), params)

    return dataclasses.replace(stats, **{f: back(getattr(stats, f)) for f in DIAGONAL + FIRST_ORDER})


def _leaf_paths(diff: list, nums: tuple[int, ...]) -> list[tuple[int, tuple]]:
    """``(argnum, key path inside it)`` of every differentiated leaf, in the engine's order."""
    out = []
    for keys, _ in jax.tree_util.tree_flatten_with_path(diff)[0]:
        out.append((nums[keys[0].idx], tuple(keys[1:])))
    return out


def _plain_dense(site: Any, params: dict) -> bool:
    """A kind-less ``{"weight" (in, out)[, "bias" (out,)]}`` layer on a float input ``(..., in)``
    with output ``(..., out)`` (``vjpkit.nn.dense``; an embedding's table is not one)."""
    if set(params) not in ({"weight"}, {"weight", "bias"}) or params["weight"].ndim != 2:
        return False
    x, y = site.record.input, site.record.output
    if not (hasattr(x, "dtype") and hasattr(y, "dtype")) or not jnp.issubdtype(x.dtype, jnp.floating):
        return False
    n_in, n_out = params["weight"].shape
    return x.shape[-1:] == (n_in,) and y.shape == (*x.shape[:-1], n_out)


def _affine(site: Any) -> bool:
    """Whether the call's own program is ``x @ weight [+ bias]`` (``_examples.is_affine``)."""
    layout = site.layout
    if layout.n_hoisted or layout.tree.children()[2].num_leaves:
        return False
    jaxpr = getattr(site.span.jaxpr, "jaxpr", site.span.jaxpr)
    _, (p, inputs, _) = layout.split(list(jaxpr.invars))
    if not isinstance(p, dict) or len(inputs) != 1 or not hasattr(inputs[0], "aval"):
        return False
    return _examples.is_affine(jaxpr, p["weight"], p.get("bias"), inputs[0])


def _as_layout_kind(kind: Any) -> Any:
    """A dense kind whose weight leaf the input meets in another order (``x @ W.T``, a tied
    head ``h @ embed.T``: ``LayerKind.axes``) as ``Layout`` can hold it: stored ``(out..., in...)``
    is ``transpose=True``; any other order is a layer of its own kind (no K-FAC layout, its
    diagonal from its per-example vjp), never read as ``(in, out)``."""
    if not (isinstance(kind, LayerKind) and kind.kind == "dense" and kind.axes):
        return kind
    left, right = (tuple(a) for a in kind.axes)
    n_out = len(right)
    if right == tuple(range(n_out)) and left == tuple(range(n_out, n_out + len(left))):
        return dataclasses.replace(kind, transpose=True, in_ndim=len(left), axes=())
    return LayerKind("dense_permuted", roles=kind.roles, note=kind.note)


def _rule(site: Any, paths: list, spec: StatsSpec, transform: str) -> Any:
    """A ``Layout`` (how the call's params map to the K-FAC matrix, from its kind) for a dense
    or conv layer; ``(per_example, Layout("local", ...))`` for any other per-example layer (see
    ``local_stats``), the layout naming its parameters' leaves."""
    params = _flat(site.record.params)
    kind = _as_layout_kind(site.kind)
    where = f"layer {site.key!r}"
    _, (origins, _, _) = site.layout.split(site.origins)
    origin = _flat(origins, lambda o: o is None or isinstance(o, _engine.Scanned))
    scanned = [o.how for o in origin.values() if isinstance(o, _engine.Scanned)]
    scans = scanned[0] if scanned else ""  # a local layer's; a dense layer's is its weight's

    def leaf(at, scans):  # the argument leaf given to the call as it is (sliced or closed over)
        if isinstance(at, _engine.Scanned) and at.how == scans and len(scans) == len(site.scans):
            return paths[at.leaf]
        return paths[at] if isinstance(at, int) and not site.scans else None

    if isinstance(kind, LayerKind) and kind.kind in ("dense", "conv"):
        roles = {role: p for p, role in kind.roles.items() if p in params}
    elif kind is None and _plain_dense(site, params) and _affine(site):
        kind, roles = LayerKind("dense"), {"weight": "weight", "bias": "bias"}
        roles = {r: p for r, p in roles.items() if p in params}
    else:
        what = (
            "an affine norm" if isinstance(kind, AffineNorm)
            else f"a layer of kind {kind.kind!r}" if isinstance(kind, LayerKind)
            else "a layer of no known kind"
        )  # fmt: skip
        per_example = (
            None if isinstance(kind, LayerKind) and kind.kind == "batch" else _local.per_example_for(site)
        )
        if per_example is None:
            raise ConfigError(
                f"{transform}: vk.curvature.stats{list(spec.which)}: {where} is {what} with params "
                f"{_format.describe(site.record.params)}, which has no curvature rule (its examples "
                "mix, or it closes over values its record does not hold). Leave it out of the globs."
            )
        at = {p: leaf(o, scans) for p, o in origin.items()}
        argnums = {a[0] for a in at.values() if a is not None}
        known = tuple((p, a and a[1]) for p, a in at.items())
        return per_example, Layout(
            "local", "", None, argnum=min(argnums, default=0), scans=scans,
            leaves=known if len(argnums) <= 1 else tuple((p, None) for p in at),
        )  # fmt: skip
    weight, bias = roles.get("weight"), roles.get("bias")
    if weight is None:
        raise ConfigError(f"{transform}: vk.curvature.stats: {where} has no weight among {sorted(params)}.")
    w_at, b_at = origin.get(weight), origin.get(bias) if bias else None
    scans = w_at.how if isinstance(w_at, _engine.Scanned) else ""
    w_leaf, b_leaf = leaf(w_at, scans), leaf(b_at, scans) if b_at is not None else None
    if kind.kind == "conv":
        n = params[weight].ndim - 2
        return Layout(
            "conv", weight, bias, in_ndim=n + 1, strides=tuple(kind.strides), padding=kind.padding,
            dilation=tuple(kind.dilation), argnum=w_leaf[0] if w_leaf else 0,
            weight_leaf=w_leaf and w_leaf[1], bias_leaf=b_leaf and b_leaf[1], scans=scans,
        )  # fmt: skip
    return Layout(
        "dense", weight, bias, transpose=kind.transpose, in_ndim=kind.in_ndim,
        argnum=w_leaf[0] if w_leaf else 0, weight_leaf=w_leaf and w_leaf[1], bias_leaf=b_leaf and b_leaf[1],
        scans=scans,
    )  # fmt: skip
