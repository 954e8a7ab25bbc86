"""Golden plans: every built-in strategy's layouts and predicted cost on a few zoo models and
topologies, pinned in ``plans.json`` (written by ``python -m tests.golden.cases``).

A structural change (moving code between layers) must leave every plan as it was. A change meant
to change plans regenerates the file and says why in its commit.
"""

import json
import math

import pytest

from tests.golden import cases

# Solved strategies pin their objective, not their layouts: optima of equal cost are equally
# right, and which one a solver returns may change with its version (HiGHS through scipy returned
# different ones from run to run; highspy on one thread with a fixed seed does not). The objective
# is exact: the ILP solves in units of its trivial bound with no absolute gap (HiGHS's default
# absolute gap of 1e-6 once let microsecond-scale plans 2-4% above the optimum pass as optimal).
# It stops within its relative gap (``mip_rel_gap``, 1e-4) of the bound, so which plan inside that
# gap it returns may depend on where the search stands when it stops: a clean-clone CI run under
# load returned GPT-2 tiny's ilp plan on dgx-h100x2 1.7e-8 (relative) above the golden one.
SOLVED = ("ilp", "auto")
SOLVED_RTOL = 1e-4


with open(cases.PATH) as _f:
    GOLDEN = json.load(_f)


@pytest.mark.parametrize("model,size,overrides,topo", list(cases.all_cases()),
                         ids=[cases.case_id(*c) for c in cases.all_cases()])
def test_plans_unchanged(model, size, overrides, topo):
    want = GOLDEN[cases.case_id(model, size, overrides, topo)]
    got = cases.plans_for(model, size, overrides, topo)
    assert sorted(got) == sorted(want), "a strategy appeared or disappeared"
    for strategy in want:
        w, g = want[strategy], got[strategy]
        if strategy in SOLVED:
            assert math.isclose(g["step_time"], w["step_time"], rel_tol=SOLVED_RTOL), \
                f"{strategy}: step time {g['step_time']!r} != golden {w['step_time']!r}"
            continue
        for key in ("in", "out", "operands", "results"):
            assert g[key] == w[key], f"{strategy}: {key} layouts changed"
        for key in ("step_time", "compute_time", "comm_time", "peak_memory"):
            assert math.isclose(g[key], w[key], rel_tol=1e-9, abs_tol=1e-18), \
                f"{strategy}: {key} {g[key]!r} != golden {w[key]!r}"
