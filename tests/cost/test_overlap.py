"""Collectives overlapped with compute as XLA's latency-hiding scheduler does
(hulkjax/cost/overlap.py), checked against hand computations on small traced steps."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import hulkjax as hj
from hulkjax.cost.backends import BACKENDS
from hulkjax.cost.overlap import overlap
from hulkjax.strategies import cost_model
from tests.helpers import mlp_step

# 50 GB/s links: a 256 x 256 float32 gradient all-reduce (9.2 us) is shorter than one layer's
# backward (~20 us), an all-gather of a weight (11.6 us) a little longer than one layer's
# forward (9.7 us).
TOPO = hj.Topology.grid((8,), ("d",), bandwidth=(50e9,), latency=(1e-6,))
# XLA:GPU's scheduler (one collective in flight) without its combiners.
UNCOMBINED = dataclasses.replace(BACKENDS["gpu"], combine_threshold={})
REL = 1e-9


def _planned(strategy: str, depth: int = 4, topology=TOPO):
    step, ws, x = mlp_step(depth, 256, 512)
    plan = hj.plan(step, ws, x, topology=topology, strategy=strategy)
    return plan, cost_model(plan.graph, topology)


def _dots(graph):
    return [n.id for n in graph.nodes if n.primitive.name == "dot_general"]


def test_no_collectives_is_compute_time():
    plan, cm = _planned("replicate")
    o = overlap(cm, plan.assignment, "gpu")
    cost = cm.evaluate(plan.assignment)
    assert o.collectives == () and o.comm_time == 0.0
    assert o.step_time == pytest.approx(cost.compute_time, rel=REL)
    assert o.step_time == pytest.approx(o.compute_time, rel=REL)


def test_combined_gradient_all_reduce_is_exposed():
    """Under XLA:GPU's 30 MiB threshold the four gradient all-reduces combine into one, which
    reads every gradient and which every update reads: nothing is left to hide it under."""
    plan, cm = _planned("dp")
    o = overlap(cm, plan.assignment, "gpu")
    (ar,) = o.collectives
    assert (ar.kind, ar.count, ar.asynchronous) == ("all-reduce", 4, True)
    b = cm.breakdown(plan.assignment, memory=False)
    grads = [c for cms in b.own.values() for c in cms]
    assert ar.seconds == pytest.approx(sum(cm.comm_time(c) for c in grads), rel=REL)
    assert ar.hidden_seconds == pytest.approx(0.0, abs=1e-12)
    assert o.step_time == pytest.approx(o.compute_time + ar.seconds, rel=REL)
    assert o.step_time == pytest.approx(cm.evaluate(plan.assignment).step_time, rel=REL)


def test_uncombined_gradient_all_reduces_overlap_the_backward_of_earlier_layers():
    """Without combining, the last layer's gradient is reduced while earlier layers' backward
    runs; only the first layer's gradient (computed last) waits, under nothing but the updates
    of the other layers. Links of 0.1 us: each all-reduce pays its 14 latencies (9.2 + 1.4 us,
    shorter than a layer's backward; at 1 us, 23 us, it would not hide)."""
    plan, cm = _planned("dp", topology=hj.Topology.grid((8,), ("d",), bandwidth=(50e9,),
                                                         latency=(1e-7,)))
    combined = overlap(cm, plan.assignment, "gpu")
    o = overlap(cm, plan.assignment, UNCOMBINED)
    ars = sorted(o.collectives, key=lambda c: c.start)
    assert [c.kind for c in ars] == ["all-reduce"] * 4 and all(c.count == 1 for c in ars)
    assert all(c.hidden for c in ars[:3])  # layers 4, 3, 2
    last = ars[-1]
    assert not last.hidden
    # The step ends with the first layer's reduction and its update: compute + what of it the
    # other layers' updates do not cover.
    assert o.exposed_comm_time == pytest.approx(last.exposed_seconds, rel=1e-6)
    assert o.step_time == pytest.approx(o.compute_time + last.exposed_seconds, rel=REL)
    # Hand computation: it starts once the backward pass is done (every operator up to the
    # first layer's weight gradient, the last matmul), and the step ends when it and the
    # first layer's update (what reads it: the only operators left) are done.
    b = cm.breakdown(plan.assignment, memory=False)
    dw1 = max(n for n, cms in b.own.items() if cms)
    assert last.start >= sum(b.compute[:dw1 + 1]) * (1 - REL)
    prog = cm.combined_program(plan.assignment, UNCOMBINED)
    (j,) = [k for k, c in enumerate(prog.collectives) if dw1 in
            {prog.entries[i].source for i in c.members}]
    after, todo = set(), [prog.nodes + j]
    while todo:  # the update of the first layer: everything that reads the reduction
        x = todo.pop()
        for y, ops in enumerate(prog.operands[:prog.nodes]):
            if x in ops and y not in after:
                after.add(y)
                todo.append(y)
    update = sum(b.compute[y] for y in after)
    assert update > 0
    assert o.step_time == pytest.approx(last.start + last.seconds + update, rel=1e-9)
    assert o.step_time < combined.step_time
    assert o.hidden_comm_time == pytest.approx(o.comm_time - last.exposed_seconds, rel=1e-6)


def test_fsdp_gathers_the_next_layer_during_this_one_but_not_the_first():
    """FSDP, one collective in flight: the four weight all-gathers (ready at the start: they
    read only parameters) run back to back from t = 0. Layer 1 waits for the first whole; layer
    k's gather runs while layer k-1 computes, so its hidden seconds are layer k-1's compute
    (a gather, 11.6 us, outlasts a layer's forward, 9.7 us)."""
    plan, cm = _planned("fsdp")
    o = overlap(cm, plan.assignment, UNCOMBINED)
    gathers = sorted((c for c in o.collectives if c.kind == "all-gather"), key=lambda c: c.start)
    assert len(gathers) == 4  # the backward re-uses each forward gather (XLA's CSE)
    a = gathers[0].seconds
    assert [g.start for g in gathers] == pytest.approx([0.0, a, 2 * a, 3 * a], rel=1e-9)
    assert gathers[0].hidden_seconds < 1e-6 * a  # nothing before the first layer
    b = cm.breakdown(plan.assignment, memory=False)
    dots = _dots(plan.graph)[:4]  # the forward matmuls, in order
    for k in range(1, 4):
        # Layer k's forward: its matmul and tanh. The `1 - tanh` it also computes is read only
        # by the backward, in whose kernel XLA fuses it: it runs there, not here.
        layer = sum(b.compute[i] for i in range(dots[k - 1], dots[k])
                    if plan.graph.nodes[i].primitive.name != "sub")
        assert layer < a
        assert gathers[k].hidden_seconds == pytest.approx(layer, rel=1e-6)
    # Combined (XLA:GPU's default 30 MiB), the four gathers are one that layer 1 waits for.
    (ag,) = [c for c in overlap(cm, plan.assignment, "gpu").collectives if c.kind == "all-gather"]
    assert ag.count == 4 and ag.hidden_seconds < 1e-6 * ag.seconds


def test_a_tensor_parallel_all_reduce_is_not_hidden_under_what_its_reader_fuses():
    """Megatron's forward all-reduce is read by `out * mask`, the mask an iota and a comparison
    that nothing else reads. XLA fuses them into the multiply, which waits for the all-reduce:
    nothing runs during it (XLA:GPU schedules such all-reduces synchronously,
    benchmarks/GPU_SHARDED.md). Scheduled as kernels of their own, the mask's operators ran
    while the all-reduce was in flight and hid part of it."""
    def step(ws, x):
        def loss(ws):
            w1, w2 = ws
            out = jnp.tanh(x @ w1) @ w2
            keep = jax.lax.broadcasted_iota(jnp.int32, out.shape, 1) < 192
            return jnp.mean((out * keep) ** 2)

        return [w - 0.1 * g for w, g in zip(ws, jax.grad(loss)(ws))]

    ws, x = [jnp.full((256, 256), 0.01)] * 2, jnp.ones((512, 256))
    plan = hj.plan(step, ws, x, topology=TOPO, strategy="megatron")
    cm = cost_model(plan.graph, TOPO)
    o = overlap(cm, plan.assignment, UNCOMBINED)
    forward = min((c for c in o.collectives if c.kind == "all-reduce"), key=lambda c: c.start)
    assert forward.bytes == 512 * 256 * 4  # the row-parallel matmul's partial sums
    assert forward.hidden_seconds < 1e-6 * forward.seconds
    assert o.compute_time == pytest.approx(cm.evaluate(plan.assignment).compute_time, rel=REL)


@pytest.mark.parametrize("strategy", ["dp", "fsdp", "megatron"])
@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu", UNCOMBINED])
def test_bounds(strategy, backend):
    """max(compute, comm) <= overlapped <= additive; step = compute + exposed; per collective
    exposed seconds add up to the exposed time (one resource at a time on GPU)."""
    plan, cm = _planned(strategy)
    cost = cm.evaluate(plan.assignment)
    o = overlap(cm, plan.assignment, backend)
    assert o.compute_time == pytest.approx(cost.compute_time, rel=REL)
    assert max(o.compute_time, o.comm_time) <= o.step_time * (1 + REL)
    assert o.step_time <= cost.step_time * (1 + REL)
    assert o.additive_time == pytest.approx(cost.step_time, rel=REL)
    assert o.comm_time <= cost.comm_time * (1 + REL)
    assert o.reused_comm_time + o.reassociated_comm_time == pytest.approx(
        cost.comm_time - o.comm_time, abs=1e-12)
    assert o.step_time == pytest.approx(o.compute_time + o.exposed_comm_time, rel=REL)
    assert o.hidden_comm_time == pytest.approx(o.comm_time - o.exposed_comm_time, abs=1e-12)
    if backend == "cpu":  # XLA:CPU: synchronous collectives, nothing hidden
        assert o.hidden_comm_time == pytest.approx(0.0, abs=1e-12)
        assert not any(c.asynchronous for c in o.collectives)
    else:
        assert sum(c.exposed_seconds for c in o.collectives) == pytest.approx(
            o.exposed_comm_time, rel=1e-6, abs=1e-12)


def test_combined_program_groups_match_program_summary():
    plan, cm = _planned("fsdp")
    for be in ("cpu", "gpu", UNCOMBINED):
        prog = cm.combined_program(plan.assignment, be)
        members = sorted(i for c in prog.collectives for i in c.members)
        assert members == list(range(len(prog.entries)))  # each collective in one group
        summary: dict = {}
        for c in prog.collectives:
            e = summary.setdefault((c.kind, c.axes), {"count": 0, "bytes": 0})
            e["count"] += 1
            e["bytes"] += c.bytes
        assert summary == cm.program_summary(plan.assignment, be)
        n = prog.nodes
        for j, c in enumerate(prog.collectives):  # a combined one reads its members' operands
            for i in c.members:
                e = prog.entries[i]
                src = n + next(k for k, d in enumerate(prog.collectives) if e.after in d.members) \
                    if e.after >= 0 else e.source
                assert e.source < 0 and e.after < 0 or src in prog.operands[n + j]


def test_loop_bodies_are_scheduled_per_iteration():
    """A scanned MLP under FSDP: the body's gather and gradient reduce-scatter run trip_count
    times; the forward body's gather is the first thing its iteration needs (exposed), the
    backward body's overlaps the body's compute."""
    def step(ws, x):
        def loss(ws):
            h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
            return jnp.mean(h ** 2)

        return ws - 0.1 * jax.grad(loss)(ws)

    ws, x = jnp.ones((4, 256, 256)), jnp.ones((512, 256))
    plan = hj.plan(step, ws, x, topology=TOPO, strategy="fsdp")
    cm = cost_model(plan.graph, TOPO)
    cost = cm.evaluate(plan.assignment)
    o = overlap(cm, plan.assignment, "gpu")
    assert o.compute_time == pytest.approx(cost.compute_time, rel=REL)
    assert max(o.compute_time, o.comm_time) <= o.step_time <= cost.step_time * (1 + REL)
    inner = [c for c in o.collectives if c.loop is not None]
    assert inner and all(c.trips == 4 for c in inner)
    assert {c.loop for c in inner} <= {n.id for n in plan.graph.nodes if n.subgraphs}
    gathers = sorted((c for c in inner if c.kind == "all-gather"), key=lambda c: c.hidden_seconds)
    assert gathers[0].hidden_seconds == 0.0  # forward: its iteration starts with the gather
    assert gathers[-1].hidden_seconds > 0.5 * gathers[-1].seconds  # backward
    assert o.step_time < cost.step_time
    # CPU: synchronous, so the overlapped step is the compiled program's sum.
    cpu = overlap(cm, plan.assignment, "cpu")
    assert cpu.step_time == pytest.approx(cpu.compute_time + cpu.comm_time, rel=REL)


def test_cost_model_method_delegates():
    plan, cm = _planned("dp")
    assert cm.overlapped(plan.assignment, UNCOMBINED) == overlap(cm, plan.assignment, UNCOMBINED)
    assert cm.overlapped(plan.assignment).backend == "cpu"  # the topology's backend by default
