"""What a plan does, layer by layer: the data behind :func:`hulkjax.explain.explain`.

Every operator's predicted compute, every collective the cost model charges (the operator's own
partial sums, layout changes inside a cost-model group and on edges between groups) and every byte
of per-device memory is read from the cost model's own records (:meth:`CostModel.breakdown`) and
attributed to one layer, so the rows add up to ``plan.cost``: the *total* row equals
``cost.step_time`` and ``cost.peak_memory``. Nothing here re-derives a number.

A node's layer is its ``Node.layer`` (the module scope, e.g. ``"GPT2/h_3/attn"``) with einsum scopes
folded into their module (``".../bqhd,bkhd->bhqk"`` -> ``".../attn"``). Operators without a scope
(optimizer updates, the loss) take the layer of the operand they follow (the cost model's lead), or
of their cost-model group for graph inputs, so a parameter's update is charged to the parameter's
layer. Repeated layers with identical rows (``h_0`` ... ``h_11``) are shown once as
``GPT2/h_{0..11}/attn (x12)`` with totals over the repeats.

>>> import hulkjax as hj, jax.numpy as jnp
>>> plan = hj.plan(lambda w, x: (x @ w).sum(), jnp.ones((64, 64)), jnp.ones((128, 64)),
...                topology=hj.Topology.grid((8,), ("d",)), strategy="dp")
>>> e = explanation(plan)
>>> abs(e.total_time - plan.cost.step_time) < 1e-12
True
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from hulkjax.cost.model import FREE, INPUT, LEADER
from hulkjax.cost.overlap import Overlap
from hulkjax.formatting import (
    SHORT_COLLECTIVES,
    format_bytes,
    format_shape,
    format_spec,
    format_time,
)
from hulkjax.strategies.realize import plan_cost_model
from hulkjax.strategies.specbuilder import complete
from hulkjax.strategies.stages import stage_models
from hulkjax.trace.graph import DATA, OPTIMIZER, PARAMETER

_MEMORY_KINDS = ("parameters", "gradients", "optimizer", "activations", "transients", "data")
BATCH, OPTIMIZER_ROW, CONSTANTS, UNSCOPED = "(batch)", "(optimizer)", "(constants)", "(outside modules)"

@dataclass
class CollectiveUse:
    """Collectives of one kind over one set of mesh axes inside one layer.

    Attributes:
      kind: ``"all-reduce" | "reduce-scatter" | "all-gather" | "all-to-all"``.  # str
      axes: mesh axes, in mesh order.  # tuple of str
      links: link class of each axis (``"node" | "region" | "wan"``), same order.  # tuple of str
      count: how many.  # int
      bytes: per-device bytes of the tensors moved (the cost model's convention).  # float
      time: predicted seconds.  # float
    """

    kind: str
    axes: tuple[str, ...]
    links: tuple[str, ...]
    count: int = 0
    bytes: float = 0.0
    time: float = 0.0

    def short(self) -> str:
        """``"AR node (region) x3, 256 B, 12 us"``."""
        return (f"{SHORT_COLLECTIVES.get(self.kind, self.kind)} {'+'.join(self.axes)} "
                f"({'+'.join(dict.fromkeys(self.links))}) x{self.count}, "
                f"{format_bytes(self.bytes)}, {format_time(self.time)}")


@dataclass
class LayerRow:
    """One row of the per-layer table.

    Attributes:
      layer: the layer label; repeated layers read ``"GPT2/h_{0..11}/attn"``.  # str
      count: how many identical layers the row stands for.  # int
      parameters: ``"kernel 768x3072 [-, gpu]"`` per parameter leaf.  # list of str
      optimizer: how the optimizer state of those parameters is laid out.  # list of str
      activations: ``"16x1024x768 [node+gpu, -, -]"`` per distinct forward result layout.  # list
      collectives: what the layer's operators and layout changes communicate.  # list of CollectiveUse
      compute / comm: predicted seconds, totals over the ``count`` layers.  # float
      memory: per-device bytes by kind (``parameters``, ``gradients``, ``optimizer``,
        ``activations``, ``data``), totals over the ``count`` layers.  # dict
      stages: indices into ``plan.stages`` its operators run in (empty for SPMD plans).  # tuple
      order: position of its first operator in the step (rows are sorted by it).  # int
    """

    layer: str
    count: int = 1
    parameters: list[str] = field(default_factory=list)
    optimizer: list[str] = field(default_factory=list)
    activations: list[str] = field(default_factory=list)
    collectives: list[CollectiveUse] = field(default_factory=list)
    compute: float = 0.0
    comm: float = 0.0
    memory: dict[str, float] = field(default_factory=dict)
    stages: tuple[int, ...] = ()
    order: int = 0

    @property
    def time(self) -> float:
        """``compute + comm``."""
        return self.compute + self.comm

    @property
    def memory_total(self) -> float:
        return float(sum(self.memory.values()))

    @property
    def label(self) -> str:
        return self.layer if self.count == 1 else f"{self.layer} (x{self.count})"


@dataclass
class AxisInfo:
    """A mesh axis: its size, the links its collectives cross and what the plan sends over it."""

    name: str
    size: int
    link_class: str  # "node" | "region" | "wan"
    bandwidth: float  # bytes/s
    latency: float  # seconds
    comm_time: float  # seconds the plan spends on it
    comm_bytes: float  # bytes each device sends over it
    per_axis: bool = False  # the topology gives this axis its own link (Topology.grid, tori)


@dataclass
class Explanation:
    """Everything :func:`explain` renders (build it with :func:`explanation`).

    Attributes:
      strategy / topology_name / mesh: what was planned, on what.  # str
      axes: one :class:`AxisInfo` per mesh axis.
      cost: the plan's ``hulkjax.Cost`` (``None`` if the planner gave none).
      rows: per-layer rows in step order (empty when the plan has no graph: a loaded plan).
      collectives: whole-step collectives with link classes (from ``cost.collectives``).
      stages: ``[(device group text, [layer labels])]`` for staged plans; ``None`` for SPMD plans.
      notes: the planner's notes.
      per_layer_note: why there are no rows, or why they do not add up to the cost.
      pipeline: lines on a staged plan's pipeline: per-stage times and memory, the bubble, the
        transfers per link (empty for SPMD plans).
      overlap: the step with its collectives overlapped with compute as XLA's latency-hiding
        scheduler runs them on the topology's backend, and which ones it hides
        (:func:`hulkjax.cost.overlap.overlap`; ``None`` for staged plans and plans without a
        graph).
    """

    strategy: str
    topology_name: str
    mesh: str
    axes: list[AxisInfo]
    cost: object
    rows: list[LayerRow]
    collectives: list[CollectiveUse]
    stages: list[tuple[str, list[str]]] | None
    notes: list[str]
    per_layer_note: str = ""
    pipeline: list[str] = field(default_factory=list)
    overlap: Overlap | None = None

    @property
    def total_time(self) -> float:
        return float(sum(r.time for r in self.rows))

    @property
    def total_memory(self) -> float:
        return float(sum(r.memory_total for r in self.rows))



# ---- building it ---------------------------------------------------------------------------
def layer_label(layer: str, depth: int | None = None) -> str:
    """The module path of a ``Node.layer``: einsum scopes folded, cut to ``depth`` components.

    >>> layer_label("GPT2/h_0/attn/bqhd,bkhd->bhqk"), layer_label("GPT2/h_0/mlp/fc", depth=2)
    ('GPT2/h_0/attn', 'GPT2/h_0')
    """
    parts = [p for p in layer.split("/") if p and "->" not in p]
    if depth is not None:
        parts = parts[:max(depth, 1)]
    return "/".join(parts)


def _plan_assignment(plan, cm):
    if plan.assignment is not None:
        return list(plan.assignment)
    return complete(cm, [t.spec for t in plan.inputs])


class _Acc:
    __slots__ = ("compute", "comms", "memory", "params", "optimizer", "activations", "order",
                 "nodes")

    def __init__(self):
        self.compute = 0.0
        self.comms: dict[tuple, CollectiveUse] = {}
        self.memory: dict[str, float] = defaultdict(float)
        self.params: list[str] = []
        self.optimizer: dict[str, None] = {}  # ordered set
        self.activations: dict[str, None] = {}  # ordered set
        self.order = 1 << 60
        self.nodes: set[int] = set()


def _group_layers(cm, depth) -> dict[int, str]:
    """A layer label for every cost-model group (what its unscoped operators are charged to)."""
    g = cm.graph
    out: dict[int, str] = {}
    for grp in cm.groups:
        label = ""
        if grp.kind == LEADER:
            label = layer_label(g.nodes[grp.leader].layer, depth)
        elif grp.kind == INPUT:
            roles = [g.input_roles[i] for i in grp.inputs]
            if DATA in roles:
                label = BATCH
            elif PARAMETER not in roles:
                label = OPTIMIZER_ROW
            else:
                uses = sorted((nid for i in grp.inputs for nid, _ in g.consumers(g.inputs[i])),
                              key=lambda nid: (g.nodes[nid].backward, nid))
                label = next((layer_label(g.nodes[n].layer, depth) for n in uses
                              if layer_label(g.nodes[n].layer, depth)), "")
                if not label:  # unscoped model: name the layer after the parameter's path
                    path = g.input_paths[grp.inputs[0]].split("/")
                    label = "/".join(path[2:-1] if len(path) > 3 else path[-1:])
        if not label:
            members = [layer_label(g.nodes[n].layer, depth) for n in grp.members]
            members = [m for m in members if m]
            label = (Counter(members).most_common(1)[0][0] if members  # ties: first seen
                     else CONSTANTS if grp.kind == FREE else UNSCOPED)
        out[grp.id] = label
    return out


@dataclass(frozen=True)
class Charge:
    """One collective the cost model charges: kind, mesh axes (mesh order), bytes, seconds."""

    kind: str
    axes: tuple[str, ...]
    bytes: float
    time: float


@dataclass
class Attribution:
    """Where the cost model's time and memory go, operator by operator (what explain and the plots
    aggregate). Built by :func:`attribute`; the sums equal ``plan.cost``.

    Attributes:
      graph / topology / cm / assignment: the plan's graph, topology, cost model and choices.
      group_layer: a layer label per cost-model group.  # dict[int, str]
      node_layer: a layer label per node: its own scope; else (unscoped: optimizer updates, the
        loss) the layer of the operand it follows, or its group's for graph inputs.  # dict
      specs: planned layout of every value (the cost model's specs).  # dict[int, Spec]
      compute: predicted compute seconds per node.  # list of float
      own: collectives each operator implies itself (partial sums).  # dict[int, list[Charge]]
      moves: layout changes of operands: ``(value, consumer node, consumer group, Charge)``;
        consumer node ``-1`` is a state result going back to its input's layout.
      memory: ``(node or None, group, kind, bytes)``: per-device bytes; parameters, gradients,
        optimizer state and data belong to their input group, activations to their producer.
    """

    graph: object
    topology: object
    cm: object
    assignment: list
    group_layer: dict
    node_layer: dict
    specs: dict
    compute: list
    own: dict
    moves: list
    memory: list


def attribute(plan, depth: int | None = None) -> Attribution:
    """Per-operator compute, collectives and memory of a plan (needs ``plan.graph``), from the
    cost model's records (:meth:`~hulkjax.cost.CostModel.breakdown`)."""
    if plan.stages is not None:
        return _staged_attribution(plan, depth)
    g, topo = plan.graph, plan.topology
    cm = plan_cost_model(g, topo, plan)
    a = _plan_assignment(plan, cm)
    order = tuple(topo.axis_names)
    group_layer = _group_layers(cm, depth)
    node_layer: dict[int, str] = {}
    for n in g.nodes:  # unscoped operators take the layer of the operand they follow
        label = layer_label(n.layer, depth)
        if not label:
            k = cm.lead.get(n.id)
            v = n.inputs[k] if k is not None else None
            p = None if v is None else g.values[v].producer
            label = node_layer[p] if p is not None else group_layer[cm.group_of_node[n.id]]
        node_layer[n.id] = label

    def charge(c) -> Charge:
        return Charge(c.kind, tuple(sorted(c.axes, key=order.index)), c.bytes, cm.comm_time(c))

    b = cm.breakdown(a)
    own = {nid: [charge(c) for c in comms] for nid, comms in b.made().items()}
    moves = [(m.value, m.node, m.group, charge(m.comm)) for m in b.moves if not m.repeat]
    memory = [(u.node, u.group, u.kind, u.bytes) for u in b.memory]
    return Attribution(graph=g, topology=topo, cm=cm, assignment=a, group_layer=group_layer,
                       node_layer=node_layer, specs=b.specs, compute=b.compute, own=own,
                       moves=moves, memory=memory)


def _layer_accumulators(plan, depth, at: Attribution | None = None):
    at = attribute(plan, depth) if at is None else at
    g, cm, topo = at.graph, at.cm, at.topology
    link_class = {ax: topo.axis_scope(ax) for ax in topo.axis_names}
    acc: dict[str, _Acc] = defaultdict(_Acc)

    def charge(layer, chs):
        for ch in chs:
            key = (ch.kind, ch.axes)
            use = acc[layer].comms.get(key)
            if use is None:
                use = acc[layer].comms[key] = CollectiveUse(
                    kind=ch.kind, axes=ch.axes, links=tuple(link_class[x] for x in ch.axes))
            use.count += 1
            use.bytes += ch.bytes
            use.time += ch.time

    for nid, t in enumerate(at.compute):
        lay = acc[at.node_layer[nid]]
        lay.compute += t
        lay.nodes.add(nid)
        lay.order = min(lay.order, nid)
        charge(at.node_layer[nid], at.own.get(nid, ()))
    for _v, nid, gc, ch in at.moves:  # charged to the layer of the operator that needs the layout
        charge(at.node_layer[nid] if nid >= 0 else at.group_layer[gc], (ch,))
    for nid, gid, kind, b in at.memory:
        acc[at.node_layer[nid] if nid is not None else at.group_layer[gid]].memory[kind] += b
    for grp in cm.groups:
        if grp.kind == INPUT:
            layer = acc[at.group_layer[grp.id]]
            spec = at.specs[g.inputs[grp.inputs[0]]]
            params = [i for i in grp.inputs if g.input_roles[i] == PARAMETER]
            opt = [i for i in grp.inputs if g.input_roles[i] == OPTIMIZER]
            for i in params:
                v = g.values[g.inputs[i]]
                layer.params.append(f"{_leaf_name(g.input_paths[i])} "
                                    f"{format_shape(v.shape)} {format_spec(spec)}")
            if params and opt:
                layer.optimizer[f"{len(opt) // len(params)} per param, same layout"] = None
            elif opt or (not params and g.input_roles[grp.inputs[0]] == DATA):
                for i in grp.inputs:
                    v = g.values[g.inputs[i]]
                    entry = (f"{_leaf_name(g.input_paths[i])} {format_shape(v.shape)} "
                             f"{format_spec(spec)}")
                    if g.input_roles[i] == OPTIMIZER:
                        layer.optimizer[entry] = None
                    else:
                        layer.params.append(entry)
            uses = [nid for i in grp.inputs for nid, _ in g.consumers(g.inputs[i])]
            layer.order = min([layer.order, *uses]) if uses else layer.order
        elif grp.kind == LEADER:
            node = g.nodes[grp.leader]
            if not node.backward:
                lay = acc[at.node_layer[node.id]]
                for o in node.outputs:
                    lay.activations[f"{format_shape(g.values[o].shape)} "
                                    f"{format_spec(at.specs[o])}"] = None
    # Layers without a leader: show the layout of their largest forward result.
    for name, lay in acc.items():
        if lay.activations or not lay.nodes or name in (BATCH, OPTIMIZER_ROW, CONSTANTS):
            continue
        fwd = [o for nid in lay.nodes if not g.nodes[nid].backward for o in g.nodes[nid].outputs
               if o in at.specs and g.values[o].shape]
        if fwd:
            o = max(fwd, key=lambda v: (g.values[v].size, -v))
            lay.activations[f"{format_shape(g.values[o].shape)} {format_spec(at.specs[o])}"] = None
    return acc


def _leaf_name(path: str) -> str:
    """``"state/params/dense_0/kernel/value"`` (flax.nnx) -> ``"kernel"``."""
    parts = [p for p in path.split("/") if p not in ("value", "raw_value")]
    return parts[-1] if parts else path


_NUM = re.compile(r"^(.*?)(\d+)$")


def _ranges(nums: list[int]) -> str:
    nums = sorted(set(nums))
    if nums == list(range(nums[0], nums[-1] + 1)):
        return f"{{{nums[0]}..{nums[-1]}}}"
    return "{" + ",".join(map(str, nums)) + "}"


def _collapse(rows: list[LayerRow]) -> list[LayerRow]:
    """Merge rows of repeated layers (labels that differ only in numbers, identical content)."""
    def norm(label):
        return tuple(_NUM.sub(r"\1#", p) for p in label.split("/"))

    def sig(r):
        return (norm(r.layer), tuple(r.parameters), tuple(r.optimizer), tuple(r.activations),
                tuple((c.kind, c.axes, c.count, round(c.bytes)) for c in r.collectives),
                f"{r.compute:.4g}", f"{r.comm:.4g}", f"{r.memory_total:.4g}", r.stages)

    buckets: dict[tuple, list[LayerRow]] = {}
    for r in rows:
        buckets.setdefault(sig(r), []).append(r)
    out = []
    for members in buckets.values():
        first = members[0]
        if len(members) == 1 or first.layer.startswith("("):
            out.extend(members)
            continue
        parts = [p.split("/") for p in (m.layer for m in members)]
        label = []
        for k, comp in enumerate(parts[0]):
            comps = [p[k] for p in parts]
            if len(set(comps)) == 1:
                label.append(comp)
            else:
                label.append(_NUM.match(comp).group(1) + _ranges([int(_NUM.match(c).group(2))
                                                                  for c in comps]))
        merged = LayerRow(layer="/".join(label), count=sum(m.count for m in members),
                          parameters=first.parameters, optimizer=first.optimizer,
                          activations=first.activations, stages=first.stages, order=first.order,
                          compute=sum(m.compute for m in members),
                          comm=sum(m.comm for m in members))
        mem: dict[str, float] = defaultdict(float)
        colls: dict[tuple, CollectiveUse] = {}
        for m in members:
            for k, b in m.memory.items():
                mem[k] += b
            for c in m.collectives:
                t = colls.setdefault((c.kind, c.axes), CollectiveUse(c.kind, c.axes, c.links))
                t.count += c.count
                t.bytes += c.bytes
                t.time += c.time
        merged.memory = dict(mem)
        merged.collectives = list(colls.values())
        out.append(merged)
    return sorted(out, key=lambda r: r.order)


def explanation(plan, *, depth: int | None = None, collapse: bool = True) -> Explanation:
    """The data behind :func:`explain`: per-layer rows that add up to ``plan.cost``.

    Args:
      plan: a plan from ``hj.plan`` / ``hj.compare`` (a plan loaded from JSON has no graph: its
        explanation has the totals but no per-layer rows).
      depth: cut layer labels to this many components (``2``: ``"GPT2/h_3"``); ``None``: full.
      collapse: show repeated identical layers once (``"GPT2/h_{0..11}/mlp (x12)"``).
    """
    if plan.stages is not None:
        return staged_explanation(plan, depth=depth, collapse=collapse)
    topo = plan.topology
    cost = plan.cost
    axes = []
    for ax, size in zip(plan.axis_names, plan.mesh_shape):
        link = topo.axis_link(ax) if topo is not None else None
        axes.append(AxisInfo(
            name=ax, size=size,
            link_class=(cost.link_class.get(ax) if cost is not None and cost.link_class
                        else topo.axis_scope(ax) if topo is not None else "?"),
            bandwidth=link.bandwidth if link else float("nan"),
            latency=link.latency if link else float("nan"),
            comm_time=cost.comm_time_by_axis.get(ax, 0.0) if cost is not None else 0.0,
            comm_bytes=cost.comm_bytes.get(ax, 0.0) if cost is not None else 0.0,
            per_axis=getattr(topo, "axis_links", None) is not None))
    links = {x.name: x.link_class for x in axes}
    collectives = []
    if cost is not None:
        for c in cost.collectives:
            collectives.append(CollectiveUse(kind=c.kind, axes=tuple(c.axes),
                                             links=tuple(links.get(x, "?") for x in c.axes),
                                             count=c.count, bytes=c.bytes, time=c.time))
    rows: list[LayerRow] = []
    note = ""
    hidden = None
    if plan.graph is None or topo is None:
        note = ("no per-layer rows: this plan has no traced graph (plans loaded from JSON keep "
                "layouts and totals only). Re-plan it with hj.plan(step, state, batch, ...).")
    else:
        at = attribute(plan, depth)
        acc = _layer_accumulators(plan, depth, at)
        hidden = at.cm.overlapped(at.assignment)
        stage_of: dict[int, int] = {}
        for k, stage in enumerate(plan.stages or ()):
            for nid in _stage_nodes(stage):
                stage_of[nid] = k
        for name, lay in acc.items():
            r = LayerRow(layer=name, parameters=lay.params, optimizer=list(lay.optimizer),
                         activations=list(lay.activations), order=lay.order,
                         compute=lay.compute, comm=sum(c.time for c in lay.comms.values()),
                         memory={k: lay.memory[k] for k in _MEMORY_KINDS if lay.memory.get(k)},
                         collectives=sorted(lay.comms.values(), key=lambda c: -c.time),
                         stages=tuple(sorted({stage_of[n] for n in lay.nodes if n in stage_of})))
            if r.time or r.memory_total or r.parameters or r.collectives:
                rows.append(r)
        rows.sort(key=lambda r: (r.layer != BATCH, r.layer == OPTIMIZER_ROW, r.order))
        total = sum(r.time for r in rows)
        if plan.assignment is None and cost is not None and \
                abs(total - cost.step_time) > 1e-6 * max(cost.step_time, 1e-30):
            note = (f"the planner kept no per-operator choices: rows are re-derived from the "
                    f"argument layouts and add up to {format_time(total)}, not the plan's "
                    f"{format_time(cost.step_time)}.")
        if collapse:
            rows = _collapse(rows)
    stages = None
    if plan.stages is not None:
        stages = []
        for k, stage in enumerate(plan.stages):
            layers = [r.label for r in rows if k in r.stages]
            stages.append((_stage_devices(stage, topo), layers))
    mesh = " x ".join(f"{a}={n}" for a, n in zip(plan.axis_names, plan.mesh_shape))
    return Explanation(strategy=plan.strategy, topology_name=getattr(topo, "name", "?"),
                       mesh=mesh, axes=axes, cost=cost, rows=rows, collectives=collectives,
                       stages=stages, notes=list(plan.notes), per_layer_note=note,
                       overlap=hidden)


def _stage_nodes(stage) -> list[int]:
    return list(stage.nodes)


def _stage_devices(stage, topology=None) -> str:
    ids = sorted(stage.devices)
    text = (f"devices {ids[0]}..{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1))
            else f"devices {ids}")
    if topology is not None:
        devs = [topology.devices[d] for d in ids]
        kinds = "+".join(dict.fromkeys(d.spec.kind for d in devs))
        regions = list(dict.fromkeys(d.region for d in devs))
        nodes = list(dict.fromkeys(d.node for d in devs))
        where = (regions[0] if len(regions) == 1 and len(topology.regions) > 1
                 else nodes[0] if len(nodes) == 1 else f"{len(nodes)} nodes")
        text += f" ({len(ids)} x {kinds}, {where})"
    return text


# ---- rendering -----------------------------------------------------------------------------


# ---- staged plans ------------------------------------------------------------------------------

def stage_cost_models(plan) -> list:
    """``[(cost model, assignment)]`` of each stage of a staged plan made in this process
    (:func:`~hulkjax.strategies.stages.stage_models` on the plan's own step and topology)."""
    return stage_models(plan.graph, plan.topology, plan)


def staged_explanation(plan, *, depth: int | None = None, collapse: bool = True) -> Explanation:
    """The explanation of a staged plan: per-layer rows with the stage each runs on (their time is
    the layer's work per step on its stage's devices: per-microbatch forward and backward times
    ``microbatches``, plus its update), the per-stage pipeline, the bubble and the transfers."""
    from hulkjax.cost.pipeline import node_costs

    topo, cost, M = plan.topology, plan.cost, plan.microbatches
    axes, links = [], {}
    for k, st in enumerate(plan.stages):
        sub = topo.subset(st.devices, canonical=True) if topo is not None else None
        for ax, size in zip(st.axis_names, st.mesh_shape):
            name = f"s{k}/{ax}"
            link = sub.axis_link(ax) if sub is not None else None
            cls = sub.axis_scope(ax) if sub is not None else "?"
            links[name] = cls
            axes.append(AxisInfo(
                name=name, size=size, link_class=cls,
                bandwidth=link.bandwidth if link else float("nan"),
                latency=link.latency if link else float("nan"),
                comm_time=cost.comm_time_by_axis.get(name, 0.0) if cost is not None else 0.0,
                comm_bytes=cost.comm_bytes.get(name, 0.0) if cost is not None else 0.0))
    rows: list[LayerRow] = []
    note = ""
    if plan.graph is None or topo is None:
        note = ("no per-layer rows: this plan has no traced graph (plans loaded from JSON keep "
                "layouts and totals only). Re-plan it with hj.plan(step, state, batch, ...).")
    else:
        g = plan.graph
        acc: dict[str, _Acc] = defaultdict(_Acc)
        stages_of: dict[str, set[int]] = defaultdict(set)
        scms = stage_cost_models(plan)
        input_layer: dict[int, str] = {}
        for i, v in enumerate(g.inputs):
            uses = sorted((nid for nid, _ in g.consumers(v)), key=lambda n: (g.nodes[n].backward, n))
            lab = next((layer_label(g.nodes[n].layer, depth) for n in uses
                        if layer_label(g.nodes[n].layer, depth)), "")
            input_layer[i] = lab or (BATCH if g.input_roles[i] == DATA else OPTIMIZER_ROW)
        for k, (st, (cm, a)) in enumerate(zip(plan.stages, scms)):
            nc = node_costs(cm, a)
            b = cm.breakdown(a)
            times = {n: M for n in st.forward + st.backward}
            times.update({n: 1 for n in st.update})
            label: dict[int, str] = {}
            for nid in st.nodes:
                lab = layer_label(g.nodes[nid].layer, depth)
                if not lab:  # unscoped: the layer of its first labelled operand
                    for v in g.nodes[nid].inputs:
                        p = None if v is None else g.values[v].producer
                        if p is not None and label.get(p):
                            lab = label[p]
                            break
                label[nid] = lab or UNSCOPED
                row = acc[label[nid]]
                row.compute += nc.compute[nid] * times[nid]
                row.nodes.add(nid)
                row.order = min(row.order, nid)
                if nc.time[nid] > 0:
                    stages_of[label[nid]].add(k)

            def charge(nid, comm, runs, k=k, label=label, cm=cm):
                name = label[nid]
                keyaxes = tuple(f"s{k}/{x}" for x in comm.axes)
                use = acc[name].comms.get((comm.kind, keyaxes))
                if use is None:
                    use = acc[name].comms[(comm.kind, keyaxes)] = CollectiveUse(
                        kind=comm.kind, axes=keyaxes, links=tuple(links.get(x, "?") for x in keyaxes))
                use.count += runs
                use.bytes += comm.bytes * runs
                use.time += cm.comm_time(comm) * runs

            for nid, c, runs in _own_charges(plan, st, cm, a, b.own, times):
                charge(nid, c, runs)
            for m in b.moves:
                if m.node in times:
                    charge(m.node, m.comm, times[m.node])
            held = set(st.inputs)
            mine = set(st.forward) | set(st.backward)
            inflight = cost.stages[k].in_flight if cost is not None and cost.stages else 1
            for node, inputs, kind, nbytes in nc.memory:
                if node is None and inputs and inputs[0] in held and kind != "data":
                    acc[input_layer[inputs[0]]].memory[kind] += nbytes
                    stages_of[input_layer[inputs[0]]].add(k)
                elif node is not None and node in mine and kind == "activations":
                    acc[label[node]].memory[kind] += nbytes * inflight
            for i in st.inputs:
                t = plan.inputs[i]
                if g.input_roles[i] == PARAMETER:
                    acc[input_layer[i]].params.append(
                        f"{_leaf_name(t.path)} {format_shape(t.shape)} {format_spec(t.spec)}")
                elif g.input_roles[i] == OPTIMIZER:
                    acc[input_layer[i]].optimizer[f"{format_spec(t.spec)} (stage {k})"] = None
        for name, lay in acc.items():
            r = LayerRow(layer=name, parameters=lay.params, optimizer=list(lay.optimizer),
                         activations=[], order=lay.order, compute=lay.compute,
                         comm=sum(c.time for c in lay.comms.values()),
                         memory={k: lay.memory[k] for k in _MEMORY_KINDS if lay.memory.get(k)},
                         collectives=sorted(lay.comms.values(), key=lambda c: -c.time),
                         stages=tuple(sorted(stages_of[name])))
            if r.time or r.memory_total or r.parameters or r.collectives:
                rows.append(r)
        rows.sort(key=lambda r: (min(r.stages, default=0), r.order))
        if collapse:
            rows = _collapse(rows)
            rows.sort(key=lambda r: (min(r.stages, default=0), r.order))
        note = (f"staged plan: each row is its layer's work per step on its stage's devices "
                f"(forward and backward per microbatch x {M}, plus the update); stages run "
                f"concurrently, so the rows add up to more than the step. The pipeline lines "
                f"below give the step.")
    stage_rows = []
    for k, st in enumerate(plan.stages):
        layers = [r.label for r in rows if k in r.stages] or list(st.layers)
        stage_rows.append((_stage_devices(st, topo), layers))
    mesh = " x ".join(f"{a}={n}" for a, n in zip(plan.axis_names, plan.mesh_shape))
    # Each stage's collectives per step, on its own axes (``s<stage>/<axis>``).
    collectives = [CollectiveUse(kind=c.kind, axes=tuple(c.axes),
                                 links=tuple(links.get(x, "?") for x in c.axes),
                                 count=c.count, bytes=c.bytes, time=c.time)
                   for c in (cost.collectives if cost is not None else ())]
    return Explanation(strategy=plan.strategy, topology_name=getattr(topo, "name", "?"),
                       mesh=mesh, axes=axes, cost=cost, rows=rows, collectives=collectives,
                       stages=stage_rows, notes=list(plan.notes), per_layer_note=note,
                       pipeline=pipeline_lines(plan))


def _own_charges(plan, st, cm, assignment, own, times) -> list[tuple]:
    """``(node, collective, runs per step)`` of the operators' own collectives on one stage:
    each ``times[node]`` times (its program's runs), but for the sums the stage accumulates
    unreduced (``Stage.unreduced``): their all-reduce once per step, on the float32 accumulator
    (:mod:`hulkjax.cost.unreduced`), as the pipeline's cost charges it."""
    from hulkjax.cost.unreduced import unreduced_sums
    from hulkjax.strategies.partition import partition

    un = {}
    if st.unreduced and plan.microbatches > 1:
        recs = unreduced_sums(cm, assignment, partition(plan.graph).split,
                              st.forward + st.backward)
        un = {r.node: r for r in recs.values()}
    out = []
    for nid, comms in own.items():
        if nid not in times:
            continue
        r = un.get(nid)
        out += [(nid, c, times[nid]) for i, c in enumerate(comms)
                if r is None or i not in r.deferred]
        if r is not None:
            out.append((nid, r.reduction, 1))
    return out


def pipeline_lines(plan) -> list[str]:
    """A staged plan's pipeline in words: stages with their layers, times and memory; the bubble;
    the transfers per link."""
    c = plan.cost
    if c is None or not c.stages:
        return []
    topo = plan.topology
    v = plan.virtual_stages
    G = len(plan.stages) // v
    if v > 1:
        head = (f"pipeline: {len(plan.stages)} stages ({G} device groups x {v} chunks each) x "
                f"{plan.microbatches} microbatches ({plan.schedule}); step "
                f"{format_time(c.step_time)} = busiest group's compute")
    else:
        head = (f"pipeline: {len(plan.stages)} stages x {plan.microbatches} microbatches "
                f"({plan.schedule}); step {format_time(c.step_time)} = busiest stage's compute")
    lines = [f"{head} {format_time(c.compute_time)} + its communication "
             f"{format_time(c.comm_time)} + bubble {format_time(c.bubble)}"]
    for k, (st, t) in enumerate(zip(plan.stages, c.stages)):
        first = st.layers[0] if st.layers else "-"
        last = st.layers[-1] if st.layers else "-"
        span = first if first == last else f"{first} .. {last}"
        chunk = f" (chunk {k // G} of group {k % G})" if v > 1 else ""
        lines.append(
            f"  stage {k}{chunk} on {_stage_devices(st, topo)}, mesh "
            f"{' x '.join(f'{a}={n}' for a, n in zip(st.axis_names, st.mesh_shape))} "
            f"({st.strategy}): {span} ({len(st.layers)} units); per microbatch forward "
            f"{format_time(t.forward)}, backward {format_time(t.backward)}; "
            + (f"gradients reduced once per step {format_time(t.reduction)} "
               f"({format_time(t.reduction_exposed)} after the drain); " if t.reduction else "")
            + f"update {format_time(t.update)}; memory {format_bytes(t.peak_memory)} of "
            f"{format_bytes(t.memory_capacity)}{'' if t.fits else ' (DOES NOT FIT)'}, "
            f"{t.in_flight} microbatch(es) in flight")
    for tr in c.transfers:
        lines.append(
            f"  transfer stage {tr.src} -> {tr.dst} over {tr.link} links "
            f"({format_bytes(tr.bandwidth)}/s, {format_time(tr.latency)}): "
            f"{format_bytes(tr.microbatch_bytes)} per microbatch, {format_bytes(tr.step_bytes)} "
            f"per step; {format_time(tr.time)} per step")
    return lines


def _staged_attribution(plan, depth: int | None) -> Attribution:
    """A staged plan's operators with their stage's records: each node's compute, collectives and
    layouts come from the cost model of its stage (its group's devices, microbatch shapes), per
    step (per-microbatch work x microbatches); mesh axes are named ``s<stage>/<axis>``. The
    assignment and cost model are the first stage's (the group structure is the same)."""
    from hulkjax.cost.pipeline import node_costs

    g, M = plan.graph, plan.microbatches
    scms = stage_cost_models(plan)
    compute = [0.0] * len(g.nodes)
    own: dict[int, list[Charge]] = {}
    moves, memory = [], []
    specs: dict = {}
    node_layer: dict[int, str] = {}
    group_layer = _group_layers(scms[0][0], depth)
    for k, (st, (cm, a)) in enumerate(zip(plan.stages, scms)):
        nc = node_costs(cm, a)
        b = cm.breakdown(a)
        times = {n: M for n in st.forward + st.backward}
        times.update({n: 1 for n in st.update})
        order = tuple(cm.topology.axis_names)

        def charge(c, t, k=k, cm=cm, order=order):
            axes = tuple(f"s{k}/{x}" for x in sorted(c.axes, key=order.index))
            return Charge(c.kind, axes, c.bytes * t, cm.comm_time(c) * t)

        for nid, t in times.items():
            compute[nid] = float(nc.compute[nid]) * t
            own[nid] = []
        for nid, c, runs in _own_charges(plan, st, cm, a, b.own, times):
            own[nid].append(charge(c, runs))
        for nid in times:
            for o in g.nodes[nid].outputs:
                if o in b.specs:
                    specs[o] = b.specs[o]
        for m in b.moves:
            if m.node in times:
                moves.append((m.value, m.node, m.group, charge(m.comm, times[m.node])))
        held = set(st.inputs)
        for u in b.memory:
            ins = cm.groups[u.group].inputs
            if (u.node is None and ins and ins[0] in held) or (u.node is not None
                                                               and u.node in times):
                memory.append((u.node, u.group, u.kind, u.bytes))
        for i in st.inputs:
            specs[g.inputs[i]] = b.specs.get(g.inputs[i])
    for n in g.nodes:
        label = layer_label(n.layer, depth)
        if not label:
            v = next((v for v in n.inputs if v is not None), None)
            p = None if v is None else g.values[v].producer
            label = node_layer.get(p, UNSCOPED) if p is not None else UNSCOPED
        node_layer[n.id] = label
    return Attribution(graph=g, topology=plan.topology, cm=scms[0][0], assignment=scms[0][1],
                       group_layer=group_layer, node_layer=node_layer, specs=specs,
                       compute=compute, own=own, moves=moves, memory=memory)
