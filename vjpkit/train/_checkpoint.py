"""Atomic, verified checkpoints of a training state pytree, with orbax-checkpoint.

Contract: ``Checkpointer`` keeps numbered checkpoints in one directory. ``save(step,
state, meta)`` writes the array leaves of ``state`` and a small JSON ``meta`` dict, and
returns only once the checkpoint is complete on disk. A save is atomic: orbax writes into a
temporary directory and renames it on commit, so a process killed mid-save leaves the
previous complete checkpoint as ``latest_step()``; a leftover temporary directory is ignored
and removed when the next ``Checkpointer`` opens the directory. ``restore(target)``
returns the saved values bit for bit, in the pytree structure and types of ``target``
(NamedTuples, optax states, dicts), on the devices of ``target``'s arrays (the default
device for numpy leaves and unsharded ``jax.ShapeDtypeStruct`` leaves).

Layout: ``<dir>/<step>/state`` is an ordinary orbax PyTree checkpoint of the state as a nested
dict named like the state (``{"params": {"fc1": {"weight": ...}}, "opt_state": {"0": {"mu":
...}}, "step": ...}``: NamedTuple fields by name, sequence items by index), so orbax alone
restores ``params`` by name. ``<dir>/<step>/tree`` records every leaf's tree path, shape,
dtype and the SHA-256 of its bytes; ``<dir>/<step>/meta`` is the JSON meta dict.

Verification: ``restore`` compares the recorded paths, shapes and dtypes with ``target`` before
reading any array (``ConfigError`` naming the first path that differs: another model's
state), and the checksum of every array it reads (``CheckpointDamagedError``: bytes changed,
a file truncated or missing, unreadable JSON). ``restore_newest_intact`` (what ``fit`` uses)
walks back from the newest checkpoint to the newest intact one, warning for each damaged one
and moving it aside to ``<dir>/damaged/<step>`` so the run can save that step again.

Several processes (``jax.distributed``): every process calls ``save`` and ``restore`` at the
same point. Each writes its own shards (orbax's multi-process save, process 0 the metadata and
the commit) and restores its own shards onto ``target``'s sharding, with no transfer between
hosts. An array split over processes is recorded with one checksum per shard (gathered to
process 0 when saving); each process checks what it reads, and the processes agree (one
``process_allgather``) before ``restore`` returns or raises, so all of them skip the same
damaged checkpoint. Process 0 moves it aside, behind a barrier, and warns.

Typed PRNG key arrays (``jax.random.key``) are stored as their key data and rewrapped with
``target``'s key implementation. No pickle is involved.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from .._errors import ConfigError
from ._distributed import barrier, gather, multi, primary

__all__ = ["CheckpointDamagedError", "Checkpointer", "restore"]

_FORMAT = "vjpkit.train checkpoint"
_VERSION = 2  # 1: arrays in one flat dict keyed "0".."N"; 2: nested by name, with checksums
_STATE, _META, _TREE = "state", "meta", "tree"
_DAMAGED = "damaged"


class CheckpointDamagedError(ConfigError):
    """A checkpoint on disk is damaged: an array's bytes changed, a file is truncated or missing.

    Attributes:
        step: the damaged checkpoint's step.
        path: its directory.
        reason: what is wrong, e.g. ``"the array at state['params']['fc1']['weight'] does not
            match its checksum"``.
    """

    def __init__(self, step: int, path: str, reason: str, *, leaf: int = -1):
        self.step, self.path, self.reason, self.leaf = step, path, reason, leaf
        super().__init__(f"checkpoint step {step} ({path}) is damaged: {reason}.")


def _changed(where: str) -> str:
    return f"the array at state{where} does not match its checksum (its bytes changed on disk after the save)"


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array | jax.ShapeDtypeStruct) and jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key
    )


def _leaf_spec(x: Any) -> tuple[tuple[int, ...], str]:
    """(shape, dtype name) of a leaf as it is recorded in a checkpoint."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = np.asarray(x)
    return tuple(int(d) for d in x.shape), str(x.dtype)


def _escape(name: str) -> str:
    # orbax joins a leaf's keys with "." into its name in the checkpoint, and "/" would be read
    # as a directory: percent-encode both (and "%"), so that every key names exactly one leaf.
    return name.replace("%", "%25").replace(".", "%2E").replace("/", "%2F")


