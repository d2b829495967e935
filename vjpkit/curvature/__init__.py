"""Curvature from layer records: K-FAC factors, the diagonal GGN and Fisher, first-order
statistics, and a K-FAC optimizer (``docs/curvature.md``).

Examples:
    >>> spec = vk.curvature.stats("fc*", ["kflr", "diag_ggn"])
    >>> (loss, grads), captured = vk.value_and_grad(loss_fn, capture=spec)(params, x, y)
    >>> A, G = captured["fc1"].kflr
"""

from ._types import Factors as Factors
from ._types import LayerCurvature as LayerCurvature
from ._types import Layout as Layout

__all__ = ["Factors", "LayerCurvature", "Layout"]
