"""Clusters: devices (compute, memory), their hierarchy (region > node > device), links, meshes.

Where this sits::

    errors | formatting  ->  topology (this package) | trace  ->  plan  ->  ...

>>> import hulkjax as hj
>>> hj.Topology.preset("dgx-h100", nodes=2).shape
(2, 8)
"""

from hulkjax.topology import presets as _presets  # noqa: F401  (registers the presets)
from hulkjax.topology.model import GROUP_LEVELS as GROUP_LEVELS
from hulkjax.topology.model import Topology as Topology
from hulkjax.topology.model import resolve as resolve
from hulkjax.topology.presets import register_preset as register_preset
from hulkjax.topology.specs import DEVICE_SPECS as DEVICE_SPECS
from hulkjax.topology.specs import Device as Device
from hulkjax.topology.specs import DeviceSpec as DeviceSpec
from hulkjax.topology.specs import LinkSpec as LinkSpec
from hulkjax.topology.specs import PairLink as PairLink
