"""Per-example gradient norms, and DP-SGD clipping, from layer records.

Contract. ``loss_fn(params, *batch)`` returns a scalar ``L`` that reduces independent
per-example terms over the batch axis 0: ``L = mean_i l_i`` (``reduction="mean"``, the default)
or ``L = sum_i l_i`` (``reduction="sum"``), where ``l_i = loss_fn(params, *example_i)`` is the
loss on example ``i`` alone (a batch of one, every batch array indexed ``[i:i+1]``). Every
positional argument after ``params`` is a pytree of arrays with the batch on axis 0; anything
else is closed over. The per-example gradient is ``g_i = grad l_i`` whatever the reduction,
exactly what ``jax.vmap(jax.grad(l))`` over the examples gives (the reference the tests use).
``per_example_grad_norms`` returns ``||g_i||`` for each example, in total, per layer and per
parameter leaf, and ``dp_clip`` clips each ``g_i`` to norm ``C`` and adds noise.

A term of the loss that does not depend on the batch (a weight penalty ``lam * sum(w**2)``) is
part of every ``l_i`` in full, since ``l_i`` is ``loss_fn`` on a batch of one: with
``reduction="mean"``, ``L = mean_i ce_i + lam * sum(w**2)`` keeps to the contract and
``g_i = grad ce_i + 2 lam w``; with ``reduction="sum"`` it does not (``sum_i l_i`` counts the
penalty ``B`` times), and the check below warns. A loss that mixes the examples (centering or
normalising over the batch, a contrastive term, random numbers drawn for the whole batch) does
not keep to it either: ``l_i`` on a batch of one is then not example ``i``'s share of ``L``.
With ``check=True`` (the default) ``loss_fn`` also runs forward on examples 0 and 1 together,
and a ``UserWarning`` says so when that differs from the mean (sum) of ``l_0`` and ``l_1``
(relative tolerance 1e-4, absolute 1e-5 for float32 losses; a host callback, called only
then). The norms are still those of ``g_i = grad l_i`` as defined above, and the ``loss`` and
``grads`` returned are of ``mean_i l_i`` (or the sum), not of ``loss_fn`` on the batch.

How the example axis is found: by dataflow, never by shape. The loss is evaluated as
``mean_i l_i`` (or the sum) with ``jax.vmap`` over the examples: one forward and one backward
pass, through vjpkit's records. Under ``vmap`` each layer call stays one call over the whole
batch, and its operands carry the example axis wherever the batching rules put it. A
shape-only trace of the same vmapped loss over a batch of one gives every record field the
same shape with the example axis of length 1, so the example axis of each field is the one axis
whose length differs (``B`` against 1): a time-major layer ``(T, B, d)``, a batch permuted or
reversed inside the loss, and ``T == B`` are all exact. A field without that axis does not
depend on the example (a positional embedding looked up with ``arange``). The ``loss`` and
``grads`` returned are those of this evaluation: equal to ``jax.value_and_grad(loss_fn)`` (up to
float rounding) whenever ``loss_fn`` keeps to the contract.

Each parameter leaf gets its per-example gradient one of these ways:

* which layer calls use which leaf is found by *identity* (the engine's plan of the program), so
  weight sharing (a layer called twice, one array given to two layers) is exact: the calls'
  contributions add per example. A leaf the program also uses anywhere else (a weight penalty
  in the loss, a transposed or cast copy given to a layer, a tied use such as ``Embed.attend``
  inside a parent module, a ``while`` loop or ``cond`` branch) is found by walking the program
  and falls back (last item), with a warning naming the leaf and that use.
* layers called inside ``lax.scan`` (nested scans too) have one record per iteration, stacked
  on a leading axis. A leaf the scans slice (given as ``xs``: weights stacked ``(L, ...)``) has
  ``g_i`` whose slice ``k`` is iteration ``k``'s, so each path below runs per iteration,
  mapped over the iterations (``||g_i||^2 = sum_k ||g_ik||^2``, the per-iteration ghost norms
  for dense). A leaf the scans close over (the same weight every iteration) gets the sum over
  iterations: each iteration is one more call (for dense, rows stacked on ``T``, so the norm
  of the sum with its cross terms). A leaf sliced by some uses and not by others falls back.
  ``per_example_grad_norms`` (norms only) reduces each iteration of a call whose leaves are its
  own and sliced by its scans to that iteration's squared norms (and its check, against the
  record's own ``grad_params``) inside the backward pass, where the record is made: no record
  is stacked over the iterations (``dp_clip`` and ``gradient_stats`` need the records after the
  pass, and stack them).
* dense (``weight (in, out)``, optional ``bias (out,)``, output ``input @ weight + bias`` on the
  last axis; Flax ``Dense``/``DenseGeneral``, NNX and Equinox ``Linear`` by their kind): from
  the records' ``input`` ``X_i`` and ``grad_output`` ``D_i`` of every call, example axis first,
  ``||g_i||^2 = ||x_i||^2 ||d_i||^2`` when each example is one row; otherwise (sequences, and
  several calls stacked on ``T``) ``<X_i X_i^T, D_i D_i^T>`` when ``T^2 <= in*out``, else the
  per-example weight gradient of *that layer only* ``X_i^T D_i`` (the "mixed ghost norm"). The
  bias gradient is ``sum_t d_it``.
* convolutions (``nn.conv2d``, ``nn.conv1d`` and Flax ``Conv`` give their kind with their own
  strides, padding and dilation; nothing is inferred from shapes; a custom layer with a
  conv-shaped ``weight`` is a conv only with ``conv={glob: (stride, padding)}``): the ghost norm
  over the unfolded patches when ``P^2 <= K c_out`` (``P`` output positions per example), else
  the per-example kernel gradients of that layer only, from the unfolded patches when they are
  small, else one window offset at a time, their squared norms and batch sum reduced per offset
  (``stats.reduced``: no ``B x`` kernel array kept); such a leaf's batch gradient is that sum
  (the layer's own weight gradient is then dead code). All in ``vjpkit.stats`` (``Rows.conv``),
  with dense weights and lookups.
* a leaf used only outside the layers, not in a loop or branch (a class token, a temperature),
  and the vector or scalar leaves of norms, other per-example layers and layers of no known kind
  (``_small_local_leaves``):
  given to the loss broadcast over the examples, its gradient in the same pass is per example.
* affine norms (layers that note themselves as ``_kinds.AffineNorm``: ``nn.rms_norm``,
  ``nn.batch_norm`` in eval mode): ``y = x_hat * scale + bias`` on the last axis, with
  ``x_hat`` recomputed from the captured ``input``; per example the ``scale`` gradient is
  ``sum_t d_it * x_hat_it`` and the ``bias`` gradient ``sum_t d_it``; other parameters (running
  statistics) get zero.
* "local" kinds (Flax ``Embed``/``LayerNorm``/``RMSNorm``, NNX ``Embed``/``LayerNorm``/
  ``RMSNorm``/``Conv``, Equinox ``Embedding``/``LayerNorm``/``RMSNorm``/``Conv2d``, also under
  nested ``vmap`` s): a vmap over the examples of the vjp of *that call's own computation* on one
  example (the call as traced over a batch of one), so ``B * (its params)`` floats. A layer of
  no known kind (a custom ``nn.layer``, vjpkit's embedding) takes the same path when it takes
  nothing but its params and inputs, with a warning naming it: ``vmap(grad)`` of that layer alone.
* plain-JAX layers (found by dataflow, ``_engine._match``): ``x @ W (+ b)`` and channels-last
  convolutions of leaves as they are take the dense and conv paths, embeddings and norm affines
  the local one. A matched ``dot_general`` or ``conv_general_dilated`` of another form (feature
  groups, batch dimensions on the weight, a transposed, cast or combined weight) also takes the
  local path, with a ``UserWarning`` naming the layer, its equation and its params.
* a leaf used only by calls whose inputs are the same for every example (a positional
  embedding looked up with ``arange``; found by dataflow from the batch) is lifted over the
  examples: given to the loss broadcast and vmapped like the batch, so its calls become
  per-example calls and its gradient is the ``g_i``, in the same single pass (``B * (its size)``
  floats).
* anything else (a layer that closes over other values or whose params are computed in the
  loss, leaves used outside the layers' params, a leaf used both per example and by an
  example-independent call) falls back to ``jax.vmap(jax.grad)`` of ``l_i`` with respect to
  those leaves only, with a ``UserWarning`` naming each layer, its leaves and why. Exact, never
  silent.
* a layer that mixes the examples of its input (batch statistics: ``nn.batch_norm`` with
  ``train=True``, Flax/NNX/Equinox ``BatchNorm`` in training mode) breaks the contract: its
  per-example gradients are not defined, and the call raises a ``ConfigError`` naming it.
* a runtime consistency check (``check=True``, besides the one on independent examples above):
  per fast-path leaf, the sum of the per-example gradients must equal the batch gradient (for
  dense weights through a fixed random projection, a matrix-vector product), to a relative
  tolerance of 1e-3 of a bound on the rounding error. A dense weight or lookup table all of
  whose uses have a kind (read from the layer, or from the equation by plain-JAX matching) is
  ``x^T d`` by construction and skips it (on a 50k-vocabulary tied head it cost 0.2x a step).
  A leaf with a dense-shaped ``{"weight", "bias"}`` and no kind is taken as dense by its shapes;
  if it is not (a custom layer), the check fails and that leaf gets NaN norms (and NaN DP
  gradients), never a silently wrong value, and a ``UserWarning`` names the layer when the
  computation runs (a host callback, only when a check fails).

With a batch of one, ``g_0`` is the batch gradient itself. The fast path costs one ordinary
backward pass plus ``O(B * (in + out))`` per dense call; no per-example weight gradient of a
dense layer with one row per example is ever formed.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from .. import _engine, _format, stats
from .._autodiff import value_and_grad as _vk_value_and_grad
from .._capture import CaptureSpec, RecordFn
from .._capture import capture as _capture
from .._errors import ConfigError
from .._kinds import AffineNorm, LayerKind
from .._names import matches_key

__all__ = ["PerExampleNorms", "dp_clip", "dp_noise", "per_example_grad_norms"]

# loss_fn on examples 0 and 1 together against its values on each alone (float32 losses; 8 eps
# for a less precise dtype): the two programs round differently
_MIX_RTOL, _MIX_ATOL = 1e-4, 1e-5


class PerExampleNorms(NamedTuple):
    """Per-example gradient norms ``||grad l_i||``, each of shape ``(B,)`` and float32.

    Attributes:
        total: over all parameters.
        layers: ``{layer name: norms}`` over the leaves each layer uses (a leaf shared by two
            layers counts for the first in forward order). Leaves used by no vjpkit layer are
            keyed by their parameter path (``"scale"``, ``"head/extra"``).
        params: keyed exactly like ``params``: one ``(B,)`` array per leaf.
    """

    total: jax.Array
    layers: dict[str, jax.Array]
    params: Any


# --------------------------------------------------------------------------------------------
# Trace-time analysis: the per-example program, its layer calls and which leaves each one uses.


@dataclasses.dataclass
class _Call:
    key: str
    name: str
    params: dict[str, tuple[int | None, tuple[int, ...]]]  # local name -> (leaf index | None, shape)
    derived: list[str]  # local names of params computed inside the loss (not leaves of params)
    kind: Any = None  # what the layer noted about itself (nn._kinds), e.g. an AffineNorm
    tree: Any = None  # the structure of the call's params, and the leaf index of each of its leaves
    order: list[int | None] = dataclasses.field(default_factory=list)
    foreign: LayerKind | None = None  # a foreign layer's kind (Flax, NNX, Equinox), or a conv's
    container: bool = False  # a call that contains other layer calls (a parent module)
    jaxpr: Any = None  # the call's computation in the program over a batch of one (a ClosedJaxpr)
    layout: Any = None  # its operands' layout (_engine.Layout)
    record: Any = None  # its record's shapes in that program (the example axis has length 1)
    batched: bool = True  # some operand depends on the example (False: the same for all examples)
    scans: tuple = ()  # lengths of the enclosing lax.scan s, outermost first (records stacked so)
    # under scans, each params leaf it uses: "stacked" (sliced by every enclosing scan, as xs) or
    # "const" (closed over by every one of them: the same array in every iteration)
    modes: dict = dataclasses.field(default_factory=dict)
    local: dict = dataclasses.field(default_factory=dict)  # role -> the param's own name, when renamed


def _per_example_loss(
    loss_fn: Callable,
    n_batch: int,
    reduction: str,
    who: str,
    with_losses: bool = False,
    given: frozenset = frozenset(),
) -> Callable:
    """``fun(params, *batch)``: ``mean_i l_i`` (or the sum), the ``l_i`` vmapped over the examples.

    The params leaves ``given`` (indices) come broadcast over the examples already
    (``_broadcast``), and are vmapped like the batch: the gradient with respect to them is
    ``grad l_i`` per example (times the mean's ``1/B``), and the layer calls that use them are
    per-example calls. With ``with_losses``, ``fun`` returns ``(L, (l_0, ..., l_{B-1}))`` (for
    ``has_aux``).
    """

    def single(params, *example):
        try:
            out = loss_fn(params, *jax.tree.map(lambda a: a[None], example))
        except ValueError as err:  # a shard_map cannot split a batch of one example
            if "shard_map" not in str(err):
                raise
            raise ConfigError(
                f"{who}: loss_fn runs a jax.shard_map over the batch, which cannot split the batch "
                "of one example each per-example loss is computed on. Call the tool inside the "
                "shard_map body instead (per-example statistics of each shard's rows), or run the "
                "loss on a sharded batch under jax.jit without shard_map."
            ) from err
        if not (hasattr(out, "shape") and tuple(out.shape) == ()):
            raise ConfigError(
                f"{who}: loss_fn must return a scalar: the mean (reduction='mean') or the sum "
                f"(reduction='sum') over the batch of per-example losses; on a batch of one example "
                f"it returned {getattr(out, 'shape', type(out).__name__)}."
            )
        return out

    def fun(params, *batch):
        axes = None
        if given:
            treedef = jax.tree.structure(params)
            axes = jax.tree.unflatten(treedef, [0 if i in given else None for i in range(treedef.num_leaves)])
        losses = jax.vmap(single, in_axes=(axes, *([0] * n_batch)))(params, *batch)
        total = jnp.mean(losses) if reduction == "mean" else jnp.sum(losses)
        return (total, losses) if with_losses else total

    return fun


# B x floats of a local or norm layer's leaf given to the loss per example (_small_local_leaves)
_GIVEN = 1 << 20


def _small_local_leaves(
    calls: list[_Call], users: dict, wanted: list, outside: dict, given: frozenset, paths: list,
    params: Any, b: int,
) -> frozenset:  # fmt: skip
    """The leaves of affine norms, other per-example ("local") layers and layers of no known kind
    given to the loss per example: the one backward pass then gives their per-example gradients
    exactly, for ``B x`` their floats, with no record kept and no per-example pull of the layer.
    Every leaf of such a call, each a vector or scalar in the call (a scale, a bias, a gain:
    batched, it costs no more than shared), small (``B x`` its floats at most ``_GIVEN``), used
    by such calls only, and no sibling of a leaf another call uses (a residual bias
    ``x + h @ W + b`` beside its ``W``: a batched ``b`` would change how the dense layer is
    matched)."""
    parent = [p.rsplit("/", 1)[0] if "/" in p else "" for p in paths]
    ndims = {ix: max(len(s) for c in cs for i, s in c.params.values() if i == ix) for ix, cs in users.items()}
    sizes = [int(np.prod(jnp.shape(a))) for a in jax.tree.leaves(params)]
    shared = {parent[ix] for c in calls for ix in c.order if ix is not None and not _local_call(c)}

    def ok(ix: int) -> bool:
        return (
            wanted[ix] and ix not in outside and ix not in given and ndims[ix] <= 1  # per call
            and b * sizes[ix] <= _GIVEN
            and all(_local_call(c) for c in users[ix]) and parent[ix] not in shared
        )  # fmt: skip

    chosen = {ix for ix in users if ok(ix)}
    # a call keeps all its leaves per example or none (the others as before)
    while partial := [c for c in calls if chosen & set(c.order) and not chosen >= set(c.order)]:
        chosen -= {ix for c in partial for ix in c.order}
    return frozenset(chosen)


def _local_call(c: _Call) -> bool:
    """An affine norm's, another per-example ("local") layer's or a layer of no known kind's call
    (a Flax ``GroupNorm``, a custom ``nn.layer``) on its own leaves only."""
    kind = isinstance(c.kind, AffineNorm) or (
        c.foreign.kind == "local" if c.foreign is not None else c.kind is None
    )
    return kind and None not in c.order and not c.derived


def _broadcast(params: Any, given: frozenset, size: int) -> Any:
    """``params`` with the leaves ``given`` (indices) broadcast over ``size`` examples."""
    flat, treedef = jax.tree.flatten(params)
    flat = [jnp.broadcast_to(a, (size, *jnp.shape(a))) if i in given else a for i, a in enumerate(flat)]
    return jax.tree.unflatten(treedef, flat)


def _map_calls(fun: Callable, params: Any, batch: tuple, who: str) -> tuple[list[_Call], dict]:
    """The layer calls of ``fun`` (forward order) with the params leaves each one uses, and the
    leaves the program uses other than as a layer call's params (``{leaf index: (in a loop or
    branch, which use)}``)."""
    config = _engine.configure(None, None, who)
    args = (params, *batch)
    traced = _engine.trace(config, fun, args, argnums=tuple(range(len(args))), check=False, params=(0,))
    _engine.require_unsharded(traced, "per-example statistics")
    n_leaves = len(jax.tree.leaves(params))  # the program's inputs: params leaves, then the batch
    n_inputs = len(traced.closed.jaxpr.invars)
    batched: set[int] = set()  # ids of the layer equations some example-dependent value reaches
    _batched_calls(traced.closed.jaxpr, [k >= n_leaves for k in range(n_inputs)], batched, {})
    outside: dict[int, tuple[bool, str]] = {}
    tags = [(k, "") if k < n_leaves else None for k in range(n_inputs)]
    _walk_uses(traced.closed.jaxpr, tags, None, outside, {})
    calls = []
    plan = traced.plan
    for key in plan.order:
        site = plan.by_key[key]
        n = site.layout.n_hoisted
        paths = jax.tree_util.tree_flatten_with_path(site.record.params)[0]
        entries, derived, order = {}, [], []
        origins, modes = list(site.origins), {}
        if site.scans:  # inside lax.scan: the leaves given to every scan alike (as xs or consts)
            for k, o in enumerate(origins):
                uniform = (
                    isinstance(o, _engine.Scanned) and len(o.how) == len(site.scans) and len(set(o.how)) == 1
                )
                origins[k] = o.leaf if uniform else None
                if uniform:
                    modes[o.leaf] = "stacked" if o.how[0] == "s" else "const"
        for (path, aval), origin, flag in zip(paths, origins[n:], site.flags[n:]):
            origin = origin if origin is not None and origin < n_leaves else None
            local_name = _format.path(path)
            if origin is None and flag:
                derived.append(local_name)
            entries[local_name] = (origin, tuple(aval.shape))
            order.append(origin)
        params_tree = jax.tree.structure(site.record.params)
        kind = site.kind
        norm = kind if isinstance(kind, AffineNorm) else None
        call = _Call(key, site.name, entries, derived, norm, params_tree, order)
        call.foreign = kind if isinstance(kind, LayerKind) else None
        call.container = plan.contains_calls(site)
        call.jaxpr, call.layout, call.record = site.span.jaxpr, site.layout, site.record
        call.batched = id(site.eqn) in batched or bool(site.scans) or site.in_cond
        call.scans, call.modes = tuple(site.scans), modes
        if call.foreign is not None and call.foreign.kind in ("dense", "conv", "lookup"):
            call.local = {call.foreign.roles.get(k, k): k for k in call.params}
            call.params = {call.foreign.roles.get(k, k): v for k, v in call.params.items()}
        calls.append(call)
    return calls, outside


def _span(eqn: Any) -> Any:
    source = _engine.SOURCES.get(eqn.primitive)
    return None if source is None else source(eqn)


def _call_nest(eqn: Any) -> Any:
    """The program a call-like equation runs on its operands (``_engine.Nested``), or ``None``."""
    return next((n for n in _engine.nested(eqn) if n.kind == "call"), None)


def _has_calls(jaxpr: Any, cache: dict) -> bool:
    """Whether a layer call runs anywhere inside ``jaxpr``."""
    if id(jaxpr) not in cache:
        cache[id(jaxpr)] = any(
            _span(e) is not None or any(_has_calls(j, cache) for j in _engine.sub_programs(e.params))
            for e in jaxpr.eqns
        )
    return cache[id(jaxpr)]


def _walk_uses(jaxpr: Any, tags: list, where: str | None, out: dict, cache: dict) -> list:
    """Records in ``out`` each params leaf that ``jaxpr`` uses other than as the params of a
    layer call: ``{leaf index: (in a loop or branch, the use)}``. ``tags``: per input, ``(leaf
    index, how)`` or None, where ``how`` has one letter per enclosing ``lax.scan`` the leaf was
    given to, outermost first: ``"s"`` sliced (``xs``), ``"c"`` closed over (a const); a leaf
    given to a layer call inside nested scans sliced by some and closed over by others is such a
    use (the engine's plan tags the others, ``_engine.Scanned``). Returns the tag of each output
    (values passed through unchanged), or None."""
    env = {v: t for v, t in zip(jaxpr.invars, tags) if t is not None}

    def read(a):
        return None if isinstance(a, jcore.Literal) else env.get(a)

    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        if all(t is None for t in ins):
            continue
        span = _span(eqn)
        if span is not None:
            n = span.layout.n_hoisted
            n_params = span.layout.tree.children()[0].num_leaves
            for k, t in enumerate(ins):
                if t is not None and k < n:
                    out.setdefault(
                        t[0], (False, f"closed over by layer {span.name!r} (not one of its params)")
                    )
                elif t is not None and k >= n + n_params:
                    out.setdefault(
                        t[0], (False, f"given to layer {span.name!r} as an input, not as its params")
                    )
                elif t is not None and len(set(t[1])) > 1:
                    out.setdefault(
                        t[0], (True, "passed into nested 'scan's, sliced by some and closed over by others")
                    )
            if _has_calls(span.jaxpr.jaxpr, cache):  # a parent module: its own code may use them too
                _walk_uses(span.jaxpr.jaxpr, ins, span.name, out, cache)
            continue
        nest = _engine.nested(eqn)
        kinds = {n.kind for n in nest}
        if "call" in kinds:
            (call,) = [n for n in nest if n.kind == "call"]
            for v, t in zip(eqn.outvars, _walk_uses(call.jaxpr, call.operands(ins), where, out, cache)):
                if t is not None:
                    env[v] = t
            continue
        prim = eqn.primitive.name
        if "scan" in kinds:  # a leaf given as xs (sliced) or a const: its layer calls are per iteration
            (scan,) = nest
            for t, r in zip(scan.operands(ins, "crs"), scan.roles):
                if t is not None and r == "r":
                    out.setdefault(
                        t[0], (True, "carried through a 'scan' (its value changes between iterations)")
                    )
            body = [(t[0], t[1] + r) if t is not None and r in "cs" else None
                    for t, r in zip(scan.operands(ins, "crs"), scan.roles)]  # fmt: skip
            _walk_uses(scan.jaxpr, body, where, out, cache)
            continue
        looped = bool(kinds & {"scan", "loop", "branch"})
        if looped:
            use = f"passed into a '{prim}' (a layer called in a loop or branch has no per-example record)"
        elif where:
            use = f"used by a '{prim}' in layer {where!r} outside its sublayers (e.g. a tied Embed.attend)"
        else:
            use = (
                f"used by a '{prim}' in the loss itself (e.g. a weight penalty: put weight decay in "
                "the optimizer; or a transposed or cast copy given to a layer)"
            )
        for t in ins:
            if t is not None:
                out.setdefault(t[0], (looped, use))
    return [read(v) for v in jaxpr.outvars]


def _batched_calls(jaxpr: Any, tainted: list, out: set, cache: dict) -> list:
    """Adds to ``out`` the id of every layer equation of ``jaxpr`` (and of the calls and jits it
    holds) that a value depending on the example reaches (``tainted``: per input); under
    ``vmap`` exactly these calls are batched. Returns, per output, whether it depends on it."""
    env = {v for v, t in zip(jaxpr.invars, tainted) if t}

    def read(a):
        return not isinstance(a, jcore.Literal) and a in env

    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        span = _span(eqn)
        call = None if span is not None else _call_nest(eqn)
        if span is not None:
            if any(ins):
                out.add(id(eqn))
            if _has_calls(span.jaxpr.jaxpr, cache):
                _batched_calls(span.jaxpr.jaxpr, ins, out, cache)
            outs = [any(ins)] * len(eqn.outvars)  # the batching rule batches every output
        elif call is not None:
            outs = _batched_calls(call.jaxpr, call.operands(ins), out, cache)
        else:
            outs = [any(ins)] * len(eqn.outvars)
        env.update(v for v, t in zip(eqn.outvars, outs) if t)
    return [read(v) for v in jaxpr.outvars]


def _batch_size(batch: tuple, who: str) -> int:
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ConfigError(
            f"{who}: call it as f(params, *batch) with at least one batch array (batch on axis 0)."
        )
    sizes = {int(np.shape(a)[0]) if np.ndim(a) else -1 for a in leaves}
    if len(sizes) != 1 or -1 in sizes:
        shapes = [tuple(np.shape(a)) for a in leaves]
        raise ConfigError(
            f"{who}: every batch argument must have the batch on axis 0, with one batch size; got "
            f"shapes {shapes}. Close over anything that is not per-example."
        )
    size = sizes.pop()
    if size == 0:
        raise ConfigError(f"{who}: the batch has no examples (axis 0 has length 0).")
    return size


def _mixes(call: _Call) -> bool:
    """A layer that mixes the examples of its input (batch statistics)."""
    if call.foreign is not None and call.foreign.kind == "batch":
        return True
    # nn.batch_norm in training mode: it notes itself as an AffineNorm only in eval mode
    return (
        call.kind is None and call.foreign is None and any(k.startswith("batch_stats/") for k in call.params)
    )


def _escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _tuple(v: Any, n: int) -> tuple[int, ...]:
    return (int(v),) * n if isinstance(v, (int, np.integer)) else tuple(int(a) for a in v)


def _padding(padding: Any) -> Any:
    return padding if isinstance(padding, str) else tuple((int(lo), int(hi)) for lo, hi in padding)


# --------------------------------------------------------------------------------------------
# Records with the example axis first, and what kind of per-example gradient a call gets.


def _example_axes(real: list, one: list, batch_size: int) -> list[int | None] | None:
    """Per leaf, the example axis: where the real record (batch ``B``) and the record of the
    same program over a batch of one differ (``None``: no such axis; the leaf does not depend on
    the example). ``None`` overall when the shapes do not differ on exactly one such axis."""
    axes = []
    for r, o in zip(real, one):
        if r is None or o is None:
            axes.append(None)
            continue
        rs, os_ = tuple(np.shape(r)), tuple(o.shape)
        if len(rs) != len(os_):
            return None
        diff = [k for k, (a, b) in enumerate(zip(rs, os_)) if a != b]
        if not diff:
            axes.append(None)
        elif len(diff) == 1 and os_[diff[0]] == 1 and rs[diff[0]] == batch_size:
            axes.append(diff[0])
        else:
            return None
    return axes


def _none_leaves(tree: Any) -> list:
    return jax.tree.leaves(tree, is_leaf=lambda v: v is None)


@dataclasses.dataclass
class _View:
    """One captured record's input and grad_output leaves, each with its example axis."""

    xs: list
    x_axes: list
    ds: list
    d_axes: list
    iters: int | None = None  # a call under lax.scan: the leaves lead with the iterations' axis

    def unstack(self) -> list[_View]:
        """One view per iteration (the whole view when not under a scan)."""
        if self.iters is None:
            return [self]
        return [
            _View(
                [x[k] for x in self.xs],
                self.x_axes,
                [None if d is None else d[k] for d in self.ds],
                self.d_axes,
            )
            for k in range(self.iters)
        ]

    def single(self) -> tuple[jax.Array, jax.Array] | None:
        """``(x, d)`` with the example axis first, for one batched input and one batched output."""
        if len(self.xs) != 1 or len(self.ds) != 1 or self.ds[0] is None:
            return None
        if self.x_axes[0] is None or self.d_axes[0] is None:
            return None
        return jnp.moveaxis(self.xs[0], self.x_axes[0], 0), jnp.moveaxis(self.ds[0], self.d_axes[0], 0)


_NOT_PER_EXAMPLE = (
    "no fast path: its input does not depend on the example (the same for every example, e.g. "
    "positions from arange), so its record holds no per-example part"
)


def _view(call: _Call, rec: Any, batch_size: int, stacked: bool = True) -> _View | str:
    """The call's record as a ``_View``, or why it has none. Under ``lax.scan`` the record is
    stacked on the enclosing scans' lengths (outermost first): one leading axis in the view
    (``stacked=False``: one iteration's record, as the backward pass makes it)."""
    xs, one_x = jax.tree.leaves(rec.input), jax.tree.leaves(call.record.input)
    ds, one_d = _none_leaves(rec.grad_output), _none_leaves(call.record.grad_output)
    if len(xs) != len(one_x) or len(ds) != len(one_d):
        return "no fast path: its record does not match the program's"
    iters = None
    if call.scans and stacked:
        n, lead = len(call.scans), tuple(call.scans)
        if any(a is not None and tuple(np.shape(a))[:n] != lead for a in (*xs, *ds)):
            return "no fast path: its record is not stacked on the scan's iterations"
        iters = int(np.prod(lead))
        xs, ds = ([None if a is None else a.reshape(iters, *a.shape[n:]) for a in v] for v in (xs, ds))
    x_axes = _example_axes([None if a is None else a[0] for a in xs] if iters else xs, one_x, batch_size)
    d_axes = _example_axes([None if a is None else a[0] for a in ds] if iters else ds, one_d, batch_size)
    if x_axes is None or d_axes is None:
        return "no fast path: its record's example axis could not be found"
    if all(a is None for a in x_axes):
        return _NOT_PER_EXAMPLE
    return _View(xs, x_axes, ds, d_axes, iters)


@dataclasses.dataclass
class _Use:
    key: str
    role: str
    kind: str  # "dense" | "conv" | "norm" | "local"
    conv: Any = None  # (strides, padding, dilation) for conv; the AffineNorm for norm


def _float(a: Any) -> bool:
    return jnp.issubdtype(a.dtype, jnp.floating)


def _classify(call: _Call, view: _View, conv_cfg: dict) -> tuple[str | None, Any]:
    """``("dense" | "conv" | "norm" | "local", config)``, or ``(None, why not)``."""
    roles = set(call.params)
    no = (None, "no fast path for this layer type")
    pair = view.single()
    if isinstance(call.kind, AffineNorm):
        ok = (
            pair is not None
            and pair[0].ndim >= 2
            and pair[1].shape == pair[0].shape
            and _float(pair[0])
            and all(call.params[r][1] == (pair[0].shape[-1],) for r in ("scale", "bias") if r in roles)
            and not call.derived
        )
        return ("norm", call.kind) if ok else (None, "no fast path: its record is not an affine norm's")
    kind = call.foreign
    if kind is not None and kind.kind == "local":
        return _classify_local(call, view)
    if kind is not None and kind.kind == "lookup":
        ok = (
            roles == {"weight"} and not call.derived and call.layout.n_hoisted == 0
            and len(view.xs) == 1 and view.x_axes[0] is not None and len(view.ds) == 1
            and view.d_axes[0] is not None and view.ds[0] is not None and _float(view.ds[0])
        )  # fmt: skip
        return ("lookup", kind.padding) if ok else (None, "no fast path: its record is not a lookup's")
    if kind is None:  # a layer of no known kind: the local path if it can, else `no`
        no = _custom(call, view, no)
    if "weight" not in roles or not roles <= {"weight", "bias"}:
        return no
    if pair is None or not _float(pair[0]):
        return (
            no
            if kind is None
            else (None, "no fast path: it needs one float input and one float output per example")
        )
    x, d = pair
    if kind is not None and kind.kind == "dense":
        return _classify_foreign_dense(call, x, d)
    if d.ndim != x.ndim:
        return no
    w = call.params["weight"][1]
    b = call.params.get("bias", (None, None))[1]
    if kind is None and len(w) == 2:
        ok = x.shape[-1] == w[0] and d.shape == (*x.shape[:-1], w[1]) and b in (None, (w[1],))
        return ("dense", None) if ok else no
    if len(w) not in (3, 4) or x.ndim < len(w):
        return no
    *kernel, cin, cout = w
    n = len(kernel)
    if x.shape[-1] != cin or d.shape[-1] != cout or b not in (None, (cout,)):
        return no
    if kind is not None and kind.kind == "conv":
        dilation = _tuple(kind.dilation, n) if kind.dilation else (1,) * n
        return "conv", (_tuple(kind.strides, n), _padding(kind.padding), dilation)
    for glob, (stride, padding) in conv_cfg.items():
        if matches_key(call.key, glob):
            return "conv", (_tuple(stride, n), _padding(padding), (1,) * n)
    return None, (
        "no fast path: a conv-shaped weight, but the layer does not give its strides and padding "
        "(pass conv={name: (stride, padding)})"
    )


def _custom(call: _Call, view: _View, no: tuple) -> tuple[str | None, Any]:
    """A layer of no known kind (a custom ``nn.layer``): the local path, a vmap over the examples
    of the vjp of its own computation (exact: the loss is vmapped over the examples, so each
    call is one example's; ``B x`` its parameter floats, as ``vmap(grad)`` of that layer alone),
    when it takes nothing but its params and inputs; else ``no``."""
    local = _classify_local(call, view)
    return ("local", "custom") if local[0] == "local" else no  # a derived param is None in order


def _classify_local(call: _Call, view: _View) -> tuple[str | None, Any]:
    n_kwargs = call.layout.tree.children()[2].num_leaves
    if None in call.order or call.layout.n_hoisted or n_kwargs:
        return None, "no fast path: it takes values other than its params and inputs"
    return "local", None


def _classify_foreign_dense(call: _Call, x: jax.Array, d: jax.Array) -> tuple[str | None, Any]:
    """A Flax ``Dense``/``DenseGeneral``, NNX ``Linear`` or Equinox ``Linear`` call."""
    kind = call.foreign
    no = (None, "no fast path: its record is not a dense layer's")
    if x.ndim < kind.in_ndim + 1:
        return no
    w = call.params["weight"][1]
    lead = x.ndim - kind.in_ndim
    n_in, n_out = int(np.prod(x.shape[lead:])), int(np.prod(d.shape[lead:]))
    if d.shape[:lead] != x.shape[:lead] or int(np.prod(w)) != n_in * n_out:
        return no
    left, right = _dense_axes(kind, w, d.ndim - lead)
    if int(np.prod([w[k] for k in left])) != n_in or int(np.prod([w[k] for k in right])) != n_out:
        return no
    return "dense", None


def _dense_axes(kind: LayerKind | None, w: tuple[int, ...], n_out_axes: int) -> tuple[tuple, tuple]:
    """The weight leaf's axes met by the input (in order) and those of the output (in order)."""
    if kind is not None and kind.axes:
        return tuple(kind.axes[0]), tuple(kind.axes[1])
    split = n_out_axes if kind is not None and kind.transpose else len(w) - n_out_axes
    if kind is not None and kind.transpose:  # stored (out..., in...)
        return tuple(range(split, len(w))), tuple(range(split))
    return tuple(range(split)), tuple(range(split, len(w)))


# --------------------------------------------------------------------------------------------
# Per-leaf per-example gradients, implicit (dense weights) or materialised (the rest).

_ROWS = {("dense", "weight"), ("lookup", "weight"), ("conv", "weight")}  # the uses stats.Rows holds


def _tol(dtype: Any) -> float:
    return max(1e-3, 32.0 * float(jnp.finfo(dtype).eps))


def _check(u: jax.Array, v: jax.Array, bound: jax.Array, tol: float) -> jax.Array:
    """``||u - v|| <= tol * ||bound||``: the batch gradient equals the sum of per-example ones."""
    err = jnp.sqrt(jnp.sum(jnp.square(u - v)))
    return err <= tol * jnp.sqrt(jnp.sum(jnp.square(bound))) + 1e-30


class _Leaf:
    """One parameter leaf's per-example gradients ``g_i``, and what is computed from them."""

    ok: jax.Array | None = None

    def sq_norms(self) -> jax.Array:  # (B,)
        raise NotImplementedError

    def weighted_sum(self, c: jax.Array) -> jax.Array:  # sum_i c_i g_i, leaf-shaped
        raise NotImplementedError

    def sum_sq(self) -> jax.Array:  # sum_i g_i**2, elementwise, leaf-shaped
        raise NotImplementedError

    def guard(self, x: jax.Array) -> jax.Array:
        return x if self.ok is None else jnp.where(self.ok, x, jnp.nan)


class _Materialized(_Leaf):
    def __init__(self, g: jax.Array, ok: jax.Array | None = None):
        self.g, self.ok = g, ok

    def sq_norms(self):
        return self.guard(jnp.sum(jnp.square(self.g), axis=tuple(range(1, self.g.ndim))))

    def weighted_sum(self, c):
        return self.guard(jnp.tensordot(c, self.g, axes=1))

    def sum_sq(self):
        return self.guard(jnp.sum(jnp.square(self.g), axis=0))


class _Factored(_Leaf):
    """A leaf's ``g_i`` in matrix form (``vjpkit.stats.Rows``, one per use): dense weights in any
    layout (``x @ W``, ``x @ W.T``, einsum projections), lookups, and a table tied to a head."""

    def __init__(self, rows: list, ok: jax.Array | None):
        self.rows, self.ok = rows, ok
        self._reduced: list = []

    def reduced(self) -> tuple[jax.Array, jax.Array] | None:
        """``(||g_i||^2, sum_i g_i)`` when the norms form the ``g_i`` (``stats.reduced``), once."""
        if not self._reduced:
            self._reduced.append(stats.reduced(self.rows))
        return self._reduced[0]

    def sq_norms(self):
        return self.guard(stats.sq_norms(self.rows, self.reduced()))

    def weighted_sum(self, c):
        return self.guard(stats.weighted_sum(self.rows, c))

    def sum_sq(self):
        return self.guard(stats.sum_sq(self.rows))


def _rows(call: _Call, view: _View, use: _Use, param_leaves: list, shape: tuple, scaled) -> Any:
    """One use of a dense weight, a conv kernel or a lookup table as ``stats.Rows``, examples
    first (a conv's rows are its output positions, ``a`` the unfolded patches)."""
    x, d = view.single()
    fk = call.foreign
    if use.kind == "conv":
        return stats.Rows.conv(*_scale_smaller(x, d, scaled), shape, *use.conv)
    if fk is not None and fk.kind == "lookup":
        d = scaled(d)
        index = _lookup_index(call, param_leaves, x, view.x_axes[0])
        if use.conv == "clip":  # the lookup's out-of-range mode
            return stats.Rows.lookup(jnp.clip(index, 0, shape[0] - 1), d, shape)
        valid = (index >= 0) & (index < shape[0])
        return stats.Rows.lookup(index, d, shape, valid.astype(d.dtype))
    n_in_axes = fk.in_ndim if fk is not None else 1
    lead = x.ndim - n_in_axes
    left, right = _dense_axes(fk, shape, d.ndim - lead)
    x = x.reshape(x.shape[0], -1, int(np.prod(x.shape[lead:])))
    return stats.Rows.dense(*_scale_smaller(x, d, scaled), shape, left, right)


def _scale_smaller(x: jax.Array, d: jax.Array, scaled) -> tuple[jax.Array, jax.Array]:
    """``(x, d)`` in float32 with the mean's factor ``B`` on the smaller of the two (``g_i`` is
    their product; a tied head's cotangent is ``B x T x vocab``: never copied scaled)."""
    if x.size <= d.size:
        return scaled(x), d.astype(jnp.float32)
    return x.astype(jnp.float32), scaled(d)


def _lookup_index(call: _Call, param_leaves: list, ids: jax.Array, axis: int) -> jax.Array:
    """The row of the table each position of ``ids`` (the call's input, examples first) reads,
    one example at a time as the call's program was traced: over a batch of one (its example
    axis ``axis``)."""
    index = stats.lookup_index(call.jaxpr)
    params = [param_leaves[i] for i in call.order]
    return jax.vmap(lambda x: index(*params, jnp.expand_dims(x, axis)))(ids)


def _local_per_example(call: _Call, param_leaves: list, view: _View) -> dict[str, jax.Array]:
    """Per-example gradients of one call's params: a vmap over the examples of the vjp of the
    call's own computation (as traced over a batch of one) on that example's operands."""
    fn = jcore.jaxpr_as_fun(call.jaxpr)
    p = [param_leaves[i] for i in call.order]
    out_avals = call.jaxpr.out_avals

    def one(xs, ds):
        xs = [x if a is None else jnp.expand_dims(x, a) for x, a in zip(xs, view.x_axes)]
        _, pullback = jax.vjp(lambda q: fn(*q, *xs), p)
        cts = []
        for aval, d, a in zip(out_avals, ds, view.d_axes):
            if not jnp.issubdtype(aval.dtype, jnp.inexact):
                cts.append(np.zeros(aval.shape, jax.dtypes.float0))
            elif d is None:
                cts.append(jnp.zeros(aval.shape, aval.dtype))
            else:
                cts.append((d if a is None else jnp.expand_dims(d, a)).astype(aval.dtype))
        return pullback(cts)[0]

    g = jax.vmap(one, in_axes=(view.x_axes, view.d_axes))(view.xs, view.ds)
    return dict(zip(call.params, g))


# --------------------------------------------------------------------------------------------
# The analysis shared by per_example_grad_norms, dp_clip and gradient_stats.


@dataclasses.dataclass
class Analysis:
    """Everything one call of the loss gives: loss, batch gradient and per-leaf ``g_i``."""

    loss: jax.Array
    grads: Any
    batch_size: int
    paths: list[str]
    owners: list[str]  # layer name (or parameter path) each leaf is reported under
    leaves: list[_Leaf | None]  # None: not analysed (gradient_stats on other layers)
    treedef: Any
    captured: dict
    calls: list[_Call]

    def leaf_sq_norms(self) -> list[jax.Array]:
        return [leaf.sq_norms() for leaf in self.leaves]


def analyze(
    loss_fn: Callable,
    params: Any,
    batch: tuple,
    *,
    reduction: str,
    who: str,
    check: bool = True,
    conv: dict | None = None,
    select: Callable[[str], bool] | None = None,
    capture_fields: Sequence[str] = ("input", "grad_output"),
    norms_only: bool = False,
) -> Analysis:
    """Runs the loss once (forward, one backward) and sets up each leaf's per-example gradients.

    ``select(layer name)`` limits the per-example work to the leaves of some layers (the others,
    and leaves used by no layer, get ``None``); all leaves are analysed when it is ``None``.
    With ``norms_only`` the caller asks the leaves for ``sq_norms`` alone: a call under
    ``lax.scan`` whose leaves are its own and sliced by the scans then reduces each iteration's
    record to its leaves' squared norms inside the backward pass (``_in_backward``), so its
    records are never stacked over the iterations.
    """
    batch_size = _batch_size(batch, who)
    flat_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = [_format.path(p) for p, _ in flat_paths]
    fun = _per_example_loss(loss_fn, len(batch), reduction, who)
    one = jax.tree.map(lambda a: a[:1], batch)
    all_calls, outside = _map_calls(fun, params, one, who)
    calls = [c for c in all_calls if not c.container]
    owners, wanted = [], []
    for i, path in enumerate(paths):
        owner = next((c.name for c in calls if any(ix == i for ix, _ in c.params.values())), None)
        wanted.append(select is None or (owner is not None and select(owner)))
        owners.append(owner if owner is not None else (path.rsplit("/", 1)[0] if "/" in path else path))
    if not any(wanted):  # no per-example gradient asked for (gradient_stats without variance)
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        return Analysis(loss, grads, batch_size, paths, owners, [None] * len(paths), treedef, {}, calls)
    mixing = [c.name for c in calls if _mixes(c)]
    if mixing:
        raise ConfigError(
            f"{who}: layer(s) {sorted(set(mixing))} normalise with statistics of the batch (batch norm "
            "in training mode): one example's output depends on the other examples, so per-example "
            "gradients are not defined (and DP-SGD's clipping does not bound an example's influence). "
            "Use the layer in eval mode (running statistics), or a per-example norm (layer, group or "
            "RMS norm)."
        )
    conv = dict(conv or {})
    scale = float(batch_size) if reduction == "mean" else 1.0

    def scaled(a):
        return a.astype(jnp.float32) * jnp.float32(scale)

    if batch_size == 1:  # the one example's gradient is the batch gradient
        loss, grads = jax.value_and_grad(fun)(params, *batch)
        leaves = [
            _Materialized(scaled(g)[None]) if w else None for g, w in zip(jax.tree.leaves(grads), wanted)
        ]
        return Analysis(loss, grads, 1, paths, owners, leaves, treedef, {}, calls)

    # Leaves whose every use is a call with an input the same for all examples (positions from
    # arange): lifted over the examples, their calls become per-example calls.
    users: dict[int, list[_Call]] = {}
    for c in calls:
        for ix in {ix for ix, _ in c.params.values() if ix is not None}:
            users.setdefault(ix, []).append(c)
    lifted = {
        ix
        for ix, cs in users.items()
        if wanted[ix] and ix not in outside and all(not c.batched and None not in c.order for c in cs)
    }
    lifted_names = {c.name for ix in lifted for c in users[ix]}
    for c in calls:  # capture chooses by name: a name with a batched call is not lifted
        if c.name in lifted_names and c.batched:
            lifted -= {ix for ix, _ in c.params.values()}
    lifted_names = {c.name for ix in lifted for c in users[ix]}
    # Those, and leaves used only outside every layer, not in a loop or branch (a class token
    # broadcast and concatenated, a bare scale): given to the loss broadcast over the examples,
    # so that their gradient in the one backward pass is per example (B x their size floats).
    given = frozenset(lifted) | frozenset(
        i for i in range(len(paths)) if wanted[i] and i in outside and not outside[i][0] and i not in users
    )
    given |= _small_local_leaves(calls, users, wanted, outside, given, paths, params, batch_size)
    run = _per_example_loss(loss_fn, len(batch), reduction, who, True, given)
    run_params = _broadcast(params, given, batch_size) if given else params

    def _could_be_fast(c: _Call) -> bool:
        if (
            c.name in lifted_names
            or all(ix in given for ix in c.order)
            or not any(ix is not None and wanted[ix] and ix not in outside for ix, _ in c.params.values())
        ):
            return False
        shapes = {k: s for k, (_, s) in c.params.items()}
        if isinstance(c.kind, AffineNorm) or (
            c.foreign is not None and c.foreign.kind in ("local", "dense", "lookup")
        ):
            return True
        if c.kind is None and c.foreign is None and None not in c.order:  # no derived params
            return not c.layout.n_hoisted  # a layer of no known kind: its own vjp (_custom)
        return "weight" in shapes and set(shapes) <= {"weight", "bias"} and len(shapes["weight"]) in (2, 3, 4)

    names = sorted({c.name for c in calls if _could_be_fast(c)})
    calls_by_key = {c.key: c for c in calls}
    # Calls under lax.scan whose every leaf is theirs alone and sliced by the scans: each
    # iteration's squared norms are formed where its record is, in the backward pass.
    decided: dict[str, tuple] = {}  # call key -> what _classify said, as the backward pass ran it
    in_backward = {}
    if norms_only:
        counts: dict[str, int] = {}
        for c in all_calls:
            counts[c.name] = counts.get(c.name, 0) + 1

        def own_stacked(c: _Call) -> bool:  # every leaf its alone, sliced by its scans
            return all(
                wanted[ix] and ix not in outside and ix not in given and len(users[ix]) == 1
                and c.modes.get(ix) == "stacked"
                for ix in c.order
            )  # fmt: skip

        for c in calls:
            # (outside scans, a conv's kernel gradients would be formed beside its own: slower)
            if c.scans and c.name in names and counts[c.name] == 1 and None not in c.order and own_stacked(c):
                in_backward[c.key] = c
    specs = [
        CaptureSpec((_escape(c.name),), tuple(capture_fields), RecordFn(fn))
        for c in in_backward.values()
        if (fn := _in_backward(c, calls_by_key, batch_size, conv, check, scaled, decided))
    ]
    full = [n for n in names if n not in {c.name for c in in_backward.values()}]
    specs += [_capture([_escape(n) for n in full], fields=list(capture_fields))] if full else []
    if specs:
        ((loss, losses), grads), captured = _vk_value_and_grad(run, has_aux=True, capture=specs)(
            run_params, *batch
        )
    else:
        ((loss, losses), grads), captured = jax.value_and_grad(run, has_aux=True)(run_params, *batch), {}
    per_given = {}
    if given:  # per example for the given leaves; their batch gradient is the sum over examples
        flat = jax.tree.leaves(grads)
        per_given = {i: flat[i] for i in given}
        grads = jax.tree.unflatten(
            treedef, [g.sum(0).astype(g.dtype) if i in given else g for i, g in enumerate(flat)]
        )
    if check:
        _check_independent(loss_fn, params, batch, losses, reduction, who)
    grad_leaves = jax.tree.leaves(grads)
    param_leaves = jax.tree.leaves(params)

    views: dict[str, _View] = {}
    # Which calls use each leaf, and how; why a call has no fast path.
    uses: list[list[_Use | None]] = [[] for _ in paths]
    why: dict[str, str] = {}
    for c in calls:
        kind, cfg = None, "no fast path for this layer type"
        if c.key in in_backward:
            kind, cfg = decided.get(c.key, (None, "no fast path: its backward pass did not run"))
        elif c.name in names and c.key in captured:
            view = _view(c, captured[c.key], batch_size)
            if isinstance(view, str):
                cfg = view
            else:
                views[c.key] = view
                kind, cfg = _classify(c, view.unstack()[0], conv)
        if kind is None:
            note = c.foreign.note if c.foreign is not None else ""
            why[c.key] = f"{cfg}; the layer is a {note}" if note else cfg
        for role, (ix, _) in c.params.items():
            if ix is not None:
                uses[ix].append(_Use(c.key, role, kind, cfg) if kind else None)

    def build(kind, role, vs, u, param_leaves, shape, agg) -> _Leaf:
        return _build_leaf(kind, role, vs, u, calls_by_key, param_leaves, shape, agg, scaled)

    leaves: list[_Leaf | None] = []
    fallback: dict[int, str] = {}
    noted: dict[str, tuple[str, list[str]]] = {}  # matched calls taken by the local path: why
    for i in range(len(paths)):
        if not wanted[i]:
            leaves.append(None)
            continue
        if i in given:
            leaves.append(_Materialized(scaled(per_given[i])))
            continue
        u = uses[i]
        if u and u[0] is not None and u[0].key in in_backward:  # reduced in the backward pass
            c = calls_by_key[u[0].key]
            note = "layer of no known kind" if u[0].conv == "custom" else c.foreign and c.foreign.note
            if u[0].kind == "local" and note:
                noted.setdefault(c.key, (note, []))[1].append(paths[i])
            leaves.append(_Summed(captured[c.key][u[0].role], len(c.scans)))
            continue
        kinds = {(x.kind, x.role) for x in u if x is not None}
        if kinds and kinds <= _ROWS:  # dense weights and lookups: one matrix form, cross terms kept
            kinds = {("rows", "weight")}
        if i in outside or not u or None in u or len(kinds) != 1:
            leaves.append(None)
            fallback[i] = _fallback_reason(i, u, outside, calls, why)
            continue
        kind, role = kinds.pop()
        agg = grad_leaves[i] if check else None
        if kind == "rows" and all(calls_by_key[x.key].foreign is not None for x in u):
            agg = None  # every use's layout was read from its equation or its layer: nothing guessed
        vs = [views[x.key] for x in u]
        shape = tuple(grad_leaves[i].shape)
        for x_use in u:
            c = calls_by_key[x_use.key]
            note = "layer of no known kind" if x_use.conv == "custom" else c.foreign and c.foreign.note
            if kind == "local" and note:
                noted.setdefault(c.key, (note, []))[1].append(paths[i])
        modes = {calls_by_key[x.key].modes.get(i) for x in u}
        sliced_too = any("stacked" in calls_by_key[x.key].modes.values() for x in u)
        if "stacked" not in modes and sliced_too and kind in ("local", "norm"):
            leaves.append(None)  # its calls also take other leaves sliced by the scan: not mapped
            fallback[i] = "no fast path: closed over by a scan whose layer also takes a leaf sliced by it"
            continue
        if "stacked" not in modes:  # closed over by a scan: each iteration is one more call
            us = [x for x, v in zip(u, vs) for _ in range(v.iters or 1)]
            vs = [w for v in vs for w in v.unstack()]
            leaves.append(build(kind, role, vs, us, param_leaves, shape, agg))
            continue
        lead = {calls_by_key[x.key].scans for x in u}
        if len(modes) != 1 or len(lead) != 1:
            leaves.append(None)
            fallback[i] = (
                "no fast path: the leaf is given to layer calls both as a scan's xs and otherwise, "
                "or to scans of different lengths"
            )
            continue
        lead = lead.pop()
        leaves.append(_Stacked(build, kind, role, vs, u, param_leaves, calls_by_key, lead, shape, agg))

    if noted:
        _warn_local(noted, who)
    if fallback:
        _warn_fallback(fallback, paths, owners, who)
        per_example = _vmap_grads(loss_fn, params, batch, list(fallback))
        for i, g in zip(fallback, per_example):
            leaves[i] = _Materialized(g.astype(jnp.float32))
    _report_failed_checks(leaves, paths, owners, who)
    # A leaf whose g_i are formed anyway (a conv's long rows): its batch gradient is their sum,
    # so the backward pass's own weight gradient of that layer is dead code (XLA drops it)
    flat = list(grad_leaves)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, _Factored) and leaf.ok is None and (done := leaf.reduced()) is not None:
            flat[i] = (done[1] / jnp.float32(scale)).astype(flat[i].dtype)
    grads = jax.tree.unflatten(treedef, flat)
    return Analysis(loss, grads, batch_size, paths, owners, leaves, treedef, captured, calls)


