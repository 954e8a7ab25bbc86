"""A layout change several operators need is made once (XLA's partitioner keeps one reshard per
instruction and sharding), so the cost model charges it once per (value, layout), and every
planner optimizes that charge: the ILP exactly, the descent by exact deltas."""

import itertools
import random

import jax.numpy as jnp
import numpy as np
import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.cost.model import INPUT
from hulkjax.cost.pipeline import StageWork, node_costs, pipeline_cost, shared_excess
from hulkjax.plan.specs import replicated
from hulkjax.strategies.ilp import _Program, solve
from hulkjax.strategies.partition import BACKWARD, FORWARD, UPDATE, partition
from hulkjax.strategies.realize import cost_model
from hulkjax.strategies.search import local_cost, neighbours

ONE_D = hj.Topology.grid((4,), ("x",), bandwidth=1e9, latency=1e-5)
TWO_D = hj.Topology.grid((2, 4), ("data", "model"))


def _two_readers():
    """One weight read by two matmuls (two groups): ``x @ w`` and ``y @ w``."""
    f = lambda w, x, y: (w, jnp.tanh(x @ w), jnp.tanh(y @ w))  # noqa: E731
    g = hj.trace(f, jnp.ones((64, 256)), jnp.ones((32, 64)), jnp.ones((16, 64)))
    return g, cost_model(g, ONE_D)


@pytest.fixture(scope="module")
def gpt2_tiny():
    m = zoo.get("gpt2", size="tiny")
    g = hj.trace(m.step, *m.abstract())
    return cost_model(g, TWO_D)


def _random(cm, n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(len(grp.candidates)) for grp in cm.groups] for _ in range(n)]


def test_a_gather_two_operators_need_is_charged_once():
    g, cm = _two_readers()
    (w, readers), = cm.shared_items()
    assert w == g.inputs[0] and len(readers) == 2
    gw = cm.group_of_value[w]
    split = next(c for c, s in enumerate(cm.groups[gw].candidates) if s[0] == ("x",))
    a = cm.replicated_assignment()
    a[gw] = split  # w split by rows; both matmuls run replicated and need it whole
    gather = cm.move_time(w, cm.groups[gw].candidates[split], replicated(2), readers[0][1])
    assert gather > 0
    tables = sum(cm.table(gid, c).time for gid, c in enumerate(a))
    assert cm.objective(a) == pytest.approx(tables + gather, rel=1e-12)
    per_reader = sum(cm.edge_time(gp, a[gp], gc, a[gc]) for (gp, gc), _ in cm.edge_items())
    assert per_reader == pytest.approx(2 * gather, rel=1e-12)  # what each edge alone would need
    cost = cm.evaluate(a)
    assert cost.step_time == pytest.approx(cm.objective(a), rel=1e-12)
    assert [c.count for c in cost.collectives if c.kind == "all-gather"] == [1]
    # ... as the program makes it: one all-gather, read by both matmuls.
    assert cm.program_collectives(a) == {("all-gather", ("x",)): 64 * 256 * 4}
    # The breakdown lists both readings (what reads the copy) and charges one.
    moves = [m for m in cm.breakdown(a, memory=False).moves if m.value == w]
    assert sorted(m.repeat for m in moves) == [False, True]


def test_the_ilp_optimum_is_the_brute_force_optimum_with_a_shared_value():
    _, cm = _two_readers()
    sizes = [len(grp.candidates) for grp in cm.groups]
    best = min(cm.objective(list(a)) for a in itertools.product(*map(range, sizes)))
    result = solve(cm, tie_layers=False, max_candidates=10**6)
    assert result.status == "optimal"
    assert result.objective == pytest.approx(best, rel=1e-6)


