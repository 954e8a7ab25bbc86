"""The joined operator + device graph as arrays, for the GNN.

One :class:`JoinedGraph` per (cost model): nodes are the cost model's groups (the coarsened
operators and the graph inputs) and the mesh axes (TAG's device-side nodes: an axis stands for the
device groups a collective over it spans); edges are the tensors between groups (both directions,
log bytes) and group<->axis links. Every group's candidates are encoded per mesh axis: the role the
axis plays in the candidate (which operand / result it splits, whether it leaves partial sums).

Training pads these arrays into ``jraph.GraphsTuple`` buckets
(:func:`hulkjax.training.batching.to_graphs_tuple`); planning reads them as they are
(:mod:`hulkjax.gnn.infer`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hulkjax.cost.model import FREE, INPUT, LEADER, CostModel
from hulkjax.plan.specs import dim_of, num_shards
from hulkjax.trace.graph import OPTIMIZER, PARAMETER

MAX_AXES = 3  # mesh axes encoded per candidate (meshes have 1-3 axes)
MAX_CANDIDATES = 256  # candidates per group the network scores (the rest are left to search)
GROUP_FEATURES = 24
AXIS_FEATURES = 10
EDGE_FEATURES = 4
ROLE_FEATURES = 9  # per axis and candidate
CAND_EXTRA = 3  # per candidate, axis-independent

_LEADER_KINDS = ("dot_general", "conv_general_dilated", "gather", "scatter-add")
_LINK_CLASSES = ("node", "region", "wan")


@dataclass
class JoinedGraph:
    """Arrays describing one (graph, topology) for the GNN.

    Attributes:
      group_x: ``[G, GROUP_FEATURES]`` float32 group features.
      axis_x: ``[A, AXIS_FEATURES]`` float32 mesh-axis features.
      senders / receivers: ``[E]`` int32 edges over nodes numbered groups first, then axes.
      edge_x: ``[E, EDGE_FEATURES]`` float32 (log bytes, direction, group<->axis flag, ...).
      cand_roles: ``[G, K, MAX_AXES, ROLE_FEATURES]`` float32 per-candidate per-axis roles.
      cand_extra: ``[G, K, CAND_EXTRA]`` float32 (log work split, log own collective bytes, ...).
      cand_mask: ``[G, K]`` bool, real candidates.
      axis_mask: ``[MAX_AXES]`` bool, real axes.
    """

    group_x: np.ndarray
    axis_x: np.ndarray
    senders: np.ndarray
    receivers: np.ndarray
    edge_x: np.ndarray
    cand_roles: np.ndarray
    cand_extra: np.ndarray
    cand_mask: np.ndarray
    axis_mask: np.ndarray

    @property
    def num_groups(self) -> int:
        return self.group_x.shape[0]


def _log(x: float) -> float:
    return math.log10(max(float(x), 1.0))


def build(cm: CostModel, *, max_candidates: int | None = MAX_CANDIDATES) -> JoinedGraph:
    """Encode a cost model's groups, axes and candidates."""
    g, topo = cm.graph, cm.topology
    axes = list(cm.mesh.axis_names)
    if len(axes) > MAX_AXES:
        raise ValueError(f"the GNN encodes meshes of at most {MAX_AXES} axes; got {axes}")
    k_max = max(len(grp.candidates) for grp in cm.groups)
    if max_candidates is not None:
        k_max = min(k_max, max_candidates)
    n_g = len(cm.groups)
    gx = np.zeros((n_g, GROUP_FEATURES), np.float32)
    roles = np.zeros((n_g, k_max, MAX_AXES, ROLE_FEATURES), np.float32)
    extra = np.zeros((n_g, k_max, CAND_EXTRA), np.float32)
    mask = np.zeros((n_g, k_max), bool)
    flops = np.zeros(n_g)
    nbytes = np.zeros(n_g)
    seen: dict = {}
    for nid, gid in cm.group_of_node.items():
        flops[gid] += g.nodes[nid].flops
        nbytes[gid] += cm.traffic[nid]
    for grp in cm.groups:
        f = gx[grp.id]
        f[0] = _log(flops[grp.id]) / 15
        f[1] = _log(nbytes[grp.id]) / 12
        f[2] = len(grp.members) / 50
        if grp.kind == INPUT:
            i = grp.inputs[0]
            role = g.input_roles[i]
            v = g.values[g.inputs[i]]
            f[3 + (0 if role == PARAMETER else 1 if role == OPTIMIZER else 2)] = 1
            f[6] = _log(v.nbytes) / 12
            f[7] = len(v.shape) / 4
            for d, s in enumerate(v.shape[:4]):
                f[8 + d] = _log(s) / 6
            f[12] = len(grp.inputs) / 4
        elif grp.kind == LEADER:
            node = g.nodes[grp.leader]
            name = node.name if node.name != "scatter_add" else "scatter-add"
            f[13 + (_LEADER_KINDS.index(name) if name in _LEADER_KINDS else 3)] = 1
            f[17] = float(node.backward)
            out = g.values[node.outputs[0]]
            f[18] = _log(out.nbytes) / 12
            f[19] = len(out.shape) / 4
            ins = [g.values[v] for v in node.inputs if v is not None]
            f[20] = _log(max((v.nbytes for v in ins), default=1)) / 12
            f[21] = _log(min((v.nbytes for v in ins), default=1)) / 12
        else:
            f[22] = 1
        f[23] = 1.0  # bias
        # Candidate features depend on the candidates alone: repeated layers share their rows.
        if grp.kind == LEADER:
            key = ("lead", id(grp.candidates))
        elif grp.kind == INPUT:
            key = ("in", g.values[g.inputs[grp.inputs[0]]].shape, tuple(grp.candidates[:k_max]))
        else:
            key = None
        same = seen.get(key) if key is not None else None
        if same is not None:
            roles[grp.id], extra[grp.id], mask[grp.id] = roles[same], extra[same], mask[same]
            continue
        if key is not None:
            seen[key] = grp.id
        for c, cand in enumerate(grp.candidates[:k_max]):
            mask[grp.id, c] = True
            if grp.kind == INPUT:
                shape = g.values[g.inputs[grp.inputs[0]]].shape
                largest = int(np.argmax(shape)) if shape else -1
                for a, axis in enumerate(axes):
                    d = dim_of(cand, axis)
                    r = roles[grp.id, c, a]
                    if d is None:
                        r[0] = 1
                    else:
                        r[1 + min(d, 3)] = 1
                        r[5] = float(d == largest)
                        r[6] = float(d == 0)
                        r[7] = _log(shape[d]) / 6
                extra[grp.id, c, 0] = math.log2(num_shards(cand, cm.sizes)) / 10
            elif grp.kind == LEADER:
                ins = [s for s in cand.in_specs if s is not None]
                for a, axis in enumerate(axes):
                    r = roles[grp.id, c, a]
                    r[0] = float(all(dim_of(s, axis) is None for s in ins)
                                 and dim_of(cand.out_specs[0], axis) is None)
                    for j, s in enumerate(ins[:2]):
                        r[1 + j] = float(dim_of(s, axis) is not None)
                    r[3] = float(dim_of(cand.out_specs[0], axis) is not None)
                    # partial sums over the axis: all-reduced, or reduce-scattered (one
                    # reduce-scatter, or the partitioner's all-reduce and permute: the sum's
                    # axes are its first collective's)
                    summed = any(axis in cm_.axes and cm_.kind in ("all-reduce", "reduce-scatter")
                                 for cm_ in (cand.comms[:1] if cand.scatters else cand.comms))
                    r[4] = float(summed and not cand.scatters)
                    r[5] = float(summed and cand.scatters)
                    d = dim_of(cand.out_specs[0], axis)
                    r[6] = float(d == 0)
                extra[grp.id, c, 0] = math.log2(max(cand.shards, 1)) / 10
                extra[grp.id, c, 1] = _log(sum(cm_.bytes for cm_ in cand.comms)) / 12
            else:  # constants: replicated
                roles[grp.id, c, :len(axes), 0] = 1
            extra[grp.id, c, 2] = float(c == 0)  # the replicated candidate
        for c in range(min(len(grp.candidates), k_max), k_max):
            mask[grp.id, c] = False
    ax = np.zeros((len(axes), AXIS_FEATURES), np.float32)
    dev = topo.slowest_device()
    for a, axis in enumerate(axes):
        link = topo.axis_link(axis)
        ax[a, 0] = math.log2(topo.axis_size(axis)) / 6
        ax[a, 1] = _log(link.bandwidth) / 12
        ax[a, 2] = _log(link.latency * 1e9) / 9
        ax[a, 3] = _log(dev.peak_flops) / 15
        ax[a, 4] = _log(dev.memory) / 12
        ax[a, 5] = _log(dev.hbm_bandwidth) / 13
        scope = topo.axis_scope(axis)
        ax[a, 6 + (_LINK_CLASSES.index(scope) if scope in _LINK_CLASSES else 0)] = 1
        ax[a, 9] = float(topo.is_heterogeneous)
    senders, receivers, ex = [], [], []
    for (gp, gc), items in cm.edge_items():
        b = sum(g.values[v].nbytes for v, _, _ in items)
        for s, r, direction in ((gp, gc, 1.0), (gc, gp, -1.0)):
            senders.append(s)
            receivers.append(r)
            ex.append([_log(b) / 12, direction, 0.0, len(items) / 10])
    for grp in cm.groups:
        if grp.kind == FREE:
            continue
        for a in range(len(axes)):
            for s, r in ((grp.id, n_g + a), (n_g + a, grp.id)):
                senders.append(s)
                receivers.append(r)
                ex.append([0.0, 0.0, 1.0, 0.0])
    axis_mask = np.zeros(MAX_AXES, bool)
    axis_mask[:len(axes)] = True
    return JoinedGraph(gx, ax, np.array(senders, np.int32), np.array(receivers, np.int32),
                       np.array(ex, np.float32).reshape(-1, EDGE_FEATURES), roles, extra, mask,
                       axis_mask)
