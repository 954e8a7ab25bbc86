"""Measure this machine (device throughput, memory bandwidth, the link between processes) and
write a topology whose numbers are measured, not nominal.

Where this sits::

    hulkjax calibrate / calibrate(...)        the parent: spawns the processes (launcher's
            |                                 machinery: timeouts, logs, process groups), reads
            |                                 process 0's measurements, fits, writes the JSON
            v
    python -m hulkjax.launch.calibrate        one per process, each with ``local_devices`` fake CPU
            |                                 devices, joined by jax.distributed (gloo over TCP,
            |                                 the transport `hulkjax launch` jobs use)
            v
    calibration.json + topology JSON          raw timings, the fitted numbers, and
                                              Topology.grid((processes, local_devices), ...)

What is measured, and how (every number is a median over ``repeats`` timed runs after a warm-up,
with every device of every process running at once, as they do in a launch job):

* **matmul throughput** per device: the three matmuls of a dense layer's training step on
  ``n x n`` float32 activations and weights (forward ``y = x w``, input gradient ``y w^T``, weight
  gradient ``x^T y``: two of three contract a transposed operand, as in every training step),
  chained in one jitted program on each local device at once (a process-local mesh, no
  communication) for :data:`BUSY_FLOPS` per run, ``6 n^3`` FLOPs per link of the chain. Fake CPU
  devices share the machine's cores, so this is each device's share when all of them work,
  which is what a launch job on this machine gets. Why a chain, and why these matmuls (measured
  on 2 cores, one device in each of 2 processes): one 512 x 512 matmul per run gave 107
  GFLOP/s per device, the rate of one device alone, because each run takes milliseconds and the
  barrier releases the processes a fraction of that apart, so their runs barely overlap; a GPT
  step running in both processes at once took 1.9x what that number predicted. On one core a
  square matmul ran at 65-78 GFLOP/s and the training trio at 48-58 (XLA:CPU runs the
  transposed-operand products slower), which is the pace of the step's matmuls.
* **both-transposed matmuls** per device: ``a^T b^T`` with ``a`` (``2n x n/4``) contracting its
  leading dimension and ``b`` (``n x 2n``) its trailing one, a weight gradient as XLA:CPU lays it
  out where the forward activation ends up on the left (:mod:`hulkjax.cost.dots`), repeated for
  :data:`BUSY_FLOPS` per run. XLA:CPU runs it with Eigen's contraction, not its fused matmul:
  on one core 87 GFLOP/s at ``n = 1024`` where the dense-layer chain ran at 220
  (``benchmarks/COMPUTE.md``). Its rate over the chain's is
  ``DeviceSpec.transposed_dot_efficiency`` (at most 1).
* **memory bandwidth and fresh pages** per device: ``y = x * a + b`` on a ``memory_bytes``
  float32 array per device, one program per pass, for :data:`BUSY_TRAFFIC` bytes per run (one
  read and one write, ``2 x memory_bytes`` per pass), twice: each pass writing a fresh output
  buffer (as a step's temporaries are allocated on every call), and in place (each pass's
  input donated). On XLA:CPU a buffer above glibc's mmap threshold (at most 32 MiB; lower in a
  process that has not yet freed large buffers) is new pages on every call: one core wrote
  fresh 64-256 MB outputs at 4.2-4.6 GB/s, one minor fault per 4 KB page, and in place at
  45 GB/s (``benchmarks/compute_check.py --streams``). The in-place rate is the device's
  memory bandwidth; the fresh chain's extra time over the page faults it took (counted with
  ``getrusage``) is the cost of a fresh page, ``DeviceSpec.fresh_page_time``, which the cost
  model charges for the temporaries of each program call above the threshold
  (``CostModel.page_time``). Give ``memory_bytes`` above 32 MiB (the default is 64 MiB), or the
  fresh chain reuses its pages and the page cost reads 0.
* **kernel overhead** per device: a jitted chain of ``KERNEL_CHAIN`` dependent ``16 x 16``
  matmuls (one kernel each) against a chain of one, on every local device at once:
  ``(t_chain - t_one) / (KERNEL_CHAIN - 1)`` is what each further kernel adds beyond its
  (negligible) roofline time, the dispatch of the call cancelled out. It becomes the spec's
  ``kernel_overhead``.
* **link between processes**: an all-reduce (``shard_map`` + ``psum``, compiled by XLA:CPU into one
  all-reduce run by gloo over TCP) over one device per process, at several sizes. A ring
  all-reduce of ``B`` bytes over ``n`` processes takes ``2 (n-1)/n B / bw + 2 (n-1) a``; a least
  squares fit over the sizes gives the bandwidth ``bw`` (bytes/s per direction) and latency ``a``.
  This is the collective the launch jobs run, not a raw socket: gloo's framing and XLA's
  collective overhead are in it, which is what the cost model should predict.
* **link inside a process** (when ``local_devices > 1``): the same all-reduce over the local
  devices of process 0 (memory copies).
* **cost per call**, of both links: one ``psum`` of :data:`CALL_OPERANDS` arrays of
  :data:`CALL_BYTES` against one of a single array. XLA combines the first into one all-reduce
  and XLA:CPU runs it as one communicator call per operand (:mod:`hulkjax.cost.backends`), so
  each further operand costs one small all-reduce (:func:`call_seconds`). A call is a fixed cost
  (the device's ``collective_overhead``) plus a latency per ring step of its link
  (:func:`split_call_cost`). On this machine, two processes of two fake devices in network
  namespaces, a call cost 3.4 ms between the devices of a process and 4.0 ms between the
  processes, and ``dp``'s 40-operand all-reduce over all four devices about 4 ms a call (its
  step took 163 ms with the links unshaped): the fixed part
  dominates, far above the wire's round trip (tens of microseconds), and neither is visible in
  the fit's intercept over 0.25-4 MiB, which read 0.

>>> from hulkjax.launch.calibrate import fit_alpha_beta
>>> bw, a = fit_alpha_beta([1e6, 2e6], [1e-3 + 2e-4, 2e-3 + 2e-4], participants=2)
>>> round(bw / 1e9, 6), round(a * 1e3, 6)  # 1 GB/s, 0.1 ms
(1.0, 0.1)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from hulkjax.cost.backends import PAGE_BYTES
from hulkjax.errors import HulkjaxError, WorkerFailedError
from hulkjax.launch.launcher import _free_port, _run_workers, _worker_env
from hulkjax.topology.model import Topology
from hulkjax.topology.specs import DeviceSpec

log = logging.getLogger("hulkjax.launch")

CALIBRATION_FORMAT = 1
"""Version of ``calibration.json``."""

KERNEL_CHAIN = 64
"""Dependent tiny matmuls in the kernel-overhead measurement."""

BUSY_FLOPS = 2e10
"""FLOPs per device in one timed run of the matmul measurement (a chain of dense-layer training
matmuls): long enough that every device's run overlaps the others' (the module docstring)."""

BUSY_TRAFFIC = 4e9
"""Bytes read and written per device in one timed run of the memory measurement."""

CALL_OPERANDS = 16
"""Operands of the combined all-reduce whose cost per further operand is a call's cost."""

