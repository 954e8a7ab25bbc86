"""Named clusters built from public hardware and network numbers: ``Topology.preset(name, **kw)``.

Where this sits: each preset is a function registered with :func:`register_preset` into the table
:meth:`Topology.preset` reads (``hulkjax.topology.model.presets``; the model imports no preset), and
returns a :class:`~hulkjax.topology.Topology`. Numbers come from vendor specifications and published
measurements collected in ``/work/shared/reference/topologies.md``; each preset says which it uses.
Latencies that no source gives are marked as estimates.

Presets do not create size-1 mesh axes (``dgx-h100`` with one node has the single axis ``gpu``).

>>> sorted(names())  # doctest: +NORMALIZE_WHITESPACE
['aws-p3', 'dgx-h100', 'dtfm', 'geo', 'hetero', 'mixed', 'regional', 'tpu-v5e', 'tpu-v5p',
 'tpu-v6e']
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from hulkjax.errors import InvalidTopologyError
from hulkjax.topology.model import Topology, resolve_device
from hulkjax.topology.model import presets as preset_builders
from hulkjax.topology.specs import (
    DEVICE_SPECS,
    INTRA_NODE_LINKS,
    Device,
    DeviceSpec,
    LinkSpec,
    PairLink,
)

__all__ = ["DTFM_WAN_MEASUREMENTS", "GEO_WAN_MEASUREMENTS", "names", "preset_builders",
           "register_preset"]

logger = logging.getLogger(__name__)


def register_preset(name: str) -> Callable[[Callable[..., Topology]], Callable[..., Topology]]:
    """Decorator: registers a function returning a Topology as preset ``name``.

    >>> @register_preset("my-pair")
    ... def _pair():
    ...     return Topology.grid(2, "data", name="my-pair")
    >>> Topology.preset("my-pair").num_devices
    2
    >>> del preset_builders["my-pair"]
    """

    def register(fn: Callable[..., Topology]) -> Callable[..., Topology]:
        preset_builders[name] = fn
        return fn

    return register


def names() -> list[str]:
    """Registered preset names, sorted."""
    return sorted(preset_builders)


# ---------------------------------------------------------------------------------------- helpers


def _positive_int(value: Any, preset: str, arg: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidTopologyError(
            f"preset {preset!r}: {arg} must be an int >= 1, got {arg}={value!r}."
        )
    return value


def _mesh_axes(axes: Sequence[tuple[str, int]]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Drops size-1 axes (keeping the last axis if all are size 1)."""
    kept = [(a, s) for a, s in axes if s > 1] or [axes[-1]]
    return tuple(a for a, _ in kept), tuple(s for _, s in kept)


def _intra_node_link(spec: DeviceSpec, preset: str, given: dict[str, LinkSpec] | None) -> LinkSpec:
    table = {**INTRA_NODE_LINKS, **(given or {})}
    if spec.kind not in table:
        raise InvalidTopologyError(
            f"preset {preset!r}: no intra-node link known for device kind {spec.kind!r}; pass "
            f"intra_node={{{spec.kind!r}: LinkSpec(bandwidth=..., latency=...)}}. Known kinds: "
            f"{sorted(table)!r}."
        )
    return table[spec.kind]


def _nodes_of_gpus(name: str, spec: DeviceSpec, nodes: int, gpus: int, *,
                   node_link: LinkSpec | None, region_link: LinkSpec | None) -> Topology:
    """``nodes`` nodes of ``gpus`` devices in one region, mesh ``("node", "gpu")`` (size-1 axes
    dropped); ``name`` gets ``-<gpus>gpu`` unless nodes hold the usual 8."""
    devices = tuple(
        Device(id=n * gpus + g, spec=spec, region="local", node=f"node{n}")
        for n in range(nodes)
        for g in range(gpus)
    )
    axis_names, shape = _mesh_axes([("node", nodes), ("gpu", gpus)])
    return Topology(name=name + ("" if gpus == 8 else f"-{gpus}gpu"), devices=devices,
                    axis_names=axis_names, shape=shape, node_link=node_link,
                    region_link=region_link)


def _gbps(gbit_per_s: float) -> float:
    """Gb/s -> bytes/s."""
    return gbit_per_s * 1e9 / 8


# ---------------------------------------------------------------------------------------- dgx-h100

NVLINK4 = LinkSpec(bandwidth=450e9, latency=1e-6)
INFINIBAND_NDR_PER_GPU = LinkSpec(bandwidth=50e9, latency=5e-6)


