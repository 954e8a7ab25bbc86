"""Staged plans against SPMD: wide-area, regional and heterogeneous clusters (hulkjax issue 12).

Every number is the **cost model's prediction** of one training step (nothing is compiled or
run). For each experiment (a model on a cluster) the step is traced once on abstract arguments and
planned with ``dp``, ``fsdp``, ``dp_tp``, the SPMD optimum (``ilp`` with ``stages=False``), the
uniform ``pipeline`` baseline, and hulkjax's planners with staged plans enabled (``ilp``: the
two-level optimum; ``auto``, the default). The planning time of the staged planner on a freshly
traced step (cold caches) is measured separately for the 2.7B GPT on 32 devices.

Results go to ``benchmarks/results/stages.json``, a markdown section (``benchmarks/STAGES.md``,
also spliced into ``benchmarks/RESULTS.md`` between markers) and ``benchmarks/results/stages.png``.

Usage::

    python benchmarks/stages.py                  # every experiment (~20 minutes on 2 cores)
    python benchmarks/stages.py --quick          # small models, same clusters: a smoke test
    python benchmarks/stages.py --only regional-2.7b
    python benchmarks/stages.py --report-only    # markdown and plot from the JSON
    python benchmarks/stages.py --merge --only sites3-hf-llama   # rerun some, keep the rest
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback

import jax
from tqdm import tqdm

import hulkjax as hj
from hulkjax import zoo

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(HERE, "results")
JSON_PATH = os.path.join(RESULTS_DIR, "stages.json")
MD_PATH = os.path.join(HERE, "STAGES.md")
PLOT_PATH = os.path.join(RESULTS_DIR, "stages.png")
RESULTS_MD = os.path.join(HERE, "RESULTS.md")
BEGIN, END = "<!-- stages:begin -->", "<!-- stages:end -->"

GBIT = 1e9 / 8
# Realistic training settings: bfloat16 compute, rematerialized transformer blocks (GPT), AdamW.
MODELS = {
    "gpt-1.3b": ("gpt2", dict(size="1b", batch=64, dtype="bfloat16", remat=True)),
    "gpt-2.7b": ("gpt2", dict(size="1b", n_layers=32, d_model=2560, n_heads=32, batch=128,
                              dtype="bfloat16", remat=True)),
    "gpt-1.5b": ("gpt2", dict(size="1b", n_layers=48, d_model=1600, n_heads=25, batch=128,
                              dtype="bfloat16", remat=True)),
    "bert-large": ("bert", dict(size="base", n_layers=24, d_model=1024, n_heads=16, d_ff=4096,
                                seq_len=512, batch=128, dtype="bfloat16")),
}
# Third-party model code (tests/realmodels/families.py: the Flax models of transformers 4.x,
# random-initialized, abstract here: nothing is downloaded or allocated), as the library writes
# them: float32, no rematerialization. "family:NAME" names the family; the dict is its dimensions
# (a size of families._DIMS): a 1.3B-class shape, 24 layers of width 2048.
THIRD_PARTY_DIMS = dict(layers=24, width=2048, heads=16, ff=8192, vocab=32768, seq=1024,
                        batch=64, image=224, patch=16)
MODELS.update({
    "hf-gpt2-1.3b": ("family:gpt2", THIRD_PARTY_DIMS),
    "hf-llama-1.3b": ("family:llama", THIRD_PARTY_DIMS),
    "hf-t5": ("family:t5", THIRD_PARTY_DIMS),
    "hf-bert-mlm": ("family:bert", THIRD_PARTY_DIMS),
    # The same BERT with the masked-token count computed outside the step and passed in the
    # batch (what the planner's note on hf-bert-mlm says to do): the step then microbatches.
    "hf-bert-mlm-count": ("family:bert+count", THIRD_PARTY_DIMS),
})
QUICK_DIMS = dict(layers=4, width=256, heads=8, ff=1024, vocab=8192, seq=128, batch=32, image=64,
                  patch=8)
QUICK_MODELS = {k: (name, QUICK_DIMS) if name.startswith("family:") else
                ("gpt2", dict(size="small", batch=32, dtype="bfloat16", remat=True))
                for k, (name, _) in MODELS.items()}
TOPOLOGIES = {
    "dtfm-us": ("dtfm", dict(case="us-regions")),
    "dtfm-cities": ("dtfm", dict(case="cities")),
    "regional-25g": ("regional", dict(regions=4)),
    "regional-10g": ("regional", dict(regions=4, metro=hj.LinkSpec(bandwidth=10 * GBIT,
                                                                   latency=2e-3))),
    "mixed": ("mixed", dict(a100=1, v100=2, t4=1)),
    "dgx": ("dgx-h100", dict(nodes=1)),
    # Held out (no zoo model was tuned on it): 3 sites of 2 nodes x 4 H100, 10 Gbit/s, 3 ms.
    "sites3-h100-10g": ("regional", dict(regions=3, nodes_per_region=2, gpus_per_node=4,
                                         device="H100",
                                         metro=hj.LinkSpec(bandwidth=10 * GBIT, latency=3e-3))),
}
EXPERIMENTS = {
    # key: (model, topology, family, what it shows)
    "wan-us-1.3b": ("gpt-1.3b", "dtfm-us", "wide-area",
                    "DT-FM case 3: 4 US regions x 16 V100 instances (2 Gbit/s inside a region, "
                    "1.02-1.25 Gbit/s between)"),
    "wan-cities-1.3b": ("gpt-1.3b", "dtfm-cities", "wide-area",
                        "DT-FM case 4: 8 cities x 8 V100 instances (0.34-1.16 Gbit/s)"),
    "regional-2.7b": ("gpt-2.7b", "regional-25g", "regional",
                      "4 sites x 8 A100 over 25 Gbit/s metro links"),
    "regional-10g-2.7b": ("gpt-2.7b", "regional-10g", "regional",
                          "4 sites x 8 A100 over 10 Gbit/s regional links"),
    "mixed-bert-large": ("bert-large", "mixed", "heterogeneous",
                         "1 A100 + 2 V100 + 1 T4 nodes (8 GPUs each) over 10 Gbit/s"),
    "mixed-1.5b": ("gpt-1.5b", "mixed", "heterogeneous",
                   "1 A100 + 2 V100 + 1 T4 nodes (8 GPUs each) over 10 Gbit/s"),
    "dgx-2.7b": ("gpt-2.7b", "dgx", "one node", "one DGX H100 node"),
    # Third-party model code (transformers' Flax modules) on the regional cluster and on a held-out
    # one: the planner was built on the zoo's models.
    "regional-hf-gpt2": ("hf-gpt2-1.3b", "regional-25g", "regional",
                         "transformers FlaxGPT2LMHeadModule, 4 sites x 8 A100, 25 Gbit/s"),
    "regional-hf-llama": ("hf-llama-1.3b", "regional-25g", "regional",
                          "transformers FlaxLlamaForCausalLMModule, 4 sites x 8 A100, 25 Gbit/s"),
    "regional-hf-t5": ("hf-t5", "regional-25g", "regional",
                       "transformers FlaxT5ForConditionalGenerationModule, 4 sites x 8 A100, "
                       "25 Gbit/s"),
    "regional-hf-bert-mlm": ("hf-bert-mlm", "regional-25g", "regional",
                             "transformers FlaxBertForMaskedLMModule (loss over the masked "
                             "tokens), 4 sites x 8 A100, 25 Gbit/s"),
    "regional-hf-bert-mlm-count": ("hf-bert-mlm-count", "regional-25g", "regional",
                                   "the same BERT, the masked-token count passed in the batch, "
                                   "4 sites x 8 A100, 25 Gbit/s"),
    "sites3-hf-llama": ("hf-llama-1.3b", "sites3-h100-10g", "held-out",
                        "transformers FlaxLlamaForCausalLMModule, held-out cluster: 3 sites x "
                        "2 nodes x 4 H100, 10 Gbit/s"),
}
STRATEGIES = [("dp", {}), ("fsdp", {}), ("dp_tp", {}), ("ilp-spmd", {"stages": False}),
              ("pipeline", {}), ("ilp", {}), ("auto", {})]
TARGETS = {  # family: (vs best SPMD, vs pipeline, vs dp)
    "regional": (1.5, 1.2, None),
    "held-out": (1.0, 1.0, None),  # no issue target: never worse than SPMD or pipeline
    "wide-area": (1.0, None, None),
    "heterogeneous": (None, 1.15, 1.5),
}


def run(keys, quick: bool) -> dict:
    out = {"meta": _meta(quick), "experiments": {}}
    models = QUICK_MODELS if quick else MODELS
    traced: dict[str, tuple] = {}
    for key in tqdm(keys, desc="experiments"):
        model_key, topo_key, family, what = EXPERIMENTS[key]
        name, cfg = models[model_key]
        preset, kw = TOPOLOGIES[topo_key]
        topo = hj.Topology.preset(preset, **kw)
        if model_key not in traced:
            m = ThirdParty(name[len("family:"):], cfg) if name.startswith("family:") \
                else zoo.get(name, **cfg)
            state, batch = m.abstract()
            t0 = time.perf_counter()
            g = hj.trace(m.step, state, batch)
            traced[model_key] = (m, state, batch, g, time.perf_counter() - t0)
        m, state, batch, g, trace_time = traced[model_key]
        rec = {"model": model_key, "zoo": [name, cfg], "params": m.param_count(),
               "nodes": len(g.nodes), "trace_time": trace_time, "topology": topo.name,
               "preset": [preset, {k: repr(v) for k, v in kw.items()}],
               "devices": topo.num_devices, "family": family, "what": what, "plans": {}}
        for label, opts in STRATEGIES:
            strategy = "ilp" if label == "ilp-spmd" else label
            t0 = time.perf_counter()
            try:
                p = hj.plan(m.step, state, batch, topology=topo, strategy=strategy, graph=g,
                            **opts)
                rec["plans"][label] = _record(p, time.perf_counter() - t0)
            except hj.errors.StrategyNotApplicableError as e:
                rec["plans"][label] = {"status": "n/a", "error": str(e)}
            except hj.errors.InfeasiblePlanError as e:
                rec["plans"][label] = {"status": "infeasible", "error": str(e)}
            except Exception as e:  # noqa: BLE001 - a failure is recorded, the run goes on
                rec["plans"][label] = {"status": "error", "error": f"{type(e).__name__}: {e}",
                                       "traceback": traceback.format_exc()[-2000:]}
        if family == "regional" and not name.startswith("family:"):
            rec["ilp_1f1b"] = _best_1f1b(g, topo)
            rec["per_count"] = _per_count(g, topo)
        out["experiments"][key] = rec
    if "regional-2.7b" in keys and not quick:
        out["planning_time"] = _cold_planning_time()
    return out


class ThirdParty:
    """A family of ``tests/realmodels/families.py`` at dimensions ``dims``, abstract: the
    family's parameters, optimizer state and batch as shapes (``jax.eval_shape`` of its
    random initialization), with the zoo models' ``step`` / ``abstract`` / ``param_count``.
    ``family`` may end in ``+count`` (BERT: the masked-token count passed in the batch) or
    ``+bf16`` (computed and stored in bfloat16, where the family has the option)."""

    def __init__(self, family: str, dims: dict):
        sys.path.insert(0, os.path.dirname(HERE))  # the families live in tests/realmodels
        from tests.realmodels import families

        family, _, extra = family.partition("+")
        size = f"bench-{family}"
        families._DIMS[size] = dict(dims)
        made = {}
        dtype = jax.numpy.bfloat16 if extra == "bf16" else None

        def build():
            step, state, batch = families.build(family, size, dtype=dtype)
            made["step"] = step
            return state, batch

        # families._init runs the module's init (jitted); under eval_shape it is traced only.
        self.state, self.batch = jax.eval_shape(build)
        self.step = made["step"]
        if extra == "count":  # the masked-token count, computed outside the step
            self.batch = dict(self.batch, label_count=jax.ShapeDtypeStruct((), "float32"))

    def abstract(self):
        return self.state, self.batch

    def param_count(self) -> int:
        return sum(math.prod(x.shape) for x in jax.tree.leaves(self.state["params"]))


def _cold_planning_time() -> dict:
    """``auto`` (the default planner, staged plans enabled) on a freshly traced 2.7B GPT over
    32 devices: the time ``hj.plan`` takes after tracing, caches cold."""
    name, cfg = MODELS["gpt-2.7b"]
    m = zoo.get(name, **cfg)
    state, batch = m.abstract()
    topo = hj.Topology.preset(*[TOPOLOGIES["regional-25g"][0]], **TOPOLOGIES["regional-25g"][1])
    t0 = time.perf_counter()
    g = hj.trace(m.step, state, batch)
    trace = time.perf_counter() - t0
    p = hj.plan(m.step, state, batch, topology=topo, strategy="auto", graph=g)
    return {"model": "gpt-2.7b", "topology": topo.name, "devices": topo.num_devices,
            "trace_time": trace, "planning_time": p.planning_time,
            "step_time": p.cost.step_time, "staged": p.stages is not None}


def _best_1f1b(g, topo) -> dict:
    """The staged search without the interleaved schedule (``virtual_stages=(1,)``, as before it
    existed): its best plain-1F1B layout's predicted step, to show what interleaving buys."""
    from hulkjax.strategies.ilp import solve
    from hulkjax.strategies.stages import search

    t0 = time.perf_counter()
    res = search(g, topo, solver=solve, virtual_stages=(1,))
    if not res.layouts:
        return {"status": "none"}
    t, layout = res.layouts[0]
    return {"status": "ok", "step_time": t, "microbatches": layout.microbatches,
            "stages": len(layout.ranges), "wall_time": time.perf_counter() - t0}


