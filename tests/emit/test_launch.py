"""Planned steps as real multi-process JAX jobs: 2 processes x 2 CPU devices, gloo between them.

Every job has a timeout, so a hang fails the test instead of blocking the run. Wall-clock times are
reported by the jobs but never asserted.
"""

import json
import os
import signal
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.emit.hlo import summarize
from hulkjax.errors import ProcessLayoutError, WorkerFailedError
from hulkjax.launch import launch, process_layout, tree_error
from hulkjax.plan import Plan
from tests.helpers import zoo_losses_and_state

# Process p holds row p of the mesh: 'proc' crosses processes, 'dev' stays inside one.
TOPO = hj.Topology.grid((2, 2), ("proc", "dev"), bandwidth=(1e9, 100e9), latency=(5e-6, 1e-6))
STRATEGIES = ("dp", "megatron", "dp_tp")  # dp_tp: a 2-D plan (data on 'proc', tensor on 'dev')
STEPS = 3
TIMEOUT = 180  # seconds per job; a hung job fails with WorkerFailedError


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("launch")
    return launch("mlp", TOPO, size="tiny", strategies=list(STRATEGIES), processes=2,
                  steps=STEPS, out=str(out), timeout=TIMEOUT)


@pytest.fixture(scope="module")
def unsharded():
    """Losses and final state of the plain jitted step in this process (independent of the job)."""
    return zoo_losses_and_state("mlp", STEPS)


def test_every_plan_matches_the_unsharded_step(report, unsharded):
    losses, _ = unsharded
    assert [r["strategy"] for r in report["runs"]] == list(STRATEGIES)
    for r in report["runs"]:
        np.testing.assert_allclose(r["losses"], losses, rtol=1e-5, atol=1e-6,
                                   err_msg=f"{r['strategy']}: losses differ from the unsharded step")
        check = r["check"]
        assert check["match"], (r["strategy"], check)
        assert check["final_state"]["leaves"] == len(jax.tree_util.tree_leaves(unsharded[1]))
        np.testing.assert_allclose(check["reference_losses"], losses, rtol=1e-6)
        assert len(r["step_times"]) == 2 and all(len(t) == STEPS for t in r["step_times"])
        assert r["predicted"]["step_time"] > 0


def test_process_p_holds_the_pth_block_of_the_topology(report):
    lay = report["layout"]
    assert lay["processes"] == 2 and lay["local_devices"] == 2
    assert lay["blocks"] == [[0, 1], [2, 3]]
    assert lay["process_axes"] == ["proc"] and lay["local_axes"] == ["dev"]
    assert [d["process"] for d in report["device_map"]] == [0, 0, 1, 1]
    assert len({d["device_id"] for d in report["device_map"]}) == 4


def _single_process_collectives(plan_path):
    """The same plan compiled in this one process on 4 of its 8 fake devices."""
    m = zoo.get("mlp", size="tiny")
    plan = Plan.load(plan_path)
    step = hj.emit(m.step, plan, mesh=TOPO.mesh(jax.devices()[:4]))
    step.compile(*m.abstract())
    return {(kind, tuple(axes), v["count"], v["bytes"])
            for (kind, axes), v in summarize(step.collectives()).items()}


def test_the_multiprocess_program_has_the_planned_collectives(report):
    runs = {r["strategy"]: r for r in report["runs"]}
    for name, r in runs.items():
        got = {(c["kind"], tuple(c["axes"]), c["count"], c["bytes"]) for c in r["collectives"]}
        want = _single_process_collectives(r["plan"])
        assert got == want, name
        for c in r["collectives"]:
            assert c["crosses_processes"] == ("proc" in c["axes"])
    kinds = lambda name: {(c["kind"], tuple(c["axes"])) for c in runs[name]["collectives"]}  # noqa: E731
    # dp: one gradient all-reduce over every device, so over the network.
    assert kinds("dp") == {("all-reduce", ("proc", "dev"))}
    # megatron: activations reduced; no gradient all-reduce of whole parameters.
    assert {k for k, _ in kinds("megatron")} == {"all-reduce"}
    mp = sum(c["bytes"] for c in runs["megatron"]["collectives"])
    assert mp < sum(c["bytes"] for c in runs["dp"]["collectives"])
    # dp_tp: tensor-parallel reduction inside a process, gradient reduction across processes.
    assert kinds("dp_tp") == {("all-reduce", ("dev",)), ("all-reduce", ("proc",))}
    crossing = [c for c in runs["dp_tp"]["collectives"] if c["crosses_processes"]]
    assert [tuple(c["axes"]) for c in crossing] == [("proc",)]


