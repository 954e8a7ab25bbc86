"""``DeviceSpec.fresh_page_time``: XLA:CPU allocates a program's temporaries on every call, and
those above glibc's mmap threshold (``Backend.fresh_buffer_threshold``, 32 MiB) are new pages
each time; the cost model charges their pages per program call (measured:
``benchmarks/compute_check.py``, ``benchmarks/COMPUTE.md``). A pipeline's microbatch programs are
smaller than the whole step's and can stay under the threshold."""

import math

import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.cost.backends import BACKENDS, PAGE_BYTES
from hulkjax.cost.memory import liveness
from hulkjax.cost.model import CostModel
from hulkjax.errors import InvalidTopologyError
from hulkjax.launch.calibrate import device_spec, fresh_page_time
from hulkjax.topology import DeviceSpec
from tests.helpers import cpu_regions

PAGE = 2e-6  # seconds per 4 KiB page


def _topo(page: float):
    return cpu_regions(hbm_bandwidth=2e10, fresh_page_time=page)


@pytest.fixture(scope="module")
def model():
    # batch 128: the whole step's temporaries (~60 MiB) are above the threshold, a quarter
    # batch's are not
    m = zoo.get("gpt2", size="tiny", batch=128, n_layers=4)
    args = m.abstract()
    return m, args, hj.trace(m.step, *args)


def test_the_step_pays_the_pages_of_its_temporaries_above_the_threshold(model):
    m, args, graph = model
    cm = CostModel(graph, _topo(PAGE))
    a = cm.replicated_assignment()
    cost = cm.evaluate(a)
    temps = liveness(cm, a).temporaries
    assert temps > BACKENDS["cpu"].fresh_buffer_threshold
    assert cost.page_time == pytest.approx(temps / PAGE_BYTES * PAGE)
    free = CostModel(graph, _topo(0.0)).evaluate(a)
    assert free.page_time == 0.0
    assert cost.compute_time == pytest.approx(free.compute_time + cost.page_time)
    assert cost.step_time == pytest.approx(free.step_time + cost.page_time)
    # the temporaries are what is live at the peak beyond the step's arguments
    report = liveness(cm, a)
    held = sum(b.bytes for b in report.live if b.node is None)
    assert temps == pytest.approx(report.peak - held) and 0 < temps < report.peak


def test_under_the_threshold_and_on_pooled_allocators_nothing_is_charged(model):
    m, args, graph = model
    small = zoo.get("gpt2", size="tiny", batch=8, n_layers=4)
    sargs = small.abstract()
    cm = CostModel(hj.trace(small.step, *sargs), _topo(PAGE))
    assert liveness(cm, cm.replicated_assignment()).temporaries < 32 * (1 << 20)
    assert cm.evaluate(cm.replicated_assignment()).page_time == 0.0
    # a GPU's allocator pools its memory: no fresh pages whatever the spec says
    assert math.isinf(BACKENDS["gpu"].fresh_buffer_threshold)
    assert BACKENDS["gpu"].fresh_bytes(1e12) == 0.0


def test_microbatch_programs_under_the_threshold_pay_no_pages(model):
    m, args, graph = model
    topo = _topo(PAGE)
    spmd = hj.plan(m.step, *args, topology=topo, strategy="replicate", graph=graph)
    four = hj.plan(m.step, *args, topology=topo, strategy="pipeline", microbatches=4,
                   graph=graph)
    assert spmd.cost.page_time > 0
    assert four.microbatches == 4 and four.cost.page_time == 0.0
    # Four times the batch in one microbatch: each stage's forward and backward programs (half
    # the layers each) cross the threshold again, and each stage pays its own.
    big = zoo.get("gpt2", size="tiny", batch=512, n_layers=4)
    bargs = big.abstract()
    one = hj.plan(big.step, *bargs, topology=topo, strategy="pipeline", microbatches=1)
    free = hj.estimate(big.step, *bargs, plan=one, topology=_topo(0.0))
    assert one.cost.page_time > 0 and free.page_time == 0.0
    extra = [a.forward + a.backward + a.update - (b.forward + b.backward + b.update)
             for a, b in zip(one.cost.stages, free.stages)]
    assert all(e > 0 for e in extra)
    assert any(one.cost.page_time == pytest.approx(e) for e in extra)  # the busiest stage's
    assert one.cost.step_time > free.step_time


def test_a_programs_temporaries_leave_out_what_other_programs_make(model):
    m, args, graph = model
    cm = CostModel(graph, _topo(PAGE))
    a = cm.replicated_assignment()
    # The backward pass as one program: the forward's saved activations are its arguments.
    backward = [n.id for n in graph.nodes if n.backward]
    as_buffers = liveness(cm, a, nodes=backward)
    as_args = liveness(cm, a, nodes=backward, received_as_arguments=True)
    received = [b for b in as_args.live if b.node is None and b.kind == "activations"]
    assert received  # the saved activations, held from the start
    # held throughout, so the peak holds all of them; the temporaries none
    assert as_args.peak == pytest.approx(as_args.temporaries + sum(
        b.bytes for b in as_args.live if b.node is None))
    assert sum(b.bytes for b in received) > as_buffers.peak - as_buffers.temporaries
    assert as_args.temporaries <= as_buffers.temporaries
    assert as_args.temporaries == pytest.approx(
        as_args.peak - sum(b.bytes for b in as_args.live if b.node is None))


def test_the_json_form_keeps_it_and_bad_values_are_refused():
    topo = _topo(1.5e-6)
    again = hj.Topology.from_dict(topo.to_dict())
    assert again.devices[0].spec.fresh_page_time == 1.5e-6
    assert "fresh_page_time" not in str(_topo(0.0).to_dict())  # ideal: not written
    with pytest.raises(InvalidTopologyError, match="fresh_page_time"):
        DeviceSpec(kind="x", peak_flops=1e11, memory=1e10, hbm_bandwidth=1e9,
                   fresh_page_time=-1e-6)


def test_calibration_reads_bandwidth_in_place_and_the_page_cost_from_the_faults():
    meas = {"matmul": {"flops_per_device": 1e10, "seconds": 0.1},
            "memory": {"traffic_per_device": 4e9, "seconds": 1.0, "bytes_per_device": 64 << 20,
                       "page_faults_per_device": 2e5, "page_bytes": 4096},
            "memory_in_place": {"seconds": 0.1, "page_faults_per_device": 0.0},
            "kernels": {"chain": 64, "seconds_one": 1e-5, "seconds_chain": 1e-5}}
    spec = device_spec(meas, memory=1e10)
    assert spec.hbm_bandwidth == pytest.approx(4e10)  # in place, not the fresh chain's 4 GB/s
    assert spec.fresh_page_time == pytest.approx(0.9 / 2e5)
    # a larger page: the cost per 4 KiB is its share
    assert fresh_page_time({**meas["memory"], "page_bytes": 16384}, meas["memory_in_place"]) \
        == pytest.approx(0.9 / 2e5 / 4)
    # no faults (buffers under the threshold): nothing to read a page cost from
    assert fresh_page_time({**meas["memory"], "page_faults_per_device": 0.0},
                           meas["memory_in_place"]) == 0.0
    # an older measurement without the in-place chain: the fresh chain's rate, no page cost
    old = {k: v for k, v in meas.items() if k != "memory_in_place"}
    assert device_spec(old, memory=1e10).hbm_bandwidth == pytest.approx(4e9)
    assert device_spec(old, memory=1e10).fresh_page_time == 0.0
