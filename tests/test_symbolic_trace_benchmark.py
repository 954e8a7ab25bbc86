"""``benchmarks/symbolic_trace.py``'s pieces: a step traced once with a symbolic batch, made
concrete at a batch size, is the graph a concrete trace at that size gives (``SYMBOLIC.md``
checks the third-party models), and where it is not, the benchmark says so."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.extend import core as jex_core

import hulkjax as hj
from hulkjax import zoo
from hulkjax.errors import UnsupportedStepError
from hulkjax.trace.microbatch import batch_size, microbatch_graph
from tests.helpers import assert_trees_close, benchmark_module

with benchmark_module("symbolic_trace") as _bench:  # (its functions stay usable after)
    concretize, equations, evaluate = _bench.concretize, _bench.equations, _bench.evaluate
    graph_at, graph_difference = _bench.graph_at, _bench.graph_difference
    static_gathers, symbolic_trace = _bench.static_gathers, _bench.symbolic_trace


def _same_graph(derived, traced):
    """Everything planning reads of a graph, and its literal operands (the ``1 / B`` of a
    mean: a literal in both)."""
    assert graph_difference(traced, derived) is None


@pytest.mark.parametrize("name,overrides", [
    ("gpt2", {}), ("gpt2", {"scan_layers": True, "remat": True}), ("cnn", {}), ("moe", {})])
def test_one_symbolic_trace_gives_the_traced_graphs_at_the_batch_and_its_microbatches(
        name, overrides):
    """Made concrete at the batch and at two microbatch sizes, the symbolic trace is the graph
    ``hj.trace`` and the staged search's microbatch traces give, field by field (a scanned,
    rematerialized stack's loop bodies too)."""
    m = zoo.get(name, size="tiny", batch=16, **overrides)
    g = hj.trace(m.step, *m.abstract())
    symbolic = symbolic_trace(g)
    assert any("dim_as_value" == e.primitive.name for e in symbolic.jaxpr.eqns) or \
        name != "gpt2"  # a mean loss: its B is computed from the dimension
    assert static_gathers(symbolic) == 0
    _same_graph(graph_at(symbolic, g, 16), g)
    for k in (2, 8):
        _same_graph(graph_at(symbolic, g, 16 // k, check=False), microbatch_graph(g, k))


def test_third_party_gpt2_traced_once_symbolically_is_its_traced_graph():
    """transformers' Flax GPT-2 (code we did not write)."""
    from tests.realmodels import families

    step, state, batch = families.build("gpt2", "tiny")
    g = hj.trace(step, state, batch)
    symbolic = symbolic_trace(g)
    B = batch_size(g)
    _same_graph(graph_at(symbolic, g, B), g)
    _same_graph(graph_at(symbolic, g, B // 2), microbatch_graph(g, 2))


def test_static_slices_of_a_symbolic_batch_are_gathers_and_another_graph():
    """transformers' Flax LLaMA slices its rotary halves (``x[..., :n]``): with a symbolic batch
    JAX gathers there, so the graph differs from the traced one (``graph_difference`` names
    where), and ``static_gathers`` says so (what keeps one symbolic trace from standing for
    LLaMA's two)."""
    from tests.realmodels import families

    step, state, batch = families.build("llama", "tiny")
    g = hj.trace(step, state, batch)
    symbolic = symbolic_trace(g)
    assert static_gathers(symbolic) > 0
    derived = graph_at(symbolic, g, batch_size(g))
    assert sum(n.name == "gather" for n in derived.nodes) > sum(n.name == "gather" for n in g.nodes)
    assert sum(n.name == "slice" for n in derived.nodes) < sum(n.name == "slice" for n in g.nodes)
    assert graph_difference(g, derived) == (f"{len(g.nodes)} / {len(derived.nodes)} nodes, "
                                            f"{len(g.values)} / {len(derived.values)} values")


def test_the_concrete_jaxpr_computes_the_step():
    """Run as it is, the jaxpr made concrete at the batch computes what the step does."""
    m = zoo.get("gpt2", size="tiny", batch=8)
    state, batch = m.init()
    g = hj.trace(m.step, state, batch)
    concrete = concretize(symbolic_trace(g), {"b": 8})
    got = jax.jit(jex_core.jaxpr_as_fun(concrete))(*jax.tree.leaves((state, batch)))
    want = jax.tree.leaves(jax.jit(m.step)(state, batch))
    assert_trees_close(list(got), want)


def test_evaluate_walks_parameters_and_leaves_the_rest():
    (b,) = export.symbolic_shape("b")
    dims = jax.lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,),
                                          start_index_map=(0,))
    params = {"shape": (b, 4), "sizes": [2 * b], "dims": dims, "fill": float("nan"),
              "name": "x", "nested": {"k": (b + 1,)}}
    out = evaluate(params, {"b": 3})
    assert out["shape"] == (3, 4) and out["sizes"] == [6] and out["nested"] == {"k": (4,)}
    assert out["dims"] is dims and out["name"] == "x" and np.isnan(out["fill"])
    assert all(type(d) is int for d in (*out["shape"], *out["sizes"]))


def test_a_size_the_trace_cannot_take_is_refused():
    """A size the step cannot have (a reshape's new size negative) is an
    ``UnsupportedStepError`` naming the sizes, not a jaxpr that fails later: the result is
    type-checked."""
    (b,) = export.symbolic_shape("b")
    symbolic = jax.make_jaxpr(lambda x: x.reshape(2, -1).sum())(
        jax.ShapeDtypeStruct((2 * b, 4), jnp.float32))
    assert concretize(symbolic, {"b": 3}).jaxpr.invars[0].aval.shape == (6, 4)
    with pytest.raises(UnsupportedStepError, match=r"concrete at \{'b': -1\}.*new_sizes"):
        concretize(symbolic, {"b": -1})
    unchecked = concretize(symbolic, {"b": -1}, check=False)  # the caller's risk
    assert unchecked.jaxpr.invars[0].aval.shape == (-2, 4)


def test_a_step_that_branches_on_the_batch_size_does_not_trace_symbolically():
    def step(w, x):
        y = x @ w
        return (y.sum() if x.shape[0] > 4 else y.mean()), w

    g = hj.trace(step, jnp.ones((4, 4)), jnp.ones((8, 4)))
    with pytest.raises(UnsupportedStepError, match="does not trace with a symbolic batch"):
        symbolic_trace(g)


def test_the_doc_example_is_the_concrete_trace_printed():
    """A mean loss's gradient traced with a symbolic batch, made concrete at 8, prints as the
    step traced at 8 (the mean's ``B`` a literal again)."""
    (b,) = export.symbolic_shape("b")
    def step(w, x):
        return jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w)))(w)

    w = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    sym = jax.make_jaxpr(step)(w, jax.ShapeDtypeStruct((b, 4), jnp.float32))
    at8 = concretize(sym, {"b": 8})
    assert [str(v.aval) for v in at8.jaxpr.invars] == ["float32[4,4]", "float32[8,4]"]
    assert str(at8) == str(jax.make_jaxpr(step)(w, jax.ShapeDtypeStruct((8, 4), jnp.float32)))


