"""Plan explanations: per-layer rows that add up to the cost, in text, markdown and rich."""

import random
import re

import pytest
from rich.console import Console

import hulkjax as hj
from hulkjax.errors import HulkjaxError
from hulkjax.explain import explain, explanation, layer_label
from hulkjax.formatting import format_spec
from tests.viz.conftest import TWO_NODES


@pytest.mark.parametrize("strategy", ["replicate", "dp", "fsdp", "megatron", "dp_tp", "expert"])
def test_rows_add_up_to_the_plans_cost(gpt2_plans, strategy):
    plan = gpt2_plans[strategy]
    e = explanation(plan, collapse=False)
    c = plan.cost
    assert sum(r.compute for r in e.rows) == pytest.approx(c.compute_time, rel=1e-9)
    assert sum(r.comm for r in e.rows) == pytest.approx(c.comm_time, rel=1e-9, abs=1e-15)
    assert e.total_time == pytest.approx(c.step_time, rel=1e-9)
    assert e.total_memory == pytest.approx(c.peak_memory, rel=1e-9)
    for kind, b in c.memory_breakdown.items():
        assert sum(r.memory.get(kind, 0.0) for r in e.rows) == pytest.approx(b, rel=1e-9)
    # Collapsing repeated layers keeps the totals.
    e2 = explanation(plan)
    assert e2.total_time == pytest.approx(c.step_time, rel=1e-9)
    assert len(e2.rows) < len(e.rows)


def test_text_has_a_row_per_layer_with_layouts_links_and_times(gpt2_plans):
    plan = gpt2_plans["dp_tp"]
    text = explain(plan, fmt="text", collapse=False)
    lines = text.splitlines()
    assert lines[0] == "Plan 'dp_tp' on dgx-h100x2-4gpu (mesh node=2 x gpu=4)"
    assert "axis node (size 2): region links, 50 GB/s" in text
    assert "axis gpu (size 4): node links, 450 GB/s" in text
    layers = {n.layer for n in plan.graph.nodes if n.layer}
    for layer in ("GPT2/h_0/mlp/fc", "GPT2/h_1/mlp/proj", "GPT2/h_0/attn/query", "GPT2/wte"):
        assert layer in layers
        assert any(line.startswith(layer + " ") for line in lines), layer
    start = next(i for i, line in enumerate(lines) if line.startswith("GPT2/h_0/mlp/fc "))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith(" "))
    fc = "\n".join(lines[start:end])  # a row's cells may span several lines
    # Megatron on the fast gpu axis: column-split kernel, partial sums reduced inside the node.
    assert "kernel 64x256 [-, gpu]" in fc
    assert "[node, -, gpu]" in fc  # activation: batch over node, hidden over gpu
    assert re.search(r"AR node \(region\) x\d+", text)  # gradients over the slow axis
    assert re.search(r"AR gpu \(node\) x\d+", text)  # Megatron partial sums over the fast one
    assert "all-reduce over node (region links)" in text
    from hulkjax.formatting import format_time

    assert f"predicted step {format_time(plan.cost.step_time)} = compute" in text
    assert "total" in lines[next(i for i, ln in enumerate(lines) if ln.startswith("total"))]
    assert "(100%)" in text
    assert "memory per device" in text and "(fits)" in text


def test_repeated_layers_are_collapsed(gpt2_plans):
    text = explain(gpt2_plans["dp"], fmt="text")
    assert "GPT2/h_{0..1}/mlp/fc (x2)" in text
    assert "GPT2/h_0/mlp/fc " not in text
    assert "GPT2/h_0/mlp/fc " in explain(gpt2_plans["dp"], fmt="text", collapse=False)


def test_depth_coarsens_layers(gpt2_plans):
    e = explanation(gpt2_plans["fsdp"], depth=2, collapse=False)
    names = [r.layer for r in e.rows]
    assert "GPT2/h_0" in names and "GPT2/h_1" in names
    assert not any(n.count("/") > 1 for n in names)
    assert layer_label("GPT2/h_0/attn/bqhd,bkhd->bhqk") == "GPT2/h_0/attn"


