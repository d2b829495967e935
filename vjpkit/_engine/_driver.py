"""The driver: the one way a user function is traced and linearized with hooks, capture and handlers.

Contract: every vjpkit transform and inspect tool goes through these functions, and nothing
outside the engine builds a configuration or a trace itself.

* ``configure(hooks, capture, transform)`` makes the immutable ``_context.Config`` of one
  transformed function (hooks and capture normalised and checked).
* ``trace(config, fun, args, kwargs, argnums=..., has_aux=...)`` traces ``fun(*args, **kwargs)``
  once under ``jax.make_jaxpr`` with every layer call marked (the program does not depend on
  the configuration), and plans it (``Plan``: names, active calls, record, state and probe
  shapes). ``args[i]`` for ``i`` in ``argnums`` are differentiated (all of them when ``None``).
  Called eagerly, the other arguments are concrete in the trace; when matching then finds the
  loss a parameter computation (the batch taken for a constant), the function is traced again
  with them as inputs, as under ``jax.jit`` (kept unless it needs them concrete).
* ``linearize(traced, hook_state, log)`` evaluates the program under ``jax.vjp`` through the
  runner, and returns ``(out, aux, pull)``. ``pull(seed)`` returns ``(grads, captured, new
  hook state, results)`` with one gradient per differentiated argument, the user's captured
  records, and ``results`` the other handlers' results (``trace(..., handlers=)``, by name);
  the host deliveries of the backward pass (``vk.on_host`` hooks, then capture ``host=``) are
  chained and tied ONCE to everything it returns.
* ``replan(traced, config, handlers)``: the same program planned for another configuration.
* ``init_hook_state(traced)`` gives the initial ``HookState`` of the configuration.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from .. import _compat, _context, _format, _hooks, _host
from .._capture import CaptureSpec, as_specs
from .._errors import ConfigError, VjpkitError
from .._hook_base import HookState
from .._trees import is_traced, vary, varying_axes
from . import _carry, _fori, _handlers, _match, _slots
from ._plan import Plan, Site
from ._rules import sub_programs
from ._run import Runner


def configure(
    hooks: Any = None, capture: Any = None, transform: str = "vk.grad", match: bool | None = None
) -> _context.Config:
    """The configuration of one transformed function; ``hooks`` may be already-normalised pairs.

    ``match``: find the layers of plain JAX code (``_match``); ``None``: on unless the
    environment variable ``VJPKIT_MATCH=0`` turns it off.
    """
    normalised = isinstance(hooks, tuple) and all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], tuple)
        for p in hooks
    )
    pairs = hooks if normalised else _context.normalize_hooks(hooks, transform)
    ready = isinstance(capture, tuple) and all(isinstance(c, CaptureSpec) for c in capture)
    specs = capture if ready else as_specs(capture, transform)
    if match is None:
        match = _match.enabled()
    elif not isinstance(match, bool):
        raise ConfigError(f"{transform}: match= takes True or False, got {type(match).__name__} {match!r}.")
    return _context.Config(pairs, specs, transform, match)


@dataclasses.dataclass
class Traced:
    """A traced program and its plan.

    Attributes:
        closed: the program, ``flat(*leaves) -> (out leaves, aux leaves)``.
        plan: its ``Plan``; out_tree: the treedef of ``(out, aux)``; n_out: leaves of ``out``.
        leaves: the differentiated leaves; tree: their treedef (a list, one entry per argnum).
    """

    closed: Any
    plan: Plan
    out_tree: Any
    n_out: int
    leaves: list
    tree: Any
    vma: tuple = ()  # the shard_map axes the arguments vary over (probes vary over them too)
    other_uses: list = dataclasses.field(
        default_factory=list
    )  # _match.OtherUse s: params used outside layers


def trace(
    config: _context.Config,
    fun: Callable,
    args: Sequence,
    kwargs: dict | None = None,
    *,
    argnums: Sequence[int] | None = None,
    has_aux: bool = False,
    check: bool = True,
    handlers: Sequence[_handlers.Handler] = (),
    params: Sequence[int] | None = None,
) -> Traced:
    """Traces ``fun(*args, **kwargs)`` once with every layer call marked, and plans it.

    With ``check``, a hook or capture glob that matches no layer call is a ``ConfigError``.
    ``handlers`` run after the default ones (hooks, capture, host) on every active call.
    ``params``: the differentiated arguments whose leaves plain-JAX matching takes as
    parameters (all of ``argnums`` when ``None``); the others are data to it.
    """
    kwargs = kwargs or {}
    nums = tuple(range(len(args))) if argnums is None else tuple(argnums)
    leaves, tree = jax.tree.flatten([args[i] for i in nums])

    def flat(*leaves, args=args, kwargs=kwargs):
        full = list(args)
        for i, d in zip(nums, jax.tree.unflatten(tree, leaves)):
            full[i] = d
        out = fun(*full, **kwargs)
        return (out[0], out[1]) if has_aux else (out, None)

    # Called eagerly (no argument is traced), what does not depend on the differentiated
    # arguments is computed as it is written, as eager jax.grad does: a loss may read concrete
    # values of its other arguments (int(y.max())).
    eager = not is_traced((args, kwargs))

    def marked(*leaves, eager=eager):
        with _context.activate(_context.LAYERS):
            if eager:
                with jax.ensure_compile_time_eval():
                    return flat(*leaves)
            return flat(*leaves)

    try:
        closed, shape = jax.make_jaxpr(marked, return_shape=True)(*leaves)
    except Exception:
        # Some programs cannot be evaluated at trace time (JAX inserts a pvary into the
        # constants of a jax.shard_map body): traced as under jit, as jax.grad would be; if that
        # fails too, the first error stands
        retraced = _as_under_jit(marked, leaves) if eager else None
        if retraced is None:
            raise
        closed, shape = retraced
    closed = _fori.hoist(closed)  # fori_loop's W[i] as the scan's xs, as lax.scan(body, x, W)
    other: list = []
    if config.match:
        kept = nums if params is None else tuple(params)
        paths = iter(_leaf_paths([args[i] for i in kept], kept))
        names = [next(paths) if i in kept else None for i in nums for _ in jax.tree.leaves(args[i])]
        matched, other = _match.rewrite(closed, names)
        if eager and (
            any(u.primitive == "output" and not u.where for u in other) or _folded_ids(matched.jaxpr)
        ):
            # the loss returned a parameter computation: the eager trace took the batch for a
            # constant (x * a**2 is then a parameter computation, and no layer reads it); or a
            # lookup reads ids folded into a constant (jnp's index array, not the ids). Traced
            # with the data as inputs, as under jax.jit, so both find the same layers and records
            again = _data_as_inputs(flat, leaves, args, kwargs, nums, names)
            if again is not None:
                matched, other, shape = again
        closed = matched
    out_tree = jax.tree.structure(shape)
    n_out = len(jax.tree.leaves(shape[0]))
    plan = Plan(config, closed.jaxpr, [True] * len(leaves), _handlers.chain(_handlers.default(), *handlers))
    if check:
        config.check_matched(plan.names)
    return Traced(closed, plan, out_tree, n_out, leaves, tree, _varying_axes((args, kwargs)), other)


def _folded_ids(jaxpr: Any) -> bool:
    """Whether a matched lookup, at any depth of the program, reads the gather's index array
    itself (no jnp indexing step before it): called eagerly, jnp's indexing of the batch ran at
    trace time (``ids[..., None]``, negative ids wrapped), so the lookup's ``input`` would be
    that array instead of the ids it reads under ``jax.jit``."""
    for e in jaxpr.eqns:
        programs = sub_programs(e.params)  # a matched equation's own: the layer's program
        lookup = e.primitive is _match.match_p and getattr(e.params["kind"].value, "kind", None) == "lookup"
        if (lookup and any(_reads_index_array(j) for j in programs)) or any(map(_folded_ids, programs)):
            return True
    return False


def _reads_index_array(layer: Any) -> bool:
    """Whether a lookup's program takes its gather's index array as its input (its last)."""
    gather = next((q for q in layer.eqns if q.primitive.name == "gather"), None)
    return gather is not None and gather.invars[1] is layer.invars[-1]


def _data_as_inputs(flat: Callable, leaves: list, args: Sequence, kwargs: dict, nums: Sequence[int],
                    names: list) -> tuple | None:  # fmt: skip
    """The eagerly called program traced again with the array leaves of its other arguments as
    inputs (data, as under ``jax.jit``), matched, and those inputs bound back as its constants:
    ``(closed, other uses, shape)``, or ``None`` when the function needs them concrete."""
    data, data_tree = jax.tree.flatten(([a for i, a in enumerate(args) if i not in nums], kwargs))
    at = [i for i, x in enumerate(data) if isinstance(x, (jax.Array, np.ndarray))]
    if not at:
        return None

    def with_data(*values):
        given = list(data)
        for i, v in zip(at, values[len(leaves) :]):
            given[i] = v
        rest, kw = jax.tree.unflatten(data_tree, given)
        rest = iter(rest)
        full = [args[i] if i in nums else next(rest) for i in range(len(args))]
        with _context.activate(_context.LAYERS):
            return flat(*values[: len(leaves)], args=full, kwargs=kw)

    try:
        closed, shape = jax.make_jaxpr(with_data, return_shape=True)(*leaves, *(data[i] for i in at))
        closed = _fori.hoist(closed)
        matched, other = _match.rewrite(closed, [*names, *([None] * len(at))])
    except Exception:  # a value the function reads concretely (int(y.max())): the eager trace stands
        return None
    j = matched.jaxpr
    n = len(leaves)
    program = _compat.open_jaxpr(
        [*j.invars[n:], *j.constvars], j.invars[:n], j.outvars, j.eqns, j.effects, j.debug_info
    )
    return _compat.closed_jaxpr(program, [*(data[i] for i in at), *matched.consts]), other, shape


def replan(traced: Traced, config: _context.Config, handlers: Sequence[_handlers.Handler] = ()) -> Traced:
    """The same traced program planned for another configuration (no new trace).

    A transform that pulls one program with different handlers per backward pass (curvature
    statistics beside hooks: the hooks run in the gradient's pass only) linearizes each plan
    once; each pull traces its own backward pass, so no handler decision is shared through
    JAX's caches of transposed programs.
    """
    plan = Plan(
        config,
        traced.closed.jaxpr,
        [True] * len(traced.leaves),
        _handlers.chain(_handlers.default(), *handlers),
    )
    config.check_matched(plan.names)
    return dataclasses.replace(traced, plan=plan)


def _as_under_jit(marked: Callable, leaves: list) -> tuple | None:
    """``make_jaxpr`` of ``marked`` traced without evaluating at trace time, or ``None`` when
    that fails too (vjpkit's own errors, which say what is wrong with the function, propagate)."""
    try:
        return jax.make_jaxpr(functools.partial(marked, eager=False), return_shape=True)(*leaves)
    except VjpkitError:
        raise
    except Exception:
        return None


def require_unsharded(traced: Traced, what: str) -> None:
    """A ``ConfigError`` when a layer call of ``traced`` runs inside a ``jax.shard_map`` of the
    function: ``what`` (per-example or curvature statistics) reads records per example of the
    whole batch, which a shard_map splits."""
    inside = [s.key for s in traced.plan.by_key.values() if s.shards]
    if inside:
        raise ConfigError(
            f"{traced.plan.config.transform}: layer call(s) {inside} run inside a jax.shard_map in the "
            f"function, so their records are per shard; {what} are computed from the whole batch's "
            "records and do not take them. Call the tool inside the shard_map body instead (each "
            "shard's statistics; vk.curvature.kfac averages its factors over the shards with "
            "axis_name=), or run the function on a sharded batch under jax.jit without shard_map."
        )


def _leaf_paths(diff: list, nums: Sequence[int]) -> list[str]:
    """``/``-joined paths of the differentiated leaves: inside the argument when only one is
    differentiated, else under ``arg{i}``; a bare array argument is ``arg{i}``."""
    paths = []
    for keys, _ in jax.tree_util.tree_flatten_with_path(diff)[0]:
        if len(keys) > 1 and keys[-1] == jax.tree_util.GetAttrKey("value"):  # an NNX Variable's value
            keys = keys[:-1]
        inner, arg = _format.path(keys[1:]), f"arg{nums[keys[0].idx]}"
        paths.append(inner if inner and len(diff) == 1 else f"{arg}/{inner}" if inner else arg)
    return paths


def _varying_axes(tree: Any) -> tuple:
    """Inside ``jax.shard_map``: the manual axes any argument varies over (sorted), else ``()``."""
    return tuple(sorted(frozenset().union(*(varying_axes(leaf) for leaf in jax.tree.leaves(tree)))))


def linearize(traced: Traced, hook_state: Any = None, log: list | None = None):
    """``(out, aux, pull)`` of the traced program (see the module contract).

    ``pull`` is a ``jax.tree_util.Partial`` (a pytree, so ``jit`` can take it). ``log``, when
    given, receives the key of every call whose backward pass runs, in backward order, at trace
    time.
    """
    plan = traced.plan
    handler = plan.handlers if log is None else _handlers.chain(_handlers.log(log), plan.handlers)
    runner = Runner(plan, handler, compile_calls=log is None)
    probes0 = _slots.probes(plan)
    states0 = _slots.layer_states(plan, hook_state)
    carriers = {s.carrier: jnp.zeros(s.shards, jnp.float32) for s in plan.active() if s.carrier}
    if traced.vma:  # per-shard records: each shard's probe varies, so its cotangent is not summed
        probes0 = jax.tree.map(lambda z: vary(z, traced.vma), probes0)
        carriers = {k: vary(v, traced.vma) for k, v in carriers.items()}
    states0.update(carriers)

    def program(leaves, probes, states):
        outs, states = runner.eval(traced.closed.jaxpr, traced.closed.consts, leaves, (), probes, states)
        return (outs[: traced.n_out], states), outs[traced.n_out :]

    (outs, _), pullback, aux_leaves = jax.vjp(program, list(traced.leaves), probes0, states0, has_aux=True)
    out_shape, aux_shape = jax.tree.unflatten(traced.out_tree, [0] * traced.out_tree.num_leaves)
    out = jax.tree.unflatten(jax.tree.structure(out_shape), outs)
    aux = jax.tree.unflatten(jax.tree.structure(aux_shape), aux_leaves)
    pull = jax.tree_util.Partial(functools.partial(_pull, plan, traced.tree), pullback, states0, hook_state)
    return out, aux, pull


def _pull(plan: Plan, tree: Any, pullback: Callable, states0: dict, hook_state: Any, seed: Any) -> tuple:
    g_leaves, g_probes, g_states = pullback((list(jax.tree.leaves(seed)), states0))
    results = plan.handlers.result(plan, functools.partial(_carry.read, plan, g_probes))
    captured = results.pop("captured")
    host, token = _slots.send_host(plan, g_probes, hook_state)
    state = _slots.new_state(plan, hook_state, g_states, host)
    state, token = _slots.deliver(plan.config, captured, state, after=token)
    grads = jax.tree.unflatten(tree, g_leaves)
    _hooks.warn_kept()  # the backward pass is traced: a record still alive was kept by a hook
    return _host.tie(token, (grads, captured, state, results))


def init_hook_state(traced: Traced) -> HookState:
    """Initial states of every stateful call of the traced program, and the host counters."""
    return _slots.init_states(traced.plan, _forward_values(traced))


def _forward_values(traced: Traced) -> Callable[[Site], Any]:
    """``params(site)``: the params a stateful call used, for its hooks' ``init``.

    An ``init`` that reads only shapes (all of vjpkit's) is evaluated on shapes. One that reads
    values gets them from one forward evaluation; inside ``lax.scan`` or ``lax.cond`` a call
    has no single params value, which is an error.
    """
    cache: dict[str, Any] = {}

    def params(site: Site) -> Any:
        def init(p):
            return _hooks.init_state(site.hooks, p)

        closed = jax.make_jaxpr(init)(site.record.params)
        if not _depends(closed.jaxpr):
            return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), site.record.params)
        if site.stack or site.in_cond:
            raise ConfigError(
                f"{traced.plan.config.transform}: the init of the hooks on layer {site.key!r} reads its "
                "params' values, but the layer runs inside lax.scan, jax.shard_map or lax.cond, where "
                "its params differ per iteration, shard or branch. Make init depend on shapes only "
                "(jnp.zeros_like)."
            )
        if not cache:
            _collect(traced, cache)
        return cache[site.key]

    return params


def _depends(jaxpr: Any) -> bool:
    """Whether any output of ``jaxpr`` depends on its inputs."""
    live = set(jaxpr.invars)
    for eqn in jaxpr.eqns:
        if any(not isinstance(a, jcore.Literal) and a in live for a in eqn.invars):
            live.update(eqn.outvars)
    return any(not isinstance(v, jcore.Literal) and v in live for v in jaxpr.outvars)


def _collect(traced: Traced, out: dict) -> None:
    plan = traced.plan

    class Collect(Runner):
        def layer(self, eqn, invals, p, probes, states):
            site = plan.sites[p]
            out.setdefault(site.key, site.layout.split(invals)[1][0])
            inner = site.span.jaxpr
            return self.eval(inner.jaxpr, inner.consts, invals, p, probes, states)

    Collect(plan).eval(traced.closed.jaxpr, traced.closed.consts, list(traced.leaves), (), {}, {})
