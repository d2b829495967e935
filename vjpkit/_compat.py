"""JAX versions: every use of JAX internals and every version-dependent jaxpr parameter.

Contract: nothing else in vjpkit imports ``jax._src`` or reads a jaxpr parameter whose name or
meaning changed between the JAX releases vjpkit supports (jax/jaxlib 0.10.1 to 0.12.x, on
Python 3.11 to 3.13; ``pyproject.toml`` and ``docs/faq.md`` say which are tested). Each entry
names the JAX release and the change it follows. What JAX offers publicly is used as it is
(``jax.extend.core``, ``jax.tree_util``, ``jax.lax``); the private uses left are the ones JAX
has no public form of, each guarded so that a JAX without it degrades as documented.

Reviewed against JAX's CHANGELOG (0.10.0, 0.10.1, 0.10.2, 0.11.0) and, where the CHANGELOG is
silent (internal parameters are not in it) or ends (0.12), against the released wheels' own
sources (``jax/_src/lax/control_flow/loops.py``, ``jax/_src/core.py``, ``jax/extend/core``), for
what vjpkit walks or binds: scan, while, cond, jit/pjit, custom_jvp/custom_vjp, checkpoint,
shard_map, callbacks, effects and the ``jax.extend`` API:

* **scan** (jax 0.11.0): ``num_consts``/``num_carry`` became the flat-tree parameters
  ``ft_in = (consts, carry, xs)`` and ``ft_out = (carry, ys)`` (``jax._src.flattree``); the
  forwarded-``ys`` pruning makes ``ft_out``'s ``ys`` part a filtered tree, while the equation's
  outputs stay ``carry + kept ys``. ``scan_split`` reads either form. vjpkit re-binds scans only
  through the public ``lax.scan`` (``_engine/_rules.py``) or by replacing the body and keeping
  every other parameter (``_engine/_match.py``), so ``ft_in``/``ft_out`` stay JAX's.
* **ClosedJaxpr** (jax 0.12.0): ``ClosedJaxpr`` is an alias of ``Jaxpr``; a jaxpr carries its
  consts, ``jaxpr.jaxpr`` is itself, and ``constvars`` are the inputs with attached values (a
  ``Jaxpr(constvars, invars, ...)`` built without consts treats its ``constvars`` as leading
  plain inputs). ``ClosedJaxpr(jaxpr, consts)`` still attaches consts. vjpkit builds closed
  programs only with ``closed_jaxpr`` below, and reads ``closed.jaxpr`` / ``closed.consts``,
  which mean the same on both.
* **jax.core deprecations** (deprecated in 0.10.0, removed in 0.11.0): ``DebugInfo``,
  ``DropVar``, ``new_jaxpr_eqn``, ``jaxprs_in_params``, ``subjaxprs`` and
  ``unsafe_get_axis_names_DO_NOT_USE`` are read from ``jax.extend.core``, where 0.10 to 0.12
  all have them. ``join_effects`` has no public form: ``join_effects`` below unions the sets.
* **while** (``cond_nconsts``/``body_nconsts``/``cond_jaxpr``/``body_jaxpr``), **cond**
  (``branches``), **jit** (``jaxpr``; 0.11 adds ``inline``, which vjpkit passes through),
  **checkpoint** (``remat2``'s ``jaxpr``) and **custom_vjp_call** (``call_jaxpr``): unchanged
  from 0.10.1 to 0.12 (read in each release's jaxprs; ``tests/test_compat.py`` checks it).
* **callbacks**: ``mlir.emit_python_callback``'s keywords and ``_callback_op_sharding``'s
  signature are unchanged from 0.10.1 to 0.12; both are probed, and a JAX without them loses
  only the single-device placement of host callbacks under SPMD.
* **shard_map** (jax 0.11.0): the equation's ``manual_axes`` parameter became
  ``newly_manual_axes``; ``manual_axes`` below reads either. ``mesh``, ``in_specs``,
  ``out_specs``, ``check_vma`` and ``jaxpr`` (an open program) are unchanged, and vjpkit re-binds
  a shard_map only through the public ``jax.shard_map`` (``_engine/_rules.py``).
* **effects**: no change vjpkit depends on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from jax.extend import core as jcore


def scan_split(params: dict) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation's parameters.

    jax <= 0.10: ``num_consts`` and ``num_carry``. jax >= 0.11: the flat trees ``ft_in`` =
    ``(consts, carry, xs)`` (kfac-jax reads the same: ``len(g) for g in ft_in.unpack()``).

    >>> import jax, jax.numpy as jnp
    >>> jaxpr = jax.make_jaxpr(lambda c, w: jax.lax.scan(lambda c, x: (c * w, x), c, jnp.ones(3)))(1.0, 2.0)
    >>> scan_split([e for e in jaxpr.eqns if e.primitive.name == "scan"][0].params)
    (1, 1)
    """
    if "ft_in" in params:  # jax >= 0.11.0
        consts, carry, _ = params["ft_in"].unpack()
        return len(consts), len(carry)
    return params["num_consts"], params["num_carry"]


