"""Atomic, synchronous checkpoints of a training state pytree, with orbax-checkpoint.

Contract: ``Checkpointer`` keeps numbered checkpoints in one directory. ``save(step,
state, meta)`` writes the array leaves of ``state`` and a small JSON ``meta`` dict, and
returns only once the checkpoint is complete on disk. A save is atomic: orbax writes into a
temporary directory and renames it on commit, so a process killed mid-save leaves the
previous complete checkpoint as ``latest_step()``; a leftover temporary directory is ignored
and removed when the next ``Checkpointer`` opens the directory. ``restore(target)``
returns the saved values bit for bit, in the pytree structure and types of ``target``
(NamedTuples, optax states, dicts), on the devices of ``target``'s arrays (the default
device for numpy leaves and unsharded ``jax.ShapeDtypeStruct`` leaves).

Each checkpoint also records every leaf's tree path, shape and dtype. ``restore`` compares
them with ``target`` before reading any array, and raises ``ConfigError``
naming the first path that differs. Arrays are stored as one flat item keyed by leaf index,
so any pytree that ``jax.tree_util`` can flatten is saved, whatever its node types or its
dict keys. Typed PRNG key arrays (``jax.random.key``) are stored as their key data and
rewrapped with ``target``'s key implementation. No pickle is involved.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from .._errors import ConfigError

__all__ = ["Checkpointer"]

_FORMAT = "vjpkit.train checkpoint"
_VERSION = 1
_STATE, _META, _TREE = "state", "meta", "tree"


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array | jax.ShapeDtypeStruct) and jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key
    )


def _leaf_spec(x: Any) -> tuple[tuple[int, ...], str]:
    """(shape, dtype name) of a leaf as it is recorded in a checkpoint."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = np.asarray(x)
    return tuple(int(d) for d in x.shape), str(x.dtype)