class _Summed(_Leaf):
    """A stacked leaf's squared norms (and check), formed per iteration in the backward pass
    (``_in_backward``): ``{"sq": (*iterations, B), "ok": (*iterations,) or None}``."""

    def __init__(self, part: dict, n_scans: int):
        self.sq = jnp.sum(part["sq"], axis=tuple(range(n_scans)))
        self.ok = None if part.get("ok") is None else jnp.all(part["ok"] > 0.5)

    def sq_norms(self):
        return self.guard(self.sq)


def _in_backward(
    call: _Call, calls_by_key: dict, batch_size: int, conv: dict, check: bool, scaled, decided: dict
) -> Callable:
    """``fn(record)`` of one iteration of a call under ``lax.scan`` whose leaves are its alone and
    sliced by the scans: ``{role: {"sq": ||g_ik||^2 (B,), "ok": its check}}``, the leaf built
    from this iteration's record as ``_Stacked`` builds it (the check against the record's own
    ``grad_params``, which is iteration ``k``'s slice of the batch gradient). What ``_classify``
    said goes to ``decided``; a call it rejects gives ``{}`` and its leaves fall back."""

    def fn(rec):
        view = _view(call, rec, batch_size, stacked=False)
        kind, cfg = (None, view) if isinstance(view, str) else _classify(call, view, conv)
        decided[call.key] = (kind, cfg)
        if kind is None:
            return {}
        p = dict(zip(call.order, jax.tree.leaves(rec.params)))
        batch_grads = dict(zip(call.params, _none_leaves(rec.grad_params)))
        out = {}
        for role, (_, shape) in call.params.items():
            rows = (kind, role) in _ROWS
            agg = None if not check or (rows and call.foreign is not None) else batch_grads[role]
            use = _Use(call.key, role, kind, cfg)
            leaf = _build_leaf(
                "rows" if rows else kind, role, [view], [use], calls_by_key, p, shape, agg, scaled
            )
            ok = None if leaf.ok is None else leaf.ok.astype(jnp.float32)
            out[role] = {"sq": leaf.sq_norms(), "ok": ok}
        return out

    return fn


