"""How the staged search ranks the layouts its dynamic programs find, and what those programs
charge once per step: held against the exact pipeline cost on a step with a tied embedding
(GPT-2: the first stage holds it, the last stage's LM head reads it, its gradient goes back) on
clusters whose links differ pair by pair."""

import itertools
import math

import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.strategies import stages as S
from hulkjax.topology.model import Device, PairLink, Topology
from hulkjax.topology.specs import DEVICE_SPECS, LinkSpec


def _gbit(x: float, ms: float = 1.0) -> LinkSpec:
    return LinkSpec(bandwidth=x * 1e9 / 8, latency=ms / 1e3)


def _sites(kinds, links: dict[tuple[int, int], LinkSpec], gpus: int = 2) -> Topology:
    """Sites ``r0, r1, ...`` of ``gpus`` devices of each kind, with a link per pair."""
    devices = tuple(Device(id=r * gpus + k, spec=DEVICE_SPECS[kind], region=f"r{r}",
                           node=f"r{r}-n0") for r, kind in enumerate(kinds) for k in range(gpus))
    return Topology(name="sites", devices=devices, axis_names=("region", "gpu"),
                    shape=(len(kinds), gpus), node_link=LinkSpec(bandwidth=150e9, latency=1e-6),
                    wan_link=_gbit(1.0, 50.0),
                    links=tuple(PairLink(between=(f"r{a}", f"r{b}"), link=ln)
                                for (a, b), ln in links.items()))


def _gpt2(**kw):
    m = zoo.get("gpt2", size="tiny", n_layers=4, batch=16, **kw)
    return hj.trace(m.step, *m.abstract())


# Four sites, the first and the last joined by a slow link, the others by fast ones.
FOUR = _sites(["A100", "V100", "A100", "V100"],
              {(0, 1): _gbit(25), (0, 2): _gbit(10), (0, 3): _gbit(0.05, 30),
               (1, 2): _gbit(25), (1, 3): _gbit(2, 10), (2, 3): _gbit(25)})