def _tree_spec(tree: Any) -> tuple[list[dict], list[Any], Any]:
    """Returns ([{path, shape, dtype}] per leaf, leaves, treedef)."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    spec = []
    for path, leaf in with_path:
        shape, dtype = _leaf_spec(leaf)
        spec.append({"path": jax.tree_util.keystr(path), "shape": list(shape), "dtype": dtype})
    return spec, [leaf for _, leaf in with_path], treedef


def _describe(entry: dict) -> str:
    return f"shape {tuple(entry['shape'])} dtype {entry['dtype']}"


def _to_savable(leaf: Any) -> Any:
    if _is_key(leaf):
        return jax.random.key_data(leaf)
    if isinstance(leaf, jax.Array | np.ndarray):
        return leaf
    return np.asarray(leaf)


class Checkpointer:
    """Numbered, atomic checkpoints of a state pytree and a JSON dict, in one directory.

    Args:
        directory: where checkpoints live; created if missing. Each step is a subdirectory
            named by its number.
        keep: how many of the newest checkpoints to keep; older ones are deleted after each
            successful save.

    Example::

        ckpt = Checkpointer("runs/ckpt", keep=2)
        ckpt.save(100, state, {"epoch": 3, "index": 40})
        if ckpt.latest_step() is not None:
            state, meta = ckpt.restore(state)
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 2):
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ConfigError(f"Checkpointer keep must be an int >= 1, got {keep!r}.")
        self.directory = os.path.abspath(os.fspath(directory))
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise ConfigError(
                f"checkpoint directory {self.directory} exists and is not a directory. "
                "Pass another checkpoint_dir."
            )
        self.keep = keep
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            enable_async_checkpointing=False,
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                _STATE: ocp.StandardCheckpointHandler(),
                _META: ocp.JsonCheckpointHandler(),
                _TREE: ocp.JsonCheckpointHandler(),
            },
        )

    def __repr__(self) -> str:
        return f"Checkpointer({self.directory!r}, keep={self.keep})"

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Waits for any pending work and releases orbax's resources."""
        self._manager.close()

    def all_steps(self) -> list[int]:
        """Returns the steps of all complete checkpoints on disk, oldest first."""
        self._manager.reload()
        return sorted(int(s) for s in self._manager.all_steps())

    def latest_step(self) -> int | None:
        """Returns the newest complete checkpoint's step, or ``None`` if there is none.

        Reads the directory afresh, so checkpoints written by another process count. A
        checkpoint whose save was interrupted is never complete, and never returned.
        """
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, meta: dict | None = None) -> bool:
        """Saves ``state`` and ``meta`` as checkpoint ``step``, and returns when it is complete.

        Args:
            step: the checkpoint's number, an int >= 0.
            state: a pytree of arrays (jax or numpy; Python scalars are stored as numpy).
            meta: a JSON-serialisable dict, such as the data position. Tuples come back as lists.

        Returns:
            True if the checkpoint was written; False if checkpoint ``step`` already exists,
            in which case it is kept unchanged.

        Raises:
            ConfigError: ``step`` is not a non-negative int, is older than the newest
                checkpoint, or ``meta`` is not JSON-serialisable.
        """
        step = _check_step(step)
        meta = {} if meta is None else meta
        if not isinstance(meta, dict):
            raise ConfigError(f"checkpoint meta must be a dict, got {type(meta).__name__}.")
        try:
            meta = json.loads(json.dumps(meta, allow_nan=True))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"checkpoint meta must be JSON-serialisable: {e}.") from e
        steps = self.all_steps()
        if step in steps:
            return False
        if steps and step < steps[-1]:
            raise ConfigError(
                f"cannot save checkpoint step {step} in {self.directory}: it already holds the "
                f"newer step {steps[-1]}. Resume from it, or use another checkpoint_dir."
            )
        spec, leaves, _ = _tree_spec(state)
        arrays = {str(i): _to_savable(leaf) for i, leaf in enumerate(leaves)}
        tree = {"format": _FORMAT, "version": _VERSION, "leaves": spec}
        items = {_META: ocp.args.JsonSave(meta), _TREE: ocp.args.JsonSave(tree)}
        if arrays:  # orbax refuses an empty tree
            items[_STATE] = ocp.args.StandardSave(arrays)
        self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        self._manager.wait_until_finished()
        return True

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict]:
        """Restores checkpoint ``step`` (default: the newest) into the structure of ``target``.

        Args:
            target: a pytree with the saved state's structure, shapes and dtypes: concrete
                arrays or ``jax.ShapeDtypeStruct``. Only its structure, shapes, dtypes and
                shardings are used. Restored jax leaves take the sharding of ``target``'s leaf
                (the default device for numpy leaves and unsharded structs); numpy leaves
                come back as numpy.
            step: which checkpoint; ``None`` means ``latest_step``.

        Returns:
            ``(state, meta)``: the saved values, bit-identical, in ``target``'s pytree
            structure and node types, and the saved meta dict.

        Raises:
            ConfigError: there is no such checkpoint, or its tree differs from ``target``
                (structure, keys, shapes or dtypes). Checked before any array is read.
        """
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise ConfigError(f"no complete checkpoint in {self.directory} to restore.")
            step = steps[-1]
        else:
            step = _check_step(step)
            if step not in steps:
                raise ConfigError(f"no checkpoint step {step} in {self.directory}; complete steps: {steps}.")
        not_ours = ConfigError(
            f"{os.path.join(self.directory, str(step))} is not a vjpkit checkpoint (it has no "
            "tree record). Use another checkpoint_dir, or delete this one to start fresh."
        )
        try:
            info = self._manager.restore(
                step,
                args=ocp.args.Composite(**{_META: ocp.args.JsonRestore(), _TREE: ocp.args.JsonRestore()}),
            )
        except (KeyError, FileNotFoundError, ValueError) as e:
            raise not_ours from e
        saved = info[_TREE]
        if not isinstance(saved, dict) or saved.get("format") != _FORMAT:
            raise not_ours
        spec, leaves, treedef = _tree_spec(target)
        self._check_match(step, spec, saved["leaves"])
        abstract = {str(i): _abstract(leaf) for i, leaf in enumerate(leaves)}
        restored = {}
        if abstract:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(abstract)})
            )[_STATE]
        out = [_from_saved(restored[str(i)], leaf) for i, leaf in enumerate(leaves)]
        return jax.tree_util.tree_unflatten(treedef, out), dict(info[_META] or {})

    def _check_match(self, step: int, expected: list[dict], saved: list[dict]) -> None:
        where = f"checkpoint step {step} in {self.directory}"
        fix = "Use another checkpoint_dir, or delete this one to start fresh."
        saved_by_path = {e["path"]: e for e in saved}
        expected_paths = {e["path"] for e in expected}
        for i, exp in enumerate(expected):
            got = saved_by_path.get(exp["path"])
            if got is None:
                other = saved[i]["path"] if i < len(saved) else None
                instead = f" (at that position it has {other!r})" if other is not None else ""
                raise ConfigError(
                    f"{where} holds another model's state: the target has a leaf at "
                    f"state{exp['path']} ({_describe(exp)}) that the checkpoint lacks{instead}. {fix}"
                )
            if exp["shape"] != got["shape"] or exp["dtype"] != got["dtype"]:
                raise ConfigError(
                    f"{where} holds another model's state: at state{exp['path']} the target "
                    f"expects {_describe(exp)} but the checkpoint has {_describe(got)}. {fix}"
                )
        for got in saved:
            if got["path"] not in expected_paths:
                raise ConfigError(
                    f"{where} holds another model's state: it has a leaf at state{got['path']} "
                    f"({_describe(got)}) that the target lacks. {fix}"
                )
        if [e["path"] for e in expected] != [e["path"] for e in saved]:  # same paths, other order
            raise ConfigError(f"{where} orders its leaves differently from the target. {fix}")


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
        raise ConfigError(f"checkpoint step must be an int >= 0, got {step!r}.")
    return int(step)


def _abstract(leaf: Any) -> jax.ShapeDtypeStruct:
    """The array orbax should restore for ``leaf``: same shape/dtype, on leaf's devices."""
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if _is_key(leaf):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
    shape, dtype = _leaf_spec(leaf)
    return jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=sharding)


def _from_saved(value: Any, like: Any) -> Any:
    if _is_key(like):
        impl = jax.random.key_impl(like) if isinstance(like, jax.Array) else like.dtype._impl
        return jax.random.wrap_key_data(value, impl=impl)
    if isinstance(like, jax.Array | jax.ShapeDtypeStruct):
        return value
    return np.asarray(value)
