"""``auto`` solves the whole integer program where it is small (``full_program``): a mesh of at
most two axes and few enough candidate pairs (:func:`hulkjax.strategies.ilp.program_pairs`).
Elsewhere it solves the network's shortlist and widens it in neighbourhood rounds."""

import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.strategies.auto import FULL_PROGRAM_AXES, FULL_PROGRAM_PAIRS
from hulkjax.strategies.ilp import _Program, program_pairs, solve
from hulkjax.strategies.realize import cost_model

# The golden plans' grid (tests/golden/cases.py): slow links across, fast within.
GRID = hj.Topology.grid((2, 4), ("data", "model"), bandwidth=(25e9, 450e9),
                        latency=(5e-6, 1e-6))
THREE_D = hj.Topology.grid((2, 2, 2), ("data", "fsdp", "model"), bandwidth=(25e9, 100e9, 450e9),
                           latency=(5e-6, 2e-6, 1e-6))
WHOLE = "the whole program solved"


def _model(name):
    m = zoo.get(name, size="tiny")
    args = m.abstract()
    return m, args, hj.trace(m.step, *args)


@pytest.fixture(scope="module")
def gpt2():
    return _model("gpt2")


def _auto(model, topo, **options):
    m, args, g = model
    return hj.plan(m.step, *args, topology=topo, strategy="auto", graph=g, stages=False,
                   **options)


def test_the_whole_program_holds_what_the_shortlist_misses(gpt2):
    """GPT-2 tiny on the grid: the network's shortlist, without the neighbourhood rounds, holds
    no plan within 20% of the ILP's optimum; solving the whole program (the default there)
    reaches it without any round."""
    cm = cost_model(gpt2[2], GRID)
    optimum = solve(cm).objective
    short = _auto(gpt2, GRID, full_program=0, rounds=0)
    assert WHOLE not in short.notes[0]
    assert cm.objective(short.assignment) > 1.2 * optimum  # the negative control
    whole = _auto(gpt2, GRID, rounds=0)
    assert WHOLE in whole.notes[0]
    assert whole.source in ("optimum", "optimum + descent")
    assert cm.objective(whole.assignment) <= optimum * (1 + 1e-9)


def test_no_neighbourhood_rounds_after_the_whole_program_s_proven_optimum(gpt2, monkeypatch):
    """With nothing left out of the program, the rounds have nothing to find: they run after the
    shortlist's solve, not after the whole program's (proven optimal here)."""
    import hulkjax.strategies.auto as auto_module

    calls = []
    real = auto_module._neighbourhood_search
    monkeypatch.setattr(auto_module, "_neighbourhood_search",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    assert WHOLE in _auto(gpt2, GRID).notes[0]
    assert calls == []
    _auto(gpt2, GRID, full_program=0)
    assert calls == [1]


def test_the_limit_is_the_count_of_candidate_pairs(gpt2):
    """``full_program`` is compared with :func:`program_pairs`: at the count the whole program
    is solved, one below it the shortlist."""
    n = program_pairs(cost_model(gpt2[2], GRID))
    assert WHOLE in _auto(gpt2, GRID, full_program=n, rounds=0).notes[0]
    assert WHOLE not in _auto(gpt2, GRID, full_program=n - 1, rounds=0).notes[0]


def test_meshes_of_three_axes_keep_the_shortlist():
    """On 2x2x2 the tied program can take HiGHS far longer than the shortlist and its rounds
    (tests/strategies/test_auto_neighbourhood.py): the MLP's is under the pairs limit, and
    still not solved whole."""
    mlp = _model("mlp")
    cm = cost_model(mlp[2], THREE_D)
    assert len(cm.mesh.axis_names) > FULL_PROGRAM_AXES
    assert program_pairs(cm) <= FULL_PROGRAM_PAIRS
    assert WHOLE not in _auto(mlp, THREE_D).notes[0]


@pytest.mark.parametrize("topo", [GRID, THREE_D], ids=["2x4", "2x2x2"])
def test_program_pairs_counts_the_candidate_by_candidate_program(gpt2, topo):
    """Within 5% of the x and y variables of the program that couples every pair of candidates
    (``aggregate=False``; it leaves out joined classes whose edges cost nothing, and the count
    leaves out the seeds' extra candidates)."""
    cm = cost_model(gpt2[2], topo)
    prog = _Program(cm, [], tie_layers=True, restrict=None, max_candidates=256, aggregate=False)
    xy = prog.n - len(prog.z_rows)
    assert program_pairs(cm) == pytest.approx(xy, rel=0.05)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_bad_full_program_is_refused(value):
    with pytest.raises(hj.errors.InvalidOptionError, match=r"full_program=.*use an int >= 0"):
        hj.strategies.options_of("auto", full_program=value)
