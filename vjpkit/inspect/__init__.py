"""vjpkit.inspect: explain records, statistics over training, non-finite origins, plots."""

from ._explain import explain as explain
from ._nonfinite import NonFiniteReport as NonFiniteReport
from ._nonfinite import find_nonfinite as find_nonfinite
from ._per_example import PerExampleNorms as PerExampleNorms
from ._per_example import dp_clip as dp_clip
from ._per_example import dp_noise as dp_noise
from ._per_example import per_example_grad_norms as per_example_grad_norms
from ._plots import plot_backward_shapes as plot_backward_shapes
from ._plots import plot_gradient_flow as plot_gradient_flow
from ._plots import plot_histograms as plot_histograms
from ._plots import save as save
from ._recorder import Recorder as Recorder
from ._recorder import Series as Series
from ._stats import LayerStats as LayerStats
from ._stats import gradient_stats as gradient_stats
from ._stats import update_ratio as update_ratio

__all__ = [
    "LayerStats",
    "NonFiniteReport",
    "PerExampleNorms",
    "Recorder",
    "Series",
    "dp_clip",
    "dp_noise",
    "explain",
    "find_nonfinite",
    "gradient_stats",
    "per_example_grad_norms",
    "plot_backward_shapes",
    "plot_gradient_flow",
    "plot_histograms",
    "save",
    "update_ratio",
]
