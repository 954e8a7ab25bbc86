"""What a staged plan's stages pin: made once per (cost model, assignment) that stages share
(``build_plan``), each stage keeping its own operators' pins, in the cost model's order."""

from hulkjax.plan.specs import to_pspec
from hulkjax.strategies import stages as S
from hulkjax.strategies.ilp import solve
from hulkjax.strategies.loops import body_plans

from .test_staged_ranking import FOUR, _gpt2


def _direct(cm, assignment, mine):
    """A stage's pins computed on their own, as each stage did before they were shared."""
    ops, res = cm.pinned_layouts(assignment)
    via = cm.pinned_paths(assignment, ops)
    return {
        "operand_specs": {k: to_pspec(s) for k, s in ops.items() if k[0] in mine},
        "result_specs": {k: to_pspec(s) for k, s in res.items() if k[0] in mine},
        "operand_paths": {k: tuple(to_pspec(s) for s in p) for k, p in via.items()
                          if k[0] in mine},
        "bodies": {n: b for n, b in body_plans(cm, assignment).items() if n in mine},
    }


def test_each_stage_pins_its_own_operators_as_the_cost_model_orders_them():
    """Interleaved over two groups: the second group's two chunks share a cost model and an
    assignment (one set of pins), the first group's run two plans on one cost model. Each
    stage's pins are exactly its operators' (none lost, none of another stage's) with their
    layouts, in the cost model's order."""
    g = _gpt2()
    ctx = S._context(g, FOUR)
    ctx.solver = solve
    groups = S.device_groups(FOUR)["region"]
    layout = S.StagedLayout(groups=(groups[0], groups[1]) * 2,
                            ranges=tuple(S.uniform_ranges(ctx.part, 4)),
                            plans=("fsdp", "dp_tp", "dp_tp", "dp_tp"), microbatches=2,
                            schedule="interleaved", virtual_stages=2)
    plan = S.build_plan(ctx, layout, "test")
    works, _ = S.stage_works(ctx, layout)
    assert len(plan.stages) == 4
    for st, w in zip(plan.stages, works):
        mine = set(w.forward) | set(w.backward) | set(w.update)
        want = _direct(w.cost_model, w.assignment, mine)
        got = {k: getattr(st, k) for k in want}
        assert got == want
        for k in ("operand_specs", "result_specs", "operand_paths"):
            assert list(got[k]) == list(want[k])  # the same order
        assert st.result_specs  # non-trivial: every stage pins its results
        assert not {n for n, _ in st.operand_specs} - mine
    # Both cases are exercised: pins shared by two chunks, and two plans on one cost model.
    assert works[1].cost_model is works[3].cost_model and works[1].assignment is works[3].assignment
    assert works[0].cost_model is works[2].cost_model
    assert list(works[0].assignment) != list(works[2].assignment)
