"""Where a layer's examples go: a forward dataflow over the traced program, at trace time.

Contract. The per-example statistics of a layer call read one axis of its output (and input)
as the ``N`` examples of the registered loss, whose output has them on axis 0. They are exact
only if that axis reaches axis 0 of the registered output with no example mixed with another
on the way (a batch norm in training mode, ``h - h.mean(0)``, a reduction or contraction over
the examples, a scan over them). ``reaches(jaxpr, path, out_axes, target)`` follows one axis of
the outputs of the equation at ``path`` (indices into nested programs, as the engine's plan
numbers them) to the program's output ``target``, and returns where it ends there: an axis
(an ``int``), ``None`` when the call does not reach ``target``, or ``MIXED`` when examples mix
on some path (or an operation the rules below do not know touches the tracked axis: the
analysis is conservative). Nothing is computed: it reads the program's equations and shapes.

``is_affine(span)`` says whether a layer call's computation is exactly ``x @ W [+ b]`` over
the last axis of ``x`` (the structure of its program, not the shapes of its parameters).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.extend import core as jcore

from .. import _engine

MIXED = "mixed"

_ELEMENTWISE = frozenset(
    [
        "abs",
        "acos",
        "acosh",
        "add",
        "add_any",
        "and",
        "asin",
        "asinh",
        "atan",
        "atan2",
        "atanh",
        "bessel_i0e",
        "bessel_i1e",
        "cbrt",
        "ceil",
        "clamp",
        "clz",
        "complex",
        "conj",
        "convert_element_type",
        "copy",
        "copy_p",
        "cos",
        "cosh",
        "digamma",
        "div",
        "eq",
        "erf",
        "erf_inv",
        "erfc",
        "exp",
        "exp2",
        "expm1",
        "floor",
        "ge",
        "gt",
        "igamma",
        "igammac",
        "imag",
        "integer_pow",
        "is_finite",
        "le",
        "lgamma",
        "log",
        "log1p",
        "logistic",
        "lt",
        "max",
        "min",
        "mul",
        "ne",
        "neg",
        "nextafter",
        "not",
        "or",
        "polygamma",
        "population_count",
        "pow",
        "real",
        "reduce_precision",
        "rem",
        "round",
        "rsqrt",
        "select_n",
        "shift_left",
        "shift_right_arithmetic",
        "shift_right_logical",
        "sign",
        "sin",
        "sinh",
        "sqrt",
        "square",
        "stop_gradient",
        "sub",
        "tan",
        "tanh",
        "xor",
        "zeta",
        "sharding_constraint",
        "pvary",
    ]
)
_REDUCE = frozenset(
    [
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "reduce_and",
        "reduce_or",
        "reduce_xor",
        "argmax",
        "argmin",
    ]
)
_CUMULATIVE = frozenset(["cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"])


def join(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None or a == b:
        return a
    return MIXED


def _shape(v: Any) -> tuple:
    return tuple(getattr(v.aval, "shape", ()))


def _open(j: Any) -> Any:
    return getattr(j, "jaxpr", j)


def reaches(jaxpr: Any, path: Sequence, out_axes: dict[int, int], target: int) -> Any:
    """Where the axes ``out_axes`` (output index -> axis) of the equation at ``path`` end at
    the program's output ``target`` (see the module contract)."""
    outs = _walk(jaxpr, [None] * len(jaxpr.invars), (tuple(path), out_axes))
    return outs[target]


def _walk(jaxpr: Any, ins: list, seed: Any) -> list:
    jaxpr = _open(jaxpr)
    env = {v: a for v, a in zip(jaxpr.invars, ins) if a is not None}

    def read(v):
        return None if isinstance(v, jcore.Literal) else env.get(v)

    for i, eqn in enumerate(jaxpr.eqns):
        axes = [read(v) for v in eqn.invars]
        sub = seed[0][1:] if seed is not None and seed[0][0] == i else None
        if sub is None and all(a is None for a in axes):
            continue
        if sub == ():  # the seeded call itself
            outs = [seed[1].get(k) for k in range(len(eqn.outvars))]
            if any(a is not None for a in axes):
                outs = [join(o, a) for o, a in zip(outs, _eqn(eqn, axes, None))]
        else:
            outs = _eqn(eqn, axes, (sub, seed[1]) if sub is not None else None)
        for v, a in zip(eqn.outvars, outs):
            if a is not None:
                env[v] = a
    return [read(v) for v in jaxpr.outvars]


