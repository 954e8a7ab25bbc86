"""The local launcher: plan once in the parent, start one process per node (or region), collect
process 0's report.

Where this sits::

    hulkjax launch / launch(...)          the parent: traces and plans ONCE (so every process runs
            |                             the identical plan), writes plan-<strategy>.json and
            |                             job.json to the run directory, spawns the workers
            v
    python -m hulkjax.launch worker       one per process (hulkjax.launch.worker), or `hulkjax
            |                             launch --coordinator ...` on each host of a real cluster
            v
    report.json (written by process 0)    plan and predicted cost, measured step times, losses,
                                          the collectives of the compiled multi-process program,
                                          and a numerical check against the unsharded step
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

from hulkjax import api
from hulkjax.errors import InvalidPlanError, PlanMismatchError, WorkerFailedError
from hulkjax.launch.arrays import SAFETY
from hulkjax.launch.job import Job
from hulkjax.launch.layout import check_stages, process_layout
from hulkjax.launch.worker import check_runnable
from hulkjax.loading import absolute_spec, load_step
from hulkjax.plan.records import Plan
from hulkjax.topology.model import resolve as resolve_topology
from hulkjax.trace.tracer import trace

log = logging.getLogger("hulkjax.launch")


def _free_port(host: str) -> int:
    for h in (host, "127.0.0.1"):  # host may only exist in another network namespace
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((h, 0))
                return s.getsockname()[1]
        except OSError:
            continue
    raise WorkerFailedError(f"no free TCP port for the coordinator on {host!r}; pass port=.")


def _worker_env(extra: dict | None) -> dict:
    env = dict(os.environ)
    # The worker sets its own device count; a count forced through XLA_FLAGS would override it.
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    env.pop("JAX_NUM_CPU_DEVICES", None)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def _tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    kept = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("[Gloo]")]
    return "\n".join(kept[-lines:])


def _stop(procs) -> None:
    """SIGKILL each worker's own process group (only what we started).

    Not SIGTERM: ``jax.distributed`` installs a SIGTERM handler (preemption notice) and the
    process carries on; an abandoned job has nothing worth cleaning up.
    """
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for p in procs:
        p.wait()


def launch(model: str, topology, *, strategies: str | Sequence = "dp", processes: int = 2,
           steps: int = 3, size: str | None = None, overrides: dict | None = None, seed: int = 0,
           out: str | None = None, check: bool = True, rtol: float | None = None,
           atol: float | None = None, safety: float = SAFETY,
           timeout: float = 600.0, host: str = "127.0.0.1", port: int | None = None,
           env: dict | None = None, prefix: Callable[[int], Sequence[str]] | None = None,
           plan_options: dict | None = None) -> dict:
    """Plan once, then run the plan(s) as a ``processes``-process JAX job on this machine.

    Every process gets ``topology.num_devices // processes`` fake CPU devices and joins one
    ``jax.distributed`` job (collectives between processes go over gloo/TCP). The parent traces
    and plans once and writes ``plan-<strategy>.json`` and ``job.json`` to ``out``; process 0
    writes ``report.json`` there, which is returned with a ``"launcher"`` section added.

    Args:
      model: zoo name or ``module:function`` / ``path/file.py:function`` (a string: every process
        rebuilds the model from it).
      topology: a :class:`hulkjax.Topology`, a preset name or a topology JSON path.
      strategies: a strategy name, or a sequence of names and/or :class:`hulkjax.Plan` s, run one
        after another in the same job.
      processes: number of processes; the topology is split into that many node/region blocks.
      steps: timed steps per plan (the first one is reported but not in the median).
      size / overrides / seed: zoo size preset, config overrides and init seed.
      out: run directory (default: a new temporary directory).
      check: compare with the unsharded step (process 0 runs it on one device).
      rtol / atol: fixed tolerances of that comparison. ``None`` (default): each leaf may differ
        by ``safety`` x how far a float64 run of the unsharded step is from the float32 one (the
        rounding scale of this model and these steps); the report's ``check`` records it.
      safety: the factor on that measured spread (:data:`hulkjax.launch.arrays.SAFETY`).
      timeout: seconds for the whole job; then every worker is stopped.
      host / port: coordinator address (default 127.0.0.1 and a free port).
      env: extra environment variables for the workers.
      prefix: per process id, a command prefix (e.g. ``ip netns exec ns0``).
      plan_options: passed to :func:`hulkjax.plan` (e.g. ``{"time_limit": 10}`` for ``ilp``).

    Staged plans (``strategy="pipeline"``, or ``ilp`` / ``auto`` plans with stages) run each stage
    in one process: its programs there, activations and gradients sent between processes with
    cross-host ``jax.device_put`` (:mod:`hulkjax.emit.transfer`); the run's ``"transfers"`` say
    how many values and bytes crossed per step.

    Raises:
      ProcessLayoutError: the topology does not split into ``processes`` node/region blocks, or
        a staged plan's stage would span several processes.
      WorkerFailedError: a worker exited with an error (its stderr is in the message) or the job
        ran past ``timeout``.

    >>> import hulkjax as hj
    >>> report = launch("mlp", hj.Topology.grid((2, 2), ("proc", "dev")), size="tiny",
    ...                 strategies=["dp"], steps=2)                    # doctest: +SKIP
    >>> report["runs"][0]["check"]["match"]                              # doctest: +SKIP
    True
    """
    t_start = time.perf_counter()
    topo = resolve_topology(topology)
    layout = process_layout(topo, processes)
    items = [strategies] if isinstance(strategies, str | Plan) else list(strategies)
    if not items:
        raise InvalidPlanError("launch needs at least one strategy or plan.")
    run_dir = os.path.abspath(out or tempfile.mkdtemp(prefix="hulkjax-launch-"))
    os.makedirs(run_dir, exist_ok=True)
    model = absolute_spec(model)  # a relative file path must resolve in the workers too
    m = load_step(model, size=size, overrides=overrides)
    check_runnable(m)
    t0 = time.perf_counter()
    graph = None
    plan_paths, strategy_names = [], []
    for item in items:
        if graph is None:
            graph = trace(m.step, *m.args)
        if isinstance(item, Plan):
            plan = item
            if plan.graph_fingerprint and plan.graph_fingerprint != graph.fingerprint():
                raise PlanMismatchError(
                    f"plan {plan.strategy!r} was made for another step (graph fingerprint "
                    f"{plan.graph_fingerprint}); {m.name} traces to {graph.fingerprint()}. Pass "
                    f"the model the plan was made for (--model/--size/--batch), or re-plan.")
        else:
            log.info("planning %s on %s", item, topo.name)
            plan = api.plan(m.step, *m.args, topology=topo, strategy=item, graph=graph,
                           **(plan_options or {}))
        if plan.topology is None or plan.topology.fingerprint() != topo.fingerprint():
            raise InvalidPlanError(
                f"plan {plan.strategy!r} was made for topology "
                f"{getattr(plan.topology, 'name', None)!r}, the launch is on {topo.name!r}; "
                f"re-plan for {topo.name!r}.")
        check_stages(plan, layout)  # a staged plan: each stage inside one process
        name = plan.strategy
        while name in strategy_names:
            name += "_"
        strategy_names.append(name)
        path = os.path.join(run_dir, f"plan-{name}.json")
        plan.save(path)
        plan_paths.append(path)
    planning_time = time.perf_counter() - t0

    job = Job(model=model, size=size, overrides=dict(overrides or {}), plans=tuple(plan_paths),
              steps=steps, seed=seed, check=check, rtol=rtol, atol=atol, safety=safety,
              local_devices=layout.local_devices, out=run_dir,
              init_timeout=max(10, int(timeout)))
    job_path = os.path.join(run_dir, "job.json")
    job.save(job_path)
    report_path = os.path.join(run_dir, "report.json")
    if os.path.exists(report_path):
        os.remove(report_path)

    port = port or _free_port(host)
    coordinator = f"{host}:{port}"
    cmds = []
    for i in range(processes):
        cmd = [sys.executable, "-m", "hulkjax.launch", "worker", "--job", job_path,
               "--coordinator", coordinator, "--num-processes", str(processes),
               "--process-id", str(i)]
        cmds.append(list(prefix(i)) + cmd if prefix else cmd)
    log.info("launching %d processes x %d devices (one per %s), coordinator %s, run dir %s",
             processes, layout.local_devices, layout.level, coordinator, run_dir)
    _run_workers(cmds, run_dir, _worker_env(env), timeout)

    with open(report_path) as f:
        report = json.load(f)
    report["launcher"] = {
        "run_dir": run_dir, "coordinator": coordinator, "planning_time": planning_time,
        "wall_time": time.perf_counter() - t_start,
        "commands": [shlex.join(c) for c in cmds],
    }
    with open(report_path, "w") as f:
        json.dump(report, f, indent=1)
    return report


def _run_workers(cmds: list[list[str]], run_dir: str, env: dict, timeout: float) -> None:
    procs, files = [], []
    t0 = time.monotonic()
    try:
        for i, cmd in enumerate(cmds):
            fo = open(os.path.join(run_dir, f"worker-{i}.out"), "w")
            fe = open(os.path.join(run_dir, f"worker-{i}.err"), "w")
            files += [fo, fe]
            procs.append(subprocess.Popen(cmd, stdout=fo, stderr=fe, env=env,
                                          start_new_session=True, cwd=os.getcwd()))
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # The first to fail is the cause; the others fail after it (a lost peer).
                i = min(failed, key=lambda k: (codes[k] < 0, k))
                _stop(procs)
                tail = _tail(os.path.join(run_dir, f"worker-{i}.err"))
                raise WorkerFailedError(
                    f"process {i} of {len(cmds)} exited with status {codes[i]} after "
                    f"{time.monotonic() - t0:.1f} s; the other processes were stopped. Its stderr "
                    f"ends with:\n{tail or '(empty)'}\nLogs: {run_dir}/worker-<i>.err. To tell a "
                    f"model problem from a job problem, run the step in one process first "
                    f"(hj.emit(step, plan) on fake devices).",
                    process_id=i, returncode=codes[i], stderr=tail)
            if all(c == 0 for c in codes):
                return
            if time.monotonic() - t0 > timeout:
                running = [i for i, c in enumerate(codes) if c is None]
                _stop(procs)
                tails = "\n".join(f"--- process {i} stderr:\n"
                                  f"{_tail(os.path.join(run_dir, f'worker-{i}.err'), 15)}"
                                  for i in running)
                raise WorkerFailedError(
                    f"the job ran past its timeout of {timeout:g} s; processes {running} were "
                    f"still running and were stopped (a process waiting for a peer that never "
                    f"came, or a slow model). Raise timeout= / --timeout, or check the logs in "
                    f"{run_dir}.\n{tails}", stderr=tails)
            time.sleep(0.05)
    finally:
        _stop(procs)
        for f in files:
            f.close()
