"""Topology: presets, per-axis links, device groups, meshes, construction checks (closed form)."""

import itertools
import math
import os
import pickle
import random
import subprocess
import sys

import jax
import numpy as np
import pytest

from hulkjax.errors import InvalidTopologyError, NotEnoughDevicesError
from hulkjax.topology import DEVICE_SPECS, Device, DeviceSpec, LinkSpec, PairLink, Topology

GB = 1e9


# ------------------------------------------------------------------------------------ specs


def test_device_specs_table():
    assert set(DEVICE_SPECS) == {"H100", "H200", "A100", "V100", "T4", "TPUv5e", "TPUv5p", "TPUv6e",
                                "cpu"}
    h100 = DEVICE_SPECS["H100"]
    assert (h100.peak_flops, h100.memory, h100.hbm_bandwidth) == (9.9e14, 80e9, 3.35e12)
    assert DEVICE_SPECS["TPUv6e"].peak_flops == 9.18e14  # Cloud TPU v6e documentation
    assert DEVICE_SPECS["TPUv5e"].peak_flops == 1.97e14
    for kind, spec in DEVICE_SPECS.items():
        assert spec.kind == kind


def test_specs_are_frozen_hashable_and_normalize_ints():
    spec = DeviceSpec(kind="X", peak_flops=10**15, memory=80 * 10**9, hbm_bandwidth=3 * 10**12)
    assert isinstance(spec.memory, float) and spec.memory == 80e9
    assert hash(spec) == hash(
        DeviceSpec(kind="X", peak_flops=1e15, memory=80e9, hbm_bandwidth=3e12)
    )
    with pytest.raises(AttributeError):
        spec.memory = 1.0  # type: ignore[misc]
    link = LinkSpec(bandwidth=1e9, latency=0)
    assert link.time(2e9) == 2.0


@pytest.mark.parametrize(
    "kwargs, field, value",
    [
        (dict(peak_flops=-1.0), "DeviceSpec.peak_flops", "-1.0"),
        (dict(memory=0), "DeviceSpec.memory", "0"),
        (dict(hbm_bandwidth=float("nan")), "DeviceSpec.hbm_bandwidth", "nan"),
        (dict(hbm_bandwidth=True), "DeviceSpec.hbm_bandwidth", "True"),
        (dict(kind=""), "DeviceSpec.kind", "''"),
    ],
)
def test_device_spec_rejects_bad_values(kwargs, field, value):
    base = dict(kind="X", peak_flops=1e12, memory=1e9, hbm_bandwidth=1e11)
    with pytest.raises(InvalidTopologyError) as e:
        DeviceSpec(**{**base, **kwargs})
    assert field in str(e.value) and value in str(e.value)


@pytest.mark.parametrize(
    "kwargs, field, value",
    [
        (dict(bandwidth=0.0, latency=1e-6), "LinkSpec.bandwidth", "0.0"),
        (dict(bandwidth=-5e9, latency=1e-6), "LinkSpec.bandwidth", "-5000000000.0"),
        (dict(bandwidth=float("inf"), latency=1e-6), "LinkSpec.bandwidth", "inf"),
        (dict(bandwidth=1e9, latency=-1.0), "LinkSpec.latency", "-1.0"),
        (dict(bandwidth="fast", latency=1e-6), "LinkSpec.bandwidth", "'fast'"),
    ],
)
def test_link_spec_rejects_bad_values(kwargs, field, value):
    with pytest.raises(InvalidTopologyError) as e:
        LinkSpec(**kwargs)
    assert field in str(e.value) and value in str(e.value)


def test_device_rejects_bad_values():
    with pytest.raises(InvalidTopologyError, match=r"Device.id.*id=-1"):
        Device(id=-1, spec=DEVICE_SPECS["cpu"], region="r", node="n")
    with pytest.raises(InvalidTopologyError, match=r"Device.spec.*'H100'"):
        Device(id=0, spec="H100", region="r", node="n")  # type: ignore[arg-type]
    with pytest.raises(InvalidTopologyError, match=r"Device.node.*node=''"):
        Device(id=0, spec=DEVICE_SPECS["cpu"], region="r", node="")


