"""Plots of captured cotangents: gradient flow over steps, histograms, and one step's backward shapes.

Contract: every function takes plain host data (numpy arrays, or records as ``vk.capture`` and
``fit(..., on_records=...)`` deliver them), returns a ``matplotlib.figure.Figure``, and with
``path=`` also saves it as a PNG (``dpi=120``) through ``save``. matplotlib is imported
lazily, inside the functions, so ``import vjpkit`` never needs it; when it is missing the
functions raise an ``ImportError`` that names the ``plot`` extra (``pip install "vjpkit[plot]"``).

No display and no backend choice are needed: when ``matplotlib.pyplot`` has not been imported,
the figures are standalone ``Figure`` objects drawn with Agg, never registered with pyplot (so
nothing accumulates in a training loop). When the caller has already imported pyplot, they are
made with ``pyplot.figure`` instead, so that ``plt.show()`` and notebooks show them.

Bad input (an empty history, a field that was not captured, records that hold the wrong
reduction) raises ``vjpkit.ConfigError`` saying what was expected and what to pass.
"""

from __future__ import annotations

import io
import math
import pathlib
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .. import _format
from .._capture import REDUCTION_NAMES, histogram
from .._errors import ConfigError
from .._names import matches_key
from .._records import Cotangents

DPI = 120
_MEANING = {
    "grad_output": "dL/dy",
    "grad_input": "dL/dx",
    "grad_params": "dL/dparams",
    "output": "y",
    "input": "x",
    "params": "params",
}


# --------------------------------------------------------------------------- matplotlib, lazily


def _matplotlib():
    try:
        import matplotlib
    except ImportError as err:  # the tests block the import to check this message
        raise ImportError(
            'vjpkit\'s plots need matplotlib, which is in the "plot" extra: pip install "vjpkit[plot]"'
        ) from err
    return matplotlib


def _figure(figsize: tuple[float, float]):
    """A new figure: pyplot's if the caller uses pyplot, else a standalone Agg-drawn one."""
    _matplotlib()
    if "matplotlib.pyplot" in sys.modules:
        import matplotlib.pyplot as plt

        return plt.figure(figsize=figsize)
    from matplotlib.figure import Figure

    return Figure(figsize=figsize)


def save(fig: Any, path: str | pathlib.Path, *, dpi: int = DPI, palette: bool = True) -> pathlib.Path:
    """Saves ``fig`` at ``path`` (parent directories are created); returns the path.

    Args:
        fig: a matplotlib figure, e.g. from ``plot_gradient_flow``.
        path: where to write; the format follows the suffix (no suffix: PNG).
        dpi: resolution; 120 gives figures of roughly 1000 to 1600 pixels across.
        palette: for PNG, store an adaptive 256-color palette (through Pillow, which
            matplotlib depends on) instead of full RGBA: about 3 times smaller, and the same
            to the eye for line plots, histograms and diagrams. ``False`` keeps full color.

    Returns:
        The path written, as a ``pathlib.Path``.

    Examples:
        >>> fig = plot_gradient_flow(history)
        >>> save(fig, "out/gradient_flow.png")
        PosixPath('out/gradient_flow.png')
    """
    _matplotlib()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    options = dict(dpi=dpi, facecolor="white", bbox_inches="tight", pad_inches=0.15)
    png = path.suffix.lower() in ("", ".png")
    if not (png and palette):
        fig.savefig(path, format="png" if png else None, **options)
        return path
    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", **options)
    buffer.seek(0)
    with Image.open(buffer) as image:
        small = image.convert("RGB").quantize(256)
    small.save(path, format="png", optimize=True, dpi=(dpi, dpi))
    return path


def _finish(fig: Any, path: str | pathlib.Path | None) -> Any:
    if path is not None:
        save(fig, path)
    return fig


def _colors(n: int) -> list:
    """Distinct colors: tab10 up to 10 lines, tab20 beyond (cycled)."""
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


# --------------------------------------------------------------------------- reading records


def _leaves(value: Any) -> list[tuple[str, Any]]:
    """``(path label, leaf)`` pairs of a field's pytree; ``[]`` for ``None`` and ``{}``."""
    flat, _ = jax.tree_util.tree_flatten_with_path(value, is_leaf=_is_reduction_dict)
    out = []
    for path, leaf in flat:
        out.append((_format.path(path), leaf))
    return out


def _is_reduction_dict(x: Any) -> bool:
    """A ``{reduction: value}`` dict, as ``vk.capture`` makes for a list of reductions."""
    return isinstance(x, Mapping) and bool(x) and set(x) <= REDUCTION_NAMES


def _check_field(field: str) -> None:
    if field not in _MEANING:
        raise ConfigError(f"unknown record field {field!r}; choose from {list(_MEANING)}.")


def _pick(leaf: Any, reduction: str, key: str, field: str) -> Any:
    """The ``reduction`` entry of a multi-reduction leaf, or the leaf itself."""
    if not _is_reduction_dict(leaf):
        return leaf
    if reduction not in leaf:
        raise ConfigError(
            f"layer {key!r}, {field}: the records hold the reductions {sorted(leaf)}, which do not "
            f"include {reduction!r}; capture with reduce={reduction!r} (or a list that contains it)."
        )
    return leaf[reduction]


