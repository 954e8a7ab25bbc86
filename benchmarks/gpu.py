"""The compute model against a real GPU: calibrate on an H100, then check on steps it never saw.

Two halves, because hulkjax pins JAX 0.10 and the GPU machine has its own JAX:

1. ``benchmarks/gpu_measure.py`` runs on the GPU with plain JAX (no hulkjax): matmul, streaming
   and per-kernel microbenchmarks, and the training steps of six third-party model families
   (``tests/realmodels/families.py``), timed and profiled. Its JSON files are committed in
   ``benchmarks/results/gpu/`` (``run1``: microbenchmarks and ``small``/``base`` steps; ``run2``:
   bfloat16 matmuls, profiled steps; ``run3`` and ``run4``: the held-out
   ``wide`` and ``large`` steps).
2. This script (anywhere): traces the same steps with hulkjax, predicts them on one H100 with the
   datasheet roofline and with the calibrated spec, fits the calibration, and writes
   ``benchmarks/results/gpu.json`` and ``benchmarks/GPU.md``.

The calibration (``DeviceSpec.flops_efficiency``, ``memory_efficiency``, ``kernel_overhead``):

* ``flops_efficiency``: a chain of ``8192^3`` bfloat16 matmuls against the dense bf16 peak (the
  TF32 chain's fraction is reported beside it).
* ``memory_efficiency``: streaming ``y = a x + b`` over 2 GB against the HBM bandwidth.
* ``kernel_overhead``: the one number fitted on training steps. The predicted step is
  ``T0 + k * K`` (``T0``: the roofline with the two efficiencies, ``K``: the kernels the cost model
  counts); ``k`` minimizes the mean absolute log error over the ``small`` and ``base`` steps,
  and is also fitted leaving each family out (the held-out error of each family is reported).
  The ``wide`` and ``large`` steps (other widths, sequences and batches; ``large`` is a 1B-class
  matmul-bound step) are never used to fit.

A held-out GPU (``benchmarks/results/gpu/h200/``: an H200, measured with the same script): nothing
of it is fitted on its training steps. Its steps are predicted with the numbers the H200 carried
before it was measured (the H100's efficiencies and kernel overhead on the H200's datasheet) and
with its own microbenchmarks' efficiencies plus the H100's fitted kernel overhead, and its
compiled programs' memory (``memory_analysis``: arguments + outputs + temporaries, which is the
allocator's measured peak where a step ran first in its process) against the cost model's
predicted peak of the unsharded step.

    python benchmarks/gpu_measure.py --out run.json     # on a GPU machine (plain JAX)
    python benchmarks/gpu.py                            # here: predict, fit, write GPU.md
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import re
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tqdm import tqdm  # noqa: E402

import hulkjax as hj  # noqa: E402
from hulkjax.cost.model import CostModel  # noqa: E402
from hulkjax.topology.specs import DEVICE_SPECS  # noqa: E402
from tests.realmodels import families  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = os.path.join(HERE, "results", "gpu")
FIT_SIZES = ("small", "base")
HELD_OUT_SIZES = ("wide", "large")
# Held-out devices: folder under RUNS -> the DEVICE_SPECS kind its measurements are of.
HELD_OUT_DEVICES = {"h200": "H200"}
_GEMM = re.compile(r"gemm|xmma|cutlass|cublas|sm\d\d_", re.I)


def load_runs(folder: str = RUNS) -> dict:
    """The measurements, later runs over earlier ones: microbenchmark rows per case, steps per
    ``(family, size)``. Run 1's bfloat16 matmul chain was promoted to float32 by a NumPy scalar
    (fixed in ``gpu_measure.py``); run 2 measured it again, and its rows replace run 1's."""
    out: dict = {"matmuls": {}, "streaming": {}, "kernel_floor": {}, "steps": {}, "runs": []}
    for path in sorted(glob.glob(os.path.join(folder, "run*.json"))):
        with open(path) as f:
            run = json.load(f)
        out["runs"].append({k: run.get(k) for k in ("device", "platform", "jax", "date")}
                           | {"file": os.path.basename(path)})
        for r in run.get("matmuls", []):
            out["matmuls"][(r["dtype"], r["precision"], r["n"])] = r
        for r in run.get("streaming", []):
            out["streaming"][r["megabytes"]] = r
        for r in run.get("kernel_floor", []):
            out["kernel_floor"][r["case"]] = r
        for r in run.get("steps", []):
            if "seconds" in r:
                out["steps"][(r["family"], r["size"])] = r
    return out


