"""The distributed optimizer: optimizer state laid out apart from its parameter.

``strategy="zero"`` (ZeRO-1/2) and ``ilp`` / ``auto`` with ``optimizer_apart=True`` plan in the
cost model whose optimizer-state arguments are groups of their own
(``CostModel(..., optimizer_apart=True)``).
"""

import jax
import pytest
from jax.sharding import PartitionSpec as P

import hulkjax as hj
from hulkjax import zoo
from hulkjax.plan.records import Plan
from hulkjax.strategies.baselines import BASELINES, baseline_assignments
from hulkjax.strategies.ilp import solve
from hulkjax.strategies.realize import cost_model, plan_cost_model
from hulkjax.trace.graph import OPTIMIZER, PARAMETER
from tests.helpers import TWO_D_TOPOLOGY, assert_steps_match, first_steps, tight_regional

DGX2 = hj.Topology.preset("dgx-h100", nodes=2)


@pytest.fixture(scope="module")
def gpt2():
    m = zoo.get("gpt2", size="tiny", batch=8)
    return m, hj.trace(m.step, *m.abstract())


def test_zero_shards_the_state_and_keeps_parameters_whole(gpt2):
    m, g = gpt2
    plan = hj.plan(m.step, *m.abstract(), topology=TWO_D_TOPOLOGY, strategy="zero", graph=g)
    dp = hj.plan(m.step, *m.abstract(), topology=TWO_D_TOPOLOGY, strategy="dp", graph=g)
    assert plan.optimizer_apart and not dp.optimizer_apart
    specs = [t.spec for t in plan.inputs]
    pairs = g.state_pairs()
    assert pairs
    for i, role in enumerate(g.input_roles):
        if role == PARAMETER:
            assert specs[i] == P(), g.input_paths[i]
    sharded = [o for o, _ in pairs if specs[o] != P()]
    # every matrix's state divides over the 8 devices (biases and norms of 64 do too)
    assert len(sharded) == len(pairs)
    assert all(g.input_roles[o] == OPTIMIZER for o in sharded)
    # the gradients are reduce-scattered onto the state's shards, not all-reduced and sliced
    cm = plan_cost_model(g, TWO_D_TOPOLOGY, plan)
    kinds = [c.kind for comms in cm.breakdown(plan.assignment, memory=False).made().values()
             for c in comms]
    assert kinds.count("reduce-scatter") >= len({p for _, p in pairs
                                                  if len(g.values[g.inputs[p]].shape) == 2})
    # the state (and the gradients reduced onto it) no longer whole on every device
    assert plan.cost.peak_memory < 0.8 * dp.cost.peak_memory


def test_zero_is_faster_than_dp_where_the_update_is_not_free():
    """On H100s (bandwidth-bound collectives) the reduce-scatter and gather cost about what the
    all-reduce did, and the update runs on an eighth of the state (GPT-2 small on one node:
    11.8 against 12.3 ms, 1.29 against 2.16 GB)."""
    m = zoo.get("gpt2", size="small", batch=16, seq_len=128)
    g = hj.trace(m.step, *m.abstract())
    one_node = hj.Topology.preset("dgx-h100", nodes=1)
    zero = hj.plan(m.step, *m.abstract(), topology=one_node, strategy="zero", graph=g)
    dp = hj.plan(m.step, *m.abstract(), topology=one_node, strategy="dp", graph=g)
    assert zero.cost.step_time < dp.cost.step_time
    assert zero.cost.compute_time < dp.cost.compute_time
    assert zero.cost.peak_memory < dp.cost.peak_memory


def test_apart_model_costs_every_baseline_as_the_default_model_does(gpt2):
    """Each baseline's layouts, completed in the model with state apart (the seeds of ``ilp`` /
    ``auto`` with ``optimizer_apart``), cost what its plan costs in the default model."""
    m, g = gpt2
    apart = cost_model(g, TWO_D_TOPOLOGY, optimizer_apart=True)
    seeds = baseline_assignments(g, TWO_D_TOPOLOGY, optimizer_apart=True)
    assert set(seeds) == set(BASELINES) | {"zero"}
    for strategy in BASELINES:
        plan = hj.plan(m.step, *m.abstract(), topology=TWO_D_TOPOLOGY, strategy=strategy, graph=g)
        assert apart.objective(seeds[strategy]) == pytest.approx(plan.cost.step_time,
                                                                 rel=1e-9), strategy
    assert len(apart.groups) > len(cost_model(g, TWO_D_TOPOLOGY).groups)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_the_program_with_state_apart_holds_the_default_one(family):
    """Its classes tie a state with the states of its parameter's repeated layers, and a
    parameter with the parameters whose states are alike: never coarser than the default
    model's, so its optimum (before the memory polish, a local search) is never above the
    default program's. Without the states in the classes' structure, the GPT-2 program's
    optimum was 139.87 against 138.83 us."""
    from tests.realmodels import families

    step, state, batch = families.build(family, "tiny")
    g = hj.trace(step, *jax.eval_shape(lambda: (state, batch)))
    tied = solve(cost_model(g, TWO_D_TOPOLOGY), polish=False)
    apart = solve(cost_model(g, TWO_D_TOPOLOGY, optimizer_apart=True), polish=False)
    assert tied.status == apart.status == "optimal"
    assert apart.objective <= tied.objective * (1 + 1e-9)


