"""A staged plan's communication per stage and mesh axis (``Cost.comm_time_by_axis`` and
``Cost.comm_bytes``), found from each stage's own nodes (``NodeCosts.by_node``): the same sums as a
walk over every node of the step, in the same order, and the stage's communication in all."""

import math
from collections import defaultdict

import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.cost import pipeline as P
from hulkjax.cost.unreduced import unreduced_sums
from hulkjax.strategies.baselines import baseline_assignments
from hulkjax.strategies.partition import partition
from hulkjax.strategies.realize import cost_model
from hulkjax.strategies.stages import stage_models

THREE = hj.Topology.preset("hetero", nodes=(("A100", 4), ("V100", 2), ("T4", 2)))


def _walked(s, unreduced, M):
    """The stage's collectives per axis from a walk over every node of the step."""
    cm, b = s.cost_model, P.node_costs(s.cost_model, s.assignment)
    mb, up = set(s.forward) | set(s.backward), set(s.update)
    deferred = {(x.node, i) for x in unreduced.values() for i in x.deferred}
    per, sent = defaultdict(float), defaultdict(float)

    def add(comm, times):
        t, nbytes = P._axis_charges(cm, comm)
        for axis, x in t.items():
            per[axis] += x * times
        for axis, x in nbytes.items():
            sent[axis] += x * times

    for nid, comms in b.own.items():
        times = M if nid in mb else 1 if nid in up else 0
        for i, c in enumerate(comms):
            if times and (nid, i) not in deferred:
                add(c, times)
    for x in unreduced.values():
        add(x.reduction, 1)
    copies = {i for ph in (s.forward, s.backward, s.update) for *_, ix in P._copies(b, ph)
              for i in ix}
    mine_in = set(s.inputs)
    held = {cm.graph.outputs[o] for i, o in cm.graph.carried.items() if i in mine_in}
    for i, m in enumerate(b.moves):
        times = M if m.node in mb else 1 if m.node in up or (m.node < 0 and m.value in held) \
            else 0
        if times and i not in copies:
            add(m.comm, times)
    return dict(per), dict(sent)


@pytest.mark.parametrize("strategy", ["dp_tp", "zero"])
def test_stage_collectives_per_axis_are_the_walk_over_every_node(strategy):
    """``dp_tp``: the pipeline baseline's stages; ``zero``: each stage's plan replaced by the
    distributed optimizer's (state apart), whose update reads the gradient reduced onto the
    state's shards and gathers the parameter: collectives in the update, charged once a step,
    beside the microbatches' charged ``M`` times."""
    m = zoo.get("gpt2", size="tiny", batch=8)
    state, batch = m.abstract()
    g = hj.trace(m.step, state, batch)
    plan = hj.plan(m.step, state, batch, topology=THREE, strategy="pipeline", microbatches=4,
                   graph=g)
    split = partition(g).split
    seen = update = 0
    for k, (st, (cm, a)) in enumerate(zip(plan.stages, stage_models(g, THREE, plan))):
        if strategy == "zero":
            cm = cost_model(cm.graph, cm.topology, optimizer_apart=True)
            a = baseline_assignments(cm.graph, cm.topology, ("zero",),
                                     optimizer_apart=True)["zero"]
        s = P.StageWork(devices=st.devices, cost_model=cm, assignment=a, forward=st.forward,
                        backward=st.backward, update=st.update, inputs=st.inputs)
        un = unreduced_sums(cm, a, split, s.forward + s.backward)
        got = P._stage_times(s, un)["comm_by_axis"](4)[:2]
        assert got == _walked(s, un, 4), k
        seen += sum(t > 0 for t in got[0].values())
        b = P.node_costs(cm, a)
        update += sum(1 for m in b.moves if m.node in set(st.update))
    assert seen and (update > 0) == (strategy == "zero")


@pytest.mark.parametrize("topology,strategy", [
    (THREE, "pipeline"),
    (hj.Topology.preset("dgx-h100", nodes=2), "auto"),
    (hj.Topology.preset("dgx-h100", nodes=2), "pipeline"),
])
def test_a_stage_s_axes_add_up_to_its_communication(topology, strategy):
    """Each stage's seconds per axis sum to its ``StageTime.comm`` (as its backend runs its
    collectives: gradient all-reduces that XLA combines share one latency, which the staged
    axes charged once each, 100x the stage's communication of a tiny GPT-2 on two DGX nodes),
    and an axis with time has bytes."""
    m = zoo.get("gpt2", size="tiny", batch=8)
    state, batch = m.abstract()
    g = hj.trace(m.step, state, batch)
    kw = {"microbatches": 4} if strategy == "pipeline" else {}
    plan = hj.plan(m.step, state, batch, topology=topology, strategy=strategy, graph=g, **kw)
    c = plan.cost
    assert c.stages, plan.notes
    assert set(c.comm_bytes) == set(c.comm_time_by_axis)
    for k, st in enumerate(c.stages):
        mine = {a: t for a, t in c.comm_time_by_axis.items() if a.startswith(f"s{k}/")}
        assert math.isclose(sum(mine.values()), st.comm, rel_tol=1e-9, abs_tol=1e-15), k
        for a, t in mine.items():
            assert (t > 0) == (c.comm_bytes[a] > 0), (a, t, c.comm_bytes[a])
    assert any(c.comm_bytes.values())