CALL_BYTES = 1024
"""Bytes per device of each of its operands."""


def chain_length(work: float, per_run: float) -> int:
    """Repeats of a kernel doing ``per_run`` of work so that a chain does ``work`` (at least 1).

    >>> chain_length(2e10, 6 * 512 ** 3), chain_length(1.0, 5.0)
    (25, 1)
    """
    return max(1, round(work / per_run))


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float], *,
                   participants: int) -> tuple[float, float]:
    """Bandwidth (bytes/s) and latency (s) of a ring all-reduce from timings at several sizes.

    Least squares of ``t = 2 (n-1)/n B / bw + 2 (n-1) a`` over ``(B, t)``; the latency is clipped
    at 0 (timing noise can make the intercept slightly negative).

    Raises:
      HulkjaxError: fewer than two sizes, or times that do not grow with size (no bandwidth can
        be read from them: use larger sizes).
    """
    b, t = np.asarray(nbytes, np.float64), np.asarray(seconds, np.float64)
    n = int(participants)
    if len(b) < 2 or len(set(b.tolist())) < 2:
        raise HulkjaxError(f"fit_alpha_beta needs timings at two or more sizes, got {b.tolist()}.")
    x = 2 * (n - 1) / n * b
    slope, intercept = np.polyfit(x, t, 1)
    if not slope > 0:
        raise HulkjaxError(
            f"all-reduce times {t.tolist()} s do not grow with the sizes {b.tolist()} bytes: no "
            f"bandwidth can be read from them. Calibrate with larger link sizes.")
    return float(1.0 / slope), float(max(intercept, 0.0) / (2 * (n - 1)))


