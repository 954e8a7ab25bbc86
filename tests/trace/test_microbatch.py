"""The microbatch analysis: what runs per microbatch, how microbatches combine, what is refused."""

import jax
import jax.numpy as jnp
import pytest

import hulkjax as hj
from hulkjax.trace.microbatch import EX, IND, RED, analyze, batch_size, microbatch_graph
from tests.helpers import graph_record


def _split(step, *args, k=2):
    g = hj.trace(step, *args)
    return g, analyze(g, microbatch_graph(g, k))


def _sgd(loss):
    def step(w, x):
        value, grad = jax.value_and_grad(loss)(w, x)
        return w - 0.1 * grad, {"loss": value}
    return step


W, X = jnp.ones((4, 4)), jnp.ones((8, 4))


def _descent(net):
    """A gradient step on the mean square of a Flax module's output."""
    def step(p, x):
        value, grad = jax.value_and_grad(lambda p: jnp.mean(net.apply(p, x) ** 2))(p)
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, grad), {"loss": value}
    return step


def _assert_pipeline_computes_the_step(step, params, x, *, microbatches):
    """Two stages (the DGX nodes) x ``microbatches``, emitted, equal the unsharded step."""
    two = hj.Topology.preset("dgx-h100", nodes=2, gpus_per_node=4)
    plan = hj.plan(step, params, x, topology=two, strategy="pipeline", microbatches=microbatches)
    assert plan.microbatches == microbatches and len(plan.stages) == 2
    got = hj.emit(step, plan, donate=False)(params, x)
    want = jax.jit(step)(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert jnp.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_mean_loss_gradients_combine_as_the_mean():
    g, split = _split(_sgd(lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)), W, X)
    assert split.exact and split.batch == 8 and split.split_inputs == (1,)
    # The gradient (x^T dy: a sum over examples times 1 / B) and the loss (a sum over examples,
    # divided by B once per step): both sums, the gradient's with exponent -1.
    assert sorted((c.kind, c.exp) for c in split.boundary.values()) == [("sum", -1), ("sum", 0)]
    # The update (w - 0.1 g) runs once: its node is not per microbatch.
    update = g.values[g.outputs[0]].producer
    assert update not in split.per_microbatch
    assert split.flows[g.inputs[0]].kind == IND and split.flows[g.inputs[1]] .kind == EX


def test_summed_loss_combines_as_the_sum():
    _, split = _split(_sgd(lambda w, x: jnp.sum(x @ w)), W, X)
    assert split.exact
    assert {c.exp for c in split.boundary.values()} == {0}


def test_per_example_outputs_are_concatenated():
    def step(w, x):
        return w, x @ w  # predictions per example
    g, split = _split(step, W, X)
    assert split.exact
    (c,) = [split.boundary[v] for v in split.boundary if v == g.outputs[1]]
    assert (c.kind, c.dim, c.exp) == ("concat", 0, 0)


@pytest.mark.parametrize("loss,why", [
    # Aggregates of the data alone: the message says to pass them in.
    (lambda w, x: jnp.mean((x - x.mean(0)) @ w), "pass it in"),
    (lambda w, x: jnp.max(x @ w), "not a sum"),
    (lambda w, x: jnp.sum(jnp.sum(x @ w, 1) / jnp.maximum(jnp.sum(x[:, 0]), 1.0)),
     "pass it in"),
    # A statistic of activations: no argument can stand for it.
    (lambda w, x: jnp.mean(((x @ w) - (x @ w).mean(0)) ** 2), "depends on the parameters"),
    (lambda w, x: jnp.mean(jnp.cumsum(x @ w, axis=0)), "mixes examples"),
])
def test_steps_that_microbatching_would_change_are_refused(loss, why):
    _, split = _split(_sgd(loss), W, X)
    assert not split.exact
    assert any(why in p for p in split.problems), split.problems


