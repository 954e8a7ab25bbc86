"""The cost of gradients accumulated unreduced over microbatches: which sums a stage's plan
leaves unreduced, their all-reduces taken out of every microbatch and charged once per step
(hidden by the drain where the schedule runs them there), and the intra-stage ILP's objective
pricing them so."""

import math

import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.cost.pipeline import node_costs, pipeline_cost, shared_excess
from hulkjax.cost.unreduced import unreduced_sums
from hulkjax.plan.collectives import Comm
from hulkjax.plan.stages import schedule_queues, schedule_times
from hulkjax.strategies.partition import BACKWARD, FORWARD, UPDATE
from hulkjax.strategies.realize import cost_model
from hulkjax.strategies.stages import (
    StagedLayout,
    _context,
    group_topology,
    stage_works,
    uniform_ranges,
)
from hulkjax.topology.specs import LinkSpec

# Two sites of one 4-GPU node each, the GPUs joined by a slow link: the gradients' reductions
# inside a stage cost more than the tiny MLP's compute, so the drain cannot hide them.
SLOW = hj.Topology.preset("regional", regions=2, gpus_per_node=4,
                          intra_node={"A100": LinkSpec(bandwidth=1e6, latency=1e-3)})
M = 4


@pytest.fixture(scope="module")
def staged():
    """``(ctx, layout, works)``: the MLP on SLOW, data parallel inside both stages, 4
    microbatches, 1F1B."""
    m = zoo.get("mlp", size="tiny", optimizer="sgd")
    g = hj.trace(m.step, *m.abstract())
    ctx = _context(g, SLOW)
    groups = SLOW.groups("region")
    layout = StagedLayout(groups=tuple(groups), ranges=tuple(uniform_ranges(ctx.part, 2)),
                          plans=("dp", "dp"), microbatches=M)
    works, _ = stage_works(ctx, layout)
    return ctx, layout, works


def test_every_gradient_of_a_data_parallel_stage_is_left_unreduced(staged):
    ctx, _, works = staged
    g, split = ctx.graph, ctx.part.split
    for w in works:
        rec = unreduced_sums(w.cost_model, w.assignment, split, w.forward + w.backward)
        made = [x for x, c in split.boundary.items() if c.kind == "sum"
                and g.values[x].producer in set(w.forward + w.backward)]
        assert sorted(rec) == sorted(made) and made
        nc = node_costs(w.cost_model, w.assignment)
        for x, r in rec.items():
            assert r.axes == ("gpu",)
            # Every collective of the operator is the batch's all-reduce, deferred.
            assert r.deferred == tuple(range(len(nc.own[r.node]))) and r.deferred
            # Once per step: the float32 accumulator of the whole (replicated) value.
            assert r.reduction == Comm("all-reduce", ("gpu",),
                                       4 * math.prod(g.values[x].shape), deferred=True)


def test_the_reductions_leave_the_microbatches_and_are_charged_once(staged):
    ctx, layout, works = staged
    split = ctx.part.split
    cost = pipeline_cost(SLOW, ctx.graph, works, microbatches=M, split=split)
    per_mb = pipeline_cost(SLOW, ctx.graph, works, microbatches=M, split=None)
    for k, w in enumerate(works):
        cm, nc = w.cost_model, node_costs(w.cost_model, w.assignment)
        rec = unreduced_sums(cm, w.assignment, split, w.forward + w.backward)
        saved = {r.node: sum(cm.comm_time(nc.own[r.node][i]) for i in r.deferred)
                 for r in rec.values()}
        for phase, nodes, got in (("forward", w.forward, cost.stages[k].forward),
                                  ("backward", w.backward, cost.stages[k].backward)):
            want = sum(nc.time[n] - saved.get(n, 0.0) for n in nodes) - shared_excess(nc, nodes)
            assert got == pytest.approx(want, rel=1e-12), phase
        assert sum(saved.values()) > 0
        st, old = cost.stages[k], per_mb.stages[k]
        assert old.forward + old.backward - st.forward - st.backward == pytest.approx(
            sum(saved.values()), rel=1e-9)
        assert st.reduction == pytest.approx(
            sum(cm.comm_time(r.reduction) for r in rec.values()), rel=1e-12)
        assert old.reduction == 0.0
        # The stage's collectives per step on its axis (as its backend runs them, the combined
        # reductions sharing a latency): the reductions once, not M times.
        def on_axis(c, cm=cm):
            return cm.comm_time_by_axis(c)["gpu"]

        want = sum(M * sum(on_axis(nc.own[r.node][i]) for i in r.deferred)
                   - on_axis(r.reduction) for r in rec.values())
        assert per_mb.comm_time_by_axis[f"s{k}/gpu"] - cost.comm_time_by_axis[f"s{k}/gpu"] \
            == pytest.approx(want, rel=1e-9)
        # Memory: the float32 accumulators, one whole value per device, as before.
        assert st.memory_breakdown["accumulators"] == pytest.approx(
            sum(r.reduction.bytes for r in rec.values()))
    assert cost.step_time < per_mb.step_time


