"""Remat policies in the plan: ``checkpoint_name`` labels and activations offloaded to host memory.

A policy of ``jax.checkpoint`` chooses what the backward pass keeps; MaxText's recipes name the
values (``jax.ad_checkpoint.checkpoint_name``) and save some on the device and move others to host
memory (``save_and_offload_only_these_names``). The label is an identity (its layout passes
through); an offloaded value is copied out to host memory in the forward pass and back where the
backward pass reads it. On GPUs and TPUs it then leaves the device's memory and its copies take
the host link, asynchronously; XLA:CPU, with one memory, holds them as a step that saves them on
the device does (:attr:`hulkjax.cost.backends.Backend.host_offload`).
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import hulkjax as hj
from hulkjax import zoo
from hulkjax.cost import CostModel
from hulkjax.cost.memory import host_copies
from hulkjax.cost.overlap import _HOST, Overlap, _loop_resolution, _overlap, _pipelined, _schedule
from hulkjax.errors import InvalidModelConfigError, InvalidTopologyError
from hulkjax.strategies import plan_cost_model
from hulkjax.strategies.partition import partition
from hulkjax.topology.specs import DEVICE_SPECS
from tests.helpers import assert_steps_match, assert_trees_close, first_steps

OFFLOAD = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[], names_which_can_be_offloaded=["h"], offload_src="device",
    offload_dst="pinned_host")
SAVE = jax.checkpoint_policies.save_only_these_names("h")
NOTHING = jax.checkpoint_policies.nothing_saveable


def remat_step(policy, *, named=True, layers=4):
    """An MLP of ``layers`` rematerialized layers whose hidden activation is named ``h``."""

    def layer(w, x):
        h = jnp.tanh(x @ w)
        if named:
            h = checkpoint_name(h, "h")
        return jnp.tanh(h @ w)

    f = layer if policy is None else jax.checkpoint(layer, policy=policy)

    def loss(w, x):
        for _ in range(layers):
            x = f(w, x)
        return jnp.mean(x ** 2)

    def step(w, x):
        value, grad = jax.value_and_grad(loss)(w, x)
        return w - 0.1 * grad, value

    return step


def args(batch=512, width=128):
    return (jnp.full((width, width), 0.05, jnp.float32), jnp.linspace(-1.0, 1.0, batch * width,
                                                         dtype=jnp.float32).reshape(batch, width))


def collectives(plan):
    return sorted((c.kind, c.axes, c.count) for c in plan.cost.collectives)


# ---- checkpoint_name ---------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
@pytest.mark.parametrize("policy", [None, SAVE], ids=["no remat", "saved"])
def test_a_checkpoint_name_passes_its_operands_layout_through(strategy, policy):
    """The label is an identity: plans of the step with it make the collectives they make
    without it. It was an operator without data (like an iota), made replicated: ``dp``
    all-gathered every labelled activation."""
    w, x = args()
    topo = hj.Topology.preset("dgx-h100")
    named = hj.plan(remat_step(policy), w, x, topology=topo, strategy=strategy)
    plain = hj.plan(remat_step(policy, named=False), w, x, topology=topo, strategy=strategy)
    assert collectives(named) == collectives(plain)
    if strategy == "dp":
        assert {c.kind for c in named.cost.collectives} == {"all-reduce"}


@pytest.mark.parametrize("strategy", ["dp", "megatron"])
def test_a_labelled_steps_gathers_are_the_compiled_ones(strategy):
    """Where both the labelled value and its operand are read in another layout (``megatron``
    here: the backward reads the label, the forward matmul its operand), XLA gathers each: the
    predicted all-gathers are the compiled program's."""
    w, x = args()
    step = remat_step(None)
    p = hj.plan(step, w, x, topology=hj.Topology.grid((8,), ("d",)), strategy=strategy)
    hlo = hj.emit(step, p).compile(w, x).as_text()
    predicted = sum(c.count for c in p.cost.collectives if c.kind == "all-gather")
    assert predicted == hlo.count(" all-gather(")


def test_a_labelled_step_computes_what_the_unsharded_step_computes(compile_count):
    w, x = args(batch=64, width=32)
    step = remat_step(SAVE)
    refs = first_steps(jax.jit(step), w, x, n=2)
    topo = hj.Topology.grid((8,), ("d",))
    sharded = hj.hulk_shard(topology=topo, strategy="dp")(step)
    assert_steps_match(sharded, w, x, refs, compile_count)


