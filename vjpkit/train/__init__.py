"""vjpkit.train: the jit-compiled training loop on optax, with hooks, capture and hook state."""

from ._checkpoint import CheckpointDamagedError as CheckpointDamagedError
from ._checkpoint import restore as restore
from ._distributed import initialize as initialize
from ._fit import fit as fit
from ._sharding import batch_sharding as batch_sharding
from ._sharding import check_mesh as check_mesh
from ._sharding import data_mesh as data_mesh
from ._sharding import replicate as replicate
from ._sharding import replicated as replicated
from ._sharding import shard_batch as shard_batch
from ._state import TrainState as TrainState
from ._step import make_step as make_step

__all__ = [
    "CheckpointDamagedError",
    "TrainState",
    "batch_sharding",
    "check_mesh",
    "data_mesh",
    "fit",
    "initialize",
    "make_step",
    "replicate",
    "replicated",
    "restore",
    "shard_batch",
]
