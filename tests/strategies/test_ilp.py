"""The ILP: exact optimum of the cost model, and the choices users expect from it."""

import itertools

import jax
import jax.numpy as jnp
import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.errors import InfeasiblePlanError
from hulkjax.strategies.baselines import baseline_assignments
from hulkjax.strategies.ilp import relaxation_bound, solve
from hulkjax.strategies.realize import cost_model
from hulkjax.topology import DeviceSpec
from tests.helpers import TWO_D_TOPOLOGY

BASELINES = ["replicate", "dp", "fsdp", "megatron", "dp_tp", "expert"]
ONE_D = hj.Topology.grid((8,), ("x",), bandwidth=100e9, latency=5e-6, device="V100")
TWO_D = hj.Topology.grid((2, 4), ("slow", "fast"), bandwidth=(1e9, 450e9), latency=(2e-5, 1e-6),
                         device="V100")


def _plans(model, topology, **overrides):
    m = zoo.get(model, **overrides)
    state, batch = m.abstract()
    g = hj.trace(m.step, state, batch)
    plans = {}
    for s in BASELINES + ["ilp"]:
        try:
            plans[s] = hj.plan(m.step, state, batch, topology=topology, strategy=s, graph=g)
        except hj.errors.StrategyNotApplicableError:
            pass
    return m, plans


def test_ilp_is_the_exact_optimum_of_a_small_program():
    """Brute force over every assignment of a two-matmul step agrees with the solver."""
    f = lambda w1, w2, x: (w1, w2, jnp.tanh(x @ w1) @ w2)  # noqa: E731
    args = jnp.ones((64, 256)), jnp.ones((256, 64)), jnp.ones((32, 64))
    topo = hj.Topology.grid((4,), ("x",), bandwidth=1e9, latency=1e-5)
    g = hj.trace(f, *args)
    cm = cost_model(g, topo)
    sizes = [len(grp.candidates) for grp in cm.groups]
    best = min(cm.objective(list(a)) for a in itertools.product(*map(range, sizes)))
    result = solve(cm, tie_layers=False, max_candidates=10**6)
    assert result.status == "optimal"
    assert result.objective == pytest.approx(best, rel=1e-6)  # up to the memory tie-break


def test_ilp_is_the_exact_optimum_of_a_training_step_with_shared_changes():
    """Brute force over every assignment of a two-matmul training step, whose weights and
    activations the forward and the backward pass both read (layout changes charged once: the
    program's ``z`` terms, over parts of candidates), agrees with the solver."""
    def loss(w1, w2, x):
        return jnp.sum((jnp.tanh(x @ w1) @ w2) ** 2)

    def step(w1, w2, x):
        g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2, x)
        return w1 - 0.1 * g1, w2 - 0.1 * g2

    args = jnp.ones((64, 256)), jnp.ones((256, 64)), jnp.ones((32, 64))
    topo = hj.Topology.grid((4,), ("x",), bandwidth=1e9, latency=1e-5)
    cm = cost_model(hj.trace(step, *args), topo)
    assert cm.shared_items()
    sizes = [len(grp.candidates) for grp in cm.groups]
    best = min(cm.objective(list(a)) for a in itertools.product(*map(range, sizes)))
    result = solve(cm, tie_layers=False, max_candidates=10**6, mip_rel_gap=0.0)
    assert result.status == "optimal"
    assert result.objective == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("model, topology", [
    ("gpt2", TWO_D_TOPOLOGY), ("transformer-block", hj.Topology.preset("dgx-h100", nodes=2)),
    ("moe", ONE_D)], ids=["gpt2-2x4", "block-dgx2", "moe-1d"])
