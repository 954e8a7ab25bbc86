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
from hulkjax.trace.primitives import (
    CASTS,
    COMBINING_SCATTERS,
    CUMULATIVE,
    ELEMENTWISE,
    KERNELS,
    PASSTHROUGH,
    PER_INPUT_ELEMENT,
    POOLING,
    RANDOM_KEYS,
    SCATTERS,
    SIZE_PRESERVING,
    SPLIT,
    STACK,
    TILE,
    TOP_K,
    UNSTACK,
    WINDOW_GRADIENTS,
)

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


def map_dim_results(node: Node, graph: OpGraph, operand: int,
                    dim: int) -> list[tuple[int, int]] | str | None:
    """Like :func:`map_dim`, for every result: ``[(result index, result dim), ...]``,
    :data:`CONTRACTED` or ``None``. A ``split``, ``sort`` or ``top_k`` carries the dimension into
    each of its results; a pass-through (``optimization_barrier``) carries operand ``k`` into
    result ``k``; everything else into result 0.

    >>> import jax, jax.numpy as jnp, hulkjax as hj
    >>> g = hj.trace(lambda x: jnp.split(x, 2, axis=1)[1].sum(), jnp.ones((4, 6)))
    >>> map_dim_results(g.nodes[0], g, 0, 0)
    [(0, 0), (1, 0)]
    """
    if node.primitive in PASSTHROUGH:
        return [(operand, dim)] if operand < len(node.outputs) else None
    if node.primitive in KERNELS:
        return _kernel_results(node, operand, dim)
    r = map_dim(node, graph, operand, dim)
    if r is None or r == CONTRACTED:
        return r
    if (node.primitive in SPLIT or node.primitive in TOP_K or node.primitive in UNSTACK
            or node.primitive is P.sort_p):
        return [(k, r) for k in range(len(node.outputs))]
    return [(0, r)]


def _kernel_results(node: Node, operand: int, dim: int) -> list[tuple[int, int]] | None:
    """The results' dimensions a Pallas kernel carries an operand dimension into: those the same
    grid axis indexes, when the kernel may be split along it (:mod:`hulkjax.trace.kernels`)."""
    k = node.kernel
    if k is None or operand >= len(k.operand_axes) or dim >= len(k.operand_axes[operand]):
        return None
    g = k.operand_axes[operand][dim]
    if g is None or g not in k.parallel:
        return None
    _, results = k.split_dims(g)
    return [(r, d) for r, d in enumerate(results) if d is not None] or None


@register_dim_rule(*KERNELS)
def _kernel_dims(node, graph, operand, dim):
    """A Pallas kernel: into its first result (see :func:`_kernel_results`)."""
    found = _kernel_results(node, operand, dim)
    return next((d for r, d in found or () if r == 0), None)


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


@register_dim_rule(*TILE)
def _tile_dims(node, graph, operand, dim):
    """A dimension repeated once keeps its place (and its layout); a repeated one does not: its
    blocks interleave the copies."""
    return dim if int(node.params["reps"][dim]) == 1 else None


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
    """A dimension survives a reshape where it starts a result dimension that it splits into or is
    merged into as the major factor: ``(B, T, H*D) -> (B, T, H, D)`` keeps B, T and maps H*D to H;
    merging the heads back, ``(B, T, H, D) -> (B, T, H*D)``, maps H to H*D (a block of heads per
    device is a block of columns). The follow rules check that the mesh axes divide the result."""
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
    # dst[j] starts exactly where src[dim] starts: a split (dst[j] divides it) or a merge with
    # src[dim] as the major factor (it divides dst[j]).
    size = src[dim]
    if dst[j] == size or (size % dst[j] == 0 and dst[j] > 1) or (dst[j] % size == 0 and size > 1):
        return j
    return None


_COMBINING_REDUCTIONS = frozenset((P.reduce_sum_p, P.reduce_max_p, P.reduce_min_p))
"""Reductions whose per-device results combine into the whole one with one all-reduce (sum, max,
min): a split dimension they reduce leaves partial results (XLA's partitioner reduces locally,
then all-reduces with the same operation). A cumulative op, an arg-max or a product (kept
gathered: rare, and its all-reduce multiplies) gather the dimension instead."""


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
        return CONTRACTED if node.primitive in _COMBINING_REDUCTIONS else None
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
    """Each operand's dimensions are the result's; a split of the concatenated dimension survives
    as an exchange of blocks (see the follow rule) when the operands divide it."""
    return dim


@register_dim_rule(*RANDOM_KEYS)
def _random_key_dims(node, graph, operand, dim):
    """Arrays of PRNG keys map over their dimensions: ``random_split`` appends the new keys' shape,
    ``random_fold_in`` folds same-shaped messages in key by key. (Without a rule every step that
    draws random numbers, e.g. for dropout, warned that ``random_split`` was replicated.)"""
    shape, out = _shape(graph, node, operand), _out_shape(graph, node)
    if dim >= len(out) or shape[dim] != out[dim]:
        return None
    return dim


@register_dim_rule(*SPLIT)
def _split_dims(node, graph, operand, dim):
    """Every piece keeps the operand's dimensions (a split of the split axis survives as an
    exchange of blocks when the pieces divide it, see the follow rule)."""
    return dim


@register_dim_rule(*STACK)
def _stack_dims(node, graph, operand, dim):
    """Every operand's dimensions are the result's, shifted past the new ``axis``."""
    return dim if dim < node.params["axis"] else dim + 1


