"""Plain-JAX matching: the layers of a traced program found by dataflow, named by parameter path.

Contract: ``rewrite(closed, paths) -> (closed, other_uses)`` returns the program with every
matched layer use of a parameter replaced by one ``vjpkit_matched`` equation, a second site
source beside ``vjpkit_layer`` (``SOURCES[match_p]``): the engine plans, names, hooks and
captures it as any layer call, and the custom_vjp rule is unchanged. ``paths[i]`` is the
``/``-joined path of the program's ``i``-th input, a leaf of the differentiated arguments.

Each value of the program gets a class: *C* (depends on no input: literals, ``iota``, a loop
counter), *K* (a concrete array closed over, or computed from one: data or a constant, which
an eager trace does not tell apart), *P* (a parameter computation: depends on parameter leaves
and on nothing else but C and K values) or *D* (data: anything else, the traced arguments and
every layer output). A *layer* is an equation with a P operand (the weight) and a non-literal
C, K or D operand (the input):

* ``dot_general`` and ``conv_general_dilated``, with a bias ``add`` of a plain parameter that
  follows it directly (through a ``transpose``, as a vmapped ``W @ x + b`` traces); an
  embedding's following ``add`` (``table[ids] + pos``) is a layer of its own;
* ``gather`` of a P table at C, K or D indices (an embedding);
* ``mul`` / ``add`` of a D or K value by a *plain* parameter (a leaf up to reshapes, casts,
  broadcasts and slices): a norm's affine scale, then shift.

The span of a layer is its equation with the whole computation of its P operands from the
parameter leaves (a cast, a transpose, LoRA's ``W + A @ B``); the span's params are the leaves
it reads, keyed by their path. Its name is the longest common path of those leaves, or the
weight's own path when they share none (flat ``{"w1", "b1"}``); params are keyed relative to
the name, or by their full path when the name is the weight's own. A span of one leaf in a
module is named by the module (``{"fc": {"w": W}}``: ``fc`` with params ``{"w"}``, as Flax's
``Dense_0/kernel`` is ``Dense_0``), unless another layer with other params would have that name
(``fc/w`` and ``fc/v`` used apart, ``layers/0`` and ``layers/1``): then it keeps the leaf's path.
Walked into ``lax.scan`` (a stacked leaf passed as ``xs`` is a plain parameter per iteration),
``lax.cond`` branches, inner ``jax.jit``, ``jax.checkpoint`` and ``jax.shard_map`` bodies (a
leaf replicated into a shard_map, ``in_specs`` ``P()``, is the leaf in every shard; one split
over the shards is a copy); explicit layer calls (``vjpkit_layer``) are
left to their source. A leaf enters a nested program as a leaf only as it is (a scan's carry
only when the body returns it unchanged): a parameter computation made outside the nested
program (``W.T``, a cast, ``W[i]``, LoRA's sum) or changed in a carry is a *copy* there, never a
layer's weight, as its record would hold the copy's gradient under the leaf's path. A
parameter computation that reaches D other than through a layer (weight decay in the loss, a
``custom_vjp`` function, an output, a copy's use with data) is an *other use*, listed with the
leaves it reads, so that records plus other uses account for every gradient.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend import core as jcore

from .. import _compat
from .._kinds import LayerKind
from .._primitive import layer_p, site_primitive
from .._trees import Static
from . import _site
from ._rules import nested, with_programs

match_p = site_primitive("vjpkit_matched")
_site.SOURCES[match_p] = _site.layer_span

D = "data"  # the class of data values; C (no dependence) is None
K = "concrete"  # a concrete value closed over: data or a constant (an eager trace computes both)


class P(NamedTuple):
    """The class of a parameter computation: the leaves it reads; ``plain``: the leaf it is, up
    to reshapes, casts, broadcasts and slices, or ``None``; ``copy``: computed from a value that
    entered this nested program other than as a leaf itself (``W.T``, a cast, a slice, LoRA's
    sum made outside, a weight changed in a scan's carry), so never a layer's weight here."""

    leaves: frozenset
    plain: int | None
    copy: bool = False


class OtherUse(NamedTuple):
    """A parameter computation that reaches data other than through a matched layer."""

    leaves: tuple[str, ...]  # the paths of the leaves it reads
    primitive: str  # the equation that uses it ("output": returned by the function)
    where: str  # "" at the top level, else the enclosing primitives ("scan/cond")


_TRANSPARENT = frozenset(
    {"convert_element_type", "reshape", "transpose", "broadcast_in_dim", "squeeze", "copy", "copy_p",
     "slice", "dynamic_slice", "reduce_precision", "pvary"}
)  # fmt: skip
_LAYERS = frozenset({"dot_general", "conv_general_dilated", "gather"})
_AFFINE = frozenset({"mul", "add"})
_BIASED = frozenset({"dot_general", "conv_general_dilated", "mul"})  # a bias add joins these
_CALL_NAMES = {"pjit": "jit", "remat2": "checkpoint"}  # as an other use's ``where`` says them
# (id(program), classes, leaf paths, where) -> (program, rewritten, out classes, other uses)
_CALL_CACHE: dict = {}


def _join(classes: Sequence, transparent: bool = False) -> Any:
    if any(c is D for c in classes):
        return D
    ps = [c for c in classes if isinstance(c, P)]
    if not ps:
        return K if any(c is K for c in classes) else None
    leaves = frozenset().union(*(p.leaves for p in ps))
    copy = any(p.copy for p in ps)
    return P(leaves, ps[0].plain if transparent and len(ps) == 1 and not copy else None, copy)


def _copy(c: Any) -> Any:
    """``c`` as the class of a parameter computation made outside the program it is used in."""
    return P(c.leaves, None, True) if isinstance(c, P) else c


def _outer(c: Any) -> Any:
    """A nested program's output class as its caller sees it: a copy there is computed by the
    nested equation, which a span can hold whole."""
    return P(c.leaves, c.plain) if isinstance(c, P) and c.copy else c


def _is_lit(a: Any) -> bool:
    return isinstance(a, jcore.Literal)


@dataclasses.dataclass
class _Matcher:
    paths: Sequence[str]
    other: list = dataclasses.field(default_factory=list)
    long: frozenset = frozenset()  # module names single-weight spans must not take (collisions)
    named: list = dataclasses.field(default_factory=list)  # (name, leaf keys, named by its module)

    # -- one program: classify every value (recursing into nested programs), then rewrite
    def walk(self, jaxpr: Any, in_cls: Sequence, const_cls: Sequence, where: str, rewrite: bool):
        env: dict[Any, Any] = {}
        env.update(zip(jaxpr.constvars, const_cls))
        env.update(zip(jaxpr.invars, in_cls))
        # the inputs that are parameter leaves as they are (the top level's, or passed into this
        # nested program as they are): only these enter a nested program as leaves
        leaves = {v for v, c in env.items() if isinstance(c, P) and c.plain is not None}

        def cls(a):
            return None if _is_lit(a) else env.get(a)

        eqns = list(jaxpr.eqns)
        new_eqns: list = list(eqns)
        layers: list[int] = []
        for i, eqn in enumerate(eqns):
            ins = [cls(a) for a in eqn.invars]
            outs, replaced = self.classify(eqn, ins, where, rewrite, leaves)
            if replaced is not None:
                new_eqns[i] = replaced
            if outs == "layer":
                layers.append(i)
                outs = [D] * len(eqn.outvars)
            env.update(zip(eqn.outvars, outs))
        out_cls = [cls(v) for v in jaxpr.outvars]
        if not rewrite:
            return jaxpr, out_cls
        for c in out_cls:
            if isinstance(c, P) and not where:  # returned by the function
                self.other_use(c, "output", where)
        if layers:
            new_eqns = _live(self.spans(jaxpr, eqns, new_eqns, layers, cls, where), jaxpr.outvars)
            jaxpr = jaxpr.replace(eqns=new_eqns)
        elif any(a is not b for a, b in zip(new_eqns, eqns)):
            jaxpr = jaxpr.replace(eqns=new_eqns)
        return jaxpr, out_cls

    def other_use(self, c: P, primitive: str, where: str) -> None:
        self.other_use_exact(OtherUse(tuple(sorted(self.paths[k] for k in c.leaves)), primitive, where))

    def other_use_exact(self, use: OtherUse) -> None:
        if use not in self.other:
            self.other.append(use)

    def classify(self, eqn: Any, ins: list, where: str, rewrite: bool, leaves: set) -> tuple[Any, Any]:
        """``(out classes or "layer", replacement equation or None)``. ``leaves``: this program's
        variables that are parameter leaves as they are."""
        name = eqn.primitive.name
        if eqn.primitive is layer_p or eqn.primitive is match_p:  # left to its source
            return [D] * len(eqn.outvars), None
        nest = [n for n in nested(eqn) if n.kind in ("call", "scan", "branch")]  # walked here
        if nest:
            # a parameter computation made here (W.T, a cast, W[i], LoRA's sum) is a copy inside
            # the nested program: its record there would hold the copy's gradient under the
            # leaf's path. Its uses there with data are other uses; its uses here, as the nested
            # equation's outputs, are matched here (a span holds the nested equation whole)
            ins = [c if _is_lit(a) or a in leaves else _copy(c) for a, c in zip(eqn.invars, ins)]
            # a leaf split over a shard_map's shards is a slice of it in each: a copy
            parts = {i for n in nest for i, r in zip(n.ins, n.roles) if r == "p"}
            ins = [_copy(c) if i in parts else c for i, c in enumerate(ins)]
            if nest[0].kind == "scan":
                leaf = [not _is_lit(a) and a in leaves for a in eqn.invars]
                return self.scan(eqn, nest[0], ins, where, rewrite, leaf)
            if nest[0].kind == "branch":
                return self.cond(eqn, nest, ins, where, rewrite)
            return self.call(eqn, nest[0], ins, where, rewrite)
        if _layer_roles(eqn, ins) is not None:
            return "layer", None
        out = _join(ins, transparent=name in _TRANSPARENT)
        if out is D and rewrite:
            for c in ins:
                if isinstance(c, P):
                    self.other_use(c, name, where)
        return [out] * len(eqn.outvars), None

    def call(self, eqn, nest, ins, where, rewrite):
        inner = nest.program
        ins = nest.operands(ins, "=cp")
        # JAX reuses an inner jit's program across traces: so does the rewrite, which keeps the
        # eager engine's compiled-call cache (keyed by the program's identity) warm
        here = _CALL_NAMES.get(eqn.primitive.name, eqn.primitive.name)
        here = f"{where}/{here}" if where else here
        memo = (
            id(inner),
            tuple(ins),
            tuple(self.paths[k] for c in ins if isinstance(c, P) for k in c.leaves),
            here,
        )
        memo = (*memo, self.long)  # the names of the spans inside depend on it
        hit = _CALL_CACHE.get(memo) if rewrite else None
        if hit is not None and hit[0] is inner:
            _, value, outs, other, named = hit
            for use in other:
                self.other_use_exact(use)
            self.named += named
        else:
            # a closed program keeps its consts (jax 0.12: ClosedJaxpr is Jaxpr, with its consts)
            closed = isinstance(inner, jcore.ClosedJaxpr) and (inner.jaxpr is not inner or bool(inner.consts))
            jaxpr = inner.jaxpr if closed else inner
            before, named_before = len(self.other), len(self.named)
            new, outs = self.walk(jaxpr, ins, [None] * len(jaxpr.constvars), here, rewrite)
            outs = [_outer(c) for c in outs]
            value = inner if new is jaxpr else _compat.closed_jaxpr(new, inner.consts) if closed else new
            if rewrite:
                if len(_CALL_CACHE) >= 256:
                    _CALL_CACHE.pop(next(iter(_CALL_CACHE)))
                _CALL_CACHE[memo] = (inner, value, outs, self.other[before:], self.named[named_before:])
        new_eqn = with_programs(eqn, {nest: value})
        return outs, (None if new_eqn is eqn else new_eqn)

    def scan(self, eqn, nest, ins, where, rewrite, leaf: list[bool]):
        body = nest.program
        ins = [ins[i] for i in nest.ins]
        leaf = [leaf[i] for i in nest.ins]
        roles = nest.roles
        # a carry is the leaf in every iteration only when it enters as the leaf and the body
        # returns it unchanged; any other parameter carry (``w * 0.99``) is a copy in the body
        carried = [k for k, r in enumerate(roles) if r == "r"]
        kept = {k: leaf[k] and body.jaxpr.outvars[j] is body.jaxpr.invars[k] for j, k in enumerate(carried)}
        ins = [c if roles[k] != "r" or kept[k] else _copy(c) for k, c in enumerate(ins)]
        const_cls = [None] * len(body.jaxpr.constvars)
        here = f"{where}/scan" if where else "scan"
        while True:  # the carry's classes to a fixed point
            _, outs = self.walk(body.jaxpr, ins, const_cls, here, False)
            new = list(ins)
            for j, k in enumerate(carried):
                a, b = ins[k], outs[j]
                new[k] = a if a == b else _copy(_join([a, b]))
            if new == ins:
                break
            ins = new
        jaxpr, outs = self.walk(body.jaxpr, ins, const_cls, here, rewrite)
        outs = [_outer(c) for c in outs]
        if jaxpr is body.jaxpr:
            return outs, None
        return outs, with_programs(eqn, {nest: _compat.closed_jaxpr(jaxpr, body.consts)})

    def cond(self, eqn, nest, ins, where, rewrite):
        here = f"{where}/cond" if where else "cond"
        new, outs = {}, None
        for n in nest:
            br = n.program
            jaxpr, o = self.walk(br.jaxpr, n.operands(ins), [None] * len(br.jaxpr.constvars), here, rewrite)
            o = [_outer(c) for c in o]
            if jaxpr is not br.jaxpr:
                new[n] = _compat.closed_jaxpr(jaxpr, br.consts)
            outs = o if outs is None else [_join([a, b]) for a, b in zip(outs, o)]
        return outs, (with_programs(eqn, new) if new else None)

    # -- spans: each layer equation (and what joins it) becomes one vjpkit_matched equation
    def spans(self, jaxpr, eqns, new_eqns, layers, cls, where: str) -> list:
        producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
        users: dict[Any, list[int]] = {}
        for i, e in enumerate(eqns):
            for a in e.invars:
                if not _is_lit(a):
                    users.setdefault(a, []).append(i)
        for v in jaxpr.outvars:
            if not _is_lit(v):
                users.setdefault(v, []).append(-1)
        consumed: set[int] = set()
        for i in layers:
            if i in consumed:
                continue
            eqn = eqns[i]
            if isinstance(eqn.outvars[0], jcore.DropVar):  # an unused result: nothing to record
                new_eqns[i] = eqn
                continue
            w, x = _layer_roles(eqn, [cls(a) for a in eqn.invars])
            joined = self.joined(i, eqns, users, cls)
            consumed.update(joined)
            last = joined[-1] if joined else i
            new = self.span(eqns, producer, cls, i, w, x, joined, where)
            if new is None:  # no parameter leaf in reach: no record (the use is an other use)
                new_eqns[i] = eqn
                continue
            new_eqns[last] = new
            for j in (i, *joined):
                if j != last:
                    new_eqns[j] = None
        return [e for e in new_eqns if e is not None]

    def joined(self, i: int, eqns: list, users: dict, cls) -> list[int]:
        """The equations after layer ``i`` that join its span: a transpose, then a bias add."""
        out, chain = eqns[i].outvars[0], []
        kind = eqns[i].primitive.name
        for step in ("transpose", "add"):
            user = users.get(out, [])
            if len(user) != 1 or user[0] < 0:
                break
            e = eqns[user[0]]
            if e.primitive.name != step or (step == "transpose" and kind not in ("dot_general",)):
                continue
            if step == "add":
                other = [a for a in e.invars if a is not out]
                c = cls(other[0]) if len(other) == 1 and not _is_lit(other[0]) else None
                if kind not in _BIASED or not (isinstance(c, P) and c.plain is not None):
                    break
            chain.append(user[0])
            out = e.outvars[0]
        return chain

    def span(self, eqns, producer, cls, i, w, x, joined, where: str) -> Any:
        """The layer ``i`` and its joins as one ``vjpkit_matched`` equation, or ``None`` when
        its span reads no parameter leaf of this program (its weight was computed together with
        data, by a nested program that returns both: an other use)."""
        eqn = eqns[i]
        body: set[int] = {i, *joined}
        weights, prev = [eqn.invars[w]], eqn.outvars[0]
        for j in joined:  # a bias add's other operand is a weight too
            weights += [a for a in eqns[j].invars if a is not prev] if eqns[j].primitive.name == "add" else []
            prev = eqns[j].outvars[0]
        bound: list = []
        for v in weights:
            _closure(v, eqns, producer, cls, body, bound)
        x_var = eqn.invars[x]
        if eqn.primitive.name == "gather":  # the ids as indexed, not the index array jnp builds
            x_var = _ids(x_var, eqns, producer, body)
        out_var = eqns[joined[-1] if joined else i].outvars[0]
        # operands: params (P inputs of this program, keyed by path), the rest hoisted
        params_vars = [v for v in bound if isinstance(cls(v), P) and v not in producer]
        hoisted = [v for v in bound if v not in params_vars]
        for v in hoisted:  # a parameter computation made with data (an inner jit returning both)
            if isinstance(cls(v), P):
                self.other_use(cls(v), eqn.primitive.name, where)
        if not params_vars:
            return None
        keys = [self.key(cls(v)) for v in params_vars]
        weight_cls = cls(eqn.invars[w])
        name, rel = _name(keys, self.key(weight_cls) if weight_cls.plain is not None else None, self.long)
        self.named.append((name, frozenset(keys), len(keys) == 1 and name != keys[0]))
        order = sorted(range(len(keys)), key=lambda k: rel[k])
        params = {rel[k]: 0 for k in order}
        pvars = [params_vars[k] for k in order]
        tree = jax.tree.structure((params, (0,), {}))
        sub_eqns = [eqns[k] for k in sorted(body)]
        effects = _compat.join_effects(*(e.effects for e in sub_eqns))
        info = _compat.debug_info("vjpkit matching", name)
        inner = _compat.open_jaxpr([], [*hoisted, *pvars, x_var], [out_var], sub_eqns, effects, info)
        closed = _compat.closed_jaxpr(inner, [])
        kind = _kind(eqn, w, joined, eqns, {v: rel[k] for k, v in zip(order, pvars)}, body, i)
        return jcore.new_jaxpr_eqn(
            [*hoisted, *pvars, x_var],
            [out_var],
            match_p,
            dict(jaxpr=closed, name=name, tree=tree, n_hoisted=len(hoisted), out_tree=jax.tree.structure(0),
                 kind=Static(kind)),
            effects,
            eqn.source_info,
            eqn.ctx,
        )  # fmt: skip

    def key(self, c: P) -> str:
        if c.plain is not None:
            return self.paths[c.plain]
        return "+".join(sorted(self.paths[k] for k in c.leaves))


def _closure(v, eqns, producer, cls, body: set, bound: list) -> None:
    """Adds the parameter computation of ``v`` to ``body`` and its program inputs to ``bound``."""
    stack = [v]
    seen = set()
    while stack:
        a = stack.pop()
        if _is_lit(a) or a in seen:
            continue
        seen.add(a)
        k = producer.get(a)
        if k is not None and k in body:
            continue
        if k is not None and all(cls(o) is not D for o in eqns[k].outvars):
            body.add(k)
            stack.extend(eqns[k].invars)
        elif a not in bound:
            bound.append(a)


# what jnp's indexing does to the ids before a gather (wrap negative ids, add the index axis)
_INDEXING = frozenset(
    {"lt", "ge", "add", "select_n", "broadcast_in_dim", "concatenate", "convert_element_type",
     "reshape", "clamp", "and"}
)  # fmt: skip


def _ids(v, eqns, producer, body: set):
    """The one array ``v`` (a gather's indices) is built from by jnp's indexing steps, whose
    equations then join ``body``; ``v`` itself when there is no such single array."""
    steps, sources, stack = set(), set(), [v]
    while stack:
        a = stack.pop()
        if _is_lit(a):
            continue
        k = producer.get(a)
        e = eqns[k] if k is not None else None
        integer = e is not None and all(
            not jax.numpy.issubdtype(o.aval.dtype, jax.numpy.inexact) for o in e.outvars
        )
        if e is not None and e.primitive.name in _INDEXING and integer:
            steps.add(k)
            stack.extend(e.invars)
        else:
            sources.add(a)
    if len(sources) != 1 or not steps:
        return v
    body.update(steps)
    return next(iter(sources))


def _live(eqns: list, outvars: Sequence) -> list:
    """``eqns`` without the pure ones nothing uses: the parameter computations a span now holds
    (left in place, they would read as uses of the parameters outside any layer)."""
    live = {v for v in outvars if not _is_lit(v)}
    kept = []
    for eqn in reversed(eqns):
        if eqn.effects or any(v in live for v in eqn.outvars if not isinstance(v, jcore.DropVar)):
            kept.append(eqn)
            live.update(a for a in eqn.invars if not _is_lit(a))
    return kept[::-1]


def _layer_roles(eqn: Any, ins: Sequence) -> tuple[int, int] | None:
    """``(weight operand, input operand)`` when ``eqn`` is a layer (see the module contract)."""
    name = eqn.primitive.name
    if name in _LAYERS:
        a, b = ins[0], ins[1]
        if isinstance(a, P) == isinstance(b, P):
            return None
        w = 0 if isinstance(a, P) else 1
        if (name == "gather" and w != 0) or ins[w].copy:  # a copy made outside: an other use
            return None
        return None if _is_lit(eqn.invars[1 - w]) else (w, 1 - w)
    if name in _AFFINE and len(ins) == 2:
        for w in (0, 1):
            c = ins[w]
            if isinstance(c, P) and c.plain is not None and ins[1 - w] in (D, K):
                return w, 1 - w
    return None


def _name(keys: Sequence[str], weight: str | None, long: frozenset = frozenset()) -> tuple[str, list[str]]:
    """The call's name and each key relative to it (see the module contract). ``long``: module
    names a single-leaf span may not take (another layer has that name)."""
    parts = [k.split("/") for k in keys]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    name = "/".join(common)
    module, _, leaf = name.rpartition("/")
    if len(keys) == 1 and module and module not in long:  # {"fc": {"w": W}}: the layer fc
        return module, [leaf]
    if not name or name in keys:  # no shared container: the weight's own path, full keys
        return (weight or keys[0]), list(keys)
    return name, [k[len(name) + 1 :] for k in keys]


def _transposed_back(eqn: Any, joined: list, eqns: list) -> bool:
    """``W @ x`` (the weight the left operand, no batch dimensions) whose output is transposed at
    once into the input's free axes then the weight's: ``x @ W.T``, a dense layer with a stored
    ``(out, in)`` weight (``jax.vmap`` of Equinox's ``Linear``, ``weight @ x + bias``)."""
    if not joined or eqns[joined[0]].primitive.name != "transpose":
        return False
    if eqns[joined[0]].invars[0] is not eqn.outvars[0]:
        return False
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    if lb or rb:
        return False
    n_w = eqn.invars[0].aval.ndim - len(lc)  # the output: the weight's free axes, then the input's
    n_x = eqn.invars[1].aval.ndim - len(rc)
    perm = tuple(int(k) for k in eqns[joined[0]].params["permutation"])
    return perm == (*range(n_w, n_w + n_x), *range(n_w))


def _trailing(src: tuple, eqns: list, out: Any) -> bool:
    """Whether a bias leaf reaches the output ``out`` on its last axes only: through casts,
    reshapes that add or drop leading 1s, and ``broadcast_in_dim`` s onto trailing axes (a
    per-position ``b[:, None]`` or per-example "bias" does not)."""
    leaf, between = src
    for k in between:
        e = eqns[k]
        if e.primitive.name == "broadcast_in_dim":
            n_in, n_out = e.invars[0].aval.ndim, e.outvars[0].aval.ndim
            if tuple(int(d) for d in e.params["broadcast_dimensions"]) != tuple(range(n_out - n_in, n_out)):
                return False
        elif e.primitive.name == "reshape":
            strip = lambda sh: tuple(sh)[next((k for k, d in enumerate(sh) if d != 1), len(sh)) :]
            if strip(e.invars[0].aval.shape) != strip(e.outvars[0].aval.shape):
                return False
        elif e.primitive.name not in _CASTS:
            return False
    shape = tuple(leaf.aval.shape)
    return len(shape) >= 1 and tuple(out.aval.shape[len(out.aval.shape) - len(shape) :]) == shape


def _kind(eqn, w, joined, eqns, roles_of, body, i) -> Any:
    """A ``LayerKind`` the per-example fast paths read: dense or conv when the span is the
    canonical ``x @ W + b`` / NHWC-HWIO convolution of its leaves as they are, else local. A
    local ``dot_general`` / ``conv_general_dilated`` notes why: the equation and what in it has
    no fast path (``"conv_general_dilated with feature_group_count=2"``)."""
    name = eqn.primitive.name
    if name == "gather":
        return _lookup_kind(eqn, body - {i, *joined}, eqns, roles_of)
    if name not in ("dot_general", "conv_general_dilated"):
        return LayerKind("local")  # a norm's affine: the local path is theirs
    why: list[str] = []  # what has no fast path, in words
    back = w != 1 and name == "dot_general" and _transposed_back(eqn, joined, eqns)
    if w != 1 and not back:
        if name != "dot_general":
            return LayerKind("local", note=f"{name} with the parameter as its input, not its kernel")
        why.append("with the weight as its left operand (W @ x)")
    extra = body - {i, *joined}
    bias = [j for j in joined if eqns[j].primitive.name == "add"]
    if len(joined) != len(bias) + back:
        why.append("followed by a transpose of its output")
    roles, allowed = {}, set()
    if bias:
        prev = eqns[joined[joined.index(bias[0]) - 1]].outvars[0] if joined[0] != bias[0] else eqn.outvars[0]
        b = next(a for a in eqns[bias[0]].invars if a is not prev)  # not the (transposed) output
        src = _broadcast_source(b, eqns, extra)
        if src is None or src[0] not in roles_of:
            why.append("with a bias that is not a parameter leaf (broadcast)")
        elif not _trailing(src, eqns, eqns[bias[0]].outvars[0]):
            why.append("with a bias not broadcast onto the output's last axes")
        else:
            roles[roles_of[src[0]]] = "bias"
            allowed = src[1]
    weight, x_var = eqn.invars[w], eqn.invars[1 - w]
    w_aval = weight.aval  # the weight as the equation takes it
    perm = tuple(range(w_aval.ndim))  # its axes as the leaf's
    cast = _weight_source(weight, eqns, extra)  # a leaf through casts (bf16, pvary) and transposes
    if cast is not None and cast[1] and cast[0] in roles_of:
        weight, allowed, perm = cast[0], allowed | cast[1], cast[2]
    if extra - allowed:
        ops = ", ".join(sorted({eqns[k].primitive.name for k in extra - allowed}))
        why.append(f"of parameters computed from the leaves (by {ops}), not leaves as they are")
    elif weight not in roles_of:
        why.append("of a weight that is not a parameter leaf")
    else:
        roles[roles_of[weight]] = "weight"
    x_aval = x_var.aval
    if name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        if w != 1:  # name the dimensions by role: the input's, then the weight's
            lc, rc, lb, rb = rc, lc, rb, lb
        n = len(lc)
        if lb or rb:
            why.append(f"with batch dimensions {tuple(lb)} on the input and {tuple(rb)} on the weight")
        elif tuple(lc) != tuple(range(x_aval.ndim - n, x_aval.ndim)):
            why.append(f"contracting input axes {tuple(lc)} (not the input's last axes)")
        elif bias and w_aval.ndim - n != 1:
            why.append(f"with a bias and {w_aval.ndim - n} output axes of the weight")
        if why:
            return LayerKind("local", note=f"{name} {', '.join(why)}")
        left = tuple(perm[k] for k in rc)  # the leaf's axes the input meets, in the input's order
        right = tuple(perm[k] for k in range(w_aval.ndim) if k not in rc)  # the output's
        axes = () if left + right == tuple(range(len(perm))) else (left, right)
        return LayerKind("dense", roles=roles, in_ndim=n, axes=axes)
    p = eqn.params
    dn = p["dimension_numbers"]
    nd = x_aval.ndim
    channels_last = (0, nd - 1, *range(1, nd - 1))
    kernel = (nd - 1, nd - 2, *range(nd - 2))
    why += [f"with {k}={p[k]}" for k in ("feature_group_count", "batch_group_count") if p[k] != 1]
    if any(d != 1 for d in p["lhs_dilation"]):
        why.append(f"with lhs_dilation={tuple(p['lhs_dilation'])}")
    if (tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec)) != (channels_last, kernel, channels_last):
        why.append("with a layout other than channels-last (NWC/NHWC input, WIO/HWIO kernel)")
    if why:
        return LayerKind("local", note=f"{name} {', '.join(why)}")
    dil = tuple(p["rhs_dilation"])
    return LayerKind(
        "conv",
        roles=roles,
        strides=tuple(p["window_strides"]),
        padding=tuple(tuple(q) for q in p["padding"]),
        dilation=() if all(d == 1 for d in dil) else dil,
    )


# value-preserving casts between a parameter leaf and its use: a dtype convert, and the pvary
# shard_map inserts where a replicated parameter meets varying data
_CASTS = ("convert_element_type", "pvary")


def _weight_source(v, eqns, extra: set) -> tuple[Any, set, tuple[int, ...]] | None:
    """``(leaf var, the equations between, perm)`` when ``v`` is a leaf through casts and
    transposes: axis ``k`` of ``v`` is axis ``perm[k]`` of the leaf."""
    return _source(v, eqns, extra, ("transpose", *_CASTS))


def _lookup_kind(eqn, extra: set, eqns, roles_of) -> LayerKind:
    """``table[ids]``: a gather of whole rows of axis 0 of a leaf (through casts) at integer
    indices with a trailing index axis of 1 (``jnp`` indexing and ``jnp.take``), clamped or
    filled out of range; any other gather is local."""
    src = _weight_source(eqn.invars[0], eqns, extra)
    p = eqn.params
    dn = p["dimension_numbers"]
    table, ids = eqn.invars[0].aval, eqn.invars[1].aval
    mode = str(p.get("mode", "")).lower()
    # out of range: "clip" clamps the row in both passes; "fill" and "promise_in_bounds" drop it
    # in the backward pass (the scatter of the transposed gather skips it)
    mode = "clip" if "clip" in mode else "fill" if ("fill" in mode or "promise" in mode) else ""
    out_ndim = len(eqn.outvars[0].aval.shape)
    canonical = (
        src is not None and src[0] in roles_of and src[2] == tuple(range(table.ndim))
        and not {k for k in extra - src[1] if not _integer(eqns[k])}  # only jnp's index steps besides
        and tuple(dn.collapsed_slice_dims) == (0,) and tuple(dn.start_index_map) == (0,)
        and not tuple(getattr(dn, "operand_batching_dims", ())) and ids.shape and ids.shape[-1] == 1
        and tuple(p["slice_sizes"]) == (1, *table.shape[1:]) and mode
        and tuple(dn.offset_dims) == tuple(range(out_ndim - table.ndim + 1, out_ndim))
        and np.issubdtype(ids.dtype, np.integer)
    )  # fmt: skip
    if not canonical:
        return LayerKind("local")
    return LayerKind("lookup", roles={roles_of[src[0]]: "weight"}, padding=mode)


def _integer(eqn) -> bool:
    return all(np.issubdtype(o.aval.dtype, np.integer) or o.aval.dtype == np.bool_ for o in eqn.outvars)


def _broadcast_source(
    v, eqns, extra: set, prims=("broadcast_in_dim", "reshape", *_CASTS)
) -> tuple[Any, set] | None:
    """``(leaf var, the equations between)`` when ``v`` is a leaf through ``prims`` (broadcasts,
    reshapes and casts by default)."""
    src = _source(v, eqns, extra, prims)
    return None if src is None else src[:2]


def _source(v, eqns, extra: set, prims: Sequence[str]) -> tuple[Any, set, tuple[int, ...]] | None:
    """``(var, the equations of ``extra`` between, perm)``: ``v`` walked back through the
    equations of ``prims`` (first operand) to the first value no equation of ``extra`` makes;
    ``perm`` composes the transposes on the way (axis ``k`` of ``v`` is axis ``perm[k]`` there)."""
    between, perm = set(), tuple(range(len(v.aval.shape)))
    index = {o: k for k in extra for o in eqns[k].outvars}
    while v in index:
        k = index[v]
        name = eqns[k].primitive.name
        if name not in prims:
            return None
        if name == "transpose":
            p = eqns[k].params["permutation"]
            perm = tuple(p[a] for a in perm)
        between.add(k)
        v = eqns[k].invars[0]
    return v, between, perm


def _collisions(named: Sequence[tuple[str, frozenset, bool]]) -> frozenset:
    """The module names given to single-weight spans that a layer with other params also has."""
    params: dict[str, set] = {}
    for name, keys, _ in named:
        params.setdefault(name, set()).add(keys)
    return frozenset(name for name, _, by_module in named if by_module and len(params[name]) > 1)


def enabled() -> bool:
    """Whether matching is on by default (``VJPKIT_MATCH=0`` turns it off for the process)."""
    return os.environ.get("VJPKIT_MATCH", "1") != "0"


def rewrite(closed: Any, paths: Sequence[str | None]) -> tuple[Any, list[OtherUse]]:
    """The program with its matched layers as ``vjpkit_matched`` equations, and the other uses.

    ``paths[i]`` names input ``i`` as a parameter leaf; ``None`` makes it data (a batch the
    caller differentiates for its own reasons, as the per-example tools do).
    """
    m = _Matcher(list(paths))
    jaxpr = closed.jaxpr
    in_cls = [D if path is None else P(frozenset({k}), k) for k, path in enumerate(paths)]
    # closed-over tracers are data (an outer jit's batch); concrete values may be data or
    # constants: an eager trace computes everything that does not depend on the parameters
    consts = [D if isinstance(c, jax.core.Tracer) else K for c in closed.consts]
    new, _ = m.walk(jaxpr, in_cls, consts, "", True)
    long = _collisions(m.named)
    if long:  # single-weight spans named by a module another layer is named by: keep their paths
        m = _Matcher(list(paths), long=long)
        new, _ = m.walk(jaxpr, in_cls, consts, "", True)
    if new is jaxpr:
        return closed, m.other
    return _compat.closed_jaxpr(new, closed.consts), m.other
