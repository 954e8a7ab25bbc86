"""The staged search's shortcuts give what the plain computations give: equivalent chains of
device groups share one dynamic program, and the interleaved dynamic program solves every
bottleneck bound at once as it solved them one by one."""

import itertools
import math

import numpy as np
import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.cost.pipeline import stage_link
from hulkjax.plan.stages import schedule_in_flight
from hulkjax.strategies import stages
from hulkjax.strategies.ilp import solve
from hulkjax.strategies.stages import (
    INTRA_PLANS,
    _chain_signature,
    _context,
    _dp,
    _dp_interleaved,
    _dp_once,
    _range_costs,
    chains,
    group_topology,
)

FOUR_NODES = hj.Topology.preset("dgx-h100", nodes=4, gpus_per_node=2)
HETERO = hj.Topology.preset("hetero")


def _setup(topology, M=2):
    m = zoo.get("gpt2", size="tiny")
    g = hj.trace(m.step, *m.abstract())
    ctx = _context(g, topology)
    ctx.solver = solve
    groups = topology.groups("node")
    subs = [group_topology(topology, grp) for grp in groups]
    tables = {sub: [t for n in INTRA_PLANS if (t := ctx.table(M, sub, n)) is not None]
              for sub in dict.fromkeys(subs)}
    return ctx, groups, subs, tables


def _dp_interleaved_reference(ctx, topology, groups, subs, chain, tables, M, v):
    """:func:`stages._dp_interleaved` as it was: one bottleneck bound at a time."""
    U = len(ctx.part.units)
    S = len(chain)
    P = S * v
    inflight = schedule_in_flight("interleaved", S, v, M)
    W, Z, A, cuts = [], [], [], []
    for p in range(P):
        gi = chain[p % S]
        w, z, a = _range_costs(tables[subs[gi]], U, inflight[p], 1.0 / v)
        W.append(w)
        with np.errstate(invalid="ignore"):
            Z.append(np.where(np.isfinite(w), w / v + (z - w), np.inf))
        A.append(a)
        best_t = min(tables[subs[gi]], key=lambda t: t.f.sum() + t.b.sum())
        cuts.append((best_t.cut_f, best_t.cut_b, best_t.devices))
    finite = np.concatenate([w[np.isfinite(w)] for w in W])
    if finite.size == 0:
        return None
    links = []
    for p in range(1, P):
        a, b = chain[(p - 1) % S], chain[p % S]
        link = stage_link(topology, groups[a], groups[b])
        cf, cb, nd = cuts[p]
        spread = max(1.0, nd / len(groups[a]))
        links.append((np.where(cf > 0, link.latency + cf * spread / link.bandwidth, 0.0),
                      np.where(cb > 0, link.latency + cb * spread / link.bandwidth, 0.0)))
    lo, hi = float(finite.min()) * v, float(finite.max()) * v
    taus = [lo]
    while taus[-1] < hi:
        taus.append(taus[-1] * 1.1)
    best_val, best_sol = math.inf, None
    for tau in taus:
        cap = tau / v
        best = np.where(W[0][0, :] <= cap, Z[0][0, :], np.inf)
        args = []
        for p in range(1, P):
            lf, lb = links[p - 1]
            inc = np.where((lf <= cap) & (lb <= cap), best + lf + lb, np.inf)
            cand = inc[:, None] + np.where(W[p] <= cap, Z[p], np.inf)
            j = np.argmin(cand, axis=0)
            best = cand[j, np.arange(U + 1)]
            args.append(j)
        if not np.isfinite(best[U]):
            continue
        ends = [U]
        for j in reversed(args):
            ends.append(int(j[ends[-1]]))
        bounds = [0] + list(reversed(ends))
        picks = [(p, bounds[p], bounds[p + 1]) for p in range(P)]
        w_group = [0.0] * S
        for p, a, b in picks:
            w_group[p % S] += W[p][a, b]
        load = {}
        fill = 0.0
        for p, a, _ in picks[1:]:
            lf, lb = links[p - 1][0][a], links[p - 1][1][a]
            fill += lf + lb
            load.setdefault(((p - 1) % S, p % S), [0.0, 0.0])[0] += lf
            load.setdefault((p % S, (p - 1) % S), [0.0, 0.0])[1] += lb
        u_group = [0.0] * S  # the slowest group's updates, as pipeline_cost charges them
        for p, a, b in picks:
            u_group[p % S] += float(Z[p][a, b]) - W[p][a, b] / v
        t = ((sum(w_group) - max(w_group)) / v + max(w_group) + fill + max(u_group)
             + (M - 1) * max([max(w_group)] + [max(x) for x in load.values()]))
        if t < best_val:
            best_val = t
            plans = [tables[subs[chain[p % S]]][A[p][a, b]].name for p, a, b in picks]
            best_sol = ([chain[p % S] for p, _, _ in picks], [(a, b) for _, a, b in picks],
                        plans, t)
    return best_sol


