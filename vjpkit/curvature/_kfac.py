"""A K-FAC preconditioner as an optax transformation, fed by ``vk.curvature.stats``' factors.

Contract. ``kfac(learning_rate, like=...)`` (and ``scale_by_kfac(like=...)``, its direction
without momentum and learning rate) returns an ``optax.GradientTransformationExtraArgs``
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
* Blocks (``_blocks``). ``like``'s calls are grouped by the leaves they read. A group of
  ``Factors`` calls of one layout (a weight called twice, ``fc1`` and ``fc1#1``, or closed over
  by a ``lax.scan``, one factor per iteration along leading axes) is one Kronecker block: their
  ``A``'s are summed and their ``G``'s are summed, separately. Any other group (``Diagonal``
  calls: embeddings, norm affines, residual biases; or calls of different kinds or layouts on
  one leaf, a tied embedding) is one diagonal block, the sum of its calls' diagonals (a
  ``Factors`` call's ``diag(A) kron diag(G)``). A block's state is keyed by its first layer name
  in ``like``'s order.
* Stacked leaves. A weight given to ``lax.scan`` as ``xs`` (blocks over stacked weights,
  ``Layout.scans`` with ``"s"``) is one block per slice: its factors, their EMA and inverses
  keep the iterations' leading axes, and each slice of the leaf is preconditioned by its own
  (``jax.vmap`` over the slices), exactly as the same model unrolled into separate weights.
* EKFAC (``estimator="ekfac"``): each Kronecker group is an ``_blocks.ekfac`` block instead, fed
  the same summed factors and the calls' per-example rows joined (``_ekfac_gather``).
* Leaves no layer reads. ``stats`` gives each such leaf (a class token, a temperature) an
  entry of ``Layout`` kind ``"leaf"`` holding each estimator's ``Diagonal``: one diagonal block,
  as any other ``Diagonal`` call.
* Fallback. Leaves no call of ``like`` covers, and calls without a leaf path (a weight computed
  in the loss or carried through a scan, a bias row the factors include but no bias leaf), get
  the plain gradient, ``-learning_rate * g`` (SGD), each warned about once (``UserWarning``).
* Statistics. ``A_ema = decay * A_ema + (1 - decay) * A`` (same for ``G``), the EMA taking the
  first step's factors themselves (initialised at the first observation, not bias-corrected).
  With ``axis_name`` the step's factors are ``lax.pmean``-ed over that axis before the EMA.
* Records form. When the step's curvature holds a Kronecker group's gradient rows
  (``stats(..., ["kfac", "grad_rows"])``; every call of the group), a ``"inverse"`` block whose
  rows are fewer than its sides (a batch smaller than the layer) preconditions
  ``(a A^-1)^T (d G^-1)`` instead of ``A^-1 M G^-1``, when ``a^T d`` is the updates' ``M`` to
  rounding (else the Kronecker form: a transformation before K-FAC in a chain that changed
  the gradient). A curvature dict with rows only (``stats(..., ["grad_rows"])``) is a step
  without statistics (below) preconditioned in that form.
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
* Pieces. ``scale_by_kfac`` is everything above but the tail: statistics, refresh and
  preconditioning, returning the direction. ``kfac`` is it followed by the tail, as
  ``optax.chain`` would compose them, with the two states flattened into one ``KfacState``.
  The statistics and the preconditioning stay one transformation: both read the blocks' EMA,
  and optax's members share no state.

Computations run in the factors' dtype promoted to at least float32; outputs take each leaf's
dtype. This module imports only ``vjpkit._errors`` and ``vjpkit.curvature._blocks`` /
``_types`` of vjpkit.
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
from vjpkit.curvature._blocks import Block, BlockState, diagonal, ekfac, kronecker, per_slice, side_diagonal
from vjpkit.curvature._types import Diagonal, Ekfac, Factors, LayerCurvature, Layout, stats_dtype

__all__ = ["KfacState", "ScaleByKfacState", "kfac", "scale_by_kfac"]

_ESTIMATORS = ("kfac", "kflr", "kfac_empirical", "ekfac")
_SOLVERS = ("inverse", "eigh")


class ScaleByKfacState(NamedTuple):
    """The state of ``scale_by_kfac``: ``KfacState`` without the tail's.

    Attributes:
        count: the number of updates done (int32 scalar).
        factors: the EMA statistics per preconditioned block, keyed by its first layer name.
        inverses: per block, what its refresh cached (see ``KfacState``).
    """

    count: jax.Array
    factors: dict[str, Any]
    inverses: dict[str, Any]


class KfacState(NamedTuple):
    """The state of ``kfac``: ``scale_by_kfac``'s fields and the tail's state (``inner``).

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


