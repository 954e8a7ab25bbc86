"""The planner registry: every planner is ``(graph, topology, options) -> Plan``, registered by name
with the dataclass of options it takes.

Optax gives every optimizer one shape; we give every planner one: a benchmark is a loop over
:func:`names`, a test is parameterized over it, and options are typed. ``hj.plan(...,
strategy="ilp", time_limt=5)`` raises :class:`~hulkjax.errors.UnknownOptionError` naming the
valid options instead of ignoring the typo.

>>> names()[:3]
['replicate', 'dp', 'fsdp']
>>> options_of("ilp").time_limit
60.0
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hulkjax.errors import InvalidOptionError, UnknownOptionError, UnknownStrategyError
from hulkjax.heap import collector_paused
from hulkjax.plan.records import Plan
from hulkjax.trace.graph import OpGraph

Planner = Callable[..., Plan]


@dataclass(frozen=True)
class Strategy:
    """A registered planner.

    Attributes:
      name: the strategy name (``"dp"``, ``"ilp"``, ...).  # str
      fn: ``fn(graph, topology)`` or, with options, ``fn(graph, topology, options)``.
      options: the frozen dataclass of its options (``None``: it takes none).
    """

    name: str
    fn: Planner
    options: type | None = None

    def __call__(self, graph: OpGraph, topology, **options) -> Plan:
        """Run the planner with ``options`` (checked against its options dataclass)."""
        opts = make_options(self, options)
        return self.fn(graph, topology) if opts is None else self.fn(graph, topology, opts)


strategies: dict[str, Strategy] = {}


def register_strategy(name: str, *, options: type | None = None) -> Callable[[Planner], Planner]:
    """Register a planner under ``name``.

    Args:
      name: the strategy name users pass as ``strategy=``.
      options: a dataclass whose fields are the planner's options (with defaults); the planner is
        then called as ``fn(graph, topology, options)``. Without one it is called as
        ``fn(graph, topology)`` and takes no options.

    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True, kw_only=True)
    ... class MyOptions:
    ...     axis: str = "data"  # the mesh axis to split the batch over
    >>> @register_strategy("doc-example", options=MyOptions)
    ... def my_planner(graph, topology, options):
    ...     ...
    >>> options_of("doc-example").axis
    'data'
    >>> del strategies["doc-example"]
    """
    if options is not None and not dataclasses.is_dataclass(options):
        raise InvalidOptionError(f"register_strategy({name!r}, options={options!r}): options must "
                                 f"be a dataclass type whose fields are the planner's options.")

    def deco(fn: Planner) -> Planner:
        strategies[name] = Strategy(name, fn, options)
        return fn

    return deco


# Built-in planners in the order tables and plots show them; user-registered ones follow.
_ORDER = ("replicate", "dp", "fsdp", "megatron", "dp_tp", "expert", "zero", "pipeline", "ilp",
          "auto")


def names() -> list[str]:
    """Registered strategy names: the built-in ones in a fixed order, then user-registered ones."""
    builtin = [n for n in _ORDER if n in strategies]
    return builtin + [n for n in strategies if n not in _ORDER]


def get_strategy(name: str) -> Strategy:
    """The planner registered as ``name``."""
    try:
        return strategies[name]
    except (KeyError, TypeError):
        raise UnknownStrategyError(
            f"unknown strategy {name!r}; choose one of {names()} or register your own with "
            f"@hulkjax.strategies.register_strategy({name!r}).") from None


def option_fields(strategy: str | Strategy) -> dict[str, Any]:
    """``{option: default}`` of a strategy's options (``{}`` when it takes none)."""
    s = strategy if isinstance(strategy, Strategy) else get_strategy(strategy)
    if s.options is None:
        return {}
    return {f.name: (f.default if f.default is not dataclasses.MISSING else None)
            for f in dataclasses.fields(s.options) if f.init}


def options_of(strategy: str | Strategy, **options):
    """The options object a strategy would run with (defaults, overridden by ``options``)."""
    s = strategy if isinstance(strategy, Strategy) else get_strategy(strategy)
    return make_options(s, options)


def make_options(s: Strategy, given: dict[str, Any]):
    """``s.options(**given)``, or ``None`` for a planner without options; an unknown name raises
    :class:`UnknownOptionError` listing the valid ones."""
    valid = option_fields(s)
    unknown = sorted(set(given) - set(valid))
    if unknown:
        import difflib

        hints = [f"{u!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(u, valid, 1))
                 else repr(u) for u in unknown]
        listed = ", ".join(f"{k}={v!r}" for k, v in valid.items()) or "none"
        raise UnknownOptionError(
            f"strategy {s.name!r} has no option {', '.join(hints)}. Its options are: {listed}.")
    if s.options is None:
        return None
    try:
        return s.options(**given)
    except (TypeError, ValueError) as e:
        raise InvalidOptionError(f"strategy {s.name!r}: {e}") from e


@collector_paused()  # see hulkjax.heap: planning allocates much and frees little
def run_planner(name: str, graph: OpGraph, topology, **options) -> Plan:
    """Run a registered planner and stamp the plan with timing and fingerprints."""
    s = get_strategy(name)
    opts = make_options(s, options)
    t0 = time.perf_counter()
    plan = s.fn(graph, topology) if opts is None else s.fn(graph, topology, opts)
    plan.planning_time = time.perf_counter() - t0
    plan.graph_fingerprint = graph.fingerprint()
    plan.topology_fingerprint = topology.fingerprint()
    plan.topology = topology
    plan.graph = graph
    plan.in_tree = graph.in_tree
    plan.out_tree = graph.out_tree
    return plan
