"""The cluster model: devices in a hierarchy, the links between them, and a logical mesh over them.

Where this sits::

    JSON file / preset / grid  ->  Topology  ->  cost (alpha-beta per mesh axis, roofline per device)
                                       |     ->  strategies (device groups by region / node / kind)
                                       |     ->  gnn (device and link nodes of the joined graph)
                                       v
                     jax.sharding.Mesh (real or fake devices) / AbstractMesh (no devices)

A topology has three layers:

1. **Devices**, ordered hierarchically: region > node > local index. ``devices[i].id == i``.
2. **Links**, an alpha-beta :class:`LinkSpec` between any two devices. Which one applies depends on the
   lowest hierarchy level the two devices share, with per-pair overrides taking precedence:

   ================  =====================================  =======================================
   devices are in    override looked up (first match wins)  default
   ================  =====================================  =======================================
   the same node     (node, node)                           ``node_link``   (JSON ``levels.node``)
   one region        (node_a, node_b), (region, region)     ``region_link`` (JSON ``levels.region``)
   two regions       (node_a, node_b), (region_a, region_b) ``wan_link``    (JSON ``levels.wan``)
   ================  =====================================  =======================================

   A topology may instead give one link per mesh axis (``axis_links``, as ``Topology.grid`` and the
   TPU torus preset do); then the hierarchy only names devices, and a transfer between two devices
   pays the slowest axis link among the axes along which their mesh coordinates differ.
3. **A logical mesh**: ``axis_names`` and ``shape``; the device order reshaped row-major to ``shape``.
   A collective over a mesh axis runs inside the groups of devices that differ only along that axis;
   it pays the bottleneck link inside those groups (:meth:`Topology.axis_link`).
"""

from __future__ import annotations

import difflib
import hashlib
import inspect
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import jax
import numpy as np

from hulkjax.errors import InvalidTopologyError, NotEnoughDevicesError
from hulkjax.formatting import format_count, format_rate, format_time
from hulkjax.topology import schema
from hulkjax.topology.specs import (
    DEVICE_SPECS,
    Device,
    DeviceSpec,
    LinkSpec,
    PairLink,
    check_axes,
    check_name,
    worst_link,
)

__all__ = ["GROUP_LEVELS", "Topology", "presets"]

logger = logging.getLogger(__name__)

GROUP_LEVELS = ("region", "node", "kind")
"""The levels :meth:`Topology.groups` accepts."""