# ------------------------------------------------------------------------------------ presets


def test_presets_list_and_unknown_name():
    assert Topology.presets() == ["aws-p3", "dgx-h100", "dtfm", "geo", "hetero", "mixed",
                                  "regional", "tpu-v5e", "tpu-v5p", "tpu-v6e"]
    with pytest.raises(InvalidTopologyError) as e:
        Topology.preset("dgx-a100")
    msg = str(e.value)
    assert "'dgx-a100'" in msg and all(name in msg for name in Topology.presets())


def test_preset_unknown_argument_and_bad_value():
    with pytest.raises(InvalidTopologyError, match=r"'gpus'.*nodes.*gpus_per_node"):
        Topology.preset("dgx-h100", gpus=4)
    with pytest.raises(InvalidTopologyError, match=r"nodes=0"):
        Topology.preset("dgx-h100", nodes=0)


def test_dgx_h100_single_node():
    topo = Topology.preset("dgx-h100")
    assert topo.num_devices == 8
    assert topo.axis_names == ("gpu",) and topo.shape == (8,)
    assert all(d.spec == DEVICE_SPECS["H100"] for d in topo.devices)
    assert topo.axis_link("gpu") == LinkSpec(bandwidth=450 * GB, latency=1e-6)
    assert not topo.is_heterogeneous


def test_dgx_h100_two_nodes_axis_links():
    topo = Topology.preset("dgx-h100", nodes=2)
    assert topo.name == "dgx-h100x2"
    assert (topo.num_devices, topo.axis_names, topo.shape) == (16, ("node", "gpu"), (2, 8))
    assert topo.axis_size("node") == 2 and topo.axis_size("gpu") == 8
    # gpu axis: groups are the 8 GPUs of one node -> NVLink4.
    assert topo.axis_bandwidth("gpu") == 450e9 and topo.axis_latency("gpu") == 1e-6
    # node axis: groups pair GPU i of node 0 with GPU i of node 1 -> InfiniBand, 400 Gb/s per GPU.
    assert topo.axis_bandwidth("node") == 400e9 / 8 and topo.axis_latency("node") == 5e-6
    assert (topo.axis_scope("gpu"), topo.axis_scope("node")) == ("node", "region")
    assert topo.link(0, 7).bandwidth == 450e9 and topo.link(3, 11).bandwidth == 50e9
    assert [d.node for d in topo.devices] == ["node0"] * 8 + ["node1"] * 8
    assert topo.groups("node") == (tuple(range(8)), tuple(range(8, 16)))
    assert topo.groups("region") == (tuple(range(16)),)


def test_dgx_h100_custom_gpus_per_node_drops_size1_axes():
    topo = Topology.preset("dgx-h100", nodes=4, gpus_per_node=1)
    assert topo.axis_names == ("node",) and topo.shape == (4,)
    assert topo.axis_link("node").bandwidth == 50e9


def test_tpu_v5e():
    topo = Topology.preset("tpu-v5e")
    assert topo.shape == (4, 4) and topo.axis_names == ("x", "y")
    assert all(d.spec == DEVICE_SPECS["TPUv5e"] for d in topo.devices)
    # Two ICI links per axis per chip, ~50 GB/s each per direction.
    assert topo.axis_bandwidth("x") == topo.axis_bandwidth("y") == 2 * 50e9
    assert Topology.preset("tpu-v5e", chips=8).shape == (2, 4)
    assert Topology.preset("tpu-v5e", chips=256).shape == (16, 16)
    assert Topology.preset("tpu-v5e", shape=(1, 8)).axis_names == ("y",)
    with pytest.raises(InvalidTopologyError, match="16 x 16"):
        Topology.preset("tpu-v5e", shape=(4, 32))
    with pytest.raises(InvalidTopologyError, match="not both"):
        Topology.preset("tpu-v5e", shape=(4, 4), chips=16)


