"""The compiled HLO shows what each strategy means."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import hulkjax as hj
from hulkjax import zoo
from hulkjax.trace import PARAMETER

ONE_D = hj.Topology.grid((8,), ("data",))
ONE_D_MODEL = hj.Topology.grid((8,), ("model",))
TWO_D = hj.Topology.grid((2, 4), ("data", "model"), bandwidth=(25e9, 450e9), latency=(5e-6, 1e-6))
MODELS = ["mlp", "transformer-block"]
METRIC_BYTES = 64  # scalar metrics (the loss) may ride along with a gradient all-reduce


def _compiled(name, topology, strategy):
    m = zoo.get(name, size="tiny")
    state, batch = m.abstract()
    plan = hj.plan(m.step, state, batch, topology=topology, strategy=strategy)
    step = hj.emit(m.step, plan)
    step.compile(state, batch)
    return m, state, batch, plan, step.collectives()


def _param_leaves(plan):
    return [t for t in plan.inputs if t.role == PARAMETER]


def _nbytes(t):
    return int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize


def _local_nbytes(t, sizes):
    n = _nbytes(t)
    for entry in t.spec:
        for a in (entry if isinstance(entry, tuple) else (entry,) if entry else ()):
            n //= sizes[a]
    return n


@pytest.mark.parametrize("name", MODELS)
def test_dp_all_reduces_gradients_over_all_devices_and_nothing_else(name):
    m, state, batch, plan, colls = _compiled(name, ONE_D, "dp")
    assert colls, "data parallelism must reduce gradients"
    assert {c.kind for c in colls} == {"all-reduce"}
    assert {c.axes for c in colls} == {("data",)}
    grad_bytes = sum(_nbytes(t) for t in _param_leaves(plan))
    total = sum(c.bytes for c in colls)
    assert grad_bytes <= total <= grad_bytes + METRIC_BYTES
    # No activation collectives: every reduced tensor has a parameter's shape, up to the layout
    # XLA picks (it may reduce a kernel's gradient transposed), or is a metric.
    param_shapes = {tuple(sorted(t.shape)) for t in _param_leaves(plan)}
    assert all(tuple(sorted(s)) in param_shapes or s == () for c in colls for s in c.shapes)


@pytest.mark.parametrize("name", MODELS)
def test_fsdp_all_gathers_parameters(name):
    m, state, batch, plan, colls = _compiled(name, ONE_D, "fsdp")
    gathers = [c for c in colls if c.kind == "all-gather"]
    sharded = [t for t in _param_leaves(plan) if t.spec != P()]
    assert len(sharded) == len(_param_leaves(plan)), "every parameter divides 8 ways here"
    # Each sharded parameter is gathered whole (bytes of the full parameter) before use.
    gathered = sorted(c.bytes for c in gathers)
    for t in sharded:
        assert _nbytes(t) in gathered, (t.path, _nbytes(t), gathered)
    assert all(c.axes == ("data",) for c in gathers)
    # Parameters and their optimizer state live sharded: the state leaves match.
    for t in plan.inputs:
        if t.role == "optimizer" and len(t.shape) >= 1 and t.shape[0] >= 8:
            assert t.spec != P(), t.path


@pytest.mark.parametrize("name", MODELS)
def test_megatron_all_reduces_activations_on_the_model_axis_only(name):
    m, state, batch, plan, colls = _compiled(name, ONE_D_MODEL, "megatron")
    batch_size = m.config.batch
    assert colls and {c.kind for c in colls} == {"all-reduce"}
    assert {c.axes for c in colls} == {("model",)}
    # Activations, not gradients: every reduced tensor leads with the batch dimension.
    for c in colls:
        for s in c.shapes:
            assert s == () or s[0] == batch_size, (c, s)
    # Parameters are split column/row, not replicated.
    assert any(t.spec != P() for t in _param_leaves(plan))


@pytest.mark.parametrize("name", MODELS)
def test_dp_tp_splits_the_batch_on_the_expensive_axis_and_tensors_on_the_cheap_one(name):
    m, state, batch, plan, colls = _compiled(name, TWO_D, "dp_tp")
    sizes = dict(zip(TWO_D.axis_names, TWO_D.shape))
    model_axis = [c for c in colls if c.axes == ("model",)]
    data_axis = [c for c in colls if c.axes == ("data",)]
    assert model_axis and data_axis
    assert len(model_axis) + len(data_axis) == len(colls)
    local_batch = m.config.batch // sizes["data"]
    for c in model_axis:  # activations of the local batch
        assert all(s == () or s[0] == local_batch for s in c.shapes), c
    grad_bytes = sum(_local_nbytes(t, sizes) for t in _param_leaves(plan))
    total = sum(c.bytes for c in data_axis)
    assert grad_bytes <= total <= grad_bytes + METRIC_BYTES
    for t in plan.inputs:
        if t.role == "data":
            assert t.spec == P("data"), (t.path, t.spec)


def test_megatron_finds_attention_heads_and_mlp_pairs_from_the_graph():
    m = zoo.get("transformer-block", size="tiny")  # 4 heads: split 4 ways on 'model'
    state, batch = m.abstract()
    g = hj.trace(m.step, state, batch)
    plan = hj.plan(m.step, state, batch, topology=TWO_D, strategy="dp_tp", graph=g)
    split, head = {}, {}
    for t in _param_leaves(plan):
        dims = [i for i, e in enumerate(t.spec) if e is not None]
        if "/head/" in t.path:
            head[t.path.rsplit("/", 1)[-1]] = tuple(dims)
            continue
        split[t.shape] = split.get(t.shape, set()) | {tuple(dims)}
    d, h, dh, f = 32, 4, 8, 128
    assert split[(d, h, dh)] == {(1,)}  # q/k/v kernels: column on heads
    assert split[(h, dh, d)] == {(0,)}  # output projection: row on heads
    assert split[(d, f)] == {(1,)}  # MLP up: column
    assert split[(f, d)] == {(0,)}  # MLP down: row
    assert split[(d,)] == {()}  # LayerNorm parameters and row biases stay replicated
    # The last projection (32 -> 32), which only the loss's reductions would complete, is no
    # vocabulary: splitting it would add all-reduces for no memory worth saving. Replicated, and
    # the plan says why.
    assert head == {"kernel": (), "bias": ()}
    assert any("head/kernel" in n and "no wider than its input" in n for n in plan.notes)


def test_gpt2_small_megatron_keeps_heads_whole_when_they_do_not_divide():
    m = zoo.get("gpt2", size="small")  # 12 heads over 8 devices: attention stays replicated
    state, batch = m.abstract()
    plan = hj.plan(m.step, state, batch, topology=ONE_D_MODEL, strategy="megatron")
    by_shape = {}
    for t in _param_leaves(plan):
        by_shape.setdefault(t.shape, set()).add(t.spec)
    assert by_shape[(768, 3072)] == {P(None, "model")}
    assert by_shape[(3072, 768)] == {P("model")}
    assert by_shape[(768, 12, 64)] == {P()}
    assert jax.tree.structure(plan.in_specs) == jax.tree.structure(
        jax.tree.map(lambda _: P(), (state, batch)))
