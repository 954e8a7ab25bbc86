"""The public API: hulk_shard, plan, emit, compare, Plan JSON, and the errors users meet."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import hulkjax as hj
from hulkjax import zoo
from hulkjax.errors import (
    InvalidPlanError,
    NotEnoughDevicesError,
    PlanMismatchError,
    StrategyNotApplicableError,
    UnknownStrategyError,
    UnsupportedPrimitiveError,
    UnsupportedPrimitiveWarning,
)
from tests.helpers import TWO_D_TOPOLOGY, assert_trees_close

TOPO = TWO_D_TOPOLOGY


@pytest.fixture(scope="module")
def mlp():
    m = zoo.get("mlp", size="tiny")
    state, batch = m.init(0)
    return m, state, batch


def test_hulk_shard_caches_per_shape_and_replans_new_shapes(mlp, compile_count):
    m, state, batch = mlp
    step = hj.hulk_shard(m.step, topology=TOPO, strategy="dp")
    assert step.plan is None and "not planned" in step.summary()
    s1, _ = step(state, batch)
    n = compile_count()
    s2, _ = step(s1, batch)
    assert compile_count() == n  # same shapes: no new compilation
    first_plan = step.plan
    bigger = jax.tree.map(lambda x: jnp.concatenate([x, x]), batch)
    step(s2, bigger)
    assert compile_count() > n  # new shapes: planned and compiled again
    assert step.plan is not first_plan
    assert step.plan.spec("batch/x") == P(("data", "model"))
    assert dict((t.path, t.shape) for t in step.plan.inputs)["batch/x"] == (32, 16)
    summary = step.summary()
    assert "Plan 'dp'" in summary and "data" in summary


def test_plan_from_shape_dtype_structs_mirrors_the_arguments():
    m = zoo.get("gpt2", size="small")
    state, batch = m.abstract()
    plan = hj.plan(m.step, state, batch, topology=TOPO, strategy="fsdp")
    specs_state, specs_batch = plan.in_specs
    assert jax.tree.structure(specs_state) == jax.tree.structure(
        jax.tree.map(lambda _: 0, state))
    assert specs_batch["tokens"] == P(("data", "model"))
    out_state, metrics = plan.out_specs
    assert jax.tree.structure(out_state) == jax.tree.structure(specs_state)
    # A state result keeps its input's layout.
    assert jax.tree.leaves(out_state, is_leaf=lambda x: isinstance(x, P)) == jax.tree.leaves(
        specs_state, is_leaf=lambda x: isinstance(x, P))


def test_plan_json_round_trips_and_a_loaded_plan_runs(mlp, tmp_path):
    m, state, batch = mlp
    plan = hj.plan(m.step, state, batch, topology=TOPO, strategy="megatron")
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = hj.Plan.load(path)
    assert loaded.to_dict() == plan.to_dict()
    assert json.loads(path.read_text())["strategy"] == "megatron"
    # A loaded plan knows its specs by path until it meets the arguments.
    assert loaded.in_specs["batch/x"] == plan.spec("batch/x")
    ref = jax.jit(m.step)(state, batch)
    out = hj.emit(m.step, loaded)(state, batch)
    assert_trees_close(out, ref)
    assert jax.tree.structure(loaded.in_specs) == jax.tree.structure(plan.in_specs)


def test_a_plan_for_another_model_is_refused(mlp, tmp_path):
    m, state, batch = mlp
    plan = hj.plan(m.step, state, batch, topology=TOPO, strategy="dp")
    plan.save(tmp_path / "p.json")
    other = zoo.get("mlp", size="tiny", depth=3)
    o_state, o_batch = other.init(0)
    with pytest.raises(PlanMismatchError, match="another step"):
        hj.emit(other.step, hj.Plan.load(tmp_path / "p.json"))(o_state, o_batch)
    assert not any(x.is_deleted() for x in jax.tree.leaves(o_state))


def test_new_shapes_on_a_fixed_plan_are_refused_and_nothing_is_consumed(mlp):
    m, state, batch = mlp
    step = hj.emit(m.step, hj.plan(m.step, state, batch, topology=TOPO, strategy="dp"))
    bigger = jax.tree.map(lambda x: jnp.concatenate([x, x]), batch)
    with pytest.raises(PlanMismatchError, match=r"batch/x.*float32\[32, 16\].*\[16, 16\]"):
        step(state, bigger)
    assert not any(x.is_deleted() for x in jax.tree.leaves((state, bigger)))


def test_malformed_plan_json_names_the_problem(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidPlanError, match="not a plan JSON"):
        hj.Plan.load(bad)
    bad.write_text(json.dumps({"format": 1, "strategy": "dp"}))
    with pytest.raises(InvalidPlanError, match="malformed plan: KeyError"):
        hj.Plan.load(bad)


def test_compare_gives_one_plan_per_applicable_strategy(mlp):
    m, state, batch = mlp
    plans = hj.compare(m.step, state, batch, topology=TOPO)
    # 'pipeline' needs regions or nodes: a grid has neither.
    assert list(plans) == [s for s in hj.strategies.names() if s != "pipeline"]
    assert {p.strategy for p in plans.values()} == set(plans)
    one_d = hj.compare(m.step, state, batch, topology=hj.Topology.grid((8,), ("d",)))
    assert "dp_tp" not in one_d and "dp" in one_d
    with pytest.raises(StrategyNotApplicableError, match=r"at least 2 axes.*\('d',\)"):
        hj.plan(m.step, state, batch, topology=hj.Topology.grid((8,), ("d",)), strategy="dp_tp")


def test_unknown_strategy_lists_the_registered_ones(mlp):
    m, state, batch = mlp
    with pytest.raises(UnknownStrategyError, match=r"'zero9'.*\['replicate', 'dp'"):
        hj.plan(m.step, state, batch, topology=TOPO, strategy="zero9")


def test_a_topology_larger_than_the_machine_says_how_to_get_devices(mlp):
    m, state, batch = mlp
    big = hj.Topology.preset("dgx-h100", nodes=2)
    plan = hj.plan(m.step, state, batch, topology=big, strategy="dp")  # planning needs no devices
    assert plan.mesh_shape == (2, 8)
    with pytest.raises(NotEnoughDevicesError, match=r"16 devices.*JAX has 8.*jax_num_cpu_devices"):
        hj.emit(m.step, plan)


def test_dimensions_that_do_not_divide_are_not_sharded_on_that_axis():
    f = lambda w, x: jnp.tanh(x @ w).sum()  # noqa: E731
    w, x = jnp.ones((4, 4)), jnp.ones((6, 4))  # batch 6 over 2 x 4 devices
    plan = hj.plan(f, w, x, topology=TOPO, strategy="dp")
    assert plan.spec("x") == P("data")  # 6 divides over 'data' (2), not over all 8
    assert any("does not divide" in n for n in plan.notes)
    out = hj.emit(f, plan)(w, x)
    np.testing.assert_allclose(out, f(w, x), rtol=1e-6)


def test_unsupported_primitive_is_replicated_with_one_warning_or_raises_in_strict_mode():
    def f(x):
        return jnp.abs(jnp.fft.fft(x @ x.T)).sum() + jnp.abs(jnp.fft.ifft(x)).sum()

    x = jnp.arange(32.0).reshape(8, 4)
    with pytest.warns(UnsupportedPrimitiveWarning, match=r"'fft' \(2 use\(s\), first at") as rec:
        plan = hj.plan(f, x, topology=TOPO, strategy="dp")
    assert len([w for w in rec if issubclass(w.category, UnsupportedPrimitiveWarning)]) == 1
    fft_nodes = [n for n in plan.graph.nodes if n.name == "fft"]
    assert all(plan.result_specs[(n.id, 0)] == P() for n in fft_nodes)
    np.testing.assert_allclose(hj.emit(f, plan)(x), f(x), rtol=1e-5)
    with pytest.raises(UnsupportedPrimitiveError, match=r"no sharding rule for 'fft'.*test_api.py"):
        hj.plan(f, x, topology=TOPO, strategy="dp", strict=True)


def test_topology_by_preset_name_and_json_path(mlp, tmp_path):
    m, state, batch = mlp
    TOPO.save(tmp_path / "t.json")
    p1 = hj.plan(m.step, state, batch, topology=str(tmp_path / "t.json"), strategy="dp")
    p2 = hj.plan(m.step, state, batch, topology="dgx-h100", strategy="dp")
    assert p1.topology == TOPO and p1.topology_fingerprint == TOPO.fingerprint()
    assert p2.mesh_shape == (8,)
    with pytest.raises(hj.HulkjaxError, match="topology must be"):
        hj.plan(m.step, state, batch, topology=42, strategy="dp")
