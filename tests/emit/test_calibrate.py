"""``hulkjax calibrate`` on loopback with small sizes: a loadable topology whose numbers are the
ones computed from the job's own timings (never the nominal ``cpu`` spec). Times are measured
but never compared with a wall-clock bound."""

import json

import pytest

import hulkjax as hj
from hulkjax.cli import main
from hulkjax.errors import HulkjaxError, WorkerFailedError
from hulkjax.launch.calibrate import (
    BUSY_FLOPS,
    CALL_BYTES,
    CALL_OPERANDS,
    calibrate,
    call_seconds,
    chain_length,
    fit_alpha_beta,
    fresh_page_time,
    split_call_cost,
    transposed_dot_efficiency,
)
from hulkjax.topology.specs import DEVICE_SPECS

pytestmark = pytest.mark.usefixtures("default_backend_optimization")

TIMEOUT = 180
SMALL = dict(matmul_size=96, memory_bytes=1 << 20, link_bytes=(1 << 20, 1 << 23), repeats=3)


def test_the_workers_compile_without_the_tests_fast_compile_flags():
    """The measuring processes get the flags the tests started with, not -O0 (conftest.py)."""
    from hulkjax.launch.launcher import _worker_env

    flags = _worker_env(None)["XLA_FLAGS"]
    assert "--xla_backend_optimization_level=0" not in flags
    assert "--xla_cpu_use_fusion_emitters=false" not in flags


def test_calibrate_writes_a_topology_of_measured_numbers(tmp_path):
    topo, rec = calibrate(processes=2, local_devices=2, out=str(tmp_path), timeout=TIMEOUT,
                          **SMALL)
    loaded = hj.Topology.load(tmp_path / "topology.json")
    assert loaded == topo and loaded.shape == (2, 2) and loaded.axis_names == ("proc", "dev")
    meas = json.loads((tmp_path / "measurements.json").read_text())
    assert meas["processes"] == 2 and meas["local_devices"] == 2
    spec = loaded.slowest_device()
    # The device numbers are the measured work divided by the measured median times.
    mm, mem = meas["matmul"], meas["memory"]
    # A chain of matmuls per run, long enough that every device's runs overlap the others'.
    assert mm["chain"] == chain_length(BUSY_FLOPS, 6 * 96 ** 3) > 1
    assert mm["flops_per_device"] == 6 * 96 ** 3 * mm["chain"] and mm["seconds"] > 0
    assert mem["traffic_per_device"] == 2 * mem["bytes_per_device"] * mem["chain"]
    assert spec.peak_flops == pytest.approx(mm["flops_per_device"] / mm["seconds"])
    # the memory rate is the chain's in place (donated: no fresh pages); a fresh page's cost is
    # what the chain into fresh buffers took beyond it, over its page faults
    in_place = meas["memory_in_place"]
    assert spec.hbm_bandwidth == pytest.approx(mem["traffic_per_device"] / in_place["seconds"])
    assert mem["page_faults_per_device"] >= 0 and mem["page_bytes"] > 0
    assert spec.fresh_page_time == fresh_page_time(mem, in_place) >= 0
    # the both-transposed matmul (2n x n/4 by n x 2n): its rate over the chain's, at most 1
    tt = meas["transposed_matmul"]
    assert (tt["m"], tt["n"], tt["k"]) == (24, 96, 192)
    assert tt["flops_per_device"] == 2 * 192 * 24 * 96 * tt["chain"] and tt["seconds"] > 0
    assert spec.transposed_dot_efficiency == transposed_dot_efficiency(mm, tt)
    assert 0 < spec.transposed_dot_efficiency <= 1
    assert rec["device"]["transposed_dot_efficiency"] == spec.transposed_dot_efficiency
    kern = rec["measurements"]["kernels"]
    # Per further kernel of the chain, clipped at 0: on a loaded CI machine a 64-kernel chain can
    # time below a single kernel, so the two timings are never compared with each other here.
    assert kern["chain"] == 64 and kern["seconds_chain"] > 0 and kern["seconds_one"] > 0
    assert spec.kernel_overhead == pytest.approx(
        max(0.0, (kern["seconds_chain"] - kern["seconds_one"]) / (kern["chain"] - 1)))
    assert 0 <= spec.kernel_overhead < 1e-3
    assert spec.peak_flops != DEVICE_SPECS["cpu"].peak_flops and spec.platform == "cpu"
    # The links' bandwidths are the alpha-beta fits of the all-reduce timings, one per size
    # asked for; what a call costs beyond its bytes (each further operand of a combined
    # all-reduce) splits into the device's fixed cost per call and the link's latency.
    assert [x["bytes"] for x in meas["link"]] == [1 << 20, 1 << 23]
    bw, fit = fit_alpha_beta([x["bytes"] for x in meas["link"]],
                             [x["seconds"] for x in meas["link"]], participants=2)
    assert loaded.axis_link("proc").bandwidth == pytest.approx(bw) and bw > 0 and fit >= 0
    assert rec["link"]["bandwidth"] == pytest.approx(bw)
    assert rec["link"]["latency_fit"] == pytest.approx(fit)
    for key in ("link", "local_link"):
        calls = meas[f"{key}_calls"]
        assert calls["operands"] == CALL_OPERANDS > 1 and calls["bytes_per_operand"] == CALL_BYTES
        assert calls["seconds_one"] > 0 and calls["seconds_many"] > 0
        got = rec["calls"]["link_call" if key == "link" else "local_call"]
        assert got == pytest.approx(
            call_seconds(calls, participants=2, bandwidth=rec[key]["bandwidth"]))
    overhead, lat = split_call_cost(link_call=rec["calls"]["link_call"], processes=2,
                                    link_fit=fit, local_call=rec["calls"]["local_call"])
    assert overhead == pytest.approx(rec["calls"]["local_call"])
    assert rec["local_link"]["latency"] == 0.0 and rec["local_link"]["latency_fit"] >= 0
    assert spec.collective_overhead == pytest.approx(overhead) and overhead >= 0
    assert rec["device"]["collective_overhead"] == pytest.approx(overhead)
    assert rec["link"]["latency"] == pytest.approx(lat) and lat >= 0
    assert loaded.axis_link("dev").bandwidth == pytest.approx(rec["local_link"]["bandwidth"])
    assert rec["local_link"]["bandwidth"] > 0
    # A plan on the calibrated topology is priced with the measured numbers.
    assert loaded.axis_link("proc").latency == pytest.approx(rec["link"]["latency"])
    assert loaded.axis_link("dev").latency == pytest.approx(rec["local_link"]["latency"])
    assert loaded.collective_overhead() == pytest.approx(overhead)


