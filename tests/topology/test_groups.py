"""Device groups as topologies (pipeline stages) and the presets of staged plans' experiments."""

import pytest

from hulkjax.errors import InvalidTopologyError
from hulkjax.topology import LinkSpec, Topology


def test_subset_keeps_specs_links_and_a_hierarchy_mesh():
    topo = Topology.preset("geo", regions=3, gpus_per_region=4, nodes_per_region=2)
    pair = topo.groups("region")[0] + topo.groups("region")[1]
    sub = topo.subset(pair)
    assert sub.axis_names == ("region", "node", "gpu") and sub.shape == (2, 2, 2)
    assert sub.link(0, 4) == topo.link(0, 4)  # oregon - virginia, measured
    assert sub.axis_link("gpu") == topo.axis_link("gpu")
    assert sub.regions == ("oregon", "virginia")


def test_canonical_subsets_of_one_shape_are_equal():
    topo = Topology.preset("regional", regions=3, gpus_per_node=4)
    subs = [topo.subset(g, canonical=True) for g in topo.groups("region")]
    assert subs[0] == subs[1] == subs[2] and hash(subs[0]) == hash(subs[2])
    assert subs[0].name == "group-4xA100" and subs[0].shape == (4,)


def test_subset_of_unequal_nodes_is_flat():
    topo = Topology.preset("hetero", nodes=(("A100", 4), ("V100", 2)))
    sub = topo.subset([1, 2, 3, 4, 5])  # 3 A100s of one node, 2 V100s of the other
    assert sub.axis_names == ("gpu",) and sub.shape == (5,)
    assert sub.slowest_device().kind == "V100"
    assert topo.subset([2, 3, 4, 5]).shape == (2, 2)  # equal nodes: node x gpu


def test_subset_of_a_grid_is_a_block():
    grid = Topology.grid((2, 4), ("data", "model"), bandwidth=(1e9, 1e11))
    row = grid.subset([4, 5, 6, 7])
    assert row.axis_names == ("model",) and row.axis_bandwidth("model") == 1e11
    with pytest.raises(InvalidTopologyError, match="not a block"):
        grid.subset([0, 5])


def test_regional_preset_joins_sites_by_metro_links():
    topo = Topology.preset("regional", regions=4, nodes_per_region=2, gpus_per_node=4)
    assert topo.shape == (4, 2, 4) and topo.axis_scope("region") == "wan"
    assert topo.axis_bandwidth("region") == 25e9 / 8 and topo.axis_latency("region") == 2e-3
    slow = Topology.preset("regional", metro=LinkSpec(bandwidth=10e9 / 8, latency=1e-3))
    assert slow.axis_bandwidth("region") == 10e9 / 8


def test_mixed_preset_lists_generations_fastest_first():
    topo = Topology.preset("mixed", h100=1, a100=1, v100=2, t4=1, gpus_per_node=2)
    assert [s.kind for s in topo.device_specs()] == ["H100", "A100", "V100", "T4"]
    assert len(topo.groups("node")) == 5 and topo.slowest_device().kind == "T4"
    with pytest.raises(InvalidTopologyError, match="at least one node"):
        Topology.preset("mixed", a100=0, v100=0, t4=0)


def test_dtfm_presets_use_the_measured_tables():
    us = Topology.preset("dtfm", case="us-regions")
    assert us.num_devices == 64 and us.regions == ("virginia", "oregon", "california", "ohio")
    assert us.link(0, 16).latency == 0.067 and us.link(16, 32).bandwidth == 1.25e9 / 8
    assert us.link(0, 1).bandwidth == 2e9 / 8  # two instances of one region
    cities = Topology.preset("dtfm", case="cities", gpus_per_region=2)
    bws = {cities.link(a, b).bandwidth * 8 / 1e9 for a in range(0, 16, 2) for b in range(0, 16, 2)
           if a != b}
    assert min(bws) == pytest.approx(0.335) and max(bws) == pytest.approx(1.16)
