"""Do the rules lose against the same maths written without the operators they cover?

Issue 11's quality target: *the ILP's plan is within 2% of the plan for the same maths rewritten to
avoid any missing rule.* Third-party model code (``tests/realmodels/families.py``) splits fused
projections (GPT-2's ``c_attn``, LLaMA's ``rotate_half``: ``split``) and joins pieces back
(``concatenate``, also the gradient of every ``split``). This script rewrites each family's traced
training step so that

* every ``split`` becomes one ``lax.slice`` per piece, and
* every ``concatenate`` becomes a sum of zero-padded operands (``lax.pad`` then ``add``; ``or``
  for booleans),

the same values computed with slices, pads and adds only (a jaxpr interpreter re-emits every other
equation as it is, inlining ``jit`` and ``custom_jvp`` / ``custom_vjp`` calls, whose primal is what
the step computes after differentiation). The numerics are checked first: the rewritten step's
results equal the original's, bit for bit, on the **tiny** configuration. Then both are planned
(**small** configuration, nothing compiled) with ``ilp`` and ``auto`` on each topology, and the
report gives the predicted step time of the original over the rewritten one per family: above 1.02
a rule loses more than 2% against plain slices.

The identity rewrite (the same interpreter, nothing replaced) is planned too: its cost must equal
the original's, so that the ratio measures the rewrite and nothing else.

Results go to ``benchmarks/results/rewrite.json`` and ``benchmarks/REWRITE.md``.

Usage::

    python benchmarks/rewrite.py            # gpt2 llama gemma-bf16 mixtral vit on 2x4 and dgx-h100 x 2
    python benchmarks/rewrite.py --families gpt2 --topologies 2x4 --planners ilp
    python benchmarks/rewrite.py --report-only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # the families live in tests/realmodels

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.extend import core as jex_core  # noqa: E402

import hulkjax as hj  # noqa: E402
from hulkjax.formatting import format_time  # noqa: E402
from tests.realmodels import families  # noqa: E402
from tests.realmodels.measure import MESHES, source_commit  # noqa: E402

JSON_PATH = os.path.join(HERE, "results", "rewrite.json")
MD_PATH = os.path.join(HERE, "REWRITE.md")
TOPOLOGIES = {
    "2x4": MESHES["2x4"],
    "dgx-h100x2": hj.Topology.preset("dgx-h100", nodes=2),
}
PLANNER_OPTIONS = {"ilp": {"time_limit": 10.0}, "auto": {"time_limit": 10.0}}
TARGET = 1.02
REWRITTEN = ("split", "concatenate")
_INLINED = ("jit", "pjit", "custom_jvp_call", "custom_vjp_call")


# ------------------------------------------------------------------------------------------------
# The rewrite: a jaxpr interpreter
# ------------------------------------------------------------------------------------------------


def _split_as_slices(x, *, sizes, axis):
    out, start = [], 0
    for size in sizes:
        out.append(lax.slice_in_dim(x, start, start + size, axis=axis))
        start += size
    return out


def _concatenate_as_pads(xs, *, dimension):
    total = sum(x.shape[dimension] for x in xs)
    zero = np.zeros((), xs[0].dtype)
    out, start = None, 0
    for x in xs:
        cfg = [(0, 0, 0)] * x.ndim
        cfg[dimension] = (start, total - start - x.shape[dimension], 0)
        padded = lax.pad(x, zero, cfg)
        if out is None:
            out = padded
        elif x.dtype == jnp.bool_:
            out = lax.bitwise_or(out, padded)
        else:
            out = lax.add(out, padded)
        start += x.shape[dimension]
    return [out]


def _sub_jaxpr(eqn):
    """The closed jaxpr an inlined call runs on its operands."""
    p = eqn.params
    sub = p.get("jaxpr", p.get("call_jaxpr", p.get("fun_jaxpr")))
    if sub is None:
        raise KeyError(f"no sub-jaxpr in {eqn.primitive.name}'s params {sorted(p)}")
    if isinstance(sub, jex_core.ClosedJaxpr):
        return sub.jaxpr, sub.consts
    return sub, ()


def evaluate(jaxpr, consts, args, *, rewrite, counts: Counter):
    """Run ``jaxpr`` on ``args``, re-emitting the primitives named in ``rewrite`` (of ``split``,
    ``concatenate``) as slices and padded sums (``counts`` tallies what was replaced); every
    other equation is bound as it is (``jit`` and custom-derivative calls inlined)."""
    env = {}

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "split" and name in rewrite:
            outs = _split_as_slices(invals[0], **eqn.params)
            counts[name] += 1
        elif name == "concatenate" and name in rewrite:
            outs = _concatenate_as_pads(invals, **eqn.params)
            counts[name] += 1
        elif name in _INLINED:
            sub, sub_consts = _sub_jaxpr(eqn)
            n = len(sub.invars)
            outs = evaluate(sub, sub_consts, invals[len(invals) - n:], rewrite=rewrite,
                            counts=counts)
        else:
            outs = eqn.primitive.bind(*invals, **eqn.params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, jex_core.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def rewritten_step(step, state, batch, *, rewrite=REWRITTEN):
    """``(step', counts)``: ``step`` traced on ``(state, batch)`` (arrays or shape structs) and
    re-run through :func:`evaluate` rewriting the primitives named in ``rewrite``; ``counts``
    fills in when ``step'`` is traced."""
    closed, shapes = jax.make_jaxpr(step, return_shape=True)(state, batch)
    out_tree = jax.tree.structure(shapes)
    counts: Counter = Counter()

    def step2(state, batch):
        counts.clear()
        outs = evaluate(closed.jaxpr, closed.consts, jax.tree.leaves((state, batch)),
                        rewrite=rewrite, counts=counts)
        return jax.tree.unflatten(out_tree, outs)

    return step2, counts


def primitive_counts(step, *args) -> Counter:
    """Equations per primitive name in ``step``'s jaxpr, sub-jaxprs included."""
    counts: Counter = Counter()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            counts[eqn.primitive.name] += 1
            for sub in jex_core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(step)(*args).jaxpr)
    return counts


