"""Staged (pipeline) plans as real multi-process JAX jobs on loopback: each stage in its own
process, activations and gradients sent between processes with cross-host ``jax.device_put``,
the final state checked against the unsharded step.

Every job has a timeout, so a hang fails the test instead of blocking the run. Wall-clock times are
reported by the jobs but never asserted.
"""

import jax
import numpy as np
import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.errors import ProcessLayoutError
from hulkjax.launch import launch
from tests.helpers import zoo_losses_and_state

TIMEOUT = 180  # seconds per job; a hung job fails with WorkerFailedError
STEPS = 2

# Two node groups of 2 devices (an SPMD layout inside each stage), and three of 1 device.
TWO = hj.Topology.preset("hetero", nodes=(("A100", 2), ("V100", 2)))
THREE = hj.Topology.preset("hetero", nodes=(("A100", 1), ("V100", 1), ("T4", 1)))


def _unsharded(name, steps=STEPS, **cfg):
    """Losses and final state of the plain jitted step in this process (independent of the job)."""
    return zoo_losses_and_state(name, steps, **cfg)


def _check_staged_run(report, processes, stages, microbatches, name, **cfg):
    (run,) = report["runs"]
    assert run["strategy"] == "pipeline"
    assert report["layout"]["processes"] == processes
    # The stages really ran in different processes ...
    assert len(run["stages"]) == stages
    owners = [s["process"] for s in run["stages"]]
    assert sorted(set(owners)) == list(range(processes)), owners
    assert run["microbatches"] == microbatches
    # ... and values crossed between them: forward activations downstream and gradients
    # upstream, for every microbatch, between every pair of neighbouring processes.
    moved = {(tuple(t["from_processes"]), tuple(t["to_processes"])): t for t in run["transfers"]}
    for p in range(processes - 1):
        for pair in (((p,), (p + 1,)), ((p + 1,), (p,))):
            assert pair in moved, (pair, run["transfers"])
            assert moved[pair]["count"] >= microbatches and moved[pair]["bytes"] > 0
    if all(len(st["devices"]) == 1 for st in run["stages"]):
        # One device per stage: the bytes that crossed are the plan's transfers exactly (a
        # boundary activation goes once per microbatch, though the receiving stage's backward
        # reads it again; it used to be sent a second time).
        assert _bytes_between_processes(run) == _predicted_bytes(run), run["transfers"]
    # The result equals the unsharded step: the job's own check (tolerance from the float64
    # spread) and the losses of an independent run in this process.
    check = run["check"]
    assert check["match"], check
    assert check["tolerance"]["source"] == "float64 reference"
    losses, final = _unsharded(name, **cfg)
    np.testing.assert_allclose(run["losses"], losses, rtol=1e-5, atol=1e-6)
    assert check["final_state"]["leaves"] == len(jax.tree_util.tree_leaves(final))
    assert len(run["step_times"]) == processes
    return run


def _bytes_between_processes(run) -> dict:
    return {(tuple(t["from_processes"]), tuple(t["to_processes"])): t["bytes"]
            for t in run["transfers"]}


def _predicted_bytes(run) -> dict:
    """The plan's transfers per pair of processes: per microbatch x microbatches + per step."""
    owner = [(s["process"],) for s in run["stages"]]
    out: dict = {}
    for t in run["predicted"]["transfers"]:
        pair = (owner[t["src"]], owner[t["dst"]])
        nbytes = t["microbatch_bytes"] * run["microbatches"] + t["step_bytes"]
        if pair[0] != pair[1] and nbytes:
            out[pair] = out.get(pair, 0) + int(nbytes)
    return out


def test_two_stages_in_two_processes_match_the_unsharded_step(tmp_path):
    """1F1B over 2 microbatches; each stage is a 2-device SPMD program in its own process."""
    report = launch("mlp", TWO, size="tiny", strategies="pipeline", processes=2, steps=STEPS,
                    out=str(tmp_path), timeout=TIMEOUT,
                    plan_options={"microbatches": 2, "schedule": "1f1b"})
    run = _check_staged_run(report, processes=2, stages=2, microbatches=2, name="mlp")
    assert [s["devices"] for s in run["stages"]] == [[0, 1], [2, 3]]
    assert run["schedule"] == "1f1b"
    # Collectives stay inside stages (each stage's own mesh axes), none between processes.
    assert all(not c["crosses_processes"] and c["axes"][0][0] == "s" for c in run["collectives"])


def test_three_stages_in_three_processes_with_a_tied_embedding(tmp_path):
    """GPT-2 over three processes, GPipe over 2 microbatches: the embedding is read by the first
    and the last stage (its gradient comes back across two processes)."""
    report = launch("gpt2", THREE, size="tiny", strategies="pipeline", processes=3, steps=STEPS,
                    overrides={"optimizer": "sgd"}, out=str(tmp_path), timeout=TIMEOUT,
                    plan_options={"microbatches": 2, "schedule": "gpipe"})
    run = _check_staged_run(report, processes=3, stages=3, microbatches=2, name="gpt2",
                            optimizer="sgd")
    assert run["schedule"] == "gpipe"
    moved = {(tuple(t["from_processes"]), tuple(t["to_processes"])) for t in run["transfers"]}
    assert ((0,), (2,)) in moved and ((2,), (0,)) in moved  # the tied embedding and its gradient