def _build_leaf(kind, role, vs, u, calls_by_key, param_leaves, shape, agg, scaled) -> _Leaf:
    """One leaf's per-example gradients from the views ``vs`` of its uses ``u`` (one call each,
    not stacked), ``shape`` the leaf's, ``agg`` its batch gradient (None: no check)."""
    if kind == "local":
        g = 0.0
        for v, x_use in zip(vs, u):
            pex = _local_per_example(calls_by_key[x_use.key], param_leaves, v)
            g = g + scaled(pex[x_use.role])
        ok = None
        if agg is not None:
            bound = jnp.sum(jnp.abs(g), axis=0)
            ok = _check(scaled(agg), jnp.sum(g, axis=0), bound, _tol(agg.dtype))
        return _Materialized(g, ok)
    if kind == "rows":
        rows = [_rows(calls_by_key[x.key], v, x, param_leaves, shape, scaled) for v, x in zip(vs, u)]
        ok = None if agg is None else stats.check(rows, scaled(agg), _tol(agg.dtype))
        return _Factored(rows, ok)
    pairs = [v.single() for v in vs]
    batch_size = pairs[0][1].shape[0]
    if kind == "norm":
        return _norm_leaf(role, pairs, u, calls_by_key, param_leaves, shape, batch_size, scaled, agg)
    if role == "bias":
        ds = [scaled(d) for _, d in pairs]
        nb = int(np.prod(shape))
        g = sum(jnp.sum(a.reshape(batch_size, -1, nb), axis=1) for a in ds).reshape(batch_size, *shape)
        ok = None
        if agg is not None:
            bound = sum(jnp.sum(jnp.abs(a.reshape(-1, *shape)), axis=0) for a in ds)
            ok = _check(scaled(agg), jnp.sum(g, axis=0), bound, _tol(agg.dtype))
        return _Materialized(g, ok)
    raise AssertionError(f"no per-example rule for {kind!r} {role!r}")


