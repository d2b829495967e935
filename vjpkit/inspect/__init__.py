"""vjpkit.inspect: explain records, statistics over training, non-finite origins, plots."""

from ._explain import explain as explain
from ._nonfinite import NonFiniteReport as NonFiniteReport
from ._nonfinite import find_nonfinite as find_nonfinite
from ._plots import plot_backward_shapes as plot_backward_shapes
from ._plots import plot_gradient_flow as plot_gradient_flow
from ._plots import plot_histograms as plot_histograms
from ._plots import save as save
from ._recorder import Recorder as Recorder
from ._recorder import Series as Series

__all__ = [
    "NonFiniteReport",
    "Recorder",
    "Series",
    "explain",
    "find_nonfinite",
    "plot_backward_shapes",
    "plot_gradient_flow",
    "plot_histograms",
    "save",
]