def _inner(eqn: Any) -> Any:
    """The program a call-like equation runs on its operands (``_engine.call_program``), or ``None``."""
    found = _engine.call_program(eqn, forward=True)
    return None if found is None else found[1]


def _eqn(eqn: Any, axes: list, seed: Any) -> list:
    """The tracked axes of ``eqn``'s outputs from those of its operands (``seed``: a seeded call
    inside one of its programs)."""
    name = eqn.primitive.name
    n_out = len(eqn.outvars)
    if MIXED in axes:
        return [MIXED] * n_out
    nest = _engine.nested(eqn)
    kinds = {n.kind for n in nest}
    if "scan" in kinds:
        return _scan(nest[0], axes, seed)
    if "branch" in kinds:
        picked = set(range(len(axes))) - {i for n in nest for i in n.ins}  # the branch index
        if any(axes[i] is not None for i in picked):
            return [MIXED] * n_out
        outs = [None] * n_out
        for n in nest:
            sub = seed[0][2:] if seed is not None and seed[0][:2] == ("b", n.index) else None
            got = _walk(n.program, n.operands(axes), (sub, seed[1]) if sub is not None else None)
            outs = [join(o, g) for o, g in zip(outs, got)]
        return outs
    if "loop" in kinds:
        return [MIXED] * n_out
    if seed is not None or name not in _RULES:
        inner = _inner(eqn) if name not in _RULES else None
        if inner is not None:
            return _walk(inner, axes, seed)
        if seed is not None:
            return [MIXED] * n_out
    if name in _ELEMENTWISE:
        out = _shape(eqn.outvars[0])
        found = None
        for v, a in zip(eqn.invars, axes):  # size-1 axes broadcast (jax >= 0.12), not the examples
            if a is not None:
                same = len(_shape(v)) == len(out) and _shape(v)[a] == out[a]
                found = join(found, a if same else MIXED)
        return [found] * n_out
    rule = _RULES.get(name)
    if rule is None:
        return [MIXED] * n_out
    try:
        return rule(eqn, axes)
    except (KeyError, AttributeError, IndexError, TypeError, ValueError):  # params of another JAX
        return [MIXED] * n_out


def _scan(nest: Any, axes: list, seed: Any) -> list:
    """A scan's body walked to a fixed point over its carry. A slice (``xs``) has lost the
    leading axis, the iterations': an example axis there is mixed, any other one is one lower."""
    roles = nest.roles
    ins = [axes[i] for i in nest.ins]
    ins = [a if r != "s" or a is None else MIXED if a == 0 else a - 1 for a, r in zip(ins, roles)]
    carried = [k for k, r in enumerate(roles) if r == "r"]
    for _ in range(8):
        outs = _walk(nest.program, ins, seed)
        new = list(ins)
        for j, k in enumerate(carried):
            new[k] = join(ins[k], outs[j])
        if new == ins:
            break
        ins = new
    else:
        return [MIXED] * len(outs)
    ys = [None if a is None else MIXED if a == MIXED else a + 1 for a in outs[len(carried) :]]
    return [ins[k] for k in carried] + ys


def _one(fn):
    def rule(eqn, axes):
        (a,) = [a for a in axes if a is not None] or [None]
        if sum(x is not None for x in axes[1:]):  # index operands carrying examples
            return [MIXED] * len(eqn.outvars)
        return [fn(eqn, a)] * len(eqn.outvars)

    return rule


def _broadcast(eqn, a):
    dims = eqn.params["broadcast_dimensions"]
    src, out = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    return dims[a] if src[a] == out[dims[a]] else MIXED


