"""What a plan does, layer by layer: layouts, collectives on each link class, time and memory.

Where this sits::

    Plan (graph + assignment + topology) --> CostModel tables --> explanation(plan): Explanation
                                                                        |
                      explain(plan, fmt="text" | "markdown" | "rich")   +--> Plan.summary()
                                                                        +--> hulkjax explain (CLI)

Every operator's predicted compute, every collective the cost model charges (the operator's own
partial sums, layout changes inside a cost-model group and on edges between groups) and every byte of
per-device memory is attributed to one layer, so the rows add up to ``plan.cost``: the *total* row
equals ``cost.step_time`` and ``cost.peak_memory``.

A node's layer is its ``Node.layer`` (the module scope, e.g. ``"GPT2/h_3/attn"``) with einsum scopes
folded into their module (``".../bqhd,bkhd->bhqk"`` -> ``".../attn"``). Operators without a scope
(optimizer updates, the loss) take the layer of the operand they follow (the cost model's lead), or
of their cost-model group for graph inputs, so a parameter's update is charged to the parameter's
layer. Repeated layers with identical rows (``h_0`` ... ``h_11``)
are shown once as ``GPT2/h_{0..11}/attn (x12)`` with totals over the repeats.

>>> import hulkjax as hj, jax.numpy as jnp
>>> plan = hj.plan(lambda w, x: (x @ w).sum(), jnp.ones((64, 64)), jnp.ones((128, 64)),
...                topology=hj.Topology.grid((8,), ("d",)), strategy="dp")
>>> print(explain(plan, fmt="text").splitlines()[0])
Plan 'dp' on grid-8 (mesh d=8)
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

_SHORT_KIND = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A",
               "collective-permute": "CP"}
_LINK_WORDS = {"node": "links inside a node", "region": "links between nodes of a region",
               "wan": "WAN links between regions"}
_MEMORY_KINDS = ("parameters", "gradients", "optimizer", "activations", "data")
BATCH, OPTIMIZER_ROW, CONSTANTS, UNSCOPED = "(batch)", "(optimizer)", "(constants)", "(outside modules)"


# ---- small formatters (also used by Cost.__str__, the CLI and the ILP's errors) ---------------
def format_spec(spec) -> str:
    """``PartitionSpec(None, 'model')`` -> ``"[-, model]"``; replicated -> ``"replicated"``.

    Also takes the cost model's specs (a tuple of axis tuples per dimension).

    >>> from jax.sharding import PartitionSpec as P
    >>> format_spec(P(None, ("node", "gpu"))), format_spec(((), ("gpu",))), format_spec(P())
    ('[-, node+gpu]', '[-, gpu]', 'replicated')
    """
    entries = list(spec)
    if not any(e for e in entries):
        return "replicated"
    parts = []
    for e in entries:
        if not e:
            parts.append("-")
        elif isinstance(e, tuple):
            parts.append("+".join(e))
        else:
            parts.append(str(e))
    return "[" + ", ".join(parts) + "]"


def format_bytes(n: float) -> str:
    """Decimal units: ``format_bytes(1.5e9) == "1.5 GB"``."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} TB"


def format_time(seconds: float) -> str:
    """``format_time(0.0123) == "12.3 ms"``; adapts the unit (s, ms, us)."""
    if seconds == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def format_rate(bytes_per_s: float) -> str:
    """``format_rate(5e10) == "50 GB/s"``."""
    return format_bytes(bytes_per_s) + "/s"


def format_shape(shape) -> str:
    """``(8, 16, 64)`` -> ``"8x16x64"``; scalars -> ``"scalar"``."""
    return "x".join(str(d) for d in shape) if len(shape) else "scalar"