def manual_axes(params: dict) -> tuple:
    """The mesh axes a ``shard_map`` equation makes manual, in the mesh's order.

    jax <= 0.10: ``manual_axes``; jax >= 0.11: ``newly_manual_axes``.
    """
    axes = params["newly_manual_axes"] if "newly_manual_axes" in params else params["manual_axes"]
    return tuple(a for a in params["mesh"].axis_names if a in axes)


def closed_jaxpr(jaxpr: Any, consts: Sequence[Any]) -> Any:
    """The closed program of ``jaxpr`` with ``consts`` for its ``constvars`` (every JAX)."""
    return jcore.ClosedJaxpr(jaxpr, list(consts))


def open_jaxpr(constvars: Sequence, invars: Sequence, outvars: Sequence, eqns: Sequence, effects: Any,
               debug_info: Any) -> Any:  # fmt: skip
    """An open ``Jaxpr`` whose ``constvars`` get values later through ``closed_jaxpr``.

    jax 0.12.0 treats the ``constvars`` of a ``Jaxpr`` built without consts as plain leading
    inputs; attaching the consts with ``closed_jaxpr`` makes them constvars again, as on 0.10.
    """
    return jcore.Jaxpr(list(constvars), list(invars), list(outvars), list(eqns), effects, debug_info)


def join_effects(*effects: Any) -> Any:
    """The union of effect sets (``jax._src.core.join_effects``, which has no public form)."""
    return frozenset().union(*effects) if effects else frozenset()


def debug_info(traced_for: str, func_src_info: str) -> Any:
    """A ``DebugInfo`` for a program vjpkit builds (``jax.extend.core.DebugInfo``, 0.10+)."""
    return jcore.DebugInfo(traced_for, func_src_info, None, None)


def axis_names() -> list:
    """The named axes the current trace is under (``pmap``, ``shard_map``, a named ``vmap``).

    ``jax.extend.core.unsafe_get_axis_names_DO_NOT_USE`` (0.10 to 0.12); ``[]`` on a JAX
    without it (a host hook's ``every=N`` then counts per callback, not per device position).
    """
    get = getattr(jcore, "unsafe_get_axis_names_DO_NOT_USE", None)
    return [] if get is None else list(get())


@contextlib.contextmanager
def no_eager_constant_folding() -> Iterator[None]:
    """Stages an equation even when every operand is concrete (private ``eager_constant_folding``
    state, 0.10 to 0.12; a JAX without it folds as it likes, and nothing else changes)."""
    try:
        from jax._src import config as _jax_config  # private: no public context manager
    except ImportError:  # pragma: no cover - a JAX without the module
        yield
        return
    state = getattr(_jax_config, "eager_constant_folding", None)
    if state is None:  # pragma: no cover - a JAX without the flag
        yield
        return
    with state(False):
        yield


def callback_op_sharding() -> Any:
    """``jax._src.callback._callback_op_sharding`` (pure_callback's device placement under SPMD,
    signature ``(axis_context, sharding, avals_out)`` in 0.10 to 0.12), or ``None``."""
    try:
        from jax._src import callback as _jax_callback  # private: no public form
    except ImportError:  # pragma: no cover
        return None
    return getattr(_jax_callback, "_callback_op_sharding", None)
