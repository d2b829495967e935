"""Curvature blocks: the preconditioner of one group of parameter leaves, as pure functions.

Contract. A ``Block`` is a NamedTuple of pure functions over its ``BlockState(stats, cache)``,
in the style of optax's ``(init, update)``; ``vk.curvature.kfac`` holds one per group of
leaves and only routes statistics and gradients to them.

* ``init() -> BlockState``: zero statistics; a cache of NaN (a block preconditions nothing
  before its first statistics: a jitted update without them gives NaN, never a silent step).
* ``update(state, stats, decay) -> BlockState``: the statistics' EMA,
  ``decay * old + (1 - decay) * stats`` (``decay = 0`` takes ``stats`` as they are).
* ``refresh(state, damping) -> BlockState``: the cache (inverses, eigendecompositions) from
  the EMA statistics, with the Tikhonov ``damping``.
* ``precondition(state, grads) -> grads``: the block's leaves' gradients (a tuple, in the
  block's leaf order) preconditioned with the cache. A Kronecker block also takes
  ``rows=(a, d)``, the gradient's rows (``GradRows``): with ``solver="inverse"`` and fewer
  flops than ``A^-1 M G^-1`` it computes ``(a A^-1)^T (d G^-1)`` (K-FAC's records form), when
  ``a^T d`` is ``M`` to rounding (a fixed random projection; else the Kronecker form).
* ``eigen(state) -> (bases, eigenvalues)``: the EMA statistics' eigendecomposition, side by
  side (``None`` as the basis of a diagonal side: the identity).
* ``sync(stats, axis_name) -> stats``: one step's statistics averaged over a mapped axis.

Blocks: ``kronecker`` (``Factors(A, G)`` of the matrix ``[W; b]``, each side dense or, past
``max_factor_dim``, diagonal), ``ekfac`` (the same factors' eigenbasis with its scaling
corrected by each example's gradient, ``Ekfac``) and ``diagonal`` (one diagonal per leaf).
Statistics and caches have the leading axes ``lead`` of a stacked leaf (one block per
``lax.scan`` iteration, computed with ``jax.vmap``). Computations run in the block's
``dtype``; gradients keep theirs.
This module imports only ``vjpkit.stats`` and ``vjpkit.curvature._types`` of vjpkit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import stats as statslayer
from ._types import Ekfac, Factors, Layout

__all__ = [
    "Block", "BlockState", "Eigen", "EkfacBasis", "EkfacStats", "diagonal", "ekfac", "ekfac_scaling",
    "kronecker", "per_slice", "side_diagonal",
]  # fmt: skip


class BlockState(NamedTuple):
    """A block's EMA statistics and its cache (as of the last ``refresh``)."""

    stats: Any
    cache: Any


class Eigen(NamedTuple):
    """A Kronecker block's eigh cache: ``(A kron G + damping I)^-1`` is
    ``U_A [. / (s_A s_G^T + damping)] U_G^T`` (a diagonal side's basis is empty: the identity)."""

    u_a: jax.Array
    s_a: jax.Array
    u_g: jax.Array
    s_g: jax.Array
    damping: jax.Array


class Block(NamedTuple):
    """A curvature block's pure functions (see the module contract)."""

    init: Callable[[], BlockState]
    update: Callable[[BlockState, Any, Any], BlockState]
    refresh: Callable[[BlockState, Any], BlockState]
    precondition: Callable[[BlockState, tuple], tuple]
    eigen: Callable[[BlockState], tuple]
    sync: Callable[[Any, Any], Any]


def per_slice(f, lead: tuple, *xs: Any) -> Any:
    """``f`` of each stacked slice of ``xs`` (leading axes ``lead``), stacked back."""
    if not lead:
        return f(*xs)
    n = math.prod(lead)
    flat = [jax.tree.map(lambda a: a.reshape(n, *a.shape[len(lead) :]), x) for x in xs]
    out = jax.vmap(f)(*flat)
    return jax.tree.map(lambda a: a.reshape(*lead, *a.shape[1:]), out)


def _ema(old: Any, new: Any, decay: Any) -> Any:
    return jax.tree.map(lambda o, x: decay * o + (1.0 - decay) * x.astype(o.dtype), old, new)


def _sync(stats: Any, axis_name: Any) -> Any:
    return stats if axis_name is None else jax.tree.map(lambda x: lax.pmean(x, axis_name), stats)


