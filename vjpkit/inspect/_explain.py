"""``explain``: the shape of every cotangent of one backward pass, without computing any.

Contract: ``explain`` traces ``fun(*args)`` and its backward pass **once, shape-only**
(``jax.eval_shape`` of the engine's program, with every layer call's whole
record): no forward or backward computation runs on data. It differentiates the way training
does, with respect to ``args[0]`` (or ``argnums``):

* a scalar output is a loss, and reverse mode starts from the seed dL/dL = 1.0
  (as ``vk.grad``);
* any other output is differentiated as ``vk.vjp(fun, *args)`` with a seed of the output's
  shape (cotangent shapes do not depend on the seed's values).

It prints one row per layer call in forward order (with each call's position in backward
order), and returns the same data as a list of dicts whose array entries are
``jax.ShapeDtypeStruct`` pytrees. Output uses ``rich`` when it is importable and ``file`` is a
terminal, plain text otherwise. A function that calls no vjpkit layer raises
``ConfigError`` saying how to make one.

The plain-text table helpers here are shared with the other ``inspect`` modules.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TextIO

import jax
import jax.numpy as jnp
import numpy as np

from .. import _engine
from .._capture import FIELDS, capture
from .._errors import ConfigError
from .._format import path, spec

MEANING = {
    "input": "x, the forward input of the call (a tuple when the layer takes several inputs).",
    "output": "y = layer(params, x), the forward output of the call.",
    "grad_output": "dL/dy, the gradient arriving from the layers above; same shape and dtype as output.",
    "grad_input": (
        "dL/dx, the gradient this layer sends to the layer below; same structure as input. "
        "None when x needs no gradient (e.g. the data batch entering the first layer): it is "
        "then never computed."
    ),
    "grad_params": (
        "dL/dparams of this call only, keyed like params; a layer called twice (fc, fc#1) gets "
        "one record per call, and the gradient of its params is the sum."
    ),
}

NO_LAYER = (
    "vk.explain: {fname} calls no vjpkit layer, and plain-JAX matching found no layer either (a "
    "dot_general, conv or gather of a differentiated argument's leaf with data), so there is no "
    "layer call to explain. Differentiate the argument that holds the parameters (argnums), or "
    "build the model from vjpkit layers (nn.dense, nn.conv2d, ... composed with nn.serial), or "
    "make any pure function a named layer with nn.layer(fn, init) (fn(params, *inputs)). If fun "
    "is wrapped in jax.jit, pass the un-jitted function: explain must trace its Python."
)


# --- small rendering helpers (shared with the other inspect modules) ----------------------


def tree_lines(tree: Any) -> list[str]:
    """One line per leaf: ``spec`` for a bare array, ``path: spec`` inside a container."""
    if tree is None:
        return ["None"]
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
    if not leaves:
        return ["{}" if isinstance(tree, dict) else "()"]
    if len(leaves) == 1 and not leaves[0][0]:
        return [spec(leaves[0][1])]
    return [f"{path(keys)}: {spec(leaf)}" for keys, leaf in leaves]


def plain_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table; a cell may be a string with newlines or a list of lines.

    vjpkit's one table renderer for text: ``rich`` (the ``pretty`` extra) draws the tables on a
    terminal (``rich_console``), but it is optional, and logs, files, notebooks' plain output
    and the doc tests need text whatever is installed, so this small renderer stays.
    """

    def lines(cell: Any) -> list[str]:
        if isinstance(cell, (list, tuple)):
            return [str(c) for c in cell] or [""]
        return str(cell).split("\n")

    cells = [[lines(c) for c in row] for row in [list(header), *rows]]
    widths = [max(len(line) for row in cells for line in row[i]) for i in range(len(header))]
    out = []
    for r, row in enumerate(cells):
        for k in range(max(len(c) for c in row)):
            parts = [(c[k] if k < len(c) else "").ljust(w) for c, w in zip(row, widths)]
            out.append("  ".join(parts).rstrip())
        if r == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def rich_console(file: TextIO) -> Any:
    """A ``rich`` console writing to ``file`` when rich is importable and ``file`` is a TTY."""
    isatty = getattr(file, "isatty", None)
    if not (callable(isatty) and isatty()):
        return None
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console(file=file)


# --- the trace ---------------------------------------------------------------------------


