"""Sharded loop bodies: GPT-2 with its blocks in one ``scan`` (stacked parameters) computes what the
unsharded step computes under every planner, and the ILP shards the stack as it shards unrolled
blocks.

sgd keeps the comparison tight (see tests/robustness/test_random_equivalence.py: adam's first step
divides near-zero gradients by their own size, so a different summation order shows at 1e-4).
"""

import jax
import jax.numpy as jnp
import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.cost.model import LEADER
from hulkjax.strategies.realize import cost_model
from tests.helpers import TWO_D_TOPOLOGY, assert_steps_match, assert_trees_close, first_steps

STRATEGIES = ["dp", "fsdp", "megatron", "ilp", "auto"]
STEPS = 2


@pytest.fixture(scope="module", params=[False, True], ids=["scan", "scan+remat"])
def scanned_gpt2(request):
    m = zoo.get("gpt2", size="tiny", scan_layers=True, remat=request.param, optimizer="sgd")
    state, batch = m.init(0)
    return m, state, batch, first_steps(jax.jit(m.step), state, batch, STEPS)


def _loop_labels(plan):
    cm = cost_model(plan.graph, plan.topology)
    return [cm.groups[gid].candidates[c].label for gid, c in enumerate(plan.assignment)
            if cm.groups[gid].kind == LEADER and plan.graph.nodes[cm.groups[gid].leader].subgraphs]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_scanned_gpt2_matches_unsharded(scanned_gpt2, strategy, compile_count):
    m, state, batch, refs = scanned_gpt2
    step = hj.hulk_shard(m.step, topology=TWO_D_TOPOLOGY, strategy=strategy)
    assert_steps_match(step, state, batch, refs, compile_count)
    assert set(step.plan.bodies) == {n.id for n in step.plan.graph.nodes if n.subgraphs}
    if strategy in ("dp", "fsdp"):  # the blocks are really split, not replicated
        assert all(label != "replicated" for label in _loop_labels(step.plan))


def test_while_and_cond_bodies_are_emitted_with_their_layouts():
    topo = hj.Topology.grid((8,), ("d",), bandwidth=1e12, latency=1e-7)

    def step(w, x, n):
        def body(s):
            i, c = s
            c = jax.lax.cond(i % 2 == 0, lambda a: jnp.tanh(a @ w), lambda a: a * 0.5, c)
            return i + 1, c
        y = jax.lax.while_loop(lambda s: s[0] < n, body, (jnp.int32(0), x))[1]
        return w, (y ** 2).sum()

    w = jax.random.normal(jax.random.key(0), (64, 64)) / 8
    x = jax.random.normal(jax.random.key(1), (64, 64))
    n = jnp.int32(3)
    want = jax.jit(step)(w, x, n)
    plan = hj.plan(step, w, x, n, topology=topo, strategy="dp")
    assert _loop_labels(plan) == ["batch:d"]
    [(wid, (cond_plan, body_plan))] = plan.bodies.items()
    assert body_plan.bodies  # the cond nested in the while body has layouts of its own
    got = hj.emit(step, plan, donate=False)(w, x, n)
    assert_trees_close(got, want)


def _ilp_and_replicated(scan: bool, topo):
    m = zoo.get("gpt2", size="tiny", scan_layers=scan, optimizer="sgd")
    state, batch = m.abstract()
    g = hj.trace(m.step, state, batch)
    ilp = hj.plan(m.step, state, batch, topology=topo, strategy="ilp", graph=g)
    rep = hj.plan(m.step, state, batch, topology=topo, strategy="replicate", graph=g)
    return ilp, rep.cost.step_time


def test_ilp_shards_the_scanned_stack_like_unrolled_blocks():
    """On a data-parallel-friendly topology (links whose collectives cost only their bytes,
    1 TB/s) the ILP splits the scanned blocks, and relative to its own replicated step the
    scanned plan gains as much as the unrolled one (measured: 0.131 of the replicated step for
    both, 30.7 against 23.7 us).

    The plans' step times differ by what the programs differ in: the scanned one writes the
    stacked residuals (``ys``) to memory and reads them back in the backward scan, which the
    model's fusion of the unrolled program does not pay (GPT-2 tiny is memory-bound: the
    replicated scanned step is 29% slower). Links with latency are no longer data-parallel
    friendly on the CPU: XLA:CPU runs the combined gradient all-reduce one call per gradient
    (:mod:`hulkjax.cost.backends`), about 40 latencies for GPT-2 tiny, and the ILP then takes
    tensor-parallel bodies.
    """
    topo = hj.Topology.grid((8,), ("d",), bandwidth=1e12, latency=0.0)
    scan_ilp, scan_rep = _ilp_and_replicated(True, topo)
    flat_ilp, flat_rep = _ilp_and_replicated(False, topo)
    assert _loop_labels(scan_ilp) and all(label.startswith("batch:")
                                          for label in _loop_labels(scan_ilp))
    assert scan_ilp.cost.step_time / scan_rep <= 1.02 * flat_ilp.cost.step_time / flat_rep


def test_scanned_gpt2_plans_close_to_the_unrolled_one_on_the_2d_grid():
    """The forward and backward scans are planned as a pair (the backward scan has a candidate
    mirroring each forward one, ``+search`` bodies included), so the ILP can take a searched or
    tensor-parallel body without resharding the residuals between the scans. GPT-2 tiny (adam)
    on the 2 x 4 grid: 186.8 us against 151.3 us unrolled (+23%). It was 92.7 against 84.8 us
    (+9%; 106.7 us, +26%, when each scan's candidates were built alone) while the model charged
    XLA:CPU's combined gradient all-reduces no latency; it charges one per operand now, as
    XLA:CPU runs them (:mod:`hulkjax.cost.backends`), and the tensor-parallel body's gradient
    partial sums cost 73 us of all-reduces over "model" where the unrolled plan, which keeps the
    small operators replicated layer by layer, pays 24 us. Part of
    the rest is the scanned program's own work: it writes the stacked residuals and reads them
    back (the replicated scanned step is 28% slower). What the pairing of the scans guarantees
    is checked exactly below: no residual changes layout between them.
    """
    plans = {}
    for scan in (False, True):
        m = zoo.get("gpt2", size="tiny", scan_layers=scan)
        state, batch = m.abstract()
        plans[scan] = hj.plan(m.step, state, batch, topology=TWO_D_TOPOLOGY, strategy="ilp")
    plan = plans[True]
    assert plan.cost.step_time <= 1.25 * plans[False].cost.step_time
    g = plan.graph
    cm = cost_model(g, plan.topology)
    fwd, bwd = [n for n in g.nodes if n.subgraphs]
    residuals = {v for v in fwd.outputs if v in bwd.inputs}
    moves = [mv for mv in cm.breakdown(plan.assignment, memory=False).moves
             if mv.value in residuals]
    assert not moves, moves
