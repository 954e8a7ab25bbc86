"""The ``expert`` baseline: the public recipes' layouts (FSDP across nodes, Megatron inside one)."""

import jax
import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.strategies.baselines import recipe_axes
from tests.helpers import assert_steps_match, first_steps

# 8 fake devices as two DGX-like nodes of 4 GPUs: 'node' crosses nodes, 'gpu' stays inside one.
DGX = hj.Topology.preset("dgx-h100", nodes=2, gpus_per_node=4)


@pytest.mark.parametrize("topology, expected", [
    (hj.Topology.preset("dgx-h100", nodes=4), (("node",), ("gpu",))),
    (hj.Topology.preset("dgx-h100", nodes=1), (("gpu",), ())),
    (hj.Topology.grid((8,), ("d",)), (("d",), ())),
    (hj.Topology.grid((2, 4), ("data", "model"), bandwidth=(25e9, 450e9)), (("data",), ("model",))),
    (hj.Topology.grid((4, 2), ("a", "b"), bandwidth=(450e9, 25e9)), (("b",), ("a",))),
    (hj.Topology.grid((2, 4), ("a", "b"), bandwidth=100e9), (("a", "b"), ())),
    (hj.Topology.preset("tpu-v5e", shape=(4, 4)), (("x", "y"), ())),
], ids=["dgx4", "dgx1", "1d", "2d-slow-fast", "2d-fast-slow", "2d-alike", "tpu"])
def test_recipe_axes(topology, expected):
    """Tensor parallel where the axis stays inside a node (or is strictly the fastest); FSDP on
    the rest, and everywhere when the axes are alike (MaxText's TPU recipes)."""
    assert recipe_axes(topology) == expected


def test_llama_layouts_are_fsdp_across_nodes_and_megatron_inside():
    m = zoo.get("llama", size="tiny")
    plan = hj.plan(m.step, *m.abstract(), topology=DGX, strategy="expert")
    specs = {t.path.split("params/", 1)[-1]: (t.shape, tuple(t.spec)) for t in plan.inputs
             if t.role in ("parameter", "data")}
    # Column-parallel projections: output features (heads) over 'gpu', input features over 'node'.
    for proj in ("query", "gate", "up"):
        shape, spec = specs[f"layer_0/{proj}/kernel"]
        assert spec[0] == "node" and spec[1] == "gpu", (proj, spec)
    # Row-parallel projections: their input features over 'gpu', their output over 'node'.
    assert specs["layer_0/down/kernel"][1] == ("gpu", "node")
    assert specs["layer_0/out/kernel"][1] == ("gpu", None, "node")
    # Two key/value heads do not divide four GPUs: grouped-query K/V stay whole on 'gpu'.
    assert "gpu" not in specs["layer_0/key/kernel"][1]
    # The batch is split across nodes only: a tensor-parallel group sees the same examples.
    assert specs["batch/tokens"][1] == ("node",)
    assert any("tensor parallel over ('gpu',)" in n for n in plan.notes)


def test_without_column_row_pairs_or_distinct_axes_it_is_fsdp():
    """A topology whose axes are alike gives FSDP over every axis: the fsdp baseline's layouts."""
    m = zoo.get("transformer-block", size="tiny")
    state, batch = m.abstract()
    g = hj.trace(m.step, state, batch)
    topo = hj.Topology.grid((8,), ("d",))
    e = hj.plan(m.step, state, batch, topology=topo, strategy="expert", graph=g)
    f = hj.plan(m.step, state, batch, topology=topo, strategy="fsdp", graph=g)
    assert [t.spec for t in e.inputs] == [t.spec for t in f.inputs]
    assert e.cost.step_time == pytest.approx(f.cost.step_time, rel=1e-12)


@pytest.mark.parametrize("model", ["llama", "transformer-block", "bert", "moe"])
def test_expert_steps_match_unsharded_on_two_nodes(model, compile_count):
    """FSDP over 'node' and tensor parallelism over 'gpu' compute the serial step (within adamw's
    first-step tolerance, ``atol=1e-4``: it divides by the root of tiny second moments, which
    amplifies summation-order noise; see tests/robustness/test_random_equivalence.py)."""
    m = zoo.get(model, size="tiny")
    assert m.config.optimizer == "adamw"
    state, batch = m.init(0)
    refs = first_steps(jax.jit(m.step), state, batch, 2)
    step = hj.hulk_shard(m.step, topology=DGX, strategy="expert")
    assert_steps_match(step, state, batch, refs, compile_count, rtol=1e-4, atol=1e-4)
    specs = [tuple(t.spec) for t in step.plan.inputs if t.role == "parameter"]
    assert any("node" in s and "gpu" in s for s in specs)  # 2-D layouts were really emitted
    # ... with the tensor-parallel sums reduce-scattered onto the sequence
    assert any(n.startswith("sequence parallel over") for n in step.plan.notes), step.plan.notes