def test_layouts_that_do_not_fit_the_topology_are_refused():
    with pytest.raises(ProcessLayoutError, match=r"4 devices, which 3 processes"):
        process_layout(TOPO, 3)
    with pytest.raises(ProcessLayoutError, match=r"2 processes x 4 local devices = 8"):
        process_layout(TOPO, 2, local_devices=4)
    # 'hetero' is 2 nodes of 4 GPUs: 4 processes would put half a node in each.
    with pytest.raises(ProcessLayoutError, match=r"split node 'node0'.*--processes 2"):
        process_layout(hj.Topology.preset("hetero"), 4)
    assert process_layout(hj.Topology.preset("hetero"), 2).level == "node"
    assert process_layout(hj.Topology.preset("geo"), 3).process_axes == ("region",)
    with pytest.raises(ProcessLayoutError):  # before planning or spawning anything
        launch("mlp", TOPO, size="tiny", processes=3, timeout=5)


def test_tree_error_finds_the_leaf_that_differs():
    a = {"w": np.ones((2, 2)), "b": np.zeros(3)}
    assert tree_error(a, {"w": np.ones((2, 2)) + 1e-7, "b": np.zeros(3)})["match"]
    bad = tree_error(a, {"w": np.ones((2, 2)), "b": np.array([0.0, 0.0, 1e-3])})
    assert not bad["match"] and bad["mismatched_leaves"] == ["['b']"]
    assert bad["max_abs_err"] == pytest.approx(1e-3)
    assert not tree_error(a, {"w": np.ones((2, 2))})["match"]  # structure


FAILING_MODEL = """
import jax
from hulkjax import zoo

def make():
    if jax.process_index() == 1:
        raise RuntimeError("boom on process 1: no data shard found")
    m = zoo.get("mlp", size="tiny")
    return (m.step, *m.init(seed=0))
"""


def test_a_failing_worker_stops_the_job_with_its_stderr(tmp_path):
    (tmp_path / "failing_steps.py").write_text(FAILING_MODEL)
    with pytest.raises(WorkerFailedError) as info:
        launch(f"{tmp_path / 'failing_steps.py'}:make", TOPO, strategies="dp", processes=2,
               steps=1, out=str(tmp_path / "run"), timeout=TIMEOUT)
    e = info.value
    assert e.process_id == 1 and e.returncode == 1  # failed, not timed out
    assert "boom on process 1: no data shard found" in str(e)
    assert "RuntimeError" in e.stderr and "[Gloo]" not in e.stderr
    assert not (tmp_path / "run" / "report.json").exists()


def test_a_job_past_its_timeout_is_stopped(tmp_path):
    # No 2-process job finishes in 1 s (importing JAX alone takes longer): it must be stopped.
    with pytest.raises(WorkerFailedError, match=r"ran past its timeout of 1 s") as info:
        launch("mlp", TOPO, size="tiny", strategies="dp", processes=2, steps=1,
               out=str(tmp_path), timeout=1)
    assert info.value.returncode is None and info.value.process_id is None


TRAIN_STATE_MODEL = """
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state


def make():
    model = nn.Dense(4)
    x = jnp.arange(32.0).reshape(8, 4) / 32
    ts = train_state.TrainState.create(apply_fn=model.apply,
                                       params=model.init(jax.random.PRNGKey(0), x),
                                       tx=optax.adam(1e-2))
    assert type(ts.step) is int  # the Python int TrainState.create leaves
    ema = jax.tree.map(lambda p: p.astype(jnp.bfloat16), ts.params)

    def step(state, batch):
        ts, decay = state["ts"], state["decay"]
        loss_fn = lambda p: jnp.mean((ts.apply_fn(p, batch["x"]) - batch["y"]) ** 2)
        loss, g = jax.value_and_grad(loss_fn)(ts.params)
        ts = ts.apply_gradients(grads=g)
        # A weakly typed Python float keeps the bfloat16 average in bfloat16 (under jax.jit).
        ema = jax.tree.map(lambda e, p: e * decay + p.astype(jnp.bfloat16) * (1 - decay),
                           state["ema"], ts.params)
        return {"ts": ts, "ema": ema, "decay": decay}, {"loss": loss, "step": ts.step}

    return step, {"ts": ts, "ema": ema, "decay": 0.75}, {"x": x, "y": jnp.cos(x)}
"""


