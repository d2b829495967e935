"""``fit``: the jit-compiled training loop, with hooks, capture, hook state, checkpoints and a mesh.

Contract: ``fit`` validates everything (optimizer, data, batch, mesh, loss, checkpoint tree)
before anything is compiled, then runs ``steps`` steps of ``make_step``, ``scan_steps``
per dispatch (``lax.scan``). Metrics stay on the device and are fetched every ``log_every``
steps, so dispatch runs ahead of the host. Captured records leave each step as ONE packed
output (``_host._pack``). Between dispatches, ``on_records`` gets the records of every step
the device has finished, without waiting for it; the loop waits for records only when the
records of more than ``_outstanding`` dispatches are pending, and then once, for the older
half (waiting on the device after every dispatch made the host thread sleep and wake once
per step, which slowed the MLP 3-20-30-2's XLA:CPU step by about 20%, measured). Each
dispatched step's records reach ``on_records`` exactly once, in step order, also at the end,
before a checkpoint is saved, and when the loop stops on an exception (under
``nan_policy="stop"``: up to and including the non-finite step; nothing more after an
exception raised by ``on_records`` itself). The run is a pure function of ``(params, data,
seed)``: batch ``t`` depends only on ``t`` and the seed, and so a run resumed from a checkpoint
ends bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import collections
import hashlib
import inspect
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import _format
from .._errors import ConfigError, NonFiniteError
from .._host import _pack
from ..inspect._nonfinite import first_nonfinite
from ._data import ArrayBatches, check_batch, make_batches
from ._distributed import gather, multi, primary
from ._state import TrainState
from ._step import _kfac_states, _wants_key, build_step, check_optimizer, due_phase, init_hook_state


def _positive(name: str, value: Any, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"fit: {name} must be a positive int, got {value!r}.")


def _stack(batches: list) -> Any:
    return jax.tree.map(lambda *leaves: np.stack(leaves), *batches)


def _check_loss_signature(loss_fn: Callable) -> None:
    """``fit`` calls ``loss_fn(params, batch)`` (and ``key=`` when it takes one)."""
    if not callable(loss_fn):
        raise ConfigError(
            f"fit: loss_fn must be callable loss_fn(params, batch), got {type(loss_fn).__name__}."
        )
    try:
        sig = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return  # a builtin or C callable: no signature to check
    try:
        if _wants_key(loss_fn):
            sig.bind(None, None, key=None)
        else:
            sig.bind(None, None)
    except TypeError as err:
        name = getattr(loss_fn, "__name__", "loss_fn")
        raise ConfigError(
            f"fit: loss_fn {name}{sig} cannot be called as loss_fn(params, batch) ({err}). fit passes "
            "the params and one batch (the data's pytree, e.g. a tuple (x, y)): write "
            "def loss_fn(params, batch): x, y = batch; ..."
        ) from None


def _check_float_params(params: Any) -> None:
    """Every params leaf is differentiated and updated by the optimizer, so it must be a float."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
            raise ConfigError(
                f"fit: params leaf {_format.where(path)} is {_format.spec(leaf)}, not a float array. fit "
                "differentiates and updates every params leaf; keep integer state (counters, "
                "indices, masks) out of params: close over it in loss_fn, or pass it in the batch."
            )


