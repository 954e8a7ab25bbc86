"""The cost model in closed form: collectives, resharding, compute, memory, and plan costs."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.cost import Cost, CostModel, collective_time, reshard_comms
from hulkjax.plan import Comm

SLOW, FAST = 1e9, 4e9
TOPO = hj.Topology.grid((2, 4), ("slow", "fast"), bandwidth=(SLOW, FAST), latency=(1e-5, 1e-6))


def test_ring_collectives_on_one_axis():
    t = hj.Topology.grid((4,), ("x",), bandwidth=2e9, latency=1e-6)
    b = 8e6
    assert collective_time("all-reduce", b, ("x",), t)["x"] == pytest.approx(2 * 3 / 4 * b / 2e9 + 2 * 3 * 1e-6)
    assert collective_time("all-gather", b, ("x",), t)["x"] == pytest.approx(3 / 4 * b / 2e9 + 3 * 1e-6)
    assert collective_time("reduce-scatter", b, ("x",), t)["x"] == pytest.approx(3 / 4 * b / 2e9 + 3e-6)
    assert collective_time("all-to-all", b, ("x",), t)["x"] == pytest.approx(3 / 4 * b / 2e9 + 3e-6)


def test_all_reduce_over_two_axes_is_hierarchical():
    b = 8e6
    t = collective_time("all-reduce", b, ("slow", "fast"), TOPO)
    # reduce-scatter + all-gather on the fast axis over all the data, all-reduce on the slow axis
    # over the quarter each device holds after the reduce-scatter.
    assert t["fast"] == pytest.approx(2 * (3 / 4 * b / FAST + 3 * 1e-6))
    assert t["slow"] == pytest.approx(2 * (1 / 2 * (b / 4) / SLOW + 1 * 1e-5))


def test_resharding_is_gather_all_to_all_or_free():
    shape, sizes = (8, 16), {"x": 4}
    assert reshard_comms(shape, "float32", (("x",), ()), ((), ()), sizes) == (
        Comm("all-gather", ("x",), 8 * 16 * 4),)
    assert reshard_comms(shape, "float32", (("x",), ()), ((), ("x",)), sizes) == (
        Comm("all-to-all", ("x",), 2 * 16 * 4),)
    assert reshard_comms(shape, "float32", ((), ()), ((), ("x",)), sizes) == ()  # a local slice


def test_data_parallel_matmul_costs_compute_only():
    topo = hj.Topology.grid((8,), ("d",), bandwidth=1e10, latency=1e-6)
    f = lambda w, x: (w, x @ w)  # noqa: E731  (w is carried: state, used by a matmul: a parameter)
    w, x = jnp.ones((64, 64)), jnp.ones((128, 64))
    plan = hj.plan(f, w, x, topology=topo, strategy="dp")
    dev = topo.slowest_device()
    flops = 2 * 128 * 64 * 64
    traffic = 4 * (64 * 64 + 128 * 64 + 128 * 64)
    expected = max(flops / 8 / dev.peak_flops, traffic / 8 / dev.hbm_bandwidth)
    assert plan.cost.compute_time == pytest.approx(expected)
    assert plan.cost.comm_time == 0.0
    assert plan.cost.ideal_time == pytest.approx(flops / (8 * dev.peak_flops))
    assert plan.cost.step_time == pytest.approx(plan.cost.compute_time)


def test_row_parallel_matmul_pays_one_all_reduce_of_its_result():
    # The result feeds the next matmul: on the critical path, the all-reduce pays its latency.
    topo = hj.Topology.grid((8,), ("m",), bandwidth=1e10, latency=1e-6)
    f = lambda w1, w2, w3, x: (w1, w2, w3, jnp.tanh((x @ w1) @ w2) @ w3)  # noqa: E731
    w1, w2, w3, x = jnp.ones((64, 256)), jnp.ones((256, 64)), jnp.ones((64, 64)), jnp.ones((16, 64))
    plan = hj.plan(f, w1, w2, w3, x, topology=topo, strategy="megatron")
    assert plan.spec("w1") == jax_p(None, "m") and plan.spec("w2") == jax_p("m")
    (ar,) = plan.cost.collectives
    assert (ar.kind, ar.axes, ar.count, ar.bytes) == ("all-reduce", ("m",), 1, 16 * 64 * 4)
    assert plan.cost.comm_time == pytest.approx(2 * 7 / 8 * 16 * 64 * 4 / 1e10 + 2 * 7 * 1e-6)


@pytest.mark.parametrize("device,share", [("cpu", 1.0), ("H100", 16 * 64 * 4 / (30 << 20))])
def test_a_deferred_all_reduce_pays_its_share_of_a_combined_one(device, share):
    # The result is the step's: nothing waits for the all-reduce, so XLA combines it with the
    # others (GPU: up to 30 MiB each, one NCCL call each, whose latency they share; CPU: all of
    # them, but one gloo call per operand, so each still pays its whole latency).
    topo = hj.Topology.grid((8,), ("m",), bandwidth=1e10, latency=1e-6, device=device)
    f = lambda w1, w2, x: (w1, w2, (x @ w1) @ w2)  # noqa: E731
    w1, w2, x = jnp.ones((64, 256)), jnp.ones((256, 64)), jnp.ones((16, 64))
    plan = hj.plan(f, w1, w2, x, topology=topo, strategy="megatron")
    (ar,) = plan.cost.collectives
    assert (ar.kind, ar.count, ar.bytes) == ("all-reduce", 1, 16 * 64 * 4)
    assert plan.cost.comm_time == pytest.approx(
        2 * 7 / 8 * 16 * 64 * 4 / 1e10 + 2 * 7 * 1e-6 * share)


def jax_p(*entries):
    from jax.sharding import PartitionSpec

    return PartitionSpec(*entries)


def test_memory_counts_parameters_gradients_optimizer_state_and_saved_activations():
    m = zoo.get("mlp", size="tiny", width=64, in_dim=64, out_dim=64, batch=64)
    state, batch = m.abstract()
    topo = hj.Topology.grid((8,), ("d",))
    rep = hj.plan(m.step, state, batch, topology=topo, strategy="replicate").cost
    fsdp = hj.plan(m.step, state, batch, topology=topo, strategy="fsdp").cost
    param_bytes = 4 * m.param_count()
    # The breakdown is of the buffers live at the peak: all the state, the gradients made so far
    # and the activations still waiting for the backward pass.
    assert rep.memory_breakdown["parameters"] == param_bytes
    assert rep.memory_breakdown["optimizer"] == pytest.approx(2 * param_bytes, rel=0.01)  # mu, nu
    assert 0 < rep.memory_breakdown["gradients"] <= param_bytes
    assert rep.memory_breakdown["activations"] > 0
    assert rep.peak_memory == pytest.approx(sum(rep.memory_breakdown.values()))
    # Every dimension divides 8 ways here: ZeRO-3 holds an eighth of the state.
    for part in ("parameters", "optimizer"):
        assert fsdp.memory_breakdown[part] == pytest.approx(rep.memory_breakdown[part] / 8, rel=0.01)
    assert fsdp.peak_memory < rep.peak_memory


def test_a_slow_axis_costs_more_than_a_fast_one_for_the_same_collective():
    m = zoo.get("mlp", size="tiny", width=256, in_dim=256, out_dim=256, batch=64)
    state, batch = m.abstract()
    slow = hj.Topology.grid((8,), ("d",), bandwidth=1e9, latency=1e-5)
    fast = hj.Topology.grid((8,), ("d",), bandwidth=1e11, latency=1e-6)
    c_slow = hj.plan(m.step, state, batch, topology=slow, strategy="dp").cost
    c_fast = hj.plan(m.step, state, batch, topology=fast, strategy="dp").cost
    assert c_slow.comm_bytes == c_fast.comm_bytes
    gpu = hj.Topology.grid((8,), ("d",), bandwidth=1e9, latency=1e-5, device="H100")
    c_gpu = hj.plan(m.step, state, batch, topology=gpu, strategy="dp").cost
    grads = [math.prod(t.shape) * 4 for t in hj.plan(m.step, state, batch, topology=gpu,
                                                     strategy="dp").inputs
             if t.role == "parameter"]
    assert len(grads) == 2 * m.config.depth + 2
    reduced = grads + [4]  # and the loss's partial sums (a float32 scalar)
    for cost, bw, lat in ((c_slow, 1e9, 1e-5), (c_fast, 1e11, 1e-6)):
        # One gradient all-reduce per parameter, combined into one by XLA:CPU, which calls gloo
        # once per operand: every one pays the ring's 2 x 7 latencies.
        (ar,) = cost.collectives
        assert ar.kind == "all-reduce" and ar.count == 1 and ar.bytes == sum(reduced)
        assert cost.comm_time == pytest.approx(
            2 * 7 / 8 * ar.bytes / bw + len(reduced) * 2 * 7 * lat)
    # On GPUs each all-reduce pays its share of the latency of a 30 MiB combined one.
    assert c_gpu.comm_time == pytest.approx(
        2 * 7 / 8 * sum(reduced) / 1e9 + sum(2 * 7 * 1e-5 * b / (30 << 20) for b in reduced))


def test_cost_round_trips_through_plan_json(tmp_path):
    m = zoo.get("mlp", size="tiny")
    plan = hj.plan(m.step, *m.abstract(), topology=TOPO, strategy="dp_tp")
    plan.save(tmp_path / "p.json")
    loaded = hj.Plan.load(tmp_path / "p.json")
    assert isinstance(loaded.cost, Cost)
    assert loaded.cost == plan.cost
    assert "step" in str(plan.cost) and 0 < plan.cost.efficiency <= 1


def test_objective_equals_evaluate():
    m = zoo.get("transformer-block", size="tiny")
    state, batch = m.abstract()
    g = hj.trace(m.step, state, batch)
    cm = CostModel(g, TOPO)
    rng = np.random.default_rng(0)
    for _ in range(5):
        a = [int(rng.integers(len(grp.candidates))) for grp in cm.groups]
        assert cm.objective(a) == pytest.approx(cm.evaluate(a).step_time, rel=1e-9)
        # the ILP's additive memory bounds the liveness peak the plan reports
        assert cm.memory(a) >= cm.evaluate(a).peak_memory


def test_estimate_matches_the_plans_cost():
    m = zoo.get("mlp", size="tiny")
    state, batch = m.abstract()
    plan = hj.plan(m.step, state, batch, topology=TOPO, strategy="fsdp")
    assert hj.estimate(m.step, state, batch, plan=plan) == plan.cost
    assert hj.estimate(m.step, state, batch, topology=TOPO, strategy="fsdp") == plan.cost


def test_zeros_a_scatter_accumulates_into_are_made_in_the_readers_layout():
    """The gradient of a pick from the logits (a cross-entropy's label lookup) scatter-adds into
    zeros of the logits' shape, made from a constant alone. XLA's partitioner cuts such a
    broadcast to its reader's sharding, so each device writes its own piece. Costed replicated, the
    (batch, sequence, vocabulary) zeros were a quarter of an 8B LLaMA's predicted step. Here the
    zeros are costed at the batch split ``dp`` gives the scatter, and the emitted program (which
    pins them there) computes what the unsharded gradient does."""
    import jax

    def loss(w, x, labels):
        logp = jax.nn.log_softmax(x @ w)
        return -jnp.take_along_axis(logp, labels[:, None], axis=-1).mean()

    step = jax.grad(loss)
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(64, 512)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(256, 64)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 512, size=(256,)), jnp.int32)
    topo = hj.Topology.grid((8,), ("data",))
    g = hj.trace(step, w, x, labels)
    cm = CostModel(g, topo)
    [zeros] = [n for n in g.nodes if n.primitive.name == "broadcast_in_dim"
               and all(v is None for v in n.inputs) and g.values[n.outputs[0]].shape == (256, 512)]
    assert cm.group_of_node[zeros.id] != cm.free_group
    plan = hj.plan(step, w, x, labels, topology=topo, strategy="dp")
    b = cm.breakdown(plan.assignment, memory=False)
    assert b.specs[zeros.outputs[0]] == (("data",), ())
    assert b.compute[zeros.id] == pytest.approx(cm.compute_time(zeros, 8))
    assert b.compute[zeros.id] < cm.compute_time(zeros, 1) / 4
    np.testing.assert_allclose(hj.emit(step, plan)(w, x, labels), step(w, x, labels),
                               rtol=1e-5, atol=1e-6)
