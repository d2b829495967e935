"""Per-layer statistics below ``vk.inspect`` and ``vk.curvature``: a layer call's per-example
parameter gradient in matrix form (``Rows``), and what both read from it.

Examples:
    >>> rows = [vjpkit.stats.Rows.dense(x, d, W.shape), vjpkit.stats.Rows.bias(d, b.shape)]
    >>> vjpkit.stats.sq_norms(rows[:1])  # ||x_i^T d_i||^2 per example, by the ghost norm
"""

from ._rows import OneHot as OneHot
from ._rows import Rows as Rows
from ._rows import check as check
from ._rows import materialize as materialize
from ._rows import sq_norms as sq_norms
from ._rows import sum_sq as sum_sq
from ._rows import weighted_sum as weighted_sum

__all__ = ["OneHot", "Rows", "check", "materialize", "sq_norms", "sum_sq", "weighted_sum"]