def kernel_overhead(kernels: dict) -> float:
    """Seconds each further kernel of a dependent chain adds (clipped at 0: noise).

    >>> kernel_overhead({"chain": 64, "seconds_one": 10e-6, "seconds_chain": 10e-6 + 63 * 4e-6})
    4e-06
    """
    extra = (kernels["seconds_chain"] - kernels["seconds_one"]) / (kernels["chain"] - 1)
    return round(max(extra, 0.0), 12)


# ---- one process ---------------------------------------------------------------------------


def _median_time(fn: Callable[[], object], repeats: int, barrier: Callable[[], None]) -> float:
    import jax

    jax.block_until_ready(fn())  # warm-up (compiles)
    times = []
    for _ in range(repeats):
        barrier()
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _median_time_and_faults(fn: Callable[[], object], repeats: int,
                            barrier: Callable[[], None]) -> tuple[float, float]:
    """:func:`_median_time`, and the minor page faults this process took per call once warm
    (the first call, which compiles, is left out; _median_time's own warm-up call is in)."""
    import jax

    jax.block_until_ready(fn())
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = _median_time(fn, repeats, barrier)
    return t, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / (repeats + 1)


def _allreduce_fn(mesh, axis: str, nbytes: int):
    """A thunk running a jitted all-reduce of ``nbytes`` (float32) per device over ``mesh``'s one
    axis, and the bytes it really reduces per device."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    n = mesh.devices.size
    elems = max(1, nbytes // 4)
    sharding = NamedSharding(mesh, PartitionSpec(axis))
    x = jax.make_array_from_callback((n * elems,), sharding,
                                     lambda idx: np.ones(elems, np.float32))
    f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, axis), mesh=mesh,
                              in_specs=PartitionSpec(axis), out_specs=PartitionSpec(axis)))
    return lambda: f(x), elems * 4


def _allreduce_calls_fn(mesh, axis: str, operands: int):
    """A thunk running one jitted ``psum`` of ``operands`` float32 arrays of :data:`CALL_BYTES`
    per device over ``mesh``'s one axis: one all-reduce in the HLO, which XLA:CPU runs as one
    communicator call per operand (:mod:`hulkjax.cost.backends`)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    n = mesh.devices.size
    elems = CALL_BYTES // 4
    sharding = NamedSharding(mesh, PartitionSpec(axis))
    xs = [jax.make_array_from_callback((n * elems,), sharding,
                                       lambda idx: np.ones(elems, np.float32))
          for _ in range(operands)]
    f = jax.jit(jax.shard_map(lambda *v: jax.lax.psum(v, axis), mesh=mesh,
                              in_specs=PartitionSpec(axis), out_specs=PartitionSpec(axis)))
    return lambda: f(*xs)


def _call_times(mesh, axis: str, repeats: int, barrier) -> dict:
    """Seconds of a combined all-reduce of one and of :data:`CALL_OPERANDS` small operands."""
    one = _median_time(_allreduce_calls_fn(mesh, axis, 1), repeats, barrier)
    many = _median_time(_allreduce_calls_fn(mesh, axis, CALL_OPERANDS), repeats, barrier)
    return {"operands": CALL_OPERANDS, "bytes_per_operand": CALL_BYTES, "seconds_one": one,
            "seconds_many": many}


