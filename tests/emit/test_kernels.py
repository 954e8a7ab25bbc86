"""Pallas kernels in planned programs: each strategy splits a flash-attention LLaMA's kernel as
its rule allows, the emitter runs it per shard (XLA cannot split a custom call), the program
computes what the unsharded step computes, and the collectives it compiles to are the predicted
ones. The kernel is JAX's (``jax.experimental.pallas.ops.gpu.attention.mha``), interpreted on
CPU; the model is the zoo's ``llama`` with ``attention="flash"``."""

import warnings

import jax
import numpy as np
import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.emit.hlo import summarize
from hulkjax.errors import UnsupportedPrimitiveWarning
from hulkjax.strategies.realize import cost_model
from tests.helpers import SPMD_STRATEGIES, TWO_D_TOPOLOGY, assert_trees_close

SMALL = 64


@pytest.fixture(scope="module")
def flash():
    m = zoo.get("llama", size="tiny", attention="flash", seq_len=32, optimizer="sgd")
    state, batch = m.init(seed=0)
    graph = hj.trace(m.step, state, batch)
    return m, state, batch, graph, jax.jit(m.step)(state, batch)


def _plan(flash, strategy):
    m, state, batch, graph, _ = flash
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsupportedPrimitiveWarning)
        return hj.plan(m.step, state, batch, topology=TWO_D_TOPOLOGY, strategy=strategy,
                       graph=graph)


@pytest.mark.parametrize("strategy", [s for s in SPMD_STRATEGIES if s != "replicate"])
def test_every_strategy_computes_the_unsharded_step(flash, strategy):
    m, state, batch, _, want = flash
    plan = _plan(flash, strategy)
    assert_trees_close(hj.emit(m.step, plan)(state, batch), want, rtol=1e-4, atol=1e-5)


def _kernel_layouts(flash, plan):
    """The planned layout of each kernel's first operand (the queries), per kernel node."""
    _, _, _, graph, _ = flash
    specs = cost_model(graph, TWO_D_TOPOLOGY).value_specs(plan.assignment)
    return {n.kernel.name: specs.get(n.inputs[0]) for n in graph.nodes if n.kernel is not None}


@pytest.mark.parametrize("strategy, dims", [("dp", {0: ("data", "model")}),
                                            ("dp_tp", {0: ("data",), 2: ("model",)})])
def test_kernels_keep_the_batch_and_head_splits_and_compile_to_what_is_predicted(
        flash, strategy, dims):
    m, state, batch, graph, _ = flash
    plan = _plan(flash, strategy)
    layouts = _kernel_layouts(flash, plan)
    assert set(layouts) == {"mha_forward", "mha_preprocess_backward", "mha_backward"}
    for name, spec in layouts.items():  # q is (batch, seq, heads, head_dim)
        assert {d: tuple(ax) for d, ax in enumerate(spec) if ax} == dims, (name, spec)
    step = hj.emit(m.step, plan)
    step.compile(state, batch)
    compiled = {k: v["bytes"] for k, v in summarize(step.collectives()).items()
                if v["bytes"] > SMALL}
    predicted = {k: b for k, b in cost_model(graph, TWO_D_TOPOLOGY).program_collectives(
        plan.assignment, reduce_scatter=False).items() if b > SMALL}
    assert predicted == compiled
    if strategy == "dp":  # one combined gradient all-reduce: nothing gathers the kernels' operands
        assert list(compiled) == [("all-reduce", ("data", "model"))]


def test_flash_attention_llama_matches_softmax_attention():
    soft = zoo.get("llama", size="tiny", seq_len=32, optimizer="sgd")
    flash = zoo.get("llama", size="tiny", seq_len=32, optimizer="sgd", attention="flash")
    state, batch = soft.init(seed=0)
    (s1, m1), (s2, m2) = jax.jit(soft.step)(state, batch), jax.jit(flash.step)(state, batch)
    np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-5)
    assert_trees_close(s2, s1, rtol=1e-3, atol=1e-6)


def test_flash_attention_needs_whole_blocks():
    with pytest.raises(hj.HulkjaxError, match="multiple of it"):
        zoo.get("llama", size="tiny", seq_len=200, attention="flash")
    with pytest.raises(hj.HulkjaxError, match="attention='sparse'"):
        zoo.get("llama", size="tiny", attention="sparse")