@register_preset("dgx-h100")
def dgx_h100(nodes: int = 1, gpus_per_node: int = 8) -> Topology:
    """NVIDIA DGX H100 nodes: 8 x H100 SXM on NVLink4/NVSwitch, nodes joined by InfiniBand.

    Sources: NVIDIA H100 and DGX H100 datasheets (via topologies.md): H100 SXM 9.9e14 dense bf16
    FLOP/s, 80 GB HBM3 at 3.35 TB/s; NVLink4 450 GB/s per GPU per direction; 8 x 400 Gb/s
    InfiniBand NDR per node = 50 GB/s per GPU. Latencies (1 us NVSwitch hop, 5 us InfiniBand) are
    estimates ("a few microseconds").

    Mesh axes ``("node", "gpu")`` of shape ``(nodes, gpus_per_node)``; just ``("gpu",)`` for one node.

    Args:
      nodes: number of DGX nodes.
      gpus_per_node: GPUs used per node (8 in a full DGX).

    >>> topo = dgx_h100(nodes=2)
    >>> topo.name, topo.shape, topo.axis_link("node").bandwidth
    ('dgx-h100x2', (2, 8), 50000000000.0)
    """
    nodes = _positive_int(nodes, "dgx-h100", "nodes")
    gpus = _positive_int(gpus_per_node, "dgx-h100", "gpus_per_node")
    return _nodes_of_gpus(f"dgx-h100x{nodes}", DEVICE_SPECS["H100"], nodes, gpus,
                          node_link=NVLINK4, region_link=INFINIBAND_NDR_PER_GPU)


# ---------------------------------------------------------------------------------------- aws-p3

# p3.16xlarge: 8 x V100 SXM2 16 GB (the 32 GB part is p3dn.24xlarge); the V100's other numbers.
V100_16GB = DeviceSpec(**{**dataclasses.asdict(DEVICE_SPECS["V100"]), "kind": "V100-16GB",
                          "memory": 16e9})
# 25 Gb/s per p3.16xlarge instance, shared by its 8 GPUs: 25/8 Gb/s per GPU (LinkSpec is per
# device). 10 us latency is an estimate (as for the other cloud Ethernet links here).
AWS_P3_NETWORK_PER_GPU = LinkSpec(bandwidth=_gbps(25) / 8, latency=1e-5)


@register_preset("aws-p3")
def aws_p3(nodes: int = 8, gpus_per_node: int = 8) -> Topology:
    """AWS p3.16xlarge instances: 8 x V100 16 GB on NVLink2, instances joined by 25 Gb/s Ethernet.

    Alpa's evaluation cluster (Zheng et al., OSDI'22: 8 x p3.16xlarge, 64 GPUs; anchors.md).
    Sources (via topologies.md): V100 SXM2 1.25e14 dense fp16 FLOP/s, 0.9 TB/s HBM2 (16 GB on the
    p3.16xlarge), NVLink2 150 GB/s per GPU per direction inside an instance; 25 Gb/s of network
    per instance (AWS instance table), i.e. 25/8 Gb/s per GPU when all 8 GPUs send at once. The
    1 us NVLink and 10 us Ethernet latencies are estimates.

    Mesh axes ``("node", "gpu")`` of shape ``(nodes, gpus_per_node)``; just ``("gpu",)`` for one node.

    Args:
      nodes: number of p3.16xlarge instances (Alpa used 1, 2, 4 and 8).
      gpus_per_node: GPUs used per instance (Alpa's 1-, 2- and 4-GPU cases use part of one).

    >>> topo = aws_p3(nodes=2)
    >>> topo.name, topo.shape, topo.slowest_device().memory, topo.axis_link("node").bandwidth
    ('aws-p3x2', (2, 8), 16000000000.0, 390625000.0)
    """
    nodes = _positive_int(nodes, "aws-p3", "nodes")
    gpus = _positive_int(gpus_per_node, "aws-p3", "gpus_per_node")
    return _nodes_of_gpus(f"aws-p3x{nodes}", V100_16GB, nodes, gpus,
                          node_link=INTRA_NODE_LINKS["V100"] if gpus > 1 else None,
                          region_link=AWS_P3_NETWORK_PER_GPU if nodes > 1 else None)


# ---------------------------------------------------------------------------------------- tpu-v5e

TPU_V5E_ICI_PER_LINK = 50e9  # bytes/s per direction per ICI link (topologies.md)
TPU_V5E_AXIS_LINK = LinkSpec(bandwidth=2 * TPU_V5E_ICI_PER_LINK, latency=1e-6)
TPU_V5E_MAX_DIM = 16  # a v5e pod is a 16 x 16 torus


def _near_square(chips: int) -> tuple[int, int]:
    a = max(d for d in range(1, math.isqrt(chips) + 1) if chips % d == 0)
    return a, chips // a