def call_seconds(calls: dict, *, participants: int, bandwidth: float) -> float:
    """Seconds one call of a combined all-reduce costs beyond its bytes: what each further
    operand added, ``(t_many - t_one) / (k - 1)``, less a ring all-reduce's ``2 (n-1)/n B / bw``
    of one operand (clipped at 0: noise). XLA:CPU makes one call per operand.

    >>> calls = {"operands": 16, "bytes_per_operand": 0, "seconds_one": 1e-3,
    ...          "seconds_many": 1e-3 + 15 * 4e-4}
    >>> round(call_seconds(calls, participants=2, bandwidth=1e9) * 1e6, 6)
    400.0
    """
    n, k = int(participants), int(calls["operands"])
    per_call = (calls["seconds_many"] - calls["seconds_one"]) / (k - 1)
    moving = 2 * (n - 1) / n * calls["bytes_per_operand"] / bandwidth
    return float(max(per_call - moving, 0.0))


def split_call_cost(*, link_call: float, processes: int, link_fit: float,
                    local_call: float | None = None) -> tuple[float, float]:
    """``(collective_overhead, link latency)`` from the per-call costs (:func:`call_seconds`).

    A call over ``n`` devices costs ``c + 2 (n-1) a``: a fixed ``c`` whatever its size (the
    communicator's own; ``DeviceSpec.collective_overhead``) and a latency ``a`` per ring step
    of its link. One link's calls at one size cannot tell the two apart, so each split takes
    the physical latency of one link as known:

    * several devices per process: the link between them is memory copies (its ``a`` taken as
      0), so the call between them is ``c``, and the call between processes, less ``c``, gives
      that link's ``a``. The local link's alpha-beta fit reads the same ``c`` as its intercept
      (3.4 ms here for both), so the calibrated local link has no latency of its own;
    * one device per process: the link's ``a`` is its fit's intercept, ``c`` the rest.

    >>> c, a = split_call_cost(link_call=4.4e-3, processes=2, link_fit=0.0, local_call=4.0e-3)
    >>> round(c * 1e3, 9), round(a * 1e6, 9)
    (4.0, 200.0)
    >>> c, a = split_call_cost(link_call=4.4e-3, processes=2, link_fit=1e-4)
    >>> round(c * 1e3, 9), round(a * 1e6, 9)
    (4.2, 100.0)
    """
    if local_call is not None:
        return local_call, max(link_call - local_call, 0.0) / (2 * (processes - 1))
    return max(link_call - 2 * (processes - 1) * link_fit, 0.0), link_fit


