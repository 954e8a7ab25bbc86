"""The learned planner: feature encoding, training, shipped weights, and ``auto``."""

import jax
import numpy as np
import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.gnn import features as F
from hulkjax.gnn.weights import load
from hulkjax.strategies.realize import cost_model
from hulkjax.training import data
from hulkjax.training.batching import to_graphs_tuple
from hulkjax.training.model import PlannerNet
from hulkjax.training.train import make_loss, train

TWO_D = hj.Topology.grid((2, 4), ("data", "model"), bandwidth=(25e9, 450e9), latency=(5e-6, 1e-6))


def _cm(model="mlp", topology=TWO_D, **kw):
    m = zoo.get(model, size="tiny", **kw)
    g = hj.trace(m.step, *m.abstract())
    return cost_model(g, topology)


def test_features_cover_groups_axes_and_candidates():
    cm = _cm("transformer-block")
    jg = F.build(cm)
    n_g = len(cm.groups)
    assert jg.group_x.shape == (n_g, F.GROUP_FEATURES)
    assert jg.axis_x.shape == (2, F.AXIS_FEATURES)
    assert list(jg.axis_mask) == [True, True, False]
    real = jg.cand_mask.sum(axis=1)
    assert list(real) == [min(len(g.candidates), F.MAX_CANDIDATES) for g in cm.groups]
    # Candidate 0 is the replicated one: every real axis has the "none" role.
    assert np.all(jg.cand_roles[:, 0, :2, 0] == 1)
    # The fast axis has the higher bandwidth feature.
    assert jg.axis_x[1, 1] > jg.axis_x[0, 1]
    # Tensor edges come in both directions; every non-free group is linked to every axis.
    tensor = jg.edge_x[:, 2] == 0
    assert tensor.sum() == 2 * len(list(cm.edge_items()))
    assert np.all((jg.senders < n_g + 2) & (jg.receivers < n_g + 2))


def test_padding_buckets_keep_the_real_graph():
    cm = _cm("mlp")
    jg = F.build(cm)
    graph, roles, extra, mask, axis_index, axis_mask = to_graphs_tuple(jg)
    n = jg.num_groups + 2
    assert graph.nodes.shape[0] >= n + 1 and graph.nodes.shape[0] & (graph.nodes.shape[0] - 1) == 0
    assert int(graph.n_node[0]) == n
    assert mask[:jg.num_groups].sum() == jg.cand_mask.sum() and not mask[jg.num_groups:].any()
    assert list(axis_index[:2]) == [jg.num_groups, jg.num_groups + 1]


def test_a_tiny_training_run_lowers_its_loss(tmp_path, monkeypatch):
    monkeypatch.setenv("HULKJAX_CACHE", str(tmp_path))
    specs = [{"family": "mlp", "model": dict(size="tiny", depth=2, width=w, in_dim=w, out_dim=w,
                                             batch=b, optimizer="sgd"),
              "topology": {"grid": [8], "bandwidth": [bw], "latency": [1e-5], "device": "V100",
                           "memory_scale": 1.0}}
             for w, b, bw in [(2048, 8, 1e10), (64, 16384, 1e11), (512, 512, 1e9)]]
    samples = [data.load_or_make(s) for s in specs]
    assert all(s is not None for s in samples)
    assert len(list(tmp_path.rglob("*.npz"))) == 3  # cached on disk
    params, history = train(samples, epochs=50, lr=3e-3, progress=False)
    assert history["train_loss"][-1] < 0.6 * history["train_loss"][0], history["train_loss"]


def test_shipped_weights_load_and_give_distributions():
    loaded = load()
    assert loaded is not None, "hulkjax/gnn/weights/planner.msgpack must ship with the package"
    params = loaded.params
    cm = _cm("transformer-block")
    from hulkjax.strategies.auto import prior

    logp = prior(cm)
    assert logp.shape[0] == len(cm.groups)
    for grp in cm.groups:
        k = min(len(grp.candidates), logp.shape[1])
        assert np.exp(logp[grp.id, :k]).sum() == pytest.approx(1.0, abs=1e-4)
    assert jax.tree.leaves(params)


@pytest.mark.parametrize("model", ["mlp", "transformer-block", "moe"])
def test_auto_is_never_worse_than_a_baseline_and_the_prior_helps(model):
    m = zoo.get(model, size="tiny")
    state, batch = m.abstract()
    g = hj.trace(m.step, state, batch)
    auto = hj.plan(m.step, state, batch, topology=TWO_D, strategy="auto", graph=g)
    for name in ("dp", "fsdp", "megatron", "dp_tp", "expert", "replicate"):
        base = hj.plan(m.step, state, batch, topology=TWO_D, strategy=name, graph=g)
        assert auto.cost.step_time <= base.cost.step_time * (1 + 1e-9), name
    assert auto.notes[0].startswith("auto: network prior + search")


def test_loss_ignores_groups_without_a_choice():
    cm = _cm("mlp")
    jg = F.build(cm)
    net = PlannerNet(hidden=8, layers=1)
    arrs = to_graphs_tuple(jg)
    params = net.init(jax.random.key(0), *arrs)
    n = arrs[0].nodes.shape[0]
    label = np.zeros(n, np.int32)
    weight = np.zeros(n, np.float32)
    assert float(make_loss(net)(params, arrs, label, weight)) == 0.0


def test_train_gnn_command_writes_weights_auto_can_use(tmp_path, monkeypatch):
    from hulkjax.cli import main

    monkeypatch.setenv("HULKJAX_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "weights"
    assert main(["train-gnn", "--samples", "3", "--val-samples", "1", "--epochs", "2",
                 "--out", str(out)]) == 0
    assert (out / "planner.msgpack").exists() and (out / "planner.json").exists()
    m = zoo.get("mlp", size="tiny")
    p = hj.plan(m.step, *m.abstract(), topology=TWO_D, strategy="auto", weights=str(out))
    assert p.notes[0].startswith("auto: network prior + search")


def test_shortlist_holds_the_likeliest_candidates_and_every_way_to_finish_a_split():
    from hulkjax.strategies.auto import TOP_K, prior, shortlist

    cm = _cm("transformer-block")
    logp = prior(cm)
    seed = cm.replicated_assignment()
    start, options = shortlist(cm, logp, seeds={"replicated": seed})
    for grp in cm.groups:
        n = len(grp.candidates)
        opts = set(options[grp.id])
        likeliest = np.argsort(-logp[grp.id, :n], kind="stable")[:TOP_K]
        assert set(likeliest.tolist()) <= opts and 0 in opts and seed[grp.id] in opts
        assert start[grp.id] == likeliest[0]
        if grp.kind == "leader":
            for c in opts:
                same_operands = {k for k, r in enumerate(grp.candidates)
                                 if r.in_specs == grp.candidates[c].in_specs}
                assert same_operands <= opts, (grp.id, c)
    # Somewhere a split is finished in more than one way, and all of them are kept.
    assert any(sum(x.kind == "reduce-scatter" for r in [grp.candidates[c] for c in options[grp.id]]
                   for x in r.comms) > 1 for grp in cm.groups if grp.kind == "leader")