def _nan(shape: tuple, dtype: Any) -> jax.Array:
    return jnp.asarray(np.full(shape, np.nan, dtype))  # built in NumPy: no program per shape


def _zeros(shape: tuple, dtype: Any) -> jax.Array:
    return jnp.asarray(np.zeros(shape, dtype))


# The records form's check: |M v - a^T (d v)| <= 2 eps | |a|^T (|d| |v|) |. Measured in float32
# on XLA:CPU for rows and gradients that are equal (R = 16 ... 2048, widths 10 ... 1000), the
# left side is at most 0.11 eps |...|: any larger difference is a change to the gradient
# (weight decay, clipping) and takes the Kronecker form. A looser, worst-case rounding bound
# (64 eps sqrt(R) sum |a_r| |d_r| |v|) let a weight decay of 1e-4 through in float32.
_ROWS_TOL = 2


def side_diagonal(x: jax.Array, diag: bool) -> jax.Array:
    """A factor side's diagonal (its trace terms) whether it is stored dense or as a vector."""
    return x if diag else jnp.diagonal(x, axis1=-2, axis2=-1)


def _on_matrix(layout: Layout, dtype: Any, apply: Callable) -> Callable:
    """``one(cache, w[, b])``: ``apply(cache, M)`` on the block's matrix ``M = [W; b]``, laid out
    as the weight (and bias) leaves again, each in its own dtype."""

    def one(cache, w, *b):
        m = layout.to_matrix(w).astype(dtype)
        if b:
            m = jnp.concatenate([m, b[0].reshape(1, -1).astype(dtype)], axis=0)
        return _as_leaves(layout, apply(cache, m), w, *b)

    return one


def _as_leaves(layout: Layout, p: jax.Array, w: jax.Array, *b: jax.Array) -> tuple:
    """A block's matrix ``[W; b]`` laid out as the weight (and bias) leaves, each in its dtype."""
    pw = layout.from_matrix(p[:-1] if b else p, w.shape).astype(w.dtype)
    return (pw, p[-1].reshape(b[0].shape).astype(b[0].dtype)) if b else (pw,)


