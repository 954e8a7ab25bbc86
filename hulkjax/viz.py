"""Plots of plans, topologies and training curves (matplotlib).

Where this sits::

    hj.compare(...) -> {name: Plan} --> plot_comparison   (step time split by link class, memory)
    Plan (graph + cost model)       --> plot_graph        (operator graph coloured by layout)
    Topology [+ Plan]               --> plot_topology     (regions > nodes > devices, links)
    GNN training history            --> plot_training_curves

Every function returns a ``matplotlib.figure.Figure``, draws into ``ax`` when one is given (and
then returns ``ax.figure``), and writes a PNG when ``path`` is given. Figures are created without
``pyplot``, so nothing here needs a display or touches pyplot's global state (safe under the Agg
backend, in threads and in the CLI). In Jupyter, run ``%matplotlib inline`` once so a returned
figure is drawn.

>>> import hulkjax as hj
>>> from hulkjax import viz
>>> fig = viz.plot_topology(hj.Topology.preset("geo"))
>>> fig.axes[0].get_title()
"topology 'geo-3x2': 6 devices in 3 regions"
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np

from hulkjax.explain import attribute, layer_label
from hulkjax.formatting import byte_unit, format_bytes, format_rate, format_time, time_unit
from hulkjax.topology.specs import LinkSpec

__all__ = ["plot_comparison", "plot_graph", "plot_topology", "plot_training_curves",
           "LINK_COLORS"]

LINK_COLORS = {"compute": "#4c72b0", "node": "#55a868", "region": "#dd8452", "wan": "#c44e52"}
"""Colours of compute and of communication per link class (shared by the plots)."""

_LINK_NAMES = {"node": "comm inside a node", "region": "comm between nodes",
               "wan": "comm between regions (WAN)"}
_MEMORY_COLORS = {"parameters": "#4c72b0", "gradients": "#8172b3", "optimizer": "#937860",
                  "transients": "#ccb974",
                  "activations": "#da8bc3", "data": "#8c8c8c"}


# ---- helpers ---------------------------------------------------------------------------------
def _figure(ax, figsize, ncols=1):
    """``(fig, [axes])``: new figure (no pyplot) or the given axes."""
    if ax is not None:
        axes = list(ax) if isinstance(ax, Sequence | np.ndarray) else [ax]
        return axes[0].figure, axes
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def _save(fig, path):
    if path is not None:
        fig.savefig(path, dpi=110, bbox_inches="tight", facecolor="white")
    return fig


def _cost_of(p):
    return getattr(p, "cost", p)


# ---- plot_comparison -------------------------------------------------------------------------
def plot_comparison(plans: Mapping, *, ax=None, path=None, title: str | None = None,
                    scale: str = "auto"):
    """Per strategy: predicted step time split into compute and communication per link class
    (stacked bars), and memory per device by kind against the device's capacity.

    Args:
      plans: ``{name: Plan}`` (e.g. from ``hj.compare``); a ``hulkjax.Cost`` works as a value too.
      ax: a pair of axes ``(time_ax, memory_ax)`` to draw into.
      path: write a PNG here.
      title: figure title (default: the topology's name).
      scale: time axis ``"linear"``, ``"log"``, or ``"auto"`` (log when the totals span more
        than 30x, e.g. when some strategies cross a WAN).

    The best strategy (fastest among those that fit in memory) is marked with a star; strategies
    that do not fit are hatched and labelled. A staged plan's bar is its busiest stage's compute
    and collectives plus the pipeline bubble (fill, drain, waiting on transfers); its memory is
    its fullest stage's.
    """
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    names = list(plans)
    if not names:
        raise ValueError("plot_comparison needs at least one plan")
    costs = [_cost_of(plans[n]) for n in names]
    if any(c is None for c in costs):
        raise ValueError(f"plans without a cost: {[n for n, c in zip(names, costs) if c is None]}")
    fig, axes = _figure(ax, (12, 2.2 + 0.5 * len(names)), ncols=2)
    if len(axes) < 2:
        raise ValueError("plot_comparison draws two panels: pass ax=(time_ax, memory_ax)")
    tax, max_ = axes[0], axes[1]
    y = np.arange(len(names))[::-1]
    tunit, tscale = time_unit(max(c.step_time for c in costs))
    fitting = [c.step_time for c in costs if c.fits and all(st.fits for st in c.stages)]
    best = min(fitting) if fitting else None
    classes = [k for k in ("node", "region", "wan")
               if any(c.link_class.get(a) == k and t for c in costs
                      for a, t in c.comm_time_by_axis.items())]
    segments = [("compute", np.array([c.compute_time for c in costs]), LINK_COLORS["compute"])]

    def by_class(c, k):
        t = sum(t for a, t in c.comm_time_by_axis.items() if c.link_class.get(a) == k)
        if c.stages:  # staged: every stage's axes are listed; show the busiest stage's share
            total = sum(c.comm_time_by_axis.values())
            return t * c.comm_time / total if total else 0.0
        return t

    for k in classes:
        vals = np.array([by_class(c, k) for c in costs])
        segments.append((_LINK_NAMES.get(k, f"comm ({k})"), vals, LINK_COLORS.get(k, "#999999")))
    if any(c.stages for c in costs):
        segments.append(("pipeline bubble",
                         np.array([c.bubble for c in costs]), "#c7c7c7"))
    totals = np.array([c.step_time for c in costs]) / tscale
    positive = totals[totals > 0]
    if scale == "auto":
        scale = "log" if len(positive) and positive.max() / positive.min() > 30 else "linear"
    if scale not in ("linear", "log"):
        raise ValueError(f"scale={scale!r}: use 'auto', 'linear' or 'log'")
    # Log scale: bars start at a floor below the smallest total and every segment spans its
    # cumulative [start, end) interval, so the boundaries are exact and the ends are the totals.
    floor = 10 ** math.floor(math.log10(positive.min() / 4)) if scale == "log" and len(
        positive) else 0.0
    bottom = np.zeros(len(names))
    for label, vals, color in segments:
        lo = np.maximum(bottom, floor)
        hi = np.maximum(bottom + vals / tscale, floor)
        tax.barh(y, hi - lo, left=lo, color=color, label=label, height=0.6)
        bottom = bottom + vals / tscale
    xmax = max(bottom.max(), 1e-30)
    for yi, c, total in zip(y, costs, bottom):
        at = total * 1.08 if scale == "log" else total + 0.01 * xmax
        tax.text(at, yi, f"{total:.3g} {tunit}"
                 + ("" if c.step_time == 0 else f"  ({c.efficiency:.0%} eff.)"),
                 va="center", fontsize=9)
    labels = [("★ " if best is not None and c.step_time == best else "") + n
              for n, c in zip(names, costs)]
    tax.set_yticks(y, labels)
    for tick, c in zip(tax.get_yticklabels(), costs):
        if best is not None and c.step_time == best:
            tick.set_fontweight("bold")
        if not c.fits:
            tick.set_color(LINK_COLORS["wan"])
    if scale == "log":
        tax.set_xscale("log")
        tax.set_xlim(floor, xmax * 12)
        tax.set_xlabel(f"predicted step time ({tunit}, log scale)")
    else:
        tax.set_xlim(0, xmax * 1.35)
        tax.set_xlabel(f"predicted step time ({tunit})")
    tax.set_title("step time: compute + communication by link class")
    tax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=4, fontsize=8,
               frameon=False)
    tax.grid(axis="x", alpha=0.3)
    tax.set_axisbelow(True)

    # Memory per device.
    cap = min(c.memory_capacity for c in costs)
    peak = max(c.peak_memory for c in costs)
    munit, mscale = byte_unit(max(peak, cap if math.isfinite(cap) and peak > 0.05 * cap else 0))
    kinds = [k for k in _MEMORY_COLORS if any(c.memory_breakdown.get(k) for c in costs)]
    kinds += sorted({k for c in costs for k in c.memory_breakdown} - set(kinds))
    left = np.zeros(len(names))
    for k in kinds:
        vals = np.array([c.memory_breakdown.get(k, 0.0) for c in costs]) / mscale
        bars = max_.barh(y, vals, left=left, color=_MEMORY_COLORS.get(k, "#cccccc"), label=k,
                         height=0.6)
        for b, c in zip(bars, costs):
            if not c.fits:
                b.set_hatch("//")
                b.set_edgecolor("white")
        left += vals
    mmax = max(left.max(), 1e-30)
    handles = [Patch(color=_MEMORY_COLORS.get(k, "#cccccc"), label=k) for k in kinds]
    if math.isfinite(cap) and peak > 0.05 * cap:
        max_.axvline(cap / mscale, color=LINK_COLORS["wan"], ls="--", lw=1.5)
        max_.text(cap / mscale, y.max() + 0.45, f" capacity {cap / mscale:.3g} {munit}",
                  color=LINK_COLORS["wan"], fontsize=8, va="bottom", ha="center")
        mmax = max(mmax, cap / mscale)
        handles.append(Line2D([], [], color=LINK_COLORS["wan"], ls="--", label="capacity"))
    elif math.isfinite(cap):
        max_.text(0.98, 0.02, f"device capacity {cap / byte_unit(cap)[1]:.3g} "
                  f"{byte_unit(cap)[0]} (off scale: every plan uses < 5%)",
                  transform=max_.transAxes, ha="right", va="bottom", fontsize=8,
                  color="#555555")
    for yi, c, total in zip(y, costs, left):
        txt = f"{total:.3g} {munit}" + ("" if c.fits else "  does not fit")
        max_.text(total + 0.01 * mmax, yi, txt, va="center", fontsize=9,
                  color="black" if c.fits else LINK_COLORS["wan"])
    max_.set_yticks(y, [""] * len(names))
    max_.set_xlim(0, mmax * 1.35)
    max_.set_ylim(y.min() - 0.6, y.max() + 0.9)
    tax.set_ylim(y.min() - 0.6, y.max() + 0.9)
    max_.set_xlabel(f"predicted peak memory per device ({munit})")
    max_.set_title("memory per device")
    max_.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=6,
                fontsize=8, frameon=False)
    max_.grid(axis="x", alpha=0.3)
    max_.set_axisbelow(True)
    if title is None:
        topo = getattr(plans[names[0]], "topology", None)
        title = f"strategies on {topo.name}" if topo is not None else "strategies"
        if topo is not None:
            title += " (mesh " + " x ".join(f"{a}={n}" for a, n in
                                            zip(topo.axis_names, topo.shape)) + ")"
    if ax is None:
        fig.suptitle(title, fontsize=12, fontweight="bold")
    return _save(fig, path)


# ---- plot_graph ------------------------------------------------------------------------------
_PHASES = ("forward", "backward", "update")
_CATEGORY_COLORS = ["#4c72b0", "#dd8452", "#55a868", "#8172b3", "#937860", "#da8bc3",
                    "#ccb974", "#64b5cd", "#c44e52", "#8c8c8c"]


def _phases(g) -> list[str]:
    """forward / backward / update per node: updates are non-backward operators that read a
    backward result (the optimizer), found by propagation in execution order."""
    tainted = set()
    out = []
    for n in g.nodes:
        if n.backward:
            phase = "backward"
        elif any(v is not None and v in tainted for v in n.inputs):
            phase = "update"
        else:
            phase = "forward"
        if phase != "forward":
            tainted.update(n.outputs)
        out.append(phase)
    return out


def _layout_category(spec) -> str:
    if not spec or not any(spec):
        return "replicated"
    parts = []
    if spec[0]:
        parts.append(f"{'+'.join(spec[0])} on dim 0")
    inner = [a for axes in spec[1:] for a in axes]
    if inner:
        parts.append(f"{'+'.join(dict.fromkeys(inner))} on inner dims")
    return ", ".join(parts)


def plot_graph(plan, *, level: str = "layer", depth: int | None = None, max_nodes: int = 60,
               ax=None, path=None, title: str | None = None):
    """The operator graph of a plan, coarsened, coloured by sharding choice.

    Nodes are layers (``level="layer"``: ``Node.layer`` scopes, cut to ``depth`` components, or to
    the deepest depth with at most ``max_nodes`` boxes in all) or cost-model groups
    (``level="group"``), split by phase: forward, backward and the optimizer update each get a band.
    Inside a band, x is the topological layer of the coarsened forward graph (a layer's backward
    and update sit under its forward). Colour: the layout of the values the node produces,
    weighted by bytes (which mesh axes split dim 0, which split inner dims). Size: predicted time.
    Red edges change layout (and communicate); their width grows with the time spent.

    Args:
      plan: a plan with a graph (from ``hj.plan`` / ``hj.compare``).
      level: ``"layer"`` or ``"group"``.
      depth / max_nodes: coarsening (see above).
      ax, path, title: as in :func:`plot_comparison`.
    """
    import networkx as nx
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyArrowPatch

    if plan.graph is None:
        raise ValueError("plot_graph needs plan.graph: plan with hj.plan(...) (a plan loaded from "
                         "JSON has no graph)")
    if level not in ("layer", "group"):
        raise ValueError(f"level={level!r}: use 'layer' or 'group'")
    at = attribute(plan)
    g = at.graph
    phase = _phases(g)
    full = {n.id: at.node_layer[n.id] for n in g.nodes}
    if level == "layer":
        if depth is None:
            deepest = max((len(v.split("/")) for v in full.values()), default=1)
            depth = deepest
            while depth > 1:
                n_boxes = len({(layer_label(v, depth), phase[k]) for k, v in full.items()})
                if n_boxes <= max_nodes:
                    break
                depth -= 1
        label = {k: (layer_label(v, depth) if not v.startswith("(") else v)
                 for k, v in full.items()}
        key = {n.id: (label[n.id], phase[n.id]) for n in g.nodes}
    else:
        gon = at.cm.group_of_node
        key = {}
        for n in g.nodes:
            grp = at.cm.groups[gon[n.id]]
            lead = g.nodes[grp.leader] if grp.leader is not None else None
            name = at.group_layer[grp.id] + (f" {lead.name}" if lead is not None else "")
            ph = phase[grp.leader] if lead is not None else ("update" if grp.kind == "input"
                                                              else phase[n.id])
            key[n.id] = (f"{name} #{grp.id}", ph)
    boxes = list(dict.fromkeys(key[n.id] for n in g.nodes))
    index = {b: i for i, b in enumerate(boxes)}
    # Time, layout category (by bytes) per box.
    time = np.zeros(len(boxes))
    cat_bytes: list[dict[str, float]] = [defaultdict(float) for _ in boxes]
    for n in g.nodes:
        i = index[key[n.id]]
        time[i] += at.compute[n.id] + sum(c.time for c in at.own.get(n.id, ()))
        for o in n.outputs:
            spec = at.specs.get(o)
            if spec is not None and g.values[o].shape:
                cat_bytes[i][_layout_category(spec)] += g.values[o].nbytes
    edges: dict[tuple[int, int], float] = defaultdict(float)
    for n in g.nodes:
        for v in n.inputs:  # scalars (step counters, loss scales) carry no layout: not drawn
            p = None if v is None or not g.values[v].shape else g.values[v].producer
            if p is not None and key[p] != key[n.id]:
                edges[(index[key[p]], index[key[n.id]])] += 0.0
    for v, nid, _gc, ch in at.moves:
        p = g.values[v].producer
        if nid < 0 or p is None:
            continue
        i, j = index[key[p]], index[key[nid]]
        if i == j:
            time[i] += ch.time
        elif g.values[v].shape:
            edges[(i, j)] += ch.time
        else:
            time[j] += ch.time
    category = [max(cb, key=cb.get) if cb else "replicated" for cb in cat_bytes]
    cats = sorted(set(category), key=lambda c: (c != "replicated", c))
    color_of = {c: _CATEGORY_COLORS[k % len(_CATEGORY_COLORS)] for k, c in enumerate(cats)}
    if "replicated" in color_of:
        color_of["replicated"] = "#bbbbbb"

    # Layout: topological layers of the forward boxes (edges going back in execution order are
    # dropped, so repeated scopes such as a residual stream do not make cycles).
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(boxes)))
    dag.add_edges_from((i, j) for (i, j) in edges if i < j)
    col = {}
    for gen, layer_nodes in enumerate(nx.topological_generations(dag)):
        for b in layer_nodes:
            col[b] = gen
    fwd_col = {boxes[b][0]: col[b] for b in range(len(boxes)) if boxes[b][1] == "forward"}
    x = {}
    for b, (name, ph) in enumerate(boxes):
        x[b] = fwd_col.get(name, col[b]) if ph != "forward" else col[b]
    # Stack boxes sharing a column inside their band; bands from the top: fwd, bwd, update.
    slots: dict[tuple[str, int], list[int]] = defaultdict(list)
    for b in range(len(boxes)):
        slots[(boxes[b][1], x[b])].append(b)
    height = {ph: max([len(v) for (p, _), v in slots.items() if p == ph], default=0)
              for ph in _PHASES}
    base, ypos = 0.0, {}
    band_span = {}
    for ph in _PHASES:
        if not height[ph]:
            continue
        top = base
        for (p, _x), members in slots.items():
            if p != ph:
                continue
            for k, b in enumerate(members):
                ypos[b] = top - k - (height[ph] - len(members)) / 2
        band_span[ph] = (top - height[ph] + 1, top)
        base = top - height[ph] - 1.2
    ncols = max(x.values()) + 1 if x else 1
    nrows = -base
    fig, (axis,) = _figure(ax, (min(max(8, 0.75 * ncols + 2), 26), min(max(4, 0.55 * nrows + 1.5), 16)))
    for ph, (lo, hi) in band_span.items():
        axis.axhspan(lo - 0.5, hi + 0.5, color="#f3f3f3", zorder=0)
        axis.text(-0.8, (lo + hi) / 2, ph, rotation=90, va="center", ha="center", fontsize=10,
                  color="#666666")
    tmax = max(time.max(), 1e-30)
    comm_max = max(edges.values(), default=0.0) or 1e-30
    for (i, j), t in edges.items():
        red = t > 0
        arrow = FancyArrowPatch(
            (x[i], ypos[i]), (x[j], ypos[j]), arrowstyle="-|>", mutation_scale=8,
            connectionstyle=f"arc3,rad={0.25 if x[i] == x[j] else 0.08}",
            color=LINK_COLORS["wan"] if red else "#9a9a9a", alpha=0.9 if red else 0.35,
            lw=(1.0 + 3.0 * t / comm_max) if red else 0.6, shrinkA=7, shrinkB=7, zorder=1)
        axis.add_patch(arrow)
    sizes = 60 + 540 * np.sqrt(time / tmax)
    for b in range(len(boxes)):
        axis.scatter([x[b]], [ypos[b]], s=sizes[b], color=color_of[category[b]],
                     edgecolors="black", linewidths=0.5, zorder=3)
    if len(boxes) <= 3 * max_nodes:
        for b, (name, _ph) in enumerate(boxes):
            short = "/".join(name.split("/")[-2:]) if level == "layer" else name
            axis.annotate(short, (x[b], ypos[b]), xytext=(0, 7 + math.sqrt(sizes[b]) / 2),
                          textcoords="offset points", ha="center", va="bottom", fontsize=7,
                          rotation=25, zorder=4)
    handles = [Line2D([], [], marker="o", ls="", markersize=8, markerfacecolor=color_of[c],
                      markeredgecolor="black", label=c) for c in cats]
    handles.append(Line2D([], [], color=LINK_COLORS["wan"], lw=2, label="layout change (comm)"))
    axis.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
                title="layout of results", title_fontsize=8, frameon=False)
    axis.set_xlim(-1.3, ncols + 0.3)
    axis.set_ylim(base + 0.4, 1.6)
    axis.set_xticks([])
    axis.set_yticks([])
    for s in axis.spines.values():
        s.set_visible(False)
    if title is None:
        title = (f"plan {plan.strategy!r}: {len(g.nodes)} operators in {len(boxes)} "
                 f"{'layers' if level == 'layer' else 'groups'}"
                 + (f" (depth {depth})" if level == "layer" else "")
                 + "; size = predicted time")
    axis.set_title(title, fontsize=11)
    return _save(fig, path)


# ---- plot_topology ---------------------------------------------------------------------------
def _grid_shape(n: int) -> tuple[int, int]:
    cols = math.ceil(math.sqrt(n))
    return cols, math.ceil(n / cols)


def plot_topology(topology, plan=None, *, ax=None, path=None, title: str | None = None):
    """Devices grouped by region and node, links coloured and weighted by bandwidth (log scale).

    Regions are boxes (placed on a circle when there are more than two), nodes are boxes inside
    them, devices are dots coloured by kind. Lines: between mesh-neighbour devices of a node (the
    intra-node link), between nodes of a region, and between regions (labelled with bandwidth and
    latency). With a ``plan``, a box lists each mesh axis with its link class and what the plan
    spends on it; with a staged plan, each stage's devices are ringed in its colour and labelled
    with its layers, arrows follow the pipeline, and the box lists the transfers per link.
    """
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import LogNorm
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyBboxPatch

    topo = topology
    regions = list(topo.regions)
    nodes_of = {r: list(dict.fromkeys(d.node for d in topo.devices if d.region == r))
                for r in regions}
    devs_of = {n: [d.id for d in topo.devices if d.node == n] for n in topo.nodes}
    coords = np.array(np.unravel_index(np.arange(topo.num_devices), topo.shape)).T
    # Device positions inside a node: their mesh coordinates if they span <= 2 axes, else a grid.
    local: dict[int, tuple[float, float]] = {}
    node_size = {}
    node_axes: dict[str, list[tuple[str, str]]] = {}  # node -> [(mesh axis, direction)]
    for n, ids in devs_of.items():
        c = coords[ids]
        varying = [k for k in range(c.shape[1]) if len(set(c[:, k])) > 1]
        node_axes[n] = [(topo.axis_names[k], "") for k in varying]
        if 1 <= len(varying) <= 2 and len({tuple(r) for r in c[:, varying]}) == len(ids):
            ax0 = varying[-1]
            ax1 = varying[0] if len(varying) == 2 else None
            xs = {v: k for k, v in enumerate(sorted(set(c[:, ax0])))}
            ys = {v: k for k, v in enumerate(sorted(set(c[:, ax1])))} if ax1 is not None else {0: 0}
            if ax1 is None and len(xs) > 8:  # wrap a long row
                cols, _ = _grid_shape(len(ids))
                for k, d in enumerate(ids):
                    local[d] = (k % cols, -(k // cols))
            else:
                for d, row in zip(ids, c):
                    local[d] = (xs[row[ax0]], -(ys[row[ax1]] if ax1 is not None else 0))
                node_axes[n] = [(topo.axis_names[ax0], "→")] + (
                    [(topo.axis_names[ax1], "↓")] if ax1 is not None else [])
        else:
            cols, _ = _grid_shape(len(ids))
            for k, d in enumerate(ids):
                local[d] = (k % cols, -(k // cols))
        w = max(local[d][0] for d in ids) + 1
        h = -min(local[d][1] for d in ids) + 1
        node_size[n] = (w, h)
    pad = 0.45
    # Nodes inside regions: a grid of node boxes.
    region_size, node_pos = {}, {}
    for r in regions:
        ns = nodes_of[r]
        cols, rows = _grid_shape(len(ns)) if len(ns) > 3 else (len(ns), 1)
        cw = max(node_size[n][0] for n in ns) + 2 * pad
        ch = max(node_size[n][1] for n in ns) + 2 * pad + 0.8  # + name above, links below
        for k, n in enumerate(ns):
            node_pos[n] = ((k % cols) * (cw + 0.8), -(k // cols) * (ch + 0.8))
        region_size[r] = (cols * (cw + 0.8) - 0.8, rows * (ch + 0.8) - 0.8, cw, ch)
    # Regions: a row for one or two, else a circle.
    rw = max(s[0] for s in region_size.values()) + 2
    rh = max(s[1] for s in region_size.values()) + 2.5
    region_pos = {}
    if len(regions) <= 2:
        for k, r in enumerate(regions):
            region_pos[r] = (k * (rw + 3.0), 0.0)
    else:
        radius = max(rw, rh) * len(regions) / (2 * math.pi) * 1.35 + max(rw, rh) / 2
        for k, r in enumerate(regions):
            ang = math.pi / 2 - 2 * math.pi * k / len(regions)
            region_pos[r] = (radius * math.cos(ang) - region_size[r][0] / 2,
                             radius * math.sin(ang) + region_size[r][1] / 2)
    dev_xy = {}
    node_box = {}
    for r in regions:
        rx, ry = region_pos[r]
        for n in nodes_of[r]:
            nx_, ny_ = node_pos[n]
            cw, ch = region_size[r][2], region_size[r][3]
            x0, y0 = rx + nx_, ry + ny_
            node_box[n] = (x0, y0 - ch, cw, ch)
            w, h = node_size[n]
            ox = x0 + (cw - w) / 2 + 0.5
            oy = y0 - 0.5 - pad - (ch - 2 * pad - 0.8 - h) / 2 - 0.5
            for d in devs_of[n]:
                lx, ly = local[d]
                dev_xy[d] = (ox + lx, oy + ly)
    # Links.
    lines = []  # (p, q, link, label or None, zorder)
    inside = {}  # node -> its intra-node links, for a label under the devices
    for n, ids in devs_of.items():
        pairs = [(a, b) for i, a in enumerate(ids) for b in ids[i + 1:]
                 if np.abs(coords[a] - coords[b]).sum() == 1]
        if not pairs and len(ids) > 1:
            pairs = list(zip(ids[:-1], ids[1:]))
        for a, b in pairs:
            lines.append((dev_xy[a], dev_xy[b], topo.link(a, b), None, 2))
        inside[n] = sorted({topo.link(a, b) for a, b in pairs}, key=lambda ln: ln.bandwidth)

    def centre(n):
        x0, y0, w, h = node_box[n]
        return (x0 + w / 2, y0 + h / 2)

    for r in regions:
        ns = nodes_of[r]
        if len(ns) < 2:
            continue
        if len(ns) <= 6:
            pairs = [(a, b) for i, a in enumerate(ns) for b in ns[i + 1:]]
        else:  # many nodes: a chain in grid order keeps the picture readable
            pairs = list(zip(ns[:-1], ns[1:]))
        for a, b in pairs:
            link = topo.link(devs_of[a][0], devs_of[b][0])
            lbl = (f"{format_rate(link.bandwidth)}\n{format_time(link.latency)}"
                   if (a, b) == pairs[0] else None)
            lines.append((centre(a), centre(b), link, lbl, 0.5))
    rcentre = {}
    for r in regions:
        rx, ry = region_pos[r]
        rcentre[r] = (rx + region_size[r][0] / 2, ry - region_size[r][1] / 2)
    for i, ra in enumerate(regions):
        for rb in regions[i + 1:]:
            da = topo.devices[devs_of[nodes_of[ra][0]][0]].id
            db = topo.devices[devs_of[nodes_of[rb][0]][0]].id
            link = topo.link(da, db)
            lines.append((rcentre[ra], rcentre[rb], link,
                          f"{format_rate(link.bandwidth)}, {format_time(link.latency)}", -1))
    if not lines:  # a single device
        lines.append((dev_xy[0], dev_xy[0], LinkSpec(bandwidth=1.0, latency=0.0), None, 2))
    bws = [ln[2].bandwidth for ln in lines]
    lo, hi = min(bws), max(bws)
    norm = LogNorm(vmin=lo / 1.5, vmax=hi * 1.5)
    cmap = __import__("matplotlib").colormaps["plasma"]

    def width(bw):
        if hi <= lo:
            return 2.5
        return 1.5 + 3.5 * (math.log(bw) - math.log(lo)) / (math.log(hi) - math.log(lo))

    xs = [x for x0, _, w, _ in node_box.values() for x in (x0, x0 + w)]
    ys = [y for _, y0, _, h in node_box.values() for y in (y0, y0 + h)]
    if len(regions) > 1:
        xs += [region_pos[r][0] - 0.6 for r in regions]
        xs += [region_pos[r][0] + region_size[r][0] + 0.6 for r in regions]
        ys += [region_pos[r][1] + 1.6 for r in regions]
        ys += [region_pos[r][1] - region_size[r][1] - 0.6 for r in regions]
    n_lines, per_line = len(topo.axis_names), 0.45
    if plan is not None and getattr(plan, "stages", None) is not None and plan.cost is not None:
        n_lines, per_line = min(len(plan.cost.transfers), 7) + 1, 0.75
    extra = (1.2 + per_line * n_lines) if plan is not None else 0.0
    extent_w = max(xs) - min(xs) + 0.6
    extent_h = max(ys) - min(ys) + 0.6 + extra
    scale = min(11 / extent_w, 7 / extent_h, 0.9)  # inches per device spacing
    fig, (axis,) = _figure(ax, (max(6.0, extent_w * scale + 2.8), max(3.5, extent_h * scale + 1.0)))
    for r in regions if len(regions) > 1 else ():  # one region: its nodes say enough
        rx, ry = region_pos[r]
        w, h = region_size[r][0], region_size[r][1]
        axis.add_patch(FancyBboxPatch((rx - 0.5, ry - h - 0.5), w + 1.0, h + 1.6,
                                      boxstyle="round,pad=0.1,rounding_size=0.6",
                                      fc="#eef3fb", ec="#6c8ebf", lw=1.2, zorder=0))
        axis.text(rx + w / 2, ry + 0.75, f"region {r}", ha="center", va="bottom", fontsize=10, fontweight="bold", color="#2a4d7f")
    for n, (x0, y0, w, h) in node_box.items():
        axis.add_patch(FancyBboxPatch((x0, y0), w, h, boxstyle="round,pad=0.05,rounding_size=0.3",
                                      fc="white", ec="#888888", lw=1.0, zorder=1))
        axis.text(x0 + w / 2, y0 + h - 0.15, n, ha="center", va="top", fontsize=8.5,
                  color="#333333", zorder=2)
        if inside.get(n):
            if topo.axis_links is not None or len(node_axes[n]) > 1:
                rates = ", ".join(f"{a}{arrow} {format_rate(topo.axis_bandwidth(a))}"
                                  for a, arrow in node_axes[n])
            else:
                rates = " - ".join(dict.fromkeys(format_rate(ln.bandwidth) for ln in inside[n]))
            axis.text(x0 + w / 2, y0 + 0.1, rates, ha="center", va="bottom",
                      fontsize=7.5, color="#555555", zorder=2)
    for p, q, link, lbl, z in lines:
        axis.plot([p[0], q[0]], [p[1], q[1]], color=cmap(norm(link.bandwidth)),
                  lw=width(link.bandwidth), solid_capstyle="round", zorder=z, alpha=0.9)
        if lbl:
            axis.text((p[0] + q[0]) / 2, (p[1] + q[1]) / 2, lbl, fontsize=7.5, ha="center",
                      va="center", zorder=5,
                      bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="#cccccc", alpha=0.95))
    kinds = list(dict.fromkeys(d.spec.kind for d in topo.devices))
    kind_color = {k: _CATEGORY_COLORS[i % len(_CATEGORY_COLORS)] for i, k in enumerate(kinds)}
    for d in topo.devices:
        xx, yy = dev_xy[d.id]
        axis.scatter([xx], [yy], s=90, color=kind_color[d.spec.kind], edgecolors="black",
                     linewidths=0.6, zorder=3)
    if topo.num_devices <= 64:
        for d in topo.devices:
            xx, yy = dev_xy[d.id]
            axis.text(xx, yy, str(d.id), fontsize=5.5, ha="center", va="center", color="white",
                      zorder=4)
    handles = [Line2D([], [], marker="o", ls="", markersize=8, markerfacecolor=kind_color[k],
                      markeredgecolor="black",
                      label=f"{k} ({sum(d.spec.kind == k for d in topo.devices)})")
               for k in kinds]
    axis.legend(handles=handles, loc="upper right", bbox_to_anchor=(1.0, 0.0), fontsize=8,
                ncol=len(handles), title="devices", title_fontsize=8, frameon=False)
    sm = ScalarMappable(norm=norm, cmap=cmap)
    cb = fig.colorbar(sm, ax=axis, shrink=0.6, pad=0.02, aspect=25)
    cb.set_label("link bandwidth (log scale; line width too)", fontsize=8)
    ticks = []
    span = max(math.log10(norm.vmax / norm.vmin), 1e-9)
    for t in sorted({ln[2].bandwidth for ln in lines}):  # no overlapping labels
        if not ticks or math.log10(t / ticks[-1]) > 0.06 * span:
            ticks.append(t)
    cb.set_ticks(ticks, labels=[format_rate(t) for t in ticks], fontsize=8)
    cb.minorticks_off()
    staged = plan is not None and getattr(plan, "stages", None) is not None
    if staged:
        _draw_stages(axis, topo, plan, dev_xy)
    if plan is not None and getattr(plan, "cost", None) is not None and staged:
        c = plan.cost
        txt = [f"plan {plan.strategy!r}: {len(plan.stages)} stages x {plan.microbatches} "
               f"microbatches ({plan.schedule}), step {format_time(c.step_time)}, bubble "
               f"{format_time(c.bubble)}"]
        for t in c.transfers:
            if t.microbatch_bytes or t.step_bytes:
                txt.append(f"stage {t.src} -> {t.dst} ({t.link}, {format_rate(t.bandwidth)}): "
                           f"{format_bytes(t.microbatch_bytes)} / microbatch, "
                           f"{format_bytes(t.step_bytes)} / step, {format_time(t.time)}")
        axis.text(0.01, 0.01, "\n".join(txt[:8]), transform=axis.transAxes, fontsize=8,
                  va="bottom", bbox=dict(boxstyle="round", fc="white", ec="#999999", alpha=0.95),
                  zorder=6)
    elif plan is not None and getattr(plan, "cost", None) is not None:
        c = plan.cost
        txt = [f"plan {plan.strategy!r}: step {format_time(c.step_time)}"]
        for a, size in zip(topo.axis_names, topo.shape):
            txt.append(f"axis {a} (size {size}, {topo.axis_scope(a)} links, "
                       f"{format_rate(topo.axis_bandwidth(a))}): comm "
                       f"{format_time(c.comm_time_by_axis.get(a, 0.0))}, "
                       f"{format_bytes(c.comm_bytes.get(a, 0.0))}")
        axis.text(0.01, 0.01, "\n".join(txt), transform=axis.transAxes, fontsize=8, va="bottom",
                  bbox=dict(boxstyle="round", fc="white", ec="#999999", alpha=0.95), zorder=6)
    axis.set_aspect("equal")
    axis.autoscale_view()
    axis.set_xlim(min(xs) - 0.3, max(xs) + 0.3)
    axis.set_ylim(min(ys) - 0.3 - extra, max(ys) + 0.3)
    axis.set_xticks([])
    axis.set_yticks([])
    for s in axis.spines.values():
        s.set_visible(False)
    if title is None:
        title = (f"topology '{topo.name}': {topo.num_devices} devices in "
                 f"{len(regions)} region{'s' if len(regions) > 1 else ''}")
    axis.set_title(title, fontsize=11)
    return _save(fig, path)


def _draw_stages(axis, topo, plan, dev_xy) -> None:
    """A staged plan on the topology: each stage's devices ringed in its colour and labelled with
    its layers; arrows along the pipeline between consecutive stages."""
    from matplotlib.patches import FancyArrowPatch

    colors = ["#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#e377c2", "#8c564b",
              "#bcbd22"]
    centres = []
    for k, st in enumerate(plan.stages):
        col = colors[k % len(colors)]
        pts = np.array([dev_xy[d] for d in st.devices])
        axis.scatter(pts[:, 0], pts[:, 1], s=260, facecolors="none", edgecolors=col,
                     linewidths=2.2, zorder=3.5)
        cx, top = float(pts[:, 0].mean()), float(pts[:, 1].max())
        centres.append((cx, float(pts[:, 1].mean())))
        first = st.layers[0] if st.layers else "-"
        last = st.layers[-1] if st.layers else "-"
        span = first if first == last else f"{_short(first)} .. {_short(last)}"
        axis.text(cx, top + 0.55, f"stage {k}: {span}", ha="center", va="bottom", fontsize=7.5,
                  color=col, fontweight="bold", zorder=6,
                  bbox=dict(boxstyle="round,pad=0.15", fc="white", ec=col, alpha=0.9))
    for k in range(len(centres) - 1):
        arrow = FancyArrowPatch(centres[k], centres[k + 1], arrowstyle="-|>", mutation_scale=14,
                                connectionstyle="arc3,rad=0.2", color="#444444", lw=1.6,
                                alpha=0.8, zorder=5)
        axis.add_patch(arrow)


def _short(label: str) -> str:
    parts = label.split("/")
    return "/".join(parts[-2:]) if len(parts) > 2 else label


# ---- plot_training_curves ----------------------------------------------------------------------
def plot_training_curves(history: Mapping[str, Sequence[float]], *, ax=None, path=None,
                         title: str | None = "GNN planner training"):
    """Training curves of the learned planner: losses in one panel, cost ratios in another.

    Args:
      history: ``{"train_loss": [...], "val_cost_ratio": [...], ...}``: one value per epoch.
        Keys containing ``"loss"`` go to the left panel (log scale when positive), the others
        (cost ratios: planner cost / ILP optimum) to the right one, with the optimum (1.0) marked.
      ax: one axes (everything in it) or a pair (losses, ratios).
    """
    series = {k: np.asarray(v, dtype=float) for k, v in history.items()
              if isinstance(v, Sequence | np.ndarray) and len(v)}
    if not series:
        raise ValueError(f"history has no non-empty series: keys {list(history)}")
    losses = [k for k in series if "loss" in k]
    others = [k for k in series if k not in losses]
    panels = [p for p in (losses, others) if p]
    if ax is not None and not isinstance(ax, Sequence | np.ndarray):
        fig, axes = _figure(ax, None)
        axes = axes * len(panels)
    else:
        fig, axes = _figure(ax, (5.2 * len(panels), 3.8), ncols=len(panels))
    for axis, keys in zip(axes, panels):
        for k in keys:
            y = series[k]
            axis.plot(np.arange(1, len(y) + 1), y, marker="o" if len(y) <= 30 else None,
                      markersize=3, label=k)
        if keys is losses and all((series[k] > 0).all() for k in keys):
            axis.set_yscale("log")
        if keys is others and any("ratio" in k for k in keys):
            axis.axhline(1.0, color="black", ls="--", lw=1, label="optimum (ILP) = 1")
        axis.set_xlabel("epoch")
        axis.set_ylabel("loss" if keys is losses else "value")
        axis.set_title("loss" if keys is losses else "planner cost / optimal cost"
                       if any("ratio" in k for k in keys) else "metrics")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    if title and ax is None:
        fig.suptitle(title, fontsize=12, fontweight="bold")
    return _save(fig, path)
