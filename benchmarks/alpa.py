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
``k = 2, 4, ...`` until a plan fits, and at ``2 k`` once more, and predicts the faster of ``k x``
their step times: an upper bound under the cost model (the gradient reduction and the optimizer
update are paid every microbatch instead of once). The extra attempt is there because a plan
that only just fits (stage layouts bent to the memory) can be slower than two steps at half
the batch. Planning time is the sum over all attempts (what finding a plan costs), tracing excluded.

Results go to ``benchmarks/results/alpa.json`` and ``benchmarks/ALPA.md`` (linked from
``PLANNING.md``)::

    python benchmarks/alpa.py                 # every case, auto + ilp (~15 minutes on 2 cores)
    python benchmarks/alpa.py --quick         # 2-layer models, small batches: a smoke test
    python benchmarks/alpa.py --cases gpt-1.3b gpt-2.6b --no-ilp
    python benchmarks/alpa.py --report-only   # ALPA.md from the JSON

Alpa's Wide-ResNet cases (``wresnet-*``; Alpa's ``wide_resnet.py``: ResNet-50's layout with the
bottleneck's 3x3 convolution ``width_factor`` times wider, 224 x 224 images, fp32, batch 1536,
remat) are the zoo's ``resnet`` with ``width`` and ``width_factor`` at the specs of
``benchmark/alpa/suite_paper_wresnet.py`` (osdi22_artifact branch; their parameter counts match
the ones the artifact logs to 0.1%), float32, ``remat`` on every block, AdamW. Alpa's TFLOP/s for
them divides XLA's FLOP count of its executable (``executable.flop_count``, not published) by the
measured time; the step time in our table is derived with the FLOPs of our own trace of the same
step at the global batch (remat included) in its place. Their BatchNorm takes statistics over the
batch, so hulkjax's staged plans run them as one microbatch (microbatching would change what the
step computes); Alpa's pipelines used 24-32 microbatches, each normalized with its own
statistics.