def measure(*, matmul_size: int, memory_bytes: int, link_bytes: Sequence[int],
            repeats: int) -> dict:
    """This process's part of a calibration (inside a joined ``jax.distributed`` job).

    Returns the raw timings (process 0's view; the barriers make every process run each
    measurement at the same time).
    """
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

    counter = [0]

    def barrier():
        counter[0] += 1
        multihost_utils.sync_global_devices(f"hulkjax-calibrate-{counter[0]}")

    local = jax.local_devices()
    k = len(local)
    local_mesh = Mesh(np.array(local), ("dev",), axis_types=(AxisType.Auto,))
    per_dev = NamedSharding(local_mesh, PartitionSpec("dev"))
    out: dict = {"local_devices": k, "processes": jax.process_count(),
                 "platform": local[0].platform}

    n = int(matmul_size)
    reps = chain_length(BUSY_FLOPS, 6 * n ** 3)

    def dense_layer(i, xw):
        x, w = xw
        y = x @ w  # forward
        # input gradient (w transposed) and weight gradient (x transposed); filled with 1/n,
        # x @ w == x and the chain stays finite
        return y @ w.T, w + jnp.float32(1e-9) * (x.T @ y)

    fill = lambda idx: np.full((n, n), 1.0 / n, np.float32)  # noqa: E731
    xs = jax.make_array_from_callback((k * n, n), per_dev, fill)
    ws = jax.make_array_from_callback((k * n, n), per_dev, fill)
    mm = jax.jit(jax.shard_map(
        lambda x, w: jax.lax.fori_loop(0, reps, dense_layer, (x, w)), mesh=local_mesh,
        in_specs=(PartitionSpec("dev"),) * 2, out_specs=(PartitionSpec("dev"),) * 2))
    t = _median_time(lambda: mm(xs, ws), repeats, barrier)
    out["matmul"] = {"n": n, "chain": reps, "matmuls": "dense-layer training (x w, y w^T, x^T y)",
                     "seconds": t, "flops_per_device": 6 * n ** 3 * reps}

    # A weight gradient's matmul with both operands stored transposed (a: tokens x rows, b:
    # columns x tokens), a transformer's shapes at n = 1024 (2n tokens, n/4 rows, n columns).
    rows = max(1, n // 4)
    tt_flops = 2 * (2 * n) * rows * n
    tt_reps = chain_length(BUSY_FLOPS, tt_flops)
    a_tt = jax.make_array_from_callback((k * 2 * n, rows), per_dev,
                                        lambda idx: np.full((2 * n, rows), 1.0 / n, np.float32))
    b_tt = jax.make_array_from_callback((k * n, 2 * n), per_dev,
                                        lambda idx: np.full((n, 2 * n), 1.0 / n, np.float32))
    tt = jax.jit(jax.shard_map(
        lambda a, b: jax.lax.dot_general(a, b, (((0,), (1,)), ((), ()))), mesh=local_mesh,
        in_specs=(PartitionSpec("dev"),) * 2, out_specs=PartitionSpec("dev")))

    def transposed():
        y = None
        for _ in range(tt_reps):
            y = tt(a_tt, b_tt)
        return y

    t = _median_time(transposed, repeats, barrier)
    out["transposed_matmul"] = {"m": rows, "n": n, "k": 2 * n, "chain": tt_reps, "seconds": t,
                                "flops_per_device": tt_flops * tt_reps}

    elems = max(1, int(memory_bytes) // 4)
    passes = chain_length(BUSY_TRAFFIC, 2 * elems * 4)
    x = jax.make_array_from_callback((k * elems,), per_dev,
                                     lambda idx: np.ones(elems, np.float32))
    axpb = jax.jit(lambda v: v * jnp.float32(1.0001) + jnp.float32(1e-3))

    def streams():
        y = x
        for _ in range(passes):
            y = axpb(y)
        return y

    t, faults = _median_time_and_faults(streams, repeats, barrier)
    out["memory"] = {"bytes_per_device": elems * 4, "chain": passes, "seconds": t,
                     "traffic_per_device": 2 * elems * 4 * passes,
                     "page_faults_per_device": faults / k,
                     "page_bytes": resource.getpagesize()}
    # The same chain in place: each pass's input donated, its output takes the input's pages.
    in_place = jax.jit(lambda v: v * jnp.float32(1.0001) + jnp.float32(1e-3), donate_argnums=0)
    held = [jnp.copy(x)]

    def streams_in_place():
        y = held[0]
        for _ in range(passes):
            y = in_place(y)
        held[0] = y
        return y

    t, faults = _median_time_and_faults(streams_in_place, repeats, barrier)
    out["memory_in_place"] = {"seconds": t, "page_faults_per_device": faults / k}

    def chain(links):
        def body(v):
            for _ in range(links):
                v = v @ v
            return v
        return jax.jit(jax.shard_map(body, mesh=local_mesh, in_specs=PartitionSpec("dev"),
                                     out_specs=PartitionSpec("dev")))

    tiny = jax.make_array_from_callback((k * 16, 16), per_dev,
                                        lambda idx: np.full((16, 16), 1e-2, np.float32))
    one, many = chain(1), chain(KERNEL_CHAIN)
    out["kernels"] = {"chain": KERNEL_CHAIN,
                      "seconds_one": _median_time(lambda: one(tiny), repeats, barrier),
                      "seconds_chain": _median_time(lambda: many(tiny), repeats, barrier)}

    # One device per process: the link between processes.
    firsts = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
              for p in range(jax.process_count())]
    out["link"] = []
    if len(firsts) > 1:
        mesh = Mesh(np.array(firsts), ("proc",), axis_types=(AxisType.Auto,))
        for nb in link_bytes:
            fn, real = _allreduce_fn(mesh, "proc", int(nb))
            out["link"].append({"bytes": real, "seconds": _median_time(fn, repeats, barrier)})
        out["link_calls"] = _call_times(mesh, "proc", repeats, barrier)
    out["local_link"] = []
    if k > 1:
        for nb in link_bytes:
            fn, real = _allreduce_fn(local_mesh, "dev", int(nb))
            out["local_link"].append({"bytes": real,
                                      "seconds": _median_time(fn, repeats, barrier)})
        out["local_link_calls"] = _call_times(local_mesh, "dev", repeats, barrier)
    return out


def _worker_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hulkjax.launch.calibrate",
                                description="one process of hulkjax calibrate")
    p.add_argument("--coordinator", required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--config", required=True, help="JSON of measure()'s arguments and out")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[process {args.process_id}] %(message)s")
    try:
        import jax

        with open(args.config) as f:
            cfg = json.load(f)
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", int(cfg["local_devices"]))
        jax.distributed.initialize(coordinator_address=args.coordinator,
                                   num_processes=args.num_processes, process_id=args.process_id,
                                   initialization_timeout=int(cfg["timeout"]))
        res = measure(matmul_size=cfg["matmul_size"], memory_bytes=cfg["memory_bytes"],
                      link_bytes=cfg["link_bytes"], repeats=cfg["repeats"])
        if args.process_id == 0:
            path = os.path.join(cfg["out"], "measurements.json")
            with open(path + ".tmp", "w") as f:
                json.dump(res, f, indent=1)
            os.replace(path + ".tmp", path)
    except BaseException:  # noqa: BLE001 -- report, then leave without the shutdown barrier
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    jax.distributed.shutdown()
    return 0


# ---- the parent ----------------------------------------------------------------------------


def calibrate(*, processes: int = 2, local_devices: int = 1, matmul_size: int = 1024,
              memory_bytes: int = 64 << 20, link_bytes: Sequence[int] = (1 << 20, 1 << 23, 1 << 25),
              repeats: int = 5, out: str | None = None, name: str = "calibrated",
              timeout: float = 600.0, host: str = "127.0.0.1",
              prefix: Callable[[int], Sequence[str]] | None = None,
              env: dict | None = None) -> tuple[Topology, dict]:
    """Measure this machine and the link between its processes; a topology with those numbers.

    Spawns ``processes`` JAX processes with ``local_devices`` fake CPU devices each (one
    ``jax.distributed`` job on ``host``, as ``hulkjax launch`` does), measures as the module
    docstring says, and builds ``Topology.grid((processes, local_devices), ("proc", "dev"))``
    (``("proc",)`` with one device per process) whose device spec and links are the measured ones.

    Args:
      processes: processes (>= 2 to measure a link between processes).
      local_devices: fake CPU devices per process (the devices of a launch on this machine).
      matmul_size: ``n`` of the ``n x n`` float32 activations and weights of the dense-layer
        training matmuls (the module docstring).
      memory_bytes: bytes per device of the memory-bandwidth array.
      link_bytes: all-reduce sizes (bytes per device) the link is fitted on (>= 2 sizes).
      repeats: timed runs per measurement (the median is kept).
      out: directory for ``calibration.json``, ``topology.json`` and the worker logs.
      name: the topology's name.
      timeout: seconds for the whole job.
      host: the coordinator's address; prefix: per process a command prefix (``ip netns exec``
        to calibrate the links of network namespaces); env: extra environment for the workers.

    Returns:
      ``(topology, record)``; the record holds the raw timings and the fitted numbers, as
      written to ``out/calibration.json``.

    Raises:
      WorkerFailedError: a process failed or the job ran past ``timeout``.

    >>> topo, rec = calibrate(processes=2, matmul_size=128, memory_bytes=1 << 20,
    ...                       link_bytes=(1 << 12, 1 << 18), repeats=3)   # doctest: +SKIP
    >>> topo.axis_link("proc").bandwidth == rec["link"]["bandwidth"]        # doctest: +SKIP
    True
    """
    import tempfile

    if processes < 2:
        raise WorkerFailedError(f"processes={processes}: calibrate measures the link between "
                                f"processes, so it needs 2 or more.")
    if len(set(link_bytes)) < 2:
        raise WorkerFailedError(f"link_bytes={tuple(link_bytes)}: give two or more sizes (the "
                                f"link's bandwidth and latency are fitted on them).")
    run_dir = os.path.abspath(out or tempfile.mkdtemp(prefix="hulkjax-calibrate-"))
    os.makedirs(run_dir, exist_ok=True)
    cfg = {"local_devices": int(local_devices), "matmul_size": int(matmul_size),
           "memory_bytes": int(memory_bytes), "link_bytes": [int(b) for b in link_bytes],
           "repeats": int(repeats), "out": run_dir, "timeout": max(10, int(timeout))}
    cfg_path = os.path.join(run_dir, "calibrate-config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=1)
    meas_path = os.path.join(run_dir, "measurements.json")
    if os.path.exists(meas_path):
        os.remove(meas_path)
    coordinator = f"{host}:{_free_port(host)}"
    cmds = []
    for i in range(processes):
        cmd = [sys.executable, "-m", "hulkjax.launch.calibrate", "--coordinator", coordinator,
               "--num-processes", str(processes), "--process-id", str(i), "--config", cfg_path]
        cmds.append(list(prefix(i)) + cmd if prefix else cmd)
    log.info("calibrating: %d processes x %d devices, coordinator %s, run dir %s", processes,
             local_devices, coordinator, run_dir)
    _run_workers(cmds, run_dir, _worker_env(env), timeout)
    with open(meas_path) as f:
        meas = json.load(f)
    topo, record = _topology_from(meas, processes=processes, local_devices=local_devices,
                                  name=name)
    record["run_dir"] = run_dir
    with open(os.path.join(run_dir, "calibration.json"), "w") as f:
        json.dump(record, f, indent=1)
    topo.save(os.path.join(run_dir, "topology.json"))
    return topo, record


def _memory_capacity(devices: int) -> float:
    """This machine's RAM split between its devices (bytes)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return float(total) / devices


def fresh_page_time(memory: dict, in_place: dict) -> float:
    """Seconds per 4 KiB page a fresh buffer costs: what the memory chain into fresh outputs
    took beyond the same chain in place, over the page faults each device took per run
    (0 where it took none: buffers under the allocator's threshold reuse their pages).

    >>> fresh_page_time({"seconds": 0.5, "page_faults_per_device": 1e5, "page_bytes": 4096},
    ...                 {"seconds": 0.3, "page_faults_per_device": 0.0})
    2e-06
    """
    faults = memory.get("page_faults_per_device", 0.0) - in_place.get("page_faults_per_device", 0.0)
    if faults <= 0:
        return 0.0
    per_fault = max(memory["seconds"] - in_place["seconds"], 0.0) / faults
    return round(per_fault * PAGE_BYTES / memory.get("page_bytes", PAGE_BYTES), 12)


def transposed_dot_efficiency(matmul: dict, transposed: dict) -> float:
    """The share of the dense-layer chain's FLOP/s that the both-transposed matmul reached
    (at most 1: a device that runs it no slower is charged no more).

    >>> transposed_dot_efficiency({"flops_per_device": 2e10, "seconds": 0.1},
    ...                           {"flops_per_device": 1e10, "seconds": 0.125})
    0.4
    """
    rate = transposed["flops_per_device"] / transposed["seconds"]
    return round(min(1.0, rate / (matmul["flops_per_device"] / matmul["seconds"])), 6)


def device_spec(meas: dict, *, memory: float) -> DeviceSpec:
    """The device of :func:`measure`'s timings: FLOP/s is the measured work over the measured
    median time; the memory bandwidth the chain's traffic over its time in place (donated
    buffers, no fresh pages; the fresh chain's where an older measurement has no in-place
    one), the cost of a fresh page :func:`fresh_page_time`'s, the kernel overhead
    :func:`kernel_overhead`'s, the both-transposed matmuls' share
    :func:`transposed_dot_efficiency`'s (1 where an older measurement has none)."""
    mm, mem = meas["matmul"], meas["memory"]
    flops = mm["flops_per_device"] / mm["seconds"]
    tt = meas.get("transposed_matmul")
    in_place = meas.get("memory_in_place")
    seconds = in_place["seconds"] if in_place else mem["seconds"]
    return DeviceSpec(kind="cpu-calibrated", peak_flops=flops, peak_flops_f32=flops,
                      memory=memory, hbm_bandwidth=mem["traffic_per_device"] / seconds,
                      kernel_overhead=kernel_overhead(meas["kernels"]) if "kernels" in meas
                      else 0.0,
                      fresh_page_time=fresh_page_time(mem, in_place) if in_place else 0.0,
                      transposed_dot_efficiency=transposed_dot_efficiency(mm, tt) if tt else 1.0)


def _topology_from(meas: dict, *, processes: int, local_devices: int,
                   name: str) -> tuple[Topology, dict]:
    spec = device_spec(meas, memory=_memory_capacity(processes * local_devices))
    def fit(key: str, participants: int) -> tuple[float, float]:
        return fit_alpha_beta([x["bytes"] for x in meas[key]], [x["seconds"] for x in meas[key]],
                              participants=participants)

    local = local_devices > 1
    link_bw, link_fit = fit("link", processes)
    loc_bw, loc_fit = fit("local_link", local_devices) if local else (None, None)
    calls = {}
    if "link_calls" in meas:  # older measurements have no per-call timings
        calls["link_call"] = call_seconds(meas["link_calls"], participants=processes,
                                          bandwidth=link_bw)
        if local:
            calls["local_call"] = call_seconds(meas["local_link_calls"],
                                               participants=local_devices, bandwidth=loc_bw)
    overhead, link_lat = (split_call_cost(processes=processes, link_fit=link_fit, **calls)
                          if calls else (0.0, link_fit))
    # With per-call timings a local call's cost is the fixed part alone (split_call_cost).
    loc_lat = 0.0 if calls and local else loc_fit
    spec = replace(spec, collective_overhead=overhead)
    flops, hbm, kern = spec.peak_flops, spec.hbm_bandwidth, spec.kernel_overhead
    pages, tt = spec.fresh_page_time, spec.transposed_dot_efficiency
    record = {"format": CALIBRATION_FORMAT, "measurements": meas,
              "device": {"peak_flops": flops, "hbm_bandwidth": hbm, "memory": spec.memory,
                         "kernel_overhead": kern, "fresh_page_time": pages,
                         "transposed_dot_efficiency": tt, "collective_overhead": overhead},
              "calls": calls,
              "link": {"bandwidth": link_bw, "latency": link_lat, "latency_fit": link_fit,
                       "method": "gloo all-reduce between processes (jax.distributed on "
                                 "loopback or the given namespaces): bandwidth from an "
                                 "alpha-beta fit over sizes, latency per ring step from the "
                                 "per-call cost (split_call_cost)"}}
    if local:
        record["local_link"] = {"bandwidth": loc_bw, "latency": loc_lat, "latency_fit": loc_fit,
                                "method": "XLA:CPU all-reduce between one process's devices: "
                                          "bandwidth from an alpha-beta fit over sizes, no "
                                          "latency beyond the fixed cost per call "
                                          "(split_call_cost)"}
        topo = Topology.grid((processes, local_devices), ("proc", "dev"),
                             bandwidth=(link_bw, loc_bw), latency=(link_lat, loc_lat),
                             device=spec, name=name)
    else:
        topo = Topology.grid((processes,), ("proc",), bandwidth=link_bw, latency=link_lat,
                             device=spec, name=name)
    return topo, record


if __name__ == "__main__":
    sys.exit(_worker_main())
