"""Every record reaches the host exactly once and in step order, for each delivery path.

Paths: ``fit(on_records=...)`` (records as step outputs, handed over between dispatches, with and
without ``scan_steps``), per-layer ``vk.on_host`` hooks in ``fit`` and in a user's jitted loop
(``every=1`` and ``every=N`` decided in the graph), and capture host deliveries. Each over
1,000 steps, on an early stop (``NonFiniteError``), on an exception from the data, and on a run
resumed from a checkpoint.

Batch ``t`` is ``x = t`` everywhere, so the record a step delivers names its step: the mean of
layer ``fc``'s input. A NaN target at step ``BAD`` makes that step non-finite.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import vjpkit as vk
from tests.helpers import tree_allclose
from vjpkit import nn

STEPS, BAD = 1000, 600
MODEL = nn.serial(fc=nn.dense(2))


def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((MODEL.apply(params, x) - y) ** 2)


def batches(steps=STEPS, bad=None, fail_at=None):
    """Batch ``t``: ``x = t`` and a zero target (NaN at step ``bad``); raises at ``fail_at``."""
    for t in range(steps):
        if t == fail_at:
            raise RuntimeError(f"the data source failed at step {t}")
        y = np.zeros((4, 2), np.float32)
        if t == bad:
            y[0, 0] = np.nan
        yield np.full((4, 3), t, np.float32), y


PARAMS = MODEL.init(jax.random.key(0), np.zeros((4, 3), np.float32))
OPT = optax.sgd(0.0)  # the params stay put: every step's loss is finite except BAD's
INPUT_MEAN = vk.capture("fc", fields=["input"], reduce="mean")


def input_step(rec) -> int:
    """The step a record belongs to (its ``fc`` input is that step's ``x``)."""
    value = float(np.mean(rec.input))
    assert value == int(value), value
    return int(value)


def run(kind, data, seen, every=1, **kwargs):
    """``fit`` with one delivery path, appending what the host receives to ``seen``."""
    if kind == "on_records":
        kwargs.update(capture=INPUT_MEAN, on_records=lambda s, c: seen.append((s, input_step(c["fc"]))))
    elif kind == "on_host":
        kwargs.update(hooks={"fc": vk.on_host(lambda rec: seen.append(input_step(rec)), every=every)})
    else:  # capture_host
        host = vk.on_host(lambda c: seen.append(input_step(c["fc"])), every=every)
        kwargs.update(capture=vk.capture("fc", fields=["input"], reduce="mean", host=host))
    result = vk.train.fit(loss_fn, OPT, PARAMS, data, progress=False, **kwargs)
    return jax.block_until_ready(result)


def expected(kind, steps, every=1):
    """What the host should receive over ``steps`` (``every`` counts from the run's first step)."""
    kept = [s for s in steps if (s - steps[0]) % every == 0]
    return [(s, s) for s in kept] if kind == "on_records" else kept


PATHS = [("on_records", 1), ("on_host", 1), ("on_host", 7), ("capture_host", 1), ("capture_host", 5)]


@pytest.mark.parametrize("kind, every", PATHS)
@pytest.mark.parametrize("scan_steps", [1, 8])
def test_every_record_once_in_order(kind, every, scan_steps):
    seen = []
    state, history = run(kind, batches(), seen, every, scan_steps=scan_steps)
    assert seen == expected(kind, range(STEPS), every)
    assert history["step"] == list(range(STEPS))
    if every > 1:  # fit threads the hook state: the step counter advanced in the graph
        (counter,) = state.hook_state.host.values()
        assert float(counter["count"]) == STEPS


@pytest.mark.parametrize("whole", [False, True], ids=["mean", "whole-arrays"])
def test_on_records_runs_during_the_run_with_bounded_pending_steps(whole, monkeypatch):
    """``on_records`` is called between dispatches, not only at the end, and the records of at
    most ``_outstanding`` steps wait on the device (fewer when each step's records are large)."""
    from vjpkit.train import _fit

    if whole:  # each step's record is fc's whole (4, 3) float32 input: allow 3 steps of them
        monkeypatch.setattr(_fit, "_MAX_PENDING_BYTES", 3 * 4 * 3 * 4)
    limit = 3 if whole else _fit._MAX_PENDING
    drawn, lags = [0], []

    def data():
        for batch in batches():
            drawn[0] += 1
            yield batch

    def on_records(step, captured):
        assert input_step(captured["fc"]) == step
        lags.append(drawn[0] - step)  # batches handed to the loop, minus the delivered step

    spec = vk.capture("fc", fields=["input"], reduce=None) if whole else INPUT_MEAN
    vk.train.fit(
        loss_fn, OPT, PARAMS, data(), capture=spec, on_records=on_records, log_every=10_000, progress=False
    )
    assert len(lags) == STEPS
    # delivered while the loop runs: when step s arrives, at most `limit` + 2 batches were drawn
    # after it (the loop draws a batch before it dispatches and delivers)
    assert max(lags) <= limit + 2, max(lags)


@pytest.mark.parametrize("kind, every", PATHS)
def test_early_stop_delivers_up_to_the_nonfinite_step(kind, every):
    seen = []
    with pytest.raises(vk.NonFiniteError) as err:
        run(kind, batches(bad=BAD), seen, every)
    assert err.value.step == BAD
    # the non-finite step's own records arrive (they show the NaNs); the steps dispatched after
    # it change nothing and send nothing
    assert seen == expected(kind, range(BAD + 1), every)


@pytest.mark.parametrize("kind, every", PATHS)
def test_exception_then_resumed_run(kind, every, tmp_path):
    """A run that dies on a data error loses none of its dispatched steps' records; resumed
    from its last checkpoint, the next run delivers every step from there, once, in order."""
    first, resumed = [], []
    with pytest.raises(RuntimeError, match="failed at step 450"):
        run(kind, batches(fail_at=450), first, every, checkpoint_dir=str(tmp_path), checkpoint_every=100)
    assert first == expected(kind, range(450), every)
    state, history = run(kind, batches(), resumed, every, checkpoint_dir=str(tmp_path))
    assert history["step"][0] == 400 and int(state.step) == STEPS
    if every > 1:  # the counter was saved with the checkpoint: the cadence goes on from step 400
        assert resumed == expected(kind, range(STEPS), every)[-len(resumed) :]
        assert resumed[0] == min(s for s in range(400, STEPS) if s % every == 0)
    else:
        assert resumed == expected(kind, range(400, STEPS))


def test_user_jit_loop_every_n_in_graph():
    """``vk.on_host(every=N)`` in a user's jitted loop with ``hook_state``: one transfer per Nth
    step, decided in the graph (the counter is in the hook state), in order."""
    seen = []
    g = vk.grad(loss_fn, hooks={"fc": vk.on_host(lambda rec: seen.append(input_step(rec)), every=9)})
    step = jax.jit(lambda p, b, s: g(p, b, hook_state=s))
    state = vk.init_hook_state(g, PARAMS, next(batches()))
    for batch in batches():
        grads, state = step(PARAMS, batch, state)
    jax.block_until_ready((grads, state))
    assert seen == list(range(0, STEPS, 9))
    assert float(state.host["on_host[0]"]["count"]) == STEPS


def test_user_jit_loop_without_hook_state_counts_on_the_host():
    """Without ``hook_state`` the same cadence holds (counted on the host, every step transfers)."""
    seen = []
    g = jax.jit(vk.grad(loss_fn, hooks={"fc": vk.on_host(lambda rec: seen.append(input_step(rec)), every=9)}))
    out = [g(PARAMS, batch) for batch in batches(100)]
    jax.block_until_ready(out)
    assert seen == list(range(0, 100, 9))


def test_every_n_counted_on_the_host_counts_steps_per_example_under_vmap():
    """Under ``vmap`` of the transform each example makes its own host callback per step; without
    ``hook_state`` each example counts its own steps (as a batched hook state would), so every
    example delivers on steps 1 and 3, never a callback count that strides over the examples."""
    seen = []
    g = vk.grad(loss_fn, hooks={"fc": vk.on_host(lambda rec: seen.append(input_step(rec)), every=2)})
    step = jax.jit(jax.vmap(g, (None, (0, None))))
    y = np.zeros((4, 2), np.float32)
    for t in range(4):  # example k of step t has x = 10 t + k
        xs = np.stack([np.full((4, 3), 10 * t + k, np.float32) for k in range(3)])
        jax.block_until_ready(step(PARAMS, (xs, y)))
    assert seen == [0, 1, 2, 20, 21, 22]


@pytest.mark.parametrize("direct", [True, False], ids=["host_call", "pure_callback_fallback"])
def test_both_transports_deliver_in_order_under_vmap_and_grad_of_grad(direct, monkeypatch):
    """The private ``host_call`` primitive and its ``jax.pure_callback`` fallback agree: in order,
    once per example under ``vmap``, and inside ``jax.grad`` of a hooked gradient."""
    from vjpkit import _callback

    monkeypatch.setattr(_callback, "DIRECT", direct)
    seen = []
    g = vk.grad(loss_fn, hooks={"fc": vk.on_host(lambda rec: seen.append(input_step(rec)))})
    data = list(batches(20))
    jax.block_until_ready([jax.jit(g)(PARAMS, b) for b in data])
    assert seen == list(range(20))
    seen.clear()
    xs = np.stack([b[0] for b in data[:5]])
    jax.block_until_ready(jax.jit(jax.vmap(g, (None, (0, None))))(PARAMS, (xs, data[0][1])))
    assert seen == list(range(5))
    seen.clear()
    outer = jax.jit(jax.grad(lambda p, b: optax.tree.norm(g(p, b))))
    ref = jax.grad(lambda p, b: optax.tree.norm(jax.grad(loss_fn)(p, b)))(PARAMS, data[3])
    tree_allclose(outer(PARAMS, data[3]), ref, rtol=1e-5)
    assert seen == [3]


def test_hook_state_made_for_other_hooks_names_the_missing_counter():
    """A threaded hook state without this hook's step counter is rejected, naming the hook and key."""
    g = vk.grad(loss_fn, hooks={"fc": vk.on_host(lambda rec: None, every=3)})
    spec = vk.capture("fc", fields=["input"], reduce="mean", host=vk.on_host(lambda c: None, every=2))
    other = vk.init_hook_state(vk.grad(loss_fn, capture=spec), PARAMS, next(batches()))
    with pytest.raises(vk.ConfigError, match=r"no step counter for on_host\(.*every=3\).*'on_host\[0\]'"):
        g(PARAMS, next(batches()), hook_state=other)