def test_gradients_left_unreduced_are_reduced_once_per_step_across_processes(tmp_path):
    """Two sites of 2 nodes x 2 devices, one process each: dp_tp splits each stage's batch
    over its nodes, so the stages accumulate their gradients unreduced and reduce them once per
    step (the last stage's share of the tied embedding's gradient is reduced, then sent to the
    first stage's update in the other process).

    It is also 1F1B over more microbatches (4) than stages (2): each process would dispatch
    programs waiting on the other's values until XLA:CPU's in-flight limit blocks the send the
    other waits for (a hang before the receiver waited for each value it is sent)."""
    sites = hj.Topology.preset("regional", regions=2, nodes_per_region=2, gpus_per_node=2)
    m = zoo.get("gpt2", size="tiny", batch=8)
    plan = hj.plan(m.step, *m.abstract(), topology=sites, strategy="pipeline", microbatches=4)
    assert all(st.unreduced for st in plan.stages)
    report = launch("gpt2", sites, size="tiny", overrides={"batch": 8}, strategies="pipeline",
                    processes=2, steps=STEPS, out=str(tmp_path), timeout=TIMEOUT,
                    plan_options={"microbatches": 4, "schedule": "1f1b"})
    run = _check_staged_run(report, processes=2, stages=2, microbatches=4, name="gpt2", batch=8)
    assert run["schedule"] == "1f1b"


def test_an_interleaved_pipeline_runs_its_chunks_in_their_groups_processes(tmp_path):
    """Interleaved 1F1B over two processes: four chunks of a 4-layer GPT-2, chunk j on group
    j % 2, so each process runs two non-adjacent chunks and values cross processes at every
    chunk boundary (three each way per microbatch)."""
    report = launch("gpt2", TWO, size="tiny", overrides={"n_layers": 4}, strategies="pipeline",
                    processes=2, steps=STEPS, out=str(tmp_path), timeout=TIMEOUT,
                    plan_options={"microbatches": 4, "schedule": "interleaved",
                                  "virtual_stages": 2})
    run = _check_staged_run(report, processes=2, stages=4, microbatches=4, name="gpt2",
                            n_layers=4)
    assert run["schedule"] == "interleaved"
    assert [s["process"] for s in run["stages"]] == [0, 1, 0, 1]
    moved = {(tuple(t["from_processes"]), tuple(t["to_processes"])): t["count"]
             for t in run["transfers"]}
    assert moved[((0,), (1,))] >= 2 * 4 and moved[((1,), (0,))] >= 4


def test_two_stages_per_process(tmp_path):
    """Four one-device stages in two processes: values move inside a process between its own
    stages, and across processes between the second and third stage only."""
    four = hj.Topology.preset("hetero", nodes=(("A100", 1), ("V100", 1), ("T4", 1), ("T4", 1)))
    report = launch("mlp", four, size="tiny", overrides={"depth": 4}, strategies="pipeline",
                    processes=2, steps=STEPS, out=str(tmp_path), timeout=TIMEOUT,
                    plan_options={"microbatches": 2})
    run = _check_staged_run(report, processes=2, stages=4, microbatches=2, name="mlp", depth=4)
    assert [s["process"] for s in run["stages"]] == [0, 0, 1, 1]


WRONG_TRANSFER = """
import jax
from hulkjax import zoo
from hulkjax.emit import transfer

_move = transfer.move


def shifted(x, want, crossings=None):
    # A broken link: every value that crosses processes arrives off by one.
    n = len(crossings) if crossings is not None else 0
    y = _move(x, want, crossings)
    if crossings is not None and len(crossings) > n and y.is_fully_addressable:
        y = y + 1
    return y


def make():
    transfer.move = shifted
    m = zoo.get("mlp", size="tiny")
    return (m.step, *m.init(seed=0))
"""


def test_a_wrong_transfer_fails_the_check(tmp_path):
    """The check has teeth: the same job with every cross-process value off by one is a
    MISMATCH (the model file patches the transfer in every process)."""
    (tmp_path / "wrong_transfer.py").write_text(WRONG_TRANSFER)
    report = launch(f"{tmp_path / 'wrong_transfer.py'}:make", TWO, strategies="pipeline",
                    processes=2, steps=STEPS, out=str(tmp_path / "run"), timeout=TIMEOUT,
                    plan_options={"microbatches": 2})
    (run,) = report["runs"]
    assert sum(t["count"] for t in run["transfers"]) > 0
    assert not run["check"]["match"]
    assert run["check"]["final_state"]["mismatched_leaves"]


def test_a_stage_split_across_processes_is_refused(tmp_path):
    """Stages per region, processes per node: a stage would span two processes. Refused before
    any process starts, saying how to launch instead."""
    geo = hj.Topology.preset("geo", regions=2, gpus_per_region=2, nodes_per_region=2)
    with pytest.raises(ProcessLayoutError, match=r"stage 0 .* split across processes \[0, 1\]"
                                                  r".*--processes 2"):
        launch("mlp", geo, size="tiny", strategies="pipeline", processes=4, steps=1,
               out=str(tmp_path), timeout=TIMEOUT)
    assert not (tmp_path / "job.json").exists()
