"""Explicit products: ``vjp``, ``jvp``, ``linearize``, ``hvp`` and ``jacobian``, with layer hooks.

Contract:

* Without ``hooks`` each returns what its ``jax`` counterpart returns, with the same structure.
  Only the checks differ: seeds and tangents are checked against the value they pair with
  before anything is computed, and bad ones raise ``SeedError`` naming the tree path, the
  expected and the actual ``dtype[shape]``. Integer and boolean primals are allowed, as in JAX,
  and get ``float0`` cotangents; their tangents and the seeds of integer outputs must be
  ``float0`` (the tangent type of a value that cannot change infinitesimally).
* Casting rule for seeds and tangents: a Python scalar, or a weakly typed JAX scalar such as
  ``jnp.asarray(2.0)``, adopts the dtype it is paired with, as it would in any JAX expression,
  when it is of the same kind (a real number for a real or complex dtype, a complex one for a
  complex dtype) and has the right shape. A numpy value has the dtype JAX gives it (a
  ``float64`` array is ``float32`` unless ``jax_enable_x64`` is on), as in ``jax.vjp``. Every
  other leaf must have exactly the expected dtype: a committed dtype is never upcast or downcast.
* With ``hooks``: ``vjp`` and ``jacobian(mode="rev")`` trace ``fun`` through the engine
  (``_engine``), which routes matching layers through the custom_vjp rule (hooks get
  ``Cotangents``; the returned pullback keeps them, also when it runs later or under ``jit``);
  ``jvp``, ``linearize`` and ``jacobian(mode="fwd")`` open a ``TangentScope`` and go through the
  custom_jvp rule of ``_jvp_rule`` (hooks get ``Tangents``). ``hvp`` is forward over reverse:
  ``jax.jvp`` of ``vk.grad(fun, hooks=hooks)``, so its hooks get ``Cotangents``.
* Forward mode without hooks of its own works inside a hooked reverse-mode transform; forward
  mode *with* hooks there is refused with a ``ConfigError`` (the outer hooks would not see
  those layers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _context, _engine, _format, _hooks
from ._autodiff import grad as _vk_grad
from ._check import check_like, require_inexact
from ._errors import ConfigError, SeedError
from ._format import describe as _describe
from ._format import spec
from ._hook_base import HookTransform, before
from ._jvp_rule import TangentScope

SEED_SENTENCE = (
    "A seed is dL/d(out), the cotangent that starts reverse mode: one value per output element, "
    "with out's structure, shape and dtype (the 'vector' of a vector-Jacobian product; "
    "jnp.ones_like(out) gives the gradient of out.sum())."
)
TANGENT_SENTENCE = (
    "A tangent is the direction in which forward mode moves its primal: it has that primal's "
    "structure, shape and dtype."
)
_FLOAT0_SENTENCE = (
    " Integer and boolean values have no derivative: their seed or tangent is "
    "np.zeros(shape, jax.dtypes.float0)."
)


# --- seeds and tangents ------------------------------------------------------------------


def _tangent_dtype(dtype: Any) -> np.dtype:
    dtype = np.dtype(dtype)
    return dtype if jnp.issubdtype(dtype, jnp.inexact) else np.dtype(jax.dtypes.float0)


def _specs(tree: Any) -> Any:
    """The tangent/cotangent type of every leaf of ``tree``, as ``ShapeDtypeStruct``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), _tangent_dtype(jnp.result_type(x))), tree)


def _is_weak(x: Any) -> bool:
    if type(x) in (int, float, complex):
        return True
    aval = getattr(x, "aval", None)
    return bool(getattr(aval, "weak_type", False)) and isinstance(x, jax.Array)


