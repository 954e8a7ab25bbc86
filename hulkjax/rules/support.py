"""Which primitives hulkjax knows how to shard, and the replicated fallback for the rest.

A primitive is supported when one of the rule tables has a rule for it (dimension, follow,
candidate or loop rules), or when it has nothing to shard of its own (constants made in place, key
plumbing: :data:`hulkjax.trace.primitives.NO_DATA`). Every other primitive is replicated with a
warning and a plan note that say where it is and what the forced gathers cost; strict mode raises.
Control flow (``scan``, ``while``, ``cond``) is supported through its bodies: the check looks
inside them (an unsupported primitive in a scan body warns, or raises in strict mode, like one
outside), and replicates such operators there through the plan's loop-body layouts.

>>> from jax.extend.core import primitives as P
>>> is_supported(P.dot_general_p), is_supported(P.cholesky_p)
(True, False)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from jax.sharding import PartitionSpec

from hulkjax.errors import UnsupportedPrimitiveError, UnsupportedPrimitiveWarning
from hulkjax.plan.records import BodyPlan
from hulkjax.rules.dims import dim_rules, register_dim_rule
from hulkjax.rules.loops import loop_rules
from hulkjax.rules.sharding import candidate_rules, follow_rules
from hulkjax.trace.graph import OpGraph
from hulkjax.trace.primitives import KERNELS, NO_DATA

_TABLES = (dim_rules, follow_rules, candidate_rules, loop_rules)


def register_sharding_rule(prim) -> Callable:
    """Make ``prim`` known with a dimension rule ``(node, graph, operand, dim) -> ...`` (the same
    as ``register_dim_rule(prim)``): the cost model follows layouts through it and XLA keeps them.

    >>> from jax.extend.core import Primitive
    >>> my_op_p = Primitive("my_op")
    >>> @register_sharding_rule(my_op_p)
    ... def _my_op_rule(node, graph, operand, dim):
    ...     return dim
    >>> is_supported(my_op_p)
    True
    """
    return register_dim_rule(prim)


def is_supported(prim) -> bool:
    """Whether a primitive has a rule (or needs none)."""
    return handling(prim) != "unsupported"


def handling(prim) -> str:
    """How hulkjax handles a primitive, for coverage reports: ``"loop"`` (planned through its
    bodies), ``"leader"`` (a candidate rule: its layouts are chosen), ``"follow"`` (a follow rule),
    ``"dims"`` (follows through its dimension rule), ``"no data"`` (nothing to shard), or
    ``"unsupported"`` (replicated, with a warning).

    >>> from jax.extend.core import primitives as P
    >>> handling(P.dot_general_p), handling(P.tanh_p), handling(P.iota_p), handling(P.cholesky_p)
    ('leader', 'follow', 'no data', 'unsupported')
    """
    if prim in loop_rules:
        return "loop"
    if prim in candidate_rules:
        return "leader"
    if prim in follow_rules:
        return "follow"
    if prim in dim_rules:
        return "dims"
    if prim in NO_DATA:
        return "no data"
    return "unsupported"


def check_supported(graph: OpGraph, plan, *, strict: bool = False,
                    gather_cost: Callable[[list], str] | None = None) -> list[str]:
    """Replicate the operands and results of operators without a rule, warning once per primitive.

    Looks inside the bodies of ``scan`` / ``while`` / ``cond`` too (there, the operators are
    replicated through ``plan.bodies``). Returns the names of the unsupported primitives. In strict
    mode, raises :class:`UnsupportedPrimitiveError` naming the first one and its source line
    instead. ``gather_cost``: given the step's nodes of one such primitive, a phrase saying what
    gathering their operands costs (the caller's cost model); the warning and the plan's note
    quote it.
    """
    found: dict[str, list] = {}  # name -> [count, first node, the step's (not bodies') nodes]
    _check(graph, plan.operand_specs, plan.result_specs, plan.bodies, strict, found, "")
    for name, (count, node, nodes) in found.items():
        cost = f"; {gather_cost(nodes)}" if gather_cost is not None and nodes else ""
        message = (f"no sharding rule for {name!r} ({count} use(s), first at {node.source}); "
                   f"it was replicated{cost}.")
        warnings.warn(
            f"{message} Register one with @hulkjax.rules.register_sharding_rule, or pass "
            f"strict=True to make this an error.", UnsupportedPrimitiveWarning, stacklevel=3)
        plan.notes.append(message)
    return sorted(found)


def _check(graph: OpGraph, operand_specs, result_specs, bodies, strict: bool, found: dict,
           where: str) -> None:
    """Check one graph (the step's or a loop body's) and, recursively, the bodies of its loops.

    ``bodies`` is ``{loop node id: (BodyPlan per sub-graph, ...)}`` for this graph (a body's entry
    is made only when the body has something to replicate).
    """
    for node in graph.nodes:
        for b, sub in enumerate(node.subgraphs):
            inner = f"{where}body {b} of {node.name!r} node {node.id}, "

            def body_plan(node=node, b=b):
                table = bodies
                plans = list(table.get(node.id, ()))
                while len(plans) < len(node.subgraphs):
                    plans.append(BodyPlan())
                table[node.id] = tuple(plans)
                return plans[b]

            def lazy_specs(kind, body_plan=body_plan):
                return _LazySpecs(lambda: getattr(body_plan(), kind))

            _check(sub, lazy_specs("operand_specs"), lazy_specs("result_specs"),
                   _LazyBodies(lambda body_plan=body_plan: body_plan().bodies), strict, found,
                   inner)
        if is_supported(node.primitive) and not (node.primitive in KERNELS and node.kernel is None):
            continue
        if strict:
            raise UnsupportedPrimitiveError(
                f"no sharding rule for {node.name!r} ({where}node {node.id}, {node.source}). "
                f"Register one with @hulkjax.rules.register_sharding_rule({node.name}_p), or pass "
                f"strict=False to replicate it.")
        entry = found.setdefault(node.name, [0, node, []])
        entry[0] += 1
        if not where:
            entry[2].append(node)
        for k, v in enumerate(node.inputs):
            if v is not None and graph.values[v].shape:
                operand_specs[(node.id, k)] = PartitionSpec()
        for k, v in enumerate(node.outputs):
            if graph.values[v].shape:
                result_specs[(node.id, k)] = PartitionSpec()


class _LazySpecs:
    """A dict-like target for specs that finds its dict only when first written to."""

    def __init__(self, get):
        self._get = get

    def __setitem__(self, key, value):
        self._get()[key] = value


class _LazyBodies:
    """A body's nested-loop table, found (and its body plan made) only when first used."""

    def __init__(self, get):
        self._get = get

    def get(self, key, default=None):
        return self._get().get(key, default)

    def __setitem__(self, key, value):
        self._get()[key] = value