Alpa's MoE cases (``moe-*``; Alpa's ``moe.py``: a BERT-style language model whose every second
layer's MLP is a GShard top-2 mixture of experts, MLPs 8x the width, 2,048-token expert groups,
capacity 2 S / E, a 32k vocabulary, sequence 1024, global batch 1024, remat) are the zoo's ``moe``
with ``moe_every=2``, ``group_size=2048``, ``vocab_size=32000`` and relu experts at the specs of
``benchmark/alpa/suite_paper_auto_moe.py`` (their parameter counts match the artifact's to
0.25%), bfloat16 for Alpa's fp16; TFLOP/s as Alpa counts them (``compute_moe_tflops`` with
``checkpoint_activations=True``, the artifact's ``tflops_ckpt``). The auto rows publish TFLOP/s
without their latencies, so the count cannot be checked against them; at the logged latency of
the older intra-only 380M run it gives 43.3 TFLOP/s where that row logs 45.5 (the GPT count
reproduces its rows exactly): the MoE ratios carry that ~5% uncertainty.

    python benchmarks/alpa.py --cases wresnet-250m moe-380m --merge   # add rows to the JSON
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
# Wide-ResNet: (base channels, width factor) of suite_paper_wresnet.py's wresnet_specs (ResNet-50
# layout, 224 x 224, fp32), global batch 1536; microbatches of the artifact's solutions
# (suite_artifact_e2e_wresnet.py, none listed for 64 GPUs); tflops: results_e2e_ref.tsv's
# "wresnet parax.auto"; alpa_params: its parameter count in billions (the intra_only rows).
WRN_SPECS = dict(model="wresnet", layers=50, image=224, batch=1536)
CASES.update({
    "wresnet-250m": dict(WRN_SPECS, size="250M", width=160, factor=2, nodes=1, gpus=1,
                         microbatches=24, tflops=8.3, alpa_params=0.2541),
    "wresnet-500m": dict(WRN_SPECS, size="500M", width=224, factor=2, nodes=1, gpus=2,
                         microbatches=24, tflops=8.46, alpa_params=0.495),
    "wresnet-1b": dict(WRN_SPECS, size="1B", width=320, factor=2, nodes=1, gpus=4,
                       microbatches=24, tflops=8.16, alpa_params=1.0057),
    "wresnet-2b": dict(WRN_SPECS, size="2B", width=448, factor=2, nodes=1, gpus=8,
                       microbatches=24, tflops=8.04, alpa_params=1.965),
    "wresnet-4b": dict(WRN_SPECS, size="4B", width=640, factor=2, nodes=2, gpus=8,
                       microbatches=32, tflops=6.76, alpa_params=4.0009),
    "wresnet-6.8b": dict(WRN_SPECS, size="6.8B", width=320, factor=16, nodes=4, gpus=8,
                         microbatches=32, tflops=6.60, alpa_params=6.7277),
    "wresnet-13b": dict(WRN_SPECS, size="13B", width=320, factor=32, nodes=8, gpus=8,
                        tflops=5.3, alpa_params=13.2671),
})
# MoE: (hidden, layers, experts) of suite_paper_auto_moe.py's moe_specs (sequence 1024, 16 heads,
# vocab 32000, expert groups of 2048 tokens), global batch 1024; microbatches of the artifact's
# solutions (suite_artifact_e2e_moe.py; 70B: suite_auto_moe.py's perf_test_suite); tflops:
# results_e2e_ref.tsv's "moe parax.auto" (deepspeed_tflops: its DeepSpeed baseline, for reference;
# none for 70B, which DeepSpeed could not run); alpa_params: its (tied-embedding) parameter count.
MOE_SPECS = dict(model="moe", heads=16, batch=1024, group=2048, vocab=32000)
CASES.update({
    "moe-380m": dict(MOE_SPECS, size="380M", hidden=768, layers=8, experts=8, nodes=1, gpus=1,
                     microbatches=512, tflops=45.4621, deepspeed_tflops=34.24, alpa_params=0.3835),
    "moe-690m": dict(MOE_SPECS, size="690M", hidden=768, layers=8, experts=16, nodes=1, gpus=2,
                     microbatches=32, tflops=43.03, deepspeed_tflops=33.11, alpa_params=0.6857),
    "moe-1.3b": dict(MOE_SPECS, size="1.3B", hidden=768, layers=16, experts=16, nodes=1, gpus=4,
                     microbatches=32, tflops=39.92, deepspeed_tflops=34.67, alpa_params=1.3468),
    "moe-2.4b": dict(MOE_SPECS, size="2.4B", hidden=1024, layers=16, experts=16, nodes=1,
                     gpus=8, microbatches=32, tflops=45.76, deepspeed_tflops=40.01, alpa_params=2.383),
    "moe-10b": dict(MOE_SPECS, size="10B", hidden=1536, layers=16, experts=32, nodes=2, gpus=8,
                    microbatches=16, tflops=45.36, deepspeed_tflops=12.91, alpa_params=10.1696),
    "moe-27b": dict(MOE_SPECS, size="27B", hidden=2048, layers=16, experts=48, nodes=4, gpus=8,
                    microbatches=128, tflops=38.84, deepspeed_tflops=3.82, alpa_params=26.6481),
    "moe-70b": dict(MOE_SPECS, size="70B", hidden=2048, layers=32, experts=64, nodes=8, gpus=8,
                    microbatches=64, tflops=36.55, alpa_params=70.4152),
})
DEFAULT_CASES = tuple(CASES)
SEQ, VOCAB = 1024, 51200
QUICK = dict(layers=2, batch=16)  # --quick: every case at 2 layers and batch 16 (same code path)
WRN_QUICK = dict(batch=16, image=32)  # --quick for Wide-ResNet: 32 x 32 images, batch 16
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


def alpa_moe_flops(batch: int, layers: int, hidden: int, experts: int, group: int = 2048,
                   seq: int = SEQ, vocab: int = 32000, mlp_factor: int = 8,
                   remat: bool = True) -> float:
    """FLOPs of one training step as Alpa counts them (``compute_moe_tflops``, osdi22_artifact's
    ``benchmark/util.py``; with remat, the artifact's ``tflops_ckpt``): half the layers dense,
    half with experts, plus the LM head."""
    factor = 4 if remat else 3
    dense = (batch * seq * hidden ** 2 * (8 + 4 * mlp_factor)
             + 4 * batch * seq ** 2 * hidden) * factor
    moe = (batch * seq * hidden ** 2 * 8 + 4 * batch * seq ** 2 * hidden
           + 8 * batch * seq * hidden ** 2 * mlp_factor  # expert MLPs (top-2)
           + 2 * batch * seq * hidden * experts  # router softmax
           + 2 * batch * seq * 2 * group  # top-2 gating
           + 2 * batch * seq * hidden * 2 * group * 2) * factor  # dispatch and combine
    return dense * layers / 2 + moe * layers / 2 + 6 * batch * seq * hidden * vocab