def _same_kind(expected: np.dtype, x: Any) -> bool:
    if type(x) in (int, float):
        return jnp.issubdtype(expected, jnp.inexact)
    if type(x) is complex:
        return jnp.issubdtype(expected, jnp.complexfloating)
    dtype = np.dtype(x.dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return jnp.issubdtype(expected, jnp.complexfloating)
    if jnp.issubdtype(dtype, jnp.number) and not jnp.issubdtype(dtype, jnp.bool_):
        return jnp.issubdtype(expected, jnp.inexact)
    return False


def _coerce_leaf(expected: jax.ShapeDtypeStruct, x: Any) -> Any:
    # As in jax.vjp: a numpy value has the dtype JAX gives it (float64 is float32 without x64).
    numpy_value = isinstance(x, (np.ndarray, np.generic)) and tuple(np.shape(x)) == tuple(expected.shape)
    if numpy_value and jax.dtypes.canonicalize_dtype(x.dtype) == np.dtype(expected.dtype):
        return jnp.asarray(x, expected.dtype)
    if not _is_weak(x) or tuple(np.shape(x)) != tuple(expected.shape):
        return x
    if not _same_kind(np.dtype(expected.dtype), x):
        return x
    return jnp.asarray(x, expected.dtype)


def check_cast(expected: Any, got: Any, *, what: str, hint: str) -> Any:
    """``got`` with weak scalars cast to ``expected``'s dtypes, after checking it matches.

    Args:
        expected: a pytree of ``jax.ShapeDtypeStruct`` (tangent types).
        got: the user's seed or tangents.
        what: who is checked, e.g. ``"vk.vjp pullback: the seed"``.
        hint: sentences appended to every error.

    Raises:
        SeedError: naming the path and the expected and actual ``dtype[shape]``.

    Examples:
        >>> check_cast(jax.ShapeDtypeStruct((), jnp.float32), 1.0, what="seed", hint="")
        Array(1., dtype=float32)
    """
    if any(np.dtype(s.dtype) == jax.dtypes.float0 for s in jax.tree.leaves(expected)):
        hint += _FLOAT0_SENTENCE
    if jax.tree.structure(expected) == jax.tree.structure(got):
        got = jax.tree.map(_coerce_leaf, expected, got)
        _check_float0(expected, got, what=what, hint=hint)
    check_like(expected, got, what=what, error=SeedError, hint=hint)
    return got


def _check_float0(expected: Any, got: Any, *, what: str, hint: str) -> None:
    """Names ``float0`` in mismatches that involve it (numpy would call it ``void``)."""
    for (path, e), g in zip(jax.tree_util.tree_flatten_with_path(expected)[0], jax.tree.leaves(got)):
        is_float0 = [
            getattr(x, "dtype", None) is not None and np.dtype(x.dtype) == jax.dtypes.float0 for x in (e, g)
        ]
        if is_float0[0] != is_float0[1] or (is_float0[0] and tuple(np.shape(g)) != tuple(e.shape)):
            where = _format.where(path)
            raise SeedError(f"{what}, path {where}: expected {spec(e)}, got {spec(g)}. {hint}")


@dataclasses.dataclass(frozen=True)
class _Checked:
    """The check in front of a linear function (a pullback or a linearized jvp).

    Hashable, so ``jax.tree_util.Partial(checker, fn)`` is a pytree that ``jit`` can take.
    """

    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], np.dtype], ...]
    what: str
    hint: str
    star_args: bool

    @classmethod
    def make(cls, expected: Any, *, what: str, hint: str, star_args: bool) -> _Checked:
        leaves, treedef = jax.tree.flatten(expected)
        return cls(treedef, tuple((tuple(s.shape), np.dtype(s.dtype)) for s in leaves), what, hint, star_args)

    def __call__(self, fn: Callable, *args: Any) -> Any:
        expected = jax.tree.unflatten(self.treedef, [jax.ShapeDtypeStruct(s, d) for s, d in self.leaves])
        if self.star_args:
            return fn(*check_cast(expected, tuple(args), what=self.what, hint=self.hint))
        if len(args) != 1:
            raise SeedError(
                f"{self.what}: the pullback takes one seed (a pytree like out), got {len(args)} "
                f"arguments. {SEED_SENTENCE} For several outputs, pass one tuple: pullback((s1, s2))."
            )
        return fn(check_cast(expected, args[0], what=self.what, hint=self.hint))


# --- shared plumbing ---------------------------------------------------------------------


def _fname(fun: Callable) -> str:
    name = getattr(fun, "__name__", "fun")
    return "fun" if name == "<lambda>" else name


def _check_callable(fun: Any, transform: str) -> None:
    if not callable(fun):
        raise ConfigError(f"{transform}: fun must be callable, got {type(fun).__name__}.")


def _aux_checked(fun: Callable, has_aux: bool, transform: str) -> Callable:
    if not has_aux:
        return fun

    @functools.wraps(fun)
    def checked(*args):
        out = fun(*args)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise SeedError(
                f"{transform}(..., has_aux=True): {_fname(fun)} must return a pair (out, aux), got "
                f"{_describe(out)}. Return (out, aux), or drop has_aux=True."
            )
        return tuple(out)

    return checked


