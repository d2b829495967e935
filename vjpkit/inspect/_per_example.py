"""Per-example gradient norms, and DP-SGD clipping, from layer records.

Contract. ``loss_fn(params, *batch)`` returns a scalar ``L`` that is a reduction over the
batch axis 0 of independent per-example terms: ``L = mean_i l_i`` (``reduction="mean"``, the
default) or ``L = sum_i l_i`` (``reduction="sum"``), where ``l_i`` is ``loss_fn`` on example
``i`` alone (a batch of one). Every positional argument after ``params`` is a pytree of arrays
with the batch on axis 0; anything else is closed over. Each vjpkit layer call must treat the
rows of its input independently (no batch norm, no attention across the batch).
The per-example gradient is ``g_i = grad l_i`` whatever the reduction: for a mean, the
records' ``grad_output`` holds ``(1/B) dl_i/dy_i``, and it is rescaled by ``B``.
``per_example_grad_norms`` returns ``||g_i||`` for each example, in total, per layer and
per parameter leaf, and ``dp_clip`` clips each ``g_i`` to norm ``C`` and adds noise.

How each parameter leaf's per-example gradient is handled:

* which layer calls use which leaf is found by *identity*, in a shape-only forward trace: a
  ``vk.HookTransform`` whose ``init`` sees each call's params. So weight sharing (a layer called
  twice, or one array used by two layers) is exact: the calls' contributions add per example.
* dense (``weight (in, out)``, optional ``bias (out,)``, output ``input @ weight + bias`` on the
  last axis): from the captured ``input`` ``x_i`` and ``grad_output`` ``d_i`` of every call,
  ``||g_i||^2 = ||x_i||^2 ||d_i||^2`` for 2-D inputs; for sequences ``(B, T, in)`` (and for
  several calls, stacked on ``T``) ``<X_i X_i^T, D_i D_i^T>`` when ``T^2 <= in*out``, else the
  per-example weight gradient of *that layer only* ``X_i^T D_i`` (the cheaper of the two: the
  "mixed ghost norm"). The bias gradient is ``sum_t d_it``.
* conv2d (NHWC ``weight (kh, kw, in, out)``) and conv1d (NWC ``weight (k, in, out)``): stride
  and padding are not in the record, so they are inferred from the shapes (SAME preferred, then
  VALID, smallest stride), or given with ``conv={glob: (stride, padding)}``. The per-example
  kernel gradients of that layer are then computed exactly as a vmapped vjp of
  ``lax.conv_general_dilated`` per example (XLA turns it into one grouped convolution):
  ``B * prod(kernel shape)`` floats for that layer, no more.
* attention (``nn.multi_head_attention``) is its dense projections ``q``, ``k``, ``v``, ``out``:
  sequence dense layers above; its ``dot_product`` part has no parameters.
* affine norms (layers that note themselves as ``nn.AffineNorm`` while traced:
  ``nn.rms_norm``, and ``nn.batch_norm`` in eval mode): ``y = x_hat * scale + bias`` on the last
  axis, with ``x_hat`` recomputed from the captured ``input``; per example, the ``scale``
  gradient is ``sum_t d_it * x_hat_it`` and the ``bias`` gradient ``sum_t d_it`` over every axis
  but the batch and the last, and any other parameter (running statistics) gets zero.
* any other leaf (embedding, layer_norm, custom layers, params used outside vjpkit layers)
  falls back to ``jax.vmap(jax.grad)`` of ``l_i`` with respect to those leaves only, with a
  ``UserWarning`` naming the layer.
* a runtime consistency check (``check=True``): per fast-path leaf, the sum of the per-example
  gradients must equal the batch gradient (tested through a fixed random projection for dense
  weights, so it costs a matrix-vector product), to a relative tolerance of 1e-3 of a bound on
  the rounding error (float32). A layer is recognised as dense or conv by its params and record
  shapes, so the check is what catches one whose gradient is not ``x^T d`` anyway (a custom
  layer, a wrongly inferred stride, a weight also used transposed, a weight penalty inside the
  loss, which is not a per-example term: put weight decay in the optimizer). A leaf that fails
  gets NaN norms (and NaN DP gradients): loud, never a silently wrong value.

The fast path costs one ordinary backward pass plus ``O(B * (in + out))`` per dense call; no
per-example weight gradient of a dense layer with 2-D input is ever formed.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _engine, _format
from .._autodiff import value_and_grad as _vk_value_and_grad
from .._capture import capture as _capture
from .._errors import ConfigError
from .._kinds import AffineNorm, LayerKind

__all__ = ["PerExampleNorms", "dp_clip", "dp_noise", "per_example_grad_norms"]

_DN = {4: ("NHWC", "HWIO", "NHWC"), 3: ("NWC", "WIO", "NWC")}


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
# Trace-time analysis: which layer calls use which parameter leaves.


@dataclasses.dataclass
class _Call:
    key: str
    name: str
    params: dict[str, tuple[int | None, tuple[int, ...]]]  # local name -> (leaf index | None, shape)
    derived: list[str]  # local names of params computed inside the loss (not leaves of params)
    kind: Any = None  # what the layer noted about itself (nn._kinds), e.g. an AffineNorm
    tree: Any = None  # the structure of the call's params, and the leaf index of each of its leaves
    order: list[int | None] = dataclasses.field(default_factory=list)
    foreign: LayerKind | None = None  # a foreign layer's kind (Flax, NNX, Equinox)
    container: bool = False  # a foreign call that contains other layer calls (a parent module)


def _map_calls(loss_fn: Callable, params: Any, batch: tuple, who: str) -> list[_Call]:
    """The layer calls of ``loss_fn`` in forward order, with the params leaves each one uses."""
    config = _engine.configure(None, None, who)
    traced = _engine.trace(config, loss_fn, (params, *batch), argnums=(0,), check=False)
    out = traced.closed.out_avals[0]
    if not (hasattr(out, "shape") and tuple(out.shape) == ()):
        raise ConfigError(
            f"{who}: loss_fn must return a scalar: the mean (reduction='mean') or the sum "
            f"(reduction='sum') over the batch of per-example losses; it returned "
            f"{getattr(out, 'shape', type(out).__name__)}."
        )
    calls = []
    plan = traced.plan
    for key in plan.order:
        site = plan.by_key[key]
        n = site.layout.n_hoisted
        paths = jax.tree_util.tree_flatten_with_path(site.record.params)[0]
        entries, derived, order = {}, [], []
        for (path, aval), origin, flag in zip(paths, site.origins[n:], site.flags[n:]):
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
        if call.foreign is not None and call.foreign.kind in ("dense", "conv"):
            call.params = {call.foreign.roles.get(k, k): v for k, v in call.params.items()}
        calls.append(call)
    return calls


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
    return sizes.pop()


def _escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _tuple(v: Any, n: int) -> tuple[int, ...]:
    return (int(v),) * n if isinstance(v, (int, np.integer)) else tuple(int(a) for a in v)


def _infer_1d(n: int, k: int, n_out: int) -> tuple[int, tuple[int, int]] | None:
    """(stride, (lo, hi)) of a conv dimension from its sizes: SAME first, then VALID."""
    if n_out == 1:  # one output position: the stride plays no role
        total = max(k - n, 0)
        return 1, (total // 2, total - total // 2)
    for s in range(1, n + 1):
        if -(-n // s) == n_out:
            total = max((n_out - 1) * s + k - n, 0)
            return s, (total // 2, total - total // 2)
    for s in range(1, n + 1):
        if n >= k and (n - k) // s + 1 == n_out:
            return s, (0, 0)
    return None


def _conv_padding(padding: Any, shape_in, kernel, strides) -> tuple[tuple[int, int], ...]:
    if isinstance(padding, str):
        return tuple(jax.lax.padtype_to_pads(shape_in, kernel, strides, padding))
    return tuple((int(lo), int(hi)) for lo, hi in padding)


@dataclasses.dataclass
class _Use:
    key: str
    role: str
    kind: str  # "dense" | "conv" | "norm"
    conv: Any = None  # (strides, padding) for conv; the AffineNorm for norm


def _classify(call: _Call, rec: Any, batch_size: int, conv_cfg: dict, who: str) -> tuple[str | None, Any]:
    """``("dense" | "conv" | "norm" | None, config)`` from the call's params and record shapes."""
    roles = set(call.params)
    if isinstance(call.kind, AffineNorm):
        x, d = (None, None) if rec is None else (rec.input, rec.grad_output)
        ok = (
            hasattr(x, "shape")
            and hasattr(d, "shape")
            and x.ndim >= 2
            and d.shape == x.shape
            and x.shape[0] == batch_size
            and jnp.issubdtype(x.dtype, jnp.floating)
            and all(call.params[r][1] == (x.shape[-1],) for r in ("scale", "bias") if r in roles)
            and not call.derived
        )
        return ("norm", call.kind) if ok else (None, None)
    if call.foreign is not None and call.foreign.kind == "local" and rec is not None:
        return _classify_local(call, rec, batch_size)
    if "weight" not in roles or not roles <= {"weight", "bias"} or rec is None:
        return None, None
    if call.foreign is not None and call.foreign.kind == "dense":
        return _classify_foreign_dense(call, rec, batch_size)
    if call.foreign is not None and call.foreign.kind == "conv":
        strides, padding = call.foreign.strides, call.foreign.padding
        conv_cfg = {_escape(call.name): (strides, padding), **conv_cfg}
    x, d = rec.input, rec.grad_output
    if not (hasattr(x, "shape") and hasattr(d, "shape")) or x.ndim < 2 or d.ndim != x.ndim:
        return None, None
    if x.shape[0] != batch_size or d.shape[0] != batch_size:
        return None, None
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return None, None
    w = call.params["weight"][1]
    b = call.params.get("bias", (None, None))[1]
    if len(w) == 2:
        ok = x.shape[-1] == w[0] and d.shape == (*x.shape[:-1], w[1]) and b in (None, (w[1],))
        return ("dense", None) if ok else (None, None)
    if len(w) in (3, 4) and x.ndim == len(w):
        *kernel, cin, cout = w
        n = len(kernel)
        if x.shape[-1] != cin or d.shape[-1] != cout or b not in (None, (cout,)):
            return None, None
        for glob, cfg in conv_cfg.items():
            if fnmatch.fnmatchcase(call.name, glob):
                stride, padding = cfg
                strides = _tuple(stride, n)
                pads = _conv_padding(padding, x.shape[1 : 1 + n], tuple(kernel), strides)
                return "conv", (strides, pads)
        dims = [_infer_1d(x.shape[1 + a], kernel[a], d.shape[1 + a]) for a in range(n)]
        if None in dims:
            return None, "no-infer"
        return "conv", (tuple(s for s, _ in dims), tuple(p for _, p in dims))
    return None, None