# ---- what the trace says ------------------------------------------------------------------------

def test_the_trace_marks_values_in_host_memory():
    w, x = args()
    g = hj.trace(remat_step(OFFLOAD), w, x)
    copies = host_copies(g)
    # each layer's h out to the host in the forward pass, and back in the backward pass
    assert len(copies) == 2 * 4
    assert set(copies.values()) == {float(x.size * 4)}
    host = [v for v in g.values if v.host]
    assert len(host) == 4 and all(v.shape == x.shape for v in host)
    assert not any(v.host for v in hj.trace(remat_step(SAVE), w, x).values)


# ---- memory ------------------------------------------------------------------------------------

def test_xla_cpu_compiles_offloading_as_saving_and_the_cost_model_follows():
    """What ``Backend("cpu").host_offload = False`` rests on: XLA:CPU gives this offloading step
    the memory of the step that saves the same values on the device (it has no host memory
    space; a larger step's buffer assignment can pack the two differently, see
    :attr:`~hulkjax.cost.backends.Backend.host_offload`)."""
    w, x = args(batch=16384, width=256)  # activations well above the weights
    temp = {name: jax.jit(remat_step(pol)).lower(w, x).compile().memory_analysis()
            .temp_size_in_bytes for name, pol in (("offload", OFFLOAD), ("save", SAVE))}
    assert temp["offload"] == temp["save"]
    topo = hj.Topology.grid((8,), ("d",))
    peak = {name: hj.plan(remat_step(pol), w, x, topology=topo, strategy="dp").cost.peak_memory
            for name, pol in (("offload", OFFLOAD), ("save", SAVE))}
    assert peak["offload"] == pytest.approx(peak["save"], rel=0.02)


@pytest.mark.parametrize("preset", ["dgx-h100", "tpu-v6e"])
def test_offloaded_activations_leave_device_memory(preset):
    """Where the backend offloads, the saved values are not in the device's peak: the step's
    activations are then what it keeps without saving them (``nothing_saveable``), and its
    additive memory (the integer program's) leaves them out too."""
    w, x = args(batch=16384, width=256)  # activations well above the weights
    topo = hj.Topology.preset(preset) if preset == "dgx-h100" else \
        hj.Topology.preset(preset, shape=(2, 4))
    plans = {name: hj.plan(remat_step(pol), w, x, topology=topo, strategy="dp")
             for name, pol in (("offload", OFFLOAD), ("save", SAVE), ("nothing", NOTHING))}
    act = {k: p.cost.memory_breakdown["activations"] for k, p in plans.items()}
    per_device = x.size * 4 / topo.num_devices
    # saving keeps 4 more activations than rematerializing them; offloading keeps none of them
    assert act["save"] - act["nothing"] == pytest.approx(4 * per_device, rel=0.01)
    assert act["offload"] <= act["nothing"] + per_device
    cms = {k: plan_cost_model(p.graph, p.topology, p) for k, p in plans.items()}
    additive = {k: cms[k].memory(p.assignment) for k, p in plans.items()}
    assert additive["save"] - additive["offload"] >= 4 * per_device * 0.99


# ---- time ---------------------------------------------------------------------------------------