def _key_name(entry: Any) -> str:
    """One tree-path entry as a checkpoint key: dict keys and NamedTuple fields by name,
    sequence items by index."""
    if isinstance(entry, jax.tree_util.DictKey):
        name = str(entry.key)
    elif isinstance(entry, jax.tree_util.GetAttrKey):
        name = entry.name
    elif isinstance(entry, jax.tree_util.SequenceKey):
        name = str(entry.idx)
    elif isinstance(entry, jax.tree_util.FlattenedIndexKey):
        name = str(entry.key)
    else:  # a custom node's key: its own str
        name = str(entry)
    return _escape(name) or "%"  # orbax refuses an empty key


def _tree_spec(tree: Any) -> tuple[list[dict], list[Any], Any]:
    """Returns ([{path, keys, shape, dtype}] per leaf, leaves, treedef)."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    spec = []
    for path, leaf in with_path:
        shape, dtype = _leaf_spec(leaf)
        keys = [_key_name(e) for e in path] or ["%"]
        spec.append({"path": jax.tree_util.keystr(path), "keys": keys, "shape": list(shape), "dtype": dtype})
    return spec, [leaf for _, leaf in with_path], treedef


def _nest(spec: list[dict], values: list[Any]) -> dict:
    """The leaves as a nested dict keyed by ``spec``'s keys (raises if two leaves collide)."""
    root: dict = {}
    for entry, value in zip(spec, values):
        node = root
        *parents, last = entry["keys"]
        for k in parents:
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                raise ConfigError(
                    f"cannot checkpoint the state: the leaf at state{entry['path']} and another leaf "
                    f"have the same name {'/'.join(entry['keys'])!r} once keys are written as strings."
                )
            node = child
        if last in node:
            raise ConfigError(
                f"cannot checkpoint the state: two leaves are named {'/'.join(entry['keys'])!r} once "
                f"keys are written as strings (one is state{entry['path']}). Use distinct dict keys."
            )
        node[last] = value
    return root


def _pluck(nested: dict, keys: list[str]) -> Any:
    for k in keys:
        nested = nested[k]
    return nested


def _describe(entry: dict) -> str:
    return f"shape {tuple(entry['shape'])} dtype {entry['dtype']}"


def _to_savable(leaf: Any) -> Any:
    if _is_key(leaf):
        return jax.random.key_data(leaf)
    if isinstance(leaf, jax.Array | np.ndarray):
        return leaf
    return np.asarray(leaf)


def _digest(a: Any) -> str:
    a = np.ascontiguousarray(np.asarray(a))
    return "sha256:" + hashlib.sha256(a.reshape(-1).view(np.uint8)).hexdigest()


def _index_key(index: tuple, shape: tuple) -> str:
    """A shard's place in its array, ``"0:4,0:16"`` (start:stop per dimension)."""
    return ",".join("{}:{}".format(*s.indices(n)[:2]) for s, n in zip(index, shape))


def _whole_key(shape: tuple) -> str:
    return ",".join(f"0:{n}" for n in shape)


def _over_hosts(value: Any) -> bool:
    """An array split over several processes: no process holds all of it."""
    return (
        isinstance(value, jax.Array)
        and not value.is_fully_addressable
        and not value.sharding.is_fully_replicated
    )


def _checksums(values: list[Any]) -> list[dict]:
    """Per leaf ``{"sha256": digest of its bytes (C order)}``; an array split over several
    processes gets ``{"sha256": None, "shards": {index key: digest}}``, one digest per distinct
    shard, computed by the process that holds it and gathered (a collective: every process saves)."""
    out: list[dict] = []
    plan = []  # (leaf, shard key, owning process): the same list in every process
    for i, value in enumerate(values):
        if _over_hosts(value):
            owners: dict[str, int] = {}
            for device, index in value.sharding.devices_indices_map(value.shape).items():
                key = _index_key(index, value.shape)
                owners[key] = min(owners.get(key, device.process_index), device.process_index)
            plan += [(i, key, owners[key]) for key in sorted(owners)]
            out.append({"sha256": None, "shards": {}})
        elif isinstance(value, jax.Array) and not value.is_fully_addressable:  # replicated
            out.append({"sha256": _digest(value.addressable_data(0))})
        else:
            out.append({"sha256": _digest(value)})
    if plan:
        mine = jax.process_index()
        rows = np.zeros((len(plan), 32), np.uint8)
        for r, (i, key, owner) in enumerate(plan):
            if owner == mine:
                shards = values[i].addressable_shards
                shard = next(s for s in shards if _index_key(s.index, values[i].shape) == key)
                rows[r] = np.frombuffer(bytes.fromhex(_digest(shard.data)[7:]), np.uint8)
        everyone = gather(rows)
        for r, (i, key, owner) in enumerate(plan):
            out[i]["shards"][key] = "sha256:" + everyone[owner, r].tobytes().hex()
    return out