def test_geo_default_region_axis_pays_slowest_wan_pair():
    topo = Topology.preset("geo")
    assert topo.regions == ("oregon", "virginia", "ohio")
    assert topo.shape == (3, 2) and topo.axis_names == ("region", "gpu")
    # Yuan et al.: Oregon-Virginia 67 ms / 0.79 Gb/s is the slowest of the three pairs in both terms.
    assert topo.axis_link("region") == LinkSpec(bandwidth=0.79e9 / 8, latency=0.067)
    assert topo.axis_scope("region") == "wan"
    assert topo.axis_link("gpu") == LinkSpec(bandwidth=150e9, latency=1e-6)  # V100 NVLink2
    # Per-pair links between devices: virginia (ids 2, 3) - ohio (ids 4, 5) is 11 ms / 1.12 Gb/s.
    assert topo.link(2, 5) == LinkSpec(bandwidth=1.12e9 / 8, latency=0.011)
    assert topo.link(0, 5) == LinkSpec(bandwidth=1.10e9 / 8, latency=0.049)
    assert topo.groups("region") == ((0, 1), (2, 3), (4, 5))


def test_geo_region_subset_and_node_level():
    topo = Topology.preset(
        "geo", region_names=["virginia", "ohio"], gpus_per_region=8, nodes_per_region=2
    )
    assert topo.axis_names == ("region", "node", "gpu") and topo.shape == (2, 2, 4)
    assert topo.axis_link("region") == LinkSpec(bandwidth=1.12e9 / 8, latency=0.011)
    assert topo.axis_link("node") == LinkSpec(bandwidth=100e9 / 8, latency=1e-5)
    assert topo.axis_scope("node") == "region"
    with pytest.raises(InvalidTopologyError, match="must divide"):
        Topology.preset("geo", gpus_per_region=3, nodes_per_region=2)


def test_geo_unmeasured_pair_uses_wan_default():
    wan = LinkSpec(bandwidth=1e8, latency=0.1)
    topo = Topology.preset("geo", region_names=["tokyo", "seoul", "mars"], wan=wan)
    assert topo.link(0, 2) == LinkSpec(bandwidth=1.10e9 / 8, latency=0.034)  # tokyo-seoul measured
    assert topo.link(0, 4) == wan
    assert topo.axis_link("region") == LinkSpec(bandwidth=1e8, latency=0.1)


def test_hetero_default():
    topo = Topology.preset("hetero")
    assert topo.num_devices == 8 and topo.shape == (2, 4) and topo.axis_names == ("node", "gpu")
    assert topo.is_heterogeneous
    assert [d.spec.kind for d in topo.devices] == ["A100"] * 4 + ["V100"] * 4
    assert topo.slowest_device() == DEVICE_SPECS["V100"]
    assert topo.groups("kind") == ((0, 1, 2, 3), (4, 5, 6, 7))
    # 10 Gb/s Ethernet between nodes (HAP/TAG); inside nodes the V100 NVLink2 is the bottleneck.
    assert topo.axis_link("node").bandwidth == 10e9 / 8
    assert topo.axis_link("gpu").bandwidth == 150e9
    assert topo.link(0, 1).bandwidth == 300e9 and topo.link(4, 5).bandwidth == 150e9


def test_hetero_custom_and_unequal_nodes():
    topo = Topology.preset("hetero", nodes=[("H100", 2), ("A100", 2), ("T4", 2)])
    assert topo.shape == (3, 2) and topo.groups("kind") == ((0, 1), (2, 3), (4, 5))
    assert topo.slowest_device().kind == "T4"
    flat = Topology.preset("hetero", nodes=[("A100", 4), ("V100", 2)])
    assert flat.axis_names == ("gpu",) and flat.shape == (6,)
    assert flat.axis_link("gpu").bandwidth == 10e9 / 8
    with pytest.raises(InvalidTopologyError, match="'P100'"):
        Topology.preset("hetero", nodes=[("P100", 4)])


# ------------------------------------------------------------------------------------ grid


