"""How close ``auto`` (network prior + search) gets to the ILP optimum, and how much faster it is.

For graphs the network never saw: in-distribution (same generators, other seed), held-out model
families (GPT-2, BERT, ViT) and a held-out topology kind (TPU v5e slices). For each: the cost ratio
auto/ILP (``auto`` from the network's shortlist, ``full_program=0``: as shipped, ``auto`` solves
the whole program where it is small, which the network only seeds), of the network's
shortlist with coordinate descent only (no solver, no baselines), of ``auto`` with a uniform
prior (the ablation: the same pipeline and budget, no network), and the planning-time ratios
ILP/auto and uniform-prior auto/auto (each planner on a freshly traced graph of its own).
Then the planning time of the zoo's GPT-2 small, medium and 1B steps (trace + plan).

    python benchmarks/gnn_eval.py [--n 6] [--out benchmarks/results/gnn_eval.json]

Writes the JSON and prints a markdown report (also written to benchmarks/results/gnn_eval.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
from tqdm.auto import tqdm

import hulkjax as hj
from hulkjax import zoo
from hulkjax.strategies.auto import prior, search
from hulkjax.strategies.realize import cost_model
from hulkjax.training import data

HERE = os.path.dirname(os.path.abspath(__file__))


def evaluate(specs, desc):
    rows = []
    for spec in tqdm(specs, desc=desc):
        topo = data.make_topology(spec["topology"])
        # Each planner gets its own freshly traced graph: the cost model's tables are cached on
        # a graph, and whoever ran second would plan on the first one's tables.
        try:
            g = data.make_graph(spec)
            t0 = time.perf_counter()
            ilp = hj.plan(None, graph=g, topology=topo, strategy="ilp")
            t_ilp = time.perf_counter() - t0
        except hj.errors.InfeasiblePlanError:
            continue
        # auto from the network's shortlist (full_program=0): on small programs (meshes of at
        # most two axes) auto as shipped solves the whole program, which the network only
        # seeds; this measures the shortlist the network chooses, where it decides.
        g = data.make_graph(spec)
        t0 = time.perf_counter()
        auto = hj.plan(None, graph=g, topology=topo, strategy="auto", full_program=0)
        t_auto = time.perf_counter() - t0
        # The ablation on a fresh graph too, so that its time is comparable with auto's.
        gu = data.make_graph(spec)
        t0 = time.perf_counter()
        uniform = hj.plan(None, graph=gu, topology=topo, strategy="auto", prior_kind="uniform",
                          full_program=0)
        t_uniform = time.perf_counter() - t0
        cm = cost_model(g, topo)
        found, _ = search(cm, prior(cm))  # the network's shortlist and descent, nothing else
        opt = ilp.cost.step_time
        rows.append({"spec": spec, "ilp_ms": opt * 1e3, "auto_ratio": auto.cost.step_time / opt,
                     "search_ratio": cm.objective(found) / opt,
                     "uniform_ratio": uniform.cost.step_time / opt,
                     "ilp_s": t_ilp, "auto_s": t_auto, "uniform_s": t_uniform,
                     "auto_source": auto.source})
    return rows


def summary(rows):
    if not rows:
        return {}
    r = lambda k: np.array([x[k] for x in rows])  # noqa: E731
    return {"n": len(rows), "auto_median": float(np.median(r("auto_ratio"))),
            "auto_max": float(np.max(r("auto_ratio"))),
            "search_median": float(np.median(r("search_ratio"))),
            "uniform_median": float(np.median(r("uniform_ratio"))),
            "speedup_median": float(np.median(r("ilp_s") / r("auto_s"))),
            "uniform_time_median": float(np.median(r("uniform_s") / r("auto_s")))}


def gpt2_times():
    topo = hj.Topology.preset("dgx-h100", nodes=2)
    out = []
    for size in ("small", "medium", "1b"):
        m = zoo.get("gpt2", size=size)
        state, batch = m.abstract()
        row = {"size": size}
        for strategy in ("auto", "ilp"):
            t0 = time.perf_counter()
            g = hj.trace(m.step, state, batch)
            t_trace = time.perf_counter() - t0
            p = hj.plan(m.step, state, batch, topology=topo, strategy=strategy, graph=g)
            row[strategy] = {"trace_s": t_trace, "plan_s": p.planning_time,
                             "total_s": time.perf_counter() - t0, "step_ms": p.cost.step_time * 1e3}
        out.append(row)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=6, help="graphs per split")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "gnn_eval.json"))
    args = ap.parse_args()
    splits = {
        "in-distribution": data.sample_specs(args.n, seed=101),
        "held-out families": data.sample_specs(args.n, seed=102, families=data.HELD_OUT_FAMILIES),
        "held-out topology (TPU v5e)": data.sample_specs(args.n, seed=103, topologies=("tpu",)),
    }
    results = {name: evaluate(specs, name) for name, specs in splits.items()}
    report = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
              "splits": {k: {"summary": summary(v), "rows": v} for k, v in results.items()},
              "gpt2": gpt2_times()}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    md = render(report)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(md)
    print(md)


def render(report) -> str:
    lines = ["| split | graphs | auto / ILP (median) | auto / ILP (max) | network + descent only | "
             "auto with a uniform prior | ILP time / auto time | uniform prior's time / auto "
             "time |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in report["splits"].items():
        s = s["summary"]
        if not s:
            continue
        lines.append(f"| {name} | {s['n']} | {s['auto_median']:.3f} | {s['auto_max']:.3f} | "
                     f"{s['search_median']:.3f} | {s['uniform_median']:.3f} | "
                     f"{s['speedup_median']:.1f}x | {s['uniform_time_median']:.1f}x |")
    lines += ["", "| GPT-2 | auto: trace + plan (s) | ilp: trace + plan (s) | auto step (ms) | "
              "ilp step (ms) |", "|---|---:|---:|---:|---:|"]
    for row in report["gpt2"]:
        a, i = row["auto"], row["ilp"]
        lines.append(f"| {row['size']} | {a['trace_s']:.2f} + {a['plan_s']:.2f} | "
                     f"{i['trace_s']:.2f} + {i['plan_s']:.2f} | {a['step_ms']:.3f} | "
                     f"{i['step_ms']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