def _classify_local(call: _Call, rec: Any, batch_size: int) -> tuple[str | None, Any]:
    leaves = jax.tree.leaves((rec.input, rec.grad_output))
    if None in call.order or not leaves or any(np.shape(a)[:1] != (batch_size,) for a in leaves):
        return None, None
    return "local", None


def _classify_foreign_dense(call: _Call, rec: Any, batch_size: int) -> tuple[str | None, Any]:
    """A Flax ``Dense``/``DenseGeneral``, NNX ``Linear`` or Equinox ``Linear`` call."""
    x, d, kind = rec.input, rec.grad_output, call.foreign
    if not (hasattr(x, "shape") and hasattr(d, "shape")) or x.ndim < kind.in_ndim + 1:
        return None, None
    if x.shape[0] != batch_size or d.shape[0] != batch_size or not jnp.issubdtype(x.dtype, jnp.floating):
        return None, None
    w = call.params["weight"][1]
    lead = x.ndim - kind.in_ndim
    n_in, n_out = int(np.prod(x.shape[lead:])), int(np.prod(d.shape[lead:]))
    if d.shape[:lead] != x.shape[:lead] or int(np.prod(w)) != n_in * n_out:
        return None, None
    split = len(w) - (d.ndim - lead) if not kind.transpose else d.ndim - lead
    w_in = w[split:] if kind.transpose else w[:split]
    if int(np.prod(w_in)) != n_in:
        return None, None
    return "dense", None