# ------------------------------------------------------------------------------------------------
# The measurements
# ------------------------------------------------------------------------------------------------


def check_numerics(name: str) -> dict:
    """The rewritten step against the original on the tiny configuration: every result leaf
    bit-identical (``np.array_equal``) over one step."""
    step, state, batch = families.build(name, "tiny")
    step2, counts = rewritten_step(step, state, batch)
    want = jax.device_get(jax.jit(step)(state, batch))
    got = jax.device_get(jax.jit(step2)(state, batch))
    leaves_w, leaves_g = jax.tree.leaves(want), jax.tree.leaves(got)
    equal = [bool(np.array_equal(np.asarray(a), np.asarray(b)))
             for a, b in zip(leaves_w, leaves_g)]
    maxdiff = max((float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                   for a, b in zip(leaves_w, leaves_g) if np.asarray(a).size), default=0.0)
    before = primitive_counts(step, state, batch)
    after = primitive_counts(step2, state, batch)
    return {"leaves": len(equal), "identical": sum(equal), "max_abs_diff": maxdiff,
            "rewritten": dict(counts),
            "left": {p: after.get(p, 0) for p in REWRITTEN},
            "original": {p: before.get(p, 0) for p in REWRITTEN}}


def plan_family(name: str, topologies, planners) -> list[dict]:
    step, state, batch = families.build(name, "small")
    args = jax.eval_shape(lambda s=state, b=batch: (s, b))
    del state, batch
    variants = {"original": step,
                "identity": rewritten_step(step, *args, rewrite=())[0],
                "slices": rewritten_step(step, *args, rewrite=("split",))[0],
                "rewritten": rewritten_step(step, *args)[0]}
    graphs = {v: hj.trace(f, *args) for v, f in variants.items()}
    rows = []
    for topo_name in topologies:
        topo = TOPOLOGIES[topo_name]
        for planner in planners:
            row = {"family": name, "topology": topo_name, "planner": planner}
            for v, f in variants.items():
                t0 = time.perf_counter()
                try:
                    plan = hj.plan(f, *args, topology=topo, strategy=planner, graph=graphs[v],
                                   **PLANNER_OPTIONS.get(planner, {}))
                    row[v] = {"step_time": plan.cost.step_time,
                              "comm_time": plan.cost.comm_time,
                              "compute_time": plan.cost.compute_time,
                              "peak_memory": plan.cost.peak_memory, "fits": bool(plan.cost.fits),
                              "nodes": len(graphs[v].nodes),
                              "solver": next((n for n in plan.notes if n.startswith("ILP:")),
                                             None),
                              "planning_time": time.perf_counter() - t0}
                except Exception as e:  # noqa: BLE001 (a report records every failure)
                    row[v] = {"error": f"{type(e).__name__}: {e}"[:300]}
            for v, key in (("rewritten", "ratio"), ("slices", "ratio_slices")):
                if "step_time" in row["original"] and "step_time" in row[v]:
                    row[key] = row["original"]["step_time"] / row[v]["step_time"]
                    row["comm_" + key] = (row["original"]["comm_time"]
                                          / max(row[v]["comm_time"], 1e-15))
            rows.append(row)
            print(f"{name} {topo_name} {planner}: "
                  + ", ".join(f"{v} {format_time(row[v]['step_time'])}" if "step_time" in row[v]
                              else f"{v} error" for v in variants)
                  + (f", ratio {row['ratio']:.3f}" if "ratio" in row else "")
                  + (f", split-only ratio {row['ratio_slices']:.3f}" if "ratio_slices" in row
                     else ""), flush=True)
    return rows


