"""The program engine: one driver, rules per primitive, sites with layouts, handlers for policy.

Contract: the facade every transform (``_autodiff``, ``_explicit``) and inspect tool uses; they
import nothing else from the engine. Rooms, dependencies pointing down:

* ``_driver``: ``configure``, ``trace``, ``replan``, ``linearize``, ``init_hook_state`` (the one driver),
  ``require_unsharded`` (for tools that need the whole batch's records);
* ``_plan`` (names, active calls, shapes) and ``_run`` (evaluation), both walking equations by
  ``_rules`` (one table keyed by primitive: planning, evaluation and the programs an equation
  holds side by side; its ``nested`` (with ``call_program`` and ``sub_programs`` on it) is how
  every other walker descends into programs);
* ``_site``: sites as spans of the program with a layout, found by site sources;
* ``_rule``: the custom_vjp rule, which builds the record and hands it to a handler;
* ``_handlers``: the policy (hooks, capture, host, explain log; ``tangent_hooks`` for forward
  mode's rule, ``vjpkit._jvp_rule``), composed with ``chain``;
* ``_slots`` / ``_carry``: probes, captured records and hook state out of the backward pass.

See ``docs/architecture.md``.
"""

from ._carry import Part as Part
from ._carry import part as part
from ._driver import Traced as Traced
from ._driver import configure as configure
from ._driver import init_hook_state as init_hook_state
from ._driver import linearize as linearize
from ._driver import replan as replan
from ._driver import require_unsharded as require_unsharded
from ._driver import trace as trace
from ._handlers import Handler as Handler
from ._handlers import chain as chain
from ._handlers import records as records
from ._handlers import tangent_hooks as tangent_hooks
from ._plan import Plan as Plan
from ._plan import Scanned as Scanned
from ._plan import Site as Site
from ._rules import RULES as RULES
from ._rules import Nested as Nested
from ._rules import Rule as Rule
from ._rules import call_program as call_program
from ._rules import nested as nested
from ._rules import registered_rule as registered_rule
from ._rules import sub_programs as sub_programs
from ._rules import with_programs as with_programs
from ._site import SOURCES as SOURCES
from ._site import Layout as Layout
from ._site import Span as Span
from ._site import registered_source as registered_source

__all__ = [
    "RULES",
    "SOURCES",
    "Handler",
    "Layout",
    "Nested",
    "Part",
    "Plan",
    "Rule",
    "Scanned",
    "Site",
    "Span",
    "Traced",
    "call_program",
    "chain",
    "configure",
    "init_hook_state",
    "linearize",
    "nested",
    "part",
    "records",
    "registered_rule",
    "registered_source",
    "replan",
    "require_unsharded",
    "sub_programs",
    "tangent_hooks",
    "trace",
    "with_programs",
]