# ---- the data ------------------------------------------------------------------------------
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
        return (f"{_SHORT_KIND.get(self.kind, self.kind)} {'+'.join(self.axes)} "
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
    from hulkjax.strategies.realize import assignment_for_inputs
    from hulkjax.strategies.search import propagate

    return propagate(cm, assignment_for_inputs(cm, [t.spec for t in plan.inputs]))


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
    from hulkjax.cost.model import FREE, INPUT, LEADER
    from hulkjax.trace.graph import DATA, PARAMETER

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
    """Per-operator compute, collectives and memory of a plan (needs ``plan.graph``)."""
    from hulkjax.cost.comm import collective_time
    from hulkjax.cost.model import INPUT, LEADER
    from hulkjax.rules.loops import LoopResolution
    from hulkjax.rules.specs import local_shape
    from hulkjax.strategies.realize import cost_model
    from hulkjax.trace.graph import OPTIMIZER, PARAMETER, dtype_size

    g, topo = plan.graph, plan.topology
    cm = cost_model(g, topo)
    a = _plan_assignment(plan, cm)
    order = tuple(topo.axis_names)
    sizes = dict(zip(topo.axis_names, topo.shape))
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
    saved = _saved_activations(g)
    times: dict = {}

    def charges(comms):
        out = []
        for c in comms:
            key = (c.kind, c.bytes, c.axes)
            t = times.get(key)
            if t is None:
                t = times[key] = sum(collective_time(c.kind, c.bytes, c.axes, topo).values())
            out.append(Charge(c.kind, tuple(sorted(c.axes, key=order.index)), c.bytes, t))
        return out

    def nbytes(vid, spec):
        v = g.values[vid]
        n = 1
        for d in local_shape(v.shape, spec, sizes):
            n *= d
        return float(n) * dtype_size(v.dtype)

    # Per-node shares of CostModel.local() / evaluate(), recomputed with the model's own helpers
    # (_compute, _reshard); tests/viz/test_explain.py checks that the rows add up to plan.cost.
    compute = [0.0] * len(g.nodes)
    own: dict[int, list[Charge]] = {}
    moves: list = []
    memory: list = []
    specs: dict = {}
    for grp in cm.groups:
        loc = cm.local(grp.id, a[grp.id])
        specs.update(loc.specs)
        if grp.kind == INPUT:
            kinds = {PARAMETER: ("parameters", "gradients"), OPTIMIZER: ("optimizer",)}
            for i in grp.inputs:
                vid = g.inputs[i]
                for kind in kinds.get(g.input_roles[i], ("data",)):
                    memory.append((None, grp.id, kind, nbytes(vid, loc.specs[vid])))
        nodes = ([grp.leader] if grp.kind == LEADER else []) + list(grp.members)
        for nid in nodes:
            node, r = g.nodes[nid], loc.res[nid]
            if isinstance(r, LoopResolution):  # a loop: its body's plan, times its trip count
                compute[nid] = r.compute
                memory.append((nid, grp.id, "activations", r.memory))
            else:
                compute[nid] = cm._compute(node, r.shards)
            own[nid] = charges(r.comms)
            if nid == grp.leader:
                continue
            for k, v in enumerate(node.inputs):  # layout changes inside the group (as local())
                if v is not None and v in loc.specs and r.in_specs[k] is not None:
                    for ch in charges(cm._reshard(v, loc.specs[v], r.in_specs[k])):
                        moves.append((v, nid, grp.id, ch))
        for vid, spec in loc.specs.items():
            if vid in saved:
                memory.append((g.values[vid].producer, grp.id, "activations", nbytes(vid, spec)))
    for (gp, gc), items in cm.edge_items():  # layout changes between groups
        src_loc = cm.local(gp, a[gp])
        for v, nid, k in items:
            dst = cm.required(gc, a[gc], nid, k)
            src = src_loc.specs.get(v)
            if src is not None and dst is not None:
                for ch in charges(cm._reshard(v, src, dst)):
                    moves.append((v, nid, gc, ch))
    return Attribution(graph=g, topology=topo, cm=cm, assignment=a, group_layer=group_layer,
                       node_layer=node_layer, specs=specs, compute=compute, own=own, moves=moves,
                       memory=memory)


def _layer_accumulators(plan, depth):
    from hulkjax.cost.model import INPUT, LEADER
    from hulkjax.trace.graph import DATA, OPTIMIZER, PARAMETER

    at = attribute(plan, depth)
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


def _saved_activations(g) -> set[int]:
    """Forward values a backward operator reads (what the step keeps alive for the backward pass)."""
    saved = set()
    for n in g.nodes:
        if n.backward:
            for v in n.inputs:
                if v is not None:
                    p = g.values[v].producer
                    if p is not None and not g.nodes[p].backward:
                        saved.add(v)
    return saved


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
    if plan.graph is None or topo is None:
        note = ("no per-layer rows: this plan has no traced graph (plans loaded from JSON keep "
                "layouts and totals only). Re-plan it with hj.plan(step, state, batch, ...).")
    else:
        acc = _layer_accumulators(plan, depth)
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
            stages.append((_stage_devices(stage), layers))
    mesh = " x ".join(f"{a}={n}" for a, n in zip(plan.axis_names, plan.mesh_shape))
    return Explanation(strategy=plan.strategy, topology_name=getattr(topo, "name", "?"),
                       mesh=mesh, axes=axes, cost=cost, rows=rows, collectives=collectives,
                       stages=stages, notes=list(plan.notes), per_layer_note=note)


def _stage_nodes(stage) -> list[int]:
    if isinstance(stage, dict):
        return list(stage.get("nodes", stage.get("ops", ())))
    return list(stage[1]) if len(stage) > 1 else []


def _stage_devices(stage) -> str:
    group = stage.get("devices", stage.get("group")) if isinstance(stage, dict) else stage[0]
    if isinstance(group, list | tuple) and group and all(isinstance(d, int) for d in group):
        ids = sorted(group)
        return (f"devices {ids[0]}..{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1))
                else f"devices {ids}")
    return str(group)


# ---- rendering -----------------------------------------------------------------------------
_COLUMNS = ("layer", "parameters / data", "optimizer state", "activations (fwd results)",
            "collectives (link class)", "compute", "comm", "time (share)", "memory / device")


_ENTRY = re.compile(r"^(?:(\S+) )?(\S+) (replicated|\[.*\])$")


def _compact(entries: list[str], what: str, limit: int = 4) -> list[str]:
    """More than ``limit`` entries (a coarse layer): one line per layout, with counts."""
    if len(entries) <= limit:
        return entries
    by_spec: dict[str, int] = {}
    for entry in entries:
        m = _ENTRY.match(entry)
        spec = m.group(3) if m else entry
        by_spec[spec] = by_spec.get(spec, 0) + 1
    return [f"{len(entries)} {what}:"] + [f"  {n} x {spec}" for spec, n in by_spec.items()]


def _cells(r: LayerRow, step: float, stages: bool) -> list[list[str]]:
    share = f" ({r.time / step:.1%})" if step > 0 else ""
    cells = [[r.label], _compact(r.parameters, "leaves") or ["-"], r.optimizer or ["-"],
             _compact(r.activations, "results") or ["-"],
             [c.short() for c in r.collectives] or ["-"], [format_time(r.compute)],
             [format_time(r.comm)], [format_time(r.time) + share],
             [format_bytes(r.memory_total)]]
    if stages:
        cells.insert(1, [",".join(map(str, r.stages)) or "-"])
    return cells


def _header_lines(e: Explanation) -> list[str]:
    lines = [f"Plan {e.strategy!r} on {e.topology_name} (mesh {e.mesh})"]
    for x in e.axes:
        where = ("its own per-axis link" if x.per_axis
                 else _LINK_WORDS.get(x.link_class, x.link_class))
        lines.append(f"  axis {x.name} (size {x.size}): {x.link_class} links, "
                     f"{format_rate(x.bandwidth)}, latency {format_time(x.latency)} ({where})")
    c = e.cost
    if c is not None:
        per = ", ".join(f"{x.name}/{x.link_class} {format_time(x.comm_time)}"
                        for x in e.axes if x.comm_time)
        lines.append(f"predicted step {format_time(c.step_time)} = compute "
                     f"{format_time(c.compute_time)} + communication {format_time(c.comm_time)}"
                     f"{' (' + per + ')' if per else ''}; efficiency {c.efficiency:.1%}")
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in c.memory_breakdown.items() if v)
        fits = "fits" if c.fits else "DOES NOT FIT"
        lines.append(f"memory per device {format_bytes(c.peak_memory)} of "
                     f"{format_bytes(c.memory_capacity)} ({fits}): {parts}")
    return lines


