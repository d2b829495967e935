"""The training state: everything a step reads and writes, as one pytree.

Contract: ``TrainState`` holds only arrays (and optax/vjpkit NamedTuples and dicts of
arrays), so it can be jitted, donated, sharded and checkpointed whole. ``rng`` is a raw
``uint32[2]`` key (``jax.random.PRNGKey``) so checkpoints store it as plain data.
Every array leaf is strongly typed (``create`` copies drop weak types, and ``keep_types`` gives
a step's new state its old state's types), so a step's output has its input's types and the
jitted step compiles once. ``nonfinite_step`` is ``-1`` until a step's loss is NaN or Inf;
with ``nan_policy="stop"`` the step that sees it, and every step after it, leaves the state
unchanged.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class TrainState(NamedTuple):
    """The state of a training run.

    Attributes:
        params: the model parameters.
        opt_state: the optax optimizer state.
        hook_state: ``{call key: state}`` of stateful hooks (``{}`` when none keeps state).
        step: the number of steps taken (int32 scalar).
        rng: a ``uint32[2]`` PRNG key; each step splits it and passes a subkey to the loss as
            ``key=`` when the loss accepts one.
        nonfinite_step: the first step whose loss was not finite, or -1 (int32 scalar).

    Examples:
        >>> state = vk.train.TrainState.create(params, optax.sgd(0.1), seed=0)
        >>> int(state.step)
        0
    """

    params: Any
    opt_state: Any
    hook_state: Any
    step: jax.Array
    rng: jax.Array
    nonfinite_step: jax.Array

    @classmethod
    def create(cls, params: Any, optimizer: Any, *, hook_state: Any = None, seed: int = 0) -> TrainState:
        """A fresh state: copies of ``params`` and ``hook_state`` (the step donates the state, so the
        caller's arrays stay valid), ``optimizer.init(params)``, step 0, ``PRNGKey(seed)``."""
        # copies: the steps donate the state; strongly typed: a weakly typed leaf (optax.lbfgs's
        # initial state has some) would come back strong from the first step, and the jitted
        # step would compile a second time
        copy = lambda tree: jax.tree.map(lambda a: _strong(jnp.array(a, copy=True)), tree)
        params = copy(params)
        return cls(
            params=params,
            # copied too: an optimizer's init may put one array in two places (optax.lbfgs
            # does), and a buffer cannot be donated twice
            opt_state=copy(optimizer.init(params)),
            hook_state={} if hook_state is None else copy(hook_state),
            step=jnp.zeros((), jnp.int32),
            rng=jax.random.PRNGKey(seed),
            nonfinite_step=jnp.full((), -1, jnp.int32),
        )


def _weak(a: Any) -> bool:
    return bool(getattr(getattr(a, "aval", None), "weak_type", False))  # arrays and tracers


def _strong(a: Any) -> Any:
    return jax.lax.convert_element_type(a, a.dtype) if _weak(a) else a  # same dtype, not weak


def keep_types(new: Any, old: Any) -> Any:
    """``new`` with each leaf strongly typed where ``old``'s leaf of the same dtype is (a step's
    update may make a leaf weakly typed, from a Python constant); other leaves unchanged."""
    if jax.tree.structure(new) != jax.tree.structure(old):
        return new

    def keep(n, o):
        return _strong(n) if _weak(n) and not _weak(o) and n.dtype == o.dtype else n

    return jax.tree.map(keep, new, old)