class _Stacked(_Leaf):
    """A leaf stacked on the iterations of the scans it is given to as ``xs`` (shape
    ``(*lead, ...)``): slice ``k`` of ``g_i`` is iteration ``k``'s, from that iteration's records,
    so ``||g_i||^2 = sum_k ||g_ik||^2``. Each method maps the one-iteration leaf (the usual
    dense, bias, norm, conv or local one) over the iterations with ``jax.vmap``."""

    def __init__(self, build, kind, role, views, uses, param_leaves, calls_by_key, lead, shape, agg):
        self.build, self.kind, self.role, self.uses = build, kind, role, uses
        self.shape, self.slice = shape, shape[len(lead) :]
        n, iters = len(lead), int(np.prod(lead))
        self.x_axes = [(v.x_axes, v.d_axes) for v in views]
        self.arrays = [(v.xs, v.ds) for v in views]
        # the leaves these calls take sliced by the same scans: one slice per iteration
        sliced = {ix for x in uses for ix, m in calls_by_key[x.key].modes.items() if m == "stacked"}
        self.fixed = param_leaves
        self.sliced = {ix: param_leaves[ix].reshape(iters, *param_leaves[ix].shape[n:]) for ix in sliced}
        self.agg = None if agg is None else agg.reshape(iters, *self.slice)
        self._checked: list = []

    @property
    def ok(self) -> jax.Array | None:  # type: ignore[override]
        return None if self.agg is None else self._check()[1]

    def _check(self) -> tuple[jax.Array, jax.Array | None]:
        """The squared norms and the checks in one map over the iterations (a per-iteration
        leaf built twice would compute its per-example gradients twice)."""
        if not self._checked:

            def one(a, p, g):
                leaf = self._one(a, p, g)
                return leaf.sq_norms(), leaf.ok

            sq, oks = jax.vmap(one)(self.arrays, self.sliced, self.agg)
            self._checked.append((jnp.sum(sq, axis=0), None if oks is None else jnp.all(oks)))
        return self._checked[0]

    def _one(self, arrays, sliced, agg=None) -> _Leaf:
        views = [_View(xs, xa, ds, da) for (xs, ds), (xa, da) in zip(arrays, self.x_axes)]
        p = [sliced.get(ix, leaf) for ix, leaf in enumerate(self.fixed)]
        return self.build(self.kind, self.role, views, self.uses, p, self.slice, agg)

    def _map(self, f) -> jax.Array:
        return jax.vmap(lambda a, p: f(self._one(a, p)))(self.arrays, self.sliced)

    def sq_norms(self):
        if self.agg is not None:
            return self.guard(self._check()[0])
        return self.guard(jnp.sum(self._map(lambda leaf: leaf.sq_norms()), axis=0))

    def weighted_sum(self, c):
        return self.guard(self._map(lambda leaf: leaf.weighted_sum(c)).reshape(self.shape))

    def sum_sq(self):
        return self.guard(self._map(lambda leaf: leaf.sum_sq()).reshape(self.shape))


