"""The planner registry: one shape for every planner, typed options, unknown names refused."""

import dataclasses

import jax.numpy as jnp
import pytest

import hulkjax as hj
from hulkjax.errors import InvalidOptionError, UnknownOptionError, UnknownStrategyError
from tests.helpers import TWO_D_TOPOLOGY


def _step(w, x):
    return w - 0.1 * jnp.mean(x @ w, axis=0)


ARGS = (jnp.ones((8, 8)), jnp.ones((16, 8)))


def test_a_misspelt_option_is_refused_with_the_valid_ones():
    with pytest.raises(UnknownOptionError) as e:
        hj.plan(_step, *ARGS, topology=TWO_D_TOPOLOGY, strategy="ilp", time_limt=5)
    msg = str(e.value)
    assert "'time_limt'" in msg and "did you mean 'time_limit'" in msg and "tie_layers=" in msg


def test_baselines_take_no_options_and_decorators_check_eagerly():
    with pytest.raises(UnknownOptionError, match="has no option 'time_limit'.*none"):
        hj.plan(_step, *ARGS, topology=TWO_D_TOPOLOGY, strategy="dp", time_limit=5)
    with pytest.raises(UnknownOptionError):
        hj.hulk_shard(_step, topology=TWO_D_TOPOLOGY, strategy="auto", topk=3)
    with pytest.raises(InvalidOptionError, match="prior_kind"):
        hj.hulk_shard(_step, topology=TWO_D_TOPOLOGY, strategy="auto", prior_kind="psychic")
    with pytest.raises(UnknownStrategyError):
        hj.strategies.option_fields("zero9")


def test_options_reach_the_planner():
    p = hj.plan(_step, *ARGS, topology=TWO_D_TOPOLOGY, strategy="ilp", time_limit=7.0)
    assert p.solver is not None and p.solver.status in ("optimal", "time limit")
    assert hj.strategies.options_of("ilp", time_limit=7.0).time_limit == 7.0
    assert set(hj.strategies.option_fields("auto")) >= {"top_k", "time_limit", "prior_kind"}


def test_user_registered_planner_with_typed_options():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Opts:
        axes: tuple = ("data",)

    @hj.strategies.register_strategy("test-batch-over", options=Opts)
    def batch_over(graph, topology, options):
        sb = hj.strategies.SpecBuilder(graph, topology, "test-batch-over")
        x = graph.inputs[1]
        sb.set_input(1, sb.dim_spec(graph.values[x].shape, 0, options.axes))
        return sb.build()

    try:
        p = hj.plan(_step, *ARGS, topology=TWO_D_TOPOLOGY, strategy="test-batch-over",
                    axes=("model",))
        assert p.in_specs[1] == jax_p("model")
        assert "test-batch-over" in hj.strategies.names()
    finally:
        del hj.strategies.strategies["test-batch-over"]


def jax_p(*entries):
    from jax.sharding import PartitionSpec

    return PartitionSpec(*entries)