def test_a_count_passed_in_makes_a_normalized_loss_exact():
    """The message's advice holds: ``sum(m)`` computed in the step is refused (and the problem
    says to pass it in, not that it is a batch statistic); the same loss dividing by a count
    passed in as a scalar of the batch microbatches exactly."""
    def inside(w, b):
        return jnp.sum(jnp.sum(jnp.tanh(b["x"] @ w), 1) * b["m"]) / jnp.sum(b["m"])

    def passed(w, b):
        return jnp.sum(jnp.sum(jnp.tanh(b["x"] @ w), 1) * b["m"]) / b["n"]

    m = jnp.array([1.0, 0, 1, 1, 0, 0, 1, 0])
    _, split = _split(_sgd(inside), W, {"x": X, "m": m})
    assert not split.exact
    assert all("parameters" not in p for p in split.problems)
    assert any("pass it in" in p for p in split.problems), split.problems
    _, split = _split(_sgd(passed), W, {"x": X, "m": m, "n": m.sum()})
    assert split.exact, split.problems


def test_dropout_masks_per_example_are_refused():
    def loss(w, x, key):
        keep = jax.random.bernoulli(key, 0.5, x.shape)
        return jnp.mean(jnp.where(keep, x, 0.0) @ w)

    def step(w, batch):
        value, grad = jax.value_and_grad(loss)(w, batch["x"], batch["key"])
        return w - grad, value

    batch = {"x": X, "key": jax.random.key_data(jax.random.key(0))}
    _, split = _split(step, W, batch)
    assert not split.exact and any("random" in p for p in split.problems)


def test_a_batch_size_constant_that_is_no_power_is_refused():
    _, split = _split(_sgd(lambda w, x: jnp.sum(x @ w) / (x.shape[0] - 1)), W, X)
    assert not split.exact


@pytest.mark.parametrize("batch_sized,constant,differ", [
    # B - 1 and the constant 7.0: one literal at B = 8; only the first is no power of B.
    (lambda w, x: jnp.sum(x @ w) / (x.shape[0] - 1), lambda w, x: jnp.sum(x @ w) / 7.0,
     "exactness"),
    # zeros of the batch's size and of 8: one shape at B = 8, another at a microbatch.
    (lambda w, x: jnp.sum(x @ w) + jnp.sum(jnp.ones(x.shape[0]) ** 2),
     lambda w, x: jnp.sum(x @ w) + jnp.sum(jnp.ones(8) ** 2), "shapes"),
])
def test_the_microbatch_trace_says_what_the_full_graph_cannot(batch_sized, constant, differ):
    """Why the partition traces the step once at a microbatch instead of deriving that graph
    from the full one (as :func:`planning_graph` derives the other counts from the two): two
    steps with one jaxpr at the full batch can depend on the batch size differently, which only
    the step's code run at another batch size tells."""
    a, b = hj.trace(_sgd(batch_sized), W, X), hj.trace(_sgd(constant), W, X)
    assert str(a.jaxpr) == str(b.jaxpr)
    ma, mb = microbatch_graph(a, 2), microbatch_graph(b, 2)
    if differ == "exactness":
        assert not analyze(a, ma).exact and analyze(b, mb).exact
    else:
        assert [v.shape for v in ma.values] != [v.shape for v in mb.values]


