"""One layer call's per-example parameter gradient in matrix form, and its first-order statistics.

Contract. A ``Rows`` is what one layer call contributes to one parameter leaf's per-example
gradients: for each example ``i`` (axis 0 of every array),

    ``g_i = sum_r a_ir (x) b_ir``, laid out as the leaf: its axes ``left`` (flattened, ``m``
    entries) then ``right`` (``n`` entries), transposed back to the leaf's own axis order.

``a`` is ``(B, R, m)`` (a dense layer's input rows: every position of the example, or a conv's
unfolded patches, ``Rows.conv``) or a ``OneHot`` (an embedding lookup: the row of the table each
position reads);
``b`` is ``(B, R, n)`` (the output cotangent rows). A bias is ``a = 1``: ``Rows.bias(d)``. A leaf
used by several calls (a layer called twice, an embedding tied to the head) is a list of ``Rows``
whose ``g_i`` add, cross terms included.

The statistics (every function takes the list of one leaf's ``Rows``):

* ``sq_norms``: ``||g_i||^2``, ``(B,)``. Ghost norm ``sum_{u,v} <A_u A_v^T, B_u B_v^T>`` over the
  per-example Gram matrices (``B x R^2`` floats) when the uses share one ``(left, right)``
  split and ``R^2 <= m n`` or a ``OneHot`` is among them (whose materialised gradient would be
  ``B x`` the table); otherwise each ``g_i`` is formed (``B x m x n`` floats, cheaper for short
  rows of a small weight).
* ``weighted_sum(rows, c)``: ``sum_i c_i g_i`` in the leaf's layout (``c = 1``: the batch
  gradient; DP-SGD's clipped sum), never forming a ``g_i``.
* ``sum_sq``: ``sum_i g_i**2`` elementwise (BackPACK's ``SumGradSquared``, the diagonal GGN
  from seeded cotangents): ``(a*a)^T (b*b)`` with one row per example; for one lookup, each
  row times the sum of the example's rows at the same index (``B x R^2``); else the ``g_i``
  formed in chunks of examples.
* ``materialize``: ``g_i`` stacked, ``(B, *leaf)``; ``reduced``: ``(||g_i||^2, sum_i g_i)`` only
  when ``sq_norms`` must form the ``g_i`` (else None), so that a caller needing the batch
  gradient too sums them instead of computing it again.
* ``check(rows, batch_grad)``: whether ``weighted_sum(rows, 1)`` equals the batch gradient,
  through a fixed random projection (two matrix-vector products), to a bound on rounding.

Everything is computed in the arrays' own dtype; callers choose it (float32, or float64).
This module imports nothing of vjpkit: it is the layer both ``vk.inspect`` and
``vk.curvature`` read their per-example statistics from.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._patches import column, padded, patches

_CHUNK = 1 << 24  # floats of g_i formed at once by sum_sq / materialize when they must be formed
_PATCHES = 1 << 20  # floats of unfolded patches a conv's per-example kernel gradient may make


class OneHot(NamedTuple):
    """Rows that are one-hot over ``size`` entries: row ``r`` of example ``i`` is ``e_{index[i, r]}``
    scaled by ``weight[i, r]`` (``None``: 1). An embedding lookup's rows; an index outside
    ``[0, size)`` must carry weight 0 (a lookup that fills out-of-range rows with zeros)."""

    index: jax.Array  # (B, R) int
    size: int
    weight: jax.Array | None = None  # (B, R) float, or None


class Rows(NamedTuple):
    """One layer call's per-example gradient of one leaf (see the module contract)."""

    a: Any  # (B, R, m) array, or a OneHot
    b: jax.Array  # (B, R, n)
    left: tuple[int, ...]  # leaf axes of a's m entries, in order
    right: tuple[int, ...]  # leaf axes of b's n entries, in order
    shape: tuple[int, ...]  # the leaf's shape

    @classmethod
    def dense(cls, x: jax.Array, d: jax.Array, shape: Sequence[int], left: Sequence[int] | None = None,
              right: Sequence[int] | None = None) -> Rows:  # fmt: skip
        """``x @ W``'s rows: ``x (B, ..., m)``, ``d (B, ..., n)``, whose trailing axes are the leaf's
        axes ``left`` and ``right`` in that order (default: the leading axes of the leaf whose
        sizes multiply to ``x``'s last axis, then the rest)."""
        shape = tuple(int(s) for s in shape)
        if left is None or right is None:
            left, right = _split(shape, int(x.shape[-1]))
        m, n = math.prod(shape[k] for k in left), math.prod(shape[k] for k in right)
        return cls(
            x.reshape(x.shape[0], -1, m), d.reshape(d.shape[0], -1, n), tuple(left), tuple(right), shape
        )

    @classmethod
    def conv(cls, x: jax.Array, d: jax.Array, kernel: Sequence[int], strides: Sequence[int] = (),
             padding: Any = "VALID", dilation: Sequence[int] = ()) -> Conv:  # fmt: skip
        """A channels-last convolution with an HWIO (WIO, DHWIO) ``kernel``: ``x (B, ..., *spatial,
        c_in)``, ``d (B, ..., *out_spatial, c_out)``. A ``Conv``: its rows are the output positions
        with ``a`` the unfolded patches (``patches``), formed only for the ghost norm."""
        kernel = tuple(int(k) for k in kernel)
        nd = len(kernel) - 2
        return Conv(x, d, kernel, tuple(strides) or (1,) * nd, padding, tuple(dilation) or (1,) * nd)

    @classmethod
    def bias(cls, d: jax.Array, shape: Sequence[int]) -> Rows:
        """A bias added on the trailing axes of the output: ``a = 1``, ``b = d``'s rows."""
        shape = tuple(int(s) for s in shape)
        b = d.reshape(d.shape[0], -1, math.prod(shape))
        return cls(jnp.ones((*b.shape[:2], 1), b.dtype), b, (), tuple(range(len(shape))), shape)

    @classmethod
    def lookup(
        cls, index: jax.Array, d: jax.Array, shape: Sequence[int], weight: jax.Array | None = None
    ) -> Rows:
        """``table[index]``: ``index (B, ...)``, ``d (B, ..., *shape[1:])``, rows of the table's axis 0."""
        shape = tuple(int(s) for s in shape)
        n = math.prod(shape[1:])
        index = index.reshape(index.shape[0], -1)
        w = None if weight is None else weight.reshape(index.shape).astype(d.dtype)
        return cls(
            OneHot(index, shape[0], w), d.reshape(d.shape[0], -1, n), (0,), tuple(range(1, len(shape))), shape
        )

    @property
    def m(self) -> int:
        return self.a.size if isinstance(self.a, OneHot) else int(self.a.shape[-1])

    @property
    def n(self) -> int:
        return int(self.b.shape[-1])

    @property
    def n_rows(self) -> int:
        return int(self.b.shape[1])

    def swapped(self) -> Rows:
        """The same rows with ``a`` and ``b`` exchanged (a dense ``a`` only)."""
        return Rows(self.b, self.a, self.right, self.left, self.shape)


