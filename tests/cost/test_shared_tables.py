"""Speed-ups of the cost model's tables leave every number as it was."""

import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.cost import CostModel


def _record(loc) -> tuple:
    # Dict orders too: sums over them (memory by kind, the liveness walk) follow them.
    return (loc.specs, list(loc.specs), loc.res, list(loc.res), loc.time, loc.compute, loc.comms,
            loc.memory, loc.memory_parts, loc.program_comms, loc.node_compute, loc.node_comms,
            list(loc.node_comms), loc.moves, loc.memory_uses)


@pytest.mark.parametrize("name,overrides,topology", [
    ("gpt2", {}, hj.Topology.preset("dgx-h100", nodes=2, gpus_per_node=4)),
    ("gpt2", {"scan_layers": True}, hj.Topology.grid((2, 4), ("data", "model"))),
    ("llama", {}, hj.Topology.preset("hetero")),
    ("moe", {}, hj.Topology.grid((2, 4), ("data", "model")))])
def test_repeated_layers_share_tables_equal_to_their_own(name, overrides, topology):
    """Groups of one table class (repeated layers) share one table, renamed to their ids: it
    equals the table each group builds on its own, for every candidate."""
    m = zoo.get(name, size="tiny", **overrides)
    cm = CostModel(hj.trace(m.step, *m.abstract()), topology)
    shared = [g.id for g in cm.groups if cm.table_rep[g.id] != g.id]
    if not overrides:
        assert shared  # the tiny models repeat their layers
    g = cm.graph
    for grp in cm.groups:
        for c in range(len(grp.candidates)):
            own = cm._build_local(grp.id, c)
            assert _record(cm.local(grp.id, c)) == _record(own), (grp.id, c)
            # The accessors that read the shared table without renaming it.
            assert (cm.table(grp.id, c).time, cm.table(grp.id, c).memory) == (own.time, own.memory)
            for v, s in own.specs.items():
                assert cm.spec(grp.id, c, v) == s
            for nid, r in own.res.items():
                assert cm.resolution(grp.id, c, nid) == r
                assert all(cm.required(grp.id, c, nid, k) == r.in_specs[k]
                           for k in range(len(g.nodes[nid].inputs)))


def test_shared_tables_keep_reductions_distinct_per_operator():
    """The liveness walk tells deferred gradient reductions apart by identity: groups sharing a
    table get their own objects."""
    m = zoo.get("gpt2", size="tiny")
    topo = hj.Topology.grid((8,), ("d",))
    cm = CostModel(hj.trace(m.step, *m.abstract()), topo)
    p = hj.plan(m.step, *m.abstract(), topology=topo, strategy="dp")
    seen = {}
    for gid, c in enumerate(p.assignment):
        for nid, comms in cm.local(gid, c).node_comms.items():
            for x in comms:
                if x.deferred:
                    assert seen.setdefault(id(x), nid) == nid
    assert seen


def test_edge_matrices_of_repeated_layers_are_shared_and_equal_to_their_own(monkeypatch):
    """Edges between repeated layers share one matrix (cached under the table classes' ids): it
    equals the matrix each edge computes on its own."""
    import numpy as np

    m = zoo.get("gpt2", size="tiny")
    g = hj.trace(m.step, *m.abstract())
    topo = hj.Topology.grid((2, 4), ("data", "model"))
    shared, own = CostModel(g, topo), CostModel(g, topo)
    monkeypatch.setattr(own, "_edge_key", lambda *a: None)
    edges = [e for e, _ in shared.edge_items()]
    for gp, gc in edges:
        assert np.array_equal(shared.edge_matrix(gp, gc), own.edge_matrix(gp, gc))
    assert len(shared._matrix_cache) < len(edges)  # some were shared