def _zero_seed(spec: Any) -> Any:
    dtype = np.dtype(spec.dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.zeros(spec.shape, dtype)
    return np.zeros(spec.shape, jax.dtypes.float0)


class _Trace(NamedTuple):
    """What one shape-only trace learned: the plan, and the calls reached in backward order."""

    plan: Any
    backward: list[str]
    other_uses: tuple = ()  # params used outside any layer (plain-JAX matching, _engine._match)


def _trace(fun: Callable, args: tuple, nums: tuple[int, ...], match: Any = None) -> tuple[_Trace, Any, str]:
    """One shape-only trace of fun's forward and backward pass, records captured whole."""
    config = _engine.configure(None, (capture("*"),), "vk.explain", match)
    seen: dict[str, Any] = {}
    backward: list[str] = []

    def trace(*values):
        traced = _engine.trace(config, fun, values, argnums=nums, check=False)
        out, _, pull = _engine.linearize(traced, log=backward)
        seen["plan"] = traced.plan
        seen["other"] = traced.other_uses
        seen["out"] = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), out)
        scalar = isinstance(out, jax.Array) and out.shape == () and jnp.issubdtype(out.dtype, jnp.inexact)
        seen["kind"] = "loss" if scalar else "vjp"
        seed = [jnp.ones((), out.dtype)] if scalar else [_zero_seed(a) for a in jax.tree.leaves(out)]
        return pull(seed)[1]

    jax.eval_shape(trace, *args)
    trace_ = _Trace(seen["plan"], list(dict.fromkeys(backward)), seen["other"])
    return trace_, seen["out"], seen["kind"]


def _meanings(row: dict, nums: tuple[int, ...], first_backward: bool, shared: bool) -> dict[str, str]:
    name = row["key"]
    m = {
        "input": f"x: what {name} receives in the forward pass.",
        "output": f"y = {row['name']}(params, x): what {name} returns.",
        "params": f"the parameters {name} uses in this call.",
    }
    if row["backward"] is None:
        note = (
            f"None: the backward pass never reaches {name} (its output does not affect the "
            "differentiated result), so it makes no record."
        )
        return {**m, "grad_output": note, "grad_input": note, "grad_params": note}
    m["grad_output"] = (
        f"dL/dy: the gradient arriving at {name} from above"
        + (
            ", the first cotangent of the backward pass: the seed pulled back through what follows"
            if first_backward
            else ""
        )
        + "; shaped like y."
    )
    if row["grad_input"] is None:
        which = ", ".join(f"args[{i}]" for i in nums)
        m["grad_input"] = (
            f"None: needs no gradient. Nothing differentiated ({which}) flows into {name}'s input, "
            "or it is not a float, so it is never computed."
        )
    else:
        m["grad_input"] = f"dL/dx: the gradient {name} sends to the layer below; shaped like x."
    gp = row["grad_params"]
    if gp is None:
        m["grad_params"] = f"None: {name}'s params are not differentiated here."
    elif not jax.tree.leaves(gp):
        m["grad_params"] = f"{{}}: {name} has no parameters."
    else:
        entries = ", ".join(path(p) for p, _ in jax.tree_util.tree_flatten_with_path(gp)[0])
        m["grad_params"] = (
            f"dL/d({entries}) of this call only, keyed like params"
            + (f"; the gradient of {row['name']}'s shared params is the sum over its calls" if shared else "")
            + "."
        )
    return m


def _rows(traced: _Trace, nums: tuple[int, ...]) -> list[dict]:
    plan, backward = traced.plan, traced.backward
    counts = collections.Counter(plan.by_key[k].name for k in plan.order)
    rows = []
    for position, key in enumerate(plan.order):
        site = plan.by_key[key]
        reached = key in backward
        row = {
            "key": key,
            "name": site.name,
            "call": site.call,
            "forward": position,
            "backward": backward.index(key) if reached else None,
            "iterations": tuple(site.scans),  # the enclosing lax.scan s' lengths, outermost first
            "shards": tuple(site.shards),  # the enclosing jax.shard_map s' shards, outermost first
        }
        for field in FIELDS:
            row[field] = getattr(site.record, field) if reached else None
        shared = counts[site.name] > 1
        row["meaning"] = _meanings(row, nums, reached and backward.index(key) == 0, shared)
        if row["iterations"]:
            row["meaning"]["iterations"] = _iterations_meaning(key, row["iterations"])
        if row["shards"]:
            row["meaning"]["shards"] = (
                f"{key} is called inside jax.shard_map ({' x '.join(map(str, row['shards']))} shards); "
                "the shapes shown are one shard's. Captured records and on_host records have one "
                "entry per shard on a leading axis (after the axes of the lax.scan s around the "
                "shard_map, before those inside it); a parameter replicated into the shard_map "
                "(in_specs P()) has grad_params summed over the shards, as jax.grad gives it there."
            )
        rows.append(row)
    return rows