def test_scan_over_layers_is_analysed_inside_its_body():
    def loss(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return jnp.mean(h ** 2)

    _, split = _split(_sgd(loss), jnp.ones((3, 4, 4)), X)
    assert split.exact
    assert {c.exp for c in split.boundary.values()} == {-1, 0}


def test_reductions_over_other_dimensions_stay_per_example():
    g, split = _split(_sgd(lambda w, x: jnp.mean(jax.nn.logsumexp(x @ w, axis=1))), W, X)
    assert split.exact
    maxes = [n for n in g.nodes if n.name == "reduce_max" and not n.backward]
    assert maxes and all(split.flows[n.outputs[0]].kind == EX for n in maxes)
    # Aggregates only appear where the batch is summed away (and after).
    assert any(f.kind == RED for f in split.flows)


def test_batch_size_is_the_data_arguments_leading_dimension():
    g = hj.trace(lambda w, b: w, W, {"x": X, "y": jnp.ones((8,)), "lr": jnp.ones(())})
    assert batch_size(g) == 8
    with pytest.raises(hj.errors.UnsupportedStepError, match="divisible"):
        microbatch_graph(g, 3)


def test_zoo_models_microbatch_exactly_except_batchnorm_and_a_normalized_loss():
    from hulkjax import zoo
    from hulkjax.strategies.partition import partition

    exact = {}
    for name in ("mlp", "mlp-nnx", "resnet", "bert"):
        m = zoo.get(name, size="tiny")
        exact[name] = partition(hj.trace(m.step, *m.abstract())).exact
    # ResNet's BatchNorm statistics and BERT's loss, normalized by the number of masked tokens
    # of the batch, depend on the whole batch.
    assert exact == {"mlp": True, "mlp-nnx": True, "resnet": False, "bert": False}


@pytest.mark.parametrize("name,size,overrides", [
    ("gpt2", "tiny", {}), ("gpt2", "tiny", {"scan_layers": True}), ("llama", "tiny", {}),
    ("mlp", "tiny", {}), ("cnn", "tiny", {}), ("moe", "tiny", {}), ("vit", "tiny", {}),
    ("transformer-block", "tiny", {})])
def test_planning_graphs_derived_without_tracing_equal_traced_ones(name, size, overrides):
    """The staged search's microbatch graphs, derived from the full and the first microbatch
    graph instead of traced (a speed-up), are the traced graphs in every field planning reads."""
    from hulkjax import zoo
    from hulkjax.trace.microbatch import planning_graph, scaled_graph

    m = zoo.get(name, size=size, batch=16, **overrides)
    g = hj.trace(m.step, *m.abstract())
    first = microbatch_graph(g, 2)
    derived = 0
    for M in (4, 8):
        scaled = scaled_graph(g, first, 2, M)
        fresh = hj.trace(m.step, *m.abstract())  # a graph without cached microbatch traces
        traced = microbatch_graph(fresh, M)
        if scaled is not None:
            derived += 1
            assert graph_record(scaled) == graph_record(traced)
            assert planning_graph(g, M) is scaled or graph_record(planning_graph(g, M)) == \
                graph_record(traced)
    # Derived (not traced) wherever the rescaling is exact: every zoo model here but a scanned
    # stack, whose loop body changes with the batch.
    assert derived == (0 if overrides.get("scan_layers") else 2)


def test_a_weakly_typed_argument_microbatches_as_it_traces():
    """``jnp.full(shape, 0.1)`` is weakly typed; the microbatch trace used to drop that, add or
    drop casts, and find the step's structure batch-dependent (one microbatch only)."""
    import jax
    import jax.numpy as jnp

    import hulkjax as hj
    from hulkjax.strategies.partition import partition

    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)

    w = jnp.full((8, 8), 0.1)
    assert jax.typeof(w).weak_type
    g = hj.trace(step, w, jnp.ones((16, 8)))
    part = partition(g)
    assert part.exact, part.problems()


def _rotate_every_two(x):
    """GPT-J's and RoFormer's rotary helper (transformers' Flax modules): ``jnp.stack`` along a
    new last axis, merged back by a reshape; its gradient is an ``unstack``."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return jnp.stack((-x2, x1), axis=-1).reshape(x.shape)


def test_a_rotary_stack_and_its_unstack_microbatch_exactly():
    """``stack`` (new axis, never the batch's) and ``unstack`` (the batch's split refused) keep
    the batch's flow and its exponent: GPT-J and RoFormer, whose staged plans fell back to one
    microbatch (and before that, the pad after the unknown flow raised a TypeError)."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + _rotate_every_two(jnp.tanh(nn.Dense(8)(x)))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Block()(Block()(x))

    net = Net()
    x = jnp.linspace(-1.0, 1.0, 16 * 8).reshape(16, 8)
    params = net.init(jax.random.key(0), x)
    step = _descent(net)
    _, split = _split(step, params, x)
    assert split.exact, split.problems
    # ... as staged emission over two microbatches computes it
    _assert_pipeline_computes_the_step(step, params, x, microbatches=2)
    # An unstack of the batch dimension itself (one result per example: the step's structure
    # depends on the batch) is refused.
    _, split = _split(_sgd(lambda w, x: sum(jnp.unstack(x @ w, axis=0)).sum()), W, X)
    assert not split.exact