# ------------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------------


def _gmean(xs) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def markdown(result: dict) -> str:
    meta = result["meta"]
    rows = result["plans"]
    lines = [
        "# Rules against the same maths without them (split and concatenate rewritten)",
        "",
        f"Generated by `{meta['command']}` on {meta['date']} (commit `{meta['commit']}`; jax "
        f"{jax.__version__}; {meta['elapsed'] / 60:.0f} min wall on a {meta['cpus']}-core "
        f"machine). Families: `tests/realmodels/families.py`, **small** configurations, planned "
        f"(nothing compiled); `ilp` and `auto` with `time_limit="
        f"{meta['planner_options']['ilp']['time_limit']:g}` s. Topologies: `2x4` (the 2 x 4 "
        f"fake-CPU mesh of `tests/realmodels/measure.py`) and `dgx-h100x2` "
        f"(`Topology.preset(\"dgx-h100\", nodes=2)`, 2 x 8 H100).",
        "",
        "The rewrite (`benchmarks/rewrite.py`, a jaxpr interpreter over the traced training step, "
        "gradients included): **slices** re-emits every `split` as one `lax.slice` per piece; "
        "**rewritten** also every `concatenate` as a sum of zero-padded operands (`pad` + "
        "`add`, which adds elementwise work); everything else is re-emitted as it is. **Ratio** "
        "= predicted step time of the plan for the original code / of the plan for the "
        f"rewritten code, same planner; above {TARGET} the rules for `split` / `concatenate` "
        "lose more than 2% against the plain-slice maths. The identity rewrite (same "
        "interpreter, nothing replaced) must cost what the original costs.",
        "",
        "## Summary",
        "",
    ]
    for key, what in (("ratio_slices", "original / slices"), ("ratio", "original / rewritten")):
        rs = [r for r in rows if key in r]
        if not rs:
            continue
        ratios = [r[key] for r in rs]
        over = [r for r in rs if r[key] > TARGET]
        worst = max(rs, key=lambda r: r[key])
        lines.append(
            f"- **{what}**: geometric mean {_gmean(ratios):.3f}, range {min(ratios):.3f}-"
            f"{max(ratios):.3f} over {len(rs)} family x topology x planner cells; "
            f"{len(over)} above {TARGET}"
            + (": " + ", ".join(f"{r['family']} {r['topology']} {r['planner']} {r[key]:.3f}"
                                for r in over) if over else
               f" (highest: {worst['family']} {worst['topology']} {worst['planner']})") + ".")
    best: dict[tuple, dict] = {}  # (family, topology) -> variant -> best step time of any planner
    for r in rows:
        for v in ("original", "identity", "slices", "rewritten"):
            if "step_time" in r.get(v, {}):
                cell = best.setdefault((r["family"], r["topology"]), {})
                cell[v] = min(cell.get(v, math.inf), r[v]["step_time"])
    for v, what in (("slices", "original / slices"), ("rewritten", "original / rewritten")):
        rs = [(k, c["original"] / c[v]) for k, c in best.items() if "original" in c and v in c]
        if rs:
            hi = max(rs, key=lambda kv: kv[1])
            lines.append(
                f"- **{what}, best plan of either planner on each side**: range "
                f"{min(q for _, q in rs):.3f}-{hi[1]:.3f} over {len(rs)} family x topology "
                f"cells ({sum(q > TARGET for _, q in rs)} above {TARGET}; highest "
                f"{hi[0][0]} {hi[0][1]}).")
    for v, what in (("slices", "original / slices"), ("rewritten", "original / rewritten")):
        rs = [r for r in rows if "comm_time" in r.get("original", {})
              and "comm_time" in r.get(v, {})]
        if rs:
            more = [r for r in rs
                    if r["original"]["comm_time"] > r[v]["comm_time"] * 1.001 + 1e-9]
            lines.append(
                f"- **{what}, communication time alone**: the original's plan communicates no "
                f"more than the {v} one's in {len(rs) - len(more)}/{len(rs)} cells"
                + (": more in " + ", ".join(
                    f"{r['family']} {r['topology']} {r['planner']} "
                    f"({format_time(r['original']['comm_time'])} against "
                    f"{format_time(r[v]['comm_time'])})" for r in more) if more else "") + ".")
    ident = [r for r in rows if "step_time" in r.get("identity", {})
             and "step_time" in r.get("original", {})]
    same = [r for r in ident if math.isclose(r["identity"]["step_time"],
                                             r["original"]["step_time"], rel_tol=1e-9)]
    differ = Counter(r["planner"] for r in ident if r not in same)
    lines.append(f"- **Identity rewrite** costs what the original costs in {len(same)}/"
                 f"{len(ident)} cells: the same maths, traced anew and planned again; where it "
                 f"differs (" + (", ".join(f"{k} {p}" for p, k in sorted(differ.items())) or "none")
                 + "), the planner's own spread (an ILP stopped by its time limit returns its "
                 "best incumbent so far, see the notes below; `auto` searches a shortlist its "
                 "network draws from the re-traced graph, which need not be the same).")
    num = result["numerics"]
    lines.append("- **Numerics** (tiny, one step, every result leaf of the fully rewritten "
                 "step against the original): " + "; ".join(
                     f"{n}: {c['identical']}/{c['leaves']} bit-identical"
                     + (f" (max abs diff {c['max_abs_diff']:.2g})"
                        if c["identical"] < c["leaves"] else "")
                     for n, c in num.items()) + ".")
    lines += ["", "## Per family", "",
              "Times: predicted step time (communication time in parentheses).", "",
              "| family | split / concatenate rewritten | topology | planner | original | "
              "slices | rewritten | identity | ratio (slices) | ratio (rewritten) |",
              "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        c = num.get(r["family"], {})
        rw = c.get("rewritten", {})
        left = c.get("left", {})
        what = (f"{rw.get('split', 0)} / {rw.get('concatenate', 0)}"
                + (f" ({sum(left.values())} left in loops)" if sum(left.values()) else ""))

        def t(v, r=r):
            e = r.get(v, {})
            if "step_time" not in e:
                return "error" if e else "n/a"
            return f"{format_time(e['step_time'])} ({format_time(e['comm_time'])})"

        def q(key, r=r):
            return f"{r[key]:.3f}" if key in r else "n/a"

        lines.append(f"| {r['family']} | {what} | {r['topology']} | {r['planner']} | "
                     f"{t('original')} | {t('slices')} | {t('rewritten')} | {t('identity')} | "
                     f"{q('ratio_slices')} | {q('ratio')} |")
    limited = [(r, v) for r in rows for v in ("original", "slices", "rewritten")
               if "time limit" in (r.get(v, {}).get("solver") or "")]
    lines += ["", f"ILP solves stopped by the time limit (best incumbent, gap in the note): "
              f"{len(limited)}"
              + (": " + "; ".join(f"{r['family']} {r['topology']} {v}: {r[v]['solver']}"
                                  for r, v in limited) if limited else ".")]
    errors = [(r, v) for r in rows for v in ("original", "identity", "slices", "rewritten")
              if "error" in r.get(v, {})]
    if errors:
        lines += ["", "Errors: " + "; ".join(f"{r['family']} {r['topology']} {r['planner']} "
                                              f"{v}: {r[v]['error']}" for r, v in errors)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", nargs="+",
                    default=["gpt2", "llama", "gemma-bf16", "mixtral", "vit"],
                    choices=families.names())
    ap.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES), choices=list(TOPOLOGIES))
    ap.add_argument("--planners", nargs="+", default=["ilp", "auto"])
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite REWRITE.md from the existing JSON")
    ap.add_argument("--out", default=JSON_PATH)
    ap.add_argument("--md", default=MD_PATH)
    args = ap.parse_args(argv)
    if args.report_only:
        with open(args.out) as f:
            result = json.load(f)
    else:
        t0 = time.perf_counter()
        names = [n for n in args.families if families.available(n)]
        numerics, plans = {}, []
        for name in names:
            jax.clear_caches()
            numerics[name] = check_numerics(name)
            print(f"{name}: numerics {numerics[name]}", flush=True)
            plans += plan_family(name, args.topologies, args.planners)
        result = {"meta": {"date": time.strftime("%Y-%m-%d"), "commit": source_commit(ROOT),
                           "command": " ".join(["python benchmarks/rewrite.py",
                                                *(sys.argv[1:] if argv is None else argv)]),
                           "cpus": os.cpu_count(), "families": names,
                           "topologies": args.topologies, "planners": args.planners,
                           "planner_options": PLANNER_OPTIONS,
                           "elapsed": time.perf_counter() - t0},
                  "numerics": numerics, "plans": plans}
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    with open(args.md, "w") as f:
        f.write(markdown(result))
    print(f"wrote {args.out} and {args.md}")


if __name__ == "__main__":
    main()