@pytest.mark.parametrize("topology", [FOUR_NODES, HETERO])
def test_the_interleaved_dynamic_program_solves_every_bound_as_one_at_a_time(topology):
    ctx, groups, subs, tables = _setup(topology, M=4)
    G = len(groups)
    done = 0
    for chain in itertools.permutations(range(G)):
        for S in range(2, G + 1):
            for v in (2, 4):
                if S * v > len(ctx.part.units) or 4 % S:
                    continue
                got = _dp_interleaved(ctx, topology, groups, subs, chain[:S], tables, 4, v)
                ref = _dp_interleaved_reference(ctx, topology, groups, subs, chain[:S],
                                                tables, 4, v)
                assert got == ref  # the same floats: the same arithmetic per bound
                done += got is not None
    assert done > 0


@pytest.mark.parametrize("topology", [FOUR_NODES, HETERO])
def test_equivalent_chains_share_one_dynamic_program(topology):
    """Solved once per signature, every chain gets what its own dynamic program gives."""
    ctx, groups, subs, tables = _setup(topology)
    G = len(groups)
    solved = {}
    orders = list(itertools.permutations(range(G)))[:12] + chains(topology, groups)
    for chain in orders:
        assert _dp_once(solved, _dp, ctx, topology, groups, subs, chain, tables, 2) == \
            _dp(ctx, topology, groups, subs, chain, tables, 2)
        for S in range(2, G + 1):
            if 2 % S == 0 and 2 * S <= len(ctx.part.units):
                assert _dp_once(solved, _dp_interleaved, ctx, topology, groups, subs,
                                chain[:S], tables, 2, 2) == \
                    _dp_interleaved(ctx, topology, groups, subs, chain[:S], tables, 2, 2)
    if topology is FOUR_NODES:  # uniform nodes: far fewer programs than chains
        assert len({k[3] for k in solved}) < len(orders)
        assert _chain_signature(topology, groups, subs, (0, 1, 2, 3)) != \
            _chain_signature(topology, groups, subs, (0, 1, 2))


def test_the_pipeline_baseline_is_costed_only_where_its_floor_allows(monkeypatch):
    """``best_staged`` costs the ``pipeline`` baseline after the search, and not where its
    floor is at least the cutoff; with every floor and bound at zero, the plan is the same."""
    m = zoo.get("gpt2", size="tiny")
    state, batch = m.abstract()
    out = {}
    for label in ("pruned", "full"):
        if label == "full":
            monkeypatch.setattr(stages, "staged_lower_bound", lambda *a, **k: 0.0)
            monkeypatch.setattr(stages, "_pipeline_floor", lambda *a, **k: 0.0)
        g = hj.trace(m.step, state, batch)
        plan = hj.plan(m.step, state, batch, topology=FOUR_NODES, strategy="auto", graph=g)
        out[label] = ([t.spec for t in plan.inputs], plan.stages, plan.microbatches,
                      plan.assignment, plan.cost.step_time, plan.cost.peak_memory)
    assert out["pruned"] == out["full"]
