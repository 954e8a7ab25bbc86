"""The JSON form of a :class:`~hulkjax.topology.Topology`.

Where this sits: ``Topology.save/load/to_dict/from_dict/fingerprint`` call :func:`to_dict` and
:func:`from_dict` here. This module checks only the JSON's structure (objects, fields, types, names
that refer to each other); every value is checked once, by the constructors (``DeviceSpec``,
``LinkSpec``, ``PairLink``, ``Topology``), and their errors are re-raised here naming the JSON path
of the bad field (``levels.node.bandwidth``, ``devices.hierarchy[0].nodes[1].kind``) and its value,
prefixed with the file name when loading a file.

Schema (version 1). Units: FLOP/s, bytes, bytes/s (per direction per device), seconds::

    {
      "version": 1,                      # optional when reading; always written
      "name": "dgx-h100x2",              # required, non-empty string
      "devices": {                       # required
        "kinds": {                       # optional: kinds not listed here come from DEVICE_SPECS
          "H100": {"peak_flops": 9.9e14, "memory": 8e10, "hbm_bandwidth": 3.35e12,
                   "peak_flops_f32": 4.95e14,  # optional: float32 matmul peak
                   "flops_efficiency": 0.69,   # optional: fraction of the peaks reached (1)
                   "memory_efficiency": 0.77,  # optional: fraction of hbm_bandwidth reached (1)
                   "kernel_overhead": 5e-6,    # optional: seconds per kernel launch (0)
                   "receive_overhead": 0.0,    # optional: compute lost per receive second (0)
                   "fresh_page_time": 0.0,     # optional: seconds per 4 KiB page mapped per call (0)
                   "transposed_dot_efficiency": 1.0,  # optional: both-transposed matmuls' share (1)
                   "collective_overhead": 0.0,  # optional: seconds per collective call (0)
                   "host_bandwidth": 6.4e10}   # optional: device <-> host memory (unknown)
        },
        "hierarchy": [                   # required, >= 1 region; order = device order
          {"region": "local",            # unique, non-empty
           "nodes": [                    # >= 1 node
             {"name": "node0",           # unique across regions, differs from every region name
              "kind": "H100",            # a key of devices.kinds or of DEVICE_SPECS
              "count": 8}]}              # int >= 1
        ]
      },
      "levels": {                        # optional; each entry {"bandwidth": > 0, "latency": >= 0}
        "node": {...},                   # devices on one node; required if a node has > 1 device
        "region": {...},                 # nodes of one region; required if a region has > 1 node
        "wan": {...}                     # two regions; required if there is > 1 region
      },
      "links": [                         # optional per-pair overrides, at most one per pair
        {"between": ["oregon", "virginia"], "bandwidth": 9.875e7, "latency": 0.067}
      ],                                 # two regions, or two nodes; [x, x] = inside region/node x
      "mesh": {                          # required
        "axis_names": ["node", "gpu"],   # unique Python identifiers
        "shape": [2, 8],                 # ints >= 1, one per name, product = number of devices
        "axis_links": [{...}, {...}]     # optional, one link per axis (grid/torus topologies);
      }                                  #   then "levels" and "links" must be empty
    }

Unknown fields anywhere are errors (a typo such as ``"bandwith"`` must not pass silently).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from hulkjax.errors import InvalidTopologyError
from hulkjax.topology.specs import DEVICE_SPECS, Device, DeviceSpec, LinkSpec, PairLink

__all__ = ["SCHEMA_VERSION", "from_dict", "to_dict"]

SCHEMA_VERSION = 1

_LEVELS = ("node", "region", "wan")
_LEVEL_FIELDS = {"node": "node_link", "region": "region_link", "wan": "wan_link"}


class _Checker:
    """Raises InvalidTopologyError with the source (file name) prefixed."""

    def __init__(self, source: str | None):
        self.prefix = f"{source}: " if source else ""

    def fail(self, message: str) -> None:
        raise InvalidTopologyError(self.prefix + message)

    def build(self, cls: Any, path: str, **kwargs: Any) -> Any:
        """``cls(**kwargs)``, its error naming the JSON path instead of ``<cls>.<field>``."""
        try:
            return cls(**kwargs)
        except InvalidTopologyError as e:
            message = str(e).replace(f"{cls.__name__}.", f"{path}.")
            raise InvalidTopologyError(self.prefix + message, where=path) from None

    def obj(
        self, value: Any, path: str, required: tuple[str, ...], optional: tuple[str, ...] = ()
    ) -> dict:
        where = path or "the topology (top level)"
        if not isinstance(value, dict):
            self.fail(f"{where} must be a JSON object, got {type(value).__name__}: {value!r:.80}.")
        missing = [k for k in required if k not in value]
        if missing:
            self.fail(
                f"{where} is missing field {_join(path, missing[0])!r}; it needs "
                f"{list(required)!r}{f' and may have {list(optional)!r}' if optional else ''}."
            )
        unknown = [k for k in value if k not in required and k not in optional]
        if unknown:
            self.fail(
                f"{where} has unknown field {_join(path, str(unknown[0]))!r}; allowed fields are "
                f"{list(required + optional)!r}."
            )
        return value

    def string(self, value: Any, path: str) -> str:
        if not isinstance(value, str) or not value:
            self.fail(
                f"{path} must be a non-empty string, got {path.rsplit('.', 1)[-1]}={value!r}."
            )
        return value

    def array(self, value: Any, path: str, nonempty: bool = True) -> list:
        if not isinstance(value, list) or (nonempty and not value):
            self.fail(
                f"{path} must be a{' non-empty' if nonempty else ''} JSON array, got {value!r:.80}."
            )
        return value

    def positive_int(self, value: Any, path: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            self.fail(f"{path} must be an int >= 1, got {path.rsplit('.', 1)[-1]}={value!r}.")
        return value

    def link(self, value: Any, path: str, extra: tuple[str, ...] = ()) -> LinkSpec:
        obj = self.obj(value, path, ("bandwidth", "latency"), extra)
        return self.build(LinkSpec, path, bandwidth=obj["bandwidth"], latency=obj["latency"])


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def from_dict(data: Any, source: str | None = None) -> tuple[dict[str, Any], Callable]:
    """Checks a topology's JSON structure and returns ``(kwargs, locate)``: the ``Topology(...)``
    keyword arguments, and ``locate(error)``, which re-words an error of the ``Topology``
    constructor with the JSON path of the field it names (``Topology.shape`` -> ``mesh.shape``,
    ``Topology.devices[5].node`` -> ``devices.hierarchy[1].nodes[0].name``).

    Args:
      data: the parsed JSON object.
      source: the file it came from, prefixed to error messages.

    Raises:
      InvalidTopologyError: naming the JSON path of the first bad field and its value.

    >>> kw, _ = from_dict({"name": "one", "devices": {"hierarchy": [{"region": "r", "nodes": [
    ...     {"name": "n", "kind": "H100", "count": 1}]}]}, "mesh": {"axis_names": ["gpu"], "shape": [1]}})
    >>> kw["shape"], kw["devices"][0].spec.kind
    ((1,), 'H100')
    """
    c = _Checker(source)
    top = c.obj(data, "", ("name", "devices", "mesh"), ("version", "levels", "links"))
    if "version" in top and (top["version"] != SCHEMA_VERSION or isinstance(top["version"], bool)):
        c.fail(
            f"version={top['version']!r} is not supported; this hulkjax reads version {SCHEMA_VERSION}."
        )
    name = c.string(top["name"], "name")

    # devices.kinds, then devices.hierarchy
    devs = c.obj(top["devices"], "devices", ("hierarchy",), ("kinds",))
    kinds: dict[str, DeviceSpec] = dict(DEVICE_SPECS)
    file_kinds = devs.get("kinds", {})
    if not isinstance(file_kinds, dict):
        c.fail(f"devices.kinds must be a JSON object of kind -> spec, got {file_kinds!r:.80}.")
    for kind, spec in file_kinds.items():
        path = f"devices.kinds.{kind}"
        c.string(kind, "devices.kinds key")
        c.obj(spec, path, ("peak_flops", "memory", "hbm_bandwidth"),
              ("peak_flops_f32", "flops_efficiency", "memory_efficiency", "kernel_overhead",
               "receive_overhead", "fresh_page_time", "transposed_dot_efficiency",
               "collective_overhead", "host_bandwidth"))
        kinds[kind] = c.build(DeviceSpec, path, kind=kind, **spec)

    devices: list[Device] = []
    device_paths: list[tuple[int, int]] = []  # device id -> (region index, node index)
    regions: list[str] = []
    hierarchy = c.array(devs["hierarchy"], "devices.hierarchy")
    for r, region_obj in enumerate(hierarchy):
        rpath = f"devices.hierarchy[{r}]"
        c.obj(region_obj, rpath, ("region", "nodes"))
        region = c.string(region_obj["region"], f"{rpath}.region")
        if region in regions:  # the list form's own rule: the device order cannot show it
            c.fail(f"{rpath}.region={region!r} is listed twice; merge its nodes into one entry.")
        regions.append(region)
        in_region: set[str] = set()
        for n, node_obj in enumerate(c.array(region_obj["nodes"], f"{rpath}.nodes")):
            npath = f"{rpath}.nodes[{n}]"
            c.obj(node_obj, npath, ("name", "kind", "count"))
            node = c.string(node_obj["name"], f"{npath}.name")
            if node in in_region:  # the list form's own rule (a, a would read as one node)
                c.fail(f"{npath}.name={node!r} is listed twice in region {region!r}; node names "
                       "must be unique.")
            in_region.add(node)
            kind = c.string(node_obj["kind"], f"{npath}.kind")
            if kind not in kinds:
                c.fail(
                    f"{npath}.kind={kind!r} is not a known device kind; add it under devices.kinds "
                    f"or use one of {sorted(kinds)!r}."
                )
            count = c.positive_int(node_obj["count"], f"{npath}.count")
            first = len(devices)
            for i in range(count):
                devices.append(c.build(Device, npath, id=first + i, spec=kinds[kind],
                                       region=region, node=node))
                device_paths.append((r, n))

    # levels, links
    levels_obj = top.get("levels", {})
    c.obj(levels_obj, "levels", (), _LEVELS)
    levels = {
        level: c.link(levels_obj[level], f"levels.{level}")
        for level in _LEVELS
        if level in levels_obj
    }
    pairs: list[PairLink] = []
    for i, entry in enumerate(c.array(top.get("links", []), "links", nonempty=False)):
        path = f"links[{i}]"
        c.obj(entry, path, ("between", "bandwidth", "latency"))
        link = c.link({"bandwidth": entry["bandwidth"], "latency": entry["latency"]}, path)
        between = entry["between"]
        if not isinstance(between, list):
            c.fail(f"{path}.between must be a JSON array of two names, got between={between!r}.")
        pairs.append(c.build(PairLink, path, between=tuple(between), link=link))

    # mesh
    mesh = c.obj(top["mesh"], "mesh", ("axis_names", "shape"), ("axis_links",))
    axis_names = tuple(c.array(mesh["axis_names"], "mesh.axis_names"))
    shape = tuple(c.array(mesh["shape"], "mesh.shape"))
    axis_links = None
    if "axis_links" in mesh:
        raw = c.array(mesh["axis_links"], "mesh.axis_links")
        axis_links = tuple(c.link(x, f"mesh.axis_links[{i}]") for i, x in enumerate(raw))

    kwargs: dict[str, Any] = dict(
        name=name,
        devices=tuple(devices),
        axis_names=axis_names,
        shape=shape,
        links=tuple(pairs),
        axis_links=axis_links,
    )
    for level, link in levels.items():
        kwargs[_LEVEL_FIELDS[level]] = link

    def locate(error: InvalidTopologyError) -> InvalidTopologyError:
        return InvalidTopologyError(c.prefix + _json_words(str(error), device_paths),
                                    where=error.where)

    return kwargs, locate


_DEVICE_FIELD = {"node": "nodes[{n}].name", "region": "region", "spec": "nodes[{n}].kind"}
_TOPOLOGY_WORDS = [
    (re.compile(r"Topology\.(node|region|wan)_link \(levels\.\w+\)"), r"levels.\1"),
    (re.compile(r"Topology\.(shape|axis_names|axis_links)"), r"mesh.\1"),
    (re.compile(r"Topology\.links\["), "links["),
    (re.compile(r"Topology\.name"), "name"),
]


def _json_words(message: str, device_paths: list[tuple[int, int]]) -> str:
    """A ``Topology`` constructor message with its field names as JSON paths."""

    def device(m: re.Match) -> str:
        r, n = device_paths[int(m.group(1))]
        field = m.group(2)
        where = _DEVICE_FIELD[field].format(n=n) if field else f"nodes[{n}]"
        return f"devices.hierarchy[{r}].{where}"

    message = re.sub(r"Topology\.devices\[(\d+)\](?:\.(node|region|spec))?", device, message)
    message = message.replace("Topology.devices", "devices.hierarchy")
    for pattern, words in _TOPOLOGY_WORDS:
        message = pattern.sub(words, message)
    return message


def _link_dict(link: LinkSpec) -> dict[str, float]:
    return {"bandwidth": link.bandwidth, "latency": link.latency}


def to_dict(topo: Any) -> dict[str, Any]:
    """The JSON form of ``topo`` (plain dicts, lists, strings and numbers).

    Every device kind used is written out in ``devices.kinds``, so a file does not depend on the
    ``DEVICE_SPECS`` of the hulkjax that reads it.

    >>> from hulkjax.topology import Topology
    >>> to_dict(Topology.preset("dgx-h100"))["devices"]["hierarchy"]
    [{'region': 'local', 'nodes': [{'name': 'node0', 'kind': 'H100', 'count': 8}]}]
    """
    kinds: dict[str, dict[str, float]] = {}
    hierarchy: list[dict[str, Any]] = []
    for dev in topo.devices:
        spec = dev.spec
        kinds.setdefault(
            spec.kind,
            {
                "peak_flops": spec.peak_flops,
                "memory": spec.memory,
                "hbm_bandwidth": spec.hbm_bandwidth,
                **({} if spec.peak_flops_f32 is None else {"peak_flops_f32": spec.peak_flops_f32}),
                **({} if spec.host_bandwidth is None else {"host_bandwidth": spec.host_bandwidth}),
                **spec.calibration,
            },
        )
        if not hierarchy or hierarchy[-1]["region"] != dev.region:
            hierarchy.append({"region": dev.region, "nodes": []})
        region_nodes = hierarchy[-1]["nodes"]
        if not region_nodes or region_nodes[-1]["name"] != dev.node:
            region_nodes.append({"name": dev.node, "kind": spec.kind, "count": 0})
        region_nodes[-1]["count"] += 1
    levels = {
        level: _link_dict(getattr(topo, attr))
        for level, attr in _LEVEL_FIELDS.items()
        if getattr(topo, attr) is not None
    }
    mesh: dict[str, Any] = {"axis_names": list(topo.axis_names), "shape": list(topo.shape)}
    if topo.axis_links is not None:
        mesh["axis_links"] = [_link_dict(link) for link in topo.axis_links]
    return {
        "version": SCHEMA_VERSION,
        "name": topo.name,
        "devices": {"kinds": kinds, "hierarchy": hierarchy},
        "levels": levels,
        "links": [{"between": list(p.between), **_link_dict(p.link)} for p in topo.links],
        "mesh": mesh,
    }
