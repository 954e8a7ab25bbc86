"""The cost model's predicted collectives against the compiled HLO, for every strategy.

Predictions are :meth:`CostModel.program_collectives` (a value brought to a layout once, as XLA
reuses it) with reduce-scatters reported as all-reduces: XLA:CPU emits all-reduce + dynamic-slice
where GPUs and TPUs emit reduce-scatter. Collectives under 64 bytes (scalar metrics XLA may fold
into other reductions) are ignored.
"""

import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.emit.hlo import summarize
from hulkjax.strategies.realize import plan_cost_model
from tests.helpers import SPMD_STRATEGIES, tight_regional

TOPO = hj.Topology.grid((2, 4), ("data", "model"), bandwidth=(25e9, 450e9), latency=(5e-6, 1e-6))
SMALL = 64


def _predicted_and_compiled(model, strategy, **config):
    """The model's predicted collectives for the plan, and the plan's compiled step."""
    m = zoo.get(model, size="tiny", **config)
    state, batch = m.abstract()
    g = hj.trace(m.step, state, batch)
    plan = hj.plan(m.step, state, batch, topology=TOPO, strategy=strategy, graph=g)
    predicted = plan_cost_model(g, TOPO, plan).program_collectives(plan.assignment,
                                                                  reduce_scatter=False)
    step = hj.emit(m.step, plan)
    step.compile(state, batch)
    return predicted, step


def _compare(model, strategy):
    predicted, step = _predicted_and_compiled(model, strategy)
    compiled = {k: v["bytes"] for k, v in summarize(step.collectives()).items()}
    predicted = {k: b for k, b in predicted.items() if b > SMALL}
    compiled = {k: b for k, b in compiled.items() if b > SMALL}
    return predicted, compiled


@pytest.mark.parametrize("strategy", SPMD_STRATEGIES)
@pytest.mark.parametrize("model", ["mlp", "transformer-block", "mlp-nnx", "transformer-block-nnx",
                                   "cnn"])
def test_predicted_collectives_match_the_hlo(model, strategy):
    predicted, compiled = _compare(model, strategy)
    assert set(predicted) == set(compiled), (predicted, compiled)
    for key, b in compiled.items():
        assert predicted[key] == pytest.approx(b, rel=0.10), (key, predicted, compiled)


@pytest.mark.parametrize("strategy", ["dp", "dp_tp", "ilp"])
def test_scanned_gpt2_collectives_match_the_hlo_per_iteration(strategy):
    """GPT-2 with its blocks in one scan: the body's collectives are in the HLO's while body once,
    and run ``trip_count`` times (XLA's ``known_trip_count``); the cost model counts them once
    per iteration. Bytes are compared per step: HLO bytes weighted by each collective's
    ``trip_count``. ``ilp`` plans the backward scan as the mirror of a tensor-parallel forward
    one (tests/strategies/test_loops_equivalence.py)."""
    predicted, step = _predicted_and_compiled("gpt2", strategy, scan_layers=True)
    collectives = step.collectives()
    in_loop = [c for c in collectives if c.in_loop]
    assert in_loop and all(c.trip_count == 2 for c in in_loop)  # the gradients, per layer
    compiled: dict = {}
    for c in collectives:
        compiled[(c.kind, c.axes)] = compiled.get((c.kind, c.axes), 0) + c.bytes * c.trip_count
    predicted = {k: b for k, b in predicted.items() if b > SMALL}
    compiled = {k: b for k, b in compiled.items() if b > SMALL}
    assert set(predicted) == set(compiled), (predicted, compiled)
    for key, b in compiled.items():
        assert predicted[key] == pytest.approx(b, rel=0.10), (key, predicted, compiled)


@pytest.mark.parametrize("case", ["pipeline", "ilp", "auto-apart"])
def test_staged_predicted_collectives_match_the_hlo(case):
    """A staged plan's ``Cost.collectives`` (per step, axes ``s<stage>/<axis>``: each stage's
    microbatch programs ``microbatches`` times, its reduction and update once, a value brought
    to a layout once per program) against the compiled stage programs' HLO. The ``pipeline``
    baseline's stages on three GPU kinds; the stages of ``ilp`` and of ``auto`` with optimizer
    state apart where memory bends their plans (their tensor-parallel sums, and the
    distributed optimizer's reduce-scatters, which XLA:CPU emits as all-reduces)."""
    m = zoo.get("gpt2", size="tiny", n_layers=8, batch=32 if case == "ilp" else 8)
    state, batch = m.abstract()
    if case == "pipeline":
        topo = hj.Topology.preset("hetero", nodes=(("A100", 4), ("V100", 2), ("T4", 2)))
        plan = hj.plan(m.step, state, batch, topology=topo, strategy="pipeline", microbatches=4)
    elif case == "ilp":
        plan = hj.plan(m.step, state, batch, topology=tight_regional(3.5e6), strategy="ilp")
    else:
        plan = hj.plan(m.step, state, batch, topology=tight_regional(2.5e6), strategy="auto",
                       optimizer_apart=True)
    assert plan.stages is not None and len(plan.stages) > 1
    if case == "ilp":
        assert plan.microbatches > 1
    predicted: dict = {}
    for c in plan.cost.collectives:
        kind = "all-reduce" if c.kind == "reduce-scatter" else c.kind
        predicted[(kind, c.axes)] = predicted.get((kind, c.axes), 0) + c.bytes
    if case == "auto-apart":
        assert any(c.kind == "reduce-scatter" for c in plan.cost.collectives)
    step = hj.emit(m.step, plan)
    step.compile(state, batch)
    compiled = {k: v["bytes"] for k, v in summarize(step.collectives()).items()}
    predicted = {k: b for k, b in predicted.items() if b > SMALL}
    compiled = {k: b for k, b in compiled.items() if b > SMALL}
    assert set(predicted) == set(compiled), (predicted, compiled)
    for key, b in compiled.items():
        assert predicted[key] == pytest.approx(b, rel=0.10), (key, predicted, compiled)
    # Per axis, the bytes are those the collectives move (the ring's share, not their operands).
    assert set(plan.cost.comm_bytes) >= {a for c in plan.cost.collectives for a in c.axes}
