"""The layer call: ``call()`` and the ``vjpkit_layer`` primitive, one layer call in a program.

Contract: ``call`` is what every layer source runs (``vjpkit.nn`` layers, the Flax, NNX and
Equinox adapters); it is the only engine-facing name they import. Outside a vjpkit transform
it is exactly ``fn(params, *inputs, **kwargs)``; inside ``vk.jvp`` with hooks it is routed to
the active scope's own ``call`` (the custom_jvp rule); inside a reverse-mode transform it binds
the call as one ``vjpkit_layer`` equation whose parameters are

* ``jaxpr``: the layer's computation over flat operands ``(*hoisted, *leaves)``, where
  ``leaves`` flatten ``(params, inputs, array_kwargs)`` and ``hoisted`` are traced values the
  layer's function closed over (they get gradients but are not part of the record);
* ``name``: the layer's full path; ``tree``: the treedef of ``(params, inputs, array_kwargs)``;
  ``n_hoisted``; ``out_tree``: the treedef of the output; ``kind``: the call's kind
  (``_kinds``, wrapped in ``_trees.Static``; ``None`` inside when unknown).

The equation is what the engine (``_engine``) turns into a hooked rule. Anywhere else it is
plain JAX: its implementation and lowering evaluate ``jaxpr``; under ``vmap`` it stays one
equation over the batched operands (the record of a batched call is the batched record); under
``jvp`` (a plain ``jax.grad`` inside the loss) its primal stays marked and its tangent is the
plain JVP of ``jaxpr``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

from . import _compat, _context, _kinds
from ._trees import Static, split_kwargs


def site_primitive(name: str) -> jcore.Primitive:
    """A primitive with ``vjpkit_layer``'s parameters and rules (``jaxpr``, ``name``, ``tree``, ...).

    Plain JAX everywhere: its implementation and lowering evaluate ``jaxpr``; under ``vmap`` it
    stays one equation over the batched operands; under ``jvp`` its primal stays marked and its
    tangent is the plain JVP of ``jaxpr``. ``vjpkit_layer`` is one; the engine's plain-JAX
    matching (``_engine._match``) makes another, so that a matched span stays apart from an
    explicit layer call.
    """
    prim = jcore.Primitive(name)
    prim.multiple_results = True

    def impl(*args, jaxpr, **_):
        return jcore.jaxpr_as_fun(jaxpr)(*args)

    def abstract_eval(*args, jaxpr, **_):
        del args
        return jaxpr.out_avals, jaxpr.effects

    def batch(args, dims, *, jaxpr, **params):
        in_axes = [d if isinstance(d, int) else None for d in dims]  # not_mapped is None
        batched = jax.make_jaxpr(jax.vmap(jcore.jaxpr_as_fun(jaxpr), in_axes=in_axes, out_axes=0))(*args)
        outs = prim.bind(*args, jaxpr=batched, **params)
        return outs, [0] * len(outs)

    def jvp(primals, tangents, *, jaxpr, **params):
        outs = prim.bind(*primals, jaxpr=jaxpr, **params)
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        _, tangents_out = jax.jvp(jcore.jaxpr_as_fun(jaxpr), list(primals), tangents)
        return outs, tangents_out

    prim.def_impl(impl)
    prim.def_effectful_abstract_eval(abstract_eval)
    batching.primitive_batchers[prim] = batch
    ad.primitive_jvps[prim] = jvp
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=True))
    return prim


layer_p = site_primitive("vjpkit_layer")


def _hoist(closed: jcore.ClosedJaxpr) -> tuple[jcore.ClosedJaxpr, list]:
    """Moves the traced constants of ``closed`` to leading inputs; returns them."""
    lift = [isinstance(c, jax.core.Tracer) for c in closed.consts]
    if not any(lift):
        return closed, []
    j = closed.jaxpr
    keep_vars = [v for v, up in zip(j.constvars, lift) if not up]
    keep = [c for c, up in zip(closed.consts, lift) if not up]
    hoisted_vars = [v for v, up in zip(j.constvars, lift) if up]
    hoisted = [c for c, up in zip(closed.consts, lift) if up]
    info = j.debug_info
    if info is not None and info.arg_names is not None:
        info = info._replace(arg_names=(*(f"closed-over {i}" for i in range(len(hoisted))), *info.arg_names))
    new = _compat.open_jaxpr(keep_vars, [*hoisted_vars, *j.invars], j.outvars, j.eqns, j.effects, info)
    return _compat.closed_jaxpr(new, keep), hoisted


def call(fn: Callable, params: Any, inputs: tuple, kwargs: dict, default_name: str, kind: Any = None) -> Any:
    """Applies ``fn(params, *inputs, **kwargs)`` as the layer call ``default_name``.

    ``default_name`` is the name when no combinator or adapter has pushed one
    (``_context.name_scope``); ``kind`` is the call's ``_kinds`` kind when the source knows it.
    """
    scope = _context.current()
    if scope is None:
        return fn(params, *inputs, **kwargs)
    name = _context.layer_path(default_name)
    if scope is not _context.LAYERS:
        return scope.call(fn, name, params, inputs, kwargs)
    return bind(fn, name, params, inputs, kwargs, kind)


def bind(fn: Callable, name: str, params: Any, inputs: tuple, kwargs: dict, kind: Any = None) -> Any:
    """Traces ``fn(params, *inputs, **kwargs)`` and binds it as layer call ``name``."""
    dynamic, static = split_kwargs(kwargs)
    leaves, tree = jax.tree.flatten((params, tuple(inputs), dynamic))

    def flat(*leaves):
        p, xs, kw = jax.tree.unflatten(tree, leaves)
        return fn(p, *xs, **kw, **static)

    with _context.tracing(name), _kinds.noting(kind) as noted:
        closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*leaves)
    closed, hoisted = _hoist(closed)
    out_tree = jax.tree.structure(out_shape)
    # Staged even when every operand is concrete (an eager transform evaluates what does not
    # depend on the differentiated arguments at trace time): a frozen teacher's calls are layer
    # calls too, so their records exist.
    with _compat.no_eager_constant_folding():
        outs = _bind_layer(hoisted, leaves, closed, name, tree, out_tree, noted[0])
    return jax.tree.unflatten(out_tree, outs)


def _bind_layer(hoisted, leaves, closed, name, tree, out_tree, kind):
    return layer_p.bind(
        *hoisted,
        *leaves,
        jaxpr=closed,
        name=name,
        tree=tree,
        n_hoisted=len(hoisted),
        out_tree=out_tree,
        kind=Static(kind),
    )