def _iterations_meaning(key: str, lengths: tuple[int, ...]) -> str:
    index = "".join(f"[{c}]" for c in "ijk"[: len(lengths)]) if len(lengths) <= 3 else "[i]..."
    runs = " x ".join(map(str, lengths))
    return (
        f"{key} is called inside lax.scan ({runs} iterations); the shapes shown are one "
        f"iteration's. Hooks run once per iteration (the last first); captured records are "
        f"stacked on leading axes ({', '.join(map(str, lengths))}, ...); hook and capture globs, "
        f"Recorder series, summaries and plots address each iteration as {key}{index} "
        f"({key}[0] the first)."
    )


# --- rendering ----------------------------------------------------------------------------


class Rows(list):
    """``vk.explain``'s rows (a list of dicts), with ``other_uses``: the parameter computations
    that reach the result other than through a layer call, as ``(leaf paths, primitive, where)``."""

    other_uses: tuple = ()


def _other_lines(other: list) -> list[str]:
    if not other:
        return []
    lines = ["params used outside any layer (no record; their gradient flows as plain JAX):"]
    for use in other:
        by = "returned by the function" if use.primitive == "output" else f"used by {use.primitive}"
        lines.append(f"  {', '.join(use.leaves)}: {by}{f' inside {use.where}' if use.where else ''}")
    return lines


def _header(fname: str, out: Any, kind: str, nums: tuple[int, ...], rows: list[dict]) -> list[str]:
    which = ", ".join(f"args[{i}]" for i in nums)
    if kind == "loss":
        how = [
            f"{fname} returns a scalar ({spec(out)}): a loss. Reverse mode starts from the seed",
            f"dL/dL = 1.0 and differentiates with respect to {which}, as vk.grad does.",
        ]
    else:
        how = [
            f"{fname} returns {', '.join(tree_lines(out))}, not a scalar: explained as vk.vjp, with a seed",
            f"of that shape (one value per output element), differentiating with respect to {which}.",
        ]
    reached = sorted((r for r in rows if r["backward"] is not None), key=lambda r: r["backward"])
    unreached = [r["key"] for r in rows if r["backward"] is None]
    lines = [
        f"vk.explain({fname}): {len(rows)} layer call(s), traced for shapes only (nothing was computed).",
        *how,
        f"forward order:  {' -> '.join(r['key'] for r in rows)}",
        f"backward order: {' -> '.join(r['key'] for r in reached)}  (records are made, hooks run)",
    ]
    if unreached:
        lines.append(f"never reached by the backward pass (no record): {', '.join(unreached)}")
    scanned = [r for r in rows if r.get("iterations")]
    if scanned:
        each = ", ".join(f"{r['key']} x{' x '.join(map(str, r['iterations']))}" for r in scanned)
        lines.append(
            f"inside lax.scan (one record per iteration, shapes per iteration): {each}; "
            "iteration i is key[i] in Recorder series and plots"
        )
    sharded = [r for r in rows if r.get("shards")]
    if sharded:
        each = ", ".join(f"{r['key']} x{' x '.join(map(str, r['shards']))}" for r in sharded)
        lines.append(f"inside jax.shard_map (one record per shard, shapes per shard): {each}")
    return lines


def _cells(row: dict) -> list[Any]:
    if row["backward"] is None:
        unreached = ["(not reached)"]
        return [str(row["forward"]), row["key"], "-", "-", "-", *[unreached] * 3]
    gi = tree_lines(row["grad_input"]) if row["grad_input"] is not None else ["None: needs no gradient"]
    gp = row["grad_params"]
    gp_lines = ["None: not differentiated"] if gp is None else tree_lines(gp)
    if gp is not None and not jax.tree.leaves(gp):
        gp_lines = ["{}: no params"]
    its = row.get("iterations") or ()
    return [
        str(row["forward"]),
        f"{row['key']}{''.join(f'[:{n}]' for n in its)} (call {row['call']})",
        str(row["backward"]),
        tree_lines(row["input"]),
        tree_lines(row["output"]),
        tree_lines(row["grad_output"]),
        gi,
        gp_lines,
    ]


COLUMNS = ("fwd", "layer", "bwd", "input", "output", "grad_output", "grad_input", "grad_params")


def render_plain(header: list[str], rows: list[dict]) -> str:
    """The plain-text report: header lines, the table, and one sentence per field."""
    legend = [f"  {field:<12} {MEANING[field]}" for field in ("input", "output", *FIELDS[3:])]
    table = plain_table(COLUMNS, [_cells(r) for r in rows])
    return "\n".join(
        [*header, "", table, "", "what each is (fwd/bwd: position in forward/backward order):", *legend]
    )


