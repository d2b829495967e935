"""The curvature records: what ``vk.curvature.stats`` returns per layer call.

Contract. For one layer call ``y = x @ W + b`` (dense; a convolution reads ``x`` as its unfolded
patches and ``W`` as ``(kh*kw*...*c_in, c_out)``), inside a loss registered with a
``vk.curvature`` loss (a mean over the ``N`` examples of axis 0 of the registered output):

* ``Factors(A, G)``: ``A = (1/N) sum_rows a a^T`` over every row of the layer's input (rows are
  the examples and, for sequences and convolutions, their positions), with a trailing
  homogeneous coordinate ``a = [x, 1]`` when the layer has a bias (as kfac-jax does);
  ``G = sum_seeds sum_rows g g^T`` over the output cotangents ``g`` of the backward passes
  seeded with the columns of a square root of the loss Hessian (``kflr``, the exact GGN), with
  sampled labels (``kfac``, the Monte-Carlo Fisher) or with the data's labels (``kfac_empirical``),
  each seed carrying the ``1/sqrt(N)`` of the mean. ``kron(A, G)`` is then the K-FAC
  approximation of the loss's GGN (Fisher) block of ``[vec(W); b]`` with ``W`` as ``(in, out)``.
  A factor side longer than ``max_factor_dim`` is its diagonal only (a vector: ``A``'s or
  ``G``'s diagonal), so ``kron`` is then with ``diag`` of it.
* ``Ekfac(A, G, a, g)``: ``kfac``'s factors and the rows of each example's Monte-Carlo gradient
  (``ekfac``; its scaling in an eigenbasis is ``vk.curvature.ekfac_scaling``).
* ``Diagonal(diagonal)``: the same estimator's field for a layer with no Kronecker rule (an
  embedding, a norm's scale and shift, a residual bias, a transposed or custom layer): the
  diagonal of the same curvature (``kflr``: the exact GGN's, ``= diag_ggn``; ``kfac`` and
  ``ekfac``: the Monte-Carlo Fisher's, ``= diag_ggn_mc``; ``kfac_empirical``: the empirical Fisher's,
  ``N * sum_grad_squared``), keyed like the layer's ``params``.
* ``GradRows(a, d)``: a dense call's gradient as rows (``grad_rows``), ``a^T d``, for K-FAC's
  records-form preconditioning; ``None`` for a convolution or a layer with no Kronecker rule.
* the first-order statistics and the diagonal GGN are pytrees keyed like the layer's ``params``
  (BackPACK's conventions for a mean loss: the per-example gradient is that of ``l_n / N``).

``Layout`` is static: how the layer's weight leaf maps to the ``(in, out)`` matrix above, and
where its weight and bias sit in the differentiated arguments (``None`` when they are not
arguments themselves, e.g. slices of a stacked weight under ``lax.scan``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Factors(NamedTuple):
    """A K-FAC pair: ``A`` over the layer's input (``[x, 1]`` with a bias), ``G`` over its output.

    Each is ``(..., d, d)``, or ``(..., d)`` (its diagonal) when ``d`` exceeds ``max_factor_dim``.
    """

    A: jax.Array
    G: jax.Array


class Ekfac(NamedTuple):
    """EKFAC's statistics of a Kronecker layer (George et al. 2018): the Monte-Carlo Fisher's
    factors ``A``, ``G`` (as ``kfac``'s) and each example's gradient in matrix form, so that its
    second moment can be taken in any basis (``vk.curvature.ekfac_scaling``).

    ``a`` ``(N, T, d_a)``: the rows of each example (``[x, 1]`` with a bias: the ``1`` is the
    bias's own input, also for a convolution); ``g`` ``(K, N, T, d_g)``: the output cotangents of
    the ``K`` Monte-Carlo passes (each carrying ``1 / sqrt(N K)``). Example ``n``'s gradient of
    ``M = [W; b]`` in pass ``k`` is ``sum_t a[n, t] g[k, n, t]^T``.
    """

    A: jax.Array
    G: jax.Array
    a: jax.Array
    g: jax.Array


class GradRows(NamedTuple):
    """The rows of a dense call's gradient of ``M = [W; b]``: ``a`` ``(R, d_a)`` (``[x, 1]`` with a
    bias) and ``d`` ``(R, d_g)`` (the gradient's own output cotangents, each carrying the ``1/N``
    of the mean), one row per position of every example, so that the call's gradient is
    ``a^T d``. K-FAC's records form preconditions it as ``(a A^-1)^T (d G^-1)``."""

    a: jax.Array
    d: jax.Array


class Diagonal(NamedTuple):
    """A diagonal curvature block: ``diagonal`` keyed like the layer's ``params``, each entry
    the curvature's diagonal for that parameter (its shape)."""

    diagonal: Any


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a layer's parameters map to the K-FAC matrix ``[W; b]`` of shape ``(in [+1], out)``.

    Attributes:
        kind: ``"dense"`` or ``"conv"``; ``"local"`` for a layer with diagonal blocks only (its
            leaves in ``leaves``); ``"leaf"`` for a differentiated leaf no layer reads (one
            ``("", key path)`` in ``leaves``; its ``kfac`` is a ``Diagonal`` of that leaf alone).
        weight: the weight's path inside the layer's ``params`` (``"weight"``, ``"kernel"``, ...).
        bias: the bias's path inside ``params``, or ``None``.
        transpose: the weight leaf is stored ``(out, in)`` (Equinox); else ``(in..., out...)``.
        in_ndim: how many leading axes of the (untransposed) weight leaf are input axes.
        strides, padding, dilation: a convolution's own (from its kind), else unused.
        argnum: the differentiated positional argument the weight and bias leaves belong to.
        weight_leaf, bias_leaf: the leaves' key paths inside that argument (as
            ``jax.tree_util.tree_flatten_with_path`` of it gives them), or ``None`` when the
            layer's parameter is not a leaf of an argument (a computed value, a weight carried
            through a scan).
        scans: under ``lax.scan``, one letter per enclosing scan (outermost first): ``"s"`` the
            leaves are given to it as ``xs`` (stacked: a leading axis of the leaf per ``"s"``,
            one slice and one factor per iteration), ``"c"`` closed over (the same weight every
            iteration: its factors sum over that scan's iterations, as a shared weight's do).
        leaves: a ``"local"`` layer's ``(param path, leaf key path or None)`` pairs, its
            parameters' leaves in the differentiated argument ``argnum``.
    """

    kind: str
    weight: str
    bias: str | None
    transpose: bool = False
    in_ndim: int = 1
    strides: tuple = ()
    padding: Any = "VALID"
    dilation: tuple = ()
    argnum: int = 0
    weight_leaf: tuple | None = None
    bias_leaf: tuple | None = None
    scans: str = ""
    leaves: tuple = ()

    @property
    def n_stacked(self) -> int:
        """How many leading axes of the weight (and bias) leaf are the scans' iterations."""
        return self.scans.count("s")

    def matrix_shape(self, w_shape: tuple[int, ...]) -> tuple[int, int]:
        """``(in, out)`` of the weight leaf of shape ``w_shape`` as the K-FAC matrix."""
        lead = w_shape[len(w_shape) - self.in_ndim :] if self.transpose else w_shape[: self.in_ndim]
        n_in = math.prod(lead)
        return n_in, math.prod(w_shape) // n_in

    def to_matrix(self, w: jax.Array) -> jax.Array:
        """The weight leaf as the ``(in, out)`` matrix."""
        n_in, n_out = self.matrix_shape(tuple(w.shape))
        return w.reshape(n_out, n_in).T if self.transpose else w.reshape(n_in, n_out)

    def from_matrix(self, m: jax.Array, w_shape: tuple[int, ...]) -> jax.Array:
        """An ``(in, out)`` matrix laid out as the weight leaf of shape ``w_shape``."""
        return m.T.reshape(w_shape) if self.transpose else m.reshape(w_shape)


def stats_dtype(dtype: Any) -> np.dtype:
    """The dtype statistics and factors are computed in: the float dtype itself when it has at
    least 32 bits, else float32 (half-precision layers). No promotion lattice: strict dtype
    promotion has no path from float64 to float32."""
    dtype = np.dtype(dtype)
    return dtype if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize >= 4 else np.dtype(np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCurvature:
    """The statistics asked for of one layer call; the others are ``None``.

    Under ``lax.scan`` every array has a leading axis per enclosing scan (one entry per
    iteration), as records do.
    """

    kflr: Factors | None = None
    kfac: Factors | None = None
    kfac_empirical: Factors | None = None
    ekfac: Any = None
    diag_ggn: Any = None
    diag_ggn_mc: Any = None
    sum_grad_squared: Any = None
    batch_l2: Any = None
    backpack_variance: Any = None
    grad_rows: GradRows | None = None
    layout: Layout | None = dataclasses.field(default=None, metadata=dict(static=True))