def _layouts(ctx, topo):
    """Staged layouts of every kind the search makes: 2-4 stages in several orders, 1F1B at
    1, 2 and 4 microbatches, GPipe, and the interleaved schedule."""
    groups = S.device_groups(topo)["region"]
    U = len(ctx.part.units)
    out = []
    for n in (2, 3, 4):
        for order in itertools.islice(itertools.permutations(range(4), n), 0, None, 5):
            for M in (1, 2, 4):
                out.append(S.StagedLayout(groups=tuple(groups[k] for k in order),
                                          ranges=tuple(S.uniform_ranges(ctx.part, n)),
                                          plans=("fsdp", "dp_tp", "ilp", "fsdp")[:n],
                                          microbatches=M))
    out.append(S.StagedLayout(groups=(groups[0], groups[1]), ranges=((0, U // 2), (U // 2, U)),
                              plans=("dp_tp", "fsdp"), microbatches=4, schedule="gpipe"))
    chunks = tuple(S.uniform_ranges(ctx.part, 4))
    out.append(S.StagedLayout(groups=(groups[2], groups[1]) * 2, ranges=chunks,
                              plans=("fsdp",) * 4, microbatches=4, schedule="interleaved",
                              virtual_stages=2))
    return out


def _tables(ctx, topo, layouts):
    from hulkjax.strategies.ilp import solve

    ctx.solver = solve
    for lay in layouts:
        for devs, name in zip(lay.groups, lay.plans):
            ctx.table(lay.microbatches, S.group_topology(topo, devs), name)


def test_the_ranking_is_the_exact_cost_from_the_unit_tables(monkeypatch):
    """``_ranking_time`` (the exact cost's terms from the unit tables) is within 3% of
    ``layout_cost`` on every kind of layout; with the per-step transfers left out (the tied
    embedding over the slow link) it is off by far more on some: the check can tell."""
    g = _gpt2()
    ctx = S._context(g, FOUR)
    layouts = _layouts(ctx, FOUR)
    _tables(ctx, FOUR, layouts)
    exact = {lay: S.layout_cost(ctx, lay).step_time for lay in layouts}
    ratio = {lay: S._ranking_time(ctx, lay) / exact[lay] for lay in layouts}
    assert all(0.97 <= r <= 1.03 for r in ratio.values()), sorted(ratio.values())
    real = S._table_transfers

    def per_microbatch_only(ctx, layout, subs):
        out = real(ctx, layout, subs)
        for t in out.values():
            t["start"] = t["end"] = t["late"] = 0.0
        return out

    monkeypatch.setattr(S, "_table_transfers", per_microbatch_only)
    off = [S._ranking_time(ctx, lay) / exact[lay] for lay in layouts]
    assert min(off) < 0.8


def test_the_program_charges_what_the_first_and_last_stage_exchange(monkeypatch):
    """GPT-2's 154 MB tied embedding, 8 layers: along the chain r0 r1 r2 r3, the program's closed
    form without the embedding's exchange puts stages on r0, r1 and r2, whose first and last
    groups send the embedding and its gradient over 10 Gbit/s every step (about 250 ms, six
    times the step it predicted); with it, the program keeps the step on r0 and the layout it
    returns is faster, costed exactly, at every count."""
    m = zoo.get("gpt2", size="small", n_layers=8, batch=16, seq_len=256, n_positions=256)
    g = hj.trace(m.step, *m.abstract())
    topo = _sites(["A100", "V100", "A100", "V100"],
                  {(0, 1): _gbit(25), (0, 2): _gbit(10), (0, 3): _gbit(0.5, 30),
                   (1, 2): _gbit(25), (1, 3): _gbit(2, 10), (2, 3): _gbit(25)})
    ctx = S._context(g, topo)
    groups = S.device_groups(topo)["region"]
    subs = [S.group_topology(topo, grp) for grp in groups]
    chain = (0, 1, 2, 3)

    def program(M):
        tables = {sub: [t for n in S.INTRA_PLANS if (t := ctx.table(M, sub, n)) is not None]
                  for sub in subs}
        order, ranges, plans, _ = S._dp(ctx, topo, groups, subs, chain, tables, M)
        lay = S.StagedLayout(groups=tuple(groups[k] for k in order), ranges=tuple(ranges),
                             plans=tuple(plans), microbatches=M)
        return S.layout_cost(ctx, lay).step_time, order

    with_exchange = {M: program(M) for M in (4, 8)}
    monkeypatch.setattr(S, "_end_exchange", lambda *a, **k: None)
    without = {M: program(M) for M in (4, 8)}
    for M in (4, 8):
        assert len(without[M][1]) > 1  # the closed form alone spreads the stages
        assert with_exchange[M][0] < 0.5 * without[M][0]


@pytest.mark.parametrize("G", [2, 3, 4])
def test_the_program_with_no_exchange_is_the_plain_program(G):
    """With ``end_cost`` zero the program per first position finds what the plain program
    finds (the same sum, the same stages)."""
    import numpy as np

    rng = np.random.default_rng(G)
    U = 6
    W, Z = [], []
    for _ in range(G):
        w = np.triu(rng.uniform(0.1, 1.0, (U + 1, U + 1)), 1)
        w[w == 0] = np.inf
        W.append(w)
        Z.append(w + rng.uniform(0, 0.1))
    links = {(a, b): (rng.uniform(0, 0.2, U + 1), rng.uniform(0, 0.2, U + 1))
             for a in range(G) for b in range(a + 1, G)}
    for tau in (0.5, 1.0, 5.0):
        plain = S._dp_tau(W, Z, links, G, U, tau)
        per_first = S._dp_tau(W, Z, links, G, U, tau, np.zeros((G, G)))
        if plain is None:
            assert per_first is None
            continue
        assert per_first[0] == pytest.approx(plain[0], rel=1e-12)
        # A large exchange between every pair of different positions: one stage, if any fits.
        far = S._dp_tau(W, Z, links, G, U, tau, 1e6 * (1 - np.eye(G)))
        if far is not None and far[0] < 1e6:
            assert len(far[1]) == 1


def _four_nodes(name: str, M: int):
    """The zoo's tiny ``name`` on four DGX nodes of two GPUs: ``(topology, context, node groups,
    their topologies, unit tables of the stage plans at M microbatches)``."""
    from hulkjax.strategies.ilp import solve

    topo = hj.Topology.preset("dgx-h100", nodes=4, gpus_per_node=2)
    m = zoo.get(name, size="tiny")
    g = hj.trace(m.step, *m.abstract())
    ctx = S._context(g, topo)
    ctx.solver = solve
    groups = S.device_groups(topo)["node"]
    subs = [S.group_topology(topo, grp) for grp in groups]
    tables = {sub: [t for n in S.INTRA_PLANS if (t := ctx.table(M, sub, n)) is not None]
              for sub in dict.fromkeys(subs)}
    return topo, ctx, groups, subs, tables


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_programs_charge_the_slowest_groups_update_not_their_sum(name):
    """The stages update at once after the last backward: ``pipeline_cost`` charges the slowest
    group's update (its chunks' in turn). The dynamic programs' predictions (which rank their
    layouts and compare microbatch counts) did charge the sum over every stage: on these steps
    that put them 12-22% above the exact cost of their own layouts, and on LLaMA-8B shapes on
    eight DGX nodes it hid a staged plan 2.6% faster than SPMD behind the cutoff. They are now
    at most the exact cost, within 10% of it, plain and interleaved."""
    M = 4
    topo, ctx, groups, subs, tables = _four_nodes(name, M)
    chain = tuple(range(len(groups)))
    checked = 0
    for v in (1, 2):
        sol = (S._dp(ctx, topo, groups, subs, chain, tables, M) if v == 1 else
               S._dp_interleaved(ctx, topo, groups, subs, chain, tables, M, v))
        lay = S.StagedLayout(groups=tuple(groups[c] for c in sol[0]), ranges=tuple(sol[1]),
                             plans=tuple(sol[2]), microbatches=M,
                             schedule="1f1b" if v == 1 else "interleaved", virtual_stages=v)
        cost = S.layout_cost(ctx, lay)
        assert len(cost.stages) > 1 and max(st.update for st in cost.stages) > 0
        assert 0.9 * cost.step_time <= sol[3] <= cost.step_time * (1 + 1e-9), (v, sol[3],
                                                                              cost.step_time)
        # The counts' comparisons take the cutoff's bound as a lower bound on these predictions.
        assert S.staged_lower_bound(ctx, groups, M) <= sol[3]
        checked += 1
    assert checked == 2


def test_a_program_returns_the_bound_solution_its_judge_finds_fastest():
    """``_judged``: the best distinct solutions by the program's prediction, re-ranked by the
    judge (ties in the prediction's order); without a judge, the prediction's best."""
    found = {((0, 1), ((0, 2), (2, 4)), ("ilp", "ilp")): 1.0,
             ((0, 1), ((0, 1), (1, 4)), ("ilp", "ilp")): 1.1,
             ((0, 1), ((0, 3), (3, 4)), ("ilp", "fsdp")): 1.2}
    score = {(0, 2): 5.0, (0, 1): 3.0, (0, 3): 3.0}
    assert S._judged(found, None) == ([0, 1], [(0, 2), (2, 4)], ["ilp", "ilp"], 1.0)
    got = S._judged(found, lambda sol: score[sol[1][0]])
    assert got == ([0, 1], [(0, 1), (1, 4)], ["ilp", "ilp"], 1.1)  # its own prediction kept
    assert S._judged({}, None) is None


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_interleaved_program_judged_by_the_ranking_returns_faster_layouts(name):
    """The interleaved program's closed form does not see how unequal chunks stretch the fill:
    of its bottleneck bounds' solutions, the one the ranking (within 3% of the exact cost)
    finds fastest is returned. Two groups of four chunks at 2 microbatches on four DGX nodes:
    exactly costed, the judged layout is 8-18% faster than the closed form's pick."""
    M, v = 2, 4
    topo, ctx, groups, subs, tables = _four_nodes(name, M)

    def exact(judge):
        sol = S._dp_interleaved(ctx, topo, groups, subs, (0, 1), tables, M, v, judge=judge)
        lay = S.StagedLayout(groups=tuple(groups[c] for c in sol[0]), ranges=tuple(sol[1]),
                             plans=tuple(sol[2]), microbatches=M, schedule="interleaved",
                             virtual_stages=v)
        return S.layout_cost(ctx, lay).step_time

    plain = exact(None)
    judged = exact(S._layout_judge(lambda lay: S._ranking_time(ctx, lay), groups, M,
                                   "interleaved", v))
    assert judged < 0.95 * plain, (judged, plain)


def test_the_programs_charge_each_boundary_direction_at_its_receivers_plan():
    """The dynamic programs' link times at a boundary (:func:`S._boundary_links`, from the unit
    tables' cut bytes) are what :func:`S._table_transfers` (the ranking's and, per value, the
    exact cost's transfers) charges a two-stage layout there: the forward values at the bytes a
    device of the later stage gets under its plan, the backward values at the earlier stage's.
    With dp_tp on one side and fsdp on the other the two plans' bytes differ, so reading both
    directions off one stage's plan (as the programs did) is off in one of them."""
    g = _gpt2()
    topo = _sites(["A100", "V100"], {(0, 1): _gbit(5, 2)}, gpus=4)
    ctx = S._context(g, topo)
    groups = S.device_groups(topo)["region"]
    subs = [S.group_topology(topo, grp) for grp in groups]
    U, M = len(ctx.part.units), 2
    differ = 0
    for plans in (("dp_tp", "fsdp"), ("fsdp", "dp_tp"), ("fsdp", "fsdp")):
        tabs = [ctx.table(M, sub, name) for sub, name in zip(subs, plans)]
        for j in range(1, U):
            lay = S.StagedLayout(groups=tuple(groups), ranges=((0, j), (j, U)), plans=plans,
                                 microbatches=M)
            sent = S._table_transfers(ctx, lay, subs)
            cuts = [(t.cut_f, t.cut_b, t.devices) for t in tabs]
            link = S.stage_link(topo, groups[0], groups[1])
            lf, lb = S._boundary_links(link, cuts[0], cuts[1], len(groups[0]), len(groups[1]))
            assert lf[j] == pytest.approx(sent.get((0, 1), {}).get("fwd", 0.0), rel=1e-9)
            assert lb[j] == pytest.approx(sent.get((1, 0), {}).get("bwd", 0.0), rel=1e-9)
            differ += not math.isclose(tabs[0].cut_b[j], tabs[1].cut_b[j], rel_tol=1e-6)
    assert differ  # some boundary's backward bytes differ between the two plans
