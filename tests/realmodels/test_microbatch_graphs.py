"""The staged search's microbatch graphs of third-party model code (transformers' Flax GPT-2,
LLaMA, T5 and BERT), derived from the full and the first microbatch trace
(:func:`hulkjax.trace.microbatch.planning_graph`), are the traced graphs in every field planning
reads."""

import jax
import pytest

import hulkjax as hj
from hulkjax.trace.microbatch import microbatch_graph, planning_graph, scaled_graph
from tests.helpers import graph_record
from tests.realmodels import families


def _abstract(tree, scale=1):
    """Shapes and dtypes of ``tree``'s leaves, leading dimensions of arrays times ``scale``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        ((scale * x.shape[0],) + x.shape[1:]) if x.ndim else x.shape, x.dtype), tree)


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5", "bert"])
def test_derived_microbatch_graphs_of_library_models_equal_traced_ones(name):
    if not families.available(name):
        pytest.skip(f"{families.FAMILIES[name].library} is not installed")
    step, state, batch = families.build(name, "tiny")
    args = (_abstract(state), _abstract(batch, 2))  # batch 16: microbatches of 8, 4 and 2
    g = hj.trace(step, *args)
    first = microbatch_graph(g, 2)
    for M in (4, 8):
        derived = scaled_graph(g, first, 2, M)
        assert derived is not None, M  # every size these models have scales exactly
        traced = microbatch_graph(hj.trace(step, *args), M)
        assert graph_record(derived) == graph_record(traced), M
        assert planning_graph(g, M) is derived or \
            graph_record(planning_graph(g, M)) == graph_record(traced)
