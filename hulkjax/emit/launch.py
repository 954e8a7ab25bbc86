"""Run a planned step as a real multi-process JAX job: one process per node (or region) of the topology.

Where this sits::

    hulkjax launch / launch(...)          the parent: traces and plans ONCE (so every process runs
            |                             the identical plan), writes plan-<strategy>.json and
            |                             job.json to the run directory, spawns the workers
            v
    python -m hulkjax.emit.launch worker  one per process (or `hulkjax launch --coordinator ...` on
            |                             each host of a real cluster): jax.distributed.initialize,
            |                             Plan.load, emit over the GLOBAL devices, N timed steps
            v
    report.json (written by process 0)    plan and predicted cost, measured step times, losses,
                                          the collectives of the compiled multi-process program,
                                          and a numerical check against the unsharded step

Processes map onto the topology's hierarchy: with ``P`` processes of ``L`` local devices each
(``P * L == topology.num_devices``), process ``p`` holds topology devices ``p*L .. (p+1)*L - 1``.
Topology devices are ordered region > node > device, so that block is whole nodes (one process per
node, or per region); a layout that would split a node across processes is refused. The mesh is the
device order reshaped row-major (:meth:`Topology.mesh`), so the mesh axes along which the process
index changes are the ones whose collectives cross process boundaries (gloo over TCP on CPU).

Inputs become global ``jax.Array`` s with :func:`to_global`: every process computes the same host
value (zoo models from the seed) and fills only its own shards (``jax.make_array_from_callback``),
so no input crosses the network. Results are gathered with ``multihost_utils.process_allgather``.

>>> import hulkjax as hj
>>> from hulkjax.emit.launch import process_layout
>>> layout = process_layout(hj.Topology.grid((2, 2), ("proc", "dev")), 2)
>>> layout.blocks, layout.process_axes, layout.local_axes
(((0, 1), (2, 3)), ('proc',), ('dev',))
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
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
import traceback
from collections.abc import Callable, Sequence

import numpy as np

from hulkjax.errors import (
    HulkjaxError,
    InvalidPlanError,
    PlanMismatchError,
    ProcessLayoutError,
    UnsupportedStepError,
    WorkerFailedError,
)

log = logging.getLogger("hulkjax.launch")

REPORT_FORMAT = 1

__all__ = ["Job", "ProcessLayout", "launch", "process_layout", "run_worker", "to_global",
           "tree_error"]


# ------------------------------------------------------------------------------------------------
# Processes on the topology
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ProcessLayout:
    """Which topology devices each process of a job holds.

    Attributes:
      processes: number of processes.  # int
      local_devices: devices per process; ``processes * local_devices == topology.num_devices``.
      blocks: per process, the topology device ids it holds (contiguous).  # tuple[tuple[int, ...]]
      level: what one process is in the topology's hierarchy: ``"node"``, ``"region"``,
        ``"nodes"`` (several whole nodes of one or more regions) or ``"mesh block"`` (topologies
        with per-axis links, whose hierarchy names no hosts).  # str
      process_axes: mesh axes along which the process index changes: their collectives cross
        processes.  # tuple[str, ...]
      local_axes: mesh axes whose collectives stay inside one process.  # tuple[str, ...]
    """

    processes: int
    local_devices: int
    blocks: tuple[tuple[int, ...], ...]
    level: str
    process_axes: tuple[str, ...]
    local_axes: tuple[str, ...]

    def to_dict(self) -> dict:
        return {"processes": self.processes, "local_devices": self.local_devices,
                "blocks": [list(b) for b in self.blocks], "level": self.level,
                "process_axes": list(self.process_axes), "local_axes": list(self.local_axes)}


def process_layout(topology, processes: int, local_devices: int | None = None) -> ProcessLayout:
    """Map ``processes`` processes onto ``topology``: process ``p`` holds the ``p``-th block.

    Args:
      topology: a :class:`hulkjax.Topology`.
      processes: number of processes (hosts) in the job.
      local_devices: devices per process; default ``topology.num_devices // processes``.

    Raises:
      ProcessLayoutError: ``processes * local_devices != topology.num_devices``, or a block would
        split one of the topology's nodes across processes.

    >>> import hulkjax as hj
    >>> process_layout(hj.Topology.preset("hetero"), 2).level
    'node'
    """
    n = topology.num_devices
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
        raise ProcessLayoutError(f"processes={processes!r} must be a positive integer.")
    if local_devices is None:
        if n % processes:
            raise ProcessLayoutError(
                f"topology '{topology.name}' has {n} devices, which {processes} processes cannot "
                f"share equally. Use a process count that divides {n} "
                f"({_divisors_hint(topology)}), or a topology with {processes} x k devices.")
        local_devices = n // processes
    if processes * local_devices != n:
        raise ProcessLayoutError(
            f"topology '{topology.name}' has {n} devices, but the job has {processes} processes x "
            f"{local_devices} local devices = {processes * local_devices}. Every topology device "
            f"must be one device of one process: use {n // local_devices if n % local_devices == 0 else '?'}"
            f" processes of {local_devices} devices, {processes} processes of "
            f"{n / processes:g} devices, or a topology of {processes * local_devices} devices.")
    blocks = tuple(tuple(range(p * local_devices, (p + 1) * local_devices))
                   for p in range(processes))
    owner = np.repeat(np.arange(processes), local_devices)
    if topology.axis_links is not None:
        level = "mesh block"
    else:
        for node, ids in zip(topology.nodes, topology.groups("node")):
            owners = sorted({int(owner[i]) for i in ids})
            if len(owners) > 1:
                raise ProcessLayoutError(
                    f"{processes} processes of {local_devices} devices would split node "
                    f"{node!r} ({len(ids)} devices, topology ids {ids[0]}..{ids[-1]}) across "
                    f"processes {owners}; a node is one host, and its devices talk over the "
                    f"node's links, not the network. Launch one process per node "
                    f"(--processes {len(topology.nodes)}) or per region "
                    f"(--processes {len(topology.regions)}).")
        nodes = {tuple(g) for g in topology.groups("node")}
        regions = {tuple(g) for g in topology.groups("region")}
        level = ("node" if set(blocks) <= nodes else "region" if set(blocks) <= regions
                 else "nodes")
    grid = owner.reshape(topology.shape)
    varies = [bool(np.any(np.diff(grid, axis=k) != 0)) for k in range(grid.ndim)]
    return ProcessLayout(
        processes=processes, local_devices=local_devices, blocks=blocks, level=level,
        process_axes=tuple(a for a, v in zip(topology.axis_names, varies) if v),
        local_axes=tuple(a for a, v in zip(topology.axis_names, varies) if not v))


def _divisors_hint(topology) -> str:
    n = topology.num_devices
    counts = [d for d in range(1, n + 1) if n % d == 0]
    if topology.axis_links is None:
        counts = [d for d in counts if d <= len(topology.nodes)
                  and len(topology.nodes) % d == 0] or counts
    return "e.g. " + ", ".join(map(str, counts))


def ordered_devices(layout: ProcessLayout) -> list:
    """The job's global devices in topology order: process ``p``'s devices form block ``p``.

    ``jax.devices()`` of a multi-process job lists every process's devices; they are sorted by
    (process index, device id) here so that ``Topology.mesh(devices)`` puts process ``p`` on the
    ``p``-th node / region block whatever order the platform lists them in.

    Raises:
      ProcessLayoutError: the job's process count or some process's device count differs from the
        layout.
    """
    import jax

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    per_process: dict[int, int] = {}
    for d in devices:
        per_process[d.process_index] = per_process.get(d.process_index, 0) + 1
    want = {p: layout.local_devices for p in range(layout.processes)}
    if per_process != want:
        raise ProcessLayoutError(
            f"the job's devices per process are {per_process}, the topology needs "
            f"{layout.processes} processes x {layout.local_devices} devices ({want}). Start "
            f"{layout.processes} processes, each with {layout.local_devices} local devices "
            f"(on CPU: --local-devices {layout.local_devices}; on GPU hosts: that many visible "
            f"GPUs, e.g. CUDA_VISIBLE_DEVICES).")
    return devices


# ------------------------------------------------------------------------------------------------
# Global inputs and numerical comparison
# ------------------------------------------------------------------------------------------------


def to_global(tree, shardings):
    """A pytree of host values (the same on every process) as global ``jax.Array`` s.

    Each process fills only the shards its own devices hold (``jax.make_array_from_callback``), so
    nothing crosses the network; values the same everywhere is the caller's contract (the launcher
    checks it with one small all-gather of a fingerprint). Leaves that cannot be viewed as a numpy
    array (PRNG key arrays) go through ``jax.device_put``, which checks equality across processes.

    Args:
      tree: pytree of numpy arrays / fully addressable ``jax.Array`` s.
      shardings: a flat sequence of ``jax.sharding.Sharding``, one per leaf (``ShardedStep.
        in_shardings`` for the step's arguments).

    >>> import jax, numpy as np
    >>> mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> s = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    >>> to_global({"x": np.arange(4.0)}, [s])["x"].sharding == s
    True
    """
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(tree)
    shardings = list(shardings)
    if len(leaves) != len(shardings):
        raise UnsupportedStepError(f"to_global: {len(leaves)} leaves but {len(shardings)} "
                                   f"shardings; pass one sharding per leaf.")
    out = []
    for x, s in zip(leaves, shardings):
        try:
            host = np.asarray(x)
        except (TypeError, ValueError):  # extended dtypes (PRNG keys)
            out.append(jax.device_put(x, s))
            continue
        host = host.astype(jax.dtypes.canonicalize_dtype(host.dtype), copy=False)
        out.append(jax.make_array_from_callback(host.shape, s, lambda idx, h=host: h[idx]))
    return jax.tree_util.tree_unflatten(treedef, out)


def tree_error(actual, expected, *, rtol: float = 1e-4, atol: float = 1e-5) -> dict:
    """How far two pytrees of arrays are apart, leaf by leaf (``numpy.allclose`` semantics).

    Returns:
      ``{"match": bool, "max_abs_err": float, "worst_leaf": str | None, "leaves": int,
      "mismatched_leaves": [path, ...], "rtol": rtol, "atol": atol}``; ``match`` is False also
      when the structures or shapes differ (``"reason"`` says how).

    >>> tree_error({"a": [1.0, 2.0]}, {"a": [1.0, 2.0 + 1e-7]})["match"]
    True
    >>> tree_error({"a": [1.0, 2.0]}, {"a": [1.0, 2.5]})["mismatched_leaves"]
    ["['a'][1]"]
    """
    import jax

    out = {"match": True, "max_abs_err": 0.0, "worst_leaf": None, "leaves": 0,
           "mismatched_leaves": [], "rtol": rtol, "atol": atol}
    la, ta = jax.tree_util.tree_flatten_with_path(actual)
    lb, tb = jax.tree_util.tree_flatten(expected)
    if ta != tb:
        return out | {"match": False, "reason": f"tree structures differ: {ta} vs {tb}"}
    for (path, x), y in zip(la, lb):
        name = jax.tree_util.keystr(path)
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        out["leaves"] += 1
        if x.shape != y.shape:
            out["match"] = False
            out["mismatched_leaves"].append(name)
            out.setdefault("reason", f"leaf {name} has shape {x.shape}, expected {y.shape}")
            continue
        err = float(np.max(np.abs(x - y), initial=0.0))
        if not np.isfinite(err):  # NaN where the other is finite, or inf - inf
            err = 0.0 if np.array_equal(x, y, equal_nan=True) else float("inf")
        if err > out["max_abs_err"] or out["worst_leaf"] is None:
            out["max_abs_err"], out["worst_leaf"] = max(err, out["max_abs_err"]), name
        if not np.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True):
            out["match"] = False
            out["mismatched_leaves"].append(name)
    return out


# ------------------------------------------------------------------------------------------------
# The job every process runs
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """What every process of a launch runs; saved as ``job.json`` in the run directory.

    Attributes:
      model: a zoo name (``hulkjax.zoo.names()``) or ``module:function`` / ``path/file.py:function``
        returning ``(step, state, batch)`` with concrete arrays.  # str
      size: zoo size preset (``None``: the model's default).  # str | None
      overrides: zoo config overrides, e.g. ``{"batch": 8}``.  # dict
      plans: plan JSON files, run one after another in the same job.  # tuple[str, ...]
      strategies: when ``plans`` is empty, process 0 plans with these strategies on ``topology``
        and broadcasts the plans to the others (so planners with time limits need not be
        deterministic).  # tuple[str, ...]
      topology: the topology's JSON form, for ``strategies``.  # dict | None
      steps: timed training steps per plan.  # int
      seed: zoo ``init`` seed (the same on every process).  # int
      check: run the unsharded step on process 0 and compare losses and the final state.  # bool
      rtol / atol: tolerances of that comparison.  # float
      local_devices: fake CPU devices per process; ``None`` leaves devices to the platform (GPU
        and TPU hosts).  # int | None
      out: directory process 0 writes ``report.json`` (and a planned ``plan-*.json``) to.  # str
      init_timeout: seconds to wait for every process to join the job.  # int
    """

    model: str
    size: str | None = None
    overrides: dict = dataclasses.field(default_factory=dict)
    plans: tuple[str, ...] = ()
    strategies: tuple[str, ...] = ()
    topology: dict | None = None
    steps: int = 3
    seed: int = 0
    check: bool = True
    rtol: float = 1e-4
    atol: float = 1e-5
    local_devices: int | None = None
    out: str = "."
    init_timeout: int = 300

    def __post_init__(self):
        object.__setattr__(self, "plans", tuple(self.plans))
        object.__setattr__(self, "strategies", tuple(self.strategies))
        if not self.plans and not (self.strategies and self.topology):
            raise InvalidPlanError("a launch job needs plan files (--plan), or strategies and a "
                                   "topology to plan on process 0.")
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 1:
            raise UnsupportedStepError(f"steps={self.steps!r} must be a positive integer.")

    def to_dict(self) -> dict:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> Job:
        return cls(**d)

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path) -> Job:
        with open(path) as f:
            return cls.from_dict(json.load(f))


@dataclasses.dataclass
class _Model:
    name: str
    step: Callable
    args: tuple  # (state, batch): arrays or ShapeDtypeStructs
    init: Callable[[int], tuple] | None  # zoo models: seed -> concrete (state, batch)
    params: int | None


def load_model(spec: str, size: str | None = None, overrides: dict | None = None) -> _Model:
    """A zoo model (``name``) or the user's ``module:function``, as the CLI commands accept them."""
    if ":" in spec:
        from hulkjax.cli import _load_user_step

        name, (step, state, batch) = _load_user_step(spec)
        return _Model(name, step, (state, batch), None, None)
    from hulkjax import zoo

    kw = dict(overrides or {})
    if size is not None:
        kw["size"] = size
    m = zoo.get(spec, **kw)
    return _Model(m.name, m.step, m.abstract(), m.init, m.param_count())


def _check_runnable(model: _Model) -> None:
    """A user's step must come with concrete arrays: launch runs it (zoo models have ``init``)."""
    import jax

    if model.init is not None:
        return
    leaves = jax.tree_util.tree_flatten_with_path(model.args)[0]
    abstract = [jax.tree_util.keystr(p) for p, x in leaves if isinstance(x, jax.ShapeDtypeStruct)]
    if abstract:
        raise UnsupportedStepError(
            f"launch runs the step, but {model.name}() returned jax.ShapeDtypeStruct leaves "
            f"({', '.join(abstract[:4])}{', ...' if len(abstract) > 4 else ''}), which hold no "
            f"values. Return concrete arrays for launch (plan and compare accept abstract ones).")


def _concrete_args(model: _Model, seed: int) -> tuple:
    """``(state, batch)`` as host numpy trees (zoo: ``init(seed)``; user steps: what they return)."""
    import jax

    _check_runnable(model)
    args = model.init(seed) if model.init is not None else model.args

    def host(x):
        try:
            return np.asarray(x)
        except (TypeError, ValueError):  # PRNG keys stay jax arrays
            return x

    return jax.tree_util.tree_map(host, args)


def _fingerprint(tree) -> int:
    import jax

    h = hashlib.sha256()
    for x in jax.tree_util.tree_leaves(tree):
        a = np.asarray(x) if isinstance(x, np.ndarray) else np.asarray(jax.random.key_data(x))
        h.update(str((a.shape, a.dtype.str)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return int.from_bytes(h.digest()[:7], "little")  # fits an int64


def _init_distributed(coordinator: str, num_processes: int, process_id: int,
                      local_devices: int | None, init_timeout: int) -> None:
    """``jax.distributed.initialize``; on CPU first ask for ``local_devices`` devices."""
    import jax

    if local_devices is not None:
        os.environ["JAX_PLATFORMS"] = "cpu"
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", int(local_devices))
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


def _job_plans(job: Job, model: _Model, process_id: int) -> list:
    from hulkjax.strategies.plan import Plan

    if job.plans:
        return [Plan.load(p) for p in job.plans]
    plans = []
    for strategy in job.strategies:
        d = None
        if process_id == 0:
            import hulkjax as hj
            from hulkjax.topology import Topology

            log.info("process 0: planning %s", strategy)
            plan = hj.plan(model.step, *model.args, topology=Topology.from_dict(job.topology),
                           strategy=strategy)
            os.makedirs(job.out, exist_ok=True)
            plan.save(os.path.join(job.out, f"plan-{strategy}.json"))
            d = plan.to_dict()
        plans.append(Plan.from_dict(_broadcast_plan(d)))
    return plans


def _state_and_metrics(out, state, name: str):
    """``(new_state, metrics)`` from a step's result, or a teaching error."""
    import jax

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
    import jax

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
    import jax
    from jax.experimental import multihost_utils

    import hulkjax as hj
    from hulkjax.emit.hlo import summarize

    log.info("process %d/%d joined: %d local devices (%s)", process_id, num_processes,
             jax.local_device_count(), jax.local_devices()[0].platform)
    model = load_model(job.model, job.size, job.overrides)
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
        mesh = topo.mesh(devices)
        step = hj.emit(model.step, plan, mesh=mesh)
        leaves, treedef = jax.tree_util.tree_flatten((host_state, host_batch))
        if len(leaves) != len(step.in_shardings):
            raise InvalidPlanError(f"plan {plan.strategy!r} has {len(step.in_shardings)} inputs, "
                                   f"the model has {len(leaves)}; re-plan for this model.")
        t0 = time.perf_counter()
        state, batch = jax.tree_util.tree_unflatten(treedef, jax.tree_util.tree_leaves(
            to_global(leaves, step.in_shardings)))
        step.compile(state, batch)
        compile_time = time.perf_counter() - t0
        colls = step.collectives()
        multihost_utils.sync_global_devices(f"hulkjax-launch-{plan.strategy}")
        times, metrics = [], []
        for i in range(job.steps):
            t0 = time.perf_counter()
            out = step(state, batch)
            jax.block_until_ready(out)
            times.append(time.perf_counter() - t0)
            state, m = _state_and_metrics(out, state, model.name)
            metrics.append(m)
            log.info("process %d: %s step %d: %.3f s", process_id, plan.strategy, i + 1, times[-1])
        all_times = np.asarray(multihost_utils.process_allgather(np.asarray(times)))
        metrics = [_float_tree(multihost_utils.process_allgather(m, tiled=True)) for m in metrics]
        final = (jax.tree_util.tree_map(np.asarray,
                                        multihost_utils.process_allgather(state, tiled=True))
                 if job.check else None)
        del state
        per_step = all_times.reshape(num_processes, job.steps).max(axis=0)  # the slowest process
        timed = per_step[1:] if job.steps > 1 else per_step
        runs.append({
            "strategy": plan.strategy,
            "plan": job.plans[len(runs)] if job.plans else f"plan-{plan.strategy}.json",
            "predicted": None if plan.cost is None else plan.cost.to_dict(),
            "compile_time": compile_time,
            "step_times": all_times.reshape(num_processes, job.steps).tolist(),
            "step_time": float(np.median(timed)),
            "losses": [_loss(m) for m in metrics],
            "metrics": metrics,
            "collectives": [
                {"kind": kind, "axes": list(axes), "count": v["count"], "bytes": v["bytes"],
                 "crosses_processes": bool(set(axes) & set(layout.process_axes))}
                for (kind, axes), v in sorted(summarize(colls).items())],
            "_final": final,
        })

    report = None
    if process_id == 0:
        check = _check_against_unsharded(model, host_state, host_batch, job, runs) \
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


def _check_against_unsharded(model, host_state, host_batch, job: Job, runs) -> list[dict]:
    """Run the unsharded step on this process's first device; compare every run with it."""
    import jax

    dev = jax.local_devices()[0]
    step = jax.jit(model.step)
    state, batch = jax.device_put((host_state, host_batch), dev)
    ref_metrics = []
    for _ in range(job.steps):
        state, m = step(state, batch)
        ref_metrics.append(_float_tree(jax.device_get(m)))
    ref_final = jax.tree_util.tree_map(np.asarray, jax.device_get(state))
    out = []
    for r in runs:
        metrics = tree_error(r["metrics"], ref_metrics, rtol=job.rtol, atol=job.atol)
        final = tree_error(r["_final"], ref_final, rtol=job.rtol, atol=job.atol)
        out.append({
            "match": metrics["match"] and final["match"],
            "reference_losses": [_loss(m) for m in ref_metrics],
            "metrics": metrics, "final_state": final,
        })
    return out


# ------------------------------------------------------------------------------------------------
# The local launcher
# ------------------------------------------------------------------------------------------------


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


def _resolve_topology(topology, nodes: int | None = None):
    from hulkjax.topology import Topology

    if isinstance(topology, Topology):
        return topology
    if isinstance(topology, str) and topology.endswith(".json"):
        return Topology.load(topology)
    return Topology.preset(topology, **({} if nodes is None else {"nodes": nodes}))


def launch(model: str, topology, *, strategies: str | Sequence = "dp", processes: int = 2,
           steps: int = 3, size: str | None = None, overrides: dict | None = None, seed: int = 0,
           out: str | None = None, check: bool = True, rtol: float = 1e-4, atol: float = 1e-5,
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
      rtol / atol: tolerances of that comparison.
      timeout: seconds for the whole job; then every worker is stopped.
      host / port: coordinator address (default 127.0.0.1 and a free port).
      env: extra environment variables for the workers.
      prefix: per process id, a command prefix (e.g. ``ip netns exec ns0``).
      plan_options: passed to :func:`hulkjax.plan` (e.g. ``{"time_limit": 10}`` for ``ilp``).

    Raises:
      ProcessLayoutError: the topology does not split into ``processes`` node/region blocks.
      WorkerFailedError: a worker exited with an error (its stderr is in the message) or the job
        ran past ``timeout``.

    >>> import hulkjax as hj
    >>> report = launch("mlp", hj.Topology.grid((2, 2), ("proc", "dev")), size="tiny",
    ...                 strategies=["dp"], steps=2)                    # doctest: +SKIP
    >>> report["runs"][0]["check"]["match"]                              # doctest: +SKIP
    True
    """
    import hulkjax as hj
    from hulkjax.strategies.plan import Plan

    t_start = time.perf_counter()
    topo = _resolve_topology(topology)
    layout = process_layout(topo, processes)
    items = [strategies] if isinstance(strategies, str | Plan) else list(strategies)
    if not items:
        raise InvalidPlanError("launch needs at least one strategy or plan.")
    run_dir = os.path.abspath(out or tempfile.mkdtemp(prefix="hulkjax-launch-"))
    os.makedirs(run_dir, exist_ok=True)
    if ":" in model:  # a relative file path must resolve in the workers too
        where, _, fname = model.rpartition(":")
        if where.endswith(".py"):
            model = f"{os.path.abspath(where)}:{fname}"

    m = load_model(model, size, overrides)
    _check_runnable(m)
    t0 = time.perf_counter()
    graph = None
    plan_paths, strategy_names = [], []
    for item in items:
        if graph is None:
            graph = hj.trace(m.step, *m.args)
        if isinstance(item, Plan):
            plan = item
            if plan.graph_fingerprint and plan.graph_fingerprint != graph.fingerprint():
                raise PlanMismatchError(
                    f"plan {plan.strategy!r} was made for another step (graph fingerprint "
                    f"{plan.graph_fingerprint}); {m.name} traces to {graph.fingerprint()}. Pass "
                    f"the model the plan was made for (--model/--size/--batch), or re-plan.")
        else:
            log.info("planning %s on %s", item, topo.name)
            plan = hj.plan(m.step, *m.args, topology=topo, strategy=item, graph=graph,
                           **(plan_options or {}))
        if plan.topology is None or plan.topology.fingerprint() != topo.fingerprint():
            raise InvalidPlanError(
                f"plan {plan.strategy!r} was made for topology "
                f"{getattr(plan.topology, 'name', None)!r}, the launch is on {topo.name!r}; "
                f"re-plan for {topo.name!r}.")
        name = plan.strategy
        while name in strategy_names:
            name += "_"
        strategy_names.append(name)
        path = os.path.join(run_dir, f"plan-{name}.json")
        plan.save(path)
        plan_paths.append(path)
    planning_time = time.perf_counter() - t0

    job = Job(model=model, size=size, overrides=dict(overrides or {}), plans=tuple(plan_paths),
              steps=steps, seed=seed, check=check, rtol=rtol, atol=atol,
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
        cmd = [sys.executable, "-m", "hulkjax.emit.launch", "worker", "--job", job_path,
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


# ------------------------------------------------------------------------------------------------
# python -m hulkjax.emit.launch worker ...
# ------------------------------------------------------------------------------------------------


def _worker_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hulkjax.emit.launch",
                                description="one process of a hulkjax launch job")
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker", help="run one process of the job in job.json")
    w.add_argument("--job", required=True, help="job.json written by hulkjax.emit.launch.launch")
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
    import jax

    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    from hulkjax.emit import launch as _launch  # one module object for classes and errors

    sys.exit(_launch._worker_main())
