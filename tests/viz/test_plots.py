"""Plots return figures with the expected artists and labels (and write PNGs)."""

import dataclasses

import pytest
from matplotlib.figure import Figure

import hulkjax as hj
from hulkjax import viz
from tests.viz.conftest import TWO_NODES

PNG = b"\x89PNG\r\n\x1a\n"


def _texts(fig):
    out = []
    for ax in fig.axes:
        out += [t.get_text() for t in ax.texts]
        out += [t.get_text() for t in ax.get_yticklabels() + ax.get_xticklabels()]
        out += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
        if ax.get_legend() is not None:
            out += [t.get_text() for t in ax.get_legend().get_texts()]
    if fig._suptitle is not None:
        out.append(fig._suptitle.get_text())
    return out


def test_comparison_stacks_compute_and_comm_per_link_class(gpt2_plans, tmp_path):
    path = tmp_path / "cmp.png"
    fig = viz.plot_comparison(gpt2_plans, path=path, scale="linear")
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    assert path.read_bytes()[:8] == PNG
    tax, max_ = fig.axes
    legend = [t.get_text() for t in tax.get_legend().get_texts()]
    assert legend == ["compute", "comm inside a node", "comm between nodes"]
    ticks = [t.get_text() for t in tax.get_yticklabels()]
    best = min(gpt2_plans, key=lambda n: gpt2_plans[n].cost.step_time)
    assert f"★ {best}" in ticks
    assert {t.lstrip("★ ") for t in ticks} == set(gpt2_plans)
    # One bar per strategy and segment; the stack reaches the predicted step time.
    n = len(gpt2_plans)
    assert len(tax.patches) == 3 * n
    widths = [sum(p.get_width() for p in tax.patches[k::n]) for k in range(n)]
    unit = 1e-3 if "(ms)" in tax.get_xlabel() else 1e-6 if "(us)" in tax.get_xlabel() else 1.0
    for w, name in zip(widths, gpt2_plans):
        assert w * unit == pytest.approx(gpt2_plans[name].cost.step_time, rel=1e-6)
    mem_legend = [t.get_text() for t in max_.get_legend().get_texts()]
    assert "parameters" in mem_legend and "optimizer" in mem_legend
    assert "memory per device" in max_.get_title()
    assert any("device capacity 80 GB" in t for t in _texts(fig))  # far off scale: noted


def test_comparison_marks_plans_that_do_not_fit_and_takes_costs_and_axes(geo_plans):
    costs = {n: p.cost for n, p in geo_plans.items()}
    big = dataclasses.replace(costs["dp"], peak_memory=2 * costs["dp"].memory_capacity)
    costs["dp-too-big"] = big
    # The same plan over a WAN 1000x slower: its step spans far more than 30x the others'.
    dp = costs["dp"]
    slow_axes = {a: t * 1000 for a, t in dp.comm_time_by_axis.items()}
    costs["dp-slow-wan"] = dataclasses.replace(
        dp, comm_time_by_axis=slow_axes, comm_time=sum(slow_axes.values()),
        step_time=dp.compute_time + sum(slow_axes.values()))
    from matplotlib.figure import Figure as F

    fig = F()
    axes = fig.subplots(1, 2)
    out = viz.plot_comparison(costs, ax=axes, title="geo")
    assert out is fig
    texts = _texts(fig)
    assert any("does not fit" in t for t in texts)
    assert "comm between regions (WAN)" in texts
    assert any(t == "capacity" for t in texts)  # the capacity line is on scale now
    # The slow-WAN plan takes over 30x the others: the time axis turns logarithmic.
    tax = fig.axes[0]
    assert tax.get_xscale() == "log" and "log scale" in tax.get_xlabel()
    ends = sorted(max(p.get_x() + p.get_width() for p in tax.patches if abs(p.get_y() + 0.3 - yy)
                      < 1e-6) for yy in {round(p.get_y() + 0.3, 6) for p in tax.patches})
    unit = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[tax.get_xlabel().split("(")[1].split(",")[0]]
    assert [e * unit for e in ends] == pytest.approx(sorted(c.step_time for c in costs.values()))


