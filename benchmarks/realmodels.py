"""hulkjax on third-party models: numerics, cost-model fidelity and plan quality.

Two passes over the families of ``tests/realmodels/families.py`` and the meshes of
``tests/realmodels/measure.py`` (8, 2 x 4, 2 x 2 x 2 fake CPU devices), every strategy that applies:

1. Fidelity (``tiny`` configurations, compiled): plan, emit and compile; run two steps and compare
   them with the unsharded ``jax.jit`` step (the test suite's check, on the full grid); hold the
   cost model's predicted collectives per ``(kind, axes)`` against the compiled HLO's (same count,
   bytes within 10%) and the predicted peak memory against ``compiled.memory_analysis()``
   (within 15%); for ``dp``, list the compiled collectives that are not gradient all-reduces.
2. Quality (``small`` configurations, planned only, nothing compiled): the predicted step time of
   every strategy; ``ilp`` and ``auto`` against the best baseline that fits memory; how many
   projection kernels ``megatron`` shards.

Results go to ``benchmarks/results/realmodels.json``, ``benchmarks/REALMODELS.md`` (summary and
plan quality) and ``benchmarks/FIDELITY.md`` (predicted against compiled, per kind, family and
case), both written from the JSON alone (``--report-only`` rewrites them). A case that fails is
recorded with its error and the run goes on.

Usage::

    python benchmarks/realmodels.py                 # both passes (about 15 minutes on 2 cores)
    python benchmarks/realmodels.py --families gpt2 llama --meshes 2x4 --strategies dp megatron
    python benchmarks/realmodels.py --report-only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
import warnings
from importlib import metadata

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # the families and measurements live in tests/realmodels

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from tqdm import tqdm  # noqa: E402

import hulkjax as hj  # noqa: E402
from hulkjax.errors import StrategyNotApplicableError, UnsupportedPrimitiveWarning  # noqa: E402
from hulkjax.formatting import format_bytes, format_time  # noqa: E402
from tests.helpers import assert_trees_close, first_steps  # noqa: E402
from tests.realmodels import families  # noqa: E402
from tests.realmodels.measure import (  # noqa: E402
    MEMORY_TOLERANCE,
    MESHES,
    compare_collectives,
    compiled_collectives,
    compiled_memory,
    non_gradient_collectives,
    predicted_collectives,
    projection_kernels,
    replicated_kernels,
    sharded_inputs,
    source_commit,
    within,
)

JSON_PATH = os.path.join(HERE, "results", "realmodels.json")
MD_PATH = os.path.join(HERE, "REALMODELS.md")
FIDELITY_PATH = os.path.join(HERE, "FIDELITY.md")
KINDS = ("all-reduce", "all-gather", "all-to-all", "collective-permute")
PLANNER_OPTIONS = {"ilp": {"time_limit": 10.0}, "auto": {"time_limit": 10.0}}


def _plan(step, args, graph, topo, strategy):
    """The plan and the primitives it warned about (UnsupportedPrimitiveWarning)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnsupportedPrimitiveWarning)
        plan = hj.plan(step, *args, topology=topo, strategy=strategy, graph=graph,
                       **PLANNER_OPTIONS.get(strategy, {}))
    unsupported = sorted({str(w.message).split("'")[1] for w in caught
                          if issubclass(w.category, UnsupportedPrimitiveWarning)})
    return plan, unsupported


# Left out unless --ilp-3d: on the 2 x 2 x 2 mesh HiGHS overruns the ILP's time limit (it checks
# the limit between phases, and the root LP of these graphs on three axes takes longer), 50-150 s
# per plan here, which alone would double the run.
SLOW = {("2x2x2", "ilp")}


def _cases(meshes, strategies, skip=frozenset()):
    return [(m, s) for m in meshes for s in strategies
            if not (s == "dp_tp" and m == "8") and (m, s) not in skip]


# ------------------------------------------------------------------------------------------------
# Pass 1: fidelity (tiny, compiled)
# ------------------------------------------------------------------------------------------------


