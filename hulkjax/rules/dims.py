"""Where an operand's dimension goes in an operator's result: a table keyed by primitive.

``dim_rules[prim](node, graph, operand, dim)`` answers one of:

* an ``int``: the result dimension that carries the operand dimension (a sharding on it survives);
* :data:`CONTRACTED`: the dimension is summed away (a sharding on it leaves partial sums: all-reduce);
* ``None``: the dimension does not survive in a way a sharding can follow (it is gathered, sliced,
  merged with a smaller dimension, ...).

Primitives without a rule answer ``None``. Strategies use the table to follow a sharded dimension
through the graph (megatron's column/row pairing); the follow table builds on it, and a follower
with a dimension rule but no follow rule follows by it
(:func:`hulkjax.rules.sharding.mapped_follow`). Registering a dimension rule for a primitive
hulkjax does not know makes it known: the cost model keeps its operand's layout through it.

>>> from hulkjax.rules.dims import CONTRACTED
>>> CONTRACTED
'contracted'
"""

from __future__ import annotations

from collections.abc import Callable

from jax.extend.core import primitives as P

from hulkjax.trace.graph import Node, OpGraph
from hulkjax.trace.primitives import CASTS, ELEMENTWISE, PER_INPUT_ELEMENT, RANDOM_KEYS

CONTRACTED = "contracted"
DimRule = Callable[[Node, OpGraph, int, int], "int | str | None"]
dim_rules: dict[object, DimRule] = {}


def register_dim_rule(*prims) -> Callable[[DimRule], DimRule]:
    """Register a dimension rule ``(node, graph, operand, dim) -> int | CONTRACTED | None`` for one
    or more primitives.

    >>> from jax.extend.core import Primitive
    >>> my_cumsum_p = Primitive("my_cumsum")   # a primitive of your own
    >>> @register_dim_rule(my_cumsum_p)
    ... def _my_cumsum_dims(node, graph, operand, dim):
    ...     return None if dim == node.params["axis"] else dim
    """

    def deco(rule: DimRule) -> DimRule:
        for p in prims:
            dim_rules[p] = rule
        return rule

    return deco


def map_dim(node: Node, graph: OpGraph, operand: int, dim: int) -> int | str | None:
    """The result dimension of ``node`` that carries ``dim`` of operand ``operand``."""
    rule = dim_rules.get(node.primitive)
    if rule is None:
        return None
    r = rule(node, graph, operand, dim)
    return int(r) if r is not None and r != CONTRACTED else r


def _shape(graph: OpGraph, node: Node, operand: int) -> tuple[int, ...]:
    vid = node.inputs[operand]
    return () if vid is None else graph.values[vid].shape


def _out_shape(graph: OpGraph, node: Node) -> tuple[int, ...]:
    return graph.values[node.outputs[0]].shape


@register_dim_rule(*ELEMENTWISE, *CASTS)
def _elementwise_dims(node, graph, operand, dim):
    """Same-rank operands; lax broadcasts size-1 dimensions, which carry no sharding."""
    shape, out = _shape(graph, node, operand), _out_shape(graph, node)
    if len(shape) != len(out) or shape[dim] != out[dim]:
        return None
    return dim


@register_dim_rule(P.broadcast_in_dim_p)
def _broadcast_dims(node, graph, operand, dim):
    if operand != 0:
        return None
    out = int(node.params["broadcast_dimensions"][dim])
    return out if _shape(graph, node, 0)[dim] == _out_shape(graph, node)[out] else None


@register_dim_rule(P.transpose_p)
def _transpose_dims(node, graph, operand, dim):
    return tuple(node.params["permutation"]).index(dim)


@register_dim_rule(P.squeeze_p)
def _squeeze_dims(node, graph, operand, dim):
    removed = sorted(d % len(_shape(graph, node, 0)) for d in node.params["dimensions"])
    if dim in removed:
        return None
    return dim - sum(1 for r in removed if r < dim)


