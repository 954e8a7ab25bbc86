"""The cost-model sweep: plan every zoo model on every topology preset with every strategy.

Each (model, topology, strategy) is planned abstractly: the step is traced once per model on
``ShapeDtypeStruct`` arguments (``model.abstract()``) and ``hj.plan(..., graph=g)`` runs the
planner; nothing is compiled or run. Every number is the cost model's prediction (``plan.cost``):
step / compute / communication time, efficiency against perfect scaling, peak memory per device,
communication by mesh axis and by link class, plus planning time and, for ``ilp``, what the solver
did. Results go to ``benchmarks/results/sweep.json`` and ``benchmarks/RESULTS.md`` (generated from
the JSON alone, so ``--report-only`` rewrites the markdown without planning again).

Usage::

    python benchmarks/sweep.py                      # full sweep -> results/sweep.json + RESULTS.md
    python benchmarks/sweep.py --quick              # small subset -> results/sweep-subset.json, md to stdout
    python benchmarks/sweep.py --models gpt2-small --topologies dgx-h100x2 --strategies dp ilp
    python benchmarks/sweep.py --report-only        # RESULTS.md from the existing sweep.json
    python benchmarks/sweep.py --list               # the model, topology and strategy keys

A run with a filter (or ``--quick``) writes ``results/sweep-subset.json`` and prints its markdown
instead of overwriting the full results, unless ``--out`` / ``--md`` say otherwise. ``--time-limit``
overrides the ILP's time limit (default: the planner's own default). Failures of one combination
are recorded (``status`` ``"n/a"``, ``"infeasible"`` or ``"error"`` with the message) and the sweep
goes on. Searching planners (``ilp``, and ``auto`` when registered) plan on a freshly traced graph so
that their planning time includes building the cost model, as a first ``hj.plan`` call pays.

hulkjax is imported once; if its sources change while the sweep runs, it warns and says so in the
JSON and the markdown. To benchmark one commit while the working tree is being edited, run from a
clone: ``git clone -q . "$D" && cp benchmarks/sweep.py "$D/benchmarks/" && cd "$D" &&
PYTHONPATH="$D" python benchmarks/sweep.py`` (then copy ``RESULTS.md`` and ``results/sweep.json``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
import warnings
from collections import defaultdict

import jax
from tqdm import tqdm

import hulkjax as hj
from hulkjax import zoo

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(HERE, "results")
FULL_JSON = os.path.join(RESULTS_DIR, "sweep.json")
SUBSET_JSON = os.path.join(RESULTS_DIR, "sweep-subset.json")
FULL_MD = os.path.join(HERE, "RESULTS.md")

# key -> (zoo name, size). Zoo defaults for everything else (batch size included).
MODELS: dict[str, tuple[str, str]] = {
    "mlp-small": ("mlp", "small"),
    "gpt2-small": ("gpt2", "small"),
    "gpt2-medium": ("gpt2", "medium"),
    "bert-base": ("bert", "base"),
    "vit-base": ("vit", "base"),
    "moe-small": ("moe", "small"),
    "resnet-50": ("resnet", "50"),
}

# key -> (preset name, preset arguments).
TOPOLOGIES: dict[str, tuple[str, dict]] = {
    "dgx-h100x1": ("dgx-h100", {"nodes": 1}),
    "dgx-h100x2": ("dgx-h100", {"nodes": 2}),
    "tpu-v5e-4x4": ("tpu-v5e", {"shape": (4, 4)}),
    # 3 regions x 2 nodes x 2 V100: a mesh whose axes cross all three link classes
    # (NVLink inside a node, cloud Ethernet between nodes, WAN between regions).
    "geo-3r": ("geo", {"regions": 3, "gpus_per_region": 4, "nodes_per_region": 2}),
    "hetero": ("hetero", {}),
}

QUICK = {"models": ["mlp-small", "gpt2-small"], "topologies": ["dgx-h100x2", "geo-3r"]}

# Planners that search the cost model; every other registered strategy is a fixed baseline.
SEARCHERS = ("ilp", "auto")
SEARCHER_PROMISE = {"ilp": "the baselines' plans are in the ILP's search space",
                    "auto": "auto scores the baselines too and keeps the best"}
# What the link classes of Cost.link_class mean, for the report.
LINK_CLASS_DOC = {"node": "inside a node", "region": "between nodes of a region",
                  "wan": "between regions"}


# ------------------------------------------------------------------------------------ running

def source_digest() -> str:
    """A digest of hulkjax's Python sources: tells whether the library changed during a run."""
    root = os.path.dirname(os.path.abspath(hj.__file__))
    h = hashlib.sha256()
    for dirpath, dirnames, files in os.walk(root):
        dirnames.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(dirpath, name)
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:12]