def fidelity_case(name, built, mesh, strategy) -> dict:
    step, state, batch, graph, refs, kernels = built
    row = {"family": name, "mesh": mesh, "strategy": strategy}
    t0 = time.perf_counter()
    plan, row["unsupported"] = _plan(step, (state, batch), graph, MESHES[mesh], strategy)
    row["planning_time"] = time.perf_counter() - t0
    row["predicted_step_time"] = plan.cost.step_time
    predicted = predicted_collectives(graph, plan)
    sharded = hj.emit(step, plan)
    t0 = time.perf_counter()
    compiled = sharded.compile(state, batch)
    row["compile_time"] = time.perf_counter() - t0
    hlo = sharded.collectives()
    row["collectives"] = compare_collectives(predicted, compiled_collectives(hlo))
    row["memory"] = {"predicted": plan.cost.peak_memory, "compiled": compiled_memory(compiled)}
    row["memory"]["within"] = within(row["memory"]["predicted"], row["memory"]["compiled"],
                                     MEMORY_TOLERANCE)
    if strategy == "dp":
        row["dp_non_gradient"] = non_gradient_collectives(hlo, graph)
    row["kernels_sharded"] = sorted(sharded_inputs(plan) & set(kernels))
    row["kernels_replicated"] = replicated_kernels(plan, set(kernels) - set(row["kernels_sharded"]))
    s = state
    try:
        for ref_state, ref_metrics in refs:
            s, metrics = sharded(s, batch)
            assert_trees_close((s, metrics), (ref_state, ref_metrics),
                               **families.FAMILIES[name].tolerance)
        row["equal"] = True
    except AssertionError as e:
        row["equal"] = False
        row["mismatch"] = " ".join(str(e).split())[:300]
    row["status"] = "ok"
    return row


def fidelity_pass(names, meshes, strategies, skip) -> tuple[list, dict]:
    rows, kernels_of = [], {}
    cases = [(n, m, s) for n in names for m, s in _cases(meshes, strategies, skip)]
    built = {}
    for name, mesh, strategy in (bar := tqdm(cases, desc="fidelity (tiny, compiled)")):
        bar.set_postfix_str(f"{name} {mesh} {strategy}")
        if name not in built:
            built.clear()  # one family's programs at a time
            jax.clear_caches()
            step, state, batch = families.build(name, "tiny")
            refs = jax.device_get(first_steps(jax.jit(step), state, batch, n=2))
            graph = hj.trace(step, state, batch)
            kernels_of[name] = projection_kernels(graph)
            built[name] = (step, state, batch, graph, refs, kernels_of[name])
        try:
            rows.append(fidelity_case(name, built[name], mesh, strategy))
        except StrategyNotApplicableError as e:
            rows.append({"family": name, "mesh": mesh, "strategy": strategy, "status": "n/a",
                         "error": str(e)})
        except Exception as e:  # noqa: BLE001 (a report records every failure and goes on)
            rows.append({"family": name, "mesh": mesh, "strategy": strategy, "status": "error",
                         "error": f"{type(e).__name__}: {e}"[:500],
                         "traceback": traceback.format_exc()[-2000:]})
    return rows, kernels_of


# ------------------------------------------------------------------------------------------------
# Pass 2: quality (small, planned only)
# ------------------------------------------------------------------------------------------------


def quality_pass(names, meshes, strategies, skip) -> list:
    rows = []
    for name in (bar := tqdm(names, desc="quality (small, planned)")):
        step, state, batch = families.build(name, "small")
        args = jax.eval_shape(lambda s=state, b=batch: (s, b))
        del state, batch
        graph = hj.trace(step, *args)
        kernels = projection_kernels(graph)
        for mesh, strategy in _cases(meshes, strategies, skip):
            bar.set_postfix_str(f"{name} {mesh} {strategy}")
            row = {"family": name, "mesh": mesh, "strategy": strategy}
            try:
                t0 = time.perf_counter()
                plan, row["unsupported"] = _plan(step, args, graph, MESHES[mesh], strategy)
                row.update(status="ok", planning_time=time.perf_counter() - t0,
                           step_time=plan.cost.step_time, peak_memory=plan.cost.peak_memory,
                           fits=bool(plan.cost.fits), kernels=len(kernels),
                           kernels_sharded=len(sharded_inputs(plan) & set(kernels)))
            except StrategyNotApplicableError as e:
                row.update(status="n/a", error=str(e))
            except Exception as e:  # noqa: BLE001
                row.update(status="error", error=f"{type(e).__name__}: {e}"[:500])
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------------