def test_the_ilp_with_state_apart_shards_state_its_parameter_keeps_whole(gpt2):
    """On GPT-2 tiny over 2 x 4 it lays some state out apart and is faster."""
    m, g = gpt2
    tied = hj.plan(m.step, *m.abstract(), topology=TWO_D_TOPOLOGY, strategy="ilp", graph=g)
    apart = hj.plan(m.step, *m.abstract(), topology=TWO_D_TOPOLOGY, strategy="ilp", graph=g,
                    optimizer_apart=True)
    assert apart.optimizer_apart
    assert apart.cost.step_time < tied.cost.step_time * (1 - 1e-3)
    specs = [t.spec for t in apart.inputs]
    assert any(specs[o] != specs[p] for o, p in g.state_pairs())
    auto = hj.plan(m.step, *m.abstract(), topology=TWO_D_TOPOLOGY, strategy="auto", graph=g,
                   optimizer_apart=True)
    assert auto.cost.step_time <= apart.cost.step_time * (1 + 0.01)


def test_a_plan_with_state_apart_is_judged_by_its_own_model(gpt2):
    m, g = gpt2
    plan = hj.plan(m.step, *m.abstract(), topology=TWO_D_TOPOLOGY, strategy="zero", graph=g)
    # fresh: its assignment; saved and loaded: re-completed from its layouts in the apart model
    assert hj.estimate(m.step, *m.abstract(), plan=plan).step_time == plan.cost.step_time
    loaded = Plan.from_dict(plan.to_dict())
    assert loaded.optimizer_apart and loaded.assignment is None
    est = hj.estimate(m.step, *m.abstract(), plan=loaded)
    assert est.step_time == pytest.approx(plan.cost.step_time, rel=1e-9)
    # a plan without the flag that lays state out apart (written by hand) is read apart too
    by_hand = Plan.from_dict({k: v for k, v in plan.to_dict().items() if k != "optimizer_apart"})
    assert not by_hand.optimizer_apart
    assert hj.estimate(m.step, *m.abstract(), plan=by_hand).peak_memory == pytest.approx(
        est.peak_memory, rel=1e-9)
    # tied plans write what they wrote before
    dp = hj.plan(m.step, *m.abstract(), topology=TWO_D_TOPOLOGY, strategy="dp", graph=g)
    assert "optimizer_apart" not in dp.to_dict()
    hj.explain(plan)  # reads the plan's own model
    # the default model refuses the plan's assignment and says which model to use
    with pytest.raises(hj.HulkjaxError, match="plan_cost_model"):
        cost_model(g, TWO_D_TOPOLOGY).breakdown(plan.assignment)


def test_the_emitted_step_with_state_apart_computes_the_unsharded_step(compile_count):
    m = zoo.get("gpt2", size="tiny", batch=8)
    state, batch = m.init(0)
    refs = first_steps(jax.jit(m.step), state, batch, 2)
    step = hj.hulk_shard(m.step, topology=TWO_D_TOPOLOGY, strategy="ilp", optimizer_apart=True)
    # (Adam divides by the root of the second moment: where that is near zero, the sums' other
    # order moves a weight by up to the learning rate, 1e-3; one element of 16,384 by 6e-5)
    s = assert_steps_match(step, state, batch, refs, compile_count, rtol=1e-4, atol=2e-4)
    assert step.plan.optimizer_apart
    # the state comes back laid out as the plan says, apart from its parameter
    g = step.plan.graph
    specs = {t.path: t.spec for t in step.plan.outputs}
    assert len(set(specs.values())) > 1
    assert any(step.plan.inputs[o].spec != step.plan.inputs[p].spec for o, p in g.state_pairs())
    for t, leaf in zip(step.plan.outputs, jax.tree.leaves(s)):
        assert leaf.sharding.is_equivalent_to(
            jax.sharding.NamedSharding(step.sharded.mesh, t.spec), leaf.ndim), t.path


def test_zero_predicts_the_memory_and_collectives_xla_compiles():
    """XLA:CPU forms no reduce-scatter: it all-reduces the combined gradients, then slices, so
    where the reduction runs it holds the whole sum (predicted 23% low before the liveness walk
    held it), and its collectives are the predicted ones."""
    from hulkjax.emit.hlo import collectives_from_hlo
    from tests.realmodels.measure import (
        compare_collectives,
        compiled_collectives,
        compiled_memory,
        predicted_collectives,
    )

    m = zoo.get("gpt2", size="tiny", batch=8)
    state, batch = m.init(0)
    step = hj.hulk_shard(m.step, topology=TWO_D_TOPOLOGY, strategy="zero")
    step(state, batch)
    plan = step.plan
    compiled = step.sharded.lower(state, batch).compile()
    assert plan.cost.peak_memory == pytest.approx(compiled_memory(compiled), rel=0.05)
    found = compiled_collectives(collectives_from_hlo(
        compiled.as_text(), tuple(plan.mesh_shape), tuple(plan.axis_names)))
    for kind, c in compare_collectives(predicted_collectives(plan.graph, plan), found).items():
        assert c["count_equal"] and c["bytes_within"], (kind, c)