def fit(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    params: Any,
    data: Any,
    *,
    batch_size: int | None = None,
    steps: int | None = None,
    epochs: int | None = None,
    hooks: dict | None = None,
    capture: Any = None,
    curvature_every: int = 1,
    scan_steps: int = 1,
    eval_fn: Callable | None = None,
    eval_every: int | None = None,
    on_records: Callable | None = None,
    on_metrics: Callable | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    keep: int = 2,
    mesh: Any = None,
    seed: int = 0,
    progress: bool | None = None,
    nan_policy: str = "stop",
    log_every: int = 50,
    local_data: bool = False,
) -> tuple[TrainState, dict]:
    """Trains ``params`` on ``data`` with ``optimizer``; returns ``(state, history)``.

    Args:
        loss_fn: ``loss_fn(params, batch[, key=k]) -> scalar`` (``key`` is a fresh PRNG key
            each step when the loss declares it, e.g. for dropout).
        optimizer: an optax ``GradientTransformation`` or ``optax.MultiSteps``; one that reads
            the loss (``optax.reduce_on_plateau``, ``optax.lbfgs``) gets ``value=``, ``grad=``
            and ``value_fn=`` as in an optax loop (see ``make_step``).
        params: the initial parameters.
        data: arrays (an array, or a tuple or dict of arrays sharing the leading axis; needs
            ``batch_size``, shuffled each epoch, the incomplete last batch dropped), or any
            iterable of batches (a list, a generator), iterated once.
        batch_size: examples per step, for array data.
        steps: number of steps; or ``epochs`` for array data. An iterable runs until it ends.
        hooks: layer hooks (see ``vk.grad``); stateful ones are threaded in ``state.hook_state``.
        capture: capture spec(s) (see ``vk.capture``); each step's records go to ``on_records``.
        curvature_every: ``vk.curvature.stats`` on every ``curvature_every``-th step only, as in
            ``make_step`` (the other steps' records are NaN). One step per dispatch
            (``scan_steps=1``) runs one of two compiled programs, chosen on the host by K-FAC's
            update count (one scalar read per step), as ``make_step`` does; ``scan_steps > 1``
            keeps the ``lax.cond`` inside the scanned program (XLA:CPU compiles convolutions in
            its branches slowly).
        scan_steps: steps per dispatch; more than 1 runs them in one ``lax.scan``.
        eval_fn: ``eval_fn(params) -> dict of numbers``, called every ``eval_every`` steps.
        eval_every: steps between evaluations (and at the end).
        on_records: ``on_records(step, captured)`` with numpy records, for every step, exactly
            once and in order: between dispatches, as soon as the device has finished the
            step (the loop does not wait for it), and all of them at the end, before each
            checkpoint and when the loop raises (``NonFiniteError``: up to the bad step).
        on_metrics: ``on_metrics(step, metrics)`` with a flat dict of floats: ``{"train/loss":
            ...}`` for every step and ``{"eval/<name>": ...}`` for every evaluation; for example
            ``vk.inspect.Recorder(tensorboard_dir=...).log_metrics``.
        checkpoint_dir: save there every ``checkpoint_every`` steps and at the end, and resume
            from the newest intact checkpoint found there. A damaged newer checkpoint (an
            array whose checksum differs, a truncated or missing file) is skipped with a
            ``RuntimeWarning`` naming its step and what is wrong, and moved aside to
            ``checkpoint_dir/damaged/<step>``.
        checkpoint_every: steps between checkpoints.
        keep: how many of the newest checkpoints to keep (at least 1; 2 or more leaves an
            older one to resume from if the newest is damaged).
        mesh: a ``jax.sharding.Mesh`` with a ``"data"`` axis (see ``data_mesh``): batches are
            sharded over it and the state is replicated.
        seed: seeds the shuffling and ``state.rng``.
        progress: show a tqdm bar with the loss, the last evaluation and tqdm's step rate,
            refreshed at least every second (default: when stderr is a terminal).
        nan_policy: ``"stop"`` raises ``vjpkit.NonFiniteError`` naming the step and the
            first layer with a non-finite cotangent; ``"continue"`` warns for every non-finite
            step and goes on; ``"off"`` does not check.
        log_every: steps between fetches of the metrics (and progress updates).
        local_data: in a run of several processes (``jax.distributed``), each process passes
            only its own rows: arrays (``batch_size`` is still the global batch; each process
            takes ``batch_size // jax.process_count()`` of its rows per step, shuffled by the
            same ``(seed, epoch)`` permutation in every process) or an iterable of local batches
            (with ``steps=``). ``fit`` assembles step ``t``'s global batch from every process's
            batch ``t``, each on its own devices, with ``jax.make_array_from_process_local_data``.
            Needs ``mesh=``. A local batch whose size, leaves or batches per epoch differ from
            process 0's raises ``ConfigError`` naming the process.

    Several processes: every process calls ``fit`` with the same arguments (and, without
    ``local_data``, the same data). Process 0 alone shows the progress bar, calls
    ``on_metrics`` and ``on_records`` (with the global records, gathered inside the step) and
    warns; every process writes its shards of each checkpoint and resumes from it.

    Returns:
        The final ``TrainState`` and ``history = {"step": [...], "loss": [...],
        "eval": [{"step": s, ...}], "nonfinite": [steps]}``.

    Examples:
        >>> state, history = vk.train.fit(loss_fn, optax.adam(1e-3), params, (x, y), batch_size=64, epochs=3)
    """
    optimizer = check_optimizer(optimizer)
    for name, value in (
        ("steps", steps),
        ("epochs", epochs),
        ("eval_every", eval_every),
        ("checkpoint_every", checkpoint_every),
    ):
        _positive(name, value)
    _positive("scan_steps", scan_steps, allow_none=False)
    _positive("log_every", log_every, allow_none=False)
    _positive("keep", keep, allow_none=False)
    if on_records is not None and capture is None:
        raise ConfigError("fit: on_records= receives captured records; pass capture= too.")
    if eval_every is not None and eval_fn is None:
        raise ConfigError("fit: eval_every= needs eval_fn=.")
    if checkpoint_every is not None and checkpoint_dir is None:
        raise ConfigError("fit: checkpoint_every= needs checkpoint_dir=.")
    _check_loss_signature(loss_fn)
    _check_float_params(params)
    processes = jax.process_count() if local_data else 1
    if local_data:
        batch_size = _local_batch_size(mesh, batch_size, steps, data)
    batches = make_batches(data, batch_size, seed, local=local_data)
    if epochs is not None:
        if not isinstance(batches, ArrayBatches):
            raise ConfigError(
                "fit: epochs= needs array data; for an iterable, pass steps= or let it run out."
            )
        if steps is not None:
            raise ConfigError("fit: pass steps= or epochs=, not both.")
        steps = epochs * batches.per_epoch
    if steps is None and isinstance(batches, ArrayBatches):
        raise ConfigError("fit: with array data, pass steps= or epochs=.")
    if local_data and not isinstance(batches, ArrayBatches):
        batches.until = steps

    first = batches.first()
    if first is None:
        raise ConfigError("fit: the data yielded no batch.")
    size = check_batch(first)
    if local_data:
        _check_local_batches(first, batches)
        size *= processes  # the global batch; traced with zeros of its shape
        first = jax.tree.map(lambda a: np.zeros((size, *np.shape(a)[1:]), np.asarray(a).dtype), first)
    if mesh is not None:
        from ._sharding import check_mesh

        check_mesh(mesh, size)
    hook_state = init_hook_state(loss_fn, hooks, capture, params, first)
    state = TrainState.create(params, optimizer, hook_state=hook_state, seed=seed)
    step_fn = build_step(
        loss_fn, optimizer, hooks=hooks, capture=capture, nan_policy=nan_policy, report_finite=True,
        curvature_every=curvature_every,
    )  # fmt: skip
    jax.eval_shape(step_fn, state, first)  # every trace-time check, before any compile
    # curvature_every > 1, one step per dispatch: a statistics program and a plain one, chosen on
    # the host (make_step's reason: jax#12868, XLA:CPU's convolutions inside a lax.cond)
    phases = (
        {ph: build_step(loss_fn, optimizer, hooks=hooks, capture=capture, nan_policy=nan_policy,
                        report_finite=True, curvature_every=curvature_every, phase=ph)
         for ph in ("stats", "plain")}
        if curvature_every > 1 and scan_steps == 1 and _kfac_states(state) else {}
    )  # fmt: skip
    unpack: list = []  # the records' unpack function, set when the step is traced

    def wrapped(fn: Callable) -> Callable:
        if mesh is not None:  # the state stays replicated: every process can read it, one program
            fn = _keep_replicated(fn, _replicated(mesh))
        if on_records is not None:
            # several processes: the records are gathered inside the step, to every process (one
            # compiled program for all), and process 0 hands them to on_records
            everywhere = mesh is not None and multi()
            fn = _packing(fn, unpack, _replicated(mesh) if everywhere else None)
        return fn

    step_fn = wrapped(step_fn)
    phases = {ph: wrapped(fn) for ph, fn in phases.items()}
    del first  # an iterable's first batch is handed to the loop; keep no extra reference
    if not primary():  # process 0 prints, logs and calls on_records
        on_records = on_metrics = None
        progress = False
    if mesh is not None:  # placed before a restore, so that each process reads its own shards
        from ._sharding import replicate

        state = replicate(state, mesh)

    checkpointer = None
    bar = None
    try:
        if checkpoint_dir is not None:
            from ._checkpoint import Checkpointer

            checkpointer = Checkpointer(checkpoint_dir, keep=keep)
            found = checkpointer.restore_newest_intact(state)
            if found is not None:
                state = found[0]
        start = int(state.step)
        if progress is None:
            progress = sys.stderr.isatty()
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=steps, initial=start, unit="step", dynamic_ncols=True, mininterval=0.2)
        state, history = _loop(
            state,
            start,
            batches,
            step_fn,
            loss_fn,
            phases=phases,
            curvature_every=curvature_every,
            put=_placer(mesh, local_data),
            steps=steps,
            scan_steps=scan_steps,
            eval_fn=eval_fn,
            eval_every=eval_every,
            on_records=on_records,
            unpack=unpack,
            on_metrics=on_metrics,
            checkpointer=checkpointer,
            checkpoint_every=checkpoint_every,
            seed=seed,
            bar=bar,
            nan_policy=nan_policy,
            log_every=log_every,
        )
    finally:
        if bar is not None:
            bar.close()
        if checkpointer is not None:
            checkpointer.close()
    return state, history


