"""Batches for ``fit``: from arrays (shuffled per epoch, resumable by step) or any iterable.

Contract: ``ArrayBatches`` draws batch ``t`` of a run from the step count alone: epoch
``t // batches_per_epoch`` is a permutation seeded by ``(seed, epoch)``, so a resumed run sees
exactly the batches the uninterrupted run would have. An incomplete last batch of an epoch is
dropped. ``IterableBatches`` wraps any iterable; resuming skips the batches already
consumed, and a batch whose size differs from the first one's (an uneven last batch) is
skipped with a warning; with ``local=True`` (one process's batches of a multi-process run, where
a skip would leave the processes on different steps) it raises ``ConfigError`` naming the
process, as does an iterable that ends before ``until`` steps.
Both check, before anything is compiled, that every leaf of a batch has the same
leading size, and that the batch size fits the data.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np

from .. import _format
from .._errors import ConfigError


def leading_sizes(tree: Any) -> list[tuple[str, int]]:
    """``(path, leading size)`` of every array leaf; raises for a leaf without a batch axis."""
    sizes = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        where = _format.where(path)
        shape = np.shape(leaf)
        if not shape:
            raise ConfigError(f"batch leaf {where} is a scalar; every leaf needs a leading batch axis.")
        sizes.append((where, shape[0]))
    if not sizes:
        raise ConfigError("the data has no array leaves.")
    return sizes


def check_batch(batch: Any) -> int:
    """The batch size of ``batch``; raises if its leaves disagree on the leading dimension."""
    sizes = leading_sizes(batch)
    if len({n for _, n in sizes}) > 1:
        listed = ", ".join(f"{p}: {n}" for p, n in sizes)
        raise ConfigError(
            f"the leaves of a batch disagree on the leading (batch) dimension: {listed}. Every array "
            "in a batch must have the same number of examples along axis 0."
        )
    return sizes[0][1]


class ArrayBatches:
    """Shuffled, resumable batches from a pytree of arrays with a common leading axis.

    Examples:
        >>> batches = ArrayBatches((x, y), batch_size=64, seed=0)
        >>> xb, yb = batches.batch(0)          # the first batch of the run
    """

    def __init__(self, data: Any, batch_size: int, *, seed: int = 0, shuffle: bool = True):
        n = check_batch(data)
        if n == 0:
            raise ConfigError(
                "fit: the data has 0 examples (every array's leading axis is empty), so there is no "
                "batch to train on. Check how the data was loaded or filtered."
            )
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive int, got {batch_size!r}.")
        if batch_size > n:
            raise ConfigError(
                f"batch_size {batch_size} is larger than the data ({n} examples). Use batch_size <= {n}."
            )
        self.data = jax.tree.map(np.asarray, data)
        self.n, self.batch_size, self.seed, self.shuffle = n, batch_size, seed, shuffle
        self.per_epoch = n // batch_size  # the incomplete last batch is dropped
        self._epoch, self._order = -1, None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order = rng.permutation(self.n) if self.shuffle else np.arange(self.n)
            self._epoch = epoch
        return self._order

    def batch(self, step: int) -> Any:
        """The batch of step ``step`` (0-based) of the run."""
        epoch, index = divmod(step, self.per_epoch)
        rows = self._permutation(epoch)[index * self.batch_size : (index + 1) * self.batch_size]
        return jax.tree.map(lambda a: a[rows], self.data)

    def first(self) -> Any:
        """The first batch of the run."""
        return self.batch(0)

    def iterate(self, start: int) -> Iterator[Any]:
        step = start
        while True:
            yield self.batch(step)
            step += 1


class IterableBatches:
    """Batches from any iterable; resuming at step ``s`` skips the first ``s`` batches.

    The iterable is iterated once: ``first()`` reads its first batch (to check it and trace
    the step) and ``iterate`` yields that same batch, then the rest, so a one-shot iterator
    or generator loses nothing.
    """

    def __init__(self, data: Iterable, *, local: bool = False):
        self.data, self.local = data, local
        self.until: int | None = None  # with local: the steps every process must run
        self._it: Iterator[Any] | None = None
        self._first: list = []

    def first(self) -> Any:
        """The first batch (``None`` if there is none), read once and kept for ``iterate``."""
        if self._it is None:
            self._it = iter(self.data)
            self._first = [next(self._it, None)]
        return self._first[0] if self._first else None  # None too once iterate took it over

    def iterate(self, start: int) -> Iterator[Any]:
        """Batches from step ``start`` on; a batch whose size differs from the first is skipped."""
        first = self.first()
        if first is None:
            return
        # Hand the first batch over once, keeping no reference: the chain drops it when it moves on.
        source = itertools.chain([self._first.pop()], self._it)
        size = None
        step = 0
        for batch in source:
            n = check_batch(batch)
            size = n if size is None else size
            if n == size and step < start:  # already consumed by the run being resumed
                step += 1
                continue
            if n != size and self.local:
                raise ConfigError(
                    f"fit (local_data): process {jax.process_index()}'s local batch {step} has {n} "
                    f"rows, its first had {size}. With local data every process must feed batches of "
                    "the same size at every step: drop or pad the uneven batch in your loader."
                )
            if n != size:
                warnings.warn(
                    f"fit skipped a batch of {n} examples (the batches have {size}): an uneven batch "
                    "would recompile the step and may not split over the mesh.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                continue
            yield batch
            step += 1
        if self.local and self.until is not None and step < self.until:
            raise ConfigError(
                f"fit (local_data): process {jax.process_index()}'s iterable of local batches ended "
                f"after {step} batches, before steps={self.until}. Every process must run the same "
                "steps: give each process at least that many batches."
            )


def make_batches(
    data: Any, batch_size: int | None, seed: int, *, local: bool = False
) -> ArrayBatches | IterableBatches:
    """Arrays (an array, or a tuple or dict of arrays) need ``batch_size``; anything else is
    taken as an iterable of batches (a list, a generator, a data loader) and must not get one."""
    if hasattr(data, "shape") or isinstance(data, (tuple, dict)):
        if batch_size is None:
            raise ConfigError("fit got arrays as data: pass batch_size= (examples per step).")
        return ArrayBatches(data, batch_size, seed=seed)
    if not isinstance(data, Iterable):
        raise ConfigError(
            f"fit's data must be arrays (an array, a tuple or a dict of arrays) or an iterable of "
            f"batches, got {type(data).__name__}."
        )
    if batch_size is not None:
        raise ConfigError("fit got an iterable of batches: drop batch_size= (the batches set it).")
    return IterableBatches(data, local=local)
