"""The ``aws-p3`` preset: Alpa's p3.16xlarge cluster (8 x V100 16 GB per node, 25 Gb/s between)."""

import pytest

from hulkjax.errors import InvalidTopologyError
from hulkjax.topology import Topology


def test_aws_p3_has_alpas_cluster_numbers():
    topo = Topology.preset("aws-p3")  # 8 instances, Alpa's 64 GPUs
    assert (topo.num_devices, topo.axis_names, topo.shape) == (64, ("node", "gpu"), (8, 8))
    spec = topo.slowest_device()
    assert (spec.kind, spec.memory, spec.peak_flops) == ("V100-16GB", 16e9, 1.25e14)
    assert topo.axis_link("gpu").bandwidth == 150e9  # NVLink2 per GPU per direction
    # 25 Gb/s per instance, shared by its 8 GPUs: bytes/s per GPU.
    assert topo.axis_link("node").bandwidth == pytest.approx(25e9 / 8 / 8)


def test_aws_p3_part_of_one_node_and_round_trip():
    topo = Topology.preset("aws-p3", nodes=1, gpus_per_node=4)
    assert (topo.name, topo.axis_names, topo.shape) == ("aws-p3x1-4gpu", ("gpu",), (4,))
    two = Topology.preset("aws-p3", nodes=2)
    assert Topology.from_dict(two.to_dict()) == two
    with pytest.raises(InvalidTopologyError, match="nodes=0"):
        Topology.preset("aws-p3", nodes=0)
