"""Soft against hard targets for the planner network (issue 14, item 5: a learned prior that earns
its place), on held-out splits whose optimum is not trivial.

What it does, in order (each step cached, so a rerun only redoes what changed):

1. Labels: the training and validation graphs of ``hulkjax train-gnn`` (``hulkjax.training.data``,
   ``DATA_VERSION`` 4: the ILP's plan and every candidate's regret; cached in
   ``$HULKJAX_CACHE`` or ``~/.cache/hulkjax``).
2. Trains the network twice on them from the same seed, ``targets="hard"`` (the ILP's candidate,
   one-hot, as the shipped weights were trained) and ``targets="soft"`` (each candidate weighed by
   its regret; :mod:`hulkjax.training.train`), into ``--weights-dir``.
3. Evaluates the shipped weights and both new ones on four held-out splits (other seeds than
   training's): in-distribution, held-out zoo families (GPT-2, BERT, ViT), a held-out topology
   (TPU v5e slices), and third-party model code (transformers' Flax GPT-2, BERT, T5, ViT and
   LLaMA of ``tests/realmodels/families.py``, at random small dimensions, on the training
   distribution's random clusters). Only graphs whose optimum is *not trivial* count: the ILP's SPMD plan at
   least ``--margin`` (1%) faster than the best baseline's (replicate, dp, fsdp, megatron,
   dp_tp, expert, ...), drawn until each split has ``--n``. Per graph and weights (the cost
   model's SPMD objective, staged plans left out: the network only decides SPMD layouts):

   * *recall@16* and *recall@4*: the share of groups with a choice whose ILP candidate is among
     the network's 16 (``auto``'s shortlist, ``TOP_K``) or 4 likeliest;
   * *argmax*: the network's likeliest candidate per group, no search, over the ILP's objective;
   * *descent*: the network's shortlist and coordinate descent (``auto``'s ``search``, no solver,
     no baselines), over the ILP's;
   * *auto*: ``auto``'s SPMD planner from the shortlist (``full_program=0``: as shipped, ``auto``
     solves the whole program where it is small, which the network only seeds), over the ILP's,
     and its CPU seconds;
   * and once per graph, ``auto`` from a uniform prior (the ablation).

Writes ``benchmarks/results/gnn_targets.json`` and ``benchmarks/GNN_TARGETS.md``::

    python benchmarks/gnn_targets.py                 # label, train both, evaluate (~40 min
                                                     # with the labels cached)
    python benchmarks/gnn_targets.py --skip-train    # evaluate the weights in --weights-dir
    python benchmarks/gnn_targets.py --report-only   # the markdown from the JSON
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

OUT_JSON = os.path.join(HERE, "results", "gnn_targets.json")
OUT_MD = os.path.join(HERE, "GNN_TARGETS.md")
TARGETS = ("hard", "soft")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=ROOT, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def train_both(weights_dir: str, *, samples: int, val_samples: int, epochs: int) -> dict:
    from hulkjax.training.train import run

    out = {}
    for targets in TARGETS:
        t0 = time.process_time()
        history = run(samples=samples, val_samples=val_samples, epochs=epochs, seed=0,
                      out_dir=os.path.join(weights_dir, targets), targets=targets)
        out[targets] = {"cpu_s": time.process_time() - t0,
                        **{k: v[-1] for k, v in history.items()
                           if isinstance(v, list) and v and k != "epoch_time"},
                        "val_argmax_first": history.get("val_argmax_ratio", [None])[0]}
    return out


def _nontrivial(specs, n: int, margin: float, desc: str):
    """The first ``n`` specs (of an endless stream) whose ILP SPMD plan beats every baseline by
    ``margin``: ``[(spec, graph, topology, cost model, ILP assignment, ILP objective,
    best baseline's objective)]``, and how many were drawn."""
    from hulkjax.errors import HulkjaxError
    from hulkjax.strategies.baselines import baseline_assignments
    from hulkjax.strategies.ilp import solve
    from hulkjax.strategies.realize import cost_model
    from hulkjax.training import data

    kept, drawn = [], 0
    for spec in specs:
        if len(kept) >= n:
            break
        drawn += 1
        try:
            g = _graph(spec)
            topo = data.make_topology(spec["topology"])
            cm = cost_model(g, topo)
            base = baseline_assignments(g, topo)
            res = solve(cm, seeds=list(base.values()), time_limit=30.0)
        except HulkjaxError:
            continue
        fits = [cm.objective(a) for a in base.values() if cm.memory(a) <= cm.capacity]
        best = min(fits, default=float("inf"))
        if res.objective < best * (1 - margin):
            kept.append((spec, g, topo, cm, list(res.assignment), res.objective, best))
            print(f"  {desc}: {len(kept)}/{n} ({spec['family']}, ILP {res.objective * 1e3:.4g} "
                  f"ms, best baseline {best * 1e3:.4g} ms)", flush=True)
    return kept, drawn


THIRD_PARTY = ("gpt2", "bert", "t5", "vit", "llama")


def _stream(seed: int, *, third_party: bool = False, **kw):
    """Specs without end: ``hulkjax.training.data``'s, or (``third_party``) a family of
    ``tests/realmodels/families.py`` at random small dimensions on the same random clusters."""
    from hulkjax.training import data

    k = 0
    while True:
        specs = data.sample_specs(16, seed=seed * 1000 + k, **kw)
        if third_party:
            rng = np.random.default_rng(seed * 1000 + k)

            def pick(*xs, rng=rng):
                return xs[int(rng.integers(len(xs)))]

            specs = [{"family": "hf:" + pick(*THIRD_PARTY),
                      "model": dict(layers=int(pick(1, 2)), width=int(pick(64, 128)), heads=4,
                                    ff=int(pick(128, 256, 512)), vocab=int(pick(256, 1024)),
                                    seq=int(pick(16, 64)), batch=int(pick(8, 32)), image=16,
                                    patch=4),
                      "topology": s["topology"]} for s in specs]
        yield from specs
        k += 1


def _graph(spec: dict):
    """The spec's step, traced abstractly (a third-party family through ``benchmarks/stages.py``'s
    ``ThirdParty``, as ``benchmarks/planning.py`` builds them)."""
    import hulkjax as hj
    from hulkjax.training import data

    if not spec["family"].startswith("hf:"):
        return data.make_graph(spec)
    sys.path.insert(0, HERE)
    from stages import ThirdParty

    m = ThirdParty(spec["family"][3:], spec["model"])
    return hj.trace(m.step, *m.abstract())


def evaluate(weights: dict[str, str | None], *, n: int, margin: float) -> dict:
    import hulkjax as hj
    from hulkjax.strategies.auto import TOP_K, prior, search
    from hulkjax.training import data

    splits = {
        "in-distribution": _stream(201),
        "held-out families (GPT-2, BERT, ViT)": _stream(202, families=data.HELD_OUT_FAMILIES),
        "held-out topology (TPU v5e)": _stream(203, topologies=("tpu",)),
        "third-party code (transformers' GPT-2, BERT, T5, ViT, LLaMA)": _stream(
            204, third_party=True),
    }
    out = {}
    for name, stream in splits.items():
        kept, drawn = _nontrivial(stream, n, margin, name)
        rows = []
        for spec, _g, topo, cm, ilp_a, opt, best in kept:
            row = {"family": spec["family"], "spec": spec, "ilp_ms": opt * 1e3,
                   "best_baseline_ms": best * 1e3, "groups": len(cm.groups)}
            choice = [gr.id for gr in cm.groups if len(gr.candidates) > 1]
            for label, wdir in weights.items():
                logp = prior(cm, weights=wdir)
                if logp is None:  # more mesh axes than the network reads
                    continue
                order = np.argsort(-logp, axis=1, kind="stable")
                rec = {k: float(np.mean([ilp_a[i] in order[i, :k] for i in choice]))
                       if choice else 1.0 for k in (4, TOP_K)}
                pick = [int(np.argmax(logp[gr.id, :len(gr.candidates)])) for gr in cm.groups]
                found, _ = search(cm, logp)
                g2 = _graph(spec)  # auto on a graph of its own (tables cached per graph)
                c0 = time.process_time()
                plan = hj.plan(None, graph=g2, topology=topo, strategy="auto", full_program=0,
                               stages=False, weights=wdir)
                row[label] = {"recall4": rec[4], "recall16": rec[TOP_K],
                              "argmax": cm.objective(pick) / opt,
                              "descent": cm.objective(found) / opt,
                              "auto": plan.cost.step_time / opt,
                              "auto_cpu_s": time.process_time() - c0}
            g2 = _graph(spec)
            c0 = time.process_time()
            plan = hj.plan(None, graph=g2, topology=topo, strategy="auto", full_program=0,
                           stages=False, prior_kind="uniform")
            row["uniform"] = {"auto": plan.cost.step_time / opt,
                              "auto_cpu_s": time.process_time() - c0}
            rows.append(row)
        out[name] = {"drawn": drawn, "rows": rows}
    return out


def _median(rows, label, key):
    xs = [r[label][key] for r in rows if label in r]
    return float(np.median(xs)) if xs else float("nan")


def _geomean(rows, label, key):
    xs = [r[label][key] for r in rows if label in r]
    return float(np.exp(np.mean(np.log(xs)))) if xs else float("nan")


def render(report: dict) -> str:
    tr = report.get("training", {})
    lines = [
        "# Soft against hard targets for the planner network",
        "",
        f"Generated by `python benchmarks/gnn_targets.py` (see its docstring) at commit "
        f"`{report['commit']}`, {report['date']}, on {report['machine']['cpus']} CPU(s). "
        f"The network was trained twice on the same {report['samples']} ILP-labelled graphs "
        f"({report['val_samples']} for validation, {report['epochs']} epochs, seed 0): "
        "*hard*, the ILP's candidate per group (one-hot: how the shipped weights were trained, on "
        "older labels), and *soft*, each candidate weighed by its regret (the step's increase "
        "when that group alone takes it, `exp(-regret / (0.01 x step))`, normalized). *shipped* "
        "is `hulkjax/gnn/weights/planner.msgpack`. Each held-out split holds graphs whose "
        f"optimum is not trivial: the ILP's SPMD plan at least {report['margin']:.0%} faster "
        "than every baseline that fits (drawn until there were enough). Ratios are over the "
        "ILP's objective (1.000: the optimum); *auto* is `auto`'s SPMD planner from the "
        "network's shortlist (`full_program=0`, `stages=False`); *uniform* is the same from a "
        "uniform prior (the ablation).",
        "",
    ]
    if tr:
        lines += ["Training (last epoch; validation: 24 graphs of the training distribution, "
                  "medians over the ILP):", "",
                  "| targets | train loss | val argmax / ILP | val network + search / ILP | "
                  "CPU s |", "|---|---:|---:|---:|---:|"]
        for t, h in tr.items():
            lines.append(f"| {t} | {h.get('train_loss', float('nan')):.3f} | "
                         f"{h.get('val_argmax_ratio', float('nan')):.4f} | "
                         f"{h.get('val_search_ratio', float('nan')):.4f} | {h['cpu_s']:.0f} |")
        lines.append("")
    labels = report["labels"]
    lines += ["| split | graphs (drawn) | weights | recall@4 | recall@16 | argmax / ILP "
              "(median) | network + descent / ILP (median, geomean) | auto / ILP (median, "
              "max) | auto CPU s (median) |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, split in report["splits"].items():
        rows = split["rows"]
        for label in (*labels, "uniform"):
            if label == "uniform":
                lines.append(
                    f"| {name} | {len(rows)} ({split['drawn']}) | uniform prior | - | - | - | - "
                    f"| {_median(rows, label, 'auto'):.4f}, "
                    f"{max((r[label]['auto'] for r in rows), default=float('nan')):.4f} | "
                    f"{_median(rows, label, 'auto_cpu_s'):.2f} |")
                continue
            lines.append(
                f"| {name} | {len(rows)} ({split['drawn']}) | {label} | "
                f"{_median(rows, label, 'recall4'):.3f} | {_median(rows, label, 'recall16'):.3f} "
                f"| {_median(rows, label, 'argmax'):.4f} | "
                f"{_median(rows, label, 'descent'):.4f}, {_geomean(rows, label, 'descent'):.4f} "
                f"| {_median(rows, label, 'auto'):.4f}, "
                f"{max((r[label]['auto'] for r in rows), default=float('nan')):.4f} | "
                f"{_median(rows, label, 'auto_cpu_s'):.2f} |")
    lines += ["", "Per graph (ILP ms, best baseline ms; then per weights: recall@16, argmax / ILP, "
              "network + descent / ILP):", ""]
    for name, split in report["splits"].items():
        lines.append(f"- {name}:")
        for r in split["rows"]:
            parts = "; ".join(f"{lab} {r[lab]['recall16']:.2f} / {r[lab]['argmax']:.3f} / "
                              f"{r[lab]['descent']:.3f}" for lab in labels)
            lines.append(f"  - {r['family']} ({r['groups']} groups): {r['ilp_ms']:.4g} / "
                         f"{r['best_baseline_ms']:.4g} ms; {parts}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights-dir", default=None,
                    help="where the two trainings write their weights (hard/, soft/; default: "
                         "gnn-targets/ beside the labels' cache)")
    ap.add_argument("--samples", type=int, default=360)
    ap.add_argument("--val-samples", type=int, default=24)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--n", type=int, default=8, help="graphs per held-out split")
    ap.add_argument("--margin", type=float, default=0.01,
                    help="how much faster than every baseline the optimum must be")
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--out", default=OUT_JSON)
    ap.add_argument("--md", default=OUT_MD)
    args = ap.parse_args()
    if args.report_only:
        with open(args.out) as f:
            report = json.load(f)
    else:
        import jax
        jax.config.update("jax_platforms", "cpu")
        from hulkjax.training import data
        if args.weights_dir is None:
            args.weights_dir = os.path.join(os.path.dirname(data.cache_dir()), "gnn-targets")
        training = {}
        if args.skip_train and os.path.exists(args.out):
            with open(args.out) as f:
                training = json.load(f).get("training", {})
        if not args.skip_train:
            training = train_both(args.weights_dir, samples=args.samples,
                                  val_samples=args.val_samples, epochs=args.epochs)
        weights = {"shipped": None, **{t: os.path.join(args.weights_dir, t) for t in TARGETS}}
        splits = evaluate(weights, n=args.n, margin=args.margin)
        report = {"commit": _commit(),
                  "date": datetime.datetime.now(datetime.UTC).isoformat(
                      timespec="seconds"),
                  "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                  "samples": args.samples, "val_samples": args.val_samples,
                  "epochs": args.epochs, "margin": args.margin, "labels": list(weights),
                  "training": training, "splits": splits}
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)
    md = render(report)
    with open(args.md, "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
