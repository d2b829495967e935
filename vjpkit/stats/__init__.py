"""Per-layer statistics below ``vk.inspect`` and ``vk.curvature``: a layer call's per-example
parameter gradient in matrix form (``Rows``), what both read from it, and the rows an embedding
lookup reads (``lookup_index``).

Examples:
    >>> from vjpkit import stats
    >>> x, d = jnp.ones((8, 16, 32)), jnp.ones((8, 16, 64))  # (B, T, in), (B, T, out)
    >>> stats.sq_norms([stats.Rows.dense(x, d, (32, 64))]).shape  # ||X_i^T D_i||^2, ghost norm
    (8,)
"""

from ._lookup import lookup_index as lookup_index
from ._patches import patches as patches
from ._rows import Conv as Conv
from ._rows import OneHot as OneHot
from ._rows import Rows as Rows
from ._rows import check as check
from ._rows import materialize as materialize
from ._rows import reduced as reduced
from ._rows import sq_norms as sq_norms
from ._rows import sum_sq as sum_sq
from ._rows import weighted_sum as weighted_sum

__all__ = [
    "Conv",
    "OneHot",
    "Rows",
    "check",
    "lookup_index",
    "materialize",
    "patches",
    "reduced",
    "sq_norms",
    "sum_sq",
    "weighted_sum",
]
