"""Capture specs: which layers and fields to return from the graph, and how to reduce them.

Contract: ``capture`` builds a ``CaptureSpec``; ``as_specs`` turns what a user
passes as ``capture=`` (a glob, a list of globs, a spec, or a list of specs) into specs.
``reduce_record`` keeps the chosen fields of a record and reduces each array leaf inside
the graph: with one reduction a leaf becomes a float32 scalar (a ``(bins,)`` vector for a
histogram); with several, a dict ``{reduction name: value}``. Unchosen fields become ``None``.
A spec whose ``reduce`` is a ``RecordFn`` (vjpkit's own tools, not ``capture``) reduces the
whole record at once to any pytree of arrays.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._errors import ConfigError
from ._names import iterations, matches_any
from ._records import Cotangents

FIELDS = ("params", "input", "output", "grad_output", "grad_input", "grad_params")


def _stored(x):
    """``x`` as stored: a float leaf narrower than float32 passes an optimization barrier, or
    XLA could feed a reduction the float32 values the leaf was rounded from (excess
    precision), and the statistic would not be the leaf's."""
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32:
        return lax.optimization_barrier(x)
    return x


def _flat32(x):
    """``x`` as a flat float32 vector.

    Every reduction reads its leaf flattened. A reduction over the leaf's own shape made
    XLA:CPU write some cotangents twice: a max-pool's ``grad_input`` is computed in the pool's
    window shape ``(b, h/2, 2, w/2, 2, c)``, and a sum over its ``(b, h, w, c)`` view got its
    own copy of the pool's backward instead of reading the array the ReLU below reads. Flat,
    the reshape is free whichever shape the producer wrote, and equal arrays seen through
    different shapes (a flatten layer's ``grad_input`` and ``grad_output``) reduce once.
    """
    x = lax.reshape(_stored(x), (x.size,))  # lax, not jnp: a jnp function traces per shape
    return x if x.dtype == jnp.float32 else lax.convert_element_type(x, jnp.float32)


# A flat vector shorter than this is reduced in blocks of at most 32 (``_blocks``).
_BLOCKED_BELOW = 4096


