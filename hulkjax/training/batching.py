"""Padding joined graphs into ``jraph.GraphsTuple`` size buckets for the jitted training model.

Nodes and edges are padded to powers of two, candidates to 16, 64 or 256, so the model compiles a
handful of times, not once per graph.
"""

from __future__ import annotations

import math

import jraph
import numpy as np

from hulkjax.gnn.features import (
    AXIS_FEATURES,
    CAND_EXTRA,
    EDGE_FEATURES,
    GROUP_FEATURES,
    MAX_AXES,
    MAX_CANDIDATES,
    ROLE_FEATURES,
    JoinedGraph,
)


def _bucket(n: int, floor: int = 16) -> int:
    return max(floor, 1 << math.ceil(math.log2(max(n, 1))))


def _k_bucket(k: int) -> int:
    return next((b for b in (16, 64, MAX_CANDIDATES) if k <= b), k)


def to_graphs_tuple(jg: JoinedGraph, *, k_pad: int | None = None):
    """A padded ``jraph.GraphsTuple`` (node features = groups then axes, zero-padded to a bucket)
    and the padded candidate arrays ``(roles, extra, mask)``."""
    n_g, n_a = jg.num_groups, jg.axis_x.shape[0]
    n_nodes = n_g + n_a
    nodes_pad = _bucket(n_nodes + 1, 64)
    edges_pad = _bucket(len(jg.senders) + 1, 512)
    width = GROUP_FEATURES + AXIS_FEATURES + 1
    x = np.zeros((nodes_pad, width), np.float32)
    x[:n_g, :GROUP_FEATURES] = jg.group_x
    x[n_g:n_nodes, GROUP_FEATURES:GROUP_FEATURES + AXIS_FEATURES] = jg.axis_x
    x[n_g:n_nodes, -1] = 1.0  # is-axis flag
    senders = np.full(edges_pad, nodes_pad - 1, np.int32)
    receivers = np.full(edges_pad, nodes_pad - 1, np.int32)
    e = np.zeros((edges_pad, EDGE_FEATURES), np.float32)
    senders[:len(jg.senders)] = jg.senders
    receivers[:len(jg.receivers)] = jg.receivers
    e[:len(jg.edge_x)] = jg.edge_x
    graph = jraph.GraphsTuple(nodes=x, edges=e, senders=senders, receivers=receivers,
                              n_node=np.array([n_nodes, nodes_pad - n_nodes], np.int32),
                              n_edge=np.array([len(jg.senders), edges_pad - len(jg.senders)], np.int32),
                              globals=None)
    k = jg.cand_mask.shape[1]
    k_pad = max(k_pad or _k_bucket(k), k)
    roles = np.zeros((nodes_pad, k_pad, MAX_AXES, ROLE_FEATURES), np.float32)
    extra = np.zeros((nodes_pad, k_pad, CAND_EXTRA), np.float32)
    mask = np.zeros((nodes_pad, k_pad), bool)
    roles[:n_g, :k] = jg.cand_roles
    extra[:n_g, :k] = jg.cand_extra
    mask[:n_g, :k] = jg.cand_mask
    axis_index = np.zeros(MAX_AXES, np.int32)
    axis_index[:n_a] = np.arange(n_g, n_nodes)
    return graph, roles, extra, mask, axis_index, jg.axis_mask.copy()