def test_coupling_parts_of_candidates_keeps_the_optimum_and_the_relaxation(model, topology):
    """The program couples parts of two classes' candidates (candidates the pair's edge costs
    and shared changes do not tell apart), not every pair: the same optimum and the same LP
    relaxation (a parts solution splits into pairs in proportion to ``x``), from a program
    several times smaller."""
    m = zoo.get(model, size="tiny")
    g = hj.trace(m.step, *m.abstract())
    cm = cost_model(g, topology)
    seeds = baseline_assignments(g, topology)
    parts = solve(cm, seeds=seeds, mip_rel_gap=0.0)
    pairs = solve(cm, seeds=seeds, mip_rel_gap=0.0, aggregate=False)
    assert parts.status == pairs.status == "optimal"
    assert parts.objective == pytest.approx(pairs.objective, rel=1e-9)
    assert cm.objective(parts.assignment) == pytest.approx(parts.objective, rel=1e-12)
    assert relaxation_bound(cm, seeds=seeds) == pytest.approx(
        relaxation_bound(cm, seeds=seeds, aggregate=False), rel=1e-7)
    assert parts.variables < pairs.variables / 2


@pytest.mark.parametrize("model, size", [("mlp", "tiny"), ("transformer-block", "tiny"),
                                         ("cnn", "tiny"), ("moe", "tiny"), ("gpt2", "tiny"),
                                         ("transformer-block", "small")])
@pytest.mark.parametrize("topology", [ONE_D, TWO_D, hj.Topology.preset("dgx-h100", nodes=2),
                                      hj.Topology.preset("geo"), hj.Topology.preset("hetero")],
                         ids=["1d", "2d", "dgx2", "geo", "hetero"])
def test_ilp_is_never_worse_than_any_baseline(model, size, topology):
    _, plans = _plans(model, topology, size=size)
    ilp = plans.pop("ilp")
    for name, p in plans.items():
        if p.cost.fits:
            assert ilp.cost.step_time <= p.cost.step_time * (1 + 1e-9), name
    assert ilp.cost.fits


def _style(plan) -> str:
    """How the forward matmuls with a parameter run: split batch or split weights."""
    g = plan.graph
    params = {g.inputs[i] for i, r in enumerate(g.input_roles) if r == "parameter"}
    styles = set()
    for n in g.nodes:
        if n.name != "dot_general" or n.backward:
            continue
        k = next((k for k, v in enumerate(n.inputs) if _from_any(g, v, params)), None)
        if k is None:
            continue
        act, weight = plan.operand_specs[(n.id, 1 - k)], plan.operand_specs[(n.id, k)]
        batch_split = len(act) > 0 and act[0] is not None
        weight_split = any(e is not None for e in weight)
        styles.add("batch" if batch_split and not weight_split else
                   "weights" if weight_split and not batch_split else "mixed")
    return styles.pop() if len(styles) == 1 else "mixed"


def _from_any(g, v, params) -> bool:
    while v is not None:
        if v in params:
            return True
        p = g.values[v].producer
        if p is None or g.nodes[p].name not in ("convert_element_type", "reshape", "transpose"):
            return False
        v = g.nodes[p].inputs[0]
    return False


def test_large_batch_small_hidden_is_data_parallel():
    m, plans = _plans("mlp", ONE_D, size="tiny", depth=4, width=256, in_dim=256, out_dim=256,
                      batch=65536)
    p = plans["ilp"]
    assert _style(p) == "batch"
    assert p.spec("batch/x") == jax_p("x") and p.spec("batch/y") == jax_p("x")
    assert p.cost.step_time == pytest.approx(plans["dp"].cost.step_time, rel=0.05)


def test_small_batch_large_hidden_is_tensor_parallel():
    m, plans = _plans("mlp", ONE_D, size="tiny", depth=4, width=8192, in_dim=8192, out_dim=8192,
                      batch=8)
    p = plans["ilp"]
    assert _style(p) == "weights"
    kernels = [t for t in p.inputs if t.role == "parameter" and len(t.shape) == 2]
    assert all(t.spec != jax_p() for t in kernels), [t.spec for t in kernels]
    assert p.cost.step_time < 0.5 * plans["dp"].cost.step_time