def _keystr(path) -> str:
    return jax.tree_util.keystr(tuple(path))


def _lead_sum(x: jax.Array, scans: str, k: int) -> jax.Array:
    """Sums the leading (scan) axes of a stacked statistic with ``k`` own trailing axes, but
    those of the scans that slice the leaf (``"s"`` in ``scans``, one letter per leading axis)."""
    summed = tuple(i for i in range(x.ndim - k) if i >= len(scans) or scans[i] != "s")
    return jnp.sum(x, axis=summed) if summed else x


def _stat_of(rec: Any, name: str, estimator: str, where: str) -> Factors | Ekfac | Diagonal:
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
    if rec.layout is None:
        raise ConfigError(
            f"kfac: layer {name!r} has no layout in {where}; pass records from vk.curvature.stats."
        )
    return f


class _Call(NamedTuple):
    """One layer call of ``like``: its statistic's kind and the leaves it reads."""

    name: str
    layout: Layout
    kron: bool  # Factors (else Diagonal)
    leaves: tuple  # leaf key paths: (weight[, bias]) for Factors, the layout's leaves else
    shapes: tuple  # (A, G) shapes, or each diagonal's
    dtype: Any  # what its block computes in


def _kron_dims(call: _Call) -> tuple[tuple, int, int, bool, bool]:
    """``(lead, d_a, d_g, diag_a, diag_g)`` of a Factors call (``lead``: its sliced iterations)."""
    n = len(call.layout.scans)
    (a, g) = call.shapes
    lead = tuple(k for k, how in zip(a[:n], call.layout.scans) if how == "s")
    return lead, a[-1], g[-1], len(a) - n == 1, len(g) - n == 1


class _Planned(NamedTuple):
    """A block of the plan: its key (first layer name), its calls and leaves, the ``Block``,
    and ``gather(curvature) -> stats`` (one step's statistics of the block from its calls)."""

    key: str
    names: tuple
    leaves: tuple
    block: Block
    gather: Any
    rows: Any = None  # rows(curvature) -> (a, d) of a Kronecker group, or None (_rows_gather)


def _rows_gather(calls: list, dtype: Any) -> Any:
    """``rows(curvature)``: a Kronecker group's gradient rows (``GradRows``), every call's (and
    every iteration's of a scan closing over the weight) joined along the rows' axis, so that
    ``a^T d`` is the group's gradient; ``None`` when a call's entry has none."""

    def rows(curvature):
        got = [(curvature[c.name].grad_rows, c.layout.scans) for c in calls]
        if any(r is None for r, _ in got):
            return None
        a = jnp.concatenate([_fold(jnp.asarray(r.a), scans) for r, scans in got], axis=-2)
        d = jnp.concatenate([_fold(jnp.asarray(r.d), scans) for r, scans in got], axis=-2)
        return a.astype(dtype), d.astype(dtype)

    return rows


def _check_kron(call: _Call, leaves: list, estimator: str) -> None:
    """That a Factors call's ``A``, ``G`` fit its weight (and bias) leaf arrays."""
    layout, (w, *b) = call.layout, leaves
    lead, d_a, d_g, _, _ = _kron_dims(call)
    k = layout.n_stacked
    if tuple(w.shape[:k]) != lead:
        raise ConfigError(
            f"kfac: layer {call.name!r}: the weight leaf {_keystr(layout.weight_leaf)} of shape "
            f"{tuple(w.shape)} is given to lax.scan as xs with {lead} iterations: its leading axes "
            f"must be {lead}."
        )
    wshape = tuple(w.shape[k:])
    if not 1 <= layout.in_ndim < len(wshape):
        raise ConfigError(
            f"kfac: layer {call.name!r}: the weight leaf {_keystr(layout.weight_leaf)} has shape {wshape}, "
            f"which cannot hold in_ndim={layout.in_ndim} input axes and an output axis."
        )
    d_in, d_out = layout.matrix_shape(wshape)
    if (d_a, d_g) != (d_in + bool(b), d_out):
        _, _, _, diag_a, diag_g = _kron_dims(call)
        want = [(d,) if diag else (d, d) for d, diag in ((d_in + bool(b), diag_a), (d_out, diag_g))]
        raise ConfigError(
            f"kfac: layer {call.name!r}: {estimator} factors A {call.shapes[0]}, G {call.shapes[1]} do not "
            f"fit the weight leaf {_keystr(layout.weight_leaf)} of shape {wshape} (transpose="
            f"{layout.transpose}, in_ndim={layout.in_ndim}{', with a bias' if b else ''}): expected "
            f"A {want[0]}, G {want[1]}."
        )
    if b and (tuple(b[0].shape[:k]) != lead or math.prod(b[0].shape[k:]) != d_out):
        raise ConfigError(
            f"kfac: layer {call.name!r}: the bias leaf {_keystr(layout.bias_leaf)} has shape "
            f"{tuple(b[0].shape)}, expected "
            + (f"{lead} iterations of " if lead else "")
            + f"{d_out} entries."
        )