def _frac(n: int, d: int) -> str:
    return f"{n}/{d} ({n / d:.0%})" if d else "0/0"


def _kind_cell(entry: dict | None) -> str:
    """``✓`` count and bytes agree; ``≈`` bytes only; ``✗`` neither; then predicted / HLO."""
    if entry is None:
        return ""
    mark = "✓" if entry["count_equal"] and entry["bytes_within"] else (
        "≈" if entry["bytes_within"] else "✗")

    def side(d):
        if not d:
            return "-"
        return " ".join(f"{a}:{c}×{format_bytes(b)}" for a, (c, b) in sorted(d.items()))

    return f"{mark} {side(entry['predicted'])} / {side(entry['compiled'])}"


def markdown(result: dict) -> tuple[str, str]:
    """``(REALMODELS.md, FIDELITY.md)``: the summary with plan quality, and the summary with the
    fidelity tables per collective kind, family and case."""
    fid = [r for r in result["fidelity"] if r["status"] == "ok"]
    errors = ([("fidelity", r) for r in result["fidelity"] if r["status"] == "error"]
              + [("quality", r) for r in result["quality"] if r["status"] == "error"])
    meta = result["meta"]
    match = [r for r in fid if all(k["count_equal"] and k["bytes_within"]
                                   for k in r["collectives"].values())]
    bytes_match = [r for r in fid if all(k["bytes_within"] for k in r["collectives"].values())]
    mem = [r for r in fid if r["memory"]["within"]]
    equal = [r for r in fid if r["equal"]]
    lines = [
        "# hulkjax on third-party models",
        "",
        f"Generated by `{meta['command']}` on {meta['date']} (commit `{meta['commit']}`; jax "
        f"{meta['versions']['jax']}, flax {meta['versions']['flax']}, transformers "
        f"{meta['versions']['transformers']}, keras-hub {meta['versions']['keras-hub']}; "
        f"{meta['elapsed'] / 60:.0f} min wall on a {meta['cpus']}-core machine). Families: "
        f"`tests/realmodels/families.py`; meshes: {', '.join(meta['meshes'])} fake CPU devices "
        f"(`tests/realmodels/measure.py`). The fidelity pass compiles the **tiny** "
        f"configurations; the quality pass plans the **small** ones without compiling. `ilp` and "
        f"`auto` run with `time_limit={meta['planner_options']['ilp']['time_limit']:g}` s."
        + (f" Left out: {', '.join(meta['left_out'])} (`--ilp-3d` includes it: HiGHS overruns "
           f"its time limit on the 3-axis mesh)." if meta.get("left_out") else "")
        + (f" The fidelity results are `{ff['command']}`'s, commit `{ff['commit']}` "
           f"({ff['date']}); this run planned the quality pass only." if (
               ff := meta.get("fidelity_from")) else ""),
        "",
        "## Summary",
        "",
        f"- **Numerics**: {_frac(len(equal), len(fid))} compiled cases equal the unsharded step "
        f"over two steps.",
        f"- **Collectives**: predicted = compiled per kind (same axes, same count, bytes within "
        f"10%) in {_frac(len(match), len(fid))} cases; bytes alone within 10% in "
        f"{_frac(len(bytes_match), len(fid))}.",
        f"- **Memory**: predicted peak within 15% of the compiled program's in "
        f"{_frac(len(mem), len(fid))} cases (median predicted / compiled "
        f"{statistics.median(r['memory']['predicted'] / r['memory']['compiled'] for r in fid):.2f})."
        if fid else "- **Memory**: no compiled case.",
        f"- **Errors**: {len(errors)} case(s)" + (": " + "; ".join(
            f"{p} pass, {r['family']} {r['mesh']} {r['strategy']}: {r['error'][:160]}"
            for p, r in errors) if errors else "."),
        *highlights(result),
        "",
        "Counts compare the cost model's collectives as XLA:CPU compiles them "
        "(`CostModel.program_summary(..., backend=\"cpu\")`: independent all-reduces combined "
        "in the post-order XLA's combiner walks, reduce-scatters as all-reduce + slice, bf16 "
        "moved as f32) with the HLO's collective instructions; a loop body's count once per "
        "iteration on both sides.",
        "",
        "### Per collective kind",
        "",
        "| kind | cases with it (either side) | count and bytes agree | bytes agree | predicted "
        "only | compiled only |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind in KINDS:
        have = [r["collectives"][kind] for r in fid if kind in r["collectives"]]
        lines.append(
            f"| {kind} | {len(have)} | "
            f"{_frac(sum(e['count_equal'] and e['bytes_within'] for e in have), len(have))} | "
            f"{_frac(sum(e['bytes_within'] for e in have), len(have))} | "
            f"{sum(not e['compiled'] for e in have)} | {sum(not e['predicted'] for e in have)} |")
    lines += ["", "### Per family", "",
              "| family | cases | equal to unsharded | collectives agree | bytes agree | memory "
              "within 15% | median memory predicted / compiled |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for name in meta["families"]:
        rs = [r for r in fid if r["family"] == name]
        if not rs:
            continue
        lines.append(
            f"| {name} | {len(rs)} | {_frac(sum(r['equal'] for r in rs), len(rs))} | "
            f"{_frac(sum(r in match for r in rs), len(rs))} | "
            f"{_frac(sum(r in bytes_match for r in rs), len(rs))} | "
            f"{_frac(sum(r['memory']['within'] for r in rs), len(rs))} | "
            f"{statistics.median(r['memory']['predicted'] / r['memory']['compiled'] for r in rs):.2f} |")
    summary = lines
    lines = ["# Cost-model fidelity on third-party models", *summary[1:]]  # FIDELITY.md
    summary = [*summary, "", "Per-case predicted / compiled collectives and memory: "
               "[FIDELITY.md](FIDELITY.md) (same command).", *quality_markdown(result)]
    lines += ["", "## Fidelity per case (tiny, compiled)", "",
              "Cells: `✓` count and bytes agree, `≈` bytes only, `✗` neither; then predicted / "
              "HLO as `axes:count×bytes` per step.", ""]
    for name in meta["families"]:
        rs = [r for r in result["fidelity"] if r["family"] == name]
        if not rs:
            continue
        fam = result["families"].get(name, {})
        lines += [f"### {name}", "", f"{fam.get('library', '')} `{fam.get('model', '')}` "
                  f"({fam.get('kind', '')}); {len(fam.get('kernels', []))} projection kernels.",
                  "", "| mesh | strategy | equal | " + " | ".join(KINDS)
                  + " | memory predicted / compiled |", "|---|---|---|" + "---|" * len(KINDS)
                  + "---|"]
        for r in rs:
            if r["status"] != "ok":
                lines.append(f"| {r['mesh']} | {r['strategy']} | {r['status']}: "
                             f"{r['error'][:150]} |" + " |" * (len(KINDS) + 1))
                continue
            m = r["memory"]
            lines.append(
                f"| {r['mesh']} | {r['strategy']} | {'yes' if r['equal'] else 'NO'} | "
                + " | ".join(_kind_cell(r["collectives"].get(k)) for k in KINDS)
                + f" | {'✓' if m['within'] else '✗'} {format_bytes(m['predicted'])} / "
                f"{format_bytes(m['compiled'])} |")
        lines.append("")
    return "\n".join(summary) + "\n", "\n".join(lines) + "\n"


def _short_reason(reason: str) -> str:
    """The first rejection of a planner note, without its dimension and source lines:
    ``"dim 1: top_k (math.py:278) does not keep the split; dim 2: ..."`` -> ``"top_k does not keep
    the split"``."""
    first = re.split(r"; (?=dim \d+: )", reason)[0]
    first = re.sub(r"^dim \d+: ", "", first)
    return re.sub(r" \([^()]*:\d+\)", "", first)


def highlights(result: dict) -> list[str]:
    """Summary bullets on plan quality and coverage, computed from the cases."""
    fid = [r for r in result["fidelity"] if r["status"] == "ok"]
    qual = [r for r in result["quality"] if r["status"] == "ok"]
    names = result["meta"]["families"]
    dp = {n: [r for r in fid if r["family"] == n and r["strategy"] == "dp"] for n in names}
    leaky = [n for n in names if any(r["dp_non_gradient"] for r in dp[n])]
    mt = {n: [r for r in fid if r["family"] == n and r["strategy"] == "megatron"] for n in names}
    kernels = {n: len(result["families"].get(n, {}).get("kernels", [])) for n in names}
    sharded = {n: max((len(r["kernels_sharded"]) for r in mt[n]), default=0) for n in names}
    out = [
        f"- **dp** keeps collectives other than gradient all-reduces in its compiled program "
        f"for {len(leaky)}/{len(names)} families"
        + (": " + ", ".join(f"{n} ({max(len(r['dp_non_gradient']) for r in dp[n])})"
                            for n in leaky) if leaky else "") + ".",
        f"- **megatron** shards {sum(sharded.values())}/{sum(kernels.values())} projection "
        f"kernels (tiny): " + ", ".join(f"{n} {sharded[n]}/{kernels[n]}" for n in names) + ".",
    ]
    # The kernels the best megatron plan of each family keeps replicated, with the planner's reason
    # (its plan notes): a router (top_k over its output), a dense between LayerNorm and a
    # matmul, a single shared key/value head are replicated in Megatron-LM too; a head no wider
    # than its input (a classifier) is no vocabulary to split.
    for n in names:
        best = max(mt[n], key=lambda r: len(r["kernels_sharded"]), default=None)
        kept = (best or {}).get("kernels_replicated", {})
        if kept:
            out.append(f"  - {n} ({best['mesh']}) keeps replicated: " + "; ".join(
                f"`{p.removeprefix('state/params/')}` ({_short_reason(why)})"
                for p, why in sorted(kept.items())) + ".")
    for planner in ("ilp", "auto"):
        ratios = []
        for n in names:
            for mesh in result["meta"]["meshes"]:
                cell = {r["strategy"]: r for r in qual if (r["family"], r["mesh"]) == (n, mesh)}
                base = [r["step_time"] for st, r in cell.items()
                        if st in hj.strategies.BASELINES and r["fits"]]
                if planner in cell and base:
                    ratios.append(cell[planner]["step_time"] / min(base))
        if ratios:
            gmean = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
            out.append(f"- **{planner}** / best baseline, predicted step time (small): geometric "
                       f"mean {gmean:.2f}, range {min(ratios):.2f}-{max(ratios):.2f} over "
                       f"{len(ratios)} family x mesh cells.")
    out += _rewrite_bullets()
    warned = {n: sorted({p for r in fid + qual if r["family"] == n
                         for p in r.get("unsupported", [])}) for n in names}
    out.append("- **Unsupported primitives** (replicated with a warning): " + "; ".join(
        f"{n}: {', '.join(f'`{p}`' for p in ps)}" for n, ps in warned.items() if ps)
        + ("; none elsewhere." if any(warned.values()) else "none."))
    return out


REWRITE_JSON = os.path.join(HERE, "results", "rewrite.json")


def _rewrite_bullets() -> list[str]:
    """The quality target against rewritten maths, quoted from ``benchmarks/rewrite.py``'s
    results (its own command; nothing here reruns it)."""
    if not os.path.exists(REWRITE_JSON):
        return []
    with open(REWRITE_JSON) as f:
        rows = json.load(f)["plans"]
    out = []
    for planner in ("ilp", "auto"):
        rs = [r["ratio_slices"] for r in rows if r["planner"] == planner and "ratio_slices" in r]
        rw = [r["ratio"] for r in rows if r["planner"] == planner and "ratio" in r]
        if rs and rw:
            out.append(
                f"- **{planner} against the same maths without `split` / `concatenate`** "
                f"([REWRITE.md](REWRITE.md), `python benchmarks/rewrite.py`): predicted step time "
                f"of the plan for the original code / for the code with `split` as slices "
                f"{min(rs):.3f}-{max(rs):.3f}, with `concatenate` as padded sums too "
                f"{min(rw):.3f}-{max(rw):.3f} over {len(rs)} family x topology cells (target: "
                f"<= 1.02)" + (_time_limited(rows) if planner == "ilp" else "") + ".")
    return out


def _time_limited(rows) -> str:
    """How many of the rewrite benchmark's ILP solves stopped at their time limit."""
    solves = [r[v].get("solver") or "" for r in rows if r["planner"] == "ilp"
              for v in ("original", "slices", "rewritten") if v in r]
    limited = sum("time limit" in s for s in solves)
    return (f"; {limited} of its {len(solves)} solves stopped at the time limit with their best "
            f"incumbent, so single ratios move with the machine's load" if limited else "")


def quality_markdown(result: dict) -> list[str]:
    fid = [r for r in result["fidelity"] if r["status"] == "ok"]
    qual = [r for r in result["quality"] if r["status"] == "ok"]
    meta = result["meta"]
    lines = ["", "## Plan quality", "",
             "**dp's activation collectives** (tiny, compiled): collectives of `dp`'s program "
             "other than gradient all-reduces (all-gathers, all-to-alls, collective-permutes, "
             "all-reduces of tensors shaped neither like a parameter nor like a backward sum "
             "that only makes parameter gradients, as T5's position-bias gradient summed over "
             "the batch before its scatter-add into the bucket table; pieces of at most 64 "
             "bytes left out). A data-parallel step needs none.",
             "**megatron kernels**: projection kernels (parameters of rank >= 2 feeding a "
             "`dot_general`) that `megatron` splits, of all of them (tiny / small).",
             "**Step time** (small, planned): the cost model's prediction for `ilp`, `auto` and "
             "the best baseline that fits memory.", "",
             "| family | mesh | dp activation collectives | megatron kernels sharded (tiny / "
             "small) | ilp | auto | best baseline | ilp / best | auto / best |",
             "|---|---|---|---|---:|---:|---|---:|---:|"]
    for name in meta["families"]:
        for mesh in meta["meshes"]:
            dp = next((r for r in fid if (r["family"], r["mesh"], r["strategy"])
                       == (name, mesh, "dp")), None)
            if dp is None:
                dp_cell = "n/a"
            else:
                extra = dp["dp_non_gradient"]
                kinds = sorted({e["kind"] for e in extra})
                dp_cell = "none" if not extra else (
                    f"{len(extra)}: {', '.join(kinds)}, "
                    f"{format_bytes(sum(e['bytes'] for e in extra))}")
            kernels = len(result["families"].get(name, {}).get("kernels", []))
            mt = next((r for r in fid if (r["family"], r["mesh"], r["strategy"])
                       == (name, mesh, "megatron")), None)
            mq = next((r for r in qual if (r["family"], r["mesh"], r["strategy"])
                       == (name, mesh, "megatron")), None)
            tiny = f"{len(mt['kernels_sharded'])}/{kernels}" if mt else "n/a"
            small = f"{mq['kernels_sharded']}/{mq['kernels']}" if mq else "n/a"
            times = {r["strategy"]: r for r in qual if (r["family"], r["mesh"]) == (name, mesh)}
            base = [r for s, r in times.items() if s in hj.strategies.BASELINES and r["fits"]]
            best = min(base, key=lambda r: r["step_time"]) if base else None

            def t(s, times=times):
                return format_time(times[s]["step_time"]) if s in times else "n/a"

            def ratio(s, times=times, best=best):
                if s not in times or best is None:
                    return "n/a"
                return f"{times[s]['step_time'] / best['step_time']:.2f}"

            lines.append(
                f"| {name} | {mesh} | {dp_cell} | {tiny} / {small} | {t('ilp')} | {t('auto')} | "
                + (f"{best['strategy']} {format_time(best['step_time'])}" if best else "n/a")
                + f" | {ratio('ilp')} | {ratio('auto')} |")
    return lines


# ------------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------------


def _versions() -> dict:
    out = {}
    for pkg in ("jax", "flax", "optax", "transformers", "keras", "keras-hub"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", nargs="+", default=families.names(), choices=families.names())
    ap.add_argument("--meshes", nargs="+", default=list(MESHES), choices=list(MESHES))
    ap.add_argument("--strategies", nargs="+", default=hj.strategies.names(),
                    choices=hj.strategies.names())
    ap.add_argument("--skip-quality", action="store_true", help="fidelity pass only")
    ap.add_argument("--fidelity-from", metavar="JSON",
                    help="take the fidelity pass's results (and kernel tables) from this JSON, "
                         "written by an earlier run (e.g. --skip-quality), and run the quality "
                         "pass only")
    ap.add_argument("--ilp-3d", action="store_true",
                    help="also run ilp on the 2x2x2 mesh (50-150 s per plan: HiGHS overruns "
                         "its time limit there)")
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite REALMODELS.md from the existing JSON")
    ap.add_argument("--out", default=JSON_PATH)
    ap.add_argument("--md", default=MD_PATH)
    ap.add_argument("--fidelity-md", default=FIDELITY_PATH)
    args = ap.parse_args(argv)
    if args.report_only:
        with open(args.out) as f:
            result = json.load(f)
    else:
        t0 = time.perf_counter()
        names = [n for n in args.families if families.available(n)]
        missing = sorted(set(args.families) - set(names))
        skip = set() if args.ilp_3d else SLOW
        if args.fidelity_from:
            with open(args.fidelity_from) as f:
                earlier = json.load(f)
            fidelity = [r for r in earlier["fidelity"] if r["family"] in names
                        and r["mesh"] in args.meshes and r["strategy"] in args.strategies]
            kernels = {n: fam.get("kernels", []) for n, fam in earlier["families"].items()}
            fidelity_from = {k: earlier["meta"][k] for k in ("command", "commit", "date")}
        else:
            fidelity, kernels = fidelity_pass(names, args.meshes, args.strategies, skip)
            fidelity_from = None
        quality = ([] if args.skip_quality
                   else quality_pass(names, args.meshes, args.strategies, skip))
        fams = {n: {"library": f.library, "model": f.model, "kind": f.kind,
                    "kernels": kernels.get(n, [])}
                for n, f in families.FAMILIES.items() if n in names}
        result = {
            "meta": {"date": time.strftime("%Y-%m-%d"), "commit": source_commit(ROOT),
                     "command": " ".join(["python benchmarks/realmodels.py",
                                          *(sys.argv[1:] if argv is None else argv)]),
                     "cpus": os.cpu_count(),
                     "versions": _versions(), "families": names, "not_installed": missing,
                     "meshes": args.meshes, "strategies": args.strategies,
                     "left_out": sorted(f"{s} on {m}" for m, s in skip
                                        if m in args.meshes and s in args.strategies),
                     "planner_options": PLANNER_OPTIONS,
                     "elapsed": time.perf_counter() - t0, "fidelity_from": fidelity_from},
            "families": fams, "fidelity": fidelity, "quality": quality,
        }
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    realmodels, fidelity = markdown(result)
    with open(args.md, "w") as f:
        f.write(realmodels)
    with open(args.fidelity_md, "w") as f:
        f.write(fidelity)
    print(f"wrote {args.out}, {args.md} and {args.fidelity_md}")


if __name__ == "__main__":
    main()