@register_preset("tpu-v5e")
def tpu_v5e(shape: Sequence[int] | None = None, chips: int | None = None) -> Topology:
    """A Google Cloud TPU v5e slice: a 2-D ICI torus of v5e chips, axes ``("x", "y")``.

    Sources: Google Cloud TPU v5e documentation (via topologies.md): 1.97e14 bf16 FLOP/s, 16 GB HBM2
    at 0.82 TB/s per chip; 2-D torus ICI with 4 links per chip at ~50 GB/s per link per direction.

    Effective per-axis bandwidth: each chip has 2 of its 4 ICI links along each torus axis, and a
    collective over one axis runs a bidirectional ring that drives both, so we model every axis as
    ``2 x 50 GB/s = 100 GB/s`` per chip per direction. (A slice without wraparound along an axis gets
    about half of that for a ring; use ``Topology.grid`` with your own numbers for such slices.) The
    1 us latency per axis is an estimate (an ICI hop is sub-microsecond; collectives add software
    overhead). All chips are listed as one node ``slice0``: the ICI, not the host, carries traffic.

    Args:
      shape: slice shape ``(x, y)``, each at most 16 (a v5e pod is 16 x 16). Default ``(4, 4)``.
      chips: alternative to ``shape``: number of chips, laid out as the most square ``(x, y)``.

    >>> tpu_v5e(chips=8).shape, tpu_v5e().axis_bandwidth("x")
    ((2, 4), 100000000000.0)
    """
    if shape is not None and chips is not None:
        raise InvalidTopologyError(
            f"preset 'tpu-v5e': give shape or chips, not both (got shape={shape!r}, chips={chips!r})."
        )
    if chips is not None:
        dims = _near_square(_positive_int(chips, "tpu-v5e", "chips"))
    elif shape is None:
        dims = (4, 4)
    else:
        if isinstance(shape, int) or len(tuple(shape)) != 2:
            raise InvalidTopologyError(
                f"preset 'tpu-v5e': shape must be two ints (x, y), got shape={shape!r}."
            )
        dims = tuple(_positive_int(s, "tpu-v5e", "shape[i]") for s in shape)  # type: ignore[assignment]
    if max(dims) > TPU_V5E_MAX_DIM:
        raise InvalidTopologyError(
            f"preset 'tpu-v5e': slice {dims[0]}x{dims[1]} has a side over {TPU_V5E_MAX_DIM}; a v5e pod "
            "is 16 x 16 chips. Use at most 256 chips, or several slices joined over the data-center "
            "network (a JSON topology)."
        )
    axis_names, mesh_shape = _mesh_axes([("x", dims[0]), ("y", dims[1])])
    spec = DEVICE_SPECS["TPUv5e"]
    n = dims[0] * dims[1]
    return Topology(
        name=f"tpu-v5e-{dims[0]}x{dims[1]}",
        devices=tuple(Device(id=i, spec=spec, region="local", node="slice0") for i in range(n)),
        axis_names=axis_names,
        shape=mesh_shape,
        axis_links=(TPU_V5E_AXIS_LINK,) * len(mesh_shape),
    )


def _tpu_slice(preset: str, kind: str, shape: Sequence[int], max_dim: int) -> Topology:
    """A slice of TPU chips on an ICI torus: one mesh axis per torus dimension, each paying the
    kind's per-axis ICI link (``INTRA_NODE_LINKS``); all chips listed as one node ``slice0``."""
    if isinstance(shape, int):
        raise InvalidTopologyError(f"preset {preset!r}: shape must be a tuple of ints, got {shape!r}.")
    dims = tuple(_positive_int(s, preset, "shape[i]") for s in shape)
    if max(dims) > max_dim:
        raise InvalidTopologyError(
            f"preset {preset!r}: slice {'x'.join(map(str, dims))} has a side over {max_dim}.")
    names = ("x", "y", "z")[: len(dims)]
    axis_names, mesh_shape = _mesh_axes(list(zip(names, dims)))
    spec = DEVICE_SPECS[kind]
    link = INTRA_NODE_LINKS[kind]
    n = math.prod(dims)
    return Topology(
        name=f"{preset}-{'x'.join(map(str, dims))}",
        devices=tuple(Device(id=i, spec=spec, region="local", node="slice0") for i in range(n)),
        axis_names=axis_names,
        shape=mesh_shape,
        axis_links=(link,) * len(mesh_shape),
    )


@register_preset("tpu-v6e")
def tpu_v6e(shape: Sequence[int] = (16, 16)) -> Topology:
    """A Google Cloud TPU v6e (Trillium) slice: a 2-D ICI torus, axes ``("x", "y")``.

    Source: Google Cloud TPU v6e documentation (docs.cloud.google.com/tpu/docs/v6e): 918 TFLOP/s
    bf16, 32 GB HBM at 1638 GB/s per chip; 800 GB/s bidirectional ICI per chip over 4 ports, i.e.
    100 GB/s per link per direction; a pod is 256 chips (16 x 16). As for ``tpu-v5e``, each axis
    is modelled as its 2 links driven by a bidirectional ring: 200 GB/s per chip per direction;
    the 1 us latency is an estimate. ``v6e-256`` is ``shape=(16, 16)`` (v6e counts chips).

    >>> tpu_v6e().shape, tpu_v6e().axis_bandwidth("x")
    ((16, 16), 200000000000.0)
    """
    return _tpu_slice("tpu-v6e", "TPUv6e", shape, 16)