def test_a_host_copy_takes_its_shard_over_the_host_link():
    w, x = args(batch=4096, width=256)
    topo = hj.Topology.preset("dgx-h100")
    p = hj.plan(remat_step(OFFLOAD), w, x, topology=topo, strategy="dp")
    cm = plan_cost_model(p.graph, p.topology, p)
    bd = cm.breakdown(p.assignment, memory=False)
    copies = host_copies(p.graph)
    assert copies
    for nid, nbytes in copies.items():
        # the batch split 8 ways: each GPU copies its eighth, at PCIe Gen5's 64 GB/s
        assert bd.compute[nid] == pytest.approx(nbytes / 8 / 64e9, rel=1e-9)
    cpu = CostModel(p.graph, hj.Topology.grid((8,), ("d",)))  # XLA:CPU copies nothing
    assert cpu.host_copies == {}
    assert all(cpu.breakdown(p.assignment, memory=False).compute[nid] == 0.0 for nid in copies)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_host_copies_overlap_with_compute(backend):
    """The copies run beside compute: nearly all of them hidden where the forward and backward
    compute between a copy and its reader covers it, and the schedule's parts add up."""
    w, x = args(batch=4096, width=256)
    topo = hj.Topology.preset("dgx-h100")
    p = hj.plan(remat_step(OFFLOAD), w, x, topology=topo, strategy="dp")
    cm = plan_cost_model(p.graph, p.topology, p)
    o = cm.overlapped(p.assignment, backend)
    copies = sum(cm.breakdown(p.assignment, memory=False).compute[n] for n in cm.host_copies)
    assert o.host_copy_time == pytest.approx(copies, rel=1e-9) and copies > 0
    assert o.exposed_host_copy_time < 0.25 * o.host_copy_time
    assert o.step_time == pytest.approx(
        o.compute_time + o.exposed_comm_time + o.exposed_host_copy_time, rel=1e-9)
    assert o.step_time < p.cost.step_time - 0.5 * copies
    if backend == "gpu":  # the cost model's own: the copies are not mistaken for reused comm
        assert o.reused_comm_time == pytest.approx(0.0, abs=1e-12)
    assert "host copies" in str(o)


# ---- the host link -----------------------------------------------------------------------------

def test_an_unknown_host_link_is_refused_with_what_to_give():
    w, x = args()
    step = remat_step(OFFLOAD)
    v5e = hj.Topology.preset("tpu-v5e", chips=8)  # its host link is not published
    with pytest.raises(InvalidTopologyError, match=r"host_bandwidth=.*PCIe") as e:
        hj.plan(step, w, x, topology=v5e, strategy="dp")
    assert "device_put" in str(e.value) and "TPUv5e" in str(e.value)
    given = dataclasses.replace(DEVICE_SPECS["TPUv5e"], host_bandwidth=16e9)
    p = hj.plan(step, w, x, topology=hj.Topology.grid((8,), ("d",), device=given),
                strategy="dp")
    assert p.cost.step_time > 0
    # without offloading, nothing is asked of the host link
    hj.plan(remat_step(SAVE), w, x, topology=v5e, strategy="dp")
    with pytest.raises(InvalidTopologyError, match="host_bandwidth"):
        dataclasses.replace(DEVICE_SPECS["H100"], host_bandwidth=-1.0)


def test_the_host_link_survives_the_json_form():
    topo = hj.Topology.preset("dgx-h100")
    again = hj.Topology.from_dict(topo.to_dict())
    assert again.devices[0].spec.host_bandwidth == 64e9
    assert np.isclose(DEVICE_SPECS["TPUv6e"].host_bandwidth, 1.5e10)
    assert DEVICE_SPECS["TPUv5p"].host_bandwidth is None


def scanned_step(policy, layers=8):
    """The same layers as one ``lax.scan`` over stacked weights, rematerialized inside."""

    def body(x, w):
        h = checkpoint_name(jnp.tanh(x @ w), "h")
        return jnp.tanh(h @ w), None

    f = jax.checkpoint(body, policy=policy, prevent_cse=False)

    def loss(ws, x):
        y, _ = jax.lax.scan(f, x, ws)
        return jnp.mean(y ** 2)

    def step(ws, x):
        value, grad = jax.value_and_grad(loss)(ws, x)
        return ws - 0.1 * grad, value

    return step