def _render_rich(console: Any, header: list[str], rows: list[dict]) -> None:
    from rich.table import Table

    for line in header:
        console.print(line, highlight=False, markup=False)
    table = Table(show_lines=True)
    for col in COLUMNS:
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*("\n".join(c) if isinstance(c, list) else c for c in _cells(row)))
    console.print(table)
    from rich.markup import escape

    console.print("what each is (fwd/bwd: position in forward/backward order):", highlight=False)
    for field in ("input", "output", *FIELDS[3:]):
        console.print(f"  [bold]{field}[/bold]: {escape(MEANING[field])}", highlight=False)


def explain(
    fun: Callable,
    *args: Any,
    argnums: int | Sequence[int] = 0,
    file: TextIO | None = None,
    match: bool | None = None,
) -> list[dict]:
    """Prints and returns the shapes of every layer call's record, tracing shapes only.

    One trace of ``fun(*args)`` and its backward pass under ``jax.eval_shape``: nothing runs
    on data. A scalar output is a loss (seed 1.0, as ``vk.grad``); any other output is
    explained as ``vk.vjp(fun, *args)`` with a seed of the output's shape.

    Args:
        fun: a function that calls vjpkit layers, e.g. a loss ``loss(params, x, y)`` or
            ``model.apply``.
        *args: example arguments (arrays or ``jax.ShapeDtypeStruct``).
        argnums: the argument(s) differentiated, ``0`` (the params) as in training.
        file: where to print (default ``sys.stdout``); a table drawn by ``rich`` when it is
            installed and ``file`` is a terminal, plain text otherwise.
        match: find the layers of plain JAX code, as ``vk.grad(match=...)`` does.

    Returns:
        One dict per layer call, in forward order, with ``key``, ``name``, ``call``,
        ``forward`` and ``backward`` (positions in forward and backward order; ``backward`` is
        ``None`` for a call the backward pass never reaches), the record fields ``params``,
        ``input``, ``output``, ``grad_output``, ``grad_input``, ``grad_params`` as
        ``jax.ShapeDtypeStruct`` pytrees (``None`` where the record has ``None``),
        ``iterations`` (the enclosing ``lax.scan`` s' lengths, outermost first; the shapes are
        one iteration's), ``shards`` (the enclosing ``jax.shard_map`` s' shards, outermost first;
        the shapes are one shard's) and ``meaning``: one sentence per field about this call. Its
        ``other_uses`` attribute lists the parameters that plain-JAX matching found used outside
        any layer (weight decay in the loss): ``(leaves, primitive, where)`` each, also printed
        under the header.

    Raises:
        ConfigError: ``fun`` calls no vjpkit layer, or no arguments were given.

    Examples:
        >>> model = nn.serial(fc1=nn.dense(20), relu1=nn.relu(), fc2=nn.dense(2))
        >>> rows = vk.explain(model.apply, params, jnp.ones((64, 3)))
        >>> rows[0]["key"], rows[0]["grad_input"], rows[-1]["grad_output"].shape
        ('fc1', None, (64, 2))
    """
    if not callable(fun):
        raise ConfigError(f"vk.explain: fun must be callable, got {type(fun).__name__}.")
    if not args:
        raise ConfigError(
            "vk.explain needs fun's example arguments, e.g. vk.explain(loss_fn, params, x, y): "
            "it traces fun(*args) to learn every layer call's shapes."
        )
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums or any(not isinstance(i, int) or not -len(args) <= i < len(args) for i in nums):
        raise ConfigError(f"vk.explain: argnums={argnums!r} does not index the {len(args)} argument(s).")
    nums = tuple(i % len(args) for i in nums)
    fname = getattr(fun, "__name__", "fun")
    fname = "fun" if fname == "<lambda>" else fname
    traced, out, kind = _trace(fun, args, nums, match)
    if not traced.plan.order:
        message = NO_LAYER.format(fname=fname)
        if not traced.plan.config.match:
            message = message.replace(
                ", and plain-JAX matching found no layer either (a",
                " (plain-JAX matching is off: match=False or VJPKIT_MATCH=0; it finds a",
            )
        raise ConfigError(message)
    rows = Rows(_rows(traced, nums))
    rows.other_uses = tuple(traced.other_uses)
    header = _header(fname, out, kind, nums, rows) + _other_lines(rows.other_uses)
    file = sys.stdout if file is None else file
    console = rich_console(file)
    if console is not None:
        _render_rich(console, header, rows)
    else:
        print(render_plain(header, rows), file=file)
    return rows