def _reshape(eqn, a):
    src, out = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    before = 1
    for s in src[:a]:
        before *= s
    acc = 1
    for b, s in enumerate(out):
        if acc == before and s == src[a]:
            return b
        acc *= s
    return MIXED


def _reduce(eqn, a):
    reduced = tuple(eqn.params["axes"])
    return MIXED if a in reduced else a - sum(r < a for r in reduced)


def _transpose(eqn, a):
    return tuple(eqn.params["permutation"]).index(a)


def _squeeze(eqn, a):
    dims = tuple(d % len(_shape(eqn.invars[0])) for d in eqn.params["dimensions"])
    return MIXED if a in dims else a - sum(d < a for d in dims)


def _slice(eqn, a):
    shape = _shape(eqn.invars[0])
    strides = eqn.params.get("strides") or (1,) * len(shape)
    whole = eqn.params["start_indices"][a] == 0 and eqn.params["limit_indices"][a] == shape[a]
    return a if whole and strides[a] == 1 else MIXED


def _dynamic_slice(eqn, a):
    return a if eqn.params["slice_sizes"][a] == _shape(eqn.invars[0])[a] else MIXED


def _along(param):
    def fn(eqn, a):
        return MIXED if a == eqn.params[param] % len(_shape(eqn.invars[0])) else a

    return fn


def _rev(eqn, a):
    return MIXED if a in tuple(eqn.params["dimensions"]) else a


def _pad(eqn, a):
    return a if tuple(eqn.params["padding_config"][a]) == (0, 0, 0) else MIXED


def _window(eqn, a):
    p = eqn.params
    plain = p["window_dimensions"][a] == 1 and p["window_strides"][a] == 1
    return a if plain and tuple(p["padding"][a]) == (0, 0) else MIXED


def _top_k(eqn, a):
    return MIXED if a == len(_shape(eqn.invars[0])) - 1 else a


def _concatenate(eqn, axes):
    found = None
    for a in axes:
        if a is not None:
            found = join(found, MIXED if a == eqn.params["dimension"] else a)
    return [found]


def _dot_general(eqn, axes):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    la, ra = axes
    nl, nr = len(_shape(eqn.invars[0])), len(_shape(eqn.invars[1]))
    lfree = [d for d in range(nl) if d not in lc and d not in lb]
    rfree = [d for d in range(nr) if d not in rc and d not in rb]

    def where(a, contract, batch, free, offset):
        if a in contract:
            return MIXED
        if a in batch:
            return ("batch", tuple(batch).index(a))
        return ("free", len(lb) + offset + free.index(a))

    sides = []
    if la is not None:
        sides.append(where(la, lc, lb, lfree, 0))
    if ra is not None:
        sides.append(where(ra, rc, rb, rfree, len(lfree)))
    if MIXED in sides:
        return [MIXED]
    if len(sides) == 2:  # both operands carry examples: only a shared batch axis keeps them apart
        return [sides[0][1] if sides[0] == sides[1] and sides[0][0] == "batch" else MIXED]
    return [sides[0][1]]


def _conv(eqn, axes):
    la, ra = axes
    dn = eqn.params["dimension_numbers"]
    if ra is not None or la != dn.lhs_spec[0] or eqn.params.get("batch_group_count", 1) != 1:
        return [MIXED]
    return [dn.out_spec[0]]


def _gather(eqn, axes):
    oa, ia = axes
    dn = eqn.params["dimension_numbers"]
    if oa is not None or getattr(dn, "operand_batching_dims", ()):
        return [MIXED]
    n_idx = len(_shape(eqn.invars[1]))
    if ia == n_idx - 1:  # the index vector's own axis
        return [MIXED]
    out = len(_shape(eqn.outvars[0]))
    batch = [d for d in range(out) if d not in tuple(dn.offset_dims)]
    return [batch[ia]]


def _dynamic_update_slice(eqn, axes):
    oa, ua = axes[0], axes[1]
    if any(a is not None for a in axes[2:]):
        return [MIXED]
    a = oa if oa is not None else ua
    whole = _shape(eqn.invars[0])[a] == _shape(eqn.invars[1])[a]
    return [join(oa, ua) if whole else MIXED]