def test_the_choice_flips_where_the_cost_model_says():
    """Sweeping the batch, the ILP goes from splitting weights to splitting the batch, and at every
    point its choice is at least as cheap as the cheaper of the two baselines."""
    styles = []
    for batch in (8, 64, 512, 4096, 32768, 262144):
        m, plans = _plans("mlp", ONE_D, size="tiny", depth=4, width=2048, in_dim=2048,
                          out_dim=2048, batch=batch)
        p = plans["ilp"]
        styles.append(_style(p))
        assert p.cost.step_time <= min(plans["dp"].cost.step_time,
                                       plans["megatron"].cost.step_time) * (1 + 1e-9)
    assert styles[0] == "weights" and styles[-1] == "batch", styles
    flips = sum(a != b for a, b in zip(styles, styles[1:]))
    assert flips <= 2, styles  # weights -> (mixed) -> batch, never back


def test_tensor_parallelism_goes_on_the_cheap_axis():
    m, plans = _plans("transformer-block", TWO_D, size="small", batch=16, seq_len=256)
    p = plans["ilp"]
    used = {a for t in p.inputs if t.role == "parameter" for e in t.spec if e
            for a in (e if isinstance(e, tuple) else (e,))}
    assert used == {"fast"}
    assert p.cost.comm_time_by_axis.get("slow", 0.0) <= 0.01 * p.cost.comm_time
    assert p.cost.step_time < min(plans[s].cost.step_time for s in ("dp", "dp_tp"))


def test_moe_experts_are_sharded_on_the_expert_dimension_with_all_to_all():
    m, plans = _plans("moe", ONE_D, size="small", n_experts=8, d_model=1024, d_ff=8192,
                      batch=32, seq_len=256, attention=False)
    p = plans["ilp"]
    experts = [t for t in p.inputs if t.role == "parameter" and len(t.shape) == 3]
    assert experts and all(t.spec == jax_p("x") for t in experts), [t.spec for t in experts]
    kinds = {c.kind for c in p.cost.collectives}
    assert "all-to-all" in kinds
    assert p.cost.step_time < min(plans[s].cost.step_time for s in ("dp", "fsdp", "megatron"))


def test_a_model_that_does_not_fit_replicated_gets_a_plan_that_fits():
    small = DeviceSpec(kind="small", peak_flops=1e14, memory=2e9, hbm_bandwidth=1e12)
    topo = hj.Topology.grid((8,), ("x",), bandwidth=50e9, latency=5e-6, device=small)
    m, plans = _plans("mlp", topo, size="tiny", depth=4, width=8192, in_dim=8192, out_dim=8192,
                      batch=64)
    assert not plans["replicate"].cost.fits and not plans["dp"].cost.fits
    assert plans["ilp"].cost.fits
    assert plans["ilp"].cost.peak_memory <= 2e9


def test_a_model_that_cannot_fit_is_a_clear_error():
    tiny = DeviceSpec(kind="tiny", peak_flops=1e12, memory=1e6, hbm_bandwidth=1e11)
    topo = hj.Topology.grid((8,), ("x",), device=tiny)
    m = zoo.get("mlp", size="tiny", width=1024, in_dim=1024, out_dim=1024)
    with pytest.raises(InfeasiblePlanError, match=r"needs? [\d.]+ [KMG]B per device.*has 1 MB.*"
                                                  r"Largest tensors: state/params"):
        hj.plan(m.step, *m.abstract(), topology=topo, strategy="ilp")


def test_gpt2_small_solves_to_optimality():
    # The SPMD program (with staged plans, two nodes running half the layers each win by 3.5%).
    m = zoo.get("gpt2", size="small")
    p = hj.plan(m.step, *m.abstract(), topology=hj.Topology.preset("dgx-h100", nodes=2),
                strategy="ilp", stages=False)
    assert p.solver.status == "optimal" and p.solver.gap < 0.01
    assert p.notes[0].startswith("ILP: optimal")


def jax_p(*entries):
    from jax.sharding import PartitionSpec

    return PartitionSpec(*entries)


# ---- a plan always: the warm start, the time limit, the gap ----------------------------------


@pytest.fixture(scope="module")
def mixed_mlp():
    """A program whose optimum mixes layouts and beats every baseline by more than 2x (2-D mesh),
    small enough to solve to optimality in well under a second."""
    m = zoo.get("mlp", size="tiny", depth=2, width=1024, in_dim=1024, out_dim=1024, batch=256)
    g = hj.trace(m.step, *m.abstract())
    cm = cost_model(g, TWO_D)
    return m, g, cm, baseline_assignments(g, TWO_D)


