"""Dimension rules of ``gather`` and the scatters (:mod:`hulkjax.rules.dims`): what megatron
follows a split through in an embedding lookup, ``take_along_axis`` and their gradients."""

import jax
import jax.numpy as jnp
import optax

import hulkjax as hj
from hulkjax.rules.dims import CONTRACTED, map_dim


def _nodes(graph, name):
    return [n for n in graph.nodes if n.name == name]


def test_embedding_lookup_and_its_gradient():
    def loss(table, ids):
        return jnp.sum(jnp.tanh(table[ids]))  # (10, 4)[ (2, 3) ] -> (2, 3, 4)

    g = hj.trace(jax.grad(loss), jnp.ones((10, 4)), jnp.zeros((2, 3), jnp.int32))
    (gather,) = _nodes(g, "gather")
    assert [map_dim(gather, g, 0, d) for d in range(2)] == [CONTRACTED, 2]  # rows: masked lookup
    assert [map_dim(gather, g, 1, d) for d in range(3)] == [0, 1, None]  # index vector: none
    (scatter,) = _nodes(g, "scatter-add")
    # updates (2, 3, 4): the token dims land anywhere in the table (partial tables), the feature
    # dim on the table's features; the operand is the result dimension for dimension.
    assert [map_dim(scatter, g, 2, d) for d in range(3)] == [CONTRACTED, CONTRACTED, 1]
    assert [map_dim(scatter, g, 0, d) for d in range(2)] == [0, 1]
    assert map_dim(scatter, g, 1, 0) is None


def test_take_along_axis_of_a_cross_entropy():
    def loss(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    g = hj.trace(jax.value_and_grad(loss), jnp.ones((2, 3, 8)), jnp.zeros((2, 3), jnp.int32))
    gather = next(n for n in _nodes(g, "gather") if g.values[n.inputs[0]].shape == (2, 3, 8))
    # batch dims shared with the labels stay; the vocabulary is looked up: a masked lookup
    assert [map_dim(gather, g, 0, d) for d in range(3)] == [0, 1, CONTRACTED]
    scatter = next(n for n in _nodes(g, "scatter-add") if g.values[n.outputs[0]].shape == (2, 3, 8))
    assert [map_dim(scatter, g, 2, d) for d in range(3)] == [0, 1, CONTRACTED]