def kronecker(
    layout: Layout,
    d_a: int,
    d_g: int,
    *,
    dtype: Any,
    lead: tuple = (),
    diag_a: bool = False,
    diag_g: bool = False,
    solver: str = "inverse",
    pi_damping: bool = True,
) -> Block:
    """A Kronecker-factored block of the matrix ``M = [W; b]`` (``(d_a, d_g)``, ``layout``'s).

    Statistics: ``Factors(A, G)``, each ``(d, d)``, or ``(d,)`` when ``diag_a`` / ``diag_g``.

    * ``solver="inverse"``: ``A_d^-1 M G_d^-1``, ``A_d = A + pi sqrt(damping)``,
      ``G_d = G + sqrt(damping) / pi`` with ``pi = sqrt((tr A / d_a) / (tr G / d_g))``
      (Martens & Grosse sec. 6.3; 1 when ``pi_damping`` is False or a trace is 0), inverted
      (a diagonal side by division).
    * ``solver="eigh"``: the exactly damped ``(A kron G + damping I)^-1 vec M`` in the factors'
      eigenbases, eigenvalues clipped at 0.

    Grads: ``(weight,)`` or ``(weight, bias)`` leaves, with the leading axes ``lead``.
    """
    eye = lambda d: jnp.eye(d, dtype=dtype)

    def init() -> BlockState:
        stats = Factors(
            _zeros((*lead, d_a) if diag_a else (*lead, d_a, d_a), dtype),
            _zeros((*lead, d_g) if diag_g else (*lead, d_g, d_g), dtype),
        )
        if solver == "eigh":
            u = lambda d, diag: _nan((*lead, 0) if diag else (*lead, d, d), dtype)
            cache = Eigen(
                u(d_a, diag_a), _zeros((*lead, d_a), dtype), u(d_g, diag_g), _zeros((*lead, d_g), dtype),
                _nan(lead, dtype),
            )  # fmt: skip
        else:
            cache = Factors(*(_nan(s.shape, dtype) for s in stats))
        return BlockState(stats, cache)

    def eigen_one(a, g):
        def side(x, diag):
            if diag:
                return jnp.zeros((0,), x.dtype), jnp.maximum(x, 0.0)
            s, u = jnp.linalg.eigh(x)
            return u, jnp.maximum(s, 0.0)

        (u_a, s_a), (u_g, s_g) = side(a, diag_a), side(g, diag_g)
        return u_a, s_a, u_g, s_g

    def invert_one(a, g, damping):
        if solver == "eigh":
            return Eigen(*eigen_one(a, g), jnp.asarray(damping, dtype))
        if pi_damping:
            ta, tg = jnp.sum(side_diagonal(a, diag_a)) / d_a, jnp.sum(side_diagonal(g, diag_g)) / d_g
            ok = (ta > 0) & (tg > 0)
            pi = jnp.where(ok, jnp.sqrt(jnp.where(ok, ta, 1.0) / jnp.where(ok, tg, 1.0)), 1.0)
        else:
            pi = jnp.ones((), dtype)
        sq = math.sqrt(damping)

        def inv(x, diag, shift, d):
            if diag:
                return 1.0 / (x + shift)
            # LU, not cho_solve: cho_solve's program beside the diagonal blocks' hung XLA:CPU's
            # concurrency-optimized scheduler of jaxlib 0.10.x (no hang with this, 3 of 3 runs)
            return jnp.linalg.inv(x + shift * eye(d))

        return Factors(inv(a, diag_a, pi * sq, d_a), inv(g, diag_g, sq / pi, d_g))

    def apply_one(cache, m):
        if solver == "eigh":  # a diagonal side's basis is the identity
            rotated = m if diag_a else cache.u_a.T @ m
            rotated = rotated if diag_g else rotated @ cache.u_g
            scaled = rotated / (cache.s_a[:, None] * cache.s_g[None, :] + cache.damping)
            scaled = scaled if diag_a else cache.u_a @ scaled
            return scaled if diag_g else scaled @ cache.u_g.T
        m = cache.A[:, None] * m if diag_a else cache.A @ m
        return m * cache.G[None, :] if diag_g else m @ cache.G

    def refresh(state: BlockState, damping: Any) -> BlockState:
        cache = per_slice(lambda a, g: invert_one(a, g, damping), lead, *state.stats)
        return BlockState(state.stats, cache)

    def side_cost(d: int, diag: bool) -> int:  # a side's product with one row (or column)
        return d if diag else d * d

    def records_cheaper(n_rows: int) -> bool:
        """Whether ``(a A^-1)^T (d G^-1)`` over ``n_rows`` rows costs fewer flops than
        ``A^-1 M G^-1`` (a batch smaller than the layer's sides); ``"inverse"`` only."""
        kron = side_cost(d_a, diag_a) * d_g + d_a * side_cost(d_g, diag_g)
        rows = n_rows * (side_cost(d_a, diag_a) + side_cost(d_g, diag_g) + d_a * d_g)
        return solver == "inverse" and rows < kron

    def rows_match(a, d, w, *b):
        """Whether ``a^T d`` is the grads' ``M`` to rounding, through a fixed random projection
        (``M v`` read from the leaves as they are: no copy of ``M``)."""
        a, d = a.astype(dtype), d.astype(dtype)
        v = jnp.asarray(np.random.default_rng(d_g).standard_normal(d_g), dtype)
        mv = layout.to_matrix(w).astype(dtype) @ v  # a float32 w is not copied (a half one is)
        if b:
            mv = jnp.concatenate([mv, (b[0].reshape(-1).astype(dtype) @ v)[None]])
        err = jnp.linalg.norm(mv - a.T @ (d @ v))
        bound = jnp.linalg.norm(jnp.abs(a).T @ (jnp.abs(d) @ jnp.abs(v)))
        return err <= _ROWS_TOL * jnp.finfo(dtype).eps * bound

    def rows_one(cache, a, d, w, *b):
        """``apply_one`` in the records form, ``(a A^-1)^T (d G^-1)``."""
        a, d = a.astype(dtype), d.astype(dtype)
        left = a * cache.A[None, :] if diag_a else a @ cache.A.T
        return _as_leaves(layout, left.T @ (d * cache.G[None, :] if diag_g else d @ cache.G), w, *b)

    def precondition(state: BlockState, grads: tuple, rows: Any = None) -> tuple:
        def kron(_=None):
            return per_slice(_on_matrix(layout, dtype, apply_one), lead, state.cache, *grads)

        if rows is None or not records_cheaper(rows[0].shape[-2]):
            return kron()
        # one decision for every slice: a cond under the slices' vmap would run both forms
        same = jnp.all(per_slice(rows_match, lead, *rows, *grads))
        return lax.cond(same, lambda _: per_slice(rows_one, lead, state.cache, *rows, *grads), kron, None)

    def eigen(state: BlockState) -> tuple:
        u_a, s_a, u_g, s_g = per_slice(eigen_one, lead, *state.stats)
        return (None if diag_a else u_a, None if diag_g else u_g), (s_a, s_g)

    def update(state: BlockState, stats: Any, decay: Any) -> BlockState:
        return BlockState(Factors(*_ema(tuple(state.stats), tuple(stats), decay)), state.cache)

    return Block(init, update, refresh, precondition, eigen, _sync)


