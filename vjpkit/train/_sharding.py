"""Data parallelism: a 1-D device mesh, the batch split over its data axis, parameters replicated.

Contract:
- ``data_mesh`` builds a 1-D ``jax.sharding.Mesh`` over ``jax.devices()`` (or the devices
  given), with one axis named ``axis`` (``"data"``) of type ``Auto``, so ``jax.jit`` propagates
  shardings as usual. Under ``jax.distributed.initialize`` ``jax.devices()`` lists every
  process's devices, so the same call spans all hosts. No backend is named anywhere here.
- ``check_mesh`` raises ``ConfigError`` before any transfer or compile when the
  mesh has no such axis or its size does not divide the batch size.
- ``batch_sharding`` splits the batch dimension over ``axis`` (``batch_dim=0``, the leading
  one; ``1`` for a stack of batches fed to ``lax.scan``); ``replicated`` keeps a full copy
  on every device of the mesh.
- ``shard_batch`` and ``replicate`` ``jax.device_put`` every leaf of a pytree with those
  shardings (``shard_batch`` checks each leaf's batch dimension first). A leaf that already
  has the target sharding is returned as is.

Inside a jitted step the sharded batch is one global array: a mean over the batch, a gradient
and a captured norm are the same global numbers as on one device, up to float summation order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from .. import _format
from .._errors import ConfigError

__all__ = ["batch_sharding", "check_mesh", "data_mesh", "replicate", "replicated", "shard_batch"]


def _check_axis_name(axis: Any, where: str) -> None:
    if not isinstance(axis, str) or not axis:
        raise ConfigError(f"{where}: axis must be a non-empty string such as 'data', got {axis!r}.")


def _check_is_mesh(mesh: Any, where: str, types: tuple[type, ...] = (Mesh,)) -> None:
    if not isinstance(mesh, types):
        raise ConfigError(
            f"{where}: expected a jax.sharding.Mesh, got {type(mesh).__name__}. "
            "Build one with vjpkit.train.data_mesh()."
        )


def data_mesh(devices: Sequence[Any] | None = None, axis: str = "data") -> Mesh:
    """A 1-D mesh over ``devices`` (default: all of ``jax.devices()``) with one axis ``axis``.

    Args:
        devices: the devices to split the batch over (``jax.make_mesh`` orders them for the
            hardware's topology). ``None`` means ``jax.devices()``:
            every device of the default backend, on all hosts after ``jax.distributed.initialize``.
        axis: the name of the mesh axis the batch is split over.

    Returns:
        A ``jax.sharding.Mesh`` of shape ``{axis: len(devices)}``.

    Raises:
        ConfigError: if ``devices`` is empty or ``axis`` is not a non-empty string.

    Examples:
        >>> mesh = data_mesh()
        >>> mesh.axis_names, mesh.shape["data"] == jax.device_count()
        (('data',), True)
    """
    _check_axis_name(axis, "data_mesh")
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ConfigError("data_mesh: devices is empty; pass None to use every device in jax.devices().")
    # jax.make_mesh lays the devices out for the hardware's topology. Auto axis types keep the
    # sharding-in-types rules out: the batch is sharded by device_put, as with a plain Mesh.
    return jax.make_mesh((len(devices),), (axis,), (jax.sharding.AxisType.Auto,), devices=devices)


def check_mesh(mesh: Mesh | AbstractMesh, batch_size: int, axis: str = "data") -> None:
    """Raises ``ConfigError`` unless ``mesh``'s ``axis`` divides ``batch_size``.

    Args:
        mesh: the device mesh (a ``jax.sharding.AbstractMesh`` of the same shape works too).
        batch_size: the global batch size (the leading dimension of every batch leaf).
        axis: the mesh axis the batch is split over.

    Raises:
        ConfigError: if ``mesh`` is not a ``Mesh``, has no axis ``axis``, or the size of that
            axis does not divide ``batch_size``. The message names both numbers and the nearest
            batch sizes that would work.

    Examples:
        >>> check_mesh(data_mesh(), batch_size=8 * jax.device_count())
    """
    _check_is_mesh(mesh, "check_mesh", (Mesh, AbstractMesh))
    _check_axis_name(axis, "check_mesh")
    if axis not in mesh.axis_names:
        raise ConfigError(
            f"The mesh has no axis {axis!r}; its axes are {list(mesh.axis_names)}. "
            f"Pass axis= one of those, or build the mesh with vjpkit.train.data_mesh(axis={axis!r})."
        )
    n = int(mesh.shape[axis])
    if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer) or batch_size < 1:
        raise ConfigError(f"The batch size must be a positive integer, got {batch_size!r}.")
    batch_size = int(batch_size)
    if batch_size % n:
        lower = batch_size - batch_size % n
        higher = lower + n
        choices = f"{lower} or {higher}" if lower else f"{higher}"
        raise ConfigError(
            f"Mesh axis {axis!r} has {n} devices, which does not divide the batch size {batch_size}: "
            f"each device must get the same number of examples. Use a batch size that is a multiple "
            f"of {n} (for example {choices}), or a mesh over a number of devices that divides {batch_size}."
        )


def batch_sharding(mesh: Mesh, axis: str = "data", batch_dim: int = 0) -> NamedSharding:
    """The sharding that splits an array's batch dimension (by default the leading one) over ``axis``.

    Other dimensions are not split. Each device holds ``batch_size // mesh.shape[axis]`` rows.
    Use ``batch_dim=1`` for a stack of batches ``(steps, batch, ...)`` fed to a ``lax.scan``.

    Examples:
        >>> batch_sharding(data_mesh()).spec
        P('data',)
        >>> batch_sharding(data_mesh(), batch_dim=1).spec
        P(None, 'data')
    """
    _check_is_mesh(mesh, "batch_sharding")
    _check_axis_name(axis, "batch_sharding")
    if axis not in mesh.axis_names:
        raise ConfigError(
            f"batch_sharding: the mesh has no axis {axis!r}; its axes are {list(mesh.axis_names)}."
        )
    if isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0:
        raise ConfigError(f"batch_sharding: batch_dim must be an int >= 0, got {batch_dim!r}.")
    return NamedSharding(mesh, PartitionSpec(*([None] * batch_dim), axis))


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding that keeps a full copy of an array on every device of ``mesh``.

    Examples:
        >>> replicated(data_mesh()).is_fully_replicated
        True
    """
    _check_is_mesh(mesh, "replicated")
    return NamedSharding(mesh, PartitionSpec())


def _batch_dim_size(path: Any, leaf: Any, batch_dim: int) -> int:
    shape = np.shape(leaf)
    if len(shape) <= batch_dim:
        what = "is a scalar" if not shape else f"has shape {shape}"
        raise ConfigError(
            f"shard_batch: batch leaf {_format.where(path)} {what} and has no "
            f"batch dimension {batch_dim} to split. Every leaf of a batch needs the batch dimension; "
            "pass per-step constants separately (for example with replicate)."
        )
    return shape[batch_dim]


def shard_batch(batch: Any, mesh: Mesh, axis: str = "data", batch_dim: int = 0) -> Any:
    """Puts every leaf of ``batch`` on ``mesh``, split along its batch dimension over ``axis``.

    Each leaf is checked with ``check_mesh`` first, so a batch the mesh cannot split evenly
    raises before any transfer. The batch is the global one: in a multi-process run every
    process must pass the same values here; to feed each process its own part of the batch,
    use ``jax.make_array_from_process_local_data(batch_sharding(mesh), local_part)``.

    Args:
        batch: a pytree of arrays (numpy or JAX) with a common batch dimension.
        mesh: the device mesh, e.g. from ``data_mesh``.
        axis: the mesh axis to split the batch over.
        batch_dim: the batch dimension of every leaf: 0, or 1 for a stack of batches
            ``(steps, batch, ...)`` fed to a ``lax.scan``.

    Returns:
        The same pytree of ``jax.Array`` s, each sharded with ``batch_sharding``.

    Examples:
        >>> x = shard_batch(np.zeros((8 * jax.device_count(), 3), np.float32), data_mesh())
        >>> len(x.sharding.device_set) == jax.device_count()
        True
    """
    sharding = batch_sharding(mesh, axis, batch_dim)
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        check_mesh(mesh, _batch_dim_size(path, leaf, batch_dim), axis)
    return jax.device_put(batch, sharding)


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Puts every leaf of ``tree`` (parameters, optimizer state, ...) on every device of ``mesh``.

    In a multi-process run every process must pass the same values (for example parameters
    initialised from the same key).

    Examples:
        >>> params = replicate({"w": np.ones((3, 2), np.float32)}, data_mesh())
        >>> params["w"].sharding.is_fully_replicated
        True
    """
    return jax.device_put(tree, replicated(mesh))
