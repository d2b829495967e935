"""``fit``: the jit-compiled training loop, with hooks, capture, hook state, checkpoints and a mesh.

Contract: ``fit`` validates everything (optimizer, data, batch, mesh, loss, checkpoint tree)
before anything is compiled, then runs ``steps`` steps of ``make_step``, ``scan_steps``
per dispatch (``lax.scan``). Metrics stay on the device and are fetched every ``log_every``
steps, so dispatch runs ahead of the host. The run is a pure function of ``(params, data,
seed)``: batch ``t`` depends only on ``t`` and the seed, and so a run resumed from a checkpoint
ends bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import collections
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from .._errors import ConfigError, NonFiniteError
from ..inspect._nonfinite import first_nonfinite
from ._data import ArrayBatches, check_batch, make_batches
from ._state import TrainState
from ._step import check_optimizer, init_hook_state, make_step


def _positive(name: str, value: Any, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"fit: {name} must be a positive int, got {value!r}.")


def _stack(batches: list) -> Any:
    return jax.tree.map(lambda *leaves: np.stack(leaves), *batches)


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
    scan_steps: int = 1,
    eval_fn: Callable | None = None,
    eval_every: int | None = None,
    on_records: Callable | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    mesh: Any = None,
    seed: int = 0,
    progress: bool | None = None,
    nan_policy: str = "stop",
    log_every: int = 50,
) -> tuple[TrainState, dict]:
    """Trains ``params`` on ``data`` with ``optimizer``; returns ``(state, history)``.

    Args:
        loss_fn: ``loss_fn(params, batch[, key=k]) -> scalar`` (``key`` is a fresh PRNG key
            each step when the loss declares it, e.g. for dropout).
        optimizer: an optax ``GradientTransformation``.
        params: the initial parameters.
        data: arrays (an array, or a tuple or dict of arrays sharing the leading axis; needs
            ``batch_size``, shuffled each epoch, the incomplete last batch dropped), or any
            iterable of batches (a list, a generator).
        batch_size: examples per step, for array data.
        steps: number of steps; or ``epochs`` for array data. An iterable runs until it ends.
        hooks: layer hooks (see ``vk.grad``); stateful ones are threaded in ``state.hook_state``.
        capture: capture spec(s) (see ``vk.capture``); each step's records go to ``on_records``.
        scan_steps: steps per dispatch; more than 1 runs them in one ``lax.scan``.
        eval_fn: ``eval_fn(params) -> dict of numbers``, called every ``eval_every`` steps.
        eval_every: steps between evaluations (and at the end).
        on_records: ``on_records(step, captured)`` with numpy records, for every step.
        checkpoint_dir: save there every ``checkpoint_every`` steps and at the end, and resume
            from the newest complete checkpoint found there.
        checkpoint_every: steps between checkpoints.
        mesh: a ``jax.sharding.Mesh`` with a ``"data"`` axis (see ``data_mesh``): batches are
            sharded over it and the state is replicated.
        seed: seeds the shuffling and ``state.rng``.
        progress: show a tqdm bar (default: when stderr is a terminal).
        nan_policy: ``"stop"`` raises ``vjpkit.NonFiniteError`` naming the step and the
            first layer with a non-finite cotangent; ``"continue"`` warns and goes on;
            ``"off"`` does not check.
        log_every: steps between fetches of the metrics (and progress updates).

    Returns:
        The final ``TrainState`` and ``history = {"step": [...], "loss": [...],
        "eval": [{"step": s, ...}], "nonfinite": [steps]}``.

    Examples:
        >>> state, history = vk.train.fit(loss_fn, optax.adam(1e-3), params, (x, y), batch_size=64, epochs=3)
    """
    check_optimizer(optimizer)
    for name, value in (
        ("steps", steps),
        ("epochs", epochs),
        ("eval_every", eval_every),
        ("checkpoint_every", checkpoint_every),
    ):
        _positive(name, value)
    _positive("scan_steps", scan_steps, allow_none=False)
    _positive("log_every", log_every, allow_none=False)
    if on_records is not None and capture is None:
        raise ConfigError("fit: on_records= receives captured records; pass capture= too.")
    if eval_every is not None and eval_fn is None:
        raise ConfigError("fit: eval_every= needs eval_fn=.")
    if checkpoint_every is not None and checkpoint_dir is None:
        raise ConfigError("fit: checkpoint_every= needs checkpoint_dir=.")
    batches = make_batches(data, batch_size, seed)
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

    first = next(batches.iterate(0), None)
    if first is None:
        raise ConfigError("fit: the data yielded no batch.")
    size = check_batch(first)
    if mesh is not None:
        from ._sharding import check_mesh, replicate, shard_batch

        check_mesh(mesh, size)
    hook_state = init_hook_state(loss_fn, hooks, capture, params, first)
    state = TrainState.create(params, optimizer, hook_state=hook_state, seed=seed)
    step_fn = make_step(loss_fn, optimizer, hooks=hooks, capture=capture, nan_policy=nan_policy, jit=False)
    jax.eval_shape(step_fn, state, first)  # every trace-time check, before any compile

    checkpointer = None
    if checkpoint_dir is not None:
        from ._checkpoint import Checkpointer

        checkpointer = Checkpointer(checkpoint_dir)
        if checkpointer.latest_step() is not None:
            state, _ = checkpointer.restore(state)
    start = int(state.step)
    if mesh is not None:
        state = replicate(state, mesh)
        put = lambda b, dim=0: shard_batch(b, mesh, batch_dim=dim)
    else:
        put = lambda b, dim=0: b

    single = jax.jit(step_fn, donate_argnums=0)
    multi = jax.jit(lambda s, bs: jax.lax.scan(step_fn, s, bs), donate_argnums=0) if scan_steps > 1 else None
    history: dict[str, list] = {"step": [], "loss": [], "eval": [], "nonfinite": []}
    recent: collections.deque = collections.deque(maxlen=log_every * scan_steps + scan_steps)
    if progress is None:
        progress = sys.stderr.isatty()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, initial=start, unit="step", dynamic_ncols=True)
    pending: list = []
    reported: set[int] = set()
    clock = [time.perf_counter(), start]

    def flush() -> None:
        if not pending:
            return
        fetched = jax.device_get([m for _, _, m, _ in pending])
        for (t0, k, _, stacked), metrics in zip(pending, fetched):
            losses = np.atleast_1d(metrics["loss"])
            for i in range(k):
                history["step"].append(t0 + i)
                history["loss"].append(float(losses[i]))
                if on_records is not None:
                    captured = metrics["captured"]
                    on_records(t0 + i, jax.tree.map(lambda a, i=i: a[i], captured) if stacked else captured)
        pending.clear()
        if bar is not None:
            now = time.perf_counter()
            rate = (t - clock[1]) / max(now - clock[0], 1e-9)
            clock[:] = [now, t]
            bar.update(t - bar.n)
            bar.set_postfix(loss=f"{history['loss'][-1]:.4g}", steps_per_s=f"{rate:.1f}")
        if nan_policy != "off":
            bad = int(state.nonfinite_step)
            if bad >= 0 and bad not in reported:
                reported.add(bad)
                _nonfinite(bad)

    def _nonfinite(bad: int) -> None:
        history["nonfinite"].append(bad)
        batch = batches.batch(bad) if isinstance(batches, ArrayBatches) else dict(recent).get(bad)
        where = None
        if nan_policy == "stop" and batch is not None:
            where = first_nonfinite(loss_fn, jax.device_get(state.params), batch)
        layer, field = where if where else (None, None)
        named = (
            f"; the first layer in backward order with a non-finite cotangent is {layer!r} ({field})"
            if layer
            else ""
        )
        message = f"the loss or the gradients at step {bad} are not finite (NaN or Inf){named}."
        if nan_policy == "continue":
            warnings.warn(
                message + " Training continues (nan_policy='continue').", RuntimeWarning, stacklevel=3
            )
            return
        err = NonFiniteError(
            message + " Training stopped (nan_policy='stop'); err.state is the state before that step. "
            "Look at that layer's inputs (a log or division of a bad value?), lower the learning "
            "rate, or clip gradients."
        )
        err.step, err.layer, err.field, err.state, err.history = bad, layer, field, state, history
        raise err

    t = start
    it = batches.iterate(start)
    next_eval = (start // eval_every + 1) * eval_every if eval_every else None
    next_ckpt = (start // checkpoint_every + 1) * checkpoint_every if checkpoint_every else None
    last_log = start
    try:
        while steps is None or t < steps:
            k = scan_steps if (multi is not None and (steps is None or steps - t >= scan_steps)) else 1
            group = []
            for _ in range(k):
                batch = next(it, None)
                if batch is None:
                    break
                recent.append((t + len(group), batch))
                group.append(batch)
            if not group:
                break
            if len(group) == k and k > 1:
                state, metrics = multi(state, put(_stack(group), 1))
                pending.append((t, k, metrics, True))
                t += k
            else:
                for batch in group:
                    state, metrics = single(state, put(batch))
                    pending.append((t, 1, metrics, False))
                    t += 1
            if t - last_log >= log_every:
                flush()
                last_log = t
            if next_eval is not None and t >= next_eval:
                flush()
                history["eval"].append({"step": t, **eval_fn(state.params)})
                next_eval += eval_every
            if next_ckpt is not None and t >= next_ckpt:
                flush()
                checkpointer.save(t, state, {"step": t, "seed": seed})
                next_ckpt += checkpoint_every
        flush()
        if eval_fn is not None and (not history["eval"] or history["eval"][-1]["step"] != t):
            history["eval"].append({"step": t, **eval_fn(state.params)})
        if checkpointer is not None and t > start:
            checkpointer.save(t, state, {"step": t, "seed": seed})
    finally:
        if bar is not None:
            bar.close()
    return state, history