@register_preset("tpu-v5p")
def tpu_v5p(shape: Sequence[int] = (4, 8, 8)) -> Topology:
    """A Google Cloud TPU v5p slice: a 3-D ICI torus, axes ``("x", "y", "z")``.

    Sources: Google Cloud TPU v5p documentation (docs.cloud.google.com/tpu/docs/v5p-training) and
    topologies.md: 459 TFLOP/s bf16, 95 GB HBM at 2.76 TB/s per chip; 1200 GB/s bidirectional ICI
    per chip over 6 ports, ~90 GB/s per link per direction (topologies.md). Each axis is modelled
    as its 2 links driven by a bidirectional ring: 180 GB/s per chip per direction; the 1 us
    latency is an estimate. v5p accelerator names count TensorCores (2 per chip): ``v5p-512`` is
    256 chips, the default ``shape=(4, 8, 8)``.

    >>> tpu_v5p().num_devices, tpu_v5p().axis_bandwidth("z")
    (256, 180000000000.0)
    """
    return _tpu_slice("tpu-v5p", "TPUv5p", shape, 24)


# ---------------------------------------------------------------------------------------- geo

GEO_WAN_MEASUREMENTS: dict[tuple[str, str], tuple[float, float]] = {
    ("oregon", "virginia"): (67.0, 0.79),
    ("oregon", "ohio"): (49.0, 1.10),
    ("virginia", "ohio"): (11.0, 1.12),
    ("tokyo", "seoul"): (34.0, 1.10),
    ("virginia", "london"): (76.0, 1.16),
    ("london", "frankfurt"): (14.0, 1.14),
    ("sydney", "frankfurt"): (265.0, 0.33),
    ("seoul", "london"): (238.0, 0.34),
}
"""Measured WAN links between cloud regions: (latency ms, bandwidth Gb/s), Yuan et al. NeurIPS 2022."""

GEO_REGIONS = ("oregon", "virginia", "ohio", "tokyo", "seoul", "london", "frankfurt", "sydney")
# Pairs without a measurement get the slowest measured link (Sydney-Frankfurt): a conservative default.
GEO_DEFAULT_WAN = LinkSpec(bandwidth=_gbps(0.33), latency=0.265)
# Ethernet between GPU nodes of one cloud region: 100 Gb/s (top of the 25-100 Gb/s range);
# 10 us latency is an estimate (Hulk: "within one city under 1 ms").
CLOUD_ETHERNET_100G = LinkSpec(bandwidth=_gbps(100), latency=1e-5)


