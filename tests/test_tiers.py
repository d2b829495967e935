"""The default tier's choice of eager twins (``conftest._full_only``), on stand-in test items."""

from __future__ import annotations

import types

import pytest

from tests.conftest import _full_only


def _items(module, specs):
    """Stand-in pytest items: ``(name, param id, slow)`` in file order, all in ``module``."""

    def item(name, pid, slow):
        return types.SimpleNamespace(
            nodeid=f"tests/test_x.py::{name}[{pid}]",
            name=f"{name}[{pid}]",
            originalname=name,
            module=module,
            callspec=types.SimpleNamespace(id=pid),
            get_closest_marker=lambda mark, slow=slow: object() if mark == "slow" and slow else None,
        )

    return [item(*spec) for spec in specs]


def _module(**attrs):
    mod = types.SimpleNamespace(test_a=lambda: None, test_b=lambda: None, **attrs)
    return mod


SPECS = [
    ("test_a", "eager", False),
    ("test_a", "jit", False),
    ("test_b", "eager", False),
    ("test_b", "jit", False),
]


def test_the_first_eager_twin_stays_by_default():
    assert _full_only(_items(_module(), SPECS)) == [False, False, True, False]


def test_a_file_names_its_eager_representative():
    assert _full_only(_items(_module(DEFAULT_TIER_EAGER="test_b"), SPECS)) == [True, False, False, False]


def test_a_misspelt_or_slow_representative_is_an_error():
    with pytest.raises(pytest.UsageError, match="names no test"):
        _full_only(_items(_module(DEFAULT_TIER_EAGER="test_c"), SPECS))
    slow = [("test_a", "eager", False), ("test_b", "eager", True), ("test_b", "jit", False)]
    with pytest.raises(pytest.UsageError, match="marked slow"):
        _full_only(_items(_module(DEFAULT_TIER_EAGER="test_b"), slow))