def _as_tuple(value: Any, argname: str, transform: str, example: str) -> tuple:
    if not isinstance(value, (tuple, list)):
        raise SeedError(
            f"{transform}: {argname} must be a tuple with one entry per argument of fun, got "
            f"{_describe(value)}. Example: {example}."
        )
    return tuple(value)


def _require_float(tree: Any, what: str, transform: str) -> None:
    require_inexact(
        tree,
        f"{transform}: {what}",
        error=SeedError,
        hint="Integer values have no derivative: cast it (x.astype(jnp.float32)) or pass it as "
        "another argument (argnums).",
    )


@contextlib.contextmanager
def _tangent_scope(pairs: tuple, transform: str) -> Iterator[None]:
    """Opens a forward-mode hook scope when ``pairs`` is non-empty.

    A forward-mode transform with hooks inside a reverse-mode vjpkit transform is refused: its
    layers are already marked for the outer transform, whose hooks would not see them.
    """
    if not pairs:
        yield
        return
    outer = _context.current()
    if outer is not None and outer.mode != "jvp":
        raise ConfigError(
            f"{transform} with hooks was called inside a vjpkit reverse-mode transform with hooks. "
            f"Nested hooked transforms would hide the outer transform's hooks from these layers. "
            f"Apply {transform} outside it (forward over reverse), or drop one set of hooks."
        )
    scope = TangentScope(_engine.configure(pairs, (), transform), _engine.tangent_hooks())
    with _context.activate(scope):
        yield
    scope.config.check_matched(scope.names)


def _prepare_hooks(hooks: Any, transform: str, mode: str) -> tuple:
    """``normalize_hooks``, plus the rules for ``vk.HookTransform`` in explicit transforms.

    Tangent hooks are plain functions: a HookTransform rewrites cotangents, so it is refused in
    forward mode. In reverse mode a stateless HookTransform (``vk.scale``, ``vk.clip_by_norm``)
    works; one that keeps state raises when its state is created, because these transforms do
    not thread ``hook_state=``.
    """
    pairs = _context.normalize_hooks(hooks, transform)
    prepared = []
    for glob, fns in pairs:
        out = []
        for fn in fns:
            if isinstance(fn, before):
                if mode == "jvp":
                    raise ConfigError(
                        f"{transform}: the hook for glob {glob!r} is a vk.before(...) pre-hook, which "
                        "rewrites grad_output before a layer's VJP (reverse mode). Tangent hooks are "
                        "functions rec -> None | Tangents, or vk.on_host(fn)."
                    )
                hook = fn.hook
                if isinstance(hook, HookTransform):
                    hook = HookTransform(_stateless_init(hook.init, glob, transform), hook.update)
                out.append(before(hook))
                continue
            if isinstance(fn, HookTransform):
                if mode == "jvp":
                    raise ConfigError(
                        f"{transform}: the hook for glob {glob!r} is a vk.HookTransform, which rewrites "
                        "cotangents (reverse mode). Tangent hooks are functions rec -> None | Tangents "
                        "(return rec.replace(tangent_output=...) to rewrite), or vk.on_host(fn)."
                    )
                fn = HookTransform(_stateless_init(fn.init, glob, transform), fn.update)
            out.append(fn)
        prepared.append((glob, tuple(out)))
    return tuple(prepared)


def _stateless_init(init: Callable, glob: str, transform: str) -> Callable:
    def checked(params):
        state = init(params)
        if _hooks.is_stateful(state):
            raise ConfigError(
                f"{transform}: the vk.HookTransform for glob {glob!r} keeps state ({_describe(state)}), "
                f"and {transform} does not thread hook state from step to step. Use it with vk.grad or "
                "vk.value_and_grad and hook_state= (see vk.init_hook_state), or use a stateless hook here."
            )
        return state

    return checked


# --- public transforms -------------------------------------------------------------------