def test_static_gathers_counts_gathers_of_a_symbolic_shape_at_constant_indices():
    (b,) = export.symbolic_shape("b")
    def f(x):
        return x[:, :2] * 2

    assert static_gathers(jax.make_jaxpr(f)(jax.ShapeDtypeStruct((b, 4), jnp.float32))) == 1
    assert static_gathers(jax.make_jaxpr(f)(jax.ShapeDtypeStruct((8, 4), jnp.float32))) == 0
    # a lookup by data (an embedding) is a gather in both traces: not counted
    def lookup(table, ids):
        return table[ids]

    ids = jax.ShapeDtypeStruct((b, 3), jnp.int32)
    assert static_gathers(jax.make_jaxpr(lookup)(jax.ShapeDtypeStruct((10, 4), jnp.float32),
                                                 ids)) == 0


def test_symbolic_trace_benchmark_tells_same_operators_from_different_ones():
    """``benchmarks/symbolic_trace.py`` compares a step traced with a symbolic batch with the
    same step traced concretely: a mean loss is the same step (its ``1 / B`` folded on both
    sides), and slicing an array whose batch is symbolic is another (JAX gathers where the
    concrete trace slices: transformers' rotary embeddings)."""
    (b,) = export.symbolic_shape("b")
    w = jax.ShapeDtypeStruct((4, 4), jnp.float32)

    def traced(f, batch):
        jaxpr = jax.make_jaxpr(f)(w, jax.ShapeDtypeStruct((batch, 4), jnp.float32)).jaxpr
        return equations(jaxpr, {"b": 8}), {e.primitive.name for e in jaxpr.eqns}

    def mean_step(w, x):
        return jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)

    def sliced_step(w, x):
        return jax.grad(lambda w: jnp.mean((x @ w)[:, :2] ** 2))(w)

    (concrete, _), (symbolic, raw) = traced(mean_step, 8), traced(mean_step, b)
    assert concrete == symbolic and ("dot_general", ((8, 4),)) in concrete
    assert "dim_as_value" in raw  # the symbolic trace's 1 / B, folded
    assert "dim_as_value" not in {p for p, _ in symbolic}
    (concrete, _), (symbolic, _) = traced(sliced_step, 8), traced(sliced_step, b)
    assert concrete != symbolic
    assert "slice" in {p for p, _ in concrete} and "gather" in {p for p, _ in symbolic}