def _fallback_reason(i: int, uses: list, outside: dict, calls: list[_Call], why: dict) -> str:
    users = [c for c in calls if any(ix == i for ix, _ in c.params.values())]
    if i in outside:
        loop, use = outside[i]
        if loop:
            return f"no fast path: the leaf is {use}"
        if users:
            return f"no fast path: the leaf is also {use}"
        return f"used outside any vjpkit layer's params: {use}"
    if not users:
        return "used outside any vjpkit layer"
    for c in users:
        if c.key in why:
            return why[c.key]
    return "no fast path: its layers compute different kinds of gradient for it"


def _norm_leaf(role, pairs, uses, calls_by_key, param_leaves, shape, batch_size, scaled, agg) -> _Leaf:
    """Per-example gradients of one affine-norm parameter: ``scale``, ``bias`` or a statistic."""
    g, bound = 0.0, 0.0
    for (x, d), use in zip(pairs, uses):
        d = scaled(d)
        axes = tuple(range(1, d.ndim - 1))
        if role == "scale":
            local = {k: param_leaves[ix] for k, (ix, _) in calls_by_key[use.key].params.items()}
            x_hat = use.conv.normalize(local, x).astype(jnp.float32)
            term = d * x_hat
        elif role == "bias":
            term = d
        else:  # running statistics and the like: no gradient, by the AffineNorm contract
            term = None
        if term is not None:
            g = g + jnp.sum(term, axis=axes)
            bound = bound + jnp.sum(jnp.abs(term), axis=tuple(range(term.ndim - 1)))
    if isinstance(g, float):
        g = jnp.zeros((batch_size, *shape), jnp.float32)
    ok = None if agg is None else _check(scaled(agg), jnp.sum(g, axis=0), bound, _tol(agg.dtype))
    return _Materialized(g, ok)