def test_a_loops_host_copies_run_across_its_iterations():
    """In a scan, the copies of one iteration run while others compute: each further iteration
    takes the longer of its compute and its copies (``_pipelined``), so the loop waits for fewer
    copies than its body, scheduled alone, waits for in every iteration."""

    def body(step, exposed, host):
        return Overlap(step_time=step, compute_time=step - exposed, comm_time=0.0,
                       exposed_comm_time=0.0, hidden_comm_time=0.0, additive_time=step + host,
                       reused_comm_time=0.0, collectives=(), backend="tpu", host_copy_time=host,
                       exposed_host_copy_time=exposed)

    assert _pipelined(body(10.0, 4.0, 7.0), 5) == 10.0 + 4 * 7.0  # the host link bounds it
    assert _pipelined(body(10.0, 1.0, 3.0), 5) == 10.0 + 4 * 9.0  # compute bounds it
    assert _pipelined(body(10.0, 0.0, 0.0), 5) == 50.0

    ws = jnp.full((8, 256, 256), 0.05, jnp.float32)
    x = jnp.ones((16384, 256), jnp.float32)
    p = hj.plan(scanned_step(OFFLOAD), ws, x, topology=hj.Topology.preset("dgx-h100"),
                strategy="dp")
    cm = plan_cost_model(p.graph, p.topology, p)
    o = cm.overlapped(p.assignment)
    assert o.host_copy_time > 0
    # per body (forward and backward), its own schedule's wait, in every one of the 8 iterations
    scans = [nid for nid, n in enumerate(p.graph.nodes) if n.subgraphs]
    alone = 0.0
    for nid in scans:
        r = _loop_resolution(cm, p.assignment, nid)
        alone += r.trips * sum(_overlap(b.cost_model, list(b.assignment), cm.backend, b.outputs,
                                        nid).exposed_host_copy_time for b in r.bodies)
    assert alone > 0 and o.exposed_host_copy_time < 0.5 * alone
    # offloaded, the stacked activations are not on the device: its activations are those of
    # the step that saves nothing
    nothing = hj.plan(scanned_step(NOTHING), ws, x, topology=p.topology, strategy="dp")
    assert p.cost.memory_breakdown["activations"] == pytest.approx(
        nothing.cost.memory_breakdown["activations"], rel=0.01)


def test_the_zoos_llama_offloads_maxtexts_names(compile_count):
    """``zoo.get("llama", remat=True, offload=(...))``: the named values go to host memory and
    back (one copy each way per name and layer), the step computes what it computes without
    offloading, and its plans compute what the unsharded step computes."""

    names = ("decoder_layer_input", "query_proj", "value_proj")
    m = zoo.get("llama", size="tiny", remat=True, offload=names)
    state, batch = m.init(0)
    g = hj.trace(m.step, state, batch)
    assert len(host_copies(g)) == 2 * len(names) * m.config.n_layers
    plain = zoo.get("llama", size="tiny", remat=True)
    refs = first_steps(jax.jit(m.step), state, batch, n=2)
    assert float(refs[0][1]["loss"]) == pytest.approx(
        float(jax.jit(plain.step)(*plain.init(0))[1]["loss"]), rel=1e-6)
    sharded = hj.hulk_shard(m.step, topology=hj.Topology.grid((2, 4), ("data", "model")),
                            strategy="fsdp")
    # AdamW's first steps amplify reduction-order noise: under the tests' XLA flags the same
    # plan of the step without offloading is 2.1e-5 off its unsharded step too (this 2.2e-5)
    assert_steps_match(sharded, state, batch, refs, compile_count, rtol=2e-4, atol=5e-5)
    with pytest.raises(InvalidModelConfigError, match="needs remat=True"):
        zoo.get("llama", size="tiny", offload=names)
    with pytest.raises(InvalidModelConfigError, match="mlpwi"):
        zoo.get("llama", size="tiny", remat=True, offload=("mlpwi",))


def test_host_copies_do_not_share_the_network():
    """A copy to host memory and a collective in flight at once each run at their own pace
    (the host link is not the network); two collectives on different resources share it."""

    # compute for 5 s; a collective and a host copy of 4 s each, ready at once
    start, hidden, makespan = _schedule([5.0, 4.0, 4.0], [None, "collectives", _HOST],
                                        [[], [], []], [0, 1, 2])
    assert makespan == pytest.approx(5.0) and hidden[1:] == pytest.approx([4.0, 4.0])
    _, _, shared = _schedule([5.0, 4.0, 4.0], [None, "all-gather", "all-reduce"],
                             [[], [], []], [0, 1, 2])
    assert shared == pytest.approx(8.0)


def test_explain_says_what_the_host_copies_take():
    w, x = args(batch=4096, width=256)
    p = hj.plan(remat_step(OFFLOAD), w, x, topology=hj.Topology.preset("dgx-h100"),
                strategy="dp")
    text = hj.explain(p)
    line = next(ln for ln in text.splitlines() if "copies to and from host memory" in ln)
    assert "of it hidden under compute" in line
    saved = hj.explain(hj.plan(remat_step(SAVE), w, x, topology=p.topology, strategy="dp"))
    assert "host memory" not in saved


