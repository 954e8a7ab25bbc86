"""The staged search's lower bounds: true bounds under the pipeline cost, and plans unchanged by
the pruning they allow."""

import itertools
import logging

import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.strategies import stages
from hulkjax.strategies.ilp import solve
from hulkjax.strategies.stages import (
    StagedLayout,
    _context,
    _pipeline_floor,
    layout_cost,
    search,
    staged_lower_bound,
    uniform_ranges,
)
from hulkjax.topology.specs import LinkSpec

TWO_NODES = hj.Topology.preset("dgx-h100", nodes=2, gpus_per_node=4)
FOUR_NODES = hj.Topology.preset("dgx-h100", nodes=4, gpus_per_node=2)
# tests/strategies/test_stages.py's regional cluster, where staged plans win
REGIONAL = hj.Topology.preset("regional", regions=2, gpus_per_node=4, device="V100",
                              metro=LinkSpec(bandwidth=5e9 / 8, latency=2e-3))


def _record(plan) -> tuple:
    staged = None if plan.stages is None else [(s.devices, s.layers, s.strategy)
                                               for s in plan.stages]
    return ([t.spec for t in plan.inputs], [t.spec for t in plan.outputs], staged,
            plan.microbatches, plan.schedule, plan.assignment, plan.cost.step_time,
            plan.cost.peak_memory)


def _candidates(g, topology, level):
    """Staged layouts of many shapes: the search's best per microbatch count and schedule, and
    uniform layouts over every order of the groups, with each intra-stage plan."""
    ctx = _context(g, topology)
    groups = topology.groups(level)
    out = []
    for M in (1, 2, 4, 8):
        if not ctx.usable(M):  # one example per microbatch: the step traces differently
            continue
        for v in (1, 2):
            res = search(g, topology, solver=solve, microbatches=[M], virtual_stages=(v,),
                         keep=2)
            out += [lay for _, lay in res.layouts]
        for S in (1, 2):
            for order in itertools.permutations(range(len(groups)), S):
                # dp: every gradient accumulated unreduced, its reduction once per step
                for plan in ("dp_tp", "fsdp", "ilp", "dp"):
                    out.append(StagedLayout(groups=tuple(groups[k] for k in order),
                                            ranges=tuple(uniform_ranges(ctx.part, S)),
                                            plans=(plan,) * S, microbatches=M))
        if max(M, 2) % len(groups) == 0:  # Megatron-LM's condition, as the search builds them
            out.append(StagedLayout(groups=tuple(groups) * 2,
                                    ranges=tuple(uniform_ranges(ctx.part, 2 * len(groups))),
                                    plans=("dp_tp",) * (2 * len(groups)), microbatches=max(M, 2),
                                    schedule="interleaved", virtual_stages=2))
        out.append(StagedLayout(groups=tuple(groups), ranges=tuple(uniform_ranges(ctx.part, 2)),
                                plans=("fsdp",) * 2, microbatches=M, schedule="gpipe"))
        out.append(StagedLayout(groups=tuple(groups), ranges=tuple(uniform_ranges(ctx.part, 2)),
                                plans=("dp",) * 2, microbatches=M, schedule="gpipe"))
    return ctx, groups, list(dict.fromkeys(out))


@pytest.mark.parametrize("model,kw,topology,level", [
    ("gpt2", {"size": "tiny"}, TWO_NODES, "node"),
    ("gpt2", {"size": "tiny"}, FOUR_NODES, "node"),
    ("transformer-block", {"size": "small", "n_layers": 8, "batch": 64}, REGIONAL, "region"),
])
def test_lower_bounds_are_at_most_the_exact_pipeline_cost(model, kw, topology, level):
    m = zoo.get(model, **kw)
    g = hj.trace(m.step, *m.abstract())
    ctx, groups, layouts = _candidates(g, topology, level)
    assert len(layouts) > 20
    checked = 0
    for layout in layouts:
        ctx.table(layout.microbatches, stages.group_topology(topology, layout.groups[0]),
                  layout.plans[0])
        exact = layout_cost(ctx, layout).step_time
        bound = staged_lower_bound(ctx, groups, layout.microbatches)
        assert 0 < bound <= exact, (layout, bound, exact)
        floor = _pipeline_floor(ctx, layout)
        assert floor <= exact, (layout, floor, exact)
        checked += floor > 0
    assert checked > len(layouts) // 2  # the floor had its tables for most layouts
    assert any(st.reduction > 0 for layout in layouts if layout.microbatches > 1
               for st in layout_cost(ctx, layout).stages)  # gradients left unreduced
    # The bound grows with the microbatches' kernel launches: it is of use for many of them.
    assert staged_lower_bound(ctx, groups, 64) > staged_lower_bound(ctx, groups, 2)