def diagonal(shapes: tuple[tuple[int, ...], ...], *, dtype: Any) -> Block:
    """A diagonal block of leaves of ``shapes``: each gradient entry divided by its damped
    curvature diagonal, ``g / (d + damping)`` (exact damping; the same under both solvers).

    Statistics: a tuple of one diagonal per leaf (its shape); cache: the damped reciprocals.
    """

    def init() -> BlockState:
        stats = tuple(_zeros(s, dtype) for s in shapes)
        return BlockState(stats, tuple(_nan(s, dtype) for s in shapes))

    def update(state: BlockState, stats: Any, decay: Any) -> BlockState:
        return BlockState(tuple(_ema(state.stats, tuple(stats), decay)), state.cache)

    def refresh(state: BlockState, damping: Any) -> BlockState:
        return BlockState(state.stats, tuple(1.0 / (jnp.maximum(d, 0.0) + damping) for d in state.stats))

    def precondition(state: BlockState, grads: tuple) -> tuple:
        return tuple((g.astype(dtype) * c).astype(g.dtype) for g, c in zip(grads, state.cache, strict=True))

    def eigen(state: BlockState) -> tuple:
        return tuple(None for _ in shapes), state.stats

    return Block(init, update, refresh, precondition, eigen, _sync)


# --------------------------------------------------------------------------------------------
# EKFAC: K-FAC's eigenbasis, its eigenvalues replaced by each example's second moment in it


class EkfacStats(NamedTuple):
    """An EKFAC block's statistics: the EMA factors and the EMA ``scaling`` ``(d_a, d_g)``, the
    second moment of each example's gradient of ``[W; b]`` in the basis of the last refresh."""

    A: jax.Array
    G: jax.Array
    scaling: jax.Array


class EkfacBasis(NamedTuple):
    """An EKFAC block's cache: the factors' eigenbases as of the last refresh (empty for a
    diagonal side: the identity) and the damping (NaN before the first refresh)."""

    u_a: jax.Array
    u_g: jax.Array
    damping: jax.Array


def ekfac_scaling(stats: Ekfac, u_a: jax.Array | None = None, u_g: jax.Array | None = None) -> jax.Array:
    """EKFAC's scaling of one layer call: ``sum_{k,n} (U_A^T J_kn U_G)**2`` elementwise, ``(d_a, d_g)``,
    where ``J_kn = sum_t a[n, t] g[k, n, t]^T`` is example ``n``'s gradient of ``M = [W; b]`` in
    Monte-Carlo pass ``k`` (``Ekfac``'s rows). ``None`` bases are the identity (then it is the
    Fisher's diagonal, ``diag_ggn_mc``, laid out as ``M``).

    Examples:
        >>> st = captured["fc1"].ekfac
        >>> (u_a, u_g), _ = vk.curvature.ekfac_block(...).eigen(state)  # or any orthogonal bases
        >>> vk.curvature.ekfac_scaling(st, jnp.linalg.eigh(st.A)[1], jnp.linalg.eigh(st.G)[1])
    """
    a = stats.a if u_a is None else stats.a @ u_a.astype(stats.a.dtype)
    g = stats.g if u_g is None else stats.g @ u_g.astype(stats.g.dtype)
    shape = (int(a.shape[-1]), int(g.shape[-1]))

    def one(gk):  # one pass: sum_n J_n**2, with the per-example gradients formed in chunks
        return statslayer.sum_sq([statslayer.Rows(a, gk, (0,), (1,), shape)])

    if g.shape[0] == 1:
        return one(g[0])
    return lax.scan(lambda acc, gk: (acc + one(gk), None), jnp.zeros(shape, a.dtype), g)[0]


