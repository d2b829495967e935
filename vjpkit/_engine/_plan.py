"""The plan: every layer call of one traced program, named, with its hooks and slot shapes.

Contract: ``Plan(config, jaxpr, in_flags, handlers)`` walks a traced program once, computing
nothing; each equation is walked by its primitive's rule (``_rules``). It names every site
(``_site``: a span a site source recognises) in forward order (``name``, ``name#1``, ...) as
if inner ``jax.jit`` and ``jax.checkpoint`` bodies were inlined; the calls of one ``lax.cond``
restart from the same counts in each branch, so a layer in either branch has one key; a call
inside ``lax.scan`` or ``jax.shard_map`` has one record per iteration or shard (``Site.stack``). It
decides which calls are *active* (a hook or capture spec matches), and derives from the
program's types, per call: the record's shapes (``grad_input`` / ``grad_params`` leaves are
``None`` where no gradient can flow: a forward dataflow over the program), the hook state's
shapes and the probe's shapes (the handlers' ``slot`` parts). A layer called where the engine
cannot rewrite (inside a ``custom_jvp``/``custom_vjp`` function or a ``while`` loop) makes a
warning.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from .._errors import ConfigError
from .._hook_base import at_iteration
from .._records import Cotangents, call_key
from . import _site
from ._rules import At, Scanned, rule_for, sub_programs

__all__ = ["Plan", "Scanned", "Site"]


def _inexact(aval: Any) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def _sds(aval: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class Site:
    """One layer call of the traced program (static facts only).

    Attributes:
        key: ``name`` or ``name#k``; name, call: as in the record.
        path: where the equation sits (indices into nested programs).
        span: the call's ``_site.Span`` (name, computation, layout); ``layout`` and ``kind``
            are shortcuts to it.
        eqn: the equation the span was found at.
        hooks: the hooks matching ``name``; spec: the capture spec, or ``None``; host: the
            ``vk.on_host`` hooks among them, whose records leave in the step's one transfer.
        flags: per operand, whether it carries a gradient (``grad_input`` / ``grad_params``
            leaves are ``None`` where not).
        origins: per operand, the index of the program input it is (passed through calls
            unchanged), a ``Scanned`` under ``lax.scan`` (the input given to the enclosing
            scans, sliced or closed over by each), or ``None`` (computed, constant, carried,
            or inside a ``cond`` branch).
        loops: the paths of the enclosing scans and ``jax.shard_map`` s, outermost first.
        in_cond: inside a ``lax.cond`` branch.
        record: the record's fields as ``ShapeDtypeStruct`` trees (unstacked).
        state: the hook state's ``ShapeDtypeStruct`` tree, or ``None`` when stateless.
        slot: the probe's parts, ``{name: _carry.Part}`` (the handlers' own and the flags), or ``None``.
        stack: the sizes of the enclosing scans (lengths) and shard_maps (shards), outermost
            first: the leading axes of the call's probes and records; sharded: per entry,
            whether it is a shard_map. ``scans`` and ``shards`` are their two parts.
    """

    key: str
    name: str
    call: int
    path: tuple
    span: _site.Span
    eqn: Any
    hooks: tuple
    spec: Any
    host: tuple
    flags: tuple
    origins: tuple
    loops: tuple
    in_cond: bool
    record: Cotangents
    state: Any
    slot: Any
    stack: tuple = ()
    sharded: tuple = ()

    @property
    def gated(self) -> bool:
        """Whether a hook of the call runs on some scan iterations only (a glob ``name[i]``)."""
        return any(isinstance(h, at_iteration) for h in self.hooks)

    @property
    def scans(self) -> tuple:
        """The lengths of the enclosing ``lax.scan`` s, outermost first."""
        return tuple(n for n, s in zip(self.stack, self.sharded) if not s)

    @property
    def shards(self) -> tuple:
        """The shards of the enclosing ``jax.shard_map`` s, outermost first (their state axes)."""
        return tuple(n for n, s in zip(self.stack, self.sharded) if s)

    @property
    def active(self) -> bool:
        return bool(self.hooks) or self.slot is not None

    @property
    def carrier(self) -> str | None:
        """The states key of the call's "live" carrier: a captured call's pass-through value whose
        seeded cotangent makes its backward rule run even when the loss does not reach it
        (its record then has its forward values and zero cotangents); ``None`` when no probe part
        wants that record (``Part.unreached``: host hooks' records and the flags do not)."""
        wanted = self.slot is not None and any(p.unreached for p in self.slot.values())
        return f"{self.key}\x00live" if wanted else None

    @property
    def layout(self) -> _site.Layout:
        return self.span.layout

    @property
    def kind(self) -> Any:
        return self.span.layout.kind


def _is_site(eqn: Any) -> bool:
    return eqn.primitive in _site.SOURCES and _site.span_of(eqn) is not None


class Plan:
    """Every layer call of a traced program, named, with its hooks and slot shapes."""

    def __init__(self, config: Any, jaxpr: Any, in_flags: Sequence[bool], handlers: Any):
        self.config = config
        self.handlers = handlers
        self.sites: dict[tuple, Site] = {}
        self.by_key: dict[str, Site] = {}
        self.order: list[str] = []  # keys of every layer call, forward order
        self.busy: set[tuple] = set()  # paths that hold a layer call
        self.unreached: list[str] = []  # layer names inside programs the engine cannot rewrite
        self.counts: dict[str, int] = {}
        self._origins: list = []
        self.walk(jaxpr, list(in_flags), At(()), list(range(len(in_flags))))

    # -- queries
    def active(self) -> list[Site]:
        return [s for s in self.by_key.values() if s.active]

    def under(self, path: tuple, active: bool = True) -> list[Site]:
        """Sites (one per key; active ones by default) strictly inside the equation at ``path``."""
        index = self._index(active)
        return list(index.get(tuple(path), {}).values())

    def _index(self, active: bool) -> dict:
        cache = self.__dict__.setdefault("_indexes", {})
        if cache.get(active, (None, -1))[1] != len(self.sites):  # index every proper prefix once
            index: dict[tuple, dict[str, Site]] = {}
            for p, s in self.sites.items():
                if s.active or not active:
                    for k in range(len(p)):
                        index.setdefault(p[:k], {}).setdefault(s.key, s)
            cache[active] = (index, len(self.sites))
        return cache[active][0]

    def contains_calls(self, site: Site) -> bool:
        """Whether other layer calls run inside ``site`` (a parent module, a block)."""
        return bool(self.under(site.path, active=False))

    @property
    def names(self) -> list[str]:
        return [self.by_key[k].name for k in self.order] + self.unreached

    # -- the walk (the rules call back into walk, site and unreachable)
    def walk(self, jaxpr, flags, at: At, origins=None) -> list[bool]:
        env: dict[Any, bool] = dict(zip(jaxpr.invars, flags))
        origin = dict(zip(jaxpr.invars, origins or ()))

        def read(a):
            return False if isinstance(a, jcore.Literal) else env.get(a, False)

        for i, eqn in enumerate(jaxpr.eqns):
            ins = [read(a) for a in eqn.invars]
            self._origins = [None if isinstance(a, jcore.Literal) else origin.get(a) for a in eqn.invars]
            outs = rule_for(eqn, _is_site).plan(self, eqn, ins, at.to((*at.path, i)))
            for v, f in zip(eqn.outvars, outs):
                env[v] = bool(f) and _inexact(v.aval)
        return [read(v) for v in jaxpr.outvars]

    def origins_of(self, eqn: Any) -> list:
        """The program-input origins of the operands of the equation being walked."""
        del eqn
        return list(self._origins)

    def unreachable(self, eqn: Any) -> None:
        names = _layer_names_in(eqn.params)
        if not names:
            return
        self.unreached += names
        warnings.warn(
            f"vjpkit: layer call(s) {sorted(set(names))} run inside a '{eqn.primitive.name}' (a "
            "custom_jvp/custom_vjp function or a while loop, which vjpkit does not rewrite: they "
            "run as plain JAX and make no record. Call them outside it to hook them.)",
            stacklevel=2,
        )

    def site(self, eqn, ins, at: At) -> list[bool]:
        span = _site.span_of(eqn)
        inner = span.jaxpr.jaxpr
        orig = [None] * len(inner.invars) if at.in_cond else list(self._origins)
        if not at.register:
            return self.walk(inner, ins, at)
        name = span.name
        call = self.counts.get(name, 0)
        self.counts[name] = call + 1
        key = call_key(name, call)
        config = self.config
        hooks = config.hooks_for(name, call)
        spec = config.capture_for(name, call)
        record = _record_avals(span.layout, eqn, ins, name, call)
        lengths = tuple(n for _, n in at.scans)
        _check_iterations(config, key, lengths, hooks, spec.iterations(name, call) if spec else None)
        host = tuple(h for h in hooks if getattr(h, "deferred", False))
        state = self.handlers.state(hooks, record, key)
        slot = self.handlers.slot(name, call, record, spec, host)
        stack, sharded = tuple(n for _, n, _ in at.stack), tuple(s for _, _, s in at.stack)
        if state is not None and any(sharded):  # each shard keeps its own state
            shards = tuple(n for n, s in zip(stack, sharded) if s)
            state = jax.tree.map(lambda a: jax.ShapeDtypeStruct((*shards, *a.shape), a.dtype), state)
        loops = tuple(q for q, _, _ in at.stack)
        p = at.path
        site = Site(
            key, name, call, p, span, eqn, hooks, spec, host, tuple(ins), tuple(orig), loops,
            at.in_cond, record, state, slot, stack, sharded
        )  # fmt: skip
        if key in self.by_key:  # the same call in another branch of a lax.cond
            other = self.by_key[key]
            same = jax.tree.structure((other.slot, other.state)) == jax.tree.structure((slot, state))
            if not same or jax.tree.leaves((other.slot, other.state)) != jax.tree.leaves((slot, state)):
                raise ConfigError(
                    f"{config.transform}: layer call {key!r} appears in two lax.cond branches with "
                    f"different record shapes ({other.record!r} and {record!r}). Give the layers "
                    "in the two branches different names."
                )
        else:
            self.by_key[key] = site
            self.order.append(key)
        self.sites[p] = site
        self.busy.update(p[:k] for k in range(len(p) + 1))  # every layer call is rewritten or inlined
        return self.walk(inner, ins, at, orig)


def _check_iterations(config: Any, key: str, lengths: tuple, hooks: tuple, kept: list | None) -> None:
    """A ``ConfigError`` when a glob's ``[i]`` does not fit the scans around call ``key``."""
    wanted = [h.wanted for h in hooks if isinstance(h, at_iteration)] + list(kept or ())
    for w in wanted:
        index = "".join(f"[{'*' if i is None else i}]" for i in w)
        if not lengths:
            raise ConfigError(
                f"{config.transform}: a hook or capture glob chooses iteration {index} of layer call "
                f"{key!r}, which is not called inside lax.scan (one record per call). Drop the {index}."
            )
        if len(w) != len(lengths) or any(i is not None and not 0 <= i < n for i, n in zip(w, lengths)):
            runs = " x ".join(map(str, lengths))
            raise ConfigError(
                f"{config.transform}: a hook or capture glob chooses iteration {index} of layer call "
                f"{key!r}, which runs inside {len(lengths)} lax.scan(s) of {runs} iterations: give one "
                f"index per scan, outermost first, each below its length ({key}"
                + "".join(f"[0..{n - 1}]" for n in lengths)
                + ", or [*] for every iteration)."
            )


def _record_avals(layout: _site.Layout, eqn: Any, flags: Sequence[bool], name: str, call: int) -> Cotangents:
    ops = [_sds(v.aval) for v in eqn.invars]
    outs = [_sds(v.aval) for v in eqn.outvars]
    grads = [a if f and _inexact(a) else None for a, f in zip(ops, flags)]
    return _site.record(layout, name, call, ops, outs, outs, grads)


def _layer_names_in(params: dict) -> list[str]:
    """Names of the layer calls inside the programs held by an equation's ``params``."""
    names = []
    for jaxpr in sub_programs(params):
        for eqn in jaxpr.eqns:
            span = _site.span_of(eqn)
            if span is not None:
                names.append(span.name)
            names += _layer_names_in(eqn.params)
    return names