# --------------------------------------------------------------------------------------------
# Per-leaf per-example gradients, implicit (dense weights) or materialised (the rest).


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


class _DenseWeight(_Leaf):
    """``g_i = X_i^T D_i`` with ``X_i (T, in)``, ``D_i (T, out)``: never formed when ``T == 1``."""

    def __init__(self, x: jax.Array, d: jax.Array, batch_grad: jax.Array | None, check: bool):
        self.x, self.d = x, d
        self.x_sq, self.d_sq = jnp.sum(jnp.square(x), axis=2), jnp.sum(jnp.square(d), axis=2)  # (B, T)
        self._g = None
        t, n_in, n_out = x.shape[1], x.shape[2], d.shape[2]
        self.ghost = t == 1 or t * t <= n_in * n_out
        if check and batch_grad is not None:
            # Freivalds: (sum_i g_i) r == G r for a fixed random r, at the cost of two mat-vecs. The
            # rounding error is bounded by a multiple of sum_bt |x_bt|.|d_bt| |r|.
            rng = np.random.default_rng(n_out)
            r = jnp.asarray(rng.standard_normal(n_out), jnp.float32)
            u = batch_grad.astype(jnp.float32) @ r
            v = jnp.einsum("btd,bt->d", x, d @ r)
            bound = jnp.sum(jnp.sqrt(self.x_sq * self.d_sq)) * jnp.sqrt(jnp.sum(jnp.square(r)))
            self.ok = _check(u, v, bound, _tol(batch_grad.dtype))

    def g(self):
        if self._g is None:
            self._g = jnp.einsum("btd,bte->bde", self.x, self.d)
        return self._g

    def sq_norms(self):
        if self.x.shape[1] == 1:
            out = self.x_sq[:, 0] * self.d_sq[:, 0]
        elif self.ghost:
            gram_x = jnp.einsum("btd,bsd->bts", self.x, self.x)
            gram_d = jnp.einsum("bte,bse->bts", self.d, self.d)
            out = jnp.sum(gram_x * gram_d, axis=(1, 2))
        else:
            out = jnp.sum(jnp.square(self.g()), axis=(1, 2))
        return self.guard(out)

    def weighted_sum(self, c):
        return self.guard(jnp.einsum("btd,bte->de", self.x, self.d * c[:, None, None]))

    def sum_sq(self):
        if self.x.shape[1] == 1:
            return self.guard(jnp.square(self.x[:, 0]).T @ jnp.square(self.d[:, 0]))
        return self.guard(jnp.sum(jnp.square(self.g()), axis=0))


