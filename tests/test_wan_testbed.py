"""The wide-area testbed's network (``benchmarks/wan/testbed.py``): regions as network namespaces
joined through a bridge, each uplink shaped with tbf, and nothing left behind, also when the run
fails, and the report it writes. The network tests need root and network namespaces and skip
otherwise, saying which is missing. Rates are configured and checked in ``tc``'s own report,
never timed."""

import importlib.util
import os
import pathlib
import subprocess

import pytest

TESTBED = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "wan" / "testbed.py"


def _netns_ok() -> str | None:
    if os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    probe = f"hjwtest{os.getpid() % 10000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create network namespaces here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


needs_netns = pytest.mark.skipif(_netns_ok() is not None, reason=f"WAN testbed: {_netns_ok()}")


@pytest.fixture(scope="module")
def testbed():
    spec = importlib.util.spec_from_file_location("wan_testbed", TESTBED)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _qdiscs(ns, dev):
    return subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev],
                          capture_output=True, text=True, check=True).stdout


@needs_netns
def test_regions_are_shaped_reachable_and_torn_down(testbed):
    tag = f"t{os.getpid() % 1000}"
    net = testbed.Regions([40.0, 80.0, 40.0], tag)
    with net:
        assert sorted(testbed.leftovers(tag)) == sorted([net.core, *net.ns])
        net.shape(True)
        for i, rate in enumerate((40, 80, 40)):
            up, down = _qdiscs(net.ns[i], net.dev[i]), _qdiscs(net.core, net.port[i])
            assert "tbf" in up and f"rate {rate}Mbit" in up, up
            assert "tbf" in down and f"rate {rate}Mbit" in down, down
        rtt, goodput = net.probe(0, 2, megabytes=1)  # through the bridge, region 0 to region 2
        assert rtt > 0 and goodput > 0
        net.shape(False)
        assert "tbf" not in _qdiscs(net.ns[0], net.dev[0])
    assert testbed.leftovers(tag) == []


@needs_netns
def test_nothing_is_left_when_the_run_fails_inside(testbed):
    tag = f"f{os.getpid() % 1000}"
    with pytest.raises(RuntimeError, match="a worker failed"):
        with testbed.Regions([100.0, 100.0], tag) as net:
            net.shape(True)
            raise RuntimeError("a worker failed")
    assert testbed.leftovers(tag) == []


@needs_netns
def test_a_failed_setup_removes_what_it_made(testbed):
    tag = f"s{os.getpid() % 1000}"
    net = testbed.Regions([100.0, 100.0], tag, subnet="10.214.300")  # an invalid address
    with pytest.raises(subprocess.CalledProcessError):
        net.__enter__()
    assert testbed.leftovers(tag) == []


@needs_netns
def test_a_staged_plan_runs_between_namespaces(testbed):
    """Two sites, each a network namespace with one JAX process of two devices: the stages of a
    1F1B pipeline exchange activations and gradients over the bridge (cross-host
    ``jax.device_put``), and the job's result equals the unsharded step. Before the bulk
    transports listened on each process's reachable address, the first transfer was refused
    (JAX's default ``0.0.0.0`` sent the peer to its own namespace)."""
    import hulkjax as hj
    from hulkjax.launch import launch

    sites = hj.Topology.preset("regional", regions=2, gpus_per_node=2, device="A100")
    tag = f"p{os.getpid() % 1000}"
    with testbed.Regions([200.0, 200.0], tag, subnet="10.214.11") as net:
        net.shape(True)
        report = launch("gpt2", sites, size="tiny", overrides={"batch": 8},
                        strategies="pipeline", processes=2, steps=2, host=net.ip[0],
                        prefix=net.prefix, timeout=240,
                        plan_options={"microbatches": 4, "schedule": "1f1b"})
    assert testbed.leftovers(tag) == []
    (run,) = report["runs"]
    assert [s["process"] for s in run["stages"]] == [0, 1]
    moved = {(tuple(t["from_processes"]), tuple(t["to_processes"])): t for t in run["transfers"]}
    assert moved[((0,), (1,))]["count"] >= 4 and moved[((1,), (0,))]["count"] >= 4
    assert run["check"]["match"], run["check"]


