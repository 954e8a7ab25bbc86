"""Gradients accumulated unreduced over the microbatches and reduced once per step: the staged
step equals the unsharded one, its microbatch programs make no reduction over the batch axes,
each stage's reduction program makes one, and the cost model charges what the programs do."""

import math

import jax
import numpy as np
import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.cost.pipeline import node_costs
from hulkjax.cost.unreduced import ACCUMULATOR_BYTES, unreduced_sums
from hulkjax.plan.specs import from_pspec, local_shape
from hulkjax.strategies.realize import cost_model
from hulkjax.strategies.stages import (
    StagedLayout,
    _context,
    build_plan,
    group_topology,
    uniform_ranges,
)
from tests.helpers import assert_trees_close

# Two sites of 2 nodes x 2 GPUs: a stage's mesh is (node, gpu); dp_tp splits the batch over
# "node" (data parallel) and the layers over "gpu" (tensor parallel).
REGIONAL = hj.Topology.preset("regional", regions=2, nodes_per_region=2, gpus_per_node=2)
# Two 4-GPU nodes: a stage's mesh is one axis, "gpu".
TWO = hj.Topology.preset("hetero", nodes=(("A100", 4), ("A100", 4)))


def _plan(m, state, batch, topology, plans, M, schedule="1f1b", v=1):
    """The uniform staged plan with ``plans`` inside its stages (one stage per region or node,
    ``v`` chunks per group)."""
    g = hj.trace(m.step, state, batch)
    ctx = _context(g, topology)
    level = "region" if len(topology.groups("region")) > 1 else "node"
    groups = topology.groups(level)
    layout = StagedLayout(groups=tuple(groups) * v,
                          ranges=tuple(uniform_ranges(ctx.part, len(groups) * v)),
                          plans=(plans,) * (len(groups) * v), microbatches=M,
                          schedule=schedule, virtual_stages=v)
    plan = build_plan(ctx, layout, "pipeline")
    plan.graph, plan.topology, plan.in_tree, plan.out_tree = g, topology, g.in_tree, g.out_tree
    plan.graph_fingerprint, plan.topology_fingerprint = g.fingerprint(), topology.fingerprint()
    return plan


def _records(plan, topology):
    """Per stage, the cost model's :class:`~hulkjax.cost.unreduced.Unreduced` records."""
    ctx = _context(plan.graph, topology)
    micro = ctx.micro(plan.microbatches)
    out = []
    for k, st in enumerate(plan.stages):
        cm = cost_model(micro, group_topology(topology, st.devices))
        out.append(unreduced_sums(cm, plan.assignment[k], ctx.part.split,
                                  st.forward + st.backward))
    return out


def _over(colls, axes):
    return [c for c in colls if c.kind == "all-reduce" and set(c.axes) & set(axes)]


CASES = [
    # (model, config, topology, plan inside the stages, microbatches, schedule, chunks)
    ("gpt2", {}, REGIONAL, "dp_tp", 4, "1f1b", 1),        # tied embedding: a scatter-add
    ("gpt2", {"remat": True}, REGIONAL, "dp_tp", 2, "gpipe", 1),
    ("transformer-block-nnx", {}, REGIONAL, "dp_tp", 2, "1f1b", 1),
    ("mlp", {}, TWO, "dp", 4, "1f1b", 1),                  # pure data parallel stages
    ("cnn", {}, TWO, "dp", 2, "1f1b", 1),                  # a kernel's gradient: a convolution
    ("mlp", {"depth": 4}, REGIONAL, "dp_tp", 4, "interleaved", 2),
]


@pytest.mark.parametrize("case", CASES, ids=[
    f"{n}{''.join('+' + k for k in c)}-{p}-M{M}-{s}" for n, c, _, p, M, s, _ in CASES])