class _Reshaped(_Leaf):
    """A dense weight's ``g_i`` computed as ``(in, out)``, reported in the leaf's own layout."""

    def __init__(self, inner: _Leaf, shape: tuple[int, ...], transpose: bool):
        self.inner, self.shape, self.transpose = inner, shape, transpose

    def _layout(self, g: jax.Array) -> jax.Array:
        return (g.T if self.transpose else g).reshape(self.shape)

    def sq_norms(self):
        return self.inner.sq_norms()

    def weighted_sum(self, c):
        return self._layout(self.inner.weighted_sum(c))

    def sum_sq(self):
        return self._layout(self.inner.sum_sq())


def _local_per_example(call: _Call, param_leaves: list, x: Any, d: Any) -> dict[str, jax.Array]:
    """Per-example gradients of one call's params: a vmap of *that layer's* vjp over examples."""
    kind = call.foreign
    p = jax.tree_util.tree_unflatten(call.tree, [param_leaves[i] for i in call.order])

    def one(xi, di):
        if kind.batched:
            xi, di = jax.tree.map(lambda a: a[None], (xi, di))
        _, pullback = jax.vjp(lambda q: kind.fn(q, xi), p)
        return pullback(di.astype(jnp.result_type(di)))[0]

    g = jax.vmap(one)(x, d)
    return {_format.path(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(g)[0]}


def _conv_per_example(x: jax.Array, d: jax.Array, kernel_shape, strides, pads) -> jax.Array:
    """Per-example kernel gradients ``(B, *kernel_shape)`` of one conv call (1-D or 2-D), exactly."""
    zero = jnp.zeros(kernel_shape, x.dtype)
    dn = _DN[x.ndim]

    def one(xi, di):
        conv = lambda w: jax.lax.conv_general_dilated(xi[None], w, strides, pads, dimension_numbers=dn)
        return jax.vjp(conv, zero)[1](di[None])[0]

    return jax.vmap(one)(x, d)


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
) -> Analysis:
    """Runs the loss once (forward, one backward) and sets up each leaf's per-example gradients.

    ``select(layer name)`` limits the per-example work to the leaves of some layers (the others,
    and leaves used by no layer, get ``None``); all leaves are analysed when it is ``None``.
    """
    batch_size = _batch_size(batch, who)
    flat_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = [_format.path(p) for p, _ in flat_paths]
    calls = [c for c in _map_calls(loss_fn, params, batch, who) if not c.container]
    conv = dict(conv or {})

    owners, wanted = [], []
    for i, path in enumerate(paths):
        owner = next((c.name for c in calls if any(ix == i for ix, _ in c.params.values())), None)
        wanted.append(select is None or (owner is not None and select(owner)))
        owners.append(owner if owner is not None else (path.rsplit("/", 1)[0] if "/" in path else path))

    def _could_be_fast(c: _Call) -> bool:
        shapes = {k: s for k, (_, s) in c.params.items()}
        if c.foreign is not None and c.foreign.kind in ("local", "dense"):
            return any(ix is not None and wanted[ix] for ix, _ in c.params.values())
        shaped = (
            "weight" in shapes and set(shapes) <= {"weight", "bias"} and len(shapes["weight"]) in (2, 3, 4)
        )
        return (shaped or isinstance(c.kind, AffineNorm)) and any(
            ix is not None and wanted[ix] for ix, _ in c.params.values()
        )

    names = sorted({c.name for c in calls if _could_be_fast(c)})
    if names:
        spec = _capture([_escape(n) for n in names], fields=list(capture_fields))
        (loss, grads), captured = _vk_value_and_grad(loss_fn, capture=spec)(params, *batch)
    else:
        (loss, grads), captured = jax.value_and_grad(loss_fn)(params, *batch), {}
    grad_leaves = jax.tree.leaves(grads)
    param_leaves = jax.tree.leaves(params)
    scale = float(batch_size) if reduction == "mean" else 1.0

    calls_by_key = {c.key: c for c in calls}
    # Which calls use each leaf, and how.
    uses: list[list[_Use | None]] = [[] for _ in paths]
    no_infer: set[str] = set()
    for c in calls:
        kind, cfg = (
            _classify(c, captured.get(c.key), batch_size, conv, who) if c.name in names else (None, None)
        )
        if cfg == "no-infer":
            no_infer.add(c.name)
        for role, (ix, _) in c.params.items():
            if ix is not None:
                uses[ix].append(_Use(c.key, role, kind, cfg) if kind else None)

    def scaled(a):
        return a.astype(jnp.float32) * jnp.float32(scale)

    leaves: list[_Leaf | None] = []
    fallback: list[int] = []
    for i in range(len(paths)):
        if not wanted[i]:
            leaves.append(None)
            continue
        u = uses[i]
        kinds = {(x.kind, x.role) for x in u if x is not None}
        if not u or None in u or len(kinds) != 1:
            leaves.append(None)
            fallback.append(i)
            continue
        kind, role = kinds.pop()
        agg = grad_leaves[i] if check else None
        recs = [captured[x.key] for x in u]
        if kind == "local":
            g = 0.0
            for r, x_use in zip(recs, u):
                call = next(c for c in calls if c.key == x_use.key)
                pex = _local_per_example(call, param_leaves, r.input, r.grad_output)
                g = g + pex[x_use.role].astype(jnp.float32) * jnp.float32(scale)
            ok = None
            if agg is not None:
                bound = jnp.sum(jnp.abs(g), axis=0)
                ok = _check(scaled(agg), jnp.sum(g, axis=0), bound, _tol(agg.dtype))
            leaves.append(_Materialized(g, ok))
            continue
        if kind == "dense" and role == "weight":
            foreign = [next(c.foreign for c in calls if c.key == x_use.key) for x_use in u]
            fk = foreign[0]
            n_in_axes = fk.in_ndim if fk is not None else 1
            xs = [r.input.astype(jnp.float32) for r in recs]
            ds = [scaled(r.grad_output) for r in recs]
            lead = xs[0].ndim - n_in_axes
            x = jnp.concatenate([a.reshape(*a.shape[:1], -1, int(np.prod(a.shape[lead:]))) for a in xs], 1)
            d = jnp.concatenate([a.reshape(*a.shape[:1], -1, int(np.prod(a.shape[lead:]))) for a in ds], 1)
            agg_2d = None
            if agg is not None:
                agg_2d = scaled(agg)
                agg_2d = agg_2d.reshape(d.shape[-1], x.shape[-1]).T if fk and fk.transpose else agg_2d
                agg_2d = agg_2d.reshape(x.shape[-1], d.shape[-1])
            leaf = _DenseWeight(x, d, agg_2d, check)
            if fk is not None and (fk.transpose or n_in_axes > 1 or lead + 1 < ds[0].ndim):
                leaf = _Reshaped(leaf, tuple(grad_leaves[i].shape), fk.transpose)
            leaves.append(leaf)
            continue
        if kind == "norm":
            shape = grad_leaves[i].shape
            leaves.append(
                _norm_leaf(role, recs, u, calls_by_key, param_leaves, shape, batch_size, scaled, agg)
            )
            continue
        if role == "bias":
            ds = [scaled(r.grad_output) for r in recs]
            b_shape = tuple(grad_leaves[i].shape)
            nb = int(np.prod(b_shape))
            g = sum(jnp.sum(a.reshape(batch_size, -1, nb), axis=1) for a in ds).reshape(batch_size, *b_shape)
            ok = None
            if agg is not None:
                bound = sum(jnp.sum(jnp.abs(a.reshape(-1, *b_shape)), axis=0) for a in ds)
                ok = _check(scaled(agg), jnp.sum(g, axis=0), bound, _tol(agg.dtype))
            leaves.append(_Materialized(g, ok))
            continue
        # conv kernel
        shape = grad_leaves[i].shape
        g = 0.0
        bound = 0.0
        for r, x_use in zip(recs, u):
            strides, pads = x_use.conv
            xi, di = r.input.astype(jnp.float32), scaled(r.grad_output)
            g = g + _conv_per_example(xi, di, shape, strides, pads)
            axes = tuple(range(1, xi.ndim))
            per = jnp.sqrt(jnp.sum(jnp.square(xi), axis=axes) * jnp.sum(jnp.square(di), axis=axes))
            bound = bound + jnp.sqrt(float(np.prod(shape[:-2]))) * jnp.sum(per)
        ok = None if agg is None else _check(scaled(agg), jnp.sum(g, axis=0), bound, _tol(agg.dtype))
        leaves.append(_Materialized(g, ok))

    if fallback:
        _warn_fallback(fallback, paths, owners, calls, uses, no_infer, who)
        per_example = _vmap_grads(loss_fn, params, batch, fallback)
        for i, g in zip(fallback, per_example):
            leaves[i] = _Materialized(g.astype(jnp.float32))
    derived = sorted({c.name for c in calls if c.derived})
    if derived:
        warnings.warn(
            f"{who}: layer(s) {derived} use parameters computed inside the loss (not leaves of params, "
            "e.g. a tied weight passed transposed). Their contribution reaches the source leaf only "
            "through the batch gradient: a leaf with such a use and a dense/conv fast path fails the "
            "consistency check and gets NaN norms. Do the computation inside an nn.layer instead.",
            stacklevel=3,
        )
    return Analysis(loss, grads, batch_size, paths, owners, leaves, treedef, captured, calls)