def test_a_time_limit_returns_the_warm_start_with_its_gap(mixed_mlp):
    """Stopped before it can improve on its starting solution, HiGHS returns that incumbent (the
    cheapest baseline), reports the time limit, and a gap that the true optimum lies within."""
    _, _, cm, seeds = mixed_mlp
    best = min(seeds, key=lambda k: cm.objective(seeds[k]))
    full = solve(cm, seeds=seeds, tie_layers=False)
    assert full.status == "optimal"
    assert full.objective < 0.5 * cm.objective(seeds[best])  # so stopping early costs something

    cut = solve(cm, seeds=seeds, tie_layers=False, time_limit=0.0)
    assert cut.status == "time limit"
    assert cut.start == best and cut.start_objective == pytest.approx(cm.objective(seeds[best]))
    # Never worse than where it started (HiGHS's presolve may already have improved on it).
    assert full.objective <= cut.objective <= cut.start_objective * (1 + 1e-12)
    assert cm.memory(cut.assignment) <= cm.capacity
    assert 0 < cut.gap < 1
    assert cut.bound <= full.objective * (1 + 1e-9)  # a true lower bound
    assert cut.gap == pytest.approx((cut.objective - cut.bound) / cut.objective)


def test_a_plan_stopped_by_its_time_limit_says_so_with_the_gap(mixed_mlp):
    m, g, cm, seeds = mixed_mlp
    state, batch = m.abstract()
    p = hj.plan(m.step, state, batch, topology=TWO_D, strategy="ilp", graph=g, time_limit=0)
    assert p.solver.status == "time limit" and p.solver.gap > 0
    assert p.notes[0].startswith("ILP: time limit") and f"gap {p.solver.gap:.2%}" in p.notes[0]
    assert f"started from {p.solver.start}" in p.notes[0] and "Raise time_limit" in p.notes[0]
    best = min(hj.plan(m.step, state, batch, topology=TWO_D, strategy=s, graph=g).cost.step_time
               for s in BASELINES)
    assert p.cost.step_time <= best * (1 + 1e-9)
    full = hj.plan(m.step, state, batch, topology=TWO_D, strategy="ilp", graph=g)
    assert full.solver.status == "optimal" and full.cost.step_time < 0.5 * best


def test_started_from_auto_a_stopped_ilp_is_never_worse_than_auto(mixed_mlp):
    """``start_from_auto``: auto's SPMD plan is one more warm start, so even an ILP stopped
    before it improves on its start returns a plan no slower than auto's (started from the
    baselines alone, it returns the best baseline's, here slower)."""
    m, g, _, _ = mixed_mlp
    state, batch = m.abstract()
    auto = hj.plan(m.step, state, batch, topology=TWO_D, strategy="auto", graph=g)
    cut = hj.plan(m.step, state, batch, topology=TWO_D, strategy="ilp", graph=g, time_limit=0)
    assert cut.cost.step_time > auto.cost.step_time * 1.01
    seeded = hj.plan(m.step, state, batch, topology=TWO_D, strategy="ilp", graph=g,
                     time_limit=0, start_from_auto=True)
    assert seeded.solver.status == "time limit" and seeded.solver.start.startswith("auto")
    assert seeded.cost.step_time <= auto.cost.step_time * (1 + 1e-9)


def test_without_a_fitting_seed_the_leanest_layouts_start_the_solver(mixed_mlp):
    """No seed fits under the limit, yet a plan does: the solver starts from every class's
    smallest-footprint candidate, which fits whenever anything does, and what it returns fits by
    the liveness peak (here 3x the additive sum: the leanest layouts gather each weight whole,
    and its copies and the weight's partial gradient are live together in the backward pass)."""
    _, _, cm, seeds = mixed_mlp
    lean = solve(cm, time_limit=0.0, polish=False)
    assert lean.start == "leanest" and lean.status == "time limit"
    limit = cm.peak_memory(lean.assignment) * 1.2
    unfit = {k: a for k, a in seeds.items()
             if cm.memory(a) > limit and cm.peak_memory(a) > limit}
    assert {"replicate", "dp"} <= set(unfit)  # (dp_tp's vocab-parallel last layer fits)
    for time_limit in (0.0, 60.0):  # (untied: no seed is tied into one that fits)
        r = solve(cm, seeds=unfit, memory_limit=limit, time_limit=time_limit, tie_layers=False)
        assert r.start == "leanest" and cm.peak_memory(r.assignment) <= limit
    assert r.status == "optimal" and r.objective < lean.start_objective