def _intact(entry: dict, value: Any) -> bool:
    """Whether ``value`` matches the checksums recorded in ``entry``, for every part of it that
    this process holds (each process checks its own shards)."""
    whole, shards = entry.get("sha256"), entry.get("shards") or {}
    shape = tuple(np.shape(value))
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        parts = {_index_key(s.index, shape): s.data for s in value.addressable_shards}
    elif whole is None:  # saved split over processes, read whole here: check every recorded shard
        parts = {key: np.asarray(value)[_slices(key)] for key in shards}
    else:
        parts = {_whole_key(shape): value}
    for key, part in parts.items():
        expected = shards.get(key, whole if key == _whole_key(shape) else None)
        if expected is not None and _digest(part) != expected:
            return False
    return True


def _slices(key: str) -> tuple:
    return tuple(slice(*map(int, part.split(":"))) for part in key.split(",") if part)


class Checkpointer:
    """Numbered, atomic, verified checkpoints of a state pytree and a JSON dict, in one directory.

    Args:
        directory: where checkpoints live; created if missing. Each step is a subdirectory
            named by its number.
        keep: how many of the newest checkpoints to keep; older ones are deleted after each
            successful save. Keep at least 2 so that a damaged newest checkpoint leaves an
            intact one to resume from.

    Example::

        ckpt = Checkpointer("runs/ckpt", keep=2)
        ckpt.save(100, state, {"epoch": 3, "index": 40})
        if ckpt.latest_step() is not None:
            state, meta = ckpt.restore(state)
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 2, _read_only: bool = False):
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
            create=not _read_only,
            enable_async_checkpointing=False,
            # a reader (vk.train.restore) must not remove the temporary directory of a save
            # that a training process has in progress
            cleanup_tmp_directories=not _read_only,
            # several processes: each writes its own shards, process 0 the metadata and the commit
            multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=0),
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

    def step_path(self, step: int) -> str:
        """The directory of checkpoint ``step``."""
        return os.path.join(self.directory, str(step))

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
        savable = [_to_savable(leaf) for leaf in leaves]
        for entry, sums in zip(spec, _checksums(savable)):
            entry.update(sums)
        arrays = _nest(spec, savable)
        tree = {"format": _FORMAT, "version": _VERSION, "leaves": spec}
        items = {_META: ocp.args.JsonSave(meta), _TREE: ocp.args.JsonSave(tree)}
        if arrays:  # orbax refuses an empty tree
            items[_STATE] = ocp.args.StandardSave(arrays)
        self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        self._manager.wait_until_finished()
        return True

    def _read_item(self, step: int, item: str) -> Any:
        return self._manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))[item]

    def _read_json(self, step: int) -> tuple[dict, dict]:
        """``(tree record, meta)`` of ``step``; ``ConfigError`` if not ours, damaged if unreadable."""
        path = self.step_path(step)
        if not os.path.isdir(os.path.join(path, _TREE)):
            raise ConfigError(
                f"{path} is not a vjpkit checkpoint (it has no tree record). Use another "
                f"checkpoint_dir, or move {path} away."
            )
        not_ours = ConfigError(
            f"{path} is not a vjpkit checkpoint (its tree record is not vjpkit's). Use another "
            f"checkpoint_dir, or move {path} away."
        )
        try:
            saved = self._read_item(step, _TREE)
        except Exception as e:  # orbax, tensorstore and json raise many kinds
            raise CheckpointDamagedError(step, path, f"its tree record cannot be read ({_brief(e)})") from e
        if not isinstance(saved, dict) or saved.get("format") != _FORMAT:
            raise not_ours
        try:
            meta = self._read_item(step, _META)
        except Exception as e:
            raise CheckpointDamagedError(step, path, f"its meta record cannot be read ({_brief(e)})") from e
        return saved, dict(meta or {})

    def _read_arrays(self, step: int, saved: dict, abstract: list[Any]) -> list[Any]:
        """The arrays of ``step`` in the order of ``saved["leaves"]``, each checked against its
        recorded checksum; ``CheckpointDamagedError`` for anything unreadable or changed."""
        path = self.step_path(step)
        entries = saved["leaves"]
        if not entries:
            return []
        if saved.get("version", 1) == 1:  # flat: {"0": leaf 0, "1": leaf 1, ...}
            keys = [[str(i)] for i in range(len(entries))]
        else:
            keys = [e["keys"] for e in entries]
        target = _nest([{"keys": k, "path": e["path"]} for k, e in zip(keys, entries)], abstract)
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(target)})
            )[_STATE]
            values = [_pluck(restored, k) for k in keys]
        except Exception as e:  # a truncated or missing file: tensorstore, orbax or OS errors
            raise CheckpointDamagedError(step, path, f"its arrays cannot be read ({_brief(e)})") from e
        for leaf, (entry, value) in enumerate(zip(entries, values)):
            if not _intact(entry, value):
                raise CheckpointDamagedError(step, path, _changed(entry["path"]), leaf=leaf)
        return values

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
            CheckpointDamagedError: the checkpoint is damaged: an array does not match its
                checksum, or a file is truncated, missing or unreadable.
        """
        step = self._pick(step)
        damage = None
        try:
            saved, meta = self._read_json(step)
            spec, leaves, treedef = _tree_spec(target)
            self._check_match(step, spec, saved["leaves"])
            values = self._read_arrays(step, saved, [_abstract(leaf) for leaf in leaves])
        except CheckpointDamagedError as err:
            damage = err
        self._agree(step, damage, target)
        out = [_from_saved(v, leaf) for v, leaf in zip(values, leaves)]
        return jax.tree_util.tree_unflatten(treedef, out), meta

    def _agree(self, step: int, damage: CheckpointDamagedError | None, target: Any) -> None:
        """Raises ``damage``, or, in a run of several processes, the damage any process found:
        each process checks the shards it reads, and all of them must take the same decision."""
        if not multi():
            if damage is not None:
                raise damage
            return
        found = gather([damage is not None, -1 if damage is None else damage.leaf])
        bad = [p for p in range(len(found)) if found[p, 0]]
        if not bad:
            return
        if damage is not None:
            damage.reason += f" (found by process {jax.process_index()})"
            raise CheckpointDamagedError(step, damage.path, damage.reason, leaf=damage.leaf) from damage
        first, leaf = bad[0], int(found[bad[0], 1])
        paths = _tree_spec(target)[0]
        reason = _changed(paths[leaf]["path"]) if 0 <= leaf < len(paths) else "its files cannot be read"
        reason += f" (found by process {first})"
        raise CheckpointDamagedError(step, self.step_path(step), reason, leaf=leaf)

    def restore_newest_intact(self, target: Any) -> tuple[Any, dict, int] | None:
        """Restores the newest checkpoint that is intact, skipping damaged newer ones.

        Each damaged checkpoint is reported with a ``RuntimeWarning`` naming its step and what
        is wrong, and moved aside to ``<dir>/damaged/<step>`` (kept for inspection; a run that
        resumes from an older step saves that step again).

        Returns:
            ``(state, meta, step)``, or ``None`` when the directory holds no checkpoint.

        Raises:
            ConfigError: a checkpoint of another model (never skipped), or every checkpoint
                is damaged (the message lists them).
        """
        steps = self.all_steps()
        if not steps:
            return None
        problems = []
        for step in reversed(steps):
            try:
                state, meta = self.restore(target, step)
            except CheckpointDamagedError as err:
                problems.append(err)
                continue
            for err in problems:
                moved = self._move_aside(err.step)
                if not primary():  # one warning for the run, from process 0
                    continue
                warnings.warn(
                    f"{err} Resuming from checkpoint step {step}, the newest intact one; the damaged "
                    f"checkpoint was moved to {moved}.",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return state, meta, step
        listed = "; ".join(f"step {e.step}: {e.reason}" for e in problems)
        raise ConfigError(
            f"every checkpoint in {self.directory} is damaged ({listed}). Nothing was changed on "
            f"disk. To start fresh, move the damaged step directories ({', '.join(map(str, steps))}) "
            "out of it, or pass another checkpoint_dir."
        )

    def _move_aside(self, step: int) -> str:
        """Moves checkpoint ``step`` to ``<dir>/damaged/<step>`` (process 0 moves; all wait)."""
        src = self.step_path(step)
        dst = os.path.join(self.directory, _DAMAGED, str(step))
        if primary():
            if os.path.exists(dst):
                dst = f"{dst}.{time.strftime('%Y%m%dT%H%M%S')}"
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.move(src, dst)
        barrier(f"vjpkit checkpoint {step} moved aside")
        self._manager.reload()
        return dst

    def _pick(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise ConfigError(f"no complete checkpoint in {self.directory} to restore.")
            return steps[-1]
        step = _check_step(step)
        if step not in steps:
            raise ConfigError(f"no checkpoint step {step} in {self.directory}; complete steps: {steps}.")
        return step

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


def restore(checkpoint_dir: str | os.PathLike, step: int | None = None, *, target: Any = None) -> Any:
    """Reads a checkpoint that ``fit`` (or a ``Checkpointer``) wrote, verifying every array.

    Args:
        checkpoint_dir: the directory given to ``fit(checkpoint_dir=...)``.
        step: which checkpoint; ``None`` means the newest intact one (a damaged newer one is
            skipped with a ``RuntimeWarning``, and left where it is).
        target: optional, a pytree of the saved structure (such as the ``TrainState`` that
            ``fit`` returns, or a ``jax.ShapeDtypeStruct`` tree); the state then comes back in
            its node types and on its devices, as ``Checkpointer.restore`` gives it.

    Returns:
        Without ``target``: the state as nested dicts of numpy arrays, named as saved:
        ``state["params"]`` is the params tree, ``state["step"]`` the step count,
        ``state["opt_state"]`` the optimizer state with NamedTuple fields by name and tuple
        items by index. With ``target``: the state in ``target``'s structure.

    Raises:
        ConfigError: no checkpoint there (or no such step), or ``target``'s tree differs.
        CheckpointDamagedError: the requested ``step`` is damaged, or, with ``step=None``,
            every checkpoint is.

    Examples:
        >>> state = vk.train.restore("runs/ckpt")
        >>> params = state["params"]
    """
    directory = os.path.abspath(os.fspath(checkpoint_dir))
    if not os.path.isdir(directory):
        raise ConfigError(f"no checkpoint directory {directory}.")
    with Checkpointer(directory, keep=1_000_000, _read_only=True) as ckpt:
        steps = ckpt.all_steps()
        if not steps:
            raise ConfigError(f"no complete checkpoint in {directory} to restore.")
        candidates = [ckpt._pick(step)] if step is not None else list(reversed(steps))
        damaged = []
        for s in candidates:
            try:
                if target is not None:
                    state = ckpt.restore(target, s)[0]
                else:
                    saved, _ = ckpt._read_json(s)
                    entries = saved["leaves"]
                    abstract = [_abstract_of_entry(e) for e in entries]
                    values = ckpt._read_arrays(s, saved, abstract)
                    keys = [e.get("keys") or [str(i)] for i, e in enumerate(entries)]
                    state = _nest(
                        [{"keys": k, "path": e["path"]} for k, e in zip(keys, entries)],
                        [np.asarray(v) for v in values],
                    )
            except CheckpointDamagedError as err:
                if step is not None:
                    raise
                damaged.append(err)
                continue
            for err in damaged:
                warnings.warn(
                    f"{err} Restored step {s}, the newest intact one.", RuntimeWarning, stacklevel=2
                )
            return state
        raise CheckpointDamagedError(
            damaged[0].step,
            directory,
            "every checkpoint there is damaged: " + "; ".join(f"step {e.step}: {e.reason}" for e in damaged),
        )


def _brief(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
        raise ConfigError(f"checkpoint step must be an int >= 0, got {step!r}.")
    return int(step)


def _abstract_of_entry(entry: dict) -> np.ndarray:
    """The numpy array to restore for a recorded leaf (a key array as its uint32 key data)."""
    dtype = entry["dtype"]
    if dtype.startswith("key<") and dtype.endswith(">"):  # stored as its key data
        impl = {"fry": "threefry2x32"}.get(dtype[4:-1], dtype[4:-1])
        like = jax.eval_shape(lambda: jax.random.key(0, impl=impl))
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(tuple(entry["shape"]), like.dtype))
        return np.empty(data.shape, data.dtype)
    return np.empty(tuple(entry["shape"]), np.dtype(dtype))


def _abstract(leaf: Any) -> jax.ShapeDtypeStruct | np.ndarray:
    """The array orbax should restore for ``leaf``: same shape/dtype, on leaf's devices.

    A numpy (or Python scalar) leaf is restored as numpy, in its own dtype: a float64 leaf
    stays float64 even when jax runs without x64 (as a jax array it would be cast to float32).
    """
    if not isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
        shape, dtype = _leaf_spec(leaf)
        return np.empty(shape, np.dtype(dtype))  # only its type, shape and dtype are read
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