def _kron_diagonal(call: _Call, f: Factors, shapes: list) -> list:
    """``diag(A kron G)`` of a Factors call laid out as its weight (and bias) leaves."""
    scans = call.layout.scans
    _, _, _, diag_a, diag_g = _kron_dims(call)
    a = _lead_sum(side_diagonal(jnp.asarray(f.A), diag_a), scans, 1)
    g = _lead_sum(side_diagonal(jnp.asarray(f.G), diag_g), scans, 1)
    outer = a[..., :, None] * g[..., None, :]
    k = call.layout.n_stacked
    w_shape = shapes[0][k:]
    n_in = call.layout.matrix_shape(w_shape)[0]
    out = [per_slice(lambda m: call.layout.from_matrix(m[:n_in], w_shape), shapes[0][:k], outer)]
    if len(shapes) > 1:
        out.append(outer[..., -1, :].reshape(shapes[1]))
    return out


class _Plan(NamedTuple):
    calls: tuple  # every _Call of like
    groups: tuple  # tuples of _Call indices sharing leaves, each one block
    warnings: tuple  # layers whose leaves are not known (their leaves get the gradient)

    @property
    def owned(self) -> set:
        return {leaf for group in self.groups for i in group for leaf in self.calls[i].leaves}


def _plan(like: Mapping[str, LayerCurvature], estimator: str) -> _Plan:
    """The static plan from ``like``: its calls, grouped into blocks by the leaves they read."""
    calls, warned = [], []
    for name, rec in like.items():
        layout = getattr(rec, "layout", None)
        if getattr(layout, "kind", None) == "leaf" and getattr(rec, estimator, None) is None:
            continue  # a leaf no layer reads has a kfac entry only: uncovered (warned) otherwise
        f, layout = _stat_of(rec, name, estimator, "like"), rec.layout
        if isinstance(f, (Factors, Ekfac)):
            leaves = (layout.weight_leaf,) + ((layout.bias_leaf,) if layout.bias is not None else ())
            shapes = (tuple(f.A.shape), tuple(f.G.shape))
            n = len(layout.scans)
            if any(len(sh) <= n or (len(sh) > n + 1 and sh[-1] != sh[-2]) for sh in shapes):
                raise ConfigError(
                    f"kfac: layer {name!r}: {estimator}.A and .G must be square (..., d, d) or diagonal "
                    f"(d,) after its {n} scan axes; got A {shapes[0]} and G {shapes[1]}."
                )
        else:
            leaves = tuple(p for _, p in layout.leaves)
            shapes = tuple(tuple(x.shape) for x in jax.tree.leaves(f.diagonal))
        if not leaves or any(p is None for p in leaves):
            warned.append(
                f"kfac: layer {name!r} has {estimator} statistics but no leaf path in the params for "
                f"{'its weight or bias' if isinstance(f, (Factors, Ekfac)) else 'some of its parameters'} "
                "(a value computed in the loss or carried through a lax.scan, or a layer inside a "
                "lax.cond branch, whose statistics are NaN on the steps that take another branch), so "
                "they are not used. Its leaves get their 'leaf' entries' diagonal blocks where like has "
                "them (stats with 'kfac' or 'ekfac'); any leaf nothing covers gets the plain gradient "
                "(SGD direction) and is named in its own warning."
            )
            continue
        dtype = jax.dtypes.canonicalize_dtype(stats_dtype(jax.tree.leaves(f)[0].dtype))
        kron = isinstance(f, (Factors, Ekfac))
        calls.append(_Call(name, layout, kron, tuple(map(tuple, leaves)), shapes, dtype))
    parent = list(range(len(calls)))  # union-find of the calls sharing a leaf

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[tuple, int] = {}
    for i, call in enumerate(calls):
        for leaf in call.leaves:
            parent[root(i)] = root(first.setdefault(leaf, i))
    groups: dict[int, list[int]] = {}
    for i in range(len(calls)):
        groups.setdefault(root(i), []).append(i)
    return _Plan(tuple(calls), tuple(tuple(g) for g in groups.values()), tuple(warned))