_DN = {1: ("NWC", "WIO", "NWC"), 2: ("NHWC", "HWIO", "NHWC"), 3: ("NDHWC", "DHWIO", "NDHWC")}


class Conv(NamedTuple):
    """A convolution's use of its kernel (``Rows.conv``): as ``Rows`` of patches for the ghost
    norm (``P^2 <= K c_out`` with ``P`` output positions per example, ``K`` the patch size), else
    each example's kernel gradient formed (``B x`` the kernel floats): one batched matrix product
    of the unfolded patches with the cotangents when the patches are small (``B P K`` at most
    ``_PATCHES`` floats), else one per window offset over that offset's strided input slice (no
    patches). Both are the kernel gradient's own sums kept per example: on XLA:CPU 1.1-4x faster
    than the vmapped vjp of the convolution (a grouped convolution) on ResNet-sized layers."""

    x: jax.Array
    d: jax.Array
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    padding: Any
    dilation: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.kernel

    def _images(self, a: jax.Array) -> jax.Array:
        """``a``'s leading axes (examples, their own batch of one) flattened into one batch axis."""
        nd = len(self.kernel) - 2
        return a.reshape(-1, *a.shape[a.ndim - nd - 1 :])

    @property
    def ghost(self) -> bool:
        positions = math.prod(self.d.shape[1:]) // self.kernel[-1]
        return positions * positions <= math.prod(self.kernel)

    def rows(self) -> Rows:
        nd = len(self.kernel) - 2
        p = patches(self._images(self.x), self.kernel[:-2], self.strides, self.padding, self.dilation)
        a = p.reshape(self.x.shape[0], -1, p.shape[-1])
        return Rows.dense(a, self.d, self.kernel, tuple(range(nd + 1)), (nd + 1,))

    def _vjp(self, x: jax.Array, d: jax.Array) -> jax.Array:
        nd = len(self.kernel) - 2

        def conv(w):
            return jax.lax.conv_general_dilated(
                x, w, self.strides, self.padding, rhs_dilation=self.dilation, dimension_numbers=_DN[nd]
            )

        return jax.vjp(conv, jnp.zeros(self.kernel, x.dtype))[1](d.astype(x.dtype))[0]

    def reduced(self) -> tuple[jax.Array, jax.Array]:
        """``(||g_i||^2 (B,), sum_i g_i)`` without keeping every ``g_i``: per window offset on
        long rows (the squared norms add over the offsets' disjoint kernel slices)."""
        g = self._patched()
        if g is not None:
            return jnp.sum(jnp.square(g.reshape(g.shape[0], -1)), axis=1), jnp.sum(g, axis=0)
        sq, total = self._per_offset(lambda g: (jnp.sum(jnp.square(g), axis=(1, 2)), jnp.sum(g, axis=0)))
        return jnp.sum(sq, axis=0), total.reshape(self.kernel)

    def _patched(self) -> jax.Array | None:
        """``g_i`` from the unfolded patches when they are small (``_PATCHES``), else None."""
        b, window = self.x.shape[0], self.kernel[:-2]
        positions = math.prod(self.d.shape[1:]) // self.kernel[-1]
        if b * positions * math.prod(self.kernel[:-1]) > _PATCHES:
            return None
        a = patches(self._images(self.x), window, self.strides, self.padding, self.dilation)
        d = self.d.reshape(b, positions, self.kernel[-1]).astype(self.x.dtype)
        return jnp.einsum("bpk,bpo->bko", a.reshape(b, positions, -1), d).reshape(b, *self.kernel)

    def _per_offset(self, f) -> Any:
        """``f(g_off)`` of each window offset's ``(B, c_in, c_out)`` slice of ``g_i``, stacked on a
        leading offset axis (``jax.lax.map``: one offset's input slice at a time)."""
        b, window = self.x.shape[0], self.kernel[:-2]
        d = self.d.reshape(b, -1, self.kernel[-1]).astype(self.x.dtype)  # (B, positions, c_out)
        xp, out, strides, dilation = padded(
            self._images(self.x), window, self.strides, self.padding, self.dilation
        )
        offsets = jnp.asarray(list(itertools.product(*(range(k) for k in window))), jnp.int32)

        def one(offset):
            c = column(xp, offset, out, strides, dilation).reshape(*d.shape[:2], -1)
            return f(jnp.einsum("bpi,bpo->bio", c, d))

        return jax.lax.map(one, offsets)

    def per_example(self) -> jax.Array:
        g = self._patched()
        if g is not None:
            return g
        return jnp.moveaxis(self._per_offset(lambda g: g), 1, 0).reshape(self.x.shape[0], *self.kernel)

    def total(self, c: jax.Array | None) -> jax.Array:
        d = self.d if c is None else self.d * c.reshape(-1, *[1] * (self.d.ndim - 1)).astype(self.d.dtype)
        return self._vjp(self._images(self.x), self._images(d))


