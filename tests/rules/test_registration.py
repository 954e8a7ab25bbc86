"""A rule registered for a primitive hulkjax has never heard of is honoured end to end: the plan
shards through it, the cost model charges it at its sharded size, and the emitted program keeps the
layout (no gather) and computes what the unsharded step computes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir

import hulkjax as hj
from hulkjax import rules
from hulkjax.errors import UnsupportedPrimitiveError
from hulkjax.strategies import cost_model
from tests.helpers import assert_trees_close

# y = 3 x, as a primitive of its own (a user's custom op): linear, so it trains.
triple_p = Primitive("hulkjax_test_triple")
triple_p.def_impl(lambda x: 3 * x)
triple_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
mlir.register_lowering(triple_p, mlir.lower_fun(lambda x: 3 * x, multiple_results=False))
ad.deflinear2(triple_p, lambda ct, x: [triple_p.bind(ct)])

TOPO = hj.Topology.grid((8,), ("d",), bandwidth=1e9, latency=1e-6)


def step(w, x):
    def loss(w):
        return jnp.mean(jnp.tanh(triple_p.bind(x @ w)) ** 2)

    return w - 0.1 * jax.grad(loss)(w), loss(w)


ARGS = (jnp.linspace(-1, 1, 32 * 16).reshape(32, 16), jnp.linspace(0, 1, 64 * 32).reshape(64, 32))


@pytest.fixture
def registered():
    rules.register_dim_rule(triple_p)(lambda node, graph, operand, dim: dim)
    rules.register_flops(triple_p)(lambda ins, outs, params: float(np.prod(outs[0])))
    yield
    rules.dim_rules.pop(triple_p)
    from hulkjax.trace.flops import flops_rules

    flops_rules.pop(triple_p)


def _triple_nodes(graph):
    return [n for n in graph.nodes if n.primitive is triple_p]


def test_unknown_primitive_is_never_silent():
    with pytest.raises(UnsupportedPrimitiveError, match="hulkjax_test_triple"):
        hj.plan(step, *ARGS, topology=TOPO, strategy="dp", strict=True)
    with pytest.warns(hj.errors.UnsupportedPrimitiveWarning, match="hulkjax_test_triple") as w:
        p = hj.plan(step, *ARGS, topology=TOPO, strategy="dp")
    [note] = [n for n in p.notes if "hulkjax_test_triple" in n]
    # The warning and the note say where (this file's line) and what the forced gather costs:
    # the batch-split x @ w is all-gathered into every use (forward, and the loss's recompute).
    message = str(w[0].message)
    assert "test_registration.py" in message and "3 use(s)" in message
    assert "gathering its operands costs" in message
    assert "gathering its operands costs" in note
    cm = cost_model(p.graph, TOPO)
    gathers = [m.comm for m in cm.breakdown(p.assignment, memory=False).moves
               if p.graph.nodes[m.node].primitive is triple_p]
    assert gathers and all(c.kind == "all-gather" for c in gathers)


def test_registered_rule_shards_costs_and_emits(registered, compile_count):
    assert rules.is_supported(triple_p)
    plan = hj.plan(step, *ARGS, topology=TOPO, strategy="dp", strict=True)
    graph = plan.graph
    cm = cost_model(graph, TOPO)
    b = cm.breakdown(plan.assignment)
    nodes = _triple_nodes(graph)
    assert len(nodes) >= 2  # forward and its transpose in the backward pass
    for n in nodes:
        # The batch split flows through the op: its result stays split over "d" ...
        out = b.specs[n.outputs[0]]
        assert out[0] == ("d",), (n.id, out)
        # ... and the cost model charges it split 8 ways (FLOPs and bytes both registered/known).
        assert b.compute[n.id] == pytest.approx(cm.compute_time(n, 8))
        assert b.compute[n.id] < cm.compute_time(n, 1)
    # No gathers anywhere: the only collective is the gradient's all-reduce.
    assert {c.kind for c in plan.cost.collectives} == {"all-reduce"}

    sharded = hj.emit(step, plan)
    got = sharded(*ARGS)
    want = jax.jit(step)(*ARGS)
    assert_trees_close(got, want)
    kinds = {c.kind for c in sharded.collectives()}
    assert "all-gather" not in kinds and "all-to-all" not in kinds, kinds
    before = compile_count()
    sharded(*ARGS)
    assert compile_count() == before
