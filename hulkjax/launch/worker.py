"""One process of a launch job: join ``jax.distributed``, load the step and the plans, run them.

``python -m hulkjax.launch worker ...`` (spawned by :func:`hulkjax.launch.launch`) and ``hulkjax
launch --coordinator ...`` (one host of a real cluster) both end in :func:`run_worker`. It must run
before JAX initializes its backends in the process: importing hulkjax starts none.

An SPMD plan becomes one program over the job's global mesh (inputs placed shard by shard with
:func:`hulkjax.launch.arrays.to_global`). A staged plan becomes a
:class:`~hulkjax.emit.mpmd.StagedStep` over the same devices: each process compiles and runs the
programs of the stages it holds, every process runs the same schedule, and values between stages
in different processes go with cross-host ``jax.device_put`` (:mod:`hulkjax.emit.transfer`); the
results are sent to process 0 for the report and the check.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
import traceback

import jax
import numpy as np

from hulkjax import api
from hulkjax.emit import transfer
from hulkjax.emit.hlo import summarize
from hulkjax.emit.mpmd import StagedStep
from hulkjax.errors import HulkjaxError, InvalidPlanError, UnsupportedStepError
from hulkjax.launch.arrays import running_max_over_steps, to_global, tree_error, tree_spread
from hulkjax.launch.job import REPORT_FORMAT, Job
from hulkjax.launch.layout import check_stages, ordered_devices, process_layout
from hulkjax.loading import LoadedStep, load_step
from hulkjax.plan.records import Plan
from hulkjax.topology import Topology
from hulkjax.trace.tracer import PYTHON_SCALARS

log = logging.getLogger("hulkjax.launch")


def check_runnable(model: LoadedStep) -> None:
    """A user's step must come with concrete arrays: launch runs it (zoo models have ``init``)."""
    if model.init is not None:
        return
    leaves = jax.tree_util.tree_flatten_with_path(model.args)[0]
    abstract = [jax.tree_util.keystr(p) for p, x in leaves if isinstance(x, jax.ShapeDtypeStruct)]
    if abstract:
        raise UnsupportedStepError(
            f"launch runs the step, but {model.name}() returned jax.ShapeDtypeStruct leaves "
            f"({', '.join(abstract[:4])}{', ...' if len(abstract) > 4 else ''}), which hold no "
            f"values. Return concrete arrays for launch (plan and compare accept abstract ones).")


def _concrete_args(model: LoadedStep, seed: int) -> tuple:
    """``(state, batch)`` as host numpy trees (zoo: ``init(seed)``; user steps: what they return)."""
    check_runnable(model)
    args = model.init(seed) if model.init is not None else model.args

    def host(x):
        if isinstance(x, PYTHON_SCALARS):  # weakly typed under jax.jit: keep them as they are
            return x
        try:
            return np.asarray(x)
        except (TypeError, ValueError):  # PRNG keys stay jax arrays
            return x

    return jax.tree_util.tree_map(host, args)


