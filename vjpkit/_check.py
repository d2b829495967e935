"""Trace-time checks that a pytree matches an expected one, leaf by leaf.

Contract: ``check_like`` compares pytree structure, then each leaf's shape and dtype, and
raises the given error class with the tree path, the expected value and the actual value.
It never casts. Leaves are anything with ``.shape`` and ``.dtype`` (arrays, tracers,
``jax.ShapeDtypeStruct``); ``None`` marks an absent subtree, as in JAX. ``require_inexact``
raises for the first leaf of a differentiated tree that is not float or complex.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._format import describe as _describe
from ._format import spec
from ._format import where as _where


def check_like(expected: Any, got: Any, *, what: str, error: type[Exception], hint: str = "") -> None:
    """Raises ``error`` unless ``got`` has the structure, shapes and dtypes of ``expected``.

    Args:
        expected: the reference pytree.
        got: the pytree to check.
        what: who and which field, e.g. ``"layer 'fc2' (call 0), field grad_params"``.
        error: the exception class to raise.
        hint: a sentence appended to the message (what to do).
    """
    tail = f" {hint}" if hint else ""
    exp_leaves, exp_def = jax.tree_util.tree_flatten_with_path(expected)
    got_leaves, got_def = jax.tree_util.tree_flatten_with_path(got)
    if exp_def != got_def:
        raise error(
            f"{what}: wrong pytree structure. Expected {_describe(expected)}, got {_describe(got)}.{tail}"
        )
    for (path, e), (_, g) in zip(exp_leaves, got_leaves):
        where = f"{what}, path {_where(path)}"
        if getattr(g, "shape", None) is None or getattr(g, "dtype", None) is None:
            raise error(f"{where}: expected an array {spec(e)}, got {spec(g)}.{tail}")
        dtype_differs = np.dtype(g.dtype) != np.dtype(e.dtype)
        if tuple(g.shape) != tuple(e.shape) or dtype_differs:
            cast = " There is no silent cast." if dtype_differs else ""
            raise error(f"{where}: expected {spec(e)}, got {spec(g)}.{cast}{tail}")


def require_inexact(tree: Any, what: str, *, error: type[Exception], hint: str) -> None:
    """Raises ``error`` naming the path and dtype of the first non-float leaf of ``tree``.

    Args:
        tree: a differentiated pytree.
        what: who and which argument, e.g. ``"vk.grad: args[1]"``.
        error: the exception class to raise.
        hint: what to do, appended to the message.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise error(
                f"{what}, path {_where(path)}, has dtype {np.dtype(dtype).name}; "
                f"it is differentiated, so it must be a float or complex array. {hint}"
            )