def test_grid_scalar_and_per_axis_links():
    topo = Topology.grid((2, 4), ("data", "model"), bandwidth=(25e9, 450e9), latency=(5e-6, 1e-6))
    assert topo.axis_link("data") == LinkSpec(bandwidth=25e9, latency=5e-6)
    assert topo.axis_link("model") == LinkSpec(bandwidth=450e9, latency=1e-6)
    # Devices 0 and 5 differ along both axes: the slower axis link.
    assert topo.link(0, 5) == LinkSpec(bandwidth=25e9, latency=5e-6)
    assert topo.link(0, 1) == LinkSpec(bandwidth=450e9, latency=1e-6)
    assert all(d.spec == DEVICE_SPECS["cpu"] for d in topo.devices)
    same = Topology.grid((2, 1), ("a", "b"), bandwidth=1e9, latency=0.0, device="A100")
    assert same.axis_link("b") == same.axis_link("a") == LinkSpec(bandwidth=1e9, latency=0.0)
    assert same.devices[0].spec.kind == "A100"


@pytest.mark.parametrize(
    "args, kwargs, needle",
    [
        (((2, 4), ("data", "model-parallel")), {}, "'model-parallel'"),
        (((2, 4), ("data", "class")), {}, "'class'"),
        (((2, 4), ("data", "data")), {}, "repeated"),
        (((2, 0), ("a", "b")), {}, "0"),
        (((2, 4), ("a",)), {}, "one size per axis"),
        (((2, 4), ("a", "b")), {"bandwidth": (1e9,)}, "bandwidth=[1000000000.0]"),
        (((2, 4), ("a", "b")), {"bandwidth": (1e9, -1e9)}, "bandwidth=-1000000000.0"),
        (((2, 4), ("a", "b")), {"device": "B200"}, "'B200'"),
    ],
)
def test_grid_rejects_bad_arguments(args, kwargs, needle):
    with pytest.raises(InvalidTopologyError) as e:
        Topology.grid(*args, **kwargs)
    assert needle in str(e.value)


# ------------------------------------------------------------------------------------ identity


def test_hashable_and_comparable():
    a, b = Topology.preset("dgx-h100", nodes=2), Topology.preset("dgx-h100", nodes=2)
    assert a == b and hash(a) == hash(b) and a is not b
    assert a != Topology.preset("dgx-h100", nodes=3)
    assert len({a, b, Topology.preset("geo")}) == 2
    assert {a: 1}[b] == 1


def test_pair_link_order_does_not_matter():
    devs = tuple(
        Device(id=i, spec=DEVICE_SPECS["cpu"], region=r, node=f"n{i}")
        for i, r in enumerate(["a", "b", "c"])
    )
    link1, link2 = LinkSpec(bandwidth=1e8, latency=0.01), LinkSpec(bandwidth=2e8, latency=0.02)
    kw = dict(name="t", devices=devs, axis_names=("r",), shape=(3,), wan_link=link2)
    t1 = Topology(**kw, links=(PairLink(between=("b", "a"), link=link1),))
    t2 = Topology(**kw, links=[PairLink(between=["a", "b"], link=link1)])
    assert t1 == t2 and hash(t1) == hash(t2)
    assert t1.links[0].between == ("a", "b")


def test_with_mesh_reshapes_and_recomputes_links():
    topo = Topology.preset("dgx-h100", nodes=2).with_mesh((4, 4), ("data", "model"))
    # data groups {i, i+4, i+8, i+12} span both nodes; model groups of 4 stay inside a node.
    assert topo.axis_link("data").bandwidth == 50e9
    assert topo.axis_link("model").bandwidth == 450e9
    assert topo.axis_scope("data") == "region"
    with pytest.raises(InvalidTopologyError, match="axis_links"):
        Topology.grid((2, 4), ("a", "b")).with_mesh((8,), ("c",))
    with pytest.raises(InvalidTopologyError, match="multiplies to 8"):
        topo.with_mesh((2, 4), ("a", "b"))


def test_unknown_axis_and_level_and_device():
    topo = Topology.preset("dgx-h100", nodes=2)
    with pytest.raises(InvalidTopologyError, match=r"'model'.*\('node', 'gpu'\)"):
        topo.axis_link("model")
    with pytest.raises(InvalidTopologyError, match=r"'gpu'.*region.*node.*kind"):
        topo.groups("gpu")
    with pytest.raises(InvalidTopologyError, match="dev_b=16"):
        topo.link(0, 16)


