"""Pytree plumbing shared by the custom_vjp and custom_jvp rules.

Contract: pure helpers over flat leaf lists and boolean masks; no JAX transforms here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal


def is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, jnp.ndarray)) or hasattr(x, "__jax_array__")


def split_kwargs(kwargs: dict) -> tuple[dict, dict]:
    dynamic = {k: v for k, v in kwargs.items() if is_array(v)}
    static = {k: v for k, v in kwargs.items() if k not in dynamic}
    return dynamic, static


def unwrap(tree: Any) -> tuple[Any, list[bool]]:
    """Values and per-leaf ``perturbed`` flags of a tree of CustomVJPPrimal."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, CustomVJPPrimal))
    values = [leaf.value for leaf in leaves]
    return jax.tree.unflatten(treedef, values), [bool(leaf.perturbed) for leaf in leaves]


def select(leaves: Sequence, mask: Sequence[bool]) -> list:
    return [leaf for leaf, keep in zip(leaves, mask) if keep]


def scatter(treedef: Any, mask: Sequence[bool], values: Sequence, *, collapse: bool) -> Any:
    """A tree shaped by ``treedef`` with ``values`` where ``mask`` and ``None`` elsewhere.

    With ``collapse``, a tree that has leaves but none selected becomes plain ``None``.
    """
    if collapse and mask and not any(mask):
        return None
    it = iter(values)
    return jax.tree.unflatten(treedef, [next(it) if keep else None for keep in mask])


def merge(leaves: Sequence, mask: Sequence[bool], diff: Sequence) -> list:
    it = iter(diff)
    return [next(it) if keep else leaf for leaf, keep in zip(leaves, mask)]


@jax.tree_util.register_static
class Static:
    """A hashable value carried as pytree metadata (no leaves), e.g. inside custom_vjp residuals."""

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Static) and self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)


def is_traced(tree: Any) -> bool:
    """Whether any leaf of ``tree`` is a tracer (so the call is not eager)."""
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree))


def varying_axes(x: Any) -> frozenset:
    """The shard_map axes a (traced) value varies over; empty outside shard_map."""
    aval = getattr(x, "aval", x)
    mat = getattr(aval, "mat", None)  # jax >= 0.10: aval.mat.varying; earlier: aval.vma
    return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())


def unvary(x: Any, like: Any) -> Any:
    """``x`` typed as ``like`` (a value or aval) varies: the mean over the shard_map axes ``x``
    varies over and ``like`` does not. A hook that rewrites a replicated parameter's gradient
    (the same in every shard) differently per shard gives the mean of the shards' versions."""
    extra = tuple(sorted(varying_axes(x) - varying_axes(like)))
    return jax.lax.pmean(x, extra) if extra else x


def vary(x: Any, axes: Any) -> Any:
    """``x`` typed as varying over the shard_map ``axes`` as well (its value unchanged)."""
    missing = tuple(sorted(set(axes) - varying_axes(x)))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)  # pragma: no cover - older JAX
