"""Curvature from layer records: K-FAC factors, the diagonal GGN and Fisher, first-order
statistics, and a K-FAC optimizer (``docs/curvature.md``).

Examples:
    >>> spec = vk.curvature.stats("fc*", ["kflr", "diag_ggn"])
    >>> (loss, grads), captured = vk.value_and_grad(loss_fn, capture=spec)(params, x, y)
    >>> A, G = captured["fc1"].kflr
"""

from ._blocks import Block as Block
from ._blocks import BlockState as BlockState
from ._blocks import EkfacBasis as EkfacBasis
from ._blocks import EkfacStats as EkfacStats
from ._blocks import diagonal as diagonal_block
from ._blocks import ekfac as ekfac_block
from ._blocks import ekfac_scaling as ekfac_scaling
from ._blocks import kronecker as kronecker_block
from ._kfac import KfacState as KfacState
from ._kfac import ScaleByKfacState as ScaleByKfacState
from ._kfac import kfac as kfac
from ._kfac import scale_by_kfac as scale_by_kfac
from ._losses import mse as mse
from ._losses import sigmoid_binary_cross_entropy as sigmoid_binary_cross_entropy
from ._losses import softmax_cross_entropy as softmax_cross_entropy
from ._spec import stats as stats
from ._stats import STATISTICS as STATISTICS
from ._stats import StatsSpec as StatsSpec
from ._types import Diagonal as Diagonal
from ._types import Ekfac as Ekfac
from ._types import Factors as Factors
from ._types import GradRows as GradRows
from ._types import LayerCurvature as LayerCurvature
from ._types import Layout as Layout

__all__ = [
    "STATISTICS",
    "Block",
    "BlockState",
    "Diagonal",
    "Ekfac",
    "EkfacBasis",
    "EkfacStats",
    "Factors",
    "GradRows",
    "KfacState",
    "LayerCurvature",
    "Layout",
    "ScaleByKfacState",
    "StatsSpec",
    "diagonal_block",
    "ekfac_block",
    "ekfac_scaling",
    "kfac",
    "kronecker_block",
    "mse",
    "scale_by_kfac",
    "sigmoid_binary_cross_entropy",
    "softmax_cross_entropy",
    "stats",
]
