"""The NumPy forward pass planning uses is the flax network's forward pass."""

import jax
import numpy as np
import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.gnn import features as F
from hulkjax.gnn.infer import log_probs
from hulkjax.gnn.weights import load
from hulkjax.strategies.realize import cost_model
from hulkjax.training.batching import to_graphs_tuple
from hulkjax.training.model import PlannerNet
from tests.helpers import TWO_D_TOPOLOGY


def _joined(model, topology):
    m = zoo.get(model, size="tiny")
    return F.build(cost_model(hj.trace(m.step, *m.abstract()), topology))


@pytest.mark.parametrize("model,topology", [
    ("transformer-block", TWO_D_TOPOLOGY),  # 2 of 3 axes real: the padded axis must not count
    ("cnn", hj.Topology.grid((8,), ("d",))),
])
def test_numpy_forward_matches_the_flax_network(model, topology):
    jg = _joined(model, topology)
    arrs = to_graphs_tuple(jg)
    shipped = load()
    cases = [(PlannerNet(hidden=16, layers=2), None),
             (PlannerNet(hidden=shipped.hidden, layers=shipped.layers), shipped.params)]
    cases[0] = (cases[0][0], cases[0][0].init(jax.random.key(3), *arrs))
    for net, params in cases:
        want = np.asarray(jax.jit(net.apply)(params, *arrs))[:jg.num_groups, :jg.cand_mask.shape[1]]
        got = log_probs(params, jg, layers=net.layers)
        assert got.shape == want.shape
        np.testing.assert_allclose(got[jg.cand_mask], want[jg.cand_mask], atol=2e-4, rtol=2e-4)
        assert np.all(got[~jg.cand_mask] < -1e8)


def test_weights_of_another_network_fail_clearly():
    jg = _joined("mlp", TWO_D_TOPOLOGY)
    net = PlannerNet(hidden=8, layers=1)
    params = net.init(jax.random.key(0), *to_graphs_tuple(jg))
    with pytest.raises(hj.HulkjaxError, match="train-gnn"):
        log_probs(params, jg, layers=2)  # a layer the weights do not have


def test_features_of_repeated_layers_are_shared_and_equal_to_their_own():
    """Groups with the same candidates share their candidate feature rows (a speed-up): the
    features equal those built when no two groups share a candidate list."""
    import numpy as np

    import hulkjax as hj
    from hulkjax import zoo
    from hulkjax.cost import CostModel
    from hulkjax.gnn import features as F

    m = zoo.get("gpt2", size="tiny")
    g = hj.trace(m.step, *m.abstract())
    topo = hj.Topology.grid((2, 4), ("data", "model"))
    shared = F.build(CostModel(g, topo))
    cm = CostModel(g, topo)
    for grp in cm.groups:
        grp.candidates = list(grp.candidates)  # no two leaders share a list any more
    own = F.build(cm)
    for field in ("group_x", "cand_roles", "cand_extra", "cand_mask", "edge_x"):
        assert np.array_equal(getattr(shared, field), getattr(own, field)), field
