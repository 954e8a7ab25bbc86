"""Alpa's benchmark suite as a yardstick: plan its GPT configurations on its cluster (issue 14, item 6).

Alpa (Zheng et al., OSDI'22) planned GPT-3-style models from 350M parameters on 1 GPU to 39B on 64
GPUs of AWS p3.16xlarge instances (8 x V100 16 GB, NVLink2 inside, 25 Gb/s between), and took about
2,393 s to plan the 39B one. This script traces and plans the same configurations with hulkjax on
the ``aws-p3`` preset, each case in a fresh process (timeout, peak RSS as
``benchmarks/planning.py`` measures it), and puts the planning time and the **predicted** step
time next to Alpa's **published** numbers.

What is published and where (nothing here is a measurement of ours on GPUs):

* configurations: ``benchmark/alpa/suite_manual_gpt.py`` (``gpt_specs``: sequence 1024, vocab
  51200, hidden / layers / heads per size), ``benchmark/alpa/suite_auto_gpt.py`` (global batch
  1024; the microbatch counts of the solutions Alpa found on p3.16xlarge, ``perf_test_suite``), in
  alpa-projects/alpa (main);
* throughput: ``osdi22_artifact/results_e2e_ref.tsv`` (branch ``osdi22_artifact`` of
  alpa-projects/alpa; the data of the paper's end-to-end figure, GPT weak scaling): TFLOP/s per
  GPU of ``parax.auto`` (Alpa) and ``megatron``, counted by Alpa's ``compute_gpt_tflops``
  (``benchmark/util.py`` of that branch) with rematerialization (factor 96). The step time in our
  table is **derived** from it: Alpa's FLOP count / (TFLOP/s x GPUs);
* sanity figure: GPT-2.6B, batch 32, 4 microbatches, data x operator x pipeline = 2 x 2 x 2 on 8
  GPUs, 2.425 s per iteration (``benchmark/alpa/README.md`` at commit 5e8e355d, May 2022; a
  hand-set ("uniform") plan, measured);
* planning time: 2,393 s for GPT-39B on 64 GPUs (the paper's compilation-time section, as quoted in
  issue 14 and ``/work/shared/reference/anchors.md``); no other planning time is tabulated.

How hulkjax is set up: the zoo's ``gpt2`` at Alpa's sizes (learned position embedding, tied LM
head, as Alpa's GPT), bfloat16 for Alpa's fp16 (same bytes, the V100's fp16 peak), ``remat`` on
every block (Alpa's ``use_remat``), AdamW, abstract arguments (nothing is allocated). hulkjax's SPMD
plans have no gradient accumulation (only staged plans split the batch into microbatches), so
where the global batch does not fit as one step the script plans the step at ``batch / k`` for
``k = 2, 4, ...`` until a plan fits and predicts ``k x`` its step time: an upper bound under the
cost model (the gradient reduction and the optimizer update are paid every microbatch instead of
once). Planning time is the sum over all attempts (what finding a plan costs), tracing excluded.

Results go to ``benchmarks/results/alpa.json`` and ``benchmarks/ALPA.md`` (linked from
``PLANNING.md``)::

    python benchmarks/alpa.py                 # every case, auto + ilp (~15 minutes on 2 cores)
    python benchmarks/alpa.py --quick         # 2-layer models, small batches: a smoke test
    python benchmarks/alpa.py --cases gpt-1.3b gpt-2.6b --no-ilp
    python benchmarks/alpa.py --report-only   # ALPA.md from the JSON

Not planned: Alpa's Wide-ResNet (its bottleneck widens only the 3x3 convolution by the width
factor, which the zoo's ResNet cannot express, and its BatchNorm cannot be microbatched exactly)
and its MoE (it alternates dense and MoE layers over a 32k-token vocabulary with 2,048-token expert
groups; the zoo's ``moe`` has an MoE MLP in every layer, no embedding and one group per sequence).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from planning import (  # noqa: E402  (the planning benchmark's helpers)
    _digest,
    _rss_mb,
    machine_info,
    run_in_fresh_process,
)

OUT_JSON = os.path.join(HERE, "results", "alpa.json")
OUT_MD = os.path.join(HERE, "ALPA.md")

ALPA = "alpa-projects/alpa"
SRC_SPECS = f"{ALPA} `benchmark/alpa/suite_manual_gpt.py` + `suite_auto_gpt.py`"
SRC_E2E = f"{ALPA}@osdi22_artifact `osdi22_artifact/results_e2e_ref.tsv`"
SRC_SANITY = f"{ALPA}@5e8e355d `benchmark/alpa/README.md`"
SRC_PLAN = "Alpa paper (OSDI'22), compilation time, via anchors.md"

# key -> Alpa's configuration and its published numbers. gpt_specs: (hidden, layers, heads);
# sequence 1024 and vocab 51200 everywhere. microbatches: Alpa's solution on p3.16xlarge
# (perf_test_suite); tflops / megatron_tflops: TFLOP/s per GPU (results_e2e_ref.tsv).
CASES: dict[str, dict] = {
    "gpt-350m": dict(size="350M", hidden=1024, layers=24, heads=16, batch=1024, nodes=1, gpus=1,
                     microbatches=512, tflops=45.07, megatron_tflops=47.53),
    "gpt-760m": dict(size="760M", hidden=1536, layers=24, heads=16, batch=1024, nodes=1, gpus=2,
                     microbatches=128, tflops=57.92, megatron_tflops=55.53),
    "gpt-1.3b": dict(size="1.3B", hidden=2048, layers=24, heads=32, batch=1024, nodes=1, gpus=4,
                     microbatches=128, tflops=58.21, megatron_tflops=55.89),
    "gpt-2.6b": dict(size="2.6B", hidden=2560, layers=32, heads=32, batch=1024, nodes=1, gpus=8,
                     microbatches=128, tflops=61.61, megatron_tflops=50.44),
    "gpt-2.6b-b32": dict(size="2.6B", hidden=2560, layers=32, heads=32, batch=32, nodes=1, gpus=8,
                         microbatches=4, step=2.425, step_src=SRC_SANITY,
                         note="sanity figure: a hand-set 2 x 2 x 2 plan, measured"),
    "gpt-6.7b": dict(size="6.7B", hidden=4096, layers=32, heads=32, batch=1024, nodes=2, gpus=8,
                     microbatches=64, tflops=60.0, megatron_tflops=56.59),
    "gpt-15b": dict(size="15B", hidden=5120, layers=48, heads=40, batch=1024, nodes=4, gpus=8,
                    microbatches=128, tflops=59.9, megatron_tflops=58.24),
    "gpt-39b": dict(size="39B", hidden=8192, layers=48, heads=64, batch=1024, nodes=8, gpus=8,
                    microbatches=1024, tflops=57.0, megatron_tflops=57.84, plan_s=2393.0),
}
DEFAULT_CASES = tuple(CASES)
SEQ, VOCAB = 1024, 51200
QUICK = dict(layers=2, batch=16)  # --quick: every case at 2 layers and batch 16 (same code path)
# ilp runs on the one-instance cases (up to 8 GPUs) by default, HiGHS stopped after this many
# seconds per integer program (it then returns its best plan and the gap). On several instances
# it also runs the staged search, as auto does (2-3 minutes per case there, several batch
# attempts each), so it runs there only with --ilp-everywhere, to keep the command near 15
# minutes.
ILP_TIME_LIMIT = 60.0


def alpa_gpt_flops(batch: int, layers: int, hidden: int, seq: int = SEQ, vocab: int = VOCAB,
                   remat: bool = True) -> float:
    """FLOPs of one training step as Alpa counts them (``compute_gpt_tflops``, with remat)."""
    factor = 96 if remat else 72
    return (factor * batch * seq * hidden ** 2 * layers * (1 + seq / (6 * hidden))
            + 6 * batch * seq * hidden * vocab)


def case_config(key: str, quick: bool) -> dict:
    c = dict(CASES[key])
    if quick:
        c.update(QUICK)
    return c


# ------------------------------------------------------------------------------------- worker

def _describe(plan) -> str:
    """SPMD: the mesh axes the batch is split over (the targets' layout) and the share of
    parameter elements held split; staged: stages, device groups, microbatches, meshes."""
    if plan.stages is not None:
        groups = {tuple(s.devices) for s in plan.stages}
        meshes = sorted({"x".join(map(str, s.mesh_shape)) for s in plan.stages})
        return (f"staged: {len(plan.stages)} stages on {len(groups)} device groups x "
                f"{plan.microbatches} microbatches ({plan.schedule}; stage meshes "
                f"{', '.join(meshes)})")
    import math

    targets = next((t.spec for t in plan.inputs if t.path.endswith("targets")), ())
    axes = [a for entry in targets for a in ((entry,) if isinstance(entry, str) else entry or ())]
    size = {t.path: math.prod(t.shape) for t in plan.inputs if t.role == "parameter"}
    split = sum(size[t.path] for t in plan.inputs
                if t.role == "parameter" and any(e is not None for e in t.spec))
    return (f"SPMD: batch over {'+'.join(axes) or 'nothing'}, "
            f"{split / max(sum(size.values()), 1):.0%} of parameters split")


def worker(key: str, strategy: str, quick: bool) -> dict:
    sys.path.insert(0, ROOT)
    import jax

    import hulkjax as hj
    from hulkjax import zoo
    from hulkjax.errors import InfeasiblePlanError

    c = case_config(key, quick)
    topo = hj.Topology.preset("aws-p3", nodes=c["nodes"], gpus_per_node=c["gpus"])
    opts = {"time_limit": ILP_TIME_LIMIT} if strategy == "ilp" else {}
    attempts, k, plan = [], 1, None
    while plan is None:
        micro = c["batch"] // k
        m = zoo.get("gpt2", size="1b", n_layers=c["layers"], d_model=c["hidden"],
                    n_heads=c["heads"], vocab_size=VOCAB, n_positions=SEQ, seq_len=SEQ,
                    batch=micro, dtype="bfloat16", remat=True)
        args = m.abstract()
        jax.clear_caches()
        t0 = time.perf_counter()
        graph = hj.trace(m.step, *args)
        trace_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            plan = hj.plan(m.step, *args, topology=topo, strategy=strategy, graph=graph, **opts)
        except InfeasiblePlanError as e:
            attempts.append({"k": k, "batch": micro, "trace_s": trace_s,
                             "plan_s": time.perf_counter() - t0, "fits": False,
                             "why": str(e).split(". ")[0][:200]})
            if micro % 2 or micro // 2 < 1:
                break
            k *= 2
            continue
        attempts.append({"k": k, "batch": micro, "trace_s": trace_s,
                         "plan_s": time.perf_counter() - t0, "fits": True})
    out = {"case": key, "strategy": strategy, "quick": quick, "devices": topo.num_devices,
           "topology": topo.name, "attempts": attempts,
           "trace_s": attempts[0]["trace_s"], "plan_s": sum(a["plan_s"] for a in attempts),
           "trace_total_s": sum(a["trace_s"] for a in attempts), "rss_peak_mb": _rss_mb()}
    if plan is None:
        out.update(fits=False)
        return out
    cost = plan.cost
    out.update(fits=True, params=m.param_count(), nodes=len(graph.nodes), accumulation=k,
               micro_batch=c["batch"] // k, step_time=k * cost.step_time,
               micro_step_time=cost.step_time, compute_time=k * cost.compute_time,
               comm_time=k * cost.comm_time, peak_memory=cost.peak_memory,
               capacity=cost.memory_capacity,
               graph_flops=k * cost.ideal_time * topo.num_devices
               * topo.slowest_device().peak_flops,
               staged=plan.stages is not None, microbatches=plan.microbatches,
               kind=_describe(plan), source=getattr(plan, "source", None),
               notes=list(plan.notes)[:3], digest=_digest(plan))
    return out


# ------------------------------------------------------------------------------------- driver

def _run_worker(key: str, strategy: str, quick: bool, timeout: float) -> dict:
    return run_in_fresh_process(__file__, ["--worker", key, strategy] + ["--quick"] * quick,
                                {"case": key, "strategy": strategy, "quick": quick}, timeout)


def published(key: str, quick: bool) -> dict:
    """Alpa's published numbers for a case, and the step time derived from its TFLOP/s."""
    c = case_config(key, quick)
    flops = alpa_gpt_flops(c["batch"], c["layers"], c["hidden"])
    n = c["nodes"] * c["gpus"]
    out = {"flops": flops, "gpus": n}
    if "tflops" in c:
        out.update(tflops=c["tflops"], step=flops / (c["tflops"] * 1e12 * n), step_src=SRC_E2E,
                   step_derived=True, megatron_tflops=c["megatron_tflops"])
    if "step" in c:
        out.update(step=c["step"], step_src=c["step_src"], step_derived=False,
                   tflops=flops / c["step"] / n / 1e12)
    if "plan_s" in c:
        out.update(plan_s=c["plan_s"], plan_src=SRC_PLAN)
    return out


def _row(rows, key, strategy):
    return next((r for r in rows if r["case"] == key and r["strategy"] == strategy), None)


def _fmt_s(x: float) -> str:
    return f"{x:.3g}" if x < 100 else f"{x:,.0f}"


def headline(doc: dict) -> list[str]:
    """The numbers the README quotes: the 39B case against Alpa, and the predicted / published
    step ratios of ``auto`` (geometric mean and range over the cases with a published step)."""
    ratios = {}
    for key in doc["cases"]:
        r, pub = _row(doc["rows"], key, "auto"), published(key, False)
        if r and r.get("status") == "ok" and r.get("fits") and "step" in pub:
            ratios[key] = r["step_time"] / pub["step"]
    out = []
    big = _row(doc["rows"], "gpt-39b", "auto")
    if big and big.get("status") == "ok":
        out.append(f"**Headline.** GPT-39B on 64 GPUs: hulkjax traces in {big['trace_s']:.1f} s "
                   f"and plans in {big['plan_s']:.0f} s (all batch attempts) at "
                   f"{big['rss_peak_mb'] / 1024:.1f} GB peak RSS on {doc['machine']['cpus']} CPU "
                   f"cores, against Alpa's 2,393 s on its cluster ("
                   f"{2393 / big['plan_s']:.0f}x less, different work: see below)"
                   + (f"; predicted step {big['step_time']:.0f} s against Alpa's "
                      f"{published('gpt-39b', False)['step']:.0f} s." if big.get("fits") else "."))
    elif big:
        out.append(f"**Headline.** GPT-39B on 64 GPUs: {big.get('status')} (see the table).")
    if ratios:
        import math

        geo = math.exp(sum(math.log(v) for v in ratios.values()) / len(ratios))
        lo, hi = min(ratios, key=ratios.get), max(ratios, key=ratios.get)
        out.append(f"Predicted / Alpa's step time (auto): geometric mean {geo:.2f} over "
                   f"{len(ratios)} cases, from {ratios[lo]:.2f} ({lo}) to {ratios[hi]:.2f} "
                   f"({hi}); below 1 hulkjax predicts faster than Alpa measured.")
    return [" ".join(out)] if out else []


def report(doc: dict) -> str:
    quick = doc.get("quick", False)
    mach = doc["machine"]
    lines = [
        "# Alpa's suite as a yardstick", "",
        "Generated by `python benchmarks/alpa.py`" + (" --quick" if quick else "")
        + f" (issue 14, item 6) on {mach['cpus']} CPU core(s), commit `{mach['git_commit']}`"
        f"{' (dirty)' if mach['hulkjax_dirty'] else ''}, {mach['date']}. Alpa's GPT "
        "configurations (sequence 1024, vocab 51,200, global batch as in its suite) on its "
        "cluster, the `aws-p3` preset (p3.16xlarge: 8 x V100 16 GB, NVLink2 inside an instance, "
        "25 Gb/s between instances, i.e. 25/8 Gb/s per GPU). hulkjax: the zoo's `gpt2` at those "
        "sizes, bfloat16 for Alpa's fp16, remat on every block, AdamW, abstract arguments. Each "
        "case runs in a fresh process."
        + (f" The machine's 1-minute load average was {min(doc['load']):.1f}-"
           f"{max(doc['load']):.1f} during the run (on {mach['cpus']} cores: other work slows the "
           "wall times)." if doc.get("load") else ""), "",
        "**Published** (Alpa, measured on GPUs): step time, TFLOP/s per GPU, planning time; "
        "sources below the table. **Predicted** (hulkjax's cost model, nothing run): step time and "
        "TFLOP/s per GPU. **Measured here** (this machine, CPU): trace and planning wall time, "
        "peak RSS of the planning process. TFLOP/s on both sides count FLOPs as Alpa does "
        "(`compute_gpt_tflops` with remat), so their ratio is the ratio of step times.", "",
    ]
    if quick:
        lines += ["**--quick run: every model cut to 2 layers and batch 16 (a smoke test); "
                  "Alpa's published numbers do not apply and are left out.**", ""]
    if not quick:
        lines += headline(doc) + [""]
    strategies = [s for s in ("auto", "ilp") if any(r["strategy"] == s for r in doc["rows"])]
    head = ("| case | params | layers / hidden / heads | batch | GPUs | Alpa step (s) | "
            "Alpa TFLOP/s/GPU | Alpa planning (s) | strategy | trace (s) | planning (s) | "
            "peak RSS (MB) | predicted step (s) | predicted / Alpa | predicted TFLOP/s/GPU | "
            "plan | peak memory / GPU (GB) |")
    lines += [head, "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for key in doc["cases"]:
        c = case_config(key, quick)
        pub = published(key, quick)
        base = (f"| {key} | {c['size']} | {c['layers']} / {c['hidden']} / {c['heads']} | "
                f"{c['batch']} | {pub['gpus']} | "
                + (f"{pub['step']:.3g}{'*' if pub['step_derived'] else ''} | "
                   if "step" in pub and not quick else "- | ")
                + (f"{pub['tflops']:.1f} | " if "tflops" in pub and not quick else "- | ")
                + (f"{pub['plan_s']:,.0f} | " if "plan_s" in pub and not quick else "- | "))
        for strategy in strategies:
            r = _row(doc["rows"], key, strategy)
            if r is None:
                continue
            if r.get("status") != "ok":
                what = (f"timeout ({r['timeout_s']:.0f} s)" if r.get("status") == "timeout"
                        else "error (see JSON)")
                lines.append(base + f"{strategy} | | {what} | | | | | | |")
                continue
            if not r.get("fits"):
                last = r["attempts"][-1]
                lines.append(base + f"{strategy} | {r['trace_s']:.2f} | {_fmt_s(r['plan_s'])} | "
                             f"{r['rss_peak_mb']:.0f} | no plan fits (down to batch "
                             f"{last['batch']}) | | | | |")
                continue
            ratio = (f"{r['step_time'] / pub['step']:.2f}" if "step" in pub and not quick
                     else "-")
            tf = pub["flops"] / r["step_time"] / pub["gpus"] / 1e12
            plan = r["kind"] + (f"; at batch {r['micro_batch']}, x{r['accumulation']}"
                                if r["accumulation"] > 1 else "")
            lines.append(base + f"{strategy} | {r['trace_s']:.2f} | {_fmt_s(r['plan_s'])} | "
                         f"{r['rss_peak_mb']:.0f} | {_fmt_s(r['step_time'])} | {ratio} | "
                         f"{tf:.1f} | {plan} | {r['peak_memory'] / 1e9:.1f} |")
    lines += [
        "", "\\* derived: Alpa's FLOP count divided by its published TFLOP/s per GPU and the GPU "
        "count.", "",
        "Sources: configurations and microbatch counts: " + SRC_SPECS + "; TFLOP/s per GPU "
        "(Alpa = `parax.auto`; Megatron-LM's for reference in the JSON): " + SRC_E2E + "; the "
        "GPT-2.6B batch-32 step: " + SRC_SANITY + " (a hand-set data 2 x operator 2 x pipeline "
        "2 plan with 4 microbatches, measured: Alpa's sanity figure); planning time: " + SRC_PLAN
        + ".", "",
        "How to read it:", "",
        "- `planning (s)` is hulkjax's `hj.plan` wall time on this machine's CPU, summed over "
        "the attempts below, tracing excluded (`trace (s)`: the first attempt's). Alpa's 2,393 s "
        "includes profiling on the GPU cluster and XLA compilation of candidate stages; ours is "
        "planning against an analytical cost model, so the two are not the same work.",
        "- `at batch b, xk`: hulkjax's SPMD plans have no gradient accumulation, and the global "
        "batch did not fit the V100's 16 GB as one step, so the step was planned at batch "
        "`b = batch / k` (k = 2, 4, ... until a plan fits) and the prediction is `k x` that "
        "step: an upper bound under the cost model, since the gradient reduction and optimizer "
        "update are counted every microbatch. Staged plans microbatch the batch they are given "
        "(`stages x microbatches`), but with at most 64 microbatches (8 per device group, "
        "`microbatch_counts` in `hulkjax/strategies/stages.py`), so at batch 1024 a microbatch "
        "holds at least 16 sequences, and none of the multi-instance cases fit that way; "
        "Alpa's plans used 64-1,024 microbatches (1 to 16 sequences each).",
        "- `plan`: for SPMD plans, the mesh axes the batch is split over (the targets' layout; "
        "`gpu` inside an instance, `node` across instances) and the share of parameter elements "
        "held split (tensor parallelism or FSDP); hulkjax uses the "
        "topology's mesh as given (one `gpu` axis on one instance), where Alpa also searches "
        "logical mesh shapes (e.g. 2 x 4 inside an instance).",
        "- `peak memory / GPU`: the predicted peak of the planned step (per microbatch step "
        "where accumulated, without the gradient accumulator).",
    ]
    fails = [r for r in doc["rows"] if r.get("status") == "ok"
             and any(not a["fits"] for a in r["attempts"])]
    if fails:
        lines += ["", "Attempts that did not fit (why, from `InfeasiblePlanError`):", ""]
        for r in fails:
            for a in r["attempts"]:
                if not a["fits"]:
                    lines.append(f"- {r['case']} `{r['strategy']}` at batch {a['batch']}: "
                                 f"{a['plan_s']:.1f} s, {a['why']}")
    skipped = doc.get("skipped") or []
    if skipped:
        lines += ["", "Not run: " + "; ".join(skipped) + "."]
    lines += ["", "Not planned: Alpa's Wide-ResNet (its bottleneck widens only the 3x3 "
              "convolution, which the zoo's ResNet cannot express; BatchNorm cannot be "
              "microbatched exactly) and MoE (it alternates dense and MoE layers, with a 32k "
              "vocabulary and 2,048-token expert groups; the zoo's `moe` has an MoE MLP in every "
              "layer, no embedding and one group per sequence)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=2, metavar=("CASE", "STRATEGY"), help=argparse.SUPPRESS)
    ap.add_argument("--cases", nargs="*", default=list(DEFAULT_CASES), choices=list(CASES))
    ap.add_argument("--quick", action="store_true",
                    help="every case at 2 layers and batch 16 (a smoke test of the code path)")
    ap.add_argument("--no-ilp", action="store_true", help="skip ilp everywhere")
    ap.add_argument("--ilp-everywhere", action="store_true",
                    help="run ilp on the multi-instance cases too (slow)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per process")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--out", default=OUT_JSON)
    ap.add_argument("--md", default=OUT_MD)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], args.quick)))
        return
    if args.report_only:
        with open(args.out) as f:
            doc = json.load(f)
    else:
        from tqdm import tqdm

        jobs, skipped = [], []
        for key in args.cases:
            jobs.append((key, "auto"))
            if args.no_ilp:
                continue
            if CASES[key]["nodes"] == 1 or args.ilp_everywhere:
                jobs.append((key, "ilp"))
            else:
                skipped.append(f"ilp on {key} (several instances; --ilp-everywhere runs it)")
        if args.no_ilp:
            skipped.append("ilp (--no-ilp)")
        rows, load = [], [os.getloadavg()[0]]
        bar = tqdm(jobs, desc="alpa suite", unit="run")
        for key, strategy in bar:
            bar.set_postfix_str(f"{key} {strategy}")
            rows.append(_run_worker(key, strategy, args.quick, args.timeout))
            load.append(os.getloadavg()[0])
        doc = {"machine": machine_info(), "quick": args.quick, "cases": list(args.cases),
               "published": {k: published(k, args.quick) for k in args.cases},
               "rows": rows, "skipped": skipped, "load": load}
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    md = report(doc)
    with open(args.md, "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
