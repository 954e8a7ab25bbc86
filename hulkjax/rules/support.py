"""Which primitives hulkjax knows how to shard, and the replicated fallback for the rest.

A primitive is supported when the dimension table has a rule for it, or when it is one of the
data-movement operators the SPMD partitioner handles by itself (slicing, gathers, padding, iota,
...). Control flow (``scan``, ``while``, ``cond``) is supported through its bodies: the check looks
inside them (an unsupported primitive in a scan body warns, or raises in strict mode, like one
outside), and replicates such operators there through the plan's loop-body layouts.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from jax.extend.core import primitives as P
from jax.sharding import PartitionSpec

from hulkjax.errors import UnsupportedPrimitiveError, UnsupportedPrimitiveWarning
from hulkjax.rules.dims import dim_rules
from hulkjax.trace.graph import OpGraph

_PARTITIONER_HANDLED = [
    "iota", "slice", "dynamic_slice", "dynamic_update_slice", "gather", "scatter", "scatter_add",
    "scatter_mul", "scatter_min", "scatter_max", "pad", "rev", "concatenate", "sort", "top_k",
    "argsort", "clamp", "expand_dims", "select_and_scatter_add", "select_and_gather_add",
    "reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
    "reduce_precision", "random_bits", "random_seed", "random_wrap", "random_unwrap",
    "threefry2x32", "sharding_constraint", "stop_gradient", "bitcast_convert_type", "erf_inv",
    "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count", "clz",
    "scan", "while", "cond", "split", "device_put", "optimization_barrier", "name",
]
_known: set = set(dim_rules)
for _n in _PARTITIONER_HANDLED:
    if hasattr(P, f"{_n}_p"):
        _known.add(getattr(P, f"{_n}_p"))
_known_names = set(_PARTITIONER_HANDLED)


def register_sharding_rule(prim) -> Callable:
    """Mark ``prim`` as supported with a dimension rule ``(node, graph, operand, dim) -> ...``.

    >>> from jax.extend.core import primitives as P
    >>> @register_sharding_rule(P.cumsum_p)
    ... def _cumsum_rule(node, graph, operand, dim):
    ...     return None if dim == node.params["axis"] else dim
    """

    def deco(rule):
        dim_rules[prim] = rule
        _known.add(prim)
        return rule

    return deco


def is_supported(prim) -> bool:
    """Whether a primitive has a rule (or needs none)."""
    return prim in _known or prim in dim_rules or getattr(prim, "name", None) in _known_names


def check_supported(graph: OpGraph, plan, *, strict: bool = False) -> list[str]:
    """Replicate the operands and results of operators without a rule, warning once per primitive.

    Looks inside the bodies of ``scan`` / ``while`` / ``cond`` too (there, the operators are
    replicated through ``plan.bodies``). Returns the names of the unsupported primitives. In strict
    mode, raises :class:`UnsupportedPrimitiveError` naming the first one and its source line
    instead.
    """
    found: dict[str, list] = {}  # name -> [count, first node]
    _check(graph, plan.operand_specs, plan.result_specs, lambda: plan.bodies, strict, found, "")
    for name, (count, node) in found.items():
        warnings.warn(
            f"no sharding rule for {name!r} ({count} use(s), first at {node.source}); "
            f"it was replicated. Register one with @hulkjax.rules.register_sharding_rule, or pass "
            f"strict=True to make this an error.", UnsupportedPrimitiveWarning, stacklevel=3)
    if found:
        plan.notes.append(f"replicated operators without a sharding rule: {sorted(found)}")
    return sorted(found)


def _check(graph: OpGraph, operand_specs, result_specs, bodies, strict: bool, found: dict,
           where: str) -> None:
    """Check one graph (the step's or a loop body's) and, recursively, the bodies of its loops.

    ``bodies()`` returns ``{loop node id: (BodyPlan per sub-graph, ...)}`` for this graph (built
    only when a body has something to replicate).
    """
    for node in graph.nodes:
        for b, sub in enumerate(node.subgraphs):
            inner = f"{where}body {b} of {node.name!r} node {node.id}, "

            def body_plan(node=node, b=b):
                from hulkjax.strategies.plan import BodyPlan

                table = bodies()
                plans = list(table.get(node.id, ()))
                while len(plans) < len(node.subgraphs):
                    plans.append(BodyPlan())
                table[node.id] = tuple(plans)
                return plans[b]

            def lazy_specs(kind, body_plan=body_plan):
                return _LazySpecs(lambda: getattr(body_plan(), kind))

            _check(sub, lazy_specs("operand_specs"), lazy_specs("result_specs"),
                   lambda body_plan=body_plan: body_plan().bodies, strict, found, inner)
        if is_supported(node.primitive):
            continue
        if strict:
            raise UnsupportedPrimitiveError(
                f"no sharding rule for {node.name!r} ({where}node {node.id}, {node.source}). "
                f"Register one with @hulkjax.rules.register_sharding_rule({node.name}_p), or pass "
                f"strict=False to replicate it.")
        entry = found.setdefault(node.name, [0, node])
        entry[0] += 1
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