def _fingerprint(tree) -> int:
    h = hashlib.sha256()
    for x in jax.tree_util.tree_leaves(tree):
        if isinstance(x, PYTHON_SCALARS):
            a = np.asarray(x)
            h.update(type(x).__name__.encode())
        else:
            a = np.asarray(x) if isinstance(x, np.ndarray) else np.asarray(jax.random.key_data(x))
        h.update(str((a.shape, a.dtype.str)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return int.from_bytes(h.digest()[:7], "little")  # fits an int64


def _init_distributed(coordinator: str, num_processes: int, process_id: int,
                      local_devices: int | None, init_timeout: int) -> None:
    """``jax.distributed.initialize``; on CPU first ask for ``local_devices`` devices and turn on
    cross-host ``device_put`` (a transfer server on this host's address towards the coordinator,
    :func:`hulkjax.emit.transfer.enable`), which staged plans send values between processes
    with."""
    if local_devices is not None:
        os.environ["JAX_PLATFORMS"] = "cpu"
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", int(local_devices))
        transfer.enable(transfer.reachable_address(coordinator))
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=init_timeout)


def _broadcast_plan(plan_dict: dict | None) -> dict:
    """Process 0's plan (a JSON dict) on every process, through the job's own collectives."""
    from jax.experimental import multihost_utils

    data = b"" if plan_dict is None else json.dumps(plan_dict).encode()
    n = int(multihost_utils.broadcast_one_to_all(np.array(len(data), np.int64)))
    buf = np.frombuffer(data, np.uint8) if data else np.zeros(n, np.uint8)
    buf = multihost_utils.broadcast_one_to_all(buf)
    return json.loads(np.asarray(buf, np.uint8).tobytes().decode())


def _job_plans(job: Job, model: LoadedStep, process_id: int) -> list:
    if job.plans:
        return [Plan.load(p) for p in job.plans]
    plans = []
    for strategy in job.strategies:
        d = None
        if process_id == 0:
            log.info("process 0: planning %s", strategy)
            plan = api.plan(model.step, *model.args, topology=Topology.from_dict(job.topology),
                           strategy=strategy)
            os.makedirs(job.out, exist_ok=True)
            plan.save(os.path.join(job.out, f"plan-{strategy}.json"))
            d = plan.to_dict()
        plans.append(Plan.from_dict(_broadcast_plan(d)))
    return plans


def _state_and_metrics(out, state, name: str):
    """``(new_state, metrics)`` from a step's result, or a teaching error."""
    if not (isinstance(out, tuple) and len(out) == 2):
        raise UnsupportedStepError(
            f"launch runs {name}'s step as state, metrics = step(state, batch) again and again, "
            f"but it returned {type(out).__name__}"
            f"{f' of length {len(out)}' if isinstance(out, tuple | list) else ''}. Return "
            f"(new_state, metrics).")
    if jax.tree_util.tree_structure(out[0]) != jax.tree_util.tree_structure(state):
        raise UnsupportedStepError(
            f"{name}'s step returned a new state with another structure than the state it was "
            f"given ({jax.tree_util.tree_structure(out[0])} vs "
            f"{jax.tree_util.tree_structure(state)}); launch feeds it back as the next state.")
    return out


def _loss(metrics) -> float | None:
    """The loss in a step's (gathered, float) metrics: ``metrics["loss"]`` or a scalar metric."""
    if isinstance(metrics, dict):
        return metrics.get("loss")
    return metrics if isinstance(metrics, float) else None


def _float_tree(tree):
    return jax.tree_util.tree_map(lambda x: float(np.asarray(x)) if np.ndim(x) == 0
                                  else np.asarray(x).tolist(), tree)


def run_worker(job: Job, *, coordinator: str, num_processes: int, process_id: int) -> dict | None:
    """Run this process's part of a launch job (what ``hulkjax launch --coordinator ...`` runs).

    Must be called before JAX initializes its backends in this process. Initializes
    ``jax.distributed``, loads the model and the plan(s), emits each plan over the job's global
    devices, runs ``job.steps`` timed steps and gathers the results; process 0 also runs the
    unsharded step (``job.check``) and writes ``report.json`` to ``job.out``.

    Returns:
      The report on process 0, ``None`` on the others.

    Raises:
      ProcessLayoutError: the job's processes x local devices do not match the plan's topology.
    """
    t_start = time.perf_counter()
    _init_distributed(coordinator, num_processes, process_id, job.local_devices, job.init_timeout)
    from jax.experimental import multihost_utils

    log.info("process %d/%d joined: %d local devices (%s)", process_id, num_processes,
             jax.local_device_count(), jax.local_devices()[0].platform)
    model = load_step(job.model, size=job.size, overrides=job.overrides)
    plans = _job_plans(job, model, process_id)
    topo = plans[0].topology
    if topo is None:
        raise InvalidPlanError(f"plan {job.plans[0]!r} has no topology; re-plan with hj.plan.")
    for p in plans[1:]:
        if p.topology_fingerprint != plans[0].topology_fingerprint:
            raise InvalidPlanError("the job's plans were made for different topologies; launch "
                                   "plans for one topology per job.")
    layout = process_layout(topo, num_processes, jax.local_device_count())
    devices = ordered_devices(layout)

    host_state, host_batch = _concrete_args(model, job.seed)
    prints = multihost_utils.process_allgather(np.array(_fingerprint((host_state, host_batch)),
                                                        np.int64))
    if len(set(np.asarray(prints).ravel().tolist())) != 1:
        raise UnsupportedStepError(
            f"the processes computed different initial state/batch (fingerprints "
            f"{np.asarray(prints).ravel().tolist()}); launch needs the same values on every "
            f"process. Make the model's init deterministic (a fixed seed, no wall-clock or "
            f"per-host randomness).")

    runs = []
    for plan in plans:
        if plan.stages is None:
            runs.append(_run_spmd(job, model, plan, topo, devices, layout, host_state, host_batch,
                                  len(runs)))
        else:
            runs.append(_run_staged(job, model, plan, devices, layout, host_state, host_batch,
                                    len(runs)))
    report = None
    if process_id == 0:
        check = check_against_unsharded(model, host_state, host_batch, job, runs) \
            if job.check else None
        for i, r in enumerate(runs):
            r.pop("_final")
            r["check"] = None if check is None else check[i]
        report = {
            "format": REPORT_FORMAT,
            "model": model.name, "size": job.size, "overrides": job.overrides,
            "params": model.params,
            "topology": {"name": topo.name, "fingerprint": topo.fingerprint(),
                         "axis_names": list(topo.axis_names), "shape": list(topo.shape),
                         "num_devices": topo.num_devices},
            "platform": jax.local_devices()[0].platform,
            "layout": layout.to_dict(),
            "device_map": [{"topology_id": i, "process": d.process_index, "device_id": d.id}
                           for i, d in enumerate(devices)],
            "steps": job.steps, "seed": job.seed,
            "warmup_steps": 1 if job.steps > 1 else 0,
            "runs": runs,
            "worker_wall_time": time.perf_counter() - t_start,
        }
        os.makedirs(job.out, exist_ok=True)
        path = os.path.join(job.out, "report.json")
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(path + ".tmp", path)
        log.info("process 0: report written to %s", path)
    return report


def _timed_steps(job: Job, model: LoadedStep, plan: Plan, step, state, batch):
    """``job.steps`` steps from ``(state, batch)``: ``(final state, metrics per step, this
    process's step times)``."""
    times, metrics = [], []
    for i in range(job.steps):
        t0 = time.perf_counter()
        out = step(state, batch)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
        state, m = _state_and_metrics(out, state, model.name)
        metrics.append(m)
        log.info("process %d: %s step %d: %.3f s", jax.process_index(), plan.strategy, i + 1,
                 times[-1])
    return state, metrics, times


def _run_record(job: Job, plan: Plan, index: int, compile_time, times, metrics, final,
                collectives: dict, layout) -> dict:
    """The report's record of one run; ``collectives``: ``{(kind, axes): {"count", "bytes"}}``
    (:func:`hulkjax.emit.hlo.summarize`)."""
    from jax.experimental import multihost_utils

    all_times = np.asarray(multihost_utils.process_allgather(np.asarray(times)))
    all_times = all_times.reshape(layout.processes, job.steps)
    per_step = all_times.max(axis=0)  # the slowest process
    timed = per_step[1:] if job.steps > 1 else per_step
    return {
        "strategy": plan.strategy,
        "plan": job.plans[index] if job.plans else f"plan-{plan.strategy}.json",
        "predicted": None if plan.cost is None else plan.cost.to_dict(),
        "compile_time": compile_time,
        "step_times": all_times.tolist(),
        "step_time": float(np.median(timed)),
        "losses": [_loss(m) for m in metrics] if metrics is not None else None,
        "metrics": metrics,
        "collectives": [
            {"kind": kind, "axes": list(axes), "count": v["count"], "bytes": v["bytes"],
             "crosses_processes": bool(set(axes) & set(layout.process_axes))}
            for (kind, axes), v in sorted(collectives.items())],
        "_final": final,
    }


def _run_spmd(job, model, plan, topo, devices, layout, host_state, host_batch, index) -> dict:
    """One SPMD plan over the job's global mesh: global inputs, one program on every process."""
    from jax.experimental import multihost_utils

    mesh = topo.mesh(devices)
    step = api.emit(model.step, plan, mesh=mesh)
    leaves, treedef = jax.tree_util.tree_flatten((host_state, host_batch))
    if len(leaves) != len(step.in_shardings):
        raise InvalidPlanError(f"plan {plan.strategy!r} has {len(step.in_shardings)} inputs, "
                               f"the model has {len(leaves)}; re-plan for this model.")
    t0 = time.perf_counter()
    state, batch = jax.tree_util.tree_unflatten(treedef, jax.tree_util.tree_leaves(
        to_global(leaves, step.in_shardings)))
    step.compile(state, batch)
    compile_time = time.perf_counter() - t0
    colls = summarize(step.collectives())
    multihost_utils.sync_global_devices(f"hulkjax-launch-{plan.strategy}")
    state, metrics, times = _timed_steps(job, model, plan, step, state, batch)
    metrics = [_float_tree(multihost_utils.process_allgather(m, tiled=True)) for m in metrics]
    final = (jax.tree_util.tree_map(np.asarray,
                                    multihost_utils.process_allgather(state, tiled=True))
             if job.check else None)
    del state
    return _run_record(job, plan, index, compile_time, times, metrics, final, colls, layout)


def _run_staged(job, model, plan, devices, layout, host_state, host_batch, index) -> dict:
    """One staged plan: each process runs the programs of the stages on its devices; values
    crossing processes go with cross-host ``jax.device_put`` (:mod:`hulkjax.emit.transfer`).

    Every process calls the step with the same host values; the results are sent to process 0's
    first device for the report and the check.
    """
    from jax.experimental import multihost_utils

    check_stages(plan, layout)
    step = StagedStep(model.step, plan, devices=devices)
    t0 = time.perf_counter()
    step.compile(host_state, host_batch)
    compile_time = time.perf_counter() - t0
    # Each process compiled its own stages' programs: process 0 reports everyone's.
    colls: dict = {}
    mine = [[kind, list(axes), v["count"], v["bytes"]]
            for (kind, axes), v in summarize(step.collectives()).items()]
    for part in _allgather_json(mine):
        for kind, axes, count, nbytes in part:
            c = colls.setdefault((kind, tuple(axes)), {"count": 0, "bytes": 0})
            c["count"] += count
            c["bytes"] += nbytes
    multihost_utils.sync_global_devices(f"hulkjax-launch-{plan.strategy}")
    state, metrics, times = _timed_steps(job, model, plan, step, host_state, host_batch)
    crossings = list(step.crossings)  # the last step's (every step sends the same)
    metrics = [_float_tree(m) if m is not None else None
               for m in (transfer.gather(m, devices[0]) for m in metrics)]
    final = transfer.gather(state, devices[0]) if job.check else None
    del state
    run = _run_record(job, plan, index, compile_time, times,
                      metrics if jax.process_index() == 0 else None, final, colls, layout)
    owner = {d: p for p, block in enumerate(layout.blocks) for d in block}
    run["stages"] = [{"stage": k, "devices": list(st.devices), "process": owner[st.devices[0]],
                      "mesh": dict(zip(st.axis_names, st.mesh_shape)), "strategy": st.strategy,
                      "layers": list(st.layers)}
                     for k, st in enumerate(plan.stages)]
    run["microbatches"], run["schedule"] = plan.microbatches, plan.schedule
    pairs: dict[tuple, list] = {}
    for c in crossings:
        pairs.setdefault((c.src, c.dst), []).append(c.nbytes)
    run["transfers"] = [{"from_processes": list(src), "to_processes": list(dst),
                         "count": len(b), "bytes": int(sum(b))}
                        for (src, dst), b in sorted(pairs.items())]
    return run


def _allgather_json(obj) -> list:
    """``obj`` (JSON) of every process, in process order, through the job's collectives."""
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array(len(data), np.int64))).ravel()
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:len(data)] = data
    every = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [json.loads(row[:n].tobytes().decode()) for row, n in zip(every, sizes)]


