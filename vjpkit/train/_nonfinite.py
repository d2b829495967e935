"""Where a non-finite loss came from: the first layer, in backward order, with a NaN/Inf cotangent.

Contract: :func:`first_nonfinite` re-runs one step's gradient eagerly with a capture of
``nonfinite_count`` on every layer, and returns the first call key (in backward order, the
order records are produced) and field whose count is positive, or ``None``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .. import _autodiff
from .._capture import capture
from .._errors import ConfigError

FIELDS = ("grad_output", "grad_input", "grad_params")


def first_nonfinite(loss_fn: Callable, params: Any, batch: Any, **kwargs: Any) -> tuple[str, str] | None:
    """``(call key, field)`` of the first non-finite cotangent in backward order, or ``None``."""
    spec = capture("*", fields=FIELDS, reduce="nonfinite_count")
    try:
        _, captured = _autodiff.value_and_grad(loss_fn, capture=spec)(params, batch, **kwargs)
    except ConfigError:  # the loss calls no vjpkit layer: nothing to name
        return None
    for key, rec in captured.items():  # eager: dict order is backward order
        for field in FIELDS:
            counts = jax.tree.leaves(getattr(rec, field))
            if any(float(c) > 0 for c in counts):
                return key, field
    return None