def _same_kron(calls: list[_Call]) -> bool:
    """Whether calls of one group form one Kronecker block: all Factors of the same leaves,
    layout and factor shapes (a weight called twice, or closed over by a scan)."""
    if not all(c.kron for c in calls):
        return False
    head = calls[0]

    def sig(c: _Call) -> tuple:
        lay = c.layout
        return (c.leaves, lay.transpose, lay.in_ndim, lay.kind, _kron_dims(c))

    return all(sig(c) == sig(head) for c in calls)


def _build(plan: _Plan, shapes: Mapping[tuple, tuple], estimator: str, solver: str, pi_damping: bool) -> list:
    """The plan's blocks for leaves of ``shapes`` (leaf path -> shape): a Kronecker block per
    group of ``_same_kron`` calls, else a diagonal block over the group's leaves, each call
    adding its diagonal (a Factors call ``diag(A kron G)``)."""
    out = []
    for group in plan.groups:
        calls = [plan.calls[i] for i in group]
        head = calls[0]
        names, dtype = tuple(c.name for c in calls), head.dtype
        for c in calls:
            if c.kron:
                _check_kron(c, [jax.ShapeDtypeStruct(shapes[leaf], dtype) for leaf in c.leaves], estimator)
        if _same_kron(calls):
            lead, d_a, d_g, diag_a, diag_g = _kron_dims(head)
            factors = _factor_sum(calls, lead, (diag_a, diag_g), (d_a, d_g), dtype, estimator)
            if estimator == "ekfac":
                block = ekfac(head.layout, d_a, d_g, dtype=dtype, lead=lead, diag_a=diag_a, diag_g=diag_g)
                gather = _ekfac_gather(calls, factors, dtype)
            else:
                block = kronecker(
                    head.layout, d_a, d_g, dtype=dtype, lead=lead, diag_a=diag_a, diag_g=diag_g,
                    solver=solver, pi_damping=pi_damping,
                )  # fmt: skip
                gather = lambda curvature, factors=factors: Factors(*factors(curvature))
            rows = _rows_gather(calls, dtype) if estimator != "ekfac" else None
            out.append(_Planned(head.name, names, head.leaves, block, gather, rows))
            continue
        leaves = tuple(dict.fromkeys(leaf for c in calls for leaf in c.leaves))
        for c in calls:
            if not c.kron:
                for leaf, sh in zip(c.leaves, c.shapes, strict=True):
                    k = len(c.layout.scans)
                    kept = tuple(n for n, how in zip(sh[:k], c.layout.scans) if how == "s") + sh[k:]
                    if kept != tuple(shapes[leaf]):
                        raise ConfigError(
                            f"kfac: layer {c.name!r}: its {estimator} diagonal of shape {sh} (scans "
                            f"{c.layout.scans!r}) does not fit the leaf {_keystr(leaf)} of shape "
                            f"{tuple(shapes[leaf])}."
                        )

        def gather(curvature, calls=calls, leaves=leaves, dtype=dtype):
            total = {leaf: jnp.zeros(shapes[leaf], dtype) for leaf in leaves}
            for c in calls:
                f = _stat_of(curvature[c.name], c.name, estimator, "curvature")
                if c.kron:
                    parts = _kron_diagonal(c, f, [shapes[leaf] for leaf in c.leaves])
                else:
                    parts = [
                        _lead_sum(jnp.asarray(x), c.layout.scans, x.ndim - len(c.layout.scans))
                        for x in jax.tree.leaves(f.diagonal)
                    ]
                for leaf, x in zip(c.leaves, parts, strict=True):
                    total[leaf] = total[leaf] + x.reshape(shapes[leaf]).astype(dtype)
            return tuple(total[leaf] for leaf in leaves)

        block = diagonal(tuple(tuple(shapes[leaf]) for leaf in leaves), dtype=dtype)
        out.append(_Planned(head.name, names, leaves, block, gather))
    return out