def vjp(
    fun: Callable,
    *primals: Any,
    has_aux: bool = False,
    hooks: dict | None = None,
    capture: Any = None,
    match: bool | None = None,
):
    """``jax.vjp`` with a checked seed and named, hookable layer cotangents.

    Args:
        fun: ``fun(*primals) -> out`` (any pytree of arrays), or ``(out, aux)`` with ``has_aux``.
        *primals: the point at which to differentiate. Integer primals are allowed and get
            ``float0`` cotangents, as in ``jax.vjp``.
        has_aux: ``fun`` returns ``(out, aux)``; ``aux`` is returned, not differentiated.
        hooks: ``{glob: hook or [hooks]}`` as in ``vjpkit.grad``: hooks get
            ``Cotangents`` when the pullback runs (also later, or under ``jit``).
        capture: as in ``vjpkit.grad``: ``pullback(seed)`` then returns
            ``(cotangents, captured)``, with ``captured = {call key: Cotangents}`` of this seed.
        match: find the layers of plain JAX code, as in ``vjpkit.grad``; every primal counts
            as parameters.

    Returns:
        ``(out, pullback)``, or ``(out, pullback, aux)`` with ``has_aux``. ``pullback(seed)``
        takes a seed shaped like ``out`` and returns one cotangent per primal, as a tuple.
        It is a pytree, so it can be passed to a jitted function.

    Raises:
        SeedError: a seed whose structure, shape or dtype does not match ``out`` (see the
            module's casting rule), or ``has_aux=True`` with ``fun`` not returning a pair.

    Examples:
        >>> out, pullback = vk.vjp(lambda x, a: x @ a, jnp.ones((2, 3)), jnp.ones((3, 4)))
        >>> grad_x, grad_a = pullback(jnp.array([[1.0, 2, 3, 4], [5, 6, 7, 8]]))
        >>> grad_x
        Array([[10., 10., 10.],
               [26., 26., 26.]], dtype=float32)
    """
    _check_callable(fun, "vk.vjp")
    config = _engine.configure(_prepare_hooks(hooks, "vk.vjp", "vjp"), capture, "vk.vjp", match)
    f = _aux_checked(fun, has_aux, "vk.vjp")
    if not config.hooks and not config.capture:
        result = jax.vjp(f, *primals, has_aux=has_aux)
        out, pull = result[0], result[1]
    else:
        out, pull, aux = _hooked_vjp(f, primals, has_aux, config)
        result = (out, pull, aux)
    hint = SEED_SENTENCE
    if not has_aux and isinstance(out, tuple) and len(out) == 2:
        hint += " If fun returns (out, aux), pass has_aux=True."
    checker = _Checked.make(_specs(out), what="vk.vjp pullback: the seed", hint=hint, star_args=False)
    pullback = jax.tree_util.Partial(checker, pull)
    return (out, pullback, result[2]) if has_aux else (out, pullback)


def _hooked_vjp(f: Callable, primals: tuple, has_aux: bool, config: _context.Config):
    """``(out, pull, aux)`` through the engine; ``pull(seed)`` is a pytree (``Partial``)."""
    if any(spec.host is not None and spec.host.every > 1 for spec in config.capture):
        raise ConfigError(
            "vk.vjp: capture host delivery with every > 1 needs a step counter in hook state, which "
            "vk.vjp does not thread. Use every=1 here, or vk.grad / vk.value_and_grad with hook_state=."
        )
    traced = _engine.trace(config, f, primals, has_aux=has_aux)
    out, aux, pull = _engine.linearize(traced)
    wrapped = jax.tree_util.Partial(functools.partial(_pull, bool(config.capture)), pull)
    return out, wrapped, aux


def _pull(with_capture: bool, pull: Callable, seed: Any) -> Any:
    grads, captured, _, _ = pull(seed)
    return (tuple(grads), captured) if with_capture else tuple(grads)


def jvp(
    fun: Callable,
    primals: Sequence[Any],
    tangents: Sequence[Any],
    hooks: dict | None = None,
    *,
    has_aux: bool = False,
):
    """``jax.jvp`` with checked tangents and named, hookable layer tangents.

    Args:
        fun: ``fun(*primals) -> out``, or ``(out, aux)`` with ``has_aux``.
        primals: a tuple, one entry per argument of ``fun``.
        tangents: a tuple like ``primals``: the direction to push forward (``float0`` for
            integer primals).
        hooks: ``{glob: hook or [hooks]}``. A tangent hook is ``rec -> None | Tangents``; it
            may return ``rec.replace(tangent_output=...)`` (same structure, shape and dtype),
            and ``vk.on_host(fn)`` works as in ``vjpkit.grad``. Hooks fire in forward
            order, for each layer call that a non-zero tangent reaches.
        has_aux: ``fun`` returns ``(out, aux)``; the result is then ``(out, tangent_out, aux)``.

    Returns:
        ``(out, tangent_out)``: ``fun(*primals)`` and J @ tangents.

    Examples:
        >>> out, t_out = vk.jvp(jnp.sin, (jnp.zeros(3),), (jnp.ones(3),))
        >>> t_out
        Array([1., 1., 1.], dtype=float32)
    """
    _check_callable(fun, "vk.jvp")
    example = "vk.jvp(f, (x,), (v,))"
    primals = _as_tuple(primals, "primals", "vk.jvp", example)
    tangents = _as_tuple(tangents, "tangents", "vk.jvp", example)
    tangents = check_cast(_specs(primals), tangents, what="vk.jvp: tangents", hint=TANGENT_SENTENCE)
    pairs = _prepare_hooks(hooks, "vk.jvp", "jvp")
    with _tangent_scope(pairs, "vk.jvp"):
        return jax.jvp(_aux_checked(fun, has_aux, "vk.jvp"), primals, tangents, has_aux=has_aux)