def _per_count(g, topo, counts=(4, 8, 16, 32), chunks=(1, 2, 4)) -> list[dict]:
    """The staged search's best layout per microbatch count and chunks per group (exactly
    costed): why the chosen count is the best one."""
    from hulkjax.strategies.ilp import solve
    from hulkjax.strategies.stages import search

    out = []
    for M in counts:
        for v in chunks:
            res = search(g, topo, solver=solve, microbatches=[M], virtual_stages=(v,))
            best = res.layouts
            if not best:
                out.append({"microbatches": M, "virtual_stages": v, "status": "none"})
                continue
            c = res.costs[best[0][1]]
            out.append({"microbatches": M, "virtual_stages": v, "status": "ok",
                        "step_time": c.step_time, "compute": c.compute_time,
                        "comm": c.comm_time, "bubble": c.bubble})
    return out


def _pipeline_parts(p) -> dict:
    """The staged step split by cause (1F1B / interleaved; seconds): the busiest group's compute
    and in-stage collectives, and the bubble as the fill and drain of the chunks' work
    (``(sum_d W_d - max_d W_d) / v``), the transfers of the fill and drain (every stage
    boundary once each way), the per-step transfers the fill and drain do not hide, and the rest
    (updates, the reductions of gradients accumulated unreduced that the drain does not hide,
    steady-state links, and 1F1B's waits for each microbatch's round trip); ``reductions``: the
    busiest group's reductions once per step (in its collectives) and ``reductions_exposed``
    their part in the rest."""
    c, M, v = p.cost, p.microbatches, p.virtual_stages
    G = len(p.stages) // v
    w, busy, red = [0.0] * G, [0.0] * G, [0.0] * G
    for k, st in enumerate(c.stages):
        w[k % G] += st.forward + st.backward
        busy[k % G] += st.compute + st.comm
        red[k % G] += st.reduction
    kb = max(range(G), key=lambda d: busy[d])
    exposed = next(st.reduction_exposed for k, st in enumerate(c.stages) if k % G == kb)
    step_tr = mb_tr = 0.0
    for t in c.transfers:
        once = (t.latency + t.step_bytes / t.bandwidth) if t.step_bytes else 0.0
        step_tr += t.exposed  # what the fill and drain do not hide
        mb_tr += (t.time - once) / M
    fill = (sum(w) - max(w)) / v if p.schedule != "gpipe" else None
    parts = {"compute": c.compute_time, "comm": c.comm_time, "bubble": c.bubble,
             "fill_compute": fill, "fill_transfers": mb_tr, "step_transfers": step_tr,
             "reductions": red[kb], "reductions_exposed": exposed}
    if fill is not None:
        rest = c.bubble - fill - mb_tr - step_tr
        parts["rest"] = rest if abs(rest) > 1e-9 * c.step_time else 0.0
    return parts


