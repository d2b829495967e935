"""Layer-call names and the one glob matcher every API uses.

Contract: a layer call is named by its layer's path (``fc1``, ``block1/fc1``) and its call index
in one forward pass; its *key* is ``name`` for call 0 and ``name#k`` for the k-th later call
(``_records.call_key``). ``matches(name, call, glob)`` is how hooks, capture, the curvature
transform and the inspect tools choose calls:

* a glob without ``#`` is an ``fnmatch`` pattern over the name: it matches every call of a
  layer whose name matches (``fc*``, ``block1/*``);
* a glob with ``#`` matches one call key: ``emb#1`` the second call of ``emb``, ``emb#0`` (or
  ``emb``) the first, ``emb#*`` every call. The part before the last ``#`` is matched against
  the name and the part after it against the call index, both with ``fnmatch``.

``call=None`` stands for a layer as a whole (all its calls, as per-layer statistics are): only
globs without ``#`` or whose call part is ``*`` match it.

A layer called inside ``lax.scan`` is addressed per iteration by a trailing ``[i]`` (digits or
``*``, one per enclosing scan, outermost first: ``name#k[i][j]``): hooks and capture given
``blocks/fc[2]`` run on, and keep, iteration 2 only (``iterations``); the ``Recorder``'s series
and the plots are keyed ``blocks/fc[2]`` (``matches_key``): ``blocks/fc[2]`` matches only
``blocks/fc[2]``, ``blocks/fc[*]`` and ``blocks/fc`` every iteration.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable

from ._errors import ConfigError
from ._records import call_key


def matches(name: str, call: int | None, glob: str) -> bool:
    """Whether ``glob`` chooses call ``call`` of layer ``name`` (see the module contract).

    Examples:
        >>> matches("emb", 1, "emb"), matches("emb", 1, "emb#1"), matches("emb", 0, "emb#1")
        (True, True, False)
        >>> matches("emb", 0, "emb#0"), matches("block1/fc", 3, "block1/*#*")
        (True, True)
    """
    base, sep, index = glob.rpartition("#")
    if not sep:
        return fnmatch.fnmatchcase(name, glob)
    if call is None:
        return index == "*" and fnmatch.fnmatchcase(name, base)
    return fnmatch.fnmatchcase(name, base) and fnmatch.fnmatchcase(str(call), index)


def matches_any(name: str, call: int | None, globs: Iterable[str]) -> bool:
    """Whether any of ``globs`` chooses call ``call`` of layer ``name``."""
    return any(matches(name, call, g) for g in globs)


def split_key(key: str) -> tuple[str, int]:
    """``(name, call)`` of a call key: ``"fc#2"`` is ``("fc", 2)``, ``"fc"`` is ``("fc", 0)``."""
    base, sep, index = key.rpartition("#")
    if sep and index.isdigit():
        return base, int(index)
    return key, 0


_ITERATIONS = re.compile(r"((?:\[(?:\d+|\*)\])+)$")


def _split_iterations(s: str) -> tuple[str, tuple[str, ...]]:
    """``("blocks/fc#1", ("2",))`` for ``"blocks/fc#1[2]"``; no suffix: ``(s, ())``."""
    m = _ITERATIONS.search(s)
    if m is None:
        return s, ()
    return s[: m.start()], tuple(m.group(1)[1:-1].split("]["))


def iterations(glob: str) -> tuple[str, tuple[int | None, ...]]:
    """``(glob without its trailing [i]..., the iteration per enclosing scan)``; ``None`` for
    ``[*]``. Hooks and capture given ``blocks[2]`` run on, and keep, iteration 2 only.

    Examples:
        >>> iterations("blocks/fc[2]"), iterations("fc"), iterations("blocks[*][1]")
        (('blocks/fc', (2,)), ('fc', ()), ('blocks', (None, 1)))
    """
    base, wanted = _split_iterations(glob)
    return base, tuple(None if w == "*" else int(w) for w in wanted)


def check_glob(glob: str, who: str) -> None:
    """Raises when ``glob`` names scan iterations (a trailing ``[i]``) where the tool takes
    whole layers (curvature statistics)."""
    base, wanted = _split_iterations(glob)
    if wanted:
        raise ConfigError(
            f"{who}: the glob {glob!r} chooses scan iteration(s) {'/'.join(wanted)} of {base!r}, but "
            f"these statistics are per layer: ask for {base!r} (its entries are stacked on the "
            "iterations) and index them. Hooks and capture take iteration globs."
        )


def matches_key(key: str, glob: str) -> bool:
    """``matches`` for a call key (``fc``, ``fc#1``, ``blocks/fc[2]``), as results are keyed.

    Examples:
        >>> matches_key("blocks/fc[2]", "blocks/fc[2]"), matches_key("blocks/fc[1]", "blocks/fc[2]")
        (True, False)
        >>> matches_key("blocks/fc[1]", "blocks/*"), matches_key("blocks/fc[1]", "blocks/fc[*]")
        (True, True)
    """
    base, iterations = _split_iterations(key)
    glob_base, wanted = _split_iterations(glob)
    if wanted and (
        len(wanted) != len(iterations) or any(w not in ("*", i) for w, i in zip(wanted, iterations))
    ):
        return False
    return matches(*split_key(base), glob_base)


def call_keys(names: Iterable[str]) -> list[str]:
    """The call keys of layer ``names`` listed in forward order, a name once per call."""
    counts: dict[str, int] = {}
    keys = []
    for n in names:
        call = counts.get(n, 0)
        counts[n] = call + 1
        keys.append(call_key(n, call))
    return keys
