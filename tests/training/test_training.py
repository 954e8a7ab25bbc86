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
    cached = [data.load_or_make(s) for s in specs]  # read back: the same labels and regrets
    for a, b in zip(samples, cached):
        assert np.array_equal(a.label, b.label) and np.array_equal(a.regret, b.regret)
    for targets in ("hard", "soft"):
        params, history = train(samples, epochs=50, lr=3e-3, progress=False, targets=targets)
        assert history["train_loss"][-1] < 0.6 * history["train_loss"][0], (targets, history)


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
    n, k = arrs[3].shape
    target = np.zeros((n, k), np.float32)
    target[:, 0] = 1.0
    weight = np.zeros(n, np.float32)
    assert float(make_loss(net)(params, arrs, target, weight)) == 0.0


def _labelled(spec_kw=None, *, memory_scale=1.0):
    spec = {"family": "transformer-block",
            "model": dict(size="tiny", d_model=64, n_heads=4, d_ff=256, n_layers=1, seq_len=64,
                          batch=16, dtype="float32"),
            "topology": {"grid": [2, 4], "bandwidth": [25e9, 450e9], "latency": [5e-6, 1e-6],
                         "device": "H100", "memory_scale": memory_scale}}
    cm, res = data.label(spec)
    return spec, cm, res


def test_a_candidates_regret_is_the_step_it_costs_with_the_rest_of_the_plan_kept():
    _, cm, res = _labelled()
    a = list(res.assignment)
    k = F.build(cm).cand_mask.shape[1]
    r = data.regrets(cm, a, k)
    assert r.shape == (len(cm.groups), k)
    base = cm.objective(a)
    checked = 0
    for grp in cm.groups:
        n = min(len(grp.candidates), k)
        assert np.all(np.isinf(r[grp.id, n:]))
        if n < 2:
            continue
        assert r[grp.id, a[grp.id]] == pytest.approx(0.0, abs=1e-12 * base)
        for c in range(0, n, max(n // 4, 1)):  # a few candidates of every group, exactly
            moved = list(a)
            moved[grp.id] = c
            if np.isfinite(r[grp.id, c]):
                assert r[grp.id, c] == pytest.approx(cm.objective(moved) - base,
                                                     rel=1e-9, abs=1e-12 * base)
                checked += 1
    assert checked > 50
    # The ILP's plan is a one-move optimum here (tied layers aside): no move improves on it.
    assert np.nanmin(np.where(np.isfinite(r), r, np.nan)) >= -1e-9 * base


def test_a_candidate_over_the_memory_limit_has_no_finite_regret():
    _, cm, res = _labelled(memory_scale=1e-4)  # about 8 MB per device: tight
    a = list(res.assignment)
    k = F.build(cm).cand_mask.shape[1]
    r = data.regrets(cm, a, k)
    total = cm.memory(a)
    limit = max(cm.capacity, total)
    over = 0
    for grp in cm.groups:
        for c in range(min(len(grp.candidates), k)):
            mem = total - cm.table(grp.id, a[grp.id]).memory + cm.table(grp.id, c).memory
            if len(grp.candidates) > 1 and mem > limit * (1 + 1e-9):
                assert np.isinf(r[grp.id, c])
                over += 1
    assert over > 0, "the test needs candidates over the limit"


def test_soft_targets_weigh_candidates_by_regret_and_hard_ones_are_the_ilps():
    from hulkjax.training.train import _batch, soft_targets

    spec, cm, res = _labelled()
    jg = F.build(cm)
    r = data.regrets(cm, res.assignment, jg.cand_mask.shape[1])
    sample = data.Sample(spec, jg, np.array(res.assignment, np.int32), res.objective, r)
    q = soft_targets(sample, temperature=0.01)
    for grp in cm.groups:
        row, reg = q[grp.id], r[grp.id]
        fin = np.isfinite(reg)
        assert row.sum() == pytest.approx(1.0) and np.all(row[~fin] == 0)
        # lower regret, more weight; equal regret, equal weight
        order = np.argsort(reg[fin], kind="stable")
        assert np.all(np.diff(row[fin][order]) <= 1e-12)
    _, hard, w_hard = _batch(sample, "hard")
    n_g = len(cm.groups)
    assert np.array_equal(np.argmax(hard[:n_g], axis=1), np.minimum(res.assignment,
                                                                      hard.shape[1] - 1))
    assert np.all(hard[:n_g].sum(axis=1) == 1.0)
    _, soft, w_soft = _batch(sample, "soft")
    assert np.array_equal(w_soft > 0, w_hard > 0)  # the same groups carry signal
    # where the ILP's candidate is the only one without regret, it weighs most
    for grp in cm.groups:
        if w_soft[grp.id] and np.sum(np.isclose(r[grp.id], 0.0, atol=1e-15)) == 1:
            assert np.argmax(soft[grp.id]) == res.assignment[grp.id]


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


def test_train_gnn_targets_are_the_planner_networks_option(capsys):
    from hulkjax.cli import main

    assert main(["train-gnn", "--head", "groups", "--targets", "hard"]) != 0
    assert "--targets is for the planner network" in capsys.readouterr().err
