"""The device-group head (Hulk: a distribution over device groups per layer): features, its
NumPy forward pass, and the orders of the groups it proposes to the staged search.

Where this sits::

    strategies.partition (layer units)  +  topology groups (regions, nodes, GPU kinds)
            |   stage_features(...)
            v
    StageGraph: unit features along the step, device-group features, links between groups
            |   group_log_probs(params, sg)   (NumPy; the flax twin is
            v                                   hulkjax.training.model.GroupHead)
    log P(unit k runs on group j)   [units, groups]
            |   propose_orders(logp, n)
            v
    orders of the groups -> strategies.stages.search (its dynamic program runs along each)

The head's job is the one part of the staged search that is a guess: the orders of the groups
the dynamic program places stages along (:func:`hulkjax.strategies.stages.chains` tries three
heuristic ones; every order is ``G!``). Trained on the best layouts of every order of 3-4 groups
(``hulkjax train-gnn --head groups``, :mod:`hulkjax.training.groups`), it proposes the orders
its distribution makes likeliest; the search costs them after its own, so a proposal can only
add layouts. How many orders ``auto`` asks it for is
:class:`hulkjax.strategies.auto.AutoOptions`' ``head_orders``.

**Status: trained, no better than random orders.** The shipped weights
(``weights/groups.msgpack``; ``groups.json`` has the command, sizes and test numbers) were
trained on 113 labels of 3-4 groups. On 26 test labels the search's own orders are 1.0067x the
best order (geometric mean), own + the head's order 1.0066x, own + a random order 1.0043x;
the head's orders alone 1.017x against random 1.019x (README, "The learned planner"). It
ships because it cannot make a plan slower.

The network: units (a chain along the forward pass) exchange messages with their neighbours;
groups attend to each other through their links; a unit-group pair is scored by an MLP of the two
embeddings; a softmax over groups per unit.

>>> import numpy as np
>>> sg = StageGraph(unit_x=np.zeros((3, UNIT_FEATURES), np.float32),
...                 group_x=np.zeros((2, DEVICE_GROUP_FEATURES), np.float32),
...                 link_x=np.zeros((2, 2, LINK_FEATURES), np.float32))
>>> sg.unit_x.shape, sg.num_groups
((3, 11), 2)
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from hulkjax.cost.pipeline import stage_link
from hulkjax.gnn.infer import _dense, _gelu, _layer_norm, _mlp
from hulkjax.trace.graph import PARAMETER

UNIT_FEATURES = 11
DEVICE_GROUP_FEATURES = 8
LINK_FEATURES = 3


@dataclass
class StageGraph:
    """Arrays of the device-group head.

    Attributes:
      unit_x: ``[U, UNIT_FEATURES]`` float32: per layer unit, log FLOPs of its forward, backward
        and update nodes, log bytes of its parameters, of the activations it hands on and of those
        it saves, its position along the step, whether its scope repeats (a layer), log bytes of
        the parameters it reads that live in another unit and of its own that another unit
        reads (a tied embedding: the LM head reads the first unit's), and log2 of the most
        microbatches the step can be cut into (0 where it cannot be microbatched), / 6.
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


def _readers(graph, value: int, depth: int = 3) -> set[int]:
    """Nodes reading ``value``, through up to ``depth`` one-operand nodes (a cast, a transpose
    of a parameter before its matmul)."""
    out, frontier = set(), [value]
    for _ in range(depth):
        nxt = []
        for v in frontier:
            for c, _ in graph.consumers(v):
                out.add(c)
                node = graph.nodes[c]
                if sum(x is not None for x in node.inputs) == 1:
                    nxt.extend(node.outputs)
        frontier = nxt
    return out


def stage_features(graph, phase, unit, home, labels, topology, groups, *,
                   microbatches: int = 1) -> StageGraph:
    """The :class:`StageGraph` of a step cut into units (``phase`` / ``unit`` per node, ``home``
    unit per input, unit ``labels``: a :class:`hulkjax.strategies.partition.Partition`'s fields)
    on ``groups`` of ``topology``'s devices; ``microbatches``: the most the step may be cut
    into."""
    import re

    U, G = len(labels), len(groups)
    ux = np.zeros((U, UNIT_FEATURES), np.float32)
    flops = np.zeros((U, 3))
    for n in graph.nodes:
        flops[unit[n.id], "FBU".index(phase[n.id])] += n.flops
    params, borrowed, lent = np.zeros(U), np.zeros(U), np.zeros(U)
    for i, u in home.items():
        if graph.input_roles[i] == PARAMETER:
            nb = graph.values[graph.inputs[i]].nbytes
            params[u] += nb
            others = {unit[c] for c in _readers(graph, graph.inputs[i])
                      if phase[c] == "F"} - {u}
            for r in others:
                borrowed[r] += nb
            if others:
                lent[u] += nb
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
        ux[k, 8] = _log(borrowed[k] + 1) / 12
        ux[k, 9] = _log(lent[k] + 1) / 12
        ux[k, 10] = math.log2(max(microbatches, 1)) / 6
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


def order_scores(logp: np.ndarray) -> list[tuple[float, tuple[int, ...]]]:
    """Every order of the groups scored by the head: ``(score, order)``, best first, one per
    distinct order of the groups used.

    An order's score is the log-likelihood of the likeliest way to run the units along it:
    consecutive runs of units on the groups in that order, a group skipped (left idle) where
    that is likelier (a Viterbi pass per order). Orders that use the same groups in the same
    order score alike; each is returned once, its idle groups last (the staged search's
    interleaved schedule uses prefixes of an order), by their total probability.

    >>> logp = np.log(np.array([[.9, .05, .05], [.1, .1, .8], [.1, .1, .8]]))
    >>> [o for _, o in order_scores(logp)][:2]
    [(0, 2, 1), (2, 0, 1)]
    """
    U, G = logp.shape
    mass = np.exp(logp).sum(0)
    best: dict[tuple[int, ...], float] = {}
    positions = np.arange(G)
    for order in itertools.permutations(range(G)):
        lp = logp[:, order]  # [U, position]
        score = lp[0].copy()
        back = np.zeros((U, G), np.int64)
        for k in range(1, U):
            run = np.maximum.accumulate(score)  # the best position at or before each one
            back[k] = np.maximum.accumulate(np.where(score >= run, positions, 0))  # its index
            score = run + lp[k]
        p = int(np.argmax(score))
        total = float(score[p])
        used = [p]
        for k in range(U - 1, 0, -1):
            p = int(back[k, p])
            if p != used[-1]:
                used.append(p)
        used = [order[q] for q in reversed(used)]
        idle = sorted(set(range(G)) - set(used), key=lambda j: (-mass[j], j))
        key = tuple(used + idle)
        if total > best.get(key, -math.inf):
            best[key] = total
    return sorted(((v, k) for k, v in best.items()), key=lambda t: (-t[0], t[1]))


MAX_SCORED_GROUPS = 6  # beyond, orders come from the expected unit index (G! is too many)


def propose_orders(logp: np.ndarray, n: int = 1) -> list[tuple[int, ...]]:
    """The ``n`` likeliest orders of the groups under the head's ``[units, groups]``
    log-probabilities (:func:`order_scores`; none with more than :data:`MAX_SCORED_GROUPS`
    groups), filled up with the groups by the mean index of the units they receive, those
    expected to run less than half a unit last (where the likeliest runs of every order use
    the same groups, the scores tie and give one order).

    >>> logp = np.log(np.array([[.1, .9], [.2, .8], [.7, .3]]))
    >>> propose_orders(logp)
    [(1, 0)]
    """
    U, G = logp.shape
    scored = [o for _, o in order_scores(logp)[:n]] if G <= MAX_SCORED_GROUPS else []
    p = np.exp(logp)
    mass = p.sum(0)
    mean = (p * np.arange(U)[:, None]).sum(0) / np.maximum(mass, 1e-12)
    by_mean = tuple(sorted(range(G), key=lambda j: (mass[j] < 0.5, mean[j], j)))
    return list(dict.fromkeys([*scored, by_mean]))[:n]


def _numpy(tree):
    if isinstance(tree, dict):
        return {k: _numpy(v) for k, v in tree.items()}
    return np.asarray(tree, np.float32)