def test_the_drain_hides_the_last_stages_reduction(staged):
    """1F1B on two stages: stage 1's last backward ends before stage 0's, which waits for its
    gradient (the backward transfer) and then runs its own last backward; stage 1 reduces in
    that window. Stage 0's last backward ends the pipeline: its reduction is all exposed."""
    ctx, _, works = staged
    cost = pipeline_cost(SLOW, ctx.graph, works, microbatches=M, split=ctx.part.split)
    s0, s1 = cost.stages
    back = next(t for t in cost.transfers if (t.src, t.dst) == (1, 0))
    window = back.latency + back.microbatch_bytes / back.bandwidth + s0.backward
    assert s1.reduction > window > 0, "the slow link makes the reduction longer than the drain"
    assert s1.reduction_exposed == pytest.approx(s1.reduction - window, rel=1e-9)
    assert s0.reduction_exposed == pytest.approx(s0.reduction, rel=1e-12)


def test_the_intra_stage_objective_charges_unreduced_sums_once(staged):
    """The intra-stage ILP minimizes the step a stage runs (forward and backward ``M`` times,
    the update once): with the microbatch analysis, each unreduced sum's all-reduce once, on its
    float32 accumulator."""
    ctx, _, works = staged
    part, split = ctx.part, ctx.part.split
    runs = {FORWARD: M, BACKWARD: M, UPDATE: 1}
    for w in works:
        cm = w.cost_model
        plain = cm.by_programs(part.phase, runs)
        view = cm.by_programs(part.phase, runs, split=split)
        nc = node_costs(cm, w.assignment)
        every = [n for n in range(len(cm.graph.nodes))]
        rec = unreduced_sums(cm, w.assignment, split, [n for n in every
                                                       if part.phase[n] != UPDATE])
        want = sum(cm.comm_time(r.reduction) - M * sum(cm.comm_time(nc.own[r.node][i])
                                                       for i in r.deferred)
                   for r in rec.values())
        assert want < 0
        assert view.objective(w.assignment) - plain.objective(w.assignment) == pytest.approx(
            want, rel=1e-9)


def test_staged_plans_record_their_unreduced_sums():
    topo = hj.Topology.preset("regional", regions=2, gpus_per_node=4)
    m = zoo.get("mlp", size="tiny", optimizer="sgd")
    g = hj.trace(m.step, *m.abstract())
    plan = hj.plan(m.step, *m.abstract(), topology=topo, strategy="pipeline", microbatches=2,
                   graph=g)
    ctx = _context(g, topo)
    for k, st in enumerate(plan.stages):
        cm = cost_model(ctx.micro(2), group_topology(topo, st.devices))
        rec = unreduced_sums(cm, plan.assignment[k], ctx.part.split, st.forward + st.backward)
        assert st.unreduced == {x: r.axes for x, r in rec.items()}
    one = hj.plan(m.step, *m.abstract(), topology=topo, strategy="pipeline", microbatches=1,
                  graph=g)
    assert not any(st.unreduced for st in one.stages)
    assert all(st.reduction == 0.0 for st in one.cost.stages)


def test_a_chunks_reduction_keeps_its_group_busy():
    """Interleaved: a stage reduces right after its last program, on its group's devices, so
    the group's next program (another chunk's backward) starts after it, as the emitted step
    runs them."""
    f, b = [1.0] * 4, [2.0] * 4
    plain = schedule_times("interleaved", 2, 2, 4, f, b)
    tails = schedule_times("interleaved", 2, 2, 4, f, b, tails=[0.0, 0.0, 5.0, 0.0])
    queue = schedule_queues("interleaved", 2, 2, 4)[0]  # group 0: chunks 0 and 2
    last = max(i for i, key in enumerate(queue) if key[0] == 2)
    assert last + 1 < len(queue), "chunk 0's backwards come after chunk 2's last"
    nxt = queue[last + 1]
    assert tails[nxt][0] >= tails[queue[last]][1] + 5.0 > plain[nxt][0]
    assert all(tails[key] == plain[key] for key in queue[:last + 1])
