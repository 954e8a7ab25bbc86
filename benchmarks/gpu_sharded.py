"""hulkjax's sharded programs, exported for XLA:GPU to compile for 8 GPUs on one GPU machine.

``benchmarks/gpu.py`` calibrated the compute model on unsharded steps on one GPU. The sharded
plans add collectives, XLA:GPU's combiners, its async start/done pairs and latency-hiding schedule,
and per-device compute on split operands; every check of those so far read XLA:CPU's programs.
This is the instrument for checking them on a GPU compiler, in two halves:

* **export** (here, no GPU): plan each third-party family (``tests/realmodels/families.py``) under
  each strategy on one 8-GPU H200 node (a ``(2, 4)`` mesh over NVLink), record the cost model's
  prediction in ``manifest.json`` (compute, collectives as ``backend="gpu"`` combines them, the
  overlapped step and which collectives it hides, peak memory), and serialize the program
  ``hj.emit`` compiles (its in/out shardings and every ``with_sharding_constraint``), lowered for
  CUDA (``jax.export``; needs ``flatbuffers``).
* **measure** (on the GPU machine: ``gpu_sharded_measure.py``, plain JAX): XLA:GPU compiles each
  program for 8 mocked GPUs (``jax_mock_gpu_topology``), saves the scheduled HLO, and runs it.

Status (2026-11-27, one H200, jax 0.11.2): the mocked client came up with 8 devices (1 local),
but no program finished compiling in 165 s (two attempts; see ``benchmarks/GPU.md``), so there
is no measurement yet and no report half. The measuring script now turns off XLA's sharded
autotuning, the likely wait (it exchanges autotuning results with the other, mocked, processes).

    python benchmarks/gpu_sharded.py export --out gpu_programs
    python benchmarks/gpu_sharded_measure.py --programs gpu_programs --out OUT    # on the GPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FAMILIES = ("gpt2", "llama", "bert", "gemma-bf16")
STRATEGIES = ("dp", "fsdp", "dp_tp", "expert", "auto")
MESH = ((2, 4), ("data", "model"))
NVLINK = dict(bandwidth=450e9, latency=1e-6)  # NVLink4 per GPU per direction (topologies.md)


def topology():
    import hulkjax as hj
    from hulkjax.topology.specs import DEVICE_SPECS

    return hj.Topology.grid(MESH[0], MESH[1], device=DEVICE_SPECS["H200"], name="h200x8-2x4",
                            **NVLINK)


def prediction(plan) -> dict:
    """What the cost model says of ``plan`` on GPU: times, collectives, overlap, memory."""
    import hulkjax as hj

    cm = hj.strategies.cost_model(plan.graph, plan.topology)
    o = cm.overlapped(plan.assignment, "gpu")
    summary = cm.program_summary(plan.assignment, "gpu")
    return {
        "compute_time": plan.cost.compute_time, "comm_time": plan.cost.comm_time,
        "step_time": plan.cost.step_time, "peak_memory": plan.cost.peak_memory,
        "overlapped_step_time": o.step_time, "exposed_comm_time": o.exposed_comm_time,
        "hidden_comm_time": o.hidden_comm_time, "overlap_comm_time": o.comm_time,
        "collectives": [{"kind": c.kind, "axes": list(c.axes), "bytes": c.bytes,
                         "count": c.count, "seconds": c.seconds,
                         "hidden_seconds": c.hidden_seconds, "asynchronous": c.asynchronous}
                        for c in o.collectives],
        "summary": [{"kind": k, "axes": list(a), "count": v["count"], "bytes": v["bytes"]}
                    for (k, a), v in sorted(summary.items())],
    }


def export(out: str, families=FAMILIES, strategies=STRATEGIES, size: str = "base",
           platform: str = "cuda") -> dict:
    """Plan, predict and serialize every (family, strategy) into ``out`` (``manifest.json`` and
    one ``.bin`` per program). ``platform="cpu"`` lowers for the CPU instead: a check of
    ``gpu_sharded_measure.py --cpu`` where no GPU is."""
    import jax

    import hulkjax as hj
    from tests.realmodels import families as fam

    os.makedirs(out, exist_ok=True)
    topo = topology()
    manifest = {"mesh_shape": list(MESH[0]), "axis_names": list(MESH[1]), "size": size,
                "topology": topo.name, "jax": jax.__version__, "programs": []}
    for family in families:
        step, state, batch = fam.build(family, size)
        graph = hj.trace(step, state, batch)
        for strategy in strategies:
            name = f"{family}-{strategy}"
            t0 = time.perf_counter()
            plan = hj.plan(step, state, batch, topology=topo, strategy=strategy, graph=graph)
            planned = time.perf_counter() - t0
            fn, abstract = hj.emit(step, plan, donate=False).jitted(state, batch)
            blob = jax.export.export(fn, platforms=(platform,))(*abstract).serialize()
            with open(os.path.join(out, f"{name}.bin"), "wb") as f:
                f.write(blob)
            manifest["programs"].append({"name": name, "family": family, "strategy": strategy,
                                         "file": f"{name}.bin", "plan_seconds": planned,
                                         "predicted": prediction(plan)})
            print(f"{name}: planned in {planned:.1f} s, predicted "
                  f"{plan.cost.step_time * 1e3:.2f} ms, {len(blob) / 1e6:.1f} MB", flush=True)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="plan, predict and serialize the programs (no GPU)")
    e.add_argument("--out", required=True)
    e.add_argument("--families", nargs="*", default=list(FAMILIES))
    e.add_argument("--strategies", nargs="*", default=list(STRATEGIES))
    e.add_argument("--size", default="base")
    e.add_argument("--platform", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    export(args.out, args.families, args.strategies, args.size, args.platform)


if __name__ == "__main__":
    main()
