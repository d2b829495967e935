"""A K-FAC preconditioner as an optax transformation, fed by ``vk.curvature.stats``' factors.

Contract. ``kfac(learning_rate, like=...)`` returns an ``optax.GradientTransformationExtraArgs``
whose ``update(updates, state, params=None, *, curvature)`` takes the step's curvature dict
(``{layer call name: LayerCurvature}``, as one ``vk.curvature.stats`` capture returns it). It
computes nothing from the model: the factors are given, the optimizer only averages, damps,
inverts and applies them.

* Layers and leaves. Each record's static ``Layout`` names its weight and bias leaves by key path
  inside the updates (= params) tree; the weight leaf maps to the ``(in, out)`` matrix of the
  factors (``transpose``: stored ``(out..., in...)`` with the last ``in_ndim`` axes as input;
  else ``(in..., out...)`` with the first ``in_ndim``, e.g. a 2-D HWIO conv kernel with
  ``in_ndim=3``), the bias to a last row, ``M = [W; b]`` of shape ``(in [+1], out)``. The paths
  are looked up in the tree given to ``init`` and ``update`` (``Layout.argnum`` is not read:
  give the optimizer the differentiated argument's tree).
* Shared leaves. All records naming the same weight leaf (a weight called twice, ``fc1`` and
  ``fc1#1``, or closed over by a ``lax.scan``, with one factor per iteration along leading
  axes) form one block: their ``A``'s are summed and their ``G``'s are summed, separately. The
  block's state is keyed by its first layer name in ``like``'s order.
* Stacked leaves. A weight given to ``lax.scan`` as ``xs`` (blocks over stacked weights,
  ``Layout.scans`` with ``"s"``) is one block per slice: its factors, their EMA and inverses
  keep the iterations' leading axes, and each slice of the leaf is preconditioned by its own
  (``jax.vmap`` over the slices), exactly as the same model unrolled into separate weights.
* Fallback. Leaves no layer covers, and layers without a weight leaf path (a weight computed in
  the loss or carried through a scan, or a bias row the factors include but no bias leaf), get
  the plain gradient, ``-learning_rate * g`` (SGD); the latter are warned about once
  (``UserWarning``).
* Statistics. ``A_ema = decay * A_ema + (1 - decay) * A`` (same for ``G``), the EMA taking the
  first step's factors themselves (initialised at the first observation, not bias-corrected).
  With ``axis_name`` the step's factors are ``lax.pmean``-ed over that axis before the EMA.
* A step without statistics (``update(..., curvature=None)``, the statistics computed only every
  few steps to save their cost) keeps the EMA and preconditions with the cached inverses; the
  first update needs statistics: without them it is a ``ConfigError`` when the state's count
  is concrete (an eager call), and under ``jax.jit`` its updates are NaN (the inverses start as
  NaN until the first statistics), never momentum SGD; ``vk.train.make_step`` / ``fit`` refuse a
  K-FAC optimizer without a ``vk.curvature.stats`` capture. ``like={}`` is an error.
* Inverses are recomputed from the EMA when ``count % update_every == 0`` (``lax.cond``; the
  first step always), else the cached ones are reused: an ``"inverse"`` step between refreshes
  costs two matmuls per layer.
* Output ``-learning_rate * optax.trace(momentum)(direction)``, the direction being the
  preconditioned gradient on covered leaves and the gradient elsewhere (momentum and learning
  rate are optax's ``trace`` and ``scale_by_learning_rate``).

Computations run in the factors' dtype promoted to at least float32; outputs take each leaf's
dtype. This module imports only ``vjpkit._errors`` and ``vjpkit.curvature._types`` of vjpkit.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from vjpkit._errors import ConfigError
from vjpkit.curvature._types import Factors, LayerCurvature, Layout, stats_dtype

__all__ = ["KfacState", "kfac"]

_ESTIMATORS = ("kfac", "kflr", "kfac_empirical")
_SOLVERS = ("inverse", "eigh")


class KfacState(NamedTuple):
    """The state of ``kfac``.

    Attributes:
        count: the number of updates done (int32 scalar).
        factors: the EMA ``Factors(A, G)`` per preconditioned block, keyed by its first layer name.
        inverses: per block, ``Factors(A_d^-1, G_d^-1)`` (``solver="inverse"``) or the tuple
            ``(U_A, s_A, U_G, s_G)`` of the EMA factors' eigendecompositions (``solver="eigh"``),
            as of the last refresh.
        inner: the state of the ``optax.trace`` (momentum) and learning-rate transformations.
    """

    count: jax.Array
    factors: dict[str, Factors]
    inverses: dict[str, Any]
    inner: optax.OptState


@dataclasses.dataclass(frozen=True)
class _Block:
    """One preconditioned weight: the layer calls naming it and how its leaves map to ``M``."""

    key: str
    names: tuple[str, ...]
    layout: Layout
    d_a: int
    d_g: int
    dtype: Any
    lead: tuple = ()  # the stacked iterations' lengths (a slice and a factor pair per iteration)

    @property
    def leaves(self) -> tuple:
        w, b = self.layout.weight_leaf, self.layout.bias_leaf
        return (w,) if b is None else (w, b)


def _keystr(path) -> str:
    return jax.tree_util.keystr(tuple(path))


def _lead_sum(x: jax.Array, scans: str = "") -> jax.Array:
    """Sums the leading (scan) axes of a stacked ``(..., d, d)`` factor, but those of the scans
    that slice the leaf (``"s"`` in ``scans``, one letter per leading axis)."""
    summed = tuple(k for k in range(x.ndim - 2) if k >= len(scans) or scans[k] != "s")
    return jnp.sum(x, axis=summed) if summed else x


def _per_slice(f, lead: tuple, *xs: Any) -> Any:
    """``f`` of each stacked slice of ``xs`` (leading axes ``lead``), stacked back."""
    if not lead:
        return f(*xs)
    n = math.prod(lead)
    flat = [jax.tree.map(lambda a: a.reshape(n, *a.shape[len(lead) :]), x) for x in xs]
    out = jax.vmap(f)(*flat)
    return jax.tree.map(lambda a: a.reshape(*lead, *a.shape[1:]), out)


def _factors_of(rec: Any, name: str, estimator: str, where: str) -> Factors:
    if not isinstance(rec, LayerCurvature):
        raise ConfigError(
            f"kfac: {where}[{name!r}] is a {type(rec).__name__}, not a LayerCurvature; pass the dict "
            "vk.curvature.stats captures (or jax.eval_shape of it)."
        )
    f = getattr(rec, estimator)
    if f is None:
        raise ConfigError(
            f"kfac(estimator={estimator!r}): layer {name!r} has no {estimator!r} factors in {where}; "
            f"request them with vk.curvature.stats(..., [{estimator!r}, ...]) or pass the "
            "estimator= that was requested."
        )
    return f


def kfac(
    learning_rate: optax.ScalarOrSchedule,
    *,
    like: Mapping[str, LayerCurvature],
    estimator: str = "kfac",
    damping: float = 1e-3,
    decay: float = 0.95,
    update_every: int = 1,
    solver: str = "inverse",
    pi_damping: bool = True,
    momentum: float | None = None,
    axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """K-FAC (Martens & Grosse 2015): precondition each layer's gradient by its damped factors.

    Each preconditioned block's gradient ``M = [W; b]`` (``(in [+1], out)``) becomes, with the
    EMA factors ``A``, ``G`` as of the last refresh:

    * ``solver="inverse"``: ``A_d^-1 M G_d^-1`` with factored Tikhonov damping,
      ``A_d = A + pi sqrt(damping) I``, ``G_d = G + sqrt(damping) / pi I`` and
      ``pi = sqrt((tr A / dim A) / (tr G / dim G))`` (sec. 6.3; ``pi = 1`` when ``pi_damping`` is
      False or a trace is 0), inverted by Cholesky;
    * ``solver="eigh"``: the exactly damped ``(A kron G + damping I)^-1 vec M``, i.e.
      ``U_A [(U_A^T M U_G) / (s_A s_G^T + damping)] U_G^T`` with eigenvalues clipped at 0
      (``pi_damping`` does not apply).

    Several calls of one weight leaf (a shared weight) form one block whose ``A``'s are summed
    and whose ``G``'s are summed. Leaves no layer covers get the plain gradient (see the module
    docstring for the EMA, the refresh and the fallback rules).

    Args:
        learning_rate: a float or an optax schedule of the update count.
        like: a curvature dict as one capture returns it (arrays or ``jax.ShapeDtypeStruct``s,
            e.g. ``jax.eval_shape`` of the step): the layers, layouts and factor shapes.
        estimator: the ``LayerCurvature`` field to use: ``"kfac"``, ``"kflr"`` or
            ``"kfac_empirical"``.
        damping: the Tikhonov damping ``lambda > 0``.
        decay: the factors' EMA decay, in ``[0, 1)``.
        update_every: recompute the inverses every this many updates.
        solver: ``"inverse"`` or ``"eigh"``.
        pi_damping: scale the damping between the factors by ``pi`` (``"inverse"`` only).
        momentum: ``optax.trace`` decay applied to the direction before the learning rate.
        axis_name: under ``pmap``/``shard_map``, the axis the step's factors are averaged over.

    Returns:
        An ``optax.GradientTransformationExtraArgs``; its ``update`` takes ``curvature=`` (the step's
        dict, with the layers of ``like``) and ignores other extra arguments (``optax.chain``).

    Raises:
        ConfigError: bad options, a layer of ``like`` without the estimator's factors; at ``init``
            a leaf path not in ``params`` or factor shapes that do not fit the leaves; at
            ``update`` a missing ``curvature`` or a layer missing from it.

    Examples:
        >>> spec = vk.curvature.stats("fc*", ["kfac"])
        >>> step_grad = vk.value_and_grad(loss_fn, capture=spec)
        >>> like = jax.eval_shape(step_grad, params, x, y)[1]
        >>> opt = vk.curvature.kfac(0.1, like=like, damping=1e-3, momentum=0.9)
        >>> state = opt.init(params)
        >>> (loss, grads), curvature = step_grad(params, x, y)
        >>> updates, state = opt.update(grads, state, params, curvature=curvature)
        >>> params = optax.apply_updates(params, updates)
    """
    if estimator not in _ESTIMATORS:
        raise ConfigError(f"kfac: estimator={estimator!r}; use one of {_ESTIMATORS}.")
    if solver not in _SOLVERS:
        raise ConfigError(f"kfac: solver={solver!r}; use one of {_SOLVERS}.")
    if not damping > 0:
        raise ConfigError(f"kfac: damping={damping!r}; it must be > 0.")
    if not 0 <= decay < 1:
        raise ConfigError(f"kfac: decay={decay!r}; it must be in [0, 1).")
    if not (isinstance(update_every, int) and update_every >= 1):
        raise ConfigError(f"kfac: update_every={update_every!r}; it must be an int >= 1.")
    if not isinstance(like, Mapping):
        raise ConfigError(
            f"kfac: like= is a {type(like).__name__}; pass the curvature dict of one capture "
            "({layer name: LayerCurvature}, e.g. jax.eval_shape of the step)."
        )

    if not like:
        raise ConfigError(
            "kfac: like= has no layers, so there is nothing to precondition: every step would be "
            "momentum SGD. Pass the curvature dict of a step captured with vk.curvature.stats over "
            "the model's layers (jax.eval_shape of the step)."
        )
    # Static plan from `like`: blocks (one per weight leaf) and layers falling back to SGD.
    names = tuple(like)
    grouped: dict[tuple, list[str]] = {}
    unpreconditioned: list[str] = []
    shapes: dict[str, tuple[tuple, tuple, Any]] = {}
    for name in names:
        rec = like[name]
        f = _factors_of(rec, name, estimator, "like")
        layout = rec.layout
        if layout is None:
            raise ConfigError(
                f"kfac: layer {name!r} has no layout in like; pass records from vk.curvature.stats."
            )
        a_shape, g_shape = tuple(f.A.shape), tuple(f.G.shape)
        dtype = jax.dtypes.canonicalize_dtype(stats_dtype(f.A.dtype))
        lead = tuple(n for n, how in zip(a_shape[:-2], layout.scans) if how == "s")
        shapes[name] = (a_shape, g_shape, dtype, lead)
        if layout.weight_leaf is None or (layout.bias is not None and layout.bias_leaf is None):
            unpreconditioned.append(name)
        else:
            grouped.setdefault(tuple(layout.weight_leaf), []).append(name)

    blocks: list[_Block] = []
    for members in grouped.values():
        first = members[0]
        layout = like[first].layout
        a_shape, g_shape, dtype, lead = shapes[first]
        if len(a_shape) < 2 or len(g_shape) < 2 or a_shape[-1] != a_shape[-2] or g_shape[-1] != g_shape[-2]:
            raise ConfigError(
                f"kfac: layer {first!r}: {estimator}.A and .G must be square (..., d, d); got "
                f"A {a_shape} and G {g_shape}."
            )
        for other in members[1:]:
            o_layout = like[other].layout
            same = (o_layout.bias_leaf, o_layout.transpose, o_layout.in_ndim, o_layout.n_stacked) == (
                layout.bias_leaf,
                layout.transpose,
                layout.in_ndim,
                layout.n_stacked,
            )
            o_a, o_g, _, o_lead = shapes[other]
            same = same and o_lead == lead
            if not same or o_a[-2:] != a_shape[-2:] or o_g[-2:] != g_shape[-2:]:
                raise ConfigError(
                    f"kfac: layers {first!r} and {other!r} share the weight leaf "
                    f"{_keystr(layout.weight_leaf)} but differ in layout or factor shapes "
                    f"(A {a_shape[-2:]} vs {o_a[-2:]}, G {g_shape[-2:]} vs {o_g[-2:]}); their factors "
                    "cannot be summed into one block."
                )
        blocks.append(_Block(first, tuple(members), layout, a_shape[-1], g_shape[-1], dtype, lead))

    owner: dict[tuple, str] = {}
    for blk in blocks:
        for leaf in blk.leaves:
            if tuple(leaf) in owner:
                raise ConfigError(
                    f"kfac: the leaf {_keystr(leaf)} belongs to two preconditioned blocks "
                    f"({owner[tuple(leaf)]!r} and {blk.key!r}); a leaf can be preconditioned once."
                )
            owner[tuple(leaf)] = blk.key

    warned: set[str] = set()

    def warn_unpreconditioned() -> None:
        for name in unpreconditioned:
            if name not in warned:
                warned.add(name)
                warnings.warn(
                    f"kfac: layer {name!r} has K-FAC factors but no weight (or bias) leaf path in the "
                    "params (e.g. a slice of a stacked weight under lax.scan); its leaves get the "
                    "plain gradient (SGD direction).",
                    UserWarning,
                    stacklevel=3,
                )

    tail = optax.chain(
        optax.trace(decay=momentum) if momentum is not None else optax.identity(),
        optax.scale_by_learning_rate(learning_rate),
    )

    def leaf_index(tree: Any, what: str) -> tuple[dict, list, Any]:
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        index = {tuple(p): i for i, (p, _) in enumerate(flat)}
        for blk in blocks:
            for leaf in blk.leaves:
                if tuple(leaf) not in index:
                    raise ConfigError(
                        f"kfac: layer {blk.key!r} names the leaf {_keystr(leaf)}, which is not in {what} "
                        f"(its leaves: {', '.join(_keystr(p) for p, _ in flat[:8])}"
                        f"{', ...' if len(flat) > 8 else ''}); pass the params the curvature was "
                        "captured for (the layout's paths are relative to the differentiated argument)."
                    )
        return index, [x for _, x in flat], treedef

    def check_shapes(index: dict, leaves: list) -> None:
        for blk in blocks:
            layout = blk.layout
            w = leaves[index[tuple(layout.weight_leaf)]]
            k = layout.n_stacked
            if tuple(w.shape[:k]) != blk.lead:
                raise ConfigError(
                    f"kfac: layer {blk.key!r}: the weight leaf {_keystr(layout.weight_leaf)} of shape "
                    f"{tuple(w.shape)} is given to lax.scan as xs with {blk.lead} iterations: its "
                    f"leading axes must be {blk.lead}."
                )
            wshape = tuple(w.shape[k:])
            if not 1 <= layout.in_ndim < len(wshape):
                raise ConfigError(
                    f"kfac: layer {blk.key!r}: the weight leaf {_keystr(layout.weight_leaf)} has shape "
                    f"{wshape}, which cannot hold in_ndim={layout.in_ndim} input axes and an output axis."
                )
            n_in = layout.in_ndim
            d_in, d_out = layout.matrix_shape(wshape)
            has_bias = layout.bias_leaf is not None
            want_a, want_g = (d_in + has_bias,) * 2, (d_out,) * 2
            got_a, got_g = (blk.d_a, blk.d_a), (blk.d_g, blk.d_g)
            if (got_a, got_g) != (want_a, want_g):
                raise ConfigError(
                    f"kfac: layer {blk.key!r}: {estimator} factors A {got_a}, G {got_g} do not fit the "
                    f"weight leaf {_keystr(layout.weight_leaf)} of shape {wshape} (transpose="
                    f"{layout.transpose}, in_ndim={n_in}{', with a bias' if has_bias else ''}): expected "
                    f"A {want_a}, G {want_g}."
                )
            if has_bias:
                b = leaves[index[tuple(layout.bias_leaf)]]
                if tuple(b.shape[:k]) != blk.lead or math.prod(b.shape[k:]) != d_out:
                    raise ConfigError(
                        f"kfac: layer {blk.key!r}: the bias leaf {_keystr(layout.bias_leaf)} has shape "
                        f"{tuple(b.shape)}, expected "
                        + (f"{blk.lead} iterations of " if blk.lead else "")
                        + f"{d_out} entries (G is {got_g})."
                    )

    def refresh(factors: dict[str, Factors], _old: Any = None) -> dict[str, Any]:
        return {
            blk.key: _per_slice(lambda a, g, b=blk: invert(b, a, g), blk.lead, *factors[blk.key])
            for blk in blocks
        }

    def invert(blk: _Block, a: jax.Array, g: jax.Array) -> Any:
        """One slice's inverses (or eigendecompositions) of its EMA factors."""
        eye_a, eye_g = jnp.eye(blk.d_a, dtype=a.dtype), jnp.eye(blk.d_g, dtype=g.dtype)
        if solver == "eigh":
            s_a, u_a = jnp.linalg.eigh(a)
            s_g, u_g = jnp.linalg.eigh(g)
            return (u_a, jnp.maximum(s_a, 0.0), u_g, jnp.maximum(s_g, 0.0))
        if pi_damping:
            ta, tg = jnp.trace(a) / blk.d_a, jnp.trace(g) / blk.d_g
            ok = (ta > 0) & (tg > 0)
            pi = jnp.where(ok, jnp.sqrt(jnp.where(ok, ta, 1.0) / jnp.where(ok, tg, 1.0)), 1.0)
        else:
            pi = jnp.ones((), a.dtype)
        sq = math.sqrt(damping)
        a_d = a + (pi * sq) * eye_a
        g_d = g + (sq / pi) * eye_g
        a_inv = jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(a_d, lower=True), eye_a)
        g_inv = jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(g_d, lower=True), eye_g)
        return Factors(a_inv, g_inv)

    def precondition(blk: _Block, inv: Any, m: jax.Array) -> jax.Array:
        if solver == "eigh":
            u_a, s_a, u_g, s_g = inv
            rotated = u_a.T @ m @ u_g
            return u_a @ (rotated / (s_a[:, None] * s_g[None, :] + damping)) @ u_g.T
        return inv.A @ m @ inv.G

    def init_fn(params: Any) -> KfacState:
        index, leaves, _ = leaf_index(params, "params")
        check_shapes(index, leaves)
        warn_unpreconditioned()
        # built in NumPy and transferred: no small program to compile per shape at init
        zeros = lambda *shape, dtype: jnp.asarray(np.zeros(shape, dtype))
        # no inverses before the first statistics: NaN, so that a first update without them under
        # jax.jit (where the count is not known) gives NaN updates, never silent momentum SGD
        eye = lambda lead, n, dtype: jnp.asarray(np.full((*lead, n, n), np.nan, dtype))
        factors = {
            b.key: Factors(
                zeros(*b.lead, b.d_a, b.d_a, dtype=b.dtype), zeros(*b.lead, b.d_g, b.d_g, dtype=b.dtype)
            )
            for b in blocks
        }
        if solver == "eigh":
            inverses = {
                b.key: (
                    eye(b.lead, b.d_a, b.dtype),
                    zeros(*b.lead, b.d_a, dtype=b.dtype),
                    eye(b.lead, b.d_g, b.dtype),
                    zeros(*b.lead, b.d_g, dtype=b.dtype),
                )
                for b in blocks
            }
        else:
            inverses = {
                b.key: Factors(eye(b.lead, b.d_a, b.dtype), eye(b.lead, b.d_g, b.dtype)) for b in blocks
            }
        return KfacState(jnp.asarray(np.zeros((), np.int32)), factors, inverses, tail.init(params))

    def step_factors(curvature: Mapping[str, LayerCurvature]) -> dict[str, Factors]:
        if not isinstance(curvature, Mapping):
            raise ConfigError(
                f"kfac: curvature= is a {type(curvature).__name__}, not a dict of LayerCurvature."
            )
        missing = [n for n in names if n not in curvature]
        if missing:
            raise ConfigError(
                f"kfac: layer(s) {', '.join(map(repr, missing))} of like are missing from this step's "
                "curvature; capture the same layers with vk.curvature.stats at every step (the same "
                "spec as for like)."
            )
        extra = [n for n in curvature if n not in like]
        if extra:
            raise ConfigError(
                f"kfac: layer(s) {', '.join(map(repr, extra))} of this step's curvature are not in like; "
                "build like from the same vk.curvature.stats spec (jax.eval_shape of the step)."
            )
        out = {}
        for blk in blocks:
            sum_a = sum_g = None
            for name in blk.names:
                f = _factors_of(curvature[name], name, estimator, "curvature")
                scans = curvature[name].layout.scans if curvature[name].layout is not None else ""
                a, g = _lead_sum(jnp.asarray(f.A), scans), _lead_sum(jnp.asarray(f.G), scans)
                want_a, want_g = (*blk.lead, blk.d_a, blk.d_a), (*blk.lead, blk.d_g, blk.d_g)
                if a.shape != want_a or g.shape != want_g:
                    raise ConfigError(
                        f"kfac: layer {name!r}: this step's {estimator} factors A {tuple(f.A.shape)}, "
                        f"G {tuple(f.G.shape)} differ from like's {want_a}, {want_g}."
                    )
                a, g = a.astype(blk.dtype), g.astype(blk.dtype)
                sum_a = a if sum_a is None else sum_a + a
                sum_g = g if sum_g is None else sum_g + g
            if axis_name is not None:
                sum_a, sum_g = lax.pmean(sum_a, axis_name), lax.pmean(sum_g, axis_name)
            out[blk.key] = Factors(sum_a, sum_g)
        return out

    def update_fn(
        updates: Any,
        state: KfacState,
        params: Any = None,
        *,
        curvature: Mapping[str, LayerCurvature] | None = None,
        **extra_args: Any,
    ) -> tuple[Any, KfacState]:
        del extra_args  # other members' extra arguments under optax.chain
        warn_unpreconditioned()
        if curvature is None:  # no statistics this step: the cached inverses precondition it
            if not isinstance(state.count, jax.core.Tracer) and int(state.count) == 0:
                raise ConfigError(
                    "kfac: the first update() has no curvature=: there are no statistics to "
                    "precondition with yet (the step would be plain momentum SGD). Pass the step's "
                    "vk.curvature.stats capture as update(..., curvature=...) at least on the first "
                    "step; later steps may omit it to reuse the cached inverses."
                )
            factors, inverses = state.factors, state.inverses
        else:
            new = step_factors(curvature)
            first = state.count == 0
            factors = {
                k: Factors(
                    *(
                        jnp.where(first, x, decay * old + (1.0 - decay) * x)
                        for old, x in zip(state.factors[k], new[k], strict=True)
                    )
                )
                for k in new
            }
            if update_every == 1:
                inverses = refresh(factors)
            else:
                inverses = lax.cond(
                    state.count % update_every == 0, refresh, lambda f, old: old, factors, state.inverses
                )

        index, leaves, treedef = leaf_index(updates, "the updates")
        direction = list(leaves)
        for blk in blocks:
            layout = blk.layout
            wi = index[tuple(layout.weight_leaf)]
            bi = index[tuple(layout.bias_leaf)] if layout.bias_leaf is not None else None
            w, b = leaves[wi], None if bi is None else leaves[bi]

            def one(inv, w, b, blk=blk, layout=layout):  # one slice of a stacked leaf, or the leaf
                m = layout.to_matrix(w).astype(blk.dtype)
                if b is not None:
                    m = jnp.concatenate([m, b.reshape(1, -1).astype(blk.dtype)], axis=0)
                p = precondition(blk, inv, m)
                pb = None if b is None else p[-1].reshape(b.shape).astype(b.dtype)
                return layout.from_matrix(p if b is None else p[:-1], w.shape).astype(w.dtype), pb

            direction[wi], pb = _per_slice(one, blk.lead, inverses[blk.key], w, b)
            if bi is not None:
                direction[bi] = pb
        direction = jax.tree_util.tree_unflatten(treedef, direction)
        out, inner = tail.update(direction, state.inner, params)
        return out, KfacState(optax.safe_increment(state.count), factors, inverses, inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