def _reductions(q: dict) -> str:
    if q.get("reductions") is None:  # a record from before the reductions were split out
        return "-"
    return f"{_ms(q['reductions'])} ({_ms(q['reductions_exposed'])})"


def _record(p, wall: float) -> dict:
    c = p.cost
    rec = {"status": "ok", "strategy": p.strategy, "step_time": c.step_time,
           "compute_time": c.compute_time, "comm_time": c.comm_time, "bubble": c.bubble,
           "peak_memory": c.peak_memory, "memory_capacity": c.memory_capacity,
           "fits": bool(c.fits if not c.stages else all(s.fits for s in c.stages)),
           "efficiency": c.efficiency, "planning_time": p.planning_time, "wall_time": wall,
           "staged": p.stages is not None, "notes": list(p.notes[:3])}
    if p.stages is not None:
        rec["microbatches"] = p.microbatches
        rec["schedule"] = p.schedule
        rec["virtual_stages"] = p.virtual_stages
        rec["parts"] = _pipeline_parts(p)
        rec["stages"] = [{"devices": [st.devices[0], st.devices[-1]], "n": len(st.devices),
                          "kind": "", "layers": [st.layers[0], st.layers[-1]] if st.layers else [],
                          "units": len(st.layers), "strategy": st.strategy,
                          "forward": t.forward, "backward": t.backward, "update": t.update,
                          "memory": t.peak_memory, "capacity": t.memory_capacity}
                         for st, t in zip(p.stages, c.stages)]
        rec["transfers"] = [{"src": t.src, "dst": t.dst, "link": t.link,
                             "bandwidth": t.bandwidth, "microbatch_bytes": t.microbatch_bytes,
                             "step_bytes": t.step_bytes, "time": t.time} for t in c.transfers]
    return rec


