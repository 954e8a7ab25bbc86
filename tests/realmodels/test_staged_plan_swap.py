"""The staged search tries other SPMD plans on the stages of its best layouts
(:func:`hulkjax.strategies.stages._better_plans`), on third-party model code: transformers'
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
    kw = dict(solver=solve, microbatches=(1, 2, 4, 8), virtual_stages=(1,))
    with_swaps = S.search(g, TWO_REGIONS, **kw)
    g.memo.pop("staged_contexts", None)
    with monkeypatch.context() as m:
        m.setattr(S, "_better_plans", lambda ctx, layout, ranking: layout)
        without = S.search(g, TWO_REGIONS, **kw)
    (t0, lay0), (t1, lay1) = without.layouts[0], with_swaps.layouts[0]
    # Both are two-stage pipelines; the programs give each stage the ILP's plan (least work per
    # microbatch), the swap gives the second stage fsdp: its layout of the activations it
    # receives over the 5 Gbit/s link is cheaper to send (492 ms -> 467 ms when written).
    assert len(lay0.groups) == len(lay1.groups) == 2 and lay1.microbatches > 1
    assert lay1.plans != lay0.plans
    assert t1 < 0.97 * t0
    # The swap only adds layouts to cost exactly: the best returned is never slower.
    ctx = S._context(g, TWO_REGIONS)
    assert t1 == pytest.approx(S.layout_cost(ctx, lay1).step_time, rel=1e-9)


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