def host_state_step(state, x):
    """An SGD-with-momentum step whose momentum lives in host memory between steps (as
    MaxText's ``optimizer_memory_host_offload`` keeps optimizer state)."""
    w, m = state
    grad = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
    m_new = 0.9 * jax.device_put(m, jax.memory.Space.Device) + grad
    return (w - 0.1 * m_new, jax.device_put(m_new, jax.memory.Space.Host)), jnp.sum(grad)


def test_state_kept_in_host_memory_stays_there(compile_count, tmp_path):
    """An argument and result the step keeps in host memory: the plan records it
    (``TensorPlan.memory_kind``, kept in the JSON form), the emitted program takes and returns
    it there and computes what the unsharded step computes, and on a GPU it holds no device
    memory."""

    host = NamedSharding(Mesh(jax.devices()[:1], ("d",)), P(), memory_kind="pinned_host")
    w = jnp.full((64, 64), 0.1, jnp.float32)
    m = jax.device_put(jnp.zeros((64, 64), jnp.float32), host)
    x = jnp.linspace(-1.0, 1.0, 128 * 64, dtype=jnp.float32).reshape(128, 64)
    refs = first_steps(jax.jit(host_state_step), (w, m), x, n=2)
    assert refs[0][0][1].sharding.memory_kind == "pinned_host"
    sharded = hj.hulk_shard(host_state_step, topology=hj.Topology.grid((8,), ("d",)),
                            strategy="dp")
    _, m2 = assert_steps_match(sharded, (w, m), x, refs, compile_count)
    assert m2.sharding.memory_kind == "pinned_host"
    kinds = [t.memory_kind for t in sharded.plan.inputs]
    assert kinds == ["device", "pinned_host", "device"]
    assert [t.memory_kind for t in sharded.plan.outputs] == ["device", "pinned_host", "device"]
    sharded.plan.save(tmp_path / "plan.json")
    loaded = hj.Plan.load(tmp_path / "plan.json")
    assert [t.memory_kind for t in loaded.inputs] == kinds
    # the momentum is optimizer state (its update reaches it through the host copies)
    assert [t.role for t in sharded.plan.inputs] == ["parameter", "optimizer", "data"]

    def optimizer_bytes(p):  # the walk's, and the integer program's additive tables'
        cm = plan_cost_model(p.graph, p.topology, p)
        return p.cost.memory_breakdown["optimizer"], sum(
            cm.local(gid, c).memory_parts.get("optimizer", 0.0)
            for gid, c in enumerate(p.assignment))

    gpu = hj.plan(host_state_step, (w, m), x, topology=hj.Topology.preset("dgx-h100"),
                  strategy="dp")
    assert optimizer_bytes(gpu) == (0.0, 0.0)
    cpu = hj.plan(host_state_step, (w, m), x, topology=hj.Topology.grid((8,), ("d",)),
                  strategy="dp")
    assert optimizer_bytes(cpu) == (64 * 64 * 4, 64 * 64 * 4)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_staged_plans_of_an_offloading_step_compute_the_unsharded_step(scan):
    """The batch analysis reads labels and host copies as the identities they are (before, a
    labelled step could not be microbatched: "cannot tell whether name mixes examples"), and the
    staged program of an offloading step, over two microbatches, computes the unsharded step.

    The offloaded values cross from each stage's forward program to its backward program in
    host memory: the copy out runs in the forward pass (where XLA's host offloader puts it), and
    the programs take and return host values there. Before, an unrolled step's copy out ran in
    the backward program, so the activation crossed on the device and the offload saved
    nothing; and a value the plan lays out was returned in device memory."""
    m = zoo.get("llama", size="tiny", optimizer="sgd", remat=True, scan_layers=scan,
                offload=("decoder_layer_input", "query_proj", "value_proj"))
    state, batch = m.init(0)
    topo = hj.Topology.preset("hetero", nodes=(("A100", 6), ("V100", 2)))
    plan = hj.plan(m.step, state, batch, topology=topo, strategy="pipeline", microbatches=2)
    assert plan.microbatches == 2 and len(plan.stages) == 2
    want_state, want_metrics = jax.jit(m.step)(state, batch)
    step = hj.emit(m.step, plan, donate=False)
    new_state, metrics = step(state, batch)
    assert_trees_close(metrics, want_metrics)
    assert_trees_close(new_state, want_state)

    if not scan:  # (scanned, the copies are the scan's: its forward loop returns host values)
        part = partition(plan.graph)
        copies = host_copies(plan.graph)
        out = [n for n in copies if plan.graph.values[plan.graph.nodes[n].outputs[0]].host]
        assert out and {part.phase[n] for n in out} == {"F"}
        assert {part.phase[n] for n in copies if n not in out} == {"B"}
    assert_offloaded_values_cross_in_host_memory(step)


