"""The one place for how vjpkit writes shapes, dtypes and tree paths in messages and tables.

Contract: pure functions, no JAX transforms; every module formats through these.

* ``dtype_name(dtype)``: ``float32``, ``bfloat16``, ``float0`` (numpy calls it ``void``);
* ``spec(x)``: ``float32[4,3]`` for anything with ``shape`` and ``dtype`` (arrays, tracers,
  ``ShapeDtypeStruct``), ``None`` for ``None``, the type and ``repr`` otherwise (``bool True``);
* ``describe(tree)``: a pytree's specs, compactly (``{bias: float32[3]}``);
* ``path(keys)``: a tree path as ``fc1/weight`` or ``0/bias`` (``""`` for the root), the
  way layer names are written;
* ``where(keys)``: a tree path as ``['fc1']['weight']`` (``(root)`` for the root), for errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


def dtype_name(dtype: Any) -> str:
    """``float32``, ``bfloat16``, ... and ``float0`` (which numpy calls ``void``)."""
    return "float0" if dtype == jax.dtypes.float0 else np.dtype(dtype).name


def spec(x: Any) -> str:
    """``float32[4,3]`` for an array-like (``float32[]`` for a scalar), ``bool True`` (type and
    ``repr``) for anything else, ``None`` for ``None``."""
    if x is None:
        return "None"
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        return f"{type(x).__name__} {x!r}"
    return f"{dtype_name(dtype)}[{','.join(map(str, shape))}]"


def describe(tree: Any) -> str:
    """Shapes and dtypes of a pytree, compactly: ``float32[4,3]`` or ``{bias: float32[3]}``."""
    if tree is None:
        return "None"

    def leaf(x):
        if x is None:
            return None
        if getattr(x, "shape", None) is None or getattr(x, "dtype", None) is None:
            return repr(x)
        return spec(x)

    described = jax.tree.map(leaf, tree)
    return str(described).replace("'", "") if not isinstance(described, str) else described


def path(keys: Sequence[Any]) -> str:
    """``fc1/weight``: dict keys, attribute names and indices joined by ``/`` (root: ``""``)."""
    return jax.tree_util.keystr(tuple(keys), simple=True, separator="/")


def where(keys: Sequence[Any]) -> str:
    """``['fc1']['weight']`` as JAX writes a key path; ``(root)`` for the root."""
    return jax.tree_util.keystr(tuple(keys)) or "(root)"