def test_a_baseline_beating_the_tied_program_unties_layers_within_the_same_time_limit(
        monkeypatch):
    """On this wide-batch MLP the four equal layers are best sharded differently (the untied
    optimum is cheaper than the tied one), but no built-in baseline says so. A baseline that
    does (here that untied optimum, offered as one more baseline) makes the planner solve the
    untied program, in the time the tied solve left (none at a zero limit: then the best
    baseline's plan)."""
    m = zoo.get("mlp", size="tiny", depth=4, width=1024, in_dim=1024, out_dim=1024, batch=1024)
    state, batch = m.abstract()
    g = hj.trace(m.step, state, batch)
    cm = cost_model(g, ONE_D)
    seeds = baseline_assignments(g, ONE_D)
    tied = solve(cm, seeds=seeds, tie_layers=True)
    untied = solve(cm, seeds=seeds, tie_layers=False)
    assert untied.objective < tied.objective * (1 - 1e-3)
    assert min(cm.objective(s) for s in seeds.values()) > tied.objective  # nothing to untie for
    p = hj.plan(m.step, state, batch, topology=ONE_D, strategy="ilp", graph=g)
    assert not any("untied" in n for n in p.notes)
    assert p.cost.step_time == pytest.approx(tied.objective, rel=1e-6)

    import hulkjax.strategies.ilp as ilp_module

    monkeypatch.setattr(ilp_module, "baseline_assignments",
                        lambda graph, topo, **kw: {**baseline_assignments(graph, topo, **kw),
                                                   "mixed": list(untied.assignment)})
    for time_limit, status in ((60.0, "optimal"), (0.0, "time limit")):
        p = hj.plan(m.step, state, batch, topology=ONE_D, strategy="ilp", graph=g,
                    time_limit=time_limit)
        assert p.solver.status == status
        assert any("solved with layers untied" in n for n in p.notes), p.notes
        assert p.cost.step_time <= untied.objective * (1 + 1e-9)


def test_a_seed_sharding_repeated_layers_differently_starts_the_tied_program_tied():
    """A seed the tied program cannot hold (its equal layers on different candidates) is not
    dropped: tied (each class on its layers' most common candidate), it is a start like any."""
    m = zoo.get("mlp", size="tiny", depth=4, width=1024, in_dim=1024, out_dim=1024, batch=1024)
    g = hj.trace(m.step, *m.abstract())
    cm = cost_model(g, ONE_D)
    untied = solve(cm, seeds=baseline_assignments(g, ONE_D), tie_layers=False)
    r = solve(cm, seeds={"mixed": untied.assignment}, time_limit=0.0, polish=False)
    assert r.start == "mixed (layers tied)"
    assert r.start_objective > untied.objective  # tied, it is another plan
    assert r.objective <= r.start_objective * (1 + 1e-12)


def test_the_solver_is_deterministic(mixed_mlp):
    _, _, cm, seeds = mixed_mlp
    runs = [solve(cm, seeds=seeds, tie_layers=False) for _ in range(3)]
    assert all(r.assignment == runs[0].assignment for r in runs)


