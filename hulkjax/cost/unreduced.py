"""Gradients accumulated unreduced over microbatches and reduced once per step.

Where this sits::

    trace.microbatch (flows, boundary sums, sum_over_examples)  +  a stage's SPMD plan
                                      |
                                      v
    unreduced_sum(s): which boundary sums a stage's per-microbatch programs leave unreduced,
    over which mesh axes  ->  cost.pipeline (charged once per step), CostModel.by_programs
    (the intra-stage ILP's objective), Stage.unreduced  ->  emit.mpmd (runs it so)

A staged plan runs a stage's forward and backward once per microbatch and adds what they hand
the update (weight gradients, summed losses: the *boundary sums*) into float32 accumulators. A
boundary sum made by a sum over examples (:func:`~hulkjax.trace.microbatch.sum_over_examples`:
a weight gradient's ``x^T dy``, a bias gradient's ``reduce_sum``, an embedding's
``scatter-add``), whose operands read example by example the stage's plan splits along the
batch over mesh axes ``A`` and whose result it leaves whole over ``A``, is a partial sum on each
device:
XLA's partitioner completes it with an all-reduce over ``A`` in every microbatch. As
Megatron-LM and DeepSpeed do, the staged step instead adds each device's partial sum to an
accumulator of its own (a leading dimension over ``A``, one row per device: no communication)
and reduces the accumulators once per step, in one program per stage after the stage's device
group has run its last backward (one all-reduce over ``A`` of the float32 accumulators, which
XLA combines across the stage's gradients), before the update. ``M`` all-reduces of the
gradient become one, at twice the bytes where the gradient is bfloat16.

What is left reduced per microbatch, and why:

* a sum whose result the plan splits over an axis of ``A`` (fsdp-like stages: the gradient is
  reduce-scattered): as ZeRO-3 does, it is reduced in every microbatch. Deferring it would hold
  a float32 accumulator of the whole gradient on every device, ``|A|`` times the shard that
  sharding the gradient is chosen to keep; the accumulator stays the shard;
* an operator whose collective spans axes of ``A`` and other axes at once, an operand
  independent of the batch that the plan splits over ``A``, per-example operands split over
  different axes, and sums no :func:`sum_over_examples` rule covers (a ``scan`` over layers:
  its gradients are reduced inside its body);
* with one microbatch there is nothing to accumulate.

The operator's collectives over other axes (a contraction also split over a tensor-parallel
axis) stay in the microbatch's program. Memory: the accumulator holds one partial sum per
device, as large as the accumulator of the reduced gradient at its layout (float32), so the
stage's memory is what it was; the reduction's result is the reduced gradient the update
reads, as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hulkjax.plan.collectives import Comm
from hulkjax.plan.specs import axes_of, local_shape
from hulkjax.trace.microbatch import EX, BatchSplit, sum_over_examples

ACCUMULATOR_BYTES = 4
"""Bytes per element of a gradient accumulator (float32, whatever the gradient's dtype)."""


@dataclass(frozen=True)
class Unreduced:
    """A boundary sum a stage's per-microbatch program leaves unreduced.

    Attributes:
      value: the sum's value id.  # int
      node: the operator making it.  # int
      axes: the mesh axes its partial sums are accumulated over (the axes splitting the batch
        of the operands it reads example by example), in the order they split it.  # tuple
      operands: ``{operand index: batch dimension}`` of those operands
        (:func:`~hulkjax.trace.microbatch.sum_over_examples`).  # dict
      deferred: indices of the operator's own collectives (``Resolution.comms``, the cost
        model's ``node_comms``) the program no longer makes per microbatch.  # tuple of int
      reduction: the all-reduce over ``axes`` of its float32 accumulator, once per step.  # Comm
    """

    value: int
    node: int
    axes: tuple[str, ...]
    operands: dict[int, int]
    deferred: tuple[int, ...]
    reduction: Comm


def unreduced_sum(cm, nid: int, resolution, split: BatchSplit) -> Unreduced | None:
    """The :class:`Unreduced` record of node ``nid`` run as ``resolution`` (a
    :class:`~hulkjax.rules.sharding.Resolution` of cost model ``cm``), or ``None`` where its
    result is not a boundary sum left unreduced (see the module docstring)."""
    g = cm.graph
    node = g.nodes[nid]
    if resolution is None or len(node.outputs) != 1:
        return None
    v = node.outputs[0]
    c = split.boundary.get(v)
    if c is None or c.kind != "sum":
        return None
    operands = sum_over_examples(g, node, split.flows)
    if not operands:
        return None
    entries = set()
    for k, dim in operands.items():
        spec = resolution.in_specs[k] if k < len(resolution.in_specs) else None
        if spec is None or dim >= len(spec):
            return None
        entries.add(tuple(spec[dim]))
    if len(entries) != 1:
        return None  # operands split along the batch over different axes
    axes = entries.pop()
    if not axes:
        return None
    A = set(axes)
    out = resolution.out_specs[0]
    if A & set(axes_of(out)):
        return None  # reduce-scattered (fsdp-like): reduced per microbatch, as ZeRO-3 does
    for k, spec in enumerate(resolution.in_specs):
        if k not in operands and spec is not None and A & set(axes_of(spec)):
            return None
    deferred = []
    for i, comm in enumerate(resolution.comms):
        if set(comm.axes) <= A and comm.kind == "all-reduce":
            deferred.append(i)
        elif A & set(comm.axes):
            return None
    if not deferred:
        return None
    elems = math.prod(local_shape(g.values[v].shape, out, cm.sizes))
    return Unreduced(value=v, node=nid, axes=axes, operands=dict(operands),
                     deferred=tuple(deferred),
                     reduction=Comm("all-reduce", axes, int(elems * ACCUMULATOR_BYTES),
                                    deferred=True))


def unreduced_sums(cm, assignment, split: BatchSplit | None, nodes) -> dict[int, Unreduced]:
    """``{value: Unreduced}`` of the boundary sums ``nodes`` (a stage's per-microbatch
    operators) make under ``assignment`` (memoized on the cost model's graph)."""
    if split is None or not split.boundary:
        return {}
    nodes = tuple(nodes)
    key = ("unreduced sums", id(cm), tuple(assignment), id(split), nodes)
    memo = cm.graph.memo
    hit = memo.get(key)
    if hit is not None and hit[0] is cm and hit[1] is split:
        return hit[2]
    g = cm.graph
    out: dict[int, Unreduced] = {}
    for nid in nodes:
        node = g.nodes[nid]
        if len(node.outputs) != 1 or node.outputs[0] not in split.boundary:
            continue
        gid = cm.group_of_node[nid]
        u = unreduced_sum(cm, nid, cm.resolution(gid, assignment[gid], nid), split)
        if u is not None:
            out[u.value] = u
    memo[key] = (cm, split, out)
    return out


def sum_producers(graph, split: BatchSplit | None) -> frozenset[int]:
    """Nodes that make a boundary sum by a sum over examples: the only ones
    :func:`unreduced_sum` can leave unreduced (cached on the graph)."""
    if split is None:
        return frozenset()
    key = ("sum producers", id(split))
    hit = graph.memo.get(key)
    if hit is not None and hit[0] is split:
        return hit[1]
    out = frozenset(
        n.id for n in graph.nodes if len(n.outputs) == 1
        and (c := split.boundary.get(n.outputs[0])) is not None and c.kind == "sum"
        and any(v is not None and split.flows[v].kind == EX for v in n.inputs)
        and sum_over_examples(graph, n, split.flows))
    graph.memo[key] = (split, out)
    return out


__all__ = ["ACCUMULATOR_BYTES", "Unreduced", "sum_producers", "unreduced_sum", "unreduced_sums"]