@pytest.mark.parametrize("model,kw,topology", [
    ("gpt2", {"size": "tiny"}, TWO_NODES),
    ("transformer-block", {"size": "small", "n_layers": 16, "batch": 64}, REGIONAL),
])
@pytest.mark.parametrize("strategy", ["auto", "ilp"])
def test_pruning_leaves_the_plan_as_it_was(monkeypatch, model, kw, topology, strategy):
    """With the bounds (microbatch counts skipped, layouts not costed) and without them (every
    count the local search reaches, the twelve best layouts costed), the plan is the same."""
    m = zoo.get(model, **kw)
    state, batch = m.abstract()
    runs, costed = {}, {"pruned": 0, "full": 0}
    counts = {"pruned": set(), "full": set()}  # microbatch counts whose tables were built
    real_cost, real_table = stages.layout_cost, stages._Context.table
    for label in ("pruned", "full"):
        if label == "full":
            monkeypatch.setattr(stages, "staged_lower_bound", lambda *a, **k: 0.0)
            monkeypatch.setattr(stages, "_pipeline_floor", lambda *a, **k: 0.0)

        def counted(ctx, layout, label=label):
            costed[label] += 1
            return real_cost(ctx, layout)

        def table(self, M, sub, name, label=label):
            counts[label].add(M)
            return real_table(self, M, sub, name)

        monkeypatch.setattr(stages, "layout_cost", counted)
        monkeypatch.setattr(stages._Context, "table", table)
        g = hj.trace(m.step, state, batch)  # a fresh graph: staged contexts are cached on it
        runs[label] = _record(hj.plan(m.step, state, batch, topology=topology,
                                      strategy=strategy, graph=g))
    assert runs["pruned"] == runs["full"]
    assert counts["pruned"] <= counts["full"], counts  # no count the search would not reach
    if topology is REGIONAL:
        assert runs["full"][2] is not None  # a staged plan won: the pruning kept it
        assert costed["pruned"] <= costed["full"], costed
    else:  # SPMD wins by far: counts skipped, layouts not costed
        assert costed["pruned"] < costed["full"], costed


def test_the_cutoff_skips_hopeless_microbatch_counts(caplog):
    """Where the best SPMD plan is far ahead, counts whose bound exceeds it are not searched."""
    m = zoo.get("gpt2", size="tiny")
    g = hj.trace(m.step, *m.abstract())
    ctx = _context(g, TWO_NODES)
    groups = TWO_NODES.groups("node")
    bounds = {M: staged_lower_bound(ctx, groups, M) for M in (1, 2, 4, 8)}
    cutoff = sorted(bounds.values())[1] * 1.0001  # above the two smallest bounds only
    searched = []
    real = ctx.table

    def spy(M, sub, name):
        searched.append(M)
        return real(M, sub, name)

    ctx.table = spy
    with caplog.at_level(logging.INFO, logger="hulkjax.stages"):
        search(g, TWO_NODES, solver=solve, cutoff=cutoff)
    hopeless = {M for M, b in bounds.items() if b >= cutoff}
    assert hopeless and not hopeless & set(searched), (bounds, cutoff, set(searched))
    assert any("skipping" in r.message for r in caplog.records)


@pytest.mark.parametrize("model,kw,topology", [
    ("gpt2", {"size": "tiny"}, TWO_NODES),
    ("gpt2", {"size": "tiny"}, hj.Topology.preset("dgx-h100", nodes=4, gpus_per_node=2)),
    ("transformer-block", {"size": "small", "n_layers": 8, "batch": 64}, REGIONAL),
])
def test_the_pipeline_baselines_bound_is_at_most_its_cost(model, kw, topology):
    """best_staged costs the pipeline baseline only where its bound (its own microbatches, plain
    1F1B) is below the cutoff: the bound must not exceed its exact cost."""
    m = zoo.get(model, **kw)
    g = hj.trace(m.step, *m.abstract())
    ctx, layout, _, level = stages._pipeline_layout(g, topology, stages.PipelineOptions())
    bound = staged_lower_bound(ctx, stages.device_groups(topology)[level], layout.microbatches,
                               schedule=layout.schedule, virtual_stages=(1,))
    assert 0 < bound <= layout_cost(ctx, layout).step_time


def test_a_search_left_out_by_the_cutoff_says_so():
    """Where the cutoff leaves every staged plan out (the pipeline baseline, microbatch counts,
    found layouts), best_staged returns no plan and a note with the least bound left out."""
    m = zoo.get("gpt2", size="tiny")
    g = hj.trace(m.step, *m.abstract())
    ctx = _context(g, TWO_NODES)
    groups = TWO_NODES.groups("node")
    spmd = 0.5 * min(staged_lower_bound(ctx, groups, M) for M in (1, 2, 4, 8))
    plan, notes = stages.best_staged(g, TWO_NODES, strategy="auto", spmd_time=spmd,
                                     solver=solve)
    assert plan is None
    assert len(notes) == 1 and "no staged plan can be" in notes[0], notes


def test_every_block_boundary_carries_activations_both_ways():
    """The bound's transfers: each boundary inside the transformer blocks sends activations
    forward and their gradients back (batch-sized), and one microbatch gets no credit for
    interleaving (it needs a multiple of the groups): the bound is plain 1F1B's there."""
    m = zoo.get("gpt2", size="tiny")
    g = hj.trace(m.step, *m.abstract())
    ctx = _context(g, TWO_NODES)
    fl = stages._node_floor(ctx)
    labels = [u.label for u in ctx.part.units]
    blocks = [j for j in range(1, len(labels)) if "/h_" in labels[j - 1] and "/h_" in labels[j]]
    assert blocks, labels
    for j in blocks:
        assert fl.cross_scaled[0, j] > 0 and fl.cross_scaled[1, j] > 0, (j, labels)
    groups = TWO_NODES.groups("node")
    assert staged_lower_bound(ctx, groups, 1) == staged_lower_bound(ctx, groups, 1,
                                                                    virtual_stages=(1,))
    assert staged_lower_bound(ctx, groups, 2) < staged_lower_bound(ctx, groups, 2,
                                                                   virtual_stages=(1,))
