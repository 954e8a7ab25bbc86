"""Shared plans for the explanation and plot tests (planned abstractly: nothing is compiled)."""

import matplotlib
import pytest

import hulkjax as hj
from hulkjax import zoo

matplotlib.use("Agg")  # no display in tests; hulkjax.viz itself never touches pyplot

# 8 devices with two link classes: mesh node=2 (between nodes) x gpu=4 (inside a node).
TWO_NODES = hj.Topology.preset("dgx-h100", nodes=2, gpus_per_node=4)


@pytest.fixture(scope="session")
def gpt2_tiny():
    m = zoo.get("gpt2", size="tiny")
    return m, m.abstract()


@pytest.fixture(scope="session")
def gpt2_plans(gpt2_tiny):
    m, (state, batch) = gpt2_tiny
    return hj.compare(m.step, state, batch, topology=TWO_NODES,
                      strategies=["replicate", "dp", "fsdp", "megatron", "dp_tp", "expert"])


@pytest.fixture(scope="session")
def geo_plans():
    m = zoo.get("mlp", size="tiny", batch=12)  # divides region=3 x gpu=2
    state, batch = m.abstract()
    return hj.compare(m.step, state, batch, topology=hj.Topology.preset("geo"),
                      strategies=["replicate", "dp", "fsdp", "dp_tp"])