def _unsharded_run(model, host_state, host_batch, steps: int, dev):
    """``(metrics per step, final state)`` of the plain jitted step on one device, as host values."""
    step = jax.jit(model.step)
    state, batch = jax.device_put((host_state, host_batch), dev)
    metrics = []
    for _ in range(steps):
        state, m = step(state, batch)
        metrics.append(_float_tree(jax.device_get(m)))
    return metrics, jax.tree_util.tree_map(np.asarray, jax.device_get(state))


def _to_float64(x):
    """Floating host arrays (float32, bfloat16, ...) as float64; anything else as it is."""
    if isinstance(x, np.ndarray) and jax.dtypes.issubdtype(x.dtype, np.floating):
        return x.astype(np.float64)
    return x


def _reference_spread(model, host_state, host_batch, steps: int, dev, ref_metrics, ref_final):
    """How far a float64 run of the unsharded step is from the float32 one, per leaf.

    The float64 run is the same step compiled again with ``jax_enable_x64`` and every floating
    input in float64: another compilation and another rounding, close to the exact result. Its
    distance from the float32 run is this model's rounding scale over these steps (AdamW turns
    rounding in near-zero gradients into whole-learning-rate moves, so it is not one ulp). A
    metric's spread is the running maximum over the steps
    (:func:`hulkjax.launch.arrays.running_max_over_steps`).

    Returns:
      ``(metrics spread, final-state spread, None)``, or ``(None, None, reason)`` when the step
      does not run in float64 (a model that fixes dtypes in a way float64 breaks).
    """
    try:
        with jax.enable_x64(True):
            metrics, final = _unsharded_run(model, jax.tree_util.tree_map(_to_float64, host_state),
                                            jax.tree_util.tree_map(_to_float64, host_batch),
                                            steps, dev)
        m_spread = running_max_over_steps(ref_metrics, tree_spread(ref_metrics, metrics))
        return (m_spread, tree_spread(ref_final, final), None)
    except Exception as e:  # noqa: BLE001 -- any failure of the float64 run: fixed tolerances
        reason = f"the float64 run failed ({type(e).__name__}: {str(e)[:200]})"
        log.warning("process 0: %s; the check falls back to rtol=1e-4, atol=1e-5", reason)
        return None, None, reason