def assert_offloaded_values_cross_in_host_memory(step):
    """Every value of a staged step in host memory is written by a forward program and taken
    and returned by every program in host memory."""
    host = {i for i, v in enumerate(step.micro.values) if v.host}
    crossing = 0
    for p in step._all_programs():
        ins, outs = p.compiled.input_shardings[0], p.compiled.output_shardings[0]
        kinds = {s.memory_kind for v, s in (*zip(p.reads, ins), *zip(p.writes, outs))
                 if v in host}
        assert kinds <= {"pinned_host"}, (p.name, kinds)
        written = [v for v in p.writes if v in host]
        assert not written or p.name.startswith("F"), (p.name, written)
        crossing += len(written)
    assert host and crossing == len(host)  # each offloaded value, written by a forward program


def test_state_kept_in_host_memory_stays_there_in_a_staged_plan():
    """A staged plan of a step that keeps its momentum in host memory: the stage holding it
    takes it there, its update returns it there, and the step computes the unsharded step's.
    Before, the staged program returned it in device memory."""

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(4):
                x = jnp.tanh(nn.Dense(64, name=f"layer_{i}")(x))
            return x

    model = MLP()

    def step(state, x):
        params, mom = state
        loss, grad = jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)
        mom = jax.tree.map(lambda m, g: 0.9 * jax.device_put(m, jax.memory.Space.Device) + g,
                           mom, grad)
        new = jax.tree.map(lambda p, m: p - 0.1 * m, params, mom)
        return (new, jax.tree.map(lambda m: jax.device_put(m, jax.memory.Space.Host), mom)), loss

    x = jnp.linspace(-1.0, 1.0, 32 * 64, dtype=jnp.float32).reshape(32, 64)
    params = model.init(jax.random.key(0), x)
    host = NamedSharding(Mesh(jax.devices()[:1], ("d",)), P(), memory_kind="pinned_host")
    mom = jax.tree.map(lambda p: jax.device_put(jnp.zeros_like(p), host), params)
    want = jax.jit(step)((params, mom), x)
    topo = hj.Topology.preset("hetero", nodes=(("A100", 6), ("V100", 2)))
    plan = hj.plan(step, (params, mom), x, topology=topo, strategy="pipeline", microbatches=2)
    assert plan.stages is not None and len(plan.stages) == 2
    n = len(jax.tree.leaves(params))
    assert [t.memory_kind for t in plan.inputs] == ["device"] * n + ["pinned_host"] * n \
        + ["device"]
    got = hj.emit(step, plan, donate=False)((params, mom), x)
    assert {m.sharding.memory_kind for m in jax.tree.leaves(got[0][1])} == {"pinned_host"}
    assert {p.sharding.memory_kind for p in jax.tree.leaves(got[0][0])} == {"device"}
    assert_trees_close(got, want)


def test_a_scanned_offloading_step_emits_with_its_body_plans():
    """Layers in one scan, their offloaded values stacked in host memory: the emitted program
    re-traces the scan's body with its planned layouts (its inputs' memory spaces kept) and
    computes the unsharded step."""
    m = zoo.get("llama", size="tiny", optimizer="sgd", remat=True, scan_layers=True,
                offload=("decoder_layer_input", "query_proj", "value_proj"))
    state, batch = m.init(0)
    want_state, want_metrics = jax.jit(m.step)(state, batch)
    step = hj.hulk_shard(m.step, topology=hj.Topology.grid((2, 4), ("data", "model")),
                         strategy="megatron")
    new_state, metrics = step(state, batch)
    assert step.plan.bodies  # the scan's body is laid out by the plan
    assert_trees_close(metrics, want_metrics)
    assert_trees_close(new_state, want_state)