def test_markdown_is_a_pipe_table(gpt2_plans):
    md = explain(gpt2_plans["fsdp"], fmt="markdown")
    lines = md.splitlines()
    assert lines[0].startswith("### Plan 'fsdp'")
    header = next(i for i, ln in enumerate(lines) if ln.startswith("| layer |"))
    assert set(lines[header + 1]) <= set("|-: ")
    table = [ln for ln in lines[header + 2:] if ln.startswith("|")]
    assert len(table) > 8
    n_cols = lines[header].count(" | ") + 1
    assert all(row.count(" | ") + 1 - row.count("\\|") == n_cols for row in table)
    assert any("AG node+gpu (region+node)" in row for row in table)  # fsdp gathers parameters
    assert any("<br>" in row for row in table)
    assert table[-1].startswith("| **total**")


def test_rich_renders_a_table(gpt2_plans):
    console = Console(record=True, width=240)
    console.print(explain(gpt2_plans["megatron"], fmt="rich"))
    out = console.export_text()
    assert "Plan 'megatron'" in out
    assert "GPT2/h_{0..1}/mlp/fc (x2)" in out
    assert "(region" in out or "(node" in out
    assert "total" in out


def test_geo_shows_wan_links(geo_plans):
    text = explain(geo_plans["dp"], fmt="text")
    assert "axis region (size 3): wan links" in text
    assert "AR region+gpu (wan+node)" in text and "WAN links between regions" in text
    assert "all-reduce over region+gpu (wan+node links)" in text


def test_summary_has_the_per_layer_table(gpt2_plans):
    s = gpt2_plans["fsdp"].summary()
    assert s.startswith("Plan 'fsdp' on mesh (node=2 x gpu=4)")
    assert "GPT2/h_{0..1}/mlp/fc (x2)" in s
    assert "parameter  [node+gpu" in s or "parameter" in s
    assert "all-gather over node+gpu" in s


def test_loaded_plan_has_totals_but_no_rows(gpt2_plans, tmp_path):
    gpt2_plans["dp"].save(tmp_path / "p.json")
    loaded = hj.Plan.load(tmp_path / "p.json")
    e = explanation(loaded)
    assert e.overlap is None  # no graph to schedule
    assert e.rows == [] and "no per-layer rows" in e.per_layer_note
    text = explain(loaded, fmt="text")
    assert "predicted step" in text and "no per-layer rows" in text
    assert "Plan 'dp'" in loaded.summary()


def test_stages_are_shown_when_the_plan_has_them(gpt2_tiny):
    m, (state, batch) = gpt2_tiny
    plan = hj.plan(m.step, state, batch, topology=TWO_NODES, strategy="pipeline")
    text = explain(plan, fmt="text")
    assert "stages (layers placed on device groups):" in text
    assert "stage 0 on devices 0..3 " in text and "stage 1 on devices 4..7 " in text
    assert "stage" in text.splitlines()[next(i for i, ln in enumerate(text.splitlines())
                                             if ln.startswith("layer "))]
    # Each stage's collectives per step, on its own axes, with their link classes.
    e = explanation(plan)
    assert [(c.kind, c.axes, c.count, c.bytes) for c in e.collectives] == [
        (c.kind, c.axes, c.count, c.bytes) for c in plan.cost.collectives]
    assert {a.split("/")[0] for c in e.collectives for a in c.axes} == {"s0", "s1"}
    assert all(set(c.links) == {"node"} for c in e.collectives)
    assert "collectives over the whole step" in text and "over s1/gpu (node links)" in text
    # Many (a staged plan's, stage by stage): the dearest, and how many more; so in the summary.
    from dataclasses import replace

    from hulkjax.explain.render import render_text
    from hulkjax.formatting import format_time
    from hulkjax.plan.cost import PredictedCollective
    many = [replace(c, time=c.time * (1 + i)) for i in range(20) for c in e.collectives]
    lines = render_text(replace(e, collectives=many)).splitlines()
    at = lines.index("collectives over the whole step (link class in parentheses):")
    assert lines[at + 25].startswith(f"  ... and {len(many) - 24} more, each at most ")
    assert lines[at + 1].endswith(format_time(max(c.time for c in many)))
    summary = replace(plan, cost=replace(plan.cost, collectives=tuple(
        PredictedCollective(kind=c.kind, axes=c.axes, count=c.count, bytes=c.bytes, time=c.time)
        for c in many))).summary(max_rows=10)
    assert f"  ... and {len(many) - 10} more (plan.cost.collectives)" in summary.splitlines()
    spmd = hj.plan(m.step, state, batch, topology=TWO_NODES, strategy="dp")
    assert "stages (" not in explain(spmd, fmt="text")


