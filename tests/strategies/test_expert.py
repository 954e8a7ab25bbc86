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
