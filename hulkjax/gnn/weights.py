"""The planner network's weights: where they ship, and loading them for planning.

``hulkjax train-gnn`` (:mod:`hulkjax.training`) writes ``<name>.msgpack`` (the parameters) and
``<name>.json`` (the network's size, the feature version and the training history); planning reads
them back here without building the flax module (no compilation).

>>> w = load()
>>> w is None or w.layers >= 1
True
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

WEIGHTS_DIR = os.path.join(os.path.dirname(__file__), "weights")
"""The weights shipped in the package."""

CONFIG = {"hidden": 64, "layers": 4, "features_version": 1}
"""The network's size and the feature version the shipped weights were trained with."""

GROUP_CONFIG = {"hidden": 64, "layers": 3, "unit_features": 11, "groups": [3, 4]}
"""The device-group head's size (:class:`hulkjax.training.model.GroupHead`), its unit features
(:data:`hulkjax.gnn.groups.UNIT_FEATURES`) and the counts of device groups it is trained on
(and proposes orders for); its weights are ``groups.msgpack``."""


@dataclass(frozen=True)
class Weights:
    """Trained parameters of the planner network.

    Attributes:
      hidden: the hidden width.  # int
      layers: message-passing layers.  # int
      params: the parameter tree (nested dicts of arrays).
      meta: the rest of ``<name>.json`` (feature version, training history).  # dict
    """

    hidden: int
    layers: int
    params: Any
    meta: dict


_loaded: dict = {}


def load(directory: str | None = None, name: str = "planner") -> Weights | None:
    """The weights in ``directory`` (default: the ones shipped in the package), or ``None`` if
    there are none. Loaded once per process."""
    from flax import serialization

    directory = directory or WEIGHTS_DIR
    key = (directory, name)
    if key in _loaded:
        return _loaded[key]
    path = os.path.join(directory, f"{name}.msgpack")
    if not os.path.exists(path):
        return None
    with open(os.path.join(directory, f"{name}.json")) as f:
        meta = json.load(f)
    with open(path, "rb") as f:
        params = serialization.msgpack_restore(f.read())
    _loaded[key] = Weights(hidden=meta["hidden"], layers=meta["layers"], params=params, meta=meta)
    return _loaded[key]


def history(directory: str | None = None, name: str = "planner") -> dict:
    """Training curves of the weights (``train_loss``, ``val_loss``, ...); ``{}`` without weights.

    >>> isinstance(history(), dict)
    True
    """
    path = os.path.join(directory or WEIGHTS_DIR, f"{name}.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f).get("history", {})