def efficiencies(runs: dict, spec) -> dict:
    """The two efficiencies from the microbenchmarks (largest sizes measured)."""
    bf16 = max((r for (d, p, n), r in runs["matmuls"].items() if d == "bfloat16"),
               key=lambda r: r["n"])
    tf32 = max((r for (d, p, n), r in runs["matmuls"].items()
                if d == "float32" and p == "default"), key=lambda r: r["n"])
    stream = max(runs["streaming"].values(), key=lambda r: r["megabytes"])
    return {
        "flops_efficiency": bf16["tflops"] * 1e12 / spec.peak_flops,
        "tf32_efficiency": tf32["tflops"] * 1e12 / spec.flops_for("float32"),
        "memory_efficiency": stream["gbps"] * 1e9 / spec.hbm_bandwidth,
        "bf16_tflops": bf16["tflops"], "tf32_tflops": tf32["tflops"], "stream_gbps": stream["gbps"],
        "matmul_n": bf16["n"], "stream_mb": stream["megabytes"],
    }


def _topology(spec) -> hj.Topology:
    return hj.Topology.grid((1,), ("d",), device=spec)


def predict(graph, spec) -> dict:
    """Compute time of the unsharded step on one device of ``spec`` (the sum the cost model
    charges every operator: ``strategy="replicate"``'s ``cost.compute_time``), its kernel count,
    and the matmul share. Loop bodies are costed by their own cost models, not summed here, so a
    graph with loops is refused (the families have none)."""
    if any(n.subgraphs for n in graph.nodes):
        raise ValueError("predict() sums top-level operators; this graph has loops")
    cm = CostModel(graph, _topology(spec))
    total = mm = 0.0
    for n in graph.nodes:
        t = cm.compute_time(n, 1)
        total += t
        if n.name in ("dot_general", "conv_general_dilated"):
            mm += t
    return {"seconds": total, "matmul_seconds": mm, "kernels": int(sum(cm.launches))}


def predicted_memory(step, state, batch, graph, spec) -> float:
    """The cost model's peak memory of the unsharded step on one device of ``spec``."""
    return hj.plan(step, state, batch, topology=_topology(spec), strategy="replicate",
                   graph=graph).cost.peak_memory


def compiled_memory(step_row: dict) -> int | None:
    """Bytes the compiled program needs: arguments + outputs + temporaries - aliased outputs."""
    m = step_row.get("memory")
    if not m:
        return None
    return m["argument"] + m["output"] + m["temp"] - m["alias"]


def _profile_split(step: dict) -> dict | None:
    prof = step.get("profile")
    if not prof or not prof.get("lines"):
        return None
    n = prof["steps"]
    line = max(prof["lines"], key=lambda ln: ln["total_ns"])
    gemm = sum(ns for name, (ns, _) in line["top"] if _GEMM.search(name)) / n / 1e9
    busy = line["total_ns"] / n / 1e9
    return {"busy": busy, "gemm": gemm, "other": busy - gemm, "kernels": line["events"] / n}


def _log_err(measured: float, predicted: float) -> float:
    return abs(math.log(measured / predicted))


def fit_overhead(rows: list[dict], grid=None) -> float:
    """``k`` (seconds per kernel) minimizing the mean ``|log(measured / (T0 + k K))|``."""
    grid = grid or [i * 0.05e-6 for i in range(0, 401)]  # 0 to 20 us
    return min(grid, key=lambda k: sum(_log_err(r["measured"], r["t0"] + k * r["kernels"])
                                       for r in rows))


def geo_mean_error(ratios) -> float:
    """``exp(mean |log ratio|)``: 1.0 is exact; 1.2 means 20% off on (geometric) average."""
    ratios = list(ratios)
    return math.exp(sum(abs(math.log(r)) for r in ratios) / len(ratios)) if ratios else float("nan")