def _fold(x: jax.Array, scans: str) -> jax.Array:
    """Rows ``(*scan axes, ..., T, d)`` with the axes of the scans
    that do not slice the leaf (``"c"``: the same weight every iteration) folded into ``T``."""
    fold = [i for i, how in enumerate(scans) if how != "s"]
    if not fold:
        return x
    t = x.ndim - 2  # the rows' axis; the folded scan axes go just before it, then join it
    x = jnp.moveaxis(x, fold, range(t - len(fold), t))
    return x.reshape(*x.shape[: t - len(fold)], -1, x.shape[-1])


def _factor_sum(calls: list, lead: tuple, diag: tuple, d: tuple, dtype: Any, estimator: str) -> Any:
    """``sum(curvature) -> (A, G)``: one step's factors of a Kronecker group, each call's scan axes
    summed but the slicing ones (``lead``), checked against ``like``'s shapes, summed over calls."""

    def total(curvature):
        out = None
        for c in calls:
            f = _stat_of(curvature[c.name], c.name, estimator, "curvature")
            want = tuple((*lead, n) if dg else (*lead, n, n) for n, dg in zip(d, diag))
            got = tuple(
                _lead_sum(jnp.asarray(x), c.layout.scans, 1 if dg else 2).astype(dtype)
                for x, dg in zip((f.A, f.G), diag)
            )
            if tuple(x.shape for x in got) != want:
                raise ConfigError(
                    f"kfac: layer {c.name!r}: this step's {estimator} factors A {tuple(f.A.shape)}, "
                    f"G {tuple(f.G.shape)} differ from like's {c.shapes[0]}, {c.shapes[1]}."
                )
            out = got if out is None else tuple(t + x for t, x in zip(out, got))
        return out

    return total


def _ekfac_gather(calls: list, factors: Any, dtype: Any) -> Any:
    """One step's ``Ekfac`` of a group of calls of one weight: the factors summed
    (``_factor_sum``, as K-FAC's), the rows of every call (and every iteration of a scan closing
    over the weight) joined along the rows' axis, so that each example's gradient is the sum of
    the calls'."""

    def gather(curvature):
        fs = [(_stat_of(curvature[c.name], c.name, "ekfac", "curvature"), c.layout.scans) for c in calls]
        rows_a = jnp.concatenate([_fold(f.a, scans) for f, scans in fs], axis=-2)
        rows_g = jnp.concatenate([_fold(f.g, scans) for f, scans in fs], axis=-2)
        return Ekfac(*factors(curvature), rows_a.astype(dtype), rows_g.astype(dtype))

    return gather


def _rows_only(curvature: Any) -> bool:
    """Whether a step's curvature dict holds gradient rows and no statistic at all
    (``stats(globs, ["grad_rows"])``: the records form with the cached inverses, no update)."""
    if not isinstance(curvature, Mapping) or not curvature:
        return False
    entries = [c for c in curvature.values() if isinstance(c, LayerCurvature)]
    others = [f.name for f in dataclasses.fields(LayerCurvature) if f.name not in ("grad_rows", "layout")]
    return (  # another statistic (another estimator's) is not rows only: step_stats says what is missing
        len(entries) == len(curvature)
        and all(getattr(c, f) is None for c in entries for f in others)
        and any(c.grad_rows is not None for c in entries)
    )


def _block_rows(blocks: list, curvature: Mapping) -> dict:
    """``{block key: (a, d)}`` of the Kronecker blocks whose calls all have gradient rows."""
    out = {}
    for b in blocks:
        if b.rows is not None and all(n in curvature for n in b.names):
            got = b.rows(curvature)
            if got is not None:
                out[b.key] = got
    return out