def case_config(key: str, quick: bool) -> dict:
    c = dict(CASES[key])
    if quick:
        c.update(WRN_QUICK if c.get("model") == "wresnet" else QUICK)
    return c


def _model(c: dict, batch: int):
    """The zoo model of case config ``c`` at global batch ``batch``."""
    from hulkjax import zoo

    if c.get("model") == "wresnet":
        return zoo.get("resnet", size="50", width=c["width"], width_factor=c["factor"],
                       image_size=c["image"], batch=batch, dtype="float32", remat=True)
    if c.get("model") == "moe":
        return zoo.get("moe", size="small", d_model=c["hidden"], d_ff=8 * c["hidden"],
                       n_layers=c["layers"], n_heads=c["heads"], n_experts=c["experts"],
                       top_k=2, capacity_factor=1.0, seq_len=SEQ, batch=batch,
                       group_size=min(c["group"], batch * SEQ), moe_every=2,
                       vocab_size=c["vocab"], activation="relu", dtype="bfloat16", remat=True)
    return zoo.get("gpt2", size="1b", n_layers=c["layers"], d_model=c["hidden"],
                   n_heads=c["heads"], vocab_size=VOCAB, n_positions=SEQ, seq_len=SEQ,
                   batch=batch, dtype="bfloat16", remat=True)


def _shape(c: dict) -> str:
    """The table's ``layers / width / heads`` cell."""
    if c.get("model") == "wresnet":
        return f"{c['layers']} / {c['width']} x {c['factor']} / -"
    if c.get("model") == "moe":
        return f"{c['layers']} / {c['hidden']} / {c['heads']}, {c['experts']} experts"
    return f"{c['layers']} / {c['hidden']} / {c['heads']}"


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

    targets = next((t.spec for t in plan.inputs if t.path.endswith("targets")), None)
    if targets is None:  # Wide-ResNet: its labels, the batch's other leaf
        targets = next((t.spec for t in plan.inputs if t.role == "data"
                        and t.path.endswith("/y")), ())
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
    from hulkjax.errors import InfeasiblePlanError

    c = case_config(key, quick)
    topo = hj.Topology.preset("aws-p3", nodes=c["nodes"], gpus_per_node=c["gpus"])
    opts = {"time_limit": ILP_TIME_LIMIT} if strategy == "ilp" else {}
    attempts, k, full_flops, best, fitted = [], 1, None, None, False
    while True:
        micro = c["batch"] // k
        m = _model(c, micro)
        args = m.abstract()
        jax.clear_caches()
        t0 = time.perf_counter()
        graph = hj.trace(m.step, *args)
        trace_s = time.perf_counter() - t0
        if full_flops is None:  # the step at the global batch (k = 1), remat included
            full_flops = float(sum(n.flops for n in graph.nodes))
        t0 = time.perf_counter()
        try:
            p = hj.plan(m.step, *args, topology=topo, strategy=strategy, graph=graph, **opts)
        except InfeasiblePlanError as e:
            attempts.append({"k": k, "batch": micro, "trace_s": trace_s,
                             "plan_s": time.perf_counter() - t0, "fits": False,
                             "why": str(e).split(". ")[0][:200]})
        else:
            attempts.append({"k": k, "batch": micro, "trace_s": trace_s,
                             "plan_s": time.perf_counter() - t0, "fits": True,
                             "step_time": k * p.cost.step_time})
            if best is None or k * p.cost.step_time < best[0]:
                best = (k * p.cost.step_time, k, p, m, graph)
        # Halved until a plan fits, then once more: a plan that only just fits (its stages'
        # layouts bent to the memory) can be slower than two steps at half the batch.
        if fitted or micro % 2 or micro // 2 < 1:
            break
        fitted = best is not None
        k *= 2
    out = {"case": key, "strategy": strategy, "quick": quick, "devices": topo.num_devices,
           "topology": topo.name, "attempts": attempts,
           "trace_s": attempts[0]["trace_s"], "plan_s": sum(a["plan_s"] for a in attempts),
           "trace_total_s": sum(a["trace_s"] for a in attempts), "rss_peak_mb": _rss_mb(),
           "full_flops": full_flops}
    if best is None:
        out.update(fits=False)
        return out
    _, k, plan, m, graph = best
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