def _meta(quick: bool) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                                capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        commit = ""
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "commit": commit, "hulkjax": hj.__version__, "jax": jax.__version__,
            "python": platform.python_version(), "cpus": os.cpu_count(), "quick": quick}


# ---- the report ------------------------------------------------------------------------------

def _shape(p) -> str:
    v = p.get("virtual_stages", 1)
    n = len(p["stages"])
    return f"{n} stages" if v == 1 else f"{n // v} groups x {v} chunks"


def _ms(t):
    return "-" if t is None else f"{t * 1e3:,.4g}"


def _ok(rec):
    return rec.get("status") == "ok" and rec.get("fits")


def report(data: dict) -> str:
    meta = data["meta"]
    lines = [
        "## Staged plans: layers on device groups vs SPMD",
        "",
        f"Generated by `python benchmarks/stages.py` on {meta['date']}: hulkjax {meta['hulkjax']}"
        f" at commit `{meta['commit']}`, jax {meta['jax']}, Python {meta['python']}, "
        f"{meta['cpus']} CPUs{' (QUICK: small models)' if meta.get('quick') else ''}. Raw "
        f"numbers: `benchmarks/results/stages.json`.",
        "",
        "Every number is the cost model's prediction of one training step (ms): SPMD plans from "
        "`hulkjax.cost`, staged plans from `hulkjax.cost.pipeline` (per-stage SPMD costs on each "
        "group's devices, alpha-beta transfers between groups, the 1F1B / interleaved 1F1B / GPipe "
        "schedule with its bubble; `G groups x v chunks`: the interleaved schedule, each device "
        "group running v non-contiguous chunks of layers). The zoo's models in bfloat16 with "
        "AdamW; GPT blocks rematerialized. `hf-*` rows are third-party model code (the Flax "
        "modules of transformers 4.x via `tests/realmodels/families.py`, random-initialized "
        "and abstract, 24 layers of width 2048, batch 64 x 1024 tokens) as the library writes "
        "them: float32, no rematerialization, AdamW; `held-out` is a cluster no model was "
        "tuned on. `ilp-spmd` is the SPMD "
        "optimum; `pipeline` the uniform staged baseline (one stage per region or node, equal "
        "layers, dp_tp inside, 2 x stages microbatches); `ilp` the two-level optimum (SPMD or "
        "staged, whichever is faster); `auto` the default planner. **Bold**: the fastest plan "
        "that fits memory; † does not fit.",
        "",
    ]
    reruns = [f"{key} (commit `{rec['rerun']['commit']}`, {rec['rerun']['date']})"
              for key, rec in data["experiments"].items() if rec.get("rerun")]
    if reruns:
        lines += ["Rerun alone with `python benchmarks/stages.py --merge --only ...` after the "
                  "full run: " + "; ".join(reruns) + ".", ""]
    cols = [label for label, _ in STRATEGIES]
    lines.append("| experiment | model | cluster | " + " | ".join(cols) + " | hulkjax plan |")
    lines.append("|---|---|---|" + "---:|" * len(cols) + "---|")
    for key, rec in data["experiments"].items():
        plans = rec["plans"]
        fit = [p["step_time"] for p in plans.values() if _ok(p)]
        best = min(fit) if fit else None
        cells = []
        for label in cols:
            p = plans.get(label, {})
            if p.get("status") != "ok":
                cells.append(p.get("status", "-"))
                continue
            s = _ms(p["step_time"]) + ("" if p["fits"] else " †")
            cells.append(f"**{s}**" if best is not None and p["fits"]
                         and p["step_time"] <= best * (1 + 1e-9) else s)
        chosen = plans.get("ilp", {})
        if chosen.get("staged"):
            desc = (f"{_shape(chosen)} x {chosen['microbatches']} mb: " + ", ".join(
                f"{s['n']} dev {s['units']} units" for s in chosen["stages"]))
        else:
            desc = "SPMD" if chosen.get("status") == "ok" else chosen.get("status", "-")
        lines.append(f"| {key} | {rec['model']} ({rec['params'] / 1e9:.2f}B) | {rec['what']} | "
                     + " | ".join(cells) + f" | {desc} |")
    lines += ["", "### Against the targets", "",
              "Ratios are predicted step times (baseline / hulkjax's plan, which fits memory); "
              "best SPMD is the fastest SPMD plan that fits; † the baseline itself does not fit "
              "memory (its time is still the cost model's).", "",
              "| experiment | family | best SPMD / hulkjax | pipeline / hulkjax | dp / hulkjax | "
              "targets | met |", "|---|---|---:|---:|---:|---|---|"]
    for key, rec in data["experiments"].items():
        plans = rec["plans"]
        ours = plans.get("ilp", {})
        if not _ok(ours):
            lines.append(f"| {key} | {rec['family']} | - | - | - | - | no plan |")
            continue
        t = ours["step_time"]
        spmd = [plans[k]["step_time"] for k in ("dp", "fsdp", "dp_tp", "ilp-spmd")
                if _ok(plans.get(k, {}))]

        def vs(label, plans=plans, t=t):  # a baseline that does not fit still has a time (†)
            p = plans.get(label, {})
            return None if p.get("status") != "ok" else (p["step_time"] / t, p["fits"])

        ratios = {"spmd": (min(spmd) / t, True) if spmd else None,
                  "pipeline": vs("pipeline"), "dp": vs("dp")}
        want = TARGETS.get(rec["family"], (None, None, None))
        if rec["family"] == "one node":
            target = "auto stays SPMD"
            met = "yes" if not plans.get("auto", {}).get("staged") else "no"
        else:
            parts, ok = [], True
            for name, need in zip(("spmd", "pipeline", "dp"), want):
                if need is None:
                    continue
                parts.append(f"{name} >= {need}x")
                if name == "spmd" and ratios[name] is None and plans.get("ilp-spmd", {}).get(
                        "status") == "infeasible":
                    continue  # no SPMD plan fits (the SPMD optimum says so): nothing to beat
                ok = ok and ratios[name] is not None and ratios[name][0] >= need - 1e-9
            target, met = ", ".join(parts), "yes" if ok else "**no**"

        def fmt(r):
            return "no SPMD plan fits" if r is None else f"{r[0]:.2f}x" + ("" if r[1] else " †")
        lines.append(f"| {key} | {rec['family']} | {fmt(ratios['spmd'])} | "
                     f"{fmt(ratios['pipeline'])} | {fmt(ratios['dp'])} | {target} | {met} |")
    pt = data.get("planning_time")
    if pt:
        lines += ["", f"Planning time (target: under 60 s on 2 cores): `auto` with staged plans "
                      f"on a freshly traced {pt['model']} over {pt['devices']} devices "
                      f"({pt['topology']}) took **{pt['planning_time']:.1f} s** after a "
                      f"{pt['trace_time']:.1f} s trace; its plan is "
                      f"{'staged' if pt['staged'] else 'SPMD'} at {_ms(pt['step_time'])} ms."]
    regional = {k: r for k, r in data["experiments"].items() if r["family"] == "regional"
                and r["plans"].get("ilp", {}).get("parts")}
    if regional:
        lines += ["", "### Where the regional step goes", "",
                  "hulkjax's plan (`ilp`) split by cause (ms): the busiest device group's compute "
                  "and in-stage collectives, then its bubble: the fill and drain of the stages' "
                  "work (`(sum - max of the groups' per-microbatch work) / v`), the transfers of "
                  "the fill and drain (every stage boundary once each way), the per-step "
                  "transfers left exposed (the tied embedding's weights to the last stage, "
                  "hidden under the fill before it, and its gradient back, under the drain), "
                  "and the rest (updates, the gradient reductions the drain does not hide, "
                  "steady-state links, 1F1B's waits for each microbatch's round trip). "
                  "`of it once per step`: the busiest group's reductions of the gradients its "
                  "stages accumulate unreduced over the microbatches (in its collectives), and "
                  "in brackets what of them the drain does not hide (in the rest; the rest is "
                  "negative where they run inside the fill and drain, idle time the bubble "
                  "columns count). `1F1B only`: the staged search's best layout without the "
                  "interleaved schedule.", "",
                  "| experiment | plan | step | compute | in-stage comm | of it once per step | "
                  "fill/drain compute | fill/drain transfers | per-step transfers | rest | "
                  "1F1B only | best SPMD / step |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for key, rec in regional.items():
            p = rec["plans"]["ilp"]
            q = p["parts"]
            spmd = [rec["plans"][k]["step_time"] for k in ("dp", "fsdp", "dp_tp", "ilp-spmd")
                    if _ok(rec["plans"].get(k, {}))]
            flat = rec.get("ilp_1f1b", {})
            ratio = f"{min(spmd) / p['step_time']:.3f}x" if spmd else "-"
            lines.append(
                f"| {key} | {_shape(p)} x {p['microbatches']} mb | {_ms(p['step_time'])} | "
                f"{_ms(q['compute'])} | {_ms(q['comm'])} | {_reductions(q)} | "
                f"{_ms(q['fill_compute'])} | "
                f"{_ms(q['fill_transfers'])} | {_ms(q['step_transfers'])} | {_ms(q.get('rest'))} | "
                f"{_ms(flat.get('step_time')) if flat.get('status') == 'ok' else '-'} | "
                f"{ratio} |")
        counted = {k: r["per_count"] for k, r in regional.items() if r.get("per_count")}
        if counted:
            lines += ["", "Per microbatch count and chunks per device group: the staged search's "
                      "best layout, step = busiest group's compute + in-stage collectives + "
                      "bubble (ms). More microbatches shrink the bubble but every kernel pays "
                      "its launch once more per microbatch (and so does every collective the "
                      "microbatch's programs make; gradients accumulated unreduced are reduced "
                      "once per step); more chunks shrink it too but cross more links.",
                      "", "| experiment | microbatches | 1F1B | 2 chunks | 4 chunks |",
                      "|---|---:|---|---|---|"]
            for key, rows in counted.items():
                for M in sorted({r["microbatches"] for r in rows}):
                    cells = []
                    for v in (1, 2, 4):
                        r = next((r for r in rows if r["microbatches"] == M
                                  and r["virtual_stages"] == v), {})
                        cells.append("-" if r.get("status") != "ok" else
                                     f"{_ms(r['step_time'])} = {_ms(r['compute'])} + "
                                     f"{_ms(r['comm'])} + {_ms(r['bubble'])}")
                    lines.append(f"| {key} | {M} | " + " | ".join(cells) + " |")
    lines += ["", "### The staged plans hulkjax chose", ""]
    for key, rec in data["experiments"].items():
        p = rec["plans"].get("ilp", {})
        if not p.get("staged"):
            continue
        lines.append(f"**{key}** ({rec['what']}): {_shape(p)} x "
                     f"{p['microbatches']} microbatches ({p['schedule']}), bubble "
                     f"{_ms(p['bubble'])} ms, planned in {p['planning_time']:.1f} s")
        lines.append("")
        lines.append("| stage | devices | layers | SPMD inside | fwd / bwd per mb (ms) | "
                     "update (ms) | memory / capacity (GB) |")
        lines.append("|---:|---|---|---|---:|---:|---:|")
        v = p.get("virtual_stages", 1)
        for k, s in enumerate(p["stages"]):
            layers = " .. ".join(dict.fromkeys(s["layers"])) if s["layers"] else "-"
            chunk = f" (chunk {k // (len(p['stages']) // v)})" if v > 1 else ""
            lines.append(f"| {k}{chunk} | {s['devices'][0]}..{s['devices'][1]} ({s['n']}) | {layers} "
                         f"({s['units']} units) | {s['strategy']} | {_ms(s['forward'])} / "
                         f"{_ms(s['backward'])} | {_ms(s['update'])} | "
                         f"{s['memory'] / 1e9:.1f} / {s['capacity'] / 1e9:.0f} |")
        links = [t for t in p["transfers"] if t["microbatch_bytes"] or t["step_bytes"]]
        if links:
            lines.append("")
            lines.append("Transfers: " + "; ".join(
                f"{t['src']}->{t['dst']} ({t['link']}, {t['bandwidth'] * 8 / 1e9:.3g} Gbit/s): "
                f"{t['microbatch_bytes'] / 1e6:.3g} MB/mb + {t['step_bytes'] / 1e6:.3g} MB/step"
                for t in links[:6]))
        lines.append("")
    lines += ["![Predicted step time per strategy and experiment](results/stages.png)", ""]
    return "\n".join(lines)


def plot(data: dict, path: str) -> None:
    from matplotlib.figure import Figure

    exps = list(data["experiments"])
    cols = [label for label, _ in STRATEGIES]
    fig = Figure(figsize=(max(8, 1.6 * len(exps) + 2), 4.6), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(cols)
    colors = ["#9ecae1", "#6baed6", "#3182bd", "#08519c", "#fdae6b", "#e6550d", "#a63603"]
    for j, label in enumerate(cols):
        xs, ys, hatches = [], [], []
        for i, key in enumerate(exps):
            p = data["experiments"][key]["plans"].get(label, {})
            if p.get("status") == "ok":
                xs.append(i + (j - len(cols) / 2 + 0.5) * width)
                ys.append(p["step_time"])
                hatches.append("" if p["fits"] else "//")
        bars = ax.bar(xs, ys, width=width, color=colors[j % len(colors)], label=label)
        for b, h in zip(bars, hatches):
            b.set_hatch(h)
    ax.set_yscale("log")
    ax.set_xticks(range(len(exps)), exps, rotation=15, fontsize=8)
    ax.set_ylabel("predicted step time (s, log)")
    ax.set_title("Staged plans vs SPMD (cost model; hatched: does not fit memory)")
    ax.legend(fontsize=8, ncol=4)
    ax.grid(axis="y", alpha=0.3, which="both")
    fig.savefig(path, dpi=110)


def splice(md: str) -> None:
    """Put the section into RESULTS.md between the markers (appended the first time)."""
    text = open(RESULTS_MD).read() if os.path.exists(RESULTS_MD) else ""
    block = f"{BEGIN}\n{md}\n{END}"
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    with open(RESULTS_MD, "w") as f:
        f.write(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small models (smoke test)")
    ap.add_argument("--only", nargs="*", choices=list(EXPERIMENTS), help="these experiments")
    ap.add_argument("--report-only", action="store_true", help="markdown + plot from the JSON")
    ap.add_argument("--merge", action="store_true",
                    help="with --only: run those experiments and put them into the JSON (the "
                         "others kept; the report names the commit of each rerun)")
    args = ap.parse_args(argv)
    os.makedirs(RESULTS_DIR, exist_ok=True)
    if args.report_only:
        with open(JSON_PATH) as f:
            data = json.load(f)
    elif args.merge:
        if not args.only or args.quick:
            ap.error("--merge needs --only and full-size models")
        with open(JSON_PATH) as f:
            data = json.load(f)
        new = run(args.only, quick=False)
        for rec in new["experiments"].values():
            rec["rerun"] = {k: new["meta"][k] for k in ("date", "commit")}
        merged = {k: new["experiments"].get(k, data["experiments"].get(k)) for k in EXPERIMENTS
                  if k in new["experiments"] or k in data["experiments"]}
        data["experiments"] = merged
        with open(JSON_PATH, "w") as f:
            json.dump(data, f, indent=1)
        args.only = None  # the whole report, as a full run writes it
    else:
        data = run(args.only or list(EXPERIMENTS), args.quick)
        if not args.quick and not args.only:
            with open(JSON_PATH, "w") as f:
                json.dump(data, f, indent=1)
    md = report(data)
    if args.quick or args.only:
        print(md)
        return 0
    with open(MD_PATH, "w") as f:
        f.write(md + "\n")
    plot(data, PLOT_PATH)
    splice(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
