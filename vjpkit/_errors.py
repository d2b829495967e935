"""Exception types raised by vjpkit.

Every vjpkit error says what happened and what to do, and names the layer, the field and
the tree path where one applies. All inherit from ``VjpkitError``, and also from the
builtin a user would catch for the same mistake (``ValueError``, ``TypeError``).
"""

from __future__ import annotations


class VjpkitError(Exception):
    """Base class of all vjpkit errors."""


class HookError(VjpkitError, ValueError):
    """A hook returned something that cannot replace the record it was given."""


class ConfigError(VjpkitError, ValueError):
    """A transform or layer was configured wrongly (bad glob, duplicate name, ...)."""


class SeedError(VjpkitError, TypeError):
    """A cotangent seed (or the function output it seeds) does not fit."""


class HostHookError(VjpkitError, RuntimeError):
    """A function run on the host by ``vjpkit.on_host`` raised an exception.

    Attributes:
        original: the exception the host function raised.
    """

    original: BaseException | None = None


class NonFiniteError(VjpkitError, FloatingPointError):
    """Training met a NaN or Inf loss (``fit(..., nan_policy="stop")``).

    Attributes:
        step: the first step whose loss was not finite.
        layer: the call key of the first layer, in backward order, with a non-finite
            cotangent, or ``None`` when no layer could be named.
        field: that layer's first non-finite field (``grad_output``, ``grad_input``, ``grad_params``).
        state: the training state just before that step (the step and later ones were not applied).
        history: the metrics history up to the stop.
    """

    step: int = -1
    layer: str | None = None
    field: str | None = None
    state: object = None
    history: object = None