def run(runs: dict) -> dict:
    base_spec = DEVICE_SPECS["H100"]
    datasheet = dataclasses.replace(base_spec, flops_efficiency=1.0, memory_efficiency=1.0,
                                    kernel_overhead=0.0)
    eff = efficiencies(runs, datasheet)
    no_overhead = dataclasses.replace(datasheet, flops_efficiency=round(eff["flops_efficiency"], 2),
                                      memory_efficiency=round(eff["memory_efficiency"], 2))
    rows = []
    keys = sorted(runs["steps"], key=lambda k: ((FIT_SIZES + HELD_OUT_SIZES).index(k[1]), k[0]))
    for fam, size in tqdm(keys, desc="trace + predict", unit="step"):
        step, state, batch = families.build(fam, size)
        graph = hj.trace(step, state, batch)
        m = runs["steps"][(fam, size)]
        p_sheet = predict(graph, datasheet)
        p_eff = predict(graph, no_overhead)
        p_shipped = predict(graph, base_spec)
        rows.append({
            "family": fam, "size": size, "held_out": size in HELD_OUT_SIZES,
            "measured": m["seconds"], "xla_kernels": m.get("hlo_kernels"),
            "datasheet": p_sheet["seconds"], "t0": p_eff["seconds"], "kernels": p_eff["kernels"],
            "matmul_predicted": p_eff["matmul_seconds"], "shipped": p_shipped["seconds"],
            "profile": _profile_split(m), "nodes": len(graph.nodes),
        })
        del step, state, batch, graph
    fit_rows = [r for r in rows if not r["held_out"]]
    k_all = fit_overhead(fit_rows)
    for fam in sorted({r["family"] for r in fit_rows}):
        k = fit_overhead([r for r in fit_rows if r["family"] != fam])
        for r in rows:
            if r["family"] == fam and not r["held_out"]:
                r["k_without_family"] = k
                r["leave_family_out"] = r["t0"] + k * r["kernels"]
    for r in rows:
        r["calibrated"] = r["t0"] + k_all * r["kernels"]
    held = [r for r in rows if r["held_out"]]
    summary = {
        "datasheet_error_fit": geo_mean_error(r["measured"] / r["datasheet"] for r in fit_rows),
        "calibrated_error_fit": geo_mean_error(r["measured"] / r["calibrated"] for r in fit_rows),
        "leave_family_out_error": geo_mean_error(r["measured"] / r["leave_family_out"]
                                                 for r in fit_rows),
        "datasheet_error_held_out": geo_mean_error(r["measured"] / r["datasheet"] for r in held),
        "calibrated_error_held_out": geo_mean_error(r["measured"] / r["calibrated"] for r in held),
        "shipped_error_all": geo_mean_error(r["measured"] / r["shipped"] for r in rows),
        "worst_shipped": max(rows, key=lambda r: _log_err(r["measured"], r["shipped"])),
    }
    fitted = {"flops_efficiency": round(eff["flops_efficiency"], 2),
              "memory_efficiency": round(eff["memory_efficiency"], 2),
              "kernel_overhead": round(k_all, 8)}
    return {"device": runs["runs"][0]["device"] if runs["runs"] else None, "runs": runs["runs"],
            "efficiencies": eff, "fitted": fitted,
            "shipped": {k: getattr(base_spec, k) for k in fitted}, "rows": rows,
            "summary": summary,
            "micro": {"matmuls": list(runs["matmuls"].values()),
                      "streaming": list(runs["streaming"].values()),
                      "kernel_floor": list(runs["kernel_floor"].values())}}


