"""Peak memory (hulkjax/cost/memory.py) against what XLA:CPU compiles
(``compiled.memory_analysis()``: arguments + temporaries + outputs - donated aliases), and its
rules in closed form.

Measured on jax 0.10 (``python benchmarks/realmodels.py`` tabulates seven third-party model
families and three meshes): data-parallel and sharded-state plans are predicted within 1% there
(within 12% on the zoo's transformer block below); replicated and tensor-parallel plans of
attention models are underpredicted by up to 27%, mostly because XLA:CPU copies some donated
weights at the start of the step and materializes broadcasts and transposed operands this walk
does not know of. The bounds below are what holds, so that a change that breaks the walk (a
missing kind of buffer, a double count) fails here.
"""

import jax
import jax.numpy as jnp
import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.cost.memory import liveness
from hulkjax.strategies import cost_model

D8 = hj.Topology.grid((8,), ("d",))
CASES = {
    "mlp": ("mlp", dict(size="tiny", width=512, in_dim=512, out_dim=512, batch=256)),
    "transformer": ("transformer-block", dict(size="tiny", d_model=128, d_ff=512, seq_len=64,
                                              batch=16, n_heads=4)),
}


def _compiled_bytes(step, plan, *args) -> int:
    ma = hj.emit(step, plan).compile(*args).memory_analysis()
    return (ma.argument_size_in_bytes + ma.temp_size_in_bytes + ma.output_size_in_bytes
            - ma.alias_size_in_bytes)


@pytest.fixture(scope="module", params=sorted(CASES))
def measured(request):
    family, kw = CASES[request.param]
    m = zoo.get(family, **kw)
    state, batch = m.init(0)
    g = hj.trace(m.step, state, batch)
    out = {}
    for s in ("replicate", "dp", "fsdp"):
        p = hj.plan(m.step, state, batch, topology=D8, strategy=s, graph=g)
        out[s] = (p.cost.peak_memory, _compiled_bytes(m.step, p, state, batch))
    return out


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_sharded_plans_peak_memory_is_close_to_the_compiled_program(measured, strategy):
    predicted, compiled = measured[strategy]
    assert 0.85 * compiled <= predicted <= 1.1 * compiled, (predicted, compiled)


def test_replicated_peak_memory_is_a_lower_estimate_within_a_third(measured):
    """Attention's batched matmuls read saved activations transposed: XLA lays those copies
    out where the activation is made, so they are held from the forward pass on (0.65 of the
    compiled peak without them, 0.72 with them, on the transformer block)."""
    predicted, compiled = measured["replicate"]
    assert 0.7 * compiled <= predicted <= 1.1 * compiled, (predicted, compiled)


def test_plans_rank_by_memory_as_compiled(measured):
    order = sorted(measured, key=lambda s: measured[s][0])
    assert order == sorted(measured, key=lambda s: measured[s][1])


@pytest.mark.parametrize("remat", [False, True], ids=["saved", "remat"])
def test_a_scanned_models_peak_memory_is_close_to_the_compiled_program(remat):
    """GPT-2 with its blocks in one ``scan``: a loop body's memory is its own liveness walk (the
    gathered parameters, fused chains as one buffer, what its backward part reads) less its
    arguments, which the outer walk holds, and the loop's collectives run inside it. Measured
    (jax 0.10, 8 CPU devices) within 0.92-1.13 of the compiled peak for replicate / dp / fsdp;
    saved activations plus the body's largest
    value, as before, gave 0.40 of it for the rematerialized replicated step."""
    m = zoo.get("gpt2", size="tiny", scan_layers=True, n_layers=4, d_model=128, seq_len=128,
                n_positions=128, batch=32, remat=remat)
    state, batch = m.init(0)
    g = hj.trace(m.step, state, batch)
    for s in ("replicate", "dp", "fsdp"):
        p = hj.plan(m.step, state, batch, topology=D8, strategy=s, graph=g)
        compiled = _compiled_bytes(m.step, p, state, batch)
        assert 0.88 * compiled <= p.cost.peak_memory <= 1.15 * compiled, (s, p.cost.peak_memory,
                                                                          compiled)


