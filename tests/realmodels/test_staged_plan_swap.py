"""The staged search tries other SPMD plans on the stages of its best layouts
(:func:`hulkjax.strategies.stages._better_plans`) and cuts the ranges those plans call for
(:func:`hulkjax.strategies.stages._ranges_for_plans`), on third-party model code: transformers'
Flax GPT-2, where the dynamic programs' choice of plan (by work per microbatch alone, every
boundary charged at one plan's bytes) leaves a faster plan out."""

import jax
import pytest

import hulkjax as hj
from hulkjax.strategies import stages as S
from hulkjax.strategies.ilp import solve
from hulkjax.topology.specs import LinkSpec
from tests.realmodels import families

TWO_REGIONS = hj.Topology.preset("regional", regions=2, gpus_per_node=4, device="V100",
                                 metro=LinkSpec(bandwidth=5e9 / 8, latency=2e-3))


def _abstract_gpt2(monkeypatch):
    """transformers' Flax GPT-2 at 8 x 1024, batch 64 x 512, as shapes (nothing allocated)."""
    monkeypatch.setitem(families._DIMS, "plan-swap", dict(
        layers=8, width=1024, heads=16, ff=4096, vocab=8192, seq=512, batch=64, image=16,
        patch=4))
    made = {}

    def build():
        step, state, batch = families.build("gpt2", "plan-swap")
        made["step"] = step
        return state, batch

    state, batch = jax.eval_shape(build)
    return made["step"], state, batch


def test_the_search_swaps_a_stage_plan_the_dynamic_program_chose_by_work_alone(monkeypatch):
    if not families.available("gpt2"):
        pytest.skip("transformers is not installed")
    step, state, batch = _abstract_gpt2(monkeypatch)
    g = hj.trace(step, state, batch)
    kw = dict(solver=solve, microbatches=(4,), virtual_stages=(1,))
    full = S.search(g, TWO_REGIONS, **kw)
    g.memo.pop("staged_contexts", None)
    with monkeypatch.context() as m:
        m.setattr(S, "_ranges_for_plans", lambda ctx, layout, ranking: None)
        swap_only = S.search(g, TWO_REGIONS, **kw)
    g.memo.pop("staged_contexts", None)
    with monkeypatch.context() as m:
        m.setattr(S, "_better_plans", lambda ctx, layout, ranking: layout)
        without = S.search(g, TWO_REGIONS, **kw)
    (t0, lay0), (t1, lay1), (t2, lay2) = (without.layouts[0], swap_only.layouts[0],
                                          full.layouts[0])
    # All are two-stage pipelines; the programs give each stage the ILP's plan (least work per
    # microbatch), the swap gives the second stage fsdp: its layout of the activations it
    # receives over the 5 Gbit/s link is cheaper to send (492 ms -> 467 ms when written).
    assert len(lay0.groups) == len(lay1.groups) == len(lay2.groups) == 2
    assert lay1.microbatches > 1
    assert lay1.plans != lay0.plans
    assert t1 < 0.97 * t0
    # The swapped plans' own ranges (_ranges_for_plans): another cut, 467 -> 457 ms (the best
    # of every 1F1B layout of these plans, groups and counts, costed one by one).
    assert lay2.plans == lay1.plans and lay2.ranges != lay1.ranges
    assert t2 < 0.99 * t1
    # Both only add layouts to cost exactly: the best returned is never slower.
    ctx = S._context(g, TWO_REGIONS)
    assert t2 == pytest.approx(S.layout_cost(ctx, lay2).step_time, rel=1e-9)


def test_better_plans_descends_to_a_layout_no_single_change_ranks_faster():
    """On the zoo's transformer blocks over the same two regions, from the search's best layouts with every
    stage on dp_tp (slow on these groups): :func:`_better_plans` returns the same ranges and
    groups, ranked faster, and no change of one stage's plan among the group's built plans
    ranks faster still."""
    from hulkjax import zoo

    m = zoo.get("transformer-block", size="small", n_layers=8, batch=64)
    g = hj.trace(m.step, *m.abstract())
    res = S.search(g, TWO_REGIONS, solver=solve, microbatches=(4,), virtual_stages=(1,))
    ctx = S._context(g, TWO_REGIONS)

    def rank(lay):
        return S._ranking_time(ctx, lay)

    staged = [lay for _, lay in res.layouts if len(lay.groups) > 1]
    assert staged
    for layout in staged:
        start = S.StagedLayout(groups=layout.groups, ranges=layout.ranges,
                               plans=("dp_tp",) * len(layout.groups),
                               microbatches=layout.microbatches)
        out = S._better_plans(ctx, start, rank)
        assert (out.groups, out.ranges) == (start.groups, start.ranges)
        assert rank(out) < rank(start)
        for k in range(len(out.plans)):
            for name in S.INTRA_PLANS:
                other = out.plans[:k] + (name,) + out.plans[k + 1:]
                if S._variant_ok(ctx, S.StagedLayout(
                        groups=out.groups, ranges=out.ranges, plans=other,
                        microbatches=out.microbatches)):
                    assert rank(out) <= rank(S.StagedLayout(
                        groups=out.groups, ranges=out.ranges, plans=other,
                        microbatches=out.microbatches)) * (1 + 1e-12)


def test_ranges_for_plans_keeps_each_stage_on_its_plan():
    """On the zoo's transformer blocks over two regions: for the search's staged layouts with
    their stages' plans set to every mix of the built plans, :func:`_ranges_for_plans` cuts
    consecutive ranges over every unit and keeps each stage (chunk) on its plan."""
    from hulkjax import zoo

    m = zoo.get("transformer-block", size="small", n_layers=8, batch=64)
    g = hj.trace(m.step, *m.abstract())
    res = S.search(g, TWO_REGIONS, solver=solve, microbatches=(4,), virtual_stages=(1, 2))
    ctx = S._context(g, TWO_REGIONS)
    staged = [lay for _, lay in res.layouts if len(lay.groups) > 1]
    assert staged and any(lay.virtual_stages > 1 for lay in staged)
    U = len(ctx.part.units)
    checked = 0
    for layout in staged:
        for first in S.INTRA_PLANS:
            plans = (first,) + layout.plans[1:]
            lay = S.StagedLayout(groups=layout.groups, ranges=layout.ranges, plans=plans,
                                 microbatches=layout.microbatches, schedule=layout.schedule,
                                 virtual_stages=layout.virtual_stages)
            if not S._variant_ok(ctx, lay):
                continue
            out = S._ranges_for_plans(ctx, lay, lambda x: S._ranking_time(ctx, x))
            if out is None:
                continue
            checked += 1
            assert out.ranges[0][0] == 0 and out.ranges[-1][1] == U
            assert all(a < b for a, b in out.ranges)
            assert all(out.ranges[k][0] == out.ranges[k - 1][1] for k in range(1, len(out.ranges)))
            if lay.virtual_stages > 1:  # every chunk kept, each on its own plan
                assert (out.groups, out.plans) == (lay.groups, lay.plans)
            else:  # stages may be left out; those kept keep their group's plan
                plan_of = dict(zip(lay.groups, lay.plans))
                assert all(plan_of[grp] == name for grp, name in zip(out.groups, out.plans))
    assert checked >= 2