def _packing(step_fn: Callable, unpack: list, sharding: Any = None) -> Callable:
    """``step_fn`` whose captured records leave as one buffer per dtype (``metrics["records"]``),
    placed with ``sharding`` when one is given."""

    def step(state, batch):
        state, metrics = step_fn(state, batch)
        buffers, unpack_fn = _pack(metrics.pop("captured"))
        if sharding is not None:
            buffers = [jax.lax.with_sharding_constraint(b, sharding) for b in buffers]
        unpack[:] = [unpack_fn]
        return state, {**metrics, "records": buffers}

    return step


def _keep_replicated(step_fn: Callable, sharding: Any) -> Callable:
    def step(state, batch):
        state, metrics = step_fn(state, batch)
        return jax.lax.with_sharding_constraint(state, sharding), metrics

    return step


def _replicated(mesh: Any) -> Any:
    from ._sharding import replicated

    return replicated(mesh)


def _placer(mesh: Any, local_data: bool) -> Callable:
    """``put(batch, batch_dim)``: a host batch onto ``mesh`` (as is without one); with
    ``local_data``, this process's rows of the global batch."""
    if mesh is None:
        return lambda b, dim=0: b
    from ._sharding import batch_sharding, shard_batch

    if not multi():
        return lambda b, dim=0: shard_batch(b, mesh, batch_dim=dim)
    n = jax.process_count()
    if not local_data:  # the same global batch in every process: each places its own rows

        def put_global(batch: Any, dim: int = 0) -> Any:
            sharding = batch_sharding(mesh, batch_dim=dim)
            # a jax.device_put of host data onto other hosts' devices would first compare the
            # values across processes, every step (and a NaN never equals itself)
            place = lambda a: jax.make_array_from_callback(np.shape(a), sharding, lambda i: np.asarray(a)[i])
            return jax.tree.map(place, batch)

        return put_global

    def put(batch: Any, dim: int = 0) -> Any:
        sharding = batch_sharding(mesh, batch_dim=dim)

        def one(a):
            a = np.asarray(a)
            shape = (*a.shape[:dim], a.shape[dim] * n, *a.shape[dim + 1 :])
            return jax.make_array_from_process_local_data(sharding, a, shape)

        return jax.tree.map(one, batch)

    return put


