"""Hook protocols: ``HookTransform``, ``before`` and ``HookState`` (a leaf module, optax's ``base``).

Contract: the types every hook is made of, with no behaviour. A hook in a ``hooks={glob: ...}``
mapping is one of

* a plain function ``rec -> None | Cotangents``, run after the layer's own VJP;
* a ``HookTransform(init, update)``: ``init(params) -> state``, ``update(rec, state) -> (rec,
  state)``, the state threaded through steps by ``hook_state=``;
* either of those wrapped in ``before(...)``: run *before* the layer's own VJP, on a record with
  ``grad_output`` and the forward fields only; it may return ``rec.replace(grad_output=...)``;
* a *deferred* hook (``vk.on_host``, marked by ``deferred = True``): its records leave the
  backward pass in the step's one host transfer.

``HookState`` is the typed hook-state container. This module imports only ``_records``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax

from ._records import Cotangents


class HookTransform(NamedTuple):
    """A stateful hook, in optax's shape.

    Attributes:
        init: ``init(params) -> state``, called once per matching layer call with its params.
            State leaves must be floating point (keep counters as ``float32``).
        update: ``update(rec, state) -> (rec, state)``: return ``rec`` unchanged to observe, or
            ``rec.replace(grad_input=..., grad_params=...)`` to rewrite, and the next state.

    Examples:
        >>> def init(params):
        ...     return {"count": jnp.zeros(())}
        >>> def update(rec, state):
        ...     return rec, {"count": state["count"] + 1}
        >>> counter = vk.HookTransform(init, update)
    """

    init: Callable[[Any], Any]
    update: Callable[[Cotangents, Any], tuple[Cotangents, Any]]


class before:  # noqa: N801  (a hook wrapper, used like a function)
    """A backward pre-hook: runs before the layer's own VJP (PyTorch's ``register_full_backward_pre_hook``).

    The hook gets a record with ``grad_output`` and the forward fields (``input``, ``output``,
    ``params``); ``grad_input`` and ``grad_params`` are ``None`` because they are not computed
    yet. It may return ``rec.replace(grad_output=new)``: the layer's ``grad_input`` and
    ``grad_params`` are then computed from ``new``, and the hooks that run after the VJP see it.

    Args:
        hook: a plain hook ``rec -> None | Cotangents`` or a ``vk.HookTransform`` (its state is
            threaded as usual).

    Examples:
        >>> reverse = vk.before(lambda rec: rec.replace(grad_output=-rec.grad_output))
        >>> g = vk.grad(loss, hooks={"head": reverse})  # gradient reversal below "head"
    """

    def __init__(self, hook: Callable | HookTransform):
        if isinstance(hook, before):
            hook = hook.hook
        self.hook = hook

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, before) and other.hook == self.hook

    def __hash__(self) -> int:
        return hash(("vk.before", self.hook))

    def __repr__(self) -> str:
        return f"vk.before({self.hook!r})"


def factory(fn: Callable) -> Callable:
    """Marks ``fn`` as a hook factory (``vk.ema_normalize``): put in ``hooks=`` uncalled, it is an error."""
    fn.__vjpkit_factory__ = True
    return fn


def is_factory(obj: Any) -> bool:
    """A hook factory given where its product belongs: ``vk.ema_normalize``, or the class ``vk.on_host``."""
    return bool(getattr(obj, "__vjpkit_factory__", False)) or (
        isinstance(obj, type) and hasattr(obj, "deferred")
    )


class at_iteration:  # noqa: N801  (a hook wrapper)
    """A hook that runs on some iterations only of a layer called inside ``lax.scan``: made by a
    glob ending in ``[i]`` (``hooks={"blocks[2]": hook}``), never by hand.

    Attributes:
        hook: the hook (possibly ``vk.before(...)``); wanted: per enclosing scan, outermost
            first, the iteration index, or ``None`` for every iteration (``[*]``).
    """

    def __init__(self, hook: Any, wanted: tuple):
        self.hook = hook
        self.wanted = tuple(wanted)

    def wants(self, index: tuple) -> bool:
        """Whether the iteration ``index`` (one int per enclosing scan) is chosen."""
        return all(w is None or w == i for w, i in zip(self.wanted, index))

    def __getattr__(self, name: str) -> Any:  # a host hook's deferred, every, _deliver, ...
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.__dict__["hook"], name)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, at_iteration) and (other.hook, other.wanted) == (self.hook, self.wanted)

    def __hash__(self) -> int:
        return hash(("at_iteration", self.hook, self.wanted))

    def __repr__(self) -> str:
        index = "".join(f"[{'*' if w is None else w}]" for w in self.wanted)
        return f"{self.hook!r}{index}"


def inner(hook: Any) -> Any:
    """The hook itself, without ``before`` or iteration wrappers."""
    if isinstance(hook, at_iteration):
        hook = hook.hook
    return hook.hook if isinstance(hook, before) else hook


def is_before(hook: Any) -> bool:
    return isinstance(hook.hook if isinstance(hook, at_iteration) else hook, before)


def is_deferred(hook: Any) -> bool:
    """Whether ``hook`` is a host hook whose records leave in the step's one transfer."""
    return bool(getattr(hook, "deferred", False))


class HookState(Mapping):
    """Hook state across steps: ``state[key]`` is the state of layer call ``key``'s hooks.

    Attributes:
        layers: ``{call key: state}`` of the stateful hooks.
        host: ``{"capture[i]" or "on_host[j]": {"count": float32}}``: step counters of the
            host deliveries with ``every > 1`` (capture spec ``i``; the ``j``-th distinct
            ``vk.on_host`` hook), kept apart from the layers' states.

    Examples:
        >>> state = vk.init_hook_state(g, params, x, y)
        >>> sorted(state), state["fc2"].count
    """

    def __init__(self, layers: Mapping | None = None, host: Mapping | None = None):
        self.layers = dict(layers or {})
        self.host = dict(host or {})

    def __getitem__(self, key: str) -> Any:
        return self.layers[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __bool__(self) -> bool:
        return bool(self.layers) or bool(self.host)

    def __repr__(self) -> str:
        return f"HookState(layers={self.layers!r}, host={self.host!r})"


jax.tree_util.register_pytree_with_keys(
    HookState,
    lambda s: (
        ((jax.tree_util.GetAttrKey("layers"), s.layers), (jax.tree_util.GetAttrKey("host"), s.host)),
        None,
    ),
    lambda _, children: HookState(*children),
)