def published(key: str, quick: bool, flops: float | None = None) -> dict:
    """Alpa's published numbers for a case, and the step time derived from its TFLOP/s.

    GPT: FLOPs as Alpa counts them (``compute_gpt_tflops``). Wide-ResNet: Alpa divides XLA's
    FLOP count of its executable, which is not published: ``flops`` is our trace's count of the
    same step (the ``auto`` row's ``full_flops``); without it no step is derived."""
    c = case_config(key, quick)
    n = c["nodes"] * c["gpus"]
    if c.get("model") == "wresnet":
        out = {"flops": flops, "gpus": n, "flops_src": "our trace (XLA's count not published)"}
        if flops and "tflops" in c:
            out.update(tflops=c["tflops"], step=flops / (c["tflops"] * 1e12 * n),
                       step_src=SRC_E2E, step_derived=True)
        elif "tflops" in c:
            out.update(tflops=c["tflops"])
        return out
    if c.get("model") == "moe":
        flops = alpa_moe_flops(c["batch"], c["layers"], c["hidden"], c["experts"], c["group"])
    else:
        flops = alpa_gpt_flops(c["batch"], c["layers"], c["hidden"])
    out = {"flops": flops, "gpus": n}
    if "tflops" in c:
        out.update(tflops=c["tflops"], step=flops / (c["tflops"] * 1e12 * n), step_src=SRC_E2E,
                   step_derived=True)
        out.update({k: c[k] for k in ("megatron_tflops", "deepspeed_tflops") if k in c})
    if "step" in c:
        out.update(step=c["step"], step_src=c["step_src"], step_derived=False,
                   tflops=flops / c["step"] / n / 1e12)
    if "plan_s" in c:
        out.update(plan_s=c["plan_s"], plan_src=SRC_PLAN)
    return out


def _row(rows, key, strategy):
    return next((r for r in rows if r["case"] == key and r["strategy"] == strategy), None)


def _pub(doc: dict, key: str, quick: bool) -> dict:
    """:func:`published` with the FLOPs a Wide-ResNet case's step is derived from (its
    ``auto`` row's trace at the global batch)."""
    r = _row(doc["rows"], key, "auto")
    return published(key, quick, flops=(r or {}).get("full_flops"))


def _fmt_s(x: float) -> str:
    return f"{x:.3g}" if x < 100 else f"{x:,.0f}"


def headline(doc: dict) -> list[str]:
    """The numbers the README quotes: the 39B case against Alpa, and the predicted / published
    step ratios of ``auto`` (geometric mean and range over the cases with a published step)."""
    ratios, wrn, moe = {}, {}, {}
    for key in doc["cases"]:
        r, pub = _row(doc["rows"], key, "auto"), _pub(doc, key, False)
        if r and r.get("status") == "ok" and r.get("fits") and "step" in pub:
            fam = {"wresnet": wrn, "moe": moe}.get(CASES[key].get("model"), ratios)
            fam[key] = r["step_time"] / pub["step"]
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
    import math

    for name, rs in (("GPT", ratios), ("MoE", moe), ("Wide-ResNet", wrn)):
        if not rs:
            continue
        geo = math.exp(sum(math.log(v) for v in rs.values()) / len(rs))
        lo, hi = min(rs, key=rs.get), max(rs, key=rs.get)
        out.append(f"Predicted / Alpa's step time ({name}, auto): geometric mean {geo:.2f} over "
                   f"{len(rs)} cases, from {rs[lo]:.2f} ({lo}) to {rs[hi]:.2f} ({hi})"
                   + ("; below 1 hulkjax predicts faster than Alpa measured." if name == "GPT"
                      else "."))
    return [" ".join(out)] if out else []


def _merge_line(doc: dict) -> str:
    """Which cases the last run replanned, where it merged them into earlier runs' rows
    (``--merge``): the header's commit is theirs."""
    earlier = doc.get("merged")
    if not earlier or not doc.get("ran"):
        return ""
    commits = ", ".join(dict.fromkeys(f"`{m['machine']['git_commit']}` "
                                      f"({m['machine']['date'][:10]})" for m in earlier))
    return (f" Merged (`--merge --cases ...`): this run replanned {', '.join(doc['ran'])}; the "
            f"other rows are from the earlier runs at {commits} (`merged` in the JSON).")


