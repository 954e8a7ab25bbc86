"""The device-group head's training: labels over every order of the groups, regret-aware
targets, the loop and the command, end to end on a tiny dataset."""

import numpy as np
import pytest

from hulkjax.gnn.groups import StageGraph
from hulkjax.training import group_data
from hulkjax.training.groups import ALONE_CAP, alone_regret, random_regret, soft_targets

TINY = {"family": "gpt2", "model": dict(size="tiny", n_layers=3, batch=8),
        "cluster": {"kind": "pairs", "kinds": ["A100", "T4", "V100"], "gpus": 2,
                    "links": [[20.0, 2.0], [1.0, 30.0], [5.0, 5.0]]}}


def _label(steps, assign, own_step, own_assign):
    G = len(assign[0])
    return group_data.Label(
        "region", StageGraph(np.zeros((len(assign[0]), 1)), np.zeros((G, 1)), np.zeros((G, G, 1))),
        orders=np.array([[0, 1], [1, 0]]), steps=np.array(steps), assign=np.array(assign),
        own_step=own_step, own_assign=np.array(own_assign), own_orders=np.array([[0, 1]]))


def test_soft_targets_weigh_each_orders_layout_by_its_regret():
    # Order (1, 0) is 1% slower than the best: its layout weighs 1 / e of the best's.
    lab = _label([1.00, 1.01], [[0, 1], [1, 1]], own_step=1.00, own_assign=[0, 1])
    t = soft_targets(lab, temperature=0.01)
    w = np.exp(-1)
    np.testing.assert_allclose(t[0], [2 / (2 + w), w / (2 + w)], rtol=1e-6)
    np.testing.assert_allclose(t[1], [0, 1])
    # An order with no layout (inf) votes for nothing.
    lab = _label([1.0, np.inf], [[1, 0], [-1, -1]], own_step=2.0, own_assign=[0, 1])
    np.testing.assert_allclose(soft_targets(lab), [[0, 1], [1, 0]], atol=1e-12)
    assert lab.regret([(0, 1)]) == 1.0 and lab.regret([(1, 0)]) == 2.0  # the own search's
    assert random_regret(lab, 1) == 1.5 and random_regret(lab, 2) == 1.0
    # Alone (without the own orders' search), an order along which nothing fits counts
    # ALONE_CAP.
    assert alone_regret(lab, [(0, 1)]) == 1.0 and alone_regret(lab, [(1, 0)]) == ALONE_CAP
    assert random_regret(lab, 1, own=False) == (1.0 + ALONE_CAP) / 2


def test_labels_search_every_order_and_are_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("HULKJAX_CACHE", str(tmp_path))
    labels = group_data.load_or_make(TINY)
    assert [lab.level for lab in labels] == ["region"]
    lab = labels[0]
    U = lab.graph.unit_x.shape[0]
    assert sorted(map(tuple, lab.orders.tolist())) == sorted(
        [(0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0)])
    assert np.isfinite(lab.steps).all() and lab.assign.shape == (6, U)
    assert ((lab.assign >= 0) & (lab.assign < 3)).all()
    assert lab.best <= lab.own_step and lab.regret([]) == pytest.approx(lab.own_step / lab.best)
    again = group_data.load_or_make(TINY)[0]  # from the cache
    assert len(list(tmp_path.rglob("*.npz"))) == 1
    np.testing.assert_array_equal(again.assign, lab.assign)
    np.testing.assert_array_equal(again.graph.unit_x, lab.graph.unit_x)
    assert again.own_step == lab.own_step


def test_train_gnn_head_groups_trains_and_auto_proposes_with_it(tmp_path, monkeypatch):
    import hulkjax as hj
    from hulkjax import zoo
    from hulkjax.cli import main
    from hulkjax.gnn.weights import load
    from hulkjax.strategies.auto import head_orders
    from hulkjax.strategies.partition import partition

    monkeypatch.setenv("HULKJAX_CACHE", str(tmp_path / "cache"))
    specs = [TINY, dict(TINY, cluster=dict(TINY["cluster"], kinds=["T4", "T4", "H100"])),
             dict(TINY, family="llama", model=dict(size="tiny", n_layers=2))]
    monkeypatch.setattr(group_data, "sample_specs",
                        lambda n, seed: specs[:n] if seed == 1 else specs[2:2 + n])
    out = tmp_path / "weights"
    assert main(["train-gnn", "--head", "groups", "--samples", "2", "--val-samples", "1",
                 "--test-samples", "1", "--epochs", "3", "--out", str(out)]) == 0
    loaded = load(str(out), name="groups")
    hist = loaded.meta["history"]
    assert len(hist["train_loss"]) == 3 and hist["labels"] == {**hist["labels"], "train": 2,
                                                                 "val": 1}
    assert hist["val_head_regret"][-1] >= 1.0
    # The kept epoch is evaluated once on the test draw, with 1-3 orders proposed; the command
    # that made the weights is recorded.
    meta = loaded.meta
    assert meta["command"] == ("hulkjax train-gnn --head groups --samples 2 --val-samples 1 "
                               "--test-samples 1 --epochs 3")
    assert meta["samples"] == {"train": 2, "val": 1, "test": 1, "seed": 0}
    assert sorted(meta["test"]) == ["1", "2", "3"]
    assert meta["test"]["1"]["head_regret"] <= meta["test"]["1"]["own_regret"]
    m = zoo.get("gpt2", size="tiny", n_layers=3)
    graph = hj.trace(m.step, *m.abstract())
    topo = group_data.make_cluster(TINY["cluster"])
    groups = topo.groups("region")
    propose = head_orders(2, weights=str(out))
    orders = propose(partition(graph), topo, "region", groups)
    assert 1 <= len(orders) <= 2 and all(sorted(o) == [0, 1, 2] for o in orders)
    plan = hj.plan(m.step, *m.abstract(), topology=topo, strategy="auto", graph=graph,
                   weights=str(out), head_orders=2)
    assert plan.cost is not None