def _select(keys: Iterable[str], layers: str | Sequence[str] | None, known: Iterable[str] = ()) -> list[str]:
    """``keys`` filtered and ordered by ``layers`` (call keys or globs), in that order.

    A glob that matches none of ``keys`` nor of ``known`` (keys present in the records but with
    nothing to draw, such as a ``relu``'s empty ``grad_params``) is an error.
    """
    keys = list(keys)
    if layers is None:
        return keys
    everything = keys + [k for k in known if k not in keys]
    globs = [layers] if isinstance(layers, str) else list(layers)
    chosen: list[str] = []
    for glob in globs:
        if not any(matches_key(k, glob) for k in everything):
            raise ConfigError(f"layers: {glob!r} matches no layer; the records have {everything}.")
        chosen += [k for k in keys if matches_key(k, glob) and k not in chosen]
    if not chosen:
        raise ConfigError(f"layers: {layers!r} selects no layer with something to draw among {keys}.")
    return chosen


def _field_norm(rec: Any, field: str, key: str) -> float | None:
    """sqrt(sum of squared leaf norms) of ``rec.<field>``, or ``None`` when it has no leaves."""
    leaves = _leaves(getattr(rec, field))
    if not leaves:
        return None
    total = 0.0
    for _, leaf in leaves:
        leaf = np.asarray(_pick(leaf, "norm", key, field), dtype=np.float64)
        total += float(np.sum(np.square(leaf)))  # a captured norm is a scalar: its square
    return math.sqrt(total)


def _as_step_records(history: Any) -> list[tuple[int, Mapping]]:
    """A list of ``(step, captured)`` from a list of captured dicts or of ``(step, captured)`` pairs."""
    out = []
    for i, item in enumerate(history):
        if (
            isinstance(item, tuple)
            and len(item) == 2
            and isinstance(item[1], Mapping)
            and np.ndim(item[0]) == 0
        ):
            step, captured = int(item[0]), item[1]
        elif isinstance(item, Mapping):
            step, captured = i, item
        else:
            raise ConfigError(
                "plot_gradient_flow: each history entry must be one step's captured dict "
                "{key: vk.Cotangents} (or a (step, captured) pair, as fit's on_records receives); "
                f"entry {i} is a {type(item).__name__}."
            )
        for key, rec in captured.items():
            if not isinstance(rec, Cotangents):
                raise ConfigError(
                    f"plot_gradient_flow: entry {i}, key {key!r} is a {type(rec).__name__}, not a "
                    "vk.Cotangents record."
                )
        out.append((step, captured))
    return out


def _is_recorder(x: Any) -> bool:
    """Duck-typed ``vk.inspect.Recorder``: ``keys`` (series ids) and ``series(...)``."""
    return (
        not isinstance(x, Mapping) and hasattr(x, "series") and hasattr(x, "keys") and hasattr(x, "to_dict")
    )