def _footer_lines(e: Explanation) -> list[str]:
    lines = []
    if e.collectives:
        lines.append("collectives over the whole step (link class in parentheses):")
        for c in e.collectives:
            lines.append(f"  {c.kind} over {'+'.join(c.axes)} ({'+'.join(dict.fromkeys(c.links))}"
                         f" links): {c.count} x, {format_bytes(c.bytes)}, {format_time(c.time)}")
    if e.stages is not None:
        lines.append("stages (layers placed on device groups):")
        for k, (devices, layers) in enumerate(e.stages):
            lines.append(f"  stage {k} on {devices}: {', '.join(layers) or '-'}")
    for n in e.notes[:10]:
        lines.append(f"note: {n}")
    if len(e.notes) > 10:
        lines.append(f"note: ... and {len(e.notes) - 10} more")
    lines.append("AR all-reduce, AG all-gather, RS reduce-scatter, A2A all-to-all; link classes: "
                 "node = inside a node, region = between nodes, wan = between regions. Times and "
                 "memory of a repeated layer (xN) are totals over its repeats.")
    return lines


def _table_rows(e: Explanation, max_rows: int | None):
    stages = e.stages is not None
    cols = list(_COLUMNS)
    if stages:
        cols.insert(1, "stage")
    step = e.cost.step_time if e.cost is not None else e.total_time
    rows = [_cells(r, step, stages) for r in e.rows]
    hidden = 0
    if max_rows is not None and len(rows) > max_rows:
        hidden = len(rows) - max_rows
        rows = rows[:max_rows]
    total = [["total"], [""], [""], [""], [""],
             [format_time(sum(r.compute for r in e.rows))],
             [format_time(sum(r.comm for r in e.rows))],
             [format_time(e.total_time) + (" (100%)" if step > 0 else "")],
             [format_bytes(e.total_memory)]]
    if stages:
        total.insert(1, [""])
    return cols, rows, total, hidden


