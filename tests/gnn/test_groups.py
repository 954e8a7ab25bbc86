"""The device-group head: its NumPy forward pass is the flax module's (weights trained with one
plan with the other), and its features describe units and groups."""

import itertools

import jax
import numpy as np
import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.gnn.groups import (
    DEVICE_GROUP_FEATURES,
    LINK_FEATURES,
    UNIT_FEATURES,
    group_log_probs,
    order_scores,
    propose_orders,
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


def _brute_force_orders(logp):
    """Every assignment of units to groups as runs along an order: the best score per order of
    the groups used."""
    U, G = logp.shape
    best = {}
    for assign in itertools.product(range(G), repeat=U):
        runs = [assign[0]] + [a for a, b in zip(assign[1:], assign) if a != b]
        if len(set(runs)) != len(runs):
            continue  # a group running two separate ranges: not one order
        score = sum(logp[k, a] for k, a in enumerate(assign))
        best[tuple(runs)] = max(best.get(tuple(runs), -np.inf), score)
    return best


def test_order_scores_are_the_likeliest_runs_of_units_along_each_order():
    rng = np.random.default_rng(0)
    for G, U in ((3, 6), (4, 6)):
        x = rng.normal(size=(U, G)) * 2
        logp = x - np.log(np.exp(x).sum(1, keepdims=True))
        brute = _brute_force_orders(logp)
        scored = order_scores(logp)
        assert len({o for _, o in scored}) == len(scored)
        for score, order in scored:
            # the best of the runs of groups the order begins with (its idle groups last)
            want = max(v for k, v in brute.items() if order[:len(k)] == k)
            assert score == pytest.approx(want)
        assert scored[0][0] == pytest.approx(max(brute.values()))


def test_proposals_are_orders_of_the_groups_idle_ones_last():
    rng = np.random.default_rng(1)
    for G in (3, 4, 5, 6, 8):
        x = rng.normal(size=(12, G)) * 3
        x[:, G - 1] -= 30  # a group the head gives nothing: idle, so last
        logp = x - np.log(np.exp(x).sum(1, keepdims=True))
        props = propose_orders(logp, 2)
        assert 1 <= len(props) <= 2 and len(set(props)) == len(props)
        for o in props:
            assert sorted(o) == list(range(G)) and o[-1] == G - 1


def test_unit_features_see_a_tied_embedding_and_the_microbatches():
    topo = hj.Topology.preset("mixed", gpus_per_node=2)
    groups = topo.groups("node")
    _, tied = _stage_graph(topo)  # GPT-2: the LM head reads the token embedding
    assert tied.unit_x[0, 9] > 0 and tied.unit_x[-1, 8] > 0  # lent by the first, read by the last
    assert tied.unit_x[1:-1, 8].max() == 0 and tied.unit_x[0, 10] == 0  # one microbatch
    m = zoo.get("llama", size="tiny")
    part = partition(hj.trace(m.step, *m.abstract()))
    untied = stage_features(part.graph, part.phase, part.unit, part.home,
                            [u.label for u in part.units], topo, groups, microbatches=4)
    assert untied.unit_x[:, 8:10].max() == 0
    np.testing.assert_allclose(untied.unit_x[:, 10], 2 / 6)