def _recorder_series(recorder: Any, field: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per-layer norms from a Recorder's ring buffers: the ``"norm"`` series of ``field``
    (``"value"`` series when the recorder was made without ``spec=`` for ``reduce="norm"``)."""
    ids = [tuple(s) for s in recorder.keys]
    if not ids:
        raise ConfigError("plot_gradient_flow: the Recorder is empty: no step was recorded.")
    mine = [s for s in ids if s[1] == field]
    if not mine:
        raise ConfigError(
            f"plot_gradient_flow: the Recorder holds no {field!r} series; capture it, e.g. "
            f"vk.capture('*', fields=[{field!r}], reduce='norm')."
        )
    reduction = "norm" if any(s[3] == "norm" for s in mine) else "value"
    chosen = [s for s in mine if s[3] == reduction]
    if not chosen:
        raise ConfigError(
            f"plot_gradient_flow: the Recorder's {field} series are reduced by "
            f"{sorted({s[3] for s in mine})}, not 'norm'; capture with reduce='norm' (or a list with it)."
        )
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for key in dict.fromkeys(s[0] for s in chosen):
        total: dict[str, dict[int, float]] = {}  # series name -> step -> squared norm
        for s in chosen:
            if s[0] != key:
                continue
            steps, values = recorder.series(*s)
            values = np.asarray(values, dtype=np.float64)
            if reduction == "value" and values.ndim != 1:
                raise ConfigError(f"plot_gradient_flow: the Recorder series {s} is not scalar per step.")
            # a layer inside lax.scan has one norm per iteration, stacked: one series per block,
            # named key[i] (key[i][j] under nested scans)
            for index in np.ndindex(*values.shape[1:]):
                name = key + "".join(f"[{i}]" for i in index)
                series = total.setdefault(name, {})
                for step, v in zip(steps.tolist(), values[(slice(None), *index)].tolist()):
                    series[step] = series.get(step, 0.0) + v * v
        for name, series in total.items():
            steps = np.asarray(sorted(series), dtype=np.float64)
            out[name] = (steps, np.sqrt([series[int(t)] for t in steps]))
    return out


def gradient_flow_series(
    history: Any, field: str = "grad_params"
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per-layer norm series ``{key: (steps, norms)}`` from captured records, as plotted by
    ``plot_gradient_flow``.

    Args:
        history: a list of per-step captured dicts ``{key: vk.Cotangents}`` (or of
            ``(step, captured)`` pairs, which is what ``fit``'s ``on_records(step, captured)``
            receives), captured with ``reduce="norm"`` (or whole arrays, ``reduce=None``); a
            ``vk.inspect.Recorder`` fed such records (its ring buffers: the last ``last``
            steps; its ``"norm"`` series, or its ``"value"`` series when it was made without
            ``spec=``); or an already computed mapping ``{key: (steps, norms)}``.
        field: the record field: ``"grad_params"``, ``"grad_output"``, ``"grad_input"``, ...

    Returns:
        ``{key: (steps, norms)}``, float64 norms, in the order keys first appear. A field with
        several leaves (``grad_params``' ``weight`` and ``bias``) is one norm per step: the
        square root of the sum of the squared leaf norms, i.e. the norm of all of the layer's
        parameter gradients as one vector. Layers whose field has no leaves (the
        ``grad_params`` of ``relu``) are left out.

    Examples:
        >>> series = gradient_flow_series(records, "grad_params")
        >>> steps, norms = series["fc2"]
    """
    _check_field(field)
    if _is_recorder(history):
        return _recorder_series(history, field)
    if isinstance(history, Mapping):
        if not history:
            raise ConfigError("plot_gradient_flow: the history is empty: no layer, no step.")
        first = next(iter(history.values()))
        if isinstance(first, Cotangents):
            raise ConfigError(
                "plot_gradient_flow: got one step's captured dict {key: vk.Cotangents}; the flow is "
                "over steps, so pass a list of them (one per step), e.g. collected with "
                "fit(..., on_records=lambda step, captured: history.append((step, captured)))."
            )
        out = {}
        for key, value in history.items():
            try:
                steps, norms = value
                steps, norms = np.asarray(steps, dtype=np.float64), np.asarray(norms, dtype=np.float64)
            except (TypeError, ValueError) as err:
                raise ConfigError(
                    f"plot_gradient_flow: history[{key!r}] must be a pair (steps, norms) of 1-D "
                    f"sequences; got {type(value).__name__}."
                ) from err
            if steps.ndim != 1 or steps.shape != norms.shape:
                raise ConfigError(
                    f"plot_gradient_flow: history[{key!r}]: steps and norms must be 1-D of one length; "
                    f"got shapes {steps.shape} and {norms.shape}."
                )
            out[str(key)] = (steps, norms)
        return out
    if isinstance(history, (str, bytes)) or not isinstance(history, Iterable):
        raise ConfigError(
            "plot_gradient_flow: history must be a list of per-step captured dicts or a mapping "
            f"{{key: (steps, norms)}}; got {type(history).__name__}."
        )
    records = _as_step_records(list(history))
    if not records:
        raise ConfigError(
            "plot_gradient_flow: the history is empty (no step was recorded). Collect each step's "
            "captured dict, e.g. fit(..., capture=vk.capture('*', fields=['grad_params'], "
            "reduce='norm'), on_records=lambda step, captured: history.append((step, captured)))."
        )
    steps: dict[str, list[int]] = {}
    norms: dict[str, list[float]] = {}
    captured_field = False
    for step, captured in records:
        for key, rec in captured.items():
            value = getattr(rec, field)
            if value is None:
                continue
            captured_field = True
            norm = _field_norm(rec, field, key)
            if norm is None:
                continue
            steps.setdefault(key, []).append(step)
            norms.setdefault(key, []).append(norm)
    if not captured_field:
        raise ConfigError(
            f"plot_gradient_flow: no record holds {field!r}; capture it, e.g. "
            f"vk.capture('*', fields=[{field!r}], reduce='norm')."
        )
    if not norms:
        raise ConfigError(f"plot_gradient_flow: no layer has any {field} leaf (no layer has parameters?).")
    return {k: (np.asarray(steps[k], dtype=np.float64), np.asarray(norms[k])) for k in norms}


# --------------------------------------------------------------------------- gradient flow


def plot_gradient_flow(
    history: Any,
    *,
    field: str = "grad_params",
    layers: str | Sequence[str] | None = None,
    path: str | pathlib.Path | None = None,
    ax: Any = None,
    title: str | None = None,
) -> Any:
    """Per-layer gradient norm over training steps: one line per layer, log y scale.

    Vanishing gradients show as lines that sink decades below the others, exploding ones as
    lines that climb; a healthy net keeps its layers within a decade or two of each other.

    Args:
        history: either a list with one captured dict ``{key: vk.Cotangents}`` per step (or
            ``(step, captured)`` pairs, exactly what ``vk.train.fit(..., on_records=...)``
            receives), captured with ``reduce="norm"`` (each leaf a scalar norm; with a list of
            reductions the ``"norm"`` entry is used) or as whole arrays (``reduce=None``);
            a ``vk.inspect.Recorder`` fed such records (its last ``last`` steps); or a
            mapping ``{key: (steps, norms)}`` of ready series. Steps default to the list index.
            A single reduction other than ``"norm"`` cannot be told from a norm: do not pass
            records captured with ``reduce="mean"`` and the like.
        field: the record field to plot: ``"grad_params"`` (default), ``"grad_output"`` or
            ``"grad_input"``. For ``grad_params`` the leaves of one layer are combined into one
            norm per step, ``sqrt(sum of the squared leaf norms)`` (the norm of weight and bias
            gradients concatenated); layers without parameters are skipped. Steps whose norm is
            NaN or Inf are drawn as x marks along the top edge; zeros, which a log scale cannot
            show, leave gaps.
        layers: call keys or globs choosing the lines and their legend order (default: all, in
            the order they first appear; ``fit`` delivers keys sorted by name).
        path: if given, also save the figure there as a PNG.
        ax: draw into this matplotlib ``Axes`` instead of a new figure.
        title: the title (default: says which norm is shown).

    Returns:
        The ``matplotlib.figure.Figure``.

    Raises:
        ConfigError: an empty history, a field that no record holds, records that are not
            ``vk.Cotangents``, or a single step's captured dict instead of a list of steps.

    Examples:
        >>> history = []
        >>> spec = vk.capture("*", fields=["grad_params"], reduce="norm")
        >>> state, _ = vk.train.fit(loss_fn, optax.sgd(0.1), params, (x, y), batch_size=32, steps=100,
        ...                         capture=spec, on_records=lambda s, c: history.append((s, c)))
        >>> fig = plot_gradient_flow(history, path="gradient_flow.png")
    """
    recorder = _is_recorder(history)
    if not (recorder or isinstance(history, (Mapping, str))) and isinstance(history, Iterable):
        history = list(history)  # read twice below; a generator would be spent
    series = gradient_flow_series(history, field)
    if recorder:
        known = {s[0] for s in map(tuple, history.keys)}
    elif isinstance(history, Mapping):
        known = set()
    else:
        known = {k for _, c in _as_step_records(history) for k in c}
    keys = _select(series, layers, known)
    own_figure = ax is None
    if own_figure:
        fig = _figure((8.5, 4.8))
        ax = fig.add_subplot()
    else:
        _matplotlib()
        fig = ax.figure
    many = max(len(series[k][0]) for k in keys) <= 40
    for key, color in zip(keys, _colors(len(keys))):
        steps, norms = series[key]
        shown = np.where(np.isfinite(norms) & (norms > 0), norms, np.nan)  # log scale: gaps, not errors
        ax.plot(steps, shown, color=color, lw=1.6, marker="o" if many else None, ms=3, label=key)
        bad = ~np.isfinite(norms)
        if bad.any():  # NaN/Inf: x marks along the top edge, in the layer's color
            ax.plot(
                steps[bad],
                np.full(int(bad.sum()), 0.97),
                ls="none",
                marker="x",
                ms=7,
                mew=2,
                color=color,
                transform=ax.get_xaxis_transform(),
                label=f"{key}: NaN/Inf",
            )
    ax.set_yscale("log")
    ax.set_xlabel("step")
    label = "parameter gradients" if field == "grad_params" else field
    ax.set_ylabel(f"‖{field}‖ (L2 norm, log scale)")
    ax.set_title(title or f"Gradient flow: per-layer norm of the {label} ({_MEANING[field]})")
    ax.grid(True, which="major", alpha=0.45)
    ax.grid(True, which="minor", alpha=0.15)
    if len(keys) > 8:
        ax.legend(title="layer", loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    else:
        ax.legend(title="layer", fontsize=9, ncols=2 if len(keys) > 4 else 1, framealpha=0.85)
    if own_figure:
        fig.tight_layout()
    return _finish(fig, path)


# --------------------------------------------------------------------------- histograms


def _bin_range(bins_range: Any) -> tuple[float, float] | None:
    if bins_range is None:
        return None
    if isinstance(bins_range, histogram):
        bins_range = bins_range.range
    try:
        lo, hi = (float(v) for v in bins_range)
    except (TypeError, ValueError) as err:
        raise ConfigError(
            f"plot_histograms: bins_range must be (lo, hi) or the vk.histogram used to capture; "
            f"got {bins_range!r}."
        ) from err
    if not lo < hi:
        raise ConfigError(f"plot_histograms: bins_range needs lo < hi, got {(lo, hi)}.")
    return lo, hi


def _panel_data(rec: Any, field: str, key: str, counts_range: tuple[float, float] | None):
    """``[(label, counts, edges)]`` for one panel, plus a note; ``None`` when nothing to draw."""
    value = getattr(rec, field)
    leaves = _leaves(value)
    if not leaves:
        return None
    label_of = (lambda p: p or field) if field != "grad_params" else (lambda p: p or "params")
    if counts_range is not None:
        out = []
        for p, leaf in leaves:
            counts = np.asarray(_pick(leaf, "histogram", key, field), dtype=np.float64)
            if counts.ndim != 1 or np.any(counts < 0) or np.any(counts != np.round(counts)):
                raise ConfigError(
                    f"plot_histograms: bins_range= means the records hold vk.histogram counts, but "
                    f"layer {key!r}, {field} {p} is {_shape_str(leaf)} and not a 1-D vector of counts. "
                    "For whole-array records (capture with reduce=None) leave bins_range out."
                )
            edges = np.linspace(counts_range[0], counts_range[1], counts.size + 1)
            out.append((label_of(p), counts, edges))
        total = sum(float(c.sum()) for _, c, _ in out)
        return out, f"{total:.0f} values; edge bins hold the outliers"
    arrays = []
    for p, leaf in leaves:
        if _is_reduction_dict(leaf):
            if "histogram" in leaf:
                raise ConfigError(
                    f"plot_histograms: layer {key!r}, {field} holds vk.histogram counts; pass the "
                    "range they were captured with as bins_range=(lo, hi) (or the vk.histogram itself)."
                )
            raise ConfigError(
                f"plot_histograms: layer {key!r}, {field} holds the reductions {sorted(leaf)}; "
                "histograms need whole arrays (capture with reduce=None) or vk.histogram counts."
            )
        a = np.asarray(leaf, dtype=np.float64).ravel()
        if a.size == 1 and np.ndim(leaf) == 0:
            raise ConfigError(
                f"plot_histograms: layer {key!r}, {field} {p or ''} is a scalar, so the records were "
                "reduced (reduce='norm'?). Histograms need whole arrays (capture with reduce=None), "
                "or vk.histogram(bins, range) counts together with bins_range=range."
            )
        arrays.append((label_of(p), a))
    finite = [a[np.isfinite(a)] for _, a in arrays]
    bound = max((float(np.max(np.abs(f))) for f in finite if f.size), default=0.0) or 1.0
    edges = np.linspace(-bound, bound, _BINS + 1)
    out = [
        (label, np.histogram(f, bins=edges)[0].astype(np.float64), edges)
        for (label, _), f in zip(arrays, finite)
    ]
    every = np.concatenate([a for _, a in arrays])
    bad = int(np.sum(~np.isfinite(every)))
    finite_all = every[np.isfinite(every)]
    note = f"std {np.std(finite_all):.2e}" if finite_all.size else "no finite value"
    zeros = float(np.mean(finite_all == 0)) if finite_all.size else 0.0
    if zeros >= 0.01:
        note += f"\n{zeros:.0%} exactly 0"
    if bad:
        note += f"\n{bad} NaN/Inf not shown"
    return out, note


_BINS = 41


def plot_histograms(
    captured: Mapping[str, Any],
    *,
    fields: Sequence[str] = ("grad_output", "grad_params"),
    bins_range: Any = None,
    layers: str | Sequence[str] | None = None,
    log: bool = True,
    path: str | pathlib.Path | None = None,
    title: str | None = None,
) -> Any:
    """Per-layer histograms of one step's cotangents: one row per layer, one column per field.

    Args:
        captured: one step's captured dict ``{key: vk.Cotangents}``, either of whole arrays
            (``capture=...`` with ``reduce=None``; the histograms are computed here with numpy,
            41 bins symmetric about 0 spanning the panel's largest magnitude, NaN and Inf left
            out and counted in the panel's note) or of ``vk.histogram(bins, range)`` counts
            (then pass that range as ``bins_range``).
        fields: the record fields, one column each. A field with several leaves (``weight`` and
            ``bias`` of ``grad_params``) draws one outline per leaf in the same panel.
        bins_range: ``None`` for whole-array records; for histogram-reduced records the
            ``(lo, hi)`` they were captured with, or the ``vk.histogram`` itself. The first and
            last bins of ``vk.histogram`` also count the values below and above the range.
        layers: call keys or globs choosing the rows and their order (default: all, in the
            dict's order: backward order for an un-jitted ``vk.grad``, while ``jax.jit`` and
            ``fit`` return dicts with sorted keys).
        log: log scale for the counts (default), so the tails stay visible.
        path: if given, also save the figure there as a PNG.
        title: the figure title.

    Returns:
        The ``matplotlib.figure.Figure``.

    Raises:
        ConfigError: an empty dict, fields that no record holds, reduced records (norms) where
            arrays or counts are needed, or counts without ``bins_range``.

    Examples:
        >>> spec = vk.capture("*", fields=["grad_output", "grad_params"])
        >>> grads, captured = vk.grad(loss_fn, capture=spec)(params, x, y)
        >>> fig = plot_histograms(captured, path="histograms.png")
        >>> spec = vk.capture("*", fields=["grad_output"], reduce=vk.histogram(32, (-0.01, 0.01)))
        >>> grads, counts = vk.grad(loss_fn, capture=spec)(params, x, y)
        >>> fig = plot_histograms(counts, fields=["grad_output"], bins_range=(-0.01, 0.01))
    """
    if not isinstance(captured, Mapping):
        raise ConfigError(
            "plot_histograms: captured must be one step's dict {key: vk.Cotangents}; "
            f"got {type(captured).__name__}."
        )
    if not captured:
        raise ConfigError("plot_histograms: captured is empty: no layer was captured.")
    for key, rec in captured.items():
        if not isinstance(rec, Cotangents):
            raise ConfigError(
                f"plot_histograms: captured[{key!r}] is a {type(rec).__name__}, not a vk.Cotangents record."
            )
    fields = [fields] if isinstance(fields, str) else list(fields)
    if not fields:
        raise ConfigError("plot_histograms: fields is empty.")
    for field in fields:
        _check_field(field)
        if all(getattr(rec, field) is None for rec in captured.values()):
            raise ConfigError(
                f"plot_histograms: no record holds {field!r}; capture it, e.g. "
                f"vk.capture('*', fields={fields!r}), or choose fields=."
            )
    counts_range = _bin_range(bins_range)
    keys = _select(captured, layers)
    panels = {(k, f): _panel_data(captured[k], f, k, counts_range) for k in keys for f in fields}

    nrows, ncols = len(keys), len(fields)
    fig = _figure((4.3 * ncols + 0.6, 1.55 * nrows + 0.9))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    colors = _colors(10)
    for i, key in enumerate(keys):
        for j, field in enumerate(fields):
            ax = axes[i][j]
            panel = panels[(key, field)]
            if i == 0:
                ax.set_title(f"{field}  ({_MEANING[field]})", fontsize=11, pad=8)
            if j == 0:
                ax.set_ylabel(key, fontsize=10, rotation=0, ha="right", va="center", labelpad=8)
            if panel is None:
                value = getattr(captured[key], field)
                text = (
                    "not captured"
                    if value is None
                    else "no parameters"
                    if field == "grad_params"
                    else "empty"
                )
                ax.text(0.5, 0.5, text, ha="center", va="center", color="0.5", transform=ax.transAxes)
                ax.set_xticks([])
                ax.set_yticks([])
                for spine in ax.spines.values():
                    spine.set_color("0.85")
                continue
            parts, note = panel
            floor = 0.5 if log else 0.0  # log scale: empty bins sit on a floor below the axis
            for (label, counts, edges), color in zip(parts, colors):
                shown = np.maximum(counts, floor)
                if len(parts) == 1:
                    ax.stairs(shown, edges, baseline=floor, fill=True, color=color, alpha=0.35, lw=0)
                ax.stairs(shown, edges, baseline=floor, color=color, lw=1.3, label=label)
            if log:
                ax.set_yscale("log")
                top = max(float(c.max()) for _, c, _ in parts)
                ax.set_ylim(0.7, max(top * 2.5, 3.0))
            else:
                ax.set_ylim(bottom=0)
            ax.axvline(0.0, color="0.35", lw=0.7, ls=":")
            ax.ticklabel_format(axis="x", style="sci", scilimits=(-2, 3))
            ax.xaxis.get_offset_text().set_fontsize(8)
            ax.tick_params(labelsize=8)
            ax.text(0.98, 0.95, note, ha="right", va="top", fontsize=7.5, color="0.3", transform=ax.transAxes)
            if len(parts) > 1:
                ax.legend(fontsize=7.5, loc="upper left", frameon=False, handlelength=1.2)
    scale = "log scale" if log else "linear scale"
    fig.suptitle(title or f"Cotangent histograms of one step, per layer (count, {scale})", fontsize=12)
    fig.supxlabel("value", fontsize=10)
    fig.tight_layout()
    return _finish(fig, path)


# --------------------------------------------------------------------------- backward shapes


def _shape_str(x: Any) -> str:
    """``float32[64,30]`` for anything with shape and dtype; strings pass through."""
    if x is None:
        return "None"
    if isinstance(x, str):
        return x
    if getattr(x, "shape", None) is not None and getattr(x, "dtype", None) is not None:
        return _format.spec(x)
    if isinstance(x, (tuple, list)) and all(isinstance(d, (int, np.integer)) for d in x):
        return "(" + ", ".join(map(str, x)) + ("," if len(x) == 1 else "") + ")"
    return str(x)


def _is_shape_leaf(x: Any) -> bool:
    """A shape string, a shape tuple of ints, an array-like, or None: one line of the diagram."""
    if x is None or isinstance(x, str) or hasattr(x, "shape"):
        return True
    return isinstance(x, tuple) and all(isinstance(d, (int, np.integer)) for d in x)


def _shapes_text(value: Any) -> list[str]:
    """One line per leaf: ``float32[64,30]`` alone, ``weight  float32[20,30]`` inside a container.

    ``[]`` for ``None``, ``{}`` and empty strings; strings are shown as given.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return []
    if _is_shape_leaf(value):
        return [_shape_str(value)]
    flat = jax.tree_util.tree_flatten_with_path(value, is_leaf=_is_shape_leaf)[0]
    return [f"{_format.path(path)}  {_shape_str(leaf)}" for path, leaf in flat]


def _is_none(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower().startswith("none"))


def _shape_rows(rows: Any) -> list[dict]:
    """Normalises rows (dicts, or a captured mapping of whole-array records) to plain dicts."""
    if isinstance(rows, Mapping):
        if not rows:
            raise ConfigError("plot_backward_shapes: no layer call to draw (the records are empty).")
        out = []
        for key, rec in rows.items():
            if not isinstance(rec, Cotangents):
                raise ConfigError(
                    f"plot_backward_shapes: rows[{key!r}] is a {type(rec).__name__}; pass a list of row "
                    "dicts or a captured dict {key: vk.Cotangents} of whole arrays."
                )
            if any(np.ndim(leaf) == 0 for _, leaf in _leaves(rec.grad_output)):
                raise ConfigError(
                    f"plot_backward_shapes: the records hold reductions (grad_output of {key!r} is a "
                    "scalar); capture whole arrays (reduce=None), or pass vk.explain's rows."
                )
            out.append(
                dict(
                    name=key,
                    grad_output=rec.grad_output,
                    grad_input=rec.grad_input,
                    grad_params=rec.grad_params,
                )
            )
        return out
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Iterable):
        raise ConfigError(f"plot_backward_shapes: rows must be a list of dicts; got {type(rows).__name__}.")
    rows = list(rows)
    if not rows:
        raise ConfigError("plot_backward_shapes: no layer call to draw (rows is empty).")
    if all(isinstance(r, Mapping) and "backward" in r for r in rows):  # vk.explain's rows: forward order
        rows = sorted((r for r in rows if r["backward"] is not None), key=lambda r: r["backward"])
        if not rows:
            raise ConfigError("plot_backward_shapes: the backward pass reaches none of these layer calls.")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ConfigError(f"plot_backward_shapes: row {i} is a {type(row).__name__}, not a dict.")
        name = row.get("key") or row.get("name")
        if name is None:
            raise ConfigError(f"plot_backward_shapes: row {i} has neither 'key' nor 'name': {sorted(row)}.")
        call = row.get("call", 0)
        if "key" not in row and isinstance(call, int) and call > 0:
            name = f"{name}#{call}"
        missing = [f for f in ("grad_output",) if f not in row]
        if missing:
            raise ConfigError(f"plot_backward_shapes: row {i} ({name!r}) has no {missing[0]!r}.")
        out.append(
            dict(
                name=str(name),
                grad_output=row.get("grad_output"),
                grad_input=row.get("grad_input"),
                grad_params=row.get("grad_params"),
            )
        )
    return out


def plot_backward_shapes(
    rows: Any,
    *,
    layers: str | Sequence[str] | None = None,
    path: str | pathlib.Path | None = None,
    title: str | None = None,
) -> Any:
    """A diagram of one step's backward pass: one row per layer call, in backward order.

    Each row reads left to right the way the cotangent flows through the layer:
    ``grad_output`` (dL/dy, arriving from above) → the layer call → ``grad_input`` (dL/dx,
    sent to the layer below), with the call's ``grad_params`` (dL/dparams) on the right. A grey
    elbow arrow joins a row's ``grad_input`` to the next row's ``grad_output`` when the two have
    the same shape (in a serial chain they are the same array). ``grad_input`` drawn as "None"
    means the input needs no gradient, and then it is never computed.

    Args:
        rows: the layer calls, in backward order, as either
            * a list of dicts with ``"name"`` (or ``"key"``; an int ``"call"`` > 0 appends
              ``#call`` to a name), ``"grad_output"``, ``"grad_input"`` and ``"grad_params"``.
              Values may be shape strings (``"float32[64,30]"``), shape tuples, objects with
              ``.shape`` and ``.dtype`` (arrays, ``jax.ShapeDtypeStruct``), ``None`` (or a string
              starting with "None"), and for ``grad_params`` a dict of those per leaf. Other
              keys (``"input"``, ``"output"``, ...) are ignored. When every row has an int
              ``"backward"`` position, as ``vk.explain``'s rows (which come in forward order)
              do, the rows are drawn sorted by it, and rows whose ``"backward"`` is ``None``
              (calls the backward pass never reaches) are left out.
            * or one step's captured dict ``{key: vk.Cotangents}`` of whole arrays, e.g. from
              ``vk.grad(loss_fn, capture="*")``. Un-jitted, its order is backward order;
              ``jax.jit`` returns dicts with sorted keys, so then pass ``layers=``.
        layers: names or globs choosing the rows and their order (default: all, as given).
        path: if given, also save the figure there as a PNG.
        title: the title.

    Returns:
        The ``matplotlib.figure.Figure``.

    Raises:
        ConfigError: no rows, a row without a name or ``grad_output``, or reduced records.

    Examples:
        >>> rows = [
        ...     dict(name="fc2", grad_output="float32[64,2]", grad_input="float32[64,20]",
        ...          grad_params={"weight": "float32[20,2]", "bias": "float32[2]"}),
        ...     dict(name="relu", grad_output="float32[64,20]", grad_input="float32[64,20]", grad_params={}),
        ...     dict(name="fc1", grad_output="float32[64,20]", grad_input=None,
        ...          grad_params={"weight": "float32[3,20]", "bias": "float32[20]"}),
        ... ]
        >>> fig = plot_backward_shapes(rows, path="backward_shapes.png")
    """
    from matplotlib.patches import FancyBboxPatch

    table = _shape_rows(rows)
    if layers is not None:
        by_name = {row["name"]: row for row in table}
        table = [by_name[k] for k in _select(by_name, layers)]
    n = len(table)
    most = max(
        max(len(_shapes_text(r[f])) for f in ("grad_output", "grad_input", "grad_params")) for r in table
    )
    pitch = max(1.0, 0.45 + 0.2 * most)  # row spacing, data units
    box_h = 0.56  # box height for one line of text
    heights = [
        max(box_h, 0.2 + 0.19 * max(len(_shapes_text(r["grad_output"])), len(_shapes_text(r["grad_input"]))))
        for r in table
    ]
    col = {"gout": 1.7, "layer": 5.0, "gin": 8.3, "gp": 10.25}  # centres (gp: left edge)
    width = {"gout": 2.9, "layer": 2.3, "gin": 2.9}
    fig = _figure((13.0, 0.78 * n * pitch + 1.6))
    ax = fig.add_subplot()
    ax.set_xlim(-0.1, 13.6)
    ax.set_ylim(-(n - 1) * pitch - 0.45, 1.45)
    ax.axis("off")

    style = {
        "gout": dict(fc="#fde7cf", ec="#d9822b"),
        "layer": dict(fc="#dbe8f6", ec="#3d6fa6"),
        "layer_np": dict(fc="#eef2f6", ec="#8797a8"),
        "gin": dict(fc="#dcf0dc", ec="#3f8f3f"),
        "none": dict(fc="#f2f2f2", ec="#b0b0b0"),
        "gp": dict(fc="#ece3f5", ec="#7a57a3"),
    }

    def box(x, y, w, h, text, kind, **text_kw):
        ax.add_patch(
            FancyBboxPatch(
                (x - w / 2, y - h / 2),
                w,
                h,
                boxstyle="round,pad=0.02,rounding_size=0.08",
                lw=1.2,
                **style[kind],
            )
        )
        ax.text(x, y, text, ha="center", va="center", **text_kw)

    def arrow(x0, y0, x1, y1, color="0.25", ls="-"):
        ax.annotate(
            "",
            xy=(x1, y1),
            xytext=(x0, y0),
            arrowprops=dict(arrowstyle="-|>", color=color, lw=1.3, ls=ls, shrinkA=0, shrinkB=0),
        )

    head_y = 0.95
    heads = [
        (col["gout"], "grad_output\ndL/dy, arriving from above"),
        (col["layer"], "layer call\n(backward order, top to bottom)"),
        (col["gin"], "grad_input\ndL/dx, sent to the layer below"),
    ]
    for x, text in heads:
        ax.text(x, head_y, text, ha="center", va="center", fontsize=10, fontweight="bold", linespacing=1.35)
    ax.text(
        col["gp"],
        head_y,
        "grad_params\ndL/dparams of this call",
        ha="left",
        va="center",
        fontsize=10,
        fontweight="bold",
        linespacing=1.35,
    )
    mono = dict(family="monospace", fontsize=9.5)
    joined = False  # any dashed grad_input -> next grad_output connector drawn
    for i, row in enumerate(table):
        y = -i * pitch
        gout = _shapes_text(row["grad_output"])
        h = heights[i]
        box(col["gout"], y, width["gout"], h, "\n".join(gout) or "?", "gout", **mono)
        has_params = bool(_shapes_text(row["grad_params"]))
        box(
            col["layer"],
            y,
            width["layer"],
            h,
            row["name"],
            "layer" if has_params else "layer_np",
            fontsize=11,
            fontweight="bold" if has_params else "normal",
        )
        gin_none = _is_none(row["grad_input"])
        gin_text = (
            "None: needs no gradient\n(never computed)"
            if gin_none
            else "\n".join(_shapes_text(row["grad_input"]))
        )
        box(
            col["gin"],
            y,
            width["gin"],
            h,
            gin_text,
            "none" if gin_none else "gin",
            **(dict(fontsize=8.5, style="italic", color="0.35") if gin_none else mono),
        )
        arrow(col["gout"] + width["gout"] / 2, y, col["layer"] - width["layer"] / 2, y)
        arrow(
            col["layer"] + width["layer"] / 2,
            y,
            col["gin"] - width["gin"] / 2,
            y,
            color="0.6" if gin_none else "0.25",
        )
        params = _shapes_text(row["grad_params"])
        if params:
            h = max(box_h, 0.2 + 0.19 * len(params))
            ax.add_patch(
                FancyBboxPatch(
                    (col["gp"], y - h / 2),
                    3.25,
                    h,
                    boxstyle="round,pad=0.02,rounding_size=0.08",
                    lw=1.2,
                    **style["gp"],
                )
            )
            ax.text(col["gp"] + 0.15, y, "\n".join(params), ha="left", va="center", linespacing=1.25, **mono)
        else:
            ax.text(col["gp"] + 0.15, y, "no parameters", ha="left", va="center", fontsize=9, color="0.55")
        if i + 1 < n and not gin_none:
            nxt = _shapes_text(table[i + 1]["grad_output"])
            if nxt == _shapes_text(row["grad_input"]):
                joined = True
                ym = y - pitch / 2
                x0, x1 = col["gin"], col["gout"]
                ax.plot([x0, x0, x1], [y - h / 2, ym, ym], color="0.6", lw=1.0, ls="--")
                arrow(x1, ym, x1, y - pitch + heights[i + 1] / 2, color="0.6", ls="--")
    if joined:
        ax.text(
            col["gout"] - width["gout"] / 2,
            -(n - 1) * pitch - heights[-1] / 2 - 0.22,
            "dashed: the grad_input a layer sends down is the grad_output of the layer below it (next row)",
            ha="left",
            va="top",
            fontsize=9,
            color="0.45",
        )
        ax.set_ylim(-(n - 1) * pitch - 0.8, 1.45)
    ax.set_title(
        title or "One step's backward pass: the cotangents of each layer call and their shapes",
        fontsize=12,
        pad=4,
    )
    fig.tight_layout()
    return _finish(fig, path)