def _warn_fallback(fallback: dict[int, str], paths, owners, who) -> None:
    groups: dict[tuple[str, str], list[str]] = {}
    for i, reason in fallback.items():
        groups.setdefault((owners[i], reason), []).append(paths[i])
    parts = [f"{owner!r} ({reason}; params {leaf_paths})" for (owner, reason), leaf_paths in groups.items()]
    warnings.warn(
        f"{who}: per-example gradients of {'; '.join(parts)} fall back to jax.vmap(jax.grad) of the "
        "per-example loss with respect to those parameters only (exact, but it forms their "
        "per-example gradients and runs a vmapped backward pass).",
        UserWarning,
        stacklevel=4,
    )


def _warn_local(noted: dict[str, tuple[str, list[str]]], who: str) -> None:
    """Layers with no dense/conv fast path (plain-JAX layers of another form, custom layers):
    the equation or why, the parameter paths, and the path taken instead."""
    parts = [f"{key!r} (a {note}; params {leaf_paths})" for key, (note, leaf_paths) in noted.items()]
    warnings.warn(
        f"{who}: no dense or conv fast path for the layer(s) {'; '.join(parts)}: the "
        "per-example gradients of those parameters are taken by a vmapped vjp of that layer's own "
        "computation over the examples (exact, but it forms batch x the layer's parameter size "
        "floats, as jax.vmap(jax.grad) would for them).",
        UserWarning,
        stacklevel=4,
    )


