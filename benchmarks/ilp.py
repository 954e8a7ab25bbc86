"""How the full ILP solves third-party model code: program size, LP bound, gap and seconds.

The project promises that ``strategy="ilp"`` is the cost model's exact optimum. On the real-model
families (``tests/realmodels/families.py``, **small**) it used to stop at the benchmarks' 10 s
limit with gaps of 10-17%. This script measures, per family x topology, the SPMD program ``ilp``
solves first (repeated layers tied, started from the best baseline that fits):

* **pairwise**: the program as it was at f5a9d0b, coupling every pair of two classes'
  candidates (``solve(..., aggregate=False)``);
* **parts**: the program as it is, coupling parts of candidates (candidates with equal edge
  costs that the shared layout changes' readings select alike): the same optimum and the same LP
  relaxation, from a program several times smaller;

each with ``time_limit`` seconds (10 by default, as ``benchmarks/rewrite.py`` and
``benchmarks/realmodels.py`` run ``ilp``): status, objective, the best proven bound, the gap,
branch-and-bound nodes, simplex iterations and seconds. Also the parts program's LP relaxation
(``relaxation_bound``: its optimum over fractional choices; equal to the integer optimum where
the relaxation is integral), the untied parts program (what ``ilp`` solves when a baseline shards
repeated layers differently and beats the tied plan), and ``auto``'s SPMD plan against the
proven optimum. The machine's load average is recorded per cell: seconds are noisy on shared
cores, nodes and gaps are not.

Results go to ``benchmarks/results/ilp.json`` and ``benchmarks/ILP.md``.

Usage::

    python benchmarks/ilp.py                      # 7 families on 2x4 and dgx-h100 x 2
    python benchmarks/ilp.py --families gpt2 --topologies 2x4 2x2x2 --time-limit 60
    python benchmarks/ilp.py --report-only
    python benchmarks/ilp.py --auto-only --families gpt2 vit --topologies 2x2x2   # auto again,
                                                  # against the optima already in the JSON
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # the families live in tests/realmodels

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import hulkjax as hj  # noqa: E402
from hulkjax.strategies.ilp import relaxation_bound, solve  # noqa: E402
from tests.realmodels import families  # noqa: E402
from tests.realmodels.measure import MESHES, source_commit  # noqa: E402

JSON_PATH = os.path.join(HERE, "results", "ilp.json")
MD_PATH = os.path.join(HERE, "ILP.md")
TOPOLOGIES = {
    "2x4": MESHES["2x4"],
    "dgx-h100x2": hj.Topology.preset("dgx-h100", nodes=2),
    "8": MESHES["8"],
    "2x2x2": MESHES["2x2x2"],
}
FORMULATIONS = {"pairwise": False, "parts": True}  # solve(aggregate=...)


def _result(r) -> dict:
    return {"status": r.status, "objective": r.objective, "bound": r.bound, "gap": r.gap,
            "variables": r.variables, "rows": r.rows, "classes": r.classes, "nodes": r.nodes,
            "iterations": r.iterations, "solve_time": r.solve_time, "build_time": r.build_time,
            "start": r.start, "start_objective": r.start_objective}


def measure(name: str, topologies, *, time_limit: float, formulations, untied_limit: float,
            auto: bool) -> list[dict]:
    step, state, batch = families.build(name, "small")
    args = jax.eval_shape(lambda s=state, b=batch: (s, b))
    del state, batch
    t0 = time.perf_counter()
    g = hj.trace(step, *args)
    trace_time = time.perf_counter() - t0
    rows = []
    for topo_name in topologies:
        topo = TOPOLOGIES[topo_name]
        row = {"family": name, "topology": topo_name, "nodes": len(g.nodes),
               "trace_time": trace_time, "load": os.getloadavg()[0], "time_limit": time_limit,
               "untied_limit": untied_limit}
        t0 = time.perf_counter()
        cm = hj.strategies.cost_model(g, topo)
        seeds = hj.strategies.baseline_assignments(g, topo)
        limit = cm.capacity
        fitting = [(cm.objective(a), k) for k, a in seeds.items() if cm.memory(a) <= limit]
        row["best_baseline"] = dict(zip(("objective", "name"), min(fitting))) if fitting else None
        row["setup_time"] = time.perf_counter() - t0
        # The relaxation first: its program build fills the cost model's caches, so that the
        # solves below build from warm caches alike.
        t0 = time.perf_counter()
        row["relaxation"] = {"bound": relaxation_bound(cm, seeds=seeds, time_limit=600.0),
                             "time": time.perf_counter() - t0}
        for f in formulations:
            r = solve(cm, seeds=seeds, time_limit=time_limit, aggregate=FORMULATIONS[f])
            row[f] = _result(r)
            print(f"{name} {topo_name} {f}: {r.summary()}", flush=True)
        if untied_limit > 0:
            r = solve(cm, seeds=seeds, time_limit=untied_limit, tie_layers=False)
            row["untied"] = _result(r)
            print(f"{name} {topo_name} untied: {r.summary()}", flush=True)
        if auto:
            row["auto"] = measure_auto(step, args, g, topo, cm)
            print(f"{name} {topo_name} auto: {_ms(row['auto']['objective'])}", flush=True)
        rows.append(row)
    return rows


def measure_auto(step, args, g, topo, cm) -> dict:
    """``auto``'s SPMD plan: its objective, wall and CPU seconds, the load, what it returned.
    Where it solved the whole program (``full_program``), also the plan it makes from the
    network's shortlist (``full_program=0``), as ``"shortlist"``: each then planned twice in
    turns (whole, shortlist, whole, shortlist), each time on a freshly traced graph (the cost
    model's tables are cached on a graph), and timed the second time (the process's own caches
    warm alike for both; whichever ran first used to be about 20% slower)."""
    def plan(graph, **options):
        t0, c0 = time.perf_counter(), time.process_time()
        p = hj.plan(step, *args, topology=topo, strategy="auto", graph=graph, stages=False,
                    **options)
        return {"objective": cm.objective(p.assignment), "time": time.perf_counter() - t0,
                "cpu_time": time.process_time() - c0, "load": os.getloadavg()[0],
                "source": p.source, "whole": "whole program" in p.notes[0]}

    out = plan(g)
    if out["whole"]:
        plan(hj.trace(step, *args), full_program=0)
        out = plan(hj.trace(step, *args))
        out["shortlist"] = plan(hj.trace(step, *args), full_program=0)
    return out


def remeasure_auto(rows: list[dict], names, topologies) -> None:
    """Plan ``auto`` again on the cells of ``rows`` (the ILP's results kept) in ``names`` x
    ``topologies``, replacing their ``auto`` entries."""
    for name in names:
        mine = [r for r in rows if r["family"] == name and r["topology"] in topologies]
        if not mine:
            continue
        jax.clear_caches()
        step, state, batch = families.build(name, "small")
        args = jax.eval_shape(lambda s=state, b=batch: (s, b))
        del state, batch
        g = hj.trace(step, *args)
        for row in mine:
            topo = TOPOLOGIES[row["topology"]]
            row["auto"] = measure_auto(step, args, g, topo, hj.strategies.cost_model(g, topo))
            best = row.get("parts") or row.get("pairwise")
            print(f"{name} {row['topology']} auto: {_ms(row['auto']['objective'])} "
                  f"({row['auto']['objective'] / best['objective']:.4f} of the ILP's, "
                  f"{row['auto']['cpu_time']:.1f} CPU s)", flush=True)


# ------------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------------


def _ms(t: float) -> str:
    """Seconds as milliseconds to four digits (bounds and optima differ in the third)."""
    return f"{t * 1e3:.4g} ms"


def _gap(r: dict) -> str:
    return f"{r['gap']:.2%}" if r["status"] == "optimal" else f"**{r['gap']:.2%}**"


def _cell(r: dict | None) -> list[str]:
    if r is None:
        return ["", "", "", "", "", ""]
    status = "optimal" if r["status"] == "optimal" else r["status"]
    return [f"{r['variables']:,}", status, _ms(r["bound"]), _gap(r), f"{r['nodes']}",
            f"{r['solve_time']:.1f}"]


def _gmean(xs) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def _summary(rows: list[dict], forms: list[str]) -> list[str]:
    lines = []
    limit = rows[0]["time_limit"]
    for f in forms:
        rs = [r for r in rows if f in r]
        if not rs:
            continue
        opt = [r for r in rs if r[f]["status"] == "optimal"]
        worst = max(rs, key=lambda r: r[f]["gap"])
        times = sorted(r[f]["solve_time"] for r in rs)
        lines.append(
            f"- **{f}**: {len(opt)}/{len(rs)} solved to proven optimality within {limit:g} s; "
            f"largest gap {worst[f]['gap']:.2%} ({worst['family']} {worst['topology']}); "
            f"variables {min(r[f]['variables'] for r in rs):,}-"
            f"{max(r[f]['variables'] for r in rs):,}; HiGHS seconds {times[0]:.1f}-"
            f"{times[-1]:.1f} (median {times[len(times) // 2]:.1f}).")
    both = [r for r in rows if all(f in r for f in FORMULATIONS)]
    if both:
        shrink = [r["pairwise"]["variables"] / r["parts"]["variables"] for r in both]
        lines.append(f"- **parts / pairwise**: {_gmean(shrink):.1f}x fewer variables (geometric "
                     f"mean, {min(shrink):.1f}-{max(shrink):.1f}x).")
        same = [r for r in both if r["pairwise"]["status"] == r["parts"]["status"] == "optimal"]
        if same:
            d = max(abs(r["pairwise"]["objective"] / r["parts"]["objective"] - 1) for r in same)
            lines.append(f"- Where both proved optimality ({len(same)} cells) their optima "
                         f"differ by at most {d:.1e} (relative; HiGHS's gap tolerance is 1e-4).")
    tight = [r for r in rows if "parts" in r and r["parts"]["status"] == "optimal"]
    if tight:
        rel = [max(0.0, (r["parts"]["objective"] - r["relaxation"]["bound"])
                   / r["parts"]["objective"]) for r in tight]
        loose = [f"{r['family']} {r['topology']} {x:.1e}" for r, x in zip(tight, rel) if x > 1e-6]
        closed = sum(r["parts"]["nodes"] <= 1 for r in tight)
        lines.append(f"- **LP relaxation** (parts): its bound equals the proven optimum (to 1e-6) "
                     f"in {len(tight) - len(loose)} of the {len(tight)} cells where parts proved it"
                     + (f"; below it in {', '.join(loose)} (relative)" if loose else "")
                     + f". HiGHS closed the gap at the root node in {closed} of them.")
    stopped = [r for r in rows if "parts" in r and r["parts"]["status"] != "optimal"
               and r["relaxation"]["bound"] > 0]
    for r in stopped:
        lb, obj = r["relaxation"]["bound"], r["parts"]["objective"]
        auto = r.get("auto", {}).get("objective")
        lines.append(f"- **{r['family']} {r['topology']}** (stopped): the LP relaxation bounds "
                     f"the tied program's optimum at {_ms(lb)} (solved in "
                     f"{r['relaxation']['time']:.0f} s, the program's build included); the "
                     f"ILP's plan, {_ms(obj)}, is within {1 - lb / obj:.2%} of it"
                     + (f", auto's, {_ms(auto)}, within "
                        f"{1 - lb / auto:.2%}" if auto and auto >= lb else
                        f"; auto's plan, {_ms(auto)} with layers untied, is below it" if auto
                        else "") + ".")
    au = [r for r in rows if "auto" in r and "parts" in r and r["parts"]["status"] == "optimal"]
    if au:
        ratios = [r["auto"]["objective"] / r["parts"]["objective"] for r in au]
        below = [r for r, x in zip(au, ratios) if x < 1 - 1e-5]
        lines.append(f"- **auto / ILP** (SPMD plans, predicted step time, against the proven "
                     f"tied optimum): median {sorted(ratios)[len(ratios) // 2]:.4f}, range "
                     f"{min(ratios):.4f}-{max(ratios):.4f} over {len(au)} cells"
                     + (f"; below 1 in {', '.join(r['family'] + ' ' + r['topology'] for r in below)}"
                        f" (auto's descent unties repeated layers; see the untied program)"
                        if below else "")
                     + f". auto took {min(r['auto']['time'] for r in au):.1f}-"
                     f"{max(r['auto']['time'] for r in au):.1f} s"
                     + (f" ({min(r['auto']['cpu_time'] for r in au):.1f}-"
                        f"{max(r['auto']['cpu_time'] for r in au):.1f} CPU s)"
                        if all("cpu_time" in r["auto"] for r in au) else "") + ".")
    whole = [r for r in rows if "shortlist" in r.get("auto", {})]
    if whole:
        a_s = sum(r["auto"]["cpu_time"] for r in whole)
        s_s = sum(r["auto"]["shortlist"]["cpu_time"] for r in whole)
        same = sum(math.isclose(r["auto"]["objective"], r["auto"]["shortlist"]["objective"],
                                rel_tol=1e-9) for r in whole)
        per = [r["auto"]["cpu_time"] / r["auto"]["shortlist"]["cpu_time"] for r in whole]
        lines.append(f"- **auto, whole program or shortlist**: auto solved the whole program "
                     f"(small: `full_program`) in {len(whole)} of the {len(rows)} cells; there "
                     f"it took {a_s:.1f} CPU s in all against {s_s:.1f} from the network's "
                     f"shortlist and its neighbourhood rounds (`full_program=0`; per cell "
                     f"{min(per):.2f}-{max(per):.2f}x, geometric mean {_gmean(per):.2f}x), the "
                     f"same predicted step in {same} of them.")
    un = [r for r in rows if "untied" in r]
    if un:
        opt = [r for r in un if r["untied"]["status"] == "optimal"]
        cheaper = [r for r in opt if "parts" in r and r["parts"]["status"] == "optimal"
                   and r["untied"]["objective"] < r["parts"]["objective"] * (1 - 1e-4)]
        lines.append(f"- **untied** (parts, every group its own decision): {len(opt)}/{len(un)} "
                     f"optimal within {un[0]['untied_limit']:g} s; variables "
                     f"{min(r['untied']['variables'] for r in un):,}-"
                     f"{max(r['untied']['variables'] for r in un):,}; its optimum below the "
                     f"tied one by more than 1e-4 in "
                     + (", ".join(f"{r['family']} {r['topology']} "
                                  f"({1 - r['untied']['objective'] / r['parts']['objective']:.2%})"
                                  for r in cheaper) or "none")
                     + " of the cells where both proved optimality.")
    return lines


def markdown(result: dict) -> str:
    runs, rows = result["runs"], result["rows"]
    forms = [f for f in FORMULATIONS if any(f in r for r in rows)]
    lines = [
        "# The full ILP on third-party model code",
        "",
        "Generated by "
        + "; then ".join(f"`{m['command']}` on {m['date']} (commit `{m['commit']}`, "
                         f"{m['elapsed'] / 60:.0f} min wall)" for m in runs)
        + f" (jax {jax.__version__}; a {runs[-1]['cpus']}-core machine shared with other work: "
        "the load average at each cell is in the last table). Families: "
        "`tests/realmodels/families.py`, **small** configurations (4 layers, width 256, "
        "sequence 128, batch 16). Topologies: `2x4` (the 2 x 4 fake-CPU mesh of "
        "`tests/realmodels/measure.py`), `dgx-h100x2` (`Topology.preset(\"dgx-h100\", "
        "nodes=2)`, 2 x 8 H100), `8` and `2x2x2` (the other meshes of `measure.py`). One HiGHS "
        "thread; the time limit per solve is in the tables.",
        "",
        "The program is the SPMD one `strategy=\"ilp\"` solves (`hulkjax.strategies.ilp.solve`: "
        "repeated layers tied, warm-started from the best baseline that fits). **pairwise**: "
        "every pair of two joined classes' candidates coupled, the program as it was at "
        "f5a9d0b (`solve(..., aggregate=False)`). "
        "**parts**: parts of candidates coupled (candidates with equal edge costs that the "
        "shared layout changes' readings select alike): the same optimum and LP relaxation "
        "(tested), from a smaller program. **LP bound**: the optimum of the parts program's LP "
        "relaxation (fractional choices; the integer optimum where it equals the objective). "
        "**bound**: the best bound HiGHS proved in the time (the sum of every class's cheapest "
        "own time where it proved none); gap = (objective - bound) / objective, bold where the "
        "time limit stopped the solve. **nodes**: branch-and-bound nodes (1: solved at the "
        "root; 0: stopped before the root LP finished). Seconds are HiGHS's, the program's "
        "build apart (**build s**: the parts program's, the cost model's tables warm).",
        "",
        "## Summary",
    ]
    for limit in sorted({r["time_limit"] for r in rows}):
        group = [r for r in rows if r["time_limit"] == limit]
        cells = sorted({r["topology"] for r in group})
        lines += ["", f"**{len(group)} cells** ({', '.join(cells)}), `time_limit={limit:g}` s:", ""]
        lines += _summary(group, forms)
    head = ["family", "topology", "limit s"]
    for f in forms:
        head += [f"{f} variables", f"{f} status", f"{f} bound", f"{f} gap", f"{f} nodes",
                 f"{f} s"]
    lines += ["", "## Per family and topology", "",
              "Objective: the best plan's predicted step time (of the parts program where it "
              "proved optimality).", "",
              "| " + " | ".join(head + ["build s", "objective", "LP bound"]) + " |",
              "|" + "---|" * 2 + "---:|" * (len(head) - 2 + 3)]
    for r in rows:
        best = r.get("parts") or r.get("pairwise")
        cells = [r["family"], r["topology"], f"{r['time_limit']:g}"]
        for f in forms:
            cells += _cell(r.get(f))
        cells += [f"{best['build_time']:.1f}", _ms(best["objective"]),
                  _ms(r["relaxation"]["bound"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Starts, untied layers, auto and load", "",
              "**auto**: its SPMD plan (`stages=False`), wall and CPU seconds, and the load "
              "average when it was planned (`--auto-only` plans it again and keeps the ILP's "
              "results, so its load may differ from the cell's). Where it solved the whole "
              "program (small: `full_program`), also its plan from the network's shortlist "
              "(`full_program=0`) and that plan's CPU seconds.", "",
              "| family | topology | best baseline | start (parts) | untied variables | untied "
              "status | untied objective | untied gap | untied s | auto | auto / ILP | auto s "
              "| auto CPU s | auto from the shortlist | its CPU s | load | auto's load |",
              "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        best = r.get("parts") or r.get("pairwise")
        bb = r["best_baseline"]
        u = r.get("untied")
        a = r.get("auto")
        lines.append("| " + " | ".join([
            r["family"], r["topology"],
            f"{bb['name']} {_ms(bb['objective'])}" if bb else "none fits",
            f"{best['start']} {_ms(best['start_objective'])}",
            f"{u['variables']:,}" if u else "", u["status"] if u else "",
            _ms(u["objective"]) if u else "", _gap(u) if u else "",
            f"{u['solve_time']:.1f}" if u else "",
            _ms(a["objective"]) if a else "",
            f"{a['objective'] / best['objective']:.4f}" if a else "",
            f"{a['time']:.1f}" if a else "",
            f"{a['cpu_time']:.1f}" if a and "cpu_time" in a else "",
            _ms(a["shortlist"]["objective"]) if a and "shortlist" in a else "",
            f"{a['shortlist']['cpu_time']:.1f}" if a and "shortlist" in a else "",
            f"{r['load']:.1f}",
            f"{a['load']:.1f}" if a and "load" in a else ""]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", nargs="+", default=families.names(), choices=families.names())
    ap.add_argument("--topologies", nargs="+", default=["2x4", "dgx-h100x2"],
                    choices=list(TOPOLOGIES))
    ap.add_argument("--formulations", nargs="+", default=list(FORMULATIONS),
                    choices=list(FORMULATIONS))
    ap.add_argument("--time-limit", type=float, default=10.0, help="seconds per solve")
    ap.add_argument("--untied-limit", type=float, default=30.0,
                    help="seconds for the untied program (0: skip it)")
    ap.add_argument("--no-auto", action="store_true", help="skip auto's plan")
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite ILP.md from the existing JSON")
    ap.add_argument("--auto-only", action="store_true",
                    help="plan auto again on these cells of the existing JSON, keeping the ILP's")
    ap.add_argument("--merge", action="store_true",
                    help="replace or add these cells in the existing JSON, keeping the others")
    ap.add_argument("--out", default=JSON_PATH)
    ap.add_argument("--md", default=MD_PATH)
    args = ap.parse_args(argv)
    if args.report_only:
        with open(args.out) as f:
            result = json.load(f)
    elif args.auto_only:
        t0 = time.perf_counter()
        with open(args.out) as f:
            result = json.load(f)
        remeasure_auto(result["rows"], [n for n in args.families if families.available(n)],
                       args.topologies)
        result["runs"].append({
            "date": time.strftime("%Y-%m-%d"), "commit": source_commit(ROOT),
            "command": " ".join(["python benchmarks/ilp.py", *(sys.argv[1:] if argv is None
                                                               else argv)]),
            "cpus": os.cpu_count(), "elapsed": time.perf_counter() - t0})
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    else:
        t0 = time.perf_counter()
        names = [n for n in args.families if families.available(n)]
        rows = []
        for name in names:
            jax.clear_caches()
            rows += measure(name, args.topologies, time_limit=args.time_limit,
                            formulations=args.formulations, untied_limit=args.untied_limit,
                            auto=not args.no_auto)
        run = {"date": time.strftime("%Y-%m-%d"), "commit": source_commit(ROOT),
               "command": " ".join(["python benchmarks/ilp.py",
                                    *(sys.argv[1:] if argv is None else argv)]),
               "cpus": os.cpu_count(), "elapsed": time.perf_counter() - t0}
        result = {"runs": [run], "rows": rows}
        if args.merge and os.path.exists(args.out):
            with open(args.out) as f:
                old = json.load(f)
            new = {(r["family"], r["topology"]) for r in rows}
            result = {"runs": old["runs"] + [run],
                      "rows": [r for r in old["rows"] if (r["family"], r["topology"]) not in new]
                      + rows}
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    with open(args.md, "w") as f:
        f.write(markdown(result))
    print(f"wrote {args.out} and {args.md}")


if __name__ == "__main__":
    main()