@register_dim_rule(P.reshape_p)
def _reshape_dims(node, graph, operand, dim):
    """A dimension survives a reshape as the major factor of a split, or unchanged in a merge-free
    region: ``(B, T, H*D) -> (B, T, H, D)`` keeps B, T, and maps H*D to H."""
    if operand != 0:
        return None
    src, dst = _shape(graph, node, 0), _out_shape(graph, node)
    before = 1
    for d in range(dim):
        before *= src[d]
    acc, j = 1, 0
    while j < len(dst) and acc < before:
        acc *= dst[j]
        j += 1
    while j < len(dst) and dst[j] == 1 and src[dim] != 1:
        j += 1
    if acc != before or j >= len(dst):
        return None
    # dst[j] must start exactly where src[dim] starts and be a multiple-aligned factor of it.
    size = src[dim]
    if dst[j] == size or (size % dst[j] == 0 and dst[j] > 1):
        return j
    return None


@register_dim_rule(*PER_INPUT_ELEMENT)
def _reduce_dims(node, graph, operand, dim):
    axes = node.params.get("axes")
    if axes is None:  # argmax/argmin/cumulative ops
        axis = node.params.get("axis", node.params.get("axes"))
        if node.primitive in (P.argmax_p, P.argmin_p):
            axes = tuple(node.params["axes"])
        elif axis is not None:
            return None if dim == axis else dim
        else:
            return None
    axes = tuple(a % max(len(_shape(graph, node, 0)), 1) for a in axes)
    if dim in axes:
        return CONTRACTED if node.primitive is P.reduce_sum_p else None
    return dim - sum(1 for a in axes if a < dim)


@register_dim_rule(P.dot_general_p)
def _dot_general_dims(node, graph, operand, dim):
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    contract, batch = (lc, lb) if operand == 0 else (rc, rb)
    if dim in contract:
        return CONTRACTED
    if dim in batch:
        return tuple(batch).index(dim)
    lhs_rank = len(_shape(graph, node, 0))
    lhs_free = [d for d in range(lhs_rank) if d not in lc and d not in lb]
    if operand == 0:
        return len(lb) + lhs_free.index(dim)
    rhs_rank = len(_shape(graph, node, 1))
    rhs_free = [d for d in range(rhs_rank) if d not in rc and d not in rb]
    return len(lb) + len(lhs_free) + rhs_free.index(dim)


def dot_partner(node: Node, operand: int, dim: int) -> int | None:
    """For a ``dot_general``: the other operand's dimension contracted or batched with ``dim``."""
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    mine_c, other_c = (lc, rc) if operand == 0 else (rc, lc)
    mine_b, other_b = (lb, rb) if operand == 0 else (rb, lb)
    if dim in mine_c:
        return other_c[tuple(mine_c).index(dim)]
    if dim in mine_b:
        return other_b[tuple(mine_b).index(dim)]
    return None


@register_dim_rule(P.conv_general_dilated_p)
def _conv_dims(node, graph, operand, dim):
    dn = node.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    if operand == 0:
        if dim == lhs_spec[0] and node.params.get("batch_group_count", 1) == 1:
            return out_spec[0]  # batch
        if dim == lhs_spec[1] and node.params.get("feature_group_count", 1) == 1:
            return CONTRACTED  # input features
        return None  # spatial dims need halos
    if dim == rhs_spec[0]:
        return out_spec[1]  # output features
    if dim == rhs_spec[1]:
        return CONTRACTED
    return None


@register_dim_rule(P.concatenate_p)
def _concat_dims(node, graph, operand, dim):
    return None if dim == node.params["dimension"] else dim


@register_dim_rule(*RANDOM_KEYS)
def _random_key_dims(node, graph, operand, dim):
    """Arrays of PRNG keys map over their dimensions: ``random_split`` appends the new keys' shape,
    ``random_fold_in`` folds same-shaped messages in key by key. (Without a rule every step that
    draws random numbers, e.g. for dropout, warned that ``random_split`` was replicated.)"""
    shape, out = _shape(graph, node, operand), _out_shape(graph, node)
    if dim >= len(out) or shape[dim] != out[dim]:
        return None
    return dim