Preset = Callable[..., "Topology"]
presets: dict[str, Preset] = {}
"""Named cluster builders, filled by :mod:`hulkjax.topology.presets` (and by
``hulkjax.topology.register_preset`` for your own): :meth:`Topology.preset` reads this table and
imports no builder."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """A cluster: devices in a region > node hierarchy, links between them, and a logical mesh.

    Build one with :meth:`preset`, :meth:`grid` or :meth:`load` rather than field by field. Instances
    are immutable, hashable and compared by value (they key plan caches); ``fingerprint()`` is a
    stable short hash of the JSON form.

    >>> topo = Topology.preset("dgx-h100", nodes=2)
    >>> topo.axis_names, topo.shape, topo.axis_bandwidth("node"), topo.axis_bandwidth("gpu")
    (('node', 'gpu'), (2, 8), 50000000000.0, 450000000000.0)

    Attributes:
      name: a short name for messages and file names, e.g. ``"dgx-h100x2"``. Non-empty.
      devices: every device, in hierarchical order (region, node, local index); ``devices[i].id == i``,
        the devices of a node are contiguous, and so are the nodes of a region. Each node holds devices
        of one spec; node names are unique and differ from region names.  # tuple[Device, ...]
      axis_names: logical mesh axis names, each a Python identifier.  # tuple[str, ...]
      shape: logical mesh size per axis, same order; ``prod(shape) == len(devices)``. The mesh is the
        device order reshaped row-major to ``shape``.  # tuple[int, ...]
      node_link: default link between two devices of one node (JSON ``levels.node``). Required when
        some node holds more than one device, unless ``axis_links`` is given.
      region_link: default link between devices on two nodes of one region (JSON ``levels.region``).
        Required when some region holds more than one node, unless ``axis_links`` is given.
      wan_link: default link between devices in two regions (JSON ``levels.wan``). Required when
        there is more than one region, unless ``axis_links`` is given.
      links: per-pair overrides of those defaults (JSON ``links``), stored sorted by pair; at most one
        per pair.  # tuple[PairLink, ...]
      axis_links: one link per mesh axis, used as-is for collectives over that axis (grid and torus
        topologies). When given, ``node_link``/``region_link``/``wan_link``/``links`` must be empty.
        # tuple[LinkSpec, ...] | None
    """

    name: str
    devices: tuple[Device, ...]
    axis_names: tuple[str, ...]
    shape: tuple[int, ...]
    node_link: LinkSpec | None = None
    region_link: LinkSpec | None = None
    wan_link: LinkSpec | None = None
    links: tuple[PairLink, ...] = ()
    axis_links: tuple[LinkSpec, ...] | None = None

    # Derived in __post_init__; not part of equality or the hash.
    _node_of: np.ndarray = field(init=False, repr=False, compare=False, hash=False)
    _node_names: tuple[str, ...] = field(init=False, repr=False, compare=False, hash=False)
    _region_of_node: dict[str, str] = field(init=False, repr=False, compare=False, hash=False)
    _overrides: dict[tuple[str, str], LinkSpec] = field(
        init=False, repr=False, compare=False, hash=False
    )
    _axis_table: tuple[LinkSpec, ...] = field(init=False, repr=False, compare=False, hash=False)
    _scope_table: tuple[str, ...] = field(init=False, repr=False, compare=False, hash=False)
    _hash: int = field(init=False, repr=False, compare=False, hash=False)
    _collective_overhead: float = field(init=False, repr=False, compare=False, hash=False)

    # ------------------------------------------------------------------ construction and validation

    def __post_init__(self) -> None:
        check_name(self.name, "Topology.name")
        for attr in ("devices", "axis_names", "shape", "links"):
            value = getattr(self, attr)
            if isinstance(value, list):
                object.__setattr__(self, attr, tuple(value))
        if self.axis_links is not None and isinstance(self.axis_links, list):
            object.__setattr__(self, "axis_links", tuple(self.axis_links))
        self._check_devices()
        check_axes(self.axis_names, self.shape, "Topology.axis_names", "Topology.shape")
        if math.prod(self.shape) != len(self.devices):
            raise InvalidTopologyError(
                f"Topology.shape={list(self.shape)} multiplies to {math.prod(self.shape)} but the "
                f"topology '{self.name}' has {len(self.devices)} devices. Pick a mesh shape whose "
                f"sizes multiply to {len(self.devices)}.",
                where="Topology.shape",
            )
        self._check_links()
        object.__setattr__(
            self, "_axis_table", tuple(self._compute_axis_link(i) for i in range(len(self.shape)))
        )
        object.__setattr__(
            self, "_scope_table", tuple(self._compute_scope(i) for i in range(len(self.shape)))
        )
        object.__setattr__(
            self,
            "_hash",
            hash(
                (
                    self.name,
                    self.devices,
                    self.axis_names,
                    self.shape,
                    self.node_link,
                    self.region_link,
                    self.wan_link,
                    self.links,
                    self.axis_links,
                )
            ),
        )

    def _check_devices(self) -> None:
        if not isinstance(self.devices, tuple) or not self.devices:
            raise InvalidTopologyError(
                f"Topology.devices must be a non-empty tuple of Device, got {self.devices!r}."
            )
        node_spec: dict[str, DeviceSpec] = {}
        region_of_node: dict[str, str] = {}
        kind_spec: dict[str, DeviceSpec] = {}
        done_regions: set[str] = set()
        done_nodes: set[str] = set()
        node_index: dict[str, int] = {}
        node_of = np.empty(len(self.devices), dtype=np.int64)
        prev: Device | None = None
        for i, dev in enumerate(self.devices):
            if not isinstance(dev, Device):
                raise InvalidTopologyError(f"Topology.devices[{i}] must be a Device, got {dev!r}.")
            if dev.id != i:
                raise InvalidTopologyError(
                    f"Topology.devices[{i}].id={dev.id}; ids must be 0..n-1 in order (the id is "
                    "the device's position). Renumber the devices."
                )
            if dev.node in region_of_node and region_of_node[dev.node] != dev.region:
                raise InvalidTopologyError(
                    f"Topology.devices[{i}].node={dev.node!r} is also a node of region "
                    f"{region_of_node[dev.node]!r} (this device is in region {dev.region!r}); a node "
                    "lies in one region, so node names must be unique across regions.",
                    where=f"Topology.devices[{i}].node",
                )
            if prev is not None and dev.region != prev.region:
                done_regions.add(prev.region)
            if prev is not None and dev.node != prev.node:
                done_nodes.add(prev.node)
            if dev.region in done_regions:
                raise InvalidTopologyError(
                    f"Topology.devices[{i}].region={dev.region!r}: that region's devices ended "
                    "earlier; devices must be ordered region by region, node by node (list each "
                    "region once).",
                    where=f"Topology.devices[{i}].region",
                )
            if dev.node in done_nodes:
                raise InvalidTopologyError(
                    f"Topology.devices[{i}].node={dev.node!r}: that node's devices ended earlier; "
                    "devices must be ordered region by region, node by node (node names are "
                    "unique).",
                    where=f"Topology.devices[{i}].node",
                )
            if dev.node in node_spec and node_spec[dev.node] != dev.spec:
                raise InvalidTopologyError(
                    f"Topology.devices[{i}].spec: node={dev.node!r} mixes device specs "
                    f"{node_spec[dev.node]!r} and {dev.spec!r}; a node holds one kind of device. "
                    "Split it into two nodes.",
                    where=f"Topology.devices[{i}].spec",
                )
            if dev.spec.kind in kind_spec and kind_spec[dev.spec.kind] != dev.spec:
                raise InvalidTopologyError(
                    f"Topology.devices[{i}].spec: kind={dev.spec.kind!r} has two different specs, "
                    f"{kind_spec[dev.spec.kind]!r} and {dev.spec!r}. Give each spec its own kind "
                    "name.",
                    where=f"Topology.devices[{i}].spec",
                )
            kind_spec[dev.spec.kind] = dev.spec
            node_spec[dev.node] = dev.spec
            region_of_node[dev.node] = dev.region
            node_of[i] = node_index.setdefault(dev.node, len(node_index))
            prev = dev
        clash = sorted(set(region_of_node) & set(region_of_node.values()))
        if clash:
            raise InvalidTopologyError(
                f"Topology.devices: {clash[0]!r} names both a region and a node; per-pair links "
                "name either, so the names must differ. Rename the node (e.g. 'node0').",
                where="Topology.devices",
            )
        node_of.setflags(write=False)
        object.__setattr__(self, "_node_of", node_of)
        object.__setattr__(self, "_node_names", tuple(node_index))
        object.__setattr__(self, "_region_of_node", region_of_node)
        object.__setattr__(self, "_collective_overhead",
                           max(dev.spec.collective_overhead for dev in self.devices))

    def _check_links(self) -> None:
        for attr, json_name in (
            ("node_link", "levels.node"),
            ("region_link", "levels.region"),
            ("wan_link", "levels.wan"),
        ):
            value = getattr(self, attr)
            if value is not None and not isinstance(value, LinkSpec):
                raise InvalidTopologyError(
                    f"Topology.{attr} ({json_name}) must be a LinkSpec or None, got {value!r}."
                )
        if not isinstance(self.links, tuple):
            raise InvalidTopologyError(
                f"Topology.links must be a tuple of PairLink, got {self.links!r}."
            )
        regions = set(self._region_of_node.values())
        nodes = set(self._region_of_node)
        overrides: dict[tuple[str, str], LinkSpec] = {}
        first: dict[tuple[str, str], int] = {}
        for i, pair in enumerate(self.links):
            if not isinstance(pair, PairLink):
                raise InvalidTopologyError(f"Topology.links[{i}] must be a PairLink, got {pair!r}.",
                                           where=f"Topology.links[{i}]")
            a, b = pair.between
            if not ({a, b} <= regions or {a, b} <= nodes):
                raise InvalidTopologyError(
                    f"Topology.links[{i}].between={list(pair.between)!r} must name two regions or two "
                    f"nodes of this topology; regions are {sorted(regions)!r}, nodes are "
                    f"{sorted(nodes)[:8]!r}{' ...' if len(nodes) > 8 else ''}.",
                    where=f"Topology.links[{i}].between",
                )
            if pair.between in overrides:
                raise InvalidTopologyError(
                    f"Topology.links[{i}].between={list(pair.between)!r} repeats "
                    f"Topology.links[{first[pair.between]}]; keep one link per pair.",
                    where=f"Topology.links[{i}].between",
                )
            overrides[pair.between] = pair.link
            first[pair.between] = i
        ordered = tuple(sorted(self.links, key=lambda p: p.between))
        object.__setattr__(self, "links", ordered)
        object.__setattr__(self, "_overrides", overrides)

        if self.axis_links is not None:
            if not isinstance(self.axis_links, tuple) or len(self.axis_links) != len(self.shape):
                n = len(self.axis_links) if isinstance(self.axis_links, tuple) else self.axis_links
                raise InvalidTopologyError(
                    f"Topology.axis_links has {n} entries but the mesh has {len(self.shape)} axes "
                    f"{list(self.axis_names)}; give one LinkSpec per axis.",
                    where="Topology.axis_links",
                )
            for i, link in enumerate(self.axis_links):
                if not isinstance(link, LinkSpec):
                    raise InvalidTopologyError(
                        f"Topology.axis_links[{i}] must be a LinkSpec, got {link!r}.",
                        where=f"Topology.axis_links[{i}]",
                    )
            given = [
                a for a in ("node_link", "region_link", "wan_link") if getattr(self, a) is not None
            ]
            if given or self.links:
                raise InvalidTopologyError(
                    f"Topology.axis_links is given, so the hierarchy links (levels, links) must be "
                    f"empty: with per-axis links they are unused; got "
                    f"{', '.join(given + (['links'] if self.links else []))}. Give one or the other.",
                    where="Topology.axis_links",
                )
            return
        self._check_levels_present(regions)

    def _check_levels_present(self, regions: set[str]) -> None:
        node_sizes: dict[str, int] = {}
        for dev in self.devices:
            node_sizes[dev.node] = node_sizes.get(dev.node, 0) + 1
        nodes_per_region: dict[str, int] = {}
        for region in self._region_of_node.values():
            nodes_per_region[region] = nodes_per_region.get(region, 0) + 1
        multi = [n for n, k in node_sizes.items() if k > 1]
        if self.node_link is None and multi:
            raise InvalidTopologyError(
                f"Topology.node_link (levels.node) is missing but node {multi[0]!r} holds "
                f"{node_sizes[multi[0]]} devices. Give the link between devices of one node, "
                "e.g. LinkSpec(bandwidth=450e9, latency=1e-6) for NVLink4."
            )
        multi = [r for r, k in nodes_per_region.items() if k > 1]
        if self.region_link is None and multi:
            raise InvalidTopologyError(
                f"Topology.region_link (levels.region) is missing but region {multi[0]!r} holds "
                f"{nodes_per_region[multi[0]]} nodes. Give the link between nodes of one region, "
                "e.g. LinkSpec(bandwidth=50e9, latency=5e-6) for 400 Gb/s InfiniBand per GPU."
            )
        if self.wan_link is None and len(regions) > 1:
            raise InvalidTopologyError(
                f"Topology.wan_link (levels.wan) is missing but there are {len(regions)} regions "
                f"{sorted(regions)!r}. Give the default link between regions (per-pair links "
                "override it), e.g. LinkSpec(bandwidth=1.25e8, latency=0.05)."
            )

    # ------------------------------------------------------------------ links

    def _node_pair_link(self, node_a: str, node_b: str) -> LinkSpec | None:
        """Link between a device on node_a and one on node_b (the same node: inside the node)."""
        pair = _pair(node_a, node_b)
        if pair in self._overrides:
            return self._overrides[pair]
        if node_a == node_b:
            return self.node_link
        return self._region_pair_link(self._region_of_node[node_a], self._region_of_node[node_b])

    def _region_pair_link(self, region_a: str, region_b: str) -> LinkSpec | None:
        """Link between nodes of two regions (the same region: between its nodes), no node overrides."""
        pair = _pair(region_a, region_b)
        if pair in self._overrides:
            return self._overrides[pair]
        return self.region_link if region_a == region_b else self.wan_link

    def _fastest_link(self) -> LinkSpec:
        candidates = [
            link
            for link in (
                self.node_link,
                self.region_link,
                self.wan_link,
                *self._overrides.values(),
                *(self.axis_links or ()),
            )
            if link is not None
        ]
        if not candidates:  # one device per node, one node, no links at all: nothing ever moves
            return LinkSpec(bandwidth=1e12, latency=0.0)
        return max(candidates, key=lambda link: (link.bandwidth, -link.latency))

    def _check_device_id(self, dev: Any, arg: str) -> int:
        if (
            not isinstance(dev, int | np.integer)
            or isinstance(dev, bool)
            or not 0 <= dev < len(self.devices)
        ):
            raise InvalidTopologyError(
                f"{arg}={dev!r} is not a device id of topology '{self.name}'; ids are "
                f"0..{len(self.devices) - 1}."
            )
        return int(dev)

    def link(self, dev_a: int, dev_b: int) -> LinkSpec:
        """The link between two devices, by device id.

        Hierarchy topologies: the per-pair override or level default for the lowest level the two
        devices share (see the module docstring). Per-axis topologies (``axis_links``): the bottleneck
        of the links of the axes along which the two devices' mesh coordinates differ. A device with
        itself gets its node's internal link (or the topology's fastest link if it has none).

        >>> topo = Topology.preset("dgx-h100", nodes=2)
        >>> topo.link(0, 1).bandwidth, topo.link(0, 8).bandwidth
        (450000000000.0, 50000000000.0)
        """
        a = self._check_device_id(dev_a, "dev_a")
        b = self._check_device_id(dev_b, "dev_b")
        if self.axis_links is not None:
            ca = np.unravel_index(a, self.shape)
            cb = np.unravel_index(b, self.shape)
            crossed = [self.axis_links[i] for i in range(len(self.shape)) if ca[i] != cb[i]]
            return worst_link(crossed) if crossed else self._fastest_link()
        link = self._node_pair_link(self.devices[a].node, self.devices[b].node)
        return link if link is not None else self._fastest_link()

    def _axis_groups(self, axis: int) -> np.ndarray:
        """Device ids grouped along mesh axis ``axis``: shape (num_groups, axis_size)."""
        ids = np.arange(len(self.devices)).reshape(self.shape)
        return np.moveaxis(ids, axis, -1).reshape(-1, self.shape[axis])

    def _compute_axis_link(self, axis: int) -> LinkSpec:
        if self.axis_links is not None:
            return self.axis_links[axis]
        if self.shape[axis] == 1:
            return self._fastest_link()
        # Reason per hierarchy level rather than per device pair, so that an axis over thousands of
        # nodes costs O(nodes + overrides), not O(nodes^2): a region pair (or a region) contributes its
        # level link unless per-node-pair overrides cover every node pair in it.
        partners: dict[str, list[tuple[str, LinkSpec]]] = {}
        for (a, b), link in self._overrides.items():
            if a != b and a in self._region_of_node:
                partners.setdefault(a, []).append((b, link))
        crossed: dict[LinkSpec, None] = {}  # ordered set
        node_groups = np.sort(self._node_of[self._axis_groups(axis)], axis=1)
        for group in np.unique(node_groups, axis=0):
            idx, counts = np.unique(group, return_counts=True)
            names = [self._node_names[i] for i in idx]
            for name, count in zip(names, counts):
                if count > 1:
                    crossed[self._node_pair_link(name, name) or self._fastest_link()] = None
            if len(names) < 2:
                continue
            in_group = set(names)
            per_region: dict[str, int] = {}
            for name in names:
                region = self._region_of_node[name]
                per_region[region] = per_region.get(region, 0) + 1
            covered: dict[tuple[str, str], int] = {}
            for name in names:
                for partner, link in partners.get(name, ()):
                    if partner in in_group:
                        crossed[link] = None
                        key = _pair(self._region_of_node[name], self._region_of_node[partner])
                        covered[key] = covered.get(key, 0) + 1
            regions = list(per_region)
            for i, ra in enumerate(regions):
                for rb in regions[i:]:
                    ka, kb = per_region[ra], per_region[rb]
                    pairs = ka * (ka - 1) // 2 if ra == rb else ka * kb
                    if pairs > covered.get(_pair(ra, rb), 0):
                        crossed[self._region_pair_link(ra, rb) or self._fastest_link()] = None
        return worst_link(crossed)

    def _compute_scope(self, axis: int) -> str:
        groups = self._axis_groups(axis)
        nodes = self._node_of[groups]
        if (nodes == nodes[:, :1]).all():
            return "node"
        region_index = {r: i for i, r in enumerate(dict.fromkeys(self._region_of_node.values()))}
        region_of = np.array([region_index[self._region_of_node[n]] for n in self._node_names])
        regions = region_of[nodes]
        return "region" if (regions == regions[:, :1]).all() else "wan"

    def _axis_index(self, name: str) -> int:
        if name not in self.axis_names:
            raise InvalidTopologyError(
                f"topology '{self.name}' has no mesh axis {name!r}; its axes are "
                f"{self.axis_names} with sizes {self.shape}."
            )
        return self.axis_names.index(name)

    def axis_size(self, name: str) -> int:
        """Number of devices along mesh axis ``name``.

        >>> Topology.grid((2, 4), ("data", "model")).axis_size("model")
        4
        """
        return self.shape[self._axis_index(name)]

    def axis_link(self, name: str) -> LinkSpec:
        """The link a collective over mesh axis ``name`` pays: the bottleneck inside its groups.

        The groups of an axis are the sets of devices that differ only in their coordinate along it.
        The result is the lowest bandwidth and the highest latency over every pair of devices in every
        group: an axis whose groups span regions pays the WAN (the slowest region pair), one that spans
        nodes pays the inter-node link. Per-axis topologies (``grid``) return their given link. A
        size-1 axis moves no data; it reports the topology's fastest link.

        >>> topo = Topology.preset("dgx-h100", nodes=2)
        >>> topo.axis_link("node")
        LinkSpec(bandwidth=50000000000.0, latency=5e-06)
        """
        return self._axis_table[self._axis_index(name)]

    def axis_bandwidth(self, name: str) -> float:
        """``axis_link(name).bandwidth``, in bytes/s per direction per device.

        >>> Topology.grid((2, 4), ("data", "model"), bandwidth=(25e9, 450e9)).axis_bandwidth("data")
        25000000000.0
        """
        return self.axis_link(name).bandwidth

    def axis_latency(self, name: str) -> float:
        """``axis_link(name).latency``, in seconds.

        >>> Topology.grid((2, 4), ("data", "model"), latency=(5e-6, 1e-6)).axis_latency("data")
        5e-06
        """
        return self.axis_link(name).latency

    def axis_scope(self, name: str) -> str:
        """The widest hierarchy level the groups of mesh axis ``name`` span.

        ``"node"``: every group lies inside one node; ``"region"``: groups span nodes of one region;
        ``"wan"``: groups span regions. Computed from the device hierarchy also for per-axis topologies.

        >>> topo = Topology.preset("dgx-h100", nodes=2)
        >>> topo.axis_scope("gpu"), topo.axis_scope("node")
        ('node', 'region')
        """
        return self._scope_table[self._axis_index(name)]

    # ------------------------------------------------------------------ devices

    @property
    def num_devices(self) -> int:
        """Number of devices, ``prod(shape)``."""
        return len(self.devices)

    @property
    def is_heterogeneous(self) -> bool:
        """Whether the devices have more than one spec (mixed GPU generations).

        >>> Topology.preset("hetero").is_heterogeneous
        True
        """
        first = self.devices[0].spec
        return any(dev.spec != first for dev in self.devices)

    def device_specs(self) -> tuple[DeviceSpec, ...]:
        """The distinct device specs, in order of first appearance.

        >>> [s.kind for s in Topology.preset("hetero").device_specs()]
        ['A100', 'V100']
        """
        return tuple(dict.fromkeys(dev.spec for dev in self.devices))

    def collective_overhead(self) -> float:
        """Seconds each collective call costs beyond its links (``DeviceSpec.
        collective_overhead``; the largest of the devices': a call waits for its slowest member).

        >>> Topology.grid(4, "d").collective_overhead()
        0.0
        """
        return self._collective_overhead

    def slowest_device(self) -> DeviceSpec:
        """The spec with the lowest peak FLOP/s (ties: lower HBM bandwidth, then less memory).

        SPMD gives every device an equal shard, so a step runs at the pace of this device.

        >>> Topology.preset("hetero").slowest_device().kind
        'V100'
        """
        return min(self.device_specs(), key=lambda s: (s.peak_flops, s.hbm_bandwidth, s.memory))

    def groups(self, level: str) -> tuple[tuple[int, ...], ...]:
        """Device ids grouped by ``"region"``, ``"node"`` or ``"kind"`` (device spec).

        Groups are in order of first appearance; ids inside a group ascend.

        >>> Topology.preset("hetero").groups("kind")
        ((0, 1, 2, 3), (4, 5, 6, 7))
        """
        keys: dict[Any, list[int]] = {}
        if level == "region":
            key = lambda d: d.region  # noqa: E731
        elif level == "node":
            key = lambda d: d.node  # noqa: E731
        elif level == "kind":
            key = lambda d: d.spec  # noqa: E731
        else:
            raise InvalidTopologyError(
                f"groups(level={level!r}): level must be one of {list(GROUP_LEVELS)!r}."
            )
        for dev in self.devices:
            keys.setdefault(key(dev), []).append(dev.id)
        return tuple(tuple(ids) for ids in keys.values())

    def subset(self, devices: Sequence[int], *, canonical: bool = False,
               name: str | None = None) -> Topology:
        """The topology of some of its devices: a device group (a pipeline stage's cluster).

        Devices keep their specs and (unless ``canonical``) their region and node names; links
        between them are the topology's. The mesh follows the hierarchy: axes ``("region",
        "node", "gpu")`` over the group's regions, nodes per region and devices per node (size-1
        axes dropped), or one flat ``"gpu"`` axis when regions or nodes hold unequal numbers. For
        per-axis topologies (``grid``, ``tpu-v5e``) the group must be a block of the mesh; it keeps
        the axes it spans, with their links.

        Args:
          devices: device ids; sorted into the topology's (hierarchical) order.
          canonical: name regions ``r0, r1, ...`` and nodes ``n0, n1, ...`` in order, so that
            groups of the same shape (four 8-GPU nodes of one kind over the same links) are equal
            topologies: cost tables keyed by topology are then shared between them.
          name: the sub-topology's name (default: derived from the parent's, or from the shape).

        >>> topo = Topology.preset("hetero")
        >>> sub = topo.subset(topo.groups("kind")[1])
        >>> sub.shape, sub.slowest_device().kind, sub.axis_link("gpu").bandwidth
        ((4,), 'V100', 150000000000.0)
        """
        ids = sorted({self._check_device_id(d, "subset(devices)") for d in devices})
        if not ids:
            raise InvalidTopologyError("subset(devices=[]): a device group needs a device.")
        if self.axis_links is not None:
            return self._grid_subset(ids, name)
        devs = [self.devices[i] for i in ids]
        region_names = list(dict.fromkeys(d.region for d in devs))
        node_names = list(dict.fromkeys(d.node for d in devs))
        rename_r = {r: (f"r{k}" if canonical else r) for k, r in enumerate(region_names)}
        rename_n = {n: (f"n{k}" if canonical else n) for k, n in enumerate(node_names)}
        new = tuple(Device(id=k, spec=d.spec, region=rename_r[d.region], node=rename_n[d.node])
                    for k, d in enumerate(devs))
        keep = set(region_names) | set(node_names)
        rename = {**rename_r, **rename_n}
        links = tuple(PairLink(between=(rename[a], rename[b]), link=p.link)
                      for p in self.links for a, b in [p.between] if a in keep and b in keep)
        per_node = [sum(1 for d in devs if d.node == n) for n in node_names]
        per_region = [sum(1 for n in node_names if self._region_of_node[n] == r)
                      for r in region_names]
        if len(set(per_node)) == 1 and len(set(per_region)) == 1:
            axes = [("region", len(region_names)), ("node", per_region[0]), ("gpu", per_node[0])]
            kept = [(a, s) for a, s in axes if s > 1] or [("gpu", 1)]
        else:
            kept = [("gpu", len(ids))]
        multi_node = any(k > 1 for k in per_node)
        multi_region_nodes = any(k > 1 for k in per_region)
        if name is None:
            kinds = "+".join(dict.fromkeys(d.spec.kind for d in devs))
            name = (f"group-{len(ids)}x{kinds}" if canonical
                    else f"{self.name}[{ids[0]}..{ids[-1]}]")
        return Topology(
            name=name,
            devices=new,
            axis_names=tuple(a for a, _ in kept),
            shape=tuple(s for _, s in kept),
            node_link=self.node_link if multi_node else None,
            region_link=self.region_link if multi_region_nodes else None,
            wan_link=self.wan_link if len(region_names) > 1 else None,
            links=links,
        )

    def _grid_subset(self, ids: list[int], name: str | None) -> Topology:
        coords = np.array(np.unravel_index(np.array(ids), self.shape)).T
        values = [sorted(set(coords[:, k].tolist())) for k in range(len(self.shape))]
        if math.prod(len(v) for v in values) != len(ids):
            raise InvalidTopologyError(
                f"subset(devices={ids[:8]}{'...' if len(ids) > 8 else ''}) of per-axis topology "
                f"'{self.name}' is not a block of its mesh {dict(zip(self.axis_names, self.shape))}"
                f"; give whole rows or blocks (e.g. the devices of one index along the first "
                f"axis).")
        kept = [k for k, v in enumerate(values) if len(v) > 1] or [len(self.shape) - 1]
        spec = self.devices[ids[0]].spec
        devices = tuple(Device(id=k, spec=self.devices[i].spec, region=self.devices[i].region,
                               node=self.devices[i].node) for k, i in enumerate(ids))
        if any(d.spec != spec for d in devices):
            raise InvalidTopologyError(f"subset of '{self.name}' mixes device kinds in one "
                                       f"per-axis mesh; give devices of one kind.")
        return Topology(
            name=name or f"{self.name}[{ids[0]}..{ids[-1]}]",
            devices=devices,
            axis_names=tuple(self.axis_names[k] for k in kept),
            shape=tuple(len(values[k]) for k in kept),
            axis_links=tuple(self.axis_links[k] for k in kept),
        )

    @property
    def regions(self) -> tuple[str, ...]:
        """Region names in device order."""
        return tuple(dict.fromkeys(dev.region for dev in self.devices))

    @property
    def nodes(self) -> tuple[str, ...]:
        """Node names in device order."""
        return self._node_names

    # ------------------------------------------------------------------ meshes

    def mesh(self, devices: Sequence[Any] | None = None) -> jax.sharding.Mesh:
        """A ``jax.sharding.Mesh`` of this topology's shape, all axes ``AxisType.Auto``.

        Topology device ``i`` is placed on ``devices[i]`` (default ``jax.devices()``; extra devices
        are left out).

        Args:
          devices: JAX devices to use, at least ``num_devices`` of them; default ``jax.devices()``.

        Raises:
          NotEnoughDevicesError: fewer devices than the topology needs.

        >>> mesh = Topology.grid(1, "data").mesh()
        >>> dict(mesh.shape), mesh.axis_types
        ({'data': 1}, (Auto,))
        """
        given = devices is not None
        devs = list(jax.devices() if devices is None else devices)
        n = self.num_devices
        if len(devs) < n:
            platform = getattr(devs[0], "platform", "?") if devs else "none"
            have = f"{len(devs)} were given" if given else f"JAX has {len(devs)} ({platform})"
            raise NotEnoughDevicesError(
                f"topology '{self.name}' needs {n} devices but {have}. To plan without devices use "
                "topo.abstract_mesh() / hj.plan with ShapeDtypeStructs; for fake CPU devices call "
                f"jax.config.update('jax_num_cpu_devices', {n}) before JAX initializes (or "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={n})."
            )
        if len(devs) > n:
            logger.debug("topology %r uses %d of %d devices", self.name, n, len(devs))
        grid = np.empty(n, dtype=object)
        grid[:] = devs[:n]
        return jax.sharding.Mesh(
            grid.reshape(self.shape),
            self.axis_names,
            axis_types=(jax.sharding.AxisType.Auto,) * len(self.shape),
        )

    def abstract_mesh(self) -> jax.sharding.AbstractMesh:
        """A ``jax.sharding.AbstractMesh`` of this topology's shape (no devices needed), axes Auto.

        >>> dict(Topology.preset("dgx-h100", nodes=64).abstract_mesh().shape)
        {'node': 64, 'gpu': 8}
        """
        return jax.sharding.AbstractMesh(
            self.shape,
            self.axis_names,
            axis_types=(jax.sharding.AxisType.Auto,) * len(self.shape),
        )

    def with_mesh(
        self, shape: Sequence[int], axis_names: Sequence[str], name: str | None = None
    ) -> Topology:
        """The same devices and links under another logical mesh (row-major over the device order).

        Not available for per-axis topologies (``grid``, ``tpu-v5e``): their links belong to axes.

        >>> Topology.preset("dgx-h100").with_mesh((2, 4), ("data", "model")).axis_link("data").bandwidth
        450000000000.0
        """
        if self.axis_links is not None:
            raise InvalidTopologyError(
                f"topology '{self.name}' gives its links per mesh axis (axis_links), so its mesh "
                "cannot be reshaped; build a new one with Topology.grid(shape, axis_names, ...)."
            )
        return Topology(
            name=self.name if name is None else name,
            devices=self.devices,
            axis_names=tuple(axis_names),
            shape=tuple(shape),
            node_link=self.node_link,
            region_link=self.region_link,
            wan_link=self.wan_link,
            links=self.links,
        )

    # ------------------------------------------------------------------ constructors

    @classmethod
    def grid(
        cls,
        shape: int | Sequence[int],
        axis_names: str | Sequence[str],
        bandwidth: float | Sequence[float] = 100e9,
        latency: float | Sequence[float] = 1e-6,
        device: str | DeviceSpec = "cpu",
        name: str | None = None,
    ) -> Topology:
        """An abstract mesh with one alpha-beta link per axis and identical devices.

        All devices sit on one node of one region; collectives over an axis pay that axis's link.

        Args:
          shape: devices per axis (an int for one axis).
          axis_names: a name per axis (a str for one axis); Python identifiers.
          bandwidth: bytes/s per direction per device: one for all axes or one per axis.
            Default 100 GB/s (nominal).
          latency: seconds: one for all axes or one per axis. Default 1 us (nominal).
          device: a ``DeviceSpec`` or the kind name of one in ``DEVICE_SPECS``. Default ``"cpu"``.
          name: default ``"grid-<shape joined by x>"``.

        >>> topo = Topology.grid((2, 4), ("data", "model"), bandwidth=(25e9, 450e9), latency=(5e-6, 1e-6))
        >>> topo.name, topo.num_devices, topo.axis_link("model")
        ('grid-2x4', 8, LinkSpec(bandwidth=450000000000.0, latency=1e-06))
        """
        shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
        names_t = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
        check_axes(names_t, shape_t, "grid(axis_names)", "grid(shape)")
        spec = resolve_device(device, "grid(device)")
        bws = _per_axis(bandwidth, names_t, "bandwidth")
        lats = _per_axis(latency, names_t, "latency")
        axis_links = tuple(
            _link(bw, lat, f"grid(bandwidth/latency) for axis {ax!r}")
            for bw, lat, ax in zip(bws, lats, names_t)
        )
        n = math.prod(shape_t)
        devices = tuple(Device(id=i, spec=spec, region="local", node="node0") for i in range(n))
        return cls(
            name=name or "grid-" + "x".join(str(s) for s in shape_t),
            devices=devices,
            axis_names=names_t,
            shape=shape_t,
            axis_links=axis_links,
        )

    @classmethod
    def preset(cls, name: str, **kwargs: Any) -> Topology:
        """A named cluster from public hardware numbers; see :meth:`presets` for the names.

        Args:
          name: preset name, e.g. ``"dgx-h100"``, ``"tpu-v5e"``, ``"geo"``, ``"hetero"``.
          **kwargs: the preset's arguments (e.g. ``nodes=2`` for ``dgx-h100``).

        Raises:
          InvalidTopologyError: unknown name (the message lists the valid ones) or bad arguments.

        >>> Topology.preset("dgx-h100", nodes=2).num_devices
        16
        """
        builder = presets.get(name)
        if builder is None:
            close = difflib.get_close_matches(str(name), list(presets), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise InvalidTopologyError(
                f"unknown topology preset {name!r}; valid presets are {sorted(presets)!r}.{hint} "
                "For anything else use Topology.grid(...) or write a JSON file (Topology.load).")
        params = inspect.signature(builder).parameters
        unknown = [k for k in kwargs if k not in params]
        if unknown:
            raise InvalidTopologyError(
                f"preset {name!r} got unknown argument {unknown[0]!r}; it takes {list(params)!r}.")
        return builder(**kwargs)

    @staticmethod
    def presets() -> list[str]:
        """Names accepted by :meth:`preset`, sorted.

        >>> Topology.presets()[:2]
        ['aws-p3', 'dgx-h100']
        """
        return sorted(presets)

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (see :mod:`hulkjax.topology.schema`); ``from_dict(to_dict()) == self``.

        >>> Topology.grid(2, "data").to_dict()["mesh"]["shape"]
        [2]
        """
        return schema.to_dict(self)

    @classmethod
    def from_dict(cls, data: Any, source: str | None = None) -> Topology:
        """Builds a topology from its JSON form, validating every field.

        Args:
          data: the parsed JSON object.
          source: where it came from (a file name), prefixed to error messages.

        Raises:
          InvalidTopologyError: a field is missing, unknown or has a bad value; the message names its
            path (e.g. ``levels.node.bandwidth``) and the value.

        >>> topo = Topology.preset("geo")
        >>> Topology.from_dict(topo.to_dict()) == topo
        True
        """
        kwargs, locate = schema.from_dict(data, source=source)
        try:
            return cls(**kwargs)
        except InvalidTopologyError as e:
            raise locate(e) from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the JSON form to ``path`` (UTF-8, indented).

        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "t.json"
        >>> topo = Topology.preset("dgx-h100", nodes=2); topo.save(path)
        >>> Topology.load(path) == topo
        True
        """
        text = json.dumps(self.to_dict(), indent=2)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Topology:
        """Reads a topology JSON file.

        Raises:
          InvalidTopologyError: the file is not valid JSON (the message names the file and the parse
            error) or does not follow the schema.
          OSError: the file cannot be read.
        """
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidTopologyError(
                f"{os.fspath(path)}: not valid JSON: {e}. See the schema in hulkjax/topology/schema.py."
            ) from e
        return cls.from_dict(data, source=os.fspath(path))

    def fingerprint(self) -> str:
        """A stable short hash of the JSON form: the first 16 hex digits of its sha256.

        Equal topologies have equal fingerprints, across processes and runs.

        >>> len(Topology.preset("dgx-h100").fingerprint())
        16
        """
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]

    # ------------------------------------------------------------------ text

    def describe(self) -> str:
        """A few human-readable lines: devices, mesh axes with their links, regions.

        >>> print(Topology.preset("dgx-h100", nodes=2).describe().splitlines()[0])
        topology 'dgx-h100x2': 16 devices (16 x H100) in 1 region, 2 nodes
        """
        kinds: dict[str, int] = {}
        for dev in self.devices:
            kinds[dev.spec.kind] = kinds.get(dev.spec.kind, 0) + 1
        mix = " + ".join(f"{n} x {k}" for k, n in kinds.items())
        lines = [
            f"topology '{self.name}': {format_count(self.num_devices, 'device')} ({mix}) in "
            f"{format_count(len(self.regions), 'region')}, {format_count(len(self.nodes), 'node')}"
        ]
        for spec in self.device_specs():
            lines.append(
                f"  {spec.kind}: {spec.peak_flops / 1e12:.4g} TFLOP/s, {spec.memory / 1e9:.4g} GB, "
                f"HBM {format_rate(spec.hbm_bandwidth)}"
            )
        shape = " x ".join(f"{a}={s}" for a, s in zip(self.axis_names, self.shape))
        lines.append(f"  mesh: {shape}")
        scope_words = {"node": "within a node", "region": "across nodes", "wan": "across regions"}
        width = max(len(a) for a in self.axis_names)
        for axis, size, link, scope in zip(
            self.axis_names, self.shape, self._axis_table, self._scope_table
        ):
            where = "per-axis link" if self.axis_links is not None else scope_words[scope]
            lines.append(
                f"    {axis:<{width}}  size {size:<4} {format_rate(link.bandwidth)}, "
                f"latency {format_time(link.latency)} ({where})"
            )
        if len(self.regions) > 1:
            lines.append(
                "  regions: "
                + ", ".join(f"{r} ({len(g)})" for r, g in zip(self.regions, self.groups("region")))
            )
        if self.links:
            lines.append("  per-pair links:")
        for pair in self.links:
            a, b = pair.between
            lines.append(
                f"    {f'inside {a}' if a == b else f'{a} <-> {b}'}: "
                f"{format_rate(pair.link.bandwidth)}, latency {format_time(pair.link.latency)}"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        kinds = ", ".join(f"{s.kind}" for s in self.device_specs())
        return (
            f"Topology(name={self.name!r}, num_devices={self.num_devices}, kinds=[{kinds}], "
            f"axis_names={self.axis_names}, shape={self.shape}, fingerprint={self.fingerprint()!r})"
        )

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        # Rebuild on unpickling: the cached hash depends on the process's string-hash seed.
        return _rebuild_topology, ({f.name: getattr(self, f.name) for f in fields(self) if f.init},)


def _rebuild_topology(kwargs: dict[str, Any]) -> Topology:
    return Topology(**kwargs)


def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


def resolve(topology: Any, *, nodes: int | None = None) -> Topology:
    """A :class:`Topology` from what users pass: a topology, a preset name, or a JSON path.

    The one place the API, the command line and ``launch`` turn a name into a topology.

    >>> resolve("dgx-h100", nodes=2).num_devices
    16
    """
    if isinstance(topology, Topology):
        return topology
    if isinstance(topology, str | os.PathLike):
        text = os.fspath(topology)
        if text.endswith(".json"):
            return Topology.load(text)
        return Topology.preset(text, **({} if nodes is None else {"nodes": nodes}))
    raise InvalidTopologyError(
        f"topology must be a hulkjax.Topology, a preset name or a .json path; got "
        f"{type(topology).__name__} {topology!r}. Try hj.Topology.preset('dgx-h100').")


def resolve_device(device: Any, where: str) -> DeviceSpec:
    """A ``DeviceSpec`` from a spec or a kind name in ``DEVICE_SPECS``."""
    if isinstance(device, DeviceSpec):
        return device
    if isinstance(device, str) and device in DEVICE_SPECS:
        return DEVICE_SPECS[device]
    raise InvalidTopologyError(
        f"{where}={device!r} is not a DeviceSpec or a known device kind; known kinds are "
        f"{sorted(DEVICE_SPECS)!r}. Pass DeviceSpec(kind=..., peak_flops=..., memory=..., "
        "hbm_bandwidth=...) for another device."
    )


def _per_axis(value: Any, axis_names: tuple[str, ...], arg: str) -> tuple[Any, ...]:
    if isinstance(value, Iterable) and not isinstance(value, str):
        values = tuple(value)
        if len(values) != len(axis_names):
            raise InvalidTopologyError(
                f"grid({arg}={list(values)!r}) must be one number or one per axis "
                f"({len(axis_names)} for {list(axis_names)!r})."
            )
        return values
    return (value,) * len(axis_names)


def _link(bandwidth: Any, latency: Any, where: str) -> LinkSpec:
    try:
        return LinkSpec(bandwidth=bandwidth, latency=latency)
    except InvalidTopologyError as e:
        raise InvalidTopologyError(f"{where}: {e}") from None
