"""One jitted training step: vjpkit gradients (hooks, capture, hook state) and an optax update.

Contract: ``make_step`` returns ``step(state, batch) -> (state, metrics)``, a plain
``jax.jit`` function with the state donated. ``metrics`` has ``"loss"`` and, with ``capture``,
``"captured"``. The loss is ``loss_fn(params, batch)``, or ``loss_fn(params, batch, key=k)``
when it declares ``key``; ``k`` is split from ``state.rng`` each step. Hook state is threaded
through ``state.hook_state`` when the hooks keep any. Everything is checked at trace time, so
``jax.eval_shape(step, state, batch)`` validates a configuration without compiling.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from .. import _autodiff, _capture, _host
from .._errors import ConfigError
from .._trees import is_traced
from ..curvature import KfacState, ScaleByKfacState, StatsSpec
from ._state import TrainState, keep_types

NAN_POLICIES = ("stop", "continue", "off")


def check_optimizer(optimizer: Any) -> optax.GradientTransformation:
    """The optax ``GradientTransformation`` of ``optimizer``; raises for anything else.

    ``optax.MultiSteps`` (gradient accumulation) is a class with ``init`` and ``update`` rather
    than a ``GradientTransformation``; its own ``init`` and ``update`` are used, as a
    ``GradientTransformationExtraArgs`` (its ``update`` passes extra arguments, K-FAC's
    ``curvature=``, to the transformation it wraps; its ``gradient_transformation()`` drops them).
    """
    if isinstance(optimizer, optax.MultiSteps):
        return optax.GradientTransformationExtraArgs(optimizer.init, optimizer.update)
    if not isinstance(optimizer, optax.GradientTransformation):
        raise ConfigError(
            f"the optimizer must be an optax.GradientTransformation (for example optax.sgd(0.1), "
            f"optax.adam(1e-3), or optax.MultiSteps(...)), got {type(optimizer).__name__}. Pass the "
            "transformation itself, not its init/update functions or an optimizer state."
        )
    return optimizer


def _wants_key(loss_fn: Callable) -> bool:
    try:
        parameters = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):
        return False
    return "key" in parameters


def _curvature_specs(capture: Any) -> list:
    return [c for c in _capture.items(capture) if isinstance(c, StatsSpec)]


def _is_kfac(x: Any) -> bool:
    return isinstance(x, (KfacState, ScaleByKfacState))


def due_phase(state: TrainState, curvature_every: int) -> str:
    """The program of the host dispatch for the step at ``state``: ``"stats"`` when K-FAC's
    update count is a multiple of ``curvature_every``, else ``"plain"``. The count is read from
    this process's own copy of the replicated state (one scalar; every process picks the same)."""
    count = _kfac_states(state)[0].count
    local = count.addressable_data(0) if hasattr(count, "addressable_data") else count
    return "stats" if int(np.asarray(local)) % curvature_every == 0 else "plain"


def _kfac_states(state: TrainState) -> list:
    """The K-FAC states inside the optimizer state (a ``kfac`` or ``scale_by_kfac`` anywhere)."""
    return [x for x in jax.tree.leaves(state.opt_state, is_leaf=_is_kfac) if _is_kfac(x)]


def _check_curvature_every(every: Any, capture: Any, curvature: list) -> None:
    if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 1:
        raise ConfigError(f"make_step: curvature_every must be an int >= 1, got {every!r}.")
    if every == 1:
        return
    if not curvature or len(curvature) != len(_capture.items(capture)):
        raise ConfigError(
            f"make_step: curvature_every={every} skips the statistics of vk.curvature.stats on the "
            "other steps, so capture= must hold vk.curvature.stats specs only (got "
            f"{capture!r}); capture other records in a separate step, or leave curvature_every=1."
        )