def _report_failed_checks(leaves: list, paths: list[str], owners: list[str], who: str) -> None:
    """A ``UserWarning`` naming every leaf whose consistency check fails (NaN norms), when the
    computation runs: a host callback, called only when a check fails."""
    checked = [(i, leaf.ok) for i, leaf in enumerate(leaves) if leaf is not None and leaf.ok is not None]
    if not checked:
        return
    labels = [f"{owners[i]!r} ({paths[i]})" for i, _ in checked]
    oks = jnp.stack([jnp.asarray(ok, bool).reshape(()) for _, ok in checked])

    def host(flags):
        bad = [label for label, ok in zip(labels, np.asarray(flags)) if not ok]
        if bad:
            warnings.warn(
                f"{who}: the per-example gradients of {', '.join(bad)} do not sum to the batch "
                "gradient, so their norms (and DP gradients) are NaN. The layer was taken as dense "
                "(or conv) by its parameter shapes, but its gradient is not x^T d (a custom layer): "
                "give it a kind, or compute it with jax.vmap(jax.grad).",
                UserWarning,
                stacklevel=2,
            )

    jax.lax.cond(jnp.all(oks), lambda f: None, lambda f: jax.debug.callback(host, f), oks)


def _check_independent(
    loss_fn: Callable, params: Any, batch: tuple, losses: jax.Array, reduction: str, who: str
) -> None:
    """Warns, when the computation runs, if ``loss_fn`` on examples 0 and 1 together differs from
    the reduction of its values on each alone (``losses[:2]``): a loss that mixes the examples."""
    pair = jax.tree.map(lambda a: a[:2], batch)
    joint = jnp.asarray(loss_fn(params, *pair))
    eps = 8.0 * max(float(jnp.finfo(joint.dtype).eps), float(jnp.finfo(losses.dtype).eps))
    rtol, atol = max(_MIX_RTOL, eps), max(_MIX_ATOL, eps)
    joint = joint.astype(jnp.float32).reshape(())
    sep = jnp.sum(losses[:2].astype(jnp.float32))
    sep = sep / 2 if reduction == "mean" else sep
    bound = jnp.sum(jnp.abs(losses[:2].astype(jnp.float32))) + jnp.abs(joint)
    ok = jnp.abs(joint - sep) <= rtol * bound + atol
    shown = "mean" if reduction == "mean" else "sum"

    def host(values):
        j, s = (float(v) for v in np.asarray(values))
        warnings.warn(
            f"{who}: loss_fn does not reduce independent per-example losses (reduction={reduction!r}): "
            f"on examples 0 and 1 together it returns {j:.6g}, but the {shown} of its values on each "
            f"example alone is {s:.6g}. The loss mixes the examples of a batch (centering or "
            "normalising over the batch, a contrastive term, batch statistics, random numbers drawn "
            "for the whole batch), or, with reduction='sum', adds a term once per batch (a weight "
            "penalty: use reduction='mean', or weight decay in the optimizer). The per-example "
            "gradients are those of loss_fn on each example alone (what jax.vmap(jax.grad) of it "
            f"gives), and the loss and grads returned are of their {shown}, not of loss_fn on the "
            "batch.",
            UserWarning,
            stacklevel=2,
        )

    values = jnp.stack([joint, sep])
    jax.lax.cond(ok, lambda v: None, lambda v: jax.debug.callback(host, v), values)


