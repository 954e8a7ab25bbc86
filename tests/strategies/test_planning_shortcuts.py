"""The shortcuts that make planning faster compute what the plain computations compute, to the
last bit (issue 14, item 1): descent that skips groups nothing changed around, every candidate's
shared-change times at once, edge matrices and class times read off tables once, the network's
candidate scores a block of groups at a time, a stage's nodes in one walk, reading times of
an item's layouts as one memoized matrix (edge matrices and the ILP's shared changes)."""

import random

import numpy as np
import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.cost.model import CostModel
from hulkjax.strategies import search
from hulkjax.strategies.baselines import baseline_assignments

TOPOLOGIES = (hj.Topology.grid((2, 4), ("data", "model")),
              hj.Topology.preset("dgx-h100", nodes=2, gpus_per_node=4))


def _model(topology, name="gpt2"):
    m = zoo.get(name, size="tiny", n_layers=3)
    return CostModel(hj.trace(m.step, *m.abstract()), topology)


def _assignments(cm, n=4):
    rng = random.Random(0)
    out = list(baseline_assignments(cm.graph, cm.topology).values())
    out += [[rng.randrange(len(g.candidates)) for g in cm.groups] for _ in range(n)]
    return out


def _plain_descent(cm, assignment, free, *, sweeps=4, candidates=None):
    """coordinate_descent as it was: every free group evaluated in every sweep."""
    nb = search.neighbours(cm)
    a = list(assignment)
    for _ in range(sweeps):
        changed = False
        for gid in free:
            options = (candidates or {}).get(gid) or range(len(cm.groups[gid].candidates))
            best_c = search.best_option(cm, nb, gid, a, options)
            if best_c != a[gid]:
                a[gid] = best_c
                changed = True
        if not changed:
            break
    return a


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_descent_skipping_unchanged_groups_makes_the_same_moves(topology, name):
    cm = _model(topology, name)
    free = [g.id for g in cm.groups if len(g.candidates) > 1]
    for sweeps in (1, 4):
        for a in _assignments(cm):
            assert search.coordinate_descent(cm, a, free, sweeps=sweeps) == \
                _plain_descent(cm, a, free, sweeps=sweeps)
    rng = random.Random(1)
    shortlist = {g: sorted(rng.sample(range(len(cm.groups[g].candidates)),
                                      min(3, len(cm.groups[g].candidates)))) for g in free}
    for a in _assignments(cm, 2):
        assert search.coordinate_descent(cm, a, free, candidates=shortlist) == \
            _plain_descent(cm, a, free, candidates=shortlist)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_shared_times_are_each_candidates_shared_time(topology):
    cm = _model(topology)
    keys = {k for ks in cm.shared_of_group.values() for k in ks}
    assert keys
    for a in _assignments(cm, 2):
        for gid, ks in cm.shared_of_group.items():
            cands = list(range(len(cm.groups[gid].candidates)))
            for key in ks:
                assert cm.shared_times(key, a, gid, cands) == \
                    [cm.shared_time(key, a, gid, c) for c in cands]
                assert set(cm.shared_groups(key)) >= {gid}


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_edge_matrix_entries_are_the_edges_readings(topology):
    """Every entry of an edge matrix (subsets of candidates, either order) is the sum of its
    readings' layout changes, as :meth:`CostModel.edge_time` prices the edge."""
    cm = _model(topology)
    rng = random.Random(2)
    for (gp, gc), _ in list(cm.edge_items())[::3]:
        cps = rng.sample(range(len(cm.groups[gp].candidates)),
                         min(4, len(cm.groups[gp].candidates)))
        ccs = rng.sample(range(len(cm.groups[gc].candidates)),
                         min(4, len(cm.groups[gc].candidates)))
        for shared in (True, False):
            m = cm.edge_matrix(gp, gc, cps, ccs, shared=shared)
            for i, cp in enumerate(cps):
                for j, cc in enumerate(ccs):
                    assert m[i, j] == pytest.approx(
                        cm.edge_time(gp, cp, gc, cc, shared=shared), rel=1e-12, abs=0)


def test_class_times_add_the_groups_times_in_order():
    from hulkjax.strategies.ilp import _class_times

    cm = _model(TOPOLOGIES[0])
    view = cm.by_programs([n.backward for n in cm.graph.nodes], {False: 3, True: 2})
    groups = [g.id for g in cm.groups if len(g.candidates) > 1]
    for model in (cm, view):
        for gids in (groups[:1], groups[::5], groups):
            keep = list(range(min(len(cm.groups[g].candidates) for g in gids)))
            want = np.array([sum(model.table_time(g, k) for g in gids) for k in keep])
            assert _class_times(model, gids, keep).tolist() == want.tolist()


