"""``vk.hookable``: Flax NNX and Equinox models whose submodule calls are vjpkit layer calls.

Contract: ``hookable(model)`` returns a model equivalent to ``model`` (the same object: the
module classes in it get a ``__call__`` that is a plain call outside vjpkit transforms), so its
pytree or graph structure, ``nnx.split``/``merge``, ``eqx.partition``/``combine``, ``jit``,
``vmap`` and serialisation are unchanged. Flax linen modules need no call (a vjpkit transform
intercepts them) and are returned as given. Without the framework installed, or for another
type, it raises ``ConfigError``.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from ._errors import ConfigError


def _installed(name: str) -> bool:
    return name in sys.modules or importlib.util.find_spec(name) is not None


def hookable(model: Any) -> Any:
    """Makes an Equinox or Flax NNX model's submodule calls hookable vjpkit layer calls.

    Inside ``vk.grad``, ``vk.value_and_grad``, ``vk.vjp``, ``vk.jvp``, ``vk.inspect`` and
    ``vk.train.fit``, each call of a submodule becomes a layer call named by its attribute path
    from the module that calls it: ``"fc1"``, ``"layers/0"``, ``"blocks/2/attn"``. The model
    itself, called from the loss, is a layer call named by its class (``"MLP"``). A record's
    ``params`` and ``grad_params`` are that submodule's parameters: an Equinox module of arrays
    (``rec.params.weight``), or NNX's nested dict (``rec.params["kernel"]``). Outside vjpkit
    transforms the model behaves exactly like the original; its tree structure is unchanged,
    so ``vk.grad`` returns gradients shaped like ``jax.grad``'s.

    Flax linen modules need no call: inside vjpkit transforms every linen module call is a
    layer call already, named by its Flax path (``"Dense_0"``, ``"Encoder_0/Dense_1"``).

    Args:
        model: an ``equinox.Module``, a ``flax.nnx.Module``, or a ``flax.linen.Module``.

    Returns:
        The model, hookable. The module classes it uses become hookable, which also applies to
        other instances of those classes.

    Raises:
        ConfigError: the framework is not installed (install the ``vjpkit[equinox]`` or
            ``vjpkit[flax]`` extra), or ``model`` is not a model of a supported framework.

    Examples:
        >>> model = vk.hookable(eqx.nn.MLP(3, 2, 16, 2, key=jax.random.key(0)))
        >>> params, static = eqx.partition(model, eqx.is_array)
        >>> loss = lambda p, x: jnp.sum(jax.vmap(eqx.combine(p, static))(x) ** 2)
        >>> grads = vk.grad(loss, hooks={"layers/*": vk.on_host(print)})(params, x)

        >>> model = vk.hookable(MyNNXModel(nnx.Rngs(0)))
        >>> graphdef, state = nnx.split(model)
        >>> loss = lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x) ** 2)
        >>> grads, captured = vk.grad(loss, capture="fc*")(state, x)
    """
    have_eqx, have_flax = _installed("equinox"), _installed("flax")
    if not (have_eqx or have_flax):
        raise ConfigError(
            f"vk.hookable: got a {type(model).__module__}.{type(model).__qualname__}, and neither "
            'Equinox nor Flax is installed. Install the extra: pip install "vjpkit[equinox]" or '
            'pip install "vjpkit[flax]".'
        )
    if have_eqx:
        import equinox as eqx

        if isinstance(model, eqx.Module):
            from ._foreign import _equinox

            return _equinox.make_hookable(model)
    if have_flax:
        from flax import nnx

        if isinstance(model, nnx.Module):
            from ._foreign import _nnx

            return _nnx.make_hookable(model)
        import flax.linen as linen

        if isinstance(model, linen.Module):
            return model
    missing = [
        f'pip install "vjpkit[{extra}]"'
        for extra, ok in (("equinox", have_eqx), ("flax", have_flax))
        if not ok
    ]
    hint = (
        f" If it is a model of a framework that is not installed: {' or '.join(missing)}." if missing else ""
    )
    raise ConfigError(
        f"vk.hookable: {type(model).__module__}.{type(model).__qualname__} is not a model vjpkit "
        "can make hookable. It takes an equinox.Module or a flax.nnx.Module (Flax linen modules "
        "need no call); for plain functions use vjpkit.nn.layer(fn, init)." + hint
    )
