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


def test_reductions_that_combine_leave_partial_results():
    # sum, max and min over a split dimension: local reductions completed by one all-reduce (the
    # log-sum-exp of a vocab-parallel cross-entropy); an arg-max must see the whole dimension.
    g = hj.trace(lambda x: (jnp.max(x, -1), jnp.min(x, -1), jnp.sum(x, -1), jnp.argmax(x, -1)),
                 jnp.ones((4, 16)))
    got = {n.name: map_dim(n, g, 0, 1) for n in g.nodes}
    assert got == {"reduce_max": CONTRACTED, "reduce_min": CONTRACTED,
                   "reduce_sum": CONTRACTED, "argmax": None}


def test_a_table_split_along_its_indexed_rows_scatters_without_collectives():
    from jax.sharding import PartitionSpec as P

    from hulkjax.rules.sharding import Mesh, candidate_rules

    V, D = 64, 4
    topo = hj.Topology.grid((8,), ("m",))

    def step(table, ids, g):  # an embedding gradient into a zero table, then used
        return jnp.tanh(jnp.zeros((V, D)).at[ids].add(g) + table)

    args = (jnp.ones((V, D)), jnp.arange(6).reshape(2, 3) * 7, jnp.ones((2, 3, D)))
    graph = hj.trace(step, *args)
    (scatter,) = _nodes(graph, "scatter-add")
    mesh = Mesh(("m",), (8,))
    rows = [r for r in candidate_rules[scatter.primitive](scatter, graph, mesh)
            if r.out_specs[0] == (("m",), ())]
    # Each device applies the updates that land in its rows: whole updates and indices, no comm.
    assert any(r.comms == () and r.in_specs[2] == ((), (), ()) for r in rows), rows
    # What the rule claims of XLA: a row-split table, whole updates, nothing exchanged.
    from jax.sharding import NamedSharding
    m = topo.mesh()
    rows_split, whole = NamedSharding(m, P("m")), NamedSharding(m, P())
    jitted = jax.jit(step, in_shardings=(rows_split, whole, whole), out_shardings=rows_split)
    hlo = jitted.lower(*args).compile().as_text()
    assert not [k for k in ("all-reduce(", "all-gather(", "all-to-all(", "collective-permute(")
                if k in hlo]
    assert jnp.allclose(jitted(*args), jax.jit(step)(*args), atol=1e-6)