def test_gradients_reduced_once_per_step_are_charged_once():
    """A staged plan whose stages split the batch over their nodes accumulates its gradients
    unreduced: the per-layer rows charge each one's all-reduce over the batch axis once per
    step (not once per microbatch), and the pipeline lines say what it costs."""
    from hulkjax import zoo

    m = zoo.get("mlp", size="tiny")
    sites = hj.Topology.preset("regional", regions=2, nodes_per_region=2, gpus_per_node=2)
    plan = hj.plan(m.step, *m.abstract(), topology=sites, strategy="pipeline", microbatches=4)
    assert all(st.unreduced for st in plan.stages)
    e = explanation(plan, collapse=False)
    counts = [c.count for r in e.rows for c in r.collectives
              if c.kind == "all-reduce" and any(a.endswith("/node") for a in c.axes)]
    assert sum(counts) == sum(len(st.unreduced) for st in plan.stages)
    assert "gradients reduced once per step" in explain(plan, fmt="text")


def test_bad_format_is_an_error(gpt2_plans):
    with pytest.raises(HulkjaxError, match="fmt='html'"):
        explain(gpt2_plans["dp"], fmt="html")


def test_format_spec_reads_both_spec_forms():
    from jax.sharding import PartitionSpec as P

    assert format_spec(P(None, "model")) == "[-, model]"
    assert format_spec(((), ("node", "gpu"))) == "[-, node+gpu]"
    assert format_spec(P()) == format_spec(((), ())) == "replicated"


def test_a_plan_without_choices_is_re_derived_from_its_argument_layouts(gpt2_tiny):
    m, (state, batch) = gpt2_tiny
    plan = hj.plan(m.step, state, batch, topology=TWO_NODES, strategy="dp_tp")
    plan.assignment = None  # e.g. a planner that only sets argument layouts
    e = explanation(plan)
    assert e.rows
    if abs(e.total_time - plan.cost.step_time) > 1e-6 * plan.cost.step_time:
        assert "re-derived from the argument layouts" in e.per_layer_note
    else:
        assert e.per_layer_note == ""


@pytest.mark.parametrize("strategy", ["dp", "fsdp", "ilp"])
def test_rows_add_up_for_a_scanned_model(strategy):
    """A scan over the layers is one operator whose cost is its body plan's, times its length."""
    from hulkjax import zoo

    m = zoo.get("gpt2", size="tiny", scan_layers=True)
    state, batch = m.abstract()
    plan = hj.plan(m.step, state, batch, topology=TWO_NODES, strategy=strategy)
    assert plan.bodies, "the scan's body plan is part of the plan"
    e = explanation(plan, collapse=False)
    c = plan.cost
    assert sum(r.compute for r in e.rows) == pytest.approx(c.compute_time, rel=1e-9)
    assert e.total_time == pytest.approx(c.step_time, rel=1e-9)
    assert e.total_memory == pytest.approx(c.peak_memory, rel=1e-9)