def transformers_gpt2_under_policies():
    """Transformers' Flax GPT-2 (tiny), its loss under ``jax.checkpoint`` with each of three
    generic policies: ``(families, dims, {policy: step}, state, batch)``."""
    families = pytest.importorskip("tests.realmodels.families")
    if not families.available("gpt2"):
        pytest.skip("transformers is not installed")
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2LMHeadModule

    d = families._dims("tiny")
    module = FlaxGPT2LMHeadModule(GPT2Config(
        vocab_size=d["vocab"], n_positions=d["seq"], n_embd=d["width"], n_layer=d["layers"],
        n_head=d["heads"], n_inner=d["ff"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    batch = families._lm_batch(d)

    def loss_fn(params, b):  # (positions from the batch: a staged plan splits it)
        logits = module.apply({"params": params}, b["input_ids"], b["attention_mask"],
                              families._positions(b["input_ids"]), deterministic=True).logits
        return families._token_loss(logits, b["targets"])

    state = families._state(families._init(module, batch["input_ids"], batch["attention_mask"],
                                           families._positions(batch["input_ids"])))
    policies = jax.checkpoint_policies
    steps = {name: families._train_step(jax.checkpoint(loss_fn, policy=pol)) for name, pol in (
        ("offload", policies.offload_dot_with_no_batch_dims("device", "pinned_host")),
        ("save", policies.dots_with_no_batch_dims_saveable),
        ("nothing", policies.nothing_saveable))}
    return families, d, steps, state, batch


def test_third_party_code_offloaded_by_a_generic_policy():
    """Model code this project did not write: transformers' Flax GPT-2, its loss under
    ``jax.checkpoint`` with ``offload_dot_with_no_batch_dims`` (every weight matmul's result to
    host memory, no names needed). On an H100 node the offloaded results leave the integer
    program's memory (what it keeps is what recomputing everything keeps, less than saving
    them), their copies run nearly all under compute, and the emitted ``dp`` program computes
    the unsharded step."""
    families, d, steps, state, batch = transformers_gpt2_under_policies()
    topo = hj.Topology.preset("dgx-h100")
    plans = {k: hj.plan(s, state, batch, topology=topo, strategy="dp") for k, s in steps.items()}
    cms = {k: plan_cost_model(p.graph, p.topology, p) for k, p in plans.items()}
    additive = {k: cms[k].memory(p.assignment) for k, p in plans.items()}
    assert additive["offload"] == pytest.approx(additive["nothing"], rel=1e-9)
    assert additive["offload"] < additive["save"]
    cm = cms["offload"]
    # each layer's fused QKV, attention output and two MLP matmuls, out and back
    assert len(cm.host_copies) >= 2 * d["layers"] * 4
    o = cm.overlapped(plans["offload"].assignment)
    assert o.host_copy_time > 0 and o.exposed_host_copy_time < 0.25 * o.host_copy_time
    refs = first_steps(jax.jit(steps["offload"]), state, batch, n=1)
    sharded = hj.hulk_shard(steps["offload"], topology=hj.Topology.grid((8,), ("d",)),
                            strategy="dp")
    new_state, metrics = sharded(state, batch)
    tol = families.FAMILIES["gpt2"].tolerance
    assert_trees_close(metrics, refs[0][1], **tol)
    assert_trees_close(new_state, refs[0][0], **tol)


def test_third_party_code_offloaded_in_a_staged_plan():
    """Transformers' GPT-2 under ``offload_dot_with_no_batch_dims``, planned in two stages of two
    microbatches: every offloaded matmul result goes to host memory in its stage's forward
    program and comes back in the backward one (before, the copies out ran in the backward
    program: the results crossed on the device), and the step computes the unsharded step's."""
    families, _, steps, state, batch = transformers_gpt2_under_policies()
    topo = hj.Topology.preset("hetero", nodes=(("A100", 6), ("V100", 2)))
    plan = hj.plan(steps["offload"], state, batch, topology=topo, strategy="pipeline",
                   microbatches=2)
    assert plan.microbatches == 2 and len(plan.stages) == 2
    want_state, want_metrics = jax.jit(steps["offload"])(state, batch)
    step = hj.emit(steps["offload"], plan, donate=False)
    new_state, metrics = step(state, batch)
    tol = families.FAMILIES["gpt2"].tolerance
    assert_trees_close(metrics, want_metrics, **tol)
    assert_trees_close(new_state, want_state, **tol)
    assert_offloaded_values_cross_in_host_memory(step)