def test_a_pad_of_a_value_whose_batch_dimension_is_unknown_is_refused_not_raised():
    """A per-example value the analysis cannot place (here after an operator it cannot read)
    reaching a pad: the step cannot be microbatched exactly, and the problem says why (it used
    to index the pad's configuration with ``None``)."""
    def loss(w, x):
        y = jax.lax.top_k(x @ w, 2)[0]  # (B, 2): top_k is not among the operators read
        return jnp.mean(jnp.pad(y, ((0, 0), (1, 1))) ** 2)

    _, split = _split(_sgd(loss), W, X)
    assert not split.exact
    assert split.problems


def test_an_in_batch_contrastive_loss_is_refused_not_raised():
    """CLIP's loss: every example is scored against every other (a B x B similarity matrix), and
    the label of each row is picked with a gather. The analysis loses the batch dimension at
    the similarity (examples paired with examples) and used to index the gather's slice sizes
    with ``None`` (transformers' ``FlaxCLIPModule`` under ``auto`` on two DGX nodes)."""
    def loss(w, x):
        a, b = jnp.tanh(x @ w), jnp.tanh(x @ w.T)
        sim = jax.nn.log_softmax(a @ b.T, axis=1)
        labels = jnp.arange(x.shape[0])
        return -jnp.mean(jnp.take_along_axis(sim, labels[:, None], axis=1))

    g, split = _split(_sgd(loss), W, X)
    assert not split.exact
    assert "pairs examples with other examples" in split.problems[0]
    gathers = [n for n in g.nodes if n.name == "gather" and not n.backward]
    assert gathers and all(split.flows[n.outputs[0]].exp is None for n in gathers)


@pytest.mark.parametrize("reps,exact", [((1, 2), True), ((2, 1), False)])
def test_a_tile_keeps_the_batch_unless_it_repeats_it(reps, exact):
    """``jnp.tile`` of a per-example value: repeating other dimensions keeps each example's rows
    its own (exact); repeating the batch dimension mixes copies of the batch (refused)."""
    _, split = _split(_sgd(lambda w, x: jnp.mean(jnp.tile(jnp.tanh(x @ w), reps) ** 2)), W, X)
    assert split.exact is exact
    if not exact:
        assert "repeats the batch dimension" in split.problems[0]


def _masked(w, x):
    """An additive mask of shape (1, 4) stretched to the batch explicitly (as attention masks
    are): ``jnp.broadcast_to`` elides the broadcast where the shapes are equal."""
    mask = jnp.broadcast_to(jnp.arange(4.0)[None], x.shape)
    return jnp.mean(jnp.tanh(x @ w + mask) ** 2)


def test_a_broadcast_of_a_size_one_dimension_to_the_batch_is_found():
    from hulkjax.trace.microbatch import broadcast_to_the_batch

    g, _ = _split(_sgd(_masked), W, X)
    n = broadcast_to_the_batch(g)
    assert n is not None and n.name == "broadcast_in_dim"
    # It is why the step traces to other operators at one example per microbatch.
    one = microbatch_graph(g, 8)
    assert [m.name for m in one.nodes].count("broadcast_in_dim") < \
        [m.name for m in g.nodes].count("broadcast_in_dim")
    plain, _ = _split(_sgd(lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)), W, X)
    assert broadcast_to_the_batch(plain) is None