def _vmap_grads(loss_fn: Callable, params: Any, batch: tuple, indices: list[int]) -> list[jax.Array]:
    """``grad l_i`` of the leaves ``indices``, by ``jax.vmap(jax.grad)`` over examples."""
    flat, treedef = jax.tree.flatten(params)

    def single(sub, *example):
        full = list(flat)
        for i, leaf in zip(indices, sub):
            full[i] = leaf
        one = jax.tree.map(lambda a: a[None], example)
        return loss_fn(jax.tree.unflatten(treedef, full), *one)

    sub = [flat[i] for i in indices]
    return jax.vmap(jax.grad(single), in_axes=(None, *[0] * len(batch)))(sub, *batch)


def _check_reduction(reduction: str, who: str) -> str:
    if reduction not in ("mean", "sum"):
        raise ConfigError(
            f"{who}: reduction must be 'mean' (loss_fn returns the mean of per-example losses) or "
            f"'sum' (their sum), got {reduction!r}."
        )
    return reduction


def _check_conv(conv: Any, who: str) -> dict:
    if conv is None:
        return {}
    if not isinstance(conv, dict):
        raise ConfigError(f"{who}: conv must be {{glob: (stride, padding)}}, got {type(conv).__name__}.")
    for glob, cfg in conv.items():
        if not (isinstance(glob, str) and isinstance(cfg, (tuple, list)) and len(cfg) == 2):
            raise ConfigError(
                f"{who}: conv={{glob: (stride, padding)}}, e.g. {{'conv1': (2, 'SAME')}}; "
                f"got {glob!r}: {cfg!r}."
            )
    return conv


def _norms(a: Analysis) -> PerExampleNorms:
    sq = a.leaf_sq_norms()
    by_layer: dict[str, jax.Array] = {}
    for owner, s in zip(a.owners, sq):
        by_layer[owner] = by_layer.get(owner, 0.0) + s
    total = sum(sq) if sq else jnp.zeros((a.batch_size,), jnp.float32)
    return PerExampleNorms(
        total=jnp.sqrt(total),
        layers={k: jnp.sqrt(v) for k, v in by_layer.items()},
        params=jax.tree.unflatten(a.treedef, [jnp.sqrt(s) for s in sq]),
    )


def per_example_grad_norms(
    loss_fn: Callable,
    *,
    reduction: str = "mean",
    check: bool = True,
    conv: dict | None = None,
) -> Callable[..., tuple[jax.Array, Any, PerExampleNorms]]:
    """Per-example gradient norms ``||grad l_i||`` from layer records, in one backward pass.

    Args:
        loss_fn: ``loss_fn(params, *batch) -> L``, a scalar mean (or sum) over batch axis 0 of
            per-example losses ``l_i``; see the module docstring for the contract.
        reduction: ``"mean"`` or ``"sum"``: how ``L`` reduces the ``l_i``. The norms are of
            ``grad l_i`` either way (for a mean, ``B`` times example ``i``'s share of ``grad L``).
        check: verify per fast-path leaf that the per-example gradients sum to the batch
            gradient (a leaf that fails gets NaN norms, with a warning), and that ``loss_fn``
            on examples 0 and 1 together equals the reduction of its values on each alone
            (a loss that mixes the examples, or a per-batch term with ``reduction="sum"``:
            a warning). It costs a forward pass of two examples and a host callback (the
            warnings'), whose presence alone slows a CPU step 3-15%; ``False`` drops both.
        conv: ``{glob: (stride, padding)}`` for custom layers with a conv-shaped ``weight`` that
            give no kind (``nn.conv2d``, ``nn.conv1d`` and Flax ``Conv`` give their own); such
            a layer without an entry falls back, with a warning. Nothing is inferred from shapes.

    Returns:
        ``f(params, *batch) -> (loss, grads, norms)``: ``loss`` and ``grads`` of the mean (or
        sum) of the per-example losses, evaluated under ``jax.vmap`` over the examples (what
        ``jax.value_and_grad(loss_fn)`` returns, up to float rounding, for a loss that keeps to
        the contract), and a ``PerExampleNorms``. It can be jitted.

    Raises:
        ConfigError: a layer mixes the examples of its input (batch norm in training mode).

    Examples:
        >>> norms_fn = jax.jit(vk.inspect.per_example_grad_norms(loss_fn))
        >>> loss, grads, norms = norms_fn(params, x, y)
        >>> norms.total.shape, sorted(norms.layers)
        ((64,), ['fc1', 'fc2', 'fc3'])
    """
    who = "vk.inspect.per_example_grad_norms"
    _check_reduction(reduction, who)
    conv = _check_conv(conv, who)
    if not callable(loss_fn):
        raise ConfigError(f"{who}: loss_fn must be callable, got {type(loss_fn).__name__}.")

    def norms_fn(params, *batch):
        a = analyze(
            loss_fn, params, batch, reduction=reduction, who=who, check=check, conv=conv, norms_only=True
        )
        return a.loss, a.grads, _norms(a)

    return norms_fn


def dp_noise(key: jax.Array, step: Any, like: Any, stddev: float) -> Any:
    """The Gaussian noise ``dp_clip`` adds at ``step``: ``stddev * N(0, 1)``, shaped like ``like``.

    The key of step ``t`` is ``jax.random.fold_in(key, t)``, split into one key per leaf of
    ``like`` (in ``jax.tree.leaves`` order); each leaf's noise is float32 normal, cast to the
    leaf's dtype. A naive DP-SGD implementation that calls this gets the same noise.

    Examples:
        >>> noise = vk.inspect.dp_noise(jax.random.key(0), 3, params, 1.1 * 1.0)
    """
    step_key = jax.random.fold_in(key, jnp.asarray(step).astype(jnp.uint32))
    leaves, treedef = jax.tree.flatten(like)
    keys = jax.random.split(step_key, max(len(leaves), 1))
    return jax.tree.unflatten(
        treedef,
        [
            (stddev * jax.random.normal(k, jnp.shape(x), jnp.float32)).astype(jnp.result_type(x))
            for k, x in zip(keys, leaves)
        ],
    )


def dp_clip(
    l2_norm_clip: float,
    noise_multiplier: float,
    key: jax.Array,
    *,
    reduction: str = "mean",
    check: bool = True,
    conv: dict | None = None,
) -> Callable[[Callable], Callable]:
    """DP-SGD per-example clipping and noise, from the per-example norms of one backward pass.

    With ``g_i = grad l_i``, ``C = l2_norm_clip`` and ``sigma = noise_multiplier``, the DP
    gradient is ``(sum_i g_i * min(1, C / ||g_i||) + N(0, sigma^2 C^2)) / B``. The clipped sum
    is ``grad`` of ``sum_i c_i l_i`` with the factors ``c_i`` held constant; vjpkit forms it
    from the same records that gave the norms (``X^T (c * D)`` for a dense weight), so there
    is one backward pass, not two. The noise of step ``t`` is ``dp_noise`` ``(key, t, ...)``.

    Args:
        l2_norm_clip: the clipping norm ``C > 0``.
        noise_multiplier: ``sigma >= 0``; the noise stddev is ``sigma * C``.
        key: a PRNG key; each step folds in its ``step``.
        reduction: as in ``per_example_grad_norms`` (``loss_fn``'s contract).
        check: as in ``per_example_grad_norms``.
        conv: as in ``per_example_grad_norms``.

    Returns:
        A decorator: ``dp_clip(...)(loss_fn)`` is ``dp_grad(params, *batch, step) -> (loss,
        grads, norms)`` with the DP ``grads`` (keyed like ``params``, estimating the gradient of
        the *mean* loss) and the unclipped ``PerExampleNorms``. ``step`` is keyword-only
        (an int or a traced integer/float scalar).

    Examples:
        >>> dp_grad = jax.jit(vk.inspect.dp_clip(1.0, 1.1, jax.random.key(0))(loss_fn))
        >>> loss, grads, norms = dp_grad(params, x, y, step=0)
    """
    who = "vk.inspect.dp_clip"
    if not (isinstance(l2_norm_clip, (int, float)) and l2_norm_clip > 0):
        raise ConfigError(f"{who}: l2_norm_clip must be a positive number, got {l2_norm_clip!r}.")
    if not (isinstance(noise_multiplier, (int, float)) and noise_multiplier >= 0):
        raise ConfigError(f"{who}: noise_multiplier must be a number >= 0, got {noise_multiplier!r}.")
    _check_reduction(reduction, who)
    conv = _check_conv(conv, who)
    stddev = float(noise_multiplier) * float(l2_norm_clip)

    def decorate(loss_fn: Callable) -> Callable:
        if not callable(loss_fn):
            raise ConfigError(f"{who}(...) decorates a loss function; got {type(loss_fn).__name__}.")

        def dp_grad(params, *batch, step=None):
            if step is None:
                raise ConfigError(
                    f"{who}: pass the training step as dp_grad(params, *batch, step=t); it is folded "
                    "into the key so that each step draws fresh noise."
                )
            a = analyze(loss_fn, params, batch, reduction=reduction, who=who, check=check, conv=conv)
            norms = _norms(a)
            factor = jnp.minimum(1.0, l2_norm_clip / jnp.maximum(norms.total, 1e-30))
            noise = dp_noise(key, step, a.grads, stddev)
            clipped = [leaf.weighted_sum(factor) for leaf in a.leaves]
            grads = jax.tree.unflatten(
                a.treedef,
                [
                    ((c + n.astype(jnp.float32)) / a.batch_size).astype(n.dtype)
                    for c, n in zip(clipped, jax.tree.leaves(noise))
                ],
            )
            return a.loss, grads, norms

        return dp_grad

    return decorate