def test_gradients_are_reduced_once_per_step(case, compile_count):
    name, cfg, topology, inside, M, schedule, v = case
    m = zoo.get(name, size="tiny", optimizer="sgd", **cfg)
    state, batch = m.init(0)
    plan = _plan(m, state, batch, topology, inside, M, schedule, v)
    records = _records(plan, topology)
    assert all(st.unreduced for st in plan.stages), "every stage accumulates some unreduced"
    for st, rec in zip(plan.stages, records):
        assert st.unreduced == {x: r.axes for x, r in rec.items()}
    step = hj.emit(m.step, plan)
    ref = jax.jit(m.step)
    want_state, want_metrics = ref(state, batch)
    new_state, metrics = step(state, batch)
    compiles = compile_count()
    assert_trees_close(metrics, want_metrics)
    assert_trees_close(new_state, want_state)
    want_state2, want_metrics2 = ref(want_state, batch)
    state2, metrics2 = step(new_state, batch)
    assert compile_count() == compiles, "a second call recompiled"
    assert_trees_close(metrics2, want_metrics2)
    assert_trees_close(state2, want_state2)

    _check_reductions(step, plan, records)


def _check_reductions(step, plan, records):
    """No microbatch program reduces over a stage's batch axes, its reduction program once
    (XLA:CPU combines the stage's all-reduces), moving the bytes the cost model charges."""
    progs = step.program_collectives()
    for k, (st, rec) in enumerate(zip(plan.stages, records)):
        axes = {a for x in st.unreduced.values() for a in x}
        # Every sum over the batch there is left unreduced (these models have no other
        # reduction over the batch axes).
        for ph in ("F", "B"):
            assert not _over(progs.get(f"{ph}{k}", []), axes), (k, ph, progs.get(f"{ph}{k}"))
        red = _over(progs[f"R{k}"], axes)
        assert len(red) == 1 and len(progs[f"R{k}"]) == 1, progs[f"R{k}"]
        assert red[0].bytes == sum(r.reduction.bytes for r in rec.values())
        assert all(r.reduction.bytes == ACCUMULATOR_BYTES * math.prod(local_shape(
            plan.graph.values[x].shape, from_pspec(st.value_specs[x],
                                                   len(plan.graph.values[x].shape)),
            dict(zip(st.axis_names, st.mesh_shape)))) for x, r in rec.items())
    # In the step: once per stage, not once per microbatch.
    batch_axes = [{a for x in st.unreduced.values() for a in x} for st in plan.stages]
    per_step = [c for c in step.collectives() if any(
        a.split("/", 1)[1] in batch_axes[int(a[1:].split("/")[0])] for a in c.axes)]
    assert len(per_step) == len(plan.stages), [c.axes for c in per_step]


def test_third_party_gpt2_reduces_its_gradients_once_per_step():
    """transformers' Flax GPT-2 (tiny): its token embedding's gradient is a scatter-add at the
    batch's token ids, its position embedding's one at positions made in the step (no data);
    both, and every kernel's, are reduced once per step. adamw, with the family's
    tolerance."""
    from tests.realmodels import families

    if not families.available("gpt2"):
        pytest.skip("transformers is not installed")
    step_fn, state, batch = families.build("gpt2", "tiny")
    g = hj.trace(step_fn, state, batch)
    plan = hj.plan(step_fn, state, batch, topology=REGIONAL, strategy="pipeline",
                   microbatches=2, graph=g)
    records = _records(plan, REGIONAL)
    assert all(st.unreduced == {x: r.axes for x, r in rec.items()} and rec
               for st, rec in zip(plan.stages, records))
    step = hj.emit(step_fn, plan, donate=False)
    new_state, metrics = step(state, batch)
    want_state, want_metrics = jax.jit(step_fn)(state, batch)
    tol = families.FAMILIES["gpt2"].tolerance
    assert_trees_close(metrics, want_metrics, **tol)
    assert_trees_close(new_state, want_state, **tol)
    _check_reductions(step, plan, records)