def linearize(fun: Callable, *primals: Any, has_aux: bool = False, hooks: dict | None = None):
    """``jax.linearize`` with checked tangents and named, hookable layer tangents.

    The forward pass runs once; ``f_jvp(*tangents)`` then costs about one forward pass each
    time. Tangent hooks (see ``jvp``) become part of ``f_jvp`` and fire at each call.

    Returns:
        ``(out, f_jvp)``, or ``(out, f_jvp, aux)`` with ``has_aux``. ``f_jvp`` takes one tangent
        per primal and returns J @ tangents; it is a pytree, so ``jit`` can take it.

    Examples:
        >>> out, f_jvp = vk.linearize(jnp.sin, jnp.zeros(3))
        >>> f_jvp(jnp.ones(3))
        Array([1., 1., 1.], dtype=float32)
    """
    _check_callable(fun, "vk.linearize")
    pairs = _prepare_hooks(hooks, "vk.linearize", "jvp")
    with _tangent_scope(pairs, "vk.linearize"):
        result = jax.linearize(_aux_checked(fun, has_aux, "vk.linearize"), *primals, has_aux=has_aux)
    out, jax_f_jvp = result[0], result[1]
    checker = _Checked.make(
        _specs(tuple(primals)), what="vk.linearize f_jvp: tangents", hint=TANGENT_SENTENCE, star_args=True
    )
    f_jvp = jax.tree_util.Partial(checker, jax_f_jvp)
    return (out, f_jvp, result[2]) if has_aux else (out, f_jvp)


def _scalar_checked(fun: Callable, transform: str) -> Callable:
    @functools.wraps(fun)
    def checked(*args):
        out = fun(*args)
        if getattr(out, "shape", None) != () or not jnp.issubdtype(out.dtype, jnp.floating):
            raise SeedError(
                f"{transform} needs fun to return a float scalar, got {_describe(out)}. A Hessian is "
                "the derivative of a gradient, and a gradient needs a scalar: reduce the output "
                "(out.sum(), out.mean()), or use vk.jacobian for a vector output."
            )
        return out

    return checked


def hvp(fun: Callable, primals: Sequence[Any], tangents: Any, *, hooks: dict | None = None) -> Any:
    """Hessian-vector product ``H @ tangents`` of a scalar ``fun`` with respect to ``primals[0]``.

    Forward over reverse: ``jax.jvp`` of ``vk.grad(fun, hooks=hooks)``, about the cost of two
    gradients, without forming H. With ``hooks``, it is the derivative of the hooked gradient.

    Args:
        fun: a scalar function ``fun(*primals)``.
        primals: a tuple; ``primals[0]`` is differentiated (float leaves only), the rest are fixed.
        tangents: the vector, with the structure, shapes and dtypes of ``primals[0]``.
        hooks: reverse-mode hooks, as in ``vjpkit.grad`` (they get ``Cotangents``).

    Returns:
        ``H @ tangents``, with the structure of ``primals[0]``.

    Examples:
        >>> vk.hvp(lambda x: jnp.sum(x**3), (jnp.array([1.0, 2.0]),), jnp.array([1.0, 0.0]))
        Array([6., 0.], dtype=float32)
    """
    _check_callable(fun, "vk.hvp")
    primals = _as_tuple(primals, "primals", "vk.hvp", "vk.hvp(f, (params, x), v)")
    if not primals:
        raise SeedError("vk.hvp: primals is empty; it needs at least the argument to differentiate.")
    _require_float(primals[0], "primals[0]", "vk.hvp")
    v = check_cast(
        _specs(primals[0]),
        tangents,
        what="vk.hvp: tangents",
        hint="The tangents of vk.hvp have the structure of primals[0] alone (not a tuple over primals).",
    )
    pairs = _prepare_hooks(hooks, "vk.hvp", "vjp")
    grad_fn = _vk_grad(_scalar_checked(fun, "vk.hvp"), hooks=dict(pairs) if pairs else None)
    rest = primals[1:]
    return jax.jvp(lambda p0: grad_fn(p0, *rest), (primals[0],), (v,))[1]