def test_python_scalars_in_the_state_run_as_a_job(tmp_path):
    """A flax TrainState straight from create (a Python int step) and a Python float that keeps
    a bfloat16 average in bfloat16: every process takes them as jax.jit does (weakly typed,
    placed with device_put), so the plans' graphs match and each run equals the unsharded step."""
    (tmp_path / "ts_steps.py").write_text(TRAIN_STATE_MODEL)
    report = launch(f"{tmp_path / 'ts_steps.py'}:make", TOPO, strategies=["dp", "fsdp"],
                    processes=2, steps=STEPS, out=str(tmp_path / "run"), timeout=TIMEOUT)
    for r in report["runs"]:
        # The bfloat16 averages get the tolerance of their own (bfloat16-sized) spread.
        assert r["check"]["tolerance"]["source"] == "float64 reference"
        assert r["check"]["match"], (r["strategy"], r["check"])
        np.testing.assert_allclose(r["losses"], r["check"]["reference_losses"], rtol=1e-5)
        assert [m["step"] for m in r["metrics"]] == [1, 2, 3]
        # step, kernel, bias, adam's count, mu and nu of kernel and bias, the averages, decay
        assert r["check"]["final_state"]["leaves"] == 11


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_real_cluster_mode_one_command_per_host(tmp_path):
    """`hulkjax launch --coordinator ...` on each 'host'; process 0 plans and broadcasts."""
    topo_path = tmp_path / "grid.json"
    TOPO.save(topo_path)
    out = tmp_path / "run"
    coordinator = f"127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "hulkjax.cli", "launch", "--coordinator", coordinator,
         "--num-processes", "2", "--process-id", str(i), "--local-devices", "2",
         "--model", "mlp", "--size", "tiny", "--topology", str(topo_path), "--strategy", "fsdp",
         "--steps", "2", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for i, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i}: {err[-3000:]}"
    assert "match" in outs[0][0] and "done" in outs[1][0]
    report = json.loads((out / "report.json").read_text())
    (run,) = report["runs"]
    assert run["strategy"] == "fsdp" and run["check"]["match"]
    assert {c["kind"] for c in run["collectives"]} == {"all-gather", "all-reduce"}
    assert (out / "plan-fsdp.json").exists()


def _gpt2_runs(strategies=("dp", "dp_tp")):
    """The tiny GPT-2 (3 AdamW steps) sharded on 2x2 of this process's fake devices, as the
    worker records runs: metrics per step and the final state on the host."""
    from hulkjax.loading import load_step

    model = load_step("gpt2", size="tiny")
    state0, batch = model.init(0)
    host = jax.tree_util.tree_map(np.asarray, (state0, batch))
    runs = []
    for strategy in strategies:
        plan = hj.plan(model.step, *host, topology=TOPO, strategy=strategy)
        step = hj.emit(model.step, plan, mesh=TOPO.mesh(jax.devices()[:4]))
        state, metrics = host[0], []
        for _ in range(STEPS):
            state, m = step(state, host[1])
            metrics.append(jax.tree_util.tree_map(lambda x: float(np.asarray(x)), m))
        runs.append({"strategy": strategy, "metrics": metrics,
                     "_final": jax.tree_util.tree_map(np.asarray, state)})
    return model, host, runs


