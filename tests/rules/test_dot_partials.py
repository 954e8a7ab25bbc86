"""A ``dot_general`` whose contracting dimensions are split over different mesh axes (and a sum
over dimensions so split) leaves partial sums that XLA's partitioner completes one dimension at a
time: held against XLA:CPU.

The issue-11 fidelity miss it fixes: Mixtral's LM-head gradient under ``auto`` on 2 x 2 x 2, with
the batch split over ``data, fsdp`` and the sequence over ``model``, was predicted as one all-reduce
over all three axes; XLA compiles one over ``model`` and one over ``data, fsdp``.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import hulkjax as hj
from hulkjax.emit.hlo import collectives_from_hlo
from hulkjax.plan.specs import from_pspec
from hulkjax.rules import Mesh, candidate_rules
from hulkjax.rules.sharding import follow_rules

DN = (((0, 1), (0, 1)), ((), ()))  # (B, S, D) x (B, S, V) -> (D, V): the head's gradient


@pytest.mark.parametrize("mesh_shape,names,spec", [
    ((2, 2, 2), ("data", "fsdp", "model"), P(("data", "fsdp"), "model")),
    ((2, 4), ("data", "model"), P("data", "model")),
    ((2, 2, 2), ("data", "fsdp", "model"), P(("data", "fsdp", "model"))),
])
def test_contracting_dims_split_over_different_axes_reduce_one_at_a_time(mesh_shape, names, spec):
    shapes = ((8, 16, 64), (8, 16, 256))
    mesh = jax.make_mesh(mesh_shape, names, axis_types=(AxisType.Auto,) * len(names))
    f = jax.jit(lambda x, y: jax.lax.dot_general(x, y, DN),
                in_shardings=(NamedSharding(mesh, spec),) * 2,
                out_shardings=NamedSharding(mesh, P()))
    hlo = f.lower(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)).compile().as_text()
    compiled = sorted((c.kind, tuple(c.axes), c.bytes)
                      for c in collectives_from_hlo(hlo, mesh_shape, names))

    graph = hj.trace(lambda x, y: jax.lax.dot_general(x, y, DN),
                     *(jnp.ones(s) for s in shapes))
    [node] = [n for n in graph.nodes if n.name == "dot_general"]
    want = from_pspec(spec, 3)
    [res] = [r for r in candidate_rules[node.primitive](node, graph, Mesh(names, mesh_shape))
             if r.in_specs == (want, want) and r.out_specs == (((), ()),)]
    assert sorted((c.kind, c.axes, c.bytes) for c in res.comms) == compiled


@pytest.mark.parametrize("mesh_shape,names,spec,order", [
    ((2, 4), ("data", "model"), P("data", "model"), [("model",), ("data",)]),
    ((2, 2, 2), ("data", "fsdp", "model"), P(("data", "fsdp"), "model"),
     [("model",), ("data", "fsdp")]),
    ((2, 4), ("data", "model"), P(("data", "model")), [("data", "model")]),
])
def test_a_sum_over_dims_split_over_different_axes_reduces_one_dim_at_a_time(
        mesh_shape, names, spec, order):
    """The same for a reduction (the follow rule of ``reduce_sum``): a LayerNorm scale's gradient
    under sequence parallelism sums a (batch, sequence, features) array split on the batch and
    the sequence. XLA:CPU all-reduces over the sequence's axes, then over the batch's; one
    dimension split over two axes is one all-reduce over both."""
    shape = (8, 16, 32)
    mesh = jax.make_mesh(mesh_shape, names, axis_types=(AxisType.Auto,) * len(names))
    f = jax.jit(lambda x: jnp.sum(x, axis=(0, 1)), in_shardings=NamedSharding(mesh, spec),
                out_shardings=NamedSharding(mesh, P()))
    hlo = f.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile().as_text()
    compiled = [(c.kind, tuple(c.axes), c.bytes) for c in collectives_from_hlo(hlo, mesh_shape, names)]

    graph = hj.trace(lambda x: jnp.sum(x, axis=(0, 1)), jnp.ones(shape))
    [node] = [n for n in graph.nodes if n.name == "reduce_sum"]
    res = follow_rules[node.primitive](node, graph, 0, from_pspec(spec, 3), Mesh(names, mesh_shape))
    assert [(c.kind, c.axes, c.bytes) for c in res.comms] == compiled  # in the order they run
    assert [c.axes for c in res.comms] == order