def test_describe_mentions_devices_axes_and_regions():
    text = Topology.preset("geo").describe()
    assert "6 devices (6 x V100)" in text
    assert "region" in text and "67 ms" in text and "98.8 MB/s" in text
    assert "oregon (2), virginia (2), ohio (2)" in text
    text = Topology.preset("dgx-h100", nodes=2).describe()
    assert "450 GB/s" in text and "50 GB/s" in text and "5 us" in text
    assert "dgx-h100x2" in repr(Topology.preset("dgx-h100", nodes=2))


# ------------------------------------------------------------------------------------ construction


def _devs(layout, spec=DEVICE_SPECS["cpu"]):
    """Devices from [(region, node, count), ...]."""
    out = []
    for region, node, count in layout:
        out += [Device(id=len(out) + i, spec=spec, region=region, node=node) for i in range(count)]
    return tuple(out)


NVL = LinkSpec(bandwidth=450e9, latency=1e-6)
IB = LinkSpec(bandwidth=50e9, latency=5e-6)
WAN = LinkSpec(bandwidth=1e8, latency=0.05)


@pytest.mark.parametrize(
    "kwargs, needles",
    [
        (
            dict(devices=_devs([("r", "n0", 4)]), shape=(3,), node_link=NVL),
            ["Topology.shape=[3]", "4 devices"],
        ),
        (dict(devices=_devs([("r", "n0", 4)]), shape=(4,)), ["levels.node", "'n0'"]),
        (
            dict(devices=_devs([("r", "n0", 2), ("r", "n1", 2)]), shape=(4,), node_link=NVL),
            ["levels.region", "'r'"],
        ),
        (
            dict(devices=_devs([("a", "n0", 1), ("b", "n1", 1)]), shape=(2,)),
            ["levels.wan", "'a'", "'b'"],
        ),
        (
            dict(devices=_devs([("r", "n0", 1), ("r", "n1", 1), ("r", "n0", 1)]), shape=(3,)),
            ["devices[2]", "'n0'"],
        ),
        (
            dict(devices=_devs([("r", "r", 2)]), shape=(2,), node_link=NVL),
            ["'r'", "region and a node"],
        ),
        (
            dict(
                devices=(Device(id=1, spec=DEVICE_SPECS["cpu"], region="r", node="n"),), shape=(1,)
            ),
            ["devices[0].id=1"],
        ),
        (
            dict(
                devices=_devs([("r", "n0", 2)]),
                shape=(2,),
                node_link=NVL,
                links=(PairLink(between=("n0", "zz"), link=IB),),
            ),
            ["links[0].between", "'zz'"],
        ),
        (
            dict(
                devices=_devs([("r", "n0", 2)]),
                shape=(2,),
                node_link=NVL,
                axis_links=(NVL,),
            ),
            ["axis_links", "node_link"],
        ),
    ],
)
def test_topology_construction_checks(kwargs, needles):
    kwargs = {
        "name": "t",
        "axis_names": tuple(f"a{i}" for i in range(len(kwargs["shape"]))),
        **kwargs,
    }
    with pytest.raises(InvalidTopologyError) as e:
        Topology(**kwargs)
    for needle in needles:
        assert needle in str(e.value)


def test_node_mixing_specs_is_rejected():
    devs = (
        Device(id=0, spec=DEVICE_SPECS["A100"], region="r", node="n"),
        Device(id=1, spec=DEVICE_SPECS["V100"], region="r", node="n"),
    )
    with pytest.raises(InvalidTopologyError, match="mixes device specs"):
        Topology(name="t", devices=devs, axis_names=("g",), shape=(2,), node_link=NVL)


# ------------------------------------------------------------------------------------ axis links


def _brute_axis_link(topo, name):
    axis = topo.axis_names.index(name)
    ids = np.moveaxis(np.arange(topo.num_devices).reshape(topo.shape), axis, -1)
    links = [
        topo.link(int(a), int(b))
        for group in ids.reshape(-1, topo.shape[axis])
        for a, b in itertools.combinations(group, 2)
    ]
    return LinkSpec(
        bandwidth=min(x.bandwidth for x in links), latency=max(x.latency for x in links)
    )