def _select(ok: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def make_step(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    *,
    hooks: dict | None = None,
    capture: Any = None,
    nan_policy: str = "stop",
    curvature_every: int = 1,
    jit: bool = True,
) -> Callable:
    """A training step ``step(state, batch) -> (state, metrics)``.

    Args:
        loss_fn: ``loss_fn(params, batch[, key=k]) -> scalar``.
        optimizer: an optax ``GradientTransformation`` or ``optax.MultiSteps``. Transformations
            that read the loss get it as in an optax loop: ``update(grads, opt_state, params,
            value=loss, grad=grads, value_fn=...)`` (``optax.reduce_on_plateau``,
            ``optax.lbfgs``), where ``value_fn(params)`` is the loss on this step's batch.
        hooks: layer hooks, as in ``vjpkit.grad``; stateful ones use ``state.hook_state``.
        capture: capture spec(s), as in ``vjpkit.grad``; records go to ``metrics["captured"]``.
        nan_policy: ``"stop"``: a step whose loss or gradients are not finite, and every later
            one, leaves the state unchanged, step count and rng included, and sends nothing to the host
            (``state.nonfinite_step`` records it); ``"continue"``: it is recorded
            and training goes on; ``"off"``: nothing is checked.
        curvature_every: with ``capture=`` holding only ``vk.curvature.stats`` specs, compute the
            statistics only on the steps where K-FAC's update count is a multiple of
            ``curvature_every`` (its first update always has them; jitted, two programs chosen on
            the host by that count, one scalar read per step; with ``jit=False``, a ``lax.cond``,
            whose branches XLA:CPU compiles slowly for convolutions); the other steps
            take a plain gradient and ``optimizer.update(..., curvature=None)`` (K-FAC keeps its
            EMA and cached inverses), and their ``metrics["captured"]`` is NaN. K-FAC refreshes
            its inverses on a step with statistics whose count is a multiple of its
            ``update_every``: make ``update_every`` a multiple of ``curvature_every`` (else the
            refresh comes every least common multiple of the two). Its ``decay`` applies per
            statistics step.
        jit: return the ``jax.jit``-compiled step (state donated); ``False`` gives the traceable
            function, for ``lax.scan`` or a custom jit.

    Examples:
        >>> step = vk.train.make_step(loss_fn, optax.sgd(0.1))
        >>> state, metrics = step(vk.train.TrainState.create(params, optax.sgd(0.1)), (x, y))
    """
    options = dict(hooks=hooks, capture=capture, nan_policy=nan_policy, curvature_every=curvature_every)
    step = build_step(loss_fn, optimizer, **options)
    if not jit:
        return step
    compiled = jax.jit(step, donate_argnums=0)
    if curvature_every == 1:
        return compiled
    # XLA:CPU compiles the convolutions inside lax.cond's branches without canonicalising their
    # layouts (jax#12868): a CNN's step in the cond measured 13x the same step outside it. So the
    # jitted step is two programs, chosen on the host by K-FAC's update count (one scalar read).
    phases = {
        phase: jax.jit(build_step(loss_fn, optimizer, **options, phase=phase), donate_argnums=0)
        for phase in ("stats", "plain")
    }

    @functools.wraps(compiled)
    def dispatched(state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        kfacs = _kfac_states(state)
        if not kfacs or is_traced((state, batch)):  # traced (or an error to raise): the cond
            return compiled(state, batch)
        return phases[due_phase(state, curvature_every)](state, batch)

    return dispatched


def build_step(
    loss_fn: Callable,
    optimizer: Any,
    *,
    hooks: dict | None = None,
    capture: Any = None,
    nan_policy: str = "stop",
    report_finite: bool = False,
    curvature_every: int = 1,
    phase: str | None = None,
) -> Callable:
    """``make_step``'s traceable step; ``report_finite`` adds ``metrics["finite"]`` (this step's
    loss and gradients were finite), which ``fit`` reads to record every non-finite step.
    ``phase`` (with ``curvature_every > 1``): ``"stats"`` or ``"plain"``, the one branch of the
    ``lax.cond`` the caller knows is due (``make_step``'s host dispatch)."""
    optimizer = check_optimizer(optimizer)
    if nan_policy not in NAN_POLICIES:
        raise ConfigError(f"nan_policy must be one of {NAN_POLICIES}, got {nan_policy!r}.")
    # vk.curvature's Monte-Carlo statistics sample labels with key= (the loss gets it too if it
    # takes one), and a K-FAC optimizer reads the statistics as update(..., curvature=captured)
    curvature = _curvature_specs(capture)
    wants_key = _wants_key(loss_fn) or any(spec.sampled for spec in curvature)
    # Transformations that read the loss (optax.reduce_on_plateau, optax.lbfgs and its line
    # search) take it as update(..., value=, grad=, value_fn=); optax passes these extra
    # arguments on to the members of a chain that use them, and the others ignore them.
    extra_args = isinstance(optimizer, optax.GradientTransformationExtraArgs)
    value_and_grad = _autodiff.value_and_grad(loss_fn, hooks=hooks, capture=capture)
    captures = capture is not None
    _check_curvature_every(curvature_every, capture, curvature)
    # the steps without statistics keep the gradient's rows when the spec asks for them (K-FAC's
    # records form with the cached inverses)
    rows_spec = [s._replace(which=("grad_rows",)) for s in curvature if "grad_rows" in s.which]
    plain = (
        _autodiff.value_and_grad(loss_fn, hooks=hooks, capture=rows_spec or None)
        if curvature_every > 1
        else None
    )

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        kfacs = _kfac_states(state)
        if not curvature and kfacs:
            raise ConfigError(
                "make_step: the optimizer holds vk.curvature.kfac, which preconditions with the "
                "statistics a vk.curvature.stats capture gives each step, but capture= has none: "
                "every step would be momentum SGD. Pass capture=vk.curvature.stats(layers, "
                "['kfac']) (the spec like= was built from), or use another optimizer."
            )
        if kfacs and not extra_args:
            raise ConfigError(
                "make_step: the optimizer holds vk.curvature.kfac inside a transformation whose "
                "update takes no extra arguments (an optax.GradientTransformation, not "
                "...ExtraArgs), so K-FAC would never get the statistics (update(..., curvature=)) "
                "and every step would be NaN. Wrap it with optax.with_extra_args_support, or build "
                "the chain with optax.chain, which passes them on."
            )
        if plain is not None and not kfacs:
            raise ConfigError(
                f"make_step: curvature_every={curvature_every}, but the optimizer holds no "
                "vk.curvature.kfac to take the statistics (update(..., curvature=)): use it (alone "
                "or in an optax chain), or leave curvature_every=1."
            )
        rng, key = jax.random.split(state.rng)
        kwargs = {"key": key} if wants_key else {}
        loss_kwargs = kwargs if _wants_key(loss_fn) else {}

        # under "stop", the steps after a non-finite one change nothing and send nothing to the host
        def live():  # a new context each time with_stats is traced (lax.cond traces it again)
            return _host.gate(state.nonfinite_step < 0) if nan_policy == "stop" else contextlib.nullcontext()

        # the plain loss: hooks change gradients only
        value_fn = lambda p: loss_fn(p, batch, **loss_kwargs)

        def update(loss, grads, captured):
            if not extra_args:
                return optimizer.update(grads, state.opt_state, state.params)
            more = {"curvature": captured} if curvature else {}
            return optimizer.update(
                grads, state.opt_state, state.params, value=loss, grad=grads, value_fn=value_fn, **more
            )

        def with_stats(_=None):
            with live():
                if state.hook_state:
                    out = value_and_grad(state.params, batch, hook_state=state.hook_state, **kwargs)
                    hook_state = out[-1]
                else:
                    out = value_and_grad(state.params, batch, **kwargs)
                    hook_state = state.hook_state
            if captures:
                (loss, grads), captured = out[0], out[1]
            else:
                (loss, grads), captured = (out[0] if state.hook_state else out), None
            return loss, grads, captured, hook_state, update(loss, grads, captured)

        if plain is None:
            loss, grads, captured, hook_state, (updates, opt_state) = with_stats()
        else:  # the statistics on every curvature_every-th step only

            def without(_):
                if rows_spec:
                    (loss, grads), rows = plain(state.params, batch, **loss_kwargs)
                else:
                    (loss, grads), rows = plain(state.params, batch, **loss_kwargs), None
                shapes = jax.eval_shape(with_stats)[2]
                captured = jax.tree.map(lambda a: jnp.full(a.shape, jnp.nan, a.dtype), shapes)
                return loss, grads, captured, state.hook_state, update(loss, grads, rows)

            # K-FAC's own update count (an optax.MultiSteps or a re-initialised optimizer state
            # counts differently from state.step): its first update always has statistics
            if phase is None:
                due = kfacs[0].count % curvature_every == 0
                branches = lax.cond(due, with_stats, without, None)
            else:
                branches = with_stats() if phase == "stats" else without(None)
            loss, grads, captured, hook_state, (updates, opt_state) = branches
        new = TrainState(
            keep_types(optax.apply_updates(state.params, updates), state.params),
            keep_types(opt_state, state.opt_state),
            keep_types(hook_state, state.hook_state),
            state.step + 1,
            rng,
            state.nonfinite_step,
        )
        grad_leaves = jax.tree.leaves(grads)
        finite = jnp.isfinite(loss) & jnp.all(
            jnp.array([jnp.isfinite(g).all() for g in grad_leaves] or [True])
        )
        if nan_policy != "off":
            first_bad = jnp.where((state.nonfinite_step < 0) & ~finite, state.step, state.nonfinite_step)
            new = new._replace(nonfinite_step=first_bad)
            if nan_policy == "stop":
                ok = first_bad < 0
                new = TrainState(*_select(ok, tuple(new[:5]), tuple(state[:5])), new.nonfinite_step)
        metrics = {"loss": loss}
        if captures:
            metrics["captured"] = captured
        if report_finite:
            metrics["finite"] = finite
        return new, metrics

    return step


def init_hook_state(loss_fn: Callable, hooks: Any, capture: Any, params: Any, batch: Any) -> dict:
    """The initial ``hook_state`` for ``make_step``'s hooks (``{}`` when none keeps state)."""
    if hooks is None and capture is None:
        return {}
    g = _autodiff.value_and_grad(loss_fn, hooks=hooks, capture=capture)
    if _wants_key(loss_fn):
        return _autodiff.init_hook_state(g, params, batch, key=jax.random.PRNGKey(0))
    return _autodiff.init_hook_state(g, params, batch)
