"""The statistics spec, and each statistic of one layer call from its records.

Contract. ``stats(layers, which, mc_samples)`` builds a ``StatsSpec``, which ``capture=`` of
``vk.value_and_grad`` / ``vk.grad`` takes. ``layer_stats(which, layout, x, d, exact, mc, n)``
computes the asked-for statistics of one (unstacked) layer call from:

* ``x``: the call's input; ``d``: its ``grad_output`` in the gradient's own backward pass (the
  empirical cotangents ``dL/dy``, each example's carrying the ``1/N`` of the mean);
* ``exact`` / ``mc``: its ``grad_output`` in the backward passes seeded with the loss Hessian's
  square-root columns / Monte-Carlo samples (stacked on axis 0), or ``None``;
* ``n``: the number of examples of the registered loss.

Every layer is read as the matrix form ``y_rows = a_rows @ M`` of ``_types``: a dense layer's
rows are every position of its input's leading axes, a convolution's rows its output positions
with ``a`` the unfolded patch. The per-example statistics group the rows by axis 0 of the
input and output, which must have ``n`` entries (the examples).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .. import stats as statslayer
from .._errors import ConfigError
from .._names import check_glob
from ._types import Factors, LayerCurvature, Layout, stats_dtype

FACTORS = ("kflr", "kfac", "kfac_empirical")
DIAGONAL = ("diag_ggn", "diag_ggn_mc")
FIRST_ORDER = ("sum_grad_squared", "batch_l2", "backpack_variance")
STATISTICS = FACTORS + DIAGONAL + FIRST_ORDER
EXACT = ("kflr", "diag_ggn")  # need the Hessian square-root pulls
SAMPLED = ("kfac", "diag_ggn_mc")  # need the Monte-Carlo pulls (and a key)


class StatsSpec(NamedTuple):
    """What curvature to compute: see ``stats``."""

    layers: tuple[str, ...]
    which: tuple[str, ...]
    mc_samples: int = 1

    @property
    def exact(self) -> bool:
        return any(s in EXACT for s in self.which)

    @property
    def sampled(self) -> bool:
        return any(s in SAMPLED for s in self.which)


def stats(
    layers: str | Sequence[str] = "*", which: str | Sequence[str] = ("kflr",), mc_samples: int = 1
) -> StatsSpec:
    """Chooses layer calls and the curvature statistics to compute for them, in the graph.

    Args:
        layers: a glob or globs over layer paths (layers without parameters are skipped).
        which: any of ``kflr`` (exact GGN K-FAC factors), ``kfac`` (Monte-Carlo Fisher
            factors), ``kfac_empirical`` (empirical Fisher factors), ``diag_ggn``,
            ``diag_ggn_mc``, ``sum_grad_squared``, ``batch_l2``, ``backpack_variance`` (BackPACK's
            ``Variance``, of the per-example gradients ``grad l_n / N``; ``vk.inspect.gradient_stats``'s
            ``variance`` is of ``grad l_n``, ``N^2`` times larger).
        mc_samples: Monte-Carlo samples for ``kfac`` and ``diag_ggn_mc``; the transformed
            function then takes ``key=``.

    Returns:
        A spec for ``capture=``: ``captured[name]`` is a ``vk.curvature.LayerCurvature``.

    Examples:
        >>> spec = vk.curvature.stats("fc*", ["kflr", "diag_ggn"])
        >>> (loss, grads), captured = vk.value_and_grad(loss_fn, capture=spec)(params, x, y)
    """
    globs = (layers,) if isinstance(layers, str) else tuple(layers)
    if not globs or not all(isinstance(g, str) and g for g in globs):
        raise ConfigError(f"vk.curvature.stats: layers must be a glob or a list of globs, got {layers!r}.")
    for g in globs:
        check_glob(g, "vk.curvature.stats")
    which = (which,) if isinstance(which, str) else tuple(which)
    if "variance" in which:
        raise ConfigError(
            "vk.curvature.stats: 'variance' is now 'backpack_variance': BackPACK's Variance, "
            "(1/N) sum_n g_n^2 - ((1/N) sum_n g_n)^2 of g_n = grad l_n / N. vk.inspect.gradient_stats's "
            "variance is of grad l_n itself (N^2 times larger); the two names say which is which."
        )
    unknown = [w for w in which if w not in STATISTICS]
    if unknown or not which:
        raise ConfigError(
            f"vk.curvature.stats: unknown statistic(s) {unknown or which!r}; choose from {list(STATISTICS)}."
        )
    if not isinstance(mc_samples, int) or isinstance(mc_samples, bool) or mc_samples < 1:
        raise ConfigError(f"vk.curvature.stats: mc_samples must be an int >= 1, got {mc_samples!r}.")
    return StatsSpec(globs, tuple(dict.fromkeys(which)), mc_samples)


# --------------------------------------------------------------------------------------------
# One layer call as rows of a matrix product: a (rows, in), g (..., rows, out)


def _patches(x: jax.Array, layout: Layout, kernel: tuple[int, ...]) -> jax.Array:
    """``vjpkit.stats.patches`` of a conv layer's input with the layer's own geometry."""
    return statslayer.patches(x, kernel[:-1], layout.strides, layout.padding, layout.dilation)


def _rows_in(layout: Layout, x: jax.Array, w_shape: tuple[int, ...]) -> jax.Array:
    """``a`` with the examples on axis 0 kept: ``(N, T, in)``."""
    if layout.kind == "conv":
        kernel = w_shape[:-1]
        x = _patches(x, layout, kernel)
        return x.reshape(x.shape[0], -1, x.shape[-1])
    n_in, _ = layout.matrix_shape(w_shape)
    return x.reshape(x.shape[0], -1, n_in)


# --------------------------------------------------------------------------------------------


def _a_factor(a: jax.Array, n: int, bias: bool, conv: bool) -> jax.Array:
    """``A = (1/N) sum_rows [a,1][a,1]^T`` of a dense layer.

    Convolution (BackPACK's KFLR / KFAC for convolutions): ``A = (1/N) sum_{n,t} [a,c][a,c]^T``
    over the ``T`` patches of each example with ``c = 1/sqrt(T)`` (the bias entry of ``A`` is 1);
    with ``_g_factor``'s ``G``, ``kron(A, G)``'s weight and bias blocks are BackPACK's.
    """
    t = a.shape[1]
    a = a.reshape(-1, a.shape[-1])
    if bias:
        c = 1 / math.sqrt(t) if conv else 1.0
        a = jnp.concatenate([a, jnp.full((a.shape[0], 1), c, a.dtype)], axis=1)
    return a.T @ a / n


def _g_factor(gs: jax.Array, conv: bool) -> jax.Array:
    """``G = sum_seeds sum_rows g g^T``; for a convolution each example's cotangents are first
    summed over the output positions, ``G = sum_seeds sum_n (sum_t g_nt)(sum_t g_nt)^T``."""
    g = gs.sum(axis=-2) if conv else gs  # (..., N, T, out) -> (..., N, out) for a convolution
    g = g.reshape(-1, g.shape[-1])
    return g.T @ g


def _over_seeds(body, zero, seeds: jax.Array) -> Any:
    """``body``'s accumulation over the seeds on axis 0, one at a time (a ``lax.scan``); one seed
    (a Monte-Carlo sample, the gradient) without a loop around it."""
    if seeds.shape[0] == 1:
        return body(zero, seeds[0])[0]
    return lax.scan(body, zero, seeds)[0]


def _rows(a: jax.Array, g: jax.Array) -> list:
    """The weight's and the bias's ``statslayer.Rows`` in the ``(in, out)`` matrix layout."""
    return [statslayer.Rows(a, g, (0,), (1,), (a.shape[-1], g.shape[-1]))], [
        statslayer.Rows.bias(g, (g.shape[-1],))
    ]


def _per_example_sq(a: jax.Array, gs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Over seeds ``k`` and examples ``n``: ``sum (J_kn)^2`` of the weight matrix ``(in, out)``
    and of the bias ``(out,)``, where ``J_kn = sum_t a_nt g_knt^T`` (``vjpkit.stats.sum_sq``).
    ``a (N, T, in)``, ``gs (K, N, T, out)``."""

    def body(acc, g):  # one seed at a time
        w, b = _rows(a, g)
        return (acc[0] + statslayer.sum_sq(w), acc[1] + statslayer.sum_sq(b)), None

    zero = (jnp.zeros((a.shape[-1], gs.shape[-1]), a.dtype), jnp.zeros((gs.shape[-1],), a.dtype))
    return _over_seeds(body, zero, gs)


def _batch_sq_norms(a: jax.Array, d: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per example: ``||sum_t a_t d_t^T||^2`` and ``||sum_t d_t||^2``, each ``(N,)``
    (``vjpkit.stats.sq_norms``: the ghost norm when ``T^2 <= in * out``)."""
    w, b = _rows(a, d)
    return statslayer.sq_norms(w), statslayer.sq_norms(b)


def layer_stats(
    which: Sequence[str],
    layout: Layout,
    params: dict,
    grad_params: dict,
    x: jax.Array,
    d: jax.Array,
    exact: jax.Array | None,
    mc: jax.Array | None,
    n: int,
    where: str,
) -> LayerCurvature:
    """The statistics ``which`` of one layer call (see the module contract)."""
    w_shape = tuple(params[layout.weight].shape)
    n_in, n_out = layout.matrix_shape(w_shape)
    dtype = stats_dtype(x.dtype)
    a = _rows_in(layout, x.astype(dtype), w_shape)
    per_example = [s for s in which if s not in FACTORS]
    if per_example and (a.shape[0] != n or d.shape[0] != n):
        raise ConfigError(
            f"vk.curvature.stats: {where}: the per-example statistics {per_example} read axis 0 of the "
            f"layer's input and output as the {n} examples of the registered loss, but they have "
            f"{a.shape[0]} and {d.shape[0]} entries there. Ask only for K-FAC factors "
            f"({list(FACTORS)}) of this layer, or keep the examples on axis 0."
        )

    def rows(g):  # (..., N or rows, ..., out) -> (..., N, T, out)
        lead = g.ndim - d.ndim
        return g.astype(dtype).reshape(*g.shape[:lead], a.shape[0], -1, n_out)

    bias, conv = layout.bias is not None, layout.kind == "conv"
    out: dict[str, Any] = {}
    if any(s in FACTORS for s in which):
        big_a = _a_factor(a, n, bias, conv)  # one A for every K-FAC estimator asked for
        seeds = {"kflr": exact, "kfac": mc, "kfac_empirical": d}
        for name in (s for s in FACTORS if s in which):
            g = rows(seeds[name])
            if name == "kfac_empirical":  # each example's dL/dy carries the 1/N of the mean
                g = g * jnp.sqrt(jnp.asarray(n, dtype))
            out[name] = Factors(big_a, _g_factor(g, conv))

    def as_params(w_mat, b_vec):
        tree = {layout.weight: layout.from_matrix(w_mat, w_shape)}
        if bias:
            tree[layout.bias] = b_vec.reshape(params[layout.bias].shape)
        return tree

    for name, seeds in (("diag_ggn", exact), ("diag_ggn_mc", mc)):
        if name in which:
            out[name] = as_params(*_per_example_sq(a, rows(seeds)))
    if any(s in which for s in FIRST_ORDER):
        dd = rows(d)
        if "sum_grad_squared" in which or "backpack_variance" in which:
            sgs = as_params(*_per_example_sq(a, dd[None]))
            if "sum_grad_squared" in which:
                out["sum_grad_squared"] = sgs
            if "backpack_variance" in which:
                out["backpack_variance"] = jax.tree.map(
                    lambda s, g: _variance(s, g.astype(dtype), n), sgs, _used(grad_params, sgs)
                )
        if "batch_l2" in which:
            w, b = _batch_sq_norms(a, dd)
            out["batch_l2"] = {layout.weight: w, **({layout.bias: b} if bias else {})}
    return LayerCurvature(**out, layout=layout)


def shared_stats(which: Sequence[str], calls: Sequence[tuple], n: int) -> dict[str, Any]:
    """The per-example statistics ``which`` of ONE weight (and bias) used by several dense calls
    with one layout: each example's gradient is the sum of the calls' (``vjpkit.stats`` keeps
    the cross terms), so ``diag_ggn`` is the diagonal of that weight's whole GGN, not the sum of
    the calls' own diagonals. ``calls``: per call ``(layout, params, grad_params, x, d, exact,
    mc)`` as ``layer_stats`` takes them (examples on axis 0). Returns ``{field: {leaf key:
    array}}`` keyed by the first call's params keys."""
    layout, params = calls[0][0], calls[0][1]
    w_shape = tuple(params[layout.weight].shape)
    n_in, n_out = layout.matrix_shape(w_shape)
    dtype = stats_dtype(calls[0][3].dtype)
    rows_in = [_rows_in(lay, x.astype(dtype), w_shape) for lay, _, _, x, _, _, _ in calls]
    bias = layout.bias is not None

    ds = [c[4] for c in calls]

    def rows(g, k):  # call k's (..., N or rows, ..., out) -> (..., N, T, out)
        lead = g.ndim - ds[k].ndim
        return g.astype(dtype).reshape(*g.shape[:lead], rows_in[k].shape[0], -1, n_out)

    def matrices(gs):  # one seed's Rows of every call: weight and bias
        w = [statslayer.Rows(a, g, (0,), (1,), (n_in, n_out)) for a, g in zip(rows_in, gs)]
        b = [statslayer.Rows.bias(g, (n_out,)) for g in gs]
        return w, b

    def square_sum(seeds):  # seeds per call (K, N, T, out): sum over seeds of sum_n (sum_c J)^2
        def body(acc, gs):
            w, b = matrices(gs)
            return (acc[0] + statslayer.sum_sq(w), acc[1] + statslayer.sum_sq(b)), None

        zero = (jnp.zeros((n_in, n_out), dtype), jnp.zeros((n_out,), dtype))
        stacked = [rows(sd, k) for k, sd in enumerate(seeds)]
        if stacked[0].shape[0] == 1:
            return body(zero, [g[0] for g in stacked])[0]
        return lax.scan(body, zero, stacked)[0]

    def as_params(w_mat, b_vec):
        tree = {layout.weight: layout.from_matrix(w_mat, w_shape)}
        if bias:
            tree[layout.bias] = b_vec.reshape(params[layout.bias].shape)
        return tree

    out: dict[str, Any] = {}
    for name, pos in (("diag_ggn", 5), ("diag_ggn_mc", 6)):
        if name in which:
            out[name] = as_params(*square_sum([c[pos] for c in calls]))
    if "sum_grad_squared" in which or "backpack_variance" in which:
        sgs = as_params(*square_sum([d[None] for d in ds]))
        if "sum_grad_squared" in which:
            out["sum_grad_squared"] = sgs
        if "backpack_variance" in which:
            total = {k: sum(c[2][k].astype(dtype) for c in calls) for k in sgs}
            out["backpack_variance"] = {k: _variance(sgs[k], total[k], n) for k in sgs}
    if "batch_l2" in which:
        w, b = matrices([rows(d, k) for k, d in enumerate(ds)])
        out["batch_l2"] = {
            layout.weight: statslayer.sq_norms(w),
            **({layout.bias: statslayer.sq_norms(b)} if bias else {}),
        }
    return out


def _variance(sgs: jax.Array, grad: jax.Array, n: int) -> jax.Array:
    """BackPACK's ``Variance``: ``(1/N) sum_n g_n^2 - ((1/N) sum_n g_n)^2`` of the per-example
    gradients ``g_n = grad l_n / N`` (``sgs = sum_n g_n^2``, ``grad = sum_n g_n``)."""
    return sgs / n - jnp.square(grad / n)


def _used(grad_params: dict, like: dict) -> dict:
    return {k: grad_params[k] for k in like}


# --------------------------------------------------------------------------------------------
# Layers without a matrix form (embeddings, norm affines, any per-example layer): the diagonal
# and first-order statistics from per-example parameter gradients, materialised one seed at a time


def local_stats(
    which: Sequence[str],
    per_example: Any,
    params: Any,
    grad_params: Any,
    d: jax.Array,
    exact: jax.Array | None,
    mc: jax.Array | None,
    n: int,
    where: str,
    kind: str,
    axis: int = 0,
) -> dict[str, Any]:
    """The statistics of a layer with no K-FAC rule, from ``per_example(g) -> {leaf: (N, ...)}``,
    its per-example parameter gradients for output cotangents ``g`` (examples on ``axis``)."""
    factors = [s for s in which if s in FACTORS]
    if factors:
        raise ConfigError(
            f"vk.curvature.stats: {where} is {kind}, which has no Kronecker-factored rule, so "
            f"{factors} are not defined for it. Ask for its diagonal ({list(DIAGONAL)}: the "
            "diagonal block kfac-jax uses for scale-and-shift layers) or leave it out of the globs."
        )
    if d.shape[axis] != n:
        raise ConfigError(
            f"vk.curvature.stats: {where}: the per-example statistics {list(which)} read axis {axis} of "
            f"the layer's output as the {n} examples of the registered loss, but it has "
            f"{d.shape[axis]} entries there."
        )
    dtype = stats_dtype(d.dtype)

    def square_sum(seeds):  # sum over seeds and examples of the squared per-example gradients
        def body(acc, g):
            pe = per_example(g)
            return jax.tree.map(lambda a, p: a + jnp.sum(jnp.square(p.astype(dtype)), axis=0), acc, pe), None

        zero = jax.tree.map(lambda p: jnp.zeros(p.shape, dtype), params)
        return _over_seeds(body, zero, seeds)

    out: dict[str, Any] = {}
    if "diag_ggn" in which:
        out["diag_ggn"] = square_sum(exact)
    if "diag_ggn_mc" in which:
        out["diag_ggn_mc"] = square_sum(mc)
    if "sum_grad_squared" in which or "backpack_variance" in which:
        sgs = square_sum(d[None])
        if "sum_grad_squared" in which:
            out["sum_grad_squared"] = sgs
        if "backpack_variance" in which:
            out["backpack_variance"] = jax.tree.map(
                lambda s, g: _variance(s, g.astype(dtype), n), sgs, grad_params
            )
    if "batch_l2" in which:
        pe = per_example(d)
        out["batch_l2"] = jax.tree.map(
            lambda p: jnp.sum(jnp.square(p.astype(dtype)).reshape(p.shape[0], -1), axis=1), pe
        )
    return out