def held_out_device(folder: str, kind: str, base_spec, base_rows=()) -> dict:
    """Predict a GPU none of whose steps was used to fit anything.

    ``transferred``: the H100's efficiencies and kernel overhead on this kind's datasheet (what
    ``DEVICE_SPECS`` carried for it before it was measured); ``own``: its own microbenchmarks'
    efficiencies with the H100's kernel overhead; ``shipped``: ``DEVICE_SPECS[kind]`` now.
    ``base_rows``: the H100's rows (:func:`run`), for the speed-up over it, measured and
    predicted, of the steps measured on both."""
    runs = load_runs(folder)
    shipped = DEVICE_SPECS[kind]
    datasheet = dataclasses.replace(shipped, flops_efficiency=1.0, memory_efficiency=1.0,
                                    kernel_overhead=0.0)
    eff = efficiencies(runs, datasheet)
    calib = ("flops_efficiency", "memory_efficiency", "kernel_overhead")
    transferred = dataclasses.replace(datasheet, **{k: getattr(base_spec, k) for k in calib})
    own = dataclasses.replace(datasheet, flops_efficiency=round(eff["flops_efficiency"], 2),
                              memory_efficiency=round(eff["memory_efficiency"], 2),
                              kernel_overhead=base_spec.kernel_overhead)
    rows = []
    keys = sorted(runs["steps"], key=lambda k: ((FIT_SIZES + HELD_OUT_SIZES).index(k[1]), k[0]))
    for fam, size in tqdm(keys, desc=f"{kind}: trace + predict", unit="step"):
        step, state, batch = families.build(fam, size)
        graph = hj.trace(step, state, batch)
        m = runs["steps"][(fam, size)]
        rows.append({
            "family": fam, "size": size, "measured": m["seconds"],
            "datasheet": predict(graph, datasheet)["seconds"],
            "transferred": predict(graph, transferred)["seconds"],
            "own": predict(graph, own)["seconds"],
            "shipped": predict(graph, shipped)["seconds"],
            "profile": _profile_split(m),
            "matmul_predicted": predict(graph, own)["matmul_seconds"],
            "memory_compiled": compiled_memory(m),
            "memory_peak_measured": m.get("peak_bytes_in_use"),
            "memory_predicted": predicted_memory(step, state, batch, graph, shipped),
        })
        del step, state, batch, graph
    err = {name: geo_mean_error(r["measured"] / r[name] for r in rows)
           for name in ("datasheet", "transferred", "own", "shipped")}
    h100 = {(r["family"], r["size"]): r for r in base_rows}
    both = [(h100[r["family"], r["size"]], r) for r in rows if (r["family"], r["size"]) in h100]
    speedup = {"steps": len(both)}
    if both:
        speedup["measured"] = math.exp(statistics.mean(
            math.log(b["measured"] / r["measured"]) for b, r in both))
        speedup["predicted"] = math.exp(statistics.mean(
            math.log(b["shipped"] / r["shipped"]) for b, r in both))
    mem = [r["memory_predicted"] / r["memory_compiled"] for r in rows if r["memory_compiled"]]
    return {"kind": kind, "folder": os.path.relpath(folder, HERE), "runs": runs["runs"],
            "efficiencies": eff, "own": {k: getattr(own, k) for k in calib},
            "transferred": {k: getattr(transferred, k) for k in calib},
            "shipped": {k: getattr(shipped, k) for k in calib}, "rows": rows, "errors": err,
            "speedup_over_h100": speedup,
            "memory_within_15": sum(abs(x - 1) <= 0.15 for x in mem), "memory_cases": len(mem),
            "micro": {"matmuls": list(runs["matmuls"].values()),
                      "streaming": list(runs["streaming"].values()),
                      "kernel_floor": list(runs["kernel_floor"].values())}}