def test_the_staged_search_does_not_trace_one_example_where_the_batch_is_broadcast_to():
    """A microbatch of one example is refused without a trace where a size-1 dimension is
    stretched to the batch; traced (and found to differ or not) elsewhere."""
    from hulkjax.strategies.stages import _context

    topo = hj.Topology.preset("dgx-h100", nodes=2, gpus_per_node=4)
    for loss, traced in ((_masked, False), (lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2), True)):
        g = hj.trace(_sgd(loss), W, X)
        ctx = _context(g, topo)
        assert ctx.usable(2)
        usable = ctx.usable(8)
        assert (8 in g.memo.get("microbatch_graphs", {})) is traced
        assert usable is (traced and len(microbatch_graph(g, 8).nodes) == len(g.nodes))


def _pool(order):
    """A pooler that reads, for each example, the row at one token (``x[rows, idx]``); ``order``
    says which example's row each reads."""
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = jnp.tanh(nn.Dense(4)(nn.Dense(4)(x)))  # (B, T, 4)
            idx = jnp.argmax(x[..., 0], axis=-1)  # a per-example token
            return h[order(h.shape[0]), idx]

    return Net()


@pytest.mark.parametrize("order,exact", [
    (jnp.arange, True),  # each example's own row: CLIP's text pooler
    (lambda b: jnp.arange(b)[::-1], False),  # other examples' rows
    (lambda b: (jnp.arange(b) + 1) % b, False),
    (lambda b: jnp.arange(b) * 0, False),  # the first example's row for every example
])
def test_indexing_each_example_s_own_row_microbatches_exactly(order, exact):
    """``x[jnp.arange(B), idx]`` reads each example's own row: its positions (an iota along the
    batch, through jnp's negative-index fix-up) index the batch dimension of the same example,
    and the gradient's scatter writes each example's own row. It used to be refused (an iota
    read by per-example computation), so such steps were staged with one microbatch. Any other
    order of rows still is."""
    net = _pool(order)
    x = jnp.linspace(-1.0, 1.0, 16 * 5 * 4).reshape(16, 5, 4)
    params = net.init(jax.random.key(0), x)
    step = _descent(net)
    _, split = _split(step, params, x)
    assert split.exact is exact, split.problems
    if exact:
        _assert_pipeline_computes_the_step(step, params, x, microbatches=4)


def test_a_scatter_of_examples_into_rows_the_data_chooses_is_refused():
    """A per-example update written into a batch-sized buffer at rows the data picks moves
    examples across the batch (it used to pass: only a per-example buffer was checked)."""
    def loss(w, x):
        y = jnp.tanh(x @ w)  # (B, 4)
        rows = jnp.argmax(x, axis=1) % x.shape[0]
        return jnp.mean(jnp.zeros_like(y).at[rows].add(y) ** 2)

    _, split = _split(_sgd(loss), W, X)
    assert not split.exact
    assert any("scatter writes across examples" in p for p in split.problems)


@pytest.mark.parametrize("loss,why", [
    # the stacked positions fed to a matmul as data (each microbatch's are 0 .. B / M - 1)
    (lambda w, x: jnp.mean(jnp.concatenate(
        [jnp.arange(x.shape[0])[:, None], jnp.argmax(x, 1)[:, None]], 1).astype(x.dtype) @ w[:2]),
     "as data"),
    # ... or carried into a loop, whose body would see them as plain per-example values
    (lambda w, x: jnp.mean(jax.lax.scan(
        lambda c, r: (c + r.astype(x.dtype).sum(), None), 0.0, jnp.concatenate(
            [jnp.arange(x.shape[0])[:, None], jnp.argmax(x, 1)[:, None]], 1))[0] * (x @ w)),
     "as data"),
    # a table indexed by the positions: rows of the table, not of each example
    (lambda w, x: jnp.mean(jnp.tile(w, (2, 1))[jnp.arange(x.shape[0]), jnp.argmax(x, 1)] * x[:, 0]),
     "something other than each example's own row"),
])
def test_the_examples_positions_are_refused_outside_their_own_rows(loss, why):
    _, split = _split(_sgd(loss), W, X)
    assert not split.exact
    assert any(why in p for p in split.problems), split.problems
