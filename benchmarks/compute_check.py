"""The calibrated compute model on third-party model code: measured unsharded steps against the
cost model's prediction on the device ``hulkjax calibrate`` measures.

One process, one fake CPU device. It measures the device as ``hulkjax calibrate`` does
(:func:`hulkjax.launch.calibrate.measure`: chained dense-layer training matmuls, fresh-buffer
memory passes, the kernel overhead), then for each family of ``tests/realmodels/families.py``
(third-party Flax code, random-initialized) times the jitted unsharded training step (median of
``--repeats`` after a warm-up) and predicts its compute with
:class:`~hulkjax.cost.model.CostModel` on a one-device topology of that device. Run it pinned to
one core, as the WAN testbed runs each region (the rate of one core then does not depend on
what else runs)::

    taskset -c 0 python benchmarks/compute_check.py                      # about 2 minutes
    taskset -c 0 python benchmarks/compute_check.py --families gpt2 bert --size small
    taskset -c 0 python benchmarks/compute_check.py --families gpt2 llama --batches 16 8 4 2

``--batches`` runs each step on the first ``b`` examples of its batch too (as a pipeline's
microbatch would): the prediction's error as the batch shrinks. ``--streams`` (default 1-256 MB)
times a streaming kernel into a fresh output buffer and in place: on XLA:CPU a fresh buffer above
glibc's mmap threshold is new pages, and writing it costs the page faults, which is what the
calibrated memory rate measures. The threshold rises (to 32 MB at most) as the process frees
large buffers, so the streams, timed after the families' steps, see fewer faults at small sizes
than a new process does.

Writes ``benchmarks/results/compute_check.json`` and ``benchmarks/COMPUTE.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # the families live in tests/realmodels
sys.path.insert(0, HERE)  # gpu_measure, also when imported rather than run

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from gpu_measure import _median_time  # noqa: E402  (this directory: the same timer)

import hulkjax as hj  # noqa: E402
from hulkjax.cost.model import CostModel  # noqa: E402
from hulkjax.launch.calibrate import device_spec, measure  # noqa: E402
from tests.realmodels import families  # noqa: E402

JSON_PATH = os.path.join(HERE, "results", "compute_check.json")
MD_PATH = os.path.join(HERE, "COMPUTE.md")


def stream_rates(megabytes: int, repeats: int) -> dict:
    """Bytes/s of ``y = x * a + b`` on a ``megabytes`` float32 array: into a fresh output buffer,
    and in place (the input donated, so the output reuses its pages)."""
    import resource

    import jax.numpy as jnp

    n = megabytes * (1 << 20) // 4
    traffic = 2 * 4 * n
    axpb = lambda v: v * jnp.float32(1.0001) + jnp.float32(1e-3)  # noqa: E731
    into_fresh, inplace = jax.jit(axpb), jax.jit(axpb, donate_argnums=0)
    x = jnp.ones((n,), jnp.float32)
    y = [jnp.ones((n,), jnp.float32)]  # the donated array, replaced by each call's result

    def fresh_call():
        jax.block_until_ready(into_fresh(x))

    def donated_call():
        y[0] = jax.block_until_ready(inplace(y[0]))

    def timed(call) -> tuple[float, float]:
        """Median seconds and minor page faults (the process's count) per call, after two
        warm-up calls."""
        for _ in range(2):
            call()
        f0, times = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, []
        for _ in range(repeats):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / repeats
        return sorted(times)[len(times) // 2], faults

    (fresh, faults_fresh), (donated, faults_donated) = timed(fresh_call), timed(donated_call)
    return {"megabytes": megabytes, "fresh": traffic / fresh, "donated": traffic / donated,
            "faults_fresh": faults_fresh, "faults_donated": faults_donated,
            "pages": 4 * n / resource.getpagesize()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=["gpt2", "bert", "t5", "vit", "llama"],
                    choices=families.names())
    ap.add_argument("--size", default="small")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--streams", type=int, nargs="*", default=[1, 4, 16, 64, 256],
                    metavar="MB", help="also time y = x * a + b at these sizes, into a fresh "
                    "output buffer and in place (donated): what the memory rate depends on")
    ap.add_argument("--batches", type=int, nargs="+", default=None,
                    help="also run each step on the first b examples of its batch (default: "
                         "the family's own batch only)")
    args = ap.parse_args(argv)
    # One device (set here, not on import: importing must leave JAX's configuration alone).
    jax.config.update("jax_num_cpu_devices", 1)
    meas = measure(matmul_size=1024, memory_bytes=32 << 20, link_bytes=(), repeats=args.repeats)
    spec = device_spec(meas, memory=16e9)
    topo = hj.Topology.grid((1,), ("d",), device=spec, name="calibrated-1")
    print(f"calibrated: {spec.peak_flops / 1e9:.1f} GFLOP/s, {spec.hbm_bandwidth / 1e9:.2f} GB/s, "
          f"kernel overhead {spec.kernel_overhead * 1e6:.1f} us", flush=True)
    rows = []
    for name in args.families:
        if not families.available(name):
            print(f"  {name}: skipped ({families.FAMILIES[name].install})", flush=True)
            continue
        step, state, full = families.build(name, args.size)
        jitted = jax.jit(step)
        own = len(jax.tree_util.tree_leaves(full)[0])
        for b in args.batches or [own]:
            if b > own:
                print(f"  {name}: batch {b} skipped (its batch has {own} examples)", flush=True)
                continue
            batch = jax.tree_util.tree_map(lambda x, b=b: x[:b], full)
            measured, _ = _median_time(jitted, (state, batch), args.repeats)
            graph = hj.trace(step, state, batch)
            cm = CostModel(graph, topo)
            predicted = cm.evaluate(cm.replicated_assignment()).compute_time
            rows.append({"family": name, "model": families.FAMILIES[name].model,
                         "size": args.size, "batch": b, "measured": measured,
                         "predicted": predicted})
            print(f"  {name} (batch {b}): measured {measured * 1e3:.1f} ms, predicted "
                  f"{predicted * 1e3:.1f} ms ({measured / predicted:.2f})", flush=True)
    streams = [stream_rates(mb, args.repeats) for mb in args.streams]
    for r in streams:
        print(f"  stream {r['megabytes']} MB: fresh output {r['fresh'] / 1e9:.1f} GB/s "
              f"({r['faults_fresh']:.0f} page faults a call), in place "
              f"{r['donated'] / 1e9:.1f} GB/s ({r['faults_donated']:.0f})", flush=True)
    cpus = sorted(os.sched_getaffinity(0))
    res = {"date": datetime.date.today().isoformat(), "jax": jax.__version__, "cpus": cpus,
           "command": "python benchmarks/compute_check.py " + " ".join(sys.argv[1:]),
           "device": {"peak_flops": spec.peak_flops, "hbm_bandwidth": spec.hbm_bandwidth,
                      "kernel_overhead": spec.kernel_overhead}, "rows": rows,
           "streams": streams}
    os.makedirs(os.path.dirname(JSON_PATH), exist_ok=True)
    with open(JSON_PATH, "w") as fh:
        json.dump(res, fh, indent=1)
    lines = ["# Calibrated compute on third-party model code", "",
             f"Generated by `{'taskset -c ' + str(cpus[0]) + ' ' if len(cpus) == 1 else ''}"
             f"{res['command'].strip()}` on {res['date']} (jax {res['jax']}, cores {cpus}). "
             f"The device as `hulkjax calibrate` measures it: "
             f"{spec.peak_flops / 1e9:.1f} GFLOP/s (chained dense-layer training matmuls), "
             f"{spec.hbm_bandwidth / 1e9:.2f} GB/s, kernel overhead "
             f"{spec.kernel_overhead * 1e6:.1f} us. Each family's unsharded training step "
             f"(random-initialized, median of {args.repeats}) against the cost model's compute "
             f"prediction on that device.", "",
             "| family | model | size | batch | measured | predicted | measured / predicted | "
             "measured per example | predicted per example |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['model']} | {r['size']} | {r['batch']} | "
                     f"{r['measured'] * 1e3:.1f} ms | {r['predicted'] * 1e3:.1f} ms | "
                     f"{r['measured'] / r['predicted']:.2f} | "
                     f"{r['measured'] / r['batch'] * 1e3:.1f} ms | "
                     f"{r['predicted'] / r['batch'] * 1e3:.1f} ms |")
    if streams:
        lines += ["", "Memory rate by buffer: `y = x * a + b` on a float32 array (one read, one "
                  "write per element), its output in a fresh buffer (as `hulkjax calibrate` "
                  "measures it, and as a step's outputs and temporaries are allocated each call) "
                  "or in the input's buffer (donated), median of the timed calls; minor page "
                  "faults per call from the process's count (`getrusage`).", "",
                  "| array | pages | fresh output | page faults a call | in place | page faults "
                  "a call |", "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['megabytes']} MB | {r['pages']:.0f} | {r['fresh'] / 1e9:.1f} GB/s | "
                  f"{r['faults_fresh']:.0f} | {r['donated'] / 1e9:.1f} GB/s | "
                  f"{r['faults_donated']:.0f} |" for r in streams]
    with open(MD_PATH, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print(f"wrote {JSON_PATH} and {MD_PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