def machine_info() -> dict:
    """Where and with what the sweep ran."""
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=os.path.dirname(HERE), capture_output=True,
                                  text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    import jaxlib
    import scipy

    dirty = git("status", "--porcelain", "--", "hulkjax")
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "scipy": scipy.__version__,
        "hulkjax": hj.__version__,
        "git_commit": git("rev-parse", "--short", "HEAD"),
        "hulkjax_dirty": bool(dirty) if dirty is not None else None,
        "hulkjax_source_digest": source_digest(),
    }


def ilp_default_time_limit() -> float | None:
    """The ILP planner's own default ``time_limit`` (from its registered options)."""
    from hulkjax.strategies.registry import options_of
    return getattr(options_of("ilp"), "time_limit", None)


def topology_info(key: str, topo) -> dict:
    """The topology's mesh, devices and per-axis links."""
    kinds: dict[str, int] = defaultdict(int)
    for d in topo.devices:
        kinds[d.spec.kind] += 1
    preset, kwargs = TOPOLOGIES[key]
    return {
        "key": key, "name": topo.name, "preset": preset,
        "kwargs": {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()},
        "axis_names": list(topo.axis_names), "shape": list(topo.shape),
        "num_devices": topo.num_devices, "device_kinds": dict(kinds),
        "axes": {a: {"bandwidth": topo.axis_link(a).bandwidth, "latency": topo.axis_link(a).latency}
                 for a in topo.axis_names},
    }


def by_link_class(per_axis: dict, link_class: dict) -> dict:
    """Sum a ``{mesh axis: value}`` dict over the link class each axis crosses."""
    out: dict[str, float] = defaultdict(float)
    for axis, value in per_axis.items():
        out[link_class.get(axis, axis)] += float(value)
    return dict(out)


def solver_info(plan) -> dict | None:
    s = getattr(plan, "solver", None)
    if s is None:
        return None
    return {k: getattr(s, k, None) for k in ("status", "objective", "bound", "gap", "solve_time",
                                              "build_time", "variables", "classes")}


def plan_row(plan) -> dict:
    """The recorded numbers of one plan."""
    c = plan.cost
    cap = c.memory_capacity
    return {
        "status": "ok",
        "step_time": c.step_time, "compute_time": c.compute_time, "comm_time": c.comm_time,
        "bubble": c.bubble, "ideal_time": c.ideal_time, "efficiency": c.efficiency,
        "peak_memory": c.peak_memory, "memory_capacity": None if math.isinf(cap) else cap,
        "fits": c.fits, "memory_breakdown": dict(c.memory_breakdown),
        "link_class": dict(c.link_class),
        "comm_time_by_axis": dict(c.comm_time_by_axis), "comm_bytes": dict(c.comm_bytes),
        "comm_time_by_link": by_link_class(c.comm_time_by_axis, c.link_class),
        "comm_bytes_by_link": by_link_class(c.comm_bytes, c.link_class),
        "collectives": [{"kind": k.kind, "axes": list(k.axes), "count": k.count,
                         "bytes": k.bytes, "time": k.time} for k in c.collectives],
        "planning_time": plan.planning_time,
        "optimizer_apart": plan.optimizer_apart,
        "notes": list(plan.notes),
        "solver": solver_info(plan),
    }


def run_one(m, state, batch, graph, topo, strategy: str, options: dict) -> dict:
    """Plan one combination; never raises (failures become rows)."""
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            p = hj.plan(m.step, state, batch, topology=topo, strategy=strategy, graph=graph,
                        **options)
            row = plan_row(p)
        except hj.errors.StrategyNotApplicableError as e:
            row = {"status": "n/a", "message": str(e)}
        except hj.errors.InfeasiblePlanError as e:
            row = {"status": "infeasible", "message": str(e)}
        except Exception as e:  # noqa: BLE001  (recorded and reported, the sweep goes on)
            row = {"status": "error", "message": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc()}
    row["wall_time"] = time.perf_counter() - t0
    row["warnings"] = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    return row