def test_network_scores_by_blocks_are_the_whole_arrays(monkeypatch):
    from hulkjax.gnn import features, infer
    from hulkjax.gnn.weights import load
    from hulkjax.strategies.realize import cost_model

    loaded = load(None)
    if loaded is None:
        pytest.skip("no shipped weights")
    cm = cost_model(hj.trace(*_step()), TOPOLOGIES[0])
    jg = features.build(cm)
    whole = infer.log_probs(loaded.params, jg, layers=loaded.layers)
    for block in (1, 7, 1000):  # elements per block: one group, a few, several
        monkeypatch.setattr(infer, "_BLOCK_ELEMENTS", block)
        assert np.array_equal(infer.log_probs(loaded.params, jg, layers=loaded.layers), whole)


def _step():
    m = zoo.get("gpt2", size="tiny", n_layers=3)
    return (m.step, *m.abstract())


def test_stage_nodes_are_each_stage_and_phases_nodes():
    from hulkjax.strategies.partition import partition

    part = partition(hj.trace(*_step()))
    units = len(part.units)
    for stages in (1, 2, 3):
        stage_of_unit = [min(u * stages // units, stages - 1) for u in range(units)]
        by = part.stage_nodes(stage_of_unit)
        for k in range(stages):
            for phase in ("F", "B", "U"):
                # one stage and phase's nodes in program order, a walk of its own
                plain = tuple(n.id for n in part.graph.nodes if part.phase[n.id] == phase
                              and stage_of_unit[part.unit[n.id]] == k)
                assert by.get((k, phase), ()) == plain


def _plain_edge_matrix(cm, gp, gc, cps, ccs, shared):
    """CostModel.edge_matrix as it was: every item's (source, target) pair priced with
    reading_time one by one, items added in order; then each merge it prices, pair by pair."""
    m = np.zeros((len(cps), len(ccs)))
    items = (cm._edges if shared else cm._pair_edges).get((gp, gc), ())
    for v, nid, k in items:
        t = np.zeros((len(cps), len(ccs)))
        for i, cp in enumerate(cps):
            s = cm.spec(gp, cp, v)
            for j, cc in enumerate(ccs):
                d = cm.required(gc, cc, nid, k)
                if s is not None and d is not None and s != d:
                    t[i, j] = cm.reading_time(v, s, d, nid)
        m += t
    credit = np.zeros((len(cps), len(ccs)))  # the merges of partial sums it prices (GPU)
    for site in cm.sum_sites().get((gp, gc), ()):
        for i, cp in enumerate(cps):
            for j, cc in enumerate(ccs):
                merged = cm.sum_credit(site, cp, cc)
                if merged is not None:
                    credit[i, j] += cm.comm_time(merged)
    return m - credit if cm.sum_sites().get((gp, gc)) else m


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_reading_matrices_are_the_pairs_reading_times(topology):
    """The memoized reading matrices (what edge matrices and the ILP's shared changes read)
    hold each pair's reading time, bit for bit, in a program view too, and the edge matrices
    built on them are the pair-by-pair sums."""
    cm = _model(topology)
    view = cm.by_programs([n.backward for n in cm.graph.nodes], {False: 3, True: 2})
    rng = random.Random(3)
    for model in (cm, view):
        for (gp, gc), items in list(model.edge_items())[::4]:
            cps = rng.sample(range(len(model.groups[gp].candidates)),
                             min(5, len(model.groups[gp].candidates)))
            ccs = rng.sample(range(len(model.groups[gc].candidates)),
                             min(5, len(model.groups[gc].candidates)))
            for v, nid, k in items:
                us = list(dict.fromkeys(model.spec(gp, c, v) for c in cps))
                ud = list(dict.fromkeys(model.required(gc, c, nid, k) for c in ccs))
                t = model.reading_matrix(v, nid, us, ud)
                assert model.reading_matrix(v, nid, us, ud) is t  # memoized
                for i, s in enumerate(us):
                    for j, d in enumerate(ud):
                        want = 0.0 if s is None or d is None or s == d else \
                            model.reading_time(v, s, d, nid)
                        assert t[i, j] == want
            for shared in (True, False):
                got = model.edge_matrix(gp, gc, cps, ccs, shared=shared)
                assert got.tolist() == _plain_edge_matrix(model, gp, gc, cps, ccs,
                                                          shared).tolist()


def _plain_value_terms(cm, v, a, srcs, dsts, nids):
    """strategies.ilp._value_terms as it was: reading_time per (source, reader, target)."""
    from collections import defaultdict

    from hulkjax.strategies.ilp import _need_terms, _positions

    out = []
    src_pos = _positions(srcs)
    dst_pos = [(b, nid, _positions(d)) for (b, _, d), nid in zip(dsts, nids)]
    for s, S in src_pos.items():
        if s is None:
            continue
        need = defaultdict(list)
        for b, nid, pos in dst_pos:
            for d, D in pos.items():
                if d is not None and d != s:
                    w = cm.reading_time(v, s, d, nid)
                    if w > 0:
                        need[d].append((b, D, w))
        _need_terms(a, S, need, out)
    return out


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("tie_layers", [True, False])
def test_ilp_programs_from_reading_matrices_are_the_plain_ones(monkeypatch, topology,
                                                               tie_layers):
    """The integer program built with the memoized reading matrices (edge matrices and shared
    changes), one edge matrix per edge class and shared values' terms looked up by table class
    is the program built pair by pair, edge by edge, value by value: the same variables, costs
    and rows, bit for bit, for a plain cost model and a program view."""
    from hulkjax.strategies import ilp

    def program(model):
        seeds = list(baseline_assignments(model.graph, model.topology).values())
        p = ilp._Program(model, seeds, tie_layers=tie_layers, restrict=None,
                         max_candidates=256)
        return (p.n, p.n_x, p.n_rows, p.cost.tolist(), p.matrix.data.tolist(),
                p.matrix.indices.tolist(), p.matrix.indptr.tolist(),
                p.row_lo.tolist(), p.row_hi_wo_memory.tolist(), p.trivial_bound)

    def models():
        cm = _model(topology, "llama")
        return cm, cm.by_programs([n.backward for n in cm.graph.nodes], {False: 3, True: 2})

    fast = [program(m) for m in models()]
    monkeypatch.setattr(ilp, "_value_terms", _plain_value_terms)
    monkeypatch.setattr(CostModel, "edge_matrix",
                        lambda self, gp, gc, cps=None, ccs=None, *, shared=True:
                        _plain_edge_matrix(self, gp, gc, list(cps), list(ccs), shared))
    # (every edge's matrix fetched, none reused for the edges of its class)
    monkeypatch.setattr(CostModel, "edge_class", lambda self, gp, gc, shared=True: None)
    # (every shared value's terms keyed by its layouts: no two values share a table-class key)
    monkeypatch.setattr(CostModel, "table_ids", lambda self, gid: None)
    assert [program(m) for m in models()] == fast


@pytest.mark.parametrize("tie_layers", [True, False])
def test_shared_change_rows_laid_out_at_once_are_the_row_by_row_ones(tie_layers):
    """The ILP's shared-change rows, laid out in one go, are the rows made one at a time: for
    each change, ``t + (the first reading) - (another) >= 0`` per other reading."""
    import scipy.sparse as sp

    from hulkjax.strategies import ilp

    cm = _model(TOPOLOGIES[1], "llama")
    seeds = list(baseline_assignments(cm.graph, cm.topology).values())
    for aggregate in (True, False):
        p = ilp._Program(cm, seeds, tie_layers=tie_layers, restrict=None, max_candidates=256,
                         aggregate=aggregate)
        rows, cols, vals, r = [], [], [], 0
        for z, readings in p.z_rows:  # as it was built, row by row
            first = readings[0] if p.excess else np.zeros(0, dtype=np.int64)
            for c in readings[1:] if p.excess else readings:
                rows += [np.full(1 + len(first) + len(c), r)]
                cols += [np.concatenate([[z], first, c])]
                vals += [np.concatenate([[1.0], np.ones(len(first)), -np.ones(len(c))])]
                r += 1
        assert r > 0
        want = sp.csr_array((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                            shape=(r, p.n))
        got = sp.csr_array(p.matrix)[p.n_rows - 1 - r:p.n_rows - 1]
        assert (got != want).nnz == 0
        assert np.isinf(p.row_hi_wo_memory[-r:]).all() and (p.row_lo[-1 - r:-1] == 0).all()