def test_a_fused_elementwise_chain_is_one_buffer():
    """``tanh(x) * 2 + 1`` fuses into one loop: only its result is a buffer, never the tanh or
    the product (forward only, nothing saved for a backward pass)."""
    n = 1 << 16
    step = lambda w, x: (w, (jnp.tanh(x) * 2 + 1).reshape(n))  # noqa: E731
    w, x = jnp.ones((4,)), jnp.ones((2, n // 2))
    p = hj.plan(step, w, x, topology=hj.Topology.grid((1,), ("d",)), strategy="replicate")
    assert p.graph.input_roles[1] == "data"
    rep = liveness(cost_model(p.graph, p.topology), p.assignment)
    # the argument x, the result, and w
    assert rep.peak == pytest.approx(2 * 4 * n + 4 * 4)
    ma = hj.emit(step, p).compile(w, x).memory_analysis()
    compiled = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
    assert rep.peak == pytest.approx(compiled, abs=64)  # + the result tuple's pointer table
    assert ma.temp_size_in_bytes == 0


def _mlp(depth, width, batch):
    def step(ws, x):
        def loss(ws):
            h = x
            for w in ws:
                h = jnp.tanh(h @ w)
            return jnp.mean(h)
        return [w - 0.1 * g for w, g in zip(ws, jax.grad(loss)(ws))]
    return step, [jnp.ones((width, width))] * depth, jnp.ones((batch, width))


def test_the_peak_is_at_the_turn_of_the_backward_pass_and_holds_the_saved_activations():
    """An MLP keeps each layer's activations until its backward pass: the peak is after the
    forward pass and holds them all (``activations``) next to the state."""
    depth, width, batch = 4, 64, 8192  # activations larger than the gradients: with small
    # ones the peak is at the combined gradient all-reduce (the test below)
    step, ws, x = _mlp(depth, width, batch)
    p = hj.plan(step, ws, x, topology=D8, strategy="dp")
    cm = cost_model(p.graph, D8)
    rep = liveness(cm, p.assignment)
    local_act = batch // 8 * width * 4
    assert rep.breakdown["parameters"] == depth * width * width * 4
    assert rep.breakdown["data"] == local_act
    assert rep.breakdown["activations"] >= (depth - 1) * local_act
    assert rep.peak <= cm.memory(p.assignment)  # the ILP's additive model bounds it


def test_a_combined_gradient_all_reduce_holds_its_operands_and_results():
    """XLA combines ``dp``'s gradient all-reduces into one after the last gradient is made. An
    all-reduce is not in place: there every partial gradient and every reduced one are live at
    once. With small activations that is the peak: twice the gradients."""
    depth, width = 4, 64
    step, ws, x = _mlp(depth, width, batch=64)
    p = hj.plan(step, ws, x, topology=D8, strategy="dp")
    rep = liveness(cost_model(p.graph, D8), p.assignment)
    assert rep.breakdown["gradients"] == 2 * depth * width * width * 4
    assert rep.breakdown["activations"] == 0  # the last matmul's operands are freed by then
    assert rep.peak == pytest.approx(_compiled_bytes(step, p, ws, x), rel=0.02)



def test_gradient_reductions_free_their_operands_group_by_group_on_a_gpu():
    """Abstract arrays: 8 gradients of 16 MiB. XLA:GPU combines gradient all-reduces up to 30 MiB,
    so each runs right after its gradient is made and frees its partial sum there: at the end
    one reduced copy of every gradient is held, plus at most one group's partial sums. XLA:CPU
    combines all of them into one, which holds both copies of every gradient at once."""
    depth, width = 8, 2048  # 2048 x 2048 float32 = 16 MiB
    step, _, _ = _mlp(depth, width, 8)
    ws = [jax.ShapeDtypeStruct((width, width), jnp.float32)] * depth
    x = jax.ShapeDtypeStruct((64, width), jnp.float32)
    total = depth * width * width * 4
    gpu = hj.Topology.preset("dgx-h100")
    held = {}
    for name, topo in (("gpu", gpu), ("cpu", hj.Topology.grid((8,), ("d",)))):
        p = hj.plan(step, ws, x, topology=topo, strategy="dp")
        held[name] = liveness(cost_model(p.graph, topo), p.assignment).breakdown["gradients"]
    assert held["cpu"] == 2 * total
    assert total <= held["gpu"] <= total + width * width * 4


def test_a_buffer_made_from_constants_alone_is_held_from_the_start_on_cpu():
    """XLA:CPU makes the zeros an embedding gradient accumulates into at the start of the step,
    with the parameters, and holds them through the forward pass (the live-range dumps of BERT
    and GPT-2): a large vocabulary's table of zeros is live at the peak, at the turn of the
    backward pass. The scatter-add then writes into that buffer: one table, not two."""
    V, D, B, W = 32768, 32, 2048, 512

    def loss(p, ids):
        h = jnp.tanh(p["emb"][ids] @ p["w1"])  # (B, W)
        h = jnp.tanh(h @ p["w2"])
        return jnp.sum(h ** 2)

    def step(p, ids):
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(loss)(p, ids))

    params = {"emb": jnp.full((V, D), 0.01), "w1": jnp.full((D, W), 0.01),
              "w2": jnp.full((W, W), 0.01)}
    ids = jnp.arange(B) * 7 % V
    one = hj.Topology.grid((1,), ("d",))
    plan = hj.plan(step, params, ids, topology=one, strategy="replicate")
    cm = cost_model(plan.graph, one)
    g = cm.graph
    zeros = next(n for n in g.nodes if n.name == "broadcast_in_dim"
                 and g.values[n.outputs[0]].shape == (V, D))
    scatter = next(n for n in g.nodes if n.name == "scatter-add")
    report = liveness(cm, plan.assignment)
    assert report.at < scatter.id  # the peak is before the scatter-add ...
    assert any(b.node == zeros.id for b in report.live)  # ... and holds the zeros
    # Within 20%: the walk also holds a transposed copy of the last layer's output gradient for
    # its weight-gradient matmul, which XLA:CPU's matmul kernel reads as it is (1.18 of the
    # compiled peak; without the zeros it would be 1.0 by the error's luck, not by the model).
    compiled = _compiled_bytes(step, plan, params, ids)
    assert compiled <= plan.cost.peak_memory <= 1.2 * compiled, (plan.cost.peak_memory, compiled)


def _cross_entropy_step(dtype=jnp.float32):
    """A vocabulary projection and optax's cross-entropy: the gradient of its logits is the
    softmax part plus the one-hot part, which JAX's transpose of the label gather scatters into
    zeros."""
    import optax

    def loss(w, x, y):
        logits = (x @ w).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(w, x, y):
        value, grad = jax.value_and_grad(loss)(w, x, y)
        return w - 0.1 * grad, value

    B, S, D, V = 4, 512, 256, 32000
    w = jnp.full((D, V), 0.01, dtype)
    x = jnp.linspace(-1.0, 1.0, B * S * D, dtype=dtype).reshape(B, S, D)
    y = jnp.arange(B * S, dtype=jnp.int32).reshape(B, S) * 7 % V
    return step, (w, x, y), B * S * V * 4


def _logits_sized(report, nbytes) -> int:
    return sum(1 for b in report.live if b.node is not None and b.bytes == nbytes)


def test_a_scatter_added_to_another_value_writes_into_it():
    """XLA's algebraic simplifier rewrites ``A + scatter(0, I, U)`` into ``scatter(A, I, U)``
    (``HandleAdd``): the scatter writes into the other addend, and no buffer holds the zeros
    or the sum. Optax's cross-entropy gradient then holds two logits-sized buffers at its
    peak, as XLA:CPU's live-range dump shows (the softmax's ``exp`` and the gradient), not
    three: predicted within 10% of the compiled program (1.47x when the zeros were a buffer,
    made at the start of the step on CPU), on one CPU device and on an H100."""
    step, args, logits = _cross_entropy_step()
    one = hj.Topology.grid((1,), ("d",))
    plan = hj.plan(step, *args, topology=one, strategy="replicate")
    report = liveness(cost_model(plan.graph, one), plan.assignment)
    assert _logits_sized(report, logits) == 2
    compiled = _compiled_bytes(step, plan, *args)
    assert 0.9 * compiled <= plan.cost.peak_memory <= 1.1 * compiled, (
        plan.cost.peak_memory, compiled)
    h100 = hj.Topology.preset("dgx-h100")
    plan = hj.plan(step, *args, topology=h100, strategy="replicate")
    report = liveness(cost_model(plan.graph, h100), plan.assignment)
    assert _logits_sized(report, logits) == 2


def test_a_stage_without_the_scatter_keeps_its_zeros():
    """The fold needs one program to run the add, the scatter and its zeros: a stage that makes
    the zeros and the add while another stage runs the scatter (a tied embedding's gradients on
    two stages) holds the zeros it sends, as without the fold."""
    step, args, logits = _cross_entropy_step()
    one = hj.Topology.grid((1,), ("d",))
    plan = hj.plan(step, *args, topology=one, strategy="replicate")
    cm = cost_model(plan.graph, one)
    g = cm.graph
    scatter = next(n for n in g.nodes if n.name == "scatter-add"
                   and g.values[n.outputs[0]].nbytes == logits)
    zeros = g.values[scatter.inputs[0]].producer
    whole = liveness(cm, plan.assignment)
    assert not any(b.node == zeros for b in whole.live)
    stage = liveness(cm, plan.assignment, nodes=[n.id for n in g.nodes if n.id != scatter.id])
    assert any(b.node == zeros and b.bytes == logits for b in stage.live)