def _expand(rows: Sequence[Any]) -> list[Rows]:
    """Every use as ``Rows`` (a ``Conv`` by its patches)."""
    return [r.rows() if isinstance(r, Conv) else r for r in rows]


def _split(shape: tuple[int, ...], m: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    for k in range(len(shape) + 1):
        if math.prod(shape[:k]) == m:
            return tuple(range(k)), tuple(range(k, len(shape)))
    raise ValueError(f"no leading axes of a weight {shape} hold {m} inputs")


def _oriented(rows: Sequence[Rows]) -> list[Rows] | None:
    """The rows on one ``(left, right)`` split (a use on the swapped split exchanges its ``a``
    and ``b``), or None when the uses split the leaf differently."""
    first = rows[0]
    out = []
    for r in rows:
        if (r.left, r.right) == (first.left, first.right):
            out.append(r)
        elif (r.right, r.left) == (first.left, first.right) and not isinstance(r.a, OneHot):
            out.append(r.swapped())
        elif (r.right, r.left) == (first.left, first.right) and not isinstance(first.a, OneHot):
            return _oriented([r] + [q for q in rows if q is not r])
        else:
            return None
    return out


def _gram(u: Any, v: Any) -> jax.Array:
    """``(B, R_u, R_v)``: per example, the inner products of the rows of ``u`` and ``v``."""
    if isinstance(u, OneHot) and isinstance(v, OneHot):
        weights = [w for w in (u.weight, v.weight) if w is not None]
        g = (u.index[:, :, None] == v.index[:, None, :]).astype(weights[0].dtype if weights else jnp.float32)
        if u.weight is not None:
            g = g * u.weight[:, :, None].astype(g.dtype)
        if v.weight is not None:
            g = g * v.weight[:, None, :].astype(g.dtype)
        return g
    if isinstance(u, OneHot):
        return jnp.swapaxes(_gram(v, u), 1, 2)
    if isinstance(v, OneHot):  # u's entry at v's index: (B, R_u, R_v), never B x the table
        idx = jnp.clip(v.index, 0, v.size - 1)
        g = jnp.take_along_axis(u, jnp.broadcast_to(idx[:, None, :], (*u.shape[:2], idx.shape[1])), axis=2)
        return g if v.weight is None else g * v.weight[:, None, :].astype(g.dtype)
    return jnp.einsum("brm,bsm->brs", u, v)


def _ghost(rows: list[Rows]) -> bool:
    n_rows = sum(r.n_rows for r in rows)
    return any(isinstance(r.a, OneHot) for r in rows) or n_rows * n_rows <= rows[0].m * rows[0].n


def reduced(rows: Sequence[Rows]) -> tuple[jax.Array, jax.Array] | None:
    """``(||g_i||^2, sum_i g_i)`` when ``sq_norms`` must form the ``g_i`` (a convolution with long
    rows, or rows too long for the ghost norm), else None (ghost norm or one row: nothing formed,
    and the batch gradient is better taken from the backward pass). A caller that needs the
    batch gradient too takes this sum instead of computing it again."""
    rows = list(rows)
    if len(rows) == 1 and isinstance(rows[0], Conv):  # decided by its shapes: no patches made here
        return None if rows[0].ghost else rows[0].reduced()
    expanded = _expand(rows)
    oriented = _oriented(expanded)
    if oriented is not None and (
        (all(r.n_rows == 1 for r in oriented) and len(oriented) == 1) or _ghost(oriented)
    ):
        return None
    g = materialize(expanded)
    return jnp.sum(jnp.square(g.reshape(g.shape[0], -1)), axis=1), jnp.sum(g, axis=0)


_UNSET: Any = object()


def sq_norms(rows: Sequence[Rows], done: Any = _UNSET) -> jax.Array:
    """``||g_i||^2`` of the leaf, ``(B,)`` (see the module contract); ``done``: ``reduced(rows)``
    when the caller has it already (``None`` included: it is not computed again)."""
    rows = list(rows)
    done = reduced(rows) if done is _UNSET else done
    if done is not None:
        return done[0]
    oriented = _oriented(_expand(rows))
    if len(oriented) == 1 and oriented[0].n_rows == 1:
        r = oriented[0]
        return _row_sq(r.a)[:, 0] * jnp.sum(jnp.square(r.b[:, 0]), -1)
    total = 0.0
    for k, u in enumerate(oriented):
        for v in oriented[k:]:
            term = jnp.sum(_gram(u.a, v.a).astype(u.b.dtype) * _gram(u.b, v.b), axis=(1, 2))
            total = total + (term if v is u else 2 * term)
    return total


def _row_sq(a: Any) -> jax.Array:
    if isinstance(a, OneHot):
        return jnp.ones(a.index.shape) if a.weight is None else jnp.square(a.weight)
    return jnp.sum(jnp.square(a), -1)


def _to_leaf(mat: jax.Array, r: Rows, lead: tuple[int, ...] = ()) -> jax.Array:
    """``(*lead, m, n)`` in the ``(left, right)`` layout to ``(*lead, *leaf)``."""
    order = (*r.left, *r.right)
    mat = mat.reshape(*lead, *(r.shape[k] for k in order))
    nl = len(lead)
    return jnp.transpose(mat, (*range(nl), *(nl + order.index(k) for k in range(len(order)))))


def _scatter(a: OneHot, b: jax.Array) -> jax.Array:
    """``sum_r e_{index_r} b_r^T`` over every example and row: ``(size, n)``."""
    w = b if a.weight is None else b * a.weight[..., None].astype(b.dtype)
    return jax.ops.segment_sum(w.reshape(-1, b.shape[-1]), a.index.reshape(-1), num_segments=a.size)


def _product(a: Any, b: jax.Array) -> jax.Array:
    """``sum_{i, r} a_ir b_ir^T``: ``(m, n)``."""
    if isinstance(a, OneHot):
        return _scatter(a, b)
    return jnp.einsum("brm,brn->mn", a, b)


def weighted_sum(rows: Sequence[Rows], c: jax.Array | None = None) -> jax.Array:
    """``sum_i c_i g_i`` in the leaf's layout (``c=None``: all ones, the batch gradient)."""
    total = 0.0
    for r in rows:
        if isinstance(r, Conv):
            total = total + r.total(c)
            continue
        b = r.b if c is None else r.b * c[:, None, None].astype(r.b.dtype)
        total = total + _to_leaf(_product(r.a, b), r)
    return total


def _one_example(r: Rows, i: Any) -> jax.Array:
    """``g_i`` of one use in the ``(m, n)`` layout."""
    b = r.b[i][None]
    if isinstance(r.a, OneHot):
        a = OneHot(r.a.index[i][None], r.a.size, None if r.a.weight is None else r.a.weight[i][None])
    else:
        a = r.a[i][None]
    return _product(a, b)


def _examples(rows: list[Rows], f) -> jax.Array:
    """``f(g_i)`` of each example's leaf-shaped ``g_i`` (a ``jax.lax.map`` in chunks of examples)."""
    size = math.prod(rows[0].shape)
    batch = int(rows[0].b.shape[0])

    def one(i):
        return f(sum(_to_leaf(_one_example(r, i), r) for r in rows))

    chunk = max(1, min(batch, _CHUNK // max(size, 1)))
    return jax.lax.map(one, jnp.arange(batch), batch_size=chunk)


def materialize(rows: Sequence[Rows]) -> jax.Array:
    """``g_i`` stacked: ``(B, *leaf)``."""
    rows = list(rows)
    convs = [r.per_example() for r in rows if isinstance(r, Conv)]
    rows = [r for r in rows if not isinstance(r, Conv)]
    if not rows:
        return sum(convs)
    if all(not isinstance(r.a, OneHot) for r in rows):
        out = sum(_to_leaf(jnp.einsum("brm,brn->bmn", r.a, r.b), r, (int(r.b.shape[0]),)) for r in rows)
    else:
        out = _examples(rows, lambda g: g)
    return out + sum(convs) if convs else out


def sum_sq(rows: Sequence[Rows]) -> jax.Array:
    """``sum_i g_i**2`` elementwise, in the leaf's layout."""
    rows = list(rows)
    if any(isinstance(r, Conv) for r in rows):
        return jnp.sum(jnp.square(materialize(rows)), axis=0)
    if len(rows) == 1 and rows[0].n_rows == 1:
        r = rows[0]
        a = r.a
        if isinstance(a, OneHot):
            sq = OneHot(a.index, a.size, None if a.weight is None else jnp.square(a.weight))
            return _to_leaf(_scatter(sq, jnp.square(r.b)), r)
        return _to_leaf(jnp.square(a[:, 0]).T @ jnp.square(r.b[:, 0]), r)
    size, batch = math.prod(rows[0].shape), int(rows[0].b.shape[0])
    if len(rows) == 1 and isinstance(rows[0].a, OneHot) and batch * rows[0].n_rows ** 2 <= _CHUNK:
        return _to_leaf(_lookup_sum_sq(rows[0]), rows[0])
    if batch * size <= _CHUNK and all(not isinstance(r.a, OneHot) for r in rows):
        return jnp.sum(jnp.square(materialize(rows)), axis=0)
    return jnp.sum(_examples(rows, jnp.square), axis=0)


def _lookup_sum_sq(r: Rows) -> jax.Array:
    """``sum_i g_i**2`` of one lookup, ``(size, n)``: ``g_i``'s entry at a row of the table is the
    sum of the example's rows reading it, so its square is ``sum_r w_r b_r * c_r`` over those
    rows, ``c_r`` the sum of the rows sharing ``r``'s index (``B x R^2`` floats, never the table
    per example)."""
    a = r.a
    wb = r.b if a.weight is None else r.b * a.weight[..., None].astype(r.b.dtype)
    same = (a.index[:, :, None] == a.index[:, None, :]).astype(r.b.dtype)
    c = jnp.einsum("brs,bsn->brn", same, wb)
    return jax.ops.segment_sum((wb * c).reshape(-1, r.n), a.index.reshape(-1), num_segments=a.size)


def check(rows: Sequence[Rows], batch_grad: jax.Array, tol: float) -> jax.Array:
    """``||weighted_sum(rows) - batch_grad|| <= tol * bound`` through a fixed random projection
    of the ``right`` axes (Freivalds: two matrix-vector products, no ``g_i``); ``bound`` bounds
    the rounding error, ``sum_{i, r} |a_ir| |b_ir| |v|``. A bool scalar."""
    rows = _expand(rows)
    oriented = _oriented(rows)
    if oriented is None:  # the uses split the leaf differently: compare the sum itself
        est = weighted_sum(rows)
        bound = sum(jnp.sum(jnp.sqrt(_row_sq(r.a) * jnp.sum(jnp.square(r.b), -1))) for r in rows)
        return jnp.sqrt(jnp.sum(jnp.square(est - batch_grad))) <= tol * bound + 1e-30
    first = oriented[0]
    order = (*first.left, *first.right)
    g = jnp.transpose(batch_grad, order).reshape(first.m, first.n)
    v = jnp.asarray(np.random.default_rng(first.n).standard_normal(first.n), g.dtype)
    u = g @ v
    est, bound = 0.0, 0.0
    for r in oriented:
        bv = r.b @ v.astype(r.b.dtype)
        if isinstance(r.a, OneHot):
            est = est + _scatter(r.a, bv[..., None])[:, 0]
        else:
            # a vector-matrix product streaming a in its own layout (an einsum over (b, r) made
            # XLA copy a into a transposed layout)
            est = est + bv.reshape(-1) @ r.a.reshape(-1, r.m)
        bound = bound + jnp.sum(jnp.sqrt(_row_sq(r.a) * jnp.sum(jnp.square(r.b), -1)))
    bound = bound * jnp.sqrt(jnp.sum(jnp.square(v)))
    err = jnp.sqrt(jnp.sum(jnp.square(u - est)))
    return err <= tol * bound + 1e-30
