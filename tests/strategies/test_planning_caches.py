"""Caches that make planning faster return what the uncached computations return (issue 14,
item 1): a stale or mis-keyed cache entry fails here."""

import random

import jax
import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.strategies import layouts
from hulkjax.strategies.layouts import InputLayouts, tensor_parallel

# Model axes whose sizes divide different dimensions: llama tiny's two key/value heads divide 2
# but not 4 or 8, so the column-split walks answer differently per axis size.
TOPOLOGIES = (hj.Topology.grid((8,), ("model",)), hj.Topology.grid((2,), ("model",)),
              hj.Topology.grid((2, 4), ("data", "model")), hj.Topology.grid((4, 2), ("a", "b")))
MODELS = (("gpt2", {"size": "tiny"}), ("llama", {"size": "tiny"}), ("moe", {"size": "tiny"}))


def _layouts(graph, topology, axes, vocab_parallel=False):
    sb = InputLayouts(graph, topology)
    tensor_parallel(sb, axes, vocab_parallel=vocab_parallel)
    return sb.input_specs, sb.notes


def _cases(topology):
    names = tuple(topology.axis_names)
    return [names] + [(a,) for a in names if len(names) > 1]


@pytest.mark.parametrize("name,overrides", MODELS)
def test_column_split_answers_shared_across_layouts_are_the_uncached_ones(name, overrides):
    """``tensor_parallel`` keeps its column-split walks with the graph and reuses them for other
    model axes of the same sizes: every layout (and note) equals the one a fresh graph gives, in
    any order of topologies and axes, and every kept answer equals a fresh walk's."""
    m = zoo.get(name, **overrides)
    args = m.abstract()
    shared = hj.trace(m.step, *args)
    for vocab_parallel in (False, True):
        for topology in TOPOLOGIES + tuple(reversed(TOPOLOGIES)):
            for axes in _cases(topology):
                fresh = hj.trace(m.step, *args)
                assert _layouts(shared, topology, axes, vocab_parallel) == \
                    _layouts(fresh, topology, axes, vocab_parallel), (topology, axes)
    kept = shared.memo["column_split_rejections"]
    assert {key[2] for key in kept} == {(2,), (4,), (8,), (2, 4)}
    assert any(r is None for r in kept.values()) and any(r is not None for r in kept.values())


def test_column_split_cache_key_holds_what_the_walk_reads(monkeypatch):
    """The cached answer for a key is the walk's answer for that key (recomputed without the
    cache), and a second layout on the same graph walks nothing new."""
    m = zoo.get("llama", size="tiny")
    g = hj.trace(m.step, *m.abstract())
    topo = hj.Topology.grid((2, 4), ("data", "model"))
    walks = []
    real = layouts._column_split_rejection

    def spy(*a, **k):
        walks.append(a[1:3])
        return real(*a, **k)

    monkeypatch.setattr(layouts, "_column_split_rejection", spy)
    first = _layouts(g, topo, ("model",))
    n = len(walks)
    assert n > 0
    again = _layouts(g, hj.Topology.grid((4,), ("model",)), ("model",))  # same size
    assert len(walks) == n and first[0] == again[0]
    monkeypatch.setattr(layouts, "_column_split_rejection", real)
    sb = InputLayouts(g, topo)
    divisible = lambda size: bool(sb.axes_for(size, ("model",)))  # noqa: E731
    origin = _origin(g)
    for (start, dim, divides, vp), answer in g.memo["column_split_rejections"].items():
        assert divides == (4,)
        assert answer == real(g, start, dim, origin, divisible, vocab_parallel=vp)


def _origin(g):
    """The parameters and their views, as ``tensor_parallel`` collects them."""
    return layouts._parameter_views(g)


def test_axes_for_cache_is_the_subset_search():
    topo = hj.Topology.grid((2, 3, 4), ("a", "b", "c"))
    sb = InputLayouts(hj.trace(lambda x: x * 2, jax.ShapeDtypeStruct((4,), "float32")), topo)
    for size in range(1, 50):
        for axes in (("a",), ("a", "b"), ("c", "a"), ("a", "b", "c")):
            for _ in range(2):  # the second answer comes from the cache
                assert sb.axes_for(size, axes) == sb._largest_dividing(size, axes)


def _gpt2_cost_models():
    from hulkjax.cost.model import CostModel

    m = zoo.get("gpt2", size="tiny", n_layers=3)
    topo = hj.Topology.grid((2, 4), ("data", "model"))

    def fresh():
        return CostModel(hj.trace(m.step, *m.abstract()), topo)

    return fresh


def _assignments(cm, n=6):
    import random

    from hulkjax.strategies.baselines import baseline_assignments

    rng = random.Random(0)
    out = list(baseline_assignments(cm.graph, cm.topology).values())
    for _ in range(n):
        out.append([rng.randrange(len(grp.candidates)) for grp in cm.groups])
    return out


