"""vjpkit.inspect: explain records, statistics over training, non-finite origins, plots."""

from ._explain import explain as explain
from ._nonfinite import NonFiniteReport as NonFiniteReport
from ._nonfinite import find_nonfinite as find_nonfinite
from ._recorder import Recorder as Recorder
from ._recorder import Series as Series

__all__ = ["NonFiniteReport", "Recorder", "Series", "explain", "find_nonfinite"]
