"""FLOPs of one equation, from a table keyed by primitive (like ``jax.experimental.roofline``).

A primitive without an entry costs 0 FLOPs (data movement only). ``scan``/``while``/``cond`` are not in
the table: the tracer costs them from their bodies.

>>> from jax.extend.core import primitives as P

from hulkjax.trace.primitives import ELEMENTWISE, PER_INPUT_ELEMENT
>>> flops_of(P.dot_general_p, [(8, 16), (16, 32)], [(8, 32)],
...          {"dimension_numbers": (((1,), (0,)), ((), ()))})
8192.0
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from jax.extend.core import primitives as P

from hulkjax.trace.primitives import ELEMENTWISE, PER_INPUT_ELEMENT

Shape = tuple[int, ...]
FlopsRule = Callable[[Sequence[Shape], Sequence[Shape], dict], float]

flops_rules: dict[object, FlopsRule] = {}


def _size(shape: Shape) -> float:
    # math.prod of ints is exact, as np.prod in float64 is below 2**53
    return float(math.prod(shape)) if shape else 1.0


def register_flops(*prims) -> Callable[[FlopsRule], FlopsRule]:
    """Register one FLOPs rule ``(in_shapes, out_shapes, params) -> float`` for primitives.

    Public: a primitive hulkjax does not know costs 0 FLOPs (memory traffic only) until its FLOPs
    are registered here (``hulkjax.rules.register_flops`` re-exports it).
    """

    def deco(rule: FlopsRule) -> FlopsRule:
        for p in prims:
            flops_rules[p] = rule
        return rule

    return deco


@register_flops(P.dot_general_p)
def _dot_general_flops(ins, outs, params):
    (lhs_contract, _), _ = params["dimension_numbers"]
    k = _size(tuple(ins[0][d] for d in lhs_contract))
    return 2.0 * _size(outs[0]) * k


@register_flops(P.conv_general_dilated_p)
def _conv_flops(ins, outs, params):
    dn = params["dimension_numbers"]
    rhs = ins[1]
    out_feature_dim = dn.rhs_spec[0] if dn is not None else 0
    per_output = _size(rhs) / max(rhs[out_feature_dim], 1)  # kernel window x input features/group
    return 2.0 * _size(outs[0]) * per_output


@register_flops(*ELEMENTWISE)
def _elementwise_flops(ins, outs, params):
    return _size(outs[0])


@register_flops(*PER_INPUT_ELEMENT)
def _reduction_flops(ins, outs, params):
    return _size(ins[0])


@register_flops(P.sort_p)
def _sort_flops(ins, outs, params):
    n = _size(ins[0])
    dim = params.get("dimension", len(ins[0]) - 1)
    length = ins[0][dim] if ins[0] else 1
    return n * max(np.log2(max(length, 2)), 1.0)


@register_flops(P.reduce_window_sum_p, P.reduce_window_max_p, P.reduce_window_min_p)
def _reduce_window_flops(ins, outs, params):
    return _size(outs[0]) * _size(tuple(params["window_dimensions"]))


@register_flops(P.scatter_add_p, P.scatter_mul_p, P.scatter_min_p, P.scatter_max_p)
def _scatter_flops(ins, outs, params):
    return _size(ins[2])  # one combine per update element


def flops_of(prim, in_shapes: Sequence[Shape], out_shapes: Sequence[Shape], params: dict) -> float:
    """FLOPs of one execution of an equation (0 for a primitive without a rule)."""
    rule = flops_rules.get(prim)
    if rule is None:
        return 0.0
    return float(rule(in_shapes, out_shapes, params))