@pytest.mark.parametrize("aggregate", [True, False], ids=["parts", "pairwise"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_the_integer_program_prices_every_assignment_as_the_objective(gpt2_tiny, tie, aggregate):
    """At every integral point the program's objective (its shared-change variables at their
    least feasible value: the largest reading's excess over the first) is the cost model's
    objective, and every row holds: the linearization is exact."""
    cm = gpt2_tiny
    prog = _Program(cm, [], tie_layers=tie, restrict=None, max_candidates=256,
                    aggregate=aggregate)
    assert prog.z_rows  # GPT-2's weights and activations are read by several operators
    for a in _random(cm, 12, seed=int(tie)):
        for gids in prog.members.values():
            for gid in gids:
                a[gid] = a[gids[0]]
        x = prog.vector(a)
        assert prog.cost @ x == pytest.approx(cm.objective(a), rel=1e-12)
        rows = prog.matrix @ x
        assert np.all(rows[:-1] >= prog.row_lo[:-1] - 1e-9)
        assert np.all(rows[:-1] <= prog.row_hi_wo_memory + 1e-9)
        for z, readings in prog.z_rows:  # least feasible (the excess over the first reading)
            first = x[readings[0]].sum() if prog.excess else 0.0
            assert x[z] + first == max(x[c].sum() for c in readings)


def test_the_descent_sees_a_group_s_exact_share_of_the_objective(gpt2_tiny):
    """``local_cost`` differences are objective differences, shared changes included."""
    cm = gpt2_tiny
    nb = neighbours(cm)
    touched = [gid for gid in cm.shared_of_group if len(cm.groups[gid].candidates) > 2]
    rng = random.Random(3)
    checked = 0
    for a in _random(cm, 4, seed=5):
        for gid in rng.sample(touched, 6):
            _assert_local_delta(cm, nb, gid, a, rng)
            checked += 1
    assert checked == 24


def _assert_local_delta(cm, nb, gid, a, rng):
    """Moving group ``gid`` between two of its candidates changes ``local_cost`` as much as
    the objective."""
    c1, c2 = rng.sample(range(len(cm.groups[gid].candidates)), 2)
    b1, b2 = list(a), list(a)
    b1[gid], b2[gid] = c1, c2
    delta = local_cost(cm, nb, gid, c1, a) - local_cost(cm, nb, gid, c2, a)
    assert delta == pytest.approx(cm.objective(b1) - cm.objective(b2), rel=1e-9, abs=1e-15)


def test_breakdown_charges_what_evaluate_charges(gpt2_tiny):
    cm = gpt2_tiny
    repeats = 0
    for a in _random(cm, 4, seed=7):
        b = cm.breakdown(a, memory=False)
        own = sum(cm.comm_time(c) for cs in b.own.values() for c in cs)
        moved = sum(cm.comm_time(m.comm) for m in b.moves if not m.repeat)
        assert own + moved == pytest.approx(cm.evaluate(a).comm_time, rel=1e-9)
        repeats += sum(m.repeat for m in b.moves)
    assert repeats  # some change is shared under random layouts


def test_input_groups_of_shared_values_are_known_to_the_descent(gpt2_tiny):
    cm = gpt2_tiny
    for v, readers in cm.shared_items():
        for gid in {cm.group_of_value[v], *(r[0] for r in readers)}:
            assert v in cm.shared_of_group[gid]
    assert any(cm.groups[cm.group_of_value[v]].kind == INPUT for v, _ in cm.shared_items())


def test_values_no_layout_splits_are_not_shared_terms(gpt2_tiny):
    """An optimizer's scalars (its step count's powers) are read by every parameter's update:
    they are never changed, so they are not shared terms (they made the descent's shared terms
    several times dearer), and the objective charges them nothing either way."""
    cm = gpt2_tiny
    g = cm.graph
    unsplittable = lambda v: all(d <= 1 for d in g.values[v].shape)  # noqa: E731
    assert not any(unsplittable(v) for v, _ in cm.shared_items())
    many = [v for v, n in _readers(cm).items() if n > 2 and unsplittable(v)]
    assert many  # the Adam update's scalars are read by every parameter's update group
    for a in _random(cm, 3, seed=11):
        assert not any(m.value in many for m in cm.breakdown(a, memory=False).moves)


def _readers(cm) -> dict[int, int]:
    counts: dict[int, int] = {}
    for (_, _gc), items in cm.edge_items():
        for v, nid, _k in items:
            if nid >= 0:
                counts[v] = counts.get(v, 0) + 1
    return counts


def test_one_program_charges_a_shared_change_at_its_dearest_reading(gpt2_tiny):
    """Per-reader charges less :func:`shared_excess` over every operator is the SPMD objective
    (one program: each change made once)."""
    cm = gpt2_tiny
    every = range(len(cm.graph.nodes))
    excess = 0.0
    for a in _random(cm, 4, seed=13):
        nc = node_costs(cm, a)
        per_reader = float(nc.time.sum()) + sum(nc.state_moves.values())
        assert per_reader - shared_excess(nc, every) == pytest.approx(cm.objective(a), rel=1e-12)
        excess += shared_excess(nc, every)
    assert excess > 0


def test_a_stage_makes_a_shared_change_once_per_program(gpt2_tiny):
    """A stage runs a program per phase (forward, backward, update): each makes a change its
    operators share once, a change read in two phases twice."""
    cm = gpt2_tiny
    g = cm.graph
    part = partition(g)
    phases = [tuple(n.id for n in g.nodes if part.phase[n.id] == ph)
              for ph in (FORWARD, BACKWARD, UPDATE)]
    shared_in_a_phase = 0.0
    for a in _random(cm, 4, seed=17):
        nc = node_costs(cm, a)
        work = StageWork(devices=tuple(range(cm.topology.num_devices)), cost_model=cm,
                         assignment=a, forward=phases[0], backward=phases[1],
                         update=phases[2], inputs=tuple(range(len(g.inputs))))
        st, = pipeline_cost(cm.topology, g, [work], microbatches=1).stages
        excess = [shared_excess(nc, ph) for ph in phases]
        for t, ph, x in zip((st.forward, st.backward), phases, excess):
            assert t == pytest.approx(float(sum(nc.time[n] for n in ph)) - x, rel=1e-12)
        # programs per phase share less than one program does
        assert sum(excess) <= shared_excess(nc, range(len(g.nodes))) + 1e-18
        shared_in_a_phase += sum(excess)
    assert shared_in_a_phase > 0


@pytest.mark.parametrize("runs", [None, (1, 1, 1), (4, 4, 1)], ids=["once", "ones", "M=4"])
def test_the_per_program_objective_is_what_a_stage_s_programs_make(gpt2_tiny, runs):
    """``by_programs(phase, runs)`` charges a shared change once per phase program that reads
    it, and each program's time times its runs: its objective is the per-reader charge less
    :func:`shared_excess` of each phase (what ``pipeline_cost`` takes off a stage), each phase
    times its runs (a stage's forward and backward once per microbatch, its update once), and
    the ILP and descent over it see the same."""
    cm = gpt2_tiny
    g = cm.graph
    part = partition(g)
    names = (FORWARD, BACKWARD, UPDATE)
    view = cm.by_programs(part.phase, None if runs is None else dict(zip(names, runs)))
    assert cm.program_of is None and cm.program_runs is None  # the view is a copy
    phases = [tuple(n.id for n in g.nodes if part.phase[n.id] == ph) for ph in names]
    times = runs or (1, 1, 1)
    dearer = 0
    for a in _random(cm, 4, seed=19):
        nc = node_costs(cm, a)
        staged = sum(k * (float(sum(nc.time[n] for n in ph)) - shared_excess(nc, ph))
                     for k, ph in zip(times, phases)) + sum(nc.state_moves.values())
        assert view.objective(a) == pytest.approx(staged, rel=1e-12)
        one = view.evaluate(a).step_time  # evaluate: one run of each program
        assert one == pytest.approx(view.objective(a) if runs != (4, 4, 1) else sum(
            float(sum(nc.time[n] for n in ph)) - shared_excess(nc, ph) for ph in phases)
            + sum(nc.state_moves.values()), rel=1e-12)
        assert cm.objective(a) == pytest.approx(float(nc.time.sum()) + sum(
            nc.state_moves.values()) - shared_excess(nc, range(len(g.nodes))), rel=1e-12)
        dearer += one > cm.objective(a) * (1 + 1e-9)
    assert dearer  # a change read in the forward and the backward phase is made twice
    # the integer program and the descent price the view's objective
    prog = _Program(view, [], tie_layers=False, restrict=None, max_candidates=256)
    nb = neighbours(view)
    rng = random.Random(23)
    for a in _random(cm, 3, seed=29):
        assert prog.cost @ prog.vector(a) == pytest.approx(view.objective(a), rel=1e-12)
        for _ in range(3):
            gid = rng.choice([gid for gid in view.shared_of_group
                              if len(view.groups[gid].candidates) > 2])
            _assert_local_delta(view, nb, gid, a, rng)
