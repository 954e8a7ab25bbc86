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

* **report** (here): XLA:GPU's collectives, read off each scheduled program
  (:func:`hulkjax.emit.hlo.collectives_from_hlo`: kind, mesh axes, bytes, async, and the work
  each async pair is in flight over), against the cost model's combined program and overlapped
  schedule; the local device's step time, matmul kernels and compiled memory against the
  predicted compute and peak. ``benchmarks/GPU_SHARDED.md``, from the records in
  ``benchmarks/results/gpu_sharded/`` (``report --measured`` adds one).

Status: on 2026-11-27 nothing compiled in time. On 2026-11-28 (one H200, jax 0.11.2) the
measuring script's probe showed why: with XLA's defaults the compiler waits in
``xla::InMemoryKeyValueStore::Get`` (``ConfigAssignerPass``: sharded autotuning waits for the 7
mocked processes), and with ``--xla_gpu_shard_autotuning=false`` 18 of the 20 programs compiled
(13-22 s each) and ran in two calls of the device's 15 minutes.

    python benchmarks/gpu_sharded.py export --out gpu_programs
    python benchmarks/gpu_sharded_measure.py --programs gpu_programs --out OUT    # on the GPU
    python benchmarks/gpu_sharded.py report --measured OUT --programs gpu_programs \
        --record h200-DATE.json
    python benchmarks/gpu_sharded.py report        # GPU_SHARDED.md from the records alone
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

    cm = hj.strategies.plan_cost_model(plan.graph, plan.topology, plan)
    o = cm.overlapped(plan.assignment, "gpu")
    summary = cm.program_summary(plan.assignment, "gpu")
    compute = cm.breakdown(plan.assignment, memory=False).compute
    matmul = sum(t for n, t in zip(plan.graph.nodes, compute)
                 if n.name in ("dot_general", "conv_general_dilated"))
    return {
        "compute_time": plan.cost.compute_time, "matmul_time": matmul,
        "comm_time": plan.cost.comm_time,
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


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu_sharded")


def _profile(events: list[dict]) -> dict | None:
    """GPU time of one profiled step: all kernels, matmul kernels, and how many kernels."""
    from gpu import _GEMM  # this directory: the matmul kernels as the unsharded report reads them

    if not events:
        return None
    busy = sum(e["dur_ns"] for e in events) / 1e9
    gemm = sum(e["dur_ns"] for e in events if _GEMM.search(e["name"])) / 1e9
    return {"busy": busy, "gemm": gemm, "kernels": len(events)}


def digest(measured: list[str], programs: str) -> dict:
    """One record of a measurement (``gpu_sharded_measure.py``'s folders, ``measured``) with the
    export's predictions (``programs``' manifest): per program the step time, the profiled GPU
    time, the compiled memory, and XLA:GPU's collectives read off its scheduled HLO
    (:func:`hulkjax.emit.hlo.collectives_from_hlo`: kind, mesh axes, bytes, operands, whether
    async and how much work it is in flight over). Small enough to commit, unlike the HLO."""
    import gzip
    import tarfile

    from hulkjax.emit.hlo import collectives_from_hlo

    manifest = json.load(open(os.path.join(programs, "manifest.json")))
    by_name = {e["name"]: e for e in manifest["programs"]}
    out = {"mesh_shape": manifest["mesh_shape"], "axis_names": manifest["axis_names"],
           "size": manifest["size"], "topology": manifest["topology"],
           "export_jax": manifest["jax"], "runs": [], "programs": []}
    for folder in measured:
        m = json.load(open(os.path.join(folder, "measured.json")))
        out["runs"].append({k: m.get(k) for k in ("date", "device", "jax", "xla_flags",
                                                  "mock_gpu_topology", "children",
                                                  "mock_collectives")}
                           | {"probes": m.get("probes", []),
                              "stacks": _stacks(os.path.join(folder, "log.txt"))})
        hlo = {}
        with tarfile.open(os.path.join(folder, "hlo.tar")) as tar:
            for member in tar.getmembers():
                hlo[member.name.split(".hlo")[0]] = gzip.decompress(
                    tar.extractfile(member).read()).decode()
        for row in m["programs"]:
            name = row["name"]
            if name not in hlo:
                continue
            entry = by_name[name]
            collectives = collectives_from_hlo(hlo[name], manifest["mesh_shape"],
                                               manifest["axis_names"])
            out["programs"].append({
                "name": name, "family": entry["family"], "strategy": entry["strategy"],
                "run": len(out["runs"]) - 1, "compile_seconds": row.get("compile_seconds"),
                "seconds": row.get("seconds"), "times": row.get("times"),  # None: not run
                "memory": row.get("memory"), "profile": _profile(row.get("events", [])),
                "collectives": [{"kind": c.kind, "axes": list(c.axes), "bytes": c.bytes,
                                 "operands": len(c.shapes), "asynchronous": c.asynchronous,
                                 "overlapped": c.overlapped} for c in collectives],
                "predicted": entry["predicted"]})
    return out


def _stacks(log: str, keep: int = 40) -> list[str]:
    """The native stacks ``gpu_sharded_measure.py`` dumped of children that hung (each
    ``py-spy dump --native`` block of its log, its first ``keep`` lines)."""
    if not os.path.exists(log):
        return []
    blocks, current = [], None
    for line in open(log).read().splitlines():
        if line.startswith("--- ") and "py-spy" in line:
            current = []
            blocks.append(current)
        elif line.startswith("$ "):
            current = None
        elif current is not None and len(current) < keep and line.strip():
            current.append(line)
    return ["\n".join(b) for b in blocks]


def _cells(collectives, hidden) -> dict:
    """``{(kind, axes): [count, bytes, overlapped count, overlapped bytes]}``."""
    out: dict = {}
    for c in collectives:
        cell = out.setdefault((c["kind"], tuple(c["axes"])), [0, 0, 0, 0])
        cell[0] += 1
        cell[1] += c["bytes"]
        if hidden(c):
            cell[2] += 1
            cell[3] += c["bytes"]
    return out


def compare(program: dict) -> dict:
    """XLA:GPU's collectives against the cost model's, per (kind, mesh axes): the counts after
    combining, the bytes, and which run while compute does (XLA: an async pair with work
    between its start and done; the model: any hidden seconds in its overlapped schedule)."""
    xla = _cells(program["collectives"], lambda c: c["overlapped"] > 0)
    model = _cells(program["predicted"]["collectives"], lambda c: c["hidden_seconds"] > 0)
    rows = []
    for key in sorted(set(xla) | set(model)):
        x, p = xla.get(key, [0, 0, 0, 0]), model.get(key, [0, 0, 0, 0])
        rows.append({"kind": key[0], "axes": list(key[1]), "xla": x, "model": p})
    return {"cells": rows,
            "counts_equal": sum(r["xla"][0] == r["model"][0] for r in rows),
            "bytes_within_5pct": sum(abs(r["xla"][1] - r["model"][1])
                                     <= 0.05 * max(r["xla"][1], r["model"][1]) for r in rows),
            "xla_bytes": sum(r["xla"][1] for r in rows),
            "model_bytes": sum(r["model"][1] for r in rows),
            "xla_overlapped_bytes": sum(r["xla"][3] for r in rows),
            "model_hidden_bytes": sum(r["model"][3] for r in rows),
            "xla_sync": sum(not c["asynchronous"] for c in program["collectives"]),
            # Collectives whose over-compute status the model gets wrong, at least: per cell,
            # the difference of the two over-compute counts.
            "overlap_misses": sum(abs(r["xla"][2] - r["model"][2]) for r in rows),
            "xla_count": sum(r["xla"][0] for r in rows)}


def _load(folder: str = RESULTS, prefix: str = "h200-") -> list[dict]:
    """The records: ``h200-*.json`` the measurements with XLA's flags as the probe chose them,
    ``flags-*.json`` programs compiled again with other XLA flags (experiments)."""
    import glob

    return [json.load(open(p)) for p in sorted(glob.glob(os.path.join(folder, prefix + "*.json")))
            if "attempt" not in os.path.basename(p)]


def _experiments(records: list[dict], experiments: list[dict]) -> list[str]:
    """Each program compiled again with other flags: its collectives per (kind, axes) beside
    the same program's with the probe's flags and the cost model's."""
    base = {p["name"]: p for r in records for p in r["programs"]}
    out = []
    for rec in experiments:
        for p in rec["programs"]:
            if p["name"] not in base:
                continue
            flags = " ".join(f for f in (rec["runs"][p["run"]].get("xla_flags") or "").split()
                             if "shard_autotuning" not in f)
            again = _cells(p["collectives"], lambda c: False)
            first = _cells(base[p["name"]]["collectives"], lambda c: False)
            model = _cells(base[p["name"]]["predicted"]["collectives"], lambda c: False)
            for key in sorted(set(again) | set(first) | set(model)):
                a, f, m = (d.get(key, [0, 0]) for d in (again, first, model))
                if a[:2] == f[:2] == m[:2]:
                    continue
                out.append(f"| `{flags}` | {p['name']} | {key[0]} | {','.join(key[1])} | "
                           f"{f[0]} ({f[1] / 1e6:.0f} MB) | {a[0]} ({a[1] / 1e6:.0f} MB) | "
                           f"{m[0]} ({m[1] / 1e6:.0f} MB) |")
    return out


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f}"