def test_a_reduce_scattered_gradient_is_reduced_in_every_microbatch(compile_count):
    """A stage plan that splits a weight gradient over the batch axis (reduce-scattered, as
    ZeRO-3 lays it out) reduces it in every microbatch: an unreduced accumulator of the whole
    gradient on every device would undo the sharding. The other sums are left unreduced; the
    cost charges the reduce-scatters per microbatch; the step equals the unsharded one."""
    m = zoo.get("mlp", size="tiny", optimizer="sgd")
    state, batch = m.init(0)
    g = hj.trace(m.step, state, batch)
    ctx = _context(g, TWO)
    M, groups = 2, TWO.groups("node")
    split = ctx.part.split
    scattered = set()
    for devs in groups:  # dp, with every weight gradient's matmul reduce-scattered instead
        sub = group_topology(TWO, devs)
        cm = cost_model(ctx.micro(M), sub)
        a = list(ctx.assignments(M, sub, ("dp",))["dp"])
        for x, c in split.boundary.items():
            n = g.nodes[g.values[x].producer]
            if c.kind != "sum" or n.name != "dot_general":
                continue
            gid = cm.group_of_node[n.id]
            for j, r in enumerate(cm.groups[gid].candidates):
                if r.out_specs[0][0] == ("gpu",) and all(s[0] == ("gpu",) for s in r.in_specs):
                    a[gid] = j
                    scattered.add(x)
                    break
        ctx.plans[(M, sub, "dp-scattered")] = a
    layout = StagedLayout(groups=tuple(groups), ranges=tuple(uniform_ranges(ctx.part, 2)),
                          plans=("dp-scattered",) * 2, microbatches=M)
    plan = build_plan(ctx, layout, "pipeline")
    plan.graph, plan.topology, plan.in_tree, plan.out_tree = g, TWO, g.in_tree, g.out_tree
    assert len(scattered) == 3, "the MLP's three kernels"
    records = _records(plan, TWO)
    for st, rec in zip(plan.stages, records):
        assert st.unreduced and not scattered & set(st.unreduced)
        assert st.unreduced == {x: r.axes for x, r in rec.items()}
    step = hj.emit(m.step, plan, donate=False)
    new_state, metrics = step(state, batch)
    want_state, want_metrics = jax.jit(m.step)(state, batch)
    assert_trees_close(metrics, want_metrics)
    assert_trees_close(new_state, want_state)
    progs = step.program_collectives()
    for k, st in enumerate(plan.stages):
        # XLA:CPU makes a reduce-scatter an all-reduce and a slice (combined): one per kernel,
        # per microbatch; the rest once per step.
        mine = [x for x in scattered if x in st.value_specs and g.values[x].producer
                in st.backward]
        per_mb = _over(progs[f"B{k}"], ("gpu",))
        assert sum(len(c.shapes) for c in per_mb) == len(mine) > 0, per_mb
        assert all(c.scatter_emulated for c in per_mb)
        assert len(_over(progs[f"R{k}"], ("gpu",))) == 1
        # The cost's backward holds them: per microbatch, one stage's reduce-scatters.
        cm = cost_model(ctx.micro(M), group_topology(TWO, st.devices))
        nc = node_costs(cm, plan.assignment[k])
        kept = sum(cm.comm_time(c) for x in mine for c in nc.own[g.values[x].producer])
        assert kept > 0
        deferred = sum(cm.comm_time(c) for r in records[k].values() for i, c in
                       enumerate(nc.own[r.node]) if i in r.deferred)
        assert plan.cost.stages[k].reduction == pytest.approx(
            sum(cm.comm_time(r.reduction) for r in records[k].values()))
        assert deferred > 0


def test_unreduced_sums_round_trip_and_a_wrong_one_is_refused(tmp_path):
    m = zoo.get("mlp", size="tiny", optimizer="sgd")
    state, batch = m.init(0)
    plan = _plan(m, state, batch, TWO, "dp", 2)
    plan.save(tmp_path / "p.json")
    loaded = hj.Plan.load(tmp_path / "p.json")
    assert [st.unreduced for st in loaded.stages] == [st.unreduced for st in plan.stages]
    a = hj.emit(m.step, plan, donate=False)(state, batch)
    b = hj.emit(m.step, loaded, donate=False)(state, batch)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # A value the stage's programs do not make by a sum over examples (a parameter's id).
    d = plan.to_dict()
    d["stages"][0]["unreduced"].append([plan.graph.inputs[0], ["gpu"]])
    bad = hj.Plan.from_dict(d)
    with pytest.raises(hj.errors.InvalidPlanError, match="unreduced"):
        hj.emit(m.step, bad, donate=False)(state, batch)
    d = plan.to_dict()
    d["stages"][0]["unreduced"][0][1] = ["region"]
    with pytest.raises(hj.errors.InvalidPlanError, match="not axes of the stage's mesh"):
        hj.Plan.from_dict(d)
