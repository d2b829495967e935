"""vjpkit: every layer's backward pass, visible, exact and programmable.

Examples:
    >>> import vjpkit as vk
    >>> from vjpkit import nn
"""

from . import _foreign  # noqa: F401  (registers the Flax linen interceptor with the scope)
from . import curvature as curvature
from . import inspect as inspect
from . import nn as nn
from . import train as train
from ._autodiff import grad as grad
from ._autodiff import init_hook_state as init_hook_state
from ._autodiff import value_and_grad as value_and_grad
from ._capture import CaptureSpec as CaptureSpec
from ._capture import capture as capture
from ._capture import histogram as histogram
from ._errors import ConfigError as ConfigError
from ._errors import HookError as HookError
from ._errors import HostHookError as HostHookError
from ._errors import NonFiniteError as NonFiniteError
from ._errors import SeedError as SeedError
from ._errors import VjpkitError as VjpkitError
from ._explicit import hvp as hvp
from ._explicit import jacobian as jacobian
from ._explicit import jvp as jvp
from ._explicit import linearize as linearize
from ._explicit import vjp as vjp
from ._hook_base import HookState as HookState
from ._hook_base import HookTransform as HookTransform
from ._hook_base import before as before
from ._hookable import hookable as hookable
from ._hooks import hook_chain as hook_chain
from ._host import on_host as on_host
from ._records import Cotangents as Cotangents
from ._records import Tangents as Tangents
from ._transforms import AccumulateState as AccumulateState
from ._transforms import AddNoiseState as AddNoiseState
from ._transforms import EmaNormalizeState as EmaNormalizeState
from ._transforms import accumulate_stats as accumulate_stats
from ._transforms import add_noise as add_noise
from ._transforms import clip_by_norm as clip_by_norm
from ._transforms import ema_normalize as ema_normalize
from ._transforms import scale as scale
from ._transforms import zero as zero
from .inspect import explain as explain

__version__ = "0.1.0"

__all__ = [
    "AccumulateState",
    "AddNoiseState",
    "CaptureSpec",
    "ConfigError",
    "Cotangents",
    "EmaNormalizeState",
    "HookError",
    "HookState",
    "HookTransform",
    "HostHookError",
    "NonFiniteError",
    "SeedError",
    "Tangents",
    "VjpkitError",
    "accumulate_stats",
    "add_noise",
    "before",
    "capture",
    "clip_by_norm",
    "curvature",
    "ema_normalize",
    "explain",
    "grad",
    "histogram",
    "hook_chain",
    "hookable",
    "hvp",
    "init_hook_state",
    "inspect",
    "jacobian",
    "jvp",
    "linearize",
    "nn",
    "on_host",
    "scale",
    "train",
    "value_and_grad",
    "vjp",
    "zero",
]