def sweep(models: list[str], topologies: list[str], strategies: list[str],
          time_limit: float | None) -> dict:
    """Plan every combination; returns the JSON document."""
    from hulkjax.strategies.realize import cost_model  # the cache hj.plan uses

    t_start = time.perf_counter()
    topos = {k: hj.Topology.preset(TOPOLOGIES[k][0], **TOPOLOGIES[k][1]) for k in topologies}
    doc = {"meta": machine_info() | {
               "command": "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
               "ilp_time_limit": time_limit if time_limit is not None else ilp_default_time_limit(),
               "ilp_time_limit_source": "--time-limit" if time_limit is not None else "default"},
           "models": [], "topologies": [topology_info(k, t) for k, t in topos.items()],
           "strategies": strategies, "rows": []}
    bar = tqdm(total=len(models) * len(topologies) * len(strategies), unit="plan",
               dynamic_ncols=True)
    for mk in models:
        name, size = MODELS[mk]
        bar.set_postfix_str(f"{mk}: trace")
        m = zoo.get(name, size=size)
        state, batch = m.abstract()
        jax.clear_caches()
        t0 = time.perf_counter()
        graph = hj.trace(m.step, state, batch)
        trace_s = time.perf_counter() - t0
        doc["models"].append({"key": mk, "name": name, "size": size, "params": m.param_count(),
                              "batch": getattr(m.config, "batch", None),
                              "dtype": m.config.dtype, "graph_nodes": len(graph.nodes),
                              "trace_time": trace_s})
        for tk, topo in topos.items():
            # Build the baselines' shared cost model first, so their planning times exclude it.
            bar.set_postfix_str(f"{mk} / {tk}: cost model")
            t0 = time.perf_counter()
            cost_model(graph, topo)
            cm_s = time.perf_counter() - t0
            for st in strategies:
                bar.set_postfix_str(f"{mk} / {tk} / {st}")
                opts = {"time_limit": time_limit} if st == "ilp" and time_limit is not None else {}
                row = {"model": mk, "topology": tk, "strategy": st, "cost_model_time": cm_s}
                if st in SEARCHERS:
                    # A fresh graph: no cost-model cache from the other planners, so the
                    # planning time is what a first hj.plan(strategy=st) pays (tracing excluded).
                    fresh = hj.trace(m.step, state, batch)
                    row |= run_one(m, state, batch, fresh, topo, st, opts) | {"fresh_graph": True}
                    del fresh
                    gc.collect()  # its cost model's tables: GBs for a 3-axis mesh
                else:
                    row |= run_one(m, state, batch, graph, topo, st, opts)
                doc["rows"].append(row)
                if row["status"] == "error":
                    tqdm.write(f"error: {mk} / {tk} / {st}: {row['message']}")
                bar.update()
            graph.memo.get("cost_models", {}).pop(topo, None)  # done with this topology
            gc.collect()
        del graph, state, batch, m
        gc.collect()
    bar.close()
    doc["meta"]["total_time"] = time.perf_counter() - t_start
    # The modules were imported at the start; edits made since then are not in these numbers.
    doc["meta"]["source_changed_during_run"] = source_digest() != doc["meta"]["hulkjax_source_digest"]
    if doc["meta"]["source_changed_during_run"]:
        print("warning: hulkjax's sources changed during the sweep; the results are for the code "
              "as imported at the start (see meta.hulkjax_source_digest). Run it again.",
              file=sys.stderr)
    return doc


# ------------------------------------------------------------------------------------ report

def ms(seconds: float) -> str:
    v = seconds * 1e3
    return f"{v:,.0f}" if v >= 1000 else f"{v:.3g}"


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g}"