def test_auto_is_predicted_no_slower_than_expert_on_dgx_nodes():
    """On two DGX-H100 nodes (16 GPUs), ``auto`` finds its plan by search (not by taking the
    expert seed) and the cost model predicts it no slower than the recipe's layout."""
    m = zoo.get("llama", size="small")
    state, batch = m.abstract()
    g = hj.trace(m.step, state, batch)
    topo = hj.Topology.preset("dgx-h100", nodes=2)
    expert = hj.plan(m.step, state, batch, topology=topo, strategy="expert", graph=g)
    auto = hj.plan(m.step, state, batch, topology=topo, strategy="auto", graph=g)
    assert auto.cost.fits
    assert auto.cost.step_time <= expert.cost.step_time * (1 + 1e-9)
    assert auto.source != "expert"


def _expert_without_sequence_parallelism(g, topo):
    from hulkjax.strategies.baselines import expert_layouts

    sb = expert_layouts(g, topo)
    assert sb.sequence_axes == ("gpu",)
    sb.sequence_axes = ()
    return sb.build()


def test_sequence_parallelism_reduce_scatters_every_tensor_parallel_sum_onto_the_sequence():
    """Megatron's sequence parallelism (the recipes' ``sequence_parallel`` with tensor
    parallelism): no all-reduce over 'gpu' of a (batch, sequence, features) sum is left; each is
    a reduce-scatter onto the sequence, and the residual stream between them (the embedding
    lookup's group, which the residual adds and norms follow) is split on the sequence too. The
    same bytes cross 'gpu', the norms' activations are divided by the group: less memory."""
    from hulkjax.cost.model import LEADER
    from hulkjax.strategies.realize import cost_model

    m = zoo.get("llama", size="small")
    state, batch = m.abstract()
    g = hj.trace(m.step, state, batch)
    topo = hj.Topology.preset("dgx-h100", nodes=2)
    plan = hj.plan(m.step, state, batch, topology=topo, strategy="expert", graph=g)
    plain = _expert_without_sequence_parallelism(g, topo)
    cm = cost_model(g, topo)

    def sums(assignment):
        out = {"all-reduce": [], "reduce-scatter": []}
        for grp in cm.groups:
            if grp.kind != LEADER:
                continue
            r = grp.candidates[assignment[grp.id]]
            shape = g.values[g.nodes[grp.leader].outputs[0]].shape
            if len(r.comms) == 1 and r.comms[0].axes == ("gpu",) and len(shape) == 3:
                out.setdefault(r.comms[0].kind, []).append((grp.id, r.out_specs[0]))
        return out

    before, after = sums(plain.assignment), sums(plan.assignment)
    assert before["all-reduce"] and not before["reduce-scatter"]
    assert not after["all-reduce"]
    assert {gid for gid, _ in after["reduce-scatter"]} == {gid for gid, _ in before["all-reduce"]}
    assert all(spec == (("node",), ("gpu",), ()) for _, spec in after["reduce-scatter"])
    n = len(after["reduce-scatter"])
    assert any(f"sequence parallel over ('gpu',): {n} tensor-parallel sum(s)" in note
               for note in plan.notes)
    # The token embedding's lookup (a gather of (batch, sequence, features) rows from a
    # (vocabulary, features) table) is split on the sequence: the residual stream starts split.
    lookups = [grp for grp in cm.groups if grp.kind == LEADER
               and g.nodes[grp.leader].primitive.name == "gather"
               and len(g.values[g.nodes[grp.leader].inputs[0]].shape) == 2
               and len(g.values[g.nodes[grp.leader].outputs[0]].shape) == 3]
    assert lookups and all(
        grp.candidates[plan.assignment[grp.id]].out_specs[0][1] == ("gpu",) for grp in lookups)
    # Parameters keep the recipe's layouts; memory goes down, the step is no slower.
    assert [t.spec for t in plan.inputs] == [t.spec for t in plain.inputs]
    assert plan.cost.peak_memory < plain.cost.peak_memory
    assert plan.cost.step_time <= plain.cost.step_time * (1 + 1e-9)


def test_sequence_parallelism_needs_a_tensor_parallel_axis():
    """Where the recipe has no tensor parallelism (axes alike), there is none to extend."""
    from hulkjax.strategies.baselines import expert_layouts

    m = zoo.get("llama", size="tiny")
    g = hj.trace(m.step, *m.abstract())
    sb = expert_layouts(g, hj.Topology.grid((8,), ("d",)))
    assert sb.sequence_axes == ()
    assert not any("sequence" in n for n in sb.build().notes)
