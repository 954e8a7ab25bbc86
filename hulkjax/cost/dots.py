"""Which matmuls a compiler runs with both operands stored transposed (a slower kernel on XLA:CPU).

Where this sits: :class:`~hulkjax.cost.model.CostModel` asks :func:`transposed_dots` once per
graph, and charges those dots at ``DeviceSpec.transposed_dot_efficiency`` of its matmul rate.

A weight gradient is a ``dot_general`` that contracts the leading (batch and sequence) dimensions
of both its operands, a forward activation ``x`` (tokens x in) and a cotangent ``g`` (tokens x
out); JAX writes it as ``dot_general(g, x)`` or ``dot_general(x, g)``, often followed by a
``transpose`` that swaps the result's two halves, which XLA folds by swapping the operands. XLA:CPU
then copies the cotangent into the order with its contracted dimension minor (it is made by the
backward pass and read by the matmuls alone) and keeps the activation as the forward operators
read it (contracted dimension major). Where the activation ends up the left operand (the rows of
the result), the dot's operands are both transposed (``lhs_contracting_dims={0},
rhs_contracting_dims={1}``) and XLA:CPU runs it with Eigen's contraction, not with its YNNPACK
matmul fusion: 52-104 GFLOP/s on one core where the fused matmuls of the same step ran at
170-245 (``benchmarks/COMPUTE.md``). Where the cotangent ends up on the left (HF GPT-2's
``Conv1D``, whose kernel is stored transposed), both operands are in the plain order and the dot
runs at the fused rate. The rule reads only what the operator is (its dimension numbers, the
transpose that reads it, and whether each operand is made by the forward or the backward pass).

>>> import jax, jax.numpy as jnp
>>> import hulkjax as hj
>>> def loss(w, x):
...     return jnp.sum(jnp.tanh(x @ w))
>>> g = hj.trace(jax.grad(loss), jnp.ones((4, 3)), jnp.ones((8, 4)))
>>> [g.nodes[i].name for i in sorted(transposed_dots(g))]
['dot_general']
"""

from __future__ import annotations

from jax.extend.core import primitives as P

from hulkjax.trace.graph import OpGraph


def weight_gradients(graph: OpGraph) -> dict[int, int]:
    """``{node id: its cotangent's value id}`` for the weight gradients of ``graph`` (not of its
    loop bodies): the ``dot_general`` nodes without batch dimensions that contract the leading
    dimensions of both operands, one operand made by the backward pass (the cotangent) and the
    other not (a forward activation, or an input)."""
    out = {}
    for node in graph.nodes:
        if node.primitive is not P.dot_general_p or None in node.inputs[:2]:
            continue
        (lc, rc), (lb, rb) = node.params["dimension_numbers"]
        if lb or rb or tuple(lc) != tuple(range(len(lc))) or tuple(rc) != tuple(range(len(rc))):
            continue
        lhs, rhs = node.inputs[0], node.inputs[1]
        lhs_backward = _backward(graph, lhs)
        if lhs_backward != _backward(graph, rhs):
            out[node.id] = lhs if lhs_backward else rhs
    return out


def transposed_dots(graph: OpGraph) -> frozenset[int]:
    """Ids of the weight gradients of ``graph`` (:func:`weight_gradients`) that XLA:CPU runs
    with both operands transposed: those whose forward operand leads the result (the right
    operand where a ``transpose`` chain that swaps the result's halves is its only reader)."""
    out = []
    for nid, cotangent in weight_gradients(graph).items():
        node = graph.nodes[nid]
        (lc, rc), _ = node.params["dimension_numbers"]
        lhs, rhs = node.inputs[0], node.inputs[1]
        rows = lhs
        if _swapped(graph, node, len(graph.values[lhs].shape) - len(lc),
                    len(graph.values[rhs].shape) - len(rc)):
            rows = rhs
        if rows != cotangent:
            out.append(nid)
    return frozenset(out)


def _swapped(graph: OpGraph, node, lhs_free: int, rhs_free: int) -> bool:
    """Whether the dot's result reaches its readers with the right operand's free dimensions
    first: the transposes that are each the only reader of the one before compose to that swap
    (XLA folds them into the dot by swapping the operands; two swaps cancel)."""
    perm = tuple(range(lhs_free + rhs_free))
    value = node.outputs[0]
    while True:
        readers = graph.consumers(value)
        if len(readers) != 1 or graph.nodes[readers[0][0]].primitive is not P.transpose_p:
            break
        reader = graph.nodes[readers[0][0]]
        perm = tuple(perm[i] for i in reader.params["permutation"])
        value = reader.outputs[0]
    return perm == tuple(range(lhs_free, lhs_free + rhs_free)) + tuple(range(lhs_free))


def _backward(graph: OpGraph, vid: int) -> bool:
    """Whether a value is made by the backward pass (an input or a constant is not)."""
    producer = graph.values[vid].producer
    return producer is not None and graph.nodes[producer].backward