@register_dim_rule(*UNSTACK)
def _unstack_dims(node, graph, operand, dim):
    """Every result has the operand's dimensions but ``axis`` (one result per index of it)."""
    axis = node.params["axis"]
    return None if dim == axis else (dim if dim < axis else dim - 1)


@register_dim_rule(*TOP_K)
def _top_k_dims(node, graph, operand, dim):
    rank = len(_shape(graph, node, 0))
    axis = node.params.get("axis", node.params.get("reduction_dimension", rank - 1)) % max(rank, 1)
    return None if dim == axis else dim


@register_dim_rule(P.bitcast_convert_type_p)
def _bitcast_dims(node, graph, operand, dim):
    """Same-width bitcasts keep the shape; a width change adds or drops a minor dimension."""
    shape, out = _shape(graph, node, 0), _out_shape(graph, node)
    return dim if dim < len(out) and out[dim] == shape[dim] else None


@register_dim_rule(*PASSTHROUGH)
def _passthrough_dims(node, graph, operand, dim):
    """Result ``operand`` is operand ``operand``: for the first one, dimension for dimension."""
    return dim if operand == 0 else None


@register_dim_rule(*SIZE_PRESERVING)
def _same_size_dims(node, graph, operand, dim):
    """Slicing, padding, reversal, sorting and scans keep a dimension whose size does not change
    and that they do not work along (a rotary embedding's half-slices keep the heads)."""
    shape, out = _shape(graph, node, operand), _out_shape(graph, node)
    if len(shape) != len(out) or shape[dim] != out[dim]:
        return None
    if node.primitive is P.rev_p and dim in node.params["dimensions"]:
        return None
    if node.primitive is P.sort_p and dim == node.params["dimension"]:
        return None
    if node.primitive in CUMULATIVE and dim == node.params.get("axis"):
        return None
    return dim


@register_dim_rule(P.gather_p)
def _gather_dims(node, graph, operand, dim):
    """Embedding lookups and ``take_along_axis``. A table dimension sliced whole is the matching
    offset dimension of the result; one shared with the indices (``operand_batching_dims``) is
    that batch dimension; an indexed dimension looked up one entry at a time
    (``collapsed_slice_dims``) is :data:`CONTRACTED`: a table split there gives each device the
    entries it holds and zeros elsewhere, completed by an all-reduce (a vocab-parallel embedding,
    the label logit of a vocab-parallel cross-entropy). The indices' batch dimensions are the
    result's batch dimensions (the index vector is their last dimension)."""
    if len(node.inputs) != 2:
        return None
    dn = node.params["dimension_numbers"]
    out = _out_shape(graph, node)
    batch_out = [d for d in range(len(out)) if d not in dn.offset_dims]
    if operand == 1:
        idx = _shape(graph, node, 1)
        if dim >= len(idx) - 1 or dim >= len(batch_out):
            return None
        return batch_out[dim]
    table = _shape(graph, node, 0)
    if dim in dn.operand_batching_dims:
        ib = dn.start_indices_batching_dims[tuple(dn.operand_batching_dims).index(dim)]
        return batch_out[ib] if ib < len(batch_out) else None
    if dim in dn.collapsed_slice_dims:
        return CONTRACTED if dim in dn.start_index_map else None
    offset_src = [d for d in range(len(table)) if d not in dn.collapsed_slice_dims
                  and d not in dn.operand_batching_dims]
    if node.params["slice_sizes"][dim] != table[dim]:
        return None  # a window of the dimension: its split does not survive
    return sorted(dn.offset_dims)[offset_src.index(dim)]


@register_dim_rule(*SCATTERS)
def _scatter_dims(node, graph, operand, dim):
    """The result is the operand, dimension for dimension. An update's window dimension (one that
    covers the operand's whole dimension) lands on that operand dimension, and one shared with the
    operand (``take_along_axis`` gradients) on the shared one; for a combining scatter the other
    update dimensions (the scattered ones: which tokens hit which row of an embedding's gradient)
    are :data:`CONTRACTED`, partial tables completed by an all-reduce. Indices are not followed."""
    if len(node.inputs) != 3:
        return None
    dn = node.params["dimension_numbers"]
    if operand == 0:
        return dim
    if operand != 2:
        return None
    os_, us = _shape(graph, node, 0), _shape(graph, node, 2)
    window_dst = [d for d in range(len(os_)) if d not in dn.inserted_window_dims
                  and d not in dn.operand_batching_dims]
    if dim in dn.update_window_dims:
        od = window_dst[sorted(dn.update_window_dims).index(dim)]
        return od if us[dim] == os_[od] else None
    upd_batch = [d for d in range(len(us)) if d not in dn.update_window_dims]
    j = upd_batch.index(dim)
    if j in dn.scatter_indices_batching_dims:
        return dn.operand_batching_dims[tuple(dn.scatter_indices_batching_dims).index(j)]
    return CONTRACTED if node.primitive in COMBINING_SCATTERS else None


@register_dim_rule(*POOLING, *WINDOW_GRADIENTS)
def _window_dims(node, graph, operand, dim):
    """Pooling and its gradients keep a dimension their window does not span (size 1, stride 1,
    no padding or dilation): a CNN's channels through max pooling."""
    p = node.params
    if p["window_dimensions"][dim] != 1 or p["window_strides"][dim] != 1:
        return None
    if tuple(p["padding"][dim]) != (0, 0):
        return None
    if any(p.get(k, (1,) * (dim + 1))[dim] != 1 for k in ("base_dilation", "window_dilation")):
        return None
    return dim
