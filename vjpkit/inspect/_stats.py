"""Training statistics in the style of Cockpit and BackPACK, computed inside the graph.

Contract. ``gradient_stats`` wraps a loss with the contract of
``per_example_grad_norms`` (``L`` is the mean, or the sum, over batch axis
0 of per-example losses ``l_i``; ``g_i = grad l_i``) and returns ``(loss, grads, stats)`` from
one forward and one backward pass, usable under ``jax.jit`` and ``lax.scan``. ``stats`` maps
each selected layer name to a ``LayerStats``, over the parameter leaves that layer uses
(a leaf shared by two layers is reported under the first, in forward order), keyed by their
names inside the layer (``"weight"``, ``"bias"``). With ``B`` the batch size:

* ``grad_norm = ||grad L||``, the norm of the gradient the step returns (for a mean loss, of
  the batch mean ``m``; for a sum, of ``B * m``).
* ``mean = m = (1/B) sum_i g_i``, elementwise.
* ``variance = (1/B) sum_i (g_i - m)**2``, elementwise (the population variance, as BackPACK's
  ``Variance``). For a dense layer with 2-D input it comes from ``sum_i g_i**2 =
  (x*x)^T (d*d)``: no per-example gradient is formed. Other layers use the per-example
  gradients of that layer only, as ``per_example_grad_norms`` does.
* ``variance_sum = sum_j variance_j``, the trace of the per-example gradient covariance.
* ``snr = ||m||**2 / variance_sum``: the gradient signal-to-noise ratio. It is
  ``1 / B_simple`` for McCandlish et al.'s simple noise scale ``B_simple = tr(Sigma) / |G|^2``;
  ``snr * B`` above 1 means the batch gradient is dominated by signal rather than noise.
* ``histogram``: with ``histogram=vk.histogram(bins, range)``, the counts of each leaf of
  ``grad L`` over fixed bins (values outside the range count in the edge bins).

``update_ratio`` gives ``||new - old|| / ||old||`` per layer from the params before and
after an optimizer step. Everything is float32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from .._capture import histogram as _histogram
from .._errors import ConfigError
from .._format import path as _path_name
from .._names import matches_any
from ._per_example import _check_conv, _check_reduction, analyze

__all__ = ["LayerStats", "gradient_stats", "update_ratio"]


class LayerStats(NamedTuple):
    """Gradient statistics of one layer's parameters for one batch (see the module docstring).

    Attributes:
        grad_norm: ``||grad L||`` over the layer's params, a float32 scalar.
        mean: elementwise batch mean of the per-example gradients, ``{leaf name: array}``.
        variance: elementwise variance of the per-example gradients, ``{leaf name: array}``.
        variance_sum: the sum of ``variance`` over all the layer's elements.
        snr: ``||mean||**2 / variance_sum``.
        histogram: ``{leaf name: (bins,) counts}`` of ``grad L``, or ``None``.
    """

    grad_norm: jax.Array
    mean: Any = None
    variance: Any = None
    variance_sum: jax.Array | None = None
    snr: jax.Array | None = None
    histogram: Any = None


def _f32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float32)


def _sq(tree: Any) -> jax.Array:
    """The squared L2 norm of a tree, in float32 (optax's tree norm)."""
    return optax.tree.norm(jax.tree.map(_f32, tree), squared=True)


def gradient_stats(
    loss_fn: Callable,
    layers: str | Sequence[str] = "*",
    *,
    reduction: str = "mean",
    variance: bool = True,
    histogram: _histogram | None = None,
    check: bool = True,
    conv: dict | None = None,
) -> Callable[..., tuple[jax.Array, Any, dict[str, LayerStats]]]:
    """Per-layer gradient norm, mean, variance, SNR and histograms, from one backward pass.

    Args:
        loss_fn: ``loss_fn(params, *batch) -> L``, the mean (or sum) over batch axis 0 of
            per-example losses.
        layers: glob(s) over layer names; the layers with parameters that match are reported.
        reduction: ``"mean"`` or ``"sum"``: how ``L`` reduces the per-example losses.
        variance: compute ``mean``, ``variance``, ``variance_sum`` and ``snr`` (they need the
            per-example second moment); with ``False`` only ``grad_norm`` (and histograms).
        histogram: ``vk.histogram(bins, range)`` to histogram each leaf of ``grad L``.
        check: as in ``per_example_grad_norms``.
        conv: as in ``per_example_grad_norms``.

    Returns:
        ``f(params, *batch) -> (loss, grads, {layer name: LayerStats})``; jit it.

    Examples:
        >>> stats_fn = jax.jit(vk.inspect.gradient_stats(loss_fn, "fc*"))
        >>> loss, grads, stats = stats_fn(params, x, y)
        >>> float(stats["fc2"].snr), stats["fc2"].variance["weight"].shape
    """
    who = "vk.inspect.gradient_stats"
    _check_reduction(reduction, who)
    conv = _check_conv(conv, who)
    globs = (layers,) if isinstance(layers, str) else tuple(layers)
    if not globs or not all(isinstance(g, str) and g for g in globs):
        raise ConfigError(f"{who}: layers must be a glob or a list of globs, got {layers!r}.")
    if histogram is not None and not isinstance(histogram, _histogram):
        raise ConfigError(f"{who}: histogram must be vk.histogram(bins, range), got {histogram!r}.")
    if not callable(loss_fn):
        raise ConfigError(f"{who}: loss_fn must be callable, got {type(loss_fn).__name__}.")

    def matches(name: str) -> bool:  # a layer as a whole: its statistics sum all its calls
        return matches_any(name, None, globs)

    def stats_fn(params, *batch):
        a = analyze(
            loss_fn,
            params,
            batch,
            reduction=reduction,
            who=who,
            check=check,
            conv=conv,
            select=(lambda owner: matches(owner)) if variance else (lambda owner: False),
        )
        names = [c.name for c in a.calls]
        local: dict[int, str] = {}
        for c in a.calls:
            for role, (ix, _) in c.params.items():
                if ix is not None and ix not in local:
                    local[ix] = c.local.get(role, role)  # the name inside the layer, as records key it
        groups: dict[str, list[int]] = {}
        for i, owner in enumerate(a.owners):
            if owner in names and i in local and matches(owner):
                groups.setdefault(owner, []).append(i)
        if not groups:
            with_params = sorted({a.owners[i] for i in local})
            raise ConfigError(
                f"{who}: the glob(s) {list(globs)} match no layer with parameters. Layers with "
                f"parameters: {with_params or 'none: no vjpkit layer uses params'}."
                + (
                    " The statistics are per layer, over all its calls: a glob 'name#k' chooses "
                    "one call, so use 'name' (or 'name#*')."
                    if any("#" in g for g in globs)
                    else ""
                )
            )
        grads = jax.tree.leaves(a.grads)
        mean_scale = 1.0 if reduction == "mean" else 1.0 / a.batch_size
        stats = {}
        for owner, idx in groups.items():
            keyed = {local[i]: _f32(grads[i]) for i in idx}
            fields: dict[str, Any] = {"grad_norm": optax.tree.norm(keyed)}
            if variance:
                mean = {k: g * jnp.float32(mean_scale) for k, g in keyed.items()}
                var = {
                    local[i]: jnp.maximum(
                        a.leaves[i].sum_sq() / a.batch_size - jnp.square(mean[local[i]]), 0.0
                    )
                    for i in idx
                }
                var_sum = sum(jnp.sum(v) for v in var.values())
                fields.update(mean=mean, variance=var, variance_sum=var_sum, snr=_sq(mean) / var_sum)
            if histogram is not None:
                fields["histogram"] = {k: histogram(g) for k, g in keyed.items()}
            stats[owner] = LayerStats(**fields)
        return a.loss, a.grads, stats

    return stats_fn


def update_ratio(params: Any, new_params: Any) -> dict[str, jax.Array]:
    """The update-to-parameter ratio ``||new - old|| / ||old||`` of each layer.

    A layer is a group of leaves with the same parent in the params tree, named by the parent's
    path joined with ``/`` (``"fc1"``, ``"block1/fc1"``: the layer names of ``nn.serial``); a
    top-level leaf is its own group. Norms are float32, over all leaves of the group; a group
    whose params are all zero gives ``inf`` (or ``nan`` if it did not move either).

    Args:
        params: the parameters before the step.
        new_params: after it, e.g. ``optax.apply_updates(params, updates)``.

    Returns:
        ``{layer name: float32 scalar}``.

    Examples:
        >>> new = optax.apply_updates(params, updates)
        >>> ratios = vk.inspect.update_ratio(params, new)   # {"fc1": ~1e-3, ...}
    """
    old_flat, old_def = jax.tree_util.tree_flatten_with_path(params)
    new_flat, new_def = jax.tree_util.tree_flatten_with_path(new_params)
    if old_def != new_def:
        raise ConfigError(
            "vk.inspect.update_ratio: params and new_params must have the same tree structure; got\n"
            f"{old_def}\nand\n{new_def}."
        )
    num: dict[str, jax.Array] = {}
    den: dict[str, jax.Array] = {}
    for (path, old), (_, new) in zip(old_flat, new_flat):
        if jnp.shape(old) != jnp.shape(new):
            raise ConfigError(
                f"vk.inspect.update_ratio: leaf {_path_name(path)!r} has shape {jnp.shape(old)} in params "
                f"and {jnp.shape(new)} in new_params."
            )
        name = _path_name(path[:-1]) if len(path) > 1 else _path_name(path)
        num[name] = num.get(name, 0.0) + jnp.sum(jnp.square(_f32(new) - _f32(old)))
        den[name] = den.get(name, 0.0) + jnp.sum(jnp.square(_f32(old)))
    return {k: jnp.sqrt(num[k]) / jnp.sqrt(den[k]) for k in num}