def test_the_overlap_lines_say_what_the_step_waits_for(gpt2_plans):
    """``explain`` shows the overlapped step next to the additive one: what XLA's scheduler
    hides on the plan's backend (GPU here) and the collectives the step still waits for, the
    longest exposed first, each with the seconds :meth:`CostModel.overlapped` leaves exposed."""
    from hulkjax.formatting import format_time

    plan = gpt2_plans["dp_tp"]
    e = explanation(plan)
    o = e.overlap
    assert o is not None and o.backend == "gpu"
    assert o.step_time <= plan.cost.step_time * (1 + 1e-9)
    assert o.hidden and o.exposed  # per-layer gradients hide; the last ones cannot
    text = explain(plan)
    assert (f"with overlap (gpu: XLA's latency-hiding scheduler, collectives combined as "
            f"compiled): step {format_time(o.step_time)}; "
            f"{format_time(o.hidden_comm_time)} of {format_time(o.comm_time)} communication "
            f"hidden under compute ({len(o.hidden)} of {len(o.collectives)} collectives)") in text
    worst = max(o.exposed, key=lambda c: c.exposed_seconds * c.trips)
    first = next(ln for ln in text.splitlines() if ln.startswith("  waits for "))
    assert first.startswith(f"  waits for {worst.kind} over {'+'.join(worst.axes)}")
    assert f"{format_time(worst.exposed_seconds * worst.trips)} exposed" in first
    # fsdp: a weight's gather read by the forward and the backward matmul, made once by the
    # program and charged once by the cost (it was charged per reader): nothing more to say
    # of layout changes. (GPT-2's tied embedding: its two gradients' all-reduces are one on
    # GPU, the sum's, and the objective prices that: nothing charged apart.)
    fsdp = gpt2_plans["fsdp"]
    o = explanation(fsdp).overlap
    assert abs(o.reused_comm_time) < 1e-9 * o.additive_time
    assert o.reassociated_comm_time == 0
    assert "more for layout changes than the program makes" not in explain(fsdp)
    # Layouts at random: some change inside a group is also needed by another group's operator
    # (or a path's step by a direct change), which the cost prices apart.
    from hulkjax.strategies.realize import cost_model, plan_from_assignment

    cm = cost_model(fsdp.graph, fsdp.topology)
    rng = random.Random(2)
    a = [rng.randrange(len(grp.candidates)) for grp in cm.groups]
    odd = plan_from_assignment(cm, a, "random")
    odd.graph, odd.topology = fsdp.graph, fsdp.topology
    o = explanation(odd).overlap
    assert o.reused_comm_time > 1e-3 * o.additive_time
    assert (f"charges {format_time(o.reused_comm_time)} more for layout changes than the "
            f"program makes" in explain(odd))


def test_explain_says_what_the_cost_charges_for_all_reduces_xla_gpu_merges():
    """Three partial sums added: XLA:GPU all-reduces their sum once. The objective prices the
    first add's merge (two groups' layouts decide it), not the second's (three do): explain
    says how much of the step that one all-reduce is."""
    import jax.numpy as jnp

    from hulkjax.formatting import format_time
    from hulkjax.topology.specs import DEVICE_SPECS

    def step(x, y, w, v, a, b):
        return x.T @ y + w.T @ v + a.T @ b

    x = jnp.ones((4096, 1024))
    topo = hj.Topology.grid((8,), ("d",), device=DEVICE_SPECS["H100"])
    plan = hj.plan(step, *[x] * 6, topology=topo, strategy="dp")
    o = explanation(plan).overlap
    # two of the three partial sums' all-reduces charged: the first add's merge is priced
    assert plan.cost.collectives[0].bytes == 2 * 1024 * 1024 * 4
    assert o.backend == "gpu" and o.reassociated_comm_time == pytest.approx(
        plan.cost.comm_time / 2, rel=1e-9)
    assert (f"charges {format_time(o.reassociated_comm_time)} for all-reduces gpu does not "
            f"make") in explain(plan)