def kfac(
    learning_rate: optax.ScalarOrSchedule,
    *,
    like: Mapping[str, LayerCurvature],
    estimator: str = "kfac",
    damping: float = 1e-3,
    decay: float = 0.95,
    update_every: int = 1,
    solver: str | None = None,
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
      False or a trace is 0), inverted by LU;
    * ``solver="eigh"``: the exactly damped ``(A kron G + damping I)^-1 vec M``, i.e.
      ``U_A [(U_A^T M U_G) / (s_A s_G^T + damping)] U_G^T`` with eigenvalues clipped at 0
      (``pi_damping`` does not apply).

    Several calls of one weight leaf (a shared weight) form one block whose ``A``'s are summed
    and whose ``G``'s are summed. A leaf no layer reads is a diagonal block when ``like`` has its
    ``"leaf"`` entry (``stats`` with ``kfac``); leaves nothing in ``like`` covers get the plain
    gradient, with a warning (see the module docstring for the EMA, the refresh and the fallback
    rules).

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
    inner = scale_by_kfac(
        like=like, estimator=estimator, damping=damping, decay=decay, update_every=update_every,
        solver=solver, pi_damping=pi_damping, axis_name=axis_name,
    )  # fmt: skip
    tail = optax.chain(
        optax.trace(decay=momentum) if momentum is not None else optax.identity(),
        optax.scale_by_learning_rate(learning_rate),
    )

    def init_fn(params: Any) -> KfacState:
        return KfacState(*inner.init(params), tail.init(params))

    def update_fn(
        updates: Any,
        state: KfacState,
        params: Any = None,
        *,
        curvature: Mapping[str, LayerCurvature] | None = None,
        **extra_args: Any,
    ) -> tuple[Any, KfacState]:
        del extra_args  # other members' extra arguments under optax.chain
        own = ScaleByKfacState(state.count, state.factors, state.inverses)
        direction, own = inner.update(updates, own, params, curvature=curvature)
        out, tail_state = tail.update(direction, state.inner, params)
        return out, KfacState(*own, tail_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def scale_by_kfac(
    *,
    like: Mapping[str, LayerCurvature],
    estimator: str = "kfac",
    damping: float = 1e-3,
    decay: float = 0.95,
    update_every: int = 1,
    solver: str | None = None,
    pi_damping: bool = True,
    axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """The blocks' statistics and preconditioning alone: ``kfac`` without momentum and
    learning rate, for any optax tail (``scale_by_adam``'s naming: the direction, not the step).

    ``kfac(lr, momentum=m, ...)`` is ``scale_by_kfac(...)`` followed by ``optax.trace(m)`` and
    ``optax.scale_by_learning_rate(lr)``. The arguments are ``kfac``'s; the state is a
    ``ScaleByKfacState(count, factors, inverses)``. ``vk.train.make_step`` / ``fit`` find it
    inside any chain and pass it the statistics as they do ``kfac``.

    Examples:
        >>> opt = optax.chain(vk.curvature.scale_by_kfac(like=like, damping=1e-2), optax.adam(1e-3))
        >>> updates, state = opt.update(grads, state, params, curvature=curvature)
    """
    if estimator not in _ESTIMATORS:
        raise ConfigError(f"kfac: estimator={estimator!r}; use one of {_ESTIMATORS}.")
    if solver is None:
        solver = "eigh" if estimator == "ekfac" else "inverse"
    if solver not in _SOLVERS:
        raise ConfigError(f"kfac: solver={solver!r}; use one of {_SOLVERS}.")
    if estimator == "ekfac" and solver != "eigh":
        raise ConfigError(
            f"kfac(estimator='ekfac'): solver={solver!r}; EKFAC preconditions in the factors' "
            "eigenbasis with its own scaling: leave solver= out (or pass 'eigh')."
        )
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
    plan = _plan(like, estimator)
    built: dict[tuple, list] = {}  # the blocks per leaf shapes (init and every update trace)
    warned: set[str] = set()

    def warn(messages) -> None:
        for message in messages:
            if message not in warned:
                warned.add(message)
                warnings.warn(message, UserWarning, stacklevel=5)

    def blocks_for(tree: Any, what: str) -> tuple[list, dict, list, Any]:
        """The blocks for ``tree``'s leaves, its leaf index, leaves and treedef."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        index = {tuple(p): i for i, (p, _) in enumerate(flat)}
        for call in plan.calls:
            for leaf in call.leaves:
                if leaf not in index:
                    raise ConfigError(
                        f"kfac: layer {call.name!r} names the leaf {_keystr(leaf)}, which is not in {what} "
                        f"(its leaves: {', '.join(_keystr(p) for p, _ in flat[:8])}"
                        f"{', ...' if len(flat) > 8 else ''}); pass the params the curvature was "
                        "captured for (the layout's paths are relative to the differentiated argument)."
                    )
        shapes = {tuple(p): tuple(np.shape(x)) for p, x in flat}
        key = tuple(shapes.items())
        if key not in built:
            built[key] = _build(plan, shapes, estimator, solver, pi_damping)
        return built[key], index, [x for _, x in flat], treedef

    def uncovered(index: dict) -> list[str]:
        owned = plan.owned
        rest = [_keystr(p) for p in index if p not in owned]
        if not rest:
            return []
        return [
            f"kfac: no layer of like covers the leaves {', '.join(rest[:8])}"
            f"{', ...' if len(rest) > 8 else ''}: they get the plain gradient (SGD direction). Include "
            "the layers that use them in vk.curvature.stats' globs (every layer kind has a block, "
            "Kronecker or diagonal); a leaf no layer reads gets its diagonal block from "
            "stats(glob matching it, ['kfac']) with estimator='kfac' (the Monte-Carlo passes' squared "
            "gradients)."
        ]

    def init_fn(params: Any) -> ScaleByKfacState:
        blocks, index, _, _ = blocks_for(params, "params")
        warn([*plan.warnings, *uncovered(index)])
        states = {b.key: b.block.init() for b in blocks}
        return ScaleByKfacState(
            jnp.asarray(np.zeros((), np.int32)),
            {k: st.stats for k, st in states.items()},
            {k: st.cache for k, st in states.items()},
        )

    def step_stats(blocks: list, curvature: Mapping[str, LayerCurvature]) -> dict[str, Any]:
        if not isinstance(curvature, Mapping):
            raise ConfigError(
                f"kfac: curvature= is a {type(curvature).__name__}, not a dict of LayerCurvature."
            )
        missing = [n for n in like if n not in curvature]
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
        return {b.key: b.block.sync(b.gather(curvature), axis_name) for b in blocks}

    def update_fn(
        updates: Any,
        state: ScaleByKfacState,
        params: Any = None,
        *,
        curvature: Mapping[str, LayerCurvature] | None = None,
        **extra_args: Any,
    ) -> tuple[Any, ScaleByKfacState]:
        del params, extra_args  # other members' extra arguments under optax.chain
        blocks, index, leaves, treedef = blocks_for(updates, "the updates")
        warn([*plan.warnings, *uncovered(index)])
        states = {b.key: BlockState(state.factors[b.key], state.inverses[b.key]) for b in blocks}
        # each Kronecker block's gradient rows this step (the records form), if the curvature has them
        rows = _block_rows(blocks, curvature) if curvature is not None else {}
        if curvature is not None and _rows_only(curvature):
            curvature = None  # rows only: no statistics this step
        if curvature is None:  # no statistics this step: the cached inverses precondition it
            if not isinstance(state.count, jax.core.Tracer) and int(state.count) == 0:
                raise ConfigError(
                    "kfac: the first update() has no curvature=: there are no statistics to "
                    "precondition with yet (the step would be plain momentum SGD). Pass the step's "
                    "vk.curvature.stats capture as update(..., curvature=...) at least on the first "
                    "step; later steps may omit it to reuse the cached inverses."
                )
        else:
            new = step_stats(blocks, curvature)
            step_decay = jnp.where(state.count == 0, 0.0, decay)  # the first step takes its own
            states = {b.key: b.block.update(states[b.key], new[b.key], step_decay) for b in blocks}

            def refresh(states):
                return {b.key: b.block.refresh(states[b.key], damping) for b in blocks}

            if update_every == 1:
                states = refresh(states)
            else:
                states = lax.cond(state.count % update_every == 0, refresh, lambda s: s, states)

        direction = list(leaves)
        for b in blocks:
            at = [index[leaf] for leaf in b.leaves]
            grads = tuple(leaves[i] for i in at)
            got = rows.get(b.key)
            new_grads = (
                b.block.precondition(states[b.key], grads, got)
                if got is not None
                else b.block.precondition(states[b.key], grads)
            )
            for i, p in zip(at, new_grads, strict=True):
                direction[i] = p
        direction = jax.tree_util.tree_unflatten(treedef, direction)
        factors = {k: st.stats for k, st in states.items()}
        inverses = {k: st.cache for k, st in states.items()}
        return direction, ScaleByKfacState(optax.safe_increment(state.count), factors, inverses)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