def test_edge_times_shared_by_repeated_layers_are_each_edges_own():
    """Edges between repeated layers share one time per (edge class, candidates): every edge's
    time, in any order of asking, equals a sum over its own layout changes."""
    fresh = _gpt2_cost_models()
    cm = fresh()
    edges = [e for e, _ in cm.edge_items()]
    shared = [e for e in edges if cm.edge_class(*e) is not None]
    classes = {cm.edge_class(*e) for e in shared}
    assert len(classes) < len(shared)  # repeated layers' edges do share
    for a in _assignments(cm, 3):
        for gp, gc in reversed(edges):
            t = cm.edge_time(gp, a[gp], gc, a[gc])
            assert t == sum(cm.comm_time(c) for c in cm.edge_comms(gp, a[gp], gc, a[gc]))
    other = fresh()
    for a in _assignments(other, 3):
        assert other.objective(a) == cm.objective(a)
        for gp, gc in edges:
            assert other.edge_matrix(gp, gc).tolist() == cm.edge_matrix(gp, gc).tolist()


def test_kept_breakdowns_equal_fresh_ones_and_are_not_changed_by_callers():
    fresh = _gpt2_cost_models()
    cm = fresh()
    assignments = _assignments(cm) * 2  # asked twice: the second time from the kept parts
    for a in assignments:
        b = cm.breakdown(a, memory=False)
        b.moves.append("changed by a caller")
        b.specs.clear()
        b.own.clear()
        b.compute[:] = []
    # What fresh cost models say (each answer from a model that was asked nothing before), once
    # per assignment: the second copy of each is asked of ``cm`` only.
    wants = {}
    for a in assignments:
        if tuple(a) not in wants:
            wants[tuple(a)] = (fresh().breakdown(a), fresh().peak_memory(a), fresh().evaluate(a))
    for a in assignments:
        got, (want, peak, evaluated) = cm.breakdown(a), wants[tuple(a)]
        assert (got.assignment, got.specs, got.compute, got.own, got.moves) == \
            (want.assignment, want.specs, want.compute, want.own, want.moves)
        assert [(u.node, u.group, u.kind, u.bytes) for u in got.memory] == \
            [(u.node, u.group, u.kind, u.bytes) for u in want.memory]
        assert cm.peak_memory(a) == peak
        assert cm.evaluate(a) == evaluated


def _fixed_layouts(graph, topology):
    """Every baseline's fixed input layouts, as ``SpecBuilder.assignment`` hands them to
    ``propagate``: ``{baseline: (fixed, param_use, gather_axes)}``."""
    from hulkjax.strategies.baselines import LAYOUTS
    from hulkjax.strategies.realize import assignment_for_inputs, cost_model

    cm = cost_model(graph, topology)
    out = {}
    for name, make in LAYOUTS.items():
        try:
            sb = make(graph, topology)
        except hj.errors.StrategyNotApplicableError:
            continue
        for opt, param in graph.owners.items():
            if graph.values[graph.inputs[opt]].shape == graph.values[graph.inputs[param]].shape:
                sb.input_specs[opt] = sb.input_specs[param]
        out[name] = (assignment_for_inputs(cm, sb.input_specs), sb.param_use, sb.gather_axes)
    return out


@pytest.mark.parametrize("name,overrides,topology", [
    ("gpt2", {"size": "tiny", "n_layers": 4}, hj.Topology.grid((2, 4), ("data", "model"))),
    ("llama", {"size": "tiny", "n_layers": 4}, hj.Topology.preset("dgx-h100", nodes=2,
                                                                  gpus_per_node=4)),
    ("moe", {"size": "tiny"}, hj.Topology.grid((4, 2), ("a", "b"))),
    ("bert", {"size": "tiny"}, hj.Topology.grid((8,), ("model",))),
])
def test_propagation_decides_repeated_layers_once_as_it_decides_each(name, overrides, topology):
    """``propagate`` takes a repeated layer's decision from an earlier group with the same
    decision key (table class, arriving layouts, neighbours' edges and candidates): for every
    baseline's layouts it completes the assignment that deciding every group on its own gives,
    and it does reuse decisions."""
    from hulkjax.strategies import search
    from hulkjax.strategies.realize import cost_model

    m = zoo.get(name, **overrides)
    g = hj.trace(m.step, *m.abstract())
    cm = cost_model(g, topology)
    calls = []
    real = cm.operand_changes_of
    cm.operand_changes_of = lambda *a, **k: calls.append(a[0]) or real(*a, **k)
    # Every baseline's layouts, and random input layouts (layers then differ in what arrives
    # and in their neighbours' candidates: a key that misses either decides wrongly).
    rng = random.Random(0)
    inputs = [grp for grp in cm.groups if grp.kind == "input"]
    cases = dict(_fixed_layouts(g, topology))
    for k in range(16):
        share = rng.random()
        fixed = {grp.id: rng.randrange(len(grp.candidates)) for grp in inputs
                 if rng.random() < share}
        cases[f"random {k}"] = (fixed, rng.choice(["keep", "gather"]), None)
    for baseline, (fixed, param_use, gather_axes) in cases.items():
        calls.clear()
        shared = search.propagate(cm, fixed, param_use=param_use, gather_axes=gather_axes)
        reused = len(calls)
        calls.clear()
        own = search._propagate(cm, fixed, param_use=param_use, gather_axes=gather_axes,
                                share=False)
        assert shared == own, baseline
        if not baseline.startswith("random"):
            assert reused < len(calls), baseline