def _identity(eqn, axes):
    return list(axes)


def _split(eqn, axes):
    a = axes[0]
    return [MIXED if a == eqn.params["axis"] else a] * len(eqn.outvars)


def _sort(eqn, axes):
    found = None
    for a in axes:
        if a is not None:
            found = join(found, MIXED if a == eqn.params["dimension"] else a)
    return [found] * len(eqn.outvars)


_RULES = {
    "broadcast_in_dim": _one(_broadcast),
    "reshape": _one(_reshape),
    "transpose": _one(_transpose),
    "squeeze": _one(_squeeze),
    "slice": _one(_slice),
    "dynamic_slice": _one(_dynamic_slice),
    "rev": _one(_rev),
    "pad": _one(_pad),
    "reduce_window_sum": _one(_window),
    "reduce_window_max": _one(_window),
    "reduce_window_min": _one(_window),
    "top_k": _one(_top_k),
    "concatenate": _concatenate,
    "dot_general": _dot_general,
    "conv_general_dilated": _conv,
    "gather": _gather,
    "dynamic_update_slice": _dynamic_update_slice,
    "optimization_barrier": _identity,
    "split": _split,
    "sort": _sort,
    **{n: _one(_reduce) for n in _REDUCE},
    **{n: _one(_along("axis")) for n in _CUMULATIVE},
}


# --------------------------------------------------------------------------------------------


def elementwise(eqn: Any) -> bool:
    """Whether ``eqn`` acts on each entry alone (size-1 axes of its operands broadcast)."""
    return eqn.primitive.name in _ELEMENTWISE


def is_affine(jaxpr: Any, w: Any, b: Any, x: Any) -> bool:
    """Whether ``jaxpr``'s one output is exactly ``x @ w`` (+ ``b`` broadcast over the leading
    axes) for its input variables ``w (in, out)``, ``b (out,)`` (or ``None``) and ``x (..., in)``,
    dtype conversions aside."""
    jaxpr = _open(jaxpr)
    if len(jaxpr.outvars) != 1:
        return False
    tags = {w: "w", x: "x", **({b: "b"} if b is not None else {})}
    if not _tag(jaxpr, tags):
        return False
    out = jaxpr.outvars[0]
    return not isinstance(out, jcore.Literal) and tags.get(out) == ("xwb" if b is not None else "xw")


def _tag(jaxpr: Any, tags: dict) -> bool:
    for eqn in _open(jaxpr).eqns:
        ins = [None if isinstance(v, jcore.Literal) else tags.get(v) for v in eqn.invars]
        if all(t is None for t in ins):
            continue
        name = eqn.primitive.name
        out = None
        if name in ("convert_element_type", "copy", "copy_p") and len(ins) == 1:
            out = ins[0]
        elif name == "dot_general" and ins == ["x", "w"]:
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            nx = len(_shape(eqn.invars[0]))
            if tuple(lc) == (nx - 1,) and tuple(rc) == (0,) and not lb and not rb:
                out = "xw"
        elif name in ("broadcast_in_dim", "reshape") and ins == ["b"]:
            shape = _shape(eqn.outvars[0])
            dims = eqn.params.get("broadcast_dimensions", (len(shape) - 1,))
            if tuple(dims) == (len(shape) - 1,) and shape[-1:] == _shape(eqn.invars[0]):
                out = "bb"
        elif name in ("add", "add_any") and sorted(map(str, ins)) in (["bb", "xw"], ["b", "xw"]):
            out = "xwb"
        elif len(eqn.outvars) == len(ins) or _inner(eqn) is not None:
            inner = _inner(eqn)
            if inner is not None:
                sub = {v: t for v, t in zip(_open(inner).invars, ins) if t is not None}
                if not _tag(inner, sub):
                    return False
                for v, u in zip(eqn.outvars, _open(inner).outvars):
                    if not isinstance(u, jcore.Literal) and u in sub:
                        tags[v] = sub[u]
                continue
        if out is None:
            return False
        tags[eqn.outvars[0]] = out
    return True