def _local_batch_size(mesh: Any, batch_size: int | None, steps: int | None, data: Any) -> int | None:
    """With ``local_data``: this process's rows per step (from the global ``batch_size``)."""
    if mesh is None:
        raise ConfigError(
            "fit: local_data=True assembles each step's global batch on a mesh: pass "
            "mesh=vjpkit.train.data_mesh() too."
        )
    n = jax.process_count()
    if batch_size is None:
        if multi() and steps is None:
            raise ConfigError(
                f"fit (process {jax.process_index()}): with local_data and an iterable of local "
                "batches, pass steps=: every process must run the same number of steps, and a "
                "process whose iterable ends first would leave the others waiting."
            )
        return None
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        return batch_size  # make_batches names the problem
    if batch_size % n:
        raise ConfigError(
            f"fit: with local_data, batch_size={batch_size} is the global batch, split over "
            f"{n} processes; it must be a multiple of {n} (each process takes batch_size // {n} "
            "of its rows per step)."
        )
    return batch_size // n


def _check_local_batches(first: Any, batches: Any) -> None:
    """Every process's local batch has process 0's rows, leaves and batches per epoch (a
    collective: every process checks at once, and all raise the same error)."""
    with_path = jax.tree_util.tree_leaves_with_path(first)
    shapes = f"{[(_format.where(p), np.shape(a)[1:], str(np.asarray(a).dtype)) for p, a in with_path]}"
    digest = np.frombuffer(hashlib.sha256(shapes.encode()).digest()[:8], np.int32)
    per_epoch = batches.per_epoch if isinstance(batches, ArrayBatches) else -1
    found = gather([check_batch(first), per_epoch, *digest.tolist()])
    me = jax.process_index()
    for p in range(1, len(found)):
        if found[p, 0] != found[0, 0]:
            raise ConfigError(
                f"fit (local_data): process {p}'s local batch has {found[p, 0]} rows but process 0's "
                f"has {found[0, 0]}. Every process must feed the same number of rows per step."
            )
        if found[p, 1] != found[0, 1]:
            raise ConfigError(
                f"fit (local_data): process {p}'s data gives {found[p, 1]} batches per epoch but "
                f"process 0's gives {found[0, 1]}. Give every process the same number of rows, so "
                "that all run the same steps."
            )
        if list(found[p, 2:]) != list(found[0, 2:]):
            raise ConfigError(
                f"fit (local_data): process {p}'s local batch differs from process 0's in its leaves' "
                f"trailing shapes or dtypes (process {me} has {shapes}). Every process must feed "
                "batches of the same structure."
            )


