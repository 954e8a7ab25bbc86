"""Speed-ups of planning leave the plans as they were."""

import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.strategies import stages
from hulkjax.strategies.baselines import BASELINES

TWO_NODES = hj.Topology.preset("dgx-h100", nodes=2, gpus_per_node=4)


def _record(plan) -> tuple:
    staged = None if plan.stages is None else [(s.devices, s.layers, s.strategy)
                                               for s in plan.stages]
    return ([t.spec for t in plan.inputs], [t.spec for t in plan.outputs], staged,
            plan.microbatches, plan.cost.step_time, plan.cost.peak_memory)


@pytest.mark.parametrize("strategy", ["auto", "pipeline"])
def test_stage_search_builds_only_the_baselines_it_keeps(monkeypatch, strategy):
    """The staged search asks for the baselines it stores (not all of them), and plans exactly as
    when every baseline was built."""
    m = zoo.get("gpt2", size="tiny")
    state, batch = m.abstract()
    real = stages.baseline_assignments
    asked = []

    def spy(graph, topology, names=BASELINES, **kw):
        asked.append(tuple(names))
        return real(graph, topology, names, **kw)

    def every(graph, topology, names=BASELINES, **kw):
        return real(graph, topology, **kw)

    runs = {}
    for label, fn in (("only kept", spy), ("all", every)):
        monkeypatch.setattr(stages, "baseline_assignments", fn)
        g = hj.trace(m.step, state, batch)  # a fresh graph: staged contexts are cached on it
        runs[label] = _record(hj.plan(m.step, state, batch, topology=TWO_NODES,
                                      strategy=strategy, graph=g))
    assert runs["only kept"] == runs["all"]
    assert asked and all(set(n) <= {"fsdp", "dp_tp", "megatron"} for n in asked), asked


@pytest.mark.parametrize("topology", [TWO_NODES, hj.Topology.grid((2, 4), ("data", "model"))])
def test_baselines_completed_from_layouts_are_their_plans_assignments(topology):
    """``baseline_assignments`` completes each baseline's layouts without building its plan (a
    speed-up of ``auto`` and of the ILP's seeds): the assignments are those of the plans."""
    from hulkjax.strategies.baselines import baseline_assignments
    from hulkjax.strategies.registry import strategies

    m = zoo.get("gpt2", size="tiny")
    g = hj.trace(m.step, *m.abstract())
    fast = baseline_assignments(g, topology)
    assert set(fast) == set(BASELINES) - ({"dp_tp"} if len(topology.axis_names) < 2 else set())
    for name, a in fast.items():
        assert a == strategies[name].fn(g, topology).assignment, name