def nice_bytes(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def secs(s: float) -> str:
    return f"{s:.3g}" if s < 100 else f"{s:.0f}"


def table(header: list[str], rows: list[list[str]], align: str | None = None) -> list[str]:
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    return ["| " + " | ".join(header) + " |", "|" + "|".join(sep) + "|",
            *("| " + " | ".join(r) + " |" for r in rows), ""]


class Results:
    """Index over the JSON rows."""

    def __init__(self, doc: dict):
        self.doc = doc
        self.models = [m["key"] for m in doc["models"]]
        self.topologies = [t["key"] for t in doc["topologies"]]
        self.strategies = list(doc["strategies"])
        self.baselines = [s for s in self.strategies if s not in SEARCHERS]
        self.searchers = [s for s in self.strategies if s in SEARCHERS]
        # Baselines whose plans lay optimizer state out apart from its parameter (zero's) are of
        # the cost model with optimizer_apart, outside the space the default ilp / auto search
        # (their optimizer_apart option searches it): the searchers are held against the other
        # baselines, and against these in a section of their own.
        self.apart = [s for s in self.baselines
                      if any(r["strategy"] == s and r.get("optimizer_apart") for r in doc["rows"])]
        self.rivals = [s for s in self.baselines if s not in self.apart]
        self.rows = {(r["model"], r["topology"], r["strategy"]): r for r in doc["rows"]}
        self.model_info = {m["key"]: m for m in doc["models"]}
        self.topo_info = {t["key"]: t for t in doc["topologies"]}

    def get(self, model, topo, strategy) -> dict | None:
        return self.rows.get((model, topo, strategy))

    def ok(self, model, topo, strategy) -> dict | None:
        r = self.get(model, topo, strategy)
        return r if r is not None and r["status"] == "ok" else None

    def best_baseline(self, model, topo, *, fitting: bool = True) -> tuple[str, dict] | None:
        """The fastest baseline plan in the searchers' space (among those that fit memory, by
        default): :attr:`rivals`, not the baselines that lay state apart (:attr:`apart`)."""
        cands = [(s, r) for s in self.rivals if (r := self.ok(model, topo, s))
                 and (r["fits"] or not fitting)]
        return min(cands, key=lambda sr: sr[1]["step_time"]) if cands else None


def status_cell(r: dict | None) -> str | None:
    if r is None:
        return "—"
    if r["status"] != "ok":
        return {"n/a": "n/a", "infeasible": "infeasible", "error": "**error**"}[r["status"]]
    return None


def anomalies(res: Results) -> list[str]:
    """Findings a person should look at, from the rows alone."""
    out = []
    for (mk, tk, st), r in res.rows.items():
        where = f"{mk} / {tk} / {st}"
        if r["status"] == "error":
            out.append(f"**error** {where}: `{r['message'].splitlines()[0][:300]}`")
            continue
        if r["status"] != "ok":
            continue
        topo = res.topo_info[tk]
        if st in res.baselines and st != "replicate" and topo["num_devices"] > 1 \
                and r["comm_time"] == 0:
            # A searcher may rightly choose to replicate; a sharding baseline should shard.
            same = res.ok(mk, tk, "replicate")
            tail = (" and the same step time as `replicate`: nothing is sharded"
                    if same and math.isclose(same["step_time"], r["step_time"], rel_tol=1e-9)
                    else "")
            out.append(f"zero communication: {where} predicts no collective at all on "
                       f"{topo['num_devices']} devices{tail} (notes: "
                       f"{'; '.join(r['notes'][:2])[:300] or 'none'})")
        for axis, t in r["comm_time_by_axis"].items():
            if (t > 0) != (r["comm_bytes"].get(axis, 0) > 0):
                out.append(f"time/bytes mismatch: {where} axis `{axis}` has {ms(t)} ms but "
                           f"{nice_bytes(r['comm_bytes'].get(axis, 0))}")
        # (a staged step: the busiest group's compute and communication, and its bubble)
        if not math.isclose(r["compute_time"] + r["comm_time"] + r.get("bubble", 0.0),
                            r["step_time"], rel_tol=1e-6):
            out.append(f"step != compute + comm + bubble: {where}")
        if r["step_time"] < r["ideal_time"] * (1 - 1e-9):
            out.append(f"faster than ideal: {where} ({ms(r['step_time'])} < "
                       f"{ms(r['ideal_time'])} ms)")
        if r["warnings"]:
            out.append(f"warnings in {where}: " + "; ".join(f"`{w[:200]}`" for w in r["warnings"]))
        if st in res.searchers:
            best = res.best_baseline(mk, tk)
            if best and r["step_time"] > best[1]["step_time"] * (1 + 1e-6):
                out.append(f"**{st} worse than a baseline**: {where} {ms(r['step_time'])} ms > "
                           f"{best[0]} {ms(best[1]['step_time'])} ms")
            if not r["fits"]:
                out.append(f"**{st} plan does not fit memory**: {where}")
            s = r.get("solver")
            if s and s.get("status") != "optimal":
                out.append(f"{where}: solver stopped at `{s.get('status')}`, gap {s['gap']:.2%}")
    for tk in res.topologies:
        for mk in res.models:
            for st in res.searchers:
                r = res.get(mk, tk, st)
                if r is None or r["status"] != "infeasible":
                    continue
                over = [s for s in res.rivals if (b := res.ok(mk, tk, s)) and b["fits"]]
                if over:
                    out.append(f"**{st} infeasible but baselines fit**: {mk} / {tk} "
                               f"({', '.join(over)})")
    return out


def render(doc: dict, json_path: str = FULL_JSON) -> str:
    """RESULTS.md from the sweep JSON (``json_path``: where it is, for the intro)."""
    res = Results(doc)
    meta = doc["meta"]
    L: list[str] = ["# Cost-model sweep", ""]
    repo = os.path.dirname(HERE)
    shown = os.path.relpath(json_path, repo)
    shown = os.path.abspath(json_path) if shown.startswith("..") else shown
    commit = meta.get("git_commit") or "?"
    dirty = " with uncommitted changes under hulkjax/" if meta.get("hulkjax_dirty") else ""
    dirty += f" (source digest `{meta['hulkjax_source_digest']}`)"
    L += [f"Generated by `{meta['command']}` (`benchmarks/sweep.py`, regenerate the markdown alone "
          f"with `python benchmarks/sweep.py --report-only`) on {meta['date']}: hulkjax "
          f"{meta['hulkjax']} at commit `{commit}`{dirty}, jax {meta['jax']}, scipy "
          f"{meta['scipy']}, Python {meta['python']}, {meta['cpus']} CPUs ({meta['processor']}). "
          f"{len(doc['rows'])} plans in {secs(meta['total_time'])} s. Raw numbers: "
          f"`{shown}`.", ""]
    if meta.get("source_changed_during_run"):
        L += ["> **Warning:** hulkjax's sources changed while this sweep ran; the numbers are for "
              "the code as imported at its start. Run the sweep again.", ""]
    L += ["Every number is the **cost model's prediction** for one training step (nothing is "
          "compiled or run): step time = compute (roofline at the slowest device's pace) + "
          "communication (alpha-beta per mesh axis, no overlap). Models use their zoo defaults "
          "(float32, AdamW, the batch below); steps are traced once per model on abstract "
          f"arguments. The ILP ran with `time_limit={meta['ilp_time_limit']}` s "
          f"({meta['ilp_time_limit_source']}).", ""]

    L += ["## Models", ""]
    L += table(["model", "params", "batch", "graph nodes", "trace (s)"],
               [[mk, f"{m['params'] / 1e6:.1f}M", str(m["batch"]), f"{m['graph_nodes']:,}",
                 secs(m["trace_time"])] for mk, m in res.model_info.items()])
    L += ["## Topologies", ""]
    rows = []
    for tk, t in res.topo_info.items():
        link = {}
        for (_, tk2, _), r in res.rows.items():
            if tk2 == tk and r["status"] == "ok":
                link = r["link_class"]
                break
        axes = ", ".join(f"`{a}`={n} ({link.get(a, '?')}, {t['axes'][a]['bandwidth'] / 1e9:.3g} GB/s, "
                         f"{t['axes'][a]['latency'] * 1e6:.3g} µs)"
                         for a, n in zip(t["axis_names"], t["shape"]))
        kinds = " + ".join(f"{n} x {k}" for k, n in t["device_kinds"].items())
        args = ", ".join(f"{k}={v}" for k, v in t["kwargs"].items())
        rows.append([tk, f"`preset(\"{t['preset']}\"{', ' if args else ''}{args})`", kinds, axes])
    L += table(["topology", "preset", "devices", "mesh axes (link class, bandwidth, latency)"], rows,
               "llll")
    L += ["Link classes (`plan.cost.link_class`): " + "; ".join(
        f"`{k}` = {v}" for k, v in LINK_CLASS_DOC.items()) + ".", ""]

    # -- step time per topology
    L += ["## Predicted step time (ms)", "",
          "Per topology; rows are models, columns strategies. **Bold**: the fastest plan that fits "
          "device memory. † the plan does not fit memory. n/a: the strategy does not apply to the "
          "mesh; infeasible: no plan fits memory.", ""]
    for tk in res.topologies:
        t = res.topo_info[tk]
        L += [f"### {tk} ({t['num_devices']} devices, mesh "
              f"{' x '.join(f'{a}={n}' for a, n in zip(t['axis_names'], t['shape']))})", ""]
        rows = []
        for mk in res.models:
            fitting = [(s, r) for s in res.strategies if (r := res.ok(mk, tk, s)) and r["fits"]]
            best = min(r["step_time"] for _, r in fitting) if fitting else None
            cells = [mk]
            for s in res.strategies:
                r = res.get(mk, tk, s)
                cell = status_cell(r)
                if cell is None:
                    cell = ms(r["step_time"])
                    if not r["fits"]:
                        cell += " †"
                    elif best is not None and math.isclose(r["step_time"], best, rel_tol=1e-9):
                        cell = f"**{cell}**"
                cells.append(cell)
            planned = [r for s in res.strategies if (r := res.ok(mk, tk, s))]
            cells.append(ms(planned[0]["ideal_time"]) if planned else "—")
            rows.append(cells)
        L += table(["model", *res.strategies, "ideal"], rows)

    # -- searchers vs the best baseline
    for st in res.searchers:
        L += [f"## {st.upper() if st == 'ilp' else st} vs best baseline per topology", "",
              f"`{st}` step time / the fastest baseline that fits memory ({', '.join(res.rivals)})"
              ". Below 1 is better; above 1 would be a bug (" + SEARCHER_PROMISE.get(st, "") +
              "). Cells: ratio, then the solver's time and optimality gap where there is a solver."
              + (f" {', '.join(f'`{a}`' for a in res.apart)} lays optimizer state out apart from "
                 f"its parameter, outside `{st}`'s default space: see the section on it below."
                 if res.apart else ""), ""]
        rows = []
        for mk in res.models:
            cells = [mk]
            for tk in res.topologies:
                r = res.get(mk, tk, st)
                best = res.best_baseline(mk, tk)
                cell = status_cell(r)
                if cell is None:
                    if best is None:
                        cell = "no baseline fits"
                    else:
                        cell = f"{r['step_time'] / best[1]['step_time']:.3f}"
                    s = r.get("solver")
                    if s:
                        cell += f" ({secs(s['solve_time'])} s, {s['gap']:.2%})"
                cells.append(cell)
            rows.append(cells)
        geo = []
        for tk in res.topologies:
            ratios = [r["step_time"] / b[1]["step_time"] for mk in res.models
                      if (r := res.ok(mk, tk, st)) and (b := res.best_baseline(mk, tk))]
            geo.append(f"**{math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}**"
                       if ratios else "—")
        rows.append(["geometric mean", *geo])
        L += table(["model", *res.topologies], rows)
        L += [f"Detail (best baseline, `{st}` plan):", ""]
        rows = []
        for tk in res.topologies:
            for mk in res.models:
                r = res.get(mk, tk, st)
                best = res.best_baseline(mk, tk)
                cell = status_cell(r)
                s = (r or {}).get("solver") or {}
                rows.append([tk, mk,
                             f"{best[0]} {ms(best[1]['step_time'])}" if best else "none fits",
                             cell or ms(r["step_time"]),
                             f"{r['step_time'] / best[1]['step_time']:.3f}"
                             if cell is None and best else "—",
                             cell or f"{r['efficiency']:.1%}",
                             s.get("status", "—"), secs(s["solve_time"]) if s else "—",
                             f"{s['gap']:.2%}" if s else "—",
                             f"{s['variables']:,}" if s.get("variables") else "—"])
        L += table(["topology", "model", "best baseline (ms)", f"{st} (ms)", "ratio",
                    "efficiency", "solver", "solve (s)", "gap", "variables"], rows, "ll" + "r" * 8)

    # -- the searchers against the plans outside their default space
    for a in res.apart:
        L += [f"## `{a}` against the searchers", "",
              f"`{a}` lays optimizer state out apart from its parameter: a plan of the cost model "
              "with `optimizer_apart`, which the default `ilp` and `auto` do not search (with "
              "`optimizer_apart=True` they do: `benchmarks/OPTIMIZER_APART.md`). Cells: each "
              f"searcher's step time / `{a}`'s (where both fit memory); above 1, `{a}`'s plan is "
              "the faster one.", ""]
        rows = []
        for mk in res.models:
            cells = [mk]
            for tk in res.topologies:
                z = res.ok(mk, tk, a)
                cells.append(" / ".join(
                    f"{r['step_time'] / z['step_time']:.3f}"
                    if z and z["fits"] and (r := res.ok(mk, tk, st)) and r["fits"] else "—"
                    for st in res.searchers))
            rows.append(cells)
        L += table(["model", *(f"{tk} ({' / '.join(res.searchers)})" for tk in res.topologies)],
                   rows)

    # -- planning time
    L += ["## Planning time (s)", "",
          f"`plan.planning_time` (tracing excluded). Searching planners ({', '.join(res.searchers)}) "
          "plan on a freshly traced graph, so their time is what a first `hj.plan` call pays: "
          "building the cost model, the candidates' costs, the program (the ILP also runs the "
          "baselines as seeds) and the solve. Baselines share one graph whose cost model is "
          "built beforehand (its build time is in the last table); the first baseline per model "
          "and topology still pays for per-operator costs computed on first use.", ""]
    for st in res.searchers:
        L += [f"### {st} planning time per model and topology (s)", ""]
        rows = []
        for mk in res.models:
            cells = [mk]
            for tk in res.topologies:
                r = res.get(mk, tk, st)
                cell = status_cell(r)
                if cell is None:
                    s = r.get("solver")
                    cell = secs(r["planning_time"]) + (f" (solve {secs(s['solve_time'])})" if s else "")
                elif r is not None and r["status"] == "infeasible":
                    cell = f"infeasible after {secs(r['wall_time'])}"
                cells.append(cell)
            rows.append(cells)
        L += table(["model", *res.topologies], rows)
        for mk in ("gpt2-small", "gpt2-medium"):
            times = [r["planning_time"] for tk in res.topologies if (r := res.ok(mk, tk, st))]
            solves = [r["solver"]["solve_time"] for tk in res.topologies
                      if (r := res.ok(mk, tk, st)) and r.get("solver")]
            if times:
                line = (f"- **{mk}** ({res.model_info[mk]['graph_nodes']:,} graph nodes): "
                        f"`{st}` planning {secs(min(times))}–{secs(max(times))} s over "
                        f"{len(times)} topologies")
                if solves:
                    line += f"; solver {secs(min(solves))}–{secs(max(solves))} s"
                L.append(line + ".")
        L.append("")
    L += ["### Mean planning time per strategy (s, over models and topologies)", ""]
    rows = []
    for s in res.strategies:
        ts = [r["planning_time"] for r in doc["rows"] if r["strategy"] == s and r["status"] == "ok"]
        rows.append([s, secs(sum(ts) / len(ts)) if ts else "—", secs(max(ts)) if ts else "—"])
    cms = defaultdict(float)
    for (mk, _, st), r in res.rows.items():
        if st == res.strategies[0]:
            cms[mk] += r["cost_model_time"]
    L += table(["strategy", "mean", "max"], rows)
    L += table(["model", "baselines' cost model build, sum over topologies (s)"],
               [[mk, secs(cms[mk])] for mk in res.models])

    # -- memory
    L += ["## Peak memory per device (GB)", "",
          "`plan.cost.peak_memory` (parameters + gradients + optimizer state + saved activations "
          "on the worst device). † over the smallest device's memory (`plan.cost.memory_capacity`"
          ", in each heading).", ""]
    for tk in res.topologies:
        caps = {r["memory_capacity"] for (_, t2, _), r in res.rows.items()
                if t2 == tk and r["status"] == "ok" and r["memory_capacity"]}
        cap = f"{gb(min(caps))} GB per device" if caps else "capacity unknown"
        L += [f"### {tk} ({cap})", ""]
        rows = []
        for mk in res.models:
            cells = [mk]
            for s in res.strategies:
                r = res.get(mk, tk, s)
                cell = status_cell(r)
                if cell is None:
                    cell = gb(r["peak_memory"]) + ("" if r["fits"] else " †")
                cells.append(cell)
            rows.append(cells)
        L += table(["model", *res.strategies], rows)

    # -- communication by link class
    for st in res.searchers:
        classes = sorted({c for r in doc["rows"] if r["status"] == "ok"
                          for c in r["link_class"].values()},
                         key=lambda c: (list(LINK_CLASS_DOC).index(c) if c in LINK_CLASS_DOC
                                        else len(LINK_CLASS_DOC), c))
        L += [f"## Communication of the {st} plan by link class", "",
              "Per link class: time (ms) / bytes each device sends (`plan.cost.comm_time_by_axis` "
              "and `plan.cost.comm_bytes` summed over the mesh axes of that class; a staged "
              "plan's over every stage's). — : the topology has no axis of that class.", ""]
        rows = []
        for tk in res.topologies:
            for mk in res.models:
                r = res.get(mk, tk, st)
                cell = status_cell(r)
                if cell is not None:
                    rows.append([tk, mk, *([cell] * len(classes)), cell])
                    continue
                present = set(r["link_class"].values())
                cells = [tk, mk]
                for c in classes:
                    if c not in present:
                        cells.append("—")
                    else:
                        cells.append(f"{ms(r['comm_time_by_link'].get(c, 0.0))} / "
                                     f"{nice_bytes(r['comm_bytes_by_link'].get(c, 0.0))}")
                cells.append(f"{ms(r['comm_time'])} of {ms(r['step_time'])}")
                rows.append(cells)
        L += table(["topology", "model", *(f"{c} ({LINK_CLASS_DOC.get(c, c)})" for c in classes),
                    "comm of step (ms)"], rows, "ll" + "r" * (len(classes) + 1))

    # -- failures and checks
    L += ["## Not planned", ""]
    rows = [[mk, tk, st, r["status"], r.get("message", "").splitlines()[0][:220].replace("|", "\\|")]
            for (mk, tk, st), r in res.rows.items() if r["status"] != "ok"]
    L += table(["model", "topology", "strategy", "status", "message"], rows, "lllll") if rows \
        else ["Every combination produced a plan.", ""]
    L += ["## Automatic checks", "",
          "Generated from the rows: errors, a searching planner worse than a fitting baseline or "
          "not fitting memory, solver stops before optimality, plans on several devices with zero "
          "predicted communication, inconsistent time/bytes per axis, warnings.", ""]
    found = anomalies(res)
    L += [f"- {a}" for a in found] if found else ["No findings."]
    L.append("")
    gnn = os.path.join(os.path.dirname(json_path), "gnn_eval.md")
    if os.path.exists(gnn):  # written by benchmarks/gnn_eval.py
        with open(gnn) as f:
            L += ["## The learned planner (`auto`) against the ILP", "",
                  "From `python benchmarks/gnn_eval.py` (`benchmarks/results/gnn_eval.json`): "
                  "graphs the network never saw. *auto / ILP*: `auto` as shipped (network "
                  "shortlist, search, baselines); *search alone*: coordinate descent from the "
                  "network's prior; *uniform prior*: the same search budget without the network "
                  "(the ablation). Wall times on the shared 2-core machine.", "", f.read()]
    return "\n".join(L)


# ------------------------------------------------------------------------------------ main

def pick(values: list[str] | None, known: list[str], what: str) -> list[str]:
    if not values:
        return list(known)
    bad = [v for v in values if v not in known]
    if bad:
        raise SystemExit(f"unknown {what} {bad}; choose from {known}")
    return [k for k in known if k in values]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--models", nargs="+", metavar="KEY", help=f"subset of {list(MODELS)}")
    ap.add_argument("--topologies", nargs="+", metavar="KEY", help=f"subset of {list(TOPOLOGIES)}")
    ap.add_argument("--strategies", nargs="+", metavar="NAME",
                    help="subset of the registered strategies (default: all)")
    ap.add_argument("--quick", action="store_true",
                    help=f"small subset: {QUICK['models']} on {QUICK['topologies']}")
    ap.add_argument("--time-limit", type=float, help="ILP time limit in s (default: the ILP's)")
    ap.add_argument("--out", help="JSON path (default: results/sweep.json for the full sweep, "
                                  "results/sweep-subset.json for a subset)")
    ap.add_argument("--md", help="markdown path (default: RESULTS.md for the full sweep, stdout "
                                 "for a subset); '-' for stdout")
    ap.add_argument("--report-only", action="store_true",
                    help="do not plan; render the markdown from the JSON (--out or sweep.json)")
    ap.add_argument("--list", action="store_true", help="print the keys and exit")
    args = ap.parse_args(argv)

    registered = hj.strategies.names()
    if args.list:
        print("models:    ", " ".join(MODELS))
        print("topologies:", " ".join(TOPOLOGIES))
        print("strategies:", " ".join(registered))
        return
    subset = bool(args.quick or args.models or args.topologies or args.strategies)
    out = args.out or (SUBSET_JSON if subset and not args.report_only else FULL_JSON)
    md = args.md or ("-" if subset and not args.report_only else FULL_MD)

    if args.report_only:
        with open(out) as f:
            doc = json.load(f)
    else:
        models = pick(args.models or (QUICK["models"] if args.quick else None), list(MODELS),
                      "model")
        topologies = pick(args.topologies or (QUICK["topologies"] if args.quick else None),
                          list(TOPOLOGIES), "topology")
        strategies = pick(args.strategies, registered, "strategy")
        doc = sweep(models, topologies, strategies, args.time_limit)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {os.path.relpath(out)} ({len(doc['rows'])} rows, "
              f"{doc['meta']['total_time']:.0f} s)", file=sys.stderr)
    text = render(doc, out)
    if md == "-":
        print(text)
    else:
        with open(md, "w") as f:
            f.write(text)
        print(f"wrote {os.path.relpath(md)}", file=sys.stderr)


if __name__ == "__main__":
    main()