def test_a_call_is_a_fixed_cost_and_a_latency_per_ring_step():
    """Each further operand of a combined all-reduce is one more ring all-reduce of its bytes:
    over 4 devices, ``2 x 3/4 B / bw`` plus its fixed cost ``c`` and ``2 x 3 a``."""
    bw, a, c, b, k = 1e9, 30e-6, 2e-3, 4096, 16
    per_call = 1.5 * b / bw + c + 6 * a
    calls = {"operands": k, "bytes_per_operand": b, "seconds_one": 2e-4 + per_call,
             "seconds_many": 2e-4 + k * per_call}
    assert call_seconds(calls, participants=4, bandwidth=bw) == pytest.approx(c + 6 * a)
    # noise that makes the many-operand run no slower reads 0, not a negative cost
    assert call_seconds({**calls, "seconds_many": 1e-4}, participants=4, bandwidth=bw) == 0.0
    # 2 processes of 2 devices: the call between a process's devices (memory copies, no
    # latency of their own) is c; the one between the processes, less c, the link's latency.
    got_c, got_a = split_call_cost(link_call=c + 2 * a, processes=2, link_fit=0.0, local_call=c)
    assert got_c == pytest.approx(c) and got_a == pytest.approx(a)
    # one device per process: the fit's latency, the rest is the fixed cost
    got_c, got_a = split_call_cost(link_call=c + 6 * a, processes=4, link_fit=a)
    assert got_c == pytest.approx(c) and got_a == a
    # a link call cheaper than the fixed cost reads no latency, not a negative one
    assert split_call_cost(link_call=c / 2, processes=2, link_fit=0.0, local_call=c)[1] == 0.0


def test_alpha_beta_fit_in_closed_form_and_its_refusals():
    # Ring all-reduce over 4: t = 2 * 3/4 * B / bw + 2 * 3 * a, with bw = 2 GB/s, a = 50 us.
    sizes = [1e6, 4e6, 16e6]
    times = [1.5 * b / 2e9 + 6 * 50e-6 for b in sizes]
    bw, a = fit_alpha_beta(sizes, times, participants=4)
    assert bw == pytest.approx(2e9) and a == pytest.approx(50e-6)
    with pytest.raises(HulkjaxError, match="two or more sizes"):
        fit_alpha_beta([1e6, 1e6], [1e-3, 1e-3], participants=2)
    with pytest.raises(HulkjaxError, match="do not grow with the sizes"):
        fit_alpha_beta([1e6, 2e6], [2e-3, 1e-3], participants=2)
    with pytest.raises(WorkerFailedError, match="needs 2 or more"):
        calibrate(processes=1)


def test_calibrate_command(tmp_path, capsys):
    out = tmp_path / "cal"
    assert main(["calibrate", "--processes", "2", "--matmul-size", "64", "--memory-mb", "1",
                 "--link-mb", "1", "8", "--repeats", "3", "--out", str(out),
                 "--topology-out", str(tmp_path / "mine.json"), "--timeout", str(TIMEOUT)]) == 0
    printed = capsys.readouterr().out
    assert "link between processes" in printed and "GFLOP/s" in printed
    assert "both-transposed matmuls at" in printed and "each collective call" in printed
    topo = hj.Topology.load(tmp_path / "mine.json")
    assert topo == hj.Topology.load(out / "topology.json") and topo.shape == (2,)
    rec = json.loads((out / "calibration.json").read_text())
    assert topo.axis_link("proc").bandwidth == pytest.approx(rec["link"]["bandwidth"])