def _text_table(cols, rows, total) -> list[str]:
    widths = [len(c) for c in cols]
    for row in rows + [total]:
        for k, cell in enumerate(row):
            widths[k] = max(widths[k], *(len(s) for s in cell))
    right = {len(cols) - 4, len(cols) - 3, len(cols) - 2, len(cols) - 1}

    def line(cells):
        out = []
        for i in range(max(len(c) for c in cells)):
            parts = []
            for k, c in enumerate(cells):
                s = c[i] if i < len(c) else ""
                parts.append(s.rjust(widths[k]) if k in right else s.ljust(widths[k]))
            out.append("  ".join(parts).rstrip())
        return out

    rule = "  ".join("-" * w for w in widths)
    out = line([[c] for c in cols]) + [rule]
    for row in rows:
        out += line(row)
    return out + [rule] + line(total)


def _markdown_table(cols, rows, total) -> list[str]:
    def esc(s):
        return s.replace("|", "\\|")

    def line(cells):
        return "| " + " | ".join("<br>".join(esc(s) for s in c) for c in cells) + " |"

    right = len(cols) - 4
    out = [line([[c] for c in cols]),
           "|" + "|".join("---:" if k >= right else "---" for k in range(len(cols))) + "|"]
    out += [line(r) for r in rows]
    out.append(line([[f"**{c[0]}**" if c and c[0] else ""] for c in total]))
    return out


def render_text(e: Explanation, *, max_rows: int | None = None) -> str:
    """Plain text (fixed-width table), for logs and ``print``."""
    lines = _header_lines(e)
    if e.rows:
        cols, rows, total, hidden = _table_rows(e, max_rows)
        lines.append("")
        lines += _text_table(cols, rows, total)
        if hidden:
            lines.append(f"... {hidden} more layers (max_rows={max_rows})")
        lines.append("")
    if e.per_layer_note:
        lines.append(f"note: {e.per_layer_note}")
    return "\n".join(lines + _footer_lines(e))


def render_markdown(e: Explanation, *, max_rows: int | None = None) -> str:
    """GitHub-flavoured markdown (a pipe table; multi-line cells use ``<br>``)."""
    head = _header_lines(e)
    lines = [f"### {head[0]}", ""] + [f"- {h.strip()}" for h in head[1:]] + [""]
    if e.rows:
        cols, rows, total, hidden = _table_rows(e, max_rows)
        lines += _markdown_table(cols, rows, total)
        if hidden:
            lines.append(f"\n_... {hidden} more layers (max_rows={max_rows})_")
        lines.append("")
    if e.per_layer_note:
        lines += [f"_{e.per_layer_note}_", ""]
    for f in _footer_lines(e):
        lines.append(f"- {f.strip()}" if f.startswith("  ") else f)
    return "\n".join(lines)


