"""The device-group head: its NumPy forward pass is the flax module's (weights trained with one
plan with the other), and its features describe units and groups."""

import jax
import numpy as np

import hulkjax as hj
from hulkjax import zoo
from hulkjax.gnn.groups import (
    DEVICE_GROUP_FEATURES,
    LINK_FEATURES,
    UNIT_FEATURES,
    group_log_probs,
    stage_features,
)
from hulkjax.strategies.partition import partition
from hulkjax.training.model import GroupHead


def _stage_graph(topo):
    m = zoo.get("gpt2", size="tiny")
    part = partition(hj.trace(m.step, *m.abstract()))
    groups = topo.groups("node")
    return part, stage_features(part.graph, part.phase, part.unit, part.home,
                                [u.label for u in part.units], topo, groups)


def test_numpy_forward_matches_the_flax_head():
    topo = hj.Topology.preset("mixed", gpus_per_node=2)
    part, sg = _stage_graph(topo)
    assert sg.unit_x.shape == (len(part.units), UNIT_FEATURES)
    assert sg.group_x.shape == (3, DEVICE_GROUP_FEATURES)
    assert sg.link_x.shape == (3, 3, LINK_FEATURES)
    head = GroupHead(hidden=16, layers=2)
    args = (sg.unit_x, sg.group_x, sg.link_x)
    params = head.init(jax.random.key(1), *args)
    want = np.asarray(jax.jit(head.apply)(params, *args))
    got = group_log_probs(params, sg, layers=2)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.exp(got).sum(-1), 1.0, rtol=1e-5)


def test_group_features_order_generations_by_speed():
    topo = hj.Topology.preset("mixed", gpus_per_node=2)
    _, sg = _stage_graph(topo)
    peak, share = sg.group_x[:, 0], sg.group_x[:, 5]
    assert peak[0] > peak[1] > peak[2]  # A100 > V100 > T4
    assert abs(share.sum() - 1.0) < 1e-6
    assert (sg.link_x[np.eye(3, dtype=bool), 2] == 1).all()