def test_the_check_tolerates_rounding_and_still_catches_a_wrong_result():
    """The issue-13 false alarm: a correct tiny GPT-2 differs from the unsharded step by ~1e-4
    after three AdamW steps (rounding in near-zero gradients, amplified by Adam's normalization),
    which fixed rtol 1e-4 / atol 1e-5 called a MISMATCH. The measured tolerance accepts it; a
    result moved by one update is still a MISMATCH.

    How far rounding moves a correct run depends on the CPU (XLA:CPU's kernels sum in the order
    its vector width gives: a clean-clone CI on another machine moved it less than the old atol),
    so the old tolerance's verdict is not asserted; what is: every correct run matches, within a
    tolerance scaled from the measured spread, and a perturbed one does not. (A tenth of an
    update is within that tolerance on some CPUs: on an AMD EPYC under the tests' XLA flags the
    perturbed leaf's float32/float64 spread is 9.0e-6, so 16x that, 1.4e-4, exceeds 1e-4.)"""
    from hulkjax.cli import _print_launch_report  # noqa: F401 -- the printer is tested below
    from hulkjax.launch import Job, check_against_unsharded

    model, host, runs = _gpt2_runs()
    job = Job(model="gpt2", plans=("unused.json",), steps=STEPS)
    checks = check_against_unsharded(model, *host, job, runs)
    for r, c in zip(runs, checks):
        tol = c["tolerance"]
        assert tol["source"] == "float64 reference" and tol["safety"] == job.safety
        assert 0 < tol["final_state_spread"] < 1e-3
        assert c["match"], (r["strategy"], c["final_state"])
        assert c["final_state"]["worst_ratio"] <= 1

    # Perturb one element of one parameter by one AdamW step (lr = 1e-3 here).
    bad = dict(runs[0])
    final = jax.tree_util.tree_map(np.array, bad["_final"])
    kernel = final["params"]["h_0"]["attn"]["query"]["kernel"]
    kernel.flat[7] += 1e-3
    bad["_final"] = final
    (c,) = check_against_unsharded(model, *host, job, [bad])
    assert not c["match"]
    assert c["final_state"]["mismatched_leaves"] == ["['params']['h_0']['attn']['query']['kernel']"]
    assert c["final_state"]["worst_ratio"] > 1


def test_tree_error_with_a_spread_scales_each_leaf():
    exp = {"a": np.array([1.0, 2.0]), "b": np.array([0.0]), "n": np.array(3)}
    got = {"a": np.array([1.0, 2.0 + 1e-3]), "b": np.array([1e-6]), "n": np.array(3)}
    ok = tree_error(got, exp, spread=[1e-4, 1e-7, 0.0], safety=16)
    assert ok["match"] and ok["max_spread"] == 1e-4
    assert ok["worst_ratio"] == pytest.approx(1e-6 / (16 * 1e-7))  # leaf b is the tightest
    bad = tree_error(got, exp, spread=[1e-5, 1e-7, 0.0], safety=16)  # 1e-3 > 16 x 1e-5 + 4 ulp
    assert not bad["match"] and bad["mismatched_leaves"] == ["['a']"]
    # A leaf both references compute exactly (an integer counter) must be exact.
    assert not tree_error(got | {"n": np.array(4)}, exp, spread=[1e-4, 1e-7, 0.0])["match"]


def test_a_metric_whose_spread_sample_is_zero_keeps_the_earlier_steps_tolerance():
    """A false alarm seen on the WAN testbed: a 6-layer GPT's loss at step 7 happened to round
    alike in the float32 and float64 references (spread ~0), and a correct dp run that summed in
    another order was 6e-6 off and called a MISMATCH. The spread of a per-step metric is the
    running maximum over the steps; a loss off by a real amount still fails."""
    from hulkjax.launch.arrays import running_max_over_steps

    ref = [{"loss": 5.6}, {"loss": 5.2}, {"loss": 4.26}]
    raw = [3e-7, 5e-6, 0.0]
    spread = running_max_over_steps(ref, raw)
    assert spread == [3e-7, 5e-6, 5e-6]
    close = [{"loss": 5.6}, {"loss": 5.2}, {"loss": 4.26 + 6e-6}]
    assert not tree_error(close, ref, spread=raw, safety=16)["match"]  # the false alarm
    assert tree_error(close, ref, spread=spread, safety=16)["match"]
    wrong = [{"loss": 5.6}, {"loss": 5.2}, {"loss": 4.26 + 1e-3}]
    assert not tree_error(wrong, ref, spread=spread, safety=16)["match"]
