"""The distributed optimizer as a plannable layout, measured on third-party model code.

For each family of ``tests/realmodels/families.py`` (transformers' Flax GPT-2, BERT, T5, ViT,
LLaMA, Gemma, keras-hub's Mixtral, diffusers' UNet: code hulkjax was not written for, **small**
configurations, random-initialized, abstract) on each topology, this plans:

* ``dp`` and ``zero`` (the same batch split; ``zero`` shards the optimizer state over every
  device and reduce-scatters the gradients onto it);
* ``ilp`` and ``auto`` in the default cost model (optimizer state laid out with its parameter)
  and with ``optimizer_apart=True`` (each state a decision of its own), SPMD only
  (``stages=False``; staged plans are the section below).

and reports each plan's predicted step time and peak memory per device, the ratios apart /
default, how many optimizer states the apart plan lays out differently from their parameter, and
the planning CPU seconds. Topologies: the 2 x 4 fake CPU mesh of ``tests/realmodels/measure.py``
and two DGX-H100 nodes (2 x 8 H100).

The staged section (:data:`STAGED`) plans ``auto`` with staged plans on, state tied and apart
(the staged search's stages then decide each state apart, and the search with state tied runs
too, the faster plan kept), where staged plans win: transformers' 1.3B-class GPT-2, LLaMA and
BERT (``benchmarks/stages.py``'s third-party models, float32) on two AWS p3 nodes (16 V100s of
16 GB: memory bends the stages' plans) and on four sites of eight A100s (memory does not), and
Alpa's GPT-6.7B, 15B and 39B (``benchmarks/alpa.py``: the zoo's GPT at Alpa's sizes, at the
batch ``ALPA.md``'s plans take) on 16, 32 and 64 V100s.

Writes ``benchmarks/results/optimizer_apart.json`` and ``benchmarks/OPTIMIZER_APART.md``::

    python benchmarks/optimizer_apart.py [--families gpt2 llama] [--topologies 2x4]
    python benchmarks/optimizer_apart.py --sections staged   # one section; the other kept
    python benchmarks/optimizer_apart.py --report-only
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import hulkjax as hj  # noqa: E402
from tests.realmodels import families  # noqa: E402
from tests.realmodels.measure import MESHES, source_commit  # noqa: E402

TOPOLOGIES = {"2x4": lambda: MESHES["2x4"],
              "dgx-h100x2": lambda: hj.Topology.preset("dgx-h100", nodes=2)}
PLANS = (("dp", "dp", {}), ("zero", "zero", {}),
         ("ilp", "ilp", {"stages": False, "time_limit": 60.0}),
         ("ilp apart", "ilp", {"stages": False, "time_limit": 60.0, "optimizer_apart": True}),
         ("auto", "auto", {"stages": False}),
         ("auto apart", "auto", {"stages": False, "optimizer_apart": True}))
"""(label, strategy, options) of every plan made per family and topology."""


def states_apart(g, plan) -> int:
    """How many optimizer states ``plan`` lays out differently from their parameter."""
    specs = [t.spec for t in plan.inputs]
    return sum(1 for o, p in g.state_pairs() if specs[o] != specs[p])


def measure(name: str, topo_name: str) -> dict:
    step, state, batch = families.build(name, "small")
    args = jax.eval_shape(lambda s=state, b=batch: (s, b))
    del state, batch
    g = hj.trace(step, *args)
    topo = TOPOLOGIES[topo_name]()
    row = {"family": name, "topology": topo_name, "nodes": len(g.nodes),
           "states": len(g.state_pairs()),
           "plans": {}}
    for label, strategy, options in PLANS:
        c0 = time.process_time()
        try:
            plan = hj.plan(step, *args, topology=topo, strategy=strategy, graph=g, **options)
        except hj.HulkjaxError as e:
            row["plans"][label] = {"error": f"{type(e).__name__}: {e}"}
            continue
        row["plans"][label] = {
            "step_ms": plan.cost.step_time * 1e3, "memory_mb": plan.cost.peak_memory / 1e6,
            "fits": bool(plan.cost.fits), "apart": states_apart(g, plan),
            "cpu_s": time.process_time() - c0}
    return row


# label -> (model, model dimensions or config, topology preset, preset arguments, what it is)
STAGED: dict[str, tuple] = {
    "hf-gpt2-1.3b @ 2 p3 nodes": ("hf-gpt2-1.3b", None, "aws-p3", {"nodes": 2},
                                  "transformers' GPT-2, 16 V100 16 GB"),
    "hf-llama-1.3b @ 2 p3 nodes": ("hf-llama-1.3b", None, "aws-p3", {"nodes": 2},
                                   "transformers' LLaMA, 16 V100 16 GB"),
    "hf-bert-mlm-count @ 2 p3 nodes": ("hf-bert-mlm-count", None, "aws-p3", {"nodes": 2},
                                       "transformers' BERT (masked LM), 16 V100 16 GB"),
    "hf-gpt2-1.3b @ 4 sites": ("hf-gpt2-1.3b", None, "regional", {"regions": 4},
                               "transformers' GPT-2, 4 sites x 8 A100 80 GB, 25 Gbit/s"),
    "hf-llama-1.3b @ 4 sites": ("hf-llama-1.3b", None, "regional", {"regions": 4},
                                "transformers' LLaMA, 4 sites x 8 A100 80 GB, 25 Gbit/s"),
    "alpa gpt-6.7b": ("alpa:gpt-6.7b", 128, "aws-p3", {"nodes": 2},
                      "Alpa's GPT-6.7B (zoo), batch 128, 16 V100 16 GB"),
    "alpa gpt-15b": ("alpa:gpt-15b", 128, "aws-p3", {"nodes": 4},
                     "Alpa's GPT-15B (zoo), batch 128, 32 V100 16 GB"),
    "alpa gpt-39b": ("alpa:gpt-39b", 256, "aws-p3", {"nodes": 8},
                     "Alpa's GPT-39B (zoo), batch 256, 64 V100 16 GB"),
}


def measure_staged(label: str) -> dict:
    """``auto`` with staged plans on, state tied and apart, on one :data:`STAGED` case."""
    sys.path.insert(0, HERE)
    model, cfg, preset, preset_kw, what = STAGED[label]
    if model.startswith("alpa:"):
        import alpa

        m = alpa._model(alpa.case_config(model[len("alpa:"):], False), cfg)
    else:
        import stages

        name, dims = stages.MODELS[model]
        m = stages.ThirdParty(name[len("family:"):], dims)
    topo = hj.Topology.preset(preset, **preset_kw)
    args = m.abstract()
    row = {"case": label, "what": what, "topology": topo.name, "devices": topo.num_devices,
           "plans": {}}
    for key, apart in (("auto", False), ("auto apart", True)):
        g = hj.trace(m.step, *args)  # a fresh graph: the other plan's caches are not this one's
        row["states"] = len(g.state_pairs())
        c0 = time.process_time()
        try:
            plan = hj.plan(m.step, *args, topology=topo, strategy="auto", graph=g,
                           optimizer_apart=apart)
        except hj.HulkjaxError as e:
            row["plans"][key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        row["plans"][key] = {
            "step_ms": plan.cost.step_time * 1e3, "memory_mb": plan.cost.peak_memory / 1e6,
            "capacity_mb": plan.cost.memory_capacity / 1e6, "fits": bool(plan.cost.fits),
            "apart": states_apart(g, plan), "optimizer_apart": plan.optimizer_apart,
            "staged": plan.stages is not None, "microbatches": plan.microbatches,
            "stage_plans": [st.strategy for st in plan.stages] if plan.stages else [],
            "cpu_s": time.process_time() - c0}
    return row


def render_staged(doc: dict) -> list[str]:
    rows = doc["rows"]
    out = ["", "## Staged plans", "",
           f"`python benchmarks/optimizer_apart.py --sections staged` (commit `{doc['commit']}`, "
           f"{doc['date']}): `auto` with staged plans on, in the default model and with "
           "`optimizer_apart=True`, where staged plans win. With state apart the staged "
           "search's stages plan in the model with state apart (each stage's Adam moments may be "
           "sharded over its group where its parameters stay whole: Megatron's pipeline with "
           "`use_distributed_optimizer`), and the search with state tied runs too, the faster "
           "plan kept (*kept*: which; the search is not exhaustive, so either can win). *CPU "
           "s*: planning CPU seconds, each plan on a freshly traced graph (with state apart, "
           "both searches). "
           "Third-party code: transformers' 1.3B-class modules of `benchmarks/stages.py` "
           "(float32); Alpa's GPTs are the zoo's at Alpa's sizes (`benchmarks/alpa.py`).", ""]
    rs = [r for row in rows if (r := _ratio(row, "auto apart", "auto", "step_ms")) is not None]
    ms = [r for row in rows if (r := _ratio(row, "auto apart", "auto", "memory_mb")) is not None]
    if rs:
        out += [f"- Step time apart / tied: geometric mean {_gmean(rs):.3f}, range "
                f"{min(rs):.3f}-{max(rs):.3f} over {len(rs)} cases; faster in "
                f"{sum(r < 1 - 1e-9 for r in rs)}, equal in "
                f"{sum(abs(r - 1) <= 1e-9 for r in rs)}, slower in "
                f"{sum(r > 1 + 1e-9 for r in rs)}.",
                f"- Peak memory apart / tied: range {min(ms):.3f}-{max(ms):.3f}.", ""]
    out += ["| case | cluster | states | tied: step (ms) | tied: memory (GB) | tied: stage plans "
            "| apart: step (ms) | apart: memory (GB) | apart: stage plans | kept | states apart "
            "| apart / tied step | apart / tied memory | CPU s tied | CPU s apart |",
            "|---|---|---:|---:|---:|---|---:|---:|---|---|---:|---:|---:|---:|---:|"]

    def plans(p):
        if not p.get("staged"):
            return "SPMD"
        names = p["stage_plans"]
        return (f"{len(names)} stages x {p['microbatches']} mb: "
                + ", ".join(f"{n} x{names.count(n)}" for n in dict.fromkeys(names)))

    for row in rows:
        t, a = row["plans"].get("auto", {}), row["plans"].get("auto apart", {})
        if "error" in t or "error" in a:
            out.append(f"| {row['case']} | {row['what']} | {row['states']} | "
                       f"{t.get('error', '')} {a.get('error', '')} |" + " |" * 12)
            continue
        out.append("| " + " | ".join([
            row["case"], row["what"], str(row["states"]), _fmt(t["step_ms"], 1),
            f"{t['memory_mb'] / 1e3:.2f} of {t['capacity_mb'] / 1e3:.0f}", plans(t),
            _fmt(a["step_ms"], 1), f"{a['memory_mb'] / 1e3:.2f} of {a['capacity_mb'] / 1e3:.0f}",
            plans(a), "apart" if a["optimizer_apart"] else "tied", str(a["apart"]),
            _fmt(_ratio(row, "auto apart", "auto", "step_ms"), 4),
            _fmt(_ratio(row, "auto apart", "auto", "memory_mb")),
            _fmt(t["cpu_s"], 1), _fmt(a["cpu_s"], 1)]) + " |")
    return out


def _ratio(row: dict, a: str, b: str, key: str) -> float | None:
    pa, pb = row["plans"].get(a, {}), row["plans"].get(b, {})
    if key not in pa or key not in pb or not pb[key]:
        return None
    return pa[key] / pb[key]


def _gmean(xs) -> float:
    return float(np.exp(np.mean(np.log(xs)))) if xs else float("nan")


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def render(report: dict) -> str:
    rows = report["rows"]
    out = ["# The distributed optimizer: optimizer state apart from its parameter", "",
           f"Generated by `python benchmarks/optimizer_apart.py` on {report['date']} (commit "
           f"`{report['commit']}`, {report['machine']['cpus']} CPU(s)); see the script's "
           "docstring. Third-party model code (`tests/realmodels/families.py`, **small**: 4 "
           "layers, width 256, sequence 128, batch 16), planned SPMD on each topology. `zero` "
           "against `dp`: the same batch split, optimizer state sharded over every device. "
           "`apart` against the default: `ilp` / `auto` with `optimizer_apart=True` against "
           "the same planner in the default cost model (state laid out with its parameter). "
           "Ratios below 1 are faster or smaller; *states apart*: optimizer states the apart "
           "plan lays out differently from their parameter, of those it has.", "", "## Summary",
           ""]
    for a, b, what in (("zero", "dp", "`zero` / `dp`"),
                       ("ilp apart", "ilp", "`ilp` apart / default"),
                       ("auto apart", "auto", "`auto` apart / default"),
                       ("auto apart", "ilp apart", "`auto` apart / `ilp` apart")):
        for key, label in (("step_ms", "step time"), ("memory_mb", "peak memory")):
            rs = [r for row in rows if (r := _ratio(row, a, b, key)) is not None]
            if rs:
                out.append(f"- {what}, {label}: geometric mean {_gmean(rs):.3f}, range "
                           f"{min(rs):.3f}-{max(rs):.3f} over {len(rs)} cells; faster / smaller in "
                           f"{sum(r < 1 - 1e-9 for r in rs)}, slower / larger in "
                           f"{sum(r > 1 + 1e-9 for r in rs)}.")
    out += ["", "## Per family and topology", "",
            "| family | topology | states | dp ms | zero / dp step | zero / dp memory | ilp ms "
            "| ilp MB | ilp apart / ilp step | ilp apart / ilp memory | states apart (ilp) "
            "| auto apart / auto step | auto apart / auto memory | auto apart / ilp apart step "
            "| ilp CPU s | ilp apart CPU s |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        p = row["plans"]
        cells = [row["family"], row["topology"], str(row["states"]),
                 _fmt(p.get("dp", {}).get("step_ms"), 2),
                 _fmt(_ratio(row, "zero", "dp", "step_ms")),
                 _fmt(_ratio(row, "zero", "dp", "memory_mb")),
                 _fmt(p.get("ilp", {}).get("step_ms"), 3),
                 _fmt(p.get("ilp", {}).get("memory_mb"), 1),
                 _fmt(_ratio(row, "ilp apart", "ilp", "step_ms"), 4),
                 _fmt(_ratio(row, "ilp apart", "ilp", "memory_mb")),
                 str(p.get("ilp apart", {}).get("apart", "-")),
                 _fmt(_ratio(row, "auto apart", "auto", "step_ms"), 4),
                 _fmt(_ratio(row, "auto apart", "auto", "memory_mb")),
                 _fmt(_ratio(row, "auto apart", "ilp apart", "step_ms"), 4),
                 _fmt(p.get("ilp", {}).get("cpu_s"), 1),
                 _fmt(p.get("ilp apart", {}).get("cpu_s"), 1)]
        out.append("| " + " | ".join(cells) + " |")
    errors = [(row["family"], row["topology"], k, v["error"]) for row in rows
              for k, v in row["plans"].items() if "error" in v]
    if errors:
        out += ["", "Errors:", ""] + [f"- {f} {t} {k}: {e}" for f, t, k, e in errors]
    if report.get("staged"):
        out += render_staged(report["staged"])
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=families.names(), choices=families.names())
    ap.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES), choices=list(TOPOLOGIES))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "optimizer_apart.json"))
    ap.add_argument("--md", default=os.path.join(HERE, "OPTIMIZER_APART.md"))
    ap.add_argument("--sections", nargs="+", default=["spmd", "staged"],
                    choices=["spmd", "staged"],
                    help="what to plan (the other section is kept from --out)")
    ap.add_argument("--staged-cases", nargs="+", default=list(STAGED), choices=list(STAGED))
    ap.add_argument("--report-only", action="store_true", help="rewrite the markdown from --out")
    args = ap.parse_args(argv)
    if args.report_only:
        with open(args.out) as f:
            report = json.load(f)
    else:
        from tqdm import tqdm

        report = {}
        if set(args.sections) != {"spmd", "staged"} and os.path.exists(args.out):
            with open(args.out) as f:
                report = json.load(f)
        stamp = {"commit": source_commit(ROOT), "date": datetime.date.today().isoformat(),
                 "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}
        if "spmd" in args.sections:
            cells = [(f, t) for f in args.families if families.available(f)
                     for t in args.topologies]
            rows = []
            for f, t in (bar := tqdm(cells, desc="planning", unit="cell")):
                bar.set_postfix_str(f"{f} {t}")
                rows.append(measure(f, t))
            report.update(stamp, rows=rows)
        if "staged" in args.sections:
            rows = []
            for label in (bar := tqdm(args.staged_cases, desc="staged", unit="case")):
                bar.set_postfix_str(label)
                rows.append(measure_staged(label))
            report["staged"] = dict(stamp, rows=rows)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    with open(args.md, "w") as f:
        f.write(render(report))
    print(f"wrote {args.md}")


if __name__ == "__main__":
    main()
