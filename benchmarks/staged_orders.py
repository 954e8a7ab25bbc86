"""The staged search on held-out clusters: random heterogeneous sites, the search's own orders
of the device groups against every order.

The staged search (``hulkjax.strategies.stages.search``, what ``ilp`` and ``auto`` run) places
stages along a few orders of the groups (:func:`~hulkjax.strategies.stages.chains`: the
topology's, the path of cheapest links, fastest first) and ranks what its dynamic programs find
before costing the best few exactly. On clusters nobody tuned it on, this measures:

* **regret of the orders**: the best step the search finds with its own orders, against the same
  search over every order of the groups (``G!``; an upper bound on what a better choice of
  orders could gain: the exhaustive search is the same program, ranking and shortlist);
* **the device-group head**: the search's own orders plus the ``--head-orders`` orders the
  shipped device-group head proposes (``auto``'s ``head_orders``,
  :func:`hulkjax.strategies.auto.head_orders`), against its own orders plus as many orders
  drawn at random (seeded per cluster: what any extra order buys), and the CPU seconds of each;
* **ranking accuracy**: for every layout the search costs exactly, the time it ranked it by
  (``_ranking_time``, where the installed hulkjax has it) against its exact cost.

Held out from the head's training (``hulkjax train-gnn --head groups``,
:mod:`hulkjax.training.group_data`): these clusters (another generator and seeds), the zoo GPT's
shape (its family is trained on at other shapes), and transformers' code (GPT-2, T5: families
never seen).

Clusters: ``--clusters`` seeded draws of ``--sites`` sites of 2 GPUs each, every site one kind
of A100, V100 or T4, a link per pair of sites of 1-40 Gbit/s and 1-30 ms (log-uniform). Models:
GPT-2-style steps with a tied embedding (the first stage holds it, the LM head on the last reads
it): the zoo's GPT at 2B-class shapes (bf16, rematerialized) and transformers' Flax GPT-2 at
1.3B-class shapes (float32, as the library writes it), abstract. Stage plans are the baselines'
(``fsdp``, ``dp_tp``; no intra-stage ILP, to keep the run short), which every search shares.

Every number is the cost model's prediction; nothing is compiled or run::

    python benchmarks/staged_orders.py                        # -> results + STAGED_ORDERS.md
    python benchmarks/staged_orders.py --clusters 3 --models gpt-2b
    python benchmarks/staged_orders.py --compare before.json  # a column of an earlier run
    python benchmarks/staged_orders.py --report-only
    python benchmarks/staged_orders.py --models hf-t5 --merge   # more rows into the JSON
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time

from tqdm import tqdm

import hulkjax as hj
from hulkjax import zoo
from hulkjax.strategies import stages
from hulkjax.strategies.auto import HEAD_ORDERS, head_orders
from hulkjax.topology.model import Device, PairLink, Topology
from hulkjax.topology.specs import DEVICE_SPECS, LinkSpec

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from stages import THIRD_PARTY_DIMS, ThirdParty  # noqa: E402  (the staged benchmark's models)

OUT_JSON = os.path.join(HERE, "results", "staged_orders.json")
OUT_MD = os.path.join(HERE, "STAGED_ORDERS.md")
KINDS = ("A100", "V100", "T4")
GPUS = 2


def _zoo_gpt():
    return zoo.get("gpt2", size="1b", n_layers=24, d_model=2560, n_heads=20, batch=32,
                   dtype="bfloat16", remat=True)


MODELS = {
    "gpt-2b": ("zoo GPT, 24 x 2560, batch 32, bf16, remat", _zoo_gpt),
    "hf-gpt2-1.3b": ("transformers FlaxGPT2, 24 x 2048, batch 32, float32",
                     lambda: ThirdParty("gpt2", dict(THIRD_PARTY_DIMS, batch=32))),
    "hf-t5": ("transformers FlaxT5 (encoder-decoder, untied), 24 x 2048, batch 32, float32",
              lambda: ThirdParty("t5", dict(THIRD_PARTY_DIMS, batch=32))),
}


def cluster(seed: int, sites: int) -> tuple[Topology, dict]:
    """A seeded random cluster of ``sites`` sites (see the module docstring)."""
    rng = random.Random(seed)
    kinds = [rng.choice(KINDS) for _ in range(sites)]
    devices = tuple(Device(id=r * GPUS + k, spec=DEVICE_SPECS[kinds[r]], region=f"s{r}",
                           node=f"s{r}-n0") for r in range(sites) for k in range(GPUS))
    links, info = [], {}
    for a in range(sites):
        for b in range(a + 1, sites):
            gbit, ms = 10 ** rng.uniform(0, 1.6), 10 ** rng.uniform(0, 1.5)
            links.append(PairLink(between=(f"s{a}", f"s{b}"),
                                  link=LinkSpec(bandwidth=gbit * 1e9 / 8, latency=ms / 1e3)))
            info[f"{a}-{b}"] = [round(gbit, 2), round(ms, 1)]
    topo = Topology(name=f"random-{seed}", devices=devices, axis_names=("region", "gpu"),
                    shape=(sites, GPUS), node_link=LinkSpec(bandwidth=150e9, latency=1e-6),
                    wan_link=LinkSpec(bandwidth=1e9 / 8, latency=0.05), links=tuple(links))
    return topo, {"kinds": kinds, "links": info}


def _every_order(topology, groups, *, limit: int = 3):
    return list(itertools.permutations(range(len(groups))))


def _random_orders(n: int, seed: int):
    """The control for the head: ``n`` orders of the groups drawn at random (seeded)."""
    def propose(part, topology, level, groups):
        rng = random.Random(seed)
        every = list(itertools.permutations(range(len(groups))))
        return rng.sample(every, min(n, len(every)))

    return propose


def run_one(graph, topo, *, seed: int, head_n: int) -> dict:
    """The search with its own orders, with the head's or random ones added, and with every
    order; ranking against exact costs."""
    out = {}
    rank_of = getattr(stages, "_ranking_time", None)
    real_cost = stages.layout_cost
    head = head_orders(head_n)
    runs = [("own", stages.chains, None), ("every", _every_order, None)]
    if head is not None:
        runs += [("head", stages.chains, head),
                 ("random", stages.chains, _random_orders(head_n, seed))]
    for label, orders, propose in runs:
        pairs = []
        proposed = []

        def spy_propose(*a, propose=propose, proposed=proposed):
            got = propose(*a)
            proposed.extend([list(o) for o in got])
            return got

        def spy(ctx, layout, pairs=pairs):
            c = real_cost(ctx, layout)
            if rank_of is not None:
                pairs.append((rank_of(ctx, layout), c.step_time))
            return c

        graph.memo.pop("staged_contexts", None)  # a cold search each time
        stages.chains, stages.layout_cost = orders, spy
        try:
            t0 = time.process_time()
            res = stages.search(graph, topo, keep=1, shortlist=12,
                                propose=None if propose is None else spy_propose)
            seconds = time.process_time() - t0
        finally:
            stages.chains, stages.layout_cost = _OWN_ORDERS, real_cost
        best = res.layouts[0] if res.layouts else None
        out[label] = {
            "step": best[0] if best else None, "cpu_seconds": seconds,
            "layout": None if best is None else {
                "sites": [int(g[0]) // GPUS for g in best[1].groups],
                "ranges": [list(r) for r in best[1].ranges], "plans": list(best[1].plans),
                "microbatches": best[1].microbatches, "schedule": best[1].schedule},
            "ranked_over_exact": [r / e for r, e in pairs if e and math.isfinite(r)],
            "proposed": proposed,
        }
    return out


_OWN_ORDERS = stages.chains


def _git(*args) -> str:
    """``git`` in the tree of the hulkjax imported (``--compare`` runs may import another)."""
    try:
        return subprocess.run(["git", *args], cwd=os.path.dirname(hj.__file__),
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _geo(xs) -> float:
    xs = [x for x in xs if x and math.isfinite(x)]
    return math.exp(statistics.mean(math.log(x) for x in xs)) if xs else float("nan")


def _ratio(a, b):
    return a / b if a and b else None


def _summary(mine: list, col: str) -> str:
    """``col`` / every order over the rows: geometric mean, worst, optimal count."""
    r = [x for x in (_ratio(row[col]["step"], row["every"]["step"]) for row in mine) if x]
    if not r:
        return "-"
    return (f"{_geo(r):.3f} (worst {max(r):.3f}, optimal on {sum(x <= 1.005 for x in r)}/"
            f"{len(r)})")


def report(doc: dict, before: dict | None) -> str:
    rows = doc["rows"]
    heads = any("head" in r for r in rows)
    prev = {} if before is None else {(r["model"], r["seed"]): r for r in before["rows"]}
    out = [
        "# The staged search on held-out clusters",
        "",
        f"Generated by `{doc['command']}` on {doc['date']} (commit `{doc['commit']}`; "
        f"{doc['cpus']} CPUs, {doc['seconds']:.0f} s)"
        + "".join(f"; rows of {m} merged by `{c}` (commit `{k}`)"
                  for m, c, k in doc.get("merged", [])) + ". "
        f"{len(doc['seeds'])} seeded clusters of "
        f"{doc['sites']} sites x {GPUS} GPUs (each site A100, V100 or T4; a link per pair of "
        "sites, 1-40 Gbit/s and 1-30 ms, log-uniform), models: "
        + "; ".join(f"`{k}`: {MODELS[k][0]}" for k in doc["models"]) + ". Stage plans: the "
        "baselines' (`fsdp`, `dp_tp`). Every number is the cost model's prediction.",
        "",
        "**own**: the search as `ilp` and `auto` run it without the head, over its own orders "
        "of the sites (the topology's, the path of cheapest links, fastest first); **every**: "
        "the same search over every order (an upper bound on what better orders could gain; it "
        "is not always faster: its microbatch counts follow its own comparisons). "
        "**ranked / exact**: for every layout costed exactly, the time the search ranked it by "
        "against that cost.",
        "",
    ]
    if heads:
        out += [
            f"**own + head**: its own orders and the {doc.get('head_orders', 1)} the shipped "
            "device-group head proposes (what `auto` runs); **own + random**: its own orders "
            "and as many drawn at random (seeded per cluster), the control: what any order "
            "more buys. CPU seconds are each search's, cold (no tables cached), on a shared "
            "machine: compare them within a row.",
            "",
        ]
    out += ["## Summary", ""]
    for model in doc["models"]:
        mine = [r for r in rows if r["model"] == model and r["own"]["step"]]
        if not mine:
            continue
        ratios = [x for r in mine for x in r["own"]["ranked_over_exact"]]
        line = f"- `{model}`: own / every order: {_summary(mine, 'own')}"
        if heads:
            line += (f"; own + head / every: {_summary(mine, 'head')}; own + random / every: "
                     f"{_summary(mine, 'random')}")
            for col in ("head", "random"):
                gain = [x for x in (_ratio(r["own"]["step"], r[col]["step"]) for r in mine)
                        if x]
                line += (f"; own + {col} faster than own on {sum(g > 1.005 for g in gain)}, "
                         f"slower on {sum(g < 0.995 for g in gain)} of {len(gain)} (geometric "
                         f"mean {_geo(gain):.3f}x)")
            # The own search runs first and pays what a cold process pays once: the head's
            # CPU seconds are compared with the random orders' (both run after it).
            cpu = [r["head"]["cpu_seconds"] / r["random"]["cpu_seconds"] for r in mine
                   if r["random"]["cpu_seconds"]]
            line += f"; CPU own + head / own + random: median {statistics.median(cpu):.2f}"
        if ratios:
            err = sorted(abs(x - 1) for x in ratios)
            line += (f"; ranked / exact within 3% for {sum(e <= 0.03 for e in err)}/{len(err)} "
                     f"layouts costed (median error {statistics.median(err):.1%}, worst "
                     f"{err[-1]:.1%})")
        olds = [(prev[(model, r["seed"])]["own"]["step"], r["own"]["step"]) for r in mine
                if (model, r["seed"]) in prev and prev[(model, r["seed"])]["own"]["step"]]
        if olds:
            gain = [o / n for o, n in olds]
            line += (f"; against {before['label']}: {_geo(gain):.3f}x faster (geometric mean), "
                     f"faster on {sum(g > 1.005 for g in gain)}, slower on "
                     f"{sum(g < 0.995 for g in gain)} of {len(gain)}")
        out.append(line + ".")
    cols = ["own (ms)"] + (["own + head (ms)", "own + random (ms)"] if heads else []) + [
        "every order (ms)", "own / every"] + (["own + head / every", "own + random / every"]
                                              if heads else [])
    out += ["", "## Per cluster", "",
            "| model | cluster | sites | " + " | ".join(cols) + " | "
            + ("before (ms) | before / own | " if before else "")
            + "own's layout | " + ("head's orders | " if heads else "")
            + "CPU s (own / " + ("head / random / " if heads else "") + "every) |",
            "|---|---|---|" + "---:|" * len(cols) + ("---:|---:|" if before else "") + "---|"
            + ("---|" if heads else "") + "---:|"]
    ms = lambda x: f"{x * 1e3:.0f}" if x else "-"  # noqa: E731
    rt = lambda a, b: f"{a / b:.3f}" if a and b else "-"  # noqa: E731
    for r in rows:
        o, e = r["own"], r["every"]
        h, q = r.get("head"), r.get("random")
        lay = o["layout"]
        desc = "-" if lay is None else (
            f"{lay['schedule']}, {lay['microbatches']} mb: "
            + " ".join(f"s{s}[{a}:{b}]" for s, (a, b) in zip(lay["sites"], lay["ranges"])))
        cells = [r["model"], str(r["seed"]), " ".join(r["cluster"]["kinds"]), ms(o["step"])]
        if heads:
            cells += [ms(h and h["step"]), ms(q and q["step"])]
        cells += [ms(e["step"]), rt(o["step"], e["step"])]
        if heads:
            cells += [rt(h and h["step"], e["step"]), rt(q and q["step"], e["step"])]
        if before:
            p = prev.get((r["model"], r["seed"]))
            ps = p["own"]["step"] if p else None
            cells += [ms(ps), rt(ps, o["step"])]
        cells.append(desc)
        if heads:
            cells.append(" ".join("".join(map(str, x)) for x in (h or {}).get("proposed", []))
                         or "-")
        cpus = [o["cpu_seconds"]] + ([h["cpu_seconds"] if h else 0, q["cpu_seconds"] if q else 0]
                                     if heads else []) + [e["cpu_seconds"]]
        cells.append(" / ".join(f"{c:.1f}" for c in cpus))
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "Links per cluster (Gbit/s, ms) are in the JSON."]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clusters", type=int, default=12)
    ap.add_argument("--sites", type=int, default=4)
    ap.add_argument("--models", nargs="*", default=["gpt-2b", "hf-gpt2-1.3b"],
                    choices=list(MODELS))
    ap.add_argument("--head-orders", type=int, default=HEAD_ORDERS,
                    help="orders the device-group head proposes (0: no head columns)")
    ap.add_argument("--merge", action="store_true",
                    help="run --models and put their rows into the existing JSON (same "
                         "clusters)")
    ap.add_argument("--compare", metavar="JSON", help="an earlier run's JSON, as a column")
    ap.add_argument("--before-label", default=None)
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--out", default=OUT_JSON)
    ap.add_argument("--md", default=OUT_MD)
    args = ap.parse_args()
    before = None
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        before["label"] = args.before_label or f"commit `{before.get('commit', '?')}`"
    command = "python benchmarks/staged_orders.py" + "".join(  # (without its output paths)
        f" {a}" for a in sys.argv[1:] if a not in ("--out", args.out, "--md", args.md))
    if args.report_only:
        with open(args.out) as f:
            doc = json.load(f)
    else:
        t0 = time.time()
        if args.merge:
            with open(args.out) as f:
                doc = json.load(f)
            doc["rows"] = [r for r in doc["rows"] if r["model"] not in args.models]
            doc["models"] = [m for m in doc["models"] if m not in args.models] + args.models
            doc.setdefault("merged", []).append(
                [", ".join(args.models), command, _git("rev-parse", "--short", "HEAD")])
            seeds, done = doc["seeds"], doc["seconds"]
        else:
            seeds, done = list(range(args.clusters)), 0.0
            doc = {"command": command, "date": datetime.date.today().isoformat(),
                   "commit": _git("rev-parse", "--short", "HEAD"),
                   "cpus": os.cpu_count(), "python": platform.python_version(),
                   "sites": args.sites, "seeds": seeds, "models": args.models,
                   "head_orders": args.head_orders, "rows": []}
        for model in args.models:
            m = MODELS[model][1]()
            graph = hj.trace(m.step, *m.abstract())
            for seed in tqdm(seeds, desc=model, unit="cluster"):
                topo, info = cluster(seed, doc["sites"])
                doc["rows"].append({"model": model, "seed": seed, "cluster": info,
                                    **run_one(graph, topo, seed=seed,
                                              head_n=doc.get("head_orders", 0))})
                with open(args.out, "w") as f:  # a run cut short keeps what it measured
                    json.dump(doc | {"seconds": done + time.time() - t0}, f, indent=1)
        doc["seconds"] = done + time.time() - t0
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    with open(args.md, "w") as f:
        f.write(report(doc, before))
    print(report(doc, before).split("## Per cluster")[0])


if __name__ == "__main__":
    main()
