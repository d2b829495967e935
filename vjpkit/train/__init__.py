"""vjpkit.train: the jit-compiled training loop on optax, with hooks, capture and hook state."""

from ._fit import fit as fit
from ._state import TrainState as TrainState
from ._step import make_step as make_step

__all__ = ["TrainState", "fit", "make_step"]