def _norm_leaf(role, recs, uses, calls_by_key, param_leaves, shape, batch_size, scaled, agg) -> _Leaf:
    """Per-example gradients of one affine-norm parameter: ``scale``, ``bias`` or a statistic."""
    g, bound = 0.0, 0.0
    for r, use in zip(recs, uses):
        d = scaled(r.grad_output)
        axes = tuple(range(1, d.ndim - 1))
        if role == "scale":
            local = {k: param_leaves[ix] for k, (ix, _) in calls_by_key[use.key].params.items()}
            x_hat = use.conv.normalize(local, r.input).astype(jnp.float32)
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


def _warn_fallback(fallback, paths, owners, calls, uses, no_infer, who) -> None:
    by_owner: dict[str, list[str]] = {}
    for i in fallback:
        by_owner.setdefault(owners[i], []).append(paths[i])
    layer_names = {c.name for c in calls}
    parts = []
    for owner, leaf_paths in by_owner.items():
        if owner in no_infer:
            why = (
                "conv stride/padding cannot be inferred from the shapes (pass conv={name: (stride, padding)})"
            )
        elif owner in layer_names:
            why = "no fast path for this layer type"
        else:
            why = "used outside any vjpkit layer"
        parts.append(f"{owner!r} ({why}; params {leaf_paths})")
    warnings.warn(
        f"{who}: per-example gradients of {'; '.join(parts)} fall back to jax.vmap(jax.grad) of the "
        "per-example loss with respect to those parameters only (exact, but it forms their "
        "per-example gradients and runs a vmapped backward pass).",
        UserWarning,
        stacklevel=4,
    )


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
            gradient; a leaf that fails gets NaN norms.
        conv: ``{glob: (stride, padding)}`` for conv layers whose stride and padding should not
            be inferred from the shapes.

    Returns:
        ``f(params, *batch) -> (loss, grads, norms)``: ``loss`` and ``grads`` as
        ``jax.value_and_grad(loss_fn)`` returns them, and a ``PerExampleNorms``. It can be
        jitted.

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
        a = analyze(loss_fn, params, batch, reduction=reduction, who=who, check=check, conv=conv)
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
