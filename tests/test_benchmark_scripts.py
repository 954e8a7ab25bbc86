"""Every benchmark script imports against the current package layout (a moved module once left
``benchmarks/gnn_eval.py`` importing ``hulkjax.gnn.data``, which no longer exists, unnoticed
until the benchmark was rerun). Importing runs nothing: each script works under
``if __name__ == "__main__"``."""

import importlib.util
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py"))


def _script(stem: str):
    """Benchmark script ``stem`` imported as a module (the benchmarks directory is not put on
    ``sys.path``: its ``coverage.py`` would shadow the package)."""
    spec = importlib.util.spec_from_file_location(f"_benchmark_{stem}", BENCHMARKS / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_benchmark_script_imports(path):
    assert '__name__ == "__main__"' in path.read_text(), f"{path.name} runs on import"
    _script(path.stem)


def test_planning_third_party_cases_are_abstract_library_models():
    """``benchmarks/planning.py``'s third-party cases name families that exist, and a family
    built as they build it is abstract (nothing allocated) and in the dtype asked for: LLaMA's
    ``+bf16`` computes and stores in bfloat16, where the library default is float32."""
    import jax
    import jax.numpy as jnp

    from tests.realmodels import families

    planning = _script("planning")
    third = {k: c for k, c in planning.CASES.items() if c[0].startswith("family:")}
    assert third, "planning.py has third-party cases"
    for name, dims, *_ in third.values():
        assert name[len("family:"):].partition("+")[0] in families.FAMILIES
        assert dims["batch"] % 16 == 0 and dims["layers"] >= 12  # the zoo cases' shapes

    tiny = dict(families._DIMS["tiny"])
    third_party = _script("stages").ThirdParty  # what planning's worker builds them with
    for spec, dtype in (("llama+bf16", jnp.bfloat16), ("llama", jnp.float32)):
        m = third_party(spec, tiny)
        leaves = jax.tree.leaves(m.state["params"])
        assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
        assert {x.dtype for x in leaves} == {jnp.dtype(dtype)}
    with pytest.raises(ValueError, match="no dtype option"):
        families.build("gpt2", "tiny", dtype=jnp.bfloat16)


def test_merges_benchmark_finds_priced_merges_and_agreement_on_a_held_out_model():
    """``benchmarks/merges.py`` on OPT (transformers' Flax module, tiny): the objective prices
    merges under tensor parallelism, and the objective, ``evaluate``, the plan's cost and the
    breakdown agree; its summary says so."""
    pytest.importorskip("transformers")
    from tests.realmodels import families, unseen_models

    families._quiet_transformers()
    merges = _script("merges")
    rows = merges.measure("opt", unseen_models.MODELS["opt"])
    spmd = [r for r in rows if "error" not in r and not r["staged"]]
    assert {r["strategy"] for r in spmd} >= {"dp", "dp_tp", "megatron"}
    assert all(r["agrees"] for r in spmd)
    assert any(r["merges_priced"] and r["priced_share"] > 0 for r in spmd)
    md = merges.markdown({"date": "2026-11-28", "commit": "abc", "wall_s": 60.0, "rows": rows})
    assert f"- {len(spmd)} SPMD plans of 1 models; 0 where the objective" in md


def test_gnn_eval_reports_the_ablations_time_from_its_own_runs():
    """``benchmarks/gnn_eval.py``'s summary and table give the uniform prior's planning time
    against ``auto``'s (the network's part in the time, not only in the plan), as the median of
    the per-graph ratios."""
    gnn_eval = _script("gnn_eval")
    rows = [{"auto_ratio": 1.0, "search_ratio": 1.1, "uniform_ratio": 1.0, "ilp_s": 4.0,
             "auto_s": 1.0, "uniform_s": u} for u in (1.5, 2.0, 3.0)]
    s = gnn_eval.summary(rows)
    assert s["uniform_time_median"] == 2.0 and s["speedup_median"] == 4.0
    md = gnn_eval.render({"splits": {"held-out": {"summary": s, "rows": rows}}, "gpt2": []})
    assert "uniform prior's time / auto time" in md.splitlines()[0]
    assert md.splitlines()[2].endswith("| 4.0x | 2.0x |")



def test_gnn_targets_reports_each_weights_medians_per_split():
    """``benchmarks/gnn_targets.py``'s table: one row per weights (and the uniform prior) per
    split, each the median over that split's graphs."""
    gt = _script("gnn_targets")

    def weights(recall, argmax):
        return {"recall4": recall, "recall16": recall, "argmax": argmax, "descent": argmax,
                "auto": 1.0, "auto_cpu_s": 1.0}

    rows = [{"family": "gpt2", "groups": 10, "ilp_ms": 1.0, "best_baseline_ms": 1.2,
             "hard": weights(r, a), "soft": weights(r + 0.1, a - 0.01),
             "uniform": {"auto": 1.0, "auto_cpu_s": 2.0}}
            for r, a in ((0.5, 1.2), (0.7, 1.1), (0.9, 1.0))]
    report = {"commit": "x", "date": "d", "machine": {"cpus": 2}, "samples": 3,
              "val_samples": 1, "epochs": 1, "margin": 0.01, "labels": ["hard", "soft"],
              "training": {}, "splits": {"held-out": {"drawn": 5, "rows": rows}}}
    md = gt.render(report)
    table = [ln for ln in md.splitlines() if ln.startswith("| held-out |")]
    assert [ln.split("|")[3].strip() for ln in table] == ["hard", "soft", "uniform prior"]
    assert table[0].split("|")[4:7] == [" 0.700 ", " 0.700 ", " 1.1000 "]
    assert table[1].split("|")[4:7] == [" 0.800 ", " 0.800 ", " 1.0900 "]
    assert table[2].split("|")[-2].strip() == "2.00"


def test_optimizer_apart_reports_ratios_against_the_default_per_cell():
    """``benchmarks/optimizer_apart.py``'s table: `zero` against `dp` and each planner with state
    apart against its default, per family and topology, and their geometric means."""
    oa = _script("optimizer_apart")

    def plan(step, memory, apart=0):
        return {"step_ms": step, "memory_mb": memory, "fits": True, "apart": apart, "cpu_s": 1.0}

    rows = [{"family": f, "topology": "2x4", "nodes": 10, "states": 8,
             "plans": {"dp": plan(2.0, 10.0), "zero": plan(2.0 * z, 8.0),
                       "ilp": plan(1.0, 9.0), "ilp apart": plan(0.99, 9.0, 3),
                       "auto": plan(1.0, 9.0), "auto apart": plan(1.0, 7.0, 2)}}
            for f, z in (("gpt2", 1.0), ("llama", 4.0))]
    rows[1]["plans"]["auto apart"] = {"error": "InfeasiblePlanError: no plan fits"}
    md = oa.render({"commit": "x", "date": "d", "machine": {"cpus": 2}, "rows": rows})
    assert "- `zero` / `dp`, step time: geometric mean 2.000, range 1.000-4.000 over 2 cells" in md
    assert "- `auto` apart / default, peak memory: geometric mean 0.778, range 0.778-0.778 " \
           "over 1 cells" in md
    table = [ln for ln in md.splitlines() if ln.startswith("| gpt2 |")]
    assert table[0].split("|")[9:12] == [" 0.9900 ", " 1.000 ", " 3 "]
    assert "- llama 2x4 auto apart: InfeasiblePlanError: no plan fits" in md
    # the staged section: apart against tied per case, which was kept, and the summary
    def staged(step, memory, kept_apart, names):
        return {"step_ms": step, "memory_mb": memory, "capacity_mb": 16e3, "fits": True,
                "apart": 5 if kept_apart else 0, "optimizer_apart": kept_apart, "staged": True,
                "microbatches": 4, "stage_plans": names, "cpu_s": 2.0}

    srows = [{"case": "a", "what": "A", "states": 9,
              "plans": {"auto": staged(10.0, 8e3, False, ["ilp/2", "ilp/2"]),
                        "auto apart": staged(8.0, 6e3, True, ["ilp", "ilp/2"])}},
             {"case": "b", "what": "B", "states": 9,
              "plans": {"auto": staged(5.0, 8e3, False, ["ilp"]),
                        "auto apart": staged(5.0, 8e3, False, ["ilp"])}}]
    md = oa.render({"commit": "x", "date": "d", "machine": {"cpus": 2}, "rows": rows,
                    "staged": {"commit": "y", "date": "d", "rows": srows}})
    assert "- Step time apart / tied: geometric mean 0.894, range 0.800-1.000 over 2 cases; " \
           "faster in 1, equal in 1, slower in 0." in md
    a = [ln for ln in md.splitlines() if ln.startswith("| a |")][0].split("|")
    assert [c.strip() for c in a[6:13]] == ["2 stages x 4 mb: ilp/2 x2", "8.0", "6.00 of 16",
                                           "2 stages x 4 mb: ilp x1, ilp/2 x1", "apart", "5",
                                           "0.8000"]
    assert [ln for ln in md.splitlines() if ln.startswith("| b |")][0].split("|")[10].strip() \
        == "tied"


def test_sweep_holds_the_searchers_against_baselines_of_their_space():
    """``benchmarks/sweep.py``: `zero`'s plans are of the cost model with optimizer state apart,
    outside the default `ilp` / `auto`'s space, so the best-baseline ratios (where above 1 would
    be a bug) leave it out, and it has a section of its own (the committed sweep's rows, with
    `zero` made twice as fast as `ilp` on one cell)."""
    import json

    sw = _script("sweep")
    with open(BENCHMARKS / "results" / "sweep.json") as f:
        doc = json.load(f)
    cell = ("vit-base", "dgx-h100x1")
    rows = {(r["model"], r["topology"], r["strategy"]): r for r in doc["rows"]}
    ilp, zero = rows[(*cell, "ilp")], rows[(*cell, "zero")]
    zero.update(step_time=ilp["step_time"] / 2, fits=True)
    res = sw.Results(doc)
    assert res.apart == ["zero"] and "zero" not in res.rivals
    name, best = res.best_baseline(*cell)
    assert name != "zero" and best["step_time"] >= ilp["step_time"]
    md = sw.render(doc)
    assert "## `zero` against the searchers" in md
    row = [ln for ln in md.splitlines() if ln.startswith("| vit-base |") and " / " in ln][0]
    assert "| 2.000 / " in row
    assert not any("worse than a baseline" in ln and "vit-base / dgx-h100x1" in ln
                   for ln in md.splitlines())


def test_sweep_staged_rows_add_up():
    """The committed sweep's staged plans report what each stage sends per axis in time and
    bytes alike, and their step is the busiest group's compute, communication and bubble (the
    sweep's automatic checks once listed 152 staged axes with time and no bytes, and every staged
    step as other than compute + communication)."""
    import json

    sw = _script("sweep")
    with open(BENCHMARKS / "results" / "sweep.json") as f:
        doc = json.load(f)
    staged = [r for r in doc["rows"] if r["status"] == "ok"
              and any("/" in a for a in r["comm_time_by_axis"])]
    assert staged and all(r["comm_bytes"] and r["collectives"] for r in staged)
    found = sw.anomalies(sw.Results(doc))
    assert not [a for a in found if a.startswith(("time/bytes mismatch", "step != compute"))]


def test_alpa_report_says_which_rows_a_merge_replanned():
    """``benchmarks/alpa.py --merge`` keeps earlier runs' rows: the report's header names the
    cases the last run replanned and the commits the others come from (the committed JSON, and
    without the merge history: no such line)."""
    import json

    al = _script("alpa")
    with open(BENCHMARKS / "results" / "alpa.json") as f:
        doc = json.load(f)
    line = al._merge_line(doc)
    assert line.startswith(f" Merged (`--merge --cases ...`): this run replanned "
                           f"{', '.join(doc['ran'])}; the other rows are from the earlier runs at ")
    assert all(f"`{m['machine']['git_commit']}`" in line for m in doc["merged"])
    assert line in al.report(doc)
    assert al._merge_line({k: v for k, v in doc.items() if k != "merged"}) == ""


def test_published_rows_run_their_recipes_offloading():
    """The committed PUBLISHED table's Llama 3.1 rows on v6e offload what their MaxText recipes
    offload (the zoo's ``offload``), and move it over the host link; the other rows copy
    nothing; every overlapped step is its compute plus what it waits for."""
    import json

    pub = _script("published")
    with open(BENCHMARKS / "results" / "published.json") as f:
        rows = {r["recipe"]: r for r in json.load(f)["rows"]}
    for recipe in pub.RECIPES:
        r = rows[recipe.name]
        assert tuple(r["offload"]) == recipe.offload
        o = r["overlap"]
        assert (o["host_copy_s"] > 0) == bool(recipe.offload)
        assert r["overlapped_step_s"] == pytest.approx(
            o["compute_s"] + o["exposed_comm_s"] + o["exposed_host_copy_s"], rel=1e-6)
    offloading = [r for r in pub.RECIPES if r.offload]
    assert {r.name for r in offloading} == {"Llama 3.1 8B, v6e-256", "Llama 3.1 70B, v6e-256"}