def test_graph_is_coarsened_and_coloured_by_layout(gpt2_plans, tmp_path):
    plan = gpt2_plans["dp_tp"]
    fig = viz.plot_graph(plan, path=tmp_path / "g.png")
    assert (tmp_path / "g.png").read_bytes()[:8] == PNG
    (ax,) = fig.axes
    boxes = [c for c in ax.collections if len(c.get_offsets()) == 1]
    assert 10 <= len(boxes) <= 60
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "node on dim 0, gpu on inner dims" in legend  # Megatron MLP activations
    assert "layout change (comm)" in legend
    texts = [t.get_text() for t in ax.texts]
    assert {"forward", "backward", "update"} <= set(texts)
    assert "h_0/mlp" in texts
    # A smaller budget coarsens further; the group view has one dot per cost-model group.
    few = viz.plot_graph(plan, max_nodes=12)
    assert len([c for c in few.axes[0].collections if len(c.get_offsets()) == 1]) < len(boxes)
    groups = viz.plot_graph(plan, level="group")
    assert "groups" in groups.axes[0].get_title()


def test_graph_needs_the_traced_graph(gpt2_plans, tmp_path):
    gpt2_plans["dp"].save(tmp_path / "p.json")
    with pytest.raises(ValueError, match="plan.graph"):
        viz.plot_graph(hj.Plan.load(tmp_path / "p.json"))


def test_topology_groups_devices_and_weights_links(geo_plans, tmp_path):
    geo = hj.Topology.preset("geo")
    fig = viz.plot_topology(geo, geo_plans["dp"], path=tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG
    assert len(fig.axes) == 2  # the plot and the bandwidth colour bar
    ax = fig.axes[0]
    texts = [t.get_text() for t in ax.texts]
    for region in ("oregon", "virginia", "ohio"):
        assert f"region {region}" in texts
    assert "98.8 MB/s, 67 ms" in texts  # the slowest WAN pair
    assert any(t.startswith("plan 'dp'") and "axis region" in t for t in texts)
    assert "log scale" in fig.axes[1].get_ylabel()
    widths = sorted({round(ln.get_linewidth(), 3) for ln in ax.lines})
    assert len(widths) >= 2  # WAN lines thinner than NVLink ones
    assert ax.get_title() == "topology 'geo-3x2': 6 devices in 3 regions"


def test_topology_shows_device_kinds_and_meshes():
    fig = viz.plot_topology(hj.Topology.preset("hetero"))
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["A100 (4)", "V100 (4)"]
    fig = viz.plot_topology(hj.Topology.preset("tpu-v5e"))
    # A 4x4 torus slice: 24 neighbour links drawn inside its one node.
    assert len(fig.axes[0].lines) == 24
    fig = viz.plot_topology(TWO_NODES)
    assert any("50 GB/s" in t.get_text() for t in fig.axes[0].texts)


def test_training_curves(tmp_path):
    history = {"train_loss": [2.0, 1.0, 0.5, 0.4], "val_loss": [2.2, 1.3, 0.9, 0.8],
               "val_cost_ratio": [1.6, 1.2, 1.05, 1.02]}
    fig = viz.plot_training_curves(history, path=tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:8] == PNG
    loss_ax, ratio_ax = fig.axes
    assert [ln.get_label() for ln in loss_ax.lines] == ["train_loss", "val_loss"]
    assert loss_ax.get_yscale() == "log"
    labels = [ln.get_label() for ln in ratio_ax.lines]
    assert labels == ["val_cost_ratio", "optimum (ILP) = 1"]
    assert list(ratio_ax.lines[0].get_ydata()) == history["val_cost_ratio"]
    assert loss_ax.get_xlabel() == "epoch"
    one = Figure().subplots()
    assert viz.plot_training_curves({"train_loss": [1.0, 0.5]}, ax=one) is one.figure
    with pytest.raises(ValueError, match="no non-empty series"):
        viz.plot_training_curves({"train_loss": []})


def test_viz_does_not_import_pyplot():
    import subprocess
    import sys

    code = ("import hulkjax as hj, sys; from hulkjax import viz; "
            "viz.plot_topology(hj.Topology.preset('geo')); "
            "viz.plot_training_curves({'train_loss': [1, 0.5]}); "
            "print('matplotlib.pyplot' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "MPLBACKEND": "Agg"}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
