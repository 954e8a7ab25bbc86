"""``DeviceSpec.receive_overhead``: a device whose network stack shares its cores loses that share
of a receive's link time to compute; a staged plan's receiving stage pays it (measured on the WAN
testbed: ``benchmarks/wan/transfer_time.py --mode busy1``)."""

import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.errors import InvalidTopologyError
from hulkjax.topology import DeviceSpec
from tests.helpers import cpu_regions


def _topo(rho: float):
    return cpu_regions(receive_overhead=rho)


@pytest.fixture(scope="module")
def staged():
    m = zoo.get("gpt2", size="tiny", batch=8, n_layers=4)
    args = m.abstract()
    graph = hj.trace(m.step, *args)
    plan = hj.plan(m.step, *args, topology=_topo(0.0), strategy="pipeline", graph=graph)
    assert plan.stages is not None and len(plan.stages) == 2
    return m, args, plan


def test_the_receiving_phase_pays_its_share_of_each_receive(staged):
    m, args, plan = staged
    rho = 0.5
    cost = hj.estimate(m.step, *args, plan=plan, topology=_topo(rho))
    base = plan.cost
    # per microbatch: the activations go 0 -> 1 (read by stage 1's forward), their gradients
    # back (read by stage 0's backward); alpha-beta on the link
    per_mb = {(t.src, t.dst): t.latency + t.microbatch_bytes / t.bandwidth
              for t in base.transfers if t.microbatch_bytes}
    fwd, bwd = per_mb[(0, 1)], per_mb[(1, 0)]
    assert cost.stages[1].forward == pytest.approx(base.stages[1].forward + rho * fwd, rel=0.05)
    assert cost.stages[0].backward == pytest.approx(base.stages[0].backward + rho * bwd, rel=0.05)
    assert cost.stages[0].forward == base.stages[0].forward  # receives nothing in its forward
    assert cost.stages[1].backward == base.stages[1].backward
    assert cost.step_time > base.step_time
    # compute is the plan's own; the receive's share counts with the stage's communication
    assert cost.stages[1].compute == base.stages[1].compute
    assert cost.stages[1].comm > base.stages[1].comm


def test_zero_changes_nothing_and_the_json_form_keeps_it(staged):
    m, args, plan = staged
    assert hj.estimate(m.step, *args, plan=plan, topology=_topo(0.0)).step_time == \
        plan.cost.step_time
    topo = _topo(0.3)
    again = hj.Topology.from_dict(topo.to_dict())
    assert again.devices[0].spec.receive_overhead == 0.3
    assert "receive_overhead" not in str(_topo(0.0).to_dict())  # ideal: not written


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_a_share_outside_0_1_is_refused_with_the_fix(bad):
    with pytest.raises(InvalidTopologyError, match="receive_overhead"):
        DeviceSpec(kind="x", peak_flops=1e11, memory=1e10, hbm_bandwidth=1e9,
                   receive_overhead=bad)
