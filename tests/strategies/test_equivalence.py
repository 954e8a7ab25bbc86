"""Every strategy's emitted program computes what the unsharded step computes."""

import jax
import pytest

import hulkjax as hj
from hulkjax import zoo
from tests.helpers import SPMD_STRATEGIES, assert_steps_match, first_steps

MODELS = ["mlp", "transformer-block", "mlp-nnx", "transformer-block-nnx", "cnn"]
TOPO = hj.Topology.grid((2, 4), ("data", "model"), bandwidth=(25e9, 450e9), latency=(5e-6, 1e-6))
STEPS = 3


@pytest.fixture(scope="module", params=MODELS)
def model_run(request):
    """A tiny zoo model, its initial (state, batch), and 3 unsharded reference steps."""
    m = zoo.get(request.param, size="tiny")
    state, batch = m.init(0)
    return m, state, batch, first_steps(jax.jit(m.step), state, batch, STEPS)


@pytest.mark.parametrize("strategy", SPMD_STRATEGIES)
def test_sharded_steps_match_unsharded(model_run, strategy, compile_count):
    m, state, batch, refs = model_run
    step = hj.hulk_shard(m.step, topology=TOPO, strategy=strategy)
    s = assert_steps_match(step, state, batch, refs, compile_count)
    # The caller's initial arrays survive (only the step's own previous outputs are donated).
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))
    # Planned layouts are really used: state comes back laid out as the plan says.
    for t, leaf in zip(step.plan.outputs, jax.tree.leaves(s)):
        assert leaf.sharding.spec == t.spec or leaf.sharding.is_equivalent_to(
            jax.sharding.NamedSharding(step.sharded.mesh, t.spec), leaf.ndim), t.path
