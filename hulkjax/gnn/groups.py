"""The device-group head (Hulk: a distribution over device groups per layer): features and its
NumPy forward pass.

Where this sits::

    strategies.partition (layer units)  +  topology groups (regions, nodes, GPU kinds)
            |   stage_features(...)
            v
    StageGraph: unit features along the step, device-group features, links between groups
            |   group_log_probs(params, sg)   (NumPy; the flax twin is
            v                                   hulkjax.training.model.GroupHead)
    log P(unit k runs on group j)   [units, groups]

**Status: designed, not trained.** The head is not trained yet (training the network's heads
together is a later job) and ships no weights, so ``auto`` does not consult it: its staged
candidates come from the dynamic program of :mod:`hulkjax.strategies.stages`, and the cost model
chooses between staged and SPMD plans. ``tests/gnn/test_groups.py`` holds this forward pass equal
to the flax module, so weights trained with the module will plan as trained.

The network: units (a chain along the forward pass) exchange messages with their neighbours;
groups attend to each other through their links; a unit-group pair is scored by an MLP of the two
embeddings; a softmax over groups per unit.

>>> import numpy as np
>>> sg = StageGraph(unit_x=np.zeros((3, UNIT_FEATURES), np.float32),
...                 group_x=np.zeros((2, DEVICE_GROUP_FEATURES), np.float32),
...                 link_x=np.zeros((2, 2, LINK_FEATURES), np.float32))
>>> sg.unit_x.shape, sg.num_groups
((3, 8), 2)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hulkjax.cost.pipeline import stage_link
from hulkjax.gnn.infer import _dense, _gelu, _layer_norm, _mlp
from hulkjax.trace.graph import PARAMETER

UNIT_FEATURES = 8
DEVICE_GROUP_FEATURES = 8
LINK_FEATURES = 3


@dataclass
class StageGraph:
    """Arrays of the device-group head.

    Attributes:
      unit_x: ``[U, UNIT_FEATURES]`` float32: per layer unit, log FLOPs of its forward, backward
        and update nodes, log bytes of its parameters, of the activations it hands on and of those
        it saves, its position along the step, and whether its scope repeats (a layer).
      group_x: ``[G, DEVICE_GROUP_FEATURES]`` float32: per device group, log peak FLOP/s, log
        smallest memory, log HBM bandwidth, log device count, log fastest link inside, its share of
        the cluster's FLOP/s, log mean bandwidth and log smallest latency to the other groups.
      link_x: ``[G, G, LINK_FEATURES]`` float32: log bandwidth and log latency of the link between
        two groups, and a same-group flag.
    """

    unit_x: np.ndarray
    group_x: np.ndarray
    link_x: np.ndarray

    @property
    def num_groups(self) -> int:
        return self.group_x.shape[0]


def _log(x: float) -> float:
    return math.log10(max(float(x), 1e-12))


def stage_features(graph, phase, unit, home, labels, topology, groups) -> StageGraph:
    """The :class:`StageGraph` of a step cut into units (``phase`` / ``unit`` per node, ``home``
    unit per input, unit ``labels``: a :class:`hulkjax.strategies.partition.Partition`'s fields)
    on ``groups`` of ``topology``'s devices."""
    import re

    U, G = len(labels), len(groups)
    ux = np.zeros((U, UNIT_FEATURES), np.float32)
    flops = np.zeros((U, 3))
    for n in graph.nodes:
        flops[unit[n.id], "FBU".index(phase[n.id])] += n.flops
    params = np.zeros(U)
    for i, u in home.items():
        if graph.input_roles[i] == PARAMETER:
            params[u] += graph.values[graph.inputs[i]].nbytes
    handed, saved = np.zeros(U), np.zeros(U)
    for n in graph.nodes:
        if phase[n.id] != "F":
            continue
        for o in n.outputs:
            uses = [c for c, _ in graph.consumers(o)]
            nb = graph.values[o].nbytes
            if any(phase[c] == "F" and unit[c] > unit[n.id] for c in uses):
                handed[unit[n.id]] += nb
            if any(phase[c] == "B" for c in uses):
                saved[unit[n.id]] += nb
    norm = [re.sub(r"\d+", "#", lab) for lab in labels]
    for k in range(U):
        ux[k, 0:3] = [_log(f + 1) / 15 for f in flops[k]]
        ux[k, 3] = _log(params[k] + 1) / 12
        ux[k, 4] = _log(handed[k] + 1) / 12
        ux[k, 5] = _log(saved[k] + 1) / 12
        ux[k, 6] = k / max(U - 1, 1)
        ux[k, 7] = float(norm.count(norm[k]) > 1)
    gx = np.zeros((G, DEVICE_GROUP_FEATURES), np.float32)
    lx = np.zeros((G, G, LINK_FEATURES), np.float32)
    total = sum(d.spec.peak_flops for grp in groups for d in (topology.devices[i] for i in grp))
    for a, grp in enumerate(groups):
        devs = [topology.devices[i] for i in grp]
        peak = sum(d.spec.peak_flops for d in devs)
        inside = max((topology.link(grp[0], b).bandwidth for b in grp[1:]), default=1e12)
        gx[a, :6] = [_log(peak) / 15, _log(min(d.spec.memory for d in devs)) / 12,
                     _log(min(d.spec.hbm_bandwidth for d in devs)) / 12, _log(len(devs)) / 3,
                     _log(inside) / 12, peak / total if total else 0.0]
        for b in range(G):
            if a == b:
                lx[a, b] = [_log(inside) / 12, 0.0, 1.0]
                continue
            link = stage_link(topology, groups[a], groups[b])
            lx[a, b] = [_log(link.bandwidth) / 12, _log(link.latency * 1e3 + 1e-3) / 3, 0.0]
        others = [b for b in range(G) if b != a]
        if others:
            gx[a, 6] = float(np.mean([lx[a, b, 0] for b in others]))
            gx[a, 7] = float(min(lx[a, b, 1] for b in others))
    return StageGraph(unit_x=ux, group_x=gx, link_x=lx)


def group_log_probs(params, sg: StageGraph, *, layers: int) -> np.ndarray:
    """``log P(unit k on group j)``, ``[units, groups]``: the forward pass of
    :class:`hulkjax.training.model.GroupHead` in NumPy (float32)."""
    p = params["params"] if "params" in params else params
    p = _numpy(p)
    u = _mlp(p["_MLP_0"], sg.unit_x.astype(np.float32), 2)
    g = _mlp(p["_MLP_1"], sg.group_x.astype(np.float32), 2)
    links = _mlp(p["_MLP_2"], sg.link_x.astype(np.float32), 1)
    G = g.shape[0]
    for i in range(layers):
        zero = np.zeros_like(u[:1])
        prev = np.concatenate([zero, u[:-1]], 0)
        nxt = np.concatenate([u[1:], zero], 0)
        lp = p[f"_ChainLayer_{i}"]
        u = _layer_norm(lp["LayerNorm_0"], u + _mlp(lp["_MLP_0"], np.concatenate([u, prev, nxt], -1), 2))
        gp = p[f"_GroupLayer_{i}"]
        gi = np.broadcast_to(g[:, None, :], (G, G, g.shape[1]))
        gj = np.broadcast_to(g[None, :, :], (G, G, g.shape[1]))
        logits = _dense(gp["Dense_0"], np.tanh(_dense(gp["Dense_1"],
                                                       np.concatenate([gi, gj, links], -1))))[..., 0]
        logits = logits - logits.max(-1, keepdims=True)
        alpha = np.exp(logits)
        alpha /= alpha.sum(-1, keepdims=True)
        msg = _dense(gp["Dense_2"], np.concatenate([gj, links], -1)) * alpha[..., None]
        g = _layer_norm(gp["LayerNorm_0"], g + _mlp(gp["_MLP_0"], msg.sum(1), 2))
    pair = _gelu(_dense(p["Dense_0"], u)[:, None, :] + _dense(p["Dense_1"], g)[None, :, :])
    score = _mlp(p["_MLP_3"], pair, 2)[..., 0]
    top = score.max(-1, keepdims=True)
    return score - top - np.log(np.exp(score - top).sum(-1, keepdims=True))


def _numpy(tree):
    if isinstance(tree, dict):
        return {k: _numpy(v) for k, v in tree.items()}
    return np.asarray(tree, np.float32)