@register_preset("geo")
def geo(
    regions: int | None = None,
    gpus_per_region: int = 2,
    nodes_per_region: int = 1,
    region_names: Sequence[str] | None = None,
    device: str | DeviceSpec = "V100",
    wan: LinkSpec = GEO_DEFAULT_WAN,
    inter_node: LinkSpec = CLOUD_ETHERNET_100G,
    intra_node: dict[str, LinkSpec] | None = None,
) -> Topology:
    """GPU clusters in several cloud regions joined over the wide-area network.

    Sources (via topologies.md): WAN latency and bandwidth between cloud regions measured by Yuan et
    al., "Decentralized Training of Foundation Models in Heterogeneous Environments", NeurIPS 2022
    (:data:`GEO_WAN_MEASUREMENTS`; each measured pair becomes a per-pair link). Pairs without a
    measurement get ``wan`` (default: the slowest measured pair, Sydney-Frankfurt, 0.33 Gb/s and
    265 ms). Inside a region: NVLink of the device's generation inside a node (V100: NVLink2 150 GB/s)
    and 100 Gb/s cloud Ethernet between nodes (latency 10 us, an estimate). Default device V100, the
    GPU of Yuan et al.'s cloud setup.

    Mesh axes ``("region", "gpu")``, or ``("region", "node", "gpu")`` with several nodes per region;
    size-1 axes are dropped.

    Args:
      regions: number of regions; default 3, or ``len(region_names)``.
      gpus_per_region: GPUs in each region.
      nodes_per_region: nodes the GPUs of a region are spread over (must divide gpus_per_region).
      region_names: names, default the measured regions in order ``oregon, virginia, ohio, tokyo,
        seoul, london, frankfurt, sydney`` (then ``region8``, ...). Case-insensitive lookup.
      device: a ``DeviceSpec`` or a kind in ``DEVICE_SPECS``.
      wan: link for region pairs without a measurement.
      inter_node: link between nodes of one region.
      intra_node: per-kind link inside a node, overriding the built-in NVLink table.

    >>> topo = geo()
    >>> topo.regions, topo.shape, topo.axis_latency("region")
    (('oregon', 'virginia', 'ohio'), (3, 2), 0.067)
    """
    if region_names is not None:
        if isinstance(region_names, str) or not all(isinstance(r, str) and r for r in region_names):
            raise InvalidTopologyError(
                f"preset 'geo': region_names must be a list of non-empty strings, got {region_names!r}."
            )
        names_t = tuple(region_names)
        if len(set(names_t)) != len(names_t):
            raise InvalidTopologyError(
                f"preset 'geo': region_names repeats a name: {list(names_t)!r}."
            )
        if regions is not None and regions != len(names_t):
            raise InvalidTopologyError(
                f"preset 'geo': regions={regions!r} but region_names has {len(names_t)} names; "
                "give one of them, or make them agree."
            )
    else:
        count = _positive_int(3 if regions is None else regions, "geo", "regions")
        names_t = GEO_REGIONS[:count] + tuple(f"region{i}" for i in range(len(GEO_REGIONS), count))
    gpus = _positive_int(gpus_per_region, "geo", "gpus_per_region")
    n_nodes = _positive_int(nodes_per_region, "geo", "nodes_per_region")
    if gpus % n_nodes:
        raise InvalidTopologyError(
            f"preset 'geo': nodes_per_region={n_nodes} must divide gpus_per_region={gpus}."
        )
    for arg, value in (("wan", wan), ("inter_node", inter_node)):
        if not isinstance(value, LinkSpec):
            raise InvalidTopologyError(
                f"preset 'geo': {arg} must be a LinkSpec, got {arg}={value!r}."
            )
    spec = resolve_device(device, "preset 'geo': device")
    per_node = gpus // n_nodes

    devices: list[Device] = []
    for region in names_t:
        for j in range(n_nodes):
            node = f"{region}-node{j}"
            first = len(devices)
            devices.extend(
                Device(id=first + g, spec=spec, region=region, node=node) for g in range(per_node)
            )

    measured = {(min(a, b), max(a, b)): v for (a, b), v in GEO_WAN_MEASUREMENTS.items()}
    links, missing = [], []
    for i, a in enumerate(names_t):
        for b in names_t[i + 1 :]:
            key = tuple(sorted((a.lower(), b.lower())))
            if key in measured:
                latency_ms, gbit = measured[key]
                links.append(
                    PairLink(
                        between=(a, b),
                        link=LinkSpec(bandwidth=_gbps(gbit), latency=latency_ms / 1e3),
                    )
                )
            else:
                missing.append(f"{a}-{b}")
    if missing:
        logger.info("geo preset: no WAN measurement for %s; using wan=%s", ", ".join(missing), wan)

    axis_names, shape = _mesh_axes([("region", len(names_t)), ("node", n_nodes), ("gpu", per_node)])
    return Topology(
        name=f"geo-{len(names_t)}x{gpus}",
        devices=tuple(devices),
        axis_names=axis_names,
        shape=shape,
        node_link=_intra_node_link(spec, "geo", intra_node) if per_node > 1 else None,
        region_link=inter_node if n_nodes > 1 else None,
        wan_link=wan if len(names_t) > 1 else None,
        links=tuple(links),
    )


# ---------------------------------------------------------------------------------------- hetero

ETHERNET_10G = LinkSpec(bandwidth=_gbps(10), latency=1e-5)