def test_zero_without_optimizer_state_is_data_parallel_and_says_so():
    import jax.numpy as jnp

    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)

    args = (jnp.ones((64, 64)), jnp.ones((16, 64)))
    topo = hj.Topology.grid((8,), ("d",))
    zero = hj.plan(step, *args, topology=topo, strategy="zero")
    dp = hj.plan(step, *args, topology=topo, strategy="dp")
    assert not zero.optimizer_apart and zero.in_specs == dp.in_specs
    assert zero.cost.step_time == dp.cost.step_time
    assert any("no optimizer state" in n for n in zero.notes)


def test_stages_decide_optimizer_state_apart_too(compile_count):
    """With ``optimizer_apart``, the staged search's stages plan in the model with state apart
    (the distributed optimizer inside each stage, Megatron's pipeline with
    ``use_distributed_optimizer``): where memory bends the stages' plans, sharding a stage's
    Adam moments where its parameters stay whole makes a faster staged plan than any with state
    tied (benchmarks/OPTIMIZER_APART.md: Alpa's GPT-6.7B on 16 V100s, 7.63 -> 6.66 s). The
    emitted staged step computes the unsharded step; the plan keeps its model through JSON."""
    m = zoo.get("gpt2", size="tiny", n_layers=8, batch=8)
    topo = tight_regional(2.5e6)
    state, batch = m.init(0)
    g = hj.trace(m.step, state, batch)
    tied = hj.plan(m.step, state, batch, topology=topo, strategy="auto", graph=g)
    apart = hj.plan(m.step, state, batch, topology=topo, strategy="auto", graph=g,
                    optimizer_apart=True)
    assert tied.stages is not None and apart.stages is not None
    assert apart.optimizer_apart and not tied.optimizer_apart
    assert apart.cost.step_time < tied.cost.step_time * 0.99
    assert all(st.fits for st in apart.cost.stages)
    specs = [t.spec for t in apart.inputs]
    assert any(specs[o] != P() and specs[p] == P() for o, p in g.state_pairs())
    # judged in its own model: an estimate of the plan made here is its cost, to the bit
    assert hj.estimate(m.step, state, batch, plan=apart).step_time == apart.cost.step_time
    loaded = Plan.from_dict(apart.to_dict())
    assert loaded.optimizer_apart
    refs = first_steps(jax.jit(m.step), state, batch, 2)
    assert_steps_match(hj.emit(m.step, loaded, donate=False), state, batch, refs, compile_count,
                       rtol=1e-4, atol=2e-4)


def test_with_state_apart_the_faster_staged_plan_of_both_searches_is_kept(monkeypatch):
    """The staged search over stages with state apart is not exhaustive (its dynamic program
    ranks the stages' plans by their tables): ``spmd_or_staged`` with ``optimizer_apart`` runs
    it with state tied too and keeps the faster plan, saying so in its notes."""
    from hulkjax.plan import Cost
    from hulkjax.strategies import stages as S

    def staged(t, apart):
        p = Plan(strategy="auto", axis_names=("x",), mesh_shape=(1,), inputs=(), outputs=(),
                 cost=Cost(step_time=t, compute_time=t, comm_time=0.0), optimizer_apart=apart)
        return p

    found = {}

    def fake(graph, topology, *, optimizer_apart, **kw):
        t = found[optimizer_apart]
        return (None if t is None else staged(t, optimizer_apart)), [f"searched {optimizer_apart}"]

    monkeypatch.setattr(S, "best_staged", fake)
    spmd = staged(1.0, True)
    for apart_t, tied_t, kept in ((0.5, 0.6, True), (0.7, 0.6, False), (None, 0.6, False),
                                  (0.6, None, True), (0.6, 0.6, True)):
        found.update({True: apart_t, False: tied_t})
        plan = S.spmd_or_staged(None, None, lambda: spmd, strategy="auto", solver=None,
                                time_limit=1.0, optimizer_apart=True)
        assert plan.optimizer_apart is kept and plan.cost.step_time == min(
            t for t in (apart_t, tied_t) if t is not None)
        said = [n for n in plan.notes if "optimizer state" in n]
        assert bool(said) == (not kept or tied_t is not None), plan.notes
    found.update({True: None, False: None})
    assert S.spmd_or_staged(None, None, lambda: spmd, strategy="auto", solver=None,
                            time_limit=1.0, optimizer_apart=True) is spmd
