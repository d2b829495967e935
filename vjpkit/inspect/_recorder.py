"""``Recorder``: captured statistics accumulated over training steps, in bounded memory.

Contract: a ``Recorder`` takes one step's captured dict at a time (``{call key:
Cotangents}`` as returned by ``capture=``, with numpy or jax arrays) and splits it into
*series*, one per ``(call key, field, tree path, reduction)``:

* the reduction is the key of a reduction dict (``{"norm": ..., "max": ...}``, from
  ``vk.capture(..., reduce=[...])``); with a single reduction the leaf is bare and its
  reduction is named after ``spec`` when given, else ``"value"``;
* a scalar leaf updates the series' running moments (count, mean and variance by Welford's
  method, min, max; NaN and Inf are counted in ``nonfinite`` and kept out of the moments) and
  its ring buffer of the last ``last`` ``(step, value)`` pairs;
* a non-scalar leaf (a ``vk.histogram`` vector, or a whole array captured with
  ``reduce=None``) goes to the ring buffer only.

Memory is ``O(series * last)`` whatever the number of steps. Exports (``to_dict``,
``to_csv``, ``to_jsonl``) hold the moments over all steps and the values in the ring buffers.
With ``tensorboard_dir`` every scalar is also written to TensorBoard event files through
``tensorboardX`` (imported when the recorder is made; it is in the ``log`` extra). The
recorder plugs into ``vk.train.fit(..., on_records=recorder.update)`` and into capture host
delivery, ``vk.capture(..., host=recorder.host(every=N))``. Updates are thread-safe.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import sys
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any, NamedTuple, TextIO

import jax
import numpy as np

from .. import _format
from .._capture import FIELDS, REDUCTION_NAMES, CaptureSpec, histogram
from .._errors import ConfigError
from .._host import on_host
from ._explain import plain_table, rich_console


class Series(NamedTuple):
    """The identity of one recorded series: ``("fc1", "grad_params", "weight", "norm")``."""

    key: str
    field: str
    path: str
    reduction: str


@dataclasses.dataclass
class _Stats:
    """Running moments of the finite scalar values (Welford) and the last values."""

    buffer: deque
    updates: int = 0
    count: int = 0
    mean: float = 0.0
    m2: float = 0.0
    min: float = math.inf
    max: float = -math.inf
    nonfinite: int = 0
    vector: bool = False

    def add(self, step: int, value: np.ndarray) -> None:
        self.updates += 1
        if value.ndim:
            self.vector = True
            self.buffer.append((step, np.array(value, copy=True)))
            return
        v = float(value)
        self.buffer.append((step, v))
        if not math.isfinite(v):
            self.nonfinite += 1
            return
        self.count += 1
        delta = v - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (v - self.mean)
        self.min = min(self.min, v)
        self.max = max(self.max, v)

    def moments(self) -> dict[str, Any]:
        n = self.count
        none = n == 0 or self.vector
        var = None if none else self.m2 / n
        return {
            "updates": self.updates,
            "count": n,
            "mean": None if none else self.mean,
            "var": var,
            "std": None if var is None else math.sqrt(var),
            "min": None if none else self.min,
            "max": None if none else self.max,
            "nonfinite": self.nonfinite,
        }


def _record_fields(rec: Any) -> Iterator[tuple[str, Any]]:
    if dataclasses.is_dataclass(rec) and hasattr(rec, "call"):
        for f in dataclasses.fields(rec):
            if f.name not in ("name", "call"):
                yield f.name, getattr(rec, f.name)
    else:
        yield "value", rec


def _parent_keysets(captured: dict) -> list[frozenset | None]:
    """For every leaf of a step's records, the key set of the dict holding it (None when the
    leaf is not in a dict: a bare array or scalar field)."""
    sets = []
    for rec in captured.values():
        for _, value in _record_fields(rec):
            if value is None:
                continue
            groups: dict[tuple, list] = {}
            for path, _ in jax.tree_util.tree_flatten_with_path(value)[0]:
                groups.setdefault(tuple(path[:-1]), []).append(path[-1] if path else None)
            for last in groups.values():
                dict_keys = all(isinstance(k, jax.tree_util.DictKey) for k in last)
                keys = frozenset(str(k.key) for k in last) if dict_keys else None
                sets += [keys] * len(last)
    return sets


def _reduction_keys(captured: dict, names: frozenset | None) -> frozenset | None:
    """The key set of the dicts that hold reductions in this step's records, or None.

    With the spec's reductions known (``names``, two or more), those are the reduction dicts.
    Without a spec, a dict is taken for reductions only if every leaf of the step sits in a dict
    with one same key set of reduction names: a multi-reduction capture replaces every leaf by
    such a dict, while a layer whose parameters are named ``mean``/``var``/``min``/``max``
    sits beside others named otherwise (or beside bare reduced arrays). When every captured
    leaf has such a parent, it is ambiguous: pass ``spec=`` to be exact.
    """
    if names is not None:
        return names if len(names) > 1 else None
    sets = _parent_keysets(captured)
    if sets and all(k is not None for k in sets) and len(set(sets)) == 1 and sets[0] <= REDUCTION_NAMES:
        return sets[0]
    return None


def _leaves(tree: Any, single: str, reductions: frozenset | None) -> Iterator[tuple[str, str, Any]]:
    """``(path, reduction, leaf)``: the keys of a dict of reductions become the reduction."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    parents: dict[tuple, list] = {}
    for path, _ in flat:
        parents.setdefault(tuple(path[:-1]), []).append(path[-1] if path else None)
    for path, leaf in flat:
        siblings = parents[tuple(path[:-1])]
        is_reduction = (
            reductions is not None
            and bool(path)
            and all(isinstance(k, jax.tree_util.DictKey) for k in siblings)
            and frozenset(str(k.key) for k in siblings) == reductions
        )
        if is_reduction:
            yield _format.path(path[:-1]), str(path[-1].key), leaf
        else:
            yield _format.path(path), single, leaf