def test_a_highs_scheduler_set_up_elsewhere_does_not_break_the_solver(mixed_mlp):
    """HiGHS refuses a thread count other than its process-wide scheduler's; the solver then runs
    on that scheduler (the same optimum)."""
    import highspy

    if not hasattr(highspy.Highs, "resetGlobalScheduler"):
        pytest.skip(f"highspy {highspy.Highs().version()} cannot reset its scheduler")
    _, _, cm, seeds = mixed_mlp
    want = solve(cm, seeds=seeds, tie_layers=False)
    highspy.Highs.resetGlobalScheduler(True)
    try:
        other = highspy.Highs()
        other.setOptionValue("output_flag", False)
        other.setOptionValue("threads", 2)
        x = other.addVariable(0, 1, 1.0)
        other.addConstr(x >= 0.5)
        assert other.run() == highspy.HighsStatus.kOk  # the scheduler now has 2 threads
        got = solve(cm, seeds=seeds, tie_layers=False)
        assert got.status == "optimal"
        assert got.objective == pytest.approx(want.objective, rel=1e-9)
    finally:
        highspy.Highs.resetGlobalScheduler(True)


def test_the_solver_switches_off_highs_probing_and_nothing_else(mixed_mlp, tmp_path,
                                                                  monkeypatch):
    """HiGHS numbers its presolve rules itself: the bit the solver switches off must be the one
    the installed HiGHS calls probing (a renumbering would switch off another rule silently),
    and every solve, the LP relaxation's too, must pass it."""
    import highspy

    from hulkjax.strategies import ilp

    # Which rule the bit is: HiGHS's log names the rules switched off when presolve runs.
    log = tmp_path / "highs.log"
    h = highspy.Highs()
    for option, value in (("log_to_console", False), ("log_file", str(log)),
                          ("presolve_rule_off", ilp._NO_PROBING)):
        assert h.setOptionValue(option, value) == highspy.HighsStatus.kOk
    xs = [h.addBinary(obj=-float(w)) for w in (5, 4, 3, 7, 6)]
    h.addConstr(sum(w * x for w, x in zip((3, 2, 4, 5, 1), xs)) <= 8)
    assert h.run() == highspy.HighsStatus.kOk
    h.setOptionValue("log_file", "")  # (closes it)
    switched_off = [ln.strip() for ln in log.read_text().splitlines() if ln.strip().startswith("Rule")]
    assert switched_off == [f"Rule 15 (set bit 15 = {1 << 15:7d}): Probing"], switched_off

    # What the solver's runs set.
    seen = []
    set_option = highspy.Highs.setOptionValue
    monkeypatch.setattr(highspy.Highs, "setOptionValue",
                        lambda self, k, v: seen.append((k, v)) or set_option(self, k, v))
    _, _, cm, seeds = mixed_mlp
    solve(cm, seeds=seeds, tie_layers=False)
    relaxation_bound(cm)
    runs = [v for k, v in seen if k == "presolve_rule_off"]
    assert len(runs) >= 2 and set(runs) == {1 << 15}


def test_a_3_axis_vit_gets_a_plan_within_its_time_limit():
    """A 4-layer ViT (hidden 128) on a 2x2x2 mesh: ~1M variables, where HiGHS found no solution
    of its own within 60 s. Started from the best baseline, it returns a plan at its time limit
    (or the optimum), never worse than any baseline, with the gap in the notes."""
    m = zoo.get("vit", size="tiny", n_layers=4, d_model=128)
    topo = hj.Topology.grid((2, 2, 2), ("a", "b", "c"))
    _, plans = _plans_with(m, topo, time_limit=5.0)
    p = plans.pop("ilp")
    assert p.solver.status in ("time limit", "optimal")
    assert p.cost.fits
    assert p.cost.step_time <= min(q.cost.step_time for q in plans.values() if q.cost.fits) * (
        1 + 1e-9)
    assert 0 <= p.solver.gap < 1 and p.solver.bound <= p.solver.objective
    assert f"gap {p.solver.gap:.2%}" in p.notes[0]


def _plans_with(m, topology, **ilp_options):
    state, batch = m.abstract()
    g = hj.trace(m.step, state, batch)
    plans = {s: hj.plan(m.step, state, batch, topology=topology, strategy=s, graph=g)
             for s in BASELINES}
    plans["ilp"] = hj.plan(m.step, state, batch, topology=topology, strategy="ilp", graph=g,
                           **ilp_options)
    return m, plans