def jacobian(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    *,
    mode: str = "rev",
    has_aux: bool = False,
    hooks: dict | None = None,
) -> Callable:
    """The full Jacobian, built row by row (``mode="rev"``) or column by column (``"fwd"``).

    ``"rev"`` is ``jax.jacrev``: one VJP per output element, cheaper when outputs are fewer than
    inputs. ``"fwd"`` is ``jax.jacfwd``: one JVP per input element, cheaper in the opposite case.
    Hooks get ``Cotangents`` in ``"rev"`` mode and ``Tangents`` in ``"fwd"`` mode, once
    per row or column (the products are vmapped).

    Args:
        fun: ``fun(*args) -> out``.
        argnums: which positional argument(s) to differentiate (float leaves only).
        mode: ``"rev"`` or ``"fwd"``.
        has_aux: ``fun`` returns ``(out, aux)``; the result is then ``(jacobian, aux)``.
        hooks: ``{glob: hook or [hooks]}``.

    Returns:
        A function with ``fun``'s signature returning what ``jax.jacrev`` / ``jax.jacfwd`` return.

    Examples:
        >>> vk.jacobian(lambda x: x**2, mode="fwd")(jnp.array([1.0, 2.0]))
        Array([[2., 0.],
               [0., 4.]], dtype=float32)
    """
    _check_callable(fun, "vk.jacobian")
    if mode not in ("rev", "fwd"):
        raise ConfigError(
            f"vk.jacobian: mode must be 'rev' (reverse mode, one VJP per output element) or 'fwd' "
            f"(forward mode, one JVP per input element), got {mode!r}."
        )
    pairs = _prepare_hooks(hooks, "vk.jacobian", "vjp" if mode == "rev" else "jvp")
    f = _aux_checked(fun, has_aux, "vk.jacobian")
    if mode == "fwd" or not pairs:
        inner = (jax.jacrev if mode == "rev" else jax.jacfwd)(f, argnums=argnums, has_aux=has_aux)
    else:
        inner = functools.partial(_hooked_jacrev, f, argnums, has_aux, pairs)

    @functools.wraps(fun)
    def jac(*args):
        for i in (argnums,) if isinstance(argnums, int) else tuple(argnums):
            if -len(args) <= i < len(args):
                _require_float(args[i], f"argument {i}", "vk.jacobian")
        with _tangent_scope(pairs if mode == "fwd" else (), "vk.jacobian"):
            return inner(*args)

    return jac


def _hooked_jacrev(f: Callable, argnums: Any, has_aux: bool, pairs: tuple, *args: Any) -> Any:
    """``jax.jacrev`` through the engine: one hooked pullback per output element, vmapped."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    nums = tuple(i % len(args) for i in nums)

    def g(*diff):
        full = list(args)
        for i, d in zip(nums, diff):
            full[i] = d
        return f(*full)

    out, pull, aux = _hooked_vjp(
        g, tuple(args[i] for i in nums), has_aux, _engine.configure(pairs, (), "vk.jacobian")
    )
    leaves, out_def = jax.tree.flatten(out)
    sizes = [int(np.prod(np.shape(x), dtype=np.int64)) for x in leaves]
    total = sum(sizes)
    offsets = np.cumsum([0, *sizes])
    seeds = [
        jnp.eye(total, dtype=x.dtype)[:, offsets[j] : offsets[j + 1]].reshape(total, *np.shape(x))
        for j, x in enumerate(leaves)
    ]
    rows = jax.vmap(lambda *s: pull(jax.tree.unflatten(out_def, s)))(*seeds)
    per_leaf = [
        jax.tree.map(
            lambda r, j=j, x=x: r[offsets[j] : offsets[j + 1]].reshape(*np.shape(x), *r.shape[1:]), rows
        )
        for j, x in enumerate(leaves)
    ]
    jac = jax.tree.unflatten(out_def, [p[0] if isinstance(argnums, int) else p for p in per_leaf])
    return (jac, aux) if has_aux else jac