def held_out_markdown(h: dict) -> list[str]:
    e, eff, k = h["errors"], h["efficiencies"], h["kind"]
    out = [
        "",
        f"## A held-out GPU: {k}",
        "",
        f"Measured with the same script on one {h['runs'][0]['device']} "
        f"(`benchmarks/{h['folder']}/`: "
        f"{', '.join(r['file'] + ', jax ' + str(r['jax']) + ', ' + str(r['date']) for r in h['runs'])}). "
        "None of its steps fitted anything: each is predicted from the datasheet and "
        "microbenchmarks alone.",
        "",
        f"- Its microbenchmarks: bf16 {eff['matmul_n']}^3 chain {eff['bf16_tflops']:.0f} TFLOP/s "
        f"({eff['flops_efficiency']:.3f} of the datasheet; the H100 reached 0.694), streaming "
        f"{eff['stream_mb']:.0f} MB {eff['stream_gbps']:.0f} GB/s ({eff['memory_efficiency']:.3f} "
        "of the datasheet's HBM bandwidth; the H100 reached 0.769).",
        f"- Step time, measured / predicted (geometric mean over {len(h['rows'])} steps): "
        f"datasheet roofline **{e['datasheet']:.2f}x**; the H100's numbers on the {k} "
        f"datasheet (what `DEVICE_SPECS['{k}']` carried before) **{e['transferred']:.2f}x**; the "
        f"{k}'s own efficiencies with the H100's kernel overhead **{e['own']:.2f}x**; shipped "
        f"now ({_calibration(h['shipped'])}) **{e['shipped']:.2f}x**.",
    ]
    sp = h.get("speedup_over_h100", {})
    if sp.get("steps"):
        out.append(
            f"- Against the H100 (the {sp['steps']} steps measured on both): the {k} is "
            f"{sp['measured']:.2f}x faster measured and {sp['predicted']:.2f}x predicted "
            "(geometric means, shipped specs). The H200 has the H100's compute and 1.43x its "
            "HBM bandwidth on paper; its steps gain less than their memory-bound share suggests, "
            "the kernels of model size reaching a smaller share of the bandwidth than the 2 GB "
            "stream (the streaming table: 1.1 TB/s at 64 MB, 1.9 at 256 MB).")
    out += [
        f"- Memory: the cost model's peak of the unsharded step within 15% of XLA:GPU's compiled "
        f"program's (arguments + outputs + temporaries) in {h['memory_within_15']}/"
        f"{h['memory_cases']} steps. Where a step ran first in its process, the allocator's "
        "measured peak (`memory_stats()['peak_bytes_in_use']`) equals the compiled program's "
        f"bytes (the table's last column).{_memory_misses(h['rows'])}",
        "",
        "| family | size | measured (ms) | datasheet | H100's numbers | own efficiencies | "
        "shipped | GEMM measured / predicted (ms) | memory predicted / compiled (GB) | "
        "allocator peak (GB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in h["rows"]:
        prof = r["profile"]
        mem = ("-" if not r["memory_compiled"] else
               f"{r['memory_predicted'] / 1e9:.2f} / {r['memory_compiled'] / 1e9:.2f} "
               f"({r['memory_predicted'] / r['memory_compiled']:.2f})")
        peak = r["memory_peak_measured"]
        out.append(
            f"| {r['family']} | {r['size']} | {_ms(r['measured'])} | "
            + " | ".join(f"{_ms(r[c])} ({r['measured'] / r[c]:.2f})"
                         for c in ("datasheet", "transferred", "own", "shipped"))
            + f" | {'-' if prof is None else _ms(prof['gemm']) + ' / ' + _ms(r['matmul_predicted'])}"
            + f" | {mem} | {'-' if peak is None else f'{peak / 1e9:.2f}'} |")
    out += ["", "Cells: predicted ms (measured / predicted). The allocator's peak is a high-water "
            "mark over every step its process ran, so it speaks of a step only where it rises.",
            "", f"| {k} matmul | n | us per matmul | TFLOP/s |", "|---|---:|---:|---:|"]
    for r in sorted(h["micro"]["matmuls"], key=lambda r: (r["dtype"], r["precision"], r["n"])):
        out.append(f"| {r['dtype']} ({r['precision']}) | {r['n']} | "
                   f"{r['seconds_per_matmul'] * 1e6:.1f} | {r['tflops']:.1f} |")
    out += ["", f"| {k} streaming (MB) | us | GB/s |", "|---:|---:|---:|"]
    for r in sorted(h["micro"]["streaming"], key=lambda r: r["megabytes"]):
        out.append(f"| {r['megabytes']:.0f} | {r['seconds'] * 1e6:.1f} | {r['gbps']:.0f} |")
    out += ["", f"| {k} per-kernel floor | kernels | us per kernel |", "|---|---:|---:|"]
    for r in h["micro"]["kernel_floor"]:
        out.append(f"| {r['case']} | {r['chain']} | {r['seconds_per_link'] * 1e6:.2f} |")
    return out


def _memory_misses(rows) -> str:
    ratios = [r["memory_predicted"] / r["memory_compiled"] for r in rows if r["memory_compiled"]]
    over = sorted(x for x in ratios if x > 1.15)
    under = sorted(x for x in ratios if x < 0.85)
    out = ""
    if over:
        out += (f" Over-predicted beyond 15%: {len(over)} ({over[0]:.2f}-{over[-1]:.2f}x): XLA:GPU "
                "keeps fewer intermediates live than the cost model's liveness walk, which "
                "holds XLA:CPU's compiled programs of the same families within 15% "
                "(`benchmarks/FIDELITY.md`).")
    if under:
        out += f" Under-predicted beyond 15%: {len(under)} ({under[0]:.2f}-{under[-1]:.2f}x)."
    return out


def _calibration(c: dict) -> str:
    return (f"`flops_efficiency` {c['flops_efficiency']}, `memory_efficiency` "
            f"{c['memory_efficiency']}, `kernel_overhead` {c['kernel_overhead'] * 1e6:g} us")


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def markdown(res: dict, command: str) -> str:
    s, eff, fit, shipped = res["summary"], res["efficiencies"], res["fitted"], res["shipped"]
    out = [
        "# The compute model against a real GPU",
        "",
        f"Generated by `{command}` from the measurements in `benchmarks/results/gpu/` "
        f"({', '.join(r['file'] + ': ' + str(r['device']) + ', jax ' + str(r['jax']) + ', ' + str(r['date']) for r in res['runs'])}), "
        "taken with `benchmarks/gpu_measure.py` (plain JAX on the GPU; hulkjax traces and "
        "predicts here). One GPU: these numbers calibrate compute; communication and its "
        "overlap with compute need several GPUs and are not measured here.",
        "",
        "## Calibration",
        "",
        "| number | measured | shipped in `DEVICE_SPECS` | from |",
        "|---|---:|---:|---|",
        f"| `flops_efficiency` | {eff['flops_efficiency']:.3f} | {shipped['flops_efficiency']} | "
        f"bf16 {eff['matmul_n']}^3 matmul chain: {eff['bf16_tflops']:.0f} TFLOP/s of 990 "
        f"(TF32: {eff['tf32_tflops']:.0f} of 495, {eff['tf32_efficiency']:.3f}) |",
        f"| `memory_efficiency` | {eff['memory_efficiency']:.3f} | "
        f"{shipped['memory_efficiency']} | streaming {eff['stream_mb']:.0f} MB: "
        f"{eff['stream_gbps']:.0f} GB/s of 3350 |",
        f"| `kernel_overhead` | {fit['kernel_overhead'] * 1e6:.2f} us | "
        f"{shipped['kernel_overhead'] * 1e6:.2f} us | fitted on the {len([r for r in res['rows'] if not r['held_out']])} "
        f"`small` and `base` steps (per kernel the cost model counts) |",
        "",
        "## Predicted against measured step time (one H100, unsharded step)",
        "",
        f"- Datasheet roofline: measured / predicted is **{s['datasheet_error_fit']:.2f}x** off "
        f"(geometric mean) on the fitting steps and {s['datasheet_error_held_out']:.2f}x on the "
        "held-out `wide` and `large` steps.",
        f"- Calibrated: **{s['calibrated_error_fit']:.2f}x** on the fitting steps, "
        f"{s['leave_family_out_error']:.2f}x with `kernel_overhead` fitted leaving the family out, "
        f"and **{s['calibrated_error_held_out']:.2f}x on the held-out `wide` and `large` steps**.",
        f"- Worst case of the shipped spec: {s['worst_shipped']['family']} "
        f"{s['worst_shipped']['size']}, measured {_ms(s['worst_shipped']['measured'])} ms against "
        f"{_ms(s['worst_shipped']['shipped'])} ms predicted.",
        "",
        "Measured: median of timed steps after warm-up (wall clock, `block_until_ready`). "
        "Kernels: the cost model's count against the launching instructions of XLA's entry "
        "computation. GEMM: profiled GPU time in cuBLAS / Triton matmul kernels against the "
        "calibrated matmul roofline.",
        "",
        "| family | size | measured (ms) | datasheet (ms) | ratio | calibrated (ms) | ratio | "
        "leave family out | kernels (model / XLA) | GEMM measured / predicted (ms) | "
        "GPU busy / wall |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        prof = r["profile"]
        lfo = r.get("leave_family_out")
        lfo_cell = "-" if lfo is None else f"{r['measured'] / lfo:.2f}"
        busy_cell = "-" if prof is None else f"{prof['busy'] / r['measured']:.2f}"
        out.append(
            f"| {r['family']} | {r['size']}{' (held out)' if r['held_out'] else ''} | "
            f"{_ms(r['measured'])} | {_ms(r['datasheet'])} | {r['measured'] / r['datasheet']:.2f} | "
            f"{_ms(r['calibrated'])} | {r['measured'] / r['calibrated']:.2f} | "
            f"{lfo_cell} | "
            f"{r['kernels']} / {r['xla_kernels']} | "
            f"{'-' if prof is None else _ms(prof['gemm']) + ' / ' + _ms(r['matmul_predicted'])} | "
            f"{busy_cell} |")
    out += [
        "",
        "Ratios are measured / predicted (above 1: the step is slower than predicted).",
        "",
        "## Microbenchmarks",
        "",
        "| matmul | n | us per matmul | TFLOP/s |",
        "|---|---:|---:|---:|",
    ]
    for r in sorted(res["micro"]["matmuls"], key=lambda r: (r["dtype"], r["precision"], r["n"])):
        out.append(f"| {r['dtype']} ({r['precision']}) | {r['n']} | "
                   f"{r['seconds_per_matmul'] * 1e6:.1f} | {r['tflops']:.1f} |")
    out += ["", "| streaming (MB) | us | GB/s |", "|---:|---:|---:|"]
    for r in sorted(res["micro"]["streaming"], key=lambda r: r["megabytes"]):
        out.append(f"| {r['megabytes']:.0f} | {r['seconds'] * 1e6:.1f} | {r['gbps']:.0f} |")
    out += ["", "| per-kernel floor | kernels | us per kernel |", "|---|---:|---:|"]
    for r in res["micro"]["kernel_floor"]:
        out.append(f"| {r['case']} | {r['chain']} | {r['seconds_per_link'] * 1e6:.2f} |")
    out += [
        "",
        "Run 2 also holds model-shaped matmuls timed one product per call (an earlier version "
        "of `gpu_measure.py`); each includes the ~70 us of dispatch and synchronisation a single "
        "call pays (the one-kernel row above), so they are not used, and the script no longer "
        "takes them.",
        "",
        "## What this does not cover",
        "",
        "- Communication and its overlap with compute: one GPU. The collective terms stay the "
        "alpha-beta model of `hulkjax/cost/comm.py`. XLA:GPU's own program for 8 GPUs (its "
        "combiners, async collectives and latency-hiding schedule) is compiled on one GPU with "
        "JAX's `jax_mock_gpu_topology` and compared with the cost model in "
        "`benchmarks/GPU_SHARDED.md` (`benchmarks/gpu_sharded.py`). The 2026-11-27 attempts "
        "compiled nothing: with XLA's defaults the compiler waits forever for the mocked "
        "processes' autotuning results (seen in its native stack on 2026-11-28); "
        "`--xla_gpu_shard_autotuning=false` compiles every program.",
        "- A100, V100 and T4 take the H100's efficiencies and kernel overhead (assumed: the "
        "same compiler; their datasheet ratios are kept); the H200 carries its own measured "
        "efficiencies (below). TPU and CPU specs are unchanged.",
        "- The cost model counts more kernels than XLA launches (the table's kernels column): "
        "XLA fuses sibling and multi-output fusions the model counts separately, so the fitted "
        "overhead per counted kernel is below the measured idle gap per launched kernel.",
    ]
    for h in res.get("held_out_devices", []):
        out += held_out_markdown(h)
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=RUNS, help="folder of gpu_measure.py JSON files")
    args = ap.parse_args(argv)
    t0 = time.time()
    res = run(load_runs(args.runs))
    res["held_out_devices"] = [held_out_device(os.path.join(args.runs, folder), kind,
                                               DEVICE_SPECS["H100"], res["rows"])
                               for folder, kind in HELD_OUT_DEVICES.items()
                               if glob.glob(os.path.join(args.runs, folder, "run*.json"))]
    res["seconds"] = time.time() - t0
    with open(os.path.join(HERE, "results", "gpu.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    with open(os.path.join(HERE, "GPU.md"), "w") as f:
        f.write(markdown(res, "python benchmarks/gpu.py"))
    s = res["summary"]
    print(f"fitted {res['fitted']} (shipped {res['shipped']})")
    print(f"datasheet {s['datasheet_error_fit']:.2f}x, calibrated {s['calibrated_error_fit']:.2f}x "
          f"(leave family out {s['leave_family_out_error']:.2f}x), held out "
          f"{s['calibrated_error_held_out']:.2f}x (datasheet {s['datasheet_error_held_out']:.2f}x)")
    for h in res["held_out_devices"]:
        print(f"held-out {h['kind']}: " + ", ".join(f"{k} {v:.2f}x" for k, v in h["errors"].items())
              + f"; memory within 15% in {h['memory_within_15']}/{h['memory_cases']}")
    print("median |log err| shipped:",
          statistics.median(_log_err(r["measured"], r["shipped"]) for r in res["rows"]))


if __name__ == "__main__":
    main()