@needs_netns
def test_each_region_runs_on_cores_of_its_own(testbed):
    cpus = sorted(os.sched_getaffinity(0))
    for regions in range(1, len(cpus) + 1):
        pins = testbed.pinning(regions)
        flat = [c for p in pins for c in p]
        assert len(pins) == regions and all(pins) and len(set(flat)) == len(flat)
        assert set(flat) <= set(cpus)
    assert testbed.pinning(len(cpus) + 1) is None  # fewer cores than regions: not pinned
    net = testbed.Regions([100.0] * len(cpus), "p")
    assert net.prefix(0)[4:7] == ["taskset", "-c", ",".join(map(str, net.cpus[0]))]
    assert "taskset" not in testbed.Regions([100.0] * (len(cpus) + 1), "p").prefix(0)
    # A pinned process runs where it is told (the command the workers start under).
    out = subprocess.run(["taskset", "-c", str(cpus[-1]), "python3", "-c",
                          "import os; print(sorted(os.sched_getaffinity(0)))"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == str([cpus[-1]])


# The report (no namespaces needed): which measured orders the noise explains.

def _row(name, predicted, steps):
    """A row measured on one process: ``steps`` (s), the first a warm-up."""
    return {"strategy": name, "predicted_step": predicted,
            "measured_step": sorted(steps[1:])[len(steps[1:]) // 2],
            "step_times": [list(steps)]}  # one process


def test_swapped_pairs_within_noise_are_told_from_real_misrankings(testbed):
    a = _row("a", 1.0, [9.0, 1.10, 1.02, 1.06, 1.04])   # predicted faster, measured 1.04-1.06
    b = _row("b", 1.1, [9.0, 1.00, 1.05, 1.03, 1.01])   # measured 1.01-1.04: overlaps a
    c = _row("c", 0.5, [9.0, 2.0, 2.1, 2.2, 2.05])      # predicted fastest, measured slowest
    swapped = {(x["strategy"], y["strategy"]): noise for x, y, noise in
               testbed._swapped([a, b, c])}
    assert swapped == {("a", "b"): True, ("c", "a"): False, ("c", "b"): False}
    assert testbed._swapped([a, c | {"predicted_step": 3.0}]) == []  # same order: none


def test_summary_states_the_targets_per_run(testbed):
    """WAN.md's summary row: auto against dp and the best measured SPMD baseline (pipeline is
    not SPMD) with the predicted ratio beside it, the ranking verdict, the communication-bound plans within 30%, and whether the
    processes had cores of their own."""
    rows = [_row("replicate", 1.0, [9, 1.2, 1.2, 1.2]) | {"plan": "SPMD"},
            _row("dp", 5.0, [9, 5.5, 5.5, 5.5]) | {"plan": "SPMD"},
            _row("pipeline", 0.9, [9, 0.8, 0.8, 0.8]) | {"plan": "2 stages x 4 mb (1f1b)"},
            _row("auto", 0.8, [9, 0.6, 0.6, 0.6]) | {"plan": "2 stages x 8 mb (1f1b)"}]
    for r, comm in zip(rows, (0.0, 4.5, 0.2, 0.2)):
        r["predicted_comm"] = comm
    run = {"regions": 2, "devices_per_region": 1, "rates_mbit": [100, 100], "model": "m",
           "cpus": 2, "pinning": [[0], [1]], "overrides": {"batch": 16, "n_layers": 8},
           "rows": rows}
    (row,) = [ln for ln in testbed.summary([run]) if ln.startswith("| 2 x 1")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["2 x 1, 100/100 Mbit/s", "`m`, n_layers 8", "pinned",
                     "2 stages x 8 mb (1f1b)", "9.17x", "2.00x (`replicate`; predicted 1.25x)",
                     "same", "1/1",
                     "0.75-1.20"]
    shared = testbed.summary([run | {"devices_per_region": 2}])
    assert "shared (2 processes, 4 devices on 2 cores)" in "\n".join(shared)
    wrong = rows[:3] + [_row("auto", 0.8, [9, 1.5, 1.5, 1.5]) | {"predicted_comm": 0.2}]
    assert "| 2 pair(s) wrong |" in "\n".join(testbed.summary([run | {"rows": wrong}]))
    # a run without dp keeps its row, with "-" where dp's ratio would be
    (no_dp,) = [ln for ln in testbed.summary([run | {"rows": [rows[0], *rows[2:]]}])
                if ln.startswith("| 2 x 1")]
    assert [c.strip() for c in no_dp.strip("|").split("|")][3:6] == [
        "2 stages x 8 mb (1f1b)", "-", "2.00x (`replicate`; predicted 1.25x)"]
    # Under each run: the model's own ratio beside the measured one, and on shared cores why a
    # measured ratio far above it is not the network's
    assert "Predicted: 1.25x `replicate`." in testbed._targets(rows)
    assert any(t.startswith("Predicted: 1.25x `replicate`; on shared cores")
               for t in testbed._targets(rows, shared=True))


def test_plans_predicted_equal_are_ties_not_misrankings(testbed):
    a = _row("dp", 2.0, [9.0, 2.8, 2.8, 2.8])
    b = _row("fsdp", 2.0, [9.0, 2.7, 2.7, 2.7])   # predicted equal, measured faster
    c = _row("auto", 1.0, [9.0, 1.5, 1.5, 1.5])
    assert testbed._ties([a, b, c]) == [("dp", "fsdp")]
    assert testbed._swapped([a, b, c]) == []
    assert testbed._ties([a, c]) == []


def test_predicted_comm_is_what_shaped_links_add_to_the_same_plan(testbed):
    """A staged plan's exposed transfers count as its predicted communication (its collective
    time is 0), as the measured comm (shaped - unshaped step) counts them; an SPMD plan's is its
    collectives between regions."""
    import jax.numpy as jnp

    import hulkjax as hj
    from hulkjax import zoo

    m = zoo.get("gpt2", size="tiny", batch=8, n_layers=4)
    margs = m.abstract()
    graph = hj.trace(m.step, *margs)

    def sites(bw):
        return hj.Topology.preset("regional", regions=2, gpus_per_node=1,
                                  metro=hj.LinkSpec(bandwidth=bw, latency=1e-4))

    slow, free = sites(2e6), sites(2e9)
    staged = hj.plan(m.step, *margs, topology=slow, strategy="pipeline", graph=graph)
    assert staged.stages is not None and abs(staged.cost.comm_time) < 1e-12
    free_step = testbed.free_step(staged, graph, m.step, margs, free)
    assert free_step >= staged.cost.compute_time  # its stages' work stays
    assert staged.cost.step_time - free_step > 0.05 * staged.cost.step_time  # its sends go
    dp = hj.plan(m.step, *margs, topology=slow, strategy="dp", graph=graph)
    dp_comm = dp.cost.step_time - testbed.free_step(dp, graph, m.step, margs, free)
    assert dp_comm == pytest.approx(dp.cost.comm_time, rel=0.05)
    assert jnp.isfinite(dp_comm)
    # Another mesh has other candidates: no prediction, and no exception (the run's
    # measurements, taken before, are kept).
    other = hj.Topology.preset("regional", regions=4, gpus_per_node=1,
                               metro=hj.LinkSpec(bandwidth=2e9, latency=1e-4))
    assert testbed.free_step(dp, graph, m.step, margs, other) is None


def test_third_party_models_load_as_launch_user_steps(testbed):
    """``--model benchmarks/wan/thirdparty.py:gpt2`` (Hugging Face's Flax GPT-2): every process of
    the job rebuilds the same step and arrays from the spec, and the results name its size."""
    import jax
    import numpy as np

    from hulkjax.loading import absolute_spec, load_step

    spec = absolute_spec(str(TESTBED.parent / "thirdparty.py") + ":gpt2")
    a, b = load_step(spec), load_step(spec)
    state, batch = a.args
    assert sorted(batch) == ["attention_mask", "input_ids", "targets"]
    for x, y in zip(jax.tree_util.tree_leaves(a.args), jax.tree_util.tree_leaves(b.args)):
        np.testing.assert_array_equal(x, y)  # the same initialization in every process
    params = sum(x.size for x in jax.tree_util.tree_leaves(state["params"]))
    text = testbed._model_config({"model_params": params,
                                  "model_batch": {k: list(v.shape) for k, v in batch.items()}})
    assert text.startswith(f"{params / 1e6:.2f}M parameters, batch ") and "input_ids 16x128" in text
    assert testbed._model_config({"overrides": {"batch": 12, "n_layers": 6}}) == "batch 12, n_layers 6"


def test_a_run_states_its_calibrated_call_cost_and_what_the_2x2_runs_really_measured(testbed):
    """The committed 2 x 2 run (``benchmarks/results/wan-2x2.json``): its section states the
    latency per ring step and the fixed cost of each collective call it planned with (what
    XLA:CPU pays once per operand of a combined all-reduce), and no longer puts the older runs'
    errors down to oversubscription; a run from before either field keeps its own wording."""
    import json

    res = json.loads((TESTBED.parents[1] / "results" / "wan-2x2.json").read_text())
    text = testbed.markdown(res)
    overhead = res["calibration"]["device"]["collective_overhead"]
    assert overhead > 0 and res["wan_latency"] >= res["rtt"] / 2
    assert f"each collective call costs a further {overhead * 1e3:.2f} ms" in text
    assert f"{res['wan_latency'] * 1e6:.0f} us (calibrated, at least the round trip / 2)" in text
    assert "the cause was the fixed cost of each gloo call" in text
    old = {k: v for k, v in res.items() if k != "wan_latency"}
    old_text = testbed.markdown(old)
    assert "which is the latency the topology uses" in old_text
    assert "runs from 2026-11-28 on do" in old_text


def test_replan_says_whether_the_measured_plans_are_still_the_ones_planned(testbed, tmp_path,
                                                                         monkeypatch, capsys):
    """``--replan`` plans a recorded run's strategies again on its recorded topology: the same
    plans and predictions pass; a recorded prediction that the planner no longer makes, or a
    plan it no longer chooses, is reported and fails."""
    import json

    res = json.loads((pathlib.Path(testbed.RESULTS_DIR) / "wan-3x1.json").read_text())
    res["rows"] = [r for r in res["rows"] if r["strategy"] in ("dp", "pipeline")]
    monkeypatch.setattr(testbed, "RESULTS_DIR", str(tmp_path))
    (tmp_path / "wan-3x1.json").write_text(json.dumps(res))
    assert testbed.replan() == 0
    assert "every plan and prediction as measured" in capsys.readouterr().out
    res["rows"][0]["predicted_step"] *= 1.01
    res["rows"][1]["plan"] = "SPMD"
    (tmp_path / "wan-3x1.json").write_text(json.dumps(res))
    assert testbed.replan() == 1
    out = capsys.readouterr().out
    assert "2 plan(s) or prediction(s) differ" in out
    assert "now: 3 stages x 3 mb (1f1b)" in out