def report(doc: dict) -> str:
    quick = doc.get("quick", False)
    mach = doc["machine"]
    lines = [
        "# Alpa's suite as a yardstick", "",
        "Generated by `python benchmarks/alpa.py`" + (" --quick" if quick else "")
        + f" (issue 14, item 6) on {mach['cpus']} CPU core(s), commit `{mach['git_commit']}`"
        f"{' (dirty)' if mach['hulkjax_dirty'] else ''}, {mach['date']}. Alpa's GPT "
        "configurations (sequence 1024, vocab 51,200, global batch as in its suite), its MoE "
        "ones (`moe-*`: every second layer's MLP a top-2 mixture of experts, vocab 32,000, "
        "batch 1024) and its Wide-ResNet ones (`wresnet-*`: 224 x 224 images, fp32, batch "
        "1536) on its "
        "cluster, the `aws-p3` preset (p3.16xlarge: 8 x V100 16 GB, NVLink2 inside an instance, "
        "25 Gb/s between instances, i.e. 25/8 Gb/s per GPU). hulkjax: the zoo's `gpt2` at those "
        "sizes and the zoo's `moe` as Alpa's MoE language model (`moe_every=2`, 2,048-token "
        "expert groups, relu experts), bfloat16 for Alpa's fp16, and the zoo's `resnet` with "
        "Alpa's width and width "
        "factor (the 3x3 convolution widened), float32; remat on every block, AdamW, abstract "
        "arguments. Each case runs in a fresh process."
        + _merge_line(doc)
        + (f" The machine's 1-minute load average was {min(doc['load']):.1f}-"
           f"{max(doc['load']):.1f} during the run (on {mach['cpus']} cores: other work slows the "
           "wall times)." if doc.get("load") else ""), "",
        "**Published** (Alpa, measured on GPUs): step time, TFLOP/s per GPU, planning time; "
        "sources below the table. **Predicted** (hulkjax's cost model, nothing run): step time and "
        "TFLOP/s per GPU. **Measured here** (this machine, CPU): trace and planning wall time, "
        "peak RSS of the planning process. TFLOP/s on both sides count FLOPs as Alpa does "
        "(`compute_gpt_tflops` / `compute_moe_tflops` with remat), so their ratio is the ratio "
        "of step times; for "
        "Wide-ResNet, whose FLOP count Alpa took from XLA's executable (not published), both "
        "sides count our trace's FLOPs of the step at the global batch (remat included).", "",
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
        pub = _pub(doc, key, quick)
        base = (f"| {key} | {c['size']} | {_shape(c)} | "
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
            tf = (pub["flops"] or r["full_flops"]) / r["step_time"] / pub["gpus"] / 1e12
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
        "`b = batch / k` (k = 2, 4, ... until a plan fits, and once more at twice that k, the "
        "faster kept) and the prediction is `k x` that "
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
    if any(CASES[k].get("model") == "wresnet" for k in doc["cases"]):
        lines += ["", "Wide-ResNet: `layers / width / heads` is ResNet depth / base channels x "
                  "width factor. The zoo's models have the parameter counts Alpa's artifact logs "
                  "(`params` is Alpa's size name; ours are within 0.1% of its logged counts, "
                  "tested). Their BatchNorm takes statistics over the batch, so microbatching "
                  "would change what the step computes: hulkjax's staged plans run such a step "
                  "as one microbatch, where Alpa's pipelines used 24-32 microbatches, each "
                  "normalized with its own statistics. Multi-instance cases are therefore SPMD "
                  "or single-microbatch staged plans here."]
    if any(CASES[k].get("model") == "moe" for k in doc["cases"]):
        lines += ["", "MoE: `layers / hidden / heads` with the expert count; the zoo's models "
                  "have Alpa's logged parameter counts (tied embeddings; ours are untied, as the "
                  "runs were) to 0.25%, tested. Alpa's layers are post-norm (BERT's), ours "
                  "pre-norm: the same FLOPs and parameters."]
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
    ap.add_argument("--merge", action="store_true",
                    help="keep the JSON's other cases; replace the rows of the cases run")
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
               "ran": list(args.cases), "rows": rows, "skipped": skipped, "load": load}
        if args.merge and os.path.exists(args.out):
            with open(args.out) as f:
                old = json.load(f)
            ran = set(args.cases)
            doc["cases"] = [k for k in CASES if k in ran or k in old["cases"]]
            doc["rows"] = [r for r in old["rows"] if r["case"] not in ran] + rows
            doc["skipped"] = [s for s in old.get("skipped", [])
                              if not any(f" {k} " in f" {s} " for k in ran)] + skipped
            doc["load"] = old.get("load", []) + load
            doc["merged"] = old.get("merged", []) + [{"machine": old["machine"],
                                                      "cases": old["cases"]}]
        doc["published"] = {k: _pub(doc, k, args.quick) for k in doc["cases"]}
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    md = report(doc)
    with open(args.md, "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
