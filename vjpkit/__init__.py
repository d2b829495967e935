"""vjpkit: every layer's backward pass, visible, exact and programmable.

>>> import vjpkit as vk
>>> from vjpkit import nn
"""

from . import nn as nn
from ._autodiff import grad as grad
from ._autodiff import value_and_grad as value_and_grad
from ._errors import ConfigError as ConfigError
from ._errors import HookError as HookError
from ._errors import HostHookError as HostHookError
from ._errors import SeedError as SeedError
from ._errors import VjpkitError as VjpkitError
from ._host import on_host as on_host
from ._records import Cotangents as Cotangents
from ._records import Tangents as Tangents

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "Cotangents",
    "HookError",
    "HostHookError",
    "SeedError",
    "Tangents",
    "VjpkitError",
    "grad",
    "nn",
    "on_host",
    "value_and_grad",
]