@functools.cache  # n < 5120: a few thousand entries at most
def _block_dims(n: int) -> tuple[int, ...] | None:
    """Three axes of at most 32 whose product is ``n``, or None (a prime factor above 32)."""
    for c in range(32, 0, -1):
        for b in range(32, 0, -1):
            if n % (b * c) == 0 and n // (b * c) <= 32:
                return (n // (b * c), b, c)
    return None


def _blocks(flat):
    """A flat vector as blocks whose sum XLA computes in one kernel (``norm``, ``mean``, ``nonfinite_count``).

    XLA:CPU rewrites the sum of a vector longer than 32 into a tree of ``reduce-window``s
    (three to five kernels instead of one; on jax 0.12 only below 4096 elements, on 0.10 at any
    length). Each kernel costs about 3 ms of compile time, and a capture reduces small leaves by
    the dozen (biases, weights, a head's logits). Reshaped to axes of at most 32 (zero-padded
    when the length has a prime factor above 32) and read through an optimization barrier, so
    that XLA cannot fold them back into the vector, the sum is one kernel of the same values.
    """
    n = flat.shape[0]
    if n <= 32 or n >= _BLOCKED_BELOW:
        return flat
    dims = _block_dims(n)
    if dims is None:
        padded = -(-n // 32) * 32 if n <= 1024 else -(-n // 1024) * 1024
        flat, dims = lax.pad(flat, np.zeros((), flat.dtype), [(0, padded - n, 0)]), _block_dims(padded)
    return lax.optimization_barrier(lax.reshape(flat, dims))


def _sum(x):
    return lax.reduce_sum(x, tuple(range(x.ndim)))


def _norm(x: jax.Array) -> jax.Array:
    # |x| only for complex leaves: for real ones x * x is already |x|^2, bit for bit, and an
    # abs in front of the square kept XLA:CPU from sharing the producer (measured, CNN).
    if jnp.iscomplexobj(x):
        x = jnp.abs(x)
    x = _blocks(_flat32(x))
    return lax.sqrt(_sum(lax.mul(x, x)))


REDUCTIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "norm": _norm,
    "mean": lambda x: lax.div(_sum(_blocks(_flat32(x))), np.float32(x.size)),
    "var": lambda x: jnp.var(_flat32(x)),
    "min": lambda x: jnp.min(_flat32(x)),
    "max": lambda x: jnp.max(_flat32(x)),
    "nonfinite_count": lambda x: jnp.sum(~jnp.isfinite(_blocks(_stored(x).ravel()))).astype(jnp.float32),
}
# every reduction name a captured record may be keyed by (the REDUCTIONS and "histogram")
REDUCTION_NAMES = frozenset([*REDUCTIONS, "histogram"])


class histogram(NamedTuple):  # noqa: N801  (used like a reduction name)
    """A fixed-bin histogram reduction: ``bins`` equal bins over ``range``, as float32 counts.

    Values below or above ``range`` are counted in the first or last bin, so the counts always
    sum to the number of elements; NaNs are not counted.

    Examples:
        >>> spec = vk.capture("fc*", fields=["grad_output"], reduce=vk.histogram(32, (-1e-2, 1e-2)))
    """

    bins: int = 16
    range: tuple[float, float] = (-1.0, 1.0)

    @property
    def name(self) -> str:
        return "histogram"

    def __call__(self, x: jax.Array) -> jax.Array:
        lo, hi = self.range
        x = _flat32(x)
        index = jnp.clip(jnp.floor((x - lo) / (hi - lo) * self.bins), 0, self.bins - 1).astype(jnp.int32)
        weights = jnp.isfinite(x).astype(jnp.float32)
        return jnp.zeros((self.bins,), jnp.float32).at[index].add(weights)


class RecordFn(NamedTuple):
    """A reduction of the whole record, ``fn(record) -> pytree of arrays``, run inside the graph
    where the record is made (one scan iteration's, under ``lax.scan``). For vjpkit's tools:
    per-example statistics that need several fields of a call at once."""

    fn: Callable


class CaptureSpec(NamedTuple):
    """What to capture: see ``capture``."""

    layers: tuple[str, ...]
    fields: tuple[str, ...]
    reduce: tuple[Any, ...] | None
    host: Any = None

    def matches(self, name: str, call: int = 0) -> bool:
        """Whether the globs choose call ``call`` of layer ``name`` (``_names.matches``; a
        trailing ``[i]`` chooses iterations of it, see ``iterations``)."""
        return matches_any(name, call, [iterations(g)[0] for g in self.layers])

    def iterations(self, name: str, call: int = 0) -> list[tuple] | None:
        """The scan iterations the globs keep of call ``call`` of ``name``: ``None`` for all of
        them (a glob without ``[i]``, or ``[*]`` only), else one index tuple per glob
        (``None`` entries for ``[*]``)."""
        chosen = []
        for glob in self.layers:
            base, wanted = iterations(glob)
            if matches_any(name, call, [base]):
                if all(w is None for w in wanted):
                    return None
                chosen.append(wanted)
        return chosen


def _reduction(r: Any) -> Any:
    if isinstance(r, histogram):
        if not isinstance(r.bins, int) or r.bins < 1 or not r.range[0] < r.range[1]:
            raise ConfigError(f"vk.histogram needs bins >= 1 and range lo < hi, got {r!r}.")
        return r
    if isinstance(r, str) and r in REDUCTIONS:
        return r
    raise ConfigError(
        f"vk.capture: unknown reduction {r!r}. Use one of {sorted(REDUCTIONS)} or "
        "vk.histogram(bins, range); reduce=None captures whole arrays."
    )


def capture(
    layers: str | Sequence[str] = "*",
    fields: Sequence[str] = FIELDS,
    reduce: Any = None,
    host: Any = None,
) -> CaptureSpec:
    """Chooses layer calls and record fields to return from the graph as arrays.

    Args:
        layers: a glob or globs over layer paths; ``blocks[2]`` keeps iteration 2 only of a
            layer called inside ``lax.scan``, keyed ``"blocks[2]"`` (``[i][j]`` for nested scans).
        fields: record fields to keep (others are ``None``): any of ``params, input, output,
            grad_output, grad_input, grad_params``.
        reduce: ``None`` for whole arrays, a reduction (``"norm"``, ``"mean"``, ``"var"``,
            ``"min"``, ``"max"``, ``"nonfinite_count"``, ``vk.histogram(bins, range)``), or a
            list of them. Reductions run inside the graph, so only statistics leave it.
        host: ``vk.on_host(fn, every=N)``: ``fn`` receives the whole step's captured dict on
            the host, in one transfer per step (per N steps).

    Examples:
        >>> spec = vk.capture("conv*", fields=["grad_params"], reduce=["norm", "nonfinite_count"])
        >>> (loss, grads), captured = jax.jit(vk.value_and_grad(loss_fn, capture=spec))(params, x, y)
        >>> captured["conv1"].grad_params["weight"]["norm"]
    """
    globs = (layers,) if isinstance(layers, str) else tuple(layers)
    if not globs or not all(isinstance(g, str) and g for g in globs):
        raise ConfigError(f"vk.capture: layers must be a glob or a list of globs, got {layers!r}.")
    fields = (fields,) if isinstance(fields, str) else tuple(fields)
    unknown = [f for f in fields if f not in FIELDS]
    if unknown or not fields:
        raise ConfigError(f"vk.capture: unknown field(s) {unknown or fields!r}; choose from {list(FIELDS)}.")
    if reduce is not None:
        many = isinstance(reduce, (list, tuple)) and not isinstance(reduce, histogram)
        reduce = tuple(_reduction(r) for r in (reduce if many else [reduce]))
    if host is not None and not callable(host):
        raise ConfigError(f"vk.capture: host must be vk.on_host(fn, every=N), got {type(host).__name__}.")
    return CaptureSpec(globs, fields, reduce, host)


def items(value: Any) -> list:
    """The items of a ``capture=`` argument: the elements of a list or tuple, else the value
    itself (a spec is a NamedTuple: a tuple, but one item)."""
    return list(value) if type(value) in (list, tuple) else [value]


def as_specs(value: Any, transform: str) -> tuple[CaptureSpec, ...]:
    """Normalises a ``capture=`` argument to a tuple of specs."""
    if value is None:
        return ()
    if isinstance(value, CaptureSpec):
        return (value,)
    if isinstance(value, str):
        return (capture(value),)
    if isinstance(value, (list, tuple)) and value:
        if all(isinstance(v, str) for v in value):
            return (capture(tuple(value)),)
        if all(isinstance(v, CaptureSpec) for v in value):
            return tuple(value)
    raise ConfigError(
        f"{transform}: capture= takes a glob, a list of globs, vk.capture(...), or a list of "
        f"vk.capture(...) specs; got {value!r}."
    )


_COMPLEX_OK = ("norm", "nonfinite_count")


def _reduce_leaf(x: Any, reductions: tuple[Any, ...], where: str, shapes: bool = False) -> Any:
    """``x`` reduced by each of ``reductions``; with ``shapes``, the results' shapes (every
    reduction gives a float32 scalar, a histogram its ``(bins,)`` counts), nothing traced."""
    if jnp.iscomplexobj(x):
        bad = [r if isinstance(r, str) else r.name for r in reductions if r not in _COMPLEX_OK]
        if bad:
            raise ConfigError(
                f"vk.capture: {where} is complex ({x.dtype}); the reduction(s) {bad} are defined for "
                f"real values only. Use {list(_COMPLEX_OK)} for complex cotangents, or reduce=None "
                "for the whole arrays."
            )

    def one(r):
        if shapes:
            return jax.ShapeDtypeStruct((r.bins,) if isinstance(r, histogram) else (), jnp.float32)
        return r(x) if isinstance(r, histogram) else REDUCTIONS[r](x)

    if len(reductions) == 1:
        return one(reductions[0])
    return {r if isinstance(r, str) else r.name: one(r) for r in reductions}


def reduce_record(rec: Cotangents, spec: CaptureSpec, shapes: bool = False) -> Cotangents:
    """The record with only ``spec.fields`` kept, each array leaf reduced by ``spec.reduce``.

    With ``shapes``, ``rec`` holds ``ShapeDtypeStruct`` s and the result is the reduced record's
    shapes, without tracing (as ``jax.eval_shape`` of the reduction gives them, at a fraction of
    its cost: the plan asks once per captured call)."""
    if isinstance(spec.reduce, RecordFn):
        return jax.eval_shape(spec.reduce.fn, rec) if shapes else spec.reduce.fn(rec)
    changes = {}
    for field in FIELDS:
        value = getattr(rec, field)
        if field not in spec.fields:
            changes[field] = None
        elif spec.reduce is not None:
            changes[field] = jax.tree_util.tree_map_with_path(
                lambda path, x, field=field: _reduce_leaf(
                    x,
                    spec.reduce,
                    f"layer {rec.name!r} (call {rec.call}), {field}{jax.tree_util.keystr(path)}",
                    shapes,
                ),
                value,
            )
    return rec.replace(**changes)