def check_against_unsharded(model, host_state, host_batch, job: Job, runs) -> list[dict]:
    """Run the unsharded step on this process's first device; compare every run with it.

    The tolerance: fixed ``job.rtol`` / ``job.atol`` if given, else ``job.safety`` x the per-leaf
    spread between float32 and float64 unsharded runs (:func:`_reference_spread`).

    Args:
      model: the loaded step (:func:`hulkjax.loading.load_step`).
      host_state / host_batch: the job's initial values as host arrays.
      job: its ``steps``, ``rtol`` / ``atol`` and ``safety`` are used.
      runs: one dict per sharded run with ``"metrics"`` (per step, host floats) and ``"_final"``
        (the final state as host arrays).

    Returns:
      Per run ``{"match", "reference_losses", "tolerance", "metrics", "final_state"}``; the last
      two are :func:`hulkjax.launch.arrays.tree_error` records, ``"tolerance"`` says where the
      tolerance came from (``"float64 reference"`` with the spreads, ``"given"`` or ``"fixed"``
      with the reason).
    """
    dev = jax.local_devices()[0]
    ref_metrics, ref_final = _unsharded_run(model, host_state, host_batch, job.steps, dev)
    if job.rtol is not None:
        m_spread = f_spread = None
        tolerance = {"source": "given", "rtol": job.rtol, "atol": job.atol}
    else:
        m_spread, f_spread, failed = _reference_spread(model, host_state, host_batch, job.steps,
                                                       dev, ref_metrics, ref_final)
        if failed:
            tolerance = {"source": "fixed", "reason": failed, "rtol": 1e-4, "atol": 1e-5}
        else:
            tolerance = {"source": "float64 reference", "safety": job.safety,
                         "metrics_spread": max(m_spread, default=0.0),
                         "final_state_spread": max(f_spread, default=0.0)}
    rtol, atol = tolerance.get("rtol"), tolerance.get("atol")
    out = []
    for r in runs:
        metrics = tree_error(r["metrics"], ref_metrics, rtol=rtol, atol=atol, spread=m_spread,
                             safety=job.safety)
        final = tree_error(r["_final"], ref_final, rtol=rtol, atol=atol, spread=f_spread,
                           safety=job.safety)
        out.append({
            "match": metrics["match"] and final["match"],
            "reference_losses": [_loss(m) for m in ref_metrics],
            "tolerance": tolerance,
            "metrics": metrics, "final_state": final,
        })
    return out


def main(argv=None) -> int:
    """``python -m hulkjax.launch worker --job ... --coordinator ... --num-processes N --process-id I``."""
    p = argparse.ArgumentParser(prog="python -m hulkjax.launch",
                                description="one process of a hulkjax launch job")
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker", help="run one process of the job in job.json")
    w.add_argument("--job", required=True, help="job.json written by hulkjax.launch.launch")
    w.add_argument("--coordinator", required=True, help="HOST:PORT of process 0's coordinator")
    w.add_argument("--num-processes", type=int, required=True)
    w.add_argument("--process-id", type=int, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[process {args.process_id}] %(message)s")
    try:
        run_worker(Job.load(args.job), coordinator=args.coordinator,
                   num_processes=args.num_processes, process_id=args.process_id)
    except BaseException as e:  # noqa: BLE001 -- report anything, then leave without the
        # distributed shutdown barrier (it would wait minutes for peers that may be gone).
        traceback.print_exc(file=sys.stderr)
        kind = "error" if isinstance(e, HulkjaxError) else "failed"
        print(f"{kind}: {type(e).__name__}: {e}", file=sys.stderr)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)
    jax.distributed.shutdown()
    return 0