def render_rich(e: Explanation, *, max_rows: int | None = None):
    """A ``rich`` renderable (``rich.console.Console().print(...)`` it): header, table, footer."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = _header_lines(e)
    parts = [Text(head[0], style="bold")] + [Text(h) for h in head[1:]]
    if e.rows:
        cols, rows, total, hidden = _table_rows(e, max_rows)
        table = Table(show_lines=True, header_style="bold")
        n = len(cols)
        for k, c in enumerate(cols):
            table.add_column(c, justify="right" if k >= n - 4 else "left", overflow="fold",
                             no_wrap=k >= n - 4)
        colour = {"wan": "red", "region": "yellow", "node": "green"}
        for row in rows:
            cells = []
            for k, cell in enumerate(row):
                text = "\n".join(cell)
                if cols[k].startswith("collectives"):
                    t = Text()
                    for i, s in enumerate(cell):
                        style = next((v for key, v in colour.items() if f"({key}" in s), "")
                        t.append(("\n" if i else "") + s, style=style)
                    cells.append(t)
                else:
                    cells.append(text)
            table.add_row(*cells)
        table.add_row(*["\n".join(c) for c in total], style="bold")
        parts.append(table)
        if hidden:
            parts.append(Text(f"... {hidden} more layers (max_rows={max_rows})"))
    if e.per_layer_note:
        parts.append(Text(e.per_layer_note, style="yellow"))
    parts += [Text(f) for f in _footer_lines(e)]
    return Group(*parts)


def explain(plan, fmt: str = "text", *, depth: int | None = None, collapse: bool = True,
            max_rows: int | None = None):
    """Explain a plan per layer: layouts, collectives per link class, time and memory.

    Args:
      plan: a :class:`hulkjax.Plan` (from ``hj.plan``, ``hj.compare`` or ``step.plan``).
      fmt: ``"text"`` (a plain string), ``"markdown"`` (a string with a pipe table) or ``"rich"``
        (a ``rich`` renderable for ``Console().print``).
      depth: cut layer labels to this many scope components (coarser rows); ``None``: full.
      collapse: merge repeated identical layers (``h_{0..11}``) into one row.
      max_rows: show at most this many layer rows.

    >>> import hulkjax as hj, jax.numpy as jnp
    >>> plan = hj.plan(lambda w, x: (x @ w).sum(), jnp.ones((64, 64)), jnp.ones((128, 64)),
    ...                topology=hj.Topology.grid((8,), ("d",)), strategy="fsdp")
    >>> explain(plan, fmt="markdown").splitlines()[0]
    "### Plan 'fsdp' on grid-8 (mesh d=8)"
    """
    renderers = {"text": render_text, "markdown": render_markdown, "md": render_markdown,
                 "rich": render_rich}
    if fmt not in renderers:
        from hulkjax.errors import HulkjaxError

        raise HulkjaxError(f"explain(fmt={fmt!r}): use one of 'text', 'markdown', 'rich'.")
    return renderers[fmt](explanation(plan, depth=depth, collapse=collapse), max_rows=max_rows)


# ---- Plan.summary --------------------------------------------------------------------------
def plan_summary(plan, *, max_rows: int = 40) -> str:
    """``Plan.summary()``: the per-layer explanation, then arguments grouped by role and layout.

    Leaves with the same role and the same spec pattern are counted together, so a GPT-2 plan
    reads as a dozen lines rather than hundreds. Plans without a graph (loaded from JSON) show the
    argument groups and the cost only.
    """
    from hulkjax.trace.graph import dtype_size

    mesh = " x ".join(f"{a}={n}" for a, n in zip(plan.axis_names, plan.mesh_shape))
    lines = [f"Plan {plan.strategy!r} on mesh ({mesh}), planned in {plan.planning_time:.2f} s"]
    if plan.graph is not None and plan.topology is not None:
        e = explanation(plan)
        cols, rows, total, hidden = _table_rows(e, max_rows)
        lines += _text_table(cols, rows, total)
        if hidden:
            lines.append(f"... {hidden} more layers")
        lines.append("")
    groups: dict[tuple[str, str], list] = defaultdict(list)
    for t in plan.inputs:
        groups[(t.role, format_spec(t.spec))].append(t)
    lines.append(f"{'role':<10} {'layout':<22} {'leaves':>6} {'bytes':>10}  example")
    for (role, spec), ts in sorted(groups.items(), key=lambda kv: (kv[0][0], -len(kv[1])))[:max_rows]:
        total_b = sum(_size(t.shape) * dtype_size(t.dtype) for t in ts)
        lines.append(f"{role:<10} {spec:<22} {len(ts):>6} {format_bytes(total_b):>10}  {ts[0].path}")
    if plan.operand_specs or plan.result_specs:
        lines.append(f"constraints: {len(plan.operand_specs)} operand, "
                     f"{len(plan.result_specs)} intermediate")
    if plan.cost is not None:
        lines.append(str(plan.cost))
        for c in plan.cost.collectives:
            links = "+".join(dict.fromkeys(plan.cost.link_class.get(x, "?") for x in c.axes))
            lines.append(f"  {c.kind} over {'+'.join(c.axes)} ({links} links): {c.count} x, "
                         f"{format_bytes(c.bytes)}, {format_time(c.time)}")
    for note in plan.notes[:10]:
        lines.append(f"note: {note}")
    if len(plan.notes) > 10:
        lines.append(f"note: ... and {len(plan.notes) - 10} more")
    return "\n".join(lines)


def _size(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