@register_preset("hetero")
def hetero(
    nodes: Sequence[tuple[str | DeviceSpec, int]] = (("A100", 4), ("V100", 4)),
    inter_node: LinkSpec = ETHERNET_10G,
    intra_node: dict[str, LinkSpec] | None = None,
) -> Topology:
    """A cluster mixing GPU generations, one generation per node, over commodity Ethernet.

    Sources (via topologies.md): the heterogeneous clusters of HAP (V100 and P100 nodes, ~10 Gb/s
    between nodes) and TAG (V100, 1080Ti, P100 machines); device numbers from the vendor tables;
    NVLink of each generation inside a node (A100: NVLink3 300 GB/s, V100: NVLink2 150 GB/s).
    10 GbE between nodes = 1.25e9 bytes/s; its 10 us latency is an estimate.

    Mesh axes ``("node", "gpu")`` when all nodes hold the same number of GPUs; otherwise one flat
    axis ``("gpu",)`` (a 2-D mesh needs equal rows). ``groups("kind")`` gives the generations.

    Args:
      nodes: one ``(kind or DeviceSpec, gpu count)`` per node. Default 4 x A100 + 4 x V100.
      inter_node: link between nodes.
      intra_node: per-kind link inside a node, overriding the built-in NVLink table.

    >>> topo = hetero()
    >>> topo.shape, topo.slowest_device().kind, topo.axis_bandwidth("gpu")
    ((2, 4), 'V100', 150000000000.0)
    """
    if isinstance(nodes, str) or not isinstance(nodes, Sequence) or not nodes:
        raise InvalidTopologyError(
            f"preset 'hetero': nodes must be a non-empty list of (kind, count), got nodes={nodes!r}."
        )
    if not isinstance(inter_node, LinkSpec):
        raise InvalidTopologyError(
            f"preset 'hetero': inter_node must be a LinkSpec, got inter_node={inter_node!r}."
        )
    entries: list[tuple[DeviceSpec, int]] = []
    for i, entry in enumerate(nodes):
        if not isinstance(entry, Sequence) or isinstance(entry, str) or len(entry) != 2:
            raise InvalidTopologyError(
                f"preset 'hetero': nodes[{i}] must be a (kind, count) pair, got {entry!r}."
            )
        spec = resolve_device(entry[0], f"preset 'hetero': nodes[{i}] kind")
        entries.append((spec, _positive_int(entry[1], "hetero", f"nodes[{i}] count")))

    devices: list[Device] = []
    for n, (spec, count) in enumerate(entries):
        first = len(devices)
        devices.extend(
            Device(id=first + g, spec=spec, region="local", node=f"node{n}") for g in range(count)
        )
    multi = [(n, spec) for n, (spec, count) in enumerate(entries) if count > 1]
    node_link = _intra_node_link(multi[0][1], "hetero", intra_node) if multi else None
    links = tuple(
        PairLink(between=(f"node{n}", f"node{n}"), link=link)
        for n, spec in multi
        if (link := _intra_node_link(spec, "hetero", intra_node)) != node_link
    )
    counts = {count for _, count in entries}
    if len(counts) == 1:
        axis_names, shape = _mesh_axes([("node", len(entries)), ("gpu", counts.pop())])
    else:
        logger.info("hetero preset: nodes hold different GPU counts; using one flat 'gpu' axis")
        axis_names, shape = ("gpu",), (len(devices),)
    return Topology(
        name="hetero-" + "-".join(f"{count}x{spec.kind}" for spec, count in entries),
        devices=tuple(devices),
        axis_names=axis_names,
        shape=shape,
        node_link=node_link,
        region_link=inter_node if len(entries) > 1 else None,
        links=links,
    )


# ---------------------------------------------------------------------------------------- regional

METRO_25G = LinkSpec(bandwidth=_gbps(25), latency=2e-3)
# A cloud region's GPU nodes joined by InfiniBand-class networking (DGX: 400 Gb/s per GPU).
REGION_INFINIBAND = LinkSpec(bandwidth=50e9, latency=5e-6)


@register_preset("regional")
def regional(
    regions: int = 4,
    nodes_per_region: int = 1,
    gpus_per_node: int = 8,
    device: str | DeviceSpec = "A100",
    metro: LinkSpec = METRO_25G,
    inter_node: LinkSpec = REGION_INFINIBAND,
    intra_node: dict[str, LinkSpec] | None = None,
) -> Topology:
    """GPU clusters in nearby sites (regions of one metro area or country) joined by fast
    regional links: the setting where placing layers on sites beats every SPMD plan.

    Sources: regional / metro links of 10-25 Gb/s between sites (hulkjax issue 12; DT-FM's
    universities case has 5 Gb/s inside a site, topologies.md); the 2 ms latency of a metro link
    is an estimate. Inside a site: the device's NVLink inside a node (A100: NVLink3 300 GB/s) and
    400 Gb/s InfiniBand per GPU between nodes (5 us, an estimate). Bandwidths are per device per
    direction, as everywhere in hulkjax: ``metro`` is what each device can send to the other
    site.

    Mesh axes ``("region", "node", "gpu")`` with size-1 axes dropped; ``groups("region")`` are the
    sites.

    Args:
      regions: number of sites.
      nodes_per_region: GPU nodes per site.
      gpus_per_node: GPUs per node.
      device: a ``DeviceSpec`` or a kind in ``DEVICE_SPECS`` (default A100).
      metro: the link between sites (default 25 Gb/s, 2 ms).
      inter_node: the link between nodes of one site.
      intra_node: per-kind link inside a node, overriding the built-in NVLink table.

    >>> topo = regional()
    >>> topo.shape, topo.axis_scope("region"), topo.axis_bandwidth("region") * 8 / 1e9
    ((4, 8), 'wan', 25.0)
    """
    n_regions = _positive_int(regions, "regional", "regions")
    n_nodes = _positive_int(nodes_per_region, "regional", "nodes_per_region")
    gpus = _positive_int(gpus_per_node, "regional", "gpus_per_node")
    for arg, value in (("metro", metro), ("inter_node", inter_node)):
        if not isinstance(value, LinkSpec):
            raise InvalidTopologyError(
                f"preset 'regional': {arg} must be a LinkSpec, got {arg}={value!r}.")
    spec = resolve_device(device, "preset 'regional': device")
    devices: list[Device] = []
    for r in range(n_regions):
        for j in range(n_nodes):
            first = len(devices)
            devices.extend(Device(id=first + g, spec=spec, region=f"site{r}", node=f"site{r}-node{j}")
                           for g in range(gpus))
    axis_names, shape = _mesh_axes([("region", n_regions), ("node", n_nodes), ("gpu", gpus)])
    return Topology(
        name=f"regional-{n_regions}x{n_nodes * gpus}{spec.kind}",
        devices=tuple(devices),
        axis_names=axis_names,
        shape=shape,
        node_link=_intra_node_link(spec, "regional", intra_node) if gpus > 1 else None,
        region_link=inter_node if n_nodes > 1 else None,
        wan_link=metro if n_regions > 1 else None,
    )