def ekfac(
    layout: Layout,
    d_a: int,
    d_g: int,
    *,
    dtype: Any,
    lead: tuple = (),
    diag_a: bool = False,
    diag_g: bool = False,
) -> Block:
    """An EKFAC block of ``M = [W; b]`` (George et al. 2018): ``(A kron G)``'s eigenbasis
    ``U_A kron U_G`` with the scaling ``S`` measured in it, ``M -> U_A [(U_A^T M U_G) / (S +
    damping)] U_G^T`` (exact damping).

    Statistics: ``Ekfac(A, G, a, g)`` of one step. ``update`` takes the EMA of ``A``, ``G`` and
    of ``S`` = ``ekfac_scaling`` in the current basis; ``refresh`` takes the new eigenbasis of
    the EMA factors and carries ``S`` into it as the diagonal, there, of the matrix ``S`` stood
    for: ``S' = (R_A * R_A) S (R_G * R_G)^T`` with ``R = U_new^T U_old`` (unchanged when the bases
    agree). The first basis is the identity, so the first step's ``S`` is the Fisher's
    diagonal, carried into the first eigenbasis. A diagonal side (``diag_a`` / ``diag_g``) keeps
    the identity basis.
    """

    def init() -> BlockState:
        stats = EkfacStats(
            _zeros((*lead, d_a) if diag_a else (*lead, d_a, d_a), dtype),
            _zeros((*lead, d_g) if diag_g else (*lead, d_g, d_g), dtype),
            _zeros((*lead, d_a, d_g), dtype),
        )
        eye = lambda d, diag: _zeros((*lead, 0), dtype) if diag else jnp.asarray(
            np.broadcast_to(np.eye(d, dtype=dtype), (*lead, d, d))
        )  # fmt: skip
        return BlockState(stats, EkfacBasis(eye(d_a, diag_a), eye(d_g, diag_g), _nan(lead, dtype)))

    def scaling_one(a, g, u_a, u_g):
        return ekfac_scaling(Ekfac(None, None, a, g), None if diag_a else u_a, None if diag_g else u_g)

    def update(state: BlockState, stats: Any, decay: Any) -> BlockState:
        s = per_slice(
            scaling_one, lead, stats.a.astype(dtype), stats.g.astype(dtype), state.cache.u_a, state.cache.u_g
        )
        old = state.stats
        new = _ema((old.A, old.G, old.scaling), (stats.A, stats.G, s), decay)
        return BlockState(EkfacStats(*new), state.cache)

    def refresh_one(a, g, scaling, u_a, u_g, damping):
        def side(x, u, diag):
            if diag:
                return u, None
            v = jnp.linalg.eigh(x)[1]
            return v, jnp.square(v.T @ u)

        (v_a, r_a), (v_g, r_g) = side(a, u_a, diag_a), side(g, u_g, diag_g)
        s = scaling if r_a is None else r_a @ scaling
        s = s if r_g is None else s @ r_g.T
        return s, EkfacBasis(v_a, v_g, jnp.asarray(damping, dtype))

    def refresh(state: BlockState, damping: Any) -> BlockState:
        st, cache = state.stats, state.cache
        s, basis = per_slice(
            lambda *xs: refresh_one(*xs, damping), lead, st.A, st.G, st.scaling, cache.u_a, cache.u_g
        )
        return BlockState(EkfacStats(st.A, st.G, s), basis)

    def apply_one(at, m):  # in the eigenbasis, divided by the damped scaling, and back
        scaling, cache = at
        r = m if diag_a else cache.u_a.T @ m
        r = r if diag_g else r @ cache.u_g
        r = r / (scaling + cache.damping)
        r = r if diag_a else cache.u_a @ r
        return r if diag_g else r @ cache.u_g.T

    def precondition(state: BlockState, grads: tuple) -> tuple:
        at = (state.stats.scaling, state.cache)
        return per_slice(_on_matrix(layout, dtype, apply_one), lead, at, *grads)

    def eigen(state: BlockState) -> tuple:
        c = state.cache
        return (None if diag_a else c.u_a, None if diag_g else c.u_g), state.stats.scaling

    def sync(stats: Ekfac, axis_name: Any) -> Ekfac:
        """The factors averaged; the rows gathered over the axis (the examples of every shard),
        ``g`` scaled so that the scaling is the shards' average."""
        if axis_name is None:
            return stats
        shards = lax.psum(jnp.ones((), stats.g.dtype), axis_name)
        gather = lambda x: lax.all_gather(x, axis_name, axis=x.ndim - 3, tiled=True)
        return Ekfac(
            lax.pmean(stats.A, axis_name), lax.pmean(stats.G, axis_name), gather(stats.a),
            gather(stats.g) / jnp.sqrt(shards),
        )  # fmt: skip

    return Block(init, update, refresh, precondition, eigen, sync)