@pytest.mark.parametrize("options, message", [
    (dict(time_limit=-1.0), r"time_limit=-1\.0: use seconds >= 0"),
    (dict(mip_rel_gap=-0.1), r"mip_rel_gap=-0\.1"),
    (dict(max_candidates=0), r"max_candidates=0"),
    (dict(memory_limit=0.0), r"memory_limit=0\.0"),
])
def test_bad_solver_options_are_refused(options, message):
    """HiGHS would ignore a negative time limit (and run without one): refused up front."""
    with pytest.raises(hj.errors.InvalidOptionError, match=message):
        hj.strategies.options_of("ilp", **options)


# ---- infeasibility that names its cause -----------------------------------------------------

SMALL_V100 = DeviceSpec(kind="V100", peak_flops=1.25e14, memory=30e6, hbm_bandwidth=9e11)


@pytest.mark.parametrize("strategy", ["ilp", "auto"])
def test_an_axis_that_divides_nothing_is_named_as_the_cause(strategy):
    """Three regions (a 3-way mesh axis) and a model whose sizes are powers of two: the region
    axis can split nothing, so the state is divided 2 ways, not 6. The SPMD planner's message says
    so, with the sizes, and what to do instead of a smaller batch: staged plans, which do fit."""
    topo = hj.Topology.preset("geo", device=SMALL_V100)
    assert dict(zip(topo.axis_names, topo.shape)) == {"region": 3, "gpu": 2}
    m = zoo.get("mlp", size="tiny", width=1024, in_dim=1024, out_dim=1024, depth=4, batch=64)
    g = hj.trace(m.step, *m.abstract())
    with pytest.raises(InfeasiblePlanError) as e:
        hj.plan(m.step, *m.abstract(), topology=topo, strategy=strategy, graph=g, stages=False)
    msg = str(e.value)
    assert msg.startswith(f"{strategy}: no plan fits")
    assert ("nothing in the model can be split over mesh axis 'region' (3 regions): no dimension "
            "of the step's inputs is divisible by 3") in msg
    assert "divided at most 2 ways, not 6" in msg and "dimensions: 64, 1024" in msg
    assert "does not put 3 regions on one axis" in msg and "a batch of 66 instead of 64" in msg
    assert "staged plans" in msg and "smaller batch" not in msg
    # The remedy it names: layers placed per region fit where no SPMD layout does.
    staged = hj.plan(m.step, *m.abstract(), topology=topo, strategy=strategy, graph=g)
    assert staged.stages is not None and len(staged.stages) == 3 and staged.cost.fits
    # The same memory on a mesh whose axes divide the model fits: the axis was the cause.
    grid = hj.Topology.grid((2, 4), ("region", "gpu"), device=SMALL_V100)
    assert hj.plan(m.step, *m.abstract(), topology=grid, strategy=strategy).cost.fits


def test_without_such_an_axis_the_message_stays_about_memory():
    tiny = DeviceSpec(kind="tiny", peak_flops=1e12, memory=1e6, hbm_bandwidth=1e11)
    m = zoo.get("mlp", size="tiny", width=1024, in_dim=1024, out_dim=1024)
    with pytest.raises(InfeasiblePlanError) as e:
        hj.plan(m.step, *m.abstract(), topology=hj.Topology.grid((8,), ("x",), device=tiny),
                strategy="ilp")
    assert "smaller batch" in str(e.value) and "mesh axis" not in str(e.value)


def test_an_axis_that_splits_little_is_named_with_the_bytes():
    """Only the batch (66 = 3 x 22) divides by 3: the parameters, most of the bytes, cannot be
    split over the region axis."""
    topo = hj.Topology.preset("geo", device=SMALL_V100)
    m = zoo.get("mlp", size="tiny", width=1024, in_dim=1024, out_dim=1024, depth=4, batch=66)
    with pytest.raises(InfeasiblePlanError,
                       match=r"mesh axis 'region' \(3 regions\) can split only [\d.]+ [kKMG]B of "
                             r"the inputs' [\d.]+ MB: the rest has no dimension divisible by 3.*"
                             r"most of the inputs is divided at most 2 ways, not 6"):
        hj.plan(m.step, *m.abstract(), topology=topo, strategy="ilp", stages=False)