def _random_topology(rng):
    n_regions = rng.randint(1, 3)
    nodes_per_region = rng.randint(1, 3)
    per_node = rng.choice([1, 2, 4])
    layout = [
        (f"r{r}", f"r{r}n{n}", per_node) for r in range(n_regions) for n in range(nodes_per_region)
    ]
    devices = _devs(layout)
    node_names = [node for _, node, _ in layout]
    region_names = [f"r{r}" for r in range(n_regions)]

    def rand_link():
        return LinkSpec(
            bandwidth=rng.choice([1e8, 1e9, 1e10, 1e11]), latency=rng.choice([0, 1e-6, 1e-3])
        )

    pairs = {}
    for names in (node_names, region_names):
        for a, b in itertools.combinations_with_replacement(names, 2):
            if rng.random() < 0.3:
                pairs[(a, b)] = PairLink(between=(a, b), link=rand_link())
    size = len(devices)
    factors = [d for d in range(1, size + 1) if size % d == 0]
    first = rng.choice(factors)
    second = rng.choice([d for d in range(1, size // first + 1) if (size // first) % d == 0])
    shape = (first, second, size // first // second)
    return Topology(
        name="rand",
        devices=devices,
        axis_names=("a", "b", "c"),
        shape=shape,
        node_link=rand_link(),
        region_link=rand_link(),
        wan_link=rand_link(),
        links=tuple(pairs.values()),
    )


@pytest.mark.parametrize("seed", range(40))
def test_axis_link_matches_brute_force_over_device_pairs(seed):
    topo = _random_topology(random.Random(seed))
    for name, size in zip(topo.axis_names, topo.shape):
        if size > 1:
            assert topo.axis_link(name) == _brute_axis_link(topo, name), (topo.describe(), name)


def test_axis_link_on_large_cluster_is_fast_enough_to_build():
    topo = Topology.preset("dgx-h100", nodes=1024)
    assert topo.num_devices == 8192 and topo.axis_link("node").bandwidth == 50e9
    flat = topo.with_mesh((8192,), ("d",))
    assert flat.axis_link("d") == LinkSpec(bandwidth=50e9, latency=5e-6)


# ------------------------------------------------------------------------------------ meshes


def test_mesh_on_fake_devices():
    topo = Topology.preset("hetero")
    mesh = topo.mesh()
    assert dict(mesh.shape) == {"node": 2, "gpu": 4}
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 2
    assert list(mesh.devices.flat) == jax.devices()[:8]
    small = Topology.grid((2, 2), ("a", "b")).mesh()
    assert list(small.devices.flat) == jax.devices()[:4]
    given = Topology.grid(2, "a").mesh(devices=jax.devices()[6:])
    assert list(given.devices.flat) == jax.devices()[6:]


def test_mesh_not_enough_devices():
    topo = Topology.preset("dgx-h100", nodes=2)
    with pytest.raises(NotEnoughDevicesError) as e:
        topo.mesh()
    msg = str(e.value)
    assert "'dgx-h100x2'" in msg and "needs 16 devices" in msg and "JAX has 8 (cpu)" in msg
    assert "abstract_mesh()" in msg and "jax_num_cpu_devices', 16" in msg
    assert "xla_force_host_platform_device_count=16" in msg
    with pytest.raises(NotEnoughDevicesError, match="3 were given"):
        Topology.grid(4, "a").mesh(devices=jax.devices()[:3])


def test_abstract_mesh_needs_no_devices():
    topo = Topology.preset("dgx-h100", nodes=2)
    mesh = topo.abstract_mesh()
    assert isinstance(mesh, jax.sharding.AbstractMesh)
    assert dict(mesh.shape) == {"node": 2, "gpu": 8}
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 2
    big = Topology.preset("dgx-h100", nodes=64).abstract_mesh()
    assert math.prod(big.shape.values()) == 512


def test_pickle_in_another_process_keeps_hash_consistent():
    topo = Topology.preset("geo")
    assert pickle.loads(pickle.dumps(topo)) == topo
    code = (
        "import pickle, sys; from hulkjax.topology import Topology; "
        "t = pickle.loads(sys.stdin.buffer.read()); "
        "print(hash(t) == hash(Topology.preset('geo')) and t == Topology.preset('geo'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=pickle.dumps(topo),
        capture_output=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "random"},
    )
    assert out.stdout.strip() == b"True"