def _iterations(key: str, reduction: str, leaf: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """A reduced leaf of a layer called inside ``lax.scan`` holds one reduction per iteration,
    stacked (a scalar per call, a histogram per call): one series per iteration, keyed
    ``key[i]`` (``key[i][j]`` under nested scans). Whole arrays (``"value"``) stay as they are."""
    lead = leaf.ndim - (1 if reduction == "histogram" else 0)
    if reduction == "value" or lead <= 0:
        yield key, leaf
        return
    for index in np.ndindex(*leaf.shape[:lead]):
        yield key + "".join(f"[{i}]" for i in index), leaf[index]


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.4g}"


class Recorder:
    """Running statistics and the last values of captured records, over training steps.

    Args:
        last: how many ``(step, value)`` pairs each series keeps (its ring buffer).
        spec: the ``vk.capture`` spec the records come from. It only names the reduction of
            bare leaves (a spec with one reduction); otherwise they are named ``"value"``.
        tensorboard_dir: also write every scalar to TensorBoard event files in this
            directory, tagged ``key/field/path/reduction`` with ``#`` in a call key written
            ``.call`` (``fc.call1/grad_params/weight/norm``). Needs ``tensorboardX``:
            ``pip install "vjpkit[log]"``.

    Examples:
        >>> spec = vk.capture("*", fields=["grad_output", "grad_params"], reduce=["norm", "max"])
        >>> recorder = vk.inspect.Recorder(last=100)
        >>> state, history = vk.train.fit(loss_fn, opt, params, data, batch_size=64, steps=500,
        ...                               capture=spec, on_records=recorder.update)
        >>> steps, norms = recorder.series("fc1", "grad_params", "weight", "norm")
        >>> text = recorder.summary()
    """

    def __init__(
        self, last: int = 100, *, spec: CaptureSpec | None = None, tensorboard_dir: str | None = None
    ):
        if not isinstance(last, int) or isinstance(last, bool) or last < 1:
            raise ConfigError(
                f"Recorder: last must be a positive int (the ring buffer length), got {last!r}."
            )
        if spec is not None and not isinstance(spec, CaptureSpec):
            raise ConfigError(f"Recorder: spec must be a vk.capture(...) spec, got {type(spec).__name__}.")
        self.last = last
        self._single = "value"
        self._names: frozenset | None = None  # the spec's reduction names, when known
        self._hist_range: tuple[float, float] | None = None
        if spec is not None:
            reduce = spec.reduce or ()
            names = [r.name if isinstance(r, histogram) else r for r in reduce]
            self._names = frozenset(names)
            if len(names) == 1:
                self._single = names[0]
            ranges = [r.range for r in reduce if isinstance(r, histogram)]
            self._hist_range = tuple(map(float, ranges[0])) if ranges else None
        self._stats: dict[Series, _Stats] = {}
        self._lock = threading.Lock()
        self._host_step = 0
        self.steps_seen = 0
        self.first_step: int | None = None
        self.last_step: int | None = None
        self._writer = None
        if tensorboard_dir is not None:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as err:
                raise ConfigError(
                    "Recorder(tensorboard_dir=...) writes event files with tensorboardX, which is not "
                    'installed. Install the log extra: pip install "vjpkit[log]" '
                    "(or: pip install tensorboardX)."
                ) from err
            self._writer = SummaryWriter(logdir=str(tensorboard_dir))

    # --- input -------------------------------------------------------------------------

    def update(self, step: int, captured: dict[str, Any]) -> None:
        """Adds one step's captured records; ``fit(..., on_records=recorder.update)``.

        Args:
            step: the training step (an int).
            captured: ``{call key: Cotangents}`` whose leaves are reduced scalars, dicts of
                reductions, histogram vectors or whole arrays (numpy or jax).
        """
        if not isinstance(captured, dict):
            raise ConfigError(
                "Recorder.update(step, captured): captured must be the dict {call key: Cotangents} "
                f"returned by capture=, got {type(captured).__name__}."
            )
        step = int(step)
        host = jax.device_get(captured)
        reductions = _reduction_keys(host, self._names)
        with self._lock:
            for key, rec in host.items():
                for field, value in _record_fields(rec):
                    if value is None:
                        continue
                    for path, reduction, leaf in _leaves(value, self._single, reductions):
                        for name, part in _iterations(str(key), reduction, np.asarray(leaf)):
                            self._add(Series(name, field, path, reduction), step, part)
            self.steps_seen += 1
            self.first_step = step if self.first_step is None else min(self.first_step, step)
            self.last_step = step if self.last_step is None else max(self.last_step, step)

    def _add(self, series: Series, step: int, value: np.ndarray) -> None:
        stats = self._stats.get(series)
        if stats is None:
            stats = self._stats[series] = _Stats(deque(maxlen=self.last))
        stats.add(step, value)
        if self._writer is None:
            return
        tag = "/".join(p for p in (series.key.replace("#", ".call"), *series[1:]) if p)
        if value.ndim == 0:
            self._writer.add_scalar(tag, float(value), step)
        elif series.reduction == "histogram" and value.ndim == 1:
            self._write_histogram(tag, value, step)

    def _write_histogram(self, tag: str, counts: np.ndarray, step: int) -> None:
        """A ``vk.histogram`` capture as a TensorBoard histogram: its bins over the spec's range
        (over bin indices 0..bins when the recorder has no spec to tell the range)."""
        bins = counts.shape[0]
        lo, hi = self._hist_range if self._hist_range is not None else (0.0, float(bins))
        edges = np.linspace(lo, hi, bins + 1)
        centers = (edges[:-1] + edges[1:]) / 2
        counts = np.asarray(counts, np.float64)
        filled = np.nonzero(counts)[0]
        if filled.size == 0:
            return
        self._writer.add_histogram_raw(
            tag,
            min=float(edges[filled[0]]),
            max=float(edges[filled[-1] + 1]),
            num=float(counts.sum()),
            sum=float((centers * counts).sum()),
            sum_squares=float((centers**2 * counts).sum()),
            bucket_limits=edges[1:].tolist(),
            bucket_counts=counts.tolist(),
            global_step=step,
        )

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Writes scalars such as the training loss and eval metrics to the TensorBoard events.

        ``vk.train.fit(..., on_metrics=recorder.log_metrics)`` writes ``train/loss`` every step
        and ``eval/<name>`` at each evaluation. Without ``tensorboard_dir`` nothing is written.
        """
        if self._writer is None:
            return
        with self._lock:
            for tag, value in metrics.items():
                self._writer.add_scalar(str(tag), float(value), int(step))

    def update_host(self, captured: dict[str, Any]) -> None:
        """Adds one delivery, numbering steps 0, 1, 2, ... itself.

        For ``vk.capture(..., host=vk.on_host(recorder.update_host))``. With ``every=N`` use
        ``host`` instead, which numbers the deliveries 0, N, 2N, ...
        """
        with self._lock:
            step = self._host_step
            self._host_step += 1
        self.update(step, captured)

    def host(self, every: int = 1) -> on_host:
        """A capture host delivery feeding this recorder: ``vk.capture(..., host=recorder.host(N))``.

        Deliveries happen at steps 0, N, 2N, ... of the transformed function, and are recorded
        with those step numbers.
        """

        def deliver(captured):
            with self._lock:
                step = self._host_step
                self._host_step += every
            self.update(step, captured)

        deliver.__qualname__ = "Recorder.host"
        return on_host(deliver, every=every)

    # --- queries -------------------------------------------------------------------------

    @property
    def keys(self) -> list[Series]:
        """Every series, in the order first seen."""
        return list(self._stats)

    def _find(self, key: str, field: str, path: str, reduction: str | None) -> Series:
        matches = [
            s
            for s in self._stats
            if (s.key, s.field, s.path) == (key, field, path) and reduction in (None, s.reduction)
        ]
        if len(matches) == 1:
            return matches[0]
        near = [tuple(s) for s in self._stats if s.key == key] or [tuple(s) for s in self._stats]
        what = "no series" if not matches else f"{len(matches)} series (pass reduction=)"
        raise ConfigError(
            f"Recorder: {what} for key={key!r}, field={field!r}, path={path!r}, reduction={reduction!r}. "
            f"Recorded (key, field, path, reduction): {near[:20]}{' ...' if len(near) > 20 else ''}"
        )

    def series(
        self, key: str, field: str, path: str = "", reduction: str | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The ring buffer of one series: ``(steps, values)``, oldest first.

        Args:
            key: the call key (``"fc1"``, ``"fc#1"``).
            field: ``grad_output``, ``grad_params``, ...
            path: the tree path inside the field, ``"weight"`` for ``grad_params["weight"]``,
                ``""`` for a bare array.
            reduction: ``"norm"``, ...; may be left out when only one matches.

        Returns:
            ``steps`` (int64, shape ``(n,)``) and ``values`` (float64, shape ``(n,)``, or
            ``(n, bins)`` for a vector series).

        Examples:
            >>> steps, norms = recorder.series("fc1", "grad_params", "weight", "norm")
        """
        stats = self._stats[self._find(key, field, path, reduction)]
        with self._lock:
            pairs = list(stats.buffer)
        steps = np.array([s for s, _ in pairs], dtype=np.int64)
        values = np.array([v for _, v in pairs], dtype=np.float64)
        return steps, values

    def stats(self, key: str, field: str, path: str = "", reduction: str | None = None) -> dict[str, Any]:
        """The running moments of one series over all steps (not only the ring buffer).

        Returns:
            ``{"updates", "count", "mean", "var", "std", "min", "max", "nonfinite"}``: ``count``
            finite values of ``updates`` received, ``var`` the population variance (as
            ``np.var``), ``nonfinite`` the NaN/Inf values left out. The moments are ``None`` for
            a vector series or when nothing finite arrived.

        Examples:
            >>> recorder.stats("fc1", "grad_params", "weight", "norm")["mean"]
        """
        return self._stats[self._find(key, field, path, reduction)].moments()

    # --- exports ------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready: ``{"last", "steps_seen", "first_step", "last_step", "series": [...]}``.

        Each series entry has ``key``, ``field``, ``path``, ``reduction``, the moments of
        ``stats``, and ``steps`` / ``values`` from the ring buffer (lists; a vector value
        is a list).
        """
        with self._lock:
            out = []
            for s, st in self._stats.items():
                pairs = list(st.buffer)
                out.append(
                    {
                        **s._asdict(),
                        **st.moments(),
                        "steps": [int(p) for p, _ in pairs],
                        "values": [v.tolist() if isinstance(v, np.ndarray) else v for _, v in pairs],
                    }
                )
            return {
                "last": self.last,
                "steps_seen": self.steps_seen,
                "first_step": self.first_step,
                "last_step": self.last_step,
                "series": out,
            }

    def _rows(self) -> list[tuple[int, Series, Any]]:
        with self._lock:
            rows = [
                (step, s, v.tolist() if isinstance(v, np.ndarray) else v)
                for s, st in self._stats.items()
                for step, v in st.buffer
            ]
        order = {s: i for i, s in enumerate(self._stats)}
        return sorted(rows, key=lambda r: (r[0], order[r[1]]))

    def to_csv(self, path: str) -> str:
        """Writes the ring buffers as CSV, one row per step per series, and returns ``path``.

        Columns: ``step, key, field, path, reduction, value``. A vector value is written as a
        JSON list; non-finite values as ``nan``, ``inf``, ``-inf`` (``float()`` reads them back).
        """
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["step", *Series._fields, "value"])
            for step, s, v in self._rows():
                writer.writerow([step, *s, json.dumps(v) if isinstance(v, list) else repr(v)])
        return path

    def to_jsonl(self, path: str) -> str:
        """Writes the ring buffers as JSON lines, one object per step per series; returns ``path``.

        Keys: ``step, key, field, path, reduction, value``. Non-finite values are written as
        ``NaN`` / ``Infinity``, which Python's ``json`` reads back.
        """
        with open(path, "w") as f:
            for step, s, v in self._rows():
                f.write(json.dumps({"step": step, **s._asdict(), "value": v}) + "\n")
        return path

    def summary(self, file: TextIO | None = None) -> str:
        """Prints one table per layer call (``rich`` on a terminal, else plain text); returns the text.

        Columns: field, path, reduction, count (finite values), mean, std, min, max, the number
        of non-finite values, and the last value.
        """
        header = ["field", "path", "reduction", "count", "mean", "std", "min", "max", "nonfinite", "last"]
        with self._lock:
            by_key: dict[str, list] = {s.key: [] for s in self._stats}  # layers in the order first seen
            field_order = {f: i for i, f in enumerate(FIELDS)}
            ordered = sorted(
                self._stats.items(), key=lambda kv: (field_order.get(kv[0].field, 99), kv[0][2:])
            )
            for s, st in ordered:
                m = st.moments()
                last_v = st.buffer[-1][1] if st.buffer else None
                if isinstance(last_v, np.ndarray):
                    last_s = f"vector[{','.join(map(str, last_v.shape))}]"
                else:
                    last_s = _fmt(last_v)
                count = f"{m['updates']} vec" if st.vector else str(m["count"])
                by_key[s.key].append(
                    [
                        s.field,
                        s.path or "-",
                        s.reduction,
                        count,
                        *(_fmt(m[k]) for k in ("mean", "std", "min", "max")),
                        str(m["nonfinite"]),
                        last_s,
                    ]
                )
            span = "" if self.first_step is None else f", steps {self.first_step}..{self.last_step}"
            title = (
                f"vk.inspect.Recorder: {self.steps_seen} update(s){span}, {len(self._stats)} series, "
                f"last {self.last} values kept per series"
            )
        blocks = [title]
        for key, rows in by_key.items():
            blocks += ["", key, plain_table(header, rows)]
        text = "\n".join(blocks)
        file = sys.stdout if file is None else file
        console = rich_console(file)
        if console is None:
            print(text, file=file)
        else:
            from rich.table import Table

            console.print(title, highlight=False, markup=False)
            for key, rows in by_key.items():
                table = Table(title=key, title_justify="left")
                for col in header:
                    table.add_column(
                        col, justify="right" if col not in ("field", "path", "reduction") else "left"
                    )
                for row in rows:
                    table.add_row(*row)
                console.print(table)
        return text

    # --- tensorboard ----------------------------------------------------------------------

    def flush(self) -> None:
        """Flushes the TensorBoard writer, if any."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Closes the TensorBoard writer, if any (the recorder keeps its data)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Recorder(last={self.last}, series={len(self._stats)}, steps_seen={self.steps_seen})"