def _cell(c: list) -> str:
    return f"{c[0]} ({c[1] / 1e6:.0f} MB; {c[2]} over compute)"


def markdown(records: list[dict], command: str, experiments: list[dict] | None = None) -> str:
    import statistics

    from gpu import _ms  # this directory

    progs = [p for r in records for p in r["programs"]]
    runs = [run for r in records for run in r["runs"]]
    cmp = {p["name"]: compare(p) for p in progs}
    cells = [c for v in cmp.values() for c in v["cells"]]
    timed = [p for p in progs if p.get("seconds") is not None]
    ratio = [p["seconds"] / p["predicted"]["compute_time"] for p in timed]
    gemm = [(p["profile"]["gemm"], p["predicted"]["matmul_time"]) for p in timed
            if p.get("profile")]
    mem = [(_compiled(p), p["predicted"]["peak_memory"]) for p in progs if p.get("memory")]
    probes = runs[0]["probes"] if runs else []
    out = [
        "# XLA:GPU's own sharded programs against the cost model",
        "",
        f"Generated by `{command}` from `benchmarks/results/gpu_sharded/` "
        f"({len(progs)} programs: {', '.join(sorted({p['family'] for p in progs}))} at size "
        f"`{records[0]['size'] if records else '-'}`, each under "
        f"{', '.join(sorted({p['strategy'] for p in progs}))}, planned for one 8-GPU H200 node, "
        "a (2, 4) `data` x `model` mesh over NVLink). Each program is the one `hj.emit` "
        "compiles, exported here (`gpu_sharded.py export`) and compiled by XLA:GPU for 8 GPUs on "
        f"one real GPU ({', '.join(sorted({str(r['device']) + ', jax ' + str(r['jax']) + ', ' + str(r['date']) for r in runs}))}) "
        "with JAX's `jax_mock_gpu_topology` (`gpu_sharded_measure.py`): one device of 8 is real, "
        "the other 7 and their collectives are mocked.",
        "",
        "## Compiling for 8 mocked GPUs",
        "",
    ]
    for pr in probes:
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in pr.get("phases", {}).items())
        fate = ("timed out after " + f"{pr['timed_out_after']:.0f} s"
                if "timed_out_after" in pr else f"exit {pr.get('returncode')}")
        out.append(f"- XLA flags `{pr.get('xla_flags') or '(none)'}`: {phases}; {fate}.")
    stacks = [st for run in runs for st in run.get("stacks", [])]
    frames = [ln.strip().split(" (")[0] for ln in (stacks[0].splitlines() if stacks else [])
              if "xla::" in ln][:6]
    out += [
        "",
        "With XLA's defaults the compile never ends: its native stack (`py-spy dump --native`, "
        "kept in the record) waits in `xla::InMemoryKeyValueStore::Get`, "
        "called by `xla::ConfigAssigner::AssignConfigs` in `xla::gpu::ConfigAssignerPass`: "
        "sharded autotuning waits for the results of the 7 mocked processes, which never come. "
        "`--xla_gpu_shard_autotuning=false` compiles every program tried (the 2026-11-27 attempts, "
        "`results/gpu_sharded/h200-attempt-2026-11-27.json`, ran with the defaults: most "
        "likely they waited there). Mocked collectives move nothing: no profile of these "
        "programs holds a communication kernel, and a program summing a 64 MB array over the "
        "8 (a local reduction, then the all-reduce) took "
        + ", ".join(f"{r['seconds'] * 1e6:.0f} us" for run in runs
                    for r in (run.get("mock_collectives") or [])
                    if r.get("kind") == "all-reduce" and r.get("megabytes") == 64)
        + " (one per run), a local copy of the same size "
        + ", ".join(f"{r['seconds'] * 1e6:.0f} us" for run in runs
                    for r in (run.get("mock_collectives") or [])
                    if r.get("kind") == "local copy" and r.get("megabytes") == 64)
        + ".",
    ]
    if frames:
        out += ["", "The hung compile's innermost XLA frames, innermost first:", "",
                *(f"    {f}" for f in frames)]
    out += [
        "",
        "## The collectives: counts, bytes, and which run during compute",
        "",
        f"- **Counts after combining** equal in {sum(c['xla'][0] == c['model'][0] for c in cells)}"
        f" of {len(cells)} (program, kind, mesh axes) cells; **bytes** within 5% in "
        f"{sum(abs(c['xla'][1] - c['model'][1]) <= 0.05 * max(c['xla'][1], c['model'][1]) for c in cells)}"
        f" of {len(cells)}; programs whose every cell matches in count: "
        f"{sum(v['counts_equal'] == len(v['cells']) for v in cmp.values())} of {len(cmp)}.",
        f"- **Over compute.** XLA:GPU runs {sum(v['xla_overlapped_bytes'] for v in cmp.values()) / max(1, sum(v['xla_bytes'] for v in cmp.values())):.0%}"
        " of all collective bytes as async pairs with work scheduled between start and done; the "
        f"cost model's overlapped schedule hides some of {sum(v['model_hidden_bytes'] for v in cmp.values()) / max(1, sum(v['model_bytes'] for v in cmp.values())):.0%}."
        f" Synchronous collectives in XLA's programs (nothing to overlap): "
        f"{sum(v['xla_sync'] for v in cmp.values())}.",
        f"- **Which ones.** Per cell, the two over-compute counts differ by "
        f"{sum(v['overlap_misses'] for v in cmp.values())} collectives of XLA's "
        f"{sum(v['xla_count'] for v in cmp.values())} "
        f"({sum(v['overlap_misses'] for v in cmp.values()) / max(1, sum(v['xla_count'] for v in cmp.values())):.0%}; "
        + ", ".join(f"{s} {sum(cmp[p['name']]['overlap_misses'] for p in progs if p['strategy'] == s)}"
                    f"/{sum(cmp[p['name']]['xla_count'] for p in progs if p['strategy'] == s)}"
                    for s in sorted({p["strategy"] for p in progs}))
        + "): a lower bound on the collectives the model places wrongly.",
    ]
    rs = [c for c in cells if c["kind"] == "reduce-scatter" and c["xla"][0] < c["model"][0]]
    ar = [c for c in cells if c["kind"] == "all-reduce" and c["model"][1] > 1.05 * c["xla"][1]]
    extra = sum(c["model"][1] - c["xla"][1] for c in ar)
    out += [
        "",
        "What differs, and why (read off the programs):",
        "",
        f"- **Reduce-scatters combined past the threshold.** In {len(rs)} cells XLA:GPU made "
        f"{sum(c['xla'][0] for c in rs)} reduce-scatters where the model, combining up to "
        "30 MiB (`xla_gpu_reduce_scatter_combine_threshold_bytes`' default), predicts "
        f"{sum(c['model'][0] for c in rs)}. Without a threshold given, XLA:GPU's all-reduce and "
        "all-gather combiners (in XLA's source) combine the collectives its scheduler would "
        "leave synchronous up to the device's memory, and pipelined ones up to what the "
        "program's peak leaves free (`ComputeSuggestedCombinerThreshold`); these programs show "
        "its reduce-scatters combined past 30 MiB too. The model does not know which those "
        "are. Bytes are the same; latencies are fewer. Not settled: compiled again with the "
        "thresholds given as 30 MiB (below), they stayed combined, but XLA's combiners take "
        "their heuristic path whenever the threshold equals its default, which 30 MiB is, so "
        "that run did not test it (another value was not tried: the device time was spent).",
        "- **Partial sums added before they are reduced.** XLA adds two partial sums and "
        "all-reduces the sum once (its `AllReduceReassociate` pass: `all-reduce(a) + "
        "all-reduce(b)` into `all-reduce(a + b)`): a tied embedding's gradient, whose lookup (a "
        "scatter-add) and output projection (a matmul, then transposes) are both partial over "
        "the batch, is one all-reduce of the summed `input_scatter_fusion` in XLA's `dp` "
        "programs; Megatron's input gradient of a layer whose several matmuls read one input is "
        "likewise one all-reduce. Compiled again with "
        "`--xla_disable_hlo_passes=all-reduce-reassociate` (below), XLA:GPU all-reduces each "
        "operator's partial sum where it is made, which is what the cost model predicted until "
        "2026-11-28. The GPU backend now reassociates in the program it predicts "
        "(`Backend.reassociates_all_reduce`, `CostModel._reassociated`: counts, bytes, overlap); "
        "the planners' objective prices each merge two groups' layouts decide "
        "(`CostModel.sum_sites`; a chain's later adds, which three groups decide, it still "
        f"charges). All-reduce cells where the model moves over 5% more "
        f"bytes than XLA: {len(ar)}"
        + (f", {extra / 1e6:.0f} MB." if ar else "."),
        "- **Forward tensor-parallel all-reduces.** XLA:GPU runs almost all of them "
        "synchronously: what follows needs their result, and the small operators that do not "
        "(a causal mask's iota and comparisons, weight transposes) are fused into the kernels "
        "that read them. The cost model's schedule runs such fusible operators inside their "
        "reader (`hulkjax.cost.overlap`); until 2026-11-28 they ran on their own and hid the "
        "early forward all-reduces.",
        "",
        "| program | kind | axes | XLA:GPU: count (bytes; over compute) | cost model: count "
        "(bytes; hidden) |",
        "|---|---|---|---|---|",
    ]
    for p in progs:
        for c in cmp[p["name"]]["cells"]:
            mark = "" if c["xla"][0] == c["model"][0] else " **≠**"
            out.append(f"| {p['name']} | {c['kind']} | {','.join(c['axes']) or '-'} | "
                       f"{_cell(c['xla'])} | {_cell(c['model'])}{mark} |")
    rows = _experiments(records, experiments or [])
    if rows:
        out += [
            "",
            "Programs compiled again with other XLA flags (`report --measured ... --record "
            "flags-*.json`), the cells that differ:",
            "",
            "| flags | program | kind | axes | XLA:GPU, probe's flags | XLA:GPU, these flags | "
            "cost model |",
            "|---|---|---|---|---:|---:|---:|",
            *rows,
        ]
    out += [
        "",
        "## Compute and memory per device",
        "",
        "The step runs on the one real device with its collectives mocked: it times that "
        "device's compute and launches, and whatever the mock costs per collective (the host "
        "still drives each async pair). The profiled matmul kernels are the cleanest compute "
        "check: they time the per-device products of the sharded plan.",
        "",
        f"- Step (mocked collectives) / predicted compute: median {statistics.median(ratio):.2f}, "
        f"range {min(ratio):.2f}-{max(ratio):.2f}.",
    ]
    if gemm:
        g = [m / p for m, p in gemm]
        out.append(f"- Matmul kernels measured / the cost model's matmul time: median "
                   f"{statistics.median(g):.2f}, range {min(g):.2f}-{max(g):.2f}.")
    if mem:
        mm = [p / c for c, p in mem]
        out.append(f"- Memory, predicted peak / compiled (arguments + outputs + temporaries): "
                   f"median {statistics.median(mm):.2f}, range {min(mm):.2f}-{max(mm):.2f}.")
    out += [
        "",
        "| program | step (ms) | predicted compute (ms) | ratio | GPU busy (ms) | matmul kernels "
        "/ predicted (ms) | kernels | async collectives | memory predicted / compiled (GB) | "
        "compile (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in timed:
        pr, prof = p["predicted"], p.get("profile")
        n_async = sum(c["asynchronous"] for c in p["collectives"])
        out.append(
            f"| {p['name']} | {_ms(p['seconds'])} | {_ms(pr['compute_time'])} | "
            f"{p['seconds'] / pr['compute_time']:.2f} | "
            f"{'-' if prof is None else _ms(prof['busy'])} | "
            f"{'-' if prof is None else _ms(prof['gemm'])} / {_ms(pr['matmul_time'])} | "
            f"{'-' if prof is None else prof['kernels']} | {n_async} | "
            f"{_gb(pr['peak_memory'])} / {_gb(_compiled(p))} | "
            f"{p['compile_seconds']:.1f} |")
    out += [
        "",
        "Step: median of timed runs after warm-up (wall clock, `block_until_ready`). GPU busy "
        "and matmul kernels: one profiled step (JAX's profiler). Compiled memory: XLA's "
        "`memory_analysis()` (no donation in these programs). Over compute / hidden: the "
        "collectives an async pair runs over work (XLA) or that the overlapped schedule hides "
        "any of (the cost model), not how many seconds.",
        "",
    ]
    return "\n".join(out)


def _compiled(p: dict) -> int:
    m = p["memory"]
    return (m["argument_size_in_bytes"] + m["output_size_in_bytes"] + m["temp_size_in_bytes"]
            - m["alias_size_in_bytes"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="plan, predict and serialize the programs (no GPU)")
    e.add_argument("--out", required=True)
    e.add_argument("--families", nargs="*", default=list(FAMILIES))
    e.add_argument("--strategies", nargs="*", default=list(STRATEGIES))
    e.add_argument("--size", default="base")
    e.add_argument("--platform", default="cuda", choices=("cuda", "cpu"))
    r = sub.add_parser("report", help="benchmarks/GPU_SHARDED.md from the recorded measurements "
                                      "(with --measured: record a new one first)")
    r.add_argument("--measured", nargs="*", default=[],
                   help="folders gpu_sharded_measure.py wrote (measured.json, hlo.tar)")
    r.add_argument("--programs", help="the export folder those programs came from")
    r.add_argument("--record", help="file name under results/gpu_sharded/ for the new record")
    args = ap.parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    if args.command == "export":
        export(args.out, args.families, args.strategies, args.size, args.platform)
        return
    if args.measured:
        if not args.programs or not args.record:
            ap.error("--measured needs --programs (the export) and --record (a file name)")
        record = digest(args.measured, args.programs)
        with open(os.path.join(RESULTS, args.record), "w") as f:
            json.dump(record, f, separators=(",", ":"))
    records = _load()
    text = markdown(records, "python benchmarks/gpu_sharded.py report", _load(prefix="flags-"))
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "GPU_SHARDED.md"), "w") as f:
        f.write(text)
    print(f"{sum(len(r['programs']) for r in records)} programs: benchmarks/GPU_SHARDED.md")


if __name__ == "__main__":
    main()