_REFRESH_SECONDS = 1.0  # the progress bar's loss and count are fetched at least this often
_MAX_PENDING = 32  # dispatches whose records may wait on the device before the loop waits
_MAX_PENDING_BYTES = 64 << 20  # ... and their bytes (whole captured arrays are large)


def _outstanding(records: list) -> int:
    """How many dispatches' packed ``records`` may be pending before the loop waits for them."""
    nbytes = sum(b.nbytes for b in records)
    return max(2, min(_MAX_PENDING, _MAX_PENDING_BYTES // max(nbytes, 1)))


def _loop(
    state: TrainState,
    start: int,
    batches: Any,
    step_fn: Callable,
    loss_fn: Callable,
    *,
    phases: dict,
    curvature_every: int,
    put: Callable,
    steps: int | None,
    scan_steps: int,
    eval_fn: Callable | None,
    eval_every: int | None,
    on_records: Callable | None,
    unpack: list,
    on_metrics: Callable | None,
    checkpointer: Any,
    checkpoint_every: int | None,
    seed: int,
    bar: Any,
    nan_policy: str,
    log_every: int,
) -> tuple[TrainState, dict]:
    if phases:  # make_step's host dispatch: K-FAC's count read on the host, one program each
        programs = {ph: jax.jit(fn, donate_argnums=0) for ph, fn in phases.items()}

        def single(state: TrainState, batch: Any) -> tuple[TrainState, dict]:
            return programs[due_phase(state, curvature_every)](state, batch)

    else:
        single = jax.jit(step_fn, donate_argnums=0)

    scanned = (
        jax.jit(lambda s, bs: jax.lax.scan(step_fn, s, bs), donate_argnums=0) if scan_steps > 1 else None
    )
    history: dict[str, list] = {"step": [], "loss": [], "eval": [], "nonfinite": []}
    # The batches of dispatched steps are kept only to name the layer of a non-finite step
    # ("stop" on an iterable: array batches are recomputed from the step). A step's batch is
    # dropped as soon as its finite flag is known to be True, so what stays alive is what the
    # runtime holds anyway for steps still in flight, not the last log_every batches.
    keep_batches = nan_policy == "stop" and not isinstance(batches, ArrayBatches)
    pending: list[list] = []  # [t0, k, metrics, batches or None]
    last_eval: dict = {}
    stop: list[int] = []  # the first non-finite step under "stop", once seen
    halt: list[int] = []  # ... as on_records saw it (several processes: stop is seen at a flush)
    outbox: collections.deque = collections.deque()  # [t0, k, records, finite, stacked]
    in_callback = [False]  # on_records is running: an exception from it ends delivery

    def deliver(keep: int, check: bool = True) -> None:
        """Hands ``on_records`` the records of all but the newest ``keep`` dispatches, in order."""
        if len(outbox) > keep:  # one wait, for the newest of them: the older ones are done by then
            jax.block_until_ready(outbox[len(outbox) - keep - 1][2])
        while len(outbox) > keep:
            t0, k, records, finite, stacked = outbox.popleft()
            host, finite = jax.device_get((records, finite))
            finite = np.atleast_1d(finite)
            for i in range(k):
                if (stop and t0 + i > stop[0]) or (halt and t0 + i > halt[0]):  # after it: none
                    outbox.clear()
                    return
                in_callback[0] = True
                on_records(t0 + i, unpack[0]([b[i] for b in host] if stacked else host))
                in_callback[0] = False
                if nan_policy == "stop" and not finite[i]:  # the last step whose records go out
                    outbox.clear()
                    halt.append(t0 + i)
                    # raises NonFiniteError for this step; with several processes, at the next
                    # flush, which every process reaches at the same step
                    if check and not multi():
                        flush()
                    return

    def dispatch(stepper: Callable, batch: Any, k: int, stacked: bool, kept: Any) -> None:
        nonlocal state
        state, metrics = stepper(state, batch)
        records = metrics.pop("records", None)  # process 0 delivers them; the others drop them
        if on_records is not None:
            outbox.append([t, k, records, metrics["finite"], stacked])
        pending.append([t, k, metrics, kept])
        if on_records is not None:
            ready = 0  # the finished dispatches: handed over now, with no wait
            while ready < len(outbox) and all(b.is_ready() for b in outbox[ready][2]):
                ready += 1
            deliver(keep=len(outbox) - ready)
            limit = _outstanding(outbox[-1][2]) if outbox else 0
            if len(outbox) > limit:
                deliver(keep=limit // 2)

    refreshed = [time.perf_counter()]

    def prune() -> None:
        for entry in pending:
            if entry[3] is None:
                continue
            finite = entry[2]["finite"]
            if not finite.is_ready():
                return
            if bool(np.all(np.asarray(finite))):
                entry[3] = None
            else:
                return  # keep this one: it holds the first non-finite step's batch

    def flush() -> None:
        if not pending:
            return
        fetched = jax.device_get([{k: m[k] for k in ("loss", "finite")} for _, _, m, _ in pending])
        bad_batch = None
        for (t0, k, _, kept), metrics in zip(pending, fetched):
            losses = np.atleast_1d(metrics["loss"])
            finite = np.atleast_1d(metrics["finite"])
            for i in range(k):
                if stop:
                    break
                step = t0 + i
                history["step"].append(step)
                history["loss"].append(float(losses[i]))
                if on_metrics is not None:
                    on_metrics(step, {"train/loss": float(losses[i])})
                if nan_policy != "off" and not finite[i]:
                    history["nonfinite"].append(step)
                    if nan_policy == "stop":
                        stop.append(step)
                        bad_batch = kept[i] if kept is not None else None
                    elif primary():
                        _warn_nonfinite(step)
        pending.clear()
        show()
        refreshed[0] = time.perf_counter()
        if stop:
            _raise_nonfinite(stop[0], bad_batch)

    def show() -> None:
        if bar is not None:
            bar.update(t - bar.n)
            loss = {"loss": f"{history['loss'][-1]:.4g}"} if history["loss"] else {}
            bar.set_postfix({**loss, **last_eval}, refresh=True)

    def _warn_nonfinite(bad: int) -> None:
        warnings.warn(
            f"the loss or the gradients at step {bad} are not finite (NaN or Inf). Training continues "
            "(nan_policy='continue'); history['nonfinite'] lists every such step.",
            RuntimeWarning,
            stacklevel=4,
        )

    def _raise_nonfinite(bad: int, batch: Any) -> None:
        if isinstance(batches, ArrayBatches):
            batch = batches.batch(bad)
        where = None
        if batch is not None:
            # state is the state before step `bad` ("stop" leaves it unchanged from there on), so
            # its rng gives the key that step's loss received.
            kwargs = {"key": jax.random.split(state.rng)[1]} if _wants_key(loss_fn) else {}
            where = first_nonfinite(loss_fn, jax.device_get(state.params), batch, **kwargs)
        layer, field = where if where else (None, None)
        named = (
            f"; the first layer in backward order with a non-finite cotangent is {layer!r} ({field})"
            if layer
            else ""
        )
        err = NonFiniteError(
            f"the loss or the gradients at step {bad} are not finite (NaN or Inf){named}. Training "
            "stopped (nan_policy='stop'); err.state is the state before that step. Look at that "
            "layer's inputs (a log or division of a bad value?), lower the learning rate, or clip "
            "gradients."
        )
        err.step, err.layer, err.field, err.state, err.history = bad, layer, field, state, history
        raise err

    t = start
    it = batches.iterate(start)
    next_eval = (start // eval_every + 1) * eval_every if eval_every else None
    next_ckpt = (start // checkpoint_every + 1) * checkpoint_every if checkpoint_every else None
    last_log = start

    def evaluate() -> None:
        flush()
        result = eval_fn(state.params)
        history["eval"].append({"step": t, **result})
        if on_metrics is not None:
            on_metrics(t, {f"eval/{name}": float(v) for name, v in result.items()})
        last_eval.clear()
        last_eval.update({f"eval_{name}": f"{float(v):.4g}" for name, v in result.items()})
        show()

    try:
        while steps is None or t < steps:
            k = scan_steps if (scanned is not None and (steps is None or steps - t >= scan_steps)) else 1
            group = []
            for _ in range(k):
                batch = next(it, None)
                if batch is None:
                    break
                group.append(batch)
            if not group:
                break
            if len(group) == k and k > 1:
                dispatch(scanned, put(_stack(group), 1), k, True, group if keep_batches else None)
                t += k
            else:
                for batch in group:
                    dispatch(single, put(batch), 1, False, [batch] if keep_batches else None)
                    t += 1
            del group, batch
            if keep_batches:
                prune()
            if t - last_log >= log_every or (
                bar is not None and time.perf_counter() - refreshed[0] >= _REFRESH_SECONDS
            ):
                flush()
                last_log = t
            if next_eval is not None and t >= next_eval:
                evaluate()
                next_eval += eval_every
            if next_ckpt is not None and t >= next_ckpt:
                deliver(keep=0)  # a run resumed from this checkpoint delivers from step t on
                flush()
                checkpointer.save(t, state, {"step": t, "seed": seed})
                next_ckpt += checkpoint_every
        if on_records is not None:
            deliver(keep=0)
    except BaseException:
        if on_records is not None and not in_callback[0]:
            deliver(keep=0, check=False)  # the dispatched steps' records are not lost
        raise
    flush()
    if eval_fn is not None and (not history["eval"] or history["eval"][-1]["step"] != t):
        evaluate()
    if checkpointer is not None and t > start:
        checkpointer.save(t, state, {"step": t, "seed": seed})
    return state, history