# ---------------------------------------------------------------------------------------- mixed


@register_preset("mixed")
def mixed(
    h100: int = 0,
    a100: int = 1,
    v100: int = 1,
    t4: int = 1,
    gpus_per_node: int = 8,
    inter_node: LinkSpec = ETHERNET_10G,
) -> Topology:
    """A HeteroG / Metis-style cluster: nodes of several GPU generations over 10 Gb/s Ethernet.

    Sources (via topologies.md and papers.md): Metis mixes V100 / P100 / T4 / A100 nodes of 8 GPUs
    with 10 Gb/s between nodes; HeteroG and HAP use ~10 Gb/s between V100 / P100 nodes. Device
    numbers are the vendor tables (H100 9.9e14, A100 3.12e14, V100 1.25e14, T4 6.5e13 bf16/fp16
    FLOP/s; T4 has 16 GB); inside a node each generation's NVLink, or PCIe for the T4. A thin
    wrapper over :func:`hetero` listing node counts by kind, fastest first.

    Args:
      h100 / a100 / v100 / t4: nodes of each kind.
      gpus_per_node: GPUs per node.
      inter_node: link between nodes (default 10 GbE).

    >>> topo = mixed()
    >>> [s.kind for s in topo.device_specs()], topo.shape
    (['A100', 'V100', 'T4'], (3, 8))
    """
    counts = (("H100", h100), ("A100", a100), ("V100", v100), ("T4", t4))
    for kind, n in counts:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise InvalidTopologyError(f"preset 'mixed': {kind.lower()} must be an int >= 0 (a "
                                       f"number of nodes), got {n!r}.")
    gpus = _positive_int(gpus_per_node, "mixed", "gpus_per_node")
    nodes = [(kind, gpus) for kind, n in counts for _ in range(n)]
    if not nodes:
        raise InvalidTopologyError("preset 'mixed': give at least one node (a100=1, ...).")
    topo = hetero(nodes=nodes, inter_node=inter_node)
    name = "mixed-" + "-".join(f"{n}x{kind}" for kind, n in counts if n)
    return topo.with_mesh(topo.shape, topo.axis_names, name=name)


# ---------------------------------------------------------------------------------------- dtfm

DTFM_WAN_MEASUREMENTS: dict[tuple[str, str], tuple[float, float]] = {
    ("oregon", "virginia"): (67, 0.79), ("oregon", "ohio"): (49, 1.10),
    ("oregon", "tokyo"): (96, 0.523), ("oregon", "seoul"): (124, 0.46),
    ("oregon", "singapore"): (163, 0.341), ("oregon", "sydney"): (139, 0.36),
    ("oregon", "london"): (136, 0.42), ("oregon", "frankfurt"): (143, 0.404),
    ("oregon", "ireland"): (124, 0.482), ("virginia", "ohio"): (11, 1.12),
    ("virginia", "tokyo"): (143, 0.524), ("virginia", "seoul"): (172, 0.500),
    ("virginia", "singapore"): (230, 0.364), ("virginia", "sydney"): (197, 0.383),
    ("virginia", "london"): (76, 1.16), ("virginia", "frankfurt"): (90, 1.02),
    ("virginia", "ireland"): (67, 1.05), ("ohio", "tokyo"): (130, 0.694),
    ("ohio", "seoul"): (159, 0.529), ("ohio", "singapore"): (197, 0.452),
    ("ohio", "sydney"): (185, 0.484), ("ohio", "london"): (86, 1.05),
    ("ohio", "frankfurt"): (99, 0.799), ("ohio", "ireland"): (77, 1.14),
    ("tokyo", "seoul"): (34, 1.10), ("tokyo", "singapore"): (73, 1.01),
    ("tokyo", "sydney"): (100, 0.761), ("tokyo", "london"): (210, 0.366),
    ("tokyo", "frankfurt"): (223, 0.36), ("tokyo", "ireland"): (199, 0.465),
    ("seoul", "singapore"): (74, 1.14), ("seoul", "sydney"): (148, 0.58),
    ("seoul", "london"): (238, 0.342), ("seoul", "frankfurt"): (235, 0.358),
    ("seoul", "ireland"): (228, 0.335), ("singapore", "sydney"): (92, 0.816),
    ("singapore", "london"): (169, 0.500), ("singapore", "frankfurt"): (155, 0.535),
    ("singapore", "ireland"): (179, 0.492), ("sydney", "london"): (262, 0.326),
    ("sydney", "frankfurt"): (265, 0.328), ("sydney", "ireland"): (254, 0.344),
    ("london", "frankfurt"): (14, 1.14), ("london", "ireland"): (12, 1.09),
    ("frankfurt", "ireland"): (24, 1.08),
}
"""DT-FM's measured links between AWS regions: (latency ms, bandwidth Gb/s), from
``scheduler/heuristic_evolutionary_solver/config.py`` of DS3Lab/DT-FM (Yuan et al., NeurIPS'22)."""

