"""Alpha-beta times of collectives over mesh axes, and what a layout change costs.

A collective over several axes runs hierarchically, one axis at a time: reduce-scatter over the
fast axes first (full data on fast links), all-reduce over the slowest on the reduced piece, then
all-gather back. Per axis, with ``n`` devices, bandwidth ``bw`` (bytes/s per device per direction)
and latency ``a``, a ring moves:

* all-reduce ``B`` bytes: ``2 (n-1)/n B / bw + 2 (n-1) a``
* reduce-scatter ``B`` (full operand) and all-gather ``B`` (full result): ``(n-1)/n B / bw + (n-1) a``
* all-to-all of a ``B``-byte block: ``(n-1)/n B / bw + (n-1) a``
* collective-permute of a ``B``-byte block (one exchange step): ``B / bw + a``

>>> from hulkjax.topology import Topology
>>> topo = Topology.grid((4,), ("x",), bandwidth=1e9, latency=0.0)
>>> collective_time("all-reduce", 4e9, ("x",), topo)   # 2 * 3/4 * 4 GB / 1 GB/s
{'x': 6.0}
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from hulkjax.plan.collectives import Comm
from hulkjax.plan.specs import Spec, dim_of, local_shape
from hulkjax.trace.graph import dtype_size


def _order(axes, topology, fast_first: bool):
    return sorted(axes, key=lambda a: topology.axis_bandwidth(a), reverse=fast_first)


def collective_time(kind: str, nbytes: float, axes, topology) -> dict[str, float]:
    """Seconds spent on each mesh axis by one collective (see the module docstring)."""
    out: dict[str, float] = {}
    axes = [a for a in axes if topology.axis_size(a) > 1]
    if not axes or nbytes <= 0:
        return out

    def ring(a, b, passes=1):
        n = topology.axis_size(a)
        return passes * ((n - 1) / n * b / topology.axis_bandwidth(a) + (n - 1) * topology.axis_latency(a))

    if kind == "all-reduce":
        order = _order(axes, topology, fast_first=True)
        b = nbytes
        for a in order[:-1]:
            out[a] = out.get(a, 0.0) + ring(a, b, passes=2)  # reduce-scatter + all-gather
            b /= topology.axis_size(a)
        out[order[-1]] = out.get(order[-1], 0.0) + ring(order[-1], b, passes=2)
    elif kind == "reduce-scatter":
        b = nbytes
        for a in _order(axes, topology, fast_first=True):
            out[a] = ring(a, b)
            b /= topology.axis_size(a)
    elif kind == "all-gather":
        total = 1
        for a in axes:
            total *= topology.axis_size(a)
        b = nbytes / total
        for a in _order(axes, topology, fast_first=False):  # slow links carry the small pieces
            b *= topology.axis_size(a)
            out[a] = ring(a, b)
    elif kind == "all-to-all":
        for a in axes:
            out[a] = ring(a, nbytes)
    elif kind == "collective-permute":  # one exchange step: every device sends its block once
        for a in axes:
            out[a] = nbytes / topology.axis_bandwidth(a) + topology.axis_latency(a)
    else:
        raise ValueError(f"unknown collective kind {kind!r}")
    return out


def axis_bytes(kind: str, nbytes: float, axes, topology) -> dict[str, float]:
    """Bytes each device sends over each axis's links for one collective (same ring model)."""
    out: dict[str, float] = {}
    axes = [a for a in axes if topology.axis_size(a) > 1]
    if kind == "all-reduce":
        order = _order(axes, topology, fast_first=True)
        b = nbytes
        for a in order:
            n = topology.axis_size(a)
            out[a] = 2 * (n - 1) / n * b
            b /= n
    elif kind == "reduce-scatter":
        b = nbytes
        for a in _order(axes, topology, fast_first=True):
            n = topology.axis_size(a)
            out[a] = (n - 1) / n * b
            b /= n
    elif kind == "all-gather":
        total = 1
        for a in axes:
            total *= topology.axis_size(a)
        b = nbytes / total
        for a in _order(axes, topology, fast_first=False):
            n = topology.axis_size(a)
            b *= n
            out[a] = (n - 1) / n * b
    elif kind == "collective-permute":
        for a in axes:
            out[a] = float(nbytes)
    else:
        for a in axes:
            n = topology.axis_size(a)
            out[a] = (n - 1) / n * nbytes
    return out


def reshard_comms(shape, dtype: str, src: Spec, dst: Spec, sizes: Mapping[str, int]) -> tuple[Comm, ...]:
    """Collectives that turn layout ``src`` into ``dst``.

    Per axis: on the same dimension in both, nothing; only in ``src``, an all-gather; only in
    ``dst``, a local slice (free); on different dimensions, an all-to-all.
    """
    if src == dst:
        return ()
    gather, a2a = [], []
    for a in {x for axes in src for x in axes}:
        i, j = dim_of(src, a), dim_of(dst, a)
        if j is None:
            gather.append(a)
        elif i != j:
            a2a.append(a)
    comms = []
    item = dtype_size(dtype)
    if a2a:
        nb = int(np.prod(local_shape(shape, src, sizes), dtype=np.int64)) * item
        comms.append(Comm("all-to-all", tuple(sorted(a2a)), nb))
    if gather:
        kept = tuple(tuple(a for a in axes if a not in gather) for axes in src)
        nb = int(np.prod(local_shape(shape, kept, sizes), dtype=np.int64)) * item
        comms.append(Comm("all-gather", tuple(sorted(gather)), nb))
    return tuple(comms)