DTFM_US_REGIONS: dict[tuple[str, str], tuple[float, float]] = {
    ("virginia", "oregon"): (67, 1.15), ("virginia", "california"): (59, 1.05),
    ("virginia", "ohio"): (11, 1.12), ("oregon", "california"): (12, 1.25),
    ("oregon", "ohio"): (49, 1.10), ("california", "ohio"): (52, 1.02),
}
"""DT-FM's case 3 (four US regions): (latency ms, bandwidth Gb/s) between regions."""

DTFM_CASES = {
    "us-regions": (("virginia", "oregon", "california", "ohio"), DTFM_US_REGIONS, 16),
    "cities": (("oregon", "virginia", "ohio", "tokyo", "seoul", "london", "frankfurt", "ireland"),
               DTFM_WAN_MEASUREMENTS, 8),
}
# DT-FM's machines inside one region: 2 Gb/s and 5 ms between instances (its config.py).
DTFM_IN_REGION = LinkSpec(bandwidth=_gbps(2), latency=5e-3)


@register_preset("dtfm")
def dtfm(case: str = "cities", gpus_per_region: int | None = None,
         device: str | DeviceSpec = "V100") -> Topology:
    """DT-FM's decentralized-training clusters (Yuan et al., NeurIPS'22): single-GPU cloud
    instances in several regions, with the latency and bandwidth DT-FM measured between regions.

    Sources: DS3Lab/DT-FM ``scheduler/heuristic_evolutionary_solver/config.py``: case 3
    (``"us-regions"``: Virginia, Oregon, California, Ohio; 1.02-1.25 Gb/s and 11-67 ms between
    regions) and case 4 (``"cities"``: eight cities worldwide, 0.33-1.16 Gb/s and 11-238 ms; the
    full measured table is :data:`DTFM_WAN_MEASUREMENTS`); inside a region 2 Gb/s and 5 ms between
    instances. Every GPU is its own node (one V100 per instance, as DT-FM's simulation). DT-FM
    used 64 GPUs (16 per US region, 8 per city).

    Mesh axes ``("region", "node")``: regions x instances per region.

    Args:
      case: ``"us-regions"`` or ``"cities"``.
      gpus_per_region: instances per region (default DT-FM's: 16 or 8).
      device: the GPU of each instance.

    >>> topo = dtfm("us-regions", gpus_per_region=2)
    >>> topo.regions, topo.link(0, 2).latency
    (('virginia', 'oregon', 'california', 'ohio'), 0.067)
    """
    if case not in DTFM_CASES:
        raise InvalidTopologyError(f"preset 'dtfm': case={case!r}; use one of {sorted(DTFM_CASES)}.")
    names, table, default_gpus = DTFM_CASES[case]
    gpus = _positive_int(default_gpus if gpus_per_region is None else gpus_per_region, "dtfm",
                         "gpus_per_region")
    spec = resolve_device(device, "preset 'dtfm': device")
    devices = tuple(Device(id=r * gpus + g, spec=spec, region=name, node=f"{name}-{g}")
                    for r, name in enumerate(names) for g in range(gpus))
    links = []
    for (a, b), (ms, gbit) in table.items():
        if a in names and b in names:
            links.append(PairLink(between=(a, b),
                                  link=LinkSpec(bandwidth=_gbps(gbit), latency=ms / 1e3)))
    slowest = min(gbit for (a, b), (_, gbit) in table.items() if a in names and b in names)
    worst_ms = max(ms for (a, b), (ms, _) in table.items() if a in names and b in names)
    axis_names, shape = _mesh_axes([("region", len(names)), ("node", gpus)])
    return Topology(
        name=f"dtfm-{case}-{len(names)}x{gpus}",
        devices=devices,
        axis_names=axis_names,
        shape=shape,
        region_link=DTFM_IN_REGION if gpus > 1 else None,
        wan_link=LinkSpec(bandwidth=_gbps(slowest), latency=worst_ms / 1e3),
        links=tuple(links),
    )
